"""SGLang's n-gram corpus (SGLang 0.5.23, `--speculative-algorithm NGRAM`) built for CPU: the reference
tests/proposers/test_sglang_ngram.py drives as SGLang's worker does and compares the `sglang` n-gram
proposer (proposers/ngram/sglang.py) with, step by step. `make setup` runs it (`python -m tools.sglang_ngram`).

SGLang compiles its corpus at run time (sglang/kernels/ops/speculative/ngram_corpus.py: `load_jit` of
kernels/jit/csrc/ngram_corpus/{result,trie,suffix_automaton,ngram,ngram_corpus_ffi}.cpp) behind a
tvm-ffi object. Here the wheel is downloaded once (`pip download --no-deps`: it is a zip), the same
C++ files but the tvm-ffi glue are compiled with g++ into one shared library together with DRIVER,
a C entry point per method of that glue (ngram_corpus_ffi.cpp:44-131: insert, synchronize,
batch_match_stateful, erase_match_state, reset), and installed with the sources in
`.venv/share/sglang_ngram/`. `Corpus` calls it through ctypes. No GPU, no torch, no tvm-ffi; nothing is
downloaded when the library already loads."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from tools.reference_build import ensure_built

VERSION = "0.5.23"
SHARE = Path(sys.prefix) / "share" / "sglang_ngram"  # .venv/share/sglang_ngram
LIBRARY = SHARE / "libsglang_ngram.so"
SOURCES = "sglang/kernels/jit/csrc/ngram_corpus/"
COMPILED = ("result.cpp", "trie.cpp", "suffix_automaton.cpp", "ngram.cpp")  # ngram_corpus.py:228-237 less the ffi
SETUP_HINT = "run `make setup` (or `.venv/bin/python -m tools.sglang_ngram`) to build it"
MATCH_TYPES = {"BFS": 0, "PROB": 1}  # ngram_corpus.py:12

# ngram_corpus_ffi.cpp's methods as C functions; an exception becomes its message in `error`.
DRIVER = r"""
#include "ngram.h"
#include <cstring>
#include <exception>
using sglang::ngram::Ngram;
using sglang::ngram::Param;

static void say(const std::exception& e, char* error, int64_t size) { std::strncpy(error, e.what(), size - 1); }

extern "C" {
void* sgl_ngram_create(int64_t capacity, int64_t depth, int64_t min_breadth, int64_t max_breadth,
                       int64_t draft_token_num, int64_t match_type, char* error, int64_t size) {
  try {  // NgramCorpusObj's constructor (ngram_corpus_ffi.cpp:22-42)
    Param param;
    param.enable = true;
    param.enable_router_mode = false;
    param.max_trie_depth = depth;
    param.min_bfs_breadth = min_breadth;
    param.max_bfs_breadth = max_breadth;
    param.draft_token_num = draft_token_num;
    param.match_type = match_type == 0 ? "BFS" : "PROB";
    param.external_sam_budget = 0;
    param.external_corpus_max_tokens = 10000000;
    return new Ngram(capacity, param);
  } catch (const std::exception& e) { say(e, error, size); return nullptr; }
}
void sgl_ngram_destroy(void* h) { delete static_cast<Ngram*>(h); }
void sgl_ngram_insert(void* h, const int32_t* data, const int64_t* offs, int64_t batch) {
  std::vector<std::vector<int32_t>> tokens(batch);  // async_insert (ngram_corpus_ffi.cpp:44-54)
  for (int64_t i = 0; i < batch; ++i) tokens[i].assign(data + offs[i], data + offs[i + 1]);
  static_cast<Ngram*>(h)->asyncInsert(std::move(tokens));
}
void sgl_ngram_synchronize(void* h) { static_cast<Ngram*>(h)->synchronize(); }
int64_t sgl_ngram_match(void* h, const int64_t* sid, const int32_t* data, const int64_t* offs,
                        const int64_t* tlens, int64_t batch, int32_t* out_tok, uint8_t* out_mask,
                        int64_t out_size, char* error, int64_t size) {
  try {  // batch_match_stateful (ngram_corpus_ffi.cpp:56-79); returns the tokens written
    std::vector<int64_t> state_ids(sid, sid + batch);
    std::vector<std::vector<int32_t>> tokens(batch);
    std::vector<size_t> total_lens(batch);
    for (int64_t i = 0; i < batch; ++i) {
      tokens[i].assign(data + offs[i], data + offs[i + 1]);
      total_lens[i] = static_cast<size_t>(tlens[i]);
    }
    auto result = static_cast<Ngram*>(h)->batchMatch(state_ids, tokens, total_lens);
    if (static_cast<int64_t>(result.token.size()) > out_size) throw std::runtime_error("out_tokens buffer too small");
    std::memcpy(out_tok, result.token.data(), result.token.size() * sizeof(int32_t));
    std::memcpy(out_mask, result.mask.data(), result.mask.size());
    return result.token.size();
  } catch (const std::exception& e) { say(e, error, size); return -1; }
}
void sgl_ngram_erase(void* h, const int64_t* sid, int64_t n) {
  static_cast<Ngram*>(h)->eraseMatchState(std::vector<int64_t>(sid, sid + n));
}
void sgl_ngram_reset(void* h) { static_cast<Ngram*>(h)->reset(); }
}
"""


def _signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sgl_ngram_create.restype, lib.sgl_ngram_create.argtypes = p, [i64] * 6 + [ctypes.c_char_p, i64]
    lib.sgl_ngram_destroy.argtypes = lib.sgl_ngram_synchronize.argtypes = lib.sgl_ngram_reset.argtypes = [p]
    lib.sgl_ngram_insert.argtypes = [p, p, p, i64]
    lib.sgl_ngram_match.restype = i64
    lib.sgl_ngram_match.argtypes = [p, p, p, p, p, i64, p, p, i64, ctypes.c_char_p, i64]
    lib.sgl_ngram_erase.argtypes = [p, p, i64]
    return lib


def load_library() -> ctypes.CDLL:
    """The built library; ImportError when this tool has not built it."""
    if not LIBRARY.is_file():
        raise ImportError(f"SGLang {VERSION}'s n-gram corpus is not built in {SHARE}: {SETUP_HINT}")
    return _signatures(ctypes.CDLL(str(LIBRARY)))


def _csr(batch: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """ngram_corpus.py:15-23 `_to_csr`: the sequences end to end and their offsets."""
    flat = np.array([t for seq in batch for t in seq], dtype=np.int32)
    offsets = np.cumsum([0] + [len(seq) for seq in batch]).astype(np.int64)
    return flat, offsets


def _ptr(array: np.ndarray) -> int:
    return array.ctypes.data


class Corpus:
    """SGLang's NgramCorpus (srt/speculative/cpp_ngram/ngram_corpus.py) over the compiled C++, state ids
    given by the caller: `batch_put`, `synchronize`, `batch_get` (match_stateful), `erase`, `reset`."""

    def __init__(self, capacity, max_trie_depth, min_bfs_breadth, max_bfs_breadth, draft_token_num, match_type):
        self.lib, self.n = load_library(), draft_token_num
        error = ctypes.create_string_buffer(512)
        args = (capacity, max_trie_depth, min_bfs_breadth, max_bfs_breadth, draft_token_num, MATCH_TYPES[match_type])
        self.handle = self.lib.sgl_ngram_create(*args, error, 512)
        if not self.handle:
            raise ValueError(error.value.decode())

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.sgl_ngram_destroy(self.handle)
            self.handle = None

    def batch_put(self, batch: list[list[int]]) -> None:
        flat, offsets = _csr(batch)
        self.lib.sgl_ngram_insert(self.handle, _ptr(flat), _ptr(offsets), len(batch))

    def synchronize(self) -> None:
        self.lib.sgl_ngram_synchronize(self.handle)

    def batch_get(self, state_ids: list[int], batch: list[list[int]], total_lens: list[int]):
        """(tokens [B * n], mask [B * n * n]) as match_stateful returns them (ngram_corpus.py:277-298)."""
        flat, offsets = _csr(batch)
        ids, lens = np.array(state_ids, dtype=np.int64), np.array(total_lens, dtype=np.int64)
        tokens, mask = np.zeros(len(batch) * self.n, dtype=np.int32), np.zeros(len(batch) * self.n**2, dtype=np.uint8)
        error = ctypes.create_string_buffer(512)
        args = (_ptr(ids), _ptr(flat), _ptr(offsets), _ptr(lens), len(batch), _ptr(tokens), _ptr(mask), tokens.size)
        if self.lib.sgl_ngram_match(self.handle, *args, error, 512) < 0:
            raise ValueError(error.value.decode())
        return tokens.astype(np.int64), mask.astype(np.int64)

    def erase(self, state_ids: list[int]) -> None:
        ids = np.array(state_ids, dtype=np.int64)
        self.lib.sgl_ngram_erase(self.handle, _ptr(ids), len(ids))

    def reset(self) -> None:
        self.lib.sgl_ngram_reset(self.handle)


def library_loads() -> bool:
    """Whether the built library loads and matches, checked in a fresh interpreter."""
    code = "import tools.sglang_ngram as s; c = s.Corpus(64, 4, 1, 2, 4, 'BFS'); c.batch_put([[1, 2]]); c.synchronize()"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    return done.returncode == 0


def _download(tmp: Path) -> Path:
    """The wheel's ngram_corpus sources, unpacked under tmp/src."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={VERSION}", "-d", str(tmp)], check=True
    )
    [wheel] = tmp.glob(f"sglang-{VERSION}-*.whl")
    source = tmp / "src"
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith(SOURCES) and not name.endswith("/"):
                target = source / Path(name).name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    return source


def _build(source: Path) -> Path:
    (source / "driver.cpp").write_text(DRIVER)
    library = source / LIBRARY.name
    files = [source / name for name in (*COMPILED, "driver.cpp")]
    flags = ["-O2", "-std=c++20", "-shared", "-fPIC", "-pthread", f"-I{source}"]
    subprocess.run(["g++", *flags, *map(str, files), "-o", str(library)], check=True)
    return library


def _install(source: Path) -> None:
    """The library, SGLang's sources and the driver into SHARE, whole or not at all."""
    staging = SHARE.with_name(SHARE.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    shutil.rmtree(SHARE, ignore_errors=True)
    staging.rename(SHARE)


def build_reference() -> None:
    with tempfile.TemporaryDirectory(prefix="sglang_ngram_") as tmp:
        source = _download(Path(tmp))
        _build(source)
        _install(source)


def main() -> int:
    return ensure_built(library_loads, build_reference, f"SGLang {VERSION} n-gram corpus", SHARE)


if __name__ == "__main__":
    sys.exit(main())

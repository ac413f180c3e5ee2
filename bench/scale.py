"""Memory at 27B shapes and scoring cost against response length (issue 4), for `make bench`.

    .venv/bin/python bench/scale.py                 # both sections (~5.5 min on 2 quiet cores)
    .venv/bin/python bench/scale.py --quick         # smaller shapes and lengths (~1 min)
    .venv/bin/python bench/scale.py --skip length   # only the memory section

Prints a small table and writes bench/results/scale-<date>-<time>.json. bench/run.py imports
`bench_big_shapes`, `bench_length_scaling` and `scale_table` / `scale_rows`; each returns or
takes plain JSON-able dicts.

Sections
  big     Memory at real shapes. A stand-in target with a 27B model's widths (hidden 5120, vocab
          248320, 24 query / 4 key-value heads of 256, MLP 17408, untied; 5 decoder layers whose
          outputs are the 5 feature layers; random bf16 weights written straight to safetensors,
          7.9 GiB) and a drafter shaped like z-lab's Qwen3.5-27B DFlash (hidden 5120, 32 / 8 heads
          of 128, MLP 17408, block 16, mask token 248070; one layer, random bf16). `specreplay
          extract` (bf16, teacher-forced responses of 8192 and 2048 tokens, default
          --memory-budget) runs in one fresh process, then `specreplay score` (the CPU default,
          fp32; no DDTree) in another. Each child reports its own peak RSS (VmHWM, reset per
          phase) for every phase: load, target head, and per sample the forward, the lm_head
          windows and the shard write (extract) or the context pass and the anchor chunks
          (score); the parent also polls it and kills a child before the machine runs out of
          memory. The longer sample goes first, and the children run with a fixed glibc mmap
          threshold (CHILD_MALLOC_ENV), so the shorter sample's phases are not hidden by memory
          the longer one freed. Scoring all anchors at vocab 248320 costs ~38 GFLOP per anchor in
          the lm_head alone (~300 TFLOP for 8192 anchors, half an hour of this CPU), so each sample
          replays only its LAST anchors, one full anchor chunk (as --memory-budget sizes it) + 1:
          the longest contexts, the worst case for the attention working set; everything else is
          the real `run_score` path (target head, drafter, shard decoding, the context pass over
          all positions, parquet). Verdicts: the working set of every phase whose size the budget
          sets stays within its share; the phases that are not budgeted (extract's forward,
          score's context pass, both with the sample's stored tensors resident) grow from the
          shorter to the longer sample by at most 1.5 x the stored tensors' growth + 256 MiB
          ("memory flat in T apart from the stored tensors").
          --quick: "mid" shapes (hidden 2048, vocab 65536), 4096 and 1024 tokens: checks the
          method in seconds, not the 27B claim.
  length  Scoring cost against response length at SmolLM2 shapes (hidden 576, vocab 49152, 5
          feature layers): synthetic shards (random bf16 features and top-k, one sample per
          length 512..8192, written with ShardWriter and a manifest like extract's), a random
          one-layer drafter, block 16, all-anchor chain replay (no DDTree, fp32) in this process,
          after a warm-up. Per sample: the context pass and the anchor chunks timed apart (the
          checkpoint load and shard decoding are outside the timers), with the time inside the
          drafter's attention, its other layer work and the lm_head. A sample with more than
          4 x 512 anchors replays 4 windows of 512 contiguous anchors centred at 1/8, 3/8, 5/8
          and 7/8 of its anchors and scales that time to all anchors (midpoint rule: the cost of
          an anchor is affine in its context length; checked against full replays, within 4%).
          Fitted exponent b of time = a T^b, least squares on log-log, over all lengths and over
          the longer half, next to the exponent of the FLOP count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "bench") not in sys.path:  # bench/common.py, also when imported as bench.scale
    sys.path.insert(0, str(ROOT / "bench"))
if str(ROOT) not in sys.path:  # `python bench/scale.py` puts bench/ first, not the repo root
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common import Timers, current_rss, finish_run, fmt_mib, log, peak_rss, reset_peak, start_run  # noqa: E402,F401  (bench/common.py)
MiB = 1 << 20
GiB = 1 << 30

# Stand-in target and drafter of the memory section. "27b": a 27B target's widths (Qwen3.5/3.6-27B:
# hidden 5120, vocab 248320, 24 q / 4 kv heads of 256, MLP 17408; SPEC §5) with only as many
# decoder layers as there are feature layers, and z-lab's Qwen3.5-27B DFlash drafter shapes with
# one layer instead of five. "mid" (--quick): the same structure at ~1/8 of the bytes, so the
# section runs in seconds; its figures check the method, not the 27B claim.
SHAPES = {
    "27b": {"target": dict(hidden_size=5120, vocab_size=248320, intermediate_size=17408, num_hidden_layers=5,
                           num_attention_heads=24, num_key_value_heads=4, head_dim=256),
            "drafter": dict(num_layers=1, block_size=16, num_heads=32, kv_heads=8, head_dim=128,
                            intermediate_size=17408, mask_token_id=248070),
            "lengths": [8192, 2048]},
    "mid": {"target": dict(hidden_size=2048, vocab_size=65536, intermediate_size=6144, num_hidden_layers=5,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=128),
            "drafter": dict(num_layers=1, block_size=16, num_heads=16, kv_heads=4, head_dim=128,
                            intermediate_size=6144, mask_token_id=65000),
            "lengths": [4096, 1024]},
}
BIG_LAYER_IDS = [0, 1, 2, 3, 4]
BIG_PROMPT_TOKENS = 16
BIG_TOP_K = 32
# SmolLM2-135M shapes for the length section (30 layers, hidden 576, vocab 49152).
SMALL_TARGET = dict(hidden_size=576, vocab_size=49152, num_layers=30)
SMALL_PROMPT_TOKENS = 32
BLOCK_SIZE = 16

FLAT_FACTOR = 1.5  # RSS growth allowed per byte of stored-tensor growth
FLAT_SLACK = 256 * MiB  # plus this constant
PEAK_LIMIT = 16 * GiB  # a child above this is a memory problem (the machine has 23-24 GiB)
KEEP_AVAILABLE = 1536 * MiB  # kill a child when the machine's MemAvailable drops below this
EOS_ID = 1  # the stand-in tokenizer's <|im_end|>
# The children hold two samples one after the other. glibc's default mmap threshold rises to
# 32 MiB after large frees, so blocks freed by the longer sample's phases would stay in the heap
# and be reused by the shorter one, hiding its own working set; a fixed threshold returns every
# block over 128 KiB to the kernel when freed, so each phase's peak is its own.
CHILD_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
# Disk the memory section writes (stand-in weights, target head, shards), by shapes.
DISK_NEEDED = {"27b": 16 * GiB, "mid": 3 * GiB}


# ---------------------------------------------------------------------------------------------
# /proc helpers


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class PhasePeaks:
    """Peak RSS and time per named phase of a child process.

    `wrap(name, fn)` makes each call of fn a phase (`name` may be a function of the call's
    arguments): the kernel's high-water mark is reset before the call and read after it. The
    time between phases is a gap, recorded as "other (before <next phase>)" unless `mark(label)`
    named it. Nested wrapped calls count for the outer phase."""

    def __init__(self):
        self.phases: dict[str, dict] = {}
        self.resettable = reset_peak()
        self.overall = peak_rss() or 0
        self.active: str | None = None
        self.gap_label: str | None = None
        self.gap_before: int | None = current_rss()
        self.baseline = self.gap_before  # the interpreter, torch and the stage's imports
        self.last_mark = time.perf_counter()

    def _record(self, name: str, seconds: float, peak: int, before: int | None, after: int | None) -> None:
        entry = self.phases.setdefault(name, {"seconds": 0.0, "calls": 0, "peak_rss_bytes": 0,
                                              "rss_before_bytes": before})
        entry["seconds"] += seconds
        entry["calls"] += 1
        entry["peak_rss_bytes"] = max(entry["peak_rss_bytes"], peak)
        entry["rss_after_bytes"] = after
        self.overall = max(self.overall, peak)

    def _close_gap(self, next_name: str) -> None:
        now = time.perf_counter()
        label = self.gap_label or f"other (before {next_name})"
        self._record(label, now - self.last_mark, peak_rss() or 0, self.gap_before, current_rss())
        reset_peak()
        self.gap_label, self.gap_before, self.last_mark = None, current_rss(), time.perf_counter()

    def mark(self, label: str) -> None:
        """End the current gap here; the next one is recorded as `label`."""
        if self.active is None:
            self._close_gap(label)
            self.gap_label = label

    def wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            if self.active is not None:
                return fn(*args, **kwargs)
            label = name(*args, **kwargs) if callable(name) else name
            self._close_gap(label)
            before, start = current_rss(), time.perf_counter()
            self.active = label
            try:
                return fn(*args, **kwargs)
            finally:
                self.active = None
                self._record(label, time.perf_counter() - start, peak_rss() or 0, before, current_rss())
                reset_peak()
                self.gap_before, self.last_mark = current_rss(), time.perf_counter()

        return wrapped

    def finish(self) -> dict:
        self._close_gap("exit")
        return {"peak_rss_bytes": self.overall, "phases": self.phases, "hwm_reset_works": self.resettable,
                "baseline_rss_bytes": self.baseline}


# ---------------------------------------------------------------------------------------------
# random weights written straight to safetensors (no 8.5 GB model in memory)

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def write_random_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.bfloat16,
                             std: float = 0.02, seed: int = 0) -> int:
    """Write a safetensors file holding `shapes`: 1-D tensors (norm weights) are ones, the rest
    N(0, std) values from one random block tiled over the tensor (the block length is prime, so
    no two rows of a matrix repeat each other exactly). Streams in 8 MiB writes; returns bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * item
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    generator = torch.Generator().manual_seed(seed)
    block_len = 4194301  # prime, ~8 MiB of bf16
    block = (torch.randn(block_len, generator=generator) * std).to(dtype).view(torch.uint8).numpy().tobytes()
    longest_1d = max([s[0] for s in shapes.values() if len(s) == 1] or [1])
    one = torch.ones(longest_1d, dtype=dtype).view(torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in shapes.items():
            size = int(np.prod(shape)) * item
            if len(shape) == 1:
                f.write(one[:size])
                continue
            # each tensor starts at its own place in the block, so no two tensors are equal
            # (extract would store an lm_head equal to the embedding as tied)
            start = (zlib.crc32(name.encode()) % block_len) * item
            view = memoryview(block)
            first = min(size, len(block) - start)
            f.write(view[start:start + first])
            size -= first
            while size > 0:
                n = min(size, len(block))
                f.write(view[:n])
                size -= n
    return 8 + len(blob) + offset


def _write_stand_in_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer with <|im_end|> (id 1) as eos and pad; prompts are given as ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_end|>": EOS_ID, "<unk>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                        unk_token="<unk>")
    tokenizer.save_pretrained(str(model_dir))


def build_stand_in_target(model_dir: Path, shape: dict) -> dict:
    """The stand-in target: config.json, generation_config.json, tokenizer and
    model.safetensors (random bf16). Returns its parameter counts."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    model_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6,
                         eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=None, dtype="bfloat16",
                         rope_parameters={"rope_type": "default", "rope_theta": 1e7})
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(str(model_dir))
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False).save_pretrained(str(model_dir))
    _write_stand_in_tokenizer(model_dir)
    size = write_random_safetensors(model_dir / "model.safetensors", shapes, torch.bfloat16)
    count = lambda names: sum(int(np.prod(shapes[n])) for n in names)  # noqa: E731
    return {"params": count(shapes), "embed_params": count(["model.embed_tokens.weight"]),
            "lm_head_params": count(["lm_head.weight"]),
            "layer_params": count([n for n in shapes if n.startswith("model.layers.")]),
            "file_bytes": size, "config": {**shape, "tie_word_embeddings": False, "dtype": "bfloat16"}}


def build_stand_in_drafter(ckpt_dir: Path, target: dict, shape: dict) -> dict:
    """A z-lab-format drafter (config.json + model.safetensors, random bf16) for the stand-in."""
    from scoring.drafter import DFlashDrafter, parse_drafter_config
    from scoring.fit import new_drafter_config

    facts = {"hidden_size": target["hidden_size"], "num_layers": target["num_hidden_layers"],
             "vocab_size": target["vocab_size"]}
    raw = new_drafter_config(facts, num_layers=shape["num_layers"], block_size=shape["block_size"],
                             layer_ids=BIG_LAYER_IDS, mask_token_id=shape["mask_token_id"],
                             num_heads=shape["num_heads"], intermediate_size=shape["intermediate_size"])
    raw.update(num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], rope_theta=1e7,
               torch_dtype="bfloat16")
    config = parse_drafter_config(raw, "bench drafter")
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    shapes = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "config.json").write_text(json.dumps(raw, indent=1))
    size = write_random_safetensors(ckpt_dir / "model.safetensors", shapes, torch.bfloat16, seed=1)
    return {"params": sum(int(np.prod(s)) for s in shapes.values()), "file_bytes": size,
            "config": {k: raw[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "intermediate_size", "block_size")}}


def stored_bytes_per_token(hidden: int, layers: int, feature_item: int, top_k: int) -> int:
    """Raw bytes of one token's stored tensors: features, top-k ids + log-probs, mismatch flag."""
    return layers * hidden * feature_item + top_k * (4 + 4) + 1


# ---------------------------------------------------------------------------------------------
# child processes (fresh interpreter, own peak RSS)


class ChildFailed(RuntimeError):
    """A measured child process failed or was killed (its stderr tail is in the message)."""


def run_child(kind: str, payload: dict, work: Path, timeout_s: float = 900) -> dict:
    """Run `bench/scale.py --child KIND PAYLOAD RESULT` and return its result dict with
    `parent_polled_peak_rss_bytes` and `wall_s_incl_startup` added. The parent polls the child's
    VmHWM every 50 ms and kills it when the machine's available memory runs low."""
    result_path = work / f"child-{kind}-{payload.get('label', 'x')}.json"
    err_path = result_path.with_suffix(".err")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(payload), str(result_path)]
    env = {**os.environ, **CHILD_MALLOC_ENV, "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    polled, killed = 0, None
    with open(err_path, "w") as err, subprocess.Popen(cmd, cwd=str(ROOT), stdout=err, stderr=err, env=env) as child:
        while child.poll() is None:
            try:
                with open(f"/proc/{child.pid}/cmdline", "rb") as f:
                    execed = b"--child" in f.read()  # before exec the forked child shares our pages
            except OSError:
                execed = False
            if execed:
                polled = max(polled, peak_rss(child.pid) or 0)
            available = mem_available()
            if available is not None and available < KEEP_AVAILABLE and killed is None:
                killed = f"killed: machine MemAvailable {available / MiB:.0f} MiB, child peak {polled / MiB:.0f} MiB"
                child.kill()
            if time.perf_counter() - start > timeout_s and killed is None:
                killed = f"killed after {timeout_s:.0f} s"
                child.kill()
            time.sleep(0.05)
    wall = time.perf_counter() - start
    if child.returncode != 0 or not result_path.exists():
        tail = err_path.read_text()[-3000:] if err_path.exists() else ""
        raise ChildFailed(f"bench child {kind} ({payload.get('label')}) failed"
                           f"{' (' + killed + ')' if killed else ''}, rc {child.returncode}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["parent_polled_peak_rss_bytes"] = polled or None
    result["wall_s_incl_startup"] = wall
    return result


def tag(tokens: int) -> str:
    return f"T={tokens}"


def child_extract(payload: dict) -> dict:
    """`run_extract` exactly as `specreplay extract` runs it, with phase peaks; per sample:
    the forward (+ feature copy), the lm_head windows (top-k) and the shard write."""
    from pipeline import capture, extract, shards

    phases = PhasePeaks()
    extract.load_model_once = phases.wrap("load target", extract.load_model_once)
    shards.save_target_head = phases.wrap("store target head", shards.save_target_head)
    real_capture = capture.capture_sample
    distribution = phases.wrap(lambda hidden, head, config, lo, targets, *a, **k: f"lm_head + top-k, "
                               f"{tag(int(targets.numel()))}", capture.next_token_distribution)

    def capture_sample(model, input_ids, prompt_len, config):
        phases.mark(f"forward + features, {tag(len(input_ids) - prompt_len)}")
        return real_capture(model, input_ids, prompt_len, config)

    capture.capture_sample = capture_sample
    capture.next_token_distribution = distribution
    shards.ShardWriter.write = phases.wrap(lambda self, sample: f"write shards, {tag(sample.response_len)}",
                                           shards.ShardWriter.write)
    shards.ShardWriter.close = phases.wrap("write shards, close", shards.ShardWriter.close)
    start = time.perf_counter()
    config = extract.ExtractConfig(model=payload["model"], prompts=payload["prompts"], out=payload["out"],
                                   dtype="bf16", layer_ids=payload["layer_ids"], top_k=payload["top_k"],
                                   quiet=True, overwrite=True, device="cpu")
    if payload.get("memory_budget"):
        config.memory_budget = int(payload["memory_budget"])
    manifest = extract.run_extract(config)
    wall = time.perf_counter() - start
    return {**phases.finish(), "run_s": wall, "memory_budget": config.memory_budget,
            "totals": manifest["totals"], "target_head_bytes": manifest["target_head"]["bytes"],
            "shard_bytes_by_sample": _shard_bytes_by_sample(manifest)}


def _shard_bytes_by_sample(manifest: dict) -> dict:
    """Compressed bytes of each record batch, by the sample it holds (one sample per batch here)."""
    out = {}
    for entry in manifest["shards"]:
        ids = list(entry["sample_ids"])
        for batch in entry["batches"]:
            rows = batch[2]
            names, ids = ids[:rows], ids[rows:]
            out[",".join(names)] = batch[1]
    return out


def child_score(payload: dict) -> dict:
    """`run_score` exactly as `specreplay score` runs it (no DDTree), except that each sample
    replays only its last anchors (see the module docstring), with phase peaks."""
    import scoring.replay as replay
    import scoring.score as score
    from pipeline.shards import ShardSet

    phases = PhasePeaks()
    ShardSet.target_head = phases.wrap("read target head", ShardSet.target_head)
    casts = []

    def cast_label(*args, **kwargs):
        casts.append(1)
        return "cast target head" if len(casts) == 1 else "cast target head (again: a no-op)"

    score.prepare_target_head = phases.wrap(cast_label, score.prepare_target_head)
    score.load_drafter = phases.wrap("load drafter", score.load_drafter)
    pack = phases.wrap(lambda d, samples, *a: f"context keys/values, {tag(samples[0].response_len)}",
                       replay.pack_samples)
    chunks = {}

    def bounded_replay_sample(drafter, embed, lm_head, sample, feature_columns, budget_tokens, options):
        # replay.replay_sample restricted to the last anchors: one full anchor chunk as
        # --memory-budget sizes it at this context length, plus one anchor
        result = replay.empty_anchor_tensors(sample, budget_tokens, drafter.config.block_size)
        count = result.anchors.numel()
        if count:
            packed = pack(drafter, [sample], feature_columns, options)
            chunk = replay.anchors_per_chunk(drafter, drafter.config.block_size, sample.input_ids.numel(),
                                             lm_head.shape[0], options.memory_bytes)
            last = min(count, chunk + 1)
            chunks[tag(sample.response_len)] = {"anchors_per_chunk": chunk, "anchors": last}
            phases.wrap(f"replay the last {last} anchors, {tag(sample.response_len)}", replay.replay_anchors)(
                drafter, embed, lm_head, packed, [result], [(0, r) for r in range(count - last, count)], options)
        return result

    score.replay_sample = bounded_replay_sample
    start = time.perf_counter()
    config = score.ScoreConfig(ckpts=[payload["ckpt"]], shards=payload["shards"], out=payload["out"],
                               ddtree_budgets=[], quiet=True, force=True)
    if payload.get("memory_budget"):
        config.memory_budget = int(payload["memory_budget"])
    records = score.run_score(config)
    wall = time.perf_counter() - start
    return {**phases.finish(), "run_s": wall, "memory_budget": config.memory_budget, "dtype": records[0]["dtype"],
            "anchors_scored": records[0]["anchors"], "chunks": chunks}


def child_main(kind: str, payload_json: str, result_path: str) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    payload = json.loads(payload_json)
    torch.set_num_threads(int(payload.get("threads") or torch.get_num_threads()))
    result = {"extract": child_extract, "score": child_score}[kind](payload)
    result["threads"] = torch.get_num_threads()
    Path(result_path).write_text(json.dumps(result, indent=1, default=str))
    return 0


# ---------------------------------------------------------------------------------------------
# section: memory at 27B shapes


def _write_long_prompts(path: Path, lengths: list[int], vocab: int, seed: int = 0) -> None:
    """One record per length, in the order given: a short prompt and a teacher-forced response."""
    rng = np.random.default_rng(seed)
    lines = []
    for length in lengths:
        prompt = rng.integers(3, 29, BIG_PROMPT_TOKENS).tolist()  # ids the stand-in tokenizer decodes
        response = rng.integers(3, vocab, length)
        lines.append(json.dumps({"id": f"long-{length}", "input_ids": prompt, "response": response.tolist()}))
    path.write_text("\n".join(lines) + "\n")


def _phase_table(phases: dict) -> dict:
    return {name: {"seconds": round(p["seconds"], 2), "peak_rss_bytes": p["peak_rss_bytes"],
                   "rss_before_bytes": p.get("rss_before_bytes"), "rss_after_bytes": p.get("rss_after_bytes")}
            for name, p in phases.items()}


def _per_length(phases: dict, lengths: list[int], flat: tuple[str, ...], budgeted: dict[str, int]) -> dict:
    """Per sample length: the highest peak of the phases that must be flat apart from the stored
    tensors (names starting with one of `flat`), and the working set (peak - RSS at its start) of
    each phase whose size the memory budget sets (`budgeted`: name prefix -> its share, bytes)."""
    out = {}
    for t in lengths:
        mine = {n: p for n, p in phases.items() if n.endswith(tag(t)) or n.endswith(tag(t) + ")")}
        flat_peak = max((p["peak_rss_bytes"] for n, p in mine.items() if n.startswith(flat)), default=0)
        working = {}
        for n, p in mine.items():
            share = next((v for k, v in budgeted.items() if n.startswith(k)), None)
            if share is not None:
                size = p["peak_rss_bytes"] - (p.get("rss_before_bytes") or 0)
                working[n] = {"bytes": size, "budget_share_bytes": share, "within": size <= share}
        out[t] = {"peak_rss_bytes": max((p["peak_rss_bytes"] for p in mine.values()), default=0),
                  "flat_phases_peak_rss_bytes": flat_peak, "budgeted_working_sets": working}
    return out


def _flat_verdict(peaks: dict[int, int], stored_per_token: int, phases: str) -> dict:
    lengths = sorted(peaks)
    t1, t2 = lengths[0], lengths[-1]
    growth = peaks[t2] - peaks[t1]
    stored = (t2 - t1) * stored_per_token
    allowed = FLAT_FACTOR * stored + FLAT_SLACK
    return {"phases": phases, "from_tokens": t1, "to_tokens": t2, "peak_rss_bytes": {str(t): peaks[t] for t in lengths},
            "rss_growth_bytes": growth, "stored_growth_bytes": stored,
            "growth_over_stored": growth / stored if stored else None, "allowed_bytes": allowed,
            "flat_apart_from_stored": growth <= allowed}


def _highest(phases: dict) -> dict:
    name, phase = max(phases.items(), key=lambda kv: kv[1]["peak_rss_bytes"])
    return {"phase": name, "peak_rss_bytes": phase["peak_rss_bytes"]}


def bench_big_shapes(work_dir: Path, quick: bool) -> dict:
    """Extract, then score, long responses at 27B shapes (quick: "mid" shapes), each stage in
    one fresh process holding both lengths (the longer first); peak RSS per phase, stored bytes,
    the breakdown of the peaks and the flatness verdict per stage."""
    work = Path(work_dir) / "big"
    work.mkdir(parents=True, exist_ok=True)
    shape_name = "mid" if quick else "27b"
    shape = SHAPES[shape_name]
    target_shape = shape["target"]
    lengths = list(shape["lengths"])
    threads = torch.get_num_threads()
    result: dict = {"shapes": shape_name, "lengths": sorted(lengths), "layer_ids": BIG_LAYER_IDS,
                    "prompt_tokens": BIG_PROMPT_TOKENS, "top_k": BIG_TOP_K, "threads": threads,
                    "score_anchors": "per sample, its last anchors: one full anchor chunk + 1",
                    "peak_limit_bytes": PEAK_LIMIT,
                    "machine_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    disk_needed = DISK_NEEDED[shape_name]
    free = shutil.disk_usage(work).free
    if free < disk_needed:
        result["skipped"] = f"needs {disk_needed / GiB:.0f} GiB free disk under {work}, has {free / GiB:.1f} GiB"
        log(f"big: skipped: {result['skipped']}")
        shutil.rmtree(work, ignore_errors=True)
        return result
    try:
        log(f"big: writing the stand-in target ({shape_name} shapes: hidden {target_shape['hidden_size']}, vocab "
            f"{target_shape['vocab_size']}, {target_shape['num_hidden_layers']} layers, random bf16) and drafter ...")
        start = time.perf_counter()
        result["target"] = build_stand_in_target(work / "target", target_shape)
        result["drafter"] = build_stand_in_drafter(work / "drafter", target_shape, shape["drafter"])
        result["build_s"] = time.perf_counter() - start
        log(f"big:   target {result['target']['params'] / 1e9:.2f}B params ({result['target']['file_bytes'] / GiB:.1f} "
            f"GiB), drafter {result['drafter']['params'] / 1e6:.0f}M params, {result['build_s']:.0f} s")
        per_token = stored_bytes_per_token(target_shape["hidden_size"], len(BIG_LAYER_IDS), 2, BIG_TOP_K)
        result["stored_bytes_per_token_raw"] = per_token
        prompts = work / "prompts.jsonl"
        _write_long_prompts(prompts, lengths, target_shape["vocab_size"])
        shards_dir = work / "shards"
        log(f"big: specreplay extract, bf16, teacher-forced responses of {lengths} tokens (one fresh process) ...")
        ex = run_child("extract", {"label": "all", "model": str(work / "target"), "prompts": str(prompts),
                                   "out": str(shards_dir), "layer_ids": BIG_LAYER_IDS, "top_k": BIG_TOP_K,
                                   "threads": threads}, work)
        result["extract"] = _summarize_extract(ex, result, lengths, per_token)
        log(f"big:   peak RSS {fmt_mib(result['extract']['peak_rss_bytes'])} ({result['extract']['highest']['phase']}), "
            f"{ex['run_s']:.0f} s, shards {ex['totals']['bytes'] / MiB:.0f} MiB")
        log(f"big: specreplay score, the last anchor chunk of each sample (one fresh process) ...")
        sc = run_child("score", {"label": "all", "ckpt": str(work / "drafter"), "shards": str(shards_dir),
                                 "out": str(work / "results"), "threads": threads}, work)
        result["score"] = _summarize_score(sc, result, lengths, per_token)
        log(f"big:   peak RSS {fmt_mib(result['score']['peak_rss_bytes'])} ({result['score']['highest']['phase']}), "
            f"{sc['run_s']:.0f} s ({sc['dtype']})")
        result["peak_rss_bytes"] = max(result["extract"]["peak_rss_bytes"], result["score"]["peak_rss_bytes"])
        result["under_peak_limit"] = result["peak_rss_bytes"] <= PEAK_LIMIT
    except ChildFailed as error:  # e.g. killed before the machine ran out of memory: a result, not a crash
        result["error"] = str(error)
        log(f"big: {error}")
    finally:
        shutil.rmtree(work, ignore_errors=True)  # ~8 GiB of stand-in weights and 5 GiB of target head
    return result


def _summarize_extract(ex: dict, result: dict, lengths: list[int], per_token: int) -> dict:
    target = result["target"]
    weights = target["params"] * 2
    peak = max(ex["peak_rss_bytes"], ex.get("parent_polled_peak_rss_bytes") or 0)
    budget = ex["memory_budget"]
    by_length = _per_length(ex["phases"], lengths, ("forward + features",),
                            {"lm_head + top-k": budget // 2, "write shards": budget // 2})
    per_length = {}
    for t in sorted(lengths):
        stored = (t + BIG_PROMPT_TOKENS) * per_token
        flat = by_length[t]["flat_phases_peak_rss_bytes"]
        per_length[str(t)] = {**by_length[t], "stored_tensors_bytes": stored, "forward_rest_bytes": flat - ex["baseline_rss_bytes"] - weights - stored,
                              "shard_bytes": ex["shard_bytes_by_sample"].get(f"long-{t}")}
    return {"peak_rss_bytes": peak, "highest": _highest(ex["phases"]), "wall_s": ex["run_s"],
            "wall_s_incl_startup": ex["wall_s_incl_startup"], "shard_bytes": ex["totals"]["bytes"],
            "target_head_bytes": ex["target_head_bytes"], "tokens": ex["totals"]["tokens"],
            "memory_budget": ex["memory_budget"], "weights_bytes": weights, "baseline_rss_bytes": ex["baseline_rss_bytes"],
            "embed_lm_head_bytes": (target["embed_params"] + target["lm_head_params"]) * 2,
            "layers_bytes": target["layer_params"] * 2, "per_length": per_length,
            "flat": _flat_verdict({t: v["flat_phases_peak_rss_bytes"] for t, v in by_length.items()}, per_token,
                                  "the forward (+ features)"),
            "budgeted_within": all(w["within"] for v in by_length.values() for w in v["budgeted_working_sets"].values()),
            "phases": _phase_table(ex["phases"]), "hwm_reset_works": ex["hwm_reset_works"]}


def _summarize_score(sc: dict, result: dict, lengths: list[int], per_token: int) -> dict:
    target = result["target"]
    compute_item = 4 if sc["dtype"] == "float32" else 2
    lm_head = target["lm_head_params"] * compute_item
    embed = target["embed_params"] * min(2, compute_item)  # kept in the narrower dtype
    drafter = result["drafter"]["params"] * compute_item
    fixed = lm_head + embed + drafter
    peak = max(sc["peak_rss_bytes"], sc.get("parent_polled_peak_rss_bytes") or 0)
    by_length = _per_length(sc["phases"], lengths, ("context keys/values",), {"replay the last": sc["memory_budget"]})
    per_length = {}
    for t in sorted(lengths):
        stored = (t + BIG_PROMPT_TOKENS) * per_token
        flat = by_length[t]["flat_phases_peak_rss_bytes"]
        gap = sc["phases"].get(f"other (before context keys/values, {tag(t)})", {})
        per_length[str(t)] = {**by_length[t], "stored_tensors_bytes": stored, "context_rest_bytes": flat - sc["baseline_rss_bytes"] - fixed - stored,
                              "before_context_peak_rss_bytes": gap.get("peak_rss_bytes"), **sc["chunks"].get(tag(t), {})}
    return {"peak_rss_bytes": peak, "highest": _highest(sc["phases"]), "wall_s": sc["run_s"],
            "wall_s_incl_startup": sc["wall_s_incl_startup"], "dtype": sc["dtype"],
            "anchors_scored": sc["anchors_scored"], "memory_budget": sc["memory_budget"],
            "baseline_rss_bytes": sc["baseline_rss_bytes"],
            "lm_head_bytes": lm_head, "embed_bytes": embed, "drafter_bytes": drafter, "per_length": per_length,
            "flat": _flat_verdict({t: v["flat_phases_peak_rss_bytes"] for t, v in by_length.items()}, per_token,
                                  "the context keys/values pass (sample resident)"),
            "budgeted_within": all(w["within"] for v in by_length.values() for w in v["budgeted_working_sets"].values()),
            "phases": _phase_table(sc["phases"]), "hwm_reset_works": sc["hwm_reset_works"]}


# ---------------------------------------------------------------------------------------------
# section: scoring cost against response length


def write_synthetic_shards(out: Path, lengths: list[int], hidden: int, vocab: int, num_layers: int,
                           layer_ids: list[int], top_k: int = 32, prompt_tokens: int = SMALL_PROMPT_TOKENS,
                           seed: int = 0) -> None:
    """A shard directory `score` accepts: one sample per length (random bf16 features, top-k,
    tokens; given responses), a random bf16 target head, and a manifest with the fields
    pipeline/extract.py writes (settings identity, tensors, target, target_head, shards, totals)."""
    from pipeline import shards

    generator = torch.Generator().manual_seed(seed)
    dtypes = {"features": "bfloat16", "topk_ids": "int32", "topk_logprobs": "float32", "argmax_mismatch": "uint8"}
    writer = shards.ShardWriter(str(out), 0, dtypes)
    for length in lengths:
        total = prompt_tokens + length
        ids = torch.randint(3, vocab, (total,), generator=generator)
        logprobs = -torch.rand(length + 1, top_k, generator=generator).mul(8).sort(dim=-1).values
        writer.write(shards.Sample(
            sample_id=f"len-{length}", dataset="synthetic", prompt_text="", input_ids=ids, prompt_len=prompt_tokens,
            finish_reason="given", greedy=False,
            tensors={"features": torch.randn(total, len(layer_ids) * hidden, generator=generator).to(torch.bfloat16),
                     "topk_ids": torch.randint(0, vocab, (length + 1, top_k), generator=generator, dtype=torch.int32),
                     "topk_logprobs": logprobs.contiguous(),
                     "argmax_mismatch": torch.zeros(length, dtype=torch.uint8)}))
    entries = writer.close()
    embed = (torch.randn(vocab, hidden, generator=generator) * 0.02).to(torch.bfloat16)
    lm_head = (torch.randn(vocab, hidden, generator=generator) * 0.02).to(torch.bfloat16)
    head_entry = shards.save_target_head(str(out), embed, lm_head)
    target = {"architecture": "synthetic", "num_layers": num_layers, "hidden_size": hidden, "vocab_size": vocab,
              "config_hash": "synthetic", "dtype": "bfloat16", "stop_token_ids": [EOS_ID], "pad_token_id": EOS_ID,
              "bos_token_id": None, "chat_template_hash": None, "weights_fingerprint": f"random-seed-{seed}"}
    prompts = {"hash": f"synthetic-{lengths}", "count": len(lengths), "rendered_hash": f"synthetic-{lengths}-{seed}"}
    settings = {"format_version": shards.FORMAT_VERSION, "target": target, "layer_ids": list(layer_ids),
                "feature_dtype": "bfloat16", "top_k": top_k, "store_logits": False, "store_last_hidden": False,
                "max_new_tokens": max(lengths), "enable_thinking": None, "decoding": "greedy", "prompts": prompts}
    tokens = sum(e["tokens"] for e in entries)
    shards.write_manifest(str(out), {
        "format_version": shards.FORMAT_VERSION, "complete": True, "settings": settings,
        "target": {**target, "name": "synthetic-smollm2-shapes", "path": ""}, "tensors": dtypes,
        "prompts": {"name": "synthetic", **prompts}, "target_head": head_entry, "shards": entries,
        "totals": {"samples": len(lengths), "tokens": tokens, "response_tokens": sum(lengths),
                   "bytes": sum(e["bytes"] for e in entries)},
    })


def _fit_exponent(lengths: list[int], seconds: list[float]) -> dict | None:
    if len(lengths) < 2:
        return None
    x, y = np.log(np.asarray(lengths, float)), np.log(np.asarray(seconds, float))
    b, log_a = np.polyfit(x, y, 1)
    residual = y - (b * x + log_a)
    return {"b": float(b), "a": float(math.exp(log_a)), "lengths": list(lengths),
            "rms_log_residual": float(np.sqrt(np.mean(residual ** 2)))}


def _replay_flops(cfg, vocab: int, length: int, prompt: int) -> dict:
    """Floating-point work of an all-anchor replay of one sample (multiply-add = 2), by part."""
    H, b, L = cfg.hidden_size, cfg.block_size, cfg.block_size - 1
    n_feat = len(cfg.target_layer_ids)
    kv = cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    layers = cfg.num_hidden_layers
    total = prompt + length
    anchors = np.arange(prompt, total - 1, dtype=np.float64)
    blocks = np.minimum(b, prompt + length - anchors)
    lm_head = float((2.0 * H * vocab * (blocks - 1)).sum())
    layer = float((2.0 * layers * (H * (2 * q + 2 * kv) + 3 * H * cfg.intermediate_size) * blocks).sum())
    attention = float((4.0 * layers * q * blocks * (anchors + blocks)).sum())
    context = 2.0 * total * (n_feat * H * H + layers * 2 * H * kv)
    return {"lm_head": lm_head, "drafter_layers": layer, "attention": attention, "context": context,
            "total": lm_head + layer + attention + context, "anchors": int(anchors.size)}


def anchor_windows(count: int, windows: int, width: int) -> list[int]:
    """Rows of `windows` runs of `width` contiguous anchors centred at (i + 1/2) / windows of
    the `count` anchors (all rows when they cover them): per-anchor replay cost is affine in the
    anchor's context length, so the midpoint rule gives the all-anchor total from them."""
    if windows * width >= count:
        return list(range(count))
    rows = []
    for i in range(windows):
        start = min(count - width, max(0, int((i + 0.5) * count / windows) - width // 2))
        rows.extend(range(start, start + width))
    return rows


def bench_length_scaling(work_dir: Path, quick: bool) -> dict:
    """All-anchor chain replay time against response length at SmolLM2 shapes; fitted exponent."""
    import scoring.drafter as drafter_module
    from pipeline.layer_ids import build_target_layer_ids
    from pipeline.shards import ShardSet
    from scoring.checkpoint import load_drafter
    from scoring.drafter import DFlashDrafter, parse_drafter_config
    from scoring.fit import new_drafter_config, save_drafter
    from scoring.replay import (ReplayOptions, empty_anchor_tensors, pack_samples, replay_anchors, replay_sample,
                                select_feature_columns)
    from scoring.score import prepare_target_head, resolve_device_dtype

    work = Path(work_dir) / "length"
    work.mkdir(parents=True, exist_ok=True)
    lengths = [256, 512, 1024, 2048] if quick else [512, 1024, 2048, 4096, 8192]
    windows, width = (2, 512) if quick else (4, 512)
    warmup = 128
    hidden, vocab, num_layers = SMALL_TARGET["hidden_size"], SMALL_TARGET["vocab_size"], SMALL_TARGET["num_layers"]
    layer_ids = build_target_layer_ids(num_layers, 5)
    result: dict = {"lengths": lengths, "hidden_size": hidden, "vocab_size": vocab, "layer_ids": layer_ids,
                    "block_size": BLOCK_SIZE, "drafter_layers": 1, "ddtree_budgets": [], "anchor_set": "all",
                    "prompt_tokens": SMALL_PROMPT_TOKENS, "threads": torch.get_num_threads(),
                    "anchor_windows": {"windows": windows, "width": width,
                                       "rule": "samples with more anchors than windows x width replay those "
                                               "windows (midpoint rule) and scale the replay time to all anchors"},
                    "per_length": {}}
    try:
        log(f"length: synthetic shards at SmolLM2 shapes, one sample per length {lengths} ...")
        shard_dir = work / "shards"
        write_synthetic_shards(shard_dir, [warmup] + lengths, hidden, vocab, num_layers, layer_ids)
        shardset = ShardSet(str(shard_dir))
        raw = new_drafter_config(shardset.settings["target"], num_layers=1, block_size=BLOCK_SIZE,
                                 layer_ids=layer_ids)
        torch.manual_seed(0)
        ckpt = save_drafter(DFlashDrafter(parse_drafter_config(raw, "bench drafter")), str(work / "drafter"))
        device, dtype = resolve_device_dtype("auto", "auto")
        drafter, info = load_drafter(ckpt, dtype=dtype, device=device)
        head = prepare_target_head(shardset.target_head(), device, dtype)
        embed, lm_head = head["embed_tokens"], head["lm_head"]
        options = ReplayOptions(max_budget=0, dtype=dtype, device=device)
        result.update(device=device, dtype=str(dtype).removeprefix("torch."), memory_budget=options.memory_bytes)
        columns = lambda f: select_feature_columns(f, layer_ids, info.config.target_layer_ids)  # noqa: E731
        samples = {s.response_len: s for s in shardset.samples(prefetch=0)}
        log(f"length: all-anchor chain replay, {result['dtype']}, block {BLOCK_SIZE}, 1-layer drafter ...")
        replay_sample(drafter, embed, lm_head, samples[warmup], columns, warmup, options)  # warm-up
        timers = Timers()
        drafter.forward = timers.wrap("drafter layers", drafter.forward)
        drafter.logits = timers.wrap("lm_head", drafter.logits)
        for layer in drafter.layers:
            layer.self_attn.forward = timers.wrap("attention", layer.self_attn.forward)
        real_masks = drafter_module.block_masks
        drafter_module.block_masks = timers.wrap("masks", real_masks)
        try:
            for length in lengths:
                result["per_length"][str(length)] = _replay_length(
                    samples[length], length, drafter, info, embed, lm_head, columns, options, timers, windows,
                    width, vocab, pack_samples, empty_anchor_tensors, replay_anchors)
        finally:
            drafter_module.block_masks = real_masks
        times = [result["per_length"][str(t)]["seconds"] for t in lengths]
        result["fit_all"] = _fit_exponent(lengths, times)
        half = len(lengths) // 2
        result["fit_top_half"] = _fit_exponent(lengths[half:], times[half:])
        flops_fit = _fit_exponent(lengths, [result["per_length"][str(t)]["gflop"] for t in lengths])
        result["flop_exponent"] = flops_fit["b"] if flops_fit else None
        result["dominant"] = _dominant(result, lengths)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _replay_length(sample, length, drafter, info, embed, lm_head, columns, options, timers, windows, width, vocab,
                   pack_samples, empty_anchor_tensors, replay_anchors) -> dict:
    """`replay_sample` of one sample, split in its two steps (context pass, anchor chunks) and
    timed; the anchor step over `anchor_windows` when the sample has more anchors."""
    timers.seconds.clear()
    reset_peak()
    before = current_rss()
    start = time.perf_counter()
    result = empty_anchor_tensors(sample, length, drafter.config.block_size)
    packed = pack_samples(drafter, [sample], columns, options)
    context_s = time.perf_counter() - start
    count = result.anchors.numel()
    rows = anchor_windows(count, windows, width)
    start = time.perf_counter()
    replay_anchors(drafter, embed, lm_head, packed, [result], [(0, r) for r in rows], options)
    replay_s = time.perf_counter() - start
    peak = peak_rss()
    scale = count / len(rows)
    seconds = context_s + replay_s * scale
    flops = _replay_flops(info.config, vocab, length, SMALL_PROMPT_TOKENS)
    parts = {"context pass": context_s}
    for name, value in timers.seconds.items():
        parts[name] = value * scale
    # nested timers: masks and attention run inside the drafter layers
    parts["drafter layers"] = parts.get("drafter layers", 0.0) - parts.get("attention", 0.0) - parts.get("masks", 0.0)
    parts["other per-anchor work (log_softmax, KL, gathers, writes)"] = (
        replay_s * scale - sum(v * scale for k, v in timers.seconds.items() if k in ("drafter layers", "lm_head")))
    share = {k: v / seconds for k, v in parts.items()}
    entry = {"seconds": seconds, "context_s": context_s, "replay_s_measured": replay_s, "anchors": count,
             "anchors_replayed": len(rows), "estimated": len(rows) < count, "anchors_per_s": count / seconds,
             "ms_per_anchor": 1000 * seconds / count, "gflop": flops["total"] / 1e9,
             "gflop_s": flops["total"] / seconds / 1e9, "time_share": share,
             "flop_share": {k: flops[k] / flops["total"] for k in ("lm_head", "drafter_layers", "attention", "context")},
             "peak_rss_bytes": peak, "rss_before_bytes": before,
             "rss_growth_bytes": None if peak is None or before is None else peak - before}
    log(f"length:   {length:5d} tokens: {seconds:6.1f} s{' (est.)' if entry['estimated'] else ''}, "
        f"{entry['anchors_per_s']:5.0f} anchors/s, time: attention {100 * share.get('attention', 0):.0f}% + masks "
        f"{100 * share.get('masks', 0):.0f}%, lm_head {100 * share.get('lm_head', 0):.0f}%; attention "
        f"{100 * entry['flop_share']['attention']:.1f}% of FLOPs; peak RSS +{fmt_mib(entry['rss_growth_bytes'])}")
    return entry


def _dominant(result: dict, lengths: list[int]) -> str:
    first, last = result["per_length"][str(lengths[0])], result["per_length"][str(lengths[-1])]
    att = lambda e: e["time_share"].get("attention", 0) + e["time_share"].get("masks", 0)  # noqa: E731
    return (f"At {lengths[0]} tokens the lm_head takes {100 * first['time_share'].get('lm_head', 0):.0f}% of the time "
            f"and attention (with its masks) {100 * att(first):.0f}%; at {lengths[-1]} tokens "
            f"{100 * last['time_share'].get('lm_head', 0):.0f}% and {100 * att(last):.0f}%. Attention to the context is "
            f"{100 * last['flop_share']['attention']:.0f}% of the FLOPs at {lengths[-1]} tokens but takes far more of "
            f"the time: on CPU it runs as dense masked scores over every earlier position (fp32 scores, boolean masks, "
            f"softmax: memory-bound passes over [anchors, heads, block, T]), so its cost per anchor grows with T while "
            f"the lm_head's does not; the FLOP count grows as T^{result['flop_exponent']:.2f}, the time as "
            f"T^{result['fit_all']['b']:.2f}.")


# ---------------------------------------------------------------------------------------------
# report


def scale_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(figure, value, target, met) rows for `results` = {"big_shapes": ..., "length_scaling": ...}."""
    rows: list[tuple[str, str, str, str]] = []

    def add(name, value, target="", met=None):
        rows.append((name, value, target, "" if met is None else ("yes" if met else "NO")))

    big = results.get("big_shapes")
    if big and ("skipped" in big or "error" in big):
        add(f"memory at {big.get('shapes')} shapes", "skipped: " + big["skipped"] if "skipped" in big else
            "FAILED: " + big["error"].splitlines()[0], met=False if "error" in big else None)
    if big and "extract" in big and "score" in big:
        t, cfg = big["target"], big["target"]["config"]
        add(f"memory at {big['shapes']} shapes: target {t['params'] / 1e9:.2f}B params (hidden {cfg['hidden_size']}, "
            f"vocab {cfg['vocab_size']}, {cfg['num_hidden_layers']} layers, bf16), {big['drafter']['params'] / 1e6:.0f}M "
            f"drafter, one process per stage", "")
        ex = big["extract"]
        add("  extract (bf16): peak RSS", f"{fmt_mib(ex['peak_rss_bytes'])} in '{ex['highest']['phase']}' "
            f"({ex['wall_s']:.0f} s)", f"<= {PEAK_LIMIT / GiB:.0f} GiB", ex["peak_rss_bytes"] <= PEAK_LIMIT)
        add("    weights (embedding + lm_head / layers), target head file",
            f"{fmt_mib(ex['weights_bytes'])} ({fmt_mib(ex['embed_lm_head_bytes'])} / {fmt_mib(ex['layers_bytes'])}), "
            f"{fmt_mib(ex['target_head_bytes'])}")
        for length, p in ex["per_length"].items():
            add(f"    {length} tokens, forward: peak = start-up + weights + stored + rest",
                f"{fmt_mib(p['flat_phases_peak_rss_bytes'])} = {fmt_mib(ex['baseline_rss_bytes'])} + "
                f"{fmt_mib(ex['weights_bytes'])} + "
                f"{fmt_mib(p['stored_tensors_bytes'])} + {fmt_mib(p['forward_rest_bytes'])}; shard "
                f"{fmt_mib(p['shard_bytes'])}")
            _budget_rows(add, p, ex["memory_budget"])
        sc = big["score"]
        add(f"  score ({sc['dtype']}, last anchor chunk per sample): peak RSS",
            f"{fmt_mib(sc['peak_rss_bytes'])} in '{sc['highest']['phase']}' ({sc['wall_s']:.0f} s)",
            f"<= {PEAK_LIMIT / GiB:.0f} GiB", sc["peak_rss_bytes"] <= PEAK_LIMIT)
        add("    lm_head + embedding + drafter", f"{fmt_mib(sc['lm_head_bytes'])} + {fmt_mib(sc['embed_bytes'])} + "
            f"{fmt_mib(sc['drafter_bytes'])}")
        fixed = sc["lm_head_bytes"] + sc["embed_bytes"] + sc["drafter_bytes"]
        for length, p in sc["per_length"].items():
            add(f"    {length} tokens, before its context pass (shard decoding in the background): peak",
                fmt_mib(p["before_context_peak_rss_bytes"]))
            add(f"    {length} tokens, context pass: peak = start-up + head + drafter + stored + rest",
                f"{fmt_mib(p['flat_phases_peak_rss_bytes'])} = {fmt_mib(sc['baseline_rss_bytes'])} + {fmt_mib(fixed)} + "
                f"{fmt_mib(p['stored_tensors_bytes'])} "
                f"+ {fmt_mib(p['context_rest_bytes'])}")
            _budget_rows(add, p, sc["memory_budget"], f" ({p.get('anchors', '-')} anchors, "
                         f"{p.get('anchors_per_chunk', '-')} per chunk)")
        for side in ("extract", "score"):
            v = big[side]["flat"]
            add(f"  {side}: growth {v['from_tokens']} -> {v['to_tokens']} tokens of {v['phases']} vs stored tensors",
                f"{fmt_mib(v['rss_growth_bytes'])} vs {fmt_mib(v['stored_growth_bytes'])} "
                f"({v['growth_over_stored']:.2f}x)", f"<= {FLAT_FACTOR}x + {FLAT_SLACK // MiB} MiB",
                v["flat_apart_from_stored"])
    ls = results.get("length_scaling")
    if ls:
        add(f"scoring cost vs response length (SmolLM2 shapes, {ls.get('dtype')}, all anchors, chain, block "
            f"{ls['block_size']}, 1-layer drafter)", "")
        for length, p in ls.get("per_length", {}).items():
            share = p["time_share"]
            how = f"est. from {p['anchors_replayed']} of {p['anchors']} anchors" if p["estimated"] else "all anchors"
            add(f"  {int(length):5d} tokens", f"{p['seconds']:.1f} s ({how}), {p['anchors_per_s']:.0f} anchors/s, "
                f"{p['ms_per_anchor']:.1f} ms/anchor; time in attention {100 * share.get('attention', 0):.0f}%, "
                f"lm_head {100 * share.get('lm_head', 0):.0f}%; attention {100 * p['flop_share']['attention']:.1f}% of "
                f"FLOPs; peak RSS +{fmt_mib(p['rss_growth_bytes'])}")
        fa, ft = ls.get("fit_all"), ls.get("fit_top_half")
        if fa:
            add("  fitted exponent b (time = a T^b), all lengths / longer half",
                f"{fa['b']:.2f} / {ft['b']:.2f}" if ft else f"{fa['b']:.2f}")
            add("  exponent of the FLOP count (for comparison)", f"{ls['flop_exponent']:.2f}")
    return rows


def _budget_rows(add, per_length: dict, budget: int, note: str = "") -> None:
    for name, w in per_length["budgeted_working_sets"].items():
        add(f"      {name}: working set", f"{fmt_mib(w['bytes'])}{note}", f"<= {fmt_mib(w['budget_share_bytes'])} "
            f"(of --memory-budget {fmt_mib(budget)})", w["within"])


def scale_table(results: dict) -> str:
    """The rows of `scale_rows` as an aligned text table."""
    rows = scale_rows(results)
    if not rows:
        return ""
    header = ("figure", "value", "target", "met")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="specreplay bench: memory at 27B shapes, scoring cost vs length")
    parser.add_argument("--quick", action="store_true", help="shorter sequences (~1.5 min)")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: big,length")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child_main(*sys.argv[2:5])
    args = parse_args(argv)
    out_dir, stamp, work = start_run(args.out, "scale-work")
    results: dict = {"args": {"quick": args.quick, "skip": sorted(args.skip)}, "torch": torch.__version__,
                     "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                     "loadavg_start": list(os.getloadavg())}
    log(f"scale: {'quick' if args.quick else 'full'} run, {torch.get_num_threads()} torch threads, work dir {work}")
    try:
        if "length" not in args.skip:
            results["length_scaling"] = bench_length_scaling(work, args.quick)
        if "big" not in args.skip:
            results["big_shapes"] = bench_big_shapes(work, args.quick)
    finally:
        path = finish_run(results, out_dir, f"scale-{stamp}", work, args.keep)
    print()
    print(scale_table(results))
    print(f"\ntotal {results['wall_s']:.0f} s; written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Arctic Inference's suffix decoding (PyPI `arctic-inference` 0.3.0, the package vLLM's `suffix` method
imports) built for CPU: the reference tests/proposers/test_suffix.py drives as vLLM does and compares
the `suffix` proposer with, anchor by anchor. `make setup` runs it (`python -m tools.arctic_suffix`).

Only the suffix-decoding extension is built (csrc/suffix_decoding: C++20 and nanobind, no torch, no
GPU): the package's own build also compiles CUDA kernels and pulls vLLM. The sdist is downloaded once
(`pip download --no-binary :all:`; `--no-build-isolation`, else pip would build every build
requirement, torch included, from source just to read the package's metadata), built with cmake and
ninja, and its `arctic_inference/suffix_decoding/` Python files and the built `_C` module are copied to
`.venv/share/arctic_suffix/`, importable with that folder on sys.path (`import_reference`). Nothing is
downloaded when it already imports; the tests only import what this installed."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tools.reference_build import ensure_built

VERSION = "0.3.0"
SDIST = f"arctic_inference-{VERSION}"
SHARE = Path(sys.prefix) / "share" / "arctic_suffix"  # .venv/share/arctic_suffix
BUILD_TOOLS = ("nanobind==2.9.2", "cmake", "ninja")  # nanobind pinned as the package's pyproject.toml pins it
SETUP_HINT = "run `make setup` (or `.venv/bin/python -m tools.arctic_suffix`) to build it"


def import_reference():
    """arctic_inference.suffix_decoding as this tool installed it; ImportError when it is not there."""
    if not (SHARE / "arctic_inference" / "suffix_decoding" / "cache.py").is_file():
        raise ImportError(f"Arctic Inference's suffix decoding is not built in {SHARE}: {SETUP_HINT}")
    if str(SHARE) not in sys.path:
        sys.path.insert(0, str(SHARE))
    module = importlib.import_module("arctic_inference.suffix_decoding")
    if not Path(module.__file__).resolve().is_relative_to(SHARE.resolve()):
        raise ImportError(f"arctic_inference was imported from {module.__file__}, not {SHARE}")
    return module


def reference_imports() -> bool:
    """Whether the built reference imports, checked in a fresh interpreter (a failed import here would
    leave a half-imported package in this one)."""
    code = "import tools.arctic_suffix as a; a.import_reference()"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    return done.returncode == 0


def _run(args: list, cwd: Path | None = None) -> None:
    subprocess.run([str(a) for a in args], cwd=cwd, check=True)


def _download(tmp: Path) -> Path:
    """The unpacked sdist (its csrc/ and arctic_inference/ only)."""
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
         + [f"arctic-inference=={VERSION}", "-d", tmp])  # fmt: skip
    with tarfile.open(tmp / f"{SDIST}.tar.gz") as archive:
        parts = (f"{SDIST}/csrc/", f"{SDIST}/arctic_inference/")
        wanted = [member for member in archive.getmembers() if member.name.startswith(parts)]
        archive.extractall(tmp, members=wanted, filter="data")
    return tmp / SDIST


def _build(source: Path, tmp: Path) -> Path:
    """The built `_C` extension module of csrc/suffix_decoding."""
    bin_dir = Path(sys.executable).parent  # the venv's cmake and ninja, installed with nanobind
    build = tmp / "build"
    _run([bin_dir / "cmake", "-S", source / "csrc" / "suffix_decoding", "-B", build, "-G", "Ninja"]
         + [f"-DCMAKE_MAKE_PROGRAM={bin_dir / 'ninja'}", f"-DPython_EXECUTABLE={sys.executable}"]
         + ["-DCMAKE_BUILD_TYPE=Release"])  # fmt: skip
    _run([bin_dir / "cmake", "--build", build, "-j", "2"])
    [module] = build.glob("_C*.so")
    return module


def _install(source: Path, module: Path) -> None:
    """arctic_inference/__init__.py (empty: its licence header), suffix_decoding/*.py and _C into SHARE."""
    staging = SHARE.with_name(SHARE.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    package = staging / "arctic_inference" / "suffix_decoding"
    package.mkdir(parents=True)
    shutil.copy2(source / "arctic_inference" / "__init__.py", package.parent)
    for path in (source / "arctic_inference" / "suffix_decoding").glob("*.py"):
        shutil.copy2(path, package)
    shutil.copy2(module, package)
    shutil.rmtree(SHARE, ignore_errors=True)
    staging.rename(SHARE)  # whole or not at all: a killed build leaves no half-installed reference


def build_reference() -> None:
    _run([sys.executable, "-m", "pip", "install", "-q", *BUILD_TOOLS])
    with tempfile.TemporaryDirectory(prefix="arctic_suffix_") as tmp:
        source = _download(Path(tmp))
        _install(source, _build(source, Path(tmp)))


def main() -> int:
    return ensure_built(reference_imports, build_reference, f"Arctic Inference {VERSION} suffix decoding", SHARE)


if __name__ == "__main__":
    sys.exit(main())

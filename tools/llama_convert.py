"""llama.cpp's own converter (`convert_hf_to_gguf.py`) as `make setup` unpacks it from the
llama-cpp-python 0.3.36 source package into .venv/share/llama.cpp/ (with its `conversion` package
and the `gguf-py` it imports): the engine tests (tests/parity/test_engine_parity.py) and the GGUF
drafter tests convert targets and drafters with it, exactly as a llama.cpp user does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CONVERTER_DIR = Path(sys.prefix) / "share" / "llama.cpp"


def converter() -> Path:
    path = CONVERTER_DIR / "convert_hf_to_gguf.py"
    assert path.is_file(), f"{path} is missing: run `make setup` (it unpacks llama.cpp's converter)"
    return path


def convert(model_dir, out, target_dir=None, outtype: str = "f32", extra: tuple[str, ...] = ()) -> Path:
    """Convert the HF checkpoint `model_dir` to the GGUF file `out` (a drafter with
    `--target-model-dir target_dir`, as docs/speculative.md of llama.cpp says); raises with the
    converter's last lines when it refuses."""
    command = [sys.executable, str(converter()), str(model_dir), "--outtype", outtype, "--outfile", str(out)]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    done = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py {model_dir} failed: {(done.stdout + done.stderr)[-3000:]}")
    return Path(out)

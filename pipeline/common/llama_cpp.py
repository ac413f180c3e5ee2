"""Where llama.cpp's programs are: `llama-server`, `llama-bench`, ... as llama-cpp-python installs
them when built with its tools (`make setup`: site-packages/bin/, their shared libraries in
site-packages/lib and llama_cpp/lib, not on the loader's path), or a user's own build on PATH."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

from pipeline.common.errors import UserError


def installed_binary(name: str) -> Path:
    """`name` as llama-cpp-python installs it: site-packages/bin/ of this interpreter (maybe absent)."""
    return Path(sysconfig.get_paths()["purelib"]) / "bin" / name


def binary_env(binary: Path) -> dict:
    """The environment `binary` runs in: its installed shared libraries found beside it."""
    site = binary.parent.parent
    return {**os.environ, "LD_LIBRARY_PATH": f"{site / 'lib'}:{site / 'llama_cpp' / 'lib'}"}


def find_binary(name: str, given: str | None = None) -> Path:
    """The program `given` (a path), else `name` as `make setup` installs it, else on PATH."""
    if given:
        if not os.path.isfile(given):
            raise UserError(f"{given}: no such program; give the path of llama.cpp's {name}")
        return Path(given)
    installed = installed_binary(name)
    if installed.is_file():
        return installed
    on_path = shutil.which(name)
    if on_path is None:
        raise UserError(f"llama.cpp's {name} is not installed here: run `make setup`, or give its path")
    return Path(on_path)

"""What bench/run.py and bench/scale.py share: progress lines, /proc memory readings, the
results directory of a run, quiet transformers."""

from __future__ import annotations

import datetime as _dt
import os
import time
from pathlib import Path

T0 = time.perf_counter()
MiB = 1 << 20


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _status_kib(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def peak_rss(pid="self") -> int | None:
    """The kernel's peak-RSS mark (VmHWM) of a process, bytes."""
    kib = _status_kib(pid, "VmHWM")
    return None if kib is None else kib * 1024


def current_rss(pid="self") -> int | None:
    kib = _status_kib(pid, "VmRSS")
    return None if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux clear_refs 5), so each phase gets its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def fmt_mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


def start_run(out: str, work_prefix: str) -> tuple[Path, str, Path]:
    """(results dir, time stamp, fresh work dir) of one run; transformers' bars and warnings off."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    work = out_dir / f"{work_prefix}-{stamp}"
    work.mkdir(parents=True)
    return out_dir, stamp, work


def finish_run(results: dict, out_dir: Path, name: str, work: Path, keep: bool) -> Path:
    """Record the end of a run, write its JSON (`<name>.json` in out_dir), drop the work dir."""
    import json
    import shutil

    results["loadavg_end"] = loadavg()
    results["wall_s"] = time.perf_counter() - T0
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return path


class Timers:
    """Accumulated wall time and call counts of wrapped callables (which part of a run dominates;
    microseconds of overhead a call)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        return wrapped

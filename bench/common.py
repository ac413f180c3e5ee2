"""What every section shares, one of each: progress lines and run directories, the process-memory
helper (RSS readings, per-block phases, the per-stage memory recorder), the sampler of other
processes' CPU, the FLOP model, and the table printer.

Sections only measure; they never patch the product. Stage times come from the product's own
hooks (`pipeline.common.timing`): a recorder here is handed to `timing.recording(...)`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

T0 = time.perf_counter()
MiB = 1 << 20
GiB = 1 << 30
GB = 1e9
ROOT = Path(__file__).resolve().parents[1]
# Others' CPU above this (cores) during a side of a comparison makes its verdict suspect: 2-thread
# OpenMP code stalls at every barrier when a core is taken (bench/README.md, "Noise").
CONTENDED_CORES = 0.2


# ---------------------------------------------------------------------------------------------
# progress lines, run directories, environment


def log(message: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {message}", flush=True)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def quiet_transformers() -> None:
    """No download/loading bars or warnings between the progress lines (also in child processes)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def start_run(out: str, work_prefix: str = "work") -> tuple[Path, str, Path]:
    """(results dir, time stamp, fresh work dir) of one run."""
    quiet_transformers()
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    work = out_dir / f"{work_prefix}-{stamp}"
    work.mkdir(parents=True)
    return out_dir, stamp, work


def finish_run(results: dict, out_dir: Path, name: str, work: Path, keep: bool) -> Path:
    """Record the end of a run, write its JSON (`<name>.json` in out_dir), drop the work dir."""
    results["loadavg_end"] = loadavg()
    results["wall_s"] = time.perf_counter() - T0
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    if not keep:
        shutil.rmtree(work, ignore_errors=True)
    return path


def environment() -> dict:
    import torch
    import transformers

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "date": _dt.date.today().isoformat(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.is_available(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB, 1),
    }


def best_of(fn, repeats: int) -> float:
    """Minimum wall time of `repeats` calls: the least disturbed one on a shared machine."""
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ---------------------------------------------------------------------------------------------
# process memory (Linux /proc): one helper for every section and the child processes


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


def mem_available() -> int | None:
    """The machine's MemAvailable, bytes (a child is killed before the machine runs out)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


KEEP_AVAILABLE = 1536 * MiB  # a watched child is killed when the machine's MemAvailable drops below this


def watch_child(
    cmd: list[str], marker: bytes, out, env: dict | None = None, timeout_s: float = 900, poll_s: float = 0.02
) -> dict:
    """Run `cmd` (cwd: the repository root, stdout and stderr to the file `out`) and poll its
    peak RSS (VmHWM) until it exits. Polled, because getrusage's ru_maxrss of a forked child
    includes this process's RSS at fork time; `marker` (a byte string of its command line) tells
    when the exec has happened, before which the child still shares our pages. The child is
    killed when the machine runs low on memory or after `timeout_s`."""
    import subprocess

    start = time.perf_counter()
    state = {"polled": 0, "killed": None}
    with subprocess.Popen(cmd, cwd=str(ROOT), stdout=out, stderr=out, env=env) as child:
        try:
            _poll(child, marker, start, timeout_s, poll_s, state)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): do not leave the child running
            child.kill()
            raise
    return {
        "returncode": child.returncode,
        "peak_rss_bytes": state["polled"] or None,
        "wall_s_incl_startup": time.perf_counter() - start,
        "killed": state["killed"],
    }


def _poll(child, marker: bytes, start: float, timeout_s: float, poll_s: float, state: dict) -> None:
    while child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/cmdline", "rb") as f:
                execed = marker in f.read()
        except OSError:
            execed = False
        if execed:
            state["polled"] = max(state["polled"], peak_rss(child.pid) or 0)
        available = mem_available()
        if available is not None and available < KEEP_AVAILABLE and state["killed"] is None:
            state["killed"] = (
                f"killed: machine MemAvailable {available / MiB:.0f} MiB, child peak {state['polled'] / MiB:.0f} MiB"
            )
            child.kill()
        if time.perf_counter() - start > timeout_s and state["killed"] is None:
            state["killed"] = f"killed after {timeout_s:.0f} s"
            child.kill()
        time.sleep(poll_s)


def fmt_mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


def rss_text(phase: dict) -> str:
    """'peak (+growth over the phase start)' of a Phase's figures."""
    peak, before = phase.get("peak_rss_bytes"), phase.get("rss_before_bytes")
    if peak is None:
        return "-"
    return f"{fmt_mib(peak)} (+{fmt_mib(max(0, peak - (before or 0)))})"


class OthersCpu:
    """Background sampler of the CPU that OTHER processes use (in cores), once a second:
    system-wide busy CPU time (idle and iowait excluded) minus this process's own. The machine is
    shared; this says how contended each measured phase was."""

    def __init__(self, interval: float = 1.0):
        import psutil

        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (perf_counter at the end of the interval, cores)
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.first = None

    def _busy(self) -> tuple[float, float, float]:
        import psutil

        total = psutil.cpu_times()
        busy = sum(getattr(total, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
        own = self._process.cpu_times()  # waited-for children (CLI subprocesses) count as ours
        return time.perf_counter(), busy, own.user + own.system + own.children_user + own.children_system + self._live()

    def _live(self) -> float:
        """CPU of our children still running (a server the bench started), ours too."""
        import psutil

        seconds = 0.0
        for child in self._process.children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.Error:  # ended between the listing and the reading
                continue
            seconds += times.user + times.system
        return seconds

    def _run(self):
        last = self.first = self._busy()
        while not self._stop.wait(self.interval):
            now = self._busy()
            wall = now[0] - last[0]
            if wall > 0:
                self.samples.append((now[0], max(0.0, ((now[1] - last[1]) - (now[2] - last[2])) / wall)))
            last = now

    def start(self) -> "OthersCpu":
        self._thread.start()
        return self

    def stop(self) -> float | None:
        """Stops sampling; returns the cores other processes used over the whole run."""
        self._stop.set()
        first, now = self.first, self._busy()
        if first is None or now[0] <= first[0]:
            return None
        return round(max(0.0, ((now[1] - first[1]) - (now[2] - first[2])) / (now[0] - first[0])), 2)

    def mean(self, start: float, end: float) -> float | None:
        """Mean cores used by others over [start, end] (the samples whose interval overlaps it)."""
        picked = [cores for t, cores in self.samples if start <= t <= end + self.interval]
        return round(sum(picked) / len(picked), 2) if picked else None


OTHERS: OthersCpu | None = None  # started by bench/__main__.py; None in child processes


def others_cpu(start: float, end: float) -> float | None:
    return OTHERS.mean(start, end) if OTHERS is not None else None


class Phase:
    """Wall time, peak RSS and others' CPU use of a block: `with Phase() as p: ...; p.seconds`."""

    def __enter__(self):
        self.peak_reset = reset_peak()
        self.rss_before = current_rss() or 0
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        end = time.perf_counter()
        self.seconds = end - self.start
        self.peak_rss = peak_rss() if self.peak_reset else None
        self.others_cpu = others_cpu(self.start, end)
        return False

    def figures(self) -> dict:
        return {
            "wall_s": self.seconds,
            "peak_rss_bytes": self.peak_rss,
            "rss_before_bytes": self.rss_before,
            "others_cpu": self.others_cpu,
        }


# ---------------------------------------------------------------------------------------------
# recorders for the product's stage events (pipeline.common.timing)


class StageClock:
    """A `pipeline.common.timing` recorder: per stage name, inclusive seconds, seconds of its own
    (nested stages subtracted, so "attention" inside "drafter layers" is not counted twice) and
    calls. A stage the product does not mark is simply absent: `get` returns None and the table
    prints '-'."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.own_seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._nested: list[float] = []  # per open stage: seconds of the stages nested in it

    def start(self, name: str, info: dict) -> None:
        self._nested.append(0.0)

    def stop(self, name: str, info: dict, seconds: float) -> None:
        nested = self._nested.pop() if self._nested else 0.0
        if self._nested and not info.get("elsewhere"):  # another thread's time is not nested here
            self._nested[-1] += seconds
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.own_seconds[name] = self.own_seconds.get(name, 0.0) + seconds - nested
        self.calls[name] = self.calls.get(name, 0) + 1

    def get(self, name: str, own: bool = False) -> float | None:
        return (self.own_seconds if own else self.seconds).get(name)

    def clear(self) -> None:
        self.seconds.clear()
        self.own_seconds.clear()
        self.calls.clear()

    def figures(self) -> dict:
        return {
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "own_seconds": {k: round(v, 4) for k, v in self.own_seconds.items()},
            "calls": dict(self.calls),
        }


class PhaseMemory:
    """Peak RSS and time per named phase of a process, as a `pipeline.common.timing` recorder.

    Time is cut into segments at every stage start and stop; a segment belongs to the innermost
    open phase, or, between phases, to a gap recorded as "other (before <next phase>)". Before
    each segment the kernel's high-water mark is reset, after it read, so every phase gets its own
    peak. `label(name, info)` names the phase of a product stage (None: not a phase of its own,
    its time stays with the enclosing one); `phase(label)` opens one from bench code."""

    def __init__(self, label=lambda name, info: name):
        self.label = label
        self.phases: dict[str, dict] = {}
        self.resettable = reset_peak()
        self.overall = peak_rss() or 0
        self.baseline = current_rss()  # the interpreter, torch and the stage's imports
        self._open: list[tuple[str, str | None]] = []  # (stage name, phase label or None)
        self._begin()

    def _begin(self) -> None:
        reset_peak()
        self._segment_rss = current_rss()
        self._segment_start = time.perf_counter()

    def _end(self, label: str) -> None:
        peak = peak_rss() or 0
        entry = self.phases.setdefault(
            label, {"seconds": 0.0, "segments": 0, "peak_rss_bytes": 0, "rss_before_bytes": self._segment_rss}
        )
        entry["seconds"] += time.perf_counter() - self._segment_start
        entry["segments"] += 1
        entry["peak_rss_bytes"] = max(entry["peak_rss_bytes"], peak)
        entry["rss_after_bytes"] = current_rss()
        self.overall = max(self.overall, peak)

    def _innermost(self) -> str | None:
        return next((label for _, label in reversed(self._open) if label is not None), None)

    def _push(self, name: str, label: str | None) -> None:
        if label is not None:
            self._end(self._innermost() or f"other (before {label})")
            self._begin()
        self._open.append((name, label))

    def _pop(self, name: str) -> None:
        if not self._open or self._open[-1][0] != name:
            return  # not ours (a stage opened before this recorder)
        _, label = self._open.pop()
        if label is not None:
            self._end(label)
            self._begin()

    def start(self, name: str, info: dict) -> None:
        self._push(name, self.label(name, info))

    def stop(self, name: str, info: dict, seconds: float) -> None:
        self._pop(name)

    @contextmanager
    def phase(self, label: str):
        """A phase around bench code: `with memory.phase("load drafter"): ...`."""
        self._push(label, label)
        try:
            yield
        finally:
            self._pop(label)

    def finish(self) -> dict:
        self._end(self._innermost() or "other (before exit)")
        return {
            "peak_rss_bytes": self.overall,
            "phases": self.phases,
            "hwm_reset_works": self.resettable,
            "baseline_rss_bytes": self.baseline,
        }


# ---------------------------------------------------------------------------------------------
# FLOP model (multiply-add = 2), one for every section; formulas in bench/README.md


def count_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def drafter_shape(cfg, vocab: int, hidden: int | None = None) -> dict:
    """Parameter counts of a DFlash drafter (proposers.dflash.config.DrafterConfig) that its FLOPs use:
    P_D the decoder layers' q/k/v/o/MLP (norms ignored), P_C its context path (fc over the stored
    feature layers + every layer's k/v), P_V = V x H the target lm_head it shares."""
    hidden = hidden or cfg.hidden_size
    q = cfg.hidden_size * cfg.num_attention_heads * cfg.head_dim
    kv = cfg.hidden_size * cfg.num_key_value_heads * cfg.head_dim
    layer = 2 * q + 2 * kv + 3 * cfg.hidden_size * cfg.intermediate_size
    return {
        "drafter_layer_params": layer * cfg.num_hidden_layers,
        "drafter_layers": cfg.num_hidden_layers,
        "drafter_attn_width": cfg.num_attention_heads * cfg.head_dim,
        "drafter_ctx_params": len(cfg.target_layer_ids) * cfg.hidden_size * cfg.hidden_size
        + 2 * kv * cfg.num_hidden_layers,
        "lm_head_params": vocab * hidden,
    }


def target_shape(target) -> dict:
    """Parameter counts of a loaded transformers target that the online loop's FLOPs use: P_T its
    decoder layers (+ final norm), L_T and W_T its layers and attention width."""
    from pipeline.extract.target import decoder_layers, text_config

    layers = decoder_layers(target)
    tcfg = text_config(target)
    norm = count_params(target.model.norm) if hasattr(target, "model") and hasattr(target.model, "norm") else 0
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    return {
        "target_layer_params": count_params(layers) + norm,
        "target_layers": len(layers),
        "target_attn_width": tcfg.num_attention_heads * head_dim,
    }


def replay_flops(m: dict, ctx_len: int, anchors, block_lens) -> dict:
    """Work of an offline replay of one sample, by part: the context path once over `ctx_len`
    positions, then per anchor (start s, block b) the drafter layers over its block, the lm_head
    on block rows 1.. and attention to the context before it (4 x width x keys per query)."""
    b = np.asarray(block_lens, dtype=np.float64)
    s = np.asarray(anchors, dtype=np.float64)
    parts = {
        "context": 2.0 * m["drafter_ctx_params"] * ctx_len,
        "drafter_layers": float((2.0 * m["drafter_layer_params"] * b).sum()),
        "lm_head": float((2.0 * m["lm_head_params"] * (b - 1)).sum()),
        "attention": float((4.0 * m["drafter_layers"] * m["drafter_attn_width"] * b * (s + b)).sum()),
    }
    parts["total"] = sum(parts.values())
    return parts


def online_flops(m: dict, prompt_len: int, steps: list[tuple[int, int]]) -> float:
    """Work of one `dflash_generate` run: prefill (logits_to_keep=1) + per step (start, verify
    size) the target verify over the block incl. its lm_head on every block row, the context
    added since the last step through the drafter's fc/k/v, the drafter layers over the block and
    its lm_head on block rows 1..; attention included."""
    flops = 2.0 * m["target_layer_params"] * prompt_len + 2.0 * m["lm_head_params"]
    flops += 4.0 * m["target_layers"] * m["target_attn_width"] * prompt_len * (prompt_len + 1) / 2
    ctx_done = 0
    for start, size in steps:
        flops += 2.0 * (m["target_layer_params"] + m["lm_head_params"]) * size
        flops += 4.0 * m["target_layers"] * m["target_attn_width"] * size * (start + size)
        if size > 1:
            flops += 2.0 * m["drafter_ctx_params"] * (start - ctx_done)
            ctx_done = start
            flops += 2.0 * m["drafter_layer_params"] * size + 2.0 * m["lm_head_params"] * (size - 1)
            flops += 4.0 * m["drafter_layers"] * m["drafter_attn_width"] * size * (start + size)
    return flops


def fit_exponent(xs: list[float], ys: list[float]) -> dict | None:
    """b and a of y = a x^b by least squares on log-log."""
    if len(xs) < 2:
        return None
    x, y = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    b, log_a = np.polyfit(x, y, 1)
    residual = y - (b * x + log_a)
    return {
        "b": float(b),
        "a": float(math.exp(log_a)),
        "lengths": list(xs),
        "rms_log_residual": float(np.sqrt(np.mean(residual**2))),
    }


# ---------------------------------------------------------------------------------------------
# the table: every section returns rows, one printer prints them


@dataclass
class Row:
    figure: str
    value: str = ""
    target: str = ""
    met: str = ""  # "", "yes", "NO", "yes*", "NO*"
    others: str = ""  # others' CPU (cores) during the measured sides


class Rows(list):
    """A section's table rows. `add(..., met=bool, sides=[cores...])`: the verdict gets a '*'
    when other processes used more than CONTENDED_CORES during any side of the comparison."""

    def add(
        self, figure: str, value: str = "", target: str = "", met: bool | None = None, others=None, sides=()
    ) -> None:
        if isinstance(others, (list, tuple)):
            others = "/".join("-" if o is None else f"{o:.1f}" for o in others)
        elif others is not None:
            others = f"{others:.1f}"
        verdict = "" if met is None else ("yes" if met else "NO")
        if verdict and any(o is not None and o > CONTENDED_CORES for o in sides):
            verdict += "*"
        self.append(Row(figure, value, target, verdict, others or ""))


def num(value, fmt: str = ".2f", suffix: str = "") -> str:
    """A figure that may be missing (a stage the product does not mark yet): '-'."""
    return "-" if value is None else f"{value:{fmt}}{suffix}"


def format_table(rows: list[Row]) -> str:
    if not rows:
        return "(no sections of this table ran)"
    header = Row("figure", "value", "target", "met", "others' CPU")
    cells = [[r.figure, r.value, r.target, r.met, r.others] for r in [header, *rows]]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells[1:]]
    flagged = [r.figure.strip() for r in rows if r.met.endswith("*")]
    if flagged:
        lines.append(
            f"* other processes used more than {CONTENDED_CORES} cores during a side of this comparison "
            f"(column others' CPU): the verdict is not trustworthy; rerun on a quiet machine. "
            f"({'; '.join(flagged)})"
        )
    return "\n".join(lines)

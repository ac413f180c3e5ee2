"""`specreplay watch`: score every checkpoint of a training run as it lands, each exactly once.

State: the results directories under --out are the only state. A checkpoint whose directory
holds a run.json scored with the same settings is skipped (score_checkpoint's own check), so a
restarted watcher, a cron job with --once and a plain `score` agree on what is done.

Completeness: a path the globs match is scored only when checkpoint_problem finds nothing wrong
(config and weights present, every shard of a safetensors index present, headers parseable,
files as long as their headers say) and its files' sizes and mtimes are unchanged since the
previous poll. A checkpoint being written, truncated or corrupt is reported once (what is
wrong) and looked at again at every poll; it never yields a result. Hidden and temporary names
(`.step_5`, `tmp-step_5`, `step_5.tmp`) are never candidates, so trainers that write under such
a name and rename work, and so do trainers that write in place.

Order: what is ready at a poll is scored oldest training step first (the step from the
checkpoint's config or path, as score records it). The target head is prepared once.

Stopping: SIGINT/SIGTERM raise Stopped wherever the watcher is; the checkpoint being scored
loses its hidden staging directory (score renames a results directory into place only once it
is complete, so none is ever half-written) and a later run scores it again. A staging directory
left by a killed process is removed before its checkpoint is scored again.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from pipeline.common import timing
from pipeline.common.distributed import Dist, dist_from_env
from pipeline.common.errors import UserError
from pipeline.shards import ShardSet
from proposers.checkpoints.files import WEIGHT_EXTENSIONS, checkpoint_problem, parse_step, resolve_checkpoint_files
from scoring import results
from scoring.compare.baselines import Versus, paired_row
from scoring.compare.bootstrap import digits, judge
from scoring.config import ScoreConfig
from scoring.replay.packing import prepare_target_head
from scoring.report.page import write_report
from scoring.score.console import floor_warning, headline
from scoring.score.outcome import Outcome, Status
from scoring.score.outputs import remove_dead_staging
from scoring.score.record import read_record
from scoring.score.run import score_checkpoint
from scoring.score.steps import check_anchor_set, resolve_device_dtype

# --once looks twice, this far apart (or --interval when shorter): long enough to see a writer
# that is still appending, short enough for cron and CI.
ONCE_SETTLE_S = 2.0
# Names trainers write under before renaming: never scored, however the glob reads.
TEMPORARY_NAME = re.compile(r"^(\.|tmp[-_.]|temp[-_.])|\.(tmp|temp|partial|incomplete)$", re.I)
REPORT_NAME = "report.html"


class Stopped(BaseException):
    """SIGINT or SIGTERM: a BaseException, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class WatchOptions:
    interval: float = 60.0  # seconds between polls
    once: bool = False  # score what is complete now, then return
    quiet: bool = False  # no progress bars, no waiting/skipped lines
    loggers: object = None  # scoring.track.loggers.LoggerOptions, or None for no logger
    progress: object = None  # progress-bar factory (specreplay.progress.bars)
    echo: Callable[[str], None] = print
    program: str = "specreplay"  # how hints name the console script (specreplay.hints.program())
    warn: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    baselines: tuple[str, ...] = ()  # scored once first; each checkpoint's line is followed by one per baseline


@dataclass
class WatchResult:
    scored: list[str] = field(default_factory=list)  # checkpoint paths, in the order scored
    skipped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)  # incomplete when a --once run ended
    stopped_by: int | None = None  # the signal number that ended the watch

    @property
    def exit_code(self) -> int:
        """128 + signal after a signal (the shell's convention), 1 when a checkpoint failed, else 0."""
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        return 1 if self.failed else 0


# --------------------------------------------------------------------------- candidates


def candidate_paths(patterns: list[str]) -> list[str]:
    """Every directory or weight file the patterns match now, sorted, minus temporary names.
    A pattern matching nothing yet is not an error: the trainer has not written it."""
    found = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            path = os.path.normpath(path)
            if TEMPORARY_NAME.search(os.path.basename(path)) or path in found:
                continue
            if os.path.isdir(path) or path.endswith(WEIGHT_EXTENSIONS):
                found.append(path)
    return found


def fingerprint(path: str) -> tuple:
    """(relative name, size, mtime) of every file of a checkpoint: a directory's whole tree, or a
    weight file and the config.json beside it. Equal at two polls = nothing was written between."""
    if os.path.isdir(path):
        files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]
    else:
        files = [path, os.path.join(os.path.dirname(path), "config.json")]
    stats = []
    for name in sorted(files):
        with contextlib.suppress(FileNotFoundError):  # removed or renamed by the writer meanwhile
            st = os.stat(name)
            stats.append((os.path.relpath(name, path), st.st_size, st.st_mtime_ns))
    return tuple(stats)


def checkpoint_step(path: str) -> int | None:
    """The training step as score records it (config first, then the path), before any weight
    is read; a .pt's own metadata is not opened here."""
    try:
        _, config_file = resolve_checkpoint_files(path)
        with open(config_file) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        config = {}
    return parse_step(path, config if isinstance(config, dict) else {})


def within(path: str, problem: str) -> str:
    """checkpoint_problem's line without the checkpoint's own path in front (the caller names it)."""
    for prefix in (f"{path}: ", f"{os.path.abspath(path)}: ", path + os.sep, os.path.abspath(path) + os.sep):
        if problem.startswith(prefix):
            return problem[len(prefix) :]
    return problem


def by_step(paths: list[str]) -> list[str]:
    """Oldest training step first; checkpoints without a step last, by path."""
    steps = {path: checkpoint_step(path) for path in paths}
    return sorted(paths, key=lambda p: (steps[p] is None, steps[p] or 0, p))


class Tracker:
    """What the watcher knows of each matched path between polls: the fingerprint it had,
    whether its problem was reported, whether it is finished (scored, skipped) or failed (kept
    with the fingerprint it failed with: retried only once its files change)."""

    def __init__(self, patterns: list[str]):
        self.patterns = patterns
        self.seen: dict[str, tuple] = {}
        self.reported: set[str] = set()
        self.finished: set[str] = set()
        self.failed: dict[str, tuple] = {}
        self.changing: list[str] = []  # complete at the last poll but written since the one before

    def poll(self, note: Callable[[str], None]) -> list[str]:
        """The paths complete and unchanged since the previous poll, oldest step first; the
        problem of a path not complete is passed to `note` the first time it is seen."""
        ready, self.changing = [], []
        for path in candidate_paths(self.patterns):
            if path in self.finished:
                continue
            before, now = self.seen.get(path), fingerprint(path)
            self.seen[path] = now
            if self.failed.get(path) == now:
                continue
            problem = checkpoint_problem(path)
            if problem is not None:
                if path not in self.reported:
                    self.reported.add(path)
                    note(f"waiting for {path}: {within(path, problem)}")
            elif before == now == fingerprint(path):  # and nothing written during the check itself
                ready.append(path)
            else:
                self.changing.append(path)
        return by_step(ready)

    def incomplete(self) -> list[str]:
        """Paths seen but neither finished nor failed: still being written, truncated or corrupt."""
        return [p for p in sorted(self.seen) if p not in self.finished and p not in self.failed]


# --------------------------------------------------------------------------- staging and signals


def remove_own_staging(out_dir: str) -> None:
    """Our own staging directory of out_dir, left when a signal or an error cut write_results short."""
    shutil.rmtree(results.staging_dir(out_dir, os.getpid()), ignore_errors=True)


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT/SIGTERM raise Stopped once; a second signal while stopping is ignored, so the
    cleanup runs to its end. The previous handlers come back on exit. Yields the signals received
    (a library may turn Stopped into its own error: the watcher checks this list)."""
    raised = []

    def handler(signum, frame):
        if not raised:
            raised.append(signum)
            raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield raised
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


# --------------------------------------------------------------------------- after each checkpoint


def change_against(previous_dir: str, out_dir: str) -> str:
    """'+0.120 (95% CI 0.010 to 0.230, better)': pooled chain tau of out_dir minus previous_dir
    with compare's paired-bootstrap interval (scoring/compare/baselines.py paired_row)."""
    row = paired_row(previous_dir, out_dir)
    if isinstance(row, str):
        return row
    delta, low, high = row["delta"], row["ci_low"], row["ci_high"]
    if row["n"] < 2:
        return f"{delta:+.3f} (one paired sample, no interval)"
    d = digits(delta, low, high)
    judged = judge(low, high).value
    return f"{delta:+.{d}f} (95% CI {low:+.{d}f} to {high:+.{d}f}, {judged}; n {row['n']})"


def step_label(step: int | None) -> str:
    return f"step {step}" if step is not None else "step ?"


def write_watch_report(out: str, newest: str | None, step: int | None) -> str:
    """Regenerate --out/report.html over every result under --out; the title names the newest
    checkpoint (the page has no per-point marker to set), when known."""
    title = f"specreplay watch: newest {newest} ({step_label(step)})" if newest else f"specreplay watch: {out}"
    return write_report([out], os.path.join(out, REPORT_NAME), title=title).path


# --------------------------------------------------------------------------- the watcher


class Watcher:
    """Scores the checkpoints a Tracker hands it, with one prepared target head, and does what
    follows each: its line, the report, the loggers."""

    def __init__(self, config: ScoreConfig, options: WatchOptions, signals: list[int] | None = None):
        self.config, self.options = config, options
        self.signals = signals if signals is not None else []  # stop_on_signals' list of signals received
        self.result = WatchResult()
        self.current: str | None = None  # the results directory being written
        self.owners: dict[str, str] = {}  # results directory -> checkpoint path
        self.steps: dict[str, int | None] = {}  # results directory -> step, for "previous"
        self.names: dict[str, str] = {}  # results directory -> checkpoint name, for the report's title
        self.baseline_dirs: dict[str, str] = {}  # baseline name -> its results directory
        self.shardset = ShardSet(config.shards)
        check_anchor_set(self.shardset, config)
        device, dtype = resolve_device_dtype(config.device, config.dtype, Dist())
        with timing.stage("prepare target head"):
            self.head = prepare_target_head(self.shardset.target_head(), device, dtype)
        self.loggers = open_configured_loggers(options.loggers)

    def say(self, line: str) -> None:
        if not self.options.quiet:
            self.options.echo(line)

    def process(self, path: str, tracker: Tracker) -> None:
        """Score one complete checkpoint (or find it scored), then its line, report and logs."""
        out_dir = os.path.join(self.config.out, results.result_dir_name(path))
        owner = self.owners.setdefault(out_dir, path)
        if owner != path:
            self.fail(path, tracker, f"{owner} already writes {out_dir}; score one of them into another --out")
            return
        remove_dead_staging(out_dir)
        if read_record(out_dir) is None:
            self.say(f"scoring {path} ({step_label(checkpoint_step(path))})")
        outcome = self.score(path, out_dir)
        if outcome.status == Status.FAILED:
            self.fail(path, tracker, outcome.error)
            return
        tracker.finished.add(path)
        self.steps[out_dir] = (outcome.record or {}).get("checkpoint", {}).get("step")
        self.names[out_dir] = outcome.name
        if outcome.status == Status.SKIPPED:
            self.result.skipped.append(path)
            self.say(f"already scored: {path} in {out_dir}")
        else:
            self.result.scored.append(path)
            self.after_scored(outcome)
        self.log([out_dir])

    def score(self, path: str, out_dir: str) -> Outcome:
        """score_checkpoint, with any error (a corrupt tensor file raises more than UserError) a
        failed outcome: one bad checkpoint never ends a watch that runs for days."""
        self.current = out_dir  # left set when Stopped passes through: the stop cleans it up
        try:
            outcome = score_checkpoint(
                path, self.shardset, self.head, out_dir, self.config, Dist(), self.options.progress
            )
        except Exception as error:  # noqa: BLE001 - reported in one line, the watch goes on
            remove_own_staging(out_dir)
            if self.signals:  # the stop arrived inside a library that made it its own error (pydantic's
                raise Stopped(self.signals[0]) from error  # schema builder): it is still the stop
            message = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
            outcome = Outcome(path, out_dir, Status.FAILED, error=message, name=path)
        self.current = None
        return outcome

    def score_baselines(self) -> None:
        """Score each --baseline once (found scored under --out on a restart), before any checkpoint;
        one that cannot be scored ends the watch before it starts."""
        for name in self.options.baselines:
            out_dir = os.path.join(self.config.out, results.result_dir_name(name))
            if read_record(out_dir) is None:
                self.say(f"scoring baseline {name}")
            outcome = self.score(name, out_dir)
            if outcome.status == Status.FAILED:
                raise UserError(f"--baseline {name}: {outcome.error}")
            self.baseline_dirs[outcome.name] = out_dir
            self.say(f"baseline {headline(outcome.name, outcome.summary)}")

    def fail(self, path: str, tracker: Tracker, error: str) -> None:
        tracker.failed[path] = tracker.seen.get(path, ())
        self.result.failed.append(path)
        retry = "" if self.options.once else " (tried again when its files change)"
        self.options.warn(f"error: {path}: {error}{retry}")

    def previous_dir(self, out_dir: str) -> str | None:
        """The results directory of the latest step before out_dir's, among those watched."""
        step = self.steps[out_dir]
        earlier = [(s, d) for d, s in self.steps.items() if d != out_dir and s is not None and step is not None]
        earlier = [(s, d) for s, d in earlier if s < step]
        return max(earlier)[1] if earlier else None

    def after_scored(self, outcome: Outcome) -> None:
        """The checkpoint's line (step, tau chain, best DDTree, change against the previous step),
        then the report. A report that cannot be written is a warning, not the watch's end."""
        step = self.steps[outcome.out_dir]
        previous = self.previous_dir(outcome.out_dir)
        change = (
            f"vs {step_label(self.steps[previous])}: {change_against(previous, outcome.out_dir)}"
            if previous is not None
            else "no earlier step scored to compare with"
        )
        self.options.echo(f"scored {step_label(step)}: {headline(outcome.name, outcome.summary)}; {change}")
        for name, base_dir in self.baseline_dirs.items():
            self.options.echo(f"  {Versus(step_label(step), name, paired_row(base_dir, outcome.out_dir)).line}")
        for line in floor_warning(outcome.summary, outcome.ckpt, self.config.shards, self.options.program):
            self.options.warn(line)
        self.report(outcome.name, step)

    def report(self, newest: str | None, step: int | None) -> None:
        """Rewrite --out/report.html. A report that cannot be written is a warning, not the watch's end."""
        try:
            self.say(f"report: {write_watch_report(self.config.out, newest, step)}")
        except Exception as error:  # noqa: BLE001 - the results are written; only the page is missing
            self.options.warn(f"warning: report not written: {type(error).__name__}: {error}")

    def report_if_nothing_new(self) -> None:
        """A --once run that scored nothing still leaves --out/report.html over the results there
        (written if missing, refreshed otherwise), so a cron job's page is there and current."""
        if self.result.scored or not results.results_dirs_below(self.config.out, ("summary", "run")):
            return
        stepped = [(s, d) for d, s in self.steps.items() if s is not None]
        newest = max(stepped)[1] if stepped else None
        self.report(self.names.get(newest), self.steps.get(newest))

    def log(self, out_dirs: list[str]) -> None:
        """Send results to the configured loggers. Skipped checkpoints too: log_results' ledger
        under --out (the one `specreplay log` keeps) says what was logged, so nothing goes twice
        and a checkpoint scored just before a kill is logged by the next run."""
        if self.loggers is None:
            return
        from scoring.track.loggers import log_results

        try:
            lines = log_results(out_dirs, self.loggers)
        except Exception as error:  # noqa: BLE001 - a tracker being down must not end the watch
            self.options.warn(
                f"warning: not logged ({type(error).__name__}: {error}); the next run, or "
                f"`specreplay log --results {self.config.out}`, logs what is missing"
            )
            return
        for line in lines:
            self.say(line)

    def close(self) -> None:
        for logger in self.loggers or []:
            logger.close()


def open_configured_loggers(options) -> list | None:
    """The loggers of LoggerOptions (scoring/track/loggers.py, imported only when one is asked for)."""
    if options is None:
        return None
    from scoring.track.loggers import open_loggers

    return open_loggers(options)


# --------------------------------------------------------------------------- the loop


def check_single_process() -> None:
    if dist_from_env().world > 1:
        raise UserError("watch runs in one process; start it with python -m specreplay, not torchrun")


def run_watch(config: ScoreConfig, options: WatchOptions) -> WatchResult:
    """Watch config.ckpts (globs) until a signal, or with options.once score what is complete
    now and return. Checkpoints already scored under config.out are skipped."""
    check_single_process()
    if options.once and not candidate_paths(config.ckpts):
        options.echo(f"no checkpoint matches {' '.join(config.ckpts)} yet; nothing to score")
        return WatchResult()
    watcher = None
    with stop_on_signals() as signals:
        try:
            watcher = Watcher(config, options, signals)
            watcher.score_baselines()
            watch_loop(watcher, Tracker(config.ckpts))
        except Stopped as stop:
            stopped_message(watcher, stop, options)
            result = watcher.result if watcher is not None else WatchResult()
            result.stopped_by = stop.signum
            return result
        finally:
            if watcher is not None:
                watcher.close()
    return watcher.result


def watch_loop(watcher: Watcher, tracker: Tracker) -> None:
    """Poll, score what is ready, sleep; --once stops after its second look."""
    options = watcher.options
    pause = min(options.interval, ONCE_SETTLE_S) if options.once else options.interval
    patterns, out = " ".join(tracker.patterns), watcher.config.out
    if options.once:
        watcher.say(f"looking once at {patterns} (two looks {pause:g} s apart, to skip files still being written)")
        watcher.say(f"results in {out}")
    else:
        watcher.say(f"watching {patterns} every {options.interval:g} s; results in {out}")
    for look in itertools.count():
        for path in tracker.poll(options.echo):  # problems are printed even with --quiet: once each
            watcher.process(path, tracker)
        if options.once and look >= 1:
            break
        time.sleep(pause)
    watcher.result.waiting = tracker.incomplete()
    for path in tracker.changing:
        watcher.say(f"not scored: {path} was still being written")
    watcher.report_if_nothing_new()


def stopped_message(watcher: Watcher | None, stop: Stopped, options: WatchOptions) -> None:
    """Remove the interrupted checkpoint's staging directory and say what happened."""
    name = signal.Signals(stop.signum).name
    current = watcher.current if watcher is not None else None
    if current is None:
        options.echo(f"stopped by {name}")
        return
    remove_own_staging(current)
    options.echo(
        f"stopped by {name} while scoring into {current}: nothing of it was kept; "
        f"run the same command again to score it"
    )

"""The `specreplay` console script: one click group, one module per subcommand, loaded lazily.

`specreplay --help` imports click and the command modules only (no torch, no pyarrow): each
command imports its stage inside its body. Every command shares one error policy: a
`UserError` (or a missing/forbidden path) prints `error: ...` and exits 2 with no traceback;
SPECREPLAY_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import warnings
from contextlib import contextmanager

import click

# verb -> module under specreplay.commands defining a click command of the same name (`import_`
# for `import`, a Python keyword)
COMMANDS = {
    "extract": "extract",
    "import": "imports",
    "inspect": "inspect",
    "score": "score",
    "fit": "fit",
    "compare": "compare",
    "compare-online": "compare_online",
    "diagnose": "diagnose",
    "profile": "profile",
    "speed": "speed",
    "report": "report",
    "log": "log",
    "watch": "watch",
}
# commands whose option takes a glob: the shell expands an unquoted one into extra arguments
GLOB_OPTIONS = {"score": "--ckpt", "watch": "--ckpt"}
PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def debug() -> bool:
    return bool(os.environ.get("SPECREPLAY_DEBUG"))


def fail(error: BaseException) -> None:
    """Print a user error as one line and exit 2; re-raise under SPECREPLAY_DEBUG=1."""
    if debug():
        raise error
    click.echo(f"error: {error}", err=True)
    sys.exit(2)


def glob_hint(error: click.UsageError, command: str | None) -> None:
    """click's "Got unexpected extra argument" after a glob option gets the likely cause and fix."""
    option = GLOB_OPTIONS.get(command or "")
    if option and "unexpected extra argument" in error.message:
        error.message += (
            f"; an unquoted glob after {option} is expanded by the shell into several paths: "
            f"quote it ({option} 'runs/*/step_*') or repeat {option}"
        )


def interrupted(command: str | None, stop: BaseException | None = None) -> None:
    """Ctrl-C or SIGTERM: say what happened to the work and exit 130 (128 + SIGINT) or 143 (128 +
    SIGTERM), not click's bare "Aborted!" with 1, the code `score` uses for "some checkpoints
    failed". A stage that put its finished work on disk says how much (pipeline.common.errors.Interrupted)."""
    from pipeline.common.errors import Interrupted, Terminated

    if debug():
        raise stop or KeyboardInterrupt
    name = " ".join(["specreplay", *([command] if command else [])])
    kept = (
        stop.kept
        if isinstance(stop, Interrupted)
        else "what it had finished is kept (shards and results directories land whole)"
    )
    click.echo(
        f"interrupted: {name} stopped; {kept}, the piece in progress was discarded; run the same command again to finish",
        err=True,
    )
    terminated = isinstance(stop, Terminated) or (isinstance(stop, Interrupted) and stop.signal == "SIGTERM")
    # Exit here, at once: everything that had to let go (locks, staging) did on the way up, and a
    # normal interpreter exit after a KeyboardInterrupt may still end by SIGINT (-2, seen under load).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(143 if terminated else 130)


def one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning as the project prints its own: `warning: ...`, without the source line that
    Python's default format adds (SPECREPLAY_DEBUG=1 keeps that format, with the place)."""
    if debug():
        return _default_format(message, category, filename, lineno, line)
    return f"warning: {message}\n"


_default_format = warnings.formatwarning


@contextmanager
def interrupts_noted():
    """An event set by Ctrl-C while the block runs (Python's SIGINT handler back after it). The
    KeyboardInterrupt itself can be swallowed by native code it lands in (safetensors turns it into
    a ValueError): an error raised after Ctrl-C is its echo and ends as the interrupt does. Only in
    the main thread (signals reach no other) and over Python's own handler (a caller's, e.g. a test
    harness's, stays in charge)."""
    seen = threading.Event()
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield seen
        return

    from pipeline.common.errors import note_stop

    note_stop(None)

    def handler(signum, frame):
        seen.set()
        note_stop("SIGINT")  # for a stage whose native code turns the KeyboardInterrupt into another error
        signal.default_int_handler(signum, frame)

    def terminate(signum, frame):  # SIGTERM stops the work where it is, as Ctrl-C does
        from pipeline.common.errors import Terminated

        seen.set()
        note_stop("SIGTERM")
        raise Terminated("SIGTERM")

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, handler)
    if previous is signal.SIG_DFL:  # a caller's own SIGTERM handler (watch's) stays in charge
        signal.signal(signal.SIGTERM, terminate)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, previous)


class LazyGroup(click.Group):
    """Subcommands imported on first use, so one verb never loads another's stage."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"specreplay.commands.{COMMANDS[name]}")
        attribute = name.replace("-", "_")  # compare-online -> compare_online
        return getattr(module, attribute, None) or getattr(module, f"{attribute}_")

    def invoke(self, ctx):
        from pipeline.common.errors import UserError

        warnings.formatwarning = one_line_warning
        try:
            with interrupts_noted() as seen:
                return super().invoke(ctx)
        except KeyboardInterrupt as stop:
            interrupted(ctx.invoked_subcommand, stop)
        except click.UsageError as error:
            glob_hint(error, ctx.invoked_subcommand)
            raise
        except Exception as error:
            if seen.is_set():
                interrupted(ctx.invoked_subcommand)
            if isinstance(error, (UserError, *PATH_ERRORS)):
                fail(error)
            raise
        finally:  # in-process callers (tests, CliRunner) get Python's format back
            warnings.formatwarning = _default_format


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="specreplay")
def main():
    """Extract a target model's features once; score any DFlash drafter against them offline.

    \b
    Typical use:
      specreplay extract --model smollm2 --prompts default --out data/shards/smollm2
      specreplay import data/sharegpt --format speculators --model path/to/target   # captured elsewhere
      specreplay score --ckpt path/to/drafter --shards data/shards/smollm2 --out data/results
      specreplay inspect data/shards/smollm2
      specreplay compare data/results/run7_step_1000 data/results/run7_step_2000
      specreplay compare-online data/results/run7_step_2000 --server http://127.0.0.1:8080   # served tau low?
      specreplay diagnose --ckpt runs/run7/step_2000 --shards data/shards/smollm2   # tau looks wrong?
      specreplay profile --target target.gguf --out cpu.json   # the serving side's costs, measured here
      specreplay speed data/results --profile cpu.json   # fastest configuration per batch size
      specreplay report data/results --out report.html
      specreplay watch --ckpt 'runs/run7/step_*' --shards data/shards/smollm2 --out data/results \\
          --tensorboard runs/run7/logs      # beside a training run
    """

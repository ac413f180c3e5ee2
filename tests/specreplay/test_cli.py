"""The console script's error policy around Ctrl-C."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers.processes import REPO

# A command whose Ctrl-C lands in code that turns the KeyboardInterrupt into another error, as
# safetensors' native loader does ("could not determine the shape of object type ...").
SWALLOWING = textwrap.dedent(
    """
    import os, signal, sys, types, click
    from specreplay import cli

    @click.command()
    @click.option("--after", default="ValueError")
    def swallow(after):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_kill(signal.pthread_self(), 0)  # let the handler run here
            for _ in range(10**7):
                pass
        except KeyboardInterrupt:
            if after == "ValueError":
                raise ValueError("could not determine the shape")
            from pipeline.common.errors import UserError
            raise UserError("a user error after the interrupt")
        raise SystemExit("the interrupt never arrived")

    module = types.ModuleType("specreplay.commands.swallow")
    module.swallow = swallow
    sys.modules[module.__name__] = module
    cli.COMMANDS["swallow"] = "swallow"
    cli.main(["swallow", *sys.argv[1:]])
    """
)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SWALLOWING, *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_an_error_raised_by_the_interrupt_exits_130_with_the_interrupt_line():
    for after in ("ValueError", "UserError"):
        done = run("--after", after)
        assert done.returncode == 130, done.stderr
        assert done.stderr.startswith("interrupted: specreplay swallow stopped;"), done.stderr
        assert "Traceback" not in done.stderr and "error:" not in done.stderr


def test_an_error_without_an_interrupt_is_still_an_error():
    source = SWALLOWING.replace("os.kill(os.getpid(), signal.SIGINT)", "raise KeyboardInterrupt")
    done = subprocess.run(
        [sys.executable, "-c", source, "--after", "UserError"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    # a KeyboardInterrupt raised by code, not by a signal, turned into a user error: that error
    assert done.returncode == 2 and done.stderr.startswith("error: a user error after the interrupt"), done.stderr

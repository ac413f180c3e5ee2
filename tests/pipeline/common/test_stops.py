"""A stop's echo: native code a KeyboardInterrupt lands in may turn it into another error (safetensors:
a ValueError). After the command line's handler saw a stop, a stage reads such an error as that stop
(and keeps its work); before one, or after a new command's start, the error is the error."""

from __future__ import annotations

import pytest

from pipeline.common.errors import Terminated, note_stop, stop_behind


@pytest.fixture(autouse=True)
def no_stop_left():
    yield
    note_stop(None)


def test_an_error_with_no_stop_seen_is_the_error():
    note_stop(None)
    assert stop_behind(ValueError("bad file")) is None


@pytest.mark.parametrize(("seen", "kind"), [("SIGINT", KeyboardInterrupt), ("SIGTERM", Terminated)])
def test_an_error_after_a_stop_is_that_stop(seen, kind):
    note_stop(seen)
    error = ValueError("safetensors: interrupted")
    stop = stop_behind(error)
    assert type(stop) is kind and stop.__context__ is error


def test_a_new_command_forgets_the_last_stop():
    note_stop("SIGINT")
    note_stop(None)
    assert stop_behind(OSError("disk")) is None

"""A stop (Ctrl-C, SIGTERM) that arrives while the shard writer runs a step that must be whole is
delivered when the step ends, not in its middle."""

from __future__ import annotations

import os
import signal

import pytest

from pipeline.shards.stops import stops_held


def test_a_ctrl_c_inside_the_block_is_raised_after_it():
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with stops_held():
            os.kill(os.getpid(), signal.SIGINT)
            steps.append("after the signal")  # still runs: the interrupt waits
    assert steps == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is back


def test_a_sigterm_goes_to_the_handler_that_was_in_place():
    got = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        with stops_held():
            os.kill(os.getpid(), signal.SIGTERM)
            assert got == []
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)

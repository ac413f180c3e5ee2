"""Fixtures the engine-parity modules share."""

from __future__ import annotations

import pytest

from tests.helpers import llama_engine as engine


@pytest.fixture(scope="module")
def converter():
    """llama.cpp's converter process, started once per module that asks for it."""
    started = engine.Converter()
    yield started
    started.close()

"""pytest fixtures and hooks for the whole suite. The helpers they and the tests use live in
tests/helpers/ (import them as `from tests.helpers.models import build_tiny_qwen3`).

  hook      pytest_configure: a missing reference package stops the suite at once, one line
            saying what to install (the tests that need it are never skipped)
  fixtures  tiny_qwen3_dir, tiny_qwen35_hybrid_dir, tiny_qwen35_vlm_dir (session scope, return
            str paths; tests/helpers/models.py builds them)
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.helpers.models import build_tiny_qwen3, build_tiny_qwen35_hybrid, build_tiny_qwen35_vlm

# The public reference every parity test compares with (PyPI dflash 0.1.0, installed with --no-deps
# by `make setup`): without it those tests cannot run, and a suite that skipped them would pass.
REFERENCE_PACKAGE = "dflash"


@pytest.hookimpl(tryfirst=True)  # before the terminal reporter starts: the message is the one line printed
def pytest_configure(config):
    if importlib.util.find_spec(REFERENCE_PACKAGE) is None:
        pytest.exit(
            f"reference package {REFERENCE_PACKAGE} is missing: run `make setup` (it installs dflash==0.1.0 with --no-deps)",
            returncode=3,
        )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen35_hybrid_dir(tmp_path_factory) -> str:
    return build_tiny_qwen35_hybrid(tmp_path_factory.mktemp("tiny_qwen35_hybrid"))


@pytest.fixture(scope="session")
def tiny_qwen35_vlm_dir(tmp_path_factory) -> str:
    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny_qwen35_vlm"))

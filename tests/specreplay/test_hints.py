"""The "next:" hints after extract and fit: the program named as the user can type it (the venv
is not activated after `make setup`), and the one-directory-per-checkpoint results layout."""

from __future__ import annotations

import os
import re
import sys

import pytest

from specreplay import hints
from specreplay.commands.extract import next_steps
from specreplay.commands.fit import next_hint
from specreplay.hints import program

MANIFEST = {"totals": {"samples": 16, "tokens": 3000, "bytes": 5 << 20}}


@pytest.fixture
def venv_script(tmp_path, monkeypatch):
    """Run as .venv/bin/specreplay from the repository root, with the venv not on PATH."""
    script = tmp_path / ".venv" / "bin" / "specreplay"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "extract"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    return script


def test_program_is_the_venv_script_when_not_on_path(venv_script):
    assert program() == os.path.join(".venv", "bin", "specreplay")


def test_program_under_python_m(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/specreplay/__main__.py", "extract"])
    assert program().endswith(" -m specreplay")


@pytest.fixture
def at_the_repository(venv_script, monkeypatch):
    """The working directory is the repository's root (where the Makefile and data/ are)."""
    monkeypatch.setattr(hints, "REPOSITORY", str(venv_script.parents[2]))


def test_extract_hints(at_the_repository):
    text = next_steps("data/shards/smollm2-default", MANIFEST)
    lines = text.splitlines()
    assert lines[0] == "data/shards/smollm2-default: 16 samples, 3000 tokens, 5.0 MiB"
    assert lines[1] == "next:" and "Next" not in text
    assert lines[2] == "  .venv/bin/specreplay inspect data/shards/smollm2-default"
    assert (
        ".venv/bin/specreplay score --ckpt path/to/drafter --shards data/shards/smollm2-default --out data/results"
        in lines[3]
    )
    assert "make score CKPT=path/to/drafter SHARDS=data/shards/smollm2-default" in lines[4]
    assert not any(re.search(r"(^|[\s(])specreplay ", line) for line in lines)  # never a bare `specreplay`


def test_fit_hint(at_the_repository):
    text = next_hint("runs/tiny/step_300", "data/shards/smollm2-default")
    first, second = text.splitlines()
    assert first.startswith(
        "next: .venv/bin/specreplay score --ckpt runs/tiny/step_300 --shards data/shards/smollm2-default "
        "--out data/results"
    )
    assert first.endswith("results in data/results/tiny_step_300")
    assert "make score CKPT=runs/tiny/step_300 SHARDS=data/shards/smollm2-default" in second
    assert next_hint("runs/tiny/step_300/", "s").splitlines()[0].endswith("data/results/tiny_step_300")


def test_hints_outside_the_repository_name_only_what_works_there(venv_script):
    """Run from another directory: no `make` target and no data/ of the repository's in a hint."""
    for text in (next_steps("shards/x", MANIFEST), next_hint("runs/tiny/step_300", "shards/x")):
        assert "make " not in text and "data/results" not in text, text
        assert "--out results" in text


def test_the_model_cache_is_per_user_and_overridable(monkeypatch, tmp_path):
    """A GGUF target is dequantized into the user's cache (XDG's, else ~/.cache), not into the
    repository or the working directory; SPECREPLAY_MODEL_CACHE overrides it."""
    from pipeline.common.gguf_cache import model_cache_dir

    monkeypatch.delenv("SPECREPLAY_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_cache_dir() == tmp_path / "xdg" / "specreplay" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_cache_dir() == tmp_path / "home" / ".cache" / "specreplay" / "models"
    monkeypatch.setenv("SPECREPLAY_MODEL_CACHE", str(tmp_path / "mine"))
    assert model_cache_dir() == tmp_path / "mine"

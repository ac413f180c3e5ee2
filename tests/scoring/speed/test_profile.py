"""`specreplay profile`: a cost profile measured by llama.cpp's real llama-bench (make setup builds
it), on the real SmolLM2-135M GGUF the package ships; what `speed` then reads."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from gguf import GGUFReader

from pipeline.common.llama_cpp import installed_binary
from pipeline.extract.target import smollm2_gguf_path
from scoring.speed.profile import load_profile
from specreplay.cli import main


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    assert installed_binary("llama-bench").is_file(), "llama-bench is not built: run `make setup`"
    gguf = str(smollm2_gguf_path())
    out = tmp_path_factory.mktemp("profile") / "cpu.json"
    args = ["profile", "--target", gguf, "--draft", f"draft={gguf}", "--tokens", "1-2,4", "--context", "8"]
    run = CliRunner().invoke(main, [*args, "--reps", "1", "--threads", "1", "--out", str(out)])
    assert run.exit_code == 0, run.output
    return gguf, out, args


def test_a_drafter_timed_inside_llama_server_is_one_row_per_k(measured):
    """draft-simple (the target as its own draft model) served at K 2 and 3: a pass is its draft
    call over K, timed by the server's own counters after a warm-up request, one row (the mean
    over the K) for its one-token pass; the logs are kept."""
    gguf, out, _ = measured
    served = out.parent / "served.json"
    args = ["profile", "--target", gguf, "--tokens", "1", "--context", "8", "--reps", "1", "--threads", "1"]
    serve = ["--serve", f"draft={gguf}", "--serve-drafts", "2-3", "--serve-requests", "1"]
    run = CliRunner().invoke(main, [*args, *serve, "--out", str(served)])
    assert run.exit_code == 0, run.output
    profile = load_profile(str(served))
    assert [(d.family, d.tokens) for d in profile.file.drafters] == [("draft", 1)]
    assert "drafters timed inside llama-server: draft" in profile.file.measured.notes
    logs = sorted(p.name for p in (out.parent / "served-logs").iterdir())
    assert logs == ["server-draft-2.log", "server-draft-3.log"]
    assert all("statistics     draft-simple" in (out.parent / "served-logs" / name).read_text() for name in logs)
    both = CliRunner().invoke(main, [*args, *serve, "--draft", f"draft={gguf}", "--out", str(served) + "2"])
    assert both.exit_code == 2 and "time each drafter one way" in both.output


def test_the_profile_holds_every_count_asked_and_the_gguf_s_sizes(measured):
    """The sizes as the gguf package's own reader reads the file (not this project's reader)."""
    gguf, out, _ = measured
    profile = load_profile(str(out))  # it validates as `speed` reads it
    assert [(p.batch, p.tokens) for p in profile.file.verify] == [(1, 1), (1, 2), (1, 4)]
    assert [(d.family, d.tokens) for d in profile.file.drafters] == [("draft", 1)]
    assert profile.file.measured.context_len == 8
    reader = GGUFReader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    layers = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    hidden = int(reader.fields[f"{arch}.embedding_length"].parts[-1][0])
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    target = profile.file.target
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (layers, hidden, vocab)


def test_an_existing_profile_is_not_replaced_and_bad_counts_are_refused(measured):
    _, out, args = measured
    before = out.read_text()
    again = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert again.exit_code == 2 and f"error: {out} exists" in again.output
    assert out.read_text() == before and json.loads(before)["verify"]
    unserved = CliRunner().invoke(
        main, ["profile", "--target", args[2], "--serve", f"ngram={args[2]}", "--out", str(out) + "3"]
    )
    assert unserved.exit_code == 2 and "llama-server serves no 'ngram' drafter" in unserved.output
    for tokens in ("0-3", "5-2", "x"):
        bad = CliRunner().invoke(main, ["profile", "--target", args[2], "--tokens", tokens, "--out", str(out) + "2"])
        assert bad.exit_code == 2 and "--tokens" in bad.output, bad.output


STEP_LINE = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I slot .*?\| task (\d+) \| accepted", re.M)


def step_lines(logs) -> dict[tuple[str, int], list[float]]:
    """(log, task) -> the seconds stamped on its per-step lines (LLAMA_TRACE)."""
    found: dict[tuple[str, int], list[float]] = {}
    for log in logs.iterdir():
        for m in STEP_LINE.finditer(log.read_text()):
            minutes, seconds, ms, us, task = map(int, m.groups())
            found.setdefault((log.name, task), []).append(minutes * 60 + seconds + ms / 1e3 + us / 1e6)
    return found


def task_span(stamps: list[float]) -> tuple[float, float]:
    return min(stamps), max(stamps)


def test_the_target_timed_inside_llama_server_gives_every_count_and_plain_decoding(measured):
    """--in-server: plain decoding, the speculative step without a draft (1 token) and draft-simple
    steps of 1 and 2 drafts less their draft calls (2 and 3 tokens), from the server's own timers."""
    gguf, out, _ = measured
    path = out.parent / "in-server.json"
    args = ["profile", "--target", gguf, "--in-server", "--tokens", "1-3", "--context", "8", "--threads", "1"]
    run = CliRunner().invoke(main, [*args, "--serve-requests", "2", "--out", str(path)])
    assert run.exit_code == 0, run.output
    profile = load_profile(str(path))
    assert [(p.batch, p.tokens) for p in profile.file.verify] == [(1, 1), (1, 2), (1, 3)]
    # the servers' requests went round (the machine's drift lands on every row alike): ordered by
    # time, the requests of the 2- and 3-token servers alternate, a warm-up and 2 requests each
    spans = sorted((*task_span(lines), name) for name, lines in step_lines(out.parent / "in-server-logs").items())
    order = [log for _, _, (log, _) in spans]
    assert len(order) == 6 and all(a != b for a, b in zip(order, order[1:])), spans
    assert list(profile.plain) == [1] and "llama-server's own step timers" in profile.file.measured.engine
    logs = sorted(p.name for p in (out.parent / "in-server-logs").iterdir())
    assert logs == ["server-plain.log", "server-verify-1.log", "server-verify-2.log", "server-verify-3.log"]

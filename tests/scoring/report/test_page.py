"""`specreplay report` on synthetic results directories (the scorer is never run): the HTML is
well formed and self-contained, names every checkpoint and dataset, every embedded image is a
real PNG, prompt text is escaped, missing pieces become notes, and headless Chromium renders a
page that is not blank."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import struct

import numpy as np
import polars as pl
import pytest
import torch
from click.testing import CliRunner

from scoring.methods.chain import CHAIN
from scoring.methods.ddtree import DDTREE
from scoring.methods.registry import method_names
from scoring.replay.metrics import wilson_interval
from scoring.results import (
    ALL_DATASETS,
    FILES,
    anchors_schema,
    rows_table,
    write_table,
)
from specreplay.cli import main
from tests.helpers.browser import check_html, chromium_screenshot, needs_chromium
from tests.helpers.fake_results import write_fake_results

BLOCK = 8  # block size B: produced in 1..8, block positions 1..7
DATASETS = ("gsm8k", "humaneval")
BUDGETS = (4, 8, 16)
EVIL = "<script>alert('x')</script> & \"quotes\""
LONG = "Explain, step by step, " + "why the drafter keeps failing on this prompt. " * 12


# ---------------------------------------------------------------- synthetic results


def _walk_produced(rng, p: float, response_len: int, block: int = BLOCK) -> list[int]:
    """A chain walk: each draft token accepted with probability p until the first rejection."""
    produced, done = [], 0
    while done < response_len:
        accepted = 0
        while accepted < block - 1 and rng.random() < p:
            accepted += 1
        step = min(accepted + 1, response_len - done)
        produced.append(step)
        done += step
    return produced


def _anchor_rows(rng, p: float, dataset: str, sample_id: str, response_len: int, block: int = BLOCK) -> list[dict]:
    """Every anchor of one response: a chain streak with acceptance p per position. The block is
    cut one short (as the token budget would cut it), so block position BLOCK - 1 is never
    reached and its rate is NaN, and few anchors reach the positions before it."""
    rows = []
    for offset in range(response_len - 1):
        known = min(block - 2, response_len - 1 - offset)
        accepted = 0
        while accepted < known and rng.random() < p:
            accepted += 1
        rows.append(
            {
                "dataset": dataset,
                "sample_id": sample_id,
                "anchor": 30 + offset,
                "anchor_offset": offset,
                "block_len": known + 1,
                "accepted_len": accepted,
                "produced_chain": accepted + 1,
                "draft_match": [k < accepted for k in range(known)],
            }
        )
    return rows


def accept_rates(anchor_rows: list[dict], block: int = BLOCK) -> tuple[list[int], list[float]]:
    """(reached, rate) per block position 1..BLOCK-1, as scoring/replay/metrics.py counts them."""
    reached = [
        sum(r["accepted_len"] >= k - 1 and len(r["draft_match"]) >= k for r in anchor_rows) for k in range(1, block)
    ]
    accepted = [sum(r["accepted_len"] >= k for r in anchor_rows) for k in range(1, block)]
    return reached, [a / n if n else float("nan") for a, n in zip(accepted, reached)]


def _summary_rows(samples_df: pl.DataFrame, anchor_rows: list[dict], budgets, block: int = BLOCK) -> list[dict]:
    """summary.parquet's rows for the fake samples: per (dataset, method), plus (all)."""
    summary_rows = []
    for dataset in list(DATASETS) + [ALL_DATASETS]:
        subset = samples_df if dataset == ALL_DATASETS else samples_df.filter(pl.col("dataset") == dataset)
        for method in method_names({"ddtree": budgets}):
            m = subset.filter(pl.col("method") == method)
            row = {
                "dataset": dataset,
                "method": method,
                "tau": float(m["tau"].mean()),
                "samples": m.height,
                "samples_without_steps": 0,
                "steps": int(m["steps"].sum()),
                "tokens_produced": int(m["tokens_produced"].sum()),
                "inexact_samples": 0,
                "argmax_mismatches": 0,
                "exact": True,
                "anchors": 500,
                "anchor_accepted_len_mean": float(m["tau"].mean()) - 1.1,
            }
            if method == CHAIN:
                # the last position is never reached in this run: NaN, as the scorer writes it
                mine = [r for r in anchor_rows if dataset == ALL_DATASETS or r["dataset"] == dataset]
                reached, rates = accept_rates(mine, block)
                row["accept_rate_by_position"] = rates
                low, high = wilson_interval(torch.tensor(rates) * torch.tensor(reached), torch.tensor(reached))
                row["accept_rate_low_by_position"], row["accept_rate_high_by_position"] = low.tolist(), high.tolist()
            summary_rows.append(row)
    return summary_rows


def write_results(
    directory,
    name: str,
    step: int | None,
    p: float,
    seed: int,
    budgets=BUDGETS,
    walk: bool = True,
    samples: bool = True,
    run_json: bool = True,
    anchors: bool = True,
    block: int = BLOCK,
) -> None:
    """One results directory as `specreplay score` writes it, with the README columns the report reads."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    identity = {"checkpoint": name, "checkpoint_hash": f"{seed:016x}", "checkpoint_step": step}
    walk_rows, sample_rows, anchor_rows = [], [], []
    for dataset in DATASETS:
        for i in range(6):
            sample_id = f"{dataset}-{i}"
            response_len = 20 + 7 * i
            anchor_rows += _anchor_rows(rng, p, dataset, sample_id, response_len, block)
            produced = _walk_produced(rng, p - 0.08 * (i == 0), response_len, block)
            walk_rows += [
                {
                    "dataset": dataset,
                    "sample_id": sample_id,
                    "method": "chain",
                    "step": k,
                    "anchor": 30 + sum(produced[:k]),
                    "produced": n,
                    "accepted_len": n - 1,
                }
                for k, n in enumerate(produced)
            ]
            # sample 0 has the lowest acceptance, so it is among the worst prompts
            text = {0: EVIL + " " + LONG, 1: LONG}.get(i, f"{dataset} question number {i}: what is {i} + {i}?")
            for method in method_names({"ddtree": budgets}):
                bonus = 0.0 if method == CHAIN else 0.25 * np.log2(DDTREE.setting_of(method) / 4) - 0.05
                sample_rows.append(
                    {
                        "dataset": dataset,
                        "sample_id": sample_id,
                        "method": method,
                        "prompt_len": 30,
                        "response_len": response_len,
                        "finish_reason": "eos",
                        "greedy": True,
                        "argmax_mismatches": 0,
                        "exact": True,
                        "steps": len(produced),
                        "tokens_produced": response_len,
                        "tau": float(np.mean(produced)) + bonus,
                        "prompt_text": text,
                    }
                )
    summary_rows = _summary_rows(pl.DataFrame(sample_rows), anchor_rows, budgets, block)
    run = {
        "checkpoint": {"name": name, "step": step},
        "device": "cpu",
        "dtype": "float32",
        "shards": {"uri": "/data/shards/synthetic", "identity": "synthetic-0001", "samples": 12},
        "wall_time_s": 1.25,
    }
    write_fake_results(
        directory,
        identity,
        sample_rows if samples else [],
        summary_rows,
        walk=walk_rows if walk else None,
        run=run if run_json else None,
    )
    if not samples:
        os.remove(os.path.join(directory, FILES["samples"]))
    if anchors:
        write_table(
            rows_table([{**identity, **r} for r in anchor_rows], anchors_schema({"ddtree": budgets})),
            str(directory),
            "anchors",
        )


CHECKPOINTS = [("run/step_100", 100, 0.45), ("run/step_200", 200, 0.6), ("run/step_300", 300, 0.72)]


@pytest.fixture(scope="module")
def results_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("report") / "results"
    for seed, (name, step, p) in enumerate(CHECKPOINTS):
        write_results(root / f"run_step_{step}", name, step, p, seed)
    return root


@pytest.fixture(scope="module")
def built(results_root):
    out = results_root.parent / "out" / "report.html"
    result = CliRunner().invoke(
        main,
        ["report", str(results_root), "--out", str(out), "--title", "Synthetic run", "--worst", "5"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return out, out.read_text(encoding="utf-8"), result.output


# ---------------------------------------------------------------- checkers


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; asserts the PNG signature."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------- tests


def test_html_is_valid_self_contained_and_complete(built):
    out, text, output = built
    assert output.strip().endswith(str(out))
    checker = check_html(text)
    visible = "".join(checker.text)
    for name, _, _ in CHECKPOINTS:
        assert name in visible
    for dataset in DATASETS + ("(all)",):
        assert dataset in visible
    for heading in (
        "Summary",
        "Acceptance length per step",
        "Acceptance per block position",
        "τ against DDTree budget",
        "τ against training step",
        "Worst prompts",
        "Inputs",
        "How to read this",
    ):
        assert heading in visible
    assert "Synthetic run" in visible and "tokens per step, bonus-inclusive" in visible
    assert "τ DDTree-N" in visible and "N=16" in visible and 'title="τ DDTree-16: ' in text
    # four plots, each a real PNG of sensible size
    assert len(checker.images) == 4
    for src in checker.images:
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        width, height = png_size(data)
        assert width >= 400 and height >= 200 and len(data) > 10_000
    # nothing fetched from anywhere
    assert not [link for link in checker.links if not link.startswith(("data:", "#"))]
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", text, re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text, re.I)


def test_prompts_are_escaped_ranked_and_expandable(built):
    _, text, _ = built
    assert "<script>" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quotes&quot;" in text
    assert "<details>" in text and "why the drafter keeps failing" in text
    worst = text.split("<h2>Worst prompts</h2>", 1)[1].split("<h2", 1)[0]
    assert worst.count("<tr>") == 1 + 5  # header + --worst 5
    assert "run/step_300" in worst  # ranked under the latest checkpoint
    taus = [float(x) for x in re.findall(r"<tr><td>\d+</td><td>[^<]*</td><td>[^<]*</td><td>([\d.]+)</td>", worst)]
    assert len(taus) == 5 and taus == sorted(taus)
    assert " → " in worst  # the same sample's tau through earlier checkpoints
    assert "<th>Exact walk</th>" in worst and "<td>yes</td>" in worst


def test_missing_pieces_become_notes(tmp_path):
    # no step, no DDTree, no walk, no samples, no run.json: still a report, with notes
    write_results(
        tmp_path / "a", "drafter-a", None, 0.5, 1, budgets=(), walk=False, samples=False, run_json=False, anchors=False
    )
    write_results(tmp_path / "b", "drafter-b", None, 0.6, 2, budgets=(), walk=False, samples=False, run_json=False)
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    check_html(text)
    assert text.count("<img") == 1  # only acceptance per position is left
    for note in ("No walk.parquet", "No DDTree budgets", "No checkpoint carries a training step", "No samples.parquet"):
        assert note in text
    assert "drafter-a" in text and "drafter-b" in text
    assert "No anchors.parquet for drafter-a" in text  # so its points carry no n and none is greyed


def _section_of(text: str, heading: str) -> str:
    return text.split(f">{heading}</h2>", 1)[1].split("<h2", 1)[0]


def test_acceptance_by_position_shows_n_and_greys_thin_points(built, results_root):
    _, text, _ = built
    section = _section_of(text, "Acceptance per block position")
    assert "fewer than 30 anchors" in section  # the threshold is stated
    rows = position_rows(section)
    assert [re.sub("<wbr>", "", label) for label, _ in rows] == [name for name, _, _ in CHECKPOINTS]
    for (name, step, _), (_, cells) in zip(CHECKPOINTS, rows):
        # n per position from the anchors written, independently of the report's code
        anchors = pl.read_parquet(results_root / f"run_step_{step}" / FILES["anchors"])
        expected = accept_rates(anchors.to_dicts())[0]
        shown = re.findall(r"<td( class=\"few\"[^>]*)?>(\d+)</td>", cells)
        assert [int(n) for _, n in shown] == expected, name
        assert [bool(few) for few, _ in shown] == [n < 30 for n in expected], name
    assert any(n < 30 for n in expected) and 'class="few"' in section  # the fixture has thin positions


def position_rows(section: str, row: str = "n") -> list[tuple[str, str]]:
    """(checkpoint label, that checkpoint's `row` cells) of the per-position table in `section`."""
    table = section.split('<table class="reach">', 1)[1].split("</table>", 1)[0]
    pattern = (
        rf'<tr class="rate"><td rowspan="3">(.*?)</td>.*?<tr class="{row}"><td class="what"[^>]*>[^<]*</td>(.*?)</tr>'
    )
    if row == "rate":
        pattern = r'<tr class="rate"><td rowspan="3">(.*?)</td><td class="what"[^>]*>[^<]*</td>(.*?)</tr>'
    return [(label.replace("<wbr>", ""), cells) for label, cells in re.findall(pattern, table, re.S)]


def test_histogram_legend_names_tau_and_the_per_step_mean(results_root, monkeypatch):
    from scoring.report import plots as report_plots
    from scoring.report.page import find_results_dirs, load_results

    figures = []
    monkeypatch.setattr(report_plots, "_png", lambda fig: figures.append(fig) or b"")
    results = load_results(find_results_dirs([str(results_root)]))
    report_plots.plot_acceptance_histogram(results)
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    summary = pl.read_parquet(results_root / "*" / FILES["summary"]).filter(
        (pl.col("dataset") == ALL_DATASETS) & (pl.col("method") == CHAIN)
    )
    for name, tau in zip(summary["checkpoint"], summary["tau"]):
        entry = next(e for e in legend if e.startswith(name + " "))
        assert f"τ {tau:.3f}" in entry and "per-step mean" in entry  # the table's tau, the other number named


def test_layout_scrolls_the_summary_and_wraps_identifiers(built):
    _, text, _ = built
    assert '<div class="scroll"><table class=summary>' in text
    assert "break-all" not in text  # identifiers no longer break mid-word
    inputs = _section_of(text, "Inputs")
    assert 'class="path">' in inputs and "/<wbr>" in inputs and "_<wbr>" in inputs
    assert "keep-all" in text and "overflow-wrap:anywhere" in text


def test_user_message_is_found_in_chat_templates():
    from scoring.prompts import user_message

    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    chatml = (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert user_message(chatml) == "What is 2 + 2?"
    qwen3 = "<|im_start|>user\nHi\nthere<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert user_message(qwen3) == "Hi\nthere"
    llama3 = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nName a prime.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert user_message(llama3) == "Name a prime."
    assert user_message("<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n") == "Hello"
    # a system block with no recognisable user turn: the rest, without the assistant header
    assert (
        user_message(f"<|im_start|>system\n{system}<|im_end|>\nplain question<|im_start|>assistant\n")
        == "plain question"
    )
    assert user_message("no template at all") == "no template at all"
    assert user_message(None) == ""


def _dedupe_tree(root, newer_samples: int | None = None):
    """The same checkpoint (same seed, so same hash) scored twice on the same shards, in two places,
    plus another checkpoint; returns (old copy, new copy)."""
    old, new = root / "run_step_300", root / "nested" / "run_step_300"
    write_results(old, "run/step_300", 300, 0.72, 5)
    write_results(new, "run/step_300", 300, 0.72, 5)
    write_results(root / "run_step_100", "run/step_100", 100, 0.45, 6)
    os.utime(old / FILES["run"], (1_000_000_000, 1_000_000_000))  # the old layout's run is older
    if newer_samples is not None:
        run = json.loads((new / FILES["run"]).read_text())
        run["shards"]["samples"] = newer_samples
        (new / FILES["run"]).write_text(json.dumps(run))
    return old, new


def test_a_checkpoint_scored_twice_is_listed_once(tmp_path):
    old, new = _dedupe_tree(tmp_path / "results")
    out = tmp_path / "r.html"
    result = CliRunner().invoke(main, ["report", str(tmp_path / "results"), "--out", str(out), "--worst", "20"])
    assert result.exit_code == 0, result.output
    assert f"skipped {old}: same checkpoint" in result.output and f"as {new} (more recent)" in result.output
    text = out.read_text()
    check_html(text)
    summary = text.split("<table class=summary>", 1)[1].split("</table>", 1)[0]
    assert summary.count("<td>run/step_300</td>") == 3  # once per dataset row: (all), gsm8k, humaneval
    worst = _section_of(text, "Worst prompts")
    rows = re.findall(r"<tr><td>\d+</td><td>([^<]*)</td><td>([^<]*)</td>", worst)
    assert len(rows) == 12 and len(set(rows)) == 12  # every sample once
    note = text.split('class="note duplicates"', 1)[1].split("</div>", 1)[0].replace("<wbr>", "")
    assert f"{old}</span>: same checkpoint" in note and f"as <span class=path>{new}</span>" in note
    assert "left out as duplicates" in note and "more recent" in note
    assert "left out; see" in text  # the header points at it


def test_dedupe_prefers_the_run_on_more_samples_and_keeps_other_shards(tmp_path):
    old, new = _dedupe_tree(tmp_path / "results", newer_samples=4)  # the newer run was --limit 4
    result = CliRunner().invoke(main, ["report", str(tmp_path / "results"), "--out", str(tmp_path / "r.html")])
    assert f"skipped {new}: same checkpoint" in result.output and "(more samples)" in result.output
    # the same checkpoint on other shards is another result: both stay, told apart by directory
    other = tmp_path / "other"
    write_results(other / "a", "run/step_300", 300, 0.72, 5)
    write_results(other / "b", "run/step_300", 300, 0.72, 5)
    run = json.loads((other / "b" / FILES["run"]).read_text())
    run["shards"].update(uri="/data/shards/another-set", identity="another-set-0001")
    (other / "b" / FILES["run"]).write_text(json.dumps(run))
    result = CliRunner().invoke(main, ["report", str(other), "--out", str(tmp_path / "o.html")])
    assert result.exit_code == 0 and "skipped" not in result.output
    assert "run/step_300 [other/a]" in (tmp_path / "o.html").read_text()


def test_no_results_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path), "--out", str(tmp_path / "r.html")])
    assert result.exit_code != 0
    assert "no summary.parquet" in result.output and "specreplay score" in result.output
    assert "Example:" in CliRunner().invoke(main, ["report", "--help"]).output


def _nonblank(png_path) -> tuple[int, int, int]:
    """(width, height, distinct grey levels) of a screenshot."""
    from PIL import Image  # pillow comes with matplotlib, which the report needs anyway

    with Image.open(png_path) as image:
        grey = image.convert("L")
        return image.width, image.height, sum(1 for count in grey.histogram() if count)


@needs_chromium
def test_headless_chromium_renders_the_report(built, tmp_path):
    out, _, _ = built
    shot = tmp_path / "shot.png"
    chromium_screenshot(out, shot, tmp_path / "profile", 1200, 2000)
    width, height, levels = _nonblank(shot)
    assert (width, height) == (1200, 2000)
    # text, tables and plots give many grey levels; a blank or error page gives one or two
    assert levels > 50, f"screenshot looks blank ({levels} grey levels)"
    keep = os.environ.get("SPECREPLAY_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


def test_sampled_results_are_labelled_by_their_decoding():
    """One checkpoint scored on greedy and on sampled shards: two rows, told apart by the sampling
    settings rather than merged under one label."""
    from scoring.report.data import _labels

    greedy = pl.DataFrame({"checkpoint": ["run/step_1"], "temperature": [0.0], "top_p": [1.0], "top_k": [0]})
    sampled = pl.DataFrame({"checkpoint": ["run/step_1"], "temperature": [0.6], "top_p": [0.95], "top_k": [20]})
    labels = _labels([("r/greedy/run_step_1", greedy), ("r/sampled/run_step_1", sampled)])
    assert labels == {
        "r/greedy/run_step_1": "run/step_1",
        "r/sampled/run_step_1": "run/step_1 (T=0.6, top-p 0.95, top-k 20)",
    }


def test_staging_directories_are_not_results(tmp_path):
    """score writes into a hidden `.<name>.partial-<pid>` directory and renames it when run.json
    is in; the report never takes one of those (summary.parquet already there) as results."""
    from scoring.report.data import find_results_dirs

    write_results(tmp_path / "r" / "run_step_1", "run/step_1", 1, 1.2, 4)
    write_results(tmp_path / "r" / ".run_step_2.partial-123", "run/step_2", 2, 1.3, 4)
    assert find_results_dirs([str(tmp_path / "r")]) == [str(tmp_path / "r" / "run_step_1")]


def test_sampled_results_get_the_exact_in_distribution_caption():
    from types import SimpleNamespace

    from scoring.report.page import _sampled_caption

    greedy = SimpleNamespace(summary=pl.DataFrame({"temperature": [0.0, None]}))
    sampled = SimpleNamespace(summary=pl.DataFrame({"temperature": [0.0, 0.6]}))
    assert _sampled_caption(greedy) == "" and _sampled_caption(SimpleNamespace(summary=pl.DataFrame({"x": [1]}))) == ""
    assert "expected τ, exact in distribution, ± its standard error" in _sampled_caption(sampled)


def test_out_an_existing_directory_is_one_error_line_and_leaves_no_tmp(results_root, tmp_path):
    result = CliRunner().invoke(main, ["report", str(results_root), "--out", str(tmp_path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert lines[0].startswith(f"error: --out {tmp_path} is a directory") and "report.html" in lines[0], lines[0]
    assert os.listdir(tmp_path) == [] and not os.path.exists(f"{tmp_path}.tmp")  # no .tmp left behind


def test_a_failed_write_leaves_no_tmp(tmp_path):
    from scoring.report.page import write_atomically

    (tmp_path / "page.html").mkdir()  # the rename onto a directory fails
    with pytest.raises(OSError):
        write_atomically(str(tmp_path / "page.html"), "<html></html>")
    assert os.listdir(tmp_path) == ["page.html"]

"""`specreplay report` on synthetic results directories (the scorer is never run): the HTML is
well formed and self-contained, names every checkpoint and dataset, every embedded image is a
real PNG, prompt text is escaped, missing pieces become notes, and headless Chromium renders a
page that is not blank."""

from __future__ import annotations

import base64
import html.parser
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from fake_results import write_fake_results
from scoring.results import ALL_DATASETS, CHAIN, FILES, method_names, tree_nodes_of
from specreplay.cli import main

CHROMIUM = "/usr/bin/chromium"
BLOCK = 8  # block size B: produced in 1..8, block positions 1..7
DATASETS = ("gsm8k", "humaneval")
BUDGETS = (4, 8, 16)
EVIL = "<script>alert('x')</script> & \"quotes\""
LONG = "Explain, step by step, " + "why the drafter keeps failing on this prompt. " * 12


# ---------------------------------------------------------------- synthetic results


def _walk_produced(rng, p: float, response_len: int) -> list[int]:
    """A chain walk: each draft token accepted with probability p until the first rejection."""
    produced, done = [], 0
    while done < response_len:
        accepted = 0
        while accepted < BLOCK - 1 and rng.random() < p:
            accepted += 1
        step = min(accepted + 1, response_len - done)
        produced.append(step)
        done += step
    return produced


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
) -> None:
    """One results directory as `specreplay score` writes it, with the README columns the report reads."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    identity = {"checkpoint": name, "checkpoint_hash": f"{seed:016x}", "checkpoint_step": step}
    walk_rows, sample_rows = [], []
    for dataset in DATASETS:
        for i in range(6):
            sample_id = f"{dataset}-{i}"
            response_len = 20 + 7 * i
            produced = _walk_produced(rng, p - 0.08 * (i == 0), response_len)
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
            for method in method_names(budgets):
                bonus = 0.0 if method == CHAIN else 0.25 * np.log2(tree_nodes_of(method) / 4) - 0.05
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
    samples_df = pl.DataFrame(sample_rows)
    summary_rows = []
    for dataset in list(DATASETS) + [ALL_DATASETS]:
        subset = samples_df if dataset == ALL_DATASETS else samples_df.filter(pl.col("dataset") == dataset)
        for method in method_names(budgets):
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
                row["accept_rate_by_position"] = [p ** (0.3 * k) for k in range(1, BLOCK - 1)] + [float("nan")]
            summary_rows.append(row)
    run = {
        "checkpoint": {"name": name, "step": step},
        "device": "cpu",
        "dtype": "float32",
        "shards": {"uri": "/data/shards/synthetic", "samples": 12},
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


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class StrictChecker(html.parser.HTMLParser):
    """Every non-void tag closed in order; collects img srcs and every src/href."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.images: list[str] = []
        self.links: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs.get("src") or "")
        self.links += [v for k, v in attrs.items() if k in ("src", "href") and v]
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> at {self.getpos()} closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def check_html(text: str) -> StrictChecker:
    checker = StrictChecker()
    checker.feed(text)
    checker.close()
    assert not checker.errors, checker.errors[:5]
    assert not checker.stack, f"unclosed tags: {checker.stack}"
    return checker


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
    assert "τ DDTree-16" in visible
    # four plots, each a real PNG of sensible size
    assert len(checker.images) == 4
    for src in checker.images:
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        width, height = png_size(data)
        assert width >= 400 and height >= 200 and len(data) > 10_000
    # nothing fetched from anywhere
    assert not [link for link in checker.links if not link.startswith("data:")]
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", text, re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text, re.I)


def test_prompts_are_escaped_ranked_and_expandable(built):
    _, text, _ = built
    assert "<script>" not in text
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;quotes&quot;" in text
    assert "<details>" in text and "why the drafter keeps failing" in text
    worst = text.split("<h2>Worst prompts</h2>", 1)[1].split("<h2>", 1)[0]
    assert worst.count("<tr>") == 1 + 5  # header + --worst 5
    assert "run/step_300" in worst  # ranked under the latest checkpoint
    taus = [float(x) for x in re.findall(r"<tr><td>\d+</td><td>[^<]*</td><td>[^<]*</td><td>([\d.]+)</td>", worst)]
    assert len(taus) == 5 and taus == sorted(taus)
    assert " → " in worst  # the same sample's tau through earlier checkpoints


def test_missing_pieces_become_notes(tmp_path):
    # no step, no DDTree, no walk, no samples, no run.json: still a report, with notes
    write_results(tmp_path / "a", "drafter-a", None, 0.5, 1, budgets=(), walk=False, samples=False, run_json=False)
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


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} absent: install it with `make setup-browser`")
def test_headless_chromium_renders_the_report(built, tmp_path):
    out, _, _ = built
    shot = tmp_path / "shot.png"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        "--window-size=1200,2000",
        f"file://{out}",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert shot.exists(), f"no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"
    width, height, levels = _nonblank(shot)
    assert (width, height) == (1200, 2000)
    # text, tables and plots give many grey levels; a blank or error page gives one or two
    assert levels > 50, f"screenshot looks blank ({levels} grey levels)"
    keep = os.environ.get("SPECREPLAY_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)

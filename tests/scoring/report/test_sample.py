"""`specreplay report` on real scored results (tiny random target -> extract -> fitted drafter ->
score): the token-by-token view agrees with walk.parquet step by step, `--sample` picks a sample
and an unknown one is a clear error, missing tokenizers and moved shards become notes, the
acceptance plot's n per position agrees with scoring/replay/metrics.py, the prompt column shows the
user's message, and headless Chromium draws both token colours."""

from __future__ import annotations

import glob
import html.parser
import os
import re
import shutil

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.shards import TOKENIZER_DIR
from scoring.methods.chain import CHAIN
from scoring.replay import metrics
from scoring.report.sample import visible_text
from scoring.results import ALL_DATASETS, FILES
from specreplay.cli import main
from tests.helpers.browser import check_html, chromium_screenshot, needs_chromium
from tests.helpers.drafters import fitted_drafters
from tests.helpers.prompts import write_prompts
from tests.scoring.report.test_page import position_rows

SYSTEM = "You are a terse assistant who answers arithmetic questions."
ACCEPTED_RGB, BONUS_RGB = (0xB7, 0xE4, 0xB0), (0xF8, 0xB2, 0x7A)  # .tok.acc and .tok.bon in scoring/report/page.py


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny_qwen3_dir):
    """(results root, shards, the latest checkpoint's results directory, tokenizer): two fitted
    checkpoints scored with the CLI, as a user would."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("report_sample")
    records = [
        {
            "id": f"q{i}",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {i} + {i}?"}],
        }
        for i in range(6)
    ]
    shards = str(tmp / "shards")
    run_extract(
        ExtractConfig(
            model=tiny_qwen3_dir,
            prompts=write_prompts(tmp / "prompts.jsonl", records),
            out=shards,
            max_new_tokens=40,
            layer_ids=[1, 3],
            top_k=8,
            dtype="fp32",
            quiet=True,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    if not os.path.isdir(os.path.join(shards, TOKENIZER_DIR)):  # extract saves it; older extracts did not
        tokenizer.save_pretrained(os.path.join(shards, TOKENIZER_DIR))
    # fitted to these very samples, so the walk has long accepted streaks as well as rejections
    written = fitted_drafters(
        shards, tmp / "runs", block_size=4, layer_ids=[1, 3], steps=400, save_every=200, anchors_per_step=32
    )
    root = tmp / "results"
    ckpts = [arg for path in written for arg in ("--ckpt", path)]
    result = CliRunner().invoke(
        main, ["score", *ckpts, "--shards", shards, "--out", str(root), "--ddtree-budgets", "4", "--quiet"]
    )
    assert result.exit_code == 0, result.output
    latest = next(d for d in glob.glob(str(root / "**" / FILES["summary"]), recursive=True) if "step_400" in d)
    return root, shards, os.path.dirname(latest), tokenizer


def _report(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["report", *map(str, args)])
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


class Views(html.parser.HTMLParser):
    """Per sample view (section.sample): its tokens as (kind, text) in order and its rejected
    guesses as (token id, text); text is what the page shows, unescaped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.views: dict[str, dict] = {}
        self.current: dict | None = None
        self.open: list[list] = []  # the token or guess being read, innermost last

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        if tag == "section" and "sample" in classes and "data-sample" in attrs:
            self.current = self.views[attrs["data-sample"]] = {"tokens": [], "rejected": [], "html_id": attrs["id"]}
        elif self.current is not None and tag == "span" and "tok" in classes:
            self.open.append(["tok", classes[1], ""])
        elif self.current is not None and tag == "s" and "rej" in classes:
            self.open.append(["rej", int(attrs["data-tok"]), ""])

    def handle_data(self, data):
        if self.open:
            self.open[-1][2] += data

    def handle_endtag(self, tag):
        if tag == "section":
            self.current = None
        elif self.open and tag in ("span", "s"):
            what, key, text = self.open.pop()
            self.current["tokens" if what == "tok" else "rejected"].append((key, text))


def parse_views(text: str) -> dict[str, dict]:
    parser = Views()
    parser.feed(text)
    return parser.views


def expected_view(walk: pl.DataFrame, ids: list[int], prompt_len: int, decode) -> tuple[list, list]:
    """(token kinds and texts, rejected guesses) straight from walk.parquet's definition: a step at
    `anchor` appends positions anchor+1..anchor+produced, the first min(accepted_len, produced-1)
    accepted, the last the bonus; the guess at index accepted_len was rejected unless the step was
    cut (accepted_len >= produced) or the whole block was accepted."""
    kinds, rejected = ["pre"], []
    for row in walk.sort("step").iter_rows(named=True):
        accepted = min(row["accepted_len"], row["produced"] - 1)
        kinds += ["acc"] * accepted + ["bon"]
        draft = row["draft_tokens"]
        if row["accepted_len"] < row["produced"] and row["accepted_len"] < len(draft):
            guess = draft[row["accepted_len"]]
            rejected.append((guess, visible_text(decode(guess), breaks=False)))
    texts = [visible_text(decode(i)) for i in ids[prompt_len:]]
    return list(zip(kinds, texts)), rejected


def _sample_ids(shards: str) -> dict[str, list[int]]:
    from pipeline.shards import ShardSet

    return {s.sample_id: s.input_ids.tolist() for s in ShardSet(shards).samples(tensors=[], prefetch=0)}


def test_token_view_agrees_with_the_walk(scored, tmp_path):
    root, shards, latest, tokenizer = scored
    out = tmp_path / "r.html"
    code, output = _report(root, "--out", out)
    assert code == 0, output
    check_html(out.read_text())  # well formed, every tag closed
    views = parse_views(out.read_text())
    samples = pl.read_parquet(os.path.join(latest, FILES["samples"])).filter(pl.col("method") == CHAIN)
    ranked = samples.sort("tau")["sample_id"].to_list()
    assert list(views) == [f"prompts/{s}" for s in ranked[:3] + ranked[::-1][:3]]  # 3 worst, then 3 best
    walk = pl.read_parquet(os.path.join(latest, FILES["walk"])).filter(pl.col("method") == CHAIN)
    ids = _sample_ids(shards)
    decode = lambda i: tokenizer.decode([i])  # noqa: E731
    total_rejected = 0
    for key, view in views.items():
        sample_id = key.split("/", 1)[1]
        mine = walk.filter(pl.col("sample_id") == sample_id)
        prompt_len = samples.filter(pl.col("sample_id") == sample_id)["prompt_len"][0]
        tokens, rejected = expected_view(mine, ids[sample_id], prompt_len, decode)
        assert view["tokens"] == tokens, key  # every response token, in order, with its kind and text
        assert view["rejected"] == rejected, key
        kinds = [k for k, _ in view["tokens"]]
        assert kinds.count("acc") == sum(min(a, p - 1) for a, p in zip(mine["accepted_len"], mine["produced"]))
        assert kinds.count("bon") == mine.height  # one bonus token per step
        total_rejected += len(rejected)
    assert total_rejected > 0 and "accepted draft token" in out.read_text()  # legend present


def test_sample_option_picks_one_and_an_unknown_id_is_a_clear_error(scored, tmp_path):
    root, _, _, _ = scored
    out = tmp_path / "r.html"
    code, output = _report(root, "--out", out, "--sample-views", "0", "--sample", "q4")
    assert code == 0, output
    views = parse_views(out.read_text())
    assert list(views) == ["prompts/q4"] and views["prompts/q4"]["tokens"]
    assert f"sample q4: file://{out}#{views['prompts/q4']['html_id']}" in output
    assert "picked" in out.read_text()

    missing = tmp_path / "missing.html"
    code, output = _report(root, "--out", missing, "--sample", "q99")
    assert code == 2 and output.startswith("error: --sample 'q99'"), output
    assert "valid ids include q0, q1" in output and not missing.exists()


def test_missing_tokenizer_and_moved_shards_become_notes(scored, tmp_path, tiny_qwen3_dir):
    root, shards, _, _ = scored
    old = tmp_path / "old_shards"  # shards as older extracts wrote them, without a tokenizer
    shutil.copytree(shards, old, ignore=shutil.ignore_patterns(TOKENIZER_DIR))
    out = tmp_path / "r.html"
    code, output = _report(root, "--out", out, "--sample-views", "1", "--shards", old)
    assert code == 0, output
    text = out.read_text()
    assert "carry no tokenizer" in text and "--tokenizer PATH" in text
    tokens = next(iter(parse_views(text).values()))["tokens"]
    assert all(t.startswith("⟨") and t.endswith("⟩") for _, t in tokens)  # ids instead of text

    code, output = _report(root, "--out", out, "--sample-views", "1", "--shards", old, "--tokenizer", tiny_qwen3_dir)
    assert code == 0 and "carry no tokenizer" not in out.read_text()
    assert not all(t.startswith("⟨") for _, t in next(iter(parse_views(out.read_text()).values()))["tokens"])

    code, output = _report(root, "--out", out, "--shards", tmp_path / "nowhere")
    assert code == 0, output
    assert "cannot be read at" in out.read_text() and "Pass --shards DIR" in out.read_text()
    assert not parse_views(out.read_text())

    code, output = _report(root, "--out", out, "--tokenizer", tmp_path / "nowhere")
    assert code == 2 and output.startswith("error: --tokenizer"), output


def test_n_per_position_agrees_with_the_metrics(scored, tmp_path):
    root, _, latest, _ = scored
    out = tmp_path / "r.html"
    assert _report(root, "--out", out)[0] == 0
    row = next(cells for label, cells in position_rows(out.read_text()) if "step_400" in label)
    shown = [int(n) for n in re.findall(r"<td[^>]*>(\d+)</td>", row)]
    anchors = pl.read_parquet(os.path.join(latest, FILES["anchors"]))
    accepted = torch.tensor(anchors["accepted_len"].to_list())
    known_len = torch.tensor(anchors["draft_match"].list.len().to_list())
    positions = len(shown)
    known = torch.arange(positions)[None, :] < known_len[:, None]
    reached, accepted_here = metrics.reached_accept(accepted, positions)
    assert shown == (reached & known).sum(0).tolist()
    summary = pl.read_parquet(os.path.join(latest, FILES["summary"]))
    rate = summary.filter((pl.col("dataset") == ALL_DATASETS) & (pl.col("method") == CHAIN))["accept_rate_by_position"][
        0
    ]
    assert [a / n for a, n in zip((accepted_here & known).sum(0).tolist(), shown)] == pytest.approx(rate)


def test_prompt_preview_is_the_user_message(scored, tmp_path):
    root, _, _, _ = scored
    out = tmp_path / "r.html"
    assert _report(root, "--out", out)[0] == 0
    worst = out.read_text().split("<h2>Worst prompts</h2>", 1)[1].split("<h2", 1)[0]
    previews = [s.split(">", 1)[1] for s in worst.split("<summary")[1:]]
    assert len(previews) == 6 and all(p.startswith("What is ") for p in previews)
    assert SYSTEM not in "".join(p.split("</summary>")[0] for p in previews)
    assert SYSTEM in worst  # still there in the expandable full prompt


def test_a_checkpoint_scored_into_two_directories_is_listed_once(scored, tmp_path):
    root, _, latest, _ = scored
    tree = tmp_path / "results"
    shutil.copytree(root, tree)
    shutil.copytree(latest, tree / "old_layout")  # where an older `score --out` left the same run
    os.utime(tree / "old_layout" / FILES["run"], (1_000_000_000, 1_000_000_000))
    out = tmp_path / "r.html"
    code, output = _report(tree, "--out", out)
    assert code == 0 and f"skipped {tree / 'old_layout'}: same checkpoint" in output, output
    text = out.read_text()
    worst = text.split("<h2>Worst prompts</h2>", 1)[1].split("<h2", 1)[0]
    assert worst.count("<tr>") == 1 + 6  # six samples, each once
    assert "left out as duplicates" in text and len(parse_views(text)) == 6


def _colour_pixels(png, rgb, tolerance: int = 6) -> int:
    import numpy as np
    from PIL import Image

    with Image.open(png) as image:
        pixels = np.asarray(image.convert("RGB")).astype(int)
    return int((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tolerance).sum())


@needs_chromium
def test_headless_chromium_draws_the_token_colours(scored, tmp_path):
    root, _, latest, _ = scored
    # the sample with the most tokens of its rarer kind (accepted or bonus)
    walk = pl.read_parquet(os.path.join(latest, FILES["walk"])).filter(pl.col("method") == CHAIN)
    kinds = walk.group_by("sample_id").agg(
        accepted=pl.min_horizontal("accepted_len", pl.col("produced") - 1).sum(), bonus=pl.len()
    )
    chosen = kinds.sort(pl.min_horizontal("accepted", "bonus"), "sample_id", descending=True)["sample_id"][0]
    out = tmp_path / "r.html"
    assert _report(root, "--out", out, "--sample-views", "0", "--sample", chosen)[0] == 0
    # The report's own head and token view, without the plots above it (headless --screenshot does
    # not scroll to a #fragment) and without the legend, so every coloured pixel is a token's.
    head, body = out.read_text().split("<main>", 1)
    view = body[body.index('<h2 id="tokens">') :]
    view = re.sub(r'<p class="legend">.*?</p>', "", view, count=1, flags=re.S)
    page = tmp_path / "view.html"
    page.write_text(head + "<main>" + view)
    shot = tmp_path / "shot.png"
    chromium_screenshot(page, shot, tmp_path / "profile", 1000, 800)
    accepted, bonus = _colour_pixels(shot, ACCEPTED_RGB), _colour_pixels(shot, BONUS_RGB)
    # a token's box is about 9 x 20 px per character: several tokens of each kind
    assert accepted > 500 and bonus > 500, (accepted, bonus)
    keep = os.environ.get("SPECREPLAY_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


def test_rejected_guesses_never_break_the_line():
    """A response newline is shown and kept (↵ then a real break); a rejected guess of a newline
    is only the glyph: it was never part of the text, so the text must not wrap there."""
    assert visible_text("a\nb") == "a↵\nb"
    assert visible_text("\n\t", breaks=False) == "↵⇥"
    assert visible_text("") == "∅" and visible_text("\x01") == "\\x01"

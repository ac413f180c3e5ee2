"""The report over sampled results beside greedy ones (the README's side-by-side recipe): both
kinds scored for real from one tiny target, two checkpoints each. Sampled and greedy runs are
different experiments, so the page keeps them apart and labels each."""

from __future__ import annotations

import glob
import os
import re

import pytest
from click.testing import CliRunner

from specreplay.cli import main
from tests.helpers.browser import chromium_dom, needs_chromium
from tests.helpers.prompts import write_prompts
from tests.scoring.report.test_page import position_rows

STEPS = (100, 200)


def _extract(tmp, model: str, prompts: str, name: str, sampling: list[str]) -> str:
    shards = str(tmp / name)
    args = ["extract", "--model", model, "--prompts", prompts, "--out", shards, "--layer-ids", "1,3"]
    run = CliRunner().invoke(main, [*args, *sampling, "--max-new-tokens", "12", "--dtype", "fp32", "--quiet"])
    assert run.exit_code == 0, run.output
    return shards


@pytest.fixture(scope="module")
def page(tmp_path_factory, tiny_qwen3_dir) -> dict:
    """Two checkpoints (steps 100, 200) scored on greedy and on T=0.6 sampled shards of the same
    prompts, then one report over both results trees."""
    from scoring.fit import save_drafter
    from scoring.report.page import write_report
    from tests.helpers.drafters import random_drafter

    tmp = tmp_path_factory.mktemp("sampled_report")
    prompts = write_prompts(tmp / "p.jsonl", [{"id": f"q{i}", "prompt": f"Count to {i}."} for i in range(3)])
    greedy = _extract(tmp, tiny_qwen3_dir, prompts, "greedy", [])
    sampled = _extract(tmp, tiny_qwen3_dir, prompts, "sampled", ["--temperature", "0.6", "--num-samples", "2"])
    ckpts = [save_drafter(random_drafter(seed=s), str(tmp / "runs" / f"step_{s}")) for s in STEPS]
    for shards, out in ((greedy, "r_greedy"), (sampled, "r_sampled")):
        for ckpt in ckpts:
            score = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(tmp / out), "--quiet"]
            run = CliRunner().invoke(main, score)
            assert run.exit_code == 0, run.output
    roots = [str(tmp / "r_greedy"), str(tmp / "r_sampled")]
    path = write_report(roots, str(tmp / "report.html")).path
    return {"tmp": tmp, "roots": roots, "html": open(path, encoding="utf-8").read(), "path": path}


def _section(text: str, heading: str) -> str:
    return text.split(f">{heading}</h2>", 1)[1].split("<h2", 1)[0]


def _rows(table_html: str) -> list[list[str]]:
    """Each body row's cells as text (tags and <wbr> dropped)."""
    body = table_html.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [
        [re.sub(r"<[^>]+>", "", cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    ]


def test_sampled_anchor_counts_are_found_and_thin_positions_greyed(page):
    """A sampled result's anchor counts are used (no "No anchors.parquet" note), and each
    position's n and grey mark are those score wrote in summary.parquet's reached_by_position."""
    import polars as pl

    section = _section(page["html"], "Acceptance per block position")
    assert "No anchor" not in section
    shown = {re.sub("<wbr>", "", label): cells for label, cells in position_rows(section)}
    assert len(shown) == 4 and sum("(T=0.6)" in label for label in shown) == 2
    for directory in glob.glob(os.path.join(page["roots"][1], "*")):
        summary = pl.read_parquet(os.path.join(directory, "summary.parquet")).filter(
            (pl.col("method") == "chain") & (pl.col("dataset") == "(all)")
        )
        raw = summary["reached_by_position"][0]
        expected = [int(n) for n in raw]
        label = f"runs/{os.path.basename(directory).removeprefix('runs_')} (T=0.6)"
        cells = re.findall(r"<td( class=\"few\"[^>]*)?>(\d+)</td>", shown[label])
        assert [int(n) for _, n in cells] == expected, label
        assert [bool(few) for few, _ in cells] == [n < 30 for n in raw], label
        assert any(n < 30 for n in expected)  # the fixture has thin positions


def test_training_curves_are_per_kind_and_labelled(page):
    """Greedy and sampled τ each get their own line per dataset, named by kind."""
    from scoring.report.page import find_results_dirs, load_results
    from scoring.report.plots import tau_vs_step_figure

    fig, _ = tau_vs_step_figure(load_results(find_results_dirs(page["roots"])))
    ax = fig.axes[0]
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "runs · greedy · (all)" in legend and "runs · sampled T=0.6 · (all)" in legend
    for line in ax.get_lines():
        if line.get_label().endswith("(all)"):
            assert list(line.get_xdata()) == list(STEPS)  # one point per step: no kind mixed in


def test_worst_prompts_come_from_greedy_runs(page):
    section = _section(page["html"], "Worst prompts")
    assert "runs/step_200</b>" in section and "greedy runs only" in section
    rows = _rows(section)
    assert rows
    for cells in rows:
        assert "–" not in cells[4].split(" → ")  # the history follows greedy runs, all present
        assert cells[-2] != "n/a (sampled)"


def test_sampled_rows_say_exact_walk_is_not_applicable(page):
    section = _section(page["html"], "Summary")
    for cells in _rows(section):
        if "(T=0.6)" in cells[1]:
            assert "n/a (sampled)" in cells and not any(re.fullmatch(r"\d+/\d+", c) for c in cells)
        else:
            assert any(re.fullmatch(r"\d+/\d+", c) for c in cells)


def test_paired_differences_never_pair_greedy_with_sampled(page):
    section = page["html"].split('<h2 id="paired">', 1)[1].split("<h2", 1)[0]
    pairs = [re.sub(r"<[^>]+>", "", cell).split(" →") for cell in re.findall(r'<td rowspan="\d+">(.*?)</td>', section)]
    kinds = [tuple("(T=0.6)" in side for side in pair) for pair in pairs]
    assert sorted(set(kinds)) == [(False, False), (True, True)], pairs  # one greedy pair, one sampled pair
    assert "not compared" not in section


def test_header_counts_distinct_checkpoints_and_runs_per_kind(page):
    meta = re.search(r'<p class="meta">(.*?)</p>', page["html"], re.S).group(1)
    assert meta.startswith("2 checkpoint(s) (2 greedy runs, 2 sampled T=0.6 runs)")


@needs_chromium
def test_page_renders_in_chromium(page, tmp_path):
    """The page as Chromium lays it out holds the same kinds and labels."""
    dom = chromium_dom(page["path"], tmp_path / "profile", 1280, 900)
    assert "2 greedy runs, 2 sampled T=0.6 runs" in dom and "n/a (sampled)" in dom

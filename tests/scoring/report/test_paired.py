"""Issue 37 item 9: the report shows the paired intervals `specreplay compare` computes, along the
training steps, per dataset and method, not only the summary's point estimates in bold."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from scoring.compare.run import run_comparison
from specreplay.cli import main
from tests.scoring.report.test_page import CHECKPOINTS, write_results

PAIRS = [(100, 200), (200, 300), (100, 300)]  # consecutive steps, then the first against the last


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    root = tmp_path_factory.mktemp("paired")
    for seed, (name, step, p) in enumerate(CHECKPOINTS):
        write_results(root / "results" / f"run_step_{step}", name, step, p, seed)
    out = root / "report.html"
    result = CliRunner().invoke(main, ["report", str(root / "results"), "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return root, out.read_text(encoding="utf-8")


def _comparisons(text: str) -> list[list[list[str]]]:
    """The paired tables' comparisons in page order, each its rows of cell texts (A → B left out)."""
    section = text.split('<h2 id="paired">', 1)[1].split("<h2", 1)[0]
    found = []
    for table in re.findall(r"<tbody>(.*?)</tbody>", section, re.S):
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", table, re.S):
            cells = [re.sub(r"<[^>]+>", " ", c).split() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            if "rowspan" in row:
                found.append([])
                cells = cells[1:]
            found[-1].append([" ".join(c) for c in cells])
    return found


def _close(text: str, value: float) -> bool:
    return abs(float(text) - value) <= 0.006  # shown to 2 decimals at least


@pytest.mark.filterwarnings("ignore::scoring.compare.run.FewSamplesWarning")
def test_paired_intervals_are_compares(page):
    root, text = page
    shown = _comparisons(text)
    assert len(shown) == 2 * len(PAIRS)  # chain tables, then every other method's
    for (a, b), rows in zip(PAIRS, shown):
        table = run_comparison(str(root / "results" / f"run_step_{a}"), str(root / "results" / f"run_step_{b}")).table
        chain = {r["dataset"]: r for r in table.to_dicts() if r["method"] == "chain"}
        assert [cells[0] for cells in rows] == ["(all)", "gsm8k", "humaneval"]
        for dataset, paired, taus, delta, verdict, streak in rows:
            row = chain[dataset]
            assert int(paired) == row["n"] and taus == f"{row['tau_a']:.2f} → {row['tau_b']:.2f}"
            d, low, _, high = delta.split()
            assert _close(d, row["delta"]) and _close(low, row["ci_low"]) and _close(high, row["ci_high"])
            s, s_low, _, s_high = streak.split()
            assert _close(s, row["streak_delta"]) and _close(s_low, row["streak_ci_low"])
            assert _close(s_high, row["streak_ci_high"])
            expected = "better" if row["ci_low"] > 0 else "worse" if row["ci_high"] < 0 else "no significant change"
            assert verdict == expected


def test_every_method_is_folded_below(page):
    _, text = page
    other = _comparisons(text)[len(PAIRS) :]
    groups = [cells[0] for cells in other[0]]
    assert "(all) · ddtree-16" in groups and "gsm8k · ddtree-4" in groups and len(groups) == 3 * 3
    assert "Every other method" in text and "intervals at 95%: expect about" in text
    assert 'href="#paired"' in text  # how-to-read points at it beside the bold τ

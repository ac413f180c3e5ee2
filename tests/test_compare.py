"""`specreplay compare`: the paired bootstrap interval on synthetic results with known
differences (accuracy, no-difference, coverage, pairing), null taus, shard checks, errors, CLI."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from fake_results import write_fake_results
from scoring.compare import (
    CompareError,
    ShardsDifferWarning,
    compare_results,
    paired_bootstrap,
    verdict,
)
from scoring.results import ALL_DATASETS
from specreplay.cli import main


def write_results(
    path,
    tau,
    *,
    datasets=None,
    methods=("chain",),
    name="ckpt",
    shards_id="shards-1",
    step=None,
    sample_ids=None,
    run_json=True,
):
    """A synthetic `specreplay score` results directory: samples.parquet (one row per sample and
    method; tau[i] for every method, None/NaN = no step), summary.parquet and run.json."""
    n = len(tau)
    datasets = datasets if datasets is not None else ["gsm8k"] * n
    sample_ids = sample_ids if sample_ids is not None else [f"s{i}" for i in range(n)]
    tau = [None if t is None or t != t else float(t) for t in tau]
    rows = [
        {"dataset": d, "sample_id": s, "method": m, "steps": 0 if t is None else 4, "tau": t}
        for m in methods
        for d, s, t in zip(datasets, sample_ids, tau)
    ]
    frame = pl.DataFrame(rows, schema_overrides={"tau": pl.Float64})
    summary = (
        frame.group_by("dataset", "method")
        .agg(pl.col("tau").mean(), samples=pl.len())
        .vstack(
            frame.group_by("method")
            .agg(pl.col("tau").mean(), samples=pl.len())
            .select(pl.lit(ALL_DATASETS).alias("dataset"), "method", "tau", "samples")
        )
    )
    run = {
        "checkpoint": {"name": name, "step": step},
        "shards": {"uri": f"data/shards/{shards_id}", "identity": shards_id, "samples": n},
    }
    identity = {"checkpoint": name, "checkpoint_hash": "0" * 16, "checkpoint_step": step}
    return write_fake_results(path, identity, rows, summary.to_dicts(), run=run if run_json else None)


def _pair(tmp_path, tau_a, tau_b, **kwargs):
    kw_b = {k: kwargs.pop(k) for k in list(kwargs) if k.endswith("_b")}
    a = write_results(tmp_path / "a", tau_a, name="run/step_100", **kwargs)
    b = write_results(tmp_path / "b", tau_b, name="run/step_200", **{**kwargs, **{k[:-2]: v for k, v in kw_b.items()}})
    return a, b


def test_known_difference_is_found(tmp_path):
    rng = np.random.default_rng(1)
    tau_a = rng.uniform(1.5, 4.0, 200)
    tau_b = tau_a + 0.3 + rng.normal(0, 0.05, 200)
    a, b = _pair(tmp_path, tau_a, tau_b)
    df = compare_results(a, b)
    assert df["dataset"].to_list() == ["gsm8k", "(all)"]
    row = df.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert row["n"] == 200 and row["dropped_null"] == 0 and row["unmatched"] == 0
    assert abs(row["delta"] - 0.3) < 0.02
    assert row["ci_low"] < 0.3 < row["ci_high"] and row["ci_low"] > 0
    assert row["delta"] == pytest.approx(row["tau_b"] - row["tau_a"])
    assert row["tau_a"] == pytest.approx(tau_a.mean())
    assert row["verdict"].startswith("B is better by 0.30 tau, 95% CI 0.29 to 0.3")
    assert row["checkpoint_a"] == "run/step_100" and row["checkpoint_b"] == "run/step_200"
    # swapping A and B swaps the verdict
    swapped = compare_results(b, a).filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert swapped["verdict"].startswith("A is better by 0.30 tau")
    assert swapped["delta"] == pytest.approx(-row["delta"])


def test_no_difference(tmp_path):
    rng = np.random.default_rng(2)
    tau_a = rng.uniform(1.5, 4.0, 200)
    noise = rng.normal(0, 0.3, 200)
    tau_b = tau_a + noise - noise.mean()  # true and observed mean difference both 0
    a, b = _pair(tmp_path, tau_a, tau_b)
    row = compare_results(a, b).filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert row["ci_low"] < 0 < row["ci_high"]
    assert row["verdict"].startswith("no significant difference (B - A = ")
    assert "95% CI -0.0" in row["verdict"]


def test_coverage_of_the_interval():
    """Over 100 synthetic datasets with a known mean difference the 95% interval covers it in
    roughly 95% of them (percentile bootstrap at n = 60 undercovers slightly)."""
    rng = np.random.default_rng(3)
    truth, covered = 0.2, 0
    for trial in range(100):
        a = rng.gamma(2.0, 1.0, 60) + 1.0
        b = a + truth + rng.normal(0, 0.5, 60)  # differences: mean = truth
        _, low, high = paired_bootstrap(a, b, resamples=1000, seed=trial)
        covered += low <= truth <= high
    assert 88 <= covered <= 99, covered


def test_pairing_narrows_the_interval():
    rng = np.random.default_rng(4)
    a = rng.normal(3.0, 1.0, 300)  # large spread between samples ...
    b = a + 0.05 + rng.normal(0, 0.02, 300)  # ... small, consistent shift within each sample
    delta, low, high = paired_bootstrap(a, b, resamples=2000, seed=0)
    # the unpaired bootstrap resamples A and B independently
    ia, ib = rng.integers(0, 300, (2, 2000, 300))
    unpaired = b[ib].mean(axis=1) - a[ia].mean(axis=1)
    u_low, u_high = np.quantile(unpaired, [0.025, 0.975])
    assert (high - low) < 0.05 * (u_high - u_low)
    assert low > 0 and u_low < 0 < u_high  # only the paired interval sees the shift
    assert delta == pytest.approx(0.05, abs=0.005)


def test_bootstrap_is_seeded_and_validated():
    a, b = np.arange(10.0), np.arange(10.0) + np.linspace(-1, 2, 10)
    assert paired_bootstrap(a, b, seed=7) == paired_bootstrap(a, b, seed=7)
    assert paired_bootstrap(a, b, seed=7) != paired_bootstrap(a, b, seed=8)
    with pytest.raises(ValueError, match="same length"):
        paired_bootstrap(a, b[:5])
    with pytest.raises(ValueError, match="empty"):
        paired_bootstrap(a[:0], b[:0])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap(a, b, confidence=95)
    with pytest.raises(ValueError, match="NaN"):
        paired_bootstrap(np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    # a wider confidence level gives a wider interval
    _, l90, h90 = paired_bootstrap(a, b, confidence=0.90)
    _, l99, h99 = paired_bootstrap(a, b, confidence=0.99)
    assert l99 <= l90 and h99 >= h90


def test_verdict_words():
    assert verdict(0.31, 0.22, 0.40) == "B is better by 0.31 tau, 95% CI 0.22 to 0.40"
    assert verdict(-0.31, -0.40, -0.22) == "A is better by 0.31 tau, 95% CI 0.22 to 0.40"
    assert verdict(0.02, -0.05, 0.09) == "no significant difference (B - A = 0.02, 95% CI -0.05 to 0.09)"
    assert verdict(0.004, 0.002, 0.006, confidence=0.9) == "B is better by 0.004 tau, 90% CI 0.002 to 0.006"
    assert verdict(1.0, 1.0, 1.0, n=1).startswith("too few paired samples")


def test_null_taus_dropped_and_counted(tmp_path):
    rng = np.random.default_rng(5)
    tau_a = list(rng.uniform(2, 3, 50))
    tau_b = [t + 0.5 for t in tau_a]
    tau_a[3] = None  # no walk step in A
    tau_b[7] = float("nan")  # and a NaN in B
    tau_b[3] = None
    a, b = _pair(tmp_path, tau_a, tau_b)
    row = compare_results(a, b).filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert row["n"] == 48 and row["dropped_null"] == 2 and row["unmatched"] == 0
    assert row["delta"] == pytest.approx(0.5)
    kept = [t for i, t in enumerate(tau_a) if i not in (3, 7)]
    assert row["tau_a"] == pytest.approx(np.mean(kept))


def test_datasets_methods_and_filters(tmp_path):
    rng = np.random.default_rng(6)
    tau_a = rng.uniform(2, 3, 40)
    tau_b = tau_a + np.where(np.arange(40) < 20, 0.4, 0.0)  # better on gsm8k only
    datasets = ["gsm8k"] * 20 + ["humaneval"] * 20
    a, b = _pair(tmp_path, tau_a, tau_b, datasets=datasets, methods=("ddtree-16", "chain", "ddtree-4"))
    df = compare_results(a, b)
    assert df.select("dataset", "method").rows()[:3] == [
        ("gsm8k", "chain"),
        ("gsm8k", "ddtree-4"),
        ("gsm8k", "ddtree-16"),
    ]
    assert df["dataset"].unique(maintain_order=True).to_list() == ["gsm8k", "humaneval", "(all)"]
    by = {(r["dataset"], r["method"]): r for r in df.iter_rows(named=True)}
    assert by[("gsm8k", "chain")]["verdict"].startswith("B is better by 0.40")
    assert by[("humaneval", "chain")]["delta"] == pytest.approx(0.0)
    assert by[("(all)", "chain")]["n"] == 40 and by[("(all)", "chain")]["delta"] == pytest.approx(0.2)
    only = compare_results(a, b, methods=["chain"], datasets=["humaneval"])
    assert only.select("dataset", "method").rows() == [("humaneval", "chain")]
    with pytest.raises(CompareError, match="--method 'ddtree-8'.*choose from"):
        compare_results(a, b, methods=["ddtree-8"])
    with pytest.raises(CompareError, match="--dataset 'mt-bench'"):
        compare_results(a, b, datasets=["mt-bench"])


def test_different_shards_warns_and_partial_overlap_counts(tmp_path):
    tau = np.linspace(2, 3, 30)
    a, b = _pair(
        tmp_path,
        tau,
        tau[:20] + 0.1,
        shards_id="shards-1",
        shards_id_b="shards-2",
        sample_ids_b=[f"s{i}" for i in range(20)],
    )
    with pytest.warns(UserWarning) as record:
        df = compare_results(a, b)
    messages = [(w.category, str(w.message)) for w in record]
    assert any(
        c is ShardsDifferWarning and "different shards" in m and "shards-1" in m and "shards-2" in m
        for c, m in messages
    ), messages
    assert any("10 sample(s) are in only one run (e.g. dataset 'gsm8k', sample 's20')" in m for _, m in messages)
    row = df.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert row["n"] == 20 and row["unmatched"] == 10


def test_errors_name_the_file_and_the_fix(tmp_path):
    a = write_results(tmp_path / "a", [2.0, 3.0])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompareError, match=r"B: .*empty/samples.parquet not found; pass a results directory"):
        compare_results(a, str(empty))
    with pytest.raises(CompareError, match="not a directory"):
        compare_results(a, str(tmp_path / "nowhere"))
    # a parent of several results directories: the error lists them
    write_results(tmp_path / "parent" / "runs_step_30", [2.0, 3.0])
    write_results(tmp_path / "parent" / "runs_step_60", [2.0, 3.0])
    with pytest.raises(CompareError, match="pass one of them: .*runs_step_30, .*runs_step_60"):
        compare_results(str(tmp_path / "parent"), a)
    # no overlapping sample ids
    other = write_results(tmp_path / "other", [2.0, 3.0], sample_ids=["x1", "x2"])
    no_overlap = r"no sample of A .* matches a sample of B .* by \(dataset, sample_id\); score both"
    with pytest.raises(CompareError, match=no_overlap):
        compare_results(a, other)
    # missing column
    pl.DataFrame({"sample_id": ["s0"], "tau": [1.0]}).write_parquet(tmp_path / "empty" / "samples.parquet")
    with pytest.raises(CompareError, match=r"samples.parquet lacks column\(s\) \['dataset', 'method'\]"):
        compare_results(a, str(empty))


def test_missing_or_broken_run_json(tmp_path):
    a, b = _pair(tmp_path, [2.0, 3.0, 2.5], [2.1, 3.1, 2.6], run_json=False)
    with pytest.warns(ShardsDifferWarning, match="cannot check.*run.json not found"):
        compare_results(a, b)
    (tmp_path / "b" / "run.json").write_text("{not json")
    with pytest.raises(CompareError, match=r"B: cannot read .*run.json"):
        compare_results(a, b)


def test_cli_table_out_and_json(tmp_path):
    rng = np.random.default_rng(7)
    tau_a = rng.uniform(2, 3, 100)
    a, b = _pair(tmp_path, tau_a, tau_a + 0.3 + rng.normal(0, 0.05, 100), methods=("chain", "ddtree-8"))
    runner = CliRunner()
    out_csv = tmp_path / "cmp" / "compare.csv"
    result = runner.invoke(main, ["compare", a, b, "--method", "chain", "--out", str(out_csv)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"A: run/step_100 ({a})"
    header = next(line for line in lines if line.startswith("dataset"))
    assert header.split() == ["dataset", "method", "n", "tau_a", "tau_b", "delta", "ci_low", "ci_high", "verdict"]
    assert any(line.startswith("(all)") and "B is better by 0.29 tau, 95% CI 0.29 to 0.30" in line for line in lines)
    assert "ddtree-8" not in result.output
    written = pl.read_csv(out_csv)
    assert written.height == 2 and set(written["method"]) == {"chain"}

    out_parquet = tmp_path / "compare.parquet"
    result = runner.invoke(
        main,
        [
            "compare",
            a,
            b,
            "--json",
            "--resamples",
            "500",
            "--seed",
            "3",
            "--confidence",
            "0.9",
            "--out",
            str(out_parquet),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["resamples"] == 500 and payload["confidence"] == 0.9 and payload["warnings"] == []
    assert len(payload["rows"]) == 4 and "90% CI" in payload["rows"][0]["verdict"]
    assert pl.read_parquet(out_parquet).height == 4

    bad = runner.invoke(main, ["compare", a, str(tmp_path / "nowhere")])
    assert bad.exit_code != 0 and "not a directory" in bad.output
    bad = runner.invoke(main, ["compare", a, b, "--out", str(tmp_path / "x.txt")])
    assert bad.exit_code != 0 and ".parquet or .csv" in bad.output
    help_text = runner.invoke(main, ["compare", "--help"]).output
    assert "Example:" in help_text and "specreplay compare" in help_text


def test_cli_prints_shard_warning(tmp_path):
    a, b = _pair(tmp_path, [2.0, 3.0, 2.5], [2.1, 3.1, 2.6], shards_id="x", shards_id_b="y")
    result = CliRunner().invoke(main, ["compare", a, b], catch_exceptions=False)
    assert result.exit_code == 0
    assert "warning: A and B were scored on different shards" in result.stderr
    assert "warning:" not in result.stdout

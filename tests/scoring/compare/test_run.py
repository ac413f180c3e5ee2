"""`specreplay compare` (scoring/compare/run.py, inputs.py): the paired interval on synthetic results
with known differences (accuracy, no-difference), null taus, shard checks, errors, CLI. The
bootstrap itself (coverage, pairing, seeding, verdicts): test_bootstrap.py."""

from __future__ import annotations

import hashlib
import json
import warnings

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from scoring import results
from scoring.compare.run import (
    CompareError,
    DifferingSamplesWarning,
    FewSamplesWarning,
    SameCheckpointWarning,
    ShardsDifferWarning,
    StreakWarning,
    chance_note,
    headline,
    paired_ratio_bootstrap,
    run_comparison,
)
from scoring.results import ALL_DATASETS
from specreplay.cli import main
from tests.helpers.fake_results import write_fake_results


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
    tokens=None,
    checkpoint_hash=None,
    anchors=None,
    tree_nodes=(),
    summary_streak=None,
    extra=None,
):
    """A synthetic `specreplay score` results directory: samples.parquet (one row per sample and
    method; tau[i] for every method, None/NaN = no step), summary.parquet and run.json.
    `tokens[i]` is sample i's tokens_hash (default: one per (dataset, sample_id), the same in
    every run; None = the column is null, as in results of older versions); `extra[i]` adds
    columns to sample i's rows. `checkpoint_hash` defaults to a hash of `name`. `anchors`:
    anchors.parquet rows (dataset, sample_id, anchor, accepted_len, ddtree_N_accepted_len for N
    in tree_nodes), written only when given; `summary_streak` per method: the summary's
    (all) anchor_accepted_len_mean."""
    n = len(tau)
    datasets = datasets if datasets is not None else ["gsm8k"] * n
    sample_ids = sample_ids if sample_ids is not None else [f"s{i}" for i in range(n)]
    tokens = tokens if tokens is not None else [f"h-{d}-{s}" for d, s in zip(datasets, sample_ids)]
    extra = extra if extra is not None else [{}] * n
    tau = [None if t is None or t != t else float(t) for t in tau]
    rows = [
        {"dataset": d, "sample_id": s, "method": m, "steps": 0 if t is None else 4, "tau": t, "tokens_hash": h, **x}
        for m in methods
        for d, s, t, h, x in zip(datasets, sample_ids, tau, tokens, extra)
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
    ).to_dicts()
    for row in summary:
        if summary_streak and row["dataset"] == ALL_DATASETS:
            row["anchor_accepted_len_mean"] = summary_streak[row["method"]]
    content = checkpoint_hash or hashlib.sha256(name.encode()).hexdigest()
    run = {
        "checkpoint": {"name": name, "step": step, "content_hash": content},
        "shards": {"uri": f"data/shards/{shards_id}", "identity": shards_id, "samples": n},
    }
    identity = {"checkpoint": name, "checkpoint_hash": content[:16], "checkpoint_step": step}
    out = write_fake_results(path, identity, rows, summary, run=run if run_json else None)
    if anchors is not None:
        table = results.rows_table(
            [{**identity, **row} for row in anchors], results.anchors_schema({"ddtree": tree_nodes})
        )
        results.write_table(table, out, "anchors")
    return out


def _pair(tmp_path, tau_a, tau_b, **kwargs):
    kw_b = {k: kwargs.pop(k) for k in list(kwargs) if k.endswith("_b")}
    a = write_results(tmp_path / "a", tau_a, name="run/step_100", **kwargs)
    b = write_results(tmp_path / "b", tau_b, name="run/step_200", **{**kwargs, **{k[:-2]: v for k, v in kw_b.items()}})
    return a, b


def _recorded(record, category=UserWarning) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, category)]


def test_known_difference_is_found(tmp_path):
    rng = np.random.default_rng(1)
    tau_a = rng.uniform(1.5, 4.0, 200)
    tau_b = tau_a + 0.3 + rng.normal(0, 0.05, 200)
    a, b = _pair(tmp_path, tau_a, tau_b)
    df = run_comparison(a, b).table
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
    swapped = run_comparison(b, a).table.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert swapped["verdict"].startswith("A is better by 0.30 tau")
    assert swapped["delta"] == pytest.approx(-row["delta"])


def test_no_difference(tmp_path):
    rng = np.random.default_rng(2)
    tau_a = rng.uniform(1.5, 4.0, 200)
    noise = rng.normal(0, 0.3, 200)
    tau_b = tau_a + noise - noise.mean()  # true and observed mean difference both 0
    a, b = _pair(tmp_path, tau_a, tau_b)
    row = run_comparison(a, b).table.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert row["ci_low"] < 0 < row["ci_high"]
    assert row["verdict"].startswith("no significant difference (B - A = ")
    assert "95% CI -0.0" in row["verdict"]


def test_null_taus_dropped_and_counted(tmp_path):
    rng = np.random.default_rng(5)
    tau_a = list(rng.uniform(2, 3, 50))
    tau_b = [t + 0.5 for t in tau_a]
    tau_a[3] = None  # no walk step in A
    tau_b[7] = float("nan")  # and a NaN in B
    tau_b[3] = None
    a, b = _pair(tmp_path, tau_a, tau_b)
    row = run_comparison(a, b).table.filter(pl.col("dataset") == "(all)").row(0, named=True)
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
    df = run_comparison(a, b).table
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
    only = run_comparison(a, b, methods=["chain"], datasets=["humaneval"]).table
    assert only.select("dataset", "method").rows() == [("humaneval", "chain")]
    with pytest.raises(CompareError, match="--method 'ddtree-8'.*choose from"):
        run_comparison(a, b, methods=["ddtree-8"])
    with pytest.raises(CompareError, match="--dataset 'mt-bench'"):
        run_comparison(a, b, datasets=["mt-bench"])


def test_different_shards_refused_unless_allowed(tmp_path):
    tau = np.linspace(2, 3, 30)
    a, b = _pair(
        tmp_path,
        tau,
        tau[:20] + 0.1,
        shards_id="shards-1",
        shards_id_b="shards-2",
        sample_ids_b=[f"s{i}" for i in range(20)],
    )
    with pytest.raises(CompareError) as refused:
        run_comparison(a, b)
    message = str(refused.value)
    for part in (f"A ({a})", f"B ({b})", "different shards", "shards-1", "shards-2", "--allow-different-shards"):
        assert part in message, message
    assert "same --shards" in message
    # the flag compares, with a warning; samples in only one run are still counted
    with pytest.warns(UserWarning) as record:
        df = run_comparison(a, b, allow_different_shards=True).table
    assert any("different shards" in m and "shards-1" in m for m in _recorded(record, ShardsDifferWarning))
    messages = _recorded(record)
    assert any("10 sample(s) are in only one run (e.g. dataset 'gsm8k', sample 's20')" in m for m in messages)
    row = df.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert row["n"] == 20 and row["unmatched"] == 10 and row["differing"] == 0


def test_allowed_different_shards_never_pair_differing_tokens(tmp_path):
    n = 30
    tau_a = np.full(n, 2.0)
    tau_b = np.full(n, 2.5)
    tau_b[[3, 4, 5, 6]] = 9.0  # the differing samples would pull delta far up if they were paired
    tokens_b = [f"h-gsm8k-s{i}" if i not in (3, 4, 5, 6) else f"other-{i}" for i in range(n)]
    a, b = _pair(tmp_path, tau_a, tau_b, shards_id="x", shards_id_b="y", tokens_b=tokens_b)
    with pytest.warns(
        DifferingSamplesWarning, match=r"4 of 30 sample\(s\) .* tokens_hash; e.g. dataset 'gsm8k', sample 's3'"
    ):
        comparison = run_comparison(a, b, allow_different_shards=True)
    row = comparison.table.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert row["n"] == 26 and row["differing"] == 4 and row["unmatched"] == 0
    assert row["delta"] == pytest.approx(0.5)
    assert comparison.differing_samples == 4 and comparison.shards == "different"
    result = CliRunner().invoke(main, ["compare", a, b, "--allow-different-shards"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "26 of 30 samples paired (4 differ in prompt or response)" in result.stdout.splitlines()[0]
    assert "differing: 4 sample(s) whose prompt or response differ" in result.stdout
    header = next(line for line in result.stdout.splitlines() if line.startswith("dataset"))
    assert header.split()[:4] == ["dataset", "method", "n", "differing"]
    assert "warning: 4 of 30 sample(s)" in result.stderr


def test_without_tokens_hash_pairs_on_lengths_and_prompt(tmp_path):
    """Results of older versions (tokens_hash null): pairs need equal prompt_len, response_len
    and prompt_text; with uncheckable shards the lengths must be present too."""
    n = 5
    extra_a = [{"prompt_len": 10, "response_len": 128, "prompt_text": f"p{i}"} for i in range(n)]
    extra_b = [dict(x) for x in extra_a]
    extra_b[1]["response_len"] = 32  # same prompt, truncated response
    extra_b[2]["prompt_text"] = "another prompt"
    extra_b[3] = {"prompt_text": "p3"}  # lengths unknown: cannot be checked with different shards
    a, b = _pair(
        tmp_path,
        [2.0] * n,
        [3.0] * n,
        shards_id="x",
        shards_id_b="y",
        tokens=[None] * n,
        extra=extra_a,
        extra_b=extra_b,
    )
    with pytest.warns(DifferingSamplesWarning, match="prompt_len, response_len, prompt_text; a run lacks tokens_hash"):
        df = run_comparison(a, b, allow_different_shards=True).table
    row = df.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert (row["n"], row["differing"]) == (2, 3)
    # on the same shards, missing lengths are not held against a pair (the shards guarantee the tokens)
    same = write_results(tmp_path / "c", [3.0] * n, name="run/step_300", tokens=[None] * n, extra=extra_b)
    a_same = write_results(tmp_path / "a2", [2.0] * n, name="run/step_100", tokens=[None] * n, extra=extra_a)
    row = run_comparison(a_same, same).table.filter(pl.col("dataset") == "(all)").row(0, named=True)
    assert (row["n"], row["differing"]) == (3, 2)


def test_errors_name_the_file_and_the_fix(tmp_path):
    a = write_results(tmp_path / "a", [2.0, 3.0])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompareError, match=r"B: .*empty/samples.parquet not found; pass a results directory"):
        run_comparison(a, str(empty))
    with pytest.raises(CompareError, match="not a directory"):
        run_comparison(a, str(tmp_path / "nowhere"))
    # a parent of several results directories of different checkpoints: the error lists them
    write_results(tmp_path / "parent" / "runs_step_30", [2.0, 3.0], name="runs/step_30")
    write_results(tmp_path / "parent" / "runs_step_60", [2.0, 3.0], name="runs/step_60")
    with pytest.raises(CompareError, match=r"pass one of them: .*runs_step_30 \(checkpoint_hash .*\), .*runs_step_60"):
        run_comparison(str(tmp_path / "parent"), a)
    # no overlapping sample ids
    other = write_results(tmp_path / "other", [2.0, 3.0], sample_ids=["x1", "x2"])
    no_overlap = r"no sample of A .* matches a sample of B .* by \(dataset, sample_id\); score both"
    with pytest.raises(CompareError, match=no_overlap):
        run_comparison(a, other)
    # missing column
    pl.DataFrame({"sample_id": ["s0"], "tau": [1.0]}).write_parquet(tmp_path / "empty" / "samples.parquet")
    with pytest.raises(CompareError, match=r"samples.parquet lacks column\(s\) \['dataset', 'method'\]"):
        run_comparison(a, str(empty))


def test_missing_or_broken_run_json(tmp_path):
    a, b = _pair(tmp_path, [2.0, 3.0, 2.5], [2.1, 3.1, 2.6], run_json=False)
    with pytest.raises(
        CompareError,
        match=r"cannot check that A .* and B .* same shards: .*a/run.json not found; .*b/run.json not found.*--allow-different-shards",
    ):
        run_comparison(a, b)
    with pytest.warns(ShardsDifferWarning, match="cannot check.*run.json not found"):
        comparison = run_comparison(a, b, allow_different_shards=True)
    assert comparison.shards == "unknown" and comparison.table["n"].to_list() == [3, 3]
    (tmp_path / "b" / "run.json").write_text("{not json")
    with pytest.raises(CompareError, match=r"B: .*b/run.json: not readable as JSON"):
        run_comparison(a, b)
    (tmp_path / "b" / "run.json").write_text(json.dumps({"shards": {"identity": 7}}))
    with pytest.raises(
        CompareError, match=r"B: .*b/run.json: field 'shards.identity' is 7 \(an integer\); expected a string"
    ):
        run_comparison(a, b)
    (tmp_path / "b" / "run.json").write_text(json.dumps({"checkpoint": {"name": "x"}}))
    with pytest.raises(CompareError, match=r"b/run.json has no shards.identity"):
        run_comparison(a, b)


def test_cli_table_out_and_json(tmp_path):
    rng = np.random.default_rng(7)
    tau_a = rng.uniform(2, 3, 100)
    a, b = _pair(tmp_path, tau_a, tau_a + 0.3 + rng.normal(0, 0.05, 100), methods=("chain", "ddtree-8"))
    runner = CliRunner()
    out_csv = tmp_path / "cmp" / "compare.csv"
    result = runner.invoke(main, ["compare", a, b, "--method", "chain", "--out", str(out_csv)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].startswith(f"A: run/step_100 ({a}; checkpoint_hash ")
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
    assert payload["resamples"] == 500 and payload["confidence"] == 0.9
    assert len(payload["warnings"]) == 1 and payload["warnings"][0].startswith("the all-anchor streak is not compared")
    assert payload["headline"].startswith("B (run/step_200) vs A (run/step_100): tau chain ")
    assert payload["dir_a"] == a and payload["shards"] == "same" and payload["differing_samples"] == 0
    assert payload["same_checkpoint"] is False and payload["checkpoint_hash_a"] != payload["checkpoint_hash_b"]
    assert payload["intervals"] == 4 and payload["expected_by_chance"] == pytest.approx(0.4)
    assert payload["streak_compared"] is False and payload["streak_missing"].endswith("anchors.parquet not found")
    assert payload["rows"][0]["streak_a"] is None and "differing" in payload["rows"][0]
    assert len(payload["rows"]) == 4 and "90% CI" in payload["rows"][0]["verdict"]
    assert pl.read_parquet(out_parquet).height == 4

    bad = runner.invoke(main, ["compare", a, str(tmp_path / "nowhere")])
    assert bad.exit_code != 0 and "not a directory" in bad.output
    bad = runner.invoke(main, ["compare", a, b, "--out", str(tmp_path / "x.txt")])
    assert bad.exit_code != 0 and ".parquet or .csv" in bad.output
    help_text = runner.invoke(main, ["compare", "--help"]).output
    assert "Example:" in help_text and "specreplay compare" in help_text


def test_cli_refuses_different_shards(tmp_path):
    a, b = _pair(tmp_path, [2.0, 3.0, 2.5], [2.1, 3.1, 2.6], shards_id="x", shards_id_b="y")
    result = CliRunner().invoke(main, ["compare", a, b])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: A ({a}) and B ({b}) were scored on different shards")
    assert "Traceback" not in result.output and result.stdout == ""
    allowed = CliRunner().invoke(main, ["compare", a, b, "--allow-different-shards"], catch_exceptions=False)
    assert allowed.exit_code == 0
    assert "warning: A (" in allowed.stderr and "different shards" in allowed.stderr
    assert "warning:" not in allowed.stdout


def test_headline_is_the_first_line(tmp_path):
    rng = np.random.default_rng(8)
    tau_a = rng.uniform(1.2, 1.5, 40)
    tau_b = tau_a + 0.18 + rng.normal(0, 0.05, 40)
    datasets = ["gsm8k"] * 20 + ["humaneval"] * 20
    a, b = _pair(tmp_path, tau_a, tau_b, datasets=datasets, methods=("ddtree-4", "chain"))
    result = CliRunner().invoke(main, ["compare", a, b], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    row = (
        run_comparison(a, b)
        .table.filter((pl.col("dataset") == ALL_DATASETS) & (pl.col("method") == "chain"))
        .row(0, named=True)
    )
    expected = (
        f"B (run/step_200) vs A (run/step_100): tau chain {tau_a.mean():.2f} -> {tau_b.mean():.2f}, "
        f"+{(tau_b - tau_a).mean():.2f} (95% CI {row['ci_low']:.2f} to {row['ci_high']:.2f}), B is better; "
        f"all 40 samples paired"
    )
    assert result.output.splitlines()[0] == expected  # first line of everything the user sees
    assert result.stdout.splitlines()[0] == expected
    assert row["ci_low"] > 0.1
    # the table follows, pooled chain row included
    assert any(line.startswith("(all)") and "chain" in line for line in result.stdout.splitlines()[1:])


def test_headline_words():
    base = {"dataset": ALL_DATASETS, "method": "chain", "checkpoint_a": "x/1", "checkpoint_b": "x/2"}
    counts = {"dropped_null": 0, "unmatched": 0, "differing": 0}
    rows = [
        {
            **base,
            "dataset": "gsm8k",
            **counts,
            "n": 30,
            "tau_a": 1,
            "tau_b": 2,
            "delta": 1,
            "ci_low": 0.5,
            "ci_high": 1.5,
        },
        {**base, **counts, "n": 40, "tau_a": 2.0, "tau_b": 1.5, "delta": -0.5, "ci_low": -0.7, "ci_high": -0.3},
    ]
    assert headline(rows) == (
        "B (x/2) vs A (x/1): tau chain 2.00 -> 1.50, -0.50 (95% CI -0.70 to -0.30), A is better; all 40 samples paired"
    )
    rows[1].update(n=12, dropped_null=1, unmatched=2, differing=3, ci_low=-0.7, ci_high=0.1)
    assert headline(rows) == (
        "B (x/2) vs A (x/1): tau chain 2.00 -> 1.50, -0.50 (95% CI -0.70 to 0.10), no significant difference; "
        "12 of 18 samples paired (3 differ in prompt or response, 2 in only one run, 1 without a tau); "
        "fewer than 20, so the interval is unreliable"
    )
    # filtered to one dataset: its row, named
    assert headline(rows[:1]).startswith("B (x/2) vs A (x/1): tau chain on gsm8k 1.00 -> 2.00, +1.00")


def test_few_samples_warning_only_below_20(tmp_path):
    a, b = _pair(tmp_path / "small", np.linspace(2, 3, 6), np.linspace(2, 3, 6) + 0.2)
    with pytest.warns(FewSamplesWarning, match=r"fewer than 20 paired samples in gsm8k \(n = 6\), \(all\) \(n = 6\)"):
        comparison = run_comparison(a, b)
    assert comparison.few_samples == ["gsm8k (n = 6)", "(all) (n = 6)"]
    # 25 + 5 samples: only the small dataset is named
    tau = np.linspace(2, 3, 30)
    a, b = _pair(tmp_path / "mixed", tau, tau + 0.2, datasets=["gsm8k"] * 25 + ["humaneval"] * 5)
    with pytest.warns(FewSamplesWarning) as record:
        run_comparison(a, b)
    assert _recorded(record, FewSamplesWarning) == [
        "fewer than 20 paired samples in humaneval (n = 5): the intervals there are unreliable (a bootstrap "
        "over so few samples is too narrow) and their verdicts weak; score more samples for a firm answer"
    ]
    # exactly 20: no warning
    a, b = _pair(tmp_path / "enough", np.linspace(2, 3, 20), np.linspace(2, 3, 20) + 0.2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        comparison = run_comparison(a, b)
    assert not _recorded(record, FewSamplesWarning) and comparison.few_samples == []


def _anchor_rows(per_sample: dict, dataset_of: dict, tree=None) -> list[dict]:
    """anchors.parquet rows: per_sample[sample_id] = chain accepted lengths at anchors 10, 11, ...
    (None = anchor not scored); tree[sample_id] the ddtree-4 accepted lengths when given."""
    rows = []
    for sample, values in per_sample.items():
        for k, value in enumerate(values):
            if value is None:
                continue
            row = {"dataset": dataset_of[sample], "sample_id": sample, "anchor": 10 + k, "accepted_len": value}
            if tree is not None:
                row["ddtree_4_accepted_len"] = tree[sample][k]
            rows.append(row)
    return rows


def test_streak_compared_by_sample_against_hand_computation(tmp_path):
    dataset_of = {"s0": "gsm8k", "s1": "gsm8k", "s2": "humaneval"}
    chain_a = {"s0": [0, 2, 1], "s1": [4], "s2": [1, 1]}
    chain_b = {"s0": [1, 3, 1], "s1": [4], "s2": [2, 3]}
    tree_a = {"s0": [1, 3, 2], "s1": [5], "s2": [2, 2]}
    tree_b = {"s0": [3, 5, 4], "s1": [7], "s2": [4, 4]}  # A's + 2 at every anchor
    kw = {"datasets": list(dataset_of.values()), "methods": ("chain", "ddtree-4"), "tree_nodes": [4]}
    # the summaries' pooled streaks, as `score` computes them: mean over every anchor
    streak_a = {"chain": np.mean([0, 2, 1, 4, 1, 1]), "ddtree-4": np.mean([1, 3, 2, 5, 2, 2])}
    streak_b = {"chain": np.mean([1, 3, 1, 4, 2, 3]), "ddtree-4": np.mean([3, 5, 4, 7, 4, 4])}
    a = write_results(
        tmp_path / "a",
        [2.0, 3.0, 2.0],
        name="run/step_100",
        anchors=_anchor_rows(chain_a, dataset_of, tree_a),
        summary_streak=streak_a,
        **kw,
    )
    b = write_results(
        tmp_path / "b",
        [2.5, 3.0, 2.5],
        name="run/step_200",
        anchors=_anchor_rows(chain_b, dataset_of, tree_b),
        summary_streak=streak_b,
        **kw,
    )
    df = run_comparison(a, b).table
    by = {(r["dataset"], r["method"]): r for r in df.iter_rows(named=True)}
    pooled = by[(ALL_DATASETS, "chain")]
    # anchor-weighted: (1+3+1+4+2+3)/6 - (0+2+1+4+1+1)/6 = 14/6 - 9/6; the mean of per-sample
    # streaks would give (5/3+4+5/2)/3 - (1+4+1)/3 = 0.722 instead
    assert pooled["streak_a"] == pytest.approx(9 / 6) and pooled["streak_b"] == pytest.approx(14 / 6)
    assert pooled["streak_delta"] == pytest.approx(5 / 6)
    assert (pooled["streak_n"], pooled["streak_anchors"]) == (3, 6)
    summary = {
        side: pl.read_parquet(f"{d}/summary.parquet").filter(pl.col("dataset") == ALL_DATASETS)
        for side, d in (("a", a), ("b", b))
    }
    for method in ("chain", "ddtree-4"):
        s_a, s_b = (summary[k].filter(pl.col("method") == method)["anchor_accepted_len_mean"].item() for k in "ab")
        assert by[(ALL_DATASETS, method)]["streak_delta"] == pytest.approx(s_b - s_a)
    gsm8k = by[("gsm8k", "chain")]
    assert gsm8k["streak_a"] == pytest.approx(7 / 4) and gsm8k["streak_b"] == pytest.approx(9 / 4)
    assert gsm8k["streak_delta"] == pytest.approx(0.5) and gsm8k["streak_anchors"] == 4
    assert by[("humaneval", "chain")]["streak_delta"] == pytest.approx(1.5)
    # ddtree-4 is B = A + 2 at every anchor: the interval collapses on 2 exactly
    tree = by[(ALL_DATASETS, "ddtree-4")]
    assert (tree["streak_delta"], tree["streak_ci_low"], tree["streak_ci_high"]) == pytest.approx((2.0, 2.0, 2.0))
    assert tree["streak_verdict"] == "B is better by 2.00 streak, 95% CI 2.00 to 2.00"
    # the chain interval: every resample's ratio lies between the per-sample streak differences
    # (s1: 0, s0: 2/3, s2: 3/2)
    assert 0.0 <= pooled["streak_ci_low"] < 5 / 6 < pooled["streak_ci_high"] <= 1.5
    # resampling samples, not anchors: the interval matches the weighted bootstrap of the sums
    expected = paired_ratio_bootstrap([3, 4, 2], [5, 4, 5], [3, 1, 2])
    assert (pooled["streak_delta"], pooled["streak_ci_low"], pooled["streak_ci_high"]) == pytest.approx(expected)


def test_streak_on_common_anchors_and_when_missing(tmp_path):
    dataset_of = {"s0": "gsm8k", "s1": "gsm8k"}
    # B was scored with --anchors walk: anchors 11 and 13 of s0 missing
    a = write_results(
        tmp_path / "a",
        [2.0, 2.0],
        name="run/step_100",
        anchors=_anchor_rows({"s0": [1, 1, 1, 1], "s1": [2]}, dataset_of),
    )
    b = write_results(
        tmp_path / "b",
        [2.0, 2.0],
        name="run/step_200",
        anchors=_anchor_rows({"s0": [3, None, 3, None], "s1": [2]}, dataset_of),
    )
    with pytest.warns(StreakWarning, match=r"anchors both runs scored only \(chain: 3 common of 5 in A's and 3 in B's"):
        df = run_comparison(a, b).table
    row = df.filter(pl.col("dataset") == ALL_DATASETS).row(0, named=True)
    assert row["streak_anchors"] == 3 and row["streak_delta"] == pytest.approx((3 + 3 + 2 - 1 - 1 - 2) / 3)
    # no anchors.parquet in B: said, streak columns null, tau still compared
    (tmp_path / "b" / "anchors.parquet").unlink()
    with pytest.warns(StreakWarning, match=r"streak is not compared: .*b/anchors.parquet not found"):
        comparison = run_comparison(a, b)
    assert comparison.table["streak_delta"].to_list() == [None, None] and comparison.table["n"].to_list() == [2, 2]
    result = CliRunner().invoke(main, ["compare", a, b], catch_exceptions=False)
    assert "all-anchor streak: not compared (" in result.stdout and "anchors.parquet not found)" in result.stdout


def test_interval_count(tmp_path):
    assert (
        chance_note(32, 0.95)
        == "32 intervals at 95%: expect about 1-2 to exclude zero by chance alone when nothing differs"
    )
    assert "expect about 2 to" in chance_note(40, 0.95)
    assert "1 interval at 90%: expect fewer than 1 (0.1)" in chance_note(1, 0.9)
    dataset_of = {f"s{i}": "gsm8k" if i < 3 else "humaneval" for i in range(6)}
    anchors = _anchor_rows({s: [1, 2] for s in dataset_of}, dataset_of)
    kw = {"datasets": list(dataset_of.values()), "anchors": anchors}
    a = write_results(tmp_path / "a", np.linspace(2, 3, 6), name="run/step_100", **kw)
    b = write_results(tmp_path / "b", np.linspace(2, 3, 6) + 0.1, name="run/step_200", **kw)
    result = CliRunner().invoke(main, ["compare", a, b], catch_exceptions=False)
    # 3 rows (gsm8k, humaneval, (all)) x (tau, streak)
    assert result.stdout.splitlines()[-1] == (
        "6 intervals at 95%: expect fewer than 1 (0.3) to exclude zero by chance alone when nothing differs"
    )
    result = CliRunner().invoke(main, ["compare", a, b, "--dataset", "gsm8k"], catch_exceptions=False)
    assert result.stdout.splitlines()[-1].startswith("2 intervals at 95%")


def test_same_checkpoint_content_is_said(tmp_path):
    tau = np.linspace(2, 3, 25)
    a, b = _pair(tmp_path, tau, tau, checkpoint_hash="ab" * 32)
    with pytest.warns(
        SameCheckpointWarning,
        match=r"A \(run/step_100\) and B \(run/step_200\) are the same checkpoint content \(checkpoint_hash abababababababab",
    ):
        comparison = run_comparison(a, b)
    assert comparison.same_checkpoint is True
    assert comparison.headline.endswith(
        "; A and B are the same checkpoint content (abababababababab), so zero is expected"
    )
    result = CliRunner().invoke(main, ["compare", a, b], catch_exceptions=False)
    assert "warning: A (run/step_100) and B (run/step_200) are the same checkpoint content" in result.stderr
    # different content: no such note
    c = write_results(tmp_path / "c", tau, name="run/step_300")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert run_comparison(a, c).same_checkpoint is False
    assert not _recorded(record, SameCheckpointWarning)


def test_directory_of_results_directories(tmp_path):
    tau = np.linspace(2, 3, 25)
    b = write_results(tmp_path / "b", tau + 0.2, name="run/step_200")
    # one results directory inside: used, and said
    write_results(tmp_path / "one" / "run_step_100", tau, name="run/step_100")
    with pytest.warns(
        SameCheckpointWarning,
        match=r"A: .*one is not itself a results directory; comparing the one it holds, .*one/run_step_100",
    ):
        comparison = run_comparison(str(tmp_path / "one"), b)
    assert comparison.dir_a == str(tmp_path / "one" / "run_step_100")
    # two copies of the same checkpoint content on the same shards: one kept, and said
    for copy in ("run_step_100", "run_step_100_again"):
        write_results(tmp_path / "dups" / copy, tau, name="run/step_100", checkpoint_hash="cd" * 32)
    with pytest.warns(SameCheckpointWarning) as record:
        comparison = run_comparison(str(tmp_path / "dups"), b)
    [note] = _recorded(record, SameCheckpointWarning)
    assert "holds 2 results directories of the same checkpoint content (checkpoint_hash cdcdcdcdcdcdcdcd" in note
    assert note.endswith(f"comparing {tmp_path / 'dups' / 'run_step_100'} only (delete the others to silence this)")
    assert comparison.dir_a == str(tmp_path / "dups" / "run_step_100") and comparison.table["n"].to_list() == [25, 25]
    # the same content scored on different shards is no duplicate
    write_results(
        tmp_path / "dups" / "run_step_100_other", tau, name="run/step_100", checkpoint_hash="cd" * 32, shards_id="s9"
    )
    with pytest.raises(
        CompareError, match=r"different checkpoints, pass one of them: .*shards shards-1\), .*shards s9\)"
    ):
        run_comparison(str(tmp_path / "dups"), b)

"""`specreplay speed`: predicted speed from results and a cost profile (docs/speed.md)."""

from __future__ import annotations

import json

import polars as pl
import pytest
from click.testing import CliRunner

from scoring.speed.predict import as_rows
from scoring.speed.profile import FORMAT, load_profile
from scoring.speed.run import predict_results
from specreplay.cli import main
from tests.helpers.fake_results import write_fake_results

TARGET = {"name": "tiny", "num_layers": 4, "hidden_size": 64, "vocab_size": 512}
TARGET_FACTS = {k: v for k, v in TARGET.items() if k != "name"}  # as run.json records them


def write_result(path, family: str, taus: dict[str, float], drafts: int = 4, name: str = "run_step_1") -> str:
    """A results directory whose pooled summary holds `taus` per method, for a chain of `drafts`."""
    identity = {"checkpoint": name, "checkpoint_hash": name, "checkpoint_step": 1, "drafter_family": family}
    summary = [
        {"dataset": "(all)", "method": method, "tau": tau, "accept_rate_by_position": [0.5] * drafts}
        for method, tau in taus.items()
    ]
    run = {"checkpoint": {"family": family, "name": name}, "shards": {"target_facts": TARGET_FACTS}}
    return write_fake_results(path, identity, [], summary, run=run)


def write_profile(path, verify, drafters=(), target=None) -> str:
    """A profile of `verify` [(batch, tokens, seconds)] and `drafters` [(family, batch, tokens, seconds)]."""
    data = {
        "format": FORMAT,
        "target": target or TARGET,
        "measured": {"engine": "hand", "device": "none", "context_len": 128},
        "verify": [{"batch": b, "tokens": n, "seconds": s} for b, n, s in verify],
        "drafters": [{"family": f, "batch": b, "tokens": n, "seconds": s} for f, b, n, s in drafters],
    }
    path.write_text(json.dumps(data))
    return str(path)


def rows_of(results_dir, profile_path, batches=None) -> dict:
    """(batch, method) -> prediction row."""
    rows = as_rows(predict_results([results_dir], load_profile(profile_path), batches))
    return {(r["batch"], r["method"]): r for r in rows}


def test_a_free_drafter_over_a_flat_verification_speeds_up_by_tau(tmp_path):
    """Verification whose time does not grow with the tokens verified (memory-bound decoding) and
    a drafter costing nothing: each step takes a plain step's time, so the speedup is tau."""
    result = write_result(tmp_path / "r", "ngram", {"chain": 1.7})
    profile = write_profile(tmp_path / "p.json", [(1, 1, 0.01), (1, 8, 0.01)])
    row = rows_of(result, profile)[(1, "chain")]
    assert row["verified"] == 5 and row["draft_s"] == 0.0
    assert row["speedup"] == pytest.approx(1.7)
    assert row["tokens_per_s"] == pytest.approx(170.0) and row["plain_tokens_per_s"] == pytest.approx(100.0)


def test_throughput_pools_tokens_over_steps_not_the_mean_of_per_sample_tau(tmp_path):
    """Two samples, 1 step of 4 tokens and 9 steps of 1: per-sample taus average 2.5, the workload
    appends 13 tokens in 10 steps, 1.3 a step: its throughput's rate."""
    identity = {"checkpoint": "a", "checkpoint_hash": "a", "checkpoint_step": 1, "drafter_family": "ngram"}
    row = {"dataset": "(all)", "method": "chain", "tau": 2.5, "steps": 10, "tokens_produced": 13}
    run = {"checkpoint": {"family": "ngram", "name": "a"}, "shards": {"target_facts": TARGET_FACTS}}
    result = write_fake_results(tmp_path / "r", identity, [], [dict(row, accept_rate_by_position=[0.5] * 3)], run=run)
    profile = write_profile(tmp_path / "p.json", [(1, 1, 0.01), (1, 4, 0.01)])
    assert rows_of(result, profile)[(1, "chain")]["speedup"] == pytest.approx(1.3)


def test_steps_are_priced_at_the_drafts_the_loop_verified_and_plain_decoding_at_its_own_cost(tmp_path):
    """An n-gram walk of 4 steps, two without a match (0 drafts: a one-token forward), one of 4
    drafts and one cut to 2: the mean step is (10 + 10 + 20 + 15) / 4 ms. The profile's plain
    decoding step (12 ms), not the one-token forward, is the speedup's base."""
    result = write_walk_result(tmp_path / "r", [0, 0, 3, 2], [0, 0, 4, 2])
    profile = tmp_path / "p.json"
    write_profile(profile, [(1, 1, 0.010), (1, 3, 0.015), (1, 5, 0.020)], [("dflash", 1, 5, 0.002)])
    data = json.loads(profile.read_text())
    data["plain"] = [{"batch": 1, "seconds": 0.012}]
    profile.write_text(json.dumps(data))
    row = rows_of(result, str(profile))[(1, "chain")]
    assert row["verify_s"] == pytest.approx((0.010 + 0.010 + 0.020 + 0.015) / 4)
    assert row["draft_s"] == pytest.approx(0.002 * 2 / 4)  # a block drafter runs its block at any cut, none at 0
    assert row["plain_tokens_per_s"] == pytest.approx(1 / 0.012)
    assert row["speedup"] == pytest.approx(2.0 * 0.012 / (row["verify_s"] + row["draft_s"]))


def test_the_step_prices_the_method_s_verified_tokens_and_the_drafter_s_passes(tmp_path):
    """A DFlash block of 4 drafts: chain verifies 5 tokens, ddtree-16 verifies 17 (root not
    counted), both after one block pass of 5 queries; times between measured counts interpolate."""
    result = write_result(tmp_path / "r", "dflash", {"chain": 2.0, "ddtree-16": 2.6})
    verify = [(1, 1, 0.010), (1, 5, 0.012), (1, 33, 0.040)]
    profile = write_profile(tmp_path / "p.json", verify, [("dflash", 1, 5, 0.003)])
    rows = rows_of(result, profile)
    chain, tree = rows[(1, "chain")], rows[(1, "ddtree-16")]
    assert (chain["verified"], tree["verified"]) == (5, 17)
    assert chain["step_s"] == pytest.approx(0.012 + 0.003)
    assert tree["verify_s"] == pytest.approx(0.012 + (0.040 - 0.012) * 12 / 28)
    assert tree["speedup"] == pytest.approx(2.6 * 0.010 / (tree["verify_s"] + 0.003))


def test_an_autoregressive_drafter_runs_one_pass_per_draft_and_a_tree_per_level(tmp_path):
    result = write_result(tmp_path / "r", "eagle3", {"chain": 2.2, "eagle-tree-4x5-8": 2.9}, drafts=3)
    verify = [(1, 1, 0.010), (1, 8, 0.014)]
    drafters = [("eagle3", 1, 1, 0.001), ("eagle3", 1, 4, 0.002)]
    rows = rows_of(result, write_profile(tmp_path / "p.json", verify, drafters))
    assert rows[(1, "chain")]["draft_s"] == pytest.approx(3 * 0.001)
    assert rows[(1, "eagle-tree-4x5-8")]["verified"] == 8
    assert rows[(1, "eagle-tree-4x5-8")]["draft_s"] == pytest.approx(0.001 + 4 * 0.002)


def test_a_step_row_measured_in_the_loop_prices_every_chain_step_at_the_configuration_s_k(tmp_path):
    """draft_steps (profile --in-generate): a chain step costs the verification of the drafts it
    verified plus the family's step row at the configuration's K (every step, those without a
    match too, as the loop measured them); a K past the rows is refused naming drafts."""
    result = write_walk_result(tmp_path / "r", [0, 3], [0, 4], family="ngram")  # K = 4
    profile = tmp_path / "p.json"
    write_profile(profile, [(1, 1, 0.010), (1, 5, 0.020)])
    data = json.loads(profile.read_text())
    data["draft_steps"] = [{"family": "ngram", "batch": 1, "drafts": k, "seconds": 0.001 * k} for k in (1, 2, 4)]
    profile.write_text(json.dumps(data))
    row = rows_of(result, str(profile))[(1, "chain")]
    assert row["verify_s"] == pytest.approx((0.010 + 0.020) / 2)
    assert row["draft_s"] == pytest.approx(0.004)  # the row at K = 4 for both steps
    data["draft_steps"] = data["draft_steps"][:2]
    profile.write_text(json.dumps(data))
    run = CliRunner().invoke(main, ["speed", result, "--profile", str(profile)])
    assert run.exit_code == 2 and "draft_steps[ngram] at batch 1 measures 1..2 drafts; 4 drafts" in run.output


def test_the_fastest_configuration_changes_with_the_batch_size(tmp_path):
    """Batch 1 is memory-bound (a larger tree is nearly free: the largest wins); at batch 32 the
    forward's time grows with every token verified and the short chain wins."""
    result = write_result(tmp_path / "r", "dflash", {"chain": 2.0, "ddtree-16": 2.6, "ddtree-64": 2.9})
    verify = [(1, 1, 0.010), (1, 65, 0.011), (32, 1, 0.012), (32, 5, 0.02), (32, 65, 0.4)]
    drafters = [("dflash", 1, 5, 0.001), ("dflash", 32, 5, 0.004)]
    rows = as_rows(predict_results([result], load_profile(write_profile(tmp_path / "p.json", verify, drafters))))
    best = {r["batch"]: r["method"] for r in rows if r["best"]}
    assert best == {1: "ddtree-64", 32: "chain"}


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda p: p["target"].update(vocab_size=1024), "target.vocab_size is 1024"),
        (lambda p: p["verify"][1].update(seconds=0.0), "verify[1].seconds"),
        (lambda p: p["verify"][1].update(seconds=-0.01), "verify[1].seconds"),
        (lambda p: p["verify"].append(dict(p["verify"][1])), "batch 1, 5 tokens is given twice"),
        (lambda p: p["verify"].pop(0), "needed"),  # no plain decode measured: tokens 1 missing
        (lambda p: p["verify"].pop(), "17 tokens per sequence are needed"),  # ddtree-16 past the largest
        (lambda p: p["drafters"].clear(), "no drafter cost for family 'dflash'"),
        (lambda p: p.update(format="other"), "format"),
    ],
    ids=[
        "other-target",
        "zero-time",
        "negative-time",
        "twice",
        "no-plain",
        "budget-past-measured",
        "no-drafter",
        "format",
    ],
)
def test_a_bad_profile_is_one_error_line(tmp_path, change, words):
    result = write_result(tmp_path / "r", "dflash", {"chain": 2.0, "ddtree-16": 2.6})
    verify = [(1, 1, 0.010), (1, 5, 0.012), (1, 17, 0.02)]
    path = tmp_path / "p.json"
    write_profile(path, verify, [("dflash", 1, 5, 0.003)])
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    run = CliRunner().invoke(main, ["speed", result, "--profile", str(path)])
    assert run.exit_code == 2, run.output
    [line] = [x for x in run.output.splitlines() if x]
    assert line.startswith("error: ") and str(path) in line and words in line, line


def test_the_console_names_the_fastest_per_batch_and_out_writes_every_row(tmp_path):
    result = write_result(tmp_path / "r", "dflash", {"chain": 2.0, "ddtree-16": 2.6})
    verify = [(1, 1, 0.010), (1, 17, 0.011), (8, 1, 0.012), (8, 17, 0.05)]
    drafters = [("dflash", 1, 5, 0.001), ("dflash", 8, 5, 0.002)]
    profile = write_profile(tmp_path / "p.json", verify, drafters)
    out = tmp_path / "speed.csv"
    run = CliRunner().invoke(main, ["speed", result, "--profile", profile, "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert "batch 1: fastest run_step_1 ddtree-16" in run.output
    assert "batch 8: fastest run_step_1 chain" in run.output
    table = pl.read_csv(out)
    assert table.height == 4 and table.filter(pl.col("best")).height == 2
    unmeasured = CliRunner().invoke(main, ["speed", result, "--profile", profile, "--batch", "4"])
    assert unmeasured.exit_code == 2 and "batch size 4 is not measured" in unmeasured.output
    only = CliRunner().invoke(main, ["speed", result, "--profile", profile, "--batch", "8", "--method", "ddtree-16"])
    assert only.exit_code == 0 and "batch 8: fastest run_step_1 ddtree-16, 0.60x" in only.output, only.output


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny_qwen3_dir):
    """A real extract of a tiny target and its shards' target sizes."""
    from pipeline.shards import ShardSet
    from tests.helpers.shards import tiny_shards

    tmp = tmp_path_factory.mktemp("speed")
    records = [{"id": "a", "prompt": "one two one two one two"}, {"id": "b", "prompt": "three four three four"}]
    shards = tiny_shards(tmp, tiny_qwen3_dir, records, 24)
    target = ShardSet(shards).manifest["settings"]["target"]
    return tmp, shards, {k: target[k] for k in ("num_layers", "hidden_size", "vocab_size")}


def test_score_with_a_profile_adds_the_fastest_per_batch_and_refuses_another_target_first(scored, tmp_path):
    """A real score of a baseline on a tiny target's shards: the headline's extra line names the
    predicted speedup the speed command computes from the same result; a profile of another
    target is refused before anything is scored."""
    _, shards, facts = scored
    profile = write_profile(
        tmp_path / "p.json", [(1, 1, 0.01), (1, 5, 0.012), (4, 1, 0.02), (4, 5, 0.05)], target=facts
    )
    args = ["score", "--ckpt", "ngram:vllm:k=4", "--shards", shards, "--quiet", "--profile", profile]
    run = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "out")])
    assert run.exit_code == 0, run.output
    [result] = [str(p) for p in (tmp_path / "out").iterdir()]
    [line] = [x.strip() for x in run.output.splitlines() if x.strip().startswith("predicted speedup")]
    expected = {r["batch"]: r["speedup"] for r in rows_of(result, profile).values()}
    assert (
        line == f"predicted speedup ({profile}): batch 1 {expected[1]:.2f}x (chain), batch 4 {expected[4]:.2f}x (chain)"
    )
    other = write_profile(tmp_path / "q.json", [(1, 1, 0.01), (1, 5, 0.012)], target=dict(facts, hidden_size=7))
    refused = CliRunner().invoke(main, [*args[:-1], other, "--out", str(tmp_path / "out2")])
    assert refused.exit_code == 2 and "target.hidden_size is 7" in refused.output
    assert not (tmp_path / "out2").exists()


def write_walk_result(path, accepted: list[int], drafted: list[int], family: str = "dflash") -> str:
    """A chain result of K = 4 whose walk steps accepted `accepted` of `drafted` drafts."""
    identity = {"checkpoint": "w", "checkpoint_hash": "w", "checkpoint_step": 1, "drafter_family": family}
    summary = [{"dataset": "(all)", "method": "chain", "tau": 2.0, "accept_rate_by_position": [0.9, 0.8, 0.7, 0.6]}]
    walk = [
        {"dataset": "d", "sample_id": "s", "method": "chain", "step": i, "accepted_len": a, "drafted": d}
        for i, (a, d) in enumerate(zip(accepted, drafted))
    ]
    run = {"checkpoint": {"family": family, "name": "w"}, "shards": {"target_facts": TARGET_FACTS}}
    return write_fake_results(path, identity, [], summary, walk=walk, run=run)


def test_synthetic_rates_are_the_walk_s_unconditional_acceptance_and_llama_server_reads_them_so(tmp_path):
    """Full steps (4 drafts verified) accepted 0, 1, 2, 4, 4, 3, 1, 0: P_k = the share accepting at
    least k = 6/8, 4/8, 3/8, 2/8 (a step cut to 2 drafts at the end does not count). The real
    llama-server takes the flag (it refuses rates that rise or a count other than its draft limit)
    and states the mean acceptance length it will draw, 1 + sum P_k."""
    from pipeline.extract.target import smollm2_gguf_path
    from tools.llama_server import LlamaServer

    result = write_walk_result(tmp_path / "r", [0, 1, 2, 4, 4, 3, 1, 0, 2], [4] * 8 + [2])
    run = CliRunner().invoke(main, ["speed", result, "--export", "llama.cpp"])
    assert run.exit_code == 0, run.output
    flags = run.output.strip().split(": ", 1)[1].split()
    assert flags == ["--spec-draft-n-max", "4", "--spec-synth-rates", "0.75,0.5,0.375,0.25"]
    vllm = CliRunner().invoke(main, ["speed", result, "--export", "vllm"])
    setting = json.loads(vllm.output.strip().split(": ", 1)[1])
    assert setting == {
        "num_speculative_tokens": 4,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.75, 0.5, 0.375, 0.25],
    }
    ngram = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-m", "4")
    server = LlamaServer(smollm2_gguf_path(), tmp_path / "server.log", extra=(*ngram, *flags)).start()
    server.stop()
    log = (tmp_path / "server.log").read_text()
    assert "synthetic acceptance: n_max = 4, mean length = 2.875000" in log, log[-3000:]


def test_the_dynamic_schedule_takes_the_fastest_k_per_batch_size(tmp_path):
    """One drafter scored at K 2 and K 6: free verification at batch 1 favours K 6; at batch 16
    verification grows with the tokens and K 2 wins. vLLM's schedule starts at batch size 1."""
    for k, tau in ((2, 2.2), (6, 3.0)):
        identity = {"checkpoint": "d", "checkpoint_hash": "d", "checkpoint_step": 1, "drafter_family": "ngram"}
        summary = [{"dataset": "(all)", "method": "chain", "tau": tau, "accept_rate_by_position": [0.5] * k}]
        run = {"checkpoint": {"family": "ngram", "name": "d"}, "shards": {"target_facts": TARGET_FACTS}}
        write_fake_results(tmp_path / "results" / f"k{k}", identity, [], summary, run=run)
    verify = [(1, 1, 0.01), (1, 7, 0.01), (16, 1, 0.02), (16, 3, 0.025), (16, 7, 0.06)]
    profile = write_profile(tmp_path / "p.json", verify)
    run = CliRunner().invoke(
        main, ["speed", str(tmp_path / "results"), "--profile", profile, "--export", "vllm-dynamic"]
    )
    assert run.exit_code == 0, run.output
    assert json.loads(run.output) == {
        "num_speculative_tokens": 6,
        "num_speculative_tokens_per_batch_size": [[1, 15, 6], [16, 16, 2]],
    }


def test_the_report_with_a_profile_shows_the_fastest_per_batch_as_speed_computes_it(scored, tmp_path):
    _, shards, facts = scored
    out = tmp_path / "out"
    for k in (2, 6):
        run = CliRunner().invoke(
            main, ["score", "--ckpt", f"ngram:vllm:k={k}", "--shards", shards, "--quiet", "--out", str(out)]
        )
        assert run.exit_code == 0, run.output
    verify = [(1, 1, 0.01), (1, 7, 0.011), (8, 1, 0.02), (8, 7, 0.09)]
    profile = write_profile(tmp_path / "p.json", verify, target=facts)
    page = tmp_path / "report.html"
    run = CliRunner().invoke(main, ["report", str(out), "--out", str(page), "--profile", profile])
    assert run.exit_code == 0, run.output
    text = page.read_text()
    assert "<h2>Predicted speed</h2>" in text and "Plain tokens/s" in text
    rows = as_rows(predict_results([str(out)], load_profile(profile)))
    for r in rows:
        if r["best"]:
            assert f"<td>{r['batch']}</td><td>{r['method']}</td><td>{r['tau']:.3f}</td>" in text, r
    without = CliRunner().invoke(main, ["report", str(out), "--out", str(tmp_path / "plain.html")])
    assert without.exit_code == 0 and "Predicted speed" not in (tmp_path / "plain.html").read_text()
    a, b = sorted(str(p) for p in out.iterdir() if p.is_dir())
    compared = CliRunner().invoke(main, ["compare", a, b, "--profile", profile, "--resamples", "50"])
    assert compared.exit_code == 0, compared.output
    for side, directory in (("A", a), ("B", b)):
        best = {r["batch"]: r for r in as_rows(predict_results([directory], load_profile(profile))) if r["best"]}
        line = ", ".join(f"batch {n} {r['speedup']:.2f}x ({r['method']})" for n, r in sorted(best.items()))
        assert f"{side}: predicted speedup ({profile}): {line}" in compared.output

"""Non-finite values (NaN/Inf), through the CLI: a target whose features or logits overflow for
some samples (those are excluded at extract, recorded with layer and position, reported by
inspect and score, never scored); a drafter checkpoint with NaN/Inf weights (refused by tensor
name); a drafter whose logits overflow on some samples only (those are left out of every table
and reported with their anchors, not averaged into tau).

The faulty target is a tiny Qwen3 with one embedding row set to inf: a sample holding that
token gets NaN hidden states from its position on, every other sample is untouched. The
faulty drafter has finite weights, one fc weight so large that the product overflows only
where that feature column is large: some samples' features are, others' are not.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import polars as pl
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from pipeline import shards
from pipeline.shards import ShardSet
from scoring.fit import save_drafter
from specreplay.cli import main
from tests.helpers.drafters import random_drafter
from tests.helpers.models import build_tiny_qwen3
from tests.helpers.prompts import write_prompts

BAD = 450  # a token id the tokenizer never produces (its vocab is 400 of the model's 512 rows)
MAX_NEW = 8

# q1: BAD in the prompt; q3: BAD in the given response; q5 (last): its record comes after the
# last written sample (an empty shard carries it). The NaN of BAD's position reaches every
# position (attention multiplies it by zero weights), so the first bad one is 0 and all are bad.
RECORDS = [
    {"id": "q0", "input_ids": [1, 40, 41, 42]},
    {"id": "q1", "input_ids": [1, 40, BAD, 42, 43]},
    {"id": "q2", "prompt": "Hello, how are you today?", "dataset": "chat"},
    {"id": "q3", "input_ids": [1, 50, 51], "response": [60, 61, BAD, 62], "dataset": "chat"},
    {"id": "q4", "input_ids": [1, 44, 45, 46, 47], "response": [70, 71, 72, 73, 74]},
    {"id": "q5", "input_ids": [1, BAD, 52]},
]
GOOD = ["q0", "q2", "q4"]
EXCLUDED = {"q1": ("layer 1 features", 0), "q3": ("layer 1 features", 0), "q5": ("layer 1 features", 0)}


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def build_overflowing_target(directory: Path) -> str:
    """build_tiny_qwen3 with embedding row BAD set to +inf (any sample holding BAD gets NaN)."""
    path = build_tiny_qwen3(directory)
    weights_file = Path(path) / "model.safetensors"
    weights = load_file(str(weights_file))
    weights["model.embed_tokens.weight"][BAD] = float("inf")
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return path


def extract_args(model: str, prompts: str, out: Path) -> list[str]:
    # --shard-bytes 1KiB: every written sample lands its own shard, so exclusions are carried by
    # the entries of later shards, and the last one by a shard of its own
    return [
        "extract",
        "--model",
        model,
        "--prompts",
        prompts,
        "--out",
        str(out),
        "--max-new-tokens",
        str(MAX_NEW),
        "--layer-ids",
        "1,3",
        "--top-k",
        "8",
        "--dtype",
        "fp32",
        "--shard-bytes",
        "1KiB",
        "--quiet",
    ]


def count_captures(monkeypatch) -> list[str]:
    """Patch capture_sample to record the prompt ids of every capture forward."""
    import pipeline.extract.capture as capture

    seen, original = [], capture.capture_sample

    def counted(model, input_ids, prompt_len, config):
        seen.append(input_ids[:prompt_len])
        return original(model, input_ids, prompt_len, config)

    monkeypatch.setattr(capture, "capture_sample", counted)
    return seen


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nonfinite")
    model = build_overflowing_target(tmp / "target")
    prompts = write_prompts(tmp / "prompts.jsonl", RECORDS)
    out = tmp / "shards"
    result = invoke(*extract_args(model, prompts, out))
    assert result.exit_code == 0, result.output
    return tmp, model, prompts, out, result.output


def test_extract_excludes_nonfinite_samples_with_layer_and_position(extracted):
    tmp, _, _, out, output = extracted
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"]
    totals = manifest["totals"]
    assert totals["samples"] == len(GOOD) and totals["excluded_samples"] == len(EXCLUDED)
    recorded = {r["sample_id"]: r for r in totals["excluded"]}
    assert {k: (r["what"], r["position"]) for k, r in recorded.items()} == EXCLUDED
    assert recorded["q3"]["dataset"] == "chat" and recorded["q1"]["dataset"] == "prompts"
    assert all(r["count"] == r["length"] for r in recorded.values())  # a NaN poisons every position
    assert recorded["q3"]["length"] == 3 + 4  # q3's tokens, prompt and given response
    # never written: the shards hold only the good samples, each finite
    samples = list(ShardSet(str(out)).samples())
    assert sorted(s.sample_id for s in samples) == GOOD
    for sample in samples:
        assert BAD not in sample.input_ids.tolist()
        assert all(bool(torch.isfinite(t.float()).all()) for k, t in sample.tensors.items() if k != "topk_logprobs")
        assert not bool(torch.isnan(sample.tensors["topk_logprobs"]).any())
    # q5 came after the last written sample: a shard of no rows lands to carry it
    entries = shards.finished_shard_entries(str(out))
    last = entries[-1]
    assert last["rows"] == 0 and [r["sample_id"] for r in last["excluded"]] == ["q5"]
    assert sum("excluded" in e for e in entries) == 3  # one record each, no key where none
    # the end-of-run lines say so, with what and where
    warning = next(line for line in output.splitlines() if line.startswith("warning: "))
    lengths = {k: r["length"] for k, r in recorded.items()}
    assert warning == (
        f"warning: 3 samples excluded: non-finite values (q1: layer 1 features at every position ({lengths['q1']}); "
        f"q3: layer 1 features at every position (7); q5: layer 1 features at every position ({lengths['q5']})); "
        f"they are not stored and never scored (fp16 overflow? use bf16 or fp32 for --dtype and --feature-dtype)"
    ), output
    assert "Traceback" not in output


def test_inspect_reports_excluded(extracted):
    _, _, _, out, _ = extracted
    result = invoke("inspect", str(out))
    assert result.exit_code == 0, result.output  # exclusions are not an integrity problem
    line = next(line for line in result.output.splitlines() if line.strip().startswith("excluded"))
    assert "3 samples excluded: non-finite values (q1: layer 1 features at every position (" in line
    assert "samples         3 in" in result.output
    report = json.loads(invoke("inspect", str(out), "--json").output)
    assert report["excluded_samples"] == 3 and [r["sample_id"] for r in report["excluded"]] == ["q1", "q3", "q5"]


def test_good_samples_equal_an_extract_of_the_good_prompts_only(extracted):
    tmp, model, _, out, _ = extracted
    good_prompts = write_prompts(tmp / "good.jsonl", [r for r in RECORDS if r["id"] in GOOD])
    result = invoke(*extract_args(model, good_prompts, tmp / "good_shards"))
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output and "excluded" not in result.output
    manifest = json.loads((tmp / "good_shards" / "manifest.json").read_text())
    assert "excluded" not in manifest["totals"] and "excluded_samples" not in manifest["totals"]
    assert all("excluded" not in e for e in manifest["shards"])  # entries as they always were
    reference = {s.sample_id: s for s in ShardSet(str(tmp / "good_shards")).samples()}
    for sample in ShardSet(str(out)).samples():
        other = reference[sample.sample_id]
        assert torch.equal(sample.input_ids, other.input_ids) and sample.finish_reason == other.finish_reason
        assert set(sample.tensors) == set(other.tensors)
        for name, tensor in sample.tensors.items():
            assert torch.equal(tensor, other.tensors[name]), (sample.sample_id, name)


def test_fp16_feature_overflow_is_found_at_its_position(tmp_path):
    """The usual cause: features finite in the fp32 forward overflow float16 storage at one
    token (an embedding row of 1e5 keeps its size along the residual stream)."""
    path = build_tiny_qwen3(tmp_path / "target")
    weights = load_file(str(Path(path) / "model.safetensors"))
    weights["model.embed_tokens.weight"][BAD] = 1e5
    save_file(weights, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
    prompts = write_prompts(
        tmp_path / "p.jsonl",
        [
            {"id": "a", "input_ids": [1, 40, 41, BAD, 42], "response": [60, 61, 62]},
            {"id": "b", "input_ids": [1, 40, 41, 42], "response": [60, 61, 62]},
        ],
    )
    out = tmp_path / "out"
    result = invoke(*extract_args(path, prompts, out), "--feature-dtype", "float16")
    assert result.exit_code == 0, result.output
    assert "warning: 1 sample excluded: non-finite values (a: layer 1 features at position 3); " in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["totals"]["excluded"] == [
        {"sample_id": "a", "dataset": "p", "what": "layer 1 features", "position": 3, "count": 1, "length": 8}
    ]
    assert [s.sample_id for s in ShardSet(str(out)).samples()] == ["b"]


def test_resume_neither_redoes_nor_duplicates(extracted, tmp_path, monkeypatch):
    tmp, model, prompts, out, _ = extracted
    before = json.loads((out / "manifest.json").read_text())
    seen = count_captures(monkeypatch)
    again = invoke(*extract_args(model, prompts, out))  # complete: nothing is redone
    assert again.exit_code == 0 and seen == [] and "3 samples excluded" in again.output
    assert json.loads((out / "manifest.json").read_text()) == before

    # an interrupted run: a copy whose shard carrying q4 and q3's record never landed
    copy = tmp_path / "copy"
    for path in out.rglob("*"):
        if path.is_file() and not path.name.startswith(".specreplay"):
            target = copy / path.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    entries = shards.finished_shard_entries(str(copy))
    lost = next(e for e in entries if "q4" in e["sample_ids"])
    assert [r["sample_id"] for r in lost["excluded"]] == ["q3"]
    for suffix in (".arrow", ".json"):
        (copy / lost["file"]).with_suffix(suffix).unlink()
    shards.write_manifest(str(copy), {**shards.read_manifest(str(copy)), "complete": False})

    resumed = invoke(*extract_args(model, prompts, copy))
    assert resumed.exit_code == 0, resumed.output
    assert len(seen) == 2  # q3 (excluded again) and q4; q1 and q5, excluded before, are not redone
    final = json.loads((copy / "manifest.json").read_text())
    ids = [s for e in final["shards"] for s in e["sample_ids"]]
    assert sorted(ids) == GOOD
    records = [r["sample_id"] for r in final["totals"]["excluded"]]
    assert sorted(records) == sorted(EXCLUDED) and final["totals"]["excluded_samples"] == 3
    for key in ("samples", "tokens", "response_tokens", "finish_reasons"):
        assert final["totals"][key] == before["totals"][key]


# ---------------------------------------------------------------------------------------------
# drafters


def overflowing_drafter(shard_dir: str, directory: Path, margin: float = 1.15):
    """A drafter whose fc overflows to inf on some samples only: fc.weight[0, j] = w, so that
    |x_j| * w passes float32's maximum exactly where |x_j| > b = max / w. Column j and b are
    chosen from the stored features so that some samples reach b * margin inside their prompt
    (every anchor sees the prompt: all their anchors overflow) and the others stay below
    b / margin everywhere. Returns (checkpoint dir, the sample ids that overflow)."""
    samples = list(ShardSet(shard_dir).samples(tensors=["features"]))
    prompt_peaks = torch.stack([s.features[: s.prompt_len].abs().amax(dim=0) for s in samples])  # [S, C]
    full_peaks = torch.stack([s.features.abs().amax(dim=0) for s in samples])
    best = None  # (separation, column, boundary, hits)
    for column in range(prompt_peaks.shape[1]):
        for lowest_hit in prompt_peaks[:, column].tolist():
            hits = [i for i, peak in enumerate(prompt_peaks[:, column].tolist()) if peak >= lowest_hit]
            others = [float(full_peaks[i, column]) for i in range(len(samples)) if i not in hits]
            if not others or lowest_hit <= 0:
                continue
            separation = lowest_hit / max(others)
            if separation >= margin**2 and (best is None or separation > best[0]):
                best = (separation, column, math.sqrt(lowest_hit * max(others)), hits)
    assert best is not None, "no feature column separates the samples"
    _, column, boundary, hits = best
    weight = torch.finfo(torch.float32).max / boundary
    assert math.isfinite(weight)
    drafter = random_drafter(layer_ids=(1, 3), seed=0)
    with torch.no_grad():
        drafter.fc.weight[0, column] = weight
    hit_ids = {samples[i].sample_id for i in hits}
    assert 0 < len(hit_ids) < len(samples)  # some samples, not all
    return save_drafter(drafter, str(directory)), hit_ids


def nan_weights_drafter(directory: Path) -> str:
    path = save_drafter(random_drafter(layer_ids=(1, 3), seed=1), str(directory))
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["layers.0.mlp.up_proj.weight"].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    save_file(weights, os.path.join(path, "model.safetensors"))
    return path


def test_score_through_faulty_drafters_and_excluded_extract(extracted, tmp_path):
    """One `score` over the extract with excluded samples and four checkpoints: a good one, one
    with NaN/Inf weights (refused by file and tensor, the others still scored, exit 1), one
    whose logits overflow on some samples (those reported with anchors and left out of every
    table), one whose logits overflow everywhere (nothing left: a failed checkpoint)."""
    tmp, _, _, out, _ = extracted
    good = save_drafter(random_drafter(layer_ids=(1, 3), seed=2), str(tmp_path / "ckpts" / "good"))
    damaged = nan_weights_drafter(tmp_path / "ckpts" / "damaged")
    overflow, hits = overflowing_drafter(str(out), tmp_path / "ckpts" / "overflow")
    everywhere = save_drafter(random_drafter(layer_ids=(1, 3), seed=3), str(tmp_path / "ckpts" / "everywhere"))
    weights = load_file(os.path.join(everywhere, "model.safetensors"))
    weights["fc.weight"][0] = torch.finfo(torch.float32).max  # any non-zero feature overflows
    save_file(weights, os.path.join(everywhere, "model.safetensors"))

    results = tmp_path / "results"
    args = ["score", "--shards", str(out), "--out", str(results), "--ddtree-budgets", "4", "--no-progress"]
    for ckpt in (good, damaged, overflow, everywhere):
        args += ["--ckpt", ckpt]
    result = invoke(*args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, result.output
    weights_file = os.path.join(damaged, "model.safetensors")
    assert errors[0] == (
        f"error: {weights_file}: tensor layers.0.mlp.up_proj.weight has 3 NaN/Inf values; "
        f"the checkpoint is damaged (fp16 overflow in training?); use another checkpoint"
    )
    assert errors[1].startswith(f"error: {everywhere}: no sample left to score: 3 samples excluded: the drafter ")
    assert "2 of 4 checkpoints failed (errors above):" in result.output
    assert sorted(os.listdir(results)) == ["ckpts_good", "ckpts_overflow"]

    # the extract's exclusions: counted in run.json and one note, for every scored checkpoint
    for name in ("ckpts_good", "ckpts_overflow"):
        record = json.loads((results / name / "run.json").read_text())
        assert record["shards"]["excluded_samples"] == 3
    notes = [line for line in result.output.splitlines() if "the extract excluded 3 samples" in line]
    assert len(notes) == 2 and "NaN/Inf target values" in notes[0], result.output
    good_samples = pl.read_parquet(results / "ckpts_good" / "samples.parquet")
    assert sorted(set(good_samples["sample_id"])) == GOOD  # a bad sample is never scored
    assert json.loads((results / "ckpts_good" / "run.json").read_text())["nonfinite_drafter"] == []

    # the overflowing drafter: its bad samples are in run.json with anchors, in no table
    record = json.loads((results / "ckpts_overflow" / "run.json").read_text())
    reported = {r["sample_id"]: r for r in record["nonfinite_drafter"]}
    assert set(reported) == hits
    lengths = {s.sample_id: (s.prompt_len, s.input_ids.numel()) for s in ShardSet(str(out)).samples()}
    for sample_id, r in reported.items():
        prompt_len, n = lengths[sample_id]
        assert r["anchors"] == list(range(prompt_len, n - 1)), r  # the overflow is in the prompt
    kept = sorted(set(GOOD) - hits)
    for table in ("samples", "anchors", "walk"):
        frame = pl.read_parquet(results / "ckpts_overflow" / f"{table}.parquet")
        assert sorted(set(frame["sample_id"])) == kept, table
    summary = pl.read_parquet(results / "ckpts_overflow" / "summary.parquet")
    pooled = summary.filter(pl.col("dataset") == "(all)")
    assert set(pooled["samples"]) == {len(kept)}
    assert all(math.isfinite(t) for t in pooled["tau"])
    for column in ("anchor_accepted_len_mean", "target_prob_mean", "kl_topk_mean"):
        assert all(v is None or math.isfinite(v) for v in pooled[column]), column
    # (the random drafters' acceptance is at the floor too, which score also warns about)
    warnings = [line.strip() for line in result.output.splitlines() if line.strip().startswith("warning: ")]
    warnings = [line for line in warnings if "at the floor" not in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: {len(hits)} sample{'s' if len(hits) > 1 else ''} excluded: the drafter produced NaN/Inf logits ("
    ), result.output
    assert all(f"{sample_id} anchors " in warnings[0] for sample_id in hits)

    # walk-only replay finds the same samples
    walk_out = tmp_path / "walk"
    walked = invoke(
        "score", "--ckpt", overflow, "--shards", str(out), "--out", str(walk_out), "--anchors", "walk", "--quiet"
    )
    assert walked.exit_code == 0, walked.output
    walk_record = json.loads(next(walk_out.glob("*/run.json")).read_text())
    assert {r["sample_id"] for r in walk_record["nonfinite_drafter"]} == hits
    as_json = json.loads(invoke(*args[:-2], "--json").output)  # every checkpoint but the last, already scored
    counts = {item["checkpoint"]: item.get("nonfinite_drafter_samples") for item in as_json}
    assert counts == {"good": 0, os.path.abspath(damaged): None, "overflow": len(hits)}


def test_weights_beyond_the_compute_dtype_are_refused(tmp_path):
    from proposers.checkpoints.files import NonFiniteWeightsError
    from proposers.checkpoints.load import load_drafter

    path = save_drafter(random_drafter(layer_ids=(1, 3), seed=4), str(tmp_path / "big"))
    weights = load_file(os.path.join(path, "model.safetensors"))
    weights["fc.weight"][0, :2] = 1e6  # finite in float32, beyond float16's 65504
    save_file(weights, os.path.join(path, "model.safetensors"))
    load_drafter(path)  # float32: fine
    with pytest.raises(NonFiniteWeightsError, match=r"tensor fc.weight has 2 values beyond the range of float16"):
        load_drafter(path, dtype=torch.float16)


def test_nonfinite_values_what_and_where():
    """The unit under the extract check: layers in ascending id, logits at the position whose
    next-token distribution they are; -inf log-probs (probability 0) are not errors."""
    from pipeline.extract.capture import nonfinite_values

    features = torch.zeros(6, 3 * 4)
    logprobs = torch.full((3, 2), -1.0)
    tensors = {"features": features, "topk_logprobs": logprobs}
    assert nonfinite_values(tensors, [5, 1, 3], prompt_len=4) is None
    logprobs[1, 1] = -float("inf")
    assert nonfinite_values(tensors, [5, 1, 3], prompt_len=4) is None
    logprobs[2, 0] = float("nan")
    where = {"what": "logits", "position": 5, "count": 1, "length": 3}
    assert nonfinite_values(tensors, [5, 1, 3], prompt_len=4) == where
    features[4, 1] = float("inf")  # layer 5 (column group 0), position 4
    features[5, 9] = float("nan")  # layer 3 (column group 2), position 5: the lower layer id wins
    features[2, 10] = float("nan")  # and its first bad position is 2, of 2 bad
    where = {"what": "layer 3 features", "position": 2, "count": 2, "length": 6}
    assert nonfinite_values(tensors, [5, 1, 3], prompt_len=4) == where
    fp8 = {
        "features": torch.zeros(6, 8).to(torch.float8_e4m3fn),
        "features_scale": torch.ones(6, 2),
        "topk_logprobs": torch.zeros(3, 2),
    }
    fp8["features_scale"][3, 1] = float("inf")
    where = {"what": "layer 7 features", "position": 3, "count": 1, "length": 6}
    assert nonfinite_values(fp8, [2, 7], prompt_len=4) == where
    sampled = {"features": torch.zeros(6, 4), "topk_logprobs": torch.zeros(3, 2), "sample_logprob": torch.zeros(2)}
    sampled["sample_logprob"][1] = float("nan")
    assert nonfinite_values(sampled, [1], prompt_len=4) == {"what": "logits", "position": 4, "count": 1, "length": 2}


def test_drafter_nan_context_spoils_only_the_anchors_that_see_it(extracted):
    """Replay of a sample whose features hold inf at one response position p: the drafter's
    keys/values there are NaN; exactly the anchors that see p (t > p) are reported, the others
    equal the replay of the untouched sample bit for bit (the NaN was kept out of them)."""
    import dataclasses

    from proposers.toolkit.neural import neural_proposer
    from scoring.replay.anchors import replay_sample
    from scoring.replay.packing import ReplayOptions, prepare_target_head

    _, _, _, out, _ = extracted
    shardset = ShardSet(str(out))
    sample = next(s for s in shardset.samples() if s.sample_id == "q4")
    head = prepare_target_head(shardset.target_head(), "cpu", torch.float32)
    drafter = random_drafter(layer_ids=(1, 3), seed=5)
    options = ReplayOptions(methods={"ddtree": (4,)})

    def replay(s):
        return replay_sample(neural_proposer(drafter), head, s, lambda f: f, MAX_NEW, options)

    clean = replay(sample)
    p = sample.prompt_len + 2
    features = sample.features.clone()
    features[p, 5] = float("inf")
    spoiled = replay(dataclasses.replace(sample, tensors={**sample.tensors, "features": features}))
    assert not bool(clean.nonfinite.any())
    assert spoiled.anchors[spoiled.nonfinite].tolist() == [t for t in spoiled.anchors.tolist() if t > p]
    keep = ~spoiled.nonfinite
    assert 0 < int(keep.sum()) < keep.numel()
    for name in ("draft_tokens", "target_logprob", "kl_topk"):
        torch.testing.assert_close(
            getattr(spoiled, name)[keep], getattr(clean, name)[keep], rtol=0, atol=0, equal_nan=True
        )
    pops = spoiled.method_data["ddtree"][keep], clean.method_data["ddtree"][keep]
    torch.testing.assert_close(*pops, rtol=0, atol=0)


def test_diagnose_leaves_out_samples_with_nonfinite_logits(extracted, tmp_path):
    """diagnose pairs only samples both sides measured: the overflowing samples are counted in
    no variant's numbers, and a warning names how many."""
    import pyarrow.parquet as pq

    tmp, _, _, out, _ = extracted
    overflow, hits = overflowing_drafter(str(out), tmp_path / "ckpts" / "overflow")
    samples = ShardSet(str(out)).num_samples
    result = invoke("diagnose", "--ckpt", overflow, "--shards", str(out), "--out", str(tmp_path / "d"), "--no-progress")
    assert result.exit_code == 0, result.output
    assert f"as-configured: {len(hits)} samples left out: the drafter produced NaN/Inf logits" in result.output
    rows = pq.read_table(tmp_path / "d" / "ckpts_overflow" / "diagnose.parquet").to_pylist()
    tau = {r["variant"]: r for r in rows if r["metric"] == "tau"}
    assert tau["as-configured"]["samples"] == samples - len(hits)
    assert all(r["value"] is None or math.isfinite(r["value"]) for r in rows)

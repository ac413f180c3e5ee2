"""Generated bad inputs against every command that reads user input (tests/helpers/bad_inputs.py):
each declared input broken one way at a time, each command run in-process on it. The schema
decides what is wrong; the command must agree in one `error:` line naming the file (and the field
the schema names), never a traceback, never output from a refused run; a document the schema
accepts may also run through, and one that only gained an unknown field gives the same results.

Examples are derandomized (the same cases in CI every time); `-s` prints each command's tally.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from pipeline.common.schema import SchemaError
from pipeline.extract.records import RecordSchema
from pipeline.shards import ShardSet
from pipeline.shards.files import json_checksum
from pipeline.shards.manifest import ManifestFile, ShardEntry
from proposers.fields.known import unknown_fields
from proposers.layouts import detect_layout
from scoring.results import RunRecord
from scoring.track.ledger import LEDGER_NAME, LedgerFile
from specreplay.cli import main
from tests.helpers.bad_inputs import check_outcome, listing, mutations, schema_verdict, write_json
from tests.helpers.drafters import fitted_drafters
from tests.helpers.prompts import write_prompts
from tests.helpers.shards import tiny_shards

RECORDS = [
    {"id": "r1", "prompt": "What is 2 + 2?", "dataset": "math"},
    {"id": "r2", "messages": [{"role": "user", "content": "Name a colour."}], "response": "Blue."},
    {"id": "r3", "input_ids": [5, 6, 7, 8], "response": [9, 10]},
]
FIRST = {"id": "r0", "prompt": "Say hi."}  # every prompt file's first line, the mutated record after it
EXTRACT = ["--max-new-tokens", "4", "--dtype", "fp32", "--top-k", "4", "--layer-ids", "1,3", "--quiet"]
SCORE = ["--ddtree-budgets", "4", "--device", "cpu", "--quiet"]
TALLY: dict[str, Counter] = {}


# BAD_INPUTS_SCALE=10: ten times the examples, fresh ones each run (a longer hunt than CI's)
SCALE = int(os.environ.get("BAD_INPUTS_SCALE", "1"))


def cases(n: int):
    """Settings for one generated test: n examples, the same ones every run (unless scaled)."""
    return settings(
        max_examples=n * SCALE,
        deadline=None,
        derandomize=SCALE == 1,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def run(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_qwen3_dir):
    """A tiny target, its extract, a drafter fitted a few steps, and that drafter scored twice."""
    root = tmp_path_factory.mktemp("bad_inputs")
    shards = tiny_shards(root, tiny_qwen3_dir, RECORDS[:2], max_new_tokens=6)
    ckpt = fitted_drafters(shards, root / "runs", steps=3)[-1]
    for out in ("results", "results_b"):
        result = run("score", "--ckpt", ckpt, "--shards", shards, "--out", str(root / out), *SCORE)
        assert result.exit_code == 0, result.output
    results = [str(next((root / out).iterdir())) for out in ("results", "results_b")]
    return {"root": root, "model": tiny_qwen3_dir, "shards": shards, "ckpt": ckpt, "results": results}


def fresh(world, name: str) -> Path:
    """An empty directory for one case."""
    path = world["root"] / "cases" / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def tally(command: str, verdict: str) -> None:
    TALLY.setdefault(command, Counter())[verdict] += 1


@pytest.fixture(scope="module", autouse=True)
def report_tally():
    yield
    for command, counts in sorted(TALLY.items()):
        print(f"bad inputs, {command}: {sum(counts.values())} cases, {dict(counts)}")


# --------------------------------------------------------------------------- prompt records: extract


@given(data=st.data())
@cases(40)
def test_extract_prompt_records(world, data):
    record = data.draw(st.sampled_from(RECORDS))
    mutation = data.draw(mutations(record))
    case = fresh(world, "extract_record")
    prompts = case / "prompts.jsonl"
    prompts.write_text(json.dumps(FIRST) + "\n" + json.dumps(mutation.document) + "\n")
    out = case / "out"
    result = run("extract", "--model", world["model"], "--prompts", str(prompts), "--out", str(out), *EXTRACT)
    field = schema_verdict(RecordSchema, mutation.document) if isinstance(mutation.document, dict) else ""
    wrote = out.exists() and bool(listing(out))
    verdict = check_outcome(result, mutation, str(prompts), field, wrote)
    if verdict == "accepted" and mutation.kind == "extra":  # a field nothing reads changes nothing stored
        assert stored_tokens(out) == stored_tokens(baseline_extract(world, record)), mutation
    tally("extract (prompt records)", verdict)


def stored_tokens(shards) -> dict[str, list[int]]:
    return {s.sample_id: s.input_ids.tolist() for s in ShardSet(str(shards)).samples(tensors=[])}


def baseline_extract(world, record: dict) -> Path:
    """The extract of FIRST and `record` as they are (made once per record)."""
    out = world["root"] / "baselines" / record["id"]
    if not out.exists():
        prompts = write_prompts(out.parent / f"{record['id']}.jsonl", [FIRST, record])
        result = run("extract", "--model", world["model"], "--prompts", prompts, "--out", str(out), *EXTRACT)
        assert result.exit_code == 0, result.output
    return out


# --------------------------------------------------------------------------- drafter configs


def config_verdict(document, decoders: bool = True) -> str | None:
    """The layout's schema verdict; '' when no layout even applies (an unknown family). With
    `decoders` (the commands that parse the whole config: score, diagnose, watch), then the first
    key of a decoder namespace that neither transformers' config class nor the layout declares
    (proposers/fields/known.py), which those commands refuse by name too."""
    if not isinstance(document, dict):
        return ""
    try:
        layout = detect_layout(document, "config.json").layout
    except SchemaError:
        return ""
    field = schema_verdict(layout, document)
    if field is not None or not decoders:
        return field
    unknown = unknown_fields(layout.model_validate(document), document)
    return unknown[0][0] if unknown else None


def speculators_twin(zlab: dict, kind: str) -> dict:
    """The same drafter's config in speculators' layout, with its kind's own keys only (another
    kind's key is refused by name)."""
    shape = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if kind == "eagle3":
        own = {"eagle_aux_hidden_state_layer_ids": [2, 4]}
    else:
        own = {"block_size": 4, "mask_token_id": zlab["dflash_config"]["mask_token_id"]}
        own["aux_hidden_state_layer_ids"] = [2, 4]
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": kind,
        "transformer_layer_config": {k: zlab[k] for k in shape},
        **own,
        "speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]},
    }


def drafter_configs(world) -> list[dict]:
    zlab = json.loads(Path(world["ckpt"], "config.json").read_text())
    return [zlab, speculators_twin(zlab, "dflash"), speculators_twin(zlab, "eagle3")]


def broken_checkpoint(world, data, name: str):
    """A copy of the fitted drafter with its config.json broken one way."""
    config = data.draw(st.sampled_from(drafter_configs(world)))
    mutation = data.draw(mutations(config))
    ckpt = fresh(world, name) / "ckpt"
    shutil.copytree(world["ckpt"], ckpt)
    write_json(ckpt / "config.json", mutation.document)
    return ckpt, mutation


@given(data=st.data())
@cases(40)
def test_score_drafter_config(world, data):
    ckpt, mutation = broken_checkpoint(world, data, "score_config")
    out = ckpt.parent / "results"
    result = run("score", "--ckpt", str(ckpt), "--shards", world["shards"], "--out", str(out), *SCORE)
    wrote = out.exists() and bool(listing(out))
    verdict = check_outcome(result, mutation, str(ckpt), config_verdict(mutation.document), wrote)
    if verdict == "accepted" and mutation.kind == "extra":  # an unread field changes no number
        assert taus(next(out.iterdir())) == taus(world["results"][0]), mutation
    tally("score (drafter config)", verdict)


def taus(results_dir) -> list:
    summary = pq.read_table(Path(results_dir) / "summary.parquet").to_pylist()
    return sorted((row["dataset"], row["method"], row["tau"], row["anchor_accepted_len_mean"]) for row in summary)


@given(data=st.data())
@cases(12)
def test_diagnose_drafter_config(world, data):
    ckpt, mutation = broken_checkpoint(world, data, "diagnose_config")
    out = ckpt.parent / "diagnose"
    args = ["--ckpt", str(ckpt), "--shards", world["shards"], "--out", str(out), "--variants", "bf16"]
    result = run("diagnose", *args, "--device", "cpu", "--limit", "2", "--no-progress")
    wrote = out.exists() and bool(listing(out))
    verdict = check_outcome(result, mutation, str(ckpt), config_verdict(mutation.document), wrote)
    tally("diagnose (drafter config)", verdict)


@given(data=st.data())
@cases(12)
def test_watch_drafter_config(world, data):
    ckpt, mutation = broken_checkpoint(world, data, "watch_config")
    out = ckpt.parent / "results"
    args = ["--ckpt", str(ckpt), "--shards", world["shards"], "--out", str(out), "--once", "--device", "cpu"]
    result = run("watch", *args, "--ddtree-budgets", "4")
    field = config_verdict(mutation.document)
    if result.exit_code == 0 and field is not None:
        # watch keeps watching a checkpoint it cannot score (it may be half-written): it says why
        # in one line naming the file, scores nothing, and exits 0 with --once
        assert "Traceback" not in result.output and str(ckpt) in result.output, result.output
        assert not (out.exists() and any(p.name != ".specreplay-logged.json" for p in out.iterdir())), result.output
        tally("watch (drafter config)", "reported")
        return
    tally("watch (drafter config)", check_outcome(result, mutation, str(ckpt), field, False))


@given(data=st.data())
@cases(20)
def test_extract_draft_config(world, data):
    config = data.draw(st.sampled_from(drafter_configs(world)))
    mutation = data.draw(mutations(config))
    case = fresh(world, "extract_config")
    path = case / "config.json"
    write_json(path, mutation.document)
    prompts = write_prompts(case / "prompts.jsonl", RECORDS[:1])
    out = case / "out"
    args = ["--model", world["model"], "--prompts", prompts, "--out", str(out), "--draft-config", str(path)]
    result = run("extract", *args, *[a for a in EXTRACT if a not in ("--layer-ids", "1,3")])
    wrote = out.exists() and bool(listing(out))
    # extract reads the feature layers alone: the layout's schema, not the decoders' keys
    verdict = check_outcome(result, mutation, str(path), config_verdict(mutation.document, decoders=False), wrote)
    tally("extract (--draft-config)", verdict)


# --------------------------------------------------------------------------- manifest and sidecars


def broken_extract(world, data, name: str, kind: str):
    """A copy of the extract with its manifest (or first sidecar) broken one way, its checksum
    recomputed: what the schema must catch is a document that reads as intact."""
    shards = fresh(world, name) / "shards"
    shutil.copytree(world["shards"], shards)
    path = shards / "manifest.json" if kind == "manifest" else sorted((shards / "shards").glob("*.json"))[0]
    document = json.loads(path.read_text())
    document.pop("checksum")
    mutation = data.draw(mutations(document))
    broken = mutation.document
    if isinstance(broken, dict):
        broken = {**broken, "checksum": json_checksum(broken)}
    write_json(path, broken)
    model = ManifestFile if kind == "manifest" else ShardEntry
    field = schema_verdict(model, mutation.document)
    return shards, path, mutation, field


@given(data=st.data())
@cases(30)
def test_inspect_manifest_and_sidecars(world, data):
    kind = data.draw(st.sampled_from(["manifest", "sidecar"]))
    shards, path, mutation, field = broken_extract(world, data, "inspect", kind)
    result = run("inspect", str(shards))
    tally(f"inspect ({kind})", check_outcome(result, mutation, str(path), field, False))


@given(data=st.data())
@cases(20)
def test_score_manifest(world, data):
    shards, path, mutation, field = broken_extract(world, data, "score_manifest", "manifest")
    out = shards.parent / "results"
    result = run("score", "--ckpt", world["ckpt"], "--shards", str(shards), "--out", str(out), *SCORE)
    wrote = out.exists() and bool(listing(out))
    tally("score (manifest)", check_outcome(result, mutation, str(path), field, wrote))


@given(data=st.data())
@cases(12)
def test_fit_manifest(world, data):
    shards, path, mutation, field = broken_extract(world, data, "fit_manifest", "manifest")
    out = shards.parent / "runs"
    result = run("fit", "--shards", str(shards), "--out", str(out), "--steps", "2", "--quiet")
    wrote = out.exists() and bool(listing(out))
    tally("fit (manifest)", check_outcome(result, mutation, str(path), field, wrote))


# --------------------------------------------------------------------------- run.json


def broken_results(world, data, name: str) -> tuple[list[str], Path, object, str | None]:
    """Copies of both results directories, the first one's run.json broken one way."""
    case = fresh(world, name)
    dirs = []
    for source in world["results"]:
        target = case / Path(source).parent.name / Path(source).name
        shutil.copytree(source, target)
        dirs.append(str(target))
    path = Path(dirs[0]) / "run.json"
    mutation = data.draw(mutations(json.loads(path.read_text())))
    write_json(path, mutation.document)
    return dirs, path, mutation, schema_verdict(RunRecord, mutation.document)


@given(data=st.data())
@cases(20)
def test_compare_run_json(world, data):
    dirs, path, mutation, field = broken_results(world, data, "compare")
    result = run("compare", *dirs)
    tally("compare (run.json)", check_outcome(result, mutation, str(path), field, False))


@given(data=st.data())
@cases(15)
def test_report_run_json(world, data):
    dirs, path, mutation, field = broken_results(world, data, "report")
    page = path.parent.parent / "report.html"
    result = run("report", *dirs, "--out", str(page))
    tally("report (run.json)", check_outcome(result, mutation, str(path), field, page.exists()))


@given(data=st.data())
@cases(15)
def test_log_run_json(world, data):
    dirs, path, mutation, field = broken_results(world, data, "log")
    logs = path.parent.parent / "tb"
    result = run("log", "--results", str(path.parent), "--tensorboard", str(logs))
    wrote = logs.exists() and bool(listing(logs))
    tally("log (run.json)", check_outcome(result, mutation, str(path), field, wrote))


# --------------------------------------------------------------------------- the loggers' ledger


@given(data=st.data())
@cases(15)
def test_log_ledger(world, data):
    case = fresh(world, "ledger")
    results = case / "results"
    shutil.copytree(world["results"][0], results / Path(world["results"][0]).name)
    ledger = results / LEDGER_NAME
    entry = {"destination": "tensorboard:/elsewhere", "checkpoint_hash": "0123456789abcdef", "step": 3}
    mutation = data.draw(mutations({"version": 1, "logged": [{**entry, "scalars": 9, "logged_at": "now"}]}))
    write_json(ledger, mutation.document)
    logs = case / "tb"
    result = run("log", "--results", str(results), "--tensorboard", str(logs))
    wrote = logs.exists() and bool(listing(logs))
    tally(
        "log (ledger)",
        check_outcome(result, mutation, str(ledger), schema_verdict(LedgerFile, mutation.document), wrote),
    )

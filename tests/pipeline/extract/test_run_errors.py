"""Bad input is a clear error before anything is written; other settings in OUT are refused."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.shards import ShardError, read_manifest
from specreplay.cli import main
from tests.helpers.prompts import write_prompts

PROMPTS = [{"id": "a", "prompt": "Hello there"}, {"id": "b", "prompt": "Janet's ducks lay eggs."}]


@pytest.fixture()
def prompts_file(tmp_path):
    return write_prompts(tmp_path / "ok.jsonl", PROMPTS)


def cli(*args):
    return CliRunner().invoke(main, ["extract", "--quiet", "--max-new-tokens", "4", *args])


def assert_clean_error(result, *needles):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.output.startswith("error: "), result.output
    for needle in needles:
        assert needle in result.output, result.output


def assert_nothing_written(out):
    assert not out.exists() or not any(out.iterdir())


def test_missing_model_path(tmp_path, prompts_file):
    out = tmp_path / "out"
    assert_clean_error(
        cli("--model", str(tmp_path / "no-such-model"), "--prompts", prompts_file, "--out", str(out)),
        "no-such-model",
        "does not exist",
    )
    assert_nothing_written(out)


def test_malformed_jsonl_names_the_line(tmp_path, tiny_qwen3_dir):
    bad = write_prompts(tmp_path / "bad.jsonl", [PROMPTS[0], '{"id": "b", "prompt": "unterminated'])
    out = tmp_path / "out"
    assert_clean_error(cli("--model", tiny_qwen3_dir, "--prompts", str(bad), "--out", str(out)), "bad.jsonl:2")
    assert_nothing_written(out)


def test_duplicate_prompt_ids(tmp_path, tiny_qwen3_dir):
    dup = write_prompts(tmp_path / "dup.jsonl", [{"id": "same", "prompt": text} for text in ("one", "two")])
    out = tmp_path / "out"
    assert_clean_error(
        cli("--model", tiny_qwen3_dir, "--prompts", str(dup), "--out", str(out)), "duplicate id", "'same'"
    )
    assert_nothing_written(out)


@pytest.mark.parametrize("layer_ids, message", [("0,7", "out of range"), ("1,1", "duplicates"), ("1,x", "integers")])
def test_bad_layer_ids(tmp_path, tiny_qwen3_dir, prompts_file, layer_ids, message):
    out = tmp_path / "out"
    result = cli("--model", tiny_qwen3_dir, "--prompts", prompts_file, "--out", str(out), "--layer-ids", layer_ids)
    assert_clean_error(result, message)
    assert_nothing_written(out)


def test_formula_duplicates_and_top_k(tmp_path, tiny_qwen35_hybrid_dir, prompts_file):
    out = tmp_path / "out"
    # 4 target layers cannot feed 5 distinct drafter layers.
    assert_clean_error(
        cli("--model", tiny_qwen35_hybrid_dir, "--prompts", prompts_file, "--out", str(out)),
        "duplicate layer ids",
        "--layer-ids",
    )
    assert_clean_error(
        cli(
            "--model",
            tiny_qwen35_hybrid_dir,
            "--prompts",
            prompts_file,
            "--out",
            str(out),
            "--layer-ids",
            "1",
            "--top-k",
            "100000",
        ),
        "--top-k 100000",
    )
    assert_clean_error(
        cli(
            "--model",
            tiny_qwen35_hybrid_dir,
            "--prompts",
            prompts_file,
            "--out",
            str(out),
            "--layer-ids",
            "1",
            "--feature-dtype",
            "int8",
        ),
        "--feature-dtype",
    )
    assert_nothing_written(out)
    result = cli("--prompts", prompts_file, "--out", str(out), "--shard-bytes", "lots")
    assert result.exit_code == 2 and "--shard-bytes" in result.output


def test_other_settings_refused_unless_overwrite(tmp_path, tiny_qwen3_dir, prompts_file):
    out = tmp_path / "out"
    base = dict(
        model=tiny_qwen3_dir, prompts=prompts_file, out=str(out), layer_ids=[1, 3], max_new_tokens=4, quiet=True
    )
    first = run_extract(ExtractConfig(**base))
    before = (out / "manifest.json").read_bytes()
    shard_files = sorted(p.name for p in (out / "shards").iterdir())

    # Same settings again: nothing to do, nothing rewritten.
    again = run_extract(ExtractConfig(**base))
    assert again["shards"] == first["shards"]
    assert sorted(p.name for p in (out / "shards").iterdir()) == shard_files

    result = cli(
        "--model", tiny_qwen3_dir, "--prompts", prompts_file, "--out", str(out), "--layer-ids", "1,3", "--top-k", "8"
    )
    assert_clean_error(result, "different settings", "top_k: 32 -> 8", "--overwrite")
    with pytest.raises(ShardError, match=r"layer_ids.*\[1, 3\].*\[1, 2\]"):
        run_extract(ExtractConfig(**{**base, "layer_ids": [1, 2]}))
    assert (out / "manifest.json").read_bytes() == before  # refused runs touched nothing

    result = cli(
        "--model",
        tiny_qwen3_dir,
        "--prompts",
        prompts_file,
        "--out",
        str(out),
        "--layer-ids",
        "1,3",
        "--top-k",
        "8",
        "--overwrite",
    )
    assert result.exit_code == 0, result.output
    manifest = read_manifest(str(out))
    assert manifest["complete"] and manifest["settings"]["top_k"] == 8 and manifest["totals"]["samples"] == 2


def test_foreign_shards_without_manifest_refused(tmp_path, tiny_qwen3_dir, prompts_file):
    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    (out / "shards" / "r000-00000.arrow").write_bytes(b"someone else's")
    result = cli("--model", tiny_qwen3_dir, "--prompts", prompts_file, "--out", str(out), "--layer-ids", "1")
    assert_clean_error(result, "no manifest.json", "--overwrite")
    assert (out / "shards" / "r000-00000.arrow").read_bytes() == b"someone else's"


def test_inspect_reports_and_flags_corruption(tmp_path, tiny_qwen3_dir, prompts_file):
    out = tmp_path / "out"
    run_extract(
        ExtractConfig(
            model=tiny_qwen3_dir, prompts=prompts_file, out=str(out), layer_ids=[2], max_new_tokens=4, quiet=True
        )
    )
    result = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["samples"] == 2 and report["layer_ids"] == [2] and report["complete"]
    assert report["greedy_consistency"] == 1.0 and report["checksums"]["bad"] == []
    assert report["raw_bf16_feature_bytes_per_token"] == 64 * 2
    assert report["prompt_tokens"] + report["response_tokens"] == report["tokens"]
    assert report["tokenizer"] == f"{out}/tokenizer"
    assert f"tokenizer       {out}/tokenizer" in CliRunner().invoke(main, ["inspect", str(out), "--no-verify"]).output
    shard = next((out / "shards").glob("*.arrow"))
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["inspect", str(out)])
    assert result.exit_code == 1 and shard.name in result.output and "BAD" in result.output


def test_mistyped_shards_directory(tmp_path):
    """A path that does not exist says so; an existing directory without manifest.json says that,
    with the fix; a file is not a directory. Through `score --shards` and `inspect` alike, as one
    error line without a traceback."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    cases = {
        tmp_path / "shrads": f"no such directory: {tmp_path / 'shrads'}",
        tmp_path / "empty": "no manifest. Is this an extract output directory? Run `specreplay extract --out",
        ckpt / "config.json": f"{ckpt / 'config.json'}: not a directory",
    }
    for shards_dir, message in cases.items():
        for args in (
            ["score", "--ckpt", str(ckpt), "--shards", str(shards_dir), "--out", str(tmp_path / "results")],
            ["inspect", str(shards_dir)],
        ):
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 2, result.output
            assert result.output.startswith("error: ") and "Traceback" not in result.output, result.output
            assert message in result.output and str(shards_dir) in result.output, result.output


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        (
            {"id": "far", "input_ids": [1, 2, 10**6]},
            "ids.jsonl:2 (prompt 'far'): prompt token id 1000000 at position 2",
        ),
        (
            {"id": "big", "prompt": "hi", "response": [3, 4096]},
            "ids.jsonl:2 (prompt 'big'): response token id 4096 at position 1",
        ),
    ],
)
def test_token_ids_outside_the_vocabulary_name_the_record_and_position(tmp_path, tiny_qwen3_dir, record, needle):
    bad = write_prompts(tmp_path / "ids.jsonl", [PROMPTS[0], record])
    out = tmp_path / "out"
    result = cli("--model", tiny_qwen3_dir, "--prompts", str(bad), "--out", str(out))
    assert_clean_error(result, needle, "outside the target's vocabulary")
    assert_nothing_written(out)


def test_samples_past_the_trained_positions_are_refused_unless_asked_for(tmp_path, tiny_qwen3_dir):
    # the tiny target has max_position_embeddings 2048: 2045 prompt ids + 4 new tokens pass it
    long = write_prompts(tmp_path / "long.jsonl", [PROMPTS[0], {"id": "long", "input_ids": [5] * 2045}])
    out = tmp_path / "out"
    result = cli("--model", tiny_qwen3_dir, "--prompts", str(long), "--out", str(out))
    assert_clean_error(
        result,
        "long.jsonl:2 (prompt 'long'): 2045 prompt tokens + 4 response tokens exceed the target's max_position_embeddings (2048)",
    )
    assert_nothing_written(out)
    ok = ("--model", tiny_qwen3_dir, "--prompts", str(long), "--layer-ids", "1,3")
    fits = cli(*ok, "--out", str(out), "--max-new-tokens", "3")
    assert fits.exit_code == 0, fits.output  # 2045 + 3 = 2048: within
    opted = cli(*ok, "--out", str(tmp_path / "opted"), "--beyond-positions")
    assert opted.exit_code == 0, opted.output
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "opted")])
    assert shown.exit_code == 0 and "--beyond-positions: samples may run past" in shown.output, shown.output
    plain = CliRunner().invoke(main, ["inspect", str(out)])
    assert plain.exit_code == 0 and "beyond-positions" not in plain.output, plain.output


def test_other_settings_refused_before_the_target_loads(tmp_path, tiny_qwen3_dir, prompts_file):
    """A setting the command line decides (here --max-new-tokens) is refused before the model is
    read: the same command on a copy of the target with unreadable weights gets the settings
    error, not the load's (which would take minutes at a 27B target)."""
    import shutil

    out = tmp_path / "out"
    first = dict(model=tiny_qwen3_dir, prompts=prompts_file, out=str(out), layer_ids=[1, 3], max_new_tokens=4)
    run_extract(ExtractConfig(**first, quiet=True))
    broken = tmp_path / "broken-target"
    shutil.copytree(tiny_qwen3_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    before = (out / "manifest.json").read_bytes()
    result = CliRunner().invoke(
        main,
        [
            "extract",
            "--quiet",
            "--max-new-tokens",
            "5",
            "--layer-ids",
            "1,3",
            "--model",
            str(broken),
            "--prompts",
            prompts_file,
            "--out",
            str(out),
        ],
    )
    assert_clean_error(result, "different settings", "max_new_tokens: 4 -> 5", "--overwrite")
    assert (out / "manifest.json").read_bytes() == before
    # Into a fresh OUT the load itself fails: one line naming the directory, nothing written.
    fresh = tmp_path / "fresh"
    result = cli("--model", str(broken), "--prompts", prompts_file, "--out", str(fresh), "--layer-ids", "1,3")
    assert_clean_error(result, "broken-target", "cannot be read", "download or save the model again")
    assert_nothing_written(fresh)

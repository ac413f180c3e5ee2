"""`specreplay score --ckpt drafter.gguf` on the GGUF files llama.cpp users hold (docs/gguf-drafters.md).

Each drafter family whose GGUF layout llama.cpp defines and specreplay scores is built by its
reference's own classes, converted by llama.cpp's own convert_hf_to_gguf.py (F32, against a tiny
target at SmolLM2's vocabulary, whose tokenizer the converter knows), and scored from the GGUF and
from the checkpoint it was converted from on the same shards: anchors.parquet (every anchor's draft
tokens, with --anchor-drafts, and the probabilities the draft distribution gives: target_prob,
kl_topk, expected_accepted_len) and walk.parquet are equal, all but the checkpoint identity columns.
The vLLM/AngelSlim EAGLE-3 layout, which specreplay does not read, is compared with the same weights
in SpecForge's layout. A BF16 and a Q8_0 GGUF are read dequantized.

A bad GGUF (another target's vocabulary or width, a target model's GGUF, an architecture llama.cpp
defines no drafter for, a variant or a key specreplay does not read, a truncated file) is one `error:` line
naming the file and what is wrong, and nothing is written under --out.
"""

from __future__ import annotations

import os
import shutil

import polars as pl
import pytest
import torch
from click.testing import CliRunner
from polars.testing import assert_frame_equal

from proposers.checkpoints.load import load_drafter
from scoring.results import IDENTITY
from specreplay.cli import main
from tests.helpers import chain_parity as parity, gguf_drafters as drafters
from tests.helpers.bad_inputs import listing
from tests.helpers.prompts import write_prompts

# GGUF -> the checkpoint directory scored against it (vLLM/AngelSlim's: SpecForge's, same tensors)
CASES = {
    "zlab_dflash": "zlab_dflash",
    "zlab_dflash2": "zlab_dflash2",
    "deepspec_dspark": "deepspec_dspark",
    "speculators_dspark": "speculators_dspark",
    "speculators_eagle3": "speculators_eagle3",
    "specforge_eagle3": "specforge_eagle3",
    "angelslim_eagle3": "specforge_eagle3",
}
IDENTITY_COLUMNS = [f.name for f in IDENTITY]
MAX_NEW = 8
SCORE = dict(anchor_drafts=True, eagle_trees=[], device="cpu")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The target and its greedy shards, every drafter as a checkpoint directory and as a GGUF."""
    root = tmp_path_factory.mktemp("gguf_drafters")
    target = drafters.smollm2_target(root / "target")
    prompts = [{"id": f"p{i}", "input_ids": list(range(100 + 7 * i, 106 + 8 * i))} for i in range(3)]
    prompts = write_prompts(root / "prompts.jsonl", prompts)
    shards = parity.extract(root / "shards", target, prompts, MAX_NEW, drafters.FEATURE_LAYERS)
    sources = _sources(root)
    jobs = [(sources[name], root / f"{name}.gguf", target, "f32") for name in CASES]
    jobs += [(sources[name], root / f"{name}.gguf", target, "f32") for name in BAD_SOURCES]
    jobs += [(target, root / "target.gguf", None, "f32")]
    jobs += [(sources["zlab_dflash"], root / f"zlab_dflash.{kind}.gguf", target, kind) for kind in ("bf16", "q8_0")]
    drafters.convert_all(jobs)
    return {"root": root, "shards": shards, "sources": sources, "scores": {}}


def _sources(root) -> dict[str, str]:
    sources = {name: str(root / "src" / name) for name in (*CASES.values(), *BAD_SOURCES)}
    drafters.zlab_dflash(sources["zlab_dflash"])
    drafters.zlab_dflash2(sources["zlab_dflash2"])
    drafters.speculators_dspark(sources["speculators_dspark"])
    full = drafters.speculators_dspark(root / "src" / "dspark_full_vocab", draft_vocab=None, seed=1)
    drafters.deepspec_dspark(sources["deepspec_dspark"], full)
    drafters.speculators_eagle3(sources["speculators_eagle3"])
    drafters.specforge_eagle3(sources["speculators_eagle3"], sources["specforge_eagle3"])
    drafters.angelslim_eagle3(sources["specforge_eagle3"], root / "src" / "angelslim_eagle3")
    sources["angelslim_eagle3"] = str(root / "src" / "angelslim_eagle3")
    drafters.zlab_dflash(sources["other_vocabulary"], target={**drafters.TARGET, "vocab_size": drafters.VOCAB + 64})
    drafters.zlab_dflash(sources["other_width"], target={**drafters.TARGET, "hidden_size": 32}, num_heads=2)
    drafters.with_mask_embedding(sources["zlab_dflash"], sources["mask_embedding"])
    return sources


def scored(world, ckpt: str) -> str:
    """Its results directory, scored once a module."""
    if ckpt not in world["scores"]:
        out = world["root"] / "results" / str(len(world["scores"]))
        world["scores"][ckpt] = parity.score(ckpt, world["shards"], out, **SCORE)
    return world["scores"][ckpt]


def tables(out_dir: str) -> dict[str, pl.DataFrame]:
    return {name: pl.read_parquet(f"{out_dir}/{name}.parquet") for name in ("anchors", "walk")}


# --------------------------------------------------------------------------- the GGUF scores as its checkpoint


@pytest.mark.parametrize("name", CASES)
def test_scoring_the_gguf_equals_scoring_its_checkpoint(world, name):
    """The drafter read back is the checkpoint's, every weight bit for bit (EAGLE-3's q/k rows
    un-permuted), so its draft distributions are too; the results say so at every anchor."""
    gguf, source = str(world["root"] / f"{name}.gguf"), world["sources"][CASES[name]]
    ours, theirs = (load_drafter(path, target_layers=drafters.TARGET_LAYERS)[0].state_dict() for path in (gguf, source))
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    from_gguf, from_source = tables(scored(world, gguf)), tables(scored(world, source))
    assert from_gguf["anchors"].height > 0 and from_gguf["walk"].height > 0
    families = [results["anchors"]["drafter_family"].unique().to_list() for results in (from_gguf, from_source)]
    assert families[0] == families[1]
    for kind in ("anchors", "walk"):
        assert_frame_equal(
            from_gguf[kind].drop(IDENTITY_COLUMNS), from_source[kind].drop(IDENTITY_COLUMNS), check_exact=True
        )
    assert from_gguf["anchors"]["checkpoint"][0] == f"{world['root'].name}/{name}.gguf"


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_a_half_precision_or_quantized_gguf_is_read_dequantized(world, kind):
    """2-D weights as stored (bf16: the source rounded to bfloat16; q8_0: within its step of the
    source), norms in F32 as the converter keeps them."""
    drafter, _ = load_drafter(str(world["root"] / f"zlab_dflash.{kind}.gguf"))
    source, _ = load_drafter(world["sources"]["zlab_dflash"])
    ours, theirs = drafter.state_dict(), source.state_dict()
    assert set(ours) == set(theirs)
    for name, weight in theirs.items():
        if weight.dim() == 1:
            assert torch.equal(ours[name], weight), name
        elif kind == "bf16":
            assert torch.equal(ours[name], weight.to(torch.bfloat16).float()), name
        else:
            step = weight.abs().amax(dim=-1, keepdim=True) / 127
            assert not torch.equal(ours[name], weight) and ((ours[name] - weight).abs() <= step).all(), name


# --------------------------------------------------------------------------- bad GGUF drafters

BAD_SOURCES = ("other_vocabulary", "other_width", "mask_embedding")


def truncated(world, tmp_path) -> str:
    path = tmp_path / "cut.gguf"
    whole = (world["root"] / "zlab_dflash.gguf").read_bytes()
    path.write_bytes(whole[: len(whole) * 2 // 3])
    return str(path)


def header_only(path, arch: str, keys: dict) -> str:
    """A GGUF of `arch` with `keys` (int: uint32, float: float32, list: an array) and no tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        add = (
            writer.add_array
            if isinstance(value, list)
            else writer.add_float32
            if isinstance(value, float)
            else writer.add_uint32
        )
        add(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def unknown_architecture(world, tmp_path) -> str:
    """An architecture llama.cpp defines no drafter for."""
    return header_only(tmp_path / "medusa.gguf", "medusa", {"medusa.block_count": 1})


def unread_key(world, tmp_path) -> str:
    """A `dflash` GGUF with a key of DeepSeek-V4's DSpark backbone (hyper-connections), which llama.cpp
    defines and specreplay does not read."""
    shape = dict(block_count=1, embedding_length=64, feed_forward_length=128, block_size=4, vocab_size=drafters.VOCAB)
    keys = {f"dflash.{key}": value for key, value in shape.items()}
    keys.update({"dflash.attention.head_count": 4, "dflash.attention.layer_norm_rms_epsilon": 1e-6})
    keys.update({"dflash.target_layers": [2, 4], "tokenizer.ggml.mask_token_id": drafters.MASK})
    keys["dflash.hyper_connection_count"] = 4
    return header_only(tmp_path / "dsv4_dspark.gguf", "dflash", keys)


BAD = {
    "other_vocabulary": (lambda world, _: str(world["root"] / "other_vocabulary.gguf"), "vocab_size 49216"),
    "other_width": (lambda world, _: str(world["root"] / "other_width.gguf"), "hidden_size 32"),
    "target_model": (lambda world, _: str(world["root"] / "target.gguf"), "architecture 'qwen3' is not a drafter's"),
    "unknown_architecture": (unknown_architecture, "architecture 'medusa' is not a drafter's"),
    "unread_key": (unread_key, "GGUF key 'dflash.hyper_connection_count' (= 4) is not one specreplay reads"),
    "mask_embedding": (lambda world, _: str(world["root"] / "mask_embedding.gguf"), "mask_embedding.pt"),
    "truncated": (truncated, "truncated"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_gguf_is_one_error_line_and_writes_nothing(world, case, tmp_path):
    make, words = BAD[case]
    ckpt = make(world, tmp_path)
    out = tmp_path / "results"
    command = ["score", "--ckpt", ckpt, "--shards", world["shards"], "--out", str(out), "--device", "cpu", "--quiet"]
    result = CliRunner().invoke(main, command, catch_exceptions=True)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(errors) == 1 and ckpt in errors[0] and words in errors[0], result.output
    assert not out.exists() or not listing(out), listing(out)


def test_a_gguf_is_scored_into_parent_and_stem(world, tmp_path):
    """`--out/<parent>_<stem>/`, as a checkpoint file is."""
    copy = tmp_path / "runs" / "drafter.gguf"
    copy.parent.mkdir()
    shutil.copy(world["root"] / "zlab_dflash.gguf", copy)
    out = parity.score(str(copy), world["shards"], tmp_path / "results", **SCORE)
    assert os.path.basename(out) == "runs_drafter"

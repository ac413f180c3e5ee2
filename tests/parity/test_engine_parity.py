"""Exactness against a real engine: `specreplay score --walk-rule llama.cpp` reports, step for step,
the accepted-draft counts llama-server (llama.cpp, built by `make setup`) reports for the same
drafter, converted to GGUF by llama.cpp's own converter (tests/helpers/llama_engine.py).

A tiny random Qwen3 target with SmolLM2's tokenizer (the converter knows its pre-tokenizer),
margins clear enough that llama.cpp's F32 kernels and torch choose the same greedy tokens, and a
stop token (`<|im_end|>`, end of generation to llama.cpp) that ends about half of the responses
early. specreplay extracts the shards from the HF directory and scores each drafter (the
references' own classes, fitted briefly) from them; llama-server serves the same target and
drafter as GGUF with LLAMA_TRACE=1, which logs each verification step's `accepted a/d draft
tokens`. For every prompt whose engine response equals the stored one (float rounding may change
a few; they are counted, never dropped silently), the engine's per-step (accepted, drafted) equals
walk.parquet's (counted_accepted, drafted) over the steps that drafted, and their sums equal the
response's timings.draft_n_accepted / draft_n. The default `--walk-rule dflash` differs from the
engine on some sample, so the comparison can fail; the steps compared include drafts cut near the
budget and plain last-token decodes, and DFlash with one draft a step a stop token drafted last.

Families and layouts: DFlash (z-lab; full block, 2 and 1 drafts), DSpark (speculators, DeepSpec; the
confidence cut at --spec-draft-p-min, tests/helpers/dspark_engine.py),
EAGLE-3 (speculators, SpecForge), DFlash2 (z-lab).
"""

from __future__ import annotations

import json
import shutil

import pytest

from pipeline.shards import ShardSet
from proposers.toolkit.conventions import REFERENCE
from scoring.replay.walk_rules import WalkRule
from tests.helpers import (
    chain_parity as chains,
    dspark_engine as cut,
    engine_parity as parity,
    family_fits as fits,
    llama_engine as engine,
)
from tests.helpers.eagle3_reference import write_specforge
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow

TARGET_LAYERS = 8  # llama.cpp's converter's EAGLE-3 default layers [2, L // 2, L - 3] are then distinct
# extract's (output-of-layer) ids: the DFlash/DSpark aux ids 2, 4 (speculators: before layer i), EAGLE-3's 2, 4, 5
LAYERS = [1, 3, 4]
DFLASH = fits.Recipe("dflash", steps=100, anchors=16)
DFLASH_TWO_LAYERS = fits.Recipe("dflash", layers=2, steps=100, anchors=16)
DSPARK = fits.Recipe("dspark", steps=100, anchors=16)  # sample_from_anchor: a block of block_size drafts
DSPARK_CUT = 0.5  # llama-server's --spec-draft-p-min: cuts some blocks of the fitted confidence head
DFLASH2 = fits.Recipe("dflash2", steps=100, anchors=16)
DFLASH2_TOP_K = 4  # llama.cpp refuses hidden < top_k * (top_k + 1) (src/models/dflash.cpp:149-151)
EAGLE3_AUX = (2, 4, 5)  # before-layer ids: SpecForge's default layers of an 8-layer target, and llama.cpp's
EAGLE3_STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, converter) -> parity.Setup:
    tmp = tmp_path_factory.mktemp("engine_parity")
    prompts = parity.prompt_ids(parity.PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, parity.MAX_NEW, layers=TARGET_LAYERS)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(
        tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), parity.MAX_NEW, LAYERS
    )
    finish = {s.finish_reason for s in ShardSet(shards).samples(tensors=[])}
    assert finish == {"eos", "length"}, finish  # some responses end at the stop token, others at the budget
    sequences = engine.continuations(model_dir, prompts, parity.MAX_NEW)
    return parity.Setup(tmp, model_dir, converter.convert(model_dir, tmp / "target.gguf"), shards, sequences, converter)


@pytest.fixture(scope="module")
def dflash(setup):
    """speculators' DFlashDraftModel fitted by its own training forward, in z-lab's layout."""
    ckpt = fits.fitted(DFLASH, setup.target, setup.sequences, setup.tmp / "speculators-dflash")
    twin = fits.zlab_layout(ckpt, setup.tmp / "zlab-dflash", num_target_layers=TARGET_LAYERS)
    return parity.converted(setup, "dflash", "z-lab", twin, "draft-dflash", DFLASH.block_size - 1)


@pytest.fixture(scope="module")
def dflash_two_layers(setup):
    """As `dflash`, with two decoder layers: a change to one slot's first-layer output reaches
    every slot that sees it in the second layer."""
    ckpt = fits.fitted(DFLASH_TWO_LAYERS, setup.target, setup.sequences, setup.tmp / "speculators-dflash-2l")
    twin = fits.zlab_layout(ckpt, setup.tmp / "zlab-dflash-2l", num_target_layers=TARGET_LAYERS)
    return parity.converted(setup, "dflash", "z-lab-2l", twin, "draft-dflash", DFLASH_TWO_LAYERS.block_size - 1)


@pytest.fixture(scope="module")
def dspark(setup):
    """speculators' DSparkDraftModel as it saves itself (no embedding, no lm_head: the target's)."""
    ckpt = engine.dspark_drafter(setup.target, setup.sequences, setup.tmp / "speculators-dspark", DSPARK)
    return parity.converted(setup, "dspark", "speculators", ckpt, "draft-dspark", DSPARK.block_size)


@pytest.fixture(scope="module")
def dspark_confidence(setup):
    """As `dspark`, with a confidence head over [h ; W1[prev]] trained by its own loss."""
    out = setup.tmp / "speculators-dspark-confidence"
    ckpt = engine.dspark_drafter(setup.target, setup.sequences, out, DSPARK, confidence=True)
    return parity.converted(setup, "dspark", "conf", ckpt, "draft-dspark", DSPARK.block_size)


@pytest.fixture(scope="module")
def deepspec(setup):
    """A DSpark drafter fitted with the target's lm_head as its embedding, in DeepSpec's layout."""
    ckpt = engine.dspark_drafter(
        setup.target, setup.sequences, setup.tmp / "dspark-tied", DSPARK, head_as_embedding=True
    )
    layout = engine.deepspec_layout(ckpt, setup.tmp / "deepspec-dspark", setup.target)
    return parity.converted(setup, "dspark", "deepspec", layout, "draft-dspark", DSPARK.block_size)


@pytest.fixture(scope="module")
def eagle3(setup):
    """speculators' Eagle3DraftModel (draft vocabulary 128) and the same weights in SpecForge's
    layout, whose nested ids the converter ignores for its default [2, L // 2, L - 3]
    (conversion/llama.py:76-83): the same layers here."""
    out = setup.tmp / "speculators-eagle3"
    ckpt = engine.eagle3_drafter(setup.target, setup.sequences, out, EAGLE3_AUX, EAGLE3_STEPS, 128, 200)
    specforge = write_specforge(ckpt, setup.tmp / "specforge-eagle3", TARGET_LAYERS)
    return {
        layout: parity.converted(setup, "eagle3", layout, path, "draft-eagle3", EAGLE3_STEPS)
        for layout, path in [("speculators", ckpt), ("specforge", specforge)]
    }


@pytest.fixture(scope="module")
def dflash2(setup):
    """speculators' DFlash2DraftModel (selector top-k DFLASH2_TOP_K) in z-lab's layout."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(fits.DFLASH2_FIELDS, "selector_top_k", DFLASH2_TOP_K)
        ckpt = fits.fitted(DFLASH2, setup.target, setup.sequences, setup.tmp / "speculators-dflash2")
    twin = fits.zlab_layout(ckpt, setup.tmp / "zlab-dflash2", num_target_layers=TARGET_LAYERS)
    return parity.converted(setup, "dflash2", "z-lab", twin, "draft-dflash", DFLASH2.block_size - 1)


@pytest.mark.parametrize("n_max", [DFLASH.block_size - 1, 2, 1])
def test_dflash_zlab_counts_equal_llama_server(setup, dflash, n_max):
    """The full block and shorter ones: llama.cpp drafts a block of n_max + 1 (common/speculative.cpp:
    1203-1210), not the trained one; with one draft a step, a drafted stop token is the last draft."""
    parity.assert_engine_counts(setup, dflash, n_max)


def test_dspark_speculators_counts_equal_llama_server(setup, dspark):
    parity.assert_engine_counts(setup, dspark, dspark.drafts)


def test_dspark_deepspec_counts_equal_llama_server(setup, deepspec):
    parity.assert_engine_counts(setup, deepspec, deepspec.drafts)


def test_dspark_confidence_cut_equals_llama_server(setup, dspark_confidence):
    """llama-server --spec-draft-p-min P against `confidence_threshold: P` (tests/helpers/dspark_engine.py):
    equal steps, some blocks cut by the head; each wrong reading of the cut walks otherwise."""
    n_max = dspark_confidence.drafts
    path = cut.with_threshold(dspark_confidence.path, setup.tmp / "dspark-threshold", DSPARK_CUT)
    served = cut.served_with_threshold(dspark_confidence, path, DSPARK_CUT)
    walk = parity.assert_engine_counts(setup, served, n_max, per_step=0.1)
    cuts = cut.confidence_cuts(parity.scored(setup, served, n_max, "llama.cpp"), setup.shards, n_max, setup.max_new)
    differing = {rule: cut.differing_samples(setup, served, walk, n_max, rule) for rule in cut.WRONG_RULES}
    print(f"p-min {DSPARK_CUT}: {cuts} steps cut by the confidence head; wrong readings differ on {differing}")
    assert cuts > 0 and all(differing.values()), (cuts, differing)
    # `score --confidence-threshold`: the checkpoint without the field, and the GGUF the server runs
    for ckpt in (dspark_confidence.path, served.gguf):
        assert cut.option_counts(setup, served, ckpt, n_max, DSPARK_CUT) == engine.walk_counts(
            parity.scored(setup, served, n_max, "llama.cpp")
        ), ckpt


def test_dspark_confidence_at_the_threshold_is_proposed_as_llama_server(setup, dspark_confidence):
    """A confidence exactly at P (a zero head: 0.5 in torch and ggml alike) is not cut by llama.cpp's
    strict `<` (common/speculative.cpp:1274): the server drafts full blocks, and so does the
    replay; cutting at or below P would draft nothing."""
    flat = cut.flat_confidence(dspark_confidence.path, setup.tmp / "dspark-flat-confidence")
    drafter = parity.converted(setup, "dspark", "flat", flat, "draft-dspark", DSPARK.block_size)
    served = cut.served_with_threshold(drafter, cut.with_threshold(flat, setup.tmp / "dspark-flat-0.5", 0.5), 0.5)
    walk = parity.assert_engine_counts(setup, served, drafter.drafts)
    differing = cut.differing_samples(setup, served, walk, drafter.drafts, cut.AT_THRESHOLD)
    print(f"confidence 0.5 at p-min 0.5: the non-strict cut differs on {differing} of {len(walk)} samples")
    assert differing == len(walk), differing


def test_confidence_threshold_option_refusals(setup, dflash, dspark):
    """`score --confidence-threshold` on a drafter with no confidence head to cut with: one error line."""
    errors = [cut.option_refusal(d.path, setup.shards, setup.tmp / f"refused-{d.layout}") for d in (dflash, dspark)]
    assert "is a DFlash drafter; only a DSpark drafter's confidence head" in errors[0], errors[0]
    assert "has no confidence head (llama-server refuses --spec-draft-p-min above 0" in errors[1], errors[1]


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_eagle3_counts_equal_llama_server(setup, eagle3, layout):
    parity.assert_engine_counts(setup, eagle3[layout], EAGLE3_STEPS)


def test_dflash2_zlab_counts_equal_llama_server(setup, dflash2):
    """Also: the selector decides drafts here. The same drafter with selector top-k 1 (each draft
    its unary argmax) walks differently, so equal counts check llama.cpp's selector walk too."""
    walk = parity.assert_engine_counts(setup, dflash2, dflash2.drafts)
    unary = setup.tmp / "zlab-dflash2-top1"
    shutil.copytree(dflash2.path, unary)
    config = json.loads((unary / "config.json").read_text())
    config["dflash_config"]["selector_top_k"] = 1
    (unary / "config.json").write_text(json.dumps(config))
    steps = dict(walk_rule="llama.cpp", steps=dflash2.drafts, eagle_trees=[])
    argmax = engine.walk_counts(chains.score(str(unary), setup.shards, setup.tmp / "dflash2-top1", **steps))
    assert any(argmax.get(sid) != counts for sid, counts in walk.items())


def test_compare_online_and_the_gguf_drafter_against_llama_server(setup, dflash):
    """`specreplay compare-online` against the running server, its per-step counts read from the
    LLAMA_TRACE log: every sample equal for results scored under the llama.cpp rule from the GGUF
    llama.cpp serves (`score --ckpt drafter.gguf`); under the reference rule the differing samples
    point at the walk rule; with another draft length than the server's, at --steps."""
    from click.testing import CliRunner

    from specreplay.cli import main

    n_max, tmp = dflash.drafts, setup.tmp
    served = parity.scored(setup, dflash, n_max, "llama.cpp")
    gguf = chains.score(dflash.gguf, setup.shards, tmp / "online-gguf", walk_rule="llama.cpp", steps=n_max)
    assert engine.walk_counts(gguf) == engine.walk_counts(served)
    reference = parity.scored(setup, dflash, n_max, "dflash")
    shorter = parity.score(dflash, setup.shards, tmp / "online-short", walk_rule="llama.cpp", steps=n_max - 1)
    log = tmp / "online.log"
    with engine.serving(setup.target_gguf, dflash.gguf, dflash.spec_type, n_max, log) as server:

        def compare(results: str) -> tuple[int, dict]:
            args = ["compare-online", results, "--server", server.url, "--engine-log", str(log), "--json"]
            result = CliRunner().invoke(main, args)
            return result.exit_code, json.loads(result.output)

        outcomes = {name: compare(path) for name, path in [("gguf", gguf), ("dflash", reference), ("short", shorter)]}
    code, report = outcomes["gguf"]
    assert code == 0 and report["compared"] == parity.PROMPTS, report
    assert report["equal"] == parity.PROMPTS - report["not_comparable"] >= parity.PROMPTS - parity.MOST_DIFFERING, (
        report
    )
    assert report["online_accepted"] == report["offline_accepted"] > 0
    for name, wanted in [("dflash", "--walk-rule llama.cpp"), ("short", f"--steps {n_max}")]:
        code, report = outcomes[name]
        differing = [row for row in report["samples"] if row["verdict"] == "differs"]
        assert code == 1 and differing and all(wanted in row["points_at"] for row in differing), (name, report)


# z-lab DFlash fields llama.cpp reads and z-lab's dflash 0.1.0 does not, each served as its GGUF: the
# fitted drafter's weights under another config (top-level fields, and dflash_config's), and the
# same weights under a wrong reading of it (the rule the case checks) scored too, whose walk must
# differ from the server's somewhere. GRAPH_AS_VLLM reads the drafter with vLLM's and z-lab's block
# attention instead of llama.cpp's graph (Conventions.llama_block): sliding layers causal when
# is_causal is absent, a bidirectional window hiding later block keys too.
GRAPH_AS_VLLM = "vLLM's block attention"
VARIANTS = [  # (name, the drafter fixture, top-level fields, dflash_config fields, wrong readings)
    (
        "swa-causal",
        "dflash",
        {},
        dict(use_swa=True, swa_window_size=3, causal=True),
        [dict(swa_window_size=4), dict(causal=False)],
    ),
    # window 3 < the block's 4 slots: slot 0 sees slot 3 in vLLM's window, not in llama.cpp's
    (
        "swa-bidirectional",
        "dflash_two_layers",
        {},
        dict(use_swa=True, swa_window_size=3),
        [dict(swa_window_size=4), GRAPH_AS_VLLM],
    ),
    (
        "sliding-layers",
        "dflash",
        dict(layer_types=["sliding_attention"], use_sliding_window=True, sliding_window=8),
        {},
        [GRAPH_AS_VLLM],
    ),
    ("value-scale", "dflash", {}, dict(attention_value_scale=1.25), [dict(attention_value_scale=1.0)]),
]


def with_fields(source: str, out, top: dict, dflash: dict) -> str:
    """A copy of the z-lab checkpoint at `source` with `top` set at its top level, `dflash` in its dflash_config."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text()) | top
    config["dflash_config"].update(dflash)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize(("name", "drafter", "top", "dflash_fields", "wrongs"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_dflash_variant_counts_equal_llama_server(setup, request, name, drafter, top, dflash_fields, wrongs):
    dflash = request.getfixturevalue(drafter)
    n_max = dflash.drafts  # the trained block: 4 queries
    path = with_fields(dflash.path, setup.tmp / f"zlab-{name}", top, dflash_fields)
    variant = parity.converted(setup, "dflash", name, path, "draft-dflash", dflash.drafts)
    # a drafter fitted without a window accepts less through a narrow one: 0.2 to 0.4 drafts a step
    walk = parity.assert_engine_counts(setup, variant, n_max, per_step=0.05)
    steps = dict(walk_rule="llama.cpp", steps=n_max, eagle_trees=[])
    for i, wrong in enumerate(wrongs):
        with pytest.MonkeyPatch.context() as patch:
            if wrong == GRAPH_AS_VLLM:
                patch.setattr(WalkRule, "conventions", lambda self, family: REFERENCE)
                misread = path
            else:
                misread = with_fields(path, setup.tmp / f"zlab-{name}-wrong{i}", {}, wrong)
            counts = engine.walk_counts(chains.score(misread, setup.shards, setup.tmp / f"{name}-wrong{i}", **steps))
        differing = sum(counts.get(sid) != served for sid, served in walk.items())
        print(f"{name}: {wrong} differs from the server on {differing} of {len(walk)} samples")
        assert differing > 0, (name, wrong)

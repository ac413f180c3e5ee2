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

Families and layouts: DFlash (z-lab; full block, 2 and 1 drafts), DSpark (speculators, DeepSpec),
EAGLE-3 (speculators, SpecForge), DFlash2 (z-lab).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, family_fits as fits, llama_engine as engine
from tests.helpers.eagle3_reference import write_specforge
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow

MAX_NEW = 32
PROMPTS = 12
MOST_DIFFERING = 1  # engine responses allowed to differ from the stored ones (float rounding)
TARGET_LAYERS = 8  # llama.cpp's converter's EAGLE-3 default layers [2, L // 2, L - 3] are then distinct
# extract's (output-of-layer) ids: the DFlash/DSpark aux ids 2, 4 (speculators: before layer i), EAGLE-3's 2, 4, 5
LAYERS = [1, 3, 4]
DFLASH = fits.Recipe("dflash", steps=100, anchors=16)
DSPARK = fits.Recipe("dspark", steps=100, anchors=16)  # sample_from_anchor: a block of block_size drafts
DFLASH2 = fits.Recipe("dflash2", steps=100, anchors=16)
DFLASH2_TOP_K = 4  # llama.cpp refuses hidden < top_k * (top_k + 1) (src/models/dflash.cpp:149-151)
EAGLE3_AUX = (2, 4, 5)  # before-layer ids: SpecForge's default layers of an 8-layer target, and llama.cpp's
EAGLE3_STEPS = 3
# The real SmolLM2-135M (extract's `--model smollm2`, the package's Q4_1 weights dequantized to fp32),
# converted to an F32 GGUF by llama.cpp's converter; its greedy responses to chat prompts have no
# margins made for the test, so a near-tie may flip a token in llama.cpp's kernels: counted, bounded.
SMOLLM2_AUX = (2, 16, 29)  # speculators' ids (before layer i) of its 30 layers; z-lab's 1, 15, 28
SMOLLM2_DIFFERING = 4
SMOLLM2_PROMPTS = [
    "What is 12 times 7?",
    "Name three primary colors.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of France?",
    "Give me a short greeting.",
    "Count from one to ten.",
    "What is the opposite of hot?",
    "List the days of the week.",
    "How many legs does a spider have?",
    "Translate 'thank you' into Spanish.",
    "What color is the sky on a clear day?",
    "Spell the word 'cat' backwards.",
]
TABLE: list[str] = []


@dataclass(frozen=True)
class Setup:
    tmp: Path
    target: str  # the HF directory
    target_gguf: str
    shards: str  # extracted from the HF directory, greedy
    sequences: list  # (ids, prompt length) the drafters are fitted on: llama_engine.continuations
    converter: engine.Converter


@dataclass(frozen=True)
class Drafter:
    family: str
    layout: str
    path: str  # the checkpoint specreplay scores
    gguf: str  # the same drafter converted by llama.cpp's converter
    spec_type: str  # llama-server --spec-type
    drafts: int  # drafts of the trained block / chain: what --walk-rule dflash runs


def _prompt_ids(count: int, seed: int = 7) -> list[list[int]]:
    """Ids 300..699: none of the ids the target emits (llama_engine.engine_target's live ids)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(300, 700, (6 + i % 4,), generator=gen).tolist() for i in range(count)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread (on shared cores OpenMP's spinning workers slow tiny calls down); the
    table of every case compared, printed at the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    print(
        "\nfamily  layout       n_max  samples  differing  steps  cut  stop-last  accepted/drafted  dflash-rule differs"
    )
    print("\n".join(TABLE))


@pytest.fixture(scope="module")
def converter():
    started = engine.Converter()
    yield started
    started.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, converter) -> Setup:
    tmp = tmp_path_factory.mktemp("engine_parity")
    prompts = _prompt_ids(PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, MAX_NEW, layers=TARGET_LAYERS)
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    shards = chains.extract(tmp / "shards", model_dir, write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, LAYERS)
    finish = {s.finish_reason for s in ShardSet(shards).samples(tensors=[])}
    assert finish == {"eos", "length"}, finish  # some responses end at the stop token, others at the budget
    sequences = engine.continuations(model_dir, prompts, MAX_NEW)
    return Setup(tmp, model_dir, converter.convert(model_dir, tmp / "target.gguf"), shards, sequences, converter)


def _converted(setup: Setup, family: str, layout: str, path: str, spec_type: str, drafts: int) -> Drafter:
    gguf = setup.converter.convert(path, setup.tmp / f"{family}-{layout}.gguf", target_dir=setup.target)
    return Drafter(family, layout, path, gguf, spec_type, drafts)


@pytest.fixture(scope="module")
def dflash(setup):
    """speculators' DFlashDraftModel fitted by its own training forward, in z-lab's layout."""
    ckpt = fits.fitted(DFLASH, setup.target, setup.sequences, setup.tmp / "speculators-dflash")
    twin = fits.zlab_layout(ckpt, setup.tmp / "zlab-dflash", num_target_layers=TARGET_LAYERS)
    return _converted(setup, "dflash", "z-lab", twin, "draft-dflash", DFLASH.block_size - 1)


@pytest.fixture(scope="module")
def dspark(setup):
    """speculators' DSparkDraftModel as it saves itself (no embedding, no lm_head: the target's)."""
    ckpt = engine.dspark_drafter(setup.target, setup.sequences, setup.tmp / "speculators-dspark", DSPARK)
    return _converted(setup, "dspark", "speculators", ckpt, "draft-dspark", DSPARK.block_size)


@pytest.fixture(scope="module")
def deepspec(setup):
    """A DSpark drafter fitted with the target's lm_head as its embedding, in DeepSpec's layout."""
    ckpt = engine.dspark_drafter(
        setup.target, setup.sequences, setup.tmp / "dspark-tied", DSPARK, head_as_embedding=True
    )
    layout = engine.deepspec_layout(ckpt, setup.tmp / "deepspec-dspark", setup.target)
    return _converted(setup, "dspark", "deepspec", layout, "draft-dspark", DSPARK.block_size)


@pytest.fixture(scope="module")
def eagle3(setup):
    """speculators' Eagle3DraftModel (draft vocabulary 128) and the same weights in SpecForge's
    layout, whose nested ids the converter ignores for its default [2, L // 2, L - 3]
    (conversion/llama.py:76-83): the same layers here."""
    out = setup.tmp / "speculators-eagle3"
    ckpt = engine.eagle3_drafter(setup.target, setup.sequences, out, EAGLE3_AUX, EAGLE3_STEPS, 128, 200)
    specforge = write_specforge(ckpt, setup.tmp / "specforge-eagle3", TARGET_LAYERS)
    return {
        layout: _converted(setup, "eagle3", layout, path, "draft-eagle3", EAGLE3_STEPS)
        for layout, path in [("speculators", ckpt), ("specforge", specforge)]
    }


@pytest.fixture(scope="module")
def dflash2(setup):
    """speculators' DFlash2DraftModel (selector top-k DFLASH2_TOP_K) in z-lab's layout."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(fits.DFLASH2_FIELDS, "selector_top_k", DFLASH2_TOP_K)
        ckpt = fits.fitted(DFLASH2, setup.target, setup.sequences, setup.tmp / "speculators-dflash2")
    twin = fits.zlab_layout(ckpt, setup.tmp / "zlab-dflash2", num_target_layers=TARGET_LAYERS)
    return _converted(setup, "dflash2", "z-lab", twin, "draft-dflash", DFLASH2.block_size - 1)


def _assert_engine_counts(
    setup: Setup, drafter: Drafter, n_max: int, most_differing: int = MOST_DIFFERING, per_step: float = 0.2
) -> dict:
    """Score with the llama.cpp rule, serve, and compare per sample whose engine response is the
    stored one; the default rule's walk must differ somewhere when it runs the same block.
    Returns the llama.cpp rule's walk counts."""
    tmp, shards, name = setup.tmp, setup.shards, f"{drafter.family}-{drafter.layout}-n{n_max}"
    walk = engine.walk_counts(_score(drafter, shards, tmp / f"{name}-llama", walk_rule="llama.cpp", steps=n_max))
    stored = {s.sample_id: s for s in ShardSet(shards).samples(tensors=[])}
    with engine.serving(setup.target_gguf, drafter.gguf, drafter.spec_type, n_max, tmp / f"{name}.log") as server:
        runs = {
            sid: engine.engine_run(server, s.input_ids[: s.prompt_len].tolist(), MAX_NEW) for sid, s in stored.items()
        }
    same = [sid for sid, s in stored.items() if runs[sid].tokens == s.input_ids[s.prompt_len :].tolist()]
    for sid in same:
        run = runs[sid]
        assert run.steps == walk.get(sid, []), (sid, run.steps, walk.get(sid))
        assert (sum(a for a, _ in run.steps), sum(d for _, d in run.steps)) == (run.draft_n_accepted, run.draft_n)
    differs = "-"
    if n_max == drafter.drafts:
        wrong = engine.walk_counts(_score(drafter, shards, tmp / f"{name}-dflash"))
        differs = sum(runs[sid].steps != wrong.get(sid, []) for sid in same)
    steps = [step for sid in same for step in runs[sid].steps]
    accepted, drafted, cut = sum(a for a, _ in steps), sum(d for _, d in steps), sum(d < n_max for _, d in steps)
    last = sum(_stop_drafted_last(runs[sid], stored[sid]) for sid in same)
    TABLE.append(
        f"{drafter.family:<7} {drafter.layout:<12} {n_max:>5}  {len(same):>7}  {len(stored) - len(same):>9}  "
        f"{len(steps):>5}  {cut:>3}  {last:>9}  {accepted:>7}/{drafted:<8}  {differs}"
    )
    print(f"\n{TABLE[-1]}")
    assert len(stored) - len(same) <= most_differing, f"{len(stored) - len(same)} engine responses differ"
    assert accepted / len(steps) > per_step * n_max, (accepted, len(steps))  # blocks accept several drafts
    assert cut > 0 or n_max == 1  # drafts cut near the budget were compared (one draft is never cut, only dropped)
    assert last > 0 or n_max > 1  # one draft a step: some response's stop token was drafted and accepted
    assert differs != 0  # the comparison can fail: the reference's rule is not the engine's
    return walk


def _stop_drafted_last(run: engine.EngineRun, sample) -> bool:
    """Whether the engine counted an accepted draft past the stored response: a stop token
    accepted as the last draft, the bonus token after it dropped (common/sampling.cpp:696-707).
    Before the budget's last token every step drafts, so the tokens it accounts for are the
    prefill's one plus accepted + 1 a step."""
    response = sample.input_ids[sample.prompt_len :]
    accounted = 1 + sum(a + 1 for a, _ in run.steps)
    return sample.finish_reason == "eos" and response.numel() < MAX_NEW - 1 and accounted > response.numel()


def _score(drafter: Drafter, shards: str, out, **options) -> str:
    return chains.score(drafter.path, shards, out, eagle_trees=[], **options)


@pytest.mark.parametrize("n_max", [DFLASH.block_size - 1, 2, 1])
def test_dflash_zlab_counts_equal_llama_server(setup, dflash, n_max):
    """The full block and shorter ones: llama.cpp drafts a block of n_max + 1 (common/speculative.cpp:
    1203-1210), not the trained one; with one draft a step, a drafted stop token is the last draft."""
    _assert_engine_counts(setup, dflash, n_max)


def test_dspark_speculators_counts_equal_llama_server(setup, dspark):
    _assert_engine_counts(setup, dspark, dspark.drafts)


def test_dspark_deepspec_counts_equal_llama_server(setup, deepspec):
    _assert_engine_counts(setup, deepspec, deepspec.drafts)


@pytest.mark.parametrize("layout", ["speculators", "specforge"])
def test_eagle3_counts_equal_llama_server(setup, eagle3, layout):
    _assert_engine_counts(setup, eagle3[layout], EAGLE3_STEPS)


def test_dflash2_zlab_counts_equal_llama_server(setup, dflash2):
    """Also: the selector decides drafts here. The same drafter with selector top-k 1 (each draft
    its unary argmax) walks differently, so equal counts check llama.cpp's selector walk too."""
    walk = _assert_engine_counts(setup, dflash2, dflash2.drafts)
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
    served = _score(dflash, setup.shards, tmp / "online-llama", walk_rule="llama.cpp", steps=n_max)
    gguf = chains.score(dflash.gguf, setup.shards, tmp / "online-gguf", walk_rule="llama.cpp", steps=n_max)
    assert engine.walk_counts(gguf) == engine.walk_counts(served)
    reference = _score(dflash, setup.shards, tmp / "online-dflash")
    shorter = _score(dflash, setup.shards, tmp / "online-short", walk_rule="llama.cpp", steps=n_max - 1)
    log = tmp / "online.log"
    with engine.serving(setup.target_gguf, dflash.gguf, dflash.spec_type, n_max, log) as server:

        def compare(results: str) -> tuple[int, dict]:
            args = ["compare-online", results, "--server", server.url, "--engine-log", str(log), "--json"]
            result = CliRunner().invoke(main, args)
            return result.exit_code, json.loads(result.output)

        outcomes = {name: compare(path) for name, path in [("gguf", gguf), ("dflash", reference), ("short", shorter)]}
    code, report = outcomes["gguf"]
    assert code == 0 and report["compared"] == PROMPTS, report
    assert report["equal"] == PROMPTS - report["not_comparable"] >= PROMPTS - MOST_DIFFERING, report
    assert report["online_accepted"] == report["offline_accepted"] > 0
    for name, wanted in [("dflash", "--walk-rule llama.cpp"), ("short", f"--steps {n_max}")]:
        code, report = outcomes[name]
        differing = [row for row in report["samples"] if row["verdict"] == "differs"]
        assert code == 1 and differing and all(wanted in row["points_at"] for row in differing), (name, report)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, converter) -> Setup:
    """The real SmolLM2-135M as extract loads it, its F32 GGUF, greedy shards of chat prompts."""
    from pipeline.extract.target import resolve_model_dir

    tmp = tmp_path_factory.mktemp("engine_smollm2")
    model_dir = str(resolve_model_dir("smollm2")[2])
    records = [{"id": f"s{i}", "prompt": text} for i, text in enumerate(SMOLLM2_PROMPTS)]
    layers = [i - 1 for i in SMOLLM2_AUX]
    shards = chains.extract(tmp / "shards", "smollm2", write_prompts(tmp / "prompts.jsonl", records), MAX_NEW, layers)
    prompts = [s.input_ids[: s.prompt_len].tolist() for s in ShardSet(shards).samples(tensors=[])]
    sequences = engine.continuations(model_dir, prompts, MAX_NEW)
    return Setup(tmp, model_dir, converter.convert(model_dir, tmp / "smollm2.gguf"), shards, sequences, converter)


def test_dflash_zlab_on_the_real_smollm2_counts_equal_llama_server(smollm2):
    """A real target: speculators' DFlashDraftModel fitted to SmolLM2's own features, in z-lab's
    layout, served by llama-server beside SmolLM2's F32 GGUF (a Llama target: the converter and the
    server read its layers as they read Qwen3's)."""
    recipe = fits.Recipe("dflash", aux_ids=SMOLLM2_AUX, steps=200, anchors=32, lr=2e-2)
    ckpt = fits.fitted(recipe, smollm2.target, smollm2.sequences, smollm2.tmp / "speculators-dflash")
    twin = fits.zlab_layout(ckpt, smollm2.tmp / "zlab-dflash", num_target_layers=30)
    drafter = _converted(smollm2, "dflash", "z-lab-smollm2", twin, "draft-dflash", recipe.block_size - 1)
    # a drafter of a 576-wide target fitted for seconds accepts fewer drafts a step than the tiny
    # target's: a lower bar, still many steps accepting drafts for every rule to be compared on
    _assert_engine_counts(smollm2, drafter, drafter.drafts, most_differing=SMOLLM2_DIFFERING, per_step=0.1)

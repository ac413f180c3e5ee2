"""Exactness of vLLM's Qwen3-Omni DSpark layout (`Qwen3OmniDSparkModel`, proposers/dspark/omni*.py), scored
by `specreplay score` from shards extracted from a Qwen3-Omni thinker, against the rule vLLM runs for it.

vLLM builds the drafter as its Qwen3 DSpark (registry.py:682 -> qwen3_dspark.py `Qwen3DSparkForCausalLM`:
the DFlash Qwen3 backbone, the Markov bias over the previous token, every slot drafting), fed the
thinker's text layers `target_layer_ids` (output of layer i: aux layer i + 1, eagle3_utils.py:119-140),
its mask slots the first set of `dflash_config.mask_token_id`, `mask_token_id`, `dspark_noise_token_id`,
... (v1/worker/gpu/spec_decode/utils.py:92-115). The reference is tests/helpers/dspark_online.py's loop on
speculators' own `DSparkDraftModel` modules (the same layers and heads: qwen3_dspark.py:196-230), verified
by transformers' own `Qwen3OmniMoeThinkerForConditionalGeneration`:

- greedy: every sample's walk (produced, drafted, drafts up to the first rejection) equals the loop's;
- every anchor's block equals the reference's greedy chain there up to its first unverified draft;
- wrong rules (feature layers read one off, no Markov bias, the mask token from `dspark_noise_token_id`
  before `mask_token_id`) each change anchors' drafts;
- configs vLLM's validator refuses are one `error:` line, nothing written.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, dspark_online as online, omni_dspark as omni
from tests.helpers.dspark_reference import OUTPUT_IDS, TARGET_LAYERS
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow

PROMPTS = 6
MAX_NEW = 24
BLOCK = 4
FIT_STEPS = 100
STORED = list(range(TARGET_LAYERS))  # the right ids and the ones a wrong rule reads


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from chains.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dspark_omni")
    model_dir = omni.build_target(tmp / "target")
    target = omni.load_target(model_dir)
    ids = chains.prompt_ids(PROMPTS)
    with open(f"{model_dir}/generation_config.json") as f:
        generation = json.load(f)
    generation["eos_token_id"] = chains.stop_token(target, ids, MAX_NEW)
    with open(f"{model_dir}/generation_config.json", "w") as f:
        json.dump(generation, f)
    prompts = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(ids)])
    shards = chains.extract(tmp / "greedy", model_dir, prompts, MAX_NEW, STORED)
    samples = list(ShardSet(shards).samples(tensors=[]))
    documents = online.training_documents(target, [s.input_ids for s in samples], [s.prompt_len for s in samples])
    model = online.new_drafter(target, head_type="vanilla", block_size=BLOCK)
    losses = online.fit(model, documents * 4, steps=FIT_STEPS, lr=5e-3)
    ckpt = omni.write_omni(tmp / "drafter", model)
    stop_ids = ShardSet(shards).settings["target"]["stop_token_ids"]
    return tmp, shards, ckpt, model, target, stop_ids, losses[-1]


@pytest.fixture(scope="module")
def chain_at(setup):
    """The reference's greedy chain (and its teacher-forced drafts) at an anchor of a stored sample, the
    block `queries` long, from the target's features (cached per sample)."""
    _, _, _, model, target, _, _ = setup
    features = {}

    @torch.no_grad()
    def chain(ids: torch.Tensor, anchor: int, queries: int, mask: int | None = None) -> tuple[list, list]:
        key = tuple(ids.tolist())
        if key not in features:
            features[key] = online.target_states(target, ids)[1]
        saved = model.config.mask_token_id  # the reference's backbone fills its mask slots with it
        model.config.mask_token_id = saved if mask is None else mask
        try:
            hidden, base = online.block_hidden(model, features[key], ids, anchor, queries)
        finally:
            model.config.mask_token_id = saved
        own = online.propose(model, hidden, base, int(ids[anchor]), 0.0, 0.0).drafts.tolist()
        known = ids[anchor : anchor + queries].clone()
        previous = torch.cat([known, known.new_zeros(queries - known.numel())])[None]
        bias = model.markov_head.block_bias(prev_token_ids=previous, hidden_states=hidden[None])[0]
        return own, (base + bias).argmax(dim=-1).tolist()

    return chain


def differing(out_dir: str, shards: str, chain_at, mask: int | None = None) -> dict:
    """anchors.parquet against the reference: `anchors` whose block differs from the reference's greedy
    chain along its verified prefix, `slots` whose teacher-forced draft differs, and the totals."""
    rows = pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")
    samples = {s.sample_id: s.input_ids for s in ShardSet(shards).samples(tensors=[])}
    found = dict(anchors=0, of=0, verified=0, slots=0, of_slots=0)
    for sample_id, anchor, offline in rows.iter_rows():
        ids = samples[sample_id]
        known = min(len(offline), ids.numel() - 1 - anchor)
        if known == 0:
            continue
        chain, forced = chain_at(ids, anchor, len(offline), mask)
        stored = ids[anchor + 1 : anchor + 1 + known].tolist()
        verified = next((i + 1 for i, (d, y) in enumerate(zip(chain, stored)) if d != y), known)
        found["anchors"] += offline[:verified] != chain[:verified]
        found["slots"] += sum(a != b for a, b in zip(offline[:known], forced[:known]))
        found["of"] += 1
        found["verified"] += verified
        found["of_slots"] += known
    return found


def scored(setup, name: str, ckpt: str | None = None) -> str:
    tmp, shards, default, *_ = setup
    return chains.score(ckpt or default, shards, tmp / name, anchor_drafts=True, eagle_trees=[])


def test_greedy_walks_equal_the_online_loop(setup):
    tmp, shards, ckpt, model, target, stop_ids, loss = setup
    walks = chains.walks(scored(setup, "right"), "drafted")
    runs = {}
    for sample in ShardSet(shards).samples(tensors=[]):
        run = online.online_dspark(model, target, sample.input_ids[: sample.prompt_len], MAX_NEW, stop_ids)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        runs[sample.sample_id] = run
    for sample_id, run in runs.items():
        walk = walks.get(sample_id, pl.DataFrame({"produced": [], "draft_tokens": [], "drafted": []}))
        assert walk["produced"].to_list() == run.produced, sample_id
        assert walk["drafted"].to_list() == [len(d) for d in run.drafts], sample_id
        for step, (offline, drafts, produced) in enumerate(
            zip(walk["draft_tokens"].to_list(), run.drafts, run.produced)
        ):
            verified = min(produced, len(drafts))
            assert offline[:verified] == drafts[:verified], (sample_id, step)
    steps = [n for run in runs.values() for n in run.produced]
    finish = Counter(s.finish_reason for s in ShardSet(shards).samples(tensors=[]))
    print(
        f"\ngreedy: {len(steps)} steps equal, tau {sum(steps) / len(steps):.3f}, finish {dict(finish)}; loss {loss:.3f}"
    )
    assert sum(steps) / len(steps) > 1.5, steps  # the fitted drafter's blocks accept tokens
    assert BLOCK + 1 in steps, steps


def test_every_anchor_equals_vllms_rule(setup, chain_at):
    found = differing(scored(setup, "right"), setup[1], chain_at)
    print(
        f"\n{found['of'] - found['anchors']}/{found['of']} anchors' chains equal the reference ({found['verified']} "
        f"drafts compared), {found['of_slots'] - found['slots']}/{found['of_slots']} teacher-forced slots"
    )
    assert found["anchors"] == found["slots"] == 0 and found["of"] > 60, found
    assert found["verified"] > 1.5 * found["of"], found


# -- the wrong rules: each changes anchors' drafts ---------------------------------------------------


def _parsed(patch, change):
    import proposers.dspark.config as dspark_config

    parse = dspark_config.parse_omni

    def changed(*args):
        config = parse(*args)
        change(config)
        return config

    patch.setattr(dspark_config, "parse_omni", changed)


def _layers_one_off(patch):  # the ids read as vLLM's aux (before-layer) ids
    _parsed(patch, lambda config: setattr(config, "target_layer_ids", [i + 1 for i in OUTPUT_IDS]))


def _no_markov_bias(patch):  # served as a plain DFlash drafter
    from proposers.dspark.model import DSparkDrafter

    patch.setattr(DSparkDrafter, "markov_bias", lambda self, hidden, previous: None)


NOISE = 7  # a second mask token the config states as dspark_noise_token_id


def _noise_token_first(patch):  # the validator's later names read before mask_token_id
    _parsed(patch, lambda config: setattr(config, "mask_token_id", NOISE))


WRONG = [_layers_one_off, _no_markov_bias, _noise_token_first]


@pytest.mark.parametrize("wrong", WRONG, ids=lambda f: f.__name__.strip("_"))
def test_a_wrong_rule_differs_from_vllms_rule(setup, chain_at, wrong):
    tmp, shards, ckpt, *_ = setup
    noisy = tmp / "drafter-noise"
    if not noisy.exists():  # both names stated: vLLM takes mask_token_id
        shutil.copytree(ckpt, noisy)
        omni.rewrite_config(str(noisy), dspark_noise_token_id=NOISE)
    right = differing(scored(setup, "right-noise", str(noisy)), shards, chain_at)
    assert right["slots"] == right["anchors"] == 0, right
    with pytest.MonkeyPatch.context() as patch:
        wrong(patch)
        out_dir = scored(setup, f"wrong-{wrong.__name__}", str(noisy))
    found = differing(out_dir, shards, chain_at)
    print(
        f"\n{wrong.__name__}: {found['slots']}/{found['of_slots']} slots and {found['anchors']}/{found['of']} "
        "anchors' chains differ from vLLM's rule"
    )
    assert found["slots"] > 0 and found["anchors"] > 0, found


def test_the_wrong_mask_token_is_the_references_with_that_token(setup, chain_at):
    """The noise-token wrong rule is exactly the reference run with that mask token: the check above
    measures the reading, not a broken replay."""
    tmp, shards, *_ = setup
    with pytest.MonkeyPatch.context() as patch:
        _noise_token_first(patch)
        out_dir = scored(setup, "noise-as-mask")
    found = differing(out_dir, shards, chain_at, mask=NOISE)
    assert found["slots"] == found["anchors"] == 0, found


# -- configs vLLM's validator refuses ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"markov_head_type": "gated"}, "field 'markov_head_type' is 'gated'"),
        ({"use_aux_hidden_state": False}, "field 'use_aux_hidden_state' is false"),
        ({"target_layer_ids": [0, 2, 5]}, "the target's last layer"),
    ],
    ids=["gated head", "no aux features", "last layer"],
)
def test_a_config_vllm_refuses_is_one_error_line(setup, tmp_path, changes, named):
    from click.testing import CliRunner

    from specreplay.cli import main

    _, shards, ckpt, *_ = setup
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    omni.rewrite_config(str(bad), **changes)
    out = tmp_path / "out"
    run = CliRunner().invoke(main, ["score", "--ckpt", str(bad), "--shards", shards, "--out", str(out), "--quiet"])
    print(f"\n{run.output.strip()}")
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert named in run.output and "Traceback" not in run.output, run.output
    assert not any(out.glob("**/summary.parquet")), run.output

"""Exactness of Kimi K3's DSpark drafter (`K3DSparkModel`, proposers/dspark/k3*.py), scored by `specreplay
score` from shards extracted from a Kimi target, against vLLM's rule (tests/helpers/k3_dspark.py's
reference, written from vllm/models/kimi_k3/nvidia/dspark_mla.py on transformers' DeepSeek-V3 modules):

- greedy: every sample's walk (tokens per step, drafts proposed) equals the reference's loop over the
  stored greedy response (the target's greedy verification commits the stored tokens);
- every anchor's block equals the reference's greedy chain up to its first unverified draft, and every
  teacher-forced slot its argmax;
- wrong rules (neox RoPE for vLLM's interleaved pairs, feature layers one off, no Markov bias, a causal
  block) each change anchors' drafts;
- configs vLLM refuses are one `error:` line, nothing written.

The target: transformers' KimiLinearForCausalLM (Kimi's KDA + MLA layers; transformers 5.25 has no Kimi K3
class), tiny; the drafter (two MLA layers) fitted through the reference's own block loss.
"""

from __future__ import annotations

import json
import shutil

import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from tests.helpers import chain_parity as chains, k3_dspark as k3
from tests.helpers.prompts import write_prompts

pytestmark = pytest.mark.slow

PROMPTS = 8
MAX_NEW = 24
FIT_STEPS = 80
FIT_LR = 1e-2
STORED = list(range(k3.TARGET_LAYERS))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from chains.one_thread()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("dspark_k3")
    model_dir = k3.build_target(tmp / "target")
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = chains.prompt_ids(PROMPTS)
    with open(f"{model_dir}/generation_config.json") as f:
        generation = json.load(f)
    generation["eos_token_id"] = chains.stop_token(target, ids, MAX_NEW)
    with open(f"{model_dir}/generation_config.json", "w") as f:
        json.dump(generation, f)
    prompts = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(ids)])
    shards = chains.extract(tmp / "greedy", model_dir, prompts, MAX_NEW, STORED)
    sequences = [(s.input_ids, s.prompt_len) for s in ShardSet(shards).samples(tensors=[])]
    with k3.with_seed(1):
        reference = k3.ReferenceK3DSpark()
    loss = k3.fit(reference, target, sequences, FIT_STEPS, FIT_LR)
    ckpt = k3.save(reference.eval().requires_grad_(False), k3.drafter_config(), tmp / "drafter")
    stop_ids = ShardSet(shards).settings["target"]["stop_token_ids"]
    return tmp, shards, ckpt, reference, target, stop_ids, loss


@pytest.fixture(scope="module")
def chain_at(setup):
    """The reference's (greedy chain, teacher-forced drafts) at an anchor of a stored sample (cached)."""
    _, _, _, reference, target, _, _ = setup
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    features, found = {}, {}

    @torch.no_grad()
    def chain(ids: torch.Tensor, anchor: int, queries: int) -> tuple[list[int], list[int]]:
        key = tuple(ids.tolist())
        if key not in features:
            features[key] = k3.target_features(target, ids)
        if (key, anchor, queries) not in found:
            found[key, anchor, queries] = reference.chain(features[key], ids, anchor, queries, embed, head)
        return found[key, anchor, queries]

    return chain


def differing(out_dir: str, shards: str, chain_at) -> dict:
    """anchors.parquet against the reference: `anchors` whose block differs from its greedy chain along the
    chain's verified prefix, `slots` whose teacher-forced draft differs, and the totals."""
    rows = pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")
    samples = {s.sample_id: s.input_ids for s in ShardSet(shards).samples(tensors=[])}
    found = dict(anchors=0, of=0, verified=0, slots=0, of_slots=0)
    for sample_id, anchor, offline in rows.iter_rows():
        ids = samples[sample_id]
        known = min(len(offline), ids.numel() - 1 - anchor)
        if known == 0:
            continue
        chain, forced = chain_at(ids, anchor, len(offline))
        stored = ids[anchor + 1 : anchor + 1 + known].tolist()
        verified = next((i + 1 for i, (d, y) in enumerate(zip(chain, stored)) if d != y), known)
        found["anchors"] += offline[:verified] != chain[:verified]
        found["slots"] += sum(a != b for a, b in zip(offline[:known], forced[:known]))
        found["of"] += 1
        found["verified"] += verified
        found["of_slots"] += known
    return found


def reference_walk(ids: torch.Tensor, prompt_len: int, stop_ids, chain_at) -> list[tuple[int, int]]:
    """(produced, drafted) per step of the online loop, the reference drafting and the target verifying
    greedily: the target's greedy tokens are the stored response, so each step accepts the chain's
    leading drafts equal to it, adds the stored bonus token, cut by the budget and at a stop token."""
    steps, start, max_length = [], prompt_len, prompt_len + MAX_NEW
    if int(ids[start]) in stop_ids:  # the first response token ends it: no step
        return steps
    while start + 1 < max_length:
        queries = min(k3.BLOCK, max_length - start - 1)
        chain, _ = chain_at(ids, start, queries)
        stored = ids[start + 1 : start + 1 + queries].tolist()
        accepted = next((i for i, (d, y) in enumerate(zip(chain, stored)) if d != y), len(stored))
        new = ids[start + 1 : start + 2 + accepted].tolist()
        produced = min(len(new), max_length - start - 1)
        stops = [i for i, t in enumerate(new[:produced]) if t in stop_ids]
        produced = stops[0] + 1 if stops else produced
        steps.append((produced, queries))
        start += produced
        if stops:
            break
    return steps


def scored(setup, name: str) -> str:
    tmp, shards, ckpt, *_ = setup
    return chains.score(ckpt, shards, tmp / name, anchor_drafts=True, eagle_trees=[])


def test_greedy_walks_and_every_anchor_equal_vllms_rule(setup, chain_at):
    _, shards, _, _, _, stop_ids, loss = setup
    out_dir = scored(setup, "right")
    walks = chains.walks(out_dir, "drafted")
    steps = []
    for sample in ShardSet(shards).samples(tensors=[]):
        expected = reference_walk(sample.input_ids, sample.prompt_len, stop_ids, chain_at)
        walk = walks.get(sample.sample_id, pl.DataFrame({"produced": [], "drafted": []}))
        assert list(zip(walk["produced"].to_list(), walk["drafted"].to_list())) == expected, sample.sample_id
        steps += [produced for produced, _ in expected]
    found = differing(out_dir, shards, chain_at)
    print(
        f"\ngreedy: {len(steps)} steps equal, tau {sum(steps) / len(steps):.3f}; "
        f"{found['of'] - found['anchors']}/{found['of']} anchors' chains equal the reference "
        f"({found['verified']} drafts compared), {found['of_slots'] - found['slots']}/{found['of_slots']} "
        f"teacher-forced slots; fit loss {loss:.3f}"
    )
    assert found["anchors"] == found["slots"] == 0 and found["of"] > 60, found
    assert sum(steps) / len(steps) > 1.5, steps  # the fitted drafter's blocks accept tokens


# -- the wrong rules: each changes anchors' drafts ---------------------------------------------------


def _parsed(patch, change):
    import proposers.dspark.config as dspark_config

    parse = dspark_config.parse_k3

    def changed(*args):
        config = parse(*args)
        change(config)
        return config

    patch.setattr(dspark_config, "parse_k3", changed)


def _neox_rope(patch):  # DeepSeek-V3's rope_interleave false: halves rotated, not pairs
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb

    from proposers.toolkit.mla.attention import MlaAttention

    init = MlaAttention.__init__

    def neox(self, config, hf):
        init(self, config, hf)
        self.rotate = apply_rotary_pos_emb

    patch.setattr(MlaAttention, "__init__", neox)


def _layers_one_off(patch):  # the ids read as vLLM's aux (before-layer) ids
    _parsed(patch, lambda config: setattr(config, "target_layer_ids", [i + 1 for i in k3.FEATURES]))


def _no_markov_bias(patch):
    from proposers.dspark.model import DSparkDrafter

    patch.setattr(DSparkDrafter, "markov_bias", lambda self, hidden, previous: None)


def _causal_block(patch):  # the target's causal attention in the block
    _parsed(patch, lambda config: setattr(config, "is_causal", True))


WRONG = [_neox_rope, _layers_one_off, _no_markov_bias, _causal_block]


@pytest.mark.parametrize("wrong", WRONG, ids=lambda f: f.__name__.strip("_"))
def test_a_wrong_rule_differs_from_vllms_rule(setup, chain_at, wrong):
    tmp, shards, ckpt, *_ = setup
    with pytest.MonkeyPatch.context() as patch:
        wrong(patch)
        out_dir = chains.score(ckpt, shards, tmp / f"wrong-{wrong.__name__}", anchor_drafts=True, eagle_trees=[])
    found = differing(out_dir, shards, chain_at)
    print(
        f"\n{wrong.__name__}: {found['slots']}/{found['of_slots']} slots and {found['anchors']}/{found['of']} "
        "anchors' chains differ from vLLM's rule"
    )
    assert found["slots"] > 0, found


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"mla_use_output_gate": True}, "field 'mla_use_output_gate' is true"),
        ({"num_target_layers": 6}, "field 'num_target_layers' is 6"),
        ({"rope_interleave": False}, "field 'rope_interleave' is false"),
    ],
    ids=["output gate", "num_target_layers the target's", "neox rope"],
)
def test_a_config_vllm_refuses_is_one_error_line(setup, tmp_path, changes, named):
    from click.testing import CliRunner

    from specreplay.cli import main

    _, shards, ckpt, *_ = setup
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "config.json").write_text(json.dumps(k3.drafter_config(**changes)))
    out = tmp_path / "out"
    run = CliRunner().invoke(main, ["score", "--ckpt", str(bad), "--shards", shards, "--out", str(out), "--quiet"])
    print(f"\n{run.output.strip()}")
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert named in run.output and "Traceback" not in run.output, run.output
    assert not any(out.glob("**/summary.parquet")), run.output

"""Exactness of DeepSpec's Gemma 4 DSpark drafter (`Gemma4DSparkModel`, proposers/dspark/gemma4.py), scored
by `specreplay score`, against both engines' rule on one fitted drafter:

- llama-server (`--spec-type draft-dspark`, the drafter converted by llama.cpp's converter,
  conversion/gemma.py:813-911, run as src/models/dflash.cpp's graph): every sample's (accepted,
  drafted) steps equal the replay's under `--walk-rule llama.cpp`, step for step, at n_max 4 and 2;
- vLLM's rule (tests/helpers/gemma4_dspark.py's reference, written from gemma4_dspark.py on
  transformers' own Gemma 4 modules): at every anchor the replay's block equals the reference's
  greedy chain up to its first draft the response does not hold;
- the wrong rules (V from K after its norm's weight, V without its norm, layer_scalar ignored, no
  embedding scale, attention scale 1/sqrt(d), plain RoPE for proportional) each change anchors'
  drafts and samples' walks.

The target: transformers' Gemma4ForCausalLM (a sliding and two full layers, proportional RoPE), made
the engine target (llama_engine.engine_target) with a byte-fallback BPE tokenizer; the drafter (two
layers, layer scalars 0.6 and 1.4) fitted through the reference's own forward.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import chain_parity as chains, engine_parity as parity, gemma4_dspark as g4, llama_engine as engine

pytestmark = pytest.mark.slow

FIT_STEPS = 120
FIT_LR = 1e-2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from tests.helpers.models import seeded
    from tests.helpers.prompts import write_prompts
    from tools.llama_convert import convert

    tmp = tmp_path_factory.mktemp("engine_parity_dspark_gemma4")
    prompts = parity.prompt_ids(parity.PROMPTS)
    model_dir = engine.engine_target(tmp / "target", prompts, parity.MAX_NEW, model=g4.target_model())
    g4.save_tokenizer(model_dir)
    sequences = engine.continuations(model_dir, prompts, parity.MAX_NEW)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    raw = g4.drafter_config()
    with seeded(1):
        reference = g4.ReferenceGemma4DSpark(raw)
    loss = g4.fit(reference, target, sequences, FIT_STEPS, FIT_LR)
    ckpt = g4.save(reference.eval().requires_grad_(False), raw, tmp / "drafter")
    records = [{"id": f"p{i}", "input_ids": ids} for i, ids in enumerate(prompts)]
    prompts_file = write_prompts(tmp / "prompts.jsonl", records)
    shards = chains.extract(tmp / "shards", model_dir, prompts_file, parity.MAX_NEW, g4.FEATURES)
    served = g4.for_converter(model_dir, tmp / "target-conv", global_head_dim=16, num_global_key_value_heads=2)
    target_gguf = str(convert(served, tmp / "target.gguf"))
    drafter_gguf = str(convert(ckpt, tmp / "drafter.gguf", target_dir=served))
    found = parity.Setup(tmp, model_dir, target_gguf, shards, sequences, converter=None)
    drafter = parity.Drafter("dspark", "gemma4", ckpt, drafter_gguf, "draft-dspark", g4.BLOCK)
    return found, drafter, reference, target, loss


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from parity.threads_and_table("dspark ")


@pytest.mark.parametrize("n_max", [g4.BLOCK, 2])
def test_gemma4_dspark_counts_equal_llama_server(setup, n_max):
    found, drafter, _, _, loss = setup
    print(f"\nfitted Gemma 4 DSpark drafter: block loss {loss:.3f}")
    parity.assert_engine_counts(found, drafter, n_max)


# -- vLLM's rule: every anchor's block against the reference written from gemma4_dspark.py --------


@pytest.fixture(scope="module")
def chain_at(setup):
    """The reference's greedy chain at an anchor of a stored sample (its features from the target)."""
    _, _, reference, target, _ = setup
    features = {}

    @torch.no_grad()
    def chain(ids: torch.Tensor, anchor: int, count: int) -> list[int]:
        key = tuple(ids.tolist())
        if key not in features:
            features[key] = g4.target_features(target, ids)
        return reference.chain(features[key], ids, anchor, count)

    return chain


def test_every_anchor_equals_vllms_reference(setup, chain_at):
    found, drafter, *_ = setup
    anchors, drafts = chains.anchor_chains_compared(drafter.path, found.shards, found.tmp / "anchors", chain_at)
    assert anchors > 100 and drafts > anchors, (anchors, drafts)


# -- the wrong rules: each changes anchors' drafts and samples' walks -------------------------------


def _values_from_normed_keys(patch):
    from proposers.toolkit.gemma4.decoder import Gemma4BlockAttention

    patch.setattr(Gemma4BlockAttention, "values_of", lambda self, x, projected: self.k_norm(projected))


def _values_unnormed(patch):
    from proposers.toolkit.gemma4.decoder import Gemma4BlockAttention

    patch.setattr(Gemma4BlockAttention, "values_of", lambda self, x, projected: projected)


def _no_layer_scalar(patch):
    from proposers.toolkit.gemma4.decoder import Gemma4BlockLayer

    forward = Gemma4BlockLayer.forward
    patch.setattr(Gemma4BlockLayer, "forward", lambda self, h, *rest: forward(self, h, *rest) / self.layer_scalar)


def _no_embedding_scale(patch):
    import proposers.dspark.config as dspark_config

    parse = dspark_config.parse_gemma4

    def unscaled(*args):
        config = parse(*args)
        config.input_embedding_scale = 1.0
        return config

    patch.setattr(dspark_config, "parse_gemma4", unscaled)


def _scaled_attention(patch):
    from proposers.toolkit.gemma4.decoder import Gemma4BlockAttention

    init = Gemma4BlockAttention.__init__

    def scaled(self, config):
        init(self, config)
        self.scale = config.head_dim**-0.5

    patch.setattr(Gemma4BlockAttention, "__init__", scaled)


def _plain_rope(patch):
    import copy

    from proposers.dspark.gemma4 import Gemma4DSparkDrafter
    from proposers.toolkit.gemma4.decoder import ProportionalRotary

    class PlainRotary(ProportionalRotary):  # every frequency pair rotating: partial_rotary_factor 1
        def __init__(self, config):
            plain = copy.deepcopy(config)
            plain.rope_parameters = {"full_attention": {**config.rope_parameters["full_attention"]}}
            plain.rope_parameters["full_attention"]["partial_rotary_factor"] = 1.0
            super().__init__(plain)
            self.config = config

    patch.setattr(Gemma4DSparkDrafter, "rotary_class", PlainRotary)


WRONG = [
    _values_from_normed_keys,
    _values_unnormed,
    _no_layer_scalar,
    _no_embedding_scale,
    _scaled_attention,
    _plain_rope,
]
WRONG_IDS = ["V from normed K", "V unnormed", "no layer_scalar", "no embedding scale", "scale 1/sqrt(d)", "plain RoPE"]


def _differing_anchors(out_dir: str, shards: str, chain_at) -> tuple[int, int]:
    """(anchors whose block differs from the reference's chain along its verified prefix, anchors)."""
    import polars as pl

    from pipeline.shards import ShardSet

    rows = pl.read_parquet(f"{out_dir}/anchors.parquet").select("sample_id", "anchor", "draft_tokens")
    samples = {s.sample_id: s.input_ids for s in ShardSet(shards).samples(tensors=[])}
    differ = total = 0
    for sample_id, anchor, offline in rows.iter_rows():
        ids = samples[sample_id]
        known = min(len(offline), ids.numel() - 1 - anchor)
        if known == 0:
            continue
        chain = chain_at(ids, anchor, known)
        stored = ids[anchor + 1 : anchor + 1 + known].tolist()
        verified = next((i + 1 for i, (d, y) in enumerate(zip(chain, stored)) if d != y), known)
        differ, total = differ + (offline[:verified] != chain[:verified]), total + 1
    return differ, total


@pytest.mark.parametrize("wrong", WRONG, ids=WRONG_IDS)
def test_a_wrong_rule_differs_from_both_engines(setup, chain_at, wrong):
    found, drafter, *_ = setup
    engine_walk = engine.walk_counts(parity.scored(found, drafter, g4.BLOCK, "llama.cpp"))  # = llama-server's
    out = found.tmp / f"wrong-{wrong.__name__}"
    with pytest.MonkeyPatch.context() as patch:
        wrong(patch)
        out_dir = parity.score(drafter, found.shards, out, walk_rule="llama.cpp", steps=g4.BLOCK, anchor_drafts=True)
    walks = engine.walk_counts(out_dir)
    differ = sum(walks.get(sid) != steps for sid, steps in engine_walk.items())
    anchors, total = _differing_anchors(out_dir, found.shards, chain_at)
    print(
        f"\n{wrong.__name__}: {anchors}/{total} anchors differ from vLLM's rule, {differ}/{len(engine_walk)} walks from llama-server's"
    )
    assert anchors > 0 and differ > 0

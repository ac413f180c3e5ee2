"""Parity of proposers.dspark.config / dspark_model with the public DSpark references.

The reference is speculators' `DSparkDraftModel` (tests/helpers/dspark_reference.py): built tiny
with random weights, saved with its own save_pretrained, loaded into ours by name (config.json
through our parse function, weights with load_state_dict(strict=True)). For every anchor of one
random sequence, its own training path (`_backbone_forward`, then its Markov and confidence head
modules as its forward calls them) gives the hidden states, Markov-biased logits and confidence
logits we must reproduce. The same weights written in DeepSpec's and SpecForge's layouts must
give the same DrafterConfig and the same drafts.

Tolerances (fp32 throughout): hidden states 1e-5 and logits / confidence 1e-5 absolute, as
tests/scoring/drafters/test_dflash_model.py: both sides run the same float32 operations on the
same weights, and only the matmul shapes (batched anchors against the reference's one packed
sequence with a [Q, K] mask) and so the summation order differ. Greedy drafts must be equal.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.common.errors import UserError
from pipeline.common.sampling import Sampling
from pipeline.common.schema import validate
from proposers.dspark.config import parse_drafter_config
from proposers.dspark.layout import DeepSpecDSpark, SpecForgeDSpark
from proposers.dspark.model import DSparkDrafter, vllm_draft_logprob, vllm_top_k_top_p
from proposers.layouts import read_drafter_format
from proposers.toolkit.vocab import target_ids
from tests.helpers.dspark_reference import (
    HIDDEN,
    OUTPUT_IDS,
    VOCAB,
    confident_prefix_length,
    own_chain_confidence,
    reference_drafts,
    speculators_dspark,
    write_deepspec,
    write_specforge,
)

TOL = 1e-5
LENGTH = 20  # tokens of the random sequence: LENGTH - block_size anchors, anchor 0 included


def checked_layout(raw: dict, source: str):
    """The config validated against its declared layout, complete enough to build a drafter."""
    if "speculators_model_type" in raw:
        return read_drafter_format(raw, source)
    layout = DeepSpecDSpark if "Qwen3DSparkModel" in (raw.get("architectures") or []) else SpecForgeDSpark
    checked = validate(layout, raw, source)
    checked.check_complete(source)
    return checked


def parse(raw: dict, source: str = "drafter/config.json"):
    return parse_drafter_config(checked_layout(raw, source), raw, source)


def load_ours(save_dir) -> DSparkDrafter:
    source = f"{save_dir}/config.json"
    with open(source) as f:
        raw = json.load(f)
    model = DSparkDrafter(parse(raw, source))
    model.load_state_dict(load_file(f"{save_dir}/model.safetensors"), strict=True)
    model.check_loaded(source)
    return model.eval()


def sequence(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(LENGTH, len(OUTPUT_IDS) * HIDDEN, generator=generator)
    return features, torch.randint(0, VOCAB, (LENGTH,), generator=generator)


@torch.no_grad()
def our_drafts(ours: DSparkDrafter, embed, head, features, ids, anchors):
    """(hidden [A, B, H] of every block slot, the draft slots' predecessors, Drafts): blocks
    [x_t, mask, ...] embedded with the drafter's table, the context the features before t."""
    config = ours.config
    block = torch.full((anchors.numel(), config.block_size), config.mask_token_id)
    block[:, 0] = ids[anchors]
    embeds = torch.nn.functional.embedding(block, ours.embedding_table(embed))
    hidden = ours(embeds, anchors, ours.context_kv(features))
    slots = hidden if config.drafts_from_anchor else hidden[:, 1:]
    previous = ids[anchors[:, None] + torch.arange(slots.shape[1])]  # the token before each draft's target
    return hidden, previous, ours.drafts(slots, head, previous)


def assert_close(got, expected, what):
    diff = (got - expected).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.3g} > {TOL}"


def assert_matches_reference(ref, ours, embed, head):
    features, ids = sequence()
    expected = reference_drafts(ref, features, ids)
    anchors = expected["anchors"]
    hidden, previous, drafts = our_drafts(ours, embed, head, features, ids, anchors)
    assert_close(hidden, expected["hidden"], "backbone hidden states")
    slots = slice(None) if ours.config.drafts_from_anchor else slice(1, None)
    assert torch.equal(previous, expected["previous"][:, slots])
    ref_logits = expected["logits"][:, slots]
    ids_out = torch.arange(VOCAB) if ours.d2t is None else target_ids(ours.d2t)
    assert_close(drafts.logits[..., ids_out], ref_logits, "Markov-biased logits")
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids_out] = False
    assert torch.isneginf(drafts.logits[..., outside]).all(), "tokens outside the draft vocabulary must be -inf"
    assert torch.equal(drafts.logits.argmax(-1), ids_out[ref_logits.argmax(-1)]), "greedy drafts"
    assert drafts.limit is None  # no threshold configured: nothing is cut
    confidence = ours.confidence(hidden[:, slots], previous)
    if expected["confidence"] is None:
        assert confidence is None
        return
    assert_close(confidence, expected["confidence"][:, slots], "confidence logits")
    # the median of each block's lowest sigmoid(confidence): cuts some blocks, not all
    threshold = float(expected["confidence"][:, slots].sigmoid().min(dim=-1).values.median())
    ours.config.family_options["confidence_threshold"] = threshold
    cut = our_drafts(ours, embed, head, features, ids, anchors)[2]
    reference = confident_prefix_length(expected["confidence"][:, slots], threshold)
    assert torch.equal(cut.limit, reference)
    assert 0 < int((cut.limit < ref_logits.shape[1]).sum()) < anchors.numel()
    if not ours.config.family_options["confidence_head_with_markov"]:
        assert cut.drafted is None  # the cut reads no predecessor: the same along any chain
        return
    # the drafts proposed: the cut along the drafter's own greedy drafts, past a rejection too
    own = own_chain_confidence(ref, hidden[:, slots], ref_logits, previous, ids_out)
    assert torch.equal(cut.drafted, confident_prefix_length(own, threshold))
    assert not torch.equal(cut.drafted, cut.limit)  # the stored predecessors would cut elsewhere


# ---------------------------------------------------------------------------------------------
# speculators' DSparkDraftModel, every head


@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("confidence", ["none", "hidden", "markov"])
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_speculators_dspark_matches_reference(tmp_path, head_type, confidence, draft_vocab):
    ref, embed, head = speculators_dspark(tmp_path, head_type=head_type, confidence=confidence, draft_vocab=draft_vocab)
    ours = load_ours(tmp_path)
    assert ours.config.draft_vocab_size == draft_vocab and ours.config.drafts_from_anchor
    assert ours.config.target_layer_ids == OUTPUT_IDS  # before-layer [1, 3, 5] read as outputs of 0, 2, 4
    assert_matches_reference(ref, ours, embed, head)


@pytest.mark.parametrize("head_type", ["vanilla", "gated"])
def test_not_sampling_from_anchor_matches_reference(tmp_path, head_type):
    # sample_from_anchor false: slots 1..B-1 draft, slot k's predecessor is the token at t + k - 1.
    ref, embed, head = speculators_dspark(tmp_path, head_type=head_type, sample_from_anchor=False)
    ours = load_ours(tmp_path)
    assert not ours.config.drafts_from_anchor and ours.config.max_drafts == ours.config.block_size - 1
    assert_matches_reference(ref, ours, embed, head)


def test_without_markov_head_matches_reference(tmp_path):
    ref, embed, head = speculators_dspark(tmp_path, rank=0, confidence="hidden")
    ours = load_ours(tmp_path)
    assert ours.markov_head is None
    assert_matches_reference(ref, ours, embed, head)


# ---------------------------------------------------------------------------------------------
# the same weights in DeepSpec's and SpecForge's layouts


def comparable(config):
    """A DrafterConfig without what legitimately differs between layouts of the same drafter."""
    return dataclasses.replace(
        config, raw={}, layout="", num_target_layers=None, stated_layer_ids=None, layer_convention=""
    )


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_deepspec_and_specforge_layouts_equal_speculators(tmp_path, head_type):
    ref, embed, head = speculators_dspark(tmp_path / "speculators", head_type=head_type)
    write_deepspec(tmp_path / "deepspec", ref, embed, head)
    write_specforge(tmp_path / "specforge", ref)
    models = {name: load_ours(tmp_path / name) for name in ("speculators", "deepspec", "specforge")}
    configs = {name: model.config for name, model in models.items()}
    assert comparable(configs["deepspec"]) == comparable(configs["speculators"])
    assert comparable(configs["specforge"]) == comparable(configs["speculators"])
    assert configs["deepspec"].num_target_layers == configs["specforge"].num_target_layers == 6
    features, ids = sequence()
    anchors = torch.arange(LENGTH - ref.block_size)
    # DeepSpec embeds and projects with its own copies; pass the others the same target tensors.
    results = {name: our_drafts(model, embed, head, features, ids, anchors) for name, model in models.items()}
    assert models["deepspec"].embed_tokens is not None and models["deepspec"].lm_head is not None
    for name in ("deepspec", "specforge"):
        got, want = results[name], results["speculators"]
        assert torch.equal(got[0], want[0]), f"{name}: hidden states"
        assert torch.equal(got[2].logits, want[2].logits), f"{name}: draft logits"
    assert_matches_reference(ref, models["deepspec"], embed, head)


def test_deepspec_without_its_copies_uses_the_targets(tmp_path):
    ref, embed, head = speculators_dspark(tmp_path / "speculators")
    write_deepspec(tmp_path / "deepspec", ref, embed, head)
    ours = load_ours(tmp_path / "deepspec")
    assert set(ours.optional_weights) == {"embed_tokens.weight", "lm_head.weight"}
    ours.drop_weights(ours.optional_weights)
    assert "lm_head.weight" not in ours.state_dict() and ours.embedding_table(embed) is embed
    assert_matches_reference(ref, ours, embed, head)


def test_specforge_legacy_head_names_load(tmp_path):
    ref, embed, head = speculators_dspark(tmp_path / "speculators", head_type="gated")
    write_specforge(tmp_path / "specforge", ref, legacy_names=True)
    assert any(k.startswith("logit_head.") for k in load_file(tmp_path / "specforge" / "model.safetensors"))
    assert_matches_reference(ref, load_ours(tmp_path / "specforge"), embed, head)


# ---------------------------------------------------------------------------------------------
# refusals: one line naming the file and the field


def refusal(raw: dict) -> str:
    with pytest.raises(UserError) as caught:
        parse(raw)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("drafter/config.json: "), message
    return message


@pytest.fixture
def layouts(tmp_path) -> dict:
    """The three layouts' config.json of one drafter (vanilla head, confidence head with markov)."""
    ref, embed, head = speculators_dspark(tmp_path / "speculators")
    with open(tmp_path / "speculators" / "config.json") as f:
        speculators = json.load(f)
    return {
        "speculators": speculators,
        "deepspec": write_deepspec(tmp_path / "deepspec", ref, embed, head),
        "specforge": write_specforge(tmp_path / "specforge", ref),
    }


def heads_of(raw: dict) -> dict:
    """Where the layout keeps its DSpark head fields."""
    return raw["dflash_config"] if "dflash_config" in raw else raw


def test_deepspec_embedding_layer_refused(layouts):
    raw = dict(layouts["deepspec"], target_layer_ids=[-1, 2, 4])
    message = refusal(raw)
    assert "'target_layer_ids'" in message and "-1" in message and "embedding output" in message


def test_deepspec_last_target_layer_refused(layouts):
    message = refusal(dict(layouts["deepspec"], target_layer_ids=[0, 2, 5]))  # 6 target layers
    assert "'target_layer_ids'" in message and "last layer" in message


@pytest.mark.parametrize("layout", ["speculators", "deepspec", "specforge"])
def test_confidence_with_markov_but_no_markov_head_refused(layouts, layout):
    raw = json.loads(json.dumps(layouts[layout]))
    heads_of(raw)["markov_rank"] = 0
    message = refusal(raw)
    assert "confidence_head_with_markov'" in message and "markov_rank'" in message


@pytest.mark.parametrize("layout", ["speculators", "deepspec", "specforge"])
def test_unknown_markov_head_type_refused(layouts, layout):
    raw = json.loads(json.dumps(layouts[layout]))
    heads_of(raw)["markov_head_type"] = "lstm"
    message = refusal(raw)
    assert "markov_head_type'" in message and "'lstm'" in message


def test_head_type_case_as_deepspec_and_specforge_read_it(layouts):
    for layout in ("deepspec", "specforge"):
        raw = json.loads(json.dumps(layouts[layout]))
        heads_of(raw)["markov_head_type"] = "Gated"
        assert parse(raw).family_options["markov_head_type"] == "gated"


def test_rnn_head_without_sample_from_anchor_refused(layouts):
    raw = dict(layouts["speculators"], markov_head_type="rnn", sample_from_anchor=False)
    assert "'markov_head_type'" in refusal(raw)


def test_specforge_attention_mode_refused_as_specforge_does(layouts):
    raw = json.loads(json.dumps(layouts["specforge"]))
    raw["num_key_value_heads"] = raw["num_attention_heads"]  # MHA under the default attention_mode gqa
    assert "attention_mode" in refusal(raw)
    raw["dflash_config"]["attention_mode"] = "mha"
    assert parse(raw).num_key_value_heads == raw["num_attention_heads"]


def test_confidence_threshold_field(layouts):
    assert parse(layouts["deepspec"]).family_options["confidence_threshold"] == 0.0  # DeepSpec's default
    assert parse(dict(layouts["deepspec"], confidence_threshold=0.4)).family_options["confidence_threshold"] == 0.4
    assert parse(dict(layouts["speculators"], confidence_threshold=0.4)).family_options["confidence_threshold"] == 0.4
    assert "'confidence_threshold'" in refusal(dict(layouts["speculators"], confidence_threshold=1.5))


# ---------------------------------------------------------------------------------------------
# q at T > 0


def test_draft_logprob_is_deepspec_temperature_only(tmp_path):
    ours = DSparkDrafter(parse(speculators_layout_raw(tmp_path)))
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 4, VOCAB, generator=generator) * 3
    tokens = torch.randint(0, VOCAB, (5, 4), generator=generator)
    for temperature in (0.6, 1.0):
        # DeepSpec's logits_to_probs: softmax(logits.float() / T), no top-k/top-p even when asked
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        expected = probs.gather(-1, tokens[..., None])[..., 0].log()
        got = ours.draft_logprob(logits, tokens, Sampling(temperature, top_p=0.5, top_k=3))
        assert_close(got, expected, f"log q at T={temperature}")


def speculators_layout_raw(tmp_path) -> dict:
    speculators_dspark(tmp_path)
    with open(tmp_path / "config.json") as f:
        return json.load(f)


def test_vllm_top_k_top_p_rule():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]])
    # top-k 2 keeps every score >= the 2nd largest: both 3s (a tie at the boundary), nothing else
    assert torch.isneginf(vllm_top_k_top_p(scores, 2, 1.0)).tolist() == [[True, False, False, True, True]]
    # top-p drops the ascending prefix whose cumulative probability is <= 1 - p
    probs = torch.softmax(scores, dim=-1)[0]
    kept = ~torch.isneginf(vllm_top_k_top_p(scores, 0, 0.8))[0]
    order = probs.argsort()
    dropped_mass = probs[order][~kept[order]].sum()
    assert dropped_mass <= 0.2 + 1e-6 and dropped_mass + probs[order][kept[order]][0] > 0.2
    q = vllm_draft_logprob(scores, torch.tensor([1]), Sampling(1.0, top_p=1.0, top_k=2))
    assert abs(float(q.exp()) - 0.5) < 1e-6  # two tied scores kept, equal mass

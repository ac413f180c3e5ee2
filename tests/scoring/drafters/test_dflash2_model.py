"""Parity of proposers.dflash2.config with the public DFlash2 references.

z-lab (`dflash.model.DFlash2DraftModel`, what `dflash_generate` runs) and speculators
(`speculators.models.dflash2.core.DFlash2DraftModel`, its training forward) are built with random
weights (tests/helpers/dflash2_reference.py), saved with their own save_pretrained, and the saved
files are read into ours by name. fp32 throughout: hidden states agree to 1e-5 (only matmul
shapes and summation order differ); selector scores, sums of a dozen products of values up to ~10,
to 1e-5 relative; greedy drafts exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from dflash.model import _crop_to, _draft_value, _make_cache
from torch import nn

from pipeline.common.sampling import Sampling
from proposers.dflash2.config import FAMILY
from proposers.dflash2.model import canonical_names
from proposers.layouts import read_drafter_format
from proposers.toolkit.config import DrafterConfigError
from tests.helpers.dflash2_reference import load_ours, speculators_dflash2, zlab_config, zlab_dflash2
from tests.helpers.drafters import REFERENCE_HIDDEN as HIDDEN, REFERENCE_VOCAB as VOCAB
from tests.helpers.models import seeded

TOL = 1e-5
LENGTH = 16  # the stored sequence; anchors 1 .. LENGTH - 2, the last two blocks truncated

ZLAB_CASES = {
    "full attention": {},
    # window 3 < block 4: the context cut and the in-block cut both bite, next to the convolution
    "sliding layer": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3},
    "scales": {
        "dflash_extra": {"input_embedding_scale": 1.5, "output_multiplier": 0.8, "final_logit_softcapping": 4.0}
    },
}


class Sequence:
    """One random stored sequence with the target's parts the drafter uses: token ids, features
    of its feature layers, input embedding table, lm_head."""

    def __init__(self, layers: int, seed: int = 1):
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        self.features = torch.randn(LENGTH, layers * HIDDEN, generator=generator)
        self.embedding = torch.randn(VOCAB, HIDDEN, generator=generator)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.head.weight.normal_(0.0, 1.0, generator=generator)

    def block(self, t: int, b: int, mask: int, scale: float) -> torch.Tensor:
        """Embeddings [b, H] of the block [x_t, mask, ...] at anchor t, times the input scale."""
        ids = torch.full((b,), mask)
        ids[0] = self.tokens[t]
        return self.embedding[ids] * scale


def zlab_pair(tmp_path, **case):
    ref = zlab_dflash2(tmp_path / "drafter", **case)
    return ref, load_ours(tmp_path / "drafter")


def parse(raw: dict):
    """Our DrafterConfig of a config.json dict, through its declared layout (as detect.py reads it)."""
    return FAMILY.parse_config(read_drafter_format(raw, "d/config.json"), raw, "d/config.json")


def block_len(ref, t: int) -> int:
    """dflash_generate's verify_size at start t with max_length = LENGTH."""
    return min(ref.block_size, LENGTH - t)


@torch.no_grad()
def zlab_block(ref, seq: Sequence, t: int) -> torch.Tensor:
    """The reference's hidden states [b, H] of the block at t, uncached: context = features of
    0 .. t - 1, embeddings scaled as dflash_generate scales them."""
    scale = float(_draft_value(ref.config, "input_embedding_scale", 1.0))
    b = block_len(ref, t)
    return ref(
        target_hidden=seq.features[None, :t],
        noise_embedding=seq.block(t, b, ref.mask_token_id, scale)[None],
        position_ids=torch.arange(t + b)[None],
        past_key_values=None,
    )[0]


@torch.no_grad()
def our_blocks(ours, seq: Sequence) -> dict[int, torch.Tensor]:
    """Our hidden states [b, H] at every anchor, computed batched: all anchors of one block
    length in one call, sharing one context."""
    config = ours.config
    context = ours.context_kv(seq.features)
    by_len: dict[int, list[int]] = {}
    for t in range(1, LENGTH - 1):
        by_len.setdefault(min(config.block_size, LENGTH - t), []).append(t)
    out = {}
    for b, anchors in by_len.items():
        embeds = torch.stack([seq.block(t, b, config.mask_token_id, config.input_embedding_scale) for t in anchors])
        hidden = ours(embeds, torch.tensor(anchors), context)
        out.update(zip(anchors, hidden))
    return out


# ---------------------------------------------------------------------------------------------
# z-lab: the backbone, block by block


@pytest.mark.parametrize("case", ZLAB_CASES.values(), ids=ZLAB_CASES.keys())
def test_zlab_hidden_states_match_at_every_anchor(tmp_path, case):
    ref, ours = zlab_pair(tmp_path, **case)
    seq = Sequence(len(ref.target_layer_ids))
    ours_by_anchor = our_blocks(ours, seq)
    assert {len(h) for h in ours_by_anchor.values()} == {2, 3, 4}  # truncated tail blocks included
    for t, got in ours_by_anchor.items():
        diff = (got - zlab_block(ref, seq, t)).abs().max().item()
        assert diff <= TOL, f"anchor {t}: max abs diff {diff:.3g}"


@torch.no_grad()
@pytest.mark.parametrize("case", [ZLAB_CASES["full attention"], ZLAB_CASES["sliding layer"]], ids=["full", "sliding"])
def test_zlab_cached_online_loop_matches(tmp_path, case):
    """As dflash_generate drives the reference: a DynamicCache fed only the newly accepted
    positions' features, cropped back to `start` after each draft."""
    ref, ours = zlab_pair(tmp_path, **case)
    seq = Sequence(len(ref.target_layer_ids))
    context = ours.context_kv(seq.features)
    cache = _make_cache(ref.config)
    start, new_from = 3, 0
    for produced in [1, 3, 4, 2, 1, 1]:  # accepted-token counts a verify step could give
        b = block_len(ref, start)
        embeds = seq.block(start, b, ref.mask_token_id, 1.0)
        expected = ref(
            target_hidden=seq.features[None, new_from:start],
            noise_embedding=embeds[None],
            position_ids=torch.arange(new_from, start + b)[None],
            past_key_values=cache,
            use_cache=True,
        )[0]
        _crop_to(cache, start)
        got = ours(embeds[None], torch.tensor([start]), context)[0]
        assert (got - expected).abs().max().item() <= TOL, f"step at start {start}"
        new_from, start = start, start + produced
    assert start == LENGTH - 1  # the walk reached the truncated tail


# ---------------------------------------------------------------------------------------------
# z-lab: the candidate selector against `propose`


@torch.no_grad()
@pytest.mark.parametrize("case", ZLAB_CASES.values(), ids=ZLAB_CASES.keys())
def test_zlab_greedy_drafts_equal_propose(tmp_path, case):
    # Teacher-forced with the reference's own drafts as predecessors, our one pass drafts what its
    # left-to-right walk drafts, at every slot of every anchor.
    ref, ours = zlab_pair(tmp_path, **case)
    seq = Sequence(len(ref.target_layer_ids))
    overturned = total = 0
    for t, hidden in our_blocks(ours, seq).items():
        ref_hidden = zlab_block(ref, seq, t)[None, 1:]
        anchor = seq.tokens[t : t + 1]
        expected, _, _ = ref.propose(ref_hidden, anchor, seq.head, 0.0)
        previous = torch.cat([anchor, expected[0, :-1]])[None]
        drafts = ours.drafts(hidden[None, 1:], seq.head.weight, previous)
        assert torch.equal(drafts.tokens, expected), f"anchor {t}: {drafts.tokens.tolist()} vs {expected.tolist()}"
        overturned += (expected != ref.compute_logits(ref_hidden, seq.head).argmax(-1)).sum().item()
        total += expected.numel()
    # the selector decides at some slots and not at others, so neither rule alone passes
    assert 0 < overturned < total


@torch.no_grad()
@pytest.mark.parametrize("case", ZLAB_CASES.values(), ids=ZLAB_CASES.keys())
def test_zlab_sampled_q_equals_propose(tmp_path, case):
    # At T = 0.7 the reference samples each slot from softmax(S / T) over its candidates given
    # the path it sampled; along that path our q is the same, and top-p / top-k do not apply.
    ref, ours = zlab_pair(tmp_path, **case)
    seq = Sequence(len(ref.target_layer_ids))
    sampling = Sampling(temperature=0.7, top_p=0.5, top_k=2)
    for t, hidden in our_blocks(ours, seq).items():
        anchor = seq.tokens[t : t + 1]
        with seeded(t):
            path, candidates, q = ref.propose(zlab_block(ref, seq, t)[None, 1:], anchor, seq.head, sampling.temperature)
        drafts = ours.drafts(hidden[None, 1:], seq.head.weight, torch.cat([anchor, path[0, :-1]])[None])
        proposed = torch.isfinite(drafts.logits)
        assert torch.equal(proposed, torch.zeros_like(proposed).scatter(-1, candidates, True)), f"anchor {t}"
        ours_q = torch.stack(
            [
                ours.draft_logprob(drafts.logits, candidates[..., c], sampling).exp()
                for c in range(candidates.shape[-1])
            ],
            dim=-1,
        )
        assert (ours_q - q).abs().max().item() <= TOL, f"anchor {t}"
        outside = ours.draft_logprob(drafts.logits, (~proposed).int().argmax(-1), sampling)
        assert torch.isneginf(outside).all()  # a token outside the candidates is never proposed


# ---------------------------------------------------------------------------------------------
# speculators: `_backbone_forward` and the selector's `select`


def speculators_inputs(seed: int = 1):
    """A one-document training batch of LENGTH positions, every anchor valid."""
    generator = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, LENGTH, 2 * HIDDEN, generator=generator),
        input_ids=torch.randint(0, VOCAB, (1, LENGTH), generator=generator),
        loss_mask=torch.ones(1, LENGTH, dtype=torch.long),
        verifier_last_hidden_states=torch.randn(1, LENGTH, HIDDEN, generator=generator),
        document_ids=torch.zeros(1, LENGTH, dtype=torch.long),
        position_ids=torch.arange(LENGTH)[None],
    )


@torch.no_grad()
def speculators_and_ours(ref, ours):
    """(reference hidden [A, B, H], candidates [A, B, K], scores [A, B, K], predecessors [A, B];
    our hidden [A, B, H]) at every anchor the reference trains on (0 .. LENGTH - B - 1, in order
    when max_anchors covers them all)."""
    batch = speculators_inputs()
    B = ref.block_size
    anchors = torch.arange(LENGTH - B)
    hidden, logits, _, _, indices = ref._backbone_forward(**batch, max_anchors=len(anchors))
    predecessors = ref._predecessor_ids(batch["input_ids"], indices)
    candidates, scores = ref.candidate_selector.select(logits, hidden, predecessors.reshape(1, -1))
    ids = torch.full((len(anchors), B), ours.config.mask_token_id)
    ids[:, 0] = batch["input_ids"][0, anchors]
    ours_hidden = ours(ref.embed_tokens.weight[ids], anchors, ours.context_kv(batch["hidden_states"][0]))
    A = len(anchors)
    return hidden.view(A, B, -1), candidates.view(A, B, -1), scores.view(A, B, -1), predecessors, ours_hidden


@torch.no_grad()
@pytest.mark.parametrize("from_anchor", [False, True], ids=["drafts from slot 1", "sample_from_anchor"])
def test_speculators_backbone_and_selector_match(tmp_path, from_anchor):
    ref = speculators_dflash2(tmp_path / "drafter", sample_from_anchor=from_anchor)
    ours = load_ours(tmp_path / "drafter")
    assert ours.config.drafts_from_anchor is from_anchor
    hidden, candidates, scores, predecessors, ours_hidden = speculators_and_ours(ref, ours)
    assert (ours_hidden - hidden).abs().max().item() <= TOL
    first = 0 if from_anchor else 1  # slot 0 is the anchor's own unless it drafts
    drafts = ours.drafts(ours_hidden[:, first:], ref.lm_head.weight, predecessors[:, first:])
    candidates, scores = candidates[:, first:], scores[:, first:]
    torch.testing.assert_close(drafts.logits.gather(-1, candidates), scores, rtol=TOL, atol=TOL)
    assert torch.isfinite(drafts.logits).sum(-1).eq(candidates.shape[-1]).all()  # -inf off the candidates
    assert torch.equal(drafts.tokens, candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0])
    unary = ref.lm_head(hidden[:, first:]).argmax(-1)
    assert 0 < (drafts.tokens != unary).sum() < drafts.tokens.numel()


@torch.no_grad()
@pytest.mark.parametrize("non_causal", [True, False], ids=["non-causal (default)", "causal"])
def test_speculators_sliding_layer_matches_where_the_masks_agree(tmp_path, non_causal):
    # speculators' training mask keeps context a - W .. a - 1 for the whole block; serving (z-lab,
    # vLLM), which the replay implements, keeps q - k < W per query. They agree while
    # a + B - 1 < W and differ after (docs/drafter-families.md#dflash2).
    window = 8
    ref = speculators_dflash2(
        tmp_path / "drafter",
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=window,
        sliding_window_non_causal=non_causal,
    )
    ours = load_ours(tmp_path / "drafter")
    assert ours.config.layer_is_causal(0) is not non_causal and not ours.config.layer_is_causal(1)
    hidden, _, _, _, ours_hidden = speculators_and_ours(ref, ours)
    diff = (ours_hidden - hidden).abs().amax(dim=(1, 2))
    agree = window - ref.block_size + 1
    assert diff[:agree].max().item() <= TOL
    assert diff[agree:].min().item() > 1e-3


def test_speculators_layer_ids_are_ours_plus_one(tmp_path):
    ref = speculators_dflash2(tmp_path / "drafter", layer_ids=(1, 3, 5))
    ours = load_ours(tmp_path / "drafter")
    assert ref.config.aux_hidden_state_layer_ids == [1, 3, 5]
    assert ours.config.target_layer_ids == [0, 2, 4]
    assert ours.fc.weight.shape == (HIDDEN, 3 * HIDDEN)


# ---------------------------------------------------------------------------------------------
# names and shapes as saved


@pytest.mark.parametrize("build", [zlab_dflash2, speculators_dflash2], ids=["z-lab", "speculators"])
def test_saved_tensors_are_exactly_our_skeleton(tmp_path, build):
    # What checkpoint.py checks before loading: a meta-device skeleton's names and shapes equal
    # the file's (z-lab's own saver suffixes the codebooks with .weight; canonical_names maps them).
    from safetensors import safe_open

    build(tmp_path / "drafter")
    raw = json.loads((tmp_path / "drafter" / "config.json").read_text())
    config = FAMILY.parse_config(read_drafter_format(raw, "config.json"), raw, "config.json")
    with torch.device("meta"):
        skeleton = FAMILY.model(config)
    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), "pt") as f:
        saved = canonical_names({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    assert {name: tuple(t.shape) for name, t in skeleton.state_dict().items()} == saved
    assert saved["candidate_selector.predecessor_codebook"] == (VOCAB, 16)


def test_zlab_defaults_are_the_references():
    # Without head_dim the reference takes Qwen3Config's default (128), not hidden_size / heads (8).
    from dflash.model import DFlash2DraftModel
    from transformers import Qwen3Config

    raw = zlab_config()
    del raw["head_dim"]
    config = parse(raw)
    ref = DFlash2DraftModel(Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"}))
    assert config.head_dim == ref.layers[0].self_attn.head_dim == 128
    with torch.device("meta"):
        skeleton = FAMILY.model(config)
    expected = canonical_names({name: tuple(t.shape) for name, t in ref.state_dict().items()})
    assert {name: tuple(t.shape) for name, t in skeleton.state_dict().items()} == expected


# ---------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"conv_group_size": 5}, "dflash_config.conv_group_size 5 does not divide hidden_size 32"),
        ({"conv_kernel_size": 5}, "dflash_config.conv_kernel_size 5 exceeds block_size 4"),
        ({"selector_top_k": VOCAB + 1}, f"dflash_config.selector_top_k {VOCAB + 1} exceeds vocab_size {VOCAB}"),
        ({"selector_rank": None}, "DFlash2 field dflash_config.selector_rank is missing"),
    ],
)
def test_zlab_refusals(fields, message):
    raw = zlab_config(dflash_extra=fields)
    raw["dflash_config"] = {k: v for k, v in raw["dflash_config"].items() if v is not None}
    with pytest.raises(DrafterConfigError) as error:
        parse(raw)
    assert str(error.value).startswith(f"d/config.json: {message}") and "\n" not in str(error.value)


def test_zlab_reference_cannot_run_what_is_refused():
    # z-lab checks nothing up front; these configs fail in its forward (a kernel longer than the
    # block, once a truncated tail block is shorter than its taps) or in its selector instead.
    seq = Sequence(2)
    tail = LENGTH - 2  # a block of 2
    for fields in ({"conv_group_size": 5}, {"conv_kernel_size": 5}, {"selector_top_k": VOCAB + 1}):
        ref = zlab_dflash2(dflash_extra=fields)
        with pytest.raises(RuntimeError), torch.no_grad():
            hidden = zlab_block(ref, seq, tail)
            ref.propose(hidden[None, 1:], seq.tokens[tail : tail + 1], seq.head, 0.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"conv_group_size": 5}, "conv_group_size 5 does not divide hidden_size 32"),
        ({"conv_kernel_size": 5}, "conv_kernel_size 5 exceeds block_size 4"),
        ({"selector_top_k": VOCAB + 1}, f"selector_top_k {VOCAB + 1} exceeds transformer_layer_config.vocab_size"),
        ({"draft_vocab_size": 48}, "field 'draft_vocab_size' is 48, not transformer_layer_config.vocab_size 64"),
    ],
)
def test_speculators_refusals_are_the_references(tmp_path, fields, message):
    with pytest.raises(ValueError):  # speculators' own classes refuse each
        speculators_dflash2(**fields)
    speculators_dflash2(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(DrafterConfigError) as error:
        parse({**raw, **fields})
    assert str(error.value).startswith(f"d/config.json: {message}") and "\n" not in str(error.value)


def test_speculators_scales_stay_neutral(tmp_path):
    # speculators' DFlash2 trains and runs without them, so they never apply to its weights
    speculators_dflash2(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    config = parse({**raw, "input_embedding_scale": 2.0, "output_multiplier": 0.5, "final_logit_softcapping": 3.0})
    assert config.scales() == (1.0, 1.0, None) and config.sliding_non_causal

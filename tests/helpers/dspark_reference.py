"""DSpark reference drafters for the tests (tests/scoring/drafters/test_dspark_model.py).

`speculators_dspark` builds the public reference, speculators' `DSparkDraftModel`, tiny and on
CPU (eager attention, as /tmp notes' tiny_train.py), with random weights, and saves it with its
own save_pretrained. `reference_drafts` runs its own training path on every anchor of a
sequence: `_backbone_forward`, then its Markov and confidence head modules exactly as
`DSparkDraftModel.forward` calls them (speculators models/dspark/core.py:151-196).
`write_deepspec` and `write_specforge` write the same weights in DeepSpec's and SpecForge's layouts,
their config.json as those projects write it (DeepSpec deepspec/modeling/dspark/qwen3/config.py:9-56
through transformers' save_pretrained; SpecForge configs/qwen3-8b-dspark.json).
"""

from __future__ import annotations

import copy
import json
import os

import torch
from safetensors.torch import save_file

from tests.helpers.models import seeded

HIDDEN, VOCAB, MASK = 32, 64, 60
TARGET_LAYERS = 6
AUX_IDS = (1, 3, 5)  # speculators' before-layer ids: the outputs of layers 0, 2, 4
OUTPUT_IDS = [i - 1 for i in AUX_IDS]


def qwen3_config(layers: int):
    """A tiny Qwen3 config: the drafter's decoder, or (DeepSpec's drafter copies its target's
    config) the target's with the same widths."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )


def decoder_config(layers: int = 2):
    config = qwen3_config(layers)
    config._attn_implementation = "eager"  # speculators' CPU path: float masks, eager attention
    return config


def speculators_dspark(
    save_dir,
    *,
    head_type: str = "vanilla",
    rank: int = 8,
    confidence: str = "markov",
    draft_vocab: int | None = None,
    block_size: int = 4,
    sample_from_anchor: bool = True,
    seed: int = 0,
    std: float = 0.2,
):
    """(model, target embedding [V, H], target lm_head [V, H]): speculators' DSparkDraftModel with
    random weights, `confidence` "none", "hidden" (h_k alone) or "markov" ([h_k ; W1[prev]]),
    `draft_vocab` a reduced vocabulary of that many random target ids; saved to `save_dir`."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark.config import DSparkSpeculatorConfig
    from speculators.models.dspark.core import DSparkDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    tokens = block_size if sample_from_anchor else block_size - 1
    config = DSparkSpeculatorConfig(
        transformer_layer_config=decoder_config(),
        draft_vocab_size=draft_vocab or VOCAB,
        block_size=block_size,
        aux_hidden_state_layer_ids=list(AUX_IDS),
        mask_token_id=MASK,
        sample_from_anchor=sample_from_anchor,
        markov_rank=rank,
        markov_head_type=head_type,
        enable_confidence_head=confidence != "none",
        confidence_head_with_markov=confidence == "markov",
        speculators_config=SpeculatorsConfig(
            algorithm="dspark",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )
    with seeded(seed), torch.no_grad():
        model = DSparkDraftModel(config)
        for parameter in model.parameters():  # norms too, so a weight in the wrong slot shows
            parameter.normal_(0.0, std)
        embed, head = torch.randn(VOCAB, HIDDEN) * 0.5, torch.randn(VOCAB, HIDDEN) * 0.5
        model.embed_tokens.weight.copy_(embed)
        rows = head
        if draft_vocab:  # as speculators' vocab mapping: selected target ids ascending, d2t = id - d
            selected = torch.randperm(VOCAB)[:draft_vocab].sort().values
            t2d = torch.zeros(VOCAB, dtype=torch.bool)
            t2d[selected] = True
            model.load_vocab_mappings(t2d, selected - torch.arange(draft_vocab))
            rows = head[t2d]
        model.lm_head.weight.copy_(rows)
        model.verifier_lm_head.weight.copy_(rows)
    model.eval()
    model.save_pretrained(str(save_dir))
    return model, embed, head


@torch.no_grad()
def reference_drafts(model, features: torch.Tensor, ids: torch.Tensor) -> dict:
    """Every anchor's block through the reference's own training path, for `features` [T, n*H]
    and tokens `ids` [T]: max_anchors = T, so select_anchors takes every valid position
    (0 .. T - block_size - 1) in order. Returns anchors [A], hidden [A, B, H], the Markov-biased
    logits [A, B, Vd], the confidence logits [A, B] (or None) and the Markov predecessors [A, B]."""
    length, block = ids.numel(), model.block_size
    generator = torch.Generator().manual_seed(7)
    hidden, logits, _, _, indices = model._backbone_forward(
        features[None],
        ids[None],
        torch.ones(1, length, dtype=torch.long),
        torch.randn(1, length, HIDDEN, generator=generator),  # only its training targets read it
        torch.zeros(1, length, dtype=torch.long),
        max_anchors=length,
    )
    anchors = torch.arange(length - block)  # the valid ones, first; the rest are padding
    num_blocks = length
    # From here as DSparkDraftModel.forward (core.py:152-196), on the reference's own modules.
    block_tokens = ids[indices].view(num_blocks, block)
    if model.config.sample_from_anchor:
        previous = block_tokens
    else:
        previous = torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)
    hidden = hidden.view(num_blocks, block, -1)
    logits = logits.view(num_blocks, block, -1)
    prev_emb = None
    if model.markov_head is not None:
        prev_emb = model.markov_head.prev_embeddings(previous)
        logits = logits + model.markov_head.block_bias(prev_token_ids=previous, hidden_states=hidden, prev_emb=prev_emb)
    confidence = None
    if model.confidence_head is not None:
        features_in = hidden
        if model.config.confidence_head_with_markov:
            features_in = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        confidence = model.confidence_head(features_in)[: anchors.numel()]
    a = anchors.numel()
    return {
        "anchors": anchors,
        "hidden": hidden[:a],
        "logits": logits[:a],
        "confidence": confidence,
        "previous": previous[:a],
    }


@torch.no_grad()
def own_chain_confidence(model, hidden, logits, previous, ids_out) -> torch.Tensor:
    """[A, D] confidence logits along the drafter's own greedy drafts, as DeepSpec's proposal reads
    them (each slot's predecessor the draft before it, the first slot's the anchor token), from the
    reference's modules: `hidden` [A, D, H] and the teacher-forced `logits` [A, D, Vd] of the draft
    slots, `previous` [A, D] their stored predecessors, `ids_out` [Vd] the target id of each draft id."""
    head = model.markov_head
    base = logits - head.block_bias(prev_token_ids=previous, hidden_states=hidden)
    own = previous.clone()
    for k in range(1, own.shape[1]):
        chained = base + head.block_bias(prev_token_ids=own, hidden_states=hidden)
        own[:, k] = ids_out[chained[:, k - 1].argmax(dim=-1)]
    return model.confidence_head(torch.cat([hidden, head.prev_embeddings(own).to(hidden.dtype)], dim=-1))


def confident_prefix_length(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSpec's `_confident_prefix_length` (eval/dspark/draft_ops.py:82-93) for each row of
    [A, B] confidence logits: B when threshold <= 0 or no slot is below it, else the first slot
    with sigmoid < threshold."""
    out = []
    for row in confidence:
        below = torch.nonzero(row.sigmoid() < threshold).flatten()
        out.append(row.numel() if threshold <= 0.0 or below.numel() == 0 else int(below[0]))
    return torch.tensor(out)


def _head_fields(reference) -> dict:
    config = reference.config
    return {
        "rank": config.markov_rank,
        "type": config.markov_head_type,
        "confidence": config.enable_confidence_head,
        "with_markov": config.confidence_head_with_markov,
    }


def _drafter_weights(reference) -> dict:
    """The reference's trained weights (backbone and heads), under the names every layout uses."""
    skip = ("embed_tokens.", "lm_head.", "verifier_", "t2d", "d2t")
    return {k: v.clone().contiguous() for k, v in reference.state_dict().items() if not k.startswith(skip)}


def write_deepspec(save_dir, reference, embed: torch.Tensor, head: torch.Tensor) -> dict:
    """The reference's weights as DeepSpec saves a Qwen3DSparkModel: its config is a copy of the
    target's config with the draft fields set (build_draft_config), serialized as transformers'
    save_pretrained does (use_diff); the weights include its own copies of the target's
    embedding and lm_head (initialize_embeddings_and_head). Returns the config dict."""
    heads = _head_fields(reference)
    draft = copy.deepcopy(qwen3_config(TARGET_LAYERS))
    draft.architectures = ["Qwen3DSparkModel"]
    draft.num_target_layers = TARGET_LAYERS
    draft.num_hidden_layers = reference.config.transformer_layer_config.num_hidden_layers
    draft.block_size = reference.block_size
    draft.tie_word_embeddings = False
    draft.layer_types = ["full_attention"] * draft.num_hidden_layers
    draft.mask_token_id = MASK
    draft.target_layer_ids = list(OUTPUT_IDS)
    draft.num_anchors = 512
    draft.enable_confidence_head = heads["confidence"]
    if heads["confidence"]:
        draft.confidence_head_with_markov = heads["with_markov"]
    draft.markov_rank = heads["rank"]
    if heads["rank"] > 0:
        draft.markov_head_type = heads["type"]
    raw = draft.to_diff_dict()
    state = dict(_drafter_weights(reference), **{"embed_tokens.weight": embed.clone(), "lm_head.weight": head.clone()})
    _write(save_dir, raw, state)
    return raw


def write_specforge(save_dir, reference, legacy_names: bool = False) -> dict:
    """The reference's weights as a SpecForge DSparkDraftModel checkpoint (no embedding, no
    lm_head); `legacy_names` saves the heads under early SpecForge's `logit_head.` container."""
    heads = _head_fields(reference)
    decoder = reference.config.transformer_layer_config.to_diff_dict()
    raw = {k: v for k, v in decoder.items() if k != "transformers_version"}
    options = {
        "attention_mode": "gqa",
        "confidence_head_alpha": 1.0 if heads["confidence"] else 0.0,
        "confidence_head_with_markov": heads["with_markov"] and heads["confidence"],
        "enable_confidence_head": heads["confidence"],
        "markov_head_type": heads["type"],
        "markov_rank": heads["rank"],
        "mask_token_id": MASK,
        "projector_type": "dspark",
        "target_layer_ids": list(OUTPUT_IDS),
    }
    raw.update(
        architectures=["DSparkDraftModel"],
        auto_map={"AutoModel": "dspark.DSparkDraftModel"},
        block_size=reference.block_size,
        num_target_layers=TARGET_LAYERS,
        dflash_config=options,
    )
    state = _drafter_weights(reference)
    if legacy_names:
        state = {
            ("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
            for k, v in state.items()
        }
    _write(save_dir, raw, state)
    return raw


def _write(save_dir, raw: dict, state: dict) -> None:
    os.makedirs(save_dir, exist_ok=True)
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    save_file(state, os.path.join(save_dir, "model.safetensors"))

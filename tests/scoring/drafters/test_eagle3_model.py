"""proposers/eagle3/model.py against the public reference: speculators' own EAGLE-3 drafter,
saved by its save_pretrained and loaded by specreplay's loader, drafts at every anchor and every
step what speculators' training-time-test forward drafts there (step 0 causal over the sequence,
later steps teacher-forced with the diagonal mask), for Llama and Qwen3 layers, two layers, every
norm switch, a reduced vocabulary, on every attention backend; SpecForge's layout of the same
weights loads to the same model. The walk-level parity against an online loop with a real KV
cache is tests/parity/test_eagle3_parity.py."""

from __future__ import annotations

import pytest
import torch

from proposers.checkpoints.load import load_drafter
from tests.helpers.eagle3_reference import save, speculators_eagle3, ttt_logits, write_specforge

VOCAB, HIDDEN, LAYERS = 64, 32, 6
AUX = (1, 3, 5)  # before-layer ids of a 6-layer target
STEPS = 3

CASES = {
    "llama": dict(kind="llama"),
    "qwen3": dict(kind="qwen3"),
    "two-layers": dict(kind="llama", layers=2),
    "norm-before-fc": dict(kind="llama", switches={"norm_before_fc": True, "norm_before_residual": True}),
    "fc-norm-norm-output": dict(kind="qwen3", switches={"fc_norm": True, "norm_output": True}),
    "reduced-vocab": dict(kind="llama", draft_vocab=torch.arange(0, VOCAB, 2)),
}


def _sequence(length: int = 20, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(length, len(AUX) * HIDDEN, generator=generator)
    return features, torch.randint(0, VOCAB, (length,), generator=generator)


def _offline_logits(drafter, features, ids, attention: str) -> torch.Tensor:
    """[A, STEPS, V] the drafter's teacher-forced chain at anchors 1 .. T - STEPS (every input a stored token)."""
    embed = torch.randn(VOCAB, HIDDEN)  # unused: the checkpoint has its own copy of the embedding
    context = drafter.context_kv(features, chunk_rows=7, tokens=ids, embed=embed, attention=attention)
    anchors = torch.arange(1, ids.numel() - STEPS + 1)
    block = ids[anchors[:, None] + torch.arange(STEPS)[None, :]]
    hidden = drafter(drafter.embedding_table(embed)[block], anchors, context, attention=attention)
    return drafter.logits(hidden, None)


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_the_chain_is_speculators_ttt_forward_at_every_anchor(tmp_path, case, attention):
    reference = speculators_eagle3(vocab=VOCAB, hidden=HIDDEN, aux_ids=AUX, steps=STEPS, **CASES[case])
    drafter, info = load_drafter(save(reference, tmp_path), target_layers=LAYERS)
    assert info.config.target_layer_ids == [0, 2, 4] and info.config.block_size == STEPS
    features, ids = _sequence()
    ours = _offline_logits(drafter, features, ids, attention)  # [A, STEPS, V], anchor t = row + 1
    steps = ttt_logits(reference, features, ids)  # per step [T - 1, Vd], row i = anchor i + 1
    for s, expected in enumerate(steps):
        expected = expected[: ours.shape[0]]
        draft = CASES[case].get("draft_vocab")
        if draft is not None:  # ours over the target's vocabulary, -inf outside the draft one
            assert torch.isinf(ours[:, s]).sum() == ours.shape[0] * (VOCAB - draft.numel())
            got = ours[:, s][:, draft]
        else:
            got = ours[:, s]
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), (case, s)


@torch.no_grad()
def test_specforge_layout_loads_the_same_weights(tmp_path):
    reference = speculators_eagle3(vocab=VOCAB, hidden=HIDDEN, aux_ids=AUX, steps=STEPS)
    spec_dir = save(reference, tmp_path / "speculators")
    forge_dir = write_specforge(spec_dir, tmp_path / "specforge", LAYERS)
    spec, spec_info = load_drafter(spec_dir, target_layers=LAYERS)
    forge, forge_info = load_drafter(forge_dir, target_layers=LAYERS)
    assert (forge_info.config.layout, forge_info.config.layer_convention) == ("specforge", "output")
    assert forge_info.config.target_layer_ids == spec_info.config.target_layer_ids == [0, 2, 4]
    assert forge.embed_tokens is None  # SpecForge saves none: the target's is used
    features, ids = _sequence()
    spec.embed_tokens = None  # both read the same (target) embedding
    torch.manual_seed(0)
    a = _offline_logits(spec, features, ids, "dense")
    torch.manual_seed(0)
    b = _offline_logits(forge, features, ids, "dense")
    torch.testing.assert_close(a, b, atol=0, rtol=0)

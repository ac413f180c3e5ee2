"""XPress (speculators `XPressDraftModel`): DFlash's block drafter followed by a causal refiner that
adds a low-rank logit bias to each slot from the token before it, resolved by K Jacobi passes from
the base drafts' argmax (docs/drafter-families.md#xpress). layout.py, config.py, model.py."""

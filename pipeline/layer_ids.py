"""Which target layers feed the drafter. Shared by both stages (pure, no model code)."""

from __future__ import annotations


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash default feature layers: n == 1 gives [L // 2]; otherwise
    round(1 + i * (L - 4) / (n - 1)) for i in 0..n-1 (SPEC §1).

    Layer id i is the OUTPUT of decoder layer i, i.e. transformers' hidden_states[i + 1].
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def parse_layer_ids(text: str) -> list[int]:
    """'1,9,17' -> [1, 9, 17], with a clear error for anything else."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as error:
        raise ValueError(f"--layer-ids must be comma-separated integers like 1,9,17; got {text!r}") from error
    if not ids:
        raise ValueError("--layer-ids is empty")
    if len(set(ids)) != len(ids):
        raise ValueError(f"--layer-ids has duplicates: {text!r}")
    return ids


def check_layer_ids(layer_ids: list[int], num_target_layers: int, where: str = "--layer-ids") -> None:
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"{where}: layer ids {bad} out of range; the target has {num_target_layers} decoder layers "
            f"(valid ids 0..{num_target_layers - 1}; id i is the output of decoder layer i)"
        )

"""Which target layers feed the drafter: the DFlash default formula, parsing `--layer-ids`, the
range check. Shared by both stages (pure, no model code); a drafter config's ids are read by
its declared layout (proposers/ (layout.py of each family, layouts.py)).

Layer id i is the OUTPUT of decoder layer i, i.e. transformers' hidden_states[i + 1].

The semantics, in words: docs/layer-numbering.md.
"""

from __future__ import annotations

from pipeline.common.errors import UserError


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash default feature layers, as the reference DFlash drafter computes them: n == 1 gives
    [L // 2]; otherwise round(1 + i * (L - 4) / (n - 1)) for i in 0..n-1."""
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


NO_LAYERS = "none"  # extract --layer-ids none: no feature layers, the shards hold tokens and top-k only


def parse_layer_ids(text: str, allow_none: bool = False) -> list[int]:
    """'1,9,17' -> [1, 9, 17], with a clear error for anything else; with `allow_none` (extract),
    'none' -> [], no feature layers at all."""
    if allow_none and text.strip().lower() == NO_LAYERS:
        return []
    alternative = f", or {NO_LAYERS} for no feature layers" if allow_none else ""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise UserError(
            f"--layer-ids must be comma-separated integers like 1,9,17{alternative}; got {text!r}"
        ) from None
    if not ids:
        raise UserError(f"--layer-ids is empty; pass comma-separated layer ids like 1,9,17{alternative}")
    if len(set(ids)) != len(ids):
        raise UserError(f"--layer-ids has duplicates: {text!r}; list each layer once")
    return ids


def check_layer_ids(layer_ids: list[int], num_target_layers: int, where: str = "--layer-ids") -> None:
    """Every id names one of the target's decoder layers, or the final hidden state before the
    norm (id L, see final_prenorm_id)."""
    bad = [i for i in layer_ids if not 0 <= i <= num_target_layers]
    if bad:
        raise UserError(
            f"{where}: layer ids {bad} out of range; the target has {num_target_layers} decoder layers "
            f"(valid ids 0..{num_target_layers}; id i is the output of decoder layer i, id {num_target_layers} "
            f"the final hidden state before the final norm)"
        )


def final_prenorm_id(num_target_layers: int) -> int:
    """The stored layer id of the target's final hidden state BEFORE its final norm: L, one past
    the last layer's id. (Id L - 1 is after the norm, as transformers reports the last hidden
    state; speculators' before-layer id L and MTP heads read the pre-norm one.)"""
    return num_target_layers


def requested_layer_ids(settings: dict) -> list[int]:
    """The feature layers an extract was asked for: its stored `layer_ids` without the
    neighbours `extract --neighbour-layers` added (manifest settings.neighbour_layers)."""
    neighbours = settings.get("neighbour_layers") or {}
    return [int(i) for i in neighbours.get("requested", settings["layer_ids"])]

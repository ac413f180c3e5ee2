"""Which captured tensor becomes which stored layer: a producer's layer numbering translated
into this project's (docs/layer-numbering.md), and the stored ids served from what a capture
holds. Pure: numbers in, numbers out.

Every captured tensor is one of three kinds of source, keyed like this:

    i (0 <= i <= L-2)   the output of decoder layer i (transformers' hidden_states[i + 1])
    L  (PRE)            the final hidden state BEFORE the final norm (the last layer's raw output)
    POST                the final hidden state AFTER the final norm (what the lm_head reads)

Producers number them their way:
    "before" (vLLM, speculators): id s is the residual entering layer s: s - 1, and s = L is PRE;
    "output" (SpecForge, sglang): id s is the output of layer s: s, and s = L - 1 (the last
              layer's output, taken before the norm) is PRE.
A separately stored final hidden state (SpecForge's `hidden_state`) is POST.

Stored id L - 1 is POST on targets that tie their last hidden state to the norm output
(transformers 5's default, see pipeline/extract/capture.py), else PRE; POST is computed as
norm(PRE) when a capture holds only PRE. PRE cannot be recovered from POST.
"""

from __future__ import annotations

from pipeline.common.errors import UserError

POST = "post"
CONVENTIONS = {
    "before": "vLLM/speculators numbering (id s = the residual entering layer s)",
    "output": "SpecForge numbering (id s = the output of layer s)",
}


def source_of(stated: int, convention: str, num_layers: int, where: str) -> int:
    """The source key (a decoder layer id, or L for PRE) of a layer a producer calls `stated`."""
    last = num_layers - 1
    if convention == "before" and 1 <= stated <= num_layers:
        return num_layers if stated == num_layers else stated - 1
    if convention == "output" and 0 <= stated <= last:
        return num_layers if stated == last else stated
    valid = "1.." + str(num_layers) if convention == "before" else f"0..{last}"
    raise UserError(
        f"{where}: captured layer id {stated} has no stored equivalent in {CONVENTIONS[convention]}; "
        f"valid ids are {valid} for this {num_layers}-layer target"
        + (" (id 0, the embedding output, is never stored)" if convention == "before" and stated == 0 else "")
    )


def sources_of(stated: list[int], convention: str, num_layers: int, where: str) -> list[int]:
    """source_of for every id of a capture's feature block, in its order (a layer captured twice,
    as speculators' default [2, L // 2, L - 3, L] does on a 6-layer target, is read once)."""
    return [source_of(s, convention, num_layers, where) for s in stated]


def source_for(layer_id: int, num_layers: int, ties_norm: bool):
    """The source a stored layer id is served from: itself, PRE (id L), or for id L - 1 POST
    (targets tying their last hidden state to the norm output) or PRE (the others)."""
    if layer_id == num_layers - 1:
        return POST if ties_norm else num_layers
    return layer_id


def servable(held: set, num_layers: int) -> set:
    """The sources a capture can serve: what it holds, plus POST when it holds PRE."""
    return held | ({POST} if num_layers in held else set())


def missing_layers(wanted: list[int], held: set, num_layers: int, ties_norm: bool) -> list[int]:
    """The wanted stored ids a capture holding the sources `held` cannot serve."""
    have = servable(held, num_layers)
    return [i for i in wanted if source_for(i, num_layers, ties_norm) not in have]


def default_layers(held: set, num_layers: int) -> list[int]:
    """What to store when no --layer-ids are given: every captured decoder layer, ascending; the
    final hidden state serves the top-k and is stored only when asked for (id L or L - 1)."""
    return sorted(k for k in held if k != POST and k < num_layers)


def describe_held(held: set, num_layers: int) -> str:
    """'layers 1, 14, 26 and the final hidden state before the norm (id 30)' for messages."""
    layers = [str(k) for k in sorted(k for k in held if k != POST and k < num_layers)]
    finals = []
    if num_layers in held:
        finals.append(f"the final hidden state before the norm (id {num_layers})")
    if POST in held:
        finals.append("the final hidden state after the norm")
    parts = ([f"layers {', '.join(layers)}"] if layers else []) + finals
    return " and ".join(parts) if parts else "no layers"

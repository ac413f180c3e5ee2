"""What extract stores per sample, from one full-sequence forward: the feature layers (through
forward hooks) and the next-token distribution (lm_head over fixed-size windows of positions).

What is stored for a sample of N tokens (prompt_len P, R = N - P response tokens):

    features         [N, n*H]  storage dtype  layer ids in list order, concatenated on the last dim;
                                              absent with no layer ids (--layer-ids none); a DeepSeek-V4
                                              target's id L alone: its streams [N, hc*H] (stream_layer_ids)
    features_scale   [N, n]    float32        only with fp8 features: per token and layer (shards.quantize_fp8)
    topk_ids         [R+1, k]  int32          row i: top-k of the distribution of token P+i
    topk_logprobs    [R+1, k]  float32        log_softmax of the logits (computed in float32)
    argmax_mismatch  [R]       uint8          1 where argmax of row i != stored token P+i
    sample_logprob   [R]       float32        only at temperature > 0: log p_{P+i}(token P+i) under the
                                              sampling distribution (pipeline.common.sampling) of row i;
                                              -inf where that token has probability 0 there

Layer id i is transformers' `hidden_states[i + 1]`, which is what the reference DFlash loop
feeds its drafter. For i < L-1 that is the output of decoder layer i, captured by a forward hook
on that layer only (all L+1 hidden states are never requested). For the last layer, L-1,
transformers 5 replaces `hidden_states[L]` with the final-norm output (`tie_last_hidden_states`),
so that id is taken from the decoder's `last_hidden_state`, not from the layer's raw output.

The batch is always one unpadded sequence, so stored values equal a plain single-sequence forward
bit for bit (a padded batch would differ in the last bits). On the CPU that forward runs its
layers over fixed-size windows of positions (pipeline.extract.chunked_forward: same bits, a working set
that does not grow with N), and each feature layer goes straight into the stored features
(FeatureSink). The lm_head runs over fixed-size windows of positions, never over [N, V]; see
`head_windows` for why the windows all have the same size.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pipeline import shards
from pipeline.common import timing
from pipeline.common.errors import UserError
from pipeline.common.sampling import Sampling, token_logprob
from pipeline.extract.chunked_forward import MIN_WINDOW_ROWS, forward_rows, row_windows, windowed_forward
from pipeline.extract.generate import model_device
from pipeline.extract.target import decoder_layers, text_config, text_decoder

# The lm_head's windows follow the forward's rules (pipeline.extract.chunked_forward): all of one size,
# never fewer rows than CPU BLAS needs to round like the full forward.
MIN_HEAD_ROWS = MIN_WINDOW_ROWS
head_windows = row_windows

MAX_HEAD_ROWS = 8192
# Bytes per logit row element while a window is live: model-dtype logits, a float32 copy,
# its log_softmax and topk's scratch.
_BYTES_PER_LOGIT = 16
# More per element while sample_logprob is computed on the window (sampling_probs): scores / T
# and the scattered probabilities; a full-vocabulary top-p also holds the sorted probabilities,
# their int64 order, the cumsum, the mask and the renormalised copy.
_SAMPLING_BYTES_PER_LOGIT = 8
_SORTED_SAMPLING_BYTES_PER_LOGIT = 48


@dataclass
class CaptureConfig:
    layer_ids: list[int]  # [] stores no features (--layer-ids none)
    feature_dtype: torch.dtype | None  # None with no layer ids
    top_k: int = 32
    head_budget_bytes: int = 1 << 30  # memory for one lm_head window or one forward window; sets their rows
    sampling: Sampling | None = None  # temperature > 0: also store sample_logprob
    windowed: bool = True  # the forward over windows of positions (pipeline.extract.chunked_forward); False: one pass


def head_rows(vocab_size: int, budget_bytes: int, bytes_per_logit: int = _BYTES_PER_LOGIT) -> int:
    """Rows per lm_head window so that one window's logits and softmax fit `budget_bytes`."""
    rows = budget_bytes // max(1, vocab_size * bytes_per_logit)
    return int(min(MAX_HEAD_ROWS, max(MIN_HEAD_ROWS, rows)))


def window_bytes_per_logit(sampling: Sampling | None, vocab_size: int) -> int:
    """Bytes per window element: the top-k capture's, plus sampling_probs' scratch when sampling.
    With 0 < top_k < V the top-p sort runs over k columns only; without a top-k filter and with
    top-p < 1 it sorts whole rows, so the window holds fewer rows to stay within the budget."""
    if sampling is None:
        return _BYTES_PER_LOGIT
    sorts_rows = not 0 < sampling.top_k < vocab_size and sampling.top_p < 1
    return _BYTES_PER_LOGIT + (_SORTED_SAMPLING_BYTES_PER_LOGIT if sorts_rows else _SAMPLING_BYTES_PER_LOGIT)


def postprocess_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """What the model's own forward does after its lm_head (Gemma softcap, Cohere/Granite scale)."""
    scale = getattr(config, "logit_scale", None)
    if scale is not None:
        logits = logits * scale
    divide = getattr(config, "logits_scaling", None)
    if divide is not None:
        logits = logits / divide
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def ties_last_hidden_state(decoder) -> bool:
    """Whether transformers reports the final-norm output as the last hidden state (see module doc)."""
    tie = getattr(getattr(decoder, "config", None), "tie_last_hidden_states", None)
    return True if tie is None else bool(tie)


def stream_layer_ids(text, num_layers: int, layer_ids: list[int]) -> set[int]:
    """The stored ids kept as hyper-connection streams: id L of a DeepSeek-V4 target (`hc_mult` streams),
    flat [N, hc * H], what its MTP head reads (vLLM deepseek_v4/nvidia/model.py:1036-1038, llama.cpp
    src/models/deepseek4.cpp:1334-1341). Its width is not the other ids', so it is stored alone."""
    hc = getattr(text, "hc_mult", None)
    if not hc or num_layers not in layer_ids:
        return set()
    if len(layer_ids) > 1:
        others = [i for i in layer_ids if i != num_layers]
        raise UserError(
            f"--layer-ids {','.join(map(str, layer_ids))}: id {num_layers} of this hyper-connection target is stored as "
            f"its {hc} streams ({hc} x hidden_size wide, what DeepSeek-V4's MTP head reads), which cannot share the "
            f"features with layers {others}; extract id {num_layers} alone into its own output directory"
        )
    return {num_layers}


@contextmanager
def layer_outputs(layers: torch.nn.ModuleList, hooks: list[tuple[int, int]], put, streams: set[int] = frozenset()):
    """Forward hooks on just the layers of `hooks` [(layer index, stored layer id)], each handing
    its output [T, H] to `put(stored id, output)` at once (the windowed forward overwrites it with
    the next layer's). Two ids may come from one layer (the last one's output, stored as id L - 1
    and as id L, the final hidden state before the norm). DeepSeek-V4's outputs are hyper-connection
    streams [T, hc, H]: stored as their mean, as vLLM (deepseek_v4/nvidia/model.py:1006-1011) and
    llama.cpp (src/models/deepseek4.cpp:269, 1239-1241) hand them to a drafter, or flat [T, hc * H]
    for the ids in `streams` (stream_layer_ids)."""
    handles = []

    def hook_for(layer_id):
        def hook(module, args, output):
            hidden = (output[0] if isinstance(output, (tuple, list)) else output)[0]
            if hidden.dim() == 3:
                hidden = hidden.flatten(-2) if layer_id in streams else hidden.mean(dim=-2)
            put(layer_id, hidden)

        return hook

    try:
        for index, layer_id in sorted(set(hooks)):
            handles.append(layers[index].register_forward_hook(hook_for(layer_id)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def window_logits(hidden: torch.Tensor, head: torch.nn.Module, config, lo: int, rows: int):
    """float32 logits of rows lo..T-1 of `hidden` [T, H], one window of positions at a time
    (after the model's own softcap/scale), as the model's forward computes them."""
    total = hidden.shape[0]
    for begin, end, keep in head_windows(lo, total, total, rows):
        yield postprocess_logits(head(hidden[begin:end].to(head.weight.device)), config)[keep - begin :].float()


def next_token_distribution(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    config,
    lo: int,
    targets: torch.Tensor,
    top_k: int,
    rows: int,
    sampling: Sampling | None = None,
) -> dict[str, torch.Tensor]:
    """Top-k and argmax mismatches for rows lo..T-1 of `hidden` [T, H]; with `sampling`, also
    sample_logprob, the log-probability of each stored token under the sampling distribution.

    `targets` [T - lo - 1] are the stored tokens at positions lo+1..T-1 (row lo+i predicts
    position lo+i+1). log_softmax runs in float32 whatever the model dtype; argmax is taken on
    the logits themselves, as greedy decoding does. sample_logprob comes from the same window
    logits, so it is the full forward's value, not the cached decoding's the token was drawn from.
    """
    ids, logprobs, argmax, sampled = [], [], [], []
    done = 0  # rows of earlier windows: where this window's targets start
    with timing.stage("next-token distribution", rows=hidden.shape[0] - lo):
        for logits in window_logits(hidden, head, config, lo, rows):
            argmax.append(logits.argmax(dim=-1).cpu())
            values, indices = torch.topk(torch.log_softmax(logits, dim=-1), top_k, dim=-1)
            ids.append(indices.to(torch.int32).cpu())
            logprobs.append(values.cpu())
            if sampling is not None:  # the last row predicts past the end: it has no target
                mine = targets[done : done + logits.shape[0]].to(logits.device)
                sampled.append(token_logprob(logits[: mine.shape[0]], mine, sampling).cpu())
            done += logits.shape[0]
    best = torch.cat(argmax)
    out = {
        "topk_ids": torch.cat(ids),
        "topk_logprobs": torch.cat(logprobs),
        "argmax_mismatch": (best[:-1] != targets.cpu()).to(torch.uint8),
    }
    if sampling is not None:
        out["sample_logprob"] = torch.cat(sampled)
    return out


class FeatureSink:
    """The stored features [N, n*H] (and with fp8 the scales [N, n]) on the CPU, each layer
    written in storage form as soon as the forward produces it, `rows` positions at a time, so
    neither a [N, H] copy per layer nor a full-size cast is ever held beside them."""

    def __init__(self, tokens: int, hidden: int, layer_ids: list[int], feature_dtype: torch.dtype, rows: int):
        self.layer_ids, self.hidden, self.rows = layer_ids, hidden, rows
        self.features = torch.empty(tokens, len(layer_ids) * hidden, dtype=feature_dtype)
        fp8 = feature_dtype == torch.float8_e4m3fn  # lossy opt-in: one scale per token and layer
        self.scale = torch.empty(tokens, len(layer_ids), dtype=torch.float32) if fp8 else None

    def put(self, layer_id: int, hidden: torch.Tensor) -> None:
        """Store `hidden` [N, H] as every column group of `layer_id`."""
        for column, wanted in enumerate(self.layer_ids):
            if wanted == layer_id:
                for begin in range(0, hidden.shape[0], self.rows):
                    self._write(column, begin, hidden[begin : begin + self.rows])

    def _write(self, column: int, begin: int, part: torch.Tensor) -> None:
        rows, columns = slice(begin, begin + part.shape[0]), slice(column * self.hidden, (column + 1) * self.hidden)
        if self.scale is None:
            self.features[rows, columns] = part  # the cast and the copy to the CPU, per element
            return
        values, scale = shards.quantize_fp8(part)  # per token: a window equals the whole
        self.features[rows, columns] = values
        self.scale[rows, column] = scale[:, 0]

    def tensors(self) -> dict[str, torch.Tensor]:
        if not self.layer_ids:  # --layer-ids none: tokens and top-k only, no features tensor
            return {}
        if self.scale is None:
            return {"features": self.features}
        return {"features": self.features, "features_scale": self.scale}


def _where_bad(what: str, bad: torch.Tensor, first_position: int = 0) -> dict:
    """{what, position (the first bad row's, offset by first_position), count (bad rows), length
    (rows checked)} of a [rows, ...] bool tensor holding at least one True."""
    rows = bad.reshape(bad.shape[0], -1).any(dim=-1)
    first = int(rows.nonzero()[0, 0])
    return {"what": what, "position": first_position + first, "count": int(rows.sum()), "length": rows.numel()}


def nonfinite_values(tensors: dict[str, torch.Tensor], layer_ids: list[int] | None, prompt_len: int) -> dict | None:
    """Where a captured sample holds NaN/Inf (fp16 overflow is the usual cause): None when it
    is finite, else {"what": "layer 3 features" | "logits", "position": the first bad token
    position, "count": how many positions are bad, "length": of how many}.

    Checked on what would be stored, so an overflow of the storage cast (fp32 model, fp16
    features) counts too. Features: row = token position, layers in ascending id (`layer_ids` in
    stored order; None: one block, reported as "features"). Logits: NaN or +inf in the stored
    top-k log-probs or sample_logprob (-inf there is probability 0, not an error), at the
    position whose next-token distribution it is, prompt_len - 1 + row. A NaN computed at one
    position usually reaches every position (attention multiplies it by zero weights), so
    `count` tells one overflowing token from a poisoned sample. The common, finite case costs
    one reduction per tensor."""
    if "features" in tensors:  # absent with --layer-ids none
        bad = nonfinite_features(tensors["features"], tensors.get("features_scale"), layer_ids)
        if bad is not None:
            return bad
    for name in ("topk_logprobs", "sample_logprob"):
        logprobs = tensors.get(name)
        if logprobs is None:
            continue
        bad = torch.isnan(logprobs) | torch.isposinf(logprobs)
        if bool(bad.any()):
            return _where_bad("logits", bad, prompt_len - 1)
    return None


def nonfinite_features(features: torch.Tensor, scale: torch.Tensor | None, layer_ids: list[int] | None) -> dict | None:
    """nonfinite_values' report of the first layer (ascending id) whose features [N, n*H] (or fp8
    scales [N, n]) hold NaN/Inf; None when all are finite."""
    values = features.float() if features.dtype == torch.float8_e4m3fn else features  # e4m3fn: NaN only
    if bool(torch.isfinite(values).all()) and (scale is None or bool(torch.isfinite(scale).all())):
        return None
    groups = [None] if layer_ids is None else layer_ids
    width = values.shape[-1] // len(groups)
    for column, layer_id in sorted(enumerate(groups), key=lambda pair: pair[1] or 0):
        bad = ~torch.isfinite(values[:, column * width : (column + 1) * width])
        if scale is not None:
            mine = scale if layer_id is None else scale[:, column : column + 1]
            bad = bad | ~torch.isfinite(mine).all(dim=-1, keepdim=True)
        if bool(bad.any()):
            return _where_bad("features" if layer_id is None else f"layer {layer_id} features", bad)
    return None


@torch.inference_mode()
def capture_features(model, input_ids: list[int], config: CaptureConfig) -> tuple[dict, torch.Tensor]:
    """The stored features of one sequence ({"features"[, "features_scale"]}, see the module
    docstring) and the final-norm output [N, H] the lm_head reads."""
    decoder = text_decoder(model)
    layers = decoder_layers(model)
    last = len(layers) - 1
    from_norm = ties_last_hidden_state(decoder)
    # id L (one past the last layer) is the last layer's own output: the final hidden state before the norm
    hooked = [(min(i, last), i) for i in config.layer_ids if not (i == last and from_norm)]
    ids = torch.tensor([input_ids], dtype=torch.long, device=model_device(model))
    text, itemsize = text_config(model), next(decoder.parameters()).element_size()
    rows = forward_rows(text, config.head_budget_bytes, itemsize, len(input_ids))
    streams = stream_layer_ids(text, len(layers), config.layer_ids)
    width = text.hidden_size * (text.hc_mult if streams else 1)
    sink = FeatureSink(len(input_ids), width, config.layer_ids, config.feature_dtype, rows)
    with (
        layer_outputs(layers, hooked, sink.put, streams),
        windowed_forward(decoder, layers, rows if config.windowed else 0, ids.device),
    ):
        final = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]  # [N, H], final-norm output
    if from_norm and last in config.layer_ids:
        sink.put(last, final)
    return sink.tensors(), final


@torch.inference_mode()
def capture_sample(model, input_ids: list[int], prompt_len: int, config: CaptureConfig) -> dict[str, torch.Tensor]:
    """All stored tensors of one sample (see the module docstring for shapes and meaning)."""
    if not 1 <= prompt_len <= len(input_ids):
        raise ValueError(f"prompt_len {prompt_len} outside 1..{len(input_ids)}")
    with timing.stage("capture", tokens=len(input_ids), response_tokens=len(input_ids) - prompt_len):
        tensors, final = capture_features(model, input_ids, config)
        head = model.get_output_embeddings()
        vocab = head.weight.shape[0]
        tensors.update(
            next_token_distribution(
                final,
                head,
                text_config(model),
                prompt_len - 1,
                torch.tensor(input_ids[prompt_len:], dtype=torch.long, device=final.device),
                min(config.top_k, vocab),
                head_rows(vocab, config.head_budget_bytes, window_bytes_per_logit(config.sampling, vocab)),
                config.sampling,
            )
        )
    return tensors

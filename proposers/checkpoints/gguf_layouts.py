"""The inverse of llama.cpp's convert_hf_to_gguf.py for each drafter family it writes: a GGUF's
keys and tensors back to the config.json and tensor names of the layout whose meaning llama.cpp
runs (docs/gguf-drafters.md has the tables).

- `dflash` (conversion/qwen.py DFlashModel, DSparkModel): z-lab's DFlash layout, z-lab's DFlash2
  layout (its conv and selector keys), and DSpark's (a Markov head): DeepSpec's layout when the
  drafter has its own token embedding, speculators' otherwise. Target layer ids are stored as
  hidden-state indices (the output of layer i is i + 1): speculators' own numbering, z-lab's and
  DeepSpec's plus one. No Q/K permutation.
- `eagle3` (conversion/llama.py LlamaModel): speculators' EAGLE-3 layout with Llama layers, whose
  numbering and switches (norm_before_residual, norm_before_fc) are the ones llama.cpp stores; the
  ids are verbatim, q_proj and k_proj rows were permuted for ggml's interleaved RoPE and are put
  back. llama.cpp feeds the pre-norm hidden state to the next step, as speculators' default does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from proposers.checkpoints.files import CheckpointError
from proposers.checkpoints.gguf_file import GgufFile, Strings, tensor_values

DOCS = "docs/gguf-drafters.md"
# A decoder layer's tensors, `blk.{i}.<GGUF suffix>` -> `layers.{i}.<checkpoint suffix>`
LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
DFLASH2_LAYER = {
    "attn_conv_base": "attention_conv.base_kernel",
    "attn_conv_proj.weight": "attention_conv.kernel_projection.weight",
    "ffn_conv_base": "mlp_conv.base_kernel",
    "ffn_conv_proj.weight": "mlp_conv.kernel_projection.weight",
}
EAGLE3_LAYER = {"attn_norm_2.weight": "hidden_norm.weight"}
# Global tensors, GGUF -> checkpoint
DFLASH = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight"}
DFLASH2 = {
    "selector_predecessor.weight": "candidate_selector.predecessor_codebook",
    "selector_successor.weight": "candidate_selector.successor_codebook",
    "selector_hidden.weight": "candidate_selector.hidden_projection.weight",
}
DSPARK = {
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "conf_proj.weight": "confidence_head.proj.weight",
    "conf_proj.bias": "confidence_head.proj.bias",
    "token_embd.weight": "embed_tokens.weight",
    "output.weight": "lm_head.weight",
}
EAGLE3 = {
    "fc.weight": "fc.weight",
    "enc.output_norm.weight": "input_norm.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
    "token_embd.weight": "embed_tokens.weight",
}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# z-lab's dflash_config fields the converter writes under these keys
ZLAB_SCALES = {
    "logit_scale": "output_multiplier",
    "final_logit_softcapping": "final_logit_softcapping",
    "embedding_scale": "input_embedding_scale",
    "attention.value_scale": "attention_value_scale",
}
# DeepSpec's `num_anchors` (anchors drawn per training sequence) is training-only and not in the
# GGUF; its layout requires the field, so the read-back config states this neutral value
DEEPSPEC_NUM_ANCHORS = 1


@dataclass
class Metadata:
    """The file's `<arch>.*` keys, each one read marked, so that a key no reader took is refused."""

    file: GgufFile
    arch: str
    read: set[str] = field(default_factory=set)

    @property
    def path(self) -> str:
        return self.file.path

    def get(self, key: str, default=None):
        name = f"{self.arch}.{key}"
        self.read.add(name)
        return self.file.metadata.get(name, default)

    def need(self, key: str):
        value = self.get(key)
        if value is None:
            raise CheckpointError(
                f"{self.path}: no GGUF key '{self.arch}.{key}', which llama.cpp's converter writes for every "
                f"{self.arch} drafter; the file was not written by convert_hf_to_gguf.py: convert the drafter with it"
            )
        return value

    def check_all_read(self, label: str) -> None:
        unread = sorted(k for k in self.file.metadata if k.startswith(f"{self.arch}.") and k not in self.read)
        if unread:
            raise CheckpointError(
                f"{self.path}: GGUF key {unread[0]!r} (= {self.file.metadata[unread[0]]!r}) is not one specreplay reads "
                f"back for a {label} drafter ({DOCS}); refusing rather than scoring the drafter without it. Score "
                f"the checkpoint directory it was converted from"
            )


@dataclass(frozen=True)
class Reading:
    """A drafter GGUF read back: the config.json of its layout, and each of its tensors (by the
    layout's names) as a function reading it from the file."""

    config: dict
    tensors: dict[str, Callable[[], torch.Tensor]]


# --------------------------------------------------------------------------- what every reader shares


def f32(value: float) -> float:
    """A GGUF float32 as the decimal it was written from (1e-06, not 9.999999974752427e-07)."""
    return float(str(np.float32(value)))


def vocabulary_size(meta: Metadata) -> int:
    """The drafter's vocab_size: `<arch>.vocab_size`, else the tokenizer's token count (the
    converter pads the target's tokenizer to the drafter's vocab_size)."""
    size = meta.get("vocab_size")
    tokens = meta.file.key("tokenizer.ggml.tokens")
    if size is None and isinstance(tokens, Strings):
        size = len(tokens)
    if size is None:
        raise CheckpointError(
            f"{meta.path}: neither '{meta.arch}.vocab_size' nor tokenizer.ggml.tokens gives the vocabulary size; "
            f"convert the drafter with convert_hf_to_gguf.py --target-model-dir TARGET_DIR"
        )
    return int(size)


def decoder_fields(meta: Metadata) -> dict:
    """The decoder's config fields (transformers' names) from the GGUF's generic keys."""
    heads, hidden = meta.need("attention.head_count"), meta.need("embedding_length")
    head_dim = meta.get("attention.key_length", hidden // heads)
    if meta.get("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(
            f"{meta.path}: '{meta.arch}.attention.value_length' differs from key_length {head_dim}; no drafter "
            f"specreplay reads has values and keys of different widths"
        )
    fields = dict(
        vocab_size=vocabulary_size(meta),
        hidden_size=hidden,
        intermediate_size=meta.need("feed_forward_length"),
        num_hidden_layers=meta.need("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=meta.get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=f32(meta.need("attention.layer_norm_rms_epsilon")),
    )
    if (theta := meta.get("rope.freq_base")) is not None:
        fields["rope_theta"] = f32(theta)
    if (positions := meta.get("context_length")) is not None:
        fields["max_position_embeddings"] = positions
    rotary = meta.get("rope.dimension_count", head_dim)
    if rotary != head_dim:  # refused by name by the families: the engines rotate part of each head
        fields["partial_rotary_factor"] = rotary / head_dim
    return fields


def tensor(file: GgufFile, name: str) -> Callable[[], torch.Tensor]:
    """Reads the GGUF tensor `name` as torch: F32, F16 and integers as stored, BF16 as bfloat16,
    quantized types dequantized to float32."""
    entry = file.tensors[name]

    def read() -> torch.Tensor:
        values = torch.from_numpy(np.array(tensor_values(file, entry)))  # a copy: writable, the file closed
        return values.to(torch.bfloat16) if entry.kind == GGMLQuantizationType.BF16 else values

    return read


def renamed(file: GgufFile, names: dict[str, str], layer: dict[str, str], label: str) -> dict:
    """Checkpoint name -> reader of its GGUF tensor, for the global tensors `names` and the layer
    tensors `layer` (suffixes of `blk.{i}.`, as `layers.{i}.`); `d2t` is left to id_maps, and a
    tensor neither names is refused by name."""
    readers = {}
    for name in file.tensors:
        block, index, suffix = (name.split(".", 2) + ["", ""])[:3]
        if name in names:
            readers[names[name]] = tensor(file, name)
        elif block == "blk" and index.isdigit() and suffix in layer:
            readers[f"layers.{index}.{layer[suffix]}"] = tensor(file, name)
        elif name != "d2t":
            raise CheckpointError(
                f"{file.path}: tensor {name!r} is not part of a {label} drafter as specreplay reads it back ({DOCS}); "
                f"refusing rather than scoring the drafter without it. Score the checkpoint directory it was "
                f"converted from"
            )
    return readers


def id_maps(file: GgufFile, vocab: int) -> tuple[int, dict]:
    """(the draft vocabulary size, readers of `d2t` and `t2d`): the converter stores d2t as absolute
    target ids and drops t2d; speculators' d2t is relative (target id - draft id) and its t2d marks
    the target ids drafted. A d2t over the whole vocabulary mapping every id to itself is no reduction."""
    entry = file.tensors.get("d2t")
    if entry is None:
        return vocab, {}
    absolute = np.array(tensor_values(file, entry), dtype=np.int64).reshape(-1)  # a writable copy
    if absolute.size == vocab and np.array_equal(absolute, np.arange(vocab)):
        return vocab, {}
    in_range = absolute.size < vocab and absolute.min() >= 0 and absolute.max() < vocab
    if not in_range or np.unique(absolute).size != absolute.size:
        raise CheckpointError(
            f"{file.path}: tensor 'd2t' ({absolute.size} ids) is not a draft vocabulary of the {vocab}-token target "
            f"(ids out of range or repeated); the file is corrupt: convert the drafter again"
        )

    def t2d() -> torch.Tensor:
        marks = torch.zeros(vocab, dtype=torch.bool)
        marks[torch.from_numpy(absolute)] = True
        return marks

    relative = absolute - np.arange(absolute.size, dtype=np.int64)
    return int(absolute.size), {"d2t": lambda: torch.from_numpy(relative.copy()), "t2d": t2d}


# --------------------------------------------------------------------------- dflash: DFlash, DFlash2, DSpark


def read_dflash(meta: Metadata) -> tuple[str, Reading]:
    """(the family's label, the reading) of a `dflash` GGUF: DSpark when it has a Markov head,
    DFlash2 when it has DFlash2's keys, else DFlash."""
    file = meta.file
    shape = decoder_fields(meta)
    decoder = {"model_type": "qwen3", **shape, **block_attention(meta, shape)}
    block = dict(block_size=meta.need("block_size"), mask_token_id=mask_token(meta), hidden_ids=hidden_ids(meta))
    if "markov_w1.weight" in file.tensors:
        return "DSpark", read_dspark(meta, decoder, **block)
    if meta.get("sample_from_anchor") is not None or meta.get("has_confidence_head") is not None:
        raise CheckpointError(
            f"{meta.path}: a DSpark GGUF without a Markov head (no markov_w1.weight): llama.cpp runs it as a plain "
            f"DFlash drafter, which is not what it was trained as; specreplay does not read it back ({DOCS})"
        )
    dflash2 = meta.get("conv_kernel_size") is not None
    for name in ("token_embd.weight", "output.weight"):
        if name in file.tensors:
            raise CheckpointError(
                f"{meta.path}: tensor {name!r} in a DFlash GGUF: the converter writes the target's embedding and head "
                f"only for a drafter that ships mask_embedding.pt, whose vector replaces the mask token's embedding; "
                f"specreplay embeds the mask slots with the target's own row, so it refuses rather than scoring it wrong"
            )
    return ("DFlash2" if dflash2 else "DFlash"), read_zlab(meta, decoder, dflash2, **block)


def mask_token(meta: Metadata) -> int:
    mask = meta.file.key("tokenizer.ggml.mask_token_id")
    if mask is None:
        raise CheckpointError(
            f"{meta.path}: no tokenizer.ggml.mask_token_id: llama.cpp's converter writes it from the drafter's "
            f"dflash_config.mask_token_id only (a top-level mask_token_id is not read for DFlash); put it in "
            f"dflash_config of the drafter's config.json and convert again"
        )
    return int(mask)


def hidden_ids(meta: Metadata) -> list[int]:
    """`dflash.target_layers`: hidden-state indices, the output of layer i being i + 1."""
    ids = target_layers(meta)
    if min(ids) < 1:
        raise CheckpointError(
            f"{meta.path}: '{meta.arch}.target_layers' {ids} lists 0, the embedding output, which specreplay "
            f"does not store; only decoder layer outputs (1 and up) can be scored"
        )
    return ids


def target_layers(meta: Metadata) -> list[int]:
    """`<arch>.target_layers`, each layer once."""
    stated = meta.need("target_layers")
    ids = [int(i) for i in stated] if isinstance(stated, list) else []
    if not ids or len(set(ids)) != len(ids):
        raise CheckpointError(
            f"{meta.path}: '{meta.arch}.target_layers' is {stated}; expected each feature layer once. For EAGLE-3 the "
            f"converter writes its default [2, L // 2, L - 3] unless the drafter's config.json has a top-level "
            f"eagle_aux_hidden_state_layer_ids (SpecForge's nested eagle_config one is not read): add it and convert again"
        )
    return ids


def block_attention(meta: Metadata, shape: dict) -> dict:
    """The decoder's attention fields: causality inside the block, sliding windows (the
    converter's inverse: its window on the layers its pattern marks), M-RoPE's degenerate sections."""
    fields = {}
    if (causal := meta.get("attention.causal")) is not None:
        fields["is_causal"] = bool(causal)
    if window := meta.get("attention.sliding_window"):
        pattern = meta.get("attention.sliding_window_pattern") or []
        types = ["sliding_attention" if swa else "full_attention" for swa in pattern]
        fields.update(use_sliding_window=True, sliding_window=window, layer_types=types)
    sections = meta.get("rope.dimension_sections")
    rotary = round(shape["head_dim"] * shape.get("partial_rotary_factor", 1))
    if sections is not None and list(sections) != [rotary // 2, 0, 0, 0]:  # [n/2, 0, 0, 0]: plain RoPE on positions
        raise CheckpointError(
            f"{meta.path}: '{meta.arch}.rope.dimension_sections' {list(sections)}: M-RoPE over several position "
            f"axes, which specreplay does not replay (a drafter of an M-RoPE target stores [{rotary // 2}, 0, 0, 0])"
        )
    return fields


def read_zlab(meta: Metadata, decoder: dict, dflash2: bool, block_size: int, mask_token_id: int, hidden_ids) -> Reading:
    """z-lab's DFlash or DFlash2 layout: the decoder at the top level, the DFlash fields in dflash_config."""
    options = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": [i - 1 for i in hidden_ids],
    }
    if dflash2:
        options.update({key: meta.need(key) for key in DFLASH2_KEYS})
    for key, name in ZLAB_SCALES.items():
        if (value := meta.get(key)) is not None:
            options[name] = f32(value)
    architecture = "DFlash2DraftModel" if dflash2 else "DFlashDraftModel"
    config = {"architectures": [architecture], **decoder, "dflash_config": options}
    names, layer = (DFLASH | DFLASH2, LAYER | QK_NORMS | DFLASH2_LAYER) if dflash2 else (DFLASH, LAYER | QK_NORMS)
    return Reading(config, renamed(meta.file, names, layer, "DFlash2" if dflash2 else "DFlash"))


def read_dspark(meta: Metadata, decoder: dict, block_size: int, mask_token_id: int, hidden_ids) -> Reading:
    """DSpark: DeepSpec's layout when the drafter has its own token embedding (its lm_head, dropped
    by the converter for a full vocabulary, is that embedding, as llama.cpp takes it), else
    speculators' (the target's embedding; its own lm_head over a reduced vocabulary, d2t)."""
    file = meta.file
    rank = file.tensors["markov_w1.weight"].shape[-1]
    confidence = file.tensors.get("conf_proj.weight")
    with_markov = confidence is not None and confidence.shape[-1] == decoder["hidden_size"] + rank
    meta.get("has_confidence_head")  # the tensors say it (llama.cpp's loader reads them, not the key)
    heads = dict(
        sample_from_anchor=bool(meta.get("sample_from_anchor", True)),
        markov_rank=rank,
        markov_head_type="vanilla",  # the converter refuses every other
        enable_confidence_head=confidence is not None,
    )
    if confidence is not None:
        heads["confidence_head_with_markov"] = with_markov
    tensors = renamed(file, DFLASH | DSPARK, LAYER | QK_NORMS, "DSpark")
    draft_vocab, maps = id_maps(file, decoder["vocab_size"])
    if "token_embd.weight" not in file.tensors:
        config = {
            "speculators_model_type": "dspark",
            "transformer_layer_config": decoder,
            "aux_hidden_state_layer_ids": list(hidden_ids),
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "draft_vocab_size": draft_vocab,
            **heads,
        }
        return Reading(config, {**tensors, **maps})
    if maps:
        raise CheckpointError(
            f"{meta.path}: a DSpark GGUF with its own token embedding and a reduced draft vocabulary (d2t): no "
            f"layout specreplay reads has both (DeepSpec's has the embedding, speculators' the reduced vocabulary)"
        )
    tensors.setdefault("lm_head.weight", tensors["embed_tokens.weight"])  # dflash.cpp: output := token_embd
    config = {
        "architectures": ["Qwen3DSparkModel"],
        **decoder,
        "block_size": block_size,
        "mask_token_id": mask_token_id,
    }
    config.update(target_layer_ids=[i - 1 for i in hidden_ids], num_anchors=DEEPSPEC_NUM_ANCHORS, **heads)
    return Reading(config, tensors)


# --------------------------------------------------------------------------- eagle3


def read_eagle3(meta: Metadata) -> tuple[str, Reading]:
    """speculators' EAGLE-3 layout with Llama layers; q_proj/k_proj rows put back in HF's order."""
    decoder = {"model_type": "llama", **decoder_fields(meta)}
    if decoder["num_hidden_layers"] != 1:
        raise CheckpointError(
            f"{meta.path}: '{meta.arch}.block_count' is {decoder['num_hidden_layers']}; llama.cpp's EAGLE-3 graph has "
            f"one decoder layer (models/eagle3.cpp), so the file was not written by its converter"
        )
    file = meta.file
    if "output.weight" not in file.tensors:
        raise CheckpointError(
            f"{meta.path}: an EAGLE-3 GGUF without its own output.weight (llama.cpp then uses the target's lm_head); "
            f"every EAGLE-3 drafter specreplay reads has its own lm_head"
        )
    tensors = renamed(file, EAGLE3, LAYER | EAGLE3_LAYER, "EAGLE-3")
    heads, kv_heads = decoder["num_attention_heads"], decoder["num_key_value_heads"]
    for name, count in (("self_attn.q_proj.weight", heads), ("self_attn.k_proj.weight", kv_heads)):
        tensors[f"layers.0.{name}"] = unpermuted(tensors[f"layers.0.{name}"], count)
    draft_vocab, maps = id_maps(file, decoder["vocab_size"])
    config = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": decoder,
        "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": target_layers(meta),
        "norm_before_residual": bool(meta.get("norm_before_residual", False)),
        "norm_before_fc": bool(meta.get("norm_before_fc", False)),
    }
    if (width := meta.get("target_hidden_size")) is not None:
        config["target_hidden_size"] = width
    return "EAGLE-3", Reading(config, {**tensors, **maps})


def unpermuted(read: Callable[[], torch.Tensor], heads: int) -> Callable[[], torch.Tensor]:
    """The inverse of the converter's LlamaModel.permute (llama.py), which interleaves each head's
    rows for ggml's NORM RoPE: rows (head, pair, half) back to (head, half, pair)."""

    def unpermute() -> torch.Tensor:
        weight = read()
        rows = weight.shape[0]
        return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)

    return unpermute


READERS = {"dflash": read_dflash, "eagle3": read_eagle3}

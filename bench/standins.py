"""Stand-ins the memory and length sections measure with, at shapes this machine has no model
for: random-weight targets and drafters written straight to safetensors (no 8.5 GB model in
memory), and synthetic shard sets written through the product's own writer
(`pipeline.shards.ShardWriter`, `save_target_head`) with the manifest built by extract's own
helpers, so `specreplay score` reads them like any extract output."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

EOS_ID = 1  # the stand-in tokenizer's <|im_end|>
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def write_random_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype = torch.bfloat16,
    std: float = 0.02,
    seed: int = 0,
) -> int:
    """Write a safetensors file holding `shapes`: 1-D tensors (norm weights) are ones, the rest
    N(0, std) values from one random block tiled over the tensor (the block length is prime, so
    no two rows of a matrix repeat each other exactly). Streams in 8 MiB writes; returns bytes."""
    item = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * item
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    generator = torch.Generator().manual_seed(seed)
    block_len = 4194301  # prime, ~8 MiB of bf16
    block = (torch.randn(block_len, generator=generator) * std).to(dtype).view(torch.uint8).numpy().tobytes()
    longest_1d = max([s[0] for s in shapes.values() if len(s) == 1] or [1])
    one = torch.ones(longest_1d, dtype=dtype).view(torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in shapes.items():
            size = int(np.prod(shape)) * item
            if len(shape) == 1:
                f.write(one[:size])
                continue
            # each tensor starts at its own place in the block, so no two tensors are equal
            # (extract would store an lm_head equal to the embedding as tied)
            start = (zlib.crc32(name.encode()) % block_len) * item
            view = memoryview(block)
            first = min(size, len(block) - start)
            f.write(view[start : start + first])
            size -= first
            while size > 0:
                n = min(size, len(block))
                f.write(view[:n])
                size -= n
    return 8 + len(blob) + offset


def _write_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer with <|im_end|> (id 1) as eos and pad; prompts are given as ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_end|>": EOS_ID, "<unk>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(str(model_dir))


def build_target(model_dir: Path, shape: dict) -> dict:
    """A transformers directory `specreplay extract --model` loads: config.json,
    generation_config.json, tokenizer and model.safetensors (random bf16 Qwen3). Returns its
    parameter counts."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    model_dir.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        **shape,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        bos_token_id=None,
        dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 1e7},
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(str(model_dir))
    GenerationConfig(eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False).save_pretrained(str(model_dir))
    _write_tokenizer(model_dir)
    size = write_random_safetensors(model_dir / "model.safetensors", shapes, torch.bfloat16)
    count = lambda names: sum(int(np.prod(shapes[n])) for n in names)  # noqa: E731
    return {
        "params": count(shapes),
        "embed_params": count(["model.embed_tokens.weight"]),
        "lm_head_params": count(["lm_head.weight"]),
        "layer_params": count([n for n in shapes if n.startswith("model.layers.")]),
        "file_bytes": size,
        "config": {**shape, "tie_word_embeddings": False, "dtype": "bfloat16"},
    }


def build_drafter(ckpt_dir: Path, target: dict, shape: dict, layer_ids: list[int]) -> dict:
    """A z-lab-format drafter (config.json from `scoring.fit.new_drafter_config` +
    model.safetensors, random bf16) for a target of the given widths."""
    from proposers.detect import parse_drafter_config
    from proposers.dflash.model import DFlashDrafter
    from scoring.fit import new_drafter_config

    facts = {
        "hidden_size": target["hidden_size"],
        "num_layers": target["num_hidden_layers"],
        "vocab_size": target["vocab_size"],
    }
    raw = new_drafter_config(
        facts,
        num_layers=shape["num_layers"],
        block_size=shape["block_size"],
        layer_ids=layer_ids,
        mask_token_id=shape["mask_token_id"],
        num_heads=shape["num_heads"],
        intermediate_size=shape["intermediate_size"],
    )
    raw.update(
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], rope_theta=1e7, torch_dtype="bfloat16"
    )
    with torch.device("meta"):
        drafter = DFlashDrafter(parse_drafter_config(raw, "bench drafter"))
    shapes = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    (ckpt_dir / "config.json").write_text(json.dumps(raw, indent=1))
    size = write_random_safetensors(ckpt_dir / "model.safetensors", shapes, torch.bfloat16, seed=1)
    return {
        "params": sum(int(np.prod(s)) for s in shapes.values()),
        "file_bytes": size,
        "config": {
            k: raw[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "block_size",
            )
        },
    }


class _IdsOnly:
    """The tokenizer extract's planning needs for records given as token ids: it only decodes
    them into the (informational) prompt text, which random ids do not have."""

    def decode(self, ids) -> str:
        return ""


def write_synthetic_shards(
    out: Path,
    lengths: list[int],
    hidden: int,
    vocab: int,
    num_layers: int,
    layer_ids: list[int],
    prompt_tokens: int,
    top_k: int = 32,
    seed: int = 0,
    final_norm: bool = False,
) -> None:
    """A shard set `score` accepts, planned by extract itself: random token ids as prompt and
    given response (one sample per length), random bf16 features and top-k in place of a
    target's forward, written with ShardWriter at the plan's dtypes and chunk size, a random
    bf16 target head, and stage 1's manifest (pipeline/outdir/builder.py)."""
    from pipeline import shards
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.plan import plan_extract
    from pipeline.extract.prompts import PromptRecord
    from pipeline.extract.target import TargetInfo
    from pipeline.outdir.builder import finish_manifest, new_manifest, run_facts

    generator = torch.Generator().manual_seed(seed)
    config = ExtractConfig(
        model="synthetic",
        prompts="synthetic",
        out=str(out),
        max_new_tokens=max(lengths),
        top_k=top_k,
        layer_ids=list(layer_ids),
        dtype="bf16",
    )
    info = TargetInfo(
        name="synthetic-smollm2-shapes",
        path="",
        architecture="synthetic",
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        config_hash="synthetic",
        dtype="bfloat16",
        stop_token_ids=[EOS_ID],
        pad_token_id=EOS_ID,
        bos_token_id=None,
        tokenizer_name="synthetic",
        chat_template_hash=None,
    )
    records = [
        PromptRecord(
            id=f"len-{length}",
            dataset="synthetic",
            input_ids=torch.randint(3, vocab, (prompt_tokens,), generator=generator).tolist(),
            response=torch.randint(3, vocab, (length,), generator=generator).tolist(),
        )
        for length in lengths
    ]
    plan = plan_extract(config, records, _IdsOnly(), info, f"random-seed-{seed}")
    run = run_facts(1, "cpu", config.shard_bytes, config.zstd_level, config.memory_bytes, config.batch_size)
    manifest = new_manifest(plan.source, plan.storage, run)
    embed = (torch.randn(vocab, hidden, generator=generator) * 0.02).to(torch.bfloat16)
    lm_head = (torch.randn(vocab, hidden, generator=generator) * 0.02).to(torch.bfloat16)
    Path(out).mkdir(parents=True, exist_ok=True)
    # the final norm's weight (MTP heads read the state after it), drawn around 1 as a trained one
    norm = (1 + 0.5 * torch.randn(hidden, generator=generator)).to(torch.bfloat16) if final_norm else None
    manifest["target_head"] = shards.save_target_head(str(out), embed, lm_head, norm)
    writer = shards.ShardWriter(
        str(out),
        0,
        plan.storage.tensors,
        shard_bytes=config.shard_bytes,
        zstd_level=config.zstd_level,
        chunk_tokens=plan.storage.chunk_tokens,
    )
    width = len(plan.storage.layer_ids) * hidden
    for item in plan.items:
        length, total = len(item.given), len(item.prompt_ids) + len(item.given)
        logprobs = -torch.rand(length + 1, top_k, generator=generator).mul(8).sort(dim=-1).values
        writer.write(
            shards.Sample(
                sample_id=item.sample_id,
                dataset=item.dataset,
                prompt_text=item.prompt_text,
                input_ids=torch.tensor(item.prompt_ids + item.given, dtype=torch.int64),
                prompt_len=len(item.prompt_ids),
                finish_reason="given",
                greedy=False,
                tensors={
                    "features": torch.randn(total, width, generator=generator).to(torch.bfloat16),
                    "topk_ids": torch.randint(0, vocab, (length + 1, top_k), generator=generator, dtype=torch.int32),
                    "topk_logprobs": logprobs.contiguous(),
                    "argmax_mismatch": torch.zeros(length, dtype=torch.uint8),
                },
            )
        )
    writer.close()
    finish_manifest(str(out), manifest, plan.storage, [item.sample_id for item in plan.items])


def tree_cases(seed: int, anchors: int, depth: int, vocab: int, kind: str):
    """Drafter logits [anchors, depth, vocab] and target paths for DDTree exactness checks.
    kind: "plain" (N(0, 2) logits), "ties" (rounded to integers: many equal logits, so many
    prefixes tie), "near" (pairs of logits 1 ulp apart: weights that differ in the last bits).
    Targets follow one of the 6 likeliest tokens (rank 0 most often), a random token 1 time in
    5; each anchor knows a random prefix of its path (half of them all of it).
    -> (logits float32, targets [anchors, depth] int64 (-1 unknown), known [anchors, depth] bool)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(anchors, depth, vocab, generator=g) * 2
    if kind == "ties":
        logits = logits.round()
    elif kind == "near":
        half = logits[..., ::2]
        logits[..., 1::2] = torch.nextafter(half[..., : vocab // 2], torch.tensor(float("inf")))
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :6]
    pick = torch.where(
        torch.rand(anchors, depth, generator=g) < 0.5, 0, torch.randint(0, 6, (anchors, depth), generator=g)
    )
    targets = order.gather(-1, pick.clamp(max=order.shape[-1] - 1)[..., None])[..., 0]
    targets = torch.where(
        torch.rand(anchors, depth, generator=g) < 0.2, torch.randint(0, vocab, (anchors, depth), generator=g), targets
    )
    known = torch.arange(depth)[None] < torch.randint(0, depth + 1, (anchors, 1), generator=g)
    known[: anchors // 2] = True
    return logits, torch.where(known, targets, -1), known

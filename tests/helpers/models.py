"""Tiny random targets built from configs (no download, well under 2 s each) and the tokenizer
they share: a byte-level BPE with a ChatML template, built offline in milliseconds."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import torch

# Model vocab rows; the tokenizer uses fewer ids, so every token id it produces is a valid row.
TINY_VOCAB = 512
TINY_HIDDEN = 64
TINY_TOKENIZER_VOCAB = 400

# Special tokens come first in the vocab, so their ids are fixed whatever the BPE merges are.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

# ChatML, as Qwen renders it, including Qwen3's `enable_thinking=False` empty think block so
# tests can see the flag reach the template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}"
    "{% endif %}"
    "{% endif %}"
)

# Small fixed corpus for the in-memory BPE: code, arithmetic and prose, like the bundled prompts.
_TRAINING_TEXT = [
    "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Write a solution to the following problem and make sure that it passes the tests:",
    "def has_close_elements(numbers: List[float], threshold: float) -> bool:",
    "    for idx, elem in enumerate(numbers):\n        return True\n    return False\n",
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { }",
    "You are a helpful assistant. Hello, how are you today? I am fine, thank you.",
] * 4


def make_tokenizer(save_dir: str | os.PathLike | None = None):
    """A small byte-level BPE tokenizer with a ChatML chat template, built offline in milliseconds.

    eos = pad = `<|im_end|>` (id 2), as in SmolLM2 and Qwen chat models. Byte-level, so any text
    encodes and decodes losslessly. Saved to `save_dir` when given; returns the tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_TRAINING_TEXT, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END_ID
    assert len(tokenizer) <= TINY_VOCAB
    if save_dir is not None:
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer


def save_target(model, save_dir) -> str:
    """Save model + tokenizer + generation config (eos = <|im_end|>) and return the path."""
    from transformers import GenerationConfig

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=IM_END_ID, pad_token_id=IM_END_ID, bos_token_id=None, do_sample=False
    )
    model.save_pretrained(str(save_dir))
    make_tokenizer(save_dir)
    return str(save_dir)


@contextlib.contextmanager
def seeded(seed: int):
    """Deterministic weights without disturbing the global RNG other tests may rely on."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# A larger init std than the default 0.02: with 0.02 a tiny random model's greedy output
# collapses to one repeated token, which would hide bugs in anything that compares tokens.
# The default seeds are chosen so greedy outputs run to the token budget and differ between
# prompts (tests/pipeline/extract/test_target.py checks it); seed 0 of the VLM stops after 3 tokens.
_INIT_STD = 0.5


def text_kwargs(num_layers: int) -> dict:
    """The Qwen3 text config fields every tiny target shares (convention_fits.py builds on them too)."""
    return dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        initializer_range=_INIT_STD,
        tie_word_embeddings=False,
        eos_token_id=IM_END_ID,
        pad_token_id=IM_END_ID,
        bos_token_id=None,
    )


def build_tiny_qwen3(save_dir, num_layers: int = 6, seed: int = 0) -> str:
    """Tiny random Qwen3ForCausalLM (vocab 512, hidden 64, 4 q / 2 kv heads, head_dim 16, untied)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**text_kwargs(num_layers), rope_theta=10000.0)
    with seeded(seed):
        model = Qwen3ForCausalLM(config).eval()
    return save_target(model, save_dir)


def _qwen35_text_config(num_layers: int):
    from transformers import Qwen3_5TextConfig

    # Every other layer Gated DeltaNet, the rest full attention, last one full (as in Qwen3.5).
    layer_types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return Qwen3_5TextConfig(
        **text_kwargs(num_layers),
        layer_types=layer_types,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        # partial_rotary_factor 0.25 of head_dim 16 = 4 rotary dims = 2 frequencies; the
        # interleaved mrope sections must sum to that.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    )


def build_tiny_qwen35_hybrid(save_dir, num_layers: int = 4, seed: int = 1) -> str:
    """Tiny random Qwen3_5ForCausalLM with linear-attention (Gated DeltaNet) + full-attention layers."""
    from transformers import Qwen3_5ForCausalLM

    with seeded(seed):
        model = Qwen3_5ForCausalLM(_qwen35_text_config(num_layers)).eval()
    return save_target(model, save_dir)


def build_tiny_qwen35_vlm(save_dir, num_layers: int = 4, seed: int = 1) -> str:
    """Tiny random Qwen3_5ForConditionalGeneration; text decoder at model.model.language_model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5VisionConfig

    vision = Qwen3_5VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=TINY_HIDDEN,
        num_position_embeddings=16,
    )
    # Image/video token ids must be inside the tiny vocab; the tests never feed images.
    config = Qwen3_5Config(
        text_config=_qwen35_text_config(num_layers).to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=TINY_VOCAB - 4,
        video_token_id=TINY_VOCAB - 3,
        vision_start_token_id=TINY_VOCAB - 2,
        vision_end_token_id=TINY_VOCAB - 1,
        tie_word_embeddings=False,
    )
    with seeded(seed):
        model = Qwen3_5ForConditionalGeneration(config).eval()
    return save_target(model, save_dir)


# The settings.target of shards extracted from build_tiny_qwen3's default (6 layers).
TINY_TARGET = {"hidden_size": TINY_HIDDEN, "num_layers": 6, "vocab_size": TINY_VOCAB}


def one_torch_thread():
    """A module fixture's body: one intra-op thread while the module runs (on shared cores
    OpenMP's spinning workers slow the tiny models' calls down)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SMOLLM2_VOCAB = 49152
DRAFT_FIT_STEPS, DRAFT_FIT_LR = 40, 3e-3  # a draft model that also misses: rejections compared too


def fitted_draft_model(
    target_dir, sequences, out, layers: int = 2, steps: int = DRAFT_FIT_STEPS, lr: float = DRAFT_FIT_LR, **shape
) -> str:
    """A Qwen3 of `layers` layers at SmolLM2's vocabulary (more config fields: `shape`, e.g.
    another `vocab_size`) fitted briefly (`steps` AdamW steps at `lr`) by next-token loss on the
    target's greedy continuations (a random draft accepts nothing), saved with the target's
    tokenizer (llama.cpp's converter reads it): a standalone draft model for draft-simple."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**text_kwargs(layers), "vocab_size": SMOLLM2_VOCAB, **shape}, rope_theta=10000.0)
    with seeded(5):
        model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps if sequences else 0):
        loss = sum(model(ids[None], labels=ids[None]).loss for ids, _ in sequences) / len(sequences)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, Path(out) / name)
    return str(out)

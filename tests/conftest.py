"""Shared test fixtures: tiny random targets built from configs (no download, well under 2 s each).

Other test files rely on these names; keep them stable. One helper per fixture concept: a test
that needs a prompt file, a drafter or a brute-force tree uses the one here, not its own.
  fixtures  tiny_qwen3_dir, tiny_qwen35_hybrid_dir, tiny_qwen35_vlm_dir (session scope, return str paths)
  targets   make_tokenizer(save_dir), build_tiny_qwen3(save_dir), build_tiny_qwen35_hybrid(save_dir),
            build_tiny_qwen35_vlm(save_dir), TINY_VOCAB, TINY_HIDDEN, TINY_TARGET, IM_END_ID
  prompts   write_prompts(path, records)
  drafters  drafter_config(...) (the one config source), random_drafter(...) (ours, random weights),
            reference_drafter(...) (the public dflash model, random weights, saved in z-lab format),
            fitted_drafters(shards, out_dir, ...) (ours, fitted to extracted shards, saved)
  trees     brute_force_tree(log_q, budget)

Import the helpers with `from conftest import make_tokenizer` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

# Exact-equality tests compare two computations that differ only in where their buffers sit;
# MKL may pick alignment-dependent kernels (measured: the stored-dtype-embedding test flipped
# bits depending on which tests ran before it). Strict conditional numerical reproducibility
# makes GEMM results independent of alignment. Set before torch loads MKL.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import pytest  # noqa: E402
import torch  # noqa: E402

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


def _finish(model, save_dir) -> str:
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
def _seeded(seed: int):
    """Deterministic weights without disturbing the global RNG other tests may rely on."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


# A larger init std than the default 0.02: with 0.02 a tiny random model's greedy output
# collapses to one repeated token, which would hide bugs in anything that compares tokens.
# The default seeds are chosen so greedy outputs run to the token budget and differ between
# prompts (tests/test_target.py checks it); seed 0 of the VLM stops after 3 tokens.
_INIT_STD = 0.5


def _text_kwargs(num_layers: int) -> dict:
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

    config = Qwen3Config(**_text_kwargs(num_layers), rope_theta=10000.0)
    with _seeded(seed):
        model = Qwen3ForCausalLM(config).eval()
    return _finish(model, save_dir)


def _qwen35_text_config(num_layers: int):
    from transformers import Qwen3_5TextConfig

    # Every other layer Gated DeltaNet, the rest full attention, last one full (as in Qwen3.5).
    layer_types = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return Qwen3_5TextConfig(
        **_text_kwargs(num_layers),
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

    with _seeded(seed):
        model = Qwen3_5ForCausalLM(_qwen35_text_config(num_layers)).eval()
    return _finish(model, save_dir)


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
    with _seeded(seed):
        model = Qwen3_5ForConditionalGeneration(config).eval()
    return _finish(model, save_dir)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen35_hybrid_dir(tmp_path_factory) -> str:
    return build_tiny_qwen35_hybrid(tmp_path_factory.mktemp("tiny_qwen35_hybrid"))


@pytest.fixture(scope="session")
def tiny_qwen35_vlm_dir(tmp_path_factory) -> str:
    return build_tiny_qwen35_vlm(tmp_path_factory.mktemp("tiny_qwen35_vlm"))


# ---------------------------------------------------------------------------------------------
# prompt files


def write_prompts(path, records) -> str:
    """Write a prompts JSONL file, one record a line, and return its path as a string. Records are
    dicts (written as JSON) or strings (written as they are, for malformed-input tests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


# ---------------------------------------------------------------------------------------------
# drafters

# The settings.target of shards extracted from build_tiny_qwen3's default (6 layers).
TINY_TARGET = {"hidden_size": TINY_HIDDEN, "num_layers": 6, "vocab_size": TINY_VOCAB}


def drafter_config(
    target: dict | None = None,
    *,
    layers: int = 2,
    block_size: int = 4,
    layer_ids=(1, 3),
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    mask_token_id=None,
    dflash_extra: dict | None = None,
    **fields,
) -> dict:
    """A z-lab config.json dict from scoring.fit.new_drafter_config (what `specreplay fit` writes)
    for a drafter of `target` (default TINY_TARGET).

    `layer_ids=None` leaves dflash_config.target_layer_ids out, so loaders derive them from
    num_target_layers. `dflash_extra` goes into dflash_config (input_embedding_scale, ...); other
    fields go at the top level (layer_types, sliding_window, is_causal, ...); a sliding_window
    also sets use_sliding_window, without which Qwen3Config drops the window on load."""
    from scoring.fit import new_drafter_config

    raw = new_drafter_config(
        target or TINY_TARGET,
        num_layers=layers,
        block_size=block_size,
        layer_ids=list(layer_ids) if layer_ids is not None else None,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        mask_token_id=mask_token_id,
    )
    if layer_ids is None:
        del raw["dflash_config"]["target_layer_ids"]
    raw["dflash_config"].update(dflash_extra or {})
    raw.update(fields)
    if fields.get("sliding_window") is not None:
        raw["use_sliding_window"] = True
    return raw


def _random_weights(model, seed: int, std: float):
    """Every parameter (norms included, so a weight loaded into the wrong slot shows) drawn from
    N(0, std), seeded without touching the global RNG; eval mode."""
    with _seeded(seed), torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, std)
    return model.eval()


def random_drafter(*, seed: int = 0, std: float = 0.2, **config):
    """Our scoring.drafters.dflash.DFlashDrafter with drafter_config(**config) and random weights."""
    from scoring.drafters.detect import parse_drafter_config
    from scoring.drafters.dflash_model import DFlashDrafter

    with _seeded(seed):
        drafter = DFlashDrafter(parse_drafter_config(drafter_config(**config), "test drafter"))
    return _random_weights(drafter, seed, std)


# The public reference drafters' dimensions (test_drafter.py, test_checkpoint.py): small enough
# that a parity check over every anchor takes milliseconds; MASK inside VOCAB but not its last id.
REFERENCE_HIDDEN, REFERENCE_VOCAB, REFERENCE_MASK = 32, 64, 60
REFERENCE_TARGET = {"hidden_size": REFERENCE_HIDDEN, "num_layers": 6, "vocab_size": REFERENCE_VOCAB}


def reference_drafter(save_dir=None, *, seed: int = 0, std: float = 0.2, **config):
    """The public reference `dflash.model.DFlashDraftModel` built from drafter_config(**config)
    (default: REFERENCE_TARGET, 4 query / 2 kv heads of 8, mask REFERENCE_MASK) with random
    weights; saved to `save_dir` in z-lab format (its own save_pretrained) when given. The caller
    must have skipped without dflash (pytest.importorskip)."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config.setdefault("target", REFERENCE_TARGET)
    config.setdefault("num_heads", 4)
    config.setdefault("intermediate_size", 64)
    config.setdefault("mask_token_id", REFERENCE_MASK)
    raw = drafter_config(**config)
    hf = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    hf.architectures = raw["architectures"]
    with _seeded(seed):
        model = DFlashDraftModel(hf)
    _random_weights(model, seed, std)
    if save_dir is not None:
        model.save_pretrained(str(save_dir))
    return model


def fitted_drafters(
    shards: str,
    out_dir,
    *,
    block_size: int = 4,
    layer_ids=None,
    layer_types=None,
    sliding_window: int | None = None,
    **options,
) -> list[str]:
    """Fit a new drafter (scoring.fit, as `specreplay fit`) to every sample of the shards; returns
    the checkpoint directories written, out_dir/step_<N> (every `save_every` steps and the last).
    One decoder layer unless layer_types says more; `options` are FitOptions fields."""
    from pipeline.shards import ShardSet
    from scoring.config import FitOptions
    from scoring.fit import fit_drafter, new_drafter_config

    shardset = ShardSet(shards)
    settings = shardset.settings
    raw = new_drafter_config(
        settings["target"],
        num_layers=len(layer_types or [None]),
        block_size=block_size,
        layer_ids=layer_ids,
        layer_types=layer_types,
        sliding_window=sliding_window,
    )
    samples = list(shardset.samples(tensors=["features"]))
    _, written = fit_drafter(
        samples, shardset.target_head(), settings["layer_ids"], raw, str(out_dir), FitOptions(**options)
    )
    return written


# ---------------------------------------------------------------------------------------------
# DDTree


def brute_force_tree(log_q: torch.Tensor, budget: int, *, prune: bool = True) -> set[tuple[int, ...]]:
    """The `budget` most probable prefixes (depth 1..L) under independent per-depth log-probs
    log_q [L, V], by enumerating and sorting prefixes.

    prune=False enumerates all V + V^2 + ... + V^L prefixes (tiny L and V only): the oracle with
    no argument to trust. prune=True enumerates only each depth's top-`budget` tokens and keeps the
    `budget` best prefixes of each depth as the next depth's parents, which is exact: a prefix
    holding a rank >= budget token is beaten by `budget` siblings, and a prefix outside its depth's
    best `budget` is beaten by those (test_ddtree.py checks the two agree); it makes the vocab of
    a real target tractable (tests/online_reference.py)."""
    depths, vocab = log_q.shape
    k = min(budget, vocab) if prune else vocab
    top = torch.topk(log_q.float(), k, dim=-1)
    scored, frontier = [], [((), 0.0)]
    for depth in range(depths):
        children = [
            (prefix + (int(top.indices[depth, r]),), score + float(top.values[depth, r]))
            for prefix, score in frontier
            for r in range(k)
        ]
        children.sort(key=lambda item: -item[1])
        if prune:
            children = children[:budget]
        scored += children
        frontier = children
    scored.sort(key=lambda item: -item[1])
    return {prefix for prefix, _ in scored[:budget]}


# --------------------------------------------------------------------------- headless Chromium

CHROMIUM = "/usr/bin/chromium"  # the Debian package `make setup-browser` installs
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} absent: install it with `make setup-browser`"
)


def chromium_screenshot(page, shot, profile_dir, width: int, height: int) -> None:
    """Render a local HTML file in headless Chromium into the PNG `shot` (no network, a fresh profile)."""
    import subprocess

    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile_dir}",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        f"--window-size={width},{height}",
        f"file://{page}",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert os.path.exists(shot), f"no screenshot (rc {proc.returncode}): {proc.stderr[-2000:]}"


# --------------------------------------------------------------------------- killed runs


def kill_after_first_shard(command: list[str], out, cwd: str, timeout_s: float = 300) -> None:
    """Start `command` (an extract writing into `out`) and SIGKILL it as soon as its first shard
    lands, so a resume test finds a half-finished extract. Model load under a busy CI can be slow."""
    import signal
    import subprocess
    import time
    from pathlib import Path

    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    try:
        while not any((Path(out) / "shards").glob("*.arrow")):
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "no shard appeared"
            time.sleep(0.01)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


def tiny_shards(tmp, model_dir: str, records: list[dict], max_new_tokens: int = 16) -> str:
    """`records` written as tmp/prompts.jsonl and extracted from a tiny target into tmp/shards
    (feature layers 1 and 3, top-8, fp32): the small real extract most score tests start from."""
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract

    prompts = write_prompts(tmp / "prompts.jsonl", records)
    shards = str(tmp / "shards")
    run_extract(
        ExtractConfig(
            model=model_dir,
            prompts=prompts,
            out=shards,
            max_new_tokens=max_new_tokens,
            layer_ids=[1, 3],
            top_k=8,
            dtype="fp32",
        )
    )
    return shards

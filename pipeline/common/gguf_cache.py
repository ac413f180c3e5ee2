"""A GGUF file as a transformers directory: dequantized once by transformers' GGUF loader into
fp32 safetensors (with its tokenizer and generation config) under the model cache,
$SPECREPLAY_MODEL_CACHE/<stem>/ (default: the per-user ~/.cache/specreplay/models/<stem>/), reloaded
from there afterwards. Read by stage 1 for a GGUF
target (pipeline/extract/target.py) and by a draft model given as a GGUF file
(proposers/draft/checks.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

MODEL_CACHE_ENV = "SPECREPLAY_MODEL_CACHE"


def default_model_cache() -> Path:
    """The per-user cache (XDG's, else ~/.cache): one dequantized copy per user, wherever specreplay
    runs from, never inside the installed package or the working directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specreplay" / "models"


# Written last into a GGUF cache dir: its presence means the cache is complete and names its source.
CACHE_MARKER = "specreplay_gguf_source.json"


def model_cache_dir() -> Path:
    return Path(os.environ.get(MODEL_CACHE_ENV) or default_model_cache())


def _gguf_source_facts(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"gguf": str(gguf_path.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _gguf_cache_is_valid(cache_dir: Path, gguf_path: Path) -> bool:
    marker = cache_dir / CACHE_MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    facts = _gguf_source_facts(gguf_path)
    # Path may differ (another venv); the same bytes and size are what matter.
    return recorded.get("bytes") == facts["bytes"] and recorded.get("mtime_ns") == facts["mtime_ns"]


def _dequantize_kwargs() -> dict:
    """Ask transformers for plain dense Linear layers. Without this, an installed `kernels` package
    would keep the weights packed in GGUF blocks, which cannot be saved as safetensors."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def gguf_to_cache(gguf_path: str | Path) -> Path:
    """Dequantize a GGUF once into a transformers directory (fp32 safetensors, tokenizer,
    generation config) under the model cache; later calls return the cached directory.

    fp32 on purpose: dequantized Q4 values are not exactly representable in bf16, and the cast
    to the run dtype happens at load time anyway.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    cache_dir = model_cache_dir() / gguf_path.stem
    if _gguf_cache_is_valid(cache_dir, gguf_path):
        return cache_dir
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the destination and rename, so an interrupted build never looks complete.
    staging = Path(tempfile.mkdtemp(prefix=f".{gguf_path.stem}.", dir=cache_dir.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **_dequantize_kwargs()
        )
        # A dequantized model is a plain dense model; drop any quantizer left attached so
        # save_pretrained writes ordinary safetensors.
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer = None
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model.save_pretrained(str(staging))
        model.generation_config.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
        (staging / CACHE_MARKER).write_text(json.dumps(_gguf_source_facts(gguf_path), indent=2))
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        os.replace(staging, cache_dir)
        cache_dir.chmod(0o755)  # mkdtemp makes it private; the cache is shared like data/ is
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return cache_dir

"""`specreplay import`'s settings, with the defaults the CLI shows. Torch-free on purpose:
`specreplay import --help` reads these without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.sizes import DEFAULT_MEMORY_BYTES, DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL

FORMATS = ("vllm", "speculators", "specforge")


@dataclass
class ImportConfig:
    source: str  # the capture: vLLM's storage dir, speculators' prepared data dir, SpecForge's output dir
    format: str  # one of FORMATS
    model: str  # the target: "smollm2", a transformers directory, or a .gguf file (weights read, never loaded)
    out: str
    layer_ids: list[int] | None = None  # stored ids (this project's numbering); None: every captured layer
    capture_config: str | None = None  # the JSON naming the captured layers (vLLM speculative config, draft config)
    captured_layer_ids: str | None = None  # or the ids themselves, in the producer's numbering
    prompt_lens: str | None = None  # vllm: JSONL {"id", "prompt_len"}
    hidden_states: str | None = None  # speculators: where the hs_<i>.safetensors are, if not DATA/hidden_states
    dataset: str | None = None  # the samples' dataset name; None: the capture directory's name
    top_k: int = 32
    feature_dtype: str | None = None  # None: the capture's dtype (lossless)
    limit: int | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    device: str = "cpu"  # where the final norm and lm_head run: cpu, cuda, cuda:1
    overwrite: bool = False
    quiet: bool = False

"""Stage 1's settings: what `extract` takes, with the defaults the CLI shows.

Torch-free on purpose: `specreplay extract --help` reads these defaults without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.common.sizes import DEFAULT_MEMORY_BYTES, DEFAULT_SHARD_BYTES, DEFAULT_ZSTD_LEVEL


@dataclass
class ExtractConfig:
    model: str = "smollm2"  # "smollm2", a transformers directory, or a .gguf file
    prompts: str = "default"  # a bundled set name or a JSONL path
    out: str = "data/shards/smollm2-default"  # local path or any pyarrow.fs URI
    max_new_tokens: int = 128
    layer_ids: list[int] | None = None  # explicit; else from draft_config; else the DFlash formula
    draft_config: str | list[str] | None = None  # drafter config.json(s) (or their directories); layers of all
    neighbour_layers: bool = False  # also store ids i - 1 and i + 1 of every feature layer (diagnose)
    beyond_positions: bool = False  # extract samples longer than the target's max_position_embeddings
    num_draft_layers: int = 5  # n of the formula default
    top_k: int = 32
    dtype: str = "auto"  # model dtype: auto = fp32 on CPU, bf16 on CUDA
    feature_dtype: str | None = None  # storage dtype of features; None = the model dtype (lossless)
    enable_thinking: bool | None = None  # None = the chat template's default
    limit: int | None = None
    batch_size: int = 8
    shard_bytes: int = DEFAULT_SHARD_BYTES
    zstd_level: int = DEFAULT_ZSTD_LEVEL
    overwrite: bool = False
    quiet: bool = False  # read by the CLI: no progress bars (the library never prints)
    device: str | None = None  # None = cuda when available, else cpu; "auto" = device_map over GPUs
    memory_bytes: int = DEFAULT_MEMORY_BYTES  # working memory beyond model and sample: lm_head window + shard chunk
    # Sampling (pipeline/common/sampling.py): temperature 0 is greedy decoding, the default.
    temperature: float = 0.0
    top_p: float = 1.0
    sample_top_k: int = 0  # the sampling filter; not `top_k`, the log-probs stored per position
    num_samples: int = 1  # sampled responses per prompt (ids <id>#<k>)
    seed: int = 0  # with the prompt id and the draw, seeds each response's generator
    # Responses from a serving engine (pipeline/extract/engines/): None generates them with the target.
    responses_from: list[str] | None = None  # base URLs of OpenAI-compatible servers (llama.cpp, vLLM, SGLang)
    engine: str = "auto"  # auto: from GET /v1/models owned_by; or llama.cpp, vllm, sglang
    served_model: str | None = None  # the model name the servers serve; None: the one they serve
    concurrency: int = 4  # requests in flight per rank
    request_timeout: float = 600.0  # seconds per request
    retries: int = 3  # more tries after a failed request (exponential backoff)

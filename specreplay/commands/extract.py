"""`specreplay extract`: run the target once over a prompt set (stage 1, pipeline/extract/run.py).

The console side of extract lives here: options, the progress bar, and what to run next.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from pipeline.common.errors import UserError
from pipeline.common.sizes import format_size, parse_size
from pipeline.extract.config import ExtractConfig
from specreplay.commands.defaults import default


def default_out(model: str, prompts: str) -> str:
    """data/shards/<model>-<prompts>, as the Makefile's SHARDS default."""

    def stem(text: str) -> str:
        name = Path(text.rstrip("/")).name or text
        for suffix in (".gz", ".jsonl", ".json", ".gguf"):
            name = name.removesuffix(suffix)
        return name

    return f"data/shards/{stem(model)}-{stem(prompts)}"


def d(name: str):
    return default(ExtractConfig, name)


def next_steps(out: str, manifest: dict) -> str:
    """What the run wrote and what to run next, with the program named as the user can type it
    (specreplay.hints.program: `specreplay` is not on PATH until the venv is activated)."""
    from specreplay.hints import in_repository, program, results_dir

    t = manifest.get("totals", {})
    prog = program()
    excluded = ""
    if t.get("excluded"):  # NaN/Inf samples (pipeline/extract/capture.py nonfinite_values): not stored
        from pipeline.shards.writer import describe_excluded

        excluded = (
            f"warning: {describe_excluded(t['excluded'])}; they are not stored and never scored "
            f"(fp16 overflow? use bf16 or fp32 for --dtype and --feature-dtype)\n"
        )
    return (
        f"{out}: {t.get('samples', 0)} samples, {t.get('tokens', 0)} tokens, {t.get('bytes', 0) / 2**20:.1f} MiB\n"
        + excluded
        + f"next:\n"
        f"  {prog} inspect {out}\n"
        f"  {prog} score --ckpt path/to/drafter --shards {out} --out {results_dir()}"
        + (f"\n  (or: make score CKPT=path/to/drafter SHARDS={out})" if in_repository() else "")
    )


def check_paths(config: ExtractConfig) -> None:
    """Typed paths, before anything is loaded or written (pipeline/common/paths.py)."""
    from pipeline.common.paths import check_extract_out, check_input_path, check_output_dir
    from pipeline.extract.prompts import BUNDLED_NAMES

    check_output_dir(config.out, "--out")
    check_extract_out(config.out, "--out")
    check_input_path(config.model, "--model", "any")
    if os.path.isdir(config.prompts):
        raise UserError(
            f"--prompts {config.prompts} is a directory; give a JSONL file (one JSON object per line) or a "
            f"bundled set name: {', '.join(BUNDLED_NAMES)}"
        )
    check_input_path(config.prompts, "--prompts", "file")


@click.command(context_settings={"max_content_width": 100})
@click.option(
    "--model",
    default=d("model"),
    show_default=True,
    help="Target: `smollm2` (embedded SmolLM2-135M-Instruct), a transformers directory, or a .gguf file.",
)
@click.option(
    "--prompts",
    default=d("prompts"),
    show_default=True,
    help="Bundled set (default, gsm8k, humaneval, mt-bench, spec-bench) or a JSONL file.",
)
@click.option(
    "--out", default=None, help="Output directory or URI (s3://, gs://). [default: data/shards/<model>-<prompts>]"
)
@click.option(
    "--max-new-tokens",
    type=int,
    default=d("max_new_tokens"),
    show_default=True,
    help="Tokens generated per prompt (greedy, or sampled with --temperature).",
)
@click.option(
    "--layer-ids",
    default=None,
    help="Feature layers, e.g. 1,9,17 (id i = output of decoder layer i); `none`: no feature layers, the "
    "shards hold tokens and top-k only (for proposers that read no hidden states, e.g. n-gram lookup).",
)
@click.option(
    "--draft-config",
    multiple=True,
    help="Drafter config.json (or its dir): store the feature layers it reads (any family and layout: "
    "z-lab, speculators, SpecForge, DeepSpec; ids translated to this project's numbering). Repeat it "
    "to serve several drafters from one extract (a DFlash and an EAGLE-3 drafter: layers both read "
    "are stored once; `specreplay inspect` shows which drafter each layer serves).",
)
@click.option(
    "--neighbour-layers",
    is_flag=True,
    help="Also store layer ids i - 1 and i + 1 of every feature layer i (where they exist), so "
    "`specreplay diagnose` can test the layers-1 / layers+1 conventions. Features take up to 3x the space.",
)
@click.option(
    "--beyond-positions",
    is_flag=True,
    help="Extract samples longer than the target's max_position_embeddings (refused otherwise): their "
    "features past the trained positions are what the model computes there, not what it was trained on; "
    "`inspect` says so.",
)
@click.option(
    "--num-draft-layers",
    type=int,
    default=d("num_draft_layers"),
    show_default=True,
    help="Drafter layers n for the default DFlash layer-id formula.",
)
@click.option(
    "--top-k", type=int, default=d("top_k"), show_default=True, help="Next-token log-probs kept per position."
)
@click.option(
    "--dtype",
    default=d("dtype"),
    show_default=True,
    help="Model dtype: auto (fp32 on CPU, bf16 on GPU), fp32, bf16, fp16.",
)
@click.option(
    "--feature-dtype",
    default=None,
    help="Storage dtype of features: float32, bfloat16, float16 (lossless when it is the model dtype), or "
    "fp8 (lossy e4m3 with a per-token, per-layer scale; ~half of bf16's bytes). [default: model dtype]",
)
@click.option(
    "--enable-thinking/--disable-thinking",
    default=None,
    help="Pass enable_thinking to the chat template (e.g. Qwen3). [default: the template's own default]",
)
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option(
    "--batch-size", type=int, default=d("batch_size"), show_default=True, help="Prompts per batched generate call."
)
@click.option(
    "--shard-bytes",
    default=format_size(d("shard_bytes")),
    show_default=True,
    help="Roll over to a new shard after this size (1GiB, 512MiB, ...).",
)
@click.option(
    "--zstd-level",
    type=int,
    default=d("zstd_level"),
    show_default=True,
    help="zstd level of the shard buffers (1 measured smaller and faster to decode than 3 on features).",
)
@click.option(
    "--memory-budget",
    "memory_bytes",
    default=format_size(d("memory_bytes")),
    show_default=True,
    help="Working memory beyond the model and one sample: half for the lm_head window over the "
    "vocabulary, half for the shard chunk being written (sets their sizes).",
)
@click.option(
    "--temperature",
    type=float,
    default=d("temperature"),
    show_default=True,
    help="Sample responses at this temperature (the reference DFlash sampler); 0 = greedy decoding.",
)
@click.option(
    "--top-p",
    type=float,
    default=d("top_p"),
    show_default=True,
    help="Sampling: keep the most likely tokens up to this cumulative probability (1 = off).",
)
@click.option(
    "--sample-top-k",
    type=int,
    default=d("sample_top_k"),
    show_default=True,
    help="Sampling: keep only the k most likely tokens (0 = off). Not --top-k, the log-probs stored.",
)
@click.option(
    "--num-samples",
    type=int,
    default=d("num_samples"),
    show_default=True,
    help="Sampling: independent responses per prompt, stored as <id>#0 .. <id>#K-1.",
)
@click.option(
    "--seed",
    type=int,
    default=d("seed"),
    show_default=True,
    help="Sampling: with the prompt id and draw, seeds each response (same seed, same responses).",
)
@click.option(
    "--responses-from",
    "responses_from",
    multiple=True,
    metavar="URL",
    help="Take each response from an OpenAI-compatible serving engine (llama.cpp's llama-server, vLLM, "
    "SGLang) at this base URL instead of generating it with the target; repeat for several servers of "
    "one model. Prompts go out and responses come back as token ids (never text); greedy, or sampled "
    "with --temperature/--top-p/--sample-top-k/--seed/--num-samples. The target's forward then "
    "captures features and top-k as usual and counts the positions where a response differs from its "
    "argmax: a greedy response with none is exact. Fetched responses are kept in OUT/responses/ and "
    "never asked for again on resume.",
)
@click.option(
    "--engine",
    default=d("engine"),
    show_default=True,
    type=click.Choice(["auto", "llama.cpp", "vllm", "sglang"]),
    help="With --responses-from: which engine the servers are (auto: from GET /v1/models owned_by).",
)
@click.option(
    "--served-model",
    default=None,
    help="With --responses-from: the model name to ask the servers for. [default: the one model they serve]",
)
@click.option(
    "--concurrency",
    type=int,
    default=d("concurrency"),
    show_default=True,
    help="With --responses-from: requests in flight at once (per torchrun rank).",
)
@click.option(
    "--request-timeout",
    type=float,
    default=d("request_timeout"),
    show_default=True,
    help="With --responses-from: seconds one request may take before it is tried again.",
)
@click.option(
    "--retries",
    type=int,
    default=d("retries"),
    show_default=True,
    help="With --responses-from: tries after a failed request (refused connection, timeout, HTTP 429/5xx), "
    "waiting 0.5 s, 1 s, 2 s, ... between them.",
)
@click.option("--overwrite", is_flag=True, help="Delete old outputs in --out (needed when settings changed).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--device", default=None, help="cpu, cuda, cuda:1, or auto (device_map over all GPUs). [default: cuda if present]"
)
def extract(**options):
    """Run the target once over a prompt set; store features and next-token top-k in shards.

    Greedy generation (batched), then one full-sequence forward per response capturing the
    feature layers and the target's distribution. With --temperature > 0 responses are sampled
    (top-p/top-k as the reference DFlash loop applies them) and each token's sampling
    log-probability is stored too. With --responses-from the responses come from a serving
    engine instead (the target still runs the capture forward). Re-running the same command
    resumes an interrupted extract; under torchrun, prompts are split by rank (every rank asks
    the same servers).

    \b
    Examples:
      specreplay extract                                   # SmolLM2-135M, bundled default prompts
      specreplay extract --model path/to/Qwen3-8B --prompts gsm8k --limit 200 \\
          --draft-config path/to/dflash --draft-config path/to/eagle3 --out data/shards/qwen3-8b-gsm8k
      specreplay extract --temperature 0.6 --top-p 0.95 --sample-top-k 20 --num-samples 4 --seed 0 \\
          --out data/shards/smollm2-sampled
      specreplay extract --responses-from http://127.0.0.1:8080 --concurrency 8 --out data/shards/smollm2-served
      torchrun --nproc_per_node 8 -m specreplay extract --model path/to/target --prompts my.jsonl --out s3://bucket/x
    """
    from pipeline.common.layer_ids import parse_layer_ids
    from pipeline.extract.run import run_extract
    from specreplay.progress import bars

    options.update(
        out=options["out"] or default_out(options["model"], options["prompts"]),
        layer_ids=None if options["layer_ids"] is None else parse_layer_ids(options["layer_ids"], allow_none=True),
        shard_bytes=parse_size(options["shard_bytes"], "--shard-bytes"),
        memory_bytes=parse_size(options["memory_bytes"], "--memory-budget"),
        responses_from=list(options["responses_from"]) or None,
        draft_config=list(options["draft_config"]) or None,
    )
    config = ExtractConfig(**options)
    check_paths(config)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    show = main_rank and not config.quiet
    if not show:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the weight-loading bars too, not just ours
    manifest = run_extract(config, progress=bars(not show))
    if main_rank:
        click.echo(next_steps(config.out, manifest))

"""`specreplay import`: captures made elsewhere into shards (stage 1, pipeline/imports/run.py).

The console side: options, the progress bar, and what to run next. (`import` is a Python
keyword, so the command's function is `import_` and its module `imports`.)
"""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.common.sizes import format_size, parse_size
from pipeline.imports.config import FORMATS, ImportConfig
from specreplay.commands.defaults import default


def d(name: str):
    return default(ImportConfig, name)


def check_paths(config: ImportConfig) -> None:
    """Typed paths, before anything is read or written (pipeline/common/paths.py)."""
    from pipeline.common.paths import check_input_path, check_output_dir

    check_output_dir(config.out, "--out")
    check_input_path(config.source, "SOURCE", "directory")
    check_input_path(config.model, "--model", "any")
    for option, value in (("--capture-config", config.capture_config), ("--prompt-lens", config.prompt_lens)):
        if value is not None:
            check_input_path(value, option, "file")


@click.command(name="import", context_settings={"max_content_width": 100})
@click.argument("source")
@click.option(
    "--format", "format_", type=click.Choice(FORMATS), required=True, help="Who wrote the capture (see below)."
)
@click.option(
    "--model",
    required=True,
    help="The target the capture was made from: a transformers directory (safetensors), a .gguf file, or "
    "`smollm2`. Only its final norm, lm_head and embedding are read; the model is never loaded.",
)
@click.option("--out", default=None, help="Output directory or URI. [default: data/shards/<source name>]")
@click.option(
    "--layer-ids",
    default=None,
    help="Feature layers to store, in this project's numbering (id i = output of decoder layer i, id L = the "
    "final hidden state before the norm). [default: every captured decoder layer]",
)
@click.option(
    "--capture-config",
    default=None,
    help="JSON naming the captured layers: vLLM's --speculative-config (vllm, speculators) or the draft "
    "config (specforge: dflash_config.target_layer_ids, eagle_config.eagle_aux_hidden_state_layer_ids).",
)
@click.option(
    "--captured-layer-ids",
    default=None,
    help="Or the captured layer ids themselves, in the producer's numbering (vLLM/speculators: before layer s; "
    "SpecForge: output of layer s), in the order the capture stores them.",
)
@click.option(
    "--prompt-lens", default=None, help='vllm: JSONL of {"id": "<file stem>", "prompt_len": P}, where each prompt ends.'
)
@click.option(
    "--hidden-states",
    default=None,
    help="speculators: the directory of hs_<i>.safetensors, when not SOURCE/hidden_states.",
)
@click.option("--dataset", default=None, help="Dataset name of the samples. [default: the name of SOURCE]")
@click.option(
    "--top-k", type=int, default=d("top_k"), show_default=True, help="Next-token log-probs kept per position."
)
@click.option(
    "--feature-dtype",
    default=None,
    help="Storage dtype of features: float32, bfloat16, float16, or fp8. [default: the capture's (lossless)]",
)
@click.option("--limit", type=int, default=None, help="Import only the first N samples.")
@click.option(
    "--shard-bytes",
    default=format_size(d("shard_bytes")),
    show_default=True,
    help="Roll over to a new shard after this size (1GiB, 512MiB, ...).",
)
@click.option("--zstd-level", type=int, default=d("zstd_level"), show_default=True, help="zstd level of the shards.")
@click.option(
    "--memory-budget",
    "memory_bytes",
    default=format_size(d("memory_bytes")),
    show_default=True,
    help="Working memory beyond one sample: half for the lm_head window, half for the shard chunk.",
)
@click.option(
    "--device",
    default=d("device"),
    show_default=True,
    help="Where the final norm and lm_head run (cpu, cuda, cuda:1): the top-k is the import's only compute.",
)
@click.option("--overwrite", is_flag=True, help="Delete old outputs in --out (needed when settings changed).")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def import_(format_, **options):
    """Turn hidden states captured elsewhere into shards `score` reads, without running the target.

    \b
    SOURCE, by --format:
      vllm         the directory vLLM's ExampleHiddenStatesConnector wrote (<request id>.safetensors;
                   hs-connectors' FP8 files too); needs --capture-config and --prompt-lens
      speculators  the directory `speculators prepare-data` wrote, capture files in hidden_states/
                   (from generate-offline-data); layers default to launch_vllm.py's
      specforge    prepare_hidden_states.py's --output-path (rows_*/data_<i>.ckpt[.gz])

    The capture's layer numbering is translated into this project's; the next-token top-k is
    computed exactly from the captured final hidden state with the target's own final norm and
    lm_head. A capture without a final hidden state, with other layers than asked, or with
    all-zero hidden states is refused, naming the file. Samples are read one at a time;
    re-running the same command resumes an interrupted import. Imported responses are
    teacher-forced (not the target's greedy output), as extract marks a given response.

    \b
    Examples:
      specreplay import data/sharegpt --format speculators --model path/to/Qwen3-8B \\
          --capture-config speculative_config.json --out data/shards/qwen3-8b-sharegpt
      specreplay import cache/hidden_states/sharegpt --format specforge --model path/to/Qwen3-8B \\
          --capture-config configs/qwen3-8b-dspark.json --out data/shards/qwen3-8b-specforge
    """
    from pipeline.common.layer_ids import parse_layer_ids
    from pipeline.imports.run import run_import
    from specreplay.progress import bars

    options.update(
        format=format_,
        out=options["out"] or f"data/shards/{Path(options['source'].rstrip('/')).name}",
        layer_ids=None if options["layer_ids"] is None else parse_layer_ids(options["layer_ids"]),
        shard_bytes=parse_size(options["shard_bytes"], "--shard-bytes"),
        memory_bytes=parse_size(options["memory_bytes"], "--memory-budget"),
    )
    config = ImportConfig(**options)
    check_paths(config)
    manifest = run_import(config, progress=bars(config.quiet))
    click.echo(next_steps(config.out, manifest))


def next_steps(out: str, manifest: dict) -> str:
    """What the import wrote and what to run next (extract's hint, whose words fit)."""
    from specreplay.commands.extract import next_steps as extract_next_steps

    return extract_next_steps(out, manifest)

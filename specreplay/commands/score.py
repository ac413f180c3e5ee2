"""`specreplay score`: replay shards through drafter checkpoints (stage 2, scoring/score/steps.py)."""

from __future__ import annotations

import json
import os
import sys

import click

from pipeline.common.errors import UserError
from pipeline.common.sizes import format_size, parse_size
from proposers.baselines import NAMED
from proposers.registry import FAMILY_NAMES, LAYOUT_LABELS
from scoring.config import DEFAULT_EAGLE_TREES, WALK_RULES, ScoreConfig
from scoring.score.outcome import Status
from specreplay.commands.defaults import default


def parse_tree_nodes(text: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16]; '' -> [] (chain only)."""
    try:
        budgets = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--ddtree-budgets: expected comma-separated integers like 4,8,16; got {text!r}") from None
    if any(b < 1 for b in budgets):
        raise UserError(f"--ddtree-budgets {text!r}: DDTree budgets (tree nodes) must be >= 1")
    return budgets


def parse_eagle_trees(text: str | None) -> list[str] | None:
    """'4x5-8,8x5-32' -> ['4x5-8', '8x5-32'] (checked); None (not given) -> None: the default for
    EAGLE-3 drafters, none for the others."""
    if text is None:
        return None
    from scoring.methods.eagle_tree import parse_eagle_trees as parse

    return [tree.name for tree in parse(text)]


def d(name: str):
    return default(ScoreConfig, name)


@click.command(context_settings={"max_content_width": 100})
@click.option(
    "--ckpt",
    "ckpts",
    multiple=True,
    required=True,
    help="Drafter checkpoint: a z-lab directory (config.json + safetensors), a training "
    "checkpoint (.safetensors/.pt + config.json beside it) or a llama.cpp drafter .gguf; or a baseline "
    "that needs no trained drafter, as its engine's settings in a .json file or by name: "
    f"{', '.join(entry.usage() for entry in NAMED)} (docs/baselines.md). Repeat "
    "it or pass a quoted glob ('runs/*/step_*') to score several; each gets its own results directory, and "
    "each trained drafter is compared with each baseline scored beside it.",
)
@click.option("--shards", required=True, help="Extract output directory (local path or pyarrow.fs URI).")
@click.option("--out", required=True, help="Parent of the results: each checkpoint writes --out/<parent>_<name>/.")
@click.option(
    "--ddtree-budgets",
    "tree_nodes",
    default=",".join(map(str, d("tree_nodes"))),
    show_default=True,
    help="DDTree budgets (nodes per tree) to simulate; empty string for chain only.",
)
@click.option(
    "--eagle-trees",
    "eagle_trees",
    default=None,
    help="EAGLE-3 drafters only: sglang's dynamic trees to simulate beside the chain, as "
    "topk x depth - draft tokens (--speculative-eagle-topk, --speculative-num-steps, "
    f"--speculative-num-draft-tokens), comma-separated; default {','.join(DEFAULT_EAGLE_TREES)} "
    "(sglang's own); empty string for none. Greedy shards only. Methods eagle-tree-4x5-8, ...",
)
@click.option(
    "--family",
    default=None,
    metavar="NAME[:LAYOUT]",
    help=f"Read every checkpoint's config as this family's ({', '.join(FAMILY_NAMES)}), and optionally this "
    f"layout's ({', '.join(LAYOUT_LABELS)}), instead of detecting it (detection says when it assumed one).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    help="Drafts per step: of an EAGLE-3 or MTP chain (vLLM's num_speculative_tokens, sglang's "
    "--speculative-num-steps; default the checkpoint's speculative_tokens, else 3); of a block drafter "
    "under an engine's --walk-rule, which runs a block of that many drafts (llama.cpp's "
    "--spec-draft-n-max, whose default is 3; default the trained block).",
)
@click.option(
    "--confidence-threshold",
    type=click.FloatRange(min=0.0, max=1.0),
    default=None,
    help="DSpark drafters with a confidence head: end each proposal at the first slot whose predicted "
    "acceptance is below this (llama-server's --spec-draft-p-min, DeepSpec's --confidence-threshold; 0: "
    "never); default the checkpoint's confidence_threshold, else 0.",
)
@click.option(
    "--walk-rule",
    type=click.Choice(list(WALK_RULES)),
    default=d("walk_rule"),
    show_default=True,
    help="Whose online loop the walk follows near the end of a response and what it counts as "
    "accepted: dflash = dflash_generate (block shortened to the budget); llama.cpp = llama-server "
    "(full block, drafts cut to the budget minus one, a last-token plain decode); vllm, sglang = "
    "full block, every draft verified, drafts accepted past the end counted (a lower bound "
    "offline). walk.parquet's drafted/counted_accepted columns hold the engine's numbers "
    "(docs/walk-rules.md).",
)
@click.option("--device", default=d("device"), show_default=True, help="auto (GPU if present), cpu, cuda, cuda:1 ...")
@click.option(
    "--dtype", default=d("dtype"), show_default=True, help="auto = fp32 on CPU, bf16 on GPU; or fp32/bf16/fp16."
)
@click.option(
    "--memory-budget",
    "memory_bytes",
    default=format_size(d("memory_bytes")),
    show_default=True,
    help="Working memory for one batch of anchors; sets the chunk sizes, and how many checkpoints' "
    "drafters share one pass over the shards (as many as their weights fit).",
)
@click.option(
    "--attention",
    type=click.Choice(["auto", "dense", "blockwise", "flex"]),
    default=d("attention"),
    show_default=True,
    help="auto = block-sparse flex_attention on CUDA, blockwise (context keys in chunks) on CPU; "
    "dense = explicit masks over every key (the reference path).",
)
@click.option(
    "--anchors",
    "anchors",
    type=click.Choice(["all", "walk"]),
    default=d("anchors"),
    show_default=True,
    help="all: every response position (walk numbers plus dense all-anchor metrics); walk: only the "
    "anchors the simulated walks visit (same walk numbers, about tau times less drafter work).",
)
@click.option(
    "--anchor-drafts",
    is_flag=True,
    help="Also store every anchor's draft block in anchors.parquet (block_size - 1 ints per token); "
    "walk.parquet always keeps the blocks of the walk's steps.",
)
@click.option("--limit", type=int, default=None, help="Score only the first N samples (after --datasets).")
@click.option(
    "--sample",
    type=int,
    default=None,
    help="Score N samples drawn at random (--seed), spread over the datasets in proportion to their sizes.",
)
@click.option("--seed", type=int, default=d("seed"), show_default=True, help="Seed of --sample.")
@click.option("--datasets", default=None, help="Only these datasets, comma-separated (e.g. gsm8k,humaneval).")
@click.option(
    "--force", is_flag=True, help="Re-score and replace results already in --out, even when their settings differ."
)
@click.option(
    "--profile",
    "profile_path",
    default=None,
    metavar="PROFILE.json",
    help="A cost profile of the serving side (`specreplay profile`, docs/speed.md): each headline adds the "
    "fastest configuration's predicted speedup per measured batch size (`specreplay speed` has the table).",
)
@click.option("--no-progress", is_flag=True, help="No progress bars (the tables are still printed).")
@click.option("--quiet", is_flag=True, help="No progress bars and no tables: one headline line per checkpoint.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome of every checkpoint as JSON (stdout) instead.")
def score(no_progress, quiet, as_json, profile_path, **options):
    """Replay stored shards through drafter checkpoints; write exact acceptance metrics.

    Each checkpoint gets its own results directory, --out/<parent>_<name>/ (runs/tiny/step_300
    -> data/results/tiny_step_300/), holding anchors.parquet, walk.parquet, samples.parquet,
    summary.parquet and run.json. A checkpoint already scored there with the same settings is
    skipped; one scored with other settings is refused unless --force. Prints one headline per
    checkpoint (pooled chain tau, best DDTree budget, all-anchor streak) and, for several, a
    table across them. Exits 1 when a checkpoint could not be scored (the others still are).

    \b
    Example:
      specreplay score --ckpt runs/tiny/step_300 --shards data/shards/smollm2-default --out data/results
      specreplay score --ckpt 'runs/tiny/step_*' --shards data/shards/smollm2-default --out data/results \\
          --sample 8 --seed 0 --ddtree-budgets 16,64
    """
    from pipeline.common.paths import check_input_path, check_output_dir, check_results_parent, check_roles
    from scoring.score.checkpoints import expand_checkpoints

    datasets = [name.strip() for name in (options["datasets"] or "").split(",") if name.strip()]
    options.update(
        ckpts=list(options["ckpts"]),
        tree_nodes=parse_tree_nodes(options["tree_nodes"]),
        eagle_trees=parse_eagle_trees(options["eagle_trees"]),
        memory_bytes=parse_size(options["memory_bytes"], "--memory-budget"),
        datasets=datasets or None,
    )
    config = ScoreConfig(**options)
    if config.family is not None:
        from proposers.layouts import Override

        Override.parse(config.family)  # a misspelt family fails here, before any shard or weight is read
    check_input_path(config.shards, "--shards", "directory")
    if "://" not in config.shards and not os.path.exists(config.shards):
        raise UserError(f"--shards: no such directory: {config.shards}; give the directory `specreplay extract` wrote")
    check_roles(config.ckpts, config.shards)
    check_output_dir(config.out, "--out")
    check_results_parent(config.out, "--out")
    expand_checkpoints(config.ckpts)  # a missing checkpoint said now, not after torch loads
    # torch and the replay load after the arguments' checks: a user error returns in a second
    from pipeline.common import timing
    from scoring.score.run import run_score
    from specreplay.progress import bars

    profile = checked_profile(profile_path, config.shards)
    printer = OutcomePrinter(quiet or as_json, config.shards, profile)
    with timing.recording(printer.times):  # what the checkpoints share, said once (PassTimes)
        outcomes = run_score(config, progress=bars(no_progress or quiet), on_outcome=None if as_json else printer)
    if not outcomes:  # ranks other than 0 under torchrun
        return
    if as_json:
        from scoring.score.console import outcome_json

        click.echo(json.dumps([outcome_json(o) for o in outcomes], indent=1))
    else:
        printer.finish(outcomes, config.out)
    if any(o.status == Status.FAILED for o in outcomes):
        sys.exit(1)


def checked_profile(path: str | None, shards: str):
    """The --profile, validated and checked against the shards' target before anything is scored."""
    if path is None:
        return None
    from pipeline.shards import ShardSet
    from scoring.speed.profile import load_profile

    profile = load_profile(path)
    profile.check_target(ShardSet(shards).manifest["settings"]["target"], shards)
    return profile


class OutcomePrinter:
    """Prints each checkpoint as it finishes, then the table across them and what to run next."""

    def __init__(self, quiet: bool, shards: str, profile=None):
        from scoring.score.console import PassTimes

        self.quiet, self.shards, self.profile = quiet, shards, profile
        self.times = PassTimes()  # the timing recorder of the run

    def __call__(self, outcome) -> None:
        from scoring.score.console import failure_text, floor_warning, headline, print_table, warning_lines
        from specreplay.hints import program

        if outcome.status == Status.FAILED:
            click.echo(f"error: {failure_text(outcome)}", err=True)
            return
        if outcome.status == Status.SKIPPED:
            click.echo(f"{outcome.name}: already scored with these settings in {outcome.out_dir} (--force to redo)")
        elif not self.quiet:
            click.echo("")
            print_table(outcome.summary, outcome.record, outcome.out_dir, self.times.took(outcome.record))
        click.echo(headline(outcome.name, outcome.summary))
        if self.profile is not None:
            from scoring.speed.run import fastest_line

            click.echo(f"  {fastest_line(outcome.out_dir, self.profile)}")
        if outcome.assumed:
            click.echo(f"  note: {outcome.name}: {outcome.assumed}", err=True)
        if self.quiet and outcome.status == Status.SCORED:
            for line in warning_lines(outcome.record):  # left-out samples are never silent
                click.echo(f"  {line}", err=True)
        for line in floor_warning(outcome.summary, outcome.ckpt, self.shards, program()):
            click.echo(line, err=True)

    def finish(self, outcomes: list, out: str) -> None:
        from scoring.compare.baselines import lines as baseline_lines
        from scoring.score.console import across_table, failure_lines, next_lines
        from specreplay.hints import program

        if sum(o.summary is not None for o in outcomes) >= 2:
            click.echo("\n" + "\n".join(across_table(outcomes)))
            versus = baseline_lines([o.out_dir for o in outcomes if o.summary is not None])
            if versus:
                click.echo("against the baselines (pooled chain tau, 95% paired-bootstrap interval):")
                click.echo("\n".join(f"  {line}" for line in versus))
        timed = self.times.summary_line()
        if timed is not None and not self.quiet and sum(o.status == Status.SCORED for o in outcomes) >= 2:
            click.echo(timed)
        for line in failure_lines(outcomes):
            click.echo(line, err=True)
        for line in next_lines(outcomes, out, program()):
            click.echo(line)

"""`specreplay inspect`: summarise an extract directory and verify its checksums."""

from __future__ import annotations

import json
import sys

import click


def stored_tokenizer(directory: str) -> str | None:
    """Where the extract stored the target's tokenizer (None: an older extract stored none)."""
    from pipeline import shards

    fs, root = shards.open_fs(directory)
    found = shards.exists(fs, shards.join(root, shards.TOKENIZER_DIR))
    return shards.join(directory, shards.TOKENIZER_DIR) if found else None  # as the user wrote the directory


def tokenizer_line(path: str | None) -> str:
    if path is None:
        return "  tokenizer       not stored (extracted by an older specreplay)"
    return f"  tokenizer       {path} (AutoTokenizer.from_pretrained)"


@click.command(context_settings={"max_content_width": 100})
@click.argument("directory", default="data/shards/smollm2-default")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (for scripts).")
@click.option("--no-verify", is_flag=True, help="Skip the shard checksum pass (it reads every byte).")
def inspect(directory, as_json, no_verify):
    """Summarise an extract directory and verify its shard checksums.

    Samples, tokens, bytes per token against raw bf16 features, layer ids, finish reasons,
    greedy-consistency rate (share of response tokens equal to the full-forward argmax).
    Exits with status 1 when a checksum fails or the extract is not complete (resume it by running
    the same extract command again).

    \b
    Examples:
      specreplay inspect data/shards/smollm2-default
      specreplay inspect data/shards/smollm2-default --json | jq .greedy_consistency
    """
    from pipeline.common.paths import check_input_path
    from pipeline.extract.inspect import format_report, inspect_extract, report_problems

    check_input_path(directory, "inspect", "directory")
    report = inspect_extract(directory, verify=not no_verify)
    report["tokenizer"] = stored_tokenizer(directory)
    text = format_report(report) + "\n" + tokenizer_line(report["tokenizer"])
    click.echo(json.dumps(report, indent=1, sort_keys=True) if as_json else text)
    problems = report_problems(report, directory)
    if problems:  # the report above says what is fine; this says what is not, one problem a line
        for problem in problems:
            click.echo(f"error: {problem}", err=True)
        sys.exit(1)

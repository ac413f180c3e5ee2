"""`specreplay` console script: one click group, one subcommand per verb.

Subcommands import their stage lazily so `specreplay score` never loads pipeline's
target-loading code, and `--help` stays fast.
"""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="specreplay")
def main():
    """Extract a target model's features once; score any DFlash drafter against them offline.

    \b
    Typical use:
      specreplay extract --model smollm2 --prompts default --out data/shards/smollm2
      specreplay score --ckpt path/to/drafter --shards data/shards/smollm2 --out data/results/run1
      specreplay inspect data/shards/smollm2
    """


# Subcommands register themselves below (pipeline: extract, inspect; scoring: score).
from pipeline.extract_cli import extract, inspect  # noqa: E402

main.add_command(extract)
main.add_command(inspect)

from scoring.score_cli import fit, score  # noqa: E402

main.add_command(score)
main.add_command(fit)

from scoring.compare_cli import compare  # noqa: E402
from scoring.report_cli import report  # noqa: E402

main.add_command(compare)
main.add_command(report)


if __name__ == "__main__":
    main()

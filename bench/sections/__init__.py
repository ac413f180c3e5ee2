"""The sections of `make bench`. Each module exposes `run(ctx) -> (figures, rows)`: its figures
(JSON-able, written to bench/results/bench-*.json under the section's name) and its table rows
(bench.common.Row). A section reads what an earlier one produced from `ctx.figures`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

# Run (and print) order of the default run. length runs before memory because memory writes
# ~16 GiB of stand-in weights and shards, which evicts the page cache.
DEFAULT = (
    "extract",
    "codecs",
    "reader",
    "imports",
    "engine",
    "fp32",
    "score",
    "ddtree",
    "checkpoints",
    "families",
    "baselines",
    "speed",
    "eagle",
    "gemm",
    "fp8",
    "sampling",
    "length",
    "memory",
)
# Experiments that explain a design choice but are no figure of the product: only with --research.
RESEARCH = ("research",)
# A section needs the figures of these; skipping one skips its dependents, --only pulls them in.
REQUIRES = {
    "codecs": ("extract",),
    "reader": ("extract",),
    "imports": ("extract",),
    "research": ("extract",),
    "fp8": ("score",),
}
ALIASES = {"big": "memory"}  # the name `--skip` used before the sections were split


@dataclass
class Context:
    args: object  # the parsed command line (bench/__main__.py)
    work: Path  # this run's scratch directory
    figures: dict = field(default_factory=dict)  # section name -> its figures, as they finish


def load(name: str):
    """The section module `name` (imported on use: a section's imports stay out of the others)."""
    import importlib

    return importlib.import_module(f"bench.sections.{name}")

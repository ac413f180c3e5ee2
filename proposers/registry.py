"""The one place proposer families are registered: a folder of proposers/ per family, listed here.

A family's folder holds (docs/proposers.md: what each file does, and how to add one):

    __init__.py   what the family is, torch-free
    layout.py     its config.json layouts, declared (torch-free: stage 1 reads feature layers through
                  them): `LABEL`, `LAYOUTS`
    config.py     a validated layout -> the config its model is built from; `FAMILY`, its record below
    model.py      its network (a trained drafter), or proposer.py (one that loads no weights)
    tree.py       its own tree proposals, when it drafts trees (EAGLE-3)

Torch-free: this module and the layout modules load without torch (stage 1, results, report);
a family's config.py, with its model, loads only when asked for (`family`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# Every family, by its folder under proposers/ (results' drafter_family values; `score --family`)
FAMILY_NAMES = ("dflash", "dflash2", "xpress", "dspark", "eagle3", "peagle", "eagle", "mtp", "ngram", "draft", "suffix")
# The families that need no trained drafter: the baselines a trained one is measured against
# (compare, report and watch put each drafter beside them: scoring/compare/baselines.py)
BASELINE_FAMILIES = ("ngram", "draft", "suffix")

# Whose config layout a drafter was read from, as messages and the headline name them
LAYOUT_LABELS = {
    "z-lab": "z-lab",
    "speculators": "speculators",
    "specforge": "SpecForge",
    "deepspec": "DeepSpec",
    "qwen3-omni": "vLLM's Qwen3-Omni",
    "k3": "Kimi K3's",
    "native": "the target's own",
    "vllm": "vLLM's",
    "llama.cpp": "llama.cpp's",
    "sglang": "SGLang's",
    "eagle": "the EAGLE repository's",
}


@dataclass(frozen=True)
class Family:
    """What the rest of the project knows of a family (its config.py's `FAMILY`)."""

    name: str  # its folder, the registry's key
    # (validated layout, raw config, source, the target's layer count or None) -> its config
    parse_config: Callable[[Any, dict, str, int | None], Any]
    model: Callable[[Any], Any] | None  # the network for a parsed config, weights not loaded; None: it has none
    # a family without weights: its proposer built from the config alone (its checkpoint is a JSON file)
    proposer: Callable[[Any], Any] | None = None
    # DDTree scores prefixes by per-position marginals: exact only for drafts that are independent
    # given the block (DFlash); a selector or Markov head makes each draft depend on the last
    independent_drafts: bool = True
    # its own tree proposals (proposers.interface.TreeProposer.tree_candidates), None: it drafts none
    tree: Callable | None = None
    # its chain is autoregressive steps whose number an engine sets (`score --steps`: EAGLE-3, MTP);
    # False: it drafts its trained block at once
    chain_steps: bool = False
    # a family without `model` that loads weights of its own (a draft model): (config) -> their count,
    # read before loading (a pass's size; refused over --memory-budget); None: it loads none
    parameters: Callable[[Any], int] | None = None
    # (config, manifest, shards uri, ckpt) -> None, raising when it cannot draft for the shards (a draft
    # model's vocabulary; XPress on sampled shards); a trained drafter's widths: compatibility.py
    check_shards: Callable[[Any, dict, str, str], None] | None = None
    # (config, threshold, ckpt) -> None: `score --confidence-threshold` set on a family whose drafter
    # cuts its proposals by confidence (DSpark), raising where it cannot; None: the option is refused
    set_confidence_threshold: Callable[[Any, float, str], None] | None = None

    @property
    def label(self) -> str:
        return family_label(self.name)


def layout_module(name: str) -> ModuleType:
    """proposers.<name>.layout (torch-free); KeyError for a name that is not a family."""
    if name not in FAMILY_NAMES:
        raise KeyError(name)
    return importlib.import_module(f"proposers.{name}.layout")


def family_label(name: str) -> str:
    """'DSpark' for 'dspark' (the name itself for a name that is not a family's, e.g. older results)."""
    return layout_module(name).LABEL if name in FAMILY_NAMES else name


def layout_label(layout: str) -> str:
    return LAYOUT_LABELS.get(layout, layout)


def layout_classes(names=FAMILY_NAMES) -> list[type]:
    """Every declared layout of the families `names`, each once, in registry order."""
    found = []
    for name in names:
        found += [cls for cls in layout_module(name).LAYOUTS if cls not in found]
    return found


def families_of(layout: type) -> list[str]:
    """The families that read configs in `layout` (z-lab's is DFlash's and DFlash2's)."""
    return [name for name in FAMILY_NAMES if layout in layout_module(name).LAYOUTS]


def family(name: str) -> Family:
    """The family record (imports its config.py and model: torch)."""
    record = importlib.import_module(f"proposers.{name}.config").FAMILY
    if record.name != name:
        raise RuntimeError(f"proposers/{name}/config.py registers itself as {record.name!r}")
    return record

"""llama-server's DSpark confidence cut against specreplay's `confidence_threshold`
(tests/parity/test_engine_parity.py): the server run with `--spec-draft-p-min P` (the flag
docs/speculative.md:103-104 calls `--spec-draft-conf-min`; common/arg.cpp:4197 defines only
`--spec-draft-p-min`), specreplay scoring the same checkpoint with `confidence_threshold: P` in its
config.json, and the wrong readings of llama.cpp's rule (common/speculative.cpp:1267-1276: the
slots from the first whose sigmoid confidence is strictly below P are not proposed, each slot's
confidence reading the drafter's own previous draft, src/models/dflash.cpp:369-385) that must walk
otherwise.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest
import torch

from pipeline.shards import ShardSet
from proposers.dspark.model import DSparkDrafter
from tests.helpers import engine_parity as parity, llama_engine as engine

# The wrong readings of the cut a fitted head tells apart (wrong_rule says how each patches DSparkDrafter)
WRONG_RULES = ("after the slot", "stored predecessors", "raw logit")
AT_THRESHOLD = "at or below"  # sigmoid(c) <= P: only a confidence exactly at P tells it apart (flat_confidence)


def with_threshold(path: str, out: Path, threshold: float) -> str:
    """A copy of the speculators checkpoint at `path` with `confidence_threshold` in its config.json."""
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"confidence_threshold": threshold}))
    return str(out)


def served_with_threshold(drafter: parity.Drafter, path: str, threshold: float) -> parity.Drafter:
    """The converted drafter served with llama-server's confidence cut at `threshold`, scored from `path`."""
    layout = f"{drafter.layout}-p{threshold}"
    return replace(drafter, layout=layout, path=path, flags=("--spec-draft-p-min", str(threshold)))


def confidence_cuts(results: str, shards: str, n_max: int, max_new: int) -> int:
    """Walk steps that drafted fewer than n_max where the budget left room for n_max: the cuts the
    confidence head made (llama-server's n_draft_max is the positions left minus two)."""
    prompts = {s.sample_id: s.prompt_len for s in ShardSet(shards).samples(tensors=[])}
    walk = pl.read_parquet(f"{results}/walk.parquet", glob=False).filter(pl.col("method") == "chain")
    cuts = 0
    for sid, anchor, drafted in walk.select("sample_id", "anchor", "drafted").iter_rows():
        room = prompts[sid] + max_new - anchor - 2
        cuts += drafted < min(n_max, room)
    return cuts


@contextlib.contextmanager
def wrong_rule(name: str):
    """DSparkDrafter reading llama.cpp's cut one plausible wrong way."""
    with pytest.MonkeyPatch.context() as patch:
        if name == "after the slot":  # the low-confidence slot still proposed, the cut after it
            patch.setattr(DSparkDrafter, "proposal_limit", _cut_after(DSparkDrafter.proposal_limit))
        elif name == "stored predecessors":  # each slot's confidence given the stored token, not its own draft
            patch.setattr(DSparkDrafter, "cuts_by_previous", property(lambda self: False))
        elif name == "raw logit":  # the head's logit against P, no sigmoid
            patch.setattr(DSparkDrafter, "below_threshold", _raw_below)
        elif name == AT_THRESHOLD:  # a slot whose confidence equals P cut too
            patch.setattr(DSparkDrafter, "below_threshold", _at_or_below)
        else:
            raise ValueError(name)
        yield


def _cut_after(limit):
    def cut_after(self, confidence):
        kept = limit(self, confidence)
        return None if kept is None else (kept + 1).clamp(max=confidence.shape[-1])

    return cut_after


def _raw_below(self, confidence: torch.Tensor) -> torch.Tensor:
    return confidence < self.config.family_options["confidence_threshold"]


def _at_or_below(self, confidence: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(confidence) <= self.config.family_options["confidence_threshold"]


def flat_confidence(path: str, out: Path) -> str:
    """A copy of the checkpoint at `path` whose confidence head is zero, weights and bias: every
    slot's confidence is sigmoid(0) = 0.5 exactly, in torch and in ggml (1 / (1 + exp(0))), so at
    P = 0.5 the strict cut keeps every slot and a non-strict one none."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    state = load_file(str(out / "model.safetensors"))
    for name in ("confidence_head.proj.weight", "confidence_head.proj.bias"):
        state[name] = torch.zeros_like(state[name])
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def differing_samples(setup: parity.Setup, drafter: parity.Drafter, served: dict, n_max: int, rule: str) -> int:
    """Samples whose walk under the wrong reading `rule` differs from llama-server's steps `served`."""
    out = setup.tmp / f"dspark-cut-{rule.replace(' ', '-')}"
    with wrong_rule(rule):
        counts = engine.walk_counts(parity.score(drafter, setup.shards, out, walk_rule="llama.cpp", steps=n_max))
    return sum(counts.get(sid) != steps for sid, steps in served.items())


def option_counts(setup: parity.Setup, drafter: parity.Drafter, ckpt: str, n_max: int, threshold: float) -> dict:
    """The llama.cpp walk's counts of `ckpt` (a checkpoint without the field, or the GGUF llama-server
    serves) scored with `score --confidence-threshold`."""
    out = setup.tmp / f"dspark-option-{Path(ckpt).name}"
    options = dict(walk_rule="llama.cpp", steps=n_max, confidence_threshold=threshold)
    return engine.walk_counts(parity.score(replace(drafter, path=ckpt), setup.shards, out, **options))


def option_refusal(ckpt: str, shards: str, out: Path) -> str:
    """`specreplay score --confidence-threshold 0.5` on `ckpt`: its one `error:` line (nothing written)."""
    from click.testing import CliRunner

    from specreplay.cli import main

    args = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--quiet", "--confidence-threshold", "0.5"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code != 0 and run.output.count("error:") == 1, run.output
    assert "Traceback" not in run.output and not any(out.glob("*/summary.parquet")), run.output
    return run.output

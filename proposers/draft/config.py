"""The draft model's settings in the project's terms, and its registry record."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pipeline.common.errors import UserError
from proposers.draft.checks import check_shards, parameters
from proposers.draft.layout import LlamaDraftSimple
from proposers.draft.proposer import DraftModelProposer
from proposers.registry import Family


@dataclass
class DraftConfig:
    model_dir: str  # the draft model's transformers checkpoint (checked when it loads)
    block_size: int  # drafts per step: llama-server's --spec-draft-n-max (`score --steps` sets it)
    family: str = "draft"
    layout: str = "llama.cpp"
    raw: dict = field(default_factory=dict, repr=False)


def parse_config(checked: LlamaDraftSimple, raw: dict, source: str = "config", target_layers: int | None = None):
    folder = os.path.dirname(os.path.abspath(source))
    model_dir = os.path.normpath(os.path.join(folder, os.path.expanduser(checked.model_draft)))
    if checked.n_min > 0:  # the server drops a chain shorter than n-min after cutting it to the budget
        raise UserError(
            f"{source}: field 'spec-draft-n-min' is {checked.n_min}: llama.cpp's minimum draft length is not "
            "replayed yet (its interplay with the budget's cut); score with the server's default 0"
        )
    if checked.p_min > 0:  # where the chain ends depends on the drafts after a rejected one
        raise UserError(
            f"{source}: field 'spec-draft-p-min' is {checked.p_min}: llama.cpp's chain then ends at the first "
            "draft below it, also after a draft the target rejected, whose successors the stored response does "
            "not hold; not replayed yet: score with the server's default 0"
        )
    return DraftConfig(model_dir, checked.n_max, raw=raw)


FAMILY = Family(
    "draft",
    parse_config,
    model=None,
    proposer=DraftModelProposer,
    independent_drafts=False,
    chain_steps=True,
    parameters=parameters,
    check_shards=check_shards,
)

"""The draft model's settings in the project's terms, and its registry record."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pipeline.common.errors import UserError
from proposers.draft.checks import check_shards, model_config, parameters
from proposers.draft.layout import VllmDraftModel
from proposers.draft.pard import PardProposer, mask_token_id
from proposers.draft.proposer import DraftModelProposer
from proposers.registry import Family


@dataclass
class DraftConfig:
    model_dir: str  # the draft model's transformers checkpoint (checked when it loads)
    block_size: int  # drafts per step: llama-server's --spec-draft-n-max (`score --steps` sets it)
    family: str = "draft"
    layout: str = "llama.cpp"
    parallel_drafting: bool = False  # vLLM's PARD: K drafts from one pass over K - 1 mask tokens (pard.py)
    heterogeneous_vocab: bool = False  # vLLM's use_heterogeneous_vocab: another tokenizer, mapped (vocab_mapping.py)
    raw: dict = field(default_factory=dict, repr=False)


def _model_dir(path: str, source: str) -> str:
    """The draft model's directory: absolute, or relative to the config file's folder."""
    folder = os.path.dirname(os.path.abspath(source))
    return os.path.normpath(os.path.join(folder, os.path.expanduser(path)))


def parse_config(checked, raw: dict, source: str = "config", target_layers: int | None = None):
    if isinstance(checked, VllmDraftModel):
        return _vllm_config(checked, raw, source)
    model_dir = _model_dir(checked.model_draft, source)
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


def _vllm_config(checked: VllmDraftModel, raw: dict, source: str) -> DraftConfig:
    if checked.draft_sample_method != "greedy":  # q would be the draft model's own distribution
        raise UserError(
            f"{source}: field 'draft_sample_method' is {checked.draft_sample_method!r}: vLLM's probabilistic "
            "drafting is not replayed yet; score with its default 'greedy'"
        )
    model_dir, k = _model_dir(checked.model, source), checked.num_speculative_tokens
    return DraftConfig(
        model_dir,
        k,
        layout="vllm",
        parallel_drafting=checked.parallel_drafting,
        heterogeneous_vocab=checked.use_heterogeneous_vocab,  # greedy only: refused above otherwise, as vLLM does
        raw=raw,
    )


def proposer(config: DraftConfig):
    """vLLM's parallel drafting (PARD) or the autoregressive chain both engines run."""
    return PardProposer(config) if config.parallel_drafting else DraftModelProposer(config)


def check_draft(config: DraftConfig, manifest: dict, uri: str, ckpt: str) -> None:
    """The draft model against the shards (checks.py) and, for PARD, its mask token: before any weight."""
    check_shards(config, manifest, uri, ckpt)
    if config.parallel_drafting:
        mask_token_id(model_config(config), f"draft model {config.model_dir}")


FAMILY = Family(
    "draft",
    parse_config,
    model=None,
    proposer=proposer,
    independent_drafts=False,
    chain_steps=True,
    parameters=parameters,
    check_shards=check_draft,
)

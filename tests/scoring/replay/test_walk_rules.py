"""The walk rules' counts on steps whose outcome the engines' source decides (docs/walk-rules.md):
each case is one step at one anchor, read in llama.cpp's server loop (the cut to n_remaining - 1,
the plain last decode, the end-of-generation token inside a draft) and vLLM's scheduler (every draft
verified, counted past the end). The engine tests (tests/parity/test_engine_parity.py) hold the
llama.cpp rule to a running llama-server."""

from __future__ import annotations

import pytest
import torch

from scoring.config import WALK_RULES
from scoring.replay.walk_rules import BIG, RULES

NO_STOP = 10**6


def counts(rule: str, accepted, depth, remaining, stop=NO_STOP, produced=None, known=None):
    """One step's (drafted, counted accepted, exact) under `rule`."""
    one = lambda v: torch.tensor([v])  # noqa: E731
    steps = {
        "accepted": one(accepted),
        "depth": one(depth),
        "remaining": one(remaining),
        "stop": one(stop),
        "produced": one(accepted + 1 if produced is None else produced),
        "known": one(depth if known is None else known),
    }
    got = RULES[rule].counts(steps)
    return int(got.drafted), int(got.accepted), bool(got.exact)


def test_every_rule_the_cli_offers_is_registered():
    assert tuple(RULES) == WALK_RULES


@pytest.mark.parametrize(
    "case, step, expected",
    [
        # server-context.cpp get_n_draft_max: min(.., n_remaining - 1), n_remaining = remaining - 1
        ("full block, budget far", dict(accepted=3, depth=3, remaining=20), (3, 3, True)),
        ("cut to remaining - 2", dict(accepted=3, depth=3, remaining=4), (2, 2, True)),
        ("one token left: plain decode", dict(accepted=1, depth=3, remaining=2), (0, 0, True)),
        # sampling.cpp common_sampler_sample_and_accept_n: a matched EOG before the last draft ends
        # verification as the step's own token; as the last draft it is counted
        ("stop token mid-draft", dict(accepted=2, depth=3, remaining=20, stop=2), (3, 1, True)),
        ("stop token as last draft", dict(accepted=3, depth=3, remaining=20, stop=3), (3, 3, True)),
        ("stop token after a mismatch", dict(accepted=1, depth=3, remaining=20, stop=3), (3, 1, True)),
    ],
)
def test_llama_cpp_counts(case, step, expected):
    assert counts("llama.cpp", **step) == expected, case


def test_vllm_and_sglang_count_every_draft_and_say_when_the_stored_response_cannot():
    # all 3 drafts verified against stored tokens: exact whatever is accepted
    assert counts("vllm", accepted=3, depth=3, remaining=2) == (3, 3, True)
    # the response ends after 2 drafts, both matched: the third may be accepted too (a lower bound)
    assert counts("vllm", accepted=2, depth=3, remaining=20, known=2) == (3, 2, False)
    # a mismatch inside the stored tokens decides it
    assert counts("sglang", accepted=1, depth=3, remaining=20, known=2) == (3, 1, True)


def test_dflash_reports_its_acceptance_lengths():
    # dflash_generate's acceptance length is `produced`, capped by the budget and the stop token
    assert counts("dflash", accepted=3, depth=2, remaining=3, produced=2) == (2, 1, True)


def test_only_dflash_shortens_the_tail_block():
    remaining = torch.tensor([1, 2, 9])
    assert RULES["dflash"].block_remaining(remaining).tolist() == [1, 2, 9]
    for name in ("llama.cpp", "vllm", "sglang"):
        assert RULES[name].block_remaining(remaining).tolist() == [BIG] * 3


def test_the_wrong_rules_disagree_with_llama_cpp_where_it_differs():
    """The plausible wrong rules for llama-server (dflash's counts, vLLM's uncut counts) give other
    numbers on the cut and the last-draft stop token, so the engine test can tell them apart."""
    cut = dict(accepted=3, depth=3, remaining=4, produced=3)
    assert counts("dflash", **cut)[:2] != counts("llama.cpp", **cut)[:2]
    assert counts("vllm", **cut)[:2] != counts("llama.cpp", **cut)[:2]
    last = dict(accepted=3, depth=3, remaining=20, stop=3, produced=3)
    assert counts("dflash", **last)[1] != counts("llama.cpp", **last)[1]

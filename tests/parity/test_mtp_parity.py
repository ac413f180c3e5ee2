"""Exactness of MTP replay: `score --ckpt <target dir>` against an online greedy loop written from
the rule alone (tests/helpers/mtp_online.py: transformers' own Qwen3.5 decoder layer on a real
growing KV cache). The target is a tiny random Qwen3.5 (all layers full attention) saved with an
`mtp.*` head fitted on its own greedy continuations, so chains accept several tokens.

- every walk's `produced` equals the online loop's, step for step;
- replayed under the other pre/post-norm rule (the `mtp-prenorm` variant: the target's final
  hidden state before its final norm), the walks differ: the test can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.shards import ShardSet
from scoring.drafters.checkpoint import load_drafter
from scoring.drafters.conventions import Conventions
from scoring.replay.anchors import replay_walks
from scoring.replay.packing import ReplayOptions, prepare_target_head
from scoring.replay.walk import stop_mask
from scoring.results import CHAIN
from tests.helpers import chain_parity as parity, mtp_online as online
from tests.helpers.prompts import write_prompts

MAX_NEW = 20
PROMPTS = 6
STEPS = 3  # the native head's default (mtp.DEFAULT_STEPS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _greedy(target, prompt: list[int], max_new: int) -> torch.Tensor:
    ids = torch.tensor(prompt)
    for _ in range(max_new):
        ids = torch.cat([ids, online.target_states(target, ids)[0][-1].argmax()[None]])
    return ids


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtp_parity")
    model_dir, target, head = online.build_target(tmp / "target")
    prompt_ids = parity.prompt_ids(PROMPTS)
    # the scored prompts' continuations too (as the EAGLE-3 parity test fits on its greedy responses)
    train = [_greedy(target, p, MAX_NEW) for p in parity.prompt_ids(24, seed=9) + prompt_ids * 3]
    loss = online.fit(head, target, train, steps=600, lr=5e-3)
    online.save_head(head.eval(), model_dir)
    prompts = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(prompt_ids)])
    layers = target.config.num_hidden_layers
    shards = parity.extract(tmp / "greedy", model_dir, prompts, MAX_NEW, [layers])  # id L: before the final norm
    print(f"fitted head: step-1 loss {loss:.3f}")
    return tmp, model_dir, target, head, shards


def _online_runs(head, target, shards) -> dict[str, online.OnlineRun]:
    stop_ids = ShardSet(shards).settings["target"]["stop_token_ids"]
    runs = {}
    for sample in ShardSet(shards).samples(tensors=[]):
        run = online.online_mtp(head, target, sample.input_ids[: sample.prompt_len], STEPS, MAX_NEW, stop_ids)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        runs[sample.sample_id] = run
    return runs


@pytest.mark.slow
def test_greedy_walks_equal_the_online_loop(setup):
    tmp, model_dir, target, head, shards = setup
    runs = _online_runs(head, target, shards)
    walks = parity.walks(parity.score(model_dir, shards, tmp / "results"))
    for sample_id, run in runs.items():
        assert walks[sample_id]["produced"].to_list() == run.produced, sample_id
    accepted = [n for run in runs.values() for n in run.accepted]
    produced = [n for run in runs.values() for n in run.produced]
    print(f"greedy: {len(runs)} walks equal, {len(produced)} steps, tau {np.mean(produced):.3f}")
    assert np.mean(accepted) > 1.0, accepted  # a head that accepts: the comparison means something
    assert STEPS in accepted, accepted


def _offline_produced(model_dir: str, shards: str, conventions: Conventions) -> dict[str, list[int]]:
    """Each sample's walk (tokens produced a step) replayed under `conventions`."""
    shardset = ShardSet(shards)
    drafter, _ = load_drafter(model_dir, target_layers=shardset.settings["target"]["num_layers"])
    head = prepare_target_head(shardset.target_head(), "cpu", torch.float32)
    drafter.attach_target_head(head)
    samples = list(shardset.samples())
    stop_ids = shardset.settings["target"]["stop_token_ids"]
    options = ReplayOptions(max_tree_nodes=0, conventions=conventions)
    results = replay_walks(
        drafter,
        head["embed_tokens"],
        head["lm_head"],
        samples,
        lambda f: f,
        [MAX_NEW] * len(samples),
        [CHAIN],
        [stop_mask(s.input_ids, stop_ids) for s in samples],
        options,
    )
    return {s.sample_id: _walk(r, s) for s, r in zip(samples, results)}


def _walk(result, sample) -> list[int]:
    """Tokens produced per step along the greedy walk from the replay's per-anchor drafts."""
    produced, position, end = [], sample.prompt_len, sample.input_ids.numel()
    while position + 1 < end:
        row = position - sample.prompt_len
        depth = int(result.depth[row])
        match = (result.draft_tokens[row, :depth] == result.target_tokens[row, :depth]).long().cumprod(0).sum()
        step = min(int(match) + 1, end - 1 - position)
        produced.append(step)
        position += step
    return produced


@pytest.mark.slow
def test_the_other_norm_rule_walks_differently(setup):
    tmp, model_dir, target, head, shards = setup
    runs = _online_runs(head, target, shards)
    reference = _offline_produced(model_dir, shards, Conventions())
    prenorm = _offline_produced(model_dir, shards, Conventions(prenorm_hidden=True))
    same = sum(reference[k] == run.produced for k, run in runs.items())
    wrong = sum(prenorm[k] != run.produced for k, run in runs.items())
    steps = sum(len(run.produced) for run in runs.values())
    tau = {
        name: np.mean([n for w in walks.values() for n in w]) for name, walks in (("post", reference), ("pre", prenorm))
    }
    print(
        f"post-norm walks equal {same}/{len(runs)}; pre-norm walks differ in {wrong}/{len(runs)} ({steps} steps); tau {tau}"
    )
    assert same == len(runs)
    assert wrong > 0

"""What the MTP parity tests (tests/parity/test_mtp_parity.py, test_mtp_moe_parity.py) share around
the online loop of tests/helpers/mtp_online.py: the target's greedy continuations to fit a head on,
the online loop's runs over the shards' prompts, the replay's per-anchor chains (specreplay's own
replay_walks on a loaded drafter, which a test may change first: a wrong rule) and the greedy walk
read from them."""

from __future__ import annotations

import torch

from pipeline.shards import ShardSet
from proposers.checkpoints.load import load_drafter
from proposers.toolkit.conventions import REFERENCE, Conventions
from proposers.toolkit.neural import neural_proposer
from scoring.methods.chain import CHAIN
from scoring.replay.anchors import replay_sample, replay_walks
from scoring.replay.packing import ReplayOptions, prepare_target_head
from scoring.replay.walk import stop_mask
from tests.helpers import mtp_online as online


def score_error(ckpt: str, shards: str, out, *options: str) -> str:
    """`specreplay score`'s one `error:` line for a head it refuses (score's `options` given too):
    exit 1, no traceback, nothing written."""
    import os

    from click.testing import CliRunner

    from specreplay.cli import main

    result = CliRunner().invoke(main, ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), *options])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(errors) == 1, result.output
    assert not os.path.exists(out)  # nothing written
    return errors[0]


def greedy(target, prompt: list[int], max_new: int) -> torch.Tensor:
    ids = torch.tensor(prompt)
    for _ in range(max_new):
        ids = torch.cat([ids, online.target_states(target, ids)[0][-1].argmax()[None]])
    return ids


def fitted_native_head(
    tmp, prompts: int, max_new: int, *, moe=False, train: int, repeats: int, fit_steps: int, nextn=None
):
    """(target dir, the target, its head, greedy shards of id L, the fit's last loss): mtp_online's
    tiny target (`moe`: its MoE variant; `nextn`: a NextN target of that transformers config,
    nextn_online.build_dir) with its head fitted on the greedy continuations of `train` other prompts
    and of the `prompts` scored ones (`repeats` times) and saved into its checkpoint."""
    from tests.helpers import chain_parity as parity, nextn_online
    from tests.helpers.prompts import write_prompts

    if nextn is None:
        model_dir, target, head = online.build_target(tmp / "target", moe=moe)
    else:
        model_dir, target, head = nextn_online.build_dir(tmp / "target", nextn)
    prompt_ids = parity.prompt_ids(prompts)
    sequences = [greedy(target, p, max_new) for p in parity.prompt_ids(train, seed=9) + prompt_ids * repeats]
    loss = online.fit(head, target, sequences, steps=fit_steps, lr=5e-3)
    if nextn is None:
        online.save_head(head.eval(), model_dir, target if moe else None)
    else:
        nextn_online.save_head(head, model_dir, target)
    written = write_prompts(tmp / "prompts.jsonl", [{"id": f"p{i}", "input_ids": p} for i, p in enumerate(prompt_ids)])
    layers = target.config.num_hidden_layers
    shards = parity.extract(tmp / "greedy", model_dir, written, max_new, [layers])  # id L: before the final norm
    return model_dir, target, head, shards, loss


def online_runs(head, target, shards: str, steps: int, max_new: int, loop=online.online_mtp) -> dict:
    """The online `loop` (mtp_online's, or a family's own with its arguments) over every stored sample's
    prompt; its output must be the stored response."""
    stop_ids = ShardSet(shards).settings["target"]["stop_token_ids"]
    runs = {}
    for sample in ShardSet(shards).samples(tensors=[]):
        run = loop(head, target, sample.input_ids[: sample.prompt_len], steps, max_new, stop_ids)
        assert run.output_ids.tolist() == sample.input_ids.tolist(), sample.sample_id
        runs[sample.sample_id] = run
    return runs


def _drafter(model_dir: str, shardset: ShardSet, change):
    drafter, _ = load_drafter(model_dir, target_layers=shardset.settings["target"]["num_layers"])
    if change is not None:
        change(drafter)
    return neural_proposer(drafter), prepare_target_head(shardset.target_head(), "cpu", torch.float32)


def replayed(model_dir: str, shards: str, max_new: int, conventions: Conventions = REFERENCE, change=None):
    """[(sample, its replay result)] along the greedy walks (walk-only mode): the drafter loaded from
    `model_dir` (then given to `change`, if any) under `conventions`."""
    shardset = ShardSet(shards)
    proposer, head = _drafter(model_dir, shardset, change)
    samples = list(shardset.samples())
    stop_ids = shardset.settings["target"]["stop_token_ids"]
    options = ReplayOptions(methods={}, conventions=conventions)
    results = replay_walks(
        proposer,
        head,
        samples,
        lambda f: f,
        [max_new] * len(samples),
        [CHAIN],
        [stop_mask(s.input_ids, stop_ids) for s in samples],
        options,
    )
    return list(zip(samples, results))


def every_anchor(model_dir: str, shards: str, max_new: int, change=None):
    """[(sample, its replay result at every anchor)] (all-anchor mode, scoring.replay.anchors.replay_sample)."""
    shardset = ShardSet(shards)
    proposer, head = _drafter(model_dir, shardset, change)
    options = ReplayOptions(methods={})
    return [(s, replay_sample(proposer, head, s, lambda f: f, max_new, options)) for s in shardset.samples()]


def reference_chains(head, target, sample, steps: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(anchor row, the online reference's own drafts, the stored tokens they propose) at every
    anchor: a fresh draft cache of the stored prefix, then the head's own chain (mtp_online.propose)."""
    ids = sample.input_ids
    hidden = online.target_states(target, ids)[1]
    chains = []
    for t in range(sample.prompt_len, ids.numel() - 1):
        depth = min(steps, ids.numel() - 1 - t)
        draft = online.DraftCache(head, target.model.embed_tokens)
        drafts = online.propose(draft, target.lm_head, hidden, ids, t, depth).drafts
        chains.append((t - sample.prompt_len, drafts, ids[t + 1 : t + 1 + depth]))
    return chains


def anchors_equal(model_dir: str, head, target, shards: str, max_new: int, steps: int, change=None, chains=None):
    """(anchors whose read drafts equal the reference's, anchors, drafts compared): the replay's
    teacher-forced chain against the reference's own, at every anchor (`change`: a wrong rule;
    `chains`: the reference's, sample id -> reference_chains, computed here when not given)."""
    same = total = compared = 0
    for sample, result in every_anchor(model_dir, shards, max_new, change=change):
        assert bool(result.computed.all())
        found = chains[sample.sample_id] if chains else reference_chains(head, target, sample, steps)
        for row, drafts, stored in found:
            # the reference's chain reads its own drafts, the replay's the stored tokens: alike up to
            # and including the first draft the stored response does not hold
            read = min(int((drafts == stored).long().cumprod(0).sum()) + 1, drafts.numel())
            # the replay drafts to the budget; past a response its stop token ended no draft is verified
            assert int(result.depth[row]) >= drafts.numel()
            same += torch.equal(result.draft_tokens[row, :read], drafts[:read])
            total, compared = total + 1, compared + read
    return same, total, compared


def offline_produced(model_dir: str, shards: str, max_new: int, conventions=REFERENCE, change=None):
    """Each sample's walk (tokens produced a step) replayed under `conventions` (and `change`)."""
    return {s.sample_id: walk(r, s) for s, r in replayed(model_dir, shards, max_new, conventions, change)}


def walk(result, sample) -> list[int]:
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


def hidden_first(self, layer, h, embeds):
    """A wrong rule for a TargetStateHead's `layer_input`: fc reads [hidden ; embedding], its
    halves in the other order."""
    z = self.fc(torch.cat([self.pre_fc_norm_hidden(h), self.pre_fc_norm_embedding(embeds)], dim=-1))
    return layer.input_layernorm(z), z


def sampled_verdict(tmp, model_dir: str, target, head, greedy: str, *, steps: int, max_new: int, **sampled):
    """fitted_native_head's head at T > 0, paired (chain_parity.paired_verdict): `draws` seeded online
    runs of mtp_online's loop on each of its prompts, each run's own response extracted (id L) and
    scored as it is and with the `wrong` rule (object, attribute, value) named `label`; `sampled`
    holds prompts, temperature, draws, wrong, label."""
    from tests.helpers import chain_parity as parity

    temperature = sampled["temperature"]
    stop_ids = ShardSet(greedy).settings["target"]["stop_token_ids"]

    def run(prompt):
        return online.online_mtp(head, target, prompt, steps, max_new, stop_ids, temperature)

    runs = parity.paired_runs(run, sampled["prompts"], sampled["draws"])
    options = dict(max_new=max_new, layer_ids=[target.config.num_hidden_layers], temperature=temperature)
    return parity.paired_verdict(model_dir, model_dir, runs, tmp, sampled["wrong"], sampled["label"], **options)


def diagnose_taus(ckpt: str, shards: str, out, variant: str, limit: int = 6) -> tuple[dict[str, float], str]:
    """`specreplay diagnose` of `ckpt` with `variant` on `limit` samples: (variant -> tau, the verdict's first line)."""
    import json

    import polars as pl
    from click.testing import CliRunner

    from specreplay.cli import main

    args = ["diagnose", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--variants", variant]
    run = CliRunner().invoke(main, [*args, "--limit", str(limit), "--no-progress"])
    assert run.exit_code == 0, run.output
    [table] = [pl.read_parquet(path) for path in out.glob("*/diagnose.parquet")]
    taus = dict(table.filter(pl.col("metric") == "tau").select("variant", "value").iter_rows())
    return taus, json.loads(next(out.glob("*/diagnose.json")).read_text())["verdict"][0]

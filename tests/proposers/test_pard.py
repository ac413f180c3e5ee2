"""vLLM's PARD (method "draft_model" with "parallel_drafting": true, proposers/draft/pard.py) against an
online loop written rule by rule from vLLM 0.33.0's source: the draft model's own KV cache over the
accepted tokens, the target's sampled token and K - 1 mask tokens appended every step, the K drafts
read at the sampled token and the masks, greedy verification by the target itself.

The draft is a tiny Qwen3 at the tiny target's vocabulary, fitted briefly with PARD's objective (the
stored tokens up to t, then K - 1 masks: the token at t and mask j predict the tokens 1 and j + 1
ahead) on the target's greedy responses, so it accepts several drafts a step. Its mask token
(`pard_token`) is an id the tokenizer never produces. Plausible wrong rules (no masks, masks one
position off, the masks' KV kept across steps) give other counts: the test tells them apart.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from pipeline.common.errors import UserError
from proposers.draft.pard import mask_token_id, packed_layout, parallel_drafts
from specreplay.cli import main
from tests.helpers.models import IM_END_ID, TINY_VOCAB, one_torch_thread, seeded, text_kwargs
from tests.helpers.shards import question_fixtures

K = 4
MASK = 500  # a model row the tiny tokenizer (400 ids) never produces
MAX_NEW = 40
FIT_STEPS, FIT_LR = 30, 3e-3
RULES = ("vllm", "autoregressive", "mask positions + 1", "mask KV kept")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from one_torch_thread()


shards, samples = question_fixtures("pard", MAX_NEW)


def pard_row(ids: list[int], prompt_len: int) -> tuple[torch.Tensor, ...]:
    """PARD's training objective for one sample in one packed row (fast to fit): the stored tokens,
    then K - 1 masks per response anchor t seeing x_0 .. x_t and their own earlier masks (pard.py's
    layout); labels: the next token at every stored token, x_{t+j+1} at anchor t's mask j."""
    ids_, anchors = torch.tensor(ids), torch.arange(prompt_len - 1, len(ids) - 1)
    positions, visible = packed_layout(anchors, len(ids), K - 1)
    inputs = torch.cat([ids_, torch.full((anchors.numel() * (K - 1),), MASK)])
    ahead = anchors[:, None] + 2 + torch.arange(K - 1)[None, :]
    masked = torch.where(ahead < len(ids), ids_[ahead.clamp(max=len(ids) - 1)], -100).flatten()
    return inputs, positions, visible[None, None], torch.cat([ids_[1:], torch.tensor([-100]), masked])


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_qwen3_dir, samples) -> str:
    """A 2-layer Qwen3 fitted with PARD's objective, saved with `pard_token` and the target's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("pard_draft")
    config = Qwen3Config(**{**text_kwargs(2), "initializer_range": 0.02}, rope_theta=10000.0)
    with seeded(3):
        model = Qwen3ForCausalLM(config)
    rows = [pard_row(ids, prompt_len) for ids, prompt_len in samples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=FIT_LR)
    for _ in range(FIT_STEPS):  # short: a draft that also misses, so the wrong rules miss elsewhere
        loss = 0.0
        for inputs, positions, visible, labels in rows:
            logits = model(inputs[None], position_ids=positions[None], attention_mask=visible).logits[0]
            loss = loss + torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100) / len(rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.config.pard_token = MASK
    model.eval().save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tiny_qwen3_dir) / name).exists():
            shutil.copy(Path(tiny_qwen3_dir) / name, out / name)
    return str(out)


def vllm_json(tmp_path, model_dir, **fields) -> str:
    path = tmp_path / "pard.json"
    raw = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K, "parallel_drafting": True}
    path.write_text(json.dumps({**raw, **fields}))
    return str(path)


def score(shards: str, ckpt: str, out):
    args = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--ddtree-budgets", ""]
    return CliRunner().invoke(main, [*args, "--walk-rule", "vllm"])


@pytest.fixture(scope="module")
def walk(shards, draft_dir, tmp_path_factory) -> pl.DataFrame:
    tmp = tmp_path_factory.mktemp("pard_score")
    run = score(shards, vllm_json(tmp, draft_dir), tmp / "out")
    assert run.exit_code == 0, run.output
    walk = pl.read_parquet(next((tmp / "out").glob("*/walk.parquet")))
    return walk.filter(pl.col("method") == "chain").sort("sample_id", "step")


# ---------------------------------------------------------------------- the online loop, rule by rule


@torch.no_grad()
def draft_pass(draft, cache, fed: int, feed: list[int], first: int, masks: int, gap: int) -> tuple[list[int], int]:
    """One draft forward (vllm/v1/spec_decode/utils.py:468-535): `feed` at positions `first` .. into
    `cache` (holding `fed` entries), then `masks` mask tokens (`gap` positions later under the wrong
    rule); the argmax at the last fed token and at each mask (utils.py:546-553,
    llm_base_proposer.py:614, :628-635). Returns (drafts, the cache's length)."""
    positions = list(range(first, first + len(feed))) + [first + len(feed) + gap + i for i in range(masks)]
    ids = torch.tensor([feed + [MASK] * masks])
    logits = draft(ids, position_ids=torch.tensor([positions]), cache=cache, use_cache=True).logits[0]
    return logits[len(feed) - 1 :].argmax(-1).tolist(), fed + ids.shape[1]


def drafts_at(draft, cache, state: dict, seq: list[int], rule: str) -> list[int]:
    """The step's K drafts after `seq` under `rule` (vllm: llm_base_proposer.py:854-954)."""
    if rule == "mask KV kept":  # no overwrite: what is cached stays, only the new tokens are fed
        drafts, state["fed"] = draft_pass(draft, cache, state["fed"], seq[state["next"] :], state["next"], K - 1, 0)
        state["next"] = len(seq)
        return drafts
    first = state["next"]  # the step rewrites every position from its first accepted token on (utils.py:535)
    cache.crop(first - cache.get_seq_length())  # positions < first hold accepted tokens only
    if rule == "autoregressive":  # no masks: vLLM's draft_model without parallel_drafting
        drafts, fed = draft_pass(draft, cache, first, seq[first:], first, 0, 0)
        for _ in range(K - 1):
            more, fed = draft_pass(draft, cache, fed, [drafts[-1]], len(seq) + len(drafts) - 1, 0, 0)
            drafts += more
    else:
        gap = 1 if rule == "mask positions + 1" else 0
        drafts, _ = draft_pass(draft, cache, first, seq[first:], first, K - 1, gap)
    state["next"] = len(seq) - 1  # the next step's input starts at this step's sampled token (utils.py:468-477)
    return drafts


@torch.no_grad()
def online_counts(target, draft, prompt: list[int], max_new: int, rule: str) -> tuple[list[int], list[int], list[int]]:
    """(response, accepted drafts per step, anchor per step) of vLLM's loop: the target's prefill
    samples x_P, then every step drafts K (no cut near the end: docs/walk-rules.md#vllm), the target
    verifies greedily, appends the accepted drafts and its own next token, and the output is cut at
    the stop token or the budget afterwards (scheduler.py:2391-2398)."""
    from transformers import DynamicCache

    seq = prompt + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    cache, state, counts, anchors = DynamicCache(), {"next": 0, "fed": 0}, [], []
    while len(seq) - len(prompt) < max_new and seq[-1] != IM_END_ID:
        drafts = drafts_at(draft, cache, state, seq, rule)
        greedy = target(torch.tensor([seq + drafts])).logits[0, len(seq) - 1 :].argmax(-1).tolist()
        accepted = next((j for j in range(K) if drafts[j] != greedy[j]), K)
        counts.append(accepted)
        anchors.append(len(seq) - 1)
        seq += greedy[: accepted + 1]
        if IM_END_ID in seq[len(prompt) :]:
            seq = seq[: seq.index(IM_END_ID, len(prompt)) + 1]
        seq = seq[: len(prompt) + max_new]
    return seq[len(prompt) :], counts, anchors


def online(tiny_qwen3_dir, draft_dir, samples, rule: str) -> dict[int, tuple]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    return {i: online_counts(target, draft, ids[:p], MAX_NEW, rule) for i, (ids, p) in enumerate(samples)}


def replayed(walk: pl.DataFrame) -> list[tuple[list[int], list[int], list[bool]]]:
    """Per sample in the shards' order: (counted accepted, anchors, counted exact) of every step."""
    groups = walk.group_by("sample_id", maintain_order=True)
    return [(g["counted_accepted"].to_list(), g["anchor"].to_list(), g["counted_exact"].to_list()) for _, g in groups]


# ---------------------------------------------------------------------------------------------- tests


def test_the_fitted_pard_draft_accepts_several_drafts_a_step(walk):
    assert set(walk["drafted"]) == {K}, walk  # vLLM verifies every draft, also near the end
    mean = walk["counted_accepted"].mean()
    assert mean >= 1.5, f"mean accepted {mean}: the fit failed (a random draft accepts ~{K / TINY_VOCAB:.3f})"


def test_replayed_counts_equal_vllms_online_loop_step_by_step(walk, samples, tiny_qwen3_dir, draft_dir):
    loop = online(tiny_qwen3_dir, draft_dir, samples, "vllm")
    for i, (counts, anchors, exact) in enumerate(replayed(walk)):
        response, online_counts_, online_anchors = loop[i]
        assert response == samples[i][0][samples[i][1] :], i  # the online loop walks the stored response
        assert anchors == online_anchors, (i, anchors, online_anchors)
        for step, (mine, theirs, known) in enumerate(zip(counts, online_counts_, exact)):
            # past the stored response the replay counts a lower bound (docs/walk-rules.md#vllm)
            assert mine == theirs if known else mine <= theirs, (i, step, counts, online_counts_)


@pytest.mark.parametrize("rule", RULES[1:])
def test_a_wrong_rule_gives_other_counts(walk, samples, tiny_qwen3_dir, draft_dir, rule):
    loop = online(tiny_qwen3_dir, draft_dir, samples, rule)
    assert [counts for counts, _, _ in replayed(walk)] != [loop[i][1] for i in range(len(samples))], rule


@pytest.mark.parametrize("sliding", [False, True], ids=["full attention", "sliding window 5"])
def test_one_pass_equals_a_pass_per_anchor(sliding):
    """The packed pass (every anchor's masks beside the stored tokens) drafts what one causal pass
    over x_0 .. x_t and K - 1 masks drafts at each anchor alone, sliding-window layers too."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    window = {"use_sliding_window": True, "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]}
    config = Qwen3Config(**text_kwargs(2), rope_theta=10000.0, **(window if sliding else {}))
    with seeded(1):
        model = Qwen3ForCausalLM(config).eval()
    tokens, anchors = torch.randint(3, 400, (24,), generator=torch.Generator().manual_seed(2)), torch.arange(4, 23)
    with torch.no_grad():
        alone = [model(torch.tensor([tokens[: t + 1].tolist() + [MASK] * (K - 1)])).logits[0, t:] for t in anchors]
    assert torch.equal(parallel_drafts(model, tokens, anchors, K, MASK), torch.stack(alone).argmax(-1))


def edited_draft(source: str, dst, edit) -> str:
    shutil.copytree(source, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("pard_token"), "names no mask token; vLLM reads the first of dflash_config.mask_token_id"),
        (lambda c: c.update(pard_token=TINY_VOCAB), f"field 'pard_token' is {TINY_VOCAB}"),
        (lambda c: c.update(mask_token_id=-1), "field 'mask_token_id' is -1"),  # mask_token_id comes first
        (lambda c: c.update(dflash_config={"mask_token_id": "7"}), "field 'dflash_config.mask_token_id' is '7'"),
    ],
    ids=["missing", "past the vocabulary", "negative", "not an integer"],
)
def test_a_bad_mask_token_is_one_error_line_before_loading(shards, draft_dir, tmp_path, edit, message):
    run = score(shards, vllm_json(tmp_path, edited_draft(draft_dir, tmp_path / "draft", edit)), tmp_path / "out")
    assert run.exit_code == 1, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], run.output
    assert "Traceback" not in run.output and not list((tmp_path / "out").glob("*/run.json"))


def test_the_mask_token_is_read_in_vllms_order():
    from transformers import Qwen3Config

    config = Qwen3Config(**text_kwargs(1), pard_token=7, ptd_token_id=8)
    assert mask_token_id(config, "x") == 7
    config.mask_token_id = 9
    assert mask_token_id(config, "x") == 9
    config.dflash_config = {"mask_token_id": 10}
    assert mask_token_id(config, "x") == 10
    with pytest.raises(UserError, match="linear_attention"):
        mask_token_id(Qwen3Config(**text_kwargs(2), pard_token=7, layer_types=["linear_attention"] * 2), "x")


def test_probabilistic_parallel_drafting_is_refused_by_name():
    from proposers.detect import parse_config

    raw = {"method": "draft_model", "model": "small/", "num_speculative_tokens": K, "parallel_drafting": True}
    assert parse_config(raw, "pard.json").config.parallel_drafting
    with pytest.raises(UserError, match="field 'draft_sample_method' is 'probabilistic'"):
        parse_config({**raw, "draft_sample_method": "probabilistic"}, "pard.json")

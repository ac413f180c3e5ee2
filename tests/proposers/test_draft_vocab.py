"""vLLM's heterogeneous-vocabulary draft model (method "draft_model", `use_heterogeneous_vocab: true`,
proposers/draft/vocab_mapping.py) against vLLM 0.33.0's rules written out here one by one: the
mapping of two tokenizers (vllm/v1/spec_decode/vocab_mapping.py) and the online loop that drafts
through it (v1/spec_decode/llm_base_proposer.py: inputs mapped target -> draft, greedy drafts the
argmax of the logits constrained to the intersection, mapped back), verified greedily by the target.

The target is the tiny Qwen3 with its byte-level BPE ('Ġ' marks a space). The draft model's
tokenizer is another vocabulary built from it: SentencePiece-style ('▁' for 'Ġ', a Unigram model),
its ids shuffled, every sixth target token dropped, eight tokens of its own, and for every 'Ġx' a
twin ' x' with a literal space (two ids one normalized string: the first kept), its own '<unk>'.
The draft model, a 2-layer Qwen3 over that vocabulary, is fitted briefly on the target's greedy
responses mapped into it, each twin's lm_head row then made the larger (an unconstrained argmax
picks the id outside the intersection), so it accepts several drafts a step. Plausible wrong rules
(no space-prefix normalization, the last id of a string kept, unconstrained logits, the fallback
id 0) give other counts: the test tells them apart.

vLLM's "first id" follows the tokenizer's get_vocab() order, which for a fast tokenizer changes
from process to process; the replay and this test take the ids in ascending order (the module
docstring of vocab_mapping.py).
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest
import torch
from click.testing import CliRunner

from proposers.draft import vocab_mapping
from specreplay.cli import main
from tests.helpers.models import IM_END_ID, TINY_VOCAB, one_torch_thread, seeded, text_kwargs
from tests.helpers.shards import question_fixtures

K = 4
MAX_NEW = 40
DRAFT_VOCAB = 448  # the draft model's rows: more than its tokenizer's ids
MASK = DRAFT_VOCAB - 1  # PARD's mask token: a draft row its tokenizer never produces
FIT_STEPS, FIT_LR = 40, 3e-3
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WRONG_RULES = ("no space-prefix normalization", "last id kept", "unconstrained logits", "unk fallback to 0")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    yield from one_torch_thread()


shards, samples = question_fixtures("draft_vocab", MAX_NEW)


def draft_tokenizer(target_vocab: dict[str, int], out, unk: str | None = "<unk>", eos: str | None = "<|im_end|>"):
    """Another vocabulary made from the target's (module docstring), saved to `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = []
    for token, index in sorted(target_vocab.items(), key=lambda item: item[1]):
        if token in SPECIALS or (index % 6 == 5 and token != "Ġa"):  # dropped: outside the intersection
            continue
        pieces.append("▁" + token[1:] if token.startswith("Ġ") else token)
        if token.startswith("Ġ") and len(token) > 1:
            pieces.append(" " + token[1:])  # the twin
    pieces += [f"▁zz{i}" for i in range(8)]  # the draft's own
    random.Random(7).shuffle(pieces)
    for position, special in zip((3, 7, 11, 13), ["<unk>", *SPECIALS]):
        pieces.insert(position, special)
    backend = Tokenizer(models.Unigram([(p, -1.0 - len(p) * 0.01) for p in pieces], unk_id=3))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk, eos_token=eos, bos_token=None)
    tokenizer.save_pretrained(str(out))
    return tokenizer


# ------------------------------------------------------------------- vLLM's rules, written out here


@dataclass
class Mapping:
    d2t: dict[int, int]
    t2d: dict[int, int]
    target_unk: int
    draft_unk: int
    constrained: bool = True

    def to_draft(self, target_id: int) -> int:  # map_target_to_draft_ids (vocab_mapping.py:129-132)
        return self.t2d.get(target_id, self.draft_unk)

    def pick(self, logits: torch.Tensor) -> int:  # _greedy_sample (llm_base_proposer.py:441-446)
        if self.constrained:  # constrain_draft_logits (vocab_mapping.py:139-141)
            allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
            allowed[list(self.d2t)] = True
            logits = logits.masked_fill(~allowed, float("-inf"))
        return self.d2t.get(int(logits.argmax()), self.target_unk)  # map_draft_to_target_ids (:134-137)


def vllm_mapping(target, draft, target_vocab: int, draft_vocab: int, rule: str = "vllm") -> Mapping:
    """VocabMapping.__init__ (vocab_mapping.py:67-127) under `rule`."""

    def prefixes(tokenizer) -> tuple[str, ...]:  # _detect_space_prefix (:10-32)
        if rule == "no space-prefix normalization":
            return ()
        first = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False)[0])
        if len(first) > 1 and first.endswith("a") and first[0] not in " \t":
            return (first[:-1],)
        return ("\u0120", "\u2581")

    def normalized_first(tokenizer) -> dict[str, int]:  # :91-101, ids ascending (module docstring)
        found, marks = {}, prefixes(tokenizer)
        for token, index in sorted(
            tokenizer.get_vocab().items(), key=lambda item: item[1], reverse=rule == "last id kept"
        ):
            prefix = next((p for p in marks if token.startswith(p)), None)
            found.setdefault(" " + token[len(prefix) :] if prefix else token, index)
        return found

    def unk(tokenizer) -> int:  # _get_unk_token_id (:42-64)
        if rule == "unk fallback to 0":
            return 0
        return tokenizer.unk_token_id if tokenizer.unk_token_id is not None else tokenizer.eos_token_id

    t_first, d_first = normalized_first(target), normalized_first(draft)
    pairs = [(t_first[s], d_first[s]) for s in t_first.keys() & d_first.keys()]
    pairs = [(t, d) for t, d in pairs if t < target_vocab and d < draft_vocab]  # :108-114
    return Mapping(
        {d: t for t, d in pairs}, {t: d for t, d in pairs}, unk(target), unk(draft), rule != "unconstrained logits"
    )


@torch.no_grad()
def online_counts(
    target, draft, prompt: list[int], mapping: Mapping, pard: bool = False
) -> tuple[list[int], list[int]]:
    """(accepted drafts per step, anchor per step) of vLLM's loop (as test_pard.py's): every step
    the draft reads the tokens accepted since its cache's end and the target's sampled token, mapped
    (llm_base_proposer.py:820-835), drafts K greedily, each fed back mapped (:685-700); the target
    verifies greedily and appends the accepted drafts and its own next token; cut at the stop token
    or the budget afterwards."""
    from transformers import DynamicCache

    seq = prompt + [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    cache, fed, counts, anchors = DynamicCache(), 0, [], []
    while len(seq) - len(prompt) < MAX_NEW and seq[-1] != IM_END_ID:
        cache.crop(fed - cache.get_seq_length())  # the cache holds the accepted tokens only
        masks = [MASK] * (K - 1) if pard else []  # PARD: the draft's own mask id, after the mapping
        ids = torch.tensor([[mapping.to_draft(x) for x in seq[fed:]] + masks])
        positions = torch.arange(fed, len(seq) + len(masks))[None]
        logits = draft(ids, position_ids=positions, cache=cache, use_cache=True).logits[0, len(seq) - fed - 1 :]
        drafts, fed = [mapping.pick(row) for row in logits], len(seq)
        for j in range(len(drafts), K):
            ids = torch.tensor([[mapping.to_draft(drafts[-1])]])
            logits = draft(ids, position_ids=torch.tensor([[len(seq) + j - 1]]), cache=cache, use_cache=True).logits[
                0, -1
            ]
            drafts.append(mapping.pick(logits))
        greedy = target(torch.tensor([seq + drafts])).logits[0, len(seq) - 1 :].argmax(-1).tolist()
        accepted = next((j for j in range(K) if drafts[j] != greedy[j]), K)
        counts.append(accepted)
        anchors.append(len(seq) - 1)
        seq += greedy[: accepted + 1]
        if IM_END_ID in seq[len(prompt) :]:
            seq = seq[: seq.index(IM_END_ID, len(prompt)) + 1]
        seq = seq[: len(prompt) + MAX_NEW]
    return counts, anchors


# ------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_qwen3_dir, samples):
    """(draft model directory, the target's and the draft's tokenizers): the draft fitted on the
    mapped responses, each twin's lm_head row then the larger."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("hetero_draft")
    target_tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    draft_tokenizer(target_tokenizer.get_vocab(), out)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    mapping = vllm_mapping(target_tokenizer, tokenizer, TINY_VOCAB, DRAFT_VOCAB)
    config = Qwen3Config(**{**text_kwargs(2), "vocab_size": DRAFT_VOCAB, "initializer_range": 0.02}, rope_theta=1e4)
    with seeded(3):
        model = Qwen3ForCausalLM(config)
    rows = [torch.tensor([mapping.to_draft(x) for x in ids]) for ids, _ in samples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=FIT_LR)
    for _ in range(FIT_STEPS):
        loss = sum(model(ids[None], labels=ids[None]).loss for ids in rows) / len(rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    vocab = tokenizer.get_vocab()
    with torch.no_grad():
        for token, index in vocab.items():
            twin = vocab.get(("▁" + token[1:]) if token.startswith(" ") else None)
            if twin is not None:  # the pair's id outside the intersection scores higher than the kept one
                kept, other = (index, twin) if index in mapping.d2t else (twin, index)
                model.lm_head.weight[other] = 1.5 * model.lm_head.weight[kept]
    model.eval().save_pretrained(out)
    return str(out), target_tokenizer, tokenizer


def hetero_json(tmp_path, model_dir, **fields) -> str:
    path = tmp_path / "hetero.json"
    raw = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}
    path.write_text(json.dumps({**raw, "use_heterogeneous_vocab": True, **fields}))
    return str(path)


def score(shards: str, ckpt: str, out):
    args = ["score", "--ckpt", ckpt, "--shards", shards, "--out", str(out), "--ddtree-budgets", ""]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the twins: several ids one string (vocab_mapping.py's warning)
        return CliRunner().invoke(main, [*args, "--walk-rule", "vllm"])


@pytest.fixture(scope="module")
def walk(shards, world, tmp_path_factory) -> pl.DataFrame:
    tmp = tmp_path_factory.mktemp("draft_vocab_score")
    run = score(shards, hetero_json(tmp, world[0]), tmp / "out")
    assert run.exit_code == 0, run.output
    walk = pl.read_parquet(next((tmp / "out").glob("*/walk.parquet")))
    return walk.filter(pl.col("method") == "chain").sort("sample_id", "step")


def replayed(walk: pl.DataFrame) -> list[tuple[list[int], list[int], list[bool]]]:
    groups = walk.group_by("sample_id", maintain_order=True)
    return [(g["counted_accepted"].to_list(), g["anchor"].to_list(), g["counted_exact"].to_list()) for _, g in groups]


def online(tiny_qwen3_dir, world, samples, rule: str):
    """vLLM's loop under `rule` over the samples, one at a time (a generator: a caller may stop early)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(world[0], dtype=torch.float32).eval()
    mapping = vllm_mapping(world[1], world[2], TINY_VOCAB, DRAFT_VOCAB, rule)
    return (online_counts(target, draft, ids[:p], mapping) for ids, p in samples)


# ----------------------------------------------------------------------------------------- tests


def test_the_mapping_is_vllms(world):
    """specreplay's mapping equals the one written out here; the draft's space prefix is detected
    ('▁'), the target's too ('Ġ'), and the twins make strings of several ids."""
    _, target, draft = world
    mine = vocab_mapping.build(target, draft, TINY_VOCAB, DRAFT_VOCAB, ("target", "draft"))
    theirs = vllm_mapping(target, draft, TINY_VOCAB, DRAFT_VOCAB)
    assert vocab_mapping.space_prefixes(draft) == ("▁",) and vocab_mapping.space_prefixes(target) == ("Ġ",)
    assert {d: t for d, t in enumerate(mine.draft_to_target.tolist()) if t >= 0} == theirs.d2t
    assert {t: d for t, d in enumerate(mine.target_to_draft.tolist()) if d >= 0} == theirs.t2d
    assert (mine.target_fallback, mine.draft_fallback) == (IM_END_ID, draft.unk_token_id) != (IM_END_ID, 0)
    assert mine.ambiguous > 10 and 200 < len(theirs.d2t) < 400


def test_the_fitted_draft_accepts_several_drafts_a_step(walk):
    assert set(walk["drafted"]) == {K}, walk
    mean = walk["counted_accepted"].mean()
    assert mean >= 1.0, f"mean accepted {mean}: the fit failed"


def test_replayed_counts_equal_vllms_online_loop_step_by_step(walk, samples, tiny_qwen3_dir, world):
    loop = online(tiny_qwen3_dir, world, samples, "vllm")
    for i, ((counts, anchors, exact), (theirs, their_anchors)) in enumerate(zip(replayed(walk), loop, strict=True)):
        assert anchors == their_anchors, (i, anchors, their_anchors)
        for step, (mine, other, known) in enumerate(zip(counts, theirs, exact)):
            # past the stored response the replay counts a lower bound (docs/walk-rules.md#vllm)
            assert mine == other if known else mine <= other, (i, step, counts, theirs)


@pytest.mark.parametrize("rule", WRONG_RULES)
def test_a_wrong_rule_gives_other_counts(walk, samples, tiny_qwen3_dir, world, rule):
    """Some sample's counts differ (the first that does ends the loop)."""
    loop = online(tiny_qwen3_dir, world, samples, rule)
    assert any(mine != theirs for (mine, _, _), (theirs, _) in zip(replayed(walk), loop)), rule


def test_parallel_drafting_through_the_mapping_equals_vllms_loop(shards, samples, tiny_qwen3_dir, world, tmp_path):
    """PARD with a heterogeneous vocabulary (vLLM's V1 runner maps PARD's inputs and drafts alike):
    the same draft, its `pard_token` set, against the PARD loop through the mapping."""
    from transformers import AutoModelForCausalLM

    draft = copy_draft(world, tmp_path / "pard")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "pard_token": MASK}))
    run = score(shards, hetero_json(tmp_path, draft, parallel_drafting=True), tmp_path / "out")
    assert run.exit_code == 0, run.output
    walk = pl.read_parquet(next((tmp_path / "out").glob("*/walk.parquet")))
    walk = walk.filter(pl.col("method") == "chain").sort("sample_id", "step")
    target = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32).eval()
    mapping = vllm_mapping(world[1], world[2], TINY_VOCAB, DRAFT_VOCAB)
    assert walk["counted_accepted"].sum() > 0, walk
    for (counts, anchors, exact), (ids, p) in zip(replayed(walk), samples, strict=True):
        theirs, their_anchors = online_counts(target, model, ids[:p], mapping, pard=True)
        assert anchors == their_anchors
        assert all(a == b if known else a <= b for a, b, known in zip(counts, theirs, exact)), (counts, theirs)


# ---------------------------------------------------------------------------------------- refused


def one_error(run, out, message: str) -> None:
    assert run.exit_code == 1, run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], run.output
    assert "Traceback" not in run.output and not list(Path(out).glob("*/run.json"))


def copy_draft(world, dst) -> Path:
    shutil.copytree(world[0], dst)
    return Path(dst)


def test_a_draft_model_without_a_tokenizer_is_one_error_line(shards, world, tmp_path):
    draft = copy_draft(world, tmp_path / "draft")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (draft / name).unlink(missing_ok=True)
    run = score(shards, hetero_json(tmp_path, draft), tmp_path / "out")
    one_error(
        run, tmp_path / "out", f"{draft}: no tokenizer (tokenizer.json, tokenizer.model, vocab.json) of the draft"
    )


def test_shards_without_the_target_tokenizer_are_one_error_line(shards, world, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    shutil.rmtree(copy / "tokenizer")
    run = score(str(copy), hetero_json(tmp_path, world[0]), tmp_path / "out")
    one_error(
        run, tmp_path / "out", "tokenizer: no tokenizer (tokenizer.json, tokenizer.model, vocab.json) of the target"
    )


def test_a_tokenizer_with_neither_unk_nor_eos_is_one_error_line(shards, world, tmp_path):
    draft = copy_draft(world, tmp_path / "draft")
    draft_tokenizer(world[1].get_vocab(), draft, unk=None, eos=None)
    run = score(shards, hetero_json(tmp_path, draft), tmp_path / "out")
    one_error(run, tmp_path / "out", f"{draft}: the draft model's tokenizer has neither an unk_token nor an eos_token")


def test_probabilistic_drafting_stays_refused():
    from pipeline.common.errors import UserError
    from proposers.detect import parse_config

    raw = {"method": "draft_model", "model": "small/", "num_speculative_tokens": K, "use_heterogeneous_vocab": True}
    assert parse_config(raw, "hetero.json").config.heterogeneous_vocab
    with pytest.raises(UserError, match="field 'draft_sample_method' is 'probabilistic'"):
        parse_config({**raw, "draft_sample_method": "probabilistic"}, "hetero.json")
    with pytest.raises(UserError, match="use_local_argmax_reduction"):
        parse_config({**raw, "use_local_argmax_reduction": True}, "hetero.json")

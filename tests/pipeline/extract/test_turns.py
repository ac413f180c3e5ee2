"""Multi-turn conversations ("turns" records, pipeline/extract/turns.py): every user turn is a
sample whose prompt holds the target's own earlier answers, exactly as the shards store them, and
a resume reads those answers back instead of generating them again."""

from __future__ import annotations

import pytest
import torch

import pipeline.extract.generate as generate
from pipeline.common.errors import Interrupted, UserError
from pipeline.extract.run import ExtractConfig, run_extract
from pipeline.shards import ShardSet, finished_shard_entries, read_manifest, read_shard
from tests.helpers.models import make_tokenizer
from tests.helpers.prompts import write_prompts

MAX_NEW = 6
CONVERSATIONS = [
    {"id": "c1", "turns": ["Write a blog post about Hawaii.", "Rewrite it, every sentence with the letter A."]},
    {"id": "c2", "turns": ["What is 2 + 2?", "And times 3?", "And minus 1?"]},
    {"id": "s1", "prompt": "The quick brown fox"},
]
TURN_IDS = ["c1/turn-1", "c1/turn-2", "c2/turn-1", "c2/turn-2", "c2/turn-3", "s1"]


def extract(model, prompts, out, **more):
    fields = dict(max_new_tokens=MAX_NEW, layer_ids=[0, 2], batch_size=4, dtype="float32", quiet=True)
    return run_extract(ExtractConfig(model=model, prompts=prompts, out=str(out), **{**fields, **more}))


def by_id(out) -> dict:
    return {sample.sample_id: sample for sample in ShardSet(str(out)).samples(tensors=[])}


def kept_by_id(out) -> dict:
    """The samples an interrupted extract left in finished shards (its manifest is not complete)."""
    entries = finished_shard_entries(str(out))
    return {sample.sample_id: sample for entry in entries for sample in read_shard(str(out), entry, {}, tensors=[])}


def answer(sample) -> list[int]:
    return sample.input_ids[sample.prompt_len :].tolist()


def expected_prompt(user_turns: list[str], answers: list, tokenizer) -> str:
    """The conversation so far as the DFlash benchmark renders it: the earlier answers decoded
    without special tokens, then the chat template with the generation prompt."""
    messages = []
    for user, tokens in zip(user_turns, [*answers, None]):
        messages.append({"role": "user", "content": user})
        if tokens is not None:
            messages.append({"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def count_generated(monkeypatch, stop_at_call: int | None = None) -> list[list[int]]:
    """The prompts every generate call gets, recorded; a KeyboardInterrupt (Ctrl-C) at call `stop_at_call`."""
    prompts, calls, real = [], [], generate.generate_batch

    def counted(model, batch, *args, **kwargs):
        calls.append(len(batch))
        if len(calls) == stop_at_call:
            raise KeyboardInterrupt
        prompts.extend(list(p) for p in batch)
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(generate, "generate_batch", counted)
    return prompts


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("turns") / "chat.jsonl", CONVERSATIONS)


@pytest.fixture(scope="module")
def uninterrupted(tiny_qwen3_dir, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("turns-out") / "out"
    extract(tiny_qwen3_dir, prompts_file, out)
    return out


def test_each_turn_is_a_sample_whose_prompt_holds_the_earlier_stored_answers(uninterrupted):
    samples = by_id(uninterrupted)
    assert sorted(samples) == sorted(TURN_IDS)
    assert read_manifest(str(uninterrupted))["complete"]
    tokenizer = make_tokenizer()
    for record in CONVERSATIONS[:2]:
        turns = [samples[f"{record['id']}/turn-{r}"] for r in range(1, len(record["turns"]) + 1)]
        for number, sample in enumerate(turns, start=1):
            earlier = [answer(s) for s in turns[: number - 1]]
            text = expected_prompt(record["turns"][:number], earlier, tokenizer)
            assert sample.prompt_text == text, sample.sample_id
            assert sample.input_ids[: sample.prompt_len].tolist() == tokenizer(text, add_special_tokens=False).input_ids
            assert sample.dataset == "chat" and sample.response_len > 0
        first_answer = tokenizer.decode(answer(turns[0]), skip_special_tokens=True)
        assert first_answer and first_answer in turns[1].prompt_text  # turn 1's stored answer, exactly
    assert samples["s1"].prompt_text == expected_prompt(["The quick brown fox"], [], tokenizer)


def test_a_resume_after_round_one_reads_turn_one_back_and_generates_only_the_rest(
    tiny_qwen3_dir, prompts_file, uninterrupted, tmp_path, monkeypatch
):
    """Stopped as round 2 starts (round 1 is one batch: every first turn and s1), the rerun
    generates only the later turns, from the answers its shards hold; every sample ends as the
    uninterrupted run made it."""
    out = tmp_path / "out"
    count_generated(monkeypatch, stop_at_call=2)
    with pytest.raises(Interrupted):
        extract(tiny_qwen3_dir, prompts_file, out)
    kept = kept_by_id(out)
    assert sorted(kept) == ["c1/turn-1", "c2/turn-1", "s1"]

    generated = count_generated(monkeypatch)
    extract(tiny_qwen3_dir, prompts_file, out)
    got, want = by_id(out), by_id(uninterrupted)
    assert len(generated) == 3  # c1/turn-2, c2/turn-2, c2/turn-3: no first turn again
    assert sorted(got) == sorted(want)
    for sample_id, sample in want.items():
        assert torch.equal(got[sample_id].input_ids, sample.input_ids), sample_id
        assert got[sample_id].prompt_len == sample.prompt_len
    for sample_id in kept:
        assert torch.equal(got[sample_id].input_ids, kept[sample_id].input_ids)
    assert sorted(map(tuple, generated)) == sorted(
        tuple(got[i].input_ids[: got[i].prompt_len].tolist()) for i in ("c1/turn-2", "c2/turn-2", "c2/turn-3")
    )


def test_sampled_draw_k_of_a_turn_continues_draw_k_of_the_turn_before(tiny_qwen3_dir, tmp_path):
    out = tmp_path / "out"
    extract(
        tiny_qwen3_dir, write_prompts(tmp_path / "one.jsonl", CONVERSATIONS[:1]), out, temperature=1.0, num_samples=2
    )
    samples = by_id(out)
    assert sorted(samples) == [f"c1/turn-{r}#{k}" for r in (1, 2) for k in (0, 1)]
    tokenizer = make_tokenizer()
    for k in (0, 1):
        first, second = samples[f"c1/turn-1#{k}"], samples[f"c1/turn-2#{k}"]
        assert second.prompt_text == expected_prompt(CONVERSATIONS[0]["turns"], [answer(first)], tokenizer)
        assert not second.greedy


def test_served_responses_refuse_several_turns_in_one_line(prompts_file, tmp_path):
    """Refused before any model load (the model path does not exist), naming the flag and the fix."""
    with pytest.raises(UserError) as refused:
        extract(str(tmp_path / "no-model"), prompts_file, tmp_path / "out", responses_from=["http://127.0.0.1:9"])
    message = str(refused.value)
    assert "\n" not in message and message.startswith("--responses-from: ")
    assert "prompt 'c1'" in message and "leave --responses-from out" in message


def test_a_turn_after_an_excluded_one_is_not_run_and_says_why():
    """An excluded turn (non-finite values) stores no answer: the next turn has no prompt, and its
    `excluded` record reads as such in the console's summary."""
    from pipeline.extract.prompts import PromptRecord
    from pipeline.extract.turns import conversation_items, excluded_turn, with_prompt
    from pipeline.shards.writer import describe_excluded

    tokenizer = make_tokenizer()
    record = PromptRecord(id="c", dataset="d", turns=["Hi", "And then?"])
    first, second = conversation_items(record, tokenizer, None)
    assert (first.sample_id, second.sample_id, second.prompt_ids) == ("c/turn-1", "c/turn-2", [])
    assert with_prompt(first, {}, tokenizer, None) is first
    assert with_prompt(second, {"c/turn-1": None}, tokenizer, None) is None
    built = with_prompt(second, {"c/turn-1": [5, 6]}, tokenizer, None)
    assert built.prompt_text == expected_prompt(record.turns, [[5, 6]], tokenizer)
    said = describe_excluded([excluded_turn(second)])
    assert "c/turn-2: not run, an earlier turn of it was excluded" in said

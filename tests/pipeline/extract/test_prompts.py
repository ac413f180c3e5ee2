"""pipeline/extract/prompts.py: bundled sets, the three user JSONL forms, errors, DFlash-exact rendering."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re

import pytest

from pipeline.common.errors import UserError
from pipeline.extract.prompts import (
    BUNDLED_NAMES,
    PROMPTS_DIR,
    PromptRecord,
    load_prompts,
    prompt_set_hash,
    render_prompt,
    render_response,
)
from tests.helpers.models import IM_END_ID, make_tokenizer
from tests.helpers.processes import REPO
from tests.helpers.prompts import write_prompts

RAW_DATASETS = REPO.parent / "shared" / "datasets"


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


# ---------------------------------------------------------------- bundled sets


@pytest.mark.parametrize(
    "name, count, id_pattern",
    [
        ("humaneval", 164, r"humaneval/\d{4}"),
        ("gsm8k", 1319, r"gsm8k/\d{4}"),
    ],
)
def test_bundled_sets(name, count, id_pattern):
    records = load_prompts(name)
    assert len(records) == count
    assert len({r.id for r in records}) == count
    assert all(re.fullmatch(id_pattern, r.id) for r in records)
    assert all(r.dataset == name and r.prompt and r.messages is None and r.input_ids is None for r in records)
    assert all(r.response is None and r.turns is None for r in records)


def test_mt_bench_is_bundled_with_both_turns():
    """MT-Bench's 80 questions as two-turn conversations, as the DFlash benchmark runs them (the
    second turn answered after the target's own first answer: extract's rounds)."""
    records = load_prompts("mt-bench")
    assert len(records) == len({r.id for r in records}) == 80
    assert all(re.fullmatch(r"mt-bench/\d+", r.id) and r.dataset == "mt-bench" for r in records)
    assert all(len(r.turns) == 2 and r.prompt is None and r.response is None for r in records)
    assert records[0].turns[1] == "Rewrite your previous response. Start every sentence with the letter A."


def test_bundled_formats_match_the_dflash_benchmark():
    humaneval = load_prompts("humaneval")
    assert humaneval[0].id == "humaneval/0000" and humaneval[163].id == "humaneval/0163"
    assert humaneval[0].prompt.startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        "from typing import List\n\n\ndef has_close_elements("
    )
    assert humaneval[0].prompt.endswith('    """\n\n```')
    gsm8k = load_prompts("gsm8k")
    assert gsm8k[0].prompt.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert all(
        r.prompt.endswith("\nPlease reason step by step, and put your final answer within \\boxed{}.") for r in gsm8k
    )
    mt_bench = load_prompts("mt-bench")
    assert mt_bench[0].id == "mt-bench/81" and mt_bench[-1].id == "mt-bench/160"
    assert mt_bench[0].turns[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_spec_bench_keeps_each_category_a_dataset_and_its_turns():
    """Spec-Bench's 480 questions in 13 categories, each its own dataset in the results (80 each of
    translation, summarization, qa, math_reasoning, rag; MT-Bench's 80 by their 8 categories, the
    same two turns as the mt-bench set); the file rebuilds from the raw one (below)."""
    from collections import Counter

    records = load_prompts("spec-bench")
    assert len(records) == len({r.id for r in records}) == 480
    assert all(re.fullmatch(r"spec-bench/\d+", r.id) and r.dataset.startswith("spec-bench/") for r in records)
    counts = Counter(r.dataset for r in records)
    assert len(counts) == 13 and counts["spec-bench/writing"] == 10
    assert all(counts[f"spec-bench/{c}"] == 80 for c in ("translation", "summarization", "qa", "math_reasoning", "rag"))
    assert [r.turns for r in records[:80]] == [r.turns for r in load_prompts("mt-bench")]
    assert records[80].prompt.startswith("Translate German to English: ") and records[80].turns is None


def test_default_is_a_deterministic_mix():
    records = load_prompts("default")
    assert [r.id for r in records] == (
        [f"gsm8k/{i:04d}" for i in range(6)]
        + [f"humaneval/{i:04d}" for i in range(5)]
        + [f"mt-bench/{81 + i}" for i in range(5)]
    )
    assert [r.dataset for r in records] == ["gsm8k"] * 6 + ["humaneval"] * 5 + ["mt-bench"] * 5
    assert records[0] == load_prompts("gsm8k")[0]
    assert [r.prompt for r in records[11:]] == [r.turns[0] for r in load_prompts("mt-bench")[:5]]  # first turns
    assert not (PROMPTS_DIR / "default.jsonl.gz").exists()  # defined in code, not a copy
    # the same set as before "turns" records existed: an extract of it made then resumes now
    assert prompt_set_hash(records) == "c4336ebf545b04cee7631de67d970c2e91b6c8e4141074d0dcacf121784f24f3"


def test_bundled_names_and_licences_documented():
    assert set(BUNDLED_NAMES) == {"default", "humaneval", "gsm8k", "mt-bench", "spec-bench"}
    readme = (PROMPTS_DIR / "README.md").read_text()
    for name in BUNDLED_NAMES:
        assert f"`{name}`" in readme
    for licence in ("LICENSE.humaneval", "LICENSE.gsm8k", "LICENSE.mt-bench", "LICENSE.spec-bench"):
        assert (PROMPTS_DIR / licence).is_file() and licence in readme


@pytest.mark.skipif(not RAW_DATASETS.is_dir(), reason="raw datasets (../shared/datasets) not present")
def test_bundled_files_rebuild_byte_for_byte(tmp_path):
    spec = importlib.util.spec_from_file_location("build_prompts", PROMPTS_DIR / "build_prompts.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    build.main(RAW_DATASETS, tmp_path)
    for name in ("humaneval", "gsm8k", "mt-bench", "spec-bench"):
        assert (tmp_path / f"{name}.jsonl.gz").read_bytes() == (PROMPTS_DIR / f"{name}.jsonl.gz").read_bytes()


def test_limit_and_determinism():
    first = load_prompts("gsm8k", limit=7)
    assert [r.id for r in first] == [f"gsm8k/{i:04d}" for i in range(7)]
    assert load_prompts("gsm8k", limit=7) == first
    assert load_prompts("default", limit=0) == []
    assert len(load_prompts("mt-bench", limit=1000)) == 80
    assert prompt_set_hash(first) == prompt_set_hash(load_prompts("gsm8k", limit=7))
    assert prompt_set_hash(first) != prompt_set_hash(first[::-1])
    assert prompt_set_hash(first) != prompt_set_hash(first[:6])
    with pytest.raises(ValueError, match="limit must be >= 0"):
        load_prompts("gsm8k", limit=-1)


# ---------------------------------------------------------------- user JSONL


def test_three_forms_and_responses(tmp_path):
    path = write_prompts(
        tmp_path / "mine.jsonl",
        [
            {"id": "chat", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
            {"id": "text", "prompt": "What is 2 + 2?", "response": "4", "category": "ignored"},
            "",  # blank lines are skipped
            {"id": "raw", "input_ids": [5, 6, 7], "response": [8, 9, IM_END_ID], "dataset": "other"},
            {"id": 12, "prompt": "numeric ids become strings"},
        ],
    )
    records = load_prompts(str(path))
    assert [r.id for r in records] == ["chat", "text", "raw", "12"]
    assert [r.dataset for r in records] == ["mine", "mine", "other", "mine"]
    chat, text, raw, _ = records
    assert chat.messages[1] == {"role": "user", "content": "Hi"} and chat.prompt is None and chat.input_ids is None
    assert text.prompt == "What is 2 + 2?" and text.response == "4" and text.messages is None
    assert raw.input_ids == [5, 6, 7] and raw.response == [8, 9, IM_END_ID]
    assert load_prompts(str(path), limit=2) == records[:2]


def test_a_conversation_record_keeps_its_user_turns(tmp_path):
    """ "turns" (MT-Bench's form): the user turns, answered one after the other by the target in
    extract (tests/pipeline/extract/test_turns.py); its first turn renders as a "prompt" record's."""
    path = write_prompts(tmp_path / "chat.jsonl", [{"id": "c", "turns": ["Hi", "And then?"]}])
    (record,) = load_prompts(path)
    assert record.turns == ["Hi", "And then?"] and record.prompt is None and record.dataset == "chat"
    tokenizer = make_tokenizer()
    assert render_prompt(record, tokenizer) == render_prompt(PromptRecord(id="c", dataset="d", prompt="Hi"), tokenizer)


def test_gzipped_user_file_and_dataset_from_stem(tmp_path):
    path = tmp_path / "my-set.jsonl.gz"
    with gzip.open(path, "wt") as handle:
        handle.write(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    (record,) = load_prompts(str(path))
    assert record.dataset == "my-set"


def _error(tmp_path, lines, name="bad.jsonl") -> str:
    path = write_prompts(tmp_path / name, lines)
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        load_prompts(str(path))
    return str(info.value)


def test_malformed_json_names_file_and_line(tmp_path):
    message = _error(tmp_path, [{"id": "a", "prompt": "x"}, '{"id": "b", "prompt": }'])
    assert "bad.jsonl:2" in message and "malformed JSON" in message


def test_not_an_object(tmp_path):
    message = _error(tmp_path, ["[1, 2]"])
    assert "bad.jsonl:1" in message and "JSON object" in message


def test_record_with_no_form(tmp_path):
    message = _error(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "text": "x"}])
    assert "bad.jsonl:2" in message and "'messages/prompt/input_ids/turns'" in message and "found none" in message
    assert '{"id", "prompt": "..."}' in message  # the fix


def test_record_with_several_forms(tmp_path):
    message = _error(tmp_path, [{"id": "a", "prompt": "x", "input_ids": [1]}])
    assert "bad.jsonl:1" in message and "found prompt and input_ids" in message


def test_missing_id(tmp_path):
    message = _error(tmp_path, [{"prompt": "x"}])
    assert "bad.jsonl:1" in message and "'id'" in message and "unique" in message


def test_duplicate_id_names_both_lines(tmp_path):
    message = _error(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}])
    assert "bad.jsonl:3" in message and "bad.jsonl:1" in message and "duplicate id 'a'" in message


@pytest.mark.parametrize(
    "record, field",
    [
        ({"id": "a", "messages": "hi"}, "'messages'"),
        ({"id": "a", "messages": [{"content": "hi"}]}, "'messages[0].role'"),
        ({"id": "a", "prompt": ""}, "'prompt'"),
        ({"id": "a", "input_ids": [1, "2"]}, "'input_ids[1]'"),
        ({"id": "a", "input_ids": []}, "'input_ids'"),
        ({"id": "a", "prompt": "x", "response": 5}, "'response'"),
        ({"id": "a", "prompt": "x", "response": [1, -1]}, "'response'"),
        ({"id": "a", "prompt": "x", "dataset": 3}, "'dataset'"),
        ({"id": "a", "turns": []}, "'turns'"),
        ({"id": "a", "turns": ["x", ""]}, "'turns[1]'"),
        ({"id": "a", "turns": ["x", "y"], "response": "z"}, "'response'"),
    ],
)
def test_bad_field_values(tmp_path, record, field):
    message = _error(tmp_path, [record])
    assert "bad.jsonl:1" in message and f"field {field}" in message and "Traceback" not in message


def test_unknown_name_lists_bundled_sets():
    with pytest.raises(FileNotFoundError) as info:
        load_prompts("no-such-set")
    message = str(info.value)
    assert "'no-such-set'" in message
    for name in BUNDLED_NAMES:
        assert name in message


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(str(tmp_path / "nope.jsonl"))


# ---------------------------------------------------------------- rendering


def _reference_ids(tokenizer, messages, **template_kwargs) -> tuple[list[int], str]:
    """What the public DFlash benchmark does: chat template as text, then encode without special tokens."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False), text


def test_render_prompt_matches_dflash_benchmark(tokenizer):
    record = load_prompts("gsm8k", limit=1)[0]
    ids, text = render_prompt(record, tokenizer, None)
    assert (ids, text) == _reference_ids(tokenizer, [{"role": "user", "content": record.prompt}])
    assert text.startswith("<|im_start|>user\nJanet") and text.endswith("<|im_start|>assistant\n")
    assert all(isinstance(i, int) for i in ids)


def test_render_messages_and_enable_thinking(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    record = PromptRecord(id="c", dataset="d", messages=messages)
    assert render_prompt(record, tokenizer, None) == _reference_ids(tokenizer, messages)
    off_ids, off_text = render_prompt(record, tokenizer, False)
    assert (off_ids, off_text) == _reference_ids(tokenizer, messages, enable_thinking=False)
    assert off_text.endswith("<think>\n\n</think>\n\n")
    assert render_prompt(record, tokenizer, True) == _reference_ids(tokenizer, messages, enable_thinking=True)
    assert "<think>" not in render_prompt(record, tokenizer, None)[1]


def test_render_input_ids_as_is(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False) + [IM_END_ID]
    record = PromptRecord(id="r", dataset="d", input_ids=ids)
    rendered, text = render_prompt(record, tokenizer, False)
    assert rendered == ids and text == tokenizer.decode(ids)


def test_render_without_chat_template(tokenizer):
    plain = make_tokenizer()
    plain.chat_template = None
    with pytest.warns(UserWarning, match="no chat template"):
        ids, text = render_prompt(PromptRecord(id="p", dataset="d", prompt="hello world"), plain, None)
    assert text == "hello world" and ids == plain("hello world").input_ids
    with pytest.raises(ValueError, match="no chat template.*'prompt' text or 'input_ids'"):
        render_prompt(PromptRecord(id="m", dataset="d", messages=[{"role": "user", "content": "x"}]), plain, None)


def test_render_response(tokenizer):
    assert render_response(PromptRecord(id="a", dataset="d", prompt="x"), tokenizer) is None
    text = PromptRecord(id="a", dataset="d", prompt="x", response="The answer is 4.")
    assert render_response(text, tokenizer) == tokenizer.encode("The answer is 4.", add_special_tokens=False)
    ids = PromptRecord(id="a", dataset="d", prompt="x", response=[3, 4, IM_END_ID])
    assert render_response(ids, tokenizer) == [3, 4, IM_END_ID]


def test_user_file_round_trip_through_render(tmp_path, tokenizer):
    path = write_prompts(tmp_path / "mine.jsonl", [{"id": "t", "prompt": "What is 2 + 2?", "response": "4"}])
    (record,) = load_prompts(str(path))
    ids, _ = render_prompt(record, tokenizer, None)
    assert ids == _reference_ids(tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])[0]
    assert render_response(record, tokenizer) == tokenizer.encode("4", add_special_tokens=False)


RECORDS = [{"id": "a", "prompt": "café ✓"}, {"id": "b", "messages": [{"role": "user", "content": "2 + 2?"}]}]


def _saved(path, text: str, encoding: str = "utf-8", bom: bytes = b"") -> str:
    path.write_bytes(bom + text.encode(encoding))
    return str(path)


def test_files_as_windows_editors_save_them(tmp_path):
    lf = "\n".join(json.dumps(r, ensure_ascii=False) for r in RECORDS) + "\n"
    expected = load_prompts(_saved(tmp_path / "lf.jsonl", lf))
    assert [r.id for r in expected] == ["a", "b"] and expected[0].prompt == "café ✓"
    crlf = lf.replace("\n", "\r\n")
    for kind, text, bom in (
        ("bom-crlf", crlf, b"\xef\xbb\xbf"),  # Notepad's "UTF-8 with BOM", CRLF
        ("crlf", crlf, b""),
        ("blank-tail", lf + "\n\r\n", b"\xef\xbb\xbf"),  # trailing blank lines
    ):
        (tmp_path / kind).mkdir()  # the same file name: the dataset is the file's stem
        assert load_prompts(_saved(tmp_path / kind / "lf.jsonl", text, bom=bom)) == expected, kind


@pytest.mark.parametrize(
    ("encoding", "bom", "found"),
    [("utf-16-le", b"\xff\xfe", "UTF-16 LE"), ("utf-16-be", b"\xfe\xff", "UTF-16 BE"), ("latin-1", b"", "not UTF-8")],
)
def test_other_encodings_are_refused_naming_the_file_and_the_encoding(tmp_path, encoding, bom, found):
    record = {"id": "a", "prompt": "café"}  # é: one byte in latin-1, not valid UTF-8
    path = _saved(tmp_path / "prompts.jsonl", json.dumps(record, ensure_ascii=False) + "\n", encoding, bom)
    with pytest.raises(UserError, match=rf"{re.escape(path)}: the file is not UTF-8 \(.*{found}"):
        load_prompts(path)


@pytest.mark.parametrize("text", ["", "\n\n", "\r\n  \r\n"])
def test_an_empty_file_is_refused_naming_it(tmp_path, text):
    path = _saved(tmp_path / "empty.jsonl", text)
    with pytest.raises(UserError, match=rf"{re.escape(path)}: no prompt records"):
        load_prompts(path)

"""Prompt sets for extract: the bundled benchmarks (data/prompts/) and user JSONL files, parsed,
validated and rendered to token ids.

A user file has one JSON object per line with a unique "id" and exactly one of
"messages" (chat), "prompt" (one user message), "input_ids" (used as is) or "turns" (a
conversation's user turns, each answered by the target: pipeline/extract/turns.py); optional
"response" (text or token ids, teacher-forced instead of generated) and "dataset".
Rendering follows the public DFlash benchmark exactly: chat template with tokenize=False and
add_generation_prompt=True, then encode with add_special_tokens=False.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.common.errors import UserError
from pipeline.common.schema import found, validate
from pipeline.extract.records import PROMPT_FORMS, RecordSchema

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "data" / "prompts"
BUNDLED_FILES = ("humaneval", "gsm8k", "mt-bench", "spec-bench")  # data/prompts/<name>.jsonl.gz
# `make extract` default: small enough for SmolLM2-135M on two CPU cores in a few minutes.
# (set name, first N) in this order; a mix of the bundled files, not a copy of them.
DEFAULT_MIX = (("gsm8k", 6), ("humaneval", 5), ("mt-bench", 5))
BUNDLED_NAMES = ("default",) + BUNDLED_FILES

KNOWN_FIELDS = {"id", *PROMPT_FORMS, "response", "dataset"}


@dataclass
class PromptRecord:
    id: str
    dataset: str
    messages: list[dict] | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    turns: list[str] | None = None  # a conversation's user turns (several samples: turns.py)
    response: str | list[int] | None = None  # given response to teacher-force instead of generating
    where: str = field(default="", compare=False)  # file:line it was read from (messages; not in the hash)


# ---------------------------------------------------------------- loading


def _dataset_name(path: Path) -> str:
    """File name without .jsonl / .jsonl.gz / .json: a record's dataset when it names none."""
    name = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


# Byte-order marks of encodings other than UTF-8: named when refused, so the fix is obvious.
FOREIGN_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32 LE",
    b"\x00\x00\xfe\xff": "UTF-32 BE",
    b"\xff\xfe": "UTF-16 LE",
    b"\xfe\xff": "UTF-16 BE",
}


def _read_lines(path: Path) -> list[str]:
    """The file's lines as people save them: UTF-8 with or without a byte-order mark, LF or CRLF
    line endings; any other encoding is refused naming the file and what was found."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    found = next((name for bom, name in FOREIGN_BOMS.items() if raw.startswith(bom)), None)
    try:
        if found is None:
            return raw.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as error:
        found = f"bytes that are not UTF-8 (byte {error.start}: {raw[error.start : error.start + 1]!r})"
    raise UserError(f"{path}: the file is not UTF-8 ({found}); save it as UTF-8 (with or without a BOM)")


def _parse_record(obj, where: str, default_dataset: str) -> PromptRecord:
    """One line's object, validated against the declared schema (records.py)."""
    if not isinstance(obj, dict):
        raise UserError(
            f"{where}: expected a JSON object per line, got {found(obj)}; "
            f'write one object like {{"id": "a1", "prompt": "..."}} per line'
        )
    checked = validate(RecordSchema, obj, where)
    messages = None if checked.messages is None else [message.model_dump() for message in checked.messages]
    return PromptRecord(
        id=checked.id,
        dataset=checked.dataset or default_dataset,
        messages=messages,
        prompt=checked.prompt,
        input_ids=checked.input_ids,
        turns=checked.turns,
        response=checked.response,
        where=where,
    )


def _warn_unread(path: Path, unread: dict[str, int]) -> None:
    """Fields no record form reads, named once per file: a misspelt "reponse" would otherwise
    be generated instead of teacher-forced without a word."""
    if unread:
        names = ", ".join(f"{name!r} (line {line})" for name, line in sorted(unread.items()))
        said = f"field {names} is" if len(unread) == 1 else f"fields {names} are"
        warnings.warn(
            f"{path}: {said} not read (a record has id, one of {'/'.join(PROMPT_FORMS)}, "
            f"and optionally response and dataset)",
            stacklevel=3,
        )


def load_jsonl(path: str | Path) -> list[PromptRecord]:
    """Every record of one prompt file (.jsonl or .jsonl.gz), in file order, validated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    default_dataset = _dataset_name(path)
    records: list[PromptRecord] = []
    first_line_of: dict[str, int] = {}
    unread: dict[str, int] = {}  # field -> first line
    for line_number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as error:
            raise UserError(
                f"{where}: malformed JSON ({error.msg} at column {error.colno}); each line must be one JSON object"
            ) from None
        record = _parse_record(obj, where, default_dataset)
        for name in set(obj) - KNOWN_FIELDS:
            unread.setdefault(name, line_number)
        if record.id in first_line_of:
            raise UserError(
                f"{where}: duplicate id {record.id!r}, first used at {path}:{first_line_of[record.id]}; "
                f"ids must be unique within a prompt set"
            )
        first_line_of[record.id] = line_number
        records.append(record)
    _warn_unread(path, unread)
    if not records:
        raise UserError(
            f"{path}: no prompt records (the file is empty or holds only blank lines); one JSON object a line"
        )
    return records


def first_turn(record: PromptRecord) -> PromptRecord:
    """A conversation's first user turn as a one-message record under the conversation's id
    (`default` keeps MT-Bench's first turns: small, and the ids of its earlier versions)."""
    if record.turns is None:
        return record
    return PromptRecord(id=record.id, dataset=record.dataset, prompt=record.turns[0], where=record.where)


def _load_bundled(name: str) -> list[PromptRecord]:
    if name == "default":
        return [first_turn(r) for set_name, count in DEFAULT_MIX for r in _load_bundled(set_name)[:count]]
    path = PROMPTS_DIR / f"{name}.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(
            f"bundled prompt set {name!r} is missing ({path}); restore data/prompts from git or rebuild it with "
            f"`.venv/bin/python data/prompts/build_prompts.py`"
        )
    return load_jsonl(path)


def load_prompts(name_or_path: str, limit: int | None = None) -> list[PromptRecord]:
    """A bundled set (BUNDLED_NAMES: "default", "humaneval", "gsm8k", "mt-bench", "spec-bench") or a
    user JSONL path.

    Order is file order (deterministic); `limit` keeps the first N records.
    """
    if limit is not None and limit < 0:
        raise UserError(f"limit must be >= 0 or None, got {limit}")
    name = str(name_or_path)
    if name in BUNDLED_NAMES:
        records = _load_bundled(name)
    elif Path(name).expanduser().exists():
        records = load_jsonl(Path(name).expanduser())
    else:
        raise FileNotFoundError(
            f"prompt set {name!r} is neither a bundled name ({', '.join(BUNDLED_NAMES)}) nor an existing "
            f"JSONL file; pass one of those names or a path to a .jsonl file"
        )
    return records if limit is None else records[:limit]


# ---------------------------------------------------------------- rendering


def _chat_messages(record: PromptRecord) -> list[dict]:
    """The messages the template renders; a conversation's first turn alone (turns.py renders the rest)."""
    if record.messages is not None:
        return record.messages
    return [{"role": "user", "content": record.prompt if record.turns is None else record.turns[0]}]


def render_prompt(record: PromptRecord, tokenizer, enable_thinking: bool | None = None) -> tuple[list[int], str]:
    """(prompt token ids, prompt text) exactly as the public DFlash benchmark renders it.

    input_ids: used as given (text = decode). messages / prompt: chat template with
    tokenize=False, add_generation_prompt=True (and enable_thinking only when not None), then
    encode with add_special_tokens=False. A tokenizer without a chat template (a base model)
    gets a "prompt" record's raw text, encoded with the tokenizer's default special tokens
    (e.g. BOS), and a warning; a "messages" record is then an error.
    """
    if record.input_ids is not None:
        ids = list(record.input_ids)
        return ids, tokenizer.decode(ids)
    if not getattr(tokenizer, "chat_template", None):
        if record.prompt is None:
            form = "messages" if record.messages is not None else "turns"
            raise UserError(
                f"prompt {record.id!r} has '{form}' but the tokenizer has no chat template to render them; "
                f"use a chat model, or give the record as 'prompt' text or 'input_ids'"
            )
        # One message for all records, so the default warning filter shows it once.
        warnings.warn("tokenizer has no chat template; 'prompt' records are encoded as raw text", stacklevel=2)
        return list(tokenizer(record.prompt).input_ids), record.prompt
    return render_chat(_chat_messages(record), tokenizer, enable_thinking, record.where or f"prompt {record.id!r}")


def render_chat(messages: list[dict], tokenizer, enable_thinking: bool | None, where: str) -> tuple[list[int], str]:
    """(token ids, text) of chat `messages` through the target's template, as render_prompt says."""
    template_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    except Exception as error:  # noqa: BLE001 - the target's own template code (jinja), run on the user's messages
        raise UserError(
            f"{where}: field 'messages': the target's chat template cannot render "
            f"them ({type(error).__name__}: {error}); give each message's content as plain text"
        ) from None
    return list(tokenizer(text, add_special_tokens=False).input_ids), text


def render_response(record: PromptRecord, tokenizer) -> list[int] | None:
    """Token ids of the record's given response (text encoded with add_special_tokens=False), or None."""
    if record.response is None:
        return None
    if isinstance(record.response, list):
        return list(record.response)
    return list(tokenizer(record.response, add_special_tokens=False).input_ids)


def prompt_set_hash(records: list[PromptRecord]) -> str:
    """sha256 over a canonical JSON of the records (order matters: it is the extraction order)."""
    # `turns` only where a record has them: the hash of a set without any is what it always was
    canonical = json.dumps(
        [
            {k: v for k, v in asdict(record).items() if k != "where" and not (k == "turns" and v is None)}
            for record in records
        ],
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

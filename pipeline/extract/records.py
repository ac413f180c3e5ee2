"""The declared schema of one prompt record (one line of a user's JSONL prompt file).

Four forms, exactly one per record: `{"id", "messages": [{"role", "content"}, ...]}` (chat),
`{"id", "prompt": "..."}` (one user message), `{"id", "input_ids": [...]}` (used as is),
`{"id", "turns": ["...", "..."]}` (a conversation's user turns, each answered by the target in
turn: pipeline/extract/turns.py).
Optional: `"response"` (text or token ids, teacher-forced instead of generated; not with turns) and
`"dataset"` (else the file's name). Fields it does not name are read by nothing: prompts.py
says which, once per file, so a misspelt `"reponse"` is not silently generated instead.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from pipeline.common.schema import LARGEST, Count, Schema, wrong

PROMPT_FORMS = ("messages", "prompt", "input_ids", "turns")
TOKEN_IDS = "a non-empty list of non-negative integer token ids, e.g. [1, 4093, 314]"
Text = Annotated[str, Field(min_length=1)]


class Message(Schema):
    """One chat message as chat templates take it: a role and its content (text, or a list of
    content parts for templates that take them)."""

    role: Text = Field(description='"user", "assistant" or "system"')
    content: Any = Field(description="the message text")

    @field_validator("content")
    @classmethod
    def _content(cls, value):
        if not isinstance(value, (str, list)):
            raise wrong(value, "a string (or a list of content parts)")
        return value


class RecordSchema(Schema):
    id: Any = Field(description="a unique non-empty string; every record needs its own id")
    messages: Annotated[list[Message], Field(min_length=1)] | None = None
    prompt: Text | None = None
    input_ids: Annotated[list[Count], Field(min_length=1)] | None = None
    turns: Annotated[list[Text], Field(min_length=1)] | None = None
    response: Any = None
    dataset: Text | None = None

    @field_validator("id")
    @classmethod
    def _id(cls, value):
        # integer ids (as many datasets number their rows) are names too
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or not value:
            raise wrong(value, 'a unique non-empty string (every record needs its own "id")')
        return value

    @field_validator("response")
    @classmethod
    def _response(cls, value):
        text = isinstance(value, str) and value
        ids = isinstance(value, list) and value and all(_is_count(t) for t in value)
        if value is not None and not (text or ids):
            raise wrong(value, f"non-empty text or {TOKEN_IDS} (or leave it out to generate)")
        return value

    @model_validator(mode="after")
    def _one_form(self):
        forms = [form for form in PROMPT_FORMS if getattr(self, form) is not None]
        if len(forms) != 1:
            seen = " and ".join(forms) if forms else "none"
            raise ValueError(
                f"field {'/'.join(PROMPT_FORMS)!r}: exactly one is required (found {seen}); use "
                f'{{"id", "messages": [...]}}, {{"id", "prompt": "..."}}, {{"id", "input_ids": [...]}} '
                f'or {{"id", "turns": ["...", "..."]}}'
            )
        if self.turns is not None and self.response is not None:
            # each turn's answer is the target's own: the next turn's prompt is built from it
            raise ValueError(
                "field 'response': a 'turns' record has no given response (the target answers every turn); "
                "leave 'response' out, or give the conversation as 'messages' with its 'response'"
            )
        return self

    @property
    def unread_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= LARGEST

"""One prompt ready to run (`Item`), what extract's plan (plan.py) makes of each prompt record
and every later step reads; here, apart from the plan, so the conversation turns (turns.py)
build items without importing the plan that expands them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Item:
    """One prompt ready to run: rendered prompt ids and, when given, the response to teacher-force."""

    sample_id: str
    dataset: str
    prompt_ids: list[int]
    prompt_text: str
    given: list[int] | None = None
    draw: int | None = None  # sampled: which draw of its prompt (sample id `<prompt_id>#<draw>`)
    prompt_id: str | None = None  # sampled: the prompt record's id, what the draw's seed is made of
    where: str = field(default="", compare=False)  # the prompt file and line it came from, for messages
    # a "turns" record's turn (1-based; sample id `<conversation>/turn-<turn>`) and the user turns up
    # to it; a later turn's prompt_ids stay empty until its earlier answers exist (turns.py)
    conversation: str | None = None
    turn: int | None = None
    user_turns: list[str] | None = field(default=None, compare=False)
    frame_len: int = 0  # later turns: tokens of the conversation rendered with empty answers

    @property
    def label(self) -> str:
        """How messages name it: 'prompts.jsonl:3 (prompt 'a1')', or the id alone for bundled sets."""
        return f"{self.where} (prompt {self.sample_id!r})" if self.where else f"prompt {self.sample_id!r}"


def label(record) -> str:
    """How messages name a prompt record: its file and line when it came from a file."""
    return f"{record.where} (prompt {record.id!r})" if record.where else f"prompt {record.id!r}"

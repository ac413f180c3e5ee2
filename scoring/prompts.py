"""What a stored prompt shows a reader: the user's message inside its chat-template render.

Shards keep the prompt as the target saw it (`prompt_text`, the template applied); samples.parquet
adds `prompt_message`, the user's own words, for tables and queries (results.py), and the report
shows it. Recognised from the template's markers, so a template not listed gives the render
without its system block and assistant header.
"""

from __future__ import annotations

import re

# The last user turn of the chat templates we know, as (start marker, end marker) regexes:
# ChatML (SmolLM2, Qwen), Llama 3, Gemma, Mistral/Llama 2 [INST].
_USER_TURNS = [
    re.compile(r"<\|im_start\|>user\s*\n(.*?)(?:<\|im_end\|>|$)", re.S),
    re.compile(r"<\|start_header_id\|>user<\|end_header_id\|>\s*(.*?)(?:<\|eot_id\|>|$)", re.S),
    re.compile(r"<start_of_turn>user\s*\n(.*?)(?:<end_of_turn>|$)", re.S),
    re.compile(r"\[INST\](.*?)(?:\[/INST\]|$)", re.S),
]
# A leading system block (ChatML or Llama 3) and a trailing assistant header, for templates whose
# user turn we do not recognise.
_SYSTEM_BLOCK = re.compile(
    r"^\s*(?:<\|im_start\|>system.*?<\|im_end\|>|<\|start_header_id\|>system<\|end_header_id\|>.*?<\|eot_id\|>)\s*",
    re.S,
)
_ASSISTANT_HEADER = re.compile(r"(?:<\|im_start\|>assistant|<\|start_header_id\|>assistant<\|end_header_id\|>)\s*$")


def user_message(prompt_text: str | None) -> str:
    """The user's question inside a chat-templated prompt: the last user turn when a known
    template's markers are there; else the text without a leading system block and a trailing
    assistant header; else the text as it is."""
    if not prompt_text:
        return ""
    for pattern in _USER_TURNS:
        turns = pattern.findall(prompt_text)
        if turns and turns[-1].strip():
            return turns[-1].strip()
    stripped = _ASSISTANT_HEADER.sub("", _SYSTEM_BLOCK.sub("", prompt_text, count=1))
    return stripped.strip() or prompt_text

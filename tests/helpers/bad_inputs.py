"""Bad inputs, generated (hypothesis): a valid JSON document a user writes or brings (a prompt
record, a drafter config, a manifest or sidecar, run.json, the loggers' ledger) broken in one
place, and what a command that reads it must then do.

A `Mutation` changes one place of the document: `retype` (a value of another JSON kind),
`delete` (a key), `extra` (a key the schema does not declare), `boundary` (an edge number:
-1, 0, 2**31, 2**63, 1e30, NaN, Infinity, 0.5), `unicode` (any text, empty included) or
`not-object` (the whole document some other JSON value). The oracle is the declared schema
itself: if it refuses the document, the command must exit 2 with one `error:` line naming the
file and the field pydantic names; if it accepts it, the command may succeed or refuse for a
reason of its own (a token id beyond the target's vocabulary, weights that no longer fit the
config), but always in one `error:` line naming the file. Never a traceback, and a refused run
writes nothing.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from pipeline.common.schema import field_path

EDGE_NUMBERS = [-1, 0, 1, 2**31, 2**63, 10**30, -(10**30), 0.5, math.nan, math.inf, -math.inf]
KINDS = ["retype", "delete", "extra", "boundary", "unicode", "not-object"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**64), max_value=2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@dataclass
class Mutation:
    kind: str
    path: tuple  # where it changed (for `extra`: the new key's path)
    document: object  # the document after the change

    def __str__(self) -> str:
        return f"{self.kind} at {field_path(self.path) or '<document>'}"


def places(document, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside `document` (dict keys and list indices), outermost first."""
    found = []
    items = (
        document.items() if isinstance(document, dict) else enumerate(document) if isinstance(document, list) else []
    )
    for key, value in items:
        found.append(prefix + (key,))
        found += places(value, prefix + (key,))
    return found


def containers(document, prefix: tuple = ()) -> list[tuple]:
    """Paths of every object (dict) inside `document`, the document itself first."""
    found = [prefix] if isinstance(document, dict) else []
    for path in places(document, prefix):
        if isinstance(get(document, path[len(prefix) :]), dict):
            found.append(path)
    return found


def get(document, path: tuple):
    for key in path:
        document = document[key]
    return document


def replaced(document, path: tuple, value):
    out = copy.deepcopy(document)
    get(out, path[:-1])[path[-1]] = value
    return out


def kind_of(value) -> str:
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


@st.composite
def mutations(draw, document: dict, kinds: tuple[str, ...] = tuple(KINDS)) -> Mutation:
    """One break of `document` (never a no-op)."""
    everywhere = places(document)
    numbers = [p for p in everywhere if kind_of(get(document, p)) == "number"]
    texts = [p for p in everywhere if isinstance(get(document, p), str)]
    keyed = [p for p in everywhere if isinstance(p[-1], str)]
    usable = {
        "retype": everywhere,
        "delete": keyed,
        "extra": containers(document),
        "boundary": numbers,
        "unicode": texts,
        "not-object": [()],
    }
    kind = draw(st.sampled_from([k for k in kinds if usable[k]]))
    path = draw(st.sampled_from(usable[kind]))
    if kind == "not-object":
        return Mutation(kind, (), draw(json_values.filter(lambda v: not isinstance(v, dict))))
    if kind == "delete":
        out = copy.deepcopy(document)
        del get(out, path[:-1])[path[-1]]
        return Mutation(kind, path, out)
    if kind == "extra":
        taken = get(document, path)
        key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in taken))
        out = copy.deepcopy(document)
        get(out, path)[key] = draw(json_values)
        return Mutation(kind, path + (key,), out)
    old = get(document, path)
    if kind == "retype":
        value = draw(json_values.filter(lambda v: kind_of(v) != kind_of(old)))
    elif kind == "boundary":
        value = draw(st.sampled_from([v for v in EDGE_NUMBERS if not _same(v, old)]))
    else:
        value = draw(st.text(max_size=40).filter(lambda v: v != old))
    return Mutation(kind, path, replaced(document, path, value))


def _same(a, b) -> bool:
    return type(a) is type(b) and (a == b or (a != a and b != b))


def schema_verdict(model: type[BaseModel], document) -> str | None:
    """The field path the declared schema complains about first ('' for the document as a
    whole), or None when it accepts the document."""
    if not isinstance(document, dict):
        return ""
    try:
        model.model_validate(document)
    except ValidationError as error:
        return field_path(error.errors()[0]["loc"])
    return None


def write_json(path, document) -> None:
    """As a user's editor would: plain JSON (NaN/Infinity as Python's json writes them)."""
    Path(path).write_text(json.dumps(document, indent=1))


def listing(directory) -> dict[str, int]:
    """Every file below `directory` with its size: what 'nothing written' is checked against."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, directory)] = os.path.getsize(full)
    return out


def check_outcome(result, mutation: Mutation, file: str, field: str | None, wrote: bool) -> str:
    """What a command did with a broken input, checked: 'refused' or 'accepted'. `field` is
    the schema's verdict (None: the schema accepts the document); `wrote` whether anything
    appeared in the command's outputs."""
    output = result.output
    context = f"{mutation} -> exit {result.exit_code}:\n{output[-1500:]}"
    assert "Traceback" not in output, context
    assert result.exception is None or isinstance(result.exception, SystemExit), f"{context}\n{result.exception!r}"
    if result.exit_code == 0:
        assert field is None, f"the schema refuses field {field!r} but the command accepted it: {context}"
        return "accepted"
    assert result.exit_code in (1, 2), context
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors, f"no error: line: {context}"
    assert any(file in line for line in errors), f"the error does not name {file}: {context}"
    if field:
        assert any(repr(field) in line for line in errors), f"the error does not name field {field!r}: {context}"
    assert not wrote, f"a refused run wrote output: {context}"
    return "refused"

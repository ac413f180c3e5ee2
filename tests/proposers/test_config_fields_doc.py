"""docs/config-fields.md and the code agree: every field every layout schema declares (and every
namespace schema nested in one) is in the page's table for that layout, and every field the page
lists as refused is refused by the code, the error naming it (an example config per field comes
from tests/helpers/config_layouts.py, so a new refused row needs an example there)."""

from __future__ import annotations

import pathlib
import re

import pytest
from pydantic import BaseModel

from pipeline.common.errors import UserError
from pipeline.common.schema import Schema
from proposers.checkpoints.files import CheckpointError, resolve_checkpoint_files
from proposers.detect import parse_drafter_config
from proposers.registry import layout_classes
from tests.helpers.config_layouts import BASE, PRIOR_REFUSALS, REFUSALS, TARGET_LAYERS, changed

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config-fields.md"
STATUSES = ("implemented", "refused", "training-only", "bookkeeping")
NAMESPACE_PREFIXES = ("", "transformer_layer_config.", "text_config.")


def sections() -> list[dict]:
    """Each heading's backticked layouts and classes, and its table rows (field paths, status)."""
    found, in_table = [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            names = re.findall(r"`([^`]+)`", line)
            layouts = [n for n in names if ":" in n]
            found.append({"layouts": layouts, "classes": [n for n in names if ":" not in n], "rows": []})
        elif line.startswith("| field | status |"):
            in_table = True
        elif not line.startswith("|"):
            in_table = False
        elif in_table and line.startswith("| `") and found:
            cells = [c.strip() for c in line.strip("|").split("|")]
            found[-1]["rows"].append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return found


def schemas() -> list[type]:
    """Every layout class and every schema nested in one (namespaces, decoders)."""
    found, todo = [], list(layout_classes())
    while todo:
        cls = todo.pop()
        if cls in found:
            continue
        found.append(cls)
        for info in cls.model_fields.values():
            todo += [c for c in nested(info.annotation) if c not in found]
    return found


def nested(annotation) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [c for arg in getattr(annotation, "__args__", ()) for c in nested(arg)]


def last(path: str) -> str:
    return re.sub(r"\[\d+\]", "", path).split(".")[-1]


def test_the_page_cites_released_packages_not_this_machine():
    text = DOC.read_text()
    assert not re.search(r"/tmp/|/work/|site-packages", text)
    for engine in ("vLLM 0.33.0", "SGLang 0.5.23", "llama-cpp-python 0.3.36"):
        assert engine in text


@pytest.mark.parametrize("schema", schemas(), ids=lambda c: c.__name__)
def test_every_declared_field_is_in_its_layouts_table(schema):
    bases = {c.__name__ for c in schema.__mro__ if isinstance(c, type) and issubclass(c, Schema)}
    listed = {last(p) for s in sections() if bases & set(s["classes"]) for paths, _ in s["rows"] for p in paths}
    assert listed, f"no section of docs/config-fields.md names {schema.__name__} or a base of it"
    keys = {info.alias or name for name, info in schema.model_fields.items()}  # as the file spells them
    missing = sorted(keys - listed)
    assert not missing, f"{schema.__name__}: {missing} are declared but not in docs/config-fields.md"


def test_every_row_has_a_status_and_every_section_its_layouts():
    for section in sections():
        assert all(layout in BASE for layout in section["layouts"]), section["layouts"]
        for paths, status in section["rows"]:
            assert paths and any(word in status for word in STATUSES), (paths, status)


def examples(layouts: list[str], path: str) -> list[tuple[str, dict]]:
    """(layout, changes) from the example tables for `path` in one of `layouts`."""
    spelled = {prefix + path for prefix in NAMESPACE_PREFIXES}
    mine = [(layout, {p: value}) for layout, p, value, _, _ in REFUSALS if p in spelled]
    mine += [(layout, changes) for layout, p, changes in PRIOR_REFUSALS if p in spelled]
    return [(layout, changes) for layout, changes in mine if any(layout.startswith(k) for k in layouts)]


def refused_rows() -> list[tuple[list[str], str]]:
    return [(s["layouts"], p) for s in sections() for paths, status in s["rows"] if "refused" in status for p in paths]


@pytest.mark.parametrize(("layouts", "path"), refused_rows(), ids=lambda v: str(v))
def test_every_field_listed_as_refused_is_refused_naming_it(layouts, path, tmp_path):
    if path == "mask_embedding.pt":
        (tmp_path / "model.safetensors").write_bytes(b"")
        (tmp_path / path).write_bytes(b"")
        with pytest.raises(CheckpointError, match=re.escape(path)):
            resolve_checkpoint_files(str(tmp_path))
        return
    found = examples(layouts, path)
    assert found, f"docs/config-fields.md lists {path!r} as refused ({layouts}): add an example to config_layouts.py"
    for layout, changes in found:
        with pytest.raises(UserError) as caught:
            parse_drafter_config(changed(layout, changes), "c.json", TARGET_LAYERS)
        assert f"{last(path)}'" in str(caught.value) or f"{last(path)} " in str(caught.value), str(caught.value)

"""Declared input schemas, and the one error line a value that breaks one becomes.

Every file a user writes or brings (prompt records, drafter configs of every layout, manifests
and sidecars, run.json, the loggers' ledger) is declared as a `Schema` subclass beside the code
that reads it, and validated with `validate` before anything acts on it. pydantic does the
checking (it is what speculators and vLLM declare these same drafter configs with, it reports
every problem with its path inside nested objects, and it is strict about JSON types when asked);
this module only turns its first complaint into one line naming the file, the field's path
(`transformer_layer_config.num_hidden_layers`, `messages[0].role`), what was found and what is
expected.

Strict mode: JSON "16" is not the integer 16, 16.0 is not an integer, true is not 1: a config
edited by hand with a wrong type is refused, never coerced into another drafter.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.common.errors import UserError

# Sizes, counts and ids in these files are far below this; a larger value is a typo or damage,
# refused before it becomes a tensor shape or an allocation.
LARGEST = 2**31 - 1

Count = Annotated[int, Field(ge=0, le=LARGEST)]  # 0 allowed: lengths, token ids, small counts
Size = Annotated[int, Field(ge=0, le=2**63 - 1)]  # bytes and token totals, which pass 2**31
Positive = Annotated[int, Field(ge=1, le=LARGEST)]  # sizes: layers, heads, widths
Number = Annotated[float, Field(allow_inf_nan=False)]


class SchemaError(UserError):
    """An input that does not match its declared schema."""


class Schema(BaseModel):
    """A declared input: strict JSON types, no NaN/Infinity; fields the schema does not name
    are kept (`model_extra`) and ignored unless a subclass forbids them."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False, frozen=True)


class ClosedSchema(Schema):
    """A declared input whose unknown fields are refused (files this project writes itself)."""

    model_config = ConfigDict(extra="forbid")


class ClosedNamespace(ClosedSchema):
    """A namespace of someone else's file whose every key the schema enumerates (a drafter
    config's `dflash_config`, `eagle_config`, `speculators_config`): a key it does not name is
    refused with `UNKNOWN_KEY`, naming its path, rather than dropped."""

    UNKNOWN_KEY: ClassVar[str] = "is not a field specreplay knows"


Model = TypeVar("Model", bound=BaseModel)


def validate(
    model: type[Model], data: Any, source: str, fix: str = "", error_class: type[UserError] | None = None
) -> Model:
    """`data` as `model`, or SchemaError (or `error_class`) naming `source`, the field, the value and the fix."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = error.errors(include_url=False)
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        tail = f"; {fix}" if fix else ""
        first = problems[0]
        hint = _description(model, first["loc"]) if first["type"] == "missing" else None
        said = describe(first) + (f" (expected: {hint})" if hint else "")
        if first["type"] == "extra_forbidden":
            said = _unknown_key(model, first["loc"]) or said
        raise (error_class or SchemaError)(f"{source}: {said}{more}{tail}") from None


def _unknown_key(model: type[BaseModel], loc: tuple) -> str | None:
    """The refusal of the unknown key at `loc` in its namespace's own words (ClosedNamespace), or None."""
    owner = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        fields = getattr(owner, "model_fields", {})
        if part not in fields:
            return None
        owner = _nested_model(fields[part].annotation)
    why = getattr(owner, "UNKNOWN_KEY", None)
    return f"field {field_path(loc)!r} {why}" if why else None


def _description(model: type[BaseModel], loc: tuple) -> str | None:
    """The declared `description` of the field at `loc`, following nested schemas and lists."""
    info = None
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return None
        info = fields[part]
        model = _nested_model(info.annotation)
    return info.description if info else None


def _nested_model(annotation) -> type | None:
    """The schema class inside `list[X]`, `X | None`, `Annotated[X, ...]`, or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found_model = _nested_model(arg)
        if found_model is not None:
            return found_model
    return None


def field_path(loc: tuple) -> str:
    """('transformer_layer_config', 'num_hidden_layers') -> 'transformer_layer_config.num_hidden_layers';
    ('messages', 0, 'role') -> 'messages[0].role'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def found(value: Any) -> str:
    """A found value as a reader recognises it: short, with its JSON kind when that is the point."""
    kinds = {
        str: "a string",
        bool: "true/false",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "an object",
    }
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = kinds.get(type(value))
    return f"{text} ({kind})" if kind and not isinstance(value, (dict, list)) else (kind or text)


# pydantic's message for each error type, as the expectation it states
EXPECTED = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "none_required": "null",
}


BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def describe(problem: dict) -> str:
    """One pydantic error as 'field X is <found>; expected <what>'."""
    where = field_path(problem["loc"])
    kind, message = problem["type"], problem["msg"]
    if kind == "missing":
        return f"missing field {where!r}"
    if kind == "extra_forbidden":
        return f"unknown field {where!r}"
    if kind == "value_error":  # a validator's own message: already says what is expected
        message = message.removeprefix("Value error, ")
        return f"field {where!r} {message}" if where else message
    bound = next(
        (f"a value {sign} {problem['ctx'][key]}" for key, sign in BOUNDS.items() if key in problem.get("ctx", {})), None
    )
    expected = EXPECTED.get(kind) or bound or message.removeprefix("Input should be ").removeprefix("input should be ")
    subject = f"field {where!r} is" if where else "the file holds"
    return f"{subject} {found(problem.get('input'))}; expected {expected}"


def wrong(value: Any, expected: str) -> ValueError:
    """A field validator's complaint, in the same words as pydantic's own (see `describe`)."""
    return ValueError(f"is {found(value)}; expected {expected}")

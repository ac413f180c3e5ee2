"""Click defaults read from the dataclasses the options fill, so the two never disagree."""

from __future__ import annotations

import dataclasses


def default(config_class, name: str):
    """The declared default of `config_class.name` (default_factory called)."""
    field = config_class.__dataclass_fields__[name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default

"""The config layouts that are an engine's own settings for a proposer reading the tokens alone (an
n-gram lookup, a standalone draft model), torch-free: no transformers namespace, no feature layer,
nothing to complete. A subclass declares its fields, `FAMILY` and `evidence`."""

from __future__ import annotations

from typing import ClassVar

from pipeline.common.schema import ClosedSchema


class EngineSettings(ClosedSchema):
    FAMILY: ClassVar[str] = ""
    CONVENTION: ClassVar[str] = "output"

    @property
    def family(self) -> str:
        return self.FAMILY

    def check_complete(self, source: str) -> None:
        """Nothing to add: the schema gives every field the engine's default or requires it."""

    def namespaces(self) -> dict:
        """No namespace is a transformers config: the schema is closed (proposers/fields/known.py)."""
        return {}

    def stored_layer_ids(self) -> list[int]:
        return []

    def feature_layers(self, source: str, num_target_layers: int | None = None) -> list[int]:
        return []  # the tokens alone: shards extracted with --layer-ids none serve it

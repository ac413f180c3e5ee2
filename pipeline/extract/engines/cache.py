"""Responses already fetched from an engine, kept under OUT/responses/ so a resumed extract
never asks for them again (a restarted server, an interrupted extract, a length error fixed).

Layout: OUT/responses/rRRR-NNNNN.json, written atomically with a checksum (pipeline/shards/files.py)
by rank RRR as responses arrive (every `flush_every` responses or `flush_seconds`, and always
before an error is raised), never rewritten:

    {"responses": [{"sample_id", "key", "token_ids", "finish_reason"}, ...], "checksum"}

`key` is the sha256 of everything that made the response (prompt ids, max_new_tokens, sampling,
seed, engine, served model): a response is reused only for the same request. A damaged file is
an error naming it; deleting it makes its responses be fetched again.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Annotated

import pyarrow.fs as pafs
from pydantic import Field

from pipeline import shards
from pipeline.common.schema import ClosedSchema, Count, validate
from pipeline.engines.dialect import Request


class StoredResponse(ClosedSchema):
    sample_id: Annotated[str, Field(min_length=1)]
    key: Annotated[str, Field(min_length=64, max_length=64)]
    token_ids: list[Count]
    finish_reason: str


class ResponseFile(ClosedSchema):
    responses: list[StoredResponse]


def request_key(request: Request, engine: str) -> str:
    """sha256 of what makes the response (see the module docstring)."""
    sampling = None if request.sampling is None else request.sampling.as_dict()
    made_of = [
        request.prompt_ids,
        request.max_new_tokens,
        request.stop_ids,
        sampling,
        request.seed,
        engine,
        request.model,
    ]
    return hashlib.sha256(json.dumps(made_of).encode()).hexdigest()


class ResponseStore:
    """This rank's view of OUT/responses/: every response any rank stored, and a writer for new ones."""

    def __init__(self, out: str, rank: int, flush_every: int = 64, flush_seconds: float = 10.0):
        self.fs, root = shards.open_fs(out)
        self.dir = shards.join(root, shards.RESPONSES_DIR)
        self.fs.create_dir(self.dir, recursive=True)
        self.rank, self.flush_every, self.flush_seconds = rank, flush_every, flush_seconds
        self.known: dict[tuple[str, str], StoredResponse] = {}
        self.pending: list[StoredResponse] = []
        self.next_index = 0
        self.last_flush = time.monotonic()
        for path in self._files():
            self._load(path)

    def _files(self) -> list[str]:
        listed = self.fs.get_file_info(pafs.FileSelector(self.dir))
        return sorted(info.path for info in listed if info.path.endswith(".json"))

    def _load(self, path: str) -> None:
        fix = "delete that file: its responses are then fetched again"
        data = shards.read_json(self.fs, path, fix=fix, required=True)
        stored = validate(ResponseFile, data, path, fix=fix, error_class=shards.ShardError)
        for response in stored.responses:
            self.known[(response.sample_id, response.key)] = response
        name = path.rsplit("/", 1)[-1]
        if name.startswith(f"r{self.rank:03d}-"):
            self.next_index = max(self.next_index, int(name[5:10]) + 1)

    def get(self, sample_id: str, key: str) -> StoredResponse | None:
        return self.known.get((sample_id, key))

    def add(self, sample_id: str, key: str, token_ids: list[int], finish_reason: str) -> StoredResponse:
        response = StoredResponse(sample_id=sample_id, key=key, token_ids=list(token_ids), finish_reason=finish_reason)
        self.known[(sample_id, key)] = response
        self.pending.append(response)
        if len(self.pending) >= self.flush_every or time.monotonic() - self.last_flush >= self.flush_seconds:
            self.flush()
        return response

    def flush(self) -> None:
        """Land what arrived since the last flush as one new file (nothing when nothing arrived)."""
        self.last_flush = time.monotonic()
        if not self.pending:
            return
        path = shards.join(self.dir, f"r{self.rank:03d}-{self.next_index:05d}.json")
        shards.write_json_atomic(self.fs, path, {"responses": [r.model_dump() for r in self.pending]})
        self.pending, self.next_index = [], self.next_index + 1

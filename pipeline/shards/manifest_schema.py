"""The declared contents of manifest.json and of each shard's .json sidecar: what every reader
(score, inspect, fit, diagnose, the resume) takes from them, with its type. Stage 1 writes them;
a hand edit, a damaged copy that still parses, or a foreign file is refused here, naming the field,
before any reader acts on it. Parts absent in older formats are optional."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.common.dtypes import STORAGE_DTYPES
from pipeline.common.schema import Count, Number, Positive, Schema, Size
from pipeline.shards.schema import SHARD_DIR

Hash = Annotated[int, Field(ge=0)]  # 32- and 64-bit checksums
StorageDtype = Literal[tuple(STORAGE_DTYPES)]


class ExcludedSample(Schema):
    sample_id: str


class ShardEntry(Schema):
    """One finished shard: its file, row and byte counts, the schema block after the 8-byte
    magic and every record batch back to back ([offset, length, rows, checksum]), and one
    sample id (and dataset) per row."""

    file: Annotated[str, Field(pattern=rf"^{SHARD_DIR}/r\d+-\d+\.arrow$")]
    rows: Count
    tokens: Size
    bytes: Size
    schema_block: Annotated[list[Hash], Field(min_length=3, max_length=3)]
    batches: list[Annotated[list[Hash], Field(min_length=4, max_length=4)]]
    sample_ids: list[str]
    datasets: list[str] | None = None
    excluded: list[ExcludedSample] = []
    finish_reasons: dict[str, Count] = {}
    argmax_mismatches: Count = 0
    response_tokens: Size = 0
    greedy_samples: Count = 0
    greedy_response_tokens: Size = 0
    greedy_argmax_mismatches: Count = 0
    mismatched_samples: dict[str, Count] = {}  # greedy samples with argmax mismatches: {sample id: positions}
    sampled_response_tokens: Size = 0
    zero_prob_tokens: Count = 0

    @model_validator(mode="after")
    def _consistent(self):
        problem = entry_problem(self)
        if problem:
            raise ValueError(f"does not add up: {problem}")
        return self


def entry_problem(entry: ShardEntry) -> str | None:
    """Why an entry's counts and byte ranges disagree with each other, or None."""
    if entry.schema_block[0] != 8:
        return f"the schema block of {entry.file} does not start after the 8-byte magic"
    end = entry.schema_block[0] + entry.schema_block[1]
    for offset, length, _, _ in entry.batches:
        if offset != end:
            return f"the record batch ranges of {entry.file} are not back to back"
        end = offset + length
    if end > entry.bytes:
        return f"the record batches of {entry.file} end past its {entry.bytes} bytes"
    if sum(block[2] for block in entry.batches) != entry.rows:
        return f"the record batches of {entry.file} do not hold its {entry.rows} rows"
    for name, values in (("sample_ids", entry.sample_ids), ("datasets", entry.datasets)):
        if values is not None and len(values) != entry.rows:
            return f"the {name} of {entry.file} are not its {entry.rows} rows"
    return None


class TargetFacts(Schema):
    """The target's identity (settings.target; the top-level `target` adds its name and path)."""

    architecture: str | None = None
    num_layers: Positive
    hidden_size: Positive
    vocab_size: Positive
    dtype: str | None = None
    stop_token_ids: list[Count] = []
    pad_token_id: Count | None = None
    bos_token_id: Count | None = None
    max_position_embeddings: Positive | None = None
    name: str | None = None
    path: str | None = None


class PromptSet(Schema):
    count: Count | None = None
    hash: str | None = None
    name: str | None = None
    rendered_hash: str | None = None


class SamplingSettings(Schema):
    temperature: Number
    top_p: Number = 1.0
    top_k: Count = 0
    num_samples: Positive | None = None
    seed: int | None = None


class NeighbourLayers(Schema):
    requested: list[Count]


class LayerUse(Schema):
    """layer_uses[]: who asked extract for which feature layers (informational; inspect shows it)."""

    by: str  # "--draft-config <path>", "--layer-ids", or the default formula
    family: str | None = None  # a drafter config's family and layout
    layout: str | None = None
    layer_ids: list[int]


class ExtractSettings(Schema):
    """settings: what must not change between an extract and its resume."""

    format_version: int | None = None
    target: TargetFacts
    layer_ids: list[Count]  # [] from extract --layer-ids none: no features stored, tokens and top-k only
    feature_dtype: StorageDtype | None = None
    top_k: Count
    max_new_tokens: Count | None = None
    enable_thinking: bool | None = None
    decoding: Literal["greedy", "sampled"] = "greedy"
    prompts: PromptSet | None = None
    sampling: SamplingSettings | None = None
    neighbour_layers: NeighbourLayers | None = None
    beyond_positions: bool = False


class TargetHead(Schema):
    file: str | None = None
    bytes: Size | None = None
    crc32: Hash | None = None
    dtype: StorageDtype | None = None
    tied: bool | None = None


class Tokenizer(Schema):
    dir: str | None = None
    files: dict[str, Count] = {}


class Totals(Schema):
    """totals: sums over the shard entries (pipeline/outdir/entries.py), read by inspect and score."""

    samples: Count = 0
    tokens: Size = 0
    prompt_tokens: Size = 0
    response_tokens: Size = 0
    bytes: Size = 0
    raw_bf16_feature_bytes: Size = 0
    finish_reasons: dict[str, Count] = {}
    argmax_mismatches: Count = 0
    greedy_samples: Count = 0
    greedy_response_tokens: Size = 0
    greedy_argmax_mismatches: Count = 0
    excluded_samples: Count = 0


class RunFacts(Schema):
    """run: how the extract ran (sizes it chose, versions); shown by inspect."""

    chunk_tokens: Positive | None = None
    batch_size: Positive | None = None
    shard_bytes: Size | None = None
    memory_bytes: Size | None = None
    world_size: Positive | None = None
    device: str | None = None


class ManifestFile(Schema):
    format_version: int
    complete: bool = False
    tensors: dict[str, StorageDtype] = {}
    settings: ExtractSettings | None = None  # absent: ShardSet says so when asked
    target: TargetFacts | None = None
    target_head: TargetHead = TargetHead()
    prompts: PromptSet = PromptSet()
    layer_uses: list[LayerUse] = []
    run: RunFacts = RunFacts()
    tokenizer: Tokenizer = Tokenizer()
    totals: Totals = Totals()
    shards: list[ShardEntry] | None = None  # absent: ShardSet.entries says so when asked

    @field_validator("shards")
    @classmethod
    def _distinct(cls, value):
        files = [entry.file for entry in value or []]
        if len(set(files)) != len(files):
            raise ValueError("lists a shard twice")
        return value

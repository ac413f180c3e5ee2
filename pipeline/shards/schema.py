"""What a shard holds: the Sample a row becomes, the Arrow schema of a shard file, the names
inside an extract directory, and ShardError for bytes that cannot be trusted."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import torch

from pipeline.common.errors import UserError

# Format 3 = format 2's shard files, with a checksum in every JSON file (manifest.json, the
# sidecars); format 2 extracts are still read (their JSON unchecked, only checked for consistency).
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (2, 3)
JSON_CHECKSUM_SINCE = 3  # the first format whose manifest and sidecars must carry a checksum
MANIFEST_NAME = "manifest.json"
TARGET_HEAD_NAME = "target_head.safetensors"
TOKENIZER_DIR = "tokenizer"  # the target tokenizer (save_pretrained), for reports that show text
RESPONSES_DIR = "responses"  # a serving engine's responses (extract --responses-from), kept for resume
SHARD_DIR = "shards"
# Tokens per record batch: longer channel runs compress better, a chunk is held whole while it
# is written or read (bench/README.md "Feature codecs" compares chunk sizes).
DEFAULT_CHUNK_TOKENS = 4096
CODEC_KEY = b"specreplay.codec"  # schema metadata: the codec of the tensor frames ("none": raw planes)

# Scalar columns every row carries, in schema order.
SCALAR_FIELDS = [
    pa.field("sample_id", pa.string()),
    pa.field("dataset", pa.string()),
    pa.field("prompt_text", pa.string()),
    pa.field("prompt_len", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("greedy", pa.bool_()),
    pa.field("input_ids", pa.list_(pa.int32())),
]


class ShardError(UserError):
    """A shard or manifest that cannot be trusted (corrupt, missing, or of another format)."""


@dataclass
class Sample:
    """One extracted prompt + response. Tensors are CPU torch tensors."""

    sample_id: str
    dataset: str
    prompt_text: str
    input_ids: torch.Tensor  # [N] int64, prompt + response
    prompt_len: int
    finish_reason: str  # "eos" | "length" | "given"
    greedy: bool
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def response_len(self) -> int:
        return int(self.input_ids.numel()) - self.prompt_len

    def __getattr__(self, name):  # sample.features, sample.topk_ids, ...
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(name)


def shard_schema(tensor_names: list[str], codec: str = "zstd") -> pa.Schema:
    """The scalar columns, then per tensor its frame (`<tensor>`) and row shapes (`<tensor>_shape`)."""
    fields = list(SCALAR_FIELDS)
    for name in tensor_names:
        fields.append(pa.field(name, pa.large_binary()))
        fields.append(pa.field(name + "_shape", pa.list_(pa.int64())))
    return pa.schema(fields, metadata={CODEC_KEY: codec.encode()})

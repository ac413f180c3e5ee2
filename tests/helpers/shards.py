"""Shards for the tests: a small real extract, and bitwise comparison of what comes back."""

from __future__ import annotations

import torch

from tests.helpers.prompts import write_prompts


def tiny_shards(tmp, model_dir: str, records: list[dict], max_new_tokens: int = 16) -> str:
    """`records` written as tmp/prompts.jsonl and extracted from a tiny target into tmp/shards
    (feature layers 1 and 3, top-8, fp32): the small real extract most score tests start from."""
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.run import run_extract

    prompts = write_prompts(tmp / "prompts.jsonl", records)
    shards = str(tmp / "shards")
    run_extract(
        ExtractConfig(
            model=model_dir,
            prompts=prompts,
            out=shards,
            max_new_tokens=max_new_tokens,
            layer_ids=[1, 3],
            top_k=8,
            dtype="fp32",
        )
    )
    return shards


def question_shards(tmp, model_dir: str, max_new_tokens: int, count: int = 4) -> str:
    """`count` short arithmetic questions extracted from a tiny target (tiny_shards)."""
    records = [{"id": f"q{i}", "prompt": f"What is {i} + {2 * i}? Say it twice."} for i in range(count)]
    return tiny_shards(tmp, model_dir, records, max_new_tokens=max_new_tokens)


def stored_samples(shards: str) -> list[tuple[list[int], int]]:
    """(prompt + stored response, prompt length) per sample of the shards."""
    from pipeline.shards import ShardSet

    return [(s.input_ids.tolist(), s.prompt_len) for s in ShardSet(shards).samples(tensors=[])]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe), dtype and shape included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def question_fixtures(name: str, max_new_tokens: int):
    """A module's fixtures `shards` (question_shards of the tiny target, in a temporary dir named
    `name`) and `samples` (their stored_samples): `shards, samples = question_fixtures(...)`."""
    import pytest

    @pytest.fixture(scope="module")
    def shards(tmp_path_factory, tiny_qwen3_dir) -> str:
        return question_shards(tmp_path_factory.mktemp(name), tiny_qwen3_dir, max_new_tokens)

    @pytest.fixture(scope="module")
    def samples(shards) -> list[tuple[list[int], int]]:
        """(prompt + stored response, prompt length) per sample: the target's greedy responses."""
        return stored_samples(shards)

    return shards, samples


def tiny_synthetic(out, lengths=(14, 12), target_layers: int = 6, layers=(1, 3)) -> str:
    """Synthetic shards at the tiny drafters' widths (bench/standins.py: random features, top-k 4, 4
    prompt tokens) for a `target_layers`-layer target storing `layers`: what the families' CLI tests
    score a random checkpoint on."""
    from bench.standins import write_synthetic_shards
    from tests.helpers.models import TINY_HIDDEN, TINY_VOCAB

    write_synthetic_shards(
        out, list(lengths), TINY_HIDDEN, TINY_VOCAB, target_layers, list(layers), top_k=4, prompt_tokens=4
    )
    return str(out)

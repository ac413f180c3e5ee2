"""Section `imports`: `specreplay import` throughput in GB/s of captured hidden states, beside the
shard reader's (section `reader`, when it ran).

The capture: the extract section's samples written as vLLM `extract_hidden_states` files (bf16,
as a serving engine captures; [N, n, H] with its feature layers plus its last stored layer
standing in for the final hidden state: the same shapes, so the same work), imported with every
captured layer stored. Two figures, page cache warm, min of 2: the whole import (listing and
checks, one sample at a time the top-k through the lm_head over the full vocabulary, shards
written) and its read path alone (listing, checks, every sample loaded; no top-k, nothing
written). The whole import is bound by the lm_head, as extract's capture is: [R, V] logits per
sample, over 49k columns for SmolLM2."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.common import GB, Phase, Rows, best_of, log


def write_capture(shard_dir: str, dest: Path) -> tuple[int, list[int]]:
    """The extract's samples as vLLM capture files; (hidden_states bytes, before-layer ids)."""
    import json

    from safetensors.torch import save_file

    from pipeline.shards import ShardSet

    shardset = ShardSet(shard_dir)
    settings = shardset.manifest["settings"]
    layers, hidden = settings["layer_ids"], settings["target"]["hidden_size"]
    before = [i + 1 for i in layers[:-1]] + [settings["target"]["num_layers"]]  # the last one: the final state
    dest.mkdir(parents=True, exist_ok=True)
    total, lens = 0, []
    for index, sample in enumerate(shardset.samples(tensors=["features"], prefetch=0)):
        block = sample.features.reshape(len(sample.input_ids), len(layers), hidden).to(torch.bfloat16).contiguous()
        name = f"req-{index:05d}"  # a request id (sample ids may hold a '/')
        save_file({"hidden_states": block, "token_ids": sample.input_ids}, str(dest / f"{name}.safetensors"))
        lens.append(json.dumps({"id": name, "prompt_len": sample.prompt_len}))
        total += block.numel() * block.element_size()
    (dest.parent / "lens.jsonl").write_text("\n".join(lens) + "\n")
    return total, before


def read_path(config, num_layers: int) -> None:
    """What import reads, without computing or writing anything: list, check, load every sample."""
    from pipeline.imports.run import list_capture, open_capture

    capture = open_capture(config, num_layers)
    for entry in list_capture(capture, None):
        capture.load(entry)


def throughput(shard_dir: str, work: Path, model: str) -> dict:
    from pipeline.imports.config import ImportConfig
    from pipeline.imports.run import run_import

    capture_bytes, before = write_capture(shard_dir, work / "capture" / "files")
    config = ImportConfig(
        source=str(work / "capture" / "files"),
        format="vllm",
        model=model,
        out=str(work / "imported"),
        captured_layer_ids=",".join(map(str, before)),
        prompt_lens=str(work / "capture" / "lens.jsonl"),
        overwrite=True,
    )
    start = time.perf_counter()
    run_import(config)  # warms the page cache and the model cache
    first = time.perf_counter() - start
    whole = min(first, best_of(lambda: run_import(config), 1))
    read = best_of(lambda: read_path(config, before[-1]), 2)
    return {
        "capture_bytes": capture_bytes,
        "import_s": whole,
        "import_gb_s": capture_bytes / whole / GB,
        "read_path_s": read,
        "read_path_gb_s": capture_bytes / read / GB,
    }


def run(ctx) -> tuple[dict, Rows]:
    log("imports: specreplay import of a vLLM capture of the extract's samples ...")
    extract = ctx.figures["extract"]["run"]
    model = _target_path(extract["out"])
    with Phase() as phase:
        figures = throughput(extract["out"], ctx.work / "imports", model)
    figures["others_cpu"] = phase.others_cpu
    reader = (ctx.figures.get("reader") or {}).get("per_core_gb_s")
    figures["shard_reader_per_core_gb_s"] = reader
    rows = Rows()
    rows.add(f"import (vLLM capture, bf16, {figures['capture_bytes'] / 2**20:.1f} MiB)", others=figures["others_cpu"])
    rows.add("  whole import (top-k over the vocabulary, shards written)", f"{figures['import_gb_s']:.3f} GB/s")
    rows.add("  its read path (list, check, load)", f"{figures['read_path_gb_s']:.2f} GB/s")
    if reader:
        rows.add("  shard reader, 1 thread (section reader)", f"{reader:.2f} GB/s")
    return figures, rows


def _target_path(shard_dir: str) -> str:
    from pipeline.shards import read_manifest

    return read_manifest(shard_dir)["target"]["path"]

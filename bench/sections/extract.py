"""Section `extract`: `specreplay extract` against the bare model work, and what it stores.

SmolLM2-135M in bf16 (so stored bytes compare with raw bf16 honestly): `run_extract` with the
loaded target handed to it, alternated with what any extractor must compute (the same batched
greedy `generate` call, then one full-sequence forward per sample returning hidden states,
nothing stored); ratio of the minima. The product's stage events (`pipeline.common.timing`) give
extract's own generate time, so the pipeline's own time can be told apart from generate's noise;
the 5% target is judged on it.
Then bytes per token of every stored tensor. `measure_extract` and `stored_bytes` are shared
with the fp32 and fp8 sections.
"""

from __future__ import annotations

import time

import torch

from bench.common import Rows, StageClock, log, num, others_cpu
from pipeline.common.dtypes import STORAGE_DTYPES

# issues 2, 4: at most 5% over the bare model work, judged on the pipeline's own time: both sides
# run the same `generate` call, whose run-to-run noise would otherwise decide it (bench/README.md)
OWN_TIME_TARGET = 0.05
FEATURES_TARGET = 0.67  # issues 2, 4: features at most 0.67 of raw bf16, losslessly


@torch.inference_mode()
def bare_model_work(model, info, items, layer_ids, max_new_tokens, batch_size) -> dict:
    """What any extractor must compute: the product's own batched greedy generate
    (`pipeline.extract.generate.generate_batch`, the call extract makes), then one full-sequence forward
    per sample with hidden states out; nothing is stored. The forward is timed twice: as the
    plain transformers forward (logits at every position: the same lm_head rows extract
    computes) and with `logits_to_keep=R+1` (only the rows a next-token distribution needs)."""
    from pipeline.extract.generate import generate_batch
    from pipeline.extract.run import batches

    gen = fwd_full = fwd_min = 0.0
    tokens, responses = 0, []
    for batch in batches(items, batch_size):
        start = time.perf_counter()
        out = generate_batch(
            model, [i.prompt_ids for i in batch], max_new_tokens, info.stop_token_ids, info.pad_token_id
        )
        gen += time.perf_counter() - start
        for item, response in zip(batch, out):
            ids = torch.tensor([item.prompt_ids + response.token_ids], device=model.device)
            for keep in (None, len(response.token_ids) + 1):
                start = time.perf_counter()
                extra = {} if keep is None else {"logits_to_keep": keep}
                result = model(input_ids=ids, output_hidden_states=True, use_cache=False, **extra)
                features = [result.hidden_states[i + 1] for i in layer_ids]  # selected, not kept
                if ids.is_cuda:  # a CUDA forward returns before the GPU has finished it
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - start
                if keep is None:
                    fwd_full += elapsed
                else:
                    fwd_min += elapsed
                del result, features
            tokens += ids.shape[1]
            responses.append(response.token_ids)
    return {
        "generate_s": gen,
        "forward_full_logits_s": fwd_full,
        "forward_response_logits_s": fwd_min,
        "total_s": gen + fwd_full,
        "total_min_logits_s": gen + fwd_min,
        "tokens": tokens,
        "responses": responses,
    }


def timed_extract(config, loaded) -> tuple[dict, float, StageClock]:
    """run_extract with the loaded target reused (neither side includes model loading) and the
    product's stage events recorded; returns (manifest, seconds, stages)."""
    from pipeline.common import timing
    from pipeline.extract.run import run_extract

    clock = StageClock()
    start = time.perf_counter()
    with timing.recording(clock):
        manifest = run_extract(config, loaded=loaded)
    return manifest, time.perf_counter() - start, clock


def measure_extract(ctx, dtype: str, prompts: int, reps: int, with_bare: bool = True) -> dict:
    """`reps` alternations of bare model work and `specreplay extract` on the first `prompts`
    prompts, in `dtype`; the shards of the last extract stay in the work dir (`out`)."""
    from pipeline.common.layer_ids import build_target_layer_ids
    from pipeline.extract.config import ExtractConfig
    from pipeline.extract.plan import prepare_items
    from pipeline.extract.prompts import load_prompts
    from pipeline.extract.target import load_target
    from pipeline.shards import ShardSet

    args = ctx.args
    start = time.perf_counter()
    loaded = load_target("smollm2", dtype=dtype)
    load_s = time.perf_counter() - start
    model, tokenizer, info = loaded
    items = prepare_items(load_prompts(args.prompt_set, limit=prompts), tokenizer, None)
    layer_ids = build_target_layer_ids(info.num_layers, 5)
    out = ctx.work / f"shards-{dtype}"
    config = ExtractConfig(
        model="smollm2",
        prompts=args.prompt_set,
        limit=prompts,
        out=str(out),
        max_new_tokens=args.max_new_tokens,
        dtype=dtype,
        overwrite=True,
        quiet=True,
        batch_size=args.batch_size,
    )
    log(
        f"extract/{dtype}: SmolLM2-135M loaded in {load_s:.1f}s; {len(items)} prompts, max_new_tokens "
        f"{args.max_new_tokens}, batch {args.batch_size}, layer ids {layer_ids}"
    )

    bare_runs, extract_runs, breakdowns, bare_responses = [], [], [], None
    for rep in range(reps):
        if with_bare:
            log(f"extract/{dtype}: rep {rep + 1}/{reps} bare generate + forward ...")
            t = time.perf_counter()
            bare = bare_model_work(model, info, items, layer_ids, args.max_new_tokens, args.batch_size)
            bare["others_cpu"] = others_cpu(t, time.perf_counter())
            bare_responses = bare.pop("responses")
            bare_runs.append(bare)
            log(
                f"extract/{dtype}:   bare {bare['total_s']:.1f}s (generate {bare['generate_s']:.1f}s, forward "
                f"{bare['forward_full_logits_s']:.1f}s; with response-only logits "
                f"{bare['forward_response_logits_s']:.1f}s; other processes: {bare['others_cpu']} cores)"
            )
        log(f"extract/{dtype}: rep {rep + 1}/{reps} specreplay extract ...")
        t = time.perf_counter()
        manifest, wall, clock = timed_extract(config, loaded)
        extract_runs.append(wall)
        breakdowns.append(
            {
                "wall_s": wall,
                "others_cpu": others_cpu(t, time.perf_counter()),
                **{k: round(v, 3) for k, v in clock.seconds.items()},
            }
        )
        log(f"extract/{dtype}:   extract {wall:.1f}s (other processes: {breakdowns[-1]['others_cpu']} cores)")

    stored = [s.input_ids[s.prompt_len :].tolist() for s in ShardSet(str(out)).samples(tensors=[])]
    result = {
        "dtype": dtype,
        "prompts": len(items),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "layer_ids": layer_ids,
        "model_load_s": load_s,
        "tokens": manifest["totals"]["tokens"],
        "response_tokens": manifest["totals"]["response_tokens"],
        "argmax_mismatches": manifest["totals"]["argmax_mismatches"],
        "extract_runs_s": extract_runs,
        "extract_min_s": min(extract_runs),
        "extract_runs_others_cpu": [b["others_cpu"] for b in breakdowns],
        "extract_breakdown_of_min": min(breakdowns, key=lambda b: b["wall_s"]),
        "out": str(out),
    }
    if with_bare:
        best = min(bare_runs, key=lambda r: r["total_s"])
        min_logits = min(r["total_min_logits_s"] for r in bare_runs)
        result.update(
            {
                "bare_runs": bare_runs,
                "bare_min_s": best["total_s"],
                "bare_min_response_logits_s": min_logits,
                "overhead_ratio": min(extract_runs) / best["total_s"],
                "overhead_ratio_vs_response_logits": min(extract_runs) / min_logits,
                "responses_equal_bare": stored == bare_responses,
                "extract_incl_model_load_s": min(extract_runs) + load_s,
            }
        )
    del model, loaded
    return result


def stored_bytes(shard_dir: str) -> dict:
    """Bytes per token of what extract stored: each tensor's zstd frames as they sit in the
    shards (row 0 of every chunk, read with Arrow directly: the bench measures the format); their
    sum is compared with the shard files' real size. fp8 features count their scales."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    from pipeline import shards

    shardset = shards.ShardSet(shard_dir)
    manifest = shardset.manifest
    fs, root = shards.open_fs(shard_dir)
    sizes: dict[str, int] = {}
    chunks = 0
    for entry in shardset.entries:
        reader = ipc.open_file(pa.BufferReader(shards.read_bytes(fs, shards.join(root, entry["file"]))))
        for index in range(reader.num_record_batches):
            batch = reader.get_batch(index)
            chunks += 1
            for name in shardset.tensor_dtypes:
                sizes[name] = sizes.get(name, 0) + shards.chunk_frame(batch.column(name)).size
    totals = manifest["totals"]
    tokens, rows = totals["tokens"], totals["response_tokens"] + totals["samples"]
    settings = manifest["settings"]
    n_layers, hidden = len(settings["layer_ids"]), settings["target"]["hidden_size"]
    vocab, k = settings["target"]["vocab_size"], settings["top_k"]
    item = torch.empty((), dtype=STORAGE_DTYPES[settings["feature_dtype"]]).element_size()
    raw_bf16 = n_layers * hidden * 2
    features = sizes["features"] + sizes.get("features_scale", 0)
    topk = sizes["topk_ids"] + sizes["topk_logprobs"]
    return {
        "feature_dtype": settings["feature_dtype"],
        "zstd_level": manifest.get("run", {}).get("zstd_level"),
        "tokens": tokens,
        "topk_rows": rows,
        "chunks": chunks,
        "chunk_tokens_mean": tokens / max(1, chunks),
        "features_bytes_per_token": features / tokens,
        "raw_bf16_features_bytes_per_token": raw_bf16,
        "features_vs_raw_bf16": features / tokens / raw_bf16,
        "features_vs_raw_same_dtype": features / (tokens * n_layers * hidden * item),
        "raw_feature_dtype_bytes_per_token": n_layers * hidden * item,
        "topk_bytes_per_row": topk / rows,
        "topk_k": k,
        "raw_topk_bytes_per_row": k * (4 + 4),
        "topk_vs_raw_topk": topk / rows / (k * 8),
        "topk_vs_full_bf16_logits": topk / rows / (vocab * 2),
        "shard_bytes_per_token": totals["bytes"] / tokens,
        "shard_bytes_total": totals["bytes"],
        "sum_of_tensor_frames_vs_files": sum(sizes.values()) / totals["bytes"],
    }


def run(ctx) -> tuple[dict, Rows]:
    ex = measure_extract(ctx, "bf16", ctx.args.prompts, ctx.args.reps)
    st = stored_bytes(ex["out"])
    log(f"storage: features {st['features_vs_raw_bf16']:.3f} of raw bf16")
    rows = Rows()
    bare_others = [r.get("others_cpu") for r in ex["bare_runs"]]
    rows.add(f"extract bf16: {ex['prompts']} prompts, {ex['tokens']} tokens ({ex['response_tokens']} generated)")
    rows.add(
        "  bare generate + forward (min)",
        f"{ex['bare_min_s']:.1f} s (runs " + ", ".join(f"{r['total_s']:.1f}" for r in ex["bare_runs"]) + ")",
        others=bare_others,
    )
    rows.add(
        "  specreplay extract, target preloaded (min)",
        f"{ex['extract_min_s']:.1f} s (runs " + ", ".join(f"{r:.1f}" for r in ex["extract_runs_s"]) + ")",
        others=ex["extract_runs_others_cpu"],
    )
    rows.add("  extract overhead (extract / bare; moves with generate's noise)", f"{ex['overhead_ratio']:.3f}x")
    b = ex["extract_breakdown_of_min"]
    bare_forward = min(r["forward_full_logits_s"] for r in ex["bare_runs"])
    bare_generate = min(r["generate_s"] for r in ex["bare_runs"])
    own = None if b.get("generate") is None else b["wall_s"] - b["generate"] - bare_forward
    share = None if own is None else own / ex["bare_min_s"]
    rows.add(
        "  pipeline's own time (extract - its generate - bare forward) / bare",
        f"{num(own, '.2f', ' s')} = {num(share, '.3f')} (generate: "
        f"extract {num(b.get('generate'), '.2f', ' s')}, bare {bare_generate:.2f} s)",
        f"<= {OWN_TIME_TARGET:.2f}",
        None if share is None else share <= OWN_TIME_TARGET,
        sides=bare_others + list(ex["extract_runs_others_cpu"]),
    )
    rows.add("  ... vs bare with response-only logits", f"{ex['overhead_ratio_vs_response_logits']:.3f}x")
    rows.add("  extract incl. model load", f"{ex['extract_incl_model_load_s']:.1f} s")
    rows.add("  stored responses == bare generate", str(ex["responses_equal_bare"]))
    storage_rows(rows, st)
    return {"run": ex, "storage": st}, rows


def storage_rows(rows: Rows, st: dict) -> None:
    rows.add(
        "  features bytes/token vs raw bf16 (lossless)",
        f"{st['features_bytes_per_token']:.0f}/{st['raw_bf16_features_bytes_per_token']} = "
        f"{st['features_vs_raw_bf16']:.3f}",
        f"<= {FEATURES_TARGET}",
        st["features_vs_raw_bf16"] <= FEATURES_TARGET,
    )
    rows.add(
        f"  top-{st['topk_k']} ids+logprobs bytes/row vs raw",
        f"{st['topk_bytes_per_row']:.0f}/{st['raw_topk_bytes_per_row']} = {st['topk_vs_raw_topk']:.3f}",
    )
    rows.add("  top-k vs full-vocab bf16 logits", f"{st['topk_vs_full_bf16_logits']:.5f}")
    rows.add("  whole shard bytes/token", f"{st['shard_bytes_per_token']:.0f}")

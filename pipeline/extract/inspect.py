"""`specreplay inspect DIR`: what an extract directory holds, and whether its bytes are intact.

Reads only the manifest and the shard entries, then checksums every shard file and the target
head in chunks; nothing is decoded or held in memory whole, so inspecting hundreds of GB costs
one sequential read.
"""

from __future__ import annotations

from pipeline import shards
from pipeline.common.sampling import sampling_of
from pipeline.outdir.entries import mismatched_samples, totals
from pipeline.outdir.storage import raw_feature_bytes_per_token
from pipeline.shards.writer import describe_excluded


def verify_checksums(uri: str, entries: list[dict]) -> dict:
    """{'checked', 'ok', 'bad': [messages]} from a chunked crc32 of every shard file."""
    fs, root = shards.open_fs(uri)
    bad = []
    for entry in entries:
        path = shards.join(root, entry["file"])
        if not shards.exists(fs, path):
            bad.append(f"{path}: missing")
            continue
        crc, size = shards.file_crc32(fs, path)
        if crc != entry["crc32"] or size != entry["bytes"]:
            bad.append(
                f"{path}: crc32 {crc:#010x} / {size} bytes, manifest says {entry['crc32']:#010x} / {entry['bytes']} bytes"
            )
    return {"checked": len(entries), "ok": len(entries) - len(bad), "bad": bad}


def verify_target_head(uri: str, manifest: dict) -> str:
    """'ok', 'missing', 'not recorded' or a mismatch message (a chunked crc32 of the file)."""
    fs, root = shards.open_fs(uri)
    path = shards.join(root, shards.TARGET_HEAD_NAME)
    if not shards.exists(fs, path):
        return "missing"
    expected = manifest.get("target_head", {}).get("crc32")
    if expected is None:
        return "not recorded"
    crc, _ = shards.file_crc32(fs, path)
    return "ok" if crc == expected else f"{path}: crc32 {crc:#010x}, manifest says {expected:#010x}"


def inspect_extract(uri: str, verify: bool = True) -> dict:
    """A JSON-able report of an extract directory (complete or still running / interrupted)."""
    manifest = shards.read_manifest(uri)
    complete = bool(manifest.get("complete"))
    # An unfinished extract's manifest lags behind; its finished shards are the truth so far. A
    # finished one's sidecars are read too: a resume would trust them, so a damaged one is said now.
    sidecars = shards.finished_shard_entries(uri)
    entries = manifest.get("shards", []) if complete else sidecars
    settings = manifest.get("settings", {})
    target = manifest.get("target", {})
    raw_per_token = raw_feature_bytes_per_token(len(settings.get("layer_ids", [])), target.get("hidden_size", 0))
    t = totals(entries, raw_per_token)
    report = {
        "dir": uri,
        "complete": complete,
        "format_version": manifest.get("format_version"),
        "target": {
            key: target.get(key) for key in ("name", "architecture", "num_layers", "hidden_size", "vocab_size", "dtype")
        },
        **settings_report(manifest, settings),
        **counts_report(entries, t, raw_per_token),
        "responses": settings.get("responses"),  # what made them with --responses-from; None: the target
        "imported": settings.get("imported"),  # the capture `specreplay import` read; None: extracted
        **sampling_report(settings, t),
    }
    if verify:
        report["checksums"] = verify_checksums(uri, entries)
        report["target_head"] = verify_target_head(uri, manifest)
    return report


def settings_report(manifest: dict, settings: dict) -> dict:
    """What the extract was asked for: layers (and who asked), dtypes, top-k, prompts."""
    return {
        "layer_ids": settings.get("layer_ids", []),  # []: no feature layers (--layer-ids none)
        "neighbour_layers": bool(settings.get("neighbour_layers")),
        "layer_uses": manifest.get("layer_uses", []),  # absent before specreplay recorded it
        "beyond_positions": bool(settings.get("beyond_positions")),
        "feature_dtype": settings.get("feature_dtype"),
        "top_k": settings.get("top_k"),
        "tensors": manifest.get("tensors", {}),
        "max_new_tokens": settings.get("max_new_tokens"),
        "prompts": manifest.get("prompts", {}),
        "chunk_tokens": manifest.get("run", {}).get("chunk_tokens"),
    }


def counts_report(entries: list[dict], t: dict, raw_per_token: int) -> dict:
    """What the shards hold: samples, tokens, bytes, finish reasons, greedy consistency, exclusions."""
    tokens, greedy_tokens = t["tokens"], t["greedy_response_tokens"]
    mismatched = mismatched_samples(entries)
    return {
        "shards": len(entries),
        "chunks": sum(len(e.get("batches", [])) for e in entries),  # record batches, a few samples each
        "samples": t["samples"],
        "tokens": tokens,
        "prompt_tokens": t["prompt_tokens"],
        "response_tokens": t["response_tokens"],
        "bytes": t["bytes"],
        "bytes_per_token": t["bytes"] / tokens if tokens else None,
        "raw_bf16_feature_bytes_per_token": raw_per_token,
        # All stored bytes (features, top-k, flags, ids) against the features alone as raw bf16.
        "bytes_vs_raw_bf16_features": t["bytes"] / t["raw_bf16_feature_bytes"] if t["raw_bf16_feature_bytes"] else None,
        "finish_reasons": t["finish_reasons"],
        "greedy_samples": t["greedy_samples"],
        "given_samples": t["finish_reasons"].get("given", 0),  # teacher-forced; the rest are greedy or sampled
        "argmax_mismatches": t["greedy_argmax_mismatches"],
        # greedy samples whose walk is exact (no argmax mismatch), and the others by id
        "exact_samples": exact_samples(t, mismatched),
        "mismatched_samples": mismatched,
        "greedy_consistency": 1 - t["greedy_argmax_mismatches"] / greedy_tokens if greedy_tokens else None,
        # samples with NaN/Inf in a feature layer or the logits: never written, never scored
        "excluded_samples": t.get("excluded_samples", 0),
        "excluded": t.get("excluded", []),
    }


def exact_samples(t: dict, mismatched: dict) -> int | None:
    """Greedy samples with no argmax mismatch; None when the entries do not say which samples
    have them (written before they recorded it) but some do."""
    if t["greedy_argmax_mismatches"] and not mismatched:
        return None
    return t["greedy_samples"] - len(mismatched)


def sampling_report(settings: dict, t: dict) -> dict:
    """The sampling part of the report: settings (None for greedy), the description inspect
    prints, how many samples were sampled, and stored tokens of probability 0 (see capture.py)."""
    recorded = settings.get("sampling")
    if not recorded:
        return {"sampling": None, "decoding": "greedy"}
    draws = int(recorded.get("num_samples", 1))
    return {
        "sampling": recorded,
        "decoding": (
            f"sampled at {sampling_of(settings).describe()}; {draws} draw{'s' if draws != 1 else ''} per prompt, "
            f"seed {recorded.get('seed')}"
        ),
        "sampled_samples": t["samples"] - t["greedy_samples"] - t["finish_reasons"].get("given", 0),
        "sampled_response_tokens": t.get("sampled_response_tokens", 0),
        "zero_prob_tokens": t.get("zero_prob_tokens", 0),
    }


def layer_serves(report: dict) -> dict[int, list[str]]:
    """{stored layer id: who reads it}: each drafter config's family and layout (or --layer-ids, or
    the default formula), 'neighbour (diagnose)' for the ids --neighbour-layers added."""
    serves = {i: [] for i in report["layer_ids"]}
    for use in report["layer_uses"]:
        what = (
            f"{use['family']} ({use['layout']}) {use['by'].removeprefix('--draft-config ')}"
            if use.get("family")
            else use["by"]
        )
        for i in use["layer_ids"]:
            serves.setdefault(i, []).append(what)
    return {i: readers or ["neighbour (diagnose)"] for i, readers in serves.items()}


def layer_use_lines(report: dict) -> list[str]:
    """One line per stored layer naming what it serves (none for an extract that did not record it)."""
    if not report["layer_uses"] or not report["layer_ids"]:
        return []
    final = report["target"].get("num_layers")
    lines = []
    for i, readers in sorted(layer_serves(report).items()):
        name = f"{i} (final, pre-norm)" if i == final else str(i)
        lines.append(f"    layer {name:<6} {'; '.join(readers)}")
    return ["  layers serve", *lines]


def consistency_lines(report: dict) -> list[str]:
    """Greedy: how often the full forward agrees with the stored tokens, and which samples are
    exact walks. Sampled: the decoding settings, and stored tokens the full forward's sampling
    distribution gives probability 0. Either: what made the responses, when an engine did."""
    return responses_lines(report) + (greedy_lines(report) if report.get("sampling") is None else sampled_lines(report))


def responses_lines(report: dict) -> list[str]:
    imported, made = report.get("imported"), report.get("responses")
    if imported:
        return [f"  imported        {imported['format']} capture {imported['source']} (specreplay import)"]
    if not made:
        return []
    return [f"  responses       from {made['engine']} serving {made['model']!r} ({made['sampling_rule']})"]


def greedy_lines(report: dict, listed: int = 8) -> list[str]:
    mismatched = report.get("mismatched_samples") or {}
    named = ", ".join(f"{sid} ({n})" for sid, n in list(mismatched.items())[:listed])
    more = f", {len(mismatched) - listed} more" if len(mismatched) > listed else ""
    rest = f"; not exact (teacher-forced along the stored tokens; positions): {named}{more}" if mismatched else ""
    exact = report.get("exact_samples")
    exact = "not recorded (extracted by an older specreplay) of" if exact is None else f"{exact} of"
    return [
        f"  greedy-consistency {_pct(report['greedy_consistency'])} "
        f"({report['argmax_mismatches']} response tokens differ from the full-forward argmax)",
        f"  exact walks     {exact} {report['greedy_samples']} greedy samples{rest}",
    ]


def sampled_lines(report: dict) -> list[str]:
    return [
        f"  decoding        {report['decoding']}",
        f"  sample log-probs {report['zero_prob_tokens']} of {report['sampled_response_tokens']} sampled tokens have "
        f"probability 0 under the full forward's sampling distribution",
    ]


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def samples_kinds(report: dict) -> str:
    if report.get("sampling") is None:
        return f"{report['greedy_samples']} greedy, {report['given_samples']} given"
    return f"{report['sampled_samples']} sampled, {report['given_samples']} given"


def bytes_ratio(report: dict) -> str:
    """', 3623 B/token; stored bytes = 1.510 x the features as raw bf16 (2400 B/token; features stored
    as float32)': what the ratio is against, and the dtype that explains it (the README's ~0.6 is
    for bf16 features; float32 ones are twice the bytes)."""
    bpt, ratio = report["bytes_per_token"], report["bytes_vs_raw_bf16_features"]
    if bpt is None or ratio is None:
        return ""
    stored = (report.get("tensors") or {}).get("features") or report.get("feature_dtype")
    return (
        f", {bpt:.0f} B/token; stored bytes = {ratio:.3f} x the features as raw bf16 "
        f"({report['raw_bf16_feature_bytes_per_token']} B/token; features stored as {stored})"
    )


def layers_line(report: dict) -> str:
    """The stored feature layers and their dtype, top-k and the tensors."""
    rest = f"top-k {report['top_k']}, tensors {', '.join(report['tensors'])}"
    if not report["layer_ids"]:
        return f"  layer ids       none: no feature layers, tokens and top-k only ({rest})"
    neighbours = " (with neighbours, for diagnose)" if report["neighbour_layers"] else ""
    return f"  layer ids       {report['layer_ids']}{neighbours}  features {report['feature_dtype']}, {rest}"


def format_report(report: dict) -> str:
    """The human-readable form of `inspect_extract`'s report."""
    target = report["target"]
    prompts = report["prompts"]
    status = "complete" if report["complete"] else "NOT complete (run the same extract command again to resume)"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(report["finish_reasons"].items())) or "none"
    lines = [
        f"{report['dir']}: {status}",
        f"  target          {target['name']} ({target['architecture']}, {target['num_layers']} layers, "
        f"hidden {target['hidden_size']}, vocab {target['vocab_size']}, {target['dtype']})",
        layers_line(report),
        *layer_use_lines(report),
        f"  prompts         {prompts.get('name')} ({prompts.get('count')} prompts), max_new_tokens {report['max_new_tokens']}",
        *(
            ["  positions       --beyond-positions: samples may run past the target's max_position_embeddings"]
            if report["beyond_positions"]
            else []
        ),
        f"  samples         {report['samples']} in {report['shards']} shards, {report['chunks']} chunks of "
        f"~{report['chunk_tokens']} tokens ({samples_kinds(report)})",
        f"  tokens          {report['tokens']} ({report['prompt_tokens']} prompt, {report['response_tokens']} response)",
        f"  bytes           {report['bytes']} ({report['bytes'] / 2**20:.2f} MiB)" + bytes_ratio(report),
        f"  finish reasons  {reasons}",
        *consistency_lines(report),
    ]
    if report.get("excluded"):
        lines.append(f"  excluded        {describe_excluded(report['excluded'])}; not stored, never scored")
    if "checksums" in report:
        sums = report["checksums"]
        lines.append(f"  checksums       {sums['ok']}/{sums['checked']} shards ok; target head {report['target_head']}")
        lines.extend(f"    BAD {message}" for message in sums["bad"])
    return "\n".join(lines)


def report_problems(report: dict, uri: str) -> list[str]:
    """What makes the directory untrustworthy (used for the exit status), each naming its file."""
    problems = list(report.get("checksums", {}).get("bad", []))
    head = report.get("target_head")
    fs, root = shards.open_fs(uri)
    if not report.get("complete", True):
        problems.append(f"{uri}: the extract is not complete; run the same extract command again to resume it")
    if head == "not recorded":
        problems.append(f"{shards.join(root, shards.MANIFEST_NAME)}: the target head's crc32 is not recorded")
    elif head == "missing":
        problems.append(f"{shards.join(root, shards.TARGET_HEAD_NAME)}: missing")
    elif head not in (None, "ok"):
        problems.append(f"target head: {head}")
    return problems

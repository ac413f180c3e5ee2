"""Section `research` (only with `--research`): experiments behind the shard format's design,
not figures of the product. On the real extracted bf16 features:

  - format v1, the layout shards used before format v2 (row-major byte planes, one zstd frame
    per sample) at zstd levels 1 and 3: what channel-major multi-sample chunks gained;
  - two bounds: the order-0 entropy of the 16-bit values, and the per-channel entropy of sign,
    exponent and mantissa fields coded separately (zstd beats both by exploiting order across
    tokens, which order-0 bounds ignore).

v1's encoder lives here, not in the product: the product no longer writes or reads v1.
"""

from __future__ import annotations

import numpy as np
import torch

from bench.common import Phase, Rows, log
from bench.sections.codecs import features_of, measure_layout


def row_major_planes(tensor: torch.Tensor) -> bytes:
    """Format v1's encoding of one sample: byte planes of the flattened (row-major) values."""
    flat = tensor.contiguous().view(-1)
    return flat.view(torch.uint8).view(-1, flat.element_size()).t().contiguous().numpy().tobytes()


def entropy_bounds(words: np.ndarray) -> dict:
    """Bits per 16-bit value: order-0 over all values, and per channel with sign / exponent /
    mantissa each coded alone (a slightly optimistic bound for a channel-aware entropy coder)."""
    counts = np.bincount(words.ravel()).astype(np.float64)
    p = counts[counts > 0] / words.size
    bits = float(-(p * np.log2(p)).sum())
    channel_bits = 0.0
    for field in ((words >> 15), (words >> 7) & 0xFF, words & 0x7F):
        for column in range(words.shape[1]):
            counts = np.bincount(field[:, column]).astype(np.float64)
            p = counts[counts > 0] / words.shape[0]
            channel_bits += float(-(p * np.log2(p)).sum())
    per_channel = channel_bits / words.shape[1]
    return {
        "order0_entropy_bits": bits,
        "order0_entropy_ratio": 16 / bits,
        "per_channel_field_entropy_bits": per_channel,
        "per_channel_field_entropy_ratio": 16 / per_channel,
    }


def run(ctx) -> tuple[dict, Rows]:
    log("research: format v1 layout and entropy bounds on the real features ...")
    with Phase() as phase:
        features = features_of(ctx.figures["extract"]["run"]["out"])
        raw_total = sum(f.numel() * f.element_size() for f in features)
        out = {"raw_bytes": raw_total}
        buffers = [row_major_planes(f) for f in features]
        for level in (1, 3):
            out[f"v1_row_planes_per_sample_zstd{level}"], _ = measure_layout(buffers, raw_total, level, 3)
        if features[0].element_size() == 2:
            out.update(entropy_bounds(torch.cat(features).view(torch.int16).numpy().view(np.uint16)))
    out["others_cpu"] = phase.others_cpu
    rows = Rows()
    rows.add("research: shard format experiments (real features, 1 thread)", others=out["others_cpu"])
    for level in (1, 3):
        e = out[f"v1_row_planes_per_sample_zstd{level}"]
        rows.add(
            f"  format v1: row-major byte planes, per sample, zstd-{level}",
            f"{e['fraction_of_raw']:.3f} ({e['ratio']:.3f}x), {e['zstd_decode_gb_s']:.2f} GB/s",
        )
    co = ctx.figures.get("codecs")
    if co:  # what v2 gained over v1 as shipped (zstd-3)
        out["v2_gain_over_v1"] = (
            co[f"{co['shipped_layout']}_zstd1"]["ratio"] / out["v1_row_planes_per_sample_zstd3"]["ratio"]
        )
        out["planes_gain_level1"] = out["v1_row_planes_per_sample_zstd1"]["ratio"] / co["interleaved_zstd1"]["ratio"]
        rows.add("  format v2 (shipped) size gain over v1 (zstd-3)", f"{out['v2_gain_over_v1']:.3f}x")
    if "order0_entropy_bits" in out:
        rows.add(
            "  order-0 entropy of the 16-bit values",
            f"{out['order0_entropy_bits']:.2f} bits = {1 / out['order0_entropy_ratio']:.3f} of raw",
        )
        rows.add(
            "  per-channel sign/exponent/mantissa entropy",
            f"{out['per_channel_field_entropy_bits']:.2f} bits = "
            f"{1 / out['per_channel_field_entropy_ratio']:.3f} of raw",
        )
    return out, rows

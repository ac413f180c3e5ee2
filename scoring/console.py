"""What `score` prints once a checkpoint is scored: tau per dataset and method, the streak,
acceptance per block position, and notes on inexact or lossy inputs."""

from __future__ import annotations

import pyarrow as pa

from scoring import results


def fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return f"{value:.{digits}f}"


def print_summary(summary: pa.Table, name: str, out_dir: str, record: dict) -> None:
    import polars as pl

    df = pl.from_arrow(summary)
    print(
        f"\n{name}: {record['shards']['samples']} samples, {record['anchors']} anchors, "
        f"{record['dtype']} on {record['device']}, {record['wall_time_s']:.1f}s -> {out_dir}"
    )
    methods = df["method"].unique(maintain_order=True).to_list()
    print("tau (mean accepted + bonus per step, simulated walk)")
    print(f"{'dataset':<16}" + "".join(f"{m:>12}" for m in methods) + f"{'streak':>10}")
    for dataset in df["dataset"].unique(maintain_order=True).to_list():
        d = df.filter(pl.col("dataset") == dataset)
        taus = {r["method"]: r["tau"] for r in d.iter_rows(named=True)}
        streak = d.filter(pl.col("method") == results.CHAIN).row(0, named=True).get("anchor_accepted_len_mean")
        print(f"{dataset:<16}" + "".join(f"{fmt(taus.get(m)):>12}" for m in methods) + f"{fmt(streak):>10}")
    overall = df.filter((pl.col("dataset") == results.ALL_DATASETS) & (pl.col("method") == results.CHAIN))
    overall = overall.row(0, named=True)
    rates = overall.get("accept_rate_by_position") or []
    print("chain acceptance per block position (all anchors, given the position was reached):")
    print("  " + " ".join(f"{k + 1}:{fmt(r, 2)}" for k, r in enumerate(rates)))
    for note in notes(overall, record):
        print(f"note: {note}")


def notes(overall: dict, record: dict) -> list[str]:
    """Caveats on the numbers: inexact walks, lossy features."""
    found = []
    if overall["inexact_samples"]:
        found.append(
            f"{overall['inexact_samples']} of {overall['samples']} samples are not exact walks "
            f"(given responses or {overall['argmax_mismatches']} positions where the stored token is not "
            f"the full-forward argmax); their walk numbers approximate the online loop"
        )
    if record["shards"].get("feature_dtype") == "float8_e4m3fn":
        found.append(
            "the shards hold lossy fp8 features (extract --feature-dtype fp8); numbers approximate "
            "a lossless extract (bench/README.md measures the tau change)"
        )
    return found

"""The report's "Predicted speed" section (`report --profile`): every checkpoint's configurations
priced by a cost profile (scoring/speed/, docs/speed.md): speedup against the tokens each step
verifies, one line per checkpoint and batch size, and the fastest configuration per batch size."""

from __future__ import annotations

import html

from scoring.report.data import Results
from scoring.report.plots import MAX_SERIES, _colors, _new_figure, _png
from scoring.report.tables import label_html
from scoring.speed.predict import Prediction, best_per_batch, predict
from scoring.speed.profile import Profile
from scoring.speed.run import result_configurations

STYLES = ("-", "--", ":", "-.")  # one per batch size


def predictions_by_label(results: Results, profile: Profile) -> dict[str, list[Prediction]]:
    """label -> its predictions at every measured batch size (the profile checked against each)."""
    return {
        label: predict(profile, result_configurations(results.dir_of[label], profile))
        for label in results.order[:MAX_SERIES]
    }


def plot_speedup(found: dict[str, list[Prediction]], results: Results):
    """Speedup over plain decoding against the tokens verified per step."""
    colors = _colors(list(found), results.steps)
    fig, ax = _new_figure()
    for label, predictions in found.items():
        for i, batch in enumerate(sorted({p.batch for p in predictions})):
            mine = sorted((p for p in predictions if p.batch == batch), key=lambda p: p.verified)
            xs, ys = [p.verified for p in mine], [p.speedup for p in mine]
            ax.plot(
                xs,
                ys,
                marker="o",
                ms=4,
                color=colors[label],
                linestyle=STYLES[i % len(STYLES)],
                label=f"{label}, batch {batch}",
            )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ticks = sorted({p.verified for predictions in found.values() for p in predictions})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("tokens verified per step (chain K + 1, tree budget + 1)")
    ax.set_ylabel("predicted speedup over plain decoding")
    ax.set_title("Predicted speedup against the tokens each step verifies")
    ax.legend(fontsize=7)
    return _png(fig)


def fastest_rows(found: dict[str, list[Prediction]]) -> str:
    """One row per checkpoint and batch size: the fastest configuration, its tokens/s and speedup."""
    rows = []
    for label, predictions in found.items():
        for batch, p in sorted(best_per_batch(predictions).items()):
            cells = [
                label_html(label),
                str(batch),
                html.escape(p.method),
                f"{p.tau:.3f}",
                f"{p.step_s * 1000:.2f}",
                f"{p.tokens_per_s:.1f}",
                f"{p.plain_tokens_per_s:.1f}",
                f"{p.speedup:.2f}×",
            ]
            rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{h}</th>"
        for h in ("Checkpoint", "Batch", "Fastest", "τ/step", "Step ms", "Tokens/s", "Plain tokens/s", "Speedup")
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def speed_parts(results: Results, profile: Profile) -> tuple[str, bytes, str]:
    """(the caption, the plot's PNG, the table of the fastest) of the section."""
    found = predictions_by_label(results, profile)
    m = profile.file.measured
    caption = (
        f"Each configuration's tokens per step priced by the cost profile {html.escape(profile.source)} "
        f"({html.escape(m.engine)} on {html.escape(m.device)}, context {m.context_len} tokens): step time = the "
        "target verifying the step's tokens + the drafter's forwards; speedup over plain decoding at the same "
        "batch size. It leaves out acceptance spread within a batch and scheduling (docs/speed.md)."
    )
    return caption, plot_speedup(found, results), fastest_rows(found)

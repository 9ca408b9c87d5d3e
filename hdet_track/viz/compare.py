"""Compare runs (HDET vs OneCycle, several HDET runs): overlays by step. The table is
:func:`hdet_track.compare.comparison_rows` (no plotting needed)."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go

from ..readers.base import HDETRun, schedule_label
from ._common import MAX_POINTS, color, downsample, empty_figure, layout

__all__ = ["plot_compare", "user_metric_keys"]


def user_metric_keys(runs: list[HDETRun]) -> list[str]:
    """The metrics of ``runs`` that are the user's (``val_loss``...), each once: not the means
    ``loss``/``lr`` nor HDET's own series (a run read without its archive holds its divergences)."""
    return sorted({k for run in runs for k in run.metrics if k not in ("loss", "lr") and not k.startswith("hdet/")})


def plot_compare(
    runs: Sequence[HDETRun], key: str = "loss", log_y: bool = True, max_points: int = MAX_POINTS
) -> go.Figure:
    """``key`` (``loss``, ``lr`` or any logged metric such as ``val_loss``) of several runs, by step."""
    fig = go.Figure()
    for i, run in enumerate(runs):
        steps, values = run.mean_series(key)
        if not len(steps):
            continue
        s, v = downsample(steps, values, max_points)
        fig.add_trace(
            go.Scatter(
                x=s,
                y=v,
                mode="lines",
                name=f"{run.name} ({schedule_label(run.schedule)})"
                + ("" if not run.is_bucketed(key) else f", mean per {run.resolution:,} steps"),
                line={"color": color(i), "dash": "dash" if run.schedule == "onecycle" else "solid"},
            )
        )
    if not fig.data:
        return empty_figure(f"No {key!r} in the selected runs", f"Compare: {key}")
    return layout(fig, f"Compare: {key}", key, log_y)

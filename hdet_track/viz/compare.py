"""Compare runs (HDET vs OneCycle, several HDET runs): overlays by step and a summary table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go

from ..readers.base import HDETRun
from ._common import MAX_POINTS, color, downsample, empty_figure, layout

__all__ = ["plot_compare", "compare_table", "CompareRow", "diverged_at"]


class CompareRow(NamedTuple):
    run_id: str
    name: str
    schedule: str
    world_size: int
    status: str
    mean_lr: float
    final_loss: float
    best_loss: float
    highest_stable_lr: float  # the highest mean LR reached while the loss stayed finite and bounded
    diverged_at: int | None


def diverged_at(steps: np.ndarray, loss: np.ndarray, factor: float = 10.0) -> int | None:
    """The first step whose loss is non-finite, or above ``factor`` x the first logged loss."""
    if not len(steps):
        return None
    finite = loss[np.isfinite(loss)]
    ref = finite[0] if len(finite) else math.inf
    bad = ~np.isfinite(loss) | (loss > factor * max(ref, 1e-12))
    idx = np.flatnonzero(bad)
    return int(steps[idx[0]]) if len(idx) else None


def _row(run: HDETRun) -> CompareRow:
    steps, loss = run.mean_series("loss")
    lr_steps, lr = run.mean_series("lr")
    # the median over replicas: an exploring replica that blows up and is repaired is not a divergence
    div = diverged_at(*run.median_series("loss"))
    finite_loss = loss[np.isfinite(loss)] if len(loss) else loss
    stable = lr if div is None else lr[lr_steps < div]
    stable = stable[np.isfinite(stable)] if len(stable) else stable
    lr_f = lr[np.isfinite(lr)] if len(lr) else lr
    return CompareRow(
        run.run_id,
        run.name,
        run.schedule or "?",
        run.world_size,
        run.status,
        float(lr_f.mean()) if len(lr_f) else math.nan,
        float(finite_loss[-1]) if len(finite_loss) else math.nan,
        float(finite_loss.min()) if len(finite_loss) else math.nan,
        float(stable.max()) if len(stable) else math.nan,
        div,
    )


def compare_table(runs: Sequence[HDETRun]) -> list[CompareRow]:
    """One row per run: schedule, mean LR, final and best (mean) training loss, highest stable LR,
    and the step at which it diverged, if it did."""
    return [_row(r) for r in runs]


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
                name=f"{run.name} ({run.schedule or '?'})"
                + ("" if run.resolution is None else f", mean per {run.resolution:,} steps"),
                line={"color": color(i), "dash": "dash" if run.schedule == "onecycle" else "solid"},
            )
        )
    if not fig.data:
        return empty_figure(f"No {key!r} in the selected runs", f"Compare: {key}")
    return layout(fig, f"Compare: {key}", key, log_y)

"""Shared pieces of the figure builders: downsampling that keeps spikes, empty figures, colours."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ..readers.base import HDETRun

MAX_POINTS = 2000
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def downsample(x: np.ndarray, y: np.ndarray, max_points: int = MAX_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points: the min and the max of each bucket, in step order.

    Spikes (a divergence, a NaN-repair) survive, unlike with striding. Non-finite values are
    kept where they fall (they mark gaps).
    """
    x = np.asarray(x)
    y = np.asarray(y, dtype=float)
    n = len(x)
    if n <= max_points:
        return x, y
    # two points a bucket (its min and max), three where a gap (its first non-finite value) is kept too
    buckets = max(1, max_points // (2 if np.isfinite(y).all() else 3))
    edges = np.linspace(0, n, buckets + 1).astype(int)
    keep: list[int] = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi <= lo:
            continue
        seg = y[lo:hi]
        finite = np.isfinite(seg)
        if not finite.all():
            keep.append(lo + int(np.argmin(finite)))  # the first non-finite value of the bucket
        if finite.any():
            idx = np.flatnonzero(finite)
            a = lo + idx[np.argmin(seg[finite])]
            b = lo + idx[np.argmax(seg[finite])]
            keep.extend(sorted({int(a), int(b)}))
    order = np.array(sorted(set(keep)), dtype=int)
    return x[order], y[order]


def titled(title: str, run: HDETRun) -> str:
    """``title`` with a second line saying when the per-step series are a summary (a huge run)."""
    note = run.resolution_note()
    return f"{title}<br><sup>{note}</sup>" if note else title


def empty_figure(message: str, title: str = "") -> go.Figure:
    """A figure with a note instead of data (empty input never raises)."""
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font={"size": 14})
    fig.update_layout(title=title, xaxis={"visible": False}, yaxis={"visible": False})
    return fig


def nothing_yet(run: HDETRun, what: str) -> str:
    """The note of a chart with no ``what`` (e.g. "loss"): a live run's steps arrive with its syncs."""
    if run.live and not run.converge:
        return f"No {what} yet: a live run's steps arrive with its first sync (every sync_every steps)"
    return f"No {what} recorded in this run"


def layout(fig: go.Figure, title: str, ytitle: str, log_y: bool = False) -> go.Figure:
    fig.update_layout(
        title=title,
        xaxis_title="step",
        yaxis_title=ytitle,
        legend={"orientation": "h", "y": -0.2},
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        hovermode="x unified",
    )
    if log_y and _positive(fig):
        fig.update_yaxes(type="log")
    return fig


def _positive(fig: go.Figure) -> bool:
    """Whether every finite y value of ``fig`` is above 0 (a log axis draws nothing else: a loss
    that is zero or negative, such as a log-likelihood plus a constant, gets a linear axis)."""
    for trace in fig.data:
        y = getattr(trace, "y", None)
        if y is None:
            continue
        values = np.asarray(y, dtype=float)
        values = values[np.isfinite(values)]
        if len(values) and values.min() <= 0:
            return False
    return True

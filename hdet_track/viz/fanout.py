"""Fan-out: every replica's trajectory of an explored hyperparameter, the spread band, the
multiplier each replica held in each window, and per-replica loss."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go

from ..names import parse_series_key
from ..readers.base import HDETRun
from ._common import MAX_POINTS, color, downsample, empty_figure, layout, nothing_yet, titled

__all__ = ["plot_fanout", "plot_permutations", "plot_replica_loss"]


class FanoutInfo(NamedTuple):
    key: str
    replicas: list[tuple[int, np.ndarray, np.ndarray]]  # (replica, steps, values), downsampled
    base_steps: np.ndarray
    base: np.ndarray  # mean over replicas (the shared base: the multipliers average to 1)
    low: np.ndarray  # base * (1 - spread)
    high: np.ndarray
    spread: float
    title: str
    base_name: str


def _get_fanout_info(run: HDETRun, key: str = "lr", max_points: int = MAX_POINTS) -> FanoutInfo:
    name = parse_series_key(key)[0]
    replicas = []
    for r in range(run.world_size):
        steps, values = run.replica_series(key, r)
        if len(steps):
            s, v = downsample(steps, values, max_points)
            replicas.append((r, s, v))
    steps, base = run.mean_series(key)
    steps, base = downsample(steps, base, max_points)
    spread = run.spread(name) if run.world_size > 1 else 0.0  # one replica explores nothing: no band
    title = titled(f"Fan-out: {key} per replica", run)
    base_name = "base (mean)" if run.resolution is None else f"base (mean per {run.resolution:,} steps)"
    return FanoutInfo(key, replicas, steps, base, base * (1 - spread), base * (1 + spread), spread, title, base_name)


def _get_fanout_plot(info: FanoutInfo, log_y: bool) -> go.Figure:
    if not info.replicas:
        return empty_figure(f"No per-replica values of {info.key!r} in this run", f"Fan-out: {info.key}")
    fig = go.Figure()
    if info.spread > 0 and len(info.base_steps):
        fig.add_trace(
            go.Scatter(
                x=info.base_steps,
                y=info.high,
                mode="lines",
                line={"width": 0},
                name=f"1+{info.spread:g}",
                showlegend=False,
                hoverinfo="skip",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=info.base_steps,
                y=info.low,
                mode="lines",
                line={"width": 0},
                fill="tonexty",
                fillcolor="rgba(100,100,100,0.15)",
                name=f"band [1-{info.spread:g}, 1+{info.spread:g}]",
            )
        )
    for r, steps, values in info.replicas:
        fig.add_trace(
            go.Scatter(x=steps, y=values, mode="lines", name=f"replica {r}", line={"color": color(r), "width": 1})
        )
    if len(info.base_steps):
        fig.add_trace(
            go.Scatter(
                x=info.base_steps,
                y=info.base,
                mode="lines",
                name=info.base_name,
                line={"color": "black", "dash": "dash", "width": 2},
            )
        )
    return layout(fig, info.title, info.key, log_y)


def plot_fanout(run: HDETRun, key: str = "lr", log_y: bool = False, max_points: int = MAX_POINTS) -> go.Figure:
    """Each replica's ``key`` (``lr``, ``lr_pg1``, ``weight_decay``...) with the spread band around the base."""
    return _get_fanout_plot(_get_fanout_info(run, key, max_points), log_y)


class PermutationInfo(NamedTuple):
    name: str
    window_starts: list[int]
    multipliers: np.ndarray  # [replica, window]


def _get_permutation_info(run: HDETRun, name: str = "lr") -> PermutationInfo:
    starts, grid = run.multiplier_grid(name)
    return PermutationInfo(name, starts, grid)


def plot_permutations(run: HDETRun, name: str = "lr") -> go.Figure:
    """Which multiplier each replica held in each window (re-shuffled at every sync)."""
    info = _get_permutation_info(run, name)
    if not info.window_starts:
        return empty_figure("No multipliers recorded in this run", f"Multipliers: {name}")
    fig = go.Figure(
        go.Heatmap(
            z=info.multipliers,
            x=[str(s) for s in info.window_starts],
            y=[f"replica {r}" for r in range(info.multipliers.shape[0])],
            colorscale="RdBu_r",
            zmid=1.0,
            colorbar={"title": "multiplier"},
        )
    )
    per = "per window" if run.resolution is None else f"at the first step of every {run.resolution:,}"
    fig.update_layout(
        title=titled(f"Multiplier of {name} held by each replica, {per}", run),
        xaxis_title="window start step" if run.resolution is None else "bucket start step",
        margin={"l": 80, "r": 20, "t": 50, "b": 40},
    )
    return fig


def plot_replica_loss(run: HDETRun, log_y: bool = True, max_points: int = MAX_POINTS) -> go.Figure:
    """Each replica's training loss and the mean."""
    fig = go.Figure()
    for r in range(run.world_size):
        steps, values = run.replica_series("loss", r)
        if len(steps):
            s, v = downsample(steps, values, max_points)
            fig.add_trace(go.Scatter(x=s, y=v, mode="lines", name=f"replica {r}", line={"color": color(r), "width": 1}))
    steps, mean = run.mean_series("loss")
    if len(steps):
        s, v = downsample(steps, mean, max_points)
        fig.add_trace(go.Scatter(x=s, y=v, mode="lines", name="mean", line={"color": "black", "width": 2}))
    if not fig.data:
        return empty_figure(nothing_yet(run, "loss"), "Loss per replica")
    return layout(fig, titled("Training loss per replica", run), "loss", log_y)

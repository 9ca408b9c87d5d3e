"""Controller drift: the controller's base against the plain OneCycle curve, drift, delta, velocity."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..readers.base import HDETRun
from ._common import MAX_POINTS, downsample, empty_figure, titled

__all__ = ["controller_in_view", "guard_in_view", "plot_controller", "taken_back_steps"]

TAKEN_BACK = (
    "The drift went down with no guard action: the first window's move, taken back because the next "
    "window's own evidence did not confirm it (revert_unconfirmed; the default with shared gradients "
    "since round 17), or a bound on the LR."
)


class ControllerInfo(NamedTuple):
    name: str
    target: int
    series: dict[str, np.ndarray]
    used_steps: np.ndarray  # the base the replicas trained around, every step
    used: np.ndarray


def _in_view(run: HDETRun, step: int) -> bool:
    return run.view is None or run.view[0] <= step <= run.view[1]


def controller_in_view(run: HDETRun, name: str = "lr", target: int = 0) -> dict[str, np.ndarray]:
    """:meth:`HDETRun.controller_series` at the syncs in the run's step range (``run.view``; all without one)."""
    series = run.controller_series(name, target)
    if run.view is None:
        return series
    keep = (series["step"] >= run.view[0]) & (series["step"] <= run.view[1])
    return {key: values[keep] for key, values in series.items()}


def guard_in_view(run: HDETRun) -> list:
    """The guard's backoffs and rollbacks in the run's step range."""
    return [g for g in run.guard if _in_view(run, g.step)]


def _get_controller_info(
    run: HDETRun, name: str = "lr", target: int = 0, max_points: int = MAX_POINTS
) -> ControllerInfo:
    series = controller_in_view(run, name, target)
    keys = run.series_keys(name)
    key = keys[target] if target < len(keys) else name
    steps, used = run.mean_series(key)
    steps, used = downsample(steps, used, max_points)
    return ControllerInfo(name, target, series, steps, used)


def taken_back_steps(run: HDETRun, target: int = 0) -> list[int]:
    """Syncs at which the drift controller lowered the LR's drift with no guard action there (the
    LR's evidence only moves it up, so that is a provisional move taken back, or a bound)."""
    guarded = {g.step for g in run.guard}
    return [
        d.step
        for d in run.controller
        if d.name == "lr" and d.controller == "drift" and target < len(d.delta) and d.delta[target] < 0
        if d.step not in guarded and _in_view(run, d.step)
    ]


def plot_controller(run: HDETRun, name: str = "lr", target: int = 0, log_y: bool = False) -> go.Figure:
    """Top: the base (each sync) and the mean value used (each step) against plain OneCycle; middle:
    drift = base / reference (OneCycle's LR, or the initial value), with the guard's backoffs and
    rollbacks and the drift controller's taken-back first moves; bottom: delta and velocity (for
    the drift controller: the change of the log drift and the evidence, in standard errors)."""
    info = _get_controller_info(run, name, target)
    s = info.series
    if not len(s["step"]):
        return empty_figure(
            f"No controller decisions for {name!r} (auto_lr off, or still in warmup)", f"Controller: {name}"
        )
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        row_heights=[0.5, 0.25, 0.25],
        subplot_titles=(
            f"{name}: base vs plain OneCycle" if name == "lr" else f"{name}: base",
            "drift = base / reference",
            "delta and velocity (drift controller: change of log drift, evidence)",
        ),
    )
    if len(info.used_steps):
        fig.add_trace(
            go.Scatter(
                x=info.used_steps,
                y=info.used,
                mode="lines",
                name="used (mean over replicas)"
                if run.resolution is None
                else f"used (mean per {run.resolution:,} steps)",
                line={"color": "#999", "width": 1},
            ),
            row=1,
            col=1,
        )
    fig.add_trace(
        go.Scatter(x=s["step"], y=s["base"], mode="lines+markers", name="controller base", line={"color": "#d62728"}),
        row=1,
        col=1,
    )
    if np.isfinite(s["onecycle"]).any():
        fig.add_trace(
            go.Scatter(
                x=s["step"],
                y=s["onecycle"],
                mode="lines",
                name="plain OneCycle",
                line={"color": "black", "dash": "dash"},
            ),
            row=1,
            col=1,
        )
    if np.isfinite(s["drift"]).any():
        fig.add_trace(
            go.Scatter(x=s["step"], y=s["drift"], mode="lines+markers", name="drift", line={"color": "#9467bd"}),
            row=2,
            col=1,
        )
        fig.add_hline(y=1.0, line={"dash": "dot", "color": "#888"}, row=2, col=1)
    if name == "lr":
        for g in guard_in_view(run):
            color = "#d62728" if g.action == "rollback" else "#ff7f0e"
            fig.add_vline(x=g.step, line={"color": color, "dash": "dot"}, row=2, col=1)
            fig.add_annotation(x=g.step, y=1.0, text=g.action, hovertext=g.reason, showarrow=False, row=2, col=1)
        for step in taken_back_steps(run, target):
            fig.add_vline(x=step, line={"color": "#1f77b4", "dash": "dot"}, row=2, col=1)
            fig.add_annotation(x=step, y=1.0, text="taken back", hovertext=TAKEN_BACK, showarrow=False, row=2, col=1)
    fig.add_trace(go.Bar(x=s["step"], y=s["delta"], name="delta", marker_color="#2ca02c", opacity=0.6), row=3, col=1)
    fig.add_trace(
        go.Scatter(x=s["step"], y=s["velocity"], mode="lines+markers", name="velocity", line={"color": "#ff7f0e"}),
        row=3,
        col=1,
    )
    if log_y:
        fig.update_yaxes(type="log", row=1, col=1)
    fig.update_layout(
        title=titled(f"Controller drift: {name}" + (f" (target {target})" if target else ""), run),
        height=700,
        legend={"orientation": "h", "y": -0.08},
        margin={"l": 60, "r": 20, "t": 70, "b": 40},
    )
    fig.update_xaxes(title_text="step", row=3, col=1)
    return fig

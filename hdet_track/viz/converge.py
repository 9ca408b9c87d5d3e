"""Converge: sync points on the loss chart, divergence before averaging, window losses, the
controller's weights, replicas left out (non-finite or blown up) and the guard's backoffs and rollbacks."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import plotly.graph_objects as go

from .. import names
from ..readers.base import HDETRun
from ._common import MAX_POINTS, color, downsample, empty_figure, layout, nothing_yet, titled

__all__ = ["plot_sync_loss", "plot_divergence", "plot_sync_heatmap", "guard_rows", "step_guard_note"]

# what a run read from its metric histories has of its divergences (per replica only in the archive)
_SUMMARIES = (("mean over replicas", names.SYNC_DIVERGENCE), ("largest replica", names.SYNC_DIVERGENCE_MAX))


class SyncInfo(NamedTuple):
    steps: list[int]
    window_losses: np.ndarray  # [sync, replica]
    divergence: np.ndarray  # [sync, replica]
    left_out: list[tuple[int, int, str]]  # (step, replica, reason)
    guard: list[tuple[int, str, str]]  # (step, action, reason): backoffs and rollbacks
    weight_steps: list[int]
    weights: np.ndarray  # [sync with controller, replica]


def _get_sync_info(run: HDETRun, whole: bool = False) -> SyncInfo:
    """The run's syncs in its step range (``run.view``; all of them with ``whole``)."""
    n = run.world_size
    lo, hi = run.view if run.view is not None and not whole else (-math.inf, math.inf)
    converge = [c for c in run.converge if lo <= c.step <= hi]
    steps = [c.step for c in converge]

    def grid(rows: list[list[float]]) -> np.ndarray:
        out = np.full((len(rows), n), np.nan)
        for i, row in enumerate(rows):
            out[i, : min(n, len(row))] = row[:n]
        return out

    left = [
        (c.step, r, c.reasons[i] if i < len(c.reasons) else "non-finite")
        for c in converge
        for i, r in enumerate(c.left_out)
    ]
    lr_decisions = [d for d in run.controller if d.name == "lr" and lo <= d.step <= hi]
    return SyncInfo(
        steps,
        grid([c.window_losses for c in converge]),
        grid([c.divergence for c in converge]),
        left,
        [(g.step, g.action, g.reason) for g in run.guard if lo <= g.step <= hi],
        [d.step for d in lr_decisions],
        grid([d.weights for d in lr_decisions]),
    )


def guard_rows(run: HDETRun) -> list[dict]:
    """What the guard did, in step order: replicas left out (and why), backoffs, rollbacks (the whole
    run, whatever step range the charts show)."""
    info = _get_sync_info(run, whole=True)
    rows = [{"step": s, "action": "left out", "replicas": str(r), "reason": why} for s, r, why in info.left_out]
    rows += [
        {"step": g.step, "action": g.action, "replicas": ", ".join(map(str, g.replicas)), "reason": g.reason}
        for g in run.guard
    ]
    order = {"left out": 0, "backoff": 1, "rollback": 2}  # within a sync: what the guard saw, then did
    return sorted(rows, key=lambda row: (row["step"], order.get(row["action"], 3)))


def step_guard_note(run: HDETRun) -> str:
    """One sentence on the per-step guard the run used ("" when it had none or did not log it)."""
    scope = run.step_guard
    if scope == "local":
        return (
            "Step guard: local. Each replica checks its own loss at every step and resets itself to "
            "the last consensus when it blows up (no per-step collective; the replicas' gradients differ)."
        )
    if scope == "all":
        return (
            "Step guard: collective. The replicas' losses are gathered at every step, and a blow-up "
            "on any replica rolls every replica back to the last consensus."
        )
    return ""


def plot_sync_loss(run: HDETRun, log_y: bool = True, max_points: int = MAX_POINTS) -> go.Figure:
    """Mean training loss with every sync marked; left-out replicas as red crosses, backoffs and
    rollbacks as vertical lines."""
    steps, loss = run.mean_series("loss")
    if not len(steps):
        return empty_figure(nothing_yet(run, "loss"), "Loss and sync points")
    info = _get_sync_info(run)  # a zoomed range: the syncs in it
    s, v = downsample(steps, loss, max_points)
    fig = go.Figure(go.Scatter(x=s, y=v, mode="lines", name="mean loss", line={"color": "black"}))
    if info.steps:
        fig.add_trace(
            go.Scatter(
                x=info.steps,
                y=_on_the_line(info.steps, steps, loss),
                mode="markers",
                name="sync (parameters averaged)",
                text=[_at(s, steps, loss) for s in info.steps],
                marker={"symbol": "diamond", "size": 8, "color": "#1f77b4"},
            )
        )
    if info.left_out:
        xs = [s for s, _, _ in info.left_out]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=_on_the_line(xs, steps, loss),
                mode="markers",
                name="replica left out and reset",
                text=[f"replica {r}: {why}{_at(s, steps, loss, '; ')}" for s, r, why in info.left_out],
                marker={"symbol": "x", "size": 12, "color": "red"},
            )
        )
    for step, action, reason in info.guard:
        fig.add_vline(
            x=step,
            line={"color": "#d62728" if action == "rollback" else "#ff7f0e", "dash": "dot"},
            annotation_text=action,
            annotation_hovertext=reason,
        )
    return layout(fig, titled("Loss with converge points", run), "loss", log_y)


def _zoomed(run: HDETRun, steps: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if run.view is None:
        return steps, values
    keep = (steps >= run.view[0]) & (steps <= run.view[1])
    return steps[keep], values[keep]


def _on_the_line(xs: list[int], steps: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """Where markers at ``xs`` sit on the loss line: on its finite points (a marker where the loss is
    not finite, a diverged run's, sits at the last finite loss instead of vanishing)."""
    finite = np.isfinite(loss)
    if not finite.any():
        return np.full(len(xs), np.nan)
    return np.interp(xs, steps[finite], loss[finite])


def _at(step: int, steps: np.ndarray, loss: np.ndarray, sep: str = "") -> str:
    """A marker's note when the loss at ``step`` is not finite (it is drawn at the last finite one)."""
    i = int(np.searchsorted(steps, step))
    return f"{sep}loss not finite here" if i < len(steps) and steps[i] == step and not np.isfinite(loss[i]) else ""


def plot_divergence(run: HDETRun) -> go.Figure:
    """Each replica's distance to the average just before each averaging (relative to its norm); for
    a run read without its event archive, the mean and largest over replicas that its metrics hold."""
    info = _get_sync_info(run)
    if info.steps and not np.isfinite(info.divergence).any():
        lines = [(label, _zoomed(run, *run.metrics[key])) for label, key in _SUMMARIES if key in run.metrics]
        if lines:
            fig = go.Figure()
            for i, (label, (steps, values)) in enumerate(lines):
                fig.add_trace(go.Scatter(x=steps, y=values, mode="lines+markers", name=label, line={"color": color(i)}))
            fig.add_annotation(
                text="per replica: in the event archive, which this run was read without",
                showarrow=False,
                xref="paper",
                yref="paper",
                x=0,
                y=1.05,
            )
            return layout(fig, "Divergence before averaging: ||theta_r - mean|| / ||mean||", "relative L2 distance")
    if not info.steps and run.view is not None and run.converge:
        return empty_figure("No sync in the chosen step range", "Divergence before averaging")
    if not info.steps or not np.isfinite(info.divergence).any():
        return empty_figure("No divergence recorded (single replica, or no syncs yet)", "Divergence before averaging")
    fig = go.Figure()
    for r in range(info.divergence.shape[1]):
        fig.add_trace(
            go.Scatter(
                x=info.steps,
                y=info.divergence[:, r],
                mode="lines+markers",
                name=f"replica {r}",
                line={"color": color(r)},
            )
        )
    return layout(fig, "Divergence before averaging: ||theta_r - mean|| / ||mean||", "relative L2 distance")


def plot_sync_heatmap(run: HDETRun, what: str = "weights") -> go.Figure:
    """Window losses (``what="window_losses"``) or softmax weights (``"weights"``) per sync and replica."""
    info = _get_sync_info(run)
    if what == "weights":
        z, x, title, label = info.weights, info.weight_steps, "Controller softmax weights", "weight"
    else:
        z, x, title, label = info.window_losses, info.steps, "Window mean loss", "loss"
    if not len(x):
        if run.view is not None and (run.controller if what == "weights" else run.converge):
            return empty_figure("None in the chosen step range", title)
        return empty_figure("No controller decisions yet" if what == "weights" else "No syncs yet", title)
    fig = go.Figure(
        go.Heatmap(
            z=z.T,
            x=[str(s) for s in x],
            y=[f"replica {r}" for r in range(z.shape[1])],
            colorscale="Viridis",
            colorbar={"title": label},
        )
    )
    fig.update_layout(title=f"{title} per sync", xaxis_title="sync step", margin={"l": 80, "r": 20, "t": 50, "b": 40})
    return fig

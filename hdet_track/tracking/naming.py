"""The metric-name contract: events -> metric points (backend-independent)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..events import ControllerDecision, Converge, StepRecord, series_key
from .base import Point

__all__ = ["replica_prefix", "step_points", "converge_points", "controller_points"]


def replica_prefix(replica: int) -> str:
    return f"hdet/replica_{replica:02d}"


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def step_points(records: Sequence[StepRecord], ts: int) -> list[Point]:
    """Points of one step: ``loss`` and ``lr`` (means over replicas) and every replica's series."""
    if not records:
        return []
    step = records[0].step
    points = [
        Point("loss", _mean([r.loss for r in records]), step, ts),
        Point("lr", _mean([r.values.get("lr", math.nan) for r in records]), step, ts),
    ]
    for rec in records:
        prefix = replica_prefix(rec.replica)
        points.append(Point(f"{prefix}/loss", rec.loss, step, ts))
        for key, value in rec.values.items():
            points.append(Point(f"{prefix}/{key}", value, step, ts))
    return points


def converge_points(event: Converge, ts: int) -> list[Point]:
    step = event.step
    div = [d for d in event.divergence if math.isfinite(d)]
    points = [
        Point("hdet/sync/divergence", _mean(event.divergence), step, ts),
        Point("hdet/sync/divergence_max", max(div) if div else math.nan, step, ts),
        Point("hdet/sync/left_out", float(len(event.left_out)), step, ts),
    ]
    for r, loss in enumerate(event.window_losses):
        points.append(Point(f"hdet/sync/window_loss/replica_{r:02d}", loss, step, ts))
    return points


def controller_points(event: ControllerDecision, labels: Sequence[str], ts: int) -> list[Point]:
    step = event.step
    points = []
    for t, base in enumerate(event.base_after):
        key = series_key(event.name, t, labels[t] if t < len(labels) else "")
        stem = f"hdet/controller/{key}"
        points += [
            Point(f"{stem}/base", base, step, ts),
            Point(f"{stem}/velocity", event.velocity[t], step, ts),
            Point(f"{stem}/delta", event.delta[t], step, ts),
        ]
        if event.onecycle is not None and t < len(event.onecycle):
            points.append(Point(f"hdet/onecycle/{key}", event.onecycle[t], step, ts))
    for r, w in enumerate(event.weights):
        points.append(Point(f"hdet/controller/{event.name}/weight/replica_{r:02d}", w, step, ts))
    return points

"""From what the scheduler hands over to what a backend writes: a :class:`~hdet_track.record.SyncRecord`
becomes the steps table's rows (every step of every replica, for the event archive), the sync's
events, and metric points (thinned for the backends' metric histories, which serve their UIs).

The names come from :mod:`hdet_track.names`. Nothing here recomputes the schedule: every value is
the one the record says training used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import names
from ..events import ControllerDecision, Converge, Guard
from ..record import SyncRecord
from .archive import StepBlock
from .base import Batch, Point

__all__ = ["RecordItem", "PointBudget", "Strides", "expand", "materialize", "metric_points", "sync_point_count"]


@dataclass(frozen=True)
class RecordItem:
    """A record on its way to a backend, with its wall-clock span and the thinning of its points."""

    record: SyncRecord
    start_time: float  # wall time (s) when the window began (the previous sync)
    end_time: float  # wall time (s) of this sync
    mean_stride: int  # `loss`/`lr` means: steps kept where step % stride == 0 (and the run's last step)
    replica_stride: int  # per-replica series likewise
    last_step: int = 0  # the run's total_steps
    sync_points: bool = True  # whether this sync's series (hdet/sync/..., hdet/controller/...) are logged


@dataclass(frozen=True)
class Strides:
    mean: int  # steps between points of `loss`/`lr`
    replica: int  # steps between points of each per-replica series
    sync: int  # syncs between points of the sync and controller series


class PointBudget:
    """How densely the metric histories sample the run.

    The event archive keeps every step and every sync; the metric histories serve MLflow's and
    W&B's UIs and cost the backend about 0.1 ms per point (CPU taken from training when it shares
    the cores). They are kept at power-of-two strides such that together they cost at most
    ``points_per_second``: half for the means ``loss``/``lr``, a quarter for the per-replica series,
    a quarter for the sync and controller series. A run still gets at least ``min_mean_points``
    points of each mean, ``min_replica_points`` of each per-replica series and ``min_sync_points``
    syncs over its whole length (a fixed cost per run: at most about 1,000 points in all with 4
    replicas), a sync where the guard backed off or rolled back is always logged (one where a
    replica was left out only at the budget's stride: every one is in the event archive), and at
    most every ``log_every``-th step. ``points_per_second=None``: no budget.
    """

    def __init__(
        self,
        total_steps: int,
        points_per_second: float | None = 100.0,
        log_every: int = 1,
        min_mean_points: int = 320,
        min_replica_points: int = 50,
        min_sync_points: int = 20,
        sync_every: int = 1,
    ) -> None:
        self.total_steps = max(int(total_steps), 1)
        self.points_per_second = None if points_per_second is None else float(points_per_second)
        self.log_every = log_every
        self.min_mean_points = min_mean_points
        self.min_replica_points = min_replica_points
        self.min_sync_points = min_sync_points
        self.sync_every = max(int(sync_every), 1)

    @staticmethod
    def _pow2(x: float) -> int:
        return 1 if x <= 1 else 1 << math.ceil(math.log2(x))

    def _stride(self, points: float, per_second: float, share: float, total: int, min_points: int) -> int:
        """Power-of-two stride over ``total`` units, ``points`` per unit and ``per_second`` units per
        second, within ``share`` of the budget or ``min_points`` units over the run."""
        if self.points_per_second is None or not math.isfinite(self.points_per_second):
            return 1
        budget = self._pow2(points * per_second / (self.points_per_second * share))
        detail = max(1, 1 << int(math.log2(max(total // max(min_points, 1), 1))))
        return min(budget, detail)

    def strides(self, record: SyncRecord, seconds: float) -> Strides:
        steps = len(record.steps)
        rate = steps / seconds if seconds > 0 else float(steps)
        n, keys = record.losses.shape[0], len(record.values)
        syncs = -(-self.total_steps // self.sync_every)
        return Strides(
            max(self.log_every, self._stride(2, rate, 0.5, self.total_steps, self.min_mean_points)),
            max(self.log_every, self._stride(n * (1 + keys), rate, 0.25, self.total_steps, self.min_replica_points)),
            self._stride(sync_point_count(record), rate / max(steps, 1), 0.25, syncs, self.min_sync_points),
        )


def _mean(values: np.ndarray, axis: int = 0) -> np.ndarray:
    finite = np.isfinite(values)
    count = finite.sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, np.where(finite, values, 0.0).sum(axis=axis) / np.maximum(count, 1), np.nan)


def _steps_block(rec: SyncRecord) -> StepBlock:
    n, t = rec.losses.shape
    return StepBlock(
        step=np.repeat(rec.steps, n),
        replica=np.tile(np.arange(n, dtype=np.int32), t),
        loss=rec.losses.T.ravel(),
        values={k: v.T.ravel() for k, v in rec.values.items()},
        multipliers={k: np.tile(m, t) for k, m in rec.multipliers.items()},
    )


def _events(rec: SyncRecord) -> list:
    events: list = [
        Converge(
            step=rec.step,
            window_losses=list(rec.window_losses),
            divergence=list(rec.divergences),
            left_out=list(rec.left_out),
            reasons=list(rec.reasons),
            step_guard=rec.step_guard,
        )
    ]
    keys_of: dict[str, list[str]] = {}
    for key in rec.values:
        keys_of.setdefault(names.parse_series_key(key)[0], []).append(key)
    for name, updates in rec.updates.items():
        events.append(
            ControllerDecision(
                step=rec.step,
                name=name,
                weights=list(rec.weights) if rec.weights is not None else [],
                delta=[u.delta for u in updates],
                velocity=[u.velocity for u in updates],
                base_before=[u.base_before for u in updates],
                base_after=[u.base_after for u in updates],
                gamma=updates[0].gamma if updates else 0.0,
                permutation=list(rec.next_permutations.get(name, [])),
                onecycle=[u.reference for u in updates] if name == "lr" else None,
                controller=rec.controller,
                reference=[u.reference for u in updates],
            )
        )
    events += [Guard(rec.step, a.kind, list(a.replicas), a.reason, a.drift_change) for a in rec.guard]
    return events


def _step_points(item: RecordItem) -> list[Point]:
    rec = item.record
    t = len(rec.steps)
    ts = (1000 * (item.start_time + (item.end_time - item.start_time) * np.arange(1, t + 1) / t)).astype(np.int64)
    last = rec.steps == item.last_step
    if rec.partial and t:  # the steps since the last sync (a close, a flush): their last is the run's latest
        last[-1] = True  # (a run's final loss, read from the series, was the last step the budget kept)
    points: list[Point] = []
    keep = (rec.steps % item.mean_stride == 0) | last
    means = {names.LOSS: _mean(rec.losses)}
    if names.LR in rec.values:
        means[names.LR] = _mean(rec.values[names.LR])
    for key, series in means.items():
        points += [Point(key, float(series[i]), int(rec.steps[i]), int(ts[i])) for i in np.flatnonzero(keep)]
    keep = (rec.steps % item.replica_stride == 0) | last
    idx = np.flatnonzero(keep)
    for r in range(rec.losses.shape[0]):
        columns = {"loss": rec.losses[r]} | {k: v[r] for k, v in rec.values.items()}
        for key, column in columns.items():
            metric = names.replica_metric(r, key)
            points += [Point(metric, float(column[i]), int(rec.steps[i]), int(ts[i])) for i in idx]
    return points


def _sync_points(rec: SyncRecord, ts: int) -> list[Point]:
    step = rec.step
    div = [d for d in rec.divergences if math.isfinite(d)]
    points = [
        Point(names.SYNC_DIVERGENCE, float(np.mean(div)) if div else math.nan, step, ts),
        Point(names.SYNC_DIVERGENCE_MAX, max(div) if div else math.nan, step, ts),
        Point(names.SYNC_LEFT_OUT, float(len(rec.left_out)), step, ts),
        Point(names.SYNC_ROLLBACK, float(rec.rolled_back), step, ts),
        Point(names.SYNC_BACKOFF, float(any(a.kind == "backoff" for a in rec.guard)), step, ts),
        Point(names.SYNC_STEP_GUARD, names.STEP_GUARD_CODES.get(rec.step_guard, 0.0), step, ts),
    ]
    points += [Point(names.window_loss_metric(r), loss, step, ts) for r, loss in enumerate(rec.window_losses)]
    points += [Point(names.left_out_metric(r), 1.0, step, ts) for r in rec.left_out]
    keys_of: dict[str, list[str]] = {}
    for key in rec.values:
        keys_of.setdefault(names.parse_series_key(key)[0], []).append(key)
    for name, updates in rec.updates.items():
        for key, u in zip(keys_of.get(name, []), updates):
            points += [
                Point(names.controller_metric(key, "base"), u.base_after, step, ts),
                Point(names.controller_metric(key, "velocity"), u.velocity, step, ts),
                Point(names.controller_metric(key, "delta"), u.delta, step, ts),
            ]
            if u.reference > 0:
                points.append(Point(names.controller_metric(key, "drift"), u.base_after / u.reference, step, ts))
            if name == "lr":
                points.append(Point(names.onecycle_metric(key), u.reference, step, ts))
        for r, w in enumerate(rec.weights or []):
            points.append(Point(names.weight_metric(name, r), w, step, ts))
    return points


def sync_point_count(rec: SyncRecord) -> int:
    """How many metric points one sync logs (:func:`_sync_points`; a few dozen, in the writer)."""
    return len(_sync_points(rec, 0))


def expand(item: RecordItem) -> Batch:
    """Everything a backend writes for one record."""
    rec = item.record
    if rec.partial:  # steps after the last sync, no sync: their rows only
        return Batch(points=_step_points(item), steps=[_steps_block(rec)])
    sync = _sync_points(rec, int(item.end_time * 1000)) if item.sync_points else []
    return Batch(
        points=_step_points(item) + sync,
        events=_events(rec),
        steps=[_steps_block(rec)],
    )


def metric_points(values: dict[str, float], step: int, time_s: float) -> list[Point]:
    """User metrics (validation loss, accuracy, ...)."""
    return [Point(str(k), float(v), int(step), int(time_s * 1000)) for k, v in values.items()]


def materialize(batch: Batch) -> Batch:
    """``batch`` with its records expanded into points, events and archive rows."""
    if not batch.records:
        return batch
    out = Batch(points=list(batch.points), events=list(batch.events), steps=list(batch.steps))
    for item in batch.records:
        expanded = expand(item)
        out.points += expanded.points
        out.events += expanded.events
        out.steps += expanded.steps
    return out

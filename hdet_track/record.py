"""What the scheduler hands its callbacks: one typed, complete record per sync.

A :class:`SyncRecord` holds the window between two syncs exactly as training used it: the steps,
plain OneCycleLR's values, every replica's per-step loss and hyperparameter values (computed once,
by the scheduler, with the same rule that set them), the permutations, the health verdicts, the
controller's decisions and the guard's actions. Tracking is one such callback
(:class:`hdet_track.tracking.Recorder`); it never recomputes the schedule.

Nothing here imports torch.distributed or a tracker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ControllerUpdate", "GuardAction", "ExploredSpec", "RunInfo", "SyncRecord", "SchedulerCallback"]


class ControllerUpdate(NamedTuple):
    """One controller decision for one target (a param group's LR, one module's dropout, ...).

    ``reference`` is the value the base is measured against at the sync: plain OneCycle's LR, or
    the hyperparameter's initial value; ``base / reference`` is the drift.
    """

    delta: float
    velocity: float
    base_before: float
    base_after: float
    gamma: float
    clipped: bool
    reference: float = math.nan


@dataclass(frozen=True)
class GuardAction:
    """Something the guard did at a sync.

    ``kind``: ``"left_out"`` (replicas given no weight, left out of the average and reset),
    ``"backoff"`` (the LR drift was cut because the highest-LR replicas blew up or tripped the
    local step guard, or any replica tripped it with ``trip_backoff="spread"``) or
    ``"rollback"`` (the consensus blew up: every replica was restored to the last good consensus
    and the LR drift was cut) or ``"averaged"`` (every window loss was non-finite while every
    replica's parameters were finite, with no rollback to fall back on: averaged as they were, the
    controller did not move). ``drift_change`` is the change of the LR's log drift (0 if none).
    """

    kind: str
    replicas: list[int]
    reason: str
    drift_change: float = 0.0


@dataclass(frozen=True)
class ExploredSpec:
    """One explored hyperparameter (``"lr"`` first): its spread, multipliers, targets and bounds."""

    name: str
    spread: float
    multipliers: list[float]
    targets: list[str]  # a label per target: "pg0", "pg1", module names, ...
    series_keys: list[str]  # the metric key of each target (hdet_track.names.series_key)
    bounds: list[tuple[float, float]]
    clipped: bool  # whether replica values are clipped to the bounds (the LR is not)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "spread": self.spread,
            "multipliers": list(self.multipliers),
            "targets": list(self.targets),
            "series_keys": list(self.series_keys),
            "bounds": [list(b) for b in self.bounds],
            "clipped": self.clipped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExploredSpec:
        from .names import series_key

        name = str(data["name"])
        targets = [str(t) for t in data.get("targets", [])]
        keys = data.get("series_keys") or [series_key(name, t, label) for t, label in enumerate(targets)]
        # JSON has no inf: a missing bound is open
        bounds = [
            (-math.inf if lo is None else float(lo), math.inf if hi is None else float(hi))
            for lo, hi in data.get("bounds", [])
        ]
        return cls(
            name=name,
            spread=float(data.get("spread", 0.0)),
            multipliers=[float(m) for m in data.get("multipliers", [])],
            targets=targets,
            series_keys=[str(k) for k in keys],
            bounds=bounds,
            clipped=bool(data.get("clipped", name != "lr")),
        )


@dataclass(frozen=True)
class RunInfo:
    """What a callback learns when training starts: the configuration and the replicas."""

    config: dict[str, Any]
    world_size: int
    rank: int
    schedule: str  # "hdet" or "onecycle"
    controller: str  # "paper", "drift" or "" (auto_lr=False)
    param_groups: list[str]
    explored: list[ExploredSpec]
    total_steps: int
    start_step: int  # > 0 when the job resumed from a checkpoint or wrapped a running OneCycle
    hostnames: list[str]
    resumed_runs: dict[str, str] = field(default_factory=dict)  # backend name -> run id of the checkpoint
    job: str = ""  # the job's id, the same across its attempts (kept in the checkpoint)


@dataclass(frozen=True)
class SyncRecord:
    """One sync (converge step) and the window of steps before it.

    Arrays are indexed ``[replica, i]`` for step ``steps[i]`` (and ``[i, group]`` for
    ``onecycle``); every rank builds the same record except ``rank``.

    Attributes:
        step: the optimizer step at which the sync ran.
        steps: the window's steps (``step`` is the last).
        losses: every replica's training loss at every step (nan where none was given).
        values: per series key (``lr``, ``lr/pg1``, ``weight_decay``, ...), every replica's value
            at every step, as training used it.
        multipliers: per hyperparameter, every replica's multiplier during the window.
        onecycle: plain OneCycleLR's LR per step and param group.
        bases: per series key, the shared base at every step.
        permutations: per hyperparameter, the permutation used in the window (``perm[r]`` is
            replica r's multiplier index) and ``next_permutations`` those drawn for the next one.
        window_losses: each replica's mean loss over the window.
        divergences: each replica's relative L2 distance to the average before averaging (nan
            unless measured).
        left_out: replicas given no weight, left out of the average and reset.
        reasons: why each replica of ``left_out`` was left out.
        weights: the controller's weight per replica, or None when it did not run.
        updates: per hyperparameter, one :class:`ControllerUpdate` per target.
        guard: what the guard did.
        controller: the controller's name ("" without one).
        rank: the rank that built this record.
        step_guard: the scope of the controller's per-step guard during the window: ``"all"`` (one
            all-gather per step; every replica rolls back together), ``"local"`` (each replica checks
            its own loss and resets itself) or ``""`` (no step guard). With ``step_guard_scope="auto"``
            it is what the gradients decided (``"all"`` until they have: the collective check runs).
        partial: the steps after the last sync of a one-process job closed before its next sync,
            handed to tracking only: no sync ran, nothing changed, and only the step rows are logged.
    """

    step: int
    steps: np.ndarray
    losses: np.ndarray
    values: dict[str, np.ndarray]
    multipliers: dict[str, np.ndarray]
    onecycle: np.ndarray
    bases: dict[str, np.ndarray]
    permutations: dict[str, list[int]]
    next_permutations: dict[str, list[int]]
    window_losses: list[float]
    divergences: list[float]
    left_out: list[int]
    reasons: list[str]
    weights: list[float] | None
    updates: dict[str, list[ControllerUpdate]]
    guard: list[GuardAction]
    controller: str
    rank: int
    time: float = math.nan  # wall time (s since the epoch) of the sync, whenever callbacks get it
    step_guard: str = ""
    partial: bool = False

    @property
    def divergence(self) -> float:
        """This rank's divergence before averaging."""
        return self.divergences[self.rank] if self.rank < len(self.divergences) else math.nan

    @property
    def onecycle_lr(self) -> list[float]:
        """Plain OneCycleLR's LR per param group at the sync step."""
        return [float(v) for v in self.onecycle[-1]] if len(self.onecycle) else []

    @property
    def rolled_back(self) -> bool:
        return any(a.kind == "rollback" for a in self.guard)


class SchedulerCallback:
    """Receives what the scheduler does; subclass and override what you need.

    Called on every rank, on the training thread: keep the work small (hand it to a thread).
    ``needs_divergence`` asks every rank to measure the replicas' divergences at each sync, and
    :meth:`on_sync` then comes once they are in, with no collective of their own on short windows:
    after a window shorter than 2 s (rank 0's clock) each rank's divergence rides in the next sync's
    window gather and the record comes at that sync, before the next one's; after a longer window
    they are gathered in the background (no rank waits for the others) and the record comes at the
    start of the next step. The last step's sync and ``sync_now()`` gather at once; ``close()``,
    ``flush()`` and ``state_dict()`` hand a waiting record over without the divergences that
    have not arrived.
    """

    needs_divergence: bool = False

    def on_start(self, info: RunInfo) -> None:
        """Before the first step (or the first step after a resume)."""

    def on_sync(self, record: SyncRecord) -> None:
        """After each sync, once parameters are averaged and the next window's values are set."""

    def on_step(self, step: int) -> None:
        """After every optimizer step (``step`` counts from 1)."""

    def on_close(self, status: str, error: str | None, step: int) -> None:
        """When the job ends: ``FINISHED``, ``FAILED`` or ``KILLED``."""

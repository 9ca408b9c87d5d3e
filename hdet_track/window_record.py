"""From a window to its :class:`~hdet_track.record.SyncRecord`: the schedule as training used it
(every step's base and every replica's value) and what the sync decided, in one typed record.

Pure: no collective, nothing changes. :class:`~hdet_track.converge.Converger` calls it at each
sync, and for a one-process job closed between two syncs (a ``partial`` record).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np

from .controller import Controller, Decision, Health, WindowStats
from .record import SyncRecord
from .schedule import replica_value_table

__all__ = ["RecordBuilder"]


class RecordBuilder:
    """Builds a window's record.

    Args:
        controller: the controller whose bases the replicas trained around (None: OneCycle's).
        rank: this process's rank (in the record).
        names: the explored hyperparameters, ``"lr"`` first.
        multipliers: per name, rho by multiplier index.
        bounds: per name, what replica values are clipped to (None: not clipped).
        series_keys: per name, the metric key of each target.
    """

    def __init__(
        self,
        controller: Controller | None,
        rank: int,
        *,
        names: Sequence[str],
        multipliers: Mapping[str, list[float]],
        bounds: Mapping[str, list[tuple[float, float]] | None],
        series_keys: Mapping[str, list[str]],
    ) -> None:
        self.controller = controller
        self.rank = rank
        self.names = list(names)
        self.multipliers = multipliers
        self.bounds = bounds
        self.series_keys = series_keys

    def tables(
        self, onecycle_steps: list[list[float]], perms: Mapping[str, list[int]], references: Mapping[str, list[float]]
    ) -> dict[str, dict[str, np.ndarray]]:
        """Per series key: the base at every step of the window and every replica's value (OneCycle's
        LRs at each step in ``onecycle_steps``)."""
        onecycle = np.array(onecycle_steps, dtype=np.float64).reshape(len(onecycle_steps), -1)
        bases, values, mults = {}, {}, {}
        for name in self.names:
            rho = self.multipliers[name]
            if name == "lr":
                base = np.array([self._bases_at("lr", refs) for refs in onecycle_steps]).reshape(onecycle.shape)
            else:
                base = np.tile(self._bases_at(name, references[name]), (len(onecycle_steps), 1))
            table = replica_value_table(base, rho, perms[name], self.bounds[name])
            for t, key in enumerate(self.series_keys[name]):
                bases[key] = base[:, t]
                values[key] = table[:, :, t]
            mults[name] = np.array([rho[p] for p in perms[name]], dtype=np.float64)
        return {"onecycle": {"": onecycle}, "bases": bases, "values": values, "multipliers": mults}

    def _bases_at(self, name: str, refs: list[float]) -> list[float]:
        if self.controller is None:
            return list(refs)
        return [self.controller.base(name, t, ref) for t, ref in enumerate(refs)]

    def record(
        self,
        stats: WindowStats,
        tables: dict[str, dict[str, np.ndarray]],
        health: Health,
        divergences: list[float],
        decision: Decision,
        next_perms: Mapping[str, list[int]],
    ) -> SyncRecord:
        """The sync's record: the window (``stats``, ``tables``) and what was decided."""
        steps = np.arange(stats.step - stats.losses.shape[1] + 1, stats.step + 1, dtype=np.int64)
        return SyncRecord(
            step=stats.step,
            steps=steps,
            losses=stats.losses,
            values=tables["values"],
            multipliers=tables["multipliers"],
            onecycle=tables["onecycle"][""],
            bases=tables["bases"],
            permutations=stats.perms,
            next_permutations={k: list(v) for k, v in next_perms.items()},
            window_losses=stats.window_losses,
            divergences=divergences,
            left_out=[r for r, h in enumerate(health.healthy) if not h],
            reasons=[health.reasons[r] for r, h in enumerate(health.healthy) if not h],
            weights=decision.weights,
            updates=decision.updates,
            guard=decision.guard,
            controller=self.controller.name if self.controller is not None else "",
            rank=self.rank,
            time=time.time(),
            step_guard=self._step_guard_scope(),
        )

    def partial(
        self,
        step: int,
        row: list[float],
        tripped: bool,
        onecycle_steps: list[list[float]],
        perms: Mapping[str, list[int]],
        references: Mapping[str, list[float]],
    ) -> SyncRecord:
        """This process's window so far (``row``: the window row a sync gathers) as a ``partial``
        record of its replica alone: for a one-process job closed between two syncs."""
        stats = WindowStats(
            step=step,
            losses=np.array([row[2:]], dtype=np.float64).reshape(1, len(row) - 2),
            counts=[int(row[1])],
            sums=[row[0]],
            finite=[True],
            tripped=[tripped],
            perms={k: list(v) for k, v in perms.items()},
            values={},
            references=dict(references),
            peaks={},
        )
        tables = self.tables(onecycle_steps, perms, references)
        record = self.record(stats, tables, Health([True], [""], False), [math.nan], Decision(), perms)
        return dataclasses.replace(record, partial=True)

    def _step_guard_scope(self) -> str:
        ctrl = self.controller
        if ctrl is None or ctrl.step_guard is None:
            return ""
        return "local" if ctrl.step_guard_scope == "local" else "all"  # "auto" runs the collective check until resolved

"""The converge half of :class:`~hdet_track.scheduler.HDETScheduler`: what it hands the
:class:`~hdet_track.converge.Converger` at a sync (this window's schedule: every replica's values,
OneCycle's references and peaks, the permutations), what it takes back (the next window's
permutations), and :meth:`Syncing.sync_now`, a sync out of turn before a checkpoint.

It expects the scheduler's ``_converger``, ``_fanout``, ``_onecycle`` (plain OneCycle's LRs at the
current step), ``_schedule_phases`` (OneCycleLR's), ``_model``, ``average_buffers``,
``measure_divergence``, ``optimizer``, ``last_epoch``, ``total_steps``, :meth:`replica_values`,
:meth:`_refresh`, :meth:`_apply_explored` and :meth:`_owns_lr`, and :class:`~hdet_track.reporting.Reporting`'s
delivery (``_deliver``, ``_notify``, ``gather_pending``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .record import SyncRecord

if TYPE_CHECKING:
    from .converge import Converger
    from .fanout import FanOut

__all__ = ["Syncing"]


class Syncing:
    """The sync of :class:`~hdet_track.scheduler.HDETScheduler` (a mixin)."""

    _converger: Converger
    _fanout: FanOut
    _onecycle: list[float]
    _schedule_phases: list[dict[str, Any]]
    _model: nn.Module | None
    average_buffers: bool
    measure_divergence: bool
    last_sync: SyncRecord | None
    optimizer: torch.optim.Optimizer
    last_epoch: int
    total_steps: int
    replica_values: Callable[..., list[list[float]]]  # the scheduler's: every replica's values of a name
    _refresh: Callable[[], None]  # the scheduler's: re-apply this rank's values for the current step
    _apply_explored: Callable[..., None]  # the scheduler's: write this rank's explored values (or the base)
    _owns_lr: Callable[[], bool]  # the scheduler's: whether the optimizer's LRs are the ones it wrote last
    _deliver: Callable[..., None]  # Reporting's: hand a waiting record to the callbacks
    _notify: Callable[[SyncRecord], None]  # Reporting's: hand a complete record to the callbacks
    gather_pending: Callable[[], None]  # Reporting's

    def sync_now(self) -> SyncRecord | None:
        """Converge now instead of at the next multiple of ``sync_every`` (the schedule of later
        syncs is unchanged); a collective: every rank calls it after the same step. Integrations call
        it before a checkpoint, so that the checkpoint holds one consensus that every replica resumes
        from. The optimizer's state (momentum, Adam's moments) is averaged too, also right after a
        sync, so that rank 0's optimizer state in such a checkpoint is every replica's (with weight
        decay, or independent replicas, each replica's own differs). Returns the sync's record (None
        right after a sync: nothing to converge).

        Once another scheduler has set its own LRs over HDET's (SequentialLR's next scheduler after
        the milestone, which comes before HDET's last step), it averages without touching them, and
        every rank then holds the explored hyperparameters' shared base, as after HDET's last step
        (until HDET's next sync, if it is stepped again, as in a ChainedScheduler): call it on every
        rank right after the milestone step to end HDET's phase on one consensus.
        """
        record = None
        if not self._converger.losses:
            self.gather_pending()  # right after a sync: its divergences, before a checkpoint
        else:
            owns = self._owns_lr()  # before the sync: another scheduler's LRs are no "next step" of HDET's
            self._deliver()
            record = self._sync(self.last_epoch, final=True)  # often before a checkpoint: nothing left pending
            if owns:
                self._refresh()  # the next step's values, from the new drift and permutations
            self._synced(record, shared=None if owns else True)
        self._converger.averager.average_optimizer_state()
        return record

    def _synced(self, record: SyncRecord, shared: bool | None = None) -> None:
        self._apply_explored(shared)
        self._deliver(ready_only=True)  # the last sync's record, completed by this sync's gather
        self.last_sync = record
        if not self._converger.pending:
            self._notify(record)

    def _sync_tensors(self) -> list[torch.Tensor]:
        trained = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self._model is None:
            return trained
        tensors = list(self._model.parameters())
        if self.average_buffers:
            tensors += list(self._model.buffers())
        # and what the optimizer trains outside the model (a learnable temperature kept beside it):
        # left out, the replicas' copies drifted apart and a blow-up in one got past the guard
        held = {id(t) for t in tensors}
        return tensors + [p for p in dict.fromkeys(trained) if id(p) not in held]

    def _sync(self, step: int, blown: str | None = None, final: bool = False) -> SyncRecord:
        """Converge with the window's schedule; the next window's permutations come back in the record."""
        record = self._converger.sync(
            step,
            perms=self._fanout.perm,
            values={name: self.replica_values(name) for name in self._fanout.names},
            references=self._references(),
            peaks={"lr": self._onecycle_peaks()} | {k: list(v) for k, v in self._fanout.references.items()},
            measure=self.measure_divergence,
            blown=blown,
            final=final or step >= self.total_steps,
        )
        self._fanout.perm = {k: list(v) for k, v in record.next_permutations.items()}
        return record

    def _references(self) -> dict[str, list[float]]:
        return {"lr": list(self._onecycle)} | {k: list(v) for k, v in self._fanout.references.items()}

    def _window_record(self) -> SyncRecord:
        """The steps since the last sync as a ``partial`` record (this process's replica; nothing changes)."""
        return self._converger.window_record(self.last_epoch, self._fanout.perm, self._references())

    def _onecycle_peaks(self) -> list[float]:
        """OneCycle's highest LR per group from the current step to the end: max_lr until the peak."""
        rising = self.last_epoch < self._schedule_phases[0]["end_step"]
        return [float(g["max_lr"]) if rising else lr for g, lr in zip(self.optimizer.param_groups, self._onecycle)]

"""The converge step of :class:`~hdet_track.scheduler.HDETScheduler`: from one window to its record.

Between two syncs a :class:`Converger` keeps this replica's window (its loss and plain OneCycle's
LRs at every step). At a sync it gathers every replica's window into a
:class:`~hdet_track.controller.WindowStats` (one all-gather), asks the controller who is healthy,
then rolls every replica back or averages the healthy ones (:mod:`hdet_track.averager`) and lets
the controller decide; it draws the next window's permutations and has the
:class:`~hdet_track.record.SyncRecord` built (:mod:`hdet_track.window_record`). The scheduler
hands it the schedule as training used it (permutations, every replica's values, references) and
sets the next window's values.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from . import collectives
from .averager import ReplicaAverager
from .controller import Controller, Decision, Health, WindowStats
from .errors import NonFiniteReplicasError
from .record import GuardAction, SchedulerCallback, SyncRecord
from .schedule import draw_permutation
from .window_record import RecordBuilder

__all__ = ["Converger", "gradient_fingerprint", "gradients_shared"]

FINGERPRINT_TENSORS = 16  # gradient tensors sampled, evenly spaced over the model
FINGERPRINT_VALUES = 4  # values per sampled tensor, evenly spaced in it


def gradient_fingerprint(tensors: Sequence[torch.Tensor]) -> list[float]:
    """This rank's gradients, sampled: ``[count, n, v_1 .. v_n, 0 ..]`` (a fixed length), where
    ``count`` is how many tensors have a gradient and ``v`` are ``FINGERPRINT_VALUES`` gradient
    values in each of up to ``FINGERPRINT_TENSORS`` tensors evenly spaced over the model, read at
    fixed positions (a position repeats in a smaller tensor). Exact: no reduction, so no summation
    order that could differ between ranks; the values are read as views (no copy of a gradient,
    contiguous or not), stacked per device and copied to the host once per device."""
    grads = [t.grad for t in tensors if t.grad is not None and t.grad.numel() > 0 and not t.grad.is_sparse]
    size = FINGERPRINT_TENSORS * FINGERPRINT_VALUES
    picked: list[torch.Tensor] = []
    if grads:
        for i in np.unique(np.linspace(0, len(grads) - 1, min(len(grads), FINGERPRINT_TENSORS)).round().astype(int)):
            g = grads[i].detach()
            for j in np.linspace(0, g.numel() - 1, FINGERPRINT_VALUES).round().astype(int):
                picked.append(g[tuple(int(k) for k in np.unravel_index(j, g.shape))] if g.dim() else g)
    values: list[float] = [0.0] * len(picked)
    by_device: dict[torch.device, list[int]] = {}
    for k, v in enumerate(picked):
        by_device.setdefault(v.device, []).append(k)
    for at in by_device.values():  # one small stack and one copy per device; float64 on the host (MPS has none)
        for k, x in zip(at, torch.stack([picked[k] for k in at]).cpu().to(torch.float64).tolist()):
            values[k] = x
    return [float(len(grads)), float(len(values))] + values + [0.0] * (size - len(values))


def gradients_shared(fingerprints: Sequence[Sequence[float]]) -> bool | None:
    """Whether the ranks' gradients are shared (DDP averaged them), from every rank's
    :func:`gradient_fingerprint`; None when it cannot tell yet (a rank without gradients, a
    non-finite value: a NaN at a step says nothing about who computed it, and NaN != NaN; only
    zeros: gradients zeroed before the step; or ranks with different numbers of gradients, as
    when a parameter outside a DDP wrapper is used on some ranks only).

    Shared when any sampled tensor with a non-zero value holds the same values on every rank:
    under DDP a parameter outside the wrapper, or a per-rank term written into ``.grad``, must not
    make the rest look independent (independent replicas agreeing bit for bit on a tensor's
    non-zero gradient values is not a coincidence either). Reading shared gradients as
    independent is the unsafe direction; the other, and undecided, only cost the collective
    check's speed. The sample is 16 tensors spread over the model: DDP around a small part of a
    large model can be missed, and then reads as independent (force ``step_guard_scope="all"``)."""
    if any(f[0] == 0 or not all(map(math.isfinite, f)) for f in fingerprints):
        return None
    if all(not any(f[2:]) for f in fingerprints):
        return None
    first = list(fingerprints[0])
    if any(list(f[:2]) != first[:2] for f in fingerprints):
        return None
    k = FINGERPRINT_VALUES
    for at in range(2, 2 + int(first[1]), k):
        if any(first[at : at + k]) and all(list(f[at : at + k]) == first[at : at + k] for f in fingerprints):
            return True
    return False


_AVERAGED = (
    "every window loss non-finite, every replica's parameters finite (a skipped step, a NaN batch): "
    "averaged as they are; the controller did not move"
)


class Converger:
    """This replica's window between two syncs, and the sync that converges it.

    Args:
        averager: averages the replicas over its process group (and keeps the consensus to roll back to).
        controller: judges health and decides at each sync (None: the basic health rule, no decisions).
        names: the explored hyperparameters, ``"lr"`` first.
        multipliers: per name, rho by multiplier index.
        bounds: per name, what replica values are clipped to (None: not clipped).
        series_keys: per name, the metric key of each target.
        generators: per name, the generator the next permutations are drawn from.
        callbacks: receive the record of a window in which every replica diverged, before the error.
    """

    def __init__(
        self,
        averager: ReplicaAverager,
        controller: Controller | None,
        *,
        names: Sequence[str],
        multipliers: Mapping[str, list[float]],
        bounds: Mapping[str, list[tuple[float, float]] | None],
        series_keys: Mapping[str, list[str]],
        generators: Mapping[str, torch.Generator],
        callbacks: Sequence[SchedulerCallback],
    ) -> None:
        self.averager = averager
        self.controller = controller
        self.names = list(names)
        self.records = RecordBuilder(
            controller, averager.rank, names=names, multipliers=multipliers, bounds=bounds, series_keys=series_keys
        )
        self.generators = generators
        self._multipliers = {k: list(v) for k, v in multipliers.items()}
        self.callbacks = callbacks
        self.losses: list[float | torch.Tensor | None] = []  # this replica's losses since the last sync
        self.onecycle: list[list[float]] = []  # OneCycle's LR per group at each step of the window
        # The last sync's record while its divergences are on their way: gathered in the background
        # (PendingRows), or carried by the next sync's window gather (None).
        self._pending: tuple[SyncRecord, collectives.PendingRows | None] | None = None
        self._ready: SyncRecord | None = None  # completed by this sync's gather, not handed over yet
        self._own: tuple[int, float] = (0, math.nan)  # this replica's divergence at that sync, to carry
        self._window_start = time.monotonic()
        self.tripped = False  # the local step guard reset this replica in the window
        # Windows shorter than this (rank 0's clock and setting, shared by the gather) carry the
        # divergences in the next sync's gather instead of a collective of their own: on an
        # oversubscribed CPU that collective costs every rank a scheduler time slice (~10-20 ms)
        # per sync. Below 2 s the record arrives at most 2 s later (unless a pause comes first:
        # gather_carried()), inside the tracking writer's 3-s hand-over; a longer window pays the
        # collective unnoticed (<1%) and hands its record over at the next step.
        self.carry_below_seconds = 2.0

    def append(self, loss: float | torch.Tensor | None, onecycle: list[float]) -> None:
        """One step of the window: this replica's loss (None: not given) and OneCycle's LRs."""
        self.losses.append(loss)
        self.onecycle.append(onecycle)

    def window_state(self) -> dict[str, list]:
        """The partial window as plain Python values (for ``HDETScheduler.state_dict``)."""
        window: dict = {
            "losses": [None if x is None else float(x) for x in self.losses],
            "onecycle": list(self.onecycle),
        }
        return window | ({"tripped": True} if self.tripped else {})

    def load_window(self, window: Mapping[str, list]) -> None:
        """Resume a saved window; nothing is carried into it (hand a waiting record over first)."""
        self.losses = list(window["losses"])
        self.onecycle = [list(x) for x in window["onecycle"]]
        self.tripped = bool(window.get("tripped", False))
        self._own, self._window_start = (0, math.nan), time.monotonic()

    def step_guard(self) -> str | None:
        """With the controller's ``step_guard``: gather this step's and the window's first losses;
        a reason to converge and roll back now (the same decision on every rank), or None.

        With ``step_guard_scope="auto"`` the same all-gather carries a fingerprint of each rank's
        gradients until they tell whether they are shared (:func:`gradients_shared`); until then
        the collective check runs."""
        ctrl = self.controller
        if ctrl is None or ctrl.step_guard is None:
            return None
        now, first = (math.nan if x is None else float(x) for x in (self.losses[-1], self.losses[0]))
        if ctrl.step_guard_scope == "local":  # no collective: this replica resets itself
            if self.averager.has_consensus and ctrl.check_own_step(now, first) is not None:
                self.averager.restore()
                self.tripped = True
            return None
        # Decided from a step whose gradients were computed after one spread step since the last
        # consensus: at the window's first step every replica starts from the same parameters, so
        # identical batches would make independent replicas look shared.
        resolving = ctrl.step_guard_scope == "auto" and len(self.losses) >= 2
        row = [now, first] + (gradient_fingerprint(self.averager.tensors()) if resolving else [])
        rows = collectives.all_gather_rows(row, self.averager.group)
        if resolving:
            shared = gradients_shared([r[2:] for r in rows])
            if shared is not None:
                ctrl.resolve_scope(shared)  # from the next step on
        return ctrl.check_step([r[0] for r in rows], [r[1] for r in rows])

    def sync(
        self,
        step: int,
        perms: dict[str, list[int]],
        values: dict[str, list[list[float]]],
        references: dict[str, list[float]],
        peaks: dict[str, list[float]],
        measure: bool = False,
        blown: str | None = None,
        final: bool = False,
    ) -> SyncRecord:
        """Converge the replicas (a collective: every rank calls it after the same step).

        Args:
            step: the optimizer step of the sync.
            perms, values, references, peaks: per name, the window's permutation, every replica's
                values at the sync, the references and their peaks ahead (see ``WindowStats``).
            measure: measure and gather the replicas' divergence before averaging, into the record.
                When only a callback ``needs_divergence``, the callbacks get the record from
                :meth:`complete` once the divergences are in: carried by the next sync's window
                gather after a short window (``carry_below_seconds`` on rank 0's clock), else
                gathered in the background and in by the next step.
            blown: the step guard's reason to roll back now, if any.
            final: no sync follows (the last step, or a sync before a checkpoint): divergences that
                callbacks need are gathered now.

        Returns:
            The sync's record; its ``next_permutations`` are the next window's. The window is emptied.

        Raises:
            NonFiniteReplicasError: no replica is healthy and no rollback is possible (the callbacks
                receive the record first).
        """
        n = self.averager.world_size
        finite = self.averager.local_finite()
        row = self._window_row()
        now = time.monotonic()
        carried_step, carried = self._own
        short = now - self._window_start < self.carry_below_seconds  # rank 0's decides for all
        head = [1.0 if finite else 0.0, float(self.tripped), float(short), float(carried_step), carried]
        head += [self._fan_out_checksum(perms), 0.0 if self.averager.layout_problem is None else 1.0]
        rows = collectives.all_gather_rows([*head, *row], self.averager.group)
        changed = [r for r, got in enumerate(rows) if got[6] == 1.0]
        if changed:  # every rank sees the same rows: every rank raises
            raise ValueError(
                "Expected the model's tensors to keep their shapes and dtypes while HDETScheduler runs, but on "
                f"rank(s) {changed} they changed"
                + (f" (here {self.averager.layout_problem})" if self.averager.layout_problem else "")
                + ": build the scheduler after the model's final cast or change"
            )
        differ = [r for r, got in enumerate(rows) if got[5] != rows[0][5]]
        if differ:  # every rank sees the same rows: every rank raises
            raise ValueError(
                f"Expected every replica to explore the same hyperparameters with the same spreads, seed and "
                f"permutations, but rank(s) {differ} differ from rank 0 at step {step} (their multipliers would "
                "clash): pass the same seed=, spread= and explore= on every rank (one seed for the job, not the rank)"
            )
        self._window_start, self._own = now, (0, math.nan)
        self._complete_carried([int(r[3]) for r in rows], [r[4] for r in rows])
        stats = WindowStats(
            step=step,
            losses=np.array([r[9:] for r in rows], dtype=np.float64).reshape(n, len(self.losses)),
            counts=[int(r[8]) for r in rows],
            sums=[r[7] for r in rows],
            finite=[r[0] == 1.0 for r in rows],
            tripped=[r[1] == 1.0 for r in rows],
            perms={k: list(v) for k, v in perms.items()},
            values=values,
            references=references,
            peaks=peaks,
        )
        window = self.records.tables(self.onecycle, perms, references)  # as training used them, before anything changes
        ctrl = self.controller or Controller()
        health = ctrl.health(stats) if blown is None else Health([False] * n, [blown] * n, ctrl.rollback)
        skipped = (  # only the losses: nothing to reset from, and nothing broken (a skipped step's inf)
            blown is None
            and not ctrl.rollback
            and not any(health.healthy)
            and all(stats.finite)
            and not any(math.isfinite(x) for x in stats.window_losses)
        )
        if skipped:
            warnings.warn(
                f"HDETScheduler: every replica's window loss is non-finite at step {step} "
                f"({stats.window_losses}) but their parameters are finite (a step skipped on an overflow, "
                "a NaN batch): they are averaged as they are and the controller does not move",
                UserWarning,
                stacklevel=4,  # the training loop's step() or sync_now()
            )
            health = Health([True] * n, [""] * n)
        wanted = any(cb.needs_divergence for cb in self.callbacks)
        divergences = [math.nan] * n
        gathering: collectives.PendingRows | None = None
        carry = False
        if health.rollback and self.averager.has_consensus and ctrl.rollbacks < ctrl.max_rollbacks:
            self.averager.restore()
            decision = ctrl.rolled_back(stats, blown)
        elif not any(health.healthy):
            record = self.records.record(stats, window, health, divergences, Decision(), perms)
            earlier, self._ready = self._ready, None  # the last sync's, completed here: it goes first
            for rec in (earlier, record) if earlier is not None else (record,):
                for cb in self.callbacks:  # the diverged window is part of the run's record
                    cb.on_sync(rec)
            rollbacks = ctrl.rollbacks if health.rollback else None
            raise NonFiniteReplicasError(step, n, stats.window_losses, health.reasons, rollbacks)
        else:
            divergence = self.averager.average(health.healthy, measure=measure or wanted)
            carry = wanted and not measure and not final and n > 1 and rows[0][2] == 1.0
            if measure or (wanted and final):
                divergences = [r[0] for r in collectives.all_gather_rows([divergence], self.averager.group)]
            elif carry:  # each rank's own, in the next sync's gather (no collective of its own)
                self._own = (step, divergence)
            elif wanted:  # for the callbacks: gathered while training goes on (see complete())
                gathering = collectives.start_gather_rows([divergence], self.averager.group)
            decision = (
                Decision(guard=[GuardAction("averaged", list(range(n)), _AVERAGED)])
                if skipped
                else ctrl.update(stats, health)
            )
        drawn = dict(perms) | {name: draw_permutation(n, self.generators[name]) for name in self.names}
        self.losses, self.onecycle, self.tripped = [], [], False
        record = self.records.record(stats, window, health, divergences, decision, drawn)
        if gathering is not None or carry:
            self._pending = (record, gathering)
        return record

    def gather_carried(self) -> None:
        """Gather the divergences the last sync left for the next one's gather, now (before a
        checkpoint or a pause). A collective exactly when a divergence is carried, which every rank
        knows alike."""
        step, own = self._own
        if step == 0:
            return
        rows = collectives.all_gather_rows([float(step), own], self.averager.group)
        self._own = (0, math.nan)
        self._complete_carried([int(r[0]) for r in rows], [r[1] for r in rows])

    def _complete_carried(self, steps: list[int], divergences: list[float]) -> None:
        """The held record becomes ready, with every rank's carried divergence when all carried its
        step (a rank that resumed or was handed it over carries none), else as it is."""
        if self._pending is None or self._pending[1] is not None:
            return
        held = self._pending[0]
        self._pending = None
        same = all(s == held.step for s in steps)
        self._ready = dataclasses.replace(held, divergences=divergences) if same else held

    @property
    def pending(self) -> bool:
        """Whether the last sync's divergences are still on their way to the callbacks."""
        return self._pending is not None

    def complete(self, wait: bool = True, force: bool = False, ready_only: bool = False) -> SyncRecord | None:
        """The earliest record not yet handed to the callbacks, once its divergences are in (None when
        there is none or it is still waiting for the next sync). ``wait``: wait for a background
        gather; ``force`` (the job ends or is checkpointed; the process is ending with
        ``wait=False``): hand it over now, without the divergences that have not arrived;
        ``ready_only``: only a record this sync's gather completed."""
        if self._ready is not None:
            record, self._ready = self._ready, None
            return record
        if self._pending is None or ready_only:
            return None
        record, gathering = self._pending
        if gathering is None:  # carried by the next sync's gather
            if not (force or not wait):
                return None
            self._pending = None
            return record
        self._pending = None
        if wait or gathering.done():
            record = dataclasses.replace(record, divergences=[r[0] for r in gathering.wait()])
        return record

    def _fan_out_checksum(self, perms: Mapping[str, Sequence[int]]) -> float:
        """A checksum of what decides each replica's multipliers: the explored names, multipliers,
        this window's permutations and the generators that draw the next (a CRC-32, exact as a float)."""
        spread = [k for k in self.names if len(set(self._multipliers[k])) > 1]  # without spread: one multiplier
        crc = zlib.crc32(repr([(k, self._multipliers[k], list(perms[k])) for k in spread]).encode())
        for name in spread:
            crc = zlib.crc32(self.generators[name].get_state().numpy().tobytes(), crc)
        return float(crc)

    def _window_row(self) -> list[float]:
        """``[loss sum (float64), losses given, every step's loss (nan where none)]``: one device sync."""
        given = [x for x in self.losses if x is not None]
        if not given:
            return [math.nan, 0.0] + [math.nan] * len(self.losses)
        device = next((x.device for x in given if isinstance(x, torch.Tensor)), torch.device("cpu"))
        stacked = torch.stack(
            [torch.as_tensor(x, dtype=torch.float64).reshape(()).to(device=device, dtype=torch.float64) for x in given]
        )
        values = iter(stacked.cpu().tolist())
        return [float(stacked.sum()), float(len(given))] + [
            math.nan if x is None else next(values) for x in self.losses
        ]

    def window_record(self, step: int, perms: dict[str, list[int]], references: dict[str, list[float]]) -> SyncRecord:
        """The window so far as a ``partial`` record of this process's replica alone (no collective,
        nothing changes): for a one-process job closed between two syncs."""
        return self.records.partial(step, self._window_row(), self.tripped, self.onecycle, perms, references)

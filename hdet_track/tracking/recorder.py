"""Tracking as a scheduler callback: the :class:`Recorder` turns what the scheduler hands over into
one tracked run per job, written by rank 0's :class:`~hdet_track.tracking.hub.TrackingHub`."""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..events import RunStart
from ..record import RunInfo, SchedulerCallback, SyncRecord
from . import lifecycle
from .base import mask_secrets, redact, resolve_trackers

__all__ = ["Recorder"]


class Recorder(SchedulerCallback):
    """Logs a job to its trackers (``HDETScheduler(track=...)`` builds one; build it on every rank).

    Rank 0 owns the run; the other ranks' losses reach it in the records. A resumed job (the
    scheduler loaded a checkpoint of a tracked job) continues that job's run when its tracker can.

    Args:
        track: ``True``, ``"mlflow"``, ``"wandb"``, a :class:`~hdet_track.tracking.Tracker` or a list.
        log_every: keep at most every k-th step in the metric histories (the event archive keeps all).
        compare_group: the ``hdet.compare_group`` tag (W&B run group) shared by runs to compare.
        run_name: the run's name.
        close_at_end: end the run as soon as the scheduler reaches ``total_steps``. By default (False)
            it stays open after the last step for final metrics (``log_metrics``), as an
            ``mlflow.start_run()`` or ``wandb.init()`` run does, until ``close()``, the context
            manager's exit or the process's exit (FINISHED when the job reached ``total_steps``).
    """

    needs_divergence = True

    def __init__(
        self,
        track: Any,
        *,
        rank: int = 0,
        log_every: int = 1,
        compare_group: str | None = None,
        run_name: str | None = None,
        close_at_end: bool = False,
    ) -> None:
        self.trackers = resolve_trackers(track)
        self.log_every = int(log_every)  # a sweep's NumPy or tensor integer (checked by the scheduler)
        self.compare_group = compare_group
        self.run_name = run_name
        self.close_at_end = close_at_end
        self.created = time.time()  # the run's start time is the job's, whenever a backend writes it
        self.total_steps = 0
        self.last_step = 0
        self.hub: Any = None
        self.started = False
        self._synced_through = 0  # the last step of the syncs handed over
        self._info: Callable[[], RunInfo] | None = None
        self._early: list[tuple[dict[str, Any], int]] = []  # metrics logged before the run started
        self._pending: Callable[[], SyncRecord | None] | None = None
        if self.trackers:
            from .hub import check_environment

            check_environment()  # on every rank: a bad setting fails all of them alike
            lifecycle.install(rank)  # how the run ends when the process does; other ranks leave failure notes
        if rank == 0 and self.trackers:
            from .hub import TrackingHub

            self.hub = TrackingHub(self.trackers, log_every=self.log_every)  # the run starts at the first step
            lifecycle.register(self)

    def attach_info(self, info: Callable[[], RunInfo], pending: Callable[[], SyncRecord | None] | None = None) -> None:
        """How to describe the job if it ends before its first step (the run is still created), and
        how to take the last sync's record if the job ends while its divergences are being gathered."""
        self._info = info
        self._pending = pending

    def end_with_process(self, reason: str) -> str | None:
        """The process is ending (see :mod:`hdet_track.tracking.lifecycle`): the status the run ends with."""
        if self.hub is None:
            return None
        if not self.started and self._info is not None:
            self.on_start(self._info())  # a job that failed before its first step still has a run
        while self._pending is not None and (record := self._pending()) is not None:
            self.on_sync(record)  # without divergences unless they arrived
        return self.hub.end_with_process(reason)

    def on_start(self, info: RunInfo) -> None:
        self.total_steps = info.total_steps
        if self.hub is None or self.started:
            return
        self.started = True
        from .. import _version

        for key, t in zip(tracker_keys(self.trackers), self.trackers):
            if self.run_name and hasattr(t, "run_name") and not t.run_name:
                t.run_name = self.run_name
            if key in info.resumed_runs:
                t.resume(info.resumed_runs[key])
        self._end_abandoned(set(info.resumed_runs.values()))
        import torch

        start = RunStart(  # what a run, its event archive and its spill hold: no secret (base.redact)
            config=redact(info.config),
            world_size=info.world_size,
            schedule=info.schedule,
            param_groups=[mask_secrets(g) or g for g in info.param_groups],
            explored=info.explored,
            versions={
                "hdet_track": _version.__version__,
                "torch": str(torch.__version__),  # a plain str: the writer process need not import torch
                "python": platform.python_version(),
            },
            hostnames=info.hostnames,
            compare_group=mask_secrets(self.compare_group),
            time=self.created if info.start_step == 0 else time.time(),
            controller=info.controller,
            total_steps=info.total_steps,
            start_step=info.start_step,
            job=info.job,
        )
        self.hub.start(start)
        for metrics, step in self._early:  # behind the run's start: a backend gets nothing before it
            self.hub.metrics(metrics, step)
        self._early.clear()

    def _end_abandoned(self, run_ids: set[str]) -> None:
        """A scheduler of this process resumes a run that an earlier one left open (a retry loop that
        caught the exception): end the earlier one's writer first, FAILED, so that the resumed run
        starts from an ended run and is not ended again by the process's exit."""
        for other in lifecycle.registered():
            hub = getattr(other, "hub", None)
            if other is self or hub is None or hub.ended or not any(t.run_id in run_ids for t in hub.trackers):
                continue
            step, total = other.last_step, other.total_steps
            other.on_close(
                "FAILED",
                f"left at step {step} of {total} without closing the run; a later scheduler of the same "
                f"process resumed the run from a checkpoint",
                step,
            )

    def on_sync(self, record: SyncRecord) -> None:
        self._synced_through = max(self._synced_through, record.step)
        if self.hub is not None:  # stamped with the sync's own time, however late it is handed over
            self.hub.record(record, record.time if math.isfinite(record.time) else None)

    def keep_rows(self, record: SyncRecord) -> None:
        """The step rows of a ``partial`` record (a one-process job closed between two syncs),
        into the run while it is open; a closed or never started run has no use for them, and a
        window that overlaps the last sync's (a step that raised before it counted) is not one."""
        if self.hub is not None and self.started and not self.hub.ended and record.steps[0] > self._synced_through:
            self.hub.record(record, record.time)

    def on_step(self, step: int) -> None:
        self.last_step = step
        if self.hub is not None:
            self.hub.note_step(step)
            if step == self.total_steps and self.close_at_end and not self.hub.ended:
                # Ends the run without waiting for the writer; flush(), close() or exit wait.
                self.hub.close("FINISHED", None, step=step, wait=False)

    def on_close(self, status: str, error: str | None, step: int) -> None:
        if self.hub is not None:
            if not self.started and self._info is not None:
                info = self._info()
                # closed before its first step: the run is created (or a resumed one reopened) for
                # the metrics logged since, and for a resumed job with no steps left (it finished
                # here); a job closed before it did anything gets no empty run
                if self._early or 0 < info.total_steps <= info.start_step:
                    self.on_start(info)
            self.hub.close(status, error, step=step)
            lifecycle.unregister(self)  # written and ended: the process's exit has nothing to do

    def finished_open(self) -> bool:
        """Whether the job reached its last step and the run is still open (for final metrics)."""
        return self.hub is not None and not self.hub.ended and self.hub.reached_end

    def end_finished(self) -> None:
        """Another run of this process starts: end this finished one now (:mod:`.lifecycle`)."""
        self.hub.close("FINISHED", None)
        lifecycle.unregister(self)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Into the run; before its first step (a restored checkpoint evaluated first) they wait
        for the run's start, which comes with that step (after a ``load_state_dict``: the same run)."""
        if self.hub is None:
            return
        if not self.started and not self.hub.ended:
            self._early.append((dict(metrics), step))
        else:
            self.hub.metrics(dict(metrics), step)

    def flush(self, timeout: float | None = 60.0) -> bool:
        return True if self.hub is None else self.hub.flush(timeout)

    def run_ids(self, wait: float = 0.0) -> dict[str, str | None]:
        """Rank 0: each backend's run id (waiting up to ``wait`` s for a started run to be created;
        before the first step there is none to wait for)."""
        if self.hub is None:
            return {}
        if wait > 0 and self.started:
            self.hub.started.wait(wait)
        return {key: t.run_id for key, t in zip(tracker_keys(self.hub.trackers), self.hub.trackers)}


def tracker_keys(trackers: Any) -> list[str]:
    """Each tracker's key in ``run_ids`` and in a checkpoint's runs: its backend's name (``mlflow``,
    ``wandb``), and ``wandb#2``... for a second tracker of the same backend (two stores), so that a
    resumed job continues each run in its own store."""
    seen: dict[str, int] = {}
    keys = []
    for t in trackers:
        name = t.name or type(t).__name__
        seen[name] = seen.get(name, 0) + 1
        keys.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return keys

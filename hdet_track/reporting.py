"""What the scheduler hands its callbacks, and when: the sync records (once the divergences a
callback needs are in), the run's start, extra metrics, flushing and the end of the job.

:class:`Reporting` is the half of :class:`~hdet_track.scheduler.HDETScheduler` that faces tracking;
the other half (the schedule, the fan-out, the sync, checkpoints) never calls a tracker. It expects
the scheduler's ``_callbacks`` (a :class:`~hdet_track.callbacks.CallbackList`), ``_converger``,
``last_sync``, ``last_epoch``, ``_rank``, ``_world_size``, ``_config``, ``_started`` and
:meth:`_window_record`, and, for :meth:`run_info` (what callbacks receive at the start), ``optimizer``,
``total_steps``, ``auto_lr``, ``_fanout``, ``_controller``, ``_lr_bounds``, ``_group``,
``_resumed_runs`` and ``_job``.
"""

from __future__ import annotations

import logging
import numbers
import socket
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from . import collectives, names
from .controller import PaperController
from .record import RunInfo, SchedulerCallback, SyncRecord

if TYPE_CHECKING:
    import torch

    from .callbacks import CallbackList
    from .controller import Controller
    from .converge import Converger
    from .fanout import FanOut

_R = TypeVar("_R", bound="Reporting")

__all__ = ["Reporting", "checked_metrics"]

logger = logging.getLogger(__name__)


class Reporting:
    """Callbacks and tracking for :class:`~hdet_track.scheduler.HDETScheduler` (a mixin)."""

    _callbacks: CallbackList
    _converger: Converger
    _config: dict[str, Any]
    _rank: int
    _world_size: int
    _started: bool
    last_sync: SyncRecord | None
    last_epoch: int
    total_steps: int
    auto_lr: bool
    optimizer: torch.optim.Optimizer
    _fanout: FanOut
    _controller: Controller | None
    _lr_bounds: list[tuple[float, float]]
    _group: Any
    _resumed_runs: dict[str, str]
    _job: str
    _window_record: Callable[[], SyncRecord]  # the scheduler's: the steps since the last sync, as rows

    def run_info(self, gather: bool = True) -> RunInfo:
        """What callbacks receive at the start: configuration, replicas, explored hyperparameters
        (``gather=False``: without the collective that gathers every rank's host name)."""
        config = dict(self._config, total_steps=self.total_steps, optimizer=type(self.optimizer).__name__)
        if isinstance(self._controller, PaperController):
            config["gamma"] = self._controller.gamma["lr"]
        host = socket.gethostname()
        return RunInfo(
            config=config,
            world_size=self._world_size,
            rank=self._rank,
            schedule="hdet" if self._fanout.spreading or self.auto_lr else "onecycle",
            controller=self._controller.name if self._controller is not None else "",
            param_groups=[str(g.get("name", f"pg{i}")) for i, g in enumerate(self.optimizer.param_groups)],
            explored=self._fanout.specs(self._lr_bounds),
            total_steps=self.total_steps,
            start_step=max(self.last_epoch, 0),
            hostnames=[str(h) for h in collectives.all_gather_objects(host, self._group)] if gather else [host],
            resumed_runs=dict(self._resumed_runs),
            job=self._job,
        )

    def add_callback(self, callback: SchedulerCallback) -> None:
        """Receive :meth:`~hdet_track.record.SchedulerCallback.on_sync` etc. (add on every rank,
        before the first step, if it sets ``needs_divergence``)."""
        self._callbacks.add(callback)

    def gather_pending(self) -> None:
        """Hand the callbacks (tracking) the last sync's record now, with every replica's divergence,
        instead of at the next sync; a collective when a record waits for one (after a window
        shorter than 2 s), so every rank calls it after the same step. Call it before a pause that
        is not a step (an evaluation, a long checkpoint write): the record is then in the tracker
        while the pause lasts. The integrations call it before evaluating and saving."""
        self._deliver()
        self._converger.gather_carried()
        self._deliver()

    def _pending_record(self) -> SyncRecord | None:
        return self._converger.complete(wait=False)  # the process is ending: never wait on a collective

    def _deliver(self, force: bool = False, ready_only: bool = False) -> None:
        """Hand the callbacks a sync's record once the divergences a callback ``needs_divergence``
        are in: gathered in the background (by the next step), or carried by the next sync's
        gather after a short window; ``force``: now, with what has arrived (close, checkpoint)."""
        record = self._converger.complete(force=force, ready_only=ready_only)
        while record is not None:
            if self.last_sync is None or record.step >= self.last_sync.step:
                self.last_sync = record
            self._notify(record)
            record = self._converger.complete(force=force, ready_only=ready_only)

    def _notify(self, record: SyncRecord) -> None:
        self._callbacks.on_sync(record)

    def _start(self) -> None:
        self._started = True
        self._callbacks.on_start(self.run_info)

    def _track(self, track: Any, **settings: Any) -> None:
        self._callbacks.track(
            track, rank=self._rank, info=lambda: self.run_info(gather=False), pending=self._pending_record, **settings
        )

    def start_tracking(
        self, track: Any, *, log_every: int = 1, compare_group: str | None = None, run_name: str | None = None
    ) -> None:
        """Start tracking a scheduler built with ``track=False`` (on every rank, before the first
        ``step``): for integrations whose tracker run exists only once training begins."""
        if self._started:
            raise ValueError(f"Expected start_tracking() before the first step, but {self.last_epoch} steps were taken")
        self._track(track, log_every=log_every, compare_group=compare_group, run_name=run_name, close_at_end=False)
        self._config.update(log_every=log_every, compare_group=compare_group, run_name=run_name)

    @property
    def tracking(self) -> bool:
        """Whether this job logs to a tracker (on every rank; rank 0 owns the run)."""
        return self._callbacks.recorder is not None

    @property
    def run_ids(self) -> dict[str, str | None]:
        """Rank 0: the tracker run id of each backend (once created); elsewhere empty."""
        return self._callbacks.run_ids()

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log extra metrics (validation loss, accuracy, ...) into the run, on rank 0; a no-op elsewhere.

        ``metrics`` maps names other than HDET's own series (``loss``, ``lr``, ``hdet/...``; when
        tracked to MLflow, names MLflow takes) to real numbers (one-element real tensors and arrays
        too); ``step`` defaults to the scheduler's. Checked on every rank, here: a bad name or value
        raises at this call and never reaches the run."""
        recorder = self._callbacks.recorder
        backends = {getattr(t, "name", "") for t in recorder.trackers} if recorder is not None else set()
        values = checked_metrics(metrics, mlflow_names="mlflow" in backends, wandb_names="wandb" in backends)
        if step is not None:
            whole = isinstance(step, numbers.Integral) or (isinstance(step, float) and step.is_integer())
            if isinstance(step, bool) or not whole or not 0 <= step < 2**63:
                raise ValueError(
                    f"Expected step to be an integer in [0, 2**63) (or None: the scheduler's), but got {step!r}"
                )
            step = int(step)
        self._deliver()
        self._callbacks.log_metrics(values, max(self.last_epoch, 0) if step is None else step)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Block until what was logged so far reached the trackers (rank 0). True when it did (the
        last sync's divergences too when they are in; otherwise its record goes without them)."""
        self._deliver(force=True)
        return self._callbacks.flush(timeout)

    def close(self, status: str = "FINISHED", error: str | None = None) -> None:
        """End the job: the tracked run ends with ``status`` (FINISHED, FAILED or KILLED); idempotent.

        A job of one process closed FINISHED between two syncs (an early stop) keeps its steps
        since the last sync in the run, as rows only: nothing converges and nothing changes. A
        failed job keeps its rows up to its last sync (a resume from a checkpoint redoes the steps
        after it, and a sync's rows all come from one attempt). With several processes the other
        replicas' losses reach rank 0 only at a sync, and ``close`` never runs a collective: call
        :meth:`sync_now` on every rank first."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"Expected status in ('FINISHED', 'FAILED', 'KILLED'), but got {status!r}")
        self._deliver(force=True)
        if status == "FINISHED":
            self._keep_window()
        self.__dict__["_released"] = True  # a later optimizer.load_state_dict() is not this scheduler's
        self._callbacks.on_close(status, error, max(self.last_epoch, 0))

    def _keep_window(self) -> None:
        recorder = self._callbacks.recorder
        if recorder is None or not self._converger.losses:
            return
        if self._world_size != 1:
            if self._rank == 0:
                last = max(self.last_epoch, 0)
                logger.warning(
                    "hdet-track: closed between two syncs: steps %d-%d are not in the run (the other "
                    "replicas' losses reach rank 0 only at a sync, and close() runs no collective); call "
                    "sched.sync_now() on every rank before close() to keep them",
                    last - len(self._converger.losses) + 1,
                    last,
                )
            return
        try:
            record = self._window_record()
        except Exception as exc:  # noqa: BLE001 - close() also runs on error paths: it must not raise
            logger.warning("hdet-track: the steps after the last sync are not logged (%s: %s)", type(exc).__name__, exc)
            return
        recorder.keep_rows(record)

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            text = "".join(traceback.format_exception(exc_type, exc, tb))[-4000:]
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED", text)


def checked_metrics(metrics: Any, mlflow_names: bool = True, wandb_names: bool = True) -> dict[str, Any]:
    """``metrics`` checked: a mapping of non-empty names, none of them HDET's own series (with
    ``mlflow_names``, each one MLflow takes; with ``wandb_names``, none with a ``*``, which W&B
    reads as a pattern), to real numbers (made floats) or one-element real
    tensors or arrays (a tensor is kept as it is, detached: reading it would wait for its device
    here, in the training loop; the tracking writer reads it). Raises ``TypeError``/``ValueError``
    naming the metric and its value."""
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"Expected metrics to be a mapping of names to numbers (e.g. {{'val_loss': 0.31}}), but got "
            f"{type(metrics).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"Expected metric names to be non-empty strings, but got {key!r}")
        if mlflow_names and (problem := names.name_problem(key)) is not None:
            raise ValueError(f"Expected a metric name MLflow takes, but got {key!r}: {problem}")
        if wandb_names and "*" in key:
            raise ValueError(f"Expected a metric name W&B takes, but got {key!r}: W&B reads '*' as a pattern")
        if names.is_hdet_series(key):
            raise ValueError(
                f"Expected metric names other than HDET's own series ('loss', 'lr' and 'hdet/...'), but got "
                f"{key!r}: the run logs these itself; log yours under another name (e.g. 'train_loss')"
            )
        out[key] = _metric_value(key, value)
    return out


def _metric_value(key: str, value: Any) -> Any:
    if isinstance(value, numbers.Real):
        return float(value)
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if hasattr(value, "detach") and hasattr(value, "is_complex"):  # a torch tensor: checked by its dtype alone
        if value.numel() == 1 and not value.is_complex():
            return value.detach()
    elif getattr(dtype, "kind", "") in ("b", "i", "u", "f") and getattr(value, "size", 0) == 1:  # numpy
        return float(value.item())
    got = (
        f"a {type(value).__name__} of dtype {dtype} and shape {tuple(shape)}" if shape is not None else repr(value)[:80]
    )
    raise TypeError(
        f"Expected metric {key!r} to be a real number (or a one-element real tensor or array), but got {got}"
    )

"""The Tracker protocol, the batch it receives, and the static name -> class map of the backends."""

from __future__ import annotations

import importlib
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from ..events import Event, RunEnd, RunStart
from .archive import StepBlock

__all__ = [
    "Point",
    "Batch",
    "BatchRefused",
    "Tracker",
    "get_tracker_class",
    "resolve_trackers",
    "is_secret",
    "TRACKERS",
]


class BatchRefused(Exception):
    """The backend answered and refused what it was sent for its content (an invalid value, not an
    outage): sending the same again cannot succeed. See :meth:`Tracker.refuses`."""


class BackendBroken(Exception):
    """The backend cannot work in this process (its library failed to import): retrying it until
    the shutdown timeout cannot help, so the writer leaves the data in the spill at once."""


def broken_backend(exc: BaseException) -> bool:
    """Whether ``exc`` says the backend's library cannot be used in this process."""
    return isinstance(exc, (ImportError, BackendBroken))


class Point(NamedTuple):
    """One metric point: key (a name from the metric contract), value, step, wall time in ms."""

    key: str
    value: float
    step: int
    timestamp_ms: int


@dataclass
class Batch:
    """What the hub hands a tracker at once: metric points, events and the steps table's rows."""

    points: list[Point] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    steps: list[StepBlock] = field(default_factory=list)
    records: list[Any] = field(default_factory=list)  # expand.RecordItem, not yet expanded

    def __bool__(self) -> bool:
        return bool(self.points or self.events or self.steps or self.records)

    def after(self, step: int) -> Batch:
        """Only what belongs to steps after ``step`` (a resumed job does not write a step twice)."""
        return Batch(
            points=[p for p in self.points if p.step > step],
            events=[
                e for e in self.events if getattr(e, "step", step + 1) > step or e.kind in ("run_start", "run_end")
            ],
            steps=[b.select(b.step > step) for b in self.steps if (b.step > step).any()],
            records=[r for r in self.records if r.record.step > step],
        )

    def until(self, step: int) -> Batch:
        """Only what belongs to steps up to ``step``, without the run's start and end (an earlier
        attempt's data that a job resumed from a checkpoint at ``step`` takes over)."""
        return Batch(
            points=[p for p in self.points if p.step <= step],
            events=[
                e for e in self.events if getattr(e, "step", step) <= step and e.kind not in ("run_start", "run_end")
            ],
            steps=[b.select(b.step <= step) for b in self.steps if (b.step <= step).any()],
            records=[r for r in self.records if r.record.step <= step],
        )


class Tracker:
    """Base class of a tracking backend (one run per job; rank 0 only).

    Subclasses implement :meth:`start`, :meth:`log` and :meth:`finish`; the hub calls them
    from its writer thread, never from the training thread, and treats any exception as the
    backend being unavailable (the batch is spilled to disk and replayed later).
    """

    name: ClassVar[str] = ""
    main_process_only: ClassVar[bool] = True
    # One tracker object logs one run at a time (see _begin_run); a later scheduler gets a new run.
    _run_owner: int | None = None  # the thread whose run is open (a hub's writer), None between runs

    def _begin_run(self) -> bool:
        """For :meth:`start`: False when this thread's run is open already (a retry: nothing to do);
        otherwise wait until no other thread's run of this object is open (a scheduler ended just
        before: its writer may still be finishing it), claim the object and return True (start a
        new run). Raises when another run stays open longer than :data:`RUN_WAIT_SECONDS`."""
        me = threading.get_ident()
        deadline = time.monotonic() + RUN_WAIT_SECONDS
        with _RUNS:
            while self._run_owner not in (None, me):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(shared_tracker_message(self))
                _RUNS.wait(left)
            if self._run_owner == me:
                return False
            self._run_owner = me
            return True

    def _start_claimed(self, start: Any) -> None:
        """For :meth:`start`: claim the object (:meth:`_begin_run`) and call ``start()`` to create the
        run; nothing on a retry of this thread's open run; released again if ``start()`` raises."""
        if not self._begin_run():
            return
        try:
            start()
        except BaseException:
            self._end_run()
            raise

    def _end_run(self) -> None:
        """The run has ended (or failed to start): the next :meth:`start` makes a new one."""
        with _RUNS:
            self._run_owner = None
            _RUNS.notify_all()

    @property
    def _run_open(self) -> bool:
        return self._run_owner is not None

    def start(self, run_start: RunStart) -> None:
        """Create (or attach to) the run. Called again after a failure: must be idempotent."""
        raise NotImplementedError

    def log(self, batch: Batch) -> None:
        """Write a batch of metric points and archive its events."""
        raise NotImplementedError

    def finish(self, run_end: RunEnd) -> None:
        """Flush what is archived and end the run with ``run_end.status``."""
        raise NotImplementedError

    def refuses(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by :meth:`log`, says the backend refused the batch for its
        content (the hub then sends its parts one by one and sets aside only what is refused
        again); False (the default) means the backend is down, and the batch waits in the spill
        until it answers. Only a backend's own word counts: MLflow's ``INVALID_PARAMETER_VALUE``."""
        return isinstance(exc, BatchRefused)

    def heartbeat(self, beat: dict[str, float]) -> None:
        """Record that the run's processes are alive (``beat``: :func:`hdet_track.owner.heartbeat`),
        for readers that cannot check them (another host); the hub calls it every few seconds while
        the run is open. Optional: the default records nothing."""

    def keep_alive(self) -> None:
        """Touch the files this tracker keeps beside the store while its run is open (MLflow: the
        archive chunks not uploaded yet), so that another host does not take them for a gone
        writer's; the hub calls it every minute, whether or not the job logs. Optional."""

    @property
    def run_id(self) -> str | None:
        """The backend's id of the run, once started."""
        return None

    def resume(self, run_id: str) -> None:
        """Continue run ``run_id`` (a resumed job) instead of creating one, where the backend can.

        Called before :meth:`start`. A tracker that was given a run explicitly ignores it."""

    def carry_on(self, run_id: str, continuation: dict[str, Any] | None = None) -> None:
        """Continue run ``run_id``, which this tracker's earlier process (a tracker process that
        died: :class:`~hdet_track.tracking.isolated.IsolatedTracker`) was logging: the next
        :meth:`start` reopens it as that process had opened it (``continuation``: what its
        :meth:`continuation` said) and later batches write only what it lacks. Called before
        :meth:`start`; the default is :meth:`resume`."""
        self.resume(run_id)

    def continuation(self) -> dict[str, Any]:
        """After :meth:`start`: what a later process needs to carry on this run as this object opened
        it (see :meth:`carry_on`); picklable. Optional: the default is empty."""
        return {}

    def upload_left_behind(self) -> list[str]:
        """Deliver what gone processes of this tracker's store left beside it (MLflow: archive chunks
        they had not uploaded); a line for each thing, saying what happened. Optional: the default
        delivers nothing."""
        return []

    def holds(self) -> bool:
        """Whether data given to :meth:`log` is held only in this object's memory, neither in the
        store nor in a file beside it (a process that died now would lose it). Optional: the
        default, False, is right for a tracker that writes every batch before :meth:`log` returns."""
        return False

    @property
    def pending_run_id(self) -> str | None:
        """Before :meth:`start`, the run it will log into: the one :meth:`resume` asked for, or the
        one given (a spill written before the backend answered names it, so that its replay goes
        there and not to a new run)."""
        return None

    def replaying(self) -> None:
        """This tracker delivers a spill (:func:`~hdet_track.tracking.spill.replay_file`): its run is
        the spill's (:meth:`resume`) or a new one, never one the environment of the replaying
        process names (``$MLFLOW_RUN_ID``, ``$WANDB_RUN_ID``: that process's own job's run)."""

    def spill_dir(self) -> Path:
        """Where this tracker's undelivered batches wait (see :mod:`hdet_track.tracking.spill`)."""
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return home / "hdet-track" / "spill" / (self.name or type(self).__name__)

    def spill_settings(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this tracker in another process, to deliver its spill."""
        return {}


_RUNS = threading.Condition()
RUN_WAIT_SECONDS = 30.0  # how long a new run waits for an ending run of the same tracker object


def shared_tracker_message(tracker: Tracker) -> str:
    cls, name = type(tracker).__name__, tracker.name or "mlflow"
    return (
        f"Expected track to be a tracker object that no other open run uses, but this {cls} object is "
        f"still logging the run of another scheduler that has not ended: one tracker object logs one run "
        f"at a time. Pass a new tracker object to each scheduler ({cls}(...)), or track=True / "
        f"track={name!r} (a new run each), or end the other scheduler's run first (sched.close() or its "
        f"with block)"
    )


def _open_elsewhere(tracker: Tracker) -> bool:
    """Whether a scheduler of this process whose run is still open (not ended, and not about to be
    ended by the next run's start, see :mod:`.lifecycle`) logs to this very object."""
    from . import lifecycle

    for recorder in lifecycle.registered():
        hub = recorder.hub
        if hub is None or hub.ended or not any(t is tracker for t in hub.trackers):
            continue
        if recorder.finished_open():
            continue  # it reached its last step: the next run's start ends it FINISHED
        return True
    return False


def _check_not_shared(trackers: list[Tracker]) -> list[Tracker]:
    """A scheduler's trackers: each object once, and none that another open run logs to."""
    for i, t in enumerate(trackers):
        if any(t is u for u in trackers[:i]):
            raise ValueError(
                f"Expected track to list each tracker object once, but got the same {type(t).__name__} "
                f"object twice; pass a new object for each run you want"
            )
        if _open_elsewhere(t):
            raise ValueError(shared_tracker_message(t))
    return trackers


# Built-in backends by name, imported only when asked for (no registration by import side effect).
TRACKERS: dict[str, str] = {
    "mlflow": "hdet_track.tracking.mlflow:MLflowTracker",
    "wandb": "hdet_track.tracking.wandb:WandbTracker",
}


def get_tracker_class(name: str) -> type[Tracker]:
    """The class behind ``track=name`` (a key of :data:`TRACKERS`)."""
    if name not in TRACKERS:
        raise ValueError(f"Expected a tracker name in {sorted(TRACKERS)}, but got {name!r}")
    module, _, cls = TRACKERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def resolve_trackers(track: Any) -> list[Tracker]:
    """``track=`` of the scheduler: True (``$HDET_TRACKER``, default mlflow), a name, a Tracker, or a list."""
    if track is False or track is None:
        return []
    if track is True:
        name = os.environ.get("HDET_TRACKER", "mlflow").strip().lower() or "mlflow"
        if name not in TRACKERS:
            raise ValueError(f"Expected HDET_TRACKER to be one of {sorted(TRACKERS)}, but got {name!r}")
        return [get_tracker_class(name)()]
    if isinstance(track, str):
        return [get_tracker_class(track)()]
    if isinstance(track, Tracker):
        return _check_not_shared([track])
    if isinstance(track, (list, tuple)) and track:
        out: list[Tracker] = []
        for item in track:
            out.extend(resolve_trackers(item))
        return _check_not_shared(out)
    raise ValueError(
        f"Expected track to be True, False, 'mlflow', 'wandb', a hdet_track.tracking.Tracker or a list of "
        f"them, but got {track!r}"
    )


_SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|APIKEY|CREDENTIAL|PRIVATE_KEY)", re.IGNORECASE)


def is_secret(key: str) -> bool:
    """Whether a config/environment key looks like it holds a secret (never logged)."""
    return bool(_SECRET.search(key))


_NOT_SECRETS = {"true", "false", "yes", "no", "none", "null", "on", "off"}


def _secrets() -> set[str]:
    """The values of this process's secret-looking environment variables: 4 characters or more,
    not a number or a flag (``TOKENIZERS_PARALLELISM=false``, ``MAX_TOKENS=4096`` hold no secret)."""
    return {
        v
        for k, v in os.environ.items()
        if is_secret(k) and len(v) >= 4 and v.lower() not in _NOT_SECRETS and not _is_number(v)
    }


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _strings(value: Any) -> list[str]:
    """Every string inside ``value`` (itself, or inside its lists, tuples and dicts)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def redact(config: dict[str, Any]) -> dict[str, Any]:
    """Drop secret-looking keys and any value holding a secret environment variable's value (also
    inside a list or dict: the param-group names)."""
    secrets = _secrets()
    out = {}
    for k, v in config.items():
        if is_secret(k) or any(s in text for text in _strings(v) for s in secrets):
            continue
        out[k] = v
    return out


# a URL's password (``http://user:PASSWORD@host``) and its query's credentials (``?token=...``)
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/]*:)[^\s@/]+@")
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:access_token|token|api_key|apikey|key|password|passwd|secret|sig|signature)=)[^&\s#]+",
    re.IGNORECASE,
)


def mask_secrets(text: str | None) -> str | None:
    """``text`` (a run's name, group, tag, an error message) with every secret environment
    variable's value, a URL's password and a URL's credential parameters replaced by ``***``: kept,
    since runs are found by it, but never with the secret."""
    if not text:
        return text
    for secret in sorted(_secrets(), key=len, reverse=True):
        text = text.replace(secret, "***")
    text = _URL_PASSWORD.sub(r"\g<head>***@", text)
    return _QUERY_SECRET.sub(r"\g<head>***", text)

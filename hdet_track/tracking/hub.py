"""The tracking hub: rank 0's queue and background writer between the scheduler and the trackers.

The training thread only appends to a deque: the run's start, one :class:`~hdet_track.record.SyncRecord`
per sync (compact numpy arrays), user metrics, the end. A writer thread hands them to each tracker:
expanded into metric points, events and archive rows (:mod:`hdet_track.tracking.expand`), or as they
are to a tracker that runs in its own process (it expands them there, off the training process's GIL).
A tracker that raises is considered down: its batches go to a spill file (JSON lines) in order and
are replayed, oldest first, once a retry succeeds. Nothing raises into the training loop.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..events import RunEnd, RunStart, event_from_dict
from ..record import SyncRecord
from .archive import StepBlock
from .base import Batch, Point, Tracker
from .expand import PointBudget, RecordItem, expand, metric_points

__all__ = ["TrackingHub", "materialize"]

logger = logging.getLogger(__name__)


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


class _Sink:
    """One tracker, with its spill file and retry state."""

    def __init__(self, tracker: Tracker, spill_dir: Path, retry_seconds: float) -> None:
        self.tracker = tracker
        self.spill_path = spill_dir / f"spill-{type(tracker).__name__}-{id(tracker)}.jsonl"
        self.retry_seconds = retry_seconds
        self.down_since: float | None = None
        self.next_retry = 0.0
        self.spilled = 0

    def deliver(self, batch: Batch) -> None:
        if not getattr(self.tracker, "expands_records", False):
            batch = materialize(batch)
        if self.down_since is not None:
            if time.monotonic() < self.next_retry or not self._replay():
                self._spill(batch)
                return
        try:
            self._send(batch)
        except Exception as exc:  # noqa: BLE001 - any backend failure means "down"
            self._went_down(exc)
            self._spill(batch)

    def _send(self, batch: Batch) -> None:
        for ev in batch.events:
            if isinstance(ev, RunStart):
                self.tracker.start(ev)
        ends = [ev for ev in batch.events if isinstance(ev, RunEnd)]
        if batch.points or batch.steps or batch.records or len(ends) < len(batch.events):
            self.tracker.log(batch)
        for ev in ends:
            self.tracker.finish(ev)

    def _went_down(self, exc: BaseException) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            logger.warning(
                "hdet-track: %s is unavailable (%s: %s); buffering to %s and retrying",
                type(self.tracker).__name__,
                type(exc).__name__,
                exc,
                self.spill_path,
            )
        self.next_retry = time.monotonic() + self.retry_seconds

    def _spill(self, batch: Batch) -> None:
        batch = materialize(batch)
        record = {
            "events": [e.to_dict() for e in batch.events],
            "points": [list(p) for p in batch.points],
            "steps": [b.to_json() for b in batch.steps],
        }
        with open(self.spill_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.spilled += 1

    def _replay(self) -> bool:
        """Send the spilled batches in order; keep the unsent ones. True when all went through."""
        if not self.spill_path.exists():
            self.down_since = None
            return True
        lines = self.spill_path.read_text().splitlines()
        for i, line in enumerate(lines):
            data = json.loads(line)
            batch = Batch(
                points=[Point(str(k), float(v), int(s), int(t)) for k, v, s, t in data["points"]],
                events=[event_from_dict(e) for e in data["events"]],
                steps=[StepBlock.from_json(b) for b in data.get("steps", [])],
            )
            try:
                self._send(batch)
            except Exception as exc:  # noqa: BLE001
                self._went_down(exc)
                rest = lines[i:]
                tmp = self.spill_path.with_suffix(".tmp")
                tmp.write_text("".join(x + "\n" for x in rest))
                os.replace(tmp, self.spill_path)
                return False
        self.spill_path.unlink()
        logger.warning(
            "hdet-track: %s is back after %.1f s; replayed %d buffered batches",
            type(self.tracker).__name__,
            time.monotonic() - (self.down_since or time.monotonic()),
            len(lines),
        )
        self.down_since = None
        return True

    def drain(self, deadline: float) -> None:
        """At shutdown: retry the spill until it is empty or the deadline passes."""
        while self.down_since is not None and time.monotonic() < deadline:
            if self._replay():
                return
            time.sleep(min(self.retry_seconds, max(0.0, deadline - time.monotonic())))


def _isolated(tracker: Tracker) -> Tracker:
    if getattr(tracker, "isolate", False):
        from .isolated import IsolatedTracker

        return IsolatedTracker(tracker)
    return tracker


class TrackingHub:
    """Rank 0's background writer. Create with the trackers, then :meth:`start`."""

    _instances: weakref.WeakSet[TrackingHub] = weakref.WeakSet()

    def __init__(
        self,
        trackers: Sequence[Tracker],
        *,
        log_every: int = 1,
        spill_dir: str | os.PathLike | None = None,
        flush_seconds: float = 1.0,
        retry_seconds: float = 2.0,
        shutdown_timeout: float = 120.0,
    ) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"Expected log_every to be an integer >= 1, but got {log_every!r}")
        self.trackers = list(trackers)
        self.log_every = log_every
        self.flush_seconds = flush_seconds
        self.shutdown_timeout = shutdown_timeout
        self.spill_dir = Path(spill_dir) if spill_dir is not None else Path(tempfile.mkdtemp(prefix="hdet-spill-"))
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._sinks = [_Sink(_isolated(t), self.spill_dir, retry_seconds) for t in self.trackers]
        self._queue: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._budget: PointBudget | None = None
        self._window_start = time.time()
        self._ended = False
        self._failure: tuple[str, str] | None = None
        self._last_step = 0
        self.started = threading.Event()  # set once every tracker's start() returned (or failed)
        self._thread = threading.Thread(target=self._run, name="hdet-tracking-writer", daemon=True)
        self._thread.start()
        TrackingHub._instances.add(self)
        _install_process_hooks()

    # ------------------------------------------------------------------ training thread
    def start(self, run_start: RunStart) -> None:
        self._window_start = run_start.time or time.time()
        self._put("start", run_start)

    def record(self, record: SyncRecord, when: float | None = None) -> None:
        """One sync's record (``when``: its wall time, default now)."""
        self._put("record", (record, time.time() if when is None else when))

    def metrics(self, values: dict[str, float], step: int) -> None:
        """User metrics (e.g. validation loss) into the same run."""
        self._put("metrics", (dict(values), int(step), time.time()))

    def note_step(self, step: int) -> None:
        self._last_step = step

    def _put(self, kind: str, item: Any) -> None:
        if self._ended:
            logger.warning("hdet-track: the run has ended; dropping a late %s", kind)
            return
        self._queue.append((kind, item))
        if kind != "record" or len(self._queue) > 64:
            self._wake.set()

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Block until everything queued so far reached the trackers (or their spill files).

        After the run has ended, wait for the writer to finish delivering it."""
        if self._ended:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        self._queue.append(("flush", done))
        self._wake.set()
        return done.wait(timeout)

    def close(
        self, status: str = "FINISHED", error: str | None = None, step: int | None = None, wait: bool = True
    ) -> None:
        """End the run with ``status``; the writer stops once everything is written.

        With ``wait`` (the default) block until then; otherwise return at once (the process's
        exit, :meth:`flush` or a later ``close()`` waits)."""
        if self._ended:
            if wait:
                self._join()
            return
        if self._failure is not None and status == "FINISHED":
            status, error = self._failure
        end = RunEnd(status=status, step=self._last_step if step is None else step, error=error, time=time.time())
        self._put("end", end)
        self._ended = True
        self._wake.set()
        if wait:
            self._join()

    def _join(self) -> None:
        self._thread.join(self.shutdown_timeout + 5)
        if self._thread.is_alive():
            logger.warning("hdet-track: the tracking writer did not finish within %.0f s", self.shutdown_timeout)

    @property
    def ended(self) -> bool:
        return self._ended

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            try:
                finished = self._drain()
            except Exception:  # noqa: BLE001 - the writer must never take training down
                logger.warning("hdet-track: the tracking writer failed:\n%s", traceback.format_exc())
                finished = self._ended and not self._queue
            if finished:
                self.started.set()
                deadline = time.monotonic() + self.shutdown_timeout
                for sink in self._sinks:
                    sink.drain(deadline)
                    if sink.down_since is not None:
                        logger.warning(
                            "hdet-track: %s still unavailable at shutdown; its unsent data stays in %s",
                            type(sink.tracker).__name__,
                            sink.spill_path,
                        )
                return

    def _drain(self) -> bool:
        batch = Batch()
        flushes: list[threading.Event] = []
        end: RunEnd | None = None
        while self._queue:
            kind, item = self._queue.popleft()
            if kind == "start":
                self._budget = PointBudget(item.total_steps or 1, log_every=self.log_every)
                batch.events.append(item)
            elif kind == "record":
                record, when = item
                budget = self._budget or PointBudget(record.step, log_every=self.log_every)
                mean_stride, replica_stride = budget.strides(record, when - self._window_start)
                item = RecordItem(record, self._window_start, when, mean_stride, replica_stride, budget.total_steps)
                batch.records.append(item)
                self._window_start = when
            elif kind == "metrics":
                values, step, when = item
                batch.points.extend(metric_points(values, step, when))
            elif kind == "flush":
                flushes.append(item)
            elif kind == "end":
                end = item
        if batch:
            for sink in self._sinks:
                sink.deliver(batch)
        if not self.started.is_set() and self._sinks and all(s.tracker.run_id or s.down_since for s in self._sinks):
            self.started.set()
        if end is not None:
            for sink in self._sinks:
                sink.deliver(Batch(events=[end]))
        elif flushes:
            for sink in self._sinks:
                if sink.down_since is None:
                    try:
                        getattr(sink.tracker, "flush", lambda: None)()
                    except Exception as exc:  # noqa: BLE001
                        sink._went_down(exc)
        for done in flushes:
            done.set()
        return end is not None


# ---------------------------------------------------------------------- process hooks
_HOOKS_INSTALLED = False


def _close_all(status: str, error: str | None) -> None:
    for hub in list(TrackingHub._instances):
        hub.close(status, error)  # ends open runs, waits for ended ones to be written


def _record_failure(status: str, error: str) -> None:
    for hub in list(TrackingHub._instances):
        hub._failure = (status, error)


def _install_process_hooks() -> None:
    """atexit ends open runs; an uncaught exception marks them FAILED (KILLED for Ctrl-C);
    SIGTERM marks them KILLED before the process dies as it would have."""
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_close_all, "FINISHED", None)
    # Processes started by multiprocessing (mp.spawn, torchrun's workers) leave through
    # os._exit after their target returns: atexit never runs there, its finalizers do.
    from multiprocessing import util as mp_util

    mp_util.Finalize(None, _close_all, args=("FINISHED", None), exitpriority=100)
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        killed = issubclass(exc_type, KeyboardInterrupt)
        text = "".join(traceback.format_exception(exc_type, exc, tb))[-4000:]
        _record_failure("KILLED" if killed else "FAILED", text)
        previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except (ValueError, OSError):  # pragma: no cover
            return
        if previous in (signal.SIG_DFL, None):

            def on_sigterm(signum, frame):  # type: ignore[no-untyped-def]
                _close_all("KILLED", "terminated by SIGTERM")
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

            signal.signal(signal.SIGTERM, on_sigterm)

"""The tracking hub: rank 0's queue and background writer between the scheduler and the trackers.

The training thread only appends to a deque: the run's start, one :class:`~hdet_track.record.SyncRecord`
per sync (compact numpy arrays), user metrics, the end. A writer thread hands them to each tracker:
expanded into metric points, events and archive rows (:mod:`hdet_track.tracking.expand`), or as they
are to a tracker that runs in its own process (it expands them there, off the training process's GIL).
A tracker that raises is considered down: its batches go to a spill file (JSON lines) in order and
are replayed, oldest first, once a retry succeeds. A batch the backend refuses for its content
(``Tracker.refuses``) goes in parts instead, and what is refused again is set aside in a
``refused-*.jsonl`` file with a warning (:func:`~hdet_track.tracking.spill.log_or_set_aside`): the
rest of the run goes on. Nothing raises into the training loop.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .. import owner
from ..events import RunEnd, RunStart
from ..record import SyncRecord
from . import lifecycle
from .base import Batch, Tracker, broken_backend, mask_secrets
from .expand import PointBudget, RecordItem, materialize, metric_points
from .isolated import maybe_isolated
from .spill import (
    KEEP_ALIVE_SECONDS,
    SpillFile,
    attempt_starts,
    describe_part,
    log_or_set_aside,
    orphans,
    pending_orphans,
    refused_path,
    replay_file,
    take_over,
    upload_pending_folder,
)
from .spill import header as spill_header

__all__ = ["TrackingHub"]

logger = logging.getLogger(__name__)
_REFUSALS_TOLD = 5  # refused parts warned about one by one (a bad metric logged every step is one story)


class _Sink:
    """One tracker, with its spill file and retry state."""

    def __init__(self, tracker: Tracker, spill_dir: Path | None, retry_seconds: float) -> None:
        self.label = type(tracker).__name__  # for messages: the backend, not a process wrapper around it
        tracker = self.tracker = maybe_isolated(tracker)
        directory = spill_dir if spill_dir is not None else tracker.spill_dir()
        # one file per sink: not id(tracker), which a later run's tracker (or the same object, run
        # again) has too, and whose batches then went under the earlier run's header
        name = f"spill-{tracker.name or type(tracker).__name__}-{os.getpid()}-{uuid.uuid4().hex[:12]}.jsonl"
        self.spill = SpillFile(directory / name, {})
        self.refused = SpillFile(refused_path(self.spill.path), {})
        self.set_aside = 0  # parts the backend refused for their content
        self.retry_seconds = retry_seconds
        self.down_since: float | None = None
        self.broken = False  # its library cannot be used in this process: no waiting for it at shutdown
        self.next_retry = 0.0
        self.failures = 0  # retries in a row that failed: the next waits longer (up to 4x retry_seconds)
        self.spilled = 0
        self.run_start: RunStart | None = None

    @property
    def spill_path(self) -> Path:
        return self.spill.path

    def deliver(self, batch: Batch) -> None:
        if not getattr(self.tracker, "expands_records", False):
            batch = materialize(batch)
        if self.down_since is not None:
            if time.monotonic() < self.next_retry or not self.retry():
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
                self.run_start = ev
                self._upload_pending()  # before the start: a resumed run numbers its chunks after them
                self.tracker.start(ev)
                self._deliver_orphans()
        ends = [ev for ev in batch.events if isinstance(ev, RunEnd)]
        if batch.points or batch.steps or batch.records or len(ends) < len(batch.events):
            log_or_set_aside(self.tracker, batch, self._set_aside)
        for ev in ends:
            self.tracker.finish(ev)

    def _set_aside(self, part: Batch, exc: BaseException) -> None:
        """A part the backend refused for its content: kept in the refused file, not retried."""
        part = materialize(part)
        self.refused.header = spill_header(self.tracker, self.run_start)
        self.refused.append(part)
        self.set_aside += 1
        if self.set_aside <= _REFUSALS_TOLD:
            logger.warning(
                "hdet-track: %s refused %s for its content (%s); set aside in %s (not retried), the rest of the run goes on%s",
                self.label,
                describe_part(part),
                mask_secrets(str(exc)),
                self.refused.path,
                "; further refused parts go there without a warning" if self.set_aside == _REFUSALS_TOLD else "",
            )

    def _upload_pending(self) -> None:
        """Archive chunks that an earlier process on this store could not upload go to their runs."""
        try:
            where = Path(self.tracker.spill_dir())
        except Exception:  # noqa: BLE001 - a tracker without a store of its own
            return
        for folder in pending_orphans(where):
            line = upload_pending_folder(folder)
            if line.endswith("; kept"):
                return  # the backend is not there yet: the start will say so
            logger.warning("hdet-track: %s", line)

    def _deliver_orphans(self) -> None:
        """The backend works: deliver what earlier processes left undelivered in the same place. An
        earlier attempt's spill of the run this job resumes goes into the run through this tracker,
        up to the checkpoint's step (replayed apart, it ended the run FAILED while this job trained
        and put the steps this job redoes in twice)."""
        run_id = self.tracker.run_id
        upto = self.run_start.start_step if self.run_start is not None else 0
        job = self.run_start.job if self.run_start is not None else ""
        paths = list(orphans(self.spill.path.parent))
        starts = attempt_starts(paths, run_id, job) if run_id and upto > 0 else {}
        later = sorted(set(starts.values())) + [upto]
        for path in paths:  # each earlier attempt's steps up to where the next attempt resumed
            cut = min((s for s in later if s > starts[path]), default=upto) if path in starts else upto
            line = take_over(path, run_id, min(cut, upto), self._log_taken_over, job) if run_id and upto > 0 else None
            logger.warning("hdet-track: %s", line or replay_file(path))

    def _log_taken_over(self, part: Batch) -> None:
        log_or_set_aside(self.tracker, part, self._set_aside)

    def _went_down(self, exc: BaseException) -> None:
        self.broken = broken_backend(exc)
        if self.down_since is None:
            self.down_since = time.monotonic()
            logger.warning(
                "hdet-track: %s is unavailable (%s: %s); buffering to %s and retrying",
                self.label,
                type(exc).__name__,
                mask_secrets(str(exc)),  # a server's error may quote its URL, token and all
                self.spill.path,
            )
        self.failures += 1
        self.next_retry = time.monotonic() + self.retry_seconds * min(2 ** (self.failures - 1), 4)

    def keep_alive(self) -> None:
        """This writer lives: its spill (while the backend is down) and the tracker's pending files
        are touched, so that no other host takes them for a gone writer's (see
        :data:`~hdet_track.tracking.spill.STALE_SECONDS`)."""
        try:
            if self.down_since is not None and self.spill.path.exists():
                os.utime(self.spill.path)
            self.tracker.keep_alive()
        except Exception:  # noqa: BLE001 - a tracker process gone, a file removed: nothing to keep
            pass

    def _spill(self, batch: Batch) -> None:
        self.spill.header = spill_header(self.tracker, self.run_start)
        try:
            self.spill.append(materialize(batch))
        except OSError as exc:  # a full disk: this batch cannot be kept; the flushes and the run's end still go on
            logger.error(
                "hdet-track: %s is down and its spill %s cannot be written (%s): a batch is lost",
                self.label,
                self.spill.path,
                exc,
            )
            return
        self.spilled += 1

    def retry(self) -> bool:
        """Replay the spill (:meth:`_replay`); a failure of the spill file itself (unreadable, not
        removable) is logged and counts as not replayed, so that the batch at hand is spilled, not lost."""
        try:
            return self._replay()
        except Exception as exc:  # noqa: BLE001 - the backend's own failures are handled inside
            logger.error("hdet-track: the spill %s could not be replayed:\n%s", self.spill.path, traceback.format_exc())
            self._went_down(exc)  # the next try waits its turn, as after an outage
            return False

    def _replay(self) -> bool:
        """Send the spilled batches in order; keep the unsent ones. True when all went through."""
        if not self.spill.path.exists():
            self.down_since, self.failures = None, 0
            return True
        sent = replayed = 0
        probe = self.spill.first()  # the first batch alone: a backend still down costs one line, not the file
        if probe is not None:
            head, first = probe
            try:
                self._send(first)
            except Exception as exc:  # noqa: BLE001
                self._went_down(exc)
                if json.dumps(spill_header(self.tracker, self.run_start)) != head:  # the run, if created since
                    self._keep_unsent(0)
                return False
            sent = replayed = 1
            # the run this send created goes into the file's header at once: a process killed later
            # in the replay leaves a spill that continues it (one that named no run made a second)
            if json.dumps(spill_header(self.tracker, self.run_start)) != head and self._keep_unsent(1, keep_empty=True):
                sent = 0
        batches = self.spill.batches()
        for i, batch in enumerate(batches[sent:], start=sent):
            try:
                self._send(batch)
            except Exception as exc:  # noqa: BLE001
                self._went_down(exc)
                self._keep_unsent(i)
                return False
            replayed += 1
        self.spill.path.unlink(missing_ok=True)
        logger.warning(
            "hdet-track: %s is back after %.1f s; replayed %d buffered batches",
            self.label,
            time.monotonic() - (self.down_since or time.monotonic()),
            replayed,
        )
        self.down_since, self.failures = None, 0
        return True

    def _keep_unsent(self, index: int, keep_empty: bool = False) -> bool:
        """The spill without its first ``index`` batches (sent), under the header naming the run as it
        stands now. False when the file cannot be rewritten (a full disk): it stays as it is, and the
        batches sent go again at the next replay (the store keeps HDET's metric points once per step;
        events and user metrics may be written twice), rather than the writer thread dying and the
        run's end with it."""
        self.spill.header = spill_header(self.tracker, self.run_start)
        try:
            self.spill.keep_from(index, keep_empty=keep_empty)
        except OSError as exc:
            logger.error(
                "hdet-track: the spill %s cannot be rewritten (%s); the %d batch(es) already sent to %s stay in it",
                self.spill.path,
                exc,
                index,
                self.label,
            )
            return False
        return True

    def drain(self, deadline: float) -> None:
        """At shutdown: retry the spill until it is empty or the deadline passes (a backend whose
        library cannot be imported is tried once: it cannot come back in this process)."""
        while self.down_since is not None and time.monotonic() < deadline:
            if self.retry() or self.broken:
                return
            time.sleep(min(self.retry_seconds, max(0.0, deadline - time.monotonic())))


def default_shutdown_timeout() -> float:
    """Seconds the writer keeps retrying an unreachable backend when the run ends (then the spill
    stays on disk for the next process or ``hdet-track recover``): ``$HDET_TRACK_SHUTDOWN_TIMEOUT``,
    default 30."""
    text = os.environ.get("HDET_TRACK_SHUTDOWN_TIMEOUT", "30")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < math.inf:
        raise ValueError(
            f"Expected HDET_TRACK_SHUTDOWN_TIMEOUT to be a finite number of seconds >= 0, but got {text!r}"
        )
    return value


def check_environment() -> None:
    """The hub's settings from the environment, on every rank (only rank 0 runs a hub, and a bad
    value must not leave the other ranks waiting for it at their first collective)."""
    default_shutdown_timeout()
    default_points_per_second()
    owner.heartbeat_seconds()


def default_points_per_second() -> float | None:
    """``$HDET_POINTS_PER_SECOND``: the metric histories' budget (default 100: about 1% of a core
    in the backend; ``0`` or ``inf``: none)."""
    text = os.environ.get("HDET_POINTS_PER_SECOND", "").strip()
    if not text:
        return 100.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"Expected HDET_POINTS_PER_SECOND to be a number of points per second >= 0 (0 or inf: no budget), but got {text!r}"
        )
    return None if value == 0 or math.isinf(value) else value


class TrackingHub:
    """Rank 0's background writer. Create with the trackers, then :meth:`start`.

    The writer hands what is queued to the trackers every ``flush_seconds`` (default 3, the event
    archive's chunk interval: the dashboard's live view is no fresher than that) and at once for a
    run's start and end and for :meth:`flush`; each hand-over costs the backend a few ms whatever
    its size (MLflow: about 4 ms per ``log_batch`` plus 0.1 ms per point). While the run is open it
    also sends each working tracker a heartbeat every ``heartbeat_seconds`` (default
    ``$HDET_TRACK_HEARTBEAT_SECONDS``, 30; None: none), whatever the training loop is doing: a
    reader on another host tells a live run from one whose processes are gone by it
    (:mod:`hdet_track.owner`).
    """

    def __init__(
        self,
        trackers: Sequence[Tracker],
        *,
        log_every: int = 1,
        spill_dir: str | os.PathLike | None = None,
        flush_seconds: float = 3.0,
        retry_seconds: float = 2.0,
        shutdown_timeout: float | None = None,
        points_per_second: float | None | str = "env",
        heartbeat_seconds: float | None | str = "env",
    ) -> None:
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"Expected log_every to be an integer >= 1, but got {log_every!r}")
        self.trackers = list(trackers)
        self.log_every = log_every
        self.points_per_second = default_points_per_second() if points_per_second == "env" else points_per_second
        self._syncs = 0
        # per user metric, the last time (ms) given to one of its points: a later one gets a later
        # time, also within the same millisecond (MLflow orders a step's points by time, then by value)
        self._metric_ms: dict[str, int] = {}
        self.flush_seconds = flush_seconds
        self.heartbeat_seconds = owner.heartbeat_seconds() if heartbeat_seconds == "env" else heartbeat_seconds
        if self.heartbeat_seconds is not None and not self.heartbeat_seconds > 0:
            raise ValueError(f"Expected heartbeat_seconds to be > 0 or None, but got {self.heartbeat_seconds!r}")
        self._next_beat = math.inf  # monotonic time of the next heartbeat: the first follows the run's start
        self._next_touch = time.monotonic() + KEEP_ALIVE_SECONDS  # of the spills and pending chunks
        self._identity = owner.process_identity()  # the sender of every heartbeat: this (training) process
        self.shutdown_timeout = default_shutdown_timeout() if shutdown_timeout is None else shutdown_timeout
        directory = Path(spill_dir) if spill_dir is not None else None
        self._sinks = [_Sink(t, directory, retry_seconds) for t in self.trackers]
        self._queue: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._budget: PointBudget | None = None
        self._window_start = time.time()
        self._ended = False
        self._last_step = 0
        self.total_steps = 0
        self.started = threading.Event()  # set once every tracker's start() returned (or failed)
        self._thread = threading.Thread(target=self._run, name="hdet-tracking-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread
    def start(self, run_start: RunStart) -> None:
        self.total_steps = run_start.total_steps
        self._last_step = max(self._last_step, run_start.start_step)  # a resumed job starts there
        self._window_start = run_start.time or time.time()
        self._put("start", run_start)

    def record(self, record: SyncRecord, when: float | None = None) -> None:
        """One sync's record (``when``: its wall time, default now)."""
        self._put("record", (record, time.time() if when is None else when))

    def metrics(self, values: dict[str, float], step: int) -> None:
        """User metrics (e.g. validation loss) into the same run (checked by the caller:
        :func:`hdet_track.reporting.checked_metrics`; a tensor is read in the writer thread)."""
        self._put("metrics", (dict(values), int(step), time.time()))

    def note_step(self, step: int) -> None:
        self._last_step = step

    def _put(self, kind: str, item: Any) -> None:
        if self._ended:
            what = f"metrics {sorted(item[0])} at step {item[1]}" if kind == "metrics" else f"{kind} event"
            logger.warning(
                "hdet-track: the run has already ended (close(), close_at_end=True, or another tracked run "
                "started in this process); dropping late %s",
                what,
            )
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
        self,
        status: str = "FINISHED",
        error: str | None = None,
        step: int | None = None,
        wait: bool = True,
        timeout: float | None = None,
    ) -> None:
        """End the run with ``status``; the writer stops once everything is written.

        With ``wait`` (the default) block until then (at most ``timeout``, default
        ``shutdown_timeout``); otherwise return at once (the process's exit, :meth:`flush` or a later
        ``close()`` waits)."""
        if not self._ended:
            # an exception's text can quote a secret (a URL with its token): kept, but never with the secret
            error = mask_secrets(error)
            end = RunEnd(status=status, step=self._last_step if step is None else step, error=error, time=time.time())
            self._put("end", end)
            self._ended = True
            self._wake.set()
        if wait:
            self._join(self.shutdown_timeout if timeout is None else timeout)

    @property
    def reached_end(self) -> bool:
        """Whether the job has reached ``total_steps``."""
        return self.total_steps > 0 and self._last_step >= self.total_steps

    def end_with_process(self, reason: str) -> str:
        """The process is ending (``reason``: "exit" or a signal's name): end the run by what the job
        did (see :mod:`hdet_track.tracking.lifecycle`), give the writer a bounded time, and return
        the status it ended with."""
        status, error = lifecycle.exit_status(self.reached_end, self._last_step, self.total_steps)
        # torchrun kills 30 s after its SIGTERM: leave time to hand everything to the backend
        self.close(status, error, timeout=20.0 if reason != "exit" else None)
        return status

    def _join(self, timeout: float) -> None:
        self._thread.join(timeout + 5)
        if self._thread.is_alive():
            logger.warning("hdet-track: the tracking writer did not finish within %.0f s", timeout)

    @property
    def ended(self) -> bool:
        return self._ended

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        next_drain = time.monotonic() + self.flush_seconds
        while True:
            due = next_drain if self.heartbeat_seconds is None else min(next_drain, self._next_beat)
            woken = self._wake.wait(max(0.0, due - time.monotonic()))
            finished = False
            if woken or time.monotonic() >= next_drain:
                self._wake.clear()
                try:
                    finished = self._drain()
                except Exception:  # noqa: BLE001 - the writer must never take training down
                    logger.warning("hdet-track: the tracking writer failed:\n%s", traceback.format_exc())
                    finished = self._ended and not self._queue
                next_drain = time.monotonic() + self.flush_seconds
            if not finished and self.heartbeat_seconds is not None and time.monotonic() >= self._next_beat:
                self._guarded(self._beat)
            if not finished and time.monotonic() >= self._next_touch:
                for sink in self._sinks:
                    sink.keep_alive()
                self._next_touch = time.monotonic() + KEEP_ALIVE_SECONDS
            if finished:
                self.started.set()
                deadline = time.monotonic() + self.shutdown_timeout
                for sink in self._sinks:
                    self._guarded(partial(sink.drain, deadline))
                    if sink.down_since is not None:
                        logger.warning(
                            "hdet-track: %s still unavailable at shutdown; its unsent data stays in %s",
                            sink.label,
                            sink.spill_path,
                        )
                return

    @staticmethod
    def _guarded(work: Callable[[], object]) -> None:
        """``work`` in the writer thread: an error is a warning, never the thread's end (which would
        leave every later batch, and the run's end, undelivered and unspilled)."""
        try:
            work()
        except Exception:  # noqa: BLE001 - the writer must never take training down
            logger.warning("hdet-track: the tracking writer failed:\n%s", traceback.format_exc())

    def _beat(self) -> None:
        """A heartbeat to each tracker whose run is open and whose backend answers. A backend that
        is down is retried first when its retry is due (its spill replayed: a quiet run need not
        wait for its next batch) and gets none until it answers (a heartbeat is never spilled); one
        whose heartbeat fails is down, as for any batch."""
        assert self.heartbeat_seconds is not None
        self._next_beat = time.monotonic() + self.heartbeat_seconds  # first: a beat that fails waits its turn too
        if not self._ended:
            beat = owner.heartbeat(self.heartbeat_seconds, identity=self._identity)
            for sink in self._sinks:
                if sink.down_since is not None and (time.monotonic() < sink.next_retry or not sink.retry()):
                    continue
                if sink.tracker.run_id is not None:
                    try:
                        sink.tracker.heartbeat(beat)
                    except Exception as exc:  # noqa: BLE001 - any backend failure means "down"
                        sink._went_down(exc)

    def _make_budget(self, total_steps: int, start: RunStart | None = None) -> PointBudget:
        sync_every = int((start.config if start is not None else {}).get("sync_every", 1) or 1)
        return PointBudget(
            total_steps, points_per_second=self.points_per_second, log_every=self.log_every, sync_every=sync_every
        )

    def _drain(self) -> bool:
        batch = Batch()
        flushes: list[threading.Event] = []
        end: RunEnd | None = None
        while self._queue:
            kind, item = self._queue.popleft()
            if kind == "start":
                self._budget = self._make_budget(item.total_steps or 1, item)
                batch.events.append(item)
            elif kind == "record":
                record, when = item
                budget = self._budget or self._make_budget(record.step)
                strides = budget.strides(record, when - self._window_start)
                # A backoff or rollback is always in the histories; left-out replicas only at the
                # budget's syncs (where losses sit near zero the guard can leave one out at every
                # sync; the event archive keeps every one).
                eventful = bool(record.guard or record.rolled_back)
                last = record.step >= budget.total_steps
                item = RecordItem(
                    record,
                    self._window_start,
                    when,
                    strides.mean,
                    strides.replica,
                    budget.total_steps,
                    sync_points=self._syncs % strides.sync == 0 or eventful or last,
                )
                self._syncs += 1
                batch.records.append(item)
                self._window_start = when
            elif kind == "metrics":
                values, step, when = item
                try:
                    points = metric_points(values, step, when)
                except (TypeError, ValueError, RuntimeError) as exc:  # what the caller's check let through
                    logger.warning("hdet-track: dropping metrics %s at step %d: %s", sorted(values), step, exc)
                else:
                    for point in points:
                        ms = self._metric_ms[point.key] = max(
                            point.timestamp_ms, self._metric_ms.get(point.key, -1) + 1
                        )
                        batch.points.append(point._replace(timestamp_ms=ms))
            elif kind == "flush":
                flushes.append(item)
            elif kind == "end":
                end = item
        if batch:
            for sink in self._sinks:
                sink.deliver(batch)
            if self.heartbeat_seconds is not None and any(isinstance(e, RunStart) for e in batch.events):
                self._beat()  # the first, with the run's start (before a flush() waiting on it returns)
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

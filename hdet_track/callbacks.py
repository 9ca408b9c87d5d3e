"""The scheduler's callbacks: user callbacks in the order given, then tracking's
:class:`~hdet_track.tracking.recorder.Recorder` when the job is tracked. :class:`CallbackList`
hands every event to each of them and owns the tracking link (the scheduler never talks to a
tracker itself)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ._checks import check_bool, check_int, check_str
from .record import RunInfo, SchedulerCallback, SyncRecord

__all__ = ["CallbackList", "resolve_track", "check_track_settings"]


def resolve_track(track: Any) -> list:
    """``track=`` as tracker objects ([] when untracked); raises ValueError for a bad value before
    anything is built (checked by the scheduler before it touches the optimizer)."""
    if track is False or track is None:
        return []
    from .tracking.base import resolve_trackers

    return resolve_trackers(track)


def check_track_settings(log_every: Any, compare_group: Any, run_name: Any, close_at_end: Any) -> None:
    """The tracking settings of :meth:`CallbackList.track` (``""``: no compare group, the backend's
    own run name)."""
    check_int("log_every", log_every, 1)
    check_bool("close_at_end", close_at_end)
    check_str("compare_group", compare_group, empty=True)
    check_str("run_name", run_name, empty=True)


class CallbackList:
    """The callbacks of one scheduler, and its recorder once :meth:`track` is called."""

    def __init__(self, callbacks: Iterable[SchedulerCallback] = ()) -> None:
        self._items: list[SchedulerCallback] = list(callbacks)
        self.recorder: Any = None  # a tracking.recorder.Recorder

    def __iter__(self) -> Iterator[SchedulerCallback]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, callback: SchedulerCallback) -> None:
        self._items.append(callback)

    def track(
        self,
        track: Any,
        *,
        rank: int,
        info: Callable[[], RunInfo],
        pending: Callable[[], SyncRecord | None],
        log_every: int = 1,
        compare_group: str | None = None,
        run_name: str | None = None,
        close_at_end: bool = False,
    ) -> None:
        """Log the job to ``track`` (on every rank; rank 0 owns the run). ``info`` describes the job if
        it ends before its first step; ``pending`` gives the last sync's record if it ends while that
        record's divergences are still being gathered."""
        from .tracking.recorder import Recorder

        if self.recorder is not None:
            raise ValueError("Expected a scheduler that is not tracked yet, but it already is")
        check_track_settings(log_every, compare_group, run_name, close_at_end)
        self.recorder = Recorder(
            track,
            rank=rank,
            log_every=log_every,
            compare_group=compare_group,
            run_name=run_name,
            close_at_end=close_at_end,
        )
        self.recorder.attach_info(info, pending)
        self._items.append(self.recorder)

    # ------------------------------------------------------------------ events, to every callback
    def on_start(self, info: Callable[[], RunInfo]) -> None:
        """``info`` is called only when there is a callback to tell (it may be a collective: every
        rank has the same callbacks)."""
        if self._items:
            run = info()
            for cb in self._items:
                cb.on_start(run)

    def on_sync(self, record: SyncRecord) -> None:
        for cb in self._items:
            cb.on_sync(record)

    def on_step(self, step: int) -> None:
        for cb in self._items:
            cb.on_step(step)

    def on_close(self, status: str, error: str | None, step: int) -> None:
        for cb in self._items:
            cb.on_close(status, error, step)

    # ------------------------------------------------------------------ tracking (no-ops when untracked)
    def run_ids(self, wait: float = 0.0) -> dict[str, str | None]:
        return {} if self.recorder is None else self.recorder.run_ids(wait=wait)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.recorder is not None:
            self.recorder.log_metrics(metrics, step)

    def flush(self, timeout: float | None) -> bool:
        return True if self.recorder is None else self.recorder.flush(timeout)

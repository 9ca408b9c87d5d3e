"""The Tracker protocol, the batch it receives, and the static name -> class map of the backends."""

from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

from ..events import Event, RunEnd, RunStart
from .archive import StepBlock

__all__ = ["Point", "Batch", "Tracker", "get_tracker_class", "resolve_trackers", "is_secret", "TRACKERS"]


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


class Tracker:
    """Base class of a tracking backend (one run per job; rank 0 only).

    Subclasses implement :meth:`start`, :meth:`log` and :meth:`finish`; the hub calls them
    from its writer thread, never from the training thread, and treats any exception as the
    backend being unavailable (the batch is spilled to disk and replayed later).
    """

    name: ClassVar[str] = ""
    main_process_only: ClassVar[bool] = True

    def start(self, run_start: RunStart) -> None:
        """Create (or attach to) the run. Called again after a failure: must be idempotent."""
        raise NotImplementedError

    def log(self, batch: Batch) -> None:
        """Write a batch of metric points and archive its events."""
        raise NotImplementedError

    def finish(self, run_end: RunEnd) -> None:
        """Flush what is archived and end the run with ``run_end.status``."""
        raise NotImplementedError

    @property
    def run_id(self) -> str | None:
        """The backend's id of the run, once started."""
        return None

    def resume(self, run_id: str) -> None:
        """Continue run ``run_id`` (a resumed job) instead of creating one, where the backend can.

        Called before :meth:`start`. A tracker that was given a run explicitly ignores it."""

    def spill_dir(self) -> Path:
        """Where this tracker's undelivered batches wait (see :mod:`hdet_track.tracking.spill`)."""
        home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        return home / "hdet-track" / "spill" / (self.name or type(self).__name__)

    def spill_settings(self) -> dict[str, Any]:
        """Keyword arguments that rebuild this tracker in another process, to deliver its spill."""
        return {}


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
        return [track]
    if isinstance(track, (list, tuple)) and track:
        out: list[Tracker] = []
        for item in track:
            out.extend(resolve_trackers(item))
        return out
    raise ValueError(
        f"Expected track to be True, False, 'mlflow', 'wandb', a hdet_track.tracking.Tracker or a list of "
        f"them, but got {track!r}"
    )


_SECRET = re.compile(r"(TOKEN|SECRET|PASSWORD|API_KEY|APIKEY|CREDENTIAL|PRIVATE_KEY)", re.IGNORECASE)


def is_secret(key: str) -> bool:
    """Whether a config/environment key looks like it holds a secret (never logged)."""
    return bool(_SECRET.search(key))


def redact(config: dict[str, Any]) -> dict[str, Any]:
    """Drop secret-looking keys and any value equal to a secret environment variable."""
    secrets = {v for k, v in os.environ.items() if is_secret(k) and len(v) >= 4}
    out = {}
    for k, v in config.items():
        if is_secret(k) or (isinstance(v, str) and any(s in v for s in secrets)):
            continue
        out[k] = v
    return out

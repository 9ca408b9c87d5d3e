"""A tracker whose store is a JSON-lines file and that holds what it is given in memory until a
flush, with faults injected by marker files: for tests/test_isolated.py, which drives
:class:`~hdet_track.tracking.isolated.IsolatedTracker` through deaths of its child process. A module
of its own: the child unpickles the tracker, so its class must be importable by name."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from hdet_track.tracking.base import Batch, Tracker


class FileTracker(Tracker):
    """``store``: the file every start, written row and end goes to. ``faults``: a folder where a file
    ``start`` fails the next start and ``log-S`` the next log holding step S (each once)."""

    name = "filetracker"
    isolate = True

    def __init__(self, store: str, faults: str) -> None:
        self.store, self.faults = store, faults
        self._run: str | None = None
        self._reopen: str | None = None
        self._rows: list[int] = []

    @property
    def run_id(self) -> str | None:
        return self._run

    def carry_on(self, run_id: str, continuation: dict[str, Any] | None = None) -> None:
        self._reopen = run_id

    def __getstate__(self) -> dict[str, Any]:
        # as MLflowTracker's: a child gets the settings (and a request), never a run's state
        return self.__dict__ | {"_run": None, "_rows": []}

    def _adopt_run_id(self, run_id: str) -> None:
        """As MLflowTracker's: the caller's object names the child's run; a request is used up."""
        self._run, self._reopen = run_id, None

    def _fault(self, name: str) -> None:
        marker = Path(self.faults) / name
        if marker.exists():
            marker.unlink()
            raise RuntimeError(f"injected: {name}")

    def _write(self, line: dict[str, Any]) -> None:
        with open(self.store, "a") as f:
            f.write(json.dumps(line) + "\n")

    def start(self, run_start: Any) -> None:
        if self._run is not None:
            return  # a retry of a start that went through
        self._fault("start")
        self._run = self._reopen or uuid.uuid4().hex[:8]
        self._write({"start": self._run, "reopened": self._reopen is not None})

    def log(self, batch: Batch) -> None:
        for point in batch.points:
            self._fault(f"log-{point.step}")
        self._rows += [p.step for p in batch.points]

    def holds(self) -> bool:
        return bool(self._rows)

    def flush(self) -> None:
        for step in self._rows:
            self._write({"run": self._run, "row": step})
        self._rows = []

    def finish(self, run_end: Any) -> None:
        self.flush()
        self._write({"finish": self._run, "status": run_end.status})

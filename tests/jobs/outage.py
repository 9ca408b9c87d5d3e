"""A real MLflow tracker whose backend goes down on cue (ConnectionError, as a dead server gives),
for tests/test_spill_repair.py. Its state is class-level: ``replay_file`` builds its own tracker
from the spill's backend name, which the test maps to this class (``reset()`` between tests)."""

from __future__ import annotations

from typing import Any

from hdet_track.tracking.mlflow import MLflowTracker


class OutageMLflowTracker(MLflowTracker):
    """``down``: every call fails; ``logs_left``: the backend goes down after that many more
    ``log`` calls succeed (None: it stays up)."""

    isolate = False
    down = False
    logs_left: int | None = None

    @classmethod
    def reset(cls, down: bool = False, logs_left: int | None = None) -> None:
        cls.down, cls.logs_left = down, logs_left

    @classmethod
    def _check(cls) -> None:
        if cls.down:
            raise ConnectionError("the backend is down (injected)")

    def _start(self, run_start: Any) -> None:
        self._check()
        super()._start(run_start)

    def log(self, batch: Any) -> None:
        cls = type(self)
        self._check()
        if cls.logs_left is not None:
            if cls.logs_left == 0:
                cls.down = True
                raise ConnectionError("the backend went away (injected)")
            cls.logs_left -= 1
        super().log(batch)

    def finish(self, run_end: Any) -> None:
        self._check()
        super().finish(run_end)

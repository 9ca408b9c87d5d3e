"""A real MLflow tracker whose backend goes down on cue (ConnectionError, as a dead server gives),
for tests/test_spill_repair.py. Its state is class-level: ``replay_file`` builds its own tracker
from the spill's backend name, which the test maps to this class (``reset()`` between tests)."""

from __future__ import annotations

from typing import Any

from hdet_track.tracking.mlflow import MLflowTracker


class OutageMLflowTracker(MLflowTracker):
    """``down``: every call fails; ``uploads_down``: artifact uploads fail; ``logs_left``: the backend goes down after that many more
    ``log`` calls succeed (None: it stays up)."""

    isolate = False
    down = False
    uploads_down = False  # only artifact uploads fail (the server went away between two calls)
    logs_left: int | None = None

    @classmethod
    def reset(cls, down: bool = False, logs_left: int | None = None, uploads_down: bool = False) -> None:
        cls.down, cls.logs_left, cls.uploads_down = down, logs_left, uploads_down

    @classmethod
    def _check(cls) -> None:
        if cls.down:
            raise ConnectionError("the backend is down (injected)")

    def _start(self, run_start: Any) -> None:
        self._check()
        super()._start(run_start)
        real = self._client.log_artifact

        def log_artifact(*args: Any, **kwargs: Any) -> Any:
            self._check()
            if type(self).uploads_down:
                raise ConnectionError("the backend went away (injected)")
            return real(*args, **kwargs)

        self._client.log_artifact = log_artifact

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

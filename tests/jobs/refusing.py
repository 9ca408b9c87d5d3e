"""A real MLflow tracker with faults injected into its client, for tests/test_refused.py. A module
of its own: a tracker that runs in its own process is unpickled there, so its class must be
importable by name (the test puts the repository on PYTHONPATH)."""

from __future__ import annotations

from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from hdet_track.tracking.mlflow import MLflowTracker


class RefusingMLflowTracker(MLflowTracker):
    """Its client refuses, as MLflow refuses a value it will never take (``MlflowException``,
    ``INVALID_PARAMETER_VALUE``), any ``log_batch`` holding the metric ``refused``; the rest of the
    path is real. ``down``: the backend never answers (everything goes to the spill); ``fail_once``:
    the first ``log_batch`` holding that metric fails as in an outage (ConnectionError)."""

    down = False
    fail_once = ""

    def _start(self, run_start: Any) -> None:
        if self.down:
            raise ConnectionError("the backend is down (injected)")
        super()._start(run_start)
        real = self._client.log_batch

        def log_batch(run_id: str, metrics: Any = (), *args: Any, **kwargs: Any) -> Any:
            if any(m.key == "refused" for m in metrics):
                raise MlflowException("Invalid value for metric 'refused' (injected)", INVALID_PARAMETER_VALUE)
            if self.fail_once and any(m.key == self.fail_once for m in metrics):
                self.fail_once = ""
                raise ConnectionError("the backend went away (injected)")
            return real(run_id, metrics, *args, **kwargs)

        self._client.log_batch = log_batch


def refusing_tracker(
    uri: str, experiment: str, isolate: bool = True, down: bool = False, fail_once: str = ""
) -> RefusingMLflowTracker:
    """One, in its own process (``isolate``, the default for MLflow) or in this one."""
    tracker = RefusingMLflowTracker(tracking_uri=uri, experiment=experiment)
    tracker.isolate, tracker.down, tracker.fail_once = isolate, down, fail_once
    return tracker


class CarryOnFailsOnce(MLflowTracker):
    """A real MLflow tracker whose first carry-on (the start of a process that replaces one that
    died) fails as a backend outage does, while ``marker`` (a file) exists; it removes the file."""

    marker = ""

    def _start(self, run_start: Any) -> None:
        import os

        if self._carry_on is not None and self.marker and os.path.exists(self.marker):
            os.remove(self.marker)
            raise ConnectionError("the backend is down for the replacement's start (injected)")
        super()._start(run_start)

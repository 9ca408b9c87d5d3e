"""A new tracker per run, for the jobs here that make several runs in one process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def tracker_factory(backend: str, uri: str, name: str) -> Callable[[], Any]:
    """``backend`` "wandb" (offline, in directory ``uri``, project ``name``) or MLflow (tracking URI
    ``uri``, experiment ``name``)."""
    if backend == "wandb":
        from hdet_track.tracking.wandb import WandbTracker

        return lambda: WandbTracker(project=name, dir=uri, mode="offline")
    from hdet_track.tracking.mlflow import MLflowTracker

    return lambda: MLflowTracker(tracking_uri=uri, experiment=name)


def refusing_mlflow_tracker(
    uri: str, experiment: str, isolate: bool = True, down: bool = False, fail_once: str = ""
) -> Any:
    """A real MLflow tracker whose client refuses, as MLflow refuses a value it will never take
    (``MlflowException``, ``INVALID_PARAMETER_VALUE``), any ``log_batch`` holding the metric
    ``refused``: a fault injected into the client, the rest of the path real. With ``isolate`` it
    runs in its own process, as by default (this module must then be importable there); ``down``:
    its backend never answers (an outage injected: everything goes to the spill); ``fail_once``: the
    first ``log_batch`` holding that metric fails as in an outage (ConnectionError)."""
    tracker = __getattr__("RefusingMLflowTracker")(tracking_uri=uri, experiment=experiment)
    tracker.isolate = isolate
    tracker.down = down
    tracker.fail_once = fail_once
    return tracker


def _refusing_class() -> type:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

    from hdet_track.tracking.mlflow import MLflowTracker

    class RefusingMLflowTracker(MLflowTracker):
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

    RefusingMLflowTracker.__qualname__ = "RefusingMLflowTracker"
    RefusingMLflowTracker.__module__ = __name__
    return RefusingMLflowTracker


def __getattr__(name: str) -> Any:  # built on first use: importing this module needs no MLflow
    if name == "RefusingMLflowTracker":
        if name not in globals():
            globals()[name] = _refusing_class()
        return globals()[name]
    raise AttributeError(name)

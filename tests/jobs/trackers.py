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

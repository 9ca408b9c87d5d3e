"""Tracking: the recorder (a scheduler callback), the hub (rank 0, background writer) and the
MLflow / W&B backends.

Backends are imported only when asked for (``get_tracker_class``), so importing this package needs
neither MLflow nor W&B.
"""

from __future__ import annotations

from .base import TRACKERS, Batch, Point, Tracker, get_tracker_class, resolve_trackers
from .hub import TrackingHub
from .recorder import Recorder

__all__ = [
    "Tracker",
    "Batch",
    "Point",
    "TRACKERS",
    "get_tracker_class",
    "resolve_trackers",
    "TrackingHub",
    "Recorder",
    "MLflowTracker",
    "WandbTracker",
]


def __getattr__(name: str):
    if name in ("MLflowTracker", "WandbTracker"):
        return get_tracker_class("mlflow" if name == "MLflowTracker" else "wandb")
    raise AttributeError(name)

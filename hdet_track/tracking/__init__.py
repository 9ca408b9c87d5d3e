"""Tracking: the hub (rank 0, background writer) and the MLflow / W&B backends.

Backends are imported lazily (``get_tracker_class``), so importing this package needs neither
MLflow nor W&B.
"""

from __future__ import annotations

from .base import TRACKERS, Batch, Point, Tracker, get_tracker_class, register, resolve_trackers
from .hub import TrackingHub, WindowPayload

__all__ = [
    "Tracker",
    "Batch",
    "Point",
    "TRACKERS",
    "register",
    "get_tracker_class",
    "resolve_trackers",
    "TrackingHub",
    "WindowPayload",
]


def __getattr__(name: str):
    if name == "MLflowTracker":
        from .mlflow import MLflowTracker

        return MLflowTracker
    if name == "WandbTracker":
        from .wandb import WandbTracker

        return WandbTracker
    raise AttributeError(name)

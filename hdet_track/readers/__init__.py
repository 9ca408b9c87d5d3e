"""Readers: rebuild an :class:`HDETRun` from MLflow or W&B (no side channel from training).

``open_reader(source)`` picks the reader: a directory is a W&B folder, anything else an MLflow
tracking URI.
"""

from __future__ import annotations

import os
from pathlib import Path

from .base import HDETRun, ReaderError, RunNotFoundError, RunReader, RunSummary, StepTable

__all__ = [
    "HDETRun",
    "StepTable",
    "RunSummary",
    "RunReader",
    "ReaderError",
    "RunNotFoundError",
    "open_reader",
    "default_source",
]


def default_source() -> str:
    """``$HDET_DASHBOARD_SOURCE``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``."""
    return os.environ.get("HDET_DASHBOARD_SOURCE") or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


def open_reader(source: str | None = None) -> RunReader:
    """A reader for ``source``: a W&B directory (one holding ``wandb/`` or run folders) or an MLflow URI."""
    source = source or default_source()
    if "://" not in source and Path(source).is_dir() and not Path(source, "mlflow.db").exists():
        from .wandb import WandbReader

        return WandbReader(source)
    from .mlflow import MLflowReader

    return MLflowReader(source)

"""Readers: rebuild an :class:`HDETRun` from MLflow or W&B (no side channel from training).

``open_reader(source)`` picks the reader: a directory is a W&B folder (unless it holds ``mlflow.db``),
anything else an MLflow tracking URI or sqlite file.
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
    "resolve_source",
    "default_source",
]


def default_source() -> str:
    """``$HDET_DASHBOARD_SOURCE``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``."""
    return os.environ.get("HDET_DASHBOARD_SOURCE") or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


_SQLITE_MAGIC = b"SQLite format 3\x00"


def resolve_source(source: str | None = None) -> str:
    """``source`` as a reader takes it: an MLflow tracking URI as given (``file:PATH`` as
    ``file:///ABSOLUTE``); a directory holding ``mlflow.db`` or a sqlite file as its ``sqlite:///``
    URI; an MLflow file store's directory as its ``file:///`` URI; any other directory as itself (a
    W&B folder).

    Raises:
        ReaderError: a path that is neither a directory nor a sqlite file.
    """
    source = source or default_source()
    if "://" in source:
        return source
    if source.lower().startswith("file:"):  # file:./mlruns, file:/abs/mlruns
        store = Path(source[len("file:") :])
        if not store.is_dir():  # MLflow would create it
            raise ReaderError(_bad_source(source, "no such directory"))
        return f"file://{store.absolute()}"
    path = Path(source)
    if path.is_dir():
        db = path / "mlflow.db"
        if (path / "0" / "meta.yaml").is_file():  # an MLflow file store (its default experiment)
            return f"file://{path.absolute()}"
        return f"sqlite:///{db.absolute()}" if db.is_file() else source
    try:
        with open(path, "rb") as f:
            sqlite = f.read(len(_SQLITE_MAGIC)) == _SQLITE_MAGIC
    except OSError as exc:
        raise ReaderError(_bad_source(source, exc.strerror or str(exc))) from None
    if not sqlite:
        raise ReaderError(_bad_source(source, "a file that is not a sqlite database"))
    return f"sqlite:///{path.absolute()}"


def _bad_source(source: str, what: str) -> str:
    return (
        f"Expected a source that is an MLflow tracking URI (sqlite:///PATH, http://HOST:PORT), a W&B "
        f"directory or a directory holding mlflow.db, but got {source!r} ({what})"
    )


def open_reader(source: str | None = None) -> RunReader:
    """A reader for ``source`` (see :func:`resolve_source`): W&B's for a directory without
    ``mlflow.db``, MLflow's for anything else."""
    source = resolve_source(source)
    if "://" not in source:
        from .wandb import WandbReader

        return WandbReader(source)
    from .mlflow import MLflowReader

    return MLflowReader(source)

"""Rebuild HDET runs from MLflow (any tracking URI: a sqlite file, an ``http://`` server, ...).

The event archive (``hdet_events/*.parquet``) is read first: a handful of artifact downloads
instead of thousands of metric-history queries. Runs without it (older runs, runs logged by other
tools, an OneCycle baseline logged by hand) are rebuilt from metric histories.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import tempfile
from collections import defaultdict
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from .. import names
from ..errors import needs_extra
from ..owner import described, overdue, owner_alive
from ..summaries import SUMMARY_DIR
from ..tracking.archive import ARTIFACT_DIR
from .archive import read_archive
from .base import (
    HDETRun,
    ReaderError,
    RunNotFoundError,
    RunSummary,
    StepTable,
    divergence_summaries,
    is_sync_series,
    sync_events_from_series,
)

__all__ = ["MLflowReader", "StoreNotReady", "sqlite_file", "pending_store", "check_store_exists"]

logger = logging.getLogger(__name__)


def _probe(uri: str, timeout: float = 5.0) -> None:
    """Fail fast on a server that does not answer (MLflow's client would retry for minutes)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout):
            return
    except urllib.error.HTTPError:
        return  # it answered (some deployments have no /health): good enough
    except OSError as exc:
        raise ReaderError(f"Expected an MLflow server at {uri}, but it does not answer: {exc}") from None


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:`` tracking URI (``sqlite:///relative.db``,
    ``sqlite:////absolute.db``); None for any other URI and for an in-memory database."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.split("+", 1)[0] != "sqlite" or not rest.startswith("/"):
        return None
    path = rest[1:].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def pending_store(uri: str) -> Path | None:
    """The file of a ``sqlite:`` store a job has not created yet, in a directory that exists (a
    dashboard opened before the first job waits for it); None otherwise."""
    db = sqlite_file(uri)
    return db if db is not None and not db.exists() and db.absolute().parent.is_dir() else None


def check_store_exists(uri: str) -> None:
    """Raise :class:`ReaderError` naming ``uri`` when it is a ``sqlite:`` store whose file does not exist.

    MLflow's client creates a missing sqlite file (and its directory) on first use; a reader must
    never create a store, so it checks first. Other URIs (``file:``, ``http://``) are left to MLflow.

    Raises:
        ReaderError: the sqlite file of ``uri`` does not exist.

    Example:
        >>> check_store_exists("sqlite:///mlflow.db")  # doctest: +SKIP
    """
    db = sqlite_file(uri)
    if db is None:
        return
    if not db.exists():
        raise ReaderError(
            f"Expected an MLflow store at {uri}, but {db.absolute()} does not exist "
            "(reading never creates one: log a run to it first, or name another tracking URI)"
        )
    # MLflow's client would also add its tables to any other sqlite file (an empty one included)
    try:
        with closing(sqlite3.connect(f"file:{db.absolute()}?mode=ro", uri=True)) as con:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        raise ReaderError(
            f"Expected an MLflow store at {uri}, but {db.absolute()} is not a sqlite database ({exc})"
        ) from None
    if not {"experiments", "runs", "metrics"} <= tables:
        raise ReaderError(
            f"Expected an MLflow store at {uri}, but {db.absolute()} is "
            + ("empty" if not tables else f"another sqlite database (tables {sorted(tables)[:5]})")
            + " (reading never changes it: name the mlflow.db your jobs log to)"
        )
    _check_schema(uri, db, tables)


def _known_revision(revision: str) -> bool:
    try:
        from alembic.script import ScriptDirectory
        from mlflow.store.db.utils import _get_alembic_config

        return ScriptDirectory.from_config(_get_alembic_config("")).get_revision(revision) is not None
    except Exception:  # noqa: BLE001 - unknown to this MLflow's scripts
        return False


class StoreNotReady(ReaderError):
    """A sqlite store whose schema is not the one this MLflow reads: a job is still creating it, or
    an older MLflow made it. MLflow's client would migrate it (concurrently with the job, which can
    leave it unopenable), so a reader waits or refuses instead."""


def _check_schema(uri: str, db: Path, tables: set[str]) -> None:
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        head = _get_latest_schema_revision()
    except Exception:  # noqa: BLE001 - an MLflow without it: its client decides
        return
    revision = None
    if "alembic_version" in tables:
        with closing(sqlite3.connect(f"file:{db.absolute()}?mode=ro", uri=True)) as con:
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
            revision = row[0] if row else None
    migrating = any(t.startswith("_alembic_tmp_") for t in tables)
    if revision != head or migrating:
        import mlflow

        if revision is not None and not migrating and not _known_revision(revision):
            raise ReaderError(
                f"Expected an MLflow store at {uri} with the schema MLflow {mlflow.__version__} reads ({head}), "
                f"but it is at {revision}, which this MLflow does not know: a newer MLflow made it (read it "
                "with that version)"
            )
        raise StoreNotReady(
            f"Expected an MLflow store at {uri} with the schema MLflow {mlflow.__version__} reads ({head}), but "
            f"it is at {revision or 'no schema yet'}{' and mid-migration' if migrating else ''}: a job is still "
            f"creating it (the page waits), or an older MLflow made it (run `mlflow db upgrade {uri}`; "
            "reading never changes a store)"
        )


def _quoted(value: str) -> str | None:
    """``value`` as a string literal of MLflow's search filter (None: it holds both kinds of quote,
    which the filter cannot hold)."""
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    return None


class MLflowReader:
    """Read HDET runs from an MLflow tracking URI. Read-only: a ``sqlite:`` URI whose file does not
    exist raises :class:`ReaderError` instead of creating an empty store.

    Example:
        >>> reader = MLflowReader("sqlite:///mlflow.db")
        >>> runs = reader.list_runs("hdet")
        >>> run = reader.read(runs[0].run_id)
    """

    backend = "mlflow"

    def __init__(self, tracking_uri: str | None = None) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:  # pragma: no cover
            raise ImportError(needs_extra("reading MLflow runs", "mlflow", "mlflow")) from exc
        self.uri = tracking_uri or default_tracking_uri()
        check_store_exists(self.uri)
        if self.uri.startswith(("http://", "https://")):
            _probe(self.uri)
        self.client = MlflowClient(self.uri)

    def experiments(self) -> list[str]:
        return [e.name for e in self._all_experiments()]

    def _all_experiments(self) -> list[Any]:
        """Every experiment of the store, page by page (MLflow returns at most 1,000 a call)."""
        found: list[Any] = []
        token = None
        while True:
            page = self.client.search_experiments(max_results=1000, page_token=token)
            found += list(page)
            token = page.token
            if not token:
                return found

    def _experiment_ids(self, experiment: str | None) -> list[str]:
        if experiment is None:
            return [e.experiment_id for e in self._all_experiments()]
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            raise RunNotFoundError(f"Expected an experiment named {experiment!r} at {self.uri}, but there is none")
        return [exp.experiment_id]

    def list_runs(
        self, experiment: str | None = None, compare_group: str | None = None, limit: int | None = 1000
    ) -> list[RunSummary]:
        """Runs of ``experiment`` (all experiments when None), newest first: those of
        ``compare_group`` when given (filtered by the store), at most ``limit`` (None: all, page by page)."""
        ids = self._experiment_ids(experiment)
        if not ids:
            return []
        literal = _quoted(compare_group) if compare_group else None
        filt = f"tags.`hdet.compare_group` = {literal}" if literal else ""
        by_hand = bool(compare_group) and literal is None  # a group with both kinds of quote: matched here
        runs: list[Any] = []
        token = None
        while limit is None or len(runs) < limit:
            page = self.client.search_runs(
                ids,
                filter_string=filt,
                order_by=["attributes.start_time DESC"],
                max_results=1000 if limit is None else min(1000, limit - len(runs)),
                page_token=token,
            )
            runs += [r for r in page if not by_hand or r.data.tags.get("hdet.compare_group") == compare_group]
            token = page.token
            if not token:
                break
        names = {e.experiment_id: e.name for e in self._all_experiments()}
        out = []
        for r in runs:
            tags = r.data.tags
            ws = tags.get("hdet.world_size", "")
            status = r.info.status
            if status == "RUNNING" and self._vanished(r.info.run_id, tags):
                status = "KILLED"
            out.append(
                RunSummary(
                    run_id=r.info.run_id,
                    name=r.info.run_name or r.info.run_id[:8],
                    status=status,
                    live=status == "RUNNING",
                    schedule=tags.get("hdet.schedule", ""),
                    world_size=int(ws) if ws.isdigit() else 1,
                    compare_group=tags.get("hdet.compare_group"),
                    final_loss=self._final_loss(r.info.run_id, r.data.metrics),
                    start_time=(r.info.start_time or 0) / 1000.0,
                    experiment=names.get(r.info.experiment_id, ""),
                )
            )
        return out

    def _vanished(self, run_id: str, tags: dict[str, str]) -> str | None:
        """For a RUNNING run: the error text when its training process and its tracking process (on
        this host) are both gone without ending it (a container stopped, SIGKILL to the process
        group), or, for processes this host cannot check (another host or container), when their
        heartbeat is long overdue (:func:`~hdet_track.owner.silence`), so that it reads KILLED and
        not live for ever. None while either lives (the tracking process ends the run itself when
        the training process dies), while the heartbeat is on time, and for runs that ended
        meanwhile (read again once both are gone)."""
        try:
            owner = json.loads(tags.get(names.MLFLOW_OWNER_TAG, ""))
        except ValueError:
            return None
        if not isinstance(owner, dict):
            return None
        writer = owner.get("writer")
        alive = [owner_alive(p) for p in (owner, writer) if isinstance(p, dict)]  # the writer's, if it had one
        if None in alive:  # another host or container: the heartbeat tells
            reason = overdue(owner, tags.get(names.MLFLOW_ALIVE_TAG))
        elif any(alive):
            reason = None
        else:
            both = " and its tracking process" if len(alive) > 1 else ""
            reason = f"{described(owner)}{both} ended without ending the run"
        if reason is None or self.client.get_run(run_id).info.status != "RUNNING":  # ended just before they exited
            return None
        return reason

    def _final_loss(self, run_id: str, metrics: dict[str, float]) -> float:
        """The last finite mean ``loss`` (as :meth:`HDETRun.final_loss`; ``hdet/loss`` in a run HDET
        attached to, whose ``loss`` is its owner's): MLflow's latest value may be NaN."""
        key = names.MEANS_IN_GIVEN_RUN[names.LOSS]
        key = key if key in metrics else names.LOSS
        latest = float(_infinite(np.array([metrics.get(key, math.nan)], dtype=float))[0])
        if math.isfinite(latest):
            return float(latest)
        values = self._history(run_id, key)[1]
        finite = values[np.isfinite(values)]
        return float(finite[-1]) if len(finite) else math.nan

    def read(
        self,
        run_id: str,
        previous: HDETRun | None = None,
        steps: tuple[int, int] | None = None,
        max_rows: int | None = None,
    ) -> HDETRun:
        """The run (see :class:`~hdet_track.readers.base.RunReader`): every row when the step range
        ``steps`` (inclusive; None: the whole run) holds at most ``max_rows`` rows, else an overview
        from the archive's summaries (``run.overview``)."""
        from mlflow.exceptions import MlflowException

        if not isinstance(run_id, str) or not run_id:
            raise TypeError(f"Expected run_id to be a run's id (a non-empty str), but got {run_id!r}")
        try:
            info = self.client.get_run(run_id)
        except MlflowException as exc:
            raise RunNotFoundError(f"Expected a run {run_id!r} at {self.uri}, but: {exc}") from None
        run = HDETRun(
            run_id=run_id,
            name=info.info.run_name or run_id[:8],
            source=self.uri,
            backend=self.backend,
            status=info.info.status,
            tags=dict(info.data.tags),
            start_time=(info.info.start_time or 0) / 1000.0,
        )
        if run.status == "RUNNING" and (gone := self._vanished(run_id, run.tags)):
            run.status, run.tags["hdet.error"] = "KILLED", gone
        try:
            listed = self.client.list_artifacts(run_id, ARTIFACT_DIR)
            files = [f.path for f in listed if not f.is_dir]
            if any(f.is_dir and f.path.rsplit("/", 1)[-1] == SUMMARY_DIR for f in listed):
                files += [f.path for f in self.client.list_artifacts(run_id, f"{ARTIFACT_DIR}/{SUMMARY_DIR}")]
        except Exception as exc:  # noqa: BLE001 - no artifact store, permissions...
            run.warnings.append(f"could not list the event archive: {type(exc).__name__}: {exc}")
            files = []
        files = sorted(f for f in files if f.endswith(".parquet"))
        if files:
            previous = None if previous is not None and previous.filled_from_rows else previous
            self._read_archive(run, files, previous, steps, max_rows)
            if not run.has_step_series and any(names.parse_replica_metric(k) for k in info.data.metrics):
                # chunks that gave no rows (torn, not downloadable): the per-replica histories, as
                # for a run without an archive (not the run's plain loss/lr: an owner's, if attached);
                # the next read reads the archive afresh (these rows have no multipliers)
                run.warnings.append("the event archive gave no step rows: steps rebuilt from metric histories")
                self._read_histories(run, info.data.metrics, events=not run.converge)
                run.filled_from_rows = True
        else:
            if "hdet.schema_version" not in run.tags:
                run.warnings.append("no HDET events in this run: only its metric histories are shown")
            elif run.live:  # a live run's first chunk comes within seconds of its first steps
                run.warnings.append("no event archive yet: shown from the metric histories until its first chunk")
            else:
                run.warnings.append("no event archive: rebuilt from metric histories (slower, thinned by log_every)")
            self._read_histories(run, info.data.metrics)
        self._read_user_metrics(run, info.data.metrics, archive=bool(files))
        return run

    # ------------------------------------------------------------------ archive
    def _read_archive(
        self,
        run: HDETRun,
        files: list[str],
        previous: HDETRun | None,
        steps: tuple[int, int] | None,
        max_rows: int | None,
    ) -> None:
        with tempfile.TemporaryDirectory() as tmp:

            def fetch(path: str) -> bytes | None:
                try:
                    return Path(self.client.download_artifacts(run.run_id, path, tmp)).read_bytes()
                except Exception as exc:  # noqa: BLE001
                    run.warnings.append(f"could not download {path}: {type(exc).__name__}: {exc}")
                    return None

            read_archive(run, files, fetch, previous, steps, max_rows)

    # ------------------------------------------------------------------ metric histories
    def _history(self, run_id: str, key: str) -> tuple[np.ndarray, np.ndarray]:
        """``key``'s points by step, one per step: the last logged (a job resumed by an older
        version could log a step twice)."""
        hist = self.client.get_metric_history(run_id, key)
        steps = np.array([m.step for m in hist], dtype=np.int64)
        values = _infinite(np.array([m.value for m in hist], dtype=float))
        order = np.lexsort((np.array([m.timestamp for m in hist], dtype=np.int64), steps))
        steps, values = steps[order], values[order]
        last = np.ones(len(steps), dtype=bool)
        last[:-1] = steps[1:] != steps[:-1]
        return steps[last], values[last]

    def _read_histories(self, run: HDETRun, latest: dict[str, float], events: bool = True) -> None:
        per_replica: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = defaultdict(dict)
        for key in latest:
            parsed = names.parse_replica_metric(key)
            if parsed:
                per_replica[parsed[0]][parsed[1]] = self._history(run.run_id, key)
        tables = []
        for r, series in sorted(per_replica.items()):
            steps = np.unique(np.concatenate([s for s, _ in series.values()]))
            loss = np.full(len(steps), np.nan)
            values: dict[str, np.ndarray] = {}
            for name, (s, v) in series.items():
                col = np.full(len(steps), np.nan)
                col[np.searchsorted(steps, s)] = v
                if name == "loss":
                    loss = col
                else:
                    values[name] = col
            tables.append(StepTable(steps, np.full(len(steps), r, dtype=np.int32), loss, values, {}))
        run.steps = StepTable.concat(tables)
        if events:
            self._rebuild_sync_events(run, latest)

    def _rebuild_sync_events(self, run: HDETRun, latest: dict[str, float]) -> None:
        series = {key: dict(zip(*self._history(run.run_id, key))) for key in latest if is_sync_series(key)}
        run.converge, run.controller, run.guard = sync_events_from_series(series, run.tags.get("hdet.controller", ""))
        run.metrics.update(divergence_summaries(series))

    def _read_user_metrics(self, run: HDETRun, latest: dict[str, float], archive: bool) -> None:
        """Metrics that are not part of the HDET series (val_loss, accuracy...), and loss/lr of a run
        without per-replica series (e.g. a OneCycle baseline logged by another tool)."""
        attached = {given: mean for mean, given in names.MEANS_IN_GIVEN_RUN.items() if given in latest}
        for key in latest:
            if key.startswith("hdet/") and key not in attached:
                continue
            if key in (names.LOSS, names.LR) and (run.has_step_series or attached):
                continue  # HDET's own (rows), or an owner's in a run HDET attached to
            if key in attached and run.has_step_series:
                continue
            run.metrics[attached.get(key, key)] = self._history(run.run_id, key)


def _infinite(values: np.ndarray) -> np.ndarray:
    """``values`` as logged: MLflow's stores keep +-inf as the largest finite float (and give that
    back), which would read as a finite, merely huge, loss."""
    big = np.finfo(float).max
    return np.where(values == big, np.inf, np.where(values == -big, -np.inf, values))

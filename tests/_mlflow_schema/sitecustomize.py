"""Test-only, loaded by Python's ``site`` module in every process the suite starts (the conftest
puts this directory on ``PYTHONPATH``): a fresh sqlite MLflow store gets MLflow's tables as a copy
of the schema MLflow's own ``_initialize_tables`` made once for the session (the file named by
``$_HDET_TEST_MLFLOW_SCHEMA``), through sqlite's backup API, instead of running MLflow's migrations
again: 1.7 s of CPU per store, and the suite makes about 150. The store is then MLflow's as ever
(its default experiment is made by MLflow when it opens it, with this process's artifact root).
MLflow itself is imported only where a process imports it."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MODULE = "mlflow.store.db.utils"


def patch(utils) -> None:
    """``utils`` (``mlflow.store.db.utils``) with its table initialiser copying the schema."""
    original = utils._initialize_tables
    if getattr(original, "_from_schema", False):
        return

    def initialize(engine) -> None:
        template = os.environ.get("_HDET_TEST_MLFLOW_SCHEMA")
        db = engine.url.database
        if not template or engine.url.get_backend_name() != "sqlite" or not db or db == ":memory:":
            return original(engine)
        import fcntl
        import hashlib
        import sqlite3
        import tempfile

        key = hashlib.sha256(os.path.abspath(db).encode()).hexdigest()[:16]
        with open(os.path.join(tempfile.gettempdir(), f"hdet-test-schema-{key}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process makes the tables; another then finds them
            engine.dispose()
            target = sqlite3.connect(db)
            try:
                empty = target.execute("select count(*) from sqlite_master").fetchone()[0] == 0
                if empty:
                    source = sqlite3.connect(template)
                    try:
                        source.backup(target)
                    finally:
                        source.close()
            finally:
                target.close()
        if not empty:
            original(engine)

    initialize._from_schema = True
    utils._initialize_tables = initialize


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("_HDET_TEST_MLFLOW_SCHEMA"):
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    else:
        sys.meta_path.insert(0, _Finder())

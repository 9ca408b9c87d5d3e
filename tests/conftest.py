from __future__ import annotations

import os
import sys

import pytest

from .servers import MlflowServer

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mlflow_schema")


def pytest_configure(config):
    """Every process of the suite (this one, and those it starts, through ``sitecustomize`` on
    ``PYTHONPATH``) makes a fresh sqlite MLflow store's tables by copying a schema MLflow made once,
    instead of running MLflow's migrations for each of the ~150 stores the suite makes (1.7 s of CPU
    each; see ``tests/_mlflow_schema/sitecustomize.py``). Not in xdist's controller, which runs no
    test; not with ``_HDET_TEST_NO_SCHEMA=1`` (every store then runs MLflow's migrations)."""
    if os.environ.get("_HDET_TEST_NO_SCHEMA") or (
        getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    ):
        return
    try:
        import logging

        import mlflow.store.db.utils as db_utils
        import sqlalchemy
    except ImportError:  # a run without MLflow (the extras' own environments)
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="hdet-test-schema-")
    engine = sqlalchemy.create_engine(f"sqlite:///{os.path.join(folder, 'schema.db')}")
    quiet = logging.getLogger("mlflow.store.db.utils")
    level, quiet.level = quiet.level, logging.WARNING
    try:
        db_utils._initialize_tables(engine)
    finally:
        quiet.level = level
        engine.dispose()
    config._hdet_schema_folder = folder
    os.environ["_HDET_TEST_MLFLOW_SCHEMA"] = os.path.join(folder, "schema.db")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SCHEMA_DIR, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, SCHEMA_DIR)
    import sitecustomize

    sitecustomize.patch(db_utils)
    sys.path.remove(SCHEMA_DIR)


def pytest_unconfigure(config):
    folder = getattr(config, "_hdet_schema_folder", None)
    if folder is not None:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _session_working_directory(tmp_path_factory):
    """Module-scoped fixtures run before each test's own directory (below) is set: the runs they
    log put their artifacts in MLflow's default ``./mlruns``, which was the repository's."""
    previous = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(previous)


@pytest.fixture(autouse=True)
def _isolated_tracking_env(monkeypatch, tmp_path):
    """No test writes into the working directory or reads the developer's tracking settings."""
    for key in list(os.environ):
        if key.startswith(("MLFLOW_", "WANDB_", "HDET_")):
            monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    (tmp_path / "wandb-root").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # spills of http stores land here
    monkeypatch.chdir(tmp_path)
    # nor MLflow's process-wide URI an earlier test set in code (Lightning's MLFlowLogger does): it
    # wins over $MLFLOW_TRACKING_URI for MLflow, and Hugging Face's run would go there
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None and hasattr(utils, "_tracking_uri"):
        monkeypatch.setattr(utils, "_tracking_uri", None)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server
    server.stop()


@pytest.fixture
def outage(monkeypatch):
    """A real MLflow tracker whose backend goes down on cue (tests/jobs/outage.py), also as the
    tracker a spill's replay builds for "mlflow"."""
    from hdet_track.tracking import base

    from .jobs.outage import OutageMLflowTracker

    OutageMLflowTracker.reset()
    monkeypatch.setitem(base.TRACKERS, "mlflow", "tests.jobs.outage:OutageMLflowTracker")
    yield OutageMLflowTracker
    OutageMLflowTracker.reset()

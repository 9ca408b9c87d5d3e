from __future__ import annotations

import os
import sys

import pytest

from .servers import MlflowServer


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

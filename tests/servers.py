"""A real `mlflow server` process on 127.0.0.1 for tests (start, stop, restart on the same port), and
a sqlite store one schema revision behind the installed MLflow."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def older_schema_store(uri: str) -> None:
    """Create the sqlite store ``uri`` one schema revision behind this MLflow (alembic's own
    downgrade): what an older MLflow left, or a job's store mid-creation."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).search_experiments()
    engine = sqlalchemy.create_engine(uri)
    with engine.begin() as conn:
        config = _get_alembic_config(uri)
        config.attributes["connection"] = conn
        command.downgrade(config, "-1")
    engine.dispose()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserved_port() -> socket.socket:
    """A port kept for a server that starts later: bound with SO_REUSEADDR but not listening, so that
    connecting to it is refused (the server is "down"), no other process binds it in the meantime (a
    port from free_port() stays free only by chance), and the server (uvicorn sets SO_REUSEADDR)
    can still take it. Close it once the server is up."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> MlflowServer:
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        cmd = [
            str(mlflow_bin),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"mlflow server did not come up on {self.uri}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

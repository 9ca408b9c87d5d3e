"""Nothing logged is lost when the tracking server is down for the whole job: the unsent batches are
kept in the documented spill directory and reach the store later, through `hdet-track recover` or
through the next job that logs to the same server.

The job is tests/jobs/lifecycle_job.py (100 steps, sync every 10) against http://127.0.0.1:PORT
with no server on PORT; a real `mlflow server` is started on that port afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hdet_track.readers.mlflow import MLflowReader
from hdet_track.tracking.spill import store_spill_dir

from .servers import MlflowServer, reserved_port

JOB = str(Path(__file__).parent / "jobs" / "lifecycle_job.py")
CLI = str(Path(sys.executable).with_name("hdet-track"))


def _env() -> dict[str, str]:
    # fail fast while the server is down (MLflow retries with backoff; the writer retries for 30 s at exit)
    return dict(
        os.environ,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
        MLFLOW_HTTP_REQUEST_TIMEOUT="2",
        HDET_TRACK_SHUTDOWN_TIMEOUT="3",
        OMP_NUM_THREADS="1",
    )


def _up_env() -> dict[str, str]:
    # the server is up: MLflow's own timeouts and retries, the default time at exit (a loaded machine
    # stalls a fresh single-worker server for more than _env()'s 2 s, and a recover kept the spill)
    return {k: v for k, v in _env().items() if not k.startswith(("MLFLOW_HTTP_", "HDET_TRACK_SHUTDOWN"))}


def _job_against_down_server(uri: str, failure: str, step: int) -> tuple[float, float]:
    started = time.time()
    proc = subprocess.run(
        [sys.executable, JOB, "plain", "mlflow", uri, failure, str(step)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert (proc.returncode == 0) == (failure == "none"), proc.stderr[-3000:]
    return started, time.time()


def _only_run(uri: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("life")
    assert exp is not None, "the spilled run's experiment was never created"
    runs = client.search_runs([exp.experiment_id])
    return runs


def test_recover_delivers_a_finished_job_spilled_while_the_server_was_down(tmp_path):
    reservation = reserved_port()  # down until the server starts, and not taken by another process
    port = reservation.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    started, ended = _job_against_down_server(uri, "none", -1)

    where = store_spill_dir(uri)
    assert where.parent == Path(os.environ["XDG_CACHE_HOME"]) / "hdet-track" / "spill"  # the documented place
    files = sorted(where.glob("spill-*.jsonl"))
    assert len(files) == 1, list(where.iterdir()) if where.exists() else "no spill directory"

    # nothing to deliver to while the server is still down: the spill is kept, the command says so
    down = subprocess.run([CLI, "recover", uri], env=_env(), capture_output=True, text=True, timeout=120)
    assert down.returncode == 1 and "kept" in down.stdout, down.stdout + down.stderr
    assert sorted(where.glob("spill-*.jsonl")) == files

    with reservation:
        server = MlflowServer(tmp_path / "server", port=port).start()
    try:
        up = subprocess.run([CLI, "recover", uri], env=_up_env(), capture_output=True, text=True, timeout=180)
        assert up.returncode == 0 and "delivered" in up.stdout, up.stdout + up.stderr
        assert not list(where.glob("spill-*")), "a delivered spill must be removed"
        (run,) = _only_run(uri)
        info = run.info
        assert info.status == "FINISHED"  # the job closed its run: the spill carried its end
        # the job's own times, not the time of delivery
        assert started * 1000 - 1000 <= info.start_time < info.end_time <= ended * 1000 + 1000
        rebuilt = MLflowReader(uri).read(info.run_id)
        assert [c.step for c in rebuilt.converge] == list(range(10, 101, 10))
        steps, values = rebuilt.replica_series("loss", 0)
        assert list(steps) == list(range(1, 101)) and len(values) == 100  # every step, once

        # a second recover finds nothing left
        again = subprocess.run([CLI, "recover", uri], env=_up_env(), capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and "nothing to deliver" in again.stdout
    finally:
        server.stop()


def test_the_next_job_on_the_same_server_delivers_a_crashed_jobs_spill(tmp_path):
    reservation = reserved_port()  # down until the server starts, and not taken by another process
    port = reservation.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    _job_against_down_server(uri, "raise", 35)  # crashes at step 35 while the server is down
    where = store_spill_dir(uri)
    assert len(list(where.glob("spill-*.jsonl"))) == 1

    with reservation:
        server = MlflowServer(tmp_path / "server", port=port).start()
    try:
        ok = subprocess.run(
            [sys.executable, JOB, "plain", "mlflow", uri, "none", "-1"],
            # the server is up: the default time at exit to deliver its run after the orphan's (with
            # _env()'s 3 s a loaded machine ended the job before its writer had, and the run read KILLED)
            env=_up_env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert ok.returncode == 0, ok.stderr[-3000:]
        runs = {r.info.status: r for r in _only_run(uri)}
        assert sorted(runs) == ["FAILED", "FINISHED"]  # the orphan arrived beside the new run
        crashed = runs["FAILED"]
        assert "boom on rank 0 before step 35" in crashed.data.tags.get("hdet.error", "")
        rebuilt = MLflowReader(uri).read(crashed.info.run_id)
        assert [c.step for c in rebuilt.converge] == [10, 20, 30]
        steps, _ = rebuilt.replica_series("loss", 0)
        assert list(steps) == list(range(1, 31))  # everything synced before the crash
        assert not list(where.glob("spill-*"))
    finally:
        server.stop()


SPILL_JOB = """
import sys
import torch
from hdet_track import HDETScheduler

backend, store = sys.argv[1:3]
if backend == "wandb":
    from hdet_track.tracking.wandb import WandbTracker
    track = WandbTracker(project="spilled", dir=store, run_name="spilled")  # online, no API key: spilled
else:
    from hdet_track.tracking.mlflow import MLflowTracker
    track = MLflowTracker(tracking_uri=store, experiment="spilled", run_name="spilled")
opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
sched = HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, track=track)
for k in range(1, 21):
    opt.step()
    sched.step(1.0 / k)
sched.log_metrics({"val_loss": 0.25})
sched.close()
"""


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_recover_from_elsewhere_delivers_a_relative_store_where_the_job_ran(tmp_path, backend):
    """A job that logged to a relative store (``sqlite:///mlflow.db``, ``WandbTracker(dir="store")``)
    while it could not be written (a damaged sqlite file; W&B online without a key) leaves a spill in
    that store; ``hdet-track recover STORE`` run from another directory delivers it into that store,
    not into one relative to where recover runs (and finds W&B's spill under ``STORE/wandb/``)."""
    job_dir, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job_dir.mkdir()
    elsewhere.mkdir()
    (job_dir / "job.py").write_text(SPILL_JOB)
    env = _env() | {"HOME": str(tmp_path / "home"), "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    if backend == "mlflow":
        (job_dir / "mlflow.db").write_bytes(b"not a database" * 100)
        args, source = ["mlflow", "sqlite:///mlflow.db"], f"sqlite:///{job_dir / 'mlflow.db'}"
    else:
        args, source = ["wandb", "store"], str(job_dir / "store")
    job = subprocess.run(
        [sys.executable, "job.py", *args],
        cwd=job_dir,
        env=env | {"WANDB_MODE": "online"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    if backend == "mlflow":
        (job_dir / "mlflow.db").unlink()  # repaired: recover may create the store again
    out = subprocess.run(
        [CLI, "recover", source],
        cwd=elsewhere,
        env=env | {"WANDB_MODE": "offline"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0 and "batches delivered" in out.stdout, (out.stdout, out.stderr[-3000:])
    # no store where recover ran (a new MLflow experiment's artifacts go to MLflow's default root, ./mlruns)
    assert not [p for p in elsewhere.iterdir() if p.name != "mlruns"], list(elsewhere.iterdir())
    if backend == "mlflow":
        reader = MLflowReader(source)
    else:
        from hdet_track.readers.wandb import WandbReader

        reader = WandbReader(source)
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))
    assert list(run.metrics["val_loss"][1]) == [0.25]

"""Metrics logged before the run's first step (a restored checkpoint evaluated before training goes
on, a resumed job with no steps left that logs its final evaluation): real MLflow sqlite stores and
W&B offline runs, read back. Before, such metrics reached the backend ahead of the run's start: the
backend was taken for down, the run never started (MLflow, W&B), and a resumed job's close left its
run FAILED without the metrics."""

from __future__ import annotations

import os
import time

import pytest
import torch

from hdet_track import HDETScheduler
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.readers.wandb import WandbReader
from hdet_track.tracking.mlflow import MLflowTracker
from hdet_track.tracking.wandb import WandbTracker


def _tracker(backend, tmp_path):
    if backend == "mlflow":
        return MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="early")
    return WandbTracker(project="early", dir=os.environ["WANDB_DIR"], mode="offline")


def _read(backend, tmp_path, run_id):
    if backend == "mlflow":
        return MLflowReader(f"sqlite:///{tmp_path / 'mlflow.db'}").read(run_id)
    return WandbReader(os.environ["WANDB_DIR"]).read(run_id)


def _scheduler(track):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return opt, HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, model=model, track=track)


def _steps(opt, sched, first, last):
    for k in range(first, last + 1):
        opt.step()
        sched.step(1.0 / k)


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_metrics_logged_before_the_first_step_wait_for_the_run(tmp_path, backend, caplog):
    tracker = _tracker(backend, tmp_path)
    opt, sched = _scheduler(tracker)
    with caplog.at_level("WARNING", logger="hdet_track"):
        sched.log_metrics({"val_loss": 1.0})  # e.g. a restored model evaluated first
        time.sleep(0.5)  # the writer is awake by now
        _steps(opt, sched, 1, 20)
        sched.close()
    assert "unavailable" not in caplog.text, caplog.text
    run = _read(backend, tmp_path, tracker.run_id)
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [5, 10, 15, 20]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))
    assert run.metrics["val_loss"][0].tolist() == [0] and run.metrics["val_loss"][1].tolist() == [1.0]


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_resumed_job_with_no_steps_left_ends_its_run_with_its_final_metrics(tmp_path, backend, caplog):
    """The first attempt trained to the end and failed in its final evaluation (after its last
    checkpoint): FAILED. The second loads that checkpoint, evaluates and closes: the same run, FINISHED,
    with the metric, and nothing left in a spill."""
    first = _tracker(backend, tmp_path)
    opt, sched = _scheduler(first)
    with pytest.raises(RuntimeError, match="evaluation failed"), sched:
        _steps(opt, sched, 1, 20)
        state = sched.state_dict()
        raise RuntimeError("evaluation failed")
    run = _read(backend, tmp_path, first.run_id)
    assert run.status == "FAILED"

    second = _tracker(backend, tmp_path)
    opt, sched = _scheduler(second)
    sched.load_state_dict(state)
    with caplog.at_level("WARNING", logger="hdet_track"):
        sched.log_metrics({"val_loss": 0.25})
        sched.close()
    assert "unavailable" not in caplog.text, caplog.text
    assert second.run_id == first.run_id
    run = _read(backend, tmp_path, first.run_id)
    assert run.status == "FINISHED" and run.metrics["val_loss"][1].tolist() == [0.25]
    assert run.metrics["val_loss"][0].tolist() == [20]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))  # every step once
    assert not [p for p in tmp_path.rglob("spill-*")] and not list(tmp_path.rglob("refused-*"))


def test_a_job_closed_before_it_did_anything_makes_no_run(tmp_path):
    tracker = _tracker("mlflow", tmp_path)
    _, sched = _scheduler(tracker)
    sched.close()
    assert tracker.run_id is None and not (tmp_path / "mlflow.db").exists()


EXIT_JOB = """
import sys, torch
from hdet_track import HDETScheduler
from hdet_track.tracking.mlflow import MLflowTracker
uri, ckpt = sys.argv[1:3]
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, model=model,
                      track=MLflowTracker(tracking_uri=uri, experiment="early"))
sched.load_state_dict(torch.load(ckpt, weights_only=True))
sched.log_metrics({"val_loss": 0.25})
# no close(): the process's exit ends the run (as a Hugging Face run left open for final metrics)
"""


def test_a_resumed_job_with_no_steps_left_that_exits_without_closing_ends_finished(tmp_path):
    """Before, the exit read it as a job that stopped at step 0 of 20: FAILED."""
    import subprocess
    import sys

    tracker = _tracker("mlflow", tmp_path)
    opt, sched = _scheduler(tracker)
    with pytest.raises(RuntimeError, match="evaluation failed"), sched:
        _steps(opt, sched, 1, 20)
        torch.save(sched.state_dict(), tmp_path / "ckpt.pt")
        raise RuntimeError("evaluation failed")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = subprocess.run(
        [sys.executable, "-c", EXIT_JOB, uri, str(tmp_path / "ckpt.pt")], capture_output=True, text=True, timeout=120
    )
    assert job.returncode == 0, job.stderr[-2000:]
    run = _read("mlflow", tmp_path, tracker.run_id)
    assert run.status == "FINISHED", run.tags.get("hdet.error")
    assert run.metrics["val_loss"][0].tolist() == [20] and run.metrics["val_loss"][1].tolist() == [0.25]

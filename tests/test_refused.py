"""A part of a batch the backend refuses for its content (MLflow's INVALID_PARAMETER_VALUE, a
fault injected into a real MLflow client: tests/jobs/refusing.py) is set aside, and the rest of the
run reaches the store: live, and when an orphaned spill is recovered. Before, such a batch was
"down" for good: it and everything behind it waited in the spill, the run never ended."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hdet_track import HDETScheduler
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.tracking import base
from hdet_track.tracking.mlflow import MLflowTracker
from hdet_track.tracking.spill import SpillFile, recover, replay_file

from .jobs.refusing import RefusingMLflowTracker, refusing_tracker

ROOT = str(Path(__file__).resolve().parent.parent)


def _job(tracker, close: bool = True) -> HDETScheduler:
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, track=tracker)
    for k in range(1, 21):
        opt.step()
        sched.step(1.0 / k)
        if k == 8:
            sched.log_metrics({"refused": 1.0, "val_loss": 0.5})
            sched.flush()  # that call's metrics in a batch of their own with steps 1-8
    sched.log_metrics({"val_accuracy": 0.75})
    if close:
        sched.close()
    return sched


def _check_run(uri: str, run_id: str) -> None:
    run = MLflowReader(uri).read(run_id)
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [5, 10, 15, 20]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))
    assert "refused" not in run.metrics
    assert run.metrics["val_loss"][0].tolist() == [8] and run.metrics["val_loss"][1].tolist() == [0.5]
    assert run.metrics["val_accuracy"][1].tolist() == [0.75]  # a later call's metrics arrive


def _aside(directory: Path) -> list[tuple[str, float, int]]:
    (path,) = directory.glob("refused-*.jsonl")
    return [(p.key, p.value, p.step) for b in SpillFile(path, {}).batches() for p in b.points]


@pytest.mark.parametrize("isolate", [True, False], ids=["own-process", "in-process"])
def test_a_metric_mlflow_refuses_is_set_aside_and_the_run_goes_on(tmp_path, monkeypatch, caplog, isolate):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = refusing_tracker(uri, "refused", isolate=isolate)
    with caplog.at_level("WARNING", logger="hdet_track"):
        _job(tracker)
    assert "refused the metric 'refused' at step 8 (1 points) for its content" in caplog.text, caplog.text
    assert "Invalid value for metric 'refused' (injected)" in caplog.text
    assert "unavailable" not in caplog.text  # never taken for an outage: nothing waited in a spill
    _check_run(uri, tracker.run_id)
    spills = tmp_path / ".hdet-spill"
    assert _aside(spills) == [("refused", 1.0, 8)]
    assert not list(spills.glob("spill-*"))
    assert recover(uri) == [] and len(list(spills.glob("refused-*.jsonl"))) == 1  # evidence, not retried


def test_recovering_a_spill_sets_aside_what_the_backend_refuses(tmp_path, monkeypatch):
    """The job's backend was down throughout (an outage injected): everything is in its spill. The
    backend is back, but refuses the metric 'refused': recovering delivers the rest and ends the run."""
    monkeypatch.setenv("HDET_TRACK_SHUTDOWN_TIMEOUT", "0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _job(refusing_tracker(uri, "refused", isolate=False, down=True))
    spills = tmp_path / ".hdet-spill"
    (spill,) = spills.glob("spill-*.jsonl")  # this process wrote it and lives on: replayed by hand
    monkeypatch.setattr(base, "get_tracker_class", lambda name: RefusingMLflowTracker)
    line = replay_file(spill)
    assert "delivered" in line and "refused 1 part(s) for their content (the metric 'refused' at step 8" in line, line
    assert not spill.exists() and _aside(spills) == [("refused", 1.0, 8)]
    (run_id,) = [r.run_id for r in MLflowReader(uri).list_runs("refused")]
    _check_run(uri, run_id)


def test_an_outage_while_the_parts_go_writes_nothing_twice(tmp_path, caplog):
    """The backend refuses the batch, and then goes away while its parts go one by one (at the
    user's val_loss): the whole batch waits in the spill and is sent again once it is back. Every
    step's row, sync and metric must be in the run once, and the refused part set aside once."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = refusing_tracker(uri, "refused", isolate=False, fail_once="val_loss")
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, track=tracker)
    with caplog.at_level("WARNING", logger="hdet_track"):
        for k in range(1, 21):
            opt.step()
            sched.step(1.0 / k)
            if k == 8:  # the rows of steps 1-8 and the sync at 5 go with these metrics
                sched.log_metrics({"refused": 1.0, "acc": 0.9, "val_loss": 0.5})
                sched.flush()
        sched.close()
    assert "the backend went away (injected)" in caplog.text  # the outage did happen, mid-parts
    run = MLflowReader(uri).read(tracker.run_id)
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [5, 10, 15, 20]
    assert run.steps.step.tolist() == list(range(1, 21))  # the event archive's rows: each step once
    assert run.metrics["val_loss"][1].tolist() == [0.5] and run.metrics["acc"][1].tolist() == [0.9]
    assert _aside(tmp_path / ".hdet-spill") == [("refused", 1.0, 8)]


def test_a_deleted_run_is_not_a_refusal_and_its_data_waits_for_it(tmp_path, monkeypatch, caplog):
    """MLflow answers INVALID_PARAMETER_VALUE for a run that was deleted too: that is the run's
    state, not a bad value. The data waits in the spill (nothing set aside) and reaches the run once
    it is restored."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("HDET_TRACK_SHUTDOWN_TIMEOUT", "0")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    tracker = MLflowTracker(tracking_uri=uri, experiment="deleted")
    tracker.isolate = False
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="hdet_track"):
        sched = HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, track=tracker)
        for k in range(1, 21):
            opt.step()
            sched.step(1.0 / k)
            if k == 6:
                sched.flush()
                client.delete_run(tracker.run_id)
        sched.close()
    assert "must be in the 'active' state" in caplog.text and "refused" not in caplog.text
    spills = tmp_path / ".hdet-spill"
    assert not list(spills.glob("refused-*"))
    (spill,) = spills.glob("spill-*.jsonl")
    client.restore_run(tracker.run_id)
    assert "delivered" in replay_file(spill)
    run = MLflowReader(uri).read(tracker.run_id)
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [5, 10, 15, 20]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))

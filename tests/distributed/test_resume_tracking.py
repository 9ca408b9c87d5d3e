"""Kill and resume tracked (and untracked) jobs on 2 real gloo ranks: the schedule continues exactly,
the resumed job continues the same MLflow or W&B run, and the store holds every step once."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from hdet_track.readers.mlflow import MLflowReader
from hdet_track.readers.wandb import WandbReader

from . import workers
from .launch import run_ranks

WORLD = 2


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('full') / 'full.db'}"
    return run_ranks(workers.tracked_resume, WORLD, "", uri, "full", True)


def only_run(uri, settled=False):
    """The one run of the store; with ``settled``, once it is no longer RUNNING (a SIGKILLed job's
    tracking process, in a session of its own, ends the run a moment after the ranks are gone)."""
    client = MlflowClient(uri)
    deadline = time.monotonic() + 30
    while True:
        runs = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
        assert len(runs) == 1
        if not settled or runs[0].info.status != "RUNNING" or time.monotonic() > deadline:
            return client, runs[0]
        time.sleep(0.2)


@pytest.mark.parametrize("kill_after", [17, 21], ids=["killed-mid-window", "killed-after-the-next-sync"])
def test_tracked_job_killed_mid_window_resumes_into_the_same_run(tmp_path, uninterrupted, kill_after):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    run_ranks(workers.tracked_resume, WORLD, str(tmp_path), uri, "first", True, kill_after, allow_kill=True)
    client, killed = only_run(uri, settled=True)
    # SIGKILL: the job could not end its run; the tracker process saw it vanish and did
    assert killed.info.status == "KILLED"
    assert "vanished" in killed.data.tags.get("hdet.error", "")
    resumed = run_ranks(workers.tracked_resume, WORLD, str(tmp_path), uri, "second", True)
    assert resumed[0]["run_ids"]["mlflow"] == killed.info.run_id
    _, run = only_run(uri)
    assert run.info.status == "FINISHED" and "hdet.error" not in run.data.tags
    assert "vanished" in run.data.tags["hdet.resumed_after"]  # the interruption stays on record
    read = MLflowReader(uri).read(run.info.run_id)
    for r in range(WORLD):
        assert resumed[r]["lrs"] == uninterrupted[r]["lrs"], r  # lr, weight decay, dropout at every step
        steps, lrs = read.replica_series("lr", r)
        assert list(steps) == list(range(1, 41))  # per-step points on their own steps, none doubled or dropped
        # the job records each LR after sched.step(), i.e. the LR of the next step; the store has the
        # LR each step trained with
        assert list(lrs[1:]) == [row[0] for row in uninterrupted[r]["lrs"][:-1]]
        _, loss = read.replica_series("loss", r)
        history = client.get_metric_history(run.info.run_id, f"hdet/replica_{r:02d}/loss")
        assert len({m.step for m in history}) == len(history)
        assert {m.step: m.value for m in history} == {
            int(s): v for s, v in zip(steps, loss) if int(s) in {m.step for m in history}
        }
    assert [e.step for e in read.converge] == [6, 12, 18, 24, 30, 36, 40]


@pytest.mark.parametrize(
    ("first", "second"), [(False, True), (True, False)], ids=["untracked-to-tracked", "tracked-to-untracked"]
)
def test_checkpoint_moves_between_tracked_and_untracked_jobs(tmp_path, uninterrupted, first, second):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    run_ranks(workers.tracked_resume, WORLD, str(tmp_path), uri, "first", first, 17, allow_kill=True)
    resumed = run_ranks(workers.tracked_resume, WORLD, str(tmp_path), uri, "second", second)
    for r in range(WORLD):
        assert resumed[r]["lrs"] == uninterrupted[r]["lrs"], r
    if second:  # a new run, from the checkpoint's step: the partial window's steps 13-17 included
        client, run = only_run(uri)
        assert run.info.status == "FINISHED"
        steps, _ = MLflowReader(uri).read(run.info.run_id).replica_series("lr", 0)
        assert list(steps) == list(range(13, 41))
    else:
        assert resumed[0]["run_ids"] == {}


def test_tracked_wandb_job_killed_mid_window_resumes_into_the_same_run(tmp_path, uninterrupted):
    """The same kill (mid-window, after the checkpoint at step 17) with W&B offline: the resumed
    job continues the same W&B run (a second offline directory for the same run id, merged by the
    reader), every step once, the LR each step trained with."""
    wandb_dir = str(tmp_path / "wandb-store")
    run_ranks(workers.tracked_resume, WORLD, str(tmp_path), wandb_dir, "first", True, 17, "wandb", allow_kill=True)
    resumed = run_ranks(workers.tracked_resume, WORLD, str(tmp_path), wandb_dir, "second", True, 0, "wandb")
    reader = WandbReader(wandb_dir)
    (summary,) = reader.list_runs()  # one run, not one per session
    assert resumed[0]["run_ids"]["wandb"] == summary.run_id
    run = reader.read(summary.run_id)
    assert run.status == "FINISHED"
    for r in range(WORLD):
        assert resumed[r]["lrs"] == uninterrupted[r]["lrs"], r
        steps, lrs = run.replica_series("lr", r)
        assert list(steps) == list(range(1, 41))
        assert list(lrs[1:]) == [row[0] for row in uninterrupted[r]["lrs"][:-1]]
    assert [e.step for e in run.converge] == [6, 12, 18, 24, 30, 36, 40]

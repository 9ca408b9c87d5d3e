"""A 4-rank gloo job logs one run that holds every replica."""

from __future__ import annotations

import glob
import json
import os

import pytest
from mlflow.tracking import MlflowClient

from ..test_tracking_wandb import read_finished
from . import workers
from .launch import run_ranks

WORLD = 4


def test_one_mlflow_run_holds_all_replicas(tmp_path):
    uri = f"sqlite:///{tmp_path / 'gloo.db'}"
    res = run_ranks(workers.tracked_job, WORLD, uri, "mlflow")
    run_id = res[0]["run_ids"]["mlflow"]
    assert all(res[r]["run_ids"] == {} for r in range(1, WORLD))  # only rank 0 owns a run
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("gloo")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one run for the whole job, not one per rank
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["hdet.world_size"] == "4"
    assert len(json.loads(run.data.params["hostnames"])) == WORLD
    for r in range(WORLD):
        p = f"hdet/replica_{r:02d}"
        lr = {m.step: m.value for m in client.get_metric_history(run_id, f"{p}/lr")}
        wd = {m.step: m.value for m in client.get_metric_history(run_id, f"{p}/weight_decay")}
        loss = {m.step: m.value for m in client.get_metric_history(run_id, f"{p}/loss")}
        for step, a, w, lo in res[r]["seen"]:
            assert lr[step] == pytest.approx(a, rel=1e-12), (r, step)
            assert wd[step] == pytest.approx(w, rel=1e-12), (r, step)
            assert loss[step] == pytest.approx(lo, rel=1e-6), (r, step)
    mean = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert mean[5] == pytest.approx(sum(res[r]["seen"][4][3] for r in range(WORLD)) / WORLD, rel=1e-6)
    weights = [client.get_metric_history(run_id, f"hdet/controller/lr/weight/replica_{r:02d}") for r in range(WORLD)]
    assert [m.step for m in weights[0]] == [6, 12, 18, 24]
    assert sum(w[1].value for w in weights) == pytest.approx(1.0)
    div = {m.step: m.value for m in client.get_metric_history(run_id, "hdet/sync/divergence_max")}
    assert sorted(div) == [6, 12, 18, 24] and all(v > 0 for v in div.values())


def test_one_wandb_offline_run_holds_all_replicas(tmp_path):
    res = run_ranks(workers.tracked_job, WORLD, "", "wandb")
    files = glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1
    contents = read_finished(files[0])
    assert contents.run_id == res[0]["run_ids"]["wandb"] and contents.group == "gloo-4"
    rows = {row["hdet/step"]: row for row in contents.history if "hdet/replica_00/lr" in row}
    for r in range(WORLD):
        for step, a, _, _ in res[r]["seen"]:
            assert rows[step][f"hdet/replica_{r:02d}/lr"] == pytest.approx(a, rel=1e-12)


@pytest.mark.parametrize("sync_first", [False, True], ids=["close", "sync_now-then-close"])
def test_a_job_of_several_processes_closed_between_syncs_says_which_steps_it_leaves_out(tmp_path, sync_first):
    uri = f"sqlite:///{tmp_path / 'early.db'}"
    res = run_ranks(workers.closed_between_syncs, 2, uri, sync_first)
    assert res[1]["warnings"] == []  # rank 0 says it, once
    client = MlflowClient(uri)
    steps = sorted(m.step for m in client.get_metric_history(res[0]["run_ids"]["mlflow"], "hdet/replica_01/loss"))
    if sync_first:
        assert res[0]["warnings"] == [] and steps == list(range(1, 9))
    else:
        (text,) = res[0]["warnings"]
        assert "steps 6-8 are not in the run" in text and "sync_now() on every rank" in text
        assert steps == list(range(1, 6))

"""Tracking into a real MLflow store (sqlite file and a real `mlflow server` on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from hdet_track import HDETScheduler
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.tracking import Batch, Tracker
from hdet_track.tracking.base import is_secret, redact
from hdet_track.tracking.mlflow import MLflowTracker


def train(tracker, steps=40, sync_every=10, log_every=1, spread=0.3, auto_lr=True, controller="paper", loss=None, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        lr=0.1,
        momentum=0.9,
        weight_decay=1e-3,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = HDETScheduler(
            opt,
            [0.1, 0.05],
            total_steps=steps,
            spread=spread,
            sync_every=sync_every,
            auto_lr=auto_lr,
            controller=controller,
            auto_lr_warmup=sync_every if auto_lr else 0,
            explore={"weight_decay": 0.5} if spread else None,
            track=tracker,
            log_every=log_every,
            compare_group="cg-1",
            **kw,
        )
    seen = []
    for k in range(1, steps + 1):
        opt.step()
        seen.append((k, opt.param_groups[0]["lr"], opt.param_groups[1]["lr"], opt.param_groups[0]["weight_decay"]))
        sched.step(1.0 / k if loss is None else loss(k))
    sched.close()  # the run stays open after the last step (for final metrics) until close()
    return sched, seen


def history(client, run_id, key):
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def read_steps_artifact(client, run_id, tmp_path):
    local = client.download_artifacts(run_id, "hdet_events", str(tmp_path))
    files = sorted(f for f in os.listdir(local) if f.startswith("steps-"))
    return pq.read_table([os.path.join(local, f) for f in files]).to_pylist() if files else []


@pytest.fixture
def sqlite_uri(tmp_path):
    return f"sqlite:///{tmp_path / 'store.db'}"


def test_one_run_with_metric_contract_params_tags_and_archive(sqlite_uri, tmp_path):
    tracker = MLflowTracker(tracking_uri=sqlite_uri, experiment="contract")
    sched, seen = train(tracker)
    client = MlflowClient(sqlite_uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["hdet.schedule"] == "hdet" and tags["hdet.world_size"] == "1"
    assert tags["hdet.schema_version"] == "2" and tags["hdet.compare_group"] == "cg-1"
    params = run.data.params
    assert params["spread"] == "0.3" and params["sync_every"] == "10" and params["auto_lr"] == "true"
    assert params["explore.weight_decay.spread"] == "0.5" and params["world_size"] == "1"
    # Per replica series hold exactly what the optimizer used at each step.
    lr0 = history(client, tracker.run_id, "hdet/replica_00/lr")
    lr1 = history(client, tracker.run_id, "hdet/replica_00/lr/pg1")
    wd = history(client, tracker.run_id, "hdet/replica_00/weight_decay")
    loss = history(client, tracker.run_id, "hdet/replica_00/loss")
    assert sorted(lr0) == list(range(1, 41))
    for k, a, b, w in seen:
        assert lr0[k] == pytest.approx(a, rel=1e-12) and lr1[k] == pytest.approx(b, rel=1e-12)
        assert wd[k] == pytest.approx(w, rel=1e-12)
        assert loss[k] == pytest.approx(1.0 / k)
    assert history(client, tracker.run_id, "loss") == loss  # mean over one replica
    # Sync and controller series at every sync (10, 20, 30, 40); controller from warmup on.
    assert sorted(history(client, tracker.run_id, "hdet/sync/divergence")) == [10, 20, 30, 40]
    base = history(client, tracker.run_id, "hdet/controller/lr/base")
    assert sorted(base) == [10, 20, 30, 40]
    assert sorted(history(client, tracker.run_id, "hdet/controller/lr/pg1/base")) == [10, 20, 30, 40]
    assert sorted(history(client, tracker.run_id, "hdet/onecycle/lr")) == [10, 20, 30, 40]
    assert sorted(history(client, tracker.run_id, "hdet/controller/weight_decay/weight/replica_00")) == [10, 20, 30, 40]
    # The controller's held base is what the (single, multiplier 1) replica used after the sync.
    assert lr0[11] == pytest.approx(base[10], rel=1e-12) and lr0[19] == lr0[11]
    rows = read_steps_artifact(client, tracker.run_id, tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[4]["v:lr"] == pytest.approx(seen[4][1], rel=1e-12) and rows[4]["m:lr"] == 1.0


def test_log_every_thins_replica_series_not_sync_or_archive(sqlite_uri, tmp_path):
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    train(tracker, steps=40, log_every=4)
    client = MlflowClient(sqlite_uri)
    assert sorted(history(client, tracker.run_id, "hdet/replica_00/lr")) == list(range(4, 41, 4))
    assert sorted(history(client, tracker.run_id, "hdet/sync/divergence")) == [10, 20, 30, 40]
    assert len(read_steps_artifact(client, tracker.run_id, tmp_path)) == 40
    assert client.get_experiment_by_name("hdet") is not None  # the default experiment name


@pytest.mark.parametrize("budget", ["default", "none"])
def test_point_budget_thins_fast_series_but_keeps_guard_syncs_last_step_and_archive(
    sqlite_uri, tmp_path, monkeypatch, budget
):
    """2,000 steps and 1,000 syncs in well under a second: far past the default budget of 200
    points per second. The histories are thinned (never below their floors), a sync where the guard
    rolled back is still logged, and the archive keeps every step; HDET_POINTS_PER_SECOND=0 keeps all."""
    if budget == "none":
        monkeypatch.setenv("HDET_POINTS_PER_SECOND", "0")
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    train(tracker, steps=2000, sync_every=2, controller="drift", loss=lambda k: math.nan if k == 1001 else 1.0 / k)
    client = MlflowClient(sqlite_uri)
    syncs = history(client, tracker.run_id, "hdet/sync/divergence")
    lr = history(client, tracker.run_id, "lr")
    rollback = history(client, tracker.run_id, "hdet/sync/rollback")
    assert rollback[1001] == 1.0  # the NaN loss: the step guard converged and rolled back at once
    assert 2000 in syncs and 2000 in lr  # the run's last step
    if budget == "default":
        assert 20 <= len(syncs) <= 1000 // 4
        assert 320 <= len(lr) <= 2000 // 2
        assert sorted(rollback) == sorted(syncs)  # one decision per sync: all series of a sync or none
    else:
        assert len(syncs) == 1001 and len(lr) == 2000  # 1,000 syncs and the step guard's at 1001
    assert len(read_steps_artifact(client, tracker.run_id, tmp_path)) == 2000


def test_bad_points_per_second_names_the_variable(monkeypatch):
    from hdet_track.tracking.hub import default_points_per_second

    monkeypatch.setenv("HDET_POINTS_PER_SECOND", "-3")
    with pytest.raises(ValueError, match="HDET_POINTS_PER_SECOND .* but got '-3'"):
        default_points_per_second()
    monkeypatch.setenv("HDET_POINTS_PER_SECOND", "inf")
    assert default_points_per_second() is None


def test_onecycle_baseline_has_same_keys_and_schedule_tag(sqlite_uri):
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    train(tracker, spread=0.0, auto_lr=False)
    client = MlflowClient(sqlite_uri)
    run = client.get_run(tracker.run_id)
    assert run.data.tags["hdet.schedule"] == "onecycle"
    assert {"loss", "lr", "hdet/replica_00/lr"} <= set(run.data.metrics)
    ref = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1), 0.1, total_steps=40
    )
    lrs = history(client, tracker.run_id, "lr")
    for k in range(1, 41):
        ref.optimizer.step()
        assert lrs[k] == ref.get_last_lr()[0]
        ref.step()


def test_env_defaults_tracking_uri_experiment_and_attach(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    sched, _ = train(True, steps=20)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("from-env")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == sched.run_ids["mlflow"]
    # MLFLOW_RUN_ID: attach to an existing run instead of creating one.
    existing = client.create_run(exp.experiment_id).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", existing)
    sched, _ = train(True, steps=20)
    assert sched.run_ids["mlflow"] == existing
    assert "hdet/replica_00/lr" in client.get_run(existing).data.metrics
    assert len(client.search_runs([exp.experiment_id])) == 2


@pytest.mark.parametrize("writer_dies", [False, True])
def test_a_given_run_ended_by_a_failed_attempt_is_reopened_by_the_resumed_job_and_ended_by_it(sqlite_uri, writer_dies):
    """MLflowTracker(run_id=...) given the same run in both attempts (MLFLOW_RUN_ID alike): the
    first fails at step 13 and ends it FAILED; the second resumes from the checkpoint at step 10.
    Before, the run stayed FAILED with the first attempt's error (only checkpoint-resumed runs were
    reopened, and a given run finished was left for its owner to end); every step was there.
    ``writer_dies``: the second attempt's tracking process is killed at step 15; its replacement
    found the run RUNNING, took it for its owner's and left it RUNNING after the job finished."""
    client = MlflowClient(sqlite_uri)
    given = client.create_run(client.create_experiment("given")).info.run_id

    from .attempts import attempt

    def track():
        return MLflowTracker(tracking_uri=sqlite_uri, run_id=given)

    def status_at_15(k, sched):
        if k == 15:
            sched.flush()
            second["status"] = client.get_run(given).info.status
            if writer_dies:
                _kill_writer(client, given)
                sched._callbacks.recorder.hub._sinks[0].retry_seconds = 0.05

    first, second = {}, {}
    with pytest.raises(RuntimeError, match="boom"):
        attempt(track(), first, fail_at=13)
    assert client.get_run(given).info.status == "FAILED"
    attempt(track(), second, state=first["state"], during=status_at_15)
    assert second["status"] == "RUNNING"  # reopened while it trains
    run = client.get_run(given)
    assert run.info.status == "FINISHED"
    assert "hdet.error" not in run.data.tags and "boom at step 13" in run.data.tags["hdet.resumed_after"]
    assert MLflowReader(sqlite_uri).read(given).replica_series("loss", 0)[0].tolist() == list(range(1, 21))


def test_two_stores_of_one_backend_each_resume_their_own_run(tmp_path):
    """One scheduler tracked to two MLflow stores: a checkpoint keeps both runs' ids (the second as
    mlflow#2), and a resumed job continues each run in its own store. Before, both were saved under
    'mlflow', so the resume sent both trackers to one id: one store got a new run."""
    from .attempts import attempt

    uris = [f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db")]

    def track():
        return [MLflowTracker(tracking_uri=uri, experiment="two") for uri in uris]

    first = {}
    with pytest.raises(RuntimeError, match="boom"):
        attempt(track(), first, fail_at=13)
    assert set(first["state"]["runs"]) == {"mlflow", "mlflow#2"}
    sched = attempt(track(), {}, state=first["state"])
    assert sched.run_ids == first["state"]["runs"]
    for uri in uris:
        (run,) = MLflowReader(uri).list_runs("two")  # one run per store: the resumed job continued it
        read = MLflowReader(uri).read(run.run_id)
        assert read.status == "FINISHED" and read.replica_series("loss", 0)[0].tolist() == list(range(1, 21))


def test_nested_run_under_parent(sqlite_uri):
    client = MlflowClient(sqlite_uri)
    exp = client.create_experiment("nested")
    parent = client.create_run(exp).info.run_id
    tracker = MLflowTracker(tracking_uri=sqlite_uri, experiment="nested", parent_run_id=parent, run_name="child")
    train(tracker, steps=20)
    run = client.get_run(tracker.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.info.run_name == "child"


def test_real_mlflow_server(mlflow_server, tmp_path):
    tracker = MLflowTracker(tracking_uri=mlflow_server.uri, experiment="server")
    _, seen = train(tracker, steps=30)
    client = MlflowClient(mlflow_server.uri)
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    lr0 = history(client, tracker.run_id, "hdet/replica_00/lr")
    assert [lr0[k] for k, *_ in seen] == pytest.approx([a for _, a, *_ in seen], rel=1e-12)
    assert len(read_steps_artifact(client, tracker.run_id, tmp_path)) == 30


def test_secrets_are_never_logged(sqlite_uri, monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "hunter2-secret")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef")
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    train(tracker, steps=20, run_name="nightly")
    run = MlflowClient(sqlite_uri).get_run(tracker.run_id)
    blob = repr(run.data.params) + repr(run.data.tags)
    assert "hunter2-secret" not in blob and "0123456789abcdef" not in blob
    assert not any(is_secret(k) for k in run.data.params)
    assert "spread" in run.data.params  # the rest is there
    # Config values carrying a secret, or keys that look secret, are dropped before logging.
    assert redact({"db_password": "x", "url": "https://u:hunter2-secret@host", "lr": 0.1}) == {"lr": 0.1}


def test_context_manager_marks_failed_with_error(sqlite_uri):
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="boom"):
        with HDETScheduler(opt, 0.1, total_steps=50, sync_every=5, track=tracker) as sched:
            for k in range(12):
                opt.step()
                sched.step(1.0)
                if k == 7:
                    raise RuntimeError("boom at step 8")
    run = MlflowClient(sqlite_uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    assert "boom at step 8" in run.data.tags["hdet.error"]
    assert sorted(history(MlflowClient(sqlite_uri), tracker.run_id, "hdet/sync/divergence")) == [5]


JOB = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import MLflowTracker
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = MLflowTracker(tracking_uri=sys.argv[1])
    sched = HDETScheduler(opt, 0.1, total_steps=1000, sync_every=5, track=tracker)
    for k in range(1000):
        opt.step(); sched.step(1.0)
        if k == 11:
            sched.flush()
            print(tracker.run_id, flush=True)
            if sys.argv[2] == "raise":
                raise ValueError("diverged at step 12")
            time.sleep(60)
    """
)


@pytest.mark.parametrize(("mode", "status"), [("raise", "FAILED"), ("sigterm", "KILLED"), ("sigint", "KILLED")])
def test_crashing_or_killed_job_ends_failed_or_killed(sqlite_uri, tmp_path, mode, status):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = subprocess.Popen(
        [sys.executable, str(script), sqlite_uri, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background (``cmd &``) inherits SIGINT ignored; a job gets the default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    run_id = proc.stdout.readline().strip()
    if mode != "raise":
        proc.send_signal(15 if mode == "sigterm" else 2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    client = MlflowClient(sqlite_uri)
    run = client.get_run(run_id)
    assert run.info.status == status, err[-2000:]
    if mode == "raise":
        assert "diverged at step 12" in run.data.tags["hdet.error"]
    # Synced windows are kept: every step in the event archive, the metric history thinned to a stride.
    steps, _ = MLflowReader(sqlite_uri).read(run_id).replica_series("lr", 0)
    assert list(steps) == list(range(1, 11))
    assert set(history(client, run_id, "hdet/replica_00/lr")) <= set(range(1, 11))


class FlakyTracker(Tracker):
    """Fault injection: a backend whose log() raises for its first `failures` calls."""

    name = "flaky"

    def __init__(self, failures):
        self.failures = failures
        self.calls = 0
        self.points = []
        self.events = []
        self.ended = None

    def start(self, run_start):
        pass

    def log(self, batch: Batch):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("backend down (injected)")
        self.points += batch.points
        self.events += batch.events

    def finish(self, run_end):
        self.ended = run_end.status


def test_backend_outage_is_spilled_and_replayed_in_order(caplog):
    flaky = FlakyTracker(failures=3)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=60, sync_every=5, track=flaky)
    sched._callbacks.recorder.hub._sinks[0].retry_seconds = 0.05
    for k in range(60):
        opt.step()
        sched.step(float(k))
        if k % 5 == 4:
            sched.flush()  # one delivery per sync, so that several fail
    sched.close()
    assert flaky.ended == "FINISHED"
    lr = [(p.step, p.value) for p in flaky.points if p.key == "hdet/replica_00/lr"]
    assert [s for s, _ in lr] == list(range(1, 61))  # every point, once, in order
    losses = {p.step: p.value for p in flaky.points if p.key == "hdet/replica_00/loss"}
    assert losses == {k + 1: float(k) for k in range(60)}
    assert "unavailable" in caplog.text and "is back" in caplog.text


class BrokenTracker(FlakyTracker):
    def __init__(self):
        super().__init__(failures=10**9)

    def finish(self, run_end):
        raise ConnectionError("still down")


def test_backend_that_never_works_does_not_stop_training(caplog):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=30, sync_every=5, track=BrokenTracker())
    sched._callbacks.recorder.hub.shutdown_timeout = 0.5
    for _ in range(30):
        opt.step()
        sched.step(1.0)
    sched.close()
    assert math.isfinite(opt.param_groups[0]["lr"])
    spill = sched._callbacks.recorder.hub._sinks[0].spill_path
    assert spill.exists() and spill.read_text().count("\n") >= 1  # unsent data is kept, not lost
    assert "still unavailable at shutdown" in caplog.text


def test_an_mlflow_that_cannot_be_imported_is_named_with_its_reason_and_nothing_is_lost(sqlite_uri, tmp_path):
    """A broken MLflow install (fault injected: a package named mlflow whose import raises, first on
    the path) is found by the writer process, which imports MLflow: the warning names the backend
    and the import's own error, training goes on, and the run's data waits in the spill file. An
    import cannot come back in this process, so the exit does not wait out the shutdown timeout
    (600 s here; it used to, and the job hit the 150 s limit below)."""
    (tmp_path / "broken" / "mlflow").mkdir(parents=True)
    (tmp_path / "broken" / "mlflow" / "__init__.py").write_text('raise ImportError("protobuf mismatch (injected)")\n')
    job = textwrap.dedent(f"""
        import torch
        from hdet_track import HDETScheduler
        from hdet_track.tracking.mlflow import MLflowTracker
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=MLflowTracker(tracking_uri={sqlite_uri!r}))
        for _ in range(10):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step(); sched.step(loss)
        sched.close()
        print("trained", sched.last_epoch)
    """)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "broken"), HDET_TRACK_SHUTDOWN_TIMEOUT="600")
    proc = subprocess.run(
        [sys.executable, "-c", job], capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0 and "trained 10" in proc.stdout, proc.stderr[-3000:]
    assert "MLflowTracker is unavailable" in proc.stderr  # the backend, not the process wrapper around it
    assert "MLflow is installed but importing it failed (ImportError: protobuf mismatch (injected))" in proc.stderr
    (spill,) = (tmp_path / ".hdet-spill").glob("spill-mlflow-*.jsonl")
    assert '"hdet/replica_00/lr"' in spill.read_text()


def test_archive_chunks_appear_while_the_run_is_live(sqlite_uri, tmp_path):
    tracker = MLflowTracker(tracking_uri=sqlite_uri, chunk_seconds=0.0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=100, sync_every=10, track=tracker)
    client = MlflowClient(sqlite_uri)
    seen_chunks = []
    for k in range(1, 41):
        opt.step()
        sched.step(1.0)
        if k % 10 == 0:
            assert sched.flush()
            assert client.get_run(tracker.run_id).info.status == "RUNNING"
            seen_chunks.append(len(client.list_artifacts(tracker.run_id, "hdet_events")))
    assert seen_chunks[0] >= 1 and seen_chunks == sorted(seen_chunks) and seen_chunks[-1] > seen_chunks[0]
    assert [r["step"] for r in read_steps_artifact(client, tracker.run_id, tmp_path)] == list(range(1, 41))
    sched.close()
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_several_trackers_each_get_everything():
    a, b = FlakyTracker(failures=0), FlakyTracker(failures=1)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=[a, b])
    sched._callbacks.recorder.hub._sinks[1].retry_seconds = 0.0
    for _ in range(20):
        opt.step()
        sched.step(1.0)
    sched.close()
    for t in (a, b):
        assert t.ended == "FINISHED"
        assert sorted(p.step for p in t.points if p.key == "lr") == list(range(1, 21))


def ten_steps(tracker, **kw):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=tracker, **kw)
    for _ in range(10):
        opt.step()
        sched.step(1.0)
    sched.flush()
    return sched


def test_by_default_the_run_stays_open_after_the_last_step_for_final_metrics(sqlite_uri):
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    sched = ten_steps(tracker)
    client = MlflowClient(sqlite_uri)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    sched.log_metrics({"val_loss": 0.25})  # after training: the step defaults to the last one
    sched.close()
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert history(client, tracker.run_id, "val_loss") == {10: 0.25}


def test_a_bad_user_metric_raises_at_the_call_and_costs_the_run_nothing(sqlite_uri):
    """A metric that is not a number, or named as one of HDET's own series, used to reach the
    writer thread, where it took the syncs and steps queued with it down (steps 1-10 and the syncs
    at 5 and 10 were lost), or went into HDET's ``loss`` series. Now it raises at the call, naming
    it; tensors and numpy scalars are numbers."""
    import numpy as np

    tracker = MLflowTracker(tracking_uri=sqlite_uri, experiment="bad-metric")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    bad = [
        ({"note": "abc"}, TypeError, r"metric 'note' to be a real number .* but got 'abc'"),
        (
            {"grid": torch.ones(3)},
            TypeError,
            r"metric 'grid' .* but got a Tensor of dtype torch.float32 and shape \(3,\)",
        ),
        ({"z": torch.tensor(1j)}, TypeError, r"metric 'z' .* one-element real tensor .* dtype torch.complex64"),
        ({"loss": 0.5}, ValueError, r"other than HDET's own series .* but got 'loss'"),
        ({"hdet/x": 0.5}, ValueError, r"but got 'hdet/x'"),
        ({"": 0.5}, ValueError, r"non-empty strings, but got ''"),
        # names MLflow refuses: they used to fail in the writer, and the spill replayed them first for ever
        ({"top-1 acc (%)": 0.5}, ValueError, r"a metric name MLflow takes, but got 'top-1 acc \(%\)'"),
        ({"acc@1": 0.5}, ValueError, r"but got 'acc@1': names may only contain letters"),
        ({"a/../b": 0.5}, ValueError, r"but got 'a/../b': names must not be paths .* resolves to 'b'"),
        ({"x" * 251: 0.5}, ValueError, r"at most 250 characters \(this one has 251\)"),
        ([("val_loss", 0.5)], TypeError, r"mapping of names to numbers .* but got list"),
    ]
    with HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, track=tracker) as sched:
        for k in range(1, 21):
            opt.step()
            sched.step(1.0 / k)
            if k == 10:
                for metrics, error, match in bad:
                    with pytest.raises(error, match=match):
                        sched.log_metrics(metrics)
                for step in (-1, 2**63):
                    with pytest.raises(ValueError, match=rf"step to be an integer in \[0, 2\*\*63\) .* but got {step}"):
                        sched.log_metrics({"val_loss": 0.5}, step=step)
                sched.log_metrics(
                    {"val_loss": torch.tensor(0.25), "val_accuracy": np.float32(0.5), "eval/top-1 acc:x": 1}
                )
                sched.log_metrics({"val_loss": np.array([0.125])}, step=np.int64(11))
                sched.log_metrics({"val_accuracy": np.array(0.75)}, step=12.0)
    client = MlflowClient(sqlite_uri)
    assert history(client, tracker.run_id, "val_loss") == {10: 0.25, 11: 0.125}
    assert history(client, tracker.run_id, "val_accuracy") == {10: 0.5, 12: 0.75}
    assert history(client, tracker.run_id, "eval/top-1 acc:x") == {10: 1.0}  # what MLflow takes is kept
    assert sorted(history(client, tracker.run_id, "loss")) == list(range(1, 21))  # HDET's own, untouched
    assert sorted(history(client, tracker.run_id, "hdet/sync/divergence")) == [5, 10, 15, 20]
    run = MLflowReader(sqlite_uri).read(tracker.run_id)
    assert [c.step for c in run.converge] == [5, 10, 15, 20]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))


def test_tracker_settings_a_backend_would_refuse_fail_when_the_tracker_is_built(sqlite_uri):
    """They used to fail in the writer at the run's start: no run (or an empty RUNNING one per
    retry), every batch in the spill, ``hdet-track recover`` unable to deliver it."""
    bad = [
        ({"experiment": 7}, ValueError, "experiment to be a non-empty str or None, but got 7"),
        ({"run_id": ""}, ValueError, "run_id to be a non-empty str or None, but got ''"),
        ({"chunk_seconds": "3"}, ValueError, r"chunk_seconds in \[0.0, inf\), but got '3'"),
        ({"tags": {"bad key!": "x"}}, ValueError, r"tag names MLflow takes, but got 'bad key!': names may only"),
        ({"tags": {"owner": ["a"]}}, TypeError, r"tags\['owner'\] to be a str \(or a number\), but got list"),
        ({"tags": ["a"]}, TypeError, "tags to be a dict of str to str, but got list"),
    ]
    for kw, error, match in bad:
        with pytest.raises(error, match=match):
            MLflowTracker(tracking_uri=sqlite_uri, **kw)
    import numpy as np

    tracker = MLflowTracker(
        tracking_uri=sqlite_uri, experiment="tags", tags={"n": 5, "team": "vision", "k": np.int64(3)}
    )
    ten_steps(tracker).close()
    run = MlflowClient(sqlite_uri).get_run(tracker.run_id)
    assert run.data.tags["n"] == "5" and run.data.tags["k"] == "3"  # numbers stored as MLflow does
    assert run.data.tags["team"] == "vision"
    assert len(run.data.metrics) > 0 and run.info.status == "FINISHED"
    assert len(MlflowClient(sqlite_uri).search_runs([run.info.experiment_id])) == 1


def test_close_at_end_true_ends_the_run_at_the_last_step_and_says_what_it_drops(sqlite_uri, caplog):
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    sched = ten_steps(tracker, close_at_end=True)
    client = MlflowClient(sqlite_uri)
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    with caplog.at_level("WARNING", logger="hdet_track"):
        sched.log_metrics({"val_loss": 0.25})
    assert "dropping late metrics ['val_loss'] at step 10" in caplog.text
    assert history(client, tracker.run_id, "val_loss") == {}


@pytest.mark.parametrize("how", ["close", "with-block", "failed", "untracked"])
def test_a_one_process_job_stopped_between_syncs_keeps_every_step_and_changes_nothing(sqlite_uri, caplog, how):
    """An early stop at step 13 of 40, syncs every 5: a one-process job has every step's loss in
    hand, so close() puts steps 11-13 in the run (they used to be dropped: the rows reach tracking
    with each sync), as rows only: no sync, so nothing changes. The losses jump in that window, which
    a sync would have answered with a rollback of the model; a second close() adds nothing; a failed
    job keeps its rows up to its last sync (a resume redoes the steps after it: a sync's rows come
    from one attempt); an untracked job is untouched."""
    tracker = MLflowTracker(tracking_uri=sqlite_uri, experiment="early") if how != "untracked" else False
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=40, sync_every=5, model=model, auto_lr=True, track=tracker)
    losses = [1.0] * 10 + [1.0, 3.0, 5.0]
    before = []

    def train():
        for loss in losses:
            opt.step()
            sched.step(loss)
        before.extend(p.detach().clone() for p in model.parameters())
        if how == "failed":
            raise RuntimeError("stopped at step 13")

    if how == "close":
        train()
        sched.close()
    else:
        with pytest.raises(RuntimeError) if how == "failed" else contextlib.nullcontext():
            with sched:
                train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no rollback, no average
    assert sched.last_sync.step == 10 and sched.state_dict()["window"]["losses"] == losses[10:]
    with caplog.at_level("WARNING", logger="hdet_track"):
        sched.close()  # idempotent: nothing more to log
    assert "dropping" not in caplog.text and "not logged" not in caplog.text
    if how == "untracked":
        return
    reader = MLflowReader(sqlite_uri)
    (summary,) = reader.list_runs("early")
    run = reader.read(summary.run_id)
    last = 10 if how == "failed" else 13
    assert run.status == ("FAILED" if how == "failed" else "FINISHED")
    steps, logged = run.replica_series("loss", 0)
    assert list(steps) == list(range(1, last + 1)) and list(logged) == losses[:last]
    assert list(run.replica_series("lr", 0)[0]) == list(range(1, last + 1))
    assert [e.step for e in run.converge] == [5, 10]  # the rows are not a sync
    client = MlflowClient(sqlite_uri)
    assert sorted(history(client, summary.run_id, "loss")) == list(range(1, last + 1))


def test_closing_after_a_sync_that_raised_logs_no_step_twice(sqlite_uri):
    """Every loss non-finite from step 8: the sync at step 10 raises (no healthy replica) after
    handing its record over, before the step counts. A caller that catches it and closes FINISHED
    must not get that window again (it came back one step off: steps 5-9 twice)."""
    from hdet_track import NonFiniteReplicasError

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=40, sync_every=5, model=model, track=MLflowTracker(sqlite_uri))
    with pytest.raises(NonFiniteReplicasError):
        for k in range(1, 41):
            opt.step()
            if k >= 8:  # diverged: the parameters too
                with torch.no_grad():
                    model.weight.fill_(math.nan)
            sched.step(1.0 if k < 8 else math.nan)
    sched.close()
    reader = MLflowReader(sqlite_uri)
    (summary,) = reader.list_runs()
    steps, _ = reader.read(summary.run_id).replica_series("loss", 0)
    assert list(steps) == list(range(1, 11))


def test_a_job_resumed_from_a_checkpoint_taken_after_those_rows_logs_each_step_once(sqlite_uri):
    """Stopped at step 13 (syncs every 5) with a checkpoint, closed (rows 11-13 logged), resumed from
    the checkpoint to step 20: every step once, and the syncs the resumed job made (15, 20)."""

    def job(state=None):
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, model=model, track=MLflowTracker(sqlite_uri))
        if state is not None:
            sched.load_state_dict(state)
        return opt, sched

    opt, sched = job()
    for k in range(1, 14):
        opt.step()
        sched.step(1.0 / k)
    state = sched.state_dict()
    sched.close()
    opt, sched = job(state)
    for k in range(14, 21):
        opt.step()
        sched.step(1.0 / k)
    sched.close()
    reader = MLflowReader(sqlite_uri)
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    steps, losses = run.replica_series("loss", 0)
    assert list(steps) == list(range(1, 21)) and list(losses) == pytest.approx([1.0 / k for k in range(1, 21)])
    assert [e.step for e in run.converge] == [5, 10, 15, 20] and run.status == "FINISHED"
    client = MlflowClient(sqlite_uri)
    assert sorted(m.step for m in client.get_metric_history(summary.run_id, "loss")) == list(range(1, 21))


def one_run(tracker, name, val_loss, steps=10):
    """A scheduler's whole run on ``tracker``: ``steps`` steps, a final metric, then close()."""
    sched = ten_steps(tracker, run_name=name)
    sched.log_metrics({"val_loss": val_loss})
    sched.close()
    return sched.run_ids["mlflow"]


def run_snapshot(client, run_id):
    run = client.get_run(run_id)
    metrics = {k: history(client, run_id, k) for k in run.data.metrics}
    return run.info.status, run.info.end_time, run.info.run_name, dict(run.data.params), metrics


@pytest.mark.parametrize("isolate", [True, False], ids=["child-process", "in-process"])
def test_one_tracker_object_for_two_schedulers_in_turn_makes_two_runs(sqlite_uri, tmp_path, isolate):
    """Each scheduler is one run, also when the same MLflowTracker object is passed to both (the
    second used to log into the first, finished run, or fail and spill into it)."""
    tracker = MLflowTracker(tracking_uri=sqlite_uri, experiment="reuse")
    tracker.isolate = isolate
    client = MlflowClient(sqlite_uri)
    first = one_run(tracker, "first", 0.5)
    before = run_snapshot(client, first)
    second = one_run(tracker, "second", 0.25)
    assert first and second and first != second
    assert tracker.run_id == second  # the object names the run it logged last
    runs = client.search_runs([client.get_experiment_by_name("reuse").experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted([first, second])
    assert run_snapshot(client, first) == before  # the first run is untouched by the second
    reader = MLflowReader(sqlite_uri)
    for run_id, name, val in [(first, "first", 0.5), (second, "second", 0.25)]:
        run = reader.read(run_id)
        assert (run.status, run.name) == ("FINISHED", name)
        assert [c.step for c in run.converge] == [5, 10]
        assert list(run.replica_series("loss", 0)[0]) == list(range(1, 11))
        assert list(run.metrics["val_loss"][1]) == [val]
        assert not run.tags.get("hdet.error")
    assert not list(tracker.spill_dir().glob("spill-*"))  # nothing was left undelivered


def test_one_tracker_object_for_two_open_runs_at_once_is_an_error(sqlite_uri):
    tracker = MLflowTracker(tracking_uri=sqlite_uri, experiment="shared")
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=tracker)
    for _ in range(3):
        opt.step()
        sched.step(1.0)
    opt2 = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"Expected track to be a tracker object that no other open run uses") as err:
        HDETScheduler(opt2, 0.1, total_steps=10, sync_every=5, track=tracker)
    assert "Pass a new tracker object to each scheduler (MLflowTracker(...)), or track=True / track='mlflow'" in str(
        err.value
    )
    with pytest.raises(ValueError, match="Expected track to list each tracker object once"):
        HDETScheduler(opt2, 0.1, total_steps=10, sync_every=5, track=[MLflowTracker(sqlite_uri)] * 2)
    sched.close("KILLED")
    first = tracker.run_id
    client = MlflowClient(sqlite_uri)
    assert client.get_run(first).info.status == "KILLED"
    second = one_run(tracker, "after", 0.1)  # once the first run ended, the object is free again
    assert second != first and client.get_run(second).info.status == "FINISHED"
    assert client.get_run(first).info.status == "KILLED"


def test_run_list_and_read_agree_when_the_last_loss_is_nan_or_the_steps_chunk_is_torn(sqlite_uri, tmp_path):
    """The run list's final loss is the last finite one, as a full read's (MLflow's latest value may
    be NaN: a blow-up's step); and a torn steps chunk leaves the store's per-replica histories in use."""
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    track = MLflowTracker(tracking_uri=sqlite_uri, experiment="nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with HDETScheduler(opt, 0.1, total_steps=12, spread=0.0, sync_every=4, track=track) as s:
            for k in range(1, 13):
                opt.step()
                s.step(1.0 / k)
    reader = MLflowReader(sqlite_uri)
    (summary,) = reader.list_runs("nan")
    MlflowClient(sqlite_uri).log_metric(summary.run_id, "loss", math.nan, step=13)  # a blow-up logged last
    (summary,) = reader.list_runs("nan")
    assert summary.final_loss == pytest.approx(reader.read(summary.run_id).final_loss()) == pytest.approx(1 / 12)
    (chunk,) = tmp_path.rglob("hdet_events/steps-*.parquet")
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    run = reader.read(summary.run_id)
    assert any("steps-" in w for w in run.warnings) and run.steps.step.tolist() == list(range(1, 13))
    assert run.final_loss() == pytest.approx(1 / 12) and run.mean_series("lr")[0].tolist()[-1] == 12


KILL_BOTH_JOB = """
import sys, time, torch
from hdet_track import HDETScheduler
from hdet_track.tracking.mlflow import MLflowTracker
opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
sched = HDETScheduler(opt, 0.1, total_steps=30, spread=0.0, sync_every=5,
                      track=MLflowTracker(tracking_uri=sys.argv[1], experiment="both"))
for k in range(1, 11):
    opt.step()
    sched.step(1.0 / k)
assert sched.flush() is True
print("READY", flush=True)
time.sleep(300)
"""


def test_a_run_whose_job_and_tracking_process_were_both_killed_reads_killed(sqlite_uri, tmp_path):
    """SIGKILL to the job and its tracking process (a container stopped): nobody ends the run, which
    MLflow keeps RUNNING; the readers report it KILLED once both are gone (RUNNING while alive)."""
    script = tmp_path / "job.py"
    script.write_text(KILL_BOTH_JOB)
    proc = subprocess.Popen(
        [sys.executable, str(script), sqlite_uri], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        reader = MLflowReader(sqlite_uri)
        (summary,) = reader.list_runs("both")
        assert summary.status == "RUNNING" and summary.live
        writer = json.loads(MlflowClient(sqlite_uri).get_run(summary.run_id).data.tags["hdet.owner"])["writer"]
        os.kill(writer["pid"], signal.SIGKILL)  # the tracking process runs in a session of its own
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30
    while True:  # the tracking process is reaped by init a moment later
        (summary,) = reader.list_runs("both")
        if summary.status != "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert summary.status == "KILLED" and not summary.live
    assert MlflowClient(sqlite_uri).get_run(summary.run_id).info.status == "RUNNING"  # the store is left as it is
    run = reader.read(summary.run_id)
    assert run.status == "KILLED" and f"pid {proc.pid}" in run.tags["hdet.error"], run.tags.get("hdet.error")
    assert "and its tracking process ended without ending the run" in run.tags["hdet.error"]
    assert [c.step for c in run.converge] == [5, 10]


def test_a_file_store_is_refused_when_the_tracker_is_made_and_still_read(tmp_path, monkeypatch):
    """In a file store every metric name is a file, and HDET's names nest (hdet/sync/left_out and
    hdet/sync/left_out/replica_00): a run lost points on "Not a directory", was ended KILLED with
    its data left in the spill, and the retries of the half-done log_batch wrote points up to 10x.
    Readers took `file:./mlruns` for a missing path, and a file store's directory for W&B's."""
    from hdet_track.readers import open_reader
    from hdet_track.readers.mlflow import MLflowReader

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for uri in ("mlruns", "file:./mlruns", f"file://{tmp_path / 'mlruns'}"):
        with pytest.raises(ValueError, match=r"Expected tracking_uri to be a database .* file store"):
            MLflowTracker(tracking_uri=uri)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "mlruns")
    with pytest.raises(ValueError, match=r"Expected MLFLOW_TRACKING_URI .* got 'mlruns'"):
        HDETScheduler(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), 0.1, total_steps=4, track="mlflow")
    MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'ok.db'}")  # a database is taken, whatever the variable says
    client = MlflowClient(f"file://{tmp_path / 'mlruns'}")  # a run that plain MLflow logged there
    run_id = client.create_run(client.create_experiment("plain")).info.run_id
    client.log_metric(run_id, "loss", 0.5, step=3)
    for source in ("file:./mlruns", "mlruns", str(tmp_path / "mlruns")):
        reader = open_reader(source)
        assert isinstance(reader, MLflowReader), source
        assert [s.run_id for s in reader.list_runs(experiment="plain")] == [run_id], source
    from hdet_track.readers import ReaderError

    with pytest.raises(ReaderError, match="no such directory"):
        open_reader("file:./typo")  # MLflow would create it
    assert not (tmp_path / "typo").exists()
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"file://{tmp_path / 'mlruns'}")  # set in code (MLflow 2's default is ./mlruns)
    try:
        with pytest.raises(
            ValueError, match=r"Expected (MLFLOW_TRACKING_URI|MLflow's tracking URI .*) to be a database"
        ):
            MLflowTracker()
    finally:
        mlflow.set_tracking_uri(before)


def test_a_second_training_from_step_1_in_a_given_run_is_named(sqlite_uri, caplog):
    """Lightning's Trainer fit again with the same MLFlowLogger, Hugging Face's train() twice: each
    training logged steps 1-N into the one given run, which read as one mixed series, with no word."""
    import logging

    from mlflow.tracking import MlflowClient

    client = MlflowClient(sqlite_uri)
    run_id = client.create_run(client.create_experiment("given")).info.run_id

    def train(steps):
        opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
        tracker = MLflowTracker(tracking_uri=sqlite_uri, run_id=run_id)
        tracker.isolate = False  # its warning in this process (the tracker's own process logs it otherwise)
        sched = HDETScheduler(opt, 0.1, total_steps=steps, sync_every=2, track=tracker)
        for k in range(1, steps + 1):
            opt.step()
            sched.step(1.0 / k)
        sched.close()

    with caplog.at_level(logging.WARNING):
        train(4)
        assert "already holds an earlier HDET training" not in caplog.text
        train(6)
    assert f"MLflow run {run_id} already holds an earlier HDET training (through step 4)" in caplog.text


def _log_with_a_secret(secret: str, track) -> HDETScheduler:
    """A run whose param-group name, run name and compare group carry ``secret``."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD([{"params": model.parameters(), "name": f"enc-{secret}"}], lr=0.1)
    sched = HDETScheduler(
        opt, 0.1, total_steps=10, sync_every=5, track=track, run_name=f"nightly-{secret}", compare_group=f"g-{secret}"
    )
    for k in range(1, 11):
        opt.step()
        sched.step(1.0 / k)
    sched.close()
    return sched


def test_a_secret_in_a_list_a_tag_or_a_run_name_is_never_logged(sqlite_uri, monkeypatch):
    """Only string values were checked, and only params: a param-group name holding a secret went
    out in the param_groups list, and a run name or compare group holding one became MLflow's
    runName and hdet.compare_group tags, and went into the event archive. Names and groups are kept
    with the secret masked, so the run is still found by them. A secret-looking variable holding a
    flag or a number (TOKENIZERS_PARALLELISM=false) hides nothing: params that read false stay."""
    monkeypatch.setenv("MY_API_KEY", "sekret-xyz")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MAX_TOKENS", "4096")
    sched = _log_with_a_secret("sekret-xyz", MLflowTracker(tracking_uri=sqlite_uri))
    run = MlflowClient(sqlite_uri).get_run(sched.run_ids["mlflow"])
    blob = repr(run.data.params) + repr(run.data.tags) + repr(run.info)
    assert "sekret-xyz" not in blob
    assert run.data.params["param_groups"] == '["enc-***"]' and run.data.params["auto_lr"] == "false"
    assert run.data.tags["hdet.compare_group"] == "g-***" and run.info.run_name == "nightly-***"
    (summary,) = MLflowReader(sqlite_uri).list_runs(compare_group="g-***")
    assert summary.run_id == run.info.run_id
    read = MLflowReader(sqlite_uri).read(summary.run_id)  # the event archive too
    assert read.start is not None and read.compare_group == "g-***" and read.start.param_groups == ["enc-***"]


def test_log_every_takes_a_sweeps_numpy_or_tensor_integer(sqlite_uri):
    """log_every=torch.tensor(2) or np.int64(2) passed the scheduler's check, then failed in the
    tracking hub at the first step; it now thins the series as the int 2 does."""
    import numpy as np

    logged = []
    for log_every in (2, np.int64(2), torch.tensor(2)):
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tracker = MLflowTracker(tracking_uri=sqlite_uri)
        sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=tracker, log_every=log_every)
        for k in range(1, 11):
            opt.step()
            sched.step(1.0 / k)
        sched.close()
        logged.append(sorted(history(MlflowClient(sqlite_uri), tracker.run_id, "hdet/replica_00/loss")))
    assert logged[0] == logged[1] == logged[2] and logged[0] != list(range(1, 11))


def test_a_spill_folder_that_cannot_be_made_does_not_lose_a_run_the_store_takes(sqlite_uri):
    """An audit's finding: where the spill folder could not be created (a read-only home, a file in
    its place) the run's start failed though the store worked: the run was left RUNNING with no
    points. Its archive chunks now wait in a temporary folder, and the run is whole."""
    from pathlib import Path

    from hdet_track.tracking.spill import DIRNAME

    db = Path(sqlite_uri[len("sqlite:///") :])
    (db.parent / DIRNAME).write_text("a file where the spill folder would go")
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    _, seen = train(tracker, steps=20)
    run = MlflowClient(sqlite_uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert sorted(history(MlflowClient(sqlite_uri), tracker.run_id, "hdet/replica_00/loss")) == list(range(1, 21))
    read = MLflowReader(sqlite_uri).read(tracker.run_id)
    assert read.replica_series("loss", 0)[0].tolist() == list(range(1, 21))
    assert not any("archive" in w for w in read.warnings), read.warnings  # its event archive reached the store


def test_a_disk_that_fills_at_the_runs_end_still_ends_the_run(sqlite_uri, monkeypatch):
    """An audit's finding: the event archive's last write failing on a full disk made the store
    count as down at the run's end, and the end was lost: a finished job's run stayed RUNNING
    (read KILLED). The run now ends FINISHED with every step's metrics, and the error is logged."""
    from hdet_track.tracking import archive

    real = archive._write_atomic
    full = {"now": False}

    def write_atomic(table, path):  # the fault: this host's disk fills after the steps chunk is written
        if full["now"] and path.name.startswith("events-"):
            raise OSError(28, "No space left on device")
        return real(table, path)

    monkeypatch.setattr(archive, "_write_atomic", write_atomic)
    tracker = MLflowTracker(tracking_uri=sqlite_uri)
    tracker.isolate = False  # in this process, where the fault is injected
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=tracker)
    for k in range(1, 21):
        opt.step()
        sched.step(1.0 / k)
    full["now"] = True
    sched.close()
    client = MlflowClient(sqlite_uri)
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert sorted(history(client, tracker.run_id, "hdet/replica_00/loss")) == list(range(1, 21))
    # the steps chunk written before the disk filled reached the run (it used to be deleted unsent)
    assert any(
        a.path.endswith(".parquet") and "steps-" in a.path for a in client.list_artifacts(tracker.run_id, "hdet_events")
    )


def test_a_retry_while_the_backend_is_down_tries_one_batch_and_leaves_the_spill_alone(tmp_path, monkeypatch):
    """An audit measured each retry during a long outage parse and rewrite the whole spill in the
    training process (1.3 s a retry after 30 minutes, every 2 s). A retry now sends the first batch
    alone; while that fails the spill file is not rewritten, and the retries space out (up to 4x).
    When the backend is back, every batch goes, once, in order."""
    from hdet_track.tracking.base import Point
    from hdet_track.tracking.hub import _Sink
    from hdet_track.tracking.spill import SpillFile

    flaky = FlakyTracker(failures=10**9)
    sink = _Sink(flaky, tmp_path, retry_seconds=1.0)
    for step in range(1, 51):
        sink.deliver(Batch(points=[Point("loss", float(step), step, 0)]))
    before = (sink.spill_path.stat().st_ino, sink.spill_path.read_bytes())
    parsed = []  # the whole file parsed: what a retry must not cost while the backend is down
    whole = SpillFile.batches
    monkeypatch.setattr(SpillFile, "batches", lambda self: parsed.append(1) or whole(self))
    waits = []
    for _ in range(4):
        calls = flaky.calls
        start = time.monotonic()
        assert not sink._replay()
        waits.append(sink.next_retry - start)
        assert flaky.calls == calls + 1  # the first batch alone
    assert (sink.spill_path.stat().st_ino, sink.spill_path.read_bytes()) == before and parsed == []
    # longer waits, up to 4x retry_seconds (the first may already be 4: a slow machine retried before)
    rounded = [round(w, 1) for w in waits]  # (each wait is measured from its own clock reading)
    assert rounded == sorted(rounded) and 1.5 < waits[0] and abs(waits[-1] - 4.0) < 0.5, waits
    flaky.failures = 0
    assert sink._replay() and not sink.spill_path.exists()
    assert [p.step for p in flaky.points] == list(range(1, 51))


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped by its parent
    except FileNotFoundError:
        return True


def test_a_tracker_process_that_dies_mid_run_is_replaced_and_the_run_loses_nothing(sqlite_uri, tmp_path, caplog):
    """The MLflow child process killed (the out-of-memory killer's pick, a crash in a library) while
    its archive rows were only in its memory: the next retry starts another child that uploads what
    the dead one left, reopens the run and is given again what was lost with it. Before, every later
    batch went to the spill, the run stayed RUNNING and the dashboard saw nothing more of it."""
    tracker = MLflowTracker(tracking_uri=sqlite_uri, experiment="restart", chunk_seconds=3600.0)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=40, spread=0.3, sync_every=5, track=tracker)
    sched._callbacks.recorder.hub._sinks[0].retry_seconds = 0.05
    client = MlflowClient(sqlite_uri)
    for k in range(1, 41):
        opt.step()
        sched.step(1.0 / k)
        if k in (12, 27):  # twice: each death gets its own replacement
            _wait_logged(client, tracker, k - 2)
            # those steps' archive rows are in the child's memory (no chunk is due for an hour)
            assert not any(f.path.endswith(".parquet") for f in client.list_artifacts(tracker.run_id, "hdet_events"))
            _kill_writer(client, tracker.run_id)
    with caplog.at_level("WARNING", logger="hdet_track"):
        sched.close()
    (run,) = client.search_runs([client.get_experiment_by_name("restart").experiment_id])
    assert run.info.run_id == tracker.run_id and run.info.status == "FINISHED"
    rows = read_steps_artifact(client, run.info.run_id, tmp_path)
    assert sorted(r["step"] for r in rows) == list(range(1, 41))  # every step once, those the dead held too
    assert sorted(history(client, run.info.run_id, "hdet/replica_00/loss")) == list(range(1, 41))
    hdet_run = MLflowReader(sqlite_uri).read(run.info.run_id)
    assert [c.step for c in hdet_run.converge] == list(range(5, 41, 5))
    assert caplog.text.count("tracker process died; starting another") == 2
    assert not list((tmp_path / ".hdet-spill").glob("*")), "a spill or a pending folder was left behind"


def _wait_logged(client, tracker, step):
    """Until ``tracker``'s process has started its run and logged ``step`` (a new child imports
    MLflow: seconds on a loaded machine)."""
    deadline = time.monotonic() + 120
    while tracker.run_id is None or max(history(client, tracker.run_id, "hdet/replica_00/loss"), default=0) < step:
        assert time.monotonic() < deadline, "the writer never logged"
        time.sleep(0.05)


def _kill_writer(client, run_id):
    """SIGKILL the run's tracking process (its pid is in the run's owner tag); wait until it is gone."""
    writer = json.loads(client.get_run(run_id).data.tags["hdet.owner"])["writer"]["pid"]
    os.kill(writer, signal.SIGKILL)
    while not _gone(writer):
        time.sleep(0.01)
    return writer


def test_a_replacement_whose_start_fails_keeps_what_the_dead_one_held_and_tries_again(
    sqlite_uri, tmp_path, caplog, monkeypatch
):
    """The backend failed the replacement's start (a locked database, a server away for a moment):
    the batches the dead child held were dropped, and the new child, never started, failed every
    later call; the run stayed RUNNING with the rest in the spill. Now the next retry starts it again."""
    from .jobs.refusing import CarryOnFailsOnce

    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    tracker = CarryOnFailsOnce(tracking_uri=sqlite_uri, experiment="restart", chunk_seconds=3600.0)
    tracker.marker = str(tmp_path / "fail-the-next-carry-on")
    opt = torch.optim.SGD(nn.Linear(3, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=30, sync_every=5, track=tracker)
    sched._callbacks.recorder.hub._sinks[0].retry_seconds = 0.05
    client = MlflowClient(sqlite_uri)
    for k in range(1, 31):
        opt.step()
        sched.step(1.0 / k)
        if k == 12:
            _wait_logged(client, tracker, 10)
            Path(tracker.marker).touch()
            _kill_writer(client, tracker.run_id)
    with caplog.at_level("WARNING", logger="hdet_track"):
        sched.close()
    assert not Path(tracker.marker).exists()  # the replacement's first start did fail
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert sorted(r["step"] for r in read_steps_artifact(client, tracker.run_id, tmp_path)) == list(range(1, 31))
    assert caplog.text.count("tracker process died; starting another") == 1

"""A tracked job SIGKILLed and resumed from a checkpoint into the same MLflow run (real sqlite store,
real processes): the run ends KILLED, and the resumed run holds every step once, in the metric store
and in the event archive, whatever each of them had when the job died."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections import Counter

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from hdet_track.events import RunStart
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.tracking.archive import StepBlock
from hdet_track.tracking.base import Batch, Point
from hdet_track.tracking.isolated import IsolatedTracker
from hdet_track.tracking.mlflow import MLflowTracker

JOB = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import MLflowTracker
    from mlflow.tracking import MlflowClient

    uri, ckpt, phase = sys.argv[1:4]
    total, sync, ckpt_at, flush_at, kill_at = map(int, sys.argv[4:9])
    val_at = {int(s) for s in sys.argv[9].split(",") if s}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = MLflowTracker(tracking_uri=uri, experiment="resume", chunk_seconds=3600)
    tracker.isolate = False  # the tracker dies with the job, as when a container is OOM-killed
    sched = HDETScheduler(opt, max_lr=0.05, total_steps=total, sync_every=sync, model=model, track=tracker)
    start = 0
    if phase == "second":
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = ckpt_at
    for step in range(start + 1, (kill_at if phase == "first" else total) + 1):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        if step in val_at:
            sched.log_metrics({"val_loss": 1.0 / step}, step=step)
        if phase == "first" and step == ckpt_at:
            sched.flush()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
        if phase == "first" and step == flush_at:
            sched.flush()  # the store and the event archive hold every step so far
    if phase == "first":  # the store gets the last sync; the archive holds it in memory
        sched.gather_pending()  # the last sync's record, without waiting for the next step
        run_id = sched.run_ids["mlflow"]
        while kill_at not in {m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")}:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    sched.close()
    """
)


def run_job(tmp_path, uri, phase, total, sync, ckpt_at, flush_at, kill_at, val_at):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    args = [str(a) for a in (uri, tmp_path / "ckpt.pt", phase, total, sync, ckpt_at, flush_at, kill_at, val_at)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_"))}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # spills, if any, stay in the test's folder
    proc = subprocess.run(
        [sys.executable, str(script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == (-9 if phase == "first" else 0), proc.stderr[-3000:]


def only_run(uri):
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    return client, run


def doubled(steps):
    return sorted(s for s, n in Counter(int(s) for s in steps).items() if n > 1)


def test_job_dying_while_its_tracker_process_is_mid_call_leaves_a_killed_run_with_that_call(tmp_path):
    """The job dies (SIGKILL, out of memory) while its MLflow process handles a log call, so the answer
    finds nobody to read it (injected: the job's ends of the pipes are closed around the call): the
    call's data is still written, and the run ends KILLED with the event archive that process held."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    start = RunStart(
        config={}, world_size=1, schedule="hdet", param_groups=["pg0"], explored=[], versions={}, hostnames=[]
    )

    def steps(first, last):
        step = np.arange(first, last + 1)
        block = StepBlock(step, np.zeros(len(step), dtype=np.int32), 1.0 / step)
        return Batch(points=[Point("loss", 1.0 / s, int(s), 0) for s in step], steps=[block])

    tracker = IsolatedTracker(MLflowTracker(tracking_uri=uri, experiment="resume"))
    tracker.start(start)
    tracker.log(steps(1, 20))
    tracker._recv.close()  # the job is gone: nobody reads the answer to the next call
    tracker._send.send(("log", (steps(21, 30),)))
    tracker._send.close()
    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    deadline = time.monotonic() + 60
    while run.info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
        run = client.get_run(tracker.run_id)
    assert run.info.status == "KILLED"
    assert "vanished after step 30" in run.data.tags["hdet.error"]
    assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "loss")) == list(range(1, 31))
    archived, _ = MLflowReader(uri).read(tracker.run_id).replica_series("loss", 0)
    assert list(archived) == list(range(1, 31))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Job and tracker die at once after step 104 (a container OOM-killed): the store holds steps up to
    104 (val_loss at 101 and 102), the event archive up to 80 (its last chunk), the sync series
    thinned by the default point budget. Resumed from the checkpoint at step 60 (it logs val_loss
    at 101 and 102 again) and run to step 400."""
    tmp_path = tmp_path_factory.mktemp("resumed")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    shape = {"total": 400, "sync": 2, "ckpt_at": 60, "flush_at": 80, "kill_at": 104, "val_at": "101,102"}
    for phase in ("first", "second"):
        run_job(tmp_path, uri, phase, **shape)
    client, run = only_run(uri)
    assert run.info.status == "FINISHED"
    return client, run


def test_resume_after_the_archive_lagged_the_store_archives_every_step_once(resumed):
    client, run = resumed
    read = MLflowReader(client.tracking_uri).read(run.info.run_id)
    steps, _ = read.replica_series("lr", 0)
    assert list(steps) == list(range(1, 401))
    assert [e.step for e in read.converge] == list(range(2, 401, 2))


def test_resume_with_thinned_sync_series_writes_no_metric_point_twice(resumed):
    client, run = resumed
    left_out = client.get_metric_history(run.info.run_id, "hdet/sync/left_out")
    assert len(left_out) < 200  # thinned: its last point is not where the store ends
    # hdet.logged_through names the last step whose points were all delivered; a job killed between
    # two deliveries of its last step (a race with the writer thread) can leave that step written
    # again by the resume in the raw store (the readers keep one point per step)
    # MLflow's log_batch commits its metrics before its tags: a kill between the two leaves that
    # call's points (a loaded machine: many steps) in the store without the tag, and the resume writes
    # them again; every doubled step is after the archive's flush at 80 and at most the kill's 104
    assert all(80 < s <= 104 for s in doubled(m.step for m in left_out))
    assert all(
        80 < s <= 104 for s in doubled(m.step for m in client.get_metric_history(run.info.run_id, "hdet/replica_00/lr"))
    )
    loss = client.get_metric_history(run.info.run_id, "loss")  # at every step (the budget's minimum)
    assert sorted({m.step for m in loss}) == list(range(1, 401))
    assert all(80 < s <= 104 for s in doubled(m.step for m in loss))  # the same race (seen on a loaded machine)


def test_resumed_job_logs_a_user_metric_once_per_step(resumed):
    client, run = resumed
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss")) == [101, 102]


def test_reader_keeps_the_last_point_of_a_user_metric_logged_twice_at_a_step(tmp_path):
    """A store written by an older version, whose resumed job logged val_loss again at a step."""
    from mlflow.entities import Metric

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("old")).info.run_id
    points = [(5, 0.9, 1000), (6, 0.8, 2000), (5, 0.7, 3000)]  # step, value, time (ms)
    client.log_batch(run_id, metrics=[Metric("val_loss", v, t, s) for s, v, t in points])
    steps, values = MLflowReader(uri).read(run_id).metrics["val_loss"]
    assert list(steps) == [5, 6] and list(values) == [0.7, 0.8]


def test_a_job_resumed_into_a_run_whose_owner_logs_loss_writes_its_own_steps(tmp_path):
    """A run HDET attaches to (Hugging Face's MLflowCallback's, after resume_from_checkpoint) where
    the owner's own ``loss`` was logged past the resume step before HDET's writer started: HDET took
    that ``loss`` for its own and skipped every step it had, so the resumed part had no HDET series."""
    import torch

    from hdet_track import HDETScheduler

    uri = f"sqlite:///{tmp_path / 'own.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("owned")).info.run_id
    for k in range(1, 7):  # the owner's training loss, at its own steps
        client.log_metric(run_id, "loss", 3.0, step=k)

    def scheduler(track=False):
        torch.manual_seed(0)
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        return opt, HDETScheduler(opt, 0.1, total_steps=6, sync_every=3, track=track)

    opt, first = scheduler()
    for k in range(1, 4):
        opt.step()
        first.step(1.0 / k)
    opt, sched = scheduler(MLflowTracker(tracking_uri=uri, run_id=run_id))
    sched.load_state_dict(first.state_dict())
    for k in range(4, 7):
        opt.step()
        sched.step(1.0 / k)
    sched.close()
    assert [m.step for m in client.get_metric_history(run_id, "hdet/replica_00/lr")] == [4, 5, 6]
    assert [m.step for m in client.get_metric_history(run_id, "hdet/replica_00/loss")] == [4, 5, 6]


def test_a_run_given_by_mlflow_run_id_keeps_the_contracts_loss_and_lr(tmp_path, monkeypatch):
    """$MLFLOW_RUN_ID (`mlflow run` opens the job's own run) is not someone else's run: its means
    stay `loss` and `lr`, as the baseline's do."""
    import torch

    from hdet_track import HDETScheduler

    uri = f"sqlite:///{tmp_path / 'env.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("proj")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", run_id)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with HDETScheduler(opt, 0.1, total_steps=4, sync_every=2, track=MLflowTracker(tracking_uri=uri)) as sched:
        for k in range(1, 5):
            opt.step()
            sched.step(1.0 / k)
    keys = set(client.get_run(run_id).data.metrics)
    assert {"loss", "lr"} <= keys and not {"hdet/loss", "hdet/lr"} & keys


def test_a_fit_resumed_in_a_given_run_writes_the_steps_past_its_tag(tmp_path):
    """A run given to HDET (a Lightning logger's, across fits) holds an earlier fit's steps past the
    point a later fit logged through: a job resuming that later fit writes every step after its own
    tag, not only those after the earlier fit's last points."""
    import torch

    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import LOGGED_THROUGH_TAG

    uri = f"sqlite:///{tmp_path / 'given.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("given")).info.run_id

    def scheduler():
        torch.manual_seed(0)
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        return opt, HDETScheduler(
            opt, 0.1, total_steps=10, sync_every=2, track=MLflowTracker(tracking_uri=uri, run_id=run_id)
        )

    opt, first = scheduler()  # fit 1: steps 1-10
    for k in range(1, 11):
        opt.step()
        first.step(1.0 / k)
        if k == 2:
            state = first.state_dict()  # fit 2's checkpoint, for this test
    first.close()
    client.set_tag(run_id, LOGGED_THROUGH_TAG, "3")  # fit 2 logged through 3 and crashed
    opt, sched = scheduler()  # fit 2 resumed from its checkpoint at 2
    sched.load_state_dict(state)
    for k in range(3, 11):
        opt.step()
        sched.step(10.0 / k)
    sched.close()
    values = {}
    for m in client.get_metric_history(run_id, "hdet/replica_00/loss"):
        values.setdefault(m.step, []).append(m.value)
    assert all(any(v == pytest.approx(10.0 / s) for v in values[s]) for s in range(4, 11)), values


def test_a_run_given_then_resumed_as_the_jobs_own_keeps_hdets_means_apart_from_the_owners_loss(tmp_path):
    """Hugging Face's retry on the same Trainer: the first train() logged into the run its
    MLflowCallback opened (HDET's means as ``hdet/loss``, beside the callback's ``loss``); the retry
    finds no open run and resumes that run from the checkpoint as the job's own. Its means went to
    plain ``loss``: two values at a step, Hugging Face's and HDET's, in one series."""
    import torch

    from hdet_track import HDETScheduler

    uri = f"sqlite:///{tmp_path / 'retry.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("retry")).info.run_id

    def scheduler(track):
        torch.manual_seed(0)
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        return opt, HDETScheduler(opt, 0.1, total_steps=6, sync_every=3, track=track)

    opt, first = scheduler(MLflowTracker(tracking_uri=uri, run_id=run_id))
    for k in range(1, 5):
        opt.step()
        first.step(1.0 / k)
        client.log_metric(run_id, "loss", 3.0, step=k)  # the owner's own training loss
        if k == 3:
            state = first.state_dict()
    first.close("FAILED", error="RuntimeError: boom at step 4")
    opt, sched = scheduler(MLflowTracker(tracking_uri=uri))  # the retry: the run comes from the checkpoint
    sched.load_state_dict(state)
    for k in range(4, 7):
        opt.step()
        sched.step(1.0 / k)
    sched.close()
    assert sched.run_ids["mlflow"] == run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(k, 3.0) for k in range(1, 5)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "hdet/loss")) == list(range(1, 7))
    assert client.get_run(run_id).info.status == "FINISHED"


def _forking_job(uri, ckpt, scale, start=0, stop=10, keep_open=False):
    """A small tracked job: from scratch (a checkpoint after step 5), or resumed from ``ckpt``; its
    losses (and val_loss) times ``scale``, so that each job's points tell which job wrote them."""
    import torch

    from hdet_track import HDETScheduler

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = HDETScheduler(
        opt, max_lr=0.05, total_steps=10, sync_every=5, model=model,
        track=MLflowTracker(tracking_uri=uri, experiment="fork"),
    )  # fmt: skip
    if start:
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
    for step in range(start + 1, stop + 1):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        sched.log_metrics({"val_loss": scale * step}, step=step)
        if step == 5 and not start:
            sched.flush()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
    if not keep_open:
        sched.close()
    return sched


def _val(client, run_id):
    return {m.step: m.value for m in client.get_metric_history(run_id, "val_loss")}


def test_a_second_job_resumed_from_the_checkpoint_of_a_finished_run_logs_to_a_run_of_its_own(tmp_path, capfd):
    """An audit's finding: two jobs resumed from one checkpoint (a fork, a rerun of a finished job)
    shared the run. The second found it logged through the end and wrote nothing, silently, and
    ended it FINISHED again. Now a run that another attempt ended FINISHED is not reopened: the job
    logs to a new run, linked to the old one by its tags, and says so."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    ckpt = tmp_path / "ckpt.pt"
    client = MlflowClient(uri)
    first = _forking_job(uri, ckpt, 1.0).run_ids["mlflow"]
    resumed = _forking_job(uri, ckpt, 2.0, start=5).run_ids["mlflow"]  # B1: the run's own resume
    assert resumed != first
    capfd.readouterr()
    again = _forking_job(uri, ckpt, 3.0, start=5).run_ids["mlflow"]  # B2, from the same checkpoint
    assert len({first, resumed, again}) == 3
    assert _val(client, first) == {s: 1.0 * s for s in range(1, 11)}  # the finished run is left as it was
    for run_id, scale in ((resumed, 2.0), (again, 3.0)):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert run.data.tags["hdet.forked_from"] == first and run.data.tags["hdet.forked_at_step"] == "5"
        assert _val(client, run_id) == {s: scale * s for s in range(6, 11)}
        assert MLflowReader(uri).read(run_id).steps.step.min() == 6
    said = [line for line in capfd.readouterr().err.splitlines() if first in line]  # the tracker process's
    assert said and "FINISHED" in said[0] and again in said[0], said


_HOLDING_JOB = """
import sys
from tests.test_resume_mlflow import _forking_job
sched = _forking_job(sys.argv[1], sys.argv[2], 2.0, start=5, stop=8, keep_open=True)
sched.flush()
print(sched.run_ids["mlflow"], flush=True)
sys.stdin.read()  # trains on until the test lets it end
sched.close()
"""


def test_a_job_resumed_into_a_run_a_live_process_is_logging_logs_to_a_run_of_its_own(tmp_path):
    """The same for two jobs resumed at once: their points went into one run, two per step, and the
    run read back as a trajectory made of both trainings."""
    from pathlib import Path

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    ckpt = tmp_path / "ckpt.pt"
    client = MlflowClient(uri)
    first = _forking_job(uri, ckpt, 1.0, stop=7, keep_open=True)  # the first attempt, killed after step 7
    run_id = first.run_ids["mlflow"]
    first.close("KILLED")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    b1 = subprocess.Popen(
        [sys.executable, "-c", _HOLDING_JOB, uri, str(ckpt)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert b1.stdout.readline().strip() == run_id  # B1 resumed the run and is training in it
        b2 = _forking_job(uri, ckpt, 3.0, start=5)  # B2, from the same checkpoint, meanwhile
        forked = b2.run_ids["mlflow"]
        assert forked != run_id and client.get_run(forked).data.tags["hdet.forked_from"] == run_id
        assert _val(client, forked) == {s: 3.0 * s for s in range(6, 11)}
    finally:
        b1.communicate("", timeout=120)
    values = _val(client, run_id)
    assert values == {s: (2.0 if s > 7 else 1.0) * s for s in range(1, 9)}  # the killed attempt's, then B1's
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_job_closed_early_and_resumed_from_an_earlier_checkpoint_continues_its_run(tmp_path):
    """A job run in parts: closed (FINISHED) at step 8 of 10 by a time budget, resumed from its
    checkpoint of step 5. The run is its own, not another attempt's: no fork (a review's finding: the
    fork rule took every run FINISHED past the checkpoint for another attempt's)."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    ckpt = tmp_path / "ckpt.pt"
    client = MlflowClient(uri)
    first = _forking_job(uri, ckpt, 1.0, stop=8).run_ids["mlflow"]
    assert client.get_run(first).info.status == "FINISHED"
    again = _forking_job(uri, ckpt, 2.0, start=5).run_ids["mlflow"]
    assert again == first and "hdet.forked_from" not in client.get_run(first).data.tags
    # the steps the store held (6-8) stay the first part's; the rest are the resumed part's
    assert _val(client, first) == {s: (2.0 if s > 8 else 1.0) * s for s in range(1, 11)}

"""A run whose processes this host cannot check (another host, another container) reads live while
its heartbeat comes and KILLED once it is long overdue: real jobs in a pid namespace of their own
(what a container is to a reader outside it), killed outright, read back from a real MLflow sqlite
store and a real offline W&B directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from hdet_track.owner import MISSED_BEATS, heartbeat, heartbeat_seconds, silence
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.readers.wandb import WandbReader

# seconds: the runs below read KILLED MISSED_BEATS * BEAT seconds after the last beat (at 0.5 s, a
# beat held up 5 s on a loaded machine would read a live run KILLED)
BEAT = 1.0


def test_silence_counts_missed_beats_on_the_records_own_interval():
    now = 1_000_000.0
    on_time = heartbeat(30, now=now - MISSED_BEATS * 30 + 1)
    assert silence(on_time, now=now) is None
    assert silence(json.dumps(on_time), now=now) is None
    late = heartbeat(30, now=now - MISSED_BEATS * 30 - 1)
    text = silence(json.dumps(late), now=now)
    assert text is not None and "no heartbeat for 301 s" in text and "every 30 s" in text, text
    assert silence(heartbeat(0.5, now=now - 6), now=now) is not None  # 12 beats of 0.5 s missed
    # the beat of the run's owner counts; an earlier attempt's (a resumed run) says nothing of this one
    owner = {k: late[k] for k in ("host", "pid", "start", "pidns")} | {"writer": {"pid": 7}}
    assert silence(late, owner, now=now) == text
    assert silence(late, owner | {"pid": late["pid"] + 1}, now=now) is None
    assert silence(late, owner | {"host": "elsewhere"}, now=now) is None
    # a restarted container: the same host name and pid, another pid namespace and start time
    assert silence(late, owner | {"pidns": "pid:[1]"}, now=now) is None
    assert silence(late, owner | {"start": "1"}, now=now) is None
    # a run written before heartbeats, or a damaged record: cannot tell, so not ended
    for record in (
        None,
        "",
        "{",
        "[]",
        {"time": now - 1e6},
        {"time": now - 1e6, "every": 0},
        {"time": "x", "every": 1},
    ):
        assert silence(record, now=now) is None, record


def test_heartbeat_interval_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.delenv("HDET_TRACK_HEARTBEAT_SECONDS", raising=False)
    assert heartbeat_seconds() == 30.0
    monkeypatch.setenv("HDET_TRACK_HEARTBEAT_SECONDS", "0")
    assert heartbeat_seconds() is None
    monkeypatch.setenv("HDET_TRACK_HEARTBEAT_SECONDS", "2.5")
    assert heartbeat_seconds() == 2.5
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv("HDET_TRACK_HEARTBEAT_SECONDS", bad)
        with pytest.raises(ValueError, match=rf"HDET_TRACK_HEARTBEAT_SECONDS.*>= 0.*{bad!r}"):
            heartbeat_seconds()


def test_no_heartbeat_when_turned_off(tmp_path, monkeypatch):
    import torch

    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'off.db'}"
    for value, expected in (("0", False), ("", True)):
        monkeypatch.setenv("HDET_TRACK_HEARTBEAT_SECONDS", value)
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        with HDETScheduler(opt, 0.1, total_steps=4, spread=0.0, sync_every=2, track=MLflowTracker(uri, "off")) as s:
            for k in range(1, 5):
                opt.step()
                s.step(1.0 / k)
            assert s.flush() is True  # the run is open: the first heartbeat went with its start
            run = MlflowClient(uri).get_run(s.run_ids["mlflow"])
        assert ("hdet.alive" in run.data.tags) is expected, (value, run.data.tags.get("hdet.alive"))


@pytest.fixture(scope="module")
def namespaces():
    """Skip unless this machine can start a process in a pid namespace of its own (Linux, root)."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs unshare with pid namespaces (Linux, root): a process this host cannot check")
    probe = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"needs unshare with pid namespaces (root): {probe.stderr.decode(errors='replace').strip()}")


JOB = """
import sys, time, torch
from hdet_track import HDETScheduler
if sys.argv[1] == "mlflow":
    from hdet_track.tracking.mlflow import MLflowTracker
    tracker = MLflowTracker(tracking_uri=sys.argv[2], experiment="beat")
else:
    from hdet_track.tracking.wandb import WandbTracker
    tracker = WandbTracker(project="beat", dir=sys.argv[2], mode="offline")
opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
sched = HDETScheduler(opt, 0.1, total_steps=30, spread=0.0, sync_every=5, track=tracker)
for k in range(1, 11):
    opt.step()
    sched.step(1.0 / k)
assert sched.flush() is True
print("READY", flush=True)
time.sleep(300)  # a long evaluation: no step, no metric, only the heartbeat
"""


def _start_in_namespace(tmp_path, backend, store):
    """The job as pid 1 of a new pid namespace; SIGKILL to the returned process kills all of it."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, HDET_TRACK_HEARTBEAT_SECONDS=str(BEAT), WANDB_SILENT="true")
    return subprocess.Popen(
        ["unshare", "-p", "-f", "--kill-child", "--mount-proc", sys.executable, str(script), backend, store],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )


def _kill(proc):
    os.killpg(proc.pid, signal.SIGKILL)  # unshare, and with it (--kill-child) the namespace's pid 1
    proc.wait(timeout=30)


def _until_not_running(read, timeout):
    deadline = time.monotonic() + timeout
    while True:
        summary, run = read()
        if run.status != "RUNNING" or time.monotonic() > deadline:
            return summary, run
        time.sleep(0.5)


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_run_of_another_container_reads_live_while_it_beats_and_killed_once_silent(tmp_path, backend, namespaces):
    """No step and no metric for longer than the silence that reads KILLED (a long evaluation): the
    heartbeat keeps the run live. Then the whole container is killed: nobody ends the run, and it
    reads KILLED once its heartbeat is overdue; the store is left as it is."""
    if backend == "mlflow":
        store = f"sqlite:///{tmp_path / 'mlflow.db'}"
        client, reader = MlflowClient(store), MLflowReader(store)

        def owner_and_alive(summary):
            tags = client.get_run(summary.run_id).data.tags
            return json.loads(tags["hdet.owner"]), json.loads(tags["hdet.alive"])
    else:
        store = str(tmp_path / "store")
        reader = None

        def owner_and_alive(summary):
            (path,) = (tmp_path / "store").glob(f"wandb/offline-run-*-{summary.run_id}/files/hdet_events/owner.json")
            record = json.loads(path.read_text())
            return record, record["alive"]

    def read():
        runs = reader or WandbReader(store)  # once the job made the W&B directory
        (summary,) = runs.list_runs(*(["beat"] if backend == "mlflow" else []))
        return summary, runs.read(summary.run_id)

    proc = _start_in_namespace(tmp_path, backend, store)
    try:
        assert proc.stdout.readline().strip() == "READY"
        summary, run = read()
        first = owner_and_alive(summary)[1]
        time.sleep(MISSED_BEATS * BEAT + 3)
        summary, run = read()
        assert summary.status == run.status == "RUNNING" and summary.live and run.live
        owner, later = owner_and_alive(summary)
        assert later["every"] == BEAT and later["time"] >= first["time"] + MISSED_BEATS * BEAT
    finally:
        _kill(proc)
    assert owner["pidns"] != os.readlink("/proc/self/ns/pid")  # this host cannot check its processes
    for key in ("host", "pid", "start", "pidns"):  # the owner's own beat
        assert later[key] == owner[key] is not None, key
    summary, run = _until_not_running(read, MISSED_BEATS * BEAT + 30)
    assert summary.status == run.status == "KILLED" and not summary.live and not run.live
    error = run.tags["hdet.error"]
    assert f"(pid {later['pid']} on {later['host']}) sent no heartbeat for" in error, error
    assert "presumed ended without ending the run" in error, error
    if backend == "mlflow":
        assert client.get_run(summary.run_id).info.status == "RUNNING"  # the store is left as it is
    else:
        assert error.endswith("presumed ended without ending the run, after its last logged step 10"), error
    assert [c.step for c in run.converge] == [5, 10]


def test_a_hub_refuses_a_heartbeat_interval_that_is_not_positive():
    from hdet_track.tracking.hub import TrackingHub

    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=rf"heartbeat_seconds.*> 0 or None.*{bad!r}"):
            TrackingHub([], heartbeat_seconds=bad)


def _open_run(tmp_path, backend, tracker_kwargs=None):
    """A job of ten steps whose run stays open after its last step (no heartbeat of its own)."""
    import torch

    from hdet_track import HDETScheduler

    if backend == "mlflow":
        from hdet_track.tracking.mlflow import MLflowTracker

        tracker = MLflowTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "open", **(tracker_kwargs or {}))
    else:
        from hdet_track.tracking.wandb import WandbTracker

        tracker = WandbTracker(project="open", dir=tmp_path / "store", mode="offline", **(tracker_kwargs or {}))
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=10, spread=0.0, sync_every=5, track=tracker)
    for k in range(1, 11):
        opt.step()
        sched.step(1.0 / k)
    assert sched.flush() is True
    return sched


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_run_owned_elsewhere_reads_by_the_owners_own_heartbeat(tmp_path, monkeypatch, backend):
    """The owner record says another host (this host cannot check it): a heartbeat of that owner
    long overdue reads KILLED; on time, or an earlier attempt's (another process of that host), or
    none at all (a run written before heartbeats) reads RUNNING."""
    monkeypatch.setenv("HDET_TRACK_HEARTBEAT_SECONDS", "0")  # this job's own hub writes none
    monkeypatch.setenv("WANDB_SILENT", "true")
    sched = _open_run(tmp_path, backend)
    run_id = sched.run_ids[backend]
    elsewhere = {"host": "node-7", "pid": 4242, "start": "99", "pidns": "pid:[9]"}
    if backend == "mlflow":
        client, reader = (
            MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"),
            MLflowReader(f"sqlite:///{tmp_path / 'mlflow.db'}"),
        )
        client.set_tag(run_id, "hdet.owner", json.dumps(elsewhere | {"writer": elsewhere | {"pid": 4243}}))

        def set_alive(beat):
            if beat is None:
                client.delete_tag(run_id, "hdet.alive")
            else:
                client.set_tag(run_id, "hdet.alive", json.dumps(beat))
    else:
        reader = WandbReader(tmp_path / "store")
        (path,) = (tmp_path / "store").glob(f"wandb/offline-run-*-{run_id}/files/hdet_events/owner.json")

        def set_alive(beat):
            path.write_text(json.dumps(elsewhere | ({} if beat is None else {"alive": beat})))

    def status():
        run = reader.read(run_id)
        assert reader.list_runs(*(["open"] if backend == "mlflow" else []))[0].status == run.status
        return run.status, run.tags.get("hdet.error", "")

    try:
        now = time.time()
        set_alive(heartbeat(30, now=now - MISSED_BEATS * 30 - 60, identity=elsewhere))
        state, error = status()
        assert state == "KILLED" and "(pid 4242 on node-7) sent no heartbeat for 36" in error, error
        set_alive(heartbeat(30, now=now - 60, identity=elsewhere))
        assert status()[0] == "RUNNING"
        set_alive(heartbeat(30, now=now - 3600, identity=elsewhere | {"pid": 4241}))  # an earlier attempt's
        assert status()[0] == "RUNNING"
        set_alive(None)
        assert status()[0] == "RUNNING"
    finally:
        sched.close()


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_run_left_open_for_its_own_owner_keeps_no_heartbeat(tmp_path, monkeypatch, backend):
    """hdet-track logged into a run someone else started (a Lightning logger's) and ends FINISHED:
    the run stays open for that owner, and no heartbeat of the training job stays behind to make it
    read KILLED 10 intervals later on another host."""
    monkeypatch.delenv("HDET_TRACK_HEARTBEAT_SECONDS", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    if backend == "mlflow":
        client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
        theirs = client.create_run(client.create_experiment("open")).info.run_id
        sched = _open_run(tmp_path, backend, {"run_id": theirs})

        def alive():
            return client.get_run(theirs).data.tags.get("hdet.alive")
    else:
        import wandb

        theirs = wandb.init(project="open", dir=tmp_path / "store", mode="offline")
        sched = _open_run(tmp_path, backend, {"run": theirs})
        (path,) = (tmp_path / "store").glob(f"wandb/offline-run-*-{theirs.id}/files/hdet_events/owner.json")

        def alive():
            return json.loads(path.read_text()).get("alive")

    try:
        assert alive() is not None  # beating while hdet-track's part runs
        sched.close()
        assert alive() is None
        if backend == "mlflow":
            assert client.get_run(theirs).info.status == "RUNNING"
    finally:
        if backend == "wandb":
            theirs.finish()


def test_a_failing_heartbeat_takes_the_backend_down_like_any_batch_and_nothing_is_lost(tmp_path, monkeypatch, caplog):
    """A heartbeat that raises (a fault injected into a real MLflow tracker) means the backend is
    down, as for any batch: what follows waits in the spill until a retry succeeds, and the retry
    comes with a later heartbeat (a quiet run does not wait for its next batch); nothing is lost."""
    import torch

    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import MLflowTracker

    class FlakyHeartbeat(MLflowTracker):
        isolate = False
        failures = 1

        def heartbeat(self, beat):
            if self.failures:
                self.failures -= 1
                raise ConnectionError("connection refused (injected)")
            super().heartbeat(beat)

    monkeypatch.setenv("HDET_TRACK_HEARTBEAT_SECONDS", "0.2")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = FlakyHeartbeat(uri, "flaky")
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="hdet_track"):
        with HDETScheduler(opt, 0.1, total_steps=20, spread=0.0, sync_every=5, track=tracker) as sched:
            for k in range(1, 21):
                opt.step()
                sched.step(1.0 / k)
                time.sleep(0.15)
            assert "FlakyHeartbeat is unavailable (ConnectionError: connection refused (injected))" in caplog.text
            # no step from here on: the retry (2 s after the failure) comes with a heartbeat, and the
            # run beats again before close()
            client, deadline = MlflowClient(uri), time.monotonic() + 20
            while "hdet.alive" not in client.get_run(tracker.run_id).data.tags and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "hdet.alive" in client.get_run(tracker.run_id).data.tags
            assert sched.flush() is True
            assert sorted(m.step for m in client.get_metric_history(tracker.run_id, "loss")) == list(range(1, 21))
    assert tracker.failures == 0
    run = MLflowReader(uri).read(tracker.run_id)
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [5, 10, 15, 20]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))

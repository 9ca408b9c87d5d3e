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

BEAT = 0.5  # seconds: the runs below read KILLED MISSED_BEATS * BEAT seconds after the last beat


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
    owner = {"host": late["host"], "pid": late["pid"]}
    assert silence(late, owner, now=now) == text
    assert silence(late, owner | {"pid": late["pid"] + 1}, now=now) is None
    assert silence(late, owner | {"host": "elsewhere"}, now=now) is None
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


def _namespaces_available() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _namespaces_available(),
    reason="needs unshare with pid namespaces (Linux, root): a process this host cannot check",
)

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


@needs_namespaces
@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_run_of_another_container_reads_live_while_it_beats_and_killed_once_silent(tmp_path, backend):
    """No step and no metric for longer than the silence that reads KILLED (a long evaluation): the
    heartbeat keeps the run live. Then the whole container is killed: nobody ends the run, and it
    reads KILLED once its heartbeat is overdue; the store is left as it is."""
    if backend == "mlflow":
        store = f"sqlite:///{tmp_path / 'mlflow.db'}"
        client, reader = MlflowClient(store), MLflowReader(store)

        def alive(summary):
            return json.loads(client.get_run(summary.run_id).data.tags["hdet.alive"])
    else:
        store = str(tmp_path / "store")
        reader = None

        def alive(summary):
            (path,) = (tmp_path / "store").glob(f"wandb/offline-run-*-{summary.run_id}/files/hdet_events/owner.json")
            return json.loads(path.read_text())["alive"]

    def read():
        runs = reader or WandbReader(store)  # once the job made the W&B directory
        (summary,) = runs.list_runs(*(["beat"] if backend == "mlflow" else []))
        return summary, runs.read(summary.run_id)

    proc = _start_in_namespace(tmp_path, backend, store)
    try:
        assert proc.stdout.readline().strip() == "READY"
        summary, run = read()
        first = alive(summary)
        time.sleep(MISSED_BEATS * BEAT + 2)
        summary, run = read()
        assert summary.status == run.status == "RUNNING" and summary.live and run.live
        later = alive(summary)
        assert later["every"] == BEAT and later["time"] >= first["time"] + MISSED_BEATS * BEAT
    finally:
        _kill(proc)
    owner = json.loads(run.tags["hdet.owner"]) if backend == "mlflow" else later
    assert (later["host"], later["pid"]) == (owner["host"], owner["pid"])  # the owner's own beat
    summary, run = _until_not_running(read, MISSED_BEATS * BEAT + 30)
    assert summary.status == run.status == "KILLED" and not summary.live and not run.live
    error = run.tags["hdet.error"]
    assert f"(pid {later['pid']} on {later['host']}) sent no heartbeat for" in error, error
    assert "presumed ended without ending the run" in error, error
    if backend == "mlflow":
        assert client.get_run(summary.run_id).info.status == "RUNNING"  # the store is left as it is
        assert json.loads(run.tags["hdet.owner"])["pidns"] != os.readlink("/proc/self/ns/pid")
    else:
        assert error.endswith("presumed ended without ending the run, after its last logged step 10"), error
    assert [c.step for c in run.converge] == [5, 10]


def test_a_hub_refuses_a_heartbeat_interval_that_is_not_positive():
    from hdet_track.tracking.hub import TrackingHub

    for bad in (0, -1.0):
        with pytest.raises(ValueError, match=rf"heartbeat_seconds.*> 0 or None.*{bad!r}"):
            TrackingHub([], heartbeat_seconds=bad)

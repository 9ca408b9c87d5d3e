"""The tracking writer against faults of its own spill file (a full disk, a kill in the middle of a
replay): found by an audit of crash-safe tracking. The backend's outages are injected into a real
MLflow tracker on a real sqlite store (tests/jobs/outage.py); the disk's into the spill's rewrite."""

from __future__ import annotations

import errno
import json
import shutil
import time

import pytest
from mlflow.tracking import MlflowClient

from hdet_track.tracking import spill as spill_module
from hdet_track.tracking.hub import TrackingHub, _Sink, default_shutdown_timeout
from hdet_track.tracking.spill import SpillFile, recover

from .jobs.outage import OutageMLflowTracker
from .test_spill_repair import _batch, _dead_identity, _orphaned, _spill_while_down, _start


def _runs(uri):
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    return [(r.info.status, sorted(m.step for m in client.get_metric_history(r.info.run_id, "val_loss"))) for r in runs]


def _hub_with_a_spill(outage, uri, spills, shutdown_timeout=5, **timing):
    """A hub whose run started, then the backend went down for val_loss at steps 1-3 (in the spill)."""
    hub = TrackingHub(
        [outage(tracking_uri=uri, experiment="out")],
        spill_dir=spills,
        flush_seconds=0.05,
        shutdown_timeout=shutdown_timeout,
        **timing,
    )
    hub.start(_start())
    assert hub.flush(30)
    outage.reset(down=True)
    for step in (1, 2, 3):
        hub.metrics({"val_loss": float(step)}, step)
        assert hub.flush(10)
    return hub


def _full_disk(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    monkeypatch.setattr(spill_module.SpillFile, "_write", refuse)


def test_a_kill_during_the_writers_replay_leaves_a_spill_that_continues_the_run_it_created(
    tmp_path, outage, monkeypatch
):
    """The backend down from the job's start (no run yet), then back: the writer's replay creates
    the run, but wrote its id into the spill only when the replay stopped. A process killed half-way
    left a spill that named no run, and `recover` made a second run with every step."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    spills = tmp_path / ".hdet-spill"
    sink = _spill_while_down(outage, uri, spills, 20)
    outage.reset()
    left = tmp_path / "left" / ".hdet-spill"  # where the killed process left its spill
    real_log, logged = OutageMLflowTracker.log, []

    def log(self, batch):
        real_log(self, batch)
        logged.append(batch)
        if len(logged) == 5:  # the process is killed here: its spill is what it leaves
            left.mkdir(parents=True)
            shutil.copy(sink.spill_path, left / sink.spill_path.name)

    monkeypatch.setattr(OutageMLflowTracker, "log", log)
    sink.deliver(_batch(21))  # the backend is back: the replay starts
    assert not sink.spill_path.exists()
    (kept,) = left.iterdir()
    assert json.loads(kept.open().readline())["run_id"] == sink.tracker.run_id  # it names the run
    _orphaned(kept, _dead_identity())
    monkeypatch.setattr(OutageMLflowTracker, "log", real_log)
    (line,) = recover(str(left))
    assert "delivered" in line, line
    ((_, steps),) = _runs(uri)  # one run, every step
    assert sorted(set(steps)) == list(range(1, 22))


def test_a_spill_that_cannot_be_rewritten_does_not_stop_the_writer(tmp_path, outage, monkeypatch):
    """The backend back for one batch and down again while the disk is full: rewriting the spill
    raised out of the heartbeat's replay, and the writer thread died; later metrics and the run's end
    were neither delivered nor spilled, and the run stayed open."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    hub = _hub_with_a_spill(outage, uri, tmp_path / ".hdet-spill", retry_seconds=0.1, heartbeat_seconds=0.2)
    with monkeypatch.context() as disk:
        _full_disk(disk)
        outage.reset(logs_left=1)  # back for one batch, then down again: the replay rewrites the spill
        deadline = time.monotonic() + 10
        while OutageMLflowTracker.logs_left != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the replay's failed rewrite
        assert OutageMLflowTracker.logs_left == 0 and OutageMLflowTracker.down
        assert hub._thread.is_alive()
    outage.reset()  # the disk and the backend are fine again
    for step in (4, 5):
        hub.metrics({"val_loss": float(step)}, step)
    assert hub.flush(20)
    hub.close("FINISHED", step=5)
    ((status, steps),) = _runs(uri)
    assert status == "FINISHED" and sorted(set(steps)) == [1, 2, 3, 4, 5]


def test_a_spill_that_cannot_be_rewritten_at_the_end_still_keeps_the_runs_end(tmp_path, outage, monkeypatch):
    """The same at close(): the run's end, taken off the queue, was lost with the writer thread.
    Now it waits in the spill, and `recover` ends the run as the job did."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    spills = tmp_path / ".hdet-spill"
    # retry_seconds=0: the end's delivery replays the spill first
    hub = _hub_with_a_spill(outage, uri, spills, retry_seconds=0.0, heartbeat_seconds=None, shutdown_timeout=1)
    with monkeypatch.context() as disk:
        _full_disk(disk)
        outage.reset(logs_left=1)
        hub.close("FINISHED", step=3)
    (path,) = spills.glob("spill-*.jsonl")
    ends = [e for b in SpillFile(path, {}).batches() for e in b.events if e.kind == "run_end"]
    assert [e.status for e in ends] == ["FINISHED"]
    outage.reset()
    _orphaned(path, _dead_identity())
    recover(str(spills))
    ((status, steps),) = _runs(uri)
    assert status == "FINISHED" and sorted(set(steps)) == [1, 2, 3]


@pytest.mark.parametrize("text", ["inf", "nan", "-1", "soon"])
def test_the_shutdown_timeout_must_be_a_finite_number_of_seconds(monkeypatch, text):
    """``inf`` was taken, and close() raised OverflowError into the training loop (thread.join)."""
    monkeypatch.setenv("HDET_TRACK_SHUTDOWN_TIMEOUT", text)
    with pytest.raises(ValueError, match=f"HDET_TRACK_SHUTDOWN_TIMEOUT.*finite.*{text!r}"):
        default_shutdown_timeout()


@pytest.mark.parametrize(
    "text, secret",
    [
        ("HTTPConnectionPool: http://alice:S3CRET-TOKEN-123@127.0.0.1:5999/api/2.0 refused", "S3CRET-TOKEN-123"),
        ("postgresql://hdet:p%40ssw0rd@db.internal/mlflow", "p%40ssw0rd"),
        ("GET https://tracking.example/api?run=1&access_token=abc123def&x=2 failed", "abc123def"),
    ],
)
def test_an_error_that_quotes_a_urls_credentials_is_masked(text, secret):
    from hdet_track.tracking.base import mask_secrets

    masked = mask_secrets(text)
    assert secret not in masked and "***" in masked
    assert masked.replace("***", secret) == text  # nothing else changes


def test_the_unavailable_warning_does_not_quote_the_servers_password(tmp_path, outage, monkeypatch, caplog):
    """MLflow's error for a server that is down quotes its URL, and the writer's warning printed it
    with the password of ``http://user:password@host``."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    secret_url = "http://alice:S3CRET-TOKEN-123@127.0.0.1:5999"

    def down(cls):
        if cls.down:
            raise ConnectionError(f"Max retries exceeded with url: {secret_url}/api/2.0/mlflow/runs/create")

    monkeypatch.setattr(OutageMLflowTracker, "_check", classmethod(down))
    outage.reset(down=True)
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), tmp_path / ".hdet-spill", retry_seconds=1e9)
    with caplog.at_level("WARNING"):
        sink.deliver(_batch(1, start=True))
    said = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert said and "S3CRET" not in said[0] and "alice:***@127.0.0.1" in said[0], said


@pytest.mark.parametrize("signum", ["SIGKILL", "SIGINT"])
def test_a_recover_killed_half_way_leaves_the_run_for_the_next_recover_not_killed(tmp_path, outage, signum):
    """`hdet-track recover` killed half-way through the spill of a job that ended FINISHED: its
    tracker process took the recover's exit for the training process's, ended the run KILLED ("the
    training process vanished"), and the run kept that message after the next recover finished it.
    Ctrl-C printed a KeyboardInterrupt traceback; now one line, exit 130."""
    import os
    import signal
    import subprocess
    import sys

    from hdet_track.events import RunEnd
    from hdet_track.tracking.base import Batch

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    spills = tmp_path / ".hdet-spill"
    sink = _spill_while_down(outage, uri, spills, 2000)  # long enough to be stopped half-way on any machine
    sink.deliver(Batch(events=[RunEnd(status="FINISHED", step=2000)]))
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    client = MlflowClient(uri)
    client.search_experiments()  # the store's tables exist before the recover and this test both open it
    # the real tracker (isolated in its own process, as a job's is), not the outage one
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "hdet_track.cli", "recover", uri]
    # Ctrl-C's default action, whatever this process inherited (a job started in the background
    # ignores SIGINT, and so did the recover: it ran to its end)
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        if runs and len(client.get_metric_history(runs[0].info.run_id, "val_loss")) > 0:  # under way: stopped at once
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the recover ended before it could be killed"
    proc.send_signal(getattr(signal, signum))
    _, err = proc.communicate()
    if signum == "SIGINT":
        assert proc.returncode == 130 and "Traceback" not in err and "recover: interrupted" in err, err
    (run,) = runs
    time.sleep(3)  # what its tracker process does once its parent is gone
    assert client.get_run(run.info.run_id).info.status == "RUNNING"
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    after = client.get_run(run.info.run_id)
    assert after.info.status == "FINISHED"
    assert not any("vanished" in v for v in after.data.tags.values()), after.data.tags
    assert sorted({m.step for m in client.get_metric_history(run.info.run_id, "val_loss")}) == list(range(1, 2001))


def test_a_spill_that_cannot_be_read_waits_its_turn_between_retries(tmp_path, outage, monkeypatch):
    """A replay that raised (an unreadable spill, not the backend) left the retry due: every batch
    and heartbeat replayed again at once, each with an ERROR and its traceback."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
    sink.retry_seconds = 30.0
    outage.reset()

    def unreadable(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(SpillFile, "first", unreadable)
    assert sink.retry() is False
    assert sink.next_retry > time.monotonic() + 10  # the next try waits, as after an outage

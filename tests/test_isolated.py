"""IsolatedTracker through deaths of its child process, with a tracker whose store is a file and
whose faults are injected (tests/jobs/file_tracker.py): what the dead child held in memory is given
to its replacement once, whatever fails on the way. MLflow's own path is tested with a real store
in tests/test_tracking_mlflow.py."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hdet_track.events import RunEnd, RunStart
from hdet_track.tracking import isolated
from hdet_track.tracking.base import Batch, Point
from hdet_track.tracking.isolated import IsolatedTracker

from .jobs.file_tracker import FileTracker

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    iso = IsolatedTracker(FileTracker(str(tmp_path / "store.jsonl"), str(tmp_path)))
    iso.start(
        RunStart(
            config={}, world_size=1, schedule="hdet", param_groups=["pg0"], explored=[], versions={}, hostnames=["h"]
        )
    )
    yield iso
    if iso._proc is not None and iso._proc.poll() is None:
        iso._proc.kill()
        iso._proc.wait()


def batch(step):
    return Batch(points=[Point("loss", 1.0 / step, step, 0)])


def kill(iso):
    os.kill(iso._proc.pid, signal.SIGKILL)
    iso._proc.wait()


def store(tmp_path):
    return [json.loads(line) for line in (tmp_path / "store.jsonl").read_text().splitlines()]


def fault(tmp_path, name):
    (tmp_path / name).touch()


def test_a_carry_on_retried_after_a_failed_batch_still_holds_what_it_gave_the_replacement(tracker, tmp_path):
    """The replacement took step 1 again, failed step 2; the retry asked it again to upload what
    was left (an answer that said it held nothing), and step 1 was dropped from what a second
    replacement would be given: its death lost it."""
    tracker.log(batch(1))
    tracker.log(batch(2))
    kill(tracker)
    with pytest.raises(ConnectionError):
        tracker.log(batch(3))  # the death is found; the hub spills this batch
    fault(tmp_path, "log-2")
    with pytest.raises(RuntimeError, match="injected: log-2"):
        tracker.log(batch(3))  # replaced; step 1 given again, step 2 refused for now
    tracker.log(batch(3))  # the retry: step 2, then this one
    kill(tracker)  # before the replacement wrote anything
    with pytest.raises(ConnectionError):
        tracker.log(batch(4))
    tracker.log(batch(4))
    tracker.finish(RunEnd(status="FINISHED", step=4))
    lines = store(tmp_path)
    runs = {line["start"] for line in lines if "start" in line}
    assert len(runs) == 1 and [line["row"] for line in lines if "row" in line] == [1, 2, 3, 4]
    assert lines[-1] == {"finish": tracker.run_id, "status": "FINISHED"}


def test_letting_go_of_a_replacement_with_a_carry_on_left_does_not_run_it(tracker, tmp_path):
    """A replay that stops half-way lets its tracker go (detach): that ran the carry-on left over,
    whose failure escaped the replay and left the spill under its claimed name, and the child,
    never let go, ended the run KILLED."""
    tracker.log(batch(1))
    kill(tracker)
    with pytest.raises(ConnectionError):
        tracker.log(batch(2))
    fault(tmp_path, "log-1")
    with pytest.raises(RuntimeError, match="injected: log-1"):
        tracker.log(batch(2))
    fault(tmp_path, "log-1")
    child = tracker._proc
    tracker.detach()  # does not raise
    assert child.wait(30) == 0
    assert (tmp_path / "log-1").exists()  # the carry-on did not run
    assert not [line for line in store(tmp_path) if "finish" in line]  # the run is left as it is


def test_a_replacement_that_cannot_be_started_is_tried_again_with_its_request(tracker, tmp_path, monkeypatch):
    """Popen failed (out of memory right after the kill): the carry-on request was used up anyway,
    the next child opened a new run, and the tracker was given up."""
    tracker.log(batch(1))
    first = tracker.run_id
    kill(tracker)
    with pytest.raises(ConnectionError):
        tracker.log(batch(2))
    real = isolated.subprocess.Popen

    def no_memory(*args, **kwargs):
        monkeypatch.setattr(isolated.subprocess, "Popen", real)
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(isolated.subprocess, "Popen", no_memory)
    with pytest.raises(OSError):
        tracker.log(batch(2))
    tracker.log(batch(2))
    tracker.finish(RunEnd(status="FINISHED", step=2))
    lines = store(tmp_path)
    assert [line["start"] for line in lines if "start" in line] == [first, first]
    assert [line["row"] for line in lines if "row" in line] == [1, 2] and tracker.run_id == first


def test_after_the_last_replacement_dies_the_tracker_is_broken_and_its_child_reaped(tracker, tmp_path):
    """The fourth death is final: the hub takes the backend for broken (its shutdown does not wait
    out its timeout retrying it), and the dead child is not left a zombie."""
    for step in range(1, isolated.RESTARTS + 2):
        tracker.log(batch(step))
        kill(tracker)
        with pytest.raises(ConnectionError):
            tracker.log(batch(step + 1))
    child = tracker._proc
    from hdet_track.tracking.base import BackendBroken, broken_backend

    with pytest.raises(BackendBroken) as raised:
        tracker.log(batch(9))
    assert broken_backend(raised.value) and child.returncode is not None and tracker._send is None

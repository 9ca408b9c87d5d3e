"""Spills that an outage or a kill left half-replayed, stranded or torn still reach their one run
(found by an audit of `hdet-track recover`). The backend's outages are injected into a real
MLflow tracker on a real sqlite store (tests/jobs/outage.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time

import pytest
from mlflow.tracking import MlflowClient

from hdet_track.events import RunStart
from hdet_track.owner import process_identity
from hdet_track.tracking import base
from hdet_track.tracking.base import Batch, Point
from hdet_track.tracking.hub import _Sink
from hdet_track.tracking.spill import STALE_SECONDS, orphans, recover, replay_file

from .jobs.outage import OutageMLflowTracker


@pytest.fixture
def outage(monkeypatch):
    OutageMLflowTracker.reset()
    monkeypatch.setitem(base.TRACKERS, "mlflow", "tests.jobs.outage:OutageMLflowTracker")
    yield OutageMLflowTracker
    OutageMLflowTracker.reset()


def _start():
    return RunStart(
        config={}, world_size=1, schedule="hdet", param_groups=["pg0"], explored=[], versions={}, hostnames=[]
    )


def _batch(step, start=False):
    return Batch(points=[Point("val_loss", float(step), step, 0)], events=[_start()] if start else [])


def _spill_while_down(outage, uri, directory, count):
    """A sink whose backend is down from the start: ``count`` batches, the run never created."""
    outage.reset(down=True)
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), directory, retry_seconds=0.0)
    for step in range(1, count + 1):
        sink.deliver(_batch(step, start=step == 1))
    assert json.loads(sink.spill_path.open().readline())["run_id"] is None
    return sink


def _val_steps(uri):
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    return [sorted(m.step for m in client.get_metric_history(r.info.run_id, "val_loss")) for r in runs]


def _dead_identity():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def _orphaned(path, pid):
    """The spill as its writer left it when killed: the header names a process that is gone."""
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["pid"], head["owner"] = pid, dict(head["owner"], pid=pid)
    path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")


def test_a_replay_cut_short_by_an_outage_keeps_the_run_it_created(tmp_path, outage):
    """The backend came back, the replay created the run and delivered a batch, and went down again:
    the spill kept the header it began with (no run), so the rest went to a second run."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 3)
    outage.reset(logs_left=1)  # back for the start and one batch, then down again
    sink.deliver(_batch(4))
    head = json.loads(sink.spill_path.open().readline())
    assert head["run_id"] is not None and head["run_id"] == sink.tracker.run_id
    outage.reset()
    assert "4 batches delivered" not in replay_file(sink.spill_path)  # the 3 left: steps 2-4
    assert _val_steps(uri) == [[1, 2, 3, 4]]  # one run


def test_recover_cut_short_then_rerun_continues_one_run(tmp_path, outage):
    """recover went down half-way and kept the whole spill without the run it had created, so a
    rerun made a second run with the first batches twice."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 4)
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset(logs_left=2)
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert line.endswith("; kept")
    head, *rest = sink.spill_path.read_text().splitlines()
    assert json.loads(head)["run_id"] is not None and len(rest) == 2  # what did not go through
    outage.reset()
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "2 batches delivered" in line
    assert _val_steps(uri) == [[1, 2, 3, 4]]


def test_a_replay_killed_mid_way_is_found_again(tmp_path, outage):
    """A recover killed while it replayed left `spill-*.jsonl.replaying-<pid>`, which nothing looked at again."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
    dead = _dead_identity()
    _orphaned(sink.spill_path, dead)
    stranded = sink.spill_path.with_name(sink.spill_path.name + f".replaying-{dead}")
    sink.spill_path.rename(stranded)
    assert list(orphans(tmp_path / ".hdet-spill")) == [sink.spill_path]
    outage.reset()
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "2 batches delivered" in line and _val_steps(uri) == [[1, 2]]


def _claim(spill, pid, host, start, pidns=None):
    """The name a replay on ``host`` (pid ``pid``, started at ``start``) gives the spill it claims."""
    place = hashlib.sha256(f"{host}|{pidns}".encode()).hexdigest()[:12]
    return spill.with_name(f"{spill.name}.replaying-{pid}-{place}-{start}")


def test_a_replay_running_on_another_host_is_left_until_its_claim_goes_still(tmp_path, outage):
    """A claim was known by its pid alone: on a spill directory shared between hosts, a replay still
    running on another host (its pid not alive here) was taken back and delivered twice."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
    _orphaned(sink.spill_path, _dead_identity())
    claim = _claim(sink.spill_path, _dead_identity(), "another-host", 12345)
    sink.spill_path.rename(claim)
    assert list(orphans(tmp_path / ".hdet-spill")) == [] and claim.exists()  # its replay may be running
    still = time.time() - STALE_SECONDS - 5
    os.utime(claim, (still, still))
    assert list(orphans(tmp_path / ".hdet-spill")) == [sink.spill_path]  # gone quiet: taken back
    outage.reset()
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "2 batches delivered" in line and _val_steps(uri) == [[1, 2]]


def test_a_replay_claim_on_this_host_names_its_process(tmp_path, outage, monkeypatch):
    """A replay's claim names its process (pid and start time, host and pid namespace): the claim of
    the replay under way is held, one whose pid now belongs to another process is taken back."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    directory = tmp_path / ".hdet-spill"
    sink = _spill_while_down(outage, uri, directory, 2)
    _orphaned(sink.spill_path, _dead_identity())
    seen = []
    log = outage.log

    def watching(self, batch):
        seen.append(([p.name for p in directory.glob("*.replaying-*")], list(orphans(directory))))
        log(self, batch)

    monkeypatch.setattr(outage, "log", watching)
    outage.reset()
    (line,) = recover(str(directory))
    assert "2 batches delivered" in line and len(seen) == 2
    me = process_identity()
    for claims, found in seen:  # mid-replay: its own claim, held
        assert claims == [_claim(sink.spill_path, me["pid"], me["host"], me["start"], me["pidns"]).name]
        assert found == []
    # a claim whose pid lives again in another process (its start time differs): taken back
    sink = _spill_while_down(outage, uri, directory, 1)
    _orphaned(sink.spill_path, _dead_identity())
    reused = _claim(sink.spill_path, os.getpid(), me["host"], int(me["start"]) + 1, me["pidns"])
    sink.spill_path.rename(reused)
    assert list(orphans(directory)) == [sink.spill_path] and not reused.exists()


def test_a_torn_last_batch_is_set_aside_and_the_rest_delivered(tmp_path, outage, caplog):
    """A writer killed while appending leaves a cut last line: it used to fail every replay."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 3)
    _orphaned(sink.spill_path, _dead_identity())
    text = sink.spill_path.read_text()
    sink.spill_path.write_text(text[: len(text) - 20])
    outage.reset()
    with caplog.at_level(logging.WARNING):
        (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "2 batches delivered" in line and _val_steps(uri) == [[1, 2]]
    assert "was cut short" in caplog.text
    (torn,) = (tmp_path / ".hdet-spill").glob("torn-*.jsonl")
    assert torn.read_text() == text[: len(text) - 20].splitlines()[-1] + "\n"


def test_a_spill_is_orphaned_when_its_writer_is_gone_even_if_its_pid_lives_again(tmp_path, outage):
    """Ownership was the pid alone: a reused pid (pid 1 in a container) held a dead job's spill forever."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
    assert list(orphans(tmp_path / ".hdet-spill")) == []  # this process wrote it and is alive
    lines = sink.spill_path.read_text().splitlines()
    head = json.loads(lines[0])
    head["owner"]["start"] = "1"  # the same pid, another process (started at another time)
    sink.spill_path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    assert list(orphans(tmp_path / ".hdet-spill")) == [sink.spill_path]


def test_archive_chunks_an_outage_kept_from_the_store_are_delivered_later(tmp_path, outage, monkeypatch):
    """The server went down mid-job: the batches before it counted as delivered (their metrics were
    in) while their archive chunk still waited for its upload in a temporary directory, which
    nothing looked at again; the run's rows for those steps were lost for good. The chunk now waits
    in the spill directory, and recover uploads it."""
    import torch

    from hdet_track import HDETScheduler
    from hdet_track.readers.mlflow import MLflowReader

    monkeypatch.setenv("HDET_TRACK_SHUTDOWN_TIMEOUT", "0")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    tracker = outage(tracking_uri=uri, experiment="out", chunk_seconds=0.0)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=30, sync_every=5, track=tracker)
    for k in range(1, 31):
        opt.step()
        sched.step(1.0 / k)
        if k == 10:
            assert sched.flush()
            outage.reset(uploads_down=True)  # metrics go in, their chunks cannot be uploaded
        if k == 20:
            assert sched.flush()
            outage.reset(down=True)  # and then nothing goes in: the next batches spill
    sched.close()
    spill = tmp_path / ".hdet-spill"
    (pending,) = spill.glob("pending-*")
    assert list(pending.rglob("*.parquet"))
    head = json.loads((pending / "pending.json").read_text())
    head["owner"] = dict(head["owner"], pid=_dead_identity())  # as when the job's process is gone
    (pending / "pending.json").write_text(json.dumps(head))
    (path,) = spill.glob("spill-*.jsonl")
    _orphaned(path, _dead_identity())
    outage.reset()
    lines = recover(str(spill))
    assert any("archive file(s) uploaded" in line for line in lines) and not any(
        line.endswith("kept") for line in lines
    )
    assert not list(spill.glob("pending-*"))
    run = MLflowReader(uri).read(tracker.run_id)
    steps, _ = run.replica_series("loss", 0)
    assert list(steps) == list(range(1, 31))
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [5, 10, 15, 20, 25, 30]


def _hdet_job_while_down(outage, uri, monkeypatch, steps=20):
    """A real scheduler's run spilled whole: the backend is down from start to end."""
    import torch

    from hdet_track import HDETScheduler

    monkeypatch.setenv("HDET_TRACK_SHUTDOWN_TIMEOUT", "0")
    outage.reset(down=True)
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=steps, sync_every=5, track=outage(tracking_uri=uri, experiment="out"))
    for k in range(1, steps + 1):
        opt.step()
        sched.step(1.0 / k)
        sched.flush()  # a batch per step
    sched.close()


def test_recover_cut_short_keeps_the_step_rows_of_what_it_delivered(tmp_path, outage, monkeypatch):
    """The batches a cut-short recover counted as delivered had their metric points in the store,
    but their step rows and syncs still in the writer's archive buffer: dropped from the spill and
    never written, they were lost (a review found it). They are written out first, to the pending
    chunks when the backend is down, and the next recover uploads them."""
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    _hdet_job_while_down(outage, uri, monkeypatch)
    spill = tmp_path / ".hdet-spill"
    (path,) = spill.glob("spill-*.jsonl")
    _orphaned(path, _dead_identity())
    outage.reset(logs_left=2)
    (line,) = recover(str(spill))
    assert line.endswith("; kept")
    for folder in spill.glob("pending-*"):  # recover's writer is gone too
        head = json.loads((folder / "pending.json").read_text())
        head["owner"] = dict(head["owner"], pid=_dead_identity())
        (folder / "pending.json").write_text(json.dumps(head))
    outage.reset()
    recover(str(spill))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    read = MLflowReader(uri).read(run.info.run_id)
    assert list(read.replica_series("loss", 0)[0]) == list(range(1, 21))
    assert [c.step for c in read.converge] == [5, 10, 15, 20]


def test_a_spill_of_another_host_is_delivered_once_it_has_been_still_for_long(tmp_path, outage):
    """This host cannot tell whether a process on another host (a node of a shared filesystem, a
    recreated container) is alive: its spill is taken for orphaned once unchanged for 5 minutes."""
    import os
    import time

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
    lines = sink.spill_path.read_text().splitlines()
    head = json.loads(lines[0])
    head["owner"] = dict(head["owner"], host="another-node")
    sink.spill_path.write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
    assert list(orphans(tmp_path / ".hdet-spill")) == []  # it may still be writing
    old = time.time() - 600
    os.utime(sink.spill_path, (old, old))
    assert list(orphans(tmp_path / ".hdet-spill")) == [sink.spill_path]

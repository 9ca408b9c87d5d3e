"""Spills that an outage or a kill left half-replayed, stranded or torn still reach their one run
(found by an audit of `hdet-track recover`). The backend's outages are injected into a real
MLflow tracker on a real sqlite store (tests/jobs/outage.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hdet_track.events import RunStart
from hdet_track.owner import process_identity
from hdet_track.tracking import base
from hdet_track.tracking.base import Batch, Point
from hdet_track.tracking.hub import _Sink
from hdet_track.tracking.spill import STALE_SECONDS, orphans, recover, replay_file


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
    assert "were cut short" in caplog.text
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


def test_a_job_resuming_the_run_of_a_spill_takes_it_in_up_to_its_checkpoint_and_keeps_the_run_open(tmp_path, outage):
    """Attempt 1 logged run X, the backend went down after step 2, the job was killed at step 6 (its
    checkpoint at step 4). Attempt 2 resumes X: at its start the hub replayed attempt 1's spill into X
    apart, which ended X FAILED while attempt 2 trained, and put attempt 1's steps 5-6 (done again
    by attempt 2) in beside attempt 2's. Now attempt 2 takes the spill in through its own tracker, up
    to its checkpoint's step, and the run stays RUNNING until attempt 2 ends it."""
    from hdet_track.tracking.hub import TrackingHub

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    outage.reset(logs_left=2)
    first = _Sink(outage(tracking_uri=uri, experiment="out"), None, retry_seconds=1e9)
    for step in range(1, 7):
        first.deliver(
            Batch(
                points=[Point("val_loss", float(step), step, 1000 + step), Point("loss", float(step), step, 0)],
                events=[_start()] if step == 1 else [],
            )
        )
    run_id = first.tracker.run_id
    assert json.loads(first.spill_path.open().readline())["run_id"] == run_id
    _orphaned(first.spill_path, _dead_identity())
    outage.reset()  # the backend is back for attempt 2
    client = MlflowClient(uri)
    second = outage(tracking_uri=uri, experiment="out")
    second.resume(run_id)
    hub = TrackingHub([second], shutdown_timeout=5, heartbeat_seconds=None)
    hub.start(dataclasses.replace(_start(), start_step=4, total_steps=8))
    hub.metrics({"val_loss": 105.0, "loss": 105.0}, 5)
    hub.note_step(5)
    hub.flush()
    assert client.get_run(run_id).info.status == "RUNNING"  # attempt 2 still trains
    assert not list(first.spill_path.parent.glob("spill-*"))  # taken in
    for step in (6, 7, 8):
        hub.metrics({"val_loss": 100.0 + step, "loss": 100.0 + step}, step)
        hub.note_step(step)
    hub.close("FINISHED", step=8)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "hdet.error" not in run.data.tags
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "val_loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    assert len(client.search_runs([client.get_experiment_by_name("out").experiment_id])) == 1


def test_a_job_resumed_after_an_attempt_the_backend_never_saw_takes_that_attempts_spill_in(tmp_path, outage):
    """An audit's finding: attempt 1 ran with the backend down from its start (no run, so its
    checkpoint at step 4 named none) and was killed at step 6; attempt 2, with the backend back,
    started a run of its own, and attempt 1's spill was replayed as a second run holding steps 1-6.
    The checkpoint now carries the job's id, and the spill is known by it: attempt 2 takes steps
    1-4 in, and the job is one run with each step once."""
    from hdet_track.tracking.hub import TrackingHub

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    job = dataclasses.replace(_start(), job="job-1")
    outage.reset(down=True)
    first = _Sink(outage(tracking_uri=uri, experiment="out"), None, retry_seconds=1e9)
    for step in range(1, 7):
        first.deliver(Batch(points=[Point("val_loss", float(step), step, 0)], events=[job] if step == 1 else []))
    assert json.loads(first.spill_path.open().readline())["run_id"] is None
    _orphaned(first.spill_path, _dead_identity())
    outage.reset()  # the backend is back for attempt 2, which resumes from the checkpoint at step 4
    hub = TrackingHub([outage(tracking_uri=uri, experiment="out")], shutdown_timeout=5, heartbeat_seconds=None)
    hub.start(dataclasses.replace(job, start_step=4, total_steps=8))
    for step in range(5, 9):
        hub.metrics({"val_loss": 100.0 + step}, step)
        hub.note_step(step)
    hub.close("FINISHED", step=8)
    assert not list(first.spill_path.parent.glob("spill-*"))  # taken in, not left for a replay apart
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0), (8, 108.0)]
    assert run.info.status == "FINISHED"
    # another job's run-less spill is not taken in: only the same job's
    outage.reset(down=True)
    other = _Sink(outage(tracking_uri=uri, experiment="out"), None, retry_seconds=1e9)
    other.deliver(Batch(points=[Point("val_loss", 1.0, 1, 0)], events=[dataclasses.replace(job, job="job-2")]))
    _orphaned(other.spill_path, _dead_identity())
    outage.reset()
    hub = TrackingHub([outage(tracking_uri=uri, experiment="out")], shutdown_timeout=5, heartbeat_seconds=None)
    hub.start(dataclasses.replace(job, start_step=4, total_steps=8))
    hub.close("FINISHED", step=4)
    assert len(client.search_runs([client.get_experiment_by_name("out").experiment_id])) == 3  # job-2's apart


def test_of_several_killed_attempts_each_counts_up_to_where_the_next_resumed(tmp_path, outage):
    """Attempt 1 (from step 0, killed at 6) and attempt 2 (resumed at 4, killed at 8) both ran
    with the backend down; attempt 3 resumes at 7 with it back. Both spills were cut at 7, so
    steps 5-6 came in twice (attempt 1's and attempt 2's); each attempt now counts up to where the
    next one resumed."""
    from hdet_track.tracking.hub import TrackingHub

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    job = dataclasses.replace(_start(), job="job-1")
    outage.reset(down=True)
    for first, last, start, offset in ((1, 6, 0, 0.0), (5, 8, 4, 50.0)):
        sink = _Sink(outage(tracking_uri=uri, experiment="out"), None, retry_seconds=1e9)
        started = dataclasses.replace(job, start_step=start)
        for step in range(first, last + 1):
            point = Point("val_loss", offset + step, step, 0)
            sink.deliver(Batch(points=[point], events=[started] if step == first else []))
        _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    hub = TrackingHub([outage(tracking_uri=uri, experiment="out")], shutdown_timeout=5, heartbeat_seconds=None)
    hub.start(dataclasses.replace(job, start_step=7, total_steps=8))
    hub.metrics({"val_loss": 108.0}, 8)
    hub.note_step(8)
    hub.close("FINISHED", step=8)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val_loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 55.0), (6, 56.0), (7, 57.0), (8, 108.0)]


def test_a_replay_never_goes_to_the_run_its_process_environment_names(tmp_path, outage, monkeypatch):
    """`recover` (or the next job's start) in a shell or job with $MLFLOW_RUN_ID set (`mlflow run`)
    delivered the orphaned spill into that run and ended it FAILED; the spill's own experiment was
    never created."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 3)
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    client = MlflowClient(uri)
    other = client.create_run(client.create_experiment("mine")).info.run_id
    monkeypatch.setenv("MLFLOW_RUN_ID", other)
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "3 batches delivered" in line and other not in line, line
    assert client.get_run(other).info.status == "RUNNING" and not client.get_metric_history(other, "val_loss")
    assert _val_steps(uri) == [[1, 2, 3]]
    # the job ended without a word (no end in its spill): KILLED, as the readers call such a run
    (run,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    assert run.info.status == "KILLED" and "without ending its run" in run.data.tags["hdet.error"]


def test_a_resumed_job_spilled_whole_goes_to_the_run_it_resumed(tmp_path, outage):
    """A job resumed from a checkpoint (tracker.resume(run)) with the backend down the whole time:
    its spill did not name the run to resume, and its replay made a new run."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    first = client.create_run(client.create_experiment("out"), run_name="attempt-1").info.run_id
    for step in range(1, 6):
        client.log_metric(first, "val_loss", float(step), step=step)
    client.set_terminated(first, "FAILED")
    outage.reset(down=True)
    tracker = outage(tracking_uri=uri, experiment="out")
    tracker.resume(first)
    sink = _Sink(tracker, tmp_path / ".hdet-spill", retry_seconds=0.0)
    resumed = dataclasses.replace(_start(), start_step=5)
    for step in range(6, 9):
        sink.deliver(Batch(points=[Point("val_loss", float(step), step, 0)], events=[resumed] if step == 6 else []))
    sink.deliver(Batch(events=[base.RunEnd(status="FINISHED", step=8)]))
    assert json.loads(sink.spill_path.open().readline())["run_id"] == first
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert f"run {first}" in line, line
    assert _val_steps(uri) == [list(range(1, 9))] and client.get_run(first).info.status == "FINISHED"


def test_a_replay_keeps_the_given_run_the_parent_the_tags_and_the_default_experiment(tmp_path, outage, monkeypatch):
    """The spill's settings dropped ``run_id=`` (a given run got nothing, a new run got it all),
    ``parent_run_id=`` and ``tags=``, and left the experiment to the replaying shell's
    $MLFLOW_EXPERIMENT_NAME when the job had used the default."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    given = client.create_run(client.create_experiment("owners"), run_name="hf").info.run_id
    parent = client.create_run(client.get_experiment_by_name("owners").experiment_id).info.run_id
    spills = tmp_path / ".hdet-spill"
    outage.reset(down=True)
    for kwargs in ({"run_id": given}, {"parent_run_id": parent, "tags": {"team": "vision"}}):
        sink = _Sink(outage(tracking_uri=uri, **kwargs), spills, retry_seconds=0.0)
        for step in range(1, 4):
            sink.deliver(_batch(step, start=step == 1))
        if "run_id" in kwargs:  # the job ended well while the backend was down
            sink.deliver(Batch(events=[base.RunEnd(status="FINISHED", step=3)]))
        _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "recover-shell")
    lines = recover(str(spills))
    assert sorted(line.split(":")[1].split(" to ")[0] for line in lines) == [
        " 3 batches delivered",
        " 4 batches delivered",
    ]
    assert [m.step for m in client.get_metric_history(given, "val_loss")] == [1, 2, 3]
    # ended as the job ended it (its owner's process is gone too): not left RUNNING, read KILLED
    assert client.get_run(given).info.status == "FINISHED"
    assert client.get_experiment_by_name("recover-shell") is None
    (child,) = client.search_runs([client.get_experiment_by_name("hdet").experiment_id])
    assert child.data.tags["mlflow.parentRunId"] == parent and child.data.tags["team"] == "vision"


def test_a_wandb_replay_never_goes_to_the_run_wandb_run_id_names(tmp_path, monkeypatch):
    """W&B takes $WANDB_RUN_ID (a sweep agent's, a resumable job's) when wandb.init gets no id: a
    replay in such a process wrote the spill into that run."""
    from hdet_track.events import RunEnd
    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.spill import SpillFile, header
    from hdet_track.tracking.wandb import WandbTracker

    tracker = WandbTracker(dir=str(tmp_path), project="proj")
    head = header(tracker, _start())
    dead = _dead_identity()
    head["pid"], head["owner"] = dead, dict(head["owner"], pid=dead)
    spill = SpillFile(tracker.spill_dir() / "spill-wandb-1-1.jsonl", head)
    spill.append(_batch(1, start=True))
    spill.append(Batch(points=[Point("val_loss", 2.0, 2, 0)], events=[RunEnd(status="FINISHED", step=2)]))
    monkeypatch.setenv("WANDB_RUN_ID", "currentjob01")
    line = replay_file(spill.path)
    assert "2 batches delivered" in line and "currentjob01" not in line, line
    assert not list((tmp_path / "wandb").glob("*currentjob01*"))
    (listed,) = WandbReader(str(tmp_path / "wandb")).list_runs()
    assert listed.status == "FINISHED" and listed.run_id in line


def test_a_line_cut_short_in_the_middle_loses_only_itself(tmp_path, outage, caplog):
    """A write that failed half-way (a full disk) left a cut line, the writer went on, and its next
    batch was glued onto that line: every replay then failed on it and kept the whole spill."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
    cut = '{"events": [], "points": [["val_loss", 3'
    with open(sink.spill_path, "a") as f:
        f.write(cut)  # what reached the disk of batch 3
    for step in (4, 5):
        sink.deliver(_batch(step))
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    with caplog.at_level(logging.WARNING):
        (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "4 batches delivered" in line and _val_steps(uri) == [[1, 2, 4, 5]], line
    assert "1 batch(es)" in caplog.text and "cut short" in caplog.text
    (torn,) = (tmp_path / ".hdet-spill").glob("torn-*.jsonl")
    assert torn.read_text() == cut + "\n"


def test_a_spill_is_found_however_the_store_is_spelled_and_goes_where_the_job_ran(tmp_path, monkeypatch):
    """An MLflow server's spills went to a folder named after the URI's spelling (a last ``/``, an
    upper-case scheme), so `recover http://HOST:PORT` missed the job's ``http://HOST:PORT/`` spill;
    a relative file store (``mlruns``, ``file:./mlruns``) was replayed into a new store where
    `recover` ran; `recover .hdet-spill` inside ``wandb/`` wrote the run one level too deep."""
    from hdet_track.tracking.spill import _anchored, spill_dirs, store_spill_dir

    spelled = {store_spill_dir(u) for u in ("http://127.0.0.1:5000", "http://127.0.0.1:5000/", "HTTP://127.0.0.1:5000")}
    assert len(spelled) == 1 and store_spill_dir("http://127.0.0.1:5001") not in spelled
    # where the previous version put the spills of those spellings: still looked in
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "hdet-track" / "spill"
    assert spill_dirs("http://127.0.0.1:5000/") == [*spelled, cache / "127.0.0.1_5000_"]
    assert spill_dirs("HTTP://127.0.0.1:5000") == [*spelled, cache / "http_127.0.0.1_5000"]
    assert spill_dirs("http://127.0.0.1:5000") == [*spelled]
    assert spill_dirs("databricks") == [store_spill_dir("databricks")]  # a store, not a folder here
    job = tmp_path / "job"
    for spills in (job / "mlruns" / ".hdet-spill", job / "wandb" / ".hdet-spill", tmp_path / "elsewhere"):
        spills.mkdir(parents=True)
    monkeypatch.chdir(job / "wandb")
    assert _anchored("wandb", {"dir": None}, Path(".hdet-spill"))["dir"] == str(job)
    monkeypatch.chdir(tmp_path / "elsewhere")
    for uri, store in [
        ("mlruns", str(job / "mlruns")),
        ("file:./mlruns", f"file://{job / 'mlruns'}"),
        ("file:///abs/mlruns", "file:///abs/mlruns"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ]:
        assert _anchored("mlflow", {"tracking_uri": uri}, job / "mlruns" / ".hdet-spill")["tracking_uri"] == store
        assert _anchored("mlflow", {"tracking_uri": uri}, job / ".hdet-spill")["tracking_uri"] == store  # beside it


def test_a_part_refused_before_a_replay_is_cut_short_is_set_aside(tmp_path, outage):
    """The backend refused a part of batch 2 for its content (a metric key over MLflow's limit),
    then went down before batch 5: batches 1-4 left the spill, and the refused part with them,
    set aside nowhere (only a replay that went through wrote the refused file)."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    spills = tmp_path / ".hdet-spill"
    outage.reset(down=True)
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), spills, retry_seconds=0.0)
    bad = "bad/" + "x" * 300
    for step in range(1, 6):
        extra = [Point(bad, 7.0, step, 0)] if step == 2 else []
        sink.deliver(
            Batch(points=[*extra, Point("val_loss", float(step), step, 0)], events=[_start()] if step == 1 else [])
        )
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset(logs_left=6)  # batch 1, batch 2 refused then its two parts one by one, batches 3 and 4
    (line,) = recover(str(spills))
    assert line.endswith("; kept"), line
    (aside,) = spills.glob("refused-*.jsonl")
    assert bad in aside.read_text() and bad not in sink.spill_path.read_text()
    outage.reset()
    (line,) = recover(str(spills))
    assert "batches delivered" in line and _val_steps(uri) == [[1, 2, 3, 4, 5]], line
    assert aside.read_text().count(bad) == 1


def test_two_runs_of_one_tracker_object_in_turn_spill_apart(tmp_path, outage):
    """A spill was named after id(tracker): the same tracker object logging a second run (a sweep's
    next trial; or a new tracker at a freed object's address) appended to the first run's spill,
    under its header, and both runs' batches were replayed into one run."""
    from hdet_track.events import RunEnd

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    spills = tmp_path / ".hdet-spill"
    outage.reset(down=True)
    tracker = outage(tracking_uri=uri, experiment="out")
    paths = []
    for _ in range(2):
        sink = _Sink(tracker, spills, retry_seconds=0.0)
        for step in range(1, 4):
            sink.deliver(_batch(step, start=step == 1))
        sink.deliver(Batch(events=[RunEnd(status="FINISHED", step=3)]))
        paths.append(sink.spill_path)
    assert paths[0] != paths[1]
    dead = _dead_identity()
    for path in paths:
        _orphaned(path, dead)
    outage.reset()
    lines = recover(str(spills))
    assert len(lines) == 2 and all("4 batches delivered" in line for line in lines), lines
    assert _val_steps(uri) == [[1, 2, 3], [1, 2, 3]]


def test_orphaned_spills_are_replayed_in_the_order_their_jobs_started(tmp_path, outage):
    """Spills were replayed by name: a resumed attempt's (pid 10000) before its earlier attempt's
    (pid 9999), whose end then won. Nor by the files' times: a replay cut short touches its claim."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    spills = tmp_path / ".hdet-spill"
    older = _spill_while_down(outage, uri, spills, 1).spill_path
    newer = _spill_while_down(outage, uri, spills, 1).spill_path
    dead = _dead_identity()
    for path, name, started, touched in [
        (older, "spill-mlflow-9999-a.jsonl", 1000, 3000),  # touched last by a replay cut short
        (newer, "spill-mlflow-10000-b.jsonl", 2000, 2500),
    ]:
        _orphaned(path, dead)
        head, *rest = path.read_text().splitlines()
        head = json.loads(head)
        head["run_start"] = dict(head["run_start"], time=started)
        path.write_text("\n".join([json.dumps(head), *rest]) + "\n")
        os.utime(path.rename(spills / name), (touched, touched))
    assert [p.name for p in orphans(spills)] == ["spill-mlflow-9999-a.jsonl", "spill-mlflow-10000-b.jsonl"]
    assert json.loads((spills / "spill-mlflow-9999-a.jsonl").open().readline())["run_start"]["time"] == 1000


def test_an_empty_spill_a_full_disk_left_holds_back_nothing(tmp_path, outage):
    """A first write that failed (a full disk) leaves the spill empty: reading it raised, out of the
    writer's retry, and the writer thread died; tracking stopped for the rest of the run."""
    from hdet_track.tracking.spill import SpillFile

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    outage.reset(down=True)
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), tmp_path / ".hdet-spill", retry_seconds=0.0)
    sink.deliver(_batch(1, start=True))
    sink.spill_path.write_bytes(b"")  # what the full disk kept of it
    assert SpillFile(sink.spill_path, {}).batches() == []
    outage.reset()
    sink.deliver(_batch(2))  # the backend is back: the retry reads the empty spill, and goes on
    sink.deliver(_batch(3))
    assert [p.step for b in SpillFile(sink.spill_path, {}).batches() for p in b.points] == [2, 3]
    # the batch with the run's start is gone, its header keeps it: the spill still makes its run
    _orphaned(sink.spill_path, _dead_identity())
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "2 batches delivered" in line and _val_steps(uri) == [[2, 3]], line


def test_a_fresh_job_in_a_given_run_delivers_an_earlier_processs_spill_of_it_whole(tmp_path, outage):
    """Only a resumed job takes an earlier spill of its run in up to its checkpoint; a fresh job
    (step 0) given the same run took it in "up to step 0", and the spill's steps were lost."""
    from hdet_track.tracking.hub import TrackingHub

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    given = client.create_run(client.create_experiment("out")).info.run_id
    outage.reset(logs_left=1)
    first = _Sink(outage(tracking_uri=uri, run_id=given), None, retry_seconds=1e9)
    for step in range(1, 5):
        first.deliver(_batch(step, start=step == 1))
    _orphaned(first.spill_path, _dead_identity())
    outage.reset()
    hub = TrackingHub([outage(tracking_uri=uri, run_id=given)], shutdown_timeout=5, heartbeat_seconds=None)
    hub.start(_start())
    hub.flush()
    assert sorted(m.step for m in client.get_metric_history(given, "val_loss")) == [1, 2, 3, 4]
    hub.close("FINISHED", step=0)


def test_a_spill_that_cannot_be_written_loses_that_batch_only(tmp_path, outage, monkeypatch, caplog):
    """The backend down and the disk full: the spill's write raised out of the writer's pass, so
    that pass's flush() callers waited out their timeout and a run end in it was never sent. Now the
    batch is lost with an error, and the end still reaches the backend once it is back."""
    from hdet_track.events import RunEnd
    from hdet_track.tracking.spill import SpillFile

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    outage.reset(down=True)
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), tmp_path / ".hdet-spill", retry_seconds=0.0)
    sink.deliver(_batch(1, start=True))

    def full(self, batch):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch, caplog.at_level(logging.ERROR):
        patch.setattr(SpillFile, "append", full)  # the fault: the disk is full
        sink.deliver(_batch(2))
    assert "cannot be written" in caplog.text and "No space left" in caplog.text
    outage.reset()
    sink.deliver(Batch(events=[RunEnd(status="FINISHED", step=2)]))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    assert run.info.status == "FINISHED" and _val_steps(uri) == [[1]]


def test_a_quiet_live_writer_keeps_its_spill_and_pending_chunks_from_other_hosts(tmp_path, outage, monkeypatch):
    """With heartbeats off, a writer touched its spill only when a batch came: a job that logged
    nothing for 5 minutes (a long evaluation) looked gone to another host, whose `recover` ended the
    run KILLED while the job trained. The same for the archive chunks waiting to be uploaded."""
    from hdet_track.tracking import hub as hub_module
    from hdet_track.tracking.hub import TrackingHub

    monkeypatch.setattr(hub_module, "KEEP_ALIVE_SECONDS", 0.3)
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    still = time.time() - STALE_SECONDS - 5

    def touched_again(path):
        os.utime(path, (still, still))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and time.time() - path.stat().st_mtime > STALE_SECONDS:
            time.sleep(0.1)
        return time.time() - path.stat().st_mtime < 30

    outage.reset(down=True)  # the backend is down: the writer spills
    hub = TrackingHub([outage(tracking_uri=uri, experiment="out")], heartbeat_seconds=None, flush_seconds=0.1,
                      retry_seconds=1e9, shutdown_timeout=2)  # fmt: skip
    hub.start(_start())
    hub.metrics({"val_loss": 1.0}, 1)
    hub.flush()
    (spill,) = (tmp_path / ".hdet-spill").glob("spill-*.jsonl")
    assert touched_again(spill)
    hub.close("FINISHED", step=1)

    outage.reset()  # the backend answers: the run's chunks wait in a pending folder until uploaded
    hub = TrackingHub([outage(tracking_uri=uri, experiment="out")], heartbeat_seconds=None, flush_seconds=0.1,
                      shutdown_timeout=5)  # fmt: skip
    hub.start(_start())
    hub.flush()
    (pending,) = (tmp_path / ".hdet-spill").glob("pending-*/pending.json")
    assert touched_again(pending)
    hub.close("FINISHED", step=0)


def test_a_recover_killed_after_creating_the_run_leaves_the_spill_naming_it(tmp_path, outage, monkeypatch):
    """The spill named its run only when a replay failed with an exception: a recover killed after it
    created the run (and delivered part of the spill) left the spill naming none, so the next recover
    made a second run."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    directory = tmp_path / ".hdet-spill"
    sink = _spill_while_down(outage, uri, directory, 4)
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    calls = []
    real_log = outage.log

    def killed_at_the_second_batch(self, batch):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # stands for SIGKILL: nothing of replay_file runs after it
        real_log(self, batch)

    monkeypatch.setattr(outage, "log", killed_at_the_second_batch)
    with pytest.raises(KeyboardInterrupt):
        replay_file(sink.spill_path)
    (claim,) = directory.glob("spill-*.jsonl.replaying-*")
    claim.rename(sink.spill_path)  # what orphans() does once the killed replay's process is gone
    monkeypatch.setattr(outage, "log", real_log)
    (line,) = recover(str(directory))
    assert "delivered" in line
    assert _val_steps(uri) == [[1, 2, 3, 4]]  # one run


def test_a_claim_is_fresh_for_other_hosts_when_it_is_made(tmp_path, outage):
    """A rename keeps a file's time, and a spill another host may claim has been still for 5
    minutes: the new claim looked still too, so a recover on another host took it back and
    delivered it a second time while the first replay was starting."""
    from hdet_track.tracking import spill as spill_module

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
    still = time.time() - STALE_SECONDS - 5
    os.utime(sink.spill_path, (still, still))
    claimed = spill_module._claim(sink.spill_path)
    assert claimed is not None and time.time() - claimed.stat().st_mtime < 60


def test_a_rerun_of_a_killed_recover_continues_its_one_run(tmp_path, outage, monkeypatch):
    """A recover killed after some batches reached the store and its event archive: the rerun goes
    on in the same run (it sends the spill again from its start: the store keeps each point once,
    the readers each step's rows once)."""
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.tracking.archive import EventArchive

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    _hdet_job_while_down(outage, uri, monkeypatch)
    spill = tmp_path / ".hdet-spill"
    (path,) = spill.glob("spill-*.jsonl")
    assert len(path.read_text().splitlines()) > 5  # a header and more than 4 batches
    _orphaned(path, _dead_identity())
    outage.reset()
    monkeypatch.setattr(EventArchive, "due", lambda self: self._rows + len(self._other) > 0)  # a chunk per batch
    calls, real_log = [], outage.log

    def killed_at_the_fourth_batch(self, batch):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # stands for SIGKILL
        real_log(self, batch)

    monkeypatch.setattr(outage, "log", killed_at_the_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        replay_file(path)
    (claim,) = spill.glob("spill-*.jsonl.replaying-*")
    claim.rename(path)  # what orphans() does once the killed replay's process is gone
    for folder in spill.glob("pending-*"):  # the killed replay's chunks, all uploaded already
        head = json.loads((folder / "pending.json").read_text())
        head["owner"] = dict(head["owner"], pid=_dead_identity())
        (folder / "pending.json").write_text(json.dumps(head))
    monkeypatch.setattr(outage, "log", real_log)
    assert all("delivered" in line or "uploaded" in line for line in recover(str(spill)))
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    assert set(_archived_steps(client, run.info.run_id, tmp_path / "got")) == set(range(1, 21))
    read = MLflowReader(uri).read(run.info.run_id)
    assert list(read.replica_series("loss", 0)[0]) == list(range(1, 21))
    assert [c.step for c in read.converge] == [5, 10, 15, 20]


def _archived_steps(client, run_id, where):
    """The step of every row (replica 0) in the run's event archive, as stored."""
    import pyarrow.parquet as pq

    out = []
    for f in client.list_artifacts(run_id, "hdet_events"):
        if f.path.rsplit("/", 1)[-1].startswith("steps-"):
            where.mkdir(exist_ok=True)
            table = pq.read_table(client.download_artifacts(run_id, f.path, str(where)))
            out += [s for s, r in zip(table["step"].to_pylist(), table["replica"].to_pylist()) if r == 0]
    return sorted(out)


def _spill_with_lines(outage, tmp_path, steps, change):
    """An orphaned spill of ``steps`` (the backend down from the start), its lines (bytes, the header
    first) replaced by ``change(lines)``."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", steps)
    _orphaned(sink.spill_path, _dead_identity())
    lines = sink.spill_path.read_bytes().splitlines(keepends=True)
    sink.spill_path.write_bytes(b"".join(change(lines)))
    outage.reset()
    return uri, sink.spill_path


def test_damaged_lines_in_a_spill_go_aside_as_torn_and_the_rest_is_delivered(tmp_path, outage, caplog):
    """A line of bytes that are no UTF-8 (a damaged block) made reading the spill raise, and a line
    that is JSON but no batch (``{}``, ``null``) stopped the replay: the whole spill was kept, and
    tried again, forever. Each such line is set aside as torn, like a cut one."""
    bad = [b"\xff\xfe\x00garbage\n", b"{}\n", b"null\n"]
    uri, path = _spill_with_lines(outage, tmp_path, 5, lambda lines: lines[:3] + bad + lines[3:])
    with caplog.at_level(logging.WARNING):
        (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "5 batches delivered" in line and _val_steps(uri) == [[1, 2, 3, 4, 5]], line
    assert "3 batch(es)" in caplog.text
    (torn,) = (tmp_path / ".hdet-spill").glob("torn-*.jsonl")
    assert torn.read_bytes() == b"".join(bad) and not path.exists()


def test_a_spill_whose_header_cannot_be_read_is_reported_not_passed_over(tmp_path, outage, caplog, capsys):
    """A spill whose first line was cut (an earlier version wrote the header and the first batch in
    one write, which a full disk cut) or is no UTF-8 was skipped without a word: recover said
    "nothing to deliver" and exited 0, and no job ever delivered it."""
    from hdet_track.cli import main

    for n, cut in enumerate([lambda head: head[:40] + b"\n", lambda head: b"\xff" + head[1:]]):
        spill = tmp_path / str(n) / ".hdet-spill"
        spill.parent.mkdir()
        _, path = _spill_with_lines(outage, spill.parent, 3, lambda lines, cut=cut: [cut(lines[0]), *lines[2:]])
        (line,) = recover(str(spill))
        assert line.startswith(path.name) and "cannot be read" in line
        assert str(path) in line and "2 batch line(s)" in line and path.exists()  # left for a person to mend
        assert main(["recover", str(spill)]) == 2
        assert path.name in capsys.readouterr().out
        with caplog.at_level(logging.WARNING):  # a job starting on the store says so too
            assert list(orphans(spill)) == []
        assert f"{path.name}: its first line" in caplog.text


def test_a_spills_header_is_written_whole_or_not_at_all(tmp_path, outage):
    """The header went out in one write with the first batch: a disk that filled during it left the
    spill with its first line cut, and the batches appended later named no backend, store or run.
    Now the header is written apart and renamed into place: the batch whose write failed is lost,
    the ones after it are delivered to their run. The disk filling is a file-size limit (RLIMIT_FSIZE):
    a write crossing it is cut there, as on a full disk."""
    import resource
    import signal

    from hdet_track.tracking.spill import SpillFile

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    outage.reset(down=True)
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), tmp_path / ".hdet-spill", retry_seconds=1e9)
    sink.deliver(_batch(1, start=True))  # the first write: header and batch 1
    path, header = sink.spill_path, json.loads(sink.spill_path.open().readline())
    path.unlink()
    spill = SpillFile(path, header)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), cut
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(json.dumps(header)) // 2, hard))
        with pytest.raises(OSError):
            spill.append(_batch(1, start=True))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    for step in (2, 3):  # the disk has room again: the writer goes on
        spill.append(_batch(step))
    assert json.loads(path.open().readline()) == header
    _orphaned(path, _dead_identity())
    outage.reset()
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "2 batches delivered" in line and _val_steps(uri) == [[2, 3]], line


def test_a_killed_job_recovered_later_ends_when_it_last_logged(tmp_path, outage):
    """A job killed while its backend was down, recovered a day later, was ended at the recover's
    time: MLflow showed a 5-minute job as a 24-hour run."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    began = time.time() - 86400
    outage.reset(down=True)
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), tmp_path / ".hdet-spill", retry_seconds=1e9)
    for step in range(1, 6):
        events = [dataclasses.replace(_start(), time=began)] if step == 1 else []
        point = Point("val_loss", float(step), step, int((began + 60 * step) * 1000))
        sink.deliver(Batch(points=[point], events=events))
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert "5 batches delivered" in line
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("out").experiment_id])
    assert run.info.status == "KILLED"
    assert run.info.start_time == int(began * 1000) and run.info.end_time == int((began + 300) * 1000)


def _pending_folder(tmp_path, uri):
    """A folder of archive chunks a gone job left for run ``run``, with what it holds."""
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("out")).info.run_id
    folder = tmp_path / ".hdet-spill" / f"pending-{run}-99999"
    (folder / "hdet_events").mkdir(parents=True)
    for i in range(3):
        (folder / "hdet_events" / f"steps-{i:06d}.parquet").write_bytes(b"x" * 100)
    owner = dict(process_identity(), pid=_dead_identity())
    head = {"backend": "mlflow", "run_id": run, "settings": {"tracking_uri": uri, "experiment": "out"}, "owner": owner}
    (folder / "pending.json").write_text(json.dumps(head))
    return client, run, folder


def test_a_pending_folder_is_uploaded_by_one_of_two_recovers_at_once(tmp_path, outage):
    """Two recovers at once both uploaded a folder of pending chunks: the one that came second found
    it removed under it (FileNotFoundError) and said "not uploaded ...; kept", exit 1. A recover
    now claims the folder first, by renaming it, as it claims a spill; a claim whose process died
    is taken back."""
    from hdet_track.tracking.spill import pending_orphans, upload_pending_folder

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client, run, folder = _pending_folder(tmp_path, uri)
    (found,) = pending_orphans(folder.parent)  # both recovers find it; the other one takes it first
    other = _claim(folder, os.getpid(), process_identity()["host"], process_identity()["start"] or 0,
                   process_identity()["pidns"])  # fmt: skip
    folder.rename(other)
    line = upload_pending_folder(found)
    assert line == f"{folder.name}: taken by another process"
    assert list(pending_orphans(folder.parent)) == [] and other.exists()  # its upload is under way
    dead = _claim(folder, _dead_identity(), process_identity()["host"], 0, process_identity()["pidns"])
    other.rename(dead)  # that recover was killed mid-way
    (again,) = recover(str(tmp_path / ".hdet-spill"))
    assert again == f"{folder.name}: 3 archive file(s) uploaded to mlflow run {run} in {uri}", again
    assert not list((tmp_path / ".hdet-spill").iterdir())
    assert len(client.list_artifacts(run, "hdet_events")) == 3


def test_a_spill_of_a_run_deleted_for_good_is_moved_aside_not_retried_forever(tmp_path, outage, capsys):
    """A spill whose run was purged (`mlflow gc`) could never be delivered: every recover said "not
    delivered (... not found); kept" and exited 1, and every job on the store retried it at its
    start. A run in the trash is still kept for (it may be restored); a run that is gone moves the
    spill aside, with a line naming the run and the file that keeps its batches, and exit 2."""
    from hdet_track.cli import main

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    outage.reset(logs_left=1)  # up for the start and one batch, then down
    sink = _Sink(outage(tracking_uri=uri, experiment="out"), tmp_path / ".hdet-spill", retry_seconds=1e9)
    for step in range(1, 5):
        sink.deliver(_batch(step, start=step == 1))
    run_id = sink.tracker.run_id
    sink.tracker._end_run()
    _orphaned(sink.spill_path, _dead_identity())
    outage.reset()
    client = MlflowClient(uri)
    client.delete_run(run_id)  # in the trash: it waits to be restored
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert line.endswith("; kept") and sink.spill_path.exists()
    client._tracking_client.store._hard_delete_run(run_id)  # what `mlflow gc` does
    assert main(["recover", str(tmp_path / ".hdet-spill")]) == 2
    out = capsys.readouterr().out
    aside = tmp_path / ".hdet-spill" / ("undeliverable-" + sink.spill_path.name.removeprefix("spill-"))
    assert f"its run {run_id} no longer exists" in out and str(aside) in out, out
    assert not sink.spill_path.exists() and len(aside.read_text().splitlines()) == 1 + 3  # its batches kept
    assert recover(str(tmp_path / ".hdet-spill")) == []  # not tried again


def test_spill_files_are_private_and_recover_shows_no_password(tmp_path, outage, monkeypatch):
    """A spill's header (and a pending folder's) holds the tracking URI, which may carry a password
    (https://user:TOKEN@host): the files were readable by every user (0644), and recover printed the
    URI whole."""
    import stat

    from hdet_track.tracking.mlflow import _PendingChunks

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.umask(umask := os.umask(0o022))
    try:
        uri = "http://alice:S3CRET-TOKEN@127.0.0.1:9"  # nothing listens there: the backend is down
        sink = _spill_while_down(outage, uri, tmp_path / ".hdet-spill", 2)
        pending = _PendingChunks(tmp_path / ".hdet-spill", {"backend": "mlflow", "run_id": "r1", "settings": {}})
    finally:
        os.umask(umask)
    assert stat.S_IMODE(sink.spill_path.stat().st_mode) == 0o600
    assert stat.S_IMODE((pending.folder / "pending.json").stat().st_mode) == 0o600
    assert "S3CRET-TOKEN" in sink.spill_path.read_text()  # what the replay needs stays
    sink.spill.keep_from(1)  # a rewrite keeps it private
    assert stat.S_IMODE(sink.spill_path.stat().st_mode) == 0o600
    pending.remove()
    _orphaned(sink.spill_path, _dead_identity())
    monkeypatch.setitem(base.TRACKERS, "mlflow", "hdet_track.tracking.mlflow:MLflowTracker")  # a real connection
    (line,) = recover(str(tmp_path / ".hdet-spill"))
    assert line.endswith("; kept") and "S3CRET-TOKEN" not in line and "alice:***@127.0.0.1:9" in line, line

"""A W&B run resumed from a checkpoint older than what the store holds (offline: one run directory
per session), written by real jobs in subprocesses and read back."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest

from hdet_track.readers.wandb import WandbReader
from hdet_track.readers.wandb_records import read_wandb_file

# argv: store, checkpoint, phase (first|second), last step, then "kill" (SIGKILL after flush) or "close".
# The first phase checkpoints after step 17; the second loads that checkpoint and redoes 18 onwards.
JOB = """
import os, signal, sys
import torch
from hdet_track import HDETScheduler
from hdet_track.tracking import wandb as tracking_wandb

store, ckpt, phase, stop, end = sys.argv[1:6]
if os.environ.get("OLD_WRITER"):  # the tracker before it skipped what earlier sessions hold
    tracking_wandb._stored_before = lambda run: None
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
unflushed = end == "kill-unflushed"  # no archive chunk before the kill: W&B's rows only
tracker = tracking_wandb.WandbTracker(project="resume", dir=store, mode="offline", **({"chunk_seconds": 3600.0} if unflushed else {}))
sched = HDETScheduler(opt, 0.1, total_steps=40, spread=0.3, sync_every=6, auto_lr=True, seed=3, track=tracker)
parts = {"model": model, "opt": opt, "sched": sched}
if phase == "second":
    for name, state in torch.load(ckpt, weights_only=True).items():
        parts[name].load_state_dict(state)
for k in range(18 if phase == "second" else 1, int(stop) + 1):
    loss = ((model(torch.full((4, 2), k / 40)) - 1) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step(loss * float(os.environ.get("LOSS_SCALE", "1")) if phase == "second" else loss)
    if k in (19, 20, 25):
        sched.log_metrics({"val_loss": k + (0.5 if phase == "second" else 0.0)}, step=k)
    if phase == "first" and k == 17:
        torch.save({name: part.state_dict() for name, part in parts.items()}, ckpt)
if unflushed:  # killed once W&B's file holds the rows through the step before the last (the
    # last step's row waits for the next hand-over), before any archive chunk was written
    import time
    from hdet_track.wandb_file import read_wandb_file
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            rows = read_wandb_file(tracker.run.settings.sync_file).history
            if int(os.environ.get("WAIT_FOR") or int(stop) - 1) in [r.get("hdet/step") for r in rows]:
                break
        except Exception:
            pass
        time.sleep(0.2)
else:
    assert sched.flush() is True
print(os.getpid(), flush=True)
if end.startswith("kill"):
    os.kill(os.getpid(), signal.SIGKILL)
sched.close()
"""


def _job(tmp_path, phase, stop, end, old_writer=False, loss_scale=1.0, wait_for=None):
    """Run one phase; returns its pid. ``loss_scale``: the second phase feeds HDET its loss times
    this, so that its values are told from the first's. ``wait_for``: with ``kill-unflushed``, the
    step whose row W&B's file must hold before the kill (default: the step before ``stop``)."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", LOSS_SCALE=str(loss_scale))
    env["WAIT_FOR"] = str(wait_for or "")
    if old_writer:
        env["OLD_WRITER"] = "1"
    if end == "kill-unflushed":
        env["HDET_POINTS_PER_SECOND"] = "0"  # every step in W&B's rows, not thinned to the point budget
    args = [str(tmp_path / "store"), str(tmp_path / "ckpt.pt"), phase, str(stop), end]
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == (-9 if end.startswith("kill") else 0), proc.stderr[-3000:]
    return int(proc.stdout.split()[0])


def _read(tmp_path):
    reader = WandbReader(tmp_path / "store")
    (summary,) = reader.list_runs()
    return reader, summary.run_id


def _session_dirs(tmp_path):
    dirs = sorted(glob.glob(str(tmp_path / "store" / "wandb" / "*run-*")))
    assert len(dirs) == 2  # one per session, the same run id
    return dirs


@pytest.mark.parametrize("suffixed", [False, True, "online"], ids=["plain", "suffixed", "online-first"])
def test_a_job_resumed_from_an_older_checkpoint_writes_no_step_twice(tmp_path, suffixed):
    """The first session is killed at step 21 (sync 18 and val_loss at 19 and 20 stored), the second
    resumes from step 17 and redoes 18-21: W&B's run files (what `wandb sync` uploads), the event
    archive and the user metrics hold each step once, and the reader says so. ``suffixed``: the
    first session's folder is named as W&B names a second session started within the same second
    (``...-<id>-1``), which the skip used to miss. ``online``: the first session's folder is named
    as an online session's (``run-...``), which sorted after the offline resumed one, so the reader
    took the killed session for the last."""
    _job(tmp_path, "first", 21, "kill")
    (first,) = glob.glob(str(tmp_path / "store" / "wandb" / "offline-run-*"))
    if suffixed == "online":
        os.rename(first, os.path.join(os.path.dirname(first), os.path.basename(first)[len("offline-") :]))
    elif suffixed:
        os.rename(first, first + "-1")
    _job(tmp_path, "second", 40, "close")
    lr, syncs, val, archived, user = Counter(), Counter(), Counter(), Counter(), Counter()
    for directory in _session_dirs(tmp_path):
        history = read_wandb_file(glob.glob(os.path.join(directory, "run-*.wandb"))[0]).history
        lr.update(row["hdet/step"] for row in history if "hdet/replica_00/lr" in row)
        syncs.update(row["hdet/sync/step"] for row in history if "hdet/sync/step" in row)
        val.update(row["hdet/step"] for row in history if "val_loss" in row)
        for chunk in glob.glob(os.path.join(directory, "files", "hdet_events", "steps-*.parquet")):
            table = pq.read_table(chunk)
            archived.update(zip(table.column("step").to_pylist(), table.column("replica").to_pylist()))
        with open(os.path.join(directory, "files", "hdet_events", "user_metrics.jsonl")) as f:
            user.update(line for line in f)
    assert sorted(lr) == list(range(1, 41)) and set(lr.values()) == {1}
    assert {6, 12, 18, 24, 30, 36} <= set(syncs) and set(syncs.values()) == {1}
    assert val == {19: 1, 20: 1, 25: 1}
    assert sorted(archived) == [(s, 0) for s in range(1, 41)] and set(archived.values()) == {1}
    assert len(user) == 3 and set(user.values()) == {1}
    # `wandb sync` puts both sessions' files into the one run: a chunk named as an earlier
    # session's replaced it there (each session numbered its chunks from 1)
    chunks = Counter(
        os.path.relpath(path, os.path.join(directory, "files"))
        for directory in _session_dirs(tmp_path)
        for path in glob.glob(os.path.join(directory, "files", "hdet_events", "**", "*.parquet"), recursive=True)
    )
    assert chunks and set(chunks.values()) == {1}, chunks
    reader, run_id = _read(tmp_path)
    run = reader.read(run_id)
    assert run.status == "FINISHED"
    assert [c.step for c in run.converge] == sorted(syncs)
    assert [c.step for c in run.controller] == sorted(syncs)
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 41))
    steps, values = run.metrics["val_loss"]
    assert steps.tolist() == [19, 20, 25] and values.tolist() == [19.0, 20.0, 25.5]  # 19 and 20: the first's
    overview = reader.read(run_id, max_rows=1)
    assert overview.overview and int(overview.aggregates.rows[overview.aggregates.level == 1000].sum()) == 40


def test_a_store_written_before_the_skip_reads_one_point_per_step(tmp_path):
    """A store whose resumed session wrote steps 13-24 and val_loss again (the tracker before it
    skipped stored steps): the reader keeps one event per sync, one val_loss per step (the later
    session's), counts each row once in the overview, and the second process, killed after its step
    25, is named with its own last step, not the first session's 30."""
    _job(tmp_path, "first", 32, "kill", old_writer=True)
    pid = _job(tmp_path, "second", 25, "kill", old_writer=True)
    reader, run_id = _read(tmp_path)
    deadline = time.monotonic() + 30
    while True:  # W&B's service may write for a moment after the process is gone
        run = reader.read(run_id)
        if run.status != "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [c.step for c in run.converge] == [6, 9, 12, 18, 24, 30]
    assert [c.step for c in run.controller] == [6, 9, 12, 18, 24, 30]
    steps, values = run.metrics["val_loss"]
    assert steps.tolist() == [19, 20, 25] and values.tolist() == pytest.approx([19.5, 20.5, 25.5])
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 31))
    overview = reader.read(run_id, max_rows=1)
    assert int(overview.aggregates.rows[overview.aggregates.level == 1000].sum()) == 30
    assert run.status == "KILLED"
    error = run.tags["hdet.error"]
    assert f"pid {pid} " in error and error.endswith("after its last logged step 25"), error


def test_a_job_resumed_into_the_run_it_was_given_keeps_both_attempts_once(tmp_path):
    """One W&B run given to hdet-track twice (WandbTracker(run=...): Hugging Face's or Lightning's
    run across two train()/fit() calls): the first attempt fails at step 9, the second resumes from
    the checkpoint at step 6 into the same run. Before, the second scheduler's event archive started
    its chunk numbering again and overwrote the first's (steps 1-6 and the syncs at 3 and 6 were
    gone), and steps 7-9 were written to W&B's rows twice (its run file had not been flushed yet)."""
    import io

    import torch
    import wandb

    from hdet_track import HDETScheduler
    from hdet_track.tracking.wandb import WandbTracker, wait_until_written

    run = wandb.init(project="given", dir=str(tmp_path), mode="offline")
    saved = io.BytesIO()
    for attempt in range(2):
        torch.manual_seed(0)
        opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        sched = HDETScheduler(opt, 0.1, total_steps=12, sync_every=3, track=WandbTracker(run=run))
        if attempt:
            saved.seek(0)
            sched.load_state_dict(torch.load(saved, weights_only=True))
        try:
            for k in range(sched.last_epoch + 1, 13):
                opt.step()
                sched.step(1.0 / k)
                if k == 6 and not attempt:
                    torch.save(sched.state_dict(), saved)
                if k == 9 and not attempt:
                    raise RuntimeError("transient")
            sched.close()
        except RuntimeError:
            sched.close("FAILED", "transient")
    run.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "*run-*" / "run-*.wandb"))
    # the user's run, finished by the user: W&B's service writes the file's end after finish() returns
    assert wait_until_written(path, timeout=30.0)
    rows = Counter(r["hdet/step"] for r in read_wandb_file(path).history if "hdet/replica_00/loss" in r)
    assert rows == Counter(range(1, 13))  # each step's row once in what `wandb sync` uploads
    read = WandbReader(str(tmp_path)).read(run.id)
    assert read.steps.step.tolist() == list(range(1, 13))  # the archive: each step once, none lost
    assert [c.step for c in read.converge] == [3, 6, 9, 12]
    assert read.status == "FINISHED" and "hdet.error" not in read.tags  # the first attempt's, moved aside
    assert read.tags["hdet.resumed_after"] == "transient"


def test_a_resumed_run_keeps_the_failed_attempts_error_as_resumed_after(tmp_path):
    """As an MLflow run does (hdet.resumed_after): a W&B run whose first attempt failed and whose
    second, resumed from a checkpoint, finished reads FINISHED with the first attempt's error beside."""
    from hdet_track.tracking.wandb import WandbTracker

    from .attempts import attempt

    saved = {}
    with pytest.raises(RuntimeError, match="boom"):
        attempt(WandbTracker(dir=str(tmp_path)), saved, fail_at=12)
    attempt(WandbTracker(dir=str(tmp_path)), {}, state=saved["state"])
    reader = WandbReader(str(tmp_path))
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.status == "FINISHED" and "hdet.error" not in run.tags
    assert "boom at step 12" in run.tags["hdet.resumed_after"]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))


def test_a_resumed_run_skips_only_its_own_sessions_not_a_run_whose_id_extends_its_own(tmp_path):
    """Run 'trial' fails at step 8 (checkpoint at 5); run 'trial-2', another run in the same
    directory, logs 20 steps; 'trial' is resumed. Its skip must read its own sessions only (the run
    file's exact id), not 'trial-2''s folder, whose steps would have hidden 6-20 of 'trial'."""
    from hdet_track.tracking.wandb import WandbTracker

    from .attempts import attempt

    def tracker(run_id):
        track = WandbTracker(dir=str(tmp_path))
        track.resume(run_id)  # a run of this id (W&B creates it when there is none)
        return track

    saved = {}
    with pytest.raises(RuntimeError):
        attempt(tracker("trial"), saved, fail_at=8, save_at=5)
    attempt(tracker("trial-2"), {})
    attempt(tracker("trial"), {}, state=saved["state"])
    run = WandbReader(str(tmp_path)).read("trial")
    assert run.status == "FINISHED" and run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))
    assert [c.step for c in run.converge] == [5, 10, 15, 20]


def test_steps_only_in_the_killed_sessions_rows_are_read_back_after_a_resume(tmp_path):
    """The first session is killed after step 21 with no archive chunk written (W&B writes its file
    every second, the archive every few seconds), the second resumes from the checkpoint at 17:
    steps 1-17 and the syncs at 6 and 12 were in W&B's rows only, and the reader lost them."""
    _job(tmp_path, "first", 21, "kill-unflushed")
    first = glob.glob(str(tmp_path / "store" / "wandb" / "offline-run-*" / "files" / "hdet_events" / "steps-*"))
    assert first == []  # the gap: nothing archived
    _job(tmp_path, "second", 40, "close")
    (killed, _) = _session_dirs(tmp_path)
    rows = read_wandb_file(glob.glob(os.path.join(killed, "run-*.wandb"))[0]).history
    logged = {r["hdet/step"] for r in rows if "hdet/replica_00/lr" in r}
    synced = sorted({r["hdet/sync/step"] for r in rows if "hdet/sync/step" in r} - set(range(18, 41)))
    assert set(range(1, 18)) <= logged and {6, 12} <= set(synced)  # what only the killed session holds
    reader, run_id = _read(tmp_path)
    run = reader.read(run_id)
    pairs = Counter(zip(run.steps.step.tolist(), run.steps.replica.tolist()))
    assert sorted({s for s, _ in pairs}) == list(range(1, 41)) and set(pairs.values()) == {1}
    assert [c.step for c in run.converge if c.step < 18] == synced  # from the rows
    assert [c.step for c in run.converge if c.step >= 18][:4] == [18, 24, 30, 36]  # the archive's, redone
    assert run.status == "FINISHED" and any("read from W&B's rows" in w for w in run.warnings)
    # and the controller's decisions there (the Controller page said "auto_lr off" for them)
    assert set(synced) <= {d.step for d in run.controller if d.name == "lr"}
    assert all(np.isfinite(d.base_after).all() for d in run.controller)
    again = reader.read(run_id, previous=run)  # a later read does not build on the filled rows
    assert again.steps.step.tolist() == run.steps.step.tolist()
    # an overview (the dashboard's first read of a long run) has the archive's summaries only,
    # which lack these steps: it silently summarised 23 steps of 40; the run is read in full
    ov = reader.read(run_id, max_rows=10)
    assert not ov.overview and ov.steps.step.tolist() == run.steps.step.tolist()
    assert any("read from W&B's rows" in w for w in ov.warnings)


def test_a_killed_attempts_steps_past_the_checkpoint_are_not_read_into_the_resumed_run(tmp_path):
    """The first session is killed after step 31 with no archive chunk, the second resumes from
    the checkpoint at 17 and is closed at 25: the first's rows past 17 are an abandoned attempt, and
    were read as steps 26-31 (and its syncs) of the finished run."""
    _job(tmp_path, "first", 31, "kill-unflushed")
    _job(tmp_path, "second", 25, "close")
    reader, run_id = _read(tmp_path)
    run = reader.read(run_id)
    assert run.status == "FINISHED"
    assert sorted(set(run.steps.step.tolist())) == list(range(1, 26))
    assert max(c.step for c in run.converge) <= 25
    (listed,) = reader.list_runs()  # the run list (the Runs page): step 25's loss, not the attempt's 31
    assert listed.final_loss == pytest.approx(run.final_loss(), rel=1e-9)


def test_a_killed_attempts_rows_between_the_checkpoint_and_the_resumed_sessions_first_row_are_left_out(tmp_path):
    """Both sessions killed before an archive chunk: the second resumed from the checkpoint at 17
    but wrote its first row at 21 (rows the first session holds are not written twice to W&B), so
    its rows said it took over at 21, and the first attempt's abandoned 18-20 (and its sync at 18)
    were read as the run's. The owner file says where a session started."""
    _job(tmp_path, "first", 21, "kill-unflushed")
    _job(tmp_path, "second", 30, "kill-unflushed", loss_scale=1000.0, wait_for=21)  # its rows from 19 on
    reader, run_id = _read(tmp_path)
    run = reader.read(run_id)
    loss = dict(zip(run.steps.step.tolist(), run.steps.loss.tolist()))
    # the first attempt's losses are below 0.01 from step 10 on, the second's (x1000) above 1
    assert set(range(1, 18)) <= set(loss) and max(loss[s] for s in range(10, 18)) < 0.01
    assert {s for s in loss if s >= 18} and all(loss[s] > 1 for s in loss if s >= 18)  # the second's only
    assert all(c.step < 18 or min(c.window_losses) > 1 for c in run.converge)


LIVE_JOB = """
import sys, time, torch
from hdet_track import HDETScheduler
from hdet_track.tracking.wandb import WandbTracker
from hdet_track.wandb_file import read_wandb_file
opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
tracker = WandbTracker(project="live", dir=sys.argv[1], mode="offline", chunk_seconds=3600.0)
sched = HDETScheduler(opt, 0.1, total_steps=40, sync_every=5, track=tracker)
for k in range(1, 21):
    opt.step()
    sched.step(1.0 / k)
    if k == 10:
        assert sched.flush() is True  # the archive holds steps 1-10; 11-15 only W&B's rows
deadline = time.time() + 120
while time.time() < deadline:
    rows = read_wandb_file(tracker.run.settings.sync_file).history
    if 15 in [r.get("hdet/step") for r in rows]:  # (16-20 wait for the sync after 20: a window's rows go together)
        break
    time.sleep(0.2)
print("READY", flush=True)
time.sleep(300)
"""


def test_a_live_runs_rows_ahead_of_its_archive_are_its_next_chunk_not_a_gap(tmp_path):
    """A live run's archive always lags W&B's rows by up to a chunk: every live read warned of a
    killed process, filled the tail from the rows and gave up reading incrementally. Once the
    process is killed, the tail is read from the rows."""
    import signal

    script = tmp_path / "live.py"
    script.write_text(LIVE_JOB)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", HDET_POINTS_PER_SECOND="0")  # every row
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "store")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        reader, run_id = _read(tmp_path)
        live = reader.read(run_id)
        assert live.status == "RUNNING" and not live.filled_from_rows and not live.warnings
        assert sorted(set(live.steps.step.tolist())) == list(range(1, 11))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while True:  # the reader's grace for W&B's service after the process is gone
        killed = reader.read(run_id)
        if killed.status != "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert killed.status == "KILLED" and killed.filled_from_rows
    assert sorted(set(killed.steps.step.tolist())) == list(range(1, 16))


def test_a_job_resumed_from_the_checkpoint_of_a_finished_run_logs_to_a_run_of_its_own(tmp_path):
    """As with MLflow: a job resumed from a checkpoint of a run another attempt finished (a fork, a
    rerun) wrote nothing into it (every step was stored) and ended it FINISHED again. It now logs to
    a new run whose summary names the run and step it forked from."""
    _job(tmp_path, "first", 40, "close")
    _job(tmp_path, "second", 40, "close", loss_scale=2.0)
    reader = WandbReader(tmp_path / "store")
    runs = {summary.run_id: reader.read(summary.run_id) for summary in reader.list_runs()}
    assert len(runs) == 2
    (forked,) = [r for r in runs.values() if r.steps.step.min() > 1]
    (first,) = [r for r in runs.values() if r is not forked]
    assert first.status == forked.status == "FINISHED"
    assert first.replica_series("loss", 0)[0].tolist() == list(range(1, 41))
    # from the checkpoint's window (its losses, steps 13-17, are in the checkpoint), then its own
    assert forked.replica_series("loss", 0)[0].tolist() == list(range(13, 41))
    mine, theirs = forked.replica_series("loss", 0)[1], first.replica_series("loss", 0)[1][12:]
    assert np.array_equal(mine[:5], theirs[:5]) and np.allclose(mine[5:], 2 * theirs[5:])
    (folder,) = glob.glob(str(tmp_path / "store" / "wandb" / f"*run-*-{forked.run_id}"))
    summary = read_wandb_file(glob.glob(os.path.join(folder, "run-*.wandb"))[0]).summary
    assert summary["hdet/forked_from"] == first.run_id and summary["hdet/forked_at_step"] == 17
    # and the reader names it in the run's tags, as MLflow's does
    assert forked.tags["hdet.forked_from"] == first.run_id and forked.tags["hdet.forked_at_step"] == "17"
    assert "hdet.forked_from" not in first.tags

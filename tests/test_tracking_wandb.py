"""Tracking into a real W&B offline run, read back from its .wandb file."""

from __future__ import annotations

import glob
import os
import shutil
import time
import warnings

import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from hdet_track import HDETScheduler
from hdet_track.readers.wandb_records import WandbFormatError, iter_payloads, read_wandb_file


def read_finished(path, timeout=0.0):
    """The run file, read once: a run hdet-track finishes is whole on disk when ``close()`` returns
    (WandbTracker waits for W&B's service to write its end). ``timeout``: wait up to that long for
    the exit record, for a run someone else finishes (wandb flushes it after ``finish()``)."""
    deadline = time.monotonic() + timeout
    while True:
        contents = read_wandb_file(path)
        if contents.exit_code is not None or timeout <= 0:
            return contents
        assert time.monotonic() < deadline, f"W&B wrote no exit record to {path} within {timeout} s"
        time.sleep(0.2)


def run_dir(root):
    dirs = sorted(glob.glob(os.path.join(root, "wandb", "offline-run-*")))
    assert len(dirs) == 1
    return dirs[0]


def test_offline_run_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_PROJECT", "hdet-tests")
    monkeypatch.setenv("HDET_TRACKER", "wandb")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = HDETScheduler(
            opt,
            0.1,
            total_steps=30,
            spread=0.2,
            sync_every=10,
            auto_lr=True,
            controller="paper",
            auto_lr_warmup=10,
            explore={"weight_decay": 0.5},
            track=True,
            compare_group="ab",
        )
    seen = {}
    for k in range(1, 31):
        opt.step()
        seen[k] = (opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"])
        sched.step(1.0 / k)
        if k == 15:  # mid-window: logged before the window's own points reach W&B
            sched.log_metrics({"val_loss": 0.5})
    sched.close()
    root = os.environ["WANDB_DIR"]
    directory = run_dir(root)
    contents = read_finished(glob.glob(os.path.join(directory, "run-*.wandb"))[0])
    assert contents.run_id == sched.run_ids["wandb"]
    assert contents.project == "hdet-tests" and contents.group == "ab"  # compare group = run group
    assert contents.exit_code == 0 and contents.summary["hdet/status"] == "FINISHED"
    assert contents.config["spread"] == "0.2" and contents.config["explore.weight_decay.spread"] == "0.5"
    assert contents.summary["hdet.schedule"] == "hdet"
    # Every row carries its own step, so points keep their steps whatever order they arrive in.
    rows = {row["hdet/step"]: row for row in contents.history if "hdet/replica_00/lr" in row}
    assert sorted(rows) == list(range(1, 31))  # none dropped, none piled onto another step
    for k, (lr, wd) in seen.items():
        assert rows[k]["hdet/replica_00/lr"] == pytest.approx(lr, rel=1e-12)
        assert rows[k]["hdet/replica_00/weight_decay"] == pytest.approx(wd, rel=1e-12)
        assert rows[k]["hdet/replica_00/loss"] == pytest.approx(1.0 / k)
    assert [row["hdet/step"] for row in contents.history if "val_loss" in row] == [15]
    assert contents.step_metrics["val_loss"] == "hdet/step"
    # Sync and controller series sit on the sync axis.
    assert contents.step_metrics["hdet/sync/*"] == "hdet/sync/step"
    assert contents.step_metrics["hdet/controller/*"] == "hdet/sync/step"
    assert contents.step_metrics["hdet/replica_*"] == "hdet/step"
    sync = {row["hdet/sync/step"]: row for row in contents.history if "hdet/sync/step" in row}
    assert sorted(sync) == [10, 20, 30]
    assert sync[20]["hdet/controller/weight_decay/base"] > 0
    # The full-resolution event archive is among the run's files.
    steps = sorted(glob.glob(os.path.join(directory, "files", "hdet_events", "steps-*.parquet")))
    assert [r["step"] for r in pq.read_table(steps).to_pylist()] == list(range(1, 31))


def test_failed_run_exit_code_and_status(tmp_path):
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError):
        with HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track="wandb") as sched:
            for _ in range(7):
                opt.step()
                sched.step(1.0)
            raise RuntimeError("exploded")
    contents = read_finished(glob.glob(os.path.join(run_dir(os.environ["WANDB_DIR"]), "run-*.wandb"))[0])
    assert contents.exit_code == 1 and contents.summary["hdet/status"] == "FAILED"
    assert "exploded" in contents.summary["hdet/error"]


def ten_step_job() -> None:
    """A 10-step job tracked to W&B, closed."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track="wandb")
    for _ in range(10):
        opt.step()
        sched.step(1.0)
    sched.close()


def tiny_finished_run() -> str:
    """The run file of a 10-step job tracked to W&B offline, once ``close()`` returned."""
    ten_step_job()
    return glob.glob(os.path.join(run_dir(os.environ["WANDB_DIR"]), "run-*.wandb"))[0]


def test_settings_wandb_would_refuse_fail_when_the_tracker_is_built_and_a_long_group_is_kept(tmp_path, monkeypatch):
    """A mode typo or a group that is not a str used to fail ``wandb.init`` in the writer (no run,
    everything in the spill); a compare group longer than W&B's 64-character tags did too, through
    the ``hdet.compare_group=...`` tag. Now the first fail at the call and the long group is kept
    (as the run's group and in its summary; only the tag is left out)."""
    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker

    for kw, match in [
        ({"mode": "offlne"}, r"mode in \('online', 'offline', .*\) or None .* but got 'offlne'"),
        ({"group": 5}, "group to be a non-empty str or None, but got 5"),
        ({"chunk_seconds": -1}, r"chunk_seconds in \[0.0, inf\), but got -1"),
    ]:
        with pytest.raises(ValueError, match=match):
            WandbTracker(dir=tmp_path, **kw)
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(ValueError, match="WANDB_MODE in .* or unset, but got 'ofline'"):
        WandbTracker(dir=tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    group = "resnet50-imagenet-lr-sweep-2024-06-01-hdet-vs-1cycle"  # 52 characters
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    tracker = WandbTracker(project="long", dir=tmp_path / "store")
    with HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=tracker, compare_group=group) as sched:
        for k in range(1, 11):
            opt.step()
            sched.step(1.0 / k)
    (summary,) = WandbReader(tmp_path / "store").list_runs(compare_group=group)
    run = WandbReader(tmp_path / "store").read(summary.run_id)
    assert run.status == "FINISHED" and run.compare_group == group
    assert [c.step for c in run.converge] == [5, 10] and run.replica_series("loss", 0)[0].tolist() == list(range(1, 11))
    assert not list((tmp_path / "store" / "wandb" / ".hdet-spill").glob("*.jsonl"))  # nothing left undelivered


def test_record_parser_rejects_other_files_and_stops_at_truncation(tmp_path):
    with pytest.raises(WandbFormatError):
        list(iter_payloads(b"PAR1 not a wandb file"))
    path = tiny_finished_run()
    assert read_finished(path).exit_code == 0  # close() waited for wandb's service to write the whole file
    data = open(path, "rb").read()
    full = list(iter_payloads(data))
    cut = list(iter_payloads(data[: len(data) - 50]))  # a file still being written
    assert 0 < len(cut) < len(full) and cut == full[: len(cut)]


def test_a_damaged_record_header_costs_the_rest_of_its_block_not_the_rest_of_the_file(tmp_path, monkeypatch):
    """A bit flip in a record's length (LevelDB's format, as W&B writes it): the scan went on by the
    damaged length into misaligned bytes, took a garbage length past the end for a file still being
    written and stopped there: no history after it, no exit record, a finished run read RUNNING.
    A record never crosses a 32 KiB block, so a header that says it does is skipped with its block."""
    import struct

    from hdet_track.readers.wandb_records import read_wandb_file

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=200, sync_every=5, track="wandb")
    for k in range(1, 201):
        opt.step()
        sched.step(1.0 / k)
    sched.close()
    (path,) = glob.glob(os.path.join(run_dir(str(tmp_path)), "run-*.wandb"))
    data = open(path, "rb").read()
    assert len(data) > 3 * 32768, len(data)
    full = list(iter_payloads(data))
    pos, heads = 7, []
    while len(heads) < 12:  # the first records' headers (7 bytes: crc, length, type), all in block 0
        heads.append(pos)
        pos += 7 + struct.unpack_from("<H", data, pos + 4)[0]
    length = struct.unpack_from("<H", data, heads[10] + 4)[0]
    for damaged in (length + 1, length ^ 0x0100, 0xFFFF):
        bad = bytearray(data)
        struct.pack_into("<H", bad, heads[10] + 4, damaged)
        got = list(iter_payloads(bytes(bad)))
        assert got[:10] == full[:10], damaged  # what came before it
        later = [p for p in full if p in got[10:]]
        assert later == got[10:] and len(got) > len(full) / 2, (damaged, len(got), len(full))  # the next blocks'
        (tmp_path / "bad.wandb").write_bytes(bytes(bad))
        assert read_wandb_file(tmp_path / "bad.wandb").exit_code == 0, damaged  # the run's end is read


def test_a_run_file_read_again_as_it_grows_is_parsed_once_and_reads_as_parsed_whole(tmp_path):
    """The readers' cache of W&B run files (the dashboard reads every run at each refresh): a file
    that W&B appends to, read after every chunk (cut anywhere: inside a record, a record's header,
    a block's padding, records split over blocks), reads at the end exactly as one parse of the
    whole file, and the reads together parse its bytes about once; a file replaced by another
    (another inode) or cut shorter is parsed again from its start."""
    import random
    import shutil

    import wandb

    from hdet_track.wandb_file import RunFileProgress, WandbFileCache

    def write(name, rows):
        run = wandb.init(project="grow", dir=tmp_path / name, mode="offline")
        for k in range(1, rows + 1):
            run.log(
                {"hdet/step": k, "loss": 1.0 / k, "note": "x" * (k % 97)}
                | {f"hdet/replica_{r:02d}/lr": 0.1 * r for r in range(6)}
            )
        run.finish()
        (path,) = glob.glob(str(tmp_path / name / "wandb" / "offline-run-*" / "run-*.wandb"))
        return path

    source, other = write("a", 1500), write("b", 900)
    whole = read_finished(source, timeout=60)
    read_finished(other, timeout=60)  # whole on disk before it is copied below
    assert whole.exit_code == 0 and len(whole.history) == 1500
    data = open(source, "rb").read()
    assert len(data) > 4 * 32 * 1024  # several blocks, so records are split over blocks
    cache, live, rnd, cut = WandbFileCache(), tmp_path / "live.wandb", random.Random(1), 0
    progress = RunFileProgress(live)  # what a tracker's flush() and finish() read: the last step, the exit

    def last_step(contents):
        return max((row["_step"] for row in contents.history), default=None)

    seen = []
    while cut < len(data):
        cut = min(len(data), cut + rnd.choice([1, 7, 100, 4096, 40_000]))
        with open(live, "ab") as f:
            f.write(data[f.tell() : cut])
        got = cache.read(live)
        assert got.history == whole.history[: len(got.history)]  # a prefix, never a wrong row
        seen.append(len(got.history))
        assert (progress.update().last_step, progress.exit_code) == (last_step(got), got.exit_code)
    assert seen == sorted(seen) and got.history == whole.history
    assert (got.summary, got.config, got.exit_code, got.run_id) == (whole.summary, whole.config, 0, whole.run_id)
    assert cache.bytes_parsed < 1.2 * len(data), (cache.bytes_parsed, len(data))
    assert progress.bytes_parsed < 1.2 * len(data), (progress.bytes_parsed, len(data))
    assert (progress.last_step, progress.exit_code) == (1499, 0)
    got.history.clear()
    assert len(cache.read(live).history) == 1500  # a snapshot: the caller's lists are its own
    live.write_bytes(data[: len(data) // 3])  # cut shorter: parsed again from the start
    assert cache.read(live).history == whole.history[: len(cache.read(live).history)]
    assert len(cache.read(live).history) < 1500
    assert (progress.update().last_step, progress.exit_code) == (last_step(cache.read(live)), None)
    shutil.copy(source, tmp_path / "copy.wandb")
    os.replace(tmp_path / "copy.wandb", live)  # another file under the same name, as long as the first
    assert cache.read(live).history == whole.history
    live.write_bytes(data[: len(data) // 3])
    cache.read(live)
    shutil.copyfile(other, live)  # another run's file written over this one in place (same inode), longer
    assert cache.read(live).history == read_finished(other, timeout=60).history
    assert (progress.update().last_step, progress.exit_code) == (899, 0)
    small = WandbFileCache(max_cells=12_000)  # holds one parse at a time: a second file evicts the first
    small.read(source)
    small.read(live)
    before = small.bytes_parsed
    small.read(source)
    again = small.bytes_parsed - before
    assert len(data) - 8 <= again <= len(data)  # parsed again (all but its 7-byte header), as it had been dropped
    small.read(source)
    assert small.bytes_parsed == before + again  # unchanged since: nothing parsed


def test_finish_waits_until_wandb_has_written_the_run_file(tmp_path):
    """W&B's service writes the run file in 32 KiB blocks and closes it after ``finish()`` returns:
    ``wait_until_written`` holds the tracker's finish until the exit record is on disk."""
    import threading

    from hdet_track.tracking.wandb import wait_until_written

    finished = tiny_finished_run()
    assert read_wandb_file(finished).exit_code == 0
    whole = open(finished, "rb").read()
    path = tmp_path / "run-x.wandb"
    path.write_bytes(whole[:7])  # the header only: what a reader may find right after finish()
    writer = threading.Timer(0.4, path.write_bytes, args=(whole,))
    started = time.monotonic()
    writer.start()
    assert wait_until_written(path, timeout=20.0) and time.monotonic() - started >= 0.4
    writer.join()
    path.write_bytes(whole[: len(whole) // 2])  # never completed: give up at the timeout
    started = time.monotonic()
    assert not wait_until_written(path, timeout=0.5) and time.monotonic() - started >= 0.5
    assert not wait_until_written(tmp_path / "missing.wandb", timeout=0.1)


def test_an_uncaught_error_prints_one_traceback_and_fails_the_run(tmp_path):
    """wandb.init wraps the excepthook hdet-track installed, prints the traceback and calls ours:
    ours records the failure (the run ends FAILED) without printing the traceback a second time."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "crash.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from hdet_track import HDETScheduler
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track="wandb")
            for k in range(1, 21):
                opt.step()
                sched.step(1.0)
                if k == 7:
                    sched.flush()
                    raise RuntimeError("exploded at step 7")
            """
        )
    )
    env = dict(os.environ, WANDB_DIR=str(tmp_path), WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    output = proc.stdout + proc.stderr
    assert output.count("Traceback (most recent call last)") == 1, output
    assert output.count("RuntimeError: exploded at step 7") == 1, output
    contents = read_finished(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))[0], timeout=60.0)
    assert contents.exit_code == 1 and contents.summary["hdet/status"] == "FAILED"
    assert "exploded at step 7" in contents.summary["hdet/error"]


def test_offline_by_default_without_wandb_mode(monkeypatch):
    """The embedded W&B default is offline mode: with WANDB_MODE unset (and no login) a run is written
    to an offline run directory at once and reads back, instead of waiting for a server."""
    from hdet_track.readers.wandb import WandbReader

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    started = time.monotonic()
    path = tiny_finished_run()  # asserts exactly one wandb/offline-run-* directory
    assert time.monotonic() - started < 25  # no ~30 s wait for a W&B server that is not there
    contents = read_finished(path)
    assert contents.exit_code == 0 and contents.summary["hdet/status"] == "FINISHED"
    reader = WandbReader(os.environ["WANDB_DIR"])
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.status == "FINISHED" and run.steps.step.tolist() == list(range(1, 11))


def test_a_chosen_mode_wins_over_the_offline_default(monkeypatch):
    """WANDB_MODE (here ``disabled``) is the user's choice: nothing is written, not an offline run."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    ten_step_job()
    assert glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", "*run-*")) == []


def test_one_tracker_object_for_two_schedulers_in_turn_makes_two_runs(tmp_path):
    """Each scheduler is one run, also when the same WandbTracker object is passed to both (the
    second used to log into the first, finished run)."""
    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker

    tracker = WandbTracker(project="reuse", dir=tmp_path, mode="offline")
    ids = {}
    for name, val in [("first", 0.5), ("second", 0.25)]:
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=tracker, run_name=name)
        for _ in range(10):
            opt.step()
            sched.step(1.0)
        sched.log_metrics({"val_loss": val})
        sched.close()
        ids[name] = sched.run_ids["wandb"]
        if name == "first":
            first_file = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*", "run-*.wandb"))
            assert len(first_file) == 1
            first_bytes = open(first_file[0], "rb").read()
    assert ids["first"] and ids["second"] and ids["first"] != ids["second"]
    assert open(first_file[0], "rb").read() == first_bytes  # the first run is untouched by the second
    reader = WandbReader(str(tmp_path))
    summaries = {s.run_id: s for s in reader.list_runs()}
    assert sorted(summaries) == sorted(ids.values())
    for name, val in [("first", 0.5), ("second", 0.25)]:
        run = reader.read(ids[name])
        assert (run.status, run.name) == ("FINISHED", name)
        assert [c.step for c in run.converge] == [5, 10]
        assert list(run.replica_series("loss", 0)[0]) == list(range(1, 11))
        assert list(run.metrics["val_loss"][1]) == [val]
    assert not list(tracker.spill_dir().glob("spill-*"))  # nothing was left undelivered


KILL_JOB = """
import sys, time
import torch
from hdet_track import HDETScheduler
from hdet_track.tracking.wandb import WandbTracker

torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
tracker = WandbTracker(project="kill", dir=sys.argv[1], mode="offline", run_name="job")
sched = HDETScheduler(opt, 0.1, total_steps=30, spread=0.0, sync_every=10, track=tracker)
for k in range(1, 31):
    opt.step()
    sched.step(1.0 / k)
sched.log_metrics({"val_loss": 0.5})  # after the last step: the run stays open for it
assert sched.flush() is True
if sys.argv[2] == "close":
    sched.close()
    sys.exit(0)
print("READY", flush=True)
time.sleep(300)  # evaluating, when the OOM killer strikes
"""


def _start_job(tmp_path, mode):
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(KILL_JOB)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    for name in ("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL"):
        env.pop(name, None)  # W&B's default (15 s) unless hdet-track shortens it
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "store"), mode], env=env, stdout=subprocess.PIPE, text=True
    )


def _read_single(root):
    from hdet_track.readers.wandb import WandbReader

    reader = WandbReader(root)
    (summary,) = reader.list_runs()
    return summary, reader.read(summary.run_id)


def test_a_run_killed_after_flush_reads_killed_with_everything_flushed(tmp_path):
    """SIGKILL (the OOM killer during evaluation) after the last step, ``val_loss`` and ``flush()``:
    what was flushed is on disk (W&B buffers its run file for 15 s by default), and the run, whose
    process is gone without ending it, reads KILLED, not RUNNING and live for ever. While the
    process lives, the same run reads RUNNING and live."""
    import signal

    proc = _start_job(tmp_path, "hang")
    try:
        assert proc.stdout.readline().strip() == "READY"
        summary, run = _read_single(tmp_path / "store")
        assert run.status == "RUNNING" and run.live and summary.live  # the owner is alive
        assert not any("no event archive" in w for w in run.warnings)
        # a live run read before its first event-archive chunk: "not yet", not "none"
        (events,) = glob.glob(str(tmp_path / "store" / "wandb" / "offline-run-*" / "files" / "hdet_events"))
        os.rename(events, events + ".aside")
        try:
            _, early = _read_single(tmp_path / "store")
        finally:
            os.rename(events + ".aside", events)
        assert early.live and any(w.startswith("no event archive yet") for w in early.warnings), early.warnings
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # W&B's own run file holds everything logged before flush() returned
    contents = read_wandb_file(glob.glob(str(tmp_path / "store" / "wandb" / "offline-run-*" / "run-*.wandb"))[0])
    assert contents.exit_code is None
    assert sorted(row["hdet/step"] for row in contents.history if "hdet/replica_00/loss" in row) == list(range(1, 31))
    assert [row["val_loss"] for row in contents.history if "val_loss" in row] == [0.5]
    deadline = time.monotonic() + 30
    while True:  # W&B's service may write for a moment after the process is gone
        summary, run = _read_single(tmp_path / "store")
        if run.status != "RUNNING" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert run.status == "KILLED" and not run.live and not summary.live and summary.status == "KILLED"
    error = run.tags["hdet.error"]
    assert f"pid {proc.pid}" in error and "ended without ending the run" in error, error
    assert error.endswith("after its last logged step 30"), error
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 31))
    assert run.replica_series("loss", 0)[1].tolist() == pytest.approx([1.0 / k for k in range(1, 31)])
    assert [c.step for c in run.converge] == [10, 20, 30]
    assert run.metrics["val_loss"][0].tolist() == [30] and run.metrics["val_loss"][1].tolist() == [0.5]


def _closed_jobs_run_file_copy(tmp_path):
    """A job that closed its run, its run directory copied to ``copy/``: (the copy's run file, its bytes)."""
    import shutil

    proc = _start_job(tmp_path, "close")
    assert proc.wait(timeout=300) == 0
    directory = glob.glob(str(tmp_path / "store" / "wandb" / "offline-run-*"))[0]
    copy = tmp_path / "copy" / os.path.basename(directory)
    shutil.copytree(directory, copy)
    wandb_file = glob.glob(str(copy / "run-*.wandb"))[0]
    return wandb_file, open(wandb_file, "rb").read()


def test_a_run_killed_is_read_from_the_archive_when_wandb_lost_its_file(tmp_path):
    """hdet-track's readers do not depend on W&B's write timing: with W&B's history cut to before
    the last steps (what a SIGKILL within W&B's flush interval leaves), every step's loss and the
    val_loss come from hdet-track's own files, written by flush()."""
    from hdet_track.readers.wandb import WandbReader

    wandb_file, data = _closed_jobs_run_file_copy(tmp_path)
    cut = len(data)
    while cut > 0:  # the file as W&B had written it before step 20's row
        contents = read_wandb_file_bytes(data[:cut], tmp_path)
        if not any(row.get("hdet/step", 0) >= 20 for row in contents.history):
            break
        cut -= 512
    open(wandb_file, "wb").write(data[:cut])
    reader = WandbReader(tmp_path / "copy")
    run = reader.read(os.path.basename(wandb_file)[len("run-") : -len(".wandb")])
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 31))
    assert run.metrics["val_loss"][1].tolist() == [0.5]
    # the run list (the dashboard's Runs page) says the same final loss, not W&B's last row's
    (summary,) = reader.list_runs()
    assert summary.final_loss == pytest.approx(run.final_loss()) == pytest.approx(1 / 30)


def read_wandb_file_bytes(data, tmp_path):
    path = tmp_path / "probe.wandb"
    path.write_bytes(data)
    try:
        return read_wandb_file(path)
    except WandbFormatError:
        from hdet_track.wandb_file import WandbFileContents

        return WandbFileContents()


def test_a_run_whose_process_ended_it_reads_finished(tmp_path):
    """A process that closed its run and exited: FINISHED (its owner is gone, but the run ended)."""
    proc = _start_job(tmp_path, "close")
    assert proc.wait(timeout=300) == 0
    (path,) = glob.glob(str(tmp_path / "store" / "wandb" / "offline-run-*" / "run-*.wandb"))
    read_finished(path, timeout=60)  # W&B's service may outlive the job on a loaded machine
    time.sleep(2.5)  # past the reader's grace for W&B's service
    summary, run = _read_single(tmp_path / "store")
    assert run.status == "FINISHED" and not run.live and "hdet.error" not in run.tags
    assert run.metrics["val_loss"][1].tolist() == [0.5]
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 31))


INTERVAL_JOB = """
import sys, torch, wandb
from hdet_track import HDETScheduler
from hdet_track.tracking.wandb import WandbTracker
if sys.argv[2] != "none":
    wandb.setup(settings=wandb.Settings(x_transaction_log_flush_interval=float(sys.argv[2])))
opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
tracker = WandbTracker(project="interval", dir=sys.argv[1], mode="offline")
sched = HDETScheduler(opt, 0.1, total_steps=2, spread=0.0, sync_every=1, track=tracker)
for _ in range(2):
    opt.step()
    sched.step(1.0)
assert sched.flush() is True
print("INTERVAL", tracker.run.settings.x_transaction_log_flush_interval)
sched.close()
"""


@pytest.mark.parametrize("chosen", ["none", "7"])
def test_run_file_interval_is_one_second_unless_the_user_chose_one(tmp_path, chosen):
    """hdet-track's runs write W&B's run file every second (W&B's default, 15 s, loses that much to
    a SIGKILL), but an interval the user set through ``wandb.setup(settings=...)`` is kept."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(INTERVAL_JOB)
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    for name in ("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path), chosen], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("INTERVAL")]
    assert float(line.split()[1]) == (1.0 if chosen == "none" else 7.0)


def test_a_torn_steps_chunk_falls_back_to_the_run_files_rows(tmp_path):
    """The archive's steps chunk is unreadable (torn): every replica's steps still come from W&B's
    own rows, with warnings, instead of reading as missing (before: only the mean loss and LR)."""
    from hdet_track.readers.wandb import WandbReader

    proc = _start_job(tmp_path, "close")
    assert proc.wait(timeout=300) == 0
    (chunk,) = (tmp_path / "store").rglob("hdet_events/steps-*.parquet")
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    reader = WandbReader(tmp_path / "store")
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert any("steps-" in w for w in run.warnings) and any("read from W&B's rows" in w for w in run.warnings)
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 31))
    assert run.final_loss() == pytest.approx(1 / 30) == pytest.approx(summary.final_loss)
    assert run.mean_series("lr")[0].tolist()[-1] == 30


def test_a_metric_name_w_and_b_reads_as_a_pattern_fails_at_the_call(tmp_path):
    """'loss*scale' used to fail W&B's define_metric in the writer: the tracker was taken for down,
    every later batch (HDET's own series too) waited in the spill, and the run read FINISHED with
    nothing in it. Now it raises at the call; the names W&B takes (which MLflow may not) still go."""
    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker

    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    tracker = WandbTracker(dir=str(tmp_path))
    with HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=tracker) as sched:
        for k in range(1, 11):
            opt.step()
            sched.step(1.0 / k)
            if k == 2:
                with pytest.raises(ValueError, match=r"a metric name W&B takes, but got 'loss\*scale'"):
                    sched.log_metrics({"loss*scale": 3.0})
                sched.log_metrics({"acc@1": 0.5})
    run = WandbReader(str(tmp_path)).read(tracker.run_id)
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [5, 10]
    assert run.metrics["acc@1"][1].tolist() == [0.5]


def test_a_given_run_keeps_its_owners_config(tmp_path):
    """WandbTracker(run=...) used to overwrite the owner's config keys that HDET also logs (seed,
    optimizer, max_lr...: a Hugging Face run's seed=42 became HDET's seed). HDET's value of such a
    key now goes under hdet/<key>; its other settings as they are."""
    import wandb

    from hdet_track.tracking.wandb import WandbTracker

    run = wandb.init(project="cfg", dir=str(tmp_path), mode="offline", config={"seed": 42, "optimizer": "AdamW"})
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with HDETScheduler(opt, 0.1, total_steps=4, sync_every=2, seed=3, track=WandbTracker(run=run)) as sched:
        for k in range(1, 5):
            opt.step()
            sched.step(1.0 / k)
    run.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "*run-*" / "run-*.wandb"))
    config = read_finished(path, timeout=60).config
    assert config["seed"] == 42 and config["optimizer"] == "AdamW"  # the owner's
    assert str(config["hdet/seed"]) == "3" and str(config["hdet/optimizer"]) == "SGD"  # HDET's, beside them
    assert str(config["sync_every"]) == "2"  # a key the owner does not have: as in a run of HDET's own


GIVEN_WITH = """
import sys, time, torch, wandb
from hdet_track import HDETScheduler
from hdet_track.tracking.wandb import WandbTracker
with wandb.init(project="given", dir=sys.argv[1], mode="offline") as run:
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=WandbTracker(run=run))
    for k in range(1, 21):
        opt.step()
        sched.step(1.0 / k)
    sched.log_metrics({"val_loss": 0.5}, step=20)
print("left", flush=True)
"""


def test_a_given_run_its_owner_finished_first_keeps_hdets_data_and_the_job_exits_at_once(tmp_path):
    """``with wandb.init() as run:`` around training, no ``sched.close()`` (the run ends at exit):
    W&B refused HDET's last writes to the finished run, which hdet-track took for an outage: the
    exit waited out the shutdown timeout, warned "unavailable", and left a spill that `recover`
    delivered into a new session in the default project."""
    import subprocess
    import sys

    from hdet_track.readers.wandb import WandbReader

    script = tmp_path / "job.py"
    script.write_text(GIVEN_WITH)
    env = dict(os.environ, HDET_TRACK_SHUTDOWN_TIMEOUT="60")  # the old exit waited this long
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "left" in proc.stdout, proc.stderr[-3000:]
    assert "unavailable" not in proc.stderr and "finished by its owner" in proc.stderr, proc.stderr[-3000:]
    assert not list((tmp_path / "wandb").glob(".hdet-spill/spill-*"))  # nothing left to recover
    reader = WandbReader(str(tmp_path))
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.tags["project"] == "given" and run.status == "FINISHED"
    assert sorted(set(run.steps.step.tolist())) == list(range(1, 21))
    assert run.metrics["val_loss"][1].tolist() == [0.5]


def test_a_spill_reaches_the_project_mode_and_directory_this_process_resolved(tmp_path, monkeypatch):
    """Settings from the environment were left out of a spill's header: `recover` from a shell
    without WANDB_PROJECT delivered the run into the default project. A given run's spill went to
    ./wandb of the working directory, not beside the run."""
    import wandb

    from hdet_track.tracking.wandb import WandbTracker

    monkeypatch.setenv("WANDB_PROJECT", "myproj")
    monkeypatch.setenv("WANDB_RUN_GROUP", "grp")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "env-dir"))
    settings = WandbTracker().spill_settings()
    assert settings["project"] == "myproj" and settings["group"] == "grp" and settings["mode"] is None
    assert settings["dir"] == str(tmp_path / "env-dir")
    assert WandbTracker(project="mine", dir=str(tmp_path / "d")).spill_settings()["project"] == "mine"
    run = wandb.init(project="owned", dir=str(tmp_path / "owner"), mode="offline")
    try:
        given = WandbTracker(run=run)
        assert given.spill_settings()["project"] == "owned" and given.spill_settings()["group"] == "grp"
        assert given.spill_dir() == tmp_path / "owner" / "wandb" / ".hdet-spill"
    finally:
        run.finish()


def test_mode_disabled_closes_without_waiting_for_a_run_file(tmp_path, monkeypatch, caplog):
    """WANDB_MODE=disabled writes no run file: close() waited 15 s for one and warned."""
    import logging

    from hdet_track.tracking.wandb import WandbTracker

    monkeypatch.setenv("WANDB_MODE", "disabled")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING):
        with HDETScheduler(opt, 0.1, total_steps=4, sync_every=2, track=WandbTracker(dir=str(tmp_path))) as sched:
            for k in range(1, 5):
                opt.step()
                sched.step(1.0 / k)
    assert "had not written" not in caplog.text


def test_flushes_through_a_run_read_its_file_about_once(tmp_path):
    """flush() waits until W&B's file holds the last row, and the end of a run until it holds the
    exit record: each check parsed the whole file again (1.7 s for a 12 MB file, at every flush of a
    long run). Together they now read each byte about once, and still wait for the rows."""
    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker, _run_file

    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = WandbTracker(dir=tmp_path, mode="offline", chunk_seconds=0)
    sched = HDETScheduler(opt, 0.1, total_steps=600, sync_every=10, track=tracker)
    flushes = 6
    for k in range(1, 601):
        opt.step()
        sched.step(1.0 / k)
        if k % (600 // flushes) == 0:
            assert sched.flush() is True
            assert tracker._progress.last_step >= k - 1  # W&B's rows are on disk up to here
    path = _run_file(tracker.run)
    sched.close()
    size = os.path.getsize(path)
    assert tracker._progress.exit_code == 0
    assert size > 100_000 and tracker._progress.bytes_parsed < 1.3 * size, (tracker._progress.bytes_parsed, size)
    assert WandbReader(str(tmp_path)).read(tracker.run_id).steps.step.max() == 600


def test_flush_on_a_given_run_writes_the_archive_without_waiting_for_the_owners_interval(tmp_path, monkeypatch):
    """A given run's file is written at its owner's interval (15 s by default): flush() stalled the
    training loop about 15 s at every call, polling W&B's file. The archive, which the readers read,
    is written at once, and W&B's file is not polled."""
    import wandb

    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking import wandb as tracking_wandb
    from hdet_track.tracking.wandb import WandbTracker

    polled = []
    update = tracking_wandb.RunFileProgress.update
    monkeypatch.setattr(tracking_wandb.RunFileProgress, "update", lambda self: polled.append(self.path) or update(self))

    run = wandb.init(project="given", dir=str(tmp_path), mode="offline")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=WandbTracker(run=run))
    for k in range(1, 11):
        opt.step()
        sched.step(1.0 / k)
    assert sched.flush() is True
    assert polled == []  # it polled W&B's file until the owner's interval wrote it, 13-15 s
    archived = WandbReader(str(tmp_path)).read(run.id)
    assert sorted(set(archived.steps.step.tolist())) == list(range(1, 11))
    sched.close()
    run.finish()


def test_metrics_the_owner_logs_in_a_given_run_are_read_at_the_trainers_step(tmp_path):
    """A given run's owner logs its own rows (Hugging Face's train/global_step, Lightning's
    trainer/global_step): they were read at W&B's row counter, steps 12, 25, 38, 51 for a metric
    logged at 10, 20, 30, 40 (51 beyond the run's 40 steps). A row with no step of its own is left
    out; the user's metrics through HDET keep their steps."""
    import wandb

    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker

    run = wandb.init(project="given", dir=str(tmp_path), mode="offline")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=40, sync_every=5, track=WandbTracker(run=run))
    for k in range(1, 41):
        opt.step()
        sched.step(1.0 / k)
        if k % 10 == 0:
            run.log({"train/acc": k / 100, "train/global_step": k})
            run.log({"trainer/val_f1": k / 50, "trainer/global_step": k})
            run.log({"no_step": 1.0})
            sched.log_metrics({"val_loss": 1.0 / k}, step=k)
    sched.close()
    run.finish()
    read_finished(glob.glob(str(tmp_path / "wandb" / "*run-*" / "run-*.wandb"))[0], timeout=60)
    got = WandbReader(str(tmp_path)).read(run.id)
    assert got.metrics["train/acc"][0].tolist() == [10, 20, 30, 40]
    assert got.metrics["trainer/val_f1"][0].tolist() == [10, 20, 30, 40]
    assert got.metrics["val_loss"][0].tolist() == [10, 20, 30, 40]
    assert "no_step" not in got.metrics and "train/global_step" not in got.metrics


def test_hdets_means_in_a_given_run_go_beside_its_owners_loss(tmp_path):
    """A given run's owner logs its own ``loss`` (Lightning's ``self.log("loss")`` at
    trainer/global_step): HDET logged its mean under the same name and re-defined it on hdet/step,
    so W&B's chart of the owner's loss held two series, and the run list read the owner's loss as
    HDET's final loss. HDET's means are now hdet/loss and hdet/lr there, as in MLflow."""
    import wandb

    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker

    run = wandb.init(project="given", dir=str(tmp_path), mode="offline")
    run.define_metric("trainer/global_step")
    run.define_metric("*", step_metric="trainer/global_step", step_sync=True)  # as Lightning's logger does
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=WandbTracker(run=run))
    for k in range(1, 21):
        opt.step()
        sched.step(1.0 / k)
        run.log({"loss": 100.0 + k, "trainer/global_step": k})
    sched.close()
    run.finish()
    contents = read_finished(glob.glob(str(tmp_path / "wandb" / "*run-*" / "run-*.wandb"))[0], timeout=60)
    hdet_rows = [r for r in contents.history if "hdet/step" in r and "hdet/loss" in r]
    assert [r["hdet/loss"] for r in hdet_rows] == pytest.approx([1.0 / k for k in range(1, 21)])
    assert all(r["loss"] > 100 for r in contents.history if "loss" in r)  # the owner's only
    assert contents.step_metrics.get("loss") != "hdet/step" and contents.step_metrics["hdet/loss"] == "hdet/step"
    reader = WandbReader(str(tmp_path))
    (listed,) = reader.list_runs()
    assert listed.final_loss == pytest.approx(1 / 20)  # the run list read the owner's 120
    got = reader.read(run.id)
    assert got.final_loss() == pytest.approx(1 / 20)
    assert got.mean_series("lr")[0].tolist() == list(range(1, 21))
    assert "loss" not in got.metrics or max(got.metrics["loss"][1]) < 2  # never the owner's 101-120
    # read again from W&B's rows alone (no event archive): the owner's loss was HDET's metric "loss"
    for archive in glob.glob(str(tmp_path / "wandb" / "*run-*" / "files" / "hdet_events")):
        shutil.rmtree(archive)
    got = WandbReader(str(tmp_path)).read(run.id)
    assert any("no event archive" in w for w in got.warnings)
    assert got.final_loss() == pytest.approx(1 / 20) and len(got.converge) == 4
    assert "loss" not in got.metrics or max(got.metrics["loss"][1]) < 2
    assert "lr" not in got.metrics or max(got.metrics["lr"][1]) <= 0.1


def test_a_run_closed_finished_whose_file_lacks_wandbs_end_reads_finished(tmp_path):
    """hdet-track closed the run FINISHED (its status in the run's summary), then the process went
    before W&B's service wrote the run's end (a job teardown that killed the service): the run read
    KILLED, "ended without ending the run"."""
    wandb_file, data = _closed_jobs_run_file_copy(tmp_path)
    cut = len(data)
    while read_wandb_file_bytes(data[:cut], tmp_path).exit_code is not None:
        cut -= 64
    contents = read_wandb_file_bytes(data[:cut], tmp_path)
    assert contents.exit_code is None and contents.summary.get("hdet/status") == "FINISHED"
    open(wandb_file, "wb").write(data[:cut])
    still = time.time() - 60
    os.utime(wandb_file, (still, still))  # past the reader's grace for W&B's service
    summary, run = _read_single(tmp_path / "copy")
    assert run.status == summary.status == "FINISHED" and "hdet.error" not in run.tags


def test_a_run_file_removed_while_the_reader_reads_is_a_warning(tmp_path, monkeypatch):
    """`wandb sync --clean` while the dashboard polls: a run file listed, then gone before it is
    read, raised out of the reader (the fault is injected at the read)."""
    from hdet_track.readers import wandb as reader_module
    from hdet_track.readers.wandb import WandbReader

    path = tiny_finished_run()
    reader = WandbReader(os.environ["WANDB_DIR"])
    (summary,) = reader.list_runs()

    def gone(_path):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(reader_module.RUN_FILES, "read", gone)
    run = reader.read(summary.run_id)
    assert any("could not be read (FileNotFoundError" in w for w in run.warnings)
    assert sorted(set(run.steps.step.tolist())) == list(range(1, 11))  # the event archive still reads


GIVEN_TWICE = """
import os, signal, sys, torch, wandb
from hdet_track import HDETScheduler
from hdet_track.tracking.wandb import WandbTracker
run = wandb.init(project="given", dir=sys.argv[1], mode="offline")
for attempt in range(2):  # Hugging Face's train() twice in one W&B run
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=WandbTracker(run=run))
    for k in range(1, 11):
        opt.step()
        sched.step(1.0 / k)
    if attempt == 0:
        sched.close()
    else:
        assert sched.flush() is True
        run.summary["flushed"] = 1  # W&B's file is written at its owner's interval: wait for it below
        import time
        from hdet_track.wandb_file import read_wandb_file
        deadline = time.time() + 60
        while time.time() < deadline and read_wandb_file(run.settings.sync_file).summary.get("flushed") != 1:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_given_run_killed_in_its_second_scheduler_reads_killed_not_the_firsts_finished(tmp_path):
    """The first scheduler's close left hdet/status FINISHED in the given run's summary; a process
    killed in the second read FINISHED once that status was taken for hdet-track's close."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(GIVEN_TWICE)
    env = dict(os.environ, WANDB__TRANSACTION_LOG_FLUSH_INTERVAL="1")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    summary, run = _read_single(str(tmp_path))
    deadline = time.monotonic() + 30
    while run.status == "RUNNING" and time.monotonic() < deadline:  # the reader's grace after the exit
        time.sleep(0.5)
        summary, run = _read_single(str(tmp_path))
    assert run.status == "KILLED" and "ended without ending the run" in run.tags["hdet.error"]


def test_two_schedulers_logging_into_one_given_run_at_once_are_named_not_silently_mixed(tmp_path, caplog):
    """A GAN's generator and discriminator schedulers in one wandb.init(): their event archives
    overwrote each other in silence. One after the other (a closed first) is the supported way."""
    import logging

    import wandb

    from hdet_track.tracking.wandb import WandbTracker

    def scheduler(run):
        opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
        return opt, HDETScheduler(opt, 0.1, total_steps=4, sync_every=2, track=WandbTracker(run=run))

    run = wandb.init(project="given", dir=str(tmp_path), mode="offline")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # one after the other
            opt, sched = scheduler(run)
            for k in range(1, 5):
                opt.step()
                sched.step(1.0 / k)
            sched.close()
        assert "another scheduler is logging into W&B run" not in caplog.text
        # one after the other, each from step 1: their steps mix in the run, which a warning says
        assert caplog.text.count(f"W&B run {run.id} already holds an earlier HDET training") == 1
        (g_opt, g), (d_opt, d) = scheduler(run), scheduler(run)
        for k in range(1, 5):
            for opt, sched in ((g_opt, g), (d_opt, d)):
                opt.step()
                sched.step(1.0 / k)
        g.flush()
        d.flush()
        assert f"another scheduler is logging into W&B run {run.id} right now" in caplog.text
        g.close()
        d.close()
    run.finish()


def _flaky_archive(monkeypatch, kind="steps-"):
    """The event archive's next chunk write of ``kind`` fails once (a disk full for a moment), when armed."""
    import errno

    from hdet_track.tracking import archive

    real, armed = archive._write_atomic, {"left": 0}

    def flaky(table, path):
        if armed["left"] and kind in str(path):
            armed["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(table, path)

    monkeypatch.setattr(archive, "_write_atomic", flaky)
    return armed


def _counted(run_dir):
    """How often each step is in the run file's rows (replica 0's loss) and in the event archive."""
    from collections import Counter

    from hdet_track.wandb_file import read_wandb_file

    (run_file,) = glob.glob(f"{run_dir}/run-*.wandb")
    rows = Counter(r["hdet/step"] for r in read_wandb_file(run_file).history if "hdet/replica_00/loss" in r)
    archived = Counter()
    for chunk in glob.glob(f"{run_dir}/files/hdet_events/steps-*.parquet"):
        archived.update(pq.read_table(chunk).column("step").to_pylist())
    return rows, archived


def test_a_full_disk_for_a_moment_writes_no_step_twice(tmp_path, monkeypatch):
    """An archive chunk that could not be written made the whole batch fail: its rows were already in
    W&B's run file and its archive buffer, and the replay of the spilled batch wrote both again."""
    from hdet_track.tracking.wandb import WandbTracker

    armed = _flaky_archive(monkeypatch)
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    tracker = WandbTracker(project="full", dir=str(tmp_path), chunk_seconds=0.0)  # a chunk per batch
    with HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=tracker) as sched:
        for k in range(1, 21):
            opt.step()
            sched.step(1.0 / k)
            if k == 10:
                assert sched.flush()
                armed["left"] = 1
            if k == 15:
                assert sched.flush()  # steps 11-15 go while the disk is full
    (run_dir,) = glob.glob(f"{tmp_path}/wandb/offline-run-*")
    rows, archived = _counted(run_dir)
    assert armed["left"] == 0 and sorted(rows) == sorted(archived) == list(range(1, 21))
    assert set(rows.values()) == set(archived.values()) == {1}


def test_a_session_writes_a_steps_rows_once_when_they_come_twice(tmp_path):
    """A job resumed from a checkpoint between two syncs takes its earlier attempt's spill in up to
    the checkpoint, then its first sync sends the window from the last sync on again (its losses are
    in the checkpoint): W&B's rows and both trackers' archives held those steps twice."""
    import numpy as np
    from mlflow.tracking import MlflowClient

    from hdet_track import names
    from hdet_track.events import RunEnd, RunStart
    from hdet_track.tracking.archive import StepBlock
    from hdet_track.tracking.base import Batch, Point
    from hdet_track.tracking.mlflow import MLflowTracker
    from hdet_track.tracking.wandb import WandbTracker

    def steps(first, last):
        step = np.arange(first, last + 1)
        points = [Point(names.replica_metric(0, "loss"), 1.0 / s, int(s), 0) for s in step]
        return Batch(points=points, steps=[StepBlock(step, np.zeros(len(step), dtype=np.int32), 1.0 / step)])

    start = RunStart(config={}, world_size=1, schedule="hdet", param_groups=["pg0"], explored=[], versions={},
                     hostnames=[], total_steps=20)  # fmt: skip
    uri = f"sqlite:///{tmp_path / 'twice.db'}"
    mlflow_tracker = MLflowTracker(tracking_uri=uri, experiment="twice")
    mlflow_tracker.isolate = False
    wandb_tracker = WandbTracker(project="twice", dir=str(tmp_path))
    for tracker in (mlflow_tracker, wandb_tracker):
        tracker.start(start)
        for batch in (steps(1, 12), steps(11, 20)):  # the spill up to the checkpoint, then the window from 11
            tracker.log(batch)
        tracker.finish(RunEnd(status="FINISHED", step=20))
    (run_dir,) = glob.glob(f"{tmp_path}/wandb/offline-run-*")
    rows, archived = _counted(run_dir)
    assert sorted(rows) == sorted(archived) == list(range(1, 21)) and set(rows.values()) == set(archived.values()) == {
        1
    }
    client = MlflowClient(uri)
    archived = []
    for f in client.list_artifacts(mlflow_tracker.run_id, "hdet_events"):
        if f.path.rsplit("/", 1)[-1].startswith("steps-"):
            archived += (
                pq.read_table(client.download_artifacts(mlflow_tracker.run_id, f.path, str(tmp_path)))
                .column("step")
                .to_pylist()
            )
    assert sorted(archived) == list(range(1, 21))


def test_an_mlflow_server_that_is_down_does_not_hold_back_wandb(tmp_path, monkeypatch):
    """One writer thread serves every tracker of a job, and MLflow's client retried each request
    for minutes: with MLflow down and W&B beside it, W&B got nothing before the job ended, and its
    run read FINISHED and empty. The tracker's child process now gives up after one retry (the hub
    keeps MLflow's batches in a spill and retries it itself)."""
    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.mlflow import MLflowTracker
    from hdet_track.tracking.wandb import WandbTracker

    from .servers import free_port

    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # MLflow's own defaults
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HDET_TRACK_SHUTDOWN_TIMEOUT", "2")
    down = MLflowTracker(tracking_uri=f"http://127.0.0.1:{free_port()}")  # nothing listens there
    wandb_tracker = WandbTracker(project="two", dir=str(tmp_path))
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=[down, wandb_tracker])
    for k in range(1, 21):
        opt.step()
        sched.step(1.0 / k)
    assert sched.flush(timeout=60)
    sched.close()
    run = WandbReader(str(tmp_path)).read(wandb_tracker.run_id)
    assert run.status == "FINISHED" and sorted(set(run.steps.step.tolist())) == list(range(1, 21))
    assert [c.step for c in run.converge] == [5, 10, 15, 20]
    assert list((tmp_path / "cache").rglob("spill-mlflow-*.jsonl"))  # MLflow's data waits for it


def test_a_secret_in_a_list_a_group_or_a_run_name_never_reaches_the_run_file(tmp_path, monkeypatch):
    """W&B's config, group, name and tags held a secret that sat in a param-group name, the run
    name or the compare group; the run file now holds none of it."""
    from hdet_track.tracking.wandb import WandbTracker

    from .test_tracking_mlflow import _log_with_a_secret

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MY_API_KEY", "sekret-xyz")
    _log_with_a_secret("sekret-xyz", WandbTracker(mode="offline"))
    (path,) = glob.glob(os.path.join(run_dir(str(tmp_path)), "run-*.wandb"))
    assert b"sekret-xyz" not in open(path, "rb").read()
    contents = read_finished(path)
    assert contents.group == "g-***" and contents.config["param_groups"] == '["enc-***"]'
    events = glob.glob(os.path.join(run_dir(str(tmp_path)), "files", "hdet_events", "*.parquet"))
    assert events and not any(b"sekret-xyz" in open(p, "rb").read() for p in events)


def _run_record(path):
    from hdet_track.wandb_file import iter_records

    return next(rec.run for rec in iter_records(path) if rec.WhichOneof("record_type") == "run")


def test_the_users_tags_notes_and_wandb_tags_reach_the_run_beside_hdets(tmp_path, monkeypatch):
    """``wandb.init(tags=)`` with HDET's tags dropped ``WANDB_TAGS``, and WandbTracker took neither
    tags nor notes: a W&B user could not tag the runs hdet-track starts."""
    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker

    for bad in ("one-tag", ["ok", 3], ["x" * 65], [""]):
        with pytest.raises(ValueError, match=r"Expected tags to be a list of strings of 1 to 64 characters"):
            WandbTracker(dir=tmp_path, tags=bad)
    with pytest.raises(ValueError, match="notes to be a non-empty str or None, but got 5"):
        WandbTracker(dir=tmp_path, notes=5)
    monkeypatch.setenv("WANDB_TAGS", "exp42, baseline,mine")
    monkeypatch.setenv("MY_API_KEY", "sekret-xyz")
    tracker = WandbTracker(dir=tmp_path, tags=["mine", "ablation"], notes="lr sweep, key sekret-xyz")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=tracker) as sched:
        for k in range(1, 11):
            opt.step()
            sched.step(1.0 / k)
    (path,) = glob.glob(os.path.join(run_dir(str(tmp_path)), "run-*.wandb"))
    record = _run_record(path)
    tags = list(record.tags)
    assert tags[:4] == ["mine", "ablation", "exp42", "baseline"]
    assert "hdet.schema_version=2" in tags[4:]
    assert record.notes == "lr sweep, key ***" and b"sekret-xyz" not in open(path, "rb").read()
    settings = tracker.spill_settings()  # a replay tags it alike, whatever the replaying job's variables
    assert settings["tags"] == ["mine", "ablation", "exp42", "baseline"] and settings["notes"] == "lr sweep, key ***"
    monkeypatch.setenv("WANDB_TAGS", "another-job")
    replay = WandbTracker(**settings)
    replay.replaying()
    assert replay._user_tags() == ["mine", "ablation", "exp42", "baseline"]
    assert WandbReader(str(tmp_path)).read(tracker.run_id).status == "FINISHED"


def test_an_error_that_quotes_a_secret_is_kept_without_it(tmp_path, monkeypatch):
    """The run's name was masked, the failing exception's text (a URL with its token) was not."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_SuperSecretValue123")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(PermissionError):
        with HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track="wandb") as sched:
            for k in range(1, 6):
                opt.step()
                sched.step(1.0 / k)
            raise PermissionError("401 Unauthorized for url https://hub.example/api?token=hf_SuperSecretValue123")
    (path,) = glob.glob(os.path.join(run_dir(str(tmp_path)), "run-*.wandb"))
    assert b"hf_SuperSecretValue123" not in open(path, "rb").read()
    contents = read_finished(path)
    assert contents.summary["hdet/status"] == "FAILED"
    assert "401 Unauthorized for url https://hub.example/api?token=***" in contents.summary["hdet/error"]


def test_runs_w_and_b_wrote_into_a_dot_wandb_folder_are_found(tmp_path, monkeypatch):
    """W&B writes into ``<dir>/.wandb`` where that folder exists; the readers looked in ``wandb``."""
    from hdet_track.readers.wandb import WandbReader, find_run_dirs

    (tmp_path / ".wandb").mkdir()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    ten_step_job()
    (found,) = find_run_dirs(tmp_path)
    assert found.parent.name == ".wandb"
    (summary,) = WandbReader(str(tmp_path)).list_runs()
    assert summary.status == "FINISHED" and WandbReader(str(tmp_path)).read(summary.run_id).converge


def test_a_given_run_whose_owner_failed_after_hdet_closed_it_reads_failed(tmp_path, monkeypatch):
    """``with wandb.init() as run:``: training and ``close()`` went well, then the owner's evaluation
    raised (W&B's exit code 1). ``hdet/status`` FINISHED took precedence: the run read FINISHED,
    where MLflow's reader gives the owner's FAILED."""
    import wandb

    from hdet_track.readers.wandb import WandbReader
    from hdet_track.tracking.wandb import WandbTracker

    run = wandb.init(project="given", dir=str(tmp_path), mode="offline", reinit="create_new")
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=WandbTracker(run=run)) as sched:
        for k in range(1, 11):
            opt.step()
            sched.step(1.0 / k)
    run.finish(exit_code=1)  # what the context manager does when the owner's code raises
    reader = WandbReader(str(tmp_path))
    (path,) = glob.glob(os.path.join(run_dir(str(tmp_path)), "run-*.wandb"))
    read_finished(path, timeout=60)
    hdet_run = reader.read(run.id)
    assert hdet_run.status == "FAILED" and "exit code 1" in hdet_run.tags["hdet.error"]
    assert [c.step for c in hdet_run.converge] == [5, 10]


def test_a_run_id_w_and_b_kept_from_an_earlier_environment_is_not_every_new_runs(tmp_path, monkeypatch):
    """W&B's process-wide settings keep $WANDB_RUN_ID as it was when W&B was first set up (here by a
    spill replayed while a job's variable was set): every later run hdet-track started took that
    id, and two schedulers in turn logged into one run (seen as a test-order failure)."""
    import wandb

    from hdet_track.tracking.wandb import WandbTracker

    wandb.teardown()
    monkeypatch.setenv("WANDB_RUN_ID", "stalejob01")
    wandb.setup()
    monkeypatch.delenv("WANDB_RUN_ID")
    try:
        ids = []
        for _ in range(2):
            opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
            with HDETScheduler(opt, 0.1, total_steps=4, sync_every=2, track=WandbTracker(dir=tmp_path)) as sched:
                for k in range(1, 5):
                    opt.step()
                    sched.step(1.0 / k)
            ids.append(sched.run_ids["wandb"])
        assert len(set(ids)) == 2 and "stalejob01" not in ids
        monkeypatch.setenv("WANDB_RUN_ID", "nowjob01")  # set now (a sweep agent's): W&B's setup missed it
        opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
        with HDETScheduler(opt, 0.1, total_steps=4, sync_every=2, track=WandbTracker(dir=tmp_path)) as sched:
            for k in range(1, 5):
                opt.step()
                sched.step(1.0 / k)
        assert sched.run_ids["wandb"] == "nowjob01"
    finally:
        wandb.teardown()  # the next test sets W&B up from its own environment

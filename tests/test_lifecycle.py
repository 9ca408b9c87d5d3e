"""A run's status says what the job did, under every launcher; nothing logged is lost on a crash.

Each case runs tests/jobs/lifecycle_job.py (100 steps, sync every 10) under a launcher, makes it
fail in one way at one step, and reads the store back: one run, its status, the error, the syncs
that happened before the failure, and the job's own start and end times.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from hdet_track.readers.mlflow import MLflowReader
from hdet_track.readers.wandb import WandbReader

from .servers import free_port

JOB = str(Path(__file__).parent / "jobs" / "lifecycle_job.py")
SWEEP_JOB = str(Path(__file__).parent / "jobs" / "sweep_job.py")
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

CASES = [
    # launcher, ranks, backend, failure, step, failing rank, status, text in the error
    ("plain", 1, "sqlite", "none", -1, 0, "FINISHED", None),
    ("plain", 1, "sqlite", "raise", 35, 0, "FAILED", "boom on rank 0 before step 35"),
    ("plain", 1, "sqlite", "raise", 0, 0, "FAILED", "boom on rank 0 before step 1"),
    ("plain", 1, "sqlite", "exit", 35, 0, "FAILED", "step 34 of 100 without closing the run (exit code 3)"),
    ("plain", 1, "server", "sigterm", 35, 0, "KILLED", "terminated by SIGTERM"),
    ("plain", 1, "wandb", "raise", 95, 0, "FAILED", "boom on rank 0 before step 95"),
    # while the writer thread's wandb.init is under way: W&B's exit handler came first (found by CI)
    ("plain", 1, "wandb", "raise_as_service_starts", 2, 0, "FAILED", "boom on rank 0 before step 2"),
    ("spawn", 2, "sqlite", "raise", 5, 0, "FAILED", "boom on rank 0 before step 5"),
    ("spawn", 2, "wandb", "raise", 80, 1, "FAILED", "boom on rank 1 before step 80"),
    ("spawn", 2, "sqlite", "sigint", 40, 0, "KILLED", "interrupted by SIGINT"),  # Ctrl-C: spawn swallows it
    ("torchrun", 2, "sqlite", "raise", 30, 1, "FAILED", "boom on rank 1 before step 30"),
    ("torchrun", 4, "server", "raise", 51, 0, "FAILED", "boom on rank 0 before step 51"),  # right after a sync
    ("torchrun", 2, "sqlite", "sigterm", 40, 0, "KILLED", "terminated by SIGTERM"),
    ("torchrun", 2, "wandb", "exit", 60, 0, "FAILED", "(exit code 3)"),
    # torchrun tears rank 0 down after rank 1's exit, or while its own exit unwinds: not KILLED
    ("torchrun", 2, "sqlite", "exit_one", 30, 1, "FAILED", "rank 1 failed:\nthe process exited (exit code 3)"),
    ("plain", 1, "sqlite", "exit_torn_down", 30, 0, "FAILED", "step 29 of 100 without closing the run (exit code 3)"),
]


def _sigint_default() -> None:
    """A job started from a shell's background job (a CI runner's) inherits SIGINT ignored, and a
    terminal's Ctrl-C would not reach it: the job gets SIGINT's default, as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launch(launcher: str, ranks: int, backend: str, uri: str, failure: str, step: int, rank: int, tmp: Path):
    args = [launcher, backend, uri, failure, str(step), str(rank)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    if launcher == "torchrun":
        cmd = [TORCHRUN, f"--nproc-per-node={ranks}", "--max-restarts=0", "--monitor-interval=0.5"]
        cmd += ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", JOB, *args]  # a free port, bound by torchrun
    else:
        cmd = [sys.executable, JOB, *args]
    log = open(tmp / "job.log", "w+")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True, preexec_fn=_sigint_default
    )
    if failure in ("sigterm", "sigint"):
        assert proc.stdout.readline().strip() == "READY", (tmp / "job.log").read_text()[-3000:]
        time.sleep(1.0)  # the other ranks reach the next sync and wait there
        if failure == "sigterm":
            os.kill(proc.pid, signal.SIGTERM)  # from outside: to the job (plain) or to torchrun's agent
        else:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: to every process of the job
    try:
        proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, (tmp / "job.log").read_text()


@pytest.mark.parametrize(
    ("launcher", "ranks", "backend", "failure", "step", "rank", "status", "text"),
    CASES,
    ids=[f"{c[0]}{c[1]}-{c[2]}-{c[3]}-at{c[4]}-rank{c[5]}" for c in CASES],
)
def test_status_by_what_the_job_did(
    tmp_path, mlflow_server, launcher, ranks, backend, failure, step, rank, status, text
):
    if backend == "sqlite":
        uri = f"sqlite:///{tmp_path / 'store.db'}"
    elif backend == "server":
        uri = mlflow_server.uri
    else:
        uri = str(tmp_path / "wandb-dir")
    started = time.time()
    code, log = launch(launcher, ranks, backend, uri, failure, step, rank, tmp_path)
    if failure != "sigint":  # Ctrl-C: torch's spawn parent exits 0 or 1 by a race of its own
        assert (code == 0) == (status == "FINISHED"), log[-3000:]
    steps_before = 100 if failure == "none" else max(step - 1, 0)
    expected_syncs = [s for s in range(10, 101, 10) if s <= steps_before]
    if backend == "wandb":
        reader = WandbReader(uri)
        deadline = time.monotonic() + 60
        while True:  # W&B's service may still be writing the exit record
            (summary,) = reader.list_runs()
            run = reader.read(summary.run_id)
            if run.status != "RUNNING" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert run.status == status, log[-3000:]
        error = run.tags.get("hdet.error", "")
    else:
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("life").experiment_id])
        if backend == "server":
            runs = [r for r in runs if r.info.start_time >= started * 1000 - 1000]
        assert len(runs) == 1, log[-3000:]
        info, tags = runs[0].info, runs[0].data.tags
        assert info.status == status, log[-3000:]
        error = tags.get("hdet.error", "")
        # the job's own times: the run started before training and ended after it
        assert started * 1000 - 1000 <= info.start_time <= info.end_time <= time.time() * 1000
        run = MLflowReader(uri).read(info.run_id)
    if text:
        assert text in error, error[-2000:]
    if rank != 0 and failure.startswith("raise"):
        assert f"rank {rank} failed" in error, error[-2000:]  # the failing rank's error, not rank 0's
    assert [c.step for c in run.converge] == expected_syncs, log[-3000:]
    if expected_syncs:
        steps, _ = run.replica_series("loss", 0)
        assert list(steps) == list(range(1, expected_syncs[-1] + 1))  # everything synced is in the store


def _runs_by_name(backend: str, uri: str) -> dict:
    """name -> HDETRun, once no run is RUNNING any more (W&B's service may still be writing)."""
    reader = MLflowReader(uri) if backend == "sqlite" else WandbReader(uri)
    deadline = time.monotonic() + 60
    while True:
        runs = {s.name: reader.read(s.run_id) for s in reader.list_runs()}
        if all(r.status != "RUNNING" for r in runs.values()) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


@pytest.mark.parametrize("backend", ["sqlite", "wandb"])
@pytest.mark.parametrize(
    ("case", "second", "text"),
    [
        ("raise", "FAILED", "boom in second at step 15"),
        ("exit", "FAILED", "exited with code 3 after the run's last step (20 of 20)"),
        ("ok", "FINISHED", None),
    ],
)
def test_a_finished_run_left_open_is_not_failed_by_the_next_run_of_the_sweep(tmp_path, backend, case, second, text):
    """The first run reached its last step and logged a final metric without closing; what the
    second run of the same process does is not the first's failure, and the first's scheduler and
    model are not kept alive by the tracking once the second starts."""
    uri = f"sqlite:///{tmp_path / 'store.db'}" if backend == "sqlite" else str(tmp_path / "wandb-dir")
    proc = subprocess.run([sys.executable, SWEEP_JOB, backend, uri, case], capture_output=True, text=True, timeout=240)
    assert (proc.returncode == 0) == (case == "ok"), proc.stderr[-3000:]
    runs = _runs_by_name(backend, uri)
    assert sorted(runs) == ["first", "second"], proc.stderr[-3000:]
    first = runs["first"]
    assert first.status == "FINISHED", (first.tags, proc.stderr[-3000:])
    assert not first.tags.get("hdet.error")
    assert list(first.metrics["val_loss"][1]) == [0.25]  # the final metric logged while it was open
    assert [c.step for c in first.converge] == [5, 10, 15, 20]
    assert runs["second"].status == second, proc.stderr[-3000:]
    if text:
        assert text in runs["second"].tags.get("hdet.error", ""), runs["second"].tags
    if case != "raise":
        assert "FIRST_FREED True" in proc.stdout, proc.stdout


def test_exit_with_a_code_after_the_last_step_fails_the_run(tmp_path):
    """An audit's finding: site's exit(3) (and quit(3)) after the last step left the run FINISHED;
    only sys.exit(3) was seen."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    proc = subprocess.run(
        [sys.executable, SWEEP_JOB, "sqlite", uri, "builtin_exit"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    second = _runs_by_name("sqlite", uri)["second"]
    assert second.status == "FAILED" and "exited with code 3" in second.tags.get("hdet.error", ""), second.tags


@pytest.mark.parametrize("backend", ["sqlite", "wandb"])
def test_a_retry_loop_that_resumes_in_the_same_process_ends_the_run_finished(tmp_path, backend):
    """The first attempt raises (the loop catches it) and a new scheduler of the same process
    resumes the run from a checkpoint: the run ends FINISHED with one point per step, the first
    attempt's end noted in ``hdet.resumed_after``, not FAILED by the first attempt's writer at exit
    (and, with W&B, not refused as "in use" and spilled)."""
    uri = f"sqlite:///{tmp_path / 'store.db'}" if backend == "sqlite" else str(tmp_path / "wandb-dir")
    job = str(Path(__file__).parent / "jobs" / "retry_job.py")
    proc = subprocess.run([sys.executable, job, backend, uri], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "RETRY a transient failure at step 13" in proc.stdout, proc.stderr[-3000:]
    runs = _runs_by_name(backend, uri)
    assert list(runs) == ["retry"], proc.stderr[-3000:]
    run = runs["retry"]
    assert run.status == "FINISHED" and not run.tags.get("hdet.error"), (run.tags, proc.stderr[-3000:])
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))
    assert list(run.metrics["val_loss"][1]) == [0.5]
    if backend == "sqlite":
        assert "left at step 13 of 20" in run.tags.get("hdet.resumed_after", ""), run.tags
    else:
        assert not list((tmp_path / "wandb-dir" / "wandb").glob(".hdet-spill/spill-*"))


def test_a_checkpoint_before_the_first_step_does_not_wait_for_a_run(tmp_path):
    """state_dict() at step 0 (a checkpoint written before training) has no run to wait for: it
    returns at once without run ids (it used to block 30 s on rank 0); after a step it has one."""
    import torch

    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import MLflowTracker

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'store.db'}", experiment="s0")
    with HDETScheduler(opt, 0.05, total_steps=4, sync_every=2, model=model, track=tracker) as sched:
        began = time.monotonic()
        assert sched.state_dict()["runs"] == {}
        assert time.monotonic() - began < 10  # a hang check, not a speed target: the wait was 30 s
        opt.step()
        sched.step(1.0)
        assert sched.state_dict()["runs"] == {"mlflow": tracker.run_id} and tracker.run_id


def test_closed_runs_do_not_keep_their_scheduler_and_model_alive(tmp_path):
    """A sweep that closes each run (the ``with`` block) does not accumulate its trials' models
    (on a GPU, their memory) in the process-wide registry of runs to end at exit."""
    import gc
    import weakref

    import torch
    import torch.nn.functional as F

    from hdet_track import HDETScheduler
    from hdet_track.tracking import lifecycle
    from hdet_track.tracking.mlflow import MLflowTracker

    refs = []
    for _ in range(2):
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        track = MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'store.db'}", experiment="leak")
        with HDETScheduler(opt, 0.1, total_steps=6, sync_every=3, model=model, track=track) as sched:
            for _ in range(6):
                x = torch.randn(8, 4)
                loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step(loss)
            recorder = sched._callbacks.recorder
            assert recorder in lifecycle._RECORDERS
        assert recorder not in lifecycle._RECORDERS
        refs.append(weakref.ref(model))
        del model, opt, sched, recorder
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_ctrl_c_an_earlier_run_caught_does_not_make_a_later_run_killed():
    """The Ctrl-C mark lasts until the next run starts: a sweep that caught one trial's
    KeyboardInterrupt and went on ended a later trial that stopped early KILLED, not FAILED."""
    from hdet_track.tracking import lifecycle

    class Recorder:  # what register() needs of one
        def finished_open(self):
            return False

    saved = {k: lifecycle._STATE[k] for k in ("interrupted", "failure", "signal", "exit_code")}
    try:  # (an earlier test in this process may have left a failure behind)
        lifecycle._STATE.update(interrupted=True, failure=None, signal=None, exit_code=None)
        assert lifecycle.exit_status(False, 5, 10)[0] == "KILLED"
        recorder = Recorder()
        lifecycle.register(recorder)
        lifecycle.unregister(recorder)
        status, error = lifecycle.exit_status(False, 5, 10)
        assert status == "FAILED" and "step 5 of 10 without closing the run" in error
    finally:
        lifecycle._STATE.update(saved)


# what the exit-order jobs below share: imports and one training step
_JOB_PRELUDE = """
import sys, threading, time
import torch
import torch.nn.functional as F
from hdet_track import HDETScheduler
from hdet_track.tracking.mlflow import MLflowTracker

def train_step(model, opt, sched):
    x = torch.randn(8, 4)
    loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step(loss)
"""

THREAD_JOB = (
    _JOB_PRELUDE
    + """
def build():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    track = MLflowTracker(tracking_uri=sys.argv[1], experiment="thread")
    return model, opt, HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, model=model, track=track)

def train(job):
    model, opt, sched = job or build()
    built.set()
    for _ in range(20):
        time.sleep(0.1)  # still training when the main thread is done
        train_step(model, opt, sched)
    sched.log_metrics({"val_loss": 0.5}, step=20)

built = threading.Event()
job = build() if sys.argv[2] == "main" else None
threading.Thread(target=train, args=(job,)).start()  # a non-daemon thread: the process waits for it
built.wait(120)  # the main thread is done once the run is being trained
"""
)


@pytest.mark.parametrize("built_in", ["main", "thread"])
def test_a_run_trained_in_another_thread_ends_after_that_thread_not_when_the_main_thread_is_done(tmp_path, built_in):
    """The runs end at exit, after the non-daemon threads: a run trained in a thread still running when
    the main thread is done (its scheduler built there or in the main thread) ends FINISHED with every
    step and the final metric, not FAILED at step 0 with the rest dropped (a first version of the
    exit-order fix ended every run when the main thread was done)."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    cmd = [sys.executable, "-c", THREAD_JOB, uri, built_in]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = _runs_by_name("sqlite", uri).values()
    assert run.status == "FINISHED" and not run.tags.get("hdet.error"), (run.tags, proc.stderr[-3000:])
    assert run.replica_series("loss", 0)[0].tolist() == list(range(1, 21))
    assert list(run.metrics["val_loss"][1]) == [0.5]


FLUENT_JOB = (
    """
import sys
if sys.argv[1] == "early":
    import mlflow
"""
    + _JOB_PRELUDE
    + """
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, model=model, track=MLflowTracker())
for k in range(1, 21):
    if k == 10:
        import mlflow
        mlflow.log_param("note", "x")  # MLflow's fluent API: $MLFLOW_RUN_ID is its active run
    if k == 15:
        raise RuntimeError("boom at 15")
    train_step(model, opt, sched)
"""
)


@pytest.mark.parametrize("imported", ["early", "late"])
def test_a_run_mlflows_fluent_api_holds_ends_failed_not_finished_by_mlflows_exit_handler(tmp_path, imported):
    """The job's run is $MLFLOW_RUN_ID, which MLflow's fluent API also holds as its active run once the
    job calls it (mlflow.log_param); the job then fails. MLflow's own exit handler ended the active run
    FINISHED over hdet-track's FAILED (whichever of the two handlers ran last)."""
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("fluent")).info.run_id
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_"))}
    env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_RUN_ID=run_id)
    proc = subprocess.run(
        [sys.executable, "-c", FLUENT_JOB, imported], capture_output=True, text=True, timeout=240, env=env
    )
    assert proc.returncode == 1 and "boom at 15" in proc.stderr, proc.stderr[-3000:]
    run = client.get_run(run_id)
    assert run.info.status == "FAILED", (run.info, proc.stderr[-3000:])
    assert "boom at 15" in run.data.tags.get("hdet.error", "") and run.data.params["note"] == "x"
    assert len(client.get_metric_history(run_id, "loss")) == 10  # through the last sync


HUNG_JOB = (
    _JOB_PRELUDE
    + """
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, model=model, track=MLflowTracker(tracking_uri=sys.argv[1]))
for _ in range(20):
    train_step(model, opt, sched)
"""
)


def test_the_exit_waits_once_for_a_writer_a_hung_backend_holds(tmp_path):
    """A server that takes connections and never answers: the exit gave the writer its time once per
    exit handler (atexit's, then multiprocessing's, which runs the same ending again), the wait and
    its warning twice over. A run ended once is not waited for again."""
    import socket

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        env = dict(os.environ, HDET_TRACK_SHUTDOWN_TIMEOUT="2", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
        env["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "20"  # well past the 2 s wait; its tracking process lives that long
        uri = f"http://127.0.0.1:{hung.getsockname()[1]}"
        proc = subprocess.run(
            [sys.executable, "-c", HUNG_JOB, uri], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("the tracking writer did not finish within 2 s") == 1, proc.stderr[-3000:]

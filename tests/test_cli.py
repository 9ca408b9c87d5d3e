"""The CLI's demo end to end: 2 real gloo replicas launched through torch's elastic launcher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from hdet_track.cli import main

from .servers import older_schema_store


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    """`hdet-track demo --quick` end to end: 2 gloo replicas per run, a temporary sqlite store."""
    root = tmp_path_factory.mktemp("demo")
    uri = f"sqlite:///{root / 'demo.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_"))}
    env["MLFLOW_TRACKING_URI"] = uri
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hdet_track.cli",
            "demo",
            "--quick",
            "--replicas",
            "2",
            "--steps",
            "50",
            "--sync-every",
            "25",
            "--group",
            "cli-test",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return uri, proc.stdout, env, root


def test_demo_logs_one_run_per_ablation_arm_and_prints_the_table(demo_store):
    uri, out, _, root = demo_store
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("hdet")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"baseline-high", "hdet"}
    assert runs["baseline-high"].data.tags["hdet.schedule"] == "onecycle"
    assert runs["hdet"].data.tags["hdet.schedule"] == "hdet"
    assert {r.data.tags["hdet.compare_group"] for r in runs.values()} == {"cli-test"}
    assert all(r.data.tags["hdet.world_size"] == "2" for r in runs.values())
    for r in runs.values():
        assert r.info.status in ("FINISHED", "FAILED")
        assert "val_loss" in r.data.metrics and "hdet/replica_01/loss" in r.data.metrics
    assert "baseline-high" in out and "final train loss" in out and "hdet-track dashboard" in out
    assert "mlflow ui --backend-store-uri" in out
    assert "max_lr 1, runs: baseline-high, hdet;" in out  # the quick demo never runs the 0.05 run
    assert not (root / "mlflow.db").exists()  # MLFLOW_TRACKING_URI was honoured


@pytest.mark.parametrize("fmt", ["table", "markdown", "json"])
def test_compare_formats(demo_store, fmt):
    uri, _, env, root = demo_store
    proc = _cli(["compare", "--format", fmt], root, env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if fmt == "json":
        rows = json.loads(proc.stdout)
        assert [r["name"] for r in rows] == ["baseline-high", "hdet"]
        assert set(rows[0]) == {
            "run_id",
            "name",
            "schedule",
            "world_size",
            "status",
            "mean_lr",
            "final_train_loss",
            "best_train_loss",
            "highest_stable_lr",
            "best_val_loss",
            "final_val_loss",
            "val_accuracy",
            "diverged",
            "diverged_at_step",
        }
        assert [r["schedule"] for r in rows] == ["onecycle", "hdet"]
        assert all(isinstance(r["diverged"], bool) for r in rows)
        assert all(r["mean_lr"] > 0 for r in rows)
        assert [r["world_size"] for r in rows] == [2, 2] and {r["status"] for r in rows} <= {"FINISHED", "FAILED"}
        assert all(r["best_train_loss"] <= r["final_train_loss"] for r in rows)
    elif fmt == "markdown":
        lines = proc.stdout.strip().splitlines()
        assert lines[0].startswith("| run | schedule | mean LR") and lines[1].startswith("|---|")
        assert len(lines) == 4
    else:
        assert proc.stdout.splitlines()[0].split()[:2] == ["run", "schedule"]


def test_compare_without_runs_is_a_one_line_error(tmp_path):
    code = main(["compare", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}", "--experiment", "nope"])
    assert code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--replicas", "0"], "positive integer"),
        (["demo", "--spread", "1.5"], "[0, 1)"),
        (["demo", "--steps", "10", "--sync-every", "25"], "at least --sync-every"),
        (["demo", "--dataset", "cifar"], "invalid choice: 'cifar'"),
        (["demo", "--tracker", "tensorboard"], "invalid choice: 'tensorboard'"),
        (["demo", "--high-lr", "-1"], "positive finite number"),
        (["demo", "--high-lr", "inf"], "positive finite number"),  # accepted, then every worker failed
        (["dashboard", "--port", "70000"], "1..65535"),
        (["nope"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_wheel_ships_the_dashboard_inside_the_package(tmp_path):
    import zipfile

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            str(root),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("hdet_track-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "hdet_track/dashboard/app.py" in names and "hdet_track/dashboard/app_pages/fanout.py" in names
    assert not any(n.startswith("dashboard/") for n in names)  # no generic top-level module
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "hdet-track = hdet_track.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_missing_dataset_is_a_one_line_error_before_any_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'x.db'}")
    code = main(["demo", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2 and "Fashion-MNIST not found" in err and "--data-dir" in err and "dataset-fashion-mnist" in err
    assert not (tmp_path / "x.db").exists()  # nothing half-written


def _cli(argv, cwd, env, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "hdet_track.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def test_text_demo_with_independent_replicas_on_the_stdlib_sources(tmp_path):
    """`--dataset text`: a character-level transformer on the standard library's sources, local-SGD replicas."""
    import math

    uri = f"sqlite:///{tmp_path / 'text.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_"))}
    env["MLFLOW_TRACKING_URI"] = uri
    argv = ["--dataset", "text", "--quick", "--replicas", "2", "--steps", "50", "--grad-mode", "independent"]
    proc = _cli(["demo", *argv, "--group", "text-test"], tmp_path, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "text, 2 gloo replicas (independent gradients), 50 steps, max_lr 0.02, runs:" in proc.stdout
    assert "Downloading artifacts" not in proc.stdout + proc.stderr  # no progress-bar noise in the table
    client = MlflowClient(uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("hdet").experiment_id])}
    assert set(runs) == {"baseline-high", "hdet"}
    from hdet_track.examples.tasks import load_task

    vocab = load_task("text").vocab
    for run in runs.values():
        assert run.info.status == "FINISHED"
        assert float(run.data.params["max_lr"]) == 0.02
        # a character model that learned: well below the uniform guess over the alphabet
        assert run.data.metrics["val_loss"] < math.log(vocab) - 1.0
        assert run.data.metrics["val_accuracy"] > 0.2


def test_text_file_that_cannot_be_read_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'x.db'}")
    code = main(["demo", "--dataset", "text", "--text-file", str(tmp_path / "nope.txt")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot read --text-file" in err and "nope.txt" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.db").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error on a machine without GPUs")
def test_device_cuda_without_gpus_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'x.db'}")
    code = main(["demo", "--device", "cuda", "--replicas", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--device cuda needs one GPU per replica: 2 replicas but 0 GPU(s)" in err
    assert not (tmp_path / "x.db").exists()


def _read_only_cwd_run(directory, argv, env):
    """Run the demo with ``directory`` mounted read-only (a private mount namespace: root can't write either)."""
    import shutil

    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and util-linux's unshare for a read-only bind mount")
    script = 'mount --bind -o ro "$1" "$1" && cd "$1" && shift && exec "$@"'
    cmd = ["unshare", "--mount", "sh", "-c", script, "sh", str(directory), sys.executable, "-m", "hdet_track.cli"]
    return subprocess.run([*cmd, "demo", *argv], capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    ("tracker", "message"),
    [("mlflow", "cannot write the MLflow store"), ("wandb", "cannot write W&B's run files")],
)
def test_read_only_working_directory_is_a_one_line_error(tmp_path, tracker, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_", "WANDB_"))}
    env["WANDB_MODE"] = "offline"
    workdir = tmp_path / "read-only"
    workdir.mkdir()
    proc = _read_only_cwd_run(workdir, ["--quick", "--tracker", tracker], env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "writable directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(workdir.iterdir()) == []  # nothing half-written


def _env_without_tracking() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_", "WANDB_"))}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_read_only_commands_never_create_a_store(tmp_path, capsys):
    """compare, dashboard and recover on a sqlite URI whose file does not exist: a one-line error naming
    the URI, exit 2, and no file or directory created (MLflow's client would create the store)."""
    before = sorted(p.name for p in tmp_path.iterdir())
    uri = f"sqlite:///{tmp_path / 'nonexistent' / 'x.db'}"  # sqlite:////abs/path
    proc = _cli(["compare", "--tracking-uri", uri], tmp_path, _env_without_tracking(), timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert uri in proc.stderr and "does not exist" in proc.stderr
    # the default store, sqlite:///mlflow.db in the working directory (the conftest's tmp_path)
    assert main(["compare"]) == 2
    assert "sqlite:///mlflow.db" in capsys.readouterr().err
    assert main(["dashboard", uri, "--port", str(_free_port())]) == 2  # its directory does not exist: a typo
    assert uri in capsys.readouterr().err
    assert main(["recover", uri]) == 2
    assert uri in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_recover_on_a_path_that_does_not_exist_is_an_error(tmp_path, capsys):
    missing = tmp_path / "no" / "such" / "dir"
    assert main(["recover", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "does not exist" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "no").exists()
    (tmp_path / "runs").mkdir()  # an existing directory without spills: nothing to do, as before
    assert main(["recover", str(tmp_path / "runs")]) == 0
    assert "nothing to deliver" in capsys.readouterr().out


def test_recover_refuses_a_malformed_uri_with_the_argument_and_what_it_takes(tmp_path, capsys):
    """`recover http://127.0.0.1:notaport` printed urllib's ValueError traceback and exited 1, the code
    of "something kept"; a sqlite URI of a directory and a file store that does not exist said
    "nothing to deliver", exit 0, where the same paths given bare are refused (exit 2)."""
    for uri, why in [
        ("http://127.0.0.1:notaport", "its port 'notaport' is not a number in 1..65535"),
        ("http://[::1", "its host has a '[' with no ']'"),
        ("https://u:p@h:99999/", "its port '99999' is not a number in 1..65535"),
    ]:
        assert main(["recover", uri]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "Expected SOURCE to be an MLflow tracking URI" in err and why in err, err
        assert "http(s)://HOST[:PORT]" in err and ":p@" not in err  # the allowed forms; no password
    (tmp_path / "adir").mkdir()
    assert main(["recover", f"sqlite:///{tmp_path / 'adir'}"]) == 2
    err = capsys.readouterr().err
    assert "names a directory" in err and str(tmp_path / "adir") in err and "sqlite:///PATH" in err
    (tmp_path / "notadb.txt").write_text("hello")
    assert main(["recover", f"sqlite:///{tmp_path / 'notadb.txt'}"]) == 2
    assert "a file that is not a sqlite database" in capsys.readouterr().err
    assert main(["recover", f"file://{tmp_path / 'nonexistent' / 'mlruns'}"]) == 2
    err = capsys.readouterr().err
    assert "no MLflow store at" in err and str(tmp_path / "nonexistent" / "mlruns") in err, err


def test_mlflow_tracker_refuses_a_tracking_uri_with_a_bad_port():
    """MLflowTracker(tracking_uri="http://127.0.0.1:50O0") (a letter O) was taken; the hub then raised
    urllib's "Port could not be cast to integer value", naming neither tracking_uri nor what it takes."""
    from hdet_track.tracking.mlflow import MLflowTracker

    with pytest.raises(ValueError, match=r"Expected tracking_uri to be an MLflow tracking URI") as err:
        MLflowTracker(tracking_uri="http://127.0.0.1:50O0")
    assert "'http://127.0.0.1:50O0'" in str(err.value) and "port '50O0' is not a number in 1..65535" in str(err.value)
    MLflowTracker(tracking_uri="http://127.0.0.1:5000")  # a good one is taken
    MLflowTracker(tracking_uri="databricks://profile:prefix")  # a Databricks profile and secret prefix: no port


def test_demo_s_own_argument_errors_use_the_demo_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--quick", "--steps", "10"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith("usage: hdet-track demo ")
    assert "hdet-track demo: error: --steps (10) must be at least --sync-every (25)" in err


def test_progress_lines_show_4_significant_digits(capsys, monkeypatch):
    import time

    from hdet_track.examples.ablation import _progress

    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    _progress("baseline-high", 25, 50, [8851980754964.426, 2.302585, float("nan")], 1.23456e20, time.monotonic())
    line = capsys.readouterr().out
    assert "replica losses 8.852e+12 2.303 nan | val 1.235e+20 |" in line, line
    assert "8851980754964" not in line


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return fields[0], int(fields[1])


def _children(pid: int) -> list[int]:
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and (_proc_stat(int(p.name)) or ("", 0))[1] == pid
    ]


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie no one reaps is gone too


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the Streamlit child through /proc")
@pytest.mark.parametrize("store", ["missing", "not ready"])
def test_dashboard_sigterm_stops_streamlit_and_frees_the_port(tmp_path, store):
    """SIGTERM to `hdet-track dashboard` stops its `streamlit run` child too: the next launch on the
    same port works (it used to find "Address already in use"). Started before any job has created
    its store, or while one is (its schema not yet this MLflow's), it serves and waits, and creates
    or changes nothing (the second used to exit 2 with a message saying the page waits)."""
    import hashlib
    import signal
    import socket
    import time

    uri = f"sqlite:///{tmp_path / 'dash.db'}"  # no store yet: the job that creates it comes later
    if store == "not ready":
        older_schema_store(uri)
    before = hashlib.sha256((tmp_path / "dash.db").read_bytes()).hexdigest() if store == "not ready" else None
    port = _free_port()
    cli = subprocess.Popen(
        [sys.executable, "-m", "hdet_track.cli", "dashboard", uri, "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env=_env_without_tracking(),
    )
    children: list[int] = []

    def answers() -> bool:
        with socket.socket() as s:
            s.settimeout(1.0)
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        deadline = time.monotonic() + 180
        while not answers():
            assert cli.poll() is None, cli.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the dashboard never answered"
            time.sleep(0.5)
        children = _children(cli.pid)
        assert children, "expected a streamlit child process"
        if before is None:
            assert not (tmp_path / "dash.db").exists()  # waiting for the store, never creating it
        else:
            assert hashlib.sha256((tmp_path / "dash.db").read_bytes()).hexdigest() == before
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(timeout=20) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 5
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(c) for c in children), "streamlit outlived the CLI"
        assert not answers()
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free for the next launch
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        for child in children:
            if _alive(child):
                os.kill(child, signal.SIGKILL)


def test_wandb_demo_logs_offline_without_wandb_mode_and_prints_compare_s_table(tmp_path, capsys):
    """`demo --tracker wandb` with no WANDB_MODE and no login: the runs are written offline (not ~30 s
    per run waiting for a server), and the demo's summary is compare's table of the runs read back
    from the W&B directory, so "diverged" means what it means in `hdet-track compare`. Its dashboard
    hint named the working directory ('.'), where bin/demo leaves ./mlflow.db: the dashboard and
    compare read that MLflow store instead of the W&B runs; it names the wandb folder."""
    import shlex

    from hdet_track.compare import comparison_rows, format_rows
    from hdet_track.readers import resolve_source
    from hdet_track.readers.wandb import WandbReader

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")  # an earlier `bash bin/demo`'s store
    client.create_run(client.create_experiment("hdet"), run_name="mlflow-run", tags={"hdet.compare_group": "m"})
    env = _env_without_tracking()  # no WANDB_MODE, WANDB_API_KEY or WANDB_DIR
    env["WANDB_SILENT"] = "true"
    env["HDET_FULL_ROWS"] = "20"  # the demo's table read these runs as bucket means, where compare reads every row
    proc = _cli(
        ["demo", "--quick", "--replicas", "2", "--steps", "50", "--tracker", "wandb", "--group", "wb-test"],
        tmp_path,
        env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "max_lr 1, runs: baseline-high, hdet" in proc.stdout
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2
    reader = WandbReader(tmp_path)
    summaries = reader.list_runs(compare_group="wb-test")
    runs = [reader.read(s.run_id, max_rows=sys.maxsize) for s in reversed(summaries)]  # oldest first, as run
    assert [r.name for r in runs] == ["baseline-high", "hdet"]
    assert all(r.status in ("FINISHED", "FAILED") for r in runs)
    expected = format_rows(comparison_rows(runs), "table")
    assert expected in proc.stdout
    rows = comparison_rows(runs)
    assert all(r.val_accuracy == r.val_accuracy for r in rows)  # read back: not NaN
    hint = proc.stdout.strip().splitlines()[-1]
    assert hint.startswith("Open the dashboard:") and "hdet-track dashboard" in hint, hint
    source = shlex.split(hint.split(":", 1)[1])[-1]
    assert source == "wandb" and resolve_source(source) == source  # the W&B folder, not ./mlflow.db
    assert main(["compare", "--tracking-uri", source, "--format", "json"]) == 0, capsys.readouterr().err
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["baseline-high", "hdet"]


def test_compare_reads_a_directory_holding_mlflow_db_or_the_bare_file(demo_store, tmp_path, capsys):
    """A directory holding ``mlflow.db`` (what the dashboard accepts) and the bare sqlite file read
    as that store's ``sqlite:///`` URI; before, the directory went to MLflow as a file-store path."""
    import shutil

    uri, _, _, root = demo_store
    shutil.copy(root / "demo.db", tmp_path / "mlflow.db")
    assert main(["compare", "--tracking-uri", uri, "--format", "json"]) == 0
    expected = [(r["name"], r["final_train_loss"]) for r in json.loads(capsys.readouterr().out)]
    for source in (tmp_path, tmp_path / "mlflow.db"):
        assert main(["compare", "--tracking-uri", str(source), "--format", "json"]) == 0, capsys.readouterr().err
        assert [(r["name"], r["final_train_loss"]) for r in json.loads(capsys.readouterr().out)] == expected


def test_compare_on_a_file_that_is_not_a_store_is_a_one_line_error_and_leaves_it_alone(tmp_path, capsys):
    """No traceback, the value and what is allowed named, and the file not turned into a store."""
    bad = tmp_path / "notes.txt"
    bad.write_text("not a database")
    assert main(["compare", "--tracking-uri", str(bad)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(bad) in err and "not a sqlite database" in err and "sqlite:///PATH" in err
    assert bad.read_text() == "not a database"
    assert main(["dashboard", str(bad), "--port", str(_free_port())]) == 2
    assert "not a sqlite database" in capsys.readouterr().err


WANDB_RUN = """
import sys, torch
from hdet_track import HDETScheduler
from hdet_track.tracking.wandb import WandbTracker
opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
track = WandbTracker(project="hdet", dir=sys.argv[1], mode="offline", run_name="wb")
with HDETScheduler(opt, 0.1, total_steps=10, spread=0.0, sync_every=5, track=track) as sched:
    for k in range(1, 11):
        opt.step()
        sched.step(1.0 / k)
    sched.log_metrics({"val_loss": 0.25})
"""


def test_compare_reads_a_wandb_directory(tmp_path, capsys):
    """``compare --tracking-uri DIR`` on a W&B directory: the same rows as for MLflow (project =
    experiment); a run that did not end cleanly is marked in the table."""
    from hdet_track.compare import ComparisonRow, format_rows

    (tmp_path / "job.py").write_text(WANDB_RUN)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "job.py"), str(tmp_path / "wb")],
        env=dict(os.environ, WANDB_SILENT="true"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["compare", "--tracking-uri", str(tmp_path / "wb"), "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["name"], row["status"], row["final_val_loss"]) == ("wb", "FINISHED", 0.25)
    assert row["final_train_loss"] == pytest.approx(0.1)
    killed = ComparisonRow(**(row | {"status": "KILLED"}))
    assert format_rows([killed]).splitlines()[-1].startswith("wb (KILLED)")


def test_compare_reads_a_wandb_project_and_says_where_it_looked(tmp_path, capsys, monkeypatch):
    """On a W&B directory the experiment is the W&B project: $WANDB_PROJECT was ignored (compare
    looked for 'hdet'). An empty directory says it was read as a W&B directory."""
    (tmp_path / "job.py").write_text(WANDB_RUN.replace('project="hdet"', 'project="proj2"'))
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "job.py"), str(tmp_path / "wb")],
        env=dict(os.environ, WANDB_SILENT="true"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("WANDB_PROJECT", "proj2")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "other")
    assert main(["compare", "--tracking-uri", str(tmp_path / "wb"), "--format", "json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["wb"]
    (tmp_path / "empty").mkdir()
    assert main(["compare", "--tracking-uri", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    # the directory holds no run at all: the argument at fault is --tracking-uri, not --experiment
    assert f"--tracking-uri {str(tmp_path / 'empty')!r}: no runs" in err, err
    assert "read as a W&B directory: it holds no mlflow.db" in err and "--experiment" not in err
    # a project that is not there: the argument, and the projects that are
    assert main(["compare", "--tracking-uri", str(tmp_path / "wb"), "--experiment", "nope"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--experiment 'nope': no runs in W&B project 'nope'" in err
    assert "expected one of the W&B projects with runs: 'proj2'" in err, err


def test_compare_and_recover_ignore_the_dashboards_source_variable(demo_store, tmp_path, capsys, monkeypatch):
    """$HDET_DASHBOARD_SOURCE (the dashboard's) overrode $MLFLOW_TRACKING_URI for compare and recover,
    whose --help name only the latter."""
    uri, _, _, root = demo_store
    (tmp_path / "wb").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("HDET_DASHBOARD_SOURCE", str(tmp_path / "wb"))
    assert main(["compare", "--format", "json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["baseline-high", "hdet"]
    assert main(["recover"]) == 0
    assert str(root / ".hdet-spill") in capsys.readouterr().out


def test_compare_of_a_run_read_as_an_overview_gives_its_own_numbers(demo_store, capsys, monkeypatch):
    """A run with more rows than $HDET_FULL_ROWS is read as an overview (bucket means): compare used
    those for the final loss, the divergence and the highest stable LR."""
    uri, _, _, _ = demo_store
    assert main(["compare", "--tracking-uri", uri, "--format", "json"]) == 0
    full = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("HDET_FULL_ROWS", "20")
    assert main(["compare", "--tracking-uri", uri, "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == full


def test_compare_finds_a_group_among_more_runs_than_one_page(tmp_path, capsys):
    """compare --group listed the newest 1000 runs and looked for the group among them; a group with
    a quote in its name made MLflow's filter fail."""
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'many.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("hdet")
    client.create_run(exp, run_name="old", tags={"hdet.compare_group": "it's old"}, start_time=1000)
    for k in range(1000):
        client.create_run(exp, run_name=f"new{k}", tags={"hdet.compare_group": "new"}, start_time=2000 + k)
    (found,) = MLflowReader(uri).list_runs("hdet", compare_group="it's old", limit=None)
    assert found.name == "old"
    assert len(MLflowReader(uri).list_runs("hdet", limit=None)) == 1001
    assert len(MLflowReader(uri).list_runs("hdet")) == 1000


def test_markdown_escapes_a_pipe_and_a_last_val_loss_that_is_not_finite_is_shown_as_such():
    from hdet_track.compare import ComparisonRow, _last, format_rows

    row = ComparisonRow(
        run_id="r", name="a|b", schedule="hdet", world_size=2, status="FINISHED", mean_lr=0.1,
        final_train_loss=0.5, best_train_loss=0.4, highest_stable_lr=0.2, best_val_loss=0.4,
        final_val_loss=float("nan"), val_accuracy=0.9, diverged=False, diverged_at_step=None,
    )  # fmt: skip
    assert format_rows([row], "markdown").splitlines()[-1].count(" | ") == 7
    assert "a\\|b" in format_rows([row], "markdown")

    class Run:
        metrics = {"val_loss": (np.array([1, 2, 3]), np.array([0.5, 0.4, np.nan]))}

    assert math.isnan(_last(Run(), "val_loss"))  # not the 0.4 before it


def test_the_demos_hint_for_a_server_is_its_page_not_a_command_that_fails():
    from hdet_track.cli import closing_hints

    (_, ui) = closing_hints("http://127.0.0.1:5000", "mlflow")
    assert ui.endswith("http://127.0.0.1:5000 (the server's own page)") and "backend-store-uri" not in ui
    (_, ui) = closing_hints("sqlite:///mlflow.db", "mlflow")
    assert "ui --backend-store-uri sqlite:///mlflow.db" in ui


def test_recover_takes_a_bare_sqlite_file_as_its_store(tmp_path, capsys):
    """recover /path/mlflow.db looked for spills in /path/mlflow.db/.hdet-spill."""
    import sqlite3

    sqlite3.connect(tmp_path / "mlflow.db").close()
    (tmp_path / "mlflow.db").write_bytes(b"SQLite format 3\x00" + bytes(84))
    assert main(["recover", str(tmp_path / "mlflow.db")]) == 0
    assert f"looked in {tmp_path / '.hdet-spill'}" in capsys.readouterr().out


def test_recover_on_a_project_directory_looks_in_both_stores_spills(demo_store, tmp_path, capsys):
    """A directory holding mlflow.db and a W&B directory: recover looks beside the store and in
    wandb/.hdet-spill (resolving the directory to its sqlite URI dropped the second)."""
    import shutil

    _, _, _, root = demo_store
    shutil.copy(root / "demo.db", tmp_path / "mlflow.db")
    assert main(["recover", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / ".hdet-spill") in out and str(tmp_path / "wandb" / ".hdet-spill") in out


def test_dashboard_on_an_address_of_no_machine_names_host(capsys):
    assert main(["dashboard", "--host", "999.1.1.1", "--port", str(_free_port())]) == 2
    err = capsys.readouterr().err
    assert "999.1.1.1" in err and "--host" in err and "--port" not in err


@pytest.mark.parametrize("content", ["empty", "foreign"])
def test_compare_and_dashboard_leave_a_sqlite_file_that_is_not_a_store_alone(tmp_path, capsys, content):
    """An empty file or another application's sqlite database named as the store: a one-line error,
    and the file unchanged (MLflow's client would have written its ~60 tables into it)."""
    import sqlite3

    db = tmp_path / "other.db"
    if content == "foreign":
        with sqlite3.connect(db) as con:
            con.execute("CREATE TABLE users (id INTEGER)")
    else:
        db.touch()
    before = db.read_bytes()
    uri = f"sqlite:///{db}"
    assert main(["compare", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err
    assert uri in err and ("empty" if content == "empty" else "another sqlite database") in err, err
    assert main(["compare", "--tracking-uri", str(db)]) == 2
    assert main(["dashboard", uri, "--port", str(_free_port())]) == 2
    assert uri in capsys.readouterr().err
    assert db.read_bytes() == before


# ---------------------------------------------------------------------- a worker that dies, W&B hints


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_demo_goes_on_when_a_worker_dies_and_says_which(tmp_path, tracker):
    """Rank 1 of the first run SIGKILLed (the OOM killer, a lost node; through the worker's test hook):
    the demo dumped torch's ChildFailedError traceback, exited 1, skipped the other runs and printed no
    table. Now it says which run and rank died and how in one line, runs the rest, prints the table of
    what was logged (the dead run marked as the readers see it) and exits 1."""
    import re

    from hdet_track.examples.ablation import TEST_KILL_ENV

    env = _env_without_tracking()
    env[TEST_KILL_ENV] = "baseline-high:1:30"
    if tracker == "mlflow":
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'demo.db'}"
    else:  # W&B writes its runs into $WANDB_DIR/wandb
        env.update(WANDB_SILENT="true", WANDB_DIR=str(tmp_path / "runs"))
        (tmp_path / "runs").mkdir()
    argv = ["demo", "--quick", "--replicas", "2", "--steps", "50", "--tracker", tracker, "--group", "dies"]
    proc = _cli(argv, tmp_path, env)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "ChildFailedError" not in proc.stderr and "cli.py" not in proc.stderr, proc.stderr[-3000:]
    (said,) = [line for line in proc.stderr.splitlines() if line.startswith("hdet-track demo: run ")]
    # the launcher reports the first failure it sees: the killed rank (or, rarely, its peer's error)
    assert re.fullmatch(
        r"hdet-track demo: run baseline-high failed: rank (1 was killed by SIGKILL \(exit code -9\)"
        r"|0 exited with code 1.*); going on with the other runs",
        said,
    ), said
    table = proc.stdout.split("\nrun ", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    assert [row.split("  ")[0] for row in table][1:] == ["hdet"]  # the run after it ran, and ended well
    assert re.match(r"baseline-high \((KILLED|FAILED)\) ", table[0]), table
    hint = proc.stdout.strip().splitlines()[-1 if tracker == "wandb" else -2]
    expected = str(tmp_path / "runs" / "wandb") if tracker == "wandb" else env["MLFLOW_TRACKING_URI"]
    assert hint.startswith("Open the dashboard:") and hint.endswith(f" dashboard {expected}"), hint


def test_a_wandb_demo_run_that_died_unlogged_is_not_an_earlier_demos_run_of_its_name(tmp_path, capsys):
    """A W&B demo's run whose processes failed is looked up by its name in the demo's group. In a
    reused ``--group``, a run that died before W&B created its run was shown as an earlier demo's run
    of the same name; only runs started since this demo began count."""
    import time

    import torch

    from hdet_track import HDETScheduler
    from hdet_track.cli import _wandb_table

    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with HDETScheduler(
        opt, 0.1, total_steps=10, sync_every=5, track="wandb", run_name="baseline-high", compare_group="reused"
    ) as sched:
        for k in range(1, 11):
            opt.step()
            sched.step(1.0 / k)
    runs_dir = str(tmp_path / "wandb-root" / "wandb")
    failed = [{"name": "baseline-high", "failed": True}]
    assert _wandb_table(runs_dir, failed, "reused", since=0.0) == 0  # a demo that began before it: its run
    assert capsys.readouterr().out.splitlines()[2].startswith("baseline-high ")
    assert _wandb_table(runs_dir, failed, "reused", since=time.time()) == 0
    assert capsys.readouterr().out == ""  # nothing of this demo's to show


# ---------------------------------------------------------------------- compare: what it could not find


def _attached_run(uri: str, experiment: str | None, name: str, group: str) -> str:
    """A run created by its owner (Hugging Face's or Lightning's MLflow logger: experiment "Default"
    when none is named) that HDET attaches to with a compare group."""
    import torch

    from hdet_track import HDETScheduler
    from hdet_track.tracking.mlflow import MLflowTracker

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment or "Default")
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    run_id = client.create_run(exp_id, run_name=name).info.run_id
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    track = MLflowTracker(tracking_uri=uri, run_id=run_id)
    with HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, compare_group=group, track=track) as sched:
        for k in range(1, 11):
            opt.step()
            sched.step(1.0 / k)
    client.set_terminated(run_id, "FINISHED")
    return run_id


@pytest.fixture(scope="module")
def groups_store(tmp_path_factory):
    """Experiment hdet with group "demo-1", "Default" with an attached run of group "hf-run", and a bare
    MLflow run (no hdet.* tag) in experiment "bare"."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('groups') / 'mlflow.db'}"
    _attached_run(uri, "hdet", "demo-run", "demo-1")
    _attached_run(uri, None, "hf", "hf-run")
    client = MlflowClient(uri)
    bare = client.create_run(client.create_experiment("bare"), run_name="bare").info.run_id
    for step in range(1, 6):
        client.log_metric(bare, "loss", 1.0 / step, step=step)
    client.set_terminated(bare, "FINISHED")
    return uri


def test_compare_names_an_unknown_experiment_and_lists_those_there(groups_store, capsys):
    """It said "Expected an experiment named 'nope' at ..., but there is none": not which argument,
    nor which experiments there are."""
    assert main(["compare", "--tracking-uri", groups_store, "--experiment", "nope"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--experiment 'nope'" in err and groups_store in err
    assert "expected one of 'Default', 'bare', 'hdet'" in err, err


def test_compare_finds_a_group_in_any_experiment_unless_one_is_named(groups_store, capsys):
    """--group without --experiment looked only in the default experiment: an attached run (in
    "Default") was not found. A group that is nowhere lists the groups there are."""
    assert main(["compare", "--tracking-uri", groups_store, "--group", "hf-run", "--format", "json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["hf"]
    assert main(["compare", "--tracking-uri", groups_store, "--group", "nope"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--group 'nope'" in err and "any other experiment" in err
    assert "expected one of 'demo-1', 'hf-run'" in err, err
    # --experiment named: that experiment only, and its groups
    assert main(["compare", "--tracking-uri", groups_store, "--experiment", "hdet", "--group", "hf-run"]) == 2
    err = capsys.readouterr().err
    assert "--group 'hf-run'" in err and "experiment 'hdet'" in err and "any other" not in err
    assert "expected one of 'demo-1'" in err and "'hf-run'" not in err.split("expected", 1)[1], err


def test_a_group_in_two_experiments_is_compared_whole_and_attaching_makes_no_experiment(tmp_path, capsys):
    """A group with a run in "hdet" and one HDET attached to in "Default" (Hugging Face's) listed
    only the first, without a word; and attaching to a run made an empty "hdet" experiment."""
    uri = f"sqlite:///{tmp_path / 'two.db'}"
    _attached_run(uri, None, "hf", "g1")
    assert [e.name for e in MlflowClient(uri).search_experiments()] == ["Default"]  # none of HDET's made
    _attached_run(uri, "hdet", "mine", "g1")
    for extra in (["--group", "g1"], []):  # named, or the newest run's group
        assert main(["compare", "--tracking-uri", uri, *extra, "--format", "json"]) == 0
        assert sorted(r["name"] for r in json.loads(capsys.readouterr().out)) == ["hf", "mine"]
    assert main(["compare", "--tracking-uri", uri, "--experiment", "hdet", "--group", "g1", "--format", "json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["mine"]  # a named experiment only


def test_a_loss_that_starts_at_zero_or_below_diverges_only_when_it_is_not_finite():
    """The first loss was clamped to 1e-12: a loss of 0 then 0.5 "diverged" at its second step."""
    from hdet_track.compare import diverged_at

    steps = np.arange(1, 5)
    assert diverged_at(steps, np.array([0.0, 0.5, 0.4, 0.3])) is None
    assert diverged_at(steps, np.array([-0.5, -0.3, -0.1, 0.05])) is None
    assert diverged_at(steps, np.array([-0.5, -0.3, np.inf, 0.05])) == 3
    assert diverged_at(steps, np.array([1.0, 5.0, 10.5, 2.0])) == 3  # above 10x a positive first loss


def test_compare_labels_a_run_without_a_schedule_tag_plain(groups_store, capsys):
    """A bare MLflow run (no hdet.schedule) was "onecycle" in compare's table, "plain" on the
    dashboard's Runs page: one label, "plain"."""
    assert main(["compare", "--tracking-uri", groups_store, "--experiment", "bare", "--format", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["name"], row["schedule"]) == ("bare", "plain")


# ---------------------------------------------------------------------- a URI of no store


def test_recover_and_dashboard_refuse_a_uri_of_no_store(tmp_path, capsys):
    """`recover foo://bar` exited 0 having "looked in foo:/bar/.hdet-spill"; `dashboard foo://bar`
    started its server on a source compare refuses. Both: exit 2, the value and what is allowed."""
    assert main(["recover", "foo://bar"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "SOURCE 'foo://bar'" in err and "'foo://'" in err, err
    assert "sqlite:///PATH" in err and "http(s)://HOST:PORT" in err and ".hdet-spill directory" in err
    proc = _cli(["dashboard", "foo://bar", "--port", str(_free_port())], tmp_path, _env_without_tracking(), 60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert "SOURCE 'foo://bar'" in proc.stderr and "sqlite:///PATH" in proc.stderr
    assert main(["compare", "--tracking-uri", "foo://bar"]) == 2
    capsys.readouterr()
    # a server's URI with no usable port: refused before a server starts, as recover refuses it
    proc = _cli(
        ["dashboard", "http://127.0.0.1:notaport", "--port", str(_free_port())], tmp_path, _env_without_tracking(), 60
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert "Expected SOURCE to be an MLflow tracking URI" in proc.stderr and "'notaport'" in proc.stderr
    # a store of MLflow's with no path of its own: its spills in the cache, named without credentials
    assert main(["recover", "postgresql+psycopg2://me:secret@db.example:5432/runs"]) == 0
    out = capsys.readouterr().out
    looked = out.split("(looked in ", 1)[1]
    assert "nothing to deliver" in out and looked.startswith(str(tmp_path / "cache")) and "secret" not in looked
    # Databricks' default profile is the URI "databricks", not a folder of that name here
    assert main(["recover", "databricks"]) == 0
    assert capsys.readouterr().out.split("(looked in ", 1)[1].startswith(str(tmp_path / "cache" / "hdet-track"))
    assert list(tmp_path.iterdir()) == [tmp_path / "wandb-root"]  # nothing created in the working directory


def test_ctrl_c_stops_the_demo_with_one_line_and_ends_its_run_killed(tmp_path):
    """Ctrl-C during `demo` printed torch's SignalException traceback, and the run in progress ended
    FAILED ("ended at step N without closing the run"): torch's spawn wrapper swallows the workers'
    KeyboardInterrupt."""
    import signal
    import time

    exe = str(Path(sys.executable).with_name("hdet-track"))
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'int.db'}", OMP_NUM_THREADS="1")
    cmd = [exe, "demo", "--quick", "--replicas", "2", "--steps", "20000", "--sync-every", "25", "--group", "int"]

    def sigint_default():  # a CI runner's background job inherits SIGINT ignored; a terminal's job does not
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True, preexec_fn=sigint_default)  # fmt: skip
    try:
        for line in proc.stdout:
            if "[  baseline-high]" in line and "100/20000" in line:
                break
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the job
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "hdet-track demo: stopped by SIGINT" in err and "SignalException" not in err, err[-3000:]
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    # KILLED, not FAILED; the error names SIGINT, or, where torch's launcher killed the worker on its
    # way out (it escalates to SIGKILL), the tracker process's word that its training process vanished
    error = run.data.tags["hdet.error"]
    assert run.info.status == "KILLED" and ("interrupted by SIGINT" in error or "vanished" in error), error


def test_demo_refuses_up_front_what_it_could_not_finish(tmp_path, monkeypatch, capsys):
    """Found by an audit: a seed too large for torch failed with a traceback; WANDB_MODE=disabled
    trained every run and then could not read them back (exit 2, hints to a folder that was never
    written); an MLflow file store trained into the spill. Each is now a one-line error before any run."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--quick", "--seed", str(2**64)])
    assert exit_.value.code == 2 and "--seed: expected an integer in [0, 2**63)" in capsys.readouterr().err
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert main(["demo", "--quick", "--tracker", "wandb"]) == 2
    assert "WANDB_MODE=disabled writes no W&B run" in capsys.readouterr().err
    for uri in ("mlruns", "file:./mlruns"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert main(["demo", "--quick"]) == 2
        err = capsys.readouterr().err
        assert f"MLFLOW_TRACKING_URI={uri!r} is an MLflow file store" in err and len(err.strip().splitlines()) == 1
    assert list(work.iterdir()) == []  # no run, no store


def test_argument_mistakes_an_audit_found_are_named(tmp_path, monkeypatch, capsys):
    """compare on an unknown URI scheme printed MLflow's model-registry error; --data-dir and
    --text-file were silently ignored with another dataset; a Fashion-MNIST --data-dir that is not
    a directory was not named; a dashboard SOURCE from the environment was not said to be one."""
    assert main(["compare", "--tracking-uri", "foo://bar"]) == 2
    err = capsys.readouterr().err
    assert "--tracking-uri 'foo://bar' has the URI scheme 'foo://'" in err and "registry" not in err
    for argv in (["--data-dir", str(tmp_path)], ["--text-file", str(tmp_path / "t.txt")]):
        with pytest.raises(SystemExit) as exit_:
            main(["demo", "--quick", "--dataset", "digits", *argv])
        assert exit_.value.code == 2 and f"{argv[0]} {argv[1]!r} is for --dataset" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")
    assert main(["demo", "--quick", "--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "afile")]) == 2
    assert f"--data-dir {str(tmp_path / 'afile')!r} is not a directory" in capsys.readouterr().err
    monkeypatch.setenv("HDET_DASHBOARD_SOURCE", str(tmp_path / "nonexistent"))
    assert main(["dashboard"]) == 2
    assert "from $HDET_DASHBOARD_SOURCE or $MLFLOW_TRACKING_URI" in capsys.readouterr().err


def test_compare_shows_an_infinite_value_as_inf_and_a_missing_one_as_a_dash():
    """An infinite validation loss (a diverged run) showed as "-", as a value never logged does."""
    from hdet_track.compare import comparison_rows, format_rows
    from hdet_track.readers.base import HDETRun

    run = HDETRun("r1", name="blown")
    run.metrics["val_loss"] = (np.array([1, 2]), np.array([0.5, math.inf]))
    table = format_rows(comparison_rows([run]), "table")
    header, _, row = table.splitlines()[:3]
    at = header.index("final val loss")
    assert row[at:].split()[0] == "inf", table
    at = header.index("mean LR")
    assert row[at:].split()[0] == "-", table  # never logged


def test_cli_mistakes_a_second_audit_found_are_named(tmp_path, monkeypatch, capsys):
    """An empty --group turned compare's group filter off (every run of every experiment); an
    empty --experiment or --tracking-uri fell back to the default; `demo --quick --low-lr` ignored
    --low-lr; a WANDB_MODE typo started every run and failed in each worker; a WANDB_DIR that does
    not exist was blamed on WANDB_DIR being unset; an empty W&B directory blamed --experiment."""
    for flag in ("--group", "--experiment", "--tracking-uri"):
        with pytest.raises(SystemExit) as exit_:
            main(["compare", flag, ""])
        assert exit_.value.code == 2
        assert f"argument {flag}: expected a non-empty value" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--quick", "--low-lr", "0.01"])
    assert exit_.value.code == 2 and "--low-lr 0.01 is for the full demo" in capsys.readouterr().err
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("WANDB_MODE", "offlne")
    assert main(["demo", "--quick", "--tracker", "wandb"]) == 2
    err = capsys.readouterr().err
    assert "WANDB_MODE='offlne' is no W&B mode" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "absent"))
    assert main(["demo", "--quick", "--tracker", "wandb"]) == 2
    assert f"WANDB_DIR={str(tmp_path / 'absent')!r} is not a directory" in capsys.readouterr().err
    assert list(work.iterdir()) == []  # nothing ran


def test_compare_sees_past_a_thousand_experiments_and_a_group_with_both_quotes(tmp_path, capsys):
    """MLflow returns at most 1,000 experiments a call: compare said an experiment past them did
    not exist. A compare group holding both kinds of quote (which HDET takes and tags) failed
    compare with an error about an argument nobody passed."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    quoted = 'it\'s "gold"'
    _attached_run(uri, "hdet", "first", quoted)
    client = MlflowClient(uri)
    for i in range(1001):
        client.create_experiment(f"x{i:04d}")
    late = _attached_run(uri, "zz-last", "late", "late-group")
    assert main(["compare", "--tracking-uri", uri, "--experiment", "zz-last", "--format", "json"]) == 0
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == [late]
    assert main(["compare", "--tracking-uri", uri, "--group", quoted, "--format", "json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["first"]


def test_compare_shows_the_runs_it_can_read_when_one_cannot_be_read(demo_store, capsys, monkeypatch):
    """A run that failed to read (a damaged chunk raising a non-reader error) dropped the whole
    table and blamed --tracking-uri; the other runs' rows now come, and the run is named."""
    from hdet_track.readers.mlflow import MLflowReader

    uri = demo_store[0]
    real = MLflowReader.read
    broken = MLflowReader(uri).list_runs("hdet")[0].run_id

    def read(self, run_id, *args, **kwargs):  # a fault injected into one run's read
        if run_id == broken:
            raise TypeError("a damaged chunk")
        return real(self, run_id, *args, **kwargs)

    monkeypatch.setattr(MLflowReader, "read", read)
    assert main(["compare", "--tracking-uri", uri, "--format", "json"]) == 2
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert rows and broken not in [r["run_id"] for r in rows]
    assert "cannot read run" in err and f"({broken}): TypeError: a damaged chunk" in err
    assert "--tracking-uri" not in err


def test_compare_into_a_closed_pipe_ends_without_a_traceback(demo_store, capsys, monkeypatch):
    """`hdet-track compare ... | head -1`: the reader closed the pipe, and compare died with a
    BrokenPipeError traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed = open(write_end, "w", buffering=1)  # noqa: SIM115
    monkeypatch.setattr(sys, "stdout", closed)
    assert main(["compare", "--tracking-uri", demo_store[0], "--format", "json"]) == 1
    closed.write("x" * 100)  # its descriptor now goes to /dev/null: Python's flush at exit does not fail
    closed.flush()
    monkeypatch.undo()
    closed.close()
    assert "Traceback" not in capsys.readouterr().err


def test_dashboard_takes_an_ipv6_address(capsys):
    """--host ::1 was refused as "an address of no machine": the check bound an IPv4 socket."""
    import socket

    try:
        taken = socket.socket(socket.AF_INET6)
        taken.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with taken:
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["dashboard", "--host", "::1", "--port", str(port)]) == 2  # in use: before Streamlit starts
    err = capsys.readouterr().err
    assert f"cannot listen on ::1:{port}" in err and "pick another --port" in err and "--host must" not in err


@pytest.mark.parametrize("source", ["", "  "])
def test_recover_refuses_an_empty_source_not_taken_for_the_default(source, demo_store, capsys, monkeypatch):
    """`recover "$STORE"` with the variable unset went to the default store (here one with runs) as if
    no store were given (compare's --tracking-uri refused it already); now an error naming SOURCE, exit 2."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", demo_store)
    assert main(["recover", source]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "SOURCE is empty" in err and "sqlite:///PATH" in err, err


def test_dashboard_refuses_an_empty_source(tmp_path):
    proc = _cli(["dashboard", "", "--port", str(_free_port())], tmp_path, _env_without_tracking(), 60)
    assert proc.returncode == 2 and proc.stdout == "" and "SOURCE is empty ('')" in proc.stderr, proc.stderr

"""The demo's closing commands run as printed: in a fresh clone after `bash bin/demo` nothing is on PATH."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hdet_track.cli import closing_hints

SCRIPTS = Path(sysconfig.get_path("scripts"))
INSTALLED = shutil.which("hdet-track", path=str(SCRIPTS)) is not None  # bin/setup installs the project


def _path_without_scripts() -> str:
    keep = []
    for d in os.environ.get("PATH", "").split(os.pathsep):
        try:
            if d and not os.path.samefile(d, SCRIPTS):
                keep.append(d)
        except OSError:
            keep.append(d)
    return os.pathsep.join(keep)


@pytest.mark.parametrize("where", ["clone", "elsewhere", "activated"])
def test_closing_hints_run_as_printed(where, tmp_path, monkeypatch):
    """clone: the working directory holds the environment (`.venv/bin/...` relative); elsewhere: absolute
    paths; activated: the scripts folder is on PATH, so the bare names."""
    path = _path_without_scripts()
    if where == "activated":
        path = os.pathsep.join([str(SCRIPTS), path])
    cwd = Path(sys.prefix).parent if where == "clone" else tmp_path
    monkeypatch.setenv("PATH", path)
    monkeypatch.chdir(cwd)
    lines = closing_hints("sqlite:///mlflow.db", "mlflow")
    assert [line.split(":", 1)[0] for line in lines] == ["Open the dashboard", "Open MLflow's UI"]
    for line, sub in zip(lines, ["dashboard", "ui"]):
        argv = shlex.split(line.split(":", 1)[1])
        head = argv[: argv.index(sub)]
        exe = head[0]
        if os.sep in exe:
            assert os.access(cwd / exe, os.X_OK), line  # relative to the working directory, or absolute
        else:
            assert shutil.which(exe, path=path), line
        if INSTALLED:
            expected = {"clone": not os.path.isabs(exe) and os.sep in exe, "elsewhere": os.path.isabs(exe)}
            assert expected.get(where, exe in ("hdet-track", "mlflow")), line
        proc = subprocess.run(
            [*head, sub, "--help"],
            cwd=cwd,
            env=dict(os.environ, PATH=path),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "usage" in proc.stdout.lower() and sub in proc.stdout, proc.stdout[:500]


def test_wandb_hint_has_only_the_dashboard(monkeypatch):
    monkeypatch.setenv("PATH", _path_without_scripts())
    (line,) = closing_hints("./my runs", "wandb")
    assert line.startswith("Open the dashboard:  ") and line.endswith(" dashboard './my runs'")


def test_without_the_console_scripts_the_hint_runs_the_module(tmp_path, monkeypatch):
    """A tree used through PYTHONPATH, not installed: `python -m hdet_track.cli` with this interpreter."""
    import sysconfig as sc

    monkeypatch.setattr(sc, "get_path", lambda name, *a, **k: str(tmp_path / "no-scripts"))
    path = _path_without_scripts()
    monkeypatch.setenv("PATH", path)
    line = closing_hints("sqlite:///mlflow.db", "mlflow")[0]
    argv = shlex.split(line.split(":", 1)[1])
    assert argv[1:] == ["-m", "hdet_track.cli", "dashboard", "sqlite:///mlflow.db"]
    assert os.path.samefile(argv[0], sys.executable)
    env = dict(os.environ, PATH=path, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([*argv[:-1], "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: hdet-track dashboard" in proc.stdout, proc.stderr[-2000:]

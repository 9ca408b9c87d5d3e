"""The CLI's demo end to end: 2 real gloo replicas launched through torch's elastic launcher."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hdet_track.cli import main


def test_demo_runs_replicas_and_prints_each(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hdet_track.cli", "demo", "--replicas", "2", "--steps", "60", "--sync-every", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "2 replicas" in out
    rows = [line for line in out.splitlines() if line.strip()[:2].isdigit() and "|" in line]
    assert [int(r.split("|")[0]) for r in rows] == [20, 40, 60]
    first = [float(cell.split("/")[0]) for cell in rows[0].split("|")[1:]]
    assert len(first) == 2 and first[0] < first[1]  # replica 1 holds the higher multiplier at first
    accuracy = float(out.split("accuracy")[1].strip())
    assert accuracy > 0.5  # digits is easy: an averaged HDET model must learn something


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--replicas", "0"], "positive integer"),
        (["demo", "--spread", "1.5"], "[0, 1)"),
        (["demo", "--steps", "10", "--sync-every", "25"], "at least --sync-every"),
        (["nope"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

"""bench/quality.py, which writes the published results: its rules on constructed results, and one
small real study (digits, 2 gloo replicas) whose report must agree with the tracking store."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quality import Result, aggressive_lr, best_onecycle, controller_notes  # noqa: E402
from hdet_track.compare import ComparisonRow  # noqa: E402
from hdet_track.events import ControllerDecision, RunStart  # noqa: E402
from hdet_track.readers.base import HDETRun  # noqa: E402


def _result(lr: float, val: float, diverged: bool, seed: int = 0, arm: str = "onecycle") -> Result:
    row = ComparisonRow(
        "id", f"onecycle-lr{lr:g}", "onecycle", lr / 2, 0.1, val, val, 0.9, diverged, 7 if diverged else None
    )
    return Result("shared", seed, arm, lr, 1.0, row, None)


def test_aggressive_lr_is_the_smallest_that_diverged_on_any_seed():
    sweep = [
        _result(0.1, 0.40, False),
        _result(0.2, 0.35, False, seed=0),
        _result(0.2, 0.90, True, seed=1),
        _result(0.5, 2.30, True),
    ]
    assert aggressive_lr(sweep, [0.1, 0.2, 0.5]) == 0.2
    assert aggressive_lr([_result(0.1, 0.4, False), _result(0.5, 0.3, False)], [0.1, 0.5]) == 0.5


def test_best_onecycle_ranks_by_mean_final_val_loss_and_a_diverged_seed_ranks_last():
    sweep = [
        _result(0.05, 0.40, False, seed=0),
        _result(0.05, 0.42, False, seed=1),
        _result(0.2, 0.30, False, seed=0),
        _result(0.2, 0.31, True, seed=1),  # lowest loss on both seeds, but diverged on one
        _result(0.1, 0.39, False, seed=0),
        _result(0.1, 0.44, False, seed=1),
    ]
    assert best_onecycle(sweep) == 0.05  # mean 0.41 beats 0.1's 0.415; 0.2 counts as infinite
    sweep[4] = _result(0.1, 0.30, False, seed=0)
    assert best_onecycle(sweep) == 0.1  # now 0.37


def _hdet(diverged_at: int | None, decisions: list[int]) -> Result:
    start = RunStart(
        config={"auto_lr_warmup": 200, "spread": 0.5},
        world_size=4,
        schedule="hdet",
        param_groups=["pg0"],
        explored=[],
        versions={},
        hostnames=[],
    )
    controller = [
        ControllerDecision(
            step=s,
            name="lr",
            weights=[0.25] * 4,
            delta=[0.0],
            velocity=[0.0],
            base_before=[0.5],
            base_after=[0.5],
            gamma=0.0,
            permutation=[0, 1, 2, 3],
        )
        for s in decisions
    ]
    run = HDETRun("id", name="hdet", start=start, controller=controller)
    row = ComparisonRow("id", "hdet", "hdet", 0.2, 1.0, 1.0, 1.0, 0.5, diverged_at is not None, diverged_at)
    return Result("shared", 0, "hdet", 0.5, 1.0, row, run)


def test_controller_notes_say_whether_the_controller_acted_before_the_divergence():
    assert controller_notes([_hdet(None, [200, 225])], 0.5) == []  # nothing diverged: nothing to explain
    (never,) = controller_notes([_hdet(150, []), _hdet(200, [200])], 0.5)
    assert "never acted" in never and "steps 150, 200" in never and "warm-up lasts 200 steps" in never
    assert "up to 0.75" in never  # (1 + spread) x max_lr
    (acted,) = controller_notes([_hdet(300, [200, 225, 250, 300]), _hdet(210, [200])], 0.5)
    assert "never acted" not in acted and "broke: 3, 1" in acted


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    store = f"sqlite:///{out / 'q.db'}"
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "quality.py"),
        "--dataset",
        "digits",
        "--seeds",
        "0",
        "--steps",
        "50",
        "--replicas",
        "2",
        "--grad-modes",
        "independent",
        "--sweep",
        "0.05",
        "0.5",
        "--out",
        str(out),
        "--store",
        store,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, store, proc.stdout


def test_study_report_matches_the_tracking_store(study):
    from hdet_track.compare import comparison_rows
    from hdet_track.readers.mlflow import MLflowReader

    out, store, stdout = study
    report = (out / "results.md").read_text()
    reader = MLflowReader(store)
    runs = reader.list_runs("hdet-quality")
    assert sorted(r.name for r in runs) == ["hdet", "hdet-no-auto-lr", "onecycle-lr0.05", "onecycle-lr0.5"]
    every = [line for line in report.splitlines() if line.startswith("| independent | 0 |")]
    assert len(every) == 4
    for summary in runs:
        row = comparison_rows([reader.read(summary.run_id)])[0]
        line = next(x for x in every if f"`{summary.run_id[:8]}`" in x)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == row.name
        val = float(cells[4]) if cells[4] != "n/a" else math.nan
        assert val == pytest.approx(row.final_val_loss, rel=1e-3) or (
            math.isnan(val) and math.isnan(row.final_val_loss)
        )
        assert cells[6] == (str(row.diverged_at_step) if row.diverged else "-")
    assert re.search(r"\| independent \| 0\.5 \| \d/1 \| \d/1 \| 0\.(05|5) \|", report)
    assert "![loss curves](loss_curves.png)" in report
    # the set-up is read from the task and the logged runs, not typed in: digits' MLP, warm-up steps // 4
    assert "an MLP 64-256-256-10, SGD (momentum 0.9, Nesterov, weight decay 0.0005)" in report
    assert "auto-LR warm-up 12 steps" in report
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_study_ends_with_json_result_lines(study):
    *_, stdout = study
    lines = [json.loads(x) for x in stdout.strip().splitlines()[-2:]]
    assert [x["bench"] for x in lines] == [
        "quality_independent_hdet_final_val_loss_vs_best_onecycle",
        "quality_independent_hdet_diverged_seeds_at_aggressive_lr",
    ]
    for x in lines:
        assert set(x) == {"bench", "value", "unit", "target", "pass"} and isinstance(x["pass"], bool)

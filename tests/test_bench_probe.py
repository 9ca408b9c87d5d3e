"""Round 18's probe signal (bench/controller_dev.py, docs/controller.md): the probe's z, the tail
average it is taken at, and the controller hook that reads it instead of the window losses."""

from __future__ import annotations

import math
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.controller_dev import ProbeDrift, TailProbe, probe_evidence  # noqa: E402
from bench.probe_signal import counts, slope  # noqa: E402
from hdet_track.controller import ControllerContext, DriftController, WindowStats  # noqa: E402

X = [math.log(m) for m in (0.5, 5 / 6, 7 / 6, 1.5)]


def _rows(per_replica_shift: list[float], examples: int = 64, seed: int = 0) -> np.ndarray:
    base = np.random.default_rng(seed).uniform(0.5, 2.0, size=examples)
    noise = np.random.default_rng(seed + 1).normal(0, 0.05, size=(len(per_replica_shift), examples))
    return base[None, :] + np.asarray(per_replica_shift)[:, None] + noise


def test_probe_evidence_points_against_the_slope_and_is_loss_scale_free():
    larger_better = _rows([0.3, 0.2, 0.1, 0.0])  # the highest multiplier has the lowest probe loss
    z = probe_evidence(X, larger_better)
    assert z < -3
    assert probe_evidence(X, larger_better * 1000.0) == pytest.approx(z)
    assert probe_evidence(X, larger_better + 7.0) == pytest.approx(z)
    assert probe_evidence(X, _rows([0.0, 0.1, 0.2, 0.3])) > 3
    assert probe_evidence(X, _rows([0.0, 0.0, 0.0, 0.0], examples=4000)) == pytest.approx(0.0, abs=3.5)
    assert probe_evidence([0.0, 0.0, 0.0, 0.0], larger_better) == 0.0  # no spread: no slope
    assert abs(probe_evidence(X, _rows([3.0, 2.0, 1.0, 0.0]))) == 10.0  # clipped like the window's z
    with_nan = larger_better.copy()
    with_nan[2, 5] = math.nan
    assert math.isnan(probe_evidence(X, with_nan))  # no probe: the caller falls back


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Task:
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x_train = torch.randn(300, 5, generator=g)
        self.y_train = torch.randint(0, 3, (300,), generator=g)


def test_tail_probe_scores_the_mean_of_the_window_s_second_half_and_leaves_the_parameters(world_of_one):
    task, model = _Task(), nn.Linear(5, 3)
    probe = TailProbe(task, model, sync_every=8, size=100)
    iterates = []
    for k in range(8):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * (k + 1))
        iterates.append([p.detach().clone() for p in model.parameters()])
        probe.after_step()
        if k == 5:
            assert torch.isnan(probe.losses("tail")).all()  # only 2 averaged: no probe yet
    current = [p.detach().clone() for p in model.parameters()]
    tail = probe.losses("tail")[0]
    mean = [torch.stack([it[i] for it in iterates[4:]]).mean(0) for i in range(2)]  # steps 5-8 of 8
    expected = F.cross_entropy(probe.inputs @ mean[0].T + mean[1], probe.targets, reduction="none")
    torch.testing.assert_close(tail.float(), expected)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), current))  # put back
    end = probe.losses("end")[0]
    torch.testing.assert_close(end.float(), F.cross_entropy(model(probe.inputs), probe.targets, reduction="none"))
    probe.synced()
    probe.after_step()
    assert torch.isnan(probe.losses("tail")).all()  # a new window starts its own average


def _stats(step: int, window_losses: list[float]) -> WindowStats:
    n = len(window_losses)
    losses = np.array([[m + 0.01 * ((i * 7 + r) % 5 - 2) for i in range(25)] for r, m in enumerate(window_losses)])
    return WindowStats(
        step=step,
        losses=losses,
        counts=[25] * n,
        sums=[float(row.sum()) for row in losses],
        finite=[True] * n,
        perms={"lr": list(range(n))},
        values={"lr": [[0.1]] * n},
        references={"lr": [0.1]},
    )


def _bound(ctrl: DriftController) -> DriftController:
    ctrl.bind(
        ControllerContext(
            names=["lr"],
            num_targets={"lr": 1},
            multipliers={"lr": [0.5, 5 / 6, 7 / 6, 1.5]},
            bounds={"lr": [(1e-6, 10.0)]},
            lr_bounds_given=False,
            world_size=4,
            total_steps=800,
            sync_every=25,
            start_step=0,
            div_factor=25.0,
            final_div_factor=1e4,
        )
    )
    return ctrl


def test_probe_drift_reads_the_probe_only_at_the_sync_it_was_taken_for():
    window_says_smaller = [1.0, 1.02, 1.04, 1.06]
    ctrl = _bound(ProbeDrift(skip_windows=0))
    plain = _bound(DriftController(skip_windows=0))
    stats = _stats(50, window_says_smaller)
    ok = [0, 1, 2, 3]
    x = ctrl._log_mults("lr", stats)
    window_z = plain.window_evidence("lr", x, ok, stats, 0.01)
    assert window_z > 0
    ctrl.probe = (50, _rows([0.3, 0.2, 0.1, 0.0]))
    assert ctrl.window_evidence("lr", x, ok, stats, 0.01) < 0 and ctrl.probe_syncs == 1
    ctrl.probe = (25, _rows([0.3, 0.2, 0.1, 0.0]))  # stale: taken for another sync
    assert ctrl.window_evidence("lr", x, ok, stats, 0.01) == window_z and ctrl.probe_syncs == 1
    ctrl.probe = (50, _rows([0.3, 0.2, 0.1, 0.0]))
    decision = ctrl.update(stats, plain.health(stats))
    assert decision.updates["lr"][0].delta > 0  # the probe's "larger did better" moves the LR up
    assert plain.update(stats, plain.health(stats)).updates["lr"][0].delta == 0  # one-sided: the window's does not


def test_probe_signal_counts_syncs_that_favour_the_larger_lr():
    assert slope([0.0, 1.0], [2.0, 1.0]) == pytest.approx(-1.0)
    assert slope([0.0, 1.0, 2.0], [[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]]) == pytest.approx(0.0)  # mean over examples
    assert math.isnan(slope([0.0, 1.0], [1.0, math.nan]))
    syncs = [{"tail": -1.0}] * 7 + [{"tail": 1.0}] * 3 + [{"tail": -1.0}] * 2 + [{"tail": 1.0}] * 20
    assert counts(syncs, "tail") == "7 / 2"
    assert counts(syncs[:6], "tail") == "6 of 6"


def _result_lines(script: str, records: Path, *args: str) -> list[dict]:
    """The JSON lines a research bench prints over records it already holds (no run is started)."""
    import json
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--out", str(records), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def strict(constant: str) -> None:  # JSON has no Infinity or NaN (Python's json reads them)
        raise AssertionError(f"{constant} in a JSON line of {script}")

    lines = [json.loads(line, parse_constant=strict) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert "bench" not in lines[0]  # the script's summary, for the record: not a result line
    for line in lines[1:]:  # after it, result lines of the bench format
        assert set(line) == {"bench", "value", "unit", "target", "pass"}, line
    return lines


def test_controller_dev_ends_with_a_result_line_per_candidate(tmp_path):
    """Each candidate's line is its worst ratio of seed means to the bar, passing only at most
    #11's 1.03 with no diverged run (round 18's published records, read back)."""
    import json
    import shutil

    from bench.controller_dev import select

    records = tmp_path / "r18.jsonl"
    shutil.copy(ROOT / "docs" / "controller_dev_round18.jsonl", records)
    summary, *results = _result_lines("controller_dev.py", records, "--round", "18")
    assert (ROOT / "docs" / "controller_dev_round18.jsonl").read_bytes() == records.read_bytes()  # nothing run
    done = {(r := json.loads(line))["key"]: r for line in records.read_text().splitlines()}
    score = select(done, "fashion-mnist", 800, 4, 18)["score"]
    assert summary["selection"]["score"].keys() == score.keys() == {r["bench"].split(".")[2] for r in results}
    for line in results:
        s = score[line["bench"].split(".")[2]]
        assert line["value"] == pytest.approx(max(s["ratios"]), abs=1e-4) and line["target"] == 1.03
        assert line["pass"] is (s["diverged"] == 0 and line["value"] <= 1.03)


def test_probe_signal_ends_with_the_share_of_syncs_favouring_the_larger_lr_at_the_low_end(tmp_path):
    import json
    import shutil

    records = tmp_path / "p.jsonl"
    shutil.copy(ROOT / "docs" / "probe_signal_seed121.jsonl", records)
    summary, *results = _result_lines("probe_signal.py", records)
    assert len(results) == 6  # two modes, three signals
    runs = [json.loads(line) for line in records.read_text().splitlines()]
    for line in results:
        _, mode, signal, _ = line["bench"].split(".", 3)
        (run,) = [r for r in runs if r["mode"] == mode and r["max_lr"] == 0.02]
        share = float(np.mean([s[signal] < 0 for s in run["syncs"]]))
        assert line["value"] == pytest.approx(share, abs=1e-3) and line["pass"] is (share > 0.5)
        ramp, after = summary["larger_lr_better_syncs"][f"{mode}.{signal}"][0].split(" / ")
        assert int(ramp) + int(after) == round(share * len(run["syncs"]))

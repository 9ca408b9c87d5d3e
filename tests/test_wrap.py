"""hdet_track.wrap: an existing OneCycleLR loop becomes HDET with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR

import hdet_track
from hdet_track import HDETScheduler


def make(opt="sgd"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    if opt == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return torch.optim.Adam(groups, lr=0.1)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {
            "three_phase": True,
            "anneal_strategy": "linear",
            "pct_start": 0.2,
            "div_factor": 10.0,
            "final_div_factor": 100.0,
        },
        {"cycle_momentum": False},
        {"base_momentum": 0.8, "max_momentum": 0.9},
    ],
)
def test_wrapping_midway_continues_the_same_schedule(opt, kw):
    o_ref, o_wrap = make(opt), make(opt)
    ref = OneCycleLR(o_ref, [0.3, 0.1], total_steps=50, **kw)
    orig = OneCycleLR(o_wrap, [0.3, 0.1], total_steps=50, **kw)
    key = "betas" if opt == "adam" else "momentum"
    for _ in range(7):
        for o, s in ((o_ref, ref), (o_wrap, orig)):
            o.step()
            s.step()
    sched = hdet_track.wrap(orig, sync_every=10)
    assert isinstance(sched, HDETScheduler) and sched.last_epoch == 7 and sched.total_steps == 50
    for _ in range(43):
        for g1, g2 in zip(o_ref.param_groups, o_wrap.param_groups):
            assert g1["lr"] == g2["lr"] and g1[key] == g2[key]
        for o in (o_ref, o_wrap):
            o.step()
        ref.step()
        sched.step(1.0)


def test_wrap_carries_hdet_arguments_and_rejects_the_rest():
    opt = make()
    sched = hdet_track.wrap(OneCycleLR(opt, 0.2, total_steps=100), spread=0.3, sync_every=20, auto_lr=True)
    assert sched.spread == 0.3 and sched.sync_every == 20 and sched.auto_lr
    with pytest.raises(TypeError, match="do not pass \\['max_lr'\\]"):
        hdet_track.wrap(OneCycleLR(make(), 0.2, total_steps=100), max_lr=0.5)
    direct = hdet_track.wrap(make(), max_lr=0.2, total_steps=100, spread=0.1)
    assert isinstance(direct, HDETScheduler) and direct.total_steps == 100
    with pytest.raises(TypeError, match="needs max_lr"):
        hdet_track.wrap(make())
    with pytest.raises(TypeError, match="supports a torch.optim.lr_scheduler.OneCycleLR"):
        hdet_track.wrap(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="StepLR"):
        hdet_track.wrap(torch.optim.lr_scheduler.StepLR(make(), 10))


def test_plain_loop_example_runs_two_replicas_into_one_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'ex.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_"))}
    env["MLFLOW_TRACKING_URI"] = uri
    script = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--steps", "60"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("hdet").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["hdet.world_size"] == "2"
    assert {"hdet/replica_00/lr", "hdet/replica_01/lr", "val_accuracy"} <= set(runs[0].data.metrics)


def test_wrapping_halfway_decays_the_paper_base_over_the_remaining_syncs_only():
    """Issue #12: wrap() at step 50 of 100 (sync every 10) decays the paper controller's base by
    div_factor / final_div_factor over the 5 syncs left, not over all 10 (which would decay it by
    only about the square root of the intended ratio)."""
    from hdet_track.schedule import decay_gamma

    opt = make()
    orig = OneCycleLR(opt, 0.3, total_steps=100, div_factor=25.0, final_div_factor=1e4)
    for _ in range(50):
        opt.step()
        orig.step()
    sched = hdet_track.wrap(orig, sync_every=10, auto_lr=True, controller="paper")
    assert sched.gamma == pytest.approx(decay_gamma(25.0, 1e4, 5))
    assert (1 - sched.gamma) ** 5 == pytest.approx(25.0 / 1e4)
    fresh = HDETScheduler(make(), 0.3, total_steps=100, sync_every=10, auto_lr=True, controller="paper")
    assert fresh.gamma == pytest.approx(decay_gamma(25.0, 1e4, 10)) and fresh.gamma < sched.gamma


@pytest.mark.parametrize("at", [0, 1, 30])
def test_wrapping_keeps_every_groups_own_ends_bit_for_bit(at):
    """An audit's finding: wrap() rebuilt every group's initial_lr and min_lr from group 0's div
    factors, an ulp off in the others (0.014285714285714284 for 0.014285714285714285): 11 of 98
    steps differed from the OneCycleLR it continues, though spread 0 without auto-LR is OneCycle."""
    o_ref, o_wrap = make("sgd"), make("sgd")
    ref = OneCycleLR(o_ref, [0.1, 0.3], total_steps=100, div_factor=3.0, final_div_factor=7.0)
    orig = OneCycleLR(o_wrap, [0.1, 0.3], total_steps=100, div_factor=3.0, final_div_factor=7.0)
    for _ in range(at):
        for o, s in ((o_ref, ref), (o_wrap, orig)):
            o.step()
            s.step()
    sched = hdet_track.wrap(orig, spread=0.0, sync_every=1000)
    for _ in range(100 - at):
        assert [g["lr"] for g in o_ref.param_groups] == [g["lr"] for g in o_wrap.param_groups]
        assert [g["min_lr"] for g in o_ref.param_groups] == [g["min_lr"] for g in o_wrap.param_groups]
        for o in (o_ref, o_wrap):
            o.step()
        ref.step()
        sched.step(1.0)

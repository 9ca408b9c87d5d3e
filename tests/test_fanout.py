"""FanOut: the replicas' multipliers and permutations of each explored hyperparameter."""

from __future__ import annotations

import pytest
import torch

from hdet_track.explore import resolve_explore
from hdet_track.fanout import FanOut
from hdet_track.schedule import draw_permutation


def fanout(world: int = 4, seed: int = 0) -> tuple[FanOut, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(
        [{"params": [model.weight], "weight_decay": 0.01}, {"params": [model.bias], "weight_decay": 0.0}], lr=0.1
    )
    explored = resolve_explore(
        {"weight_decay": {"spread": 0.5, "bounds": (0.0, 0.012)}}, opt, cycle_momentum=False, use_beta1=False
    )
    return FanOut(0.3, explored, 2, world, seed), opt


def test_values_follow_the_permutation_and_only_explored_values_are_clipped():
    fan, opt = fanout()
    assert fan.names == ["lr", "weight_decay"] and fan.spreading
    assert fan.multipliers["lr"] == pytest.approx([0.7, 0.9, 1.1, 1.3])
    assert fan.references["weight_decay"] == [0.01, 0.0]
    fan.perm["lr"] = [2, 0, 3, 1]
    assert fan.multiplier("lr", 0) == pytest.approx(1.1)
    assert fan.values("lr", [1.0, 10.0], 2) == pytest.approx([1.3, 13.0])  # the LR is not clipped
    fan.perm["weight_decay"] = [3, 2, 1, 0]  # multipliers 0.5, 0.833, 1.167, 1.5
    assert fan.values("weight_decay", [0.01, 0.0], 0) == pytest.approx([0.012, 0.0])  # 0.015 clipped
    fan.write(lambda name: fan.references[name], 3)
    assert [g["weight_decay"] for g in opt.param_groups] == pytest.approx([0.005, 0.0])
    assert fan.series_keys("lr") == ["lr", "lr/pg1"] and fan.num_targets() == {"lr": 2, "weight_decay": 2}


def test_state_round_trip_continues_the_same_permutation_stream():
    a, _ = fanout(seed=7)
    for _ in range(3):
        draw_permutation(4, a.generators["lr"])
    a.perm["lr"] = [3, 1, 0, 2]
    state = a.state_dict()
    b, _ = fanout(seed=7)
    b.load_state_dict(state)
    assert b.perm == a.perm
    assert [draw_permutation(4, b.generators[n]) for n in b.names] == [
        draw_permutation(4, a.generators[n]) for n in a.names
    ]
    c, _ = fanout(seed=7)  # without the state: a different point of the stream
    assert [draw_permutation(4, c.generators["lr"]) for _ in range(4)] != [
        draw_permutation(4, b.generators["lr"]) for _ in range(4)
    ]


def test_no_spread_does_not_spread():
    fan = FanOut(0.0, [], 1, 4, 0)
    assert not fan.spreading and fan.multipliers["lr"] == [1.0] * 4
    assert [s.multipliers for s in fan.specs([(0.0, 1.0)])] == [[1.0] * 4]

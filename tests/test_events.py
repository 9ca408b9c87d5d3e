"""Events: round trip through dicts (and JSON), schema versioning, metric naming."""

from __future__ import annotations

import json
import math

import pytest

from hdet_track.events import (
    SCHEMA_VERSION,
    ControllerDecision,
    Converge,
    Guard,
    RunEnd,
    RunStart,
    StepRecord,
    UnknownSchemaError,
    event_from_dict,
)
from hdet_track.record import ExploredSpec

EVENTS = [
    RunStart(
        config={"max_lr": 0.1, "spread": 0.3},
        world_size=4,
        schedule="hdet",
        param_groups=["pg0"],
        explored=[
            ExploredSpec("lr", 0.3, [0.7, 0.9, 1.1, 1.3], ["pg0", "pg1"], ["lr", "lr/pg1"], [(1e-7, 1.0)] * 2, False),
            ExploredSpec("wd_pg1", 0.5, [0.5, 1.5], ["pg0"], ["wd_pg1"], [(0.0, math.inf)], True),
        ],
        versions={"torch": "2.13.0"},
        hostnames=["a", "a", "b", "b"],
        compare_group="g",
        time=1.5,
        controller="drift",
        total_steps=100,
        start_step=40,
    ),
    StepRecord(step=7, replica=2, values={"lr": 0.01, "weight_decay": 1e-4}, multipliers={"lr": 1.1}, loss=0.5),
    StepRecord(step=8, replica=3, values={"lr": 0.01}, multipliers={"lr": 1.3}, loss=math.nan),
    Converge(
        step=10,
        window_losses=[1.0, math.nan, 0.5, 0.7],
        divergence=[0.1, math.inf, 0.2, 0.3],
        left_out=[1],
        reasons=["non-finite"],
        step_guard="local",
    ),
    ControllerDecision(
        step=10,
        name="lr",
        weights=[0.2, 0.0, 0.5, 0.3],
        delta=[0.001],
        velocity=[0.0001],
        base_before=[0.1],
        base_after=[0.09],
        gamma=0.1,
        permutation=[3, 1, 0, 2],
        onecycle=[0.08],
        controller="drift",
        reference=[0.08],
    ),
    Guard(step=10, action="rollback", replicas=[0, 1, 2, 3], reason="every replica blown up", drift_change=-1.1),
    RunEnd(status="FAILED", step=12, error="ValueError: boom", time=3.5),
]


def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.kind)
def test_round_trip_through_json(event):
    data = event.to_dict()
    assert data["kind"] == event.kind and data["schema"] == SCHEMA_VERSION
    text = json.dumps(data, allow_nan=False)  # strict JSON: non-finite floats are encoded as null
    back = event_from_dict(json.loads(text))
    assert type(back) is type(event)
    # nan and +-inf come back as they were (a diverged replica's window loss is inf, not unknown)
    assert all(same(getattr(back, f), getattr(event, f)) for f in event.__dataclass_fields__)


def test_an_older_archive_s_null_reads_as_nan():
    """Before +-inf were kept, every non-finite float was written as null: it still reads (as nan)."""
    data = Converge(step=5, window_losses=[0.5, math.inf], divergence=[0.0, -math.inf]).to_dict()
    assert data["window_losses"] == [0.5, "inf"] and data["divergence"] == [0.0, "-inf"]
    data["window_losses"] = [0.5, None]
    back = event_from_dict(json.loads(json.dumps(data, allow_nan=False)))
    assert back.window_losses[0] == 0.5 and math.isnan(back.window_losses[1]) and back.divergence[1] == -math.inf


def test_unknown_kind_or_newer_schema_is_a_typed_error():
    with pytest.raises(UnknownSchemaError, match="kind"):
        event_from_dict({"kind": "telemetry", "schema": 1})
    data = EVENTS[1].to_dict()
    data["schema"] = SCHEMA_VERSION + 1
    with pytest.raises(UnknownSchemaError, match="upgrade hdet-track"):
        event_from_dict(data)


def test_schema_1_run_start_reads_with_the_keys_it_was_written_with():
    data = {
        "kind": "run_start",
        "schema": 1,
        "config": {},
        "world_size": 2,
        "schedule": "hdet",
        "param_groups": ["pg0", "pg1"],
        "explored": [
            {"name": "lr", "spread": 0.3, "bounds": [[0, 1]] * 2, "targets": ["pg0", "pg1"], "multipliers": [0.7, 1.3]},
            {
                "name": "dropout",
                "spread": 0.2,
                "bounds": [[0, 1]] * 3,
                "targets": ["a", "b", "c"],
                "multipliers": [1, 1],
            },
        ],
        "versions": {},
        "hostnames": [],
    }
    start = event_from_dict(data)
    assert [e.series_keys for e in start.explored] == [["lr", "lr_pg1"], ["dropout", "dropout_t1", "dropout_t2"]]
    assert start.controller == "" and start.start_step == 0
    data["schema"] = 2
    assert [e.series_keys for e in event_from_dict(data).explored] == [
        ["lr", "lr/pg1"],
        ["dropout", "dropout/t1", "dropout/t2"],
    ]

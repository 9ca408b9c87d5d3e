"""Events: round trip through dicts (and JSON), schema versioning, metric naming."""

from __future__ import annotations

import json
import math

import pytest

from hdet_track.events import (
    SCHEMA_VERSION,
    ControllerDecision,
    Converge,
    RunEnd,
    RunStart,
    StepRecord,
    UnknownSchemaError,
    event_from_dict,
    series_key,
)

EVENTS = [
    RunStart(
        config={"max_lr": 0.1, "spread": 0.3},
        world_size=4,
        schedule="hdet",
        param_groups=["pg0"],
        explored=[
            {
                "name": "lr",
                "spread": 0.3,
                "bounds": [[1e-7, 1.0]],
                "targets": ["pg0"],
                "multipliers": [0.7, 0.9, 1.1, 1.3],
            }
        ],
        versions={"torch": "2.13.0"},
        hostnames=["a", "a", "b", "b"],
        compare_group="g",
        time=1.5,
    ),
    StepRecord(step=7, replica=2, values={"lr": 0.01, "weight_decay": 1e-4}, multipliers={"lr": 1.1}, loss=0.5),
    StepRecord(step=8, replica=3, values={"lr": 0.01}, multipliers={"lr": 1.3}, loss=math.nan),
    Converge(step=10, window_losses=[1.0, math.nan, 0.5, 0.7], divergence=[0.1, math.inf, 0.2, 0.3], left_out=[1]),
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
    ),
    RunEnd(status="FAILED", step=12, error="ValueError: boom"),
]


def same(a, b):
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b or (not math.isfinite(a) and not math.isfinite(b))
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
    # Non-finite floats come back as nan (JSON has no inf): "not a finite value" is what is kept.
    assert all(same(getattr(back, f), getattr(event, f)) for f in event.__dataclass_fields__)


def test_unknown_kind_or_newer_schema_is_a_typed_error():
    with pytest.raises(UnknownSchemaError, match="kind"):
        event_from_dict({"kind": "telemetry", "schema": 1})
    data = EVENTS[1].to_dict()
    data["schema"] = SCHEMA_VERSION + 1
    with pytest.raises(UnknownSchemaError, match="upgrade hdet-track"):
        event_from_dict(data)


def test_series_keys():
    assert series_key("lr", 0, "pg0") == "lr"
    assert series_key("lr", 2, "pg2") == "lr_pg2"
    assert series_key("dropout", 1, "encoder.drop") == "dropout_t1"

"""Metric names and series keys: one home, and every name round-trips, awkward ones included."""

from __future__ import annotations

import pytest

from hdet_track import names

AWKWARD = ["lr", "grad_threshold", "wd_pg1", "drop_t2", "betas.1", "label-smoothing", "x_pg", "t2", "pg1"]


@pytest.mark.parametrize("name", AWKWARD)
@pytest.mark.parametrize(("target", "label"), [(0, "pg0"), (1, "pg1"), (3, "pg3"), (2, "encoder.layers.0.drop")])
def test_series_key_round_trip(name, target, label):
    key = names.series_key(name, target, label)
    assert names.parse_series_key(key) == (name, target)
    for replica in (0, 7, 123):
        assert names.parse_replica_metric(names.replica_metric(replica, key)) == (replica, key)
    for field in names.CONTROLLER_FIELDS:
        assert names.parse_controller_metric(names.controller_metric(key, field)) == (key, field)
    assert names.parse_controller_metric(names.weight_metric(name, 3)) is None
    assert names.parse_weight_metric(names.weight_metric(name, 3)) == (name, 3)


def test_other_metrics_are_not_mistaken_for_series():
    for metric in ["val/loss", "train/acc", "loss", "lr", "hdet/sync/divergence", "hdet/onecycle/lr"]:
        assert names.parse_replica_metric(metric) is None
        assert names.parse_controller_metric(metric) is None
        assert names.parse_weight_metric(metric) is None
    assert names.parse_window_loss_metric(names.window_loss_metric(12)) == 12
    assert names.parse_window_loss_metric("hdet/sync/window_loss") is None
    assert names.parse_left_out_metric(names.left_out_metric(12)) == 12
    assert names.parse_left_out_metric(names.SYNC_LEFT_OUT) is None  # the count, not a replica
    with pytest.raises(ValueError, match="series key"):
        names.parse_series_key("lr/x3")


def test_legacy_keys_and_name_rules():
    assert names.legacy_series_key("lr", 1, "pg1") == "lr_pg1"
    assert names.legacy_series_key("dropout", 2, "net.3") == "dropout_t2"
    assert names.legacy_series_key("dropout", 0, "net.3") == "dropout"
    for bad in ["lr", "a/b", "", "a b", 3]:
        with pytest.raises(ValueError, match="explored hyperparameter name"):
            names.check_name(bad)
    assert names.check_name("grad_threshold") == "grad_threshold"

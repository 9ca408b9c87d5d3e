"""Readers: round trips through real MLflow stores and real W&B offline runs, live re-reads, bad data."""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from torch import nn

from hdet_track import HDETScheduler, explore
from hdet_track.readers import RunNotFoundError, open_reader
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.readers.wandb import WandbReader
from hdet_track.tracking.mlflow import MLflowTracker
from hdet_track.viz import plot_controller

from .test_tracking_wandb import read_finished


def job(track, steps=40, stop=None, **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    sched = HDETScheduler(
        opt,
        0.1,
        total_steps=steps,
        spread=0.3,
        sync_every=10,
        auto_lr=True,
        auto_lr_warmup=10,
        explore=[explore.param_group("weight_decay", 0.5), explore.dropout(model, 0.4)],
        track=track,
        compare_group="readers",
        **kw,
    )
    seen = []
    for k in range(1, (stop or steps) + 1):
        opt.step()
        seen.append((k, opt.param_groups[0]["lr"], model[1].p))
        sched.step(2.0 / k)
    sched.flush()
    return sched, seen


def check_run(run, seen, status="FINISHED"):
    assert run.status == status and run.schedule == "hdet" and run.world_size == 1
    assert run.compare_group == "readers" and run.warnings == []
    assert run.explored_names() == ["lr", "weight_decay", "dropout"]
    steps, lr = run.replica_series("lr", 0)
    assert steps.tolist() == [k for k, *_ in seen]
    np.testing.assert_allclose(lr, [a for _, a, _ in seen], rtol=1e-12)
    np.testing.assert_allclose(run.replica_series("dropout", 0)[1], [p for *_, p in seen], rtol=1e-12)
    np.testing.assert_allclose(run.replica_series("loss", 0)[1], [2.0 / k for k, *_ in seen])
    assert [c.step for c in run.converge] == list(range(10, seen[-1][0] + 1, 10))
    ctl = run.controller_series("lr")
    assert ctl["step"].tolist() == [c.step for c in run.converge]
    assert np.all(ctl["base"] > 0) and np.all(np.isfinite(ctl["drift"]))
    assert run.final_loss() == pytest.approx(2.0 / seen[-1][0])


def test_mlflow_sqlite_round_trip_and_listing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    tracker = MLflowTracker(tracking_uri=uri, experiment="exp", run_name="first")
    sched, seen = job(tracker)
    sched.close()  # the run stays open after the last step (for final metrics) until close()
    reader = open_reader(uri)
    assert isinstance(reader, MLflowReader)
    runs = reader.list_runs("exp")
    assert [r.run_id for r in runs] == [tracker.run_id]
    assert runs[0].name == "first" and runs[0].schedule == "hdet" and runs[0].compare_group == "readers"
    assert reader.list_runs("exp", compare_group="readers")[0].run_id == tracker.run_id
    assert reader.list_runs("exp", compare_group="other") == []
    check_run(reader.read(tracker.run_id), seen)


def test_mlflow_server_round_trip(mlflow_server):
    tracker = MLflowTracker(tracking_uri=mlflow_server.uri, experiment="readers-server")
    sched, seen = job(tracker)
    sched.close()
    check_run(MLflowReader(mlflow_server.uri).read(tracker.run_id), seen)


def test_wandb_offline_round_trip():
    sched, seen = job("wandb")
    sched.close()
    for path in glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", "offline-run-*", "run-*.wandb")):
        assert read_finished(path).exit_code == 0  # whole on disk once close() returned
    reader = open_reader(os.environ["WANDB_DIR"])
    assert isinstance(reader, WandbReader)
    runs = reader.list_runs()
    assert [r.run_id for r in runs] == [sched.run_ids["wandb"]]
    check_run(reader.read(runs[0].run_id), seen)


def test_live_run_is_reread_incrementally(tmp_path):
    uri = f"sqlite:///{tmp_path / 'live.db'}"
    tracker = MLflowTracker(tracking_uri=uri, chunk_seconds=0.0)
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=100, sync_every=10, track=tracker)
    reader = None  # opened once the job created the store (a reader never creates one)
    previous = None
    for k in range(1, 51):
        opt.step()
        sched.step(1.0)
        if k % 20 == 0:
            sched.flush()
            reader = reader or MLflowReader(uri)
            run = reader.read(tracker.run_id, previous=previous)
            assert run.live and run.status == "RUNNING"
            assert run.last_step == k and run.steps.step.tolist() == list(range(1, k + 1))
            if previous is not None:
                assert set(previous.chunks) < set(run.chunks)  # only the new chunks were fetched
            previous = run
    sched.close()
    final = reader.read(tracker.run_id, previous=previous)
    assert not final.live and final.steps.step.tolist() == list(range(1, 51))


def test_history_fallback_matches_archive(tmp_path):
    uri = f"sqlite:///{tmp_path / 'h.db'}"
    tracker = MLflowTracker(tracking_uri=uri)
    _, seen = job(tracker)
    reader = MLflowReader(uri)
    full = reader.read(tracker.run_id)
    artifacts = Path(urlparse(MlflowClient(uri).get_run(tracker.run_id).info.artifact_uri).path) / "hdet_events"
    shutil.rmtree(artifacts)
    fallback = reader.read(tracker.run_id)
    assert any("metric histories" in w for w in fallback.warnings)
    np.testing.assert_allclose(fallback.replica_series("lr", 0)[1], full.replica_series("lr", 0)[1])
    np.testing.assert_allclose(fallback.replica_series("loss", 0)[1], full.replica_series("loss", 0)[1])
    assert [c.step for c in fallback.converge] == [c.step for c in full.converge]
    np.testing.assert_allclose(fallback.controller_series("lr")["base"], full.controller_series("lr")["base"])
    np.testing.assert_allclose(fallback.controller_series("lr")["drift"], full.controller_series("lr")["drift"])
    # the decisions name the run's controller (they read "paper" without the archive, and the Controller
    # page's "taken back" marks, which only the drift controller's moves get, were gone)
    assert {d.controller for d in fallback.controller} == {d.controller for d in full.controller} == {"drift"}


def test_a_series_the_run_does_not_have_is_an_error_not_an_empty_series(tmp_path):
    """A typo (``"los"``, replica 4 of 1) used to read as a run with no data; what the run has but
    has not logged yet (a controller without auto-LR) still reads empty. The same from the metric
    histories alone (no event archive), where the keys come from the series themselves."""
    uri = f"sqlite:///{tmp_path / 'k.db'}"
    tracker = MLflowTracker(tracking_uri=uri)
    job(tracker, steps=20)
    reader = MLflowReader(uri)
    run = reader.read(tracker.run_id)
    assert run.known_series_keys() == ["loss", "lr", "weight_decay", "dropout"]
    with pytest.raises(ValueError, match=r"key to be 'loss' or one of .*\['lr', 'weight_decay', 'dropout'\].*'los'"):
        run.replica_series("los", 0)
    with pytest.raises(ValueError, match=r"replica to be an integer in \[0, 1\).* 4"):
        run.replica_series("loss", 4)
    with pytest.raises(ValueError, match=r"name to be one of .*\['lr', 'weight_decay', 'dropout'\].*'dropot'"):
        run.controller_series("dropot")
    with pytest.raises(ValueError, match=r"target to be an integer in \[0, 1\).*\['lr'\].* 1"):
        run.controller_series("lr", 1)
    with pytest.raises(ValueError, match="'lrr'"):
        run.multiplier_grid("lrr")
    dropout = run.controller_series("dropout")  # read back from the archive: onecycle was None, not NaN
    assert dropout["step"].tolist() == [10, 20] and np.all(np.isnan(dropout["onecycle"]))
    np.testing.assert_allclose(dropout["drift"], dropout["base"] / 0.2)  # against its initial value
    assert plot_controller(run, "dropout", 0).data  # the dashboard's controller page for dropout
    assert run.multiplier_grid("weight_decay")[1].shape == (1, 2)
    artifacts = Path(urlparse(MlflowClient(uri).get_run(tracker.run_id).info.artifact_uri).path) / "hdet_events"
    shutil.rmtree(artifacts)
    fallback = reader.read(tracker.run_id)
    assert fallback.start is None and "lr" in fallback.known_series_keys()
    with pytest.raises(ValueError, match="'los'"):
        fallback.replica_series("los", 0)

    plain = MLflowTracker(tracking_uri=uri)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, track=plain)  # no auto-LR: no decisions
    for _ in range(10):
        opt.step()
        sched.step(1.0)
    sched.close()
    assert reader.read(plain.run_id).controller_series("lr")["step"].tolist() == []


def test_wandb_history_fallback_rebuilds_the_syncs():
    """A W&B run without its event archive (files/hdet_events deleted): the syncs come back from the
    per-sync rows (window losses, the step guard's scope), as they do from MLflow's histories."""
    sched, _ = job("wandb")
    sched.close()
    reader = WandbReader(os.environ["WANDB_DIR"])
    run_id = sched.run_ids["wandb"]
    full = reader.read(run_id)
    for directory in glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", f"*-{run_id}", "files", "hdet_events")):
        shutil.rmtree(directory)
    fallback = reader.read(run_id)
    assert any("no event archive" in w for w in fallback.warnings)
    assert [c.step for c in fallback.converge] == [c.step for c in full.converge] == [10, 20, 30, 40]
    for a, b in zip(fallback.converge, full.converge):
        np.testing.assert_allclose(a.window_losses, b.window_losses, rtol=1e-12)
        assert a.step_guard == b.step_guard and a.left_out == b.left_out == []


@pytest.mark.parametrize("track", ["mlflow", "wandb"])
def test_history_fallback_knows_replicas_left_out_with_a_finite_window_loss(tmp_path, track):
    """A loss spike trips the step guard: the replica is rolled back and left out while its window
    loss stays finite. Without the event archive the histories still say which replica was left out
    (they used to say none: only non-finite windows were read as left out), that the guard rolled
    back there and at a NaN (lost: the dashboard counted no rollback), and what the controller
    decided at every sync (W&B's rows gave no decision at all: "auto_lr off")."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    uri = f"sqlite:///{tmp_path / 'spike.db'}"
    tracker = MLflowTracker(tracking_uri=uri) if track == "mlflow" else "wandb"
    sched = HDETScheduler(opt, 0.1, total_steps=40, sync_every=10, auto_lr=True, model=model, track=tracker)
    for k in range(1, 41):
        opt.step()
        sched.step(100.0 if k == 14 else math.nan if k == 34 else 1.0)  # 100x the window's first loss at 14
    sched.close()
    run_id = sched.run_ids[track]
    if track == "mlflow":
        reader = MLflowReader(uri)
        full = reader.read(run_id)
        shutil.rmtree(Path(urlparse(MlflowClient(uri).get_run(run_id).info.artifact_uri).path) / "hdet_events")
    else:
        reader = WandbReader(os.environ["WANDB_DIR"])
        full = reader.read(run_id)
        pattern = os.path.join(os.environ["WANDB_DIR"], "wandb", f"*-{run_id}", "files", "hdet_events")
        for directory in glob.glob(pattern):
            shutil.rmtree(directory)
    fallback = reader.read(run_id)
    assert fallback.warnings and not full.warnings
    assert [c.step for c in full.converge] == [10, 14, 20, 30, 34, 40]  # the step guard converged at 14, 34
    assert [c.left_out for c in full.converge] == [[], [0], [], [], [0], []]
    assert np.isfinite(full.converge[1].window_losses).all()
    assert [(c.step, c.left_out) for c in fallback.converge] == [(c.step, c.left_out) for c in full.converge]
    assert fallback.converge[1].reasons == ["left out (reason not logged)"]  # not "non-finite": it was finite
    assert [(g.step, g.action, g.replicas) for g in full.guard] == [(14, "rollback", [0]), (34, "rollback", [0])]
    assert [(g.step, g.action, g.replicas) for g in fallback.guard] == [
        (g.step, g.action, g.replicas) for g in full.guard
    ]
    assert len(full.controller) == 6
    for a, b in zip(fallback.controller, full.controller, strict=True):
        assert (a.step, a.name, len(a.weights)) == (b.step, b.name, len(b.weights))
        np.testing.assert_allclose(a.weights, b.weights)
        np.testing.assert_allclose(a.base_after, b.base_after)


def test_left_out_markers_are_trusted_only_when_they_match_the_count():
    """A W&B run resumed from a checkpoint logs some syncs twice (a stale marker stays), and a run
    started before the markers existed has syncs without them: there the non-finite windows stand
    for the replicas left out, as before the markers."""
    from hdet_track.readers.base import converge_from_series

    inf = math.inf
    assert converge_from_series(10, [1.0, 2.0, 3.0], 1.0, None, [2]).left_out == [2]  # finite, marked
    assert converge_from_series(10, [1.0, inf, 3.0], 1.0, None, [0, 1]).left_out == [1]  # a stale marker
    assert converge_from_series(10, [1.0, inf, 3.0], 1.0, None, []).left_out == [1]  # logged before markers
    assert converge_from_series(10, [1.0, 2.0, 3.0], 0.0, None, [0]).left_out == []  # the count says none
    old = converge_from_series(10, [1.0, inf], 1.0, 2.0)
    assert old.left_out == [1] and old.reasons == ["non-finite"] and old.step_guard == "local"


def test_bad_sources_give_typed_errors_or_partial_runs(tmp_path):
    uri = f"sqlite:///{tmp_path / 'bad.db'}"
    client = MlflowClient(uri)
    empty = client.create_experiment("empty")
    reader = MLflowReader(uri)
    assert reader.list_runs("empty") == []
    with pytest.raises(RunNotFoundError, match="nope"):
        reader.list_runs("nope")
    with pytest.raises(RunNotFoundError):
        reader.read("0123456789abcdef0123456789abcdef")
    for bad_reader in (reader, WandbReader(tmp_path)):
        for bad in (5, None, ""):
            with pytest.raises(TypeError, match=rf"run_id to be a run's id \(a non-empty str\), but got {bad!r}"):
                bad_reader.read(bad)
    # A run logged by another tool, no HDET events: a partial run with a warning.
    plain = client.create_run(empty).info.run_id
    for step in range(5):
        client.log_metric(plain, "loss", 1.0 / (step + 1), step=step)
    run = reader.read(plain)
    assert run.warnings and "no HDET events" in run.warnings[0]
    assert run.mean_series("loss")[1].tolist() == [1.0, 0.5, 1 / 3, 0.25, 0.2]
    # A truncated chunk and an event of an unknown schema version: warnings, the rest is read.
    tracker = MLflowTracker(tracking_uri=uri)
    job(tracker)
    artifacts = Path(urlparse(client.get_run(tracker.run_id).info.artifact_uri).path) / "hdet_events"
    steps_file = sorted(artifacts.glob("steps-*.parquet"))[0]
    steps_file.write_bytes(steps_file.read_bytes()[:100])
    import pyarrow as pa
    import pyarrow.parquet as pq

    future = {"kind": "converge", "schema": 99, "step": 1}
    pq.write_table(
        pa.table({"kind": ["converge"], "step": [1], "json": [json.dumps(future)]}), artifacts / "events-999999.parquet"
    )
    run = reader.read(tracker.run_id)
    assert any("unreadable archive chunk steps-" in w for w in run.warnings)
    assert any("upgrade hdet-track" in w for w in run.warnings)
    # the torn chunk's steps come from the per-replica histories; the syncs stay the archive's, once
    assert any("gave no step rows: steps rebuilt from metric histories" in w for w in run.warnings)
    assert len(run.converge) == 4 and run.steps.step.tolist() == list(range(1, 41))


def test_an_attached_run_whose_archive_gave_no_rows_reads_hdets_loss_not_its_owners(tmp_path):
    """In a run HDET attached to (``MLflowTracker(run_id=...)``: Hugging Face's, Lightning's), the
    run's ``loss`` is its owner's and HDET's means are ``hdet/loss``/``hdet/lr``. When the archive
    gave no step rows (a torn chunk), the run was read from the plain ``loss`` and ``lr``: the
    owner's loss as HDET's in ``compare`` and on the Converge page, and no LR to export."""
    from hdet_track.compare import comparison_rows

    uri = f"sqlite:///{tmp_path / 'attached.db'}"
    client = MlflowClient(uri)
    owner = client.create_run(client.create_experiment("hdet"), run_name="owner").info.run_id
    for s in range(1, 21):
        client.log_metric(owner, "loss", 100.0 + s, step=s)  # the owner's own loss, far from HDET's
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    track = MLflowTracker(tracking_uri=uri, run_id=owner)
    with HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=track) as sched:
        for k in range(1, 21):
            opt.step()
            sched.step(1.0 / k)
    artifacts = Path(urlparse(client.get_run(owner).info.artifact_uri).path) / "hdet_events"
    for chunk in artifacts.glob("steps-*.parquet"):
        chunk.write_bytes(chunk.read_bytes()[:200])
    for torn_only in (True, False):  # then with no archive at all
        if not torn_only:
            shutil.rmtree(artifacts)
        run = MLflowReader(uri).read(owner)
        assert run.final_loss() == pytest.approx(1 / 20)
        assert run.replica_series("lr", 0)[0].tolist() == list(range(1, 21))
        (row,) = comparison_rows([run])
        assert row.final_train_loss == pytest.approx(1 / 20) and row.best_train_loss == pytest.approx(1 / 20)
        assert "loss" not in run.metrics or max(run.metrics["loss"][1]) < 2  # never the owner's 101-120
    (listed,) = MLflowReader(uri).list_runs("hdet")
    assert listed.final_loss == pytest.approx(1 / 20)


def test_wandb_directory_still_being_written(tmp_path):
    sched, seen = job("wandb", stop=25, steps=40)  # not finished: no exit record yet
    directory = glob.glob(os.path.join(os.environ["WANDB_DIR"], "wandb", "offline-run-*"))[0]
    wandb_file = glob.glob(os.path.join(directory, "run-*.wandb"))[0]
    copy = tmp_path / "copy" / Path(directory).name
    shutil.copytree(directory, copy)
    data = Path(wandb_file).read_bytes()
    (copy / Path(wandb_file).name).write_bytes(data[: len(data) - 30])  # a torn last record
    run = WandbReader(tmp_path / "copy").read(sched.run_ids["wandb"])
    assert run.live and run.status == "RUNNING"
    assert run.steps.step.tolist() == list(range(1, 21))  # the synced windows
    sched.close()


def test_reading_a_missing_sqlite_store_is_an_error_and_creates_nothing(tmp_path):
    """MLflow's client creates a missing sqlite file (and its directory) on first use; a reader never
    does: the URI is named in a ReaderError and nothing appears on disk."""
    from hdet_track.readers import ReaderError
    from hdet_track.readers.mlflow import sqlite_file

    before = sorted(p.name for p in tmp_path.iterdir())  # the working directory (conftest)
    for uri in [f"sqlite:///{tmp_path / 'nonexistent' / 'x.db'}", "sqlite:///mlflow.db"]:
        for opener in (MLflowReader, open_reader):
            with pytest.raises(ReaderError, match="does not exist") as exc:
                opener(uri)
            assert uri in str(exc.value)
    with pytest.raises(ReaderError, match="sqlite:///mlflow.db"):
        MLflowReader()  # the default store
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert sqlite_file("sqlite:///rel/x.db") == Path("rel/x.db")
    assert sqlite_file("sqlite:////abs/x.db?timeout=5") == Path("/abs/x.db")
    assert [sqlite_file(u) for u in ("sqlite://", "sqlite:///:memory:", "http://127.0.0.1:5000", "file:///x")] == [
        None
    ] * 4


@pytest.mark.parametrize("track", ["mlflow", "wandb"])
def test_user_metrics_read_back_from_either_backend_with_the_event_archive(tmp_path, track):
    """The metrics a job logs itself (val_loss, val_accuracy, the demo's diverged_at_step) come back
    from W&B as from MLflow, so `compare`'s rows are the same for either backend."""
    from hdet_track.compare import comparison_rows

    uri = f"sqlite:///{tmp_path / 'user.db'}"
    tracker = MLflowTracker(tracking_uri=uri) if track == "mlflow" else "wandb"
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=40, sync_every=10, track=tracker)
    for k in range(1, 31):  # closed before total_steps: every metric is logged while the run is open
        opt.step()
        sched.step(1.0)
        if k % 10 == 0:
            sched.log_metrics({"val_loss": 1.0 / k, "val_accuracy": k / 100}, step=k)
    sched.log_metrics({"diverged_at_step": 25.0}, step=25)
    sched.close()
    reader = MLflowReader(uri) if track == "mlflow" else WandbReader(os.environ["WANDB_DIR"])
    run = reader.read(sched.run_ids[track])
    assert not run.warnings  # read from the event archive
    assert run.metrics["val_loss"][0].tolist() == [10, 20, 30]
    np.testing.assert_allclose(run.metrics["val_loss"][1], [0.1, 0.05, 1 / 30])
    np.testing.assert_allclose(run.metrics["val_accuracy"][1], [0.1, 0.2, 0.3])
    assert "loss" not in run.metrics and "lr" not in run.metrics  # HDET's own series stay in run.steps
    (row,) = comparison_rows([run])
    assert row.val_accuracy == pytest.approx(0.3) and row.final_val_loss == pytest.approx(1 / 30)
    assert row.diverged and row.diverged_at_step == 25


def test_a_live_run_first_read_before_its_archive_is_read_in_full_once_the_archive_comes(tmp_path):
    """A live run read before its first archive chunk was uploaded is rebuilt from metric histories,
    which hold no multipliers; the next read reused that one and kept its rows over the archive's,
    so the Fan-out page's multiplier heatmap stayed blank for the session."""
    import shutil

    from mlflow.tracking import MlflowClient

    from hdet_track import HDETScheduler
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.tracking.mlflow import MLflowTracker

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with HDETScheduler(opt, 0.1, total_steps=12, sync_every=4, track=MLflowTracker(tracking_uri=uri)) as sched:
        for k in range(1, 13):
            opt.step()
            sched.step(1.0 / k)
    client = MlflowClient(uri)
    (listed,) = client.search_runs([client.get_experiment_by_name("hdet").experiment_id])
    archive = Path(listed.info.artifact_uri.removeprefix("file://")) / "hdet_events"
    shutil.move(archive, tmp_path / "hidden")  # as in a live run's first seconds
    reader = MLflowReader(uri)
    early = reader.read(listed.info.run_id)
    assert not early.chunks and np.isnan(early.steps.multipliers.get("lr", np.array([np.nan]))).all()
    shutil.move(tmp_path / "hidden", archive)  # the first chunks arrive
    later = reader.read(listed.info.run_id, previous=early)
    fresh = reader.read(listed.info.run_id)
    assert fresh.steps.multipliers["lr"].tolist() == [1.0] * 12
    assert later.steps.multipliers["lr"].tolist() == fresh.steps.multipliers["lr"].tolist()


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_non_finite_values_read_back_as_logged_from_either_store(tmp_path, backend):
    """MLflow keeps +-inf as the largest finite float: the reader gave val_loss 1.8e308 (and a
    replica's inf loss in a run read without its archive, from the same histories, a mean loss of
    9e307), where W&B gave inf."""
    track = MLflowTracker(tracking_uri=f"sqlite:///{tmp_path / 'inf.db'}") if backend == "mlflow" else "wandb"
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=10, track=track)
    for k in range(1, 21):
        opt.step()
        sched.step(2.0 / k)
    sched.log_metrics({"val_loss": math.inf}, step=10)
    sched.log_metrics({"val_loss": -math.inf}, step=15)
    sched.log_metrics({"val_loss": math.nan}, step=20)
    sched.close()
    run_id = sched.run_ids[backend]
    reader = open_reader(f"sqlite:///{tmp_path / 'inf.db'}" if backend == "mlflow" else os.environ["WANDB_DIR"])
    for archive in (True, False):
        if not archive:  # the metric histories (W&B: its rows) alone
            if backend == "mlflow":
                shutil.rmtree(urlparse(MlflowClient(reader.uri).get_run(run_id).info.artifact_uri).path)
            else:
                for f in glob.glob(
                    os.environ["WANDB_DIR"] + "/wandb/*run-*/files/hdet_events/**/*.parquet", recursive=True
                ):
                    os.remove(f)
        run = reader.read(run_id)
        steps, values = run.metrics["val_loss"]
        assert steps.tolist() == [10, 15, 20]
        assert values[0] == math.inf and values[1] == -math.inf and math.isnan(values[2]), (archive, values)
        assert run.final_loss() == pytest.approx(2.0 / 20)


def test_a_live_read_that_met_a_torn_steps_chunk_reads_it_whole_next_time(tmp_path):
    """A poll met the first steps chunk half uploaded (a local artifact store copies it in place):
    its rows came from the metric histories, which have no multipliers, and every later read with
    previous= kept those rows, so the fan-out grid stayed empty for good."""
    uri = f"sqlite:///{tmp_path / 'torn.db'}"
    sched, _ = job(MLflowTracker(tracking_uri=uri))
    run_id = sched.run_ids["mlflow"]
    sched.close()
    archive = Path(urlparse(MlflowClient(uri).get_run(run_id).info.artifact_uri).path) / "hdet_events"
    (chunk,) = sorted(archive.glob("steps-*.parquet"))[:1]
    whole = chunk.read_bytes()
    reader = MLflowReader(uri)
    fresh = reader.read(run_id)
    chunk.write_bytes(whole[: len(whole) // 2])
    torn = reader.read(run_id)
    assert any("rebuilt from metric histories" in w for w in torn.warnings)
    chunk.write_bytes(whole)
    again = reader.read(run_id, previous=torn)
    assert again.warnings == [] and len(again.steps) == len(fresh.steps)
    np.testing.assert_array_equal(again.steps.multipliers["lr"], fresh.steps.multipliers["lr"])
    np.testing.assert_array_equal(again.multiplier_grid("lr")[1], fresh.multiplier_grid("lr")[1])


def test_listing_w_and_b_runs_looks_for_their_directories_once(tmp_path, monkeypatch):
    """Each run's summary looked for every run's directories again: N runs, N + 1 scans of the tree
    (200 runs took 4.4 s to list, 0.1 s with one scan)."""
    import hdet_track.readers.wandb as wandb_reader

    for _ in range(3):
        sched, _ = job("wandb", steps=10)
        sched.close()
    scans = []
    real = wandb_reader.find_run_dirs
    monkeypatch.setattr(wandb_reader, "find_run_dirs", lambda root: scans.append(root) or real(root))
    runs = WandbReader(os.environ["WANDB_DIR"]).list_runs()
    assert len(runs) == 3 and len(scans) == 1


def _tracked(tmp_path, backend, steps, total_steps=None, sync_every=5):
    """A run of ``steps`` steps (losses 1/k) of ``total_steps`` (default ``steps``) logged to a
    sqlite MLflow store or W&B offline in ``tmp_path``: the scheduler, left open, and a function that
    opens a reader of the store (once the run is in it)."""
    from hdet_track.tracking.wandb import WandbTracker

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    if backend == "mlflow":
        tracker = MLflowTracker(tracking_uri=uri, experiment="audit")
    else:
        tracker = WandbTracker(project="audit", dir=tmp_path, mode="offline")
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=total_steps or steps, sync_every=sync_every, track=tracker)
    for step in range(1, steps + 1):
        opt.step()
        sched.step(1.0 / step)
    return sched, lambda: MLflowReader(uri) if backend == "mlflow" else WandbReader(str(tmp_path))


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_user_metric_logged_twice_at_a_step_reads_back_the_value_logged_last(tmp_path, backend, monkeypatch):
    """An audit's finding: val_loss logged 0.9 then 0.5 at one step read back 0.9 on both backends
    (and so did compare's final val loss). W&B's row holds the last value, the tracker's file both,
    and the merge put the file's first after the row's; MLflow orders a step's points of the same
    millisecond by value, and two log calls in one millisecond got the same time."""
    import time as time_module

    sched, reader = _tracked(tmp_path, backend, 20)
    assert sched.flush()
    now = time_module.time()
    with monkeypatch.context() as frozen:  # both calls in one millisecond
        frozen.setattr(time_module, "time", lambda: now)
        sched.log_metrics({"val_loss": 0.9}, step=20)
        sched.log_metrics({"val_loss": 0.5}, step=20)
    sched.close()
    steps, values = reader().read(sched.run_ids[backend]).metrics["val_loss"]
    assert steps.tolist() == [20] and values.tolist() == [0.5]


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_the_runs_list_gives_the_final_loss_of_a_run_closed_early_under_the_point_budget(
    tmp_path, backend, monkeypatch
):
    """An audit's finding: the runs list (the dashboard's Runs page) read a run's final loss from its
    thinned loss series, which kept the planned last step but not the last step trained: a run
    closed at step 53 of 10,000 listed the loss of the last step the budget kept."""
    monkeypatch.setenv("HDET_POINTS_PER_SECOND", "1")
    sched, reader = _tracked(tmp_path, backend, 53, total_steps=10_000, sync_every=50)
    sched.close()
    (summary,) = reader().list_runs("audit")
    assert summary.final_loss == pytest.approx(1.0 / 53) == reader().read(summary.run_id).final_loss()


@pytest.mark.parametrize("damage", ["event_not_an_object", "string_step_column", "null_step"])
def test_a_foreign_archive_chunk_is_a_warning_not_a_traceback_or_a_wrong_step(tmp_path, damage):
    """An audit's findings: an events chunk holding JSON that is no object raised AttributeError out
    of the read (the dashboard showed a traceback); a steps chunk whose step column holds text raised
    ValueError; one with a null step read as step -2**63, silently."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sched, reader = _tracked(tmp_path, "wandb", 20)
    sched.close()
    (events,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "files" / "hdet_events"))
    if damage == "event_not_an_object":
        pq.write_table(pa.table({"kind": ["x"], "step": [1], "json": ["[1, 2]"]}), f"{events}/events-000090.parquet")
    elif damage == "string_step_column":
        pq.write_table(pa.table({"step": ["x"], "replica": [0], "loss": [1.0]}), f"{events}/steps-000090.parquet")
    else:
        table = pa.table({"step": pa.array([None, 61], pa.int64()), "replica": [0, 0], "loss": [1.0, 2.0]})
        pq.write_table(table, f"{events}/steps-000090.parquet")
    run = reader().read(sched.run_ids["wandb"])
    assert run.steps.step.min() == 1 and run.steps.step.max() == 20
    assert run.final_loss() == pytest.approx(1.0 / 20)
    assert any("000090" in w for w in run.warnings), run.warnings


@pytest.mark.parametrize("backend", ["mlflow", "wandb"])
def test_a_zoom_into_a_range_without_steps_reads_empty_not_the_whole_run(tmp_path, backend):
    """An audit's finding: a step range with no rows (past the run's steps: a user metric logged at a
    later step makes it selectable on the dashboard) was taken for a torn archive: MLflow rebuilt the
    whole run from its histories and warned, W&B put the whole run's loss and lr into the metrics."""
    sched, reader = _tracked(tmp_path, backend, 40)
    sched.log_metrics({"val_loss": 0.5}, step=200)
    sched.close()
    run_id = sched.run_ids[backend]
    run = reader().read(run_id, steps=(100, 200))
    assert len(run.steps) == 0 and not run.filled_from_rows and run.view == (100, 200)
    assert not any("rebuilt" in w for w in run.warnings), run.warnings
    assert "loss" not in run.metrics and "lr" not in run.metrics
    whole = reader().read(run_id, steps=(1, 40))
    assert whole.steps.step.min() == 1 and whole.steps.step.max() == 40


def test_the_w_and_b_merge_keeps_the_order_values_were_logged_in_whichever_source_is_behind():
    """The value logged last at a step wins whether W&B's history is behind the tracker's file (a
    hand-over's rows hold only its last value) or the file is behind the history (written with the
    archive: a process killed between the two), and a point in both counts once."""
    from hdet_track.wandb_store import _merge_user_metrics

    def merged(history, in_file):
        steps, values = zip(*history) if history else ((), ())
        found = {"val": (np.array(steps, dtype=np.int64), np.array(values, dtype=float))}
        out = _merge_user_metrics(found, [("val", s, v) for s, v in in_file])["val"]
        return list(zip(out[0].tolist(), out[1].tolist()))

    assert merged([(20, 0.5)], [(20, 0.9), (20, 0.5)]) == [(20, 0.9), (20, 0.5)]  # the file ahead
    assert merged([(5, 1.0), (5, 2.0)], [(5, 1.0)]) == [(5, 1.0), (5, 2.0)]  # the history ahead
    assert merged([(1, 1.0)], [(1, 1.0), (2, 2.0)]) == [(1, 1.0), (2, 2.0)]
    assert merged([(1, 1.0), (3, 3.0)], [(1, 1.0), (2, 2.0)]) == [(1, 1.0), (2, 2.0), (3, 3.0)]

"""Lightning DDP on 2 CPU processes (gloo) with HDETCallback: fan-out, converge, one MLflow run."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from .examples_helpers import assert_synced_only_at, dumped_lrs, run_example

pytest.importorskip("lightning")


def test_lightning_ddp_example(tmp_path):
    uri = f"sqlite:///{tmp_path / 'pl.db'}"
    dump = tmp_path / "dump"
    dump.mkdir()
    args = ["--steps", "60", "--val-every", "3", "--dump", str(dump)]
    run_example("lightning_ddp.py", args, tmp_path, {"MLFLOW_TRACKING_URI": uri}, done_when="`Trainer.fit` stopped")
    assert_synced_only_at(dump, [20, 40, 60], between=30)
    # Validation (every 3 epochs of 10 steps) starts with the last sync's record complete: sync 20's
    # divergences would otherwise wait for sync 40's gather (its window was short).
    for rank in (0, 1):
        seen = [json.loads(line) for line in (dump / f"val{rank}.jsonl").read_text().splitlines()]
        assert seen == [[30, 20, True], [60, 60, True]], rank
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("hdet").experiment_id])
    assert len(runs) == 1  # Lightning's run holds both replicas
    run_id = runs[0].info.run_id
    lr0 = {m.step: m.value for m in client.get_metric_history(run_id, "hdet/replica_00/lr")}
    lr1 = {m.step: m.value for m in client.get_metric_history(run_id, "hdet/replica_01/lr")}
    assert sorted(lr0) == list(range(1, 61)) and lr0[1] < lr1[1]  # fanned out from the first step
    assert runs[0].data.tags["hdet.world_size"] == "2"


def test_callback_builds_onecycle_from_max_lr_and_steps_once_per_optimizer_step(tmp_path):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from hdet_track.integrations.lightning import HDETCallback

    class NoScheduler(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 4, generator=g), torch.randn(256, 1, generator=g))
    callback = HDETCallback(max_lr=0.05, sync_every=5, auto_lr=True, track=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=10,
        accumulate_grad_batches=2,
        logger=False,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(NoScheduler(), DataLoader(data, batch_size=8))
    sched = callback.scheduler
    assert sched is not None and sched.total_steps == 10
    assert sched.last_epoch == 10 and trainer.global_step == 10  # 20 batches, 10 optimizer steps
    assert sched.last_sync is not None and sched.last_sync.weights is not None  # the controller ran


def test_ckpt_path_resumes_the_schedule_and_the_run(tmp_path):
    """Killed right after a mid-window checkpoint (step 30, syncs every 20), resumed with
    fit(ckpt_path=...): every replica's LR at every step is the uninterrupted job's (which
    checkpoints at the same step); one MLflow run holds each step once."""
    from hdet_track.readers.mlflow import MLflowReader

    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    full_uri, uri = f"sqlite:///{tmp_path / 'full.db'}", f"sqlite:///{tmp_path / 'pl.db'}"
    common = ["--steps", "60", "--save-every", "30"]
    run_example(
        "lightning_ddp.py",
        [*common, "--ckpt-dir", str(tmp_path / "c1"), "--dump", str(full)],
        tmp_path,
        {"MLFLOW_TRACKING_URI": full_uri},
    )
    ckpts = str(tmp_path / "c2")
    killed = [*common, "--ckpt-dir", ckpts, "--dump", str(part), "--kill-at", "30"]
    run_example("lightning_ddp.py", killed, tmp_path, {"MLFLOW_TRACKING_URI": uri}, ok=False)
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hdet").experiment_id])
    resume = ["--resume", f"{ckpts}/step=30.ckpt", "--run-id", run.info.run_id]
    run_example(
        "lightning_ddp.py",
        [*common, "--ckpt-dir", ckpts, "--dump", str(part), *resume],
        tmp_path,
        {"MLFLOW_TRACKING_URI": uri},
    )
    expected, got = dumped_lrs(full), dumped_lrs(part)
    for r in range(2):
        assert sorted(got[r]) == list(range(1, 61))
        assert [got[r][k] for k in range(1, 61)] == [expected[r][k] for k in range(1, 61)], r
    assert len(client.search_runs([client.get_experiment_by_name("hdet").experiment_id])) == 1
    read = MLflowReader(uri).read(run.info.run_id)
    full = MlflowClient(full_uri)
    (reference,) = full.search_runs([full.get_experiment_by_name("hdet").experiment_id])
    reference = MLflowReader(full_uri).read(reference.info.run_id)
    for r in range(2):
        steps, lrs = read.replica_series("lr", r)
        assert list(steps) == list(range(1, 61))
        assert list(lrs) == list(reference.replica_series("lr", r)[1])  # the uninterrupted run's, exactly
    # converged where the uninterrupted run did (syncs, and any step-guard rollback) and at the checkpoint
    assert [e.step for e in read.converge] == [e.step for e in reference.converge]
    assert {20, 30, 40, 60} <= {e.step for e in read.converge}


def test_a_fit_that_reached_its_last_step_keeps_the_run_open_for_final_metrics(tmp_path, monkeypatch):
    """After fit(), callback.scheduler.log_metrics lands in the run (it used to be dropped: the
    callback closed the run in on_train_end); the next fit with the same callback ends it FINISHED
    and starts its own; a fit stopped early (before the schedule's last step) ends it at once."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from hdet_track.integrations.lightning import HDETCallback
    from hdet_track.readers.mlflow import MLflowReader

    class Module(pl.LightningModule):
        def __init__(self, stop_at: int | None = None):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.stop_at = stop_at

        def training_step(self, batch, batch_idx):
            if batch_idx == self.stop_at:
                self.trainer.should_stop = True  # as EarlyStopping does
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    callback = HDETCallback(max_lr=0.05, sync_every=4, track=True)

    def fit(module):
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=8, logger=False, callbacks=[callback],
            enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
            default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(module, data)
        return callback.scheduler

    first = fit(Module())
    first.log_metrics({"val_loss": 0.5})
    second = fit(Module())  # ends the first run FINISHED, starts its own
    second.log_metrics({"val_loss": 0.25})
    second.close()
    early = fit(Module(stop_at=2))  # stopped after 3 of the schedule's 8 steps
    assert early.last_epoch == 3
    early.log_metrics({"val_loss": 9.0})  # dropped, with a warning: the run ended with the fit
    reader = MLflowReader(uri)
    runs = sorted((reader.read(s.run_id) for s in reader.list_runs()), key=lambda r: r.start_time)
    assert [r.status for r in runs] == ["FINISHED", "FINISHED", "FINISHED"]
    assert [list(r.metrics["val_loss"][1]) if "val_loss" in r.metrics else [] for r in runs] == [[0.5], [0.25], []]
    assert [[c.step for c in r.converge] for r in runs[:2]] == [[4, 8], [4, 8]]


def test_a_typo_in_hdets_arguments_fails_when_the_callback_is_built():
    from hdet_track.integrations.lightning import HDETCallback

    with pytest.raises(
        TypeError, match=r"HDETCallback got unexpected keyword arguments \['sync_evry'\]; .*'sync_every'"
    ):
        HDETCallback(spread=0.2, sync_evry=100)
    with pytest.raises(TypeError, match=r"\['pct_start'\]"):  # OneCycle's come from the module's schedule
        HDETCallback(pct_start=0.1)
    HDETCallback(spread=0.2, sync_every=100, auto_lr=True, close_at_end=True)

"""Lightning DDP on 2 CPU processes (gloo) with HDETCallback: fan-out, converge, one MLflow run."""

from __future__ import annotations

import json
import os

import pytest
import torch
from mlflow.tracking import MlflowClient

from hdet_track.record import SchedulerCallback

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


def test_ddp_checkpoints_and_an_early_stop_hold_the_consensus(tmp_path):
    """2 ranks, syncs every 5 steps. Before: a weights-only checkpoint (no callback hook runs for
    it) held rank 0's unaveraged replica; the val_loss that picks a monitored checkpoint was the
    replicas' mix before the sync, not the saved weights'; a fit stopped at step 14 left the
    replicas apart and its steps 11-14 out of the run. Now every save and that validation converge
    first, and the early stop converges before it ends the run."""
    import subprocess
    import sys

    from hdet_track.readers.mlflow import MLflowReader

    from .jobs import lightning_saves

    uri = f"sqlite:///{tmp_path / 'pl.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_", "WANDB_"))}
    proc = subprocess.run(
        [sys.executable, lightning_saves.__file__, str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env | {"MLFLOW_TRACKING_URI": uri},
    )  # fmt: skip
    assert "fit done at step 14" in proc.stdout, proc.stderr[-4000:]
    params = [{}, {}]
    for rank in (0, 1):
        for kind, step, flat in map(json.loads, (tmp_path / f"params{rank}.jsonl").read_text().splitlines()):
            params[rank][kind, step] = flat

    def weights(path):
        return torch.cat([v.reshape(-1) for v in torch.load(path, weights_only=False)["state_dict"].values()]).tolist()

    for step in (6, 12):  # mid-window: the save converged both ranks, and holds what they hold
        assert (
            weights(tmp_path / "weights" / f"step={step}.ckpt") == params[0]["start", step] == params[1]["start", step]
        )
    module = lightning_saves.Module()
    validations = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    assert [step for step, _ in validations] == [4, 8, 12, 14]
    for step, val_loss in validations:  # the monitored metric is the checkpoint's own weights' loss
        module.load_state_dict(torch.load(tmp_path / "best" / f"step={step}.ckpt", weights_only=False)["state_dict"])
        x, y = next(iter(lightning_saves.data(32, 32)))
        with torch.no_grad():
            assert torch.nn.functional.mse_loss(module.net(x), y).item() == pytest.approx(val_loss, rel=1e-5)
    assert params[0]["end", 14] == params[1]["end", 14]  # the early stop converged the replicas
    reader = MLflowReader(uri)
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.status == "FINISHED"
    assert list(run.replica_series("lr", 1)[0]) == list(range(1, 15))
    assert [c.step for c in run.converge] == [4, 5, 6, 8, 10, 12, 14]


class _Syncs(SchedulerCallback):
    """Keeps every sync's record."""

    def __init__(self):
        self.records = []

    def on_sync(self, record):
        self.records.append(record)


class _Tiny:
    """A one-process Lightning module and trainer for the tests below (built lazily: Lightning is optional)."""

    @staticmethod
    def module(**kwargs):
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self, fail_in=None, interval="step"):
                super().__init__()
                torch.manual_seed(0)
                self.net = torch.nn.Linear(4, 1)
                self.fail_in, self.interval = fail_in, interval
                self.losses = []

            def training_step(self, batch, batch_idx):
                if self.fail_in == "training" and batch_idx == 2:
                    raise RuntimeError("a bad training_step")
                loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
                self.losses.append(loss.item())
                return loss

            def validation_step(self, batch, batch_idx):
                if self.fail_in == "validation":
                    raise RuntimeError("a bad validation_step")
                self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

            def test_step(self, batch, batch_idx):
                raise RuntimeError("a bad test_step")

            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.01)
                onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=8)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": onecycle, "interval": self.interval}}

        return Module(**kwargs)

    @staticmethod
    def data(n=64):
        from torch.utils.data import DataLoader, TensorDataset

        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=8)

    @staticmethod
    def trainer(root, callbacks, **kwargs):
        import lightning.pytorch as pl

        saves = any(type(c).__name__ == "ModelCheckpoint" for c in callbacks)
        kwargs = dict(max_steps=8, logger=False, enable_checkpointing=saves) | kwargs
        return pl.Trainer(
            accelerator="cpu", devices=1, callbacks=callbacks, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=1, **kwargs,
        )  # fmt: skip


def test_only_a_failing_fit_fails_its_run(tmp_path, monkeypatch):
    """A test() that raises after a finished fit, or a next fit that raises in its sanity check
    (before its training starts), used to end the finished fit's run FAILED: Lightning calls
    on_exception for any stage. That run ends FINISHED; a fit failing in training still fails its own."""
    from hdet_track.integrations.lightning import HDETCallback
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    callback = HDETCallback(sync_every=4)
    _Tiny.trainer(tmp_path, [callback]).fit(_Tiny.module(), _Tiny.data())
    with pytest.raises(RuntimeError, match="a bad test_step"):
        _Tiny.trainer(tmp_path, [callback]).test(_Tiny.module(), _Tiny.data())
    with pytest.raises(RuntimeError, match="a bad validation_step"):
        _Tiny.trainer(tmp_path, [callback]).fit(_Tiny.module(fail_in="validation"), _Tiny.data(), _Tiny.data(16))
    reader = MLflowReader(uri)
    (summary,) = reader.list_runs()
    assert summary.status == "FINISHED" and "hdet.error" not in reader.read(summary.run_id).tags
    with pytest.raises(RuntimeError, match="a bad training_step"):
        _Tiny.trainer(tmp_path, [callback]).fit(_Tiny.module(fail_in="training"), _Tiny.data())
    failed, finished = reader.list_runs()  # newest first
    assert (failed.status, finished.run_id, finished.status) == ("FAILED", summary.run_id, "FINISHED")
    assert "a bad training_step" in reader.read(failed.run_id).tags["hdet.error"]


def test_gradient_accumulation_steps_hdet_with_the_mean_loss_of_the_step(tmp_path):
    """Lightning hands on_train_batch_end each micro-batch's loss divided by
    accumulate_grad_batches; HDET used to get (and log, and weigh replicas by) the last one's."""
    from hdet_track.integrations.lightning import HDETCallback

    syncs = _Syncs()
    callback, module = HDETCallback(sync_every=2, track=False, callbacks=[syncs]), _Tiny.module()
    _Tiny.trainer(tmp_path, [callback], max_steps=4, accumulate_grad_batches=4).fit(module, _Tiny.data())
    means = [sum(module.losses[k : k + 4]) / 4 for k in range(0, 16, 4)]
    assert [s for r in syncs.records for s in r.steps] == [1, 2, 3, 4]
    assert [v for r in syncs.records for v in r.losses.reshape(-1)] == pytest.approx(means, rel=1e-6)


def test_wrap_steps_hdet_before_the_trainers_checkpoint_callbacks(tmp_path):
    """wrap() appended the callback after Lightning had put ModelCheckpoint last, so a step
    checkpoint was saved before HDET stepped: it held HDET one step behind, and a resume from it
    ran the schedule one step late."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    import hdet_track
    from hdet_track.integrations.lightning import HDETCallback

    saves = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = hdet_track.wrap(_Tiny.trainer(tmp_path, [saves]), sync_every=4, track=False)
    assert [type(c).__name__ for c in trainer.callbacks][-2:] == ["HDETCallback", "ModelCheckpoint"]
    trainer.fit(_Tiny.module(), _Tiny.data())
    state = torch.load(tmp_path / "ckpt" / "step=3.ckpt", weights_only=False)
    (hdet,) = [v for k, v in state["callbacks"].items() if k.startswith("HDETCallback")]
    assert state["global_step"] == 3 and hdet["scheduler"]["onecycle"]["last_epoch"] == 3
    resumed = HDETCallback(sync_every=4, track=False)
    saves = ModelCheckpoint(tmp_path / "again", every_n_train_steps=100)
    _Tiny.trainer(tmp_path, [saves, resumed]).fit(
        _Tiny.module(), _Tiny.data(), ckpt_path=tmp_path / "ckpt" / "step=3.ckpt"
    )
    assert resumed.scheduler.last_epoch == 8 and resumed.scheduler.last_sync.step == 8


def test_state_restored_by_validate_is_not_resumed_by_the_next_fit(tmp_path):
    """validate(ckpt_path=...) restores the callbacks' state too; the next fresh fit used to resume
    HDET's schedule from it (starting at the checkpoint's step 6 of 8)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hdet_track.integrations.lightning import HDETCallback

    syncs = _Syncs()
    callback = HDETCallback(sync_every=4, track=False, callbacks=[syncs])
    saves = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=6, save_top_k=-1)
    _Tiny.trainer(tmp_path, [callback, saves]).fit(_Tiny.module(), _Tiny.data())
    _Tiny.trainer(tmp_path, [callback]).validate(
        _Tiny.module(), _Tiny.data(16), ckpt_path=tmp_path / "ckpt" / "step=6.ckpt"
    )
    syncs.records.clear()
    _Tiny.trainer(tmp_path, [callback]).fit(_Tiny.module(), _Tiny.data())
    assert [list(r.steps) for r in syncs.records] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # from the start


def test_a_subclass_of_lightnings_mlflow_logger_gets_hdets_rows_in_its_run(tmp_path, monkeypatch):
    """The logger was recognised by its exact class name: a subclass got a second, separate run."""
    from lightning.pytorch.loggers import MLFlowLogger

    from hdet_track.integrations.lightning import HDETCallback
    from hdet_track.readers.mlflow import MLflowReader

    class TeamLogger(MLFlowLogger):
        pass

    uri = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # where HDET's own run would go
    logger = TeamLogger(experiment_name="hdet", tracking_uri=uri)
    callback = HDETCallback(sync_every=4)
    _Tiny.trainer(tmp_path, [callback], logger=logger).fit(_Tiny.module(), _Tiny.data())
    callback.scheduler.close()
    reader = MLflowReader(uri)
    (summary,) = reader.list_runs()
    assert summary.run_id == logger.run_id
    assert list(reader.read(summary.run_id).replica_series("lr", 0)[0]) == list(range(1, 9))


def test_an_mlflow_and_a_wandb_logger_both_get_hdets_rows(tmp_path, monkeypatch):
    """``logger=[MLFlowLogger(...), WandbLogger(...)]``: HDET logged into the first logger's run only,
    and the W&B run had none of its rows (Hugging Face's integration logs into every run of report_to)."""
    import wandb
    from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

    from hdet_track.integrations.lightning import HDETCallback
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.readers.wandb import WandbReader

    monkeypatch.setenv("WANDB_MODE", "offline")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    mlflow_logger = MLFlowLogger(experiment_name="hdet", tracking_uri=uri)
    wandb_logger = WandbLogger(project="hdet", save_dir=str(tmp_path))
    callback = HDETCallback(sync_every=4)
    trainer = _Tiny.trainer(tmp_path, [callback], logger=[mlflow_logger, wandb_logger])
    trainer.fit(_Tiny.module(), _Tiny.data())
    callback.scheduler.close()
    wandb.finish()
    for run in (MLflowReader(uri).read(mlflow_logger.run_id), WandbReader(str(tmp_path)).read(wandb_logger.version)):
        assert list(run.replica_series("lr", 0)[0]) == list(range(1, 9))


def test_a_onecycle_stepped_per_epoch_is_refused(tmp_path):
    from hdet_track.integrations.lightning import HDETCallback

    with pytest.raises(ValueError, match=r"interval='step', frequency=1\), but got interval='epoch', frequency=1"):
        _Tiny.trainer(tmp_path, [HDETCallback(track=False)]).fit(_Tiny.module(interval="epoch"), _Tiny.data())


def test_a_typo_in_hdets_arguments_fails_when_the_callback_is_built():
    from hdet_track.integrations.lightning import HDETCallback

    with pytest.raises(
        TypeError, match=r"HDETCallback got unexpected keyword arguments \['sync_evry'\]; .*'sync_every'"
    ):
        HDETCallback(spread=0.2, sync_evry=100)
    with pytest.raises(TypeError, match=r"\['pct_start'\]"):  # OneCycle's come from the module's schedule
        HDETCallback(pct_start=0.1)
    HDETCallback(spread=0.2, sync_every=100, auto_lr=True, close_at_end=True)

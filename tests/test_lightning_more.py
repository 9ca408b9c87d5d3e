"""HDETCallback on what Lightning allows beyond the plain fit: schedules that do not match the fit,
skipped and loss-less steps, manual optimization, checkpoints read with and without HDET, ranks
that fail, and ddp_spawn. One process unless a test says otherwise (tests/jobs/lightning_failures.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

from hdet_track.integrations.lightning import HDETCallback  # noqa: E402
from hdet_track.record import SchedulerCallback  # noqa: E402


def _data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class _Stream(IterableDataset):
    """10 batches, and no length: the Trainer cannot count the fit's steps."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(10):
            x = torch.randn(8, 4, generator=g)
            yield x, x.sum(1, keepdim=True)


def _trainer(root, callbacks, **kwargs) -> pl.Trainer:
    kwargs = dict(max_steps=8, logger=False, enable_checkpointing=False) | kwargs
    return pl.Trainer(
        accelerator="cpu", devices=1, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, num_sanity_val_steps=0, **kwargs,
    )  # fmt: skip


class _Module(pl.LightningModule):
    """``schedule``: None (an optimizer alone), "onecycle" (over ``total`` steps), "cosine", or
    "onecycle+weight" (a OneCycleLR, then a scheduler of a loss weight, not of a learning rate).
    ``skip``: the batches whose training_step returns None. ``manual``: manual optimization, in
    Lightning's documented pattern (``sch.step()`` after ``opt.step()``), returning the loss or not."""

    def __init__(self, schedule=None, total=8, skip=(), manual=False, returns=True):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.schedule, self.total, self.skip, self.returns = schedule, total, set(skip), returns
        self.automatic_optimization = not manual
        self.losses: dict[int, float] = {}
        self.seen: list[tuple[float, float]] = []  # manual: (the scheduler's get_last_lr, the LR used)

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.losses[batch_idx] = loss.item()
        if not self.automatic_optimization:
            opt, sch = self.optimizers(), self.lr_schedulers()
            if sch is not None:
                self.seen.append((sch.get_last_lr()[0], opt.param_groups[0]["lr"]))
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            if sch is not None:
                sch.step()
            return loss if self.returns else None
        return loss

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step()  # the loss weight's scheduler is no LRScheduler: Lightning asks for this hook

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        if self.schedule is None:
            return opt
        if self.schedule == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.total)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.schedule == "weight":
            return {"optimizer": opt, "lr_scheduler": {"scheduler": _LossWeight(opt), "interval": "step"}}
        onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=self.total)
        configs = [{"scheduler": onecycle, "interval": "step"}]
        if self.schedule == "onecycle+weight":
            configs.append({"scheduler": _LossWeight(opt), "interval": "step"})
        return [opt], configs


class _LossWeight:
    """A scheduler of something other than a learning rate (Lightning steps any object with this API)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer  # Lightning maps each scheduler to its optimizer
        self.steps = 0

    def step(self):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class _LRs(pl.Callback):
    """The learning rate each optimizer step used (by the step's number)."""

    def __init__(self):
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.lrs[trainer.global_step + 1] = trainer.optimizers[0].param_groups[0]["lr"]


class _Syncs(SchedulerCallback):
    def __init__(self):
        self.records = []

    def on_sync(self, record):
        self.records.append(record)


# ---------------------------------------------------------------------- the schedule and the fit


def test_a_onecycle_shorter_than_the_fit_is_refused_when_training_starts(tmp_path):
    """After the OneCycleLR's last step HDET neither stepped nor averaged: on 2 ranks the fit ended
    with each replica's own weights (plain Lightning fails at step 9)."""
    callback = HDETCallback(sync_every=4, track=False)
    with pytest.raises(
        ValueError, match=r"total_steps >= trainer\.estimated_stepping_batches=12, but got total_steps=8: .*max_steps=8"
    ):
        _trainer(tmp_path, [callback], max_steps=12).fit(_Module("onecycle", total=8), _data(128))
    assert callback.scheduler is None  # refused before anything was built


def test_a_fit_that_goes_on_past_the_schedule_fails_at_the_next_batch(tmp_path):
    """A fit of unknown length (a stream without a length) is not refused at the start; its
    ninth batch, past the schedule's 8 steps, used to train each replica on alone in silence."""
    callback = HDETCallback(sync_every=4, track=False)
    trainer = _trainer(tmp_path, [callback], max_steps=-1, max_epochs=1)
    with pytest.raises(ValueError, match=r"HDET's schedule \(total_steps=8\), but it goes on at trainer.global_step=8"):
        trainer.fit(_Module("onecycle", total=8), DataLoader(_Stream(), batch_size=None))
    assert callback.scheduler.last_epoch == 8 and callback.scheduler.last_sync.step == 8


@pytest.mark.parametrize(
    "kwargs, loader",
    [
        (dict(max_steps=-1, max_epochs=-1), _data),
        (dict(max_steps=-1, max_epochs=1), lambda: DataLoader(_Stream(), batch_size=None)),
    ],
    ids=["max_epochs=-1", "no-length"],
)
def test_max_lr_over_a_fit_of_unknown_length_is_refused(tmp_path, kwargs, loader):
    """Used to be an OverflowError (int(inf)), or an error about auto_lr_warmup (total_steps=-1)."""
    with pytest.raises(
        ValueError,
        match=r"Expected a finite trainer\.estimated_stepping_batches >= 1 .*but got (inf|-1).*Trainer\(max_steps=\.\.\.\)",
    ):
        _trainer(tmp_path, [HDETCallback(max_lr=0.05, track=False)], **kwargs).fit(_Module(), loader())


@pytest.mark.parametrize(
    "max_lr, schedule, message",
    [
        (0.5, "onecycle", r"but got both: max_lr=0\.5 and OneCycleLR\(max_lr=0\.05, total_steps=8\)"),
        (0.05, "cosine", r"no learning-rate scheduler .* with HDETCallback\(max_lr=0\.05\), but got CosineAnnealingLR"),
        (None, "cosine", r"Expected configure_optimizers to return a OneCycleLR .*, but got CosineAnnealingLR$"),
        (None, None, r"but got no scheduler$"),
        (None, "weight", r"Expected configure_optimizers to return a OneCycleLR .*, but got _LossWeight$"),
    ],
    ids=["max_lr+onecycle", "max_lr+cosine", "cosine", "nothing", "not-torchs"],
)
def test_conflicting_schedules_are_refused(tmp_path, max_lr, schedule, message):
    """max_lr= silently won over the module's OneCycleLR, and over a CosineAnnealingLR that Lightning
    went on stepping; without max_lr the error did not say what it got."""
    with pytest.raises(ValueError, match=message):
        _trainer(tmp_path, [HDETCallback(max_lr=max_lr, track=False)]).fit(_Module(schedule), _data())


def test_a_scheduler_not_torchs_beside_hdet_is_named_in_a_warning(tmp_path, caplog):
    """A scheduler Lightning steps through lr_scheduler_step (timm's kind) may set learning rates HDET
    overwrites at every step: it went unmentioned (and alone it was reported as "no scheduler")."""
    with caplog.at_level(logging.WARNING, logger="hdet_track.integrations.lightning"):
        _trainer(tmp_path, [HDETCallback(sync_every=4, track=False)]).fit(_Module("onecycle+weight"), _data())
    assert any("_LossWeight from configure_optimizers is stepped by Lightning too" in r.message for r in caplog.records)


def test_two_optimizers_are_refused(tmp_path):
    """A GAN's two optimizers: estimated_stepping_batches counts both optimizers' steps, HDET one
    per batch, and its schedule stopped at its midpoint."""

    class Gan(_Module):
        def training_step(self, batch, batch_idx):
            for opt in self.optimizers():
                loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.01), torch.optim.SGD(self.parameters(), lr=0.01)]

    with pytest.raises(ValueError, match=r"to return one optimizer with HDETCallback, but got 2 \(SGD, SGD\)"):
        _trainer(tmp_path, [HDETCallback(max_lr=0.05, track=False)], max_steps=16).fit(Gan(manual=True), _data())


# ---------------------------------------------------------------------- steps without a loss


@pytest.mark.parametrize(
    "accumulate, skip, amp, hdet_steps",
    [
        (1, {2}, False, 7),  # batch 2 trains nothing: 7 HDET steps in 8 optimizer steps
        (2, {0, 4, 5}, False, 3),  # step 1 from batch 1 alone; step 3 (batches 4, 5) trains nothing
        (2, {1}, True, 3),  # 16-bit AMP skips step 1, whose last micro-batch returned None
    ],
    ids=["skip", "accumulate", "amp"],
)
def test_a_step_whose_training_step_returned_none_is_no_hdet_step(tmp_path, accumulate, skip, amp, hdet_steps):
    """training_step returning None is Lightning's "skip this batch": Lightning still calls the
    optimizer and counts a step (without a gradient, or AMP skips it), and HDET stepped with no
    loss: with auto_lr=True a ValueError from deep inside the scheduler."""
    syncs = _Syncs()
    callback = HDETCallback(sync_every=4, auto_lr=True, track=False, callbacks=[syncs])
    module = _Module("onecycle", total=8 // accumulate, skip=skip)
    extra = {}
    if amp:
        from lightning.pytorch.plugins.precision import MixedPrecision

        extra["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]
    trainer = _trainer(tmp_path, [callback], max_steps=8 // accumulate, accumulate_grad_batches=accumulate, **extra)
    trainer.fit(module, _data())
    assert trainer.global_step == 8 // accumulate and callback.scheduler.last_epoch == hdet_steps
    windows = [range(k, k + accumulate) for k in range(0, 8, accumulate)]
    if amp:
        windows = [w for w in windows if w[-1] not in skip]
    means = [[module.losses[b] for b in w if b in module.losses] for w in windows]
    means = [sum(m) / len(m) for m in means if m]
    assert [v for r in syncs.records for v in r.losses.reshape(-1)] == pytest.approx(means, rel=1e-3 if amp else 1e-6)
    assert syncs.records[-1].step == hdet_steps  # the fit ended converged


def test_manual_optimization_keeps_lightnings_scheduler_and_hdet_sets_the_learning_rates(tmp_path):
    """The callback took the OneCycleLR out of trainer.lr_scheduler_configs: self.lr_schedulers()
    was None and Lightning's documented manual pattern (sch.step()) failed."""
    syncs = _Syncs()
    callback = HDETCallback(sync_every=4, auto_lr=True, track=False, callbacks=[syncs])
    module = _Module("onecycle", manual=True)
    _trainer(tmp_path, [callback]).fit(module, _data())
    sched = callback.scheduler
    assert sched.last_epoch == 8 and [r.step for r in syncs.records] == [4, 8]
    assert len(module.seen) == 8 and all(reported == used for reported, used in module.seen)
    assert [used for _, used in module.seen][:4] == pytest.approx(
        [0.002, 0.04096, 0.0486, 0.04059], abs=1e-5
    )  # the stand-in's step() did not move OneCycle on: HDET did, once per step
    assert module.lr_schedulers().hdet is sched


def test_manual_optimization_without_a_returned_loss(tmp_path, caplog):
    """Lightning's manual examples return nothing: with auto_lr=True the error said only that
    step(loss) got no loss; without it each step went into the run as NaN, in silence."""
    with pytest.raises(ValueError, match=r"under manual optimization, end training_step with `return loss`"):
        _trainer(tmp_path, [HDETCallback(max_lr=0.05, auto_lr=True, track=False)]).fit(
            _Module(manual=True, returns=False), _data()
        )
    callback = HDETCallback(max_lr=0.05, sync_every=4, track=False)
    with caplog.at_level(logging.WARNING, logger="hdet_track"):
        _trainer(tmp_path, [callback]).fit(_Module(manual=True, returns=False), _data())
    warned = [r for r in caplog.records if "return loss" in r.getMessage()]
    assert len(warned) == 1 and callback.scheduler.last_epoch == 8  # said once; the fit went on


# ---------------------------------------------------------------------- checkpoints with and without HDET


def _fit_lrs(root, callbacks, module, steps, ckpt_path=None, **kwargs) -> dict[int, float]:
    lrs = _LRs()
    _trainer(root, [*callbacks, lrs], max_steps=steps, **kwargs).fit(module, _data(), ckpt_path=ckpt_path)
    return lrs.lrs


def test_a_checkpoint_written_with_hdet_resumes_without_it_at_its_step(tmp_path):
    """The checkpoint had no lr_schedulers entry for the OneCycleLR HDET took over: a fit resumed
    without HDET started its OneCycleLR again at step 0 (and with a second scheduler, loaded that
    one's state into the OneCycleLR)."""
    plain = _fit_lrs(tmp_path, [], _Module("onecycle", total=12), 12)
    saves = ModelCheckpoint(tmp_path / "ck", filename="{step}", every_n_train_steps=6, save_top_k=-1)
    _fit_lrs(tmp_path, [HDETCallback(sync_every=4, track=False), saves], _Module("onecycle+weight", total=12), 6,
             enable_checkpointing=True)  # fmt: skip
    state = torch.load(tmp_path / "ck" / "step=6.ckpt", weights_only=False)
    onecycle, weight = state["lr_schedulers"]  # in configure_optimizers' order
    assert onecycle["last_epoch"] == 6 and onecycle["total_steps"] == 12 and weight == {"steps": 6}
    module = _Module("onecycle+weight", total=12)
    resumed = _fit_lrs(tmp_path, [], module, 12, ckpt_path=tmp_path / "ck" / "step=6.ckpt")
    assert [resumed[k] for k in range(7, 13)] == pytest.approx([plain[k] for k in range(7, 13)], rel=1e-12)
    assert module.lr_schedulers()[1].steps == 12


def test_a_checkpoint_written_with_hdet_resumes_with_it_exactly(tmp_path):
    """The OneCycleLR now comes back from the checkpoint at HDET's step too; HDET's schedule is still
    built as the saved job's was (the paper controller's decay spans all its syncs), then restored."""
    hdet = dict(sync_every=4, auto_lr=True, controller="paper", track=False)

    def saves(name):  # a checkpoint converges first: the uninterrupted fit checkpoints at step 6 too
        return ModelCheckpoint(tmp_path / name, filename="{step}", every_n_train_steps=6, save_top_k=-1)

    full = _fit_lrs(tmp_path, [HDETCallback(**hdet), saves("full")], _Module("onecycle", total=12), 12,
                    enable_checkpointing=True)  # fmt: skip
    _fit_lrs(tmp_path, [HDETCallback(**hdet), saves("ck")], _Module("onecycle", total=12), 6, enable_checkpointing=True)
    callback = HDETCallback(**hdet)
    resumed = _fit_lrs(
        tmp_path, [callback], _Module("onecycle", total=12), 12, ckpt_path=tmp_path / "ck" / "step=6.ckpt"
    )
    assert [resumed[k] for k in range(7, 13)] == [full[k] for k in range(7, 13)]
    assert callback.scheduler.last_epoch == 12


def test_max_lr_resuming_a_checkpoint_without_hdet_starts_at_its_step(tmp_path):
    """HDETCallback(max_lr=...) started its schedule again at step 0 from a plain Lightning
    checkpoint of step 6 (a module's OneCycleLR continued at its restored step)."""
    full = _fit_lrs(tmp_path, [HDETCallback(max_lr=0.05, sync_every=4, track=False)], _Module(), 12)
    saves = ModelCheckpoint(tmp_path / "ck", filename="{step}", every_n_train_steps=6, save_top_k=-1)
    _fit_lrs(tmp_path, [saves], _Module(), 6, enable_checkpointing=True)
    callback = HDETCallback(max_lr=0.05, sync_every=4, track=False)
    resumed = _fit_lrs(tmp_path, [callback], _Module(), 12, ckpt_path=tmp_path / "ck" / "step=6.ckpt")
    assert [resumed[k] for k in range(7, 13)] == [full[k] for k in range(7, 13)]
    assert callback.scheduler.last_epoch == 12 and callback.scheduler.total_steps == 12


# ---------------------------------------------------------------------- 2 ranks (gloo): failures, ddp_spawn


def _job(tmp_path, mode: str) -> subprocess.CompletedProcess:
    job = os.path.join(os.path.dirname(__file__), "jobs", "lightning_failures.py")  # not imported: it runs a fit
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_", "WANDB_"))}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path / 'pl.db'}"
    return subprocess.run(
        [sys.executable, job, mode],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["fail", "fail-slow"])
def test_a_rank_that_fails_fails_the_run_with_its_own_error(tmp_path, mode):
    """Rank 1 raises. Rank 0 (the run's owner) fails next, on the collective rank 1's exit breaks,
    and ended the run with that gloo error; or, when rank 0 took longer than Lightning's launcher
    (which polls its ranks every 5 s and SIGKILLs rank 0 once one exited with an error), the run
    was never ended. Rank 1 now leaves a note, rank 0 ends the run with it, and the kill waits."""
    from hdet_track.readers.mlflow import MLflowReader

    proc = _job(tmp_path, mode)
    assert proc.returncode != 0 and "boom on rank 1" in proc.stderr, proc.stderr[-3000:]
    reader = MLflowReader(f"sqlite:///{tmp_path / 'pl.db'}")
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.status == "FAILED", (run.status, proc.stderr[-3000:])
    error = run.tags["hdet.error"]
    assert error.startswith("rank 1 failed:") and "RuntimeError: boom on rank 1" in error, error
    assert list(run.replica_series("lr", 1)[0]) == [1, 2, 3, 4]  # the rows up to the last sync


def test_ddp_spawn_final_metrics_are_logged_inside_the_fit(tmp_path):
    """After a ddp_spawn fit the process that called fit() has no scheduler (its workers had copies
    of the callback), as documented; final metrics logged inside the fit (on_fit_end, in the
    worker) reach the run, which ends FINISHED with the workers."""
    from hdet_track.readers.mlflow import MLflowReader

    proc = _job(tmp_path, "spawn")
    assert "after fit: scheduler None" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    reader = MLflowReader(f"sqlite:///{tmp_path / 'pl.db'}")
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.status == "FINISHED" and list(run.metrics["final_loss"][1]) == [0.5]


def test_a_fit_whose_last_average_fails_ends_its_run_failed(tmp_path, monkeypatch):
    """A fit stopped early averages the replicas in on_train_end, a collective: when it fails (a
    peer gone there), Lightning's on_exception no longer takes the fit for a running one, and the run
    was left RUNNING for the process's exit to guess at."""
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'pl.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)

    class PeerGone(pl.Callback):
        def on_train_start(self, trainer, pl_module):  # after HDET's: its scheduler is built
            def sync_now():
                raise RuntimeError("peer gone in the last average")

            hdet.scheduler.sync_now = sync_now

    hdet = HDETCallback(sync_every=4, track="mlflow")
    with pytest.raises(RuntimeError, match="peer gone"):
        _trainer(tmp_path, [hdet, PeerGone()], max_steps=6).fit(_Module("onecycle", total=12), _data())
    reader = MLflowReader(uri)
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.status == "FAILED" and "RuntimeError: peer gone in the last average" in run.tags["hdet.error"]


def test_a_fit_resumed_into_a_new_mlflow_loggers_run_says_the_run_is_split(tmp_path, caplog):
    """``fit(ckpt_path=...)`` with a fresh ``MLFlowLogger()``: HDET follows the logger's new run, and
    the steps before the checkpoint stay in the old one. Hugging Face's integration said so; this
    one said nothing. With ``MLFlowLogger(run_id=...)`` the run goes on, without a warning."""
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'pl.db'}"

    def saves(name):
        return ModelCheckpoint(tmp_path / name, filename="{step}", every_n_train_steps=4, save_top_k=-1)

    first = HDETCallback(sync_every=4)
    logger = MLFlowLogger(experiment_name="e", tracking_uri=uri)
    _fit_lrs(tmp_path, [first, saves("ck")], _Module("onecycle", total=8), 4, logger=logger, enable_checkpointing=True)
    first.scheduler.close()
    earlier = logger.run_id
    for again, split in ((MLFlowLogger(experiment_name="e", tracking_uri=uri), True),
                         (MLFlowLogger(experiment_name="e", tracking_uri=uri, run_id=earlier), False)):  # fmt: skip
        caplog.clear()
        callback = HDETCallback(sync_every=4)
        with caplog.at_level(logging.WARNING, logger="hdet_track"):
            _fit_lrs(tmp_path, [callback], _Module("onecycle", total=8), 8, logger=again,
                     ckpt_path=tmp_path / "ck" / "step=4.ckpt")  # fmt: skip
        callback.scheduler.close()
        said = [r.getMessage() for r in caplog.records if "resuming the training of mlflow run" in r.getMessage()]
        if split:
            (line,) = said
            assert f"run {earlier} into run {again.run_id}" in line and f"MLFlowLogger(run_id='{earlier}')" in line
        else:
            assert said == [] and again.run_id == earlier
    client = MlflowClient(uri)
    assert len(client.search_runs([client.get_experiment_by_name("e").experiment_id])) == 2

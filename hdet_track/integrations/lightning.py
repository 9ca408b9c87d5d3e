"""PyTorch Lightning: ``callbacks=[HDETCallback(...)]`` or ``hdet_track.wrap(pl.Trainer(...), ...)``.

The callback takes over the module's ``OneCycleLR`` (from ``configure_optimizers``), or builds
one from ``max_lr`` over ``trainer.estimated_stepping_batches``; it steps HDET once per optimizer
step with the training loss (so gradient accumulation counts once), averages across Lightning's
DDP ranks (Lightning initialises ``torch.distributed``; gloo on CPU, nccl on GPU), and logs into
the run of Lightning's ``MLFlowLogger`` or ``WandbLogger`` when one is configured, through the
project's tracker otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import OneCycleLR

from ..errors import needs_extra
from ..scheduler import HDETScheduler, check_hdet_kwargs

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Checkpoint
except ImportError:  # pragma: no cover - the standalone package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
        from pytorch_lightning.callbacks import Checkpoint  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(needs_extra("hdet_track.integrations.lightning", "lightning", "lightning")) from exc

__all__ = ["HDETCallback", "wrap_trainer"]


def _tracker_for(trainer: Any, track: Any) -> Any:
    """Lightning's own logger's run when there is one (its class or a subclass), else ``track``."""
    if track is False or track is None:
        return False
    loggers = getattr(trainer, "loggers", []) or []
    for logger in loggers:
        kinds = {cls.__name__ for cls in type(logger).__mro__}
        if "MLFlowLogger" in kinds:
            from ..tracking.mlflow import MLflowTracker

            run_id = logger.run_id if trainer.global_rank == 0 else None
            return MLflowTracker(tracking_uri=getattr(logger, "_tracking_uri", None), run_id=run_id)
        if "WandbLogger" in kinds:
            from ..tracking.wandb import WandbTracker

            return WandbTracker(run=logger.experiment if trainer.global_rank == 0 else None)
    return track


class HDETCallback(pl.Callback):
    """Run a Lightning fit with HDET.

    Args:
        max_lr: build a OneCycle schedule with this peak when the module configures none.
        track: as for :class:`HDETScheduler` (``True`` by default); Lightning's MLflow/W&B logger
            wins when configured.
        **hdet_kwargs: HDET's arguments (``spread``, ``sync_every``, ``auto_lr``, ...).

    HDET steps once per optimizer step with that step's training loss (with gradient accumulation:
    the mean over its micro-batches). Every checkpoint the fit writes (``ModelCheckpoint``, any
    ``trainer.save_checkpoint``, weights-only ones included) is converged first, so it holds the
    consensus every replica resumes from; with a ``ModelCheckpoint(monitor=...)`` the validation
    that decides the save is converged first too, so the metric is the saved weights'. HDET's state
    is part of Lightning's checkpoints, and ``trainer.fit(..., ckpt_path=...)`` resumes the
    schedule where it stopped. A fit stopped early converges before it ends its run.

    Example:
        >>> trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp",
        ...                      callbacks=[HDETCallback(spread=0.2, sync_every=100, auto_lr=True)])
    """

    def __init__(self, *, max_lr: float | None = None, track: Any = True, **hdet_kwargs: Any) -> None:
        super().__init__()
        check_hdet_kwargs("HDETCallback", hdet_kwargs, taken=("track",))
        self.max_lr = max_lr
        self.track = track
        self.hdet_kwargs = hdet_kwargs
        self.scheduler: HDETScheduler | None = None
        self._fitting = False  # a fit's training owns self.scheduler's run (from on_train_start)
        self._last_global_step = 0
        self._losses: list[torch.Tensor | float] = []  # this optimizer step's micro-batch losses
        self._restored: dict[str, Any] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        if self.scheduler is not None:
            self.scheduler.close()  # the previous fit's run, left open for final metrics (idempotent)
        _run_before_checkpoints(trainer, self)
        _converge_before_saves(trainer, self)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # state restored by validate/test/predict(ckpt_path=...) is not the next fit's to resume
        self._restored = None
        _restore_saves(trainer)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        kwargs = dict(self.hdet_kwargs)
        kwargs.setdefault("model", pl_module)
        kwargs["track"] = _tracker_for(trainer, self.track)
        kwargs.setdefault("close_at_end", False)
        configs = list(trainer.lr_scheduler_configs)
        onecycle = [c for c in configs if isinstance(c.scheduler, OneCycleLR)]
        if onecycle:
            config = onecycle[0]
            if config.interval != "step" or config.frequency != 1:
                raise ValueError(
                    "Expected the OneCycleLR from configure_optimizers to step every optimizer step "
                    f"(interval='step', frequency=1), but got interval={config.interval!r}, "
                    f"frequency={config.frequency!r}: HDET steps once per optimizer step"
                )
            self.scheduler = HDETScheduler.from_onecycle(config.scheduler, **kwargs)
            # Lightning must not step it too: HDET steps once per optimizer step, with the loss.
            trainer.strategy.lr_scheduler_configs = [c for c in configs if c is not config]
        elif self.max_lr is not None:
            optimizer = trainer.optimizers[0]
            self.scheduler = HDETScheduler(
                optimizer, self.max_lr, total_steps=int(trainer.estimated_stepping_batches), **kwargs
            )
        else:
            raise ValueError(
                "Expected configure_optimizers to return a OneCycleLR, or HDETCallback(max_lr=...), but got neither"
            )
        self._fitting = True
        if self._restored is not None:  # resuming from a Lightning checkpoint (ckpt_path=...)
            self.scheduler.load_state_dict(self._restored)
            self._restored = None
        self._last_global_step = trainer.global_step
        self._losses = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.scheduler is None or not self._fitting:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        elif loss is not None:
            self._losses.append(float(loss))
        if trainer.global_step == self._last_global_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_global_step = trainer.global_step
        step_loss = _step_loss(self._losses, trainer, pl_module)
        self._losses = []
        if self.scheduler.last_epoch < self.scheduler.total_steps:
            self.scheduler.step(step_loss)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Every rank validates after the same step. A validation whose metric picks a checkpoint
        # runs on the consensus that checkpoint will hold; any other gets the last sync's record
        # into tracking first.
        if self.scheduler is None or not self._fitting:
            return
        if not trainer.sanity_checking and any(getattr(c, "monitor", None) for c in trainer.checkpoint_callbacks):
            self.scheduler.sync_now()
        else:
            self.scheduler.gather_pending()

    def state_dict(self) -> dict[str, Any]:
        # Lightning asks every rank while it checkpoints (the saves converge first, see
        # _converge_before_saves; this covers a dump that bypasses trainer.save_checkpoint).
        if self.scheduler is None:
            return {}
        if self._fitting:
            self.scheduler.sync_now()
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("scheduler")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # A fit that reached the schedule's last step (synced there) leaves the run open for final
        # metrics (callback.scheduler.log_metrics(...)), as a plain scheduler does: it ends FINISHED
        # at the next fit, close() or the process's exit. A fit stopped early (max_epochs, early
        # stopping) converges the replicas it leaves (a collective: every rank is here) and ends the
        # run now: the process's exit would take the unfinished schedule for a failure.
        self._fitting = False
        if self.scheduler is not None and self.scheduler.last_epoch < self.scheduler.total_steps:
            self.scheduler.sync_now()
            self.scheduler.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls this for an exception in fit, validate, test or predict; only a failing
        # fit's training ends its run FAILED (a failed test() after a finished fit does not).
        self._restored = None
        _restore_saves(trainer)  # Lightning calls no teardown hook here
        if self._fitting and self.scheduler is not None:
            self._fitting = False
            status = "KILLED" if isinstance(exception, KeyboardInterrupt) else "FAILED"
            self.scheduler.close(status, f"{type(exception).__name__}: {exception}")


def _step_loss(losses: list[torch.Tensor | float], trainer: Any, pl_module: Any) -> torch.Tensor | float | None:
    """The optimizer step's training loss: the mean of its micro-batches' losses. Under automatic
    optimization Lightning hands each as its loss divided by ``accumulate_grad_batches``."""
    if not losses:
        return None
    scale = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    if all(isinstance(v, torch.Tensor) for v in losses):
        return torch.stack([v.reshape(()).float() for v in losses]).mean() * scale
    return sum(float(v) for v in losses) / len(losses) * scale


def _run_before_checkpoints(trainer: Any, callback: HDETCallback) -> None:
    """HDET steps before any checkpoint callback saves at the same step (Lightning puts its own
    checkpoint callbacks last at construction; one added later, e.g. by ``wrap``, is not)."""
    callbacks = trainer.callbacks
    first = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), None)
    mine = callbacks.index(callback) if callback in callbacks else None
    if first is not None and mine is not None and mine > first:
        callbacks.insert(first, callbacks.pop(mine))


def _converge_before_saves(trainer: Any, callback: HDETCallback) -> None:
    """Every checkpoint written during the fit (every rank calls ``trainer.save_checkpoint``)
    converges first: the model's weights, collected before any callback hook runs, and weights-only
    checkpoints (which call no callback hook) then hold the consensus. Wraps whatever
    ``trainer.save_checkpoint`` is (someone else's wrapper too); :func:`_restore_saves` undoes it."""
    save = trainer.save_checkpoint
    if getattr(save, "_hdet_callback", None) is callback:
        return

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        if callback._fitting and callback.scheduler is not None:
            callback.scheduler.sync_now()
        return save(*args, **kwargs)

    save_checkpoint._hdet_callback = callback  # type: ignore[attr-defined]
    save_checkpoint._hdet_previous = trainer.__dict__.get("save_checkpoint")  # type: ignore[attr-defined]
    trainer.save_checkpoint = save_checkpoint


def _restore_saves(trainer: Any) -> None:
    current = trainer.__dict__.get("save_checkpoint")
    if getattr(current, "_hdet_callback", None) is None:
        return
    previous = current._hdet_previous
    if previous is None:
        del trainer.__dict__["save_checkpoint"]
    else:
        trainer.save_checkpoint = previous


def wrap_trainer(trainer: Any, **hdet_kwargs: Any) -> Any:
    """Add an :class:`HDETCallback` to a ``pl.Trainer`` (before its checkpoint callbacks); returns the trainer."""
    callback = HDETCallback(**hdet_kwargs)
    trainer.callbacks.append(callback)
    _run_before_checkpoints(trainer, callback)
    return trainer

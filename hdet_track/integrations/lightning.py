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

from ..scheduler import HDETScheduler, check_hdet_kwargs

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the standalone package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(
            "hdet_track.integrations.lightning needs Lightning: pip install 'hdet-track[lightning]'"
        ) from exc

__all__ = ["HDETCallback", "wrap_trainer"]


def _tracker_for(trainer: Any, track: Any) -> Any:
    """Lightning's own logger's run when there is one, else ``track`` as given."""
    if track is False or track is None:
        return False
    loggers = getattr(trainer, "loggers", []) or []
    for logger in loggers:
        name = type(logger).__name__
        if name == "MLFlowLogger":
            from ..tracking.mlflow import MLflowTracker

            run_id = logger.run_id if trainer.global_rank == 0 else None
            return MLflowTracker(tracking_uri=getattr(logger, "_tracking_uri", None), run_id=run_id)
        if name == "WandbLogger":
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

    Its state is part of Lightning's checkpoints: the replicas converge when a checkpoint is taken
    (Lightning keeps rank 0's weights), and ``trainer.fit(..., ckpt_path=...)`` resumes the
    schedule where it stopped.

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
        self._last_global_step = 0
        self._restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.scheduler is not None:
            self.scheduler.close()  # the previous fit's run, left open for final metrics
        kwargs = dict(self.hdet_kwargs)
        kwargs.setdefault("model", pl_module)
        kwargs["track"] = _tracker_for(trainer, self.track)
        kwargs.setdefault("close_at_end", False)
        configs = list(trainer.lr_scheduler_configs)
        onecycle = [c for c in configs if isinstance(c.scheduler, OneCycleLR)]
        if onecycle:
            self.scheduler = HDETScheduler.from_onecycle(onecycle[0].scheduler, **kwargs)
            # Lightning must not step it too: HDET steps once per optimizer step, with the loss.
            trainer.strategy.lr_scheduler_configs = [c for c in configs if c is not onecycle[0]]
        elif self.max_lr is not None:
            optimizer = trainer.optimizers[0]
            self.scheduler = HDETScheduler(
                optimizer, self.max_lr, total_steps=int(trainer.estimated_stepping_batches), **kwargs
            )
        else:
            raise ValueError(
                "Expected configure_optimizers to return a OneCycleLR, or HDETCallback(max_lr=...), but got neither"
            )
        if self._restored is not None:  # resuming from a Lightning checkpoint (ckpt_path=...)
            self.scheduler.load_state_dict(self._restored)
            self._restored = None
        self._last_global_step = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.scheduler is None or trainer.global_step == self._last_global_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_global_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if self.scheduler.last_epoch < self.scheduler.total_steps:
            self.scheduler.step(loss)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        # Every rank validates after the same step: the last sync's record goes to tracking first.
        if self.scheduler is not None:
            self.scheduler.gather_pending()

    def state_dict(self) -> dict[str, Any]:
        # Lightning asks every rank while it checkpoints and writes rank 0's model and optimizer:
        # converge first (every rank is here), so the checkpoint holds the consensus all resume from.
        if self.scheduler is None:
            return {}
        self.scheduler.sync_now()
        return {"scheduler": self.scheduler.state_dict()}

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # The model's weights were collected before state_dict() converged the replicas.
        if self.scheduler is not None and "state_dict" in checkpoint:
            checkpoint["state_dict"] = trainer.strategy.lightning_module_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("scheduler")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # A fit that reached the schedule's last step leaves the run open for final metrics
        # (callback.scheduler.log_metrics(...)), as a plain scheduler does: it ends FINISHED at the
        # next fit, close() or the process's exit. A fit stopped early (max_epochs, early stopping)
        # ends it now: the process's exit would take the unfinished schedule for a failure.
        if self.scheduler is not None and self.scheduler.last_epoch < self.scheduler.total_steps:
            self.scheduler.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.scheduler is not None:
            status = "KILLED" if isinstance(exception, KeyboardInterrupt) else "FAILED"
            self.scheduler.close(status, f"{type(exception).__name__}: {exception}")


def wrap_trainer(trainer: Any, **hdet_kwargs: Any) -> Any:
    """Add an :class:`HDETCallback` to a ``pl.Trainer``; returns the trainer."""
    trainer.callbacks.append(HDETCallback(**hdet_kwargs))
    return trainer

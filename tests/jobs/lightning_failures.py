"""2-rank Lightning fits (gloo, CPU) for tests/test_lightning_more.py; HDET tracks to MLflow
(MLFLOW_TRACKING_URI). The first argument is the mode:

- ``fail``: ``strategy="ddp"``; rank 1's training_step raises at step 6 (rank 0 has flushed its
  run first, so that ending it is quick).
- ``fail-slow``: the same, and rank 0 reaches HDET's on_exception only 8 s after its own error
  (another callback's on_exception first): Lightning's launcher, which polls its ranks every 5 s,
  has seen rank 1 exit by then.
- ``spawn``: ``strategy="ddp_spawn"``; the fit reaches its end, the module logs a final metric in
  on_fit_end (rank 0, in the worker), and the process that called fit() reads callback.scheduler.

Lightning's ``ddp`` launcher starts rank 1 by running this file again."""

from __future__ import annotations

import os
import sys
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from hdet_track.integrations.lightning import HDETCallback

MODE = sys.argv[1]


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if MODE.startswith("fail") and self.global_rank == 1 and self.global_step == 6:
            raise RuntimeError("boom on rank 1")
        return F.mse_loss(self.net(batch[0]), batch[1])

    def on_fit_end(self):
        hdet = next(c for c in self.trainer.callbacks if isinstance(c, HDETCallback))
        hdet.scheduler.log_metrics({"final_loss": 0.5})

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": onecycle, "interval": "step"}}


class FlushAt5(pl.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 5 and trainer.global_rank == 0:
            next(c for c in trainer.callbacks if isinstance(c, HDETCallback)).scheduler.flush()


class SlowToFail(pl.Callback):
    def on_exception(self, trainer, module, exception):
        if trainer.global_rank == 0:
            time.sleep(8)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


if __name__ == "__main__":
    callback = HDETCallback(spread=0.3, sync_every=4, auto_lr=True)
    callbacks = ([SlowToFail()] if MODE == "fail-slow" else []) + [callback, FlushAt5()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn" if MODE == "spawn" else "ddp", max_steps=12,
        logger=False, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, default_root_dir=os.getcwd(),
    )  # fmt: skip
    trainer.fit(Module(), data())
    if MODE == "spawn":
        print(f"after fit: scheduler {callback.scheduler!r}", flush=True)  # the workers' copies had theirs

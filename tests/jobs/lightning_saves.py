"""A 2-rank Lightning DDP fit (gloo, CPU) for tests/test_lightning.py. HDET syncs every 5 steps;
``ModelCheckpoint``s write a weights-only checkpoint every 6 steps (mid-window) and one at every
validation (monitoring val_loss); the fit stops at step 14, as EarlyStopping does. Each rank writes
its parameters at the start of every step and at the fit's end, and rank 0 every validation's
val_loss, under OUT (the first argument). Lightning's launcher starts rank 1 by running this file again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from hdet_track.integrations.lightning import HDETCallback

STOP_AT = 14


def data(n: int, batch: int) -> DataLoader:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch)


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        if self.global_step + 1 >= STOP_AT:
            self.trainer.should_stop = True
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=24)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": onecycle, "interval": "step"}}


class Dump(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def _write(self, trainer, module, kind: str) -> None:
        flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()
        with open(self.out / f"params{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([kind, trainer.global_step, flat]) + "\n")

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._write(trainer, module, "start")

    def on_train_end(self, trainer, module):
        self._write(trainer, module, "end")

    def on_validation_end(self, trainer, module):
        if trainer.global_rank == 0 and not trainer.sanity_checking:
            with open(self.out / "val.jsonl", "a") as f:
                f.write(json.dumps([trainer.global_step, float(trainer.callback_metrics["val_loss"])]) + "\n")


if __name__ == "__main__":
    OUT = Path(sys.argv[1])
    callbacks = [
        HDETCallback(spread=0.5, sync_every=5, auto_lr=True),
        Dump(OUT),
        ModelCheckpoint(
            OUT / "weights", filename="{step}", every_n_train_steps=6, save_top_k=-1, save_weights_only=True
        ),
        ModelCheckpoint(OUT / "best", filename="{step}", monitor="val_loss", save_top_k=-1),
    ]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=24, logger=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=OUT, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Module(), data(64, 8), data(32, 16))
    if trainer.global_rank == 0:
        print("fit done at step", trainer.global_step, flush=True)

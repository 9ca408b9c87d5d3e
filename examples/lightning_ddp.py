"""PyTorch Lightning with DDP on 2 CPU processes, switched to HDET with one callback.

    python examples/lightning_ddp.py         # logs to MLflow (MLFLOW_TRACKING_URI or sqlite:///mlflow.db)

Lightning starts the second process itself (strategy="ddp", gloo on CPU). The module keeps its
OneCycleLR; HDETCallback takes it over. With HDET_TRACKER=wandb it logs through a WandbLogger.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hdet_track.examples.digits import load_digits_split
from hdet_track.integrations.lightning import HDETCallback


class Digits(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        torch.manual_seed(0)  # the same initial weights on every replica
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class DumpAfterSync(pl.Callback):
    """Test hook: save this rank's flat parameters and learning rate after every optimizer step."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        torch.save(flat, os.path.join(self.directory, f"rank{trainer.global_rank}-step{trainer.global_step}.pt"))
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        with open(os.path.join(self.directory, f"lr{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps([trainer.global_step, lr]) + "\n")

    def on_validation_start(self, trainer, pl_module):
        """The last sync's record as validation starts: its step and whether its divergences are in."""
        if trainer.sanity_checking:
            return
        hdet = next(c for c in trainer.callbacks if isinstance(c, HDETCallback))
        last = hdet.scheduler.last_sync
        complete = bool(torch.isfinite(torch.tensor(last.divergences)).all())
        with open(os.path.join(self.directory, f"val{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps([trainer.global_step, last.step, complete]) + "\n")


class KillAfter(pl.Callback):
    """Test hook: the whole job dies (SIGKILL) once the checkpoint at step ``step`` is written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            hdet = next(c for c in trainer.callbacks if isinstance(c, HDETCallback))
            hdet.scheduler.flush()
            trainer.strategy.barrier()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps into --ckpt-dir")
    parser.add_argument("--ckpt-dir", default="checkpoints")
    parser.add_argument("--resume", default=None, help="a checkpoint file to resume from (fit(ckpt_path=...))")
    parser.add_argument("--run-id", default=None, help="the MLflow run to log into (a resumed job's)")
    parser.add_argument("--val-every", type=int, default=0, help="validate every N epochs (10 steps each; 0: never)")
    parser.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    x, y, x_val, y_val = load_digits_split()
    # 1,280 images: 10 steps per epoch on 2 replicas, so epochs (and resumes at their ends) see the same order
    loader = DataLoader(
        TensorDataset(x[:1280], y[:1280]), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    if os.environ.get("HDET_TRACKER") == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        logger = WandbLogger(project=os.environ.get("WANDB_PROJECT", "hdet"))
    else:
        from lightning.pytorch.loggers import MLFlowLogger

        logger = MLFlowLogger(
            experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", "hdet"),
            tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"),
            run_id=args.run_id,
        )
    # HDET's callback must come first so that the dump sees the averaged parameters.
    callbacks = [HDETCallback(spread=0.3, sync_every=20, auto_lr=True, auto_lr_warmup=args.steps // 4)]
    if args.dump:
        callbacks.append(DumpAfterSync(args.dump))
    if args.save_every:
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(
            ModelCheckpoint(args.ckpt_dir, filename="{step}", every_n_train_steps=args.save_every, save_top_k=-1)
        )
    if args.kill_at:
        callbacks.append(KillAfter(args.kill_at))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.replicas,
        strategy="ddp",
        max_steps=args.steps,
        max_epochs=-1,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_checkpointing=bool(args.save_every),
        enable_model_summary=False,
        check_val_every_n_epoch=max(args.val_every, 1),
    )
    val = DataLoader(TensorDataset(x_val, y_val), batch_size=256) if args.val_every else None
    trainer.fit(Digits(args.steps), loader, val, ckpt_path=args.resume)


if __name__ == "__main__":
    main()

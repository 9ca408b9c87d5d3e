"""A plain PyTorch loop that already uses OneCycleLR, switched to HDET with one line.

    python examples/plain_loop.py            # 2 local gloo replicas, logged to MLflow

It starts its own worker processes (torch's elastic launcher, 127.0.0.1) and logs to whatever
MLFLOW_TRACKING_URI / HDET_TRACKER say (MLflow's default store, sqlite:///mlflow.db, otherwise).
Under torchrun, call ``dist.init_process_group("gloo")`` and then ``main_worker(steps)`` from your
script instead of ``launch``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hdet_track
from hdet_track.examples.digits import load_digits_split
from hdet_track.launch import launch_local


def main_worker(steps: int) -> None:
    rank = dist.get_rank()
    x_train, y_train, x_val, y_val = load_digits_split()
    torch.manual_seed(0)  # the same initial weights on every replica
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.3, total_steps=steps)
    # The one line: the same OneCycle schedule, now fanned out across the replicas and tracked.
    scheduler = hdet_track.wrap(
        scheduler,
        spread=0.3,
        sync_every=20,
        auto_lr=True,
        auto_lr_warmup=steps // 4,
        model=model,
        track=True,
        close_at_end=False,
    )
    batches = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(len(x_train), (64,), generator=batches)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step(loss)
    with torch.no_grad():
        logits = model(x_val)  # the replicas were averaged at the last step: one model
        accuracy = float((logits.argmax(1) == y_val).float().mean())
    scheduler.log_metrics({"val_loss": float(F.cross_entropy(logits, y_val)), "val_accuracy": accuracy})
    scheduler.close()
    if rank == 0:
        print(f"validation accuracy {accuracy:.3f}; runs: {scheduler.run_ids}")


def _entry(steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        main_worker(steps)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(replicas: int, steps: int) -> None:
    launch_local(_entry, replicas, steps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    launch(args.replicas, args.steps)

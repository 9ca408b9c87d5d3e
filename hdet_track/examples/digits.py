"""HDET on scikit-learn's bundled 8x8 digits: an MLP trained by N gloo replicas on one machine.

Each replica draws its own mini-batches, trains with its own learning-rate multiplier, and
every ``sync_every`` steps the replicas are averaged and the controller moves the base LR.
Rank 0 prints every replica's LR and window loss at each sync.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hdet_track import HDETScheduler


@dataclass(frozen=True)
class DigitsConfig:
    steps: int = 300
    sync_every: int = 25
    spread: float = 0.3
    max_lr: float = 0.2
    auto_lr: bool = True
    auto_lr_warmup: int = 75
    batch_size: int = 64
    seed: int = 0


def load_digits_split(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised digits: 1,437 training and 360 validation images (a fixed, seeded split)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the digits example needs scikit-learn (it ships the data): pip install scikit-learn"
        ) from exc
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    n_val = len(x) // 5
    x_train, y_train, x_val, y_val = x[n_val:], y[n_val:], x[:n_val], y[:n_val]
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-3)
    return (x_train - mean) / std, y_train, (x_val - mean) / std, y_val


def make_mlp(seed: int = 0) -> nn.Module:
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # identical initial weights on every replica
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    torch.random.set_rng_state(gen_state)
    return model


def train(cfg: DigitsConfig) -> dict:
    """Train in this process as one replica of the initialised process group (or alone)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    x_train, y_train, x_val, y_val = load_digits_split(cfg.seed)
    model = make_mlp(cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.max_lr, momentum=0.9, nesterov=True)
    sched = HDETScheduler(
        opt,
        max_lr=cfg.max_lr,
        total_steps=cfg.steps,
        spread=cfg.spread,
        sync_every=cfg.sync_every,
        auto_lr=cfg.auto_lr,
        auto_lr_warmup=cfg.auto_lr_warmup,
        model=model,
        seed=cfg.seed,
    )
    batches = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    if rank == 0:
        n = sched.world_size
        print(f"HDET on digits: {n} replicas, {cfg.steps} steps, sync every {cfg.sync_every}, spread {cfg.spread}")
        print(f"{'step':>5} | " + " | ".join(f"replica {r}: lr / loss" for r in range(n)))
    for _ in range(cfg.steps):
        idx = torch.randint(len(x_train), (cfg.batch_size,), generator=batches)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        # The LRs this window used, before step() averages and re-assigns them.
        used = sched.replica_values("lr")
        sched.step(loss)
        report = sched.last_sync
        if rank == 0 and report is not None and report.step == sched.last_epoch:
            cells = [f"{used[r][0]:.3g} / {report.window_losses[r]:.3f}" for r in range(sched.world_size)]
            print(f"{report.step:>5} | " + " | ".join(f"{c:>22}" for c in cells), flush=True)
    with torch.no_grad():
        logits = model(x_val)
        val_loss = float(F.cross_entropy(logits, y_val))
        accuracy = float((logits.argmax(1) == y_val).float().mean())
    if rank == 0:
        print(f"validation (averaged model): loss {val_loss:.4f}, accuracy {accuracy:.3f}")
    return {"val_loss": val_loss, "val_accuracy": accuracy, "final_lr": opt.param_groups[0]["lr"]}


def worker(cfg: DigitsConfig) -> dict:
    """Entry point of one launched replica (RANK, WORLD_SIZE, MASTER_* set by the launcher)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        return train(cfg)
    finally:
        dist.destroy_process_group()


def launch(cfg: DigitsConfig, replicas: int = 4) -> dict:
    """Start ``replicas`` local gloo processes through torch's elastic launcher; rank 0's result."""
    import socket
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=replicas,
        run_id=f"hdet-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=0,
        monitor_interval=0.2,
        local_addr="127.0.0.1",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = elastic_launch(config, worker)(cfg)
    return results[0]

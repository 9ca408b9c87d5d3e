"""The paper's ablation, runnable on one machine: OneCycle (conservative and aggressive max_lr),
HDET without auto-LR and full HDET, on the same data order, seed and step budget, each with N
real gloo replicas launched by torch's elastic launcher, all logged to one experiment.

This module is also a template: ``train_one`` is an ordinary data-parallel training function in
which ``HDETScheduler`` replaces ``OneCycleLR``.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hdet_track import HDETScheduler, NonFiniteReplicasError
from hdet_track.launch import launch_local

FASHION_DIRS = ("/usr/share/datasets/fashion-mnist",)


class DataError(ValueError):
    """A dataset could not be found or read."""


@dataclass(frozen=True)
class RunSpec:
    """One run of the ablation."""

    name: str
    max_lr: float
    spread: float
    auto_lr: bool


@dataclass(frozen=True)
class AblationConfig:
    dataset: str = "digits"
    data_dir: str | None = None
    replicas: int = 4
    steps: int = 600
    sync_every: int = 25
    batch_size: int = 64
    low_lr: float = 0.05
    high_lr: float = 0.5
    spread: float = 0.5
    grad_mode: str = "shared"  # "shared" (DDP, the paper's algorithm) or "independent"
    tracker: str = "mlflow"
    compare_group: str = ""
    seed: int = 0
    runs: tuple[RunSpec, ...] = field(default_factory=tuple)

    def ablation(self, quick: bool) -> tuple[RunSpec, ...]:
        full = (
            RunSpec("baseline-low", self.low_lr, 0.0, False),
            RunSpec("baseline-high", self.high_lr, 0.0, False),
            RunSpec("hdet-no-auto-lr", self.high_lr, self.spread, False),
            RunSpec("hdet", self.high_lr, self.spread, True),
        )
        return (full[1], full[3]) if quick else full


# ---------------------------------------------------------------------- data
def _read_idx(path: Path) -> torch.Tensor:
    import gzip
    import struct

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype, ndim = struct.unpack_from(">HBB", data, 0)
    if zero != 0 or dtype != 0x08:
        raise DataError(f"{path} is not an idx file of unsigned bytes")
    dims = struct.unpack_from(">" + "I" * ndim, data, 4)
    return torch.frombuffer(bytearray(data[4 + 4 * ndim :]), dtype=torch.uint8).reshape(dims)


def _find(directory: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (directory / name).exists():
            return directory / name
    raise DataError(f"missing {stem}[.gz] in {directory}")


def load_dataset(name: str, data_dir: str | None, seed: int) -> tuple[torch.Tensor, ...]:
    """(x_train, y_train, x_val, y_val), standardised with the training set's statistics."""
    if name == "digits":
        from .digits import load_digits_split

        return load_digits_split(seed)
    if name == "fashion-mnist":
        candidates = [Path(data_dir)] if data_dir else [Path(d) for d in FASHION_DIRS]
        for directory in candidates:
            if directory.is_dir():
                try:
                    x_train = _read_idx(_find(directory, "train-images-idx3-ubyte")).float().reshape(-1, 784) / 255
                    y_train = _read_idx(_find(directory, "train-labels-idx1-ubyte")).long()
                    x_val = _read_idx(_find(directory, "t10k-images-idx3-ubyte")).float().reshape(-1, 784) / 255
                    y_val = _read_idx(_find(directory, "t10k-labels-idx1-ubyte")).long()
                except (OSError, DataError) as exc:
                    raise DataError(f"cannot read Fashion-MNIST from {directory}: {exc}") from None
                mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-3)
                return (x_train - mean) / std, y_train, (x_val - mean) / std, y_val
        raise DataError(
            "Fashion-MNIST not found: pass --data-dir DIR with the four idx files, or install Debian's "
            "package (apt-get install dataset-fashion-mnist) which puts them under /usr/share/datasets/fashion-mnist"
        )
    raise DataError(f"unknown dataset {name!r}: choose digits or fashion-mnist")


def make_model(inputs: int, classes: int, seed: int) -> nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # the same initial weights on every replica and in every run
    model = nn.Sequential(nn.Linear(inputs, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, classes))
    torch.random.set_rng_state(state)
    return model


# ---------------------------------------------------------------------- one run (one replica)
def _track(cfg: AblationConfig, spec: RunSpec):
    if cfg.tracker == "wandb":
        from hdet_track.tracking.wandb import WandbTracker

        return WandbTracker(run_name=spec.name)
    from hdet_track.tracking.mlflow import MLflowTracker

    return MLflowTracker(run_name=spec.name)


def train_one(cfg: AblationConfig, spec: RunSpec) -> dict:
    """Train ``spec`` as this process's replica of the initialised process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_val, y_val = load_dataset(cfg.dataset, cfg.data_dir, cfg.seed)
    model = make_model(x_train.shape[1], int(y_train.max()) + 1, cfg.seed)
    net = nn.parallel.DistributedDataParallel(model) if cfg.grad_mode == "shared" else model
    opt = torch.optim.SGD(model.parameters(), lr=spec.max_lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = HDETScheduler(
        opt,
        max_lr=spec.max_lr,
        total_steps=cfg.steps,
        spread=spec.spread,
        sync_every=cfg.sync_every,
        auto_lr=spec.auto_lr,
        auto_lr_warmup=cfg.steps // 4 if spec.auto_lr else 0,
        model=model,
        seed=cfg.seed,
        track=_track(cfg, spec),
        compare_group=cfg.compare_group,
        run_name=spec.name,
        close_at_end=False,
    )
    batches = torch.Generator().manual_seed(cfg.seed * 1000 + rank)  # the same data order in every run
    started = time.monotonic()
    diverged_at = None
    try:
        for k in range(1, cfg.steps + 1):
            idx = torch.randint(len(x_train), (cfg.batch_size,), generator=batches)
            loss = F.cross_entropy(net(x_train[idx]), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step(loss)
            report = sched.last_sync
            if report is not None and report.step == k:
                val_loss, val_acc = evaluate(model, x_val, y_val)
                sched.log_metrics({"val_loss": val_loss, "val_accuracy": val_acc}, step=k)
                if rank == 0:
                    _progress(spec.name, k, cfg.steps, report.window_losses, val_loss, started)
    except NonFiniteReplicasError as exc:
        diverged_at = exc.step
        sched.log_metrics({"diverged_at_step": float(exc.step)}, step=exc.step)
        sched.close("FAILED", f"diverged: every replica non-finite at step {exc.step}")
        if rank == 0:
            print(f"\n[{spec.name}] diverged at step {exc.step}", flush=True)
    val_loss, val_acc = evaluate(model, x_val, y_val)
    if diverged_at is None:
        sched.log_metrics({"val_loss": val_loss, "val_accuracy": val_acc}, step=cfg.steps)
        sched.close()
    if rank == 0:
        print(flush=True)
    return {
        "name": spec.name,
        "run_ids": sched.run_ids,
        "val_loss": val_loss,
        "val_accuracy": val_acc,
        "diverged_at": diverged_at,
        "world": world,
    }


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(x)
        loss = float(F.cross_entropy(logits, y))
        acc = float((logits.argmax(1) == y).float().mean())
    return (loss if math.isfinite(loss) else math.nan), acc


def _progress(name: str, k: int, steps: int, losses: list[float], val_loss: float, started: float) -> None:
    width = 24
    done = int(width * k / steps)
    bar = "#" * done + "-" * (width - done)
    cells = " ".join(f"{x:.3f}" if math.isfinite(x) else "nan" for x in losses)
    line = f"[{name:>15}] [{bar}] {k}/{steps} replica losses {cells} | val {val_loss:.3f} | {time.monotonic() - started:.0f}s"
    end = "\r" if sys.stdout.isatty() else "\n"
    print(line, end=end, flush=True)


def worker(cfg: AblationConfig, spec: RunSpec) -> dict:
    """Entry point of one launched replica (RANK, WORLD_SIZE, MASTER_* set by the launcher)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        result = train_one(cfg, spec)
        dist.barrier()  # no replica tears down while another still finishes the last collective
        return result
    finally:
        dist.destroy_process_group()


def launch_run(cfg: AblationConfig, spec: RunSpec) -> dict:
    """Start ``cfg.replicas`` local gloo processes for one run; rank 0's result."""
    return launch_local(worker, cfg.replicas, cfg, spec)[0]


def run_ablation(cfg: AblationConfig, quick: bool) -> list[dict]:
    specs = cfg.runs or cfg.ablation(quick)
    load_dataset(cfg.dataset, cfg.data_dir, cfg.seed)  # fail fast, before any process starts
    return [launch_run(replace(cfg, runs=()), spec) for spec in specs]


__all__ = [
    "AblationConfig",
    "RunSpec",
    "run_ablation",
    "launch_run",
    "train_one",
    "load_dataset",
    "DataError",
]

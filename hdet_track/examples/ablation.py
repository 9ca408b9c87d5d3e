"""The paper's ablation, runnable on one machine: OneCycle (conservative and aggressive max_lr),
HDET without auto-LR and full HDET, on the same data order, seed and step budget, each with N
real gloo replicas launched by torch's elastic launcher, all logged to one experiment.

This module is also a template: ``train_one`` is an ordinary data-parallel training function in
which ``HDETScheduler`` replaces ``OneCycleLR``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from hdet_track import HDETScheduler, NonFiniteReplicasError
from hdet_track.launch import launch_local

from .tasks import DATASETS, DataError, load_task

# (conservative, aggressive) max_lr per dataset: SGD+Nesterov for the MLPs, AdamW for the transformer
DEFAULT_LRS = {"digits": (0.05, 0.5), "fashion-mnist": (0.05, 0.5), "text": (2e-3, 2e-2)}
DEVICES = ("auto", "cpu", "cuda")


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
    text_file: str | None = None
    replicas: int = 4
    steps: int = 600
    sync_every: int = 25
    batch_size: int | None = None  # None: 64 images or 16 text windows
    low_lr: float | None = None  # None: DEFAULT_LRS[dataset]
    high_lr: float | None = None
    spread: float = 0.5
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl, one GPU per replica); see choose_device
    grad_mode: str = "shared"  # "shared" (DDP, the paper's algorithm) or "independent"
    tracker: str = "mlflow"
    compare_group: str = ""
    seed: int = 0
    runs: tuple[RunSpec, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise DataError(f"unknown dataset {self.dataset!r}: choose one of {', '.join(DATASETS)}")
        low, high = DEFAULT_LRS[self.dataset]
        object.__setattr__(self, "low_lr", low if self.low_lr is None else self.low_lr)
        object.__setattr__(self, "high_lr", high if self.high_lr is None else self.high_lr)
        if self.batch_size is None:
            object.__setattr__(self, "batch_size", 16 if self.dataset == "text" else 64)

    def ablation(self, quick: bool) -> tuple[RunSpec, ...]:
        full = (
            RunSpec("baseline-low", self.low_lr, 0.0, False),
            RunSpec("baseline-high", self.high_lr, 0.0, False),
            RunSpec("hdet-no-auto-lr", self.high_lr, self.spread, False),
            RunSpec("hdet", self.high_lr, self.spread, True),
        )
        return (full[1], full[3]) if quick else full

    def task(self):
        return load_task(self.dataset, data_dir=self.data_dir, text_file=self.text_file, seed=self.seed)


def choose_device(requested: str, replicas: int, gpus: int | None = None) -> str:
    """``"cuda"`` (nccl, one GPU per replica) or ``"cpu"`` (gloo) for ``requested`` in ``DEVICES``.

    ``auto`` takes the GPUs when there is one per replica (nccl cannot put two ranks on one GPU).
    """
    if requested not in DEVICES:
        raise ValueError(f"Expected device to be one of {', '.join(DEVICES)}, but got {requested!r}")
    gpus = (torch.cuda.device_count() if torch.cuda.is_available() else 0) if gpus is None else gpus
    if requested == "cpu":
        return "cpu"
    if gpus >= replicas:
        return "cuda"
    if requested == "cuda":
        raise ValueError(
            f"--device cuda needs one GPU per replica: {replicas} replicas but {gpus} GPU(s) visible; "
            "lower --replicas or use --device cpu"
        )
    return "cpu"


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
    device = torch.device("cpu")
    if cfg.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    task = cfg.task().to(device)
    model = task.model(cfg.seed).to(device)  # the same initial weights on every replica and in every run
    if cfg.grad_mode == "shared":
        net = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    else:
        net = model
    opt = task.optimizer(model.parameters(), spec.max_lr)
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
            inputs, targets = task.batch(batches, cfg.batch_size)
            loss = task.loss(net(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step(loss)
            report = sched.last_sync
            if report is not None and report.step == k:
                val_loss, val_acc = task.evaluate(model)
                sched.log_metrics({"val_loss": val_loss, "val_accuracy": val_acc}, step=k)
                if rank == 0:
                    _progress(spec.name, k, cfg.steps, report.window_losses, val_loss, started)
    except NonFiniteReplicasError as exc:
        diverged_at = exc.step
        sched.log_metrics({"diverged_at_step": float(exc.step)}, step=exc.step)
        sched.close("FAILED", f"diverged: every replica non-finite at step {exc.step}")
        if rank == 0:
            print(f"\n[{spec.name}] diverged at step {exc.step}", flush=True)
    val_loss, val_acc = task.evaluate(model)
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
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    try:
        result = train_one(cfg, spec)
        dist.barrier()  # no replica tears down while another still finishes the last collective
        return result
    finally:
        dist.destroy_process_group()


def launch_run(cfg: AblationConfig, spec: RunSpec) -> dict:
    """Start ``cfg.replicas`` local processes (gloo on CPU, nccl on GPUs) for one run; rank 0's result."""
    return launch_local(worker, cfg.replicas, cfg, spec)[0]


def run_ablation(cfg: AblationConfig, quick: bool) -> list[dict]:
    specs = cfg.runs or cfg.ablation(quick)
    cfg.task()  # fail fast, before any process starts
    return [launch_run(replace(cfg, runs=()), spec) for spec in specs]


__all__ = [
    "AblationConfig",
    "RunSpec",
    "run_ablation",
    "launch_run",
    "train_one",
    "choose_device",
    "DataError",
    "DEFAULT_LRS",
]

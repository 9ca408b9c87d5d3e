"""The paper's ablation, runnable on one machine: OneCycle (conservative and aggressive max_lr),
HDET without auto-LR and full HDET, on the same data order, seed and step budget, each with N
real gloo replicas launched by torch's elastic launcher, all logged to one experiment.

This module is also a template: ``train_one`` is an ordinary data-parallel training function in
which ``HDETScheduler`` replaces ``OneCycleLR``.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from hdet_track import HDETScheduler, NonFiniteReplicasError
from hdet_track.launch import launch_local

from .tasks import DATASETS, DataError, load_task

# (conservative, aggressive) max_lr per dataset: SGD+Nesterov for the MLPs, AdamW for the transformer.
# "Aggressive" is where plain OneCycle diverges: on digits the smallest of 0.5, 1, 2 and 4 at which the
# quick demo's OneCycle run did (seed 0), measured once the digits scaling was fixed (it was 0.5).
DEFAULT_LRS = {"digits": (0.05, 1.0), "fashion-mnist": (0.05, 0.5), "text": (2e-3, 2e-2)}
DEVICES = ("auto", "cpu", "cuda")


OPTIMIZERS = ("task", "schedulefree", "prodigy")


@dataclass(frozen=True)
class RunSpec:
    """One run of the ablation.

    ``optimizer``: ``"task"`` (the task's own optimizer under ``HDETScheduler``), or a one-run method
    with its own schedule, trained as plain data-parallel (DDP) job and tracked alongside:
    ``"schedulefree"`` (``schedulefree.SGDScheduleFree`` with the task's momentum and weight decay for
    the image tasks, ``AdamWScheduleFree`` for text; lr ``max_lr``) or ``"prodigy"``
    (``prodigyopt.Prodigy`` at lr 1.0 with ``CosineAnnealingLR`` over the budget; ``max_lr`` unused).
    ``controller``: ``"drift"`` (the default) or ``"paper"``. ``auto_lr_warmup``: ``None`` keeps each
    controller's setting in the demo: none for ``"drift"`` (it acts from the first sync), a quarter of
    the steps for ``"paper"`` (as in the paper's ablation).
    ``tags``: extra tags on the tracked run (e.g. a study's resume key).
    """

    name: str
    max_lr: float
    spread: float
    auto_lr: bool
    optimizer: str = "task"
    controller: str = "drift"
    auto_lr_warmup: int | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Expected optimizer to be one of {', '.join(OPTIMIZERS)}, but got {self.optimizer!r}")


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

    return MLflowTracker(run_name=spec.name, tags=dict(spec.tags) or None)


def _one_run_optimizer(task, model: nn.Module, spec: RunSpec, steps: int):
    """(optimizer, LR scheduler or None) of a one-run method, with the task's momentum/weight decay."""
    own = task.optimizer(model.parameters(), spec.max_lr).defaults
    if spec.optimizer == "schedulefree":
        import schedulefree

        if task.kind == "text":
            opt = schedulefree.AdamWScheduleFree(
                model.parameters(), lr=spec.max_lr, weight_decay=own.get("weight_decay", 0.0)
            )
        else:
            opt = schedulefree.SGDScheduleFree(
                model.parameters(),
                lr=spec.max_lr,
                momentum=own.get("momentum", 0.9),
                weight_decay=own.get("weight_decay", 0.0),
            )
        return opt, None
    from prodigyopt import Prodigy

    opt = Prodigy(model.parameters(), lr=1.0, weight_decay=own.get("weight_decay", 0.0))
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


def _set_mode(opt, training: bool) -> None:
    """Schedule-Free keeps two sequences: train() before steps, eval() (the averaged point) to evaluate."""
    if hasattr(opt, "eval") and hasattr(opt, "train"):
        opt.train() if training else opt.eval()


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
    own_schedule = None
    if spec.optimizer == "task":
        opt = task.optimizer(model.parameters(), spec.max_lr)
        tracked, averaged = opt, model
    else:
        # a one-run method steps its own schedule; HDETScheduler (spread 0, no auto-LR) only carries the
        # tracking on a placeholder parameter, so its logged "lr" series is not this optimizer's LR (that
        # one is logged as "optimizer_lr"); with DDP gradients the replicas stay identical anyway
        opt, own_schedule = _one_run_optimizer(task, model, spec, cfg.steps)
        tracked, averaged = torch.optim.SGD([nn.Parameter(torch.zeros(1, device=device))], lr=spec.max_lr), None
    warmup = spec.auto_lr_warmup
    if warmup is None:
        warmup = cfg.steps // 4 if spec.auto_lr and spec.controller == "paper" else 0
    sched = HDETScheduler(
        tracked,
        max_lr=spec.max_lr,
        total_steps=cfg.steps,
        spread=spec.spread,
        sync_every=cfg.sync_every,
        auto_lr=spec.auto_lr,
        controller=spec.controller,
        auto_lr_warmup=warmup,
        model=averaged,
        seed=cfg.seed,
        track=_track(cfg, spec),
        compare_group=cfg.compare_group,
        run_name=spec.name,
        close_at_end=False,
    )
    batches = torch.Generator().manual_seed(cfg.seed * 1000 + rank)  # the same data order in every run
    kill_at = _test_kill_step(spec.name, rank)
    started = time.monotonic()
    diverged_at = None
    try:
        _set_mode(opt, True)
        for k in range(1, cfg.steps + 1):
            inputs, targets = task.batch(batches, cfg.batch_size)
            loss = task.loss(net(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if own_schedule is not None:
                own_schedule.step()
            if tracked is not opt:
                tracked.step()  # the placeholder has no gradient: a no-op that keeps torch's step-order check quiet
            sched.step(loss)
            if kill_at == k:
                os.kill(os.getpid(), signal.SIGKILL)
            report = sched.last_sync
            if report is not None and report.step == k:
                val_loss, val_acc = _evaluate(task, model, opt)
                metrics = {"val_loss": val_loss, "val_accuracy": val_acc}
                if spec.optimizer != "task":
                    metrics["optimizer_lr"] = float(opt.param_groups[0]["lr"])
                sched.log_metrics(metrics, step=k)
                if rank == 0:
                    _progress(spec.name, k, cfg.steps, report.window_losses, val_loss, started)
    except NonFiniteReplicasError as exc:
        diverged_at = exc.step
        sched.log_metrics({"diverged_at_step": float(exc.step)}, step=exc.step)
        sched.close("FAILED", f"diverged: every replica non-finite at step {exc.step}")
        if rank == 0:
            print(f"\n[{spec.name}] diverged at step {exc.step}", flush=True)
    val_loss, val_acc = _evaluate(task, model, opt)
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


# Test hook, not a feature: HDET_TEST_KILL="<run name>:<rank>:<step>" makes that rank of that run
# SIGKILL itself after that step (what the OOM killer or a lost node does to one replica), so that
# tests/test_cli.py can check how `hdet-track demo` goes on when a worker process dies.
TEST_KILL_ENV = "HDET_TEST_KILL"


def _test_kill_step(name: str, rank: int) -> int | None:
    run, _, rest = os.environ.get(TEST_KILL_ENV, "").partition(":")
    who, _, step = rest.partition(":")
    return int(step) if run == name and who == str(rank) and step.isdigit() else None


def _evaluate(task, model: nn.Module, opt) -> tuple[float, float]:
    _set_mode(opt, False)
    try:
        return task.evaluate(model)
    finally:
        _set_mode(opt, True)


def _short(x: float) -> str:
    """4 significant digits (a blown-up loss reads 8.852e+12, not 8851980754964.426)."""
    return f"{x:.4g}" if math.isfinite(x) else str(x)


def _progress(name: str, k: int, steps: int, losses: list[float], val_loss: float, started: float) -> None:
    width = 24
    done = int(width * k / steps)
    bar = "#" * done + "-" * (width - done)
    cells = " ".join(_short(x) for x in losses)
    line = f"[{name:>15}] [{bar}] {k}/{steps} replica losses {cells} | val {_short(val_loss)} | {time.monotonic() - started:.0f}s"
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
    """Start ``cfg.replicas`` local processes (gloo on CPU, nccl on GPUs) for one run; rank 0's result.

    Raises:
        ChildFailedError: (torch's elastic launcher) a replica process died or raised.
    """
    return launch_local(worker, cfg.replicas, cfg, spec)[0]


def describe_failure(exc: BaseException) -> str:
    """One line on a launch that failed: which rank first, and its exit code or signal."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    rank, failure = exc.get_first_failure()
    if failure.exitcode < 0:
        line = f"rank {rank} was killed by {failure.signal_name()} (exit code {failure.exitcode})"
    else:
        line = f"rank {rank} exited with code {failure.exitcode}"
    message = failure.message if os.path.isfile(failure.error_file) else ""  # the worker's error file's words
    if isinstance(message, dict):
        message = str(message.get("message", ""))
    message = message.strip().splitlines()[-1] if message and message.strip() else ""
    others = len(failures) - 1
    return line + (f": {message}" if message else "") + (f" ({others} more rank(s) failed)" if others else "")


def run_ablation(cfg: AblationConfig, quick: bool, on_failure: Callable[[str, str], None] | None = None) -> list[dict]:
    """Every run of the ablation, one after the other (rank 0's results). A run whose processes
    failed does not stop the others: its result is ``{"name": ..., "run_ids": {}, "failed": why}``
    (one line, :func:`describe_failure`), also passed to ``on_failure(name, why)`` at once."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    specs = cfg.runs or cfg.ablation(quick)
    cfg.task()  # fail fast, before any process starts
    results = []
    for spec in specs:
        try:
            results.append(launch_run(replace(cfg, runs=()), spec))
        except ChildFailedError as exc:
            results.append({"name": spec.name, "run_ids": {}, "failed": describe_failure(exc)})
            if on_failure is not None:
                on_failure(spec.name, results[-1]["failed"])
    return results


__all__ = [
    "AblationConfig",
    "RunSpec",
    "run_ablation",
    "launch_run",
    "describe_failure",
    "train_one",
    "choose_device",
    "DataError",
    "DEFAULT_LRS",
    "OPTIMIZERS",
]

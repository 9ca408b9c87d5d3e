"""How the drift controller's defaults were fixed: the development-split grid of docs/controller.md.

The rule (stated in docs/controller.md before these runs): Fashion-MNIST *development split*
(train on the first 50,000 training images, validate on the last 10,000; the test set is never
read), the study's budget (an MLP, 4 gloo replicas, 800 steps, sync every 25, spread 0.5, batch 64),
both gradient modes, seed 100. The bar is the best OneCycle over max_lr 0.02, 0.05, 0.1, 0.2, 0.5.
Each candidate (the design values and five one-knob alternatives) runs at max_lr 0.02, 0.1 and 0.5
in both modes; its score is the worst final validation loss / bar over those 6 runs (a divergence
counts as infinite). The lowest worst case wins; within 0.01 of the design values' worst case the
design values stay.

Runs are untracked (only final validation losses enter the rule) and appended to ``--out`` as JSON
lines, so an interrupted grid continues where it stopped.

Run: .venv/bin/python bench/controller_dev.py --out docs/controller_dev.jsonl   (about an hour on 2 cores)
     .venv/bin/python bench/controller_dev.py --dataset digits --steps 100 --replicas 2 \
         --modes independent --lrs 0.1 --candidates design --out /tmp/dev.jsonl   (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from hdet_track import HDETScheduler, NonFiniteReplicasError  # noqa: E402
from hdet_track.controller import DriftController  # noqa: E402
from hdet_track.examples.tasks import ImageTask, load_task  # noqa: E402
from hdet_track.launch import launch_local  # noqa: E402

# The candidates of docs/controller.md: the design values and one-knob alternatives.
CANDIDATES: dict[str, dict] = {
    "design": {},
    "step-half": {"step": 0.5 * 0.5 * math.log((1 + 0.5) / (1 - 0.5))},  # half of half the log range at spread 0.5
    "dead-zone-1.0": {"dead_zone": 1.0},
    "dead-zone-2.5": {"dead_zone": 2.5},
    "forget-0.8": {"forget": 0.8},
    "two-sided": {"one_sided": False},
}
REFERENCE_LRS = (0.02, 0.05, 0.1, 0.2, 0.5)
CANDIDATE_LRS = (0.02, 0.1, 0.5)
MODES = ("shared", "independent")


@dataclass(frozen=True)
class DevRun:
    dataset: str
    mode: str
    arm: str  # "onecycle" or a candidate name
    max_lr: float
    steps: int
    replicas: int
    sync_every: int = 25
    spread: float = 0.5
    batch: int = 64
    seed: int = 100

    def key(self) -> str:
        return f"{self.dataset}/{self.mode}/{self.arm}/{self.max_lr:g}/{self.steps}/{self.replicas}/{self.seed}"


def dev_task(dataset: str, seed: int):
    """The development split: Fashion-MNIST's training images only (first 50k / last 10k)."""
    task = load_task(dataset, seed=seed)
    if dataset != "fashion-mnist":
        return task
    x, y = task.x_train, task.y_train  # the test images (task.x_val) are dropped here, never read
    return ImageTask("fashion-mnist-dev", x[:50_000], y[:50_000], x[50_000:], y[50_000:])


def train(run: DevRun) -> dict:
    rank = dist.get_rank()
    task = dev_task(run.dataset, run.seed)
    model = task.model(run.seed)
    net = nn.parallel.DistributedDataParallel(model) if run.mode == "shared" else model
    opt = task.optimizer(model.parameters(), run.max_lr)
    hdet = run.arm != "onecycle"
    sched = HDETScheduler(
        opt,
        max_lr=run.max_lr,
        total_steps=run.steps,
        spread=run.spread if hdet else 0.0,
        sync_every=run.sync_every,
        auto_lr=hdet,
        controller=DriftController(**CANDIDATES[run.arm]) if hdet else "drift",
        model=model,
        seed=run.seed,
    )
    batches = torch.Generator().manual_seed(run.seed * 1000 + rank)
    diverged_at = None
    try:
        for _ in range(run.steps):
            inputs, targets = task.batch(batches, run.batch)
            loss = task.loss(net(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step(loss)
    except NonFiniteReplicasError as exc:
        diverged_at = exc.step
    val_loss, val_acc = task.evaluate(model)
    if diverged_at is not None or not math.isfinite(val_loss):
        val_loss = math.inf
    ctrl = sched.controller
    return {
        "val_loss": val_loss,
        "val_accuracy": val_acc,
        "diverged_at": diverged_at,
        "final_drift": math.exp(ctrl._drift.get("lr", [0.0])[0]) if hdet else 1.0,
        "rollbacks": int(getattr(ctrl, "rollbacks", 0)),
    }


def _worker(run: DevRun) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = train(run)
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def select(results: dict[str, dict], dataset: str, steps: int, replicas: int, seed: int) -> dict:
    """The rule of docs/controller.md over finished runs: bar, each candidate's worst ratio, winner."""

    def val(mode: str, arm: str, lr: float) -> float | None:
        r = results.get(DevRun(dataset, mode, arm, lr, steps, replicas, seed=seed).key())
        return None if r is None else r["val_loss"]

    bar = {
        m: min((v for lr in REFERENCE_LRS if (v := val(m, "onecycle", lr)) is not None), default=None) for m in MODES
    }
    worst = {}
    for name in CANDIDATES:
        ratios = []
        for m in MODES:
            for lr in CANDIDATE_LRS:
                v = val(m, name, lr)
                if v is None or bar[m] is None:
                    break
                ratios.append(v / bar[m])
        if len(ratios) == len(MODES) * len(CANDIDATE_LRS):
            worst[name] = max(ratios)
    winner = None
    if "design" in worst and len(worst) == len(CANDIDATES):
        best = min(worst, key=worst.get)
        winner = "design" if worst["design"] - worst[best] <= 0.01 else best
    return {"bar": bar, "worst_ratio": worst, "winner": winner}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="default: the rule's max_lr values per arm")
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--no-onecycle", action="store_true")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seed", type=int, default=100)
    p.add_argument("--out", required=True, help="JSON-lines file; runs already in it are not repeated")
    args = p.parse_args()

    out = Path(args.out)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            rec = json.loads(line)
            done[rec["key"]] = rec
    plan = []
    for mode in args.modes:
        if not args.no_onecycle:
            plan += [
                DevRun(args.dataset, mode, "onecycle", lr, args.steps, args.replicas, seed=args.seed)
                for lr in args.lrs or REFERENCE_LRS
            ]
        for name in args.candidates:
            plan += [
                DevRun(args.dataset, mode, name, lr, args.steps, args.replicas, seed=args.seed)
                for lr in args.lrs or CANDIDATE_LRS
            ]
    for run in plan:
        if run.key() in done:
            continue
        started = time.monotonic()
        res = launch_local(_worker, run.replicas, run)[0]
        rec = {"key": run.key(), **asdict(run), **res, "wall_s": round(time.monotonic() - started, 1)}
        done[rec["key"]] = rec
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(
            f"{run.key():<48} val_loss {res['val_loss']:.4f} drift x{res['final_drift']:.3g} ({rec['wall_s']} s)",
            flush=True,
        )
    outcome = select(done, args.dataset, args.steps, args.replicas, args.seed)
    print(json.dumps({"bench": "controller_dev.selection", **outcome}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

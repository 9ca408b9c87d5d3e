"""Which way does each signal point? The probe-batch exploration of docs/controller.md (after round 17).

The fan-out alone (``spread=0.5, auto_lr=False``: every replica trains at OneCycle's LR times its
multiplier, so the right direction is known: larger at a max_lr below the best of the sweep,
smaller above it) on the development split. At every sync, before averaging, three readings of
"did the larger LR do better?", each the sign of a slope against the replicas' log LRs:

- ``window``: the window-mean training losses (what the drift controller reads),
- ``end``: every replica's loss on one fixed probe batch (2,048 development-training images, the
  same on every rank; ``TailProbe`` of bench/controller_dev.py) at its parameters at the sync,
- ``tail``: the same probe at the average of its iterates over the window's second half.

Records (one JSON line per run, the slopes per sync) go to ``--out``; the table counts the syncs
whose slope favours the larger LR, in the ramp-up (syncs 1-10) / after it.

Run: .venv/bin/python bench/probe_signal.py --out docs/probe_signal_seed121.jsonl   (about 5 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from controller_dev import DevRun, TailProbe, dev_task, load_records  # noqa: E402
from torch import nn  # noqa: E402

from hdet_track import HDETScheduler, NonFiniteReplicasError  # noqa: E402
from hdet_track.launch import launch_local  # noqa: E402

SIGNALS = ("window", "end", "tail")
RAMP_SYNCS = 10


def slope(log_lrs: list[float], losses) -> float:  # noqa: ANN001
    """Least-squares slope of ``losses`` (a vector, or one row per example: their mean slope)
    against ``log_lrs`` over the replicas whose losses are finite; NaN with fewer than 2."""
    y = np.asarray(losses, dtype=float)
    y = y if y.ndim == 2 else y[:, None]
    ok = np.all(np.isfinite(y), axis=1)
    if ok.sum() < 2:
        return math.nan
    x = np.asarray(log_lrs, dtype=float)[ok]
    x = x - x.mean()
    return float(np.mean(x @ (y[ok] - y[ok].mean(axis=0)) / (x @ x)))


def trace(run: DevRun) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    task = dev_task(run.dataset, run.seed)
    model = task.model(run.seed)
    net = nn.parallel.DistributedDataParallel(model) if run.mode == "shared" else model
    opt = task.optimizer(model.parameters(), run.max_lr)
    sched = HDETScheduler(
        opt, max_lr=run.max_lr, total_steps=run.steps, spread=run.spread, sync_every=run.sync_every,
        auto_lr=False, model=model, seed=run.seed,
    )  # fmt: skip
    probe = TailProbe(task, model, run.sync_every)
    batches = torch.Generator().manual_seed(run.seed * 1000 + rank)
    syncs = []
    try:
        _train(run, task, net, opt, sched, probe, batches, world, syncs)
    except NonFiniteReplicasError:  # every replica blew up (raised on every rank at the same sync)
        pass
    return {"val_loss": task.evaluate(model)[0], "syncs": syncs}


def _train(run, task, net, opt, sched, probe, batches, world, syncs) -> None:  # noqa: ANN001
    for i in range(run.steps):
        inputs, targets = task.batch(batches, run.batch)
        loss = task.loss(net(inputs), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        probe.after_step()
        at_sync = (i + 1) % run.sync_every == 0 or i + 1 == run.steps
        if at_sync:
            end, tail = probe.losses("end").numpy(), probe.losses("tail").numpy()
            lrs = [None] * world
            dist.all_gather_object(lrs, float(opt.param_groups[0]["lr"]))
        sched.step(loss)
        if at_sync:
            probe.synced()
            log_lrs = [math.log(v) for v in lrs]
            window = sched.last_sync.window_losses
            syncs.append(
                {"step": i + 1, "lrs": lrs, "window": slope(log_lrs, window), "end": slope(log_lrs, end),
                 "tail": slope(log_lrs, tail)}
            )  # fmt: skip


def _worker(run: DevRun) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = trace(run)
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def counts(syncs: list[dict], signal: str) -> str:
    """Syncs whose slope favours the larger LR: "ramp-up / after" (or "k of n" for a short run)."""
    larger = [s[signal] < 0 for s in syncs]
    if len(larger) <= RAMP_SYNCS:
        return f"{sum(larger)} of {len(larger)}"
    return f"{sum(larger[:RAMP_SYNCS])} / {sum(larger[RAMP_SYNCS:])}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=121)
    p.add_argument("--lrs", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2, 0.5])
    p.add_argument("--modes", nargs="+", default=["shared", "independent"], choices=["shared", "independent"])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--out", required=True, help="JSON-lines file; runs already in it are not repeated")
    args = p.parse_args()
    out = Path(args.out)
    done = load_records(out)
    for mode in args.modes:
        for lr in args.lrs:
            run = DevRun("fashion-mnist", mode, "fanout-only", lr, args.steps, args.replicas, seed=args.seed, round=18)
            if run.key() in done:
                continue
            res = launch_local(_worker, run.replicas, run)[0]
            done[run.key()] = rec = {"key": run.key(), "mode": mode, "max_lr": lr, "seed": args.seed, **res}
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
    print("| mode | signal | " + " | ".join(f"{lr:g}" for lr in args.lrs) + " |")
    print("|---|---|" + "---|" * len(args.lrs))
    summary = {}
    for mode in args.modes:
        recs = [done[DevRun("fashion-mnist", mode, "fanout-only", lr, args.steps, args.replicas, seed=args.seed,
                            round=18).key()] for lr in args.lrs]  # fmt: skip
        for signal in SIGNALS:
            cells = [counts(r["syncs"], signal) for r in recs]
            summary[f"{mode}.{signal}"] = cells
            print(f"| {mode} | {signal} | " + " | ".join(cells) + " |")
    print(
        json.dumps({"summary": "probe_signal", "seed": args.seed, "larger_lr_better_syncs": summary})
    )  # the record; the result lines follow
    # result lines: at the lowest max_lr given (default 0.02, 10x below the sweep's best on this task,
    # where a larger LR is the right move), the share of syncs whose slope says so; a signal that
    # could steer the LR up from there points that way more often than not
    low = min(args.lrs)
    for mode in args.modes:
        syncs = done[DevRun("fashion-mnist", mode, "fanout-only", low, args.steps, args.replicas, seed=args.seed,
                            round=18).key()]["syncs"]  # fmt: skip
        for signal in SIGNALS:
            share = sum(s[signal] < 0 for s in syncs) / max(len(syncs), 1)
            line = {"bench": f"probe_signal.{mode}.{signal}.larger_lr_share_at_{low:g}", "value": round(share, 3),
                    "unit": "share of syncs", "target": 0.5, "pass": share > 0.5}  # fmt: skip
            print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())

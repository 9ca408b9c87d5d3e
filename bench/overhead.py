"""Overhead of HDET over a plain OneCycleLR loop, and flat-bucket vs per-tensor averaging.

4 gloo processes on 127.0.0.1, an MLP with 100 parameter tensors, 2,000 steps. The plain loop
and three HDET loops (T=100, auto-LR on): the defaults (the step guard's scope "auto" finds that the
replicas' gradients differ and checks each replica's own loss), the collective step guard
(``step_guard_scope="all"``: one all-gather of the losses per step, what "auto" picks under DDP) and
``step_guard=None``. They run interleaved in blocks inside the same processes, so all see the same
machine load. Replicas train independently between syncs (no per-step gradient all-reduce), which
is the strictest case: everything HDET adds is visible. Each ratio is the median over the rounds
of blocks of that round's ratio (loops next to each other in time see the same load; a round a
neighbour disturbed does not decide the result), the first round (first-touch costs) left out.

Then the same under DDP (``DistributedDataParallel``: one gradient all-reduce per step, shared
gradients), interleaved the same way: a plain DDP + OneCycleLR loop against HDET with its defaults
(the step guard's scope "auto" finds the gradients shared and gathers every step's losses) and
with ``step_guard=None``. This is what a DDP user pays for the collective step guard: the loop is
already in lockstep once per step.

Run: .venv/bin/python bench/overhead.py [--steps 2000] [--world 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hdet_track import HDETScheduler
from hdet_track.collectives import average_buckets, make_buckets
from hdet_track.controller import DriftController

LAYERS = 50  # 50 Linear layers = 100 parameter tensors
WIDTH = 64


def make_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, 10))
    return nn.Sequential(*layers)


def run_block(model, opt, sched, x, y, steps: int, with_loss: bool) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if with_loss:
            sched.step(loss)
        else:
            sched.step()
    dist.barrier()
    return time.perf_counter() - start


def _loops(steps: int, ddp: bool) -> dict:
    """The plain loop and HDET's, each with its own model (wrapped in DDP with ``ddp``)."""

    def wrapped() -> tuple[nn.Module, nn.Module]:
        module = make_model()
        return (DDP(module) if ddp else module), module

    plain_model, plain_module = wrapped()
    plain_opt = torch.optim.SGD(plain_module.parameters(), lr=0.01, momentum=0.9)
    plain = torch.optim.lr_scheduler.OneCycleLR(plain_opt, max_lr=0.01, total_steps=steps)
    loops = {"plain": (plain_model, plain_opt, plain, False)}
    # "hdet": the defaults (the drift controller; its step guard's scope "auto" finds independent
    # replicas' gradients differ, so each replica checks its own loss: no per-step collective; under
    # DDP it finds them shared and gathers every step's losses); "hdet_collective_step_guard" (without
    # DDP only): the step guard that gathers every step's losses, as under DDP; "hdet_no_step_guard":
    # syncs only, the collectives of a window are the sync's.
    cases = [("hdet", DriftController())]
    if not ddp:
        cases.append(("hdet_collective_step_guard", DriftController(step_guard_scope="all")))
    cases.append(("hdet_no_step_guard", DriftController(step_guard=None)))
    for name, controller in cases:
        model, module = wrapped()
        opt = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
        sched = HDETScheduler(
            opt,
            max_lr=0.01,
            total_steps=steps,
            spread=0.3,
            sync_every=100,
            auto_lr=True,
            controller=controller,
            model=module,
        )
        loops[name] = (model, opt, sched, True)
    return loops


def interleaved(loops: dict, x: torch.Tensor, y: torch.Tensor, steps: int, block: int = 100) -> dict:
    """Each loop's wall time per round, a round being one block of ``block`` steps of every loop,
    the order rotating every round so that no loop always follows the same other."""
    times: dict = {name: [] for name in loops}
    order = list(loops)
    for _ in range(steps // block):
        order = order[1:] + order[:1]
        for name in order:
            model, opt, sched, with_loss = loops[name]
            times[name].append(run_block(model, opt, sched, x, y, block, with_loss))
    times["scope"] = loops["hdet"][2].controller.step_guard_scope
    return times


def median_ratio(times: list[float], base: list[float], skip_first: bool = True) -> float:
    """The median over the rounds of ``times / base`` (a round a neighbour disturbed does not decide
    it); with ``skip_first``, the first round (first-touch costs) left out when there are others."""
    pairs = list(zip(times, base))
    return statistics.median(t / b for t, b in (pairs[1:] if skip_first and len(pairs) > 1 else pairs))


def worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, WIDTH, generator=g), torch.randint(0, 10, (32,), generator=g)

    times = interleaved(_loops(steps, ddp=False), x, y, steps)
    ddp_times = interleaved(_loops(steps, ddp=True), x, y, steps)
    t_plain = times["plain"]

    # Averaging alone: one all_reduce per bucket vs one per tensor, same 100 tensors.
    params = list(make_model().parameters())
    reps = 20
    t_flat = t_per = 0.0
    for i in range(2 * reps):
        dist.barrier()
        start = time.perf_counter()
        if i % 2 == 0:
            average_buckets(make_buckets(params))
            t_flat += time.perf_counter() - start
        else:
            with torch.no_grad():
                for p in params:
                    dist.all_reduce(p.data)
                    p.data.div_(world)
            t_per += time.perf_counter() - start
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "plain_s": t_plain,
                    "hdet_s": times["hdet"],
                    "hdet_collective_step_guard_s": times["hdet_collective_step_guard"],
                    "hdet_no_step_guard_s": times["hdet_no_step_guard"],
                    "scope": times["scope"],
                    "ddp_plain_s": ddp_times["plain"],
                    "ddp_hdet_s": ddp_times["hdet"],
                    "ddp_hdet_no_step_guard_s": ddp_times["hdet_no_step_guard"],
                    "ddp_scope": ddp_times["scope"],
                    "flat_ms": 1e3 * t_flat / reps,
                    "per_tensor_ms": 1e3 * t_per / reps,
                    "step_ms": 1e3 * sum(t_plain) / (len(t_plain) * 100),
                },
                f,
            )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    if args.steps < 200 or args.world < 2:
        parser.error(
            f"--steps runs in rounds of 100 steps (at least 200: the first is not counted), --world at least 2; got --steps {args.steps}, --world {args.world}"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(worker, args=(args.world, port, args.steps, out), nprocs=args.world, start_method="spawn")
        with open(out) as f:
            r = json.load(f)
    speedup = r["per_tensor_ms"] / r["flat_ms"]
    print(f"{args.world} gloo processes, {args.steps} steps, MLP with {2 * LAYERS} parameter tensors")
    print(f"plain OneCycleLR loop: {sum(r['plain_s']):.2f} s ({r['step_ms']:.2f} ms/step)")
    cases = (  # name, what, target
        ("hdet", f"defaults: step guard scope 'auto' -> {r['scope']!r}", 1.03),
        ("hdet_collective_step_guard", "step_guard_scope='all', what 'auto' picks under DDP", 1.10),
        ("hdet_no_step_guard", "step_guard=None", 1.03),
    )
    lines = []
    for name, what, target in cases:
        ratio = median_ratio(r[f"{name}_s"], r["plain_s"])
        print(f"HDET (T=100, auto-LR, {what}): {sum(r[f'{name}_s']):.2f} s  -> median ratio {ratio:.3f}")
        bench = "hdet_overhead_ratio" + name.removeprefix("hdet")
        lines.append({"bench": bench, "value": round(ratio, 4), "unit": "x", "target": target, "pass": ratio <= target})
    print(f"plain DDP + OneCycleLR loop: {sum(r['ddp_plain_s']):.2f} s")
    for name, what, target in (
        ("ddp_hdet", f"DDP, defaults: step guard scope 'auto' -> {r['ddp_scope']!r}", 1.10),
        ("ddp_hdet_no_step_guard", "DDP, step_guard=None", 1.03),
    ):
        ratio = median_ratio(r[f"{name}_s"], r["ddp_plain_s"])
        print(f"HDET (T=100, auto-LR, {what}): {sum(r[f'{name}_s']):.2f} s  -> median ratio {ratio:.3f}")
        bench = "hdet_overhead_ratio_" + name
        lines.append({"bench": bench, "value": round(ratio, 4), "unit": "x", "target": target, "pass": ratio <= target})
    print(f"averaging: flat buckets {r['flat_ms']:.2f} ms, per tensor {r['per_tensor_ms']:.2f} ms -> {speedup:.1f}x")
    for line in lines:
        print(json.dumps(line))
    print(
        json.dumps(
            {
                "bench": "flat_vs_per_tensor_averaging",
                "value": round(speedup, 2),
                "unit": "x",
                "target": 20,
                "pass": speedup >= 20,
            }
        )
    )


if __name__ == "__main__":
    main()

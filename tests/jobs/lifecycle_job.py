"""A small tracked job that fails on purpose, under any launcher (tests/test_lifecycle.py).

    python lifecycle_job.py LAUNCHER BACKEND URI FAILURE STEP [FAIL_RANK]

LAUNCHER: plain (one process), spawn (torch.multiprocessing.spawn, 2 ranks) or torchrun (started by
the test with torchrun). FAILURE: raise (an exception on FAIL_RANK), exit (sys.exit(3) on every
rank), exit_one (sys.exit(3) on FAIL_RANK), exit_torn_down (sys.exit(3), with a SIGTERM to itself while
that unwinds, as torchrun's teardown may come), sigterm or sigint (rank 0 prints READY and waits for the test's signal), raise_as_service_starts
(W&B: raise on FAIL_RANK as soon as W&B's service has started in hdet-track's writer thread, while its
``wandb.init`` is still under way) or none. STEP: the step before which it happens (0: before the first step).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def job(rank: int, world: int, backend: str, uri: str, failure: str, at: int, fail_rank: int) -> None:
    from hdet_track import HDETScheduler

    torch.set_num_threads(1)
    service_started = threading.Event()
    if failure == "raise_as_service_starts":  # W&B registers its service's exit handler as it starts it
        register = atexit.register

        def noting(func, *args, **kwargs):  # type: ignore[no-untyped-def]
            if "teardown" in getattr(func, "__qualname__", ""):
                service_started.set()
            return register(func, *args, **kwargs)

        atexit.register = noting
    if backend == "wandb":
        from hdet_track.tracking.wandb import WandbTracker

        track = WandbTracker(project="life", dir=uri, mode="offline")
    else:
        from hdet_track.tracking.mlflow import MLflowTracker

        track = MLflowTracker(tracking_uri=uri, experiment="life")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(
        opt, 0.1, total_steps=100, spread=0.2 if world > 1 else 0.0, sync_every=10, model=model, track=track
    )
    g = torch.Generator().manual_seed(rank)
    for k in range(1, 101):
        if k == at or (at == 0 and k == 1):
            if failure == "raise" and rank == fail_rank:
                raise RuntimeError(f"boom on rank {rank} before step {k}")
            if failure == "raise_as_service_starts" and rank == fail_rank:
                assert service_started.wait(120), "W&B's service did not start"
                raise RuntimeError(f"boom on rank {rank} before step {k}")
            if failure == "exit":
                sys.exit(3)
            if failure == "exit_one" and rank == fail_rank:
                sys.exit(3)
            if failure == "exit_torn_down":  # torchrun's SIGTERM comes while the exit unwinds
                try:
                    sys.exit(3)
                finally:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(10)
            if failure in ("sigterm", "sigint") and rank == 0:
                print("READY", flush=True)
                time.sleep(120)
        x = torch.randn(16, 8, generator=g)
        loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        if failure in ("sigterm", "sigint") and rank != 0:
            time.sleep(0.01)


def _spawned(rank: int, args: tuple) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    job(rank, 2, *args)
    dist.destroy_process_group()


def main() -> None:
    launcher, backend, uri, failure, at = sys.argv[1:6]
    fail_rank = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    args = (backend, uri, failure, int(at), fail_rank)
    if launcher == "plain":
        job(0, 1, *args)
    elif launcher == "spawn":
        import torch.multiprocessing as mp

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(_spawned, args=(args,), nprocs=2)
    else:  # torchrun
        dist.init_process_group("gloo")
        job(dist.get_rank(), dist.get_world_size(), *args)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

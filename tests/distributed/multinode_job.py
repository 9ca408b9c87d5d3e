"""The job tests/distributed/test_multinode.py runs under two torchrun agents (2 nodes x 2 processes).

Usage: torchrun ... multinode_job.py OUT_DIR TRACKING_URI

Trains a tiny model with HDET (spread, periodic averaging, MLflow tracking) under gloo on the CPU and
writes ``OUT_DIR/rank{RANK}.pt``: the final flat parameters and where this rank ran.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hdet_track import HDETScheduler
from hdet_track.tracking.mlflow import MLflowTracker

STEPS = 20  # a multiple of SYNC_EVERY: the last step is a sync
SYNC_EVERY = 5


def main(out_dir: str, uri: str) -> None:
    torch.set_num_threads(1)
    with open(os.path.join(out_dir, f"worker-{os.getpid()}.pid"), "w"):
        pass  # the test kills leftover workers by pid: torchrun starts each in a session of its own
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from torchrun
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = HDETScheduler(
        opt,
        max_lr=0.2,
        total_steps=STEPS,
        spread=0.3,
        sync_every=SYNC_EVERY,
        track=MLflowTracker(tracking_uri=uri, experiment="multinode", run_name="2x2"),
        model=model,
    )
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1_000 * rank + step)  # each replica sees its own data
        x = torch.randn(32, 8, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
    sched.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    where = {k: os.environ[k] for k in ("GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE")}
    torch.save({"params": flat, "agent_pid": os.getppid(), **where}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # nobody tears down its sockets while a peer still finishes a collective
    dist.destroy_process_group()
    # the process group is gone cleanly: what comes after is torch's own exit (see the test)
    open(os.path.join(out_dir, f"rank{rank}.done"), "w").close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

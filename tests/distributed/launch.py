"""Run a function on N real gloo processes on loopback and collect what each returns.

The ranks are forked from a fork server that has imported torch and the test workers once (each
spawned rank used to spend ~2 s of CPU importing them); each rank still is its own process with its
own gloo group, and gets the caller's environment and working directory at the time of the call.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the fork server (what every rank needs; a module not listed is imported per rank)
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "hdet_track.scheduler", "tests.distributed.workers"]


def _entry(
    rank: int, fn: Callable, world_size: int, port: int, out_dir: str, args: tuple, env: dict, cwd: str, backend: str
) -> None:
    os.environ.clear()
    os.environ.update(env)  # the fork server's own environment is from when it started
    os.chdir(cwd)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # nobody tears down its sockets while a peer still finishes a collective
    finally:
        dist.destroy_process_group()
    open(os.path.join(out_dir, f"rank{rank}.done"), "w").close()  # what follows is torch's own exit


def finished(out_dir: str | os.PathLike, world_size: int) -> bool:
    """Whether every rank marked ``rank{r}.done`` in ``out_dir`` after destroy_process_group().

    torch 2.13's gloo now and then aborts a process at interpreter exit after that ("terminate
    called without an active exception", a C++ thread with no Python frame; a plain gloo job
    without hdet-track does it too): not the test's failure when every rank had finished cleanly."""
    return all(os.path.exists(os.path.join(out_dir, f"rank{r}.done")) for r in range(world_size))


def run_ranks(
    fn: Callable,
    world_size: int = 4,
    *args: Any,
    timeout: float = 240,
    allow_kill: bool = False,
    start_method: str = "forkserver",
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo, 127.0.0.1).

    Returns each rank's return value (``None`` for a rank that died and ``allow_kill`` is set).
    ``start_method="spawn"``: fresh interpreters (CUDA ranks: nothing touched a GPU before them).
    ``backend``: ``init_process_group``'s, e.g. ``"cpu:gloo,cuda:gloo"`` (a group that takes CUDA
    tensors, as nccl's does, on a machine with one GPU).
    """
    multiprocessing.set_forkserver_preload(_PRELOAD)  # used when the fork server starts (the first call)
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out_dir, args, dict(os.environ), os.getcwd(), backend),
            nprocs=world_size,
            join=False,
            start_method=start_method,
        )
        try:
            deadline = time.monotonic() + timeout
            # on a failure the others get 10 s to end by themselves before they are terminated
            while not ctx.join(max(deadline - time.monotonic(), 0.01), grace_period=10):
                if time.monotonic() >= deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks within {timeout} s")
        except mp.ProcessExitedException as exc:
            if not allow_kill and not (exc.signal_name == "SIGABRT" and finished(out_dir, world_size)):
                raise
            for p in ctx.processes:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
        out = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return out

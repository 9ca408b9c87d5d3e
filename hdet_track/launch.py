"""Start N replicas on this machine the way ``torchrun`` does (torch's elastic launcher)."""

from __future__ import annotations

import logging
import os
import pickle
import signal
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["launch_local"]

logger = logging.getLogger(__name__)


def launch_local(entrypoint: Callable[..., Any], replicas: int, *args: Any) -> dict[int, Any]:
    """Run ``entrypoint(*args)`` in ``replicas`` new processes with RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT set (c10d rendezvous on 127.0.0.1); returns each rank's return value.

    ``entrypoint`` must be importable by name (a module-level function): the workers are spawned.

    Example:
        >>> results = launch_local(worker, 4, config)   # worker calls dist.init_process_group("gloo")
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"Expected replicas to be an integer >= 1, but got {replicas!r}")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=replicas,
        run_id=f"hdet-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        # port 0, as torchrun --standalone: the rendezvous store binds a free port itself (a port picked
        # here and bound there could be taken in between, and the rendezvous then waited on its taker)
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
        local_addr="127.0.0.1",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with tempfile.TemporaryDirectory(prefix="hdet-launch-") as kept:
        try:
            return elastic_launch(config, _keeping_result)(entrypoint, kept, *args)
        except ChildFailedError as exc:
            results = _results_of_an_abort_at_exit(exc, kept, replicas)
            if results is None:
                raise
            return results


def _keeping_result(entrypoint: Callable[..., Any], kept: str, *args: Any) -> Any:
    """Run ``entrypoint`` in a worker and keep what it returned in ``kept`` before the process exits."""
    result = entrypoint(*args)
    path = Path(kept) / f"rank{os.environ['RANK']}.pkl"
    with open(path.with_suffix(".tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(path.with_suffix(".tmp"), path)
    return result


def _results_of_an_abort_at_exit(exc: Any, kept: str, replicas: int) -> dict[int, Any] | None:
    """Every rank returned, and the only failures are SIGABRTs after that: torch 2.13's gloo now and
    then aborts a process at interpreter exit after a clean ``destroy_process_group()`` (a plain
    gloo job without hdet-track does it too). The ranks' results then stand; else None."""
    paths = {rank: Path(kept) / f"rank{rank}.pkl" for rank in range(replicas)}
    aborted = all(f.exitcode == -signal.SIGABRT for f in exc.failures.values())
    if not (aborted and all(p.exists() for p in paths.values())):
        return None
    rank, _ = exc.get_first_failure()
    logger.warning("hdet-track: rank %d aborted at exit after it had finished (torch's gloo); its results stand", rank)
    results = {}
    for rank, path in paths.items():
        with open(path, "rb") as f:
            results[rank] = pickle.load(f)
    return results

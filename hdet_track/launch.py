"""Start N replicas on this machine the way ``torchrun`` does (torch's elastic launcher)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["launch_local"]


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=replicas,
        run_id=f"hdet-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{port}",
        max_restarts=0,
        monitor_interval=0.2,
        local_addr="127.0.0.1",
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return elastic_launch(config, entrypoint)(*args)

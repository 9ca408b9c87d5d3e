"""Which process owns a run, and whether it is still alive: how a reader tells a live run from one
whose process was killed outright (SIGKILL, the OOM killer, a container stopped) before it could end
the run, when the store itself only says RUNNING. Pure standard library: the trackers write an
owner record, the readers check it; neither imports the other."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

__all__ = ["process_identity", "owner_alive"]


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """``host``, ``pid`` and, where ``/proc`` tells, the process's start time (``start``: clock ticks
    after boot; guards against a reused pid) and pid namespace (``pidns``: pids of another container
    with the same hostname are not comparable)."""
    pid = os.getpid() if pid is None else pid
    out: dict[str, Any] = {"host": socket.gethostname(), "pid": pid, "start": None, "pidns": None}
    try:
        out["start"] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        pass
    try:
        out["pidns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return out


def owner_alive(owner: dict) -> bool | None:
    """Whether the process ``owner`` (a :func:`process_identity`) is alive; None when this host
    cannot tell (another host, another pid namespace, no pid)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        if owner.get("pidns") and os.readlink("/proc/self/ns/pid") != owner["pidns"]:
            return None
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    except OSError:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists
    if fields[0] in ("Z", "X"):
        return False  # exited, not yet reaped by its parent
    start = owner.get("start")
    return not (start is not None and len(fields) > 19 and fields[19] != str(start))  # else a reused pid

"""Which process owns a run, and whether it is still alive: how a reader tells a live run from one
whose process was killed outright (SIGKILL, the OOM killer, a container stopped) before it could end
the run, when the store itself only says RUNNING. Pure standard library: the trackers write an
owner record, the readers check it; neither imports the other.

A process on another host (or in another pid namespace: another container) cannot be checked from
here. For those the tracking writer sends a *heartbeat* (:func:`heartbeat`) every
``$HDET_TRACK_HEARTBEAT_SECONDS`` (default 30) while the run is open, and a reader takes a run
whose heartbeat is more than :data:`MISSED_BEATS` beats overdue (:func:`silence`) as ended without
ending it (a node lost, a container stopped), the way W&B's server marks a run crashed. The store
is left as it is: a run that beats again reads live again."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

__all__ = [
    "process_identity",
    "owner_alive",
    "described",
    "heartbeat_seconds",
    "heartbeat",
    "silence",
    "overdue",
    "MISSED_BEATS",
]

HEARTBEAT_ENV = "HDET_TRACK_HEARTBEAT_SECONDS"
DEFAULT_HEARTBEAT_SECONDS = 30.0
# A heartbeat this many intervals overdue means the run's processes are gone (at the default
# interval, 5 minutes: well past a busy backend's stall and the clock skew of NTP-synced hosts).
MISSED_BEATS = 10
_IDENTITY = ("host", "pid", "start", "pidns")  # what a heartbeat shares with its owner's record


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


def another_live_process(owner: Any, me: dict | None = None) -> bool:
    """Whether ``owner`` (a :func:`process_identity`) is a live process of this host other than
    ``me`` (default this process): one that holds a run a resumed job would otherwise reopen."""
    me = me or process_identity()
    if not isinstance(owner, dict) or (owner.get("host"), owner.get("pid")) == (me.get("host"), me.get("pid")):
        return False
    return bool(owner_alive(owner))


def heartbeat_seconds() -> float | None:
    """The heartbeat interval: ``$HDET_TRACK_HEARTBEAT_SECONDS`` (default 30; ``0``: no heartbeat)."""
    text = os.environ.get(HEARTBEAT_ENV, "").strip()
    if not text:
        return DEFAULT_HEARTBEAT_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"Expected {HEARTBEAT_ENV} to be a number of seconds >= 0 (0: no heartbeat), but got {text!r}")
    return value or None


def heartbeat(every: float, now: float | None = None, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """The heartbeat record a tracker stores: when (``time``, Unix seconds), the interval, and the
    process that sent it (the run's owner: its :func:`process_identity`, default this process's)."""
    now = time.time() if now is None else now
    return (identity or process_identity()) | {"time": now, "every": float(every)}


def silence(beat: Any, owner: dict | None = None, now: float | None = None) -> str | None:
    """Why a run whose owner this host cannot check reads as ended: its last heartbeat (a
    :func:`heartbeat` record, or its JSON) is more than :data:`MISSED_BEATS` intervals old. None while
    it is not, for no or an unreadable record (a run written before heartbeats: cannot tell), and
    for one sent by another process than ``owner`` (an earlier attempt of a resumed run, even one
    with the same host name and pid: a restarted container)."""
    if isinstance(beat, str):
        try:
            beat = json.loads(beat)
        except ValueError:
            return None
    if not isinstance(beat, dict):
        return None
    if owner is not None and any(beat.get(k) != owner.get(k) for k in _IDENTITY if owner.get(k) is not None):
        return None
    last, every = beat.get("time"), beat.get("every")
    if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in (last, every)) or every <= 0:
        return None
    silent = (time.time() if now is None else now) - last
    if silent <= MISSED_BEATS * every:
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(last))
    return f"sent no heartbeat for {silent:.0f} s (one was due every {every:g} s; the last at {when})"


def described(owner: dict) -> str:
    """How the readers name a run's owner in the error of a run it never ended."""
    return f"the training process (pid {owner.get('pid')} on {owner.get('host')})"


def overdue(owner: dict, beat: Any) -> str | None:
    """The error of a run whose ``owner`` this host cannot check and whose heartbeat ``beat`` is long
    overdue (:func:`silence`); None while it is not."""
    silent = silence(beat, owner)
    return None if silent is None else f"{described(owner)} {silent}: presumed ended without ending the run"

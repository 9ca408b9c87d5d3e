"""What a W&B run directory holds, read by the reader (:mod:`hdet_track.readers.wandb`) and by the
tracker (:mod:`hdet_track.tracking.wandb`: a resumed run writes none of what its earlier sessions
hold): W&B's history rows, hdet-track's own user-metrics file and the event archive's last step."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import names
from .wandb_file import WandbFormatError, read_wandb_file

__all__ = [
    "session_order",
    "run_sessions",
    "StoredSteps",
    "stored_steps",
    "archived_last_step",
    "archived_first_step",
    "session_first_step",
    "read_owner",
    "read_user_metrics",
    "session_user_metrics",
    "user_metrics",
    "row_step",
    "series",
    "SYNC_PREFIXES",
    "EVENTS_DIR",
    "USER_METRICS_FILE",
    "OWNER_FILE",
]

SYNC_PREFIXES = ("hdet/sync/", "hdet/controller/", "hdet/onecycle/")
EVENTS_DIR = ("files", "hdet_events")
USER_METRICS_FILE = names.WANDB_USER_METRICS_FILE  # written by hdet_track.tracking.wandb.WandbTracker
OWNER_FILE = names.WANDB_OWNER_FILE


def run_sessions(wandb_dir: Path, run_id: str) -> list[Path]:
    """The session folders of run ``run_id`` in ``wandb_dir`` (a resumed run has one per session),
    oldest first (:func:`session_order`); a folder holds its run's file under the exact id."""
    name = f"run-{run_id}.wandb"
    return sorted((d for d in wandb_dir.glob("*run-*") if (d / name).is_file()), key=session_order)


def read_owner(directory: Path) -> dict | None:
    """The owner file of the run directory ``directory`` (the process that logs into it, its
    heartbeat, the step its session started from), None when there is none or it is unreadable."""
    try:
        owner = json.loads((directory.joinpath(*EVENTS_DIR) / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def read_user_metrics(directory: Path) -> list[tuple[str, int, float]]:
    """(key, step, value) of the user's metrics from the tracker's own file (a torn last line is skipped)."""
    try:
        lines = (directory.joinpath(*EVENTS_DIR) / USER_METRICS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            p = json.loads(line)
            out.append((str(p["key"]), int(p["step"]), float(p["value"])))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def _merge_user_metrics(
    found: dict[str, tuple[np.ndarray, np.ndarray]], extra: list[tuple[str, int, float]]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``found`` (from W&B's history) with the points of ``extra`` (the tracker's file) it lacks (the
    history may stop short of what the tracker had written: W&B buffers its file; the file may stop
    short of the history: it is written with the archive), each point once, in the order they were
    logged: at a step logged twice the last value is the one logged last (a row holds only the last
    of one hand-over, the file every one). A point in both takes its place in the file; one only in
    the history comes right after the history's previous point that the file holds."""
    places: dict[tuple[str, int, float], deque[int]] = defaultdict(deque)
    for i, (key, step, value) in enumerate(extra):
        places[(key, int(step), float(value))].append(i)
    ordered: list[tuple[float, int, str, int, float]] = []  # (place, order in the history, key, step, value)
    held: set[int] = set()
    for key, (steps, values) in found.items():
        anchor = -1.0
        for j, (step, value) in enumerate(zip(steps.tolist(), values.tolist())):
            place = places.get((key, int(step), float(value)))
            if place:
                anchor = place.popleft()
                held.add(int(anchor))
                ordered.append((anchor, 0, key, step, value))
            else:
                ordered.append((anchor + 0.5, j, key, step, value))
    ordered += [(i, 0, key, step, value) for i, (key, step, value) in enumerate(extra) if i not in held]
    points: dict[str, list[tuple[int, float]]] = {}
    for _, _, key, step, value in sorted(ordered, key=lambda t: (t[0], t[1])):
        points.setdefault(key, []).append((step, value))
    return series(points)


def series(found: dict[str, list[tuple[int, float]]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Key -> (steps, values), in step order."""
    out = {}
    for key, points in found.items():
        points = sorted(points, key=lambda p: p[0])
        out[key] = (np.array([s for s, _ in points], dtype=np.int64), np.array([v for _, v in points], dtype=float))
    return out


def session_user_metrics(
    sessions: Iterable[tuple[list[dict], list[tuple[str, int, float]]]], skip: tuple[str, ...] = ()
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The user's metrics of a run's sessions (each: W&B's history, the tracker's file), one point per
    key and step: the latest session's (a job resumed from an older checkpoint logs some again)."""
    latest: dict[tuple[str, int], float] = {}
    sessions = list(sessions)
    legacy = not any(names.STEP in row for history, _ in sessions for row in history)  # over the whole run
    for history, extra in sessions:
        for key, (steps, values) in _merge_user_metrics(user_metrics(history, skip, legacy), extra).items():
            latest |= dict(zip(((key, s) for s in steps.tolist()), values.tolist()))
    found: dict[str, list[tuple[int, float]]] = {}
    for (key, step), value in latest.items():
        found.setdefault(key, []).append((step, value))
    return series(found)


_SESSION = re.compile(r"^(?:offline-)?run-(\d{8}_\d{6})-")


def session_order(directory: Path) -> tuple[str, int, str]:
    """Sort key of a run's session folders, oldest first: W&B's start time in the folder's name
    (an online session's ``run-...`` and an offline one's ``offline-run-...`` alike; by name an
    online first session sorted after an offline resumed one), then the ``-<n>`` W&B appends to a
    session started within the same second as another (numerically: ``-10`` after ``-2``)."""
    name = directory.name
    match = _SESSION.match(name)
    tail = name[match.end() :] if match else name
    files = sorted(directory.glob("run-*.wandb"))
    run_id = files[0].stem[len("run-") :] if files else ""
    rest = tail[len(run_id) + 1 :] if run_id and tail.startswith(f"{run_id}-") else ""
    return (match.group(1) if match else "", int(rest) if rest.isdigit() else 0, name)


# The training step a row that hdet-track did not write carries: Hugging Face's WandbCallback,
# Lightning's WandbLogger, a user's own ``global_step``.
OWNER_STEP_KEYS = ("train/global_step", "trainer/global_step", "global_step")


def row_step(row: dict, key: str, legacy: bool = True) -> int | None:
    """A row's own step for ``key``: hdet-track 0.2 rows carry it; a row its owner logged into a
    given run, the trainer's step (:data:`OWNER_STEP_KEYS`); older hdet-track rows (``legacy``: a
    run with no ``hdet/step`` at all) W&B's ``_step``, which counts rows, not training steps."""
    axis = names.SYNC_STEP if key.startswith(SYNC_PREFIXES) else names.STEP
    step = row.get(axis)
    if step is None:
        step = next((row[k] for k in OWNER_STEP_KEYS if isinstance(row.get(k), (int, float))), None)
    if step is None and legacy:
        step = row.get("_step")
    return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def user_metrics(
    history: list[dict], skip: tuple[str, ...] = (), legacy: bool | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Key -> (steps, values) of the numeric series that are not HDET's (``hdet/...``) nor W&B's
    (``_...``), nor in ``skip``; in step order (rows may arrive in any order). A row with no step
    of its own (its owner's, logged straight to W&B without one of :data:`OWNER_STEP_KEYS`) is
    left out: W&B's row counter is not a training step."""
    found: dict[str, list[tuple[int, float]]] = {}
    if legacy is None:  # rows of hdet-track before 0.2 (no hdet/step anywhere): W&B's _step
        legacy = not any(names.STEP in row for row in history)
    for row in history:
        for key, value in row.items():
            if key.startswith(("hdet/", "_")) or key in skip or key in OWNER_STEP_KEYS:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                step = row_step(row, key, legacy)
                if step is not None:
                    found.setdefault(key, []).append((step, float(value)))
    return series(found)


def _history(directory: Path) -> list[dict]:
    """The history rows of the run file in ``directory`` (none when it is unreadable)."""
    try:
        return read_wandb_file(sorted(directory.glob("run-*.wandb"))[0]).history
    except (IndexError, OSError, WandbFormatError):
        return []


def _archived_steps(directory: Path, pattern: str = "*.parquet") -> tuple[int, int] | None:
    """(first, last) step in the event archive of the run directory ``directory`` (None: none),
    from the chunks' Parquet statistics; a torn chunk (a SIGKILL while writing) is skipped."""
    import pyarrow.parquet as pq

    first, last = None, None
    for path in directory.joinpath(*EVENTS_DIR).glob(pattern):
        try:
            meta = pq.ParquetFile(path).metadata
            column = meta.schema.names.index("step")
            stats = [meta.row_group(g).column(column).statistics for g in range(meta.num_row_groups)]
            if all(s is not None and s.has_min_max for s in stats):
                lo, hi = min(int(s.min) for s in stats), max(int(s.max) for s in stats)
            else:
                steps = pq.read_table(path, columns=["step"]).column("step").to_pylist()
                lo, hi = min(steps), max(steps)
        except Exception:  # noqa: BLE001 - a torn, empty or foreign file
            continue
        first, last = (lo, hi) if first is None else (min(first, lo), max(last, hi))
    return None if first is None else (first, last)


def archived_last_step(directory: Path) -> int:
    """The last step in the event archive of the run directory ``directory`` (-1: none)."""
    found = _archived_steps(directory)
    return -1 if found is None else found[1]


def archived_first_step(directory: Path) -> int | None:
    """The first step of the event archive's step rows in ``directory`` (None: none)."""
    found = _archived_steps(directory, "steps-*.parquet")
    return None if found is None else found[0]


def session_first_step(directory: Path, rows: Iterable[int] = ()) -> float:
    """Where the session of the run directory ``directory`` took over from the earlier ones: the
    step after the one it resumed from (its owner file says; a session that resumed from step 17
    redid 18 even where it wrote no row for it: the earlier session's row stood), else the first
    step its archive or its rows (``rows``: its own HDET steps) hold; ``inf`` when none says."""
    owner = read_owner(directory) or {}
    start = owner.get("start_step")
    starts = [start + 1] if isinstance(start, int) and not isinstance(start, bool) else []
    starts += [s for s in (archived_first_step(directory), min(rows, default=None)) if s is not None]
    return min(starts) if starts else math.inf


@dataclass
class StoredSteps:
    """What earlier sessions of a W&B run hold (:func:`stored_steps`)."""

    archive: int = -1  # the last step of their event archive
    rows: int = -1  # the last step of HDET's own rows in their run files
    user: set[tuple[str, int]] = field(default_factory=set)  # (key, step) of the user's metrics


def stored_steps(directories: Iterable[Path]) -> StoredSteps:
    """What the run directories ``directories`` (a run's earlier sessions) hold, so that a job
    resumed from an older checkpoint writes none of it again."""
    out = StoredSteps()
    sessions = []
    for directory in directories:
        history = _history(directory)
        sessions.append((history, read_user_metrics(directory)))
        out.archive = max(out.archive, archived_last_step(directory))
        own = any(names.STEP in row or names.SYNC_STEP in row for row in history)  # else rows before 0.2
        hdet = [
            step
            for row in history
            if not own or names.STEP in row or names.SYNC_STEP in row  # not an owner's row in a given run
            for key in row
            if names.is_hdet_series(key) and key not in (names.STEP, names.SYNC_STEP)
            if (step := row_step(row, key)) is not None
        ]
        out.rows = max([out.rows] + hdet)
    builtin = (names.LOSS, names.LR)
    out.user = {(key, s) for key, (steps, _) in session_user_metrics(sessions, builtin).items() for s in steps.tolist()}
    return out

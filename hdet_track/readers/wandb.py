"""Rebuild HDET runs from W&B run directories (offline runs, or synced runs' local copies).

Each run directory holds ``run-<id>.wandb`` (parsed by :mod:`hdet_track.wandb_file`) and, under
``files/hdet_events/``, the Parquet event archive. A directory still being written is read up to
its last complete record.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from pathlib import Path

import numpy as np

from .. import names
from ..summaries import SUMMARY_DIR
from ..wandb_file import WandbFormatError, read_wandb_file
from .archive import read_archive
from .base import HDETRun, RunNotFoundError, RunSummary, StepTable, converge_from_series

__all__ = ["WandbReader", "find_run_dirs", "owner_alive"]

_SYNC_PREFIXES = ("hdet/sync/", "hdet/controller/", "hdet/onecycle/")
_EVENTS = ("files", "hdet_events")
USER_METRICS_FILE = names.WANDB_USER_METRICS_FILE  # written by hdet_track.tracking.wandb.WandbTracker
OWNER_FILE = names.WANDB_OWNER_FILE
# W&B's service is a process of its own: it may still be writing the end of a run whose training
# process has just exited. A run is read KILLED once its owner is gone AND this long has passed
# since the run file last changed (never from the file's age alone).
OWNER_GONE_GRACE_SECONDS = 2.0


def owner_alive(owner: dict) -> bool | None:
    """Whether the process ``owner`` (``process_identity()``: host, pid, start, pidns) is alive;
    None when this host cannot tell (another host, another pid namespace, no pid)."""
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


def _read_user_metrics(directory: Path) -> list[tuple[str, int, float]]:
    """(key, step, value) of the user's metrics from the tracker's own file (a torn last line is skipped)."""
    try:
        lines = (directory.joinpath(*_EVENTS) / USER_METRICS_FILE).read_text(encoding="utf-8").splitlines()
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
    """``found`` (from W&B's history) with the points of ``extra`` it lacks (the history may stop
    short of what the tracker had written: W&B buffers its file); each point counted once."""
    have = Counter((key, int(s), float(v)) for key, (steps, values) in found.items() for s, v in zip(steps, values))
    added: dict[str, list[tuple[int, float]]] = {}
    for key, step, value in extra:
        if have[(key, step, value)] > 0:
            have[(key, step, value)] -= 1
        else:
            added.setdefault(key, []).append((step, value))
    out = dict(found)
    for key, points in added.items():
        steps, values = out.get(key, (np.array([], dtype=np.int64), np.array([], dtype=float)))
        merged = sorted(list(zip(steps.tolist(), values.tolist())) + points, key=lambda p: p[0])
        out[key] = (np.array([s for s, _ in merged], dtype=np.int64), np.array([v for _, v in merged], dtype=float))
    return out


def _row_step(row: dict, key: str) -> int | None:
    """A row's own step for ``key`` (hdet-track 0.2 rows carry it; older ones used W&B's ``_step``)."""
    axis = names.SYNC_STEP if key.startswith(_SYNC_PREFIXES) else names.STEP
    step = row.get(axis, row.get("_step"))
    return int(step) if isinstance(step, (int, float)) else None


def _user_metrics(history: list[dict], skip: tuple[str, ...] = ()) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Key -> (steps, values) of the numeric series that are not HDET's (``hdet/...``) nor W&B's
    (``_...``), nor in ``skip``; in step order (rows may arrive in any order)."""
    found: dict[str, list[tuple[int, float]]] = {}
    for row in history:
        for key, value in row.items():
            if key.startswith(("hdet/", "_")) or key in skip:
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                step = _row_step(row, key)
                if step is not None:
                    found.setdefault(key, []).append((step, float(value)))
    out = {}
    for key, points in found.items():
        points.sort(key=lambda p: p[0])
        out[key] = (np.array([s for s, _ in points], dtype=np.int64), np.array([v for _, v in points], dtype=float))
    return out


def find_run_dirs(root: str | Path) -> list[Path]:
    """Run directories under ``root`` (a ``wandb`` folder, its parent, or one run directory)."""
    root = Path(root)
    if list(root.glob("run-*.wandb")):
        return [root]
    dirs = [p for pattern in ("wandb/*run-*", "*run-*") for p in root.glob(pattern) if p.is_dir()]
    return sorted({d for d in dirs if list(d.glob("run-*.wandb"))}, key=lambda p: p.name, reverse=True)


def _run_id(directory: Path) -> str:
    files = sorted(directory.glob("run-*.wandb"))
    return files[0].stem[len("run-") :] if files else directory.name.rsplit("-", 1)[-1]


class WandbReader:
    """Read HDET runs from a directory of W&B runs.

    Example:
        >>> reader = WandbReader("./wandb")
        >>> run = reader.read(reader.list_runs()[0].run_id)
    """

    backend = "wandb"

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        if not self.root.exists():
            raise RunNotFoundError(f"Expected a W&B directory at {self.root}, but it does not exist")
        self.uri = str(self.root)

    def _dirs(self) -> dict[str, list[Path]]:
        """Run id -> its directories, oldest first (offline W&B writes one per resumed session)."""
        out: dict[str, list[Path]] = {}
        for d in sorted(find_run_dirs(self.root), key=lambda p: p.name):
            out.setdefault(_run_id(d), []).append(d)
        return out

    def list_runs(self, experiment: str | None = None, compare_group: str | None = None) -> list[RunSummary]:
        out = []
        for run_id in self._dirs():
            run = self.read(run_id, summary_only=True)
            if experiment and run.tags.get("project") != experiment:
                continue
            if compare_group and run.compare_group != compare_group:
                continue
            s = run.summary()
            s.experiment = run.tags.get("project", "")
            out.append(s)
        return sorted(out, key=lambda s: s.start_time, reverse=True)

    def read(
        self,
        run_id: str,
        previous: HDETRun | None = None,
        summary_only: bool = False,
        steps: tuple[int, int] | None = None,
        max_rows: int | None = None,
    ) -> HDETRun:
        """The run; ``steps`` and ``max_rows`` as in :meth:`MLflowReader.read`."""
        dirs = self._dirs()
        if run_id not in dirs:
            raise RunNotFoundError(f"Expected a W&B run {run_id!r} under {self.root}, but found {sorted(dirs)}")
        run = HDETRun(run_id=run_id, source=str(dirs[run_id][-1]), backend=self.backend)
        history: list[dict] = []
        user_points = [p for d in dirs[run_id] for p in _read_user_metrics(d)]
        for directory in dirs[run_id]:
            wandb_file = sorted(directory.glob("run-*.wandb"))[0]
            try:
                contents = read_wandb_file(wandb_file)
            except WandbFormatError as exc:
                run.warnings.append(str(exc))
                continue
            if not history:
                times = [row.get("_timestamp") for row in contents.history[:1] if row.get("_timestamp")]
                run.start_time = float(times[0]) if times else wandb_file.stat().st_mtime
            history += contents.history
            run.name = contents.name or run_id
            run.tags = {k: str(v) for k, v in contents.summary.items() if k.startswith("hdet.")}
            if contents.summary.get("hdet/error"):
                run.tags["hdet.error"] = str(contents.summary["hdet/error"])
            run.tags["project"] = contents.project
            if contents.group:
                run.tags.setdefault("hdet.compare_group", contents.group)
            if contents.exit_code is None:
                run.status = "RUNNING"  # no exit record (yet): live, or a process that died
            else:
                run.status = str(
                    contents.summary.get("hdet/status") or ("FINISHED" if contents.exit_code == 0 else "FAILED")
                )
        gone = self._owner_gone(dirs[run_id][-1]) if run.status == "RUNNING" else None
        if gone:
            run.status = "KILLED"
            logged = [s for row in history if isinstance(s := row.get(names.STEP), (int, float))]
            last = int(max(logged + [s for _, s, _ in user_points], default=0))
            run.tags["hdet.error"] = f"{gone} after its last logged step {last}"
        if summary_only:
            loss = [
                (_row_step(r, names.LOSS), r[names.LOSS])
                for r in history
                if isinstance(r.get(names.LOSS), (int, float))
            ]
            if loss:
                run.metrics[names.LOSS] = (np.array([s for s, _ in loss]), np.array([v for _, v in loss], dtype=float))
            return run
        chunks = {
            f"{d.name}/{f.name}": f
            for d in dirs[run_id]
            for f in sorted((d / "files" / "hdet_events").glob("*.parquet"))
        }
        chunks |= {
            f"{d.name}/{SUMMARY_DIR}/{f.name}": f
            for d in dirs[run_id]
            for f in sorted((d / "files" / "hdet_events" / SUMMARY_DIR).glob("*.parquet"))
        }
        if chunks:
            read_archive(run, list(chunks), lambda name: chunks[name].read_bytes(), previous, steps, max_rows)
            # the archive holds HDET's own series; the user's metrics (val_loss, diverged_at_step...) are rows
            builtin = (names.LOSS, names.LR) if len(run.steps) or run.aggregates is not None else ()
            run.metrics.update(_merge_user_metrics(_user_metrics(history, skip=builtin), user_points))
        else:
            run.warnings.append("no event archive: rebuilt from the run's history")
            self._read_history(run, history)
            run.metrics.update(_merge_user_metrics(_user_metrics(history), user_points))
        if gone and len(run.steps):  # the archive may be ahead of W&B's history
            last = max(last, int(run.steps.step.max()))
            run.tags["hdet.error"] = f"{gone} after its last logged step {last}"
        return run

    @staticmethod
    def _owner_gone(directory: Path) -> str | None:
        """For a run with no exit record: the error text when its owning process (on this host) is
        gone, killed before it could end the run (SIGKILL, the OOM killer), so that the run reads
        KILLED and not live for ever. None for a live owner, for runs hdet-track did not start and
        for runs owned by another host (this reader cannot tell)."""
        try:
            owner = json.loads((directory.joinpath(*_EVENTS) / OWNER_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(owner, dict) or owner_alive(owner) is not False:
            return None
        try:
            changed = max(f.stat().st_mtime for f in directory.glob("run-*.wandb"))
        except ValueError:
            changed = 0.0
        if time.time() - changed < OWNER_GONE_GRACE_SECONDS:
            return None  # W&B's service may still be writing the run's end
        return f"the training process (pid {owner.get('pid')} on {owner.get('host')}) ended without ending the run,"

    def _read_history(self, run: HDETRun, history: list[dict]) -> None:
        rows: dict[int, dict[int, dict[str, float]]] = {}
        syncs: dict[int, dict[str, float]] = {}
        for row in history:
            if isinstance(row.get(names.SYNC_STEP), (int, float)):
                numbers = {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}
                syncs.setdefault(int(row[names.SYNC_STEP]), {}).update(numbers)
        for step, values in sorted(syncs.items()):
            windows = {r: v for k, v in values.items() if (r := names.parse_window_loss_metric(k)) is not None}
            if windows:
                losses = [windows.get(r, np.nan) for r in range(max(windows) + 1)]
                left, scope = values.get(names.SYNC_LEFT_OUT), values.get(names.SYNC_STEP_GUARD)
                marked = [
                    r for k, v in values.items() if (r := names.parse_left_out_metric(k)) is not None and v == 1.0
                ]
                run.converge.append(converge_from_series(step, losses, left, scope, marked))
        for row in history:
            for key, value in row.items():
                step = _row_step(row, key)
                parsed = names.parse_replica_metric(key)
                if parsed and isinstance(value, (int, float)) and step is not None:
                    rows.setdefault(parsed[0], {}).setdefault(step, {})[parsed[1]] = float(value)
        run.metrics.update(_user_metrics(history))
        tables = []
        for r, by_step in sorted(rows.items()):
            steps = np.array(sorted(by_step), dtype=np.int64)
            keys = sorted({k for d in by_step.values() for k in d} - {"loss"})
            tables.append(
                StepTable(
                    step=steps,
                    replica=np.full(len(steps), r, dtype=np.int32),
                    loss=np.array([by_step[s].get("loss", np.nan) for s in steps], dtype=float),
                    values={k: np.array([by_step[s].get(k, np.nan) for s in steps], dtype=float) for k in keys},
                )
            )
        run.steps = StepTable.concat(tables)

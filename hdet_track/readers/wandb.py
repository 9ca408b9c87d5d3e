"""Rebuild HDET runs from W&B run directories (offline runs, or synced runs' local copies).

Each run directory holds ``run-<id>.wandb`` (parsed by :mod:`hdet_track.wandb_file`) and, under
``files/hdet_events/``, the Parquet event archive. A directory still being written is read up to
its last complete record.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import numpy as np

from .. import names
from ..owner import described, overdue, owner_alive
from ..summaries import SUMMARY_DIR
from ..wandb_file import WandbFileCache, WandbFormatError
from ..wandb_store import (
    archived_last_step,
    read_owner,
    read_user_metrics,
    row_step,
    series,
    session_first_step,
    session_order,
    session_user_metrics,
)
from .archive import read_archive
from .base import (
    HDETRun,
    RunNotFoundError,
    RunSummary,
    StepTable,
    divergence_summaries,
    is_sync_series,
    sync_events_from_series,
)

__all__ = ["WandbReader", "find_run_dirs"]

# W&B's service is a process of its own: it may still be writing the end of a run whose training
# process has just exited. A run is read KILLED once its owner is gone AND this long has passed
# since the run file last changed (never from the file's age alone).
OWNER_GONE_GRACE_SECONDS = 2.0

# W&B's run files, parsed once per process and then only as far as they grew: the dashboard reads
# every run of a directory at each refresh, and a long run's file takes seconds to parse whole.
RUN_FILES = WandbFileCache()


def find_run_dirs(root: str | Path) -> list[Path]:
    """Run directories under ``root`` (a ``wandb`` folder, its parent, or one run directory). W&B
    writes into ``.wandb`` instead of ``wandb`` where that folder exists: both are looked in."""
    root = Path(root)
    if list(root.glob("run-*.wandb")):
        return [root]
    patterns = ("wandb/*run-*", ".wandb/*run-*", "*run-*")
    dirs = [p for pattern in patterns for p in root.glob(pattern) if p.is_dir()]
    return sorted({d for d in dirs if list(d.glob("run-*.wandb"))}, key=lambda p: p.name, reverse=True)


def _run_id(directory: Path) -> str:
    files = sorted(directory.glob("run-*.wandb"))
    return files[0].stem[len("run-") :] if files else directory.name.rsplit("-", 1)[-1]


_ENDED = ("FINISHED", "FAILED", "KILLED")  # hdet/status once hdet-track closed the run ("RUNNING" before)


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
        for d in sorted(find_run_dirs(self.root), key=session_order):
            out.setdefault(_run_id(d), []).append(d)
        return out

    def list_runs(
        self, experiment: str | None = None, compare_group: str | None = None, limit: int | None = 1000
    ) -> list[RunSummary]:
        out = []
        dirs = self._dirs()  # once: each run's read would look for every run's directories again
        for run_id in dirs:
            run = self._read(run_id, dirs, summary_only=True)
            if experiment and run.tags.get("project") != experiment:
                continue
            if compare_group and run.compare_group != compare_group:
                continue
            s = run.summary()
            s.experiment = run.tags.get("project", "")
            out.append(s)
        return sorted(out, key=lambda s: s.start_time, reverse=True)[:limit]

    def read(
        self,
        run_id: str,
        previous: HDETRun | None = None,
        summary_only: bool = False,
        steps: tuple[int, int] | None = None,
        max_rows: int | None = None,
    ) -> HDETRun:
        """The run; ``steps`` and ``max_rows`` as in :meth:`MLflowReader.read`."""
        if not isinstance(run_id, str) or not run_id:
            raise TypeError(f"Expected run_id to be a run's id (a non-empty str), but got {run_id!r}")
        return self._read(run_id, self._dirs(), previous, summary_only, steps, max_rows)

    def _read(
        self,
        run_id: str,
        dirs: dict[str, list[Path]],
        previous: HDETRun | None = None,
        summary_only: bool = False,
        steps: tuple[int, int] | None = None,
        max_rows: int | None = None,
    ) -> HDETRun:
        if run_id not in dirs:
            raise RunNotFoundError(f"Expected a W&B run {run_id!r} under {self.root}, but found {sorted(dirs)}")
        run = HDETRun(run_id=run_id, source=str(dirs[run_id][-1]), backend=self.backend)
        history: list[dict] = []
        sessions: list[tuple[list[dict], list[tuple[str, int, float]]]] = []  # per directory: history, user metrics
        earlier_error = ""  # the error an earlier session (attempt) of a resumed run ended with
        ended = ""  # the last session's status as hdet-track closed it
        for directory in dirs[run_id]:
            ended = ""
            sessions.append(([], read_user_metrics(directory)))
            try:
                wandb_file = sorted(directory.glob("run-*.wandb"))[0]
                contents = RUN_FILES.read(wandb_file)
            except WandbFormatError as exc:
                run.warnings.append(str(exc))
                continue
            except (OSError, IndexError) as exc:  # removed while read (`wandb sync --clean`)
                run.warnings.append(f"{directory.name}: its run file could not be read ({type(exc).__name__}: {exc})")
                continue
            sessions[-1][0].extend(contents.history)
            if not history:
                times = [row.get("_timestamp") for row in contents.history[:1] if row.get("_timestamp")]
                run.start_time = float(times[0]) if times else wandb_file.stat().st_mtime
            history += contents.history
            run.name = contents.name or run_id
            run.tags = {k: str(v) for k, v in contents.summary.items() if k.startswith("hdet.")}
            if earlier_error or contents.summary.get("hdet/resumed_after"):  # as MLflow keeps it: the run
                # went on after that attempt's error (an earlier session's, or one this session moved aside)
                run.tags["hdet.resumed_after"] = str(contents.summary.get("hdet/resumed_after") or earlier_error)
            if contents.summary.get("hdet/error"):
                run.tags["hdet.error"] = earlier_error = str(contents.summary["hdet/error"])
            for key in ("hdet/forked_from", "hdet/forked_at_step"):  # as MLflow's tags name a fork's origin
                if contents.summary.get(key) is not None:
                    run.tags[key.replace("/", ".")] = str(contents.summary[key])
            run.tags["project"] = contents.project
            if contents.group:
                run.tags.setdefault("hdet.compare_group", contents.group)
            closed = str(contents.summary.get("hdet/status") or "")  # hdet-track's close, written before W&B's end
            ended = closed if closed in _ENDED else ""
            if contents.exit_code is None:
                run.status = "RUNNING"  # no exit record (yet): live, or a process that died
            elif ended == "FINISHED" and contents.exit_code != 0:  # a given run whose owner failed after the close
                run.status = "FAILED"
                run.tags.setdefault(
                    "hdet.error",
                    f"hdet-track ended its training FINISHED; the run's owner then ended it with exit code {contents.exit_code}",
                )
            else:
                run.status = ended or ("FINISHED" if contents.exit_code == 0 else "FAILED")
        gone = self._owner_gone(dirs[run_id][-1]) if run.status == "RUNNING" else None
        if gone and ended:  # closed by hdet-track; its process went before W&B wrote the run's end
            run.status, gone = ended, None
        if gone:  # what the last session (the killed process's) logged, not an earlier one
            run.status = "KILLED"
            own_history, own_user = sessions[-1]
            logged = [s for row in own_history if isinstance(s := row.get(names.STEP), (int, float))]
            logged += [s for _, s, _ in own_user] + [archived_last_step(dirs[run_id][-1])]
            last = int(max(logged))
            run.tags["hdet.error"] = (
                f"{gone} after its last logged step {last}"
                if last > 0
                else f"{gone} before it logged a step the run did not hold yet"
            )
        if summary_only:
            # HDET's mean: hdet/loss in a run given to hdet-track, else loss in HDET's own rows (those
            # with hdet/step: in a given run, the owner's rows may log a loss of their own)
            key = names.MEANS_IN_GIVEN_RUN[names.LOSS]
            key = key if any(key in r for r in history) else names.LOSS
            own = any(names.STEP in r for r in history)
            # not a killed attempt's rows past the checkpoint the run resumed from
            standing = _rows_in_force(dirs[run_id], [h for h, _ in sessions])
            loss = {  # one point per step: the latest session's
                step: float(r[key])
                for r in standing
                if isinstance(r.get(key), (int, float))
                and (names.STEP in r or not own)
                and (step := row_step(r, key)) is not None
            }
            if loss:
                run.metrics.update(series({names.LOSS: list(loss.items())}))
            # (a resumed run's, finished too: its sessions write no rows for steps an earlier one holds)
            unsure = run.status != "FINISHED" or len(dirs[run_id]) > 1
            behind = unsure and archived_last_step(dirs[run_id][-1]) > max(loss, default=-1)
            if not behind:
                return run
            # W&B's file stops short of the archive (a killed or live run: W&B writes its file every
            # second): the final loss from the archive's summaries, as a full read gives it
            run.metrics.pop(names.LOSS, None)
            steps, max_rows = None, 0
        # each session's archive under its place in time: the archive reader lets a later one win
        scopes = [(f"{i:04d}.{d.name}", d) for i, d in enumerate(dirs[run_id])]
        chunks = {
            f"{scope}/{f.name}": f
            for scope, d in scopes
            for f in sorted((d / "files" / "hdet_events").glob("*.parquet"))
        }
        chunks |= {
            f"{scope}/{SUMMARY_DIR}/{f.name}": f
            for scope, d in scopes
            for f in sorted((d / "files" / "hdet_events" / SUMMARY_DIR).glob("*.parquet"))
        }
        if chunks:
            previous = None if previous is not None and previous.filled_from_rows else previous
            read_archive(run, list(chunks), lambda name: chunks[name].read_bytes(), previous, steps, max_rows)
            overview = run.overview and not summary_only  # (a summary's final loss is the archive's last step)
            if overview and _outside_the_archive(run, dirs[run_id], [h for h, _ in sessions], steps):
                # steps only W&B's rows hold cannot go into the archive's summaries: read in full
                return self._read(run_id, dirs, None, summary_only, steps, sys.maxsize)
            if not run.overview:
                self._fill_from_rows(run, dirs[run_id], [h for h, _ in sessions], steps)
            # the archive holds HDET's own series; the user's metrics (val_loss, diverged_at_step...) are rows
            builtin = (names.LOSS, names.LR) if run.has_step_series else ()
            run.metrics.update(session_user_metrics(sessions, skip=builtin))
        else:
            if run.live:  # a live run's first chunk comes within seconds of its first steps (as in MLflow)
                run.warnings.append("no event archive yet: shown from the run's history until its first chunk")
            else:
                run.warnings.append("no event archive: rebuilt from the run's history")
            rows = _rows_in_force(dirs[run_id], [h for h, _ in sessions])
            self._read_history(run, rows)
            # in a given run, loss and lr are its owner's and HDET's means hdet/loss and hdet/lr (as in MLflow)
            given = any(key in r for key in names.MEANS_IN_GIVEN_RUN.values() for r in rows)
            builtin = (names.LOSS, names.LR) if run.has_step_series or given else ()
            run.metrics.update(session_user_metrics(sessions, skip=builtin))
        return run

    @staticmethod
    def _owner_gone(directory: Path) -> str | None:
        """For a run with no exit record: the error text when its owning process (on this host) is
        gone, killed before it could end the run (SIGKILL, the OOM killer), so that the run reads
        KILLED and not live for ever; for an owner this host cannot check (another host or
        container), when its heartbeat is long overdue (:func:`~hdet_track.owner.silence`). None for
        a live owner, for an owner on time and for runs hdet-track did not start."""
        owner = read_owner(directory)
        if owner is None:
            return None
        alive = owner_alive(owner)
        if alive is None:  # another host or container: its heartbeat tells
            reason = overdue(owner, owner.get("alive"))
            return None if reason is None else f"{reason},"
        if alive:
            return None
        try:
            changed = max(f.stat().st_mtime for f in directory.glob("run-*.wandb"))
        except ValueError:
            changed = 0.0
        if time.time() - changed < OWNER_GONE_GRACE_SECONDS:
            return None  # W&B's service may still be writing the run's end
        return f"{described(owner)} ended without ending the run,"

    def _fill_from_rows(
        self, run: HDETRun, directories: list[Path], histories: list[list[dict]], view: tuple[int, int] | None
    ) -> None:
        """Steps and syncs W&B's rows hold and the event archive does not: a process killed between
        two archive chunks (W&B writes its file every second, the archive every few seconds) and
        resumed from a checkpoint inside that gap never writes those steps to the archive again.
        Each session's rows count only below where a later session took over (a killed attempt's
        steps past the checkpoint were redone or dropped), and a live session's tail is its
        archive's next chunk, not a gap."""
        have = set(np.unique(run.steps.step).tolist())
        synced = {c.step for c in run.converge}
        lo, hi = view if view is not None else (-math.inf, math.inf)
        rows = []
        for row in _rows_in_force(directories, histories, last=run.status != "RUNNING"):
            step = _axis_step(row)
            if step is None or not lo <= step <= hi:
                continue
            sync = isinstance(row.get(names.SYNC_STEP), (int, float))
            if (int(step) not in synced) if sync else (int(step) not in have):
                rows.append(row)
        if not rows:
            return
        extra = HDETRun(run_id=run.run_id)
        self._read_history(extra, rows)
        if not len(extra.steps) and not extra.converge:
            return
        run.steps = StepTable.concat([run.steps, extra.steps]).sorted()
        run.converge = sorted(run.converge + extra.converge, key=lambda c: c.step)
        decided = {(d.step, d.name) for d in run.controller}
        run.controller = sorted(
            run.controller + [d for d in extra.controller if (d.step, d.name) not in decided], key=lambda d: d.step
        )
        guarded = {(g.step, g.action) for g in run.guard}
        run.guard = sorted(
            run.guard + [g for g in extra.guard if (g.step, g.action) not in guarded], key=lambda g: g.step
        )
        run.filled_from_rows = True
        run.warnings.append(
            f"{len(np.unique(extra.steps.step))} steps and {len(extra.converge)} syncs read from W&B's rows: "
            "the event archive lacks them (a process killed before writing its last chunk)"
        )

    def _read_history(self, run: HDETRun, history: list[dict]) -> None:
        rows: dict[int, dict[int, dict[str, float]]] = {}
        series: dict[str, dict[int, float]] = {}  # the per-sync series, by sync step (a later row wins)
        for row in history:
            if isinstance(sync := row.get(names.SYNC_STEP), (int, float)):
                for key, value in row.items():
                    if is_sync_series(key) and isinstance(value, (int, float)):
                        series.setdefault(key, {})[int(sync)] = float(value)
        run.converge, run.controller, run.guard = sync_events_from_series(series, run.tags.get("hdet.controller", ""))
        run.metrics.update(divergence_summaries(series))
        for row in history:
            for key, value in row.items():
                step = row_step(row, key)
                parsed = names.parse_replica_metric(key)
                if parsed and isinstance(value, (int, float)) and step is not None:
                    rows.setdefault(parsed[0], {}).setdefault(step, {})[parsed[1]] = float(value)
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


def _axis_step(row: dict) -> float | None:
    """The step of one of hdet-track's rows (a sync's, or a step's); None for another row."""
    for axis in (names.SYNC_STEP, names.STEP):
        if isinstance(row.get(axis), (int, float)):
            return row[axis]
    return None


def _rows_in_force(directories: list[Path], histories: list[list[dict]], last: bool = True) -> list[dict]:
    """The sessions' rows (``histories``, one per directory of a resumed run, in order) that stand:
    each session's hdet-track rows only below where a later session took over (a killed attempt's
    steps past the checkpoint were redone, or dropped); ``last``: the last session's too (not for a
    live run, whose rows ahead of its archive are the archive's next chunk, not a gap)."""
    if len(histories) == 1:  # one session (most runs: the run list reads every one at each refresh)
        return list(histories[0]) if last else []
    firsts = (
        [math.inf]
        + [  # where each later session took over (the first's is never a limit)
            session_first_step(d, [r[names.STEP] for r in h if isinstance(r.get(names.STEP), (int, float))])
            for d, h in zip(directories[1:], histories[1:])
        ]
    )
    rows = []
    for i, history in enumerate(histories if last else histories[:-1]):
        limit = min(firsts[i + 1 :], default=math.inf)
        rows += [r for r in history if (step := _axis_step(r)) is None or step < limit]
    return rows


def _outside_the_archive(
    run: HDETRun, directories: list[Path], histories: list[list[dict]], view: tuple[int, int] | None
) -> bool:
    """Whether W&B's rows hold a step (in ``view``) that no steps chunk of the archive covers (see
    :meth:`WandbReader._fill_from_rows`), for an overview, which has the archive's summaries only."""
    covered = list(run.aggregates.chunks.values()) if run.aggregates is not None else []
    lo, hi = view if view is not None else (-math.inf, math.inf)
    for row in _rows_in_force(directories, histories, last=run.status != "RUNNING"):
        step = _axis_step(row)
        if step is None or not lo <= step <= hi or isinstance(row.get(names.SYNC_STEP), (int, float)):
            continue
        if not any(first <= step <= last for first, last in covered):
            return True
    return False

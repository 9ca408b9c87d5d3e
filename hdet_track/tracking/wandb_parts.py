"""The parts of a W&B run that :class:`~hdet_track.tracking.wandb.WandbTracker` keeps beside W&B's
own: a run given to it (``WandbTracker(run=...)``), what of each batch is new to the run (a resumed
job redoes steps), and the owner file a reader tells a live run from a killed one by."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import names
from ..owner import another_live_process, process_identity
from ..wandb_file import WandbFormatError, read_wandb_file
from ..wandb_store import OWNER_FILE, SYNC_PREFIXES, StoredSteps, read_owner, run_sessions
from .archive import ARTIFACT_DIR
from .base import Batch, Point

__all__ = ["Logged", "LOGGED", "GivenRun", "FreshRows", "OwnerFile", "taken"]

logger = logging.getLogger(__name__)


@dataclass
class Logged:
    """What this process's trackers logged into a run given to them (W&B accepted it): the last
    step of HDET's rows and of each user metric."""

    rows: int = -1
    user: dict[str, int] = field(default_factory=dict)

    def took(self, row: dict[str, float], step: int, axes: tuple[str, ...]) -> None:
        """W&B took ``row`` (at ``step``; ``axes`` are the step keys, not metrics)."""
        for key in row:
            if names.is_hdet_series(key):
                self.rows = max(self.rows, step)
            elif key not in axes:
                self.user[key] = max(self.user.get(key, -1), step)


# Per run id, for runs given to hdet-track (WandbTracker(run=...)): such a run, handed to several
# schedulers in turn (Hugging Face's or Lightning's across train()/fit() calls), holds an earlier
# scheduler's rows in its run file only once W&B flushes that (every 15 s by default for such a run)
LOGGED: dict[str, Logged] = {}


class GivenRun:
    """A run given to hdet-track (``WandbTracker(run=...)``): its owner may finish it first, and
    another scheduler of this process may log into it at the same time."""

    _open: dict[str, set[int]] = {}  # per run id, the trackers logging into it right now

    def __init__(self, run: Any) -> None:
        self.run = run
        self._said_ended = False

    def ended(self) -> bool:
        """Its owner finished it (``with wandb.init() as run:`` left before the scheduler closed):
        W&B takes nothing more into it; the event archive and user metrics still do."""
        if not getattr(self.run, "_is_finished", False):
            return False
        if not self._said_ended:
            self._said_ended = True
            logger.warning(
                "hdet-track: W&B run %s was finished by its owner before HDET's last steps: they are in "
                "hdet-track's event archive (%s), which hdet-track's readers read, not in W&B's rows",
                self.run.id,
                Path(self.run.dir) / ARTIFACT_DIR,
            )
        return True

    def call(self, calls: Callable[[], None]) -> None:
        """W&B calls on the run: none once its owner finished it (also meanwhile, in another
        thread: W&B then refuses them, and that is not an outage)."""
        if self.ended():
            return
        try:
            calls()
        except Exception:
            if not self.ended():
                raise

    def join(self, tracker: object) -> None:
        """``tracker`` starts logging into the run; two at once (a GAN's two schedulers in one
        ``wandb.init()``) would write over each other's event archive: said in a warning."""
        others = self._open.setdefault(self.run.id, set())
        if others - {id(tracker)}:
            logger.warning(
                "hdet-track: another scheduler is logging into W&B run %s right now: two at once write over "
                "each other's event archive and read back as one mixed run; give each scheduler its own run "
                "(close one before the next starts, as Hugging Face's train() and Lightning's fit() do)",
                self.run.id,
            )
        others.add(id(tracker))

    def leave(self, tracker: object) -> None:
        self._open.get(self.run.id, set()).discard(id(tracker))


def per_step(key: str) -> bool:
    """One of HDET's per-step series (not a sync series, not the user's)."""
    return names.is_hdet_series(key) and not key.startswith(SYNC_PREFIXES)


class FreshRows:
    """What of each batch is new to the run, for W&B's rows and for the archive: none of what its
    earlier sessions hold (``stored``; a job resumed from an older checkpoint redoes steps) nor, in
    a given run, the user's steps this process logged into it already (``user_through``); and a
    step's HDET rows once per session (a spill taken over up to the checkpoint, then the resumed
    job's first window, whose losses are in the checkpoint, would send some again)."""

    def __init__(self, stored: StoredSteps | None = None, user_through: dict[str, int] | None = None) -> None:
        self.stored = stored
        self.user_through = dict(user_through or {})
        self.through = (-1, -1)  # the last step of HDET's per-step rows this session logged, and archived

    def take(self, batch: Batch) -> tuple[list[Point], Batch]:
        """The points of ``batch`` for W&B's rows, and what of it goes to the archive."""
        points, stored = batch.points, self.stored
        if stored is not None:
            points = [
                p
                for p in points
                if (
                    p.step > stored.rows
                    if names.is_hdet_series(p.key)
                    else (p.key, p.step) not in stored.user and p.step > self.user_through.get(p.key, -1)
                )
            ]
            batch = batch.after(stored.archive)
        rows, archived = self.through
        points = [p for p in points if not (per_step(p.key) and p.step <= rows)]
        fresh = [b.select(b.step > archived) for b in batch.steps if (b.step > archived).any()]
        return points, dataclasses.replace(batch, steps=fresh)

    def sent(self, points: list[Point], batch: Batch) -> None:
        """``points`` went to W&B and ``batch`` to the archive."""
        rows, archived = self.through
        self.through = (
            max([rows, *(p.step for p in points if per_step(p.key))]),
            max([archived, *(int(b.step.max()) for b in batch.steps)]),
        )


class OwnerFile:
    """Who owns the run, in its event folder: a reader on this host tells a live run from one whose
    process was killed (SIGKILL, the OOM killer) before it could end the run, which W&B's file does
    not say; and the step this session started from (where it took over from the run's earlier
    ones). Replaced whole at each write: a reader never sees half of it."""

    def __init__(self, folder: Path, start_step: int) -> None:
        self.folder = folder
        self.record: dict[str, Any] = process_identity() | {"time": time.time(), "start_step": start_step}

    def write(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.folder / f".{OWNER_FILE}.tmp"
        temporary.write_text(json.dumps(self.record), encoding="utf-8")
        os.replace(temporary, self.folder / OWNER_FILE)

    def beat(self, beat: dict[str, float]) -> None:
        """This process is alive (the hub's heartbeat)."""
        self.record["alive"] = beat
        self.write()

    def release(self) -> None:
        """A run left open for its owner: this tracker's heartbeat does not speak for that process."""
        if self.record.pop("alive", None) is not None:
            self.write()


def taken(wandb_dir: Path, run_id: str, start_step: int, total_steps: int) -> bool:
    """Whether the run ``run_id``, which a resumed job's checkpoint (of step ``start_step``) names,
    is another attempt's, as its session folders in ``wandb_dir`` tell: its last session ended
    FINISHED at the schedule's end (``total_steps``), or a live process on this host owns it (see
    MLflow's ``_taken``: two jobs resumed from one checkpoint shared it)."""
    sessions = run_sessions(wandb_dir, run_id)
    if not sessions:
        return False
    if another_live_process(read_owner(sessions[-1])):
        return True
    try:
        ended = read_wandb_file(sessions[-1] / f"run-{run_id}.wandb")
    except (OSError, WandbFormatError):
        return False
    if ended.exit_code != 0 or ended.summary.get("hdet/status") != "FINISHED":
        return False
    # HDET's own per-step rows (a user metric may be logged at any step)
    steps = [row.get(names.STEP) for row in ended.history if any(per_step(k) for k in row)]
    through = max((int(s) for s in steps if isinstance(s, (int, float))), default=-1)
    return through > start_step and through >= total_steps

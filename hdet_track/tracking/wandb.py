"""Weights & Biases backend (offline unless ``mode``/``WANDB_MODE`` says otherwise): one run per job,
sync and controller series on a sync axis, Parquet event chunks in the run's files under
``hdet_events/``."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import string
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from .. import names
from .._checks import check_number, check_str
from ..errors import needs_extra
from ..events import RunEnd, RunStart
from ..wandb_file import RunFileProgress, WandbFormatError
from ..wandb_store import OWNER_FILE, SYNC_PREFIXES, USER_METRICS_FILE, StoredSteps, run_sessions
from . import lifecycle
from ._common import run_params, run_tags, warn_second_training
from .archive import ARTIFACT_DIR, EventArchive, chunk_index
from .base import Batch, Tracker, mask_secrets
from .wandb_parts import LOGGED, FreshRows, GivenRun, Logged, OwnerFile, taken

__all__ = ["WandbTracker", "DEFAULT_PROJECT", "DEFAULT_MODE", "SYNC_STEP", "STEP", "wait_until_written"]

logger = logging.getLogger(__name__)

DEFAULT_PROJECT = "hdet"
DEFAULT_MODE = "offline"  # the embedded default, as MLflow's is its sqlite store
# what wandb.init takes as mode
_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")
STEP = names.STEP
SYNC_STEP = names.SYNC_STEP
_STEP_GLOBS = (names.LOSS, names.LR, "hdet/replica_*")
# in a run given to hdet-track, whose loss (Lightning's, Hugging Face's) is its owner's
_GIVEN_STEP_GLOBS = (*names.MEANS_IN_GIVEN_RUN.values(), "hdet/replica_*")
# A run a resumed job did not continue, because another attempt had it: the run and the step it forked from.
FORKED_FROM = "hdet/forked_from"
FORKED_AT = "hdet/forked_at_step"
FINISH_WAIT_SECONDS = 15.0  # for W&B's service to close the run file after finish()
# wandb-core buffers the run file (``.wandb``) and writes it every ``x_transaction_log_flush_interval``
# seconds (15 by default): a SIGKILL (the OOM killer during evaluation) lost up to 15 s of history,
# after the last step exactly what matters (the last steps, val_loss). Unless the user chose an
# interval, runs hdet-track starts write it every second: at most one write() a second of what is
# buffered anyway, to a local file, in W&B's own process; nothing on the training thread (the bytes
# written are the same, only the number of writes grows, by about one a second). ``flush()`` then
# waits (bounded; typically under a second) until the file holds everything logged, so after
# ``sched.flush()`` the run file (what ``wandb sync`` uploads) is whole. On top of that,
# hdet-track's readers do not depend on W&B's timing at all: the per-step series and syncs are in
# hdet-track's own event archive, written by ``flush()`` in this process, and so are the user's
# metrics (``user_metrics.jsonl`` beside it) -- both on disk when ``flush()`` returns, even if W&B's
# wait timed out (a user-chosen interval of 0 or minutes, a stalled service).
TRANSACTION_LOG_FLUSH_INTERVAL = 1.0
FLUSH_WAIT_MARGIN = 5.0  # flush() waits at most the run's flush interval (<= 15 s) plus this
_INTERVAL_ENV = ("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL")


def wait_until_written(path: str | os.PathLike, timeout: float, progress: RunFileProgress | None = None) -> bool:
    """Wait (at most ``timeout`` seconds) until the run file ``path`` (``run-<id>.wandb``) holds
    the run's exit record. W&B's service writes that file in blocks and closes it after
    ``run.finish()`` has returned, in its own process: until then a reader sees only part of the
    run, or just the file's header. ``progress``, the file's reading so far (a tracker's
    ``flush()``), is read on from where it stopped."""
    progress = progress if progress is not None else RunFileProgress(path)
    return _wait_for(progress, timeout, lambda read: read.exit_code is not None)


def wait_until_holds(path: str | os.PathLike, step: int, timeout: float, progress: RunFileProgress) -> bool:
    """Wait (at most ``timeout`` seconds) until the run file ``path`` holds W&B's row ``step`` (its
    ``_step``); ``progress``, the file's reading so far, is read on from where it stopped."""
    return _wait_for(progress, timeout, lambda read: read.last_step is not None and read.last_step >= step)


def _wait_for(progress: RunFileProgress, timeout: float, done: Callable[[RunFileProgress], bool]) -> bool:
    """Read the run file on (only what W&B added) until ``done`` says so, or ``timeout`` seconds pass."""
    deadline, pause = time.monotonic() + timeout, 0.02
    while True:
        try:
            if done(progress.update()):
                return True
        except (OSError, WandbFormatError):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.2)


def _wait_for_rows(run: Any, path: str, progress: Callable[[str], RunFileProgress]) -> None:
    """Wait (bounded by W&B's own write interval) until its run file ``path`` holds every row ``run``
    logged so far; a warning when it gave up (the readers then take the rows from the archive)."""
    last = getattr(run, "_local_step", 0) - 1
    if last < getattr(run, "starting_step", 0):
        return  # nothing logged
    interval = float(getattr(run.settings, "x_transaction_log_flush_interval", 15.0) or 0.0)
    timeout = min(max(interval, 0.0), 15.0) + FLUSH_WAIT_MARGIN
    if not wait_until_holds(path, last, timeout, progress(path)):
        logger.warning(
            "hdet-track: W&B had not written step %d of run %s to %s when flush() gave up; hdet-track's "
            "readers take it from the event archive",
            last,
            run.id,
            path,
        )


def _define_metrics(run: Any, tags: dict[str, str], given: bool) -> None:
    """Every series against its own step (``hdet/step``, ``hdet/sync/step``), HDET's tags in the
    summary, and the run RUNNING in it (a given run may hold an earlier scheduler's end: a first
    ``train()`` closed, the process killed in the second must not read as that FINISHED)."""
    run.define_metric(STEP, hidden=True)
    run.define_metric(SYNC_STEP, hidden=True)
    for prefix in SYNC_PREFIXES:
        run.define_metric(f"{prefix}*", step_metric=SYNC_STEP)
    for glob in _GIVEN_STEP_GLOBS if given else _STEP_GLOBS:
        run.define_metric(glob, step_metric=STEP)
    for k, v in tags.items():
        run.summary[k] = v
    run.summary["hdet/status"] = "RUNNING"


def _stored_before(run: Any) -> StoredSteps | None:
    """What ``run`` holds already: its earlier sessions (offline, W&B writes a directory per session
    of a resumed run, beside this one; ``...-<id>-1`` when two start within a second) and this one
    (a run given to hdet-track, e.g. a Hugging Face or Lightning run across two ``train()``/``fit()``,
    holds what an earlier scheduler logged into it). None when there is nothing."""
    from ..wandb_store import stored_steps

    sessions = run_sessions(Path(run.dir).parent.parent, run.id)
    return stored_steps(sessions) if sessions else None


def _archive_folders(run: Any) -> list[Path]:
    """The event-archive folders of ``run`` on this disk: this session's and its earlier sessions'."""
    sessions = run_sessions(Path(run.dir).parent.parent, run.id)
    return [Path(run.dir) / ARTIFACT_DIR] + [d / "files" / ARTIFACT_DIR for d in sessions]


def _run_settings(wandb: Any) -> Any:
    """Settings for a run hdet-track starts: W&B's run file written every second, unless the user
    chose an interval (in the environment, ``wandb.setup(settings=...)`` or W&B's settings file)."""
    setup = wandb.setup()  # (also starts W&B's service)
    if any(os.environ.get(name) for name in _INTERVAL_ENV):
        return None  # the user's choice
    field = "x_transaction_log_flush_interval"
    try:
        chosen = getattr(setup.settings, field)  # what wandb.init would use
        default = wandb.Settings.model_fields[field].default
    except Exception:  # noqa: BLE001 - an older or newer wandb: keep to the environment check
        chosen = default = None
    if chosen != default:
        return None  # the user's choice
    return wandb.Settings(**{field: TRANSACTION_LOG_FLUSH_INTERVAL})


def _new_run_id() -> str:
    """A new W&B run id (8 characters of [a-z0-9], as W&B draws its own)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


def _import_wandb():
    try:
        import wandb
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(needs_extra("track='wandb'", "wandb", "wandb")) from exc
    return wandb


def _run_file(run: Any) -> str | None:
    """The run file W&B writes for ``run`` (``run-<id>.wandb``); None when it writes none (mode disabled)."""
    settings = run.settings
    if getattr(settings, "mode", "") == "disabled" or getattr(settings, "x_skip_transaction_log", False):
        return None
    return getattr(settings, "sync_file", None) or None


def _check_arguments(
    project: Any,
    entity: Any,
    mode: Any,
    group: Any,
    run_name: Any,
    dir: Any,  # noqa: A002
    chunk_seconds: Any,
    run: Any,
    tags: Any,
    notes: Any,
) -> None:
    """``WandbTracker``'s arguments, or an error naming the one that is wrong."""
    for name, value in [("project", project), ("entity", entity), ("group", group), ("run_name", run_name)]:
        check_str(name, value)
    check_str("notes", notes)
    if tags is not None and (
        isinstance(tags, str)
        or not isinstance(tags, (list, tuple))
        or not all(isinstance(t, str) and 0 < len(t) <= 64 for t in tags)
    ):
        raise ValueError(
            f"Expected tags to be a list of strings of 1 to 64 characters (W&B's limit) or None, but got {tags!r}"
        )
    if mode is not None and mode not in _MODES:
        raise ValueError(f"Expected mode in {_MODES} or None (WANDB_MODE, else offline), but got {mode!r}")
    if run is None and mode is None and os.environ.get("WANDB_MODE", _MODES[0]) not in _MODES:
        raise ValueError(f"Expected WANDB_MODE in {_MODES} or unset, but got {os.environ['WANDB_MODE']!r}")
    if dir is not None and not isinstance(dir, (str, os.PathLike)):
        raise TypeError(f"Expected dir to be a path or None, but got {type(dir).__name__}")
    check_number("chunk_seconds", chunk_seconds, 0.0, math.inf, low_open=False, high_open=True)  # 0: every batch


def _say_forked(run: Any, forked: str, step: int) -> None:
    """``run`` is a fork of the run ``forked`` at the checkpoint's step ``step``: in its summary and a warning."""
    run.summary[FORKED_FROM] = forked
    run.summary[FORKED_AT] = step
    logger.warning(
        "hdet-track: W&B run %s, which this job's checkpoint (step %d) continues, was ended FINISHED by another "
        "attempt or is being logged by a live process: this attempt logs to a new run, %s (its summary's %s and "
        "%s name the run and step it forked from)",
        forked, step, run.id, FORKED_FROM, FORKED_AT,
    )  # fmt: skip


class WandbTracker(Tracker):
    """Log an HDET run to W&B. ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE``,
    ``WANDB_RUN_GROUP``, ``WANDB_NAME``, ``WANDB_NOTES`` and ``WANDB_TAGS`` are honoured; the compare
    group becomes the run group. ``tags`` (W&B's limit: 64 characters each) and ``notes`` go to the
    run as ``wandb.init``'s do; the run also gets HDET's own tags after the user's.

    Offline by default: unless ``mode`` is given or ``WANDB_MODE`` is set, the run is written to a
    local ``wandb/offline-run-*`` directory (no network, no login; ``wandb sync`` uploads it later,
    and hdet-track's readers and dashboard read it as it is). Pass ``mode="online"`` or set
    ``WANDB_MODE=online`` to log to a W&B server.

    Every row carries its own step (``hdet/step``, or ``hdet/sync/step`` for the per-sync series),
    and every metric is plotted against it, so rows may reach W&B in any order. A resumed job
    continues the run (``resume="allow"``; offline, W&B writes a second directory for the same run
    id, which the reader merges); what the earlier directories hold (a checkpoint older than the
    store: steps done again) is not written twice.
    """

    name = "wandb"

    def __init__(
        self,
        project: str | None = None,
        entity: str | None = None,
        mode: str | None = None,
        group: str | None = None,
        run_name: str | None = None,
        dir: str | os.PathLike | None = None,  # noqa: A002 - wandb's own argument name
        chunk_seconds: float = 3.0,
        run: Any = None,
        tags: list[str] | tuple[str, ...] | None = None,
        notes: str | None = None,
    ) -> None:
        _import_wandb()
        _check_arguments(project, entity, mode, group, run_name, dir, chunk_seconds, run, tags, notes)
        self._existing = run  # log into a run someone else started (e.g. Lightning's WandbLogger)
        self._given = GivenRun(run) if run is not None else None
        self.project = project
        self.entity = entity
        self.mode = mode
        self.group = group
        self.run_name = run_name
        self._given_run_name = run_name  # run_name may be filled in per run (the scheduler's run_name=)
        self.dir = dir
        self.chunk_seconds = chunk_seconds
        self.tags = list(tags) if tags is not None else None
        self.notes = notes
        self._run: Any = None
        self._archive: EventArchive | None = None
        self._resume_id: str | None = None
        self._replaying = False  # a spill's replay: never the run $WANDB_RUN_ID names
        self._defined: set[str] = set()
        self._user_points: list[dict[str, Any]] = []  # user metrics not yet in user_metrics.jsonl
        self._fresh = FreshRows()  # what of each batch the run does not hold yet
        self._owner: OwnerFile | None = None
        self._progress: RunFileProgress | None = None  # how far W&B wrote this run's file, read on

    @property
    def run_id(self) -> str | None:
        return None if self._run is None else self._run.id

    @property
    def run(self) -> Any:
        return self._run

    def _root(self) -> str | None:
        """The directory holding ``wandb/``: a given run's own, else ``dir``, else ``$WANDB_DIR``."""
        given = getattr(getattr(self._existing, "settings", None), "root_dir", None)
        chosen = given or self.dir or os.environ.get("WANDB_DIR")
        return None if chosen is None else str(chosen)

    def spill_dir(self) -> Path:
        return Path(self._root() or ".") / "wandb" / ".hdet-spill"

    def spill_settings(self) -> dict[str, Any]:
        """How a replay (the next job, ``hdet-track recover``, maybe another shell) reaches the run:
        the project, entity, group and directory this process resolved from its arguments, its
        environment or the given run."""
        run = self._existing
        settings = {
            "project": getattr(run, "project", None)
            or self.project
            or os.environ.get("WANDB_PROJECT")
            or DEFAULT_PROJECT,
            "entity": getattr(run, "entity", None) or self.entity or os.environ.get("WANDB_ENTITY") or None,
            # the mode only when chosen here: a job that failed online (no key, no server) is
            # recovered in recover's own mode (WANDB_MODE, default offline: files to `wandb sync`)
            "mode": self.mode,
            "group": getattr(run, "group", None) or self.group or os.environ.get("WANDB_RUN_GROUP") or None,
        }
        return settings | {
            "run_name": self.run_name,
            "dir": self._root(),
            "tags": self._user_tags() or None,
            "notes": mask_secrets(self.notes or os.environ.get("WANDB_NOTES") or None),
        }

    def _user_tags(self) -> list[str]:
        """The user's tags: ``tags`` and ``WANDB_TAGS`` (comma-separated, as W&B reads it), in that
        order, each once (``wandb.init(tags=)``, which HDET's tags need, would drop the variable's)."""
        # a replay's tags are the job's, resolved when it spilled: not the replaying process's variable
        env = "" if self._replaying else os.environ.get("WANDB_TAGS", "")
        given = list(self.tags or []) + [t.strip() for t in env.split(",")]
        return list(dict.fromkeys(mask_secrets(t) for t in given if t.strip()))

    def _call(self, calls: Callable[[], None]) -> None:
        """W&B calls on the run (see :meth:`GivenRun.call` for a given one)."""
        if self._given is None:
            calls()
        else:
            self._given.call(calls)

    def _file_progress(self, path: str) -> RunFileProgress:
        """The reading of the run file ``path`` so far: each check parses only what W&B added."""
        if self._progress is None or self._progress.path != Path(path):
            self._progress = RunFileProgress(path)
        return self._progress

    def resume(self, run_id: str) -> None:
        if self._existing is None:
            self._resume_id = run_id

    @property
    def pending_run_id(self) -> str | None:
        return self._resume_id or getattr(self._existing, "id", None)

    def replaying(self) -> None:
        self._replaying = True

    def start(self, run_start: RunStart) -> None:
        # Once per run (a retry of start is a no-op); after finish() a new run (the next scheduler's).
        self._start_claimed(lambda: self._start(run_start))

    def _start(self, run_start: RunStart) -> None:
        self._run, self._archive, self._defined, self._user_points = None, None, set(), []
        self._fresh, self._owner = FreshRows(), None
        wandb = _import_wandb()
        tags = run_tags(run_start)
        if self._existing is not None:  # the owner's config stays: a key it holds otherwise goes as hdet/<key>
            config = self._existing.config
            params = {
                k if k not in config else f"hdet/{k}": v
                for k, v in run_params(run_start).items()
                if k not in config or str(config[k]) != str(v)  # one it holds already, equal: left as it is
            }
            self._call(lambda: config.update(params, allow_val_change=True))
            self._setup(self._existing, tags, run_start)
            return
        forked = None  # the run the checkpoint names, when another attempt has it: this one gets its own
        resumed = self._resume_id is not None and not self._replaying and run_start.start_step > 0
        asked = os.environ.get("WANDB_RUN_ID") == self._resume_id  # the job names its run itself (a requeue script)
        where = Path(self._root() or ".") / "wandb"
        if resumed and not asked and taken(where, str(self._resume_id), run_start.start_step, run_start.total_steps):
            forked, self._resume_id = self._resume_id, None
        settings = _run_settings(wandb)  # W&B set up: its service, whose exit handler would end the run
        lifecycle.end_runs_first_at_exit()  # hdet-track's first, also while wandb.init is under way
        run = wandb.init(
            project=self.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            entity=self.entity or os.environ.get("WANDB_ENTITY"),
            mode=self.mode or os.environ.get("WANDB_MODE") or DEFAULT_MODE,
            group=mask_secrets(self.group or run_start.compare_group or os.environ.get("WANDB_RUN_GROUP")),
            name=mask_secrets(self.run_name),
            dir=str(self.dir) if self.dir is not None else os.environ.get("WANDB_DIR") or None,
            config=run_params(run_start),
            # W&B's tags are at most 64 characters: longer ones stay in the summary only
            tags=self._user_tags() + [tag for k, v in tags.items() if len(tag := f"{k}={v}") <= 64][:20],
            # None: W&B's own ($WANDB_NOTES); a replay's are the job's, resolved when it spilled
            notes=mask_secrets(self.notes) or ("" if self._replaying else None),
            reinit="create_new",
            # a replay names its run: W&B would take $WANDB_RUN_ID (the replaying process's job's run);
            # so does a new run, $WANDB_RUN_ID as it is now: W&B's process-wide settings keep the
            # variable as it was when W&B was first set up, and two schedulers went into one run
            id=self._resume_id
            or (_new_run_id() if self._replaying or forked else os.environ.get("WANDB_RUN_ID") or _new_run_id()),
            resume="allow" if self._resume_id or self._replaying else None,
            settings=settings,
        )
        self._resume_id = None  # used up: a later run of this object is a new one unless resumed again
        self._setup(run, tags, run_start)
        if forked is not None:
            _say_forked(run, forked, run_start.start_step)

    def _setup(self, run: Any, tags: dict[str, str], run_start: RunStart) -> None:
        self._run = run
        if self._given is not None:
            self._given.join(self)
            owner = Path(run.dir) / ARTIFACT_DIR / OWNER_FILE
            if run_start.start_step == 0 and owner.exists():  # an earlier HDET training's (or a live one's)
                warn_second_training("W&B", run.id)

        self._call(partial(_define_metrics, run, tags, given=self._existing is not None))
        folder = Path(run.dir) / ARTIFACT_DIR
        # numbered after every chunk of the run on this disk: a given run's earlier scheduler's, and a
        # resumed run's earlier sessions' (`wandb sync` puts their files into the one run, where a
        # chunk named as an earlier session's replaced it)
        start = max((chunk_index(p.name) for f in _archive_folders(run) for p in f.glob("*.parquet")), default=0)
        self._archive = EventArchive(folder, chunk_seconds=self.chunk_seconds, start_index=start)
        self._owner = OwnerFile(folder, run_start.start_step)
        try:
            self._owner.write()
        except OSError as exc:  # pragma: no cover - an unwritable run directory fails later anyway
            logger.warning("hdet-track: could not record the W&B run's owner: %s", exc)
        if run_start.start_step > 0:  # a resumed job: what earlier sessions stored is not written twice
            stored = _stored_before(run) or StoredSteps()
            logged = LOGGED.get(run.id, Logged()) if self._existing is not None else Logged()
            stored.rows = max(stored.rows, logged.rows)  # what its file may not hold yet
            self._fresh = FreshRows(stored, logged.user)
            if (
                not (self._given and self._given.ended()) and "hdet/error" in run.summary.keys()
            ):  # the failed attempt's error goes aside
                run.summary["hdet/resumed_after"] = run.summary["hdet/error"]
                del run.summary["hdet/error"]

    def heartbeat(self, beat: dict[str, float]) -> None:
        if self._owner is not None and self._run_open:
            self._owner.beat(beat)

    def log(self, batch: Batch) -> None:
        rows: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
        points, batch = self._fresh.take(batch)
        if self._existing is not None:  # the run's loss/lr are its owner's: HDET's means go beside them
            points = [p._replace(key=names.MEANS_IN_GIVEN_RUN.get(p.key, p.key)) for p in points]
        for p in points:
            axis = SYNC_STEP if p.key.startswith(SYNC_PREFIXES) else STEP
            builtin = p.key in (names.LOSS, names.LR, *names.MEANS_IN_GIVEN_RUN.values())
            builtin = builtin or p.key.startswith("hdet/replica_")
            if axis == STEP and not builtin and p.key not in self._defined:
                self._call(partial(self._run.define_metric, p.key, step_metric=STEP))  # a user metric
                self._defined.add(p.key)
            if not names.is_hdet_series(p.key):
                self._user_points.append({"key": p.key, "step": p.step, "value": p.value})
            rows[(axis, p.step)][p.key] = p.value
        logged = LOGGED.setdefault(self._run.id, Logged()) if self._existing is not None else None

        def log_rows() -> None:
            for (axis, step), row in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                row[axis] = step
                self._run.log(row)
                if logged is not None:  # once W&B took it
                    logged.took(row, step, (STEP, SYNC_STEP))

        self._call(log_rows)
        assert self._archive is not None
        self._archive.add(batch.events)
        for block in batch.steps:
            self._archive.add_steps(block)
        self._fresh.sent(points, batch)
        if self._archive.due():
            self._write_archive()

    def _write_archive(self, live: bool = True) -> None:
        """The event archive (``live``: a write the disk refuses is kept for the next), then the user's metrics."""
        if self._archive is None:
            return
        if live:
            self._archive.write_or_keep()
        else:
            self._archive.write()
        if self._user_points:
            with open(self._archive.directory / USER_METRICS_FILE, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps(p) + "\n" for p in self._user_points))
            self._user_points = []

    def flush(self) -> None:
        """Write the event archive and the user's metrics, then wait (bounded) until W&B's run file
        holds every row logged so far: all of it survives a SIGKILL once this returns."""
        self._write_archive()
        if self._run is None or not self._run_open or self._existing is not None:
            return  # a given run's file is written at its owner's interval (15 s by default): not waited for
        path = _run_file(self._run)
        if path:  # else no run file to wait for
            _wait_for_rows(self._run, path, self._file_progress)

    def finish(self, run_end: RunEnd) -> None:
        if self._run is None or not self._run_open:
            return
        if self._given is not None:
            self._given.leave(self)
        self._finish(run_end)
        # Ended (run_id still names it): the next start(), a later scheduler's, makes a new run.
        self.run_name = self._given_run_name
        self._end_run()

    def _finish(self, run_end: RunEnd) -> None:
        self._write_archive(live=False)  # finish() waits for W&B's file below

        def end() -> None:
            self._run.summary["hdet/status"] = run_end.status
            if run_end.error:
                self._run.summary["hdet/error"] = run_end.error[-4000:]

        self._call(end)
        if self._existing is not None and self._owner is not None:
            self._owner.release()  # left open for its owner
        if self._existing is None:
            path = _run_file(self._run)
            self._run.finish(exit_code=0 if run_end.status == "FINISHED" else 1)
            # so that the run reads back whole as soon as close() returns (readers, `compare`)
            if path and not wait_until_written(path, FINISH_WAIT_SECONDS, self._file_progress(path)):
                logger.warning(
                    "hdet-track: W&B had not written the end of run %s to %s within %.0f s; it will once "
                    "its service closes the run",
                    self._run.id,
                    path,
                    FINISH_WAIT_SECONDS,
                )

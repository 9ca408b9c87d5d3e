"""MLflow backend: one run per job, ``log_batch`` from the hub's writer thread, Parquet event chunks
as artifacts under ``hdet_events/``."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import numbers
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import names
from .._checks import check_number, check_str
from ..errors import needs_extra
from ..events import RunEnd, RunStart
from ..owner import another_live_process, described, process_identity
from ..summaries import SUMMARY_DIR
from ._common import run_params, run_tags, warn_second_training
from .archive import ARTIFACT_DIR, EventArchive, artifact_dir, chunk_index
from .base import Batch, Point, Tracker, mask_secrets
from .spill import (
    PENDING_HEADER,
    PENDING_PREFIX,
    check_store_uri,
    pending_orphans,
    store_spill_dir,
    upload_pending_folder,
    uri_scheme,
)

__all__ = ["MLflowTracker", "DEFAULT_EXPERIMENT"]

logger = logging.getLogger(__name__)
DEFAULT_EXPERIMENT = "hdet"
_MAX_METRICS = 1000
_MAX_PARAMS = 100
# A run a resumed job did not continue, because another attempt had it (see _taken): the run and the
# checkpoint's step it forked from.
FORKED_FROM_TAG = "hdet.forked_from"
FORKED_AT_TAG = "hdet.forked_at_step"
# The last step whose HDET metric points are all in the store (set with each log_batch): where a
# resumed job's points begin (the thinned series cannot say, and the event archive may lag it).
LOGGED_THROUGH_TAG = "hdet.logged_through"


_NEEDS_MLFLOW = needs_extra("track='mlflow'", "mlflow", "mlflow")


def _require_mlflow() -> None:
    """Fail at construction when MLflow is not installed, without importing it: the training
    processes never do (1-2 s of CPU and about 120 MB each); the writer process does, at the run's start."""
    if importlib.util.find_spec("mlflow") is None:
        raise ImportError(_NEEDS_MLFLOW)


def _import_mlflow():
    try:
        import mlflow
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        if importlib.util.find_spec("mlflow") is None:  # pragma: no cover - depends on the environment
            raise ImportError(_NEEDS_MLFLOW) from exc
        # installed but broken (e.g. a protobuf or SQLAlchemy that does not fit it): say why
        raise ImportError(f"MLflow is installed but importing it failed ({type(exc).__name__}: {exc})") from exc
    return mlflow, MlflowClient


class MLflowTracker(Tracker):
    """Log an HDET run to MLflow.

    Args:
        tracking_uri: default ``$MLFLOW_TRACKING_URI``, else MLflow's default (``sqlite:///mlflow.db``).
        experiment: default ``$MLFLOW_EXPERIMENT_NAME``, else ``"hdet"``.
        run_name: the run's name.
        run_id: attach to this existing run (default ``$MLFLOW_RUN_ID``). An attached run is left
            open when training finishes (its owner ends it); a failure still marks it FAILED/KILLED.
            A given run that has ended already (an earlier attempt failed in it) is reopened, RUNNING
            while the job trains, and ended by the job (its earlier error moves to ``hdet.resumed_after``).
        parent_run_id: make the run a child of this run (nested runs).
        tags: extra tags.
        chunk_seconds: how often the event archive is written while the run is live.
    """

    name = "mlflow"
    # The hub runs it in a child process (IsolatedTracker): its SQLAlchemy work then never holds
    # the training process's GIL. Set False to keep it in-process (e.g. to inspect `client`).
    isolate = True

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        chunk_seconds: float = 3.0,
    ) -> None:
        _require_mlflow()
        if isinstance(tracking_uri, os.PathLike):
            tracking_uri = os.fspath(tracking_uri)
        for name, value in [("tracking_uri", tracking_uri), ("experiment", experiment), ("run_name", run_name)]:
            check_str(name, value)
        check_str("run_id", run_id)
        check_str("parent_run_id", parent_run_id)
        check_number("chunk_seconds", chunk_seconds, 0.0, math.inf, low_open=False, high_open=True)  # 0: every batch
        tags = _checked_tags(tags)
        _check_not_a_file_store(tracking_uri)
        if tracking_uri is not None:
            check_store_uri(tracking_uri, "tracking_uri")
        elif os.environ.get("MLFLOW_TRACKING_URI"):
            check_store_uri(os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI")
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self._given_run_name = run_name  # run_name may be filled in per run (the scheduler's run_name=)
        self._attach_id = run_id
        self.parent_run_id = parent_run_id
        self.extra_tags = dict(tags or {})
        self.chunk_seconds = chunk_seconds
        self._client: Any = None
        self._run_id: str | None = None
        self._attached = False
        self._given = False  # a run someone else opened: the means go under MEANS_IN_GIVEN_RUN
        self._resume_id: str | None = None
        self._carry_on: dict[str, Any] | None = None  # start() continues the run a process that died was logging
        self._from_environment = True  # $MLFLOW_RUN_ID attaches (not in a replay: see replaying())
        self._skip_until = -1  # HDET's metric points up to this step are in the store already
        self._archived = (-1, -1)  # a resumed run: the archive's step rows, and its events, up to these steps
        self._user_steps: dict[str, set[int]] | None = None  # a resumed run: user key -> steps in the store
        self._archive: EventArchive | None = None
        self._pending: _PendingChunks | None = None  # this run's archive chunks until they are uploaded

    @property
    def run_id(self) -> str | None:
        return self._run_id

    @property
    def client(self) -> Any:
        return self._client

    def _adopt_run_id(self, run_id: str) -> None:
        """This object ran in a child process (IsolatedTracker), which created run ``run_id``: so
        that ``run_id`` names it here too. A resume (or carry-on) request was for that run: used up."""
        self._run_id = run_id
        self._resume_id, self._carry_on = None, None

    def _adopt_run_end(self) -> None:
        """The run the child process logged has ended: a later scheduler gets its own name."""
        self.run_name = self._given_run_name

    def __getstate__(self) -> dict[str, Any]:
        # What IsolatedTracker sends its child: the settings (and a resume request), never the
        # state of a run this object logged before: each child, i.e. each scheduler, starts its run.
        state = self.__dict__.copy()
        state.update(_run_id=None, _client=None, _archive=None, _pending=None, _attached=False, _given=False)
        state.update(_skip_until=-1, _archived=(-1, -1), _user_steps=None)
        state.pop("_run_owner", None)
        return state

    def _uri(self) -> str:
        # MLflow's own default (3.x) without importing MLflow
        return self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"

    def spill_dir(self) -> Path:
        return store_spill_dir(self._uri())

    def spill_settings(self) -> dict[str, Any]:
        # as this process resolved them: the replaying process's environment is another job's
        experiment = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        return {
            "tracking_uri": self._uri(),
            "experiment": experiment,
            "run_name": self.run_name,
            "parent_run_id": self.parent_run_id,
            "tags": dict(self.extra_tags) or None,
        }

    @staticmethod
    def upload_pending(folder: Path, settings: dict[str, Any]) -> str:
        """See :func:`upload_pending` (what ``hdet-track recover`` calls for this backend)."""
        return upload_pending(folder, settings)

    @staticmethod
    def run_missing(settings: dict[str, Any], run_id: str) -> bool:
        """Whether run ``run_id`` does not exist in the store of ``settings`` (deleted for good, by
        ``mlflow gc``; a run in the trash exists). What a spill of it replays to: nothing, ever."""
        _, MlflowClient = _import_mlflow()
        try:
            MlflowClient(settings["tracking_uri"]).get_run(run_id)
        except Exception as exc:  # noqa: BLE001 - only MLflow's own answer for a run it does not have counts
            return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"
        return False

    def resume(self, run_id: str) -> None:
        if not self._attach_id:
            self._resume_id = run_id

    def carry_on(self, run_id: str, continuation: dict[str, Any] | None = None) -> None:
        self._carry_on = dict(continuation or {})
        if not self._attach_id:
            self._resume_id = run_id

    def continuation(self) -> dict[str, Any]:
        # a given run the job reopened is the job's to end, and is RUNNING when a later process looks
        return {"attached": self._attached, "given": self._given}

    def holds(self) -> bool:
        return self._archive is not None and self._archive.holds()

    def upload_left_behind(self) -> list[str]:
        return [upload_pending_folder(folder) for folder in pending_orphans(self.spill_dir())]

    @property
    def pending_run_id(self) -> str | None:
        attach = self._attach_id or (os.environ.get("MLFLOW_RUN_ID") if self._from_environment else None)
        return attach or self._resume_id  # as start() picks it

    def replaying(self) -> None:
        self._from_environment = False
        # its writer process, once the replaying process is gone (a recover killed half-way), leaves
        # the run as it is for the next replay: the job's end is in the spill (isolated._serve)
        self._replaying_spill = True

    def start(self, run_start: RunStart) -> None:
        # Once per run (a retry of start is a no-op); after finish() a new run (the next scheduler's).
        self._start_claimed(lambda: self._start(run_start))

    def _start(self, run_start: RunStart) -> None:
        self._client, self._run_id, self._attached, self._given = None, None, False, False
        self._skip_until, self._archived, self._user_steps = -1, (-1, -1), None
        self._archive, self._pending = None, None
        mlflow, MlflowClient = _import_mlflow()
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
        client = MlflowClient(uri)
        tags = run_tags(run_start)
        tags.update(self.extra_tags)
        # who owns the run: a reader on this host tells a live run from one whose processes were all
        # killed (a container stopped) before they could end it; MLflow's RUNNING says neither
        tags[names.MLFLOW_OWNER_TAG] = json.dumps(getattr(self, "owner", None) or process_identity())
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        attach = self._attach_id or (os.environ.get("MLFLOW_RUN_ID") if self._from_environment else None)
        # one given in code (Hugging Face's, Lightning's run), not $MLFLOW_RUN_ID (`mlflow run`'s, this job's own)
        self._given = bool(self._attach_id)
        carry = self._carry_on is not None
        replay = getattr(self, "_replaying_spill", False)  # a spill goes to the run its header names
        taken = (
            None
            if attach or carry or replay or not self._resume_id
            else _taken(client, self._resume_id, self, run_start)
        )
        if taken is not None:  # another attempt's run: this one gets its own, linked to it
            why, earlier = taken
            tags |= {FORKED_FROM_TAG: earlier.info.run_id, FORKED_AT_TAG: str(run_start.start_step)}
            name = mask_secrets(self.run_name) or earlier.info.run_name
            opened = _create(client, None, run_start, name, tags, experiment_id=earlier.info.experiment_id)
            logger.warning(
                "hdet-track: MLflow run %s, which this job's checkpoint (step %d) continues, %s: this attempt "
                "logs to a new run, %s (its tags %s and %s name the run and step it forked from)",
                earlier.info.run_id, run_start.start_step, why, opened.run_id, FORKED_FROM_TAG, FORKED_AT_TAG,
            )  # fmt: skip
        elif attach or self._resume_id:
            opened = _reopen(client, attach or self._resume_id, run_start, resumed=not attach, carry_on=carry)
        else:
            experiment = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
            opened = _create(client, experiment, run_start, mask_secrets(self.run_name), tags)
        _log_params_and_tags(client, opened, run_start, tags)
        self._attached = bool(attach) and not opened.reopen  # a given run we reopened is ours to end
        self._given = self._given or opened.means_given
        if self._carry_on:  # as the process that died had opened it
            self._attached = bool(self._carry_on.get("attached", self._attached))
            self._given = bool(self._carry_on.get("given", self._given))
        self._skip_until, self._archived, self._user_steps = opened.skip_until, opened.archived, opened.user_steps
        self._client = client
        self._run_id = opened.run_id
        head = {"backend": self.name, "run_id": opened.run_id, "settings": self.spill_settings()}
        self._pending = _PendingChunks(self.spill_dir(), head)
        self._archive = EventArchive(
            self._pending.folder / ARTIFACT_DIR,
            chunk_seconds=self.chunk_seconds,
            start_index=opened.start_index,
        )
        # used up, once the start went through (a retry after a full disk above reopens the same run):
        # a later run of this object is a new one
        self._resume_id, self._carry_on = None, None

    def keep_alive(self) -> None:
        if self._pending is not None:
            self._pending.touch()

    def log(self, batch: Batch) -> None:
        # The store and the archive each get only the steps they lack (a resumed job repeats some).
        self._log_user([p for p in batch.points if not names.is_hdet_series(p.key)])
        points = sorted(
            (p for p in batch.points if names.is_hdet_series(p.key) and p.step > self._skip_until), key=_step
        )
        if self._given:
            points = [p._replace(key=names.MEANS_IN_GIVEN_RUN.get(p.key, p.key)) for p in points]
        through = max([p.step for p in points] + [int(b.step.max()) for b in batch.steps if len(b)], default=-1)
        if through > self._skip_until:
            self._log_metrics(points, through)
        assert self._archive is not None
        steps_through, events_through = self._archived
        self._archive.add(batch.after(events_through).events)
        for block in batch.after(steps_through).steps:
            self._archive.add_steps(block)
            # a step's rows come once per session: a spill taken over up to the checkpoint, then the
            # resumed job's first window (its losses are in the checkpoint), would send some again
            steps_through = max(steps_through, int(block.step.max()))
        self._archived = (steps_through, events_through)
        if self._archive.due():
            self._pending.add(self._archive.write_or_keep())
        self._pending.upload(self._client, strict=False)

    def _log_user(self, points: list[Point]) -> None:
        """The user's metrics; after a resume, only a (key, step) the store does not hold yet."""
        if self._user_steps is None:
            self._log_metrics(points)
            return
        for key in {p.key for p in points} - set(self._user_steps):
            self._user_steps[key] = {m.step for m in self._client.get_metric_history(self._run_id, key)}
        points = list({(p.key, p.step): p for p in points if p.step not in self._user_steps[p.key]}.values())
        self._log_metrics(points)
        for p in points:
            self._user_steps[p.key].add(p.step)

    def _log_metrics(self, points: list[Point], through: int | None = None) -> None:
        """``points`` in log_batch calls. With ``through`` (HDET's points, in step order, up to step
        ``through``) each call also sets LOGGED_THROUGH_TAG to the last step it completes."""
        for done in _log_batches(self._client, self._run_id, points, through):
            self._skip_until = max(self._skip_until, done)

    def refuses(self, exc: BaseException) -> bool:
        # what MLflow answers for a value it will never take (a sqlite store and a server alike);
        # a locked database, a rate limit or a server error is not this, and neither is a run that
        # was deleted (the same code; everything waits in the spill until it is restored)
        if super().refuses(exc):
            return True
        if getattr(exc, "error_code", None) != "INVALID_PARAMETER_VALUE" or self._run_id is None:
            return False
        try:
            return self._client.get_run(self._run_id).info.lifecycle_stage == "active"
        except Exception:  # noqa: BLE001 - cannot tell: not a refusal
            return False

    def heartbeat(self, beat: dict[str, float]) -> None:
        if self._run_id is not None and self._run_open:
            self._client.set_tag(self._run_id, names.MLFLOW_ALIVE_TAG, json.dumps(beat))

    def flush(self) -> None:
        if self._archive is not None and self._pending is not None:
            self._pending.add(self._archive.write_or_keep())
            self._pending.upload(self._client, strict=False)

    def finish(self, run_end: RunEnd) -> None:
        if self._run_id is None or not self._run_open:
            return
        if self._archive is not None and self._pending is not None:
            try:
                self._pending.add(self._archive.write())
            except OSError as exc:  # this host's disk, not the store: the run still ends, and says so
                self._pending.add(self._archive.written())  # the chunks it did write still go
                logger.error(
                    "hdet-track: the event archive's last rows of run %s could not be written (%s: %s); the run "
                    "ends without them (its metric histories hold every step)", self._run_id, type(exc).__name__, exc,
                )  # fmt: skip
            self._pending.upload(self._client, strict=True)
        if run_end.error:
            self._client.set_tag(self._run_id, "hdet.error", run_end.error[-4900:])
        if not (self._attached and run_end.status == "FINISHED"):  # else its owner (a Lightning logger...) ends it
            end_ms = int((run_end.time or time.time()) * 1000)
            self._client.set_terminated(self._run_id, status=run_end.status, end_time=end_ms)
        elif names.MLFLOW_ALIVE_TAG in self._client.get_run(self._run_id).data.tags:
            # left open for its owner, whose process this tracker's heartbeat does not speak for
            self._client.delete_tag(self._run_id, names.MLFLOW_ALIVE_TAG)
        # Ended (run_id still names it): the next start(), a later scheduler's, makes a new run.
        self.run_name = self._given_run_name
        if self._pending is not None:
            self._pending.remove()  # every chunk is in the store
            self._pending = None
        self._end_run()


class _PendingChunks:
    """Where a run's archive chunks wait until they are uploaded: a folder of the spill directory
    ``spill_dir``, so that chunks an outage or a kill kept from the store are found again (by the
    next job on the store or ``hdet-track recover``; :func:`upload_pending`). An uploaded chunk is
    removed from it, and the folder when the run ends. ``head`` says whose they are (backend, run
    id, store settings); this process is added as their writer."""

    def __init__(self, spill_dir: Path, head: dict[str, Any]) -> None:
        run_id = head["run_id"]
        self.run_id = run_id
        self.paths: list[Path] = []  # written, not yet uploaded, oldest first
        head = head | {"owner": process_identity()}
        folder = spill_dir / f"{PENDING_PREFIX}{run_id}-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _write_private(folder / PENDING_HEADER, json.dumps(head))
        except OSError as exc:  # a read-only home, no home: the store works, so the run must too
            fallback = Path(tempfile.mkdtemp(prefix=f"{PENDING_PREFIX}{run_id}-"))
            logger.warning(
                "hdet-track: cannot write %s (%s: %s); this run's event-archive chunks wait in %s until uploaded "
                "instead (a job killed before uploading them leaves them there, where no later job looks)",
                folder, type(exc).__name__, exc, fallback,
            )  # fmt: skip
            folder = fallback
            _write_private(folder / PENDING_HEADER, json.dumps(head))
        self.folder = folder

    def add(self, paths: list[Path]) -> None:
        self.paths += paths

    def upload(self, client: Any, strict: bool) -> None:
        """Upload the waiting chunks, oldest first; one the store refuses stays (``strict``: raised)."""
        while self.paths:
            path = self.paths[0]
            try:
                client.log_artifact(self.run_id, str(path), artifact_dir(path))
            except Exception:
                if strict:
                    raise
                logger.debug("hdet-track: artifact upload of %s deferred", path, exc_info=True)
                return
            self.paths.pop(0)
            path.unlink(missing_ok=True)

    def touch(self) -> None:
        """The writer is alive (a quiet run's chunks are not another job's to upload)."""
        os.utime(self.folder / PENDING_HEADER)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _write_private(path: Path, text: str) -> None:
    """``text`` in ``path``, readable by this user alone (0600): a header holds the store's settings,
    whose URI may carry a password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # also a file that was there
    with os.fdopen(fd, "w") as f:
        f.write(text)


def upload_pending(folder: Path, settings: dict[str, Any]) -> str:
    """Upload the archive chunks a gone process left in ``folder`` (see
    :class:`_PendingChunks`) to their run, oldest first; a chunk the run already
    holds (uploaded just before that process died) is not sent twice. The folder is removed once
    every chunk is in the store; returns a line saying what happened."""
    head = json.loads((folder / PENDING_HEADER).read_text())
    run_id = head["run_id"]
    _, MlflowClient = _import_mlflow()
    client = MlflowClient(settings["tracking_uri"])
    held = {f.path for f in client.list_artifacts(run_id, ARTIFACT_DIR)}
    held |= {f.path for f in client.list_artifacts(run_id, f"{ARTIFACT_DIR}/{SUMMARY_DIR}")}
    files = sorted(
        (p for p in (folder / ARTIFACT_DIR).rglob("*.parquet") if not p.name.startswith(".")),
        key=lambda p: (chunk_index(p.name), p.name),
    )
    sent = 0
    for path in files:
        where = artifact_dir(path)
        if f"{where}/{path.name}" not in held:
            client.log_artifact(run_id, str(path), where)
            sent += 1
        path.unlink()
    shutil.rmtree(folder, ignore_errors=True)
    return f"{folder.name}: {sent} archive file(s) uploaded to mlflow run {run_id} in {settings['tracking_uri']}"


@dataclass
class _Opened:
    """The run a start logs into, and what a resumed job finds in it already."""

    run_id: str
    reopen: bool = False  # an ended run made RUNNING again: ours to end
    params: frozenset[str] = frozenset()  # the params it holds (MLflow refuses to change one)
    start_index: int = 0  # the archive's next chunk number
    skip_until: int = -1  # HDET's metric points up to this step are in the store already
    archived: tuple[int, int] = (-1, -1)  # the archive's step rows, and its events, up to these steps
    user_steps: dict[str, set[int]] | None = None  # user key -> steps in the store (a resumed job)
    # HDET's means are in the run under their given-run names (an earlier attempt logged into a run
    # it was given, whose owner logs a ``loss`` of its own): a resumed attempt keeps them there
    means_given: bool = False


def _create(
    client: Any,
    experiment: str | None,
    run_start: RunStart,
    run_name: str | None,
    tags: dict[str, str],
    experiment_id: str | None = None,
) -> _Opened:
    """A new run in ``experiment`` (made if need be; never for a run given to attach to), or in the
    experiment ``experiment_id``."""
    exp_id = experiment_id
    if exp_id is None:
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    start_ms = int((run_start.time or time.time()) * 1000)
    return _Opened(client.create_run(exp_id, start_time=start_ms, run_name=run_name, tags=tags).info.run_id)


def _taken(client: Any, run_id: str, tracker: Any, run_start: RunStart) -> tuple[str, Any] | None:
    """Why the run ``run_id``, which a resumed job's checkpoint names, is another attempt's, and
    the run; None when it is this job's to continue (its earlier attempt failed, was killed, or
    left it RUNNING with no live process, or closed it FINISHED before the schedule's end: a job
    run in parts). Two jobs resumed from one checkpoint (a fork, a rerun
    of a job that finished) shared it: the second found it logged through the end and wrote
    nothing, or, at once, both wrote every step. Another host's process is not checked: a job
    restarted at once after its host died would take its own run for another's."""
    run = client.get_run(run_id)
    if run.info.status == "FINISHED":  # by an attempt that reached the schedule's end
        through = _logged_through(client, run)
        if through <= run_start.start_step or through < run_start.total_steps:
            return None  # a job run in parts, closed early (FINISHED) and resumed: its own
        return f"was ended FINISHED by another attempt that reached the schedule's end (step {through})", run
    if run.info.status != "RUNNING":
        return None
    try:
        owner = json.loads(run.data.tags.get(names.MLFLOW_OWNER_TAG, ""))
    except ValueError:
        return None
    if another_live_process(owner, getattr(tracker, "owner", None)):
        return f"is being logged by {described(owner)}, which is alive", run
    return None


def _reopen(client: Any, run_id: str, run_start: RunStart, resumed: bool, carry_on: bool = False) -> _Opened:
    """An existing run: one of ours resumed from a checkpoint (``resumed``), or a given one. Either
    is RUNNING again and ended by us when it has ended (its earlier attempt ended it FAILED) and the
    job resumes; a given run ended by its owner before a fresh job (Lightning between two fits)
    stays the owner's. A resumed job writes nothing the run holds already, and neither does a
    tracker process that takes over from one that died (``carry_on``)."""
    run = client.get_run(run_id)
    reopen = resumed or (run_start.start_step > 0 and run.info.status != "RUNNING")
    chunks = [f.path for f in client.list_artifacts(run_id, ARTIFACT_DIR)]
    opened = _Opened(
        run.info.run_id,
        reopen=reopen,
        params=frozenset(run.data.params),
        start_index=max((chunk_index(p) for p in chunks), default=0),  # continue the archive's numbering
        means_given=any(key in run.data.metrics for key in names.MEANS_IN_GIVEN_RUN.values()),
    )
    earlier = run.data.tags.get(LOGGED_THROUGH_TAG)
    if not resumed and not carry_on and run_start.start_step == 0 and earlier is not None:
        warn_second_training("MLflow", run_id, earlier)
    if run_start.start_step > 0 or carry_on:
        opened.skip_until = _logged_through(client, run)
        opened.archived = _archived_through(client, run_id, chunks)
        opened.user_steps = {}
    if reopen and "hdet.error" in run.data.tags:  # the interrupted part's error; the run goes on
        client.set_tag(run_id, "hdet.resumed_after", run.data.tags["hdet.error"][-4900:])
        client.delete_tag(run_id, "hdet.error")
    return opened


def _log_params_and_tags(client: Any, opened: _Opened, run_start: RunStart, tags: dict[str, str]) -> None:
    """The run's params (those it lacks) and tags; then RUNNING again if it was reopened, once the
    tags name its new owner (not the earlier attempt's, with its heartbeat)."""
    from mlflow.entities import Param, RunTag

    params = [Param(k, v) for k, v in run_params(run_start).items() if k not in opened.params]
    run_tags_list = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, max(len(params), 1), _MAX_PARAMS):
        client.log_batch(opened.run_id, params=params[i : i + _MAX_PARAMS], tags=run_tags_list if i == 0 else [])
    if opened.reopen:
        client.update_run(opened.run_id, status="RUNNING")


def _log_batches(client: Any, run_id: str, points: list[Point], through: int | None) -> Iterator[int]:
    """``points`` in log_batch calls, each cut between two steps. With ``through`` (HDET's points,
    in step order, up to step ``through``) each call also sets LOGGED_THROUGH_TAG to the last step
    it completes, and yields that step once the call returned."""
    from mlflow.entities import Metric, RunTag

    size = _MAX_METRICS - (through is not None)  # a tag counts against log_batch's 1000 entities
    bounds = list(_step_slices(points, size)) or ([(0, 0)] if through is not None else [])
    for i, j in bounds:
        tags = []
        if through is not None:
            done = points[j].step - 1 if j < len(points) else through
            tags = [RunTag(LOGGED_THROUGH_TAG, str(done))]
        metrics = [Metric(p.key, p.value, p.timestamp_ms, p.step) for p in points[i:j]]
        client.log_batch(run_id, metrics=metrics, tags=tags, synchronous=True)
        if through is not None:
            yield done


def _check_not_a_file_store(tracking_uri: str | None) -> None:
    """HDET's metric names nest (``hdet/sync/left_out`` and ``hdet/sync/left_out/replica_00``), and
    a file store keeps each name as a file: the second cannot be a folder where the first is a file.
    Its runs lost points and were ended KILLED with their data left in the spill."""
    given = tracking_uri is not None
    uri = tracking_uri if given else os.environ.get("MLFLOW_TRACKING_URI")
    name = "tracking_uri" if given else "MLFLOW_TRACKING_URI"
    if not uri:  # MLflow's own: set in code (mlflow.set_tracking_uri), or its default (./mlruns in MLflow 2)
        import mlflow

        uri, name = mlflow.get_tracking_uri(), "MLflow's tracking URI (mlflow.get_tracking_uri())"
    if uri_scheme(uri) not in (None, "file"):
        return
    raise ValueError(
        f"Expected {name} to be a database or a tracking "
        f"server (sqlite:///mlflow.db, http://HOST:PORT, ...), but got {uri!r}, an MLflow file store: "
        "HDET's metric names nest (hdet/sync/left_out and hdet/sync/left_out/replica_00), which a file "
        "store cannot hold (MLflow 3 deprecates file stores too)"
    )


def _checked_tags(tags: Any) -> dict[str, str]:
    """The user's extra tags as MLflow stores them (values as str), or an error naming the bad one:
    a tag MLflow refuses would fail the run's start in the writer, over and over."""
    if tags is None:
        return {}
    if not isinstance(tags, Mapping):
        raise TypeError(f"Expected tags to be a dict of str to str, but got {type(tags).__name__}")
    out = {}
    for key, value in tags.items():
        if not isinstance(key, str) or (problem := names.name_problem(key)) is not None:
            why = "not a str" if not isinstance(key, str) else problem
            raise ValueError(f"Expected tag names MLflow takes, but got {key!r}: {why}")
        if not isinstance(value, (str, numbers.Number)):
            raise TypeError(f"Expected tags[{key!r}] to be a str (or a number), but got {type(value).__name__}")
        out[key] = str(value)
    return out


def _step(point: Point) -> int:
    return point.step


def _step_slices(points: list[Point], size: int):  # noqa: ANN202
    """(start, stop) of slices of at most ``size`` points, cut between two steps wherever a step
    fits: a process killed between two log_batch calls leaves no step half-written."""
    i = 0
    while i < len(points):
        j = min(i + size, len(points))
        if j < len(points):
            j = next((k for k in range(j, i, -1) if points[k].step != points[k - 1].step), j)
        yield i, j
        i = j


def _logged_through(client: Any, run: Any) -> int:
    """The last step whose HDET points are all in ``run``'s store; for a run logged before
    LOGGED_THROUGH_TAG, the last step of replica 0's series and the sync series (thinned: a lower
    bound). Not the ``loss`` mean: in a run HDET attaches to (Hugging Face's, Lightning's) the
    owner logs a ``loss`` of its own, and a resumed job skipped every step up to the owner's. Nor
    the series where the tag is set: a given run may hold an earlier fit's steps past it. (A
    log_batch commits its metrics before its tags: a job killed between the two leaves that call's
    points in the raw store, and its resumed job writes them again; the readers keep one per step.)"""
    tag = run.data.tags.get(LOGGED_THROUGH_TAG, "")
    if tag.lstrip("-").isdigit():
        return int(tag)
    keys = (names.replica_metric(0, "loss"), names.replica_metric(0, names.LR), names.SYNC_LEFT_OUT)
    history = [m for key in keys for m in client.get_metric_history(run.info.run_id, key)]
    return max((m.step for m in history), default=-1)


def _archived_through(client: Any, run_id: str, chunks: list[str]) -> tuple[int, int]:
    """The last step of the event archive's step rows and of its sync events (its latest chunk of
    each kind that has any; not the run's start and end)."""
    import pyarrow.parquet as pq

    through = []
    for kind in ("steps", "events"):
        last = -1
        named = [p for p in chunks if p.rsplit("/", 1)[-1].startswith(f"{kind}-")]
        for path in sorted(named, key=chunk_index, reverse=True):
            with tempfile.TemporaryDirectory() as tmp:
                local = client.download_artifacts(run_id, path, tmp)
                table = pq.read_table(local, columns=["kind", "step"] if kind == "events" else ["step"]).to_pydict()
            rows = zip(table.get("kind", [kind] * len(table["step"])), table["step"])
            last = max((step for k, step in rows if k not in ("run_start", "run_end")), default=-1)
            if last >= 0:
                break
        through.append(last)
    return through[0], through[1]

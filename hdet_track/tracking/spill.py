"""What could not reach a backend yet: spill files, kept in a documented place and replayed.

While a backend is down, the hub appends each batch to a spill file (JSON lines) and replays them
in order once it is back. A spill that is still there when the process ends stays where the next
process that logs to the same store finds it, and delivers it (or ``hdet-track recover``):

- MLflow, a ``sqlite:`` store: ``.hdet-spill/`` beside the database file; a ``file:`` store or a
  plain path: ``.hdet-spill/`` beside its directory (MLflow takes any folder inside it for an
  experiment); an ``http(s)://`` server:
  ``~/.cache/hdet-track/spill/<host>_<port>/`` (``$XDG_CACHE_HOME`` is honoured); any other MLflow
  store (a database server, Databricks, a plugin's): ``~/.cache/hdet-track/spill/<scheme>_<host>_<port><path>/``;
- W&B: ``.hdet-spill/`` inside the ``wandb`` directory;
- other trackers: ``~/.cache/hdet-track/spill/<name>/``.

The first line of a spill file says how to reach the run again: the backend, its settings, the run
id (once created) and the run's start event; each further line is one batch.

A part of a batch the backend refused for its content (:meth:`~hdet_track.tracking.base.Tracker.refuses`:
a value it will never take, not an outage) is set aside in a ``refused-*.jsonl`` file of the same
form beside the spills, with a warning naming it: it is evidence to read, not retried (neither by
the next process nor by ``hdet-track recover``), and it no longer holds back the rest of the run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlsplit

from .. import names
from ..events import RunEnd, RunStart, UnknownSchemaError, event_from_dict
from ..owner import owner_alive, process_identity
from .archive import StepBlock
from .base import Batch, Point, Tracker, mask_secrets

__all__ = [
    "KEEP_ALIVE_SECONDS",
    "SpillFile",
    "cache_dir",
    "store_spill_dir",
    "unknown_scheme",
    "spill_dirs",
    "replay_file",
    "recover",
    "log_or_set_aside",
    "describe_part",
    "check_store_uri",
    "Attention",
]

logger = logging.getLogger(__name__)
DIRNAME = ".hdet-spill"
# A run's archive chunks not uploaded yet: <spill dir>/pending-<run id>-<pid>/, with this header
# (backend, run id, store settings, writer); see MLflowTracker._pending_chunks
PENDING_PREFIX = "pending-"
PENDING_HEADER = "pending.json"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hdet-track" / "spill"


# The URI schemes of MLflow's own tracking stores (a SQLAlchemy URI's "dialect+driver" counts as its
# dialect); a store of an MLflow plugin registers its scheme under the entry points' group below.
STORE_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")
PLUGIN_GROUP = "mlflow.tracking_store"


# MLflow tracking URIs that are a scheme alone (Databricks' default profile)
BARE_SCHEMES = ("databricks",)


def uri_scheme(source: str) -> str | None:
    """The scheme of ``source`` when it is a URI (``postgresql`` for ``postgresql+psycopg2://...``,
    ``databricks`` for ``databricks``), else None (a path)."""
    if "://" not in source:
        head = source.split(":", 1)[0].lower()
        if source in BARE_SCHEMES or (":" in source and head in ("file", "sqlite")):  # file:./mlruns
            return head
        return None
    return source.split("://", 1)[0].split("+", 1)[0].lower()


def unknown_scheme(source: str) -> str | None:
    """The scheme of ``source`` when it is a URI of no store MLflow knows (a typo such as ``foo://bar``:
    a job cannot have logged there), else None (a path, or a known store's URI)."""
    scheme = uri_scheme(source)
    if scheme is None or scheme in STORE_SCHEMES:
        return None
    from importlib.metadata import entry_points

    return None if scheme in {ep.name for ep in entry_points(group=PLUGIN_GROUP)} else scheme


# The schemes whose URIs name a host and port (an MLflow server, a database server); a
# ``databricks://PROFILE:PREFIX`` URI has no port, and a plugin's store says what its URIs mean.
_HOST_SCHEMES = ("http", "https", "postgresql", "mysql", "mssql")
_URI_FORMS = (
    "an MLflow tracking URI (sqlite:///PATH, file:///PATH, http(s)://HOST[:PORT], "
    "postgresql://, mysql://, mssql://, databricks://) whose port, if any, is a number in 1..65535"
)


def check_store_uri(source: str, name: str) -> None:
    """A ValueError naming ``name`` (the argument ``source`` came from) when ``source`` is a URI of
    a server that names no usable host and port (``http://127.0.0.1:50O0``, ``http://[::1``): urllib's
    own error for it names neither the argument nor what it takes."""
    scheme = uri_scheme(source)
    if scheme not in _HOST_SCHEMES or "://" not in source:
        return
    why = None
    try:
        url = urlsplit(source)
    except ValueError:
        why = "its host has a '[' with no ']'"
    else:
        port = url.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")[2]
        try:
            number = url.port
        except ValueError:
            number = -1
        if port and not (number is not None and 1 <= number <= 65535):
            why = f"its port {port!r} is not a number in 1..65535"
        elif scheme in ("http", "https") and not url.hostname:
            why = "it names no host"
    if why:
        raise ValueError(f"Expected {name} to be {_URI_FORMS}, but got {mask_secrets(source)!r}: {why}")


def store_spill_dir(source: str) -> Path:
    """Where spills of the store ``source`` live (an MLflow tracking URI or a W&B directory).

    Raises:
        ValueError: ``source`` is a server's URI with no usable host or port (:func:`check_store_uri`).
    """
    check_store_uri(source, "tracking_uri")
    if source.startswith("sqlite:///"):  # sqlite:///relative.db, sqlite:////absolute.db
        return Path(source[len("sqlite:///") :]).resolve().parent / DIRNAME
    if uri_scheme(source) in ("http", "https"):  # one place however the URI is spelled (case, a last /)
        url = urlparse(source)
        return cache_dir() / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{url.hostname}_{url.port or ''}{url.path.rstrip('/')}")
    if source.startswith("file:"):  # beside the store: MLflow takes every folder inside it for an experiment
        return Path(urlparse(source).path).resolve().parent / DIRNAME
    if uri_scheme(source) is not None:  # a database server, Databricks, a plugin's store: not a path
        url = urlparse(source if "://" in source else f"{source}://")  # host, port, path: never its credentials
        try:
            port = url.port
        except ValueError:  # not a number: the store will say so
            port = None
        where = f"{uri_scheme(source)}_{url.hostname or ''}_{port or ''}{url.path}"
        return cache_dir() / re.sub(r"[^A-Za-z0-9_.-]", "_", where)
    return Path(source) / DIRNAME


class SpillFile:
    """One tracker's spill: a header line, then one line per batch. Its files are this user's alone
    (mode 0600): the header holds the store's settings, whose URI may carry a password."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header

    def append(self, batch: Batch) -> None:
        """One line, in one write. A new file gets its header first, whole or not at all (written
        apart and renamed into place: a full disk cannot leave a spill whose first line is cut,
        which would name no backend, store or run). After a write that failed half-way the next
        line starts on a line of its own, so that only the cut line is lost."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = (json.dumps(_encode(batch)) + "\n").encode()
        try:
            empty = self.path.stat().st_size == 0
        except FileNotFoundError:
            empty = True
        if empty:  # an empty file: a first write of an earlier version that failed
            self._write([json.dumps(self.header).encode()], keep_empty=True)
        with _private(self.path, os.O_APPEND) as f:
            size = f.seek(0, os.SEEK_END)
            if size and not _ends_a_line(self.path, size):
                text = b"\n" + text
            f.write(text)

    def first(self) -> tuple[str, Batch] | None:
        """The header line and the first batch, read without the rest (a retry while the backend is
        down costs one line, however long the outage); None without a batch or when that line
        does not decode (:meth:`batches` deals with it)."""
        with open(self.path, "rb") as f:
            head = f.readline().rstrip(b"\n").decode("utf-8", "replace")
            for line in f:
                if line.strip():
                    try:
                        return head, _decode_line(line)
                    except Exception:  # noqa: BLE001 - torn, damaged or another version's: see batches()
                        return None
        return None

    def batches(self) -> list[Batch]:
        """The batches, in order. A line that is no batch (cut short: its writer was killed, or its
        disk filled, while appending; damaged bytes; a JSON value that is not a batch) is moved to
        ``torn-<name>`` beside the spill, with a warning, so that it holds back none of the batches
        around it. A batch of a newer hdet-track (an event schema this one does not know) raises:
        the spill stays for that version."""
        lines = _lines(self.path)
        if not lines:  # a first write that failed (a full disk) left the file empty
            return []
        head, *rest = lines
        good, torn, out = [], [], []
        for line in (x for x in rest if x.strip()):
            try:
                out.append(_decode_line(line))
            except UnknownSchemaError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError):  # UnicodeDecodeError is a ValueError
                torn.append(line)
                continue
            good.append(line)
        if torn:
            aside = self.path.with_name("torn-" + self.path.name.split(".jsonl")[0] + ".jsonl")
            with _private(aside, os.O_APPEND) as f:
                f.write(b"".join(line + b"\n" for line in torn))
            self._write([head, *good], keep_empty=True)
            logger.warning(
                "hdet-track: %d batch(es) of %s were cut short (their writer was killed, or its disk filled, "
                "while writing them) or are no batch (damaged); moved to %s, the %d others go on",
                len(torn),
                self.path.name,
                aside,
                len(out),
            )
        return out

    def keep_from(self, index: int, keep_empty: bool = False) -> None:
        """Drop the first ``index`` batches (they reached the backend); the header becomes
        :attr:`header` when it is set (a run created since the file began). With none left the
        file is removed, unless ``keep_empty`` (it still names the run, whose end is owed)."""
        lines = _lines(self.path)
        head = json.dumps(self.header).encode() if self.header else lines[0]
        self._write([head] + [x for x in lines[1:] if x.strip()][index:], keep_empty=keep_empty)

    def _write(self, lines: list[bytes], keep_empty: bool = False) -> None:
        """The file as ``lines``, at once (written apart and renamed into place)."""
        if len(lines) == 1 and not keep_empty:
            self.path.unlink()
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with _private(tmp, os.O_TRUNC) as f:
                f.write(b"".join(x + b"\n" for x in lines))
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.path)


def _private(path: Path, mode: int):
    """``path`` opened for binary writing (``mode``: os.O_APPEND or os.O_TRUNC), created as this
    user's alone (0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
    os.fchmod(fd, 0o600)  # also a file that was there (an earlier version's spill, a leftover .tmp)
    return os.fdopen(fd, "ab" if mode == os.O_APPEND else "wb")


def _ends_a_line(path: Path, size: int) -> bool:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"


def _lines(path: Path) -> list[bytes]:
    """The lines of a spill file, as bytes: each is decoded on its own (a damaged one is torn, not
    the file unreadable)."""
    lines = path.read_bytes().split(b"\n")
    return lines[:-1] if lines and lines[-1] == b"" else lines


def _decode_line(line: bytes) -> Batch:
    return _decode(json.loads(line.decode("utf-8")))


def read_header(path: Path) -> dict[str, Any] | None:
    """The header of the spill file ``path`` (backend, settings, run); None when its first line is
    none (cut short, damaged).

    Raises:
        OSError: the file cannot be read (gone: another process took it).
    """
    with open(path, "rb") as f:
        line = f.readline()
    try:
        head = json.loads(line.decode("utf-8"))
    except ValueError:
        return None
    return head if isinstance(head, dict) and isinstance(head.get("backend"), str) else None


def log_or_set_aside(tracker: Tracker, batch: Batch, set_aside: Callable[[Batch, BaseException], None]) -> None:
    """``tracker.log(batch)``. When the backend refuses the batch for its content
    (``tracker.refuses``), its parts that stand alone go one by one: the user's metrics one name at
    a time, then HDET's own series, rows and events (last: once in, its rows are in the event
    archive, and nothing after them can fail and send them again); a part refused again goes to
    ``set_aside`` with the backend's error, so one bad value costs its own part, not the run's data
    after it.
    Any other failure raises: the backend is down, the caller keeps the whole batch, and nothing
    was set aside (its parts are tried again with it)."""
    try:
        tracker.log(batch)
        return
    except Exception as exc:
        if not tracker.refuses(exc):
            raise
    users: dict[str, list[Point]] = {}
    for p in batch.points:
        if not names.is_hdet_series(p.key):
            users.setdefault(p.key, []).append(p)
    own = Batch(
        points=[p for p in batch.points if names.is_hdet_series(p.key)],
        events=batch.events,
        steps=batch.steps,
        records=batch.records,
    )
    refused: list[tuple[Batch, BaseException]] = []
    for part in [*(Batch(points=points) for points in users.values()), own]:
        if not part:
            continue
        try:
            tracker.log(part)
        except Exception as exc:
            if not tracker.refuses(exc):
                raise
            refused.append((part, exc))
    for part, exc in refused:
        set_aside(part, exc)


def describe_part(part: Batch) -> str:
    """What a set-aside part holds, for a warning (``part`` materialized)."""
    steps = [p.step for p in part.points] + [int(b.step.max()) for b in part.steps if len(b)]
    span = f" at steps {min(steps)}-{max(steps)}" if steps and min(steps) != max(steps) else ""
    span = span or (f" at step {steps[0]}" if steps else "")
    keys = sorted({p.key for p in part.points})
    if keys and all(not names.is_hdet_series(k) for k in keys):
        return f"the metric {', '.join(repr(k) for k in keys)}{span} ({len(part.points)} points)"
    return f"HDET's own series, step rows and events{span}"


def _encode(batch: Batch) -> dict[str, Any]:
    return {
        "events": [e.to_dict() for e in batch.events],
        "points": [list(p) for p in batch.points],
        "steps": [b.to_json() for b in batch.steps],
    }


def _decode(data: dict[str, Any]) -> Batch:
    return Batch(
        points=[Point(str(k), float(v), int(s), int(t)) for k, v, s, t in data["points"]],
        events=[event_from_dict(e) for e in data["events"]],
        steps=[StepBlock.from_json(b) for b in data.get("steps", [])],
    )


def header(tracker: Tracker, run_start: RunStart | None) -> dict[str, Any]:
    return {
        "backend": tracker.name,
        "settings": tracker.spill_settings() if hasattr(tracker, "spill_settings") else {},
        # the run it was logging, or would have (resumed or given) had the backend answered
        "run_id": tracker.run_id or getattr(tracker, "pending_run_id", None),
        "run_start": run_start.to_dict() if run_start is not None else None,
        "pid": os.getpid(),
        "owner": process_identity(),  # host, pid and start time: a reused pid is not its writer
    }


# A writer this host cannot check (another host or container) is taken for gone once its spill (or
# pending chunks) have not changed for this long: a live writer appends at every failed batch
# (every few seconds) and writes chunks every 15 s. The readers' silence rule, 10 beats of 30 s.
STALE_SECONDS = 300.0
# How often a live writer touches its spill (while its backend is down) and its pending chunks,
# whether or not it logs: a job that logs nothing for minutes (a long evaluation, heartbeats off)
# is still no gone writer's.
KEEP_ALIVE_SECONDS = STALE_SECONDS / 5


def _newest_mtime(path: Path) -> float:
    try:
        files = [path, *path.rglob("*")] if path.is_dir() else [path]
        return max(f.stat().st_mtime for f in files)
    except OSError:
        return 0.0


def _writer_alive(head: dict[str, Any], path: Path | None = None) -> bool:
    """Whether the process that wrote a spill may still be writing it (when this host cannot tell,
    e.g. a spill written on another host of a shared filesystem: yes)."""
    owner = head.get("owner")
    if isinstance(owner, dict):
        alive = owner_alive(owner)
        if alive is None:  # another host or container: gone once its files have been still for long
            return path is None or time.time() - _newest_mtime(path) < STALE_SECONDS
        return alive
    pid = int(head.get("pid", -1))  # a spill of an older version: the pid alone
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


# A replay's claim: ``<spill>.replaying-<pid>-<place>-<start>``, ``place`` a hash of the replayer's
# host and pid namespace, ``start`` its process start time (0 where /proc does not tell); an older
# version's claim is ``<spill>.replaying-<pid>``.
_REPLAYING = re.compile(r"^(spill-.*\.jsonl)\.replaying-(\d+)(?:-([0-9a-f]{12})-(\d+))?$")
# An upload's claim on a folder of pending chunks, the same way: ``<folder>.replaying-<pid>-<place>-<start>``.
_UPLOADING = re.compile(r"^(pending-.+?)\.replaying-(\d+)-([0-9a-f]{12})-(\d+)$")


class Attention(str):
    """A line of :func:`recover` (or of a job delivering what earlier ones left) about a spill that
    cannot be delivered as it is, however often it is tried: it needs a person (the CLI exits 2)."""


def _place(identity: dict[str, Any]) -> str:
    return hashlib.sha256(f"{identity['host']}|{identity['pidns']}".encode()).hexdigest()[:12]


def _claim(path: Path) -> Path | None:
    """``path`` renamed to this process's claim on it (one replayer per file); None when another
    process took it first."""
    claimed = path.with_name(path.name + _claim_suffix())
    try:
        os.rename(path, claimed)
    except OSError:
        return None
    _touch(claimed)  # a rename keeps the file's time: a claim must not look still to another host at once
    return claimed


def _claim_suffix() -> str:
    me = process_identity()
    return f".replaying-{me['pid']}-{_place(me)}-{me['start'] or 0}"


def _replayer_alive(match: re.Match[str], claim: Path) -> bool:
    """Whether the replay that claimed a spill (``claim``, matched by :data:`_REPLAYING`) may still
    be running. One on another host or in another container is taken for gone once its claim has
    been still for :data:`STALE_SECONDS` (a running replay touches it at every batch)."""
    pid = int(match[2])
    if match[3] is None:
        return _writer_alive({"pid": pid})
    me = process_identity()
    if match[3] != _place(me):
        return time.time() - _newest_mtime(claim) < STALE_SECONDS
    owner = {"host": me["host"], "pid": pid, "start": None if match[4] == "0" else match[4], "pidns": me["pidns"]}
    return owner_alive(owner) is not False


def orphans(directory: Path, held: list[Path] | None = None, unreadable: list[Path] | None = None) -> Iterator[Path]:
    """Spill files in ``directory`` whose writer process is gone (``held``, when given, collects
    those a live process still holds). A replay whose process died (``*.replaying-*``) is
    given back its name first. A spill whose first line (its header) cannot be read names no
    backend, store, run or writer: it is collected in ``unreadable`` or, without that list,
    logged as a warning (:func:`unreadable_line`); never passed over in silence."""
    if not directory.is_dir():
        return
    _give_back_claims(directory, "spill-*.jsonl.replaying-*", _REPLAYING)
    found = []
    for path in directory.glob("spill-*.jsonl"):
        try:
            head = read_header(path)
        except OSError:  # taken by another process meanwhile
            continue
        if head is None:
            if unreadable is not None:
                unreadable.append(path)
            else:
                logger.warning("hdet-track: %s", unreadable_line(path))
            continue
        found.append((_started(head, path), path.name, path, head))
    for _, _, path, head in sorted(found):  # an earlier attempt's first
        if not _writer_alive(head, path):
            yield path
        elif held is not None:
            held.append(path)


def _give_back_claims(directory: Path, pattern: str, claim: re.Pattern[str]) -> None:
    """Claims (spills being replayed, pending folders being uploaded) whose process is gone get
    their names back, so that they are taken again."""
    for path in sorted(directory.glob(pattern)):
        match = claim.match(path.name)
        if match and not _replayer_alive(match, path) and not (directory / match[1]).exists():
            try:
                os.rename(path, directory / match[1])
            except OSError:
                continue


def unreadable_line(path: Path) -> Attention:
    """What :func:`recover` says of a spill whose header cannot be read."""
    try:
        lines = [x for x in _lines(path)[1:] if x.strip()]
    except OSError:
        lines = []
    return Attention(
        f"{path.name}: its first line, the header naming the backend, store and run its {len(lines)} "
        "batch line(s) belong to, cannot be read (cut short or damaged); not delivered: nothing here says "
        f"where they go. They stay in {path}: put back a first line naming them (another spill's first line "
        "shows the form), and recover delivers it; or move the file away"
    )


def _started(head: dict[str, Any], path: Path) -> float:
    """When the job of a spill started (its run start's time; the file's last change for a spill
    without one): spills are replayed in that order, not by name (a pid of 10000 sorts before 9999)
    nor by their files' times (a replay cut short touches its claim)."""
    when = (head.get("run_start") or {}).get("time")
    if isinstance(when, (int, float)):
        return float(when)
    try:
        return path.stat().st_mtime
    except OSError:
        return math.inf


def pending_orphans(directory: Path) -> Iterator[Path]:
    """Folders of archive chunks a gone process could not upload (``pending-*`` with a header;
    see :meth:`hdet_track.tracking.mlflow.MLflowTracker._pending_chunks`). An upload whose process
    died (``pending-*.replaying-*``) gives the folder its name back first."""
    if not directory.is_dir():
        return
    _give_back_claims(directory, f"{PENDING_PREFIX}*.replaying-*", _UPLOADING)
    for folder in sorted(directory.glob(f"{PENDING_PREFIX}*")):
        if _UPLOADING.match(folder.name):  # another process uploads it
            continue
        try:
            head = json.loads((folder / PENDING_HEADER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(head, dict) and not _writer_alive(head, folder):
            yield folder


def upload_pending_folder(folder: Path) -> str:
    """Upload one folder of :func:`pending_orphans` to its run; a line saying what happened. The
    folder is claimed first (renamed, as :func:`replay_file` claims a spill): of two processes at
    once, one uploads it."""
    claimed = _claim(folder)
    if claimed is None:
        return f"{folder.name}: taken by another process"
    head: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    try:
        head = json.loads((claimed / PENDING_HEADER).read_text())
        settings = _anchored(head["backend"], head.get("settings", {}), folder.parent)
        from .base import get_tracker_class

        upload = getattr(get_tracker_class(head["backend"]), "upload_pending", None)
        if upload is None:
            raise ValueError(f"no upload of pending chunks for backend {head['backend']!r}")
        line = upload(claimed, settings)
    except Exception as exc:  # noqa: BLE001 - the backend is still down: keep the folder
        if _run_gone(head, settings, exc):
            aside = _aside_path(folder)
            os.rename(claimed, aside)
            return Attention(
                mask_secrets(
                    f"{folder.name}: not uploaded: its run {head['run_id']} no longer exists in "
                    f"{_store_of(settings)} (deleted for good, e.g. by `mlflow gc`); its archive files stay in {aside}"
                )
            )
        if claimed.exists():
            os.rename(claimed, folder)
        return mask_secrets(f"{folder.name}: not uploaded ({type(exc).__name__}: {exc}); kept")
    return mask_secrets(line.replace(claimed.name, folder.name))


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def replay_file(path: Path) -> str:
    """Deliver one orphaned spill file to its run (creating the run if it never was); returns a line
    saying what happened (a URI's password shown as ``***``). The file is removed once delivered,
    kept if the backend is still down; a spill whose run no longer exists (deleted for good) is
    moved aside (``undeliverable-*.jsonl``), and one whose header cannot be read is left as it is,
    each with an :class:`Attention` line."""
    line = _replay_file(path)
    return type(line)(mask_secrets(line))


def _replay_file(path: Path) -> str:
    from .base import get_tracker_class
    from .isolated import maybe_isolated

    try:
        mtime = path.stat().st_mtime  # the writer's last write or keep-alive (a claim touches it)
    except OSError:
        mtime = None
    claimed = _claim(path)
    if claimed is None:
        return f"{path.name}: taken by another process"
    head = read_header(claimed)
    if head is None:
        os.rename(claimed, path)
        return unreadable_line(path)
    spill = SpillFile(claimed, head)
    sink: Tracker | None = None
    settings: dict[str, Any] = {}
    delivered, batches, settled = 0, [], []  # settled[i]: how many parts were refused up to batch i
    refused: list[tuple[Batch, BaseException]] = []
    try:
        settings = _anchored(head["backend"], head.get("settings", {}), path.parent)
        tracker = get_tracker_class(head["backend"])(**settings)
        tracker.replaying()
        if head.get("run_id"):
            tracker.resume(head["run_id"])
        sink = maybe_isolated(tracker)
        batches = spill.batches()
        start = next((e for b in batches for e in b.events if isinstance(e, RunStart)), None)
        if start is None and head.get("run_start"):
            start = event_from_dict(head["run_start"])
        if start is None:
            raise ValueError("the spill has no run start: nothing to attach its data to")
        sink.start(start)
        if sink.run_id and sink.run_id != head.get("run_id"):  # a kill from here on: a rerun goes on in this run
            spill.header = dict(head, run_id=sink.run_id)
            spill.keep_from(0, keep_empty=True)
        ended = False
        for batch in batches:
            events = [e for e in batch.events if not isinstance(e, (RunStart, RunEnd))]
            log_or_set_aside(sink, Batch(points=batch.points, events=events, steps=batch.steps), _keep(refused))
            for end in (e for e in batch.events if isinstance(e, RunEnd)):
                sink.finish(end)
                ended = True
            delivered += 1
            settled.append(len(refused))
            _touch(claimed)  # still replaying (read from another host)
        if not ended:
            last = max((p.step for b in batches for p in b.points), default=0)
            # its process went without a word (SIGKILL, the OOM killer): KILLED, as the readers
            # call such a run and as a writer process does that outlives it; ended when the job
            # last logged (else when it last wrote its spill), not when this replay runs
            text = "recovered from a spill: the job ended without ending its run"
            sink.finish(RunEnd(status="KILLED", step=last, error=text, time=_last_time(batches) or mtime or 0.0))
    except Exception as exc:  # noqa: BLE001 - the backend is still down: keep the spill
        dropped = _keep_undelivered(spill, sink, min(delivered, max(len(batches) - 1, 0)))
        if not dropped and _run_gone(head, settings, exc):
            aside = _aside_path(path)
            os.rename(claimed, aside)
            return Attention(
                f"{path.name}: not delivered: its run {head['run_id']} no longer exists in {_store_of(settings)} "
                f"(deleted for good, e.g. by `mlflow gc`), so nothing can take its batches; they stay in {aside} "
                "(JSON lines, its first line the header), which nothing replays"
            )
        os.rename(claimed, path)
        if dropped and settled[dropped - 1]:  # what the backend refused of the batches that left the spill
            _set_aside(path, head, refused[: settled[dropped - 1]])
        return f"{path.name}: not delivered ({type(exc).__name__}: {exc}); kept"
    claimed.unlink(missing_ok=True)
    where = _store_of(settings)
    line = f"{path.name}: {len(batches)} batches delivered to {head['backend']} run {sink.run_id}" + (
        f" in {where}" if where else ""
    )
    if refused:
        parts = "; ".join(f"{describe_part(part)}: {exc}" for part, exc in refused[:3])
        where = _set_aside(path, head, refused)
        line += f"; the backend refused {len(refused)} part(s) for their content ({parts}), set aside in {where}"
    return line


def _last_time(batches: list[Batch]) -> float | None:
    """When the job last logged, in seconds: the latest time of a point or an event of ``batches``
    (None when none has one)."""
    times = [p.timestamp_ms / 1000 for b in batches for p in b.points]
    times += [float(getattr(e, "time", 0) or 0) for b in batches for e in b.events]
    return max((t for t in times if t > 0), default=None)


def _store_of(settings: dict[str, Any]) -> str:
    return str(settings.get("tracking_uri") or settings.get("dir") or "")


def _aside_path(path: Path) -> Path:
    """Where a spill (or pending folder) that cannot be delivered is moved: ``undeliverable-<name>``,
    which nothing replays."""
    return path.with_name("undeliverable-" + path.name.removeprefix("spill-"))


def _run_gone(head: dict[str, Any], settings: dict[str, Any], exc: BaseException) -> bool:
    """Whether the run ``head`` names is known not to exist in its store (deleted for good: ``mlflow
    gc``), asked of the backend after a delivery failed with ``exc``, an error that names the run
    (a backend that is down is not asked again); False when it cannot tell, for a run that exists (a
    deleted one in the trash waits to be restored) and for a spill naming none."""
    if not head.get("run_id") or not settings or str(head["run_id"]) not in str(exc):
        return False
    try:
        from .base import get_tracker_class

        missing = getattr(get_tracker_class(head["backend"]), "run_missing", None)
        return bool(missing is not None and missing(settings, head["run_id"]))
    except Exception:  # noqa: BLE001 - cannot tell: keep it
        return False


def _set_aside(spill: Path, head: dict[str, Any], refused: list[tuple[Batch, BaseException]]) -> Path:
    """The parts of ``spill``'s batches that the backend refused, in its refused file."""
    aside = SpillFile(refused_path(spill), head)
    for part, _ in refused:
        aside.append(part)
    return aside.path


def attempt_starts(paths: list[Path], run_id: str, job: str) -> dict[Path, int]:
    """The step each spill of ``paths`` that belongs to this run (or, run-less, to this job) began
    at: of several killed attempts, each one's steps count up to where the next one resumed."""
    out = {}
    for path in paths:
        try:
            head = read_header(path)
        except OSError:
            continue
        if head is None:
            continue
        start = head.get("run_start") or {}
        if head.get("run_id") == run_id or (not head.get("run_id") and job and start.get("job") == job):
            out[path] = int(start.get("start_step") or 0)
    return out


def take_over(path: Path, run_id: str, upto: int, send: Callable[[Batch], None], job: str = "") -> str | None:
    """An orphaned spill of run ``run_id``, which this process has just resumed from a checkpoint at
    step ``upto`` (its earlier attempt, killed while the backend was down): its data up to that step
    sent through ``send`` (this process's own tracker of the run), neither its start nor its end
    (the run goes on) nor the steps after the checkpoint (the job does them again). An attempt that
    never reached the backend has no run: its spill is known by the job's id ``job``. None, and the
    file left alone, when the spill is another run's: :func:`replay_file` delivers that."""
    try:
        head = read_header(path)
    except OSError:
        return None
    if head is None:
        return None
    runless = not head.get("run_id") and bool(job) and (head.get("run_start") or {}).get("job") == job
    if head.get("run_id") != run_id and not runless:
        return None
    claimed = _claim(path)
    if claimed is None:
        return f"{path.name}: taken by another process"
    try:
        batches = SpillFile(claimed, head).batches()
        for batch in batches:
            part = batch.until(upto)
            if part:
                send(part)
            _touch(claimed)  # still taking it in (read from another host)
    except BaseException:
        os.rename(claimed, path)  # the backend went down again: the next start (or recover) delivers it
        raise
    claimed.unlink()
    return f"{path.name}: {len(batches)} batches of an earlier attempt of run {run_id} taken into it up to step {upto}"


def _keep_undelivered(spill: SpillFile, sink: Tracker | None, delivered: int) -> int:
    """A replay that stopped half-way: the spill keeps only what did not go through, under the run
    it went to (a rerun continues that run), and that run is left as it is (not ended KILLED by a
    writer process that takes the replay's exit for its training process's). Returns how many
    batches left the spill."""
    if sink is None:
        return 0
    run_id = sink.run_id
    if delivered:
        # their step rows and events wait in the tracker's archive buffer: written out now, to the
        # run or, with the backend down, to the spill directory's pending chunks (uploaded later)
        try:
            sink.flush()
        except Exception:  # noqa: BLE001 - the writer is gone with them: keep every batch
            delivered = 0
    if delivered or (run_id and not spill.header.get("run_id")):
        spill.header = dict(spill.header, run_id=run_id or spill.header.get("run_id"))
        spill.keep_from(delivered, keep_empty=True)
    detach = getattr(sink, "detach", None)
    if detach is not None:
        detach()
    return delivered


def refused_path(spill: Path) -> Path:
    """Where the parts of ``spill``'s batches that the backend refused are set aside (not a spill:
    nothing replays them)."""
    return spill.with_name("refused-" + spill.name.removeprefix("spill-"))


def _keep(found: list[tuple[Batch, BaseException]]) -> Callable[[Batch, BaseException], None]:
    return lambda part, exc: found.append((part, exc))


def spill_dirs(source: str) -> list[Path]:
    """Where ``recover`` looks for the spills of ``source``: the spill directory itself, or the store's
    (for a W&B directory also ``wandb/.hdet-spill``, where :class:`WandbTracker` keeps them)."""
    if Path(source).name == DIRNAME:
        return [Path(source)]
    found = [store_spill_dir(source)]
    if uri_scheme(source) in ("http", "https"):  # where hdet-track 0.x put them for this spelling of the URI
        url = urlparse(source)
        scheme = source.split("://", 1)[0]
        where = (
            f"{url.hostname}_{url.port or ''}{url.path}"
            if scheme in ("http", "https")
            else f"{scheme.lower()}_{url.hostname or ''}_{url.port or ''}{url.path}"
        )
        found += [d for d in [cache_dir() / re.sub(r"[^A-Za-z0-9_.-]", "_", where)] if d != found[0]]
    if source.startswith("file:") or (uri_scheme(source) is None and _mlflow_file_store(Path(source))):
        store = Path(urlparse(source).path if source.startswith("file:") else source)
        found += [d for d in [store.resolve().parent / DIRNAME, store / DIRNAME] if d not in found]  # and 0.x's
    if uri_scheme(source) is None:
        found.append(Path(source) / "wandb" / DIRNAME)
    return found


def _mlflow_file_store(path: Path) -> bool:
    """Whether ``path`` is an MLflow file store (its default experiment's folder is there)."""
    return (path / "0" / "meta.yaml").is_file()


def recover(source: str) -> list[str]:
    """Deliver every orphaned spill of the store ``source`` (an MLflow URI, a W&B directory, or a
    spill directory itself). Each line says what happened to one file (a URI's password shown as
    ``***``); an :class:`Attention` line names one that cannot be delivered as it is."""
    lines: list[str] = []
    held: list[Path] = []
    unreadable: list[Path] = []
    for directory in spill_dirs(source):
        lines += [upload_pending_folder(folder) for folder in pending_orphans(directory)]  # first: their numbering
        lines += [replay_file(path) for path in orphans(directory, held, unreadable)]
    lines += [unreadable_line(path) for path in unreadable]
    for path in held:
        try:
            owner = (read_header(path) or {}).get("owner") or {}
        except OSError:
            owner = {}
        who = f"process {owner.get('pid')} on {owner.get('host')}" if owner else "a live process"
        lines.append(f"{path.name}: held by {who}, which may still be writing it; not touched")
    return [type(line)(mask_secrets(line)) for line in lines]


def _anchored(backend: str, settings: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``settings`` with a relative store (``sqlite:///mlflow.db``, W&B's ``dir``), which meant the
    job's working directory, resolved where the spill lies: in that store (``recover`` may run
    anywhere)."""
    out = dict(settings)
    uri = out.get("tracking_uri")
    directory = directory.resolve()  # `recover .hdet-spill` names no parent
    if backend == "mlflow" and isinstance(uri, str) and uri.startswith("sqlite:///") and uri[10:11] != "/":
        out["tracking_uri"] = f"sqlite:///{directory.parent / Path(uri[len('sqlite:///') :]).name}"
    elif backend == "mlflow" and isinstance(uri, str) and (uri.startswith("file:") or uri_scheme(uri) is None):
        # a file store (``mlruns``, ``file:./mlruns``) keeps its spills beside it (0.x: in <store>/.hdet-spill)
        file = uri.startswith("file:")
        store = Path(urlparse(uri).path if file else uri)
        if not store.is_absolute():
            inside = directory.parent.name == store.name and not (directory.parent / store.name).is_dir()
            where = directory.parent if inside else directory.parent / store.name
            out["tracking_uri"] = f"file://{where}" if file else str(where)
    if backend == "wandb" and directory.parent.name == "wandb" and not Path(out.get("dir") or ".").is_absolute():
        out["dir"] = str(directory.parent.parent)  # the tracker keeps its spills in <dir>/wandb/
    return out

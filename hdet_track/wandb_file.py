"""Read W&B's ``.wandb`` run files (offline or synced) without wandb's removed reader.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, a 2-byte magic, a 1-byte version),
then 32 KiB blocks of records, each with a 7-byte header (crc32, 2-byte length, 1-byte type:
FULL, FIRST, MIDDLE, LAST). A record's payload is a protobuf ``Record``
(``wandb.proto.wandb_internal_pb2``). Nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "iter_records",
    "read_wandb_file",
    "RunFileProgress",
    "WandbFileCache",
    "WandbFileContents",
    "WandbFormatError",
]

logger = logging.getLogger(__name__)

_HEADER_LEN = 7
_BLOCK = 32 * 1024
_REC_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_HEAD = 4096  # bytes compared to tell a file grown from one rewritten in place


class WandbFormatError(ValueError):
    """The file is not a ``.wandb`` run file."""


def _masked_crc_ok(crc: int, rtype: int, payload: bytes) -> bool:
    # LevelDB's crc covers the type byte and the payload (crc32 here, no masking).
    return zlib.crc32(bytes([rtype]) + payload) & 0xFFFFFFFF == crc


def iter_payloads(data: bytes) -> Iterator[bytes]:
    """Yield each complete record payload; stop quietly at a truncated tail (a file being written)."""
    _check_header(data)
    scan = _Scan()
    yield from scan.payloads(data, 0)


def _check_header(data: bytes) -> None:
    if len(data) < _HEADER_LEN and b":W&B".startswith(data[:4]):
        return  # created but not yet written
    if data[:4] != b":W&B":
        raise WandbFormatError("Expected a .wandb file starting with ':W&B', but got something else")


class _Scan:
    """Where a scan of the records stopped: ``pos``, the first byte not consumed (a record's header
    or a block's padding; a file being written is cut anywhere after it), and the fragments of a
    record split over blocks that came before it. A later scan of the bytes from ``pos`` on goes on
    from there."""

    def __init__(self) -> None:
        self.pos = _HEADER_LEN
        self.pending: list[bytes] | None = None  # None: not inside a record split over blocks

    def payloads(self, data: bytes, base: int) -> Iterator[bytes]:
        """The complete payloads in ``data`` (the file's bytes from offset ``base`` <= ``pos``)."""
        pos, end_of_data = self.pos, base + len(data)
        while pos + _REC_HEADER <= end_of_data:
            left_in_block = _BLOCK - (pos % _BLOCK)
            if left_in_block < _REC_HEADER:
                pos += left_in_block
                continue
            crc, length, rtype = struct.unpack_from("<IHB", data, pos - base)
            start = pos + _REC_HEADER
            end = start + length
            block_end = pos + left_in_block
            if end > block_end:  # no record crosses a block: a damaged header (LevelDB drops the block's rest)
                logger.warning(
                    "hdet-track: skipping the rest of a .wandb block after a damaged record header at byte %d", pos
                )
                pos = self.pos = block_end
                self.pending = None
                continue
            if end > end_of_data:
                break  # truncated: still being written
            payload = data[start - base : end - base]
            if rtype == 0 and length == 0:  # zero padding at the end of a block
                if end % _BLOCK and end + _BLOCK - end % _BLOCK > end_of_data:
                    break  # the rest of the block is not there yet: not consumed, read again later
                pos = self.pos = end + (_BLOCK - (end % _BLOCK) if end % _BLOCK else 0)
                continue
            if not _masked_crc_ok(crc, rtype, payload):
                if end == end_of_data:
                    break  # the last bytes there are: maybe still being written, read again later
                logger.warning("hdet-track: skipping a .wandb record with a bad checksum at byte %d", start)
                pos = self.pos = end
                self.pending = None
                continue
            pos = self.pos = end
            if rtype == _FULL:
                self.pending = None  # a record begun before it and never ended is not one
                yield payload
            elif rtype == _FIRST:
                self.pending = [payload]
            elif self.pending is None:  # the rest of a record whose start was skipped: not a record
                continue
            elif rtype == _MIDDLE:
                self.pending.append(payload)
            elif rtype == _LAST:
                whole = b"".join([*self.pending, payload])
                self.pending = None
                yield whole


def iter_records(path: str | Path) -> Iterator[Any]:
    """Yield ``wandb_internal_pb2.Record`` messages from a ``.wandb`` file."""
    yield from _records(iter_payloads(Path(path).read_bytes()))


def _records(payloads: Iterator[bytes]) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    for payload in payloads:
        rec = pb.Record()
        try:
            rec.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - a damaged record is skipped, not fatal
            logger.warning("hdet-track: skipping an unparsable .wandb record")
            continue
        yield rec


def _item_key(item: Any) -> str:
    return item.key if item.key else "/".join(item.nested_key)


@dataclass
class WandbFileContents:
    """What a ``.wandb`` file says about its run."""

    run_id: str = ""
    project: str = ""
    group: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    step_metrics: dict[str, str] = field(default_factory=dict)  # define_metric: glob/name -> step metric
    exit_code: int | None = None


def read_wandb_file(path: str | Path) -> WandbFileContents:
    """Parse a ``.wandb`` file into its run, config, history rows, summary and exit code."""
    out = WandbFileContents()
    for rec in iter_records(path):
        _apply(out, rec)
    return out


def _apply(out: WandbFileContents, rec: Any) -> None:
    kind = rec.WhichOneof("record_type")
    if kind == "run":
        out.run_id, out.project, out.group = rec.run.run_id, rec.run.project, rec.run.run_group
        out.name = rec.run.display_name
        for item in rec.run.config.update:
            out.config[_item_key(item)] = _loads(item.value_json)
    elif kind == "config":
        for item in rec.config.update:
            out.config[_item_key(item)] = _loads(item.value_json)
    elif kind == "history":
        row = {_item_key(item): _loads(item.value_json) for item in rec.history.item}
        if rec.history.HasField("step"):
            row.setdefault("_step", rec.history.step.num)
        out.history.append(row)
    elif kind == "summary":
        for item in rec.summary.update:
            out.summary[_item_key(item)] = _loads(item.value_json)
        for item in rec.summary.remove:  # del run.summary[key]
            out.summary.pop(_item_key(item), None)
    elif kind == "metric":
        m = rec.metric
        name = m.name or m.glob_name
        if m.step_metric:
            out.step_metrics[name] = m.step_metric
    elif kind == "exit":
        out.exit_code = rec.exit.exit_code


def _read_on(path: Path, identity: tuple | None, scan: _Scan | None) -> tuple[tuple, _Scan, bytes, bool]:
    """The bytes of ``path`` a scan has not consumed: (the file's identity, the scan to go on with,
    its new bytes, whether it starts afresh). A file that is not the one scanned (another inode, its
    first 4 KiB changed: written over in place) or shrank is scanned again from its start."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        head = f.read(_HEAD)  # the run's first records: another run's file written over this one differs
        now = (st.st_dev, st.st_ino, head)
        fresh = scan is None or now != identity or scan.pos > st.st_size
        if fresh:
            _check_header(head)
            scan = _Scan()
        f.seek(scan.pos)
        return now, scan, f.read(), fresh


class WandbFileCache:
    """:func:`read_wandb_file` for files read again and again (a dashboard polling a directory of
    runs, some live): a file is parsed once and, while W&B appends to it, only its new bytes are.
    A file that shrank, was replaced (another inode) or was written over in place (its first 4 KiB
    changed) is parsed again from the start. Holds parses of at most ``max_cells`` history values
    in all (about 120 bytes each: the default, 2 million, is about 250 MB), the least recently read
    dropped first.

    Returns a snapshot each time: its lists and dicts are the caller's (the rows themselves are
    shared; do not change them)."""

    def __init__(self, max_cells: int = 2_000_000) -> None:
        self.max_cells = max_cells
        self._parses: OrderedDict[str, tuple[tuple[int, int, bytes], _Scan, WandbFileContents]] = OrderedDict()
        self._cells: dict[str, int] = {}  # per file: the history values its parse holds
        self._lock = threading.Lock()
        self.bytes_parsed = 0  # for tests and benches: how much work the reads did

    def read(self, path: str | Path) -> WandbFileContents:
        path = Path(path)
        key = str(path.resolve())
        with self._lock:
            cached = self._parses.pop(key, None)
            identity, scan, data, fresh = _read_on(path, *(cached[:2] if cached else (None, None)))
            cached = (identity, scan, WandbFileContents() if fresh else cached[2])  # type: ignore[index]
            contents = cached[2]
            self.bytes_parsed += len(data)
            rows = len(contents.history)
            for rec in _records(scan.payloads(data, scan.pos)):
                _apply(contents, rec)
            grown = sum(len(row) for row in contents.history[rows:])
            self._cells[key] = (self._cells.get(key, 0) if rows else 0) + grown
            self._parses[key] = cached
            self._evict(keep=key)
            return dataclasses.replace(  # the caller's own lists and dicts; the rows are shared
                contents,
                config=dict(contents.config),
                history=list(contents.history),
                summary=dict(contents.summary),
                step_metrics=dict(contents.step_metrics),
            )

    def _evict(self, keep: str) -> None:
        cells = sum(self._cells.values())
        while cells > self.max_cells and len(self._parses) > 1:
            oldest = next(iter(self._parses))
            if oldest == keep:
                break
            del self._parses[oldest]
            cells -= self._cells.pop(oldest)

    def clear(self) -> None:
        with self._lock:
            self._parses.clear()
            self._cells.clear()


class RunFileProgress:
    """How far W&B has written one run file: its highest history ``_step`` and its exit code, for a
    writer that checks again and again (a tracker's ``flush()``, the end of a run). Each
    :meth:`update` parses only the bytes W&B appended since the last one and keeps no rows, so the
    checks of a whole run parse its file about once instead of once per check. A file that shrank,
    was replaced or was written over in place is read again from its start."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.last_step: int | None = None
        self.exit_code: int | None = None
        self.bytes_parsed = 0  # for tests and benches
        self._identity: tuple[int, int, bytes] | None = None
        self._scan = _Scan()

    def update(self) -> RunFileProgress:
        """Read what W&B appended; raises ``OSError`` (no file) or :class:`WandbFormatError`."""
        self._identity, self._scan, data, fresh = _read_on(self.path, self._identity, self._scan)
        if fresh:
            self.last_step, self.exit_code = None, None
        self.bytes_parsed += len(data)
        for rec in _records(self._scan.payloads(data, self._scan.pos)):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                step = _history_step(rec.history)
                if isinstance(step, int) and (self.last_step is None or step > self.last_step):
                    self.last_step = step
            elif kind == "exit":
                self.exit_code = rec.exit.exit_code
        return self


def _history_step(history: Any) -> Any:
    """A history record's ``_step``: its own item if it has one (as :func:`_apply` reads it), else
    the record's step."""
    for item in history.item:
        if _item_key(item) == "_step":
            return _loads(item.value_json)
    return history.step.num if history.HasField("step") else None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text

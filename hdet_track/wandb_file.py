"""Read W&B's ``.wandb`` run files (offline or synced) without wandb's removed reader.

The file is a LevelDB-style log: a 7-byte header (``:W&B``, a 2-byte magic, a 1-byte version),
then 32 KiB blocks of records, each with a 7-byte header (crc32, 2-byte length, 1-byte type:
FULL, FIRST, MIDDLE, LAST). A record's payload is a protobuf ``Record``
(``wandb.proto.wandb_internal_pb2``). Nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["iter_records", "read_wandb_file", "WandbFileContents", "WandbFormatError"]

logger = logging.getLogger(__name__)

_HEADER_LEN = 7
_BLOCK = 32 * 1024
_REC_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class WandbFormatError(ValueError):
    """The file is not a ``.wandb`` run file."""


def _masked_crc_ok(crc: int, rtype: int, payload: bytes) -> bool:
    # LevelDB's crc covers the type byte and the payload (crc32 here, no masking).
    return zlib.crc32(bytes([rtype]) + payload) & 0xFFFFFFFF == crc


def iter_payloads(data: bytes) -> Iterator[bytes]:
    """Yield each complete record payload; stop quietly at a truncated tail (a file being written)."""
    if len(data) < _HEADER_LEN and b":W&B".startswith(data[:4]):
        return  # created but not yet written
    if data[:4] != b":W&B":
        raise WandbFormatError("Expected a .wandb file starting with ':W&B', but got something else")
    pos = _HEADER_LEN
    pending: list[bytes] = []
    while pos + _REC_HEADER <= len(data):
        left_in_block = _BLOCK - (pos % _BLOCK)
        if left_in_block < _REC_HEADER:
            pos += left_in_block
            continue
        crc, length, rtype = struct.unpack_from("<IHB", data, pos)
        start = pos + _REC_HEADER
        end = start + length
        if end > len(data):
            return  # truncated: still being written
        payload = data[start:end]
        pos = end
        if rtype == 0 and length == 0:  # zero padding at the end of a block
            pos += _BLOCK - (pos % _BLOCK) if pos % _BLOCK else 0
            continue
        if not _masked_crc_ok(crc, rtype, payload):
            logger.warning("hdet-track: skipping a .wandb record with a bad checksum at byte %d", start)
            pending = []
            continue
        if rtype == _FULL:
            yield payload
        elif rtype == _FIRST:
            pending = [payload]
        elif rtype == _MIDDLE:
            pending.append(payload)
        elif rtype == _LAST:
            pending.append(payload)
            yield b"".join(pending)
            pending = []


def iter_records(path: str | Path) -> Iterator[Any]:
    """Yield ``wandb_internal_pb2.Record`` messages from a ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    for payload in iter_payloads(data):
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
        elif kind == "metric":
            m = rec.metric
            name = m.name or m.glob_name
            if m.step_metric:
                out.step_metrics[name] = m.step_metric
        elif kind == "exit":
            out.exit_code = rec.exit.exit_code
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text

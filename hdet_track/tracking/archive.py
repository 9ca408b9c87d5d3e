"""The full-resolution event stream as Parquet chunks (written while the run is live).

Two kinds of chunk, numbered in order:
- ``steps-NNNNNN.parquet``: one row per replica and step; columns ``step``, ``replica``, ``loss``,
  ``v:<series>`` for every explored value (``v:lr``, ``v:lr_pg1``, ``v:weight_decay``...) and
  ``m:<name>`` for every multiplier;
- ``events-NNNNNN.parquet``: every other event; columns ``kind``, ``step``, ``json``
  (the event's ``to_dict()``);
- ``summary/part-NNNNNN.parquet``: exact per-bucket aggregates of steps chunk NNNNNN, and every
  ``rollup_every`` chunks ``summary/rollup-AAAAAA-BBBBBB.parquet``, the aggregates of every chunk this
  archive wrote so far (:mod:`hdet_track.summaries`): a reader opens a huge run from those. They sit in
  a subfolder so that readers before 0.3 skip them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..events import Event, StepRecord
from ..summaries import LEVELS, SUMMARY_DIR, BucketTable, part_name, rollup_name

__all__ = ["EventArchive", "StepBlock", "ARTIFACT_DIR", "artifact_dir", "chunk_index"]

ARTIFACT_DIR = "hdet_events"


@dataclass
class StepBlock:
    """Rows of the steps table, columnar, ordered by (step, replica)."""

    step: np.ndarray  # int64
    replica: np.ndarray  # int32
    loss: np.ndarray  # float64
    values: dict[str, np.ndarray] = field(default_factory=dict)  # series key -> float64
    multipliers: dict[str, np.ndarray] = field(default_factory=dict)  # hyperparameter name -> float64

    def __len__(self) -> int:
        return len(self.step)

    def select(self, mask: np.ndarray) -> StepBlock:
        return StepBlock(
            self.step[mask],
            self.replica[mask],
            self.loss[mask],
            {k: v[mask] for k, v in self.values.items()},
            {k: v[mask] for k, v in self.multipliers.items()},
        )

    @staticmethod
    def from_records(records: list[StepRecord]) -> StepBlock:
        keys = list(records[0].values) if records else []
        mkeys = list(records[0].multipliers) if records else []
        return StepBlock(
            step=np.array([r.step for r in records], dtype=np.int64),
            replica=np.array([r.replica for r in records], dtype=np.int32),
            loss=np.array([r.loss for r in records], dtype=np.float64),
            values={k: np.array([r.values.get(k, np.nan) for r in records], dtype=np.float64) for k in keys},
            multipliers={k: np.array([r.multipliers.get(k, np.nan) for r in records], dtype=np.float64) for k in mkeys},
        )

    def to_json(self) -> dict:
        return {
            "step": self.step.tolist(),
            "replica": self.replica.tolist(),
            "loss": [None if not np.isfinite(x) else float(x) for x in self.loss],
            "values": {k: [None if not np.isfinite(x) else float(x) for x in v] for k, v in self.values.items()},
            "multipliers": {k: v.tolist() for k, v in self.multipliers.items()},
        }

    @staticmethod
    def from_json(data: dict) -> StepBlock:
        def floats(xs: list) -> np.ndarray:
            return np.array([np.nan if x is None else x for x in xs], dtype=np.float64)

        return StepBlock(
            step=np.array(data["step"], dtype=np.int64),
            replica=np.array(data["replica"], dtype=np.int32),
            loss=floats(data["loss"]),
            values={k: floats(v) for k, v in data["values"].items()},
            multipliers={k: floats(v) for k, v in data["multipliers"].items()},
        )


logger = logging.getLogger(__name__)


def chunk_index(path: str) -> int:
    """The number of a chunk (``.../steps-000012.parquet`` -> 12; 0 for another name): a run that
    already holds chunks (a resumed or a shared run) continues the numbering, and overwrites none."""
    stem = path.rsplit("/", 1)[-1].split(".")[0]
    tail = stem.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def artifact_dir(path: str | os.PathLike) -> str:
    """The artifact folder of an archive file (``hdet_events`` or ``hdet_events/summary``)."""
    return f"{ARTIFACT_DIR}/{SUMMARY_DIR}" if Path(path).parent.name == SUMMARY_DIR else ARTIFACT_DIR


def _write_atomic(table, path: Path) -> None:  # noqa: ANN001 - a pyarrow.Table
    """Write a Parquet file under a temporary name, then rename it into place: a reader (the live
    dashboard polls every 2 s) sees the whole file or none, never a half-written one."""
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


class EventArchive:
    """Buffers events and writes them as numbered Parquet chunks under ``directory``, with the
    summaries of each steps chunk under ``directory/summary`` (``levels``: steps per bucket)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        chunk_rows: int = 200_000,
        chunk_seconds: float = 15.0,
        start_index: int = 0,
        levels: tuple[int, ...] = LEVELS,
        rollup_every: int = 16,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.chunk_rows = chunk_rows
        self.chunk_seconds = chunk_seconds
        self._blocks: list[StepBlock] = []
        self._rows = 0
        self._other: list[Event] = []
        self._unreported: list[Path] = []  # chunks a failed write() wrote before it failed
        self._index = start_index
        self._last_write = time.monotonic()
        self.levels = tuple(levels)
        self.rollup_every = rollup_every
        self._rollup: BucketTable | None = None  # everything this archive wrote, up to the last rollup
        self._parts: list[BucketTable] = []  # pieces written since
        self._first_index: int | None = None

    def artifact_dir(self, path: str | os.PathLike) -> str:
        """Where a written file goes in the run's artifacts: ``hdet_events`` or ``hdet_events/summary``."""
        return artifact_dir(path)

    def add(self, events: Iterable[Event]) -> None:
        events = list(events)
        steps = [ev for ev in events if isinstance(ev, StepRecord)]
        if steps:
            self.add_steps(StepBlock.from_records(steps))
        self._other.extend(ev for ev in events if not isinstance(ev, StepRecord))

    def add_steps(self, block: StepBlock) -> None:
        if len(block):
            self._blocks.append(block)
            self._rows += len(block)

    def holds(self) -> bool:
        """Whether rows or events added are only in this object's memory (not written to a chunk)."""
        return bool(self._blocks or self._other or self._unreported)

    def due(self) -> bool:
        pending = self._rows + len(self._other)
        return pending > 0 and (
            self._rows >= self.chunk_rows or time.monotonic() - self._last_write >= self.chunk_seconds
        )

    def write(self) -> list[Path]:
        """Write what is buffered as new chunks; returns their paths (possibly none), also those of
        chunks written by a call that then failed (a full disk): a chunk written is never written again."""
        written, self._unreported = self._unreported, []
        try:
            self._write(written)
        except BaseException:
            self._unreported = written
            raise
        self._last_write = time.monotonic()
        return written

    def written(self) -> list[Path]:
        """The chunks a :meth:`write` that then failed had written (handed over once)."""
        out, self._unreported = self._unreported, []
        return out

    def write_or_keep(self) -> list[Path]:
        """:meth:`write` while a run is live: a write the disk refuses (full for a moment) is warned
        about and kept for the next one, and the batch that filled the buffer counts as delivered
        (failing it would replay it whole: rows twice)."""
        try:
            return self.write()
        except OSError as exc:
            logger.warning(
                "hdet-track: the event archive %s could not be written now (%s); it is kept for the next write",
                self.directory,
                exc,
            )
            return []

    def _write(self, written: list[Path]) -> None:
        import pyarrow as pa

        self.directory.mkdir(parents=True, exist_ok=True)  # (a recover elsewhere may have tidied it away)
        if self._blocks:
            self._index += 1
            blocks = self._blocks
            keys = list(dict.fromkeys(k for b in blocks for k in b.values))
            mkeys = list(dict.fromkeys(k for b in blocks for k in b.multipliers))

            def col(get, key: str) -> np.ndarray:  # noqa: ANN001
                return np.concatenate([get(b).get(key, np.full(len(b), np.nan)) for b in blocks])

            columns = {
                "step": pa.array(np.concatenate([b.step for b in blocks]), type=pa.int64()),
                "replica": pa.array(np.concatenate([b.replica for b in blocks]), type=pa.int32()),
                "loss": pa.array(np.concatenate([b.loss for b in blocks]), type=pa.float64()),
            }
            columns |= {f"v:{k}": pa.array(col(lambda b: b.values, k), type=pa.float64()) for k in keys}
            columns |= {f"m:{k}": pa.array(col(lambda b: b.multipliers, k), type=pa.float64()) for k in mkeys}
            table = pa.table(columns)
            path = self.directory / f"steps-{self._index:06d}.parquet"
            _write_atomic(table, path)
            written.append(path)
            self._blocks, self._rows = [], 0
            written += self._write_summaries(table, path.name)
        if self._other:
            self._index += 1
            evs = self._other
            table = pa.table(
                {
                    "kind": pa.array([e.kind for e in evs], type=pa.string()),
                    "step": pa.array([getattr(e, "step", 0) for e in evs], type=pa.int64()),
                    "json": pa.array([json.dumps(e.to_dict(), allow_nan=False) for e in evs], type=pa.string()),
                }
            )
            path = self.directory / f"events-{self._index:06d}.parquet"
            _write_atomic(table, path)
            written.append(path)
            self._other = []

    def _write_summaries(self, table, name: str) -> list[Path]:  # noqa: ANN001 - the chunk's pyarrow.Table
        step = table.column("step").to_numpy()
        columns = {
            c: table.column(c).to_numpy(zero_copy_only=False)
            for c in table.column_names
            if c == "loss" or c.startswith(("v:", "m:"))
        }
        piece = BucketTable.summarize(
            step, table.column("replica").to_numpy(), columns, self.levels, {name: (int(step.min()), int(step.max()))}
        )
        folder = self.directory / SUMMARY_DIR
        folder.mkdir(exist_ok=True)
        path = folder / part_name(self._index)
        _write_atomic(piece.to_arrow(), path)
        written = [path]
        if self._first_index is None:
            self._first_index = self._index
        self._parts.append(piece)
        if len(self._parts) >= self.rollup_every:
            self._rollup = BucketTable.merge([self._rollup, *self._parts])
            self._parts = []
            path = folder / rollup_name(self._first_index, self._index)
            _write_atomic(self._rollup.to_arrow(), path)
            written.append(path)
        return written

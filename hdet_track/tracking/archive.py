"""The full-resolution event stream as Parquet chunks (written while the run is live).

Two kinds of chunk, numbered in order:
- ``steps-NNNNNN.parquet``: one row per replica and step; columns ``step``, ``replica``, ``loss``,
  ``v:<series>`` for every explored value (``v:lr``, ``v:lr_pg1``, ``v:weight_decay``...) and
  ``m:<name>`` for every multiplier;
- ``events-NNNNNN.parquet``: every other event; columns ``kind``, ``step``, ``json``
  (the event's ``to_dict()``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

from ..events import Event, StepRecord

__all__ = ["EventArchive", "ARTIFACT_DIR"]

ARTIFACT_DIR = "hdet_events"


class EventArchive:
    """Buffers events and writes them as numbered Parquet chunks under ``directory``."""

    def __init__(self, directory: str | os.PathLike, chunk_rows: int = 200_000, chunk_seconds: float = 15.0) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.chunk_rows = chunk_rows
        self.chunk_seconds = chunk_seconds
        self._steps: list[StepRecord] = []
        self._other: list[Event] = []
        self._index = 0
        self._last_write = time.monotonic()

    def add(self, events: Iterable[Event]) -> None:
        for ev in events:
            (self._steps if isinstance(ev, StepRecord) else self._other).append(ev)

    def due(self) -> bool:
        pending = len(self._steps) + len(self._other)
        return pending > 0 and (
            len(self._steps) >= self.chunk_rows or time.monotonic() - self._last_write >= self.chunk_seconds
        )

    def write(self) -> list[Path]:
        """Write what is buffered as new chunks; returns their paths (possibly none)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        written: list[Path] = []
        if self._steps:
            self._index += 1
            recs = self._steps
            columns: dict[str, list] = {
                "step": [r.step for r in recs],
                "replica": [r.replica for r in recs],
                "loss": [r.loss for r in recs],
            }
            for key in recs[0].values:
                columns[f"v:{key}"] = [r.values.get(key, float("nan")) for r in recs]
            for key in recs[0].multipliers:
                columns[f"m:{key}"] = [r.multipliers.get(key, float("nan")) for r in recs]
            table = pa.table(
                {
                    k: pa.array(v, type=pa.int64() if k == "step" else pa.int32() if k == "replica" else pa.float64())
                    for k, v in columns.items()
                }
            )
            path = self.directory / f"steps-{self._index:06d}.parquet"
            pq.write_table(table, path)
            written.append(path)
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
            pq.write_table(table, path)
            written.append(path)
        self._steps, self._other = [], []
        self._last_write = time.monotonic()
        return written

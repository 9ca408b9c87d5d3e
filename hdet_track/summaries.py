"""Multi-resolution summaries of the steps table: exact aggregates per replica and fixed-size step bucket.

The event archive writes one summary piece per steps chunk (``summary/part-NNNNNN.parquet``) and,
every few chunks, a rollup of everything that archive wrote so far
(``summary/rollup-AAAAAA-BBBBBB.parquet``: chunks AAAAAA to BBBBBB). A reader rebuilds the overview
of a run of 64 replicas x 1,000,000 steps from one rollup and a handful of pieces instead of 64M rows,
and reads full rows only for a zoomed step range.

For every level (steps per bucket), replica and bucket ``(step - 1) // level`` a row holds
``first_step``, ``last_step``, ``rows`` and, for every column of the steps table (``loss``, ``v:<series>``,
``m:<hyperparameter>``): ``min`` and ``max`` of its finite values, their ``sum`` and ``count``, and the
``first`` and ``last`` value (by step, finite or not). Pieces merge exactly: min of mins, sum of sums...
Nothing here imports a tracker or the scheduler.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "BucketTable",
    "LEVELS",
    "STATS",
    "SUMMARY_DIR",
    "OVERVIEW_BUCKETS",
    "FULL_ROWS",
    "full_rows_limit",
    "part_name",
    "rollup_name",
    "parse_piece_name",
]

LEVELS = (1_000, 32_000)  # steps per bucket
STATS = ("min", "max", "sum", "count", "first", "last")
SUMMARY_DIR = "summary"
OVERVIEW_BUCKETS = 1_000  # an overview uses the finest level with at most this many buckets in view
FULL_ROWS = 2_000_000  # a run (or a zoomed range) with at most this many rows is read in full
_META_KEY = b"hdet.chunks"


def full_rows_limit() -> int:
    """Rows up to which a run or step range is read at full resolution (``$HDET_FULL_ROWS``, default 2,000,000)."""
    value = os.environ.get("HDET_FULL_ROWS", "")
    return int(value) if value.strip().isdigit() else FULL_ROWS


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


def rollup_name(first: int, last: int) -> str:
    return f"rollup-{first:06d}-{last:06d}.parquet"


def parse_piece_name(name: str) -> tuple[int, int] | None:
    """The range of steps-chunk indices a summary piece covers, from its file name (None: not a piece)."""
    stem = name.rsplit("/", 1)[-1].removesuffix(".parquet")
    parts = stem.split("-")
    if parts[0] == "part" and len(parts) == 2 and parts[1].isdigit():
        return int(parts[1]), int(parts[1])
    if parts[0] == "rollup" and len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


def _empty_int(dtype: type = np.int64) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class BucketTable:
    """Aggregates per (level, replica, bucket), sorted by those three.

    Attributes:
        stats: ``"<column>|<stat>"`` -> float64 per row, for every column of the steps table
            (``loss``, ``v:lr``, ``m:lr``...) and every stat of :data:`STATS`.
        chunks: steps-chunk file name -> (first step, last step) of the chunks aggregated here.
    """

    level: np.ndarray = field(default_factory=_empty_int)
    replica: np.ndarray = field(default_factory=lambda: _empty_int(np.int32))
    bucket: np.ndarray = field(default_factory=_empty_int)
    first_step: np.ndarray = field(default_factory=_empty_int)
    last_step: np.ndarray = field(default_factory=_empty_int)
    rows: np.ndarray = field(default_factory=_empty_int)
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    chunks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.level)

    @property
    def columns(self) -> list[str]:
        """The steps-table columns summarised here (``loss``, ``v:lr``, ``m:lr``...)."""
        return list(dict.fromkeys(k.rsplit("|", 1)[0] for k in self.stats))

    @property
    def levels(self) -> list[int]:
        return sorted({int(x) for x in np.unique(self.level)})

    def select(self, mask: np.ndarray) -> BucketTable:
        return BucketTable(
            self.level[mask],
            self.replica[mask],
            self.bucket[mask],
            self.first_step[mask],
            self.last_step[mask],
            self.rows[mask],
            {k: v[mask] for k, v in self.stats.items()},
            dict(self.chunks),
        )

    def at(self, level: int, lo: int | None = None, hi: int | None = None) -> BucketTable:
        """The rows of one level whose buckets overlap steps ``[lo, hi]``."""
        mask = self.level == level
        if lo is not None:
            mask &= self.last_step >= lo
        if hi is not None:
            mask &= self.first_step <= hi
        return self.select(mask)

    def rows_in(self, lo: int | None = None, hi: int | None = None) -> int:
        """The rows these buckets hold in steps ``[lo, hi]``: whole for a bucket inside the range, in
        proportion to its steps in range for one at either end (a bucket's rows are spread evenly
        over its steps: one row per replica and logged step), rounded up."""
        first = self.first_step if lo is None else np.maximum(self.first_step, lo)
        last = self.last_step if hi is None else np.minimum(self.last_step, hi)
        inside = np.clip(last - first + 1, 0, None)
        span = np.maximum(self.last_step - self.first_step + 1, 1)
        return int((-(-self.rows.astype(np.int64) * inside // span)).sum())  # integer ceiling

    def stat(self, column: str, stat: str) -> np.ndarray | None:
        return self.stats.get(f"{column}|{stat}")

    # ------------------------------------------------------------------ reading one level's rows
    def groups(self) -> tuple[np.ndarray, np.ndarray]:
        """(middle step of each bucket here, index of each row's bucket), rows of one level."""
        buckets, inverse = np.unique(self.bucket, return_inverse=True)
        first = np.full(len(buckets), np.iinfo(np.int64).max)
        last = np.full(len(buckets), np.iinfo(np.int64).min)
        np.minimum.at(first, inverse, self.first_step)
        np.maximum.at(last, inverse, self.last_step)
        return (first + last) // 2, inverse

    def envelope(self, column: str, replica: int) -> tuple[np.ndarray, np.ndarray]:
        """One replica's min and max of ``column`` per bucket, as a line through (first step, min),
        (last step, max) of each bucket; a bucket with a missing value breaks the line."""
        if column not in self.columns:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        m = self.replica == replica
        n = int(m.sum())
        x = np.empty(2 * n, dtype=np.int64)
        y = np.empty(2 * n)
        x[0::2], x[1::2] = self.first_step[m], self.last_step[m]
        y[0::2], y[1::2] = self.stat(column, "min")[m], self.stat(column, "max")[m]
        y[0::2][self.stat(column, "count")[m] < self.rows[m]] = np.nan
        return x, y

    def mean(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(bucket middles, mean of ``column`` over every replica's finite values in each bucket)."""
        steps, inverse = self.groups()
        sums = np.bincount(inverse, weights=self.stat(column, "sum"), minlength=len(steps))
        counts = np.bincount(inverse, weights=self.stat(column, "count"), minlength=len(steps))
        with np.errstate(invalid="ignore", divide="ignore"):
            return steps, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)

    def median(self, column: str) -> tuple[np.ndarray, np.ndarray]:
        """(bucket middles, median over replicas of each replica's bucket mean; a replica with a
        missing value in the bucket counts as infinite)."""
        steps, inverse = self.groups()
        count = self.stat(column, "count")
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.where(count < self.rows, np.inf, self.stat(column, "sum") / count)
        order = np.lexsort((means, inverse))
        values = means[order]
        _, starts, counts = np.unique(inverse[order], return_index=True, return_counts=True)
        lo, hi = values[starts + (counts - 1) // 2], values[starts + counts // 2]
        with np.errstate(invalid="ignore", over="ignore"):
            return steps, (lo + hi) / 2

    # ------------------------------------------------------------------ building
    @staticmethod
    def summarize(
        step: np.ndarray,
        replica: np.ndarray,
        columns: Mapping[str, np.ndarray],
        levels: Sequence[int] = LEVELS,
        chunks: Mapping[str, tuple[int, int]] | None = None,
    ) -> BucketTable:
        """Aggregate rows (``step``, ``replica``, one array per column) into buckets at every level.

        Example:
            >>> t = BucketTable.summarize(np.arange(1, 2001), np.zeros(2000, int), {"loss": np.ones(2000)})
            >>> t.stat("loss", "sum").tolist()
            [1000.0, 1000.0, 2000.0]
        """
        step = np.asarray(step, dtype=np.int64)
        replica = np.asarray(replica, dtype=np.int32)
        n = len(step)
        if n == 0:
            return BucketTable(chunks=dict(chunks or {}))
        order = np.lexsort((step, replica))
        s, r = step[order], replica[order]
        sorted_cols = {name: np.asarray(col, dtype=np.float64)[order] for name, col in columns.items()}
        finite = {name: np.isfinite(v) for name, v in sorted_cols.items()}
        parts = []
        for level in levels:
            b = (s - 1) // level
            new = np.ones(n, dtype=bool)
            new[1:] = (r[1:] != r[:-1]) | (b[1:] != b[:-1])
            starts = np.flatnonzero(new)
            ends = np.append(starts[1:], n)
            stats: dict[str, np.ndarray] = {}
            for name, v in sorted_cols.items():
                fin = finite[name]
                only = np.where(fin, v, np.nan)
                stats[f"{name}|min"] = np.fmin.reduceat(only, starts)
                stats[f"{name}|max"] = np.fmax.reduceat(only, starts)
                stats[f"{name}|sum"] = np.add.reduceat(np.where(fin, v, 0.0), starts)
                stats[f"{name}|count"] = np.add.reduceat(fin.astype(np.float64), starts)
                stats[f"{name}|first"] = v[starts]
                stats[f"{name}|last"] = v[ends - 1]
            parts.append(
                BucketTable(
                    level=np.full(len(starts), level, dtype=np.int64),
                    replica=r[starts],
                    bucket=b[starts],
                    first_step=s[starts],
                    last_step=s[ends - 1],
                    rows=(ends - starts).astype(np.int64),
                    stats=stats,
                )
            )
        out = BucketTable.concat(parts)
        out.chunks = dict(chunks or {})
        return out

    @staticmethod
    def concat(tables: Sequence[BucketTable]) -> BucketTable:
        """Rows of every table one after the other (no merging); a column missing from a table is
        NaN there (0 for ``sum`` and ``count``)."""
        tables = [t for t in tables if t is not None]
        chunks: dict[str, tuple[int, int]] = {}
        for t in tables:
            chunks.update(t.chunks)
        tables = [t for t in tables if len(t)]
        if not tables:
            return BucketTable(chunks=chunks)
        keys = list(dict.fromkeys(k for t in tables for k in t.stats))

        def col(t: BucketTable, key: str) -> np.ndarray:
            if key in t.stats:
                return t.stats[key]
            fill = 0.0 if key.endswith(("|sum", "|count")) else np.nan
            return np.full(len(t), fill)

        return BucketTable(
            level=np.concatenate([t.level for t in tables]),
            replica=np.concatenate([t.replica for t in tables]),
            bucket=np.concatenate([t.bucket for t in tables]),
            first_step=np.concatenate([t.first_step for t in tables]),
            last_step=np.concatenate([t.last_step for t in tables]),
            rows=np.concatenate([t.rows for t in tables]),
            stats={k: np.concatenate([col(t, k) for t in tables]) for k in keys},
            chunks=chunks,
        )

    @staticmethod
    def merge(tables: Sequence[BucketTable | None]) -> BucketTable:
        """One row per (level, replica, bucket): the exact aggregate of pieces that cover disjoint rows
        (each piece a different chunk of the steps table)."""
        t = BucketTable.concat([x for x in tables if x is not None])
        n = len(t)
        if n == 0:
            return t
        order = np.lexsort((t.first_step, t.bucket, t.replica, t.level))
        t = t.select(order)
        new = np.ones(n, dtype=bool)
        new[1:] = (t.level[1:] != t.level[:-1]) | (t.replica[1:] != t.replica[:-1]) | (t.bucket[1:] != t.bucket[:-1])
        if new.all():
            return t
        starts = np.flatnonzero(new)
        ends = np.append(starts[1:], n)
        stats: dict[str, np.ndarray] = {}
        for key, v in t.stats.items():
            stat = key.rsplit("|", 1)[1]
            if stat == "min":
                stats[key] = np.fmin.reduceat(v, starts)
            elif stat == "max":
                stats[key] = np.fmax.reduceat(v, starts)
            elif stat in ("sum", "count"):
                stats[key] = np.add.reduceat(v, starts)
            elif stat == "first":
                stats[key] = v[starts]
            else:  # last: the piece that starts last ends last (pieces of one replica do not interleave)
                stats[key] = v[ends - 1]
        return BucketTable(
            level=t.level[starts],
            replica=t.replica[starts],
            bucket=t.bucket[starts],
            first_step=t.first_step[starts],
            last_step=np.maximum.reduceat(t.last_step, starts),
            rows=np.add.reduceat(t.rows, starts),
            stats=stats,
            chunks=t.chunks,
        )

    # ------------------------------------------------------------------ Parquet
    def to_arrow(self):  # noqa: ANN201 - pyarrow.Table
        import pyarrow as pa

        columns = {
            "level": pa.array(self.level, type=pa.int64()),
            "replica": pa.array(self.replica, type=pa.int32()),
            "bucket": pa.array(self.bucket, type=pa.int64()),
            "first_step": pa.array(self.first_step, type=pa.int64()),
            "last_step": pa.array(self.last_step, type=pa.int64()),
            "rows": pa.array(self.rows, type=pa.int64()),
        }
        columns |= {k: pa.array(v, type=pa.float64()) for k, v in self.stats.items()}
        meta = {_META_KEY: json.dumps({k: list(v) for k, v in self.chunks.items()}).encode()}
        return pa.table(columns).replace_schema_metadata(meta)

    @staticmethod
    def from_arrow(table) -> BucketTable:  # noqa: ANN001 - pyarrow.Table
        """Raises:
        KeyError: the table is not a summary."""
        meta = table.schema.metadata or {}
        chunks = {k: (int(v[0]), int(v[1])) for k, v in json.loads(meta.get(_META_KEY, b"{}")).items()}

        def ints(name: str, dtype: type = np.int64) -> np.ndarray:
            return table.column(name).to_numpy().astype(dtype, copy=False)

        fixed = {"level", "replica", "bucket", "first_step", "last_step", "rows"}
        return BucketTable(
            level=ints("level"),
            replica=ints("replica", np.int32),
            bucket=ints("bucket"),
            first_step=ints("first_step"),
            last_step=ints("last_step"),
            rows=ints("rows"),
            stats={
                c: table.column(c).to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
                for c in table.column_names
                if c not in fixed
            },
            chunks=chunks,
        )

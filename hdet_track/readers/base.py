"""``HDETRun``: one run rebuilt from a tracker, whatever the backend; and the reader protocol.

A run is columnar (numpy arrays) so that a 100,000-step, 8-replica run loads and slices fast.
Nothing here imports a tracker, Streamlit or the scheduler.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import names
from ..errors import HDETError
from ..events import ControllerDecision, Converge, Guard, RunEnd, RunStart, UnknownSchemaError, event_from_dict
from ..record import ExploredSpec

__all__ = [
    "HDETRun",
    "StepTable",
    "RunSummary",
    "RunReader",
    "ReaderError",
    "RunNotFoundError",
    "parse_chunks",
    "apply_events",
    "read_archive",
]

logger = logging.getLogger(__name__)


class ReaderError(HDETError):
    """A run could not be read."""


class RunNotFoundError(ReaderError):
    """No run with that id (or no runs at all) at the source."""


@dataclass
class StepTable:
    """One row per replica and step, sorted by (step, replica)."""

    step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    replica: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    loss: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    values: dict[str, np.ndarray] = field(default_factory=dict)  # series key -> value per row
    multipliers: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.step)

    @staticmethod
    def concat(tables: Sequence[StepTable]) -> StepTable:
        tables = [t for t in tables if len(t)]
        if not tables:
            return StepTable()
        if len(tables) == 1:
            return tables[0]
        keys = list(dict.fromkeys(k for t in tables for k in t.values))
        mkeys = list(dict.fromkeys(k for t in tables for k in t.multipliers))

        def col(getter: Any, key: str) -> np.ndarray:
            return np.concatenate([getter(t).get(key, np.full(len(t), np.nan)) for t in tables])

        out = StepTable(
            step=np.concatenate([t.step for t in tables]),
            replica=np.concatenate([t.replica for t in tables]),
            loss=np.concatenate([t.loss for t in tables]),
            values={k: col(lambda t: t.values, k) for k in keys},
            multipliers={k: col(lambda t: t.multipliers, k) for k in mkeys},
        )
        return out.sorted()

    def sorted(self) -> StepTable:
        if len(self) < 2 or bool(np.all(np.diff(self.step * 4096 + self.replica) > 0)):
            return self
        order = np.lexsort((self.replica, self.step))
        # Keep one row per (step, replica): a replayed chunk must not double a point.
        s, r = self.step[order], self.replica[order]
        keep = np.ones(len(order), dtype=bool)
        keep[1:] = (s[1:] != s[:-1]) | (r[1:] != r[:-1])
        order = order[keep]
        return StepTable(
            step=self.step[order],
            replica=self.replica[order],
            loss=self.loss[order],
            values={k: v[order] for k, v in self.values.items()},
            multipliers={k: v[order] for k, v in self.multipliers.items()},
        )


@dataclass
class RunSummary:
    """A line of a run list."""

    run_id: str
    name: str
    status: str
    live: bool
    schedule: str  # "hdet", "onecycle" or "" (not an HDET run)
    world_size: int
    compare_group: str | None
    final_loss: float
    start_time: float = 0.0
    experiment: str = ""


@dataclass
class HDETRun:
    """A run as the dashboard and the comparison table see it.

    Attributes:
        steps: every replica's values and loss at every step (full resolution when the run has
            its event archive; otherwise what the metric histories hold).
        converge: one :class:`~hdet_track.events.Converge` per sync.
        controller: the controller's decisions, per sync and hyperparameter.
        metrics: other metric series (``val_loss``, the means ``loss``/``lr``...): key -> (steps, values).
        live: the run is still running.
        warnings: what could not be read (a truncated chunk, an unknown schema...).
    """

    run_id: str
    name: str = ""
    source: str = ""
    backend: str = ""
    status: str = "UNKNOWN"
    start: RunStart | None = None
    end: RunEnd | None = None
    steps: StepTable = field(default_factory=StepTable)
    converge: list[Converge] = field(default_factory=list)
    controller: list[ControllerDecision] = field(default_factory=list)
    guard: list[Guard] = field(default_factory=list)
    metrics: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    chunks: tuple[str, ...] = ()  # archive chunks already read (for incremental re-reads)
    start_time: float = 0.0

    # ------------------------------------------------------------------ facts
    @property
    def live(self) -> bool:
        return self.status == "RUNNING"

    @property
    def has_events(self) -> bool:
        return self.start is not None or len(self.steps) > 0

    @property
    def world_size(self) -> int:
        if self.start is not None:
            return self.start.world_size
        if len(self.steps):
            return int(self.steps.replica.max()) + 1
        ws = self.tags.get("hdet.world_size")
        return int(ws) if ws and ws.isdigit() else 1

    @property
    def schedule(self) -> str:
        if self.start is not None:
            return self.start.schedule
        return self.tags.get("hdet.schedule", "")

    @property
    def compare_group(self) -> str | None:
        if self.start is not None and self.start.compare_group:
            return self.start.compare_group
        return self.tags.get("hdet.compare_group")

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.start.config) if self.start is not None else {}

    @property
    def explored(self) -> list[ExploredSpec]:
        return list(self.start.explored) if self.start is not None else []

    def explored_names(self) -> list[str]:
        """``"lr"`` and the other explored hyperparameters (from the run's start, else its series)."""
        found = [e.name for e in self.explored]
        if not found and len(self.steps):
            found = sorted({names.parse_series_key(k)[0] for k in self.steps.values}, key=lambda n: (n != "lr", n))
        return found

    def series_keys(self, name: str) -> list[str]:
        """The series keys of hyperparameter ``name`` (one per target: ``lr``, ``lr/pg1``, ...)."""
        for e in self.explored:
            if e.name == name:
                return list(e.series_keys)
        return [k for k in self.steps.values if names.parse_series_key(k)[0] == name]

    def spread(self, name: str) -> float:
        """The spread hyperparameter ``name`` was explored with (0 when unknown)."""
        return next((e.spread for e in self.explored if e.name == name), 0.0)

    @property
    def last_step(self) -> int:
        candidates = [int(self.steps.step[-1])] if len(self.steps) else []
        candidates += [int(s[-1]) for s, _ in self.metrics.values() if len(s)]
        return max(candidates) if candidates else 0

    # ------------------------------------------------------------------ series
    def replica_series(self, key: str, replica: int) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of one replica; ``key`` is ``"loss"`` or a series key (``"lr"``...)."""
        mask = self.steps.replica == replica
        column = self.steps.loss if key == "loss" else self.steps.values.get(key)
        if column is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        return self.steps.step[mask], column[mask]

    def mean_series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, mean over replicas) of ``loss`` or a series key; falls back to a logged metric."""
        column = self.steps.loss if key == "loss" else self.steps.values.get(key)
        if column is None or not len(self.steps):
            return self.metrics.get(key, (np.zeros(0, dtype=np.int64), np.zeros(0)))
        steps, inverse = np.unique(self.steps.step, return_inverse=True)
        finite = np.isfinite(column)
        sums = np.bincount(inverse, weights=np.where(finite, column, 0.0), minlength=len(steps))
        counts = np.bincount(inverse, weights=finite.astype(float), minlength=len(steps))
        with np.errstate(invalid="ignore", divide="ignore"):
            return steps, np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)

    def median_series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, median over replicas) of ``loss`` or a series key, a non-finite value counting as the
        largest: one exploring replica that blows up (and is repaired at the next sync) moves the mean
        but not the median; the median is non-finite once half the replicas are."""
        column = self.steps.loss if key == "loss" else self.steps.values.get(key)
        if column is None or not len(self.steps):
            return self.metrics.get(key, (np.zeros(0, dtype=np.int64), np.zeros(0)))
        ranked = np.where(np.isnan(column), np.inf, column)
        order = np.lexsort((ranked, self.steps.step))
        steps_sorted, values = self.steps.step[order], ranked[order]
        steps, starts, counts = np.unique(steps_sorted, return_index=True, return_counts=True)
        lo, hi = values[starts + (counts - 1) // 2], values[starts + counts // 2]
        with np.errstate(invalid="ignore", over="ignore"):
            return steps, (lo + hi) / 2

    def controller_series(self, name: str = "lr", target: int = 0) -> dict[str, np.ndarray]:
        """step, base, base_before, velocity, delta, onecycle and drift (= base / onecycle) per sync."""
        rows = [d for d in self.controller if d.name == name and target < len(d.base_after)]
        out = {
            "step": np.array([d.step for d in rows], dtype=np.int64),
            "base": np.array([d.base_after[target] for d in rows], dtype=float),
            "base_before": np.array([d.base_before[target] for d in rows], dtype=float),
            "velocity": np.array([d.velocity[target] for d in rows], dtype=float),
            "delta": np.array([d.delta[target] for d in rows], dtype=float),
            "onecycle": np.array(
                [d.onecycle[target] if d.onecycle is not None and target < len(d.onecycle) else np.nan for d in rows],
                dtype=float,
            ),
            "reference": np.array([_reference(d, target) for d in rows], dtype=float),
        }
        with np.errstate(invalid="ignore", divide="ignore"):
            out["drift"] = out["base"] / out["reference"]
        return out

    def final_loss(self) -> float:
        steps, values = self.mean_series("loss")
        finite = values[np.isfinite(values)] if len(values) else values
        return float(finite[-1]) if len(finite) else math.nan

    def summary(self) -> RunSummary:
        return RunSummary(
            run_id=self.run_id,
            name=self.name,
            status=self.status,
            live=self.live,
            schedule=self.schedule,
            world_size=self.world_size,
            compare_group=self.compare_group,
            final_loss=self.final_loss(),
            start_time=self.start_time,
        )


def _reference(decision: ControllerDecision, target: int) -> float:
    """What the decision's base is measured against: its reference, else (schema 1) OneCycle's LR."""
    for values in (decision.reference, decision.onecycle):
        if values is not None and target < len(values):
            return float(values[target])
    return math.nan


class RunReader(Protocol):
    """What every backend reader provides."""

    def list_runs(self, experiment: str | None = None) -> list[RunSummary]:
        """Runs at the source (newest first), with enough facts for a run list."""

    def read(self, run_id: str, previous: HDETRun | None = None) -> HDETRun:
        """The whole run; with ``previous`` (a live run read before), only what is new is fetched."""


# ---------------------------------------------------------------------- parsing archive chunks
def parse_chunks(chunks: Iterable[tuple[str, bytes]], run: HDETRun) -> tuple[list[StepTable], list[Any]]:
    """Parse archive chunks (name, Parquet bytes) into step tables and events; bad chunks become
    warnings on ``run``, never exceptions."""
    import pyarrow.parquet as pq

    tables: list[StepTable] = []
    events: list[Any] = []
    for name, data in chunks:
        try:
            table = pq.read_table(io.BytesIO(data))
        except Exception as exc:  # noqa: BLE001 - truncated or corrupt chunk
            run.warnings.append(f"skipped unreadable archive chunk {name}: {type(exc).__name__}: {exc}")
            continue
        cols = table.column_names
        if name.startswith("steps-") and {"step", "replica", "loss"} <= set(cols):
            tables.append(
                StepTable(
                    step=table.column("step").to_numpy().astype(np.int64, copy=False),
                    replica=table.column("replica").to_numpy().astype(np.int32, copy=False),
                    loss=_floats(table.column("loss")),
                    values={c[2:]: _floats(table.column(c)) for c in cols if c.startswith("v:")},
                    multipliers={c[2:]: _floats(table.column(c)) for c in cols if c.startswith("m:")},
                )
            )
        elif name.startswith("events-") and "json" in cols:
            for text in table.column("json").to_pylist():
                try:
                    events.append(event_from_dict(json.loads(text)))
                except UnknownSchemaError as exc:
                    run.warnings.append(f"{name}: {exc}")
                except (ValueError, TypeError, KeyError) as exc:
                    run.warnings.append(f"{name}: unreadable event ({type(exc).__name__}: {exc})")
        else:
            run.warnings.append(f"skipped archive chunk {name}: unexpected columns {cols[:6]}")
    return tables, events


def _floats(column: Any) -> np.ndarray:
    return column.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)


def read_archive(
    run: HDETRun, names: Sequence[str], fetch: Callable[[str], bytes | None], previous: HDETRun | None
) -> None:
    """Fold the archive chunks ``names`` into ``run``. With ``previous`` (the same run read before,
    e.g. while live), only the chunks it has not read are fetched; ``fetch`` returns a chunk's bytes
    (or None after adding a warning)."""
    reuse = previous is not None and previous.run_id == run.run_id and set(previous.chunks) <= set(names)
    known = set(previous.chunks) if reuse and previous is not None else set()
    chunks, fetched = [], set()
    for name in names:
        if name in known:
            continue
        data = fetch(name)
        if data is not None:
            chunks.append((name.rsplit("/", 1)[-1], data))
            fetched.add(name)
    tables, events = parse_chunks(chunks, run)
    if reuse and previous is not None:
        tables = [previous.steps, *tables]
        run.start, run.end = previous.start, previous.end
        run.converge, run.controller = list(previous.converge), list(previous.controller)
        run.guard = list(previous.guard)
    run.steps = StepTable.concat(tables)
    apply_events(run, events)
    run.chunks = tuple(sorted(known | fetched))


def apply_events(run: HDETRun, events: Iterable[Any]) -> None:
    """Fold parsed events into ``run`` (start, converge, controller, end), in step order."""
    for ev in events:
        if isinstance(ev, RunStart):
            run.start = ev
        elif isinstance(ev, Converge):
            run.converge.append(ev)
        elif isinstance(ev, ControllerDecision):
            run.controller.append(ev)
        elif isinstance(ev, Guard):
            run.guard.append(ev)
        elif isinstance(ev, RunEnd):
            run.end = ev
    run.converge.sort(key=lambda e: e.step)
    run.controller.sort(key=lambda e: e.step)
    run.guard.sort(key=lambda e: e.step)

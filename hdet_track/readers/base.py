"""``HDETRun``: one run rebuilt from a tracker, whatever the backend; and the reader protocol.

A run is columnar (numpy arrays) so that a 100,000-step, 8-replica run loads and slices fast. A huge
run (more rows than :func:`~hdet_track.summaries.full_rows_limit`) is read as an overview: the
archive's per-bucket summaries, with full rows only for a zoomed step range.
Nothing here imports a tracker, Streamlit or the scheduler.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import names
from ..errors import HDETError
from ..events import ControllerDecision, Converge, Guard, RunEnd, RunStart
from ..record import ExploredSpec
from ..summaries import OVERVIEW_BUCKETS, BucketTable

__all__ = [
    "HDETRun",
    "StepTable",
    "RunSummary",
    "RunReader",
    "ReaderError",
    "RunNotFoundError",
]

logger = logging.getLogger(__name__)

NO_SCHEDULE = "plain"  # the schedule of a run without the hdet.schedule tag (not an HDET run), everywhere


def schedule_label(schedule: str) -> str:
    """A run's schedule as the table, the figures and the dashboard show it: ``hdet``, ``onecycle``
    or ``plain``."""
    return schedule or NO_SCHEDULE


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
        metrics: other metric series (``val_loss``...; the means ``loss``/``lr`` only where the steps
            came from metric histories, not the archive's step rows): key -> (steps, values).
        live: the run is still running.
        warnings: what could not be read (a truncated chunk, an unknown schema...).
        aggregates: the archive's per-bucket aggregates of the steps table (None for archives written
            before 0.3, and runs without an archive).
        overview: the steps were not read (too many rows for the step range): per-step series are
            per-bucket aggregates of ``aggregates`` (see :attr:`resolution`).
        view: the step range read (inclusive), or None for the whole run.
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
    aggregates: BucketTable | None = None
    overview: bool = False
    view: tuple[int, int] | None = None
    row_chunks: tuple[str, ...] = ()  # steps chunks whose rows are in ``steps``
    # steps or syncs taken from the tracker's own rows where the archive lacks them (a W&B run
    # killed before its last chunk, then resumed from a checkpoint; an MLflow run whose steps
    # chunks gave no rows in this read): a later read starts afresh
    filled_from_rows: bool = False
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ facts
    @property
    def live(self) -> bool:
        return self.status == "RUNNING"

    @property
    def has_step_series(self) -> bool:
        """Whether the archive gave the per-replica step rows, or the run is read as an overview of
        their summaries, or as a zoom into a range where the summaries say it has none: then the
        store's own ``loss``/``lr`` histories are not needed (a torn chunk that gave no rows leaves
        them in use; an empty zoom read them, the whole run's, as if torn)."""
        if len(self.steps) > 0 or (self.overview and self.aggregates is not None):
            return True
        if self.view is None or self.aggregates is None or not self.aggregates.chunks:
            return False
        lo, hi = self.view  # a zoom between the chunks the summaries cover: empty, not torn
        return not any(first <= hi and last >= lo for first, last in self.aggregates.chunks.values())

    @property
    def has_events(self) -> bool:
        return self.start is not None or len(self.steps) > 0

    @property
    def world_size(self) -> int:
        if self.start is not None:
            return self.start.world_size
        if len(self.steps):
            return int(self.steps.replica.max()) + 1
        if self.aggregates is not None and len(self.aggregates):
            return int(self.aggregates.replica.max()) + 1
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

    @property
    def step_guard(self) -> str:
        """The scope of the controller's per-step guard (the latest sync's): ``"all"`` (collective),
        ``"local"`` (each replica checks itself), or ``""`` (none, or a run logged by an older hdet-track)."""
        return next((c.step_guard for c in reversed(self.converge) if c.step_guard), "")

    def explored_names(self) -> list[str]:
        """``"lr"`` and the other explored hyperparameters (from the run's start, else its series)."""
        found = [e.name for e in self.explored]
        if not found:
            found = sorted({names.parse_series_key(k)[0] for k in self._value_keys()}, key=lambda n: (n != "lr", n))
        return found

    def _value_keys(self) -> list[str]:
        if len(self.steps) or self.aggregates is None:
            return list(self.steps.values)
        return [c[2:] for c in self.aggregates.columns if c.startswith("v:")]

    def series_keys(self, name: str) -> list[str]:
        """The series keys of hyperparameter ``name`` (one per target: ``lr``, ``lr/pg1``, ...)."""
        for e in self.explored:
            if e.name == name:
                return list(e.series_keys)
        return [k for k in self._value_keys() if names.parse_series_key(k)[0] == name]

    def known_series_keys(self) -> list[str]:
        """The per-replica series this run has: ``"loss"`` and each explored hyperparameter's keys
        (``lr``, ``lr/pg1``, ``dropout``...); empty when the run says neither (no start, no step
        rows: a run the readers know only by its metric histories)."""
        keys = [k for e in self.explored for k in e.series_keys] + self._value_keys()
        return ["loss", *dict.fromkeys(k for k in keys if k != "loss")] if keys else []

    def spread(self, name: str) -> float:
        """The spread hyperparameter ``name`` was explored with (0 when unknown)."""
        return next((e.spread for e in self.explored if e.name == name), 0.0)

    @property
    def last_step(self) -> int:
        candidates = [int(self.steps.step[-1])] if len(self.steps) else []
        if self.aggregates is not None and len(self.aggregates):
            candidates.append(int(self.aggregates.last_step.max()))
        candidates += [int(s[-1]) for s, _ in self.metrics.values() if len(s)]
        return max(candidates) if candidates else 0

    # ------------------------------------------------------------------ series
    def replica_series(self, key: str, replica: int) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of one replica; ``key`` is ``"loss"`` or a series key (``"lr"``...).

        In an overview, two points per bucket: its min at the bucket's first step and its max at its
        last step (a bucket with a non-finite value starts with NaN, a gap). A key or replica this
        run does not have (see :meth:`known_series_keys`) is a ValueError naming what it has."""
        _check_series(self, key, replica)
        if self.overview:
            return self._buckets().envelope(self._bucket_column(key), replica)
        mask = self.steps.replica == replica
        column = self.steps.loss if key == "loss" else self.steps.values.get(key)
        if column is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        return self.steps.step[mask], column[mask]

    def mean_series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, mean over replicas) of ``loss`` or a series key; falls back to a logged metric. In an
        overview: the mean of every finite value of the bucket, at the bucket's middle step."""
        if self.overview and self._bucket_column(key) in self.aggregates.columns:  # type: ignore[union-attr]
            return self._buckets().mean(self._bucket_column(key))
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
        but not the median; the median is non-finite once half the replicas are. In an overview: the
        median over replicas of each replica's bucket mean (infinite when the bucket had a non-finite value)."""
        if self.overview and self._bucket_column(key) in self.aggregates.columns:  # type: ignore[union-attr]
            return self._buckets().median(self._bucket_column(key))
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
        """step, base, base_before, velocity, delta, onecycle, reference (the drift's reference: OneCycle's
        LR, an explored value's start) and drift (= base / reference) per sync
        (empty arrays for a run without auto-LR). A ``name`` this run did not explore, or a ``target``
        past its param groups, is a ValueError naming what it has."""
        _check_name(self, name, target)
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
        if self.overview and self.aggregates is not None and "loss" in self.aggregates.columns:
            t = self.aggregates.at(min(self.aggregates.levels))
            last = t.stat("loss", "last")[t.last_step == t.last_step.max()]
            last = last[np.isfinite(last)]
            return float(last.mean()) if len(last) else math.nan
        steps, values = self.mean_series("loss")
        finite = values[np.isfinite(values)] if len(values) else values
        return float(finite[-1]) if len(finite) else math.nan

    # ------------------------------------------------------------------ overview (per-bucket aggregates)
    @property
    def resolution(self) -> int | None:
        """Steps per bucket of the per-step series (None: every step)."""
        return int(self._buckets().level[0]) if self.overview and len(self._buckets()) else None

    def is_bucketed(self, key: str) -> bool:
        """Whether :meth:`mean_series` of ``key`` gives bucket means (an overview's per-step series),
        not the points as logged (a user's metric such as ``val_loss``)."""
        return self.resolution is not None and self._bucket_column(key) in self.aggregates.columns  # type: ignore[union-attr]

    def resolution_note(self) -> str:
        """What the per-step series show, for figure titles and captions ("" at full resolution)."""
        level = self.resolution
        if level is None:
            return ""
        rows = int(self._buckets().rows.sum())
        return f"summary: min/max and mean per {level:,} steps of {rows:,} rows; zoom in for every step"

    @staticmethod
    def _bucket_column(key: str) -> str:
        return "loss" if key == "loss" else f"v:{key}"

    def _buckets(self) -> BucketTable:
        """The summary at the finest level with at most OVERVIEW_BUCKETS buckets in view."""
        if "buckets" not in self._cache:
            summary = self.aggregates if self.aggregates is not None else BucketTable()
            lo, hi = self.view if self.view is not None else (None, None)
            chosen = BucketTable()
            for level in summary.levels:
                chosen = summary.at(level, lo, hi)
                if len(np.unique(chosen.bucket)) <= OVERVIEW_BUCKETS:
                    break
            self._cache["buckets"] = chosen
        return self._cache["buckets"]

    def multiplier_grid(self, name: str = "lr") -> tuple[list[int], np.ndarray]:
        """(window start steps, multiplier [replica, window]) of hyperparameter ``name``. At full
        resolution: one window per sync (the multiplier each replica held from that step); in an
        overview: one column per bucket (the multiplier each replica held at the bucket's first step).
        A ``name`` this run did not explore is a ValueError naming what it has."""
        _check_name(self, name)
        n = self.world_size
        if self.overview:
            t = self._buckets()
            first = t.stat(f"m:{name}", "first")
            if first is None or not len(t):
                return [], np.zeros((0, 0))
            steps, inverse = t.groups()
            starts = np.full(len(steps), np.iinfo(np.int64).max)
            np.minimum.at(starts, inverse, t.first_step)
            grid = np.full((n, len(steps)), np.nan)
            grid[t.replica, inverse] = first
            return [int(s) for s in starts], grid
        table = self.steps
        column = table.multipliers.get(name)
        if column is None or not len(table):
            return [], np.zeros((0, 0))
        sync_steps = sorted({c.step for c in self.converge})
        starts = [1] + [s + 1 for s in sync_steps if s < int(table.step[-1])]
        starts = sorted({int(table.step[0])} | {s for s in starts if s >= int(table.step[0])})  # a zoomed range
        grid = np.full((n, len(starts)), np.nan)
        for j, start in enumerate(starts):
            lo, hi = np.searchsorted(table.step, start, "left"), np.searchsorted(table.step, start, "right")
            grid[table.replica[lo:hi], j] = column[lo:hi]
        return starts, grid

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


def _check_series(run: HDETRun, key: str, replica: int) -> None:
    """A series key or replica the run does not have is a typo, not a run without data: say so
    (a run that says nothing of its series takes any key)."""
    known = run.known_series_keys()
    if known and key not in known:
        raise ValueError(
            f"Expected key to be 'loss' or one of this run's hyperparameter series {known[1:]}, but got {key!r}"
        )
    _check_index("replica", replica, run.world_size, "the run's replicas")


def _check_name(run: HDETRun, name: str, target: int | None = None) -> None:
    """Likewise for an explored hyperparameter's name, and one of its targets."""
    known = list(dict.fromkeys([*run.explored_names(), *(d.name for d in run.controller)]))
    if known and name not in known:
        raise ValueError(f"Expected name to be one of this run's explored hyperparameters {known}, but got {name!r}")
    keys = run.series_keys(name)
    if target is not None and keys:
        _check_index("target", target, len(keys), f"{name!r}'s targets: {keys}")


def _check_index(what: str, value: Any, n: int, of: str) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < n:
        raise ValueError(f"Expected {what} to be an integer in [0, {n}) ({of}), but got {value!r}")


def converge_from_series(
    step: int,
    window_losses: Sequence[float],
    left_out: float | None,
    step_guard: float | None,
    left_replicas: Sequence[int] = (),
) -> Converge:
    """A sync's :class:`Converge` rebuilt from its logged series (a run without its event archive):
    the window losses, the number left out, the replicas left out (``left_replicas``, from
    :func:`~hdet_track.names.left_out_metric`) and the step guard's code
    (:data:`~hdet_track.names.SYNC_STEP_GUARD`). The replicas are trusted only when they are as many
    as the number left out (a run logged before the series, or a resumed W&B run that logged a sync
    twice, can disagree); otherwise the non-finite windows stand for them. Divergences are not in
    the series, nor the reasons beyond "non-finite"."""
    losses = [float(x) for x in window_losses]
    count = int(left_out) if left_out is not None and math.isfinite(left_out) else 0
    given = sorted({int(r) for r in left_replicas})
    if len(given) == count:
        left = given
    else:
        left = [r for r, v in enumerate(losses) if not math.isfinite(v)] if count else []
    reasons = [
        "non-finite" if r >= len(losses) or not math.isfinite(losses[r]) else "left out (reason not logged)"
        for r in left
    ]
    scope = names.step_guard_scope(step_guard) if step_guard is not None else ""
    return Converge(
        step=int(step),
        window_losses=losses,
        divergence=[math.nan] * len(losses),
        left_out=left,
        reasons=reasons,
        step_guard=scope,
    )


# the divergences a run's metrics hold (mean and largest over replicas; per replica only in the archive)
DIVERGENCE_SUMMARIES = (names.SYNC_DIVERGENCE, names.SYNC_DIVERGENCE_MAX)


def divergence_summaries(series: dict[str, dict[int, float]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """From a run's per-sync series (see :func:`sync_events_from_series`), its divergence summaries
    as metrics (key -> (sync steps, values)): what a run read without its archive has of them."""
    out = {}
    for key in DIVERGENCE_SUMMARIES:
        if values := series.get(key):
            steps = sorted(values)
            out[key] = (np.array(steps, dtype=np.int64), np.array([values[s] for s in steps], dtype=float))
    return out


def is_sync_series(key: str) -> bool:
    """Whether ``key`` is one of the per-sync series :func:`sync_events_from_series` reads."""
    return (
        key in (names.SYNC_LEFT_OUT, names.SYNC_STEP_GUARD, names.SYNC_ROLLBACK, names.SYNC_BACKOFF)
        or key in DIVERGENCE_SUMMARIES
        or names.parse_window_loss_metric(key) is not None
        or names.parse_left_out_metric(key) is not None
        or names.parse_controller_metric(key) is not None
        or names.parse_weight_metric(key) is not None
        or key.startswith(names.onecycle_metric(""))
    )


def sync_events_from_series(
    series: dict[str, dict[int, float]], controller_name: str = ""
) -> tuple[list[Converge], list[ControllerDecision], list[Guard]]:
    """A run's syncs, controller decisions and guard actions rebuilt from its logged per-sync series
    (a run read without its event archive, or steps only a tracker's rows hold): ``series`` maps
    each metric of :func:`is_sync_series` to its values by sync step, in whatever the backend
    gives (MLflow's histories, W&B's rows). What the series do not say is unknown: the rate of a
    backoff or rollback (``drift_change`` NaN), the replicas a backoff answered, divergences.
    ``controller_name``: the run's controller (its ``hdet.controller`` tag), which the decisions name."""
    windows = {r: k for k in series if (r := names.parse_window_loss_metric(k)) is not None}
    converge: list[Converge] = []
    if windows:
        hist = {r: series[k] for r, k in windows.items()}
        n = max(hist) + 1
        left, scope = series.get(names.SYNC_LEFT_OUT, {}), series.get(names.SYNC_STEP_GUARD, {})
        left_at: dict[int, list[int]] = {}  # step -> the replicas marked left out there
        for key, values in series.items():
            if (r := names.parse_left_out_metric(key)) is not None:
                for step, value in values.items():
                    if value == 1.0:
                        left_at.setdefault(int(step), []).append(r)
        for step in sorted({s for h in hist.values() for s in h}):
            losses = [hist.get(r, {}).get(step, math.nan) for r in range(n)]
            converge.append(converge_from_series(step, losses, left.get(step), scope.get(step), left_at.get(step, [])))
    controller: dict[str, dict[str, dict[int, float]]] = {}
    weights: dict[str, dict[int, dict[int, float]]] = {}
    for key, values in series.items():
        if ctrl := names.parse_controller_metric(key):
            controller.setdefault(ctrl[0], {})[ctrl[1]] = values
        if weight := names.parse_weight_metric(key):
            weights.setdefault(weight[0], {})[weight[1]] = values
    by_name: dict[str, dict[int, dict[int, dict[str, float]]]] = {}
    for key, parts in controller.items():
        try:
            name, target = names.parse_series_key(key)
        except ValueError:
            continue
        onecycle = series.get(names.onecycle_metric(key), {})
        for step, base in parts.get("base", {}).items():
            drift = parts.get("drift", {}).get(step, math.nan)
            by_name.setdefault(name, {}).setdefault(int(step), {})[target] = {
                "base": base,
                "velocity": parts.get("velocity", {}).get(step, math.nan),
                "delta": parts.get("delta", {}).get(step, math.nan),
                "onecycle": onecycle.get(step, math.nan),
                "reference": base / drift if drift else onecycle.get(step, math.nan),
            }
    decisions = []
    for name, steps in by_name.items():
        w = weights.get(name, {})
        n = max(w) + 1 if w else 0
        for step, targets in sorted(steps.items()):
            ts = [targets[t] for t in sorted(targets)]
            weighed = any(step in w.get(r, {}) for r in range(n))  # none at a rollback
            decisions.append(
                ControllerDecision(
                    step=step,
                    name=name,
                    weights=[float(w.get(r, {}).get(step, math.nan)) for r in range(n)] if weighed else [],
                    delta=[t["delta"] for t in ts],
                    velocity=[t["velocity"] for t in ts],
                    base_before=[math.nan] * len(ts),
                    base_after=[t["base"] for t in ts],
                    gamma=math.nan,
                    permutation=[],
                    onecycle=[t["onecycle"] for t in ts] if name == "lr" else None,
                    reference=[t["reference"] for t in ts],
                    **({"controller": controller_name} if controller_name else {}),
                )
            )
    decisions.sort(key=lambda d: d.step)
    # the replicas a guard action answered: those left out at its sync (a rollback of a consensus
    # that blew up as a whole: every replica)
    world = max((len(c.window_losses) for c in converge), default=0)
    left_at_sync = {c.step: list(c.left_out) for c in converge}
    guards = [
        Guard(int(step), action, left_at_sync.get(int(step)) or fallback, f"{action} (reason not logged)", math.nan)
        for action, key, fallback in (
            ("backoff", names.SYNC_BACKOFF, []),
            ("rollback", names.SYNC_ROLLBACK, list(range(world))),
        )
        for step, value in series.get(key, {}).items()
        if value == 1.0
    ]
    return converge, decisions, sorted(guards, key=lambda g: g.step)


def _reference(decision: ControllerDecision, target: int) -> float:
    """What the decision's base is measured against: its reference, else (schema 1) OneCycle's LR."""
    for values in (decision.reference, decision.onecycle):
        if values is not None and target < len(values):
            return float(values[target])
    return math.nan


class RunReader(Protocol):
    """What every backend reader provides."""

    def list_runs(
        self, experiment: str | None = None, compare_group: str | None = None, limit: int | None = 1000
    ) -> list[RunSummary]:
        """Runs at the source (newest first), with enough facts for a run list: those of
        ``compare_group`` when given, at most ``limit`` (None: all)."""

    def read(
        self,
        run_id: str,
        previous: HDETRun | None = None,
        steps: tuple[int, int] | None = None,
        max_rows: int | None = None,
    ) -> HDETRun:
        """The run; with ``previous`` (a live run read before), only what is new is fetched. Full rows
        when the step range ``steps`` (None: the whole run) holds at most ``max_rows`` rows, else an
        overview from the archive's summaries."""

"""The comparison table of runs already logged (any tracking URI): one row per run, used by
``hdet-track compare``, the dashboard's Compare page and bench/quality.py.

Pure numpy on :class:`~hdet_track.readers.base.HDETRun`: it needs no plotting library, so
``hdet-track compare`` works with the ``[mlflow]`` extra alone.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from . import names
from .readers.base import NO_SCHEDULE, HDETRun, schedule_label

__all__ = ["ComparisonRow", "comparison_rows", "diverged_at", "format_rows", "schedule_label", "FORMATS", "NO_SCHEDULE"]

FORMATS = ("table", "markdown", "json")


@dataclass(frozen=True)
class ComparisonRow:
    run_id: str
    name: str
    schedule: str
    world_size: int
    status: str
    mean_lr: float
    final_train_loss: float  # the mean over replicas at the last finite step
    best_train_loss: float
    highest_stable_lr: float  # the highest mean LR reached while the loss stayed finite and bounded
    best_val_loss: float
    final_val_loss: float
    val_accuracy: float
    diverged: bool
    diverged_at_step: int | None


def diverged_at(steps: np.ndarray, loss: np.ndarray, factor: float = 10.0) -> int | None:
    """The first step whose loss is non-finite, or above ``factor`` x the first logged loss (when
    that is positive: a ratio says nothing about a loss that starts at 0 or below it)."""
    if not len(steps):
        return None
    finite = loss[np.isfinite(loss)]
    ref = finite[0] if len(finite) else math.inf
    bad = ~np.isfinite(loss) | ((loss > factor * ref) if ref > 0 else False)
    idx = np.flatnonzero(bad)
    return int(steps[idx[0]]) if len(idx) else None


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)] if len(values) else values


def _last(run: HDETRun, key: str) -> float:
    """The last logged value (nan, shown as ``-``, when it is not finite: not an earlier finite one)."""
    _, values = run.metrics.get(key, (np.zeros(0), np.zeros(0)))
    return float(values[-1]) if len(values) else math.nan


def _row(run: HDETRun) -> ComparisonRow:
    _, loss = run.mean_series(names.LOSS)
    lr_steps, lr = run.mean_series(names.LR)
    # the median over replicas: an exploring replica that blows up and is repaired is not a divergence
    broke = diverged_at(*run.median_series(names.LOSS))
    # the run's own mark is where it stopped (every replica non-finite at a sync); the loss usually
    # broke earlier, and the table reports the first step it did
    marked = run.metrics.get(names.DIVERGED_AT_STEP)
    stopped = int(marked[1][-1]) if marked is not None and len(marked[1]) else None
    known = [s for s in (broke, stopped) if s is not None]
    step = min(known) if known else None
    finite_loss, lr_f = _finite(loss), _finite(lr)
    stable = _finite(lr if broke is None else lr[lr_steps < broke])
    _, val = run.metrics.get(names.VAL_LOSS, (np.zeros(0), np.zeros(0)))
    finite_val = _finite(val)
    return ComparisonRow(
        run_id=run.run_id,
        name=run.name,
        schedule=schedule_label(run.schedule),
        world_size=run.world_size,
        status=run.status,
        mean_lr=float(lr_f.mean()) if len(lr_f) else math.nan,
        final_train_loss=float(finite_loss[-1]) if len(finite_loss) else math.nan,
        best_train_loss=float(finite_loss.min()) if len(finite_loss) else math.nan,
        highest_stable_lr=float(stable.max()) if len(stable) else math.nan,
        best_val_loss=float(finite_val.min()) if len(finite_val) else math.nan,
        final_val_loss=_last(run, names.VAL_LOSS),
        val_accuracy=_last(run, names.VAL_ACCURACY),
        diverged=step is not None,
        diverged_at_step=step,
    )


def comparison_rows(runs: Sequence[HDETRun]) -> list[ComparisonRow]:
    """One row per run, in the given order (as in the paper's Table 1)."""
    return [_row(run) for run in runs]


def _num(x: float, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}"  # inf as inf: a diverged value, not a missing one


def format_rows(rows: Sequence[ComparisonRow], fmt: str = "table") -> str:
    """``table`` (aligned text), ``markdown`` or ``json`` (a list with one object per run)."""
    if fmt == "json":

        def clean(v):
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return json.dumps([{k: clean(v) for k, v in asdict(r).items()} for r in rows], indent=2)
    header = [
        "run",
        "schedule",
        "mean LR",
        "final train loss",
        "best val loss",
        "final val loss",
        "val accuracy",
        "diverged",
    ]
    body = [
        [
            r.name if r.status == "FINISHED" else f"{r.name} ({r.status})",  # a run that did not end cleanly
            r.schedule,
            _num(r.mean_lr),
            _num(r.final_train_loss),
            _num(r.best_val_loss),
            _num(r.final_val_loss),
            _num(r.val_accuracy, 3),
            f"yes (step {r.diverged_at_step})" if r.diverged else "no",
        ]
        for r in rows
    ]
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in body]
        return "\n".join(lines)
    if fmt != "table":
        raise ValueError(f"Expected format in {FORMATS}, but got {fmt!r}")
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in body]
    return "\n".join(lines)

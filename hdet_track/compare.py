"""The comparison table of the paper's ablation, from runs already logged (any tracking URI)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .readers.base import HDETRun
from .viz.compare import compare_table

__all__ = ["ComparisonRow", "comparison_rows", "format_rows", "FORMATS"]

FORMATS = ("table", "markdown", "json")


@dataclass(frozen=True)
class ComparisonRow:
    run_id: str
    name: str
    schedule: str
    mean_lr: float
    final_train_loss: float
    best_val_loss: float
    final_val_loss: float
    val_accuracy: float
    diverged: bool
    diverged_at_step: int | None


def _last(run: HDETRun, key: str) -> float:
    steps, values = run.metrics.get(key, (np.zeros(0), np.zeros(0)))
    finite = values[np.isfinite(values)] if len(values) else values
    return float(finite[-1]) if len(finite) else math.nan


def comparison_rows(runs: Sequence[HDETRun]) -> list[ComparisonRow]:
    """One row per run, in the given order (as in the paper's Table 1)."""
    out = []
    for run, row in zip(runs, compare_table(runs)):
        # the run's own mark is where it stopped (every replica non-finite at a sync); the loss
        # usually broke earlier, and the table reports the first step it did
        marked = run.metrics.get("diverged_at_step")
        stopped = int(marked[1][-1]) if marked is not None and len(marked[1]) else None
        known = [s for s in (row.diverged_at, stopped) if s is not None]
        step = min(known) if known else None
        val_steps, val = run.metrics.get("val_loss", (np.zeros(0), np.zeros(0)))
        finite_val = val[np.isfinite(val)] if len(val) else val
        out.append(
            ComparisonRow(
                run_id=run.run_id,
                name=run.name,
                schedule=run.schedule or "onecycle",
                mean_lr=row.mean_lr,
                final_train_loss=row.final_loss,
                best_val_loss=float(finite_val.min()) if len(finite_val) else math.nan,
                final_val_loss=_last(run, "val_loss"),
                val_accuracy=_last(run, "val_accuracy"),
                diverged=step is not None,
                diverged_at_step=step,
            )
        )
    return out


def _num(x: float, digits: int = 4) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"


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
            r.name,
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
        lines += ["| " + " | ".join(cells) + " |" for cells in body]
        return "\n".join(lines)
    if fmt != "table":
        raise ValueError(f"Expected format in {FORMATS}, but got {fmt!r}")
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in body]
    return "\n".join(lines)

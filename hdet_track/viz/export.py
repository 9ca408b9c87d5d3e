"""Export the schedule the controller discovered: CSV, JSON and a ready ``LambdaLR`` snippet."""

from __future__ import annotations

import json

import numpy as np

from ..readers.base import HDETRun, schedule_label

__all__ = ["discovered_schedule", "schedule_csv", "schedule_json", "lambdalr_snippet"]


def discovered_schedule(run: HDETRun, key: str = "lr") -> tuple[np.ndarray, np.ndarray]:
    """(steps, LR): the shared base every step (the mean over replicas, whose multipliers average 1)."""
    steps, values = run.mean_series(key)
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def schedule_csv(run: HDETRun, key: str = "lr") -> str:
    steps, values = discovered_schedule(run, key)
    return "step,lr\n" + "".join(f"{int(s)},{v:.10g}\n" for s, v in zip(steps, values))


def schedule_json(run: HDETRun, key: str = "lr") -> str:
    steps, values = discovered_schedule(run, key)
    return json.dumps({"run_id": run.run_id, "key": key, "steps": steps.tolist(), "lr": values.tolist()})


def lambdalr_snippet(run: HDETRun, key: str = "lr", max_points: int = 500) -> str:
    """Python that replays the schedule with ``torch.optim.lr_scheduler.LambdaLR`` (piecewise linear
    between at most ``max_points`` knots)."""
    steps, values = discovered_schedule(run, key)
    if not len(steps):
        return "# this run has no learning-rate series to export\n"
    if len(steps) > max_points:
        idx = np.unique(np.linspace(0, len(steps) - 1, max_points).astype(int))
        steps, values = steps[idx], values[idx]
    peak = float(values.max())
    knots = ", ".join(str(int(s)) for s in steps)
    lrs = ", ".join(f"{v / peak:.8g}" for v in values)
    origin = "Discovered by HDET in" if run.schedule == "hdet" else f"The {schedule_label(run.schedule)} schedule of"
    named = " ".join(f"{run.run_id} ({run.name})".split())  # a name with a line break must not end the comment
    return f'''import bisect
import torch

# {origin} run {named}; peak LR {peak:.6g}.
BASE_LR = {peak!r}  # build the optimizer with lr=BASE_LR
KNOTS = [{knots}]
FACTORS = [{lrs}]


def hdet_schedule(step: int) -> float:
    """LambdaLR factor at optimizer step `step` (0-based); linear between knots."""
    s = step + 1
    i = bisect.bisect_left(KNOTS, s)
    if i <= 0:
        return FACTORS[0]
    if i >= len(KNOTS):
        return FACTORS[-1]
    t = (s - KNOTS[i - 1]) / (KNOTS[i] - KNOTS[i - 1])
    return FACTORS[i - 1] + t * (FACTORS[i] - FACTORS[i - 1])


# scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=hdet_schedule)
'''

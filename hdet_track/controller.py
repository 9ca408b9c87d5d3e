"""The auto-LR controller: softmax weights over replicas and the momentum update of a base value.

Pure math on Python floats; the scheduler calls it with values gathered from all replicas.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["softmax_weights", "ControllerUpdate", "controller_update"]


def softmax_weights(losses: Sequence[float], temperature: float) -> list[float]:
    """Weights of the replicas from their window losses: ``softmax((mean(L) - L_r) / temperature)``.

    Lower loss, higher weight. Subtracting the mean (and the max inside the softmax)
    changes nothing mathematically but keeps ``exp`` in range.

    Args:
        losses: finite window mean losses, one per replica taking part.
        temperature: > 0; small values approach an argmin, large ones uniform weights.

    Returns:
        Weights that are positive and sum to 1.

    Example:
        >>> softmax_weights([1.0, 1.0], 0.1)
        [0.5, 0.5]
    """
    if temperature <= 0:
        raise ValueError(f"Expected temperature > 0, but got {temperature!r}")
    if not losses:
        raise ValueError("Expected at least one loss, but got none")
    mean = math.fsum(losses) / len(losses)
    scores = [(mean - loss) / temperature for loss in losses]
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = math.fsum(exps)
    return [e / total for e in exps]


class ControllerUpdate(NamedTuple):
    """One controller decision for one target (a param group's LR, one module's dropout, ...)."""

    delta: float
    velocity: float
    base_before: float
    base_after: float
    gamma: float
    clipped: bool


def controller_update(
    values: Sequence[float],
    weights: Sequence[float],
    base: float,
    velocity: float,
    *,
    meta_lr: float,
    meta_momentum: float,
    gamma: float,
    bounds: tuple[float, float],
) -> ControllerUpdate:
    """Move ``base`` toward the values of the better replicas.

    ``delta = sum_r w_r * v_r - mean(v)``, ``velocity' = beta * velocity + (1 - beta) * delta``,
    ``base' = clip(base * (1 - gamma) + meta_lr * velocity', bounds)``.

    Args:
        values: the hyperparameter value each replica used (same order as ``weights``).
        weights: softmax weights of those replicas.
        base: the current base value.
        velocity: the current velocity.
        meta_lr: step size of the base update.
        meta_momentum: beta in [0, 1).
        gamma: per-sync decay rate in [0, 1).
        bounds: (low, high) the base is clipped to.

    Returns:
        A :class:`ControllerUpdate`.
    """
    if len(values) != len(weights) or not values:
        raise ValueError(f"Expected as many values as weights (at least one), but got {len(values)} and {len(weights)}")
    mean = math.fsum(values) / len(values)
    delta = math.fsum(w * v for w, v in zip(weights, values)) - mean
    new_velocity = meta_momentum * velocity + (1.0 - meta_momentum) * delta
    raw = base * (1.0 - gamma) + meta_lr * new_velocity
    low, high = bounds
    after = min(max(raw, low), high)
    return ControllerUpdate(delta, new_velocity, base, after, gamma, after != raw)

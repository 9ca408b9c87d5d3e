"""Pure schedule math: replica multipliers, the base decay rate and permutation streams.

Nothing here imports torch.distributed or a tracker; values in, values out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ._checks import real

__all__ = [
    "multipliers",
    "decay_gamma",
    "permutation_generator",
    "draw_permutation",
    "replica_values",
    "replica_value_table",
]


def multipliers(num_replicas: int, spread: float) -> list[float]:
    """The fan-out multipliers ``rho_r`` for ``num_replicas`` replicas.

    ``rho_r = 1 + spread * (r - (N - 1) / 2) / max((N - 1) / 2, 0.5)``: a symmetric,
    evenly spaced spread over ``[1 - spread, 1 + spread]`` whose mean is exactly 1.

    Args:
        num_replicas: N, at least 1.
        spread: alpha, in [0, 1).

    Returns:
        A list of N floats, increasing with r.

    Example:
        >>> multipliers(4, 0.3)
        [0.7, 0.9, 1.1, 1.3]
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"Expected num_replicas to be an integer >= 1, but got {num_replicas!r}")
    _check_spread("spread", spread)
    center = (num_replicas - 1) / 2
    half_width = max(center, 0.5)
    return [1.0 + spread * (r - center) / half_width for r in range(num_replicas)]


def decay_gamma(div_factor: float, final_div_factor: float, num_syncs: float) -> float:
    """The per-sync decay rate of the controller's base value.

    The base is multiplied by ``(1 - gamma)`` at each controller sync. Over the
    ``K = num_syncs`` remaining syncs this must shrink it by ``div_factor / final_div_factor``
    (the ratio OneCycle's defaults imply), so ``gamma = 1 - (div_factor / final_div_factor) ** (1 / K)``.
    The formula printed in the paper has the ratio inverted, which makes ``1 - gamma``
    larger than 1 (about 1.49 per sync with the defaults) and the LR diverge; a ratio
    at or above 1 here gives ``gamma = 0`` (no decay, never growth).

    Args:
        div_factor: OneCycle's ``div_factor`` (> 0).
        final_div_factor: OneCycle's ``final_div_factor`` (> 0).
        num_syncs: K, the number of controller syncs left; 0 or less gives no decay.

    Returns:
        gamma in [0, 1).
    """
    if div_factor <= 0 or final_div_factor <= 0:
        raise ValueError(
            f"Expected positive div_factor and final_div_factor, but got {div_factor} and {final_div_factor}"
        )
    ratio = div_factor / final_div_factor
    if num_syncs <= 0 or ratio >= 1.0:
        return 0.0
    return 1.0 - ratio ** (1.0 / num_syncs)


def permutation_generator(seed: int, stream: int) -> torch.Generator:
    """A private CPU generator for permutation stream ``stream`` (one per hyperparameter).

    Every rank builds the same generators from the same seed, so permutations agree
    across ranks without communication. The global RNG is never touched.
    """
    gen = torch.Generator(device="cpu")
    # Spread the streams apart with a large odd constant (splitmix-style) and keep it in 63 bits.
    gen.manual_seed((int(seed) + 0x9E3779B97F4A7C15 * (stream + 1)) & 0x7FFFFFFFFFFFFFFF)
    return gen


def draw_permutation(num_replicas: int, generator: torch.Generator) -> list[int]:
    """A fresh permutation of ``range(num_replicas)``; ``perm[r]`` is the multiplier index of rank r."""
    return torch.randperm(num_replicas, generator=generator).tolist()


def _check_spread(name: str, value: float) -> None:
    number = real(value)
    if number is None or not 0.0 <= number < 1.0:
        raise ValueError(f"Expected {name} in [0, 1), but got {value!r}")


def replica_values(
    base: list[float], rho: list[float], perm: list[int], replica: int, bounds: list[tuple[float, float]] | None
) -> list[float]:
    """The values replica ``replica`` uses on every target: ``base_t * rho[perm[replica]]``,
    clipped to ``bounds[t]`` when bounds are given (the LR is not clipped, only its base is)."""
    m = rho[perm[replica]]
    if bounds is None:
        return [b * m for b in base]
    return [min(max(b * m, lo), hi) for b, (lo, hi) in zip(base, bounds)]


def replica_value_table(
    bases: np.ndarray, rho: Sequence[float], perm: Sequence[int], bounds: Sequence[tuple[float, float]] | None
) -> np.ndarray:
    """:func:`replica_values` for every replica and every step at once.

    Args:
        bases: ``bases[i, t]``, the base of target t at step i.
        rho, perm, bounds: as for :func:`replica_values`.

    Returns:
        ``values[r, i, t]``, equal (bit for bit) to ``replica_values(bases[i], rho, perm, r, bounds)[t]``.
    """
    mults = np.array([rho[p] for p in perm], dtype=np.float64)
    values = mults[:, None, None] * np.asarray(bases, dtype=np.float64)[None, :, :]
    if bounds is not None:
        low = np.array([lo for lo, _ in bounds], dtype=np.float64)
        high = np.array([hi for _, hi in bounds], dtype=np.float64)
        values = np.minimum(np.maximum(values, low), high)
    return values

"""Warm noisy initialisation: make replicas start apart on purpose."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from . import collectives

__all__ = ["warm_noisy_init"]


def warm_noisy_init(
    model: nn.Module,
    nu: float = 0.01,
    generator: torch.Generator | None = None,
    *,
    seed: int = 0,
    process_group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """Add ``N(0, nu^2 * ||theta||^2 / d)`` noise to every parameter tensor theta of ``model``.

    d is the tensor's number of elements, so the noise is ``nu`` times the tensor's RMS.
    Without ``generator`` the noise comes from a private CPU generator seeded with
    ``(seed, rank)``: different on every rank, reproducible, and the global RNG is untouched.

    Args:
        model: the module, changed in place.
        nu: relative noise level, >= 0.
        generator: a CPU generator to draw from instead.
        seed: seeds the private generator (ignored when ``generator`` is given).
        process_group: where the rank is read from.

    Returns:
        ``model``.

    Example:
        >>> warm_noisy_init(model, nu=0.01)
    """
    if isinstance(nu, bool) or not isinstance(nu, (int, float)) or not math.isfinite(nu) or nu < 0:
        raise ValueError(f"Expected nu >= 0, but got {nu!r}")
    if generator is None:
        rank, _ = collectives.world(process_group)
        generator = torch.Generator(device="cpu")
        generator.manual_seed((int(seed) * 1_000_003 + 7919 * (rank + 1)) & 0x7FFFFFFFFFFFFFFF)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            std = nu * float(p.detach().double().norm()) / math.sqrt(p.numel())
            if std == 0.0:
                continue
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
            p.add_(noise.to(device=p.device, dtype=p.dtype), alpha=std)
    return model

"""The project's own error types."""

from __future__ import annotations

__all__ = ["HDETError", "NonFiniteReplicasError", "CheckpointMismatchError"]


class HDETError(RuntimeError):
    """Base class for failures raised by hdet-track itself (not for bad arguments)."""


class NonFiniteReplicasError(HDETError):
    """Every replica had a non-finite window loss or non-finite parameters at a sync."""

    def __init__(self, step: int, world_size: int, window_losses: list[float]) -> None:
        self.step = step
        self.world_size = world_size
        self.window_losses = window_losses
        super().__init__(
            f"All {world_size} replicas are non-finite at step {step} (window losses "
            f"{window_losses}); there is no healthy replica to reset them from. If the "
            "training loop shares gradients (DDP), one replica's NaN reaches every replica "
            "at the next step, before any sync: lower max_lr or spread, or clip gradients."
        )


class CheckpointMismatchError(HDETError):
    """A scheduler checkpoint does not fit the job that loads it."""

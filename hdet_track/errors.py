"""The project's own error types."""

from __future__ import annotations

__all__ = ["HDETError", "NonFiniteReplicasError", "CheckpointMismatchError"]


class HDETError(RuntimeError):
    """Base class for failures raised by hdet-track itself (not for bad arguments)."""


class NonFiniteReplicasError(HDETError):
    """No replica was healthy at a sync (non-finite, or blown up by the drift controller's guards)
    and there was nothing to restore (no kept consensus, or ``max_rollbacks`` rollbacks in a row).

    Attributes: ``step``, ``world_size``, ``window_losses``, ``reasons`` (one per replica) and
    ``rollbacks`` (the rollbacks in a row before this one was refused; None without a rollback).
    """

    def __init__(
        self,
        step: int,
        world_size: int,
        window_losses: list[float],
        reasons: list[str] | None = None,
        rollbacks: int | None = None,
    ) -> None:
        self.step = step
        self.world_size = world_size
        self.window_losses = window_losses
        self.reasons = list(reasons) if reasons else ["non-finite"] * world_size
        self.rollbacks = rollbacks
        if all(r == "non-finite" for r in self.reasons):
            what = "non-finite"
            hint = (
                "If the training loop shares gradients (DDP), one replica's NaN reaches every replica "
                "at the next step, before any sync: lower max_lr or spread, or clip gradients."
            )
        else:
            what = "unhealthy (" + "; ".join(dict.fromkeys(self.reasons)) + ")"
            hint = "Lower max_lr or spread, or raise the controller's max_rollbacks."
        after = "" if rollbacks is None else f" after {rollbacks} rollbacks in a row (max_rollbacks)"
        super().__init__(
            f"All {world_size} replicas are {what} at step {step} (window losses {window_losses}){after}; "
            f"there is no healthy replica to reset them from. {hint}"
        )


class CheckpointMismatchError(HDETError):
    """A scheduler checkpoint does not fit the job that loads it."""


def needs_extra(feature: str, package: str, extra: str) -> str:
    """The text of the ImportError for a feature whose optional dependency is missing: what to
    install, from PyPI and as hdet-track's extra (hdet-track installs from a clone)."""
    return (
        f"{feature} needs {package}: pip install {package} "
        f"(or hdet-track's '{extra}' extra: pip install -e '.[{extra}]' in a clone of hdet-track)"
    )

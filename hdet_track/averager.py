"""The converge step: average the replicas, repair the ones left out, roll back to the last good consensus.

A stateful averager over the stateless flat-bucket collectives of :mod:`hdet_track.collectives`,
the way torch keeps ``PeriodicModelAverager`` over ``average_parameters``. It knows nothing of
learning rates or controllers: the scheduler tells it who is healthy.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import collectives

__all__ = ["ReplicaAverager"]

logger = logging.getLogger(__name__)


class ReplicaAverager:
    """Averages ``tensors()`` (parameters and buffers) across the replicas of ``group``.

    Args:
        tensors: returns the tensors to average (looked up at each sync).
        optimizer: whose state is cleared on a replica that is reset.
        group: the process group (default: the default group, or a world of one).
        keep_consensus: keep a copy of the last good consensus (the tensors when the averager is
            built, then after every sync) for :meth:`restore`.
    """

    def __init__(
        self,
        tensors: Callable[[], list[torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        group: dist.ProcessGroup | None = None,
        keep_consensus: bool = False,
    ) -> None:
        self.tensors = tensors
        self.optimizer = optimizer
        self.group = group
        self.rank, self.world_size = collectives.world(group)
        self.keep_consensus = keep_consensus
        self._buckets: list[collectives.Bucket] = []
        self._consensus: list[torch.Tensor] | None = None
        self._state_said = False  # average_optimizer_state() warned that it could not
        if keep_consensus:
            self._consensus = [b.flat.clone() for b in collectives.make_buckets(tensors())]

    def local_finite(self) -> bool:
        """Flatten this replica's tensors for the sync; whether every floating value is finite."""
        self._buckets = collectives.make_buckets(self.tensors())
        return collectives.buckets_finite(self._buckets)

    def average(self, healthy: list[bool], measure: bool = False) -> float:
        """Average the healthy replicas into every replica (one ``all_reduce`` per bucket).

        A replica that is not healthy contributes nothing, receives the average of the others and
        loses its optimizer state (its moments belong to the parameters it just lost). Returns this
        replica's relative distance to the average before averaging (nan unless ``measure``).
        """
        ok = sum(healthy)
        if ok == 0:
            raise ValueError("Expected at least one healthy replica to average, but got none")
        divergence = 0.0 if self.world_size == 1 else math.nan
        if self.world_size > 1:
            d_sq, norm_sq = collectives.average_buckets(
                self._buckets, self.group, contribute=healthy[self.rank], num_contributors=ok, measure=measure
            )
            if measure:
                divergence = collectives.relative_divergence(d_sq, norm_sq)
        if not healthy[self.rank]:
            self.optimizer.state.clear()
        if self._consensus is not None:
            for saved, b in zip(self._consensus, self._buckets):
                saved.copy_(b.flat)
        self._buckets = []
        return divergence

    @property
    def has_consensus(self) -> bool:
        return self._consensus is not None

    def restore(self) -> None:
        """Every replica back to the last good consensus, optimizer state cleared (a rollback)."""
        if self._consensus is None:
            raise RuntimeError("Expected a kept consensus to restore, but keep_consensus is off")
        buckets = collectives.make_buckets(self.tensors())
        if [b.flat.shape for b in buckets] != [c.shape for c in self._consensus]:
            raise RuntimeError("The model's tensors changed shape since the consensus was kept; cannot roll back")
        with torch.no_grad():
            for saved, b in zip(self._consensus, buckets):
                b.flat.copy_(saved)
                b.copy_back()
        self.optimizer.state.clear()
        self._buckets = []

    def average_optimizer_state(self) -> None:
        """Average the optimizer's state (momentum buffers, Adam's moments: every floating tensor of
        one or more dimensions) across the replicas, so that one replica's state stands for all (a
        checkpoint written by rank 0 alone). Only where every replica holds state of the same layout
        (one small gather tells) and none of it is quantized (8-bit moments: integer codes beside
        float scales); otherwise nothing is averaged, and a warning says so once. A collective:
        every rank calls it at the same point."""
        if self.world_size == 1:
            return
        tensors, layout, quantized = [], [], False
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in sorted(self.optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        quantized = quantized or not value.is_floating_point()
                        tensors.append(value)
                        layout.append((str(key), tuple(value.shape), str(value.dtype)))
        layouts = collectives.all_gather_objects((quantized, layout), self.group)
        if quantized or any(other != (quantized, layout) for other in layouts):
            if not self._state_said:
                self._state_said = True
                warnings.warn(
                    "hdet-track could not average the optimizer's state at sync_now(): the replicas hold it in "
                    "different layouts (one the guard reset has none yet) or quantized, so one rank's optimizer "
                    "state is not every rank's; save every rank's optimizer state for an exact resume",
                    UserWarning,
                    stacklevel=3,
                )
            return
        if tensors:  # (SGD without momentum has none, on every replica)
            with torch.no_grad():
                collectives.average_buckets(collectives.make_buckets(tensors), self.group)

    def state_dict(self) -> dict:
        return {"consensus": None if self._consensus is None else [c.clone() for c in self._consensus]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("consensus")
        if saved is not None and self._consensus is not None:
            if [s.shape for s in saved] != [c.shape for c in self._consensus]:
                raise ValueError("Expected a kept consensus of this model's shape in the checkpoint, but it differs")
            for mine, theirs in zip(self._consensus, saved):
                mine.copy_(theirs)

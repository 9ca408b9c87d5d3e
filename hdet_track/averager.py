"""The converge step: average the replicas, repair the ones left out, roll back to the last good consensus.

A stateful averager over the stateless flat-bucket collectives of :mod:`hdet_track.collectives`,
the way torch keeps ``PeriodicModelAverager`` over ``average_parameters``. It knows nothing of
learning rates or controllers: the scheduler tells it who is healthy.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import collectives

__all__ = ["ReplicaAverager", "innermost_optimizer"]

logger = logging.getLogger(__name__)


class ReplicaAverager:
    """Averages ``tensors()`` (parameters and buffers) across the replicas of ``group``.

    Args:
        tensors: returns the tensors to average (looked up at each sync).
        optimizer: whose state is cleared on a replica that is reset.
        group: the process group (default: the default group, or a world of one).
        keep_consensus: keep a copy of the last good consensus (the tensors right before the
            optimizer's first step, so weights loaded after the scheduler was built count; then
            after every sync) for :meth:`restore`.
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
        # said (once) at the first restore: what a rollback cannot restore (the scheduler's model=)
        self.restore_note: str | None = None
        self._layout: list[tuple[torch.Size, torch.dtype]] | None = None  # the buckets' (size, dtype), once known
        self.layout_problem: str | None = None  # set by local_finite(): this rank's tensors changed
        found = tensors()
        lazy = [i for i, t in enumerate(found) if isinstance(t, torch.nn.parameter.UninitializedTensorMixin)]
        # buffers that hold inf from the start (an additive -inf attention mask): inf is their value there
        self._inf_ok = {i for i, t in enumerate(found) if i not in lazy and not _trained(t) and _has_inf(t)}
        if keep_consensus:
            if lazy:
                raise ValueError(
                    f"Expected initialised parameters to keep a consensus of, but {len(lazy)} are lazy "
                    "(nn.LazyLinear...): run one forward pass before building HDETScheduler"
                )
            self._take_consensus(found)
            me = weakref.ref(self)  # the optimizer's hook does not keep a replaced scheduler alive
            self._first_step = innermost_optimizer(optimizer).register_step_pre_hook(
                lambda *_: (a := me()) is not None and a._keep_start()
            )

    def _take_consensus(self, tensors: list[torch.Tensor]) -> None:
        buckets = collectives.make_buckets(tensors)
        self._consensus = [b.flat.clone() for b in buckets]
        self._layout = [(b.flat.shape, b.flat.dtype) for b in buckets]

    def _keep_start(self) -> None:
        """Right before the optimizer's first step: the consensus is the weights training starts
        from (loaded into the model after the scheduler was built, say), unless a checkpoint of a
        job that had stepped gave one. (The hook is removed at the first sync: not from inside the
        optimizer's hook loop.)"""
        if self._consensus is not None and not self._loaded and not self._stepped:
            self._take_consensus(self.tensors())
        self._stepped = True

    def _forget_start(self) -> None:
        if self._first_step is not None:
            self._first_step.remove()
            self._first_step = None
        self._stepped = True

    _loaded = False  # load_state_dict() gave the consensus
    _stepped = False  # the optimizer has stepped (or a sync came): the consensus is training's own
    _first_step: torch.utils.hooks.RemovableHandle | None = None

    def local_finite(self) -> bool:
        """Flatten this replica's tensors for the sync; whether it is finite: every value, except
        the inf a buffer held from the start (an additive -inf attention mask), where NaN is still
        not. Sets :attr:`layout_problem` when the tensors changed dtype or size since they were
        first seen (the converge step raises it on every rank at once: raising here would leave
        the other ranks waiting in the sync's gather)."""
        tensors = self.tensors()
        self._buckets = collectives.make_buckets(tensors)
        layout = [(b.flat.shape, b.flat.dtype) for b in self._buckets]
        if self._layout is None:
            self._layout = layout
        self.layout_problem = None
        if layout != self._layout:
            self.layout_problem = (
                f"its tensors are now {[str(d) for _, d in layout]} of sizes {[s.numel() for s, _ in layout]}, "
                f"where they were {[str(d) for _, d in self._layout]} of sizes {[s.numel() for s, _ in self._layout]}"
            )
        return collectives.buckets_finite(self._buckets) or all(
            _finite(t, i in self._inf_ok) for i, t in enumerate(tensors)
        )

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
        self._forget_start()
        if not healthy[self.rank]:
            self.optimizer.state.clear()
        if self._consensus is not None and (
            collectives.buckets_finite(self._buckets)
            or all(_finite(t, i in self._inf_ok) for i, t in enumerate(self.tensors()))
        ):  # (an average of finite replicas that is not, kept, would be restored by every rollback)
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
        self._forget_start()
        buckets = collectives.make_buckets(self.tensors())
        if [b.flat.shape for b in buckets] != [c.shape for c in self._consensus]:
            raise RuntimeError("The model's tensors changed shape since the consensus was kept; cannot roll back")
        with torch.no_grad():
            for saved, b in zip(self._consensus, buckets):
                b.flat.copy_(saved)
                b.copy_back()
        self.optimizer.state.clear()
        self._buckets = []
        if self.restore_note:
            logger.warning("hdet-track: %s", self.restore_note)
            self.restore_note = None

    def average_optimizer_state(self) -> None:
        """Average the optimizer's state (momentum buffers, Adam's moments: every floating tensor of
        one or more dimensions) across the replicas, so that one replica's state stands for all (a
        checkpoint written by rank 0 alone); a count (Adam's ``step``, restarted on a replica the
        guard reset; an integer) becomes the highest of the replicas', and another 0-dim value (the
        moments of a scalar parameter: a learnable temperature) their mean. Only where every replica holds state of
        the same layout (one small gather tells, and brings the counts: a CPU step tensor never meets
        an nccl all_reduce) and none of it is quantized or sparse (8-bit moments: integer codes
        beside float scales); otherwise nothing is averaged, and a warning says so once. A
        collective: every rank calls it at the same point."""
        if self.world_size == 1:
            return
        tensors, scalars, layout, quantized = [], [], [], False
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in sorted(self.optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                    if not isinstance(value, torch.Tensor) or value.dtype == torch.bool:
                        continue
                    layout.append((str(key), tuple(value.shape), str(value.dtype)))
                    if value.dim() == 0:  # gathered as numbers: a CPU step tensor never meets an nccl all_reduce
                        scalars.append((value, key == "step" or not value.is_floating_point()))
                        continue
                    quantized = quantized or value.is_sparse or not value.is_floating_point()
                    tensors.append(value)
        gathered = collectives.all_gather_objects((quantized, layout, [float(v) for v, _ in scalars]), self.group)
        if quantized or any(other[:2] != (quantized, layout) for other in gathered):
            if not self._state_said:
                self._state_said = True
                warnings.warn(
                    "hdet-track could not average the optimizer's state at sync_now(): the replicas hold it in "
                    "different layouts (one the guard reset has none yet), quantized or sparse, so one rank's optimizer "
                    "state is not every rank's; save every rank's optimizer state for an exact resume",
                    UserWarning,
                    stacklevel=3,
                )
            return
        if tensors:  # (SGD without momentum has none, on every replica)
            with torch.no_grad():
                collectives.average_buckets(collectives.make_buckets(tensors), self.group)
        for i, (value, count) in enumerate(scalars):
            values = [other[2][i] for other in gathered]
            value.fill_(max(values) if count else sum(values) / len(values))

    def state_dict(self) -> dict:
        return {
            "consensus": None if self._consensus is None else [c.clone() for c in self._consensus],
            "stepped": self._stepped,  # before any step the consensus is the weights it was built with
            "layout": _LAYOUT,
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("consensus")
        if saved is not None and self._consensus is not None:
            self._loaded = bool(state.get("stepped", True))  # else the first step takes it, as in a fresh job
            if [s.shape for s in saved] != [c.shape for c in self._consensus]:
                if int(state.get("layout", 1)) < _LAYOUT:  # before 0.2.x's: only the model's, not what the
                    # optimizer trains beside it (with model=); the first step keeps a fresh one
                    logger.warning(
                        "hdet-track: the checkpoint's kept consensus is an older version's, of fewer tensors "
                        "(the optimizer's parameters outside model= are averaged now): the first step keeps a new one"
                    )
                    self._loaded = False
                    return
                raise ValueError("Expected a kept consensus of this model's shape in the checkpoint, but it differs")
            for mine, theirs in zip(self._consensus, saved):
                mine.copy_(theirs)


# what a kept consensus holds: 2, the model's tensors and the optimizer's parameters outside it (1: not those)
_LAYOUT = 2


def _trained(t: torch.Tensor) -> bool:
    """A parameter, or a tensor the optimizer trains (not a buffer)."""
    return isinstance(t, torch.nn.Parameter) or t.requires_grad


def _has_inf(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and bool(torch.isinf(t).any())


def _finite(t: torch.Tensor, inf_ok: bool = False) -> bool:
    """Finite everywhere; free of NaN where ``inf_ok`` (a buffer that held inf from the start)."""
    if not (t.is_floating_point() or t.is_complex()):
        return True
    return not bool(torch.isnan(t).any()) if inf_ok else bool(torch.isfinite(t).all())


def innermost_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer a wrapper (accelerate's ``AcceleratedOptimizer``, which never ran
    ``Optimizer.__init__``) holds as ``.optimizer``; ``optimizer`` itself otherwise."""
    seen = {id(optimizer)}
    while isinstance(inner := getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and id(inner) not in seen:
        optimizer = inner
        seen.add(id(optimizer))
    return optimizer

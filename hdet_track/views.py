"""What :class:`~hdet_track.scheduler.HDETScheduler` shows of itself (a mixin, read-only): its
replicas, the controller, the explored hyperparameters and their values at the current step (the
shared base of each, what each replica uses) and what plain OneCycleLR would give.

It expects the scheduler's ``_rank``, ``_world_size``, ``_fanout`` (:class:`~hdet_track.fanout.FanOut`),
``_controller``, ``_lr_bounds`` and ``_onecycle`` (plain OneCycle's LRs at the current step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .controller import Controller, PaperController

if TYPE_CHECKING:
    from .fanout import FanOut

__all__ = ["Views"]


class Views:
    """The public views of :class:`~hdet_track.scheduler.HDETScheduler` (a mixin)."""

    _rank: int
    _world_size: int
    _fanout: FanOut
    _controller: Controller | None
    _lr_bounds: list[tuple[float, float]]
    _onecycle: list[float]

    @property
    def rank(self) -> int:
        """This replica's rank in the process group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """N, the number of replicas."""
        return self._world_size

    @property
    def explored_names(self) -> list[str]:
        """``"lr"`` followed by the names of the other explored hyperparameters."""
        return list(self._fanout.names)

    @property
    def controller(self) -> Controller | None:
        """The auto-LR controller (None with ``auto_lr=False``)."""
        return self._controller

    @property
    def gamma(self) -> float:
        """The paper controller's per-sync decay rate of the base LR (0 for other controllers)."""
        return self._controller.gamma["lr"] if isinstance(self._controller, PaperController) else 0.0

    @property
    def lr_bounds(self) -> list[tuple[float, float]]:
        """The bounds the paper controller keeps each param group's base LR in."""
        return list(self._lr_bounds)

    def multiplier(self, name: str = "lr") -> float:
        """This rank's current multiplier of hyperparameter ``name``."""
        return self._fanout.multiplier(self._explored(name), self._rank)

    def base_values(self, name: str = "lr") -> list[float]:
        """The shared base of ``name`` per target at the current step."""
        name = self._explored(name)
        refs = self._onecycle if name == "lr" else self._fanout.references[name]
        if self._controller is None:
            return list(refs)
        return [self._controller.base(name, t, ref) for t, ref in enumerate(refs)]

    def replica_values(self, name: str = "lr") -> list[list[float]]:
        """``values[r][t]``: the value of ``name`` replica r uses on target t right now."""
        bases = self.base_values(name)
        return [self._fanout.values(name, bases, r) for r in range(self._world_size)]

    def _explored(self, name: str) -> str:
        if name not in self._fanout.names:
            raise ValueError(f"Expected name to be one of explored_names {self._fanout.names}, but got {name!r}")
        return name

    def onecycle_lrs(self) -> list[float]:
        """What plain OneCycleLR gives each param group at the current step."""
        return list(self._onecycle)

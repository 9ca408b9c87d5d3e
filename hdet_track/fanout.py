"""The fan-out: which multiplier of each explored hyperparameter each replica uses.

Per explored name (``"lr"`` first, then the :mod:`hdet_track.explore` hyperparameters) a
:class:`FanOut` keeps the N multipliers (a symmetric spread, :func:`~hdet_track.schedule.multipliers`),
the current permutation (replica r uses multiplier ``perm[r]``) and the private generator that
re-shuffles it at each sync (the converge step draws the next permutation; every rank draws the
same). Given the shared bases it says what each replica uses. The permutations and generators are
part of the scheduler's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .explore import Hyperparam
from .names import series_key
from .record import ExploredSpec
from .schedule import multipliers, permutation_generator, replica_values

__all__ = ["FanOut"]


class FanOut:
    """Multipliers, permutations and permutation generators of every explored hyperparameter.

    Args:
        lr_spread: the LR's spread alpha in [0, 1).
        explore: the other explored hyperparameters (their spreads, bounds and starting values).
        num_groups: the optimizer's param groups (the LR's targets).
        world_size: N, the replicas.
        seed: seeds the generators (the same on every rank, so permutations agree without communication).
    """

    def __init__(
        self, lr_spread: float, explore: Sequence[Hyperparam], num_groups: int, world_size: int, seed: int
    ) -> None:
        self.hyperparams = {hp.name: hp for hp in explore}
        self.names = ["lr", *self.hyperparams]
        self.num_groups = num_groups
        self.spreads = {"lr": float(lr_spread)} | {hp.name: hp.spread for hp in explore}
        self.multipliers = {name: multipliers(world_size, s) for name, s in self.spreads.items()}
        self.references = {hp.name: hp.read() for hp in explore}  # the explored values' starting bases
        self.perm = {name: list(range(world_size)) for name in self.names}  # rank r starts on multiplier r
        self.generators = {name: permutation_generator(seed, i) for i, name in enumerate(self.names)}

    @property
    def spreading(self) -> bool:
        """Whether any hyperparameter is spread (the replicas differ)."""
        return any(s > 0 for s in self.spreads.values())

    def multiplier(self, name: str, rank: int) -> float:
        return self.multipliers[name][self.perm[name][rank]]

    def bounds(self, name: str) -> list[tuple[float, float]] | None:
        """What replica values of ``name`` are clipped to (the LR is not clipped, only its base)."""
        return None if name == "lr" else [self.hyperparams[name].bounds] * len(self.references[name])

    def num_targets(self) -> dict[str, int]:
        return {"lr": self.num_groups} | {k: len(v) for k, v in self.references.items()}

    def values(self, name: str, bases: Sequence[float], rank: int) -> list[float]:
        """What replica ``rank`` uses of ``name`` on each target, given the shared ``bases``."""
        return replica_values(bases, self.multipliers[name], self.perm[name], rank, self.bounds(name))

    def write(self, bases: Callable[[str], Sequence[float]], rank: int | None) -> None:
        """Set replica ``rank``'s values of the explored hyperparameters other than the LR (``None``:
        the shared bases themselves, within their bounds)."""
        for name, hp in self.hyperparams.items():
            if rank is None:
                low, high = hp.bounds
                hp.write([min(max(b, low), high) for b in bases(name)])
            else:
                hp.write(self.values(name, bases(name), rank))

    def series_keys(self, name: str) -> list[str]:
        if name == "lr":
            return [series_key("lr", g, f"pg{g}") for g in range(self.num_groups)]
        return [series_key(name, t, label) for t, label in enumerate(self.hyperparams[name].labels())]

    def specs(self, lr_bounds: Sequence[tuple[float, float]]) -> list[ExploredSpec]:
        """What the run's trackers are told about each explored hyperparameter."""
        return [
            ExploredSpec(
                name=name,
                spread=self.spreads[name],
                multipliers=list(self.multipliers[name]),
                targets=[f"pg{g}" for g in range(self.num_groups)] if name == "lr" else self.hyperparams[name].labels(),
                series_keys=self.series_keys(name),
                bounds=list(lr_bounds) if name == "lr" else self.bounds(name),
                clipped=name != "lr",
            )
            for name in self.names
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "permutations": {k: list(v) for k, v in self.perm.items()},
            "generators": {k: g.get_state() for k, g in self.generators.items()},
            # the explored values' starting bases, as read when the job began (a scheduler built after
            # the optimizer's state was loaded would read this rank's own values instead)
            "references": {k: list(v) for k, v in self.references.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.perm = {k: list(v) for k, v in state["permutations"].items()}
        for name, values in state.get("references", {}).items():
            if name in self.references and len(values) == len(self.references[name]):
                self.references[name] = [float(v) for v in values]
        for name, gen_state in state["generators"].items():
            # torch.load(map_location="cuda") moves every tensor, but a CPU generator's state must be
            # a CPU ByteTensor
            self.generators[name].set_state(gen_state.detach().to("cpu", torch.uint8))

"""Explored hyperparameters other than the learning rate.

Each explored hyperparameter has one or more *targets* (a param group, a module, a setter),
a base value per target, its own spread, bounds and permutation stream. Replica r uses
``clip(base * rho_{pi(r)}, bounds)`` on every target.

Example:
    >>> from hdet_track import explore
    >>> hps = [explore.param_group("weight_decay", spread=0.5),
    ...        explore.dropout(model, spread=0.3),
    ...        explore.module_attr("label_smoothing", loss_fn, "label_smoothing", spread=0.2,
    ...                            bounds=(0.0, 0.5))]
    >>> sched = HDETScheduler(opt, 0.1, total_steps=1000, spread=0.2, explore=hps)

A mapping works too: ``explore={"weight_decay": 0.5, "momentum": {"spread": 0.1, "bounds": (0.5, 0.99)}}``
(names of optimizer param-group keys; ``"betas.0"`` / ``"betas.1"`` address Adam's betas; a
momentum that OneCycle cycles, ``momentum`` or ``betas.0``, needs ``cycle_momentum=False``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._checks import real
from .names import check_name
from .schedule import _check_spread

__all__ = [
    "Hyperparam",
    "ParamGroupKey",
    "ModuleAttr",
    "Setter",
    "param_group",
    "dropout",
    "module_attr",
    "setter",
    "resolve_explore",
]

DROPOUT_TYPES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)
# What OneCycleLR keeps in the param groups to compute the schedule: not hyperparameters to explore.
_SCHEDULE_KEYS = {"lr", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum"}
# Keys whose values must stay below 1 (momentum coefficients, probabilities).
_UNIT_KEYS = {"momentum", "betas.0", "betas.1", "dampening", "alpha", "rho"}


class Hyperparam:
    """Base class of an explored scalar hyperparameter.

    Subclasses resolve their targets in :meth:`bind` and read and write one float per target.
    """

    def __init__(self, name: str, spread: float, bounds: tuple[float, float] | None = None) -> None:
        check_name(name)
        _check_spread(f"explore[{name!r}] spread", spread)
        self.name = name
        self.spread = float(spread)
        self._bounds_arg = bounds
        self.bounds: tuple[float, float] = (0.0, math.inf)

    # -- to implement -------------------------------------------------------
    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        """Resolve the targets; raise ``ValueError`` when nothing matches."""
        raise NotImplementedError

    def labels(self) -> list[str]:
        """A short label per target (for logs and events)."""
        raise NotImplementedError

    def read(self) -> list[float]:
        """The current value of every target."""
        raise NotImplementedError

    def write(self, values: Sequence[float]) -> None:
        """Set every target to its value."""
        raise NotImplementedError

    def default_bounds(self) -> tuple[float, float]:
        return (0.0, math.inf)

    def targets(self) -> list[tuple[tuple[Any, ...], str]]:
        """What each target writes to, ((object id, key), description): two explored hyperparameters
        must not write to the same one (empty where it cannot be told: a setter)."""
        return []

    # -- shared -------------------------------------------------------------
    def _finish_bind(self) -> None:
        bounds = self._bounds_arg if self._bounds_arg is not None else self.default_bounds()
        try:
            low, high = (float(b) for b in bounds)
        except (TypeError, ValueError):
            raise ValueError(f"Expected explore[{self.name!r}] bounds as (low, high), but got {bounds!r}") from None
        if not low < high:
            raise ValueError(f"Expected explore[{self.name!r}] bounds with low < high, but got {bounds!r}")
        self.bounds = (low, high)
        values = self.read()
        if self.spread > 0 and values and all(v == 0 for v in values):
            raise ValueError(
                f"Expected explore[{self.name!r}] to start from a nonzero value, but it is 0 in "
                f"{', '.join(self.labels())}: the spread multiplies the base value, so every replica would "
                f"keep 0; set a nonzero {self.name} (e.g. in the optimizer) to explore it"
            )
        for label, value in zip(self.labels(), values):
            if not low <= value <= high:
                raise ValueError(
                    f"Expected explore[{self.name!r}] bounds {self.bounds} to contain the base "
                    f"value {value} of {label}, but they exclude it"
                )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, spread={self.spread}, bounds={self.bounds})"


def _set_scalar(container: dict[str, Any], key: str, value: float) -> None:
    current = container[key]
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    else:
        container[key] = value


class ParamGroupKey(Hyperparam):
    """A key of every optimizer param group (``weight_decay``, ``momentum``, ``betas.0``, ...)."""

    def __init__(
        self,
        key: str,
        spread: float,
        bounds: tuple[float, float] | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name or key, spread, bounds)
        key_name, _, index = key.partition(".")
        if key_name in _SCHEDULE_KEYS:
            raise ValueError(
                f"Expected explore key {key!r} to be a hyperparameter the optimizer reads, but it is one of "
                f"OneCycle's own schedule keys {sorted(_SCHEDULE_KEYS)}: the LR is explored by spread="
            )
        self.key = key
        self._key = key_name
        self._index = int(index) if index.isdigit() else None
        if index and self._index is None:
            raise ValueError(f"Expected a param-group key such as 'weight_decay' or 'betas.1', but got {key!r}")
        self._optimizer: torch.optim.Optimizer | None = None

    @property
    def _groups(self) -> list[dict[str, Any]]:
        # Looked up live: optimizer.load_state_dict() replaces the group dicts.
        return self._optimizer.param_groups if self._optimizer is not None else []

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        missing = [i for i, g in enumerate(groups) if self._key not in g]
        if missing and len(missing) < len(groups):  # some groups hold it: say which lack it
            raise ValueError(
                f"Expected explore key {self.key!r} in every param group of {type(optimizer).__name__}, but "
                f"param group(s) {missing} lack it (of {len(groups)}); give them the key, or explore it with a Setter"
            )
        if missing:
            known = sorted(k for k, v in groups[0].items() if k != "params")
            raise ValueError(
                f"Expected explore key {self.key!r} to name a param-group key of "
                f"{type(optimizer).__name__}, but it matches nothing; known keys: {known}"
            )
        if self._key == "params":
            raise ValueError(
                f"Expected explore key {self.key!r} to be a hyperparameter, but 'params' holds the tensors"
            )
        for i, g in enumerate(groups):
            value = g[self._key]
            if self._index is None and isinstance(value, (tuple, list)):
                raise ValueError(
                    f"Expected explore key {self.key!r} to be a scalar, but it is a tuple; "
                    f"use '{self._key}.0' or '{self._key}.1'"
                )
            if self._index is not None and (not isinstance(value, (tuple, list)) or self._index >= len(value)):
                raise ValueError(
                    f"Expected explore key {self.key!r} to index a tuple, but "
                    f"param_groups[...][{self._key!r}] is {value!r}"
                )
            scalar = value if self._index is None else value[self._index]
            if real(scalar) is None:
                raise ValueError(
                    f"Expected explore key {self.key!r} to be a real number in every param group, but "
                    f"param_groups[{i}][{self._key!r}] is {value!r}"
                )
        self._optimizer = optimizer
        self._finish_bind()

    def labels(self) -> list[str]:
        return [f"pg{i}" for i in range(len(self._groups))]

    def targets(self) -> list[tuple[tuple[Any, ...], str]]:
        return [
            ((id(self._optimizer), i, self.key), f"param_groups[{i}][{self.key!r}]") for i in range(len(self._groups))
        ]

    def read(self) -> list[float]:
        out = []
        for g in self._groups:
            value = g[self._key] if self._index is None else g[self._key][self._index]
            out.append(float(value))
        return out

    def write(self, values: Sequence[float]) -> None:
        for g, value in zip(self._groups, values):
            if self._index is None:
                _set_scalar(g, self._key, value)
            else:
                entries = list(g[self._key])
                entries[self._index] = value
                g[self._key] = tuple(entries)

    def default_bounds(self) -> tuple[float, float]:
        return (0.0, 1.0 - 1e-6) if self.key in _UNIT_KEYS else (0.0, math.inf)


class ModuleAttr(Hyperparam):
    """A float attribute of every submodule of ``module`` that is an instance of ``types``."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        attr: str,
        spread: float,
        bounds: tuple[float, float] | None = None,
        types: type | tuple[type, ...] | None = None,
    ) -> None:
        super().__init__(name, spread, bounds)
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"Expected explore[{name!r}] module to be a torch.nn.Module, but got {type(module).__name__}"
            )
        self.module = module
        self.attr = attr
        self.types = types
        self._targets: list[tuple[str, nn.Module]] = []

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        found = []
        for mod_name, mod in self.module.named_modules():
            if self.types is not None and not isinstance(mod, self.types):
                continue
            value = getattr(mod, self.attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found.append((mod_name or type(mod).__name__, mod))
                if isinstance(value, int) and not isinstance(mod, DROPOUT_TYPES):  # a dropout's p=0 is a float's 0
                    raise ValueError(
                        f"Expected explore[{self.name!r}] attribute {self.attr!r} to be a float, but "
                        f"{found[-1][0]} ({type(mod).__name__}) holds the int {value!r}: each replica gets a "
                        "multiple of it (1.5, 2.5, ...), which an integer setting (a width, a count) cannot take"
                    )
        if not found:
            what = f"instances of {self.types}" if self.types is not None else "submodules"
            raise ValueError(
                f"Expected explore[{self.name!r}] to find {what} with a float attribute "
                f"{self.attr!r} in {type(self.module).__name__}, but it matches nothing"
            )
        self._targets = found
        self._finish_bind()

    def labels(self) -> list[str]:
        return [name for name, _ in self._targets]

    def read(self) -> list[float]:
        return [float(getattr(mod, self.attr)) for _, mod in self._targets]

    def write(self, values: Sequence[float]) -> None:
        for (_, mod), value in zip(self._targets, values):
            setattr(mod, self.attr, value)

    def targets(self) -> list[tuple[tuple[Any, ...], str]]:
        return [((id(mod), self.attr), f"{type(mod).__name__}.{self.attr}") for _, mod in self._targets]

    def default_bounds(self) -> tuple[float, float]:
        # a probability: the p of dropout modules, or of the types given (a dropout class of the user's)
        kinds = {self.types is not None or isinstance(mod, DROPOUT_TYPES) for _, mod in self._targets}
        if self.attr == "p" and kinds == {True, False}:
            others = sorted({type(mod).__name__ for _, mod in self._targets if not isinstance(mod, DROPOUT_TYPES)})
            raise ValueError(
                f"Expected explore[{self.name!r}] to find one kind of 'p', but it matches dropout modules (a "
                f"probability, within (0, 1)) and {others} (not one): pass types= to pick one kind, or bounds="
            )
        if self.attr == "p" and kinds == {True}:
            return (0.0, 1.0 - 1e-6)  # a probability, never 1 (a replica that trains nothing, silently)
        return (0.0, math.inf)


class Setter(Hyperparam):
    """A user-provided getter/setter pair (a single target)."""

    def __init__(
        self,
        name: str,
        get: Callable[[], float],
        set: Callable[[float], None],  # noqa: A002 - mirrors property(fget, fset)
        spread: float,
        bounds: tuple[float, float] | None = None,
    ) -> None:
        super().__init__(name, spread, bounds)
        if not callable(get) or not callable(set):
            raise TypeError(f"Expected callables for explore[{name!r}] get and set")
        self._get = get
        self._set = set

    def bind(self, optimizer: torch.optim.Optimizer) -> None:
        self._finish_bind()

    def labels(self) -> list[str]:
        return [self.name]

    def read(self) -> list[float]:
        value = self._get()
        number = real(value)
        if number is None:
            raise ValueError(
                f"Expected explore[{self.name!r}] getter to return a real number, but it returned {value!r}"
            )
        return [number]

    def write(self, values: Sequence[float]) -> None:
        self._set(values[0])


def param_group(key: str, spread: float, bounds: tuple[float, float] | None = None) -> ParamGroupKey:
    """Explore optimizer param-group key ``key`` (``"weight_decay"``, ``"momentum"``, ``"betas.1"``)."""
    return ParamGroupKey(key, spread, bounds)


def dropout(
    model: nn.Module, spread: float, bounds: tuple[float, float] = (0.0, 1.0 - 1e-6), name: str = "dropout"
) -> ModuleAttr:
    """Explore the ``p`` of every dropout module in ``model``."""
    return ModuleAttr(name, model, "p", spread, bounds, types=DROPOUT_TYPES)


def module_attr(
    name: str,
    module: nn.Module,
    attr: str,
    spread: float,
    bounds: tuple[float, float] | None = None,
    types: type | tuple[type, ...] | None = None,
) -> ModuleAttr:
    """Explore float attribute ``attr`` of ``module`` (and of its submodules of ``types``).

    Example: ``module_attr("label_smoothing", loss_fn, "label_smoothing", 0.2, (0.0, 0.5))``.
    """
    return ModuleAttr(name, module, attr, spread, bounds, types)


def setter(
    name: str,
    get: Callable[[], float],
    set: Callable[[float], None],  # noqa: A002
    spread: float,
    bounds: tuple[float, float] | None = None,
) -> Setter:
    """Explore any scalar through a getter and a setter."""
    return Setter(name, get, set, spread, bounds)


def resolve_explore(
    explore: Mapping[str, Any] | Iterable[Hyperparam] | None,
    optimizer: torch.optim.Optimizer,
    *,
    cycle_momentum: bool,
    use_beta1: bool,
) -> list[Hyperparam]:
    """Turn the scheduler's ``explore=`` argument into bound :class:`Hyperparam` objects."""
    if explore is None:
        return []
    items: list[Hyperparam] = []
    if isinstance(explore, Mapping):
        for name, spec in explore.items():
            if isinstance(spec, Hyperparam):
                if spec.name != name:
                    raise ValueError(
                        f"Expected explore[{name!r}] to be named {name!r}, but it is a Hyperparam named "
                        f"{spec.name!r} (logged under that name); use that key, or pass a list"
                    )
                items.append(spec)
            elif real(spec) is not None:
                items.append(ParamGroupKey(name, real(spec)))
            elif isinstance(spec, Mapping):
                unknown = set(spec) - {"spread", "bounds"}
                if unknown or "spread" not in spec:
                    raise ValueError(
                        f"Expected explore[{name!r}] as a spread, a dict with 'spread' (and "
                        f"'bounds'), or a Hyperparam, but got {dict(spec)!r}"
                    )
                items.append(ParamGroupKey(name, spec["spread"], spec.get("bounds")))
            else:
                raise ValueError(f"Expected explore[{name!r}] as a spread, a dict or a Hyperparam, but got {spec!r}")
    elif isinstance(explore, Iterable) and not isinstance(explore, (str, bytes)):
        for spec in explore:
            if not isinstance(spec, Hyperparam):
                raise ValueError(
                    f"Expected explore entries to be hdet_track.explore.Hyperparam objects, but got {spec!r}"
                )
            items.append(spec)
    else:
        raise ValueError(f"Expected explore as a dict or a list of Hyperparam objects, but got {explore!r}")
    names = [hp.name for hp in items]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"Expected unique explored hyperparameter names, but got duplicates {sorted(dup)}")
    cycled = "betas.0" if use_beta1 else "momentum"
    for hp in items:
        if cycle_momentum and isinstance(hp, ParamGroupKey) and hp.key == cycled:
            raise ValueError(
                f"Expected explore not to include {hp.key!r} while cycle_momentum=True (OneCycle "
                "sets it every step), but got it; pass cycle_momentum=False to explore it"
            )
        hp.bind(optimizer)
    written: dict[tuple[Any, ...], str] = {}
    for hp in items:
        for target, what in hp.targets():
            if target in written:
                raise ValueError(
                    f"Expected explored hyperparameters to set different values, but explore[{hp.name!r}] and "
                    f"explore[{written[target]!r}] both set the same {what}; explore it once"
                )
            written[target] = hp.name
    return items

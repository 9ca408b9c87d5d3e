"""Typed, versioned events: the contract between training and everything that reads a run.

Every event is a frozen dataclass with ``to_dict()`` / :func:`event_from_dict`. Dicts carry
``"kind"`` and ``"schema"`` (:data:`SCHEMA_VERSION`); a reader meeting a newer schema raises
:class:`UnknownSchemaError` instead of guessing. Nothing here imports torch or a tracker.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import HDETError
from .record import ExploredSpec

__all__ = [
    "SCHEMA_VERSION",
    "RunStart",
    "StepRecord",
    "Converge",
    "ControllerDecision",
    "RunEnd",
    "Event",
    "event_from_dict",
    "UnknownSchemaError",
    "Guard",
]

# 2: series keys "lr/pg1" (was "lr_pg1"), RunStart.controller/total_steps/start_step, Converge.reasons,
#    ControllerDecision.controller/reference, Guard events.
SCHEMA_VERSION = 2


class UnknownSchemaError(HDETError):
    """An event dict of an unknown kind or a newer schema version."""


def _clean(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become None, tuples become lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _floats(value: Any) -> Any:
    """A float field (or list of them) JSON-safe without losing what it was: NaN as None, +-inf as
    ``"inf"``/``"-inf"`` (a diverged replica's window loss is inf, not unknown)."""
    if isinstance(value, list):
        return [_floats(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return _clean(value)


def _unclean(value: Any) -> Any:
    if value is None:
        return math.nan
    if isinstance(value, list):
        return [_unclean(v) for v in value]
    if isinstance(value, str):  # "inf", "-inf" (older archives wrote None for either)
        return float(value)
    return value


@dataclass(frozen=True)
class _Event:
    kind: ClassVar[str] = ""
    _float_lists: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "schema": SCHEMA_VERSION}
        out.update(_clean(dataclasses.asdict(self)))
        out.update({key: _floats(getattr(self, key)) for key in self._float_lists if getattr(self, key) is not None})
        return out

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> _Event:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for key in cls._float_lists:
            if kwargs.get(key) is not None:  # None: an optional list left out (onecycle of a non-LR decision)
                kwargs[key] = _unclean(kwargs[key])
        return cls(**kwargs)


@dataclass(frozen=True)
class RunStart(_Event):
    """The start of a run (or of its resumed part, ``start_step > 0``): configuration and environment.

    ``explored`` holds one :class:`~hdet_track.record.ExploredSpec` per hyperparameter (``"lr"``
    first): spread, multipliers, target labels, series keys and bounds.
    """

    kind: ClassVar[str] = "run_start"
    config: dict[str, Any]
    world_size: int
    schedule: str  # "hdet" or "onecycle"
    param_groups: list[str]
    explored: list[ExploredSpec]
    versions: dict[str, str]
    hostnames: list[str]
    compare_group: str | None = None
    time: float = 0.0
    controller: str = ""
    total_steps: int = 0
    start_step: int = 0
    job: str = ""  # the job's id, the same across its attempts: a spill with no run yet is known by it

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "schema": SCHEMA_VERSION}
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "explored"}
        out.update(_clean(fields))
        out["explored"] = [_clean(e.to_dict()) for e in self.explored]
        return out

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> RunStart:
        data = dict(data)
        legacy = data.get("schema", SCHEMA_VERSION) < 2
        data["explored"] = [_spec(e, legacy) for e in data.get("explored", [])]
        return super()._from_fields(data)  # type: ignore[return-value]


@dataclass(frozen=True)
class StepRecord(_Event):
    """One replica at one optimizer step: every explored value (keyed by series), multipliers, loss."""

    kind: ClassVar[str] = "step"
    step: int
    replica: int
    values: dict[str, float]
    multipliers: dict[str, float]
    loss: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["loss"] = _floats(self.loss)
        return out

    @classmethod
    def _from_fields(cls, data: dict[str, Any]) -> StepRecord:
        data = dict(data)
        data["loss"] = _unclean(data.get("loss"))
        return super()._from_fields(data)  # type: ignore[return-value]


@dataclass(frozen=True)
class Converge(_Event):
    """One sync: window mean losses, each replica's divergence before averaging, the replicas left
    out (and why: ``reasons[i]`` for ``left_out[i]``), and the scope of the per-step guard that ran
    during the window (``"all"``, ``"local"``, or ``""`` for none or unknown)."""

    kind: ClassVar[str] = "converge"
    _float_lists: ClassVar[tuple[str, ...]] = ("window_losses", "divergence")
    step: int
    window_losses: list[float]
    divergence: list[float]
    left_out: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    step_guard: str = ""


@dataclass(frozen=True)
class ControllerDecision(_Event):
    """The controller's decision for one hyperparameter at one sync (lists: one entry per target)."""

    kind: ClassVar[str] = "controller"
    _float_lists: ClassVar[tuple[str, ...]] = (
        "weights",
        "delta",
        "velocity",
        "base_before",
        "base_after",
        "onecycle",
        "reference",
    )
    step: int
    name: str
    weights: list[float]
    delta: list[float]
    velocity: list[float]
    base_before: list[float]
    base_after: list[float]
    gamma: float
    permutation: list[int]
    onecycle: list[float] | None = None  # plain OneCycleLR's value (LR only): drift = base / onecycle
    controller: str = "paper"
    reference: list[float] | None = None  # what the base is measured against (OneCycle's LR, initial values)


@dataclass(frozen=True)
class Guard(_Event):
    """A guard action at a sync: ``backoff`` (the LR drift cut because the highest-LR replicas blew
    up), ``rollback`` (every replica restored to the last good consensus, the LR drift cut) or
    ``averaged`` (every window loss non-finite, every replica's parameters finite: averaged as they were).
    ``drift_change`` is the change of the LR's log drift."""

    kind: ClassVar[str] = "guard"
    step: int
    action: str
    replicas: list[int]
    reason: str
    drift_change: float = 0.0


@dataclass(frozen=True)
class RunEnd(_Event):
    """The end of a run: ``FINISHED``, ``FAILED`` (with the exception text) or ``KILLED``."""

    kind: ClassVar[str] = "run_end"
    status: str
    step: int
    error: str | None = None
    time: float = 0.0  # when the job ended (the backend may write it later)


Event = RunStart | StepRecord | Converge | ControllerDecision | Guard | RunEnd
_KINDS: dict[str, type[_Event]] = {
    cls.kind: cls for cls in (RunStart, StepRecord, Converge, ControllerDecision, Guard, RunEnd)
}


def _spec(data: dict[str, Any], legacy: bool) -> ExploredSpec:
    from .names import legacy_series_key

    spec = ExploredSpec.from_dict(data)
    if legacy:  # schema 1 wrote "lr_pg1"; read its columns and metrics under those keys
        keys = [legacy_series_key(spec.name, t, label) for t, label in enumerate(spec.targets)]
        spec = dataclasses.replace(spec, series_keys=keys)
    return spec


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from :meth:`to_dict`'s output.

    Raises:
        UnknownSchemaError: unknown kind, or a schema version newer than this library's.
    """
    kind = data.get("kind")
    schema = data.get("schema")
    if kind not in _KINDS:
        raise UnknownSchemaError(f"Expected an event kind in {sorted(_KINDS)}, but got {kind!r}")
    if not isinstance(schema, int) or schema > SCHEMA_VERSION or schema < 1:
        raise UnknownSchemaError(
            f"Expected event schema version 1..{SCHEMA_VERSION}, but got {schema!r}; upgrade hdet-track to read it"
        )
    return _KINDS[kind]._from_fields(data)  # type: ignore[return-value]

"""The scheduler's checkpoint format: its version, the upgrade of hdet-track 0.1's flat
checkpoints, and the checks that a checkpoint belongs to the job loading it.

Format 2 (:meth:`hdet_track.HDETScheduler.state_dict`) holds only plain Python values and tensors:
``onecycle`` (OneCycleLR's own state), ``world_size``, ``explored``, ``permutations`` and
``generators`` and ``references`` (:class:`~hdet_track.fanout.FanOut`), ``controller`` (name, state
and constructor ``settings``), ``settings`` (max_lr, total_steps, sync_every, spreads, param groups: what a
job must share with the checkpoint to resume exactly), ``window`` (this rank's partial window;
``windows``: every rank's), ``averager`` (the kept consensus), ``runs`` (the tracked runs' ids), and
what was in force: ``owns_lr`` (whether the optimizer's LRs were the ones HDET wrote last, or another
scheduler had set its own since: SequentialLR's next scheduler after the milestone, a
ChainedScheduler's factor), ``explored_shared`` (whether every rank held the explored values' shared
base) and ``onecycle_lrs`` (plain OneCycle's LRs at the saved step).
Checkpoints without ``settings``/``references`` or the three keys above (older ones, and hdet-track
0.1's through :func:`upgrade`) still load: HDET's own LRs taken as in force, the explored values as
HDET's step implies (this rank's; the shared base after the last step).

:class:`Checkpointing` is the half of :class:`~hdet_track.scheduler.HDETScheduler` that saves and
restores it. It expects the scheduler's OneCycle state (``__dict__``'s ``_onecycle_keys``),
``_fanout``, ``_controller``, ``_converger``, ``_callbacks``, ``_group``, ``_rank``, ``_world_size``,
``_config``, ``_max_lrs``, ``_lr_bounds``, ``optimizer``, ``total_steps``, ``sync_every``,
``_onecycle``, ``_explored_shared``, ``_last_lr``, and its ``_deliver``, ``_refresh``,
``_write_lrs``, ``_record_lrs`` and ``_apply_explored``. The optimizer's load hooks (registered by the
scheduler) are here too: which scheduler's LRs are in force decides what a load writes.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import collectives
from ._checks import plain
from .errors import CheckpointMismatchError

if TYPE_CHECKING:
    from .callbacks import CallbackList
    from .controller import Controller
    from .converge import Converger
    from .fanout import FanOut
    from .scheduler import HDETScheduler

__all__ = ["FORMAT", "Checkpointing", "upgrade", "check_compatible"]

FORMAT = 2


class Checkpointing:
    """``state_dict`` and ``load_state_dict`` for :class:`~hdet_track.scheduler.HDETScheduler` (a mixin)."""

    _fanout: FanOut
    _controller: Controller | None
    _converger: Converger
    _callbacks: CallbackList
    _onecycle_keys: frozenset[str]
    _config: dict[str, Any]
    _onecycle: list[float]
    _explored_shared: bool
    _max_lrs: list[float]
    _lr_bounds: list[tuple[float, float]]
    _resumed_runs: dict[str, str]
    _job: str
    _group: Any
    _rank: int
    _world_size: int
    optimizer: torch.optim.Optimizer
    last_epoch: int
    total_steps: int
    sync_every: int
    _deliver: Callable[..., None]  # Reporting's: hand a waiting record to the callbacks
    _apply_explored: Callable[..., None]  # the scheduler's: write this rank's explored values (or the base)
    _write_lrs: Callable[..., None]  # the scheduler's: write LRs into the param groups
    _record_lrs: Callable[[], None]  # the scheduler's: the LRs in force are its own (_last_lr)
    _refresh: Callable[..., None]  # the scheduler's: re-apply this rank's values for the current step

    def state_dict(self, all_ranks: bool = False) -> dict[str, Any]:
        """Everything needed to resume exactly: OneCycle's state, the permutations and their
        generators, the controller's state, this rank's partial window, the kept consensus (with
        the drift controller's rollback: one copy of the parameters), and the tracked runs' ids
        (so that a resumed job continues the same run), and whether the LRs in force were HDET's
        (another scheduler's, such as SequentialLR's next one after the milestone, are left as they
        are on load). Tracking flags are never saved. The format is :mod:`hdet_track.checkpoint`'s.

        Args:
            all_ranks: gather every rank's partial window too (a collective: call it on every
                rank), for checkpoints that only rank 0 writes; each rank then resumes its own.

        Only plain Python values and tensors, so ``torch.load(weights_only=True)`` reads it.
        """
        self._deliver(force=True)  # a record waiting for the next sync's gather goes without its divergences
        window = self._converger.window_state()
        runs = self._callbacks.run_ids(wait=30.0)
        controller = self._controller
        state = {
            "format": FORMAT,
            "onecycle": {k: self.__dict__[k] for k in sorted(self._onecycle_keys)},
            "world_size": self._world_size,
            "explored": list(self._fanout.names),
            **self._fanout.state_dict(),
            "controller": None
            if controller is None
            else {"name": controller.name, "state": controller.state_dict(), "settings": controller.settings()},
            "settings": self._resume_settings(),
            "window": window,
            "averager": self._converger.averager.state_dict(),
            "runs": {k: v for k, v in runs.items() if v},
            "job": self._job,  # an attempt that never reached its backend is known by it
            # what was in force: HDET's LRs or another scheduler's, the explored values' kind
            "owns_lr": self._owns_lr(),
            "explored_shared": self._explored_shared,
            "onecycle_lrs": list(self._onecycle),
        }
        if all_ranks:
            state["windows"] = {r: w for r, w in enumerate(collectives.all_gather_objects(window, self._group))}
        return plain(state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (or hdet-track 0.1's) and re-apply this rank's values.

        A checkpoint of any rank loads on any rank of a job with the same replicas and explored
        hyperparameters (each rank keeps its identity; the partial window is exact when every rank
        loads its own). Call before the first ``step`` so that a tracked job continues its run.

        This rank's own LRs (and momenta) for the saved step are written when HDET's were in force
        (after its last step from OneCycle's values at that step: the formula is not evaluated past
        its end, and the momenta stay). LRs another scheduler had set over HDET's (SequentialLR's
        next one after the milestone, a ChainedScheduler's factor), which torch's schedulers keep or
        build on, stay as the optimizer's checkpoint holds them, whichever of the optimizer and the
        scheduler is loaded first. The explored values come back as they were in force: this
        rank's, or the shared base after HDET's last step or after a :meth:`sync_now` that found
        another scheduler's LRs.

        Raises:
            CheckpointMismatchError: the replica count, explored names or controller differ.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"Expected state_dict to be a dict from HDETScheduler.state_dict(), but got {type(state_dict).__name__}"
            )
        self._deliver(force=True)  # a record of the run so far goes over before its state is replaced
        state = upgrade(state_dict, self._onecycle_keys, len(self.optimizer.param_groups))
        controller = self._controller
        check_compatible(
            state,
            world_size=self._world_size,
            explored=self._fanout.names,
            controller=None if controller is None else controller.name,
            settings=self._resume_settings(),
            controller_settings=None if controller is None else controller.settings(),
        )
        # a checkpoint holds Python numbers (weights_only=True); OneCycleLR computes with the NumPy
        # scalars it was given (np.float32 arithmetic): their types come back, bit for bit
        self.__dict__.update(
            {k: numbers_like(self.__dict__.get(k), v) for k, v in state["onecycle"].items() if k in self._onecycle_keys}
        )
        self._fanout.load_state_dict(state)
        if controller is not None:
            controller.load_state_dict(state["controller"]["state"])
        self._converger.load_window(state.get("windows", {}).get(self._rank, state["window"]))  # its own, if saved
        self._converger.averager.load_state_dict(state.get("averager", {}))
        self._resumed_runs = dict(state.get("runs", {}))
        self._job = str(state.get("job") or self._job)
        self._onecycle = [float(x) for x in state.get("onecycle_lrs", self._onecycle)]
        ended = self.last_epoch >= self.total_steps
        shared = bool(state.get("explored_shared", ended))
        owned = state.get("owns_lr", True)
        if owned and not ended:
            self._refresh(shared)  # HDET's own LRs were in force: this rank's, from the schedule
            self.__dict__.pop("_as_loaded", None)
            return
        # the LRs and momenta as the optimizer's checkpoint holds them: another scheduler's (if the
        # optimizer was loaded first, its hook wrote this fresh scheduler's over them), or after
        # HDET's last step this rank's own LRs from OneCycle's values at that step
        self._put_back_as_loaded()
        if owned and "onecycle_lrs" in state:
            self._restore_own_lrs(shared)
        else:
            self._apply_explored(shared)

    def _resume_settings(self) -> dict[str, Any]:
        """What a checkpoint must share with the job that loads it for the job to resume exactly
        (a checkpoint of an older version is compared on the keys it holds)."""
        shape = ["pct_start", "anneal_strategy", "three_phase", "div_factor", "final_div_factor", "cycle_momentum"]
        shape += ["base_momentum", "max_momentum"] if self._config.get("cycle_momentum") else []
        return {
            "max_lr": list(self._max_lrs),
            "total_steps": self.total_steps,
            "sync_every": self.sync_every,
            "spreads": dict(self._fanout.spreads),
            "param_groups": len(self.optimizer.param_groups),
            **{k: self._config[k] for k in shape if k in self._config},
            "lr_bounds": [[float(low), float(high)] for low, high in self._lr_bounds],
            # each explored hyperparameter's targets (a model that gained a Dropout) and bounds
            "explored_targets": self._fanout.num_targets(),
            "explore_bounds": {
                name: [float(x) for x in self._fanout.hyperparams[name].bounds] for name in self._fanout.names[1:]
            },
        }

    def _owns_lr(self) -> bool:
        """Whether the optimizer's LRs are the ones this scheduler wrote last: False once another
        scheduler has set its own (SequentialLR's next one after the milestone, a ChainedScheduler's
        factor), which torch's schedulers keep or build on and HDET must leave alone."""
        return all(float(g["lr"]) == float(lr) for g, lr in zip(self.optimizer.param_groups, self._last_lr))

    def _put_back_as_loaded(self) -> None:
        """The LRs and momenta ``optimizer.load_state_dict()`` brought, if its hook has written this
        scheduler's over them since (the optimizer loaded before the scheduler)."""
        as_loaded = self.__dict__.pop("_as_loaded", None)
        if as_loaded is None:
            return
        self._write_lrs([values["lr"] for values in as_loaded])
        for group, values in zip(self.optimizer.param_groups, as_loaded):
            group.update({k: v for k, v in values.items() if k != "lr"})

    def _restore_own_lrs(self, shared: bool | None = None) -> None:
        """:meth:`_refresh`, but never OneCycle's formula past its end: after the last step this
        rank's LRs come from plain OneCycle's values at that step (``_onecycle``, as the step left
        them or a checkpoint restored them), and the momenta stay as they are."""
        if self.last_epoch < self.total_steps:
            self._refresh(shared)
            return
        self._write_lrs(self._fanout.values("lr", self.base_values("lr"), self._rank))
        self._record_lrs()
        self._apply_explored(shared)


def numbers_like(template: Any, value: Any) -> Any:
    """``value`` (from a checkpoint: Python numbers) with the NumPy scalar types of ``template`` (what
    this scheduler holds in the same place), in lists and dicts too."""
    if isinstance(template, np.generic) and isinstance(value, (int, float)):
        return type(template)(value)
    if isinstance(template, (list, tuple)) and isinstance(value, (list, tuple)) and len(template) == len(value):
        return type(value)(numbers_like(t, v) for t, v in zip(template, value))
    if isinstance(template, dict) and isinstance(value, dict):
        return {k: numbers_like(template.get(k), v) for k, v in value.items()}
    return value


def upgrade(state: dict[str, Any], onecycle_keys: Collection[str], num_groups: int) -> dict[str, Any]:
    """``state`` in format 2: as it is, or hdet-track 0.1's flat checkpoint reshaped (the paper
    controller's state; the partial window's OneCycle values, which 0.1 did not save, as nan)."""
    if state.get("format") == FORMAT:
        return state
    if "_world_size" not in state:
        if "_schedule_phases" in state and "last_epoch" in state:  # OneCycleLR's own
            raise CheckpointMismatchError(
                f"Expected an HDETScheduler checkpoint, but got a OneCycleLR one (at step {state['last_epoch']}): it "
                "holds no replicas to resume. To go on from it with HDET, load it into the OneCycleLR it came from "
                "and hdet_track.wrap(that_scheduler, ...), which carries its progress over; or build the "
                f"HDETScheduler with the same schedule and last_epoch={state['last_epoch'] - 1} after loading the "
                "optimizer's state"
            )
        raise CheckpointMismatchError(f"Expected an HDETScheduler checkpoint, but got keys {sorted(state)[:8]}")
    window = list(state.get("_window", []))
    controller = None
    if state.get("auto_lr"):
        controller = {"name": "paper", "state": {"base": state["_base"], "velocity": state["_velocity"]}}
    return {
        "world_size": state["_world_size"],
        "explored": state.get("_explore_names", ["lr"]),
        "onecycle": {k: v for k, v in state.items() if k in onecycle_keys},
        "permutations": state["_perm"],
        "generators": state.get("_gen_states", {}),
        "controller": controller,
        "window": {"losses": window, "onecycle": [[math.nan] * num_groups] * len(window)},
    }


def check_compatible(
    state: dict[str, Any],
    *,
    world_size: int,
    explored: Sequence[str],
    controller: str | None,
    settings: dict[str, Any] | None = None,
    controller_settings: dict[str, Any] | None = None,
) -> None:
    """Raise :class:`CheckpointMismatchError` unless a format-2 ``state`` was saved by a job with
    the same replica count, explored hyperparameters and controller, and (for checkpoints that keep
    them) the same schedule settings and controller arguments."""
    if state["world_size"] != world_size:
        raise CheckpointMismatchError(
            f"Expected a checkpoint of {world_size} replicas, but it holds {state['world_size']}; "
            "resume with the same number of replicas"
        )
    if list(state["explored"]) != list(explored):
        raise CheckpointMismatchError(
            f"Expected a checkpoint exploring {list(explored)}, but it explores {state['explored']}"
        )
    saved = (state["controller"] or {}).get("name")
    if saved != controller:
        raise CheckpointMismatchError(f"Expected a checkpoint of controller {controller!r}, but it holds {saved!r}")
    differ = _differences("", settings or {}, state.get("settings") or {})
    differ += _differences("controller ", controller_settings or {}, (state["controller"] or {}).get("settings") or {})
    if differ:
        raise CheckpointMismatchError(
            f"Expected a checkpoint of a job with this job's settings, but {'; '.join(differ)}: a job resumes "
            "exactly only with the settings it was saved with"
        )


def _differences(prefix: str, mine: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    """``"<name> is <mine> here and <saved> in the checkpoint"`` for each key both hold that differs."""
    return [
        f"{prefix}{key} is {mine[key]!r} here and {saved[key]!r} in the checkpoint"
        for key in sorted(set(mine) & set(saved))
        if not _same(mine[key], saved[key])
    ]


def _same(mine: Any, saved: Any) -> bool:
    """One setting, given either way: a tuple or a list, one value or that value for every param
    group (``base_momentum=0.85``, ``[0.85]`` as ``wrap(OneCycleLR(...))`` keeps it)."""
    mine, saved = _as_lists(mine), _as_lists(saved)
    if isinstance(mine, list) != isinstance(saved, list):
        values, one = (mine, saved) if isinstance(mine, list) else (saved, mine)
        return all(v == one for v in values)
    return mine == saved


def _as_lists(value: Any) -> Any:
    """Tuples as lists, at any depth (``base_momentum=(0.85, 0.8)`` saved, ``[0.85, 0.8]`` given)."""
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    return value


_LATEST: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[HDETScheduler]] = weakref.WeakKeyDictionary()


def _latest(optimizer: torch.optim.Optimizer) -> HDETScheduler | None:
    """The optimizer's latest HDETScheduler, if still alive, built and not closed."""
    ref = _LATEST.get(optimizer)
    sched = ref() if ref is not None else None
    if sched is None or not sched._hdet_ready or sched.__dict__.get("_released"):
        return None  # gone, or closed: the optimizer is no longer HDET's
    return sched


def _note_lr_owner_before_load(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Before ``optimizer.load_state_dict()``: whether the LRs it replaces were HDET's own."""
    sched = _latest(optimizer)
    if sched is not None:
        sched.__dict__["_owned_lr_before_load"] = sched._owns_lr()


def _reapply_after_load(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict()``: the optimizer's latest HDETScheduler puts this rank's
    values back into the param groups: its LRs only while its own were in force before the load
    (after another scheduler's, the loaded LRs are that scheduler's, which ``load_state_dict`` keeps
    too), after its last step the ones it wrote last; the explored values as they were in force."""
    sched = _latest(optimizer)
    if sched is None:
        return
    owned = sched.__dict__.pop("_owned_lr_before_load", True)
    needed = ("initial_lr", "max_lr", "min_lr")  # OneCycleLR's, gone from a state saved without it
    if not all(k in g for g in optimizer.param_groups for k in needed):
        return
    if owned and sched.last_epoch < sched.total_steps:
        # what the load brought, for a checkpoint of this scheduler loaded next that keeps it
        cycled = ("lr", "momentum", "betas")
        as_loaded = [{k: _copied(g[k]) for k in cycled if k in g} for g in optimizer.param_groups]
        sched.__dict__["_as_loaded"] = as_loaded
        sched._refresh(sched._explored_shared)
        return
    if owned:
        sched._write_lrs(sched._last_lr)  # no formula past the end
    sched._apply_explored(sched._explored_shared)


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value

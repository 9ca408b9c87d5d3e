"""``HDETScheduler``: OneCycleLR with fan-out, converge and an auto-LR controller.

The scheduler owns OneCycle's schedule and wires the parts:

- the fan-out (:mod:`hdet_track.fanout`: each explored hyperparameter's multipliers, permutations
  and their generators; the pure math is :mod:`hdet_track.schedule`),
- the controller that decides the next base (:mod:`hdet_track.controller`),
- the converge step at each sync (:mod:`hdet_track.converge`: the window, health, rollback, averaging
  by :mod:`hdet_track.averager` over :mod:`hdet_track.collectives`, the controller's decision); what
  the scheduler hands it at a sync, and ``sync_now``, are the :class:`~hdet_track.syncing.Syncing`
  half of the class,
- its callbacks (:mod:`hdet_track.callbacks`), which receive one :class:`~hdet_track.record.SyncRecord`
  per sync (tracking is one: :class:`hdet_track.tracking.recorder.Recorder`, built when ``track`` is set);
  what they receive and when is the :class:`~hdet_track.reporting.Reporting` half of the class,
- what it shows of itself (the replicas, each explored hyperparameter's base and replica values now,
  plain OneCycle's LRs): :class:`~hdet_track.views.Views`,
- its checkpoints (:mod:`hdet_track.checkpoint`: the format, and the
  :class:`~hdet_track.checkpoint.Checkpointing` half of the class: ``state_dict``, ``load_state_dict``),
- what it accepts (:mod:`hdet_track.arguments`: every argument checked before anything is built, the
  configuration a run records).
"""

from __future__ import annotations

import uuid
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR, _enable_get_lr_call

from . import collectives
from .arguments import (
    check_arguments,
    check_paper_arguments,
    check_values,
    check_whole_replicas,
    checked_callbacks,
    checked_loss,
    max_lrs,
    onecycle_arguments,
    paper_arguments,
    recorded_config,
    resolve_lr_bounds,
)
from .averager import ReplicaAverager, innermost_optimizer
from .callbacks import CallbackList, resolve_track
from .checkpoint import _LATEST, Checkpointing, _note_lr_owner_before_load, _reapply_after_load
from .controller import Controller, ControllerContext, make_controller
from .converge import Converger
from .explore import Hyperparam, resolve_explore
from .fanout import FanOut
from .record import SchedulerCallback, SyncRecord
from .reporting import Reporting
from .syncing import Syncing
from .views import Views

__all__ = ["HDETScheduler", "SyncReport"]

_NO_MODEL_AT_ROLLBACK = (
    "a rollback restored the optimizer's parameters to the last good consensus, not the model's buffers "
    "(BatchNorm's running statistics keep what the blow-up put in them, NaN included): pass "
    "HDETScheduler(..., model=model) so that buffers are averaged, kept and restored too"
)

SyncReport = SyncRecord  # the name of hdet-track 0.1


class HDETScheduler(Views, Syncing, Reporting, Checkpointing, OneCycleLR):
    r"""OneCycleLR for data-parallel replicas that explore their hyperparameters.

    The N ranks of the process group train with learning rates spread around one shared
    OneCycle base (fan-out); every ``sync_every`` steps the parameters are averaged across
    ranks (converge), and, with ``auto_lr=True``, a controller moves the base toward the
    replicas with lower recent loss. Any other scalar hyperparameter can be explored the
    same way with ``explore=``. With ``spread=0, auto_lr=False`` the learning rates and momenta
    are bit-identical to OneCycleLR's.

    Args:
        optimizer, max_lr, total_steps, epochs, steps_per_epoch, pct_start, anneal_strategy,
        cycle_momentum, base_momentum, max_momentum, div_factor, final_div_factor,
        three_phase, last_epoch: as in :class:`~torch.optim.lr_scheduler.OneCycleLR`.
        spread: alpha in [0, 1): replica r's LR multiplier is
            ``1 + alpha * (r - (N-1)/2) / max((N-1)/2, 0.5)``.
        sync_every: T >= 1: average parameters every T steps (and after the last step).
        auto_lr: run the controller at each sync.
        controller: ``"drift"`` (shape-keeping, scale-free, guarded; the default since the
            published study showed it better than the paper's, see docs/controller.md and
            docs/results.md), ``"paper"`` (the published controller, kept for reproduction) or a
            :class:`hdet_track.controller.Controller`.
        auto_lr_warmup, temperature, meta_lr, meta_momentum: the paper controller's settings:
            steps of plain OneCycle before it takes over (then the LR is held between syncs), the
            softmax temperature in loss units, the step size and momentum of its base update. With
            the drift controller ``auto_lr_warmup`` is its ``warmup``: steps before its evidence
            moves the drift (the guard acts from the first step); the other three are the paper's only.
        lr_bounds: ``(low, high)`` for every param group, or one pair per group, that the
            controller keeps the base LR in. Default for the paper controller
            ``(max_lr / div_factor / final_div_factor, 10 * max_lr)``; the drift controller bounds
            its drift instead unless ``lr_bounds`` is given.
        explore: other hyperparameters: ``{"weight_decay": 0.5}`` (param-group keys and spreads),
            or a list of :mod:`hdet_track.explore` objects (dropout, module attributes, setters).
        process_group: the replicas; default the default group, or a world of one.
        seed: seeds the private permutation generators (the same on every rank).
        track: log the run: ``True`` (``$HDET_TRACKER``, MLflow when unset), ``"mlflow"``,
            ``"wandb"``, a :class:`hdet_track.tracking.Tracker`, or a list. Pass the same on every
            rank; rank 0 owns the one run of the job.
        log_every, compare_group, run_name, close_at_end: tracking settings (see
            :class:`hdet_track.tracking.recorder.Recorder`).
        callbacks: :class:`hdet_track.record.SchedulerCallback` objects (see :meth:`add_callback`).
        model: the module whose parameters *and buffers* are averaged (with any parameter the
            optimizer trains outside it). Without it, the optimizer's parameters are averaged, and
            a rollback cannot restore buffers (BatchNorm's statistics).
        average_buffers: with ``model``, average its buffers too.

    Attributes:
        last_sync: the latest sync's :class:`~hdet_track.record.SyncRecord` (None before the first).
            Its ``divergences`` are measured at the sync only with ``measure_divergence = True``;
            otherwise they are NaN until the callbacks that need them (tracking) have received the
            record with every replica's divergence (in the background by the next step, or with the
            next sync after a short window), and then ``last_sync`` is that complete record.
        measure_divergence: measure and gather every replica's distance to the consensus at each
            sync, before averaging (one more collective per sync); default False.

    Raises:
        ValueError: an argument is out of range (the message names it and the range).

    Example:
        >>> sched = HDETScheduler(opt, max_lr=0.1, total_steps=2000, spread=0.3,
        ...                       sync_every=100, auto_lr=True)
        >>> for x, y in loader:
        ...     loss = F.cross_entropy(model(x), y)
        ...     opt.zero_grad(); loss.backward(); opt.step()
        ...     sched.step(loss)
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        max_lr: float | list[float],
        total_steps: int | None = None,
        epochs: int | None = None,
        steps_per_epoch: int | None = None,
        pct_start: float = 0.3,
        anneal_strategy: Literal["cos", "linear"] = "cos",
        cycle_momentum: bool = True,
        base_momentum: float | list[float] = 0.85,
        max_momentum: float | list[float] = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
        last_epoch: int = -1,
        *,
        spread: float = 0.0,
        sync_every: int = 1000,
        auto_lr: bool = False,
        controller: str | Controller = "drift",
        auto_lr_warmup: int = 0,
        temperature: float = 0.1,
        meta_lr: float = 0.5,
        meta_momentum: float = 0.9,
        lr_bounds: tuple[float, float] | Sequence[tuple[float, float]] | None = None,
        explore: Mapping[str, Any] | Iterable[Hyperparam] | None = None,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        track: Any = False,
        log_every: int = 1,
        compare_group: str | None = None,
        run_name: str | None = None,
        close_at_end: bool = False,
        callbacks: Iterable[SchedulerCallback] = (),
        model: nn.Module | None = None,
        average_buffers: bool = True,
    ) -> None:
        self._hdet_ready = False
        config = recorded_config(locals(), controller)
        check_arguments(locals())
        trackers = resolve_track(track)  # a bad value fails before OneCycleLR rewrites the param groups
        n_groups = len(optimizer.param_groups)
        self._max_lrs = max_lrs(max_lr, n_groups)
        self._lr_bounds = resolve_lr_bounds(lr_bounds, self._max_lrs, div_factor, final_div_factor)
        self._lr_bounds_given = lr_bounds is not None
        self._group = process_group
        self._rank, self._world_size = collectives.world(process_group)
        if self._world_size > 1:
            check_whole_replicas(optimizer, model, bool(average_buffers))
        self._model = model
        self.average_buffers = bool(average_buffers)
        self.spread = float(spread)
        self.sync_every = int(sync_every)
        self.auto_lr = auto_lr
        self.seed = int(seed)
        explored = resolve_explore(
            explore, optimizer, cycle_momentum=cycle_momentum, use_beta1="betas" in optimizer.defaults
        )
        self._fanout = FanOut(self.spread, explored, n_groups, self._world_size, seed)
        paper = paper_arguments(locals())
        built = make_controller(controller, **paper)  # a wrong name fails also with auto_lr=False
        check_paper_arguments(built, auto_lr, paper)
        self._controller: Controller | None = built if auto_lr else None
        self._callbacks = CallbackList(checked_callbacks(callbacks))
        self._config = config
        self._onecycle: list[float] = []
        self._explored_shared = False  # whether the explored values in force are the shared base (_apply_explored)
        self._started = False
        self._resumed_runs: dict[str, str] = {}
        self._job = uuid.uuid4().hex  # this job's id; a checkpoint carries it to the job's next attempt
        self.measure_divergence = False
        self.last_sync: SyncRecord | None = None
        before = set(self.__dict__)
        super().__init__(
            optimizer,
            max_lr,
            total_steps=total_steps,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            three_phase=three_phase,
            last_epoch=last_epoch,
        )
        self._onecycle_keys = frozenset(set(self.__dict__) - before - {"optimizer"})  # what OneCycleLR keeps
        self._div = (float(div_factor), float(final_div_factor))
        fan = self._fanout
        keep = self._controller is not None and self._controller.rollback
        averager = ReplicaAverager(self._sync_tensors, optimizer, process_group, keep_consensus=keep)
        if model is None:
            averager.restore_note = _NO_MODEL_AT_ROLLBACK
        self._converger = Converger(
            averager,
            self._controller,
            names=fan.names,
            multipliers=fan.multipliers,
            bounds={name: fan.bounds(name) for name in fan.names},
            series_keys={name: fan.series_keys(name) for name in fan.names},
            generators=fan.generators,
            callbacks=self._callbacks,
        )
        if trackers:
            self._track(
                trackers, log_every=log_every, compare_group=compare_group, run_name=run_name, close_at_end=close_at_end
            )
        self._bind_controller()
        self._hdet_ready = True
        self._apply_explored()
        # optimizer.load_state_dict() writes the saving rank's LRs and explored values into the param
        # groups: this rank's come back at once, whichever of the two is loaded first
        inner = innermost_optimizer(optimizer)  # a wrapper's (accelerate's AcceleratedOptimizer) loads into it
        if inner not in _LATEST:
            inner.register_load_state_dict_pre_hook(_note_lr_owner_before_load)
            inner.register_load_state_dict_post_hook(_reapply_after_load)
        _LATEST[inner] = weakref.ref(self)  # the latest scheduler of the optimizer, not kept alive
        if self._world_size == 1 and fan.spreading:
            warnings.warn(
                "HDETScheduler runs on a single replica (no initialised process group, or a group "
                "of one): spread has no effect; parameters are not averaged.",
                UserWarning,
                stacklevel=2,
            )

    @classmethod
    def from_onecycle(cls, scheduler: OneCycleLR, **hdet_kwargs: Any) -> HDETScheduler:
        """An HDETScheduler continuing ``scheduler`` (a OneCycleLR) at its current step, with its
        arguments; HDET's own arguments as keywords. With ``spread=0, auto_lr=False`` the LRs
        continue unchanged; the paper controller's decay spans the syncs that remain."""
        args = onecycle_arguments(scheduler)
        clash = sorted(set(hdet_kwargs) & set(args))
        if clash:
            raise TypeError(f"from_onecycle() takes OneCycleLR's arguments from the scheduler; do not pass {clash}")
        # each group's own ends (div factors recomputed from group 0's differ by an ulp in the others)
        ends = [{k: g[k] for k in ("initial_lr", "max_lr", "min_lr")} for g in scheduler.optimizer.param_groups]
        sched = cls(scheduler.optimizer, **args, **hdet_kwargs)
        for group, kept in zip(sched.optimizer.param_groups, ends):
            group.update(kept)
        if scheduler.last_epoch > 0:
            sched._start_at(scheduler.last_epoch)
        else:
            sched._refresh()
        return sched

    def _start_at(self, step: int) -> None:
        """Put this new scheduler at ``step`` of its schedule: a job that continues a schedule
        started without HDET (a OneCycleLR's progress, a trainer's step)."""
        self.last_epoch = step
        self._step_count = step + 1
        self._bind_controller()
        self._refresh()

    # ------------------------------------------------------------------ scheduling
    def get_lr(self) -> list[float | torch.Tensor]:
        onecycle = super().get_lr()
        self._onecycle = [float(x) for x in onecycle]
        if self._controller is None and self.multiplier("lr") == 1.0:
            return onecycle
        return self._fanout.values("lr", self.base_values("lr"), self._rank)

    def step(self, loss: float | torch.Tensor | None = None, epoch: int | None = None) -> None:  # type: ignore[override]
        """Advance one optimizer step; call after ``optimizer.step()``.

        Args:
            loss: this replica's training loss for the step just taken (a float or a one-element
                tensor; detached, not synchronised). Required with ``auto_lr=True``.
            epoch: not supported (deprecated in PyTorch); must be ``None``.

        Raises:
            ValueError: a non-scalar loss, or no loss while auto-LR is on.
            NonFiniteReplicasError: every replica is non-finite at a sync and no rollback is possible.
        """
        if not self._hdet_ready or self._is_initial:  # the initial step (LRScheduler.__init__, SequentialLR's)
            super().step()
            return
        if epoch is not None:
            raise ValueError(
                f"Expected epoch=None (HDETScheduler steps one optimizer step at a time), but got {epoch!r}"
            )
        if isinstance(loss, int) and not isinstance(loss, bool) and not self.__dict__.get("_int_said"):
            self._int_said = True  # said once: an int loss is taken as a loss
            warnings.warn(
                f"HDETScheduler.step() took the int {loss!r} as this step's training loss; if it is an epoch "
                "(OneCycleLR's deprecated step(epoch)), call step(loss): the scheduler counts its steps itself",
                UserWarning,
                stacklevel=2,
            )
        if len(self.optimizer.param_groups) != self._fanout.num_groups:
            raise ValueError(
                f"Expected the optimizer's {self._fanout.num_groups} param groups HDETScheduler was built with, but it "
                f"has {len(self.optimizer.param_groups)} now (add_param_group after the scheduler was built): build "
                "the scheduler after the optimizer's last add_param_group"
            )
        if not self._started:
            self._start()
        self.__dict__.pop("_as_loaded", None)  # (the optimizer's load hook's, for a scheduler loaded next)
        self._deliver()
        self._converger.append(checked_loss(loss, self.auto_lr), self._onecycle)
        k = self.last_epoch + 1
        blown = self._converger.step_guard()
        if blown is not None or k % self.sync_every == 0 or k == self.total_steps:
            record = self._sync(k, blown)
            super().step()
            self._synced(record)
        else:
            super().step()
        if k >= self.total_steps:
            self._deliver()  # before the run ends at its last step
        self._callbacks.on_step(k)

    def _apply_explored(self, shared: bool | None = None) -> None:
        # after the last step every rank holds the shared base: what a later phase's scheduler reads
        # (shared: the base whatever the step, as sync_now() writes it once another scheduler holds the LR)
        self._explored_shared = self.last_epoch >= self.total_steps if shared is None else bool(shared)
        self._fanout.write(self.base_values, None if self._explored_shared else self._rank)

    def _write_lrs(self, values: Sequence[float | torch.Tensor]) -> None:
        for group, lr in zip(self.optimizer.param_groups, values):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr

    def _record_lrs(self) -> None:
        """The LRs in force are this scheduler's (``_last_lr``, as OneCycleLR keeps them)."""
        self._last_lr = [
            g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in self.optimizer.param_groups
        ]

    def _bind_controller(self) -> None:
        if self._controller is None:
            return
        fan = self._fanout
        self._controller.bind(
            ControllerContext(
                names=list(fan.names),
                num_targets=fan.num_targets(),
                multipliers={k: list(v) for k, v in fan.multipliers.items()},
                bounds={name: list(self._lr_bounds) if name == "lr" else fan.bounds(name) for name in fan.names},
                lr_bounds_given=self._lr_bounds_given,
                world_size=self._world_size,
                total_steps=self.total_steps,
                sync_every=self.sync_every,
                start_step=max(self.last_epoch, 0),
                div_factor=self._div[0],
                final_div_factor=self._div[1],
            )
        )

    def _refresh(self, shared: bool | None = None) -> None:
        """Re-apply this rank's LRs (and momenta) for the current step, and its explored values
        (``shared``: as :meth:`_apply_explored`)."""
        with _enable_get_lr_call(self):
            values = self.get_lr()
        self._write_lrs(values)
        self._record_lrs()
        self._apply_explored(shared)


def check_hdet_kwargs(owner: str, kwargs: Mapping[str, Any], taken: Iterable[str] = (), **given: Any) -> None:
    """For a wrapper that builds the scheduler later (a Lightning or Hugging Face callback): its
    ``**hdet_kwargs`` must be HDET's own keyword arguments (not OneCycle's, which come from the
    trainer), with values HDET takes, checked when the wrapper is built, not when training starts
    (``given``: the wrapper's own arguments that it passes on, such as ``log_every``)."""
    import inspect

    params = [p for p in inspect.signature(HDETScheduler.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
    allowed = {p.name for p in params} - set(taken)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(
            f"{owner} got unexpected keyword arguments {unknown}; HDET's keyword arguments are {sorted(allowed)}"
        )
    values = {p.name: p.default for p in params} | given | dict(kwargs)
    check_values(values)
    built = make_controller(values["controller"], **paper_arguments(values))  # a wrong name fails here too
    check_paper_arguments(built, values["auto_lr"], paper_arguments(values))

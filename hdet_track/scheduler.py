"""``HDETScheduler``: OneCycleLR with fan-out, converge and the auto-LR controller.

This module wires the pure math (:mod:`hdet_track.schedule`, :mod:`hdet_track.controller`),
the explored hyperparameters (:mod:`hdet_track.explore`) and the collective layer
(:mod:`hdet_track.collectives`), and hands events to the tracking hub on rank 0 when
``track`` is set (the backends are imported only then).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR, _enable_get_lr_call

from . import collectives
from .controller import ControllerUpdate, controller_update, softmax_weights
from .errors import CheckpointMismatchError, NonFiniteReplicasError
from .explore import Hyperparam, resolve_explore
from .schedule import (
    _check_spread,
    decay_gamma,
    draw_permutation,
    multipliers,
    permutation_generator,
    replica_values,
)

__all__ = ["HDETScheduler", "SyncReport"]

logger = logging.getLogger(__name__)

# Attributes that are rebuilt from the constructor's arguments instead of being saved.
_NOT_SAVED = frozenset(
    {"optimizer", "_explore", "_gens", "_group", "_model", "_window", "last_sync", "_hub", "_trace", "_config"}
)
# Per-rank facts that a checkpoint from another rank must not overwrite.
_PER_RANK = frozenset({"_rank"})


@dataclass(frozen=True)
class SyncReport:
    """What happened at one sync (converge step), as seen from this rank.

    Attributes:
        step: optimizer steps taken when the sync ran (a multiple of ``sync_every``, or the last step).
        window_losses: mean training loss of each replica over the window (nan where none was given).
        left_out: ranks left out as non-finite (reset to the average of the others).
        divergence: this rank's L2 distance to the average before averaging, relative to the
            average's norm (nan unless ``measure_divergence`` is set; tracking sets it).
        weights: the controller's softmax weight per rank (0 for left-out ranks), or ``None``
            when the controller did not run at this sync.
        updates: per hyperparameter name (``"lr"`` first), one :class:`ControllerUpdate` per
            target (param group, module, ...); empty when the controller did not run.
        permutations: the permutation drawn for each hyperparameter for the next window
            (``perm[r]`` is the multiplier index of rank r).
        onecycle_lr: the LR plain OneCycleLR gives each param group for the next step.
    """

    step: int
    window_losses: list[float]
    left_out: list[int]
    divergence: float
    weights: list[float] | None
    updates: dict[str, list[ControllerUpdate]] = field(default_factory=dict)
    permutations: dict[str, list[int]] = field(default_factory=dict)
    onecycle_lr: list[float] = field(default_factory=list)


def _check_number(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lb = "(" if low_open else "["
        rb = ")" if high_open else "]"
        raise ValueError(f"Expected {name} in {lb}{low}, {high}{rb}, but got {value!r}")
    return float(value)


class HDETScheduler(OneCycleLR):
    r"""OneCycleLR for data-parallel replicas that explore their hyperparameters.

    The N ranks of the process group train with learning rates spread around one shared
    OneCycle base (fan-out); every ``sync_every`` steps the parameters are averaged across
    ranks (converge), and, with ``auto_lr=True``, a controller moves the base toward the
    replicas with lower recent loss. Any other scalar hyperparameter can be explored the
    same way with ``explore=``.

    All of :class:`~torch.optim.lr_scheduler.OneCycleLR`'s arguments keep their meaning;
    with ``spread=0, auto_lr=False`` the learning rates and momenta are bit-identical to
    OneCycleLR's.

    Args:
        optimizer, max_lr, total_steps, epochs, steps_per_epoch, pct_start, anneal_strategy,
        cycle_momentum, base_momentum, max_momentum, div_factor, final_div_factor,
        three_phase, last_epoch: as in :class:`~torch.optim.lr_scheduler.OneCycleLR`.
        spread: alpha in [0, 1): replica r's LR multiplier is
            ``1 + alpha * (r - (N-1)/2) / max((N-1)/2, 0.5)``.
        sync_every: T >= 1: average parameters every T steps (and after the last step).
        auto_lr: run the controller at each sync once ``auto_lr_warmup`` steps are done.
        auto_lr_warmup: steps of plain OneCycle (with spread) before the controller starts,
            in [0, total_steps]. Afterwards the LR is held between syncs.
        temperature: > 0, of the softmax over ``(mean(L) - L_r)``.
        meta_lr: >= 0, step size of the base update.
        meta_momentum: beta in [0, 1) of the velocity.
        lr_bounds: ``(low, high)`` for every param group, or one pair per group; the
            controller keeps the base LR inside. Default per group:
            ``(max_lr / div_factor / final_div_factor, 10 * max_lr)``.
        explore: other hyperparameters to explore: a dict ``{"weight_decay": 0.5}`` of
            param-group keys and spreads, or a list of :mod:`hdet_track.explore` objects
            (dropout of a model, module attributes, setters).
        process_group: the replicas; default the default group, or a world of one when
            torch.distributed is not initialised.
        seed: seeds the private permutation generators (the same on every rank).
        track: log the run: ``True`` (the backend named by ``$HDET_TRACKER``, MLflow when unset),
            ``"mlflow"``, ``"wandb"``, a :class:`hdet_track.tracking.Tracker`, or a list of them.
            Rank 0 owns the one run of the job; the other ranks' losses reach it at syncs.
        log_every: keep every k-th step's per-replica metrics (sync and controller series and
            the event archive are never thinned).
        compare_group: the ``hdet.compare_group`` tag (W&B run group) shared by runs to compare.
        run_name: the tracker run's name.
        close_at_end: end the tracked run when ``total_steps`` is reached (default). With
            ``False`` it stays open for final metrics (``log_metrics``) until :meth:`close`, the
            context manager's exit or the process's exit.
        model: the module whose parameters *and buffers* are averaged (e.g. BatchNorm
            running statistics). Without it, the optimizer's parameters are averaged.
        average_buffers: with ``model``, average its floating and integer buffers too.

    Raises:
        ValueError: an argument is out of range (the message names it and the range).

    Example:
        >>> sched = HDETScheduler(opt, max_lr=0.1, total_steps=2000, spread=0.3,
        ...                       sync_every=100, auto_lr=True, auto_lr_warmup=500)
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
        auto_lr_warmup: int = 0,
        temperature: float = 0.1,
        meta_lr: float = 0.5,
        meta_momentum: float = 0.9,
        lr_bounds: tuple[float, float] | Sequence[tuple[float, float]] | None = None,
        explore: Mapping[str, Any] | Iterable[Hyperparam] | None = None,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
        track: Any = False,
        model: nn.Module | None = None,
        average_buffers: bool = True,
        log_every: int = 1,
        compare_group: str | None = None,
        run_name: str | None = None,
        close_at_end: bool = True,
    ) -> None:
        config = {
            k: v
            for k, v in locals().items()
            if k not in ("self", "optimizer", "explore", "process_group", "track", "model", "__class__")
        }
        self.close_at_end = bool(close_at_end)
        self._hdet_ready = False
        _check_spread("spread", spread)
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"Expected sync_every to be an integer >= 1, but got {sync_every!r}")
        _check_number("temperature", temperature, 0.0, math.inf, low_open=True, high_open=True)
        _check_number("meta_lr", meta_lr, 0.0, math.inf, low_open=False, high_open=True)
        _check_number("meta_momentum", meta_momentum, 0.0, 1.0, low_open=False, high_open=True)
        _check_number("div_factor", div_factor, 0.0, math.inf, low_open=True, high_open=True)
        _check_number("final_div_factor", final_div_factor, 0.0, math.inf, low_open=True, high_open=True)
        if not isinstance(auto_lr, bool):
            raise ValueError(f"Expected auto_lr to be a bool, but got {auto_lr!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"Expected seed to be an int, but got {seed!r}")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"Expected log_every to be an integer >= 1, but got {log_every!r}")
        trackers: list = []
        if track not in (False, None):
            from .tracking.base import resolve_trackers

            trackers = resolve_trackers(track)
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(f"Expected model to be a torch.nn.Module, but got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")

        steps = total_steps
        if steps is None and isinstance(epochs, int) and isinstance(steps_per_epoch, int):
            steps = epochs * steps_per_epoch
        if (
            isinstance(auto_lr_warmup, bool)
            or not isinstance(auto_lr_warmup, int)
            or auto_lr_warmup < 0
            or (isinstance(steps, int) and auto_lr_warmup > steps)
        ):
            raise ValueError(
                f"Expected auto_lr_warmup to be an integer in [0, total_steps={steps}], but got {auto_lr_warmup!r}"
            )

        n_groups = len(optimizer.param_groups)
        max_lrs = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * n_groups
        if len(max_lrs) != n_groups:
            raise ValueError(
                f"max_lr must have the same length as optimizer.param_groups. "
                f"max_lr has {len(max_lrs)} values, param_groups has {n_groups}."
            )
        self._lr_bounds = self._resolve_lr_bounds(lr_bounds, [float(m) for m in max_lrs], div_factor, final_div_factor)

        self._group = process_group
        self._rank, self._world_size = collectives.world(process_group)
        self._model = model
        self.average_buffers = bool(average_buffers)
        self.spread = float(spread)
        self.sync_every = sync_every
        self.auto_lr = auto_lr
        self.auto_lr_warmup = auto_lr_warmup
        self.temperature = float(temperature)
        self.meta_lr = float(meta_lr)
        self.meta_momentum = float(meta_momentum)
        self.seed = seed

        use_beta1 = "betas" in optimizer.defaults
        self._explore = resolve_explore(explore, optimizer, cycle_momentum=cycle_momentum, use_beta1=use_beta1)
        self._explore_names = ["lr"] + [hp.name for hp in self._explore]
        n = self._world_size
        self._rho = {"lr": multipliers(n, self.spread)}
        self._bounds: dict[str, list[tuple[float, float]]] = {"lr": self._lr_bounds}
        self._base: dict[str, list[float] | None] = {"lr": None}
        self._velocity: dict[str, list[float]] = {"lr": [0.0] * n_groups}
        for hp in self._explore:
            base = hp.read()
            self._rho[hp.name] = multipliers(n, hp.spread)
            self._bounds[hp.name] = [hp.bounds] * len(base)
            self._base[hp.name] = base
            self._velocity[hp.name] = [0.0] * len(base)
        # Rank r starts on multiplier r; each sync draws fresh permutations.
        self._perm = {name: list(range(n)) for name in self._explore_names}
        self._gens = {name: permutation_generator(seed, i) for i, name in enumerate(self._explore_names)}
        remaining_syncs = ((steps if isinstance(steps, int) else 0) - auto_lr_warmup) / sync_every
        self._gamma = {"lr": decay_gamma(div_factor, final_div_factor, remaining_syncs)}
        for hp in self._explore:
            self._gamma[hp.name] = 0.0
        self._onecycle: list[float] = []
        # This replica's losses since the last sync (detached tensors or floats), summed at the sync.
        self._window: list[float | torch.Tensor | None] = []
        self.measure_divergence = bool(trackers)
        self._tracking = bool(trackers)
        self._hub: Any = None
        self._trace: list[list[float]] = []
        self._config = config
        self._num_syncs = 0
        self.last_sync: SyncReport | None = None

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
        self._hdet_ready = True
        self._apply_explored()
        if trackers:
            self._start_tracking(trackers, log_every, compare_group, run_name)
        if n == 1 and (self.spread > 0 or any(hp.spread > 0 for hp in self._explore)):
            warnings.warn(
                "HDETScheduler runs on a single replica (no initialised process group, or a group "
                "of one): spread has no effect; parameters are not averaged.",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ public views
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
        return list(self._explore_names)

    @property
    def gamma(self) -> float:
        """The per-sync decay rate of the controller's base LR."""
        return self._gamma["lr"]

    @property
    def lr_bounds(self) -> list[tuple[float, float]]:
        """The bounds the controller keeps each param group's base LR in."""
        return list(self._lr_bounds)

    def multiplier(self, name: str = "lr") -> float:
        """This rank's current multiplier of hyperparameter ``name``."""
        return self._rho[name][self._perm[name][self._rank]]

    def base_values(self, name: str = "lr") -> list[float]:
        """The shared base of ``name`` per target: for ``"lr"`` the OneCycle value until the
        controller takes over, then the controller's base."""
        base = self._base[name]
        return list(self._onecycle) if base is None else list(base)

    def replica_values(self, name: str = "lr") -> list[list[float]]:
        """``values[r][t]``: the value of ``name`` replica r uses on target t right now."""
        return [self._values_for(name, r) for r in range(self._world_size)]

    def onecycle_lrs(self) -> list[float]:
        """What plain OneCycleLR gives each param group at the current step."""
        return list(self._onecycle)

    # ------------------------------------------------------------------ scheduling
    def get_lr(self) -> list[float | torch.Tensor]:
        onecycle = super().get_lr()
        self._onecycle = [float(x) for x in onecycle]
        base = self._base["lr"]
        m = self.multiplier("lr")
        if base is None:
            if m == 1.0:
                return onecycle
            return [x * m for x in onecycle]
        return [b * m for b in base]

    def step(self, loss: float | torch.Tensor | None = None, epoch: int | None = None) -> None:  # type: ignore[override]
        """Advance one optimizer step; call after ``optimizer.step()``.

        Args:
            loss: this replica's training loss for the step just taken (a float or a
                one-element tensor; it is detached and not synchronised). Required with
                ``auto_lr=True``.
            epoch: not supported (deprecated in PyTorch); must be ``None``.

        Raises:
            ValueError: a non-scalar loss, or no loss while auto-LR is on.
            NonFiniteReplicasError: every replica is non-finite at a sync.
        """
        if not self._hdet_ready:  # the initial step inside LRScheduler.__init__
            super().step()
            return
        if epoch is not None:
            raise ValueError(
                f"Expected epoch=None (HDETScheduler steps one optimizer step at a time), but got {epoch!r}"
            )
        self._accumulate(loss)
        k = self.last_epoch + 1
        if self._hub is not None:
            self._trace.append(self._onecycle)
        report = None
        if k % self.sync_every == 0 or k == self.total_steps:
            report = self._sync(k)
        super().step()
        if report is not None:
            self.last_sync = replace(report, onecycle_lr=list(self._onecycle))
        if self._hub is not None:
            self._hub.note_step(k)
            if k == self.total_steps and self.close_at_end and not self._hub.ended:
                # Ends the run without waiting for the writer; flush(), close() or exit wait.
                self._hub.close("FINISHED", None, step=k, wait=False)

    def _accumulate(self, loss: float | torch.Tensor | None) -> None:
        if loss is None:
            if self.auto_lr:
                raise ValueError(
                    "Expected step(loss) with this replica's training loss while auto_lr=True, but got no loss"
                )
            self._window.append(None)
            return
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"Expected loss to be a scalar (a float or a one-element tensor), but got a tensor of shape {tuple(loss.shape)}"
                )
            self._window.append(loss.detach())
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            self._window.append(float(loss))
        else:
            raise ValueError(f"Expected loss to be a float or a one-element tensor, but got {type(loss).__name__}")

    def _window_stats(self, per_step: bool) -> tuple[float, int, list[float]]:
        """The window's loss sum (float64, summed in the same order after a resume), the number of
        losses given, and (with ``per_step``) every step's loss, nan where none was given."""
        given = [x for x in self._window if x is not None]
        if not given:
            return math.nan, 0, [math.nan] * len(self._window) if per_step else []
        device = next((x.device for x in given if isinstance(x, torch.Tensor)), torch.device("cpu"))
        stacked = torch.stack(
            [
                x.reshape(()).to(device=device, dtype=torch.float64)
                if isinstance(x, torch.Tensor)
                else torch.tensor(x, dtype=torch.float64, device=device)
                for x in given
            ]
        )
        total = float(stacked.sum())
        if not per_step:
            return total, len(given), []
        values = iter(stacked.cpu().tolist())
        return total, len(given), [math.nan if x is None else next(values) for x in self._window]

    def _values_for(self, name: str, rank: int) -> list[float]:
        bounds = None if name == "lr" else self._bounds[name]
        return replica_values(self.base_values(name), self._rho[name], self._perm[name], rank, bounds)

    def _apply_explored(self) -> None:
        for hp in self._explore:
            hp.write(self._values_for(hp.name, self._rank))

    def _sync_tensors(self) -> list[torch.Tensor]:
        if self._model is not None:
            tensors = list(self._model.parameters())
            if self.average_buffers:
                tensors += list(self._model.buffers())
            return tensors
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _sync(self, step: int) -> SyncReport:
        n = self._world_size
        buckets = collectives.make_buckets(self._sync_tensors())
        finite = collectives.buckets_finite(buckets)
        wsum, wcount, per_step = self._window_stats(per_step=self._tracking)
        rows = collectives.all_gather_rows([wsum, float(wcount), 1.0 if finite else 0.0, *per_step], self._group)
        losses = [r[0] / r[1] if r[1] > 0 else math.nan for r in rows]
        healthy = [r[2] == 1.0 and (r[1] == 0 or math.isfinite(loss)) for r, loss in zip(rows, losses)]
        if not any(healthy):
            if self._hub is not None:  # the diverged window is part of the run's record
                self._emit_window(rows, [math.nan] * n, list(range(n)), step)
            raise NonFiniteReplicasError(step, n, losses)
        ok = [r for r in range(n) if healthy[r]]
        left_out = [r for r in range(n) if not healthy[r]]
        divergence = 0.0 if n == 1 else math.nan
        if n > 1:
            d_sq, norm_sq = collectives.average_buckets(
                buckets,
                self._group,
                contribute=healthy[self._rank],
                num_contributors=len(ok),
                measure=self.measure_divergence,
            )
            if self.measure_divergence:
                divergence = collectives.relative_divergence(d_sq, norm_sq)
            if left_out:
                logger.warning(
                    "HDET sync at step %d: replicas %s were non-finite and were reset to the average of the others",
                    step,
                    left_out,
                )
            if not healthy[self._rank]:
                self._clear_nonfinite_optimizer_state()

        divergences = [divergence]
        if self._tracking and n > 1:
            divergences = [row[0] for row in collectives.all_gather_rows([divergence], self._group)]
        if self._hub is not None:
            self._emit_window(rows, divergences, left_out, step)

        weights = None
        updates: dict[str, list[ControllerUpdate]] = {}
        if self.auto_lr and step >= self.auto_lr_warmup and all(rows[r][1] > 0 for r in ok):
            w_ok = softmax_weights([losses[r] for r in ok], self.temperature)
            weights = [0.0] * n
            for r, w in zip(ok, w_ok):
                weights[r] = w
            for name in self._explore_names:
                per_rank = [self._values_for(name, r) for r in ok]
                base = self.base_values(name)
                results = [
                    controller_update(
                        [v[t] for v in per_rank],
                        w_ok,
                        base[t],
                        self._velocity[name][t],
                        meta_lr=self.meta_lr,
                        meta_momentum=self.meta_momentum,
                        gamma=self._gamma[name],
                        bounds=self._bounds[name][t],
                    )
                    for t in range(len(base))
                ]
                updates[name] = results
                self._base[name] = [u.base_after for u in results]
                self._velocity[name] = [u.velocity for u in results]

        for name in self._explore_names:
            self._perm[name] = draw_permutation(n, self._gens[name])
        self._apply_explored()
        if self._hub is not None and weights is not None:
            self._emit_controller(step, weights, updates)
        self._window = []
        self._num_syncs += 1
        return SyncReport(
            step=step,
            window_losses=losses,
            left_out=left_out,
            divergence=divergence,
            weights=weights,
            updates=updates,
            permutations={k: list(v) for k, v in self._perm.items()},
        )

    # ------------------------------------------------------------------ tracking
    def start_tracking(
        self, track: Any, *, log_every: int = 1, compare_group: str | None = None, run_name: str | None = None
    ) -> None:
        """Start tracking a scheduler built with ``track=False`` (call on every rank, before the
        first ``step``): for integrations whose tracker run exists only once training begins."""
        from .tracking.base import resolve_trackers

        if self._hub is not None or self._tracking:
            raise ValueError("Expected a scheduler that is not tracked yet, but it already is")
        if self.last_epoch > 0:
            raise ValueError(f"Expected start_tracking() before the first step, but {self.last_epoch} steps were taken")
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"Expected log_every to be an integer >= 1, but got {log_every!r}")
        trackers = resolve_trackers(track)
        if trackers:
            self._tracking = True
            self.measure_divergence = True
            self._config.update(log_every=log_every, compare_group=compare_group, run_name=run_name)
            self._start_tracking(trackers, log_every, compare_group, run_name)

    def _start_tracking(self, trackers: list, log_every: int, compare_group: str | None, run_name: str | None) -> None:
        import platform
        import socket
        import time

        from . import __version__
        from .events import RunStart
        from .tracking.hub import TrackingHub

        hostnames = [socket.gethostname()]
        if self._world_size > 1:
            gathered: list[Any] = [None] * self._world_size
            dist.all_gather_object(gathered, hostnames[0], group=self._group)
            hostnames = [str(h) for h in gathered]
        if self._rank != 0:
            return
        for t in trackers:
            if run_name and hasattr(t, "run_name") and not t.run_name:
                t.run_name = run_name
        explored = []
        n_groups = len(self.optimizer.param_groups)
        explored.append(
            {
                "name": "lr",
                "spread": self.spread,
                "bounds": [list(b) for b in self._lr_bounds],
                "targets": [f"pg{g}" for g in range(n_groups)],
                "multipliers": self._rho["lr"],
            }
        )
        for hp in self._explore:
            explored.append(
                {
                    "name": hp.name,
                    "spread": hp.spread,
                    "bounds": [list(b) for b in self._bounds[hp.name]],
                    "targets": hp.labels(),
                    "multipliers": self._rho[hp.name],
                }
            )
        hdet = self.spread > 0 or self.auto_lr or any(hp.spread > 0 for hp in self._explore)
        config = dict(self._config)
        config["total_steps"] = self.total_steps
        config["optimizer"] = type(self.optimizer).__name__
        config["gamma"] = self._gamma["lr"]
        start = RunStart(
            config=config,
            world_size=self._world_size,
            schedule="hdet" if hdet else "onecycle",
            param_groups=[str(g.get("name", f"pg{i}")) for i, g in enumerate(self.optimizer.param_groups)],
            explored=explored,
            versions={"hdet_track": __version__, "torch": torch.__version__, "python": platform.python_version()},
            hostnames=hostnames,
            compare_group=compare_group,
            time=time.time(),
        )
        self._hub = TrackingHub(trackers, log_every=log_every)
        self._hub.start(start)

    def _emit_window(self, rows: list[list[float]], divergences: list[float], left_out: list[int], step: int) -> None:
        from .events import Converge
        from .tracking.hub import WindowPayload

        count = len(self._trace)
        losses = [list(row[3 : 3 + count]) for row in rows]
        base = self._base["lr"]
        self._hub.window(
            WindowPayload(
                steps=list(range(step - count + 1, step + 1)),
                onecycle=self._trace,
                lr_base=None if base is None else list(base),
                bases={hp.name: list(self._base[hp.name] or []) for hp in self._explore},
                perms={k: list(v) for k, v in self._perm.items()},
                losses=losses,
            )
        )
        self._trace = []
        window_losses = [r[0] / r[1] if r[1] > 0 else math.nan for r in rows]
        self._hub.event(Converge(step=step, window_losses=window_losses, divergence=divergences, left_out=left_out))

    def _emit_controller(self, step: int, weights: list[float], updates: dict[str, list[ControllerUpdate]]) -> None:
        from .events import ControllerDecision

        for name, results in updates.items():
            self._hub.event(
                ControllerDecision(
                    step=step,
                    name=name,
                    weights=list(weights),
                    delta=[u.delta for u in results],
                    velocity=[u.velocity for u in results],
                    base_before=[u.base_before for u in results],
                    base_after=[u.base_after for u in results],
                    gamma=self._gamma[name],
                    permutation=list(self._perm[name]),
                    onecycle=list(self._onecycle) if name == "lr" else None,
                )
            )

    @property
    def tracking(self) -> bool:
        """Whether this job logs to a tracker (on every rank; rank 0 owns the run)."""
        return self._tracking

    @property
    def run_ids(self) -> dict[str, str | None]:
        """Rank 0: the tracker run id of each backend (after its first write); elsewhere empty."""
        if self._hub is None:
            return {}
        return {t.name or type(t).__name__: t.run_id for t in self._hub.trackers}

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log extra metrics (validation loss, accuracy, ...) into the run, on rank 0; a no-op elsewhere."""
        if self._hub is not None:
            self._hub.metrics(dict(metrics), self.last_epoch if step is None else step)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Block until what was logged so far reached the trackers (rank 0). True when it did."""
        return True if self._hub is None else self._hub.flush(timeout)

    def close(self, status: str = "FINISHED", error: str | None = None) -> None:
        """End the tracked run (FINISHED, FAILED or KILLED) and stop the writer; idempotent.

        Runs also end by themselves at ``total_steps``, at process exit, or when the scheduler is
        used as a context manager (an exception makes the run FAILED, Ctrl-C KILLED).
        """
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"Expected status in ('FINISHED', 'FAILED', 'KILLED'), but got {status!r}")
        if self._hub is not None:
            self._hub.close(status, error, step=self.last_epoch)

    def __enter__(self) -> HDETScheduler:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            import traceback

            killed = issubclass(exc_type, KeyboardInterrupt)
            text = "".join(traceback.format_exception(exc_type, exc, tb))[-4000:]
            self.close("KILLED" if killed else "FAILED", text)

    def _clear_nonfinite_optimizer_state(self) -> None:
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = state.get(p)
                if not st:
                    continue
                bad = any(
                    isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
                    for v in st.values()
                )
                if bad:
                    del state[p]

    @staticmethod
    def _resolve_lr_bounds(
        lr_bounds: Any, max_lrs: list[float], div_factor: float, final_div_factor: float
    ) -> list[tuple[float, float]]:
        n = len(max_lrs)
        if lr_bounds is None:
            return [(m / div_factor / final_div_factor, 10.0 * m) for m in max_lrs]
        pairs: list[Any]
        if (
            isinstance(lr_bounds, (tuple, list))
            and len(lr_bounds) == 2
            and all(isinstance(b, (int, float)) for b in lr_bounds)
        ):
            pairs = [lr_bounds] * n
        elif isinstance(lr_bounds, (tuple, list)) and len(lr_bounds) == n:
            pairs = list(lr_bounds)
        else:
            raise ValueError(
                f"Expected lr_bounds as (low, high) or one (low, high) per param group ({n}), but got {lr_bounds!r}"
            )
        out = []
        for g, (pair, m) in enumerate(zip(pairs, max_lrs)):
            try:
                low, high = (float(x) for x in pair)
            except (TypeError, ValueError):
                raise ValueError(f"Expected lr_bounds[{g}] as (low, high), but got {pair!r}") from None
            if not 0.0 <= low < high:
                raise ValueError(f"Expected lr_bounds[{g}] with 0 <= low < high, but got {pair!r}")
            if not low <= m <= high:
                raise ValueError(
                    f"Expected lr_bounds[{g}] = {pair!r} to contain the base max_lr {m} of param group {g}, but it excludes it"
                )
            out.append((low, high))
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: OneCycle's state, bases, velocities, permutations,
        the permutation generators' states, the loss window and the step.

        Only plain Python values and tensors, so ``torch.load(weights_only=True)`` reads it.
        """
        state = {k: v for k, v in self.__dict__.items() if k not in _NOT_SAVED}
        state["_gen_states"] = {name: g.get_state() for name, g in self._gens.items()}
        state["_window"] = [None if x is None else float(x) for x in self._window]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output and re-apply this rank's hyperparameters.

        A checkpoint of any rank can be loaded on any rank of a job with the same number of
        replicas and the same explored hyperparameters (each rank keeps its own identity; the
        partial loss window is exact only when every rank loads its own checkpoint).

        Raises:
            CheckpointMismatchError: the replica count or explored names differ.
        """
        state = dict(state_dict)
        if "_world_size" in state and state["_world_size"] != self._world_size:
            raise CheckpointMismatchError(
                f"Expected a checkpoint of {self._world_size} replicas, but it holds {state['_world_size']}; "
                "resume with the same number of replicas"
            )
        if "_explore_names" in state and list(state["_explore_names"]) != self._explore_names:
            raise CheckpointMismatchError(
                f"Expected a checkpoint exploring {self._explore_names}, but it explores {state['_explore_names']}"
            )
        gen_states = state.pop("_gen_states", {})
        window = list(state.pop("_window", []))
        for key in _PER_RANK | _NOT_SAVED:
            state.pop(key, None)
        self.__dict__.update(state)
        for name, gen_state in gen_states.items():
            self._gens[name].set_state(gen_state)
        self._window = window
        self._refresh()

    def _refresh(self) -> None:
        """Re-apply this rank's LRs (and momenta) for the current step, and its explored values."""
        with _enable_get_lr_call(self):
            values = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, values):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr
        self._last_lr = [
            g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in self.optimizer.param_groups
        ]
        self._apply_explored()

"""``wrap``: turn what a training loop already has into an ``HDETScheduler``."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import OneCycleLR

from ..scheduler import HDETScheduler

__all__ = ["wrap", "onecycle_arguments"]

SUPPORTED = (
    "a torch.optim.lr_scheduler.OneCycleLR, a torch.optim.Optimizer (with max_lr and total_steps), "
    "a Lightning Trainer (lightning.pytorch.Trainer) or a Hugging Face transformers.Trainer"
)


def _is_hf_trainer(obj: Any) -> bool:
    return any(c.__name__ == "Trainer" and c.__module__.startswith("transformers") for c in type(obj).__mro__)


def _is_lightning_trainer(obj: Any) -> bool:
    return any(
        c.__name__ == "Trainer" and c.__module__.startswith(("lightning.pytorch", "pytorch_lightning"))
        for c in type(obj).__mro__
    )


def onecycle_arguments(scheduler: OneCycleLR) -> dict[str, Any]:
    """The constructor arguments a ``OneCycleLR`` was built with, read back from its state."""
    groups = scheduler.optimizer.param_groups
    phases = scheduler._schedule_phases
    total = scheduler.total_steps
    first = groups[0]
    anneal = getattr(scheduler, "_anneal_func_type", None)
    if anneal is None:  # schedulers pickled by old PyTorch versions
        anneal = "cos" if getattr(scheduler, "anneal_func", None) == scheduler._annealing_cos else "linear"
    args: dict[str, Any] = {
        "max_lr": [g["max_lr"] for g in groups],
        "total_steps": total,
        "pct_start": (phases[0]["end_step"] + 1) / total,
        "anneal_strategy": anneal,
        "cycle_momentum": scheduler.cycle_momentum,
        "div_factor": first["max_lr"] / first["initial_lr"],
        "final_div_factor": first["initial_lr"] / first["min_lr"],
        "three_phase": len(phases) == 3,
    }
    if scheduler.cycle_momentum:
        args["base_momentum"] = [g["base_momentum"] for g in groups]
        args["max_momentum"] = [g["max_momentum"] for g in groups]
    return args


def wrap(obj: Any, **hdet_kwargs: Any) -> Any:
    """Return an ``HDETScheduler`` for ``obj``, with HDET's keyword arguments (``spread``,
    ``sync_every``, ``auto_lr``, ``track``, ...).

    - A ``OneCycleLR``: its arguments and its progress are carried over (the new scheduler
      continues at the same step; with ``spread=0, auto_lr=False`` the LRs are unchanged). Step
      the returned scheduler from now on, with the loss: ``sched.step(loss)``.
    - An optimizer: ``max_lr`` and ``total_steps`` (or ``epochs`` and ``steps_per_epoch``) are
      required keyword arguments, as for ``OneCycleLR``.
    - A Lightning ``Trainer``: adds an :class:`~hdet_track.integrations.lightning.HDETCallback`
      and returns the trainer.
    - A Hugging Face ``transformers.Trainer``: its scheduler becomes HDET (see
      :mod:`hdet_track.integrations.transformers`); returns the trainer.

    Raises:
        TypeError: ``obj`` is something else (the message says what is supported).

    Example:
        >>> sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10_000)
        >>> sched = hdet_track.wrap(sched, spread=0.3, sync_every=100, auto_lr=True, track=True)
    """
    if isinstance(obj, HDETScheduler):
        raise TypeError("Expected a scheduler to wrap, but got an HDETScheduler already")
    if isinstance(obj, OneCycleLR):
        clash = sorted(set(hdet_kwargs) & set(onecycle_arguments(obj)))
        if clash:
            raise TypeError(f"wrap() takes OneCycleLR's arguments from the scheduler; do not pass {clash}")
        sched = HDETScheduler(obj.optimizer, **onecycle_arguments(obj), **hdet_kwargs)
        if obj.last_epoch > 0:
            sched.last_epoch = obj.last_epoch
            sched._step_count = obj._step_count
            sched._refresh()
        return sched
    if _is_hf_trainer(obj):
        from .transformers import wrap_trainer as wrap_hf

        return wrap_hf(obj, **hdet_kwargs)
    if _is_lightning_trainer(obj):
        from .lightning import wrap_trainer

        return wrap_trainer(obj, **hdet_kwargs)
    if isinstance(obj, torch.optim.Optimizer):
        if "max_lr" not in hdet_kwargs:
            raise TypeError("wrap(optimizer, ...) needs max_lr= and total_steps= (as OneCycleLR does)")
        return HDETScheduler(obj, **hdet_kwargs)
    raise TypeError(f"hdet_track.wrap supports {SUPPORTED}; got {type(obj).__module__}.{type(obj).__name__}")

"""``wrap``: turn what a training loop already has into an ``HDETScheduler``."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import OneCycleLR

from ..scheduler import HDETScheduler

__all__ = ["wrap"]

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
        return HDETScheduler.from_onecycle(obj, **hdet_kwargs)
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

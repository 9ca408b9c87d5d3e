"""hdet-track: Hyperparameter-Divergent Ensemble Training for PyTorch, observable.

Example:
    >>> from hdet_track import HDETScheduler
    >>> sched = HDETScheduler(optimizer, max_lr=0.1, total_steps=1000, spread=0.3,
    ...                       sync_every=50, auto_lr=True)
    >>> loss.backward(); optimizer.step(); sched.step(loss)
"""

from __future__ import annotations

from . import explore
from ._version import __version__
from .collectives import average_parameters
from .controller import Controller, DriftController, PaperController, controller_update, softmax_weights
from .errors import CheckpointMismatchError, HDETError, NonFiniteReplicasError
from .integrations.wrap import wrap
from .noise import warm_noisy_init
from .record import ControllerUpdate, SchedulerCallback, SyncRecord
from .schedule import decay_gamma, multipliers
from .scheduler import HDETScheduler, SyncReport

__all__ = [
    "HDETScheduler",
    "SyncReport",
    "SyncRecord",
    "SchedulerCallback",
    "Controller",
    "DriftController",
    "PaperController",
    "wrap",
    "explore",
    "warm_noisy_init",
    "average_parameters",
    "multipliers",
    "decay_gamma",
    "softmax_weights",
    "controller_update",
    "ControllerUpdate",
    "HDETError",
    "NonFiniteReplicasError",
    "CheckpointMismatchError",
    "__version__",
]

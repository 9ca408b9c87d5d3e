"""hdet-track: Hyperparameter-Divergent Ensemble Training for PyTorch, observable.

Example:
    >>> from hdet_track import HDETScheduler
    >>> sched = HDETScheduler(optimizer, max_lr=0.1, total_steps=1000, spread=0.3,
    ...                       sync_every=50, auto_lr=True)
    >>> loss.backward(); optimizer.step(); sched.step(loss)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import CheckpointMismatchError, HDETError, NonFiniteReplicasError

# Where each public name lives. They are imported on first use (PEP 562), so that a process that
# only reads or writes runs (`hdet-track compare`, the dashboard, the MLflow writer process) does
# not pay for importing torch; `from hdet_track import HDETScheduler` works as before.
_HOME = {
    "HDETScheduler": ".scheduler",
    "SyncReport": ".scheduler",
    "SyncRecord": ".record",
    "SchedulerCallback": ".record",
    "ControllerUpdate": ".record",
    "Controller": ".controller",
    "DriftController": ".controller",
    "PaperController": ".controller",
    "controller_update": ".controller",
    "softmax_weights": ".controller",
    "wrap": ".integrations.wrap",
    "warm_noisy_init": ".noise",
    "average_parameters": ".collectives",
    "multipliers": ".schedule",
    "decay_gamma": ".schedule",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from . import explore
    from .collectives import average_parameters
    from .controller import Controller, DriftController, PaperController, controller_update, softmax_weights
    from .integrations.wrap import wrap
    from .noise import warm_noisy_init
    from .record import ControllerUpdate, SchedulerCallback, SyncRecord
    from .schedule import decay_gamma, multipliers
    from .scheduler import HDETScheduler, SyncReport


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is not None:
        value = getattr(importlib.import_module(home, __name__), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # a submodule: `hdet_track.explore`
    else:
        raise AttributeError(f"module 'hdet_track' has no attribute {name!r}")
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# Spelled out (not derived from _HOME) so that linters and IDEs see it; tests/test_imports.py
# checks that every name resolves.
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

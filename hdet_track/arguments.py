"""What :class:`~hdet_track.scheduler.HDETScheduler` accepts: its arguments checked before anything
is built (errors name the argument, the value and what is allowed), the configuration a run records,
and the arguments a ``OneCycleLR`` was built with (to continue it)."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR

from ._checks import check_bool, check_int, check_number, integer, real
from .callbacks import check_track_settings
from .controller import Controller, PaperController
from .record import SchedulerCallback
from .schedule import _check_spread

__all__ = [
    "check_arguments",
    "check_paper_arguments",
    "check_values",
    "check_whole_replicas",
    "checked_callbacks",
    "checked_loss",
    "max_lrs",
    "onecycle_arguments",
    "paper_arguments",
    "recorded_config",
    "resolve_lr_bounds",
]


def paper_arguments(values: Mapping[str, Any]) -> dict[str, Any]:
    """The paper controller's settings; a one-element tensor as its Python number (the controller's
    arithmetic would make every LR a tensor), NumPy scalars as they are (their precision is kept)."""
    given = {
        "warmup": values["auto_lr_warmup"],
        "temperature": values["temperature"],
        "meta_lr": values["meta_lr"],
        "meta_momentum": values["meta_momentum"],
    }
    return {k: v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for k, v in given.items()}


def check_values(args: Mapping[str, Any]) -> None:
    """HDET's own keyword arguments that need neither the optimizer nor the model: errors name the
    argument, the value and what is allowed."""
    _check_spread("spread", args["spread"])
    check_int("sync_every", args["sync_every"], 1)
    check_number("temperature", args["temperature"], 0.0, math.inf, low_open=True, high_open=True)
    check_number("meta_lr", args["meta_lr"], 0.0, math.inf, low_open=False, high_open=True)
    check_number("meta_momentum", args["meta_momentum"], 0.0, 1.0, low_open=False, high_open=True)
    check_int("auto_lr_warmup", args["auto_lr_warmup"], 0)
    if not isinstance(args["auto_lr"], bool):
        raise ValueError(f"Expected auto_lr to be a bool, but got {args['auto_lr']!r}")
    seed = args["seed"]
    if integer(seed) is None:
        raise ValueError(f"Expected seed to be an integer, but got {seed!r}")
    group = args["process_group"]
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"Expected process_group to be a torch.distributed.ProcessGroup or None, but got {group!r}")
    check_bool("average_buffers", args["average_buffers"])
    check_track_settings(args["log_every"], args["compare_group"], args["run_name"], args["close_at_end"])


def check_arguments(args: Mapping[str, Any]) -> None:
    """The scheduler's own arguments (``args``: its constructor's, by name; OneCycleLR checks its own):
    errors name the argument, the value and what is allowed."""
    total_steps, epochs, per_epoch = args["total_steps"], args["epochs"], args["steps_per_epoch"]
    if total_steps is None and isinstance(epochs, int) and isinstance(per_epoch, int):
        total_steps = epochs * per_epoch
    model, optimizer = args["model"], args["optimizer"]
    check_values(args)
    check_number("div_factor", args["div_factor"], 0.0, math.inf, low_open=True, high_open=True)
    check_number("final_div_factor", args["final_div_factor"], 0.0, math.inf, low_open=True, high_open=True)
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"Expected model to be a torch.nn.Module, but got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{type(optimizer).__name__} is not an Optimizer")
    warmup = args["auto_lr_warmup"]
    if warmup > (total_steps if isinstance(total_steps, int) else math.inf):
        raise ValueError(
            f"Expected auto_lr_warmup to be an integer in [0, total_steps={total_steps}], but got {warmup!r}"
        )


def check_whole_replicas(optimizer: torch.optim.Optimizer, model: nn.Module | None, buffers: bool) -> None:
    """Every rank must hold a whole replica of what is averaged (as ``_sync_tensors`` picks it):
    HDET averages each rank's tensors with the others', and a shard (FSDP, FSDP2's
    ``fully_shard``, tensor parallel) averaged with other ranks' shards is another tensor's slice,
    not the same tensor trained differently."""
    # loaded already wherever such a module or tensor exists: nothing to import here
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", None)
    dtensors = tuple(
        cls
        for module in ("torch.distributed.tensor", "torch.distributed._tensor")  # torch >= 2.5, and before
        if (cls := getattr(sys.modules.get(module), "DTensor", None)) is not None
    )
    if model is not None and fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        raise ValueError(_sharded_message("model", "is wrapped in FullyShardedDataParallel (FSDP)"))
    if model is None:
        tensors = [
            (f"optimizer parameter {i} of param group {g}", p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
    else:
        named = [*model.named_parameters(), *(model.named_buffers() if buffers else [])]
        tensors = [(f"model's {name!r}", t) for name, t in named]
    for where, t in tensors:
        if getattr(t, "_is_flat_param", False) or getattr(t, "_fsdp_flattened", False):
            raise ValueError(_sharded_message(where, "is sharded by FSDP (a flat parameter or a view into one)"))
        if dtensors and isinstance(t, dtensors):
            placed = f"is a DTensor placed {tuple(t.placements)} over a device mesh (fully_shard, tensor parallel)"
            raise ValueError(_sharded_message(where, placed))


def _sharded_message(what: str, why: str) -> str:
    return (
        f"Expected every rank to hold a whole replica (plain tensors: single-device modules or DDP), but "
        f"the {what} {why}: HDET averages each rank's whole replica with the others', and a shard "
        f"averaged with other ranks' shards is not that. Train with DDP or plain replicas."
    )


_PAPER_DEFAULTS = PaperController().settings()
_PAPER_NAMES = {"warmup": "auto_lr_warmup"}


def check_paper_arguments(controller: Controller, auto_lr: bool, paper: dict[str, Any]) -> None:
    """The paper controller's settings must not be given to another controller, which would ignore them
    (``auto_lr_warmup`` also serves the drift controller when it is built from its name)."""
    if not auto_lr or isinstance(controller, PaperController):
        return
    own_warmup = getattr(controller, "warmup", None)
    ignored = [k for k, v in paper.items() if v != _PAPER_DEFAULTS[k] and not (k == "warmup" and own_warmup == v)]
    if ignored:
        given = ", ".join(f"{_PAPER_NAMES.get(k, k)}={paper[k]!r}" for k in ignored)
        name = controller.name or type(controller).__name__
        raise ValueError(
            f"Expected {given} only with controller='paper', but got controller={name!r}, which does not use "
            f"{'it' if len(ignored) == 1 else 'them'} (give its settings to its object, e.g. "
            "controller=DriftController(...))"
        )


def checked_callbacks(callbacks: Any) -> list[SchedulerCallback]:
    """``callbacks`` as a list, each with the :class:`SchedulerCallback` hooks."""
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise TypeError(f"Expected callbacks to be an iterable of SchedulerCallback objects, but got {callbacks!r}")
    items = list(callbacks)
    hooks = [name for name in vars(SchedulerCallback) if name.startswith("on_")]
    for i, cb in enumerate(items):
        missing = [h for h in hooks if not callable(getattr(cb, h, None))]
        if missing:
            raise TypeError(
                f"Expected callbacks[{i}] to be a SchedulerCallback (with {', '.join(hooks)}), but got {cb!r} "
                f"(missing {', '.join(missing)})"
            )
    return items


def max_lrs(max_lr: Any, n: int) -> list[float]:
    """One checked max_lr per param group."""
    if not isinstance(max_lr, (list, tuple)):
        return [check_number("max_lr", max_lr, 0.0, math.inf, low_open=True, high_open=True)] * n
    if len(max_lr) != n:
        raise ValueError(
            f"max_lr must have the same length as optimizer.param_groups. "
            f"max_lr has {len(max_lr)} values, param_groups has {n}."
        )
    return [check_number(f"max_lr[{g}]", m, 0.0, math.inf, low_open=True, high_open=True) for g, m in enumerate(max_lr)]


def resolve_lr_bounds(
    lr_bounds: Any, max_lrs: list[float], div_factor: float, final_div_factor: float
) -> list[tuple[float, float]]:
    """One (low, high) per param group: ``lr_bounds`` checked against ``max_lrs``, or the default."""
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


def recorded_config(values: Mapping[str, Any], controller: Any) -> dict[str, Any]:
    """The constructor's arguments as the run records them: numbers, strings, bools and lists of them
    (not the optimizer, the model, the callbacks or the tracker), the controller by its name."""
    config = {k: _as_plain(v) for k, v in values.items() if k not in ("self", "last_epoch", "track")}
    config = {k: v for k, v in config.items() if _plain(v)}
    config["controller"] = getattr(controller, "name", controller)
    return config


def _as_plain(value: Any) -> Any:
    """A NumPy or one-element tensor scalar (a sweep's config gives them) as the Python number it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(_as_plain(v) for v in value)
    if isinstance(value, (bool, str)) or value is None:
        return value
    whole = integer(value)
    if whole is not None:
        return whole
    number = real(value)
    return value if number is None else number


def _plain(value: Any) -> bool:
    """Whether ``value`` is a number, string, bool, None, or a list/tuple of them (a loggable setting)."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, (int, float, str, bool, type(None)))


def checked_loss(loss: float | torch.Tensor | None, required: bool) -> float | torch.Tensor | None:
    """The loss given to ``step()``: a detached one-element tensor or a float (``required`` with auto-LR)."""
    if loss is None:
        if required:
            raise ValueError(
                "Expected step(loss) with this replica's training loss while auto_lr=True, but got no loss "
                "(SequentialLR and ChainedScheduler step their schedulers without one: use auto_lr=False there)"
            )
        return None
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1 or loss.is_complex():
            raise ValueError(
                f"Expected loss to be a real scalar (a float or a one-element real tensor), but got a tensor "
                f"of dtype {loss.dtype} and shape {tuple(loss.shape)}"
            )
        return loss.detach()
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        try:
            return float(loss)
        except OverflowError:
            return math.inf  # an int too large for a float: a blown-up loss
    raise ValueError(f"Expected loss to be a float or a one-element tensor, but got {type(loss).__name__}")

"""The scheduler's checkpoint format: its version, the upgrade of hdet-track 0.1's flat
checkpoints, and the checks that a checkpoint belongs to the job loading it.

Format 2 (:meth:`hdet_track.HDETScheduler.state_dict`) holds only plain Python values and tensors:
``onecycle`` (OneCycleLR's own state), ``world_size``, ``explored``, ``permutations`` and
``generators`` and ``references`` (:class:`~hdet_track.fanout.FanOut`), ``controller`` (name, state
and constructor ``settings``), ``settings`` (max_lr, total_steps, sync_every, spreads, param groups: what a
job must share with the checkpoint to resume exactly), ``window`` (this rank's partial window;
``windows``: every rank's), ``averager`` (the kept consensus) and ``runs`` (the tracked runs' ids).
Checkpoints without ``settings``/``references`` (older ones) still load.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from .errors import CheckpointMismatchError

__all__ = ["FORMAT", "upgrade", "check_compatible"]

FORMAT = 2


def upgrade(state: dict[str, Any], onecycle_keys: Collection[str], num_groups: int) -> dict[str, Any]:
    """``state`` in format 2: as it is, or hdet-track 0.1's flat checkpoint reshaped (the paper
    controller's state; the partial window's OneCycle values, which 0.1 did not save, as nan)."""
    if state.get("format") == FORMAT:
        return state
    if "_world_size" not in state:
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
        if _as_lists(mine[key]) != _as_lists(saved[key])
    ]


def _as_lists(value: Any) -> Any:
    """Tuples as lists, at any depth (``base_momentum=(0.85, 0.8)`` saved, ``[0.85, 0.8]`` given)."""
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    return value

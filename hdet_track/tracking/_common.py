"""Helpers shared by the backends: flattening the run config into params."""

from __future__ import annotations

import json
import logging
from typing import Any

from ..events import RunStart
from .base import mask_secrets, redact


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = value


def run_params(run_start: RunStart) -> dict[str, str]:
    """Every config value (flattened with '.'), explored hyperparameters, world size and hosts."""
    flat: dict[str, Any] = {}
    flatten("", run_start.config, flat)
    for spec in run_start.explored:
        flat[f"explore.{spec.name}.spread"] = spec.spread
        flat[f"explore.{spec.name}.bounds"] = [list(b) for b in spec.bounds]
        flat[f"explore.{spec.name}.targets"] = spec.targets
        flat[f"explore.{spec.name}.series_keys"] = spec.series_keys
    flat["controller"] = run_start.controller
    flat["world_size"] = run_start.world_size
    flat["param_groups"] = run_start.param_groups
    flat["hostnames"] = run_start.hostnames
    for k, v in run_start.versions.items():
        flat[f"version.{k}"] = v
    flat = redact(flat)
    out = {}
    for k, v in flat.items():
        text = v if isinstance(v, str) else json.dumps(v, default=str)
        out[k] = text[:500]
    return out


def run_tags(run_start: RunStart) -> dict[str, str]:
    from ..events import SCHEMA_VERSION

    tags = {
        "hdet.schedule": run_start.schedule,
        "hdet.controller": run_start.controller,
        "hdet.schema_version": str(SCHEMA_VERSION),
        "hdet.world_size": str(run_start.world_size),
    }
    if run_start.compare_group:
        tags["hdet.compare_group"] = mask_secrets(run_start.compare_group)  # as the W&B group
    return tags


def warn_second_training(backend: str, run_id: str, through: str | None = None) -> None:
    """A training from its first step in a given run that already holds an earlier HDET training."""
    logging.getLogger("hdet_track.tracking").warning(
        "hdet-track: %s run %s already holds an earlier HDET training%s, and this one starts at "
        "step 1 in it: the two share their steps and read as one mixed series. Give each training a run of its "
        "own (a new logger, or W&B's reinit), or resume the earlier one from its checkpoint",
        backend, run_id, f" (through step {through})" if through is not None else "",
    )  # fmt: skip


def warn_resumed_elsewhere(backend: str, earlier: str, run_id: str, opener: str, how: str) -> None:
    """A job resumed from a checkpoint of run ``earlier`` logs into run ``run_id``, which the
    trainer's own reporting (``opener``) opened for it: the run is split in two. ``how``: what
    continues the earlier run instead."""
    logging.getLogger("hdet_track.tracking").warning(
        "hdet-track: resuming the training of %s run %s into run %s, which %s opened for it: the steps "
        "before the checkpoint stay in run %s; %s to continue that run",
        backend, earlier, run_id, opener, earlier, how,
    )  # fmt: skip

"""Every metric name and series key hdet-track writes or reads, in one place.

Writers (the tracking backends) and readers (MLflow, W&B) both import this module, so a name
changes in one place and the round trip ``parse(make(x)) == x`` is tested here.

A *series key* names one target of one explored hyperparameter: the bare name for the first
target (``lr``, ``weight_decay``), ``name/pg<g>`` for param group g > 0 and ``name/t<t>`` for other
targets (``lr/pg1``, ``dropout/t2``). Hyperparameter names never contain ``/``, so a key splits
at its only slash, whatever the name looks like (``grad_threshold``, ``wd_pg1``, ``drop_t2``).
"""

from __future__ import annotations

import posixpath
import re

__all__ = [
    "LOSS",
    "LR",
    "VAL_LOSS",
    "VAL_ACCURACY",
    "DIVERGED_AT_STEP",
    "STEP",
    "SYNC_STEP",
    "SYNC_DIVERGENCE",
    "SYNC_DIVERGENCE_MAX",
    "SYNC_LEFT_OUT",
    "SYNC_ROLLBACK",
    "SYNC_BACKOFF",
    "SYNC_STEP_GUARD",
    "left_out_metric",
    "parse_left_out_metric",
    "STEP_GUARD_CODES",
    "step_guard_scope",
    "check_name",
    "series_key",
    "parse_series_key",
    "legacy_series_key",
    "replica_metric",
    "parse_replica_metric",
    "window_loss_metric",
    "parse_window_loss_metric",
    "controller_metric",
    "parse_controller_metric",
    "weight_metric",
    "parse_weight_metric",
    "onecycle_metric",
    "CONTROLLER_FIELDS",
    "MEANS_IN_GIVEN_RUN",
    "is_hdet_series",
    "name_problem",
]

# Means over replicas, at every (logged) step: what MLflow's compare view plots.
LOSS = "loss"
LR = "lr"
# The means' names in a run HDET attaches to (MLflowTracker(run_id=...): Hugging Face's or
# Lightning's run), whose owner may log a ``loss`` (Hugging Face's MLflowCallback does) of its own.
MEANS_IN_GIVEN_RUN = {LOSS: "hdet/loss", LR: "hdet/lr"}
# Metrics the examples and the demo log (the comparison table reads them).
VAL_LOSS = "val_loss"
VAL_ACCURACY = "val_accuracy"
DIVERGED_AT_STEP = "diverged_at_step"


def is_hdet_series(key: str) -> bool:
    """Whether ``key`` is one of HDET's own series (``loss``, ``lr``, ``hdet/...``), not a user's metric."""
    return key.startswith("hdet/") or key in (LOSS, LR)


# Files a W&B run keeps beside its event archive (files/hdet_events/): the user's metrics as
# {"key", "step", "value"} lines, and the process that owns the run (host, pid, start, pidns).
WANDB_USER_METRICS_FILE = "user_metrics.jsonl"
WANDB_OWNER_FILE = "owner.json"
# The MLflow tag with the run's owner: the training process and, when the tracker runs in a process
# of its own, that writer (``hdet_track.owner.process_identity`` records, as JSON).
MLFLOW_OWNER_TAG = "hdet.owner"
# The MLflow tag with the run's last heartbeat (``hdet_track.owner.heartbeat``, as JSON; a W&B run
# keeps it in its owner file as ``alive``): how a reader tells a run whose host it cannot check is gone.
MLFLOW_ALIVE_TAG = "hdet.alive"
# Step axes in W&B rows (every row carries its own step, so rows may arrive in any order).
STEP = "hdet/step"
SYNC_STEP = "hdet/sync/step"
# One point per sync.
SYNC_DIVERGENCE = "hdet/sync/divergence"
SYNC_DIVERGENCE_MAX = "hdet/sync/divergence_max"
SYNC_LEFT_OUT = "hdet/sync/left_out"
SYNC_ROLLBACK = "hdet/sync/rollback"
SYNC_BACKOFF = "hdet/sync/backoff"  # 1 where the guard cut the LR drift (a backoff) at that sync
# The scope of the controller's step guard in the window, as a number (for runs read without their
# event archive): 0 none, 1 collective ("all"), 2 local.
SYNC_STEP_GUARD = "hdet/sync/step_guard"
STEP_GUARD_CODES = {"": 0.0, "all": 1.0, "local": 2.0}
CONTROLLER_FIELDS = ("base", "drift", "velocity", "delta", "evidence")

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_TARGET = re.compile(r"^(pg|t)(\d+)$")
_REPLICA = re.compile(r"^hdet/replica_(\d+)/(.+)$")
_WINDOW = re.compile(r"^hdet/sync/window_loss/replica_(\d+)$")
_LEFT_OUT = re.compile(r"^hdet/sync/left_out/replica_(\d+)$")
_WEIGHT = re.compile(r"^hdet/controller/([^/]+)/weight/replica_(\d+)$")
_CONTROLLER = re.compile(r"^hdet/controller/(.+)/(" + "|".join(CONTROLLER_FIELDS) + r")$")


# What every backend takes as a metric or tag name (MLflow's rule, the strictest: W&B takes these too).
_PORTABLE_NAME = re.compile(r"^[/\w.\- :]+$")
MAX_NAME_LENGTH = 250


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a metric or tag name in every backend; None when it can."""
    if not _PORTABLE_NAME.match(name):
        return "names may only contain letters, digits, underscores, dashes, periods, spaces, colons and slashes"
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith(("..", "/")):
        return f"names must not be paths that resolve to another name (this one resolves to {norm!r})"
    if len(name) > MAX_NAME_LENGTH:
        return f"names are at most {MAX_NAME_LENGTH} characters (this one has {len(name)})"
    return None


def check_name(name: str) -> str:
    """``name`` if it is a valid explored-hyperparameter name, else ``ValueError``."""
    if not isinstance(name, str) or not _NAME.match(name) or name == "lr":
        raise ValueError(
            f"Expected an explored hyperparameter name of letters, digits, '_', '.', '-' other than 'lr', but got {name!r}"
        )
    return name


def series_key(name: str, target: int, label: str = "") -> str:
    """The key of target ``target`` (labelled ``label``) of hyperparameter ``name``.

    Example:
        >>> series_key("lr", 0, "pg0"), series_key("lr", 1, "pg1"), series_key("dropout", 2, "net.3")
        ('lr', 'lr/pg1', 'dropout/t2')
    """
    if target == 0:
        return name
    if label == f"pg{target}":  # a param group (a module named like one at another place is not)
        return f"{name}/{label}"
    return f"{name}/t{target}"


def parse_series_key(key: str) -> tuple[str, int]:
    """``(name, target)`` of a series key (the inverse of :func:`series_key`)."""
    name, sep, suffix = key.partition("/")
    if not sep:
        return name, 0
    m = _TARGET.match(suffix)
    if m is None:
        raise ValueError(f"Expected a series key such as 'lr', 'lr/pg1' or 'dropout/t2', but got {key!r}")
    return name, int(m.group(2))


def legacy_series_key(name: str, target: int, label: str = "") -> str:
    """The key runs written by hdet-track 0.1 (event schema 1) used: ``lr_pg1``, ``dropout_t2``."""
    return series_key(name, target, label).replace("/", "_", 1)


def replica_metric(replica: int, key: str) -> str:
    """``hdet/replica_03/lr/pg1``: one replica's series (``key`` is ``loss`` or a series key)."""
    return f"hdet/replica_{replica:02d}/{key}"


def parse_replica_metric(metric: str) -> tuple[int, str] | None:
    m = _REPLICA.match(metric)
    return (int(m.group(1)), m.group(2)) if m else None


def window_loss_metric(replica: int) -> str:
    return f"hdet/sync/window_loss/replica_{replica:02d}"


def parse_window_loss_metric(metric: str) -> int | None:
    m = _WINDOW.match(metric)
    return int(m.group(1)) if m else None


def left_out_metric(replica: int) -> str:
    """``hdet/sync/left_out/replica_03``: 1 at each sync that left replica 3 out of the average (logged
    only there), so runs read without their event archive know which replicas were, also those with
    a finite window loss (a blow-up, a local step guard's reset)."""
    return f"hdet/sync/left_out/replica_{replica:02d}"


def parse_left_out_metric(metric: str) -> int | None:
    m = _LEFT_OUT.match(metric)
    return int(m.group(1)) if m else None


def controller_metric(key: str, field: str) -> str:
    """``hdet/controller/lr/pg1/base``: the controller's ``field`` for series ``key`` at each sync."""
    if field not in CONTROLLER_FIELDS:
        raise ValueError(f"Expected a controller field in {CONTROLLER_FIELDS}, but got {field!r}")
    return f"hdet/controller/{key}/{field}"


def parse_controller_metric(metric: str) -> tuple[str, str] | None:
    """``(series key, field)`` of a controller metric, or None."""
    m = _CONTROLLER.match(metric)
    if m is None or "/weight/" in metric:
        return None
    return m.group(1), m.group(2)


def weight_metric(name: str, replica: int) -> str:
    return f"hdet/controller/{name}/weight/replica_{replica:02d}"


def parse_weight_metric(metric: str) -> tuple[str, int] | None:
    m = _WEIGHT.match(metric)
    return (m.group(1), int(m.group(2))) if m else None


def onecycle_metric(key: str) -> str:
    """Plain OneCycleLR's value of series ``key`` (LR only) at each sync."""
    return f"hdet/onecycle/{key}"


def step_guard_scope(code: float) -> str:
    """The step guard's scope from its :data:`SYNC_STEP_GUARD` value (``""`` for none or unknown)."""
    return next((scope for scope, c in STEP_GUARD_CODES.items() if c == code), "")

"""Figure builders: pure functions ``HDETRun -> plotly Figure`` (no Streamlit, no tracker).

Each plot is split as in optuna's visualization module: ``_get_X_info(run) -> NamedTuple`` holds
the data, ``plot_X(run)`` draws it. Empty input draws an empty figure with a note.
"""

from __future__ import annotations

from .compare import plot_compare, user_metric_keys
from .controller import controller_in_view, guard_in_view, plot_controller
from .converge import guard_rows, plot_divergence, plot_sync_heatmap, plot_sync_loss, step_guard_note
from .export import discovered_schedule, lambdalr_snippet, schedule_csv, schedule_json
from .fanout import plot_fanout, plot_permutations, plot_replica_loss

__all__ = [
    "plot_fanout",
    "plot_permutations",
    "plot_replica_loss",
    "plot_sync_loss",
    "plot_divergence",
    "plot_sync_heatmap",
    "guard_rows",
    "step_guard_note",
    "controller_in_view",
    "guard_in_view",
    "plot_controller",
    "plot_compare",
    "user_metric_keys",
    "discovered_schedule",
    "schedule_csv",
    "schedule_json",
    "lambdalr_snippet",
]

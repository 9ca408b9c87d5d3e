"""Compare: several runs overlaid by step and a summary table; pick runs by compare group."""

from __future__ import annotations

import streamlit as st
from hdet_track.dashboard.state import label, load_full, load_run

from hdet_track.compare import comparison_rows
from hdet_track.readers import ReaderError
from hdet_track.viz import plot_compare, user_metric_keys

st.header("Compare")
runs = st.session_state.get("runs", [])
if not runs:
    st.info("No runs to compare yet.")
else:
    groups = sorted({r.compare_group for r in runs if r.compare_group})
    options = ["(pick runs)"] + groups
    # the group of the run picked in the sidebar (else of the newest run, as `hdet-track compare`
    # takes it), again whenever another run is picked there; keyed: a group picked here stays while
    # the run does, and a run or group that appears in the lists does not reset it
    selected = next((r for r in runs if r.run_id == st.session_state.get("selected")), runs[0])
    if st.session_state.get("_compare_for") != selected.run_id or st.session_state.get("compare_group") not in options:
        st.session_state["_compare_for"] = selected.run_id
        st.session_state["compare_group"] = selected.compare_group if selected.compare_group in groups else options[0]
    c1, c2 = st.columns([1, 3])
    group = c1.selectbox("Compare group", options, key="compare_group")
    default = [r.run_id for r in runs if r.compare_group == group] if group != "(pick runs)" else [selected.run_id]
    labels = {r.run_id: label(r) for r in runs}
    chosen = c2.multiselect("Runs", list(labels), default=default, format_func=labels.get, key=f"compare_runs_{group}")
    loaded = []
    for run_id in chosen:
        try:
            loaded.append(load_run(run_id))
        except ReaderError as exc:
            st.error(str(exc))
    for run in loaded:
        for w in run.warnings:
            st.warning(f"{run.name or run.run_id}: {w}")
    if loaded:
        # the table's final and best values need every row: a run read as an overview holds bucket means
        rows = comparison_rows([load_full(run) if run.overview else run for run in loaded])
        st.dataframe(
            [
                {
                    "run": r.name,
                    "schedule": r.schedule,
                    "replicas": r.world_size,
                    "status": r.status,
                    "mean lr": r.mean_lr,
                    "final train loss": r.final_train_loss,
                    "best train loss": r.best_train_loss,
                    "highest stable lr": r.highest_stable_lr,
                    "final val loss": r.final_val_loss,
                    "val accuracy": r.val_accuracy,
                    "diverged": "no" if r.diverged_at_step is None else f"yes, step {r.diverged_at_step}",
                }
                for r in rows
            ],
            hide_index=True,
            width="stretch",
        )
        st.plotly_chart(plot_compare(loaded, "loss"), key="cmp_loss")
        st.plotly_chart(plot_compare(loaded, "lr", log_y=False), key="cmp_lr")
        for key in user_metric_keys(loaded):
            st.plotly_chart(plot_compare(loaded, key, log_y=False), key=f"cmp_{key}")

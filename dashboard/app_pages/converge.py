"""Converge: sync points, divergence before averaging, window losses and weights, the guard's actions."""

from __future__ import annotations

import streamlit as st
from hdet_track.dashboard.state import live_every, load_run, resolution_caption, selected_run, step_range

from hdet_track.viz import guard_rows, plot_divergence, plot_sync_heatmap, plot_sync_loss, step_guard_note

st.header("Converge")
run = selected_run()
if run is not None:
    steps = step_range(run)

    @st.fragment(run_every=live_every(run))
    def charts() -> None:
        fresh = load_run(run.run_id, steps)
        resolution_caption(fresh)
        st.plotly_chart(plot_sync_loss(fresh), key="sync_loss")
        if step_guard_note(fresh):
            st.caption(step_guard_note(fresh))
        actions = guard_rows(fresh)
        if actions:
            said = [
                f"replica {a['replicas']} at step {a['step']} left out and reset ({a['reason']})"
                if a["action"] == "left out"
                else f"{a['action']} at step {a['step']} ({a['reason']})"
                for a in actions[:5]
            ]
            more = f"; and {len(actions) - 5} more below" if len(actions) > 5 else ""
            st.error("The guard acted: " + "; ".join(said) + more)
            st.dataframe(actions, hide_index=True, key="guard")
        st.plotly_chart(plot_divergence(fresh), key="divergence")
        c1, c2 = st.columns(2)
        c1.plotly_chart(plot_sync_heatmap(fresh, "window_losses"), key="window_losses")
        c2.plotly_chart(plot_sync_heatmap(fresh, "weights"), key="weights")

    charts()

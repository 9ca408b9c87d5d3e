"""Fan-out: per-replica trajectories, spread band, multipliers per window, per-replica loss."""

from __future__ import annotations

import streamlit as st
from hdet_track.dashboard.state import live_every, load_run, resolution_caption, selected_run, step_range

from hdet_track.names import parse_series_key
from hdet_track.viz import plot_fanout, plot_permutations, plot_replica_loss

st.header("Fan-out")
run = selected_run()
if run is not None:
    keys = [k for name in run.explored_names() for k in run.series_keys(name)] or ["lr"]
    c1, c2 = st.columns([3, 1])
    key = c1.selectbox("Hyperparameter", keys)
    log_y = c2.toggle("log scale", value=False)
    steps = step_range(run)

    @st.fragment(run_every=live_every(run))
    def charts() -> None:
        fresh = load_run(run.run_id, steps)
        resolution_caption(fresh)
        if fresh.live:
            st.caption(f"LIVE: step {fresh.last_step}")
        st.plotly_chart(plot_fanout(fresh, key, log_y=log_y), key="fanout")
        st.plotly_chart(plot_permutations(fresh, parse_series_key(key)[0]), key="perms")
        st.plotly_chart(plot_replica_loss(fresh), key="replica_loss")

    charts()

"""Controller drift: base vs plain OneCycle, drift, delta and velocity per hyperparameter."""

from __future__ import annotations

import numpy as np
import streamlit as st
from hdet_track.dashboard.state import live_every, load_run, resolution_caption, selected_run, step_range

from hdet_track.viz import controller_in_view, guard_in_view, plot_controller, step_guard_note

st.header("Controller drift")
run = selected_run()
if run is not None:
    names = run.explored_names() or ["lr"]
    c1, c2, c3 = st.columns([2, 1, 1])
    name = c1.selectbox("Hyperparameter", names)
    targets = run.series_keys(name) or [name]
    target = c2.selectbox("Target", list(range(len(targets))), format_func=lambda t: targets[t])
    log_y = c3.toggle("log scale", value=False)
    steps = step_range(run)

    @st.fragment(run_every=live_every(run))
    def charts() -> None:
        fresh = load_run(run.run_id, steps)
        resolution_caption(fresh)
        series = controller_in_view(fresh, name, target)  # the syncs of the step range, as the chart
        if len(series["step"]):
            m1, m2, m3, m4 = st.columns(4)
            m1.metric("base", f"{series['base'][-1]:.4g}")
            drift = series["drift"][-1]
            m2.metric("drift vs reference", f"{drift:.3g}x" if np.isfinite(drift) else "n/a")
            m3.metric("syncs with the controller", len(series["step"]))
            m4.metric(
                "backoffs / rollbacks",
                f"{sum(g.action == 'backoff' for g in guard_in_view(fresh))} / "
                f"{sum(g.action == 'rollback' for g in guard_in_view(fresh))}",
            )
        st.plotly_chart(plot_controller(fresh, name, target, log_y=log_y), key="controller")
        if step_guard_note(fresh):
            st.caption(step_guard_note(fresh))

    charts()

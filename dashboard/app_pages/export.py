"""Export: the schedule the controller discovered, as CSV/JSON and a LambdaLR snippet."""

from __future__ import annotations

import streamlit as st
from hdet_track.dashboard.state import selected_run

from hdet_track.readers.base import schedule_label
from hdet_track.viz import lambdalr_snippet, schedule_csv, schedule_json

run = selected_run()
st.header("Export the discovered schedule" if run is None or run.schedule == "hdet" else "Export the logged schedule")
if run is not None:
    if run.schedule != "hdet":
        st.caption(
            f"This run is {schedule_label(run.schedule)}: below is the learning-rate schedule it logged, "
            "not one HDET discovered."
        )
    keys = run.series_keys("lr") or ["lr"]
    key = st.selectbox("Param group", keys)
    if run.overview:
        st.caption(
            f"Huge run: the schedule is the mean LR of every {run.resolution:,} steps (from the archive's summaries)."
        )
    c1, c2 = st.columns(2)
    c1.download_button("schedule.csv", schedule_csv(run, key), file_name=f"{run.run_id}-{key}.csv", mime="text/csv")
    c2.download_button(
        "schedule.json", schedule_json(run, key), file_name=f"{run.run_id}-{key}.json", mime="application/json"
    )
    st.subheader("Replay it with LambdaLR")
    st.code(lambdalr_snippet(run, key), language="python")

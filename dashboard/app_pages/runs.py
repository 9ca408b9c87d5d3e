"""Runs: list and filter the runs at the source."""

from __future__ import annotations

import datetime as dt

import streamlit as st
from hdet_track.dashboard.state import current_source, no_runs_note

from hdet_track.readers.base import schedule_label

st.header("Runs")
runs = st.session_state.get("runs", [])
if not runs:
    st.info(no_runs_note())
else:
    c1, c2 = st.columns(2)
    text = c1.text_input("Filter by name, id or compare group", "")
    schedules = sorted({schedule_label(r.schedule) for r in runs})
    chosen = c2.multiselect("Schedule", schedules, default=schedules)
    rows = [
        {
            "name": r.name,
            "status": r.status,
            "live": "LIVE" if r.live else "",
            "schedule": schedule_label(r.schedule),
            "replicas": r.world_size,
            "final loss": r.final_loss,
            "compare group": r.compare_group or "",
            "experiment": r.experiment,
            "started": dt.datetime.fromtimestamp(r.start_time).strftime("%Y-%m-%d %H:%M:%S") if r.start_time else "",
            "run id": r.run_id,
        }
        for r in runs
        if (schedule_label(r.schedule)) in chosen
        and (not text or text.lower() in f"{r.name} {r.run_id} {r.compare_group or ''}".lower())
    ]
    st.caption(f"{len(rows)} of {len(runs)} runs at `{current_source()}`")
    st.dataframe(rows, hide_index=True, width="stretch")

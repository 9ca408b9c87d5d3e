"""hdet-track dashboard: fan-out trajectories, converge points, controller drift, comparisons.

Start with ``hdet-track dashboard [TRACKING_URI_OR_WANDB_DIR]`` or ``streamlit run dashboard/app.py``
(the source then comes from ``$HDET_DASHBOARD_SOURCE``, ``$MLFLOW_TRACKING_URI`` or
``sqlite:///mlflow.db``). Read-only.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st
from hdet_track.dashboard.state import sidebar

HERE = Path(__file__).parent

st.set_page_config(page_title="hdet-track", layout="wide")
pages = [
    st.Page(HERE / "app_pages" / "runs.py", title="Runs", default=True),
    st.Page(HERE / "app_pages" / "fanout.py", title="Fan-out"),
    st.Page(HERE / "app_pages" / "converge.py", title="Converge"),
    st.Page(HERE / "app_pages" / "controller.py", title="Controller drift"),
    st.Page(HERE / "app_pages" / "compare.py", title="Compare"),
    st.Page(HERE / "app_pages" / "export.py", title="Export"),
]
navigation = st.navigation(pages)
sidebar()
navigation.run()

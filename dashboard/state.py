"""Shared state of the dashboard's pages: the source, cached readers, the selected runs.

Readers are cached per source (``st.cache_resource``), run lists for a few seconds
(``st.cache_data``), and runs in the session: a RUNNING run is re-read incrementally (only new
archive chunks), an ended one is kept as is until the run list shows it otherwise (a resumed
run). A huge run is read as an overview (the archive's summaries); a zoomed step range is read at
full resolution, one range per run kept at a time.
"""

from __future__ import annotations

import math
import os
from typing import Any

import streamlit as st

from hdet_track.compare import schedule_label
from hdet_track.readers import HDETRun, ReaderError, RunSummary, default_source, open_reader
from hdet_track.readers.mlflow import StoreNotReady, check_store_exists, pending_store
from hdet_track.summaries import full_rows_limit

LIVE_SECONDS = 2.0


@st.cache_resource(show_spinner=False)
def get_reader(source: str) -> Any:
    return open_reader(source)


@st.cache_data(ttl=3, show_spinner=False)
def list_runs(source: str, experiment: str | None) -> list[RunSummary]:
    return get_reader(source).list_runs(experiment)


@st.cache_data(ttl=10, show_spinner=False)
def list_experiments(source: str) -> list[str]:
    reader = get_reader(source)
    return reader.experiments() if hasattr(reader, "experiments") else []


def load_run(run_id: str, steps: tuple[int, int] | None = None) -> HDETRun:
    """The run (or its step range ``steps``), re-read incrementally while it is live."""
    source = current_source()
    cache: dict[tuple[str, str, tuple[int, int] | None], HDETRun] = st.session_state.setdefault("_runs", {})
    key = (source, run_id, steps)
    previous = cache.get(key)
    # the run list's status and final loss for it when it was last read: an ended run that the list
    # shows otherwise since then (resumed, and ended again) is read afresh; a list that merely lags a
    # read (a live page's fragment reruns keep the list of the last full rerun) is not a change
    seen: dict[tuple[str, str, tuple[int, int] | None], Any] = st.session_state.setdefault("_listed", {})
    listed = next(
        (_state(r.status, r.final_loss) for r in st.session_state.get("runs", []) if r.run_id == run_id), None
    )
    if (
        previous is not None
        and not previous.live
        and listed not in (None, seen.get(key), _state(previous.status, previous.final_loss()))
    ):
        for stale in [k for k in cache if k[:2] == key[:2]]:
            del cache[stale]
        previous = None
    seen[key] = listed
    if previous is None or previous.live:
        if previous is None and steps is not None:  # a new range: start from the whole run's read
            for other in [k for k in cache if k[:2] == key[:2] and k[2] is not None]:
                del cache[other]
            previous = cache.get((source, run_id, None))
        cache[key] = get_reader(source).read(run_id, previous=previous, steps=steps)
    return cache[key]


def load_full(run: HDETRun) -> HDETRun:
    """``run`` (read as an overview) with every row, however many, for the comparison table's exact
    values; read again when the overview has moved on (a live run)."""
    import sys

    source = current_source()
    cache: dict[tuple[str, str], tuple[Any, HDETRun]] = st.session_state.setdefault("_full_runs", {})
    seen = (run.last_step, run.status)
    key = (source, run.run_id)
    if key not in cache or cache[key][0] != seen:
        cache[key] = (seen, get_reader(source).read(run.run_id, max_rows=sys.maxsize))
    return cache[key][1]


def _state(status: str, final_loss: float) -> tuple[str, float | None]:
    """What the run list says of a run that changes with every attempt that trains."""
    return status, round(final_loss, 9) if math.isfinite(final_loss) else None


def step_range(run: HDETRun) -> tuple[int, int] | None:
    """A step-range slider for a run read as an overview (None: the whole run, or a run read in full)."""
    if run.aggregates is None or not run.overview or not len(run.aggregates):
        return None
    first, last = int(run.aggregates.first_step.min()), run.last_step
    per_step = max(1, run.world_size)
    # The slider's identity includes its bounds: a live run's growing last step makes a new one,
    # which came back at the whole run. The choice is kept apart (None: the whole run, to its end).
    chosen = st.session_state.get(f"range_choice_{run.run_id}")
    value = (first, last) if chosen is None else tuple(min(max(int(x), first), last) for x in chosen)
    lo, hi = st.slider(
        f"Step range (every step once it spans at most {full_rows_limit() // per_step:,} steps)",
        first,
        last,
        value,
        key=f"range_{run.run_id}",
    )
    whole = (lo, hi) == (first, last)
    st.session_state[f"range_choice_{run.run_id}"] = None if whole else (int(lo), int(hi))
    return None if whole else (int(lo), int(hi))


def resolution_caption(run: HDETRun) -> None:
    """Say on the page when its charts show a summary."""
    if run.overview:
        st.caption(f"Huge run: {run.resolution_note()}.")
    elif run.view is not None:
        st.caption(f"Every step of steps {run.view[0]:,} to {run.view[1]:,}.")


def current_source() -> str:
    return st.session_state.get("source") or os.environ.get("HDET_DASHBOARD_SOURCE") or default_source()


def sidebar() -> None:
    """Source, experiment and run pickers shared by every page."""
    st.sidebar.title("hdet-track")
    source = st.sidebar.text_input(
        "Source (MLflow tracking URI or W&B directory)", value=current_source(), key="source_input"
    )
    st.session_state["source"] = source.strip() or default_source()
    try:
        experiments = list_experiments(st.session_state["source"])
    except Exception as exc:  # noqa: BLE001 - an unreachable source is shown, not raised
        st.session_state["runs"] = []
        pending = pending_store(st.session_state["source"])
        if pending is not None:
            st.sidebar.info(
                f"No store at `{st.session_state['source']}` yet: its runs appear here once a job logs there."
            )
            with st.sidebar:
                _wait_for_store(str(pending.absolute()))
            return
        if isinstance(exc, StoreNotReady):  # being created by a job (or made by an older MLflow): wait, never migrate
            st.sidebar.info(str(exc))
            with st.sidebar:
                _wait_for_schema(st.session_state["source"])
            return
        st.sidebar.error(f"Cannot read {st.session_state['source']}: {type(exc).__name__}: {exc}")
        return
    experiment = None
    if experiments:
        options = ["(all)"] + experiments
        default = _from_url("experiment", options) or _default_experiment(st.session_state["source"], experiments)
        experiment = st.sidebar.selectbox(
            "Experiment", options, index=options.index(default), key="experiment"
        )  # keyed: a new experiment in the list does not reset the choice
        st.query_params["experiment"] = experiment  # the page's address names what it shows: a link to share
        experiment = None if experiment == "(all)" else experiment
    try:
        runs = list_runs(st.session_state["source"], experiment)
    except ReaderError as exc:
        st.sidebar.error(str(exc))
        runs = []
    st.session_state["runs"] = runs
    st.session_state["experiment_shown"] = experiment
    if runs:
        labels = {r.run_id: label(r) for r in runs}
        options = list(labels)
        shown = _from_url("run", options)
        chosen = st.sidebar.selectbox(
            "Run", options, index=options.index(shown) if shown else 0, format_func=labels.get, key="run_id"
        )
        st.session_state["selected"] = chosen
        st.query_params["run"] = chosen
    st.sidebar.toggle("Live refresh of running runs", value=True, key="live")


def _from_url(name: str, options: list[str]) -> str | None:
    """The page address's ``name`` parameter (a link someone shared) when it is one of ``options``."""
    value = st.query_params.get(name)
    return value if value in options else None


def _default_experiment(source: str, experiments: list[str]) -> str:
    """The experiment the sidebar opens on: ``hdet`` (hdet-track's default), else the first one
    listed (MLflow lists the newest first), unless it holds no run and another does (an empty
    experiment made the dashboard say the whole source had none)."""
    ordered = (["hdet"] if "hdet" in experiments else []) + [e for e in experiments if e != "hdet"]
    for name in ordered:
        try:
            if list_runs(source, name):
                return name
        except ReaderError:
            break
    return ordered[0]


def no_runs_note() -> str:
    """What a page says when the sidebar's pick holds no run."""
    experiment = st.session_state.get("experiment_shown")
    where = f"in experiment `{experiment}` at `{current_source()}`" if experiment else f"at `{current_source()}`"
    other = " pick another experiment in the sidebar," if experiment else ""
    return (
        f"No runs {where} yet.{other} Log one with `hdet-track demo` or `HDETScheduler(..., track=True)`, "
        "or point the sidebar at another source."
    )


@st.fragment(run_every=LIVE_SECONDS)
def _wait_for_store(path: str) -> None:
    """Rerun the app once the store a job is about to create exists (the dashboard never creates it)."""
    if os.path.exists(path):
        st.rerun()


@st.fragment(run_every=LIVE_SECONDS)
def _wait_for_schema(source: str) -> None:
    """Rerun the app once the store a job is creating has its whole schema (read-only checks)."""
    try:
        check_store_exists(source)
    except ReaderError:
        return
    st.rerun()


def label(r: RunSummary) -> str:
    badge = " (live)" if r.live else ""
    return f"{r.name} [{schedule_label(r.schedule)}, {r.world_size}x]{badge}"


def selected_run() -> HDETRun | None:
    """The run picked in the sidebar, or a note on the page when there is none."""
    runs: list[RunSummary] = st.session_state.get("runs", [])
    if not runs:
        st.info(no_runs_note())
        return None
    run_id = st.session_state.get("selected") or runs[0].run_id
    try:
        run = load_run(run_id)
    except ReaderError as exc:
        st.error(str(exc))
        return None
    for w in run.warnings:
        st.warning(w)
    error = run.tags.get("hdet.error", "").strip()
    if run.status in ("FAILED", "KILLED") and error:  # why, in its own words (a traceback's last line)
        st.error(f"{run.status}: {error.splitlines()[-1]}")
        if "\n" in error:
            with st.expander("Full error"):
                st.code(error, language=None)
    return run


def live_every(run: HDETRun) -> float | None:
    """The fragment refresh interval for this run: only for a live run with live refresh on."""
    return LIVE_SECONDS if run.live and st.session_state.get("live", True) else None

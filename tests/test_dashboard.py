"""Every dashboard page through Streamlit's AppTest against real logged runs."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from streamlit.testing.v1 import AppTest
from torch import nn

from hdet_track import HDETScheduler
from hdet_track.tracking.mlflow import MLflowTracker

from .distributed import workers
from .distributed.launch import run_ranks
from .servers import older_schema_store

APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = [
    "app_pages/fanout.py",
    "app_pages/converge.py",
    "app_pages/controller.py",
    "app_pages/compare.py",
    "app_pages/export.py",
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A 4-replica HDET run (replica 1's weights go NaN after step 9's update) and a OneCycle baseline in one compare group."""
    root = tmp_path_factory.mktemp("dash")
    uri = f"sqlite:///{root / 'dash.db'}"
    # the collective step guard (what "auto" picks under DDP): replica 1's NaN rolls every replica back
    run_ranks(workers.tracked_job, 4, uri, "mlflow", "hdet-4", 8, "all")
    model = nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = HDETScheduler(
            opt,
            0.1,
            total_steps=24,
            sync_every=6,
            compare_group="gloo-4",
            track=MLflowTracker(tracking_uri=uri, experiment="gloo", run_name="onecycle-1"),
        )
    for k in range(24):
        opt.step()
        sched.step(1.0 / (k + 1))
    sched.close()
    return uri


def app(monkeypatch, source):
    monkeypatch.setenv("HDET_DASHBOARD_SOURCE", source)
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, at.exception
    return at


def figures(at):
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def select_run(at, name):
    box = next(s for s in at.sidebar.selectbox if s.label == "Run")
    run_id = next(r.run_id for r in at.session_state["runs"] if r.name == name)
    box.set_value(run_id)
    at.run()
    assert not at.exception, at.exception
    return at


def test_runs_page_lists_runs(monkeypatch, store):
    at = app(monkeypatch, store)
    assert [h.value for h in at.header] == ["Runs"]
    table = at.dataframe[0].value
    assert sorted(table["name"]) == ["hdet-4", "onecycle-1"]
    assert dict(zip(table["name"], table["schedule"])) == {"hdet-4": "hdet", "onecycle-1": "onecycle"}
    assert dict(zip(table["name"], table["replicas"])) == {"hdet-4": 4, "onecycle-1": 1}


def test_every_page_renders_the_hdet_run(monkeypatch, store):
    at = select_run(app(monkeypatch, store), "hdet-4")
    at.switch_page("app_pages/fanout.py").run()
    assert not at.exception
    fan, perms, loss = figures(at)
    assert [t["name"] for t in fan["data"] if t["name"].startswith("replica")] == [f"replica {r}" for r in range(4)]
    assert len(perms["data"][0]["y"]) == 4
    at.switch_page("app_pages/converge.py").run()
    assert not at.exception
    # replica 1's loss is NaN at step 10: the step guard converged at once and rolled every replica back
    assert any("replica 1 at step 10" in e.value for e in at.error)
    assert any("rollback at step 10 (step guard: replicas [1] non-finite" in e.value for e in at.error)
    assert any(c.value.startswith("Step guard: collective.") for c in at.caption)  # the fixture pins "all"
    sync_loss = figures(at)[0]
    assert any(t["name"].startswith("replica left out") for t in sync_loss["data"])
    at.switch_page("app_pages/controller.py").run()
    assert not at.exception
    ctl = figures(at)[0]
    assert any(t["name"] == "controller base" for t in ctl["data"])
    assert at.metric[2].value == "5"  # controller syncs at 6 (the end of warmup), the step guard at 10, 12, 18, 24
    at.switch_page("app_pages/compare.py").run()
    assert not at.exception
    table = at.dataframe[0].value
    assert sorted(table["run"]) == ["hdet-4", "onecycle-1"]
    at.switch_page("app_pages/export.py").run()
    assert not at.exception
    assert "LambdaLR" in at.code[0].value


def test_empty_and_unreadable_sources(monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    MlflowClient(empty).search_experiments()  # an existing store without runs
    at = app(monkeypatch, empty)
    assert any("No runs" in i.value for i in at.info)
    for page in PAGES:
        at.switch_page(page).run()
        assert not at.exception, page
    at = app(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    assert at.sidebar.error and "Cannot read" in at.sidebar.error[0].value


def test_a_store_not_created_yet_is_waited_for_and_read_once_it_exists(monkeypatch, tmp_path):
    """Opened before the first job: a sqlite store whose directory exists but whose file does not is
    waited for (a note, no error, nothing created); once a job has created it, the next rerun reads it."""
    uri = f"sqlite:///{tmp_path / 'later.db'}"
    at = app(monkeypatch, uri)
    assert not at.sidebar.error
    assert any("No store at" in i.value and "yet" in i.value for i in at.sidebar.info)
    assert not (tmp_path / "later.db").exists()
    MlflowClient(uri).create_experiment("hdet")  # the job creates its store
    at.run()
    assert not at.exception and not at.sidebar.error
    assert not any("No store at" in i.value for i in at.sidebar.info)
    assert any(s.label == "Experiment" for s in at.sidebar.selectbox)


def test_a_missing_sqlite_store_is_shown_and_never_created(monkeypatch, tmp_path):
    """The dashboard only reads: a sqlite URI whose file does not exist is an error naming it, and
    no store (nor its directory) appears."""
    missing = f"sqlite:///{tmp_path / 'nowhere' / 'x.db'}"
    at = app(monkeypatch, missing)
    assert at.sidebar.error and missing in at.sidebar.error[0].value
    assert "does not exist" in at.sidebar.error[0].value
    assert not (tmp_path / "nowhere").exists()


def test_a_store_of_another_schema_is_waited_for_and_never_migrated(monkeypatch, tmp_path):
    """A store one schema revision behind this MLflow (an older MLflow made it, or a job is still
    creating it): MLflow's client migrated it on the first read, and during a job's own creation of
    the store that concurrent migration could leave it unopenable. The readers refuse it and the
    dashboard waits, leaving the file as it is."""
    import hashlib
    import sqlite3
    from contextlib import closing

    from hdet_track.readers import ReaderError, open_reader
    from hdet_track.readers.mlflow import StoreNotReady

    db = tmp_path / "old.db"
    uri = f"sqlite:///{db}"
    older_schema_store(uri)
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    with pytest.raises(StoreNotReady, match="mlflow db upgrade"):
        open_reader(uri).list_runs()
    at = app(monkeypatch, uri)
    assert not at.exception and not at.sidebar.error
    assert any("a job is still creating it" in i.value for i in at.sidebar.info)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    with closing(sqlite3.connect(db)) as con, con:  # a revision a newer MLflow wrote
        con.execute("UPDATE alembic_version SET version_num = 'f00dfeed0001'")
    with pytest.raises(ReaderError, match="a newer MLflow made it") as refused:
        open_reader(uri).list_runs()
    assert not isinstance(refused.value, StoreNotReady)  # not waited for: it will not change


def test_a_failed_run_shows_why_and_compare_shows_read_warnings(monkeypatch, tmp_path):
    """A FAILED run's error is on the page (its last line, the whole text in an expander), and the
    Compare page says when a run was read with warnings (here a torn event-archive chunk)."""
    uri = f"sqlite:///{tmp_path / 'failed.db'}"
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    track = MLflowTracker(tracking_uri=uri, experiment="failed", run_name="broken")
    with pytest.raises(RuntimeError, match="a bad batch"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, compare_group="f", track=track) as sched:
                for k in range(1, 13):
                    opt.step()
                    sched.step(1.0 / k)
                raise RuntimeError("a bad batch at step 12")
    at = app(monkeypatch, uri)
    at.switch_page("app_pages/fanout.py").run()
    assert not at.exception
    assert any(e.value.startswith("FAILED: RuntimeError: a bad batch at step 12") for e in at.error), at.error
    assert any("a bad batch" in c.value for c in at.code)
    (chunk,) = (tmp_path / "mlruns").rglob("hdet_events/steps-*.parquet")
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    at = app(monkeypatch, uri)
    at.switch_page("app_pages/compare.py").run()
    assert not at.exception
    assert any(w.value.startswith("broken: ") for w in at.warning), at.warning


@pytest.mark.parametrize("again", [None, 18])
def test_an_ended_run_resumed_later_is_read_again(monkeypatch, tmp_path, again):
    """The page of a run that failed at step 12 is open; the job is resumed from its checkpoint at
    step 10 into the same run and finishes (or fails again, at step 18). Before, the session kept
    showing the first failure (a run read once as ended was never read again; then, only when the
    run list's status changed, so not for a second failure)."""
    import time

    uri = f"sqlite:///{tmp_path / 'resumed.db'}"

    def job(state=None, fail_at=None):
        opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
        track = MLflowTracker(tracking_uri=uri, experiment="resumed", run_name="again")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, track=track)
        if state is not None:
            sched.load_state_dict(state)
        saved = {}
        with sched:
            for k in range(sched.last_epoch + 1, 21):
                if k == fail_at:
                    saved["error"] = "a bad batch at step 12"
                    break
                opt.step()
                sched.step(1.0 / k)
                if k == 10:
                    saved["state"] = sched.state_dict()
            if fail_at is not None:
                sched.close("FAILED", f"a bad batch at step {fail_at}")
        return saved

    first = job(fail_at=12)
    at = app(monkeypatch, uri)
    at.switch_page("app_pages/fanout.py").run()
    assert any(e.value.startswith("FAILED: a bad batch at step 12") for e in at.error), at.error
    assert _last_x(figures(at)[0]) == 10  # a failed job keeps its rows up to its last sync

    job(state=first["state"], fail_at=again)
    time.sleep(3.5)  # the run list is cached for 3 s
    at.run()
    assert not at.exception and not any(e.value.startswith("FAILED: a bad batch at step 12") for e in at.error)
    if again is None:
        assert not any(e.value.startswith("FAILED") for e in at.error), at.error
        assert _last_x(figures(at)[0]) == 20
    else:
        assert any(e.value.startswith("FAILED: a bad batch at step 18") for e in at.error), at.error
        assert _last_x(figures(at)[0]) == 15


def test_a_run_that_ends_while_the_run_list_lags_is_not_read_again_and_again(monkeypatch, tmp_path):
    """A live page reads a RUNNING run; the run ends; the run list still says RUNNING (a live page's
    fragment reruns keep the list of the last full rerun; a fault injected here by holding the
    reader's list). The read that found the run ended is kept: a review found an earlier version
    took "listed RUNNING, read FINISHED" for a resume and read the whole run again at every rerun."""
    from hdet_track.dashboard import state

    uri = f"sqlite:///{tmp_path / 'lag.db'}"
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = HDETScheduler(
            opt, 0.1, total_steps=20, sync_every=5, track=MLflowTracker(tracking_uri=uri, experiment="lag")
        )
    for k in range(1, 11):
        opt.step()
        sched.step(1.0 / k)
    assert sched.flush()
    at = app(monkeypatch, uri)
    at.switch_page("app_pages/fanout.py").run()
    assert not at.exception and _last_x(figures(at)[0]) == 10
    (listed,) = at.session_state["runs"]
    assert listed.status == "RUNNING"
    reader = state.get_reader(uri)
    monkeypatch.setattr(reader, "list_runs", lambda *args, **kwargs: [listed])  # the list lags from here on
    sched.close()

    def kept():
        at.run()
        assert not at.exception, at.exception
        ((key, run),) = at.session_state["_runs"].items()
        return run

    ended = kept()
    assert ended.status == "FINISHED" and not ended.live  # the live read found the end
    assert kept() is ended and kept() is ended  # and is kept while the list still says RUNNING
    monkeypatch.undo()  # the list catches up: nothing changed for the page either
    monkeypatch.setenv("HDET_DASHBOARD_SOURCE", uri)
    state.list_runs.clear()
    assert kept() is ended


def _tiny_run(uri, experiment, name, group, steps=24):
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    track = MLflowTracker(tracking_uri=uri, experiment=experiment, run_name=name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with HDETScheduler(opt, 0.1, total_steps=steps, sync_every=6, compare_group=group, track=track) as sched:
            for k in range(1, steps + 1):
                opt.step()
                sched.step(1.0 / k + 0.01 * (k % 3))


def test_choices_survive_a_new_experiment_or_run_in_the_lists(monkeypatch, tmp_path):
    """The Experiment box (no key) went back to its default when a job made a new experiment, and
    the Compare page's picked runs went back to the whole group when a run appeared."""
    from hdet_track.dashboard import state

    uri = f"sqlite:///{tmp_path / 'lists.db'}"
    _tiny_run(uri, "hdet", "h1", "g")
    _tiny_run(uri, "study", "s1", "g")
    _tiny_run(uri, "study", "s2", "g")
    at = app(monkeypatch, uri)
    next(s for s in at.sidebar.selectbox if s.label == "Experiment").set_value("study").run()
    at.switch_page("app_pages/compare.py").run()
    s1 = next(r.run_id for r in at.session_state["runs"] if r.name == "s1")
    at.multiselect[0].set_value([s1]).run()
    assert list(at.dataframe[0].value["run"]) == ["s1"]
    _tiny_run(uri, "another", "x", "g")  # sorts before "hdet" and "study"
    _tiny_run(uri, "study", "s3", "g")
    state.list_experiments.clear()
    state.list_runs.clear()
    at.run()
    assert not at.exception
    assert next(s for s in at.sidebar.selectbox if s.label == "Experiment").value == "study"
    assert {r.name for r in at.session_state["runs"]} == {"s1", "s2", "s3"}
    assert list(at.dataframe[0].value["run"]) == ["s1"]


def test_the_compare_table_of_a_run_read_as_an_overview_is_its_own(monkeypatch, tmp_path):
    """A run with more rows than $HDET_FULL_ROWS is read as an overview (bucket means) for the
    charts; the table took its final and best values from those means."""
    from hdet_track.compare import comparison_rows
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'big.db'}"
    _tiny_run(uri, "hdet", "big", "g", steps=60)
    (summary,) = MLflowReader(uri).list_runs()
    (exact,) = comparison_rows([MLflowReader(uri).read(summary.run_id)])
    monkeypatch.setenv("HDET_FULL_ROWS", "10")
    assert MLflowReader(uri).read(summary.run_id).overview  # what the page reads for its charts
    at = app(monkeypatch, uri)
    at.switch_page("app_pages/compare.py").run()
    assert not at.exception
    table = at.dataframe[0].value
    assert table["final train loss"][0] == exact.final_train_loss
    assert table["mean lr"][0] == pytest.approx(exact.mean_lr, rel=1e-12)


def test_a_users_metric_of_a_run_read_as_an_overview_is_not_called_a_bucket_mean(monkeypatch, tmp_path):
    """In an overview HDET's loss and LR are bucket means; a user's val_loss is read as logged, and
    the Compare chart called it "mean per N steps" too."""
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.viz import plot_compare

    uri = f"sqlite:///{tmp_path / 'big.db'}"
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with HDETScheduler(opt, 0.1, total_steps=60, sync_every=6, track=MLflowTracker(tracking_uri=uri)) as sched:
            for k in range(1, 61):
                opt.step()
                sched.step(1.0 / k)
                if k % 20 == 0:
                    sched.log_metrics({"val_loss": 2.0 / k}, step=k)
    monkeypatch.setenv("HDET_FULL_ROWS", "10")
    (summary,) = MLflowReader(uri).list_runs()
    run = MLflowReader(uri).read(summary.run_id)
    assert run.overview and run.resolution is not None
    assert "mean per" in plot_compare([run], "loss").data[0].name
    (trace,) = plot_compare([run], "val_loss").data
    assert "mean per" not in trace.name and list(trace.x) == [20, 40, 60]


def _last_x(figure):
    """The last x of a figure's first trace (plotly may write it as a typed array)."""
    import base64

    import numpy as np

    x = figure["data"][0]["x"]
    if isinstance(x, dict):
        x = np.frombuffer(base64.b64decode(x["bdata"]), dtype=x["dtype"])
    return int(max(x))


def test_the_compare_page_opens_on_the_selected_run_s_group(monkeypatch, tmp_path):
    """The Compare page opened on the alphabetically first group whatever run was picked; now on the
    group of the run picked in the sidebar (with none picked, the newest run's, as `hdet-track compare`
    takes it), again when another run is picked there; a group picked on the page stays meanwhile."""
    uri = f"sqlite:///{tmp_path / 'groups.db'}"
    _tiny_run(uri, "hdet", "z1", "z-group")
    _tiny_run(uri, "hdet", "a1", "a-group")
    _tiny_run(uri, "hdet", "z2", "z-group")  # the newest

    def group_box(at):
        return next(s for s in at.selectbox if s.label == "Compare group")

    at = app(monkeypatch, uri)
    at.switch_page("app_pages/compare.py").run()
    assert not at.exception
    assert group_box(at).value == "z-group"
    assert sorted(at.dataframe[0].value["run"]) == ["z1", "z2"]
    select_run(at, "a1")
    assert group_box(at).value == "a-group"
    assert list(at.dataframe[0].value["run"]) == ["a1"]
    group_box(at).set_value("z-group").run()
    at.run()
    assert not at.exception
    assert group_box(at).value == "z-group"
    assert sorted(at.dataframe[0].value["run"]) == ["z1", "z2"]
    select_run(at, "z1")
    at.switch_page("app_pages/fanout.py").run()
    select_run(at, "a1")
    at.switch_page("app_pages/compare.py").run()  # back on the page: the group of the run picked since
    assert group_box(at).value == "a-group"


def test_a_run_without_a_schedule_tag_is_plain_on_every_page(monkeypatch, tmp_path):
    """A bare MLflow run (no hdet.schedule tag) was "plain" on the Runs page, "onecycle" in the Compare
    page's table and "(?)" in its legend: "plain" everywhere."""
    uri = f"sqlite:///{tmp_path / 'bare.db'}"
    _tiny_run(uri, "hdet", "hdet-run", "g")
    client = MlflowClient(uri)
    bare = client.create_run(client.get_experiment_by_name("hdet").experiment_id, run_name="bare").info.run_id
    for step in range(1, 6):
        client.log_metric(bare, "loss", 1.0 / step, step=step)
    client.set_terminated(bare, "FINISHED")
    at = app(monkeypatch, uri)
    table = at.dataframe[0].value
    assert dict(zip(table["name"], table["schedule"]))["bare"] == "plain"
    labels = next(s for s in at.sidebar.selectbox if s.label == "Run")
    assert "bare [plain, 1x]" in labels.options, labels.options
    at.switch_page("app_pages/compare.py").run()
    next(s for s in at.selectbox if s.label == "Compare group").set_value("(pick runs)").run()
    at.multiselect[0].set_value([bare]).run()
    assert not at.exception
    table = at.dataframe[0].value
    assert dict(zip(table["run"], table["schedule"])) == {"bare": "plain"}
    legend = [t["name"] for t in figures(at)[0]["data"]]
    assert legend == ["bare (plain)"], legend


def test_a_zoom_into_a_live_huge_run_survives_the_run_growing(monkeypatch, tmp_path):
    """The slider's identity includes its bounds (Streamlit 1.67): the live run's last step grew
    between two full reruns, the next click on any widget made a new slider, and the zoom came back
    as the whole run."""
    uri = f"sqlite:///{tmp_path / 'live.db'}"
    monkeypatch.setenv("HDET_FULL_ROWS", "100")  # this run stands for a huge one
    opt = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = HDETScheduler(
            opt, 0.1, total_steps=2000, sync_every=50, spread=0.3, track=MLflowTracker(tracking_uri=uri)
        )
    done = 0

    def train(n):
        nonlocal done
        for _ in range(n):
            done += 1
            opt.step()
            sched.step(1.0 / done)
        assert sched.flush()

    train(600)
    at = app(monkeypatch, uri)
    at.switch_page("app_pages/fanout.py").run()
    assert at.slider[0].value == (1, 600)
    at.slider[0].set_value((200, 260)).run()
    assert "Every step of steps 200 to 260." in [c.value for c in at.caption]
    train(200)
    next(t for t in at.toggle if t.label == "log scale").set_value(True).run()  # a full rerun
    assert not at.exception
    assert at.slider[0].max == 800 and at.slider[0].value == (200, 260)
    assert "Every step of steps 200 to 260." in [c.value for c in at.caption]
    at.slider[0].set_value((1, 800)).run()  # back to the whole run: it follows the run's end again
    train(100)
    next(t for t in at.toggle if t.label == "log scale").set_value(False).run()
    assert at.slider[0].value == (1, 900)
    sched.close()


def test_an_empty_newest_experiment_is_not_where_the_dashboard_opens_nor_called_the_whole_source(monkeypatch, tmp_path):
    """MLflow lists the newest experiment first: an empty one there made every page say "No runs
    at <source>", though the store held runs in another experiment."""
    uri = f"sqlite:///{tmp_path / 'exps.db'}"
    _tiny_run(uri, "study", "s1", "g")
    MlflowClient(uri).create_experiment("empty")  # the newest
    at = app(monkeypatch, uri)
    box = next(s for s in at.sidebar.selectbox if s.label == "Experiment")
    assert box.options[1] == "empty" and box.value == "study"
    assert [r.name for r in at.session_state["runs"]] == ["s1"]
    box.set_value("empty").run()
    (note,) = [i.value for i in at.info]
    assert "No runs in experiment `empty`" in note and "pick another experiment" in note
    at.switch_page("app_pages/fanout.py").run()
    assert any("No runs in experiment `empty`" in i.value for i in at.info)


def test_the_page_address_names_the_experiment_and_run_it_shows_and_a_shared_link_opens_them(monkeypatch, tmp_path):
    """The dashboard kept no choice in its address: a link to a run opened the newest one."""
    uri = f"sqlite:///{tmp_path / 'links.db'}"
    _tiny_run(uri, "hdet", "h1", "g")
    _tiny_run(uri, "study", "s1", "g")
    _tiny_run(uri, "study", "s2", "g")
    at = app(monkeypatch, uri)
    assert at.query_params["experiment"] == "hdet"
    box = next(s for s in at.sidebar.selectbox if s.label == "Experiment")
    box.set_value("study").run()
    s1 = next(r.run_id for r in at.session_state["runs"] if r.name == "s1")
    next(s for s in at.sidebar.selectbox if s.label == "Run").set_value(s1).run()
    assert at.query_params["experiment"] == "study" and at.query_params["run"] == s1
    shared = AppTest.from_file(APP, default_timeout=60)  # someone opens the link
    shared.query_params.update({"experiment": "study", "run": s1})
    shared.run()
    assert not shared.exception
    assert next(s for s in shared.sidebar.selectbox if s.label == "Experiment").value == "study"
    assert next(s for s in shared.sidebar.selectbox if s.label == "Run").value == s1
    broken = AppTest.from_file(APP, default_timeout=60)  # a run no longer there: the usual defaults
    broken.query_params.update({"experiment": "gone", "run": "nope"})
    broken.run()
    assert not broken.exception
    assert next(s for s in broken.sidebar.selectbox if s.label == "Experiment").value == "hdet"

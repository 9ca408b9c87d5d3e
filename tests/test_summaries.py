"""Multi-resolution summaries written with the event archive, and huge runs read as an overview."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hdet_track.events import Converge, RunStart
from hdet_track.readers.archive import read_archive
from hdet_track.readers.base import HDETRun, StepTable
from hdet_track.record import ExploredSpec
from hdet_track.summaries import BucketTable, parse_piece_name
from hdet_track.tracking.archive import ARTIFACT_DIR, EventArchive, StepBlock, artifact_dir

REPLICAS, STEPS, BLOCK = 4, 5_000, 700
LEVELS = (100, 1_000)


def blocks(steps: int = STEPS, seed: int = 0):
    """Rows as rank 0 receives them: per block of steps, replica 3's rows one block late."""
    rng = np.random.default_rng(seed)
    late = None
    for lo in range(1, steps + 1, BLOCK):
        st = np.arange(lo, min(lo + BLOCK, steps + 1))
        step = np.repeat(st, REPLICAS)
        replica = np.tile(np.arange(REPLICAS, dtype=np.int32), len(st))
        loss = rng.normal(2.0, 0.5, len(step))
        loss[rng.random(len(step)) < 0.01] = np.nan
        loss[rng.random(len(step)) < 0.002] = np.inf
        lr = rng.random(len(step))
        mult = 1.0 + 0.1 * (replica - 1.5)
        block = StepBlock(step, replica, loss, {"lr": lr}, {"lr": mult})
        now = block.select(replica != 3)
        if late is not None:
            now = concat_blocks(now, late)
        late = block.select(replica == 3)
        yield now
    yield late


def concat_blocks(a: StepBlock, b: StepBlock) -> StepBlock:
    return StepBlock(
        np.concatenate([a.step, b.step]),
        np.concatenate([a.replica, b.replica]),
        np.concatenate([a.loss, b.loss]),
        {k: np.concatenate([a.values[k], b.values[k]]) for k in a.values},
        {k: np.concatenate([a.multipliers[k], b.multipliers[k]]) for k in a.multipliers},
    )


def write_archive(directory: Path, steps: int = STEPS) -> Path:
    archive = EventArchive(directory / ARTIFACT_DIR, chunk_rows=3_000, levels=LEVELS, rollup_every=3)
    archive.add([Converge(step=k, window_losses=[1.0] * REPLICAS, divergence=[0.0] * REPLICAS) for k in (1000, 2000)])
    for block in blocks(steps):
        archive.add_steps(block)
        if archive.due():
            archive.write()
    archive.write()
    return directory / ARTIFACT_DIR


def names_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root.parent)) for p in root.rglob("*.parquet"))


def read(root: Path, previous: HDETRun | None = None, fetched: list | None = None, **kw) -> HDETRun:
    def fetch(name: str) -> bytes:
        if fetched is not None:
            fetched.append(name)
        return (root.parent / name).read_bytes()

    run = HDETRun("r")
    read_archive(run, names_of(root), fetch, previous, **kw)
    return run


def exact(table: StepTable) -> BucketTable:
    columns = {"loss": table.loss, "v:lr": table.values["lr"], "m:lr": table.multipliers["lr"]}
    return BucketTable.summarize(table.step, table.replica, columns, LEVELS)


def assert_same(got: BucketTable, want: BucketTable) -> None:
    for name in ("level", "replica", "bucket", "first_step", "last_step", "rows"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert sorted(got.stats) == sorted(want.stats)
    for key in want.stats:
        np.testing.assert_allclose(got.stats[key], want.stats[key], rtol=1e-12, equal_nan=True, err_msg=key)


def test_summaries_are_the_exact_aggregates_of_the_rows(tmp_path):
    root = write_archive(tmp_path)
    files = names_of(root)
    assert any(parse_piece_name(f) and "rollup-" in f for f in files)  # rollups and pieces were written
    assert artifact_dir(root / "summary" / "part-000001.parquet") == f"{ARTIFACT_DIR}/summary"
    full = read(root, max_rows=10**9)
    assert len(full.steps) == REPLICAS * STEPS and not full.overview
    overview = read(root, max_rows=1_000)
    assert overview.overview and len(overview.steps) == 0
    assert_same(overview.aggregates, exact(full.steps))
    # by hand, one bucket: replica 2, steps 1001..2000 of the loss
    t = overview.aggregates
    row = np.flatnonzero((t.level == 1_000) & (t.replica == 2) & (t.bucket == 1))[0]
    mask = (full.steps.replica == 2) & (full.steps.step > 1000) & (full.steps.step <= 2000)
    loss = full.steps.loss[mask]
    finite = loss[np.isfinite(loss)]
    assert t.stat("loss", "min")[row] == finite.min() and t.stat("loss", "max")[row] == finite.max()
    assert t.stat("loss", "count")[row] == len(finite) and t.rows[row] == 1000
    assert t.stat("loss", "sum")[row] == pytest.approx(finite.sum(), rel=1e-12)
    assert t.stat("loss", "last")[row] == loss[-1] or np.isnan(loss[-1])
    # the overview's series at 100 steps per bucket (50 buckets <= 1,000 in view)
    assert overview.resolution == 100
    assert "per 100 steps of 20,000 rows" in overview.resolution_note()
    steps, mean = overview.mean_series("loss")
    assert len(steps) == 50
    finite_rows = np.isfinite(full.steps.loss)
    in_first = (full.steps.step <= 100) & finite_rows
    assert mean[0] == pytest.approx(full.steps.loss[in_first].mean(), rel=1e-12)
    x, y = overview.replica_series("lr", 1)
    assert len(x) == 100 and x[0] == 1 and x[1] == 100
    assert y[1] == full.steps.values["lr"][(full.steps.replica == 1) & (full.steps.step <= 100)].max()
    starts, grid = overview.multiplier_grid("lr")
    assert len(starts) == 50 and np.allclose(grid[:, 0], 1.0 + 0.1 * (np.arange(4) - 1.5))
    assert overview.world_size == 4 and overview.last_step == STEPS
    assert overview.explored_names() == ["lr"] and overview.series_keys("lr") == ["lr"]
    assert np.isfinite(overview.final_loss())


def test_a_zoomed_range_reads_every_row_of_it(tmp_path):
    root = write_archive(tmp_path)
    full = read(root, max_rows=10**9)
    overview = read(root, max_rows=1_000)
    fetched: list[str] = []
    zoom = read(root, previous=overview, fetched=fetched, steps=(1234, 1789), max_rows=3_000)
    assert not zoom.overview and zoom.view == (1234, 1789)
    mask = (full.steps.step >= 1234) & (full.steps.step <= 1789)
    np.testing.assert_array_equal(zoom.steps.step, full.steps.step[mask])
    np.testing.assert_array_equal(zoom.steps.replica, full.steps.replica[mask])
    np.testing.assert_array_equal(zoom.steps.loss, full.steps.loss[mask])
    np.testing.assert_array_equal(zoom.steps.values["lr"], full.steps.values["lr"][mask])
    assert all("steps-" in f for f in fetched)  # summaries and events came from the overview
    assert len(fetched) < len([f for f in names_of(root) if "steps-" in f])  # only the chunks of the range
    # too many rows in the range: an overview of the range, at a finer level
    wide = read(root, previous=overview, steps=(1, 4000), max_rows=3_000)
    assert wide.overview and wide.view == (1, 4000) and wide.mean_series("loss")[0].max() < 4000


def test_an_archive_without_summaries_reads_every_row(tmp_path):
    root = write_archive(tmp_path)
    want = read(root, max_rows=10**9)
    parts = sorted((root / "summary").glob("part-*"))
    for p in (root / "summary").glob("rollup-*"):
        p.unlink()
    parts[1].unlink()  # one chunk has no summary: it is summarised from its rows
    patched = read(root, max_rows=1_000)
    assert patched.overview
    assert_same(patched.aggregates, exact(want.steps))
    shutil.rmtree(root / "summary")  # written before 0.3
    old = read(root, max_rows=1_000)
    assert old.aggregates is None and not old.overview
    np.testing.assert_array_equal(old.steps.step, want.steps.step)
    np.testing.assert_array_equal(old.steps.loss, want.steps.loss)
    assert len(old.converge) == 2


def test_a_live_runs_summaries_grow_with_each_read(tmp_path):
    archive = EventArchive(tmp_path / ARTIFACT_DIR, chunk_rows=3_000, levels=LEVELS, rollup_every=3)
    root = tmp_path / ARTIFACT_DIR
    previous, seen = None, 0
    for i, block in enumerate(blocks()):
        archive.add_steps(block)
        archive.write()
        if i % 2:
            continue
        fetched: list[str] = []
        run = read(root, previous=previous, fetched=fetched, max_rows=500)
        full = read(root, max_rows=10**9)
        assert run.overview and run.last_step == full.last_step
        assert_same(run.aggregates, exact(full.steps))
        assert not set(fetched) & set(previous.chunks if previous else ())  # only what is new
        seen += 1
        previous = run
    assert seen >= 4


def test_a_write_that_dies_half_way_leaves_no_torn_chunk(tmp_path, monkeypatch):
    """A chunk appears under its name whole or not at all (a live reader polls the directory): a
    write that fails half way (the process killed, the disk full) leaves only the chunks before it."""
    import pyarrow.parquet as pq

    archive = EventArchive(tmp_path / ARTIFACT_DIR, chunk_rows=3_000, levels=LEVELS, rollup_every=3)
    first, second = list(blocks())[:2]
    archive.add_steps(first)
    archive.write()
    before = sorted(p.name for p in (tmp_path / ARTIFACT_DIR).rglob("*.parquet"))
    real = pq.write_table

    def dies_half_way(table, where, **kwargs):  # noqa: ANN001, ANN003 - injects the fault
        real(table, where, **kwargs)
        Path(where).write_bytes(Path(where).read_bytes()[: Path(where).stat().st_size // 2])
        raise OSError("No space left on device")

    monkeypatch.setattr(pq, "write_table", dies_half_way)
    archive.add_steps(second)
    with pytest.raises(OSError, match="No space"):
        archive.write()
    assert sorted(p.name for p in (tmp_path / ARTIFACT_DIR).rglob("*.parquet")) == before
    run = read(tmp_path / ARTIFACT_DIR, max_rows=10**9)
    assert not run.warnings and run.last_step == int(first.step.max())


def test_a_chunk_read_while_torn_is_read_again_by_the_next_live_read(tmp_path):
    """A live reader that met a half-written chunk (a store that copies files in place) reads it
    again once it is whole: its events and rows are not lost for the rest of the session."""
    archive = EventArchive(tmp_path / ARTIFACT_DIR, chunk_rows=3_000, levels=LEVELS, rollup_every=3)
    archive.add([Converge(step=100, window_losses=[1.0] * 4, divergence=[0.0] * 4)])
    archive.add_steps(list(blocks())[0])
    archive.write()
    root = tmp_path / ARTIFACT_DIR
    want = read(root, max_rows=10**9)
    chunks = sorted(root.glob("*.parquet"))
    whole = {p: p.read_bytes() for p in chunks}
    for p in chunks:
        p.write_bytes(whole[p][: len(whole[p]) // 2])
    torn = read(root, max_rows=10**9)
    assert torn.warnings and not torn.converge
    for p in chunks:
        p.write_bytes(whole[p])
    again = read(root, previous=torn, max_rows=10**9)
    assert [c.step for c in again.converge] == [c.step for c in want.converge] == [100]
    np.testing.assert_array_equal(again.steps.step, want.steps.step)


# ---------------------------------------------------------------------- the dashboard on a huge run
APP = str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py")
PAGES = ["fanout", "converge", "controller", "compare", "export"]


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """An MLflow run of 4 x 5,000 steps written the way the tracker writes it (chunks, summaries)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("big")
    uri = f"sqlite:///{root / 'big.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("hdet", artifact_location=str(root / "artifacts"))
    run_id = client.create_run(exp, run_name="big", tags={"hdet.schedule": "hdet"}).info.run_id
    archive = EventArchive(root / "tmp" / ARTIFACT_DIR, chunk_rows=3_000, levels=LEVELS, rollup_every=3)
    archive.add(
        [
            RunStart(
                config={},
                world_size=REPLICAS,
                schedule="hdet",
                param_groups=["pg0"],
                explored=[
                    ExploredSpec.from_dict(
                        {
                            "name": "lr",
                            "spread": 0.3,
                            "bounds": [[1e-7, 1.0]],
                            "targets": ["pg0"],
                            "multipliers": [0.85, 0.95, 1.05, 1.15],
                        }
                    )
                ],
                versions={},
                hostnames=["h"] * REPLICAS,
            )
        ]
        + [
            Converge(step=k, window_losses=[1.0] * REPLICAS, divergence=[0.01] * REPLICAS)
            for k in range(500, 5001, 500)
        ]
    )
    for block in blocks():
        archive.add_steps(block)
        if archive.due():
            for path in archive.write():
                client.log_artifact(run_id, str(path), artifact_dir(path))
    for path in archive.write():
        client.log_artifact(run_id, str(path), artifact_dir(path))
    client.set_terminated(run_id)
    return uri


def test_every_page_opens_a_huge_run_as_an_overview(monkeypatch, big_store):
    from streamlit.testing.v1 import AppTest

    from hdet_track.readers.mlflow import MLflowReader

    run = MLflowReader(big_store).read(MLflowReader(big_store).list_runs()[0].run_id, max_rows=1_000)
    assert run.overview and run.resolution == 100 and "loss" not in run.metrics

    monkeypatch.setenv("HDET_DASHBOARD_SOURCE", big_store)
    monkeypatch.setenv("HDET_FULL_ROWS", "1000")  # 20,000 rows: a huge run for this test
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, at.exception
    for page in PAGES:
        at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, (page, at.exception)
        if page in ("fanout", "converge", "controller"):
            assert any("per 100 steps" in c.value for c in at.caption), page
        if page in ("fanout", "converge"):
            titles = [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]
            assert "summary: min/max and mean per 100 steps" in titles[0], (page, titles)
    at.switch_page("app_pages/fanout.py").run()
    at.slider[0].set_value((1200, 1300)).run()  # 404 rows: every step
    assert not at.exception, at.exception
    assert any("Every step of steps 1,200 to 1,300" in c.value for c in at.caption)
    fan = json.loads(at.get("plotly_chart")[0].proto.spec)
    replica0 = next(t for t in fan["data"] if t["name"] == "replica 0")
    x = replica0["x"]
    x = np.frombuffer(base64.b64decode(x["bdata"]), dtype=x["dtype"]) if isinstance(x, dict) else np.array(x)
    assert x.tolist() == list(range(1200, 1301)) and "summary" not in fan["layout"]["title"]["text"]


def test_a_zoom_of_as_many_rows_as_allowed_reads_them_all_wherever_it_starts(tmp_path):
    """The dashboard's slider promises every step of a range of up to $HDET_FULL_ROWS / replicas
    steps. Before, the range's rows were counted as those of every bucket it touched, so such a
    range across a bucket edge (here 1,000 steps over two 1,000-step buckets) stayed an overview."""
    root = write_archive(tmp_path)
    full = read(root, max_rows=10**9)
    overview = read(root, max_rows=1_000)
    for lo in (1001, 1500, 1999):
        span = (lo, lo + 999)  # 1,000 steps: 4,000 rows, the limit exactly
        zoom = read(root, previous=overview, steps=span, max_rows=REPLICAS * 1_000)
        assert not zoom.overview and len(zoom.steps) == REPLICAS * 1_000
        mask = (full.steps.step >= span[0]) & (full.steps.step <= span[1])
        np.testing.assert_array_equal(zoom.steps.loss, full.steps.loss[mask])
        # one step more is one replica row per replica over the limit: an overview
        wider = read(root, previous=overview, steps=(lo, lo + 1_000), max_rows=REPLICAS * 1_000)
        assert wider.overview


def test_a_write_that_fails_half_way_writes_no_chunk_twice(tmp_path, monkeypatch):
    """A write whose events chunk failed (a full disk) after its steps chunk was in kept both in the
    buffer: the next write wrote the step rows again, and the first steps chunk was never reported
    (MLflow uploads what write() returns)."""
    import errno

    from hdet_track.tracking import archive as archive_module

    real, armed = archive_module._write_atomic, {"left": 1}

    def events_fail_once(table, path):
        if armed["left"] and path.name.startswith("events-"):
            armed["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(table, path)

    monkeypatch.setattr(archive_module, "_write_atomic", events_fail_once)
    archive = EventArchive(tmp_path / ARTIFACT_DIR, chunk_rows=3_000, levels=LEVELS)
    archive.add([Converge(step=5, window_losses=[1.0] * REPLICAS, divergence=[0.0] * REPLICAS)])
    archive.add_steps(next(blocks(steps=5)))
    with pytest.raises(OSError):
        archive.write()
    written = archive.write()
    names = sorted(p.name for p in written if p.parent.name == ARTIFACT_DIR)
    assert [n.split("-")[0] for n in names] == ["events", "steps"]  # the first steps chunk is reported now
    assert archive.write() == []
    import pyarrow.parquet as pq

    stored = [
        s for f in (tmp_path / ARTIFACT_DIR).glob("steps-*.parquet") for s in pq.read_table(f)["step"].to_pylist()
    ]
    assert sorted(stored) == sorted(next(blocks(steps=5)).step.tolist())  # every row once
    assert [c.step for c in read(tmp_path / ARTIFACT_DIR, max_rows=10**9).converge] == [5]

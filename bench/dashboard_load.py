"""Rebuilding a large run: 8 replicas x 100,000 steps from the event archive vs metric histories.

The run is written in the tracking code's own archive format (Parquet chunks under
``hdet_events/``) into a temporary sqlite MLflow store. Reading every per-replica metric history
one by one is measured on three 100,000-point histories (logged with log_batch), each read once:
their median is multiplied by the number of histories a rebuild needs (loss and lr for each
replica); the archive rebuild is timed in full, including the artifact downloads, three times,
and its median taken.

``--huge`` instead builds a run of 64 replicas x 1,000,000 steps (64M step rows, vectorised, through
the archive's own writer, so with the summaries users get), then opens every dashboard page with
Streamlit's AppTest, each page in a fresh process (the libraries imported before the clock starts, as
in a running dashboard), and reports the slowest page and the highest peak resident memory
(JSON lines ``dashboard_load.open_64x1M`` and ``dashboard_load.open_64x1M_rss``).

Run: .venv/bin/python bench/dashboard_load.py [--replicas 8] [--steps 100000]
     .venv/bin/python bench/dashboard_load.py --huge [--replicas 64] [--steps 1000000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from hdet_track.events import Converge, RunStart, StepRecord
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.record import ExploredSpec
from hdet_track.tracking.archive import ARTIFACT_DIR, EventArchive, StepBlock, artifact_dir

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
PAGES = ["runs", "fanout", "converge", "controller", "compare", "export"]
SAMPLED_HISTORIES = ("hdet/replica_00/loss", "hdet/replica_01/lr", "hdet/replica_00/lr")


def run_start(replicas: int, rho: list[float]) -> RunStart:
    spec = {"name": "lr", "spread": 0.3, "bounds": [[1e-7, 1.0]], "targets": ["pg0"], "multipliers": rho}
    return RunStart(
        config={},
        world_size=replicas,
        schedule="hdet",
        param_groups=["pg0"],
        explored=[ExploredSpec.from_dict(spec)],
        versions={},
        hostnames=["h"] * replicas,
    )


def build_run(client: MlflowClient, exp: str, replicas: int, steps: int, tmp: Path) -> str:
    run_id = client.create_run(exp, tags={"hdet.schedule": "hdet", "hdet.schema_version": "1"}).info.run_id
    archive = EventArchive(tmp / ARTIFACT_DIR, chunk_rows=200_000)
    rho = [1 + 0.3 * (r - (replicas - 1) / 2) / ((replicas - 1) / 2) for r in range(replicas)]
    archive.add([run_start(replicas, rho)])
    for k in range(1, steps + 1):
        base = 0.1 * (1 + math.cos(math.pi * k / steps)) / 2 + 1e-4
        archive.add(
            StepRecord(
                step=k,
                replica=r,
                values={"lr": base * rho[r]},
                multipliers={"lr": rho[r]},
                loss=2.0 / math.sqrt(k) + 0.01 * r,
            )
            for r in range(replicas)
        )
        if k % 1000 == 0:
            archive.add([Converge(step=k, window_losses=[1.0] * replicas, divergence=[0.01] * replicas)])
        if archive.due():
            for path in archive.write():
                client.log_artifact(run_id, str(path), artifact_dir(path))
    for path in archive.write():
        client.log_artifact(run_id, str(path), artifact_dir(path))
    for key in SAMPLED_HISTORIES:  # the histories timed (a rebuild from histories needs 2 per replica)
        history = [Metric(key, 2.0 / math.sqrt(k), 0, k) for k in range(1, steps + 1)]
        for i in range(0, len(history), 1000):
            client.log_batch(run_id, metrics=history[i : i + 1000])
    client.set_terminated(run_id)
    return run_id


def build_huge(client: MlflowClient, exp: str, replicas: int, steps: int, tmp: Path) -> str:
    """A run of ``replicas`` x ``steps`` in the archive format, a chunk of 200,000 rows at a time (numpy
    blocks through ``EventArchive``, which writes the summaries), with a sync every 1,000 steps."""
    run_id = client.create_run(exp, run_name=f"huge-{replicas}x{steps}", tags={"hdet.schedule": "hdet"}).info.run_id
    archive = EventArchive(tmp / ARTIFACT_DIR, chunk_rows=200_000)
    rho = np.array([1 + 0.3 * (r - (replicas - 1) / 2) / ((replicas - 1) / 2) for r in range(replicas)])
    archive.add([run_start(replicas, rho.tolist())])
    syncs = range(1000, steps + 1, 1000)
    archive.add(Converge(step=k, window_losses=[1.0] * replicas, divergence=[0.01] * replicas) for k in syncs)
    per = max(1, 200_000 // replicas)
    rng = np.random.default_rng(0)
    for lo in range(1, steps + 1, per):
        k = np.arange(lo, min(lo + per, steps + 1), dtype=np.int64)
        base = 0.1 * (1 + np.cos(np.pi * k / steps)) / 2 + 1e-4
        step = np.repeat(k, replicas)
        replica = np.tile(np.arange(replicas, dtype=np.int32), len(k))
        mult = rho[replica]
        loss = 2.0 / np.sqrt(step) + 0.01 * replica + 0.01 * rng.standard_normal(len(step))
        archive.add_steps(StepBlock(step, replica, loss, {"lr": np.repeat(base, replicas) * mult}, {"lr": mult}))
        for path in archive.write():
            client.log_artifact(run_id, str(path), artifact_dir(path))
            path.unlink()
    for path in archive.write():
        client.log_artifact(run_id, str(path), artifact_dir(path))
    client.set_terminated(run_id)
    return run_id


def open_page(source: str, page: str, zoom: tuple[int, int] | None) -> None:
    """In this (fresh) process: open the dashboard, then ``page``; print seconds and peak RSS."""
    os.environ["HDET_DASHBOARD_SOURCE"] = source
    import plotly.graph_objects  # noqa: F401 - imported before the clock, as in a running dashboard
    import pyarrow.parquet  # noqa: F401
    import streamlit  # noqa: F401
    from streamlit.testing.v1 import AppTest

    import hdet_track.viz  # noqa: F401

    at = AppTest.from_file(str(APP), default_timeout=600)
    t = time.perf_counter()
    at.run()
    seconds = time.perf_counter() - t
    if page != "runs":
        t = time.perf_counter()
        at.switch_page(f"app_pages/{page}.py").run()
        seconds = time.perf_counter() - t
    out = {"page": page, "seconds": seconds, "exception": [str(e.value) for e in at.exception]}
    out["caption"] = [c.value for c in at.caption][:2]
    if zoom is not None:
        t = time.perf_counter()
        at.slider[0].set_value(zoom).run()
        out["zoom_seconds"] = time.perf_counter() - t
        out["zoom_caption"] = [c.value for c in at.caption][:2]
        out["exception"] += [str(e.value) for e in at.exception]
    out["rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print("RESULT " + json.dumps(out))


def huge(args: argparse.Namespace) -> None:
    tag = (
        f"{args.replicas}x{args.steps // 1_000_000}M"
        if args.steps % 1_000_000 == 0
        else f"{args.replicas}x{args.steps}"
    )
    with tempfile.TemporaryDirectory(dir=args.keep) as tmp:
        uri = f"sqlite:///{tmp}/huge.db"
        client = MlflowClient(uri)
        exp = client.create_experiment("hdet", artifact_location=f"{tmp}/artifacts")
        t = time.perf_counter()
        build_huge(client, exp, args.replicas, args.steps, Path(tmp) / "build")
        built = time.perf_counter() - t
        print(f"built a {args.replicas} x {args.steps:,} run ({args.replicas * args.steps:,} rows) in {built:.0f} s")
        results = []
        for page in PAGES:
            zoom = (args.steps // 2, args.steps // 2 + 10_000) if page == "fanout" else None
            cmd = [sys.executable, __file__, "--open-page", page, "--source", uri]
            if zoom:
                cmd += ["--zoom", f"{zoom[0]}:{zoom[1]}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"page {page} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            res = json.loads(line[len("RESULT ") :])
            results.append(res)
            zoomed = f", zoom to 10,000 steps {res['zoom_seconds']:.2f} s {res['zoom_caption']}" if zoom else ""
            print(f"{page:>10}: {res['seconds']:.2f} s{zoomed}, peak RSS {res['rss_gb']:.2f} GB {res['caption']}")
            if res["exception"]:
                print(f"{page:>10}: EXCEPTION {res['exception']}")
    slowest = max(r["seconds"] for r in results)
    rss = max(r["rss_gb"] for r in results)
    ok = not any(r["exception"] for r in results)
    zoom_s = max((r["zoom_seconds"] for r in results if "zoom_seconds" in r), default=None)
    per_page = {r["page"]: round(r["seconds"], 2) for r in results}
    line = {"bench": f"dashboard_load.open_{tag}", "value": round(slowest, 2), "unit": "s", "target": 3.0}
    line |= {"pass": ok and slowest <= 3.0, "pages": per_page, "zoom_10k_steps_s": zoom_s, "build_s": round(built)}
    print(json.dumps(line))
    rss_line = {"bench": f"dashboard_load.open_{tag}_rss", "value": round(rss, 3), "unit": "GB", "target": 1.5}
    print(json.dumps(rss_line | {"pass": rss <= 1.5}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--huge", action="store_true", help="64 x 1,000,000 steps; open every dashboard page")
    parser.add_argument("--keep", default=None, help="where the temporary store goes (default: the system's)")
    parser.add_argument("--open-page", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--source", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--zoom", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.open_page:
        zoom = tuple(int(x) for x in args.zoom.split(":")) if args.zoom else None
        open_page(args.source, args.open_page, zoom)  # type: ignore[arg-type]
        return
    if args.huge:
        args.replicas = args.replicas or 64
        args.steps = args.steps or 1_000_000
        huge(args)
        return
    args.replicas = args.replicas or 8
    args.steps = args.steps or 100_000
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/load.db"
        client = MlflowClient(uri)
        exp = client.create_experiment("load", artifact_location=f"{tmp}/artifacts")
        t = time.perf_counter()
        run_id = build_run(client, exp, args.replicas, args.steps, Path(tmp))
        print(f"built a {args.replicas} x {args.steps:,} run in {time.perf_counter() - t:.1f} s")
        reader = MLflowReader(uri)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            run = reader.read(run_id)
            times.append(time.perf_counter() - t)
        archive_s = float(np.median(times))
        assert len(run.steps) == args.replicas * args.steps, len(run.steps)
        # the same number of reads on the other side: 3 distinct histories, each read once (a cold
        # history and a warm archive would flatter the archive), their median times the count
        history_times = []
        for key in SAMPLED_HISTORIES:
            t = time.perf_counter()
            points = client.get_metric_history(run_id, key)
            history_times.append(time.perf_counter() - t)
            assert len(points) == args.steps, (key, len(points))
        one_s = float(np.median(history_times))
        histories = 2 * args.replicas
        histories_s = one_s * histories
        ratio = histories_s / archive_s
        print(f"archive rebuild: {archive_s:.2f} s (median of 3: {', '.join(f'{x:.2f}' for x in times)})")
        print(
            f"one {args.steps:,}-point history: {one_s:.2f} s (median of {len(SAMPLED_HISTORIES)}: "
            f"{', '.join(f'{x:.2f}' for x in history_times)}); x {histories} histories = {histories_s:.1f} s"
        )
        print(f"ratio: {ratio:.0f}x")
    print(
        json.dumps(
            {
                "bench": "dashboard_load.archive_seconds",
                "value": round(archive_s, 3),
                "unit": "s",
                "target": 2.0,
                "pass": archive_s <= 2.0,
            }
        )
    )
    print(
        json.dumps(
            {
                "bench": "dashboard_load.vs_histories",
                "value": round(ratio, 1),
                "unit": "x",
                "target": 50,
                "pass": ratio >= 50,
            }
        )
    )


if __name__ == "__main__":
    main()

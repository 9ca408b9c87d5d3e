"""Rebuilding a large run: 8 replicas x 100,000 steps from the event archive vs metric histories.

The run is written in the tracking code's own archive format (Parquet chunks under
``hdet_events/``) into a temporary sqlite MLflow store. Reading every per-replica metric history
one by one is measured on one 100,000-point history (logged with log_batch) and multiplied by the
number of histories a rebuild needs (loss and lr for each replica); the archive rebuild is timed
in full, including the artifact downloads.

Run: .venv/bin/python bench/dashboard_load.py [--replicas 8] [--steps 100000]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from hdet_track.events import Converge, RunStart, StepRecord
from hdet_track.readers.mlflow import MLflowReader
from hdet_track.tracking.archive import ARTIFACT_DIR, EventArchive


def build_run(client: MlflowClient, exp: str, replicas: int, steps: int, tmp: Path) -> str:
    run_id = client.create_run(exp, tags={"hdet.schedule": "hdet", "hdet.schema_version": "1"}).info.run_id
    archive = EventArchive(tmp / ARTIFACT_DIR, chunk_rows=200_000)
    rho = [1 + 0.3 * (r - (replicas - 1) / 2) / ((replicas - 1) / 2) for r in range(replicas)]
    archive.add(
        [
            RunStart(
                config={},
                world_size=replicas,
                schedule="hdet",
                param_groups=["pg0"],
                explored=[
                    {"name": "lr", "spread": 0.3, "bounds": [[1e-7, 1.0]], "targets": ["pg0"], "multipliers": rho}
                ],
                versions={},
                hostnames=["h"] * replicas,
            )
        ]
    )
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
                client.log_artifact(run_id, str(path), ARTIFACT_DIR)
    for path in archive.write():
        client.log_artifact(run_id, str(path), ARTIFACT_DIR)
    history = [Metric("hdet/replica_00/loss", 2.0 / math.sqrt(k), 0, k) for k in range(1, steps + 1)]
    for i in range(0, len(history), 1000):
        client.log_batch(run_id, metrics=history[i : i + 1000])
    client.set_terminated(run_id)
    return run_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100_000)
    args = parser.parse_args()
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
        archive_s = min(times)
        assert len(run.steps) == args.replicas * args.steps, len(run.steps)
        t = time.perf_counter()
        one = client.get_metric_history(run_id, "hdet/replica_00/loss")
        one_s = time.perf_counter() - t
        assert len(one) == args.steps
        histories = 2 * args.replicas
        histories_s = one_s * histories
        ratio = histories_s / archive_s
        print(f"archive rebuild: {archive_s:.2f} s (best of 3: {', '.join(f'{x:.2f}' for x in times)})")
        print(f"one {args.steps:,}-point history: {one_s:.2f} s; x {histories} histories = {histories_s:.1f} s")
        print(f"ratio: {ratio:.0f}x")
    print(
        json.dumps(
            {
                "bench": "dashboard_load_archive_seconds",
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
                "bench": "dashboard_load_vs_histories",
                "value": round(ratio, 1),
                "unit": "x",
                "target": 50,
                "pass": ratio >= 50,
            }
        )
    )


if __name__ == "__main__":
    main()

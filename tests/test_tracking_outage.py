"""Kill the real MLflow server in the middle of a run: training goes on, every point arrives."""

from __future__ import annotations

import threading
import time

import torch
from mlflow.tracking import MlflowClient
from torch import nn

from hdet_track import HDETScheduler
from hdet_track.tracking.mlflow import MLflowTracker

from .servers import MlflowServer


def test_server_outage_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HDET_POINTS_PER_SECOND", "0")  # every point is expected back: no budget thinning
    server = MlflowServer(tmp_path / "srv").start()
    try:
        tracker = MLflowTracker(tracking_uri=server.uri, experiment="outage")
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        steps = 300
        sched = HDETScheduler(opt, 0.1, total_steps=steps, sync_every=10, auto_lr=True, track=tracker)
        sched._callbacks.recorder.hub._sinks[0].retry_seconds = 0.5
        outage = {}

        def kill_and_restart():
            time.sleep(2.0)
            server.stop()
            outage["down"] = time.monotonic()
            time.sleep(6.0)
            server.start()
            outage["up"] = time.monotonic()

        chaos = threading.Thread(target=kill_and_restart)
        chaos.start()
        step_times = []
        for k in range(steps):
            t = time.monotonic()
            opt.step()
            sched.step(1.0 + 1.0 / (k + 1))
            step_times.append(time.monotonic() - t)
            time.sleep(0.04)
        chaos.join()
        assert outage["down"] < outage["up"]
        sched.close()  # the run is complete once everything reached the server
        sched.flush(timeout=180)
        client = MlflowClient(server.uri)
        run = client.get_run(tracker.run_id)
        assert run.info.status == "FINISHED"
        lr = client.get_metric_history(tracker.run_id, "hdet/replica_00/lr")
        loss = client.get_metric_history(tracker.run_id, "hdet/replica_00/loss")
        assert sorted(m.step for m in lr) == list(range(1, steps + 1))  # every point, exactly once
        assert sorted(m.step for m in loss) == list(range(1, steps + 1))
        assert len(client.get_metric_history(tracker.run_id, "hdet/controller/lr/base")) == steps // 10
        # The outage happened while training ran, and training never waited on the tracker:
        # no step took anywhere near the outage's 6 s (a loaded machine may stall a step for a second).
        assert max(step_times) < 3.0
    finally:
        server.stop()

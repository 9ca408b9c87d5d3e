"""A retry loop in one process (tests/test_lifecycle.py).

    python retry_job.py BACKEND URI

The first attempt keeps a checkpoint at step 10 and raises at step 13; the loop catches the
exception, and a second attempt (a new model, optimizer, scheduler and tracker) resumes the same
run from the checkpoint, reaches the last step and logs ``val_loss``; the process exits normally.
"""

from __future__ import annotations

import io
import sys

import torch
import torch.nn.functional as F
from trackers import tracker_factory


def attempt(factory, checkpoint: io.BytesIO):  # noqa: ANN001
    from hdet_track import HDETScheduler

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, model=model, track=factory(), run_name="retry")
    start = 0
    if checkpoint.getbuffer().nbytes:
        checkpoint.seek(0)
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start = 10
    for k in range(start + 1, 21):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(16, 8, generator=g)
        loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        if k == 10 and not start:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, checkpoint)
        if k == 13 and not start:
            raise RuntimeError("a transient failure at step 13")
    sched.log_metrics({"val_loss": 0.5})


def main() -> None:
    backend, uri = sys.argv[1:3]
    factory = tracker_factory(backend, uri, "retry")

    checkpoint = io.BytesIO()
    for _ in range(2):
        try:
            attempt(factory, checkpoint)
            break
        except RuntimeError as exc:
            print("RETRY", exc, flush=True)


if __name__ == "__main__":
    main()

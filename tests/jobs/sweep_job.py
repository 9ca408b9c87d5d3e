"""Two tracked runs in one process, as a sweep makes them (tests/test_lifecycle.py).

    python sweep_job.py BACKEND URI CASE

The first run trains to its last step and logs a final ``val_loss`` without closing. Then the
second: CASE ``raise`` (an exception at its step 15), ``exit`` (``sys.exit(3)`` after its last
step) or ``ok``. Prints ``FIRST_FREED <bool>``: whether the first run's model could be collected
once the second scheduler existed (the user dropped every reference to it).
"""

from __future__ import annotations

import gc
import sys
import weakref

import torch
import torch.nn.functional as F
from trackers import tracker_factory


def run(name: str, track_factory, fail_at: int | None = None):  # noqa: ANN001, ANN201
    from hdet_track import HDETScheduler

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, model=model, track=track_factory(), run_name=name)
    g = torch.Generator().manual_seed(0)
    for k in range(1, 21):
        if k == fail_at:
            raise RuntimeError(f"boom in {name} at step {k}")
        x = torch.randn(16, 8, generator=g)
        loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
    return model, sched


def main() -> None:
    backend, uri, case = sys.argv[1:4]
    factory = tracker_factory(backend, uri, "sweep")

    model, sched = run("first", factory)
    sched.log_metrics({"val_loss": 0.25})
    first = weakref.ref(model)
    del model, sched
    if case == "raise":
        run("second", factory, fail_at=15)
    model2, sched2 = run("second", factory)
    gc.collect()
    print("FIRST_FREED", first() is None, flush=True)
    if case == "exit":
        sys.exit(3)
    if case == "builtin_exit":  # site's exit(), as in `exit(main())`: SystemExit without sys.exit
        exit(3)  # noqa: PLR1722


if __name__ == "__main__":
    main()

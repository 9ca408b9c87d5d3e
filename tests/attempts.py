"""One attempt of a small tracked job that fails and is resumed (the resume tests' common loop)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hdet_track import HDETScheduler


def attempt(
    track: Any,
    keep: dict[str, Any],
    state: dict[str, Any] | None = None,
    fail_at: int | None = None,
    save_at: int = 10,
    during: Callable[[int, HDETScheduler], None] | None = None,
) -> HDETScheduler:
    """20 steps, syncs every 5, tracked to ``track``: resumed from ``state`` when given; raises
    ``RuntimeError("boom at step N")`` before step ``fail_at`` (inside the scheduler's ``with``: the
    run ends FAILED); the state after step ``save_at`` goes to ``keep["state"]``; ``during(k, sched)``
    after every step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, model=model, track=track)
    if state is not None:
        sched.load_state_dict(state)
    with sched:
        for k in range(sched.last_epoch + 1, 21):
            if k == fail_at:
                raise RuntimeError(f"boom at step {k}")
            opt.step()
            sched.step(1.0 / k)
            if k == save_at:
                keep["state"] = sched.state_dict()
            if during is not None:
                during(k, sched)
    return sched

"""Which error a distributed run ends with: the failure notes ranks leave in torch.distributed's
store (a real store; the ranks are this process taking each rank's place in turn)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from hdet_track.tracking import lifecycle


def test_rank_zero_reports_the_rank_that_failed_first_not_the_lowest_numbered(monkeypatch):
    """Rank 3 raises; ranks 1 and 2 then fail on the collective it left and leave notes too (both
    integrations leave one as they catch the error). Rank 0 read the lowest rank's note, rank 1's
    "Connection closed by peer", and set the store's timeout to 2 s for good."""
    store = dist.HashStore()
    monkeypatch.setattr(lifecycle, "_store", lambda: store)
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 4)
    for rank, text in [(3, "RuntimeError: the cause"), (1, "gloo: Connection closed by peer"), (2, "gloo: closed")]:
        monkeypatch.setitem(lifecycle._STATE, "rank", rank)
        monkeypatch.setitem(lifecycle._STATE, "noted", False)  # each rank its own process
        lifecycle._leave_note(text)
    lifecycle._leave_note("the same error again, at rank 2's excepthook")  # one note per process
    monkeypatch.setitem(lifecycle._STATE, "rank", 0)
    assert lifecycle._peer_failure() == "rank 3 failed:\nRuntimeError: the cause"
    assert lifecycle.caught_failure(ValueError("rank 0's own")) == ("FAILED", "rank 3 failed:\nRuntimeError: the cause")
    assert store.timeout == datetime.timedelta(minutes=5)  # put back
    assert store.get(f"{lifecycle._NOTE}2").decode().endswith("gloo: closed")

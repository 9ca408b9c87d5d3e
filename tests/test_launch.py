"""hdet_track.launch.launch_local: N local replicas through torch's elastic launcher."""

from __future__ import annotations

import os

import pytest


def _returns_then_aborts(when: str) -> int:
    """Rank 1 aborts (SIGABRT): at interpreter exit after a clean teardown (``"exit"``: what torch 2.13's
    gloo now and then does by itself), or in the middle of the job (``"job"``)."""
    import atexit

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    dist.destroy_process_group()
    if rank == 1 and when == "exit":
        atexit.register(os.abort)
    if rank == 1 and when == "job":
        os.abort()
    return int(total.item()) * 10 + rank


def test_an_abort_at_exit_after_every_rank_returned_keeps_the_results_and_one_in_the_job_fails():
    """A gloo abort at interpreter exit, after the work: the demo reported the run as failed ("rank 1
    was killed by SIGABRT") and lost its results; they now stand. An abort before the rank returned
    is still the launch's failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hdet_track.launch import launch_local

    assert launch_local(_returns_then_aborts, 2, "exit") == {0: 30, 1: 31}
    with pytest.raises(ChildFailedError) as failed:
        launch_local(_returns_then_aborts, 2, "job")
    rank, failure = failed.value.get_first_failure()
    assert rank == 1 and failure.signal_name() == "SIGABRT"

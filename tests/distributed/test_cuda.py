"""The scheduler on a GPU: 4 gloo ranks sharing one GPU (nccl refuses two ranks on one GPU, and a
test machine may have only one). Skipped where torch sees no GPU (CI's machines): these run on a
GPU machine with ``python -m pytest --noconftest tests/distributed/test_cuda.py`` (core deps only:
torch, numpy, pytest)."""

from __future__ import annotations

import math

import pytest
import torch

from . import workers_cuda
from .launch import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WORLD = 4


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:gloo"], ids=["cpu-group", "cuda-group"])
@pytest.mark.parametrize("ddp", [True, False], ids=["shared", "independent"])
def test_guard_averaging_and_exact_resume_with_cuda_state(ddp, backend):
    """``cuda-group``: a process group that takes CUDA tensors, as nccl's does (nccl itself refuses
    two ranks on one GPU), so HDET gathers its loss rows on the GPU: the same decisions."""
    res = run_ranks(workers_cuda.guard_and_resume, WORLD, ddp, timeout=300, start_method="spawn", backend=backend)
    assert all(r["rows_on"] == ("cuda" if "cuda" in backend else "cpu") for r in res)
    assert all(r["on_gpu"] for r in res)  # nothing HDET did moved parameters or moments off the GPU
    if ddp:  # the NaN reaches every rank through DDP: the collective guard rolls all back at once
        assert [r["scope"] for r in res] == ["all"] * WORLD
        assert res[0]["steps"][:2] == [7, 10] and res[0]["rolled_back"][0]
    else:  # rank 2 resets itself and is left out at the sync at 10
        assert [r["scope"] for r in res] == ["local"] * WORLD
        assert res[0]["steps"][0] == 10 and res[0]["left_out"][0] == [2]
    assert all(set(r["record_scope"]) == {res[0]["scope"]} for r in res)
    assert all(r["resumed_scope"] == r["scope"] for r in res)  # the decision came back with the checkpoint
    for r in res:
        assert torch.isfinite(r["final"]).all()
        assert torch.equal(r["final"], res[0]["final"])  # averaged at the last step: one consensus
        assert torch.equal(r["resumed"], r["final"])  # resumed from step 15 of CUDA state: bit for bit


def test_fused_adamw_with_a_tensor_lr_trains_with_each_replicas_values():
    res = run_ranks(workers_cuda.fused_adamw_tensor_lr, WORLD, timeout=300, start_method="spawn")
    for r in res:
        for lr, want_lr, wd, want_wd, is_tensor in r["seen"]:
            assert is_tensor and math.isclose(lr, want_lr, rel_tol=1e-6)
            assert math.isclose(wd, want_wd, rel_tol=1e-12)
        assert torch.equal(r["final"], res[0]["final"])
    first = [r["seen"][0][0] for r in res]
    assert len(set(first)) == WORLD  # the fan-out: four different LRs at the first step


def test_fsdp_flat_shards_are_refused_when_the_scheduler_is_built():
    res = run_ranks(workers_cuda.fsdp1_refused, 2, timeout=300, start_method="spawn")
    for errors in res:
        assert len(errors) == 6
        for case, error in errors.items():
            assert error is not None, f"{case}: accepted"
            assert "whole replica" in error or "sharded" in error, f"{case}: {error}"

"""Workers for tests/distributed/test_cuda.py: the scheduler with parameters, gradients, optimizer
state and the kept consensus on a GPU. The ranks share the one GPU a test machine may have and talk
through gloo (nccl refuses two ranks on one GPU), so what is checked is HDET's own device handling:
flat buckets, the consensus it restores, the step guard's gradient fingerprint, fused optimizers whose LR
is a tensor, and checkpoints of CUDA state."""

from __future__ import annotations

import io
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hdet_track import HDETScheduler, collectives
from hdet_track.controller import DriftController

from .workers import batch, make_model

CUDA = torch.device(os.environ.get("HDET_TEST_DEVICE", "cuda:0"))  # "cpu": a dry run of the workers


def _setup() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)
    if CUDA.type == "cuda":
        torch.cuda.set_device(CUDA)


def _train(rank, sched, net, opt, steps, start=0, nan_at=-1, victim=-1, on_step=None):  # noqa: ANN001
    for step in range(start, steps):
        x, y = (t.to(CUDA) for t in batch(rank, step))
        loss = F.cross_entropy(net(x), y)
        if rank == victim and step == nan_at:
            loss = loss * math.nan
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        if on_step is not None:
            on_step(step, sched)


def _flat(model) -> torch.Tensor:  # noqa: ANN001
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _build(ddp: bool):  # noqa: ANN202
    model = make_model().to(CUDA)
    net = DDP(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = HDETScheduler(
        opt, max_lr=0.05, total_steps=30, spread=0.3, sync_every=10, auto_lr=True, model=model,
        controller=DriftController(),
    )  # fmt: skip
    return model, net, opt, sched


def guard_and_resume(rank: int, world: int, ddp: bool) -> dict:
    """30 steps, rank 2's loss NaN at step 7 (index 6). Saved at step 15 through bytes
    (``weights_only=True``), resumed into fresh objects, run to the end: the resumed run must
    equal the uninterrupted one bit for bit."""
    _setup()
    records: list = []

    def keep(step, sched) -> None:  # noqa: ANN001
        rec = sched.last_sync
        if rec is not None and (not records or records[-1].step != rec.step):
            records.append(rec)

    model, net, opt, sched = _build(ddp)
    saved: dict = {}

    def keep_and_save(step, sched) -> None:  # noqa: ANN001
        keep(step, sched)
        if step == 14:
            buf = io.BytesIO()
            torch.save({"sched": sched.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, buf)
            saved["bytes"] = buf.getvalue()

    _train(rank, sched, net, opt, 30, nan_at=6, victim=2, on_step=keep_and_save)
    full = _flat(model)
    on_gpu = all(p.device == CUDA for p in model.parameters()) and all(
        t.device == CUDA for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
    )

    model2, net2, opt2, sched2 = _build(ddp)
    state = torch.load(io.BytesIO(saved["bytes"]), weights_only=True, map_location=CUDA)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    resumed_scope = sched2.controller.step_guard_scope  # before any step could decide it again
    _train(rank, sched2, net2, opt2, 30, start=15)
    return {
        "scope": sched.controller.step_guard_scope,
        "resumed_scope": resumed_scope,
        "steps": [r.step for r in records],
        "rolled_back": [r.rolled_back for r in records],
        "left_out": [list(r.left_out) for r in records],
        "record_scope": [r.step_guard for r in records],
        "final": full,
        "resumed": _flat(model2),
        "on_gpu": on_gpu,
        "rows_on": collectives._collective_device(None).type,  # where the loss rows were gathered
        "lr": [g["lr"] for g in opt.param_groups],
    }


def fused_adamw_tensor_lr(rank: int, world: int) -> dict:
    """Fused AdamW on the GPU with its LR as a tensor: every rank's optimizer must train with the
    scheduler's value for that rank (the fan-out), and the LR must stay a tensor on its device."""
    _setup()
    model = make_model().to(CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), fused=True, weight_decay=0.01)
    sched = HDETScheduler(
        opt, max_lr=0.01, total_steps=20, spread=0.4, sync_every=5, auto_lr=True, model=model,
        explore={"weight_decay": 0.5},
    )  # fmt: skip
    seen: list = []

    def check(step, s) -> None:  # noqa: ANN001
        group = opt.param_groups[0]
        seen.append(
            (
                float(group["lr"]),
                s.replica_values("lr")[rank][0],
                float(group["weight_decay"]),
                s.replica_values("weight_decay")[rank][0],
                torch.is_tensor(group["lr"]),
            )
        )

    _train(rank, sched, model, opt, 20, on_step=check)
    return {"seen": seen, "final": _flat(model)}


def fsdp1_refused(rank: int, world: int) -> dict:
    """FSDP (FullyShardedDataParallel, which needs an accelerator) leaves each rank a flat shard:
    the scheduler must refuse it when built, whichever of the wrapped model, the module inside it
    or the optimizer alone (``model=None``) it is given, with and without ``use_orig_params``.
    Returns ``{case: the error, or None when it was accepted}``."""
    _setup()
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    errors: dict[str, str | None] = {}
    for orig in (False, True):
        wrapped = FSDP(make_model().to(CUDA), device_id=CUDA, use_orig_params=orig)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.05)
        for given, model in (("wrapped", wrapped), ("inner", wrapped.module), ("optimizer", None)):
            try:
                HDETScheduler(opt, max_lr=0.05, total_steps=10, spread=0.3, sync_every=5, model=model)
                errors[f"{given}, use_orig_params={orig}"] = None
            except ValueError as exc:
                errors[f"{given}, use_orig_params={orig}"] = str(exc)
    return errors

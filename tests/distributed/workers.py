"""Worker functions run on real gloo ranks by tests/distributed (spawned, so module-level)."""

from __future__ import annotations

import copy
import math
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hdet_track import HDETScheduler, explore, warm_noisy_init
from hdet_track.record import SchedulerCallback


class DivergenceListener(SchedulerCallback):
    """Needs the divergences, as tracking does: every record it receives, in order, between the steps."""

    needs_divergence = True

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.times: list[float] = []

    def on_sync(self, record) -> None:
        self.events.append(("sync", record.step, list(record.divergences)))
        self.times.append(record.time)

    def on_step(self, step: int) -> None:
        self.events.append(("step", step))

    @property
    def syncs(self) -> list[tuple[int, list[float]]]:
        return [(e[1], e[2]) for e in self.events if e[0] == "sync"]


DIM = 8


def make_model(seed: int = 0, dropout: float = 0.0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)  # the same initial weights on every rank
    layers: list[nn.Module] = [nn.Linear(DIM, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3)]
    return nn.Sequential(*layers)


def batch(rank: int, step: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_003 * rank + step)
    x = torch.randn(n, DIM, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def sgd_step(net: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> torch.Tensor:
    """One optimizer step on this rank's batch of ``step``; returns the loss."""
    x, y = batch(rank, step)
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _floating_state(model: nn.Module) -> torch.Tensor:
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def fanout_and_sync(rank: int, world: int, mode: str) -> dict:
    """Train with spread and no auto-LR; record LRs, parameters and BatchNorm stats per step."""
    model = make_model(batchnorm=True)
    net = DDP(model) if mode == "ddp" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = HDETScheduler(opt, max_lr=0.2, total_steps=30, spread=0.3, sync_every=5, model=model, seed=3)
    sched.measure_divergence = True
    pre_sync, divergences = [], []
    lrs, params, bn_means, perms, onecycle = [opt.param_groups[0]["lr"]], [], [], [], [sched.onecycle_lrs()[0]]
    for step in range(30):
        x, y = batch(rank, step)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (step + 1) % 5 == 0:
            pre_sync.append(_floating_state(model))
        sched.step(loss)
        if (step + 1) % 5 == 0:
            divergences.append((sched.last_sync.divergence, _floating_state(model)))
        lrs.append(opt.param_groups[0]["lr"])
        onecycle.append(sched.onecycle_lrs()[0])
        params.append(flat_params(model))
        bn_means.append(model[1].running_mean.clone())
        perms.append(list(sched._fanout.perm["lr"]))
    return {
        "lrs": lrs,
        "onecycle": onecycle,
        "params": params,
        "bn": bn_means,
        "perms": perms,
        "pre_sync": pre_sync,
        "divergences": divergences,
        "lr_type": type(opt.param_groups[0]["lr"]).__name__,
    }


def background_divergence(rank: int, world: int) -> dict:
    """The same 14 steps (syncs every 4 and at the end) three times: divergences measured at each
    sync (``measure_divergence``), and for a callback that ``needs_divergence``, gathered in the
    background or carried by the next sync's gather: what that callback receives, and when, next to
    the scheduler's own steps."""
    out = {}
    # "carried-by-0" / "background-by-0": only rank 0's setting says the window is short / long;
    # the others' says the opposite, and rank 0's decides for every rank (shared by the gather).
    for how in ("measured", "background", "carried", "carried-by-0", "background-by-0"):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        listener = DivergenceListener()
        sched = HDETScheduler(
            opt, max_lr=0.3, total_steps=14, spread=0.5, sync_every=4, model=model, seed=3,
            callbacks=[listener] if how != "measured" else [],
        )  # fmt: skip
        sched.measure_divergence = how == "measured"
        short = (how == "carried-by-0") == (rank == 0) if how.endswith("by-0") else how == "carried"
        sched._converger.carry_below_seconds = math.inf if short else 0.0  # every window short / long
        seen = []
        for step in range(14):
            sched.step(sgd_step(model, opt, rank, step))
            seen.append((sched.last_sync.step, list(sched.last_sync.divergences)) if sched.last_sync else None)
        out[how] = {"seen": seen, "events": listener.events, "params": flat_params(model)}
    return out


def controller_direction(rank: int, world: int, prefer: str) -> dict:
    """Report a synthetic loss that rewards high (or low) values of every explored hyperparameter.

    The loss is a function of the values this replica actually uses (read back from the optimizer
    and the model), so the test covers spread, permutation, gather and controller end to end.
    """
    model = make_model(dropout=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    hps = [explore.param_group("weight_decay", spread=0.5), explore.dropout(model, spread=0.5)]
    sched = HDETScheduler(
        opt,
        max_lr=0.1,
        total_steps=60,
        spread=0.4,
        sync_every=5,
        auto_lr=True,
        controller="paper",
        auto_lr_warmup=10,
        explore=hps,
        temperature=0.05,
        model=model,
    )
    sign = -1.0 if prefer == "high" else 1.0
    reports = []
    for step in range(60):
        x, y = batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        lr = opt.param_groups[0]["lr"] / sched.base_values("lr")[0]
        wd = opt.param_groups[0]["weight_decay"] / 1e-3
        p = model[2].p / 0.2
        sched.step(sign * (lr + wd + p))
        if sched.last_sync is not None and sched.last_sync.step == step + 1:
            reports.append(sched.last_sync)
    return {"reports": reports}


def nan_repair(rank: int, world: int) -> dict:
    """Rank 2 gets NaN parameters at step 7; the sync at step 10 must repair it."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = HDETScheduler(opt, max_lr=0.01, total_steps=20, spread=0.2, sync_every=10, model=model)
    out: dict = {"finite_state_after_sync": None}
    for step in range(20):
        x, y = batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 2 and step == 6:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        sched.step(loss)
        if step == 9:
            out["report"] = sched.last_sync
            out["params_at_sync"] = flat_params(model)
            out["state_sizes"] = [len(opt.state.get(p, {})) for p in model.parameters()]
            out["state_finite"] = all(
                bool(torch.isfinite(v).all()) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)
            )
    out["final_params"] = flat_params(model)
    out["final_loss"] = float(loss)
    return out


def _train_resumable(rank: int, model, opt, sched, start: int, stop: int, lrs: list) -> None:
    for step in range(start, stop):
        x, y = batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        lrs.append([g["lr"] for g in opt.param_groups] + [g["weight_decay"] for g in opt.param_groups] + [model[2].p])


def _build_resumable(rank: int, track=False):
    model = make_model(dropout=0.1)
    warm_noisy_init(model, nu=0.01)
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[3].parameters(), "weight_decay": 0.02}], lr=0.01
    )
    sched = HDETScheduler(
        opt,
        max_lr=[0.02, 0.01],
        total_steps=40,
        spread=0.3,
        sync_every=6,
        auto_lr=True,
        auto_lr_warmup=12,
        explore=[explore.param_group("weight_decay", 0.5), explore.dropout(model, 0.5)],
        model=model,
        seed=11,
        track=track,
    )
    torch.manual_seed(1234 + rank)  # dropout masks come from the global RNG; the job owns it
    return model, opt, sched


def resume_full(rank: int, world: int) -> dict:
    model, opt, sched = _build_resumable(rank)
    lrs: list = []
    _train_resumable(rank, model, opt, sched, 0, 40, lrs)
    return {"lrs": lrs, "params": flat_params(model)}


def resume_part1(rank: int, world: int, ckpt_dir: str, stop: int) -> dict:
    model, opt, sched = _build_resumable(rank)
    lrs: list = []
    _train_resumable(rank, model, opt, sched, 0, stop, lrs)
    torch.save(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "rng": torch.get_rng_state(),
            "lrs": lrs,
        },
        os.path.join(ckpt_dir, f"ckpt{rank}.pt"),
    )
    torch.distributed.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # the job dies without cleaning up
    return {}


def resume_part2(rank: int, world: int, ckpt_dir: str, stop: int) -> dict:
    model, opt, sched = _build_resumable(rank)
    ckpt = torch.load(os.path.join(ckpt_dir, f"ckpt{rank}.pt"), weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    torch.set_rng_state(ckpt["rng"])
    lrs = list(ckpt["lrs"])
    _train_resumable(rank, model, opt, sched, stop, 40, lrs)
    return {"lrs": lrs, "params": flat_params(model)}


def noise_init(rank: int, world: int) -> dict:
    model = make_model()
    before = flat_params(model)
    rng = torch.get_rng_state()
    warm_noisy_init(model, nu=0.05)
    return {"before": before, "after": flat_params(model), "rng_same": torch.equal(rng, torch.get_rng_state())}


def all_nonfinite(rank: int, world: int) -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=10, spread=0.2, sync_every=4, model=model)
    for step in range(10):
        opt.step()
        if step >= 2:  # a real divergence: the parameters too (a NaN loss alone is averaged, with a warning)
            with torch.no_grad():
                next(model.parameters()).fill_(math.nan)
        try:
            sched.step(math.nan if step >= 2 else 1.0)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return {"error": type(exc).__name__, "message": str(exc), "step": step}
    return {"error": None}


def tracked_job(
    rank: int, world: int, uri: str, backend: str, name: str = "hdet-4", nan_at: int = -1, scope: str = "auto"
) -> dict:
    """Every rank passes the same tracker; rank 0 owns the single run. ``scope``: the step guard's."""
    from hdet_track.controller import DriftController
    from hdet_track.tracking.mlflow import MLflowTracker

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    track = MLflowTracker(tracking_uri=uri, experiment="gloo", run_name=name) if backend == "mlflow" else "wandb"
    sched = HDETScheduler(
        opt,
        max_lr=0.1,
        total_steps=24,
        spread=0.3,
        sync_every=6,
        auto_lr=True,
        auto_lr_warmup=6,
        controller=DriftController(warmup=6, step_guard_scope=scope),
        explore={"weight_decay": 0.5},
        model=model,
        track=track,
        compare_group="gloo-4",
    )
    seen = []
    for step in range(24):
        x, y = batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append((step + 1, opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"], float(loss)))
        if rank == 1 and step == nan_at:
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan")
        sched.step(loss)
    sched.flush()
    return {"seen": seen, "run_ids": sched.run_ids}


def tracked_resume(
    rank: int, world: int, ckpt_dir: str, uri: str, phase: str, track: bool, kill_after: int = 0, backend="mlflow"
) -> dict:
    """Train 40 steps (sync every 6) with or without MLflow tracking; phase "full" runs them all,
    "first" checkpoints at step 17 (mid-window), runs on to ``kill_after`` and dies (SIGKILL, after
    flushing what reached the tracker), "second" resumes from the checkpoint."""
    from hdet_track.tracking.mlflow import MLflowTracker
    from hdet_track.tracking.wandb import WandbTracker

    if not track:
        tracker = False
    elif backend == "wandb":
        tracker = WandbTracker(project="resume", dir=uri, mode="offline")
    else:
        tracker = MLflowTracker(tracking_uri=uri, experiment="resume")
    model, opt, sched = _build_resumable(rank, track=tracker)
    lrs: list = []
    path = os.path.join(ckpt_dir, f"ckpt{rank}.pt")
    if phase == "second":
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        sched.load_state_dict(ckpt["sched"])
        torch.set_rng_state(ckpt["rng"])
        lrs = list(ckpt["lrs"])
        _train_resumable(rank, model, opt, sched, 17, 40, lrs)
    elif phase == "first":
        _train_resumable(rank, model, opt, sched, 0, 17, lrs)
        state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
        torch.save(dict(state, rng=torch.get_rng_state(), lrs=list(lrs)), path)
        _train_resumable(rank, model, opt, sched, 17, kill_after, lrs)
        sched.flush()
        torch.distributed.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        _train_resumable(rank, model, opt, sched, 0, 40, lrs)
    sched.flush()
    return {"lrs": lrs, "params": flat_params(model), "run_ids": sched.run_ids}


def _blowup_run(
    rank: int,
    victim: int,
    uri: str,
    experiment: str,
    step_guard: float | None,
    ddp: bool,
    on_step,
    scope: str = "all",
    poison: str = "scale",
):
    """30 steps, sync every 10, the drift controller (``step_guard``), tracked in MLflow; replica
    ``victim``'s weights are scaled 50x after step 7 (finite, but its loss explodes), or with
    ``poison="nan"`` made NaN (its loss is NaN).
    ``on_step(step, sched, model, opt)`` after every step. Returns the scheduler and the model."""
    from hdet_track.controller import DriftController
    from hdet_track.tracking.mlflow import MLflowTracker

    model = make_model()
    net = DDP(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = HDETScheduler(
        opt, max_lr=0.05, total_steps=30, spread=0.3, sync_every=10, auto_lr=True, model=model,
        controller=DriftController(step_guard=step_guard, step_guard_scope=scope),
        track=MLflowTracker(tracking_uri=uri, experiment=experiment),
    )  # fmt: skip
    for step in range(30):
        loss = sgd_step(net, opt, rank, step)
        if rank == victim and step == 6:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(50.0) if poison == "scale" else p.fill_(math.nan)
        sched.step(loss)
        on_step(step, sched, model, opt)
    sched.flush()
    return sched, model


def finite_blowup(rank: int, world: int, uri: str, victim: int) -> dict:
    """The drift controller's sync guard (the step guard off, so that the sync's rule is what is
    tested) must leave the blown-up replica out at the sync at 10 and reset it; training goes on."""
    out: dict = {}

    def at_sync(step, sched, model, opt) -> None:
        if step == 9:
            out["record"] = sched.last_sync
            out["params_at_sync"] = flat_params(model)
            out["state_sizes"] = [len(opt.state.get(p, {})) for p in model.parameters()]

    sched, model = _blowup_run(rank, victim, uri, "blowup", None, False, at_sync)
    return out | {"final_params": flat_params(model), "run_ids": sched.run_ids}


def step_guard_blowup(rank: int, world: int, uri: str, victim: int, scope: str = "all") -> dict:
    """DDP (shared gradients): the blown-up replica's gradient reaches every replica at step 8. With
    ``step_guard`` the scheduler must converge at step 8 (not wait for the sync at 10), restore the
    consensus kept at the start and go on."""
    out: dict = {"records": [], "start": flat_params(make_model())}

    def each_step(step, sched, model, opt) -> None:
        rec = sched.last_sync
        if rec is not None and (not out["records"] or out["records"][-1].step != rec.step):
            out["records"].append(rec)
            if rec.step == 8:
                out["params_after_guard"] = flat_params(model)
                out["state_sizes"] = [len(opt.state.get(p, {})) for p in model.parameters()]

    sched, model = _blowup_run(rank, victim, uri, "step-guard", 10.0, True, each_step, scope=scope)
    out["scope"] = sched.controller.step_guard_scope
    out["final_params"] = flat_params(model)
    out["drift"] = sched.controller.drift["lr"][0]
    out["run_ids"] = sched.run_ids
    return out


def local_step_guard_blowup(
    rank: int, world: int, uri: str, victim: int, scope: str = "local", poison: str = "scale"
) -> dict:
    """Independent replicas, ``step_guard_scope="local"``: the blown-up replica resets itself at step 8
    (no collective, no early sync) and is left out at the sync at 10."""
    out: dict = {"start": flat_params(make_model()), "records": []}

    def each_step(step, sched, model, opt) -> None:
        if step == 7:
            out["after_8"] = flat_params(model)
            out["state_sizes"] = [len(opt.state.get(p, {})) for p in model.parameters()]
            out["sync_at_8"] = sched.last_sync
        if step == 9:
            out["record"] = sched.last_sync

    sched, model = _blowup_run(rank, victim, uri, "local-guard", 10.0, False, each_step, scope=scope, poison=poison)
    return out | {
        "final_params": flat_params(model),
        "run_ids": sched.run_ids,
        "scope": sched.controller.step_guard_scope,
    }


def _auto_scope_run(model: nn.Module, total_steps: int, sync_every: int):
    """SGD and an HDET scheduler whose drift controller decides its step guard's scope ("auto")."""
    from hdet_track.controller import DriftController

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = HDETScheduler(
        opt, max_lr=0.05, total_steps=total_steps, spread=0.3, sync_every=sync_every, auto_lr=True, model=model,
        controller=DriftController(step_guard_scope="auto"),
    )  # fmt: skip
    return opt, sched


def nan_gradient_at_first_step(rank: int, world: int, ddp: bool) -> dict:
    """Rank 1's loss is NaN at step 2 (the first step "auto" may decide at), so its gradients are;
    under DDP every rank's averaged gradient is then NaN. ``step_guard_scope="auto"`` must not read
    NaN fingerprints as "different gradients" (NaN != NaN): it decides at the first step with
    finite gradients (after the rollback: the new window's second step)."""
    model = make_model()
    net = DDP(model) if ddp else model
    opt, sched = _auto_scope_run(model, total_steps=20, sync_every=10)
    records = []
    for step in range(20):
        x, y = batch(rank, step)
        loss = F.cross_entropy(net(x), y) * (math.nan if rank == 1 and step == 1 else 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        if sched.last_sync is not None and (not records or records[-1].step != sched.last_sync.step):
            records.append(sched.last_sync)
    return {
        "scope": sched.controller.step_guard_scope,
        "record_scopes": [r.step_guard for r in records],
        "steps": [r.step for r in records],
        "rolled_back": [r.rolled_back for r in records],
        "final_finite": bool(torch.isfinite(flat_params(model)).all()),
    }


class HalfWrapped(nn.Module):
    """A DDP-wrapped body and a head outside the wrapper: the head's gradients are per rank."""

    def __init__(self) -> None:
        super().__init__()
        body = make_model()
        torch.manual_seed(1)
        self.head = nn.Linear(3, 3)
        self.body = DDP(body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def auto_scope(rank: int, world: int, setup: str) -> dict:
    """What ``step_guard_scope="auto"`` decides: ``"same-batches"``: independent replicas fed the
    same batch at every step (they agree at a window's first step, not after a spread step);
    ``"half-wrapped"``: DDP around part of the model (the rest holds per-rank gradients)."""
    model = HalfWrapped() if setup == "half-wrapped" else make_model()
    opt, sched = _auto_scope_run(model, total_steps=8, sync_every=4)
    scopes, shared = [], []
    for step in range(8):
        x, y = batch(0 if setup == "same-batches" else rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
        scopes.append(sched.controller.step_guard_scope)
        shared.append(sched.controller.shared_gradients)
    return {"scopes": scopes, "shared": shared}


def left_out_every_sync(rank: int, world: int, uri: str) -> dict:
    """2,000 steps, a sync every 2, far past the metric histories' budget; rank 3 reports a NaN loss
    at every step, so the paper controller leaves it out at every one of the 1,000 syncs."""
    from hdet_track.tracking.mlflow import MLflowTracker

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = HDETScheduler(
        opt, max_lr=0.05, total_steps=2000, spread=0.3, sync_every=2, auto_lr=True, controller="paper",
        model=model, track=MLflowTracker(tracking_uri=uri, experiment="left-out"),
    )  # fmt: skip
    for k in range(1, 2001):
        sched.step(math.nan if rank == 3 else 1.0 / k)
    sched.flush(timeout=120)
    return {"run_ids": sched.run_ids}


def nonfinite_after_a_carried_sync(rank: int, world: int) -> dict:
    """The sync at 4 waits for the next sync's gather for its divergences; every loss from step 5 on
    is NaN, so that next sync (8) raises: the callbacks must still get 4 (complete) before 8."""
    from hdet_track import NonFiniteReplicasError

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    listener = DivergenceListener()
    sched = HDETScheduler(
        opt, max_lr=0.1, total_steps=12, spread=0.2, sync_every=4, model=model, callbacks=[listener]
    )  # fmt: skip
    sched._converger.carry_below_seconds = math.inf
    for step in range(12):
        loss = sgd_step(model, opt, rank, step)
        if step >= 4:  # diverged: the parameters too
            with torch.no_grad():
                next(model.parameters()).fill_(math.nan)
        try:
            sched.step(math.nan if step >= 4 else loss)
        except NonFiniteReplicasError as exc:
            return {"syncs": listener.syncs, "error_step": exc.step}
    return {"syncs": listener.syncs, "error_step": None}


def sync_now_after_a_carried_sync(rank: int, world: int) -> dict:
    """A checkpoint right after a sync whose divergences wait for the next sync's gather:
    ``sync_now()`` (what integrations call first) gathers them, so ``state_dict()`` hands the record
    over complete."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    listener = DivergenceListener()
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=8, spread=0.2, sync_every=4, model=model, callbacks=[listener])
    sched._converger.carry_below_seconds = math.inf
    for step in range(4):
        sched.step(sgd_step(model, opt, rank, step))
    held = list(listener.syncs)
    assert sched.sync_now() is None
    sched.state_dict()
    return {"held": held, "syncs": [(s, d, t) for (s, d), t in zip(listener.syncs, listener.times)]}


def gather_pending_and_reload(rank: int, world: int) -> dict:
    """Syncs every 4 of 12 steps, every window short (divergences carried to the next sync).
    ``gather_pending()`` at step 5, before a pause, hands the callbacks sync 4's record complete;
    ``load_state_dict`` at step 8 (back to step 6's state) hands over sync 8's waiting record as
    it is, so the replayed sync 8 does not fill that record with its own divergences."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    listener = DivergenceListener()
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=12, spread=0.2, sync_every=4, model=model, callbacks=[listener])
    sched._converger.carry_below_seconds = math.inf
    out: dict = {}
    step, saved = 0, None
    while step < 12:
        sched.step(sgd_step(model, opt, rank, step))
        step += 1
        if step == 5:
            out["before_gather"] = list(listener.syncs)
            sched.gather_pending()
            out["after_gather"] = list(listener.syncs)
            out["last_sync"] = (sched.last_sync.step, list(sched.last_sync.divergences))
        if step == 6 and saved is None:
            saved = (sched.state_dict(), copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        if step == 8 and "reloaded" not in out:
            out["at_8"] = list(listener.syncs)
            sched.load_state_dict(saved[0])
            model.load_state_dict(saved[1])
            opt.load_state_dict(saved[2])
            out["reloaded"] = list(listener.syncs)
            step = 6
    out["syncs"] = listener.syncs
    return out


def abort_at_exit(rank: int, world: int, when: str) -> int:
    """Rank 1 aborts (SIGABRT): at interpreter exit, after a clean teardown (``"exit"``, what
    torch 2.13's gloo now and then does by itself), or in the middle of the job (``"job"``)."""
    import atexit

    if rank == 1 and when == "exit":
        atexit.register(os.abort)
    if rank == 1 and when == "job":
        os.abort()
    return rank


def sharded_replicas_refused(rank: int, world: int) -> dict:
    """FSDP2 (``fully_shard``) leaves each rank a shard: the scheduler refuses it when built, on every
    rank, with or without ``model=``; plain replicas of the same model are accepted."""
    from torch.distributed.fsdp import fully_shard

    errors = {}
    for given in ("optimizer", "model"):
        model = make_model()
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            HDETScheduler(opt, 0.1, total_steps=10, spread=0.3, sync_every=2, model=model if given == "model" else None)
        except ValueError as exc:
            errors[given] = str(exc)
    plain = make_model()
    HDETScheduler(torch.optim.SGD(plain.parameters(), lr=0.1), 0.1, total_steps=10, spread=0.3, model=plain)
    return errors


def closed_between_syncs(rank: int, world: int, uri: str, sync_first: bool) -> dict:
    """A tracked 2-rank job stopped early at step 8 (syncs every 5) and closed: what rank 0 warns,
    with and without ``sync_now()`` on every rank first."""
    import logging

    from hdet_track.tracking.mlflow import MLflowTracker

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("hdet_track").addHandler(Keep())
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    track = MLflowTracker(tracking_uri=uri, experiment=f"early-{sync_first}")
    sched = HDETScheduler(opt, 0.1, total_steps=20, spread=0.3, sync_every=5, model=model, track=track)
    for step in range(8):
        sgd_step(model, opt, rank, step)
        sched.step(float(step + 1))
    if sync_first:
        sched.sync_now()
    sched.close()
    return {"warnings": [m for m in records if "closed between two syncs" in m], "run_ids": sched.run_ids}


def resume_from_rank0_after_sync_now(rank: int, world: int, independent: bool, ckpt: str) -> dict:
    """SGD with momentum and weight decay, 4 ranks: a checkpoint written by rank 0 alone after
    ``sync_now()`` (what the Lightning and Hugging Face integrations do), resumed on every rank,
    against the run that went on. Each rank's momentum differs (``weight_decay * p`` and, with
    independent replicas, its own gradients): rank 0's stood in for every rank's."""
    import torch.distributed as dist

    def build():
        model = make_model()
        net = model if independent else DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
        sched = HDETScheduler(opt, max_lr=0.1, total_steps=16, spread=0.5, sync_every=4, model=model)
        return model, net, opt, sched

    model, net, opt, sched = build()
    for step in range(1, 17):
        sched.step(sgd_step(net, opt, rank, step))
        if step == 6:
            sched.sync_now()
            momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, ckpt)
            dist.barrier()
    went_on = [p.detach().clone() for p in model.parameters()]
    model, net, opt, sched = build()
    state = torch.load(ckpt, weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    for step in range(7, 17):
        sched.step(sgd_step(net, opt, rank, step))
    return {
        "momentum": [m.tolist() for m in momentum],
        "same": all(torch.equal(a, b) for a, b in zip(went_on, model.parameters())),
        "max_diff": max(float((a - b).abs().max()) for a, b in zip(went_on, model.parameters())),
    }


def sync_now_with_a_replica_without_optimizer_state(rank: int, world: int) -> dict:
    """Rank 1's optimizer state was cleared (as the guard does to a replica it resets): the layouts
    differ, so ``sync_now()`` averages nothing of it, on every rank alike (no rank waits in a
    collective the others skip), and says so once."""
    import warnings

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=12, spread=0.5, sync_every=4, model=model)
    for step in range(1, 7):
        sched.step(sgd_step(model, opt, rank, step))
    if rank == 1:
        opt.state.clear()
    before = [v["momentum_buffer"].clone() for v in opt.state.values()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.sync_now()
        sched.sync_now()
    after = [v["momentum_buffer"] for v in opt.state.values()]
    return {
        "kept": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)),
        "warnings": [str(w.message) for w in caught if "optimizer's state" in str(w.message)],
    }


def seed_per_rank(rank: int, world: int, spread: float = 0.3) -> dict:
    """``seed=rank`` (a per-rank seed): the replicas would draw clashing multipliers."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=20, spread=spread, sync_every=4, model=model, seed=rank)
    for step in range(20):
        loss = sgd_step(model, opt, rank, step)
        try:
            sched.step(loss)
        except ValueError as exc:
            return {"error_step": step + 1, "message": str(exc)}
    return {"error_step": None}


def explored_after_the_end(rank: int, world: int) -> dict:
    """Dropout and weight decay explored to the last step, then a second scheduler on the same
    model and optimizer (a later phase): what every rank holds after the first, what the second reads."""
    model = make_model(dropout=0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    hps = [explore.dropout(model, spread=0.5), explore.param_group("weight_decay", spread=0.5)]
    kw = dict(max_lr=0.1, spread=0.3, sync_every=4, model=model, seed=1)
    sched = HDETScheduler(opt, total_steps=10, explore=hps, **kw)
    during = []
    for step in range(10):
        sched.step(sgd_step(model, opt, rank, step))
        during.append((model[2].p, opt.param_groups[0]["weight_decay"]))
    after = (model[2].p, opt.param_groups[0]["weight_decay"])
    hps2 = [explore.dropout(model, spread=0.5), explore.param_group("weight_decay", spread=0.5)]
    second = HDETScheduler(opt, total_steps=10, explore=hps2, **kw)
    return {
        "during": during,
        "after": after,
        "bases": (sched.base_values("dropout"), sched.base_values("weight_decay")),
        "second": (second.base_values("dropout"), second.base_values("weight_decay")),
    }


class _Buffered(nn.Module):
    """A model with the buffers an audit found the averager could not handle."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(DIM, 3)
        self.big = nn.Parameter(torch.tensor([40000.0, 1.0], dtype=torch.float16))  # float16's max is 65504
        self.register_buffer("mask", torch.tensor([True, rank == 0]))  # a bool mask: never averaged
        self.register_buffer("u8", torch.tensor([200, 7], dtype=torch.uint8))
        self.register_buffer("i8", torch.tensor([100, -100], dtype=torch.int8))
        self.register_buffer("i16", torch.tensor([20000 + 2 * rank], dtype=torch.int16))
        self.register_buffer("causal", torch.full((3, 3), float("-inf")).triu(1))  # an additive attention mask
        self.register_buffer("expanded", torch.full((1,), float(rank)).expand(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + (self.big.float().sum() * 0.0)


def unusual_buffers(rank: int, world: int) -> dict:
    """Bool, small-integer, float16 and -inf tensors through syncs, the guard and sync_now()."""
    model = _Buffered(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=8, spread=0.3, sync_every=4, auto_lr=True, model=model)
    records = []
    for step in range(8):
        sched.step(sgd_step(model, opt, rank, step))
        if sched.last_sync is not None and sched.last_sync.step == step + 1:
            records.append((sched.last_sync.left_out, [g.kind for g in sched.last_sync.guard]))
    return {
        "records": records,
        "big": model.big.detach().clone(),
        "buffers": {k: v.clone() for k, v in model.named_buffers()},
    }


def sparse_momentum_sync_now(rank: int, world: int) -> dict:
    """nn.Embedding(sparse=True) with SGD momentum: a sparse momentum buffer at sync_now()."""
    import warnings

    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=10, spread=0.3, sync_every=5, model=emb)
    for step in range(3):
        loss = emb(torch.tensor([rank, step])).pow(2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.sync_now()
    return {"warned": [str(w.message) for w in caught if "could not average" in str(w.message)]}


def adam_step_after_a_reset(rank: int, world: int) -> dict:
    """Rank 1 blows up and is reset (its Adam state cleared); two steps later sync_now(): Adam's
    step count must be one across ranks, as the moments are."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = HDETScheduler(opt, max_lr=0.01, total_steps=20, spread=0.3, sync_every=4, model=model)
    for step in range(6):
        loss = sgd_step(model, opt, rank, step)
        if rank == 1 and step == 3:
            with torch.no_grad():
                model[0].weight[0, 0] = math.nan  # left out and reset at the sync of step 4
        sched.step(loss)
    sched.sync_now()
    state = opt.state[model[0].weight]
    return {"step": float(state["step"]), "exp_avg": state["exp_avg"].clone()}


def rollback_to_weights_loaded_after_build(rank: int, world: int) -> dict:
    """Pretrained weights loaded into the model after the scheduler was built; every replica blows
    up before the first sync: the rollback restores the loaded weights, not the initial ones."""
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=20, spread=0.3, sync_every=10, auto_lr=True, model=model)
    pretrained = make_model(seed=5)
    model.load_state_dict(pretrained.state_dict())
    loaded = flat_params(model)
    sched.step(sgd_step(model, opt, rank, 0))
    loss = sgd_step(model, opt, rank, 1)
    sched.step(loss * 1e6)  # the step guard rolls every replica back at once
    return {"guard": [g.kind for g in sched.last_sync.guard], "restored": flat_params(model), "loaded": loaded}


def layout_changed_on_one_rank(rank: int, world: int) -> dict:
    """Rank 1 casts its head to float64 after the first sync: every rank raises at the next one."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, max_lr=0.1, total_steps=12, spread=0.3, sync_every=4, model=model)
    for step in range(12):
        if rank == 1 and step == 5:
            model[-1].double()
        x, y = batch(rank, step)
        loss = F.cross_entropy(model[-1](model[:-1](x).to(next(model[-1].parameters()).dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        try:
            sched.step(loss)
        except ValueError as exc:
            return {"error_step": step + 1, "message": str(exc)}
    return {"error_step": None}


def sequential_handover(rank: int, world: int, milestone: int, call_sync_now: bool, ckpt_dir: str) -> dict:
    """``SequentialLR([HDET(total_steps=10, spread, explored weight decay), ConstantLR], milestones=[milestone])``
    on independent replicas for 14 steps; with ``call_sync_now``, ``sync_now()`` right after the
    milestone step, as the README says. Returns, after each step, the LR and weight decay the next
    step trains with and the parameters; and whether runs resumed from a checkpoint saved after step
    k went the same way: each rank's own (the optimizer loaded first), and rank 0's, saved after
    step 10 (where HDET's phase ends on one consensus) and ``sync_now()`` (which averages the
    optimizer's state), on every rank (the scheduler loaded first), against the run that went on."""
    import io

    import torch.distributed as dist
    from torch.optim.lr_scheduler import ConstantLR, SequentialLR

    def build():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        hdet = HDETScheduler(
            opt, 0.1, total_steps=10, spread=0.3, sync_every=5, model=model, seed=1, explore={"weight_decay": 0.5}
        )
        then = ConstantLR(opt, factor=0.5, total_iters=100)
        return model, opt, hdet, SequentialLR(opt, [hdet, then], milestones=[milestone])

    def train(job, start, stop, log):
        model, opt, hdet, sched = job
        for step in range(start, stop):
            sgd_step(model, opt, rank, step)
            sched.step()
            if call_sync_now and sched.last_epoch == milestone:
                hdet.sync_now()
            log.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"], flat_params(model)))

    def saved_after(k):
        job, head = build(), []
        train(job, 0, k, head)
        model, opt, _, sched = job
        return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, head

    def resumed(saved, head, sched_first, reference):
        job = build()
        job[0].load_state_dict(saved["model"])
        loads = [(job[1], saved["opt"]), (job[3], saved["sched"])]
        for obj, part in loads[::-1] if sched_first else loads:
            obj.load_state_dict(part)
        went = list(head)
        train(job, len(head), 14, went)
        same = [a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(reference, went)]
        return same.index(False) + 1 if False in same else None  # the first step that went otherwise

    job, run = build(), []
    train(job, 0, 14, run)
    out = {
        "lrs": [e[0] for e in run],
        "wds": [e[1] for e in run],
        "params": [e[2] for e in run],
        "last_sync": job[2].last_sync.step,
        "base_wd": job[2].base_values("weight_decay"),
        "own": {},
    }
    for k in (4, 5, 9, 10, 11, 12):
        saved, head = saved_after(k)
        buf = io.BytesIO()
        torch.save(saved, buf)
        buf.seek(0)
        out["own"][k] = resumed(torch.load(buf, weights_only=True), head, False, run)
    job, went_on = build(), []
    train(job, 0, 10, went_on)
    job[2].sync_now()
    if rank == 0:
        model, opt, _, sched = job
        saved = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
        torch.save(saved, os.path.join(ckpt_dir, "rank0.pt"))
    dist.barrier()
    train(job, 10, 14, went_on)
    saved = torch.load(os.path.join(ckpt_dir, "rank0.pt"), weights_only=True)
    out["rank0"] = resumed(saved, went_on[:10], True, went_on)
    return out


def sequential_after_a_warmup(rank: int, world: int) -> dict:
    """``SequentialLR([LinearLR(5 steps), HDET(total_steps=10, spread, explored weight decay)],
    milestones=[5])`` on independent replicas for 15 steps: HDET as the later scheduler (SequentialLR
    starts it with ``_update_lr(0)`` at the milestone, not with its ``step()``). Returns, after each
    step, the LR and weight decay the next step trains with and the parameters; and, for a checkpoint
    of each rank's saved after step k (before, at and after the milestone, and after HDET's end),
    the first step at which the resumed run went otherwise (None: it went the same way)."""
    import io

    from torch.optim.lr_scheduler import LinearLR, SequentialLR

    def build():
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        warm = LinearLR(opt, start_factor=0.1, total_iters=5)
        hdet = HDETScheduler(
            opt, 0.1, total_steps=10, spread=0.3, sync_every=5, model=model, seed=1, explore={"weight_decay": 0.5}
        )
        return model, opt, SequentialLR(opt, [warm, hdet], milestones=[5])

    def train(job, start, stop, log):
        model, opt, sched = job
        for step in range(start, stop):
            sgd_step(model, opt, rank, step)
            sched.step()
            log.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"], flat_params(model)))

    job, run = build(), []
    train(job, 0, 15, run)
    out = {"lrs": [e[0] for e in run], "wds": [e[1] for e in run], "params": [e[2] for e in run], "own": {}}
    for k in (3, 5, 6, 10, 15):
        job, head = build(), []
        train(job, 0, k, head)
        buf = io.BytesIO()
        torch.save({"model": job[0].state_dict(), "opt": job[1].state_dict(), "sched": job[2].state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        again = build()
        again[0].load_state_dict(saved["model"])
        again[1].load_state_dict(saved["opt"])
        again[2].load_state_dict(saved["sched"])
        went = list(head)
        train(again, k, 15, went)
        same = [a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(run, went)]
        out["own"][k] = same.index(False) + 1 if False in same else None
    return out


def sync_now_with_a_scalar_parameter(rank: int, world: int) -> dict:
    """A 0-dim parameter (a learnable temperature) trained by Adam with opposite gradients on the
    ranks: its moments are 0-dim tensors, which ``sync_now()`` took for counts (the highest rank's)."""
    scale = torch.nn.Parameter(torch.tensor(1.0))
    vec = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([scale, vec], lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=100, sync_every=50)
    sign = 1.0 if rank == 0 else -1.0
    for step in range(1, 4):
        loss = sign * step * (scale + vec.sum())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step(float(loss))
    before = {k: float(v) for k, v in opt.state[scale].items()}
    sched.sync_now()
    return {"before": before, "after": {k: float(v) for k, v in opt.state[scale].items()}}


def a_parameter_outside_the_model(rank: int, world: int) -> dict:
    """``model=`` given, and the optimizer also trains a parameter the model does not hold (a loss
    temperature kept beside it): each rank moves it its own way, and rank 1's blows up."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    temp = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([*model.parameters(), temp], lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=4, sync_every=2, model=model)
    syncs = []
    for step in range(1, 5):
        with torch.no_grad():
            temp.add_(rank + 1.0)
            if step == 3 and rank == 1:
                temp.fill_(float("nan"))
        opt.step()
        sched.step(1.0)
        if step % 2 == 0:
            syncs.append({"temp": temp.item(), "left_out": list(sched.last_sync.left_out)})
    return {"syncs": syncs}

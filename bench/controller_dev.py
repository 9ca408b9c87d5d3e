"""How the drift controller's defaults were fixed: the development-split grid of docs/controller.md.

The rule (stated in docs/controller.md before these runs): Fashion-MNIST *development split*
(train on the first 50,000 training images, validate on the last 10,000; the test set is never
read), the study's budget (an MLP, 4 gloo replicas, 800 steps, sync every 25, spread 0.5, batch 64),
both gradient modes, seed 100. The bar is the best OneCycle over max_lr 0.02, 0.05, 0.1, 0.2, 0.5.
Each candidate (the design values and five one-knob alternatives) runs at max_lr 0.02, 0.1 and 0.5
in both modes; its score is the worst final validation loss / bar over those 6 runs (a divergence
counts as infinite). The lowest worst case wins; within 0.01 of the design values' worst case the
design values stay.

Round 2 (``--round 2``, the default; stated in docs/controller.md before its runs): the tested-LR
ceiling against the first revision, seeds 100-102, the study's divergence rule (the median over
replicas of the training loss above 10x its first value; a recovered blow-up counts); the score is
the number of divergences, then the worst ratio of seed means. ``--round 1`` re-derives round 1.

Runs are untracked (only final validation losses enter the rule) and appended to ``--out`` as JSON
lines, so an interrupted grid continues where it stopped.

Run: .venv/bin/python bench/controller_dev.py --round N --out docs/controller_dev_roundN.jsonl   (about 30 min per
     round on 2 cores; round 1's records are docs/controller_dev.jsonl, some rounds have a ``_digits`` file too)
     .venv/bin/python bench/controller_dev.py --dataset digits --steps 100 --replicas 2 \
         --modes independent --lrs 0.1 --candidates design --out /tmp/dev.jsonl   (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from hdet_track import HDETScheduler, NonFiniteReplicasError  # noqa: E402
from hdet_track.compare import diverged_at  # noqa: E402
from hdet_track.controller import DriftController, Evidence  # noqa: E402
from hdet_track.examples.tasks import ImageTask, load_task  # noqa: E402
from hdet_track.launch import launch_local  # noqa: E402

# The candidates of docs/controller.md. Round 1: the first revision's design values (no ceiling)
# and one-knob alternatives. Round 2: the tested-LR ceiling against the first revision.
# Rounds 9-14 pin the settings that became defaults after them (guard_floor, edge_backoff), so that
# rerunning them reproduces their records; earlier rounds ran on the defaults of their day.
ROUNDS: dict[int, dict[str, dict | None]] = {
    1: {
        "design": {"ceiling": False},
        "step-half": {
            "ceiling": False,
            "step": 0.5 * 0.5 * math.log((1 + 0.5) / (1 - 0.5)),
        },  # half of half the log range
        "dead-zone-1.0": {"ceiling": False, "dead_zone": 1.0},
        "dead-zone-2.5": {"ceiling": False, "dead_zone": 2.5},
        "forget-0.8": {"ceiling": False, "forget": 0.8},
        "two-sided": {"ceiling": False, "one_sided": False},
    },
    2: {
        "design": {"ceiling": False},
        "ceiling": {"ceiling": True},
        "step-guard": {"ceiling": False, "step_guard": 10.0},
        "step-guard-own-start": {
            "step_guard_scope": "all"
        },  # the default after round 3: the step guard judged from each replica's own start
    },
    # Round 4 (independent replicas only): the local step guard, against round 2's bar and its
    # step-guard-own-start runs (docs/controller.md, "What the step guard costs").
    4: {"step-guard-local": {"step_guard_scope": "local", "trip_backoff": "notch"}},
    # Round 5: a diagnostic, not a candidate (docs/controller.md, "A diagnostic before round 5"):
    # the fan-out with no controller (auto_lr=False), at max_lr 0.1 (--lrs 0.1 --no-onecycle).
    5: {"fanout-only": None},
    # Round 6: the local step guard with a rollback-sized cut, both modes, against round 2's bar and
    # its step-guard-own-start runs (docs/controller.md, "Round 6"; --no-onecycle).
    6: {
        "step-guard-local-spread": {"step_guard_scope": "local", "trip_backoff": "spread"},
        "step-guard-collective": {
            "step_guard_scope": "all"
        },  # the default, rerun: the current code no longer reproduces round 2's runs
    },
    # Round 7: the scope chosen from the gradients (DDP -> collective, else local) against the
    # collective guard, on new seeds (docs/controller.md, "Round 7").
    7: {
        "auto": {"step_guard_scope": "auto"},
        "collective": {"step_guard_scope": "all"},
    },
    # Round 8 (independent replicas only, --modes independent): a local trip's cut sized by one
    # notch plus the ramp-up ahead, against the spread cut (docs/controller.md, "Round 8").
    8: {
        "ramp": {"trip_backoff": "ramp"},
        "spread": {"trip_backoff": "spread"},
    },
    # Round 9 (both tasks, both modes): a blow-up must also exceed half the run's starting loss,
    # against today's defaults (docs/controller.md, "Round 9").
    9: {
        "floor": {"guard_floor": 0.5, "edge_backoff": "off"},
        "default": {"guard_floor": None, "edge_backoff": "off"},  # the defaults then, pinned
    },
    # Round 11 (both modes): the first window's evidence ignored, against today's defaults, at four
    # max_lr (docs/controller.md, "Round 11").
    11: {
        "skip-first": {"skip_windows": 1, "edge_backoff": "off"},
        "default": {"edge_backoff": "off"},  # the defaults then, pinned
    },
    # Round 12 (both modes): every blow-up's cut aims OneCycle's peak at half the LR that blew up,
    # alone and with round 11's skip_windows=1, against today's defaults (docs/controller.md, "Round 12").
    12: {
        "edge": {"edge_backoff": True},
        "edge-skip": {"edge_backoff": True, "skip_windows": 1},
        "default": {"edge_backoff": "off"},  # the defaults then, pinned
    },
    # Round 13 (both modes): does round 12's edge-skip replicate on new seeds? Against today's
    # defaults, read by direction, not by a margin (docs/controller.md, "Round 13").
    13: {
        "edge-skip": {"edge_backoff": True, "skip_windows": 1},
        "default": {"edge_backoff": "off"},  # the defaults then, pinned
    },
    # Round 14 (both modes): round 12's edge cut for the sync guard's backoffs and rollbacks only (a
    # local trip keeps round 8's cut), against today's defaults (docs/controller.md, "Round 14").
    14: {
        "edge-sync": {"edge_backoff": "sync"},
        "default": {"edge_backoff": "off"},  # the defaults then (edge-sync is the default since)
    },
    # Round 15 (both modes): the first window's evidence held until the second window confirms it,
    # against today's defaults with the backoff's evidence fix; "published" is the default adopted in
    # round 14 (the published study's), the sign error included (docs/controller.md, "Round 15").
    15: {
        "confirm-first": {"skip_windows": 1, "confirm_skipped": True},
        "default": {},
        "published": {},  # run with InvertedDrop
    },
    # Round 16 (both modes): the first window's move made at once and taken back unless the second
    # window's own evidence confirms it, against today's defaults (docs/controller.md, "Round 16").
    16: {
        "revert-first": {"skip_windows": 1, "revert_unconfirmed": True},
        "default": {},
    },
    # Round 17 (shared; a check with independent replicas): round 16's revert-first only where the
    # gradients are found shared, against today's defaults (docs/controller.md, "Round 17").
    17: {
        "revert-shared": {"skip_windows": 1, "revert_unconfirmed": "shared"},
        "default": {},
    },
    18: {
        "tail-probe": {"probe": "tail"},
        "default": {},
    },
}
# The arms that ran with the sign error in Evidence.drop_upward fixed in round 15: every arm before
# round 15 (so that rerunning them reproduces their records) and round 15's "published".
INVERTED_DROP = {(r, arm) for r, arms in ROUNDS.items() if r < 15 for arm in arms} | {(15, "published")}
SEEDS = {
    1: (100,),
    2: (100, 101, 102),
    4: (100, 101, 102),
    5: (100, 101, 102),
    6: (100, 101, 102),
    7: (103, 104, 105),
    8: (106, 107, 108),
    9: (106, 107, 108),
    11: (109, 110, 111),
    12: (112, 113, 114),
    13: (115, 116, 117),
    14: (118, 119, 120),
    15: (121, 122, 123),
    16: (124, 125, 126),
    17: (127, 128, 129),
    18: (130, 131, 132),
}
CANDIDATES: dict[str, dict | None] = {k: v for r in ROUNDS.values() for k, v in r.items()}
REFERENCE_LRS = (0.02, 0.05, 0.1, 0.2, 0.5)
CANDIDATE_LRS = (0.02, 0.1, 0.5)
# rounds that run the candidates at other max_lr
ROUND_LRS = {r: (0.02, 0.1, 0.2, 0.5) for r in (11, 12, 13, 14, 15, 16, 17, 18)}
MODES = ("shared", "independent")
LR_SENSITIVITY_TARGET = 1.03  # issue #11's bar, as in bench/quality.py


class InvertedDrop(Evidence):
    """Evidence as rounds 1-14 ran it: after a backoff the *upward* evidence (a negative sum) carried
    over and the downward one was dropped, the opposite of the intent (fixed in round 15)."""

    def drop_upward(self, name: str) -> None:
        self.sums[name][0] = min(self.sums[name][0], 0.0)


# The first-window defaults before round 17 adopted revert-shared: every earlier arm ran with them.
BEFORE_ROUND_17 = {"skip_windows": 0, "revert_unconfirmed": False}


class TailProbe:
    """Round 18's signal (docs/controller.md): this replica's per-example losses on one fixed probe
    batch of development-training images (the same on every rank), at the average of its iterates
    over the second half of the window since the last sync, gathered over the ranks."""

    def __init__(self, task, model: nn.Module, sync_every: int, size: int = 2048, seed: int = 7) -> None:
        order = torch.randperm(len(task.x_train), generator=torch.Generator().manual_seed(seed))[:size]
        self.inputs, self.targets = task.x_train[order], task.y_train[order]
        self.model, self.params = model, list(model.parameters())
        self.tail = [torch.zeros_like(p) for p in self.params]
        self.count, self.since, self.half = 0, 0, sync_every // 2

    @torch.no_grad()
    def after_step(self) -> None:
        """After the optimizer's step (before the scheduler's): add the iterate to the tail average."""
        self.since += 1
        if self.since > self.half:
            self.count += 1
            for t, p in zip(self.tail, self.params):
                t.add_(p - t, alpha=1.0 / self.count)

    def synced(self) -> None:
        """A sync happened (any kind): the next window's average starts afresh."""
        self.since, self.count = 0, 0
        for t in self.tail:
            t.zero_()

    @torch.no_grad()
    def losses(self, at: str = "tail") -> torch.Tensor:
        """Per-example probe losses at the tail average (``at="tail"``; NaN with fewer than 3 averaged
        steps) or at the current parameters (``"end"``), one row per rank (a collective)."""
        if at == "end":
            mine = F.cross_entropy(self.model(self.inputs), self.targets, reduction="none")
        elif self.count < 3:
            mine = torch.full((len(self.targets),), math.nan)
        else:
            kept = [p.detach().clone() for p in self.params]
            for p, t in zip(self.params, self.tail):
                p.copy_(t)
            mine = F.cross_entropy(self.model(self.inputs), self.targets, reduction="none")
            for p, k in zip(self.params, kept):
                p.copy_(k)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine.contiguous())
        return torch.stack(rows).double()


def probe_evidence(log_multipliers: list[float], rows: np.ndarray) -> float:
    """The probe's ``z``: per example, the slope of the loss against the centred log multipliers;
    their mean over its standard error (paired by example), clipped to [-10, 10]. NaN: no probe."""
    x = np.asarray(log_multipliers, dtype=float)
    rows = np.asarray(rows, dtype=float)
    if len(x) < 2 or not np.all(np.isfinite(rows)):
        return math.nan
    x = x - x.mean()
    if float(x @ x) <= 0:
        return 0.0
    slopes = x @ (rows - rows.mean(axis=0)) / float(x @ x)
    sd = float(np.std(slopes, ddof=1))
    mean = float(np.mean(slopes))
    if sd <= 0:
        return 0.0 if mean == 0 else math.copysign(10.0, mean)
    return max(-10.0, min(10.0, mean / (sd / math.sqrt(len(slopes)))))


class ProbeDrift(DriftController):
    """Round 18's candidate: the default controller whose LR evidence is the tail probe's ``z``
    (:func:`probe_evidence`) at the syncs where the training loop handed it one (``probe``: the
    step and the gathered rows), else the window's."""

    def __init__(self, **settings) -> None:
        super().__init__(**settings)
        self.probe: tuple[int, np.ndarray] | None = None
        self.probe_syncs = 0

    def window_evidence(self, name, x, ok, stats, se):  # noqa: ANN001, ANN201
        if name == "lr" and self.probe is not None and self.probe[0] == stats.step:
            z = probe_evidence([x[r] for r in ok], self.probe[1][ok])
            if math.isfinite(z):
                self.probe_syncs += 1
                return z
        return super().window_evidence(name, x, ok, stats, se)


def drift_controller(settings: dict, round_: int, arm: str) -> DriftController:
    settings = dict(settings)
    if settings.pop("probe", None) == "tail":
        return ProbeDrift(**settings)
    ctrl = DriftController(**(BEFORE_ROUND_17 | settings if round_ <= 17 else settings))
    if (round_, arm) in INVERTED_DROP:
        e = ctrl.evidence
        ctrl.evidence = InvertedDrop(
            e.forget, e.dead_zone, e.full_step_at, e.skip_windows, e.confirm_skipped, e.revert_unconfirmed
        )
    return ctrl


@dataclass(frozen=True)
class DevRun:
    dataset: str
    mode: str
    arm: str  # "onecycle" or a candidate name
    max_lr: float
    steps: int
    replicas: int
    sync_every: int = 25
    spread: float = 0.5
    batch: int = 64
    seed: int = 100
    round: int = 1

    def key(self) -> str:
        key = f"{self.dataset}/{self.mode}/{self.arm}/{self.max_lr:g}/{self.steps}/{self.replicas}/{self.seed}"
        return key if self.round == 1 else f"r{self.round}/{key}"


def dev_task(dataset: str, seed: int):
    """The development split: Fashion-MNIST's training images only (first 50k / last 10k)."""
    task = load_task(dataset, seed=seed)
    if dataset != "fashion-mnist":
        return task
    x, y = task.x_train, task.y_train  # the test images (task.x_val) are dropped here, never read
    return ImageTask("fashion-mnist-dev", x[:50_000], y[:50_000], x[50_000:], y[50_000:])


def train(run: DevRun) -> dict:
    rank = dist.get_rank()
    task = dev_task(run.dataset, run.seed)
    model = task.model(run.seed)
    net = nn.parallel.DistributedDataParallel(model) if run.mode == "shared" else model
    opt = task.optimizer(model.parameters(), run.max_lr)
    hdet = run.arm != "onecycle"
    settings = ROUNDS[run.round][run.arm] if hdet else None
    auto = settings is not None  # "fanout-only": the spread without a controller
    sched = HDETScheduler(
        opt,
        max_lr=run.max_lr,
        total_steps=run.steps,
        spread=run.spread if hdet else 0.0,
        sync_every=run.sync_every,
        auto_lr=auto,
        controller=drift_controller(settings, run.round, run.arm) if settings is not None else "drift",
        model=model,
        seed=run.seed,
    )
    batches = torch.Generator().manual_seed(run.seed * 1000 + rank)
    ctrl = sched.controller
    probe = TailProbe(task, model, run.sync_every) if isinstance(ctrl, ProbeDrift) else None
    stopped_at = None
    losses: list[float] = []
    try:
        for i in range(run.steps):
            inputs, targets = task.batch(batches, run.batch)
            loss = task.loss(net(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if probe is not None:
                probe.after_step()
                if (i + 1) % run.sync_every == 0 or i + 1 == run.steps:  # the scheduler syncs at this step
                    ctrl.probe = (i + 1, probe.losses().numpy())
                seen = getattr(sched.last_sync, "step", None)
            sched.step(loss)
            if probe is not None and getattr(sched.last_sync, "step", None) != seen:
                probe.synced()
            losses.append(float(loss.detach()))
    except NonFiniteReplicasError as exc:
        stopped_at = exc.step
    val_loss, val_acc = task.evaluate(model)
    # The study's rule (hdet_track.compare): the median over replicas of the training loss blew up.
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    length = min(len(x) for x in every)
    median = np.median(np.array([x[:length] for x in every], dtype=float), axis=0)
    blew_up_at = diverged_at(np.arange(1, length + 1), median)
    diverged = stopped_at if stopped_at is not None else blew_up_at
    if stopped_at is not None or not math.isfinite(val_loss):
        val_loss = math.inf
    out = {
        "val_loss": val_loss,
        "val_accuracy": val_acc,
        "diverged_at": diverged,
        "stopped_at": stopped_at,
        "final_drift": math.exp(ctrl.drift.get("lr", [0.0])[0]) if auto else 1.0,
        "guard_events": int(getattr(ctrl, "guard_events", 0)),
    }
    if probe is not None:
        out["probe_syncs"] = ctrl.probe_syncs
    return out


def _worker(run: DevRun) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = train(run)
        dist.barrier()
        return out
    finally:
        dist.destroy_process_group()


def select(results: dict[str, dict], dataset: str, steps: int, replicas: int, round_: int = 1, modes=MODES) -> dict:
    """The rule of docs/controller.md over finished runs: bar, each candidate's score, winner.

    Round 1 (one seed): the worst final val loss / bar over (mode, max_lr), a divergence (training
    stopped) infinite; the lowest wins, the design values within 0.01. Round 2 (three seeds, the
    study's divergence rule): the number of diverged runs, then the worst ratio of seed means.
    Round 8 (``modes``: independent only): "ramp" wins with no divergence, a worst ratio lower than
    "spread"'s by more than 0.005, and no max_lr where its ratio is higher by more than 0.005.
    """
    seeds = SEEDS[round_]
    candidates = ROUNDS[round_]
    lrs = ROUND_LRS.get(round_, CANDIDATE_LRS)

    def runs(mode: str, arm: str, lr: float) -> list[dict] | None:
        rs = [results.get(DevRun(dataset, mode, arm, lr, steps, replicas, seed=s, round=round_).key()) for s in seeds]
        return None if any(r is None for r in rs) else rs

    def mean_val(rs: list[dict]) -> float:
        if round_ > 1 and any(r["diverged_at"] is not None for r in rs):
            return math.inf
        return float(np.mean([r["val_loss"] for r in rs]))

    bar = {}
    for m in modes:
        means = [mean_val(rs) for lr in REFERENCE_LRS if (rs := runs(m, "onecycle", lr)) is not None]
        bar[m] = min(means) if len(means) == len(REFERENCE_LRS) else None
    score = {}
    for name in candidates:
        ratios, finite_ratios, diverged, by_mode = [], [], 0, {m: 0 for m in modes}
        for m in modes:
            for lr in lrs:
                rs = runs(m, name, lr)
                if rs is None or bar[m] is None:
                    break
                lost = sum(r["diverged_at"] is not None for r in rs) if round_ > 1 else 0
                diverged += lost
                by_mode[m] += lost
                ratios.append(mean_val(rs) / bar[m])
                kept = [r["val_loss"] for r in rs if r["diverged_at"] is None or round_ == 1]
                finite_ratios.append(float(np.mean(kept)) / bar[m] if kept else math.inf)
        if len(ratios) == len(modes) * len(lrs):
            finite = [x for x in ratios if math.isfinite(x)]
            worst_finite = max(finite) if finite else math.inf
            score[name] = {
                "diverged": diverged,
                "worst_ratio": max(ratios),
                "worst_finite_ratio": worst_finite,
                "ratios": [round(x, 4) for x in ratios],  # per (mode, max_lr), in the round's max_lr order
                "finite_ratios": [round(x, 4) for x in finite_ratios],  # over the seeds that did not diverge
                "diverged_by_mode": by_mode,
            }
    winner = None  # round 6's rule compares modes separately (docs/controller.md): read from the scores
    if len(score) == len(candidates) and "design" in candidates:
        key = (
            (lambda n: (score[n]["diverged"], score[n]["worst_finite_ratio"]))
            if round_ > 1
            else (lambda n: (0, score[n]["worst_ratio"]))
        )
        best = min(score, key=key)
        d_best, w_best = key(best)
        d_design, w_design = key("design")
        winner = "design" if (d_best == d_design and w_design - w_best <= 0.01) else best
    if round_ == 8 and {"ramp", "spread"} <= set(score):
        ramp, spread = score["ramp"], score["spread"]
        better = ramp["diverged"] == 0 and ramp["worst_ratio"] < spread["worst_ratio"] - 0.005
        nowhere_worse = all(a <= b + 0.005 for a, b in zip(ramp["ratios"], spread["ratios"]))
        winner = "ramp" if better and nowhere_worse else "spread"
    if round_ == 11 and {"skip-first", "default"} <= set(score):
        winner = (
            "skip-first" if all(better_than_default(score, "skip-first", m, modes, lrs) for m in modes) else "default"
        )
    if round_ == 12 and {"edge", "edge-skip", "default"} <= set(score):
        winner = round12_winner(score, modes, lrs)
    if round_ == 13 and {"edge-skip", "default"} <= set(score):
        winner = "edge-skip" if all(replicates(score, "edge-skip", m, modes, lrs) for m in modes) else "default"
    if round_ == 14 and {"edge-sync", "default"} <= set(score):
        winner = "edge-sync" if repairs(score, "edge-sync", modes, lrs) else "default"
    if round_ == 15 and {"confirm-first", "default"} <= set(score):
        winner = "confirm-first" if all(replicates(score, "confirm-first", m, modes, lrs) for m in modes) else "default"
    if round_ == 16 and {"revert-first", "default"} <= set(score):
        winner = "revert-first" if all(holds_up(score, "revert-first", m, modes, lrs) for m in modes) else "default"
    if round_ == 17 and {"revert-shared", "default"} <= set(score) and "shared" in modes:
        winner = "revert-shared" if holds_up(score, "revert-shared", "shared", modes, lrs) else "default"
    if round_ == 18 and {"tail-probe", "default"} <= set(score):
        winner = "tail-probe" if all(holds_up(score, "tail-probe", m, modes, lrs) for m in modes) else "default"
    return {"round": round_, "bar": bar, "score": score, "winner": winner}


def round12_winner(score: dict, modes, lrs) -> str:
    """Round 12's reading: a candidate qualifies if it is better than "default" in each mode; of
    two, the lower worst ratio over both modes wins, "edge" within 0.005; none: "default"."""
    ok = [n for n in ("edge", "edge-skip") if all(better_than_default(score, n, m, modes, lrs) for m in modes)]
    if len(ok) == 2:
        edge, both = score["edge"]["worst_ratio"], score["edge-skip"]["worst_ratio"]
        return "edge-skip" if both < edge - 0.005 else "edge"
    return ok[0] if ok else "default"


def mode_ratios(score: dict, name: str, mode: str, modes, lrs) -> list[float]:
    """``name``'s ratios for one mode, in the round's max_lr order."""
    i = list(modes).index(mode) * len(lrs)
    return score[name]["ratios"][i : i + len(lrs)]


def better_than_default(score: dict, name: str, mode: str, modes, lrs) -> bool:
    """Rounds 11-12's reading for one mode: ``name`` has no divergence and its worst ratio over the
    max_lr is lower than "default"'s by more than 0.005."""
    mine, base = (mode_ratios(score, n, mode, modes, lrs) for n in (name, "default"))
    return all(math.isfinite(x) for x in mine) and max(mine) < max(base) - 0.005


def replicates(score: dict, name: str, mode: str, modes, lrs) -> bool:
    """Round 13's reading for one mode: ``name`` has no divergence, its worst ratio over the max_lr
    is not higher than "default"'s and its mean ratio is lower (a direction, not a margin)."""
    mine, base = (mode_ratios(score, n, mode, modes, lrs) for n in (name, "default"))
    return all(math.isfinite(x) for x in mine) and max(mine) <= max(base) and np.mean(mine) < np.mean(base)


def holds_up(score: dict, name: str, mode: str, modes, lrs) -> bool:
    """Round 16's reading for one mode: ``name`` has no more diverged runs than "default", and over
    the seeds that did not diverge its worst ratio over the max_lr is not higher than "default"'s
    and its mean ratio is lower (round 13's direction, with a divergence counted, not an infinity)."""
    i = list(modes).index(mode) * len(lrs)
    mine, base = (score[n]["finite_ratios"][i : i + len(lrs)] for n in (name, "default"))
    fewer = score[name]["diverged_by_mode"][mode] <= score["default"]["diverged_by_mode"][mode]
    return fewer and max(mine) <= max(base) and float(np.mean(mine)) < float(np.mean(base))


def repairs(score: dict, name: str, modes, lrs) -> bool:
    """Round 14's reading: ``name`` has no divergence, is nowhere higher than "default" by more than
    0.005, has a worst ratio not higher than "default"'s in any mode and lower in at least one."""
    if score[name]["diverged"] or any(a > b + 0.005 for a, b in zip(score[name]["ratios"], score["default"]["ratios"])):
        return False
    worst = [[max(mode_ratios(score, n, m, modes, lrs)) for n in (name, "default")] for m in modes]
    return all(a <= b for a, b in worst) and any(a < b for a, b in worst)


def load_records(out: Path) -> dict[str, dict]:
    """The runs already in a JSON-lines ``--out`` file, by key (none when it does not exist)."""
    if not out.exists():
        return {}
    return {(rec := json.loads(line))["key"]: rec for line in out.read_text().splitlines()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--round", type=int, default=2, choices=sorted(ROUNDS))
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--lrs", type=float, nargs="+", default=None, help="default: the rule's max_lr values per arm")
    p.add_argument("--candidates", nargs="+", default=None, choices=list(CANDIDATES), help="default: the round's")
    p.add_argument("--no-onecycle", action="store_true")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the round's")
    p.add_argument("--out", required=True, help="JSON-lines file; runs already in it are not repeated")
    args = p.parse_args()

    out = Path(args.out)
    done = load_records(out)
    seeds = args.seeds or SEEDS[args.round]
    candidates = args.candidates or list(ROUNDS[args.round])
    plan = []
    for seed in seeds:
        for mode in args.modes:
            arms = [] if args.no_onecycle else [("onecycle", lr) for lr in args.lrs or REFERENCE_LRS]
            arms += [(name, lr) for name in candidates for lr in args.lrs or ROUND_LRS.get(args.round, CANDIDATE_LRS)]
            plan += [
                DevRun(args.dataset, mode, arm, lr, args.steps, args.replicas, seed=seed, round=args.round)
                for arm, lr in arms
            ]
    for run in plan:
        if run.key() in done:
            continue
        started = time.monotonic()
        res = launch_local(_worker, run.replicas, run)[0]
        rec = {"key": run.key(), **asdict(run), **res, "wall_s": round(time.monotonic() - started, 1)}
        done[rec["key"]] = rec
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        state = f"diverged at {res['diverged_at']}, " if res["diverged_at"] is not None else ""
        print(
            f"{run.key():<52} {state}val_loss {res['val_loss']:.4f} drift x{res['final_drift']:.3g} ({rec['wall_s']} s)",
            flush=True,
        )
    outcome = select(done, args.dataset, args.steps, args.replicas, args.round, args.modes)
    # the rule's outcome, for the record (not a result line: those follow); JSON has no Infinity
    print(json.dumps({"selection": _json_safe(outcome)}))
    # one result line per candidate: #11's bar (the worst ratio of seed means to the best OneCycle
    # over the round's modes and max_lr, a diverged seed counting as infinite; no divergence)
    for name, score in outcome.get("score", {}).items():
        worst = score["worst_ratio"]
        line = {
            "bench": f"controller_dev.r{args.round}.{name}.worst_ratio",
            "value": round(worst, 4) if math.isfinite(worst) else None,
            "unit": "x best OneCycle (seed means)",
            "target": LR_SENSITIVITY_TARGET,
            "pass": bool(score["diverged"] == 0 and worst <= LR_SENSITIVITY_TARGET),
        }
        print(json.dumps(line))
    if not outcome.get("score"):  # the rule scores the round's whole grid: a narrowed one has no result
        line = {
            "bench": f"controller_dev.r{args.round}.worst_ratio",
            "value": None,
            "unit": "x best OneCycle (seed means)",
            "target": LR_SENSITIVITY_TARGET,
            "pass": False,
            "note": "no candidate has every run of the round's grid (--seeds/--lrs/--candidates/--modes narrowed it)",
        }
        print(json.dumps(line))
    return 0


def _json_safe(value):  # noqa: ANN001, ANN202
    """``value`` with every non-finite float as None (JSON has no Infinity or NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


if __name__ == "__main__":
    raise SystemExit(main())

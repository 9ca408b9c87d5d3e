"""Published results (issue #11): is HDET insensitive to max_lr? Fashion-MNIST, 3 seeds, both gradient
modes, every arm at every max_lr of a OneCycle sweep, next to two one-run methods and a text task.

For each gradient mode (``shared``: DDP gradients every step, the paper's algorithm;
``independent``: local-SGD replicas that meet only at syncs), with N real gloo replicas per run
started by torch's elastic launcher and every run logged to one MLflow store:

* ``onecycle``: plain OneCycle (spread 0, no auto-LR) at every max_lr of ``--sweep``;
* ``hdet-drift``: HDET with the default controller and default settings: the user gives only
  max_lr, total_steps, spread, sync_every and ``auto_lr=True`` (no warm-up, no other knob);
* ``hdet-paper``: the paper's controller with the settings the earlier study used for it
  (``auto_lr_warmup`` = steps // 4), reported as it comes out;
* ``hdet-no-auto-lr`` (optional): spread only;
* ``schedulefree`` and ``prodigy``: one-run methods at the same budget with their documented
  defaults (Schedule-Free: ``SGDScheduleFree`` with the task's momentum and weight decay, or
  ``AdamWScheduleFree`` for text, at the package's default lr unless ``--sf-lr``/``--text-sf-lr``;
  Prodigy: lr 1.0 with ``CosineAnnealingLR`` over the budget), as plain data-parallel jobs (DDP
  gradients, the same replicas, data order and batch). They have no replicas to diverge from each
  other, so they run once, in the shared mode, and the independent mode's report compares against
  those same runs.

The bar is the best OneCycle of the sweep (lowest mean final validation loss over seeds, a
diverged seed counting as infinite). Every number in the report and in the JSON lines is read back
from the store through ``hdet_track.readers`` and ``hdet_track.compare``.

Resumable: every run carries a ``quality.key`` tag (dataset, mode, seed, arm, max_lr, steps,
replicas); a run already in the store as FINISHED, or FAILED because it diverged, is not run
again. Use a persistent ``--store`` to continue an interrupted study, ``--arms/--modes/--seeds/
--sweep/--tasks`` for a subset and ``--report-only`` to rebuild the report from the store.

Run: .venv/bin/python bench/quality.py --store sqlite:////var/tmp/hdet-quality/quality.db
     .venv/bin/python bench/quality.py --dataset digits --seeds 0 --steps 60 --replicas 2 \\
         --modes shared --sweep 0.05 0.5 --tasks image --out /tmp/q        (a smoke run)
"""

from __future__ import annotations

import argparse
import datetime as dt
import inspect
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from hdet_track.compare import ComparisonRow, comparison_rows  # noqa: E402
from hdet_track.examples.ablation import AblationConfig, RunSpec, launch_run  # noqa: E402
from hdet_track.readers.base import HDETRun  # noqa: E402

EXPERIMENT = "hdet-quality"
ARMS = ("onecycle", "hdet-drift", "hdet-paper", "hdet-no-auto-lr", "schedulefree", "prodigy")
DEFAULT_ARMS = ("onecycle", "hdet-drift", "hdet-paper", "schedulefree", "prodigy")
HDET_ARMS = ("hdet-drift", "hdet-paper", "hdet-no-auto-lr")
ONE_RUN = ("schedulefree", "prodigy")
TEXT_SWEEP = [float(f"{x:.3g}") for x in np.geomspace(5e-4, 2e-2, 5)]
TARGET_RATIO = 1.03


@dataclass
class Result:
    mode: str
    seed: int
    arm: str  # one of ARMS
    max_lr: float
    wall_s: float
    row: ComparisonRow
    run: HDETRun | None
    task: str = "image"  # "image" (--dataset) or "text"


@dataclass(frozen=True)
class Planned:
    task: str  # "image" or "text"
    dataset: str
    mode: str
    seed: int
    arm: str
    max_lr: float
    steps: int
    replicas: int

    @property
    def key(self) -> str:
        return (
            f"{self.dataset}|{self.mode}|seed{self.seed}|{self.arm}|lr{self.max_lr:g}"
            f"|steps{self.steps}|replicas{self.replicas}"
        )


# ---------------------------------------------------------------------- pure rules and summaries
def aggressive_lr(sweep: list[Result], lrs: list[float]) -> float:
    """The smallest swept max_lr at which OneCycle diverged on at least one seed, else the largest."""
    diverged = sorted({r.max_lr for r in sweep if r.row.diverged})
    return diverged[0] if diverged else max(lrs)


def _stats(values: list[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else 0.0)


def _cell(values: list[float], digits: int = 3) -> str:
    if not values:
        return "not run"
    mean, sd = _stats(values)
    if not math.isfinite(mean):
        return "-"
    missing = sum(1 for v in values if not math.isfinite(v))
    text = f"{mean:.{digits}g}" if len(values) == 1 else f"{mean:.{digits}g} ± {sd:.2g}"
    return text + (f" ({missing} n/a)" if missing else "")


def _val_for_ranking(r: Result) -> float:
    """Final validation loss; a diverged run ranks last."""
    v = r.row.final_val_loss
    return math.inf if r.row.diverged or not math.isfinite(v) else v


def mean_val(rs: list[Result]) -> float:
    """Mean final validation loss over seeds; a diverged seed makes it infinite (never dropped)."""
    return statistics.fmean(_val_for_ranking(r) for r in rs) if rs else math.nan


def best_onecycle(sweep: list[Result]) -> float:
    """The swept max_lr with the lowest mean final validation loss over seeds (diverged = worst)."""
    by_lr: dict[float, list[Result]] = {}
    for r in sweep:
        by_lr.setdefault(r.max_lr, []).append(r)
    return min(by_lr, key=lambda lr: (mean_val(by_lr[lr]), lr))


def lr_sensitivity(results: list[Result], arm: str = "hdet-drift") -> tuple[float, float | None, float]:
    """(max over max_lr of arm's mean final val loss / best OneCycle's, the max_lr where it is worst,
    the best OneCycle's mean). ``inf`` when the arm diverged on a seed at some max_lr."""
    sweep = [r for r in results if r.arm == "onecycle"]
    mine = [r for r in results if r.arm == arm]
    if not sweep or not mine:
        return math.nan, None, math.nan
    bar = mean_val([r for r in sweep if r.max_lr == best_onecycle(sweep)])
    worst, at = -math.inf, None
    for lr in sorted({r.max_lr for r in mine}):
        value = mean_val([r for r in mine if r.max_lr == lr])
        ratio = value / bar if math.isfinite(bar) and bar > 0 else math.inf
        if ratio > worst:
            worst, at = ratio, lr
    return worst, at, bar


def ratio_se(mine: list[Result], bar_runs: list[Result]) -> float:
    """One standard error of ``mean(mine) / mean(bar_runs)`` over seeds, paired by seed (a seed fixes the
    initial weights and the data order of every arm): the ratio estimator's ``sd(h_s - ratio * b_s) /
    (sqrt(n) * mean(b))``. nan with fewer than two paired seeds or a non-finite value."""
    bars = {r.seed: _val_for_ranking(r) for r in bar_runs}
    pairs = [(_val_for_ranking(r), bars[r.seed]) for r in mine if r.seed in bars]
    if len(pairs) < 2 or len(pairs) != len(mine) or not all(math.isfinite(h) and math.isfinite(b) for h, b in pairs):
        return math.nan
    h_mean = statistics.fmean(h for h, _ in pairs)
    b_mean = statistics.fmean(b for _, b in pairs)
    if b_mean <= 0:
        return math.nan
    ratio = h_mean / b_mean
    return statistics.stdev(h - ratio * b for h, b in pairs) / (math.sqrt(len(pairs)) * b_mean)


def sensitivity_se(results: list[Result], lr: float | None, arm: str = "hdet-drift") -> float:
    """``ratio_se`` of ``arm`` at ``lr`` against the best OneCycle of ``results`` (one mode and task)."""
    sweep = [r for r in results if r.arm == "onecycle"]
    if lr is None or not sweep:
        return math.nan
    best = best_onecycle(sweep)
    return ratio_se([r for r in results if r.arm == arm and r.max_lr == lr], [r for r in sweep if r.max_lr == best])


def final_drift(r: Result) -> float:
    """The LR controller's last drift (base / reference) as logged, 1.0 when it never decided."""
    if r.run is None:
        return math.nan
    series = r.run.controller_series("lr")
    drift = series["drift"][np.isfinite(series["drift"])]
    return float(drift[-1]) if len(drift) else 1.0


def controller_notes(hdet: list[Result], high: float) -> list[str]:
    """What the auto-LR controller did before each HDET seed diverged, read from its logged decisions.

    A divergence before the controller's warm-up ended means HDET with and without auto-LR were
    the same runs up to there: the report says so instead of crediting or blaming the controller.
    """
    diverged = [r for r in hdet if r.row.diverged and r.run is not None and r.run.start is not None]
    if not diverged:
        return []
    acted = [sum(1 for d in r.run.controller if d.name == "lr" and d.step < r.row.diverged_at_step) for r in diverged]
    cfg = diverged[0].run.start.config
    warmup, spread = cfg.get("auto_lr_warmup"), cfg.get("spread", 0.0)
    top = f"with spread {spread:g} the highest-LR replica trained at up to {(1 + spread) * high:g} at the peak"
    if not any(acted):
        return [
            f"- HDET-paper's auto-LR controller never acted before a divergence: its diverged seeds broke by "
            f"step{'s' if len(diverged) > 1 else ''} {', '.join(str(r.row.diverged_at_step) for r in diverged)}, "
            f"and its warm-up lasts {warmup} steps; up to there HDET with and without auto-LR are the same "
            f"algorithm. At max_lr {high:g}, {top}."
        ]
    return [
        f"- HDET-paper's controller decisions before each diverged seed broke: {', '.join(map(str, acted))} "
        f"(warm-up {warmup} steps); {top}."
    ]


def recovery_notes(drift: list[Result], bar: float) -> list[str]:
    """HDET-drift seeds counted as diverged (the rule above: the median training loss blew up at some
    step) that the guard caught: what it did, read from the logged guard events, and where they ended.
    The divergence still counts; this only says what happened after it."""
    lines = []
    for lr in sorted({r.max_lr for r in drift if r.row.diverged}):
        rs = [r for r in drift if r.max_lr == lr and r.row.diverged]
        acts = []
        for r in rs:
            after = [g for g in (r.run.guard if r.run else []) if g.step >= r.row.diverged_at_step]
            acts.append(f"{after[0].action} at step {after[0].step}" if after else "no guard action")
        finals = [r.row.final_val_loss for r in rs]
        ended = _cell(finals)
        recovered = all(math.isfinite(v) for v in finals) and math.isfinite(bar) and bar > 0
        ratio = f", {statistics.fmean(finals) / bar:.3g}x the best OneCycle" if recovered else ""
        lines.append(
            f"- HDET-drift at max_lr {lr:g}: {len(rs)} seed{'s' if len(rs) > 1 else ''} blew up (steps "
            f"{', '.join(str(r.row.diverged_at_step) for r in rs)}; counted as diverged above), the guard answered "
            f"({'; '.join(acts)}) and training went on to a final val loss of {ended}{ratio}."
        )
    return lines


def describe_task(task) -> str:
    """The model and optimizer as the task builds them, so the report cannot drift from tasks.py."""
    import torch

    model = task.model(0)
    opt = task.optimizer(model.parameters(), 0.1)
    d = opt.defaults
    extras = [f"momentum {d['momentum']:g}"] if d.get("momentum") else []
    extras += ["Nesterov"] if d.get("nesterov") else []
    extras += [f"betas {tuple(d['betas'])}"] if "betas" in d else []
    extras += [f"weight decay {d['weight_decay']:g}"] if d.get("weight_decay") else []
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if getattr(task, "kind", "image") == "text":
        params = sum(p.numel() for p in model.parameters())
        what = f"a causal character transformer ({params:,} parameters)"
    else:
        widths = "-".join(str(w) for w in [linear[0].in_features, *(m.out_features for m in linear)])
        what = f"an MLP {widths}"
    return f"{what}, {type(opt).__name__} ({', '.join(extras)})"


def _fmt(x: float | None) -> str:
    return f"{x:.4g}" if x is not None and math.isfinite(x) else "n/a"


def _json_number(x: float) -> float | None:
    return x if math.isfinite(x) else None


def schedulefree_default_lr(text: bool) -> float:
    """The lr the schedulefree package documents as its constructor default."""
    import schedulefree

    cls = schedulefree.AdamWScheduleFree if text else schedulefree.SGDScheduleFree
    return float(inspect.signature(cls).parameters["lr"].default)


# ---------------------------------------------------------------------- plan, store, run
def plan(args) -> list[Planned]:
    items = []
    if "image" in args.tasks:
        for mode in args.modes:
            for seed in args.seeds:
                for arm in args.arms:
                    if arm in ONE_RUN:
                        continue
                    for lr in args.sweep:
                        items.append(Planned("image", args.dataset, mode, seed, arm, lr, args.steps, args.replicas))
        for seed in args.seeds:  # one-run methods: plain DDP, once (see the module docstring)
            for arm in (a for a in args.arms if a in ONE_RUN):
                lr = 1.0 if arm == "prodigy" else args.sf_lr
                items.append(Planned("image", args.dataset, "shared", seed, arm, lr, args.steps, args.replicas))
    if "text" in args.tasks:
        for mode in args.text_modes:
            for seed in args.text_seeds:
                for arm in args.text_arms:
                    lrs = [1.0 if arm == "prodigy" else args.text_sf_lr] if arm in ONE_RUN else args.text_sweep
                    for lr in lrs:
                        if arm in ONE_RUN and mode != "shared":
                            continue
                        items.append(Planned("text", "text", mode, seed, arm, lr, args.text_steps, args.replicas))
    return items


def spec_for(p: Planned, spread: float) -> RunSpec:
    tags = (
        ("quality.key", p.key),
        ("quality.task", p.task),
        ("quality.mode", p.mode),
        ("quality.seed", str(p.seed)),
        ("quality.arm", p.arm),
        ("quality.max_lr", f"{p.max_lr:g}"),
    )
    name = p.arm if p.arm == "prodigy" else f"{p.arm}-lr{p.max_lr:g}"
    if p.arm == "onecycle":
        return RunSpec(name, p.max_lr, 0.0, False, tags=tags)
    if p.arm == "hdet-drift":  # the defaults: no warm-up, the default controller
        return RunSpec(name, p.max_lr, spread, True, controller="drift", auto_lr_warmup=0, tags=tags)
    if p.arm == "hdet-paper":
        return RunSpec(name, p.max_lr, spread, True, controller="paper", auto_lr_warmup=p.steps // 4, tags=tags)
    if p.arm == "hdet-no-auto-lr":
        return RunSpec(name, p.max_lr, spread, False, auto_lr_warmup=0, tags=tags)
    return RunSpec(name, p.max_lr, 0.0, False, optimizer=p.arm, tags=tags)


def stored_runs(client) -> dict[str, object]:
    """quality.key -> the newest completed run in the store: FINISHED, or FAILED because it diverged
    (a run that crashed or was killed is run again)."""
    exp = client.get_experiment_by_name(EXPERIMENT)
    if exp is None:
        return {}
    found, token = {}, None
    while True:
        page = client.search_runs(
            [exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1000, page_token=token
        )
        for r in page:
            key, status = r.data.tags.get("quality.key"), r.info.status
            done = status == "FINISHED" or (
                status == "FAILED" and r.data.tags.get("hdet.error", "").startswith("diverged")
            )
            if key and done and key not in found:
                found[key] = r
        token = page.token
        if not token:
            return found


def run_planned(args, p: Planned) -> None:
    cfg = AblationConfig(
        dataset=p.dataset,
        data_dir=args.data_dir,
        text_file=args.text_file,
        replicas=p.replicas,
        steps=p.steps,
        sync_every=args.sync_every,
        spread=args.spread,
        grad_mode=p.mode,
        tracker="mlflow",
        seed=p.seed,
        compare_group=f"quality-{p.task}-{p.mode}-seed{p.seed}",
    )
    started = time.monotonic()
    result = launch_run(cfg, spec_for(p, args.spread))
    state = f"diverged at {result['diverged_at']}" if result["diverged_at"] else f"val loss {result['val_loss']:.4f}"
    print(f"  {p.task} {p.mode:>11} seed {p.seed} {p.arm:>15} lr {p.max_lr:g}: {state}, "
          f"{time.monotonic() - started:.0f}s", flush=True)  # fmt: skip


def read_results(reader, planned: list[Planned], stored: dict[str, object]) -> list[Result]:
    results = []
    for p in planned:
        info = stored.get(p.key)
        if info is None:
            continue
        run = reader.read(info.info.run_id)
        row = comparison_rows([run])[0]
        wall = ((info.info.end_time or info.info.start_time) - info.info.start_time) / 1000
        results.append(Result(p.mode, p.seed, p.arm, p.max_lr, wall, row, run, p.task))
    return results


# ---------------------------------------------------------------------- report
def _div_cell(rs: list[Result]) -> str:
    if not rs:
        return "not run"
    div = [r for r in rs if r.row.diverged]
    return f"{len(div)}/{len(rs)}" + (f" (steps {', '.join(str(r.row.diverged_at_step) for r in div)})" if div else "")


def _pick(results: list[Result], **kw) -> list[Result]:
    return [r for r in results if all(getattr(r, k) == v for k, v in kw.items())]


def sensitivity_section(results: list[Result], mode: str, task: str, arms: list[str]) -> list[str]:
    mine = _pick(results, mode=mode, task=task)
    sweep = _pick(mine, arm="onecycle")
    swept = [a for a in arms if a == "onecycle" or a in HDET_ARMS]
    lrs = sorted({r.max_lr for r in mine if r.arm in swept})
    if not lrs:
        return [f"No runs of the {task} task in the {mode} mode in the store.", ""]
    best = best_onecycle(sweep) if sweep else None
    bar = mean_val(_pick(sweep, max_lr=best)) if sweep else math.nan
    head = " | ".join(f"{a} final val loss" for a in swept)
    lines = [
        f"| max_lr | {head} | HDET-drift / best OneCycle | diverged ({', '.join(swept)}) |",
        "|---" * (len(swept) + 3) + "|",
    ]
    for lr in lrs:
        cells = [_cell([r.row.final_val_loss for r in _pick(mine, arm=a, max_lr=lr)]) for a in swept]
        drift = _pick(mine, arm="hdet-drift", max_lr=lr)
        ratio = mean_val(drift) / bar if drift and math.isfinite(bar) and bar > 0 else math.nan
        se = sensitivity_se(mine, lr)
        shown = (_fmt(ratio) + (f" ± {se:.2g}" if math.isfinite(se) else "")) if drift else "not run"
        mark = " (best OneCycle)" if lr == best else ""
        lines.append(
            f"| {lr:g}{mark} | {' | '.join(cells)} | {shown} "
            f"| {' · '.join(_div_cell(_pick(mine, arm=a, max_lr=lr)) for a in swept)} |"
        )
    worst, at, _ = lr_sensitivity(mine)
    lines += [""]
    if best is not None:
        lines.append(
            f"- Best OneCycle: max_lr {best:g}, mean final val loss {_fmt(bar)}. HDET-drift's worst ratio over "
            f"the sweep: **{_fmt(worst)}**"
            + (f" at max_lr {at:g}" if at is not None else "")
            + f" (target {TARGET_RATIO:g}; a diverged seed makes it infinite)."
            + _se_note(worst, sensitivity_se(mine, at))
        )
        lines += recovery_notes(_pick(mine, arm="hdet-drift"), bar)
        high = aggressive_lr(sweep, lrs)
        lines += controller_notes(_pick(mine, arm="hdet-paper", max_lr=high), high)
    return lines + [""]


def _se_note(worst: float, se: float) -> str:
    """How far the worst ratio is from the target, in standard errors over seeds."""
    if not (math.isfinite(worst) and math.isfinite(se) and se > 0):
        return ""
    gap = (worst - TARGET_RATIO) / se
    side = "above" if gap > 0 else "below"
    return (
        f" One standard error over seeds (paired by seed) is {se:.2g} there: the worst ratio is {abs(gap):.2g} "
        f"standard errors {side} the target."
    )


def drift_section(results: list[Result], mode: str, task: str) -> list[str]:
    mine = [r for r in _pick(results, mode=mode, task=task) if r.arm in ("hdet-drift", "hdet-paper")]
    if not mine:
        return []
    lines = [
        "| max_lr | HDET-drift final LR drift | HDET-drift drift range | HDET-paper drift range |",
        "|---|---|---|---|",
    ]
    for lr in sorted({r.max_lr for r in mine}):
        drift = _pick(mine, arm="hdet-drift", max_lr=lr)
        lines.append(
            f"| {lr:g} | {_cell([final_drift(r) for r in drift])} | {drift_ranges(drift)} "
            f"| {drift_ranges(_pick(mine, arm='hdet-paper', max_lr=lr))} |"
        )
    return lines + [
        "",
        "- Drift = the controller's base LR / its reference (plain OneCycle's LR at that step). Final: the last "
        "logged controller decision of each run (1 when it never moved), mean ± sd over seeds; range: lowest-highest "
        "over each seed's decisions. Right direction: above 1 where max_lr is too small, below 1 where it is too "
        "large. The paper's controller decays its base geometrically and is clipped to OneCycle's final LR at the "
        "end, so its final drift says nothing; its range does.",
        "",
    ]


def drift_ranges(rs: list[Result]) -> str:
    """Lowest-highest logged LR drift of each run, comma separated ("not run" when there are none)."""
    ranges = []
    for r in rs:
        d = r.run.controller_series("lr")["drift"] if r.run else np.zeros(0)
        d = d[np.isfinite(d)]
        ranges.append(f"{d.min():.3g}-{d.max():.3g}" if len(d) else "no decision")
    return ", ".join(ranges) or "not run"


def one_run_section(results: list[Result], task: str) -> list[str]:
    rs = [r for r in results if r.task == task and r.arm in ONE_RUN]
    if not rs:
        return []
    lines = [
        "| method | lr | final val loss | val accuracy | diverged | s/run |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ONE_RUN:
        mine = _pick(rs, arm=arm)
        if mine:
            label = "Schedule-Free" if arm == "schedulefree" else "Prodigy (+ cosine)"
            lines.append(
                f"| {label} | {mine[0].max_lr:g} | {_cell([r.row.final_val_loss for r in mine])} "
                f"| {_cell([r.row.val_accuracy for r in mine])} | {_div_cell(mine)} "
                f"| {statistics.fmean(r.wall_s for r in mine):.0f} |"
            )
    return lines + [
        "",
        "- Plain data-parallel jobs (DDP gradients, the same replicas, data order and batch), run once in the "
        "shared mode: with no replicas of their own to diverge, the independent mode has nothing to add. "
        "Schedule-Free is evaluated at its averaged point (`optimizer.eval()`).",
        "",
    ]


def vs_one_run(results: list[Result], mode: str) -> dict:
    """HDET-drift at its worst max_lr (mode ``mode``) against Schedule-Free and Prodigy (image task)."""
    mine = _pick(results, mode=mode, task="image")
    worst, at, bar = lr_sensitivity(mine)
    hdet = mean_val(_pick(mine, arm="hdet-drift", max_lr=at)) if at is not None else math.nan
    others = {arm: mean_val(_pick(results, task="image", arm=arm)) for arm in ONE_RUN}
    finite = [v for v in others.values() if math.isfinite(v)]
    best = min(finite) if finite else math.nan
    value = hdet / best if math.isfinite(hdet) and math.isfinite(best) and best > 0 else math.inf
    # The sweep's own best in this mode against the same methods: what any schedule of this mode is up against.
    sweep_best = bar / best if math.isfinite(bar) and math.isfinite(best) and best > 0 else math.nan
    return {"hdet_worst_lr": at, "hdet": hdet, **others, "value": value, "onecycle_best": bar, "sweep_best": sweep_best}


def json_lines(
    results: list[Result],
    modes: list[str],
    tasks: list[str],
    text_modes: list[str],
    planned: list[Planned] | None = None,
) -> list[dict]:
    """The result lines. ``quality.divergences`` passes only with every planned HDET-drift run read
    (``planned``; without it, at least one): 0 of none, or of a study cut short, is no evidence."""
    out = []
    for mode in modes if "image" in tasks else []:
        mine = _pick(results, mode=mode, task="image")
        worst, at, _ = lr_sensitivity(mine)
        drift = _pick(mine, arm="hdet-drift")
        div = sum(r.row.diverged for r in drift)
        expected = (
            len({p.key for p in planned if p.task == "image" and p.mode == mode and p.arm == "hdet-drift"})
            if planned is not None
            else max(len(drift), 1)
        )
        missing = max(expected - len(drift), 0)
        vs = vs_one_run(results, mode)
        out += [
            {"bench": "quality.lr_sensitivity", "mode": mode, "value": _json_number(worst), "unit": "ratio",
             "target": TARGET_RATIO, "pass": math.isfinite(worst) and worst <= TARGET_RATIO,
             "se": _json_number(sensitivity_se(mine, at))},
            {"bench": "quality.divergences", "mode": mode, "value": div, "unit": "runs", "target": 0,
             "pass": div == 0 and missing == 0 and len(drift) > 0, "runs": len(drift), "missing": missing},
            {"bench": "quality.vs_one_run_methods", "mode": mode, "value": _json_number(vs["value"]),
             "unit": "ratio", "target": 1.0, "pass": math.isfinite(vs["value"]) and vs["value"] <= 1.0},
        ]  # fmt: skip
    for mode in text_modes if "text" in tasks else []:
        mine = _pick(results, mode=mode, task="text")
        worst, at, _ = lr_sensitivity(mine)
        out.append(
            {"bench": "quality.text.lr_sensitivity", "mode": mode, "value": _json_number(worst), "unit": "ratio",
             "target": TARGET_RATIO, "pass": math.isfinite(worst) and worst <= TARGET_RATIO,
             "se": _json_number(sensitivity_se(mine, at))}
        )  # fmt: skip
    return out


def plot(results: list[Result], path: Path) -> None:
    """Final validation loss against max_lr per arm (mean over seeds; diverged seeds drawn at the top)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = sorted({(r.task, r.mode) for r in results if r.arm not in ONE_RUN})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (task, mode) in zip(axes[0], panels):
        mine = _pick(results, task=task, mode=mode)
        finite = [r.row.final_val_loss for r in mine if not r.row.diverged and math.isfinite(r.row.final_val_loss)]
        top = 1.5 * max(finite) if finite else 1.0
        for arm in (a for a in ARMS if a not in ONE_RUN):
            lrs = sorted({r.max_lr for r in _pick(mine, arm=arm)})
            if not lrs:
                continue
            ys = [min(mean_val(_pick(mine, arm=arm, max_lr=lr)), top) for lr in lrs]
            ax.plot(lrs, ys, marker="o", label=arm)
        for arm in ONE_RUN:
            v = mean_val(_pick(results, task=task, arm=arm))
            if math.isfinite(v):
                ax.axhline(v, linestyle=":", color="grey" if arm == "prodigy" else "black", label=arm)
        ax.set_xscale("log")
        sweep = sorted({r.max_lr for r in mine if r.arm not in ONE_RUN})
        ax.set_xticks(sweep, [f"{x:g}" for x in sweep])  # the sweep's values, not a crowd of minor ticks
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("max_lr")
        ax.set_ylabel(f"final val loss (diverged: drawn at {top:.3g})")
        ax.set_title(f"{task}, {mode} gradients", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_command(argv: list[str]) -> str:
    """The command that runs the study this report shows: ``argv`` without ``--report-only`` and
    ``--out`` (where this copy of the report was written)."""
    kept, skip = [], False
    for a in argv:
        if skip or a == "--report-only" or a.startswith("--out="):
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        kept.append(a)
    return " ".join(["python", "bench/quality.py", *kept])


def write_report(args, results: list[Result], planned: list[Planned], wall: float | None, out: Path) -> Path:
    import torch

    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    missing = len({p.key for p in planned}) - len(results)
    lines = [
        f"# Results: is HDET insensitive to max_lr? ({args.dataset}, issue #11)",
        "",
        f"Generated by `bench/quality.py` on {now}; every number below is read back from the MLflow store the "
        "runs were logged to. The command at the bottom runs the study (runs already in its store are skipped; "
        "add `--report-only` to rebuild this page from the store alone).",
        "",
    ]
    if "image" in args.tasks:
        task = AblationConfig(dataset=args.dataset, data_dir=args.data_dir).task()
        lines.append(
            f"- Image task: {args.dataset}, {describe_task(task)}, batch 64 per replica; {len(task.x_train):,} "
            f"training and {len(task.x_val):,} held-out validation images; max_lr {', '.join(f'{x:g}' for x in args.sweep)}; "
            f"seeds {', '.join(map(str, args.seeds))}; {args.steps} steps."
        )  # fmt: skip
    if "text" in args.tasks:
        text = AblationConfig(dataset="text", text_file=args.text_file).task()
        lines.append(
            f"- Text task: character-level language modelling on {text.source}, {describe_task(text)}, "
            f"16 windows of {text.context} characters per replica and step; max_lr "
            f"{', '.join(f'{x:g}' for x in args.text_sweep)}; seeds {', '.join(map(str, args.text_seeds))}; "
            f"{args.text_steps} steps."
        )
    lines += [
        f"- {args.replicas} gloo replicas per run (torch's elastic launcher, loopback), sync every "
        f"{args.sync_every} steps, HDET spread {args.spread:g}. HDET-drift: `HDETScheduler(max_lr, total_steps, "
        f'spread, sync_every, auto_lr=True)` and nothing else. HDET-paper: `controller="paper"`, '
        f"`auto_lr_warmup=steps // 4`. Schedule-Free lr {args.sf_lr:g} (image) / {args.text_sf_lr:g} (text), "
        "Prodigy lr 1.0 with CosineAnnealingLR over the budget.",
        f"- Machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}."
        + (f" Wall time of this invocation: {wall / 60:.1f} min." if wall is not None else ""),
        "- Mean ± standard deviation over seeds; `-` means no finite value; a diverged seed makes a mean "
        "infinite (n/a), never dropped. Diverged: the training loss (median over replicas) became non-finite or "
        "exceeded 10x its first value; a replica repaired at the next sync is HDET at work, not a divergence.",
        "- A ratio to the best OneCycle is shown ± one standard error over seeds, paired by seed (every arm of a "
        "seed starts from the same weights and sees the same data order); the best OneCycle is itself picked as "
        "the lowest of noisy means, and the worst ratio is the highest of several, so both lean against HDET.",
    ]
    if missing:
        lines.append(f"- **{missing} planned run(s) are not in the store yet**: re-run the command to continue.")
    lines += ["", "## Result lines", "", "```"]
    lines += [json.dumps(x) for x in json_lines(results, args.modes, args.tasks, args.text_modes, planned)]
    lines += ["```", ""]
    if "image" in args.tasks:
        lines += ["## LR sensitivity (image task)", ""]
        for mode in args.modes:
            lines += [f"### {mode} gradients", ""] + sensitivity_section(results, mode, "image", args.arms)
        lines += ["## One-run methods (image task)", ""] + one_run_section(results, "image")
        for mode in args.modes:
            vs = vs_one_run(results, mode)
            worst = _pick(results, mode=mode, task="image", arm="hdet-drift", max_lr=vs["hdet_worst_lr"])
            finals = [r.row.final_val_loss for r in worst]
            after = (
                f" (a seed blew up there; the final val loss after the guard's recovery is {_cell(finals)})"
                if not math.isfinite(vs["hdet"]) and finals and all(math.isfinite(v) for v in finals)
                else ""
            )
            lines.append(
                f"- {mode}: HDET-drift at its worst max_lr ({vs['hdet_worst_lr']}) ends at {_fmt(vs['hdet'])}{after}; "
                f"Schedule-Free {_fmt(vs['schedulefree'])}, Prodigy {_fmt(vs['prodigy'])}; ratio to the better "
                f"one {_fmt(vs['value'])}. The best OneCycle of the sweep in this mode ends at "
                f"{_fmt(vs['onecycle_best'])}, {_fmt(vs['sweep_best'])}x the better one-run method"
                + (": no max_lr of the sweep reaches it in this mode." if vs["sweep_best"] > 1 else ".")
            )
        lines += ["", "## Drift direction (image task)", ""]
        for mode in args.modes:
            lines += [f"### {mode} gradients", ""] + drift_section(results, mode, "image")
    if "text" in args.tasks:
        lines += ["## Text task", ""]
        for mode in args.text_modes:
            lines += [f"### {mode} gradients", ""] + sensitivity_section(results, mode, "text", args.text_arms)
            lines += drift_section(results, mode, "text")
        lines += one_run_section(results, "text")
    lines += ["![final validation loss against max_lr](lr_sensitivity.png)", "", "## Every run", ""]
    lines += ["| task | gradients | seed | arm | max_lr | final val loss | val accuracy | diverged at | s | run id |"]
    lines += ["|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.task} | {r.mode} | {r.seed} | {r.arm} | {r.max_lr:g} | {_fmt(r.row.final_val_loss)} "
            f"| {_fmt(r.row.val_accuracy)} | {r.row.diverged_at_step or '-'} | {r.wall_s:.0f} | `{r.row.run_id[:8]}` |"
        )
    lines += ["", f"Command: `{study_command(sys.argv[1:])}`", ""]
    path = out / "results.md"
    path.write_text("\n".join(lines))
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--tasks", nargs="+", default=["image", "text"], choices=["image", "text"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", "--grad-modes", nargs="+", default=["shared", "independent"],
                   choices=["shared", "independent"])  # fmt: skip
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=ARMS)
    p.add_argument("--sweep", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2, 0.5])
    p.add_argument("--sf-lr", type=float, default=None, help="Schedule-Free's lr (default: the package's default)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--sync-every", type=int, default=25)
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--text-file", default=None)
    p.add_argument("--text-sweep", type=float, nargs="+", default=TEXT_SWEEP)
    p.add_argument("--text-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--text-modes", nargs="+", default=["shared"], choices=["shared", "independent"])
    p.add_argument("--text-arms", nargs="+", default=["onecycle", "hdet-drift"], choices=ARMS)
    p.add_argument("--text-steps", type=int, default=None, help="default: --steps")
    p.add_argument("--text-sf-lr", type=float, default=None)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    p.add_argument("--store", default=None, help="MLflow tracking URI (default: a temporary sqlite file)")
    p.add_argument("--report-only", action="store_true", help="rebuild the report and JSON lines from --store")
    args = p.parse_args(argv)
    args.sweep = sorted(set(args.sweep))
    args.text_sweep = sorted(set(args.text_sweep))
    args.text_steps = args.text_steps or args.steps
    needs_sf = "schedulefree" in args.arms or "schedulefree" in args.text_arms
    if args.sf_lr is None:
        args.sf_lr = schedulefree_default_lr(text=False) if needs_sf else math.nan
    if args.text_sf_lr is None:
        args.text_sf_lr = schedulefree_default_lr(text=True) if needs_sf else math.nan
    if args.report_only and not args.store:
        p.error("--report-only needs --store")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = args.store or f"sqlite:///{Path(tempfile.mkdtemp(prefix='hdet-quality-')) / 'quality.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = store  # the launched replicas inherit it
    os.environ["MLFLOW_EXPERIMENT_NAME"] = EXPERIMENT
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient

    from hdet_track.readers import ReaderError
    from hdet_track.readers.mlflow import MLflowReader

    if not args.report_only:
        client = MlflowClient(store)  # the study writes there: a new store is created
        if store.startswith("sqlite:///") and client.get_experiment_by_name(EXPERIMENT) is None:
            # its artifacts beside the database, not in ./mlruns of the working directory (the repository)
            client.create_experiment(
                EXPERIMENT, artifact_location=str(Path(store[len("sqlite:///") :]).resolve().parent / "artifacts")
            )
    try:
        reader = MLflowReader(store)  # read-only: with --report-only a missing store is an error
    except ReaderError as exc:
        print(f"bench/quality.py: {exc}", file=sys.stderr)
        return 2
    planned = plan(args)
    print(f"bench/quality.py: {len(planned)} planned runs, store {store} (experiment {EXPERIMENT})", flush=True)
    started = time.monotonic()
    if not args.report_only:
        stored = stored_runs(reader.client)
        for i, p in enumerate(planned, 1):
            if p.key in stored:
                print(f"  [{i}/{len(planned)}] skip {p.key}: {stored[p.key].info.status} in the store", flush=True)
                continue
            print(f"  [{i}/{len(planned)}] run {p.key}", flush=True)
            try:
                run_planned(args, p)
            except Exception as exc:  # one broken run must not end a study of hours; it is retried next time
                print(f"  {p.key} failed to run: {type(exc).__name__}: {exc}", flush=True)
    wall = None if args.report_only else time.monotonic() - started
    results = read_results(reader, planned, stored_runs(reader.client))
    plot(results, out / "lr_sensitivity.png")
    report = write_report(args, results, planned, wall, out)
    print(f"wrote {report}; open the runs with: hdet-track dashboard {store}")
    for line in json_lines(results, args.modes, args.tasks, args.text_modes, planned):
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())

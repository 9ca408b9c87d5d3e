"""Published results: the paper's ablation on Fashion-MNIST, 3 seeds, both gradient modes, against a
OneCycle sweep over 5 max_lr values.

For each gradient mode (``shared``: DDP gradients every step, the paper's algorithm;
``independent``: local-SGD replicas that meet only at syncs), with N real gloo replicas per run
started by torch's elastic launcher and every run logged to MLflow:

1. OneCycle at every max_lr of ``--sweep`` (spread 0, no auto-LR), for every seed;
2. the aggressive max_lr is fixed by a rule stated before any HDET run: the smallest swept max_lr
   at which OneCycle diverged on at least one seed (the paper's setting), or the largest swept
   one if none diverged;
3. HDET without auto-LR and full HDET at that max_lr, for every seed.

baseline-low is OneCycle at ``--low-lr``; baseline-high is OneCycle at the aggressive max_lr; the
bar HDET is measured against is the best OneCycle of the sweep (lowest mean final validation
loss over seeds). Every number in ``docs/results.md`` is read back from the tracking store through
``hdet_track.readers`` (the same path as ``hdet-track compare``); nothing is typed in by hand.

Run: .venv/bin/python bench/quality.py            (about 20 minutes on 2 CPU cores)
     .venv/bin/python bench/quality.py --dataset digits --seeds 0 --steps 100 --replicas 2 \
         --grad-modes independent --sweep 0.05 0.5 --out /tmp/q      (a smoke run, under a minute)
"""

from __future__ import annotations

import argparse
import datetime as dt
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


@dataclass
class Result:
    mode: str
    seed: int
    arm: str  # "onecycle", "hdet-no-auto-lr" or "hdet"
    max_lr: float
    wall_s: float
    row: ComparisonRow
    run: HDETRun


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


def best_onecycle(sweep: list[Result]) -> float:
    """The swept max_lr with the lowest mean final validation loss over seeds (diverged = worst)."""
    by_lr: dict[float, list[float]] = {}
    for r in sweep:
        by_lr.setdefault(r.max_lr, []).append(_val_for_ranking(r))
    return min(by_lr, key=lambda lr: (statistics.fmean(by_lr[lr]), lr))


# ---------------------------------------------------------------------- running
def run_arm(cfg: AblationConfig, spec: RunSpec, mode: str, seed: int, arm: str, reader) -> Result:
    started = time.monotonic()
    result = launch_run(cfg, spec)
    wall = time.monotonic() - started
    run_id = next(iter(result["run_ids"].values()))
    run = reader.read(run_id)
    row = comparison_rows([run])[0]
    state = f"diverged at {row.diverged_at_step}" if row.diverged else f"val loss {row.final_val_loss:.4f}"
    print(f"  {mode:>11} seed {seed} {spec.name:>18}: {state}, {wall:.0f}s", flush=True)
    return Result(mode, seed, arm, spec.max_lr, wall, row, run)


def run_mode(args, mode: str, reader) -> tuple[list[Result], float]:
    base = {
        "dataset": args.dataset,
        "data_dir": args.data_dir,
        "replicas": args.replicas,
        "steps": args.steps,
        "sync_every": args.sync_every,
        "spread": args.spread,
        "grad_mode": mode,
        "tracker": "mlflow",
    }
    results = []
    for seed in args.seeds:
        cfg = AblationConfig(**base, seed=seed, compare_group=f"quality-{mode}-seed{seed}")
        for lr in args.sweep:
            spec = RunSpec(f"onecycle-lr{lr:g}", lr, 0.0, False)
            results.append(run_arm(cfg, spec, mode, seed, "onecycle", reader))
    high = aggressive_lr(results, args.sweep)
    print(f"  {mode}: aggressive max_lr by the rule = {high:g}", flush=True)
    for seed in args.seeds:
        cfg = AblationConfig(**base, seed=seed, compare_group=f"quality-{mode}-seed{seed}")
        for name, auto in (("hdet-no-auto-lr", False), ("hdet", True)):
            results.append(run_arm(cfg, RunSpec(name, high, args.spread, auto), mode, seed, name, reader))
    return results, high


# ---------------------------------------------------------------------- report
def _rows_for(results: list[Result], arm: str, lr: float | None = None) -> list[Result]:
    return [r for r in results if r.arm == arm and (lr is None or r.max_lr == lr)]


def _line(label: str, lr: float, rs: list[Result]) -> str:
    div = [r for r in rs if r.row.diverged]
    div_text = f"{len(div)}/{len(rs)}" + (
        f" (steps {', '.join(str(r.row.diverged_at_step) for r in div)})" if div else ""
    )
    return (
        f"| {label} | {lr:g} | {_cell([r.row.mean_lr for r in rs])} | {_cell([r.row.final_train_loss for r in rs])} "
        f"| {_cell([r.row.best_val_loss for r in rs])} | {_cell([r.row.final_val_loss for r in rs])} "
        f"| {_cell([r.row.val_accuracy for r in rs])} | {div_text} | {statistics.fmean(r.wall_s for r in rs):.0f} |"
    )


def mode_section(mode: str, results: list[Result], high: float, low: float) -> tuple[list[str], dict]:
    sweep = _rows_for(results, "onecycle")
    best = best_onecycle(sweep)
    lines = [
        f"### {mode} gradients",
        "",
        "| run | max_lr | mean LR | final train loss | best val loss | final val loss | val accuracy | diverged | s/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lr in sorted({r.max_lr for r in sweep}):
        roles = [n for n, v in (("baseline-low", low), ("baseline-high", high), ("best OneCycle", best)) if v == lr]
        label = f"OneCycle{' = ' + ', '.join(roles) if roles else ''}"
        lines.append(_line(label, lr, _rows_for(results, "onecycle", lr)))
    for arm in ("hdet-no-auto-lr", "hdet"):
        lines.append(_line(f"**{arm}**", high, _rows_for(results, arm)))
    hdet = _rows_for(results, "hdet")
    bar = _rows_for(results, "onecycle", best)
    high_rows = _rows_for(results, "onecycle", high)
    # a diverged seed counts as an infinite loss: the mean is then undefined, never flattered by dropping it
    hdet_val = statistics.fmean(_val_for_ranking(r) for r in hdet)
    bar_val = statistics.fmean(_val_for_ranking(r) for r in bar)
    ratio = hdet_val / bar_val if math.isfinite(hdet_val) and math.isfinite(bar_val) and bar_val > 0 else math.inf
    hdet_div = sum(r.row.diverged for r in hdet)
    high_div = sum(r.row.diverged for r in high_rows)
    verdict = "at or below" if ratio <= 1.0 else "above"
    lines += [
        "",
        f"- Aggressive max_lr (rule: the smallest swept max_lr at which OneCycle diverged on a seed): **{high:g}**. "
        f"There OneCycle diverged on {high_div}/{len(high_rows)} seeds, full HDET on {hdet_div}/{len(hdet)}, "
        f"HDET without auto-LR on {sum(r.row.diverged for r in _rows_for(results, 'hdet-no-auto-lr'))}/"
        f"{len(_rows_for(results, 'hdet-no-auto-lr'))}.",
        f"- Full HDET's final validation loss (mean over seeds; a diverged seed makes it undefined): "
        f"{_fmt(hdet_val)}; the best OneCycle of the sweep (max_lr {best:g}): {_fmt(bar_val)}; "
        + (
            f"ratio {_fmt(ratio)}: HDET ends **{verdict}** the tuned OneCycle."
            if math.isfinite(ratio)
            else "no ratio: HDET **diverged** on at least one seed, so it does not match the tuned OneCycle."
        ),
    ]
    lines += controller_notes(hdet, high)
    lines.append("")
    summary = {
        "mode": mode,
        "aggressive_lr": high,
        "best_onecycle_lr": best,
        "ratio": ratio,
        "hdet_diverged": hdet_div,
        "onecycle_high_diverged": high_div,
        "seeds": len(hdet),
    }
    return lines, summary


def controller_notes(hdet: list[Result], high: float) -> list[str]:
    """What the auto-LR controller did before each full-HDET seed diverged, read from its logged decisions.

    A divergence before the controller's warm-up ended means full HDET and HDET without auto-LR
    were the same runs up to there: the report says so instead of crediting or blaming the controller.
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
            f"- The auto-LR controller never acted before a divergence: the diverged full-HDET seeds broke by "
            f"step{'s' if len(diverged) > 1 else ''} {', '.join(str(r.row.diverged_at_step) for r in diverged)}, "
            f"and its warm-up lasts {warmup} steps; up to there full HDET and HDET without auto-LR are the same "
            f"algorithm. At max_lr {high:g}, {top}."
        ]
    return [
        f"- Controller decisions before each diverged full-HDET seed broke: {', '.join(map(str, acted))} "
        f"(warm-up {warmup} steps); {top}."
    ]


def describe_task(task) -> str:
    """The model and optimizer as the task builds them (e.g. "an MLP 784-256-256-10, SGD (momentum 0.9,
    Nesterov, weight decay 0.0005)"), so the report cannot drift from ``hdet_track/examples/tasks.py``."""
    import torch

    model = task.model(0)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widths = "-".join(str(w) for w in [linear[0].in_features, *(m.out_features for m in linear)])
    opt = task.optimizer(model.parameters(), 0.1)
    d = opt.defaults
    extras = [f"momentum {d['momentum']:g}"] if d.get("momentum") else []
    extras += ["Nesterov"] if d.get("nesterov") else []
    extras += [f"betas {tuple(d['betas'])}"] if "betas" in d else []
    extras += [f"weight decay {d['weight_decay']:g}"] if d.get("weight_decay") else []
    return f"an MLP {widths}, {type(opt).__name__} ({', '.join(extras)})"


def _fmt(x: float) -> str:
    return f"{x:.4g}" if math.isfinite(x) else "n/a"


def plot(results: list[Result], modes: list[str], highs: dict[str, float], low: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(modes), figsize=(6.5 * len(modes), 8), squeeze=False)
    seed = min(r.seed for r in results)
    for col, mode in enumerate(modes):
        mine = [r for r in results if r.mode == mode and r.seed == seed]
        best = best_onecycle([r for r in results if r.mode == mode and r.arm == "onecycle"])
        picks = [
            (f"OneCycle {low:g} (baseline-low)", "onecycle", low, "tab:blue"),
            (f"OneCycle {highs[mode]:g} (baseline-high)", "onecycle", highs[mode], "tab:red"),
            (f"OneCycle {best:g} (best of sweep)", "onecycle", best, "tab:green"),
            (f"HDET {highs[mode]:g}, no auto-LR", "hdet-no-auto-lr", highs[mode], "tab:orange"),
            (f"HDET {highs[mode]:g}", "hdet", highs[mode], "tab:purple"),
        ]
        seen = set()
        ceiling = [0.0, 0.0]  # per panel: 10x the highest first value, the divergence threshold
        for label, arm, lr, color in picks:
            match = next((r for r in mine if r.arm == arm and r.max_lr == lr), None)
            if match is None or (arm, lr) in seen:
                continue
            seen.add((arm, lr))
            style = "--" if arm == "hdet-no-auto-lr" else "-"  # dashed: visible where it overlaps full HDET
            steps, loss = match.run.median_series("loss")
            vs, vv = match.run.metrics.get("val_loss", (np.zeros(0), np.zeros(0)))
            for row, (xs, ys) in enumerate(((steps, loss), (vs, vv))):
                if not len(xs):
                    continue
                if row == 0:
                    window = max(1, len(ys) // 40)
                    xs, ys = xs[window - 1 :], np.convolve(ys, np.ones(window) / window, mode="valid")
                ax = axes[row][col]
                ax.plot(xs, ys, style, label=label, color=color, marker="." if row else None)
                if len(ys) and math.isfinite(ys[0]):
                    ceiling[row] = max(ceiling[row], 10 * float(ys[0]))
                if match.row.diverged:
                    ax.axvline(match.row.diverged_at_step, color=color, linestyle=":", alpha=0.8)
        for row, what in enumerate(("training loss (median over replicas, smoothed)", "validation loss at syncs")):
            ax = axes[row][col]
            ax.set_yscale("log")
            if ceiling[row] > 0:
                bottom = ax.get_ylim()[0]
                ax.set_ylim(bottom, min(ax.get_ylim()[1], ceiling[row]))
            ax.set_xlabel("step   (dotted: where that run diverged; y axis cut at 10x the first loss)")
            ax.set_title(f"{mode} gradients, seed {seed}: {what}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(args, results, highs, summaries, sections, wall: float, out: Path, png: Path) -> Path:
    import torch

    cfg = AblationConfig(dataset=args.dataset, data_dir=args.data_dir)
    task = cfg.task()
    # as the runs logged it, not as this script assumes ablation.py sets it
    warmup = next((r.run.start.config.get("auto_lr_warmup") for r in results if r.arm == "hdet" and r.run.start), "?")
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cpu = platform.processor() or platform.machine()
    lines = [
        f"# Results: HDET vs OneCycle on {args.dataset}",
        "",
        f"Generated by `bench/quality.py` on {now}; every number below is read back from the MLflow",
        "store the runs were logged to. Re-run it to reproduce (the command is at the bottom).",
        "",
        f"- Task: {args.dataset}, {describe_task(task)}, batch {cfg.batch_size} per replica; "
        f"{len(task.x_train):,} training and {len(task.x_val):,} held-out validation images.",
        f"- {args.replicas} gloo replicas per run (torch's elastic launcher, loopback), {args.steps} optimizer steps, "
        f"sync every {args.sync_every} steps, HDET spread {args.spread:g}, auto-LR warm-up {warmup} steps.",
        f"- OneCycle sweep over max_lr {', '.join(f'{x:g}' for x in args.sweep)}; seeds "
        f"{', '.join(map(str, args.seeds))} (a seed fixes the initial weights and the data order, the same for every arm).",
        f"- Machine: {platform.system()} {platform.machine()} ({cpu}), {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}. Wall time of the whole study: {wall / 60:.1f} min.",
        "- Mean ± standard deviation over seeds; `-` means no finite value. Diverged: the training loss "
        "(median over replicas) became non-finite or exceeded 10x its first value; a replica that blows up and "
        "is repaired at the next sync is HDET at work, not a divergence. When every replica is non-finite the "
        "run stops there and is marked FAILED.",
        "",
        "## Summary",
        "",
        "| gradients | aggressive max_lr | OneCycle diverged there | HDET diverged there | best OneCycle max_lr "
        "| HDET final val loss / best OneCycle |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['mode']} | {s['aggressive_lr']:g} | {s['onecycle_high_diverged']}/{s['seeds']} "
            f"| {s['hdet_diverged']}/{s['seeds']} | {s['best_onecycle_lr']:g} | {_fmt(s['ratio'])} |"
        )
    lines += ["", "## Per gradient mode", ""]
    for sec in sections:
        lines += sec
    lines += [f"![loss curves]({png.name})", "", "## Every run", ""]
    lines += ["| gradients | seed | run | max_lr | final val loss | val accuracy | diverged at | s | run id |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.mode} | {r.seed} | {r.row.name} | {r.max_lr:g} | {_fmt(r.row.final_val_loss)} "
            f"| {_fmt(r.row.val_accuracy)} | {r.row.diverged_at_step or '-'} | {r.wall_s:.0f} | `{r.row.run_id[:8]}` |"
        )
    cmd = " ".join(["python", "bench/quality.py", *sys.argv[1:]])
    lines += ["", f"Command: `{cmd}`", ""]
    path = out / "results.md"
    path.write_text("\n".join(lines))
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fashion-mnist", choices=["fashion-mnist", "digits"])
    p.add_argument("--data-dir", default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--grad-modes", nargs="+", default=["shared", "independent"], choices=["shared", "independent"])
    p.add_argument("--sweep", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2, 0.5])
    p.add_argument("--low-lr", type=float, default=0.05, help="baseline-low's max_lr (added to the sweep)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--sync-every", type=int, default=25)
    p.add_argument("--spread", type=float, default=0.5)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"))
    p.add_argument("--store", default=None, help="MLflow tracking URI for the runs (default: a temporary sqlite file)")
    args = p.parse_args()
    args.sweep = sorted(set(args.sweep) | {args.low_lr})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = args.store or f"sqlite:///{Path(tempfile.mkdtemp(prefix='hdet-quality-')) / 'quality.db'}"
    os.environ["MLFLOW_TRACKING_URI"] = store  # the launched replicas inherit it
    os.environ["MLFLOW_EXPERIMENT_NAME"] = EXPERIMENT
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from hdet_track.readers.mlflow import MLflowReader

    reader = MLflowReader(store)
    print(f"bench/quality.py: runs logged to {store} (experiment {EXPERIMENT})", flush=True)
    started = time.monotonic()
    results, highs, summaries, sections = [], {}, [], []
    for mode in args.grad_modes:
        mine, highs[mode] = run_mode(args, mode, reader)
        results += mine
        lines, summary = mode_section(mode, mine, highs[mode], args.low_lr)
        sections.append(lines)
        summaries.append(summary)
    wall = time.monotonic() - started
    png = out / "loss_curves.png"
    plot(results, args.grad_modes, highs, args.low_lr, png)
    report = write_report(args, results, highs, summaries, sections, wall, out, png)
    print(f"wrote {report} and {png}; open the runs with: hdet-track dashboard {store}")
    for s in summaries:
        ratio = s["ratio"] if math.isfinite(s["ratio"]) else None
        print(
            json.dumps(
                {
                    "bench": f"quality_{s['mode']}_hdet_final_val_loss_vs_best_onecycle",
                    "value": ratio,
                    "unit": "ratio",
                    "target": 1.0,
                    "pass": ratio is not None and ratio <= 1.0,
                }
            )
        )
        print(
            json.dumps(
                {
                    "bench": f"quality_{s['mode']}_hdet_diverged_seeds_at_aggressive_lr",
                    "value": s["hdet_diverged"],
                    "unit": f"of {s['seeds']} seeds",
                    "target": 0,
                    "pass": s["hdet_diverged"] == 0,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

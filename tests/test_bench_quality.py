"""bench/quality.py, which writes the published results (issue #11): its rules on constructed
results, and one small real study (digits, 2 gloo replicas, every default arm) whose report and
JSON lines must agree with the tracking store, and which a second invocation resumes, not reruns."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quality import (  # noqa: E402
    Planned,
    Result,
    aggressive_lr,
    best_onecycle,
    controller_notes,
    json_lines,
    lr_sensitivity,
    ratio_se,
    recovery_notes,
    sensitivity_se,
    vs_one_run,
)
from hdet_track.compare import ComparisonRow  # noqa: E402
from hdet_track.events import ControllerDecision, Guard, RunStart  # noqa: E402
from hdet_track.readers.base import HDETRun  # noqa: E402


def _row(val: float, diverged_at: int | None = None, name: str = "run") -> ComparisonRow:
    return ComparisonRow(
        run_id="id",
        name=name,
        schedule="onecycle",
        world_size=4,
        status="FINISHED",
        mean_lr=0.1,
        final_train_loss=0.1,
        best_train_loss=0.1,
        highest_stable_lr=0.1,
        best_val_loss=val,
        final_val_loss=val,
        val_accuracy=0.9,
        diverged=diverged_at is not None,
        diverged_at_step=diverged_at,
    )


def _result(lr: float, val: float, diverged: bool, seed: int = 0, arm: str = "onecycle", mode: str = "shared"):
    return Result(mode, seed, arm, lr, 1.0, _row(val, 7 if diverged else None), None)


def test_aggressive_lr_is_the_smallest_that_diverged_on_any_seed():
    sweep = [
        _result(0.1, 0.40, False),
        _result(0.2, 0.35, False, seed=0),
        _result(0.2, 0.90, True, seed=1),
        _result(0.5, 2.30, True),
    ]
    assert aggressive_lr(sweep, [0.1, 0.2, 0.5]) == 0.2
    assert aggressive_lr([_result(0.1, 0.4, False), _result(0.5, 0.3, False)], [0.1, 0.5]) == 0.5


def test_best_onecycle_ranks_by_mean_final_val_loss_and_a_diverged_seed_ranks_last():
    sweep = [
        _result(0.05, 0.40, False, seed=0),
        _result(0.05, 0.42, False, seed=1),
        _result(0.2, 0.30, False, seed=0),
        _result(0.2, 0.31, True, seed=1),  # lowest loss on both seeds, but diverged on one
        _result(0.1, 0.39, False, seed=0),
        _result(0.1, 0.44, False, seed=1),
    ]
    assert best_onecycle(sweep) == 0.05  # mean 0.41 beats 0.1's 0.415; 0.2 counts as infinite
    sweep[4] = _result(0.1, 0.30, False, seed=0)
    assert best_onecycle(sweep) == 0.1  # now 0.37


def test_lr_sensitivity_is_the_worst_ratio_to_the_best_onecycle_and_a_divergence_makes_it_infinite():
    results = [
        _result(0.1, 0.40, False),
        _result(0.2, 0.30, False),
        _result(0.5, 9.00, True),
        _result(0.1, 0.309, False, arm="hdet-drift"),
        _result(0.2, 0.303, False, arm="hdet-drift"),
        _result(0.5, 0.306, False, arm="hdet-drift"),
    ]
    worst, at, bar = lr_sensitivity(results)
    assert (worst, at, bar) == (pytest.approx(1.03), 0.1, 0.30)
    results.append(_result(0.5, 0.301, True, seed=1, arm="hdet-drift"))  # recovered, but it blew up
    worst, at, _ = lr_sensitivity(results)
    assert worst == math.inf and at == 0.5
    assert math.isnan(lr_sensitivity([r for r in results if r.arm == "onecycle"])[0])  # no HDET runs: no ratio


def test_json_lines_judge_each_mode_by_its_own_targets():
    results = [
        _result(0.1, 0.30, False, mode="shared"),
        _result(0.1, 0.305, False, arm="hdet-drift", mode="shared"),
        _result(0.1, 0.30, False, mode="independent"),
        _result(0.1, 0.32, False, arm="hdet-drift", mode="independent"),  # 1.067: over the target
        _result(0.1, 0.50, True, arm="hdet-paper", mode="independent"),  # the paper arm's divergence is not counted
        _result(1.0, 0.31, False, arm="schedulefree"),
        _result(1.0, 0.29, False, arm="prodigy"),
    ]
    lines = {(x["bench"], x["mode"]): x for x in json_lines(results, ["shared", "independent"], ["image"], [])}
    for x in lines.values():
        assert {"bench", "mode", "value", "unit", "target", "pass"} <= set(x) and isinstance(x["pass"], bool)
    assert lines["quality.lr_sensitivity", "shared"]["pass"] is True
    assert lines["quality.lr_sensitivity", "independent"]["value"] == pytest.approx(0.32 / 0.30)
    assert lines["quality.lr_sensitivity", "independent"]["pass"] is False
    assert lines["quality.divergences", "independent"]["value"] == 0
    vs = lines["quality.vs_one_run_methods", "shared"]
    assert vs["value"] == pytest.approx(0.305 / 0.29) and vs["pass"] is False  # Prodigy is the better one


def test_no_divergence_of_no_runs_or_of_a_study_cut_short_does_not_pass():
    """``quality.divergences`` read 0 and passed with no HDET-drift run in the store (every one had
    failed to run), while the report said the planned runs were missing."""
    sweep = [_result(0.1, 0.30, False)]
    (div,) = [x for x in json_lines(sweep, ["shared"], ["image"], []) if x["bench"] == "quality.divergences"]
    assert div["value"] == 0 and div["runs"] == 0 and div["pass"] is False
    planned = [Planned("image", "fashion-mnist", "shared", seed, "hdet-drift", 0.1, 100, 4) for seed in (0, 1)]
    done = sweep + [_result(0.1, 0.31, False, arm="hdet-drift")]
    (div,) = [x for x in json_lines(done, ["shared"], ["image"], [], planned) if x["bench"] == "quality.divergences"]
    assert div["missing"] == 1 and div["pass"] is False
    done.append(_result(0.1, 0.31, False, seed=1, arm="hdet-drift"))
    (div,) = [x for x in json_lines(done, ["shared"], ["image"], [], planned) if x["bench"] == "quality.divergences"]
    assert div["missing"] == 0 and div["pass"] is True


def test_ratio_se_is_the_standard_error_of_a_ratio_paired_by_seed():
    bars = [_result(0.2, v, False, seed=s) for s, v in enumerate([0.30, 0.32, 0.34])]
    # the same ratio on every seed: no uncertainty about it, however much the seeds differ
    same = [_result(0.1, 1.03 * b.row.final_val_loss, False, seed=b.seed, arm="hdet-drift") for b in bars]
    assert ratio_se(same, bars) == pytest.approx(0.0, abs=1e-12)
    # pairing broken (seed 0's HDET value set against seed 2's bar): the seeds' spread shows up
    shuffled = [_result(0.1, r.row.final_val_loss, False, seed=2 - r.seed, arm="hdet-drift") for r in same]
    assert ratio_se(shuffled, bars) > 0.02
    # a constant bar: the standard error of the HDET mean divided by the bar (sd 0.1 over 3 seeds)
    flat = [_result(0.2, 1.0, False, seed=s) for s in range(3)]
    mine = [_result(0.1, v, False, seed=s, arm="hdet-drift") for s, v in enumerate([1.0, 1.1, 1.2])]
    assert ratio_se(mine, flat) == pytest.approx(0.1 / math.sqrt(3))
    scaled = [_result(0.1, 1000 * r.row.final_val_loss, False, seed=r.seed, arm="hdet-drift") for r in mine]
    assert ratio_se(scaled, [_result(0.2, 1000.0, False, seed=s) for s in range(3)]) == pytest.approx(
        0.1 / math.sqrt(3)
    )
    # no standard error from one seed, a seed without its pair, or a run that diverged
    assert math.isnan(ratio_se(mine[:1], flat))
    assert math.isnan(ratio_se(mine, flat[:2]))
    assert math.isnan(ratio_se([*mine[:2], _result(0.1, 1.2, True, seed=2, arm="hdet-drift")], flat))


def test_json_lines_and_report_give_the_worst_ratio_its_standard_error_against_the_best_onecycle():
    results = [_result(0.2, v, False, seed=s) for s, v in enumerate([0.30, 0.31, 0.32])]
    results += [_result(0.1, v, False, seed=s) for s, v in enumerate([0.40, 0.41, 0.42])]
    results += [_result(0.1, v, False, seed=s, arm="hdet-drift") for s, v in enumerate([0.31, 0.33, 0.32])]
    results += [_result(0.2, v, False, seed=s, arm="hdet-drift") for s, v in enumerate([0.30, 0.31, 0.32])]
    results += [_result(1.0, 0.305, False, arm="schedulefree"), _result(1.0, 0.33, False, arm="prodigy")]
    line = next(x for x in json_lines(results, ["shared"], ["image"], []) if x["bench"] == "quality.lr_sensitivity")
    assert line["value"] == pytest.approx(0.32 / 0.31)  # at 0.1, against OneCycle at 0.2
    expected = ratio_se(
        [r for r in results if r.arm == "hdet-drift" and r.max_lr == 0.1],
        [r for r in results if r.arm == "onecycle" and r.max_lr == 0.2],
    )
    assert line["se"] == pytest.approx(expected) and expected > 0
    assert sensitivity_se(results, 0.2) == pytest.approx(0.0, abs=1e-12)  # HDET equals OneCycle's best there
    vs = vs_one_run(results, "shared")
    assert vs["onecycle_best"] == pytest.approx(0.31) and vs["sweep_best"] == pytest.approx(0.31 / 0.305)


def _hdet(diverged_at: int | None, decisions: list[int], guard: list[Guard] = (), val: float = 1.0) -> Result:
    start = RunStart(
        config={"auto_lr_warmup": 200, "spread": 0.5},
        world_size=4,
        schedule="hdet",
        param_groups=["pg0"],
        explored=[],
        versions={},
        hostnames=[],
    )
    controller = [
        ControllerDecision(
            step=s,
            name="lr",
            weights=[0.25] * 4,
            delta=[0.0],
            velocity=[0.0],
            base_before=[0.5],
            base_after=[0.5],
            gamma=0.0,
            permutation=[0, 1, 2, 3],
        )
        for s in decisions
    ]
    run = HDETRun("id", name="hdet", start=start, controller=controller, guard=list(guard))
    return Result("shared", 0, "hdet-paper", 0.5, 1.0, _row(val, diverged_at, "hdet"), run)


def test_controller_notes_say_whether_the_controller_acted_before_the_divergence():
    assert controller_notes([_hdet(None, [200, 225])], 0.5) == []  # nothing diverged: nothing to explain
    (never,) = controller_notes([_hdet(150, []), _hdet(200, [200])], 0.5)
    assert "never acted" in never and "steps 150, 200" in never and "warm-up lasts 200 steps" in never
    assert "up to 0.75" in never  # (1 + spread) x max_lr
    (acted,) = controller_notes([_hdet(300, [200, 225, 250, 300]), _hdet(210, [200])], 0.5)
    assert "never acted" not in acted and "broke: 3, 1" in acted


def test_recovery_notes_name_the_guard_action_after_each_blow_up_and_where_the_run_ended():
    rollback = Guard(step=125, action="rollback", replicas=[0, 1, 2, 3], reason="every replica blown up")
    early = Guard(step=50, action="backoff", replicas=[3], reason="replica 3 blew up")
    runs = [_hdet(124, [], [early, rollback], val=0.33), _hdet(None, [], [], val=0.32)]
    (note,) = recovery_notes(runs, bar=0.30)
    assert "1 seed blew up (steps 124" in note
    assert "rollback at step 125" in note and "backoff" not in note  # the action that answered this blow-up
    assert "final val loss of 0.33" in note and "1.1x the best OneCycle" in note
    lost = _hdet(124, [], [], val=math.nan)
    (note,) = recovery_notes([lost], bar=0.30)
    assert "no guard action" in note and "the best OneCycle" not in note
    assert recovery_notes([runs[1]], bar=0.30) == []


def test_a_report_from_a_store_that_does_not_exist_is_an_error_and_creates_nothing(tmp_path):
    store = tmp_path / "missing" / "q.db"
    cmd = [sys.executable, str(ROOT / "bench" / "quality.py"), "--report-only", "--store", f"sqlite:///{store}"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    assert not store.parent.exists()


# ------------------------------------------------------------------ one small real study
ARGS = [
    "--tasks", "image", "--dataset", "digits", "--seeds", "0", "--steps", "40", "--sync-every", "10",
    "--replicas", "2", "--modes", "independent", "--sweep", "0.05", "0.5",
    "--arms", "onecycle", "hdet-drift", "prodigy",
]  # fmt: skip


def _quality(out: Path, store: str, *extra: str) -> str:
    cmd = [sys.executable, str(ROOT / "bench" / "quality.py"), *ARGS, "--out", str(out), "--store", store, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("quality")
    store = f"sqlite:///{out / 'q.db'}"
    first = _quality(out, store)
    report = (out / "results.md").read_text()
    second = _quality(out, store)  # everything is in the store: nothing runs again
    return out, store, first, second, report


def test_study_report_matches_the_tracking_store(study):
    from hdet_track.compare import comparison_rows
    from hdet_track.readers.mlflow import MLflowReader

    out, store, first, _, report = study
    reader = MLflowReader(store)
    runs = reader.list_runs("hdet-quality")
    names = sorted(r.name for r in runs)
    assert names == sorted(["onecycle-lr0.05", "onecycle-lr0.5", "hdet-drift-lr0.05", "hdet-drift-lr0.5", "prodigy"])
    every = [line for line in report.splitlines() if line.startswith("| image | independent | 0 |")]
    every += [line for line in report.splitlines() if line.startswith("| image | shared | 0 | prodigy")]
    assert len(every) == len(runs)
    rows = {}
    for summary in runs:
        row = comparison_rows([reader.read(summary.run_id)])[0]
        rows[row.name] = row
        line = next(x for x in every if f"`{summary.run_id[:8]}`" in x)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert f"{cells[3]}-lr{cells[4]}" == row.name or cells[3] == row.name == "prodigy"
        shown = float(cells[5]) if cells[5] not in ("-", "n/a") else math.nan
        assert shown == pytest.approx(row.final_val_loss, rel=1e-3) or not math.isfinite(row.final_val_loss)
        assert cells[7] == (str(row.diverged_at_step) if row.diverged else "-")
    # the set-up is read from the task, not typed in
    assert "an MLP 64-256-256-10, SGD (momentum 0.9, Nesterov, weight decay 0.0005)" in report
    assert (out / "lr_sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "planned run(s) are not in the store" not in report
    # the page says the command that runs this study, also when it was rebuilt from the store alone
    command = f"Command: `python bench/quality.py {' '.join(ARGS)} --store {store}`"
    assert command in report
    rebuilt = out / "rebuilt"
    rebuilt.mkdir()
    _quality(rebuilt, store, "--report-only")
    again = (rebuilt / "results.md").read_text()
    assert command in again and "--report-only" not in again.split("Command:")[1]
    assert [x for x in again.splitlines() if x.startswith("| image |")] == [
        x for x in report.splitlines() if x.startswith("| image |")
    ]


def test_study_json_lines_are_the_store_s_numbers(study):
    from hdet_track.compare import comparison_rows
    from hdet_track.readers.mlflow import MLflowReader

    out, store, first, second, _ = study
    lines = {x["bench"]: x for x in map(json.loads, [s for s in first.splitlines() if s.startswith("{")])}
    assert set(lines) == {"quality.lr_sensitivity", "quality.divergences", "quality.vs_one_run_methods"}
    reader = MLflowReader(store)
    rows = {r.name: comparison_rows([reader.read(r.run_id)])[0] for r in reader.list_runs("hdet-quality")}

    def val(name):
        r = rows[name]
        return math.inf if r.diverged or not math.isfinite(r.final_val_loss) else r.final_val_loss

    bar = min(val("onecycle-lr0.05"), val("onecycle-lr0.5"))
    worst = max(val("hdet-drift-lr0.05"), val("hdet-drift-lr0.5")) / bar
    got = lines["quality.lr_sensitivity"]
    assert got["mode"] == "independent"
    assert (got["value"] is None and worst == math.inf) or got["value"] == pytest.approx(worst, rel=1e-9)
    assert got["pass"] == (worst <= 1.03)
    div = sum(rows[n].diverged for n in ("hdet-drift-lr0.05", "hdet-drift-lr0.5"))
    assert lines["quality.divergences"]["value"] == div and lines["quality.divergences"]["pass"] == (div == 0)
    # the second invocation found every run and printed the same lines
    assert second.count(" skip ") == 5 and " run fashion" not in second and " run digits" not in second
    assert [s for s in second.splitlines() if s.startswith("{")] == [s for s in first.splitlines() if s.startswith("{")]

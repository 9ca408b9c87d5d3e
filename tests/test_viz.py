"""Figure builders on constructed runs: assertions on the figures' data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hdet_track.compare import comparison_rows, diverged_at
from hdet_track.events import ControllerDecision, Converge, Guard, RunStart
from hdet_track.readers.base import HDETRun, StepTable
from hdet_track.record import ExploredSpec
from hdet_track.schedule import multipliers
from hdet_track.viz import (
    controller_in_view,
    guard_in_view,
    guard_rows,
    lambdalr_snippet,
    plot_compare,
    plot_controller,
    plot_divergence,
    plot_fanout,
    plot_permutations,
    plot_replica_loss,
    plot_sync_heatmap,
    plot_sync_loss,
    schedule_csv,
    user_metric_keys,
)
from hdet_track.viz._common import downsample
from hdet_track.viz.controller import taken_back_steps


def make_run(n=4, steps=100, T=10, spread=0.3, nan_replica=None, name="run", schedule="hdet", lr_scale=1.0):
    rho = multipliers(n, spread)
    perms = [list(range(n))] + [list(np.roll(range(n), j)) for j in range(1, steps // T + 1)]
    rows = []
    for k in range(1, steps + 1):
        w = (k - 1) // T
        base = 0.1 * lr_scale * (1 - k / (steps + 1))
        for r in range(n):
            m = rho[perms[w][r]]
            loss = 1.0 / k + 0.01 * r
            if nan_replica is not None and r == nan_replica and 45 <= k <= 50:
                loss = math.nan
            rows.append((k, r, loss, base * m, m))
    arr = np.array(rows, dtype=float)
    table = StepTable(
        arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int32), arr[:, 2], {"lr": arr[:, 3]}, {"lr": arr[:, 4]}
    )
    start = RunStart(
        config={},
        world_size=n,
        schedule=schedule,
        param_groups=["pg0"],
        explored=[ExploredSpec("lr", spread, rho, ["pg0"], ["lr"], [(0.0, 1.0)], False)],
        versions={},
        hostnames=["h"] * n,
    )
    converge = [
        Converge(
            step=s,
            window_losses=[1.0 / s + 0.01 * r for r in range(n)],
            divergence=[0.01 * (r + 1) for r in range(n)],
            left_out=[nan_replica] if nan_replica is not None and s == 50 else [],
        )
        for s in range(T, steps + 1, T)
    ]
    controller = [
        ControllerDecision(
            step=s,
            name="lr",
            weights=[1.0 / n] * n,
            delta=[0.001],
            velocity=[0.0005],
            base_before=[0.1],
            base_after=[0.09 - s * 1e-4],
            gamma=0.05,
            permutation=perms[s // T],
            onecycle=[0.1 - s * 1e-4],
        )
        for s in range(2 * T, steps + 1, T)
    ]
    return HDETRun(
        run_id=name, name=name, status="FINISHED", start=start, steps=table, converge=converge, controller=controller
    )


def test_fanout_traces_are_each_replicas_values_with_band():
    run = make_run(n=8)
    fig = plot_fanout(run)
    names = [t.name for t in fig.data]
    assert [f"replica {r}" for r in range(8)] == [n for n in names if n.startswith("replica")]
    r3 = next(t for t in fig.data if t.name == "replica 3")
    steps, values = run.replica_series("lr", 3)
    assert list(r3.x) == steps.tolist() and np.allclose(r3.y, values)
    base = next(t for t in fig.data if t.name == "base (mean)")
    band = [t for t in fig.data if t.name and t.name.startswith("band")][0]
    assert np.allclose(band.y, np.asarray(base.y) * 0.7)  # lower edge 1 - alpha


def test_permutation_heatmap_shows_the_multiplier_each_replica_held():
    run = make_run(n=4, steps=40, T=10)
    fig = plot_permutations(run)
    z = np.asarray(fig.data[0].z)
    rho = multipliers(4, 0.3)
    assert z.shape == (4, 4)
    assert np.allclose(z[:, 0], rho)  # window 1: rank r on rho_r
    assert np.allclose(z[:, 1], [rho[p] for p in np.roll(range(4), 1)])
    assert list(fig.data[0].x) == ["1", "11", "21", "31"]


def test_sync_loss_marks_syncs_and_resets():
    run = make_run(n=4, nan_replica=2)
    fig = plot_sync_loss(run)
    syncs = next(t for t in fig.data if t.name.startswith("sync"))
    assert list(syncs.x) == list(range(10, 101, 10))
    resets = next(t for t in fig.data if t.name.startswith("replica left out"))
    assert list(resets.x) == [50] and list(resets.text) == ["replica 2: non-finite"]  # who, and why
    mean = fig.data[0]
    assert all(np.isfinite(mean.y))  # a NaN replica is left out of the mean, not poisoning it


def test_divergence_and_heatmaps():
    run = make_run(n=3)
    fig = plot_divergence(run)
    assert [t.name for t in fig.data] == ["replica 0", "replica 1", "replica 2"]
    assert np.allclose(fig.data[1].y, [0.02] * 10)
    weights = plot_sync_heatmap(run, "weights")
    assert np.asarray(weights.data[0].z).shape == (3, 9)
    losses = plot_sync_heatmap(run, "window_losses")
    assert np.asarray(losses.data[0].z)[0, 0] == pytest.approx(0.1)


def test_controller_plot_shows_base_onecycle_drift():
    run = make_run()
    fig = plot_controller(run)
    base = next(t for t in fig.data if t.name == "controller base")
    onecycle = next(t for t in fig.data if t.name == "plain OneCycle")
    drift = next(t for t in fig.data if t.name == "drift")
    assert list(base.x) == list(range(20, 101, 10))
    assert np.allclose(drift.y, np.asarray(base.y) / np.asarray(onecycle.y))


def test_controller_plot_marks_a_taken_back_first_move_but_not_a_backoff_or_the_paper_controller():
    """The drift controller's LR drift going down with no guard action at that sync is a provisional
    move taken back (revert_unconfirmed): marked on the drift panel; a backoff's cut is marked as the
    backoff; the paper controller's downward deltas are its decay, not marked."""

    def decision(step, delta, controller="drift"):
        return ControllerDecision(
            step=step, name="lr", weights=[0.5, 0.5], delta=[delta], velocity=[0.0], base_before=[0.1],
            base_after=[0.1], gamma=0.0, permutation=[0, 1], onecycle=[0.1], controller=controller,
        )  # fmt: skip

    def marked(run):
        return [a.x for a in plot_controller(run).layout.annotations if a.text == "taken back"]

    run = HDETRun(
        run_id="t",
        controller=[decision(25, 0.55), decision(50, -0.55), decision(75, -0.3)],
        guard=[Guard(step=75, action="backoff", replicas=[1], reason="blown up", drift_change=-0.3)],
    )
    assert taken_back_steps(run) == [50] and marked(run) == [50]
    assert [a.x for a in plot_controller(run).layout.annotations if a.text == "backoff"] == [75]
    paper = HDETRun(run_id="p", controller=[decision(25, 0.1, "paper"), decision(50, -0.4, "paper")])
    assert taken_back_steps(paper) == [] and marked(paper) == []


def test_empty_and_single_replica_runs_draw_notes_not_errors():
    empty = HDETRun(run_id="e")
    for fig in (
        plot_fanout(empty),
        plot_permutations(empty),
        plot_replica_loss(empty),
        plot_sync_loss(empty),
        plot_divergence(empty),
        plot_sync_heatmap(empty),
        plot_controller(empty),
        plot_compare([empty]),
    ):
        assert len(fig.data) == 0 and fig.layout.annotations
    one = make_run(n=1, spread=0.0)
    assert [t.name for t in plot_fanout(one).data] == ["replica 0", "base (mean)"]
    assert "No" not in str(plot_replica_loss(one).layout.annotations)


def test_downsample_keeps_spikes_and_bounds_points():
    x = np.arange(100_000)
    y = np.ones(100_000)
    y[54_321] = 1e6
    y[77_777] = np.nan
    xs, ys = downsample(x, y, 1000)
    assert len(xs) <= 1000 + 10
    assert 54_321 in xs and np.nanmax(ys) == 1e6 and 77_777 in xs
    rng = np.random.default_rng(0)  # noisy, with a gap in every bucket (a replica's resets): 3 points a bucket
    noisy = rng.normal(size=100_000)
    noisy[::40] = np.nan
    xs, ys = downsample(x, noisy, 2000)
    assert len(xs) <= 2000 and np.isnan(ys).any()
    big = make_run(n=8, steps=5000, T=100)
    fig = plot_fanout(big, max_points=500)
    assert all(len(t.x) <= 510 for t in fig.data)


def test_compare_table_and_overlay():
    hdet = make_run(name="hdet")
    base = make_run(name="onecycle", schedule="onecycle", spread=0.0, lr_scale=2.0)
    # Make the baseline diverge at step 60.
    base.steps.loss[base.steps.step >= 60] = np.inf
    rows = {r.name: r for r in comparison_rows([hdet, base])}
    assert rows["hdet"].diverged_at_step is None and rows["onecycle"].diverged_at_step == 60
    assert rows["hdet"].final_train_loss == pytest.approx(np.mean([0.01 + 0.01 * r for r in range(4)]))
    assert rows["onecycle"].highest_stable_lr == pytest.approx(0.2 * (1 - 1 / 101))
    fig = plot_compare([hdet, base], "lr", log_y=False)
    assert [t.name for t in fig.data] == ["hdet (hdet)", "onecycle (onecycle)"] and fig.data[1].line.dash == "dash"
    assert diverged_at(np.array([1, 2, 3]), np.array([1.0, 20.0, 1.0])) == 2


def test_export_schedule_csv_and_lambdalr_replay():
    run = make_run()
    csv = schedule_csv(run).splitlines()
    assert csv[0] == "step,lr" and len(csv) == 101
    namespace: dict = {}
    exec(lambdalr_snippet(run), namespace)
    steps, lr = run.mean_series("lr")
    replay = [namespace["BASE_LR"] * namespace["hdet_schedule"](s - 1) for s in steps]
    assert np.allclose(replay, lr, rtol=1e-6)


def test_one_exploding_replica_is_not_a_divergence_but_half_of_them_is():
    run = make_run(n=4, steps=100)
    steps, median = run.median_series("loss")
    ref_steps, mean = run.mean_series("loss")
    assert np.array_equal(steps, ref_steps) and len(steps) == 100
    by_step = {s: sorted(run.steps.loss[run.steps.step == s]) for s in (1, 50)}
    assert median[0] == pytest.approx((by_step[1][1] + by_step[1][2]) / 2)
    # replica 3 explodes between syncs (an aggressive multiplier), then is repaired: HDET by design
    run.steps.loss[(run.steps.replica == 3) & (run.steps.step >= 41) & (run.steps.step < 50)] = 1e30
    run.steps.loss[(run.steps.replica == 3) & (run.steps.step == 45)] = np.nan
    assert comparison_rows([run])[0].diverged_at_step is None
    assert diverged_at(*run.mean_series("loss")) == 41  # the mean alone would call it diverged
    # two of four replicas non-finite: the median is non-finite, the run diverged there
    run.steps.loss[(run.steps.replica == 2) & (run.steps.step >= 70)] = np.nan
    run.steps.loss[(run.steps.replica == 1) & (run.steps.step >= 72)] = np.inf
    assert comparison_rows([run])[0].diverged_at_step == 72
    _, median = run.median_series("loss")
    assert np.isinf(median[steps == 72][0]) and np.isfinite(median[steps == 71][0])


def test_comparison_reports_where_the_loss_broke_not_where_the_run_stopped():
    from hdet_track.compare import comparison_rows

    run = make_run(n=4, steps=100)
    assert comparison_rows([run])[0].diverged is False
    # the loss of three replicas explodes at step 31; the run only stops at the sync at step 40
    run.steps.loss[(run.steps.replica >= 1) & (run.steps.step >= 31)] = 1e6
    run.metrics["diverged_at_step"] = (np.array([40]), np.array([40.0]))
    row = comparison_rows([run])[0]
    assert row.diverged and row.diverged_at_step == 31
    # without per-step losses (metric histories cut short), the run's own mark still counts
    stopped = make_run(n=4, steps=30)
    stopped.metrics["diverged_at_step"] = (np.array([30]), np.array([30.0]))
    row = comparison_rows([stopped])[0]
    assert row.diverged and row.diverged_at_step == 30


def test_a_diverged_runs_syncs_and_resets_stay_on_the_loss_chart():
    """Where every replica's loss is NaN the mean is NaN, and the sync and reset markers placed on it
    got y=NaN: plotly drew none of them, so a diverged run's last syncs vanished from the chart."""
    run = make_run(n=2, steps=60, T=10)
    broken = run.steps.step >= 45
    run.steps.loss[broken] = np.nan
    run.converge[-1].left_out[:] = [0, 1]
    fig = plot_sync_loss(run)
    syncs = next(t for t in fig.data if t.name.startswith("sync"))
    assert list(syncs.x) == [10, 20, 30, 40, 50, 60] and np.isfinite(syncs.y).all()
    last_finite = float(run.mean_series("loss")[1][43])
    assert list(syncs.y[-2:]) == [last_finite] * 2  # at the last finite loss
    assert list(syncs.text[-2:]) == ["loss not finite here"] * 2 and syncs.text[0] == ""
    resets = next(t for t in fig.data if t.name.startswith("replica left out"))
    assert np.isfinite(resets.y).all() and resets.text[0].endswith("; loss not finite here")


def test_a_single_replica_run_draws_no_exploration_band():
    """One replica explores nothing (its only multiplier is 1): the fan-out page drew a +-spread band."""
    one = make_run(n=1, spread=0.3)
    assert [t.name for t in plot_fanout(one).data] == ["replica 0", "base (mean)"]


def test_a_run_name_with_a_line_break_leaves_the_export_snippet_valid_python():
    """``run_name="sweep 3\\nlr=0.1 (retry)"`` (MLflow takes it): the name's second line became code."""
    run = make_run(name="sweep 3\nlr=0.1 (retry)")
    snippet = lambdalr_snippet(run)
    compile(snippet, "<snippet>", "exec")
    assert "(sweep 3 lr=0.1 (retry))" in snippet


def test_the_export_snippet_credits_hdet_only_for_an_hdet_run():
    """A OneCycle baseline's (or another tool's) schedule was exported as "Discovered by HDET"."""
    assert "# Discovered by HDET in run run " in lambdalr_snippet(make_run())
    for schedule, label in [("onecycle", "onecycle"), ("", "plain")]:
        snippet = lambdalr_snippet(make_run(schedule=schedule))
        assert f"# The {label} schedule of run run " in snippet and "Discovered" not in snippet


def test_a_run_read_without_its_archive_shows_the_divergence_its_metrics_hold():
    run = make_run(n=3)
    for c in run.converge:
        c.divergence[:] = [math.nan] * 3
    assert "No divergence recorded" in str(plot_divergence(run).layout.annotations)
    run.metrics["hdet/sync/divergence"] = (np.array([10, 20]), np.array([0.02, 0.03]))
    run.metrics["hdet/sync/divergence_max"] = (np.array([10, 20]), np.array([0.05, 0.06]))
    fig = plot_divergence(run)
    assert [t.name for t in fig.data] == ["mean over replicas", "largest replica"]
    assert list(fig.data[1].y) == [0.05, 0.06] and "read without" in str(fig.layout.annotations)


def test_a_zoomed_step_range_zooms_the_divergence_and_the_heatmaps_too():
    """The loss chart showed the syncs in the chosen step range, the divergence chart and the
    heatmaps below it every sync of the run."""
    run = make_run(n=3, nan_replica=1)
    run.view = (30, 60)
    assert list(plot_divergence(run).data[0].x) == [30, 40, 50, 60]
    assert list(plot_sync_heatmap(run, "window_losses").data[0].x) == ["30", "40", "50", "60"]
    assert list(plot_sync_heatmap(run, "weights").data[0].x) == ["30", "40", "50", "60"]
    assert list(next(t for t in plot_sync_loss(run).data if t.name.startswith("sync")).x) == [30, 40, 50, 60]
    run.view = (1, 20)
    assert [row["step"] for row in guard_rows(run)] == [50]  # the guard's table: the whole run


def test_a_zoomed_step_range_zooms_the_controller_page_too():
    """Zoomed on a huge run, the Controller page drew only the used LR in the range: its base,
    OneCycle, drift, delta, velocity and guard lines (and the page's metrics) spanned the run."""
    run = make_run(n=3)
    run.guard = [
        Guard(step=30, action="backoff", replicas=[2], reason="r"),
        Guard(step=90, action="rollback", replicas=[0, 1, 2], reason="r"),
    ]
    run.view = (30, 60)
    assert controller_in_view(run)["step"].tolist() == [30, 40, 50, 60]
    assert controller_in_view(run)["base"].tolist() == run.controller_series()["base"][1:5].tolist()
    assert [g.step for g in guard_in_view(run)] == [30]
    fig = plot_controller(run)
    for trace in fig.data:
        if trace.name != "used (mean over replicas)":
            assert min(trace.x) >= 30 and max(trace.x) <= 60, trace.name
    assert [a.text for a in fig.layout.annotations if a.text in ("backoff", "rollback")] == ["backoff"]
    run.view = None
    assert controller_in_view(run)["step"].tolist() == list(range(20, 101, 10))
    assert len(guard_in_view(run)) == 2


def test_a_live_run_before_its_first_sync_says_its_steps_come_with_the_sync():
    """A live run shows no step before its first sync (the steps reach the tracker with each sync):
    its charts said "No loss recorded in this run", as for a run that logged nothing."""
    live = HDETRun(run_id="live", status="RUNNING")
    for fig in (plot_sync_loss(live), plot_replica_loss(live)):
        assert "arrive with its first sync" in fig.layout.annotations[0].text
    assert "No loss recorded in this run" in str(
        plot_sync_loss(HDETRun(run_id="ended", status="FINISHED")).layout.annotations
    )


def test_the_compare_page_charts_the_users_metrics_not_hdets_own():
    """A run read without its archive holds its divergence summaries as metrics: the Compare page
    drew a chart for each, as if they were the user's (it draws one per metric but loss and lr)."""
    a, b = make_run(name="a"), make_run(name="b")
    a.metrics["val_loss"] = (np.array([10]), np.array([0.5]))
    b.metrics["hdet/sync/divergence"] = (np.array([10]), np.array([0.01]))
    b.metrics["loss"] = (np.array([10]), np.array([0.4]))
    assert user_metric_keys([a, b]) == ["val_loss"]


def test_a_step_range_without_syncs_says_so_not_that_the_run_has_none():
    run = make_run(n=3, T=10)
    run.view = (1, 5)
    for fig in (plot_divergence(run), plot_sync_heatmap(run, "window_losses"), plot_sync_heatmap(run, "weights")):
        assert "chosen step range" in fig.layout.annotations[0].text


def test_a_loss_at_or_below_zero_gets_a_linear_axis_where_a_log_axis_would_draw_nothing():
    """A loss that is a log-likelihood plus a constant (all values below 0): the loss charts of the
    Converge, Fan-out and Compare pages kept their log axis and drew empty axes."""
    positive = make_run()
    negative = make_run(name="negative")
    negative.steps.loss[:] = negative.steps.loss - 5.0
    for plot in (plot_sync_loss, plot_replica_loss, lambda run: plot_compare([run])):
        assert plot(positive).layout.yaxis.type == "log"
        assert plot(negative).layout.yaxis.type != "log"

"""The drift controller's math on constructed window losses (no training): direction, scale
invariance, continuity, the guard's threshold, back-off and rollback; and its state round trip."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hdet_track.controller import (
    Controller,
    ControllerContext,
    DriftController,
    WindowStats,
    trend_evidence,
    window_noise,
)
from hdet_track.schedule import multipliers

N, T = 4, 20
RHO = multipliers(N, 0.5)  # 0.5, 0.833, 1.167, 1.5


def context(names=("lr",), lr_bounds_given=False):
    return ControllerContext(
        names=list(names),
        num_targets={n: 1 for n in names},
        multipliers={n: RHO for n in names},
        bounds={n: [(0.0, 1.0)] if n != "lr" else [(1e-7, 1.0)] for n in names},
        lr_bounds_given=lr_bounds_given,
        world_size=N,
        total_steps=1000,
        sync_every=T,
        start_step=0,
        div_factor=25.0,
        final_div_factor=1e4,
    )


def stats(losses, step=20, perm=(0, 1, 2, 3), names=("lr",), finite=None, refs=None, c=None, peaks=None):
    """One sync's evidence; replica r's value is its multiplier times the base (from ``c``'s drift)."""
    losses = np.asarray(losses, dtype=float)
    refs = refs or {n: [0.1] for n in names}
    base = {n: c.base(n, 0, refs[n][0]) if c is not None else refs[n][0] for n in names}
    return WindowStats(
        step=step,
        losses=losses,
        counts=[int(np.isfinite(row).sum()) if np.isfinite(row).any() else T for row in losses],
        sums=[float(row.sum()) for row in losses],
        finite=list(finite) if finite is not None else [True] * len(losses),
        perms={n: list(perm) for n in names},
        values={n: [[base[n] * RHO[p]] for p in perm] for n in names},
        references=refs,
        peaks=peaks,
    )


def windows(levels, noise=0.01, seed=0, start=None):
    """Per-step losses: replica r's window sits at ``levels[r]`` with white noise; all start at ``start``."""
    rng = np.random.default_rng(seed)
    out = np.array([level + noise * rng.standard_normal(T) for level in levels])
    if start is not None:
        out[:, 0] = start
    return out


def controller(names=("lr",), **kw):
    c = DriftController(**kw)
    c.bind(context(names))
    return c


def feed(c, wins, names=("lr",), first=1):
    """Window ``k`` of ``wins`` ends at sync ``first + k``; the last sync's decision."""
    for k, w in enumerate(wins, first):
        st = stats(w, step=T * k, c=c, names=names)
        d = c.update(st, c.health(st))
    return d


def test_trend_evidence_hand_computed_and_scale_free():
    x = [-1.0, 0.0, 1.0]
    # slope of m on x is 0.5; sum x*m = 1.0; sqrt(sum x^2) = sqrt(2): z = 1 / (0.1 * sqrt 2)
    assert trend_evidence(x, [1.0, 1.5, 2.0], 0.1) == pytest.approx(1.0 / (0.1 * math.sqrt(2)))
    assert trend_evidence(x, [1000.0, 1500.0, 2000.0], 100.0) == pytest.approx(trend_evidence(x, [1.0, 1.5, 2.0], 0.1))
    assert trend_evidence([0.0, 0.0], [1.0, 2.0], 0.1) == 0.0  # no spread of multipliers: no evidence
    assert trend_evidence(x, [1.0, 1.5, 2.0], math.nan) == 0.0  # windows too short to estimate noise
    assert trend_evidence(x, [1.0, 1.5, 2.0], 0.0) == 10.0  # noiseless and different: clipped


def test_window_noise_is_the_standard_error_of_a_window_mean():
    rng = np.random.default_rng(1)
    sigma, steps = 0.3, 400
    trend = np.linspace(2.0, 1.0, steps)  # training moves the loss within the window: detrended away
    losses = np.array([trend + sigma * rng.standard_normal(steps) for _ in range(8)])
    assert window_noise(losses) == pytest.approx(sigma / math.sqrt(steps), rel=0.15)
    assert window_noise(losses * 1000) == pytest.approx(window_noise(losses) * 1000, rel=1e-9)
    assert math.isnan(window_noise(np.ones((4, 2))))


@pytest.mark.parametrize("scale", [1.0, 1000.0, 1e-3])
def test_drift_goes_up_when_higher_lr_replicas_do_better_and_decisions_are_loss_scale_free(scale):
    decisions = []
    for s in (1.0, scale):
        c = controller()
        for k in range(1, 4):
            # replica r holds multiplier r (perm identity): the higher the LR, the lower the loss
            st = stats(s * windows([1.0, 0.98, 0.96, 0.94], seed=k), step=20 * k, c=c)
            d = c.update(st, c.health(st))
        decisions.append(c.drift["lr"] + d.weights + [u.velocity for u in d.updates["lr"]])
    assert decisions[0][0] > 0.5  # a clear signal: full steps up
    assert decisions[0] == pytest.approx(decisions[1], rel=1e-9)  # x1000 or x0.001: the same decisions


def test_lr_does_not_go_down_on_evidence_but_other_hyperparameters_do():
    c = DriftController()
    c.bind(context(("lr", "weight_decay")))
    for k in range(1, 4):
        st = stats(windows([0.94, 0.96, 0.98, 1.0], seed=k), step=20 * k, names=("lr", "weight_decay"))
        d = c.update(st, c.health(st))
    assert c.drift["lr"] == [0.0]  # "smaller did better within a window" is the biased direction
    assert c.drift["weight_decay"][0] < -0.5  # the same evidence moves weight decay down
    assert d.updates["lr"][0].velocity > 3  # the evidence itself is kept for the dashboard
    symmetric = DriftController(one_sided=False)
    symmetric.bind(context())
    for k in range(1, 4):
        st = stats(windows([0.94, 0.96, 0.98, 1.0], seed=k), step=20 * k)
        symmetric.update(st, symmetric.health(st))
    assert symmetric.drift["lr"][0] < -0.5


def test_skip_windows_ignores_the_first_windows_evidence_but_not_the_guard():
    """The first window's evidence (steps up to skip_windows * sync_every) neither moves the drift
    nor accumulates; from the next window on the controller decides as a fresh one would."""
    clear = [windows([1.0, 0.98, 0.96, 0.94], seed=k) for k in range(3)]
    skip, fresh = controller(skip_windows=1, revert_unconfirmed=False), controller()
    st = stats(clear[0], step=T, c=skip)
    d = skip.update(st, skip.health(st))
    assert skip.drift["lr"] == [0.0] and d.updates["lr"][0].delta == 0.0
    assert skip.state_dict()["evidence"]["lr"] == [0.0, 0.0]  # nothing carried into the next sync
    for k in (1, 2):  # the skipping controller's 2nd and 3rd syncs are the fresh one's 1st and 2nd
        a, b = stats(clear[k], step=T * (k + 1), c=skip), stats(clear[k], step=T * k, c=fresh)
        skip.update(a, skip.health(a))
        fresh.update(b, fresh.health(b))
        assert skip.drift["lr"] == pytest.approx(fresh.drift["lr"]) and skip.drift["lr"][0] > 0
    # a resumed or wrapped schedule past the first window: nothing is skipped
    late, plain = controller(skip_windows=1, revert_unconfirmed=False), controller()
    for c in (late, plain):
        st = stats(clear[0], step=5 * T, c=c)
        c.update(st, c.health(st))
    assert late.drift == plain.drift and late.drift["lr"][0] > 0
    # the guard acts in a skipped window: the top replica blew up, one notch down (the notch rule)
    guarded = controller(skip_windows=1, revert_unconfirmed=False, edge_backoff="off")
    losses = windows([1.0, 1.0, 1.0, 1.0], noise=0.001, start=1.0)
    losses[3, 1:] = 3.0
    st = stats(losses, step=T, c=guarded)
    d = guarded.update(st, guarded.health(st))
    assert [g.kind for g in d.guard] == ["backoff"]
    assert guarded.drift["lr"][0] == pytest.approx(-(math.log(RHO[3]) - math.log(RHO[2])))


def test_confirm_skipped_holds_the_first_windows_evidence_until_the_next_window_agrees():
    """confirm_skipped: the skipped window's evidence is held; a second window pointing the same way
    (beyond the dead zone) releases it, and the drift is then where a controller that used both
    windows stands; a second window inside the dead zone or pointing the other way drops it."""
    up = [windows([1.0, 0.98, 0.96, 0.94], seed=k) for k in range(2)]
    flat = windows([1.0] * N, noise=0.01, seed=5)
    down = windows([0.94, 0.96, 0.98, 1.0], seed=6)
    names = ("lr", "weight_decay")

    def run(c, wins, first_step=T):
        return feed(c, wins, names, first_step // T)

    def make(**kw):
        return controller(names=names, **kw)

    held, fresh = make(skip_windows=1, confirm_skipped=True), make()
    run(held, up[:1])
    assert held.drift == {"lr": [0.0], "weight_decay": [0.0]}
    assert held.state_dict()["held"]["lr"][0] < -3  # kept for the next sync, not accumulated
    d = run(held, up[1:], first_step=2 * T)
    run(fresh, up)
    assert held.drift["lr"] == pytest.approx(fresh.drift["lr"]) and held.drift["lr"][0] > 1.0  # two full steps
    assert held.drift["weight_decay"] == pytest.approx(fresh.drift["weight_decay"])  # two-sided hps alike
    assert held.state_dict()["evidence"] == fresh.state_dict()["evidence"]
    assert d.updates["lr"][0].delta == pytest.approx(held.drift["lr"][0])  # both moves at the second sync
    assert held.state_dict()["held"] == {}
    weak = windows([1.0, 0.998, 0.996, 0.994], noise=0.01, seed=5)  # "up" too, but inside the dead zone
    for second in (flat, weak, down):  # not confirmed: the skip-only controller's decisions
        c, skip = make(skip_windows=1, confirm_skipped=True), make(skip_windows=1, revert_unconfirmed=False)
        run(c, [up[0], second])
        run(skip, [up[0], second])
        assert c.drift == skip.drift and c.state_dict()["evidence"] == skip.state_dict()["evidence"]
        if second is weak:  # it points the held window's way, but not beyond the dead zone
            assert -1.5 < c.state_dict()["evidence"]["lr"][0] < 0


def test_confirm_skipped_over_two_windows_never_lowers_the_lr_on_evidence():
    """skip_windows=2: a held "down" window and a held "up" window, then a confirming "up": each
    move is judged on its own (one_sided drops the LR's down move), as a controller without skipping
    would have moved sync by sync; weight decay (two-sided) takes all three."""
    names = ("lr", "weight_decay")
    wins = [windows([0.94, 0.96, 0.98, 1.0], seed=1)] + [windows([1.0, 0.98, 0.96, 0.94], seed=k) for k in (2, 3)]
    held, fresh = DriftController(skip_windows=2, confirm_skipped=True), DriftController()
    for c in (held, fresh):
        c.bind(context(names))
    for k, w in enumerate(wins, 1):
        for c in (held, fresh):
            st = stats(w, step=T * k, c=c, names=names)
            c.update(st, c.health(st))
    assert held.drift == fresh.drift and held.drift["lr"][0] > 0


def test_confirm_skipped_resumes_with_what_it_holds_and_a_backoff_drops_it():
    up = [windows([1.0, 0.98, 0.96, 0.94], seed=k) for k in range(2)]
    a = controller(skip_windows=1, confirm_skipped=True)
    st = stats(up[0], step=T, c=a)
    a.update(st, a.health(st))
    b = controller(skip_windows=1, confirm_skipped=True)
    b.load_state_dict(a.state_dict())  # a job stopped between the first and the second sync
    for c in (a, b):
        st = stats(up[1], step=2 * T, c=c)
        c.update(st, c.health(st))
    assert b.drift == a.drift and a.drift["lr"][0] > 1.0
    # the top replica blows up in the held window: its upward evidence is not released later
    guarded = controller(skip_windows=1, confirm_skipped=True, edge_backoff="off")
    losses = windows([1.0, 0.98, 0.96, 0.94], start=1.0)
    losses[3, 1:] = 3.0
    st = stats(losses, step=T, c=guarded)
    assert [g.kind for g in guarded.update(st, guarded.health(st)).guard] == ["backoff"]
    after_backoff = guarded.drift["lr"][0]
    st = stats(up[1], step=2 * T, c=guarded)
    guarded.update(st, guarded.health(st))
    half = (math.log(RHO[3]) - math.log(RHO[0])) / 2 / 2  # the step is halved after a guard event
    assert guarded.drift["lr"][0] - after_backoff == pytest.approx(half)  # its own window's move only
    # a rollback in the held window drops it too
    rolled = controller(skip_windows=1, confirm_skipped=True)
    st = stats(up[0], step=T, c=rolled)
    rolled.update(st, rolled.health(st))
    rolled.rolled_back(stats(windows([5.0] * N, start=1.0), step=T + 5, c=rolled))
    assert rolled.state_dict()["held"] == {}


def test_revert_unconfirmed_moves_at_once_and_takes_back_what_the_next_window_does_not_confirm():
    """revert_unconfirmed: the first window moves the drift as the default does; a second window
    pointing the same way beyond the dead zone keeps it (the default's decisions, value for value);
    a flat, weak or opposite second window takes it back: the drift and evidence are then the
    skip-only controller's, exactly (round 16). Weight decay (two-sided) alike."""
    names = ("lr", "weight_decay")
    up = [windows([1.0, 0.98, 0.96, 0.94], seed=k) for k in range(3)]
    weak = windows([1.0, 0.998, 0.996, 0.994], noise=0.01, seed=5)
    flat = windows([1.0] * N, noise=0.01, seed=5)
    down = windows([0.94, 0.96, 0.98, 1.0], seed=6)

    def run(c, wins, first=1):
        return feed(c, wins, names, first)

    def make(**kw):
        return controller(names=names, **kw)

    c, plain = make(skip_windows=1, revert_unconfirmed=True), make()
    run(c, up[:1])
    run(plain, up[:1])
    assert c.drift == plain.drift and c.drift["lr"][0] > 0.5  # a full step at once
    assert c.state_dict()["provisional"]["lr"] == [0.0]  # where skip-first stands, to go back to
    run(c, up[1:2], first=2)
    run(plain, up[1:2], first=2)
    assert c.drift == plain.drift and c.state_dict()["evidence"] == plain.state_dict()["evidence"]
    assert c.drift["lr"][0] > 1.0  # two full steps: the first window's is kept
    assert c.state_dict()["provisional"] == {} and c.state_dict()["held"] == {}
    for second in (flat, weak, down):
        c, skip = make(skip_windows=1, revert_unconfirmed=True), make(skip_windows=1, revert_unconfirmed=False)
        run(skip, [up[0], second])
        d = run(c, [up[0], second])
        assert c.drift == skip.drift and c.state_dict()["evidence"] == skip.state_dict()["evidence"]
        assert d.updates["lr"][0].delta < -0.5  # the first window's step taken back at this sync
    # two provisional windows (skip_windows=2) taken back together by a flat third
    c, skip = make(skip_windows=2, revert_unconfirmed=True), make(skip_windows=2, revert_unconfirmed=False)
    run(c, up[:2])
    assert c.drift["lr"][0] > 1.0
    for x in (c, skip):
        run(x, [flat], first=3)
    assert c.drift == skip.drift and c.state_dict()["evidence"] == skip.state_dict()["evidence"]
    with pytest.raises(ValueError, match="confirm_skipped and revert_unconfirmed"):
        DriftController(skip_windows=1, confirm_skipped=True, revert_unconfirmed=True)


def test_revert_unconfirmed_goes_back_to_where_skip_first_stands_per_target_within_bounds():
    """Two param groups whose bounds clip differently while OneCycle's reference rises: taking the
    first move back lands each target where skip-first's drift stands (its own clamp included)."""
    ctx = ControllerContext(
        names=["lr"], num_targets={"lr": 2}, multipliers={"lr": RHO}, bounds={"lr": [(0.01, 1.0), (1e-7, 1.0)]},
        lr_bounds_given=True, world_size=N, total_steps=1000, sync_every=T, start_step=0,
        div_factor=25.0, final_div_factor=1e4,
    )  # fmt: skip
    up, flat = windows([1.0, 0.98, 0.96, 0.94], seed=1), windows([1.0] * N, seed=2)
    out = []
    for kw in ({"revert_unconfirmed": True}, {}):
        c = DriftController(skip_windows=1, **({"revert_unconfirmed": False} | kw))
        c.bind(ctx)
        for k, (w, ref) in enumerate([(up, 0.008), (flat, 0.05)], 1):
            refs = {"lr": [ref, ref]}
            st = WindowStats(
                step=T * k, losses=w, counts=[T] * N, sums=[float(r.sum()) for r in w], finite=[True] * N,
                perms={"lr": [0, 1, 2, 3]}, references=refs,
                values={"lr": [[c.base("lr", t, ref) * RHO[p] for t in range(2)] for p in range(N)]},
            )  # fmt: skip
            c.update(st, c.health(st))
        out.append(c.drift["lr"])
    assert out[0] == out[1]
    assert out[0][0] == pytest.approx(math.log(0.01 / 0.008)) and out[0][1] == 0.0  # the bound's clamp stays


def test_revert_unconfirmed_resumes_with_its_provisional_move_and_a_guard_event_drops_it():
    up, flat = windows([1.0, 0.98, 0.96, 0.94], seed=0), windows([1.0] * N, noise=0.01, seed=5)
    a = controller(skip_windows=1, revert_unconfirmed=True)
    st = stats(up, step=T, c=a)
    a.update(st, a.health(st))
    b = controller(skip_windows=1, revert_unconfirmed=True)
    b.load_state_dict(a.state_dict())  # a job stopped between the first and the second sync
    for c in (a, b):
        st = stats(flat, step=2 * T, c=c)
        c.update(st, c.health(st))
    assert b.drift == a.drift == {"lr": [0.0]}  # taken back after the resume too
    # the top replica blows up in the first window: the backoff stands, and from there the
    # default's decisions and evidence
    guarded, plain = (
        controller(skip_windows=1, revert_unconfirmed=True, edge_backoff="off"),
        controller(edge_backoff="off"),
    )
    losses = windows([1.0, 0.98, 0.96, 0.94], start=1.0)
    losses[3, 1:] = 3.0
    for c in (guarded, plain):
        st = stats(losses, step=T, c=c)
        assert [g.kind for g in c.update(st, c.health(st)).guard] == ["backoff"]
        st = stats(flat, step=2 * T, c=c)
        c.update(st, c.health(st))
    assert guarded.drift == plain.drift and guarded.drift["lr"][0] < 0
    assert guarded.state_dict()["evidence"] == plain.state_dict()["evidence"]
    assert guarded.state_dict()["provisional"] == {}
    # a blow-up at the deciding sync: the notch is cut from the drift the replicas trained with,
    # and the drift ends at the lower of that and where taking the move back leads
    notch = math.log(RHO[3]) - math.log(RHO[2])
    blown = windows([1.0] * N, noise=0.01, seed=5, start=1.0)
    blown[3, 1:] = 3.0
    c = controller(skip_windows=1, revert_unconfirmed=True, edge_backoff="off")
    st = stats(up, step=T, c=c)
    c.update(st, c.health(st))
    trained_with = c.drift["lr"][0]
    st = stats(blown, step=2 * T, c=c)
    d = c.update(st, c.health(st))
    assert [g.kind for g in d.guard] == ["backoff"] and d.guard[0].drift_change == pytest.approx(-trained_with)
    assert c.drift["lr"][0] == min(0.0, trained_with - notch) == 0.0  # the notch is smaller than the move
    # a rollback before the second sync drops the provisional move (the rollback's cut stands)
    rolled = controller(skip_windows=1, revert_unconfirmed=True)
    st = stats(up, step=T, c=rolled)
    rolled.update(st, rolled.health(st))
    rolled.rolled_back(stats(windows([5.0] * N, start=1.0), step=T + 5, c=rolled))
    cut = rolled.drift["lr"][0]
    assert rolled.state_dict()["provisional"] == {} and rolled.state_dict()["held"] == {}
    st = stats(flat, step=2 * T, c=rolled)
    rolled.update(st, rolled.health(st))
    assert rolled.drift["lr"][0] == cut


def test_a_backoff_drops_the_upward_evidence_it_had():
    """Higher LRs did better among the healthy replicas, but the top one blew up: after the backoff,
    no upward evidence carries over, so a flat next window moves nothing (rounds 1-14 kept that
    evidence and moved up again; docs/controller.md, round 15)."""
    c = controller(edge_backoff="off")
    losses = windows([1.0, 0.9, 0.8, 0.8], start=1.0)
    losses[3, 1:] = 3.0
    st = stats(losses, c=c)
    d = c.update(st, c.health(st))
    assert [g.kind for g in d.guard] == ["backoff"] and d.updates["lr"][0].velocity < -3
    after_backoff = c.drift["lr"][0]
    assert c.state_dict()["evidence"]["lr"][0] == 0.0
    st = stats(windows([1.0] * N, noise=0.01, seed=2), step=40, c=c)
    d = c.update(st, c.health(st))
    assert abs(d.updates["lr"][0].velocity) < 1.5 and c.drift["lr"][0] == after_backoff
    # downward evidence (for a two-sided hyperparameter it would move down) is kept
    c2 = controller(edge_backoff="off")
    losses = windows([0.8, 0.9, 1.0, 1.0], start=0.8)
    losses[3, 1:] = 3.0
    st = stats(losses, c=c2)
    c2.update(st, c2.health(st))
    assert c2.state_dict()["evidence"]["lr"][0] > 3


def test_noise_alone_moves_nothing():
    c = controller()
    for k in range(1, 30):
        st = stats(windows([1.0] * N, noise=0.05, seed=k), step=20 * k)
        c.update(st, c.health(st))
    assert abs(c.drift["lr"][0]) < 0.3  # pure data noise: the dead zone keeps the drift near 0


def test_continuity_base_is_the_reference_until_the_drift_moves():
    c = controller()
    assert c.base("lr", 0, 0.0123) == 0.0123  # bit for bit: OneCycle's own value before any move
    st = stats(windows([1.0, 0.98, 0.96, 0.94]), refs={"lr": [0.05]})
    d = c.update(st, c.health(st))
    u = d.updates["lr"][0]
    assert u.base_before == 0.05 and u.reference == 0.05
    assert u.base_after == pytest.approx(0.05 * math.exp(c.drift["lr"][0]))
    assert c.base("lr", 0, 0.07) == pytest.approx(0.07 * math.exp(c.drift["lr"][0]))  # keeps OneCycle's shape


@pytest.mark.parametrize(("top", "blown"), [(1.9, False), (2.1, True), (math.inf, True), (math.nan, True)])
def test_guard_threshold_and_backoff(top, blown):
    """Replica 3 (the highest LR) ends the window at ``top`` x the others' level (1.0). The cut is
    the notch rule (edge_backoff="off"); the default's edge cut is tested below. A non-finite window
    is a blow-up too, and cuts as a finite one does (it used to be left out with no backoff)."""
    c = controller(guard=2.0, edge_backoff="off")
    losses = windows([1.0, 1.0, 1.0, 1.0], noise=0.001, start=1.0)
    losses[3, 1:] = top
    st = stats(losses)
    health = c.health(st)
    assert health.healthy == [True, True, True, not blown]
    assert not health.rollback
    d = c.update(st, health)
    if blown:
        assert "blown up" in health.reasons[3] or "non-finite" in health.reasons[3]
        assert d.weights[3] == 0.0
    if blown:
        (backoff,) = d.guard
        assert backoff.kind == "backoff" and backoff.replicas == [3]
        # one notch: from the highest multiplier down to the highest healthy one
        assert c.drift["lr"][0] == pytest.approx(-(math.log(RHO[3]) - math.log(RHO[2])))
    if not blown:
        assert d.guard == []


def test_non_finite_parameters_of_the_top_replica_with_finite_losses_back_off():
    """Its last step overflowed: the losses of the window were finite, its parameters are not."""
    c = controller(guard=2.0, edge_backoff="off")
    st = stats(windows([1.0, 1.0, 1.0, 1.0], noise=0.001, start=1.0), finite=[True, True, True, False])
    health = c.health(st)
    assert health.healthy == [True, True, True, False] and health.reasons[3] == "non-finite"
    d = c.update(st, health)
    assert [(g.kind, g.replicas) for g in d.guard] == [("backoff", [3])] and c.guard_events == 1
    assert c.drift["lr"][0] == pytest.approx(-(math.log(RHO[3]) - math.log(RHO[2])))


def test_guard_events_halve_upward_lr_steps_only():
    """A backoff halves the LR's later upward steps; with ``one_sided=False`` the evidence that the
    LR should go down still moves it a full step (it used to be halved as well)."""
    full = (math.log(RHO[3]) - math.log(RHO[0])) / 2
    for events in (0, 1, 3):
        down = controller(skip_windows=0, one_sided=False)
        up = controller(skip_windows=0, one_sided=False)
        down.guard_events = up.guard_events = events
        st = stats(windows([0.94, 0.96, 0.98, 1.0], seed=1), step=100, c=down)
        down.update(st, down.health(st))
        st = stats(windows([1.0, 0.98, 0.96, 0.94], seed=1), step=100, c=up)
        up.update(st, up.health(st))
        assert down.drift["lr"][0] == pytest.approx(-full), events
        assert up.drift["lr"][0] == pytest.approx(full * 0.5**events), events


def test_guard_uses_the_window_start_and_is_off_for_non_positive_losses():
    c = controller(guard=2.0)
    losses = windows([0.5, 0.5, 0.5, 0.5], noise=0.001, start=0.2)  # every replica rose 2.5x from the start
    assert c.health(stats(losses)).healthy == [False] * 4
    assert c.health(stats(losses)).rollback
    negative = windows([-1.0, -1.0, -1.0, -3.5], noise=0.001)  # a log-likelihood: ratios mean nothing
    assert c.health(stats(negative)).healthy == [True] * 4


def test_rollback_cuts_the_drift_at_least_by_min_backoff_and_halves_later_steps():
    c = controller(min_backoff=2.0)
    st = stats(windows([5.0] * N, start=1.0))
    assert c.health(st).rollback
    d = c.rolled_back(st)
    (action,) = d.guard
    assert action.kind == "rollback" and action.replicas == [0, 1, 2, 3]
    assert c.drift["lr"][0] == pytest.approx(-math.log(RHO[3] / RHO[0]))  # log 3 > log 2
    assert c.rollbacks == 1
    before = c.drift["lr"][0]
    st = stats(windows([1.0, 0.9, 0.8, 0.7], seed=3), c=c)
    c.update(st, c.health(st))
    assert c.rollbacks == 0  # a healthy sync ends the streak
    full = (math.log(RHO[3]) - math.log(RHO[0])) / 2
    assert 0 < c.drift["lr"][0] - before <= full / 2 + 1e-12  # up again, at half the step


def test_ceiling_keeps_the_base_within_tested_lrs_during_the_ramp_up():
    """Strong evidence for a higher LR early in the ramp-up (OneCycle's LR 0.04, its peak 1.0): the
    replicas have only used up to 0.06, so a raised drift would take the peak past anything tried."""
    up = [1.0, 0.9, 0.8, 0.7]
    c = controller(ceiling=True)
    for k in range(1, 4):
        st = stats(windows(up, seed=k), step=20 * k, refs={"lr": [0.04]}, peaks={"lr": [1.0]}, c=c)
        d = c.update(st, c.health(st))
    assert c.drift["lr"] == [0.0] and d.updates["lr"][0].clipped
    assert d.updates["lr"][0].velocity < -3  # the evidence (higher did better) is there; only the move is held
    # Near the peak the top replica has used 0.9 x 1.5 = 1.35: the base may now rise to that.
    st = stats(windows(up, seed=7), step=100, refs={"lr": [0.9]}, peaks={"lr": [1.0]}, c=c)
    c.update(st, c.health(st))
    assert c.drift["lr"][0] == pytest.approx(math.log(1.35))
    # Without the rule the first sync already moves a full step (the first revision).
    old = controller(ceiling=False)
    st = stats(windows(up, seed=1), step=20, refs={"lr": [0.04]}, peaks={"lr": [1.0]}, c=old)
    old.update(st, old.health(st))
    assert old.drift["lr"][0] == pytest.approx((math.log(RHO[3]) - math.log(RHO[0])) / 2)


def test_ceiling_after_the_peak_is_one_notch_per_sync_and_ignores_blown_up_replicas():
    c = controller(ceiling=True)
    st = stats(windows([1.0, 0.9, 0.8, 0.7], seed=1), c=c)  # peaks = references: past OneCycle's peak
    c.update(st, c.health(st))
    assert c.drift["lr"][0] == pytest.approx(math.log(RHO[3]))  # the top replica's LR, not the full step
    # The top replica blew up: its LR does not count as tried, and the drift is backed off.
    c = controller(ceiling=True)
    losses = windows([1.0, 0.9, 0.8, 0.7], seed=2, start=1.0)
    losses[3, 1:] = 50.0
    st = stats(losses, c=c)
    c.update(st, c.health(st))
    assert c.state_dict()["tested"]["lr"] == [pytest.approx(0.1 * RHO[2])]
    assert c.drift["lr"][0] < 0


def test_step_guard_threshold_non_finite_and_off_by_default():
    firsts = [1.0, 1.2, 0.8, 1.1]  # median 1.05
    c = controller(step_guard=10.0)
    assert c.check_step([1.0, 2.0, 10.4, 0.9], firsts) is None  # 10.4 < 10 x 1.05
    reason = c.check_step([1.0, 2.0, 10.6, 0.9], firsts)
    assert reason.startswith("step guard: replicas [2]")
    assert c.check_step([1.0, math.nan, 0.5, 0.9], firsts).startswith("step guard: replicas [1] non-finite")
    assert c.check_step([1.0, 50.0, 0.5, 0.9], [-1.0, -2.0, -1.0, -1.0]) is None  # ratios need positive losses
    # a replica whose data is harder starts higher from the same consensus: judged from its own start
    assert c.check_step([0.3, 0.2, 0.25, 4.2], [0.3, 0.2, 0.25, 4.1]) is None
    assert c.check_step([0.3, 0.2, 0.25, 42.0], [0.3, 0.2, 0.25, 4.1]).startswith("step guard: replicas [3]")
    assert controller(step_guard=None).check_step([1.0, math.inf, 1.0, 1.0], firsts) is None  # off
    assert controller().step_guard == 10.0  # on by default (docs/controller.md, round 2)
    st = stats(windows([1.0] * N))
    d = c.rolled_back(st, reason)
    assert d.guard[0].kind == "rollback" and d.guard[0].reason.startswith("step guard: replicas [2]")
    assert c.drift["lr"][0] < 0
    with pytest.raises(ValueError, match=r"step_guard in \(1.0, inf\)"):
        DriftController(step_guard=0.5)


def test_drift_stays_within_max_drift_and_explicit_bounds():
    c = controller(max_drift=4.0)
    for k in range(1, 20):
        st = stats(windows([1.0, 0.9, 0.8, 0.7], seed=k), step=20 * k, c=c)
        c.update(st, c.health(st))
    assert c.drift["lr"][0] == pytest.approx(math.log(4.0))
    bounded = DriftController()
    bounded.bind(context(lr_bounds_given=True))
    for k in range(1, 20):
        st = stats(windows([1.0, 0.9, 0.8, 0.7], seed=k), step=20 * k, refs={"lr": [0.5]}, c=bounded)
        d = bounded.update(st, bounded.health(st))
    assert d.updates["lr"][0].base_after == pytest.approx(1.0)  # lr_bounds (1e-7, 1.0) given: the base stays in


@pytest.mark.parametrize("kw", [{}, {"ceiling": True}])
def test_state_dict_round_trip(kw):
    a = controller(**kw)
    for k in range(1, 5):
        st = stats(windows([1.0, 0.95, 0.9, 0.85], seed=k), step=20 * k, c=a)
        a.update(st, a.health(st))
    b = controller(**kw)
    b.load_state_dict(a.state_dict())
    assert b.state_dict()["tested"] == a.state_dict()["tested"] and a.state_dict()["tested"]["lr"][0] > 0
    st = stats(windows([1.0, 0.97, 0.9, 0.88], seed=9), step=100, c=a)
    assert a.update(st, a.health(st)) == b.update(st, b.health(st))
    assert a.drift == b.drift


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"guard": 1.0}, r"guard in \(1.0, inf\), but got 1.0"),
        ({"forget": 1.0}, r"forget in \[0.0, 1.0\)"),
        ({"dead_zone": 2.0, "full_step_at": 1.0}, "full_step_at"),
        ({"step": 0}, "step"),
        ({"max_drift": 0.5}, "max_drift"),
        ({"max_rollbacks": -1}, "max_rollbacks to be an integer >= 0"),
        ({"skip_windows": -1}, "skip_windows to be an integer >= 0, but got -1"),
        ({"skip_windows": 1.5}, "skip_windows to be an integer >= 0, but got 1.5"),
        ({"min_backoff": 1.0}, r"min_backoff in \(1.0, inf\), but got 1.0"),
    ],
)
def test_bad_arguments(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        DriftController(**kw)


def test_local_step_guard_checks_own_loss_and_leaves_the_reset_replica_out():
    c = controller(step_guard=10.0, step_guard_scope="local", trip_backoff="notch")
    assert c.check_own_step(9.9, 1.0) is None
    assert c.check_own_step(10.1, 1.0).startswith("step guard (local): loss 10.1 > 10 x 1")
    assert c.check_own_step(math.nan, 1.0) == "step guard (local): non-finite loss"
    assert c.check_own_step(50.0, -1.0) is None  # the ratio needs a positive start
    assert controller(step_guard=None, step_guard_scope="local").check_own_step(math.inf, 1.0) is None
    assert controller().step_guard_scope == "auto"  # the default (round 7)
    with pytest.raises(ValueError, match=r"step_guard_scope in \('all', 'local', 'auto'\), but got 'ranks'"):
        DriftController(step_guard_scope="ranks")
    with pytest.raises(ValueError, match="rollback=True with step_guard_scope='local'"):
        DriftController(step_guard_scope="local", rollback=False)
    # at the sync: the replica the local guard reset (the highest LR, 3) is left out, gets no weight,
    # and the controller backs off one notch, as for a replica the sync guard finds blown up
    st = stats(windows([1.0, 1.0, 1.0, 1.0], noise=0.001, start=1.0))
    st = WindowStats(**{**st.__dict__, "tripped": [False, False, False, True]})
    health = c.health(st)
    assert health.healthy == [True, True, True, False] and not health.rollback
    assert health.reasons[3] == "blown up: the local step guard reset it in the window"
    d = c.update(st, health)
    assert d.weights[3] == 0.0 and [a.kind for a in d.guard] == ["backoff"]
    assert c.drift["lr"][0] == pytest.approx(-(math.log(RHO[3]) - math.log(RHO[2])))
    # every replica reset: roll back
    st_all = WindowStats(**{**st.__dict__, "tripped": [True] * N})
    assert c.health(st_all).rollback


@pytest.mark.parametrize("tripped", [3, 1])
def test_trip_backoff_spread_cuts_a_rollbacks_worth_and_keeps_the_healthy_replicas(tripped):
    """trip_backoff="spread" (the default before round 8): a replica reset by the local guard cuts the LR drift by the
    multipliers' whole log range (a rollback's cut), whichever multiplier it had; "notch" backs
    off only when it had the highest LR. Either way no rollback: the healthy
    replicas keep their window."""
    flags = [r == tripped for r in range(N)]
    st = stats(windows([1.0, 1.0, 1.0, 1.0], noise=0.001, start=1.0))
    st = WindowStats(**{**st.__dict__, "tripped": flags})
    spread = controller(step_guard_scope="local", trip_backoff="spread")
    health = spread.health(st)
    assert not health.rollback and health.healthy == [not f for f in flags]
    d = spread.update(st, health)
    (backoff,) = d.guard
    assert backoff.kind == "backoff" and backoff.replicas == [tripped]
    assert "tripped the local step guard" in backoff.reason
    full = math.log(RHO[-1]) - math.log(RHO[0])  # log 3 at spread 0.5 (above min_backoff's log 2)
    assert spread.drift["lr"][0] == pytest.approx(-full) and backoff.drift_change == pytest.approx(-full)
    assert spread.guard_events == 1
    notch = controller(step_guard_scope="local", trip_backoff="notch")
    d = notch.update(st, notch.health(st))
    if tripped == N - 1:  # the highest LR: one notch
        assert notch.drift["lr"][0] == pytest.approx(-(math.log(RHO[3]) - math.log(RHO[2])))
    else:  # a lower multiplier blew up: no evidence against the base
        assert d.guard == [] and notch.drift["lr"][0] == 0.0
    # a rollback's cut is at least min_backoff
    wide = controller(step_guard_scope="local", trip_backoff="spread", min_backoff=4.0)
    wide.update(st, wide.health(st))
    assert wide.drift["lr"][0] == pytest.approx(-math.log(4.0))
    with pytest.raises(ValueError, match=r"trip_backoff in \('notch', 'spread', 'ramp'\), but got 'all'"):
        DriftController(step_guard_scope="local", trip_backoff="all")


def test_trip_backoff_ramp_adds_nothing_when_a_lower_replica_tripped_and_the_top_blew_up_at_the_sync():
    """Replica 0 (lowest LR) tripped the local guard; replica 3 (highest) was only found blown up by
    the sync guard: one notch, as for any blow-up, and no ramp-up term (that is for trips of the
    top replica); with the default edge_backoff="sync" the sync guard's blow-up of the top replica
    aims the peak's base at half its LR instead."""
    losses = windows([1.0, 1.0, 1.0, 5.0], noise=0.001, start=1.0)
    st = stats(losses, refs={"lr": [0.02]}, peaks={"lr": [0.1]})
    st = WindowStats(**{**st.__dict__, "tripped": [True, False, False, False]})
    c = controller(step_guard_scope="local", edge_backoff="off")
    health = c.health(st)
    assert health.healthy == [False, True, True, False]
    c.update(st, health)
    assert c.drift["lr"][0] == pytest.approx(-(math.log(RHO[3]) - math.log(RHO[2])))
    default = controller(step_guard_scope="local")
    default.update(st, default.health(st))
    assert 0.1 * math.exp(default.drift["lr"][0]) == pytest.approx(st.values["lr"][3][0] / 2)


@pytest.mark.parametrize(("tripped", "ref", "peak"), [(3, 0.02, 0.1), (3, 0.1, 0.1), (3, 0.05, 0.04), (1, 0.02, 0.1)])
def test_trip_backoff_ramp_cuts_a_notch_plus_the_ramp_up_ahead(tripped, ref, peak):
    """trip_backoff="ramp" (the default since round 8): the top replica tripped during the ramp-up at OneCycle's LR
    ``ref`` with ``peak`` still ahead: the drift goes down one notch and by peak / ref, so the top
    multiplier at the peak runs at the highest LR a healthy replica used at the sync. After the
    peak (annealing: the highest LR ahead is the current one) only the notch; a lower multiplier's
    trip cuts nothing."""
    flags = [r == tripped for r in range(N)]
    st = stats(windows([1.0] * N, noise=0.001, start=1.0), refs={"lr": [ref]}, peaks={"lr": [max(ref, peak)]})
    st = WindowStats(**{**st.__dict__, "tripped": flags})
    c = controller(step_guard_scope="local")
    assert c.trip_backoff == "ramp"
    health = c.health(st)
    assert not health.rollback and health.healthy == [not f for f in flags]
    d = c.update(st, health)
    notch = math.log(RHO[3]) - math.log(RHO[2])
    if tripped != N - 1:
        assert d.guard == [] and c.drift["lr"][0] == 0.0 and c.guard_events == 0
        return
    expected = notch + math.log(max(ref, peak) / ref)
    (backoff,) = d.guard
    assert backoff.kind == "backoff" and "tripped the local step guard" in backoff.reason
    assert c.drift["lr"][0] == pytest.approx(-expected) and backoff.drift_change == pytest.approx(-expected)
    # the top multiplier at the peak ahead runs at the highest healthy LR of the sync
    healthy_top = max(v[0] for r, v in enumerate(st.values["lr"]) if not flags[r])
    assert max(ref, peak) * math.exp(c.drift["lr"][0]) * RHO[-1] == pytest.approx(healthy_top)
    # a replica that tripped on a NaN loss (its window holds it) is a blow-up all the same
    with_nan = st.losses.copy()
    with_nan[3, 5] = math.nan
    st_nan = WindowStats(**{**st.__dict__, "losses": with_nan, "sums": [float(row.sum()) for row in with_nan]})
    assert not math.isfinite(st_nan.window_losses[3])  # as the scheduler sums the window (NaN included)
    again = controller(step_guard_scope="local")
    assert again.health(st_nan).reasons[3].startswith("blown up: the local step guard")
    again.update(st_nan, again.health(st_nan))
    assert again.drift["lr"][0] == pytest.approx(-expected)
    # the cut survives a resume
    resumed = controller(step_guard_scope="local", trip_backoff="ramp")
    resumed.load_state_dict(c.state_dict())
    assert resumed.drift == c.drift and resumed.guard_events == 1


@pytest.mark.parametrize(("ref", "peak"), [(0.02, 0.1), (0.1, 0.1)])
@pytest.mark.parametrize("tripped", [False, True])
@pytest.mark.parametrize("rule", [True, "all", "sync"])
def test_edge_backoff_aims_the_peaks_base_at_half_the_lr_that_blew_up(ref, peak, tripped, rule):
    """edge_backoff="all" (True; round 12): the top replica blew up (found by the sync guard, or
    reset by the local step guard) at OneCycle's LR ``ref`` with ``peak`` ahead: the drift is cut so
    that the base at the peak is half the LR that replica used at the sync. "sync" (round 14): the
    same for a replica the sync guard found, a local trip keeps round 8's cut. Off, the sync guard
    cuts one notch (no ramp-up term) and a trip cuts round 8's notch plus ramp-up; after the peak the
    larger of the notch and log(2 / 1.5) applies. A blow-up below a healthy replica cuts nothing."""
    losses = windows([1.0, 1.0, 1.0, 1.0], noise=0.001, start=1.0)
    losses[3, 1:] = 5.0
    st = stats(losses, refs={"lr": [ref]}, peaks={"lr": [peak]})
    st = WindowStats(**{**st.__dict__, "tripped": [False, False, False, tripped]})
    edge, plain = controller(edge_backoff=rule), controller(edge_backoff=False)
    assert plain.edge_backoff == "off" and edge.edge_backoff == ("all" if rule is True else rule)
    assert DriftController().edge_backoff == "sync"  # the default since round 14
    for c in (edge, plain):
        c.update(st, c.health(st))
    notch, ramp = math.log(RHO[3] / RHO[2]), math.log(peak / ref)
    assert plain.drift["lr"][0] == pytest.approx(-(notch + (ramp if tripped else 0.0)))
    assert edge.guard_events == 1
    if rule == "sync" and tripped:  # a local trip: round 8's cut, as without the rule
        assert edge.drift["lr"][0] == pytest.approx(plain.drift["lr"][0])
        return
    blown_lr = st.values["lr"][3][0]  # the top replica's LR at the sync: ref * 1.5
    assert peak * math.exp(edge.drift["lr"][0]) == pytest.approx(blown_lr / 2)
    assert edge.drift["lr"][0] < plain.drift["lr"][0]  # log(2 / 1.5) > the notch (log(1.5 / 1.167))
    # a lower replica's blow-up: no cut with or without the rule
    low = losses[[3, 0, 1, 2]]
    st_low = stats(low, refs={"lr": [ref]}, peaks={"lr": [peak]})
    c = controller(edge_backoff=rule)
    d = c.update(st_low, c.health(st_low))
    assert c.health(st_low).healthy == [False, True, True, True] and d.guard == [] and c.drift["lr"][0] == 0.0


def test_edge_backoff_sync_cuts_for_the_sync_guards_blow_up_when_another_replica_tripped():
    """edge_backoff="sync" with trip_backoff="spread": replica 0 tripped the local guard (a rollback's
    cut, log 3) while the top replica was found blown up by the sync guard at OneCycle's LR 0.004
    with the peak 0.1 ahead: the edge cut (larger early in the ramp-up) applies to the top replica."""
    losses = windows([1.0, 1.0, 1.0, 5.0], noise=0.001, start=1.0)
    st = stats(losses, refs={"lr": [0.004]}, peaks={"lr": [0.1]})
    st = WindowStats(**{**st.__dict__, "tripped": [True, False, False, False]})
    sync = controller(step_guard_scope="local", trip_backoff="spread", edge_backoff="sync")
    off = controller(step_guard_scope="local", trip_backoff="spread", edge_backoff="off")
    for c in (sync, off):
        c.update(st, c.health(st))
    assert off.drift["lr"][0] == pytest.approx(-math.log(3.0))
    assert 0.1 * math.exp(sync.drift["lr"][0]) == pytest.approx(st.values["lr"][3][0] / 2)
    assert sync.drift["lr"][0] < off.drift["lr"][0]


@pytest.mark.parametrize(
    ("ref", "expected"), [(0.004, math.log(0.1 / 0.004) + math.log(2 / 1.5)), (0.05, math.log(3.0))]
)
@pytest.mark.parametrize("rule", ["all", "sync"])
def test_edge_backoff_rollback_cuts_the_larger_of_the_spread_and_the_half_edge(ref, expected, rule):
    """A rollback early in the ramp-up (OneCycle's LR 25x below its peak) cuts so far that the base at
    the peak is half the top replica's LR at the blow-up; later the spread's cut (log 3) is larger.
    Both rules act at every rollback; a bad value is refused, naming the argument."""
    with pytest.raises(ValueError, match=r"edge_backoff in \('off', 'sync', 'all'\) or a bool, but got 'local'"):
        DriftController(edge_backoff="local")
    st = stats(windows([5.0] * N, start=1.0), refs={"lr": [ref]}, peaks={"lr": [0.1]})
    c = controller(edge_backoff=rule)
    assert c.health(st).rollback
    (action,) = c.rolled_back(st).guard
    assert c.drift["lr"][0] == pytest.approx(-expected) and action.drift_change == pytest.approx(-expected)
    plain = controller(edge_backoff="off")
    plain.rolled_back(st)
    assert plain.drift["lr"][0] == pytest.approx(-math.log(3.0))


@pytest.mark.parametrize(
    ("kw", "shared", "scope"),
    [
        ({}, True, "all"),
        ({}, False, "local"),
        ({"rollback": False}, False, "all"),
        ({"step_guard_scope": "all"}, False, "all"),
    ],
)
def test_auto_scope_resolves_once_from_the_gradients_and_resumes_with_it(kw, shared, scope):
    if kw.get("rollback") is False:  # the local check needs the kept consensus: decided at once
        assert controller(**({"step_guard_scope": "auto"} | kw)).step_guard_scope == "all"
    c = controller(**({"step_guard_scope": "auto"} | kw))
    c.resolve_scope(shared)
    assert c.step_guard_scope == scope
    c.resolve_scope(not shared)  # decided once
    assert c.step_guard_scope == scope
    resumed = controller(**({"step_guard_scope": "auto"} | kw))
    resumed.load_state_dict(c.state_dict())
    assert resumed.step_guard_scope == scope
    explicit = controller(step_guard_scope="all")  # an explicit setting is the user's, whatever was saved
    explicit.load_state_dict(controller(step_guard_scope="local").state_dict())
    assert explicit.step_guard_scope == "all"


def test_gradient_fingerprints_tell_shared_from_independent_and_wait_on_nan():
    from hdet_track.converge import gradient_fingerprint, gradients_shared

    def model(seed: int, n_layers: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        params = [torch.nn.Parameter(torch.randn(7, 5)) for _ in range(n_layers)]
        sum((p**2).sum() for p in params).backward()
        return params

    shared = [gradient_fingerprint(model(0, 40)) for _ in range(4)]
    independent = [gradient_fingerprint(model(seed, 40)) for seed in range(4)]
    assert gradients_shared(shared) is True and gradients_shared(independent) is False
    # one length whatever the model (the rows of one all-gather must match): 2 + 16 tensors x 4 values
    assert {len(f) for f in shared + [gradient_fingerprint(model(0, 3))]} == {2 + 16 * 4}
    assert gradient_fingerprint(model(0, 3))[:2] == [3.0, 12.0]
    params = model(0, 40)
    exact = gradient_fingerprint(params)[2:6]
    first = params[0].grad.reshape(-1)
    assert exact == [float(first[i]) for i in (0, 11, 23, 34)]  # values read, not reduced
    with_nan = [list(f) for f in shared]
    with_nan[1][5] = math.nan  # NaN != NaN must not read as "different gradients"
    assert gradients_shared(with_nan) is None
    no_grads = [gradient_fingerprint([torch.nn.Parameter(torch.ones(3))])] + shared[1:]
    assert gradients_shared(no_grads) is None  # a rank without gradients: not yet
    zeroed = [[f[0], f[1]] + [0.0] * (len(f) - 2) for f in shared]
    assert gradients_shared(zeroed) is None  # gradients zeroed before sched.step: not yet
    sparse = torch.nn.Parameter(torch.ones(4, 3))
    sparse.grad = torch.ones(4, 3).to_sparse()
    assert gradient_fingerprint([sparse] + params)[0] == 40.0  # sparse gradients are skipped, not a crash


def test_one_shared_gradient_tensor_reads_as_shared_and_zeros_do_not():
    """Under DDP a parameter outside the wrapper (or a per-rank term in ``.grad``) holds per-rank
    gradients; the wrapped ones are still shared, and reading the run as independent would pick the
    local guard, unsafe with shared gradients. A tensor of zeros agrees on every rank by nature."""
    from hdet_track.converge import gradient_fingerprint, gradients_shared

    def grads(seeds: list[int], numel: int = 35) -> list[torch.Tensor]:
        params = []
        for seed in seeds:
            torch.manual_seed(seed)
            params.append(torch.nn.Parameter(torch.randn(numel)))
        sum((p**3).sum() for p in params).backward()
        return params

    wrapped_and_not = [gradient_fingerprint(grads([0] * 20 + [rank + 1] * 20)) for rank in range(4)]
    assert gradients_shared(wrapped_and_not) is True
    independent = [gradient_fingerprint(grads([10 * rank + i for i in range(40)])) for rank in range(4)]
    assert gradients_shared(independent) is False
    zero_tensor = []
    for rank in range(4):
        params = grads([10 * rank + i for i in range(40)])
        params[0].grad.zero_()  # e.g. an unused embedding row block: zeros everywhere
        zero_tensor.append(gradient_fingerprint(params))
    assert gradients_shared(zero_tensor) is False
    other_model = [gradient_fingerprint(grads([0] * 39))] + [gradient_fingerprint(grads([0] * 40))] * 3
    assert gradients_shared(other_model) is None  # a parameter used on some ranks only: undecided, not "independent"
    tiny = grads([0], numel=2)  # positions repeat in a tensor smaller than 4 values
    g = tiny[0].grad
    assert gradient_fingerprint(tiny)[:6] == [1.0, 4.0, float(g[0]), float(g[0]), float(g[1]), float(g[1])]
    # a non-contiguous gradient (a transposed view) is read at the same logical positions, without a copy
    torch.manual_seed(3)
    strided, dense = torch.nn.Parameter(torch.ones(5, 7)), torch.nn.Parameter(torch.ones(5, 7))
    strided.grad = torch.randn(7, 5).t()
    dense.grad = strided.grad.contiguous()
    assert not strided.grad.is_contiguous()
    assert gradient_fingerprint([strided]) == gradient_fingerprint([dense])
    scalar = torch.nn.Parameter(torch.tensor(2.0))
    scalar.grad = torch.tensor(0.25)
    assert gradient_fingerprint([scalar])[:6] == [1.0, 4.0, 0.25, 0.25, 0.25, 0.25]


def test_a_custom_controller_with_auto_scope_resolves_once_and_checks_its_own_step():
    """A subclass of the base ``Controller`` that asks for ``"auto"`` resolves it like the drift
    controller (local only with a kept consensus), and its local check is its own check_step."""

    class Mine(Controller):
        step_guard = 5.0
        step_guard_scope = "auto"

        def __init__(self, rollback: bool) -> None:
            self.rollback = rollback

        def check_step(self, losses, firsts):
            return "high" if max(losses) > self.step_guard * min(firsts) else None

    independent, no_consensus, shared = Mine(True), Mine(False), Mine(True)
    independent.resolve_scope(False)
    no_consensus.resolve_scope(False)
    shared.resolve_scope(True)
    assert (independent.step_guard_scope, no_consensus.step_guard_scope, shared.step_guard_scope) == (
        "local",
        "all",
        "all",
    )
    independent.resolve_scope(True)  # decided once
    assert independent.step_guard_scope == "local"
    assert independent.check_own_step(6.0, 1.0) == "high" and independent.check_own_step(4.0, 1.0) is None


@pytest.mark.parametrize("scale", [1.0, 1000.0])
def test_guard_floor_ignores_ratio_noise_near_zero_loss_but_not_a_blow_up(scale):
    """guard_floor (round 9, the default 0.5 since round 10): a loss counts as blown up only above guard_floor x the run's starting
    loss (the first window's median first loss). Near zero, one hard batch is 10x the window's
    first loss and one window 2x another: noise, not a blow-up. Scale-free: losses x1000 decide alike."""
    first = stats(windows([2.3, 2.3, 2.3, 2.3], noise=0.01, start=2.3) * scale)
    late = windows([0.01, 0.01, 0.01, 0.05], noise=0.001, start=0.01) * scale
    for floor, expect_blown in ((None, True), (0.5, False)):
        c = controller(guard_floor=floor, step_guard_scope="local")
        c.update(first, c.health(first))  # the run's first window: L0 = 2.3 (x scale)
        h = c.health(stats(late))
        assert h.healthy[3] is not expect_blown  # 0.05 > 2 x 0.01: blown only without the floor
        assert (c.check_step([0.3 * scale] * N, [0.02 * scale] * N) is not None) is expect_blown
        assert (c.check_own_step(0.3 * scale, 0.02 * scale) is not None) is expect_blown
        # a real blow-up (above half the starting loss) and a non-finite loss count either way
        assert c.check_step([5.0 * scale] + [0.02 * scale] * 3, [0.02 * scale] * N) is not None
        assert c.check_own_step(5.0 * scale, 0.02 * scale) is not None
        assert c.check_own_step(math.nan, 0.02 * scale) is not None
        assert not c.health(stats(windows([0.01, 0.01, 0.01, 5.0], noise=0.001, start=0.01) * scale)).healthy[3]
    # the starting loss is kept in the state: a resumed controller judges alike
    c = controller(guard_floor=0.5)
    c.health(first)
    resumed = controller(guard_floor=0.5)
    resumed.load_state_dict(c.state_dict())
    assert resumed.check_own_step(0.3 * scale, 0.02 * scale) is None
    # before the first sync the starting loss is the window's own first: the 10x test decides
    assert controller(guard_floor=0.5).check_own_step(0.3 * scale, 0.02 * scale) is not None
    assert controller().guard_floor == DriftController().guard_floor == 0.5  # the default (round 10)
    with pytest.raises(ValueError, match="guard_floor"):
        DriftController(guard_floor=-1.0)


def test_a_guard_storm_warns_once_and_names_guard_floor(caplog):
    """The guard acting at 5 syncs in a row (as on a small dataset near zero loss) earns one
    warning that points to guard_floor; a sync without a guard action starts the count again."""
    import logging

    blown = stats(windows([1.0, 1.0, 1.0, 5.0], noise=0.001, start=1.0))
    calm = stats(windows([1.0, 1.0, 1.0, 1.0], noise=0.001, start=1.0))
    c = controller()
    with caplog.at_level(logging.WARNING, logger="hdet_track.controller"):
        for st in [blown] * 4 + [calm] + [blown] * 4:
            c.update(st, c.health(st))
        assert not caplog.records  # never 5 in a row
        for _ in range(3):
            c.update(blown, c.health(blown))
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "5 syncs in a row" in warned[0] and "guard_floor" in warned[0]
    # resumed from a checkpoint: the count goes on (4 in a row, then one more warns) and a warning
    # given before the checkpoint is not given again
    caplog.clear()
    counting, warned_before = controller(), controller()
    for st in [blown] * 4:
        counting.update(st, counting.health(st))
    for st in [blown] * 5 + [calm] + [blown] * 4:  # warned, then 4 in a row again
        warned_before.update(st, warned_before.health(st))
    caplog.clear()
    done = controller()
    done.load_state_dict(warned_before.state_dict())
    resumed = controller()
    resumed.load_state_dict(counting.state_dict())
    with caplog.at_level(logging.WARNING, logger="hdet_track.controller"):
        for ctrl in (resumed, done):
            ctrl.update(blown, ctrl.health(blown))
    assert len(caplog.records) == 1 and "5 syncs in a row" in caplog.records[0].getMessage()


def test_revert_unconfirmed_shared_takes_back_only_under_shared_gradients():
    """revert_unconfirmed="shared" (round 17): with gradients found shared it is revert_unconfirmed=True;
    with independent replicas, or before the scheduler has told, it is the default; the finding is
    in the state, and a bad value is refused naming the argument."""
    up, flat = windows([1.0, 0.98, 0.96, 0.94], seed=0), windows([1.0] * N, noise=0.01, seed=5)

    def run(c, told=None):
        if told is not None:
            c.resolve_scope(told)
        for k, w in enumerate([up, flat], 1):
            st = stats(w, step=T * k, c=c)
            c.update(st, c.health(st))
        return c

    revert, plain = run(controller(skip_windows=1, revert_unconfirmed=True)), run(controller())
    assert revert.drift != plain.drift
    assert run(controller(skip_windows=1, revert_unconfirmed="shared"), told=True).drift == revert.drift
    for told in (False, None):
        c = run(controller(skip_windows=1, revert_unconfirmed="shared"), told=told)
        assert c.drift == plain.drift and c.state_dict()["evidence"] == plain.state_dict()["evidence"]
    # told between the syncs of a resumed job: the finding comes back with the state
    a = controller(skip_windows=1, revert_unconfirmed="shared")
    a.resolve_scope(True)
    st = stats(up, step=T, c=a)
    a.update(st, a.health(st))
    b = controller(skip_windows=1, revert_unconfirmed="shared")
    b.load_state_dict(a.state_dict())
    assert b.shared_gradients is True and b.step_guard_scope == "all"
    for c in (a, b):
        st = stats(flat, step=2 * T, c=c)
        c.update(st, c.health(st))
    assert a.drift == b.drift == revert.drift
    with pytest.raises(ValueError, match=r"revert_unconfirmed in \(False, True, 'shared'\) or None, but got 'ddp'"):
        DriftController(skip_windows=1, revert_unconfirmed="ddp")


def test_the_first_window_defaults_are_round_17s():
    """Since round 17: the first window is provisional and taken back under shared gradients unless
    the second confirms it; holding it (confirm_skipped) turns the take-back off by default."""
    c = DriftController()
    assert (c.evidence.skip_windows, c.revert_unconfirmed, c.evidence.revert_unconfirmed) == (1, "shared", True)
    held = DriftController(confirm_skipped=True)
    assert (held.revert_unconfirmed, held.evidence.confirm_skipped) == (False, True)


@pytest.mark.parametrize("given", [True, False])
def test_a_rollback_without_the_model_says_that_its_buffers_were_not_restored(given, caplog):
    """An audit's finding: a rollback restores what the scheduler averages. Without ``model=`` that
    is the optimizer's parameters: BatchNorm's running statistics kept the blow-up's NaN, and the
    model evaluated to NaN for the rest of the run, without a word. With ``model=`` they are
    restored; without it the first rollback now says so."""
    from torch import nn

    from hdet_track import HDETScheduler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = HDETScheduler(opt, 0.05, total_steps=20, sync_every=5, auto_lr=True, **({"model": model} if given else {}))
    rolled = []
    with caplog.at_level("WARNING", logger="hdet_track"):
        for step in range(20):
            x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
            if step == 6:
                x = x * float("nan")
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step(loss.detach())
            if sched.last_sync is not None and sched.last_sync.rolled_back:
                rolled.append(sched.last_sync.step)
    assert rolled  # the guard rolled back
    said = [r.getMessage() for r in caplog.records if "model=" in r.getMessage()]
    assert bool(torch.isfinite(model[1].running_mean).all()) is given
    if given:
        assert said == []
    else:
        assert len(said) == 1 and "buffers" in said[0], said  # once, naming what to pass

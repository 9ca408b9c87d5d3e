"""HDETScheduler in one process: OneCycleLR parity, state, explored hyperparameters, bad input."""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR

import hdet_track
from hdet_track import HDETScheduler, NonFiniteReplicasError, explore, warm_noisy_init
from hdet_track.controller import DriftController
from hdet_track.errors import CheckpointMismatchError


def make(opt: str = "sgd", groups: int = 3, seed: int = 0, **opt_kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.Linear(4, 4), nn.Linear(4, 2))
    layers = [model[0], model[2], model[3]][:groups]
    params = [{"params": layer.parameters()} for layer in layers]
    if opt == "sgd":
        return model, torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, **opt_kw)
    return model, torch.optim.AdamW(params, lr=0.1, **opt_kw)


def quiet(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HDETScheduler(**kw)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"anneal_strategy": "linear"},
        {"three_phase": True},
        {"cycle_momentum": False},
        {"pct_start": 0.1, "div_factor": 10.0, "final_div_factor": 100.0},
    ],
)
def test_bit_identical_to_onecycle(opt, kw):
    _, o1 = make(opt)
    _, o2 = make(opt)
    ref = OneCycleLR(o1, [0.1, 0.2, 0.3], total_steps=57, **kw)
    hdet = HDETScheduler(o2, [0.1, 0.2, 0.3], total_steps=57, sync_every=5, **kw)
    assert isinstance(hdet, OneCycleLR)
    key = "betas" if opt == "adam" else "momentum"
    for _ in range(57):
        for g1, g2 in zip(o1.param_groups, o2.param_groups):
            assert g1["lr"] == g2["lr"] and type(g2["lr"]) is float
            assert g1[key] == g2[key]
        assert ref.get_last_lr() == hdet.get_last_lr()
        o1.step()
        o2.step()
        ref.step()
        hdet.step(1.0)


def test_epochs_and_steps_per_epoch_as_in_onecycle():
    _, o = make()
    s = HDETScheduler(o, 0.1, epochs=3, steps_per_epoch=7)
    assert s.total_steps == 21
    with pytest.raises(ValueError, match="total_steps OR"):
        HDETScheduler(make()[1], 0.1)


def test_tensor_lr_stays_a_tensor():
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9)
    s = HDETScheduler(opt, 0.2, total_steps=10, sync_every=3)
    for _ in range(10):
        opt.step()
        s.step(0.5)
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


def test_never_touches_global_rng():
    model, opt = make()
    state = torch.get_rng_state()
    s = quiet(
        optimizer=opt,
        max_lr=0.1,
        total_steps=40,
        spread=0.3,
        sync_every=4,
        auto_lr=True,
        explore=[explore.dropout(model, 0.5)],
        model=model,
    )
    for _ in range(40):
        opt.step()
        s.step(1.0)
    assert torch.equal(state, torch.get_rng_state())


def test_equal_losses_shrink_base_by_div_over_final_div():
    """With identical losses the controller only decays: after K syncs base * (div / final_div)."""
    _, opt = make(groups=1)
    total, warm, T = 1000, 200, 50
    s = HDETScheduler(
        opt,
        0.1,
        total_steps=total,
        sync_every=T,
        auto_lr=True,
        controller="paper",
        auto_lr_warmup=warm,
        lr_bounds=(1e-9, 1.0),
    )
    first_base = None
    bases = []
    for k in range(1, total + 1):
        opt.step()
        s.step(1.0)
        if s.last_sync is not None and s.last_sync.step == k and s.last_sync.updates:
            u = s.last_sync.updates["lr"][0]
            first_base = u.base_before if first_base is None else first_base
            bases.append(u.base_after)
            assert u.delta == 0.0 and u.base_after < u.base_before
    assert len(bases) == (total - warm) // T + 1  # syncs at 200, 250, ..., 1000
    # K = (total - warm) / T = 16 decays take the base from its first value down by 25 / 1e4.
    assert bases[-2] == pytest.approx(first_base * 25 / 1e4, rel=1e-9)
    # Between syncs after warmup the LR is held.
    assert opt.param_groups[0]["lr"] == bases[-1]


def test_lr_held_between_syncs_after_warmup():
    _, opt = make(groups=1)
    s = HDETScheduler(opt, 0.1, total_steps=100, sync_every=10, auto_lr=True, controller="paper", auto_lr_warmup=20)
    lrs = []
    for _ in range(60):
        opt.step()
        s.step(1.0)
        lrs.append(opt.param_groups[0]["lr"])
    assert len(set(lrs[20:29])) == 1 and len(set(lrs[30:39])) == 1
    assert len(set(lrs[:19])) > 10  # OneCycle moves every step before warmup


@pytest.mark.parametrize("controller", ["paper", "drift"])
def test_state_dict_round_trip_resumes_exactly(controller):
    def run(stop_at=None, state=None):
        model, opt = make(groups=2)
        s = quiet(
            optimizer=opt,
            max_lr=[0.1, 0.05],
            total_steps=50,
            spread=0.2,
            sync_every=7,
            auto_lr=True,
            controller=controller,
            auto_lr_warmup=10,
            explore={"weight_decay": 0.3},
            model=model,
        )
        start = 0
        if state is not None:
            s.load_state_dict(state["sched"])
            start = state["k"]
        out = []
        for k in range(start, 50):
            opt.step()
            s.step(1.0 + 0.1 * math.sin(k))
            out.append([g["lr"] for g in opt.param_groups] + [g["weight_decay"] for g in opt.param_groups])
            if stop_at is not None and k + 1 == stop_at:
                buf = io.BytesIO()
                torch.save({"sched": s.state_dict(), "k": k + 1}, buf)
                buf.seek(0)
                return out, torch.load(buf, weights_only=True)
        return out, None

    full, _ = run()
    head, ckpt = run(stop_at=23)
    tail, _ = run(state=ckpt)
    assert head + tail == full
    older = {k: v for k, v in ckpt["sched"].items() if k not in ("owns_lr", "explored_shared", "onecycle_lrs")}
    tail, _ = run(state={"sched": older, "k": 23})  # a checkpoint of before these keys resumes as before
    assert head + tail == full


def test_load_state_dict_rejects_other_world_or_explore():
    from hdet_track import CheckpointMismatchError

    _, opt = make()
    s = HDETScheduler(opt, 0.1, total_steps=10)
    state = s.state_dict()
    bad = dict(state, world_size=4)
    with pytest.raises(CheckpointMismatchError, match="4"):
        HDETScheduler(make()[1], 0.1, total_steps=10).load_state_dict(bad)
    with pytest.raises(CheckpointMismatchError, match="weight_decay"):
        HDETScheduler(make()[1], 0.1, total_steps=10, explore={"weight_decay": 0.1}).load_state_dict(state)


def test_load_state_dict_rejects_other_explored_targets_or_bounds():
    """A model that gained a Dropout (the same state_dict keys) failed half-way with an IndexError,
    one that lost one loaded in silence; other bounds of an explored hyperparameter loaded in silence
    and clipped the replicas differently. Both are named, before anything is applied."""
    from hdet_track import CheckpointMismatchError

    def build(dropouts, bounds=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), *[nn.Dropout(0.1) for _ in range(dropouts)], nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-3)
        return opt, quiet(
            optimizer=opt, max_lr=0.1, total_steps=10, auto_lr=True,
            explore=[explore.dropout(model, 0.5), explore.param_group("weight_decay", 0.5, bounds=bounds)],
        )  # fmt: skip

    opt, sched = build(1)
    for k in range(1, 4):
        opt.step()
        sched.step(1.0 / k)
    state = sched.state_dict()
    with pytest.raises(CheckpointMismatchError, match=r"explored_targets is \{'lr': 1, 'dropout': 2, "):
        build(2)[1].load_state_dict(state)
    with pytest.raises(CheckpointMismatchError, match=r"explore_bounds is .*'weight_decay': \[0.0, 0.0012\]"):
        build(1, bounds=(0.0, 1.2e-3))[1].load_state_dict(state)
    build(1)[1].load_state_dict(state)  # the same job loads it


@pytest.mark.parametrize(
    ("other", "pattern"),
    [
        ({"sync_every": 4}, r"sync_every is 4 here and 5 in the checkpoint"),
        ({"max_lr": 0.2}, r"max_lr is \[0.2, 0.2, 0.2\] here and \[0.1, 0.1, 0.1\] in the checkpoint"),
        ({"total_steps": 45}, r"total_steps is 45 here and 60 in the checkpoint"),
        ({"spread": 0.1}, r"spreads is \{'lr': 0.1\} here and \{'lr': 0.3\} in the checkpoint"),
        ({"groups": 2}, r"param_groups is 2 here and 3 in the checkpoint"),
        ({"controller": DriftController(rollback=False)}, r"controller rollback is False here and True in"),
        ({"controller": DriftController(revert_unconfirmed=False)}, r"controller revert_unconfirmed is False here"),
        ({"auto_lr_warmup": 10}, r"controller warmup is 10 here and 0 in the checkpoint"),
        # the schedule's shape: before, these loaded and silently changed the trajectory
        ({"div_factor": 5.0}, r"div_factor is 5.0 here and 25.0 in the checkpoint"),
        ({"final_div_factor": 100.0}, r"final_div_factor is 100.0 here and 10000.0 in the checkpoint"),
        ({"lr_bounds": (1e-4, 0.5)}, r"lr_bounds is \[\[0.0001, 0.5\], .* here and \[\[4e-07, 1.0\], "),
        ({"pct_start": 0.25}, r"pct_start is 0.25 here and 0.3 in the checkpoint"),
        ({"anneal_strategy": "linear"}, r"anneal_strategy is 'linear' here and 'cos' in the checkpoint"),
        ({"three_phase": True}, r"three_phase is True here and False in the checkpoint"),
        ({"max_momentum": 0.9}, r"max_momentum is 0.9 here and 0.95 in the checkpoint"),
    ],
)
def test_load_state_dict_rejects_a_job_with_other_settings(other, pattern):
    from hdet_track import CheckpointMismatchError

    def build(groups=3, total_steps=60, sync_every=5, max_lr=0.1, **kw):
        return HDETScheduler(
            make(groups=groups)[1], max_lr, total_steps=total_steps, auto_lr=True, sync_every=sync_every, **kw
        )

    saved = build(spread=0.3)
    for _ in range(7):
        saved.optimizer.step()
        saved.step(1.0)
    state = saved.state_dict()
    with pytest.raises(CheckpointMismatchError, match=pattern):
        build(**{"spread": 0.3, **other}).load_state_dict(state)
    build(spread=0.3).load_state_dict(state)  # the same settings load


def test_a_setting_given_as_a_tuple_or_a_list_resumes_alike():
    def build(momentum):
        return HDETScheduler(make(groups=3)[1], 0.1, total_steps=60, sync_every=5, base_momentum=momentum)

    state = build((0.85, 0.8, 0.85)).state_dict()
    build([0.85, 0.8, 0.85]).load_state_dict(state)  # refused before: "base_momentum is [...] here and (...)"


def test_explored_bases_come_from_the_checkpoint_not_from_an_optimizer_loaded_first():
    # A rank whose optimizer state was loaded before the scheduler was built holds its own value
    # (base x its multiplier), not the base: the checkpoint's starting bases must win.
    _, opt = make(groups=1)
    first = HDETScheduler(opt, 0.1, total_steps=20, explore={"weight_decay": 0.5})
    state = first.state_dict()
    _, other = make(groups=1)
    other.param_groups[0]["weight_decay"] = 1.5e-4  # what a replica at multiplier 1.5 held
    resumed = HDETScheduler(other, 0.1, total_steps=20, explore={"weight_decay": 0.5})
    resumed.load_state_dict(state)
    assert resumed.base_values("weight_decay") == [1e-4]
    assert other.param_groups[0]["weight_decay"] == 1e-4  # a world of one: multiplier 1


def test_explored_values_written_to_targets():
    model, opt = make(groups=2)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
    box = {"v": 2.0}
    hps = [
        explore.param_group("weight_decay", 0.5),
        explore.dropout(model, 0.5),
        explore.module_attr("label_smoothing", loss_fn, "label_smoothing", 0.2, bounds=(0.0, 0.5)),
        explore.setter("custom", lambda: box["v"], lambda v: box.__setitem__("v", v), 0.1),
    ]
    s = quiet(optimizer=opt, max_lr=0.1, total_steps=10, explore=hps)
    assert s.explored_names == ["lr", "weight_decay", "dropout", "label_smoothing", "custom"]
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 1e-4]
    assert model[1].p == 0.1 and loss_fn.label_smoothing == 0.1 and box["v"] == 2.0


def test_betas_entry_explored_with_adam():
    _, opt = make("adam", groups=1)
    s = HDETScheduler(opt, 0.1, total_steps=10, explore={"betas.1": 0.001})
    assert opt.param_groups[0]["betas"][1] == 0.999
    assert s.replica_values("betas.1") == [[0.999]]


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"spread": 1.0}, r"spread in \[0, 1\), but got 1.0"),
        ({"spread": -0.1}, r"spread in \[0, 1\)"),
        ({"sync_every": 0}, "sync_every to be an integer >= 1, but got 0"),
        ({"sync_every": 2.5}, "sync_every"),
        ({"temperature": 0.0}, r"temperature in \(0.0, inf\), but got 0.0"),
        ({"temperature": -1}, "temperature"),
        ({"meta_momentum": 1.0}, r"meta_momentum in \[0.0, 1.0\), but got 1.0"),
        ({"meta_lr": -0.5}, "meta_lr"),
        ({"auto_lr_warmup": 11}, r"auto_lr_warmup to be an integer in \[0, total_steps=10\], but got 11"),
        ({"auto_lr_warmup": -1}, "auto_lr_warmup"),
        ({"explore": {"weight_decayy": 0.1}}, "'weight_decayy'.*matches nothing"),
        ({"explore": {"weight_decay": {"spread": 0.1, "bounds": (0.1, 0.2)}}}, "exclude"),
        ({"explore": {"weight_decay": 1.5}}, r"spread in \[0, 1\)"),
        ({"explore": {"momentum": 0.1}}, "cycle_momentum"),
        ({"explore": "weight_decay"}, "explore as a dict"),
        ({"lr_bounds": (0.2, 1.0)}, "contain the base max_lr 0.1"),
        ({"lr_bounds": (0.5, 0.1)}, "low < high"),
        ({"lr_bounds": [(0.0, 1.0)] * 2}, "one \\(low, high\\) per param group"),
        ({"track": "bogus"}, "tracker name in \\['mlflow', 'wandb'\\], but got 'bogus'"),
        ({"track": 3}, "Expected track to be True, False"),
        ({"log_every": 0}, "log_every to be an integer >= 1, but got 0"),
        ({"seed": 1.5}, "seed"),
        ({"max_lr": -0.1}, r"max_lr in \(0.0, inf\), but got -0.1"),
        ({"max_lr": 0.0}, r"max_lr in \(0.0, inf\), but got 0.0"),
        ({"max_lr": math.nan}, r"max_lr in \(0.0, inf\), but got nan"),
        ({"max_lr": [0.1, math.inf, 0.1]}, r"max_lr\[1\] in \(0.0, inf\), but got inf"),
        ({"controller": "drfit"}, r"controller to be one of \['drift', 'paper'\] or a Controller, but got 'drfit'"),
        (
            {"auto_lr": True, "temperature": 0.3},
            r"temperature=0.3 only with controller='paper', but got controller='drift'",
        ),
        ({"auto_lr": True, "meta_lr": 1.0, "meta_momentum": 0.5}, r"meta_lr=1.0, meta_momentum=0.5 only with"),
        ({"auto_lr": True, "controller": DriftController(), "auto_lr_warmup": 5}, "auto_lr_warmup=5 only with"),
        ({"explore": {"dampening": 0.5}}, r"explore\['dampening'\] to start from a nonzero value, but it is 0 in pg0"),
        ({"explore": {"max_lr": 0.5}}, r"explore key 'max_lr' .* one of OneCycle's own schedule keys"),
        ({"explore": {"initial_lr": 0.5}}, r"explore key 'initial_lr' .* OneCycle's own"),
        # strings that would read as True, and names a backend would refuse at the run's start
        ({"average_buffers": "no"}, "average_buffers to be a bool, but got 'no'"),
        ({"track": "mlflow", "close_at_end": "false"}, "close_at_end to be a bool, but got 'false'"),
        ({"compare_group": 5}, "compare_group to be a str or None, but got 5"),
        ({"run_name": ["a"]}, r"run_name to be a str or None, but got \['a'\]"),
    ],
)
def test_bad_arguments_name_argument_value_and_range(kw, pattern):
    _, opt = make(groups=3)
    before = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    kw = {"max_lr": 0.1, **kw}
    with pytest.raises(ValueError, match=pattern):
        HDETScheduler(opt, total_steps=10, **kw)
    # nothing was touched: OneCycleLR rewrites the param groups only once every argument is valid
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == before


def test_settings_that_do_apply_are_accepted():
    # the paper controller's settings with the paper controller, or with no controller running (an
    # ablation's arms share their arguments); auto_lr_warmup also serves the drift controller by name
    HDETScheduler(make()[1], 0.1, total_steps=10, auto_lr=True, controller="paper", temperature=0.3, meta_lr=1.0)
    HDETScheduler(make()[1], 0.1, total_steps=10, auto_lr=False, temperature=0.3, auto_lr_warmup=5)
    s = HDETScheduler(make()[1], 0.1, total_steps=10, auto_lr=True, auto_lr_warmup=5)
    assert s.controller.warmup == 5
    # weight decay 0 in some param groups (biases, norms) and not in others: those groups keep 0
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "weight_decay": 0.0}, {"params": model[1].parameters()}],
        lr=0.1,
        weight_decay=1e-3,
    )
    HDETScheduler(opt, 0.1, total_steps=10, explore={"weight_decay": 0.5})


@pytest.mark.parametrize(
    ("kw", "error", "pattern"),
    [
        ({"callbacks": [1]}, TypeError, r"callbacks\[0\] to be a SchedulerCallback .* but got 1"),
        ({"callbacks": "recorder"}, TypeError, "callbacks to be an iterable of SchedulerCallback objects"),
        (
            {"process_group": "x"},
            TypeError,
            "process_group to be a torch.distributed.ProcessGroup or None, but got 'x'",
        ),
    ],
)
def test_bad_objects_fail_at_construction_not_at_the_first_step(kw, error, pattern):
    with pytest.raises(error, match=pattern):
        HDETScheduler(make()[1], 0.1, total_steps=10, **kw)


@pytest.mark.parametrize("name", ["rollback", "one_sided", "ceiling", "confirm_skipped"])
def test_drift_controller_switches_must_be_bools(name):
    with pytest.raises(ValueError, match=f"{name} to be a bool, but got 'no'"):
        DriftController(**{name: "no"})  # "no" would read as True


def test_metric_names_follow_the_backends_own_rules():
    """HDET's own series are refused everywhere (they would mix with the run's); MLflow's name rule
    applies only when the job is tracked to MLflow (W&B takes 'acc@1')."""
    untracked = HDETScheduler(make()[1], 0.1, total_steps=10, compare_group="", run_name="")  # "": none
    untracked.log_metrics({"acc@1": 0.5, "top-1 (%)": torch.tensor(0.5)})
    for reserved in ("loss", "lr", "hdet/x"):
        with pytest.raises(ValueError, match=f"other than HDET's own series .* but got '{reserved}'"):
            untracked.log_metrics({reserved: 0.5})


def test_load_state_dict_of_something_else_names_what_it_expects():
    sched = HDETScheduler(make()[1], 0.1, total_steps=10)
    for bad in (None, [1]):
        with pytest.raises(TypeError, match=r"state_dict to be a dict from HDETScheduler.state_dict\(\), but got"):
            sched.load_state_dict(bad)


def test_dropout_explore_without_dropout_modules_is_an_error():
    with pytest.raises(ValueError, match="matches nothing"):
        HDETScheduler(make()[1], 0.1, total_steps=10, explore=[explore.dropout(nn.Linear(2, 2), 0.2)])


def test_step_loss_validation():
    _, opt = make()
    s = HDETScheduler(opt, 0.1, total_steps=10, auto_lr=True)
    opt.step()
    with pytest.raises(ValueError, match="no loss"):
        s.step()
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        s.step(torch.ones(3))
    with pytest.raises(ValueError, match="str"):
        s.step("1.0")
    s.step(torch.tensor(1.0, requires_grad=True))  # detached, accepted


def test_single_process_warns_once_and_nonfinite_raises():
    model, opt = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = HDETScheduler(opt, 0.1, total_steps=10, spread=0.2, sync_every=3)
        for _ in range(2):
            opt.step()
            s.step(float("nan"))
    assert sum("single replica" in str(w.message) for w in caught) == 1
    opt.step()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")  # diverged: nothing to reset it from
    with pytest.raises(NonFiniteReplicasError, match="step 3"):
        s.step(1.0)


@pytest.mark.parametrize("controller", [None, "paper"])
def test_a_non_finite_loss_with_finite_parameters_is_no_divergence(controller):
    """A step whose loss is inf or NaN while the parameters stay finite (a step that fp16's
    GradScaler skipped, a NaN batch the loop stepped over) makes every window loss non-finite;
    with no rollback to fall back on, HDET used to raise at the sync where OneCycleLR goes on. The
    replicas are averaged as they are, with a warning; the LRs stay OneCycleLR's (the controller
    does not move at that sync), and the record leaves no replica out."""
    from torch.optim.lr_scheduler import OneCycleLR

    model, opt = make()
    ref_model, ref_opt = make()
    kw = dict(auto_lr=True, controller="paper", auto_lr_warmup=0) if controller else {}
    s = HDETScheduler(opt, 0.1, total_steps=12, sync_every=3, model=model, **kw)
    ref = OneCycleLR(ref_opt, 0.1, total_steps=12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(1, 13):
            opt.step()
            ref_opt.step()
            s.step(math.inf if k == 2 else 1.0)
            ref.step()
            if k == 3:  # no replica left out; the guard's record says what happened; no controller move
                rec = s.last_sync
                assert rec.left_out == [] and rec.step == 3 and rec.updates == {} and rec.weights is None
                assert [(g.kind, g.replicas) for g in rec.guard] == [("averaged", [0])]
            elif k % 3 == 0 and controller:
                assert s.last_sync.updates  # the paper controller decides at the other syncs
            if not controller:
                assert s.get_last_lr() == ref.get_last_lr()
    said = [str(w.message) for w in caught if "window loss is non-finite" in str(w.message)]
    assert len(said) == 1 and "step 3" in said[0], said
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if controller:  # it moved at the syncs after the skipped one
        assert s.base_values() != ref.get_last_lr()


def test_warm_noisy_init_scale_and_determinism():
    a = nn.Linear(200, 100)
    b = nn.Linear(200, 100)
    b.load_state_dict(a.state_dict())
    w0 = a.weight.detach().clone()
    warm_noisy_init(a, nu=0.1, seed=3)
    warm_noisy_init(b, nu=0.1, seed=3)
    assert torch.equal(a.weight, b.weight)
    noise = a.weight.detach() - w0
    expected_std = 0.1 * float(w0.norm()) / math.sqrt(w0.numel())
    assert float(noise.std()) == pytest.approx(expected_std, rel=0.05)
    with pytest.raises(ValueError, match="nu >= 0"):
        warm_noisy_init(a, nu=-1)


def test_step_guard_out_of_rollbacks_says_why_not_non_finite():
    """A finite blow-up that the step guard keeps rolling back: after max_rollbacks in a row the
    error names the guard's reason and the rollbacks, not "non-finite"."""
    from hdet_track.controller import DriftController

    model, opt = make()
    s = HDETScheduler(
        opt, 0.1, total_steps=20, sync_every=10, auto_lr=True, model=model,
        controller=DriftController(step_guard=10.0, max_rollbacks=2),
    )  # fmt: skip
    opt.step()
    s.step(1.0)
    for _ in range(2):  # each blown step rolls back at once (an early sync)
        opt.step()
        s.step(1000.0)
        assert s.last_sync.guard and s.last_sync.step == s.last_epoch
        opt.step()
        s.step(1.0)  # the window after a rollback starts again from 1.0
    opt.step()
    with pytest.raises(NonFiniteReplicasError) as info:
        s.step(1000.0)
    text = str(info.value)
    assert "non-finite" not in text and "step guard" in text and "after 2 rollbacks in a row" in text
    assert info.value.rollbacks == 2 and info.value.step == s.last_epoch + 1


def test_local_step_guard_trip_survives_a_checkpoint():
    """A replica the local step guard reset mid-window is still left out at the sync after a resume:
    the flag is part of the partial window in state_dict()."""
    from hdet_track.controller import DriftController

    def build():
        model, opt = make()
        ctrl = DriftController(step_guard=10.0, step_guard_scope="local")
        return (
            model,
            opt,
            HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, auto_lr=True, model=model, controller=ctrl),
        )

    losses = [1.0, 1.0, 50.0, 1.0, 1.0, 1.0]  # trips at step 3; the sync at 5 rolls back (no healthy replica)
    model, opt, s = build()
    for k, loss in enumerate(losses, 1):
        opt.step()
        s.step(loss)
        if k == 3:
            state = {"sched": s.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
            assert state["sched"]["window"]["tripped"] is True
    uninterrupted = (s.last_sync.step, s.last_sync.left_out, [a.kind for a in s.last_sync.guard])
    model2, opt2, s2 = build()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    s2.load_state_dict(state["sched"])
    for loss in losses[3:]:
        opt2.step()
        s2.step(loss)
    assert (s2.last_sync.step, s2.last_sync.left_out, [a.kind for a in s2.last_sync.guard]) == uninterrupted
    assert uninterrupted == (5, [0], ["rollback"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))


def test_losses_of_any_real_kind_are_taken_and_others_named():
    import numpy as np

    model, opt = make()
    sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, auto_lr=True)
    for loss in (np.float32(0.5), np.float64(0.4), 1, torch.tensor(0.3), torch.tensor([0.2])):
        opt.step()
        sched.step(loss)
    assert sched.last_sync is not None and sched.last_sync.window_losses[0] == pytest.approx(
        np.mean([0.5, 0.4, 1, 0.3, 0.2])
    )
    for bad, match in (
        (torch.tensor(1j), "real scalar .* dtype torch.complex64"),
        ("0.5", "float or a one-element tensor, but got str"),
    ):
        with pytest.raises(ValueError, match=match):
            sched.step(bad)
    opt.step()
    sched.step(10**400)  # too large for a float: a blown-up loss, not an OverflowError
    assert sched.last_epoch == 6


def test_numpy_and_tensor_scalars_are_taken_as_onecycle_takes_them():
    """max_lr=np.float32(0.5) (a sweep's config) was refused as "Expected max_lr in (0.0, inf)":
    OneCycleLR takes it, and so do HDET's own arguments now; other types say what is expected."""
    import numpy as np

    _, a = make(groups=2)
    _, b = make(groups=2)
    ref = OneCycleLR(a, max_lr=np.float32(0.5), total_steps=12, div_factor=np.float32(25))
    sched = HDETScheduler(
        b, np.float32(0.5), total_steps=12, div_factor=np.float32(25), spread=np.float32(0.0), sync_every=np.int64(4)
    )
    for _ in range(12):
        a.step(), b.step()
        ref.step(), sched.step(1.0)
        assert sched.get_last_lr() == ref.get_last_lr()
    assert sched.last_sync.step == 12 and sched.sync_every == 4 and type(sched.sync_every) is int
    HDETScheduler(make(groups=2)[1], [torch.tensor(0.5), np.float64(0.1)], total_steps=12, spread=torch.tensor(0.2))
    with pytest.raises(ValueError, match=r"max_lr in \(0.0, inf\), but got '0.5'"):
        HDETScheduler(make()[1], "0.5", total_steps=10)
    with pytest.raises(ValueError, match=r"spread in \[0, 1\), but got True"):
        HDETScheduler(make()[1], 0.1, total_steps=10, spread=True)


def test_one_momentum_for_every_group_resumes_a_checkpoint_that_lists_it_per_group():
    """wrap(OneCycleLR(...)) keeps base_momentum=[0.85]; HDETScheduler(..., base_momentum=0.85)
    refused its checkpoint (and the other way round): "base_momentum is 0.85 here and [0.85]"."""

    def build(momentum):
        return HDETScheduler(make(groups=2)[1], 0.1, total_steps=20, sync_every=5, base_momentum=momentum)

    build(0.85).load_state_dict(build([0.85, 0.85]).state_dict())
    build([0.85, 0.85]).load_state_dict(build(0.85).state_dict())
    with pytest.raises(CheckpointMismatchError, match=r"base_momentum is 0.85 here and \[0.85, 0.8\]"):
        build(0.85).load_state_dict(build([0.85, 0.8]).state_dict())


def test_an_int_given_to_step_is_a_loss_said_once_to_be_no_epoch():
    """OneCycleLR.step(5) jumps to step 5 (deprecated); HDET took 5 as a loss without a word."""
    _, opt = make()
    sched = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5)
    with pytest.warns(UserWarning, match=r"took the int 5 as this step's training loss; if it is an epoch"):
        opt.step()
        sched.step(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
        sched.step(6)  # said once
    assert sched.last_epoch == 2


def test_a_onecycle_checkpoint_says_how_to_go_on_and_that_way_continues_its_schedule():
    """HDET refused OneCycleLR's state with "Expected an HDETScheduler checkpoint, but got keys [...]"."""
    _, a = make(groups=2)
    ref = OneCycleLR(a, max_lr=0.1, total_steps=20)
    for _ in range(8):
        a.step()
        ref.step()
    saved_opt, saved = a.state_dict(), ref.state_dict()
    with pytest.raises(CheckpointMismatchError, match=r"a OneCycleLR one \(at step 8\).* last_epoch=7"):
        HDETScheduler(make(groups=2)[1], 0.1, total_steps=20).load_state_dict(saved)
    _, b = make(groups=2)
    b.load_state_dict(saved_opt)
    sched = HDETScheduler(b, 0.1, total_steps=20, sync_every=5, last_epoch=7)
    assert sched.get_last_lr() == ref.get_last_lr()
    _, c = make(groups=2)  # or the OneCycleLR it came from, loaded and wrapped
    c.load_state_dict(saved_opt)
    onecycle = OneCycleLR(c, max_lr=0.1, total_steps=20)
    onecycle.load_state_dict(saved)
    wrapped = hdet_track.wrap(onecycle, sync_every=5)
    for _ in range(12):
        a.step(), b.step(), c.step()
        ref.step(), sched.step(1.0), wrapped.step(1.0)
        assert sched.get_last_lr() == ref.get_last_lr() == wrapped.get_last_lr()


def test_as_sequential_lrs_first_scheduler_it_makes_no_sync_while_being_built():
    """SequentialLR's initial step went through HDET's own step: a sync at step 0 (a collective on
    several ranks, and "no loss" with auto_lr) while SequentialLR was being built."""
    from torch.optim.lr_scheduler import ConstantLR, SequentialLR

    _, a = make(groups=1)
    _, b = make(groups=1)
    ref = SequentialLR(a, [OneCycleLR(a, 0.1, total_steps=10), ConstantLR(a, factor=0.5)], milestones=[10])
    hdet = HDETScheduler(b, 0.1, total_steps=10, sync_every=5)
    sched = SequentialLR(b, [hdet, ConstantLR(b, factor=0.5)], milestones=[10])
    assert hdet.last_sync is None and hdet.last_epoch == 0
    syncs = []
    for _ in range(12):
        a.step(), b.step()
        ref.step(), sched.step()
        syncs += [hdet.last_sync.step] if hdet.last_sync is not None and hdet.last_sync.step not in syncs else []
        assert sched.get_last_lr() == ref.get_last_lr()
    assert syncs == [5]  # SequentialLR hands over at its milestone: HDET's 10th step is the next scheduler's


def test_auto_lr_in_sequential_lr_says_it_gets_no_loss_there():
    """SequentialLR steps HDET without a loss: with auto_lr the error says where the loss went missing
    and what to do, where it only said that it got none."""
    from torch.optim.lr_scheduler import LinearLR, SequentialLR

    _, opt = make(groups=1)
    hdet = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, auto_lr=True)
    sched = SequentialLR(opt, [LinearLR(opt, 0.1, total_iters=2), hdet], milestones=[2])
    for _ in range(2):
        opt.step()
        sched.step()  # the warm-up, then the milestone (HDET's _update_lr(0): no step of its own)
    opt.step()
    with pytest.raises(ValueError, match=r"got no loss \(SequentialLR and ChainedScheduler .* use auto_lr=False"):
        sched.step()


def _lrs_resumed(build, steps: int, resume_at: int | None = None, order: str = "opt-first") -> list[float]:
    """The LR each of ``steps`` optimizer steps trains with, uninterrupted or saved after step
    ``resume_at`` (model, optimizer and scheduler, weights_only) and resumed in a fresh job that loads
    the optimizer before the scheduler (``"opt-first"``) or after it (``"sched-first"``)."""
    model, opt, sched = build()
    lrs = []
    for step in range(steps):
        if step == resume_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model, opt, sched = build()
            model.load_state_dict(saved["model"])
            loads = [(opt, saved["opt"]), (sched, saved["sched"])]
            for obj, state in loads if order == "opt-first" else loads[::-1]:
                obj.load_state_dict(state)
        lrs.append(opt.param_groups[0]["lr"])
        loss = model(torch.ones(2, 4)).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("order", ["opt-first", "sched-first"])
def test_chained_with_another_scheduler_resumes_with_its_lr_not_hdets_own(order):
    """ChainedScheduler([HDET, ExponentialLR]): the LR in force is HDET's times gamma. Loading the
    scheduler re-applied HDET's own LR, so the first step after the resume trained without the factor
    (0.0812 for 0.0731 at step 6); OneCycleLR in its place resumes exactly."""
    from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR

    def build(kind):
        def make_one():
            model, opt = make(groups=1)
            first = (
                OneCycleLR(opt, 0.1, total_steps=12)
                if kind == "onecycle"
                else HDETScheduler(opt, 0.1, total_steps=12, sync_every=4, model=model)
            )
            return model, opt, ChainedScheduler([first, ExponentialLR(opt, gamma=0.9)])

        return make_one

    reference = _lrs_resumed(build("onecycle"), 12)
    assert _lrs_resumed(build("onecycle"), 12, resume_at=5, order=order) == reference
    assert _lrs_resumed(build("hdet"), 12) == reference
    for k in (3, 4, 5, 8):  # within a window, at a sync, and later
        assert _lrs_resumed(build("hdet"), 12, resume_at=k, order=order) == reference, k


@pytest.mark.parametrize("order", ["opt-first", "sched-first"])
@pytest.mark.parametrize("milestone", [10, 11])
def test_sequential_lr_resumed_after_the_milestone_keeps_the_next_schedulers_lr(milestone, order):
    """SequentialLR([HDET(total_steps=10), ConstantLR]) resumed after the milestone: loading HDET
    wrote its own last LR (4e-7, 5000x smaller: ConstantLR keeps whatever LR it finds), or with the
    milestone at 11 OneCycle's formula one step past its end, over ConstantLR's 0.002. OneCycleLR in
    its place resumes exactly, and HDET's LRs are OneCycleLR's (a world of one, no spread)."""
    from torch.optim.lr_scheduler import ConstantLR, SequentialLR

    def build(kind):
        def make_one():
            model, opt = make(groups=1)
            first = (
                OneCycleLR(opt, 0.1, total_steps=10)
                if kind == "onecycle"
                else HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, model=model)
            )
            return model, opt, SequentialLR(opt, [first, ConstantLR(opt, factor=0.5)], milestones=[milestone])

        return make_one

    reference = _lrs_resumed(build("onecycle"), 14)
    assert reference[milestone:] == [0.1 / 25 * 0.5] * (14 - milestone)
    assert _lrs_resumed(build("hdet"), 14) == reference
    for k in (4, 5, 9, 10, 11, 12):
        assert _lrs_resumed(build("onecycle"), 14, resume_at=k, order=order) == reference, k
        assert _lrs_resumed(build("hdet"), 14, resume_at=k, order=order) == reference, k


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_lr=np.float32(0.1), div_factor=np.float32(25)),
        dict(controller=DriftController(guard=np.float64(3.0), max_rollbacks=np.int64(4))),
        dict(controller="paper", temperature=np.float32(0.2)),
    ],
)
def test_a_checkpoint_of_numpy_scalar_arguments_loads_with_weights_only_and_resumes_the_same(kwargs):
    """NumPy scalars are accepted for HDET's numbers, and OneCycleLR's state (base_lrs) and the
    controller's recorded settings kept them: torch.load(weights_only=True), torch's default, refused
    the checkpoint. The run that resumes computes what the uninterrupted one did, bit for bit (OneCycleLR
    computes in np.float32 with np.float32 arguments)."""
    import copy

    args = dict(max_lr=0.1, total_steps=20, sync_every=5, auto_lr=True) | kwargs

    def build():
        model, opt = make()
        controller = args.get("controller")
        fresh = (
            dict(args, controller=DriftController(**controller.settings()))
            if isinstance(controller, DriftController)
            else args
        )
        return model, opt, quiet(optimizer=opt, model=model, **fresh)

    model, opt, sched = build()
    lrs = []
    for k in range(1, 21):
        opt.step()
        sched.step(1.0 / k)
        lrs.append([g["lr"] for g in opt.param_groups])
        if k == 7:
            buf = io.BytesIO()
            torch.save(sched.state_dict(), buf)
            # (the optimizer's own state holds OneCycleLR's NumPy max_lr in its param groups, as with
            # plain OneCycleLR: torch's matter, kept aside here)
            state = {"opt": copy.deepcopy(opt.state_dict()), "model": copy.deepcopy(model.state_dict())}
    buf.seek(0)
    state["sched"] = torch.load(buf, weights_only=True)
    model, opt, resumed = build()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    resumed.load_state_dict(state["sched"])
    for k in range(8, 21):
        opt.step()
        resumed.step(1.0 / k)
        assert [g["lr"] for g in opt.param_groups] == lrs[k - 1]


def test_loading_the_optimizer_after_the_scheduler_keeps_this_ranks_values():
    """A checkpoint written by rank 0: its optimizer state holds rank 0's LRs and explored values.
    Loaded after the scheduler, it gave every rank rank 0's LR until the next step and its explored
    values until the next sync (the README says the order does not matter)."""
    model, opt = make()
    sched = quiet(optimizer=opt, max_lr=0.1, total_steps=20, sync_every=5, model=model, explore={"weight_decay": 0.5})
    for k in range(1, 8):
        opt.step()
        sched.step(1.0 / k)
    state = {"sched": sched.state_dict(), "opt": opt.state_dict()}
    mine = [(g["lr"], g["weight_decay"]) for g in opt.param_groups]
    for group in state["opt"]["param_groups"]:  # another rank's values, as rank 0's checkpoint holds them
        group["lr"], group["weight_decay"] = 0.123, 0.0456
    model, opt = make()
    resumed = quiet(optimizer=opt, max_lr=0.1, total_steps=20, sync_every=5, model=model, explore={"weight_decay": 0.5})
    resumed.load_state_dict(state["sched"])
    opt.load_state_dict(state["opt"])
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == mine
    # only the optimizer's latest scheduler answers a load, and a deepcopy of the optimizer still works
    import copy

    copy.deepcopy(opt)
    later = quiet(optimizer=opt, max_lr=0.2, total_steps=20, sync_every=5, model=model)
    opt.load_state_dict(state["opt"])
    assert [g["lr"] for g in opt.param_groups] == later.get_last_lr()
    later.close()  # closed: the optimizer is no longer HDET's, a load keeps what it holds
    opt.load_state_dict(state["opt"])
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.123, 0.0456)] * len(opt.param_groups)


def test_the_paper_controller_resumes_with_the_decay_of_the_job_that_took_over_part_way():
    """A OneCycleLR run that HDET took over at step 20 (from_onecycle, the paper controller): its decay
    rate spans the syncs after step 20. Resumed from a checkpoint into a scheduler built from the start,
    it was recomputed over the whole schedule (0.527 -> 0.451): the LRs ended 2x off, with no error."""
    kwargs = dict(spread=0.0, sync_every=10, auto_lr=True, controller="paper")

    def onecycle():
        model, opt = make(groups=1)
        return model, opt, OneCycleLR(opt, max_lr=0.1, total_steps=100)

    model, opt, plain = onecycle()
    for _ in range(20):
        opt.step()
        plain.step()
    sched = HDETScheduler.from_onecycle(plain, model=model, **kwargs)
    lrs = {}
    for k in range(21, 101):
        opt.step()
        sched.step(1.0 / k)
        lrs[k] = opt.param_groups[0]["lr"]
        if k == 50:
            state = {"sched": sched.state_dict(), "opt": opt.state_dict()}
    model, opt, plain = onecycle()
    resumed = HDETScheduler.from_onecycle(plain, model=model, **kwargs)
    opt.load_state_dict(state["opt"])
    resumed.load_state_dict(state["sched"])
    assert resumed.gamma == sched.gamma
    for k in range(51, 101):
        opt.step()
        resumed.step(1.0 / k)
        assert opt.param_groups[0]["lr"] == lrs[k], k


def test_explore_refuses_what_it_cannot_explore_and_names_it():
    """An audit's findings: an explored key 'lr' under another name overwrote OneCycle's LR at every
    sync; bool/None/'params' keys were taken or failed with a bare float() error; two explored
    hyperparameters on one attribute logged values never applied; a mapping key other than the
    Hyperparam's name was dropped."""
    model, opt = make()
    lin = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.2))
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)

    def build(spec, optimizer=sgd, **kw):
        return HDETScheduler(optimizer, 0.1, total_steps=10, cycle_momentum=False, explore=spec, **kw)

    with pytest.raises(ValueError, match="'lr'.*OneCycle's own schedule keys"):
        explore.ParamGroupKey("lr", 0.3, name="lr2")
    with pytest.raises(ValueError, match="'params' holds the tensors"):
        build({"params": 0.5})
    with pytest.raises(ValueError, match=r"'nesterov' to be a real number.*param_groups\[0\]\['nesterov'\] is True"):
        build({"nesterov": 0.5})
    with pytest.raises(ValueError, match=r"'foreach' to be a real number.*is None"):
        build({"foreach": 0.5})
    with pytest.raises(ValueError, match=r"explore\['x'\] getter to return a real number, but it returned None"):
        build([explore.setter("x", lambda: None, lambda v: None, 0.3)])
    with pytest.raises(ValueError, match=r"explore\['wd'\] to be named 'wd'.*named 'weight_decay'"):
        build({"wd": explore.param_group("weight_decay", 0.5)})
    with pytest.raises(ValueError, match=r"explore\['head'\] and explore\['dropout'\] both set the same Dropout.p"):
        build([explore.dropout(lin, 0.3), explore.module_attr("head", lin[1], "p", 0.3)])
    two = [explore.param_group("weight_decay", 0.3), explore.ParamGroupKey("weight_decay", 0.5, name="wd2")]
    with pytest.raises(
        ValueError,
        match=r"explore\['wd2'\] and explore\['weight_decay'\] both set the same param_groups\[0\]\['weight_decay'\]",
    ):
        build(two)
    # a sweep's NumPy or tensor spread works in the mapping form, as everywhere else
    for spread in (np.float32(0.5), torch.tensor(0.5)):
        assert build({"weight_decay": spread})._fanout.spreads["weight_decay"] == 0.5
    # a dropout's p found without types= is a probability: bounded by 1, not unbounded; so is the p of
    # the types given (a custom dropout class)
    assert build([explore.module_attr("drop", lin, "p", 0.5)])._fanout.hyperparams["drop"].bounds == (0.0, 1.0 - 1e-6)

    class MyDrop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = 0.2

    mine = nn.Sequential(nn.Linear(2, 2), MyDrop())
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    custom = build([explore.module_attr("drop", mine, "p", 0.5, types=MyDrop)], optimizer=opt_mine)
    assert custom._fanout.hyperparams["drop"].bounds == (0.0, 1.0 - 1e-6)
    sched = build({"weight_decay": 0.5})
    for ask in (sched.multiplier, sched.base_values, sched.replica_values):
        with pytest.raises(ValueError, match=r"explored_names \['lr', 'weight_decay'\], but got 'wd'"):
            ask("wd")


def test_a_module_named_like_a_param_group_keeps_its_own_series_key():
    """Targets labelled 'enc', 'pg0', 'pg1' (a ModuleDict's keys) got the keys dropout, dropout/pg0,
    dropout/pg1, read back as targets 0, 0, 1: target 1's series overwrote target 0's."""
    from hdet_track.names import parse_series_key, series_key

    keys = [series_key("dropout", t, label) for t, label in enumerate(["enc", "pg0", "pg1"])]
    assert [parse_series_key(k) for k in keys] == [("dropout", 0), ("dropout", 1), ("dropout", 2)]
    assert [series_key("lr", g, f"pg{g}") for g in range(3)] == ["lr", "lr/pg1", "lr/pg2"]  # unchanged


@pytest.mark.parametrize("kind", [np.int64, torch.tensor, lambda v: torch.tensor([v])])
def test_integer_arguments_take_a_sweeps_numpy_and_tensor_integers(kind):
    """The README says HDET takes NumPy and one-element tensor scalars for its numbers; seed=np.int64
    was refused ("to be an int"), and tensors for sync_every, auto_lr_warmup and log_every. They
    now run as the Python ints do; a float tensor where an integer is needed is still refused."""

    def run(convert):
        model, opt = make()
        s = HDETScheduler(
            opt, 0.1, total_steps=20, spread=0.3, sync_every=convert(5), auto_lr=True, controller="paper",
            auto_lr_warmup=convert(5), seed=convert(3), log_every=convert(2),
        )  # fmt: skip
        lrs = []
        for k in range(1, 21):
            opt.step()
            s.step(1.0 / k)
            lrs.append(s.get_last_lr())
        return s, lrs

    given, lrs = run(kind)
    plain, expected = run(int)
    assert lrs == expected
    assert given._config == plain._config and isinstance(given.seed, int)
    buf = io.BytesIO()
    torch.save(given.state_dict(), buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)  # torch's default loader takes it
    _, opt = make()
    with pytest.raises(ValueError, match=r"Expected sync_every to be an integer >= 1, but got tensor\(5\.\)"):
        HDETScheduler(opt, 0.1, total_steps=20, sync_every=torch.tensor(5.0))


def test_a_finite_blow_up_without_rollback_still_raises():
    """Only non-finite losses with finite parameters are averaged as they are: a finite blow-up of
    every replica with no rollback to fall back on (the drift controller's rollback=False) still
    stops training, naming it."""
    model, opt = make()
    s = HDETScheduler(
        opt, 0.1, total_steps=20, sync_every=10, auto_lr=True, model=model,
        controller=DriftController(rollback=False, step_guard=10.0),
    )  # fmt: skip
    opt.step()
    s.step(1.0)
    opt.step()
    with pytest.raises(NonFiniteReplicasError) as info:
        s.step(1000.0)
    assert "step guard" in str(info.value)


def test_a_structure_changed_after_the_scheduler_was_built_is_named():
    """add_param_group after the scheduler was built failed deep inside (IndexError in the
    controller, NumPy's 'inhomogeneous shape'); a lazy module failed with 'uninitialized
    parameter'; a submodule cast to another dtype failed after its all_reduce. Each now says what
    changed and what to do."""
    model, opt = make()
    s = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, auto_lr=True, model=model)
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    opt.step()
    with pytest.raises(ValueError, match="3 param groups HDETScheduler was built with, but it has 4 now"):
        s.step(1.0)
    lazy = nn.Sequential(nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"2 are lazy \(nn.LazyLinear...\): run one forward pass"):
        HDETScheduler(torch.optim.SGD(lazy.parameters(), lr=0.1), 0.1, total_steps=10, auto_lr=True, model=lazy)
    model, opt = make()
    s = HDETScheduler(opt, 0.1, total_steps=10, sync_every=2, auto_lr=True, model=model)
    for _ in range(2):  # to the first sync
        opt.step()
        s.step(1.0)
    model[3].double()
    opt.step()
    s.step(1.0)
    opt.step()
    with pytest.raises(ValueError, match="keep their shapes and dtypes while HDETScheduler runs"):
        s.step(1.0)


def test_a_checkpoint_carries_the_jobs_id_to_its_next_attempt():
    """The id a run-less spill is known by (an attempt the backend never saw): the same in the job
    resumed from a checkpoint, a new one in a fresh job."""
    model, opt = make()
    first = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5)
    opt.step()
    first.step(1.0)
    state = first.state_dict()
    model, opt = make()
    resumed = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5)
    fresh_id = resumed.run_info(gather=False).job
    resumed.load_state_dict(state)
    assert resumed.run_info(gather=False).job == first.run_info(gather=False).job != fresh_id
    assert len(fresh_id) == 32


def test_a_buffer_that_blows_up_to_inf_is_a_blow_up_and_a_mask_of_inf_is_not():
    """A buffer may hold inf where it held inf from the start (an additive -inf attention mask);
    a running variance that overflows to inf is a blow-up, rolled back, and never kept as the
    consensus (the rule let any inf buffer through for a while)."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)
            self.register_buffer("causal", torch.full((4, 4), float("-inf")).triu(1))

    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = HDETScheduler(opt, 0.1, total_steps=20, sync_every=2, auto_lr=True, model=model)
    for _ in range(2):
        opt.step()
        s.step(1.0)
    assert s.last_sync.guard == [] and s.last_sync.left_out == []  # the mask alone: nothing to do
    kept = model.bn.running_var.clone()
    with torch.no_grad():
        model.bn.running_var.fill_(float("inf"))
    opt.step()
    s.step(1.0)
    opt.step()
    s.step(1.0)
    assert [g.kind for g in s.last_sync.guard] == ["rollback"]
    assert torch.equal(model.bn.running_var, kept)
    assert torch.equal(model.causal, torch.full((4, 4), float("-inf")).triu(1))


def test_the_first_step_hook_keeps_no_scheduler_alive_and_a_checkpoint_before_it_keeps_the_loaded_weights():
    """The optimizer's first-step hook (which takes the consensus training starts from) held its
    scheduler: one replaced before its first sync stayed alive with a model-sized copy. And a
    checkpoint saved before any step restored the weights the scheduler was built with over ones
    loaded after it."""
    import gc
    import weakref

    model, opt = make()
    gone = weakref.ref(HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, auto_lr=True, model=model))
    gc.collect()
    assert gone() is None
    model, opt = make()
    first = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, auto_lr=True, model=model)
    state = first.state_dict()  # before any step (a save at start)
    model, opt = make()
    resumed = HDETScheduler(opt, 0.1, total_steps=10, sync_every=5, auto_lr=True, model=model)
    resumed.load_state_dict(state)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)  # pretrained weights loaded after the scheduler was built
    loaded = [p.clone() for p in model.parameters()]
    opt.step()
    resumed.step(1.0)
    opt.step()
    resumed.step(1e6)  # the step guard rolls back
    assert [g.kind for g in resumed.last_sync.guard] == ["rollback"]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded))


def test_an_explored_p_is_below_1_and_one_kind_and_an_integer_attribute_is_refused():
    """An audit's findings: a dropout's p reached 1.0 (README: kept within (0, 1)), and that replica
    trained nothing for its window; module_attr("p") over dropouts and another module with a p (GeM
    pooling's 3) bounded all by (0, inf), and a dropout got p=1.2 (torch raised in the forward); an
    integer attribute (a width) got 1.0 and 3.0 and broke the forward later."""

    class GeM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = 3.0

    class TopK(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.k = 2

    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = HDETScheduler(opt, 0.1, total_steps=10, explore=[explore.dropout(model, 0.5)])
    spec = sched._fanout.hyperparams["dropout"]
    assert spec.bounds[1] < 1.0 and max(v for r in sched.replica_values("dropout") for v in r) < 1.0
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.2), GeM())
    opt = torch.optim.SGD(mixed.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"explore\['p'\].*dropout modules.*\['GeM'\].*types="):
        HDETScheduler(opt, 0.1, total_steps=10, explore=[explore.module_attr("p", mixed, "p", 0.5)])
    # one kind: GeM's own p, unbounded above
    only = HDETScheduler(opt, 0.1, total_steps=10, explore=[explore.module_attr("gem", mixed[2], "p", 0.5)])
    assert only._fanout.hyperparams["gem"].bounds == (0.0, math.inf)
    topk = nn.Sequential(nn.Linear(2, 2), TopK())
    opt = torch.optim.SGD(topk.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"explore\['k'\] attribute 'k' to be a float.*int 2"):
        HDETScheduler(opt, 0.1, total_steps=10, explore=[explore.module_attr("k", topk, "k", 0.5)])


def test_a_param_group_key_some_groups_lack_is_refused_naming_them():
    """It said the key "matches nothing; known keys: [..., 'my_clip', ...]", naming the key it refused."""
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": a.parameters(), "my_clip": 1.0}, {"params": b.parameters()}], lr=0.1)
    with pytest.raises(ValueError, match=r"'my_clip' in every param group of SGD, but param group\(s\) \[1\] lack it"):
        HDETScheduler(opt, 0.1, total_steps=10, explore={"my_clip": 0.3})


def test_a_checkpoint_whose_kept_consensus_predates_the_parameters_outside_the_model_still_loads(caplog):
    """Since the optimizer's parameters outside model= are averaged (and kept for a rollback), a
    checkpoint of the version before held a smaller kept consensus, and loading it raised "Expected a
    kept consensus of this model's shape": the job could not resume. It now loads, says so, and the
    first step keeps a new consensus."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    temp = nn.Parameter(torch.ones(()))

    def build(params):
        opt = torch.optim.SGD(params, lr=0.1)
        return opt, HDETScheduler(opt, 0.1, total_steps=20, sync_every=5, auto_lr=True, model=model)

    opt, sched = build([*model.parameters(), temp])
    for step in range(1, 4):
        opt.step()
        sched.step(1.0 / step)
    state = sched.state_dict()
    _, older = build(list(model.parameters()))  # what the version before kept: the model's tensors only
    state["averager"] = {k: v for k, v in older.state_dict()["averager"].items() if k != "layout"}
    opt, resumed = build([*model.parameters(), temp])
    with caplog.at_level("WARNING", logger="hdet_track"):
        resumed.load_state_dict(state)
    assert any("older version's" in r.getMessage() for r in caplog.records)
    for step in range(4, 21):
        opt.step()
        resumed.step(1.0 / step)
    mismatched = dict(state, averager=dict(state["averager"], layout=2))  # this version's: a real mismatch
    with pytest.raises(ValueError, match="kept consensus of this model's shape"):
        build([*model.parameters(), temp])[1].load_state_dict(mismatched)

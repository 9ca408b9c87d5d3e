"""HDET on 4 real gloo processes on 127.0.0.1 (no mocks of torch.distributed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hdet_track.schedule import draw_permutation, multipliers, permutation_generator

from . import workers
from .launch import run_ranks

WORLD = 4


@pytest.mark.parametrize("mode", ["plain", "ddp"])
def test_fanout_values_and_converge(mode):
    res = run_ranks(workers.fanout_and_sync, WORLD, mode)
    rho = multipliers(WORLD, 0.3)
    gen = permutation_generator(3, 0)
    expected_perm = list(range(WORLD))
    for step in range(31):  # lrs[k] is the LR for optimizer step k+1
        if step > 0 and step % 5 == 0:
            expected_perm = draw_permutation(WORLD, gen)
        for r in range(WORLD):
            lr, base = res[r]["lrs"][step], res[r]["onecycle"][step]
            assert lr == pytest.approx(base * rho[expected_perm[r]], rel=1e-12), (mode, step, r)
    # Fan-out from step 0: rank r starts on rho_r, so the first LRs differ and are ordered.
    first = [res[r]["lrs"][0] for r in range(WORLD)]
    assert first == sorted(first) and len(set(first)) == WORLD
    assert all(res[r]["lr_type"] == "float" for r in range(WORLD))
    for step in range(30):
        p = [res[r]["params"][step] for r in range(WORLD)]
        bn = [res[r]["bn"][step] for r in range(WORLD)]
        synced = (step + 1) % 5 == 0
        same = all(torch.equal(p[0], q) for q in p[1:])
        assert same == synced, (mode, step)
        if synced:
            assert all(torch.equal(bn[0], b) for b in bn[1:]), "BatchNorm buffers are averaged"
    # Parameters right after a sync are the mean of the replicas' pre-sync parameters: the average
    # of all ranks equals the synced value, so any rank's copy equals the mean of the 4 copies.
    assert torch.allclose(res[0]["params"][4], sum(res[r]["params"][4] for r in range(WORLD)) / WORLD)
    # Each rank's reported divergence is its distance to the average before averaging, relative.
    for r in range(WORLD):
        for pre, (div, post) in zip(res[r]["pre_sync"], res[r]["divergences"]):
            expected = float((pre.double() - post.double()).norm() / post.double().norm())
            assert div == pytest.approx(expected, rel=1e-6) and div > 0


def test_divergences_reach_callbacks_complete_and_in_order_gathered_or_carried():
    """A callback that needs the divergences (tracking does) gets each sync's record once, with the
    same divergences as measuring at the sync; training is unchanged. Gathered in the background
    (long windows): between that step's on_step and the next one's. Carried by the next sync's
    gather (short windows, no collective of their own): at the next sync, before its own record;
    the last sync gathers at once, so a run ends with every record complete."""
    res = run_ranks(workers.background_divergence, WORLD)
    for how in ("background", "carried", "background-by-0", "carried-by-0"):
        first = [e for e in res[0][how]["events"] if e[0] == "sync"]
        for r in range(WORLD):
            measured, got = res[r]["measured"], res[r][how]
            assert torch.equal(measured["params"], got["params"])
            by_step = {s: d for s, d in (x for x in measured["seen"] if x)}
            assert sorted(by_step) == [4, 8, 12, 14]
            assert all(len(d) == WORLD and all(0 < v < math.inf for v in d) for d in by_step.values())
            events = got["events"]
            delivered = [e for e in events if e[0] == "sync"]
            assert [e[1] for e in delivered] == [4, 8, 12, 14], how  # each once, in order
            assert delivered == first  # the same record on every rank
            for event in delivered:
                step, divs = event[1], event[2]
                assert divs == pytest.approx(by_step[step], rel=1e-12), (how, r, step)
                at = events.index(event)
                if how.startswith("background"):  # rank 0's setting decides for every rank
                    around = (("step", 13), ("step", 14)) if step == 14 else (("step", step), ("step", step + 1))
                else:
                    around = {
                        4: (("step", 7), ("step", 8)),
                        8: (("step", 11), ("step", 12)),
                        12: (("step", 13), delivered[3]),
                        14: (delivered[2], ("step", 14)),
                    }[step]
                assert (events[at - 1], events[at + 1]) == around, (how, r, step)


@pytest.mark.parametrize("prefer", ["high", "low"])
def test_controller_moves_toward_better_replicas(prefer):
    res = run_ranks(workers.controller_direction, WORLD, prefer)
    reports = res[0]["reports"]
    controlled = [rep for rep in reports if rep.weights is not None]
    assert len(controlled) >= 8
    assert all(rep.step >= 10 for rep in controlled)
    assert all(rep.weights is None for rep in reports if rep.step < 10)
    for r in range(1, WORLD):  # every rank takes the same decisions
        assert [rep.updates for rep in res[r]["reports"]] == [rep.updates for rep in reports]
    sign = 1 if prefer == "high" else -1
    for name in ["lr", "weight_decay", "dropout"]:
        deltas = [u.delta for rep in controlled for u in rep.updates[name]]
        assert sign * sum(deltas) > 0, (name, deltas)
        # On average, the better replicas' side wins each sync.
        assert sum(sign * d > 0 for d in deltas) > len(deltas) / 2, (name, deltas)
    wd_final = controlled[-1].updates["weight_decay"][0].base_after
    p_final = controlled[-1].updates["dropout"][0].base_after
    assert sign * (wd_final - 1e-3) > 0
    assert sign * (p_final - 0.2) > 0
    low_bound = 0.1 / 25 / 1e4  # OneCycle's own final LR: the default lower bound
    for rep in controlled:
        u = rep.updates["lr"][0]
        raw = u.base_before * (1 - u.gamma) + 0.5 * u.velocity
        assert u.base_after == pytest.approx(max(raw, low_bound), rel=1e-12)
        assert u.clipped == (raw < low_bound)
        assert u.base_after > 0
    if prefer == "low":
        # The paper's unbounded update would have gone below zero here.
        assert any(u.clipped for rep in controlled for u in rep.updates["lr"])


def test_nan_replica_is_repaired():
    res = run_ranks(workers.nan_repair, WORLD)
    rep = res[0]["report"]
    assert rep.step == 10 and rep.left_out == [2]
    assert not math.isfinite(rep.window_losses[2])
    assert all(math.isfinite(rep.window_losses[r]) for r in (0, 1, 3))
    at_sync = [res[r]["params_at_sync"] for r in range(WORLD)]
    assert all(torch.isfinite(p).all() for p in at_sync)
    assert all(torch.equal(at_sync[0], p) for p in at_sync[1:])
    # The healthy ranks' average: rank 2 contributed nothing (its NaN would poison any mean).
    assert res[2]["state_finite"], "rank 2's NaN Adam moments were cleared"
    assert 0 in res[2]["state_sizes"] and all(n > 0 for n in res[0]["state_sizes"])
    assert all(math.isfinite(res[r]["final_loss"]) for r in range(WORLD))
    assert all(torch.isfinite(res[r]["final_params"]).all() for r in range(WORLD))
    assert all(torch.equal(res[0]["final_params"], res[r]["final_params"]) for r in range(WORLD))


def test_all_replicas_nonfinite_raises_naming_step():
    res = run_ranks(workers.all_nonfinite, WORLD)
    for r in range(WORLD):
        assert res[r]["error"] == "NonFiniteReplicasError"
        assert "step 4" in res[r]["message"] and "DDP" in res[r]["message"]


def test_a_carried_record_reaches_callbacks_before_a_failing_sync():
    res = run_ranks(workers.nonfinite_after_a_carried_sync, WORLD)
    for r in range(WORLD):
        assert res[r]["error_step"] == 8
        assert [s for s, _ in res[r]["syncs"]] == [4, 8], r  # in order, the earlier one complete
        assert all(0 < d < math.inf for d in res[r]["syncs"][0][1])


def test_sync_now_right_after_a_carried_sync_completes_its_record():
    res = run_ranks(workers.sync_now_after_a_carried_sync, WORLD)
    for r in range(WORLD):
        assert res[r]["held"] == []  # waiting for the next sync's gather
        ((step, divs, when),) = res[r]["syncs"]
        assert step == 4 and all(0 < d < math.inf for d in divs) and math.isfinite(when)


def test_gather_pending_before_a_pause_and_reloading_mid_run_with_a_carried_record():
    res = run_ranks(workers.gather_pending_and_reload, WORLD)
    for r in range(WORLD):
        got = res[r]
        assert got["before_gather"] == []  # sync 4's record waits for sync 8's gather
        ((step, divs),) = got["after_gather"]  # gather_pending(): there now, complete
        assert step == 4 and all(0 < d < math.inf for d in divs)
        assert got["last_sync"] == (4, divs)
        assert [s for s, _ in got["at_8"]] == [4]  # sync 8's record waits
        # load_state_dict hands it over as it is: its divergences never arrived
        assert [s for s, _ in got["reloaded"]] == [4, 8] and all(math.isnan(d) for d in got["reloaded"][1][1])
        # the replayed sync 8 gets its own divergences, in its own record; each record once, in order
        assert [s for s, _ in got["syncs"]] == [4, 8, 8, 12]
        assert all(0 < d < math.inf for _, divs in got["syncs"][2:] for d in divs)
        assert [got["syncs"][i] for i in (0, 2, 3)] == [res[0]["syncs"][i] for i in (0, 2, 3)]  # the same on every rank


def test_kill_and_resume_is_exact(tmp_path):
    full = run_ranks(workers.resume_full, WORLD)
    run_ranks(workers.resume_part1, WORLD, str(tmp_path), 17, allow_kill=True)
    assert all((tmp_path / f"ckpt{r}.pt").exists() for r in range(WORLD))
    resumed = run_ranks(workers.resume_part2, WORLD, str(tmp_path), 17)
    for r in range(WORLD):
        assert resumed[r]["lrs"] == full[r]["lrs"], r
        assert torch.equal(resumed[r]["params"], full[r]["params"]), r
    # The run explored something: ranks used different LRs, weight decays and dropouts.
    assert len({tuple(full[r]["lrs"][20]) for r in range(WORLD)}) == WORLD


def test_warm_noisy_init_differs_per_rank():
    res = run_ranks(workers.noise_init, WORLD)
    assert all(torch.equal(res[0]["before"], res[r]["before"]) for r in range(WORLD))
    deltas = [res[r]["after"] - res[r]["before"] for r in range(WORLD)]
    assert all(d.abs().sum() > 0 for d in deltas)
    assert all(not torch.equal(deltas[0], d) for d in deltas[1:])
    assert all(res[r]["rng_same"] for r in range(WORLD))


@pytest.mark.parametrize("victim", [1, 3], ids=["a-middle-lr-replica", "the-highest-lr-replica"])
def test_finite_blowup_is_left_out_reset_and_shown(tmp_path, victim):
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.viz import guard_rows, plot_divergence, plot_sync_loss

    uri = f"sqlite:///{tmp_path / 'blowup.db'}"
    res = run_ranks(workers.finite_blowup, WORLD, uri, victim)
    rec = res[0]["record"]
    assert rec.step == 10 and rec.left_out == [victim] and rec.reasons[0].startswith("blown up")
    assert math.isfinite(rec.window_losses[victim]) and rec.weights[victim] == 0.0
    at_sync = [res[r]["params_at_sync"] for r in range(WORLD)]
    assert all(torch.equal(at_sync[0], p) for p in at_sync[1:])  # reset to the others' average
    assert float(at_sync[0].abs().max()) < 20  # the 50x weights did not enter the average
    assert all(n == 0 for n in res[victim]["state_sizes"]) and all(
        n > 0 for n in res[0 if victim else 1]["state_sizes"]
    )
    assert all(torch.equal(res[0]["final_params"], res[r]["final_params"]) for r in range(WORLD))
    # rank 3 held the highest multiplier in the first window (the permutation starts as the identity)
    assert [a.kind for a in rec.guard] == (["backoff"] if victim == 3 else [])
    run = MLflowReader(uri).read(res[0]["run_ids"]["mlflow"])
    assert run.status == "FINISHED" and run.converge[0].left_out == [victim]
    rows = guard_rows(run)
    assert rows[0]["action"] == "left out" and rows[0]["replicas"] == str(victim) and rows[0]["step"] == 10
    assert [r["action"] for r in rows[1:]] == (["backoff"] if victim == 3 else [])
    crosses = [t for t in plot_sync_loss(run).data if t.name == "replica left out and reset"]
    assert list(crosses[0].x) == [10] and "blown up" in crosses[0].text[0]
    # read without its archive, the Converge page said "No divergence recorded (single replica, or no
    # syncs yet)": the metrics hold each sync's mean and largest divergence over replicas
    per_replica = [[d for d in c.divergence if math.isfinite(d)] for c in run.converge]
    history = without_archive(uri, run.run_id)
    lines = {t.name: t for t in plot_divergence(history).data}
    assert list(lines) == ["mean over replicas", "largest replica"]
    assert list(lines["mean over replicas"].x) == [c.step for c in run.converge]
    np.testing.assert_allclose(lines["mean over replicas"].y, [np.mean(d) for d in per_replica], rtol=1e-6)
    np.testing.assert_allclose(lines["largest replica"].y, [max(d) for d in per_replica], rtol=1e-6)


def without_archive(uri: str, run_id: str):
    """The run read back from its metric histories alone (its event archive deleted)."""
    import shutil
    from pathlib import Path
    from urllib.parse import urlparse

    from mlflow.tracking import MlflowClient

    from hdet_track.readers.mlflow import MLflowReader

    shutil.rmtree(Path(urlparse(MlflowClient(uri).get_run(run_id).info.artifact_uri).path) / "hdet_events")
    run = MLflowReader(uri).read(run_id)
    assert any("metric histories" in w for w in run.warnings)
    return run


@pytest.mark.parametrize(("scope", "poison"), [("local", "scale"), ("auto", "scale"), ("auto", "nan")])
def test_local_step_guard_resets_only_the_blown_replica_and_leaves_it_out(tmp_path, scope, poison):
    """``"auto"``: replicas with their own gradients take the local guard, every rank alike.
    ``"nan"``: the replica trips on a NaN loss, which stays in its window's sum: it is a blow-up
    all the same, and the LR is cut (it used to read as "non-finite", with no cut)."""
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.viz import step_guard_note

    uri = f"sqlite:///{tmp_path / 'local.db'}"
    res = run_ranks(workers.local_step_guard_blowup, WORLD, uri, 3, scope, poison)
    assert [res[r]["scope"] for r in range(WORLD)] == ["local"] * WORLD
    start = res[0]["start"]
    assert torch.equal(res[3]["after_8"], start)  # back at the kept consensus (the start) at once
    assert all(n == 0 for n in res[3]["state_sizes"])  # its optimizer state cleared
    assert all(not torch.equal(res[r]["after_8"], start) for r in range(3))  # the others go on
    assert all(all(n > 0 for n in res[r]["state_sizes"]) for r in range(3))
    assert all(res[r]["sync_at_8"] is None for r in range(WORLD))  # no early sync: no collective
    rec = res[0]["record"]
    assert rec.step == 10 and rec.left_out == [3] and "local step guard" in rec.reasons[0]
    assert rec.weights[3] == 0.0 and [a.kind for a in rec.guard] == ["backoff"]  # rank 3 had the highest LR
    assert all(torch.equal(res[0]["final_params"], res[r]["final_params"]) for r in range(WORLD))
    run = MLflowReader(uri).read(res[0]["run_ids"]["mlflow"])
    assert run.status == "FINISHED" and run.converge[0].left_out == [3]
    # the scope that ran (not the setting "auto") is in every sync's record and read back from the store
    assert rec.step_guard == "local" and [c.step_guard for c in run.converge] == ["local"] * 3
    assert run.step_guard == "local" and step_guard_note(run).startswith("Step guard: local.")
    history = without_archive(uri, run.run_id)  # from the metric histories alone: the scope is there too
    assert [c.step_guard for c in history.converge] == ["local"] * 3
    assert [c.left_out for c in history.converge] == [[3], [], []]  # reset with a finite window loss


@pytest.mark.parametrize("ddp", [True, False])
def test_auto_scope_waits_for_finite_gradients_with_the_collective_check(ddp):
    """A NaN at a step says nothing about whether gradients are shared: under DDP every rank holds
    the same NaN gradient, which must not read as "different" (NaN != NaN) and pick the local
    guard, which is unsafe with shared gradients. Until the gradients are finite the collective
    check runs (it rolls every replica back at step 2); the scope is decided later."""
    res = run_ranks(workers.nan_gradient_at_first_step, WORLD, ddp)
    assert [r["scope"] for r in res] == ["all" if ddp else "local"] * WORLD
    assert all(r["steps"][0] == 2 and r["rolled_back"][0] for r in res)  # caught at step 2, not at 10
    assert all(r["record_scopes"][0] == "all" for r in res)  # undecided at step 2: the NaN decided nothing
    assert all(r["final_finite"] for r in res)


@pytest.mark.parametrize(("setup", "expected"), [("same-batches", "local"), ("half-wrapped", "all")])
def test_auto_scope_after_a_spread_step_and_with_part_of_the_model_outside_ddp(setup, expected):
    """Independent replicas on identical batches hold identical gradients at a window's first step
    (every replica starts it from the consensus): deciding there would take the collective guard
    for good. DDP around only part of a model leaves per-rank gradients in the rest: that must not
    read as independent. Decided at the window's second step, the same on every rank."""
    res = run_ranks(workers.auto_scope, WORLD, setup)
    assert [r["scopes"] for r in res] == [["auto"] + [expected] * 7] * WORLD
    # the controller keeps the finding from then on: before the second sync (step 8), where
    # revert_unconfirmed="shared" (the default) takes the first move back only under DDP
    assert [r["shared"] for r in res] == [[None] + [expected == "all"] * 7] * WORLD


@pytest.mark.parametrize("scope", ["all", "auto"])
def test_step_guard_rolls_back_at_the_blow_up_step_with_shared_gradients(tmp_path, scope):
    """``"auto"``: DDP's averaged gradients are the same on every rank, so it takes the collective guard."""
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.viz import guard_rows, step_guard_note

    uri = f"sqlite:///{tmp_path / 'step-guard.db'}"
    res = run_ranks(workers.step_guard_blowup, WORLD, uri, 2, scope)
    assert [res[r]["scope"] for r in range(WORLD)] == ["all"] * WORLD
    steps = [r.step for r in res[0]["records"]]
    assert steps == [8, 10, 20, 30]  # converged at once at step 8; the sync schedule is unchanged
    guard = res[0]["records"][0]
    assert guard.rolled_back and [a.kind for a in guard.guard] == ["rollback"]
    assert guard.guard[0].reason.startswith("step guard: replicas [2]")
    for r in range(WORLD):  # every replica is back at the consensus kept at the start, state cleared
        assert torch.equal(res[r]["params_after_guard"], res[r]["start"])
        assert all(n == 0 for n in res[r]["state_sizes"])
    assert all(torch.isfinite(res[r]["final_params"]).all() for r in range(WORLD))
    assert all(torch.equal(res[0]["final_params"], res[r]["final_params"]) for r in range(WORLD))
    assert res[0]["drift"] < 0  # the LR was cut
    later = res[0]["records"][1:]
    assert not any(r.rolled_back for r in later) and all(r.left_out == [] for r in later)
    # the event reaches the store and the dashboard's guard table, at its own step
    run = MLflowReader(uri).read(res[0]["run_ids"]["mlflow"])
    assert run.status == "FINISHED" and [c.step for c in run.converge] == [8, 10, 20, 30]
    (rollback,) = [row for row in guard_rows(run) if row["action"] == "rollback"]
    assert rollback["step"] == 8 and rollback["reason"].startswith("step guard: replicas [2]")
    assert [r.step_guard for r in res[0]["records"]] == ["all"] * 4
    assert run.step_guard == "all" and step_guard_note(run).startswith("Step guard: collective.")
    history = without_archive(uri, run.run_id)
    assert [c.step_guard for c in history.converge] == ["all"] * 4
    assert [c.left_out for c in history.converge] == [c.left_out for c in run.converge] == [[0, 1, 2, 3], [], [], []]
    assert step_guard_note(history).startswith("Step guard: collective.")


def test_left_out_replicas_do_not_bypass_the_metric_budget(tmp_path):
    """Every sync leaves a replica out: the event archive keeps all 1,000, the MLflow histories only
    the budget's syncs (a left-out replica used to force every sync into them: 17 series x 1,000)."""
    from mlflow.tracking import MlflowClient

    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'left_out.db'}"
    run_id = run_ranks(workers.left_out_every_sync, WORLD, uri)[0]["run_ids"]["mlflow"]
    run = MLflowReader(uri).read(run_id)
    assert len(run.converge) == 1000 and all(c.left_out == [3] for c in run.converge)
    logged = MlflowClient(uri).get_metric_history(run_id, "hdet/sync/left_out")
    assert 20 <= len(logged) <= 1000 // 4 and all(m.value == 1.0 for m in logged)
    assert max(m.step for m in logged) == 2000  # the run's last step is always there


def test_the_harness_tolerates_an_abort_at_exit_only_after_a_clean_teardown():
    """run_ranks() treats torch's exit-time abort (after destroy_process_group) as finished, and an
    abort during the job as the failure it is."""
    assert run_ranks(workers.abort_at_exit, WORLD, "exit") == list(range(WORLD))
    with pytest.raises(torch.multiprocessing.ProcessExitedException, match="SIGABRT"):
        run_ranks(workers.abort_at_exit, WORLD, "job")


def test_sharded_replicas_are_refused_when_the_scheduler_is_built():
    """Averaging FSDP2 shards across ranks would mix slices of different tensors; it used to fail
    only at the first sync, with DTensor's 'c10d.allreduce_.default does not have a sharding strategy'."""
    res = run_ranks(workers.sharded_replicas_refused, 2)
    for rank in range(2):
        errors = res[rank]
        assert set(errors) == {"optimizer", "model"}, (rank, errors)
        assert "Expected every rank to hold a whole replica" in errors["optimizer"]
        assert "optimizer parameter 0 of param group 0 is a DTensor placed (Shard(dim=0),)" in errors["optimizer"]
        assert "the model's '0.weight' is a DTensor placed (Shard(dim=0),)" in errors["model"], errors["model"]
        assert "Train with DDP or plain replicas" in errors["model"]


@pytest.mark.parametrize("independent", [True, False], ids=["independent", "ddp"])
def test_a_checkpoint_rank_0_wrote_after_sync_now_resumes_every_rank_exactly(tmp_path, independent):
    """sync_now() averaged the parameters but not the optimizer's state, which differs per rank (weight
    decay, independent gradients): every rank resumed from rank 0's momentum and went elsewhere than
    the run that went on. Now every rank holds the same state after sync_now(); the independent
    replicas resume bit for bit (under DDP plain DDP itself agrees only to ~1e-9 across a restart)."""
    ckpt = str(tmp_path / "rank0.pt")
    res = run_ranks(workers.resume_from_rank0_after_sync_now, WORLD, independent, ckpt)
    assert all(r["momentum"] == res[0]["momentum"] for r in res)
    if independent:
        assert all(r["same"] for r in res), [r["max_diff"] for r in res]
    else:
        assert max(r["max_diff"] for r in res) < 1e-7, [r["max_diff"] for r in res]


def test_sync_now_leaves_optimizer_states_of_different_layouts_alone_on_every_rank():
    res = run_ranks(workers.sync_now_with_a_replica_without_optimizer_state, WORLD)
    assert all(r["kept"] for r in res)
    assert all(len(r["warnings"]) == 1 and "could not average the optimizer's state" in r["warnings"][0] for r in res)


def test_a_seed_per_rank_is_refused_at_the_first_sync_on_every_rank():
    """``seed=rank``: each rank drew its own permutations, so two replicas shared a multiplier (19 of
    20 steps in a 4-rank audit) and the controller read every rank's own; now every rank raises at
    the first sync, naming the ranks and the arguments to make equal."""
    res = run_ranks(workers.seed_per_rank, WORLD)
    for r in range(WORLD):
        assert res[r]["error_step"] == 4, res[r]
        assert "rank(s) [1, 2, 3]" in res[r]["message"] and "seed=" in res[r]["message"]
    # without spread every replica has the one multiplier 1: the seed decides nothing, nothing is refused
    assert all(r["error_step"] is None for r in run_ranks(workers.seed_per_rank, WORLD, 0.0))


def test_explored_values_end_on_the_shared_base_on_every_rank():
    """After the last step every rank holds the shared base of each explored hyperparameter (it
    held its own spread value), so a later phase's scheduler starts from one base everywhere."""
    res = run_ranks(workers.explored_after_the_end, WORLD)
    assert len({res[r]["during"][-2] for r in range(WORLD)}) == WORLD  # spread until the end
    for r in range(WORLD):
        (p_base,), (wd_base,) = res[r]["bases"]
        assert res[r]["after"] == (p_base, wd_base) == res[0]["after"], r
        assert res[r]["second"] == res[0]["second"] == ([p_base], [wd_base]), r


def test_bool_small_integer_float16_and_minus_inf_tensors_average_as_numbers():
    """An audit's findings: a bool mask buffer crashed the first sync (floor_divide on bool); uint8
    200 and 200 averaged to 72, int8 overflowed, int16 was refused by gloo; two float16 values of
    40,000 summed to inf, which then became the kept consensus; an additive -inf attention mask made
    every replica 'non-finite' at every sync; an expanded buffer crashed the write-back."""
    res = run_ranks(workers.unusual_buffers, 2)
    for r in range(2):
        assert res[r]["records"] == [([], []), ([], [])], res[r]["records"]  # nothing left out, no guard action
        b = res[r]["buffers"]
        assert b["u8"].tolist() == [200, 7] and b["i8"].tolist() == [100, -100] and b["i16"].tolist() == [20001]
        assert b["mask"].tolist() == [True, r == 0]  # left as each rank holds it
        assert b["causal"].tolist() == torch.full((3, 3), float("-inf")).triu(1).tolist()
        assert b["expanded"].tolist() == [float(r)] * 3
        assert torch.isfinite(res[r]["big"]).all() and abs(float(res[r]["big"][0]) - 40000) < 100


def test_sync_now_leaves_a_sparse_momentum_alone_with_a_warning():
    """SGD momentum on a sparse embedding keeps a sparse buffer: sync_now() (before every checkpoint
    of the integrations) failed with 'reshape is not implemented for sparse tensors'."""
    res = run_ranks(workers.sparse_momentum_sync_now, 2)
    assert all(len(r["warned"]) == 1 and "sparse" in r["warned"][0] for r in res)


def test_sync_now_makes_adams_step_one_after_a_guard_reset():
    """The reset replica's Adam restarted its step count; sync_now() averaged the moments but left
    'step' 6 on one rank and 2 on the other, so rank 0's checkpoint did not stand for rank 1."""
    res = run_ranks(workers.adam_step_after_a_reset, 2)
    assert res[0]["step"] == res[1]["step"] == 6.0  # the longer history's count, not a fraction
    assert torch.equal(res[0]["exp_avg"], res[1]["exp_avg"])


def test_a_rollback_restores_weights_loaded_after_the_scheduler_was_built():
    """The consensus was kept when the scheduler was built: a rollback before the first sync put
    the initial weights back over pretrained ones loaded afterwards."""
    res = run_ranks(workers.rollback_to_weights_loaded_after_build, 2)
    for r in res:
        assert r["guard"] == ["rollback"] and torch.equal(r["restored"], r["loaded"])


def test_a_tensor_that_changes_dtype_on_one_rank_stops_every_rank_at_the_next_sync():
    """The check raised on the rank whose tensors changed, before the sync's gather: the others
    waited in that gather until the process group's timeout. It now travels in the gathered row."""
    res = run_ranks(workers.layout_changed_on_one_rank, 2, timeout=120)
    for r in res:
        assert r["error_step"] == 8 and "on rank(s) [1] they changed" in r["message"], r


@pytest.mark.parametrize(
    ("milestone", "call_sync_now"),
    [(10, True), (11, False), (10, False)],
    ids=["milestone-then-sync_now", "milestone-after-hdets-last-step", "milestone-alone"],
)
def test_sequential_lr_hands_over_as_the_readme_says_and_resumes_exactly(tmp_path, milestone, call_sync_now):
    """SequentialLR([HDET(total_steps=10), ConstantLR]) on 2 ranks. At milestones=[10] SequentialLR
    steps ConstantLR instead of HDET's last step: no final sync, replicas that differ, per-rank weight
    decay in the next phase. The README's two ways out end HDET's phase on one consensus with the
    shared weight decay on every rank: sync_now() right after the milestone step (it wrote HDET's stale
    per-rank LRs, 2.8e-07 and 5.2e-07, over ConstantLR's 0.002, which ConstantLR then kept), or
    milestones=[11]. Resumed from a checkpoint after the milestone, loading HDET wrote its own stale LR
    (or OneCycle's formula past its end) over ConstantLR's; every resume now goes as the run did."""
    from torch.optim.lr_scheduler import ConstantLR, SequentialLR
    from torch.optim.lr_scheduler import OneCycleLR as PlainOneCycle

    res = run_ranks(workers.sequential_handover, 2, milestone, call_sync_now, str(tmp_path))
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ref = SequentialLR(opt, [PlainOneCycle(opt, 0.1, total_steps=10), ConstantLR(opt, 0.5, 100)], [milestone])
    plain = []
    for _ in range(14):
        opt.step()
        ref.step()
        plain.append(opt.param_groups[0]["lr"])
    assert plain[milestone - 1 :] == [0.1 / 25 * 0.5] * (15 - milestone)
    for r in range(2):
        assert res[r]["lrs"][milestone - 1 :] == plain[milestone - 1 :], r  # the next scheduler's LR from the milestone
        assert {k: v for k, v in res[r]["own"].items() if v is not None} == {}, r  # first step that went otherwise
    params_after_10 = [res[r]["params"][9] for r in range(2)]
    wds_after_10 = [res[r]["wds"][9:] for r in range(2)]
    assert not torch.equal(res[0]["params"][8], res[1]["params"][8])  # the replicas differ before
    if (milestone, call_sync_now) == (10, False):  # what the README warns of
        assert res[0]["last_sync"] == 5 and not torch.equal(*params_after_10)
        assert wds_after_10 == [[0.015] * 5, [0.005] * 5]
        return
    assert res[0]["last_sync"] == (9 if call_sync_now else 10)
    assert torch.equal(*params_after_10)  # one consensus that the next phase starts from
    assert res[0]["base_wd"] == [0.01] and wds_after_10 == [[0.01] * 5] * 2  # the shared base on every rank
    assert [res[r]["rank0"] for r in range(2)] == [None, None]  # rank 0's checkpoint resumes every rank


def test_hdet_after_a_warmup_in_sequential_lr_fans_out_ends_on_a_consensus_and_resumes_exactly():
    """HDET as the later scheduler of SequentialLR (after a LinearLR warm-up) on 2 ranks: the warm-up's
    LR on both ranks, then OneCycleLR's LR in the same place times each rank's multiplier, the
    parameters and the explored weight decay on one consensus after HDET's last step, and a run
    resumed from a checkpoint of any step (before, at and after the milestone) goes as the run did."""
    from torch.optim.lr_scheduler import LinearLR, SequentialLR
    from torch.optim.lr_scheduler import OneCycleLR as PlainOneCycle

    res = run_ranks(workers.sequential_after_a_warmup, 2)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    ref = SequentialLR(opt, [LinearLR(opt, 0.1, total_iters=5), PlainOneCycle(opt, 0.1, total_steps=10)], [5])
    plain = []
    for _ in range(15):
        opt.step()
        ref.step()
        plain.append(opt.param_groups[0]["lr"])
    for r in range(2):
        assert res[r]["lrs"][:4] == plain[:4], r  # the warm-up's, as without HDET
        ratios = {round(lr / p, 9) for lr, p in zip(res[r]["lrs"][4:14], plain[4:14])}
        assert ratios <= {0.7, 1.3}, (r, ratios)  # OneCycle's in the same place, fanned out
        assert {k: v for k, v in res[r]["own"].items() if v is not None} == {}, r
    assert [res[0]["lrs"][4], res[1]["lrs"][4]] != [plain[4]] * 2  # the replicas do differ
    assert not torch.equal(res[0]["params"][13], res[1]["params"][13])
    assert torch.equal(res[0]["params"][14], res[1]["params"][14])  # HDET's last step: one consensus
    assert res[0]["wds"][14] == res[1]["wds"][14] == 0.01  # and the shared weight decay


def test_sync_now_averages_a_scalar_parameters_moments_and_keeps_the_highest_step():
    """A 0-dim parameter's Adam moments became the highest replica's (taken for counts like Adam's
    step): with opposite gradients the momentum kept one rank's sign where the mean is near 0."""
    res = run_ranks(workers.sync_now_with_a_scalar_parameter, WORLD)
    for key in ("exp_avg", "exp_avg_sq"):
        mean = sum(r["before"][key] for r in res) / WORLD
        assert all(r["after"][key] == pytest.approx(mean, rel=1e-6, abs=1e-9) for r in res), (key, res)
    assert len({r["before"]["exp_avg"] for r in res}) > 1  # they did differ
    assert all(r["after"]["step"] == max(q["before"]["step"] for q in res) for r in res)


def test_a_parameter_the_optimizer_trains_outside_the_model_is_averaged_and_guarded():
    """With ``model=``, only the model's tensors were averaged: a parameter the optimizer trains
    beside it kept each rank's own value at every sync, and a NaN in it passed the guard."""
    res = run_ranks(workers.a_parameter_outside_the_model, WORLD)
    first = [r["syncs"][0]["temp"] for r in res]
    assert first == [first[0]] * WORLD and first[0] == pytest.approx(1.0 + 2 * (WORLD + 1) / 2)  # the mean
    second = [r["syncs"][1] for r in res]
    assert all(s["left_out"] == [1] for s in second), second  # the blown-up replica, found
    assert all(math.isfinite(s["temp"]) and s["temp"] == second[0]["temp"] for s in second), second

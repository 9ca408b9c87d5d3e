"""Hugging Face Trainer on 2 gloo replicas with hdet_track.wrap: fan-out, converge, W&B offline run."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from .examples_helpers import assert_synced_only_at, dumped_lrs, run_example
from .test_tracking_wandb import read_finished

pytest.importorskip("transformers")


def test_hf_trainer_example_into_a_wandb_offline_run(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    run_example(
        "hf_trainer.py",
        ["--steps", "30", "--output-dir", str(tmp_path / "out"), "--dump", str(dump)],
        tmp_path,
        {
            "HDET_TRACKER": "wandb",
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_DIR": str(tmp_path),
            "WANDB_PROJECT": "hf-test",
        },
    )
    assert_synced_only_at(dump, [10, 20, 30], between=15)
    files = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1  # Hugging Face's own W&B run holds both replicas
    contents = read_finished(files[0], timeout=60.0)  # a run Hugging Face finishes: wandb may still write it
    rows = {r["hdet/step"]: r for r in contents.history if "hdet/replica_00/lr" in r}
    assert sorted(rows) == list(range(1, 31))
    assert rows[1]["hdet/replica_00/lr"] < rows[1]["hdet/replica_01/lr"]  # fanned out from the first step
    assert all("hdet/replica_01/loss" in r for r in rows.values())


def test_hf_trainer_callback_form_into_the_mlflow_run_report_to_opened(tmp_path):
    from mlflow.tracking import MlflowClient

    dump = tmp_path / "dump"
    dump.mkdir()
    uri = f"sqlite:///{tmp_path / 'hf.db'}"
    run_example(
        "hf_trainer.py",
        [
            "--steps",
            "30",
            "--callback",
            "--eval-steps",
            "15",
            "--output-dir",
            str(tmp_path / "out"),
            "--dump",
            str(dump),
        ],
        tmp_path,
        {"MLFLOW_TRACKING_URI": uri, "HDET_TRACKER": "mlflow"},
    )
    assert_synced_only_at(dump, [10, 20, 30], between=15)
    # Each evaluation starts with the last sync's record complete: sync 10's divergences would
    # otherwise wait for sync 20's gather (its window was short).
    for rank in (0, 1):
        seen = [json.loads(line) for line in (dump / f"eval{rank}.jsonl").read_text().splitlines()]
        assert seen == [[15, 10, True], [30, 30, True]], rank
    client = MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].data.tags["hdet.world_size"] == "2"
    lr0 = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "hdet/replica_00/lr")}
    lr1 = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "hdet/replica_01/lr")}
    assert sorted(lr0) == list(range(1, 31)) and lr0[1] < lr1[1]
    loss = client.get_metric_history(runs[0].info.run_id, "hdet/replica_01/loss")
    assert len(loss) == 30 and all(m.value > 0 for m in loss)  # the loss came from the model's outputs


def test_gradient_accumulation_counts_one_hdet_step_per_optimizer_step(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import hdet_track

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    data = [{"input_ids": torch.randint(0, 32, (8,)), "labels": torch.randint(0, 32, (8,))} for _ in range(64)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        learning_rate=1e-3,
        warmup_steps=2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="no",
    )
    trainer = hdet_track.wrap(
        Trainer(model=model, args=args, train_dataset=data), sync_every=3, auto_lr=True, track=False
    )
    trainer.train()
    sched = trainer.lr_scheduler
    assert isinstance(sched, hdet_track.HDETScheduler)
    assert sched.total_steps == 6 and sched.last_epoch == 6  # 18 micro-batches, 6 optimizer steps
    assert sched.last_sync is not None and sched.last_sync.weights is not None  # fed with losses


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_resume_from_checkpoint_continues_the_schedule_and_the_run(tmp_path, form):
    """Killed right after a mid-window checkpoint, resumed with resume_from_checkpoint: every
    replica's LR at every step is the uninterrupted job's, and one MLflow run holds each step once."""
    from mlflow.tracking import MlflowClient

    from hdet_track.readers.mlflow import MLflowReader

    args = ["--steps", "40", "--save-steps", "15"]  # sync every 10: the checkpoint at 15 is mid-window
    args += ["--callback"] if form == "callback" else []
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir(), part.mkdir()
    env = {"HF_REPORT_TO": "none"}  # HDET's own tracker (track=True) owns the run
    full_uri, uri = f"sqlite:///{tmp_path / 'full.db'}", f"sqlite:///{tmp_path / 'resumed.db'}"
    run_example(
        "hf_trainer.py",
        [*args, "--output-dir", str(tmp_path / "o1"), "--dump", str(full)],
        tmp_path,
        env | {"MLFLOW_TRACKING_URI": full_uri},
    )
    out = str(tmp_path / "o2")
    env |= {"MLFLOW_TRACKING_URI": uri}
    run_example(
        "hf_trainer.py", [*args, "--output-dir", out, "--dump", str(part), "--kill-at", "15"], tmp_path, env, ok=False
    )
    client = MlflowClient(uri)
    (killed,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    run_example("hf_trainer.py", [*args, "--output-dir", out, "--dump", str(part), "--resume"], tmp_path, env)
    expected, got = dumped_lrs(full), dumped_lrs(part)
    for r in range(2):
        assert sorted(got[r]) == list(range(1, 41))
        assert [got[r][k] for k in range(1, 41)] == [expected[r][k] for k in range(1, 41)], r
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_id for r in runs] == [killed.info.run_id]  # the resumed job continued the same run
    assert runs[0].info.status == "FINISHED"
    run = MLflowReader(uri).read(killed.info.run_id)
    full_client = MlflowClient(full_uri)
    (reference,) = [r for e in full_client.search_experiments() for r in full_client.search_runs([e.experiment_id])]
    reference = MLflowReader(full_uri).read(reference.info.run_id)
    for r in range(2):
        steps, lrs = run.replica_series("lr", r)
        assert list(steps) == list(range(1, 41))  # every step once: none doubled, none dropped
        assert list(lrs) == list(reference.replica_series("lr", r)[1])  # the uninterrupted run's, exactly
    history = [m.step for m in client.get_metric_history(killed.info.run_id, "hdet/replica_01/loss")]
    assert len(history) == len(set(history))
    assert [e.step for e in run.converge] == [10, 15, 20, 30, 40]  # converged at the checkpoint too


# A sweep in one process (as a loop over trials or Optuna runs it): each trial's train() may raise
# after its last step (here the final evaluation's compute_metrics) and the loop goes on.
_SWEEP_JOB = """
import os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import hdet_track
from hdet_track.tracking.mlflow import MLflowTracker

URI = sys.argv[1]

def failing_metrics(_):
    raise RuntimeError("compute_metrics failed in the final evaluation")

def trainer(name, report_to=()):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    data = [{"input_ids": torch.randint(0, 32, (8,)), "labels": torch.randint(0, 32, (8,))} for _ in range(32)]
    args = TrainingArguments(
        output_dir=os.path.join(os.getcwd(), name), max_steps=6, per_device_train_batch_size=4,
        learning_rate=1e-3, report_to=list(report_to), use_cpu=True, save_strategy="no", disable_tqdm=True,
        logging_strategy="no", eval_strategy="steps", eval_steps=6, run_name=name,
    )
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8],
                   compute_metrics=failing_metrics)

def trial(t):
    try:
        t.train()
    except RuntimeError as exc:
        assert str(exc) == "compute_metrics failed in the final evaluation"  # re-raised unchanged
        return "raised"
    return "returned"

t = hdet_track.wrap(trainer("sweep"), sync_every=3, track=MLflowTracker(tracking_uri=URI, run_name="fails"))
assert trial(t) == "raised"
t.compute_metrics = None  # the next trial, same trainer: it trains and evaluates normally
assert trial(t) == "returned"
t.lr_scheduler.log_metrics({"val_loss": 0.25})  # after train(): into that trial's run
os.environ["MLFLOW_TRACKING_URI"] = URI
r = hdet_track.wrap(trainer("hf_run", report_to=["mlflow"]), sync_every=3)  # Hugging Face's own run
assert trial(r) == "raised"
print("sweep done", flush=True)
"""


def test_train_raising_after_its_last_step_ends_the_run_failed_and_a_normal_train_finished(tmp_path):
    """train() raises after the last step and the caller catches it: that run is FAILED with the
    error, not FINISHED at the process's exit; the next train() of the same trainer ends FINISHED,
    with a metric logged after train() returned; a report_to="mlflow" run fails the same way."""
    import subprocess
    import sys

    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'sweep.db'}"
    script = tmp_path / "sweep_job.py"
    script.write_text(_SWEEP_JOB)
    proc = subprocess.run([sys.executable, str(script), uri], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "sweep done" in proc.stdout, proc.stderr[-4000:]
    reader = MLflowReader(uri)
    runs = {}
    for summary in reader.list_runs():
        runs.setdefault(summary.name, []).append(reader.read(summary.run_id))
    assert sorted(runs) == ["fails", "hf_run"] and len(runs["fails"]) == 2, {k: len(v) for k, v in runs.items()}
    failed, finished = sorted(runs["fails"], key=lambda run: run.status)
    assert failed.status == "FAILED"
    assert "RuntimeError: compute_metrics failed in the final evaluation" in failed.tags["hdet.error"]
    assert "val_loss" not in failed.metrics
    assert finished.status == "FINISHED" and "hdet.error" not in finished.tags
    steps, values = finished.metrics["val_loss"]
    assert list(values) == [0.25] and list(steps) == [6]  # not dropped: the run stayed open after train()
    for run in (failed, finished):
        assert list(run.mean_series("loss")[0]) == list(range(1, 7))  # every step, before the end
    (hf_run,) = runs["hf_run"]
    assert hf_run.status == "FAILED"  # not ended FINISHED by MLflow's own exit hook
    assert "RuntimeError: compute_metrics failed in the final evaluation" in hf_run.tags["hdet.error"]


def test_a_typo_in_hdets_arguments_fails_when_the_callback_is_built():
    from hdet_track.integrations.transformers import HDETTrainerCallback

    with pytest.raises(TypeError, match=r"HDETTrainerCallback got unexpected keyword arguments \['sprad'\]"):
        HDETTrainerCallback(sprad=0.2)
    with pytest.raises(TypeError, match=r"\['close_at_end'\]"):  # the callback decides that one
        HDETTrainerCallback(close_at_end=True)
    HDETTrainerCallback(spread=0.2, sync_every=100, auto_lr=True)


def _tiny_trainer(out, callbacks=(), examples=40, **kwargs):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    gen = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": torch.randint(0, 32, (8,), generator=gen), "labels": torch.randint(0, 32, (8,), generator=gen)}
        for _ in range(examples)
    ]
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-2,
        use_cpu=True, disable_tqdm=True, **{"max_steps": 10, "report_to": [], "logging_strategy": "no", **kwargs},
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:8], callbacks=list(callbacks))


def _lr_recorder():
    from transformers import TrainerCallback

    class LRs(TrainerCallback):
        seen: dict = {}

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            self.seen[state.global_step] = optimizer.param_groups[0]["lr"]

    rec = LRs()
    rec.seen = {}
    return rec


def test_callback_form_checkpoints_and_resumes_from_a_checkpoint_anywhere(tmp_path):
    """The callback form used to fail at its first checkpoint (the Trainer's scheduler.pt pickled
    the patched scheduler), and looked for HDET's state under its own output_dir. HDET's state now
    rides in that scheduler.pt, converged: a resume from another directory's checkpoint continues the
    schedule exactly."""
    from hdet_track.integrations.transformers import HDETTrainerCallback

    kwargs = dict(save_strategy="steps", save_steps=5)
    full, rec = HDETTrainerCallback(sync_every=3, auto_lr=True, track=False), _lr_recorder()
    _tiny_trainer(tmp_path / "a", [full, rec], **kwargs).train()
    assert full.scheduler.last_epoch == 10 and sorted(rec.seen) == list(range(1, 11))
    state = torch.load(tmp_path / "a" / "checkpoint-5" / "scheduler.pt", weights_only=True)
    assert state["hdet_scheduler"]["onecycle"]["last_epoch"] == 5
    assert len(state["hdet_scheduler"]["window"]["losses"]) == 0  # converged before the checkpoint

    resumed, rec2 = HDETTrainerCallback(sync_every=3, auto_lr=True, track=False), _lr_recorder()
    _tiny_trainer(tmp_path / "b", [resumed, rec2], **kwargs).train(
        resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-5")
    )
    assert resumed.scheduler.last_epoch == 10
    assert rec2.seen == {k: rec.seen[k] for k in range(6, 11)}  # the uninterrupted schedule, exactly


@pytest.mark.parametrize("form", ["wrap", "callback"])
@pytest.mark.parametrize("strategy", ["epoch", "best"])
def test_a_checkpoint_at_an_epoch_end_or_a_new_best_holds_one_consensus(tmp_path, strategy, form):
    """Checkpoints the Trainer decides on at an epoch's end or after an evaluation (a new best) are
    converged first too, not only those of save_strategy="steps": 5 steps per epoch, syncs every 3,
    so step 5 is mid-window."""
    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    kwargs = dict(save_strategy=strategy, examples=20)
    if strategy == "best":
        kwargs |= dict(eval_strategy="steps", eval_steps=5, metric_for_best_model="loss")
    if form == "wrap":
        trainer = hdet_track.wrap(_tiny_trainer(tmp_path, **kwargs), sync_every=3, auto_lr=True, track=False)
    else:
        trainer = _tiny_trainer(tmp_path, [HDETTrainerCallback(sync_every=3, auto_lr=True, track=False)], **kwargs)
    trainer.train()
    state = torch.load(tmp_path / "checkpoint-5" / "scheduler.pt", weights_only=True)["hdet_scheduler"]  # both forms
    assert state["onecycle"]["last_epoch"] == 5
    assert len(state["window"]["losses"]) == 0


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_save_strategy_best_evaluates_the_consensus_it_would_save(tmp_path, form):
    """With save_strategy="best" the Trainer decides to save from the evaluation just before the
    save. The evaluation used to run on the replicas' weights before the sync and the save on those
    after it, so the metric that picked the checkpoint was not the checkpoint's. Now the sync comes
    first: at every evaluation step the window is empty (syncs every 3 steps, evaluations at 5, 10)."""
    from transformers import TrainerCallback

    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    class Windows(TrainerCallback):
        seen: list

        def on_prediction_step(self, args, state, control, **kwargs):
            self.seen.append((state.global_step, len(scheduler()._converger.losses)))

    probe = Windows()
    probe.seen = []
    kwargs = dict(save_strategy="best", eval_strategy="steps", eval_steps=5, metric_for_best_model="loss", examples=20)
    if form == "wrap":
        trainer = hdet_track.wrap(_tiny_trainer(tmp_path, [probe], **kwargs), sync_every=3, auto_lr=True, track=False)
        scheduler = lambda: trainer.lr_scheduler  # noqa: E731
    else:
        callback = HDETTrainerCallback(sync_every=3, auto_lr=True, track=False)
        trainer = _tiny_trainer(tmp_path, [callback, probe], **kwargs)
        scheduler = lambda: callback.scheduler  # noqa: E731
    trainer.train()
    assert {step for step, _ in probe.seen} == {5, 10}
    assert [n for _, n in probe.seen] == [0] * len(probe.seen)


class _PlainLM(torch.nn.Module):
    """A model whose forward takes no loss kwargs: the Trainer divides its loss by the accumulation."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def _step_losses():
    """A scheduler callback recording each sync's window losses (sync_every=1: each replica's step loss)."""
    from hdet_track.record import SchedulerCallback

    class Losses(SchedulerCallback):
        def __init__(self):
            self.seen = {}

        def on_sync(self, record):
            self.seen[record.step] = record.window_losses

    return Losses()


def _fed_and_trainers(tmp_path, form, model, steps=4, rank=0, callbacks=(), sync_every=1, masked=0.0, **kwargs):
    """Train ``model`` with HDET in ``form``; (this rank's window loss per sync, the Trainer's own
    loss per step, the trainer, HDET's scheduler). ``masked``: the share of labels set to -100."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    torch.manual_seed(0)
    net = (
        GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2))
        if model == "gpt2"
        else _PlainLM()
    )
    gen = torch.Generator().manual_seed(1 + rank)
    data = [
        {"input_ids": torch.randint(0, 32, (8,), generator=gen), "labels": torch.randint(0, 32, (8,), generator=gen)}
        for _ in range(64)
    ]
    for row in data:
        row["labels"][torch.rand(8, generator=gen) < masked] = -100
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out-{form}-{model}"), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no",
        save_strategy="no", **kwargs,
    )  # fmt: skip
    losses = _step_losses()
    hdet = dict(sync_every=sync_every, spread=0.2, track=False, callbacks=[losses])
    extra = [HDETTrainerCallback(**hdet)] if form == "callback" else []
    trainer = Trainer(model=net, args=args, train_dataset=data, callbacks=[*callbacks, *extra])
    own, step_losses = [], []
    original = trainer.training_step

    def training_step(*a, **k):  # the Trainer's own loss of each micro-batch, summed per optimizer step
        loss = original(*a, **k)
        own.append(float(loss))
        return loss

    trainer.training_step = training_step
    if form == "wrap":
        trainer = hdet_track.wrap(trainer, **hdet)
    accumulate = args.gradient_accumulation_steps
    trainer.train()
    step_losses = [sum(own[i : i + accumulate]) for i in range(0, len(own), accumulate)]
    return (
        {k: v[rank] for k, v in losses.seen.items()},
        step_losses,
        trainer,
        (extra[0].scheduler if extra else trainer.lr_scheduler),
    )


@pytest.mark.parametrize("model", ["gpt2", "plain"])
@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_both_forms_feed_hdet_the_trainers_own_loss_of_each_step(tmp_path, form, model):
    """The callback form reads the model's output. A Hugging Face model given num_items_in_batch
    (GPT-2) returns a loss already normalised over the accumulated step, which the callback divided
    by the accumulation again: HDET got a third of the loss with gradient_accumulation_steps=3."""
    fed, trainers, *_ = _fed_and_trainers(tmp_path, form, model, gradient_accumulation_steps=3)
    assert sorted(fed) == [1, 2, 3, 4] and len(trainers) == 4
    assert [fed[k] for k in sorted(fed)] == pytest.approx(trainers, rel=1e-5)


def _two_rank_worker(tmp_path, form):
    """One rank of a 2-rank gloo DDP Trainer stopped early at step 4 of 6 (syncs every 3)."""
    import torch.distributed as dist
    from transformers import TrainerCallback

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                control.should_training_stop = True

    class Own(TrainerCallback):  # this rank's loss summed over its own labels, and their counts, each step
        sums: list = []

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            def hook(module, inputs, kw, output):
                if module.training:
                    logits, labels = output.logits[:, :-1].float(), kw["labels"]
                    ce = torch.nn.functional.cross_entropy(
                        logits.reshape(-1, 32), labels[:, 1:].reshape(-1), reduction="sum"
                    )
                    counts = {True: int(labels[:, 1:].ne(-100).sum()), False: int(labels.ne(-100).sum())}
                    self.sums.append((float(ce), counts))

            model.register_forward_hook(hook, with_kwargs=True)

    rank = int(os.environ["RANK"])
    own = Own()
    fed, trainers, trainer, sched = _fed_and_trainers(
        tmp_path / f"rank{rank}", form, "gpt2", steps=6, rank=rank, callbacks=[Stop(), own], sync_every=3,
        ddp_backend="gloo", masked=0.6 if rank == 0 else 0.1,
    )  # fmt: skip
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    return {
        "fed": fed,
        "trainers": trainers,
        # one micro-batch per step, over the items as the Trainer counts them on one process
        "own": [s / n[trainer._loss_shifts_labels] for s, n in own.sums],
        "apart": float((gathered[0] - gathered[1]).abs().max()),
        "last_epoch": sched.last_epoch,
    }


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_two_ranks_feed_each_ranks_own_loss_and_an_early_stop_ends_on_one_consensus(tmp_path, form):
    """Under DDP the callback form fed HDET half the loss (the model's loss is normalised over both
    ranks' items and the Trainer scales it back), and both forms fed a rank's mean skewed by its
    share of the items (the Trainer's loss is this rank's sum over both ranks' items, x2: rank 0,
    with most labels masked, looked better than it was); and a training stopped early (step 4 of
    6, syncs every 3) ended with each rank's own replica, so the model saved next was rank 0's alone."""
    from hdet_track.launch import launch_local

    results = launch_local(_two_rank_worker, 2, tmp_path, form)
    for r in results.values():
        assert r["last_epoch"] == 4 and len(r["trainers"]) == 4 and len(r["own"]) == 4
        assert sorted(r["fed"]) == [3, 4]  # the sync at 3, and the one the early stop made at 4
        assert r["fed"][3] == pytest.approx(sum(r["own"][:3]) / 3, rel=1e-5)  # the window's mean
        assert r["fed"][4] == pytest.approx(r["own"][3], rel=1e-5)
        assert r["apart"] == 0.0  # converged before train() returned
    assert results[0]["trainers"][3] != pytest.approx(results[0]["own"][3], rel=0.05)  # the skew is there
    assert results[0]["fed"][3] != pytest.approx(results[1]["fed"][3])  # each rank's own batches


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_a_skipped_optimizer_step_adds_no_loss_to_the_next_and_training_ends_on_a_consensus(tmp_path, form):
    """An optimizer step skipped on an overflow (fp16's GradScaler; injected here as accelerate's
    overflow flag) is not a scheduler step: its loss was summed into the next step's, and HDET,
    one step short at the end, never made its last sync."""
    from transformers import TrainerCallback

    class Overflow(TrainerCallback):  # the fault: accelerate reports step 2's update as skipped
        def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            optimizer._is_overflow = state.global_step + 1 == 2

    fed, trainers, trainer, sched = _fed_and_trainers(tmp_path, form, "gpt2", steps=4, callbacks=[Overflow()])
    assert len(trainers) == 4 and sched.last_epoch == 3  # three scheduler steps
    assert [fed[k] for k in sorted(fed)] == pytest.approx([trainers[0], trainers[2], trainers[3]], rel=1e-5)
    assert sched.last_sync is not None and sched.last_sync.step == 3


def test_wrap_refuses_a_trainer_given_its_own_scheduler(tmp_path):
    """wrap() used to leave a scheduler given in optimizers=(opt, sched) in charge: no HDET at all."""
    from transformers import Trainer

    import hdet_track

    base = _tiny_trainer(tmp_path)
    opt = torch.optim.SGD(base.model.parameters(), lr=0.1)
    given = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    trainer = Trainer(model=base.model, args=base.args, train_dataset=base.train_dataset, optimizers=(opt, given))
    with pytest.raises(ValueError, match=r"given LambdaLR in optimizers=.*optimizers=\(optimizer, None\)"):
        hdet_track.wrap(trainer, track=False)
    hdet_track.wrap(_tiny_trainer(tmp_path / "b"), track=False)  # the Trainer's own: replaced


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps", eval_steps=5),
            r"lr_scheduler_type='linear' .* but got 'reduce_lr_on_plateau'",
        ),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0"),
        (dict(lr_scheduler_type="cosine"), r"Expected lr_scheduler_type='linear' .* but got 'cosine'"),
    ],
)
def test_the_callback_form_refuses_what_it_cannot_drive(tmp_path, kwargs, message):
    """ReduceLROnPlateau is stepped by the Trainer after evaluations only (HDET got 3 steps of 9,
    with the eval loss); with label smoothing the model's output has no loss (auto-LR failed mid-run)."""
    from hdet_track.integrations.transformers import HDETTrainerCallback

    callback = HDETTrainerCallback(sync_every=3, auto_lr=True, track=False)
    with pytest.raises(ValueError, match=message):
        _tiny_trainer(tmp_path, [callback], **kwargs).train()
    assert callback.scheduler is None  # refused before anything was built


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr_scheduler_type="cosine_with_restarts", lr_scheduler_kwargs={"num_cycles": 3}), "but got 'cosine_with"),
        (
            dict(lr_scheduler_kwargs={"power": 2.0}),
            r"Expected no lr_scheduler_kwargs with HDET, but got \{'power': 2.0\}",
        ),
    ],
)
def test_a_schedule_chosen_in_the_arguments_is_refused_not_replaced_in_silence(tmp_path, kwargs, message):
    """The Trainer's arguments chose a schedule: HDET's OneCycle took its place without a word
    (Lightning's integration refuses a scheduler other than OneCycleLR)."""
    import hdet_track

    with pytest.raises(ValueError, match=message):
        hdet_track.wrap(_tiny_trainer(tmp_path, **kwargs), track=False)


def test_the_callback_form_refuses_a_scheduler_given_to_the_trainer(tmp_path):
    """optimizers=(opt, StepLR(...)): the callback form took the StepLR over in silence (``wrap``
    refuses it); a ReduceLROnPlateau given there was blamed on lr_scheduler_type, the default."""
    from transformers import Trainer

    from hdet_track.integrations.transformers import HDETTrainerCallback

    for make in (lambda o: torch.optim.lr_scheduler.StepLR(o, 2), torch.optim.lr_scheduler.ReduceLROnPlateau):
        base = _tiny_trainer(tmp_path)
        opt = torch.optim.SGD(base.model.parameters(), lr=0.1)
        callback = HDETTrainerCallback(sync_every=3, track=False)
        trainer = Trainer(
            model=base.model, args=base.args, train_dataset=base.train_dataset, optimizers=(opt, make(opt)),
            callbacks=[callback],
        )  # fmt: skip
        with pytest.raises(ValueError, match=r"given (StepLR|ReduceLROnPlateau) in optimizers=.*\(optimizer, None\)"):
            trainer.train()
        assert callback.scheduler is None


def test_the_callback_form_refuses_to_resume_from_a_checkpoint_without_hdet(tmp_path):
    """A checkpoint of a run without HDET: HDET silently started its schedule again (warm-up at step 7)."""
    from hdet_track.integrations.transformers import HDETTrainerCallback

    _tiny_trainer(tmp_path / "plain", save_strategy="steps", save_steps=5).train()
    callback = HDETTrainerCallback(sync_every=3, track=False)
    with pytest.raises(ValueError, match=r"resumed at step 5 from one whose scheduler.pt holds no HDET state"):
        _tiny_trainer(tmp_path / "b", [callback]).train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-5"))


class _NoLossLM(_PlainLM):
    def forward(self, input_ids, labels=None):  # a tuple without the loss: the Trainer's compute_loss_func adds it
        return (self.out(self.emb(input_ids)),)


def test_the_callback_form_says_why_when_the_model_gives_no_loss(tmp_path, caplog):
    from transformers import Trainer

    from hdet_track.integrations.transformers import HDETTrainerCallback

    def loss_func(outputs, labels, num_items_in_batch=None):
        return torch.nn.functional.cross_entropy(outputs[0].reshape(-1, 32), labels.reshape(-1))

    base = _tiny_trainer(tmp_path)
    for auto_lr in (True, False):
        callback = HDETTrainerCallback(sync_every=3, auto_lr=auto_lr, track=False)
        trainer = Trainer(model=_NoLossLM(), args=base.args, train_dataset=base.train_dataset, callbacks=[callback],
                          compute_loss_func=loss_func)  # fmt: skip
        if auto_lr:
            with pytest.raises(ValueError, match=r"use hdet_track.wrap\(trainer\)"):
                trainer.train()
        else:
            trainer.train()
            assert callback.scheduler.last_epoch == 10
            assert caplog.text.count("this step's had none") == 1  # said once


def test_report_to_mlflow_and_wandb_puts_hdets_series_in_both_runs(tmp_path, monkeypatch):
    """report_to=["mlflow", "wandb"]: HDET went into the MLflow run only, the W&B run got nothing."""
    import hdet_track
    from hdet_track.readers.mlflow import MLflowReader
    from hdet_track.readers.wandb import WandbReader

    uri = f"sqlite:///{tmp_path / 'both.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    trainer = hdet_track.wrap(_tiny_trainer(tmp_path / "out", report_to=["mlflow", "wandb"]), sync_every=5)
    trainer.train()
    sched = trainer.lr_scheduler
    ids = dict(sched.run_ids)
    sched.close()
    import mlflow
    import wandb

    if mlflow.active_run() is not None:
        mlflow.end_run()
    root = wandb.run.settings.root_dir  # W&B's process-wide settings may hold an earlier test's WANDB_DIR
    wandb.run.finish()
    assert sorted(ids) == ["mlflow", "wandb"]
    for run in (MLflowReader(uri).read(ids["mlflow"]), WandbReader(root).read(ids["wandb"])):
        assert sorted(set(run.steps.step.tolist())) == list(range(1, 11))
        assert [c.step for c in run.converge] == [5, 10]


def test_report_to_mlflow_follows_the_store_mlflow_was_pointed_at_in_code(tmp_path, monkeypatch):
    """``mlflow.set_tracking_uri()`` in code wins over ``$MLFLOW_TRACKING_URI`` in MLflow, so Hugging
    Face opens its run there; HDET looked for that run in the environment's store, found none and
    logged nothing. (MLflow sets the variable too; it differs once the variable is set after, as
    when a Lightning MLFlowLogger earlier in the process pointed MLflow elsewhere.)"""
    import mlflow
    import mlflow.tracking._tracking_service.utils as tracking_utils

    import hdet_track
    from hdet_track.readers.mlflow import MLflowReader

    code, env = f"sqlite:///{tmp_path / 'code.db'}", f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setattr(tracking_utils, "_tracking_uri", None)  # MLflow's process-wide URI, put back after
    mlflow.set_tracking_uri(code)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env)
    trainer = hdet_track.wrap(_tiny_trainer(tmp_path / "out", report_to=["mlflow"]), sync_every=5)
    trainer.train()
    sched = trainer.lr_scheduler
    run_id = sched.run_ids.get("mlflow")
    sched.close()
    if mlflow.active_run() is not None:
        mlflow.end_run()
    assert run_id is not None
    run = MLflowReader(code).read(run_id)
    assert sorted(set(run.steps.step.tolist())) == list(range(1, 11)) and [c.step for c in run.converge] == [5, 10]


def test_hdets_means_do_not_mix_into_the_loss_hugging_face_logs_in_its_mlflow_run(tmp_path, monkeypatch):
    """Both logged ``loss`` into Hugging Face's MLflow run: two different values at each logged step
    (HDET's replica mean and the Trainer's mean over its logging interval) in one chart."""
    from mlflow.tracking import MlflowClient

    import hdet_track
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'hf.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    kwargs = dict(report_to=["mlflow"], logging_strategy="steps", logging_steps=2)
    trainer = hdet_track.wrap(_tiny_trainer(tmp_path / "out", **kwargs), sync_every=5, auto_lr=True)
    trainer.train()
    run_id = trainer.lr_scheduler.run_ids["mlflow"]
    trainer.lr_scheduler.close()
    client = MlflowClient(uri)
    hf = client.get_metric_history(run_id, "loss")
    assert [m.step for m in hf] == [2, 4, 6, 8, 10]  # the Trainer's own, alone
    ours = client.get_metric_history(run_id, "hdet/loss")
    assert [m.step for m in ours] == list(range(1, 11))
    run = MLflowReader(uri).read(run_id)
    (summary,) = MLflowReader(uri).list_runs()
    assert summary.final_loss == pytest.approx(run.final_loss()) == pytest.approx(ours[-1].value)


def _failing_rank_worker(tmp_path, uri):
    """One rank of a 2-rank gloo DDP Trainer (wrap form, tracked to MLflow); rank 1 raises at step 3."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import hdet_track
    from hdet_track.tracking.mlflow import MLflowTracker

    rank = int(os.environ["RANK"])

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step == 3:
                raise RuntimeError("boom on rank 1")

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1 + rank)
    data = [
        {"input_ids": torch.randint(0, 32, (8,), generator=gen), "labels": torch.randint(0, 32, (8,))}
        for _ in range(64)
    ]
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out{rank}"), max_steps=8, per_device_train_batch_size=2, learning_rate=1e-2,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no", save_strategy="no", ddp_backend="gloo",
    )  # fmt: skip
    trainer = Trainer(model=_PlainLM(), args=args, train_dataset=data, callbacks=[Boom()])
    trainer = hdet_track.wrap(trainer, sync_every=2, spread=0.2, track=MLflowTracker(tracking_uri=uri))
    trainer.train()


def test_a_rank_that_fails_fails_the_run_with_its_own_error(tmp_path):
    """Under torchrun the rank that raises first takes the others down: rank 0 then fails on a
    collective, and the run ended FAILED with rank 0's "Connection closed by peer" rather than the
    error that stopped the training. The failing rank leaves a note as train() fails; rank 0 ends
    the run with it."""
    from hdet_track.launch import launch_local
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'hf.db'}"
    with pytest.raises(Exception, match="boom on rank 1|ChildFailedError|failed"):
        launch_local(_failing_rank_worker, 2, tmp_path, uri)
    reader = MLflowReader(uri)
    (summary,) = reader.list_runs()
    run = reader.read(summary.run_id)
    assert run.status == "FAILED"
    error = run.tags["hdet.error"]
    assert error.startswith("rank 1 failed:") and "RuntimeError: boom on rank 1" in error, error


def _hdet_in(form, trainer_kwargs, tmp_path, callbacks=(), **hdet):
    """A tiny trainer with HDET in ``form`` (and ``callbacks``); (trainer, the callback or None)."""
    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    hdet = dict(sync_every=3, track=False) | hdet
    cb = HDETTrainerCallback(**hdet) if form == "callback" else None
    trainer = _tiny_trainer(tmp_path, [*callbacks, *([cb] if cb else [])], **trainer_kwargs)
    return (hdet_track.wrap(trainer, **hdet) if form == "wrap" else trainer), cb


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_each_param_groups_own_lr_is_its_peak_as_hugging_faces_schedulers_scale_it(tmp_path, form):
    """Every group peaked at args.learning_rate: a group the user gave 1e-4 trained at 1e-2."""
    from transformers import TrainerCallback

    peaks: dict[int, float] = {}

    class Peaks(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            for i, g in enumerate(optimizer.param_groups):
                peaks[i] = max(peaks.get(i, 0.0), g["lr"])

    trainer, _ = _hdet_in(form, {}, tmp_path, [Peaks()])
    params = list(trainer.model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2], "lr": 1e-4}, {"params": params[2:], "lr": 3e-3}])
    trainer.optimizer = opt  # as optimizers=(opt, None) gives it
    trainer.train()
    assert peaks[0] == pytest.approx(1e-4, rel=1e-6) and peaks[1] == pytest.approx(3e-3, rel=1e-6)


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_a_run_name_given_to_hdet_names_the_run(tmp_path, form, monkeypatch):
    """run_name= was accepted and then replaced by args.run_name (None): MLflow made up a name."""
    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'names.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    trainer, cb = _hdet_in(form, {}, tmp_path, track="mlflow", run_name="my-hdet-run")
    trainer.train()
    (cb.scheduler if cb else trainer.lr_scheduler).close()
    (run,) = MLflowReader(uri).list_runs("hdet")
    assert run.name == "my-hdet-run"


@pytest.mark.parametrize("form", ["wrap", "callback"])
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"log_every": 0}, "log_every to be an integer >= 1, but got 0"),
        ({"spread": 1.5}, "spread"),
        ({"sync_every": 0}, "sync_every to be an integer >= 1, but got 0"),
        ({"compare_group": 5}, "compare_group"),
        ({"controller": "nope"}, "nope"),
    ],
)
def test_bad_values_fail_when_the_wrapper_is_built_not_when_training_starts(tmp_path, form, kwargs, message):
    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    with pytest.raises((ValueError, TypeError), match=message):
        if form == "wrap":
            hdet_track.wrap(_tiny_trainer(tmp_path), **kwargs)
        else:
            HDETTrainerCallback(**kwargs)


@pytest.mark.parametrize("first, second", [("wrap", "callback"), ("callback", "wrap")])
def test_a_checkpoint_of_either_form_resumes_with_the_other(tmp_path, first, second):
    """wrap's scheduler.pt raised KeyError 'lr_lambdas' inside torch when the callback form resumed
    it; the callback form's raised CheckpointMismatchError in wrap, with HDET's state right there."""
    kwargs = dict(save_strategy="steps", save_steps=5)
    rec = _lr_recorder()
    trainer, _ = _hdet_in(first, kwargs, tmp_path / "a", [rec], auto_lr=True)
    trainer.train()
    rec2 = _lr_recorder()
    trainer, cb = _hdet_in(second, kwargs, tmp_path / "b", [rec2], auto_lr=True)
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-5"))
    assert (cb.scheduler if cb else trainer.lr_scheduler).last_epoch == 10
    assert rec2.seen == {k: rec.seen[k] for k in range(6, 11)}  # the uninterrupted schedule, exactly


def test_wrap_refuses_to_resume_from_a_checkpoint_without_hdet(tmp_path):
    _tiny_trainer(tmp_path / "plain", save_strategy="steps", save_steps=5).train()
    trainer, _ = _hdet_in("wrap", {}, tmp_path / "b")
    with pytest.raises(ValueError, match=r"resumed at step 5 from one whose scheduler.pt holds no HDET state"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-5"))


def test_a_resume_into_the_new_run_hugging_face_opened_says_so_and_mlflow_run_id_continues_the_old(
    tmp_path, monkeypatch, caplog
):
    """report_to="mlflow" and resume_from_checkpoint: Hugging Face opens a new run per train(), so
    the resumed training's HDET series went to a second run without a word."""
    import mlflow

    from hdet_track.readers.mlflow import MLflowReader

    uri = f"sqlite:///{tmp_path / 'hf.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    kwargs = dict(report_to=["mlflow"], save_strategy="steps", save_steps=6)
    first, _ = _hdet_in("wrap", kwargs, tmp_path / "a", track=True)
    first.train()
    old = first.lr_scheduler.run_ids["mlflow"]
    first.lr_scheduler.close()
    if mlflow.active_run() is not None:
        mlflow.end_run()
    checkpoint = str(tmp_path / "a" / "checkpoint-6")

    second, _ = _hdet_in("wrap", kwargs, tmp_path / "b", track=True)
    with caplog.at_level("WARNING", logger="hdet_track.integrations.transformers"):
        second.train(resume_from_checkpoint=checkpoint)
    new = second.lr_scheduler.run_ids["mlflow"]
    second.lr_scheduler.close()
    if mlflow.active_run() is not None:
        mlflow.end_run()
    assert new != old
    assert f"the steps before the checkpoint stay in run {old}; set MLFLOW_RUN_ID={old}" in caplog.text

    caplog.clear()
    monkeypatch.setenv("MLFLOW_RUN_ID", old)  # Hugging Face's own way to continue a run
    third, _ = _hdet_in("wrap", kwargs, tmp_path / "c", track=True)
    with caplog.at_level("WARNING", logger="hdet_track.integrations.transformers"):
        third.train(resume_from_checkpoint=checkpoint)
    assert third.lr_scheduler.run_ids["mlflow"] == old and "Hugging Face opened" not in caplog.text
    third.lr_scheduler.close()
    if mlflow.active_run() is not None:
        mlflow.end_run()
    run = MLflowReader(uri).read(old)
    steps = run.steps.step.tolist()
    assert sorted(set(steps)) == list(range(1, 11)) and len(steps) == len(set(steps))  # each step once


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_a_second_train_reporting_to_mlflow_logs_the_trainers_and_hdets_metrics_into_one_run(
    tmp_path, monkeypatch, form
):
    """Hugging Face's MLflowCallback opens its run at the first train() only: at a second train() of the
    same Trainer its metrics went to a run MLflow started by itself and HDET's series into one of HDET's
    own (two runs, each half of the training)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    uri = f"sqlite:///{tmp_path / 'twice.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "twice")
    kwargs = dict(report_to=["mlflow"], logging_strategy="steps", logging_steps=1)
    if form == "wrap":
        trainer = hdet_track.wrap(_tiny_trainer(tmp_path, **kwargs), sync_every=3)
        last = lambda: trainer.lr_scheduler  # noqa: E731
    else:
        callback = HDETTrainerCallback(sync_every=3)
        trainer = _tiny_trainer(tmp_path, [callback], **kwargs)
        last = lambda: callback.scheduler  # noqa: E731
    try:
        trainer.train()
        first = last().run_ids["mlflow"]
        trainer.train()
        second = last().run_ids["mlflow"]
        last().close()
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("twice").experiment_id])
    assert len(runs) == 2 and first != second
    for run_id in (first, second):
        assert [m.step for m in client.get_metric_history(run_id, "hdet/replica_00/lr")] == list(range(1, 11))
        assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, 11))  # Hugging Face's


@pytest.mark.parametrize("form", ["wrap", "callback"])
@pytest.mark.parametrize("kwargs", [{"warmup_steps": 1}, {"max_steps": 3}, {"warmup_steps": 0.1}])
def test_a_one_step_warm_up_or_a_three_step_run_trains(tmp_path, form, kwargs):
    """OneCycleLR's warm-up ends at step pct_start * total_steps - 1: a warm-up of one step (or
    max_steps 2-3 with none) ended it at step 0 and divided by zero before the first step."""
    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    rec = _lr_recorder()
    if form == "wrap":
        trainer = hdet_track.wrap(_tiny_trainer(tmp_path, [rec], **kwargs), track=False)
    else:
        trainer = _tiny_trainer(tmp_path, [HDETTrainerCallback(track=False), rec], **kwargs)
    trainer.train()
    steps = kwargs.get("max_steps", 10)
    assert sorted(rec.seen) == list(range(1, steps + 1))
    lrs = [rec.seen[k] for k in sorted(rec.seen)]
    # up to the peak, then annealed: the value after the last step trains nothing (OneCycleLR's own
    # runs past its curve there, as this is bit for bit)
    assert max(lrs) == pytest.approx(1e-2) and lrs[-2] < 1e-3, lrs


@pytest.mark.parametrize("form", ["wrap", "callback"])
def test_track_false_tracks_nothing_even_where_report_to_names_mlflow(tmp_path, monkeypatch, form):
    """``report_to=["mlflow"]`` put HDET's series and tags into Hugging Face's run though the user
    passed ``track=False`` (Lightning's integration honoured it)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    import hdet_track
    from hdet_track.integrations.transformers import HDETTrainerCallback

    uri = f"sqlite:///{tmp_path / 'hf.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "untracked")  # not MLflow's experiment of an earlier test
    if form == "wrap":
        trainer = hdet_track.wrap(_tiny_trainer(tmp_path / "out", report_to=["mlflow"]), track=False)
    else:
        trainer = _tiny_trainer(tmp_path / "out", [HDETTrainerCallback(track=False)], report_to=["mlflow"])
    trainer.train()
    if mlflow.active_run() is not None:
        mlflow.end_run()
    client = MlflowClient(uri)
    (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert not [k for k in run.data.metrics if k.startswith("hdet")]
    assert not [k for k in run.data.tags if k.startswith("hdet")]

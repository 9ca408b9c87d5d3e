"""Hugging Face Trainer on 2 gloo replicas with hdet_track.wrap: fan-out, converge, W&B offline run."""

from __future__ import annotations

import glob
import json

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
    contents = read_finished(files[0], timeout=20.0)  # a run Hugging Face finishes: wandb may still write it
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


def test_resume_from_checkpoint_continues_the_schedule_and_the_run(tmp_path):
    """Killed right after a mid-window checkpoint, resumed with resume_from_checkpoint: every
    replica's LR at every step is the uninterrupted job's, and one MLflow run holds each step once."""
    from mlflow.tracking import MlflowClient

    from hdet_track.readers.mlflow import MLflowReader

    args = ["--steps", "40", "--save-steps", "15"]  # sync every 10: the checkpoint at 15 is mid-window
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

"""A Hugging Face Trainer (a tiny GPT-2 built from a config: nothing is downloaded) on 2 CPU
replicas, switched to HDET with one line.

    python examples/hf_trainer.py        # report_to = $HDET_TRACKER (mlflow by default)

Character-level language modelling on Python's own standard-library sources. The script starts
its replicas itself (torch's elastic launcher, gloo, 127.0.0.1), as torchrun would.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hdet_track
from hdet_track.launch import launch_local

SEQ = 32


def corpus(limit: int = 200_000) -> torch.Tensor:
    """Bytes of the standard library's sources, folded into a 96-symbol vocabulary."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= limit:
            break
    ids = torch.tensor(list(data[:limit]), dtype=torch.long)
    return (ids.clamp(32, 127) - 32).clamp_max(95)


class Chunks(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids) // SEQ - 1

    def __getitem__(self, i: int) -> dict:
        x = self.ids[i * SEQ : (i + 1) * SEQ]
        return {"input_ids": x, "labels": x.clone()}


def main_worker(
    steps: int,
    out_dir: str,
    dump: str | None = None,
    callback: bool = False,
    save_steps: int = 0,
    kill_at: int = 0,
    resume: bool = False,
    eval_steps: int = 0,
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)  # the same initial weights on every replica
    # no dropout: a resumed run then repeats the uninterrupted one exactly (the tests compare them)
    config = GPT2Config(vocab_size=96, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    report = os.environ.get("HF_REPORT_TO", os.environ.get("HDET_TRACKER", "mlflow"))
    args = TrainingArguments(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        warmup_steps=steps // 10,
        logging_steps=10,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps or None,
        per_device_eval_batch_size=32,
        report_to=[] if report == "none" else [report],
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        dataloader_num_workers=0,
        run_name="hf-hdet",
        seed=0,
    )
    hdet = {"spread": 0.3, "sync_every": 10, "auto_lr": True, "auto_lr_warmup": steps // 4}
    text = corpus(220_000)
    data = {"train_dataset": Chunks(text[:200_000])}
    if eval_steps:
        data["eval_dataset"] = Chunks(text[200_000:])  # 624 held-out windows
    if callback:  # the callback form
        from hdet_track.integrations.transformers import HDETTrainerCallback

        trainer = Trainer(model=model, args=args, **data, callbacks=[HDETTrainerCallback(**hdet)])
    else:  # the one line
        trainer = hdet_track.wrap(Trainer(model=model, args=args, **data), **hdet)
    if dump:  # test hook: each rank's parameters and learning rate after every optimizer step

        class Dump(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                torch.save(flat, os.path.join(dump, f"rank{args.process_index}-step{state.global_step}.pt"))
                with open(os.path.join(dump, f"lr{args.process_index}.jsonl"), "a") as f:
                    f.write(json.dumps([state.global_step, optimizer.param_groups[0]["lr"]]) + "\n")

            def on_prediction_step(self, args, state, control, **kwargs):
                """At an evaluation's first batch: the last sync's step and whether its divergences are in."""
                if state.global_step in self.evaluated:
                    return
                self.evaluated.add(state.global_step)
                last = hdet_scheduler(trainer).last_sync
                complete = all(math.isfinite(d) for d in last.divergences)
                with open(os.path.join(dump, f"eval{args.process_index}.jsonl"), "a") as f:
                    f.write(json.dumps([state.global_step, last.step, complete]) + "\n")

            evaluated: set = set()

        trainer.add_callback(Dump())
    if kill_at:  # test hook: the whole job dies right after the checkpoint at this step

        class Kill(TrainerCallback):
            def on_save(self, args, state, control, **kwargs):
                if state.global_step == kill_at:
                    hdet_scheduler(trainer).flush()
                    dist.barrier()
                    os.kill(os.getpid(), signal.SIGKILL)

        trainer.add_callback(Kill())
    trainer.train(resume_from_checkpoint=True if resume else None)


def hdet_scheduler(trainer: Any) -> hdet_track.HDETScheduler:
    """The trainer's HDET scheduler: its own with wrap(); the callback form keeps it on the callback."""
    if isinstance(trainer.lr_scheduler, hdet_track.HDETScheduler):
        return trainer.lr_scheduler
    return next(c.scheduler for c in trainer.callback_handler.callbacks if hasattr(c, "scheduler"))


def _entry(steps: int, out_dir: str, dump: str | None, callback: bool, extra: dict) -> None:
    torch.set_num_threads(1)
    main_worker(steps, out_dir, dump, callback, **extra)


def launch(replicas: int, steps: int, out_dir: str, dump: str | None = None, callback: bool = False, **extra) -> None:
    launch_local(_entry, replicas, steps, out_dir, dump, callback, extra)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--output-dir", default="hf-output")
    parser.add_argument("--callback", action="store_true", help="use HDETTrainerCallback instead of wrap()")
    parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    parser.add_argument("--dump", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--eval-steps", type=int, default=0, help="evaluate on held-out text every N steps")
    a = parser.parse_args()
    extra = {"save_steps": a.save_steps, "kill_at": a.kill_at, "resume": a.resume, "eval_steps": a.eval_steps}
    launch(a.replicas, a.steps, a.output_dir, a.dump, a.callback, **extra)

"""Shared checks of the example scripts' runs (each example starts its own 2 replicas)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(
    name: str, args: list[str], cwd: Path, env_update: dict[str, str], ok: bool = True, done_when: str | None = None
) -> None:
    """Run examples/``name`` with a clean tracking environment plus ``env_update``; it must exit 0
    (or, with ``ok=False``, must not). ``done_when``: the text the job prints once its work is done;
    after it, torch 2.13's gloo abort at interpreter exit (README, "Run status") is not a failure:
    the caller's checks of what the job wrote decide."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "HDET_", "WANDB_"))}
    env.update(env_update)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env
    )
    # (the ranks' stderr interleave, so the abort's line may come before the text that says done)
    exit_abort = (
        done_when is not None
        and done_when in proc.stderr
        and "terminate called without an active exception" in proc.stderr
    )
    assert (proc.returncode == 0) == ok or (ok and exit_abort), proc.stderr[-4000:]


def dumped_lrs(dump: Path, replicas: int = 2) -> list[dict[int, float]]:
    """Each replica's learning rate per optimizer step, as the examples' test hook wrote them."""
    out = []
    for r in range(replicas):
        rows = [json.loads(line) for line in (dump / f"lr{r}.jsonl").read_text().splitlines()]
        steps = [s for s, _ in rows]
        assert len(steps) == len(set(steps)), f"a step was taken twice on replica {r}"
        out.append(dict(rows))
    return out


def assert_synced_only_at(dump: Path, synced: list[int], between: int) -> None:
    """The 2 replicas' parameters are equal right after each sync step and differ at ``between``."""
    for step in synced:
        a, b = (torch.load(dump / f"rank{r}-step{step}.pt") for r in (0, 1))
        assert torch.equal(a, b), step
    a, b = (torch.load(dump / f"rank{r}-step{between}.pt") for r in (0, 1))
    assert not torch.equal(a, b), between

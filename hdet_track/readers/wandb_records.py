"""The ``.wandb`` run-file parser, under its earlier name (it lives in :mod:`hdet_track.wandb_file`,
where the W&B tracker uses it too)."""

from ..wandb_file import WandbFileContents, WandbFormatError, iter_payloads, iter_records, read_wandb_file

__all__ = ["iter_payloads", "iter_records", "read_wandb_file", "WandbFileContents", "WandbFormatError"]

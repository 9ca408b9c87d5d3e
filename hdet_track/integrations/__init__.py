"""Adopt HDET in an existing trainer with one line: ``hdet_track.wrap(...)``."""

from __future__ import annotations

from .wrap import wrap

__all__ = ["wrap"]

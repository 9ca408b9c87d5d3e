"""Argument checks shared by the scheduler and the controllers: errors name the argument, the value
and what is allowed ("Expected X, but got Y", as torch's schedulers say)."""

from __future__ import annotations

import math
from typing import Any


def check_number(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """``float(value)`` if it is a finite real number in the interval, else ``ValueError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lb = "(" if low_open else "["
        rb = ")" if high_open else "]"
        raise ValueError(f"Expected {name} in {lb}{low}, {high}{rb}, but got {value!r}")
    return float(value)


def check_int(name: str, value: Any, low: int) -> int:
    """``value`` if it is an int (not a bool) >= ``low``, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Expected {name} to be an integer >= {low}, but got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else ``ValueError`` (a string such as "no" would read as True)."""
    if not isinstance(value, bool):
        raise ValueError(f"Expected {name} to be a bool, but got {value!r}")
    return value


def check_str(name: str, value: Any, empty: bool = False) -> str | None:
    """``value`` if it is a str (non-empty unless ``empty``) or None, else ``ValueError``."""
    if value is not None and (not isinstance(value, str) or not (value or empty)):
        kind = "a str" if empty else "a non-empty str"
        raise ValueError(f"Expected {name} to be {kind} or None, but got {value!r}")
    return value

"""Argument checks shared by the scheduler and the controllers: errors name the argument, the value
and what is allowed ("Expected X, but got Y", as torch's schedulers say)."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def real(value: Any) -> float | None:
    """``value`` as a float when it is a real number: a Python or NumPy scalar, or a one-element
    tensor or array, as a sweep's config gives them (not a bool); else None."""
    number = _scalar(value, integral=False)
    return None if number is None else float(number)


def check_number(name: str, value: Any, low: float, high: float, *, low_open: bool, high_open: bool) -> float:
    """``float(value)`` if it is a finite real number (see :func:`real`) in the interval, else ``ValueError``."""
    number = real(value)
    ok = number is not None and math.isfinite(number)
    if ok:
        ok = (number > low if low_open else number >= low) and (number < high if high_open else number <= high)
    if not ok:
        lb = "(" if low_open else "["
        rb = ")" if high_open else "]"
        raise ValueError(f"Expected {name} in {lb}{low}, {high}{rb}, but got {value!r}")
    return number  # type: ignore[return-value]


def _one_element(value: Any) -> bool:
    """A 0-d or one-element tensor or array."""
    if getattr(value, "ndim", None) == 0:
        return True
    size = value.numel() if hasattr(value, "numel") else getattr(value, "size", None)  # torch / NumPy
    return size == 1 and hasattr(value, "dtype")


def integer(value: Any) -> int | None:
    """``value`` as an int when it is an integer: a Python or NumPy one, or a one-element integer
    tensor or array, as a sweep's config gives them (not a bool); else None."""
    number = _scalar(value, integral=True)
    return None if number is None else int(number)


def _scalar(value: Any, integral: bool) -> Any:
    """The Python number ``value`` holds (see :func:`real` and :func:`integer`), or None."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, numbers.Integral if integral else numbers.Real):
        return value
    dtype = str(getattr(value, "dtype", ""))  # torch.int64, float32, uint8...: never bool or complex
    if not _one_element(value) or "bool" in dtype or "complex" in dtype or (integral and "int" not in dtype):
        return None
    try:
        return value.item()
    except (TypeError, ValueError, AttributeError):
        return None


def check_int(name: str, value: Any, low: int) -> int:
    """``int(value)`` if it is an integer (see :func:`integer`) >= ``low``, else ``ValueError``."""
    number = integer(value)
    if number is None or number < low:
        raise ValueError(f"Expected {name} to be an integer >= {low}, but got {value!r}")
    return number


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


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars as Python numbers, in lists, tuples and dicts too (tensors and
    everything else as they are): what a checkpoint holds must load with ``weights_only=True``."""
    if isinstance(value, np.generic):
        return value.item()
    if type(value) in (list, tuple):
        return type(value)(plain(v) for v in value)
    if type(value) is dict:
        return {k: plain(v) for k, v in value.items()}
    return value

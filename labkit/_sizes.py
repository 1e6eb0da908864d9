"""Counts and sizes: the one whole-number check, the one positive-number check, and divisor and
multiple suggestions for error messages."""

from __future__ import annotations

import math
import numbers


def whole(value, name: str, *, low: int = 1, error: type[Exception] = ValueError,
          hint: str = "") -> int:
    """``value`` as an int if it is a whole number >= ``low``; else ``error`` naming ``name``.

    ``True`` is refused although Python counts it as 1: a flag passed where a count belongs
    is a mistake. NumPy integers are accepted. ``hint`` is appended to the message.
    """
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < low):
        raise error(f"{name} must be a whole number >= {low}, got {value!r}{hint}")
    return int(value)


def positive(value, name: str, *, what: str = "a positive number", zero: bool = False,
             hint: str = "") -> float:
    """``value`` as a float if it is a finite real number > 0 (>= 0 with ``zero``); else a
    ValueError saying ``name`` must be ``what``.

    As in :func:`whole`, ``True`` is refused and NumPy numbers are accepted; NaN and the
    infinities are refused (a measured time or rate is never either). ``hint`` is appended.
    """
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value) or (value < 0 if zero else value <= 0)):
        raise ValueError(f"{name} must be {what}, got {value!r}{hint}")
    return float(value)


def divisors(n: int, limit: int = 8, *, proper: bool = False) -> list[int]:
    """The first ``limit`` divisors of ``n`` up to 64; without 1 and ``n`` when ``proper``."""
    found = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
    if proper:
        found = [d for d in found if 1 < d < n]
    return found[:limit]


def multiples_near(n: int, k: int) -> str:
    """The multiples of ``k`` on either side of ``n``, for error messages: ``"8 or 12"``.

    Below ``k`` there is no smaller multiple: ``k`` alone (``"4"``).
    """
    lower = n - n % k
    return f"{lower} or {lower + k}" if lower else f"{k}"

"""Size suggestions for error messages: which counts divide a batch, a hidden size, a layer."""

from __future__ import annotations


def divisors(n: int, limit: int = 8, *, proper: bool = False) -> list[int]:
    """The first ``limit`` divisors of ``n`` up to 64; without 1 and ``n`` when ``proper``."""
    found = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
    if proper:
        found = [d for d in found if 1 < d < n]
    return found[:limit]

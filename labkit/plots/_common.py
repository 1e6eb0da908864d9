"""What several figure modules share: axes to draw on, checked rows, tick labels."""

from __future__ import annotations

__all__ = ["figure_for", "figure_pair", "size_label", "check_rows", "rows_by", "integer_ticks",
           "SCALING_MODES"]


def figure_for(ax, figsize):
    """``(figure, axes)``: ``ax`` and its figure when given (a panel of a larger figure), else a
    new figure of ``figsize`` inches with one axes."""
    from matplotlib import pyplot as plt

    if ax is None:
        return plt.subplots(figsize=figsize)
    return ax.figure, ax


def figure_pair(ax, figsize):
    """``(figure, left, right)`` for a figure of two panels side by side: a new figure when
    ``ax`` is None, the two axes of a given pair, or one given axes (``right`` None: the caller
    draws only the left panel)."""
    from matplotlib import pyplot as plt

    if ax is None:
        fig, (left, right) = plt.subplots(1, 2, figsize=figsize)
        return fig, left, right
    if isinstance(ax, (list, tuple)):
        left, right = ax
        return left.figure, left, right
    return ax.figure, ax, None


def size_label(n: float, _pos=None) -> str:
    """1024 -> '1 KiB', 64 MiB -> '64 MiB': message sizes as people say them."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


SCALING_MODES = ("weak", "strong", "independent")


def check_rows(rows, keys, name, advice):
    """Every row has ``keys`` and, where ``mode`` is one of them, a known mode; or a clear error."""
    missing = [k for k in keys if any(k not in r for r in rows)]
    if missing:
        raise ValueError(f"{name} lack {missing}: {advice}")
    modes = (sorted({r["mode"] for r in rows if r["mode"] not in SCALING_MODES})
             if "mode" in keys else [])
    if modes:
        raise ValueError(f"unknown mode {modes} in {name}: mode is 'weak' (same batch per "
                         f"worker), 'strong' (same global batch) or 'independent' (no "
                         f"gradient exchange)")


def rows_by(rows, key, order_key) -> dict:
    """``{rows[key]: rows sorted by order_key}``, keys in first-seen order."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return {k: sorted(v, key=lambda r: r[order_key]) for k, v in groups.items()}


def integer_ticks(ax, ticks, log):
    """Ticks exactly at ``ticks`` labelled 1, 2, 4 ...: the default log labels read 2^3."""
    from matplotlib.ticker import NullLocator

    if log:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())  # no unlabelled ticks between worker counts

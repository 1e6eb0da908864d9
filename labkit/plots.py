"""Figures: every plot the notebooks show, drawn from plain result rows. Nothing here measures.

matplotlib is imported inside each function, so ``import labkit`` stays light; headless (CI,
a worker, a shell) matplotlib falls back to the Agg backend by itself.
"""

from __future__ import annotations

__all__ = ["bandwidth_plot"]


def _size_label(n: float, _pos=None) -> str:
    """1024 -> '1 KiB', 64 MiB -> '64 MiB': message sizes as people say them."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


def bandwidth_plot(rows: list[dict], ax=None):
    """Algorithm and bus bandwidth against message size (log-log), from ``allreduce_sweep`` rows.

    Draws on ``ax`` when given, else on a new figure; returns the Figure. A bus bandwidth of 0
    (one rank: nothing crosses a link) has no place on a log axis and is left out.

    Example::

        >>> sizes = message_sizes(1 << 10, 1 << 24)
        >>> rows = labkit.launch(allreduce_sweep, sizes, nproc=2).values[0]
        >>> fig = bandwidth_plot(rows)          # assign it, or Jupyter shows the figure twice
    """
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    if not rows:
        raise ValueError("no rows to plot: pass the list that allreduce_sweep returned")
    missing = {"bytes", "algbw_GBps", "busbw_GBps"} - set(rows[0])
    if missing:
        raise ValueError(f"rows lack {sorted(missing)}: pass the rows allreduce_sweep returned")
    rows = sorted(rows, key=lambda r: r["bytes"])
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    else:
        fig = ax.figure
    sizes = [r["bytes"] for r in rows]
    ax.plot(sizes, [r["algbw_GBps"] for r in rows], "o-", label="algbw (bytes / time)")
    bus = [(s, r["busbw_GBps"]) for s, r in zip(sizes, rows, strict=True) if r["busbw_GBps"] > 0]
    if bus:
        ax.plot(*zip(*bus, strict=True), "s--", label="busbw (algbw x 2(n-1)/n)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))  # a label every few powers of 2
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
    ax.set_xlabel("message size")
    ax.set_ylabel("bandwidth (GB/s)")
    ranks, backend = rows[0].get("ranks"), rows[0].get("backend")
    who = f": {ranks} ranks, {backend}" if ranks and backend else ""
    ax.set_title(f"all-reduce bandwidth{who}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig

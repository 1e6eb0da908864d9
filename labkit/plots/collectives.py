"""Figures of notebooks 00 and 06: the all-reduce's bandwidth against message size, a
parameter server's staleness, compression's bytes against accuracy."""

from __future__ import annotations

from ._common import check_rows, course_figure, figure_for, legend_outside, size_label

__all__ = ["bandwidth_plot", "staleness_plot", "bytes_accuracy_plot"]


@course_figure
def bandwidth_plot(rows: list[dict], ax=None, model: list[dict] | None = None):
    """Algorithm and bus bandwidth against message size (log-log), from ``allreduce_sweep`` rows.

    Rows of several algorithms (``allreduce_sweep(..., algorithms=...)``) get one busbw line
    each; ``model`` (rows with ``bytes`` and ``busbw_GBps``, e.g. from ``bench.ring_seconds``)
    is drawn dashed. Draws on ``ax`` when given, else on a new figure; returns the Figure. A bus
    bandwidth of 0 (one rank: nothing crosses a link) has no place on a log axis and is left out.

    Example::

        >>> sizes = message_sizes(1 << 10, 1 << 24)
        >>> rows = labkit.launch(allreduce_sweep, sizes, nproc=2).values[0]
        >>> fig = bandwidth_plot(rows)          # assign it, or Jupyter shows the figure twice
    """
    from matplotlib.ticker import FuncFormatter, LogLocator

    if not rows:
        raise ValueError("no rows to plot: pass the list that allreduce_sweep returned")
    missing = {"bytes", "algbw_GBps", "busbw_GBps"} - set(rows[0])
    if missing:
        raise ValueError(f"rows lack {sorted(missing)}: pass the rows allreduce_sweep returned")
    rows = sorted(rows, key=lambda r: r["bytes"])
    fig, ax = figure_for(ax, (9, 4.5))
    algorithms = list(dict.fromkeys(r.get("algorithm", "builtin") for r in rows))
    if len(algorithms) == 1:
        sizes = [r["bytes"] for r in rows]
        ax.plot(sizes, [r["algbw_GBps"] for r in rows], "o-", label="algbw (bytes / time)")
    for name in algorithms:
        bus = [(r["bytes"], r["busbw_GBps"]) for r in rows
               if r.get("algorithm", "builtin") == name and r["busbw_GBps"] > 0]
        label = "busbw (algbw x 2(n-1)/n)" if len(algorithms) == 1 else f"busbw, {name}"
        if bus:
            ax.plot(*zip(*bus, strict=True), "s--" if len(algorithms) == 1 else "o-", label=label)
    if model:
        ax.plot([r["bytes"] for r in model], [r["busbw_GBps"] for r in model], "k:",
                label="alpha-beta model of the ring")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))  # a label every few powers of 2
    ax.xaxis.set_major_formatter(FuncFormatter(size_label))
    ax.set_xlabel("message size")
    ax.set_ylabel("bandwidth (GB/s)")
    ranks, backend = rows[0].get("ranks"), rows[0].get("backend")
    who = f": {ranks} ranks, {backend}" if ranks and backend else ""
    ax.set_title(f"all-reduce bandwidth{who}")
    ax.grid(True, which="major", alpha=0.3)
    legend_outside(ax, "right", wrap=22)
    fig.tight_layout()
    return fig


@course_figure
def staleness_plot(result: dict, ax=None):
    """Each update's staleness, in the order the server applied it, one colour per worker.

    ``result`` is rank 0's return value of ``parameter_server``. Returns the Figure.

    Example::

        >>> out = labkit.launch(parameter_server, make, train, val, mode="async",
        ...                     slow={1: 0.01}, nproc=3).values[0]
        >>> fig = staleness_plot(out)
    """

    missing = {"staleness", "pushed_by", "mode"} - set(result)
    if missing:
        raise ValueError(f"result lacks {sorted(missing)}: pass rank 0's return value of "
                         f"parameter_server (values[0])")
    fig, ax = figure_for(ax, (8.5, 3.8))
    for worker in sorted(set(result["pushed_by"])):
        points = [(i, s) for i, (s, who) in enumerate(zip(result["staleness"], result["pushed_by"],
                                                          strict=True)) if who == worker]
        ax.plot(*zip(*points, strict=True), ".", label=f"worker {worker}")
    ax.set_xlabel("gradient applied (in arrival order)")
    ax.set_ylabel("staleness (updates since its weights)")
    ax.set_title(f"{result['mode']} parameter server")
    ax.grid(alpha=0.3)
    legend_outside(ax, "right", markerscale=2)
    fig.tight_layout()
    return fig


@course_figure
def bytes_accuracy_plot(rows: list[dict], ax=None):
    """Accuracy against the bytes each rank sent (a fraction of dense training's), labelled.

    ``rows`` are ``compressed_training`` results with a ``label``. Returns the Figure.

    Example::

        >>> fig = bytes_accuracy_plot([{**r, "label": r["method"]} for r in results])
    """

    advice = "pass compressed_training's results, each with a 'label' added"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    check_rows(rows, ["bytes_per_rank", "dense_bytes", "accuracy", "label"], "rows", advice)
    fig, ax = figure_for(ax, (7, 4.5))
    for r in rows:
        share = r["bytes_per_rank"] / r["dense_bytes"]
        ax.plot(share, r["accuracy"], "o")
        ax.annotate(r["label"], (share, r["accuracy"]), textcoords="offset points",
                    xytext=(5, 4))
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per rank (fraction of dense)")
    ax.set_ylabel("validation accuracy")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig

"""Figures of notebooks 04, 07 and 11: every tuning technique against its own baseline,
gradient buckets overlapping backward, memory against a budget, the roofline."""

from __future__ import annotations

from ._common import check_rows, course_figure, figure_for, legend_outside

__all__ = ["tuning_plot", "overlap_plot", "memory_plot", "roofline_plot"]


@course_figure
def tuning_plot(rows: list[dict], ax=None):
    """One bar per technique: how many times better it made its own baseline (log scale).

    ``rows`` are ``labkit.perf.result_row`` dicts (``technique, speedup, unit``); a bar right
    of the 1.0 line helped, left of it hurt. Each bar is labelled with its factor and what was
    measured, since the techniques gain different things (time, bytes, memory). Draws on ``ax``
    when given; returns the Figure.

    Example::

        >>> rows = [result_row("bf16 autocast", 0.02, 0.01, "s/step"),
        ...         result_row("fp16 compression", 40872, 20436, "bytes/step")]
        >>> fig = tuning_plot(rows)
    """

    if not rows:
        raise ValueError("no rows to plot: pass the rows built with labkit.perf.result_row")
    missing = sorted({k for r in rows for k in ("technique", "speedup", "unit") if k not in r})
    if missing:
        raise ValueError(f"rows lack {missing}: build them with labkit.perf.result_row")
    bad = [r["technique"] for r in rows if not r["speedup"] > 0]
    if bad:
        raise ValueError(f"speedup must be > 0 to sit on a log axis; not for {bad}")
    fig, ax = figure_for(ax, (9, 0.5 * len(rows) + 1.6))
    names = [r["technique"] for r in rows][::-1]  # first row on top
    gains = [r["speedup"] for r in rows][::-1]
    colors = ["tab:green" if g >= 1 else "tab:red" for g in gains]
    # Bars grow from the 1.0 line, so a technique that hurt points left.
    ax.barh(names, [g - 1.0 for g in gains], left=1.0, color=colors, alpha=0.8)
    ax.set_xscale("log", base=2)
    ax.axvline(1.0, color="k", lw=1)
    for y, (g, r) in enumerate(zip(gains, rows[::-1], strict=True)):
        ax.text(g, y, f" {g:.2f}x ({r['unit']})", va="center")
    lo, hi = min(gains + [1.0]), max(gains + [1.0])
    ax.set_xlim(lo / 1.5, hi * 8)  # room on the right for the labels
    ax.set_xlabel("gain over the baseline (x, log scale; > 1 is better)")
    ax.set_title("performance tuning: each technique against its own baseline")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


@course_figure
def overlap_plot(rows: list[dict], ax=None):
    """DDP's step per bucket size as stacked bars: compute, exposed and hidden communication.

    ``rows`` are ``labkit.ddp.bucket_sweep(..., overlap=True)``'s. Each bar is the serial step
    (every bucket's all-reduce waited for): ``compute_s`` at the bottom, then the
    communication, split at the overlapped step ``step_s`` into the part still waited for
    (exposed) and, above it, the part overlap hid. Timing noise can put ``step_s`` below
    ``compute_s`` or above ``serial_s``: the split is clipped to the bar, and the measured
    step is drawn as a black tick wherever it fell. Each bar is labelled with its
    ``hidden_fraction``. Draws on ``ax`` when given; returns the Figure.

    Example::

        >>> rows = labkit.launch(ddp.bucket_sweep, [0.25, 4, 25], overlap=True,
        ...                      nproc=2).values[0]
        >>> fig = overlap_plot(rows)
    """

    advice = "pass the rows of labkit.ddp.bucket_sweep(caps_mb, ..., overlap=True)"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    check_rows(rows, ["bucket_cap_mb", "allreduces", "compute_s", "step_s", "serial_s",
                       "hidden_fraction"], "rows", advice)
    rows = sorted(rows, key=lambda r: r["bucket_cap_mb"])
    fig, ax = figure_for(ax, (9, 4.5))
    compute = [r["compute_s"] * 1e3 for r in rows]
    comm = [max(0.0, r["serial_s"] - r["compute_s"]) * 1e3 for r in rows]
    step = [r["step_s"] * 1e3 for r in rows]
    exposed = [min(max(0.0, s - c), total) for s, c, total in zip(step, compute, comm,
                                                                   strict=True)]
    hidden = [total - e for total, e in zip(comm, exposed, strict=True)]
    x = list(range(len(rows)))
    ax.bar(x, compute, color="tab:blue", label="compute (no communication)")
    ax.bar(x, exposed, bottom=compute, color="tab:red", label="communication waited for")
    ax.bar(x, hidden, bottom=[c + e for c, e in zip(compute, exposed, strict=True)],
           color="tab:green", alpha=0.45, hatch="//", label="communication hidden by overlap")
    ax.hlines(step, [i - 0.4 for i in x], [i + 0.4 for i in x], colors="k", linewidth=2,
              label="overlapped step, measured")  # across each bar: the bars are 0.8 wide
    for i, r in enumerate(rows):
        share = r["hidden_fraction"]
        ax.text(i, max(compute[i] + comm[i], step[i]), "hidden n/a" if share is None else
                f"hidden {share:.0%}", ha="center", va="bottom")
    ax.set_xticks(x, [f"{r['bucket_cap_mb']:g} MB\n{r['allreduces']:.0f} bucket"
                      f"{'' if r['allreduces'] == 1 else 's'}" for r in rows])
    top = max(max(c + t for c, t in zip(compute, comm, strict=True)), max(step))
    ax.set_ylim(0, top * 1.15)  # room for the labels above the bars
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("ms per step (slowest rank)")
    ax.set_title("DDP: the communication that overlap hides, by bucket size")
    ax.grid(axis="y", alpha=0.3)
    legend_outside(ax, "right", wrap=18)
    fig.tight_layout()
    return fig


@course_figure
def memory_plot(rows: list[dict], budget: float, ax=None):
    """Training memory against the batch: the estimate's line, the measured peaks, the budget.

    ``rows`` have ``batch``, ``estimate`` and ``peak`` (bytes; ``peak`` may be None where not
    measured). Returns the Figure.

    Example::

        >>> fig = memory_plot([{"batch": 64, "estimate": 1.6e8, "peak": 1.9e8}], budget=2.5e8)
    """

    advice = "pass rows of {'batch', 'estimate', 'peak'} in bytes, one per batch size"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    check_rows(rows, ["batch", "estimate", "peak"], "rows", advice)
    fig, ax = figure_for(ax, (8.5, 4.5))
    rows = sorted(rows, key=lambda r: r["batch"])
    ax.plot([r["batch"] for r in rows], [r["estimate"] / 2**20 for r in rows], "-",
            label="estimate: params + grads + optimizer + activations")
    measured = [r for r in rows if r["peak"] is not None]
    ax.plot([r["batch"] for r in measured], [r["peak"] / 2**20 for r in measured], "o",
            label="measured peak")
    ax.axhline(budget / 2**20, color="k", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("batch size")
    ax.set_ylabel("MiB per device")
    ax.grid(alpha=0.3)
    legend_outside(ax, "right", wrap=24)
    fig.tight_layout()
    return fig


@course_figure
def roofline_plot(peak_flops: float, bandwidth_Bps: float, points: list[dict], ax=None,
                  title: str = "this machine's roofline"):
    """The roofline, ``min(peak, intensity x bandwidth)`` on log-log axes, and measured ops on it.

    ``peak_flops`` (FLOP/s) and ``bandwidth_Bps`` (bytes/s) come from a machine card;
    ``points`` are ``labkit.machine.measure_op`` results with an ``op`` name (``intensity`` in
    FLOP per byte, ``flops_per_s`` achieved). The ridge point, where the slanted memory roof
    meets the flat compute roof, is marked: ops left of it wait on memory. Each point is
    labelled with its op. Returns the Figure.

    Example::

        >>> fig = roofline_plot(50e9, 10e9, [{"op": "add", "intensity": 0.08,
        ...                                   "flops_per_s": 0.7e9}])
    """
    advice = "pass labkit.machine.measure_op results, each with an 'op' name added"
    if not (peak_flops > 0 and bandwidth_Bps > 0):
        raise ValueError(f"peak_flops and bandwidth_Bps must be > 0, got {peak_flops!r} and "
                         f"{bandwidth_Bps!r}: read them from machine.load_card()")
    if not points:
        raise ValueError(f"no points to plot: {advice}")
    check_rows(points, ["op", "intensity", "flops_per_s"], "points", advice)
    bad = [p["op"] for p in points if not (p["intensity"] > 0 and p["flops_per_s"] > 0)]
    if bad:
        raise ValueError(f"intensity and flops_per_s must be > 0 on log axes; not for {bad}")
    ridge = peak_flops / bandwidth_Bps
    xs = [p["intensity"] for p in points] + [ridge]
    lo, hi = min(xs) / 4, max(xs) * 4
    fig, ax = figure_for(ax, (8.5, 4.8))
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(peak_flops, x * bandwidth_Bps) / 1e9 for x in grid], color="k",
            label="roofline: min(peak, intensity x bandwidth)")
    ax.axvline(ridge, color="grey", linestyle=":", label=f"ridge point {ridge:.3g} FLOP/B")
    for p in points:
        ax.plot(p["intensity"], p["flops_per_s"] / 1e9, "o")
        ax.annotate(p["op"], (p["intensity"], p["flops_per_s"] / 1e9),
                    textcoords="offset points", xytext=(5, -12))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    legend_outside(ax, "below", wrap=40)
    fig.tight_layout()
    return fig

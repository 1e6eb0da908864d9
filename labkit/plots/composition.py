"""Figures of notebook 10: ZeRO by hand, 2-D meshes and what crosses each link, and the
planner's memory and bytes (and its predictions beside measurements)."""

from __future__ import annotations

import textwrap

from ._common import (
    MAX_WIDTH_IN,
    MIN_TEXT_PT,
    capped_width,
    check_rows,
    course_figure,
    figure_for,
    figure_pair,
    legend_outside,
)

__all__ = ["zero_plot", "mesh_plot", "wire_plot", "planner_plot", "planner_check_plot"]


# ---- ZeRO by hand (notebook 10) -----------------------------------------------------------------

_ZERO_KINDS = ("params", "grads", "optimizer")


@course_figure
def zero_plot(rows: list[dict], ax=None):
    """Bytes each rank holds, by kind, and bytes it sends per step: DP, ZeRO-1, ZeRO-2, ZeRO-3.

    ``rows`` are ``labkit.parallel.zero.zero_rows(...)`` dicts, one bar per row: ``label``,
    ``params``, ``grads``, ``optimizer`` (bytes held per rank), ``in_flight`` (ZeRO-2's one
    gradient bucket during backward, drawn hatched on top; 0 elsewhere) and ``wire`` (bytes
    sent per rank per step). Left: the bytes held, stacked by kind, in MiB; right: the bytes
    sent. ``ax``: one Axes draws the bytes held alone, a pair of Axes draws both. Returns the
    Figure.

    Example::

        >>> fig = zero_plot(zero.zero_rows(zero1, zero2, zero3))
    """

    advice = ("pass zero.zero_rows(zero1, zero2, zero3): rows of {'label', 'params', 'grads', "
              "'optimizer', 'in_flight', 'wire'} in bytes")
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    check_rows(rows, ["label", *_ZERO_KINDS, "in_flight", "wire"], "rows", advice)
    fig, held_ax, wire_ax = figure_pair(ax, (MAX_WIDTH_IN, 5.0))
    x = list(range(len(rows)))
    labels = [textwrap.fill(r["label"], 10) for r in rows]  # "ZeRO-3\n(FSDP2)": side by side
    bottom = [0.0] * len(rows)
    for kind in _ZERO_KINDS:
        heights = [r[kind] / 2**20 for r in rows]
        held_ax.bar(x, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    extra = [r["in_flight"] / 2**20 for r in rows]
    if any(extra):
        held_ax.bar(x, extra, bottom=bottom, fill=False, hatch="//", edgecolor="0.4",
                    label="one gradient bucket in flight (backward)")
    held_ax.set_ylim(0, max(b + e for b, e in zip(bottom, extra, strict=True)) * 1.1)
    held_ax.set_xticks(x, labels)
    held_ax.set_ylabel("MiB held per rank")
    held_ax.set_title("parameters, gradients,\noptimizer state")
    held_ax.grid(axis="y", alpha=0.3)
    legend_outside(held_ax, "below", ncol=2, wrap=22)
    if wire_ax is not None:
        wire_ax.bar(x, [r["wire"] / 2**20 for r in rows], color="0.5")
        for i, r in enumerate(rows):
            if not rows[0]["wire"]:  # one rank: nothing on the wire, no ratio to show
                break
            wire_ax.annotate(f"{r['wire'] / rows[0]['wire']:.2g}x DP", (i, r["wire"] / 2**20),
                             ha="center", va="bottom")
        wire_ax.margins(y=0.12)  # room for the ratios
        wire_ax.set_xticks(x, labels)
        wire_ax.set_ylabel("MiB sent per rank per step")
        wire_ax.set_title("communication per step")
        wire_ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


# ---- 2-D meshes (notebook 10) -------------------------------------------------------------------

def _mesh_cell_lines(result: dict) -> list[str]:
    """What one rank holds, in a few short lines, from a fsdp_tp_step or dp_pp_step result."""
    lines = []
    if "shards" in result:  # FSDP2 x TP: the first block's pieces stand for every block
        labels = {"0.0.weight": "W1", "0.0.bias": "b1", "0.2.weight": "W2", "0.2.bias": "b2"}
        peers = [r for r in result["groups"].get("tp", []) if r != result["rank"]]
        for name, label in labels.items():
            piece = result["shards"].get(name)
            if piece:
                local = "x".join(map(str, piece["local"]))
                whole = "x".join(map(str, piece["global"]))
                # b2 is whole over tp (Replicate): the tp peers hold the same piece
                same = (f" (also on {', '.join(map(str, peers))})"
                        if peers and piece["placements"][-1] == "R" else "")
                lines.append(f"{label} {local} of {whole}{same}")
    elif "blocks" in result:  # DP x PP: the stage's blocks, whole
        blocks = result["blocks"]
        span = f"{blocks[0]}" if len(blocks) == 1 else f"{blocks[0]}-{blocks[-1]}"
        lines.append(f"stage {result['stage']}: block{'s' * (len(blocks) > 1)} {span}")
    lines.append(f"params {result['held']['params']:,} B")
    return lines


@course_figure
def mesh_plot(values: list[dict], title: str | None = None, ax=None):
    """The 2-D mesh of a run: one box per rank, its groups along each dimension, what it holds.

    ``values`` are the per-rank results of ``compose.fsdp_tp_step`` or ``compose.dp_pp_step``
    (``labkit.launch(...).values``): each row's ``coords`` places the rank (outer dimension
    down, inner across), its ``groups`` draw the bands (inner groups as rows, outer groups as
    columns) and its ``shards`` or ``blocks`` and ``held`` say what it holds. Draws on ``ax``
    when given; returns the Figure.

    Example::

        >>> values = labkit.launch(compose.fsdp_tp_step, 2, 2, nproc=4).values
        >>> fig = mesh_plot(values, title="FSDP2 x TP on 2 x 2")
    """
    from matplotlib.patches import FancyBboxPatch, Patch

    if not values or not all(isinstance(v, dict) for v in values):
        raise ValueError("no ranks to draw: pass the .values of a launch of "
                         "compose.fsdp_tp_step or compose.dp_pp_step")
    missing = {"rank", "coords", "groups", "held"} - set(values[0])
    if missing:
        raise ValueError(f"the rows lack {sorted(missing)}: pass the .values of a launch of "
                         f"compose.fsdp_tp_step or compose.dp_pp_step")
    outer, inner = list(values[0]["coords"])
    rows = 1 + max(v["coords"][outer] for v in values)
    cols = 1 + max(v["coords"][inner] for v in values)
    char_in, line_in = 0.6 * MIN_TEXT_PT / 72, 1.25 * MIN_TEXT_PT / 72  # monospace, in inches
    room = (MAX_WIDTH_IN - 1.4) / cols  # the widest column the notebook's width allows
    cells = {v["rank"]: _mesh_cell_lines(v) for v in values}
    if max(len(line) for lines in cells.values() for line in lines) * char_in + 0.3 > room:
        # too narrow for whole lines: who else holds a piece goes on a line of its own
        cells = {rank: [part for line in lines for part in line.replace(" (also", "\n (also")
                        .split("\n")] for rank, lines in cells.items()}
    chars = max(len(line) for lines in cells.values() for line in lines)
    n_lines = max(len(lines) for lines in cells.values()) + 1  # and the rank's name
    col_in = min(max(2.6, chars * char_in + 0.6), room)
    row_in = n_lines * line_in + 0.7
    fig, ax = figure_for(ax, (cols * col_in + 1.4, rows * row_in + 1.6))
    # the axes' own size, in inches per cell (a given axes may be of any size)
    extent = ax.get_window_extent()
    cell_w, cell_h = extent.width / fig.dpi / cols, extent.height / fig.dpi / rows
    box_w = min((chars * char_in + 0.25) / cell_w, 0.92)
    box_h = min((n_lines * line_in + 0.2) / cell_h, 0.9)
    colours = {inner: "#E69F00", outer: "#0072B2"}
    # Each group is a line through its ranks: rows are the inner groups, columns the outer.
    for r in range(rows):
        ax.plot([0, cols - 1], [r, r], color=colours[inner], linewidth=9, alpha=0.55,
                solid_capstyle="round", zorder=1)
    for c in range(cols):
        ax.plot([c, c], [0, rows - 1], color=colours[outer], linewidth=9, alpha=0.55,
                solid_capstyle="round", zorder=1)
    for v in values:
        r, c = v["coords"][outer], v["coords"][inner]
        top = r - box_h / 2
        ax.add_patch(FancyBboxPatch((c - box_w / 2, top), box_w, box_h,
                                    boxstyle="round,pad=0.02", facecolor="white",
                                    edgecolor="#555555", linewidth=1.0, zorder=2))
        ax.text(c, top + 0.1 / cell_h, f"rank {v['rank']}", ha="center", va="top",
                fontweight="bold", zorder=3)
        ax.text(c, top + (0.1 + line_in * 1.2) / cell_h, "\n".join(cells[v["rank"]]),
                ha="center", va="top", fontsize=MIN_TEXT_PT, family="monospace", zorder=3)
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)  # outer index 0 on top, as the mesh is printed
    ax.xaxis.tick_top()
    ax.set_xticks(range(cols), [f"{inner}={c}" for c in range(cols)])
    ax.set_yticks(range(rows), [f"{outer}={r}" for r in range(rows)])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    groups = values[0]["groups"]
    ax.legend(handles=[Patch(color=colours[inner], alpha=0.55,
                             label=f"{inner} group (a row), e.g. ranks {groups[inner]}"),
                       Patch(color=colours[outer], alpha=0.55,
                             label=f"{outer} group (a column), e.g. ranks {groups[outer]}")],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=1)
    ax.set_title(title or f"{rows} x {cols} mesh ({outer} x {inner})", pad=30)  # over the ticks
    fig.tight_layout()
    return fig


@course_figure
def wire_plot(results: dict, ax=None):
    """Bytes one rank sends in a step, by mesh dimension and collective: measured and formula.

    ``results`` maps a label to one rank's result of ``compose.fsdp_tp_step`` or
    ``compose.dp_pp_step`` (e.g. ``{"FSDP2 x TP": ft[0], "DP x PP": pp[0]}``); each bar is one
    (dimension, collective) of its ``wire["bytes"]``, the black tick its ``wire_formula``.
    The bars are horizontal, one row each, so that any number of them fits the notebook's
    width. Draws on ``ax`` when given; returns the Figure.

    Example::

        >>> fig = wire_plot({"FSDP2 x TP": ft[0], "DP x PP": pp[0]})
    """
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    if not results:
        raise ValueError("nothing to plot: pass {label: one rank's result of fsdp_tp_step or "
                         "dp_pp_step}")
    bars = []
    for label, result in results.items():
        if "wire" not in result or "wire_formula" not in result:
            raise ValueError(f"{label!r} has no 'wire' and 'wire_formula': pass one rank's "
                             f"result of compose.fsdp_tp_step or compose.dp_pp_step")
        formula = result["wire_formula"]["bytes"]
        for dim, ops in result["wire"]["bytes"].items():
            for op, sent in ops.items():
                if op != "recv":  # a receive sends nothing
                    bars.append((f"{label}\n{dim}: {op}", sent, formula.get(dim, {}).get(op, 0),
                                 dim))
    # One row per bar: as many as there are, the figure grows down, never past the column.
    fig, ax = figure_for(ax, (MAX_WIDTH_IN, 0.6 * len(bars) + 1.8))
    colours = {"dp": "#0072B2", "tp": "#E69F00", "pp": "#009E73"}
    ys = range(len(bars))
    ax.barh(ys, [b[1] for b in bars], color=[colours.get(b[3], "#999999") for b in bars],
            height=0.6, label="measured")
    formula = ax.scatter([b[2] for b in bars], ys, marker="|", s=700, linewidths=2,
                         color="black", zorder=3, label="formula")
    for y, bar in zip(ys, bars, strict=True):
        ax.annotate(f"{bar[1]:,} B", (bar[1], y), textcoords="offset points", xytext=(6, 0),
                    va="center")
    ax.margins(x=0.3)  # room for the byte counts
    ax.set_xlim(left=0)
    ax.set_yticks(list(ys), [b[0] for b in bars])
    ax.invert_yaxis()  # the first bar on top
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    ax.set_xlabel("bytes sent by this rank")
    ax.set_title("One step on the wire, by mesh dimension")
    dims = list(dict.fromkeys(b[3] for b in bars))
    handles = [Patch(color=colours.get(d, "#999999"), label=f"{d}, measured") for d in dims]
    legend_outside(ax, "right", handles=[*handles, formula],
                   labels=[h.get_label() for h in handles] + ["formula"], markerscale=0.5)
    fig.tight_layout()
    return fig


# ---- the planner (notebook 10) ------------------------------------------------------------------

_PLAN_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
_PLAN_DIMENSIONS = ("dp", "tp", "pp", "cp", "ep")
# the dimensions' colours: none of the memory parts' (a dimension is not a kind of memory)
_DIMENSION_COLOURS = ("#56B4E9", "#882255", "#999933", "#332288", "#44AA99")


def _plan_ticks(ax, rows):
    """The plans' labels under their bars: a few side by side (a long one, e.g. a layout from
    the explorer, on two lines), many slanted."""
    x = list(range(len(rows)))
    if len(rows) > 2:
        ax.set_xticks(x, [r["label"] for r in rows], rotation=20, ha="right")
    else:
        ax.set_xticks(x, [textwrap.fill(r["label"], 24) for r in rows])


@course_figure
def planner_plot(rows: list[dict], ax=None):
    """Planned memory per device as stacked bars against the usable memory, and bytes sent per step.

    ``rows`` are ``Plan.row()`` dicts, one bar per row: ``label``, ``memory`` (bytes per device
    of ``params``, ``grads``, ``optimizer``, ``activations``, ``buffers``), ``budget`` (usable
    bytes), ``device_memory`` (the device's bytes) and ``comm`` (bytes sent per step by ``dp``,
    ``tp``, ``pp``, ``cp``, ``ep``). Left: the memory in GiB with the budget (dashed) and the
    device's memory (solid); right: the bytes sent, stacked by dimension. ``ax``: one Axes draws
    the memory alone, a pair of Axes draws both. Returns the Figure.

    Example::

        >>> fig = planner_plot([planner.plan(model, cluster, degrees).row()])
    """

    advice = "pass Plan.row() dicts, e.g. [planner.plan(model, cluster, degrees).row()]"
    if not rows:
        raise ValueError(f"no plans to plot: {advice}")
    check_rows(rows, ["label", "memory", "budget", "device_memory", "comm"], "rows", advice)
    fig, mem_ax, comm_ax = figure_pair(ax, (MAX_WIDTH_IN, 5.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for part in _PLAN_PARTS:
        heights = [r["memory"].get(part, 0) / 2**30 for r in rows]
        mem_ax.bar(x, heights, bottom=bottom, label=part)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for i, r in enumerate(rows):
        kw = {"label": "usable (less headroom)"} if i == 0 else {}
        mem_ax.hlines(r["budget"] / 2**30, i - 0.45, i + 0.45, colors="k", linestyles="--", **kw)
        kw = {"label": "device memory"} if i == 0 else {}
        mem_ax.hlines(r["device_memory"] / 2**30, i - 0.45, i + 0.45, colors="k", **kw)
    _plan_ticks(mem_ax, rows)
    top = max(max(bottom), max(r["device_memory"] / 2**30 for r in rows))
    mem_ax.set_ylim(0, 1.1 * top)
    mem_ax.set_ylabel("GiB per device")
    mem_ax.set_title("memory per device")
    mem_ax.grid(axis="y", alpha=0.3)
    legend_outside(mem_ax, "below", ncol=2)
    if comm_ax is not None:
        bottom = [0.0] * len(rows)
        for i, dim in enumerate(_PLAN_DIMENSIONS):
            heights = [r["comm"].get(dim, 0) / 2**30 for r in rows]
            if any(heights):
                comm_ax.bar(x, heights, bottom=bottom, label=dim, color=_DIMENSION_COLOURS[i])
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        _plan_ticks(comm_ax, rows)
        comm_ax.set_ylabel("GiB sent per device per step")
        comm_ax.set_title("communication per step")
        comm_ax.grid(axis="y", alpha=0.3)
        legend_outside(comm_ax, "below", ncol=3)  # none when nothing is sent
    fig.tight_layout()
    return fig


@course_figure
def planner_check_plot(rows: list[dict], ax=None):
    """The planner's predictions beside what real runs measured, one pair of bars per quantity.

    ``rows`` are ``planner.predicted_vs_measured`` rows: ``what``, ``predicted`` and ``measured``
    (bytes). The bars are in bytes on a log scale, each pair labelled with measured/predicted.
    Returns the Figure.

    Example::

        >>> fig = planner_check_plot(planner.predicted_vs_measured(p, {"dp": 529408}))
    """

    advice = "pass planner.predicted_vs_measured(plan, measured) rows"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    check_rows(rows, ["what", "predicted", "measured"], "rows", advice)
    fig, ax = figure_for(ax, (capped_width(max(6.5, 1.3 * len(rows) + 2.5)), 4.5))
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [r["predicted"] for r in rows], 0.4, label="planner")
    ax.bar([i + 0.2 for i in x], [r["measured"] for r in rows], 0.4, label="measured")
    for i, r in enumerate(rows):
        ratio = r["measured"] / r["predicted"] if r["predicted"] else float("nan")
        ax.annotate(f"x{ratio:.3f}", (i, max(r["predicted"], r["measured"])),
                    ha="center", va="bottom")
    ax.set_yscale("log")
    low = min(min(r["predicted"], r["measured"]) for r in rows)
    high = max(max(r["predicted"], r["measured"]) for r in rows)
    ax.set_ylim(max(low, 1) / 10, high * 3)  # bars start well below the smallest figure
    ax.set_xticks(x, [r["what"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("bytes")
    ax.set_title("planned vs measured")
    legend_outside(ax, "right")
    fig.tight_layout()
    return fig

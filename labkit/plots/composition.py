"""Figures of notebook 10: ZeRO by hand, 2-D meshes and what crosses each link, and the
planner's memory and bytes (and its predictions beside measurements)."""

from __future__ import annotations

from ._common import check_rows, figure_for, figure_pair

__all__ = ["zero_plot", "mesh_plot", "wire_plot", "planner_plot", "planner_check_plot"]


# ---- ZeRO by hand (notebook 10) -----------------------------------------------------------------

_ZERO_KINDS = ("params", "grads", "optimizer")


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
    fig, held_ax, wire_ax = figure_pair(ax, (10, 3.8))
    x = list(range(len(rows)))
    labels = [r["label"] for r in rows]
    bottom = [0.0] * len(rows)
    for kind in _ZERO_KINDS:
        heights = [r[kind] / 2**20 for r in rows]
        held_ax.bar(x, heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    extra = [r["in_flight"] / 2**20 for r in rows]
    if any(extra):
        held_ax.bar(x, extra, bottom=bottom, fill=False, hatch="//", edgecolor="0.4",
                    label="one gradient bucket in flight (backward)")
    held_ax.set_ylim(0, max(b + e for b, e in zip(bottom, extra, strict=True)) * 1.4)  # legend
    held_ax.set_xticks(x, labels, fontsize=8)
    held_ax.set_ylabel("MiB held per rank")
    held_ax.set_title("parameters, gradients, optimizer state")
    held_ax.legend(fontsize=7, loc="upper right")
    held_ax.grid(axis="y", alpha=0.3)
    if wire_ax is not None:
        wire_ax.bar(x, [r["wire"] / 2**20 for r in rows], color="0.5")
        for i, r in enumerate(rows):
            if not rows[0]["wire"]:  # one rank: nothing on the wire, no ratio to show
                break
            wire_ax.annotate(f"{r['wire'] / rows[0]['wire']:.2g}x DP", (i, r["wire"] / 2**20),
                             ha="center", va="bottom", fontsize=8)
        wire_ax.set_xticks(x, labels, fontsize=8)
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
    fig, ax = figure_for(ax, (2.6 * cols + 1.2, 1.6 * rows + 1.2))
    colours = {inner: "#f28e2b", outer: "#4e79a7"}
    # Each group is a line through its ranks: rows are the inner groups, columns the outer.
    for r in range(rows):
        ax.plot([0, cols - 1], [r, r], color=colours[inner], linewidth=9, alpha=0.55,
                solid_capstyle="round", zorder=1)
    for c in range(cols):
        ax.plot([c, c], [0, rows - 1], color=colours[outer], linewidth=9, alpha=0.55,
                solid_capstyle="round", zorder=1)
    for v in values:
        r, c = v["coords"][outer], v["coords"][inner]
        ax.add_patch(FancyBboxPatch((c - 0.36, r - 0.3), 0.72, 0.6, boxstyle="round,pad=0.02",
                                    facecolor="white", edgecolor="#555555", linewidth=1.0,
                                    zorder=2))
        ax.text(c, r - 0.2, f"rank {v['rank']}", ha="center", va="center", fontsize=10,
                fontweight="bold", zorder=3)
        ax.text(c, r + 0.07, "\n".join(_mesh_cell_lines(v)), ha="center", va="center",
                fontsize=7.5, family="monospace", zorder=3)
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.55, -0.5)  # outer index 0 on top, as the mesh is printed
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
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False)
    ax.set_title(title or f"{rows} x {cols} mesh ({outer} x {inner})", pad=20)
    fig.tight_layout()
    return fig


def wire_plot(results: dict, ax=None):
    """Bytes one rank sends in a step, by mesh dimension and collective: measured and formula.

    ``results`` maps a label to one rank's result of ``compose.fsdp_tp_step`` or
    ``compose.dp_pp_step`` (e.g. ``{"FSDP2 x TP": ft[0], "DP x PP": pp[0]}``); each bar is one
    (dimension, collective) of its ``wire["bytes"]``, the black tick its ``wire_formula``.
    Draws on ``ax`` when given; returns the Figure.

    Example::

        >>> fig = wire_plot({"FSDP2 x TP": ft[0], "DP x PP": pp[0]})
    """

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
    fig, ax = figure_for(ax, (max(5.0, 1.3 * len(bars) + 1.5), 3.6))
    colours = {"dp": "#4e79a7", "tp": "#f28e2b", "pp": "#59a14f"}
    xs = range(len(bars))
    ax.bar(xs, [b[1] for b in bars], color=[colours.get(b[3], "#999999") for b in bars],
           width=0.6, label="measured")
    ax.scatter(xs, [b[2] for b in bars], marker="_", s=600, color="black", zorder=3,
               label="formula")
    for x, bar in zip(xs, bars, strict=True):
        ax.annotate(f"{bar[1]:,} B", (x, bar[1]), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize=7)
    ax.margins(y=0.15)
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("bytes sent by this rank")
    ax.set_title("One step on the wire, by mesh dimension")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- the planner (notebook 10) ------------------------------------------------------------------

_PLAN_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
_PLAN_DIMENSIONS = ("dp", "tp", "pp", "cp", "ep")


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
    fig, mem_ax, comm_ax = figure_pair(ax, (10, 3.8))
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
    mem_ax.set_xticks(list(x), [r["label"] for r in rows], rotation=20, ha="right", fontsize=8)
    top = max(max(bottom), max(r["device_memory"] / 2**30 for r in rows))
    mem_ax.set_ylim(0, 1.45 * top)  # room above the bars for the legend
    mem_ax.set_ylabel("GiB per device")
    mem_ax.set_title("memory per device")
    mem_ax.legend(fontsize=7, ncol=3, loc="upper left")
    mem_ax.grid(axis="y", alpha=0.3)
    if comm_ax is not None:
        bottom = [0.0] * len(rows)
        for dim in _PLAN_DIMENSIONS:
            heights = [r["comm"].get(dim, 0) / 2**30 for r in rows]
            if any(heights):
                comm_ax.bar(x, heights, bottom=bottom, label=dim)
                bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        comm_ax.set_xticks(list(x), [r["label"] for r in rows], rotation=20, ha="right",
                           fontsize=8)
        comm_ax.set_ylabel("GiB sent per device per step")
        comm_ax.set_title("communication per step")
        if any(bottom):
            comm_ax.legend(fontsize=7)
        comm_ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


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
    fig, ax = figure_for(ax, (max(5, 1.3 * len(rows)), 3.8))
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [r["predicted"] for r in rows], 0.4, label="planner")
    ax.bar([i + 0.2 for i in x], [r["measured"] for r in rows], 0.4, label="measured")
    for i, r in enumerate(rows):
        ratio = r["measured"] / r["predicted"] if r["predicted"] else float("nan")
        ax.annotate(f"x{ratio:.3f}", (i, max(r["predicted"], r["measured"])),
                    ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    low = min(min(r["predicted"], r["measured"]) for r in rows)
    high = max(max(r["predicted"], r["measured"]) for r in rows)
    ax.set_ylim(max(low, 1) / 10, high * 3)  # bars start well below the smallest figure
    ax.set_xticks(x, [r["what"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("bytes")
    ax.set_title("planned vs measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig

"""Figures of notebook 09: sequence parallelism's activations and layout, ring attention's
schedule, work and memory, and experts over ranks (traffic, load, placement)."""

from __future__ import annotations

from ._common import MAX_WIDTH_IN, check_rows, course_figure, figure_for, legend_outside

__all__ = ["sp_activation_bytes", "sp_layout", "ring_schedule_plot", "ring_work_plot",
           "ring_memory_plot", "expert_traffic_matrix", "expert_load_plot",
           "expert_placement_plot"]


# ---- sequence parallelism (notebook 09) ---------------------------------------------------------

@course_figure
def sp_activation_bytes(rows, *, ax=None):
    """Activation bytes per rank of one transformer block, by region: dense, TP, SP.

    ``rows``: ``labkit.parallel.sequence.activation_rows(sp_check result)``, one dict per
    version (``{"version", "layernorm", "attention", "mlp", "dropout", "measured"}``, bytes).
    Draws one stacked bar per version (the formula's regions) and the measured total as a
    black marker on top: they coincide.
    """

    regions = ("layernorm", "attention", "mlp", "dropout")
    check_rows(rows, ["version", *regions, "measured"], "rows",
                "pass sequence.activation_rows(result) of a sequence.sp_check result")
    labels = {"layernorm": "LayerNorm inputs", "attention": "attention",
              "mlp": "MLP", "dropout": "dropout masks"}
    fig, ax = figure_for(ax, (9, 4.2))
    names = [r["version"] for r in rows]
    bottom = [0.0] * len(rows)
    for i, region in enumerate(regions):
        heights = [r[region] / 1e3 for r in rows]
        ax.bar(names, heights, bottom=bottom, color=f"C{i}", label=labels[region], width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.scatter(names, [r["measured"] / 1e3 for r in rows], marker="D", color="black",
               zorder=3, label="measured (saved_tensors_hooks)")
    for name, r in zip(names, rows, strict=True):
        ax.annotate(f"{r['measured'] / 1e3:.1f}", (name, r["measured"] / 1e3),
                    textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_ylabel("kB kept for backward, per rank")
    ax.set_title("one block's activations:\nwhat TP leaves replicated, SP splits")
    ax.set_ylim(0, max(bottom) * 1.2)
    legend_outside(ax, "right", wrap=18)
    fig.tight_layout()
    return fig


@course_figure
def sp_layout(tp, *, sent_bytes=None, ax=None):
    """Who holds what in a tensor-parallel and a sequence-parallel block, and what moves.

    Two rows, TP above SP; each draws the (seq x hidden) activation three times: the region
    of LayerNorm / dropout / residual, the attention and MLP region, and the next such region.
    Colours are ranks: horizontal bands are shards of the sequence, vertical bands shards of
    the heads or MLP features, grey is replicated. The arrows name the collectives;
    ``sent_bytes`` (``{"tp": n, "sp": n}``, bytes one rank sends in forward) labels each row.
    """
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, ax = figure_for(ax, (MAX_WIDTH_IN, 5.8))
    w, h, gap = 1.6, 1.2, 2.9
    xs = [0, w + gap, 2 * (w + gap)]
    top_row = 2.6  # the TP row's bottom; the SP row sits at 0, each row titled above it

    def box(x, y, split):
        if split not in ("seq", "hidden"):  # replicated: the whole tensor on every rank
            ax.add_patch(Rectangle((x, y), w, h, color="0.8"))
        for r in range(tp if split in ("seq", "hidden") else 0):
            if split == "seq":  # rank r: rows r*s/t ... of the sequence (top to bottom)
                rect = Rectangle((x, y + h - (r + 1) * h / tp), w, h / tp, color=f"C{r}",
                                 alpha=0.75)
            else:  # rank r: its heads / MLP features
                rect = Rectangle((x + r * w / tp, y), w / tp, h, color=f"C{r}", alpha=0.75)
            ax.add_patch(rect)
        ax.add_patch(Rectangle((x, y), w, h, fill=False, lw=1))

    rows = (("tp", top_row, "replicated", ("f: identity\n(all-reduce in backward)",
                                            "g: all-reduce\n(identity in backward)")),
            ("sp", 0.0, "seq", ("all-gather\n(reduce-scatter in backward)",
                                "reduce-scatter\n(all-gather in backward)")))
    for name, y, outer, (into, out_of) in rows:
        box(xs[0], y, outer)
        box(xs[1], y, "hidden")
        box(xs[2], y, outer)
        for (a, b), label in (((xs[0] + w, xs[1]), into), ((xs[1] + w, xs[2]), out_of)):
            ax.add_patch(FancyArrowPatch((a + 0.05, y + h / 2), (b - 0.05, y + h / 2),
                                         arrowstyle="-|>", mutation_scale=14, lw=1.2))
            ax.text((a + b) / 2, y + h / 2 + 0.12, label, ha="center", va="bottom")
        title = "tensor parallel" if name == "tp" else "tensor + sequence parallel"
        if sent_bytes is not None and name in sent_bytes:
            title += f"\n{sent_bytes[name] / 1e3:.1f} kB sent per rank, forward"
        ax.text(xs[0] - 0.2, y + h + 0.1, title, ha="left", va="bottom", fontweight="bold"
                if sent_bytes is None else "normal")
        where = ("every rank: all s tokens" if outer == "replicated"
                 else f"rank r: tokens r*s/{tp} ...")
        for x in (xs[0], xs[2]):
            ax.text(x + w / 2, y - 0.1, where, ha="center", va="top")
        ax.text(xs[1] + w / 2, y - 0.1, f"rank r: heads r*a/{tp} ...,\nall s tokens",
                ha="center", va="top")
    for x, label in zip(xs, ("LayerNorm, dropout,\nresidual", "QKV, attention, proj /\n"
                                                             "fc1, GELU, fc2",
                             "dropout, residual,\nnext LayerNorm"), strict=True):
        ax.text(x + w / 2, top_row + h + 0.85, label, ha="center", va="bottom")
    ax.text(xs[0] - 0.08, 0.0 + h / 2, "seq", rotation=90, ha="right", va="center")
    ax.text(xs[0] + w / 2, -0.45, "hidden", ha="center", va="top")
    handles = [Rectangle((0, 0), 1, 1, color=f"C{r}", alpha=0.75) for r in range(tp)]
    handles.append(Rectangle((0, 0), 1, 1, color="0.8"))
    ax.set_xlim(-0.5, xs[2] + w + 0.5)
    ax.set_ylim(-0.85, top_row + h + 1.55)
    ax.set_aspect("equal")
    ax.axis("off")
    legend_outside(ax, "below", handles=handles,
                   labels=[f"rank {r}" for r in range(tp)] + ["replicated"], ncol=tp + 1)
    fig.tight_layout()
    return fig


# ---- ring attention (notebook 09) ---------------------------------------------------------------

@course_figure
def ring_schedule_plot(rows: list[dict], ax=None):
    """Who holds which key/value chunk at each ring step, and which score blocks are computed.

    ``rows`` are ``labkit.parallel.context.ring_schedule(world, order, causal)``: one per
    (step, rank). Each cell (step across, rank down) is labelled with the key/value chunks the
    rank holds at that step; inside it, the blocks (query piece x key piece) are drawn dark
    where computed in full, mid where masked (the diagonal), blank where skipped (entirely in
    the future). Returns the Figure.

    Example::

        >>> fig = ring_schedule_plot(context.ring_schedule(4, "zigzag"))
    """
    from matplotlib.patches import Patch, Rectangle

    if not rows or not {"step", "rank", "kv_chunks", "blocks"} <= set(rows[0]):
        raise ValueError("pass the rows of labkit.parallel.context.ring_schedule(world, order)")
    world = max(r["rank"] for r in rows) + 1
    steps = max(r["step"] for r in rows) + 1
    fig, ax = figure_for(ax, (min(1.4 * steps + 2.5, MAX_WIDTH_IN), 0.95 * world + 1.2))
    colors = {"full": "#2b6cb0", "diagonal": "#90cdf4", "skipped": "white"}
    for r in rows:
        x0, y0 = r["step"], r["rank"]
        qs = list(dict.fromkeys(b["q"] for b in r["blocks"]))
        ks = list(dict.fromkeys(b["kv"] for b in r["blocks"]))
        w, h = 0.8 / len(ks), 0.55 / len(qs)
        for b in r["blocks"]:
            i, j = qs.index(b["q"]), ks.index(b["kv"])
            ax.add_patch(Rectangle((x0 + 0.1 + j * w, y0 + 0.35 + i * h), w, h,
                                   facecolor=colors[b["kind"]], edgecolor="0.4", linewidth=0.6))
        label = "K/V " + ",".join(map(str, r["kv_chunks"]))
        ax.text(x0 + 0.5, y0 + 0.2, label, ha="center", va="center")
    ax.set_xlim(0, steps)
    ax.set_ylim(world, 0)
    ax.set_xticks([s + 0.5 for s in range(steps)], [str(s) for s in range(steps)])
    q_of = {r["rank"]: r["q_chunks"] for r in rows}
    ax.set_yticks([k + 0.5 for k in range(world)],
                  [f"rank {k}\nQ {','.join(map(str, q_of[k]))}" for k in range(world)])
    ax.set_xlabel("ring step (K/V chunks move one rank down each step)")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.legend(handles=[Patch(facecolor=colors[k], edgecolor="0.4", label=k)
                       for k in ("full", "diagonal", "skipped")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


@course_figure
def ring_work_plot(rows: list[dict], ax=None):
    """Attention scores each rank computes in causal ring attention, contiguous vs zigzag.

    ``rows`` are ``labkit.parallel.context.ring_check`` results (every rank's, for one or more
    orders): one bar per rank and order, the height the query-key scores the rank computed
    forward (``scores``), labelled with its score blocks and measured compute time. Blocks
    differ in size between the orders (zigzag's are quarter blocks), scores do not. The ring
    is as slow as its busiest rank: the dashed line per order. Returns the Figure.

    Example::

        >>> rows = [r for order in ("contiguous", "zigzag")
        ...         for r in labkit.launch(ring_check, 64, order=order, nproc=4).values]
        >>> fig = ring_work_plot(rows)
    """

    if not rows or not {"rank", "order", "scores", "blocks"} <= set(rows[0]):
        raise ValueError("pass the rows of labkit.parallel.context.ring_check (every rank's)")
    fig, ax = figure_for(ax, (9, 4.5))
    orders = list(dict.fromkeys(r["order"] for r in rows))
    width = 0.8 / len(orders)
    for i, order in enumerate(orders):
        mine = sorted((r for r in rows if r["order"] == order), key=lambda r: r["rank"])
        xs = [r["rank"] + (i - (len(orders) - 1) / 2) * width for r in mine]
        bars = ax.bar(xs, [r["scores"] for r in mine], width, label=order)
        for bar, r in zip(bars, mine, strict=True):
            text = f"{r['blocks']} blk"
            if r.get("compute_s") is not None:
                text += f"\n{r['compute_s'] * 1e3:.1f} ms"
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center",
                    va="bottom")
        ax.axhline(max(r["scores"] for r in mine), color=bars[0].get_facecolor(),
                   linestyle="--", linewidth=1)
    ranks = sorted({r["rank"] for r in rows})
    ax.set_xticks(ranks, [f"rank {k}" for k in ranks])
    ax.set_ylabel("query-key scores computed")
    ax.set_ylim(0, max(r["scores"] for r in rows) * 1.35)  # room for the labels
    causal = "causal" if rows[0].get("causal", True) else "not causal"
    ax.set_title(f"ring attention, {causal}: work per rank\n(dashed: the busiest rank)")
    legend_outside(ax, "right")
    fig.tight_layout()
    return fig


@course_figure
def ring_memory_plot(rows: list[dict], ax=None):
    """Bytes kept for backward per rank against the sequence length: full vs ring attention.

    ``rows`` are ``labkit.parallel.context.memory_sweep``'s: markers are the measured bytes
    (``full``, ``ring``), lines the formulas (``full_formula``: ``O(s^2)``; ``ring_formula``:
    ``O(s / n)``), on log-log axes. Returns the Figure.

    Example::

        >>> fig = ring_memory_plot(labkit.launch(memory_sweep, [64, 128, 256], nproc=4).values[0])
    """
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    keys = {"seq", "full", "full_formula", "ring", "ring_formula"}
    if not rows or not keys <= set(rows[0]):
        raise ValueError("pass the rows of labkit.parallel.context.memory_sweep")
    fig, ax = figure_for(ax, (9, 4.5))
    rows = sorted(rows, key=lambda r: r["seq"])
    seqs = [r["seq"] for r in rows]
    n = rows[0].get("world", "n")
    for key, name in (("full", "full attention, one rank: O(s^2)"),
                      ("ring", f"ring attention, per rank of {n}: O(s/n)")):
        line, = ax.plot(seqs, [r[f"{key}_formula"] / 2**10 for r in rows], "-",
                        label=f"{name}, formula")
        ax.plot(seqs, [r[key] / 2**10 for r in rows], "o", color=line.get_color(),
                label=f"{name.split(',')[0]}, measured")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length s")
    ax.set_ylabel("KiB saved for backward")
    ax.grid(alpha=0.3, which="both")
    legend_outside(ax, "right", wrap=24)
    fig.tight_layout()
    return fig


# ---- experts over ranks (notebook 09) -----------------------------------------------------------

@course_figure
def expert_traffic_matrix(results: list[dict], ax=None):
    """Rows each rank sends to each rank, as a heatmap, from ``moe_check`` (one dict per rank).

    Row ``i`` is the sender, column ``j`` the receiver: entry ``(i, j)`` is ``send_counts[j]``
    of rank ``i`` ((token, expert) rows, each ``hidden`` numbers). The diagonal stays on its
    rank; everything else crosses the network, twice forward and twice backward. Draws on
    ``ax`` when given; returns the Figure.

    Example::

        >>> fig = expert_traffic_matrix(labkit.launch(moe_check, 32, 16, 32, 4, nproc=2).values)
    """

    if not results or "send_counts" not in results[0]:
        raise ValueError("pass the list of dicts moe_check returned (one per rank)")
    matrix = [r["send_counts"] for r in sorted(results, key=lambda r: r["rank"])]
    n = len(matrix)
    fig, ax = figure_for(ax, (min(1.2 * n + 3, MAX_WIDTH_IN), min(1.1 * n + 2, 8.0)))
    image = ax.imshow(matrix, cmap="Blues", vmin=0)
    top = max(max(row) for row in matrix) or 1
    for i, row in enumerate(matrix):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center",
                    color="white" if count > top / 2 else "black",
                    fontweight="bold" if i == j else "normal")
    # bare numbers: "rank 0 rank 1 ..." side by side runs together in a narrow panel
    ax.set_xticks(range(n), [str(j) for j in range(n)])
    ax.set_yticks(range(n), [str(i) for i in range(n)])
    ax.set_xlabel("receiving rank (holds the experts)")
    ax.set_ylabel("sending rank (routed the tokens)")
    ax.set_title("rows sent by each rank to each rank\n(diagonal: stays on the rank)")
    fig.colorbar(image, ax=ax, label="rows")
    fig.tight_layout()
    return fig


@course_figure
def expert_load_plot(rows: list[dict], ax=None):
    """Tokens per expert over training steps, with and without the load-balancing loss.

    From ``balance_sweep`` rows: for each setting, a band from the idlest to the busiest
    expert (and the busiest as a line), beside the fair share ``sum / n_experts`` (dashed);
    the legend gives the rows dropped at the last step. Draws on ``ax`` when given; returns
    the Figure.

    Example::

        >>> fig = expert_load_plot(balance_sweep())
    """

    if not rows or not {"aux", "step", "tokens_per_expert", "dropped"} <= set(rows[0]):
        raise ValueError("pass the rows balance_sweep returned")
    fig, ax = figure_for(ax, (8.5, 5))
    counts = rows[0]["tokens_per_expert"]
    fair = sum(counts) / len(counts)
    for aux, color in ((False, "tab:red"), (True, "tab:blue")):
        mine = sorted((r for r in rows if r["aux"] == aux), key=lambda r: r["step"])
        if not mine:
            continue
        steps = [r["step"] for r in mine]
        busiest = [max(r["tokens_per_expert"]) for r in mine]
        idlest = [min(r["tokens_per_expert"]) for r in mine]
        name = "with the load-balancing loss" if aux else "without"
        ax.fill_between(steps, idlest, busiest, color=color, alpha=0.2)
        ax.plot(steps, busiest, color=color,
                label=f"{name}: busiest expert ({mine[-1]['dropped']} rows dropped at the end)")
        ax.plot(steps, idlest, color=color, lw=0.8, ls=":")
    ax.axhline(fair, color="k", ls="--", label=f"fair share ({fair:g} rows per expert)")
    ax.set_xlabel("training step")
    ax.set_ylabel("rows per expert (band: idlest to busiest)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    legend_outside(ax, "below")  # the curves fill the axes from edge to edge
    fig.tight_layout()
    return fig


@course_figure
def expert_placement_plot(tokens_per_expert: list[int], world: int, capacity=None, ax=None):
    """Who holds which experts: one bar per expert (its rows), coloured by the rank holding it.

    Rank ``r`` holds experts ``r * E/world ... (r+1) * E/world - 1``; ``tokens_per_expert``
    (e.g. ``moe_check``'s ``reference["tokens_per_expert"]``) gives each bar its height, and
    ``capacity`` draws the limit over which rows are dropped. Draws on ``ax`` when given;
    returns the Figure.

    Example::

        >>> r = labkit.launch(moe_check, 32, 16, 32, 4, capacity_factor=1.0, nproc=2).values[0]
        >>> fig = expert_placement_plot(r["reference"]["tokens_per_expert"], 2, r["capacity"])
    """

    n_experts = len(tokens_per_expert)
    if not n_experts or world < 1 or n_experts % world:
        raise ValueError(f"{n_experts} experts do not split over {world} ranks: pass one count "
                         f"per expert and the number of ranks that hold them")
    per_rank = n_experts // world
    fig, ax = figure_for(ax, (min(max(6, 0.5 * n_experts + 3), MAX_WIDTH_IN), 4.5))
    for rank in range(world):
        experts = list(range(rank * per_rank, (rank + 1) * per_rank))
        ax.bar(experts, [tokens_per_expert[e] for e in experts], color=f"C{rank}",
               label=f"rank {rank}: experts {experts[0]}..{experts[-1]}")
    if capacity is not None:
        ax.axhline(capacity, color="k", ls="--", label=f"capacity ({capacity} rows)")
    top = max([*tokens_per_expert, capacity or 0, 1])
    ax.set_ylim(0, top * 1.1)
    ax.set_xticks(range(n_experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("rows routed to it")
    ax.set_title("experts and the ranks that hold them")
    legend_outside(ax, "below", ncol=min(world + (capacity is not None), 2))
    fig.tight_layout()
    return fig

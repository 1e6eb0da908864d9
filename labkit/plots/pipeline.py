"""Figures of notebooks 03 and 10: pipeline timelines (1F1B and GPipe, then interleaved and
zero-bubble schedules) and the bubble against the number of micro-batches."""

from __future__ import annotations

from ._common import MIN_TEXT_PT, course_figure, figure_for, fit_labels, legend_outside

__all__ = ["pipeline_timeline", "bubble_plot", "schedule_timeline_plot"]


_PIPELINE_COLOURS = {"F": "#4C72B0", "B": "#DD8452"}  # forward blue, backward orange


def _events_of_step(events: list[dict], step: int, source: str) -> list[dict]:
    """The events of ``step`` (simulated ones carry no step: they are step 0), or a clear error
    naming ``source``, the functions whose events a timeline draws."""
    if not events:
        raise ValueError(f"no events to plot: pass the 'events' that {source} returned")
    missing = {"rank", "kind", "micro", "start", "end"} - set(events[0])
    if missing:
        raise ValueError(f"events lack {sorted(missing)}: pass the events {source} returned")
    shown = [e for e in events if e.get("step", 0) == step]
    if not shown:
        steps = sorted({e.get("step", 0) for e in events})
        raise ValueError(f"no events of step {step}: the events hold steps {steps}")
    return shown


@course_figure
def pipeline_timeline(events: list[dict], title: str | None = None, step: int = 0, ax=None):
    """Gantt chart of one pipeline step: one row per rank, F and B blocks, idle as gaps.

    Each block carries its micro-batch number (upright in a narrow block, none in a block too
    small for it); the white space between blocks is the bubble
    (and, on real hardware, waiting for messages). Events of several steps (``run_pipeline``
    with ``steps > 1``) are filtered to ``step``. Draws on ``ax`` when given; returns the
    Figure.

    Example::

        >>> out = labkit.launch(run_pipeline, stage_builder(mlp_stack), "1f1b", 4,
        ...                     example_batch(256), nproc=2).values[0]
        >>> fig = pipeline_timeline(out["events"], title="1F1B, 2 stages, 4 micro-batches")
    """
    from matplotlib.patches import Patch

    shown = _events_of_step(events, step, "run_pipeline or simulate")
    ranks = sorted({e["rank"] for e in shown})
    t0 = min(e["start"] for e in shown)
    # Measured steps last milliseconds; simulate()'s unit slots (1.0, 2.0) are drawn as they are.
    scale, unit = (1e3, "ms") if max(e["end"] for e in shown) - t0 < 2 else (1.0, "s")
    fig, ax = figure_for(ax, (9.5, 0.65 * len(ranks) + 1.5))
    labelled = []
    for e in shown:
        left, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        (bar,) = ax.barh(e["rank"], width, left=left, height=0.7,
                         color=_PIPELINE_COLOURS[e["kind"]], edgecolor="white", linewidth=0.8)
        labelled.append((ax.text(left + width / 2, e["rank"], str(e["micro"]), ha="center",
                                 va="center", color="white", fontsize=MIN_TEXT_PT,
                                 clip_on=True), bar))
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()  # rank 0, the first stage, on top
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, None)
    legend_outside(ax, "right", handles=[Patch(color=c, label={"F": "forward",
                                                                "B": "backward"}[k])
                                         for k, c in _PIPELINE_COLOURS.items()],
                   labels=["forward", "backward"])
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fit_labels(labelled)  # at its final size: a block too narrow for its number stays bare
    return fig


@course_figure
def bubble_plot(rows: list[dict], ax=None):
    """Measured bubble against the micro-batch count ``m``, beside ``(p - 1) / (m + p - 1)``.

    One line of measurements per schedule (rows of ``bubble_sweep``), dotted beside it the
    schedule replayed with the measured stage times and hand-over cost (when the rows have
    ``with_messages``), and the formula as a dashed line; ``m`` on a log-2 axis. Draws on
    ``ax`` when given; returns the Figure.

    Example::

        >>> rows = labkit.launch(bubble_sweep, stage_builder(mlp_stack), [1, 2, 4, 8],
        ...                      example_batch(256), nproc=2).values[0]
        >>> fig = bubble_plot(rows)
    """

    if not rows:
        raise ValueError("no rows to plot: pass the list that bubble_sweep returned")
    missing = {"schedule", "m", "measured", "formula", "stages"} - set(rows[0])
    if missing:
        raise ValueError(f"rows lack {sorted(missing)}: pass the rows bubble_sweep returned")
    fig, ax = figure_for(ax, (9, 4.5))
    ms = sorted({r["m"] for r in rows})
    formula = {r["m"]: r["formula"] for r in rows}
    stages = rows[0]["stages"]
    ax.plot(ms, [formula[m] for m in ms], "k--",
            label=f"formula (p - 1) / (m + p - 1), p = {stages}")
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["m"])
        line, = ax.plot([r["m"] for r in mine], [r["measured"] for r in mine], "o-",
                        label=f"measured, {name}")
        if "with_messages" in mine[0]:
            ax.plot([r["m"] for r in mine], [r["with_messages"] for r in mine], ":",
                    color=line.get_color(),
                    label=f"model with measured stages and messages, {name}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle fraction)")
    ax.set_ylim(0, max(0.55, max(r["measured"] for r in rows) * 1.1))
    ax.grid(alpha=0.3)
    legend_outside(ax, "right", wrap=24)
    fig.tight_layout()
    return fig


# forward blue, backward (full or input) orange, weight gradient green
_SCHEDULE_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


@course_figure
def schedule_timeline_plot(events: list[dict], title: str | None = None, step: int = 0, ax=None):
    """Gantt chart of one pipeline step with chunks and split backwards: one row per rank.

    Draws the events of ``schedules.simulate_chunked`` / ``schedule_timeline`` / ``pipelined_step``
    (``rank, kind, chunk, micro, start, end``, optional ``step``): F blue, B orange (the full
    backward, or its input half), W green (the weight half); a rank's later chunks in paler
    shades; each block labelled ``chunk.micro`` when there are several chunks, else ``micro``
    (upright in a narrow block, none in a block too small for it).
    White space is the bubble. Measured events of several steps are filtered to ``step``.
    Draws on ``ax`` when given; returns the Figure.

    Example::

        >>> from labkit.parallel import schedules
        >>> t = schedules.schedule_timeline("interleaved 1f1b", 4, 8, chunks=2)
        >>> fig = schedule_timeline_plot(t["events"], title="interleaved 1F1B, p=4, v=2")
    """
    from matplotlib import colors as mcolors
    from matplotlib.patches import Patch

    shown = _events_of_step(events, step, "schedules.simulate_chunked, schedule_timeline or "
                                          "pipelined_step")
    ranks = sorted({e["rank"] for e in shown})
    chunks = max(e.get("chunk", 0) for e in shown) + 1
    t0 = min(e["start"] for e in shown)
    # Measured events (they carry "step") are in seconds; simulated ones in the costs' units.
    if "step" in shown[0]:
        scale, unit = (1e3, "ms") if max(e["end"] for e in shown) - t0 < 2 else (1.0, "s")
    else:
        scale, unit = 1.0, "time units"
    if max(e["end"] for e in shown) <= t0:
        raise ValueError("every event has zero length: nothing to draw (simulate with positive "
                         "costs f, b, w, or pass a measured step)")
    fig, ax = figure_for(ax, (9.5, 0.6 * len(ranks) + 1.6))
    labelled = []
    for e in shown:
        chunk = e.get("chunk", 0)
        base = mcolors.to_rgb(_SCHEDULE_COLOURS[e["kind"]])
        fade = 0.55 * chunk / max(chunks - 1, 1)  # later chunks paler, towards white
        colour = tuple(c + (1 - c) * fade for c in base)
        left, width = float(e["start"] - t0) * scale, float(e["end"] - e["start"]) * scale
        (bar,) = ax.barh(e["rank"], width, left=left, height=0.7, color=colour,
                         edgecolor="white", linewidth=0.6)
        label = f"{chunk}.{e['micro']}" if chunks > 1 else str(e["micro"])
        labelled.append((ax.text(left + width / 2, e["rank"], label, ha="center", va="center",
                                 color="black" if fade > 0.3 else "white", fontsize=MIN_TEXT_PT,
                                 clip_on=True),
                         bar))
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()  # rank 0, the first stage, on top
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, None)
    kinds = sorted({e["kind"] for e in shown}, key="FBW".index)
    names = {"F": "forward", "B": "backward (input)" if "W" in kinds else "backward",
             "W": "weight grad"}
    handles = [Patch(color=_SCHEDULE_COLOURS[k], label=names[k]) for k in kinds]
    if chunks > 1:
        handles.append(Patch(color="#BBBBBB", label="paler: later chunk (label chunk.micro)"))
    legend_outside(ax, "right", handles=handles, labels=[h.get_label() for h in handles],
                   wrap=16)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    # At its final size: a block too narrow for its label stays bare (the colours still say
    # what it is), rather than its label running into the next one's.
    fit_labels(labelled)
    return fig

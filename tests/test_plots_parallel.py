"""labkit.plots, notebooks 09 and 10: each figure drawn from the rows of the module that feeds it.

The rows are real: the pure functions (ring_schedule, schedule_timeline, mesh_groups, the
planner, balance_sweep) run here; the worker functions run once on 2 warm gloo ranks (one
launch for every figure), and a few in a one-rank group in this process (the degenerate mesh,
matrix and wire). Each test checks what was drawn against the rows: bars, patches and lines
counted, heights and labels read back, ``ax=`` honoured, bad rows refused with a clear error.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest

from labkit import launch, plots
from labkit.parallel import compose, context, expert, schedules, sequence

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def two_rank_results() -> dict:
    """Run on each of 2 ranks: every worker function whose rows a figure here draws, tiny."""
    from labkit.parallel import compose, context, expert, sequence, zero

    return {"sp": sequence.sp_check(8, 1, 8, 2),
            "ring": [context.ring_check(8, 1, 1, 4, True, order)
                     for order in ("contiguous", "zigzag")],
            "memory": context.memory_sweep([8, 16, 32], heads=1, head_dim=4),
            "moe": expert.moe_check(8, 4, 8, 4, capacity_factor=1.0),
            "zero": zero.zero_rows(zero.zero_check(1, 4, 2, 2), zero.zero_check(2, 4, 2, 2),
                                   zero.zero3_traffic(4, 2)),
            "fsdp_tp": compose.fsdp_tp_step(1, 2, width=4, depth=1, batch=2),
            "dp_pp": compose.dp_pp_step(1, 2, width=4, depth=2, batch=2, microbatches=2)}


@pytest.fixture(scope="module")
def ranks():
    return launch(two_rank_results, nproc=2, backend="gloo", warm=True, show_ranks=[],
                  timeout=240).values


@pytest.fixture(autouse=True)
def close_figures():
    yield
    from matplotlib import pyplot as plt

    plt.close("all")


def _axes():
    """A figure with one Axes, to pass as ``ax=``."""
    from matplotlib import pyplot as plt

    return plt.subplots()


def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def _ticks(labels) -> list[str]:
    return [t.get_text() for t in labels]


# ---- sequence parallelism ----------------------------------------------------------------------


def test_sp_activation_bytes_stacks_the_four_regions_per_version(ranks):
    rows = sequence.activation_rows(ranks[0]["sp"])
    (ax,) = plots.sp_activation_bytes(rows).axes
    assert len(ax.patches) == 4 * len(rows)  # layernorm, attention, mlp, dropout per version
    tops = {}
    for bar in ax.patches:
        tops[round(bar.get_x(), 6)] = max(tops.get(round(bar.get_x(), 6), 0), bar.get_y()
                                          + bar.get_height())
    assert sorted(tops.values()) == pytest.approx(sorted(r["formula"] / 1e3 for r in rows))
    (measured,) = ax.collections
    assert measured.get_offsets()[:, 1].tolist() == pytest.approx([r["measured"] / 1e3
                                                                   for r in rows])
    assert _ticks(ax.get_xticklabels()) == ["dense", "TP", "TP + SP", "TP + SP, regather"]
    assert _texts(ax) == [f"{r['measured'] / 1e3:.1f}" for r in rows]
    fig, given = _axes()
    assert plots.sp_activation_bytes(rows, ax=given) is fig and len(given.patches) == 16


def test_sp_layout_draws_both_rows_with_the_bytes_each_sends(ranks):
    r = ranks[0]["sp"]
    tp = r["degree"]
    sent = {"tp": r["tp"]["sent_bytes"]["forward"], "sp": r["sp"]["sent_bytes"]["forward"]}
    (ax,) = plots.sp_layout(tp, sent_bytes=sent).axes
    # 3 boxes a row: 4 split ones (tp pieces + outline), 2 replicated (one grey piece + outline);
    # and 4 arrows
    assert len(ax.patches) == 4 * (tp + 1) + 2 * 2 + 4
    texts = "\n".join(_texts(ax))
    for name, title in (("tp", "tensor parallel"), ("sp", "tensor + sequence parallel")):
        assert f"{title}\n{sent[name] / 1e3:.1f} kB sent per rank, forward" in _texts(ax)
    assert "g: all-reduce" in texts and "reduce-scatter\n(all-gather in backward)" in texts
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["rank 0", "rank 1",
                                                                   "replicated"]
    fig, given = _axes()
    assert plots.sp_layout(tp, ax=given) is fig
    assert not any("kB sent" in t for t in _texts(given))  # no bytes given: none shown


# ---- ring attention ----------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["contiguous", "zigzag"])
def test_ring_schedule_plot_draws_every_block_of_every_step(order):
    rows = context.ring_schedule(2, order)
    (ax,) = plots.ring_schedule_plot(rows).axes
    blocks = [b for r in rows for b in r["blocks"]]
    assert len(ax.patches) == len(blocks)
    white = sum(p.get_facecolor()[:3] == (1.0, 1.0, 1.0) for p in ax.patches)
    assert white == sum(b["kind"] == "skipped" for b in blocks)
    assert _texts(ax) == ["K/V " + ",".join(map(str, r["kv_chunks"])) for r in rows]
    q0 = ",".join(map(str, rows[0]["q_chunks"]))
    assert _ticks(ax.get_yticklabels())[0] == f"rank 0\nQ {q0}"
    fig, given = _axes()
    assert plots.ring_schedule_plot(rows, ax=given) is fig and len(given.patches) == len(blocks)


def test_ring_work_plot_one_bar_per_rank_and_order(ranks):
    rows = [r for v in ranks for r in v["ring"]]
    (ax,) = plots.ring_work_plot(rows).axes
    assert len(ax.patches) == len(rows) == 4
    assert sorted(p.get_height() for p in ax.patches) == sorted(r["scores"] for r in rows)
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert sorted(line.get_ydata()[0] for line in dashed) == sorted(
        max(r["scores"] for r in rows if r["order"] == o) for o in ("contiguous", "zigzag"))
    assert all(t.split("\n")[0].endswith(" blk") and t.endswith(" ms") for t in _texts(ax))
    assert "causal" in ax.get_title() and "not causal" not in ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["contiguous", "zigzag"]
    fig, given = _axes()
    assert plots.ring_work_plot(rows, ax=given) is fig


def test_ring_memory_plot_formulas_as_lines_and_measurements_as_markers(ranks):
    rows = ranks[0]["memory"]
    (ax,) = plots.ring_memory_plot(list(reversed(rows))).axes  # any order: sorted by seq
    full_f, full, ring_f, ring = ax.get_lines()
    assert list(full.get_xdata()) == [8, 16, 32]
    assert list(full.get_ydata()) == pytest.approx([r["full"] / 1024 for r in rows])
    assert list(ring_f.get_ydata()) == pytest.approx([r["ring_formula"] / 1024 for r in rows])
    assert list(full_f.get_ydata()) == pytest.approx([r["full_formula"] / 1024 for r in rows])
    assert list(ring.get_ydata()) == pytest.approx([r["ring"] / 1024 for r in rows])
    assert "per rank of 2" in ring_f.get_label()
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    fig, given = _axes()
    assert plots.ring_memory_plot(rows, ax=given) is fig


def test_ring_figures_refuse_the_wrong_rows(ranks):
    with pytest.raises(ValueError, match="ring_schedule"):
        plots.ring_schedule_plot([])
    with pytest.raises(ValueError, match="ring_check"):
        plots.ring_work_plot(context.ring_schedule(2))
    with pytest.raises(ValueError, match="memory_sweep"):
        plots.ring_memory_plot(ranks[0]["ring"])


# ---- experts -----------------------------------------------------------------------------------


def test_expert_traffic_matrix_is_send_counts_sender_by_receiver(ranks):
    results = [v["moe"] for v in ranks]
    fig = plots.expert_traffic_matrix(list(reversed(results)))  # sorted by rank
    ax = fig.axes[0]
    matrix = ax.images[0].get_array().tolist()
    assert matrix == [r["send_counts"] for r in results]
    # what rank j receives from rank i is what i sends to j
    assert [[row[j] for row in matrix] for j in range(2)] == [r["recv_counts"] for r in results]
    assert _texts(ax) == [str(c) for row in matrix for c in row]
    assert len(fig.axes) == 2  # and the colour bar
    fig, given = _axes()
    assert plots.expert_traffic_matrix(results, ax=given) is fig
    with pytest.raises(ValueError, match="moe_check"):
        plots.expert_traffic_matrix([{"rank": 0}])


def test_expert_load_plot_a_band_per_setting_and_the_fair_share():
    rows = expert.balance_sweep(n_experts=4, hidden=4, ffn=8, tokens=32, steps=3)
    (ax,) = plots.expert_load_plot(rows).axes
    assert len(ax.collections) == 2 and len(ax.get_lines()) == 2 * 2 + 1
    without = sorted((r for r in rows if not r["aux"]), key=lambda r: r["step"])
    busiest = ax.get_lines()[0]
    assert list(busiest.get_xdata()) == [0, 1, 2]
    assert list(busiest.get_ydata()) == [max(r["tokens_per_expert"]) for r in without]
    fair = sum(rows[0]["tokens_per_expert"]) / 4
    assert ax.get_lines()[-1].get_ydata()[0] == fair
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels[0] == (f"without: busiest expert ({without[-1]['dropped']} rows dropped "
                         f"at the end)")
    assert labels[-1] == f"fair share ({fair:g} rows per expert)"
    fig, given = _axes()
    assert plots.expert_load_plot(rows, ax=given) is fig
    with pytest.raises(ValueError, match="balance_sweep"):
        plots.expert_load_plot([])


def test_expert_placement_plot_colours_experts_by_the_rank_holding_them(ranks):
    r = ranks[0]["moe"]
    counts = r["reference"]["tokens_per_expert"]
    (ax,) = plots.expert_placement_plot(counts, 2, r["capacity"]).axes
    assert [p.get_height() for p in ax.patches] == counts
    colours = [p.get_facecolor() for p in ax.patches]
    assert colours[0] == colours[1] != colours[2] == colours[3]  # 2 experts per rank
    assert ax.get_lines()[0].get_ydata()[0] == r["capacity"]
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == [
        f"capacity ({r['capacity']} rows)", "rank 0: experts 0..1", "rank 1: experts 2..3"]
    fig, given = _axes()
    assert plots.expert_placement_plot(counts, 4, ax=given) is fig and not given.get_lines()
    with pytest.raises(ValueError, match="3 experts do not split over 2 ranks"):
        plots.expert_placement_plot(counts[:3], 2)


# ---- ZeRO by hand ------------------------------------------------------------------------------


def test_zero_plot_stacks_what_each_rank_holds_and_what_it_sends(ranks):
    rows = ranks[0]["zero"]
    assert [r["label"] for r in rows] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3 (FSDP2)"]
    held, wire = plots.zero_plot(rows).axes
    flight = sum(1 for r in rows if r["in_flight"])
    assert flight and len(held.patches) == 3 * len(rows) + len(rows)  # the bucket: one per row
    assert [p.get_height() for p in wire.patches] == pytest.approx([r["wire"] / 2**20
                                                                    for r in rows])
    assert _texts(wire) == [f"{r['wire'] / rows[0]['wire']:.2g}x DP" for r in rows]
    tops = [p.get_y() + p.get_height() for p in held.patches[2 * len(rows):3 * len(rows)]]
    assert tops == pytest.approx([(r["params"] + r["grads"] + r["optimizer"]) / 2**20
                                  for r in rows])
    # long labels on two lines, side by side
    assert [t.replace("\n", " ") for t in _ticks(held.get_xticklabels())] == [r["label"]
                                                                               for r in rows]
    fig, given = _axes()
    assert plots.zero_plot(rows, ax=given) is fig and len(fig.axes) == 1
    from matplotlib import pyplot as plt

    fig, pair = plt.subplots(1, 2)
    assert plots.zero_plot(rows, ax=list(pair)) is fig and len(pair[1].patches) == len(rows)


def test_zero_plot_refuses_rows_without_the_bytes():
    with pytest.raises(ValueError, match="no rows to plot"):
        plots.zero_plot([])
    with pytest.raises(ValueError, match=r"rows lack \['in_flight', 'wire'\]: pass zero.zero_"):
        plots.zero_plot([{"label": "DP", "params": 1, "grads": 1, "optimizer": 2}])


# ---- 2-D meshes ----------------------------------------------------------------------------------


def test_mesh_plot_a_box_per_rank_on_its_groups(ranks):
    values = [v["fsdp_tp"] for v in ranks]
    (ax,) = plots.mesh_plot(values).axes
    layout = compose.mesh_groups(1, 2)
    assert len(ax.patches) == 2 and len(ax.get_lines()) == len(layout["grid"]) + 2
    assert ax.get_title() == "1 x 2 mesh (dp x tp)"
    assert _ticks(ax.get_xticklabels()) == ["tp=0", "tp=1"]
    texts = _texts(ax)
    assert "rank 0" in texts and "rank 1" in texts
    assert any(t.startswith("W1 8x4 of 16x4") for t in texts)
    assert any("b2 4 of 4 (also on 1)" in t for t in texts)  # replicated over tp
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == f"tp group (a row), e.g. ranks {layout['tp'][0]}"
    assert legend[1] == f"dp group (a column), e.g. ranks {layout['dp'][0]}"
    fig, given = _axes()
    pp = [v["dp_pp"] for v in ranks]
    assert plots.mesh_plot(pp, title="DP x PP on 1 x 2", ax=given) is fig
    assert given.get_title() == "DP x PP on 1 x 2"
    assert any(t.startswith("stage 1: block 1\nparams ") for t in _texts(given))


def test_mesh_plot_refuses_what_is_not_a_launch_of_a_mesh_step():
    with pytest.raises(ValueError, match="no ranks to draw"):
        plots.mesh_plot([])
    with pytest.raises(ValueError, match=r"the rows lack \['coords', 'groups', 'held'\]"):
        plots.mesh_plot([{"rank": 0}])


def test_wire_plot_a_bar_per_dimension_and_collective_beside_its_formula(ranks):
    results = {"FSDP2 x TP": ranks[0]["fsdp_tp"], "DP x PP": ranks[0]["dp_pp"]}
    (ax,) = plots.wire_plot(results).axes
    expected = [(f"{label}\n{dim}: {op}", sent) for label, r in results.items()
                for dim, ops in r["wire"]["bytes"].items() for op, sent in ops.items()
                if op != "recv"]
    # one row per bar, the first on top: any number of bars keeps the notebook's width
    assert _ticks(ax.get_yticklabels()) == [name for name, _ in expected]
    assert ax.yaxis_inverted() and plots.wire_plot(results).get_size_inches()[0] <= 9.5
    assert "DP x PP\npp: send" in _ticks(ax.get_yticklabels())  # the receives send nothing
    assert [p.get_width() for p in ax.patches] == [sent for _, sent in expected]
    (formula,) = ax.collections
    assert formula.get_offsets()[:, 0].tolist() == [sent for _, sent in expected]  # exact
    fig, given = _axes()
    assert plots.wire_plot(results, ax=given) is fig
    with pytest.raises(ValueError, match="nothing to plot"):
        plots.wire_plot({})
    with pytest.raises(ValueError, match="'x' has no 'wire' and 'wire_formula'"):
        plots.wire_plot({"x": {"rank": 0}})


def test_one_rank_mesh_matrix_and_wire(group):
    step = compose.fsdp_tp_step(1, 1, width=4, depth=1, batch=2)
    (ax,) = plots.mesh_plot([step]).axes
    assert len(ax.patches) == 1 and ax.get_title() == "1 x 1 mesh (dp x tp)"
    moe = expert.moe_check(4, 4, 8, 2)
    fig = plots.expert_traffic_matrix([moe])
    assert fig.axes[0].images[0].get_array().tolist() == [[moe["send_counts"][0]]]
    pp = compose.dp_pp_step(1, 1, width=4, depth=1, batch=2, microbatches=1)
    (ax,) = plots.wire_plot({"DP x PP": pp}).axes  # one rank: nothing on the wire, no bars
    assert not ax.patches


# ---- pipeline schedules ------------------------------------------------------------------------


@pytest.mark.parametrize("name, chunks", [("interleaved 1f1b", 2), ("zero bubble", 1)])
def test_schedule_timeline_plot_one_block_per_event(name, chunks):
    t = schedules.schedule_timeline(name, 2, 4, chunks=chunks)
    (ax,) = plots.schedule_timeline_plot(t["events"], title=name).axes
    events = t["events"]
    assert len(ax.patches) == len(events)
    assert sorted(p.get_width() for p in ax.patches) == pytest.approx(
        sorted(e["end"] - e["start"] for e in events))
    assert max(p.get_x() + p.get_width() for p in ax.patches) == pytest.approx(
        max(e["end"] for e in events) - min(e["start"] for e in events))
    assert ax.get_title() == name and _ticks(ax.get_yticklabels()) == ["rank 0", "rank 1"]
    legend = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
    if chunks > 1:
        assert legend == ["forward", "backward", "paler: later chunk (label chunk.micro)"]
        assert "1.0" in _texts(ax)  # chunk.micro
    else:
        assert legend == ["forward", "backward (input)", "weight grad"]
    fig, given = _axes()
    assert plots.schedule_timeline_plot(events, ax=given) is fig and given.get_title() == ""


def test_schedule_timeline_labels_fit_their_blocks_or_are_left_out():
    """p = 4, m = 12, v = 2 at the notebook's width: a forward block is too narrow for "0.10"
    even upright; a backward one takes it upright; none overlaps the next block."""
    events = schedules.schedule_timeline("interleaved 1f1b", 4, 12, chunks=2)["events"]
    fig = plots.schedule_timeline_plot(events)
    fig.canvas.draw()
    (ax,) = fig.axes
    kept = ax.texts
    assert 0 < len(kept) < len(events)
    bars = [p.get_window_extent() for p in ax.patches]
    for text in kept:
        box = text.get_window_extent()
        assert any(b.x0 <= box.x0 and box.x1 <= b.x1 and b.y0 <= box.y0 and box.y1 <= b.y1
                   for b in bars), text.get_text()
    assert any(t.get_rotation() == 90 for t in kept)
    # on a wide enough figure every label fits as it is
    from matplotlib import pyplot as plt

    wide, ax = plt.subplots(figsize=(40, 3))
    plots.schedule_timeline_plot(events, ax=ax)
    assert len(ax.texts) == len(events) and {t.get_rotation() for t in ax.texts} == {0}


def test_schedule_timeline_plot_refuses_what_it_cannot_draw():
    events = schedules.schedule_timeline("1f1b", 2, 2)["events"]
    with pytest.raises(ValueError, match="no events to plot"):
        plots.schedule_timeline_plot([])
    with pytest.raises(ValueError, match=r"events lack \['end', 'start'\]"):
        plots.schedule_timeline_plot([{"rank": 0, "kind": "F", "micro": 0}])
    with pytest.raises(ValueError, match=r"no events of step 1: the events hold steps \[0\]"):
        plots.schedule_timeline_plot(events, step=1)


# ---- the planner -------------------------------------------------------------------------------


def _plans():
    from labkit.planner import PUBLISHED

    return [PUBLISHED[name].plan() for name in sorted(PUBLISHED)]


def test_planner_plot_stacks_memory_and_communication_per_plan():
    plans = _plans()
    rows = [p.row() for p in plans]
    mem, comm = plots.planner_plot(rows).axes
    assert len(mem.patches) == 5 * len(rows)  # params, grads, optimizer, activations, buffers
    tops = [p.get_y() + p.get_height() for p in mem.patches[-len(rows):]]
    parts = ("params", "grads", "optimizer", "activations", "buffers")
    assert tops == pytest.approx([sum(r["memory"][k] for k in parts) / 2**30 for r in rows])
    dims = [d for d in ("dp", "tp", "pp", "cp", "ep") if any(r["comm"].get(d) for r in rows)]
    assert len(comm.patches) == len(dims) * len(rows)
    assert [t.get_text() for t in comm.get_legend().get_texts()] == dims
    assert len(mem.collections) == 2 * len(rows)  # the budget and the device, per plan
    assert _ticks(mem.get_xticklabels()) == [r["label"] for r in rows]
    fig, given = _axes()
    assert plots.planner_plot(rows, ax=given) is fig and len(fig.axes) == 1
    with pytest.raises(ValueError, match=r"rows lack \['comm'\]: pass Plan.row\(\) dicts"):
        plots.planner_plot([{k: v for k, v in rows[0].items() if k != "comm"}])


def test_planner_check_plot_pairs_each_prediction_with_its_measurement():
    from labkit.planner import predicted_vs_measured

    p = _plans()[0]
    measured = {"params": p.memory["params"] * 1.02, "dp": p.comm["dp"] * 0.5}
    rows = predicted_vs_measured(p, measured)
    (ax,) = plots.planner_check_plot(rows).axes
    assert len(ax.patches) == 2 * len(rows)
    assert [b.get_height() for b in ax.patches[len(rows):]] == [r["measured"] for r in rows]
    ratios = sorted(_texts(ax))
    assert ratios == sorted(f"x{r['measured'] / r['predicted']:.3f}" for r in rows)
    assert "x0.500" in ratios and ax.get_yscale() == "log"
    fig, given = _axes()
    assert plots.planner_check_plot(rows, ax=given) is fig
    with pytest.raises(ValueError, match=r"rows lack \['measured'\]"):
        plots.planner_check_plot([{"what": "dp", "predicted": 1}])


def test_the_figures_refuse_or_skip_what_they_cannot_draw():
    import matplotlib.pyplot as plt

    with pytest.raises(ValueError, match="activation_rows"):
        plots.sp_activation_bytes([{"version": "dense"}])
    with pytest.raises(ValueError, match="zero length"):
        plots.schedule_timeline_plot([{"rank": 0, "kind": "F", "micro": 0, "start": 1, "end": 1}])
    one_rank = [{"label": "DP", "params": 4, "grads": 4, "optimizer": 8, "in_flight": 0,
                 "wire": 0}]
    fig = plots.zero_plot(one_rank)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert not any("nan" in t for t in texts), texts  # no ratio to DP when DP sent nothing
    fig = plots.sp_layout(4)
    grey = [p for p in fig.axes[0].patches if p.get_facecolor()[:3] == (0.8, 0.8, 0.8)]
    assert len(grey) == 2  # each replicated tensor drawn once, not once per rank
    plt.close("all")


# ---- every figure: the course's style, legends off the data, text that reads ---------------------
#
# What a learner sees in JupyterLab: a figure wider than the notebook's column is shrunk, text
# and all; a legend on a curve hides it; a label wider than its block runs into the next one.
# Each public figure is drawn here from small rows and measured on screen (display units).


def _figure_cases(ranks) -> dict:
    """``{name: () -> Figure}``: every figure of labkit.plots, drawn from small real rows."""
    import numpy as np

    from labkit.augment import augmentation
    from labkit.bench import bus_bandwidth, message_sizes
    from labkit.parallel import pipeline
    from labkit.perf import result_row
    from labkit.planner import PUBLISHED, predicted_vs_measured

    sweep = []
    for b in message_sizes(1024, 1 << 22):
        seconds = 20e-6 + b / 5e9
        sweep.append({"bytes": b, "seconds": seconds, "algbw_GBps": b / seconds / 1e9,
                      "busbw_GBps": bus_bandwidth(b / seconds / 1e9, 4), "ranks": 4,
                      "backend": "gloo"})
    history = [{"epoch": e, "train_loss": 1 / e, "train_acc": 1 - 0.5 / e,
                "val_loss": 1 / e + 0.2, "val_acc": 1 - 0.5 / e - 0.2} for e in range(1, 9)]

    def scaling(mode, workers, loss):
        return [{"mode": mode, "workers": n, "samples_per_s": 100 * n * (1 - loss) ** k,
                 "speedup": n * (1 - loss) ** k, "efficiency": (1 - loss) ** k}
                for k, n in enumerate(workers)]

    measured = [*scaling("weak", [1, 2, 4], 0.1), *scaling("strong", [1, 2, 4], 0.3),
                *scaling("independent", [1, 2, 4], 0.02)]
    model = [*scaling("weak", [1, 2, 4, 8, 16, 32, 64], 0.12),
             *scaling("strong", [1, 2, 4, 8, 16, 32, 64], 0.3)]
    plans = [run.plan() for run in PUBLISHED.values()]
    one = plans[0]
    moe = [v["moe"] for v in ranks]

    def live():
        import IPython.display

        shown = []

        class Handle:
            def update(self, fig):
                shown.append(fig)

        real = IPython.display.display
        IPython.display.display = lambda *a, **k: Handle()
        try:
            plots.live_training_curves()("augmentation", history)
        finally:
            IPython.display.display = real
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        return FigureCanvasAgg(shown[-1]).figure  # closed once shown: a canvas to draw it on

    return {
        "bandwidth_plot": lambda: plots.bandwidth_plot(sweep),
        "staleness_plot": lambda: plots.staleness_plot(
            {"mode": "async", "staleness": [0, 1, 2, 0, 3, 1] * 4,
             "pushed_by": [1, 2, 3, 1, 2, 3] * 4}),
        "bytes_accuracy_plot": lambda: plots.bytes_accuracy_plot(
            [{"label": "dense", "bytes_per_rank": 100, "dense_bytes": 100, "accuracy": 0.94},
             {"label": "top-k 1 %", "bytes_per_rank": 2, "dense_bytes": 100, "accuracy": 0.9}]),
        "augmentation_grid": lambda: plots.augmentation_grid(
            np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8),
            augmentation(32), n=35),
        "training_curves": lambda: plots.training_curves({"no augmentation": history,
                                                          "augmentation": history}),
        "live_training_curves": live,
        "scaling_plot": lambda: plots.scaling_plot(measured, model),
        "large_batch_plot": lambda: plots.large_batch_plot(
            [{"global_batch": b, "rule": rule, "val_acc": 0.9 - i * 0.1 * (b > 64)}
             for b in (64, 256, 1024)
             for i, rule in enumerate(("same lr", "linear scaling", "linear scaling + warmup"))]),
        "pipeline_timeline": lambda: plots.pipeline_timeline(
            pipeline.simulate(pipeline.gpipe_schedule(4, 12)), title="GPipe, m = 12"),
        "bubble_plot": lambda: plots.bubble_plot(
            [{"schedule": s, "stages": 2, "m": m, "measured": 1 / (m + 1) + d,
              "formula": 1 / (m + 1), "with_messages": 1 / (m + 1) + d / 2}
             for s, d in (("gpipe", 0.04), ("1f1b", 0.02)) for m in (1, 2, 4, 8)]),
        "schedule_timeline_plot": lambda: plots.schedule_timeline_plot(
            schedules.schedule_timeline("interleaved 1f1b", 4, 12, chunks=2)["events"],
            title="interleaved 1F1B, p = 4, m = 12, v = 2"),
        "tuning_plot": lambda: plots.tuning_plot(
            [result_row("bf16 autocast", 0.02, 0.01, "s/step"),
             result_row("fp16 on a CPU", 0.01, 0.04, "s/step"),
             result_row("PowerSGD", 40872, 3196, "bytes/step")]),
        "overlap_plot": lambda: plots.overlap_plot(
            [{"bucket_cap_mb": cap, "allreduces": n, "compute_s": 0.05, "step_s": step,
              "serial_s": 0.11, "hidden_fraction": (0.11 - step) / 0.06}
             for cap, n, step in ((0.25, 12, 0.07), (4, 3, 0.08), (25, 1, 0.11))]),
        "memory_plot": lambda: plots.memory_plot(
            [{"batch": b, "estimate": b * 2**20, "peak": (b + 3) * 2**20 if b < 64 else None}
             for b in (8, 16, 32, 64)], budget=48 * 2**20),
        "roofline_plot": lambda: plots.roofline_plot(
            50e9, 10e9, [{"op": "add", "intensity": 0.083, "flops_per_s": 0.7e9},
                         {"op": "layernorm", "intensity": 0.5, "flops_per_s": 3e9},
                         {"op": "matmul 1024", "intensity": 170.0, "flops_per_s": 40e9}]),
        "sp_activation_bytes": lambda: plots.sp_activation_bytes(
            sequence.activation_rows(ranks[0]["sp"])),
        "sp_layout": lambda: plots.sp_layout(4, sent_bytes={"tp": 12345, "sp": 12345}),
        "ring_schedule_plot": lambda: plots.ring_schedule_plot(
            context.ring_schedule(4, "zigzag", causal=True)),
        "ring_work_plot": lambda: plots.ring_work_plot([r for v in ranks for r in v["ring"]]),
        "ring_memory_plot": lambda: plots.ring_memory_plot(ranks[0]["memory"]),
        "expert_traffic_matrix": lambda: plots.expert_traffic_matrix(moe),
        "expert_load_plot": lambda: plots.expert_load_plot(
            expert.balance_sweep(n_experts=4, hidden=4, ffn=8, tokens=32, steps=6)),
        "expert_placement_plot": lambda: plots.expert_placement_plot(
            moe[0]["reference"]["tokens_per_expert"], 2, moe[0]["capacity"]),
        "zero_plot": lambda: plots.zero_plot(ranks[0]["zero"]),
        "mesh_plot": lambda: plots.mesh_plot([v["fsdp_tp"] for v in ranks]),
        "wire_plot": lambda: plots.wire_plot({"FSDP2 x TP": ranks[0]["fsdp_tp"],
                                              "DP x PP": ranks[0]["dp_pp"]}),
        "planner_plot": lambda: plots.planner_plot([one.row(f"{one.degrees}")]),
        "planner_check_plot": lambda: plots.planner_check_plot(
            predicted_vs_measured(one, {"params": one.memory["params"] * 1.02,
                                        "dp": one.comm["dp"] * 0.5})),
    }


# public names that draw no figure of their own
_NOT_FIGURES = {"check_image"}


def test_every_public_figure_has_a_case_here():
    """A new figure joins the checks below: the test fails until it has a case."""
    names = set(plots.__all__) - _NOT_FIGURES
    assert names == set(_case_names())


def _case_names() -> list[str]:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(_figure_cases))
    (returned,) = [n for n in ast.walk(tree) if isinstance(n, ast.Return)
                   and isinstance(n.value, ast.Dict)]
    return [k.value for k in returned.value.keys]


def _data_on_screen(fig):
    """Display boxes of everything each axes plots, clipped to its axes: sample points along
    lines, bars and other patches, scatter offsets, line segments, filled bands, images."""
    import numpy as np
    from matplotlib.collections import LineCollection, PathCollection, PolyCollection
    from matplotlib.transforms import Bbox

    boxes = []
    for ax in fig.axes:
        frame = ax.get_window_extent()

        def points(xy, frame=frame):
            xy = np.asarray(xy, dtype=float).reshape(-1, 2)
            xy = xy[np.isfinite(xy).all(axis=1)]
            inside = ((xy[:, 0] >= frame.x0) & (xy[:, 0] <= frame.x1)
                      & (xy[:, 1] >= frame.y0) & (xy[:, 1] <= frame.y1))
            return [Bbox.from_extents(x, y, x, y) for x, y in xy[inside]]

        def along(xy):  # a line passes between its points too
            xy = np.asarray(xy, dtype=float).reshape(-1, 2)
            if len(xy) < 2:
                return xy
            t = np.linspace(0, 1, 25)[:, None]
            return np.concatenate([a + t * (b - a) for a, b in zip(xy[:-1], xy[1:],
                                                                   strict=True)])

        for line in ax.get_lines():
            if line.get_visible():
                boxes += points(along(line.get_transform().transform(line.get_xydata())))
        for patch in ax.patches:
            box = patch.get_window_extent()
            if patch.get_visible() and box.width * box.height > 0:
                clipped = Bbox.intersection(box, frame)
                boxes += [clipped] if clipped is not None else []
        for c in ax.collections:
            if isinstance(c, PathCollection):
                boxes += points(c.get_offset_transform().transform(c.get_offsets()))
            elif isinstance(c, LineCollection):
                for seg in c.get_segments():
                    boxes += points(along(c.get_transform().transform(seg)))
            elif isinstance(c, PolyCollection):
                for path in c.get_paths():
                    box = Bbox.intersection(path.get_extents(c.get_transform()), frame)
                    boxes += [box] if box is not None else []
        boxes += [im.get_window_extent() for im in ax.images]
    return boxes


def _legends(fig) -> list:
    return [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + fig.legends


def _overlaps(a, b, slack=1.0) -> bool:
    """Boxes that share more than ``slack`` pixels each way (a point on an edge is apart)."""
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack
            and min(a.y1, b.y1) - max(a.y0, b.y0) > slack) or (
        (a.width == 0 or b.width == 0) and (a.height == 0 or b.height == 0)
        and b.x0 + slack < a.x0 < b.x1 - slack and b.y0 + slack < a.y0 < b.y1 - slack)


def _texts_shown(fig):
    """The texts drawn: tick labels only of the ticks inside the view."""
    from matplotlib.text import Text

    drawn = {}
    for ax in fig.axes:
        for axis, limits in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(limits)
            slack = 1e-6 * (hi - lo)
            for ticks, locs in ((axis.get_major_ticks(), axis.get_majorticklocs()),
                                (axis.get_minor_ticks(), axis.get_minorticklocs())):
                for i, tick in enumerate(ticks):
                    inside = i < len(locs) and lo - slack <= locs[i] <= hi + slack
                    drawn.update({id(tick.label1): inside, id(tick.label2): inside})
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
            and drawn.get(id(t), True)]


@pytest.mark.parametrize("name", _case_names())
def test_every_figure_reads_in_the_notebook_column(ranks, name):
    import matplotlib as mpl

    from labkit.plots._common import COURSE_RC, MAX_WIDTH_IN, MIN_TEXT_PT

    before = dict(mpl.rcParams)
    fig = _figure_cases(ranks)[name]()
    assert dict(mpl.rcParams) == before, "a figure must leave the learner's rcParams alone"
    if name != "live_training_curves":
        assert getattr(getattr(plots, name), "course_style", False), \
            f"{name} must draw inside the course style (@course_figure)"
    fig.canvas.draw()

    # the course's style: its sizes, and its colours first
    labelled = [a for a in fig.axes if a.xaxis.label.get_text()]
    titled = [a for a in fig.axes if a.get_title()]
    legends = _legends(fig)
    assert labelled or titled or legends, f"{name}: no label, title or legend to check"
    for legend in legends:
        assert {t.get_fontsize() for t in legend.get_texts()} == {COURSE_RC["legend.fontsize"]}
    for ax in labelled:
        assert ax.xaxis.label.get_fontsize() == COURSE_RC["axes.labelsize"]
    for ax in titled:
        assert ax.title.get_fontsize() == COURSE_RC["axes.titlesize"]
    ticks = [t for a in fig.axes if a.axison for t in a.get_xticklabels() + a.get_yticklabels()
             if t.get_text()]
    assert all(t.get_fontsize() == COURSE_RC["xtick.labelsize"] for t in ticks), name

    # no wider than the notebook's column, as Jupyter crops it (0.1 inch of padding each side)
    assert fig.get_size_inches()[0] <= MAX_WIDTH_IN + 1e-9
    shown = fig.get_tightbbox().width + 0.2
    assert shown <= MAX_WIDTH_IN + 1e-9, f"{name} is shown {shown:.2f} inches wide"

    # text no smaller than the notebook's, and no text on another
    texts = _texts_shown(fig)
    small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < MIN_TEXT_PT]
    assert not small, f"{name}: text under {MIN_TEXT_PT} pt: {small[:5]}"
    boxes = [(t.get_text(), t.get_window_extent()) for t in texts]
    clashes = [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:]
               if _overlaps(box_a, box_b)]
    assert not clashes, f"{name}: texts on each other: {clashes[:5]}"

    # every legend off the data, its own axes' and the others'
    data = _data_on_screen(fig)
    for legend in _legends(fig):
        frame = legend.get_window_extent()
        covered = [box for box in data if _overlaps(box, frame)]
        assert not covered, f"{name}: the legend covers data at {covered[:3]}"

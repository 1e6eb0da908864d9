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
    assert _ticks(held.get_xticklabels()) == [r["label"] for r in rows]
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
    assert _ticks(ax.get_xticklabels()) == [name for name, _ in expected]
    assert "DP x PP\npp: send" in _ticks(ax.get_xticklabels())  # the receives send nothing
    assert [p.get_height() for p in ax.patches] == [sent for _, sent in expected]
    (formula,) = ax.collections
    assert formula.get_offsets()[:, 1].tolist() == [sent for _, sent in expected]  # exact
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
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    if chunks > 1:
        assert legend == ["forward", "backward", "paler: later chunk (label chunk.micro)"]
        assert "1.0" in _texts(ax)  # chunk.micro
    else:
        assert legend == ["forward", "backward (input)", "weight grad"]
    fig, given = _axes()
    assert plots.schedule_timeline_plot(events, ax=given) is fig and given.get_title() == ""


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

"""labkit.plots: figures drawn from plain rows, headless."""

from __future__ import annotations

import pytest

from labkit.bench import bus_bandwidth, message_sizes
from labkit.plots import bandwidth_plot


def _rows(n=2):
    rows = []
    for b in message_sizes(1024, 1 << 20):
        seconds = 20e-6 + b / 5e9
        algbw = b / seconds / 1e9
        rows.append({"bytes": b, "seconds": seconds, "algbw_GBps": algbw,
                     "busbw_GBps": bus_bandwidth(algbw, n), "ranks": n, "backend": "gloo"})
    return rows


@pytest.fixture(autouse=True)
def close_figures():
    yield
    from matplotlib import pyplot as plt

    plt.close("all")


def test_bandwidth_plot_draws_both_lines_on_log_axes():
    rows = _rows(n=4)
    fig = bandwidth_plot(list(reversed(rows)))  # any order: sorted by size before drawing
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label().split()[0] for line in lines] == ["algbw", "busbw"]
    assert list(lines[0].get_xdata()) == [r["bytes"] for r in rows]
    assert list(lines[1].get_ydata()) == pytest.approx([r["busbw_GBps"] for r in rows])
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "message size" and "GB/s" in ax.get_ylabel()
    assert ax.get_title() == "all-reduce bandwidth: 4 ranks, gloo"
    fig.canvas.draw()  # renders headless (Agg) with the size labels
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "1 KiB" in labels and "1 MiB" in labels


def test_bandwidth_plot_on_a_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert bandwidth_plot(_rows(), ax=ax) is fig


def test_single_rank_has_no_bus_bandwidth_line():
    fig = bandwidth_plot(_rows(n=1))
    assert [line.get_label().split()[0] for line in fig.axes[0].get_lines()] == ["algbw"]


def test_rows_without_rank_info_get_a_plain_title():
    rows = [{k: r[k] for k in ("bytes", "algbw_GBps", "busbw_GBps")} for r in _rows()]
    assert bandwidth_plot(rows).axes[0].get_title() == "all-reduce bandwidth"


@pytest.mark.parametrize("rows, match", [([], "no rows"), ([{"bytes": 1}], "busbw_GBps")])
def test_bandwidth_plot_rejects_what_it_cannot_draw(rows, match):
    with pytest.raises(ValueError, match=match):
        bandwidth_plot(rows)


def test_bandwidth_plot_one_busbw_line_per_algorithm_and_the_model():
    rows = [{**r, "algorithm": name, "busbw_GBps": r["busbw_GBps"] * f}
            for name, f in (("builtin", 1.0), ("ring", 0.8)) for r in _rows(n=4)]
    model = [{"bytes": r["bytes"], "busbw_GBps": 2.0} for r in _rows(n=4)]
    lines = bandwidth_plot(rows, model=model).axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["busbw, builtin", "busbw, ring",
                                                    "alpha-beta model of the ring"]
    assert list(lines[1].get_ydata()) == pytest.approx([r["busbw_GBps"] * 0.8 for r in _rows(4)])


def test_staleness_plot_one_colour_per_worker():
    from labkit.plots import staleness_plot

    result = {"mode": "async", "staleness": [0, 1, 0, 3, 0], "pushed_by": [1, 2, 2, 1, 2]}
    (ax,) = staleness_plot(result).axes
    assert [line.get_label() for line in ax.get_lines()] == ["worker 1", "worker 2"]
    assert list(ax.get_lines()[0].get_xdata()) == [0, 3]
    assert list(ax.get_lines()[0].get_ydata()) == [0, 3]
    assert ax.get_title() == "async parameter server"
    with pytest.raises(ValueError, match=r"lacks \['pushed_by'\]: pass rank 0's return value"):
        staleness_plot({"mode": "sync", "staleness": [0]})


def test_bytes_accuracy_plot_labels_each_point_on_a_log_axis():
    from labkit.plots import bytes_accuracy_plot

    rows = [{"label": "dense", "bytes_per_rank": 100, "dense_bytes": 100, "accuracy": 0.94},
            {"label": "top-k 1 %", "bytes_per_rank": 2, "dense_bytes": 100, "accuracy": 0.93}]
    (ax,) = bytes_accuracy_plot(rows).axes
    assert [line.get_xydata().tolist() for line in ax.get_lines()] == [[[1.0, 0.94]],
                                                                       [[0.02, 0.93]]]
    assert [t.get_text() for t in ax.texts] == ["dense", "top-k 1 %"]
    assert ax.get_xscale() == "log"
    with pytest.raises(ValueError, match="no rows to plot"):
        bytes_accuracy_plot([])
    with pytest.raises(ValueError, match=r"rows lack \['label'\]: pass compressed_training's"):
        bytes_accuracy_plot([{k: v for k, v in rows[0].items() if k != "label"}])


def test_memory_plot_draws_the_estimate_the_measured_peaks_and_the_budget_in_mib():
    from labkit.plots import memory_plot

    mib = 2**20
    rows = [{"batch": 128, "estimate": 60 * mib, "peak": 59 * mib},
            {"batch": 32, "estimate": 40 * mib, "peak": None}]  # not measured: no point
    (ax,) = memory_plot(rows, budget=64 * mib).axes
    estimate, measured, budget = ax.get_lines()
    assert estimate.get_xydata().tolist() == [[32, 40], [128, 60]]  # sorted by batch
    assert measured.get_xydata().tolist() == [[128, 59]]
    assert list(budget.get_ydata()) == [64, 64]
    with pytest.raises(ValueError, match="no rows to plot"):
        memory_plot([], budget=1)
    with pytest.raises(ValueError, match=r"rows lack \['peak'\]: pass rows of"):
        memory_plot([{"batch": 1, "estimate": 1}], budget=1)


# ---------------------------------------------------------------------------- augmentation


def _photo(h=40, w=48):
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("n, cells", [(8, 9), (3, 4), (4, 5)])
def test_augmentation_grid_shows_the_original_and_n_copies(n, cells):
    from labkit.augment import augmentation
    from labkit.plots import augmentation_grid

    fig = augmentation_grid(_photo(), augmentation(32), n=n)
    assert len(fig.axes) == cells                       # unused grid cells are removed
    assert all(len(ax.images) == 1 for ax in fig.axes)
    assert fig.axes[0].get_title() == "original"
    assert fig.axes[0].images[0].get_array().shape == (40, 48, 3)
    assert fig.axes[1].images[0].get_array().shape == (32, 32, 3)


def test_augmentation_grid_undoes_normalisation_and_keeps_the_global_seed():
    import numpy as np
    import torch

    from labkit.augment import augmentation
    from labkit.plots import augmentation_grid

    photo = _photo()
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    fig = augmentation_grid(photo, augmentation(40, kind="none"), n=1)
    assert torch.equal(torch.rand(1), expected)         # the learner's random stream is intact
    shown = fig.axes[1].images[0].get_array()
    assert np.abs(np.asarray(shown) - photo[:, 4:44] / 255).max() < 0.02  # true colours


def test_augmentation_grid_is_repeatable_by_seed():
    import numpy as np

    from labkit.augment import augmentation
    from labkit.plots import augmentation_grid

    def pictures(seed):
        fig = augmentation_grid(_photo(), augmentation(32), n=3, seed=seed)
        return [np.asarray(ax.images[0].get_array()) for ax in fig.axes[1:]]

    assert all(np.array_equal(a, b) for a, b in zip(pictures(1), pictures(1), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(pictures(1), pictures(2), strict=True))


@pytest.mark.parametrize("image, transform, n, match", [
    ("float", None, 4, r"H x W x 3 uint8.*float64"),
    ("grey", None, 4, r"H x W x 3 uint8.*\(40, 48\)"),
    ("ok", None, 0, r"n must be a whole number >= 1"),
    ("ok", lambda t: t[0], 4, r"C x H x W tensor with 1 or 3 channels, got \(40, 48\)"),
    ("ok", lambda t: "text", 4, r"C x H x W tensor.*got str"),
])
def test_augmentation_grid_rejects_what_it_cannot_show(image, transform, n, match):
    from labkit.augment import augmentation
    from labkit.plots import augmentation_grid

    photo = {"ok": _photo(), "float": _photo() / 255.0, "grey": _photo()[..., 0]}[image]
    with pytest.raises(ValueError, match=match):
        augmentation_grid(photo, transform or augmentation(32), n=n)


# --------------------------------------------------------------------------- training curves


def _history(epochs=4, gap=0.1, val=True):
    rows = []
    for e in range(1, epochs + 1):
        row = {"epoch": e, "train_loss": 1 / e, "train_acc": 1 - 0.5 / e}
        if val:
            row.update(val_loss=1 / e + gap, val_acc=1 - 0.5 / e - gap)
        rows.append(row)
    return rows


def _fills(ax):
    from matplotlib.collections import PolyCollection

    return [c for c in ax.collections if isinstance(c, PolyCollection)]


def test_training_curves_one_run():
    from labkit.plots import training_curves

    fig = training_curves(_history())
    loss, acc = fig.axes
    assert [line.get_label() for line in loss.get_lines()] == ["train", "validation"]
    assert list(acc.get_lines()[1].get_ydata()) == pytest.approx([r["val_acc"] for r in _history()])
    assert len(_fills(loss)) == len(_fills(acc)) == 1   # the shaded train-validation gap
    assert loss.get_ylabel() == "loss" and acc.get_ylabel() == "accuracy"
    assert acc.get_xlabel() == "epoch"


def test_training_curves_overlays_labelled_runs():
    from labkit.plots import training_curves

    fig = training_curves({"no augmentation": _history(gap=0.3),
                           "augmentation": _history(gap=0.05)})
    for ax in fig.axes:
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["no augmentation: train", "no augmentation: validation",
                          "augmentation: train", "augmentation: validation"]
        assert len(_fills(ax)) == 2
        colours = [line.get_color() for line in ax.get_lines()]
        assert colours[0] == colours[1] != colours[2] == colours[3]  # one colour per run


def test_training_curves_without_validation_and_on_given_axes():
    from matplotlib import pyplot as plt

    from labkit.plots import training_curves

    fig, ax = plt.subplots(1, 2)
    assert training_curves(_history(val=False), ax=ax) is fig
    assert [len(a.get_lines()) for a in ax] == [1, 1] and not _fills(ax[0])


@pytest.mark.parametrize("history, ax, error, match", [
    ([], None, ValueError, "no epochs yet"),
    ({}, None, ValueError, "history is empty"),
    ({"a": []}, None, ValueError, r"run 'a' has no epochs"),
    ([{"epoch": 1, "train_loss": 1.0}], None, ValueError, r"lacks \['train_acc'\]"),
    ("history", None, TypeError, "list of per-epoch dicts"),
    (_history(), "one", ValueError, r"pair of Axes"),
    (_history(), ("a", "b"), ValueError, r"pair of Axes"),
])
def test_training_curves_rejects_what_it_cannot_draw(history, ax, error, match):
    from labkit.plots import training_curves

    with pytest.raises(error, match=match):
        training_curves(history, ax=ax)


def test_training_curves_rejects_a_single_axes():
    from matplotlib import pyplot as plt

    from labkit.plots import training_curves

    with pytest.raises(ValueError, match=r"pair of Axes"):
        training_curves(_history(), ax=plt.subplots()[1])


def test_live_training_curves_redraws_one_display(monkeypatch):
    import IPython.display

    shown = []

    class Handle:
        def update(self, fig):
            shown.append(len(fig.axes))

    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: Handle())
    from labkit.plots import live_training_curves

    live = live_training_curves()
    epoch = {"epoch": 1, "train_loss": 1.0, "train_acc": 0.5, "val_loss": 1.2, "val_acc": 0.4}
    live("none", [epoch])
    live("standard", [epoch, dict(epoch, epoch=2)])
    assert shown == [2, 2] and sorted(live.runs) == ["none", "standard"]
    assert len(live.runs["standard"]) == 2


# ----------------------------------------------------------------- scaling and large batches


def _scaling(mode, workers, one=100.0, loss=0.1, predicted=False):
    """Rows as measure_scaling gives them: each doubling of workers loses ``loss`` efficiency."""
    rows = []
    for n in workers:
        efficiency = (1 - loss) ** (n.bit_length() - 1)
        per_worker = 32 if mode == "weak" else 256 // n
        samples = one * n * efficiency
        row = {"mode": mode, "workers": n, "per_worker_batch": per_worker,
               "global_batch": per_worker * n, "step_s": per_worker * n / samples,
               "samples_per_s": samples, "speedup": n * efficiency, "efficiency": efficiency}
        if predicted:
            row.update(predicted=True, compute_s=row["step_s"] * 0.8,
                       allreduce_s=row["step_s"] * 0.2)
        rows.append(row)
    return rows


def _labels(ax):
    return [line.get_label() for line in ax.get_lines()]


def _line(ax, label):
    (line,) = [line for line in ax.get_lines() if line.get_label() == label]
    return line


def test_scaling_plot_with_a_prediction_to_64_workers():
    from labkit.plots import scaling_plot

    measured = _scaling("weak", [1, 2, 4])
    model = _scaling("weak", [1, 2, 4, 8, 16, 32, 64], loss=0.12, predicted=True)
    fig = scaling_plot(list(reversed(measured)), prediction=model)  # sorted by workers first
    fig.canvas.draw()
    tput, speed, eff = fig.axes                          # efficiency: a panel of its own
    assert [a.get_title() for a in fig.axes] == ["throughput", "speedup", "efficiency"]
    assert _labels(tput) == ["ideal (N x one worker)", "weak measured", "weak model"]
    ideal = _line(tput, "ideal (N x one worker)")
    assert list(ideal.get_xdata()) == [1, 2, 4, 8, 16, 32, 64]  # as far as the model reaches
    assert list(ideal.get_ydata()) == pytest.approx([100.0 * n for n in ideal.get_xdata()])
    assert ideal.get_color() == "grey" and ideal.get_linestyle() == ":"
    line = _line(tput, "weak measured")
    assert list(line.get_xdata()) == [1, 2, 4]
    assert list(line.get_ydata()) == pytest.approx([r["samples_per_s"] for r in measured])
    dashed = _line(tput, "weak model")
    assert dashed.get_linestyle() == "--" and dashed.get_color() == line.get_color()
    assert list(dashed.get_ydata()) == pytest.approx([r["samples_per_s"] for r in model])

    assert _labels(speed) == ["weak measured", "weak model", "ideal (speedup = N)"]
    assert list(_line(speed, "weak measured").get_ydata()) == pytest.approx(
        [r["speedup"] for r in measured])
    ideal = _line(speed, "ideal (speedup = N)")
    assert list(ideal.get_xdata()) == list(ideal.get_ydata()) == [1, 2, 4, 8, 16, 32, 64]
    assert _labels(eff) == ["weak measured", "weak model", "ideal (efficiency = 1)"]
    assert list(eff.get_lines()[0].get_ydata()) == pytest.approx([1.0, 0.9, 0.81])
    assert list(eff.get_lines()[1].get_ydata()) == pytest.approx(  # speedup / N
        [r["speedup"] / r["workers"] for r in model])
    assert eff.get_ylim() == pytest.approx((0, 1.1)) and eff.get_ylabel().startswith("efficiency")
    assert not any(a.get_legend() for a in fig.axes)     # one legend for the three panels
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "ideal (N x one worker)", "weak measured", "weak model", "ideal (speedup = N)",
        "ideal (efficiency = 1)"]                        # each label once
    corner = fig.axes[1].get_window_extent()             # beside the efficiency, under speedup
    box = legend.get_window_extent()
    assert box.x0 > eff.get_window_extent().x1 and box.y1 < corner.y0

    for ax in (tput, speed, eff):
        assert ax.get_xscale() == "log" and ax.get_xlabel() == "workers"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4", "8", "16", "32",
                                                                "64"]


def test_scaling_plot_both_modes_measured_to_4_workers_is_linear():
    from labkit.plots import scaling_plot

    rows = _scaling("weak", [1, 2, 4]) + _scaling("strong", [1, 2, 4], one=80.0, loss=0.3)
    fig = scaling_plot(rows)
    fig.canvas.draw()
    tput, speed, eff = fig.axes
    assert _labels(tput) == ["weak ideal (N x one worker)", "weak measured",
                             "strong ideal (N x one worker)", "strong measured"]
    assert list(_line(tput, "strong ideal (N x one worker)").get_ydata()) == pytest.approx(
        [80.0, 160.0, 320.0])
    assert list(_line(tput, "strong measured").get_ydata()) == pytest.approx(
        [r["samples_per_s"] for r in rows[3:]])
    assert _line(tput, "weak measured").get_color() != _line(tput, "strong measured").get_color()
    assert _labels(speed) == ["weak measured", "strong measured", "ideal (speedup = N)"]
    assert _labels(eff) == ["weak measured", "strong measured", "ideal (efficiency = 1)"]
    assert list(eff.get_lines()[1].get_ydata()) == pytest.approx([1.0, 0.7, 0.49])
    assert eff.get_ylim() == pytest.approx((0, 1.1))
    for ax in (tput, speed):
        assert ax.get_xscale() == "linear"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "4"]


def test_scaling_plot_skips_the_ideal_without_a_one_worker_row():
    from labkit.plots import scaling_plot

    fig = scaling_plot(_scaling("strong", [2, 4, 8]))
    tput, speed, _ = fig.axes
    assert _labels(tput) == ["strong measured"]
    assert _labels(speed) == ["strong measured", "ideal (speedup = N)"]


def _without(rows, key):
    return [{k: v for k, v in r.items() if k != key} for r in rows]


@pytest.mark.parametrize("rows, prediction, match", [
    ([], None, r"no rows to plot: pass the rows labkit\.ddp\.measure_scaling returned"),
    (_without(_scaling("weak", [1, 2]), "efficiency"), None,
     r"rows lack \['efficiency'\]: pass the rows labkit\.ddp\.measure_scaling returned"),
    ([{"mode": "weak", "workers": 1}], None, r"lack \['samples_per_s', 'speedup', 'efficiency'\]"),
    (_scaling("sideways", [1, 2]), None, r"unknown mode \['sideways'\] in rows.*'weak'.*'strong'"),
    (_scaling("weak", [1, 2]), _without(_scaling("weak", [8], predicted=True), "speedup"),
     r"prediction rows lack \['speedup'\]"),
    (_scaling("weak", [1, 2]), _scaling("both", [8], predicted=True),
     r"unknown mode \['both'\] in prediction rows"),
])
def test_scaling_plot_rejects_what_it_cannot_draw(rows, prediction, match):
    from labkit.plots import scaling_plot

    with pytest.raises(ValueError, match=match):
        scaling_plot(rows, prediction=prediction)


_RULES = ("same lr", "linear scaling", "linear scaling + warmup")


def _large_batch():
    """Rows in the order an experiment might give them: by batch, rules interleaved."""
    rows = []
    for batch, base_acc in ((1024, 0.8), (64, 0.9), (256, 0.88)):
        for i, rule in enumerate(_RULES):
            rows.append({"global_batch": batch, "rule": rule, "lr": 0.1 * batch / 64,
                         "val_acc": base_acc - 0.1 / (i + 1) * (batch > 64)})
    return rows


def test_large_batch_plot_one_line_per_rule():
    from labkit.plots import large_batch_plot

    rows = _large_batch()
    fig = large_batch_plot(rows)
    fig.canvas.draw()
    (ax,) = fig.axes
    assert _labels(ax) == list(_RULES)                   # first-seen order
    for rule, line in zip(_RULES, ax.get_lines(), strict=True):
        runs = sorted((r for r in rows if r["rule"] == rule), key=lambda r: r["global_batch"])
        assert list(line.get_xdata()) == [64, 256, 1024]
        assert list(line.get_ydata()) == pytest.approx([r["val_acc"] for r in runs])
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["64", "256", "1024"]
    assert ax.get_ylim() == pytest.approx((0, 1)) and ax.get_ylabel() == "validation accuracy"
    assert ax.get_title() == "large-batch training: accuracy against global batch"
    legend = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
    assert legend == list(_RULES)                       # long ones on two lines
    assert ax.get_legend().get_window_extent().x0 > ax.get_window_extent().x1  # beside it


def test_large_batch_plot_on_a_given_axes():
    from matplotlib.figure import Figure

    from labkit.plots import large_batch_plot

    fig = Figure()
    ax = fig.add_subplot()
    assert large_batch_plot(_large_batch(), ax=ax) is fig
    assert len(ax.get_lines()) == 3


@pytest.mark.parametrize("rows, match", [
    ([], r"no rows to plot: pass the rows labkit\.train\.large_batch_experiment returned"),
    (_without(_large_batch(), "val_acc"),
     r"rows lack \['val_acc'\]: pass the rows labkit\.train\.large_batch_experiment returned"),
    ([{"global_batch": 64}], r"lack \['rule', 'val_acc'\]"),
])
def test_large_batch_plot_rejects_what_it_cannot_draw(rows, match):
    from labkit.plots import large_batch_plot

    with pytest.raises(ValueError, match=match):
        large_batch_plot(rows)


def test_scaling_plot_draws_one_ideal_for_the_shared_one_worker_run_and_log_log_to_64():
    from labkit.plots import scaling_plot

    def row(mode, n, sps):
        return {"mode": mode, "workers": n, "samples_per_s": sps, "speedup": sps / 100,
                "efficiency": sps / 100 / n}

    rows = [row("weak", 1, 100), row("weak", 2, 180), row("independent", 1, 100),
            row("independent", 2, 190)]
    model = [{**row("weak", n, 100 * n * 0.9), "predicted": True} for n in (1, 2, 4, 64)]
    fig = scaling_plot(rows, model)
    ax_tput, ax_speed = fig.axes[:2]
    ideals = [line for line in ax_tput.get_lines() if "ideal" in line.get_label()]
    assert len(ideals) == 1, "weak and independent share their one-worker run: one ideal line"
    assert ax_tput.get_yscale() == "log" and ax_speed.get_yscale() == "log"
    assert fig.axes[2].get_yscale() == "linear"  # efficiency stays on a 0..1.1 linear axis
    fig.canvas.draw()


# ---- pipeline parallelism ----------------------------------------------------------------------


def test_pipeline_timeline_draws_one_block_per_event_rank_0_on_top():
    from labkit.parallel.pipeline import gpipe_schedule, simulate
    from labkit.plots import pipeline_timeline

    events = simulate(gpipe_schedule(2, 3))
    fig = pipeline_timeline(events, title="GPipe")
    (ax,) = fig.axes
    blocks = ax.patches
    assert len(blocks) == len(events) == 12
    colours = {tuple(b.get_facecolor()) for b in blocks}
    assert len(colours) == 2, "forward and backward in two colours"
    assert [t.get_text() for t in ax.texts] == [str(e["micro"]) for e in events]
    assert ax.get_title() == "GPipe" and ax.yaxis_inverted()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    fig.canvas.draw()


def test_pipeline_timeline_shows_one_step_and_refuses_bad_events():
    from labkit.plots import pipeline_timeline

    e = {"rank": 0, "kind": "F", "micro": 0, "start": 0.0, "end": 0.01}
    fig = pipeline_timeline([{**e, "step": 0}, {**e, "step": 1, "micro": 1}], step=1)
    assert [t.get_text() for t in fig.axes[0].texts] == ["1"]
    assert fig.axes[0].get_xlabel() == "time (ms)"  # measured steps are milliseconds long
    with pytest.raises(ValueError, match="no events to plot"):
        pipeline_timeline([])
    with pytest.raises(ValueError, match=r"lack \['end'\]"):
        pipeline_timeline([{k: v for k, v in e.items() if k != "end"}])
    with pytest.raises(ValueError, match=r"no events of step 3: the events hold steps \[0\]"):
        pipeline_timeline([e], step=3)


def test_bubble_plot_measured_per_schedule_beside_the_formula():
    from labkit.plots import bubble_plot

    rows = [{"schedule": s, "stages": 2, "m": m, "measured": 1 / (m + 1) + d,
             "formula": 1 / (m + 1)}
            for s, d in (("gpipe", 0.02), ("1f1b", 0.01)) for m in (1, 2, 4, 8)]
    fig = bubble_plot(rows)
    (ax,) = fig.axes
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["formula (p - 1) / (m + p - 1), p = 2", "measured, gpipe", "measured, 1f1b"]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([1 / 2, 1 / 3, 1 / 5, 1 / 9])
    assert list(ax.get_lines()[2].get_ydata()) == pytest.approx([1 / 2 + .01, 1 / 3 + .01,
                                                                 1 / 5 + .01, 1 / 9 + .01])
    assert ax.get_xscale() == "log"
    fig.canvas.draw()
    modelled = [{**r, "with_messages": r["formula"] + 0.005} for r in rows]
    labels = [line.get_label() for line in bubble_plot(modelled).axes[0].get_lines()]
    assert labels[1:3] == ["measured, gpipe", "model with measured stages and messages, gpipe"]
    with pytest.raises(ValueError, match="no rows to plot"):
        bubble_plot([])
    with pytest.raises(ValueError, match=r"lack \['formula'\]"):
        bubble_plot([{k: v for k, v in rows[0].items() if k != "formula"}])


def test_tuning_plot_bars_grow_from_one_in_both_directions():
    from labkit.perf import result_row
    from labkit.plots import tuning_plot

    rows = [result_row("bf16 autocast", 0.02, 0.01, "s/step"),
            result_row("fp16 on a CPU", 0.01, 0.04, "s/step"),
            result_row("PowerSGD", 40872, 3196, "bytes/step")]
    fig = tuning_plot(rows)
    (ax,) = fig.axes
    bars = ax.patches
    assert [t.get_text() for t in ax.get_yticklabels()] == ["PowerSGD", "fp16 on a CPU",
                                                            "bf16 autocast"]  # first row on top
    assert [b.get_x() for b in bars] == [1.0, 1.0, 1.0]
    assert [b.get_x() + b.get_width() for b in bars] == pytest.approx([40872 / 3196, 0.25, 2.0])
    assert bars[1].get_facecolor() != bars[2].get_facecolor()  # hurt and helped differ
    assert ax.get_xscale() == "log" and ax.get_lines()[0].get_xdata()[0] == 1.0
    assert [t.get_text() for t in ax.texts][2] == " 2.00x (s/step)"
    fig.canvas.draw()


def test_tuning_plot_refuses_what_it_cannot_draw():
    from labkit.plots import tuning_plot

    with pytest.raises(ValueError, match="no rows to plot"):
        tuning_plot([])
    with pytest.raises(ValueError, match=r"lack \['unit'\]"):
        tuning_plot([{"technique": "x", "speedup": 2.0}])
    with pytest.raises(ValueError, match=r"not for \['x'\]"):
        tuning_plot([{"technique": "x", "speedup": 0.0, "unit": "s"}])


def _overlap_row(cap, buckets, compute, step, serial):
    comm = serial - compute
    return {"bucket_cap_mb": cap, "allreduces": float(buckets), "MB_per_step": 12.6,
            "compute_s": compute, "step_s": step, "serial_s": serial, "comm_s": comm,
            "hidden_fraction": (serial - step) / comm if comm > 0.02 * serial else None,
            "ranks": 2}


def test_overlap_plot_stacks_compute_exposed_and_hidden_to_the_serial_step():
    from labkit.plots import overlap_plot

    rows = [_overlap_row(25, 1, 0.050, 0.090, 0.090),     # one bucket: nothing hidden
            _overlap_row(0.25, 12, 0.050, 0.070, 0.110)]  # 40 ms of 60 hidden
    fig = overlap_plot(rows)
    (ax,) = fig.axes
    bars = ax.patches  # compute, exposed, hidden; one bar per cap in each, caps sorted
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.25 MB\n12 buckets",
                                                            "25 MB\n1 bucket"]
    heights = [b.get_height() for b in bars]
    assert heights == pytest.approx([50, 50, 20, 40, 40, 0])
    assert [b.get_y() for b in bars[4:]] == pytest.approx([70, 90])  # hidden sits on exposed
    tops = [b.get_y() + b.get_height() for b in bars[4:]]
    assert tops == pytest.approx([110, 90])  # each bar is the serial step, in ms
    assert [t.get_text() for t in ax.texts] == ["hidden 67%", "hidden 0%"]
    segments = ax.collections[0].get_segments()  # the measured overlapped step on each bar
    assert [seg[0][1] for seg in segments] == pytest.approx([70, 90])
    fig.canvas.draw()


def test_overlap_plot_clips_noise_and_draws_on_a_given_axes():
    from matplotlib import pyplot as plt

    from labkit.plots import overlap_plot

    # Noise: overlapped slower than serial, or faster than compute alone.
    rows = [_overlap_row(4, 3, 0.050, 0.100, 0.080), _overlap_row(8, 2, 0.050, 0.040, 0.080),
            _overlap_row(16, 1, 0.050, 0.051, 0.0505)]
    fig, ax = plt.subplots()
    assert overlap_plot(rows, ax=ax) is fig
    heights = [b.get_height() for b in ax.patches]
    assert heights[3:6] == pytest.approx([30, 0, 0.5])   # exposed: clipped to the communication
    assert heights[6:] == pytest.approx([0, 30, 0])      # hidden: never below 0
    assert [t.get_text() for t in ax.texts] == ["hidden -67%", "hidden 133%", "hidden n/a"]


@pytest.mark.parametrize("rows, match", [
    ([], "no rows to plot"),
    ([{"bucket_cap_mb": 25, "allreduces": 1, "step_s": 0.1}],
     r"lack \['compute_s', 'serial_s', 'hidden_fraction'\]: .*overlap=True"),
])
def test_overlap_plot_refuses_rows_without_the_overlap_columns(rows, match):
    from labkit.plots import overlap_plot

    with pytest.raises(ValueError, match=match):
        overlap_plot(rows)


def test_roofline_plot_draws_the_roof_the_ridge_and_each_op():
    from labkit.plots import roofline_plot

    points = [{"op": "add", "intensity": 0.083, "flops_per_s": 0.7e9},
              {"op": "matmul", "intensity": 170.0, "flops_per_s": 40e9}]
    (ax,) = roofline_plot(50e9, 10e9, points).axes
    roof, ridge = ax.lines[0], ax.lines[1]
    xs, ys = roof.get_data()
    assert max(ys) == pytest.approx(50.0)  # GFLOP/s: the compute roof
    assert ys[0] == pytest.approx(xs[0] * 10.0)  # left of the ridge: intensity x 10 GB/s
    assert ridge.get_xdata()[0] == pytest.approx(5.0)  # 50e9 / 10e9 FLOP per byte
    assert [t.get_text() for t in ax.texts] == ["add", "matmul"]
    assert ax.get_xscale() == ax.get_yscale() == "log"


@pytest.mark.parametrize("peak, bw, points, match", [
    (0, 1e9, [{"op": "a", "intensity": 1, "flops_per_s": 1}], "must be > 0"),
    (1e9, 1e9, [], "no points"),
    (1e9, 1e9, [{"op": "a", "intensity": 1}], "flops_per_s"),
    (1e9, 1e9, [{"op": "a", "intensity": 0, "flops_per_s": 1}], "on log axes"),
])
def test_roofline_plot_refuses_what_it_cannot_draw(peak, bw, points, match):
    from labkit.plots import roofline_plot

    with pytest.raises(ValueError, match=match):
        roofline_plot(peak, bw, points)

"""Figures of notebooks 01, 02 and 08: training curves (also live), data-parallel scaling
against its prediction, and large-batch accuracy under the LR rules."""

from __future__ import annotations

from ._common import check_rows, course_figure, figure_for, integer_ticks, legend_outside, rows_by

__all__ = ["training_curves", "live_training_curves", "scaling_plot", "large_batch_plot"]


_HISTORY_KEYS = ("epoch", "train_loss", "train_acc")


def _runs(history) -> dict:
    """``history`` as ``{label: rows}``: one unlabeled run, or several labelled ones."""
    if isinstance(history, dict):
        runs = dict(history)
    elif isinstance(history, (list, tuple)):
        runs = {"": list(history)}
    else:
        raise TypeError(f"history must be a list of per-epoch dicts, or a dict label -> such a "
                        f"list, got {type(history).__name__}")
    if not runs:
        raise ValueError("history is empty: pass at least one run")
    for label, rows in runs.items():
        name = f"run {label!r}" if label else "history"
        if not rows:
            raise ValueError(f"{name} has no epochs yet: train at least one epoch first")
        missing = [k for k in _HISTORY_KEYS if any(k not in r for r in rows)]
        if missing:
            raise ValueError(f"{name} lacks {missing}: each epoch needs epoch, train_loss, "
                             f"train_acc (and val_loss, val_acc to draw validation)")
    return runs


@course_figure
def training_curves(history, ax=None):
    """Loss and accuracy per epoch, train solid and validation dashed, the gap between shaded.

    ``history`` is a list of dicts with ``epoch, train_loss, train_acc, val_loss, val_acc``
    (the validation keys optional), or a dict ``label -> list`` to overlay runs, e.g.
    augmentation against none. Draws on ``ax`` (a pair of Axes: loss, accuracy) when given.

    Example::

        >>> fig = training_curves({"no augmentation": plain, "augmentation": augmented})
    """
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    runs = _runs(history)
    if ax is None:
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9.5, 4))
    else:
        pair = list(ax) if isinstance(ax, (list, tuple)) or hasattr(ax, "flat") else [ax]
        if len(pair) != 2 or not all(hasattr(a, "plot") for a in pair):
            raise ValueError("ax must be a pair of Axes (loss, accuracy), e.g. "
                             "fig, ax = plt.subplots(1, 2)")
        ax_loss, ax_acc = pair
        fig = ax_loss.figure
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rows) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        epochs = [r["epoch"] for r in rows]
        prefix = f"{label}: " if label else ""
        for a, metric in ((ax_loss, "loss"), (ax_acc, "acc")):
            train = [r[f"train_{metric}"] for r in rows]
            a.plot(epochs, train, "o-", color=colour, markersize=4, label=f"{prefix}train")
            if all(r.get(f"val_{metric}") is not None for r in rows):
                val = [r[f"val_{metric}"] for r in rows]
                a.plot(epochs, val, "s--", color=colour, markersize=4,
                       label=f"{prefix}validation")
                a.fill_between(epochs, train, val, color=colour, alpha=0.15, linewidth=0)
    for a, name in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        a.set_xlabel("epoch")
        a.set_ylabel(name)
        a.set_title(name)
        a.grid(True, alpha=0.3)
    # one legend for both panels (they draw the same runs), beside the accuracy
    handles, labels = ax_acc.get_legend_handles_labels()
    handles.append(Patch(color="0.5", alpha=0.3, linewidth=0))
    labels.append("shaded: train-validation gap")
    legend_outside(ax_acc, "right", handles=handles, labels=labels, wrap=18)
    fig.tight_layout()
    return fig


def live_training_curves():
    """A callback ``update(label, history)`` that redraws :func:`training_curves` in place.

    Made for ``fit(..., on_epoch=...)`` and ``augmentation_experiment(..., on_epoch=...)``:
    one figure in the cell output, redrawn after every epoch of every run, so a learner
    watches the curves grow instead of waiting for the end. ``update.runs`` holds what it drew.

    Example::

        >>> live = live_training_curves()
        >>> runs = augmentation_experiment(train, val, image_size=32, on_epoch=live)
    """
    from IPython.display import display
    from matplotlib import pyplot as plt

    handle = display(display_id=True)
    runs: dict = {}

    def update(label, history):
        runs[label] = list(history)
        fig = training_curves(runs)
        handle.update(fig)
        plt.close(fig)  # the handle shows the picture; an open figure would be drawn twice

    update.runs = runs
    return update



_SCALING_KEYS = ("mode", "workers", "samples_per_s", "speedup", "efficiency")

@course_figure
def scaling_plot(rows: list[dict], prediction: list[dict] | None = None):
    """Data-parallel scaling: throughput, speedup and efficiency against workers, three panels.

    ``rows`` are measured rows from ``labkit.ddp.measure_scaling`` (weak, strong or both modes,
    one colour per mode); ``prediction`` optionally adds model rows with the same keys, drawn
    dashed and usually reaching past the measured worker counts. Grey dotted lines are ideal
    scaling: N times the one-worker throughput (skipped for a mode without a one-worker row),
    a speedup of N and an efficiency of 1. Efficiency (speedup / N; a model row's own
    ``efficiency`` when it has one) has its own panel, on its own 0 to 1.1 axis; the legend,
    one for the three panels, fills the fourth corner. The worker axis is log base 2 beyond 8
    workers. Returns the Figure.

    Example::

        >>> rows = measure_scaling(...)                    # measured, e.g. 1 to 4 workers
        >>> fig = scaling_plot(rows, prediction=model)   # model rows up to 64 workers
    """
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter

    advice = "pass the rows labkit.ddp.measure_scaling returned"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    check_rows(rows, _SCALING_KEYS, "rows", advice)
    prediction = list(prediction or [])
    # a model row's efficiency is its speedup / N, so it is not required
    check_rows(prediction, _SCALING_KEYS[:-1], "prediction rows",
                f"each needs {', '.join(_SCALING_KEYS[:-1])}")
    measured, predicted = rows_by(rows, "mode", "workers"), rows_by(prediction, "mode", "workers")
    modes = list(dict.fromkeys([*measured, *predicted]))
    workers = sorted({r["workers"] for r in [*rows, *prediction]})

    # Three panels and the legend in the fourth corner: efficiency (0 to 1) has its own axis,
    # and a legend of every mode's lines covers none of them.
    fig = plt.figure(figsize=(9.5, 7.5))
    grid = fig.add_gridspec(2, 2)
    ax_tput, ax_speed = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_eff = fig.add_subplot(grid[1, 0])
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ideals: set = set()
    for i, mode in enumerate(modes):
        colour = colours[i % len(colours)]
        seen, model = measured.get(mode, []), predicted.get(mode, [])
        one = next((r for r in seen if r["workers"] == 1), None)
        if one is not None and one["samples_per_s"] not in ideals:  # weak's and independent's
            ideals.add(one["samples_per_s"])  # one-worker runs are the same run: draw it once
            span = sorted({r["workers"] for r in [*seen, *model]})  # ideal as far as the model
            # grey for every mode, so with two modes only the label tells the ideals apart
            prefix = f"{mode} " if len(modes) > 1 else ""
            label = f"{prefix}ideal (N x one worker)"
            ax_tput.plot(span, [one["samples_per_s"] * n for n in span], ":", color="grey",
                         label=label)
        for runs, style, kind in ((seen, "o-", "measured"), (model, "--", "model")):
            if runs:
                x = [r["workers"] for r in runs]
                for ax, key in ((ax_tput, "samples_per_s"), (ax_speed, "speedup")):
                    ax.plot(x, [r[key] for r in runs], style, color=colour,
                            label=f"{mode} {kind}")
                # a model row may leave its efficiency out: it is its speedup / N
                ax_eff.plot(x, [r.get("efficiency", r["speedup"] / r["workers"]) for r in runs],
                            style, color=colour, label=f"{mode} {kind}")
    ax_speed.plot(workers, workers, ":", color="grey", label="ideal (speedup = N)")

    log = workers[-1] > 8  # 1 .. 64 on a linear axis crowds every measured point at the left
    for ax in (ax_tput, ax_speed, ax_eff):
        integer_ticks(ax, workers, log)
        ax.set_xlabel("workers")
        ax.grid(True, alpha=0.3)
    for ax in (ax_tput, ax_speed):
        if log:  # log-log: a constant efficiency is a straight line parallel to the ideal
            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax_tput.set_ylabel("samples / s")
    ax_tput.set_title("throughput")
    ax_speed.set_ylabel("speedup (x one worker)")
    ax_speed.set_title("speedup")
    ax_eff.axhline(1.0, ls=":", color="grey", label="ideal (efficiency = 1)")
    ax_eff.set_ylim(0, 1.1)
    ax_eff.set_ylabel("efficiency (speedup / N)")
    ax_eff.set_title("efficiency")
    fig.tight_layout()
    # one legend for the three panels (a line of each label once), in the empty fourth corner
    entries: dict = {}
    for ax in (ax_tput, ax_speed, ax_eff):
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    corner = grid[1, 1].get_position(fig)
    fig.legend(list(entries.values()), list(entries), loc="center",
               bbox_to_anchor=corner.bounds)
    return fig


@course_figure
def large_batch_plot(rows: list[dict], ax=None):
    """Validation accuracy against global batch size, one line per learning-rate rule.

    ``rows`` come from ``labkit.train.large_batch_experiment``: one per (rule, global batch),
    rules drawn in the order they first appear (e.g. "same lr", "linear scaling", "linear
    scaling + warmup"). Draws on ``ax`` when given, else on a new figure; returns the Figure.

    Example::

        >>> rows = large_batch_experiment(...)
        >>> fig = large_batch_plot(rows)        # assign it, or Jupyter shows the figure twice
    """

    advice = "pass the rows labkit.train.large_batch_experiment returned"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    check_rows(rows, ("global_batch", "rule", "val_acc"), "rows", advice)
    fig, ax = figure_for(ax, (9, 4.5))
    for rule, runs in rows_by(rows, "rule", "global_batch").items():
        ax.plot([r["global_batch"] for r in runs], [r["val_acc"] for r in runs], "o-", label=rule)
    integer_ticks(ax, sorted({r["global_batch"] for r in rows}), log=True)
    ax.set_ylim(0, 1)  # a fixed scale, so a collapse at large batch reads as one
    ax.set_xlabel("global batch size")
    ax.set_ylabel("validation accuracy")
    ax.set_title("large-batch training: accuracy against global batch")
    ax.grid(True, alpha=0.3)
    legend_outside(ax, "right", wrap=16)
    fig.tight_layout()
    return fig

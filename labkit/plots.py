"""Figures: every plot the notebooks show, drawn from plain result rows. Nothing here measures.

matplotlib is imported inside each function, so ``import labkit`` stays light; headless (CI,
a worker, a shell) matplotlib falls back to the Agg backend by itself.
"""

from __future__ import annotations

from ._sizes import whole

__all__ = ["bandwidth_plot", "augmentation_grid", "augmentation_explorer", "training_curves",
           "live_training_curves", "scaling_plot", "large_batch_plot", "pipeline_timeline",
           "bubble_plot", "staleness_plot", "bytes_accuracy_plot", "tuning_plot", "overlap_plot",
           "memory_plot"]


def _size_label(n: float, _pos=None) -> str:
    """1024 -> '1 KiB', 64 MiB -> '64 MiB': message sizes as people say them."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


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
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    if not rows:
        raise ValueError("no rows to plot: pass the list that allreduce_sweep returned")
    missing = {"bytes", "algbw_GBps", "busbw_GBps"} - set(rows[0])
    if missing:
        raise ValueError(f"rows lack {sorted(missing)}: pass the rows allreduce_sweep returned")
    rows = sorted(rows, key=lambda r: r["bytes"])
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    else:
        fig = ax.figure
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
    ax.xaxis.set_major_formatter(FuncFormatter(_size_label))
    ax.set_xlabel("message size")
    ax.set_ylabel("bandwidth (GB/s)")
    ranks, backend = rows[0].get("ranks"), rows[0].get("backend")
    who = f": {ranks} ranks, {backend}" if ranks and backend else ""
    ax.set_title(f"all-reduce bandwidth{who}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def staleness_plot(result: dict, ax=None):
    """Each update's staleness, in the order the server applied it, one colour per worker.

    ``result`` is rank 0's return value of ``parameter_server``. Returns the Figure.

    Example::

        >>> out = labkit.launch(parameter_server, make, train, val, mode="async",
        ...                     slow={1: 0.01}, nproc=3).values[0]
        >>> fig = staleness_plot(out)
    """
    from matplotlib import pyplot as plt

    missing = {"staleness", "pushed_by", "mode"} - set(result)
    if missing:
        raise ValueError(f"result lacks {sorted(missing)}: pass rank 0's return value of "
                         f"parameter_server (values[0])")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.5))
    else:
        fig = ax.figure
    for worker in sorted(set(result["pushed_by"])):
        points = [(i, s) for i, (s, who) in enumerate(zip(result["staleness"], result["pushed_by"],
                                                          strict=True)) if who == worker]
        ax.plot(*zip(*points, strict=True), ".", label=f"worker {worker}")
    ax.set_xlabel("gradient applied (in arrival order)")
    ax.set_ylabel("staleness (updates since its weights)")
    ax.set_title(f"{result['mode']} parameter server")
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def bytes_accuracy_plot(rows: list[dict], ax=None):
    """Accuracy against the bytes each rank sent (a fraction of dense training's), labelled.

    ``rows`` are ``compressed_training`` results with a ``label``. Returns the Figure.

    Example::

        >>> fig = bytes_accuracy_plot([{**r, "label": r["method"]} for r in results])
    """
    from matplotlib import pyplot as plt

    advice = "pass compressed_training's results, each with a 'label' added"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    _check_rows(rows, ["bytes_per_rank", "dense_bytes", "accuracy", "label"], "rows", advice)
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 4))
    else:
        fig = ax.figure
    for r in rows:
        share = r["bytes_per_rank"] / r["dense_bytes"]
        ax.plot(share, r["accuracy"], "o")
        ax.annotate(r["label"], (share, r["accuracy"]), textcoords="offset points",
                    xytext=(5, 4), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per rank (fraction of dense)")
    ax.set_ylabel("validation accuracy")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ---- augmentation: one image under many random changes ----------------------------------------


def _check_image(image):
    """An H x W x 3 uint8 array (what skimage.data and PIL give), or a clear error."""
    import numpy as np

    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"image must be an H x W x 3 uint8 array (RGB), got shape "
                         f"{arr.shape} and dtype {arr.dtype}: e.g. skimage.data.astronaut(), or "
                         f"np.asarray(PIL.Image.open(path).convert('RGB'))")
    return arr


def _normalize_step(transform):
    """The Normalize inside a (nested) Compose, so its output can be shown in true colours."""
    from torchvision import transforms as v1
    from torchvision.transforms import v2

    if isinstance(transform, (v2.Normalize, v1.Normalize)):
        return transform
    for step in getattr(transform, "transforms", ()):
        found = _normalize_step(step)
        if found is not None:
            return found
    return None


def _displayable(out, normalize_step):
    """A transform's CHW output as an H x W x C float array on 0..1, for imshow."""
    import torch

    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] not in (1, 3):
        what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"the transform must return a C x H x W tensor with 1 or 3 channels, "
                         f"got {what}: build it with labkit.augment.augmentation(...)")
    x = out.detach().cpu()
    if x.dtype == torch.uint8:
        x = x.float() / 255
    elif normalize_step is not None:  # undo (x - mean) / std to see real colours
        mean = torch.tensor(normalize_step.mean).view(-1, 1, 1)
        std = torch.tensor(normalize_step.std).view(-1, 1, 1)
        x = x.float() * std + mean
    return x.float().clamp(0, 1).permute(1, 2, 0).squeeze(-1).numpy()


def augmentation_grid(image, transform, n: int = 16, seed: int = 0):
    """The original image and ``n`` random augmentations of it, in a grid; returns the Figure.

    ``image`` is an H x W x 3 uint8 array; ``transform`` takes a uint8 C x H x W tensor (as
    ``labkit.augment.augmentation`` does). Normalised outputs are shown un-normalised. The same
    ``seed`` draws the same augmentations, without touching the global random state.

    Example::

        >>> from skimage.data import astronaut
        >>> from labkit.augment import augmentation
        >>> fig = augmentation_grid(astronaut(), augmentation(128), n=8)
    """
    import math

    import numpy as np
    import torch
    from matplotlib import pyplot as plt

    arr = _check_image(image)
    n = whole(n, "n", hint=" (how many augmented copies)")
    tensor = torch.from_numpy(np.ascontiguousarray(arr)).permute(2, 0, 1)
    step = _normalize_step(transform)
    with torch.random.fork_rng(devices=[]):  # the learner's own random stream stays untouched
        torch.manual_seed(seed)
        pictures = [_displayable(transform(tensor.clone()), step) for _ in range(n)]
    cols = math.ceil(math.sqrt(n + 1))
    rows = math.ceil((n + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.8 * cols, 1.8 * rows), squeeze=False)
    cells = list(axes.flat)
    for ax, picture in zip(cells, [arr, *pictures], strict=False):
        ax.imshow(picture, cmap="gray" if picture.ndim == 2 else None)
        ax.set_axis_off()
    for ax in cells[n + 1:]:
        fig.delaxes(ax)
    cells[0].set_title("original", fontsize=9)
    fig.tight_layout()
    return fig


# slider: (label, min, max, step); "zoom" is 1 - the smallest crop area (AugmentConfig.scale).
_SLIDERS = {
    "rotation": ("rotation (deg)", 0, 90, 1),
    "zoom": ("zoom", 0, 0.9, 0.05),
    "translate": ("shift", 0, 0.5, 0.05),
    "flip": ("flip p", 0, 1, 0.1),
    "brightness": ("brightness", 0, 1, 0.05),
    "contrast": ("contrast", 0, 1, 0.05),
    "saturation": ("saturation", 0, 1, 0.05),
    "hue": ("hue", 0, 0.5, 0.01),
}


def augmentation_explorer(image, *, image_size: int | None = None, n: int = 8, seed: int = 0):
    """Sliders for every ``AugmentConfig`` setting over a live augmentation grid of ``image``.

    Moving a slider redraws the grid (same seed, so only the changed setting moves things).
    The returned VBox has a ``config()`` method giving the chosen ``AugmentConfig``, ready for
    ``labkit.augment.augmentation(size, config=...)`` or ``gpu_augment``.

    Example::

        >>> from skimage.data import astronaut
        >>> explorer = augmentation_explorer(astronaut())
        >>> explorer                      # shows the sliders and the grid in the notebook
        >>> config = explorer.config()    # after tuning by eye
    """
    import io

    import ipywidgets as widgets
    from matplotlib import pyplot as plt

    from .augment import AugmentConfig, augmentation

    arr = _check_image(image)
    size = image_size or min(arr.shape[0], arr.shape[1], 160)  # small enough to redraw quickly
    start = AugmentConfig()
    values = {**{k: getattr(start, k) for k in _SLIDERS if k != "zoom"}, "zoom": 1 - start.scale[0]}
    sliders = {key: widgets.FloatSlider(value=values[key], min=lo, max=hi, step=step,
                                        description=label, continuous_update=False,
                                        style={"description_width": "initial"})
               for key, (label, lo, hi, step) in _SLIDERS.items()}
    picture = widgets.Image(format="png")

    def config():
        settings = {k: s.value for k, s in sliders.items() if k != "zoom"}
        return AugmentConfig(scale=(1 - sliders["zoom"].value, 1.0), **settings)

    def redraw(_change=None):
        transform = augmentation(size, kind="standard", config=config(), normalize=False)
        fig = augmentation_grid(arr, transform, n=n, seed=seed)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)  # the picture widget shows it; pyplot must not show it a second time
        picture.value = buffer.getvalue()

    for slider in sliders.values():
        slider.observe(redraw, names="value")
    redraw()
    half = (len(sliders) + 1) // 2
    columns = [widgets.VBox(list(sliders.values())[:half]),
               widgets.VBox(list(sliders.values())[half:])]
    box = widgets.VBox([widgets.HBox(columns), picture])
    box.config = config
    return box


# ---- training curves ----------------------------------------------------------------------------

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


def training_curves(history, ax=None):
    """Loss and accuracy per epoch, train solid and validation dashed, the gap between shaded.

    ``history`` is a list of dicts with ``epoch, train_loss, train_acc, val_loss, val_acc``
    (the validation keys optional), or a dict ``label -> list`` to overlay runs, e.g.
    augmentation against none. Draws on ``ax`` (a pair of Axes: loss, accuracy) when given.

    Example::

        >>> fig = training_curves({"no augmentation": plain, "augmentation": augmented})
    """
    from matplotlib import pyplot as plt

    runs = _runs(history)
    if ax is None:
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
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
            a.plot(epochs, train, "o-", color=colour, markersize=3, label=f"{prefix}train")
            if all(r.get(f"val_{metric}") is not None for r in rows):
                val = [r[f"val_{metric}"] for r in rows]
                a.plot(epochs, val, "s--", color=colour, markersize=3, label=f"{prefix}validation")
                a.fill_between(epochs, train, val, color=colour, alpha=0.15, linewidth=0)
    for a, name in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        a.set_xlabel("epoch")
        a.set_ylabel(name)
        a.set_title(f"{name} (shaded: train-validation gap)")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
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


# ---- data-parallel scaling and large batches ---------------------------------------------------

_SCALING_KEYS = ("mode", "workers", "samples_per_s", "speedup", "efficiency")
_MODES = ("weak", "strong", "independent")


def _check_rows(rows, keys, name, advice):
    """Every row has ``keys`` and, where ``mode`` is one of them, a known mode; or a clear error."""
    missing = [k for k in keys if any(k not in r for r in rows)]
    if missing:
        raise ValueError(f"{name} lack {missing}: {advice}")
    modes = sorted({r["mode"] for r in rows if r["mode"] not in _MODES}) if "mode" in keys else []
    if modes:
        raise ValueError(f"unknown mode {modes} in {name}: mode is 'weak' (same batch per "
                         f"worker), 'strong' (same global batch) or 'independent' (no "
                         f"gradient exchange)")


def _by(rows, key, order_key) -> dict:
    """``{rows[key]: rows sorted by order_key}``, keys in first-seen order."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return {k: sorted(v, key=lambda r: r[order_key]) for k, v in groups.items()}


def _integer_ticks(ax, ticks, log):
    """Ticks exactly at ``ticks`` labelled 1, 2, 4 ...: the default log labels read 2^3."""
    from matplotlib.ticker import NullLocator

    if log:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())  # no unlabelled ticks between worker counts


def scaling_plot(rows: list[dict], prediction: list[dict] | None = None):
    """Data-parallel scaling: throughput, then speedup and efficiency, against workers.

    ``rows`` are measured rows from ``labkit.ddp.measure_scaling`` (weak, strong or both modes,
    one colour per mode); ``prediction`` optionally adds model rows with the same keys, drawn
    dashed and usually reaching past the measured worker counts. Grey dotted lines are ideal
    scaling: N times the one-worker throughput (left; skipped for a mode without a one-worker
    row) and a speedup of N (right). Efficiency (speedup / N) is on the right-hand axis of the
    right panel. The worker axis is log base 2 beyond 8 workers. Returns the Figure.

    Example::

        >>> rows = measure_scaling(...)                    # measured, e.g. 1 to 4 workers
        >>> fig = scaling_plot(rows, prediction=model)   # model rows up to 64 workers
    """
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter

    advice = "pass the rows labkit.ddp.measure_scaling returned"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    _check_rows(rows, _SCALING_KEYS, "rows", advice)
    prediction = list(prediction or [])
    # predicted efficiency is not drawn (the speedup panel shows the same gap), so not required
    _check_rows(prediction, _SCALING_KEYS[:-1], "prediction rows",
                f"each needs {', '.join(_SCALING_KEYS[:-1])}")
    measured, predicted = _by(rows, "mode", "workers"), _by(prediction, "mode", "workers")
    modes = list(dict.fromkeys([*measured, *predicted]))
    workers = sorted({r["workers"] for r in [*rows, *prediction]})

    fig, (ax_tput, ax_speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_eff = ax_speed.twinx()
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
        if seen:
            ax_eff.plot([r["workers"] for r in seen], [r["efficiency"] for r in seen], "s:",
                        color=colour, alpha=0.5, markersize=4, label=f"{mode} efficiency")
    ax_speed.plot(workers, workers, ":", color="grey", label="ideal (speedup = N)")

    log = workers[-1] > 8  # 1 .. 64 on a linear axis crowds every measured point at the left
    for ax in (ax_tput, ax_speed):
        _integer_ticks(ax, workers, log)
        if log:  # log-log: a constant efficiency is a straight line parallel to the ideal
            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_xlabel("workers")
        ax.grid(True, alpha=0.3)
    ax_tput.set_ylabel("samples / s")
    ax_tput.set_title("throughput")
    ax_tput.legend(fontsize=8, loc="best")
    ax_speed.set_ylabel("speedup (x one worker)")
    ax_speed.set_title("speedup and efficiency")
    ax_eff.set_ylim(0, 1.1)
    ax_eff.set_ylabel("efficiency")
    # one legend for both y axes (two would overlap); centre left lies between efficiency,
    # which starts at 1 top left, and speedup, which starts at 1 bottom left; on log-log axes
    # the curves rise from bottom left to top right and leave the bottom right free
    handles, labels = ax_speed.get_legend_handles_labels()
    more, more_labels = ax_eff.get_legend_handles_labels()
    ax_eff.legend(handles + more, labels + more_labels, fontsize=8,
                  loc="lower right" if log else "center left")
    fig.tight_layout()
    return fig


def large_batch_plot(rows: list[dict], ax=None):
    """Validation accuracy against global batch size, one line per learning-rate rule.

    ``rows`` come from ``labkit.train.large_batch_experiment``: one per (rule, global batch),
    rules drawn in the order they first appear (e.g. "same lr", "linear scaling", "linear
    scaling + warmup"). Draws on ``ax`` when given, else on a new figure; returns the Figure.

    Example::

        >>> rows = large_batch_experiment(...)
        >>> fig = large_batch_plot(rows)        # assign it, or Jupyter shows the figure twice
    """
    from matplotlib import pyplot as plt

    advice = "pass the rows labkit.train.large_batch_experiment returned"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    _check_rows(rows, ("global_batch", "rule", "val_acc"), "rows", advice)
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    else:
        fig = ax.figure
    for rule, runs in _by(rows, "rule", "global_batch").items():
        ax.plot([r["global_batch"] for r in runs], [r["val_acc"] for r in runs], "o-", label=rule)
    _integer_ticks(ax, sorted({r["global_batch"] for r in rows}), log=True)
    ax.set_ylim(0, 1)  # a fixed scale, so a collapse at large batch reads as one
    ax.set_xlabel("global batch size")
    ax.set_ylabel("validation accuracy")
    ax.set_title("large-batch training: accuracy against global batch")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- pipeline parallelism: timelines and the bubble ---------------------------------------------

_PIPELINE_COLOURS = {"F": "#4C72B0", "B": "#DD8452"}  # forward blue, backward orange


def pipeline_timeline(events: list[dict], title: str | None = None, step: int = 0, ax=None):
    """Gantt chart of one pipeline step: one row per rank, F and B blocks, idle as gaps.

    Each block carries its micro-batch number; the white space between blocks is the bubble
    (and, on real hardware, waiting for messages). Events of several steps (``run_pipeline``
    with ``steps > 1``) are filtered to ``step``. Draws on ``ax`` when given; returns the
    Figure.

    Example::

        >>> out = labkit.launch(run_pipeline, stage_builder(mlp_stack), "1f1b", 4,
        ...                     example_batch(256), nproc=2).values[0]
        >>> fig = pipeline_timeline(out["events"], title="1F1B, 2 stages, 4 micro-batches")
    """
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    if not events:
        raise ValueError("no events to plot: pass the 'events' that run_pipeline or simulate "
                         "returned")
    missing = {"rank", "kind", "micro", "start", "end"} - set(events[0])
    if missing:
        raise ValueError(f"events lack {sorted(missing)}: pass the events run_pipeline returned")
    shown = [e for e in events if e.get("step", 0) == step]
    if not shown:
        steps = sorted({e.get("step", 0) for e in events})
        raise ValueError(f"no events of step {step}: the events hold steps {steps}")
    ranks = sorted({e["rank"] for e in shown})
    t0 = min(e["start"] for e in shown)
    # Measured steps last milliseconds; simulate()'s unit slots (1.0, 2.0) are drawn as they are.
    scale, unit = (1e3, "ms") if max(e["end"] for e in shown) - t0 < 2 else (1.0, "s")
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.4))
    else:
        fig = ax.figure
    for e in shown:
        left, width = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
        ax.barh(e["rank"], width, left=left, height=0.7, color=_PIPELINE_COLOURS[e["kind"]],
                edgecolor="white", linewidth=0.8)
        ax.text(left + width / 2, e["rank"], str(e["micro"]), ha="center", va="center",
                color="white", fontsize=8, clip_on=True)
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()  # rank 0, the first stage, on top
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, None)
    ax.legend(handles=[Patch(color=c, label={"F": "forward", "B": "backward"}[k])
                       for k, c in _PIPELINE_COLOURS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig


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
    from matplotlib import pyplot as plt

    if not rows:
        raise ValueError("no rows to plot: pass the list that bubble_sweep returned")
    missing = {"schedule", "m", "measured", "formula", "stages"} - set(rows[0])
    if missing:
        raise ValueError(f"rows lack {sorted(missing)}: pass the rows bubble_sweep returned")
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 4))
    else:
        fig = ax.figure
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
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


# ---- performance tuning: every technique against its own baseline ------------------------------


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
    from matplotlib import pyplot as plt

    if not rows:
        raise ValueError("no rows to plot: pass the rows built with labkit.perf.result_row")
    missing = sorted({k for r in rows for k in ("technique", "speedup", "unit") if k not in r})
    if missing:
        raise ValueError(f"rows lack {missing}: build them with labkit.perf.result_row")
    bad = [r["technique"] for r in rows if not r["speedup"] > 0]
    if bad:
        raise ValueError(f"speedup must be > 0 to sit on a log axis; not for {bad}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.4))
    else:
        fig = ax.figure
    names = [r["technique"] for r in rows][::-1]  # first row on top
    gains = [r["speedup"] for r in rows][::-1]
    colors = ["tab:green" if g >= 1 else "tab:red" for g in gains]
    # Bars grow from the 1.0 line, so a technique that hurt points left.
    ax.barh(names, [g - 1.0 for g in gains], left=1.0, color=colors, alpha=0.8)
    ax.set_xscale("log", base=2)
    ax.axvline(1.0, color="k", lw=1)
    for y, (g, r) in enumerate(zip(gains, rows[::-1], strict=True)):
        ax.text(g, y, f" {g:.2f}x ({r['unit']})", va="center", fontsize=8)
    lo, hi = min(gains + [1.0]), max(gains + [1.0])
    ax.set_xlim(lo / 1.5, hi * 4)  # room on the right for the labels
    ax.set_xlabel("gain over the baseline (x, log scale; > 1 is better)")
    ax.set_title("performance tuning: each technique against its own baseline")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


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
    from matplotlib import pyplot as plt

    advice = "pass the rows of labkit.ddp.bucket_sweep(caps_mb, ..., overlap=True)"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    _check_rows(rows, ["bucket_cap_mb", "allreduces", "compute_s", "step_s", "serial_s",
                       "hidden_fraction"], "rows", advice)
    rows = sorted(rows, key=lambda r: r["bucket_cap_mb"])
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 4))
    else:
        fig = ax.figure
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
                f"hidden {share:.0%}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [f"{r['bucket_cap_mb']:g} MB\n{r['allreduces']:.0f} bucket"
                      f"{'' if r['allreduces'] == 1 else 's'}" for r in rows])
    top = max(max(c + t for c, t in zip(compute, comm, strict=True)), max(step))
    ax.set_ylim(0, top * 1.45)  # room for the labels and the legend
    ax.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("ms per step (slowest rank)")
    ax.set_title("DDP: the communication that overlap hides, by bucket size")
    ax.legend(fontsize=8, loc="upper left", frameon=False, ncols=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def memory_plot(rows: list[dict], budget: float, ax=None):
    """Training memory against the batch: the estimate's line, the measured peaks, the budget.

    ``rows`` have ``batch``, ``estimate`` and ``peak`` (bytes; ``peak`` may be None where not
    measured). Returns the Figure.

    Example::

        >>> fig = memory_plot([{"batch": 64, "estimate": 1.6e8, "peak": 1.9e8}], budget=2.5e8)
    """
    from matplotlib import pyplot as plt

    advice = "pass rows of {'batch', 'estimate', 'peak'} in bytes, one per batch size"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    _check_rows(rows, ["batch", "estimate", "peak"], "rows", advice)
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 4))
    else:
        fig = ax.figure
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
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig

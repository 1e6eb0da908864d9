"""Figures: every plot the notebooks show, drawn from plain result rows. Nothing here measures.

matplotlib is imported inside each function, so ``import labkit`` stays light; headless (CI,
a worker, a shell) matplotlib falls back to the Agg backend by itself.
"""

from __future__ import annotations

from ._sizes import whole

__all__ = ["bandwidth_plot", "augmentation_grid", "check_image", "training_curves",
           "live_training_curves", "scaling_plot", "large_batch_plot", "pipeline_timeline",
           "bubble_plot", "staleness_plot", "bytes_accuracy_plot", "tuning_plot", "overlap_plot",
           "memory_plot", "sp_activation_bytes", "sp_layout", "ring_schedule_plot",
           "ring_work_plot", "ring_memory_plot", "expert_traffic_matrix", "expert_load_plot",
           "expert_placement_plot", "zero_plot", "mesh_plot", "wire_plot", "schedule_timeline_plot",
           "planner_plot", "planner_check_plot"]


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


def check_image(image):
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

    arr = check_image(image)
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


# ---- sequence parallelism (notebook 09) ---------------------------------------------------------

def sp_activation_bytes(rows, *, ax=None):
    """Activation bytes per rank of one transformer block, by region: dense, TP, SP.

    ``rows``: ``labkit.parallel.sequence.activation_rows(sp_check result)``, one dict per
    version (``{"version", "layernorm", "attention", "mlp", "dropout", "measured"}``, bytes).
    Draws one stacked bar per version (the formula's regions) and the measured total as a
    black marker on top: they coincide.
    """
    import matplotlib.pyplot as plt

    regions = ("layernorm", "attention", "mlp", "dropout")
    _check_rows(rows, ["version", *regions, "measured"], "rows",
                "pass sequence.activation_rows(result) of a sequence.sp_check result")
    labels = {"layernorm": "LayerNorm inputs", "attention": "attention",
              "mlp": "MLP", "dropout": "dropout masks"}
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.8))
    else:
        fig = ax.figure
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
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_ylabel("kB kept for backward, per rank")
    ax.set_title("one block's activations: what TP leaves replicated, SP splits")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(bottom) * 1.2)
    fig.tight_layout()
    return fig


def sp_layout(tp, *, sent_bytes=None, ax=None):
    """Who holds what in a tensor-parallel and a sequence-parallel block, and what moves.

    Two rows, TP above SP; each draws the (seq x hidden) activation three times: the region
    of LayerNorm / dropout / residual, the attention and MLP region, and the next such region.
    Colours are ranks: horizontal bands are shards of the sequence, vertical bands shards of
    the heads or MLP features, grey is replicated. The arrows name the collectives;
    ``sent_bytes`` (``{"tp": n, "sp": n}``, bytes one rank sends in forward) labels each row.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 4.2))
    else:
        fig = ax.figure
    w, h, gap = 1.6, 1.2, 2.2
    xs = [0, w + gap, 2 * (w + gap)]

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

    rows = (("tp", 2.2, "replicated", ("f: identity\n(all-reduce in backward)",
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
            ax.text((a + b) / 2, y + h / 2 + 0.12, label, ha="center", va="bottom", fontsize=7.5)
        title = "tensor parallel" if name == "tp" else "tensor + sequence parallel"
        if sent_bytes is not None and name in sent_bytes:
            title += f"\n{sent_bytes[name] / 1e3:.1f} kB sent per rank, forward"
        ax.text(-0.45, y + h / 2, title, ha="right", va="center", fontsize=9)
        where = ("every rank: all s tokens" if outer == "replicated"
                 else f"rank r: tokens r*s/{tp} ...")
        for x in (xs[0], xs[2]):
            ax.text(x + w / 2, y - 0.12, where, ha="center", va="top", fontsize=7.5)
        ax.text(xs[1] + w / 2, y - 0.12, f"rank r: heads r*a/{tp} ..., all s tokens",
                ha="center", va="top", fontsize=7.5)
    for x, label in zip(xs, ("LayerNorm, dropout,\nresidual", "QKV, attention, proj /\n"
                                                             "fc1, GELU, fc2",
                             "dropout, residual,\nnext LayerNorm"), strict=True):
        ax.text(x + w / 2, 2.2 + h + 0.1, label, ha="center", va="bottom", fontsize=8)
    ax.text(xs[0] - 0.08, 0.0 + h / 2, "seq", rotation=90, ha="right", va="center", fontsize=7)
    ax.text(xs[0] + w / 2, -0.45, "hidden", ha="center", va="top", fontsize=7)
    handles = [Rectangle((0, 0), 1, 1, color=f"C{r}", alpha=0.75) for r in range(tp)]
    handles.append(Rectangle((0, 0), 1, 1, color="0.8"))
    ax.legend(handles, [f"rank {r}" for r in range(tp)] + ["replicated"], fontsize=7.5,
              loc="lower right", bbox_to_anchor=(1.0, -0.05), ncol=tp + 1, frameon=False)
    ax.set_xlim(-3.0, xs[2] + w + 0.2)
    ax.set_ylim(-0.9, 2.2 + h + 0.6)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.tight_layout()
    return fig


# ---- ring attention (notebook 09) ---------------------------------------------------------------

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
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if not rows or not {"step", "rank", "kv_chunks", "blocks"} <= set(rows[0]):
        raise ValueError("pass the rows of labkit.parallel.context.ring_schedule(world, order)")
    world = max(r["rank"] for r in rows) + 1
    steps = max(r["step"] for r in rows) + 1
    if ax is None:
        fig, ax = plt.subplots(figsize=(1.3 * steps + 1.5, 0.9 * world + 1))
    else:
        fig = ax.figure
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
        ax.text(x0 + 0.5, y0 + 0.2, label, ha="center", va="center", fontsize=8)
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
              loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


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
    from matplotlib import pyplot as plt

    if not rows or not {"rank", "order", "scores", "blocks"} <= set(rows[0]):
        raise ValueError("pass the rows of labkit.parallel.context.ring_check (every rank's)")
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
    else:
        fig = ax.figure
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
                    va="bottom", fontsize=7)
        ax.axhline(max(r["scores"] for r in mine), color=bars[0].get_facecolor(),
                   linestyle="--", linewidth=1)
    ranks = sorted({r["rank"] for r in rows})
    ax.set_xticks(ranks, [f"rank {k}" for k in ranks])
    ax.set_ylabel("query-key scores computed")
    ax.set_ylim(0, max(r["scores"] for r in rows) * 1.3)
    causal = "causal" if rows[0].get("causal", True) else "not causal"
    ax.set_title(f"ring attention, {causal}: work per rank (dashed: the busiest rank)",
                 fontsize=9)
    ax.legend(frameon=False, fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def ring_memory_plot(rows: list[dict], ax=None):
    """Bytes kept for backward per rank against the sequence length: full vs ring attention.

    ``rows`` are ``labkit.parallel.context.memory_sweep``'s: markers are the measured bytes
    (``full``, ``ring``), lines the formulas (``full_formula``: ``O(s^2)``; ``ring_formula``:
    ``O(s / n)``), on log-log axes. Returns the Figure.

    Example::

        >>> fig = ring_memory_plot(labkit.launch(memory_sweep, [64, 128, 256], nproc=4).values[0])
    """
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    keys = {"seq", "full", "full_formula", "ring", "ring_formula"}
    if not rows or not keys <= set(rows[0]):
        raise ValueError("pass the rows of labkit.parallel.context.memory_sweep")
    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 4))
    else:
        fig = ax.figure
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
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


# ---- experts over ranks (notebook 09) -----------------------------------------------------------

def expert_traffic_matrix(results: list[dict], ax=None):
    """Rows each rank sends to each rank, as a heatmap, from ``moe_check`` (one dict per rank).

    Row ``i`` is the sender, column ``j`` the receiver: entry ``(i, j)`` is ``send_counts[j]``
    of rank ``i`` ((token, expert) rows, each ``hidden`` numbers). The diagonal stays on its
    rank; everything else crosses the network, twice forward and twice backward. Draws on
    ``ax`` when given; returns the Figure.

    Example::

        >>> fig = expert_traffic_matrix(labkit.launch(moe_check, 32, 16, 32, 4, nproc=2).values)
    """
    from matplotlib import pyplot as plt

    if not results or "send_counts" not in results[0]:
        raise ValueError("pass the list of dicts moe_check returned (one per rank)")
    matrix = [r["send_counts"] for r in sorted(results, key=lambda r: r["rank"])]
    n = len(matrix)
    if ax is None:
        fig, ax = plt.subplots(figsize=(1.2 * n + 2.5, 1.1 * n + 1.5))
    else:
        fig = ax.figure
    image = ax.imshow(matrix, cmap="Blues", vmin=0)
    top = max(max(row) for row in matrix) or 1
    for i, row in enumerate(matrix):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center",
                    color="white" if count > top / 2 else "black",
                    fontweight="bold" if i == j else "normal")
    ax.set_xticks(range(n), [f"rank {j}" for j in range(n)])
    ax.set_yticks(range(n), [f"rank {i}" for i in range(n)])
    ax.set_xlabel("receiver (holds the experts)")
    ax.set_ylabel("sender (routed the tokens)")
    ax.set_title("rows sent by each rank to each rank\n(diagonal: stays on the rank)")
    fig.colorbar(image, ax=ax, label="rows")
    fig.tight_layout()
    return fig


def expert_load_plot(rows: list[dict], ax=None):
    """Tokens per expert over training steps, with and without the load-balancing loss.

    From ``balance_sweep`` rows: for each setting, a band from the idlest to the busiest
    expert (and the busiest as a line), beside the fair share ``sum / n_experts`` (dashed);
    the legend gives the rows dropped at the last step. Draws on ``ax`` when given; returns
    the Figure.

    Example::

        >>> fig = expert_load_plot(balance_sweep())
    """
    from matplotlib import pyplot as plt

    if not rows or not {"aux", "step", "tokens_per_expert", "dropped"} <= set(rows[0]):
        raise ValueError("pass the rows balance_sweep returned")
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 4))
    else:
        fig = ax.figure
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
    ax.legend(frameon=False, fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


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
    from matplotlib import pyplot as plt

    n_experts = len(tokens_per_expert)
    if not n_experts or world < 1 or n_experts % world:
        raise ValueError(f"{n_experts} experts do not split over {world} ranks: pass one count "
                         f"per expert and the number of ranks that hold them")
    per_rank = n_experts // world
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5, 0.5 * n_experts + 2), 3.5))
    else:
        fig = ax.figure
    colors = plt.get_cmap("tab10")
    for rank in range(world):
        experts = list(range(rank * per_rank, (rank + 1) * per_rank))
        ax.bar(experts, [tokens_per_expert[e] for e in experts], color=colors(rank % 10),
               label=f"rank {rank}: experts {experts[0]}..{experts[-1]}")
    if capacity is not None:
        ax.axhline(capacity, color="k", ls="--", label=f"capacity ({capacity} rows)")
    top = max([*tokens_per_expert, capacity or 0, 1])
    ax.set_ylim(0, top * 1.35)  # room for the legend above the bars
    ax.set_xticks(range(n_experts))
    ax.set_xlabel("expert")
    ax.set_ylabel("rows routed to it")
    ax.set_title("experts and the ranks that hold them")
    ax.legend(frameon=False, fontsize="small", ncol=min(world + (capacity is not None), 3),
              loc="upper center")
    fig.tight_layout()
    return fig


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
    from matplotlib import pyplot as plt

    advice = ("pass zero.zero_rows(zero1, zero2, zero3): rows of {'label', 'params', 'grads', "
              "'optimizer', 'in_flight', 'wire'} in bytes")
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    _check_rows(rows, ["label", *_ZERO_KINDS, "in_flight", "wire"], "rows", advice)
    if ax is None:
        fig, (held_ax, wire_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    elif isinstance(ax, (list, tuple)):
        held_ax, wire_ax = ax
        fig = held_ax.figure
    else:
        held_ax, wire_ax, fig = ax, None, ax.figure
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
    from matplotlib import pyplot as plt
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
    if ax is None:
        fig, ax = plt.subplots(figsize=(2.6 * cols + 1.2, 1.6 * rows + 1.2))
    else:
        fig = ax.figure
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
    from matplotlib import pyplot as plt

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
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(bars) + 1.5), 3.6))
    else:
        fig = ax.figure
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


# ---- pipeline schedules beyond 1F1B (notebook 10) ----------------------------------------------

# forward blue, backward (full or input) orange, weight gradient green
_SCHEDULE_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def schedule_timeline_plot(events: list[dict], title: str | None = None, step: int = 0, ax=None):
    """Gantt chart of one pipeline step with chunks and split backwards: one row per rank.

    Draws the events of ``schedules.simulate`` / ``schedule_timeline`` / ``pipelined_step``
    (``rank, kind, chunk, micro, start, end``, optional ``step``): F blue, B orange (the full
    backward, or its input half), W green (the weight half); a rank's later chunks in paler
    shades; each block labelled ``chunk.micro`` when there are several chunks, else ``micro``.
    White space is the bubble. Measured events of several steps are filtered to ``step``.
    Draws on ``ax`` when given; returns the Figure.

    Example::

        >>> from labkit.parallel import schedules
        >>> t = schedules.schedule_timeline("interleaved 1f1b", 4, 8, chunks=2)
        >>> fig = schedule_timeline_plot(t["events"], title="interleaved 1F1B, p=4, v=2")
    """
    from matplotlib import colors as mcolors
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    if not events:
        raise ValueError("no events to plot: pass the 'events' of schedules.simulate, "
                         "schedule_timeline or pipelined_step")
    missing = {"rank", "kind", "micro", "start", "end"} - set(events[0])
    if missing:
        raise ValueError(f"events lack {sorted(missing)}: pass the events schedules.simulate or "
                         f"pipelined_step returned")
    shown = [e for e in events if e.get("step", 0) == step]
    if not shown:
        steps = sorted({e.get("step", 0) for e in events})
        raise ValueError(f"no events of step {step}: the events hold steps {steps}")
    ranks = sorted({e["rank"] for e in shown})
    chunks = max(e.get("chunk", 0) for e in shown) + 1
    t0 = min(e["start"] for e in shown)
    # Measured events (they carry "step") are in seconds; simulated ones in the costs' units.
    if "step" in shown[0]:
        scale, unit = (1e3, "ms") if max(e["end"] for e in shown) - t0 < 2 else (1.0, "s")
    else:
        scale, unit = 1.0, "time units"
    span = float(max(e["end"] for e in shown) - t0) * scale
    if span <= 0:
        raise ValueError("every event has zero length: nothing to draw (simulate with positive "
                         "costs f, b, w, or pass a measured step)")
    if ax is None:
        fig, ax = plt.subplots(figsize=(11, 0.55 * len(ranks) + 1.5))
    else:
        fig = ax.figure
    # Points per time unit, to leave out the labels that would not fit in their block.
    per_unit = ax.get_window_extent().width * 72 / fig.dpi / span
    for e in shown:
        chunk = e.get("chunk", 0)
        base = mcolors.to_rgb(_SCHEDULE_COLOURS[e["kind"]])
        fade = 0.55 * chunk / max(chunks - 1, 1)  # later chunks paler, towards white
        colour = tuple(c + (1 - c) * fade for c in base)
        left, width = float(e["start"] - t0) * scale, float(e["end"] - e["start"]) * scale
        ax.barh(e["rank"], width, left=left, height=0.7, color=colour, edgecolor="white",
                linewidth=0.6)
        label = f"{chunk}.{e['micro']}" if chunks > 1 else str(e["micro"])
        if len(label) * 7 * 0.62 < width * per_unit:
            ax.text(left + width / 2, e["rank"], label, ha="center", va="center", fontsize=7,
                    color="black" if fade > 0.3 else "white", clip_on=True)
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
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title)
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
    from matplotlib import pyplot as plt

    advice = "pass Plan.row() dicts, e.g. [planner.plan(model, cluster, degrees).row()]"
    if not rows:
        raise ValueError(f"no plans to plot: {advice}")
    _check_rows(rows, ["label", "memory", "budget", "device_memory", "comm"], "rows", advice)
    if ax is None:
        fig, (mem_ax, comm_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    elif isinstance(ax, (list, tuple)):
        mem_ax, comm_ax = ax
        fig = mem_ax.figure
    else:
        mem_ax, comm_ax, fig = ax, None, ax.figure
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
    from matplotlib import pyplot as plt

    advice = "pass planner.predicted_vs_measured(plan, measured) rows"
    if not rows:
        raise ValueError(f"no rows to plot: {advice}")
    _check_rows(rows, ["what", "predicted", "measured"], "rows", advice)
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows)), 3.8))
    else:
        fig = ax.figure
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

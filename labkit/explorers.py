"""Interactive explorers: sliders over a live figure, for the notebooks' "move it and watch" cells.

Each explorer joins three rooms that must not know each other: the computation (``augment``,
``parallel.schedules``, ``planner``), the figure (``plots``) and the widgets (ipywidgets). Here
they meet in one place, so ``plots`` stays free of computation and the computing rooms free of
widgets. An explorer returns an ``ipywidgets.VBox`` of its controls with what it shows as
attributes (``figure`` and ``message``, each an :class:`Shown`), so a test (or a curious
learner) can move a control and read the result without a browser.

What an explorer shows is no widget: the figure and its text are ordinary outputs of the cell
(a PNG, text and HTML), displayed beside the controls and replaced in place at every change.
A notebook saved and reopened, or read on GitHub or nbviewer, where no kernel holds the
widgets, still shows the last figure and its numbers; running the cell again brings the
controls back.

- :func:`augmentation_explorer` (notebook 01): every ``AugmentConfig`` setting over a grid.
- :func:`schedule_explorer` (notebook 10): ranks, micro-batches and chunks over a timeline.
- :func:`planner_explorer` (notebook 10): a layout's memory and bytes, for any model.

ipywidgets and matplotlib are imported inside each function: ``import labkit`` stays light.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import html

from . import plots
from ._display import wrap

__all__ = ["augmentation_explorer", "schedule_explorer", "planner_explorer", "Shown"]


def _png(fig) -> bytes:
    """``fig`` as PNG bytes; the figure is closed so that pyplot does not show it a second time
    below the explorer."""
    import io

    from matplotlib import pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()


class Shown:
    """One ordinary output of an explorer's cell (its figure, or its text), kept up to date.

    ``data`` is the latest MIME bundle (``image/png`` and ``text/plain`` for a figure,
    ``text/html`` and ``text/plain`` for a text; ``{"text/plain": ""}`` when there is nothing to
    show). Once the explorer is displayed, every change replaces the output in place through
    its display handle, so the notebook file always holds the last state: that is what a
    reopened notebook, GitHub and nbviewer show.
    """

    def __init__(self):
        self.data: dict = {"text/plain": ""}
        self.handles: list = []

    @property
    def png(self) -> bytes | None:
        """The figure's PNG bytes, or None when no figure is shown."""
        data = self.data.get("image/png")
        return None if data is None else base64.b64decode(data)

    @property
    def text(self) -> str:
        return self.data.get("text/plain", "")

    def figure(self, png: bytes, alt: str) -> None:
        self._set({"image/png": base64.b64encode(png).decode("ascii"), "text/plain": alt})

    def message(self, text: str, html_text: str | None = None) -> None:
        """Show ``text`` (and ``html_text``, else ``text`` as preformatted HTML); a line over
        100 characters is broken at spaces, as an output area would break it mid-word."""
        text = wrap(text, indent="")
        self._set({"text/plain": text,
                   "text/html": html_text if html_text is not None else
                   f"<pre>{html.escape(text)}</pre>"})

    def clear(self) -> None:
        self._set({"text/plain": ""})

    def _set(self, data: dict) -> None:
        self.data = data
        for handle in self.handles:
            handle.update(data, raw=True)

    def show(self) -> None:
        """Display it as an output of the running cell, to be replaced in place later."""
        from IPython.display import display

        handle = display(self.data, raw=True, display_id=True)
        if handle is not None:  # None outside IPython: it was printed, nothing to update
            self.handles.append(handle)


@functools.cache
def _explorer_type():
    import ipywidgets as widgets

    class Explorer(widgets.VBox):
        """An explorer's controls; displayed, its outputs (``shows``) follow it in the cell.

        Its ``text/plain`` (what a reader without the widget sees: GitHub, nbviewer, a
        notebook reopened without saved widget state) says what the controls are for, in
        lines that fit an output area.
        """

        def __repr__(self) -> str:
            return self.about

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            bundle["text/plain"] = self.about  # whole: ipywidgets cuts a repr at 110 characters
            return bundle

        def _ipython_display_(self) -> None:
            from IPython.display import display

            display(self._repr_mimebundle_(), raw=True)
            for shown in self.shows:
                shown.show()

    return Explorer


def _explorer(children, about: str, shows: list[Shown]):
    box = _explorer_type()(children)
    box.about, box.shows = about, shows
    return box


# ---- augmentation (notebook 01) ---------------------------------------------------------------


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

    Moving a slider redraws the grid (same seed, so only the changed setting moves things); the
    grid is an ordinary output of the cell (``figure``), so the last one stays in the saved
    notebook. The returned VBox has a ``config()`` method giving the chosen ``AugmentConfig``,
    ready for ``labkit.augment.augmentation(size, config=...)`` or ``gpu_augment``.

    Example::

        >>> from skimage.data import astronaut
        >>> explorer = augmentation_explorer(astronaut())
        >>> explorer                      # shows the sliders and the grid in the notebook
        >>> config = explorer.config()    # after tuning by eye
    """
    import ipywidgets as widgets

    from .augment import AugmentConfig, augmentation

    arr = plots.check_image(image)
    size = image_size or min(arr.shape[0], arr.shape[1], 160)  # small enough to redraw quickly
    start = AugmentConfig()
    values = {**{k: getattr(start, k) for k in _SLIDERS if k != "zoom"}, "zoom": 1 - start.scale[0]}
    sliders = {key: widgets.FloatSlider(value=values[key], min=lo, max=hi, step=step,
                                        description=label, continuous_update=False,
                                        style={"description_width": "initial"})
               for key, (label, lo, hi, step) in _SLIDERS.items()}
    picture = Shown()

    def config():
        settings = {k: s.value for k, s in sliders.items() if k != "zoom"}
        return AugmentConfig(scale=(1 - sliders["zoom"].value, 1.0), **settings)

    def redraw(_change=None):
        transform = augmentation(size, kind="standard", config=config(), normalize=False)
        fig = plots.augmentation_grid(arr, transform, n=n, seed=seed)
        settings = ", ".join(f"{s.description} {s.value:g}" for s in sliders.values())
        picture.figure(_png(fig), f"augmentation grid, {n} draws: {settings}")

    for slider in sliders.values():
        slider.observe(redraw, names="value")
    redraw()
    half = (len(sliders) + 1) // 2
    columns = [widgets.VBox(list(sliders.values())[:half]),
               widgets.VBox(list(sliders.values())[half:])]
    box = _explorer([widgets.HBox(columns)],
                    "Augmentation explorer: its sliders (rotation, zoom, shift, flip, colour)\n"
                    "need a running kernel: run the cell to move them. Below: the last grid.",
                    [picture])
    box.config, box.figure = config, picture
    return box


# ---- pipeline schedules (notebook 10) ---------------------------------------------------------


def schedule_explorer(stages: int = 4, m: int = 8, chunks: int = 2,
                      schedule: str = "interleaved 1f1b", draw=None):
    """Sliders for ranks, micro-batches and chunks and a schedule menu over a live timeline.

    Every change re-simulates (:func:`labkit.parallel.schedules.schedule_timeline`), redraws the
    timeline (``draw``, by default ``labkit.plots.schedule_timeline_plot``) and prints the bubble
    beside the formula's, the activations held and the messages. The chunks slider is for the
    schedules that split a rank's layers into chunks (interleaved 1F1B, zero bubble): for GPipe
    and 1F1B it shows 1 and is disabled. The returned VBox has ``update()`` (redraw now),
    ``result`` (the last ``schedule_timeline`` dict, or None after an error, whose message
    replaces the figure), ``controls``, and ``message`` and ``figure`` (what the cell shows).

    Example::

        >>> schedule_explorer()      # in a notebook cell: move the sliders, watch the bubble
    """
    import ipywidgets as widgets

    from .parallel.schedules import SCHEDULE_NAMES, schedule_timeline

    draw = draw or plots.schedule_timeline_plot
    style = {"description_width": "initial"}
    controls = {
        "stages": widgets.IntSlider(value=stages, min=1, max=8, description="ranks p",
                                    continuous_update=False, style=style),
        "m": widgets.IntSlider(value=m, min=1, max=32, description="micro-batches m",
                               continuous_update=False, style=style),
        "chunks": widgets.IntSlider(value=chunks, min=1, max=4, description="chunks v",
                                    continuous_update=False, style=style),
        "name": widgets.Dropdown(options=list(SCHEDULE_NAMES), value=schedule,
                                 description="schedule", style=style),
    }
    text, picture = Shown(), Shown()
    # The chunks chosen for a chunked schedule, kept while a one-chunk schedule shows 1.
    state = {"chunks": chunks, "busy": False}

    def fit_chunks():
        """Show the chunks the chosen schedule runs: 1, disabled, for GPipe and 1F1B."""
        slider, chunked = controls["chunks"], controls["name"].value not in ("gpipe", "1f1b")
        state["busy"] = True  # one redraw for the whole change, not one per control
        try:
            if chunked and slider.disabled:
                slider.disabled, slider.value = False, state["chunks"]
            elif not chunked and not slider.disabled:
                state["chunks"] = slider.value
                slider.value, slider.disabled = 1, True
        finally:
            state["busy"] = False

    def update(_change=None):
        if state["busy"]:
            return box.result
        fit_chunks()
        values = {key: c.value for key, c in controls.items()}
        if controls["chunks"].disabled:  # a one-chunk schedule, whatever the slider was set to
            values["chunks"] = 1
        try:
            result = schedule_timeline(values["name"], values["stages"], values["m"],
                                       values["chunks"])
        except ValueError as err:
            box.result = None
            picture.clear()  # no figure rather than the previous one under this message
            text.message(f"cannot draw this one: {err}",
                         f"<b>cannot draw this one:</b> {html.escape(str(err))}")
            return None
        formula = result["formula"]
        # Two lines: one would be wider than the output area, which wraps it mid-word.
        text.message(f"bubble {result['bubble']:.3f} of the step, formula "
                     f"{'none (m < p)' if formula is None else f'{formula:.3f}'}; "
                     f"idle / compute {result['idle_per_compute']:.3f}; "
                     f"{result['messages']} messages\n"
                     f"activations held per rank (stages' worth): "
                     f"{[round(x, 2) for x in result['peak_in_flight']]}")
        title = (f"{values['name']}: p={values['stages']}, m={values['m']}, "
                 f"v={values['chunks']}")
        picture.figure(_png(draw(result["events"], title=title)), f"timeline of {title}")
        box.result = result
        return result

    for control in controls.values():
        control.observe(update, names="value")
    box = _explorer([widgets.HBox(list(controls.values())[:2]),
                     widgets.HBox(list(controls.values())[2:])],
                    "Pipeline schedule explorer: its sliders (ranks, micro-batches, chunks) and\n"
                    "schedule menu need a running kernel: run the cell to move them. Below: the\n"
                    "last timeline drawn and its bubble.", [text, picture])
    box.update, box.result, box.controls = update, None, controls
    box.message, box.figure = text, picture
    update()
    return box


# ---- the planner (notebook 10) ----------------------------------------------------------------


def planner_explorer(model=None, cluster=None):
    """Sliders for a layout of ``model`` on ``cluster`` (or a published run), and its plan, live.

    A preset menu (your ``planner.Model`` and ``planner.Cluster``, if given, then
    ``planner.PUBLISHED``), sliders for tp, pp, cp and ep (dp takes the devices left), the ZeRO
    stage, the micro-batch and the number of micro-batches, and switches for activation
    checkpointing and sequence parallelism. Every change redraws ``plots.planner_plot``: the
    memory per device as a stacked bar against the usable memory, and the bytes sent per
    dimension; below it the verdict and ``why``. The returned VBox has ``update()`` (redraw
    now), ``plan()`` (the current Plan, or None when the layout is refused), ``controls``, and
    ``figure`` and ``message`` (what the cell shows: ordinary outputs, kept in the saved
    notebook).

    Example::

        >>> planner_explorer()                              # the published runs
        >>> box = planner_explorer(my_model, Cluster(devices=8, memory_gib=80)); box.plan()
    """
    import ipywidgets as widgets

    from .planner import PUBLISHED, Cluster, Degrees, PlanError, plan
    from .planner.describe import factors

    presets = {}
    if model is not None:
        start = cluster or Cluster(devices=8, memory_gib=80)
        presets["yours"] = (model, start, Degrees(dp=start.devices))
    presets.update({k: (v.model, v.cluster, v.degrees) for k, v in PUBLISHED.items()})
    style = {"description_width": "initial"}
    menu = widgets.Dropdown(options=list(presets), description="preset", style=style)
    sliders = {k: widgets.SelectionSlider(options=[1], description=k, style=style,
                                          continuous_update=False)
               for k in ("tp", "pp", "cp", "ep")}
    zero = widgets.ToggleButtons(options=[0, 1, 2, 3], description="ZeRO", style=style)
    micro = widgets.IntSlider(1, min=1, max=16, description="micro_batch", style=style,
                              continuous_update=False)
    chunks = widgets.IntSlider(1, min=1, max=512, description="micro-batches", style=style,
                               continuous_update=False)
    ckpt = widgets.Checkbox(description="activation checkpointing")
    sp = widgets.Checkbox(value=True, description="sequence parallelism")
    picture, text = Shown(), Shown()
    state = {"plan": None, "busy": False}

    def current():
        base, cl, start = presets[menu.value]
        m = dataclasses.replace(base, micro_batch=micro.value,
                                activation_checkpointing=ckpt.value)
        inner = sliders["tp"].value * sliders["pp"].value * sliders["cp"].value
        # The preset's unequal stages hold for its pp only; its kept-gathered FSDP for ZeRO-3.
        d = dataclasses.replace(
            start, dp=max(1, cl.devices // inner), zero=zero.value, microbatches=chunks.value,
            sp=sp.value, **{k: s.value for k, s in sliders.items()},
            stage_layers=start.stage_layers if sliders["pp"].value == start.pp else None,
            keep_gathered=start.keep_gathered and zero.value == 3)
        return m, cl, d

    def update(_change=None):
        if state["busy"]:
            return
        try:
            p = plan(*current())
        except PlanError as refused:
            state["plan"] = None
            picture.clear()  # no figure of the previous layout under this one's refusal
            text.message(f"refused: {refused}",
                         f"<b>refused:</b> {html.escape(str(refused))}")
            return
        state["plan"] = p
        fig = plots.planner_plot([p.row(f"{p.degrees}")])
        picture.figure(_png(fig), f"memory per device and bytes sent: {menu.value}, {p.degrees}")
        text.message(str(p))

    def load(_change=None):
        m, cl, d = presets[menu.value]
        state["busy"] = True  # one redraw for the whole preset, not one per control
        for k, s in sliders.items():
            s.options = factors(cl.devices)
            s.value = getattr(d, k)
        zero.value, micro.value, chunks.value = d.zero, m.micro_batch, d.m
        ckpt.value, sp.value = m.activation_checkpointing, d.sp
        state["busy"] = False
        update()

    menu.observe(load, names="value")
    for control in (*sliders.values(), zero, micro, chunks, ckpt, sp):
        control.observe(update, names="value")
    load()
    box = _explorer([menu, widgets.HBox([widgets.VBox(list(sliders.values())),
                                         widgets.VBox([zero, micro, chunks, ckpt, sp])])],
                    "Parallelism planner explorer: its preset menu, degree sliders and switches\n"
                    "need a running kernel: run the cell to move them. Below: the last plan\n"
                    "drawn and its verdict.", [picture, text])
    box.update, box.figure, box.message = update, picture, text
    box.plan = lambda: state["plan"]
    box.controls = {"preset": menu, **sliders, "zero": zero, "micro_batch": micro,
                    "microbatches": chunks, "checkpointing": ckpt, "sp": sp}
    return box

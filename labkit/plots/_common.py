"""What several figure modules share: the course's style, axes to draw on, legends kept off the
data, labels that fit their boxes, checked rows, tick labels."""

from __future__ import annotations

import contextlib
import functools
import re
import textwrap

__all__ = ["figure_for", "figure_pair", "size_label", "check_rows", "rows_by", "integer_ticks",
           "SCALING_MODES", "course_style", "course_figure", "legend_outside", "fit_labels",
           "capped_width", "COURSE_RC", "MAX_WIDTH_IN", "MIN_TEXT_PT"]


# ---- the course's style -------------------------------------------------------------------------

# JupyterLab shows a figure at its own size while it fits the notebook's column (about 950 px
# beside the file browser at 1400 px), and shrinks it, text and all, when it does not. At the
# inline backend's 100 dpi, 9.5 inches is that column; 10 pt is 14 px, the notebook's body text.
MAX_WIDTH_IN = 9.5
MIN_TEXT_PT = 10.0

# Okabe and Ito's palette (told apart with the common colour-vision deficiencies), without its
# yellow (faint on white) and black (kept for references: budgets, formulas, ideals).
COURSE_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9",
                  "#882255", "#999933")

COURSE_RC = {
    "figure.figsize": (8.0, 4.5),
    "font.size": 11.0,
    "axes.titlesize": 12.0,
    "axes.labelsize": 11.0,
    "xtick.labelsize": 10.5,
    "ytick.labelsize": 10.5,
    "legend.fontsize": 10.5,
    "legend.title_fontsize": 10.5,
    "legend.frameon": False,
    "figure.titlesize": 13.0,
    "lines.linewidth": 1.8,
    "lines.markersize": 6.0,
    "axes.titlepad": 8.0,
}


@contextlib.contextmanager
def course_style():
    """The course's rcParams inside the ``with`` block only: a learner's own settings outside
    labkit's figures stay as they were. Text sizes and colours are fixed on each artist when it
    is made, so a figure made inside keeps the style when Jupyter draws it later."""
    import matplotlib as mpl
    from cycler import cycler

    with mpl.rc_context({**COURSE_RC, "axes.prop_cycle": cycler(color=list(COURSE_COLOURS))}):
        yield


def course_figure(draw):
    """Decorator: ``draw`` runs inside :func:`course_style` (every figure of the course)."""

    @functools.wraps(draw)
    def styled(*args, **kwargs):
        with course_style():
            return draw(*args, **kwargs)

    styled.course_style = True
    return styled


# ---- legends off the data -----------------------------------------------------------------------

def legend_outside(ax, where: str = "right", handles=None, labels=None, wrap: int | None = None,
                   **kwargs):
    """A legend beside the axes (``where="right"``) or under its x axis (``"below"``), never on
    the data; ``wrap`` breaks long labels onto lines of that many characters. Call it after the
    ticks and the x label are set (a legend below sits under them), before ``tight_layout``
    (which then makes room for it). Returns the Legend, or None when nothing is labelled."""
    from matplotlib.transforms import ScaledTranslation

    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return None
    if wrap:
        labels = [_wrap(label, wrap) for label in labels]
    if where == "right":
        kwargs = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0,
                  **kwargs}
    elif where == "below":
        fig = ax.figure
        # how far the tick labels and the x label reach below the axes, in inches: the legend
        # goes under them whatever height the layout later gives the axes
        ticks = ax.xaxis.get_tightbbox() if ax.axison else None  # None: no x axis drawn
        depth = 0.0 if ticks is None else (ax.get_window_extent().y0 - ticks.y0) / fig.dpi
        kwargs = {"loc": "upper center", "bbox_to_anchor": (0.5, 0.0), "borderaxespad": 0.0,
                  "bbox_transform": ax.transAxes + ScaledTranslation(0, -(max(depth, 0) + 0.1),
                                                                     fig.dpi_scale_trans),
                  **kwargs}
    else:
        raise ValueError(f"where must be 'right' or 'below', got {where!r}")
    return ax.legend(handles, labels, **kwargs)


def _wrap(label: str, width: int) -> str:
    """``label`` on lines of ``width`` characters, a short bracketed part, e.g. a formula's
    ``(m + p - 1)``, kept on one line."""
    glued = re.sub(r"\([^()]{1,12}\)", lambda m: m.group(0).replace(" ", "\0"), label)
    return textwrap.fill(glued, width, break_long_words=False,
                         break_on_hyphens=False).replace("\0", " ")


def fit_labels(labelled, margin: float = 0.9) -> None:
    """Fit each label in its box on screen: as it is, else turned upright (a narrow, tall
    block), else removed: a block too small for its label is better bare than overlapped by
    it. ``labelled`` holds ``(text, box)`` pairs, the box a patch (a bar). Call it after
    ``tight_layout``, when the axes has its final size."""
    for text, box in labelled:
        room = box.get_window_extent()
        for rotation in (0, 90):
            text.set_rotation(rotation)
            size = text.get_window_extent()
            if size.width <= margin * room.width and size.height <= margin * room.height:
                break
        else:
            text.remove()


def capped_width(inches: float) -> float:
    """``inches``, but no wider than the notebook's column."""
    return min(float(inches), MAX_WIDTH_IN)


# ---- axes, rows, ticks --------------------------------------------------------------------------


def figure_for(ax, figsize):
    """``(figure, axes)``: ``ax`` and its figure when given (a panel of a larger figure), else a
    new figure of ``figsize`` inches with one axes."""
    from matplotlib import pyplot as plt

    if ax is None:
        return plt.subplots(figsize=figsize)
    return ax.figure, ax


def figure_pair(ax, figsize):
    """``(figure, left, right)`` for a figure of two panels side by side: a new figure when
    ``ax`` is None, the two axes of a given pair, or one given axes (``right`` None: the caller
    draws only the left panel)."""
    from matplotlib import pyplot as plt

    if ax is None:
        fig, (left, right) = plt.subplots(1, 2, figsize=figsize)
        return fig, left, right
    if isinstance(ax, (list, tuple)):
        left, right = ax
        return left.figure, left, right
    return ax.figure, ax, None


def size_label(n: float, _pos=None) -> str:
    """1024 -> '1 KiB', 64 MiB -> '64 MiB': message sizes as people say them."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


SCALING_MODES = ("weak", "strong", "independent")


def check_rows(rows, keys, name, advice):
    """Every row has ``keys`` and, where ``mode`` is one of them, a known mode; or a clear error."""
    missing = [k for k in keys if any(k not in r for r in rows)]
    if missing:
        raise ValueError(f"{name} lack {missing}: {advice}")
    modes = (sorted({r["mode"] for r in rows if r["mode"] not in SCALING_MODES})
             if "mode" in keys else [])
    if modes:
        raise ValueError(f"unknown mode {modes} in {name}: mode is 'weak' (same batch per "
                         f"worker), 'strong' (same global batch) or 'independent' (no "
                         f"gradient exchange)")


def rows_by(rows, key, order_key) -> dict:
    """``{rows[key]: rows sorted by order_key}``, keys in first-seen order."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return {k: sorted(v, key=lambda r: r[order_key]) for k, v in groups.items()}


def integer_ticks(ax, ticks, log):
    """Ticks exactly at ``ticks`` labelled 1, 2, 4 ...: the default log labels read 2^3."""
    from matplotlib.ticker import NullLocator

    if log:
        ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels=[f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())  # no unlabelled ticks between worker counts

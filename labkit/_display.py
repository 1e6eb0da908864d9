"""What labkit shows the learner: printed lines that fit, and verdicts marked in JupyterLab.

Every line labkit prints fits :data:`WIDTH` characters (a notebook's output area, a terminal):
:func:`wrap` breaks long lines at spaces only, so a number, a path or a word is never split.

A verdict (pass, not yet, as expected, ...) shows in a Jupyter kernel as a small coloured badge
with its details beside it and its hint on its own line (``text/html``), and everywhere else as
the plain text it always was: the same display carries that text as ``text/plain``, which is
what logs, ``nbval`` and a terminal read. A rank's process and a DataLoader worker are not the
kernel: they print.
"""

from __future__ import annotations

import html
import sys
import textwrap

WIDTH = 100

# label -> badge colour. White text on a mid-tone background reads on light and dark themes;
# the text beside the badge keeps the theme's own colour.
_COLOURS = {
    "pass": "#2e7d32",  # green
    "as expected": "#2e7d32",
    "not yet": "#b45309",  # amber
    "not as expected": "#b45309",
    "not judged at this size": "#616161",  # grey: nothing was judged
    "measuring again": "#616161",
    "prediction": "#1565c0",  # blue: a comparison, not a grade
}
_KINDS = {"pass": "pass", "as expected": "pass", "not yet": "not-yet",
          "not as expected": "not-yet", "not judged at this size": "not-judged",
          "measuring again": "not-judged", "prediction": "prediction"}


def wrap(text: str, width: int = WIDTH, indent: str = "    ") -> str:
    """``text`` with each line longer than ``width`` broken at spaces; the lines it adds start
    with the line's own indentation plus ``indent``. A word longer than a line stays whole."""
    out = []
    for line in text.splitlines() or [""]:
        if len(line) <= width:
            out.append(line)
            continue
        lead = line[:len(line) - len(line.lstrip(" "))]
        out.extend(textwrap.wrap(line, width, subsequent_indent=lead + indent,
                                 break_long_words=False, break_on_hyphens=False) or [line])
    return "\n".join(out)


def hang(label: str, text: str, width: int = WIDTH) -> str:
    """``label`` then ``text``, wrapped so that its lines start under the text, not the label:

        hint: every rank must call the same collectives in the same order: one that a rank
              skips leaves the others waiting
    """
    pad = " " * len(label)
    lines = text.splitlines() or [""]
    out = []
    for i, line in enumerate(lines):
        first = (label if i == 0 else pad) + line
        out.extend(textwrap.wrap(first, width, subsequent_indent=pad, break_long_words=False,
                                 break_on_hyphens=False) or [first.rstrip()])
    return "\n".join(out)


def verdict_text(label: str, title: str, detail: str, notes=()) -> str:
    """The plain text of a verdict: ``[label] title: detail``, then each ``(name, text)`` of
    ``notes`` (a hint, a likely cause) on its own line, indented under its name."""
    lines = [wrap(f"[{label}] {title}: {detail}")]
    lines += [hang(f"  {name}: ", text) for name, text in notes if text]
    return "\n".join(lines)


def verdict_html(label: str, title: str, detail: str, notes=()) -> str:
    """The same verdict as HTML: a coloured badge and border, every text escaped."""
    colour = _COLOURS.get(label, "#616161")
    kind = _KINDS.get(label, "other")
    esc = html.escape
    rows = "".join(
        f'<div class="labkit-note" style="margin:2px 0 0 1.5em">'
        f'<span style="font-weight:600">{esc(name)}:</span> {esc(text)}</div>'
        for name, text in notes if text)
    return (f'<div class="labkit-verdict labkit-{kind}" style="border-left:4px solid {colour};'
            f'padding:2px 0 2px 8px;margin:2px 0;white-space:pre-wrap;'
            f'font-family:var(--jp-code-font-family,monospace);'
            f'font-size:var(--jp-code-font-size,13px)">'
            f'<span class="labkit-badge" style="background:{colour};color:#fff;'
            f'border-radius:3px;padding:0 6px;font-weight:600">{esc(label)}</span> '
            f'<span style="font-weight:600">{esc(title)}</span>: {esc(detail)}{rows}</div>')


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel's (not a terminal's IPython, not a worker)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    import multiprocessing

    if multiprocessing.parent_process() is not None:  # a forked worker shares no kernel socket
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def show(plain: str, html_text: str) -> None:
    """Print ``plain``; in a Jupyter kernel, display it with ``html_text`` beside it."""
    if in_kernel():
        from IPython.display import display

        display({"text/plain": plain, "text/html": html_text}, raw=True)
    else:
        print(plain)


def show_verdict(label: str, title: str, detail: str, notes=()) -> str:
    """Show one verdict (HTML in a kernel, text elsewhere); return its plain text."""
    notes = list(notes)
    plain = verdict_text(label, title, detail, notes)
    show(plain, verdict_html(label, title, detail, notes))
    return plain

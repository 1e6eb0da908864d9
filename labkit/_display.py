"""What labkit shows the learner: printed lines that fit, and verdicts marked in JupyterLab.

Every line labkit prints fits :data:`WIDTH` characters (a notebook's output area, a terminal):
:func:`wrap` breaks long lines at spaces only, so a number, a path or a word is never split.

A verdict (pass, not yet, as expected, ...) shows in a Jupyter kernel as a small coloured badge
with its details beside it and its hint on its own line (``text/html``), and everywhere else as
the plain text it always was: the same display carries that text as ``text/plain``, which is
what logs, ``nbval`` and a terminal read. A rank's process and a DataLoader worker are not the
kernel: they print.

A framework's native start-up lines (TensorFlow's C++ INFO records, written before its logging
is set up) are held back by :func:`quiet_startup` (``labkit.quiet_startup``), warnings kept.

A table (:func:`show_table`, ``labkit.show_table``) shows the same way: an HTML table in the
kernel, and the same cells as aligned text, within :data:`WIDTH`, everywhere else.
"""

from __future__ import annotations

import contextlib
import html
import io
import os
import re
import sys
import tempfile
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


def _cell(value, spec=None) -> str:
    """One table cell as text: ``spec`` (a format spec, a ``{}`` template or a callable) if
    given; else whole numbers with thousands separators, others to 4 significant figures."""
    if value is None:
        return ""
    if callable(spec):
        return str(spec(value))
    if spec:
        return spec.format(value) if "{" in spec else format(value, spec)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,.0f}" if isinstance(value, int) or abs(value) >= 1000 else f"{value:.4g}"


def _table(rows, columns, formats):
    """(header, rows of cell strings, right-aligned per column) of what show_table shows."""
    rows = list(rows)
    if rows and all(isinstance(r, dict) for r in rows):
        keys = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows
                                                                             for k in r))
        values = [[r.get(k) for k in keys] for r in rows]
    elif columns is None:
        raise ValueError("rows given as lists need their column names: show_table(rows, columns)")
    else:
        keys, values = list(columns), [list(r) for r in rows]
        if any(len(r) != len(keys) for r in values):
            raise ValueError(f"each row needs {len(keys)} values, one per column {keys}")
    formats = formats or {}
    cells = [[_cell(v, formats.get(k)) for k, v in zip(keys, r, strict=True)] for r in values]
    right = [bool(col) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                               for v in col if v is not None)
             for col in zip(*values, strict=True)] if values else [False] * len(keys)
    return [str(k) for k in keys], cells, right


def table_text(rows, columns=None, *, title=None, formats=None, width: int = WIDTH) -> str:
    """The table of :func:`show_table` as aligned monospace text within ``width`` characters:
    columns two spaces apart, else one; if still too wide, the widest text columns wrap at
    spaces (numbers never do)."""
    header, cells, right = _table(rows, columns, formats)
    cols = list(zip(header, *cells, strict=True))
    widths = [max(len(c) for c in col) for col in cols]
    sep = "  " if sum(widths) + 2 * (len(widths) - 1) <= width else " "
    # how narrow each column may get: a text column down to its longest word, a number never
    floor = [w if r else max(len(word) for c in col for word in c.split() or [""])
             for col, w, r in zip(cols, widths, right, strict=True)]
    while sum(widths) + len(sep) * (len(widths) - 1) > width:
        i = max(range(len(widths)), key=lambda j: widths[j] - floor[j])
        if widths[i] <= floor[i]:
            break  # only numbers and single words left: the line stays long
        widths[i] -= 1

    def lines(row):
        parts = [textwrap.wrap(c, w, break_long_words=False) or [""]
                 for c, w in zip(row, widths, strict=True)]
        for k in range(max(len(p) for p in parts)):
            yield sep.join((p[k] if k < len(p) else "").rjust(w) if r else
                           (p[k] if k < len(p) else "").ljust(w)
                           for p, w, r in zip(parts, widths, right, strict=True)).rstrip()

    out = [wrap(title, width)] if title else []
    return "\n".join(out + [line for row in [header, *cells] for line in lines(row)])


def table_html(rows, columns=None, *, title=None, formats=None) -> str:
    """The same table as HTML: the same cells, numbers right-aligned, every text escaped."""
    header, cells, right = _table(rows, columns, formats)
    esc = html.escape
    pad = "padding:1px 10px"

    def row(values, tag, extra=""):
        return "<tr>" + "".join(
            f'<{tag} style="{pad};text-align:{"right" if r else "left"}{extra}">{esc(v)}</{tag}>'
            for v, r in zip(values, right, strict=True)) + "</tr>"

    caption = (f'<caption style="caption-side:top;text-align:left;font-weight:600;'
               f'padding:2px 0">{esc(title)}</caption>' if title else "")
    return (f'<table class="labkit-table" style="border-collapse:collapse;margin:4px 0;'
            f'font-family:var(--jp-code-font-family,monospace);'
            f'font-size:var(--jp-code-font-size,13px);font-variant-numeric:tabular-nums">'
            f'{caption}<thead>{row(header, "th", ";border-bottom:1px solid currentColor")}'
            f'</thead><tbody>{"".join(row(c, "td") for c in cells)}</tbody></table>')


def show_table(rows, columns=None, *, title=None, formats=None) -> None:
    """Show a table: in a Jupyter kernel as HTML (its text beside it, for logs and nbval),
    elsewhere (a terminal, a worker, a log) printed as aligned text within :data:`WIDTH`.

    ``rows``: dicts (``columns`` picks and orders their keys; default: every key) or lists
    (``columns`` names them). ``formats`` maps a column to a format spec (``",.0f"``), a
    template (``"{:.2f}x"``) or a callable; by default whole numbers get thousands separators
    and other numbers 4 significant figures. Numbers are right-aligned, ``None`` is blank.

    Example::

        >>> show_table([{"ranks": 2, "bytes": 1048576, "speedup": 1.93}],
        ...            formats={"speedup": "{:.2f}x"})
        ranks      bytes  speedup
            2  1,048,576    1.93x
    """
    show(table_text(rows, columns, title=title, formats=formats),
         table_html(rows, columns, title=title, formats=formats))


# A native library's log record, absl's and glog's "I0000 00:00:1796471032.925778  24127 x.cc:9]"
# (severity letter, then date and time). Lines after one that carry no such prefix continue it.
_NATIVE_RECORD = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")
_BEFORE_INIT = "WARNING: All log messages before absl::InitializeLog() is called are written to"


def is_native_info(line: str) -> bool:
    """``line`` is one native INFO record, or absl's notice that its logging is not set up yet."""
    if line.startswith(_BEFORE_INIT):
        return True
    return line.startswith("I") and bool(_NATIVE_RECORD.match(line))


def drop_native_info(text: str) -> str:
    """``text`` without the INFO records of native (absl, glog) logging and absl's notice that
    logging is not initialised yet; warnings, errors and anything else are kept whole."""
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        if line.startswith(_BEFORE_INIT) or _NATIVE_RECORD.match(line):  # a record begins
            dropping = is_native_info(line)
        if not dropping:
            kept.append(line)
    return "".join(kept)


@contextlib.contextmanager
def quiet_startup():
    """Import a framework without its C++ start-up chatter: TensorFlow logs INFO lines (oneDNN,
    CUDA drivers, CPU instructions) before its logging is set up, where ``TF_CPP_MIN_LOG_LEVEL``
    does not reach them. What native code writes to the process's stderr in the block is held
    back and written after it, less those INFO records: a warning or an error still shows.
    Python's own stderr (warnings, tracebacks) is not held: it goes out as it comes."""
    sys.stderr.flush()
    held = tempfile.TemporaryFile()
    saved = os.dup(2)
    python_stderr = sys.stderr
    # Outside a kernel, Python's sys.stderr is file descriptor 2 too: give it a copy of the real
    # one, so that a Python line is never taken for the continuation of a native record.
    # (A kernel's sys.stderr is its own stream, not descriptor 2.)
    direct = isinstance(sys.stderr, io.TextIOWrapper) and _fd(sys.stderr) == 2
    if direct:
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(saved), "wb"), write_through=True,
                                      encoding=python_stderr.encoding, errors="backslashreplace")
    os.dup2(held.fileno(), 2)
    try:
        yield
    finally:
        if direct:
            sys.stderr.close()
            sys.stderr = python_stderr
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        rest = drop_native_info(held.read().decode(errors="replace"))
        held.close()
        if rest:
            sys.stderr.write(rest)
            sys.stderr.flush()


def _fd(stream) -> int | None:
    try:
        return stream.fileno()
    except (OSError, ValueError, AttributeError):
        return None

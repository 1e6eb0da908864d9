"""Progress bars for loops that run inside launched workers: one bar per rank, in the cell.

``labkit.progress(iterable)`` wraps a loop the way tqdm does. In a worker started by
:func:`labkit.launch` it sends the loop's state to the notebook kernel as a marked line on the
rank's output, at most a few times a second however fast the loop runs; the launcher takes
those lines out of the output (they never reach ``result.logs``) and draws one bar per rank:
ipywidgets in Jupyter, a text line every 10 % elsewhere. Outside a launched worker the bar is
drawn right there. Nothing here imports torch.

Example::

    >>> def train(steps):
    ...     for step in labkit.progress(range(steps), desc="train"):
    ...         ...                                # one training step
    >>> labkit.launch(train, 200, nproc=2)         # two bars, rank 0 and rank 1
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import time

from ._protocol import CONTROLLER_PID

# A worker's progress line is MARKER + JSON on its stdout. ASCII's start- and end-of-text
# characters make it a string no program prints by chance, invisible if it reaches a terminal,
# and not a line break for str.splitlines (which the record separators \x1c-\x1e would be).
MARKER = "\x02labkit-progress\x03"
_INTERVAL = 0.25  # seconds between two updates of one bar: a few per second at most
_TEXT_EVERY = 5.0  # seconds: a text bar prints at least this often while it moves

_ids = itertools.count()
_active = 0  # progress loops running in this process, the outer ones first: a bar's row
_local: ProgressBars | None = None  # draws the bars of a process that is no launched worker


def progress(iterable, desc: str = "", total: int | None = None):
    """Iterate over ``iterable`` and show how far the loop has come, one bar per rank.

    In a function run by :func:`labkit.launch` every rank's loop gets its own bar in the
    notebook cell (``show_ranks`` hides the bars of the ranks it hides); a loop inside a loop
    gets a second row. ``total`` defaults to ``len(iterable)`` when it has one; without it the
    bar counts items. Elsewhere (a plain script, the notebook itself) the bar is drawn locally.

    Example::

        >>> import labkit
        >>> def train(epochs):
        ...     for epoch in labkit.progress(range(epochs), desc="epoch"):
        ...         for batch in labkit.progress(loader, desc="batch"):
        ...             ...
        >>> labkit.launch(train, 3, nproc=2)
        >>> for x in labkit.progress(range(1000)):  # in the notebook itself: a local bar
        ...     pass
    """
    if total is None:
        try:
            total = len(iterable)
        except TypeError:  # a generator: count the items
            total = None
    return _iterate(iterable, str(desc), total)


def _iterate(iterable, desc: str, total: int | None):
    global _active, _local
    rank = launched_rank()
    if rank is None:
        if _local is None or _active == 0:  # a new outer loop: new bars
            _local = ProgressBars()
        bars = _local
        emit = lambda update: bars.update(None, update)  # noqa: E731
    else:
        emit = _write_line
    bar = _Bar(emit, {"id": next(_ids), "pos": _active, "desc": desc, "total": total})
    _active += 1
    n = 0
    try:
        bar.report(0, force=True)  # the bar appears as the loop starts, however slow its items
        for item in iterable:
            yield item
            n += 1
            bar.report(n)
    finally:  # also after a break or an exception in the loop body
        _active -= 1
        bar.report(n, done=True)
        if rank is None and _active == 0:  # the outer loop ended: its bars become a summary
            bars.finish()


class _Bar:
    """One loop's state, passed on at most every _INTERVAL seconds, and always at the end."""

    def __init__(self, emit, fields: dict):
        self.emit, self.fields = emit, fields
        self.start = time.monotonic()
        self.last = None

    def report(self, n: int, force: bool = False, done: bool = False) -> None:
        now = time.monotonic()
        total = self.fields["total"]
        if not (force or done) and (now - self.last < _INTERVAL or (total and n >= total)):
            return  # too soon, or the last item: the final update follows at once
        self.last = now
        self.emit(dict(self.fields, n=n, elapsed=round(now - self.start, 3), done=done))


def launched_rank() -> int | None:
    """This process's rank when :func:`labkit.launch` started it, else None."""
    # The launcher marks its workers (and their own subprocesses, DataLoader workers) with
    # LABKIT_CONTROLLER_PID; their stdout is the pipe the launcher reads.
    if CONTROLLER_PID not in os.environ or "RANK" not in os.environ:
        return None
    try:
        return int(os.environ["RANK"])
    except ValueError:
        return None


def encode_update(update: dict) -> str:
    """A progress line: the marker and the update as one line of JSON."""
    return MARKER + json.dumps(update, separators=(",", ":"))


def decode_update(text: str) -> dict | None:
    """The update in a progress line (with or without its marker); None if it is not one."""
    if text.startswith(MARKER):
        text = text[len(MARKER):]
    try:
        update = json.loads(text)
    except ValueError:
        return None
    return update if isinstance(update, dict) and isinstance(update.get("n"), int) else None


def _write_line(update: dict) -> None:
    # Straight to fd 1, where the worker's output pump reads: a user's redirect_stdout must not
    # catch it. Python's own buffers are flushed first, so the line comes after what was printed.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    try:
        os.write(1, (encode_update(update) + "\n").encode())
    except OSError:
        pass


def _notebook_widgets() -> bool:
    """True in a Jupyter kernel that has ipywidgets: only there do widgets show."""
    ipython = sys.modules.get("IPython")  # not imported: not in IPython, and no need to import it
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:  # a terminal IPython has none
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


class ProgressBars:
    """Draws the progress of a run's ranks: one row per rank (and per loop inside a loop).

    :func:`labkit.launch` makes one per run and passes it every progress line it reads from
    the workers (``feed``). ``widgets=None`` picks ipywidgets rows (a label, an ``IntProgress``
    and a status in an ``HBox``) in a Jupyter kernel with ipywidgets, and text lines (every
    10 %, every few seconds, and at the end) anywhere else; each row appears with its rank's
    first update. ``rows`` maps ``(rank, loop depth)`` to the row's ``HBox`` (widgets) or its
    last state (text).

    A launch that starts workers says so at once (``starting``) and how long they took once
    they are up (``ready``): the first line of the widgets, or a text line. ``finish`` ends the
    display: the widgets are replaced by a static summary (HTML and text) of where every bar
    ended, so the saved notebook, GitHub and nbviewer show the run's progress, not a widget
    that needs the kernel which drew it.

    Example::

        >>> bars = ProgressBars(widgets=False)
        >>> bars.update(1, {"id": 0, "n": 50, "total": 50, "desc": "train", "elapsed": 2.0,
        ...                 "done": True})
        [rank1] train: 50/50 (100%) in 2.0 s, 25.0 it/s
    """

    def __init__(self, widgets: bool | None = None):
        self.widgets = widgets
        self.box = None  # the ipywidgets VBox of all rows, shown with the first update
        self.handle = None  # its display handle: the summary replaces it at the end
        self.rows: dict[tuple, object] = {}
        self.last: dict[tuple, tuple] = {}  # (rank, depth) -> (rank, its last update)
        self.header = ""  # "starting 2 workers ... ready in 3.1 s"
        self.header_label = None
        self.began: float | None = None
        self.pending = False  # a text "starting ..." line waits for its end
        self.finished = False

    def _use_widgets(self) -> bool:
        if self.widgets is None:
            self.widgets = _notebook_widgets()
        return self.widgets

    def starting(self, nproc: int) -> None:
        """Say that ``nproc`` workers are starting: at once, before any of them is up."""
        self.began, self.workers = time.monotonic(), f"{nproc} worker{'s' if nproc != 1 else ''}"
        self.header = f"starting {self.workers} ..."
        if self._use_widgets():
            self._show_header()
        elif threading.current_thread() is threading.main_thread():
            # The line ends when they are ready, or before anything else is printed.
            print(f"[labkit] {self.header}", end="", flush=True)
            self.pending = True
        else:  # runs started together (threads) print at once: whole lines only
            _say(f"[labkit] {self.header}")

    def ready(self) -> None:
        """Say how long the workers took to start, once every one is up."""
        if self.began is None or "ready in" in self.header:
            return
        seconds = time.monotonic() - self.began
        self.header += f" ready in {seconds:.1f} s"
        if self.widgets:
            self._show_header()
        elif self.pending:
            print(f" ready in {seconds:.1f} s", flush=True)
            self.pending = False
        else:  # something came between: a line of its own
            _say(f"[labkit] {self.workers} ready in {seconds:.1f} s")

    def end_line(self) -> None:
        """End a text "starting ..." line: something else is about to be printed."""
        if self.pending:
            print(flush=True)
            self.pending = False

    def finish(self) -> None:
        """The run is over: leave a static summary in place of the widgets (text: end the line)."""
        if self.finished:
            return
        self.finished = True
        if self.began is not None and "ready in" not in self.header:
            self.header += f" stopped after {time.monotonic() - self.began:.1f} s"
            if self.widgets:
                self._show_header()
        self.end_line()
        if self.handle is not None:
            self.handle.update(self.summary(), raw=True)
        if self.box is not None:  # shown nowhere now: no state of theirs to keep or save
            for row in self.rows.values():
                for child in row.children:
                    child.close()
                row.close()
            if self.header_label is not None:
                self.header_label.close()
            self.box.close()

    def summary(self) -> dict:
        """Where every bar ended, as ``text/plain`` and ``text/html``."""
        import html

        lines, rows = [], []
        if self.header:
            lines.append(self.header)
            rows.append(f"<tr><td colspan='3' style='text-align:left'>{html.escape(self.header)}"
                        "</td></tr>")
        for key in sorted(self.last):
            rank, update = self.last[key]
            name, status = _name(rank, update.get("desc", "")), _status(update)
            total, n = update.get("total"), update["n"]
            lines.append(f"{name}: {status}")
            most = max(total or n, 1)
            colour = _COLOURS[_style(update)]
            rows.append(f"<tr><td>{html.escape(name)}</td><td><progress value='{min(n, most)}' "
                        f"max='{most}' style='accent-color: {colour}'></progress></td>"
                        f"<td>{html.escape(status)}</td></tr>")
        return {"text/plain": "\n".join(lines) or "(no progress reported)",
                "text/html": "<table>" + "".join(rows) + "</table>"}

    def feed(self, rank: int | None, text: str) -> None:
        """Take one progress line (its text after the rank prefix) from ``rank``."""
        update = decode_update(text)
        if update is not None:
            self.update(rank, update)

    def update(self, rank: int | None, update: dict) -> None:
        """Show ``update`` (n, total, desc, elapsed, done) on the row of ``rank``."""
        key = (-1 if rank is None else rank, int(update.get("pos", 0)))
        self.last[key] = (rank, update)
        if self._use_widgets():
            self._widget_update(key, rank, update)
        else:
            self._text_update(key, rank, update)

    def _show(self) -> None:
        """Display the widgets' box (once), updatable in place by its display handle."""
        if self.box is not None:
            return
        import ipywidgets as w
        from IPython.display import display

        self.box = w.VBox()
        bundle = self.box._repr_mimebundle_()
        # What a reader without the live widget sees if the run never finished (kernel gone).
        bundle["text/plain"] = "progress bars of a run (live while it runs; run the cell again)"
        self.handle = display(bundle, raw=True, display_id=True)

    def _layout(self) -> None:
        heads = () if self.header_label is None else (self.header_label,)
        self.box.children = heads + tuple(self.rows[k] for k in sorted(self.rows))

    def _show_header(self) -> None:
        import ipywidgets as w

        self._show()
        if self.header_label is None:
            self.header_label = w.Label()
            self._layout()
        self.header_label.value = self.header

    def _widget_update(self, key: tuple, rank: int | None, update: dict) -> None:
        import ipywidgets as w

        row = self.rows.get(key)
        if row is None:
            row = w.HBox([w.Label(), w.IntProgress(min=0, max=1), w.Label()])
            self.rows[key] = row
            self._show()
            self._layout()
        label, bar, status = row.children
        n, total = update["n"], update.get("total")
        label.value = _name(rank, update.get("desc", ""))
        bar.max = max(total or n, 1)  # the max first: IntProgress clips value to it
        bar.value = min(n, bar.max)
        bar.bar_style = _style(update)
        status.value = _status(update)

    def _text_update(self, key: tuple, rank: int | None, update: dict) -> None:
        state = self.rows.get(key)
        if state is None or state["id"] != update.get("id"):  # a new loop on this row
            state = self.rows[key] = {"id": update.get("id"), "tenth": 0, "n": 0,
                                      "at": time.monotonic()}
        n, total, now = update["n"], update.get("total"), time.monotonic()
        tenth = n * 10 // total if total else 0
        due = (update.get("done") or tenth > state["tenth"]
               or (n > state["n"] and now - state["at"] >= _TEXT_EVERY))
        if not due:
            return
        state.update(tenth=tenth, n=n, at=now)
        self.end_line()
        prefix = "" if rank is None else f"[rank{rank}] "
        print(f"{prefix}{update.get('desc') or 'progress'}: {_status(update)}", flush=True)


def _say(line: str) -> None:
    """Print ``line`` in one write: print() writes its end apart, so another thread's line
    could come between the two."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _name(rank: int | None, desc: str) -> str:
    if rank is None:
        return desc or "progress"
    return f"rank {rank}" + (f" {desc}" if desc else "")


# The saved bars take the colours the live ones ended with: JupyterLab's theme variables that
# ipywidgets' bar styles use, with their light-theme values where no JupyterLab theme is loaded.
_COLOURS = {"": "var(--jp-brand-color1, #1976d2)", "success": "var(--jp-success-color1, #388e3c)",
            "warning": "var(--jp-warn-color1, #f57c00)"}


def _style(update: dict) -> str:
    """ipywidgets' bar colour: green once done, orange when the loop stopped early."""
    if not update.get("done"):
        return ""
    total = update.get("total")
    return "warning" if total and update["n"] < total else "success"


def _status(update: dict) -> str:
    """``25/50 (50%) 1.2 s, 20.8 it/s``; ``in`` once done; a count alone without a total."""
    n, total, elapsed = update["n"], update.get("total"), float(update.get("elapsed", 0.0))
    done = update.get("done")
    count = f"{n}/{total} ({100 * n // total}%)" if total else f"{n} items"
    if done and total and n < total:
        count += " stopped early"
    rate = ""
    if n and elapsed > 0:
        rate = f", {n / elapsed:.1f} it/s" if n >= elapsed else f", {elapsed / n:.2f} s/it"
    return f"{count} {'in ' if done else ''}{elapsed:.1f} s{rate}"

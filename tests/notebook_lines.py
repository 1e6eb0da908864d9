"""pytest plugin for the notebook run (``-p tests.notebook_lines``): no printed line over 100.

nbval makes one test item per cell and keeps what the cell's run sent back on the item
(``item.test_outputs``). A cell whose text output has a line longer than :data:`MAX` characters
fails, naming the line and its length: the learner reads it in an output area that wraps it
mid-word, or scrolls for it.

What counts is the text the learner reads as text: stream output (stdout, stderr) and the
``text/plain`` of a result or display that has nothing richer to show. An HTML table, an image
or a verdict's badge is shown instead of its ``text/plain``, so that does not count, and
neither does a traceback (Python's to format), nor a library's log record or warning
(torch's ``W1202 15:37:15 ...`` lines, ``.../site-packages/x.py:3: UserWarning: ...``): their
text is theirs, as are the frames of a printed traceback or stack (``File "...", line 7``). A
warning raised at a line of labkit counts: labkit can fix it. A progress line rewritten with
``\\r`` counts as the text left on screen. ANSI colour codes take no room.

A cell also fails when a native library's INFO record reaches the learner (TensorFlow's start-up
lines about oneDNN or CUDA drivers, written before its logging is set up, in the kernel or from
a rank): noise the learner would have to learn to ignore. ``labkit.quiet_startup()`` holds them
back in the kernel; a TensorFlow run's controller does not show them.

ipykernel forwards what native code writes to file descriptors 1 and 2 (TensorFlow's C++ log,
a library's warning) into the cell's output, as JupyterLab shows it, except in a kernel whose
environment has ``PYTEST_CURRENT_TEST``, as every kernel nbval starts does. The plugin starts
nbval's kernels without it, so the checks read what the learner reads.
"""

from __future__ import annotations

import os
import re

import pytest

from labkit._display import is_native_info

MAX = 100
# A display with one of these is shown as that, not as its text/plain.
_RICHER = ("text/html", "text/markdown", "text/latex", "image/png", "image/jpeg", "image/svg+xml",
           "application/javascript")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# A rank's prefix on its lines, as the controller prints them ("[rank0] ", torch's "[rank0]:")
_RANK = r"\[rank\d+\]:? ?"
# glog's format, which torch and TensorFlow log in, as a rank's output shows it too
# ("[rank0]:[E1202 15:42:14 ...", "[rank0] I0000 00:00:1796227092 ...")
_LOG_RECORD = re.compile(rf"({_RANK})?\[?[IWEF]\d{{4}} \d\d:\d\d:\d\d")
# A traceback's or a stack dump's frame, printed (a rank's failure, a hang's stacks): the path
# is the installation's
_FRAME = re.compile(r'\s*File "[^"]+", line \d+')
_WARNING = re.compile(r"(?P<file>\S+\.py):\d+: \w*Warning: ")


def pytest_configure(config):
    import nbval.kernel

    start = nbval.kernel.RunningKernel.__init__
    if getattr(start, "_labkit_fd_output", False):
        return

    def start_with_fd_output(self, *args, **kwargs):
        hidden = os.environ.pop("PYTEST_CURRENT_TEST", None)
        try:
            start(self, *args, **kwargs)
        finally:
            if hidden is not None:
                os.environ["PYTEST_CURRENT_TEST"] = hidden

    start_with_fd_output._labkit_fd_output = True
    nbval.kernel.RunningKernel.__init__ = start_with_fd_output


def _theirs(line: str) -> bool:
    """A library's log record or warning (not one raised at a line of labkit)."""
    if _LOG_RECORD.match(line) or _FRAME.match(line):
        return True
    m = _WARNING.match(line)
    return bool(m) and "/labkit/" not in m["file"].replace("\\", "/")


def shown_lines(outputs) -> list[str]:
    """The lines of text a learner reads in a cell's outputs (nbformat output dicts)."""
    lines: list[str] = []
    for out in outputs or ():
        kind = out.get("output_type")
        if kind == "stream":
            text = out.get("text", "")
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if any(mime in data for mime in _RICHER):
                continue
            text = data.get("text/plain", "")
        else:  # an error's traceback, or anything else
            continue
        if isinstance(text, list):
            text = "".join(text)
        for line in _ANSI.sub("", text).split("\n"):
            line = line.rsplit("\r", 1)[-1] if "\r" in line.rstrip("\r") else line.rstrip("\r")
            if not (kind == "stream" and _theirs(line)):
                lines.append(line)
    return lines


def native_info(outputs) -> list[str]:
    """The stream lines of ``outputs`` that are a native INFO record (a rank's prefix aside)."""
    found = []
    for out in outputs or ():
        if out.get("output_type") == "stream":
            text = out.get("text", "")
            for line in ("".join(text) if isinstance(text, list) else text).split("\n"):
                bare = re.sub(f"^{_RANK}", "", _ANSI.sub("", line), count=1)
                if is_native_info(bare):
                    found.append(line)
    return found


def too_long(outputs, limit: int = MAX) -> list[tuple[int, str]]:
    """``(length, line)`` of each shown line over ``limit`` characters."""
    return [(len(line), line) for line in shown_lines(outputs) if len(line) > limit]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.when != "call" or not report.passed or not item.nodeid.split("::")[0].endswith(
            ".ipynb"):
        return
    outputs = getattr(item, "test_outputs", None)
    chatter = native_info(outputs)
    if chatter:
        report.outcome = "failed"
        report.longrepr = (f"this cell showed {len(chatter)} native INFO log line(s), start-up "
                           "noise the learner need not read; import the framework inside "
                           "`with labkit.quiet_startup():`:\n  " + "\n  ".join(chatter[:5]))
        return
    long = too_long(outputs)
    if long:
        report.outcome = "failed"
        shown = "\n".join(f"  {n} characters: {line[:160]}{'...' if n > 160 else ''}"
                          for n, line in long[:5])
        more = f"\n  ... and {len(long) - 5} more" if len(long) > 5 else ""
        report.longrepr = (f"this cell printed {len(long)} line(s) over {MAX} characters (the "
                           f"learner's output area wraps them mid-word); shorten them where "
                           f"they are printed:\n{shown}{more}")

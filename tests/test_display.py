"""labkit.show_table: one table, HTML in a Jupyter kernel and the same cells as text elsewhere;
labkit.quiet_startup: a framework imported without its native INFO start-up lines."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from html.parser import HTMLParser

import pytest

import labkit
from labkit import _display
from labkit._display import WIDTH, show_table, table_html, table_text

ROWS = [{"layout": "dp=8", "ranks": 8, "bytes": 1234567, "ratio": 1.0, "note": "exact"},
        {"layout": "tp=8 x pp=4", "ranks": 32, "bytes": 987, "ratio": 0.98765, "note": None}]


class _Cells(HTMLParser):
    """The text of each <th>/<td>, row by row, and the caption."""

    def __init__(self):
        super().__init__()
        self.rows, self.caption, self._in = [], None, None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th", "caption"):
            self._in = tag
            if tag != "caption":
                self.rows[-1].append(("", dict(attrs).get("style", "")))

    def handle_endtag(self, tag):
        self._in = None if tag in ("td", "th", "caption") else self._in

    def handle_data(self, data):
        if self._in == "caption":
            self.caption = (self.caption or "") + data
        elif self._in:
            text, style = self.rows[-1][-1]
            self.rows[-1][-1] = (text + data, style)


def _html_cells(markup):
    parser = _Cells()
    parser.feed(markup)
    return parser


def test_numbers_are_formatted_and_right_aligned_text_left_aligned():
    assert table_text(ROWS).splitlines() == [
        "layout       ranks      bytes   ratio  note",
        "dp=8             8  1,234,567       1  exact",  # thousands apart, under their header
        "tp=8 x pp=4     32        987  0.9877",  # 4 significant figures; None is blank
    ]


def test_formats_take_a_spec_a_template_or_a_callable():
    text = table_text(ROWS, ["layout", "bytes", "ratio", "ranks"],
                      formats={"bytes": ",.1f", "ratio": "{:.2f}x", "ranks": lambda n: f"#{n}"})
    lines = text.splitlines()
    assert lines[0].split() == ["layout", "bytes", "ratio", "ranks"]  # columns pick and order
    assert "1,234,567.0" in lines[1] and "1.00x" in lines[1] and lines[1].endswith("#8")
    assert "0.99x" in lines[2] and lines[2].endswith("#32")
    rows = [["a", 12345.678, 3], ["b", 2.5e-07, True]]  # lists, named by columns
    lines = table_text(rows, ["name", "x", "flag"]).splitlines()
    assert lines[1].split() == ["a", "12,346", "3"] and lines[2].split() == ["b", "2.5e-07", "True"]


def test_the_html_shows_the_same_cells_as_the_text(monkeypatch):
    text = table_text(ROWS, title="bytes per rank")
    parsed = _html_cells(table_html(ROWS, title="bytes per rank"))
    assert parsed.caption == "bytes per rank" and text.splitlines()[0] == "bytes per rank"
    html_rows = [[cell for cell, _ in row] for row in parsed.rows]
    text_rows = [re.split(r" {2,}", line.strip()) for line in text.splitlines()[1:]]
    assert [[c for c in row if c] for row in html_rows] == text_rows
    aligned = [style.split("text-align:")[1].split(";")[0] for _, style in parsed.rows[1]]
    assert aligned == ["left", "right", "right", "right", "left"]  # numbers right, as the text


def test_the_html_escapes_every_text():
    markup = table_html([["<script>alert(1)</script>", 'say "a < b" & go']],
                        ["<b>col</b>", "note"], title="<i>t</i> & more")
    assert "<script>" not in markup and "<b>col</b>" not in markup and "<i>t</i>" not in markup
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in markup
    assert "say &quot;a &lt; b&quot; &amp; go" in markup
    assert "&lt;i&gt;t&lt;/i&gt; &amp; more" in markup
    parsed = _html_cells(markup)
    assert parsed.rows[1][0][0] == "<script>alert(1)</script>"  # the text itself is unchanged


def test_a_wide_table_wraps_its_text_within_the_width_and_never_splits_a_number():
    note = "the planner divides these by tp but every tp rank holds them whole " * 2
    rows = [["70B, tp=8 x pp=4 x dp=2 with ZeRO-1, 8 micro-batches", 123456789012, note],
            ["7B", 5, "short"]]
    lines = table_text(rows, ["layout", "bytes", "why"]).splitlines()
    assert max(len(line) for line in lines) <= WIDTH
    assert sum("123,456,789,012" in line for line in lines) == 1
    assert " ".join(" ".join(lines).split()).count("holds them whole") == 2  # words kept whole
    assert lines[0].split() == ["layout", "bytes", "why"]


def test_outside_a_kernel_it_prints_the_text_table(capsys, displayed):
    assert not _display.in_kernel()
    assert labkit.show_table is show_table
    show_table(ROWS, title="bytes per rank")
    assert capsys.readouterr().out == table_text(ROWS, title="bytes per rank") + "\n"
    assert displayed == []


def test_in_a_kernel_it_displays_one_bundle_with_html_and_the_text(capsys, displayed,
                                                                    monkeypatch):
    monkeypatch.setattr(_display, "in_kernel", lambda: True)
    show_table(ROWS, ["layout", "bytes"], formats={"bytes": ",.0f"})
    assert capsys.readouterr().out == ""  # displayed, not printed as well
    (data, handle), = displayed
    assert handle is None and set(data) == {"text/plain", "text/html"}
    assert data["text/plain"] == table_text(ROWS, ["layout", "bytes"], formats={"bytes": ",.0f"})
    assert data["text/html"].startswith('<table class="labkit-table"')
    assert ">1,234,567</td>" in data["text/html"]


def test_rows_as_lists_need_their_columns():
    with pytest.raises(ValueError, match="need their column names"):
        table_text([[1, 2]])
    with pytest.raises(ValueError, match="each row needs 2 values"):
        table_text([[1, 2, 3]], ["a", "b"])


# ---- a framework's native start-up lines ------------------------------------------------------

TF_START_UP = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796471032.925778   24127 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1796471033.268191   24127 cpu_feature_guard.cc:227] This TensorFlow binary is optimized.
To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow.
W0000 00:00:1796471033.300000   24127 gpu_device.cc:2] Cannot dlopen GPU libraries.
a line of the learner's own
E1205 11:40:00.000001   24127 main.cc:9] something failed
  its second line
I1205 11:40:00.000002   24127 main.cc:9] more chatter
"""


def test_native_info_records_are_dropped_with_their_continuation_lines_and_the_rest_kept():
    assert _display.drop_native_info(TF_START_UP) == (
        "W0000 00:00:1796471033.300000   24127 gpu_device.cc:2] Cannot dlopen GPU libraries.\n"
        "a line of the learner's own\n"
        "E1205 11:40:00.000001   24127 main.cc:9] something failed\n"
        "  its second line\n")
    assert _display.drop_native_info("no record here\n") == "no record here\n"
    assert _display.drop_native_info("") == ""


def test_quiet_startup_holds_back_the_native_info_lines_and_writes_the_rest_after(tmp_path):
    # A child process, as a kernel is: the lines go to file descriptor 2, below Python.
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        import labkit
        with labkit.quiet_startup():
            os.write(2, {TF_START_UP.encode()!r})
            print("python's own warning", file=sys.stderr)
        os.write(2, b"I0000 00:00:1.0 1 after.cc:1] after the block, untouched\\n")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stderr.splitlines() == [
        "python's own warning",  # at once: a Python line is never held back
        "W0000 00:00:1796471033.300000   24127 gpu_device.cc:2] Cannot dlopen GPU libraries.",
        "a line of the learner's own",
        "E1205 11:40:00.000001   24127 main.cc:9] something failed",
        "  its second line",
        "I0000 00:00:1.0 1 after.cc:1] after the block, untouched"]


def test_quiet_startup_restores_stderr_when_the_block_raises(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent("""
        import os
        import labkit
        try:
            with labkit.quiet_startup():
                os.write(2, b"E0000 00:00:1.0 1 x.cc:1] kept\\n")
                raise ImportError("no such framework")
        except ImportError as exc:
            os.write(2, f"then: {exc}\\n".encode())
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stderr.splitlines() == ["E0000 00:00:1.0 1 x.cc:1] kept",
                                        "then: no such framework"]


def test_a_tensorflow_runs_native_info_lines_are_kept_in_its_logs_but_not_shown(capsys):
    from labkit._engine import _Output

    lines = ["[rank0] " + _display._BEFORE_INIT + " STDERR",
             "[rank0] I0000 00:00:1796471032.925778   24127 port.cc:153] oneDNN custom operations",
             "[rank1] W0000 00:00:1796471033.300000   24127 gpu_device.cc:2] Cannot dlopen GPU",
             "[rank1] epoch 1: loss 0.5"]
    for quiet in (True, False):
        out = _Output(None, quiet_native_info=quiet)
        for line in lines:
            out.route(line)
        out.flush()
        assert out.logs == {0: [line.partition("] ")[2] for line in lines[:2]],
                            1: [line.partition("] ")[2] for line in lines[2:]]}
        shown = capsys.readouterr().out.splitlines()
        assert shown == (lines[2:] if quiet else lines), "a torch run shows every line"

"""tests.notebook_lines: a notebook cell that prints a line over 100 characters fails, naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat

from tests import notebook_lines

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_text_a_learner_reads_counts():
    long = "x" * 150
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "short\n" + "y" * 101 + "\n"},
        {"output_type": "stream", "name": "stdout", "text": ["\x1b[32m" + "z" * 100 + "\x1b[0m\n"]},
        {"output_type": "stream", "name": "stderr", "text": long + "\rdone\n"},  # overwritten
        {"output_type": "display_data", "data": {"text/plain": long, "text/html": "<b>x</b>"}},
        {"output_type": "display_data", "data": {"text/plain": long, "image/png": "..."}},
        {"output_type": "execute_result", "data": {"text/plain": "w" * 120}},
        {"output_type": "error", "ename": "E", "evalue": "", "traceback": [long]},
        {"output_type": "stream", "name": "stderr",  # a library's: not labkit's to shorten
         "text": "W1202 15:37:15.755000 8297 torch/utils/cpp_extension.py:183] " + long + "\n"
                 "/venv/site-packages/torch/x.py:7: UserWarning: " + long + "\n"},
        {"output_type": "stream", "name": "stdout",  # a rank's log record, a hang's stack
         "text": "[rank0]:[E1202 15:42:14.408536869 ProcessGroupGloo.cpp:2948] " + long + "\n"
                 "[rank1] I0000 00:00:1796227092.064737   18326 port.cc:153] " + long + "\n"
                 '  File "/venv/site-packages/torch/' + long + '.py", line 3913 in x\n'},
        {"output_type": "stream", "name": "stderr",  # raised at labkit's line: labkit can fix it
         "text": "/work/labkit/plots/a.py:77: UserWarning: " + "v" * 80 + "\n"},
    ]
    assert notebook_lines.too_long(outputs) == [(101, "y" * 101), (120, "w" * 120),
                                                (121, "/work/labkit/plots/a.py:77: UserWarning: "
                                                 + "v" * 80)]


def test_a_cell_printing_150_characters_or_native_info_fails_one_printing_90_passes(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("print('a' * 90)"),
        nbformat.v4.new_code_cell("print('fits')\nprint('b' * 150)"),
        nbformat.v4.new_code_cell("'c' * 95"),
        # A native INFO record shown, in the kernel's stderr and from a rank: fails.
        nbformat.v4.new_code_cell(
            "import sys\n"
            "print('I0000 00:00:1796471032.925778  24127 port.cc:153] oneDNN', file=sys.stderr)\n"
            "print('[rank1] I0000 00:00:1796471032.925778  24127 cudart_stub.cc:31] no CUDA')\n"
            "print('W0000 00:00:1796471032.925778  24127 x.cc:1] a warning', file=sys.stderr)"),
        # Held back by quiet_startup: passes.
        nbformat.v4.new_code_cell(
            "import os\nimport labkit\nwith labkit.quiet_startup():\n"
            "    os.write(2, b'I0000 00:00:1796471032.925778  24127 port.cc:153] oneDNN\\n')\n"
            "print('imported')")])
    nbformat.write(nb, tmp_path / "99_lines.ipynb")
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.notebook_lines", "--nbval-lax",
           "--nbval-current-env", "-p", "no:cacheprovider", "-rf", str(tmp_path / "99_lines.ipynb")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout
    assert "2 failed, 3 passed" in run.stdout, run.stdout
    assert "99_lines.ipynb::Cell 1" in run.stdout
    assert "99_lines.ipynb::Cell 3" in run.stdout and "Cell 4" not in run.stdout
    assert "this cell showed 2 native INFO log line(s)" in run.stdout
    assert "[rank1] I0000 00:00:1796471032.925778  24127 cudart_stub.cc:31] no CUDA" in run.stdout
    assert "1 line(s) over 100 characters" in run.stdout
    assert f"150 characters: {'b' * 150}" in run.stdout

"""Every notebook: valid nbformat, committed without outputs, one framework per kernel."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TORCH = re.compile(r"^\s*(import|from)\s+(torch|torchvision)\b", re.M)
TENSORFLOW = re.compile(r"^\s*(import|from)\s+(tensorflow|keras|tf_keras)\b", re.M)


def code_of(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


@pytest.fixture(params=NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def notebook(request):
    return request.param, nbformat.read(request.param, as_version=4)


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


def test_valid_nbformat(notebook):
    path, nb = notebook
    nbformat.validate(nb)
    assert re.match(r"\d\d_[a-z0-9_]+\.ipynb$", path.name), "name notebooks NN_topic.ipynb"


def test_outputs_stripped(notebook):
    path, nb = notebook
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; run `nbstripout {path}`"
    assert "widgets" not in nb.metadata, f"{path.name}: widget state saved; run nbstripout"


def test_one_framework_per_kernel(notebook):
    path, nb = notebook
    code = code_of(nb)
    assert not (TORCH.search(code) and TENSORFLOW.search(code)), (
        f"{path.name} imports torch and tensorflow: importing torchvision after TensorFlow in one "
        "process crashes; split it into a PyTorch and a TensorFlow notebook")


def test_notebook_asserts_its_results(notebook):
    path, nb = notebook
    assert re.search(r"^\s*assert\b", code_of(nb), re.M), f"{path.name} checks nothing in code"


def test_framework_check_catches_a_mixed_notebook():
    mixed = "import torch\nx = 1\nimport tensorflow as tf\n"
    assert TORCH.search(mixed) and TENSORFLOW.search(mixed)
    assert not TENSORFLOW.search("import torch\n# import tensorflow is mentioned in a comment\n")


def test_budget_plugin_times_and_fails_a_slow_notebook(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import time; time.sleep(0.5)"),
                                         nbformat.v4.new_code_cell("assert 1 + 1 == 2")])
    nbformat.write(nb, tmp_path / "99_slow.ipynb")
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.notebook_budget", "--nbval-lax",
           "--nbval-current-env", "-p", "no:cacheprovider", str(tmp_path / "99_slow.ipynb")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    over = subprocess.run(cmd, env=env | {"LABKIT_NOTEBOOK_BUDGET": "0.2"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert over.returncode == 1, over.stdout
    assert "over its budget of 0.2 s" in over.stdout and "OVER BUDGET" in over.stdout
    within = subprocess.run(cmd, env=env | {"LABKIT_NOTEBOOK_BUDGET": "120"}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert within.returncode == 0, within.stdout
    assert re.search(r"\d+\.\d s  .*99_slow\.ipynb", within.stdout)
    bad = subprocess.run(cmd, env=env | {"LABKIT_NOTEBOOK_BUDGET": "soon"}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "is not a number of seconds" in bad.stdout + bad.stderr


def test_makefile_runs_notebooks_single_threaded_with_a_cell_timeout():
    make = (ROOT / "Makefile").read_text()
    assert "OMP_NUM_THREADS=1" in make and "--nbval-cell-timeout" in make
    assert "-p tests.notebook_budget" in textwrap.dedent(make)

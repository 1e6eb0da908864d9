"""Every notebook: valid nbformat, committed without outputs, one framework per kernel."""

from __future__ import annotations

import builtins
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
    # over budget on an xdist worker: the verdict where the cells run, the table where they report
    over = subprocess.run([*cmd, "-n", "1"], env=env | {"LABKIT_NOTEBOOK_BUDGET": "0.2"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert over.returncode == 1, over.stdout
    assert "over its budget of 0.2 s" in over.stdout and "OVER BUDGET" in over.stdout
    within = subprocess.run(cmd, env=env | {"LABKIT_NOTEBOOK_BUDGET": "120"}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert within.returncode == 0, within.stdout
    assert re.search(r"\d+\.\d s    2 cells  .*99_slow\.ipynb", within.stdout)
    bad = subprocess.run(cmd, env=env | {"LABKIT_NOTEBOOK_BUDGET": "soon"}, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "is not a number of seconds" in bad.stdout + bad.stderr


def test_makefile_runs_notebooks_single_threaded_with_a_cell_timeout():
    make = (ROOT / "Makefile").read_text()
    assert "OMP_NUM_THREADS=1" in make and "--nbval-cell-timeout" in make
    assert "-p tests.notebook_budget" in textwrap.dedent(make)


# ---- tests.solution_cells: a solution notebook runs what its solutions change -----------------

COURSE = ["import math\nN = 4",                                   # 0 set-up
          "table = [math.sqrt(i) for i in range(N)]",             # 1 read by the check below
          "slow = sum(range(10**6))",                             # 2 unrelated to the exercise
          "log = []",                                             # 3 changed in place below
          "log.append(N)",                                        # 4
          "# EXERCISE ex\ndef my_f(x):\n    raise NotImplementedError('your code here')",
          "v = check(my_f, table, log)",                          # 6 the check
          "f = my_f if v else math.sqrt\nprint(f(N))",            # 7 uses the learner's answer
          "print(slow)"]                                          # 8 unchanged by any of it
SOLVED = COURSE[:5] + ["# EXERCISE ex (solution)\ndef my_f(x):\n    return x ** 0.5"] + \
    COURSE[6:] + ["check.assert_passed(['ex'])"]


def test_a_solution_notebook_runs_its_solutions_what_they_need_and_what_uses_them():
    from tests.solution_cells import cells_to_run

    assert cells_to_run(SOLVED, COURSE) == {0, 1, 3, 4, 5, 6, 7, 9}  # not 2, not 8
    # the same notebook beside a course that differs everywhere: every cell runs
    assert cells_to_run(SOLVED, []) == set(range(len(SOLVED)))


def test_solution_cells_follow_names_through_functions_comprehensions_and_changes():
    from tests.solution_cells import CellNames, cells_to_run

    cell = CellNames("def g(y):\n    return y + OFFSET\n\nrows = [g(r) for r in data]\n"
                     "rows.sort()\nmodel.fit(rows)\nimport numpy as np\nnp.save('x', rows)")
    assert cell.reads == {"OFFSET", "data", "model"}   # y, r are local; rows bound before read
    assert cell.defines == {"g", "rows", "np"} and cell.changes >= {"rows", "model"}
    loops = CellNames("for ax, name in zip(axes, names):\n    ax.set_title(name)\n"
                      "with open(path) as f:\n    text = f.read()\n"
                      "try:\n    n = int(text)\nexcept ValueError as err:\n    print(err)")
    builtin = set(dir(builtins))
    assert loops.reads - builtin == {"axes", "names", "path"}  # targets bound before the body
    assert loops.defines == {"ax", "name", "f", "text", "n", "err"}
    assert not CellNames("%time x = 1").python            # IPython syntax: always run
    course = ["%matplotlib inline", "x = 1", "# EXERCISE e\ny = ...", "print(x + 0)"]
    assert cells_to_run(["%matplotlib inline", "x = 1", "y = x + 1", "print(x + 0)"],
                        course) == {0, 1, 2}


def test_a_solution_notebook_runs_the_closing_cell_that_removes_what_its_cells_made():
    from tests.solution_cells import cells_to_run

    def solved(course):
        return course[:1] + ["# EXERCISE e\ny = 2"] + course[2:] + ["check.assert_passed(['e'])"]

    course = ["import shutil, tempfile", "# EXERCISE e\ny = ...", "WORK = tempfile.mkdtemp()",
              "exercise.e(y, WORK)", "slow = train()", "shutil.rmtree(WORK)"]
    # the check needs WORK, so the solution's run makes it: the closing cell removes it
    assert cells_to_run(solved(course), course) == {0, 1, 2, 3, 5, 6}
    # ... but not when it needs a cell the solution skips (it would pull in the training)
    needs_slow = course[:5] + ["shutil.rmtree(WORK)\nprint(slow)"]
    assert 5 not in cells_to_run(solved(needs_slow), needs_slow)
    # a last cell that neither removes a folder nor checks for stray workers is no closing cell
    plain = course[:5] + ["print(WORK)"]
    assert 5 not in cells_to_run(solved(plain), plain)


def test_every_solution_notebook_runs_its_solutions_their_checks_and_its_closing_assert():
    from labkit import exercises
    from tests.solution_cells import course_twin, solution_plan

    solutions = sorted((ROOT / "solutions").glob("*_solution.ipynb"))
    assert solutions
    for solution in solutions:
        twin = course_twin(solution)
        assert twin is not None, f"{solution.name} has no course notebook beside it"
        code = [c.source for c in nbformat.read(solution, as_version=4).cells
                if c.cell_type == "code"]
        course = {c.source for c in nbformat.read(twin, as_version=4).cells}
        needed, total = solution_plan(solution, twin)
        assert total == len(code) and needed <= set(range(total))
        for i, source in enumerate(code):
            if exercises.EXERCISE_LINE.match(source):  # the solution and the check after it
                assert {i, i + 1} <= needed, f"{solution.name}: code cell {i} or its check skipped"
            if source not in course:  # a solution, the capstone's runs, the closing assert
                assert i in needed, f"{solution.name}: code cell {i}, not in the course, skipped"


def test_solution_notebook_run_skips_unchanged_cells_and_make_test_reports_times(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "solutions").mkdir()
    cell = nbformat.v4.new_code_cell
    unrelated = f"with open({str(tmp_path / 'ran.txt')!r}, 'a') as f:\n    f.write('ran\\n')"
    course = nbformat.v4.new_notebook(cells=[
        cell("N = 3"), cell(unrelated), cell("answer = ..."), cell("assert answer in (..., N)")])
    solved = nbformat.v4.new_notebook(cells=[
        cell("N = 3"), cell(unrelated), cell("answer = N"), cell("assert answer in (..., N)"),
        cell("assert answer == 3")])
    nbformat.write(course, tmp_path / "notebooks" / "99_x.ipynb")
    nbformat.write(solved, tmp_path / "solutions" / "99_x_solution.ipynb")
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.notebook_budget", "-p",
           "tests.solution_cells", "-p", "tests.timing_report", "--labkit-times=nb",
           "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider", "-n", "2",
           "--dist", "loadfile", "notebooks/99_x.ipynb", "solutions/99_x_solution.ipynb"]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "LABKIT_TIMES_DIR": str(tmp_path / "times")}
    run = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "ran.txt").read_text() == "ran\n", "the unchanged cell ran twice"
    assert "8 passed" in run.stdout and "failed" not in run.stdout  # xdist tells no deselection
    assert "solution notebooks: 4 of their 5 code cells ran" in run.stdout
    assert re.search(r"\d+\.\d s    4 cells  solutions/99_x_solution\.ipynb", run.stdout)
    assert "the 10 slowest cells" in run.stdout
    report = subprocess.run([sys.executable, "-m", "tests.timing_report", "nb", "unit"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert re.search(r"== nb: \d+ s on 2 worker\(s\) .*8 passed", report.stdout), report.stdout
    assert "2 notebooks, 8 cells run" in report.stdout
    assert "unit: no figures" in report.stdout

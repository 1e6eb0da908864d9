"""The course's exercises: enough per notebook, each solved and with a wrong answer tested."""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest

from labkit import check, exercises

ROOT = Path(__file__).resolve().parents[1]
GRADED = list(exercises.TOPICS)  # every notebook with a module of graders
MIN_EXERCISES = 3


def _cells(stem):
    return exercises.exercise_cells(nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", 4))


def _wrong_answer_tests() -> set[str]:
    names = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        names.update(re.findall(r"^def (test_\w+_wrong\w*)\(", path.read_text(), re.M))
    return names


@pytest.mark.parametrize("stem", GRADED)
def test_every_notebook_has_enough_graded_exercises(stem):
    cells = _cells(stem)
    assert len(cells) >= MIN_EXERCISES, (
        f"{stem}.ipynb has {len(cells)} exercise cells (`# EXERCISE <id>`), wants at least "
        f"{MIN_EXERCISES}")


@pytest.mark.parametrize("stem", GRADED)
def test_each_exercise_is_registered_graded_and_solved(stem):
    exercises.load_all()
    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", 4)
    blocks = exercises.solution_blocks(stem)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for index, ex_id in exercises.exercise_cells(nb):
        assert ex_id in check.EXERCISES, f"{stem} cell {index}: no grader registers {ex_id!r}"
        assert check.EXERCISES[ex_id].notebook == stem[:2], f"{ex_id} is registered elsewhere"
        assert blocks.get(ex_id, "").strip(), f"solutions/{stem}.py has no `# %% {ex_id}` block"
        grader = check.EXERCISES[ex_id].grader
        assert re.search(rf"\.{grader}\(", code), f"{stem}: nothing calls the grader {grader}()"


def test_every_registered_exercise_has_a_wrong_answer_test():
    exercises.load_all()
    tests = _wrong_answer_tests()
    for ex_id in check.EXERCISES:
        if ex_id.startswith("_test"):
            continue
        assert any(t.startswith(f"test_{ex_id}_wrong") for t in tests), (
            f"no test named test_{ex_id}_wrong_...: give {ex_id} a known wrong answer and "
            f"assert its hint")


def test_the_solution_notebooks_are_current():
    stale = exercises.build_solution_notebooks(check_only=True)
    assert not stale, (f"stale: {[p.name for p in stale]}; run `.venv/bin/python -m "
                       f"labkit.exercises` and commit the result")


def test_a_missing_solution_block_is_named(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("# EXERCISE nothing_here\n")])
    path = tmp_path / "99_demo.ipynb"
    nbformat.write(nb, path)
    monkeypatch.setattr(exercises, "SOLUTIONS", tmp_path)
    (tmp_path / "99_demo.py").write_text("# %% other\nx = 1\n")
    with pytest.raises(KeyError, match="no solution block `# %% nothing_here`"):
        exercises.solution_notebook(path)


def test_solution_blocks_are_split_on_their_marks(tmp_path, monkeypatch):
    monkeypatch.setattr(exercises, "SOLUTIONS", tmp_path)
    (tmp_path / "99_demo.py").write_text("# header\n\n# %% one\na = 1\n\n# %% two\nb = 2\n")
    assert exercises.solution_blocks("99_demo") == {"one": "a = 1", "two": "b = 2"}
    (tmp_path / "98_dup.py").write_text("# %% one\na = 1\n# %% one\n")
    with pytest.raises(ValueError, match="two solution blocks for 'one'"):
        exercises.solution_blocks()


def test_the_builder_takes_notebook_stems_and_refuses_unknown_ones(capsys):
    assert exercises.main(["--check", "00_environment_check"]) == 0
    with pytest.raises(SystemExit):
        exercises.main(["--check", "99_nope"])
    assert "no graded notebook 99_nope: choose from 00_environment_check" in capsys.readouterr().err


def test_solutions_are_found_where_labkit_solutions_says(tmp_path):
    import subprocess
    import sys

    (tmp_path / "99_demo.py").write_text("# %% demo_only\nx = 1\n")
    code = "from labkit import exercises; print(exercises.solution_blocks('99_demo'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "LABKIT_SOLUTIONS": str(tmp_path)},
                         timeout=60)
    assert out.stdout.strip() == "{'demo_only': 'x = 1'}", out.stderr


def test_a_missing_solutions_folder_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(exercises, "SOLUTIONS", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="point LABKIT_SOLUTIONS at its solutions/"):
        exercises.solution_blocks()

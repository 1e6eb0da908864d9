"""The graded exercises, one module per notebook topic, and their solutions.

Each module holds the graders of one notebook's exercises (functions made checks by
:func:`labkit.check.exercise`); a notebook imports its module::

    from labkit.exercises import data_parallel as exercise
    exercise.ddp_setup(my_setup)          # [pass] ... or [not yet] ... hint: ...

An exercise cell in a notebook starts with the line ``# EXERCISE <id>``; the learner writes
the code below it, and the next cell runs the check. The reference solutions are kept out of
the notebooks, in ``solutions/<notebook>.py``: one block per exercise, each starting with the
line ``# %% <id>``. ``labkit.check.solution(id)`` prints a block; ``solutions/<notebook>_
solution.ipynb`` is the notebook with each exercise cell's body replaced by its block, rebuilt
by ``python -m labkit.exercises`` (a test checks that the committed ones are current).

Importing a module imports no framework: graders import torch or TensorFlow when they run.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

# notebook file stem -> the module with its graders
TOPICS = {
    "00_environment_check": "environment",
    "01_vgg16_data_augmentation": "augmentation",
    "01_vgg16_data_augmentation_keras": "augmentation_keras",
    "02_data_parallelism": "data_parallel",
    "02_data_parallelism_keras": "data_parallel_keras",
    "03_model_parallelism": "model_parallel",
    "04_performance_tuning": "performance",
    "05_problem_diagnosis": "diagnosis",
    "06_custom_algorithms": "custom_algorithms",
    "07_resources_multinode": "resources",
    "09_sequence_context_expert": "sequence_context_expert",
    "10_composing_parallelism": "composition",
    "11_performance_principles": "performance_principles",
    "12_checkpoints_failures": "checkpoints_failures",
}

ROOT = Path(__file__).resolve().parents[2]
# The solutions ship with the course: beside labkit in a checkout (an editable install), or
# where LABKIT_SOLUTIONS says (the container's /workspace/solutions, labkit being a wheel).
SOLUTIONS = Path(os.environ.get("LABKIT_SOLUTIONS") or ROOT / "solutions")
NOTEBOOKS = ROOT / "notebooks"
EXERCISE_LINE = re.compile(r"^# EXERCISE (\w+)", re.M)
BLOCK_LINE = re.compile(r"^# %% (\w+)[ \t]*$", re.M)


def notebook_label(module: str, notebook: str) -> str:
    """How progress names a grader's notebook: its number, and "keras" for a TensorFlow twin
    (the twins share a number: ``02`` and ``02 keras``)."""
    topic = module.removeprefix(f"{__name__}.").split(".")[0]
    for stem, name in TOPICS.items():
        if name == topic:
            return f"{stem[:2]} keras" if stem.endswith("_keras") else stem[:2]
    return notebook  # a grader outside the course's modules (a test's)


def load_all() -> None:
    """Import every topic module that exists, so that every exercise is registered."""
    for module in TOPICS.values():
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as missing:
            if missing.name != f"{__name__}.{module}":
                raise


def solution_blocks(stem: str | None = None) -> dict[str, str]:
    """``{exercise id: solution code}`` from ``solutions/<stem>.py`` (every notebook's if None)."""
    if not SOLUTIONS.is_dir():
        raise FileNotFoundError(f"no solutions folder at {SOLUTIONS}: solutions ship with the "
                                f"course repository; point LABKIT_SOLUTIONS at its solutions/ "
                                f"folder, or install labkit from the checkout (pip install -e)")
    files = [SOLUTIONS / f"{stem}.py"] if stem else sorted(SOLUTIONS.glob("[0-9][0-9]_*.py"))
    blocks: dict[str, str] = {}
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        marks = list(BLOCK_LINE.finditer(text))
        for mark, nxt in zip(marks, [*marks[1:], None], strict=True):
            body = text[mark.end():nxt.start() if nxt else len(text)].strip("\n")
            if mark.group(1) in blocks:
                raise ValueError(f"{path.name}: two solution blocks for {mark.group(1)!r}")
            blocks[mark.group(1)] = body.rstrip()
    return blocks


def exercise_cells(nb) -> list[tuple[int, str]]:
    """``(cell index, exercise id)`` of a notebook's exercise cells."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and (m := EXERCISE_LINE.match(cell.source)):
            found.append((i, m.group(1)))
    return found


def solution_notebook(path: Path):
    """The course notebook at ``path`` with every exercise cell's body replaced by its solution."""
    import copy

    import nbformat

    nb = nbformat.read(path, as_version=4)
    blocks = solution_blocks(path.stem)
    out = copy.deepcopy(nb)
    ids = []
    for i, ex_id in exercise_cells(nb):
        if ex_id not in blocks:
            raise KeyError(f"{path.name} cell {i}: no solution block `# %% {ex_id}` in "
                           f"solutions/{path.stem}.py")
        out.cells[i].source = f"# EXERCISE {ex_id} (solution)\n{blocks[ex_id]}"
        ids.append(ex_id)
    title = f"# Solutions: {path.name}"
    out.cells.insert(0, nbformat.v4.new_markdown_cell(
        f"{title}\n\nThe course notebook with every exercise cell filled in with its reference "
        f"solution (from `solutions/{path.stem}.py`). Try the exercises in the course notebook "
        f"first."))
    out.cells.append(nbformat.v4.new_code_cell(
        "# Every exercise of this notebook passed, run by its check above.\n"
        f"from labkit import check\n\ncheck.assert_passed({ids!r})"))
    for n, cell in enumerate(out.cells):  # ids stable from one build to the next
        cell["id"] = f"solution-{n}"
    return out


def solution_notebook_path(path: Path) -> Path:
    return SOLUTIONS / f"{path.stem}_solution.ipynb"


def build_solution_notebooks(check_only: bool = False, only=None) -> list[Path]:
    """Write (or, with ``check_only``, list without writing) the out-of-date solution notebooks
    (of the notebook stems in ``only``, or of every notebook)."""
    import nbformat

    unknown = sorted(set(only or ()) - set(TOPICS))
    if unknown:
        raise ValueError(f"no graded notebook {', '.join(unknown)}: choose from "
                         f"{', '.join(TOPICS)}")
    stale = []
    for stem in only or TOPICS:
        course = NOTEBOOKS / f"{stem}.ipynb"
        if not course.is_file() or not (SOLUTIONS / f"{stem}.py").is_file():
            continue
        built = nbformat.writes(solution_notebook(course)) + "\n"
        target = solution_notebook_path(course)
        if not target.is_file() or target.read_text() != built:
            stale.append(target)
            if not check_only:
                target.write_text(built)
    return stale


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.exercises [--check] [NOTEBOOK ...]``: rebuild solution notebooks."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m labkit.exercises",
                                     description="rebuild solutions/*_solution.ipynb from the "
                                                 "course notebooks and solutions/*.py")
    parser.add_argument("--check", action="store_true", help="list stale notebooks, write none")
    parser.add_argument("stems", nargs="*", metavar="NOTEBOOK",
                        help="notebook stems to build (e.g. 02_data_parallelism); all by default")
    args = parser.parse_args(argv)
    try:
        stale = build_solution_notebooks(check_only=args.check, only=args.stems)
    except ValueError as exc:
        parser.error(str(exc))
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if args.check and stale else 0

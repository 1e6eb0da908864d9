"""Nothing that answers an exercise is on screen above it.

For every exercise cell of every course notebook, the significant lines of its solution block
(``solutions/<notebook>.py``) must not appear in the cells above it, markdown or code, nor in
the sources that ``labkit.show`` prints in those cells (resolved from the notebook's own imports
with ``inspect``, as ``labkit.show`` resolves them). A line the notebook teaches on purpose (a
loop header, the API a section measured, the code an exercise says to start from) is allowed by
name below, with the reason; anything else that shows up is an answer given away.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import re
from pathlib import Path

import pytest

from labkit import exercises

ROOT = Path(__file__).resolve().parents[1]

# Lines a course teaches as building blocks before any exercise: visible anywhere.
TAUGHT = {
    "for epoch in range(epochs):",
    "for x, y in loader:",
    "model.zero_grad()",
    "with torch.no_grad():",
    "rank = dist.get_rank()",
    "rank, world = dist.get_rank(), dist.get_world_size()",
    "nn.functional.cross_entropy(model(x), y).backward()",
}

# exercise id -> (lines the notebook shows on purpose above it, why)
ALLOWED = {
    "fair_gap": ({'plain = augment.augmentation(image_size, kind="none")'},
                 "the un-augmented transform, the building block the section introduces"),
    "keras_brightness": ({"keras.Input((None, None, 3)),", 'layers.RandomFlip("horizontal"),',
                          "layers.RandomRotation(config.rotation / 360),"},
                         "the pipeline the task gives, to which the learner adds one layer"),
    "ddp_training_loop": ({"sampler.set_epoch(epoch)"},
                          "the list of DDP's changes names the call; the exercise is where"),
    "amp_grad_scaler_step": ({"scaler.scale(loss).backward()"},
                             "the GradScaler call the measurement above shows, on purpose"),
    "fp16_compress_hook": ({"buffer = bucket.buffer()"},
                           "the communication-hook API the text explains"),
    "topk_error_feedback": ({"full = grad + residual"},
                            "the contract names the quantity whose largest entries are sent"),
}

# exercise id -> the function whose code the task says to copy and fix: its lines are given.
STARTS_FROM = {"early_stop_together": "labkit.diagnose.early_stopping"}


def _norm(line: str) -> str:
    return re.sub(r"\s+", " ", line.strip())


def significant(block: str) -> list[str]:
    """The lines of a solution that carry its content: no comment, import, signature, return
    or docstring line, none shorter than 16 characters, trailing comments cut."""
    lines = []
    for line in block.splitlines():
        text = _norm(line.split("  # ")[0])
        if len(text) < 16 or text.startswith(("#", "def ", "class ", "import ", "from ",
                                             "return", "@", '"""', "'''")):
            continue
        lines.append(text)
    return lines


def _parse(source: str) -> ast.Module:
    return ast.parse("\n".join(line for line in source.splitlines()
                               if not line.lstrip().startswith(("%", "!"))))


@functools.cache
def _imports(stem: str) -> dict:
    """The labkit names a notebook imports, as its cells import them."""
    names: dict = {}
    for cell in _cells(stem):
        if cell["cell_type"] != "code":
            continue
        for stmt in _parse("".join(cell["source"])).body:
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("labkit") \
                    or isinstance(stmt, ast.Import) and stmt.names[0].name.startswith("labkit"):
                exec(compile(ast.Module([stmt], []), stem, "exec"), names)
    return names


@functools.cache
def _cells(stem: str) -> list[dict]:
    return json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]


def shown_sources(stem: str, source: str) -> list[str]:
    """The sources ``labkit.show`` prints in one cell (a loop over a tuple of objects too)."""
    tree = _parse(source)
    loops = {node.target.id: node.iter for node in ast.walk(tree)
             if isinstance(node, ast.For) and isinstance(node.target, ast.Name)}
    texts = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) in ("labkit.show", "show")):
            continue
        arg = node.args[0]
        shown = [arg]
        if isinstance(arg, ast.Name) and isinstance(loops.get(arg.id), (ast.Tuple, ast.List)):
            shown = loops[arg.id].elts
        for expr in shown:
            try:
                obj = eval(compile(ast.Expression(expr), stem, "eval"), dict(_imports(stem)))
            except Exception as exc:  # noqa: BLE001 - any failure means the test cannot see it
                raise AssertionError(f"{stem}: cannot resolve labkit.show({ast.unparse(expr)}) "
                                     f"from the notebook's labkit imports: {exc}") from None
            texts.append(inspect.getsource(inspect.unwrap(obj)))
    return texts


def exercise_cases():
    for stem in exercises.TOPICS:
        if not (ROOT / "notebooks" / f"{stem}.ipynb").is_file():
            continue
        for i, cell in enumerate(_cells(stem)):
            m = exercises.EXERCISE_LINE.match("".join(cell["source"]))
            if cell["cell_type"] == "code" and m:
                yield pytest.param(stem, i, m.group(1), id=m.group(1))


def _object(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


@pytest.mark.parametrize("stem, index, ex_id", list(exercise_cases()))
def test_no_answer_is_visible_above_its_exercise(stem, index, ex_id):
    block = exercises.solution_blocks(stem)[ex_id]
    above = []
    for cell in _cells(stem)[:index]:
        source = "".join(cell["source"])
        above.append(source)
        if cell["cell_type"] == "code":
            above += shown_sources(stem, source)
    screen = _norm("\n".join(above))
    allowed = TAUGHT | ALLOWED.get(ex_id, (set(), ""))[0]
    lines = significant(block)
    if ex_id in STARTS_FROM:
        start = {_norm(line.split("  # ")[0]) for line in
                 inspect.getsource(_object(STARTS_FROM[ex_id])).splitlines()}
        assert set(lines) - start, f"{ex_id}: the code it starts from holds the whole answer"
        allowed |= start
    visible = [line for line in lines if line in screen and line not in allowed]
    assert not visible, (f"{stem}: {len(visible)} of the {len(lines)} significant lines of "
                         f"{ex_id}'s solution are on screen above it: {visible}")


def test_the_allowances_are_still_needed():
    """An allowance whose line no longer shows (or no longer solves) is dropped, not kept."""
    for stem, _index, ex_id in (p.values for p in exercise_cases()):
        if ex_id not in ALLOWED:
            continue
        lines = set(significant(exercises.solution_blocks(stem)[ex_id]))
        stale = ALLOWED[ex_id][0] - lines
        assert not stale, f"{ex_id}: allowed lines no longer in its solution: {stale}"


def test_the_early_stopping_fix_is_shown_after_its_check_only():
    """05's starting code is printed above the exercise; the fix is not in it."""
    from labkit import diagnose

    fix = significant(inspect.getsource(diagnose.loss_over_ranks))
    start = _norm(inspect.getsource(diagnose.early_stopping))
    assert fix and not any(line in start for line in fix)

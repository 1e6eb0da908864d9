"""pytest plugin for the notebook run (``-p tests.solution_cells``): a solution notebook runs the
cells its solutions change, not the whole course a second time.

``solutions/NN_x_solution.ipynb`` is ``notebooks/NN_x.ipynb`` with its exercise cells filled in
(and a last cell asserting that every exercise passed). The course notebook runs in the same
session with every cell, its exercises as the learner finds them. A cell of the solution
notebook can only behave differently from its twin in the course run when it reads what a
changed cell defined or changed, directly or through names defined from those. So the solution
notebook runs:

- every cell not found in the course notebook (the solutions, the final assert);
- every cell that reads a name those define or change, and so on down the notebook (a later
  cell that trains with the learner's function, or uses ``v`` from ``v = exercise.x(my_x)``);
- for each of these, the latest earlier cell that defines each name it reads, and the cells in
  between that change that object (``model.fit(...)``, ``rows[0] = ...``), recursively;
- the course notebook's closing cell (no worker left behind; it removes the temporary folders
  the notebook made) when the cells it needs run anyway.

The other cells are deselected (pytest lists them as such): the course run ran the same code
on the same inputs. A solution notebook whose course twin is not part of the run runs whole.
"""

from __future__ import annotations

import ast
import functools
import symtable
from pathlib import Path

SOLUTION_SUFFIX = "_solution"
# What a notebook's closing cell calls: the check that no worker outlived its run (05 wraps it
# in a helper of its own), or the removal of a temporary folder.
CLOSING_CHECKS = ("stray_workers(", "no_strays(", "rmtree(", ".cleanup()")


class CellNames:
    """What one code cell reads from and does to the kernel's namespace (None: not Python)."""

    def __init__(self, source: str):
        self.defines: set[str] = set()  # names bound at the cell's top level
        self.reads: set[str] = set()  # names read before the cell binds them (free names)
        self.changes: set[str] = set()  # objects changed in place: x.m(...), x[i] = ..., x.a = ...
        self.modules: set[str] = set()  # names bound by imports (never "changed")
        try:
            tree = ast.parse(source)
            table = symtable.symtable(source, "<cell>", "exec")
        except SyntaxError:  # IPython syntax (%magic, !cmd): nothing known, so always run
            self.python = False
            return
        self.python = True
        self._statements(tree.body)
        # Function bodies read globals when called; the names this cell binds itself are its own.
        self.reads |= _globals_read_in_nested_scopes(table) - self.defines

    def _statements(self, statements: list[ast.stmt]) -> None:
        """Follow the cell in the order it runs: a loop's or a ``with``'s target is bound before
        its body reads it, a branch's names before the statements after it."""
        for statement in statements:
            if isinstance(statement, (ast.For, ast.AsyncFor)):
                self._expression(statement.iter)
                self._expression(statement.target)
                self._statements(statement.body + statement.orelse)
            elif isinstance(statement, (ast.If, ast.While)):
                self._expression(statement.test)
                self._statements(statement.body + statement.orelse)
            elif isinstance(statement, (ast.With, ast.AsyncWith)):
                for item in statement.items:
                    self._expression(item.context_expr)
                    if item.optional_vars is not None:
                        self._expression(item.optional_vars)
                self._statements(statement.body)
            elif isinstance(statement, ast.Try):
                self._statements(statement.body)
                for handler in statement.handlers:
                    if handler.type is not None:
                        self._expression(handler.type)
                    if handler.name:
                        self.defines.add(handler.name)
                    self._statements(handler.body)
                self._statements(statement.orelse + statement.finalbody)
            else:
                self._expression(statement)

    def _expression(self, statement: ast.AST) -> None:
        loads, stores, comprehension_targets = set(), set(), set()
        for node in _outside_nested_scopes(statement):
            if isinstance(node, ast.Name):
                (loads if isinstance(node.ctx, ast.Load) else stores).add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stores.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
                stores |= names
                self.modules |= names
            elif isinstance(node, ast.comprehension):
                comprehension_targets |= {n.id for n in ast.walk(node.target)
                                          if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                self.changes |= _base_name(node.func.value)
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(
                    node.ctx, ast.Load):
                self.changes |= _base_name(node.value)
        self.reads |= loads - self.defines - comprehension_targets
        self.defines |= stores - comprehension_targets


def _outside_nested_scopes(node: ast.AST):
    """``node`` and its descendants, without the bodies of functions, lambdas and classes
    (their decorators, defaults and bases run at the top level). Comprehensions are walked
    whole: their loop variables are told apart by the caller."""
    yield node
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        children = [*node.decorator_list, *args.defaults,
                    *(d for d in args.kw_defaults if d is not None)]
    elif isinstance(node, ast.Lambda):
        children = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
    elif isinstance(node, ast.ClassDef):
        children = [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _outside_nested_scopes(child)


def _globals_read_in_nested_scopes(table: symtable.SymbolTable) -> set[str]:
    """Names that function and class bodies (and comprehensions, where they have a scope of
    their own) read from the notebook's globals."""
    found = set()
    for child in table.get_children():
        for symbol in child.get_symbols():
            if symbol.is_referenced() and symbol.is_global():
                found.add(symbol.get_name())
        found |= _globals_read_in_nested_scopes(child)
    return found


def _base_name(node: ast.AST) -> set[str]:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return {node.id} if isinstance(node, ast.Name) else set()


def cells_to_run(sources: list[str], course_sources: list[str]) -> set[int]:
    """Which of a solution notebook's code cells (``sources``, in order) its run needs, given
    the code cells of its course notebook, which runs whole beside it."""
    cells = [CellNames(s) for s in sources]
    modules = set().union(*(cell.modules for cell in cells))
    for cell in cells:  # `plt.plot(...)` or `labkit.launch(...)` changes no notebook state
        cell.changes -= modules
    in_course = set(course_sources)
    changed_names: set[str] = set()
    run: set[int] = set()
    for i, (source, cell) in enumerate(zip(sources, cells, strict=True)):
        if source not in in_course or not cell.python or cell.reads & changed_names:
            run.add(i)
            changed_names |= cell.defines | cell.changes
    todo = sorted(run)
    while todo:
        j = todo.pop()
        for name in cells[j].reads:
            needed = _latest_definition_and_changes(cells, name, before=j)
            todo.extend(sorted(needed - run))
            run |= needed
    run |= _cleanup(cells, sources, course_sources, run)
    return run


def _cleanup(cells: list[CellNames], sources: list[str], course_sources: list[str],
             run: set[int]) -> set[int]:
    """The course notebook's closing cell (the last one, when it checks that no worker
    outlived its run or removes the folders the notebook made), when every cell it needs runs:
    cells that ran made what it removes, and without it their folders would stay behind."""
    if (not course_sources or course_sources[-1] not in sources
            or not any(check in course_sources[-1] for check in CLOSING_CHECKS)):
        return set()
    last = len(sources) - 1 - sources[::-1].index(course_sources[-1])
    needed = set().union(*(_latest_definition_and_changes(cells, name, before=last)
                           for name in cells[last].reads))
    return {last} if needed <= run else set()


def _latest_definition_and_changes(cells: list[CellNames], name: str, before: int) -> set[int]:
    """The latest cell before ``before`` that binds ``name``, and the cells after it that
    change that object in place (none if no cell binds it: a builtin, or a NameError the run
    shows)."""
    changing = set()
    for i in range(before - 1, -1, -1):
        if name in cells[i].defines:
            return {i} | changing
        if name in cells[i].changes:
            changing.add(i)
    return set()


def course_twin(path: Path) -> Path | None:
    """``notebooks/NN_x.ipynb`` for ``solutions/NN_x_solution.ipynb`` (None for others)."""
    if path.suffix != ".ipynb" or not path.stem.endswith(SOLUTION_SUFFIX):
        return None
    twin = path.parent.parent / "notebooks" / (path.stem.removesuffix(SOLUTION_SUFFIX) + ".ipynb")
    return twin if twin.is_file() else None


@functools.cache
def solution_plan(solution: Path, course: Path) -> tuple[frozenset[int], int]:
    """The code cells (by position) of the solution notebook that its run needs, and how many
    code cells it has."""
    import nbformat

    def code(path):
        return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]

    sources = code(solution)
    return frozenset(cells_to_run(sources, code(course))), len(sources)


def _planned(notebooks: set[Path]) -> dict[Path, tuple[frozenset[int], int]]:
    """The plan of every solution notebook in ``notebooks`` whose course twin is there too."""
    plans = {}
    for path in sorted(notebooks):
        twin = course_twin(path)
        if twin is not None and twin.resolve() in notebooks:
            plans[path] = solution_plan(path, twin.resolve())
    return plans


def _path(nodeid_or_item) -> Path:
    return Path(str(nodeid_or_item).split("::", 1)[0]).resolve()


def pytest_collection_modifyitems(config, items):
    by_notebook: dict[Path, list] = {}
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            by_notebook.setdefault(_path(item.fspath), []).append(item)
    dropped = []
    for path, (needed, _) in _planned(set(by_notebook)).items():
        dropped += [item for item in by_notebook[path] if item.cell_num not in needed]
    if dropped:
        gone = set(map(id, dropped))
        items[:] = [item for item in items if id(item) not in gone]
        config.hook.pytest_deselected(items=dropped)


_seen: set[Path] = set()  # the notebooks whose cells reported (here, or from xdist's workers)


def pytest_runtest_logreport(report):
    if ".ipynb::" in report.nodeid:
        _seen.add(_path(report.nodeid))


def pytest_terminal_summary(terminalreporter):
    plans = _planned(_seen)
    if not plans:
        return
    ran = sum(len(needed) for needed, _ in plans.values())
    total = sum(n for _, n in plans.values())
    terminalreporter.write_line(
        f"solution notebooks: {ran} of their {total} code cells ran (what their solutions "
        f"change, and what that needs); their course notebooks ran every cell")

"""``labkit.show``: the source of the code a notebook teaches, printed next to the cell using it."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

__all__ = ["show"]

_PACKAGE = Path(__file__).resolve().parent


class Shown(str):
    """The text :func:`show` printed; a cell ending in ``show(...)`` does not echo it again."""

    def _ipython_display_(self) -> None:
        pass


def show(obj, *, docstring: bool = False) -> Shown:
    """Print the source of a function or class that a notebook teaches (without its docstring).

    The header names the file and line, so that the learner can open it; returns the text.

    Example::

        >>> labkit.show(labkit.parallel.collectives.ring_allreduce)
        # labkit/parallel/collectives.py, line 40
        def ring_allreduce(tensor, group=None):
            ...
    """
    target = inspect.unwrap(obj)
    try:
        lines, start = inspect.getsourcelines(target)
        path = Path(inspect.getsourcefile(target) or "?").resolve()
    except (OSError, TypeError) as exc:
        raise TypeError(f"labkit.show needs a function or class defined in a file, not "
                        f"{type(obj).__name__} ({exc}): pass the function itself, not its "
                        f"result") from None
    src = textwrap.dedent("".join(lines))
    if not docstring and inspect.getdoc(target):
        src = _without_docstring(src)
    where = path.relative_to(_PACKAGE.parent) if path.is_relative_to(_PACKAGE.parent) else path
    text = Shown(f"# {where}, line {start}\n{src.rstrip()}")
    print(text)
    return text


def _without_docstring(src: str) -> str:
    """The source with the first string statement of the body (the docstring) cut out."""
    import ast

    tree = ast.parse(src)
    node = tree.body[0]
    first = node.body[0] if getattr(node, "body", None) else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return src
    lines = src.splitlines(keepends=True)
    return "".join(lines[:first.lineno - 1] + lines[first.end_lineno:])

"""The package's rooms keep to themselves: no module reaches for another module's `_private` names,
and no modules import each other in a circle.

Read from the source with `ast`, so the rule holds for code paths no test runs. A name that
several modules need is made public (without the underscore) in the module that owns it, or
goes to a private module whose names are public (`labkit._dist`, `labkit._sizes`, ...).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "labkit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module an ImportFrom names (``from ..bench import x`` in labkit.parallel)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path) -> list[str]:
    """Every use in ``path`` of a `_name` that belongs to another labkit module."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    found, aliases = [], {}  # aliases: local name -> the labkit module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node, path.name == "__init__.py")
            if not source.startswith("labkit"):
                continue
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if _private(alias.name) and source != module and target != module:
                    found.append(f"{path.name}:{node.lineno} from {source} import {alias.name}")
                aliases[alias.asname or alias.name] = target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("labkit"):
                    aliases[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = _dotted(node.value, aliases)
            if owner and owner.startswith("labkit") and owner != module:
                found.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
        elif isinstance(node, ast.Call):
            # setattr(augment, "_check_batch", ...), or a helper called the same way: a
            # module followed by the name of one of its private attributes.
            for first, second in zip(node.args, node.args[1:], strict=False):
                owner = _dotted(first, aliases)
                if (owner and owner.startswith("labkit") and owner != module
                        and isinstance(second, ast.Constant) and isinstance(second.value, str)
                        and _private(second.value)):
                    found.append(f"{path.name}:{node.lineno} {owner}.{second.value}")
    return sorted(found, key=lambda use: int(use.split(":")[1].split(" ")[0]))


def _dotted(node, aliases: dict) -> str | None:
    """``bench`` -> ``labkit.bench``, ``labkit.parallel.memory`` -> itself; else None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value, aliases)
        return f"{head}.{node.attr}" if head else None
    return None


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PACKAGE)) for p in SOURCES])
def test_no_module_uses_another_modules_private_names(path):
    assert private_uses(path) == []


def test_the_checker_finds_each_kind_of_private_use(tmp_path, monkeypatch):
    # A module planted inside a fake labkit tree: every way of reaching a private name is seen.
    fake = tmp_path / "labkit"
    (fake / "parallel").mkdir(parents=True)
    bad = fake / "parallel" / "bad.py"
    bad.write_text(
        "from ..bench import _device\n"
        "from labkit.models import _CFG, vgg16\n"
        "from . import memory\n"
        "from .. import augment\n"
        "import labkit.check as check\n"
        "memory._whole('n', 1)\n"
        "augment._check_batch = None\n"
        "check._verdict\n"
        "patch(augment, '_check_batch', wrap)\n"
        "getattr(augment, 'IMAGENET_MEAN')\n"
        "from ._own import public\n"
        "from .bad import _mine\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    uses = private_uses(bad)
    assert [u.split(" ", 1)[1] for u in uses] == [
        "from labkit.bench import _device",
        "from labkit.models import _CFG",
        "labkit.parallel.memory._whole",
        "labkit.augment._check_batch",
        "labkit.check._verdict",
        "labkit.augment._check_batch",
    ]


# ---- no import cycles ---------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, known) -> set[str]:
    """The labkit modules ``path`` imports, at the top or inside a function (a lazy import still
    ties the two rooms together): ``from . import plots`` is ``labkit.plots``, ``from .bench import
    x`` is ``labkit.bench``, ``import labkit.parallel.memory`` is that module."""
    module = _module_name(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node, path.name == "__init__.py")
            if not source.startswith("labkit"):
                continue
            for alias in node.names:
                # ``from labkit.parallel import memory`` names a module; ``from .bench import x``
                # names something inside one.
                found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known
                          else source)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("labkit"))
    return {name for name in found if name in known and name != module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan's algorithm), sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def test_labkits_modules_import_each_other_without_a_cycle():
    modules = _modules()
    graph = {name: imported_modules(path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 50  # the reader sees the imports it should
    assert "labkit.bench" in graph["labkit.ddp"]
    assert import_cycles(graph) == []


def test_the_cycle_finder_sees_a_lazy_import_that_closes_a_circle(tmp_path, monkeypatch):
    fake = tmp_path / "labkit"
    (fake / "parallel").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "parallel" / "__init__.py").write_text("")
    (fake / "bench.py").write_text("def main():\n    from .ddp import efficiency\n")
    (fake / "ddp.py").write_text("from .bench import fit\nfrom labkit.parallel import memory\n")
    (fake / "parallel" / "memory.py").write_text("from .. import ddp\n")
    (fake / "plots.py").write_text("import labkit.bench\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    modules = _modules()
    graph = {name: imported_modules(path, modules) for name, path in modules.items()}
    assert graph["labkit.plots"] == {"labkit.bench"}
    assert import_cycles(graph) == [["labkit.bench", "labkit.ddp", "labkit.parallel.memory"]]
    (fake / "bench.py").write_text("def main():\n    pass\n")
    graph = {name: imported_modules(path, _modules()) for name, path in modules.items()}
    assert import_cycles(graph) == [["labkit.ddp", "labkit.parallel.memory"]]

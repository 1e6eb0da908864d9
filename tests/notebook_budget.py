"""pytest plugin for the notebook run (``-p tests.notebook_budget``): time every notebook.

nbval makes one test item per cell; this adds the items of each notebook up (kernel start
included), prints a table of notebook times, slowest first, and fails a notebook's last cell
when the whole notebook went over budget (``LABKIT_NOTEBOOK_BUDGET`` seconds, 180 by default).

It works with pytest-xdist's ``--dist loadfile`` (every cell of a notebook on one worker, in
order, in one kernel): the budget is kept where the cells run, the table where the reports
arrive.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

DEFAULT_BUDGET = 180.0
_spent_here: dict[str, float] = defaultdict(float)  # this process's cells: the budget
_spent: dict[str, float] = defaultdict(float)  # every report that reached the terminal: the table
_cells: dict[str, int] = defaultdict(int)
_last_item: dict[str, str] = {}


def _budget() -> float:
    raw = os.environ.get("LABKIT_NOTEBOOK_BUDGET", "")
    try:
        return float(raw) if raw else DEFAULT_BUDGET
    except ValueError:
        raise pytest.UsageError(f"LABKIT_NOTEBOOK_BUDGET={raw!r} is not a number of "
                                "seconds") from None


def _notebook(nodeid: str) -> str | None:
    path = nodeid.split("::", 1)[0]
    return path if path.endswith(".ipynb") else None


def pytest_configure(config):
    config._labkit_budget = _budget()


@pytest.hookimpl(trylast=True)  # after tests.solution_cells has deselected what need not run
def pytest_collection_modifyitems(items):
    for item in items:
        if (nb := _notebook(item.nodeid)) is not None:
            _last_item[nb] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    nb = _notebook(item.nodeid)
    if nb is None:
        return
    _spent_here[nb] += report.duration
    budget = item.config._labkit_budget
    if call.when == "teardown" and item.nodeid == _last_item.get(nb) and _spent_here[nb] > budget:
        report.outcome = "failed"
        profile = os.environ.get("LABKIT_PROFILE", "the default")
        report.longrepr = (f"{nb} took {_spent_here[nb]:.1f} s in the {profile} profile, over "
                           f"its budget of {budget:g} s: shrink its sizes for that profile "
                           f"(knob(..., smoke=...)), or raise LABKIT_NOTEBOOK_BUDGET outside CI")


def pytest_runtest_logreport(report):
    if (nb := _notebook(report.nodeid)) is None:
        return
    _spent[nb] += report.duration
    if report.when == "call":
        _cells[nb] += 1


def notebook_times() -> list[tuple[str, float, int]]:
    """``(notebook, seconds, cells run)``, slowest first: what the table prints."""
    return sorted(((nb, s, _cells[nb]) for nb, s in _spent.items()), key=lambda r: -r[1])


def pytest_terminal_summary(terminalreporter):
    if not _spent:
        return
    budget = terminalreporter.config._labkit_budget
    rows = notebook_times()
    terminalreporter.section(f"notebook times, slowest first (budget {budget:g} s each)")
    for nb, seconds, cells in rows:
        flag = "  OVER BUDGET" if seconds > budget else ""
        terminalreporter.write_line(f"{seconds:8.1f} s  {cells:3d} cells  {nb}{flag}")
    terminalreporter.write_line(f"{sum(s for _, s, _ in rows):8.1f} s  "
                                f"{sum(c for _, _, c in rows):3d} cells  in {len(rows)} notebooks "
                                f"(summed: with -n, more than the run's wall time)")

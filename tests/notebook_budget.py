"""pytest plugin for the notebook run (``-p tests.notebook_budget``): time every notebook.

nbval makes one test item per cell; this adds the items of each notebook up (kernel start
included), prints a table of notebook times, and fails a notebook's last cell when the whole
notebook went over budget (``LABKIT_NOTEBOOK_BUDGET`` seconds, 180 by default).
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest

DEFAULT_BUDGET = 180.0
_spent: dict[str, float] = defaultdict(float)
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
    _spent[nb] += report.duration
    budget = item.config._labkit_budget
    if call.when == "teardown" and item.nodeid == _last_item.get(nb) and _spent[nb] > budget:
        report.outcome = "failed"
        profile = os.environ.get("LABKIT_PROFILE", "the default")
        report.longrepr = (f"{nb} took {_spent[nb]:.1f} s in the {profile} profile, over its "
                           f"budget of {budget:g} s: shrink its sizes for that profile "
                           f"(knob(..., smoke=...)), or raise LABKIT_NOTEBOOK_BUDGET outside CI")


def pytest_terminal_summary(terminalreporter):
    if not _spent:
        return
    budget = terminalreporter.config._labkit_budget
    terminalreporter.section(f"notebook times (budget {budget:g} s each)")
    for nb, seconds in sorted(_spent.items()):
        flag = "  OVER BUDGET" if seconds > budget else ""
        terminalreporter.write_line(f"{seconds:8.1f} s  {nb}{flag}")

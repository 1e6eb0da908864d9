"""Where a test run's time went (``-p tests.timing_report --labkit-times=NAME``).

At the end of a run this prints its ten slowest tests (setup, call and teardown together; in a
notebook run each test is a cell), and, for unit tests, the ten files whose tests take longest
together, and keeps the run's figures in ``NAME.json`` in
``.pytest_cache/labkit-times`` (or ``$LABKIT_TIMES_DIR``). ``python -m tests.timing_report``
prints the figures of the runs kept there, which ``make test`` does last, so that the slowest
tests and notebooks stand at the bottom of every run and a regression shows as it happens.
Works with pytest-xdist: the figures are gathered where the reports arrive.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

TIMES_DIR = Path(os.environ.get("LABKIT_TIMES_DIR") or
                 Path(__file__).resolve().parents[1] / ".pytest_cache" / "labkit-times")
SLOWEST = 10

_seconds: dict[str, float] = defaultdict(float)
_outcomes: dict[str, str] = {}
_started = time.monotonic()


def pytest_addoption(parser):
    parser.addoption("--labkit-times", metavar="NAME", default=None,
                     help=f"keep this run's figures in {TIMES_DIR.name}/NAME.json")


def pytest_sessionstart(session):
    global _started
    _started = time.monotonic()


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] += report.duration
    if report.when == "call" or report.outcome != "passed":  # a skip or error in setup counts
        _outcomes.setdefault(report.nodeid, report.outcome)
        if report.outcome == "failed":
            _outcomes[report.nodeid] = "failed"


def slowest(seconds: dict[str, float], n: int = SLOWEST) -> list[tuple[str, float]]:
    return sorted(seconds.items(), key=lambda kv: -kv[1])[:n]


def by_file(seconds: dict[str, float]) -> list[tuple[str, float, int]]:
    """(file, seconds summed over its tests, tests), slowest file first: where a speed-up pays.

    Many tests of a few seconds each cost more than the one slow test at the top of the list.
    """
    files: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for nodeid, s in seconds.items():
        entry = files[nodeid.split("::")[0]]
        entry[0] += s
        entry[1] += 1
    return sorted(((f, s, n) for f, (s, n) in files.items()), key=lambda row: -row[1])


def pytest_terminal_summary(terminalreporter, config):
    if not _seconds:
        return
    kind = "cells" if any(".ipynb::" in nodeid for nodeid in _seconds) else "tests"
    terminalreporter.section(f"the {SLOWEST} slowest {kind} (setup + call + teardown)")
    for nodeid, seconds in slowest(_seconds):
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}")
    if kind == "tests":
        terminalreporter.section(f"the {SLOWEST} slowest files (their tests summed)")
        for path, seconds, n in by_file(_seconds)[:SLOWEST]:
            terminalreporter.write_line(f"{seconds:8.1f} s  {n:3d} tests  {path}")
    name = config.getoption("--labkit-times")
    if name and not hasattr(config, "workerinput"):  # the controller, not an xdist worker
        _keep(name, config)


def _keep(name: str, config) -> None:
    from tests import notebook_budget

    counts = defaultdict(int)
    for outcome in _outcomes.values():
        counts[outcome] += 1
    figures = {
        "name": name,
        "wall_s": round(time.monotonic() - _started, 1),
        "workers": getattr(config.option, "numprocesses", None) or 1,
        "outcomes": dict(counts),
        "summed_s": round(sum(_seconds.values()), 1),
        "slowest": [[nodeid, round(s, 2)] for nodeid, s in slowest(_seconds)],
        "files": [[f, round(s, 1), n] for f, s, n in by_file(_seconds)],
        "notebooks": [[nb, round(s, 2), cells] for nb, s, cells in
                      notebook_budget.notebook_times()],
    }
    TIMES_DIR.mkdir(parents=True, exist_ok=True)
    (TIMES_DIR / f"{name}.json").write_text(json.dumps(figures, indent=1) + "\n")


def report(names: list[str]) -> str:
    """The kept figures of the runs ``names``, as ``make test`` prints them last."""
    lines = []
    for name in names:
        path = TIMES_DIR / f"{name}.json"
        if not path.is_file():
            lines.append(f"{name}: no figures (the run did not finish)")
            continue
        f = json.loads(path.read_text())
        outcomes = ", ".join(f"{n} {o}" for o, n in sorted(f["outcomes"].items()))
        lines.append(f"== {name}: {f['wall_s']:.0f} s on {f['workers']} worker(s) "
                     f"({f['summed_s']:.0f} s summed), {outcomes}")
        if f["notebooks"]:
            cells = sum(c for _, _, c in f["notebooks"])
            lines.append(f"   {len(f['notebooks'])} notebooks, {cells} cells run; "
                         f"the {SLOWEST} slowest:")
            lines += [f"{s:8.1f} s  {c:3d} cells  {nb}" for nb, s, c in f["notebooks"][:SLOWEST]]
        else:
            lines.append(f"   the {SLOWEST} slowest tests:")
            lines += [f"{s:8.1f} s  {nodeid}" for nodeid, s in f["slowest"]]
            if f.get("files"):  # figures kept before files were counted have none
                lines.append(f"   the {SLOWEST} slowest files (their tests summed):")
                lines += [f"{s:8.1f} s  {n:3d} tests  {name}"
                          for name, s, n in f["files"][:SLOWEST]]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(sys.argv[1:] or ["unit", "notebooks"]))

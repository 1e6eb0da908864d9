"""The timing report: where a run's time went, by test and by file."""

from __future__ import annotations

import json

from tests import timing_report


def test_by_file_sums_each_files_tests_slowest_first():
    seconds = {"tests/a.py::one": 2.0, "tests/a.py::two[x]": 3.0, "tests/b.py::one": 4.0,
               "tests/c.py::Class::one": 0.5}
    assert timing_report.by_file(seconds) == [("tests/a.py", 5.0, 2), ("tests/b.py", 4.0, 1),
                                              ("tests/c.py", 0.5, 1)]


def test_the_report_names_the_slowest_files_and_reads_older_figures_without_them(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr(timing_report, "TIMES_DIR", tmp_path)
    figures = {"name": "unit", "wall_s": 10.0, "workers": 2, "outcomes": {"passed": 3},
               "summed_s": 9.5, "slowest": [["tests/b.py::one", 4.0]], "notebooks": [],
               "files": [["tests/a.py", 5.0, 2], ["tests/b.py", 4.0, 1]]}
    (tmp_path / "unit.json").write_text(json.dumps(figures))
    text = timing_report.report(["unit"])
    assert "== unit: 10 s on 2 worker(s) (10 s summed), 3 passed" in text
    assert "the 10 slowest files (their tests summed):\n     5.0 s    2 tests  tests/a.py" in text
    del figures["files"]  # kept by a run before files were counted
    (tmp_path / "unit.json").write_text(json.dumps(figures))
    assert "slowest files" not in timing_report.report(["unit"])

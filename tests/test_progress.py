"""labkit.progress: per-rank bars fed through the workers' output, drawn as text or widgets."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest

import labkit
from labkit._progress import MARKER, ProgressBars, decode_update, encode_update

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_a_progress_line_round_trips_and_other_lines_are_not_one():
    update = {"id": 3, "pos": 1, "desc": "épochs", "n": 7, "total": 50, "elapsed": 1.5,
              "done": False}
    line = encode_update(update)
    assert line.startswith(MARKER) and "\n" not in line
    assert decode_update(line) == update
    assert decode_update(line[len(MARKER):]) == update, "the launcher passes it without marker"
    assert decode_update("epoch 3: loss 0.25") is None
    assert decode_update(MARKER + '{"n": "seven"}') is None
    assert decode_update(MARKER + "[1, 2]") is None


def test_two_launched_ranks_each_reach_the_end_and_the_marker_stays_out_of_the_output(capsys):
    res = labkit.launch(count_with_progress, 50, nproc=2)
    out = capsys.readouterr().out
    lines = out.splitlines()
    # Said at once, and how long the start took once they were up: on the same line, or on a
    # line of its own when something was printed in between (a busy machine's heartbeat).
    assert lines[0].startswith("[labkit] starting 2 workers ...")
    ready = next(ln for ln in lines if "ready in " in ln)
    assert ready.startswith(("[labkit] starting 2 workers ... ready in ",
                             "[labkit] 2 workers ready in ")) and ready.endswith(" s")
    assert float(ready.split()[-2]) > 0
    for rank in (0, 1):
        assert f"[rank{rank}] progress: 50/50 (100%) in " in out
        assert res.logs[rank] == ["counted 50"], "only what the rank printed is kept"
    assert res.values == [50, 50]
    assert MARKER not in out and "labkit-progress" not in out
    assert len([ln for ln in out.splitlines() if "progress: " in ln]) <= 2 * 11, "not per item"


def count_with_progress(n):
    import labkit

    seen = sum(1 for _ in labkit.progress(range(n)))
    print("counted", seen)
    return seen


def test_show_ranks_hides_the_bars_of_hidden_ranks_too(capsys):
    labkit.launch(count_with_progress, 20, nproc=2, show_ranks=1)
    out = capsys.readouterr().out
    assert "[rank1] progress: 20/20 (100%)" in out and "[rank0] progress" not in out


def test_a_progress_line_after_a_partial_line_keeps_the_text_and_updates_the_bar(capsys):
    from labkit._engine import _route

    logs, agent_log, bars = {}, [], ProgressBars(widgets=False)
    done = encode_update({"id": 0, "n": 4, "total": 4, "desc": "", "elapsed": 1.0, "done": True})
    _route("[rank2] loss 0.5" + done, logs, agent_log, None, bars)
    _route("[rank2] " + done, logs, agent_log, None, bars)
    assert logs == {2: ["loss 0.5"]} and agent_log == []
    assert capsys.readouterr().out.splitlines() == [
        "[rank2] progress: 4/4 (100%) in 1.0 s, 4.0 it/s", "[rank2] loss 0.5",
        "[rank2] progress: 4/4 (100%) in 1.0 s, 4.0 it/s"]


def test_a_worker_sends_a_few_updates_a_second_not_one_per_item(monkeypatch, capfd):
    monkeypatch.setenv("LABKIT_CONTROLLER_PID", "1")  # what the launcher gives its workers
    monkeypatch.setenv("RANK", "3")
    start = time.monotonic()
    for _ in labkit.progress(range(1000), desc="steps"):
        time.sleep(0.001)
    seconds = time.monotonic() - start
    lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith(MARKER)]
    updates = [decode_update(ln) for ln in lines]
    assert len(lines) <= seconds / 0.25 + 3, (len(lines), seconds)
    assert updates[0]["n"] == 0 and not updates[0]["done"], "the bar appears as the loop starts"
    assert updates[-1] == dict(updates[-1], n=1000, total=1000, desc="steps", done=True)
    assert [u["n"] for u in updates] == sorted(u["n"] for u in updates)


def test_outside_a_worker_the_bar_is_local_and_the_items_all_come(monkeypatch, capsys):
    monkeypatch.delenv("LABKIT_CONTROLLER_PID", raising=False)
    assert list(labkit.progress(range(5), desc="local")) == [0, 1, 2, 3, 4]
    assert list(labkit.progress(x for x in "abc")) == ["a", "b", "c"]  # no len: a count
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("local: 5/5 (100%) in ")
    assert out[-1].startswith("progress: 3 items in ")
    assert MARKER not in "".join(out)


def test_labkit_progress_is_the_function_even_after_the_launcher_is_imported():
    import labkit.launcher  # noqa: F401  (it imports the progress module)

    assert callable(labkit.progress) and labkit.progress.__name__ == "progress"
    assert list(labkit.progress(range(2))) == [0, 1]


def test_text_bars_print_about_every_tenth_and_the_end(capsys):
    bars = ProgressBars(widgets=False)
    for n in range(100):
        bars.update(0, {"id": 1, "n": n, "total": 100, "desc": "epoch", "elapsed": n / 10})
    bars.update(0, {"id": 1, "n": 100, "total": 100, "desc": "epoch", "elapsed": 10.0,
                    "done": True})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[rank0] epoch: 10/100 (10%) 1.0 s, 10.0 it/s"
    assert len(lines) == 10
    assert lines[-1] == "[rank0] epoch: 100/100 (100%) in 10.0 s, 10.0 it/s"


def test_widget_bars_show_one_row_per_rank_with_its_values(capsys):
    pytest.importorskip("ipywidgets")
    bars = ProgressBars(widgets=True)
    bars.feed(1, encode_update({"id": 0, "n": 0, "total": 40, "desc": "train", "elapsed": 0.0}))
    assert bars.box is not None and len(bars.box.children) == 1, "a row on the first update"
    bars.update(0, {"id": 0, "n": 10, "total": 40, "desc": "train", "elapsed": 2.0})
    bars.update(0, {"id": 0, "pos": 1, "n": 3, "total": None, "desc": "batch", "elapsed": 1.0})
    bars.update(1, {"id": 0, "n": 40, "total": 40, "desc": "train", "elapsed": 4.0, "done": True})
    rows = [[c for c in row.children] for row in bars.box.children]
    assert [label.value for label, _, _ in rows] == ["rank 0 train", "rank 0 batch",
                                                      "rank 1 train"]
    (_, bar0, status0), (_, inner, status_inner), (_, bar1, status1) = rows
    assert (bar0.value, bar0.max, bar0.bar_style) == (10, 40, "")
    assert status0.value == "10/40 (25%) 2.0 s, 5.0 it/s"
    assert (inner.value, status_inner.value) == (3, "3 items 1.0 s, 3.0 it/s")
    assert (bar1.value, bar1.max, bar1.bar_style) == (40, 40, "success")
    assert status1.value == "40/40 (100%) in 4.0 s, 10.0 it/s"
    bars.update(0, {"id": 0, "n": 12, "total": 40, "desc": "train", "elapsed": 3.0, "done": True})
    assert (bar0.value, bar0.bar_style) == (12, "warning"), "a loop left early shows it"
    assert "stopped early" in status0.value


def test_widget_bars_end_as_a_static_summary_that_a_saved_notebook_keeps(displayed):
    pytest.importorskip("ipywidgets")
    bars = ProgressBars(widgets=True)
    bars.update(0, {"id": 0, "n": 10, "total": 40, "desc": "train", "elapsed": 2.0})
    bars.update(1, {"id": 0, "n": 40, "total": 40, "desc": "train", "elapsed": 4.0, "done": True})
    bars.update(2, {"id": 0, "n": 5, "total": 40, "desc": "train", "elapsed": 1.0, "done": True})
    [(live, handle)] = displayed
    assert "application/vnd.jupyter.widget-view+json" in live
    assert "VBox" not in live["text/plain"] and "progress" in live["text/plain"]
    bars.finish()
    summary = handle.data
    assert summary["text/plain"].splitlines() == [
        "rank 0 train: 10/40 (25%) 2.0 s, 5.0 it/s",
        "rank 1 train: 40/40 (100%) in 4.0 s, 10.0 it/s",
        "rank 2 train: 5/40 (12%) stopped early in 1.0 s, 5.0 it/s"]
    # The saved bars keep the live ones' colours: blue while running, green once done, orange
    # for a loop left early.
    html = summary["text/html"]
    assert "<progress value='10' max='40' style='accent-color: var(--jp-brand-color1" in html
    assert "<progress value='40' max='40' style='accent-color: var(--jp-success-color1" in html
    assert "<progress value='5' max='40' style='accent-color: var(--jp-warn-color1" in html
    assert "application/vnd.jupyter.widget-view+json" not in summary, "no widget left to need"
    assert bars.box.comm is None, "the widgets are closed: a saved notebook keeps none of them"
    bars.finish()
    assert len(handle.updates) == 1, "finished once"


def test_widget_bars_say_the_workers_are_starting_then_how_long_it_took(displayed):
    pytest.importorskip("ipywidgets")
    bars = ProgressBars(widgets=True)
    bars.starting(4)
    [(_, handle)] = displayed
    assert bars.box.children[0].value == "starting 4 workers ...", "shown before any bar"
    bars.ready()
    header = bars.box.children[0].value
    assert header.startswith("starting 4 workers ... ready in ") and header.endswith(" s")
    bars.update(2, {"id": 0, "n": 1, "total": 2, "desc": "", "elapsed": 0.5})
    assert len(bars.box.children) == 2 and len(displayed) == 1, "one display for the run"
    bars.finish()
    assert handle.data["text/plain"].splitlines()[0] == header


def test_text_says_starting_and_ready_on_one_line(capsys):
    bars = ProgressBars(widgets=False)
    bars.starting(2)
    assert capsys.readouterr().out == "[labkit] starting 2 workers ...", "at once"
    time.sleep(0.1)
    bars.ready()
    bars.ready()  # said once
    bars.finish()
    line = capsys.readouterr().out
    assert line.startswith(" ready in ") and line.endswith(" s\n") and line.count("\n") == 1
    assert float(line.split()[2]) >= 0.1


def test_a_line_printed_before_the_workers_are_up_ends_the_starting_line(capsys):
    bars = ProgressBars(widgets=False)
    bars.starting(1)
    bars.update(0, {"id": 0, "n": 1, "total": 1, "desc": "", "elapsed": 0.5, "done": True})
    bars.ready()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[labkit] starting 1 worker ..."
    assert lines[1].startswith("[rank0] progress: 1/1")
    assert lines[2].startswith("[labkit] 1 worker ready in ")
    bars = ProgressBars(widgets=False)
    bars.starting(2)
    bars.finish()  # it failed before the workers were up: the line still ends
    assert capsys.readouterr().out == "[labkit] starting 2 workers ...\n"


def test_runs_started_together_say_it_in_whole_lines(capsys):
    import threading

    def run():
        bars = ProgressBars(widgets=False)
        bars.starting(3)
        bars.ready()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split(" ready in ")[0] for line in lines) == [
        "[labkit] 3 workers", "[labkit] 3 workers", "[labkit] starting 3 workers ...",
        "[labkit] starting 3 workers ..."]


def test_a_local_loop_in_the_notebook_leaves_a_summary_when_it_ends(monkeypatch, displayed):
    pytest.importorskip("ipywidgets")
    monkeypatch.delenv("LABKIT_CONTROLLER_PID", raising=False)
    monkeypatch.setattr("labkit._progress._notebook_widgets", lambda: True)
    for _ in labkit.progress(range(3), desc="outer"):
        for _ in labkit.progress(range(2), desc="inner"):
            pass
    [(_, handle)] = displayed
    assert handle.data["text/plain"].splitlines()[0].startswith("outer: 3/3 (100%) in ")
    assert handle.data["text/plain"].splitlines()[1].startswith("inner: 2/2 (100%) in ")


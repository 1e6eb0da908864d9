"""Notebook 11's graders: the solutions pass, answers written differently pass, and the usual
wrong answers get the hint that names their mistake."""

import collections
import math

import pytest

from labkit import exercises, precision, traces
from labkit.exercises import performance_principles as ex


@pytest.fixture(autouse=True)
def _own_progress_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))


@pytest.fixture(scope="module")
def solved():
    """The names that solutions/11_performance_principles.py's blocks define."""
    names = {}
    for block in exercises.solution_blocks("11_performance_principles").values():
        exec(block, names)
    return names


def not_yet(verdict, *words):
    assert not verdict, verdict
    text = f"{verdict.detail} {verdict.hint}"
    for word in words:
        assert word in text, text


# ---- attention_bytes -----------------------------------------------------------------------------

def test_attention_bytes_solution_passes(solved):
    verdict = ex.attention_bytes(solved["my_attention_bytes"])
    assert verdict, verdict


def test_attention_bytes_written_per_tensor_passes():
    def per_tensor(batch, heads, seq, head_dim, bytes_per_element, fused):
        qkvo = [seq * head_dim] * 4
        scores = [] if fused else [seq * seq] * 4  # S out, S in, P out, P in
        return batch * heads * bytes_per_element * sum(qkvo + scores)

    assert ex.attention_bytes(per_tensor)


@pytest.mark.parametrize("extra, words", [
    (lambda s: 2 * s * s, ("written once and read once",)),     # S and P each counted once
    (lambda s: s * s, ("both matrices",)),                        # P forgotten
    (lambda s: 0, ("fused flag is ignored",)),                    # no difference at all
    (lambda s: 4 * s, ("grow with seq squared",)),                # seq instead of seq squared
])
def test_attention_bytes_wrong_unfused_traffic(extra, words):
    def wrong(batch, heads, seq, head_dim, b, fused):
        more = 0 if fused else extra(seq)
        return batch * heads * b * (4 * seq * head_dim + more)

    not_yet(ex.attention_bytes(wrong), *words)


def test_attention_bytes_wrong_output_forgotten():
    def no_output(batch, heads, seq, head_dim, b, fused):
        return batch * heads * b * (3 * seq * head_dim + (0 if fused else 4 * seq * seq))

    not_yet(ex.attention_bytes(no_output), "O is also written")


def test_attention_bytes_wrong_elements_not_bytes():
    def elements(batch, heads, seq, head_dim, b, fused):
        return batch * heads * (4 * seq * head_dim + (0 if fused else 4 * seq * seq))

    not_yet(ex.attention_bytes(elements), "bytes_per_element")


def test_attention_bytes_wrong_type_is_not_yet_not_an_error():
    not_yet(ex.attention_bytes(lambda *a: "lots"), "return a number")
    not_yet(ex.attention_bytes(lambda *a: -1), "return a number")


# ---- exposed_communication -----------------------------------------------------------------------

def test_exposed_communication_solution_passes_with_and_without_a_recorded_trace(solved):
    assert ex.exposed_communication(solved["my_exposed_communication"])
    recorded = traces.load_trace(traces.synthetic_trace(steps=2, exposed=0.3, seed=7).trace)
    assert ex.exposed_communication(solved["my_exposed_communication"], events=recorded)


def sweep_line(events, is_comm, is_compute):
    """A different valid answer: one pass over the sorted start and end points."""
    points = []
    for e in events:
        if e["dur"] <= 0:
            continue
        kind = "comm" if is_comm(e) else "compute" if is_compute(e) else None
        if kind:
            points += [(e["ts"], 1, kind), (e["ts"] + e["dur"], -1, kind)]
    points.sort(key=lambda p: (p[0], p[1]))
    active = collections.Counter()
    exposed, last = 0.0, None
    for t, step, kind in points:
        if last is not None and active["comm"] > 0 and active["compute"] == 0:
            exposed += t - last
        active[kind] += step
        last = t
    return exposed / 1e6


def test_exposed_communication_sweep_line_passes():
    assert ex.exposed_communication(sweep_line)


def test_exposed_communication_wrong_sum_of_durations():
    def summed(events, is_comm, is_compute):  # two overlapping collectives counted twice
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if is_comm(e)]
        busy = traces.merge_intervals(e for e in
                                      [(x["ts"], x["ts"] + x["dur"]) for x in events
                                       if is_compute(x)])
        return sum(traces.intervals_total(traces.subtract_intervals([c], busy))
                   for c in comm) / 1e6

    not_yet(ex.exposed_communication(summed), "counted twice")


def test_exposed_communication_wrong_totals_subtracted():
    def totals(events, is_comm, is_compute):
        comm = sum(e["dur"] for e in events if is_comm(e))
        return max(0.0, comm - sum(e["dur"] for e in events if is_compute(e))) / 1e6

    not_yet(ex.exposed_communication(totals), "subtracting total durations")


def test_exposed_communication_wrong_microseconds():
    def micro(events, is_comm, is_compute):
        return traces.exposed_communication(events, comm=is_comm, compute=is_compute) * 1e6

    not_yet(ex.exposed_communication(micro), "microseconds")


def test_exposed_communication_wrong_compute_not_removed():
    def no_compute(events, is_comm, is_compute):
        return traces.intervals_total(traces.intervals(events, is_comm)) / 1e6

    not_yet(ex.exposed_communication(no_compute), "remove the time covered by compute")


def test_exposed_communication_wrong_on_the_recorded_trace_only():
    """Right on the hand-built traces (their classifiers), wrong with the library's: it ignores
    the classifiers it is given."""
    def ignores_classifiers(events, is_comm, is_compute):
        return traces.exposed_communication(
            events, comm=lambda e: e["name"] == "allreduce", compute=lambda e:
            e["cat"] == "compute")

    recorded = traces.load_trace(traces.synthetic_trace(steps=2, exposed=0.5, seed=3).trace)
    not_yet(ex.exposed_communication(ignores_classifiers, events=recorded), "recorded trace")


# ---- delayed_scaling -----------------------------------------------------------------------------

def test_delayed_scaling_solution_passes(solved):
    assert ex.delayed_scaling(solved["my_delayed_scales"])


def test_the_graders_histories_agree_with_the_library_scaler():
    for amaxes, fmt_max, history_len, margin in ex._HISTORIES:
        if fmt_max != 448.0:
            continue
        scaler = precision.DelayedScaler("e4m3", history_len=history_len, margin=margin)
        expected = [scaler.scale] + [scaler.update(a) for a in amaxes[:-1]]
        assert ex._delayed_reference(amaxes, fmt_max, history_len, margin) == expected


def deque_scales(amaxes, fmt_max, history_len, margin=0):
    """A different valid answer: a bounded deque, the scale computed before it is needed."""
    window, out, scale = collections.deque(maxlen=history_len), [], 1.0
    for amax in amaxes:
        out.append(scale)
        window.append(amax)
        top = max(window)
        scale = scale if top == 0 or math.isinf(top) else fmt_max / (top * 2 ** margin)
    return out


def test_delayed_scaling_deque_passes():
    assert ex.delayed_scaling(deque_scales)


def test_delayed_scaling_wrong_current_scaling():
    def current(amaxes, fmt_max, history_len, margin=0):
        out, history, scale = [], [], 1.0
        for amax in amaxes:
            history = (history + [amax])[-history_len:]
            if max(history) > 0:
                scale = fmt_max / max(history) / 2 ** margin
            out.append(scale)
        return out

    not_yet(ex.delayed_scaling(current), "current scaling")


def test_delayed_scaling_wrong_no_window():
    def forever(amaxes, fmt_max, history_len, margin=0):
        out, seen, scale = [], [], 1.0
        for amax in amaxes:
            out.append(scale)
            seen.append(amax)
            if max(seen) > 0:
                scale = fmt_max / max(seen) / 2 ** margin
        return out

    not_yet(ex.delayed_scaling(forever), "history keeps only the last")


def test_delayed_scaling_wrong_margin_ignored():
    not_yet(ex.delayed_scaling(lambda a, m, h, margin=0: deque_scales(a, m, h, 0)),
            "margin is ignored")


def test_delayed_scaling_wrong_inverted():
    def inverted(amaxes, fmt_max, history_len, margin=0):
        return [1.0] + [1 / s for s in deque_scales(amaxes, fmt_max, history_len, margin)[1:]]

    not_yet(ex.delayed_scaling(inverted), "upside down")


def test_delayed_scaling_wrong_zero_resets_the_scale():
    def zero_to_one(amaxes, fmt_max, history_len, margin=0):
        window, out, scale = collections.deque(maxlen=history_len), [], 1.0
        for amax in amaxes:
            out.append(scale)
            window.append(amax)
            scale = fmt_max / max(window) / 2 ** margin if max(window) > 0 else 1.0
        return out

    not_yet(ex.delayed_scaling(zero_to_one), "keep the previous one")


def test_delayed_scaling_wrong_length_and_type():
    not_yet(ex.delayed_scaling(lambda a, m, h, margin=0: [1.0]), "one scale per step")
    not_yet(ex.delayed_scaling(lambda a, m, h, margin=0: None), "one scale (a number)")


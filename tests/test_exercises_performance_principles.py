"""Notebook 11's graders: the solutions pass, answers written differently pass, and the usual
wrong answers get the hint that names their mistake."""

import collections
import math

import pytest

from labkit import exercises, traces
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


def test_placeholder_is_not_written_yet():
    def my_attention_bytes(batch, heads, seq, head_dim, bytes_per_element, fused):
        raise NotImplementedError("your code here")

    not_yet(ex.attention_bytes(my_attention_bytes), "not written yet")


# ---- attention_bytes -----------------------------------------------------------------------------

def test_attention_bytes_solution_passes(solved):
    verdict = ex.attention_bytes(solved["my_attention_bytes"])
    assert verdict and "seq 4096" in verdict.detail, verdict


def test_attention_bytes_written_per_tensor_passes():
    def per_tensor(batch, heads, seq, head_dim, bytes_per_element, fused):
        qkvo = [seq * head_dim] * 4
        scores = [] if fused else [seq * seq] * 4  # S out, S in, P out, P in
        return batch * heads * bytes_per_element * sum(qkvo + scores)

    assert ex.attention_bytes(per_tensor)


def test_attention_bytes_whole_float_passes():
    """Bytes computed in floats (a ratio first, 1 + seq/head_dim): a whole number still."""
    def ratio(batch, heads, seq, head_dim, bytes_per_element, *, fused):  # fused keyword-only
        fused_bytes = 4.0 * batch * heads * seq * head_dim * bytes_per_element
        return fused_bytes if fused else round(fused_bytes * (1 + seq / head_dim))

    assert ex.attention_bytes(ratio)


def attention(fused_elements, extra_elements):
    """An answer made of a fused count per (batch, head) and an unfused extra, in elements."""
    def answer(batch, heads, seq, head_dim, b, fused):
        more = 0 if fused else extra_elements(batch, heads, seq, head_dim)
        return batch * heads * b * fused_elements(seq, head_dim) + more * b
    return answer


def right_fused(s, d):
    return 4 * s * d


def bh(extra):
    return lambda batch, heads, s, d: batch * heads * extra(s, d)


@pytest.mark.parametrize("answer, words", [
    (attention(right_fused, bh(lambda s, d: 2 * s * s)), ("2 passes", "P forgotten")),
    (attention(right_fused, bh(lambda s, d: s * s)), ("1 pass over", "S written and read")),
    (attention(right_fused, bh(lambda s, d: 3 * s * s)), ("3 passes",)),
    (attention(right_fused, bh(lambda s, d: 4 * s)), ("multiply their traffic by 4",
                                                      "multiplied it by 2")),
    (attention(right_fused, bh(lambda s, d: 4 * s * d)), ("must not change with head_dim",)),
    (attention(right_fused, lambda batch, heads, s, d: heads * 4 * s * s),
     ("own S and P", "batch x heads")),
    (attention(lambda s, d: 3 * s * d, bh(lambda s, d: 4 * s * s)), ("O is also written",)),
    (attention(lambda s, d: 4 * s * d + 2 * s * s, bh(lambda s, d: 2 * s * s)),
     ("no seq x seq term",)),
])
def test_attention_bytes_wrong_dependence_gets_its_hint(answer, words):
    not_yet(ex.attention_bytes(answer), *words)


def elements(batch, heads, seq, head_dim, b, fused):
    return batch * heads * (4 * seq * head_dim + (0 if fused else 4 * seq * seq))


def scores_in_elements(batch, heads, seq, head_dim, b, fused):
    return batch * heads * (4 * seq * head_dim * b + (0 if fused else 4 * seq * seq))


def always_unfused(batch, heads, seq, head_dim, b, fused):
    return batch * heads * b * (4 * seq * head_dim + 4 * seq * seq)


def swapped(batch, heads, seq, head_dim, b, fused):
    return always_unfused(batch, heads, seq, head_dim, b, fused) if fused else \
        batch * heads * b * 4 * seq * head_dim


def seq_one_special(batch, heads, seq, head_dim, b, fused):
    if seq == 1:  # "nothing to attend to": a wrong special case
        return batch * heads * b * 4 * head_dim
    return always_unfused(batch, heads, seq, head_dim, b, False) if not fused else \
        batch * heads * b * 4 * seq * head_dim


@pytest.mark.parametrize("answer, words", [
    (elements, ("counts elements", "bytes_per_element")),
    (scores_in_elements, ("S and P traffic did not double with bytes_per_element",)),
    (always_unfused, ("fused flag is ignored",)),
    (lambda batch, heads, seq, head_dim, b, fused: batch * heads * b * 4 * seq * head_dim,
     ("fused flag is ignored",)),
    (swapped, ("swapped",)),
    (seq_one_special, ("special case",)),
])
def test_attention_bytes_wrong_answer_gets_its_hint(answer, words):
    not_yet(ex.attention_bytes(answer), *words)


def test_attention_bytes_not_a_whole_number_of_bytes():
    def scaled(batch, heads, seq, head_dim, b, fused):  # the 1/sqrt(d) of the scores, counted
        return always_unfused(batch, heads, seq, head_dim, b, fused) / math.sqrt(head_dim)

    not_yet(ex.attention_bytes(scaled), "not a whole number", "1/sqrt(head_dim)")
    not_yet(ex.attention_bytes(lambda *a, fused: "lots"), "not a number", "as an int")
    not_yet(ex.attention_bytes(lambda *a, fused: -1), "cannot be negative")
    not_yet(ex.attention_bytes(lambda *a, fused: math.nan), "not a whole number")


# ---- exposed_communication -----------------------------------------------------------------------

def far_from_zero(steps=2, seed=7):
    """A synthetic trace whose times lie where a recorded one's do: about 5.6e12 us."""
    raw = traces.synthetic_trace(steps=steps, exposed=0.5, seed=seed).trace
    for event in raw["traceEvents"]:
        if "ts" in event:
            event["ts"] += 5_631_539_449_351.094
    return traces.load_trace(raw)


def test_exposed_communication_solution_passes_with_and_without_a_recorded_trace(solved):
    assert ex.exposed_communication(solved["my_exposed_communication"])
    verdict = ex.exposed_communication(solved["my_exposed_communication"],
                                       events=far_from_zero())
    assert verdict and "the recorded one first" in verdict.detail, verdict


def sweep_line(events, is_comm, is_compute):
    """A different valid answer: one pass over the sorted start and end points."""
    points = []
    for e in events:
        kind = "comm" if is_comm(e) else "compute" if is_compute(e) else None
        if kind and e["dur"] > 0:
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


def with_the_library(events, is_comm, is_compute):
    """Another valid answer: labkit's interval functions, in the order the lesson gives them."""
    comm = traces.intervals(events, is_comm)
    busy = traces.merge_intervals(traces.intervals(events, is_compute))
    return traces.intervals_total(traces.subtract_intervals(comm, busy)) / 1e6


@pytest.mark.parametrize("answer", [sweep_line, with_the_library])
def test_exposed_communication_written_another_way_passes(answer):
    assert ex.exposed_communication(answer, events=far_from_zero())


def spans(events, keep):
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if keep(e)]


def summed_durations(events, is_comm, is_compute):
    return sum(e["dur"] for e in events if is_comm(e)) / 1e6


def per_collective(events, is_comm, is_compute):  # overlapping collectives counted twice
    busy = traces.merge_intervals(spans(events, is_compute))
    return sum(traces.intervals_total(traces.subtract_intervals([c], busy))
               for c in spans(events, is_comm)) / 1e6


def totals_clamped(events, is_comm, is_compute):
    comm = sum(e["dur"] for e in events if is_comm(e))
    return max(0.0, comm - sum(e["dur"] for e in events if is_compute(e))) / 1e6


def totals(events, is_comm, is_compute):
    comm = sum(e["dur"] for e in events if is_comm(e))
    return (comm - sum(e["dur"] for e in events if is_compute(e))) / 1e6


def compute_not_merged(events, is_comm, is_compute):
    exposed = 0.0
    for a, b in traces.merge_intervals(spans(events, is_comm)):
        covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans(events, is_compute))
        exposed += max(0.0, (b - a) - covered)
    return exposed / 1e6


def microseconds(events, is_comm, is_compute):
    return with_the_library(events, is_comm, is_compute) * 1e6


def no_compute(events, is_comm, is_compute):
    return traces.intervals_total(spans(events, is_comm)) / 1e6


def everything_else_is_compute(events, is_comm, is_compute):
    return with_the_library(events, is_comm, lambda e: not is_comm(e))


@pytest.mark.parametrize("answer, words", [
    (summed_durations, ("total duration", "count once")),
    (per_collective, ("counted twice", "union")),
    (totals_clamped, ("subtracting total durations",)),
    (totals, ("subtracting total durations", "negative")),
    (compute_not_merged, ("taken away twice", "merge the compute intervals")),
    (microseconds, ("in microseconds", "divide by 1e6")),
    (no_compute, ("no compute was taken away",)),
    (everything_else_is_compute, ("what is_compute accepts",)),
])
def test_exposed_communication_wrong_answer_gets_its_hint(answer, words):
    not_yet(ex.exposed_communication(answer), *words)


def test_exposed_communication_wrong_on_the_recorded_trace_only():
    """Right on the hand-built traces (their classifiers), wrong with the library's: it ignores
    the classifiers it is given."""
    def own_tests(events, is_comm, is_compute):
        return with_the_library(events, lambda e: e["name"] == "allreduce",
                                lambda e: e["cat"] == "compute")

    not_yet(ex.exposed_communication(own_tests, events=far_from_zero()), "recorded trace",
            "is_comm and is_compute you are given")


def seconds_first(events, is_comm, is_compute):
    """A valid answer that rounds more: every time turned into seconds before subtracting (a
    recorded trace's times are near 5.6e12 us, where a float keeps about 1e-9 s)."""
    def seconds(keep):
        return [(a / 1e6, b / 1e6) for a, b in spans(events, keep)]
    return traces.intervals_total(traces.subtract_intervals(seconds(is_comm),
                                                            seconds(is_compute)))


def test_exposed_communication_seconds_before_subtracting_passes_far_from_zero():
    """3e-9 s off the reference on 40 steps near 5.6e12 us (the same floats every run): within
    the rounding of the trace's own times, so a pass."""
    long = far_from_zero(steps=40, seed=2)
    right = traces.exposed_communication(long)
    assert abs(seconds_first(long, traces.is_communication, traces.is_cpu_compute)
               - right) > 2e-9
    assert ex.exposed_communication(seconds_first, events=long)


def test_exposed_communication_off_by_under_a_microsecond_is_a_rounding_hint():
    def float32_total(events, is_comm, is_compute):  # the total kept in float32, say
        exact = with_the_library(events, is_comm, is_compute)
        return exact + 5e-7 if exact > 1e-3 else exact

    not_yet(ex.exposed_communication(float32_total, events=far_from_zero(steps=40, seed=2)),
            "under a microsecond", "float64 microseconds")


def test_exposed_communication_wrong_type_and_learner_errors():
    not_yet(ex.exposed_communication(lambda ev, c, p: None), "number of seconds")
    not_yet(ex.exposed_communication(lambda ev, c, p: math.nan), "number of seconds")

    def fails_on_empty(events, is_comm, is_compute):
        first = min(e["ts"] for e in events)  # max()/min() of an empty trace
        return sweep_line(events, is_comm, is_compute) + 0 * first

    not_yet(ex.exposed_communication(fails_on_empty), "your code raised ValueError")


# ---- delayed_scaling -----------------------------------------------------------------------------

def test_delayed_scaling_solution_passes(solved):
    assert ex.delayed_scaling(solved["my_delayed_scales"])


def deque_scales(amaxes, fmt_max, history_len, margin=0):
    """A different valid answer: a bounded deque, the scale computed before it is needed."""
    window, out, scale = collections.deque(maxlen=history_len), [], 1.0
    for amax in amaxes:
        out.append(scale)
        window.append(amax)
        top = max(window)
        scale = scale if top == 0 or math.isinf(top) else fmt_max / (top * 2 ** margin)
    return out


def from_scratch(amaxes, fmt_max, history_len, margin=0):
    """Another valid answer: each step's window sliced afresh, scales kept in a tuple."""
    scales = (1.0,)
    for t in range(1, len(amaxes)):
        top = max(amaxes[max(0, t - history_len):t])
        scales += (fmt_max / top * 2.0 ** -margin if top > 0 else scales[-1],)
    return scales


@pytest.mark.parametrize("answer", [deque_scales, from_scratch])
def test_delayed_scaling_written_another_way_passes(answer):
    assert ex.delayed_scaling(answer)


def scales_with(scale_of, *, first=1.0, skip_zeros=False, zero_to_one=False, current=False):
    """Delayed scaling with one thing changed: how a scale is made, the first one, zeros."""
    def answer(amaxes, fmt_max, history_len, margin=0):
        out, window, scale = [], collections.deque(maxlen=history_len), first
        for amax in amaxes:
            if not current:
                out.append(scale)
            if not (skip_zeros and amax == 0):
                window.append(amax)
            if max(window, default=0) > 0:
                scale = scale_of(fmt_max, max(window), margin)
            elif zero_to_one:
                scale = 1.0
            if current:
                out.append(scale)
        return out
    return answer


def right_scale(fmt_max, amax, margin):
    return fmt_max / amax / 2 ** margin


def no_window(amaxes, fmt_max, history_len, margin=0):
    return deque_scales(amaxes, fmt_max, len(amaxes) + 1, margin)


@pytest.mark.parametrize("answer, words", [
    (scales_with(right_scale, current=True), ("current scaling",)),
    (no_window, ("last history_len amaxes",)),
    (scales_with(lambda f, a, m: f / a), ("margin is ignored",)),
    (scales_with(lambda f, a, m: f / a * 2 ** m), ("margin multiplies the scale",)),
    (scales_with(lambda f, a, m: a / f * 2 ** m), ("upside down",)),
    (scales_with(lambda f, a, m: a / f / 2 ** m), ("upside down",)),
    (scales_with(right_scale, first=448.0), ("first step", "1.0")),
    (scales_with(right_scale, zero_to_one=True), ("keep the previous scale, not 1.0",)),
    (scales_with(right_scale, skip_zeros=True), ("takes its place in the window",)),
    (scales_with(right_scale, skip_zeros=True, first=448.0), ("first step",)),
])
def test_delayed_scaling_wrong_answer_gets_its_hint(answer, words):
    not_yet(ex.delayed_scaling(answer), *words)


def test_delayed_scaling_wrong_length_and_type():
    not_yet(ex.delayed_scaling(lambda a, m, h, margin=0: [1.0]), "one scale per step")
    not_yet(ex.delayed_scaling(lambda a, m, h, margin=0: deque_scales(a + [1.0], m, h, margin)),
            "one scale per step")
    not_yet(ex.delayed_scaling(lambda a, m, h, margin=0: None), "one scale (a number)")


def test_delayed_scaling_division_by_a_zero_amax_is_the_learners_error():
    not_yet(ex.delayed_scaling(lambda a, m, h, margin=0: [m / x for x in a]),
            "your code raised ZeroDivisionError")

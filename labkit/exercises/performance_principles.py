"""Notebook 11's exercises: the bytes attention moves, a trace's exposed communication, delayed
FP8 scaling.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint. The three are arithmetic (a byte
count, interval arithmetic over trace events, a scale sequence), graded in the kernel against
labkit's own functions on cases the learner has not seen; where the answer is wrong, the grader
probes it (one argument changed at a time, traces built to separate the usual mistakes, the
same histories replayed with the usual mistakes) so the hint names the mistake, not only the
wrong number. Nothing here imports torch when the module is imported.
"""

from __future__ import annotations

import math
import numbers

from ..check import NotYet, exercise

NOTEBOOK = "11"


# ---- attention_bytes: what attention's forward moves, fused or not ----------------------------

_ARGS = ("batch", "heads", "seq", "head_dim", "bytes_per_element")
_SHAPES = [  # (batch, heads, seq, head_dim, bytes_per_element): every argument 1 somewhere
    (1, 1, 1, 1, 1), (2, 3, 5, 7, 2), (4, 1, 3, 1, 4), (1, 4, 64, 16, 2), (3, 2, 128, 64, 4),
    (2, 8, 1024, 128, 2), (1, 1, 4096, 64, 1),
]
_PROBE = (2, 3, 6, 5, 2)  # the shape the probes start from: s, d, s*d and s*s all tell apart


def _attention_reference(shape, fused: bool) -> int:
    from ..machine import attention_intensity

    return attention_intensity(*shape, fused=fused)["bytes"]


def _call(shape, fused: bool) -> str:
    return f"my_attention_bytes({', '.join(map(str, shape))}, fused={fused})"


def _attention_value(fn, shape, fused: bool) -> int:
    """``fn``'s bytes for ``shape``, or a NotYet if that is not a whole number >= 0."""
    value = fn(*shape, fused=fused)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise NotYet(f"{_call(shape, fused)} returned {value!r}, not a number",
                     "return the number of bytes as an int (int(x) if you computed it as a "
                     "tensor or an array)")
    if not math.isfinite(value) or value != int(value):
        raise NotYet(f"{_call(shape, fused)} returned {value!r}, not a whole number",
                     "a count of bytes is whole: elements (products of the sizes) times "
                     "bytes_per_element; nothing in it divides (the 1/sqrt(head_dim) scale of "
                     "the scores moves no bytes)")
    if value < 0:
        raise NotYet(f"{_call(shape, fused)} returned {value!r}",
                     "bytes moved cannot be negative: add up what is read and what is written")
    return int(value)


def _attention_mistake(fn) -> str:
    """Which dependence is wrong, found by changing one argument of ``_PROBE`` at a time."""
    def at(fused, **change):
        shape = dict(zip(_ARGS, _PROBE, strict=True))
        shape.update(change)
        return _attention_value(fn, tuple(shape.values()), fused)

    def extra(**change):
        return at(False, **change) - at(True, **change)

    b, h, s, d, e = _PROBE
    fused, unfused = at(True), at(False)
    right_fused = _attention_reference(_PROBE, True)
    right_extra = _attention_reference(_PROBE, False) - right_fused
    if fused == unfused:
        return ("fused and unfused came out the same: the fused flag is ignored (unfused, the "
                "three kernels also write S and P to memory and read them back; fused, they "
                "stay on chip)")
    if (fused, unfused) == (right_fused + right_extra, right_fused):
        return "fused and unfused are swapped: the fused kernel is the one that moves less"
    if fused != right_fused:  # Q, K, V read and O written
        if at(True, bytes_per_element=2 * e) == fused:
            return ("the fused count did not change with bytes_per_element: that counts "
                    "elements; multiply every element count by bytes_per_element")
        if at(True, batch=2 * b) != 2 * fused or at(True, heads=2 * h) != 2 * fused:
            return ("fused: every (batch, head) pair has its own Q, K, V and O: doubling batch "
                    "or heads must double the bytes (multiply by batch x heads)")
        if at(True, seq=2 * s) != 2 * fused:
            return ("fused: doubling seq must double the bytes, no more: a fused kernel keeps "
                    "the seq x seq scores on chip, so no seq x seq term is counted")
        if at(True, head_dim=2 * d) != 2 * fused:
            return ("fused: Q, K, V and O are seq x head_dim each: doubling head_dim must "
                    "double the bytes")
        if 4 * fused == 3 * right_fused:
            return ("fused: Q, K and V are read, and O is also written once: 4 tensors of seq "
                    "x head_dim per (batch, head), not 3")
        return ("fused: Q, K and V read once and O written once: 4 x batch x heads x seq x "
                "head_dim elements, times bytes_per_element")
    more = unfused - fused  # what S and P add, unfused
    if extra(bytes_per_element=2 * e) != 2 * more:
        return ("the S and P traffic did not double with bytes_per_element: it is counted in "
                "elements; multiply it by bytes_per_element too")
    if extra(batch=2 * b) != 2 * more or extra(heads=2 * h) != 2 * more:
        return ("unfused: every (batch, head) pair has its own S and P: doubling batch or "
                "heads must double the extra traffic (multiply by batch x heads)")
    if extra(head_dim=2 * d) != more:
        return ("unfused: the extra traffic is of S and P, (seq x seq) each whatever head_dim: "
                "it must not change with head_dim")
    grown = extra(seq=2 * s)
    if grown != 4 * more:
        return ("unfused: S and P are seq x seq: doubling seq must multiply their traffic by 4, "
                f"and it multiplied it by {grown / more:g}" if more else
                "unfused: S and P are seq x seq, written and read: the extra traffic must grow "
                "with seq squared")
    if more == right_extra:
        return (f"right for batch {b}, heads {h}, seq {s}, head_dim {d} and {e} bytes per "
                "element, wrong for the shape above: look for a special case (an if on seq, "
                "head_dim or bytes_per_element); the same formula holds for every size")
    share = 4 * more / right_extra  # how many of the 4 passes over a seq x seq matrix
    said = (f"{share:g} pass{'es' * (share != 1)} over a seq x seq matrix where there are 4"
            if share == int(share) else "the S and P traffic is off")
    if share == 2:
        said += " (S and P each counted once, or P forgotten)"
    return (f"unfused: {said}: S = QK^T is written, softmax reads S and writes P, P V reads P: "
            "S written and read, P written and read")


@exercise("attention_bytes", notebook=NOTEBOOK,
          title="the bytes attention moves, fused and unfused")
def attention_bytes(fn) -> str:
    """Exercise: ``fn(batch, heads, seq, head_dim, bytes_per_element, fused)`` is the bytes
    attention's forward moves (Q, K, V read, O written; unfused adds S and P written and read).

    Graded against :func:`labkit.machine.attention_intensity` on seven shapes, both ways (every
    argument 1 in some shape, 1, 2 and 4 bytes per element); a wrong answer is probed, one
    argument changed at a time, for the dependence it gets wrong.

    Example::

        >>> exercise.attention_bytes(my_attention_bytes)
        [pass] the bytes attention moves, fused and unfused: ...
    """
    for shape in _SHAPES:
        for fused in (True, False):
            value, right = _attention_value(fn, shape, fused), _attention_reference(shape, fused)
            if value != right:
                raise NotYet(f"{_call(shape, fused)} = {value:,}, expected {right:,}",
                             _attention_mistake(fn))
    return (f"{len(_SHAPES)} shapes, fused and unfused, from a single position to seq 4096 and "
            "1, 2 and 4 bytes per element: Q, K, V and O, plus S and P written and read when "
            "unfused")


# ---- exposed_communication: interval arithmetic over a trace's events --------------------------

def _event(name, cat, ts, dur, tid=1) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid,
            "args": {}}


def _is_comm(event) -> bool:  # the classifiers of the traces built by hand
    return event["name"] == "allreduce"


def _is_compute(event) -> bool:
    return event["cat"] == "compute"


def _hand_traces() -> list[tuple[str, list[dict]]]:
    """Traces built to tell the usual mistakes apart (times in microseconds), read by
    :func:`labkit.traces.load_trace` as a recorded trace is (sorted by start)."""
    from ..traces import load_trace

    def comm(ts, dur, tid=2):
        return _event("allreduce", "comm", ts, dur, tid)

    def work(ts, dur, tid=1):
        return _event("mm", "compute", ts, dur, tid)

    traces = [
        ("an empty trace", []),
        ("a collective inside a longer compute span", [comm(10, 50), work(0, 100)]),
        ("collectives and no compute at all", [comm(0, 30), comm(100, 20)]),
        ("two overlapping collectives", [comm(0, 60), comm(40, 60, 3), work(0, 20)]),
        ("a collective across two compute spans with a gap", [comm(0, 100), work(10, 20),
                                                              work(50, 20)]),
        ("overlapping compute on two threads", [comm(0, 100), work(10, 50), work(30, 50, 4)]),
        ("compute before and after a collective", [work(0, 30), comm(20, 40), work(50, 30)]),
        ("zero-length events", [comm(5, 0), comm(10, 10), work(12, 0)]),
        ("a range that is neither", [comm(0, 100), _event("step", "range", 0, 200),
                                     work(20, 20)]),
    ]
    return [(name, load_trace(events)) for name, events in traces]


def _exposed_mistakes():
    """Each usual mistake as the value it gives on a hand-built trace, and the hint naming it."""
    from .. import traces as tr

    def right(events):
        return tr.exposed_communication(events, comm=_is_comm, compute=_is_compute)

    def durations(events, keep):
        return sum(e["dur"] for e in events if keep(e)) / 1e6

    def per_collective(events):  # each collective's uncovered part, summed: overlaps twice
        busy = tr.intervals(events, _is_compute)
        return sum(tr.intervals_total(tr.subtract_intervals([span], busy))
                   for span in tr.intervals(events, _is_comm)) / 1e6

    def unmerged_compute(events, clamp):  # each compute span's overlap taken away on its own
        busy = tr.intervals(events, _is_compute)
        out = 0.0
        for a, b in tr.merge_intervals(tr.intervals(events, _is_comm)):
            left = (b - a) - sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)
            out += max(0.0, left) if clamp else left
        return out / 1e6

    def not_comm_is_compute(events):
        return tr.exposed_communication(events, comm=_is_comm,
                                        compute=lambda e: not _is_comm(e))

    totals = ("subtracting total durations is not enough: compute that runs while no "
              "collective does hides nothing, and the difference can even go negative; take "
              "the communication intervals and cut out the parts that compute covers")
    unmerged = ("compute spans that overlap each other (on two threads) were taken away twice: "
                "merge the compute intervals into their union before cutting them out of the "
                "communication")
    return [
        (lambda ev: right(ev) * 1e6,
         "the result is in microseconds: trace times are, the answer is in seconds (divide "
         "by 1e6)"),
        (lambda ev: durations(ev, _is_comm),
         "that is the collectives' total duration: overlapping collectives count once (merge "
         "them into their union), and the time that compute covers is not exposed"),
        (per_collective,
         "two collectives that overlap each other were counted twice: merge the communication "
         "intervals into their union first, then cut out the compute"),
        (lambda ev: max(0.0, durations(ev, _is_comm) - durations(ev, _is_compute)), totals),
        (lambda ev: durations(ev, _is_comm) - durations(ev, _is_compute), totals),
        (lambda ev: unmerged_compute(ev, clamp=False), unmerged),
        (lambda ev: unmerged_compute(ev, clamp=True), unmerged),
        (lambda ev: tr.intervals_total(tr.intervals(ev, _is_comm)) / 1e6,
         "no compute was taken away: remove the time covered by compute events"),
        (not_comm_is_compute,
         "compute is what is_compute accepts, not every event that is not communication (a "
         "range around the whole step would hide everything)"),
    ]


def _seconds(fn, name, events, is_comm, is_compute) -> float:
    """``fn``'s answer on one trace, or a NotYet if it is not a number of seconds."""
    value = fn(events, is_comm, is_compute)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value:
        raise NotYet(f"on {name}, my_exposed_communication returned {value!r}",
                     "return the exposed time as a number of seconds (a float; float(x) if "
                     "you computed it as a tensor)")
    return float(value)


def _exposed_mistake(fn, name, events, is_comm, is_compute, value, right) -> str:
    """The hint for a wrong ``value`` on trace ``name``: the usual mistake whose values the
    answer gives on every trace built by hand, or what else tells it."""
    from .. import traces as tr

    cases = _hand_traces()
    said = [_seconds(fn, n, ev, _is_comm, _is_compute) for n, ev in cases]
    for mistake, hint in _exposed_mistakes():
        if all(math.isclose(v, mistake(ev), abs_tol=1e-9) for v, (_, ev) in zip(said, cases,
                                                                                strict=True)):
            return hint
    if value < 0 or any(v < 0 for v in said):
        return ("a time cannot be negative: subtracting the compute's total from the "
                "communication's counts compute that overlaps nothing; cut the compute "
                "intervals out of the communication intervals instead")
    if all(math.isclose(v, tr.exposed_communication(ev, comm=_is_comm, compute=_is_compute),
                        abs_tol=1e-9) for v, (_, ev) in zip(said, cases, strict=True)):
        mine = tr.exposed_communication(events, comm=_is_comm, compute=_is_compute)
        if math.isclose(value, mine, abs_tol=1e-9):
            return ("classify the events with the is_comm and is_compute you are given: on "
                    f"{name} your answer is what tests of your own would give")
        if abs(value - right) < 1e-6:
            return (f"off by {abs(value - right):.2g} s, under a microsecond: rounding more "
                    "than the times' own? A recorded trace's times are microseconds far from "
                    "0 (about 1e12), where a float keeps about a nanosecond: work in the "
                    "trace's floats (float64 microseconds), subtract start from end, and "
                    "divide the total by 1e6 once, at the end")
        return (f"right on {len(cases)} traces built by hand, wrong on {name}: it has "
                "nested ops on one thread, several threads and times far from 0; merge each "
                "kind's intervals into a union before subtracting, whatever their order")
    return ("merge the communication intervals into a union first (two collectives that "
            "overlap count once), merge the compute intervals too, then total what the first "
            "union covers and the second does not, in seconds")


def _tolerance(events, is_comm, is_compute) -> float:
    """1e-9 s, plus the rounding a right answer may add on this trace: times divided by 1e6
    before subtracting are rounded to the float spacing (ulp) at the trace's latest time in
    seconds, about 1e-9 s on a recorded trace (its times lie near 1e12 us), twice for each
    exposed piece and each merged collective. On the traces built here, next to nothing."""
    from .. import traces as tr

    ends = [e["ts"] + e["dur"] for e in events if is_comm(e) or is_compute(e)]
    if not ends:
        return 1e-9
    comm = tr.intervals(events, is_comm)
    pieces = tr.subtract_intervals(comm, tr.intervals(events, is_compute))
    return 1e-9 + 2 * (len(pieces) + len(tr.merge_intervals(comm))) * math.ulp(
        max(abs(x) for x in ends) / 1e6)


@exercise("exposed_communication", notebook=NOTEBOOK, title="exposed communication in a trace")
def exposed_communication(fn, events=None) -> str:
    """Exercise: ``fn(events, is_comm, is_compute)`` is the seconds during which a collective
    runs and no compute does.

    Graded against :func:`labkit.traces.exposed_communication` (to 1e-9 s, plus the
    rounding of the trace's times in seconds, see :func:`_tolerance`) on ``events`` (a
    recorded trace's, when given), on traces built by hand to separate the usual mistakes
    (overlapping collectives, compute on two threads, a gap between compute spans, zero-length
    events, an empty trace...), and on seeded synthetic traces (fully hidden, half, fully
    exposed).

    Example::

        >>> exercise.exposed_communication(my_exposed_communication, events=events)
        [pass] exposed communication in a trace: ...
    """
    from .. import traces as tr

    checked = [(name, case, _is_comm, _is_compute) for name, case in _hand_traces()]
    for seed, share in enumerate((0.0, 0.5, 1.0)):  # seeded: durations no other trace has
        synthetic = tr.load_trace(tr.synthetic_trace(steps=3, exposed=share, seed=seed).trace)
        checked.append((f"an unseen trace {share:.0%} exposed", synthetic,
                        tr.is_communication, tr.is_cpu_compute))
    if events is not None:
        checked.insert(0, ("the recorded trace", list(events), tr.is_communication,
                           tr.is_cpu_compute))
    for name, case, is_comm, is_compute in checked:
        right = tr.exposed_communication(case, comm=is_comm, compute=is_compute)
        value = _seconds(fn, name, case, is_comm, is_compute)
        if not math.isclose(value, right, rel_tol=0.0,
                            abs_tol=_tolerance(case, is_comm, is_compute)):
            raise NotYet(f"on {name}: {value:.9g} s, expected {right:.9g} s",
                         _exposed_mistake(fn, name, case, is_comm, is_compute, value, right))
    return (f"{len(checked)} traces{' (the recorded one first)' if events is not None else ''}: "
            "overlapping collectives counted once, compute on several threads merged, gaps "
            "and zero-length events, microseconds turned into seconds")


# ---- delayed_scaling: the scale each FP8 cast uses ----------------------------------------------

_HISTORIES = [  # (amaxes, fmt_max, history_len, margin): 448 is e4m3's max, 57344 e5m2's
    ([2.0, 1.0, 1.0, 4.0, 0.5], 448.0, 2, 0),  # falling, then a spike
    ([1.0, 3.0, 2.0, 1.0, 1.0, 1.0], 448.0, 3, 0),  # the 3.0 leaves a window of 3
    ([1.0, 8.0, 1.0, 1.0], 448.0, 1, 0),
    ([0.5, 1.0, 2.0, 4.0], 448.0, 3, 1),  # rising
    ([0.0, 0.0, 2.0, 0.0], 448.0, 2, 0),  # zeros first: nothing to scale to yet
    ([2.0, 0.0, 0.0, 0.0], 448.0, 1, 0),  # the 2.0 leaves the window: keep its scale
    ([4.0, 0.0, 1.0, 1.0], 448.0, 2, 0),  # a zero takes its place in the window
    ([4.0, 2.0, 16.0, 1.0, 1.0], 57344.0, 4, 1),
    ([0.5, 0.25, 1.0], 448.0, 1024, 2),
]


def _scaler_scales(amaxes, fmt_max, history_len, margin, *, current=False) -> list[float]:
    """The scales :class:`labkit.precision.DelayedScaler` casts with, step by step (with
    ``current``, the scale after each step's own amax: current scaling's mistake)."""
    from ..precision import DelayedScaler, format_facts

    fmt = next(f for f in ("e4m3", "e5m2") if format_facts(f)["max"] == fmt_max)
    scaler = DelayedScaler(fmt, history_len=history_len, margin=margin)
    if current:
        return [scaler.update(a) for a in amaxes]
    return [scaler.scale] + [scaler.update(a) for a in amaxes[:-1]]


def _scales(fn, amaxes, fmt_max, history_len, margin) -> list[float]:
    """``fn``'s scales for one history, or a NotYet if they are not one number per step."""
    got = fn(list(amaxes), fmt_max, history_len, margin)
    try:
        got = [float(s) for s in got]
    except (TypeError, ValueError):
        raise NotYet(f"my_delayed_scales returned {got!r}",
                     "return a list with one scale (a number) per step") from None
    if len(got) != len(amaxes):
        raise NotYet(f"{len(got)} scales for {len(amaxes)} steps",
                     "return one scale per step: the one its cast used (not the one computed "
                     "after the last step)")
    return got


def _close(a, b) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9)
                                    for x, y in zip(a, b, strict=True))


def _delayed_mistakes():
    """Each usual mistake as the scales it gives for one history, and the hint naming it."""
    def margin_times(amaxes, fmt_max, history_len, margin):  # x 2^margin where it divides
        return [s if s == 1.0 else s * 2 ** margin
                for s in _scaler_scales(amaxes, fmt_max, history_len, 0)]

    def zeros_skipped(amaxes, fmt_max, history_len, margin):  # a 0 never enters the window
        kept = _scaler_scales([a for a in amaxes if a] + [0.0], fmt_max, history_len, margin)
        at, out = 0, []
        for a in amaxes:
            out.append(kept[at])
            at += bool(a)
        return out

    def zeros_reset(amaxes, fmt_max, history_len, margin):  # 1.0 while the window holds 0s
        right = _scaler_scales(amaxes, fmt_max, history_len, margin)
        return [s if t == 0 or max(amaxes[max(0, t - history_len):t]) > 0 else 1.0
                for t, s in enumerate(right)]

    return [
        (lambda *h: _scaler_scales(*h, current=True),
         "each step used the scale from its own amax: that is current scaling. Delayed scaling "
         "casts step t with the scale from the steps before t (step 0 uses 1.0)"),
        (lambda a, f, n, m: _scaler_scales(a, f, len(a) + 1, m),
         "the history keeps only the last history_len amaxes: an old maximum leaves the "
         "window, and the scale grows back"),
        (lambda a, f, n, m: _scaler_scales(a, f, n, 0),
         "the margin is ignored: divide the scale by 2 ** margin (headroom for an amax that "
         "grows)"),
        (margin_times,
         "the margin multiplies the scale: it must divide it, scale = fmt_max / amax / 2 ** "
         "margin, so that an amax up to 2 ** margin times larger still fits"),
        (lambda *h: [1 / s for s in _scaler_scales(*h)],
         "the scale is upside down: scale = fmt_max / amax, so that amax x scale lands on the "
         "format's max"),
        (lambda *h: [1 / s for s in margin_times(*h)],
         "the scale is upside down: scale = fmt_max / amax / 2 ** margin, so that amax x scale "
         "lands on the format's max, less the margin"),
        (zeros_reset,
         "a window whose largest amax is 0 gives no scale to compute (fmt_max / 0): keep the "
         "previous scale, not 1.0"),
        (zeros_skipped,
         "a step whose amax is 0 still takes its place in the window and pushes the oldest "
         "amax out: only the last history_len steps count, zeros included"),
    ]


def _scales_mistake(fn, got, history) -> str:
    """The hint for the wrong scales ``got`` on ``history``."""
    said = [_scales(fn, *h) for h in _HISTORIES]
    for mistake, hint in _delayed_mistakes():
        if all(_close(s, mistake(*h)) for s, h in zip(said, _HISTORIES, strict=True)):
            return hint
    if not math.isclose(got[0], 1.0):
        return "the first step has no history yet: it casts with a scale of 1.0"
    if 0.0 in history[0] and all(_close(s, _scaler_scales(*h)) for s, h in
                                 zip(said, _HISTORIES, strict=True) if 0.0 not in h[0]):
        return ("right without zeros, wrong with them: a step whose amax is 0 still takes its "
                "place in the window (and pushes the oldest out); only when the window's "
                "largest amax is 0 is there no scale to compute: keep the previous one")
    return ("scale_t = fmt_max / max(the last history_len amaxes before t) / 2 ** margin; "
            "1.0 at step 0, and the previous scale while the window's largest amax is 0")


@exercise("delayed_scaling", notebook=NOTEBOOK, title="delayed FP8 scaling from an amax history")
def delayed_scaling(fn) -> str:
    """Exercise: ``fn(amaxes, fmt_max, history_len, margin=0)`` is the list of scales each
    step's cast uses under delayed scaling.

    Graded on nine scripted histories (rising, falling, a maximum leaving windows of 1, 2 and
    3, zeros, e4m3's and e5m2's maxima, margins 0 to 2) against the scales
    :class:`labkit.precision.DelayedScaler` casts with.

    Example::

        >>> exercise.delayed_scaling(my_delayed_scales)
        [pass] delayed FP8 scaling from an amax history: ...
    """
    for history in _HISTORIES:
        amaxes, fmt_max, history_len, margin = history
        right = _scaler_scales(*history)
        got = _scales(fn, *history)
        if not _close(got, right):
            said = (f"amaxes {amaxes}, fmt_max {fmt_max:g}, history_len {history_len}, margin "
                    f"{margin}: scales {[round(g, 4) for g in got]}, expected "
                    f"{[round(r, 4) for r in right]}")
            raise NotYet(said, _scales_mistake(fn, got, history))
    return (f"{len(_HISTORIES)} amax histories: the scale from the steps before, within the "
            "window, with the margin, the previous scale kept while the window holds only zeros")

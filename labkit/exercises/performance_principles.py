"""Notebook 11's exercises: the bytes attention moves, a trace's exposed communication, delayed
FP8 scaling.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint. The three are arithmetic (a byte
count, interval arithmetic over trace events, a scale sequence), graded in the kernel against
labkit's own functions on cases the learner has not seen; where the answer is wrong, the grader
probes it (one argument changed at a time, traces built to separate the usual mistakes) so the
hint names the mistake, not only the wrong number.
"""

from __future__ import annotations

import math

from ..check import NotYet, exercise

NOTEBOOK = "11"


# ---- attention_bytes: what attention's forward moves, fused or not ----------------------------

_SHAPES = [  # (batch, heads, seq, head_dim, bytes_per_element)
    (1, 1, 1, 1, 1), (2, 3, 5, 7, 2), (1, 4, 64, 16, 2), (3, 2, 128, 64, 4), (2, 8, 1024, 128, 2),
    (1, 1, 4096, 64, 1),
]


def _attention_reference(batch, heads, seq, head_dim, b, fused) -> int:
    from ..machine import attention_intensity

    return attention_intensity(batch, heads, seq, head_dim, b, fused=fused)["bytes"]


def _attention_mistake(fn) -> str:
    """Which dependence is wrong, found by changing one argument at a time from a base shape."""
    base = (2, 3, 8, 4, 2)

    def got(fused, **change):
        shape = dict(zip(("batch", "heads", "seq", "head_dim", "bytes_per_element"), base,
                         strict=True))
        shape.update(change)
        return fn(*shape.values(), fused)

    b, h, s, d, e = base
    fused, unfused = got(True), got(False)
    per_head = b * h * e  # bytes per element of one (batch, head) pair's tensors
    if fused == unfused:
        return ("fused and unfused came out the same: the fused flag is ignored (the unfused "
                "kernels also write S and P to memory and read them back)")
    if fused == 4 * b * h * s * d:
        return ("the fused count is in elements: multiply by bytes_per_element")
    if fused != 4 * s * d * per_head:
        if fused == 3 * s * d * per_head:
            return ("fused: Q, K and V are read, but O is also written once: 4 tensors of "
                    "seq x head_dim per head, not 3")
        if got(True, seq=2 * s) != 2 * fused:
            return ("fused: the traffic of Q, K, V and O grows linearly with seq; a fused "
                    "kernel keeps the seq x seq scores on chip")
        return ("fused: count Q, K and V read once and O written once: 4 x batch x heads x seq "
                "x head_dim elements, times bytes_per_element")
    extra = unfused - fused
    square = s * s * per_head
    if extra == 2 * square:
        return ("unfused: S and P each go to memory and come back: each is written once and "
                "read once (4 seq x seq matrices per head, not 2)")
    if extra in (square, 3 * square):
        return ("unfused: count both matrices, S = QK^T and P = softmax(S), each written by one "
                "kernel and read by the next: 4 seq x seq per head")
    if extra == 4 * s * d * per_head:
        return ("unfused: the extra traffic is of seq x seq matrices (S and P), not seq x "
                "head_dim ones")
    doubled = got(False, seq=2 * s) - got(True, seq=2 * s)
    if doubled != 4 * extra:
        return ("unfused: the extra traffic (S and P) must grow with seq squared: doubling seq "
                f"multiplied it by {doubled / extra:g}, not 4")
    return ("unfused = fused + S written and read + P written and read: 4 x batch x heads x seq "
            "x seq more elements, times bytes_per_element")


@exercise("attention_bytes", notebook=NOTEBOOK,
          title="the bytes attention moves, fused and unfused")
def attention_bytes(fn) -> str:
    """Exercise: ``fn(batch, heads, seq, head_dim, bytes_per_element, fused)`` is the bytes
    attention's forward moves (Q, K, V read, O written; unfused adds S and P written and read).

    Graded against :func:`labkit.machine.attention_intensity` on six shapes, both ways.

    Example::

        >>> exercise.attention_bytes(my_attention_bytes)
        [pass] the bytes attention moves, fused and unfused: ...
    """
    for shape in _SHAPES:
        for fused in (True, False):
            value = fn(*shape, fused)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise NotYet(f"my_attention_bytes{(*shape, fused)} returned {value!r}",
                             "return a number of bytes (an int >= 0)")
            if value != _attention_reference(*shape, fused):
                said = (f"my_attention_bytes{(*shape, fused)} = {value:,}, expected "
                        f"{_attention_reference(*shape, fused):,}")
                raise NotYet(said, _attention_mistake(fn))
    return (f"{len(_SHAPES)} shapes, fused and unfused, from a single position to seq 4096: "
            "Q, K, V and O, plus S and P written and read when unfused")


# ---- exposed_communication: interval arithmetic over a trace's events --------------------------

def _event(name, cat, ts, dur, tid=1):
    return {"name": name, "cat": cat, "ts": float(ts), "dur": float(dur), "pid": 0, "tid": tid,
            "args": {}}


def _is_comm(event) -> bool:
    return event["name"] == "allreduce"


def _is_compute(event) -> bool:
    return event["cat"] == "compute"


def _hand_traces() -> list[tuple[str, list[dict]]]:
    """Traces built to tell the usual mistakes apart (times in microseconds)."""
    comm, compute = "allreduce", "compute"
    return [
        ("an empty trace", []),
        ("communication fully hidden", [_event(comm, "comm", 10, 50, 2),
                                        _event("mm", compute, 0, 100)]),
        ("no compute at all", [_event(comm, "comm", 0, 30, 2), _event(comm, "comm", 100, 20, 2)]),
        ("two overlapping collectives", [_event(comm, "comm", 0, 60, 2),
                                         _event(comm, "comm", 40, 60, 3),
                                         _event("mm", compute, 0, 20)]),
        ("a collective across two compute spans", [_event(comm, "comm", 0, 100, 2),
                                                   _event("mm", compute, 10, 20),
                                                   _event("mm", compute, 50, 20)]),
        ("overlapping compute on two threads", [_event(comm, "comm", 0, 100, 2),
                                                _event("mm", compute, 10, 50, 1),
                                                _event("mm", compute, 30, 50, 4)]),
        ("compute before and after the collective", [_event("mm", compute, 0, 30),
                                                     _event(comm, "comm", 20, 40, 2),
                                                     _event("mm", compute, 50, 30)]),
        ("zero-length events", [_event(comm, "comm", 5, 0, 2), _event(comm, "comm", 10, 10, 2),
                                _event("mm", compute, 12, 0)]),
    ]


def _exposed_mistakes():
    """Each usual mistake as the value it gives on a trace, with the hint that names it."""
    from .. import traces as tr

    def right(events):
        return tr.exposed_communication(events, comm=_is_comm, compute=_is_compute)

    def durations(events, keep):
        return sum(e["dur"] for e in events if keep(e)) / 1e6

    def per_event(events):  # each collective's uncovered part, summed: overlaps counted twice
        busy = tr.intervals(events, _is_compute)
        return sum(tr.intervals_total(tr.subtract_intervals([span], busy))
                   for span in tr.intervals(events, _is_comm)) / 1e6

    return [
        (lambda ev: right(ev) * 1e6,
         "the result is in microseconds: trace times are, the answer is in seconds"),
        (per_event, "two collectives that overlap each other were counted twice: merge the "
                    "communication intervals into their union first, then cut out the compute"),
        (lambda ev: max(0.0, durations(ev, _is_comm) - durations(ev, _is_compute)),
         "subtracting total durations is not enough: compute that runs while no collective "
         "does hides nothing; take the communication intervals and cut out the parts covered "
         "by compute"),
        (lambda ev: durations(ev, _is_comm) - durations(ev, _is_compute),
         "subtracting total durations is not enough (it can even go negative): take the "
         "communication intervals and cut out the parts covered by compute"),
        (lambda ev: tr.intervals_total(tr.intervals(ev, _is_comm)) / 1e6,
         "no compute was taken away: remove the time covered by compute events"),
    ]


def _exposed_mistake(fn) -> str:
    """The usual mistake whose value the answer gives on every trace built by hand, if any."""
    cases = [events for _, events in _hand_traces()]
    said = [fn(events, _is_comm, _is_compute) for events in cases]
    for mistake, hint in _exposed_mistakes():
        if all(math.isclose(v, mistake(ev), abs_tol=1e-9) for v, ev in zip(said, cases,
                                                                           strict=True)):
            return hint
    return ("merge the communication intervals into a union first (two collectives that "
            "overlap count once), merge the compute intervals too, then total what the first "
            "union covers and the second does not, in seconds")


@exercise("exposed_communication", notebook=NOTEBOOK, title="exposed communication in a trace")
def exposed_communication(fn, events=None) -> str:
    """Exercise: ``fn(events, is_comm, is_compute)`` is the seconds during which a collective
    runs and no compute does.

    Graded against :func:`labkit.traces.exposed_communication` on ``events`` (a recorded
    trace's, when given), on traces built by hand to separate the usual mistakes, and on
    synthetic traces with known exposure (fully hidden, half, fully exposed).

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
        value = fn(case, is_comm, is_compute)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise NotYet(f"on {name}, my_exposed_communication returned {value!r}",
                         "return the exposed time as a number of seconds")
        if not math.isclose(value, right, abs_tol=1e-9):
            raise NotYet(f"on {name}: {value:.9g} s, expected {right:.9g} s",
                         _exposed_mistake(fn))
    return (f"{len(checked)} traces{' (the recorded one first)' if events is not None else ''}: "
            "overlapping collectives counted once, compute on several threads merged, "
            "microseconds turned into seconds")


# ---- delayed_scaling: the scale each FP8 cast uses ----------------------------------------------

_HISTORIES = [  # (amaxes, fmt_max, history_len, margin)
    ([2.0, 1.0, 1.0, 4.0, 0.5], 448.0, 2, 0),
    ([1.0, 3.0, 2.0, 1.0, 1.0, 1.0], 448.0, 3, 0),
    ([1.0, 8.0, 1.0, 1.0], 448.0, 1, 0),
    ([0.0, 0.0, 2.0, 0.0], 448.0, 2, 0),
    ([2.0, 0.0, 0.0, 0.0], 448.0, 1, 0),  # the 2.0 leaves the window: keep its scale
    ([4.0, 2.0, 16.0, 1.0, 1.0], 57344.0, 4, 1),
    ([0.5, 0.25, 1.0], 448.0, 1024, 2),
]


def _delayed_reference(amaxes, fmt_max, history_len, margin) -> list[float]:
    """The scales used, step by step: the scale held before each step's amax is recorded."""
    scales, history, scale = [], [], 1.0
    for amax in amaxes:
        scales.append(scale)
        history = (history + [amax])[-history_len:]
        largest = max(history)
        if 0 < largest < math.inf:
            scale = fmt_max / largest / 2 ** margin
    return scales


def _current_scales(amaxes, fmt_max, history_len, margin) -> list[float]:
    """The mistake of current scaling: each step's scale from a history that includes it."""
    # the scale delayed scaling would use at step t + 1 is the one computed after step t
    return [_delayed_reference(list(amaxes[:t + 1]) + [0.0], fmt_max, history_len, margin)[t + 1]
            for t in range(len(amaxes))]


def _scales_mistake(fn, amaxes, fmt_max, history_len, margin, got) -> str:
    def close(a, b):
        return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9) for x, y in
                                        zip(a, b, strict=True))

    right = _delayed_reference(amaxes, fmt_max, history_len, margin)
    if close(got, _current_scales(amaxes, fmt_max, history_len, margin)):
        return ("each step used the scale from its own amax: that is current scaling. Delayed "
                "scaling casts step t with the scale from the steps before t (step 0 uses 1.0)")
    if got and not math.isclose(got[0], 1.0):
        return "the first step has no history yet: it casts with a scale of 1.0"
    if close(got, _delayed_reference(amaxes, fmt_max, len(amaxes) + 1, margin)):
        return (f"the history keeps only the last history_len = {history_len} amaxes: an old "
                "maximum leaves the window")
    if close(got, _delayed_reference(amaxes, fmt_max, history_len, 0)) and margin:
        return "the margin is ignored: divide the scale by 2 ** margin"
    if close(got, [1.0] + [1 / s for s in right[1:]]):
        return "the scale is upside down: scale = fmt_max / amax (values x scale fill the format)"
    if 0.0 in amaxes:
        return ("a history whose largest amax is 0 gives no scale to compute: keep the "
                "previous one")
    return ("scale_t = fmt_max / max(the last history_len amaxes before t) / 2 ** margin; "
            "1.0 at step 0")


@exercise("delayed_scaling", notebook=NOTEBOOK, title="delayed FP8 scaling from an amax history")
def delayed_scaling(fn) -> str:
    """Exercise: ``fn(amaxes, fmt_max, history_len, margin=0)`` is the list of scales each
    step's cast uses under delayed scaling.

    Graded on seven scripted histories (rising, falling, a spike leaving the window, zeros,
    e4m3's and e5m2's maxima, margins 0 to 2) against the scales
    :class:`labkit.precision.DelayedScaler` uses (a test checks that the two agree).

    Example::

        >>> exercise.delayed_scaling(my_delayed_scales)
        [pass] delayed FP8 scaling from an amax history: ...
    """
    for amaxes, fmt_max, history_len, margin in _HISTORIES:
        right = _delayed_reference(amaxes, fmt_max, history_len, margin)
        got = fn(list(amaxes), fmt_max, history_len, margin)
        try:
            got = [float(s) for s in got]
        except (TypeError, ValueError):
            raise NotYet(f"my_delayed_scales returned {got!r}",
                         "return a list with one scale (a number) per step") from None
        if len(got) != len(amaxes):
            raise NotYet(f"{len(got)} scales for {len(amaxes)} steps",
                         "return one scale per step: the one its cast used")
        if not all(math.isclose(g, r, rel_tol=1e-9) for g, r in zip(got, right, strict=True)):
            said = (f"amaxes {amaxes}, history_len {history_len}, margin {margin}: scales "
                    f"{[round(g, 4) for g in got]}, expected {[round(r, 4) for r in right]}")
            raise NotYet(said, _scales_mistake(fn, amaxes, fmt_max, history_len, margin, got))
    return (f"{len(_HISTORIES)} amax histories: the scale from the steps before, within the "
            "window, with the margin, the previous scale kept after zeros")

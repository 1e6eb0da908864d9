"""Pipeline schedules beyond 1F1B: interleaved 1F1B (virtual stages), zero bubble (split backward).

Notebook 03 wrote GPipe and 1F1B as data, one list of actions per rank, and found the bubble
``(p - 1) / (m + p - 1)`` of a step. Two ideas make it smaller without more micro-batches:

- **interleaved 1F1B** (Megatron-LM, Narayanan et al. 2021): cut the model into ``p * v``
  *virtual stages* and give rank ``r`` the ``v`` chunks ``r, r + p, r + 2p, ...``. Each chunk is
  ``1/v`` of a stage, so filling and draining the pipeline costs ``1/v`` as much: the bubble
  over the compute is ``(p - 1) / (v m)``. A micro-batch now crosses ``p v - 1`` stage
  boundaries instead of ``p - 1``: ``v`` times the messages.
- **zero bubble** (Qi et al. 2023): split each backward into ``B``, the gradient of the
  *input* (the next rank waits for it), and ``W``, the gradient of the *weights* (nobody waits
  for it). Deferring the ``W``'s into the gaps where 1F1B idles cuts the bubble to a third
  when forward, ``B`` and ``W`` cost the same (the ZB-H1 schedule).

Actions are ``("F", chunk, i)``, ``("B", chunk, i)`` and ``("W", chunk, i)``; a schedule with one
chunk per rank may also write notebook 03's ``("F", i)`` / ``("B", i)``. Plain helpers (no
process group): :func:`interleaved_1f1b`, :func:`zero_bubble`, :func:`make_schedule`,
:func:`check_chunked_schedule`, :func:`check_message_order`, :func:`simulate_chunked`,
:func:`bubble_of`, :func:`peak_in_flight`, :func:`messages`, the formulas
:func:`interleaved_bubble`, :func:`interleaved_bubble_fraction`, :func:`zero_bubble_formula`, and
:func:`schedule_timeline` (its widget is :func:`labkit.explorers.schedule_explorer`). Worker
functions: :func:`run_schedule` (a schedule of actions played with point-to-point sends) and
:func:`pipelined_step` (``torch.distributed.pipelining``'s ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble``,
timed action by action)::

    schedule = interleaved_1f1b(4, 2, 8)
    simulate_chunked(schedule, 4, 8, chunks=2)["idle_per_compute"], interleaved_bubble(4, 2, 8)
"""

from __future__ import annotations

import numbers
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from .._dist import barrier, collective_device, sync
from .._sizes import whole
from . import pipeline

__all__ = ["SCHEDULE_NAMES", "interleaved_1f1b", "zero_bubble", "make_schedule",
           "check_chunked_schedule", "check_message_order", "simulate_chunked", "bubble_of",
           "peak_in_flight", "messages", "interleaved_bubble", "interleaved_bubble_fraction",
           "zero_bubble_formula", "schedule_timeline", "run_schedule", "pipelined_step",
           "TORCH_SCHEDULES"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved 1f1b", "zero bubble")


def _check_sizes(stages, m, chunks=1) -> tuple[int, int, int]:
    return (whole(stages, "stages", hint=" (pipeline ranks)"),
            whole(m, "m", hint=" (micro-batches)"),
            whole(chunks, "chunks", hint=" (model chunks per rank; 1 is plain 1F1B)"))


def _multiple_of_stages(stages: int, m: int, what: str) -> None:
    if m % stages:
        below, above = m - m % stages, m - m % stages + stages
        options = " or ".join(str(x) for x in (below, above) if x > 0)
        raise ValueError(f"{what} runs the micro-batches in groups of stages={stages}: m={m} is "
                         f"not a multiple of {stages}; use m = {options}")


# ---- the schedules, as data ---------------------------------------------------------------------


def _forward_slot(k: int, stages: int, chunks: int) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th forward: groups of ``stages`` micro-batches a chunk."""
    group, within = divmod(k, stages * chunks)
    return within // stages, group * stages + within % stages


def _backward_slot(k: int, stages: int, chunks: int) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th backward: the same groups, the chunks last to first."""
    chunk, micro = _forward_slot(k, stages, chunks)
    return chunks - 1 - chunk, micro


def interleaved_1f1b(stages: int, chunks: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Megatron's interleaved 1F1B: rank r holds chunks (virtual stages) r, r+p, r+2p, ...

    Chunk ``c`` on rank ``r`` is virtual stage ``c * p + r``, so a micro-batch goes round the
    ranks ``chunks`` times. Each rank takes its forwards in groups of ``p`` micro-batches:
    micro-batches 0..p-1 through chunk 0, then the same through chunk 1, ..., then the next
    group; its backwards in the same groups with the chunks last to first (the last virtual
    stage's gradients come back first). Rank r warms up with ``(p - r - 1) * 2 + (v - 1) * p``
    forwards (capped at ``m * v``), then alternates one forward, one backward, and ends with the
    backwards still owed. This is the order of Megatron-LM's
    ``forward_backward_pipelining_with_interleaving`` and of torch's
    ``ScheduleInterleaved1F1B`` (Megatron alone, when ``m == p``, runs every forward first: the
    same bubble). Like Megatron, it needs ``m`` to be a multiple of ``p``.

    Example::

        >>> [f"{kind}{chunk}.{i}" for kind, chunk, i in interleaved_1f1b(2, 2, 2)[0]]
        ['F0.0', 'F0.1', 'F1.0', 'F1.1', 'B1.0', 'B1.1', 'B0.0', 'B0.1']
        >>> interleaved_1f1b(2, 2, 4)[1][:6]
        [('F', 0, 0), ('F', 0, 1), ('F', 1, 0), ('B', 1, 0), ('F', 1, 1), ('B', 1, 1)]
    """
    p, m, v = _check_sizes(stages, m, chunks)
    _multiple_of_stages(p, m, "interleaved 1F1B")
    total = m * v  # forwards (and backwards) per rank: every chunk sees every micro-batch
    schedule = []
    for rank in range(p):
        # Deep enough that the first backward can start as soon as its gradient arrives: the
        # last rank must have pushed micro-batches 0..p-1 through its first v-1 chunks, and
        # every hop further from it adds a forward out and a backward back (the 2).
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
        actions = [("F", *_forward_slot(k, p, v)) for k in range(warmup)]
        for k in range(total - warmup):  # steady state: one forward, then the oldest backward
            actions += [("F", *_forward_slot(warmup + k, p, v)), ("B", *_backward_slot(k, p, v))]
        actions += [("B", *_backward_slot(k, p, v)) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def zero_bubble(stages: int, m: int, chunks: int = 1) -> list[list[tuple[str, int, int]]]:
    """A zero-bubble schedule: 1F1B with the backward split into B (input) and W (weights).

    ``("B", c, i)`` computes the gradient of chunk c's *input* for micro-batch i: the rank
    before waits for it, so it runs as early as in 1F1B. ``("W", c, i)`` computes the gradient
    of the chunk's *weights*: nothing waits for it, so rank r defers its W's by ``r``
    micro-batches and runs the owed ones at the end. On the last ranks, where 1F1B waits for a
    gradient to come back, those W's fill the gap. With one chunk this is ZB-H1 (Qi et al.,
    "Zero Bubble Pipeline Parallelism", 2023): warm-up ``p - r - 1`` forwards as 1F1B, and at
    most ``p`` micro-batches held on any rank, 1F1B's peak (rank 0's). With ``chunks > 1`` it is
    its interleaved form, torch's ``ScheduleInterleavedZeroBubble`` (ZB1P): warm-up
    ``(v - 1) p + p - r - 1``, the interleaved groups of ``p``, and ``m`` a multiple of ``p``.

    Example::

        >>> [" ".join(f"{k}{i}" for k, _, i in actions) for actions in zero_bubble(2, 3)]
        ['F0 F1 B0 W0 F2 B1 W1 B2 W2', 'F0 B0 F1 B1 W0 F2 B2 W1 W2']
    """
    p, m, v = _check_sizes(stages, m, chunks)
    if v > 1:
        _multiple_of_stages(p, m, "interleaved zero bubble")
    total = m * v  # forwards (and backwards) per rank: m micro-batches through v chunks
    schedule = []
    for rank in range(p):
        # 1F1B's warm-up: the forwards rank r runs before its first backward can arrive
        # (fewer on later ranks: the last rank turns each forward straight into a backward).
        warmup = min((v - 1) * p + p - rank - 1, total)
        actions = [("F", *_forward_slot(k, p, v)) for k in range(warmup)]
        owed = []  # (chunk, micro) whose B ran and whose W is still to run, oldest first

        def backward(k, actions=actions, owed=owed, rank=rank):
            # B computes only the input's gradient, which the stage before is waiting for;
            # the weight gradient (W) waits, to fill an idle slot later.
            chunk, micro = _backward_slot(k, p, v)
            actions.append(("B", chunk, micro))
            owed.append((chunk, micro))
            if k >= rank:  # rank r runs its first W after its (r+1)-th B: the gap it fills
                actions.append(("W", *owed.pop(0)))

        for k in range(total - warmup):
            actions.append(("F", *_forward_slot(warmup + k, p, v)))
            backward(k)
        for k in range(total - warmup, total):
            backward(k)
        actions += [("W", *slot) for slot in owed]  # the deferred W's: nothing waits for them
        schedule.append(actions)
    return schedule


def make_schedule(name: str, stages: int, m: int, chunks: int = 1) -> list[list[tuple]]:
    """The schedule ``name`` (one of :data:`SCHEDULE_NAMES`) for ``stages`` ranks, ``m``
    micro-batches and ``chunks`` model chunks per rank.

    ``gpipe`` and ``1f1b`` are notebook 03's (one chunk per rank); ``interleaved 1f1b`` is
    :func:`interleaved_1f1b`, ``zero bubble`` :func:`zero_bubble`.

    Example::

        >>> make_schedule("1f1b", 2, 2)
        [[('F', 0), ('F', 1), ('B', 0), ('B', 1)], [('F', 0), ('B', 0), ('F', 1), ('B', 1)]]
    """
    p, m, v = _check_sizes(stages, m, chunks)
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULE_NAMES)}")
    if name in ("gpipe", "1f1b"):
        if v != 1:
            raise ValueError(f"{name} runs one model chunk per rank: use chunks=1, or "
                             f"'interleaved 1f1b' / 'zero bubble' for chunks={v}")
        return pipeline.SCHEDULES[name](p, m)
    if name == "interleaved 1f1b":
        return interleaved_1f1b(p, v, m)
    return zero_bubble(p, m, v)


# ---- checking and playing a schedule -----------------------------------------------------------


def _actions(schedule, stages: int, chunks: int) -> list[list[tuple[str, int, int]]]:
    """Every action as (kind, chunk, micro); ("F", i) means chunk 0 when there is one chunk."""
    if not isinstance(schedule, (list, tuple)) or len(schedule) != stages:
        got = f"{len(schedule)} lists" if isinstance(schedule, (list, tuple)) else repr(schedule)
        raise ValueError(f"the schedule must hold one list of actions per rank: {stages} lists, "
                         f"got {got[:80]}")
    out = []
    for rank, actions in enumerate(schedule):
        mine = []
        for action in actions:
            action = tuple(action) if isinstance(action, (list, tuple)) else (action,)
            if len(action) == 2 and chunks == 1:
                action = (action[0], 0, action[1])
            if (len(action) != 3 or action[0] not in ("F", "B", "W")
                    or not all(isinstance(x, numbers.Integral) for x in action[1:])):
                form = "('F', chunk, i)" + (" or ('F', i)" if chunks == 1 else "")
                raise ValueError(f"rank {rank} has the action {action!r}: write actions as "
                                 f"{form}, with kind 'F', 'B' or 'W'")
            mine.append((action[0], int(action[1]), int(action[2])))
        out.append(mine)
    return out


def _needs(kind: str, stage: int, micro: int, n: int, split: bool) -> list[tuple[str, int, int]]:
    """What an action waits for: (kind, virtual stage, micro) of the actions it depends on."""
    if kind == "F":
        return [("F", stage - 1, micro)] if stage > 0 else []
    if kind == "B":
        later = [("B", stage + 1, micro)] if stage < n - 1 else []
        return [("F", stage, micro)] + later
    return [("B", stage, micro)]


def _play(actions, stages: int, chunks: int, cost) -> list[dict]:
    """Run every rank's actions as soon as the rank is free and its inputs are there.

    ``cost(kind)`` is an action's duration. Returns the events; a schedule whose ranks wait on
    each other forever raises ValueError naming what each one waits for.
    """
    n, split = stages * chunks, any(kind == "W" for row in actions for kind, _, _ in row)
    done: dict[tuple[str, int, int], object] = {}
    free, position, events = [0] * stages, [0] * stages, []
    while any(position[r] < len(actions[r]) for r in range(stages)):
        progressed = False
        for r in range(stages):
            while position[r] < len(actions[r]):
                kind, chunk, micro = actions[r][position[r]]
                stage = chunk * stages + r
                needs = _needs(kind, stage, micro, n, split)
                if any(need not in done for need in needs):
                    break
                start = max([free[r]] + [done[need] for need in needs])
                end = start + cost(kind)
                done[kind, stage, micro] = free[r] = end
                events.append({"rank": r, "kind": kind, "chunk": chunk, "stage": stage,
                               "micro": micro, "start": start, "end": end})
                position[r] += 1
                progressed = True
        if not progressed:
            waiting = {r: f"{k}{c}.{i} needs " + ", ".join(
                f"{nk} of virtual stage {ns} for micro-batch {ni}"
                for nk, ns, ni in _needs(k, c * stages + r, i, n, split)
                if (nk, ns, ni) not in done)
                for r in range(stages) if position[r] < len(actions[r])
                for k, c, i in [actions[r][position[r]]]}
            raise ValueError(f"the schedule deadlocks: every rank waits for another. Next "
                             f"actions (kind chunk.micro): {waiting}")
    return events


def check_chunked_schedule(schedule, stages: int, m: int, chunks: int = 1) -> list[list[tuple]]:
    """Raise ValueError unless ``schedule`` can run: the checks of notebook 03, over chunks and W.

    Every rank runs ``("F", c, i)`` and ``("B", c, i)`` once for each of its chunks ``c`` and
    micro-batches ``i`` (and ``("W", c, i)`` once each, if the schedule splits the backward),
    B after F and W after B. Across ranks: the F of virtual stage k after the F of k-1, the B
    of k after the B of k+1, W after B (checked by playing the schedule: a deadlock names what
    each rank waits for). Returns the actions as ``(kind, chunk, micro)``.

    Example::

        >>> check_chunked_schedule([[("F", 0, 0), ("W", 0, 0), ("B", 0, 0)]], 1, 1)
        Traceback (most recent call last):
        ValueError: rank 0 runs ('W', 0, 0) before ('B', 0, 0): W needs the output gradient B
        received
    """
    p, m, v = _check_sizes(stages, m, chunks)
    actions = _actions(schedule, p, v)
    split = any(kind == "W" for row in actions for kind, _, _ in row)
    kinds = "FBW" if split else "FB"
    expected = sorted((k, c, i) for k in kinds for c in range(v) for i in range(m))
    for rank, mine in enumerate(actions):
        if sorted(mine) != expected:
            missing = sorted(set(expected) - set(mine))
            extra = sorted({a for a in mine if mine.count(a) > 1 or a not in expected})
            raise ValueError(f"rank {rank} must run each of {'/'.join(kinds)} once for each of "
                             f"its {v} chunk(s) and {m} micro-batches: missing {missing[:6]}, "
                             f"extra or repeated {extra[:6]}")
        position = {a: k for k, a in enumerate(mine)}
        for c in range(v):
            for i in range(m):
                if position["B", c, i] < position["F", c, i]:
                    raise ValueError(f"rank {rank} runs ('B', {c}, {i}) before ('F', {c}, {i}): "
                                     f"a backward needs its forward's activations")
                if split and position["W", c, i] < position["B", c, i]:
                    raise ValueError(f"rank {rank} runs ('W', {c}, {i}) before ('B', {c}, {i}): "
                                     f"W needs the output gradient B received")
    _play(actions, p, v, lambda kind: 1)
    return actions


def check_message_order(schedule, stages: int, chunks: int = 1) -> None:
    """Raise ValueError unless, between every two ranks, messages are received in the order sent.

    What a runner with blocking receives in action order needs (:func:`run_schedule`, notebook
    03's ``run_pipeline``): a rank's n-th receive from another is that rank's n-th send to it.
    Interleaved 1F1B keeps to it; torch's runtime posts its receives ahead and needs not.

    Example::

        >>> check_message_order(interleaved_1f1b(2, 2, 4), 2, 2)   # None: it keeps to it
    """
    actions = _actions(schedule, stages, chunks)
    n = stages * chunks
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for r, mine in enumerate(actions):
        for kind, c, i in mine:
            k = c * stages + r
            if kind == "F" and k > 0:  # the input arrives from virtual stage k-1
                received.setdefault(((k - 1) % stages, r), []).append(("activation", k - 1, i))
            if kind == "F" and k < n - 1:
                sent.setdefault((r, (k + 1) % stages), []).append(("activation", k, i))
            if kind == "B" and k < n - 1:  # the output's gradient arrives from stage k+1
                received.setdefault(((k + 1) % stages, r), []).append(("gradient", k + 1, i))
            if kind == "B" and k > 0:
                sent.setdefault((r, (k - 1) % stages), []).append(("gradient", k, i))
    for pair in sorted(set(sent) | set(received)):
        src, dst = pair
        if src != dst and sent.get(pair, []) != received.get(pair, []):
            raise ValueError(
                f"rank {src} sends to rank {dst} in the order {_describe(sent.get(pair, []))} "
                f"but rank {dst} receives in the order {_describe(received.get(pair, []))} "
                f"(stage.micro-batch): messages are matched in order, so both must agree")


def _describe(messages, limit: int = 6) -> str:
    text = ", ".join(f"{what} {stage}.{i}" for what, stage, i in messages[:limit])
    return "[" + text + (", ..." if len(messages) > limit else "") + "]"


# ---- simulation and the bubble -----------------------------------------------------------------


def bubble_of(events: list[dict]) -> dict:
    """The bubble of a timeline: ``bubble`` = idle / (ranks x step), ``idle_per_compute`` = idle /
    busy, and ``span``, the step from its first start to its last end (medians over steps).

    Idle is the time inside the step that a rank spends outside its own events. The two forms
    carry the same information: ``bubble = r / (1 + r)`` for ``r = idle_per_compute``.

    Example::

        >>> bubble_of([{"rank": 0, "start": 0, "end": 1}, {"rank": 1, "start": 1, "end": 2}])
        {'bubble': 0.5, 'idle_per_compute': 1.0, 'span': 2}
    """
    if not events:
        raise ValueError("no events: pass the 'events' that simulate_chunked or pipelined_step "
                         "returned")
    by_step: dict[int, list[dict]] = {}
    for e in events:
        by_step.setdefault(e.get("step", 0), []).append(e)
    rows = []
    for step_events in by_step.values():
        span = max(e["end"] for e in step_events) - min(e["start"] for e in step_events)
        ranks = {e["rank"] for e in step_events}
        busy = sum(e["end"] - e["start"] for e in step_events)
        idle = len(ranks) * span - busy
        rows.append((idle / (len(ranks) * span), idle / busy, span))
    if len(rows) == 1:
        bubble, ratio, span = rows[0]
    else:
        bubble, ratio, span = (statistics.median(col) for col in zip(*rows, strict=True))
    return {"bubble": bubble, "idle_per_compute": ratio, "span": span}


def simulate_chunked(schedule, stages: int, m: int, chunks: int = 1, f=1.0, b=1.0, w=1.0) -> dict:
    """The timeline of ``schedule`` with fixed costs: every rank and chunk equal, messages free.

    A whole stage's forward costs ``f``, its input-gradient backward ``b`` and its weight-
    gradient backward ``w``; a chunk is ``1/chunks`` of a stage, so its F costs ``f / chunks``.
    A schedule without W's runs the full backward in B, ``(b + w) / chunks``: every schedule
    does the same work, ``m (f + b + w)`` per rank. Pass :class:`fractions.Fraction` costs for
    exact bubbles. Returns ``{"events": [{"rank", "kind", "chunk", "stage", "micro", "start",
    "end"}], "bubble", "idle_per_compute", "span"}`` (see :func:`bubble_of`).

    Example::

        >>> out = simulate_chunked(interleaved_1f1b(4, 2, 8), 4, 8, chunks=2)
        >>> out["idle_per_compute"], interleaved_bubble(4, 2, 8)
        (0.1875, 0.1875)
    """
    p, m, v = _check_sizes(stages, m, chunks)
    for name, value in (("f", f), ("b", b), ("w", w)):
        if not isinstance(value, numbers.Real) or value < 0 or (name == "f" and value == 0):
            raise ValueError(f"{name} is a time: use a number >= 0 (f > 0), got {value!r}")
    actions = check_chunked_schedule(schedule, p, m, v)
    split = any(kind == "W" for row in actions for kind, _, _ in row)
    costs = {"F": f / v, "B": (b if split else b + w) / v, "W": w / v}
    events = _play(actions, p, v, costs.__getitem__)
    return {"events": events, **bubble_of(events)}


def peak_in_flight(schedule, stages: int, m: int, chunks: int = 1) -> list[float]:
    """Per rank, the most micro-batches whose activations it holds at once, in whole stages.

    A chunk's activations are held from its F until its last backward action (W when the
    backward is split, else B), and count ``1/chunks`` (a chunk is that part of a stage). 1F1B
    holds ``p - r`` on rank r, GPipe ``m``; interleaving and deferred W's hold more.

    Example::

        >>> peak_in_flight(pipeline.one_f_one_b_schedule(4, 8), 4, 8)
        [4.0, 3.0, 2.0, 1.0]
    """
    p, m, v = _check_sizes(stages, m, chunks)
    actions = check_chunked_schedule(schedule, p, m, v)
    split = any(kind == "W" for row in actions for kind, _, _ in row)
    last = "W" if split else "B"
    peaks = []
    for mine in actions:
        held = peak = 0
        for kind, _, _ in mine:
            held += 1 if kind == "F" else -1 if kind == last else 0
            peak = max(peak, held)
        peaks.append(peak / v)
    return peaks


def messages(stages: int, m: int, chunks: int = 1) -> int:
    """Point-to-point messages in one step: each micro-batch crosses ``p v - 1`` stage
    boundaries forward (activations) and as many backward (gradients).

    Example::

        >>> messages(4, 8), messages(4, 8, chunks=2)
        (48, 112)
    """
    p, m, v = _check_sizes(stages, m, chunks)
    return 2 * m * (p * v - 1)


def interleaved_bubble(stages: int, chunks: int, m: int) -> float:
    """Interleaved 1F1B's bubble over the ideal compute time: ``(p - 1) / (v m)`` (Megatron's).

    Each rank computes ``m`` micro-batches of ``(f + b)`` and idles ``(p - 1)`` chunk-times of
    ``(f + b) / v`` while the pipeline fills and drains. For ``v = 1`` it is 1F1B's
    ``(p - 1) / m``; as a fraction of the step see :func:`interleaved_bubble_fraction`.

    Example::

        >>> interleaved_bubble(4, 1, 8), interleaved_bubble(4, 2, 8)
        (0.375, 0.1875)
    """
    p, m, v = _check_sizes(stages, m, chunks)
    return (p - 1) / (v * m)


def interleaved_bubble_fraction(stages: int, chunks: int, m: int) -> float:
    """The same bubble as a fraction of the step: ``(p - 1) / (v m + p - 1)``.

    With ``v = 1`` this is notebook 03's ``pipeline.bubble_formula(p, m) = (p-1)/(m+p-1)``.

    Example::

        >>> interleaved_bubble_fraction(4, 1, 8) == pipeline.bubble_formula(4, 8)
        True
    """
    p, m, v = _check_sizes(stages, m, chunks)
    return (p - 1) / (v * m + p - 1)


def zero_bubble_formula(stages: int, m: int, chunks: int = 1, f=1.0, b=1.0, w=1.0) -> float:
    """:func:`zero_bubble`'s bubble over the compute: ``(p - 1)(f + b - w) / (v m (f + b + w))``.

    Each rank idles ``(p - 1)`` times ``f + b - w`` per chunk-time where 1F1B idles
    ``f + b + w``: the deferred W fills the rest. With ``f = b = w`` that is
    ``(p - 1) / (3 v m)``, a third of (interleaved) 1F1B's. It holds for ``m >= p`` and
    ``w <= min(f, b)``; otherwise there is no such simple form (ValueError).

    Example::

        >>> zero_bubble_formula(4, 8), interleaved_bubble(4, 1, 8) / 3
        (0.125, 0.125)
    """
    p, m, v = _check_sizes(stages, m, chunks)
    if m < p or w > min(f, b):
        raise ValueError(f"the zero-bubble formula holds for m >= stages and w <= min(f, b); got "
                         f"stages={p}, m={m}, f={f}, b={b}, w={w}: simulate the schedule instead")
    return (p - 1) * (f + b - w) / (v * m * (f + b + w))


def _formula(name: str, p: int, m: int, v: int, f, b, w) -> float | None:
    """The closed-form bubble (idle / compute) of a named schedule, or None where there is none."""
    if name in ("gpipe", "1f1b"):
        return (p - 1) / m
    if name == "interleaved 1f1b":
        return interleaved_bubble(p, v, m)
    try:
        return zero_bubble_formula(p, m, v, f, b, w)
    except ValueError:
        return None


def schedule_timeline(name: str, stages: int, m: int, chunks: int = 1, f=1.0, b=1.0,
                      w=1.0) -> dict:
    """A named schedule, simulated: its timeline, its bubble and the formula's, what it holds.

    The function under :func:`labkit.explorers.schedule_explorer`. Returns ``{"name",
    "stages", "m", "chunks", "schedule", "events", "bubble" (idle / step), "formula" (the same
    from the closed form, or None), "idle_per_compute", "formula_per_compute", "peak_in_flight"
    (per rank, in stages), "messages"}``.

    Example::

        >>> t = schedule_timeline("interleaved 1f1b", 4, 8, chunks=2)
        >>> round(t["bubble"], 4), round(t["formula"], 4), t["messages"]
        (0.1579, 0.1579, 112)
    """
    p, m, v = _check_sizes(stages, m, chunks)
    schedule = make_schedule(name, p, m, v)
    out = simulate_chunked(schedule, p, m, v, f, b, w)
    ratio = _formula(name, p, m, v, f, b, w)
    return {"name": name, "stages": p, "m": m, "chunks": v, "schedule": schedule,
            "events": out["events"], "bubble": out["bubble"],
            "formula": None if ratio is None else ratio / (1 + ratio),
            "idle_per_compute": out["idle_per_compute"], "formula_per_compute": ratio,
            "peak_in_flight": peak_in_flight(schedule, p, m, v), "messages": messages(p, m, v)}


# ---- real ranks: a schedule played with sends, and torch's own schedules ------------------------


def _flat_grads(module) -> torch.Tensor:
    return torch.cat([q.grad.detach().flatten().cpu() for q in module.parameters()
                      if q.grad is not None])


def _shapes(stage_module_fn, n: int, first_input) -> list[tuple]:
    """The (shape, dtype) each of the ``n`` virtual stages receives per micro-batch."""
    # recv needs a buffer of the right size; running the stages once on a one-row input of
    # zeros tells every rank all the shapes (simpler than passing them round the ring of
    # chunks). The rows (dim 0) are the micro-batch's: the stages keep the batch dimension.
    rows, shapes = first_input.shape[0], []
    h = torch.zeros((1, *first_input.shape[1:]), dtype=first_input.dtype)
    with torch.no_grad():
        for k in range(n):
            shapes.append(((rows, *h.shape[1:]), h.dtype))
            h = stage_module_fn(k, n)(h)
    return shapes


def run_schedule(stage_module_fn, schedule, m: int, batch, chunks: int = 1, *,
                 loss_fn=F.cross_entropy) -> dict:
    """Worker function: play a schedule of ``("F"|"B", chunk, i)`` actions for real, one step.

    Rank r builds its chunks, virtual stages ``c * p + r`` of ``stage_module_fn(stage, p * v)``.
    A forward of virtual stage k receives its input from the rank holding k - 1 (rank r - 1,
    or rank p - 1 for the next chunk round on rank 0), and sends its output on; the last virtual
    stage computes the loss (divided by m). A backward receives its output's gradient from the
    rank holding k + 1 and sends its input's gradient back. Gradients accumulate over the
    micro-batches: they equal ``pipeline.reference_step(stage_module_fn, p * v, batch)``'s.
    Returns ``{"loss", "grads": [this rank's flat gradients per chunk], "stages": its virtual
    stages}``. W actions are refused: a split backward needs torch's :func:`pipelined_step`.

    Example::

        >>> build = pipeline.stage_builder(pipeline.mlp_stack)
        >>> out = labkit.launch(run_schedule, build, interleaved_1f1b(2, 2, 4), 4,
        ...                     pipeline.example_batch(64), 2, nproc=2).values
    """
    device = collective_device()
    rank, p = dist.get_rank(), dist.get_world_size()
    v = whole(chunks, "chunks", hint=" (model chunks per rank)")
    if p < 2:
        raise ValueError("run_schedule needs at least 2 ranks: launch it with nproc >= 2")
    every = check_chunked_schedule(schedule, p, m, v)
    # Blocking receives in action order: each pair of ranks must agree on the order of the
    # messages between them (NCCL matches point-to-point messages by order, not by tag).
    check_message_order(every, p, v)
    actions = every[rank]
    if any(kind == "W" for kind, _, _ in actions):
        raise ValueError("run_schedule runs F and full B actions only: run zero-bubble schedules "
                         "with pipelined_step('zero bubble', ...), whose backward is split")
    n = p * v  # virtual stages: chunk c of rank r is stage c * p + r (Megatron's placement)
    x, y = batch
    xs, ys = pipeline.micro_batches(x.to(device), m), pipeline.micro_batches(y.to(device), m)
    shapes = _shapes(stage_module_fn, n, xs[0])
    # This rank's v chunks: stages r, r + p, r + 2p, ... far apart in the model, so a
    # micro-batch visits every rank v times on its way through.
    modules = [stage_module_fn(c * p + rank, n).to(device) for c in range(v)]
    before, after = (rank - 1) % p, (rank + 1) % p  # chunk rounds wrap: p - 1 feeds rank 0
    # Keyed by (chunk, micro-batch): several chunks of one rank hold activations at once.
    inputs, outputs, losses, sends = {}, {}, [], []
    for kind, c, i in actions:
        k = c * p + rank  # the virtual stage this action runs
        if kind == "F":
            if k == 0:
                h = xs[i]
            else:
                h = torch.empty(shapes[k][0], dtype=shapes[k][1], device=device)
                dist.recv(h, src=before)
                h.requires_grad_()  # d(loss)/dh goes back to the stage before
            out = modules[c](h)
            if k == n - 1:
                out = loss_fn(out, ys[i]) / m  # the m backwards add up to the mean's gradient
                losses.append(out.detach())
            else:
                # isend: a blocking send could wait on a rank that is itself blocked sending.
                sends.append((dist.isend(out.detach(), dst=after), out))
            inputs[c, i], outputs[c, i] = h, out
        else:
            grad = None
            if k < n - 1:
                grad = torch.empty_like(outputs[c, i])
                dist.recv(grad, src=after)
            outputs[c, i].backward(grad)
            if k > 0:
                sends.append((dist.isend(inputs[c, i].grad, dst=before), inputs[c, i]))
            del inputs[c, i], outputs[c, i]  # this chunk's activations for micro-batch i: freed
    for work, _ in sends:
        work.wait()
    loss = torch.tensor([float(sum(t.item() for t in losses))], dtype=torch.float64,
                        device=device)
    dist.broadcast(loss, src=p - 1)  # rank p - 1 holds the last virtual stage (c = v - 1)
    return {"rank": rank, "loss": loss.item(), "stages": [c * p + rank for c in range(v)],
            "grads": [_flat_grads(module) for module in modules]}


TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved 1f1b": "ScheduleInterleaved1F1B",
                   "zero bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def _placement(schedule: str, rank: int, p: int, v: int) -> list[int]:
    """The virtual stages rank ``rank`` holds: r, r+p, ... or, for ZBV, the V: r and 2p-1-r."""
    if schedule == "zbv":
        return [rank, 2 * p - 1 - rank]
    return [c * p + rank for c in range(v)]


def _timed(stage, chunk: int, record) -> None:
    """Time this PipelineStage's compute: forward, backward (full or input), weight backward."""
    # The schedule calls these three methods for every F, B and W; receives are waited for
    # before them and sends posted after, so their time is compute and the rest is idle.
    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                       ("backward_weight_one_chunk", "W")):
        original = getattr(stage, name)

        def timed(micro, *args, _original=original, _kind=kind, **kwargs):
            start = record(None)
            result = _original(micro, *args, **kwargs)
            record({"kind": _kind, "chunk": chunk, "stage": stage.stage_index, "micro": micro,
                    "start": start})
            return result

        setattr(stage, name, timed)


def pipelined_step(schedule: str, stages_per_rank: int, m: int, batch, stage_module_fn, *,
                   steps: int = 3, warmup: int = 1, loss_fn=F.cross_entropy) -> dict:
    """Worker function: steps of ``torch.distributed.pipelining``'s schedule, timed per action.

    ``schedule`` is ``"1f1b"`` (``Schedule1F1B``, one stage per rank), ``"interleaved 1f1b"``
    (``ScheduleInterleaved1F1B``), ``"zero bubble"`` (``ScheduleInterleavedZeroBubble``: ZB-H1
    with one stage per rank) or ``"zbv"`` (``ScheduleZBVZeroBubble``: two stages per rank in a V,
    rank r holding stages r and 2p-1-r). Rank r wraps each of its ``stages_per_rank`` stages of
    ``stage_module_fn(stage, p * stages_per_rank)`` in a ``PipelineStage``. ``warmup`` untimed
    steps, then ``steps`` timed ones, each from a barrier. With more than one stage per rank,
    ``m`` must be a multiple of ``p`` (torch accepts a few other ``m``; Megatron's rule keeps
    torch's order equal to :func:`interleaved_1f1b` and :func:`zero_bubble`).

    Returns, on every rank, ``{"loss", "grads": [this rank's flat gradients per chunk, last
    step], "stages", "step_s" (median), "events" (every rank's timed actions, in seconds from the
    step's barrier, with "step"), "order" (this rank's actions as torch ran them, as
    ``(kind, chunk, micro)``), "measured" (:func:`bubble_of` the events), "costs" (median F, B,
    W seconds per chunk) and "simulated" (:func:`simulate_chunked` of the same order with those
    costs; None for zbv, whose V placement simulate_chunked does not model)}``.

    Example::

        >>> build = pipeline.stage_builder(pipeline.mlp_stack)
        >>> out = labkit.launch(pipelined_step, "interleaved 1f1b", 2, 8,
        ...                     pipeline.example_batch(256), build, nproc=2).values[0]
        >>> out["measured"]["bubble"], out["simulated"]["bubble"]
    """
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} for torch.distributed.pipelining: use "
                         f"one of {', '.join(TORCH_SCHEDULES)}")
    if batch is None:
        raise ValueError("pass batch=(x, y): the first stage reads x, the last stage y")
    v = whole(stages_per_rank, "stages_per_rank", hint=" (model chunks per rank)")
    steps, warmup = whole(steps, "steps"), whole(warmup, "warmup", low=0)
    if schedule == "1f1b" and v != 1:
        raise ValueError(f"Schedule1F1B holds one stage per rank: use stages_per_rank=1, or "
                         f"'interleaved 1f1b' for {v}")
    if schedule == "zbv" and v != 2:
        raise ValueError(f"ScheduleZBVZeroBubble holds exactly two stages per rank (a V): use "
                         f"stages_per_rank=2, got {v}")
    rank, p = dist.get_rank(), dist.get_world_size()
    if schedule in ("interleaved 1f1b", "zero bubble") and v > 1:
        _multiple_of_stages(p, m, schedule)
    # Imported here: torch.distributed.pipelining takes seconds to import (it brings torch.export).
    from torch.distributed import pipelining

    device = collective_device()
    x, y = batch
    pipeline.micro_batches(x, m)  # the same check, and message, as notebook 03's runner
    n, mine = p * v, _placement(schedule, rank, p, v)
    modules = [stage_module_fn(k, n).to(device) for k in mine]
    stages = [pipelining.PipelineStage(mod, k, n, device) for mod, k in zip(modules, mine,
                                                                           strict=True)]
    events, clock = [], {"t0": 0.0, "step": -1}

    def record(event):
        sync(device)
        now = time.perf_counter() - clock["t0"]
        if event is not None and clock["step"] >= 0:
            events.append({**event, "rank": rank, "end": now, "step": clock["step"]})
        return now

    for chunk, stage in enumerate(stages):
        _timed(stage, chunk, record)
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    # scale_grads=True divides the accumulated gradients by m: our losses are means.
    runner = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=m,
                 loss_fn=loss_fn, scale_grads=True)
    first, last = 0 in mine, n - 1 in mine
    times, losses = [], []
    for step in range(warmup + steps):
        for module in modules:
            module.zero_grad(set_to_none=True)
        clock["step"] = step - warmup  # negative while warming up: not recorded
        kwargs = {"target": y.to(device), "losses": []} if last else {}
        barrier(device)
        clock["t0"] = time.perf_counter()
        runner.step(*((x.to(device),) if first else ()), **kwargs)
        sync(device)
        times.append(time.perf_counter() - clock["t0"])
        losses = kwargs.get("losses", [])
    mean = statistics.fmean(t.item() for t in losses) if last else 0.0
    loss = torch.tensor([mean], dtype=torch.float64, device=device)
    dist.broadcast(loss, src=0 if schedule == "zbv" else p - 1)  # who holds the last stage
    everyone: list = [None] * p
    dist.all_gather_object(everyone, events)
    every_event = [e for rank_events in everyone for e in rank_events]
    order = [(e["kind"], e["chunk"], e["micro"]) for e in events if e["step"] == 0]
    costs = {kind: statistics.median([(e["end"] - e["start"]) for e in every_event
                                      if e["kind"] == kind] or [0.0]) for kind in "FBW"}
    simulated = None
    if schedule != "zbv":
        orders = [[(e["kind"], e["chunk"], e["micro"])
                   for e in sorted(every_event, key=lambda e: e["start"])
                   if e["rank"] == r and e["step"] == 0] for r in range(p)]
        split = any(e["kind"] == "W" for e in every_event)
        simulated = simulate_chunked(orders, p, m, v, f=costs["F"] * v, b=costs["B"] * v,
                             w=costs["W"] * v if split else 0.0)
        simulated = {k: simulated[k] for k in ("bubble", "idle_per_compute", "span")}
    return {"rank": rank, "schedule": schedule, "chunks": v, "m": m, "loss": loss.item(),
            "stages": mine, "grads": [_flat_grads(module) for module in modules],
            "step_s": statistics.median(times[warmup:]), "events": every_event, "order": order,
            "measured": bubble_of(every_event), "costs": costs, "simulated": simulated}

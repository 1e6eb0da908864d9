"""Pipeline parallelism, built by hand: stages, micro-batches, schedules and the bubble.

One room past 800 lines on purpose: notebook 03's schedules, their simulation and their runs on
real ranks check one another, and the lesson reads them in that order.

A model too big for one device is cut into consecutive *stages*, one per rank. Run naively,
only one rank works at a time. Cutting the batch into ``m`` micro-batches lets the ranks work on
different micro-batches at once; what is left idle while the pipeline fills and drains is the
*bubble*, ``(p - 1) / (m + p - 1)`` of the time for ``p`` stages.

Plain helpers (no process group): :func:`split_stages`, :func:`micro_batches`, the schedules
(:func:`naive_schedule`, :func:`gpipe_schedule`, :func:`one_f_one_b_schedule`) as readable
lists of actions, :func:`bubble_formula`, :func:`simulate`, :func:`measured_bubble` and the
single-process :func:`reference_step`. Worker functions, run inside
``labkit.launch(..., nproc=stages)`` where rank ``r`` is stage ``r``: :func:`run_pipeline`
(the schedule executed with point-to-point sends, each stage's actions by :func:`run_stage`,
timed by a :class:`StageMeter` around them),
:func:`bubble_sweep`, and
:func:`pipelining_step` (the same step with ``torch.distributed.pipelining``)::

    build = stage_builder(mlp_stack)
    batch = example_batch(256)
    out = labkit.launch(run_pipeline, build, "1f1b", 4, batch, nproc=2).values
    measured_bubble(out[0]["events"]), bubble_formula(2, 4)
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from .._dist import barrier, collective_device, sync
from .._sizes import divisors, whole
from .memory import counting_saved_bytes

__all__ = ["mlp_stack", "example_batch", "split_stages", "stage_builder", "micro_batches",
           "naive_schedule", "gpipe_schedule", "one_f_one_b_schedule", "SCHEDULES",
           "check_schedule", "bubble_formula", "simulate", "measured_bubble", "bubble_breakdown",
           "reference_step", "run_stage", "StageMeter", "run_pipeline", "bubble_sweep",
           "pipelining_step"]


# ---- the model and its stages -------------------------------------------------------------------


def mlp_stack(width: int = 1024, depth: int = 8, inputs: int = 64, classes: int = 10):
    """The pipeline's example model: a thin input layer, ``depth`` square layers, a small head.

    Square ``Linear + ReLU`` blocks give stages of equal work. The thin input layer matters:
    the first stage never needs the gradient of its input (the data), so a first square layer
    would skip one of its three matrix products and make stage 0 ~8 % lighter than the rest.

    Example::

        >>> [type(layer).__name__ for layer in mlp_stack(depth=2)]
        ['Linear', 'ReLU', 'Linear', 'ReLU', 'Linear', 'ReLU', 'Linear']
    """
    layers = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def example_batch(batch: int = 256, inputs: int = 64, classes: int = 10, seed: int = 0):
    """A random ``(x, y)`` batch for :func:`mlp_stack`: the same on every rank for one seed.

    Example::

        >>> x, y = example_batch(8)
        >>> x.shape, y.shape
        (torch.Size([8, 64]), torch.Size([8]))
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, inputs, generator=gen), torch.randint(0, classes, (batch,),
                                                                   generator=gen)


def split_stages(model: nn.Sequential, stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``stages`` consecutive parts with about equal parameter counts.

    The split minimises the largest stage (the slowest stage sets the pipeline's pace); among
    equal splits it takes the one whose largest stage has the fewest layers, and a layer
    without parameters (a ReLU) stays with the layer before it. A model
    without parameters is split by layer count. Parameters count as a stand-in for work: fine
    for stacks of similar layers, not for convolutions whose cost grows with image size.

    Example::

        >>> [len(s) for s in split_stages(mlp_stack(depth=4), 2)]
        [6, 5]
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"split_stages needs an nn.Sequential (layers in order), got "
                         f"{type(model).__name__}: wrap the layers as nn.Sequential(*layers)")
    stages = whole(stages, "stages", hint=" (pipeline stages)")
    layers = list(model)
    n = len(layers)
    if stages > n:
        raise ValueError(f"more pipeline stages ({stages}) than layers ({n}): every stage needs "
                         f"at least one layer; use stages <= {n} or a deeper model")
    weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    if sum(weights) == 0:
        weights = [1] * n
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def cost(i, j):  # layers i..j-1 as one stage: (parameters, layers), compared in that order
        return (prefix[j] - prefix[i], j - i)

    # best[k][j]: the smallest possible largest stage when layers 0..j-1 form k stages.
    worst = (float("inf"), n)
    best = [[worst] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                candidate = max(best[k - 1][i], cost(i, j))
                if candidate < best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    # A parameter-free layer (ReLU, Flatten) goes with the layer before it: the same balance.
    for k in range(1, stages):
        while weights[bounds[k]] == 0 and bounds[k] + 1 < bounds[k + 1]:
            bounds[k] += 1
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def stage_builder(make_model, seed: int = 0):
    """A ``stage_module_fn(stage, stages)`` for the workers: stage ``stage`` of ``make_model()``.

    Every rank builds the whole model from the same seed and keeps its own stage, so the
    stages fit together exactly as in one process. (A real model too large for one device is
    built stage by stage, or on the ``meta`` device; at teaching sizes this is simpler.)

    Example::

        >>> build = stage_builder(mlp_stack)
        >>> len(build(0, 2)), len(build(1, 2))
        (10, 9)
    """
    def stage_module(stage: int, stages: int) -> nn.Module:
        torch.manual_seed(seed)
        return split_stages(make_model(), stages)[stage]

    return stage_module


def micro_batches(x: torch.Tensor, m: int) -> list[torch.Tensor]:
    """``x`` cut along its first dimension into ``m`` equal micro-batches (views, no copies).

    Equal sizes keep every stage's work per micro-batch the same, and make the mean of the
    micro-batch losses exactly the loss of the whole batch.

    Example::

        >>> [c.shape[0] for c in micro_batches(torch.zeros(12, 3), 4)]
        [3, 3, 3, 3]
    """
    m = whole(m, "m", hint=" (micro-batches)")
    size = x.shape[0]
    if size % m:
        options = divisors(size, 5)
        shown = ", ".join(map(str, options[:4])) + (", ..." if len(options) > 4 else "")
        raise ValueError(f"a batch of {size} does not split into {m} micro-batches: use m in "
                         f"({shown}) or a batch that is a multiple of {m}")
    return list(torch.split(x, size // m))


# ---- schedules: what each stage does, in order --------------------------------------------------
# A schedule is a list with one entry per stage: that stage's actions in the order it runs them,
# ("F", i) for the forward of micro-batch i and ("B", i) for its backward.


def gpipe_schedule(stages: int, m: int) -> list[list[tuple[str, int]]]:
    """GPipe: every stage runs all ``m`` forwards, then all backwards, in micro-batch order.

    The backwards go B0, B1, ... as in ``torch.distributed.pipelining.ScheduleGPipe`` (the
    GPipe paper draws them in reverse; the bubble is the same). Every stage holds the
    activations of all ``m`` micro-batches at the turn from forward to backward.

    Example::

        >>> gpipe_schedule(2, 2)
        [[('F', 0), ('F', 1), ('B', 0), ('B', 1)], [('F', 0), ('F', 1), ('B', 0), ('B', 1)]]
    """
    _check_sizes(stages, m)
    # Every stage runs the same list: the pipeline's shape comes from waiting, since stage s
    # cannot start F i before stage s - 1 has sent it F i's activations.
    one_stage = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return [list(one_stage) for _ in range(stages)]


def naive_schedule(stages: int) -> list[list[tuple[str, int]]]:
    """Naive model parallelism: the whole batch as one micro-batch, ``gpipe_schedule(stages, 1)``.

    Stage s works only while the batch passes through it; the others wait, so each rank idles
    ``(stages - 1) / stages`` of the time.

    Example::

        >>> naive_schedule(3)
        [[('F', 0), ('B', 0)], [('F', 0), ('B', 0)], [('F', 0), ('B', 0)]]
    """
    return gpipe_schedule(stages, 1)


def one_f_one_b_schedule(stages: int, m: int) -> list[list[tuple[str, int]]]:
    """1F1B: a short warm-up of forwards, then one forward / one backward, then the backwards.

    Stage s starts with ``stages - s - 1`` forwards (enough to keep the later stages fed), then
    alternates a forward with the backward of its oldest micro-batch, and ends with the
    backwards still owed. A backward frees its micro-batch's activations at once, so stage s
    never holds more than ``stages - s`` of them (GPipe holds ``m``): the same bubble as GPipe,
    far less memory. This is the order of ``torch.distributed.pipelining.Schedule1F1B``.

    Example::

        >>> one_f_one_b_schedule(2, 3)[0]
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    _check_sizes(stages, m)
    schedule = []
    for stage in range(stages):
        warmup = min(stages - stage - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: one forward, then the oldest backward
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]  # cool-down
        schedule.append(actions)
    return schedule


SCHEDULES = {"naive": lambda stages, m: naive_schedule(stages), "gpipe": gpipe_schedule,
             "1f1b": one_f_one_b_schedule}


def _check_sizes(stages, m):
    whole(stages, "stages", hint=" (one per rank)")
    whole(m, "m", hint=" (micro-batches)")


def _schedule(schedule, stages: int, m: int) -> list[list[tuple[str, int]]]:
    """A schedule by name (naive, gpipe, 1f1b) or a hand-written one, checked."""
    if isinstance(schedule, str):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}, "
                             f"or a list of per-stage action lists")
        if schedule == "naive" and m != 1:
            raise ValueError(f"naive model parallelism runs the whole batch at once: m must be 1, "
                             f"got m={m}; use 'gpipe' or '1f1b' to split it into micro-batches")
        schedule = SCHEDULES[schedule](stages, m)
    if len(schedule) != stages:
        raise ValueError(f"the schedule has {len(schedule)} stage(s) but there are {stages} "
                         f"ranks: one list of actions per rank")
    check_schedule(schedule, m)
    return schedule


def check_schedule(schedule, m: int) -> None:
    """Raise ValueError unless every stage runs each F and B once, B i after F i, and in the
    same order as its neighbours: the F's as the stage before, the B's as the stage after.

    The order matters because messages carry no micro-batch number: a stage's n-th receive
    from a neighbour is that neighbour's n-th send (NCCL matches point-to-point messages by
    order, not by tag), so a stage that took the F's in another order would pair micro-batch
    0's activations with micro-batch 1's labels and compute a wrong gradient without an error.
    Whether the stages fit together without waiting on each other forever is
    :func:`simulate`'s question.

    Example::

        >>> check_schedule([[("B", 0), ("F", 0)]], 1)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ValueError: stage 0 runs ('B', 0) before ('F', 0): a backward needs its forward's
        activations
    """
    expected = sorted((kind, i) for kind in "FB" for i in range(m))
    for stage, actions in enumerate(schedule):
        got = sorted(tuple(a) for a in actions)
        if got != expected:
            missing = sorted(set(expected) - set(got))
            extra = [a for a in got if got.count(a) > 1 or a not in expected]
            raise ValueError(f"stage {stage} must run ('F', i) and ('B', i) once for each of the "
                             f"{m} micro-batches: missing {missing}, extra or repeated "
                             f"{sorted(set(extra))}")
        position = {tuple(a): k for k, a in enumerate(actions)}
        for i in range(m):
            if position["B", i] < position["F", i]:
                raise ValueError(f"stage {stage} runs ('B', {i}) before ('F', {i}): a backward "
                                 f"needs its forward's activations")
    for stage in range(1, len(schedule)):
        for kind, sender in (("F", stage - 1), ("B", stage)):
            receiver = stage if kind == "F" else stage - 1
            order = {s: [i for k, i in schedule[s] if k == kind] for s in (sender, receiver)}
            if order[sender] != order[receiver]:
                raise ValueError(
                    f"stage {receiver} runs the {kind}'s in the order {order[receiver]} but stage "
                    f"{sender} sends them in the order {order[sender]}: messages are matched in "
                    f"order, so neighbouring stages must run the {kind}'s in the same order")


# ---- the bubble: formula, ideal timeline, measured ---------------------------------------------


def bubble_formula(stages: int, m: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal stages: ``(stages - 1) / (m + stages - 1)``.

    Each rank works ``m`` slots of (forward + backward) in a step that lasts ``m + stages - 1``
    slots. The ``stages - 1`` extra slots are the fill and the drain together: the forwards
    take ``stages - 1`` forward-times to reach the last stage, and the backwards as many
    backward-times to come back to the first.

    Example::

        >>> bubble_formula(2, 1), bubble_formula(2, 4), bubble_formula(4, 8)
        (0.5, 0.2, 0.2727272727272727)
    """
    _check_sizes(stages, m)
    return (stages - 1) / (m + stages - 1)


def simulate(schedule, forward=1.0, backward=2.0, message: float = 0.0) -> list[dict]:
    """The timeline of ``schedule`` when every action takes a fixed time: by default the ideal
    one (all stages equal, messages free). Returns events as :func:`run_pipeline` records them.

    ``forward`` and ``backward`` are one time for every stage or a list with one per stage;
    ``message`` is what receiving an input from another stage costs. A stage runs its next action as
    soon as it is free and the action's input is there: F i needs F i of the stage before,
    B i needs B i of the stage after. A schedule whose stages wait on each other forever
    raises ValueError naming where they are stuck.

    Example::

        >>> events = simulate(gpipe_schedule(2, 4))
        >>> round(measured_bubble(events), 12), bubble_formula(2, 4)
        (0.2, 0.2)
        >>> round(measured_bubble(simulate(gpipe_schedule(2, 4), message=0.5)), 3)
        0.368
    """
    stages = len(schedule)
    check_schedule(schedule, len(schedule[0]) // 2)
    times = {"F": _per_stage(forward, stages, "forward"),
             "B": _per_stage(backward, stages, "backward")}
    if message < 0:
        raise ValueError(f"message is a time, got {message}: use 0 for free messages")
    done: dict[tuple[str, int, int], float] = {}
    free, position, events = [0.0] * stages, [0] * stages, []
    while any(position[s] < len(schedule[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                kind, i = schedule[s][position[s]]
                if kind == "F":
                    needs = [("F", s - 1, i)] if s > 0 else []
                else:
                    needs = [("F", s, i)] + ([("B", s + 1, i)] if s < stages - 1 else [])
                if any(need not in done for need in needs):
                    break
                # The receiver pays for a hand-over once both it and the message are ready
                # (on CPU ranks the receive itself copies the data), so no compute hides it.
                handover = message if any(need[1] != s for need in needs) else 0.0
                start = max([free[s]] + [done[need] for need in needs]) + handover
                end = start + times[kind][s]
                done[kind, s, i] = free[s] = end
                events.append({"rank": s, "kind": kind, "micro": i, "start": start, "end": end})
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][position[s]] for s in range(stages)
                     if position[s] < len(schedule[s])}
            raise ValueError(f"the schedule deadlocks: each stage waits for another; next "
                             f"actions (stage: action) {stuck}")
    return events


def _per_stage(value, stages: int, what: str) -> list[float]:
    """One time per stage from a number or a list; a list of the wrong length is refused."""
    if isinstance(value, (int, float)):
        return [float(value)] * stages
    value = [float(v) for v in value]
    if len(value) != stages:
        raise ValueError(f"{what} has {len(value)} times for {stages} stages: give one number, "
                         f"or one time per stage")
    return value


def measured_bubble(events: list[dict]) -> float:
    """The fraction of a step the ranks sit idle, averaged over ranks (and over steps).

    Idle is any time between the step's first event start and last event end that a rank
    spends outside its own F/B events. Waiting for a message counts as idle: the events
    time compute only, from the moment the input has arrived. So the measured bubble is the
    formula's bubble plus communication, any imbalance between the stages, and the jitter of
    the compute itself (at every hand-over the faster side waits for the slower).

    Example::

        >>> measured_bubble([{"rank": 0, "kind": "F", "micro": 0, "start": 0, "end": 1},
        ...                  {"rank": 1, "kind": "F", "micro": 0, "start": 1, "end": 2}])
        0.5
    """
    if not events:
        raise ValueError("no events: pass the 'events' that run_pipeline (or simulate) returned")
    by_step: dict[int, list[dict]] = {}
    for e in events:
        by_step.setdefault(e.get("step", 0), []).append(e)
    idle = []
    for step_events in by_step.values():
        span = max(e["end"] for e in step_events) - min(e["start"] for e in step_events)
        for rank in sorted({e["rank"] for e in step_events}):
            busy = sum(e["end"] - e["start"] for e in step_events if e["rank"] == rank)
            idle.append(1 - busy / span)
    return statistics.fmean(idle)


def bubble_breakdown(events: list[dict]) -> dict:
    """Where a measured step's idle time comes from, by replaying its schedule in :func:`simulate`.

    Three models, each adding one real cost to the one before: ``formula`` (equal stages, free
    messages); ``stages`` (each stage's own median forward and backward times, free
    messages); ``messages`` (also the median hand-over delay: from the moment an action's
    input was sent, or its stage was free if later, to the moment it started). What
    ``measured`` (the median bubble over the steps) has beyond ``messages`` is jitter: compute
    times that vary from one micro-batch to the next, where every hand-over makes the faster
    side wait for the slower. Times are in seconds.

    Example::

        >>> b = bubble_breakdown(simulate(gpipe_schedule(2, 4), forward=1.0, message=0.5))
        >>> round(b["formula"], 3), round(b["messages"], 3), b["message_s"]
        (0.2, 0.368, 0.5)
    """
    if not events:
        raise ValueError("no events: pass the 'events' that run_pipeline (or simulate) returned")
    by_step: dict[int, list[dict]] = {}
    for e in events:
        by_step.setdefault(e.get("step", 0), []).append(e)
    stages = max(e["rank"] for e in events) + 1
    first = sorted(by_step[min(by_step)], key=lambda e: (e["rank"], e["start"]))
    schedule = [[(e["kind"], e["micro"]) for e in first if e["rank"] == s] for s in range(stages)]
    m = len(schedule[0]) // 2
    durations = {(kind, s): [] for kind in "FB" for s in range(stages)}
    delays = []
    for step_events in by_step.values():
        done = {(e["kind"], e["rank"], e["micro"]): e for e in step_events}
        for s in range(stages):
            mine = sorted((e for e in step_events if e["rank"] == s), key=lambda e: e["start"])
            for before, e in zip([None] + mine, mine, strict=False):
                durations[e["kind"], s].append(e["end"] - e["start"])
                sender = (e["kind"], s - 1 if e["kind"] == "F" else s + 1, e["micro"])
                if sender in done:
                    ready = max(done[sender]["end"], before["end"] if before else 0.0)
                    delays.append(max(0.0, e["start"] - ready))
    forward = [statistics.median(durations["F", s]) for s in range(stages)]
    backward = [statistics.median(durations["B", s]) for s in range(stages)]
    message = statistics.median(delays) if delays else 0.0
    return {"formula": bubble_formula(stages, m),
            "stages": measured_bubble(simulate(schedule, forward, backward)),
            "messages": measured_bubble(simulate(schedule, forward, backward, message)),
            "measured": statistics.median(measured_bubble(v) for v in by_step.values()),
            "forward_s": forward, "backward_s": backward, "message_s": message}


# ---- one process: what the pipeline must reproduce ----------------------------------------------


def _flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten().cpu() for p in module.parameters()
                      if p.grad is not None])


def reference_step(stage_module_fn, stages: int, batch, *, loss_fn=F.cross_entropy) -> dict:
    """The unpipelined step in this process: all stages, the whole batch, one backward.

    Returns ``{"loss": float, "grads": [flat gradients of stage 0, stage 1, ...]}``, what
    :func:`run_pipeline` and :func:`pipelining_step` must reproduce to float precision.

    Example::

        >>> ref = reference_step(stage_builder(mlp_stack), 2, example_batch(64))
        >>> len(ref["grads"])
        2
    """
    modules = [stage_module_fn(s, stages) for s in range(stages)]
    x, y = batch
    for module in modules:
        x = module(x)
    loss = loss_fn(x, y)
    loss.backward()
    return {"loss": loss.item(), "grads": [_flat_grads(m) for m in modules]}


# ---- many processes: rank r runs stage r -------------------------------------------------------


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_DIMS = 8


def _input_meta(module, first_input, rank: int, stages: int, device):
    """Shape and dtype of the tensor this stage receives per micro-batch, passed down the line.

    ``recv`` needs a buffer of the right size before the data arrives, so each stage learns its
    input's shape and dtype from the stage before, runs one forward on zeros to learn its
    output's, and tells the next stage.
    """
    if rank == 0:
        shape, dtype = tuple(first_input.shape), first_input.dtype
    else:
        meta = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=device)
        dist.recv(meta, src=rank - 1)
        ndim, code = int(meta[0]), int(meta[1])
        shape, dtype = tuple(int(d) for d in meta[2:2 + ndim]), _DTYPES[code]
    if rank < stages - 1:
        with torch.no_grad():
            out = module(torch.zeros(shape, dtype=dtype, device=device))
        if out.dtype not in _DTYPES or out.dim() > _MAX_DIMS:
            raise ValueError(f"stage {rank} outputs a {out.dtype} tensor with {out.dim()} dims: "
                             f"the activations sent must be floats of at most {_MAX_DIMS} dims")
        meta = [out.dim(), _DTYPES.index(out.dtype), *out.shape]
        meta = torch.tensor(meta + [0] * (_MAX_DIMS + 2 - len(meta)), dtype=torch.int64,
                            device=device)
        dist.send(meta, dst=rank + 1)
    return shape, dtype


def _unmeasured(kind: str, i: int):
    return contextlib.nullcontext()


def run_stage(module, actions, xs, ys, meta, loss_fn, device, measure=_unmeasured) -> list:
    """Inside a worker: this stage's ``actions`` for one step (:func:`run_pipeline`'s inner loop).

    ``("F", i)`` takes micro-batch i's activations from the stage before (stage 0 reads
    ``xs[i]``), runs the forward and sends its output on; the last stage computes the loss on
    ``ys[i]``, divided by m. ``("B", i)`` takes the gradient of that output from the stage
    after, runs the backward (accumulating into ``.grad``) and sends its input's gradient
    back. ``meta`` is the (shape, dtype) of this stage's input. ``measure(kind, i)`` is a
    context manager wrapped around each action's compute (:class:`StageMeter`'s, in
    :func:`run_pipeline`): the loop itself is only the schedule. Returns (last stage) the
    losses.

    Example::

        >>> meter = StageMeter(device)
        >>> losses = run_stage(module, [("F", 0), ("B", 0)], xs, ys, meta, F.cross_entropy,
        ...                    device, meter.measure)
        >>> meter.events, meter.peak
    """
    rank, stages, m = dist.get_rank(), dist.get_world_size(), len(xs)
    first, last = rank == 0, rank == stages - 1
    # This stage's tensors per micro-batch, kept from its F until its B: the input (whose
    # .grad the B sends back) and the output (whose backward the B runs).
    inputs, outputs, losses = {}, {}, []
    sends = []  # (work, tensor): a tensor must live until its isend has completed
    for kind, i in actions:
        if kind == "F":
            if first:
                x = xs[i]
            else:
                # Blocking recv: the time spent waiting here shows as a gap, i.e. as bubble.
                # No micro-batch number travels with it: the n-th message is micro-batch n.
                x = torch.empty(meta[0], dtype=meta[1], device=device)
                dist.recv(x, src=rank - 1)
                x.requires_grad_()  # we must send d(loss)/dx back to the stage before
            with measure("F", i):
                out = module(x)
                if last:
                    # Each micro-batch loss divided by m: the m backwards add up, in .grad, to
                    # the gradient of the whole batch's mean loss.
                    losses.append(loss_fn(out, ys[i]) / m)
            if last:
                outputs[i] = losses[-1]
            else:
                # isend, not send: a blocking send could wait for a stage that is itself
                # blocked sending to us (1F1B sends both ways), and the two would deadlock.
                # detach: the next stage gets values; the graph to here stays on this rank.
                activation = out.detach()
                sends.append((dist.isend(activation, dst=rank + 1), activation))
                outputs[i] = out
            inputs[i] = x
        else:
            grad = None
            if not last:  # the last stage's output is the loss: its backward needs no gradient
                grad = torch.empty_like(outputs[i])
                dist.recv(grad, src=rank + 1)
            with measure("B", i):
                outputs[i].backward(grad)  # accumulates into the parameters' .grad
            if not first:
                sends.append((dist.isend(inputs[i].grad, dst=rank - 1), inputs[i].grad))
            del inputs[i], outputs[i]  # this micro-batch's activations are freed now
    for work, _ in sends:
        work.wait()
    return losses


class StageMeter:
    """What :func:`run_pipeline` measures around :func:`run_stage`'s actions, kept apart from the
    schedule: each action's compute time, and the activations the stage holds for backward.

    ``measure(kind, i)`` syncs the device and starts the clock after the action's receive
    (waiting is idle, not compute); an F counts the bytes autograd saves for its B (``held``,
    the weights and the batch, held anyway, left out) and a B frees them. ``events`` are
    ``{"rank", "kind", "micro", "start", "end"}`` in seconds from :meth:`start_step`; ``peak``
    is ``{"live", "bytes", "micro"}``: the most micro-batches alive at once (forward done,
    backward owed), the most bytes they kept, and the bytes of one micro-batch.
    """

    def __init__(self, device, held=()):
        self.device, self.held = device, held
        self.rank = dist.get_rank()
        self.events: list[dict] = []
        self.alive: dict[int, int] = {}  # micro-batch -> bytes its F saved, until its B runs
        self.peak = {"live": 0, "bytes": 0, "micro": 0}
        self.t0 = time.perf_counter()

    def start_step(self) -> None:
        """A new step: its events count from now (call it right after the step's barrier)."""
        self.events, self.t0 = [], time.perf_counter()

    @contextlib.contextmanager
    def measure(self, kind: str, i: int):
        sync(self.device)  # work queued before (a receive's copy) is not this action's
        start = time.perf_counter()
        if kind == "F":
            with counting_saved_bytes(exclude=self.held) as saved:
                yield
            self.alive[i] = saved["bytes"]
            self.peak.update(live=max(self.peak["live"], len(self.alive)),
                             bytes=max(self.peak["bytes"], sum(self.alive.values())),
                             micro=max(self.peak["micro"], saved["bytes"]))
        else:
            yield
            self.alive.pop(i, None)
        sync(self.device)
        self.events.append({"rank": self.rank, "kind": kind, "micro": i,
                            "start": start - self.t0, "end": time.perf_counter() - self.t0})


def run_pipeline(stage_module_fn, schedule="gpipe", m: int = 4, batch=None, *, steps: int = 1,
                 warmup: int = 0, loss_fn=F.cross_entropy, threads: int | None = None,
                 return_grads: bool = True) -> dict:
    """Worker function: one training step (forward and backward) of a pipeline, rank r = stage r.

    ``stage_module_fn(stage, stages)`` builds this rank's stage (see :func:`stage_builder`);
    ``schedule`` is ``"naive"`` (needs ``m=1``), ``"gpipe"``, ``"1f1b"`` or a hand-written list
    of per-stage actions; ``batch`` is ``(x, y)``, the same on every rank (the first stage
    reads ``x``, the last ``y``). Activations travel forward and gradients backward with
    point-to-point sends; the last stage computes the loss. Gradients are accumulated over the
    micro-batches, each loss divided by ``m``, so they equal one unpipelined step on the whole
    batch (:func:`reference_step`). The optimizer step is left out: it is local to each stage.

    ``warmup`` untimed steps, then ``steps`` timed ones. Each step starts with a barrier and
    every rank times its events from there, so the ranks share t = 0 (to the barrier's skew,
    well under a millisecond on one machine). Events time compute only: waiting for a message
    is idle.

    Returns, on every rank, ``{"events": [...all ranks' events], "loss": float, "grads": this
    rank's flat gradients (of the last step) or None, "rank", "schedule", "m"}``; an event is
    ``{"rank", "kind": "F" or "B", "micro", "start", "end", "step"}`` in seconds. Lists with
    one entry per stage say what activation memory the schedule needed: ``peak_live``, the
    most micro-batches a stage held at once (forward done, backward not yet run: GPipe ``m``,
    1F1B ``min(m, stages - s)`` on stage ``s``), ``peak_saved_bytes``, the most bytes autograd
    kept for them (counted with ``saved_tensors_hooks``; the weights and the batch, held
    anyway, left out), and ``micro_saved_bytes``, what one micro-batch's forward keeps.

    Example::

        >>> out = labkit.launch(run_pipeline, stage_builder(mlp_stack), "1f1b", 4,
        ...                     example_batch(512), nproc=2).values
        >>> round(measured_bubble(out[0]["events"]), 2), bubble_formula(2, 4)   # 2 CPU cores
        (0.22, 0.2)
    """
    device = collective_device()
    rank, stages = dist.get_rank(), dist.get_world_size()
    if batch is None:
        raise ValueError("pass batch=(x, y): the first stage reads x, the last stage y")
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    actions = _schedule(schedule, stages, m)[rank]
    if threads:
        torch.set_num_threads(threads)
    x, y = (t.to(device) for t in batch)
    xs, ys = micro_batches(x, m), micro_batches(y, m)
    module = stage_module_fn(rank, stages).to(device)
    meta = _input_meta(module, xs[0], rank, stages, device)
    # Held for the whole step whatever the schedule, so not counted as activations: the
    # weights, and the batch (stage 0's micro-batches are views of it).
    meter = StageMeter(device, held=[*module.parameters(), x, y])
    events, losses = [], []
    for step in range(warmup + steps):
        module.zero_grad(set_to_none=True)
        barrier(device)
        meter.start_step()
        losses = run_stage(module, actions, xs, ys, meta, loss_fn, device, meter.measure)
        if step >= warmup:
            events += [{**e, "step": step - warmup} for e in meter.events]
    peak = meter.peak
    # The loss lives on the last stage; send it to every rank so any rank's result is complete.
    loss = torch.tensor([float(sum(loss.item() for loss in losses))], dtype=torch.float64,
                        device=device)
    dist.broadcast(loss, src=stages - 1)
    everyone: list = [None] * stages
    dist.all_gather_object(everyone, (events, peak))
    return {"rank": rank, "schedule": schedule if isinstance(schedule, str) else "custom",
            "m": m, "events": [e for rank_events, _ in everyone for e in rank_events],
            "peak_live": [p["live"] for _, p in everyone],
            "peak_saved_bytes": [p["bytes"] for _, p in everyone],
            "micro_saved_bytes": [p["micro"] for _, p in everyone],
            "loss": loss.item(), "grads": _flat_grads(module) if return_grads else None}


def bubble_sweep(stage_module_fn, ms, batch, *, schedules=("gpipe", "1f1b"), steps: int = 3,
                 warmup: int = 1, threads: int | None = None) -> list[dict]:
    """Worker function: the measured bubble for each schedule and micro-batch count in ``ms``.

    Every rank returns the same rows: ``schedule, stages, m, micro_batch, formula, measured``
    (the median over the ``steps`` timed steps: one step disturbed by another program does not
    move it), ``measured_steps`` (each step's bubble) and ``step_s`` (median time from a step's
    first event to its last); and, from :func:`bubble_breakdown`, the bubble the schedule
    would have with each stage's own compute times (``uneven_stages``) and also with the
    measured hand-over cost ``message_s`` (``with_messages``). ``m=1`` is naive model
    parallelism, measured once for all schedules.

    Example::

        >>> rows = labkit.launch(bubble_sweep, stage_builder(mlp_stack), [1, 2, 4, 8],
        ...                      example_batch(512), nproc=2).values[0]
        >>> [(r["schedule"], r["m"], round(r["measured"], 2), round(r["formula"], 2))
        ...  for r in rows][:3]                                    # 2 CPU cores, gloo
        [('gpipe', 1, 0.5, 0.5), ('gpipe', 2, 0.35, 0.33), ('gpipe', 4, 0.25, 0.2)]
    """
    stages, rows, runs = dist.get_world_size(), [], {}
    for name in schedules:
        for m in ms:
            run = "naive" if m == 1 else name
            if (run, m) not in runs:
                runs[run, m] = run_pipeline(stage_module_fn, run, m, batch, steps=steps,
                                            warmup=warmup, threads=threads, return_grads=False)
            per_step = [[e for e in runs[run, m]["events"] if e["step"] == step]
                        for step in range(steps)]
            bubbles = [measured_bubble(events) for events in per_step]
            spans = [max(e["end"] for e in events) - min(e["start"] for e in events)
                     for events in per_step]
            model = bubble_breakdown(runs[run, m]["events"])
            rows.append({"schedule": name, "stages": stages, "m": m,
                         "micro_batch": batch[0].shape[0] // m,
                         "formula": bubble_formula(stages, m),
                         "uneven_stages": model["stages"], "with_messages": model["messages"],
                         "message_s": model["message_s"],
                         "measured": model["measured"], "measured_steps": bubbles,
                         "step_s": statistics.median(spans)})
    return rows


def pipelining_step(stage_module_fn, schedule: str = "gpipe", m: int = 4, batch=None, *,
                    loss_fn=F.cross_entropy, return_grads: bool = True) -> dict:
    """Worker function: the same step with PyTorch's own ``torch.distributed.pipelining``.

    Each rank wraps its stage in a ``PipelineStage`` (shapes are inferred from the first
    micro-batch) and runs ``ScheduleGPipe`` or ``Schedule1F1B``. The first stage passes ``x``
    to ``step``, the last the target; torch splits the batch into ``m`` micro-batches and
    divides the accumulated gradients by ``m`` (``scale_grads=True``), as :func:`run_pipeline`
    does. Returns ``{"loss": the mean of the micro-batch losses, "grads", "step_s"}``.

    Example::

        >>> out = labkit.launch(pipelining_step, stage_builder(mlp_stack), "1f1b", 4,
        ...                     example_batch(64), nproc=2).values
        >>> abs(out[0]["loss"] - reference_step(stage_builder(mlp_stack), 2,
        ...                                     example_batch(64))["loss"]) < 1e-5
        True
    """
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {schedule!r} for torch.distributed.pipelining: use "
                         f"gpipe or 1f1b")
    if batch is None:
        raise ValueError("pass batch=(x, y): the first stage reads x, the last stage y")
    # Imported here: torch.distributed.pipelining takes seconds to import (it brings torch.export).
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    device = collective_device()
    rank, stages = dist.get_rank(), dist.get_world_size()
    x, y = batch
    micro_batches(x, m)  # the same check, and message, as run_pipeline
    module = stage_module_fn(rank, stages).to(device)
    stage = PipelineStage(module, rank, stages, device)
    # scale_grads=True divides the accumulated gradients by m (our losses are means); said
    # explicitly because older torch (before 2.7) had no such option and summed them.
    runner = classes[schedule](stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=True)
    first, last = rank == 0, rank == stages - 1
    args = (x.to(device),) if first else ()
    kwargs = {"target": y.to(device), "losses": []} if last else {}
    barrier(device)
    start = time.perf_counter()
    runner.step(*args, **kwargs)
    sync(device)
    step_s = time.perf_counter() - start
    mean = statistics.fmean(v.item() for v in kwargs["losses"]) if last else 0.0
    loss = torch.tensor([mean], dtype=torch.float64, device=device)
    dist.broadcast(loss, src=stages - 1)
    return {"rank": rank, "schedule": schedule, "m": m, "loss": loss.item(), "step_s": step_s,
            "grads": _flat_grads(module) if return_grads else None}

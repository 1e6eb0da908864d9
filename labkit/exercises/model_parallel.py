"""Notebook 03's exercises: the 1F1B schedule as data, Megatron's f and g, ZeRO's bytes per rank.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint. The schedule is judged by what it
does in the simulator of :mod:`labkit.parallel.schedules` (no deadlock, neighbours' messages in
the same order, 1F1B's bubble, no more activations held than 1F1B), so another valid order
passes; then it and the tensor-parallel collectives run on 2 and 4 real gloo ranks
(:func:`labkit.check.on_ranks`), through the same pipeline runner and against the same dense
layers the notebook uses.
"""

from __future__ import annotations

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "03"

# (stages, m) pairs the schedule is judged on: m below, equal to and above p (m = 1 too), on 2, 3
# and 4 stages.
_SCHEDULE_CASES = ((2, 4), (2, 2), (2, 1), (2, 3), (3, 4), (4, 8), (4, 4), (4, 2), (4, 3))
# (ranks, m) the order is then played on for real, by the runner of section 2
_SCHEDULE_RUNS = ((2, 4), (4, 6))

_DEADLOCK = ("a stage waits for a backward that needs a forward it has not run yet: stage s "
             "must run at least as many forwards before its first backward as stage s + 1 "
             "(the gradient of its oldest micro-batch comes back only after every later stage "
             "has run that micro-batch's forward; 1F1B warms up with p-s-1 forwards)")
_ORDER = ("messages carry no micro-batch number: a stage's n-th receive from a neighbour is that "
          "neighbour's n-th send. Keep one micro-batch order on every stage, for the forwards "
          "and for the backwards alike")


def _fmt(actions) -> str:
    return " ".join(f"{k}{i}" for k, i in actions)


def _as_schedule(fn, stages: int, m: int) -> list[list[tuple[str, int]]]:
    """The learner's schedule for (stages, m), as lists of ("F"/"B", int) tuples, or NotYet."""
    return parse_schedule(fn(stages, m), f"my_1f1b({stages}, {m})", stages, "stage", "('F', 0)",
                          fields=2)


def parse_schedule(got, call: str, rows: int, per: str, example: str, *,
                   fields: int) -> list[list[tuple]]:
    """A learner's schedule as ``rows`` lists (one per ``per``: stage or rank) of actions
    ``(kind, int, ...)`` of ``fields`` fields, like ``example``, or NotYet saying what ``call``
    should return. Notebook 10's interleaved schedule (``(kind, chunk, i)``) is read the same
    way."""
    shape = f"{call} must return a list of {rows} lists (one per {per}) of actions like {example}"
    if not isinstance(got, (list, tuple)) or len(got) != rows:
        what = f"{len(got)} lists" if isinstance(got, (list, tuple)) else repr(got)[:120]
        raise NotYet(f"{call} returned {what}", shape)
    try:
        out = [[(str(a[0]), *(int(v) for v in a[1:])) for a in actions] for actions in got]
    except (TypeError, ValueError, IndexError, KeyError):
        out = None
    if out is None or any(len(a) != fields for actions in out for a in actions):
        raise NotYet(f"{call} returned {str(got)[:120]}", shape)
    return out


def _relabelled(schedule, m: int):
    """``schedule`` with its micro-batches renumbered in the order stage 0 runs their forwards.

    The numbers are only names: running the micro-batches in another order, the same on every
    stage, is as good as 1F1B's. Renumbered, such an order compares with 1F1B's step by step,
    so that a mistake in it is named as it would be in 1F1B's numbering.
    """
    order = [i for kind, i in schedule[0] if kind == "F"]
    if sorted(order) != list(range(m)):
        return schedule
    new = {i: k for k, i in enumerate(order)}
    return [[(kind, new.get(i, i)) for kind, i in actions] for actions in schedule]


def _schedule_mistake(stage: int, stages: int, m: int, got, want) -> NotYet | None:
    """Why stage ``stage`` of a runnable schedule is not 1F1B: the usual mistakes, named."""
    if got == want:
        return None
    lead = next((k for k, (kind, _) in enumerate(got) if kind == "B"), len(got))
    expected = min(stages - stage, m)  # p-s-1 warm-up forwards, then the first steady forward
    where = f"(stages={stages}, m={m}) stage {stage} runs {_fmt(got)}; 1F1B runs {_fmt(want)}"
    if lead == m and m > expected:
        return NotYet(where, f"stage {stage} runs all its forwards first: that is GPipe, the same "
                             f"bubble but the activations of all m micro-batches held at once. "
                             f"1F1B starts the backward of its oldest micro-batch as soon as it "
                             f"holds {expected}, then alternates one F, one B")
    if lead > expected:
        return NotYet(where, f"warm-up too long: stage {stage} runs {lead} forwards before its "
                             f"first backward, {lead - expected} more than it needs to keep the "
                             f"later stages busy; each one holds a micro-batch's activations "
                             f"until its backward (stage s of p: p-s-1 warm-up forwards, at most "
                             f"m, then the first forward of the steady state)")
    if lead < expected:
        return NotYet(where, f"warm-up too short: stage {stage} starts its first backward after "
                             f"{lead} forward(s), before the gradient can be back, and waits for "
                             f"it. A micro-batch's gradient returns to stage s only after its "
                             f"forward has gone through every later stage: stage s of p needs "
                             f"p-s-1 warm-up forwards (at most m), then one more forward")
    return NotYet(where, "after the warm-up, alternate: the next forward, then the backward of the "
                         "oldest micro-batch still held; end with the backwards still owed")


def _invalid_hint(schedule, stages: int, m: int) -> str:
    """A hint for a schedule that check_schedule refused (its message says what is wrong)."""
    forwards = [[i for kind, i in actions if kind == "F"] for actions in schedule]
    backwards = [[i for kind, i in actions if kind == "B"] for actions in schedule]
    if any(max((i for _, i in actions), default=0) >= m for actions in schedule) and m < stages:
        return (f"with fewer micro-batches than stages (m={m}) the warm-up is min(p-s-1, m) "
                f"forwards")
    if all(sorted(f) == list(range(m)) and sorted(b) == list(range(m))
           for f, b in zip(forwards, backwards, strict=True)):
        if any(f != b for f, b in zip(forwards, backwards, strict=True)):
            return ("the backwards go oldest first, in the order of the forwards (B0, B1, ...): "
                    "each one frees the oldest micro-batch's activations, and the last stage "
                    "runs each backward right after its forward")
        return _ORDER
    return "each stage runs ('F', i) and ('B', i) exactly once for i in range(m), B i after F i"


def _judge_schedule(got, stages: int, m: int) -> bool:
    """NotYet unless ``got`` runs with 1F1B's bubble and holds no more than 1F1B; whether it is
    1F1B's own order (another numbering of the micro-batches passes too)."""
    from fractions import Fraction

    from ..parallel import pipeline, schedules

    where = f"(stages={stages}, m={m})"
    want = pipeline.one_f_one_b_schedule(stages, m)
    try:  # every F and B once, B after F, neighbours in the same order
        pipeline.check_schedule(got, m)
    except ValueError as err:
        raise NotYet(f"{where}: {err}", _invalid_hint(got, stages, m)) from None
    try:  # the stages must also fit together without waiting on each other forever
        pipeline.simulate(got)
    except ValueError as err:
        raise NotYet(f"{where}: {err}", _DEADLOCK) from None

    def named(detail: str, stage: int | None, fallback: str) -> NotYet:
        mine = _relabelled(got, m)
        rows = [stage] if stage is not None else range(stages)
        mistake = next((e for s in rows
                        if (e := _schedule_mistake(s, stages, m, mine[s], want[s]))), None)
        if mistake is None:
            return NotYet(detail, fallback)
        return NotYet(f"{detail}; {mistake.detail.split(') ', 1)[1]}", mistake.hint)

    # Equal forward and backward times, free messages: 1F1B's bubble is (p-1)/m of the compute.
    ideal = Fraction(stages - 1, m)
    bubble = schedules.simulate_chunked(got, stages, m, f=Fraction(1), b=Fraction(1),
                                        w=Fraction(0))["idle_per_compute"]
    if bubble > ideal:
        raise named(f"{where}: it runs, but its simulated bubble is {bubble} of the compute; "
                    f"1F1B's (and GPipe's) is (p-1)/m = {ideal}", None,
                    "a stage waits for work it could have had: keep every stage busy from its "
                    "first forward to its last backward")
    held, limit = (schedules.peak_in_flight(x, stages, m) for x in (got, want))
    worst = max(range(stages), key=lambda s: held[s] - limit[s])
    if held[worst] > limit[worst]:
        raise named(f"{where}: bubble {bubble} as it should be, but stage {worst} holds "
                    f"{held[worst]:g} micro-batches' activations at once, 1F1B {limit[worst]:g}",
                    worst, "a forward held longer than needed costs memory: run each backward as "
                           "soon as its gradient can be there")
    return got == want


def _run_schedule(schedule, m: int, seed: int = 0) -> dict:
    """Grading worker: ``schedule`` executed by the pipeline runner on a tiny model, rank = stage.

    Returns the largest gradient difference from the unpipelined step and the micro-batches
    each stage held at once (plain data, compared in the grader).
    """
    import functools

    import torch.distributed as dist

    from ..parallel import pipeline

    build = pipeline.stage_builder(functools.partial(pipeline.mlp_stack, 16, 4, 8, 4), seed=seed)
    batch = pipeline.example_batch(4 * m, inputs=8, classes=4, seed=seed)
    out = pipeline.run_pipeline(build, schedule, m, batch)
    ref = pipeline.reference_step(build, dist.get_world_size(), batch)
    return {"grad_diff": (out["grads"] - ref["grads"][dist.get_rank()]).abs().max().item(),
            "loss_diff": abs(out["loss"] - ref["loss"]), "peak_live": out["peak_live"]}


@exercise("pipeline_1f1b_schedule", notebook=NOTEBOOK, title="the 1F1B schedule as data")
def pipeline_1f1b_schedule(fn, cases=_SCHEDULE_CASES, runs=_SCHEDULE_RUNS) -> str:
    """Exercise: ``fn(stages, m)``, one list of ("F", i) / ("B", i) actions per stage, runs as
    1F1B does: its bubble, no more memory.

    Judged by what the order does, for several (stages, m) (m below, equal to and above the
    stages): neighbours run their forwards and backwards in the same order
    (``pipeline.check_schedule``), the stages never wait on each other forever
    (``pipeline.simulate``), the simulated bubble is (p - 1) / m of the compute
    (``schedules.simulate_chunked``) and no stage holds more micro-batches at once than
    ``pipeline.one_f_one_b_schedule`` (torch's Schedule1F1B order; ``schedules.peak_in_flight``).
    Another valid order passes. Then played on 2 and 4 gloo ranks by ``pipeline.run_pipeline``
    (``runs``: (ranks, m) pairs).

    Example::

        >>> exercise.pipeline_1f1b_schedule(my_1f1b)
        [pass] the 1F1B schedule as data: ... bubble (p-1)/m ... held [2, 1] ...
    """
    from ..parallel import schedules

    same = sum(_judge_schedule(_as_schedule(fn, stages, m), stages, m) for stages, m in cases)
    # The order is right on paper; play it for real: the runner must reproduce the unpipelined
    # gradients, and each stage hold what the simulator counted.
    held = {}
    for world, m in runs:
        got = _as_schedule(fn, world, m)
        ranks = on_ranks(_run_schedule, got, m, nproc=world)
        worst = max(r["grad_diff"] for r in ranks)
        want = [int(x) for x in schedules.peak_in_flight(got, world, m)]
        if worst > 1e-5 or ranks[0]["peak_live"] != want:
            raise NotYet(f"on {world} ranks (m={m}): gradients off by {worst:.1e}, held "
                         f"{ranks[0]['peak_live']} (the simulator: {want})",
                         "the order passed the simulator, so this is the runner: restart the "
                         "kernel and run the notebook from the top")
        held[world, m] = ranks[0]["peak_live"]
    order = ("the order of torch's Schedule1F1B" if same == len(cases) else
             f"a valid order ({len(cases) - same} of them other than torch's Schedule1F1B)")
    played = "; ".join(f"on {w} ranks (m={m}) its stages held {held[w, m]} micro-batches at "
                       f"once (GPipe: {[m] * w})" for w, m in runs)
    return (f"{order} for {len(cases)} (stages, m) pairs, m below, equal to and above the "
            f"stages: neighbours in the same order, no deadlock, simulated bubble (p-1)/m "
            f"exactly, no stage holding more than 1F1B"
            + (f"; played on gloo ranks it gave the unpipelined gradients: {played}" if runs
               else ""))


# ---- tensor parallelism: Megatron's f and g ---------------------------------------------------


def _tp_probe(copy_cls, reduce_cls, sizes=(4, 8, 16, 8), seed: int = 0) -> dict:
    """Grading worker: the learner's f and g on known tensors, then in a Megatron MLP.

    Probes: f forward on x (must be x), f backward of a gradient ``rank + 1`` (must be the sum
    over ranks), g forward of ``rank + 1`` (the sum), g backward of ones (ones). Then a column-
    then-row MLP built with f and g from this rank's slices of a dense MLP: output, input and
    weight gradients beside the dense MLP's, and the collectives of the forward and backward.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from ..parallel import tensor

    rank, t = dist.get_rank(), dist.get_world_size()
    probe = {}
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    y = copy_cls.apply(x * 1.0)  # a non-leaf input, as in a model
    probe["f_forward"] = y.detach().clone()
    y.backward(torch.full_like(y, rank + 1.0))
    probe["f_backward"] = x.grad.clone()
    base = torch.ones(2, 3, requires_grad=True)
    z = reduce_cls.apply(base * (rank + 1.0))
    probe["g_forward"] = z.detach().clone()
    z.backward(torch.ones_like(z))
    probe["g_backward"] = base.grad / (rank + 1.0)  # the gradient g handed back, per element

    batch, in_f, hidden, out_f = sizes
    torch.manual_seed(seed)
    dense = tensor.dense_mlp(in_f, hidden, out_f)
    x = torch.randn(batch, in_f)  # the same on every rank
    xd = x.clone().requires_grad_()
    (dense(xd).square().sum() / 2).backward()
    rows = slice(rank * hidden // t, (rank + 1) * hidden // t)
    w1 = dense[0].weight.detach()[rows].clone().requires_grad_()   # column parallel: rows of W1
    b1 = dense[0].bias.detach()[rows].clone().requires_grad_()
    w2 = dense[2].weight.detach()[:, rows].clone().requires_grad_()  # row parallel: columns
    b2 = dense[2].bias.detach().clone().requires_grad_()
    xt = x.clone().requires_grad_()
    outs = []

    def forward():
        h = dense[1](F.linear(copy_cls.apply(xt), w1, b1))  # f, then this rank's hidden slice
        outs.append(reduce_cls.apply(F.linear(h, w2)) + b2)  # g sums the partial outputs

    from ..parallel.traffic import count_traffic

    with count_traffic() as fwd:
        forward()
    with count_traffic() as bwd:
        (outs[0].square().sum() / 2).backward()
    counts = {"forward": fwd.counts(), "backward": bwd.counts()}
    # what each all-reduce carried: g's the (batch, out) output, f's the (batch, in) gradient
    payloads = {"forward": [c.payload_bytes for c in fwd.calls],
                "backward": [c.payload_bytes for c in bwd.calls],
                "want": {"forward": [batch * out_f * 4], "backward": [batch * in_f * 4]}}
    pairs = {"output": (outs[0], dense(x)), "input grad": (xt.grad, xd.grad),
             "W2 grad": (w2.grad, dense[2].weight.grad[:, rows]),
             "W1 grad": (w1.grad, dense[0].weight.grad[rows])}
    return {"probe": probe, "collectives": counts, "payloads": payloads,
            "mlp": {k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in pairs.items()}}


def _same(a, b) -> bool:
    import torch

    return a is not None and a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def _probe_mistake(ranks) -> NotYet | None:
    """The first of f's and g's four jobs done wrong, named, from the probes of every rank."""
    import torch

    t = len(ranks)
    for r, got in enumerate(p["probe"] for p in ranks):
        x = torch.arange(6.0).reshape(2, 3)
        if not _same(got["f_forward"], x):
            turned = got["f_forward"].flatten()[:3].tolist()
            return NotYet(f"rank {r}: f's forward turned x into {turned}... instead of x "
                          f"({x.flatten()[:3].tolist()}...)",
                          "f's forward must return x unchanged: every rank already holds all of "
                          "x (return x.view_as(x), or x itself)")
        fb, gf, gb = got["f_backward"], got["g_forward"], got["g_backward"]
        mistake = _not_summed(r, t, gf, x, "g's forward", "partials",
                              "this rank's partial output unchanged",
                              "g's forward must all-reduce (sum, dist.all_reduce's default op, "
                              "no division) the partial outputs, on a copy: dist.all_reduce "
                              "works in place")
        if mistake is not None:
            return mistake
        if not _same(gb, torch.ones_like(x)):
            return NotYet(f"rank {r}: g's backward handed back {gb.flatten()[0].item():g} times "
                          f"the incoming gradient",
                          "g's backward must pass the gradient through unchanged: it is "
                          "already the same on every rank, so summing it multiplies every "
                          "gradient by the number of ranks")
        mistake = _not_summed(r, t, fb, x, "f's backward", "gradients",
                              "its own gradient unchanged",
                              "outputs right, input gradients wrong: the backward of the copy "
                              "(f) must all-reduce (sum) the gradient: each rank holds only its "
                              "share of dL/dx")
        if mistake is not None:
            return mistake
    return None


def _not_summed(r: int, t: int, got, like, part: str, noun: str, own: str,
                hint: str) -> NotYet | None:
    """None when ``got`` is shaped ``like`` and holds the sum over the ``t`` ranks of their
    ``rank + 1``, else NotYet naming what it holds instead: this rank's ``own`` value, the
    average, or the value."""
    import torch

    total = t * (t + 1) / 2  # the sum over ranks of (rank + 1)
    if _same(got, torch.full_like(like, total)):
        return None
    said = {r + 1.0: own, total / t: "the average"}
    what = said.get(round(got.flatten()[0].item(), 6), f"{got.flatten()[0].item():g}")
    return NotYet(f"rank {r}: {part} returned {what} ({noun} {list(range(1, t + 1))} on the "
                  f"ranks, their sum is {total:g})", hint)


@exercise("tp_f_and_g", notebook=NOTEBOOK, title="Megatron's f and g")
def tp_f_and_g(copy_cls, reduce_cls) -> str:
    """Exercise: two autograd Functions, f (identity / all-reduce) and g (all-reduce / identity).

    Run on 2, then 4 gloo ranks: each on known tensors, then together in a column-then-row
    parallel MLP whose output, input gradient and weight gradients must equal the dense MLP's,
    with one all-reduce forward (of the output) and one backward (of the input's gradient),
    their bytes counted.

    Example::

        >>> exercise.tp_f_and_g(MyCopyToTP, MyReduceFromTP)
        [pass] Megatron's f and g: ... equal the dense MLP's; 1 all-reduce forward, 1 backward
    """
    import torch

    for name, cls in (("f", copy_cls), ("g", reduce_cls)):
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            raise NotYet(f"{name} is {cls!r}, not a torch.autograd.Function subclass",
                         "pass the classes themselves: exercise.tp_f_and_g(MyCopyToTP, "
                         "MyReduceFromTP)")
    for world in (2, 4):
        _judge_tp(on_ranks(_tp_probe, copy_cls, reduce_cls, nproc=world), world)
    return ("f and g right on their own on 2 and 4 gloo ranks; in a column-then-row MLP the "
            "output, input gradient and weight gradients equal the dense MLP's; 1 all-reduce "
            "forward (of the output), 1 backward (of the input's gradient)")


def _judge_tp(ranks: list[dict], world: int) -> None:
    """Raise NotYet unless f and g are right on ``world`` ranks, values then route."""
    mistake = _probe_mistake(ranks)
    if mistake is not None:
        raise mistake
    for r, got in enumerate(p["mlp"] for p in ranks):
        for what, (mine, dense) in got.items():
            if not _same(mine, dense):
                raise NotYet(f"on {world} ranks, rank {r}: the MLP's {what} differs from the "
                             f"dense MLP's",
                             "f and g passed on their own: check that forward returns a tensor "
                             "of x's shape and backward one gradient per input")
    for r, got in enumerate(ranks):
        counts = got["collectives"]
        if counts != {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}:
            raise NotYet(f"on {world} ranks, rank {r}: right numbers, but the MLP's "
                         f"collectives were {counts}",
                         "Megatron's MLP communicates once each way: g's all-reduce in "
                         "forward, f's in backward, and nothing else")
        sent = got["payloads"]
        for way in ("forward", "backward"):
            if sent[way] != sent["want"][way]:
                what = {"forward": "output", "backward": "input gradient"}[way]
                raise NotYet(f"on {world} ranks, rank {r}: the {way} all-reduce carried "
                             f"{sent[way]} bytes; the {what} is {sent['want'][way]}",
                             "all-reduce the tensor itself, in its own dtype and shape (g: the "
                             "partial output, f: the gradient of x), not a padded, converted or "
                             "concatenated copy")


# ---- ZeRO: bytes per rank ---------------------------------------------------------------------

_KEYS = ("params", "grads", "optimizer")
_SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}  # the ZeRO stage that shards each


def _zero_cases():
    """(n_params, world_size, stage, param, grad, optimizer bytes): mixed and fp32 Adam, SGD."""
    return ([(7e9, 8, s, 2, 2, 12) for s in range(4)] + [(132_352, 2, s, 4, 4, 8) for s in range(4)]
            + [(1_000_000, 4, s, 2, 2, 8) for s in range(4)])


def _zero_mistake(case, key, got, want) -> NotYet:
    n, world, stage, *nbytes = case
    full = n * dict(zip(_KEYS, nbytes, strict=True))[key]
    default_full = n * {"params": 2, "grads": 2, "optimizer": 12}[key]
    where = (f"ZeRO-{stage}, {n:g} params on {world} ranks, {'/'.join(map(str, nbytes))} bytes: "
             f"{key} {got:,.0f}, expected {want:,.0f}")
    sharded = stage >= _SHARDED_FROM[key]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(abs(b), 1.0)  # noqa: E731
    if full != default_full and close(got, default_full / (world if sharded else 1)):
        return NotYet(where, "use the byte sizes passed in (param_bytes, grad_bytes, "
                             "optimizer_bytes), not 2 / 2 / 12")
    if sharded and close(got, full):
        says = {"optimizer": "optimizer state not sharded: ZeRO-1 and up divide it by world_size",
                "grads": "gradients not sharded: ZeRO-2 and up divide them by world_size too",
                "params": "parameters not sharded: ZeRO-3 (FSDP) divides them by world_size too"}
        return NotYet(where, says[key])
    if not sharded and close(got, full / world):
        return NotYet(where, f"ZeRO-{stage} keeps the {key} whole on every rank: stage 1 shards "
                             f"only the optimizer state, stage 2 also the gradients, stage 3 also "
                             f"the parameters (stage 0 is plain data parallelism)")
    if close(got, full * world):
        return NotYet(where, "multiplied by world_size: a shard is 1/world_size of the whole")
    return NotYet(where, "bytes = n_params x bytes per parameter, divided by world_size for what "
                         "that ZeRO stage shards")


@exercise("zero_bytes_per_rank", notebook=NOTEBOOK, title="ZeRO's bytes per rank")
def zero_bytes_per_rank(fn) -> str:
    """Exercise: ``fn(n_params, world_size, stage, param_bytes, grad_bytes, optimizer_bytes)``
    returns ``{"params", "grads", "optimizer"}``: the bytes one data-parallel rank holds.

    Compared with ``labkit.parallel.memory.estimate_memory`` for ZeRO stages 0 (plain DP) to 3,
    for mixed-precision Adam, fp32 Adam and SGD with momentum.

    Example::

        >>> exercise.zero_bytes_per_rank(my_zero_bytes)
        [pass] ZeRO's bytes per rank: stages 0 to 3 ... match memory.estimate_memory
    """
    from ..parallel import memory

    cases = _zero_cases()
    for case in cases:
        n, world, stage, pb, gb, ob = case
        got = fn(n, world, stage, pb, gb, ob)
        if not isinstance(got, dict) or any(k not in got for k in _KEYS):
            raise NotYet(f"my_zero_bytes{case} returned {str(got)[:100]}",
                         "return a dict with the three keys 'params', 'grads' and 'optimizer' "
                         "(bytes on one rank)")
        want = memory.estimate_memory(n, strategy=("dp", "zero1", "zero2", "zero3")[stage],
                                      world_size=world,
                                      bytes_per_param={"params": pb, "grads": gb, "optimizer": ob})
        for key in _KEYS:
            value = float(got[key])
            if abs(value - want[key]) > 1e-9 * max(abs(want[key]), 1.0):
                raise _zero_mistake(case, key, value, want[key])
    return (f"stages 0 to 3 for {len(cases) // 4} models (mixed-precision Adam, fp32 Adam, SGD) "
            f"match memory.estimate_memory")


# ==== challenge: a GPipe runner, stages on ranks, micro-batches over point-to-point ==========
# Graded on 2 and 4 ranks by every stage's gradients and the loss against one process on the
# whole batch, and by the route: m activation messages forward, m gradient messages back, each
# of its micro-batch's bytes, every forward before any backward (GPipe, not 1F1B).

_GP_WIDTH = 4
_GP_CASES = (("float32", 7, 3), ("float64", 8, 4))  # (dtype, rows, m): uneven, then even
_GP_TOL = {"float32": 1e-5, "float64": 1e-12}
_GP_ROUTE = ("GPipe: every forward first (micro-batch 0 to m - 1: receive its activations from "
             "rank r - 1 unless first, run the stage, send the output to rank r + 1 unless "
             "last), then every backward (receive the gradient of the output from rank r + 1 "
             "unless last, backward, send the input's gradient to rank r - 1 unless first); one "
             "message per micro-batch each way, with dist.isend / dist.recv")
_GP_BUFFER = ("receive into a buffer of the micro-batch's own rows (sizes from tensor_split: "
              "they differ by one when m does not divide rows) and of the stage's dtype "
              "(next(stage.parameters()).dtype), so that each message fits the buffer it lands "
              "in")


def _gp_stage(dtype: str, rank: int):
    import torch
    from torch import nn

    torch.manual_seed(10 + rank)
    return nn.Sequential(nn.Linear(_GP_WIDTH, _GP_WIDTH), nn.Tanh()).to(getattr(torch, dtype))


def _gpipe_worker(fn) -> list[dict]:
    """Each rank, each case: ``fn`` runs one step of stage ``rank``; grads, loss, messages."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ..parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype, rows, m in _GP_CASES:
        dt = getattr(torch, dtype)
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, _GP_WIDTH, generator=g).to(dt)
        y = torch.randn(rows, _GP_WIDTH, generator=g).to(dt)
        ref = [_gp_stage(dtype, r) for r in range(world)]  # one process, the whole batch
        h = x
        for s in ref:
            h = s(h)
        ref_loss = nn.functional.mse_loss(h, y)
        ref_loss.backward()
        stage = _gp_stage(dtype, rank)
        with traffic.count_traffic() as t:
            loss = fn(stage, x if rank == 0 else None, y if rank == world - 1 else None, rows,
                      _GP_WIDTH, m, nn.functional.mse_loss)
        out.append({
            "dtype": dtype, "rows": rows, "m": m,
            "calls": [(c.op, c.payload_bytes) for c in t.calls],
            "grads": [None if p.grad is None else p.grad.detach().clone()
                      for p in stage.parameters()],
            "want": [p.grad.detach().clone() for p in ref[rank].parameters()],
            "loss": None if loss is None else float(loss), "ref_loss": float(ref_loss)})
    return out


def _gp_on_ranks(fn, world: int) -> list:
    try:
        return on_ranks(_gpipe_worker, fn, nproc=world, timeout=30.0)
    except NotYet as wrong:
        hint = wrong.hint
        if wrong.stuck:
            hint = ("a rank waited for a message that never came: every send needs the matching "
                    "receive on the neighbour, in the same order (forwards 0..m-1 to rank r + 1, "
                    "then backwards to rank r - 1), and a blocking dist.send can wait for a rank "
                    "that is itself sending: send with dist.isend and wait() at the end")
        elif any(sign in wrong.detail for sign in ("size doesn't match", "SIGABRT",
                                                   "Connection reset", "native code")):
            hint = "a message arrived into a buffer of another size or dtype: " + _GP_BUFFER
        raise NotYet(f"on {world} ranks: {wrong.detail}", hint) from None


def _gp_route(where: str, got: dict, rank: int, world: int, esize: int) -> None:
    import torch

    calls, m, rows = got["calls"], got["m"], got["rows"]
    others = sorted({op for op, _ in calls if op not in ("send", "recv")})
    if others:
        raise NotYet(f"{where}: it called {', '.join(others)}",
                     "stages talk to their neighbours only, with point-to-point messages: "
                     + _GP_ROUTE)
    sizes = [len(p) * _GP_WIDTH * esize for p in torch.arange(rows).tensor_split(m)]
    first, last = rank == 0, rank == world - 1
    # forward: activations in from r - 1 (recv) and out to r + 1 (send); backward the reverse
    sends = [c for c in calls if c[0] == "send"]
    recvs = [c for c in calls if c[0] == "recv"]
    n_send, n_recv = (0 if last else m) + (0 if first else m), (0 if first else m) + (
        0 if last else m)
    if len(sends) != n_send or len(recvs) != n_recv:
        one = " (one message of the whole batch: no micro-batches)" if len(sends) in (1, 2) \
            and m > 2 else ""
        raise NotYet(f"{where}: rank {rank} sent {len(sends)} and received {len(recvs)} "
                     f"messages{one}; with m = {m} it sends {n_send} and receives {n_recv}",
                     _GP_ROUTE)
    if sorted(b for _, b in sends) != sorted(
            ([] if last else sizes) + ([] if first else sizes)):
        raise NotYet(f"{where}: rank {rank} sent messages of {[b for _, b in sends]} bytes; "
                     f"each micro-batch's activations or gradient are {sizes} bytes",
                     _GP_BUFFER)
    # GPipe: the forward's messages all come before the backward's, on every rank
    if first and last:
        return
    forward_count = m if (first or last) else 2 * m
    head = calls[:forward_count]
    if first:
        in_forward = all(op == "send" for op, _ in head)
    elif last:
        in_forward = all(op == "recv" for op, _ in head)
    else:
        in_forward = [op for op, _ in head].count("recv") == m and \
            [op for op, _ in head].count("send") == m
    if not in_forward:
        raise NotYet(f"{where}: rank {rank} exchanged a backward message before its last "
                     f"forward one (calls in order: {[op for op, _ in calls]})",
                     "that is not GPipe's order (1F1B interleaves, GPipe does not): run all m "
                     "forwards, then all m backwards; " + _GP_ROUTE)


@exercise("gpipe_runner", notebook=NOTEBOOK, title="challenge: a GPipe step on real stages")
def gpipe_runner(fn, worlds=(2, 4)) -> str:
    """Challenge: ``fn(stage, x, y, rows, width, m, loss_fn) -> loss`` runs one GPipe step.

    Rank r holds ``stage``, the r-th part of the model; rank 0 gets the batch ``x``, the last
    rank the targets ``y`` (others None). Run on real gloo ranks (``worlds``): 7 float32 rows
    in m = 3 micro-batches (uneven), 8 float64 rows in 4. Every stage's gradients and the last
    rank's loss must equal one process's on the whole batch (the mean loss); each rank sends m
    messages each way of its micro-batches' bytes, every forward before any backward.

    Example::

        >>> exercise.gpipe_runner(my_gpipe_step)
        [pass] challenge: a GPipe step on real stages: on 2 and 4 ranks ...
    """
    for world in worlds:
        ranks = _gp_on_ranks(fn, world)
        for rank, per_case in enumerate(ranks):
            for got in per_case:
                dtype, tol = got["dtype"], _GP_TOL[got["dtype"]]
                where = (f"on {world} ranks, {dtype}, {got['rows']} rows in m = {got['m']} "
                         f"micro-batches")
                if any(g is None for g in got["grads"]):
                    raise NotYet(f"{where}: stage {rank}'s parameters have no .grad",
                                 "every stage runs the backward of each micro-batch: "
                                 "output.backward(gradient received from rank r + 1), or "
                                 "loss.backward() on the last rank")
                esize = 8 if dtype == "float64" else 4
                _gp_values(where, got, rank, world, tol)
                _gp_route(where, got, rank, world, esize)
    return (f"on {' and '.join(map(str, worlds))} ranks, float32 and float64, uneven and even "
            f"micro-batches: every stage's gradients and the loss equal one process's on the "
            f"whole batch; m messages each way per rank, all forwards before any backward")


def _gp_values(where: str, got: dict, rank: int, world: int, tol: float) -> None:
    import torch

    rows, m = got["rows"], got["m"]
    sizes = [len(p) for p in torch.arange(rows).tensor_split(m)]
    if rank == world - 1:
        loss = got["loss"]
        if loss is None:
            raise NotYet(f"{where}: the last rank returned None",
                         "return the batch's mean loss (a float) on the last rank")
        if abs(loss - got["ref_loss"]) > tol * 10:
            hint = ("the batch's mean loss is the micro-batches' losses weighted by their rows: "
                    "sum of loss_i * rows_i / rows")
            if abs(loss - m * got["ref_loss"]) <= tol * 10 * m:
                hint = "the micro-batch losses were summed unscaled: " + hint
            raise NotYet(f"{where}: the last rank returned the loss {loss:.6g}; the whole "
                         f"batch's is {got['ref_loss']:.6g}", hint)
    for k, (g, w) in enumerate(zip(got["grads"], got["want"], strict=True)):
        gap = float((g.double() - w.double()).abs().max())
        if gap <= tol:
            continue
        if float((g.double() - m * w.double()).abs().max()) <= tol * m:
            raise NotYet(f"{where}: stage {rank}'s gradients are {m}x the whole batch's",
                         "each micro-batch's loss is part of the batch's mean: scale it by "
                         "rows_i / rows before its backward (the m backwards add up in .grad)")
        if len(set(sizes)) > 1:
            raise NotYet(f"{where}: stage {rank}'s gradients differ from the whole batch's by "
                         f"{gap:.2g} (micro-batches of {sizes} rows)",
                         "with micro-batches of unequal rows, dividing each loss by m is not the "
                         "batch's mean: scale micro-batch i's loss by rows_i / rows")
        raise NotYet(f"{where}: stage {rank}'s gradients differ from the whole batch's by "
                     f"{gap:.2g} (parameter {k})", "each stage's backward takes the gradient "
                     "that rank r + 1 sent for that same micro-batch; receive in the order they "
                     "were sent. " + _GP_ROUTE)

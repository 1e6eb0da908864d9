"""Notebook 00's exercises: a first all-reduce on real ranks, busbw, the ring's alpha-beta time.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint. The kernel of notebook 00 imports
no framework, so nothing here imports torch in the kernel: the all-reduce runs on the ranks,
which send back plain lists.
"""

from __future__ import annotations

import math

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "00"


# ---- first_allreduce: the learner's all-reduce, run on two gloo ranks ------------------------

def _contribution(rank: int) -> list[float]:
    """Rank r's tensor: chosen so that sum, mean, max, min and product all differ."""
    return [rank + 1.0, 4.0 - 5.0 * rank]  # rank 0: [1, 4], rank 1: [2, -1]


def _allreduce_worker(fn) -> dict:
    """On each rank: call ``fn(x)`` with this rank's tensor; what came back, ``x`` after, and
    the calls it made (kind, tensor bytes), counted by :mod:`labkit.parallel.traffic`."""
    import torch
    import torch.distributed as dist

    from ..parallel.traffic import count_traffic

    x = torch.tensor(_contribution(dist.get_rank()))
    with count_traffic() as sent:
        out = fn(x)
    kind = type(out).__name__
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().reshape(-1).tolist()
    elif isinstance(out, int | float):
        out = [float(out)]
    else:  # None (all_reduce returns None), a Work handle (async_op=True), ...
        out = None
    return {"out": out, "kind": kind, "x_after": x.tolist(),
            "calls": [(c.op, c.payload_bytes) for c in sent.calls]}


def _close(a, b) -> bool:
    return a is not None and len(a) == len(b) and all(
        math.isclose(u, v, rel_tol=1e-6, abs_tol=1e-6) for u, v in zip(a, b, strict=True))


@exercise("first_allreduce", notebook=NOTEBOOK, title="first all-reduce")
def first_allreduce(fn) -> str:
    """Exercise: ``fn(x)`` all-reduces this rank's tensor ``x`` and returns the sum, on every rank.

    Graded on two real ranks (gloo): rank 0 passes ``[1, 4]``, rank 1 ``[2, -1]``; both must
    return ``[3, 3]``; then on four (ranks 2 and 3 pass ``[3, -6]`` and ``[4, -11]``). The route
    too: one ``all_reduce`` of ``x`` on every rank, nothing else sent.

    Example::

        >>> exercise.first_allreduce(my_allreduce)
        [pass] first all-reduce: both ranks returned [3.0, 3.0], the sum of [1.0, 4.0] and ...
    """
    for world in (2, 4):
        _judge_allreduce(on_ranks(_allreduce_worker, fn, nproc=world, timeout=30))
    return ("on 2 ranks both returned [3.0, 3.0], the sum of [1.0, 4.0] and [2.0, -1.0]; on 4 "
            "ranks every rank returned the sum too, each with one all_reduce of x: all_reduce "
            "gave every rank the same total")


def _judge_allreduce(results: list[dict]) -> None:
    """Raise NotYet unless every rank returned the sum, reached by one all_reduce of x."""
    world = len(results)
    xs = [_contribution(r) for r in range(world)]
    total = [sum(col) for col in zip(*xs, strict=True)]
    outs = [r["out"] for r in results]
    if all(o is None for o in outs):
        kind = results[0]["kind"]
        if all(_close(r["x_after"], total) for r in results):
            raise NotYet(f"the sum was in x on every rank, but the function returned {kind}",
                         "dist.all_reduce(x) works in place and returns None: end with "
                         "`return x`")
        hint = ("async_op=True gives a handle: call its .wait(), then return the tensor"
                if kind == "Work" else "return the tensor that you all-reduced")
        raise NotYet(f"the function returned {kind}, not a tensor", hint)
    if all(_close(o, total) for o in outs):
        _route_mistake(results, world)
        return
    said = (f"rank 0 returned {outs[0]}, rank 1 {outs[1]}; the sum is {total} on both"
            if world == 2 else f"on {world} ranks the ranks returned {outs}; the sum is {total} "
                               f"on every one")
    columns = list(zip(*xs, strict=True))
    wrong = [  # what a typical mistake leaves on every rank, and what to do instead
        (lambda r: xs[r], "each rank kept its own value: no all-reduce happened (or it reduced "
                          "a copy and returned the original): call dist.all_reduce on the "
                          "tensor you return"),
        (lambda r: [sum(c) / len(c) for c in columns], "that is the mean: the exercise wants "
                          "the sum, all_reduce's default op (ReduceOp.SUM); dividing by the "
                          "world size comes later, when gradients are averaged"),
        (lambda r: [max(c) for c in columns], "that is the maximum: use op=dist.ReduceOp.SUM "
                                              "(the default) instead of MAX"),
        (lambda r: [min(c) for c in columns], "that is the minimum: use op=dist.ReduceOp.SUM "
                                              "(the default) instead of MIN"),
        (lambda r: [math.prod(c) for c in columns], "that is the product: use "
                                                    "op=dist.ReduceOp.SUM instead of PRODUCT"),
        (lambda r: [len(xs) * t for t in total], "world_size times the sum: the tensor was "
                                                 "all-reduced twice; call all_reduce once"),
    ]
    for expected, hint in wrong:
        if all(_close(o, expected(r)) for r, o in enumerate(outs)):
            raise NotYet(said, hint)
    if _close(outs[0], total):
        raise NotYet(said, "only rank 0 holds the sum: dist.reduce(x, dst=0) delivers it to "
                           "one rank, dist.all_reduce(x) to every rank")
    raise NotYet(said, "each rank must return its own tensor x after dist.all_reduce(x): the "
                       "element-wise sum over the ranks")


def _route_mistake(results: list[dict], world: int) -> None:
    """The sum is right: was it one all_reduce of x on every rank, and nothing else?"""
    for rank, got in enumerate(results):
        ops = [op for op, _ in got["calls"]]
        if ops == ["all_reduce"] and got["calls"][0][1] == 8:  # x: 2 float32 entries
            continue
        where = f"on {world} ranks, rank {rank}"
        if ops and set(ops) == {"all_reduce"}:
            raise NotYet(f"{where}: the right sum, with {len(ops)} all_reduce calls "
                         f"(of {[b for _, b in got['calls']]} bytes)",
                         "one dist.all_reduce(x) gives every rank the sum; more calls send the "
                         "data again (errors that cancel, like summing twice and dividing, "
                         "still cost the traffic)")
        raise NotYet(f"{where}: the right sum, but through {ops or 'no collective'}",
                     "this exercise is the all-reduce itself: dist.all_reduce(x), one call "
                     "that leaves the sum in x on every rank (gathering every rank's x and "
                     "adding sends each tensor to every rank, n - 1 times more per rank)")


# ---- busbw_from_algbw: nccl-tests' bus bandwidth ---------------------------------------------

@exercise("busbw_from_algbw", notebook=NOTEBOOK, title="bus bandwidth from algorithm bandwidth")
def busbw_from_algbw(fn) -> str:
    """Exercise: ``fn(algbw, n)`` is the bus bandwidth of an all-reduce on ``n`` ranks.

    Graded against :func:`labkit.bench.bus_bandwidth` for n = 1, 2, 3, 4, 8.

    Example::

        >>> exercise.busbw_from_algbw(my_busbw)
        [pass] bus bandwidth from algorithm bandwidth: busbw = algbw x 2(n-1)/n for n = 1 ...
    """
    from ..bench import bus_bandwidth

    ns, algbw = (1, 2, 3, 4, 8), 10.0
    got = {n: float(fn(algbw, n)) for n in ns}
    if all(math.isclose(got[n], bus_bandwidth(algbw, n), abs_tol=1e-9) for n in ns):
        return f"busbw = algbw x 2(n-1)/n for n = {', '.join(map(str, ns))}"
    many = [n for n in ns if n > 1]
    factors = [  # busbw / algbw of a typical mistake, and why it is wrong
        (lambda n: 1.0, "busbw came out equal to algbw: the 2(n-1)/n factor is missing (with "
                        "2 ranks it is 1, which hides it)"),
        (lambda n: (n - 1) / n, "(n-1)/n counts the reduce-scatter only: the all-gather sends "
                                "every chunk around the ring once more, so 2(n-1)/n"),
        (lambda n: 2 * (n - 1), "2(n-1) steps, but each step carries 1/n of the message: "
                                "divide by n"),
        (lambda n: float(n), "n is not the factor: each link carries 2(n-1) chunks of 1/n of "
                             "the message, 2(n-1)/n in all"),
        (lambda n: n / (2 * (n - 1)), "the factor is upside down: busbw = algbw x 2(n-1)/n, "
                                      "larger than algbw for n > 2"),
    ]
    for factor, hint in factors:
        if all(math.isclose(got[n], algbw * factor(n), rel_tol=1e-6) for n in many):
            raise NotYet(f"my_busbw(10, n) gave {_fmt(got)}", hint)
    wrong_n = [n for n in ns if not math.isclose(got[n], bus_bandwidth(algbw, n), abs_tol=1e-9)]
    if wrong_n == [1]:
        raise NotYet(f"my_busbw(10, 1) gave {got[1]:g}, expected 0",
                     "with one rank nothing crosses a link: 2(n-1)/n is 0 for n = 1, and "
                     "nccl-tests print a busbw of 0")
    raise NotYet(f"my_busbw(10, n) gave {_fmt(got)}; expected "
                 f"{_fmt({n: bus_bandwidth(algbw, n) for n in ns})}",
                 "a ring all-reduce sends 2(n-1) chunks of 1/n of the message over every link: "
                 "busbw = algbw x 2(n-1)/n")


def _fmt(values: dict) -> str:
    return ", ".join(f"n={n}: {v:.4g}" for n, v in values.items())


# ---- ring_allreduce_seconds: the alpha-beta model of a ring all-reduce -----------------------

@exercise("ring_allreduce_seconds", notebook=NOTEBOOK, title="ring all-reduce time")
def ring_allreduce_seconds(fn) -> str:
    """Exercise: ``fn(nbytes, n, alpha_s, bandwidth_GBps)``, the ring all-reduce's time in seconds.

    Graded against :func:`labkit.bench.ring_seconds` for several sizes, ranks and links: first
    the latency alone (no bytes), then the transfer alone (no latency), then both.

    Example::

        >>> exercise.ring_allreduce_seconds(my_ring_seconds)
        [pass] ring all-reduce time: 2(n-1)(alpha + S/n/B) for 18 cases: latency alone, ...
    """
    from ..bench import ring_seconds

    alpha, bw = 20e-6, 2.0
    for n in (2, 4, 8):  # latency only: 2(n-1) messages one after another
        got, want = float(fn(0, n, alpha, bw)), ring_seconds(0, n, alpha_s=alpha,
                                                             bandwidth_GBps=bw)
        if not math.isclose(got, want, rel_tol=1e-6):
            ratio = got / want
            hint = {0.0: "the latency term is missing: every step pays alpha",
                    0.5: "that is the reduce-scatter's n-1 steps only: the all-gather adds "
                         "n-1 more, 2(n-1) latencies in all"}.get(
                round(ratio, 6), f"a ring of n ranks takes 2(n-1) = {2 * (n - 1)} steps one "
                                 f"after the other, each paying alpha once")
            raise NotYet(f"with 0 bytes, n={n}, alpha={alpha * 1e6:g} us: {got * 1e6:.4g} us, "
                         f"expected {want * 1e6:.4g} us", hint)
    size = 64 << 20
    for n in (2, 4, 8):  # transfer only: 2(n-1) chunks of S/n bytes at B GB/s
        got, want = float(fn(size, n, 0.0, bw)), ring_seconds(size, n, alpha_s=0.0,
                                                              bandwidth_GBps=bw)
        if not math.isclose(got, want, rel_tol=1e-6):
            raise NotYet(f"with alpha=0, {size} bytes, n={n}, B={bw:g} GB/s: {got:.4g} s, "
                         f"expected {want:.4g} s", _transfer_hint(got / want, n))
    cases = [(s, n, a, b) for s in (1 << 10, 1 << 20, 256 << 20) for n in (1, 3)
             for a, b in ((5e-6, 10.0), (1e-3, 0.5))]
    for s, n, a, b in cases:  # both together, and one rank (nothing to send: 0 s)
        got, want = float(fn(s, n, a, b)), ring_seconds(s, n, alpha_s=a, bandwidth_GBps=b)
        if not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-15):
            raise NotYet(f"my_ring_seconds({s}, {n}, {a:g}, {b:g}) gave {got:.4g} s, expected "
                         f"{want:.4g} s",
                         "with one rank nothing is sent: 0 s" if n == 1 else
                         "add the two parts: 2(n-1) x (alpha + S/n / (B x 1e9))")
    return (f"2(n-1)(alpha + S/n/B) for {6 + len(cases)} cases: latency alone, transfer alone, "
            f"both, and one rank")


def _transfer_hint(ratio: float, n: int) -> str:
    """What a wrong transfer time most likely forgot, from its ratio to the right one."""
    for value, hint in [
        (n, "each step carries one chunk of S/n bytes, not the whole message"),
        (0.5, "that is the reduce-scatter's half: the all-gather moves 2(n-1)/n x S in all, "
              "not (n-1)/n x S"),
        (n / (2 * (n - 1)), "S / B is one copy of the message: the ring moves 2(n-1) chunks of "
                            "S/n over each link"),
    ]:
        if math.isclose(ratio, value, rel_tol=1e-6):
            return hint
    for power in (3, 6, 9, -3, -6, -9):
        if math.isclose(ratio, 10.0 ** power, rel_tol=1e-6):
            return (f"off by a factor of 10^{power}: bandwidth_GBps is in GB/s, so divide bytes "
                    f"by bandwidth_GBps x 1e9 for seconds")
    return "2(n-1) steps, each one chunk of S/n bytes over a link of B x 1e9 bytes per second"

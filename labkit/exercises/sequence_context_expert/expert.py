"""Notebook 09's expert-parallel exercise: the permutation that sends each token to its
expert's rank (:func:`labkit.parallel.expert.dispatch_order` is the reference)."""

from __future__ import annotations

from ...check import NotYet, exercise, on_ranks

NOTEBOOK = "09"
__all__ = ["expert_dispatch"]

_TOL = 1e-5  # float32: the same products in the same order, up to BLAS blocking


def _cases():
    """(what, flat expert index, n_experts, world): the shapes of routing a dispatch must handle."""
    import torch

    g = torch.Generator().manual_seed(0)
    top2 = torch.randint(0, 4, (16, 2), generator=g).reshape(-1)
    no_expert_1 = torch.tensor([0, 2, 3, 0, 2, 2, 3, 0, 0, 3, 2, 0])
    no_rank_2 = torch.tensor([7, 0, 3, 1, 6, 0, 2, 7, 3, 1, 6, 0, 7, 2])  # 8 experts, 4 ranks
    all_to_rank_1 = torch.randint(2, 4, (10,), generator=g)
    top1 = torch.randint(0, 8, (12, 1), generator=g).reshape(-1)
    eight_on_two = torch.randint(0, 8, (12, 2), generator=g).reshape(-1)
    # the last rank receives no row: a count list that stops at the last rank seen is short
    none_to_last = torch.randint(0, 2, (9, 2), generator=g).reshape(-1)
    none_to_last_of_4 = torch.tensor([5, 0, 2, 4, 1, 5, 3, 0, 4, 2])
    return [("top-2 routing, 4 experts on 2 ranks", top2, 4, 2),
            ("expert 1 gets no token", no_expert_1, 4, 2),
            ("rank 2 gets no token (8 experts on 4 ranks)", no_rank_2, 8, 4),
            ("every token goes to rank 1", all_to_rank_1, 4, 2),
            ("top-1 routing, 8 experts on 4 ranks", top1, 8, 4),
            ("8 experts on 2 ranks", eight_on_two, 8, 2),
            ("the last rank gets no token (4 experts on 2 ranks)", none_to_last, 4, 2),
            ("the last rank gets no token (8 experts on 4 ranks)", none_to_last_of_4, 8, 4)]


def _as_counts(counts):
    """The learner's send_counts as a list of ints (a list, a tuple or a tensor), else None."""
    import torch

    if torch.is_tensor(counts):
        counts = counts.tolist()
    try:
        return [int(c) for c in counts]
    except (TypeError, ValueError):
        return None


def _short(t, limit: int = 12) -> str:
    """A tensor's values as a list, cut after ``limit`` of them."""
    values = t.tolist()
    return str(values) if len(values) <= limit else f"{str(values[:limit])[:-1]}, ...]"


def _nondecreasing(t) -> bool:
    return bool((t[1:] >= t[:-1]).all()) if len(t) > 1 else True


def _dispatch_mistake(what, flat, n_experts, world, got) -> NotYet | None:
    """The first thing wrong with the learner's ``(order, send_counts)`` for one case, named."""
    import torch

    from ...parallel.expert import dispatch_order

    where = f"{what} (expert_index={_short(flat)}, n_experts={n_experts}, world_size={world})"
    if not (isinstance(got, tuple | list) and len(got) == 2):
        return NotYet(f"{where}: returned {str(got)[:80]}",
                      "return a pair: (order, send_counts)")
    order, counts = got
    n = len(flat)
    if not (torch.is_tensor(order) and order.dim() == 1 and len(order) == n
            and not order.is_floating_point() and order.dtype != torch.bool):
        return NotYet(f"{where}: order is {str(order)[:80]}",
                      f"order must be a 1-D integer tensor (a LongTensor) of the {n} row "
                      f"indices, e.g. what torch.argsort returns")
    if not torch.equal(order.sort().values.long(), torch.arange(n)):
        return NotYet(f"{where}: order {_short(order)} is not a permutation of 0..{n - 1}",
                      "order must list every row index exactly once: it only rearranges rows")
    want_order, want_counts = dispatch_order(flat, n_experts, world)
    counts = _as_counts(counts)
    per_rank = n_experts // world
    if counts is None:
        return NotYet(f"{where}: send_counts is not a list of numbers",
                      f"send_counts must be a list of {world} ints, one per destination rank")
    if len(counts) < world and counts == want_counts[:len(counts)] and not any(
            want_counts[len(counts):]):
        return NotYet(f"{where}: send_counts {counts} has {len(counts)} entries for {world} "
                      f"ranks (expected {want_counts})",
                      f"the last rank receives no rows here, and the counts stop at the last "
                      f"rank that does: all_to_all_single needs a count for every rank, zeros "
                      f"included, e.g. torch.bincount(expert // {per_rank}, "
                      f"minlength=world_size)")
    if len(counts) != world:
        per_expert = torch.bincount(flat, minlength=n_experts).tolist()
        if len(counts) == n_experts and counts == per_expert:
            return NotYet(f"{where}: send_counts {counts} has one count per expert",
                          f"counts per expert instead of per rank: all_to_all_single wants one "
                          f"split size per rank; add up each rank's {per_rank} experts (or "
                          f"bincount the destination ranks, expert // {per_rank})")
        return NotYet(f"{where}: send_counts has {len(counts)} entries",
                      f"send_counts needs one entry per rank: {world} of them")
    if sum(counts) != n:
        return NotYet(f"{where}: send_counts {counts} adds up to {sum(counts)}, not {n}",
                      f"the counts must sum to the number of rows ({n}: one per (token, slot) "
                      f"pair): every row goes to exactly one rank")
    modulo = torch.bincount(flat % world, minlength=world).tolist()
    dest = flat[order] // per_rank
    if (counts == modulo and counts != want_counts) or (
            not _nondecreasing(dest) and _nondecreasing(flat[order] % world)):
        return NotYet(f"{where}: send_counts {counts} (expected {want_counts})",
                      f"off-by-one rank mapping: rank r holds the consecutive experts "
                      f"r*{per_rank} .. r*{per_rank}+{per_rank - 1}, so an expert's rank is "
                      f"expert // (n_experts // world_size), not expert % world_size")
    if counts != want_counts:
        return NotYet(f"{where}: send_counts {counts}, expected {want_counts}",
                      f"send_counts[r] is the number of rows whose expert lives on rank r, "
                      f"i.e. with expert // {per_rank} == r")
    if not _nondecreasing(dest):
        if torch.equal(order.long(), torch.arange(n)):
            return NotYet(f"{where}: order {_short(order)} is the token order",
                          "order by token, not by destination: you forgot to sort; the "
                          "exchange sends the first send_counts[0] rows to rank 0, the next to "
                          "rank 1, ..., so the rows must be sorted by destination rank")
        return NotYet(f"{where}: the rows in your order go to ranks {_short(dest)}",
                      "group the rows by destination rank (expert // (n_experts // "
                      "world_size)): rank 0's rows first, then rank 1's, ...")
    if not _nondecreasing(flat[order]):
        return NotYet(f"{where}: the rows go to experts {_short(flat[order])}",
                      "grouped by rank but not by expert within a rank: the receiver runs each "
                      "of its experts on consecutive rows, so sort by expert (ranks hold "
                      "consecutive experts, so sorting by expert also groups by rank)")
    if not torch.equal(order.long(), want_order):
        return NotYet(f"{where}: order {_short(order)}, expected {_short(want_order)}",
                      "unstable sort: within one expert keep the rows in token order "
                      "(torch.argsort(expert_index, stable=True)); with a capacity limit the "
                      "earliest tokens are kept, so another order drops other tokens than "
                      "the single-process layer")
    return None


def _dispatch_on_ranks(fn) -> dict:
    """Grading worker: ``moe_check`` with the learner's dispatch, capacity on, one empty expert."""
    import torch.distributed as dist

    from ...parallel.expert import moe_check

    n_experts = 2 * dist.get_world_size()
    bias = [0.0] * n_experts
    bias[1] = -1e4  # expert 1 gets no token
    last = [0.0] * (n_experts - 2) + [-1e4, -1e4]  # the last rank's two experts get none
    runs = [moe_check(24, 8, 16, n_experts, 2, capacity_factor=1.0, seed=1, dispatch=fn),
            moe_check(24, 8, 16, n_experts, 1, seed=2, router_bias=bias, dispatch=fn),
            moe_check(12, 8, 16, n_experts, 2, seed=3, router_bias=last, dispatch=fn)]
    return {"output": max(r["output"] for r in runs),
            "grads": max(max(r["grads"].values()) for r in runs),
            "dropped": runs[0]["reference"]["dropped"],
            # the route: the bytes all_to_all_single sent, against those the routing implies
            "bytes": [(r["bytes"]["measured"], r["bytes"]["from_routing"]) for r in runs]}


@exercise("expert_dispatch", notebook=NOTEBOOK,
          title="the permutation that sends each token to its expert's rank")
def expert_dispatch(fn) -> str:
    """Exercise: ``fn(expert_index, n_experts, world_size) -> (order, send_counts)``.

    ``expert_index`` (1-D, the expert of each (token, slot) row); ``order`` groups the rows by
    destination rank (``expert // (n_experts // world_size)``), by expert within a rank, in
    token order within an expert (a stable sort); ``send_counts`` one int per rank. Compared
    with ``labkit.parallel.expert.dispatch_order`` on several cases, then run on 2 and 4 gloo
    ranks, where it drives the real ``all_to_all_single`` of the expert-parallel layer.

    Example::

        >>> exercise.expert_dispatch(my_dispatch)
        [pass] the permutation that sends each token to its expert's rank: ...
    """
    cases = _cases()
    for what, flat, n_experts, world in cases:
        mistake = _dispatch_mistake(what, flat, n_experts, world,
                                    fn(flat.clone(), n_experts, world))
        if mistake is not None:
            raise mistake
    dropped = []
    for nproc in (2, 4):
        ranks = on_ranks(_dispatch_on_ranks, fn, nproc=nproc, timeout=120)
        out, grads = max(r["output"] for r in ranks), max(r["grads"] for r in ranks)
        if out > _TOL or grads > _TOL:
            raise NotYet(f"on {nproc} ranks the expert-parallel layer with your dispatch is off "
                         f"the single-process MoE by {out:.1e} (output), {grads:.1e} (gradients)",
                         "your function passed the cases here but not on the ranks: does it "
                         "depend on something besides its arguments, or change expert_index "
                         "in place?")
        for rank, got in enumerate(ranks):
            for measured, routed in got["bytes"]:
                if measured != routed:
                    raise NotYet(f"on {nproc} ranks, rank {rank} sent {measured} bytes; the "
                                 f"routing asks for {routed}",
                                 "right values by another route: only the rows bound for other "
                                 "ranks cross the wire, once in each direction")
        dropped.append(ranks[0]["dropped"])
    return (f"order and send_counts right for {len(cases)} cases (an empty expert, an empty "
            f"rank, the last rank empty, every token to one rank, top-1); on 2 and 4 gloo ranks "
            f"they drove the real all_to_all_single (also with the last rank receiving no row) "
            f"and the layer equals the single-process MoE (outputs and gradients within "
            f"{_TOL:g}, the same {dropped[0]} and {dropped[1]} rows over capacity dropped, the "
            f"bytes sent those the routing implies)")


# ==== challenge: the all-to-all as an autograd Function =======================================
# Graded on 2 and 4 ranks by the rows that arrive, the gradients that go home, and the route:
# forward one all-to-all of the counts and one of the rows, backward one of the gradient rows.

__all__ += ["all_to_all_function"]  # noqa: PLE0605

_A2A_HIDDEN = 3
_A2A_ROUTE = ("forward: one all-to-all of the counts (dist.all_to_all_single of an int64 tensor "
              "of world entries: entry r, the rows for rank r), then one of the rows, "
              "dist.all_to_all_single(out, x, output_split_sizes=recv_counts, "
              "input_split_sizes=send_counts); backward: one all-to-all of the gradient rows, "
              "with the two split sizes swapped (saved in ctx), and nothing else")


def _a2a_counts(world: int, case: str) -> list[list[int]]:
    """``counts[s][d]``: rows rank s sends to rank d."""
    if case == "uneven":
        return [[(s + 2 * d) % 3 for d in range(world)] for s in range(world)]
    # rank 0 has no rows at all, and the last rank receives none
    return [[0 if s == 0 or d == world - 1 else s + d for d in range(world)]
            for s in range(world)]


_A2A_CASES = (("uneven", "float32"), ("rank 0 sends nothing, the last rank gets nothing",
                                      "float64"))


def _a2a_rows(rank: int, n: int, dtype):
    """Rank ``rank``'s ``n`` rows, each one tagged: rank * 100 + row, + 0, 0.25, 0.5 by column."""
    import torch

    base = rank * 100 + torch.arange(n, dtype=torch.float64)[:, None]
    return (base + torch.tensor([0.0, 0.25, 0.5])).to(dtype)


def _all_to_all_worker(fn) -> list[dict]:
    """Each rank, each case: ``fn.apply(x, send_counts)``, a backward, and what each sent."""
    import torch
    import torch.distributed as dist

    from ...parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for case, dtype in _A2A_CASES:
        counts = _a2a_counts(world, case)
        dt = getattr(torch, dtype)
        x = _a2a_rows(rank, sum(counts[rank]), dt).requires_grad_()
        with traffic.count_traffic() as fwd:
            y = fn.apply(x, list(counts[rank]))
        want = torch.cat([_a2a_rows(s, sum(counts[s]), dt)[sum(counts[s][:rank]):
                                                           sum(counts[s][:rank + 1])]
                          for s in range(world)])
        result = {"case": case, "dtype": dtype, "counts": counts,
                  "forward": [(c.op, c.payload_bytes, c.sent_bytes) for c in fwd.calls],
                  "y": y.detach().clone() if isinstance(y, torch.Tensor) else None,
                  "y_type": type(y).__name__, "want": want, "x": x.detach().clone()}
        if isinstance(y, torch.Tensor) and y.requires_grad:
            coef = 0.5 * y.detach() + 1  # d loss / d row = 0.5 * row + 1: each row's own tag
            with traffic.count_traffic() as bwd:
                (y * coef).sum().backward()
            result["backward"] = [(c.op, c.payload_bytes, c.sent_bytes) for c in bwd.calls]
            result["grad"] = None if x.grad is None else x.grad.clone()
        out.append(result)
    return out


def _a2a_where(rows) -> str:
    """Which rank and row each of ``rows`` came from (by its tag), for the first few."""
    said = []
    for row in rows[:4]:
        tag = int(round(float(row[0])))
        said.append(f"rank {tag // 100} row {tag % 100}")
    return ", ".join(said) + (", ..." if len(rows) > 4 else "")


def _a2a_forward(world: int, rank: int, got: dict) -> None:
    import torch

    where = f"on {world} ranks (rank {rank}), {got['dtype']}, {got['case']}"
    y, want, counts = got["y"], got["want"], got["counts"]
    if y is None:
        raise NotYet(f"{where}: forward returned {got['y_type']}, not a tensor",
                     "forward returns the rows that arrived: one tensor of (sum of the "
                     "received counts, hidden)")
    if y.dtype != want.dtype:
        raise NotYet(f"{where}: forward returned {y.dtype} rows for {want.dtype} input",
                     "allocate the output with x.new_empty(...) so that it keeps x's dtype")
    received = [counts[s][rank] for s in range(world)]
    if tuple(y.shape) != tuple(want.shape):
        hint = ("receive sum(recv_counts) rows, where recv_counts[s] is what rank s sends to "
                "you: learn it from the counts all-to-all (it is not your own send_counts)")
        raise NotYet(f"{where}: forward returned shape {tuple(y.shape)}, want {tuple(want.shape)}"
                     f" (rows from each rank: {received})", hint)
    if not torch.equal(y, want):
        raise NotYet(f"{where}: the rows arrived as {_a2a_where(y)}; want "
                     f"{_a2a_where(want)}", "send_counts[r] consecutive rows of x go to "
                     "rank r, in order; the rows that arrive are grouped by source rank, rank 0's "
                     "first (output_split_sizes=recv_counts)")


def _a2a_route(world: int, rank: int, got: dict) -> None:
    """Raise NotYet unless forward made two all-to-alls (counts, rows) and backward one (rows),
    each sending the other ranks exactly their rows."""
    where = f"on {world} ranks (rank {rank}), {got['dtype']}, {got['case']}"
    counts, row_bytes = got["counts"], _A2A_HIDDEN * got["x"].element_size()
    for phase, calls, want, rows_out in (
            ("forward", got["forward"], 2, sum(counts[rank]) - counts[rank][rank]),
            ("backward", got["backward"], 1, sum(c[rank] for c in counts) - counts[rank][rank])):
        others = sorted({op for op, _, _ in calls if op != "all_to_all"})
        if others:
            raise NotYet(f"{where}: the {phase} called {', '.join(others)}",
                         "an all-to-all sends each rank only the rows meant for it"
                         + (" (gathering sends every row to every rank)"
                            if "all_gather" in others else "") + "; " + _A2A_ROUTE)
        if len(calls) != want:
            hint = _A2A_ROUTE
            if phase == "backward" and len(calls) > want:
                hint = ("backward already knows both split sizes: save them in ctx in forward, "
                        "do not exchange the counts again; " + _A2A_ROUTE)
            raise NotYet(f"{where}: the {phase} made {len(calls)} all-to-alls (payloads "
                         f"{[b for _, b, _ in calls]} bytes); want {want}", hint)
        sent = calls[-1][2]  # the rows go last: the receiver needs the counts first
        if sent != rows_out * row_bytes:
            raise NotYet(f"{where}: the {phase}'s all-to-all of rows sent {sent} bytes to the "
                         f"other ranks; the rows meant for them are {rows_out * row_bytes} bytes",
                         _A2A_ROUTE)


def _a2a_backward(world: int, rank: int, got: dict) -> None:
    import torch

    where = f"on {world} ranks (rank {rank}), {got['dtype']}, {got['case']}"
    grad, x = got.get("grad"), got["x"]
    if "backward" not in got:
        raise NotYet(f"{where}: the output does not require grad: no backward to run",
                     "call it as MyAllToAll.apply(x, send_counts), and return a tensor computed "
                     "in forward (autograd connects it)")
    if grad is None:
        raise NotYet(f"{where}: x.grad is None after backward",
                     "backward returns (gradient of x, None): one value per input of forward")
    want = 0.5 * x + 1  # every row went somewhere; its gradient is its own tag, sent home
    if tuple(grad.shape) != tuple(x.shape) or not torch.allclose(grad, want):
        came = ((grad - 1) / 0.5) if grad.shape == x.shape else None
        hint = ("backward sends each gradient row home: the reverse exchange, an all-to-all "
                "with input_split_sizes=recv_counts and output_split_sizes=send_counts")
        detail = f"{where}: x.grad is not the gradient of the rows x sent"
        if came is not None and len(came):
            detail += f" (its rows are those of {_a2a_where(came)})"
        raise NotYet(detail, hint)


@exercise("all_to_all_function", notebook=NOTEBOOK,
          title="challenge: the all-to-all of expert parallelism, as an autograd Function")
def all_to_all_function(fn, worlds=(2, 4)) -> str:
    """Challenge: ``fn.apply(x, send_counts)`` exchanges rows; its backward sends gradients home.

    ``fn`` is a ``torch.autograd.Function``. Run on real gloo ranks (``worlds``) with tagged
    rows: uneven counts in float32; then float64 with rank 0 holding no rows and the last rank
    receiving none. The rows that arrive, grouped by source rank, and ``x.grad`` after a
    backward are compared exactly with their tags; the route too: forward two
    all-to-alls (the counts, then the rows), backward one, each sending only the other ranks'
    rows.

    Example::

        >>> exercise.all_to_all_function(MyAllToAll)
        [pass] challenge: the all-to-all of expert parallelism, as an autograd Function: ...
    """
    import torch

    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise NotYet(f"got {type(fn).__name__}, not a torch.autograd.Function class",
                     "define `class MyAllToAll(torch.autograd.Function)` with static methods "
                     "forward(ctx, x, send_counts) and backward(ctx, grad), and pass the class")
    for world in worlds:
        ranks = on_ranks(_all_to_all_worker, fn, nproc=world, timeout=60.0)
        for rank, per_case in enumerate(ranks):
            for got in per_case:
                _a2a_forward(world, rank, got)
                _a2a_backward(world, rank, got)
                _a2a_route(world, rank, got)
    return (f"on {' and '.join(map(str, worlds))} ranks, float32 and float64, uneven counts, a "
            f"rank with no rows and one receiving none: the rows arrive grouped by source rank, "
            f"x.grad is each row's gradient sent home; forward one all-to-all of counts and one "
            f"of rows, backward one, each sending only the other ranks' rows")

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
    return [("top-2 routing, 4 experts on 2 ranks", top2, 4, 2),
            ("expert 1 gets no token", no_expert_1, 4, 2),
            ("rank 2 gets no token (8 experts on 4 ranks)", no_rank_2, 8, 4),
            ("every token goes to rank 1", all_to_rank_1, 4, 2),
            ("top-1 routing, 8 experts on 4 ranks", top1, 8, 4),
            ("8 experts on 2 ranks", eight_on_two, 8, 2)]


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
    runs = [moe_check(24, 8, 16, n_experts, 2, capacity_factor=1.0, seed=1, dispatch=fn),
            moe_check(24, 8, 16, n_experts, 1, seed=2, router_bias=bias, dispatch=fn)]
    return {"output": max(r["output"] for r in runs),
            "grads": max(max(r["grads"].values()) for r in runs),
            "dropped": runs[0]["reference"]["dropped"]}


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
        dropped.append(ranks[0]["dropped"])
    return (f"order and send_counts right for {len(cases)} cases (an empty expert, an empty "
            f"rank, every token to one rank, top-1); on 2 and 4 gloo ranks they drove the real "
            f"all_to_all_single and the layer equals the single-process MoE (outputs and "
            f"gradients within {_TOL:g}, the same {dropped[0]} and {dropped[1]} rows over "
            f"capacity dropped)")

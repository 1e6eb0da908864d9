"""Notebook 09's ring-attention exercise: the online-softmax merge of two partial results.

The learner writes ``my_merge(out_a, lse_a, out_b, lse_b) -> (out, lse)``. The grader runs it
first in this process against the softmax over all the keys (keys split two ways and four
ways, logits large enough to overflow a naive ``exp``, a side with no keys at all), then plugs
it into :func:`labkit.parallel.context.ring_attention` on two real gloo ranks, where every
query row starts from the empty side (lse = -inf) and the causal ring merges block after block.
"""

from __future__ import annotations

from ...check import NotYet, exercise, on_ranks

NOTEBOOK = "09"

__all__ = ["online_softmax_merge"]

_SHAPE = (2, 3, 5, 8)  # batch, heads, seq, head_dim: no two trailing sizes alike, so a
#                        weight without its trailing dim fails to broadcast instead of hiding
_TOL = 1e-5


def _parts(cuts, scale=1.0, seed=0, masked=None):
    """Query block, keys split at ``cuts``: the parts' (out, lse) and the whole's (out, lse)."""
    import torch

    from ...parallel.context import block_attention

    b, h, s, d = _SHAPE
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=gen) * scale
    k, v = torch.randn(b, h, 12, d, generator=gen), torch.randn(b, h, 12, d, generator=gen)
    mask = torch.ones(s, 12, dtype=torch.bool)
    if masked is not None:  # {query row: keys it may not see}
        for row, keys in masked.items():
            mask[row, keys] = False
    bounds = [0, *cuts, 12]
    parts = [block_attention(q, k[..., a:c, :], v[..., a:c, :], mask[:, a:c])
             for a, c in zip(bounds, bounds[1:], strict=False)]
    return parts, block_attention(q, k, v, mask)


def _call(fn, out_a, lse_a, out_b, lse_b, what):
    """The learner's merge on copies; a NotYet for results that are not (out, lse) tensors."""
    import torch

    try:
        got = fn(out_a.clone(), lse_a.clone(), out_b.clone(), lse_b.clone())
    except RuntimeError as err:
        if "must match the size" not in str(err):
            raise
        raise NotYet(f"{what}: my_merge raised RuntimeError: {str(err).splitlines()[0]}",
                     "shapes that do not broadcast: lse is (batch, heads, seq), out is (batch, "
                     "heads, seq, head_dim), so a weight computed from lse needs a trailing dim "
                     "to scale out's rows: w.unsqueeze(-1) * out_a") from None
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise NotYet(f"{what}: my_merge returned {str(got)[:100]}",
                     "return a pair of tensors: (out, lse)")
    out, lse = got
    if out.shape != out_a.shape or lse.shape != lse_a.shape:
        raise NotYet(f"{what}: my_merge returned out {tuple(out.shape)} and lse "
                     f"{tuple(lse.shape)}; expected out {tuple(out_a.shape)}, lse "
                     f"{tuple(lse_a.shape)}",
                     "shapes: out keeps out_a's shape (batch, heads, seq, head_dim) and lse "
                     "keeps lse_a's (batch, heads, seq), one number per query row; only the "
                     "weights that scale out need a trailing dim (unsqueeze(-1))")
    return out, lse


def _coefficients(out, out_a, out_b):
    """Per row, the (alpha, beta) that best give ``out = alpha out_a + beta out_b``, and the fit."""
    import torch

    basis = torch.stack([out_a, out_b], dim=-1)  # (..., d, 2)
    fit = torch.linalg.lstsq(basis, out.unsqueeze(-1)).solution.squeeze(-1)  # (..., 2)
    residual = (basis @ fit.unsqueeze(-1)).squeeze(-1) - out
    return fit[..., 0], fit[..., 1], residual.abs().max().item()


def _wrong_out_hint(out, a, b):
    """Why ``out`` is not the merged output: the usual mistakes, named, from its coefficients."""
    import torch

    (out_a, _), (out_b, _) = a, b
    if torch.allclose(out, (out_a + out_b) / 2, atol=_TOL):
        return ("that is the average of the two outputs: each part is a softmax over its own "
                "keys, so weight it by its share of the whole sum, exp(lse_a - lse) and "
                "exp(lse_b - lse) with lse the combined log-sum-exp")
    alpha, beta, residual = _coefficients(out, out_a, out_b)
    if residual < 1e-4 and (alpha + beta - 1).abs().max() > 1e-3:
        return ("out is a combination of out_a and out_b whose weights do not sum to 1: "
                "renormalise, dividing by the sum of the two weights (exp(lse_a - lse) + "
                "exp(lse_b - lse) = 1 when lse is the combined log-sum-exp)")
    return ("out should be exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b (each weight "
            "unsqueezed to (..., 1)), with lse the combined log-sum-exp")


def _grade_local(fn, parts, whole, what, big=False, empty=False):
    """Merge ``parts`` left to right with ``fn``; unless that gives ``whole``, a NotYet."""
    import torch

    out, lse = parts[0]
    for part in parts[1:]:
        previous = (out, lse)
        out, lse = _call(fn, out, lse, *part, what)
        if not torch.isfinite(out).all() or (lse.isnan() | (lse == float("inf"))).any():
            if big:
                raise NotYet(f"{what}: inf or NaN in the result (lse up to "
                             f"{float(whole[1].max()):.0f})",
                             "exp(lse) overflows float32 beyond lse = 88 (exp(88) = 1.6e38): "
                             "subtract the larger of lse_a and lse_b before exponentiating, "
                             "so the largest weight is exp(0) = 1")
            if empty:
                raise NotYet(f"{what}: NaN in the result",
                             "a side with no keys has lse = -inf (and out = 0): its weight must "
                             "come out 0, not NaN. -inf - (-inf) is NaN: where both sides are "
                             "-inf, shift by 0 instead of the max (torch.where / masked_fill), "
                             "and leave that row's lse at -inf and its out at 0")
            raise NotYet(f"{what}: inf or NaN in the result", _wrong_out_hint(out, previous,
                                                                               part))
    want_out, want_lse = whole
    if not torch.allclose(out, want_out, atol=_TOL):
        raise NotYet(f"{what}: out differs from the softmax over all the keys by "
                     f"{(out - want_out).abs().max().item():.2g}",
                     _wrong_out_hint(out, parts[0], parts[1]) if len(parts) == 2 else
                     "two parts merged right but several did not: the merged lse is the input "
                     "of the next merge, so it must be the log-sum-exp over both parts' keys")
    if not torch.allclose(lse, want_lse, atol=_TOL, rtol=_TOL):
        (_, lse_a), (_, lse_b) = parts[0], parts[1]
        if len(parts) == 2 and torch.allclose(lse, torch.maximum(lse_a, lse_b)):
            hint = ("lse combined with max instead of log-sum-exp: the combined lse is "
                    "log(exp(lse_a) + exp(lse_b)) = m + log(exp(lse_a - m) + exp(lse_b - m)), "
                    "m the max; the next merge (and the backward) weight by it")
        else:
            hint = ("lse should be log(exp(lse_a) + exp(lse_b)), computed as m + "
                    "log(exp(lse_a - m) + exp(lse_b - m)) with m the larger of the two")
        raise NotYet(f"{what}: out right, but lse differs from the log-sum-exp over all the keys "
                     f"by {(lse - want_lse).abs().max().item():.2g}", hint)


def _ring_probe(merge_fn, seq: int = 16, seed: int = 0) -> dict:
    """Grading worker: ring attention with the learner's merge, causal, both orders.

    Returns, per order, the largest differences from full attention of the output and of the
    gradients (the backward reuses the merged lse, so a wrong lse shows there too).
    """
    import torch
    import torch.distributed as dist

    from ...parallel import context, transformer

    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, 2, seq, 8, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = transformer.attention(*leaves, causal=True)
    ref.backward(dout)
    diffs = {}
    for order in context.ORDERS:
        mine = lambda t, order=order: context.shard_sequence(t, rank, n, order)  # noqa: E731
        local = [mine(t).requires_grad_() for t in (q, k, v)]
        out = context.ring_attention(*local, causal=True, order=order, merge=merge_fn)
        out.backward(mine(dout))
        grads = max((a.grad - mine(b.grad)).abs().max().item()
                    for a, b in zip(local, leaves, strict=True))
        diffs[order] = {"out": (out.detach() - mine(ref.detach())).abs().max().item(),
                        "grads": grads}
    return diffs


@exercise("online_softmax_merge", notebook=NOTEBOOK,
          title="the online-softmax merge of two partial attention results")
def online_softmax_merge(merge_fn) -> str:
    """Exercise: ``merge_fn(out_a, lse_a, out_b, lse_b) -> (out, lse)``, the online-softmax rule.

    Graded against the softmax over all the keys in this process (keys split two ways and four
    ways, logits past exp's float32 range, sides with no keys), then inside
    ``labkit.parallel.context.ring_attention(..., causal=True, merge=merge_fn)`` on 2 and 4 gloo
    ranks.

    Example::

        >>> exercise.online_softmax_merge(my_merge)
        [pass] the online-softmax merge of two partial attention results: ...
    """
    import torch

    empty_row = {2: list(range(12))}  # query row 2 sees no key at all
    cases = [  # (what, cuts, scale, masked, big, empty)
        ("keys split 5 + 7", [5], 1.0, None, False, False),
        ("keys split in 4 parts", [2, 5, 9], 1.0, None, False, False),
        ("keys split 6 + 6, large logits", [6], 60.0, None, True, False),
        ("a side with no keys visible", [4], 1.0, {r: list(range(4)) for r in range(5)}, False,
         True),
        ("a query row that sees no key on either side", [7], 1.0, empty_row, False, True),
    ]
    for what, cuts, scale, masked, big, empty in cases:
        parts, whole = _parts(cuts, scale, seed=len(what), masked=masked)
        _grade_local(merge_fn, parts, whole, what, big=big, empty=empty)
    # The empty side on the left as well: the ring starts every row from (0, -inf).
    (out_0, lse_0), _ = _parts([6], seed=1)[0]
    start = (torch.zeros_like(out_0), torch.full_like(lse_0, float("-inf")))
    _grade_local(merge_fn, [start, (out_0, lse_0)], (out_0, lse_0),
                 "merging into an empty start (lse = -inf)", empty=True)
    for world in (2, 4):  # on 4 ranks the causal ring has blocks with no visible key
        ranks = on_ranks(_ring_probe, merge_fn, nproc=world)
        for rank, diffs in enumerate(ranks):
            for order, d in diffs.items():
                if d["out"] > _TOL or d["grads"] > _TOL:
                    raise NotYet(f"on {world} ranks, rank {rank}, order {order!r}: ring "
                                 f"attention with my_merge is off full attention by "
                                 f"{d['out']:.2g} (output), {d['grads']:.2g} (gradients)",
                                 "the local cases passed: check that my_merge does not change "
                                 "its inputs in place, and uses only its four arguments")
    return (f"{len(cases) + 1} local cases right (keys split 2 and 4 ways, logits past exp's "
            f"float32 range, sides with no keys); inside ring_attention on 2 and 4 gloo ranks "
            f"(causal, contiguous and zigzag) the output and gradients equal full attention's")

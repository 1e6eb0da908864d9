"""Context parallelism: ring attention, written to be read.

Attention over ``s`` tokens scores every query against every key: an ``s x s`` matrix per head,
so its compute grows with ``s^2``, and so does its memory when the probabilities are kept for
backward. Tensor and sequence parallelism split the heads and the activations ``t`` ways, no
further; context parallelism (CP) splits the *sequence* over ``n`` ranks:

- each rank holds ``s / n`` tokens: their queries, keys and values (after the projections, which
  are per token and need nothing from the other ranks);
- the key/value chunks travel around a ring: in ``n`` steps every rank sees every chunk, computes
  the attention of its queries on it, and merges the partial results with the
  **online-softmax rule** (:func:`merge`), the trick FlashAttention uses inside one GPU;
- the next chunk is already on its way while the current one is computed, so with enough work
  per block the communication costs nothing;
- causal attention skips blocks entirely in the future, which leaves the first ranks idle: the
  **zigzag** order (rank ``r`` holds chunks ``r`` and ``2n-1-r`` of ``2n``) evens the work.

The backward is a ring too (:func:`ring_backward`): the keys and values travel again, with the
gradients ``dk``, ``dv`` accumulated along the way, and each block's probabilities are recomputed
from ``q``, ``k`` and the saved log-sum-exp instead of being stored: a rank keeps ``O(s / n)``
bytes for backward, not ``O(s^2)``.

Every tensor is ``(batch, heads, seq, head_dim)``; scores are scaled by ``1 / sqrt(head_dim)``.
:func:`ring_check` and :func:`memory_sweep` are the worker functions the notebook launches.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from labkit._dist import collective_device
from labkit._sizes import multiples_near, whole
from labkit.parallel import transformer

__all__ = ["ORDERS", "block_attention", "merge", "shard_sequence",
           "unshard_sequence", "sequence_chunks", "ring_schedule", "start_exchange",
           "finish_exchange", "ring_forward", "ring_backward", "ring_attention",
           "ring_bytes_formula", "full_saved_bytes", "ring_saved_bytes", "ring_check",
           "memory_sweep"]

ORDERS = ("contiguous", "zigzag")
_NEG_INF = float("-inf")


# ---- attention on one block, and the merge ---------------------------------------------------


def block_attention(q, k, v, mask=None):
    """Attention of a query chunk on one key/value chunk: ``(out, lse)``.

    ``q`` is ``(..., sq, d)``, ``k`` and ``v`` ``(..., sk, d)``; ``mask`` (``(sq, sk)`` bools,
    True where a query may see a key) is optional. ``out`` is ``(..., sq, d)``: the softmax over
    *these* keys only, times ``v``. ``lse`` is ``(..., sq)``: the log-sum-exp of each query's
    scores, ``log sum_j exp(q k_j / sqrt(d))``, the statistic :func:`merge` needs to combine two
    partial results. A row whose keys are all masked has no softmax: it gets ``lse = -inf`` and
    ``out = 0``, which :func:`merge` treats as "no keys seen yet".

    Example::

        >>> out, lse = block_attention(q, k, v)      # q (1, 2, 4, 8), k, v (1, 2, 6, 8)
        >>> out.shape, lse.shape
        (torch.Size([1, 2, 4, 8]), torch.Size([1, 2, 4]))
    """
    # (..., sq, sk): one query chunk against one key chunk, never the whole s x s matrix.
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # stable (max subtracted inside); -inf if all masked
    # Shift by lse, not by -inf, on the empty rows: exp(-inf - 0) = 0 there instead of NaN.
    shift = lse.masked_fill(lse == _NEG_INF, 0.0)
    probs = torch.exp(scores - shift.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def merge(out_a, lse_a, out_b, lse_b):
    """The online-softmax rule: two partial attention results over disjoint keys, as one.

    Each part is a softmax over its own keys, weighted by ``exp(lse)``, the sum of its
    exponentials. The combined sum is ``exp(lse_a) + exp(lse_b)``, so::

        lse = log(exp(lse_a) + exp(lse_b))
        out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b      (weights sum to 1)

    computed with the max subtracted first (``exp(lse)`` overflows float32 beyond 88). A side
    with ``lse = -inf`` (no keys) gets weight 0; both sides empty give ``lse = -inf``, ``out = 0``,
    never NaN. Shapes as :func:`block_attention`'s: ``out (..., s, d)``, ``lse (..., s)``.

    Example::

        >>> out_a, lse_a = block_attention(q, k[..., :4, :], v[..., :4, :])
        >>> out_b, lse_b = block_attention(q, k[..., 4:, :], v[..., 4:, :])
        >>> out, lse = merge(out_a, lse_a, out_b, lse_b)   # = block_attention(q, k, v)
    """
    top = torch.maximum(lse_a, lse_b)
    top = top.masked_fill(top == _NEG_INF, 0.0)  # both empty: -inf - (-inf) would be NaN
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)  # at most 1: no overflow
    total = w_a + w_b
    lse = top + torch.log(total)  # log(0) = -inf where both are empty
    total = total.masked_fill(total == 0, 1.0)  # then 0 / 1: out stays 0
    # lse is (..., s); out is (..., s, d): the weights need a trailing dim to scale each row.
    out = (w_a / total).unsqueeze(-1) * out_a + (w_b / total).unsqueeze(-1) * out_b
    return out, lse


_default_merge = merge  # ring_attention's ``merge=`` argument shadows the name


# ---- who holds which tokens ------------------------------------------------------------------


def _check_order(order):
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(map(repr, ORDERS))}, got {order!r}")


def _check_length(seq: int, world: int, order: str) -> int:
    """The chunk length (``seq / world``, or ``seq / 2 world`` for zigzag), or a ValueError."""
    _check_order(order)
    pieces = world * (2 if order == "zigzag" else 1)
    if seq % pieces == 0 and seq > 0:
        return seq // pieces
    if order == "zigzag":
        raise ValueError(f"sequence length {seq} does not split into 2 x {world} = {pieces} "
                         f"zigzag chunks: use a multiple of {pieces} (e.g. "
                         f"{multiples_near(seq, pieces)}), or order='contiguous'")
    raise ValueError(f"sequence length {seq} does not split over {world} ranks: use a multiple "
                     f"of {world} (e.g. {multiples_near(seq, pieces)})")


def _check_rank(rank, world) -> tuple[int, int]:
    """``(rank, world)`` as ints (NumPy integers welcome, ``True`` refused), or a ValueError."""
    world = whole(world, "world")
    if isinstance(rank, bool) or not whole(rank, "rank", low=0) < world:
        raise ValueError(f"rank must be 0 ... {world - 1} for world={world}, got {rank!r}")
    return int(rank), world


def sequence_chunks(rank: int, world: int, order: str = "contiguous") -> list[int]:
    """Which chunks of the sequence ``rank`` holds: ``[rank]`` of ``world``, or zigzag's pair.

    Zigzag cuts the sequence into ``2 world`` chunks and gives rank ``r`` chunks ``r`` and
    ``2 world - 1 - r``: one early, one late, so that causal work evens out.

    Example::

        >>> sequence_chunks(1, 4), sequence_chunks(1, 4, "zigzag")
        ([1], [1, 6])
    """
    _check_order(order)
    rank, world = _check_rank(rank, world)
    return [rank] if order == "contiguous" else [rank, 2 * world - 1 - rank]


def shard_sequence(x, rank: int, world: int, order: str = "contiguous", dim: int = 2):
    """This rank's tokens of a full sequence ``x`` (along ``dim``), as a new tensor.

    A copy, not a view: a view would keep the whole sequence's storage alive on every rank.

    Example::

        >>> x = torch.arange(8).view(1, 1, 8, 1)
        >>> shard_sequence(x, 1, 2).flatten(), shard_sequence(x, 1, 2, "zigzag").flatten()
        (tensor([4, 5, 6, 7]), tensor([2, 3, 4, 5]))
    """
    rank, world = _check_rank(rank, world)
    size = _check_length(x.shape[dim], world, order)
    parts = [x.narrow(dim, c * size, size) for c in sequence_chunks(rank, world, order)]
    return torch.cat(parts, dim=dim)  # cat copies, even of one part


def unshard_sequence(shards, order: str = "contiguous", dim: int = 2):
    """The full sequence from every rank's shard (a list in rank order): undoes shard_sequence.

    Example::

        >>> parts = [shard_sequence(x, r, 4, "zigzag") for r in range(4)]
        >>> torch.equal(unshard_sequence(parts, "zigzag"), x)
        True
    """
    _check_order(order)
    world = len(shards)
    if world == 0:
        raise ValueError("unshard_sequence needs every rank's shard, in rank order: got none")
    if order == "contiguous":
        return torch.cat(list(shards), dim=dim)
    chunks = [None] * (2 * world)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * world - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)


def _local_chunks(rank, world, order, causal):
    """The rank's query (or key/value) pieces: ``[(chunk ids, local slice)]``.

    Causal: one piece per chunk, since each chunk of a zigzag pair has its own positions.
    Not causal: every key counts, so the rank's tokens are one block, whatever their order.
    """
    ids = sequence_chunks(rank, world, order)
    if not causal:
        return [(tuple(ids), slice(None))]
    return [((c,), slice(i, i + 1)) for i, c in enumerate(ids)]


def _block_kind(q_chunk: int, kv_chunk: int, causal: bool) -> str:
    """"full" (every key visible), "diagonal" (masked: the same chunk) or "skipped" (future)."""
    if not causal or kv_chunk < q_chunk:
        return "full"
    return "diagonal" if kv_chunk == q_chunk else "skipped"


def _step_blocks(rank, src, world, order, causal):
    """The blocks ``rank`` computes on ``src``'s keys and values: ``[(qi, ki, kind)]``."""
    qs, ks = _local_chunks(rank, world, order, causal), _local_chunks(src, world, order, causal)
    return [(qi, ki, "full" if not causal else _block_kind(q[0][0], k[0][0], causal))
            for qi, q in enumerate(qs) for ki, k in enumerate(ks)]


def ring_schedule(world: int, order: str = "contiguous", causal: bool = True) -> list[dict]:
    """Who holds which key/value chunk at each ring step, and which blocks each rank computes.

    One row per (step, rank): ``kv_from`` (the rank whose keys and values it holds at that step:
    ``rank - step`` mod ``world``), ``q_chunks`` and ``kv_chunks`` (chunk ids: of ``world``
    contiguous chunks, or of ``2 world`` zigzag ones) and ``blocks``, each
    ``{"q": chunk ids, "kv": chunk ids, "kind": "full" | "diagonal" | "skipped"}``. Plain data,
    no ranks needed: what :func:`ring_attention` does, step by step.

    Example::

        >>> [sum(b["kind"] != "skipped" for r in ring_schedule(4) if r["rank"] == 3
        ...      for b in r["blocks"])]
        [4]
    """
    _check_order(order)
    _, world = _check_rank(0, world)
    rows = []
    for step in range(world):
        for rank in range(world):
            src = (rank - step) % world
            qs = _local_chunks(rank, world, order, causal)
            ks = _local_chunks(src, world, order, causal)
            blocks = [{"q": qs[qi][0], "kv": ks[ki][0], "kind": kind}
                      for qi, ki, kind in _step_blocks(rank, src, world, order, causal)]
            rows.append({"step": step, "rank": rank, "kv_from": src,
                         "q_chunks": sequence_chunks(rank, world, order),
                         "kv_chunks": sequence_chunks(src, world, order), "blocks": blocks})
    return rows


# ---- the ring --------------------------------------------------------------------------------


def _ring_group(group):
    """``(ranks, my rank)`` in ``group``; ``(1, 0)`` without a process group (no ring)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _peer(group, group_rank):
    """The global rank of ``group_rank``: point-to-point ops address global ranks."""
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


def start_exchange(tensors, group=None, tag: int = 0):
    """Send ``tensors`` to the right neighbour, receive as many from the left; do not wait.

    Batched (``batch_isend_irecv``): posted together, so no rank blocks in a send while its
    neighbour is sending too (and NCCL wants the sends and receives of one step in one group).
    Returns the pending exchange, for :func:`finish_exchange`: between the two calls the
    tensors travel while this rank computes. ``tag`` tells two exchanges in flight apart (gloo
    matches messages by tag; NCCL by order).

    Example::

        >>> pending = start_exchange((k, v))     # inside a worker: to rank + 1, from rank - 1
        >>> ...                                  # compute on k, v meanwhile (read only)
        >>> k, v = finish_exchange(pending)      # rank - 1's k, v
    """
    n, rank = _ring_group(group)
    # The ring: every rank sends to rank + 1 and receives from rank - 1 (global ranks: p2p
    # ops address the world, not the group), so after t steps rank r holds rank r - t's chunk.
    right, left = _peer(group, (rank + 1) % n), _peer(group, (rank - 1) % n)
    # Receive buffers shaped like what is sent: every rank's chunk has the same shape.
    recv = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, right, group, tag + i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, r, left, group, tag + i) for i, r in enumerate(recv)]
    return dist.batch_isend_irecv(ops), recv, tensors  # the sent tensors must outlive the sends


def finish_exchange(pending):
    """Wait for an exchange started by :func:`start_exchange`; the received tensors."""
    works, recv, _sent = pending
    for work in works:
        work.wait()
    return recv


def _positions(chunks, size, device):
    """Global token positions of the chunks ``chunks`` (each ``size`` tokens)."""
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in chunks])


def _pieces(x, rank, world, order, causal):
    """``x`` (this rank's tokens) cut into the pieces of :func:`_local_chunks`."""
    pieces = _local_chunks(rank, world, order, causal)
    if len(pieces) == 1:
        return [x]
    return list(x.chunk(len(pieces), dim=-2))


def _mask(kind, q_chunk, kv_chunk, size, device):
    """The causal mask of a diagonal block (None for a full one)."""
    if kind == "full":
        return None
    q_pos, k_pos = _positions(q_chunk, size, device), _positions(kv_chunk, size, device)
    return k_pos[None, :] <= q_pos[:, None]


class _Timer:
    """Seconds spent computing blocks, when ``stats`` asks for them.

    On a GPU, wall-clock seconds with the compute stream synchronised; on the CPU, the main
    thread's CPU seconds (``time.thread_time``): ranks that share cores are descheduled in turn,
    and a wall clock would count the waits as work.
    """

    def __init__(self, stats, device):
        self.stats, self.device = stats, device
        self.clock = time.perf_counter if device.type == "cuda" else time.thread_time

    def __enter__(self):
        self._sync()
        self.start = self.clock()

    def __exit__(self, *exc):
        self._sync()
        self.seconds = self.clock() - self.start

    def _sync(self):
        # The compute stream only: a device-wide sync would also wait for the ring's transfers
        # and hide the very overlap being measured.
        if self.stats is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _count(stats, prefix, blocks, scores, seconds):
    """Add one step's work to ``stats`` (when given): blocks, scores, compute seconds."""
    if stats is not None:
        for key, value in (("blocks", blocks), ("scores", scores), ("compute_s", seconds)):
            stats[prefix + key] = stats.get(prefix + key, 0) + value


def ring_forward(q, k, v, causal=False, order="contiguous", combine=None, group=None,
                 stats=None):
    """The forward ring, without autograd: ``(out, lse)`` of this rank's queries on all keys.

    At step ``t`` the rank holds the keys and values of rank ``rank - t``: it posts their
    exchange to the right, computes its query pieces on them (skipping blocks in the future
    when ``causal``), merges each result into its running ``(out, lse)`` with ``combine``
    (default :func:`merge`), then waits for the next chunk. Arguments as :func:`ring_attention`.

    Example::

        >>> out, lse = ring_forward(q, k, v, causal=True)   # inside a worker
    """
    combine = _default_merge if combine is None else combine
    n, rank = _ring_group(group)
    # q, k, v: (batch, heads, s/n, head_dim), this rank's tokens (two chunks under zigzag).
    size = q.shape[-2] // len(sequence_chunks(rank, n, order))  # tokens per chunk
    q_pieces = _pieces(q, rank, n, order, causal)
    q_ids = [c for c, _ in _local_chunks(rank, n, order, causal)]
    # Each query piece starts with "no keys seen": out 0, lse -inf (the merge's empty side).
    acc = [(torch.zeros_like(p), torch.full(p.shape[:-1], _NEG_INF, dtype=p.dtype,
                                            device=p.device)) for p in q_pieces]
    kv = (k.contiguous(), v.contiguous())
    for step in range(n):
        src = (rank - step) % n
        # Post the next exchange BEFORE computing: the chunk for step + 1 travels while this
        # one is computed. The send reads kv, which the compute only reads too.
        pending = start_exchange(kv, group) if step < n - 1 else None
        k_pieces, v_pieces = (_pieces(t, src, n, order, causal) for t in kv)
        kv_ids = [c for c, _ in _local_chunks(src, n, order, causal)]
        blocks = scores = 0
        timer = _Timer(stats, q.device)
        with timer:
            for qi, ki, kind in _step_blocks(rank, src, n, order, causal):
                if kind == "skipped":  # entirely in the future: no work, the source of imbalance
                    continue
                mask = _mask(kind, q_ids[qi], kv_ids[ki], size, q.device)
                part = block_attention(q_pieces[qi], k_pieces[ki], v_pieces[ki], mask)
                acc[qi] = combine(*acc[qi], *part)
                blocks += 1
                scores += q_pieces[qi].shape[-2] * k_pieces[ki].shape[-2]
        _count(stats, "", blocks, scores, timer.seconds)
        if pending is not None:
            kv = tuple(finish_exchange(pending))
    # Every key has been seen once: out (batch, heads, s/n, head_dim) equals this rank's rows of
    # full attention; lse is kept for the backward ring.
    out = torch.cat([o for o, _ in acc], dim=-2)
    lse = torch.cat([lse for _, lse in acc], dim=-1)
    return out, lse


def _block_grads(q, k, v, dout, lse, delta, mask):
    """FlashAttention's backward of one block: ``(dq, dk, dv)`` contributions.

    The probabilities are recomputed from ``q``, ``k`` and the *final* lse (the whole row's
    normaliser), so ``p`` is exactly the full softmax restricted to this block.
    """
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, _NEG_INF)
    # A row that saw no key at all (lse = -inf) has no gradient: shift it by +inf, p = 0.
    probs = torch.exp(scores - lse.masked_fill(lse == _NEG_INF, math.inf).unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v.transpose(-2, -1))
    ds = probs * (dp - delta.unsqueeze(-1))  # softmax backward: p (dp - sum_j p_j dp_j)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def ring_backward(dout, q, k, v, out, lse, causal=False, order="contiguous", group=None,
                  stats=None):
    """The backward ring: ``(dq, dk, dv)`` of this rank's chunk, from the forward's out and lse.

    k and v travel around the ring again; with them travel the accumulators of their gradients
    dk and dv: each rank adds its queries' contribution to the chunk it holds and passes the sum
    on, so after ``n`` hops (one more than k and v make) each chunk's gradient is home,
    complete. dq stays put. Each block's probabilities are recomputed from q, k and the final
    lse, as FlashAttention's backward does, so nothing ``s x s`` was kept.

    Example::

        >>> dq, dk, dv = ring_backward(dout, q, k, v, out, lse, causal=True)   # inside a worker
    """
    n, rank = _ring_group(group)
    size = q.shape[-2] // len(sequence_chunks(rank, n, order))
    split = lambda t, r: _pieces(t, r, n, order, causal)  # noqa: E731
    delta = (dout * out).sum(-1)  # sum_j p_j dp_j, per query row: the same for every block
    q_p, do_p, lse_p, delta_p = (split(t, rank) for t in (q, dout, lse.unsqueeze(-1),
                                                          delta.unsqueeze(-1)))
    q_ids = [c for c, _ in _local_chunks(rank, n, order, causal)]
    dq = [torch.zeros_like(p) for p in q_p]
    kv, grads_in = (k.contiguous(), v.contiguous()), None
    for step in range(n):
        src = (rank - step) % n
        pending = start_exchange(kv, group) if step < n - 1 else None
        k_p, v_p = split(kv[0], src), split(kv[1], src)
        kv_ids = [c for c, _ in _local_chunks(src, n, order, causal)]
        dk, dv = torch.zeros_like(kv[0]), torch.zeros_like(kv[1])
        dk_p, dv_p = split(dk, src), split(dv, src)  # views into dk, dv
        blocks = scores = 0
        timer = _Timer(stats, q.device)
        with timer:
            for qi, ki, kind in _step_blocks(rank, src, n, order, causal):
                if kind == "skipped":
                    continue
                mask = _mask(kind, q_ids[qi], kv_ids[ki], size, q.device)
                g_q, g_k, g_v = _block_grads(q_p[qi], k_p[ki], v_p[ki], do_p[qi],
                                             lse_p[qi].squeeze(-1), delta_p[qi].squeeze(-1), mask)
                dq[qi] += g_q
                dk_p[ki] += g_k
                dv_p[ki] += g_v
                blocks += 1
                scores += q_p[qi].shape[-2] * k_p[ki].shape[-2]
        _count(stats, "backward_", blocks, scores, timer.seconds)
        # dk, dv of chunk src: what the ranks before us added (they arrived during our compute)
        # plus ours, then on to the right. After n hops they are home, complete.
        if grads_in is not None:
            arrived = finish_exchange(grads_in)
            dk, dv = dk + arrived[0], dv + arrived[1]
        grads_in = start_exchange((dk, dv), group, tag=2) if n > 1 else None
        if pending is not None:
            kv = tuple(finish_exchange(pending))
    if grads_in is not None:
        dk, dv = finish_exchange(grads_in)
    return torch.cat(dq, dim=-2), dk, dv


class _RingAttention(torch.autograd.Function):
    """Ring attention with a ring backward; saves only this rank's q, k, v, out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, order, combine, group, stats):
        out, lse = ring_forward(q, k, v, causal, order, combine, group, stats)
        ctx.save_for_backward(q, k, v, out, lse)  # O(s / n): no s x s probabilities
        ctx.causal, ctx.order, ctx.group, ctx.stats = causal, order, group, stats
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.causal,
                                    ctx.order, ctx.group, ctx.stats)
        return dq, dk, dv, None, None, None, None, None


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor (batch, heads, seq, head_dim): this rank's "
                             f"chunk of the sequence; got {got}")
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q, k and v must have the same shape (batch, heads, seq, head_dim) on "
                         f"each rank: the same tokens' queries, keys and values; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def ring_attention(q, k, v, causal: bool = False, order: str = "contiguous", merge=None,
                   group=None, stats: dict | None = None):
    """Worker function piece: attention of this rank's tokens on the whole sequence, by a ring.

    ``q``, ``k``, ``v`` are this rank's chunk ``(batch, heads, s / n, head_dim)`` of the
    sequence, cut by :func:`shard_sequence` in ``order`` ("contiguous" or "zigzag"). Returns this
    rank's chunk of the full attention's output, equal to ``transformer.attention`` of the whole
    sequence, sharded the same way. Differentiable: the backward is a second ring.

    ``merge`` replaces :func:`merge` (the online-softmax rule) in the forward; ``group`` is the
    CP group (default: every rank); ``stats``, a dict, receives the work done: ``blocks`` and
    ``scores`` (score blocks and query-key scores computed) and ``compute_s`` (GPU: seconds;
    CPU: the main thread's CPU seconds, blind to a busy machine's descheduling), and the same
    with ``backward_`` in front after backward. Without a process group (or with one rank) it is
    plain attention: no ring.

    Example::

        >>> q, k, v = (shard_sequence(t, dist.get_rank(), dist.get_world_size()) for t in full)
        >>> out = ring_attention(q, k, v, causal=True)      # inside a worker
    """
    _check_qkv(q, k, v)
    _check_order(order)
    n, _ = _ring_group(group)
    if order == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"zigzag: each rank holds two chunks, so its sequence length must be "
                         f"even, got {q.shape[-2]}: use a full sequence length that is a "
                         f"multiple of {2 * n}, or order='contiguous'")
    combine = _default_merge if merge is None else merge
    return _RingAttention.apply(q, k, v, causal, order, combine, group, stats)


# ---- what it costs: bytes on the wire, bytes kept for backward -------------------------------


def ring_bytes_formula(seq: int, batch: int, heads: int, head_dim: int, world: int,
                       element_size: int = 4) -> dict:
    """Bytes each rank sends in ring attention: ``{"forward": ..., "backward": ...}``.

    One k (or v) chunk is ``C = batch * heads * seq / world * head_dim * element_size`` bytes.
    Forward: ``n - 1`` exchanges of k and v, ``2 (n - 1) C``. Backward: ``n - 1`` exchanges of k
    and v again, plus ``n`` of the gradient accumulators dk and dv (one more hop: they end on
    the rank that owns the chunk), ``2 (2n - 1) C``. One rank sends nothing: there is no ring.

    Example::

        >>> ring_bytes_formula(1024, 1, 8, 64, 4)
        {'forward': 3145728, 'backward': 7340032}
    """
    chunk = batch * heads * (seq // world) * head_dim * element_size
    return {"forward": 2 * (world - 1) * chunk,
            "backward": 2 * (2 * world - 1) * chunk if world > 1 else 0}


def full_saved_bytes(seq: int, batch: int, heads: int, head_dim: int, causal: bool,
                     element_size: int = 4) -> int:
    """Bytes full attention (``transformer.attention``) keeps for backward: q, k, v, the probs.

    ``e b h (3 s d + s^2)``, plus ``s^2`` bytes of boolean mask when causal: ``O(s^2)``. (The
    scores' own ``s x s`` are not kept: softmax's backward needs only its output.)
    """
    return element_size * batch * heads * (3 * seq * head_dim + seq * seq) + causal * seq * seq


def ring_saved_bytes(seq: int, batch: int, heads: int, head_dim: int, world: int,
                     element_size: int = 4) -> int:
    """Bytes ring attention keeps per rank for backward: q, k, v, out and lse chunks, ``O(s/n)``.

    ``e b h (s / n) (4 d + 1)``: the probabilities are recomputed in backward, never stored.
    """
    return element_size * batch * heads * (seq // world) * (4 * head_dim + 1)


# ---- the worker functions --------------------------------------------------------------------


def _reference(seq, batch, heads, head_dim, causal, seed, device):
    """The full sequence's q, k, v, upstream gradient, and full attention's output and grads."""
    gen = torch.Generator().manual_seed(seed)  # the same numbers on every rank
    q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, generator=gen).to(device)
                     for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = transformer.attention(*leaves, causal=causal)
    out.backward(dout)
    return (q, k, v, dout), out.detach(), [t.grad for t in leaves]


def ring_check(seq: int = 32, batch: int = 1, heads: int = 2, head_dim: int = 8,
               causal: bool = True, order: str = "contiguous", seed: int = 0,
               merge=None) -> dict:
    """Worker function: ring attention against full attention, its work, and its bytes.

    Every rank builds the same full sequence (one seed) and runs full attention on all of it
    (the reference), then ring attention on its own chunk, forward and backward. Returns this
    rank's largest differences (``out``, ``dq``, ``dk``, ``dv``) from the reference's shards;
    the work (``blocks``, ``scores``, ``compute_s``, and ``backward_*``) from a second run,
    without the traffic counter (the first warms the kernels up); the bytes sent forward and
    backward, counted by :func:`labkit.parallel.traffic.count_traffic`, beside
    :func:`ring_bytes_formula`.
    ``merge`` is passed on to :func:`ring_attention` (default: :func:`merge`).

    Example::

        >>> rows = labkit.launch(ring_check, 32, causal=True, nproc=4).values
        >>> [r["blocks"] for r in rows]
        [1, 2, 3, 4]
    """
    from labkit.parallel import traffic

    n, rank = _ring_group(None)
    _check_length(seq, n, order)
    device = collective_device(required=False)
    (q, k, v, dout), out_ref, grads_ref = _reference(seq, batch, heads, head_dim, causal, seed,
                                                     device)
    mine = lambda t: shard_sequence(t, rank, n, order)  # noqa: E731
    # First the bytes, counted at the dispatcher; this run also warms the kernels up, so that
    # the timed run below measures the blocks, not one-time start-up costs.
    counted = [mine(t).requires_grad_() for t in (q, k, v)]
    with traffic.count_traffic() as sent_forward:
        out = ring_attention(*counted, causal=causal, order=order, merge=merge)
    with traffic.count_traffic() as sent_backward:
        out.backward(mine(dout))

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    stats: dict = {}
    out = ring_attention(*local, causal=causal, order=order, merge=merge, stats=stats)
    out.backward(mine(dout))
    worst = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    diffs = {"out": worst(out.detach(), mine(out_ref))}
    for name, t, ref in zip(("dq", "dk", "dv"), local, grads_ref, strict=True):
        diffs[name] = worst(t.grad, mine(ref))
    formula = ring_bytes_formula(seq, batch, heads, head_dim, n, q.element_size())
    return {"rank": rank, "world": n, "seq": seq, "causal": causal, "order": order,
            "chunks": sequence_chunks(rank, n, order), "diffs": diffs,
            "max_diff": max(diffs.values()), **stats,
            "bytes": {"forward": sent_forward.sent_bytes(),
                      "backward": sent_backward.sent_bytes()},
            "bytes_formula": formula, "sends": {"forward": sent_forward.counts().get("send", 0),
                                                "backward": sent_backward.counts().get("send", 0)}}


def memory_sweep(seqs, batch: int = 1, heads: int = 2, head_dim: int = 16, causal: bool = True,
                 order: str = "zigzag", seed: int = 0) -> list[dict]:
    """Worker function: bytes kept for backward per rank, full attention vs ring, per length.

    For each ``seq`` in ``seqs``: full attention (``transformer.attention``) on the whole
    sequence (what one rank holds without CP) and :func:`ring_attention` on this rank's chunk,
    their saved tensors counted by :func:`labkit.parallel.memory.counting_saved_bytes` (the
    inputs included: they are kept too), beside :func:`full_saved_bytes` and
    :func:`ring_saved_bytes`. Returns the same rows on every rank: ``seq``, ``full``,
    ``full_formula``, ``ring``, ``ring_formula``.

    Example::

        >>> rows = labkit.launch(memory_sweep, [64, 128, 256], nproc=4).values[0]
        >>> rows[-1]["full"] / rows[-1]["ring"]     # O(s^2) against O(s / n)
    """
    from labkit.parallel.memory import counting_saved_bytes

    n, rank = _ring_group(None)
    device = collective_device(required=False)
    rows = []
    for seq in seqs:
        _check_length(seq, n, order)
        gen = torch.Generator().manual_seed(seed)
        full = [torch.randn(batch, heads, seq, head_dim, generator=gen).to(device)
                for _ in range(3)]
        leaves = [t.clone().requires_grad_() for t in full]
        with counting_saved_bytes() as saved_full:
            out = transformer.attention(*leaves, causal=causal)
        del out
        local = [shard_sequence(t, rank, n, order).requires_grad_() for t in full]
        with counting_saved_bytes() as saved_ring:
            out = ring_attention(*local, causal=causal, order=order)
        del out  # the graph and its saved tensors go; no backward, so no second ring
        e = full[0].element_size()
        rows.append({"seq": seq, "world": n, "causal": causal, "order": order,
                     "full": saved_full["bytes"],
                     "full_formula": full_saved_bytes(seq, batch, heads, head_dim, causal, e),
                     "ring": saved_ring["bytes"],
                     "ring_formula": ring_saved_bytes(seq, batch, heads, head_dim, n, e)})
    return rows

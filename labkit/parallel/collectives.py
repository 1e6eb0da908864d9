"""All-reduce written from point-to-point messages: the ring, and recursive doubling.

``dist.all_reduce`` hides the algorithm. Written out with ``isend``/``irecv`` it is a few lines:

* **ring** (what NCCL and gloo use for large messages): cut the tensor into ``n`` chunks. In
  ``n - 1`` steps of *reduce-scatter* every rank sends one chunk to its right neighbour and adds
  the chunk arriving from its left one; afterwards each rank holds one chunk fully summed. In
  ``n - 1`` steps of *all-gather* the summed chunks travel once more around the ring. Each rank
  sends ``2 (n - 1) / n`` of the tensor in all, whatever ``n``: the bandwidth-optimal amount.
* **recursive doubling** (a butterfly; the latency-optimal choice for small messages): in
  ``log2 n`` steps each rank swaps its whole tensor with the rank ``2^k`` away and adds. Fewer
  steps, but every step moves the whole tensor: ``log2 n`` times the message per rank.

Both are checked against ``dist.all_reduce`` and timed beside it by ``labkit.bench``
(``allreduce_sweep(..., algorithms=("builtin", "ring", "doubling"))``); ``bench.ring_seconds``
is the ring's alpha-beta model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_allreduce", "recursive_doubling_allreduce", "ALGORITHMS"]


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group) -> None:
    """Send to one neighbour while receiving from the other, and wait for both.

    Batched (``batch_isend_irecv``), not ``send`` then ``recv``: if every rank first sent, each
    would wait for a receiver that is itself still sending; NCCL needs the pair in one group.
    """
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _peer(group, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``: point-to-point ops address global ranks."""
    return dist.get_global_rank(group or dist.group.WORLD, group_rank)


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"all-reduce works on a tensor, got {type(x).__name__}")
    if not x.is_contiguous():
        raise ValueError("the tensor is not contiguous, so it cannot be reduced in place: pass "
                         "x.contiguous() and use the returned tensor")


def ring_allreduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` in place with a ring; return ``x``. Worker function.

    Every rank ends with bitwise the same tensor (each chunk is summed once, in ring order,
    then copied); it can differ from ``dist.all_reduce`` in the last bits, because float
    addition depends on the order.

    Example::

        >>> x = torch.full((10,), float(dist.get_rank()))   # inside a worker, 4 ranks
        >>> ring_allreduce(x)[:3]
        tensor([6., 6., 6.])
    """
    _check(x)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return x  # nothing to add: the sum over one rank is its own tensor
    # Ranks in the group's numbering form the ring; sends address global ranks.
    right, left = _peer(group, (rank + 1) % n), _peer(group, (rank - 1) % n)
    chunks = list(x.view(-1).tensor_split(n))  # views into x: work in place, sizes may differ by 1
    incoming = torch.empty_like(chunks[0])
    # Reduce-scatter: at step k send chunk rank - k (which holds k + 1 ranks' sum by now) and
    # add the left neighbour's partial sum of chunk rank - k - 1. After n - 1 steps, chunk
    # rank + 1 holds all n contributions.
    for k in range(n - 1):
        send, recv = chunks[(rank - k) % n], chunks[(rank - k - 1) % n]
        buf = incoming[:recv.numel()]
        _exchange(send, right, buf, left, group)
        recv += buf
    # All-gather: pass the finished chunks around; each arrives straight in its place.
    for k in range(n - 1):
        _exchange(chunks[(rank + 1 - k) % n], right, chunks[(rank - k) % n], left, group)
    return x


def recursive_doubling_allreduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` over a power-of-two number of ranks in place by recursive doubling; return ``x``.

    Step ``k`` pairs each rank with ``rank XOR 2^k``: they swap their partial sums and both
    add, so after ``log2 n`` steps every rank holds the total (bitwise the same on all ranks:
    ``a + b == b + a`` in floating point). Worker function.

    Example (inside a worker, 2 ranks: one step, one swap)::

        >>> recursive_doubling_allreduce(torch.ones(4) * (dist.get_rank() + 1))
        tensor([3., 3., 3., 3.])
    """
    _check(x)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n & (n - 1):
        lower = 1 << (n.bit_length() - 1)
        raise ValueError(f"recursive doubling pairs ranks by XOR, so it needs a power-of-two "
                         f"number of ranks; got {n}: use ring_allreduce, or {lower} or "
                         f"{2 * lower} ranks")
    incoming = torch.empty_like(x)  # the partner's whole tensor arrives at every step
    mask = 1
    while mask < n:
        # Step k pairs ranks that differ in bit k: after it, each holds the sum over a
        # group of 2^(k+1) ranks, so log2(n) steps reach all n.
        partner = _peer(group, rank ^ mask)
        _exchange(x, partner, incoming, partner, group)
        x += incoming
        mask <<= 1
    return x


def _builtin(x: torch.Tensor, group=None) -> torch.Tensor:
    """``dist.all_reduce`` with the same call shape as the hand-written ones."""
    dist.all_reduce(x, group=group)
    return x


# name -> fn(x, group=None) summing x in place; the names bench's --algorithms accepts.
ALGORITHMS = {"builtin": _builtin, "ring": ring_allreduce, "doubling": recursive_doubling_allreduce}

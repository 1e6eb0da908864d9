"""Notebook 06's exercises: the ring all-reduce's two halves, and top-k with error feedback.

The two ring halves run on real gloo ranks (2, then 4: on 2 ranks ``r + s`` and ``r - s`` are
the same chunk, so some index mistakes only show on more). Their inputs are *tagged*: rank r's
entry at position i is ``(i + 1) * 8**r``, so a finished sum's base-8 digits say how many times
each rank's entry went into it, and a wrong answer is diagnosed, not just refused. Their route is
judged too (:mod:`labkit.parallel.traffic`): each rank sends n - 1 messages, one a step, to rank
r + 1, step s carrying the chunk the algorithm names; a right result reached by another route
(one step too many, a collective, messages to other ranks) is not the ring.
"""

from __future__ import annotations

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "06"
WORLDS = (2, 4)  # ranks the ring halves are graded on
TIMEOUT = 20.0  # seconds: a ring of a few small chunks takes milliseconds; longer is a deadlock
BASE = 8  # rank r's entries are multiples of BASE**r: a sum's digits count each rank's share
STALE = -10000.0  # the all-gather's unfinished chunks on rank r: STALE * (r + 1)

_RS_INDEX = ("chunk indices off by one step: at step s rank r sends chunk (r - s) mod n to rank "
             "r + 1 and adds the chunk arriving from rank r - 1 into its chunk (r - s - 1) mod "
             "n; after n - 1 steps chunk (r + 1) mod n holds every rank's contribution")
_AG_INDEX = ("at step s rank r sends chunk (r + 1 - s) mod n (the one it finished, then the one "
             "it just received) to rank r + 1, and receives chunk (r - s) mod n from rank r - 1 "
             "into its place")
_DEADLOCK = ("deadlock: both ranks used blocking send first (dist.send waits for its receiver, "
             "which is itself sending): start both, dist.isend(...) and dist.irecv(...), then "
             "wait() on both (a send's wait() before the receive is posted deadlocks as well)")
_STEPS = ("the ring takes n - 1 steps: at each one every rank sends one chunk to rank r + 1 and "
          "receives one from rank r - 1 (for s in range(world - 1))")
_IN_PLACE = ("work in place (`chunk += buf`, or receive straight into the chunk): the chunks are "
             "views into the tensor being all-reduced; `chunks[j] = chunks[j] + buf` makes a new "
             "tensor and leaves that one unchanged")


def _chunks_of(x, world: int):
    """The ring's chunks: views into ``x``, sizes one apart where ``world`` does not divide it."""
    return list(x.view(-1).tensor_split(world))


def _cases(world: int) -> list[tuple[int, str]]:
    """(numel, dtype): chunks of 0 or 1 entries, unequal chunks, equal ones in float64."""
    return [(1, "float32"), (2 * world + 1, "float32"), (4 * world, "float64")]


def _run_counted(fn, chunks, rank: int, world: int, x) -> dict:
    """``fn(chunks, rank, world)`` with what this rank sent counted; x, chunks and calls after."""
    from ..parallel.traffic import count_traffic

    with count_traffic() as sent:
        fn(chunks, rank, world)
    return {"x": x.clone(), "chunks": [c.clone() for c in chunks],
            "calls": [(c.op, c.payload_bytes, c.peer) for c in sent.calls]}


def _reduce_scatter_worker(fn, cases) -> list[dict]:
    """Each rank: ``fn(chunks, rank, world)`` on a tagged tensor of each case; x, chunks after."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for numel, dtype in cases:
        x = torch.arange(1, numel + 1, dtype=getattr(torch, dtype)) * BASE ** rank
        out.append(_run_counted(fn, _chunks_of(x, world), rank, world, x))
    return out


def _all_gather_worker(fn, cases) -> list[dict]:
    """On each rank: only chunk (rank + 1) % world finished (position + 1), the rest stale."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for numel, dtype in cases:
        x = torch.full((numel,), STALE * (rank + 1), dtype=getattr(torch, dtype))
        chunks = _chunks_of(x, world)
        own = (rank + 1) % world
        start = sum(c.numel() for c in chunks[:own])
        chunks[own].copy_(torch.arange(start + 1, start + 1 + chunks[own].numel()))
        out.append(_run_counted(fn, chunks, rank, world, x))
    return out


def _on_ranks(worker, fn, world: int, cases, index_hint: str) -> list:
    """``on_ranks`` on ``world`` ranks, a hang or a size mismatch named for what it is here."""
    try:
        return on_ranks(worker, fn, cases, nproc=world, timeout=TIMEOUT)
    except NotYet as wrong:
        hint = wrong.hint
        if wrong.stuck:  # a hang
            hint = _DEADLOCK
        elif any(sign in wrong.detail for sign in ("size doesn't match", "SIGABRT",
                                                   "Connection reset", "Connection closed",
                                                   "native code")):
            # What gloo does when a message is larger than its receive buffer: abort the rank.
            hint = ("a chunk arrived into a buffer of another size or dtype (gloo aborted): "
                    "the chunk rank r + 1 receives into at a step must be the one rank r sends, "
                    "and a buffer takes the chunk's dtype (torch.empty_like(chunk)); "
                    + index_hint)
        raise NotYet(f"on {world} ranks: {wrong.detail}", hint) from None


def _shares(chunk, start: int, world: int) -> list[int] | None:
    """How many times each rank's entry is in ``chunk`` (at ``start`` in x); None if mixed up."""
    import torch

    position = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.float64)
    total = chunk.double() / position
    if chunk.numel() == 0 or not torch.all(total == total[0]) or total[0] != total[0].round():
        return None  # entries from other positions: a chunk landed in the wrong place
    value, shares = int(total[0].item()), []
    for _ in range(world):
        value, digit = divmod(value, BASE)
        shares.append(digit)
    return shares if value == 0 else None


def _starts(chunks) -> list[int]:
    starts, at = [], 0
    for c in chunks:
        starts.append(at)
        at += c.numel()
    return starts


def _route_mistake(where: str, rank: int, world: int, got: dict, first: int,
                   index_hint: str) -> None:
    """Raise NotYet unless ``rank`` sent the ring's messages: step s, chunk (first - s) mod n.

    Each rank sends n - 1 messages, all to rank r + 1, and receives n - 1, all from rank r - 1;
    the s-th carries exactly that chunk's bytes. Right values by another route are not the ring.
    """
    chunks, calls = got["chunks"], got["calls"]
    others = sorted({op for op, _, _ in calls if op not in ("send", "recv")})
    if others:
        raise NotYet(f"{where}: right values, but through {', '.join(others)}",
                     "the point is to build it from point-to-point messages: dist.isend and "
                     "dist.irecv between ring neighbours, no collective; " + _STEPS)
    sends = [(size, peer) for op, size, peer in calls if op == "send"]
    recvs = [(size, peer) for op, size, peer in calls if op == "recv"]
    steps = world - 1
    if len(sends) > steps or len(recvs) > steps:
        raise NotYet(f"{where}: {len(sends)} messages sent and {len(recvs)} received; the ring "
                     f"on {world} ranks takes {steps} steps, one message each way a step",
                     "one step too many: " + _STEPS)
    if len(sends) < steps or len(recvs) < steps:
        raise NotYet(f"{where}: {len(sends)} messages sent and {len(recvs)} received, fewer than "
                     f"the ring's {steps} steps", _STEPS)
    right, left = (rank + 1) % world, (rank - 1) % world
    if any(peer != right for _, peer in sends) or any(peer != left for _, peer in recvs):
        raise NotYet(f"{where}: sent to ranks {[p for _, p in sends]} and received from "
                     f"{[p for _, p in recvs]}; a ring sends only to rank {right} (r + 1) and "
                     f"receives only from rank {left} (r - 1)",
                     "right values, but not the ring: every rank talks to its two neighbours "
                     "only, so each link carries 1/n of the data per step; " + _STEPS)
    want = [chunks[(first - s) % world].numel() * chunks[0].element_size()
            for s in range(steps)]
    got_sizes = [size for size, _ in sends]
    if got_sizes != want:
        step = next(s for s in range(steps) if got_sizes[s] != want[s])
        raise NotYet(f"{where}: step {step} sent {got_sizes[step]} bytes; chunk "
                     f"{(first - step) % world} is {want[step]} bytes (messages "
                     f"{got_sizes}, the ring's {want})", index_hint)


def _judge_routes(results, cases, world: int, offset: int, index_hint: str) -> None:
    """Every rank's route in every case: at step s, chunk (rank + offset - s) mod n sent."""
    for rank, per_rank in enumerate(results):
        for (numel, _), got in zip(cases, per_rank, strict=True):
            where = f"on {world} ranks (numel {numel}, {got['x'].dtype}), rank {rank}"
            _route_mistake(where, rank, world, got, rank + offset, index_hint)


def _diagnose_reduce_scatter(rank: int, world: int, numel: int, got: dict) -> None:
    """Raise NotYet if ``rank``'s chunk (rank + 1) % world is not the full sum, saying why."""
    import torch

    chunks, n, mine = got["chunks"], world, (rank + 1) % world
    where = f"on {world} ranks (numel {numel}, {got['x'].dtype}), rank {rank}"
    if not torch.equal(torch.cat(chunks), got["x"]):
        raise NotYet(f"{where}: the chunks no longer view the tensor", _IN_PLACE)
    starts = _starts(chunks)
    shares = _shares(chunks[mine], starts[mine], n)
    if shares == [1] * n or chunks[mine].numel() == 0:
        return
    if shares is None:
        raise NotYet(f"{where}: chunk {mine} holds entries from other positions",
                     "receive each chunk into a buffer of that chunk's size and add it to that "
                     "same chunk (chunk sizes differ by one when n does not divide the numel); "
                     + _RS_INDEX)
    said = f"{where}: chunk {mine} holds each rank's entry {shares} times (want {[1] * n})"
    if shares[rank] == 0:
        raise NotYet(said, "rank r's own chunk not added: receive into a separate buffer and add "
                           "it (chunk += buf); receiving straight into the chunk overwrites "
                           "rank r's own contribution")
    if max(shares) > 1:
        raise NotYet(said, "a contribution was added twice: the ring takes n - 1 steps (not n), "
                           "and each step adds the arriving chunk once")
    done = [j for j in range(n) if _shares(chunks[j], starts[j], n) == [1] * n]
    also = f"; your ring completed chunk {done[0]} instead" if done else ""
    raise NotYet(said + also, _RS_INDEX)


def _grade_ring(fn, worlds, worker, diagnose, offset: int, index_hint: str) -> None:
    """Run one ring half on each world and judge every rank: the values first (they say more
    about a mistake), then the route that reached them."""
    for world in worlds:
        cases = _cases(world)
        results = _on_ranks(worker, fn, world, cases, index_hint)
        for rank, per_rank in enumerate(results):
            for (numel, _), got in zip(cases, per_rank, strict=True):
                diagnose(rank, world, numel, got)
        _judge_routes(results, cases, world, offset, index_hint)


@exercise("ring_reduce_scatter", notebook=NOTEBOOK, title="ring reduce-scatter from isend/irecv")
def ring_reduce_scatter(fn, worlds=WORLDS) -> str:
    """Exercise: ``fn(chunks, rank, world)`` leaves chunk (rank + 1) % world summed over all ranks.

    Run on real gloo ranks (``worlds``: 2, then 4) with tensors of 1, 2n + 1 and 4n entries
    (empty chunks, chunks of unequal sizes, equal ones in float64); compared exactly with the
    sum, and the route with the ring's: n - 1 messages to rank r + 1, chunk (r - s) mod n at
    step s.

    Example::

        >>> exercise.ring_reduce_scatter(my_reduce_scatter)
        [pass] ring reduce-scatter from isend/irecv: on 2 and 4 ranks, ...
    """
    _grade_ring(fn, worlds, _reduce_scatter_worker, _diagnose_reduce_scatter, 0, _RS_INDEX)
    return (f"on {' and '.join(map(str, worlds))} ranks (float32 and float64, empty and uneven "
            f"chunks), chunk (r + 1) mod n of every rank r holds every rank's contribution "
            f"exactly once, in place, after n - 1 ring steps of one chunk each")


def _diagnose_all_gather(rank: int, world: int, numel: int, got: dict) -> None:
    """Raise NotYet unless every chunk on ``rank`` holds the finished values (position + 1)."""
    import torch

    chunks = got["chunks"]
    where = f"on {world} ranks (numel {numel}, {got['x'].dtype}), rank {rank}"
    if not torch.equal(torch.cat(chunks), got["x"]):
        raise NotYet(f"{where}: the chunks no longer view the tensor", _IN_PLACE)
    done = torch.arange(1, numel + 1, dtype=got["x"].dtype).tensor_split(world)
    stale = {STALE * (r + 1) for r in range(world)}
    for j, (chunk, want) in enumerate(zip(chunks, done, strict=True)):
        if torch.equal(chunk, want):
            continue
        if set((chunk - want).tolist()) <= stale:
            raise NotYet(f"{where}: chunk {j} is the finished chunk plus a stale partial sum",
                         "added instead of copied: an arriving chunk is already the full sum; "
                         "receive it straight into its place (or copy_ it), do not add it")
        if set(chunk.tolist()) <= stale:
            raise NotYet(f"{where}: chunk {j} never arrived finished (it still holds a partial "
                         f"sum)", _AG_INDEX)
        raise NotYet(f"{where}: chunk {j} holds other chunks' entries", _AG_INDEX)


@exercise("ring_all_gather", notebook=NOTEBOOK, title="ring all-gather from isend/irecv")
def ring_all_gather(fn, worlds=WORLDS) -> str:
    """Exercise: ``fn(chunks, rank, world)`` spreads each rank's finished chunk to every rank.

    On entry rank r holds chunk (r + 1) % world finished (what the reduce-scatter leaves) and
    stale partial sums elsewhere; afterwards every chunk of every rank must be the finished one,
    reached by the ring's route: n - 1 messages to rank r + 1, chunk (r + 1 - s) mod n at step s.

    Example::

        >>> exercise.ring_all_gather(my_all_gather)
        [pass] ring all-gather from isend/irecv: on 2 and 4 ranks, every rank ends with ...
    """
    _grade_ring(fn, worlds, _all_gather_worker, _diagnose_all_gather, 1, _AG_INDEX)
    return (f"on {' and '.join(map(str, worlds))} ranks (float32 and float64, empty and uneven "
            f"chunks), every rank ends with every finished chunk, copied in place, after n - 1 "
            f"ring steps of one chunk each")


_LOST = ("residual not carried: the dropped mass is lost. Add the residual first (full = grad + "
         "residual), send the top k of full, and keep everything of full not sent as the new "
         "residual")


def _check_step(fn, grad, residual, k: int):
    """One call of the learner's ``fn``, checked against top-k with error feedback; its residual."""
    import torch

    full = grad + residual
    out = fn(grad.clone(), residual.clone(), k)
    if not (isinstance(out, tuple | list) and len(out) == 3):
        raise NotYet(f"it returned {type(out).__name__}, not (values, indices, new_residual)",
                     "end with `return values, indices, new_residual`")
    values, indices, left = out
    if not torch.is_floating_point(torch.as_tensor(values)) and torch.is_floating_point(
            torch.as_tensor(indices)):
        raise NotYet("the first item holds integers, the second floats",
                     "return (values, indices, new_residual), in that order")
    values, indices = torch.as_tensor(values), torch.as_tensor(indices).long()
    said = f"with k = {k} on {grad.numel()} entries"
    if indices.numel() != k:
        raise NotYet(f"{said} it sent {indices.numel()} entries",
                     "send exactly k entries: full.abs().topk(k).indices")
    picked = set(indices.tolist())
    if picked != set(full.abs().topk(k).indices.tolist()):
        if picked == set(grad.abs().topk(k).indices.tolist()):
            raise NotYet(f"{said} it picked the top k of grad, not of grad + residual", _LOST)
        if picked == set(full.topk(k).indices.tolist()):
            raise NotYet(f"{said} it picked the k largest values, not magnitudes",
                         "rank by magnitude, full.abs().topk(k): a large negative entry matters "
                         "as much as a large positive one")
        raise NotYet(f"{said} it picked indices {sorted(picked)}, not the k largest "
                     f"|grad + residual|", "pick full.abs().topk(k).indices")
    if not torch.allclose(values.float(), full[indices]):
        hint = _LOST if torch.allclose(values.float(), grad[indices]) else (
            "send values = full[indices]: the entries of grad + residual at those indices")
        raise NotYet(f"{said} the values sent are not (grad + residual)[indices]", hint)
    want = full.clone()
    want[indices] = 0
    if left is None or not torch.as_tensor(left).any():
        raise NotYet(f"{said} the new residual is empty: what was not sent is dropped", _LOST)
    left = torch.as_tensor(left).float()
    if torch.allclose(left, full):
        raise NotYet(f"{said} the sent entries are still in the new residual",
                     "zero the sent entries in the new residual: otherwise they are sent again "
                     "next step, applied twice")
    if not torch.allclose(left, want):
        raise NotYet(f"{said} sent + new residual is not grad + residual", _LOST)
    return values.float(), indices, left


@exercise("topk_error_feedback", notebook=NOTEBOOK, title="top-k with error feedback")
def topk_error_feedback(fn, steps: int = 12) -> str:
    """Exercise: ``fn(grad, residual, k) -> (values, indices, new_residual)``, nothing lost.

    One hand-made case where the residual changes the top k, then ``steps`` steps on random
    gradients carrying the learner's own residual; sent + final residual = the gradients' sum.

    Example::

        >>> exercise.topk_error_feedback(my_compress)
        [pass] top-k with error feedback: the top k of grad + residual sent, ...
    """
    import torch

    grad = torch.tensor([0.1, -3.0, 0.5, 2.0, -0.2, 0.05])
    _check_step(fn, grad, torch.tensor([0.0, 0.0, 2.0, 0.0, -2.5, 0.0]), 2)
    gen = torch.Generator().manual_seed(0)
    residual, sent, total = torch.zeros(50), torch.zeros(50), torch.zeros(50)
    for _ in range(steps):
        grad = torch.randn(50, generator=gen)
        values, indices, residual = _check_step(fn, grad, residual, 5)
        sent.index_add_(0, indices, values)
        total += grad
    if not torch.allclose(sent + residual, total, atol=1e-4):  # each step's check implies it
        raise NotYet(f"after {steps} steps sent + residual differs from the gradients' sum", _LOST)
    return (f"the top k of grad + residual sent, the rest kept; over {steps} steps sent + "
            f"residual = the sum of the gradients (nothing lost, only delayed)")


# ==== challenge: the whole all-reduce by recursive halving and doubling (Rabenseifner) =======
# Graded on 2 and 4 real ranks by the values (tagged, so a miscount is diagnosed) and by the
# route: point-to-point messages only, 2 log2 n of them per rank, 2 (n - 1)/n of the bytes.

_HD_CASES = ("float32", "float64", "int64")  # one dtype per shape below, in this order
_HD_ROUTE = ("step k (k = 0, 1, ...) pairs rank r with r XOR (n >> (k + 1)) (or any fixed order "
             "of the partners r XOR 2^j): split the segment you are responsible for in two "
             "halves, send your partner the half it keeps, receive its copy of the half you keep "
             "and add it; after log2 n steps you hold 1/n of the tensor summed; then retrace "
             "the steps backwards, sending your finished segment to the same partners and "
             "receiving theirs")


_HD_BUFFER = ("receive into a buffer of the size and dtype of the half it is added to "
              "(torch.empty_like(half)): x may be float64 or int64, and both partners split the "
              "same segment the same way (tensor_split(2)), so the half one sends is the size "
              "of the half the other receives into")


def _hd_on_ranks(fn, world: int) -> list:
    """``on_ranks`` on ``world`` ranks; a hang or an aborted rank named for what it is here."""
    try:
        return on_ranks(_halving_doubling_worker, fn, nproc=world, timeout=TIMEOUT)
    except NotYet as wrong:
        hint = wrong.hint
        if wrong.stuck:
            hint = ("deadlock: start the send and the receive of each step together "
                    "(dist.isend and dist.irecv, then wait() on both), and make sure both "
                    "partners take the same number of steps")
        elif any(sign in wrong.detail for sign in ("size doesn't match", "SIGABRT",
                                                   "Connection reset", "Connection closed",
                                                   "native code")):
            # what gloo does when a message is larger than its receive buffer: abort the rank
            hint = ("a message arrived into a buffer of another size or dtype (gloo aborted a "
                    "rank): " + _HD_BUFFER)
        raise NotYet(f"on {world} ranks: {wrong.detail}", hint) from None


def _hd_shapes(world: int) -> list[tuple[int, ...]]:
    """A tensor smaller than the ranks (empty halves), an odd length, a 2-D one that divides."""
    return [(1,), (2 * world + 1,), (2, 2 * world)]


def _halving_doubling_worker(fn) -> list[dict]:
    """Each rank: ``fn(x)`` on tagged tensors of each shape and dtype; what it sent and left."""
    import torch
    import torch.distributed as dist

    from ..parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for shape, dtype in zip(_hd_shapes(world), _HD_CASES, strict=True):
        numel = 1
        for d in shape:
            numel *= d
        x = (torch.arange(1, numel + 1, dtype=torch.int64) * BASE ** rank).to(
            getattr(torch, dtype)).reshape(shape)
        with traffic.count_traffic() as t:
            returned = fn(x)
        out.append({"x": x.clone(), "same_object": returned is x,
                    "returned": None if not isinstance(returned, torch.Tensor)
                    else returned.detach().clone(),
                    "calls": [(c.op, c.payload_bytes, c.sent_bytes) for c in t.calls]})
    return out


def _hd_route(world: int, rank: int, shape, dtype: str, got: dict, esize: int) -> None:
    """Raise NotYet unless rank ``rank`` sent by halving and doubling: messages, bytes."""
    import math

    where = f"on {world} ranks (rank {rank}), {dtype} of shape {tuple(shape)}"
    numel = math.prod(shape)
    ops = [op for op, _, _ in got["calls"]]
    collectives = sorted({op for op in ops if op not in ("send", "recv")})
    if collectives:
        raise NotYet(f"{where}: it called {', '.join(collectives)}",
                     "write it from point-to-point messages only (dist.isend / dist.irecv, or "
                     "dist.batch_isend_irecv): the collective is what you are building")
    sends, steps = ops.count("send"), 2 * int(math.log2(world))
    sent = sum(s for op, _, s in got["calls"] if op == "send")
    size = numel * esize
    whole = [b for op, b, _ in got["calls"] if op == "send"]
    if sends == steps // 2 and whole and all(b == size for b in whole):
        raise NotYet(f"{where}: {sends} messages of the whole tensor ({size} bytes each)",
                     "that is recursive doubling: log2 n steps of the whole tensor, log2 n times "
                     "the bytes. Halve instead: each step of the first phase sends only the half "
                     "your partner keeps, so the bytes shrink by half every step; " + _HD_ROUTE)
    if sends == 2 * (world - 1) and sends != steps:
        raise NotYet(f"{where}: {sends} messages, the ring's 2(n - 1); halving and doubling "
                     f"takes 2 log2 n = {steps}", "pair with partners at distance n/2, n/4, ... "
                     "(rank XOR distance), not your ring neighbours; " + _HD_ROUTE)
    if sends != steps:
        raise NotYet(f"{where}: {sends} messages sent; halving and doubling sends 2 log2 n = "
                     f"{steps} (one per step, log2 n steps of each phase)", _HD_ROUTE)
    if numel % world == 0 and sent != 2 * (world - 1) * size // world:
        raise NotYet(f"{where}: sent {sent} bytes; halving and doubling sends 2(n - 1)/n of the "
                     f"tensor, {2 * (world - 1) * size // world} bytes, like the ring",
                     "each step of the first phase sends half of the segment you still hold "
                     "(S/2, S/4, ...), and the second phase sends the same sizes back: "
                     + _HD_ROUTE)


def _hd_values(world: int, rank: int, shape, dtype: str, got: dict) -> None:
    """Raise NotYet unless ``x`` holds the sum over the ranks in place, tagged digits diagnosed."""
    import torch

    where = f"on {world} ranks (rank {rank}), {dtype} of shape {tuple(shape)}"
    x = got["x"]
    if tuple(x.shape) != tuple(shape) or str(x.dtype) != f"torch.{dtype}":
        raise NotYet(f"{where}: x became {x.dtype} of shape {tuple(x.shape)}",
                     "sum in place into x itself: work on a flat view, x.view(-1), and receive "
                     "into buffers of x's dtype (torch.empty_like)")
    flat = x.reshape(-1)
    want = torch.arange(1, flat.numel() + 1, dtype=torch.float64) * sum(
        BASE ** r for r in range(world))
    if torch.equal(flat.double(), want):
        back = got["returned"]
        if not got["same_object"] and not (back is not None and back.numel() == flat.numel()
                                           and torch.equal(back.reshape(-1), flat)):
            raise NotYet(f"{where}: x holds the sum but the function returned "
                         f"{'None' if got['returned'] is None else 'another tensor'}",
                         "return x, as dist.all_reduce's callers expect the summed tensor")
        return
    returned = got["returned"]
    if returned is not None and returned.numel() == flat.numel() and torch.equal(
            returned.reshape(-1).double(), want):
        raise NotYet(f"{where}: the returned tensor holds the sum, x itself does not",
                     "work in place: x.view(-1) and its slices are views, so += and copy_ into "
                     "them change x; x.reshape(-1) of a contiguous tensor is a view too, "
                     "torch.cat(...) is not")
    for i in range(flat.numel()):
        shares = _shares(flat[i:i + 1], i, world)
        if shares != [1] * world:
            said = (f"{where}: entry {i} holds each rank's entry "
                    f"{shares if shares else 'in no countable way'} times (want {[1] * world})")
            if shares and max(shares) > 1:
                hint = ("a contribution was added twice: in the second phase the arriving "
                        "segment is already finished, so copy it into place, do not add it")
            elif shares and shares[rank] == 0:
                hint = ("rank r's own part was overwritten: receive into a separate buffer and "
                        "add it (segment += buf)")
            else:
                hint = ("some part never arrived finished: each rank must end the first phase "
                        "with a different 1/n segment, and send it back along the same "
                        "partners in reverse order; " + _HD_ROUTE)
            raise NotYet(said, hint)
    raise NotYet(f"{where}: x is not the sum over the ranks", _HD_ROUTE)


@exercise("halving_doubling", notebook=NOTEBOOK,
          title="challenge: all-reduce by recursive halving and doubling")
def halving_doubling(fn, worlds=(2, 4)) -> str:
    """Challenge: ``fn(x)`` sums ``x`` over a power-of-two number of ranks in place, returns it.

    Run on real gloo ranks (``worlds``) on tagged tensors: 1 float32 entry (halves that are
    empty), 2n + 1 float64 entries (uneven halves), a 2 x 2n int64 tensor; every rank must hold
    exactly the sum, bitwise the same on all ranks, in ``x`` itself, having sent only
    point-to-point messages: 2 log2 n per rank, 2(n - 1)/n of the tensor's bytes.

    Example::

        >>> exercise.halving_doubling(my_halving_doubling)
        [pass] challenge: all-reduce by recursive halving and doubling: on 2 and 4 ranks ...
    """
    import math

    for world in worlds:
        results = _hd_on_ranks(fn, world)
        shapes = _hd_shapes(world)
        for rank, per_rank in enumerate(results):
            for shape, dtype, got in zip(shapes, _HD_CASES, per_rank, strict=True):
                _hd_values(world, rank, shape, dtype, got)
                _hd_route(world, rank, shape, dtype, got, got["x"].element_size())
        for k, shape in enumerate(shapes):
            if any(not bool((r[k]["x"] == results[0][k]["x"]).all()) for r in results):
                raise NotYet(f"on {world} ranks, shape {shape}: the ranks' sums differ",
                             "each segment is summed on one rank and copied to the others, so "
                             "every rank holds bitwise the same result")
    steps = ", ".join(f"{2 * int(math.log2(w))} messages on {w} ranks" for w in worlds)
    return (f"on {' and '.join(map(str, worlds))} ranks, float32, float64 and int64, an empty "
            f"half and uneven halves: the exact sum in place, from point-to-point messages only "
            f"({steps}), 2(n - 1)/n of the bytes")


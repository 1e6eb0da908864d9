"""What a rank puts on the wire: every collective and point-to-point call, counted as it runs.

A byte count in a lesson should be *measured*, not just computed: this module watches the calls a
worker really makes, hand-written (``dist.all_reduce``, ``dist.isend``) or issued by torch itself
(FSDP2's all-gathers and reduce-scatters, DTensor's functional collectives), and reports how many
bytes this rank sends for each. It listens at the dispatcher (a ``TorchDispatchMode``), where
every ``torch.distributed`` operation passes whatever called it.

The bytes a rank *sends* are those of the bandwidth-optimal algorithms (ring, for n ranks and a
tensor of S bytes), the figures notebooks 00 and 06 derived:

=================  ===========================================================
all_reduce         2 (n-1)/n * S   (a reduce-scatter, then an all-gather)
all_gather         (n-1)/n * S     (S: the gathered output)
reduce_scatter     (n-1)/n * S     (S: the full input)
all_to_all         the input's bytes addressed to the other ranks (its split sizes)
send / recv        S / 0   (``isend``/``irecv`` and ``batch_isend_irecv`` alike)
broadcast          S on the root, 0 elsewhere   (a pipelined chain: each rank passes S on once)
reduce             S on every rank but the root, 0 on the root   (the chain the other way)
gather             S on every rank but the root (its own tensor), 0 on the root
scatter            the parts for the other ranks on the root, 0 elsewhere
=================  ===========================================================

NCCL may pick a tree or another algorithm for some sizes; the ring's figure is the one the
formulas of the course use, so a measured count equals its formula exactly. A barrier moves no
data and is not counted. Each call also notes its ``peer`` (the rank a send goes to, a receive
comes from) and ``root``, in the group's numbering, so a grader can follow a ring.

Example (inside a worker)::

    with traffic.count_traffic() as t:
        dist.all_reduce(torch.ones(1024))          # 4 KiB
    t.counts(), t.sent_bytes()                     # ({'all_reduce': 1}, 4096) on 2 ranks
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .._dist import collective_device

__all__ = ["Call", "Traffic", "count_traffic", "ring_bytes", "step_traffic"]


@dataclass(frozen=True)
class Call:
    """One communication call: its kind, its tensor's bytes, the bytes this rank sent."""

    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send, recv, broadcast, reduce,
    # gather, scatter
    payload_bytes: int  # S in the table of the module docstring
    sent_bytes: int  # what this rank put on the wire
    world: int  # ranks in the call's group
    ranks: tuple[int, ...] = ()  # the group's global ranks (tells a 2-D mesh's dimensions apart)
    peer: int | None = None  # send: the destination, recv: the source (-1: any); group ranks
    root: int | None = None  # broadcast, reduce, gather, scatter: the root, a group rank


def ring_bytes(op: str, payload_bytes: int, world: int) -> int:
    """Bytes one rank sends for ``op`` on ``payload_bytes`` over ``world`` ranks (the table above).

    Example::

        >>> ring_bytes("all_reduce", 4096, 4), ring_bytes("all_gather", 4096, 4)
        (6144, 3072)
    """
    if world < 1:
        raise ValueError(f"world must be at least 1 rank, not {world}")
    if op == "all_reduce":
        return 2 * (world - 1) * payload_bytes // world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) * payload_bytes // world
    if op == "send":
        return payload_bytes
    if op == "recv":
        return 0
    raise ValueError(f"no ring formula for {op!r}: use all_reduce, all_gather, reduce_scatter, "
                     f"send or recv (all_to_all and broadcast depend on the splits and the root)")


class Traffic:
    """The calls seen inside one :func:`count_traffic` block, and their totals."""

    def __init__(self):
        self.calls: list[Call] = []

    def counts(self) -> dict[str, int]:
        """``{op: number of calls}`` in first-call order."""
        out: dict[str, int] = {}
        for call in self.calls:
            out[call.op] = out.get(call.op, 0) + 1
        return out

    def by_op(self) -> dict[str, int]:
        """``{op: bytes this rank sent}``."""
        out: dict[str, int] = {}
        for call in self.calls:
            out[call.op] = out.get(call.op, 0) + call.sent_bytes
        return out

    def sent_bytes(self, op: str | None = None) -> int:
        """Bytes this rank sent, over every call (or the calls of one ``op``)."""
        return sum(c.sent_bytes for c in self.calls if op is None or c.op == op)

    def __repr__(self) -> str:
        return f"Traffic({self.counts()}, sent {self.sent_bytes():,} bytes)"


def _nbytes(tensors) -> int:
    """Bytes of a tensor or of a (nested) list of tensors."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _group(obj):
    """The Python ProcessGroup behind a dispatcher argument: a boxed group or a group name."""
    if isinstance(obj, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(obj)
    if isinstance(obj, dist.ProcessGroup):
        return obj
    return dist.ProcessGroup.unbox(obj)


def _own_bytes(name: str, args, pg) -> int:
    """Bytes of an all-to-all's input that this rank addresses to itself (never sent)."""
    if name == "c10d.alltoall_":  # a list of tensors, one per destination rank
        return _nbytes(args[1][pg.rank()])
    # one tensor cut along dim 0 by the split sizes (equal parts when there are none)
    inp, splits = (args[1], args[4]) if name == "c10d.alltoall_base_" else (args[0], args[2])
    rows = inp.shape[0] if inp.dim() else 1
    row_bytes = _nbytes(inp) // rows if rows else 0
    own = list(splits)[pg.rank()] if len(splits) else rows // pg.size()
    return own * row_bytes


# dispatcher op name -> (our op, index of the group argument, payload from the arguments,
# index of the root or peer argument, or None)
_C10D = {
    "c10d.allreduce_": ("all_reduce", 1, lambda a: _nbytes(a[0]), None),
    "c10d.allreduce_coalesced_": ("all_reduce", 1, lambda a: _nbytes(a[0]), None),
    "c10d._allgather_base_": ("all_gather", 2, lambda a: _nbytes(a[0]), None),
    "c10d.allgather_": ("all_gather", 2, lambda a: _nbytes(a[0]), None),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 2, lambda a: _nbytes(a[0]), None),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 2, lambda a: _nbytes(a[1]), None),
    "c10d.reduce_scatter_": ("reduce_scatter", 2, lambda a: _nbytes(a[1]), None),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 2, lambda a: _nbytes(a[1]), None),
    "c10d.alltoall_base_": ("all_to_all", 2, lambda a: _nbytes(a[1]), None),
    "c10d.alltoall_": ("all_to_all", 2, lambda a: _nbytes(a[1]), None),
    "c10d.send": ("send", 1, lambda a: _nbytes(a[0]), 2),
    "c10d.recv_": ("recv", 1, lambda a: _nbytes(a[0]), 2),
    "c10d.recv_any_source_": ("recv", 1, lambda a: _nbytes(a[0]), None),
    "c10d.broadcast_": ("broadcast", 1, lambda a: _nbytes(a[0]), 2),
    "c10d.reduce_": ("reduce", 1, lambda a: _nbytes(a[0]), 3),
    "c10d.gather_": ("gather", 2, lambda a: _nbytes(a[1]), 3),
    # S is what the root scatters: every rank's output (one part) times the ranks
    "c10d.scatter_": ("scatter", 2, lambda a: _nbytes(a[0]), 3),
}
# functional collectives (DTensor, torch.compile): the group is their last argument
_FUNCTIONAL = {
    "_c10d_functional.all_reduce": ("all_reduce", lambda a: _nbytes(a[0])),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", lambda a: _nbytes(a[0])),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "_c10d_functional.all_gather_into_tensor_coalesced":
        ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "_c10d_functional.reduce_scatter_tensor_coalesced":
        ("reduce_scatter", lambda a: _nbytes(a[0])),
    "_c10d_functional.all_to_all_single": ("all_to_all", lambda a: _nbytes(a[0])),
    "_c10d_functional.broadcast": ("broadcast", lambda a: _nbytes(a[0])),
}


def _sent(op: str, size: int, name: str, args, pg, root) -> int:
    """What this rank puts on the wire for one call of ``op`` on ``size`` bytes (the table)."""
    rank, world = pg.rank(), pg.size()
    if op == "all_to_all":
        return size - _own_bytes(name, args, pg)
    if op == "broadcast":
        return size if rank == root else 0
    if op in ("reduce", "gather"):
        return 0 if rank == root else size
    if op == "scatter":
        return (world - 1) * size // world if rank == root else 0
    return ring_bytes(op, size, world)


class _Listener(TorchDispatchMode):
    """Records each communication op it sees into a :class:`Traffic`; runs every op unchanged."""

    def __init__(self, traffic: Traffic):
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = self._call(str(func.overloadpacket), args)
        if call is not None:
            self.traffic.calls.append(call)
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _call(name: str, args) -> Call | None:
        peer = root = None
        if name in _C10D:
            op, at, payload, where = _C10D[name]
            pg = _group(args[at])
            if op in ("send", "recv"):
                peer = int(args[where]) if where is not None else -1
            elif where is not None:
                root = int(args[where])
        elif name in _FUNCTIONAL:
            op, payload = _FUNCTIONAL[name]
            pg = _group(args[-1])
            root = int(args[1]) if op == "broadcast" else None
        else:
            return None
        size = payload(args)
        if op == "scatter":  # one part per rank: the output's bytes, the root's to keep
            size *= pg.size()
        sent = _sent(op, size, name, args, pg, root)
        return Call(op, int(size), int(sent), pg.size(), tuple(dist.get_process_group_ranks(pg)),
                    peer, root)


@contextlib.contextmanager
def count_traffic():
    """Count every communication call made inside the block, on this rank.

    Example (inside a worker, ``labkit.launch(fn, nproc=2)``)::

        >>> with count_traffic() as t:
        ...     out = torch.empty(2 * 4)
        ...     dist.all_gather_into_tensor(out, torch.ones(4))
        >>> t.counts(), t.sent_bytes()
        ({'all_gather': 1}, 16)
    """
    traffic = Traffic()
    with _Listener(traffic):
        yield traffic


# ---- one training step, counted (a worker function) ------------------------------------------


def step_traffic(model_fn, *, wrap: str = "ddp", batch: int = 8, seed: int = 0) -> dict:
    """Worker function: the bytes this rank sends in one training step under DDP or FSDP2.

    ``model_fn()`` builds the model (e.g. ``functools.partial(mlp_blocks, 4, 64)``); ``wrap``
    is ``"ddp"`` (``DistributedDataParallel``) or ``"fsdp"`` (``fully_shard`` on every child
    with parameters, then the root). One forward, backward and Adam step on a random batch
    runs inside :func:`labkit.parallel.traffic.count_traffic`. Returns ``n_params``,
    ``world_size``, ``sent_bytes`` and the ``counts`` and ``by_op`` of the calls: what
    ``labkit.planner.plan(...).comm["dp"]`` predicts for ``zero=0`` and ``zero=3`` (the
    planner is arithmetic and never measures: this is its measured side).

    Example::

        >>> r = labkit.launch(step_traffic, partial(mlp_blocks, 4, 64), nproc=2).values[0]
        >>> r["counts"], r["sent_bytes"]
        ({'all_reduce': 1}, 529408)
    """
    if wrap not in ("ddp", "fsdp"):
        raise ValueError(f"wrap={wrap!r}: use 'ddp' (DistributedDataParallel) or 'fsdp' "
                         f"(FSDP2's fully_shard)")
    device = collective_device()
    torch.manual_seed(seed)
    model = model_fn().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # A random batch shaped for the first Linear: the bytes depend on the weights, not the data.
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randn(batch, first.in_features, device=device)
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        # One FSDP unit per child with weights, then the root: each unit's parameters are
        # all-gathered before it runs and its gradients reduce-scattered after its backward.
        for layer in model.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # DDP broadcast the weights when it wrapped the model: outside the block, not a step's bytes.
    with count_traffic() as t:
        model(x).square().mean().backward()
        opt.step()
    return {"wrap": wrap, "n_params": n_params, "world_size": dist.get_world_size(),
            "sent_bytes": t.sent_bytes(), "counts": t.counts(), "by_op": t.by_op()}

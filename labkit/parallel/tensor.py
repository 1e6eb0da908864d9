"""Tensor parallelism the Megatron-LM way, written to be read, then the same with DTensor.

A linear layer ``y = x W^T + b`` splits two ways over ``tp`` ranks:

- column parallel: each rank holds ``out_features / tp`` rows of ``W`` (output features) and
  computes its slice of ``y``; the input must be the same on every rank.
- row parallel: each rank holds ``in_features / tp`` columns of ``W`` (input features), takes
  its slice of ``x`` and computes a *partial* ``y``; the partials are summed (all-reduce).

Megatron's MLP puts a column layer first and a row layer second: the column layer's output
slice is exactly the row layer's input slice, and GeLU is elementwise, so nothing is
communicated between the two GEMMs. One all-reduce in forward (``g``, after the row layer) and
one in backward (``f``, the input's gradient before the column layer) is the whole cost.

Inside a worker (``labkit.launch(tp_check, nproc=2)``) everything runs over the default process
group; the classes also accept ``group=`` (a TP group of a larger job). :func:`tp_check`
compares both implementations with the dense MLP and counts their collectives.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit._dist import collective_device
from labkit._sizes import divisors, multiples_near, whole

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "split_to_tp",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "dense_mlp", "tp_mlp",
           "check_split", "dtensor_mlp", "count_collectives", "tp_check"]


# ---- the communication: four autograd functions, two conjugate pairs ------------------------


def _group_size(group) -> int:
    """Ranks in ``group``; 1 without a process group (then every collective is the identity)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _all_reduce(x, group):
    x = x.contiguous().clone()  # all_reduce works in place: never on a tensor autograd holds
    dist.all_reduce(x, group=group)
    return x


def _gather(t, dim, group=None):
    """Every rank's ``t`` concatenated along ``dim``, in rank order."""
    parts = [torch.empty_like(t) for _ in range(_group_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _my_slice_last_dim(x, group):
    n = _group_size(group)
    return x.chunk(n, dim=-1)[dist.get_rank(group)].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # Every rank used the same x with its own slice of W: dL/dx is the SUM of the ranks'
        # contributions, so the gradient that leaves this layer must be all-reduced.
        if _group_size(ctx.group) == 1:
            return grad, None
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce forward, identity backward (``f``'s conjugate)."""

    @staticmethod
    def forward(ctx, x, group):
        if _group_size(group) == 1:
            return x.view_as(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        # y = sum over ranks of partial_r, so dL/dpartial_r = dL/dy: the gradient, already the
        # same on every rank, passes through unchanged.
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x) if _group_size(group) == 1 else _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        if _group_size(ctx.group) == 1:
            return grad, None
        return _my_slice_last_dim(grad, ctx.group), None


class _SplitToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x) if _group_size(group) == 1 else _my_slice_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        if _group_size(ctx.group) == 1:
            return grad, None
        return _gather(grad, -1, ctx.group), None


def copy_to_tp(x, group=None):
    """Megatron's ``f``: ``x`` unchanged forward; its gradient all-reduced over ``group`` backward.

    Put it where a replicated activation enters a column-parallel layer.

    Example::

        >>> y = copy_to_tp(x)          # inside a worker: y equals x on every rank
        >>> y.sum().backward()         # x.grad is the sum of every rank's gradient
    """
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    """Megatron's ``g``: the sum of ``x`` over ``group`` forward; the gradient unchanged backward.

    Put it where a row-parallel layer's partial outputs become one activation.

    Example::

        >>> reduce_from_tp(torch.ones(2) * (dist.get_rank() + 1))   # on 2 ranks
        tensor([3., 3.])
    """
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group=None):
    """Concatenate every rank's ``x`` along the last dimension (backward: this rank's slice).

    Example::

        >>> gather_from_tp(torch.full((1, 2), dist.get_rank()))   # on 2 ranks
        tensor([[0, 0, 1, 1]])
    """
    return _GatherFromTP.apply(x, group)


def split_to_tp(x, group=None):
    """This rank's slice of ``x``'s last dimension (backward: the gradients all-gathered).

    Example::

        >>> split_to_tp(torch.arange(4.0))   # rank 1 of 2
        tensor([2., 3.])
    """
    return _SplitToTP.apply(x, group)


# ---- the layers ------------------------------------------------------------------------------


def check_split(n: int, tp: int, what: str = "out_features") -> int:
    """``n // tp``, or a ValueError that says which sizes and TP degrees would work.

    Example::

        >>> check_split(1000, 4, "hidden size")
        250
        >>> check_split(1000, 3, "hidden size")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ValueError: hidden size 1000 does not split over 3 ranks: use a multiple of 3 (e.g. 999
        or 1002), or a TP degree that divides 1000 (e.g. 2, 4, 5, 8)
    """
    if n % tp == 0:
        return n // tp
    hint = f"use a multiple of {tp} (e.g. {multiples_near(n, tp)})"
    if divisors(n, proper=True):
        hint += (f", or a TP degree that divides {n} "
                 f"(e.g. {', '.join(map(str, divisors(n, 4, proper=True)))})")
    raise ValueError(f"{what} {n} does not split over {tp} ranks: {hint}")


def _degree_and_rank(tp, group) -> tuple[int, int]:
    """The TP degree and this rank's index in it; rank 0's slice when there is no group."""
    if dist.is_available() and dist.is_initialized():
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if tp is not None and tp != size:
            ranks = f"{size} rank{'s' * (size != 1)}"
            raise ValueError(f"tp={tp} but the process group has {ranks}: leave tp=None, or "
                             f"pass group= a group of {tp} ranks (dist.new_group)")
        return size, rank
    if tp is None:
        return 1, 0
    # no process group: build rank 0's slice, e.g. to look at the shapes
    return whole(tp, "tp", hint=" (ranks that share a layer)"), 0


def _check_group(layer):
    if layer.tp > 1 and _group_size(layer.group) != layer.tp:
        raise RuntimeError(f"{type(layer).__name__} holds 1/{layer.tp} of the weights: run it "
                           f"in a worker with {layer.tp} ranks, e.g. "
                           f"labkit.launch(fn, nproc={layer.tp})")


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with its output features split over ``tp`` ranks (Megatron's column split).

    Rank ``r`` holds rows ``r * out/tp ... (r+1) * out/tp`` of the weight and of the bias, takes
    the full input (the same on every rank) and returns its slice of the output, or the whole
    output with ``gather_output=True``. With one seed on every rank, the slices are those of
    ``nn.Linear(in_features, out_features)`` built with that seed (the full layer is drawn, then
    sliced, as Megatron's CPU initialisation does).

    Example::

        >>> fc = ColumnParallelLinear(16, 32)     # inside a worker with 2 ranks
        >>> fc.weight.shape, fc(torch.randn(4, 16)).shape
        (torch.Size([16, 16]), torch.Size([4, 16]))
    """

    def __init__(self, in_features, out_features, *, bias=True, tp=None, group=None,
                 gather_output=False, device=None, dtype=None):
        super().__init__()
        self.tp, self.rank = _degree_and_rank(tp, group)
        # part = out_features / tp: the output features (weight rows) this rank computes.
        self.part = check_split(out_features, self.tp, "out_features")
        self.group, self.gather_output = group, gather_output
        self.in_features, self.out_features = in_features, out_features
        # Draw the whole dense layer, then keep a slice: with one seed on every rank the
        # slices fit together into exactly the nn.Linear a single process would build.
        self._take_slices(nn.Linear(in_features, out_features, bias=bias, device=device,
                                    dtype=dtype))

    def _take_slices(self, dense):
        # nn.Linear's weight is (out, in): a column split of W^T is a row split of weight.
        # Rank r keeps rows [r * part, (r + 1) * part) of the weight, (part, in), and the same
        # slice of the bias: each output feature's bias lives with the rank computing it.
        rows = slice(self.rank * self.part, (self.rank + 1) * self.part)
        self.weight = nn.Parameter(dense.weight.detach()[rows].clone())
        bias = None if dense.bias is None else nn.Parameter(dense.bias.detach()[rows].clone())
        self.register_parameter("bias", bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, *, tp=None, gather_output=False):
        """This rank's slice of a dense ``nn.Linear`` (copied; same device and dtype)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, tp=tp,
                    group=group, gather_output=gather_output, device="meta")
        layer._take_slices(linear)
        return layer

    def forward(self, x):
        _check_group(self)
        # x: (..., in_features), the same full input on every rank.
        x = copy_to_tp(x, self.group)            # f: identity now, all-reduce of dL/dx later
        y = F.linear(x, self.weight, self.bias)  # (..., out/tp): this rank's output features
        # Usually the slice goes straight into a RowParallelLinear (no communication here);
        # gather_output all-gathers the slices into the full (..., out_features) on every rank.
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.part} on rank {self.rank} of {self.tp}), bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with its input features split over ``tp`` ranks (Megatron's row split).

    Rank ``r`` holds columns ``r * in/tp ... (r+1) * in/tp`` of the weight and the whole bias.
    Its input is its slice of the features (``input_is_parallel=True``, what a column layer
    hands over) or the full input, which it slices. The partial products are all-reduced, and
    the bias is added after the reduce: added before, it would be counted ``tp`` times.

    Example::

        >>> fc = RowParallelLinear(32, 8)         # inside a worker with 2 ranks
        >>> fc.weight.shape, fc(torch.randn(4, 16)).shape
        (torch.Size([8, 16]), torch.Size([4, 8]))
    """

    def __init__(self, in_features, out_features, *, bias=True, tp=None, group=None,
                 input_is_parallel=True, device=None, dtype=None):
        super().__init__()
        self.tp, self.rank = _degree_and_rank(tp, group)
        # part = in_features / tp: the input features (weight columns) this rank multiplies.
        self.part = check_split(in_features, self.tp, "in_features")
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        self._take_slices(nn.Linear(in_features, out_features, bias=bias, device=device,
                                    dtype=dtype))

    def _take_slices(self, dense):
        # Rank r keeps columns [r * part, (r + 1) * part) of the (out, in) weight: (out, part).
        # The bias is not split: every rank holds all of it and adds it once, after the sum.
        cols = slice(self.rank * self.part, (self.rank + 1) * self.part)
        self.weight = nn.Parameter(dense.weight.detach()[:, cols].clone())
        bias = None if dense.bias is None else nn.Parameter(dense.bias.detach().clone())
        self.register_parameter("bias", bias)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, *, tp=None, input_is_parallel=True):
        """This rank's slice of a dense ``nn.Linear`` (copied; same device and dtype)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, tp=tp,
                    group=group, input_is_parallel=input_is_parallel, device="meta")
        layer._take_slices(linear)
        return layer

    def forward(self, x):
        _check_group(self)
        # x: (..., in/tp), this rank's slice of the features, as a column layer hands it over;
        # a full (..., in_features) input is sliced here (its gradient all-gathered back).
        if not self.input_is_parallel:
            x = split_to_tp(x, self.group)
        # (..., out_features) on every rank, but each holds only a partial sum: its in/tp
        # features' contribution to every output.
        partial = F.linear(x, self.weight)       # this rank's share of every output
        y = reduce_from_tp(partial, self.group)  # g: the sum over ranks, the dense x W^T
        return y if self.bias is None else y + self.bias

    def extra_repr(self):
        return (f"in_features={self.in_features} ({self.part} on rank {self.rank} of {self.tp}), "
                f"out_features={self.out_features}, bias={self.bias is not None}")


# ---- the Megatron MLP ------------------------------------------------------------------------


def dense_mlp(in_features: int, hidden: int, out_features: int) -> nn.Sequential:
    """The reference: ``Linear(in, hidden) -> GELU -> Linear(hidden, out)``, on one device.

    Example::

        >>> torch.manual_seed(0); dense = dense_mlp(16, 64, 16)
    """
    return nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, out_features))


def _check_mlp(mlp):
    ok = (isinstance(mlp, nn.Sequential) and len(mlp) == 3 and isinstance(mlp[0], nn.Linear)
          and isinstance(mlp[2], nn.Linear) and mlp[0].out_features == mlp[2].in_features)
    if not ok:
        raise ValueError("expected nn.Sequential(nn.Linear(in, hidden), <elementwise activation>, "
                         f"nn.Linear(hidden, out)), e.g. dense_mlp(16, 64, 16); got {mlp!r}")


class ParallelMLP(nn.Module):
    """Megatron's MLP: column-parallel ``Linear``, GeLU, row-parallel ``Linear``.

    The activation must be elementwise (GeLU, ReLU): each rank applies it to its own slice of
    the hidden features, so nothing moves between the two GEMMs. One all-reduce forward (after
    the second layer) and one backward (the input's gradient, so only when the input requires
    grad: the first layer of a model skips it) is all it communicates.

    Example::

        >>> torch.manual_seed(0); mlp = ParallelMLP(16, 64, 16)   # inside a worker
        >>> torch.manual_seed(0); dense = dense_mlp(16, 64, 16)   # the same numbers, unsplit
    """

    def __init__(self, in_features, hidden, out_features, *, activation=None, bias=True,
                 tp=None, group=None, device=None, dtype=None):
        super().__init__()
        tp, _ = _degree_and_rank(tp, group)
        check_split(hidden, tp, "hidden size")
        kw = dict(bias=bias, tp=tp, group=group, device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(in_features, hidden, **kw)
        self.act = nn.GELU() if activation is None else activation
        self.fc2 = RowParallelLinear(hidden, out_features, **kw)

    @classmethod
    def from_dense(cls, mlp: nn.Sequential, group=None, *, tp=None):
        """This rank's share of a dense ``Linear -> activation -> Linear`` (copied)."""
        _check_mlp(mlp)
        first, act, second = mlp
        layer = cls(first.in_features, first.out_features, second.out_features,
                    activation=copy.deepcopy(act), tp=tp, group=group, device="meta")
        layer.fc1 = ColumnParallelLinear.from_dense(first, group, tp=tp)
        layer.fc2 = RowParallelLinear.from_dense(second, group, tp=tp)
        return layer

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def tp_mlp(dense: nn.Sequential, group=None, *, tp=None) -> ParallelMLP:
    """The hand-written tensor-parallel copy of ``dense`` (see :class:`ParallelMLP`).

    Example::

        >>> mlp = tp_mlp(dense_mlp(16, 64, 16))   # inside a worker: this rank's half
    """
    return ParallelMLP.from_dense(dense, group, tp=tp)


def dtensor_mlp(dense: nn.Sequential, mesh=None) -> nn.Module:
    """The same MLP parallelised by PyTorch: ``parallelize_module`` with Colwise / Rowwise.

    A copy of ``dense`` is sharded over a 1-D ``mesh`` (default: every rank, on the device the
    backend uses). Its weights become DTensors; inputs and outputs stay plain tensors. The
    hidden size must split evenly, as for :class:`ParallelMLP` (DTensor's sharding
    propagation fails inside the second layer otherwise, so it is refused up front).

    Example::

        >>> model = dtensor_mlp(dense_mlp(16, 64, 16))   # inside a worker
        >>> model[0].weight.placements
        (Shard(dim=0),)
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _check_mlp(dense)
    if mesh is None:
        mesh = init_device_mesh(collective_device().type, (dist.get_world_size(),))
    check_split(dense[0].out_features, mesh.size(), "hidden size")
    model = copy.deepcopy(dense).to(mesh.device_type)
    # Children of an nn.Sequential are named "0", "1", "2". Colwise shards weight rows
    # (Shard(0)) and expects a replicated input; Rowwise shards columns (Shard(1)) and
    # all-reduces its Partial output back to Replicate.
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


# ---- counting and checking -------------------------------------------------------------------

_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "all_gather_into_tensor":
          "all_gather", "allgather_into_tensor_coalesced": "all_gather", "allgather_coalesced":
          "all_gather", "allgather_base": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
          "reduce_scatter_base": "reduce_scatter", "reduce_scatter_tensor_coalesced":
          "reduce_scatter", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
          "all_to_all_single": "all_to_all", "allreduce_coalesced": "all_reduce",
          "all_reduce_coalesced": "all_reduce"}


def _collective_name(op) -> str:
    """``c10d.allreduce_`` and ``c10d_functional.all_reduce`` are both "all_reduce"."""
    name = str(op).split(".")[-1].strip("_")
    return _NAMES.get(name, name)


def count_collectives(fn, *args, **kwargs) -> dict[str, int]:
    """Run ``fn(*args, **kwargs)``; return ``{collective: count}``, e.g. ``{"all_reduce": 1}``.

    Uses ``torch.distributed.tensor.debug.CommDebugMode``, a dispatch mode that sees every op.
    DTensor issues functional collectives (``c10d_functional.all_reduce``); the hand-written
    layers call ``dist.all_reduce``, which reaches the dispatcher as ``c10d.allreduce_``.
    CommDebugMode counts both, so one counter serves both implementations. Count the forward
    and the backward separately to see where each collective happens.

    Example::

        >>> x = torch.randn(8, 16, requires_grad=True)   # else no input gradient to sum
        >>> outs = []
        >>> count_collectives(lambda: outs.append(mlp(x)))       # forward
        {'all_reduce': 1}
        >>> count_collectives(lambda: outs[0].sum().backward())  # backward
        {'all_reduce': 1}
    """
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        fn(*args, **kwargs)
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        counts[_collective_name(op)] = counts.get(_collective_name(op), 0) + n
    return counts


def _forward_backward(model, x):
    """Output, input gradient and collective counts of one forward and one backward."""
    x = x.detach().clone().requires_grad_()  # a fresh leaf: its gradient is the f all-reduce
    outs = []
    forward = count_collectives(lambda: outs.append(model(x)))
    backward = count_collectives(lambda: (outs[0].square().sum() / 2).backward())
    return outs[0].detach(), x.grad, {"forward": forward, "backward": backward}


def tp_check(batch: int = 8, in_f: int = 16, hidden: int = 64, out_f: int = 16,
             seed: int = 0) -> dict:
    """Worker function: the hand-written and the DTensor MLP against the dense one.

    Every rank builds the same dense MLP and batch (one seed), then both TP versions over all
    ranks. Returns the largest absolute differences from the dense MLP of the output, the
    input's gradient and each weight's gradient (TP slices gathered first), and the
    collectives of one forward and one backward of each version.

    Example::

        >>> r = labkit.launch(tp_check, nproc=2).values[0]
        >>> r["megatron"]["collectives"]
        {'forward': {'all_reduce': 1}, 'backward': {'all_reduce': 1}}
    """
    device = collective_device()
    torch.manual_seed(seed)
    dense = dense_mlp(in_f, hidden, out_f).to(device)
    x = torch.randn(batch, in_f, device=device)  # every rank sees the same batch
    y, x_grad, _ = _forward_backward(dense, x)
    grads = {name: p.grad for name, p in dense.named_parameters()}

    def diffs(out, in_grad, model_grads):
        worst = lambda a, b: (a.float() - b.float()).abs().max().item()  # noqa: E731
        return {"output": worst(out, y), "input_grad": worst(in_grad, x_grad),
                "grads": {k: worst(model_grads[k], grads[k]) for k in grads}}

    mega = tp_mlp(dense)
    out, in_grad, counts = _forward_backward(mega, x)
    # Gather the slices back: fc1 was split by output rows, fc2 by input columns.
    mega_grads = {"0.weight": _gather(mega.fc1.weight.grad, 0),
                  "0.bias": _gather(mega.fc1.bias.grad, 0),
                  "2.weight": _gather(mega.fc2.weight.grad, 1),
                  "2.bias": mega.fc2.bias.grad}  # the bias is whole on every rank
    result = {"rank": dist.get_rank(), "tp": mega.fc1.tp,
              "megatron": {**diffs(out, in_grad, mega_grads), "collectives": counts}}

    model = dtensor_mlp(dense)
    out, in_grad, counts = _forward_backward(model, x)
    dt_grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    result["dtensor"] = {**diffs(out, in_grad, dt_grads), "collectives": counts}
    return result

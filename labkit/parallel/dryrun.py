"""A full-scale dry run: the real layers, sharded over a thousand ranks, in one process.

The planner (:mod:`labkit.planner`) predicts the bytes each device holds from formulas. This
module measures them without a cluster: it builds the model on PyTorch's ``meta`` device
(shapes and dtypes, no storage), opens a *fake* process group of ``dp * tp`` ranks in this one
process (torch's ``fake`` backend with ``FakeStore``: every collective returns at once and moves
nothing), lays a ``(dp, tp)`` ``DeviceMesh`` over it, applies Megatron tensor parallelism on
``tp`` (``parallelize_module``) and FSDP2 (``fully_shard``) on ``dp``, exactly as a real run
would, and reads the bytes one rank holds from its DTensors' local shards (``to_local()``).
Adam's state is materialised on meta too (one ``step()`` on zero gradients), so parameters,
gradients and optimizer state are all read, not computed.

What it cannot see: what exists only while a step runs (activations, FSDP2's gathered layers
and its communication buffers), and the memory allocator. Those stay the planner's business.

Example (a 2-billion-parameter stack of :class:`~labkit.parallel.transformer.Block` s on a
128 x 8 mesh, a few seconds)::

    >>> from labkit.parallel import dryrun, transformer
    >>> r = dryrun.dry_run(lambda: transformer.block_stack(40, 2048, 16, seed=None), dp=128, tp=8)
    >>> r["world"], r["params"]
    (1024, 7881920)

Point it at your own model: ``build`` is any function returning an ``nn.Module`` (it runs
under ``torch.device("meta")``), ``tp_plan`` says which ``nn.Linear`` s are column- or
row-parallel (``{"*.wq": "colwise", "*.wo": "rowwise"}``, names matched with ``fnmatch``), and
``units`` which submodules FSDP2 shards one by one (the transformer blocks).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import time

import torch
from torch import nn

from labkit._sizes import whole

__all__ = ["DryRunError", "BLOCK_TP_PLAN", "dry_run", "fake_world"]

# Megatron's split of labkit's transformer Block: QKV (laid out head by head) and fc1 by output
# features, proj and fc2 by input features, so each pair needs one all-reduce forward.
BLOCK_TP_PLAN = {"*qkv": "colwise", "*proj": "rowwise", "*fc1": "colwise", "*fc2": "rowwise"}
MAX_WORLD = 65_536


class DryRunError(ValueError):
    """A layout or a model the dry run cannot shard; the message says what to change."""


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """A fake default process group of ``world`` ranks in this process, destroyed on exit.

    Refuses to run inside a process that already has a process group (a worker): the fake one
    would replace it. Collectives on the fake group return at once and move no data.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise DryRunError(f"a process group is already running in this process (rank "
                          f"{dist.get_rank()} of {dist.get_world_size()}): run the dry run in "
                          f"the notebook's kernel or a plain Python process, not inside a launch")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _check_layout(dp, tp, rank) -> int:
    dp = whole(dp, "dp", hint=" (data-parallel / FSDP ranks)")
    tp = whole(tp, "tp", hint=" (tensor-parallel ranks)")
    world = dp * tp
    if world > MAX_WORLD:
        raise DryRunError(f"dp * tp = {world} ranks: the dry run goes up to {MAX_WORLD}; "
                          f"a rank's bytes depend on the layout, not on how many replicas it has, "
                          f"so try a smaller dp with the same tp")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise DryRunError(f"rank={rank!r} is not one of the {world} ranks: give 0 ... {world - 1}")
    return world


def _build_on_meta(build, dtype) -> nn.Module:
    """``build()`` under ``torch.device("meta")``, or a DryRunError saying why it cannot be."""
    try:
        with torch.device("meta"):
            model = build()
    except Exception as e:  # the user's constructor: any failure is reported the same way
        raise DryRunError(f"the model could not be built on the meta device ({type(e).__name__}: "
                          f"{e}). A meta tensor has a shape but no data: the constructor must not "
                          f"read values (.item(), loading weights, data-dependent sizes); build "
                          f"the bare model there and load weights later") from e
    if not isinstance(model, nn.Module):
        raise DryRunError(f"build() returned a {type(model).__name__}, not an nn.Module: pass a "
                          f"function that returns the model, e.g. lambda: MyModel(config)")
    off_meta = [n for n, p in model.named_parameters() if p.device.type != "meta"]
    if off_meta:
        raise DryRunError(f"{len(off_meta)} parameter(s) were created off the meta device (first: "
                          f"{off_meta[0]!r}): the constructor passes device= explicitly; drop it, "
                          f"or let it default, so that the dry run allocates nothing")
    if not any(True for _ in model.parameters()):
        raise DryRunError("the model has no parameters: nothing to shard")
    return model.to(dtype) if dtype is not None else model


def _tp_targets(model: nn.Module, tp_plan: dict, tp: int) -> dict:
    """``{module name: "colwise" | "rowwise"}`` for the Linears the plan matches, checked."""
    targets = {}
    for name, module in model.named_modules():
        style = next((s for pat, s in tp_plan.items() if fnmatch.fnmatchcase(name, pat)), None)
        if style is None or not name:
            continue
        if style not in ("colwise", "rowwise"):
            raise DryRunError(f"tp_plan[{name!r}] = {style!r}: use 'colwise' or 'rowwise'")
        if not isinstance(module, nn.Linear):
            raise DryRunError(f"tp_plan matches {name!r}, a {type(module).__name__}: only "
                              f"nn.Linear layers are split here; narrow the pattern")
        features = module.out_features if style == "colwise" else module.in_features
        if features % tp:
            side = "output" if style == "colwise" else "input"
            raise DryRunError(f"{name} has {features} {side} features, which do not split over "
                              f"tp={tp} ranks: use a tp that divides {features} (e.g. "
                              f"{', '.join(str(d) for d in _divisors(features)[:6])})")
        targets[name] = style
    if tp > 1 and not targets:
        raise DryRunError(f"tp={tp} but tp_plan matches no nn.Linear of this model: give "
                          f"tp_plan={{'<name pattern>': 'colwise' | 'rowwise'}} or tp=1")
    return targets


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, min(n, 64) + 1) if n % d == 0]


def _check_heads(model: nn.Module, tp: int) -> None:
    """Column-parallel QKV gives each rank whole heads only if tp divides the heads."""
    from labkit.parallel.transformer import Block

    for name, module in model.named_modules():
        if isinstance(module, Block) and module.heads % tp:
            raise DryRunError(f"{name or 'the block'} has {module.heads} heads, which do not split "
                              f"over tp={tp} ranks: each rank needs whole heads; use a tp that "
                              f"divides {module.heads}")


def _default_units(model: nn.Module) -> list[str]:
    """FSDP2's units: every transformer Block, else the children of a Sequential / ModuleList."""
    from labkit.parallel.transformer import Block

    blocks = [n for n, m in model.named_modules() if isinstance(m, Block) and n]
    if blocks:
        return blocks
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    return []


def _shard(model: nn.Module, mesh, targets: dict, units: list[str]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # TP first, then FSDP2 on the dp sub-mesh: FSDP2 shards the (already TP-sharded) DTensors.
    if targets:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, mesh["tp"], {n: styles[s]() for n, s in targets.items()})
    modules = dict(model.named_modules())
    for name in units:
        if name not in modules:
            raise DryRunError(f"units names {name!r}, which is not a submodule of this model "
                              f"(e.g. {', '.join(list(modules)[1:4])})")
        fully_shard(modules[name], mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _padding(p, dp: int, tp: int) -> int:
    """Elements FSDP2 allocates beyond this rank's shard: it pads dim 0 to a multiple of dp."""
    from torch.distributed.tensor import Shard

    shape = list(p.shape)
    names = p.device_mesh.mesh_dim_names or ()
    tp_place = p.placements[names.index("tp")] if "tp" in names else None
    if isinstance(tp_place, Shard):
        shape[tp_place.dim] //= tp
    row = math.prod(shape[1:])
    return math.ceil(shape[0] / dp) * row - _local(p).numel() if shape else 0


def _tp_replicated(p) -> bool:
    """True when tp leaves ``p`` whole: not on the tp mesh at all (FSDP2 alone: a LayerNorm),
    or replicated on it (a row-parallel layer's bias, added once after the all-reduce)."""
    from torch.distributed.tensor import Replicate

    names = p.device_mesh.mesh_dim_names or ()
    return "tp" not in names or isinstance(p.placements[names.index("tp")], Replicate)


def dry_run(build, dp: int, tp: int = 1, *, rank: int = 0, tp_plan: dict | None = None,
            units: list[str] | None = None, optimizer: bool = True,
            dtype: torch.dtype | None = None) -> dict:
    """Bytes one rank holds when ``build()``'s model is sharded FSDP2 x TP over ``dp x tp`` ranks.

    ``build``: a function returning the model (it runs under ``torch.device("meta")``: nothing
    is allocated). ``tp_plan``: ``{name pattern: "colwise" | "rowwise"}`` for the ``nn.Linear``
    s to split over ``tp`` (default :data:`BLOCK_TP_PLAN`, labkit's transformer blocks).
    ``units``: the submodules FSDP2 shards one by one (default: every transformer block, or the
    children of a Sequential). ``optimizer``: materialise Adam's two moments (one ``step()`` on
    zero gradients, on meta). ``dtype``: cast the parameters first (e.g. ``torch.bfloat16``).

    Returns, for rank ``rank`` (mesh coordinates ``(rank // tp, rank % tp)``): ``params``,
    ``grads``, ``optimizer`` bytes read from the local shards (gradients are given the
    parameters' sharding, as FSDP2's reduce-scatter leaves them; Adam's scalar ``step``
    counters are left out), their ``total``, ``padding`` (FSDP2's pad of uneven shards, on
    parameters and gradients), ``replicated_over_tp`` (parameter bytes this rank's tp
    neighbours hold too: LayerNorms, row-parallel biases), ``n_params`` (the whole model's
    count), ``n_tp_split`` (how many of them tp splits) and the seconds it took.
    """
    world = _check_layout(dp, tp, rank)
    if isinstance(build, nn.Module) or not callable(build):
        raise DryRunError(f"build must be a function that returns the model, not a "
                          f"{type(build).__name__} (a built model already holds its weights): "
                          f"e.g. lambda: MyModel(config)")
    start = time.perf_counter()
    model = _build_on_meta(build, dtype)
    plan = BLOCK_TP_PLAN if tp_plan is None else tp_plan
    targets = _tp_targets(model, plan, tp) if tp > 1 else {}
    if tp > 1:
        _check_heads(model, tp)
    n_params = sum(p.numel() for p in model.parameters())
    split = {f"{n}.{k}" for n in targets for k in ("weight", "bias")
             if not (targets[n] == "rowwise" and k == "bias")}
    n_tp_split = sum(p.numel() for n, p in model.named_parameters() if n in split)

    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(world, rank):
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        model = _shard(model, mesh, targets, _default_units(model) if units is None else units)
        params = list(model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        states = []
        if optimizer:
            opt = torch.optim.Adam(params, lr=1e-3)
            opt.step()
            states = [v for p in params for k, v in opt.state[p].items() if k != "step"]
        held = {"params": sum(_nbytes(p) for p in params),
                "grads": sum(_nbytes(p.grad) for p in params),
                "optimizer": sum(_nbytes(v) for v in states)}
        held["total"] = held["params"] + held["grads"] + held["optimizer"]
        held["padding"] = 2 * sum(_padding(p, dp, tp) * p.element_size() for p in params)
        held["replicated_over_tp"] = (sum(_nbytes(p) for p in params if _tp_replicated(p))
                                      if tp > 1 else 0)
    return {"world": world, "mesh": (dp, tp), "rank": rank, "coords": (rank // tp, rank % tp),
            **held, "n_params": n_params, "n_tp_split": n_tp_split,
            "seconds": time.perf_counter() - start}

"""Two parallelisms at once on a 2-D DeviceMesh: FSDP2 x tensor parallel, and data x pipeline.

A ``DeviceMesh`` lays the job's ranks out as a grid; each dimension is one parallelism and each
line of the grid is one process group. ``mesh_2d(2, 2)`` on 4 ranks::

               tp=0  tp=1
        dp=0 [  0     1  ]   <- a tp group: ranks 0, 1 (adjacent)
        dp=1 [  2     3  ]
                ^ a dp group: ranks 0, 2

Rank ``r`` sits at ``(r // tp, r % tp)``. The inner dimension's ranks are adjacent, and
launchers number ranks node by node, so they share a node: put there the parallelism that
talks most and cannot hide it, tensor parallelism (an all-reduce of activations in every
layer, forward and backward, on the critical path) on NVLink. Data parallelism / FSDP (once
per layer per step, overlapped with compute) goes outermost, across nodes; pipeline
parallelism (point-to-point activations between neighbours) in between.

- :func:`mesh_2d`, :func:`check_mesh`, :func:`mesh_groups`: the mesh and which ranks form which
  groups;
- :func:`fsdp_tp_model`, :func:`fsdp_tp_step` (a worker function), with their formulas
  :func:`fsdp_tp_bytes` and :func:`fsdp_tp_traffic`;
- :func:`dp_pp_step` (a worker function) and its formula :func:`dp_pp_traffic`;
- `memory.held_bytes`: what a rank holds, counted from the local shards.

Each step is checked against the same step in one process on the whole batch, and every byte
it holds or sends against its formula.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import warnings
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._dist import collective_device
from .._sizes import divisors, multiples_near, whole
from . import traffic
from .memory import held_bytes, mlp_blocks
from .pipeline import split_stages, stage_builder

__all__ = ["check_mesh", "mesh_groups", "mesh_2d", "held_bytes", "fsdp_tp_model",
           "fsdp_tp_bytes", "fsdp_tp_traffic", "fsdp_tp_step", "dp_pp_traffic", "dp_pp_step"]

OPTIMIZERS = ("adam", "sgd")


# ---- the mesh --------------------------------------------------------------------------------


def check_mesh(dp: int, inner: int, world_size: int, names=("dp", "tp")) -> tuple[int, int]:
    """``(dp, inner)`` if the grid has exactly ``world_size`` ranks; else a ValueError with shapes.

    Example::

        >>> check_mesh(2, 2, 4)
        (2, 2)
        >>> check_mesh(2, 3, 4)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ValueError: a 2 x 3 (dp x tp) mesh needs 6 ranks but the job has 4: pick dp * tp = 4,
        e.g. (1, 4), (2, 2), (4, 1)
    """
    outer, in_name = names
    dp = whole(dp, outer, hint=" (the mesh's outer dimension)")
    inner = whole(inner, in_name, hint=" (the mesh's inner dimension)")
    world_size = whole(world_size, "world_size")
    if dp * inner != world_size:
        shapes = ", ".join(f"({d}, {world_size // d})" for d in divisors(world_size))
        raise ValueError(f"a {dp} x {inner} ({outer} x {in_name}) mesh needs {dp * inner} ranks "
                         f"but the job has {world_size}: pick {outer} * {in_name} = "
                         f"{world_size}, e.g. {shapes}")
    return dp, inner


def mesh_groups(dp: int, inner: int, names=("dp", "tp")) -> dict:
    """The ranks of a ``dp x inner`` mesh, and the groups along each dimension (no ranks needed).

    ``"grid"`` is the mesh row by row; ``names[1]`` lists the inner groups (the rows: adjacent
    ranks), ``names[0]`` the outer groups (the columns: ranks ``inner`` apart). It is the
    layout ``init_device_mesh`` builds, so the figure of a mesh can be drawn before a launch.

    Example::

        >>> mesh_groups(2, 2)
        {'grid': [[0, 1], [2, 3]], 'dp': [[0, 2], [1, 3]], 'tp': [[0, 1], [2, 3]]}
    """
    check_mesh(dp, inner, dp * inner, names)
    grid = [[row * inner + col for col in range(inner)] for row in range(dp)]
    return {"grid": grid, names[0]: [list(col) for col in zip(*grid, strict=True)],
            names[1]: [list(row) for row in grid]}


def mesh_2d(dp: int, tp: int, device_type: str | None = None, *, names=("dp", "tp")):
    """Inside a worker: a ``dp x tp`` DeviceMesh over every rank, its dimensions named ``names``.

    ``mesh["tp"]`` (``mesh[names[1]]``) is this rank's row, ``mesh["dp"]`` its column; each is
    a 1-D mesh whose ``get_group()`` is an ordinary process group. ``device_type`` defaults to
    what the backend needs (``"cuda"`` under NCCL, ``"cpu"`` under gloo).

    Example::

        >>> mesh = mesh_2d(2, 2)                     # inside labkit.launch(..., nproc=4)
        >>> dist.get_process_group_ranks(mesh["tp"].get_group())   # on rank 2
        [2, 3]
    """
    from torch.distributed.device_mesh import init_device_mesh

    device = collective_device()
    dp, tp = check_mesh(dp, tp, dist.get_world_size(), names)
    return init_device_mesh(device_type or device.type, (dp, tp), mesh_dim_names=tuple(names))


def _coords_and_groups(mesh) -> tuple[dict, dict]:
    """This rank's index along each mesh dimension, and the global ranks of each of its groups."""
    names = mesh.mesh_dim_names
    coords = {name: mesh[name].get_local_rank() for name in names}
    groups = {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in names}
    return coords, groups


def _wire_by_dimension(calls, groups: dict) -> dict:
    """``{"bytes": {dimension: {op: bytes sent}}, "calls": {dimension: {op: calls}}}``.

    A call belongs to the dimension whose group has exactly its ranks: on a 2 x 2 mesh the dp
    and tp groups have the same size, so the size alone could not tell them apart. A size-1
    dimension makes no calls (torch skips them) and has no entry.
    """
    out: dict = {"bytes": {}, "calls": {}}
    for call in calls:
        dim = next((n for n, ranks in groups.items() if tuple(ranks) == call.ranks), "other")
        sent, count = out["bytes"].setdefault(dim, {}), out["calls"].setdefault(dim, {})
        sent[call.op] = sent.get(call.op, 0) + call.sent_bytes
        count[call.op] = count.get(call.op, 0) + 1
    return out


# ---- shared by both steps --------------------------------------------------------------------


@contextlib.contextmanager
def _quiet():
    """Silence two notices that do not apply here (tested: the results equal the reference).

    FSDP2 warns that the model returns a view (an in-place op on it would skip a hook: none
    follows); DTensor, that gathering a 2-D sharded weight whole takes two all-gathers.
    """
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            yield
    finally:
        log.setLevel(level)


def _optimizer(params, name: str, lr: float):
    """Adam, or SGD with momentum 0.9: both keep state per parameter, sharded with it."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _check_optimizer(name: str) -> None:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")


def _example_data(batch: int, width: int, seed: int, device):
    """The global batch ``(x, y)``: the same on every rank for one seed."""
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(2, batch, width, generator=gen)
    return x.to(device), y.to(device)


def _reference_step(model, x, y, opt_name: str, lr: float) -> tuple[float, dict, float]:
    """One step of ``model`` in this process on the whole batch: its loss, updated weights, and
    the largest change of a weight (the comparisons' tolerance must be far below it)."""
    before = [p.detach().clone() for p in model.parameters()]
    opt = _optimizer(model.parameters(), opt_name, lr)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(model.parameters(), before,
                                                                    strict=True))
    return loss.item(), {name: p.detach() for name, p in model.named_parameters()}, moved


def _mean_over(value: float, group, device) -> float:
    """The mean of ``value`` over the ranks of ``group``."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def _split_batch(batch: int, parts: int, what: str) -> int:
    """``batch // parts``, or a ValueError that names batches that split."""
    if batch % parts:
        raise ValueError(f"a batch of {batch} does not split over {what}: use a multiple of "
                         f"{parts} (e.g. {multiples_near(batch, parts)})")
    return batch // parts


# ---- FSDP2 x tensor parallelism -------------------------------------------------------------


def fsdp_tp_model(model, mesh):
    """Shard a stack of MLP blocks two ways: Megatron TP over ``mesh["tp"]``, FSDP2 over ``"dp"``.

    The order matters. TP first: each block's first Linear becomes column-parallel, its second
    row-parallel, so the weights become DTensors sharded over the tp ranks. FSDP2 then shards
    each block's (already TP-sharded) parameters over the dp ranks, block by block, so a
    block's tp shard is gathered whole only around its own forward and backward. The root is
    wrapped last (it holds no parameters of its own: it starts and ends the step).

    Example::

        >>> model = fsdp_tp_model(mlp_blocks(2, 16), mesh_2d(2, 2))   # inside a worker
        >>> model[0][0].weight.placements
        (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model:  # block = Linear(w, 4w), GELU, Linear(4w, w): children "0", "1", "2"
        # TP over the mesh's tp dimension: on each tp rank fc1 keeps 4w/tp of its output
        # features, fc2 the same 4w/tp of its input features, so the GELU between them needs no
        # communication; fc2's partial sums are all-reduced over the tp group.
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        # FSDP2 over the dp dimension shards those TP shards again, by rows (dim 0): a rank
        # keeps about 1/(tp * dp) of each weight and all-gathers its block's tp shard over dp
        # just before the block runs (and frees it after).
        fully_shard(block, mesh=mesh["dp"])
    # The root: its own parameters (none here) and the hooks that start and end the step.
    return fully_shard(model, mesh=mesh["dp"])


def _dp_piece(rows: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Rows FSDP2 gives ``dp_rank`` of ``rows`` (``torch.chunk``'s split), and the padded length."""
    size = math.ceil(rows / dp)
    return max(0, min(size, rows - dp_rank * size)), size


def _tp_hidden(width: int, tp: int) -> int:
    """The hidden features of a block on one tp rank, ``4 * width / tp``, or a ValueError."""
    width, tp = whole(width, "width"), whole(tp, "tp", hint=" (tensor-parallel ranks)")
    if (4 * width) % tp:
        step = tp // math.gcd(4, tp)  # 4 * width splits over tp exactly for these widths
        lower = width - width % step
        widths = f"{lower} or {lower + step}" if lower else f"{step} or {2 * step}"
        tps = ", ".join(map(str, divisors(4 * width, 5, proper=True)))
        raise ValueError(f"the hidden size 4 * width = {4 * width} does not split over tp={tp} "
                         f"ranks: use a width that is a multiple of {step} (e.g. {widths}), or "
                         f"a tp that divides {4 * width} (e.g. {tps})")
    return 4 * width // tp


def _fsdp_tp_pieces(width: int, dp: int, tp: int, dp_rank: int) -> dict:
    """Per weight of a block: (rows held, padded rows, elements per row, replicated over tp)."""
    local = _tp_hidden(width, tp)
    layout = {"0.weight": (local, width, False),   # column-parallel: rows split over tp
              "0.bias": (local, 1, False),
              "2.weight": (width, local, False),   # row-parallel: columns split over tp
              "2.bias": (width, 1, True)}          # added after the all-reduce: whole on each
    return {name: (*_dp_piece(rows, dp, dp_rank), row, replicated)
            for name, (rows, row, replicated) in layout.items()}


def fsdp_tp_bytes(width: int, depth: int, dp: int, tp: int, *, dp_rank: int = 0,
                  optimizer: str = "sgd", dtype_bytes: int = 4) -> dict:
    """Bytes of parameters, gradients and optimizer state a rank holds under FSDP2 x TP.

    Per block ``Linear(w, 4w) -> GELU -> Linear(4w, w)`` (``8 w^2 + 5 w`` parameters), TP splits
    the two weights and the first bias over ``tp``, then FSDP2 splits every tp shard over
    ``dp``. The second bias is not split over tp (a row-parallel layer adds it once, after the
    all-reduce, so every tp rank holds all of it): FSDP2 alone shards it, ``w / dp`` each. When
    everything splits evenly a rank holds, per block::

        (8 w^2 + 4 w) / (dp * tp)  +  w / dp      parameters

    gradients the same, SGD's momentum one state of each (Adam two). Uneven pieces follow
    ``torch.chunk`` (the last dp ranks get fewer rows, ``dp_rank`` says which); FSDP2 pads
    parameters and gradients to the longest piece, counted in ``padding``. Adam's step
    counters are left out (see :func:`held_bytes`). ``replicated_over_tp``: parameter bytes
    this rank's tp neighbours hold too.

    Example::

        >>> b = fsdp_tp_bytes(8, 2, 2, 2, optimizer="adam")
        >>> b["params"], b["optimizer"], b["replicated_over_tp"]   # 2 * (136 + 4) * 4 bytes
        (1120, 2240, 32)
    """
    _check_optimizer(optimizer)
    whole(depth, "depth", hint=" (MLP blocks)")
    pieces = _fsdp_tp_pieces(width, dp, tp, dp_rank)
    held = sum(rows * row for rows, _, row, _ in pieces.values()) * depth * dtype_bytes
    padded = sum(pad * row for _, pad, row, _ in pieces.values()) * depth * dtype_bytes
    replicated = sum(rows * row for rows, _, row, rep in pieces.values() if rep)
    states = 2 if optimizer == "adam" else 1
    out = {"params": held, "grads": held, "optimizer": states * held}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    out["padding"] = 2 * (padded - held)  # parameters and gradients; optimizer state is not padded
    out["replicated_over_tp"] = replicated * depth * dtype_bytes
    out["unsharded_params"] = depth * (8 * width**2 + 5 * width) * dtype_bytes
    return out


def fsdp_tp_traffic(width: int, depth: int, dp: int, tp: int, batch: int,
                    dtype_bytes: int = 4) -> dict:
    """Bytes one rank sends in one FSDP2 x TP step, by mesh dimension and collective.

    ``dp`` (FSDP2, per block): an all-gather of the block's tp shard before its forward and
    again before its backward, and a reduce-scatter of its gradients after; the payload is the
    tp shard, padded to a multiple of dp rows. ``tp`` (Megatron): one all-reduce of the block's
    output activations, ``(batch / dp) x w``, in every forward, and one of its input's gradient
    in every backward except the first block's (the data needs no gradient). Ring figures
    (:func:`labkit.parallel.traffic.ring_bytes`).

    Example::

        >>> wire = fsdp_tp_traffic(8, 2, 2, 2, 8)   # 2 blocks of width 8, a batch of 8, 2 x 2
        >>> wire["calls"]["tp"], wire["bytes"]["tp"]  # 3 all-reduces of 4 x 8 floats, 2 ranks
        ({'all_reduce': 3}, {'all_reduce': 384})
        >>> wire["bytes"]["dp"]                       # 2 x 2 gathers, 2 scatters of 560 B each
        {'all_gather': 2240, 'reduce_scatter': 1120}
    """
    pieces = _fsdp_tp_pieces(width, dp, tp, 0)
    local_batch = _split_batch(batch, dp, f"{dp} data-parallel ranks")
    shard = dp * sum(pad * row for _, pad, row, _ in pieces.values()) * dtype_bytes
    activation = local_batch * width * dtype_bytes
    wire: dict = {"bytes": {}, "calls": {}}
    if dp > 1:
        gather = traffic.ring_bytes("all_gather", shard, dp)
        scatter = traffic.ring_bytes("reduce_scatter", shard, dp)
        wire["bytes"]["dp"] = {"all_gather": 2 * depth * gather, "reduce_scatter": depth * scatter}
        wire["calls"]["dp"] = {"all_gather": 2 * depth, "reduce_scatter": depth}
    if tp > 1:
        reduce = traffic.ring_bytes("all_reduce", activation, tp)
        wire["bytes"]["tp"] = {"all_reduce": (2 * depth - 1) * reduce}
        wire["calls"]["tp"] = {"all_reduce": 2 * depth - 1}
    return wire


def _check_fsdp_tp(dp, tp, width, depth, batch, optimizer) -> None:
    """Every size checked before the mesh: all ranks raise the same error and none waits."""
    _check_optimizer(optimizer)
    whole(depth, "depth", hint=" (MLP blocks)")
    _tp_hidden(width, tp)
    _split_batch(whole(batch, "batch"), whole(dp, "dp"), f"{dp} data-parallel ranks")


def fsdp_tp_step(dp: int, tp: int, width: int = 16, depth: int = 2, batch: int = 8,
                 lr: float = 0.1, seed: int = 0, optimizer: str = "sgd") -> dict:
    """Worker function: one training step of FSDP2 x TP on a ``dp x tp`` mesh, checked.

    Every rank builds the same ``depth`` MLP blocks of ``width`` (one seed) and the same
    global batch; the ``dp`` replicas each take ``batch / dp`` rows (the tp ranks of one
    replica the same rows: they share the work on one batch). One step (MSE loss, backward,
    SGD with momentum or Adam) of :func:`fsdp_tp_model`, then each weight gathered whole
    (``full_tensor()``) and compared with the same step in this process on the whole batch.

    SGD is the default because its step is linear in the gradient: the float32 rounding of
    the split sums (~1e-7 relative) stays that small in the weights. Adam's first step is
    ``lr * g / (|g| + eps)``, which turns the rounding of a gradient near ``eps`` into a far
    larger difference (2e-5 at width 64 with lr = 1e-2); use ``optimizer="adam"`` for Adam's
    memory, with a tolerance to match.

    Returns plain data: ``coords`` and ``groups`` (this rank's place on the mesh), ``loss`` (the
    mean over the replicas) and ``reference_loss``, ``weight_diff`` (largest absolute
    difference per weight) beside ``update`` (the largest change of a weight in the step),
    ``held`` (:func:`held_bytes`) beside ``formula``
    (:func:`fsdp_tp_bytes`), ``wire`` (``{"bytes": {dimension: {collective: bytes sent}},
    "calls": {...}}``, counted by :mod:`labkit.parallel.traffic`) beside ``wire_formula``
    (:func:`fsdp_tp_traffic`), and ``shards`` (each weight's placements and local shape).

    Example::

        >>> r = labkit.launch(fsdp_tp_step, 2, 2, nproc=4).values[0]
        >>> r["held"]["params"] == r["formula"]["params"]
        True
        >>> r["wire"] == r["wire_formula"]
        True
    """
    _check_fsdp_tp(dp, tp, width, depth, batch, optimizer)
    device = collective_device()
    mesh = mesh_2d(dp, tp)
    coords, groups = _coords_and_groups(mesh)
    torch.manual_seed(seed)
    dense = mlp_blocks(depth, width).to(device)
    x, y = _example_data(batch, width, seed, device)
    reference_loss, reference, moved = _reference_step(copy.deepcopy(dense), x, y, optimizer,
                                                       lr)

    model = fsdp_tp_model(copy.deepcopy(dense), mesh)
    opt = _optimizer(model.parameters(), optimizer, lr)
    rows = x.chunk(dp)[coords["dp"]], y.chunk(dp)[coords["dp"]]  # a replica's share of the batch
    with traffic.count_traffic() as wire, _quiet():
        loss = F.mse_loss(model(rows[0]), rows[1])  # TP: all-reduces; FSDP2: all-gathers
        loss.backward()  # FSDP2 reduce-scatters the gradients over dp (their mean)
        opt.step()       # on the local shards only: no communication
    held = held_bytes(model, opt)
    with _quiet():  # gathered whole to compare: after the counting, not part of training
        weights = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {"rank": dist.get_rank(), "dp": dp, "tp": tp, "coords": coords, "groups": groups,
            "loss": _mean_over(loss.item(), mesh["dp"].get_group(), device),
            "reference_loss": reference_loss, "update": moved,
            "weight_diff": {name: (w - reference[name]).abs().max().item()
                            for name, w in weights.items()},
            "held": held, "formula": fsdp_tp_bytes(width, depth, dp, tp, dp_rank=coords["dp"],
                                                   optimizer=optimizer),
            "wire": _wire_by_dimension(wire.calls, groups),
            "wire_formula": fsdp_tp_traffic(width, depth, dp, tp, batch),
            "shards": {name: {"placements": [str(pl) for pl in p.placements],
                              "local": list(p.to_local().shape), "global": list(p.shape)}
                       for name, p in model.named_parameters()}}


# ---- data x pipeline parallelism ------------------------------------------------------------


def _stages_on_meta(width: int, depth: int, pp: int) -> list:
    """The stages of ``mlp_blocks(depth, width)`` on the meta device: shapes, no values."""
    with torch.device("meta"):
        return split_stages(mlp_blocks(depth, width), pp)


def _global_name(name: str, first: int) -> str:
    """A stage's ``"1.0.weight"`` is the model's ``"3.0.weight"`` if the stage starts at block 2."""
    block, rest = name.split(".", 1)
    return f"{int(block) + first}.{rest}"


def _check_dp_pp(dp, pp, width, depth, batch, microbatches, optimizer, schedule) -> None:
    """Every size checked before the mesh: all ranks raise the same error and none waits."""
    _check_optimizer(optimizer)
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {schedule!r}: use gpipe or 1f1b")
    whole(width, "width")
    depth, pp = whole(depth, "depth", hint=" (MLP blocks)"), whole(pp, "pp")
    if depth < pp:
        raise ValueError(f"depth {depth} does not split into {pp} pipeline stages: every stage "
                         f"needs at least one block; use depth >= {pp} (a multiple of {pp} "
                         f"gives equal stages) or fewer stages")
    dp, m = whole(dp, "dp"), whole(microbatches, "microbatches")
    _split_batch(whole(batch, "batch"), dp * m,
                 f"{dp} data-parallel replicas x {m} micro-batches")


def dp_pp_traffic(width: int, depth: int, dp: int, pp: int, batch: int, microbatches: int,
                  stage: int, dtype_bytes: int = 4) -> dict:
    """Bytes pipeline stage ``stage`` sends in one DP x PP step, by mesh dimension.

    ``pp``: every stage but the last sends each micro-batch's activations on, every stage but
    the first sends each micro-batch's input gradient back: ``(batch / dp / m) x w`` floats
    each. ``dp``: one all-reduce per parameter tensor of the stage's gradients over the
    replicas holding the same stage (ring figures).

    Example::

        >>> wire = dp_pp_traffic(8, 4, 2, 2, 16, 2, stage=0)   # stage 0: 2 blocks, 1104 params
        >>> wire["bytes"]          # 2 sends of 4 x 8 floats; 2 * (1/2) * 4416 B all-reduced
        {'pp': {'send': 256, 'recv': 0}, 'dp': {'all_reduce': 4416}}
    """
    micro = _split_batch(batch, dp * microbatches, f"{dp * microbatches} micro-batches")
    message = micro * width * dtype_bytes
    neighbours = (stage < pp - 1) + (stage > 0)  # one each way in the middle of a pipeline
    wire: dict = {"bytes": {}, "calls": {}}
    if pp > 1:
        wire["bytes"]["pp"] = {"send": microbatches * neighbours * message, "recv": 0}
        wire["calls"]["pp"] = {"send": microbatches * neighbours,
                               "recv": microbatches * neighbours}
    if dp > 1:
        mine = list(_stages_on_meta(width, depth, pp)[stage].parameters())
        wire["bytes"]["dp"] = {"all_reduce": sum(
            traffic.ring_bytes("all_reduce", p.numel() * dtype_bytes, dp) for p in mine)}
        wire["calls"]["dp"] = {"all_reduce": len(mine)}
    return wire


def _pipeline_loss(losses: list, last: bool, mesh, device) -> float:
    """The step's loss on every rank: the last stage's mean over micro-batches, then replicas."""
    mean = sum(v.item() for v in losses) / len(losses) if last else 0.0
    t = torch.tensor([mean], dtype=torch.float64, device=device)
    dist.broadcast(t, group=mesh["pp"].get_group(), group_src=mesh["pp"].size() - 1)
    return _mean_over(t.item(), mesh["dp"].get_group(), device)


def dp_pp_step(dp: int, pp: int, width: int = 16, depth: int = 4, batch: int = 16,
               microbatches: int = 2, lr: float = 0.1, seed: int = 0, *,
               schedule: str = "1f1b", optimizer: str = "sgd") -> dict:
    """Worker function: one step of data x pipeline parallelism on a ``dp x pp`` mesh, checked.

    Each of the ``dp`` replicas is a pipeline of ``pp`` stages over its ``mesh["pp"]`` group
    (rank ``r`` is stage ``r % pp`` of replica ``r // pp``), run by
    ``torch.distributed.pipelining`` (``Schedule1F1B`` or ``ScheduleGPipe``) on ``batch / dp``
    rows in ``microbatches`` micro-batches. After the schedule, each stage averages its
    gradients with the same stage of the other replicas (an all-reduce over ``mesh["dp"]``),
    then steps its own optimizer (SGD with momentum, or Adam: see :func:`fsdp_tp_step`): the
    data-parallel half, by hand, as DDP would do it.

    Returns ``coords`` and ``groups``, ``stage`` and ``blocks`` (which blocks this stage
    holds), ``loss`` (the mean over the replicas) beside ``reference_loss`` (one process,
    the whole batch), ``weight_diff`` (this stage's updated weights against the same weights
    of the reference; ``update`` is the step's largest change of a weight), ``wire`` (bytes
    sent and calls by mesh dimension, counted by :mod:`labkit.parallel.traffic`) beside
    ``wire_formula`` (:func:`dp_pp_traffic`), ``shape_messages`` (the few small messages in
    which the stages agree on the shapes, on the first step: not data, so not in the
    formula) and ``held`` (:func:`held_bytes`).

    Example::

        >>> r = labkit.launch(dp_pp_step, 2, 2, nproc=4).values
        >>> max(max(v["weight_diff"].values()) for v in r) < 1e-5
        True
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    _check_dp_pp(dp, pp, width, depth, batch, microbatches, optimizer, schedule)
    device = collective_device()
    # Ranks laid out as a dp x pp grid: rank r is stage r % pp of replica r // pp. mesh["pp"]
    # groups one replica's stages (the pipeline's sends), mesh["dp"] one stage's replicas
    # (the gradient all-reduce).
    mesh = mesh_2d(dp, pp, names=("dp", "pp"))
    coords, groups = _coords_and_groups(mesh)
    stage_index, replica = coords["pp"], coords["dp"]
    x, y = _example_data(batch, width, seed, device)
    torch.manual_seed(seed)  # the same draws as stage_builder's: the whole model, then split
    reference_loss, reference, moved = _reference_step(mlp_blocks(depth, width).to(device), x,
                                                       y, optimizer, lr)

    module = stage_builder(partial(mlp_blocks, depth, width), seed)(stage_index, pp).to(device)
    first = sum(len(s) for s in _stages_on_meta(width, depth, pp)[:stage_index])  # its 1st block
    # The stage learns its input's shape from the first micro-batch: a few small messages.
    stage = PipelineStage(module, stage_index, pp, device, group=mesh["pp"].get_group())
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        stage, n_microbatches=microbatches, loss_fn=F.mse_loss, scale_grads=True)
    opt = _optimizer(module.parameters(), optimizer, lr)
    rows = x.chunk(dp)[replica], y.chunk(dp)[replica]  # a replica's share of the batch
    losses: list = []
    args = (rows[0],) if stage.is_first else ()
    kwargs = {"target": rows[1], "losses": losses} if stage.is_last else {}
    with traffic.count_traffic() as wire:
        runner.step(*args, **kwargs)  # PP: activations forward, gradients back, over mesh["pp"]
        if dp > 1:  # DP: this stage's mean gradient over the replicas (DDP's job, by hand)
            for p in module.parameters():
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad /= dp
        opt.step()
    # The schedule's own small messages (shapes and dtypes, on the first step) are not data.
    message = batch // (dp * microbatches) * width * x.element_size()
    is_shape = lambda c: c.op in ("send", "recv") and c.payload_bytes != message  # noqa: E731
    shapes = [c for c in wire.calls if is_shape(c)]
    return {"rank": dist.get_rank(), "dp": dp, "pp": pp, "coords": coords, "groups": groups,
            "stage": stage_index, "blocks": list(range(first, first + len(module))),
            "loss": _pipeline_loss(losses, stage.is_last, mesh, device),
            "reference_loss": reference_loss, "update": moved,
            "weight_diff": {_global_name(name, first):
                            (p.detach() - reference[_global_name(name, first)]).abs().max().item()
                            for name, p in module.named_parameters()},
            "held": held_bytes(module, opt),
            "wire": _wire_by_dimension([c for c in wire.calls if not is_shape(c)], groups),
            "shape_messages": {"calls": len(shapes), "bytes": sum(c.sent_bytes for c in shapes)},
            "wire_formula": dp_pp_traffic(width, depth, dp, pp, batch, microbatches,
                                          stage_index)}

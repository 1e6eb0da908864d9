"""Where training memory goes: the ZeRO arithmetic, FSDP measured, activations checkpointed.

Three questions, three functions:

- :func:`estimate_memory`: bytes per rank of parameters, gradients and optimizer state under
  data parallelism, ZeRO-1/2/3, tensor and pipeline parallelism (the ZeRO paper's model).
- :func:`fsdp_memory` (a worker function): the same bytes *counted* on a real FSDP2
  (``fully_shard``) model after an Adam step, beside the unsharded model every DDP rank holds.
- :func:`activation_memory`: the bytes autograd keeps for backward, with and without
  activation checkpointing, and what the recomputation costs in time.

All three return plain dicts of bytes and seconds; the notebook turns them into tables.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from labkit._dist import collective_device
from labkit._sizes import whole

__all__ = ["STRATEGIES", "BYTES_PER_PARAM", "estimate_memory", "mlp_blocks", "fsdp_memory",
           "held_bytes", "forward_blocks", "counting_saved_bytes", "saved_bytes",
           "activation_memory"]

STRATEGIES = ("dp", "zero1", "zero2", "zero3", "tp", "pp")

# Bytes per parameter (ZeRO paper, section 3.1). Mixed-precision Adam keeps fp16/bf16 params (2)
# and grads (2), plus an fp32 master copy, momentum and variance (4 + 4 + 4 = 12): K = 12, 16 in
# all. Plain fp32 Adam: params 4, grads 4, momentum and variance 8. SGD with momentum: one state.
BYTES_PER_PARAM = {
    ("mixed", "adam"): {"params": 2, "grads": 2, "optimizer": 12},
    ("fp32", "adam"): {"params": 4, "grads": 4, "optimizer": 8},
    ("mixed", "sgd"): {"params": 2, "grads": 2, "optimizer": 8},  # master copy + momentum
    ("fp32", "sgd"): {"params": 4, "grads": 4, "optimizer": 4},  # momentum
}


def estimate_memory(n_params, *, strategy: str, world_size: int, tp: int | None = None,
                    pp: int | None = None,
                    bytes_per_param: dict | None = None, precision: str = "mixed",
                    optimizer: str = "adam") -> dict:
    """Bytes per rank of parameters, gradients and optimizer state (activations not included).

    ``world_size`` ranks are ``tp * pp`` ways of model parallelism times ``dp`` data-parallel
    replicas. Tensor and pipeline parallelism divide everything by ``tp * pp``. Across the
    replicas, ``"dp"`` keeps a full copy on each; ZeRO-1 shards the optimizer state over them,
    ZeRO-2 the gradients too, ZeRO-3 (FSDP) the parameters too. ``"tp"`` and ``"pp"`` alone
    mean every rank is in the TP (PP) group unless ``tp`` (``pp``) says otherwise: there
    ``tp`` (``pp``) defaults to ``world_size`` divided by the other degree, elsewhere to 1.

    ``bytes_per_param`` (``{"params": 2, "grads": 2, "optimizer": 12}``) overrides the bytes
    that ``precision`` ("mixed" or "fp32") and ``optimizer`` ("adam" or "sgd") choose.

    Example::

        >>> m = estimate_memory(1e9, strategy="zero1", world_size=8)
        >>> m["params"] / 1e9, m["grads"] / 1e9, m["optimizer"] / 1e9, m["total"] / 1e9
        (2.0, 2.0, 1.5, 5.5)
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    whole(world_size, "world_size")
    for name, value in (("tp", tp), ("pp", pp)):
        if value is not None:
            whole(value, name)
    if not n_params > 0:
        raise ValueError(f"n_params must be > 0, got {n_params!r}")
    if bytes_per_param is None:
        if (precision, optimizer) not in BYTES_PER_PARAM:
            raise ValueError(f"unknown precision={precision!r} / optimizer={optimizer!r}: use "
                             "precision 'mixed' or 'fp32' and optimizer 'adam' or 'sgd', or "
                             "pass bytes_per_param={'params': 2, 'grads': 2, 'optimizer': 12}")
        bytes_per_param = BYTES_PER_PARAM[precision, optimizer]
    elif sorted(bytes_per_param) != ["grads", "optimizer", "params"]:
        raise ValueError("bytes_per_param needs exactly the keys 'params', 'grads', 'optimizer', "
                         f"got {sorted(bytes_per_param)}")
    if strategy == "tp" and tp is None:
        tp = world_size // (pp or 1)
    if strategy == "pp" and pp is None:
        pp = world_size // (tp or 1)
    tp, pp = tp or 1, pp or 1
    if world_size % (tp * pp):
        raise ValueError(f"world_size={world_size} is not a multiple of tp*pp={tp * pp}: "
                         f"choose tp and pp whose product divides {world_size}")
    # The ranks left over after tensor and pipeline splits hold copies: data parallelism.
    dp = world_size // (tp * pp)
    level = {"zero1": 1, "zero2": 2, "zero3": 3}.get(strategy, 0)  # how much ZeRO shards
    # TP and PP split the model itself: each rank holds 1/(tp*pp) of every kind of state.
    per_rank = {key: n_params * b / (tp * pp) for key, b in bytes_per_param.items()}
    # ZeRO splits what the dp copies would otherwise repeat, stage by stage: the optimizer
    # state (ZeRO-1), then the gradients (2), then the parameters themselves (3, FSDP).
    per_rank["optimizer"] /= dp if level >= 1 else 1
    per_rank["grads"] /= dp if level >= 2 else 1
    per_rank["params"] /= dp if level >= 3 else 1
    return {"strategy": strategy, "world_size": world_size, "dp": dp, "tp": tp, "pp": pp,
            **per_rank, "total": sum(per_rank.values()), "bytes_per_param": dict(bytes_per_param)}


def mlp_blocks(n_blocks: int = 8, width: int = 64, expansion: int = 4) -> nn.Sequential:
    """``n_blocks`` MLP blocks ``Linear(w, 4w) -> GELU -> Linear(4w, w)`` in an ``nn.Sequential``.

    The model the memory experiments shard and checkpoint, one block at a time (the
    transformer blocks of notebook 09 are :func:`labkit.parallel.transformer.block_stack`).

    Example::

        >>> sum(p.numel() for p in mlp_blocks(2, 8).parameters())
        1104
    """
    return nn.Sequential(*[
        nn.Sequential(nn.Linear(width, expansion * width), nn.GELU(),
                      nn.Linear(expansion * width, width))
        for _ in range(n_blocks)])


# ---- FSDP2, measured -------------------------------------------------------------------------


def _local(t):
    """The tensor this rank holds: a DTensor's local shard, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def held_bytes(model, opt) -> dict:
    """Bytes this rank holds for training: local shards of parameters, gradients, optimizer state.

    A DTensor counts its ``to_local()`` shard, a plain tensor all of itself. Adam's ``step``
    counters (one scalar per parameter tensor, on every rank) are reported apart as
    ``optimizer_steps``; ``padding`` is the storage allocated beyond the tensors' own elements
    (FSDP2 pads uneven shards of parameters and gradients to the longest one).

    Example::

        >>> held_bytes(model, opt)["params"]        # after opt.step(), inside a worker
        1120
    """
    nbytes = lambda t: _local(t).numel() * _local(t).element_size()  # noqa: E731
    params = list(model.parameters())
    states = [(k, v) for p in params for k, v in opt.state[p].items() if torch.is_tensor(v)]
    held = {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(v) for k, v in states if k != "step")}
    held["total"] = held["params"] + held["grads"] + held["optimizer"]
    # Adam's step counter is one scalar tensor per parameter tensor, on every rank, not sharded:
    # bookkeeping outside the per-parameter arithmetic, so it is reported apart.
    held["optimizer_steps"] = sum(nbytes(v) for k, v in states if k == "step")
    # Uneven shards: FSDP2 pads dim 0 to a multiple of the world size and each rank allocates
    # the padded shard; the padding is the storage beyond the tensors' own elements.
    storages = {}
    for t in [*params, *(p.grad for p in params if p.grad is not None), *(v for _, v in states)]:
        s = _local(t).untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    held["padding"] = sum(storages.values()) - held["total"] - held["optimizer_steps"]
    return held


def _train_and_count(model, x, steps, device) -> dict:
    """``steps`` Adam steps, then the bytes held (gradients kept, as between two steps)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    held = held_bytes(model, opt)
    held["cuda_peak"] = (torch.cuda.max_memory_allocated() - base
                         if device.type == "cuda" else None)
    return held


def _first_linear_input(model, batch, device):
    first = next((m for m in model.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise ValueError("fsdp_memory feeds a random batch to the model's first nn.Linear and "
                         "found none: pass input_fn=lambda: torch.randn(...) for this model")
    return torch.randn(batch, first.in_features, device=device)


def fsdp_memory(model_fn, *, steps: int = 1, mixed_precision: bool = False, batch: int = 8,
                input_fn=None, seed: int = 0) -> dict:
    """Worker function: bytes each rank holds after Adam steps, FSDP2-sharded and not.

    ``model_fn()`` builds the model (e.g. ``functools.partial(mlp_blocks, 4, 256)``); every
    direct child with parameters gets ``fully_shard``, then the root. After ``steps`` Adam
    steps the local shards (``p.to_local()``) of parameters, gradients and Adam's
    ``exp_avg`` / ``exp_avg_sq`` are summed as numel * element_size (CPU tensors have no
    allocator statistics; on CUDA ``cuda_peak`` adds the peak allocated, activations and
    all-gather buffers included). ``"unsharded"`` is the same count for the plain fp32 model,
    what every DDP rank holds.

    fp32: the sharded total is ``estimate_memory(n, strategy="zero3", precision="fp32")``
    exactly when every parameter's first dimension splits evenly; uneven shards make the
    ranks differ (their sum is still exact) and FSDP2 pads the short shards of parameters
    and gradients to the longest one, reported apart as ``padding``.
    ``mixed_precision=True`` (bf16 compute, fp32 reduce): FSDP2 keeps the sharded params in
    fp32 (they are the master copy) and the grads in fp32, so 4 + 4 + 8 bytes per parameter:
    the same 16 in all as the ZeRO paper's 2 + 2 + 12, split differently.

    Example::

        >>> from functools import partial
        >>> r = labkit.launch(fsdp_memory, partial(mlp_blocks, 4, 64), nproc=2).values[0]
        >>> r["n_params"], r["sharded"]["total"], r["unsharded"]["total"]   # 16 bytes each
        (132352, 1058816, 2117632)
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    whole(steps, "steps")
    device = collective_device()
    torch.manual_seed(seed)
    model = model_fn().to(device)
    x = input_fn().to(device) if input_fn else _first_linear_input(model, batch, device)
    n_params = sum(p.numel() for p in model.parameters())
    unsharded = _train_and_count(model, x, steps, device)
    del model  # gone before the sharded model's peak is measured

    torch.manual_seed(seed)
    model = model_fn().to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    # Shard each layer on its own, so only one layer is gathered whole at a time, then the
    # root, which takes whatever parameters are left (none for a plain nn.Sequential).
    for layer in model.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    sharded = _train_and_count(model, x, steps, device)
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "n_params": n_params,
            "mixed_precision": mixed_precision, "sharded": sharded, "unsharded": unsharded}


# ---- activations and checkpointing -----------------------------------------------------------


def forward_blocks(model: nn.Sequential, x, *, checkpoint: bool = False):
    """Run ``model``'s blocks one after the other, each under activation checkpointing if asked.

    A checkpointed block keeps only its input for backward and runs its forward again during
    backward to get the rest. ``use_reentrant=False`` is the variant PyTorch recommends: it
    works with inputs that do not require grad and with ``torch.autograd.grad``.

    Example::

        >>> y = forward_blocks(mlp_blocks(8, 64), torch.randn(32, 64), checkpoint=True)
    """
    from torch.utils.checkpoint import checkpoint as ckpt

    for block in model:
        x = ckpt(block, x, use_reentrant=False) if checkpoint else block(x)
    return x


@contextlib.contextmanager
def counting_saved_bytes(exclude=()):
    """Count in the yielded dict's ``"bytes"`` what autograd saves for backward in the block.

    Each storage counts once (views share one); tensors in ``exclude`` (a model's parameters:
    held anyway) are left out. The graph stays alive, so backward can follow. Example::

        >>> with counting_saved_bytes() as saved:
        ...     loss = model(x).square().mean()
        >>> loss.backward(); saved["bytes"]
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: set[int] = set()
    counter = {"bytes": 0}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counter["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counter


def saved_bytes(forward, x, *, exclude=()) -> int:
    """Bytes autograd saves for backward in ``forward(x)``, once per storage (views share one).

    Tensors in ``exclude`` (a model's parameters: held anyway) are left out. Example::

        >>> model = mlp_blocks(4, 64)
        >>> saved_bytes(model, torch.randn(32, 64), exclude=model.parameters())
        294912
    """
    with counting_saved_bytes(exclude) as counter:
        out = forward(x)
    del out  # frees the graph and the saved tensors
    return counter["bytes"]


def activation_memory(model_fn, x, *, checkpoint: bool = False, repeats: int = 3) -> dict:
    """Bytes saved for backward by one forward, and seconds of forward + backward.

    ``model_fn()`` builds an ``nn.Sequential`` of blocks (or pass the module itself). The
    bytes come from ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd packs
    for backward, counted once per storage (views share one), parameters left out (they are
    held anyway). ``seconds`` is the median of ``repeats`` forward + backward passes after one
    warm-up. Single process; on the device of ``x``.

    Example::

        >>> plain = activation_memory(lambda: mlp_blocks(8, 256), x)
        >>> ckpt = activation_memory(lambda: mlp_blocks(8, 256), x, checkpoint=True)
        >>> round(1 - ckpt["saved_bytes"] / plain["saved_bytes"], 2)   # block inputs only
        0.89
    """
    model = model_fn if isinstance(model_fn, nn.Module) else model_fn()
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"activation_memory checkpoints block by block: model_fn must build "
                         f"an nn.Sequential of blocks (e.g. mlp_blocks(8, 64)), "
                         f"got {type(model).__name__}")
    model = model.to(x.device)
    whole(repeats, "repeats")
    saved = saved_bytes(lambda batch: forward_blocks(model, batch, checkpoint=checkpoint), x,
                        exclude=model.parameters())

    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        forward_blocks(model, x, checkpoint=checkpoint).square().mean().backward()
        sync()
        times.append(time.perf_counter() - start)
    return {"saved_bytes": saved, "seconds": statistics.median(times[1:]),
            "checkpoint": checkpoint}

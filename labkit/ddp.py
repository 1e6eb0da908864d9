"""Data-parallel helpers that run inside the workers: batch arithmetic, rank-0 saving, replica checks.

The lesson code of notebook 02 (DistributedSampler, ``set_epoch``, DDP, ``all_reduce`` of the
metrics) stays in the notebook where the learner reads it; what lives here is what every DDP
script needs and gets subtly wrong: a global batch that does not split over the workers, a
dataset too small for them, a checkpoint half-written when a rank dies, replicas that drifted.

Every function takes an explicit ``world_size`` / ``rank`` or reads them from the initialised
process group, which is what ``labkit.launch`` sets up.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._sizes import divisors

__all__ = ["per_worker_batch", "save_on_rank0", "replica_divergence"]


def _world_size(world_size: int | None) -> int:
    if world_size is not None:
        return int(world_size)
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def per_worker_batch(global_batch: int, *, world_size: int | None = None,
                     dataset_size: int | None = None) -> int:
    """The batch each worker loads so that together they make ``global_batch``.

    Data parallelism keeps the *global* batch (what the learning rate is tuned for) and splits
    it; a global batch that does not split evenly, or a dataset that gives the workers no full
    batch, is an error here rather than a silently different experiment (DistributedSampler
    pads a short dataset by repeating samples).

    Example::

        >>> per_worker_batch(256, world_size=4)
        64
        >>> per_worker_batch(256, world_size=4, dataset_size=1000)   # 3 steps per epoch
        64
    """
    world = _world_size(world_size)
    if global_batch < 1 or world < 1:
        raise ValueError(f"need global_batch >= 1 and world_size >= 1, got {global_batch} and {world}")
    if global_batch % world:
        lower, upper = global_batch // world * world, (global_batch // world + 1) * world
        near = f"{lower} or {upper}" if lower else f"{upper} or {2 * upper}"
        options = ", ".join(str(n) for n in divisors(global_batch) if n != world)
        raise ValueError(
            f"a global batch of {global_batch} does not split evenly over {world} workers: use a "
            f"multiple of {world} (e.g. {near}), or a worker count that divides {global_batch} "
            f"({options})")
    if dataset_size is not None:
        per_worker_samples = dataset_size // world  # DistributedSampler(drop_last=True)
        if per_worker_samples < global_batch // world:
            raise ValueError(
                f"{dataset_size} samples over {world} workers is {per_worker_samples} each: not "
                f"one full batch of {global_batch // world} per worker (global batch "
                f"{global_batch}); use fewer workers, a smaller global batch (at most "
                f"{max(dataset_size // world * world, world)}), or more data")
    return global_batch // world


def save_on_rank0(obj, path) -> Path:
    """Rank 0 writes ``obj`` with ``torch.save``; every rank returns once the file is complete.

    The write goes to a temporary name and is renamed into place, so a run that dies mid-write
    leaves the previous checkpoint intact; the barrier keeps the other ranks from loading a
    file rank 0 has not finished. Without a process group it simply saves.

    Example::

        >>> path = save_on_rank0({"model": model.module.state_dict(), "epoch": 3}, "ckpt.pt")
        >>> state = torch.load(path, map_location="cpu")    # on every rank
    """
    import torch
    import torch.distributed as dist

    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(obj, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    if distributed:
        dist.barrier()
    return path


def replica_divergence(model) -> float:
    """The largest difference between any rank's parameters and rank 0's (0.0: in sync).

    DDP keeps replicas identical by construction; this checks it, e.g. after loading a
    checkpoint or after a step that went around DDP. Every rank must call it (it is a
    collective); every rank gets the same number.

    Example::

        >>> replica_divergence(ddp_model)
        0.0
    """
    import torch
    import torch.distributed as dist

    module = getattr(model, "module", model)
    flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0.0
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff.item())

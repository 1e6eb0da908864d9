"""Distributed primitives that several rooms share: the device a collective needs, syncs and
barriers, the slowest rank's time, timing training steps with a warm-up, and the all-gather /
reduce-scatter into one tensor under whichever name this torch has.

A private module with public names: ``bench``, ``ddp``, ``perf``, ``diagnose``, ``elastic`` and
``labkit.parallel`` import these instead of keeping copies. Everything runs inside a worker
with ``torch.distributed`` initialised, except :func:`collective_device`'s ``required=False``.
"""

from __future__ import annotations

import time


def collective_device(group=None, *, required: bool = True):
    """The tensor device collectives in ``group`` need: the rank's GPU under NCCL, else the CPU.

    With ``required=False`` and no process group, the CPU (a function that also runs in one
    process); otherwise no process group is an error that says how to launch.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if not required:
            return torch.device("cpu")
        raise RuntimeError("torch.distributed is not initialised: run this inside a worker, "
                           "e.g. labkit.launch(check_allreduce, nproc=2)")
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(device) -> None:
    """Wait for the device: CUDA kernels return before the GPU is done, so clocks would lie."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(device, group=None) -> None:
    """A barrier over ``group``; on a GPU naming it spares NCCL its "devices ... unknown" guess."""
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def slowest(seconds, device, group=None) -> list[float]:
    """Each of ``seconds`` (a float or a list), the maximum over the ranks of ``group``.

    A collective is as slow as its slowest rank, so step times are reported that way.
    """
    import torch
    import torch.distributed as dist

    values = [seconds] if isinstance(seconds, int | float) else list(seconds)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def time_steps(model, x, y, steps: int, warmup: int, device, group=None) -> float:
    """This rank's seconds for ``steps`` SGD steps of ``model`` on ``(x, y)``, after ``warmup``.

    With a ``group``, the ranks start and stop the clock together (a barrier before and
    after), so a DDP model's time includes waiting for the slowest rank.
    """
    import torch
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def settle():
        sync(device)
        if group is not None:
            barrier(device, group)

    for _ in range(warmup):
        step()
    settle()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    settle()
    return time.perf_counter() - start


def all_gather_into(output, input, group=None, async_op: bool = False):
    """``output`` = every rank's ``input`` concatenated along dim 0, in rank order.

    torch 2.14 renames ``all_gather_into_tensor`` to ``all_gather_single`` (the old name warns);
    the NGC containers' older torch has only the old name. This calls whichever exists.
    """
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_into(output, input, op=None, group=None, async_op: bool = False):
    """``output`` = this rank's slice (along dim 0) of ``input`` summed over the ranks (or ``op``).

    ``reduce_scatter_single`` in torch 2.14, ``reduce_scatter_tensor`` before (see
    :func:`all_gather_into`).
    """
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group,
              async_op=async_op)

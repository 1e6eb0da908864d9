"""Send less: top-k gradient compression with error feedback, and local SGD.

Data parallelism all-reduces every gradient element every step. Two classic ways to cut the
bytes, both trading some accuracy (or steps) for communication:

* **top-k sparsification** (Aji & Heafield, 2017; Lin et al., 2018 "Deep Gradient
  Compression"): each rank sends only the ``k`` largest-magnitude gradient entries (values and
  indices). Without more, the small entries are lost forever and training suffers; with
  **error feedback** each rank keeps what it did not send and adds it to the next gradient, so
  every entry is eventually applied, only late.
* **local SGD** (Stich, 2019; "post-local SGD", Lin et al., 2020): ranks take ``H`` plain
  local steps, then average their *weights* once: an all-reduce every ``H`` steps instead of
  every step.

``compressed_training`` runs any of them on ``labkit.launch`` ranks and counts the payload
bytes each rank contributes, so accuracy can be plotted against bytes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from .parameter_server import accuracy, worker_batches

__all__ = ["METHODS", "topk_compress", "compressed_training"]

METHODS = ("dense", "topk", "local_sgd")


def topk_compress(grad: torch.Tensor, k: int, residual: torch.Tensor | None = None):
    """The ``k`` largest-magnitude entries of ``grad`` (plus ``residual``), and what is left.

    Returns ``(indices, values, new_residual)``; ``new_residual`` is ``None`` without error
    feedback (``residual=None``), else everything not sent, to add to the next gradient.

    Example::

        >>> idx, val, left = topk_compress(torch.tensor([0.1, -3.0, 0.5, 2.0]), 2,
        ...                                residual=torch.zeros(4))
        >>> idx.tolist(), val.tolist(), left.tolist()
        ([1, 3], [-3.0, 2.0], [0.10000000149011612, 0.0, 0.5, 0.0])
    """
    if not 1 <= k <= grad.numel():
        raise ValueError(f"k must be between 1 and the gradient's {grad.numel()} entries, got "
                         f"{k}: use e.g. k = max(1, int(0.01 * numel)) for 1 %")
    # Error feedback: what earlier steps did not send is added back, so a small gradient that
    # is never in the top k still arrives eventually, once its sum has grown large enough.
    full = grad if residual is None else grad + residual
    # Sorted indices: every rank's message is then (k indices, k values), the same sizes on
    # every rank, which is what all_gather needs (its tensors must match in shape).
    idx = full.abs().topk(k, sorted=False).indices.sort().values
    values = full[idx]
    if residual is None:
        return idx, values, None
    left = full.clone()
    left[idx] = 0  # what was sent leaves the residual; the rest waits for the next step
    return idx, values, left


def _sparse_mean(idx, values, numel: int, world: int) -> torch.Tensor:
    """Every rank's (indices, values) gathered and summed into one dense mean gradient."""
    all_idx = [torch.empty_like(idx) for _ in range(world)]
    all_val = [torch.empty_like(values) for _ in range(world)]
    dist.all_gather(all_idx, idx)
    dist.all_gather(all_val, values)
    dense = torch.zeros(numel, dtype=values.dtype)
    for i, v in zip(all_idx, all_val, strict=True):
        dense.index_add_(0, i, v)  # index_add_, not dense[i] += v: ranks may pick the same index
    return dense / world


def compressed_training(make_model, train, val, *, method: str = "dense", steps: int = 100,
                        batch: int = 32, lr: float = 0.1, ratio: float = 0.01,
                        error_feedback: bool = True, sync_every: int = 8, seed: int = 0) -> dict:
    """Worker function: data-parallel SGD with full, top-k, or periodic (local SGD) exchange.

    Every rank trains the same initial model on its own shard (:func:`worker_batches`):
    ``"dense"`` all-reduces the gradient every step (DDP's arithmetic); ``"topk"`` all-gathers
    each rank's ``ratio`` largest entries (with ``error_feedback`` or without); ``"local_sgd"``
    steps locally and averages the weights every ``sync_every`` steps (and after the last).

    Every rank returns ``method, accuracy`` (on ``val``, with the final weights, the same on
    every rank), ``bytes_per_rank`` (payload this rank contributed: 4 per float32 value, 8 per
    top-k entry for value and int32-sized index), ``dense_bytes`` (what ``"dense"`` would have
    sent) and ``seconds``.

    Example::

        >>> make = lambda: torch.nn.Linear(64, 10)    # 650 parameters; x: (N, 64), y: (N,)
        >>> rows = [labkit.launch(compressed_training, make, (x, y), (xv, yv), method=m,
        ...                       nproc=2).values[0] for m in METHODS]
        >>> [round(r["bytes_per_rank"] / r["dense_bytes"], 3) for r in rows]   # of dense's bytes
        [1.0, 0.018, 0.13]
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio is the fraction of entries top-k sends: between 0 and 1 (e.g. "
                         f"0.01), got {ratio}")
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1 step, got {sync_every}")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = make_model()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    k = max(1, int(ratio * numel))
    residual = torch.zeros(numel) if error_feedback else None
    sent = 0
    x, y = train
    start = time.perf_counter()
    for step, idx in enumerate(worker_batches(len(x), rank, world, batch, steps, seed=seed)):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        grad = parameters_to_vector(p.grad for p in params)
        if method == "dense":
            dist.all_reduce(grad)
            grad /= world
            sent += numel * 4
        elif method == "topk":
            top, values, residual = topk_compress(grad, k, residual)
            grad = _sparse_mean(top.int(), values, numel, world)
            sent += k * 8
        weights = parameters_to_vector(params).detach() - lr * grad
        if method == "local_sgd" and ((step + 1) % sync_every == 0 or step + 1 == steps):
            dist.all_reduce(weights)  # average the models, not the gradients
            weights /= world
            sent += numel * 4
        vector_to_parameters(weights, params)
    return {"method": method, "rank": rank, "accuracy": accuracy(model, weights, *val),
            "bytes_per_rank": sent, "dense_bytes": numel * 4 * steps,
            "seconds": time.perf_counter() - start, "steps": steps}

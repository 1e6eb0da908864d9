"""A parameter server from point-to-point messages: rank 0 serves, the other ranks compute.

Before all-reduce took over, distributed SGD was a *parameter server* (Dean et al., 2012; Li et
al., 2014): a server holds the weights, workers pull them, compute a gradient on their own data
and push it back. Two ways to apply the pushes:

* **synchronous**: the server waits for one gradient from every worker, averages them and
  steps. The same as one process with the union of the workers' batches (and as DDP), but every
  step waits for the slowest worker;
* **asynchronous**: the server applies each gradient the moment it arrives and sends the new
  weights straight back to that worker. Nobody waits, but a gradient was computed on weights
  that other workers' pushes have changed since: its **staleness** is the number of updates in
  between. Fast workers update more often; a slow worker's gradients arrive stale.

``parameter_server`` runs both on ``labkit.launch`` ranks. Messages are flat float32 vectors
(``parameters_to_vector``); the server is one rank of the same process group, as in
``torch.distributed.rpc``-free teaching code.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

__all__ = ["MODES", "parameter_server", "serve_sync", "serve_async", "worker_batches",
           "accuracy"]

MODES = ("sync", "async")


def worker_batches(n_samples: int, worker: int, workers: int, batch: int, steps: int, *,
                   seed: int = 0) -> list[torch.Tensor]:
    """The sample indices of each of a worker's ``steps`` batches: its own shard, reshuffled.

    Worker ``w`` (0-based among the ``workers``) owns every ``workers``-th sample of a seeded
    permutation, and walks through a fresh shuffle of it each time it runs out.

    Example::

        >>> [b.tolist() for b in worker_batches(8, 0, 2, batch=2, steps=2)]
        [[1, 2], [4, 7]]
    """
    if not 0 <= worker < workers:
        raise ValueError(f"worker must be in 0..{workers - 1}, got {worker}")
    if batch < 1 or steps < 1:
        raise ValueError(f"need batch >= 1 and steps >= 1, got batch={batch}, steps={steps}")
    gen = torch.Generator().manual_seed(seed)
    shard = torch.randperm(n_samples, generator=gen)[worker::workers]
    if len(shard) < batch:
        raise ValueError(f"{n_samples} samples over {workers} workers leaves {len(shard)} each, "
                         f"fewer than one batch of {batch}: use a smaller batch or fewer workers")
    batches, order = [], shard[torch.randperm(len(shard), generator=gen)]
    while len(batches) < steps:
        if len(order) < batch:
            order = shard[torch.randperm(len(shard), generator=gen)]
        batches.append(order[:batch])
        order = order[batch:]
    return batches


def _gradient(model, weights, x, y) -> tuple[torch.Tensor, float]:
    """The flat gradient of the mean loss on (x, y) at ``weights``, and that loss."""
    vector_to_parameters(weights, model.parameters())
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return parameters_to_vector(p.grad for p in model.parameters()), loss.item()


def accuracy(model, weights, x, y) -> float:
    """The accuracy on ``(x, y)`` of ``model`` loaded with the flat vector ``weights``."""
    vector_to_parameters(weights, model.parameters())
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def serve_sync(weights, workers, steps, lr) -> dict:
    """Each step: send the weights to every worker, wait for every gradient, average, step."""
    grads = [torch.empty_like(weights) for _ in workers]
    for _ in range(steps):
        sends = [dist.isend(weights, dst=w) for w in workers]
        for w, g in zip(workers, grads, strict=True):
            dist.recv(g, src=w)  # in rank order: the step waits for the slowest worker anyway
        for s in sends:
            s.wait()
        weights = weights - lr * torch.stack(grads).mean(0)
    return {"weights": weights, "updates": steps, "staleness": [0] * (steps * len(workers)),
            "pushed_by": [w for _ in range(steps) for w in workers]}


def serve_async(weights, workers, steps, lr) -> dict:
    """Apply each gradient as it arrives; send the new weights back to whoever sent it."""
    # Runs on rank 0 only; every other rank is a worker that pulls weights and pushes gradients.
    version, staleness, pushed_by = 0, [], []
    left = dict.fromkeys(workers, steps)  # gradients still to come from each worker
    # Every message carries one extra float: the version of the weights (how many updates
    # they have had), so the server can tell how stale a gradient is when it arrives.
    pending = [dist.isend(torch.cat([weights, torch.tensor([0.0])]), dst=w) for w in workers]
    message = torch.empty(weights.numel() + 1)  # the gradient, then the version it was taken at
    for _ in range(steps * len(workers)):
        # src=None: receive from whichever worker is first. This is what makes it asynchronous.
        sender = dist.recv(message, src=None)
        # Updates since the sender pulled its weights: 0 is what synchronous SGD always has.
        staleness.append(version - int(message[-1].item()))
        pushed_by.append(sender)
        weights = weights - lr * message[:-1]  # a new tensor: the old one may still be sending
        version += 1
        left[sender] -= 1
        if left[sender]:
            # A fresh tensor per send: an isend's buffer must not change until it is delivered.
            pending.append(dist.isend(torch.cat([weights, torch.tensor([float(version)])]),
                                      dst=sender))
    for p in pending:
        p.wait()
    return {"weights": weights, "updates": version, "staleness": staleness,
            "pushed_by": pushed_by}


def _work(model, weights_size, x, y, batches, mode, delay_s) -> list[float]:
    """Pull weights, compute a gradient on the next batch, push it; ``len(batches)`` times."""
    losses = []
    incoming = torch.empty(weights_size + (mode == "async"))
    for idx in batches:
        dist.recv(incoming, src=0)
        weights = incoming[:weights_size]
        grad, loss = _gradient(model, weights, x[idx], y[idx])
        losses.append(loss)
        if delay_s:
            time.sleep(delay_s)  # a slower machine, or a busier one
        if mode == "async":
            dist.send(torch.cat([grad, incoming[-1:]]), dst=0)  # echo the version it used
        else:
            dist.send(grad, dst=0)
    return losses


def parameter_server(make_model, train, val, *, mode: str = "sync", steps: int = 50,
                     batch: int = 32, lr: float = 0.1, seed: int = 0, slow: dict | None = None
                     ) -> dict:
    """Worker function: SGD with rank 0 as the parameter server and the other ranks as workers.

    ``train`` and ``val`` are ``(x, y)`` tensors, the same on every rank; each worker takes
    ``steps`` batches from its own shard (:func:`worker_batches`). ``mode`` is ``"sync"``
    (the server averages one gradient from every worker per step: ``steps`` updates) or
    ``"async"`` (every gradient is applied on arrival: ``steps * workers`` updates).
    ``slow={rank: seconds}`` makes those workers sleep after each gradient.

    Rank 0 returns ``mode, updates, staleness`` (per update, in arrival order), ``pushed_by``,
    ``accuracy`` (on ``val``), ``seconds``, ``bytes_per_update`` and ``weights``; the workers
    return their ``rank``, ``losses`` and ``seconds``.

    Example::

        >>> make = lambda: torch.nn.Linear(64, 10)              # x: (N, 64) float, y: (N,)
        >>> out = labkit.launch(parameter_server, make, (x, y), (xv, yv), mode="async",
        ...                     steps=50, slow={1: 0.01}, nproc=3).values[0]
        >>> out["updates"], out["mean_staleness"] > 0      # 2 workers x 50 gradients, applied late
        (100, True)
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use 'sync' or 'async'")
    n = dist.get_world_size()
    if n < 2:
        raise ValueError("a parameter server needs a server and at least one worker: launch it "
                         "with nproc >= 2 (rank 0 serves)")
    rank, workers = dist.get_rank(), list(range(1, n))
    torch.manual_seed(seed)
    model = make_model()  # the same initial weights everywhere; only the server's are used
    weights = parameters_to_vector(model.parameters()).detach()
    start = time.perf_counter()
    if rank > 0:
        batches = worker_batches(len(train[0]), rank - 1, n - 1, batch, steps, seed=seed)
        losses = _work(model, weights.numel(), *train, batches, mode,
                       (slow or {}).get(rank, 0.0))
        return {"rank": rank, "losses": losses, "seconds": time.perf_counter() - start}
    serve = serve_sync if mode == "sync" else serve_async
    out = serve(weights, workers, steps, lr)
    seconds = time.perf_counter() - start
    return {"rank": 0, "mode": mode, "updates": out["updates"], "staleness": out["staleness"],
            "pushed_by": out["pushed_by"],
            "mean_staleness": statistics.fmean(out["staleness"]),
            "accuracy": accuracy(model, out["weights"], *val), "seconds": seconds,
            "bytes_per_update": weights.numel() * weights.element_size(),
            "weights": out["weights"]}

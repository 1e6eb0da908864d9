"""Fault-tolerant training: checkpoint every k steps, resume after torchrun restarts the workers.

torchrun's elastic agent restarts *all* workers of a run when one dies (up to
``--max-restarts`` times; ``labkit.launch(..., max_restarts=N)``). It does not restore any
state: that is the training function's job. The recipe, in :func:`resumable_training`:

1. checkpoint model, optimizer and step every ``ckpt_every`` steps, atomically, from rank 0
   (:func:`labkit.ddp.save_on_rank0`);
2. on start, load the newest checkpoint if there is one, and continue from the step after it;
3. make every step's data depend only on the step number (and a seed), not on how the run got
   there, so the redone steps see exactly the batches they saw the first time.

Then a killed and restarted run ends with bitwise the weights of an uninterrupted one, and what
is lost is only the steps since the last checkpoint, which are redone.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["latest_checkpoint", "resume_latest", "step_batch", "resumable_training"]

_PREFIX = "step-"


def latest_checkpoint(folder) -> Path | None:
    """The newest ``step-NNNNNN.pt`` in ``folder``, or ``None`` when there is none yet.

    Example::

        >>> latest_checkpoint("/tmp/run")      # after steps 5 and 10 were saved
        PosixPath('/tmp/run/step-000010.pt')
    """
    folder = Path(folder)
    found = sorted(folder.glob(f"{_PREFIX}*.pt")) if folder.is_dir() else []
    return found[-1] if found else None


def resume_latest(model, optimizer, folder) -> int:
    """Load the newest checkpoint in ``folder`` into ``model`` and ``optimizer``; its step, or 0.

    The resume step of :func:`resumable_training` (its ``resume=`` default): a checkpoint is
    ``{"model": ..., "optimizer": ..., "step": ...}``; 0 means none was saved yet, and the run
    starts at step 1. ``model`` is the plain module (not its DDP wrapper).

    Example::

        >>> resume_latest(model, opt, "/tmp/run")     # after steps 5 and 10 were saved
        10
    """
    import torch

    path = latest_checkpoint(folder)
    if path is None:
        return 0  # the first attempt: nothing saved yet
    # On the CPU first: load_state_dict copies into the model's (and optimizer's) own device.
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])  # SGD's momentum: without it, steps differ
    return state["step"]


def step_batch(n_samples: int, step: int, batch: int, rank: int, world: int, seed: int = 0):
    """The sample indices of ``rank``'s batch at ``step``: a function of the step alone.

    Each epoch is a permutation seeded by ``(seed, epoch)``; ranks take interleaved slices of
    it, as a DistributedSampler with ``set_epoch`` does. No state carries over from the steps
    before, so a resumed run draws exactly the batches an uninterrupted one would.

    Example::

        >>> step_batch(100, step=3, batch=4, rank=1, world=2).tolist()
        [97, 8, 31, 24]
    """
    import torch

    per_epoch = n_samples // (batch * world)
    if per_epoch < 1:
        raise ValueError(f"{n_samples} samples do not make one batch of {batch} on each of "
                         f"{world} ranks: use a batch of at most {n_samples // world}")
    epoch, within = divmod(step, per_epoch)
    generator = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = torch.randperm(n_samples, generator=generator)
    start = (within * world + rank) * batch
    return order[start:start + batch]


def _crash_now(crash: dict | None, rank: int, step: int) -> bool:
    """Whether this rank is the one to die at this step, in the run's first attempt only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return bool(crash) and first_attempt and crash["rank"] == rank and crash["step"] == step


def resumable_training(make_model, train, folder, *, steps: int = 20, ckpt_every: int = 5,
                       batch: int = 16, lr: float = 0.1, seed: int = 0, crash: dict | None = None,
                       resume=resume_latest) -> dict:
    """Worker function: DDP training that checkpoints every ``ckpt_every`` steps and resumes.

    ``train`` is ``(x, y)``; checkpoints go to ``folder`` (shared by all ranks). ``crash =
    {"rank": r, "step": s}`` makes rank ``r`` kill itself with SIGKILL (no exception, no
    clean-up: what a lost GPU or an OOM-killed process looks like) just before step ``s`` in
    the first attempt; run it with ``labkit.launch(..., max_restarts=1)`` to see the restart.
    ``resume(model, optimizer, folder) -> step`` restores the newest checkpoint at start
    (:func:`resume_latest`, or yours: notebook 07 has you write it).

    Returns ``weights`` (flat, final), ``resumed_from`` (the checkpoint's step, or None),
    ``restarts`` (torchrun's restart count), ``steps_run`` (the steps this attempt ran).

    Example::

        >>> out = labkit.launch(resumable_training, make, (x, y), "/tmp/ckpt", steps=20,
        ...                     crash={"rank": 1, "step": 12}, max_restarts=1, nproc=2).values
        >>> out[0]["restarts"], out[0]["resumed_from"], out[0]["steps_run"][0]
        (1, 10, 11)
    """
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.nn.utils import parameters_to_vector

    from ._dist import collective_device
    from .ddp import save_on_rank0

    if steps < 1 or ckpt_every < 1:
        raise ValueError(f"need steps >= 1 and ckpt_every >= 1, got steps={steps}, "
                         f"ckpt_every={ckpt_every}")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    device = collective_device()  # the rank's GPU under NCCL, which cannot reduce CPU tensors
    model = DDP(make_model().to(device))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)  # state that must be saved
    done = resume(model.module, opt, folder)  # every rank loads the same file
    resumed_from = done or None
    x, y = train
    steps_run = []
    for step in range(done + 1, steps + 1):
        if _crash_now(crash, rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        idx = step_batch(len(x), step - 1, batch, rank, world, seed)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx].to(device)), y[idx].to(device)).backward()
        opt.step()
        steps_run.append(step)
        if step % ckpt_every == 0 or step == steps:
            save_on_rank0({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                           "step": step}, Path(folder) / f"{_PREFIX}{step:06d}.pt")
    return {"rank": rank, "weights": parameters_to_vector(model.parameters()).detach().cpu(),
            "resumed_from": resumed_from, "steps_run": steps_run,
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}

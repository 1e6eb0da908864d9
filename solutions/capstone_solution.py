"""Reference solution of the capstone (notebook 08): the single-process script, converted to DDP.

Kept apart from the learner's notebook (``notebooks/08_capstone.ipynb``); the solution notebook
``solutions/08_capstone_solution.ipynb`` and ``tests/test_capstone.py`` import it.

``train_ddp(task)`` runs on every worker that ``labkit.launch`` starts (``labkit.capstone.capstone``
grades it that way). Next to it are the known mistakes the grader must catch, each the
solution with one thing wrong, as a learner would write it:

- :func:`no_set_epoch`: the sampler's epoch is never set, so every epoch replays one order;
- :func:`no_lr_scaling`: the single-process learning rate kept for an N times larger batch;
- :func:`evaluated_on_training_split`: the "validation" accuracy measured on training images;
- :func:`not_distributed`: every rank trains its own copy, gradients never averaged.
"""

from __future__ import annotations

import dataclasses
import sys
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from labkit import augment, data, ddp, train

WIDTH = 16  # channels of the first block (VGG16's is 64): the case study's CPU-sized network

# Digits must not be flipped (a mirrored 2 is no 2); small turns, zooms and shifts are safe.
DIGIT_AUGMENTATION = augment.AugmentConfig(rotation=10, scale=(0.8, 1.0), translate=0.1,
                                           flip=0.0, brightness=0.0, contrast=0.0,
                                           saturation=0.0, hue=0.0)


def vgg_style(num_classes: int = 10, width: int = WIDTH, image_size: int = 16) -> nn.Module:
    """The case study's network, as in the given script: two VGG blocks (two 3x3 convolutions
    with BatchNorm, then a 2x2 max-pool), channels doubling, and a linear classifier."""
    def block(c_in, c_out):
        return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, width), *block(width, 2 * width), nn.Flatten(),
                         nn.Linear(2 * width * (image_size // 4) ** 2, num_classes))


def build_model(task, width: int = WIDTH) -> nn.Module:
    """The network, with the same initial weights on every rank (DDP also broadcasts rank 0's)."""
    torch.manual_seed(task.seed)
    return vgg_style(len(task.train.classes), width, task.image_size)


def train_loader(task, world: int) -> tuple[DataLoader, DistributedSampler]:
    """Augmented training images, each rank its 1/N share through a DistributedSampler."""
    train_ds = data.to_torch(task.train, augment.augmentation(task.image_size,
                                                              config=DIGIT_AUGMENTATION))
    # Keep the single-process batch per worker: the global batch grows N times (weak scaling).
    batch = ddp.per_worker_batch(task.base_batch * world, dataset_size=len(train_ds))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=task.seed, drop_last=True)
    return DataLoader(train_ds, batch_size=batch, sampler=sampler, drop_last=True), sampler


def evaluate(model, task, rank: int, world: int, device) -> float:
    """Accuracy on the whole validation split: each rank counts its share, one all_reduce sums."""
    val_ds = data.to_torch(task.val, task.eval_transform)
    counts = torch.zeros(2, device=device)  # correct, seen (on the GPU under NCCL)
    model.eval()
    with torch.no_grad():
        # range(rank, n, world), not a DistributedSampler: that one pads by repeating images.
        for x, y in DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=256):
            x, y = x.to(device), y.to(device)
            seen = torch.tensor(len(y), device=device)
            counts += torch.stack([(model(x).argmax(1) == y).sum(), seen])
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def train_ddp(task, width: int = WIDTH) -> dict:
    """The capstone's answer: DDP, DistributedSampler + set_epoch, scaled LR with warm-up,
    augmentation, a rank-0 checkpoint every epoch, and an honest validation accuracy.

    Example::

        >>> task = labkit.capstone.capstone_task(epochs=6)
        >>> labkit.capstone.capstone(train_ddp, task, nproc=2)
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = train.pick_device()  # this rank's GPU, or the CPU
    model = DDP(build_model(task, width).to(device))
    loader, sampler = train_loader(task, world)
    # Linear scaling: N workers x the same batch = an N times larger global batch.
    peak = train.linear_scaled_lr(task.base_lr, task.base_batch, task.base_batch * world)
    warmup_steps = task.warmup_epochs * len(loader)
    opt = torch.optim.SGD(model.parameters(), lr=peak, momentum=0.9, weight_decay=5e-4)
    step = 0
    for epoch in range(task.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            for group in opt.param_groups:
                group["lr"] = train.warmup_lr(peak, step, warmup_steps)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
        ddp.save_on_rank0({"model": model.module.state_dict(), "epoch": epoch + 1},
                          task.checkpoint)
    val_acc = evaluate(model, task, rank, world, device)
    if rank == 0:
        print(f"{world} workers, global batch {task.base_batch * world}, peak lr {peak:g}: "
              f"validation accuracy {val_acc:.3f}")
    return {"model": model.module.cpu(), "val_acc": val_acc}


# ---- the known mistakes: the solution with one thing wrong -------------------------------------


def no_set_epoch(task, width: int = WIDTH) -> dict:
    """Mistake: ``sampler.set_epoch(epoch)`` forgotten; every epoch draws epoch 0's order."""
    with mock.patch.object(DistributedSampler, "set_epoch", lambda self, epoch: None):
        return train_ddp(task, width)


def no_lr_scaling(task, width: int = WIDTH) -> dict:
    """Mistake: the single-process learning rate kept, though the global batch grew N times."""
    with mock.patch.object(train, "linear_scaled_lr", lambda base_lr, base, batch: base_lr):
        return train_ddp(task, width)


def evaluated_on_training_split(task, width: int = WIDTH) -> dict:
    """Mistake: the validation loader built from the training images."""
    return train_ddp(dataclasses.replace(task, val=task.train), width)


def validation_not_all_reduced(task, width: int = WIDTH) -> dict:
    """Mistake: each rank counts its share of the validation split; the counts never all-reduced."""
    with mock.patch.object(dist, "all_reduce", lambda tensor, *args, **kwargs: None):
        return train_ddp(task, width)


class _EachRankAlone(nn.Module):
    """DDP's interface (``.module``, forward) without its gradient all-reduce."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def not_distributed(task, width: int = WIDTH) -> dict:
    """Mistake: no DDP; every rank trains its own model on its shard, gradients never averaged."""
    with mock.patch.object(sys.modules[__name__], "DDP", _EachRankAlone):
        return train_ddp(task, width)


MISTAKES = {"no set_epoch": no_set_epoch, "no lr scaling": no_lr_scaling,
            "evaluated on the training split": evaluated_on_training_split,
            "validation not all-reduced": validation_not_all_reduced,
            "not distributed": not_distributed}

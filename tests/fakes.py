"""Small stand-in inputs that several test modules share."""

from __future__ import annotations

from labkit.bench import message_sizes

# A VGG16 so small that a training step takes milliseconds on a CPU.
VGG_TINY = {"image_size": 32, "width": 1 / 16, "batch_size": 2, "num_classes": 10, "steps": 1,
        "warmup": 0, "repeats": 1}


def allreduce_rows(ranks, alpha, beta):
    """All-reduce sweep rows that follow ``seconds = alpha + bytes * beta`` exactly."""
    return [{"bytes": b, "seconds": alpha + b * beta, "ranks": ranks}
            for b in message_sizes(1 << 10, 1 << 20)]


def solution_namespace(stem: str, block: str, **names) -> dict:
    """What solution ``block`` of ``solutions/<stem>.py`` defines, run as a notebook cell would.

    The namespace starts as the notebook's first cell leaves it (torch and torch.distributed
    imported as ``torch`` and ``dist``), plus ``names``.
    """
    import torch
    import torch.distributed as dist

    from labkit import exercises

    namespace = {"__name__": "__main__", "torch": torch, "dist": dist, **names}
    exec(exercises.solution_blocks(stem)[block], namespace)
    return namespace

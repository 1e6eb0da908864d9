"""Notebook 05's challenge (training on uneven shards without a hang): the solution passes on 2
and 4 ranks, known wrong answers (a hang, a wrong divisor, an extra all-reduce) get their hints,
and a valid answer written another way passes."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import diagnosis as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    return solution_namespace("05_problem_diagnosis", "uneven_shards")["my_train_uneven"]


def _grad_flat(model, batch):
    params = list(model.parameters())
    if batch is None:
        return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(batch[0]), batch[1]).backward()
    return torch.cat([p.grad.reshape(-1) for p in params])


def _apply(model, flat, lr):
    params = list(model.parameters())
    with torch.no_grad():
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p -= lr * g.view_as(p)


def test_uneven_shards_solution_passes_on_2_and_4_ranks():
    verdict = exercise.uneven_shards(_solution())
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def test_uneven_shards_untouched_is_not_written_yet():
    def my_train_uneven(model, batches, lr):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.uneven_shards(my_train_uneven).detail


def _own_length(model, batches, lr):
    for batch in batches:  # each rank stops on its own data
        flat = _grad_flat(model, batch)
        dist.all_reduce(flat)
        _apply(model, flat / dist.get_world_size(), lr)


def test_uneven_shards_wrong_each_rank_stops_on_its_own_data_hangs(monkeypatch):
    monkeypatch.setattr(exercise, "_UN_TIMEOUT", 5.0)
    verdict = exercise.uneven_shards(_own_length, worlds=(2,))
    assert not verdict and "still running after 5 s" in verdict.detail
    assert verdict.hint.startswith("a rank that ran out of batches stopped calling all_reduce")


def _steps(model, batches, lr, *, divide_by_world=False, idle_skips=False, count_after=False):
    step, dtype = 0, next(model.parameters()).dtype
    while True:
        mine = step < len(batches)
        active = torch.tensor([float(mine)], dtype=dtype)
        if not count_after:
            dist.all_reduce(active)
            if active.item() == 0:
                return
        flat = _grad_flat(model, batches[step] if mine else None)
        dist.all_reduce(flat)
        if count_after:
            dist.all_reduce(active)
            if active.item() == 0:
                return
        divisor = dist.get_world_size() if divide_by_world else active
        if mine or not idle_skips:
            _apply(model, flat / divisor, lr)
        step += 1


def _by_world(model, batches, lr):
    _steps(model, batches, lr, divide_by_world=True)


def test_uneven_shards_wrong_divided_by_the_world_size():
    verdict = exercise.uneven_shards(_by_world, worlds=(2,))
    assert not verdict and "weights differ from the run in one process" in verdict.detail
    assert "not by the world size" in verdict.hint


def _idle_skips(model, batches, lr):
    _steps(model, batches, lr, idle_skips=True)


def test_uneven_shards_wrong_a_rank_without_a_batch_skips_the_update():
    verdict = exercise.uneven_shards(_idle_skips, worlds=(4,))
    assert not verdict and "[2, 0, 3, 1]), float32: rank 1's weights never changed" in \
        verdict.detail
    assert verdict.hint.startswith("a rank without a batch of its own still applies")


def _count_after(model, batches, lr):
    _steps(model, batches, lr, count_after=True)


def test_uneven_shards_wrong_route_a_gradient_all_reduce_of_zeros_at_the_end():
    verdict = exercise.uneven_shards(_count_after, worlds=(2,))
    assert not verdict and "all-reduced the gradients 4 times (an all-reduce of zeros" in \
        verdict.detail


def _lengths_first(model, batches, lr):
    """Valid, written differently: every rank's length gathered once, then the counts known."""
    world = dist.get_world_size()
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(batches)]))
    lengths = [int(n) for n in lengths]
    for step in range(max(lengths)):
        flat = _grad_flat(model, batches[step] if step < len(batches) else None)
        dist.all_reduce(flat)
        _apply(model, flat / sum(n > step for n in lengths), lr)


def test_uneven_shards_valid_lengths_gathered_first_pass():
    assert exercise.uneven_shards(_lengths_first)

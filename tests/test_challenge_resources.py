"""Notebook 07's challenge (a sharded checkpoint loaded on another number of ranks): the solution
passes, known wrong answers (the data gathered on one rank, every file read, the newest step
picked by name, the old slices kept) get their hints, and a valid answer written another way
passes."""

from __future__ import annotations

import json
import os
import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import resources as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    ns = solution_namespace("07_resources_multinode", "resharded_checkpoint", os=os)
    return ns["my_save"], ns["my_load"]


def _ranges(numel, world):
    sizes = [len(p) for p in torch.arange(numel).tensor_split(world)]
    return [(sum(sizes[:r]), sum(sizes[:r + 1])) for r in range(world)]


def _save(shard, step, folder, *, atomic=True):
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(folder, f"step-{step}-rank-{rank}-of-{world}.pt")
    torch.save(shard.clone(), path + ".partial" if atomic else path)
    if atomic:
        os.replace(path + ".partial", path)


def _load(numel, folder, *, every_file=False, by_name=False, same_world=False,
          any_step=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [n for n in os.listdir(folder) if n.endswith(".pt")]
    steps = {n.split("-")[1] for n in names}
    if not any_step:  # only the steps every rank finished
        steps = {s for s in steps if sum(n.startswith(f"step-{s}-") for n in names)
                 == int(next(n for n in names if n.startswith(f"step-{s}-"))
                         .split("-of-")[1][:-3])}
    step = max(steps) if by_name else max(steps, key=int)
    old_world = int(next(n for n in names if n.startswith(f"step-{step}-")).split("-of-")[1][:-3])
    if same_world:
        return torch.load(os.path.join(folder, f"step-{step}-rank-{rank}-of-{old_world}.pt")), \
            int(step)
    lo, hi = _ranges(numel, world)[rank]
    pieces = []
    for r, (a, b) in enumerate(_ranges(numel, old_world)):
        if every_file or (a < b and a < hi and lo < b):
            old = torch.load(os.path.join(folder, f"step-{step}-rank-{r}-of-{old_world}.pt"))
            if a < hi and lo < b:
                pieces.append(old[max(lo, a) - a:min(hi, b) - a])
            elif not pieces:
                pieces.append(old[:0])
    if not pieces:
        pieces.append(torch.load(os.path.join(folder, f"step-{step}-rank-0-of-{old_world}.pt"))
                      [:0])
    return torch.cat(pieces), int(step)


def test_resharded_checkpoint_solution_passes():
    verdict = exercise.resharded_checkpoint(*_solution())
    assert verdict and "saved on 4 and loaded on 2, saved on 2 and loaded on 4" in verdict.detail


def test_resharded_checkpoint_untouched_is_not_written_yet():
    def my_save(shard, step, folder):
        raise NotImplementedError(check.PLACEHOLDER)

    def my_load(numel, folder):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.resharded_checkpoint(my_save, my_load).detail


def _gathered_save(shard, step, folder):
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, shard)  # the whole tensor on every rank
    if dist.get_rank() == 0:
        torch.save(torch.cat(parts), os.path.join(folder, f"full-{step}.pt"))


def test_resharded_checkpoint_wrong_route_data_gathered_to_save():
    verdict = exercise.resharded_checkpoint(_gathered_save, _load)
    assert not verdict and "saving, rank 0 sent all_gather" in verdict.detail
    assert verdict.hint.startswith("each rank writes its own slice to its own file")


def _every_file(numel, folder):
    return _load(numel, folder, every_file=True)


def test_resharded_checkpoint_wrong_route_every_file_read():
    verdict = exercise.resharded_checkpoint(_save, _every_file)
    assert not verdict and "rank 0: read 4 files; only 2 old slice(s) overlap" in verdict.detail
    assert verdict.hint.startswith("read only the files whose slices overlap your range")


def _newest_by_name(numel, folder):
    return _load(numel, folder, by_name=True)


def test_resharded_checkpoint_wrong_newest_step_by_name():
    verdict = exercise.resharded_checkpoint(_save, _newest_by_name)
    assert not verdict and "loaded step 9, the newest is 10" in verdict.detail
    assert "'10' sorts before '9' as text" in verdict.hint


def _same_world(numel, folder):
    return _load(numel, folder, same_world=True)


def test_resharded_checkpoint_wrong_old_slices_kept():
    verdict = exercise.resharded_checkpoint(_save, _same_world)
    assert not verdict and "want elements 0 to 4" in verdict.detail
    assert verdict.hint.startswith("that is rank r's old slice")


def _meta_save(shard, step, folder):
    """Valid, written differently: offsets agreed by a small all-gather of the slice sizes, one
    JSON file of metadata written by rank 0, the data files named by their offsets."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = torch.zeros(world, dtype=torch.int64)
    sizes[rank] = shard.numel()
    dist.all_reduce(sizes)
    start = int(sizes[:rank].sum())
    name = os.path.join(folder, f"{step:08d}_{start:08d}.pt")
    with open(name + "~", "wb") as f:  # a file object, renamed once whole
        torch.save(shard.clone(), f)
    os.rename(name + "~", name)
    dist.barrier()  # the metadata, which makes the step visible, only once every slice is whole
    if rank == 0:
        meta = {"step": step, "starts": [int(sizes[:r].sum()) for r in range(world)],
                "sizes": sizes.tolist()}
        with open(os.path.join(folder, "meta.tmp"), "w") as f:
            json.dump(meta, f)
        os.rename(os.path.join(folder, "meta.tmp"), os.path.join(folder, f"meta_{step:08d}.json"))


def _meta_load(numel, folder):
    rank, world = dist.get_rank(), dist.get_world_size()
    newest = max(n for n in os.listdir(folder)  # zero-padded: sorts
                 if n.startswith("meta_") and n.endswith(".json"))
    with open(os.path.join(folder, newest)) as f:
        meta = json.load(f)
    lo, hi = _ranges(numel, world)[rank]
    out, dtype = [], None
    for a, n in zip(meta["starts"], meta["sizes"], strict=True):
        if n and a < hi and lo < a + n:
            old = torch.load(os.path.join(folder, f"{meta['step']:08d}_{a:08d}.pt"))
            out.append(old[max(lo, a) - a:min(hi, a + n) - a])
            dtype = old.dtype
    if not out:
        dtype = torch.load(os.path.join(folder, f"{meta['step']:08d}_{0:08d}.pt")).dtype
    return (torch.cat(out) if out else torch.empty(0, dtype=dtype)), meta["step"]


def test_resharded_checkpoint_valid_metadata_file_and_offsets_pass():
    assert exercise.resharded_checkpoint(_meta_save, _meta_load)


def _direct_save(shard, step, folder):
    _save(shard, step, folder, atomic=False)


def test_resharded_checkpoint_wrong_file_written_under_its_real_name():
    """Right values and route, but a crash mid-write leaves half a file that load takes for a
    complete checkpoint."""
    verdict = exercise.resharded_checkpoint(_direct_save, _load)
    assert not verdict and "step 11 cut short while rank 3 wrote its file" in verdict.detail
    assert verdict.hint.startswith("a checkpoint is complete only once every rank's file")


def _any_step(numel, folder):
    return _load(numel, folder, any_step=True)


def test_resharded_checkpoint_wrong_incomplete_step_loaded():
    """Atomic files, but load takes the largest step even though one rank's file is missing."""
    verdict = exercise.resharded_checkpoint(_save, _any_step)
    assert not verdict and "step 11 cut short while rank 3 wrote its file" in verdict.detail
    assert "skip steps with a file missing" in verdict.hint

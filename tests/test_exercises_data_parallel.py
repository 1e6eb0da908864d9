"""Notebook 02's graders: the reference solutions pass, known wrong answers get their hint.

The distributed graders run on two warm gloo ranks shared by every test here, so each check
after the first costs milliseconds.
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from labkit.exercises import data_parallel as exercise

from .fakes import solution_namespace

# The wrong answers below travel to the ranks by value, as a notebook's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NOTEBOOK_GLOBALS = {"torch": torch, "nn": nn, "dist": dist, "DDP": DDP, "DataLoader": DataLoader,
                    "DistributedSampler": DistributedSampler, "Subset": Subset, "SEED": 0,
                    "__name__": "__notebook__"}


def solution(ex_id: str, name: str):
    """The function a solution block defines, run as the notebook runs it."""
    return solution_namespace("02_data_parallelism", ex_id, **NOTEBOOK_GLOBALS)[name]


# ---- ddp_training_loop ------------------------------------------------------------------------

def training(*, wrap=True, sampler="distributed", set_epoch=True, step=True, zero=True,
             lr_by_world=0, batch_by_world=0, extra_all_reduce=False):
    """A DDP training function with one of the usual mistakes switched on.

    ``lr_by_world`` and ``batch_by_world``: the power of the world size that multiplies them
    (1: times the world size, -1: divided by it).
    """

    def train(dataset, make_model, epochs, batch_size, lr):
        world = dist.get_world_size()
        lr *= world ** lr_by_world
        batch_size = max(1, int(batch_size * world ** batch_by_world))
        model = DDP(make_model()) if wrap else make_model()
        if sampler == "distributed":
            shards = DistributedSampler(dataset, seed=0)
        elif sampler == "ordered":
            shards = DistributedSampler(dataset, shuffle=False)
        elif sampler == "seed per rank":
            shards = DistributedSampler(dataset, seed=dist.get_rank())
        else:
            shards = None
        loader = DataLoader(dataset, batch_size=batch_size, sampler=shards,
                            shuffle=shards is None)
        opt = torch.optim.SGD(model.parameters() if step else [nn.Parameter(torch.zeros(1))],
                              lr=lr)
        for epoch in range(epochs):
            if set_epoch and shards is not None:
                shards.set_epoch(epoch)
            for x, y in loader:
                if zero:
                    opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                if extra_all_reduce:  # averages what DDP already averaged: the same values
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad /= world
                opt.step()
        return model

    return train


def by_hand(dataset, make_model, epochs, batch_size, lr):
    """A valid loop without the DDP wrapper: one flat all-reduce of the gradients per step."""
    model, world = make_model(), dist.get_world_size()
    sampler = DistributedSampler(dataset, seed=3)  # another seed: another valid permutation
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
            for p in model.parameters():
                p.grad = None
            nn.functional.cross_entropy(model(x), y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)
            flat /= world
            params = list(model.parameters())
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(g.view_as(p))
            opt.step()
    return model


def test_ddp_training_loop_solution_passes():
    verdict = exercise.ddp_training_loop(solution("ddp_training_loop", "my_ddp_training"))
    assert verdict, verdict
    assert "disjoint shards" in verdict.detail and "equal replicas" in verdict.detail
    assert "2 and 4 ranks" in verdict.detail and "one process" in verdict.detail
    assert exercise.ddp_training_loop(training())  # the same, written another way
    assert exercise.ddp_training_loop(by_hand)  # no DDP, one flat all-reduce per step


def test_ddp_training_loop_wrong_gradients_never_zeroed():
    verdict = exercise.ddp_training_loop(training(zero=False))
    assert not verdict and "differ from one process" in verdict.detail
    assert "gradients never zeroed" in verdict.hint and "opt.zero_grad()" in verdict.hint


@pytest.mark.parametrize("power, said", [(1, "learning rate 2 x lr"),
                                         (-1, "learning rate lr / 2")])
def test_ddp_training_loop_wrong_learning_rate_off_by_the_world_size(power, said):
    verdict = exercise.ddp_training_loop(training(lr_by_world=power))
    assert not verdict and "on 2 ranks" in verdict.detail
    assert said in verdict.hint


@pytest.mark.parametrize("power, said", [(1, "2 x batch_size = 3"),
                                         (-1, "batch_size = 3 split 2 ways")])
def test_ddp_training_loop_wrong_per_worker_batch_off_by_the_world_size(power, said):
    verdict = exercise.ddp_training_loop(training(batch_by_world=power))
    assert not verdict and said in verdict.detail
    assert "per-worker batch off by the world size" in verdict.hint


def test_ddp_training_loop_wrong_second_all_reduce_has_right_weights_but_not_route():
    verdict = exercise.ddp_training_loop(training(extra_all_reduce=True))
    assert not verdict and "2 x the 780 bytes of gradients per step" in verdict.detail
    assert "a second all-reduce" in verdict.hint


def test_ddp_training_loop_wrong_no_sampler():
    verdict = exercise.ddp_training_loop(training(sampler=None))
    assert not verdict and "same 40 samples as rank 0" in verdict.detail
    assert "was a DistributedSampler used?" in verdict.hint


def test_ddp_training_loop_wrong_no_set_epoch():
    verdict = exercise.ddp_training_loop(training(set_epoch=False))
    assert not verdict and "epoch 2 repeated epoch 1's order" in verdict.detail
    assert "set_epoch" in verdict.hint


def test_ddp_training_loop_wrong_sampler_without_shuffle():
    verdict = exercise.ddp_training_loop(training(sampler="ordered"))
    assert not verdict and "index order" in verdict.detail and "shuffle=True" in verdict.hint


def test_ddp_training_loop_wrong_seed_per_rank():
    verdict = exercise.ddp_training_loop(training(sampler="seed per rank"))
    assert not verdict and "of the same samples" in verdict.detail
    assert "same seed" in verdict.hint


def test_ddp_training_loop_wrong_not_wrapped_in_ddp():
    verdict = exercise.ddp_training_loop(training(wrap=False))
    assert not verdict and "replicas differ" in verdict.detail
    assert "was the model wrapped in DDP?" in verdict.hint


def test_ddp_training_loop_wrong_optimizer_steps_nothing():
    verdict = exercise.ddp_training_loop(training(step=False))
    assert not verdict and "did not change" in verdict.detail and "opt.step()" in verdict.hint


def test_ddp_training_loop_wrong_returns_nothing():
    def no_return(dataset, make_model, epochs, batch_size, lr):
        training()(dataset, make_model, epochs, batch_size, lr)

    verdict = exercise.ddp_training_loop(no_return)
    assert not verdict and "returned NoneType" in verdict.detail
    assert "return model" in verdict.hint


# ---- ddp_global_accuracy ----------------------------------------------------------------------

def accuracy(*, reduce="counts", split="strided", world_in=None):
    """A distributed accuracy with one of the usual mistakes."""

    def acc(model, dataset):
        rank, world = dist.get_rank(), world_in or dist.get_world_size()
        if split == "strided":
            part = Subset(dataset, range(rank, len(dataset), world))
        elif split == "padded":
            part = Subset(dataset, list(DistributedSampler(dataset, shuffle=False)))
        else:
            part = dataset
        counts = torch.zeros(2)
        predictions = []
        with torch.no_grad():
            for x, y in DataLoader(part, batch_size=4):
                hits = model(x).argmax(1) == y
                predictions += hits.tolist()
                counts += torch.tensor([hits.sum().item(), len(y)])
        local = counts[0] / counts[1]
        if reduce == "counts":
            dist.all_reduce(counts)
            return (counts[0] / counts[1]).item()
        if reduce == "mean of accuracies":
            dist.all_reduce(local)
            return (local / world).item()
        if reduce == "sum of accuracies":
            dist.all_reduce(local)
            return local.item()
        if reduce == "rank 0":
            dist.broadcast(local, src=0)
            return local.item()
        if reduce == "weighted mean":  # right, until a slice is empty: 0/0 * 0 = nan
            seen = counts[1].clone()
            weighted = local * seen
            dist.all_reduce(weighted)
            dist.all_reduce(seen)
            return (weighted / seen).item()
        if reduce == "python division":  # the rank's own accuracy first: 0 / 0 on an empty slice
            mine = int(counts[0]) / int(counts[1])
            both = torch.tensor([mine * int(counts[1]), counts[1]])
            dist.all_reduce(both)
            return (both[0] / both[1]).item()
        if reduce == "empty rank leaves":
            if counts[1] == 0:
                return 0.0
            dist.all_reduce(counts)
            return (counts[0] / counts[1]).item()
        if reduce == "gather predictions":
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, predictions)
            flat = [p for part in every for p in part]
            return sum(flat) / len(flat)
        if reduce == "reduce and broadcast":
            dist.reduce(counts, dst=0)
            dist.broadcast(counts, src=0)
            return (counts[0] / counts[1]).item()
        if reduce == "mask":  # one number per sample, all-reduced: right, and n times the bytes
            mask = torch.zeros(len(dataset))
            for i, hit in zip(part.indices, predictions, strict=True):
                mask[i] = hit
            dist.all_reduce(mask)
            return mask.mean().item()
        return local.item()  # no reduction at all

    return acc


def test_ddp_global_accuracy_solution_passes():
    verdict = exercise.ddp_global_accuracy(solution("ddp_global_accuracy", "my_global_accuracy"))
    assert verdict and "on 2 and 4 ranks" in verdict.detail and "7/13" in verdict.detail


def test_ddp_global_accuracy_written_another_way_passes():
    def two_scalars(model, dataset):  # contiguous slices, two int64 all-reduces of one number
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = torch.arange(len(dataset)).tensor_split(world)[rank].tolist()
        correct, seen = torch.zeros((), dtype=torch.int64), torch.tensor(len(mine))
        for i in mine:
            x, y = dataset[i]
            correct += int(model(x[None]).argmax(1).item() == int(y))
        dist.all_reduce(correct)
        dist.all_reduce(seen)
        return correct.item() / seen.item()

    verdict = exercise.ddp_global_accuracy(two_scalars)
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def test_ddp_global_accuracy_wrong_averaged_accuracies():
    verdict = exercise.ddp_global_accuracy(accuracy(reduce="mean of accuracies"))
    assert not verdict and "on 2 ranks" in verdict.detail
    assert "mean of the slices' accuracies" in verdict.detail
    assert "7 and 6 samples" in verdict.hint and "sum the counts" in verdict.hint
    on_4 = exercise.ddp_global_accuracy(accuracy(reduce="mean of accuracies"), worlds=(4,))
    assert not on_4 and "mean of the slices' accuracies" in on_4.detail
    assert "4 and 3 samples" in on_4.hint


def test_ddp_global_accuracy_wrong_rank0_share():
    verdict = exercise.ddp_global_accuracy(accuracy(reduce="rank 0"))
    assert not verdict and "rank 0's share only" in verdict.detail


def test_ddp_global_accuracy_wrong_no_all_reduce():
    verdict = exercise.ddp_global_accuracy(accuracy(reduce=None))
    assert not verdict and "each its own slice" in verdict.detail
    assert "all_reduce the counts" in verdict.hint


def test_ddp_global_accuracy_wrong_summed_accuracies():
    verdict = exercise.ddp_global_accuracy(accuracy(reduce="sum of accuracies"))
    assert not verdict and "summed" in verdict.detail


def test_ddp_global_accuracy_wrong_padded_sampler():
    verdict = exercise.ddp_global_accuracy(accuracy(split="padded"))
    assert not verdict and "evaluated more than once" in verdict.detail
    assert "pads" in verdict.hint


def test_ddp_global_accuracy_wrong_world_written_in_shows_on_4_ranks_only():
    assert exercise.ddp_global_accuracy(accuracy(world_in=2), worlds=(2,))
    verdict = exercise.ddp_global_accuracy(accuracy(world_in=2))
    assert not verdict and "on 4 ranks" in verdict.detail
    assert "evaluated more than once" in verdict.detail and "overlap" in verdict.hint


def test_ddp_global_accuracy_wrong_not_split():
    verdict = exercise.ddp_global_accuracy(accuracy(split=None))
    assert not verdict and "the work was not split" in verdict.detail


def test_ddp_global_accuracy_wrong_nan_from_an_empty_slice():
    verdict = exercise.ddp_global_accuracy(accuracy(reduce="weighted mean"))
    assert not verdict and "on 2 ranks, 1 sample: " in verdict.detail
    assert "reported nan" in verdict.detail and "had an empty slice" in verdict.detail
    assert verdict.hint.startswith("an empty slice's own accuracy is 0 / 0")
    on_4 = exercise.ddp_global_accuracy(accuracy(reduce="weighted mean"), worlds=(4,))
    assert not on_4 and "on 4 ranks, 3 samples: " in on_4.detail and "rank 3 had" in on_4.detail


def test_ddp_global_accuracy_wrong_divides_by_zero_on_an_empty_slice():
    verdict = exercise.ddp_global_accuracy(accuracy(reduce="python division"))
    assert not verdict and "on 2 ranks, 1 sample" in verdict.detail
    assert "ZeroDivisionError" in verdict.detail
    assert verdict.hint.startswith("a rank whose slice is empty has seen 0 samples")


def test_ddp_global_accuracy_wrong_empty_rank_skips_the_all_reduce():
    # A hang costs its whole timeout: 5 s is ample for tiny all-reduces on warm ranks.
    verdict = exercise.ddp_global_accuracy(accuracy(reduce="empty rank leaves"), timeout=5.0)
    assert not verdict and "on 2 ranks, 1 sample" in verdict.detail
    assert verdict.hint.startswith("rank 1 returned without the all-reduce that rank 0 waits in")
    assert "a rank whose slice is empty too" in verdict.hint


@pytest.mark.parametrize("reduce, said, hinted", [
    ("gather predictions", "through all_gather", "no need to move the predictions"),
    ("reduce and broadcast", "through broadcast, reduce", "one all_reduce does in a single call"),
    ("mask", "52 bytes all-reduced in 1 call, for 13 samples", "two numbers are enough"),
])
def test_ddp_global_accuracy_wrong_route_with_the_right_value(reduce, said, hinted):
    verdict = exercise.ddp_global_accuracy(accuracy(reduce=reduce))
    assert not verdict and "the right accuracy, but" in verdict.detail and said in verdict.detail
    assert hinted in verdict.hint and "one all_reduce (SUM) of those two numbers" in verdict.hint
    if reduce == "gather predictions":
        on_4 = exercise.ddp_global_accuracy(accuracy(reduce=reduce), worlds=(4,))
        assert not on_4 and "on 4 ranks, 13 samples, rank 0" in on_4.detail


# ---- average_gradients ------------------------------------------------------------------------

def test_average_gradients_solution_passes():
    verdict = exercise.average_gradients(solution("average_gradients", "my_average_gradients"))
    assert verdict and "whole batch's gradient" in verdict.detail


def test_average_gradients_wrong_sum_not_mean():
    def summed(model):
        for p in model.parameters():
            dist.all_reduce(p.grad)

    verdict = exercise.average_gradients(summed)
    assert not verdict and "2x the whole batch's gradient" in verdict.detail  # caught on 2
    assert "divide by dist.get_world_size()" in verdict.hint


def test_average_gradients_wrong_no_all_reduce():
    def local_only(model):
        for p in model.parameters():
            p.grad /= dist.get_world_size()

    verdict = exercise.average_gradients(local_only)
    assert not verdict and "different gradients" in verdict.detail
    assert "dist.all_reduce(p.grad)" in verdict.hint


def test_average_gradients_wrong_one_parameter_left_out():
    def all_but_last(model):
        for p in list(model.parameters())[:-1]:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    verdict = exercise.average_gradients(all_but_last)
    assert not verdict and "parameters ['2.bias'] were not reduced" in verdict.detail


def test_average_gradients_wrong_grads_set_to_none():
    def dropped(model):
        for p in model.parameters():
            p.grad = None

    verdict = exercise.average_gradients(dropped)
    assert not verdict and "no .grad" in verdict.detail


def test_average_gradients_wrong_route_summed_twice_with_right_values():
    def twice(model):
        world = dist.get_world_size()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            dist.all_reduce(p.grad)  # world x the sum ...
            p.grad /= world * world  # ... divided back: the right numbers

    verdict = exercise.average_gradients(twice)
    assert not verdict and "the right gradients, but 424 bytes all-reduced for 212" \
        in verdict.detail
    assert "summing twice" in verdict.hint


def test_average_gradients_wrong_route_gathered_with_right_values():
    def gathered(model):
        world = dist.get_world_size()
        for p in model.parameters():
            parts = [torch.empty_like(p.grad) for _ in range(world)]
            dist.all_gather(parts, p.grad)
            p.grad.copy_(torch.stack(parts).mean(0))

    verdict = exercise.average_gradients(gathered)
    assert not verdict and "on 2 ranks, rank 0: the right gradients, but through all_gather " \
        "(424 bytes gathered for 212 bytes of gradients)" in verdict.detail
    assert verdict.hint.startswith("gathering every rank's gradients and taking their mean")
    on_4 = exercise.average_gradients(gathered, worlds=(4,))
    assert not on_4 and "on 4 ranks, rank 0" in on_4.detail and "848 bytes gathered" \
        in on_4.detail


def test_average_gradients_wrong_float32_buffer_in_a_float64_model():
    def float32_buffer(model):
        grads = [p.grad for p in model.parameters()]
        buffer = torch.zeros(sum(g.numel() for g in grads))  # float32, whatever the model
        buffer.copy_(torch.cat([g.reshape(-1) for g in grads]))
        dist.all_reduce(buffer)
        buffer /= dist.get_world_size()
        for g, part in zip(grads, buffer.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    verdict = exercise.average_gradients(float32_buffer)
    assert not verdict and "on 2 ranks (float64 model): the gradients are off by" \
        in verdict.detail and "float32 rounding" in verdict.detail
    assert "keep the gradients' dtype" in verdict.hint


def test_average_gradients_wrong_route_reduced_then_broadcast_with_right_values():
    def reduce_then_broadcast(model):
        for p in model.parameters():
            dist.reduce(p.grad, dst=0)
            dist.broadcast(p.grad, src=0)
            p.grad /= dist.get_world_size()

    verdict = exercise.average_gradients(reduce_then_broadcast, worlds=(4,))
    assert not verdict and "on 4 ranks" in verdict.detail
    assert "the right gradients, but through ['broadcast', 'reduce']" in verdict.detail
    assert "a reduce to one rank and a broadcast back" in verdict.hint


def test_average_gradients_written_another_way_passes():
    def flat(model):  # one flat all-reduce, the mean taken with ReduceOp.AVG's equal: a divide
        grads = [p.grad for p in model.parameters()]
        buffer = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(buffer)
        buffer /= dist.get_world_size()
        for g, part in zip(grads, buffer.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))

    verdict = exercise.average_gradients(flat)
    assert verdict and "on 2 and 4 ranks, float32 and float64" in verdict.detail


# ---- scaled_lr_warmup -------------------------------------------------------------------------

def test_scaled_lr_warmup_solution_passes():
    verdict = exercise.scaled_lr_warmup(solution("scaled_lr_warmup", "my_lr"))
    assert verdict and "4 schedules" in verdict.detail


def test_scaled_lr_warmup_wrong_not_scaled():
    def unscaled(step, global_batch, *, base_lr, base_batch, warmup_steps):
        return base_lr * min(1.0, (step + 1) / warmup_steps) if warmup_steps else base_lr

    verdict = exercise.scaled_lr_warmup(unscaled)
    assert not verdict and "not scaled by N" in verdict.detail
    assert "global_batch / base_batch" in verdict.hint


def test_scaled_lr_warmup_wrong_sqrt_scaling():
    def sqrt_rule(step, global_batch, *, base_lr, base_batch, warmup_steps):
        target = base_lr * (global_batch / base_batch) ** 0.5
        return target * min(1.0, (step + 1) / warmup_steps) if warmup_steps else target

    verdict = exercise.scaled_lr_warmup(sqrt_rule)
    assert not verdict and "sqrt" in verdict.detail


def test_scaled_lr_warmup_wrong_no_warmup():
    def no_ramp(step, global_batch, *, base_lr, base_batch, warmup_steps):
        return base_lr * global_batch / base_batch

    verdict = exercise.scaled_lr_warmup(no_ramp)
    assert not verdict and "full rate" in verdict.detail and "no warm-up" in verdict.hint


def test_scaled_lr_warmup_wrong_off_by_one():
    def from_zero(step, global_batch, *, base_lr, base_batch, warmup_steps):
        target = base_lr * global_batch / base_batch
        return target * min(1.0, step / warmup_steps) if warmup_steps else target

    verdict = exercise.scaled_lr_warmup(from_zero)
    assert not verdict and "step 0" in verdict.detail and "off by one" in verdict.hint


def test_scaled_lr_warmup_wrong_divides_by_zero_without_warmup():
    def always_ramps(step, global_batch, *, base_lr, base_batch, warmup_steps):
        return base_lr * global_batch / base_batch * min(1.0, (step + 1) / warmup_steps)

    verdict = exercise.scaled_lr_warmup(always_ramps)
    assert not verdict and "ZeroDivisionError" in verdict.detail


def test_scaled_lr_warmup_written_another_way_passes():
    def ramp(step, global_batch, *, base_lr, base_batch, warmup_steps):
        done = 1.0 if step >= warmup_steps - 1 else (step + 1) / warmup_steps
        return done * global_batch * base_lr / base_batch

    verdict = exercise.scaled_lr_warmup(ramp)
    assert verdict and "4 schedules" in verdict.detail


@pytest.mark.parametrize("ex_id", ["ddp_training_loop", "ddp_global_accuracy",
                                   "average_gradients", "scaled_lr_warmup"])
def test_the_untouched_cell_is_not_written_yet(ex_id):
    def untouched(*args, **kwargs):
        raise NotImplementedError("your code here")

    verdict = getattr(exercise, ex_id)(untouched)
    assert not verdict and "not written yet" in verdict.detail

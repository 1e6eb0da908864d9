"""Notebook 02's challenge (DDP from gradient buckets): the solution passes on 2 and 4 ranks,
known wrong answers (right values by a wrong route among them) get their hints, and a valid
answer written another way passes."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import data_parallel as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    return solution_namespace("02_data_parallelism", "bucketed_ddp")["my_bucketed_ddp"]


def _pack(model, bucket_numel):
    buckets = []
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        if buckets and sum(q.numel() for q in buckets[-1]) + p.numel() <= bucket_numel:
            buckets[-1].append(p)
        else:
            buckets.append([p])
    return buckets


def _write_back(flat, bucket, world):
    flat /= world
    for q, part in zip(bucket, flat.split([q.numel() for q in bucket]), strict=True):
        q.grad.copy_(part.view_as(q))


def _ddp(model, bucket_numel, *, when="full", divide=True, reset=True, buffer_dtype=None,
         per_parameter=False):
    """A bucketed DDP with one mistake switched on (``when``: full, end or wait)."""
    world = dist.get_world_size()
    buckets = [[p] for p in _pack(model, 10**9)[0]] if per_parameter else _pack(model,
                                                                                   bucket_numel)
    ready, pending, total = [0] * len(buckets), [], [0]
    n_params = sum(len(b) for b in buckets)

    def start(b):
        grads = [q.grad.reshape(-1) for q in buckets[b]]
        if buffer_dtype is None:
            flat = torch.cat(grads)
        else:
            flat = torch.zeros(sum(g.numel() for g in grads), dtype=buffer_dtype)
            flat.copy_(torch.cat(grads))
        pending.append((dist.all_reduce(flat, async_op=True), flat, buckets[b]))

    def hook_for(b):
        def hook(p):
            ready[b] += 1
            total[0] += 1
            if when == "full" and ready[b] == len(buckets[b]):
                if reset:
                    ready[b] = 0
                start(b)
            if when == "end" and total[0] == n_params:
                for k in range(len(buckets)):
                    start(k)
        return hook

    for b, bucket in enumerate(buckets):
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook_for(b))

    def wait():
        if when == "wait":
            for k in range(len(buckets)):
                start(k)
        for work, flat, bucket in pending:
            work.wait()
            if not divide:
                flat *= world
            _write_back(flat, bucket, world)
        pending.clear()
        ready[:] = [0] * len(buckets) if when != "full" else ready
        total[0] = 0

    return wait


def test_expected_buckets_follow_the_rule():
    assert [sum([48, 8, 64, 8, 24, 3][i] for i in b)
            for b in exercise._buckets([48, 8, 64, 8, 24, 3], 40)] == [35, 64, 8, 48]
    assert exercise._buckets([64, 8, 24, 3], 30) == [[3, 2], [1], [0]]


def test_bucketed_ddp_solution_passes_on_2_and_4_ranks():
    verdict = exercise.bucketed_ddp(_solution())
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def test_bucketed_ddp_untouched_is_not_written_yet():
    def my_bucketed_ddp(model, bucket_numel):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.bucketed_ddp(my_bucketed_ddp).detail


def _after_backward(model, bucket_numel):
    return _ddp(model, bucket_numel, when="wait")


def test_bucketed_ddp_wrong_route_all_reduce_after_backward():
    verdict = exercise.bucketed_ddp(_after_backward, worlds=(2,))
    assert not verdict and "4 of 4 all-reduces were started in wait()" in verdict.detail
    assert verdict.hint.startswith("start each bucket's all-reduce from a gradient hook")


def _at_the_end(model, bucket_numel):
    return _ddp(model, bucket_numel, when="end")


def test_bucketed_ddp_wrong_route_every_bucket_at_the_end_of_backward():
    verdict = exercise.bucketed_ddp(_at_the_end, worlds=(2,))
    assert not verdict and "0 of 4 all-reduces had started when backward reached the first " \
                           "layer" in verdict.detail
    assert verdict.hint.startswith("start a bucket as soon as its last gradient")


def _per_parameter(model, bucket_numel):
    return _ddp(model, bucket_numel, per_parameter=True)


def test_bucketed_ddp_wrong_route_one_all_reduce_per_parameter():
    verdict = exercise.bucketed_ddp(_per_parameter, worlds=(2,))
    assert not verdict and "all-reduces of [3, 24, 8, 64, 8, 48] elements; the buckets are " \
                           "[35, 64, 8, 48]" in verdict.detail
    assert verdict.hint.startswith("one all-reduce per parameter is what buckets avoid")


def _summed(model, bucket_numel):
    return _ddp(model, bucket_numel, divide=False)


def test_bucketed_ddp_wrong_sum_not_mean():
    verdict = exercise.bucketed_ddp(_summed, worlds=(4,))
    assert not verdict and "is 4x the global batch's gradient" in verdict.detail
    assert verdict.hint.startswith("all_reduce sums")


def _never_reset(model, bucket_numel):
    return _ddp(model, bucket_numel, reset=False)


def test_bucketed_ddp_wrong_hooks_not_rearmed_for_the_next_step():
    verdict = exercise.bucketed_ddp(_never_reset, worlds=(2,))
    assert not verdict and "step 1 all-reduced, step 2 issued no all-reduce" in verdict.detail
    assert "reset a bucket's count" in verdict.hint


def _float32_buffer(model, bucket_numel):
    return _ddp(model, bucket_numel, buffer_dtype=torch.float32)


def test_bucketed_ddp_wrong_float32_buffer_in_a_float64_model():
    verdict = exercise.bucketed_ddp(_float32_buffer, worlds=(2,))
    assert not verdict and "float64" in verdict.detail
    assert "went out as 4-byte numbers in a model of 8-byte ones" in verdict.detail
    assert verdict.hint.startswith("build each bucket's flat buffer in the gradients' dtype")


def _everything_in_wait(model, bucket_numel):
    def wait():  # no hooks: one all-reduce of every gradient once backward is over
        params = [p for p in model.parameters() if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        _write_back(flat, params, dist.get_world_size())

    return wait


def test_bucketed_ddp_wrong_one_all_reduce_of_everything_in_wait():
    verdict = exercise.bucketed_ddp(_everything_in_wait, worlds=(2,))
    assert not verdict and "all-reduces of [155] elements; the buckets are [35, 64, 8, 48]" \
        in verdict.detail
    assert verdict.hint.startswith("take the parameters with requires_grad in reverse order")


def _returns_nothing(model, bucket_numel):
    return None


def test_bucketed_ddp_wrong_returns_no_wait_function():
    verdict = exercise.bucketed_ddp(_returns_nothing, worlds=(2,))
    assert not verdict and "it returned NoneType, not a function" in verdict.detail


def _tensor_hooks(model, bucket_numel):
    """Valid, written differently: tensor hooks on the incoming gradients, divided before sending
    into one preallocated flat buffer per bucket, written back into .grad in wait()."""
    world = dist.get_world_size()
    buckets = _pack(model, bucket_numel)
    flats = [torch.empty(sum(p.numel() for p in b), dtype=b[0].dtype) for b in buckets]
    got = [dict() for _ in buckets]
    works = {}

    def on_grad(b, i, p):
        def hook(grad):
            got[b][i] = grad
            if len(got[b]) == len(buckets[b]):
                offsets = [0]
                for q in buckets[b]:
                    offsets.append(offsets[-1] + q.numel())
                for k in range(len(buckets[b])):
                    flats[b][offsets[k]:offsets[k + 1]] = got[b][k].reshape(-1) / world
                got[b].clear()
                works[b] = dist.all_reduce(flats[b], async_op=True)
            return grad
        return hook

    for b, bucket in enumerate(buckets):
        for i, p in enumerate(bucket):
            p.register_hook(on_grad(b, i, p))

    def wait():
        for b in sorted(works):
            works.pop(b).wait()
            start = 0
            for p in buckets[b]:
                p.grad = flats[b][start:start + p.numel()].view_as(p).clone()
                start += p.numel()

    return wait


def test_bucketed_ddp_valid_tensor_hooks_and_a_preallocated_buffer_pass():
    assert exercise.bucketed_ddp(_tensor_hooks)

"""Notebook 10's challenge (ZeRO-3's gather-and-free, one layer as an autograd Function): the
solution passes on 2 and 4 ranks, known wrong answers (right values by a wrong route, or with
ZeRO-2's memory, among them) get their hints, and a valid answer written another way passes."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import composition as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    return solution_namespace("10_composing_parallelism", "zero3_linear")["MyZero3Linear"]


def _gather(shard, in_f, out_f):
    full = shard.new_empty(shard.numel() * dist.get_world_size())
    dist.all_gather_into_tensor(full, shard.detach())
    n = in_f * out_f
    return full[:n].view(out_f, in_f), full[n:n + out_f]


def _flat_grad(grad_out, x, shard):
    flat = torch.cat([(grad_out.T @ x).reshape(-1), grad_out.sum(0)])
    return torch.cat([flat, flat.new_zeros(shard.numel() * dist.get_world_size() - len(flat))])


def test_zero3_linear_solution_passes_on_2_and_4_ranks():
    verdict = exercise.zero3_linear(_solution())
    assert verdict and "on 2 and 4 ranks, float32 and float64" in verdict.detail


def test_zero3_linear_untouched_is_not_written_yet():
    class MyZero3Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shard, in_features, out_features):
            raise NotImplementedError(check.PLACEHOLDER)

        @staticmethod
        def backward(ctx, grad_out):
            raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.zero3_linear(MyZero3Linear).detail


def test_zero3_linear_wrong_not_a_function_class():
    verdict = exercise.zero3_linear(lambda x, shard, i, o: x, worlds=(2,))
    assert not verdict and "not a torch.autograd.Function class" in verdict.detail


class KeepsWeights(torch.autograd.Function):
    """Right values, ZeRO-2's memory: the full weight kept from forward to backward."""

    @staticmethod
    def forward(ctx, x, shard, in_f, out_f):
        weight, bias = _gather(shard, in_f, out_f)
        ctx.save_for_backward(x, shard, weight)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, shard, weight = ctx.saved_tensors
        grad_shard = torch.empty_like(shard)
        dist.reduce_scatter_tensor(grad_shard, _flat_grad(grad_out, x, shard))
        return grad_out @ weight, grad_shard / dist.get_world_size(), None, None


def test_zero3_linear_wrong_keeps_the_full_weight_for_backward():
    verdict = exercise.zero3_linear(KeepsWeights, worlds=(2,), dtypes=("float32",))
    assert not verdict and "layer 1 keeps a tensor of shape (4, 5) (the weight)" in verdict.detail
    assert verdict.hint.startswith("free the full parameters after forward")


class AllReduced(torch.autograd.Function):
    """Right values by a wrong route: the full gradient all-reduced, then sliced."""

    @staticmethod
    def forward(ctx, x, shard, in_f, out_f):
        weight, bias = _gather(shard, in_f, out_f)
        ctx.save_for_backward(x, shard)
        ctx.f = (in_f, out_f)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        weight, _ = _gather(shard, *ctx.f)
        flat = _flat_grad(grad_out, x, shard)
        dist.all_reduce(flat)
        r, s = dist.get_rank(), shard.numel()
        return grad_out @ weight, flat[r * s:(r + 1) * s] / dist.get_world_size(), None, None


def test_zero3_linear_wrong_route_all_reduce_in_backward():
    verdict = exercise.zero3_linear(AllReduced, worlds=(4,), dtypes=("float64",))
    assert not verdict and "the backward all-reduced the gradients (4 calls)" in verdict.detail
    assert verdict.hint.startswith("an all-reduce hands every rank the whole averaged gradient")


class Summed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, in_f, out_f):
        weight, bias = _gather(shard, in_f, out_f)
        ctx.save_for_backward(x, shard)
        ctx.f = (in_f, out_f)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        weight, _ = _gather(shard, *ctx.f)
        grad_shard = torch.empty_like(shard)
        dist.reduce_scatter_tensor(grad_shard, _flat_grad(grad_out, x, shard))
        return grad_out @ weight, grad_shard, None, None


def test_zero3_linear_wrong_sum_not_mean():
    verdict = exercise.zero3_linear(Summed, worlds=(2,), dtypes=("float32",))
    assert not verdict and "shard gradient is 2x the global batch's" in verdict.detail
    assert verdict.hint.startswith("reduce-scatter sums over the ranks")


class NoShardGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shard, in_f, out_f):
        weight, bias = _gather(shard, in_f, out_f)
        ctx.save_for_backward(x, shard)
        ctx.f = (in_f, out_f)
        return x @ weight.T + bias

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        weight, _ = _gather(shard, *ctx.f)
        return grad_out @ weight, None, None, None


def test_zero3_linear_wrong_no_gradient_for_the_shard():
    verdict = exercise.zero3_linear(NoShardGradient, worlds=(2,), dtypes=("float32",))
    assert not verdict and "layer 1's shard has no gradient after backward" in verdict.detail


class ListGatherAutogradInside(torch.autograd.Function):
    """Valid, written differently: the list form of all-gather, and the layer's gradients
    taken by autograd itself inside backward (the layer recomputed on the gathered weights)."""

    @staticmethod
    def forward(ctx, x, shard, in_f, out_f):
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard.detach())
        full = torch.cat(parts)
        n = in_f * out_f
        ctx.save_for_backward(x, shard)
        ctx.f = (in_f, out_f)
        return torch.nn.functional.linear(x, full[:n].view(out_f, in_f), full[n:n + out_f])

    @staticmethod
    def backward(ctx, grad_out):
        x, shard = ctx.saved_tensors
        in_f, out_f = ctx.f
        world = dist.get_world_size()
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard.detach())
        full = torch.cat(parts).requires_grad_()
        x = x.detach().requires_grad_()
        n = in_f * out_f
        with torch.enable_grad():
            y = torch.nn.functional.linear(x, full[:n].view(out_f, in_f), full[n:n + out_f])
            grad_x, grad_full = torch.autograd.grad(y, (x, full), grad_out)
        grad_shard = torch.empty_like(shard)
        dist.reduce_scatter_tensor(grad_shard, grad_full.contiguous())
        return grad_x, grad_shard.div_(world), None, None


def test_zero3_linear_valid_list_gather_and_autograd_inside_pass():
    assert exercise.zero3_linear(ListGatherAutogradInside)

"""Notebook 09's sp_collectives grader: the solution passes, known wrong answers get their hint.

Every grading runs on 2 (and, once those pass, 4) warm gloo ranks; one pool per rank count
serves the whole file. Wrong routes (right values, other collectives or bytes) are judged per
class and step; the wrong answers of the route run on 2 and on 4 ranks alone (``worlds=``).
"""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit.exercises.sequence_context_expert import sequence as sq

from .fakes import solution_namespace

# The wrong answers below are shipped to the ranks by value, as a notebook's classes are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEM = "09_sequence_context_expert"


def _solution(name: str):
    """The objects the solution block of ``name`` defines, exec'd as the notebook would."""
    return solution_namespace(STEM, name)


def _fn(forward, backward):
    """An autograd Function from two plain functions of ``(ctx, tensor)``."""
    return type("Mine", (torch.autograd.Function,), {"forward": staticmethod(forward),
                                                      "backward": staticmethod(backward)})


# the pieces wrong answers are made of (default group, dim 0 unless said)

def _gather(ctx, x, dim=0):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _reduce_scatter(ctx, x):
    out = torch.empty_like(x.chunk(dist.get_world_size())[0])
    dist.reduce_scatter(out, list(x.contiguous().chunk(dist.get_world_size())))
    return out


def _all_reduce(ctx, x):
    x = x.clone()
    dist.all_reduce(x)
    return x


def _my_rows(ctx, x):
    return x.chunk(dist.get_world_size())[dist.get_rank()].contiguous()


def _identity(ctx, x):
    return x.view_as(x)


GATHER = _fn(_gather, _reduce_scatter)
SCATTER = _fn(_reduce_scatter, _gather)


def test_sp_collectives_solution_passes_on_2_and_4_ranks():
    ns = _solution("sp_collectives")
    verdict = sq.sp_collectives(ns["MyGatherSeq"], ns["MyScatterSeq"])
    assert verdict, verdict
    assert "on 2 and 4 gloo ranks" in verdict.detail


def test_sp_collectives_wrong_gather_backward_all_reduces():
    verdict = sq.sp_collectives(_fn(_gather, _all_reduce), SCATTER)
    assert not verdict and "a gradient for every token" in verdict.detail
    assert "only this rank's rows of the sum: a reduce-scatter" in verdict.hint


def test_sp_collectives_wrong_gather_backward_is_the_identity():
    verdict = sq.sp_collectives(_fn(_gather, _identity), SCATTER)
    assert not verdict and "incoming gradient unchanged" in verdict.detail
    assert "the backward of an all-gather is a reduce-scatter" in verdict.hint


def test_sp_collectives_wrong_gather_backward_slices_without_summing():
    verdict = sq.sp_collectives(_fn(_gather, _my_rows), SCATTER)
    assert not verdict and "without the other ranks' contributions" in verdict.detail
    assert "SUM over the ranks" in verdict.hint


def test_sp_collectives_wrong_gather_along_the_hidden_dim():
    verdict = sq.sp_collectives(_fn(lambda ctx, x: _gather(ctx, x, dim=-1), _reduce_scatter),
                                SCATTER)
    assert not verdict and "joined along the hidden dimension" in verdict.detail
    assert "gather along dim 0" in verdict.hint


def test_sp_collectives_wrong_scatter_divides_by_the_ranks():
    averaged = _fn(lambda ctx, x: _reduce_scatter(ctx, x) / dist.get_world_size(), _gather)
    verdict = sq.sp_collectives(GATHER, averaged)
    assert not verdict and "averaged the partial sums" in verdict.detail
    assert "reduce-scatter sums" in verdict.hint and "no division" in verdict.hint


def test_sp_collectives_wrong_scatter_forward_only_slices():
    verdict = sq.sp_collectives(GATHER, _fn(_my_rows, _gather))
    assert not verdict and "kept its own rows of its own partial sums" in verdict.detail
    assert "must be summed" in verdict.hint


def test_sp_collectives_wrong_scatter_backward_is_the_identity():
    verdict = sq.sp_collectives(GATHER, _fn(_reduce_scatter, _identity))
    assert not verdict and "the shard's" in verdict.detail
    assert "the backward of a reduce-scatter is an all-gather" in verdict.hint


# ---- right values by a wrong route: judged by the calls and bytes each step sent ------------

def _sum_then_my_rows(ctx, x):
    """All-reduce, then keep this rank's rows: the reduce-scatter's values for 2x its bytes."""
    return _my_rows(ctx, _all_reduce(ctx, x))


def _gathered_then_summed(ctx, x):
    """Every rank's whole gradient gathered, summed here, this rank's rows kept: right values,
    an all-gather where the reduce-scatter belongs (t times the whole tensor in)."""
    t = dist.get_world_size()
    parts = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(parts, x.contiguous())
    return _my_rows(ctx, torch.stack(parts).sum(0))


def _padded_all_reduce(ctx, x):
    """This rank's rows in a zero tensor of every rank's rows, all-reduced: an all-gather's
    values for 2x its bytes."""
    t, r = dist.get_world_size(), dist.get_rank()
    out = x.new_zeros((t * x.shape[0], *x.shape[1:]))
    out[r * x.shape[0]:(r + 1) * x.shape[0]] = x
    dist.all_reduce(out)
    return out


def _reduce_scatter_in_float32(ctx, x):
    """The right values (the probes' integers are exact in float32), but a float64 tensor
    converted to float32 for the collective: half the bytes of the tensor it should carry."""
    return _reduce_scatter(ctx, x.float()).to(x.dtype)


@pytest.mark.parametrize("world", [2, 4])
def test_sp_collectives_wrong_all_reduce_where_reduce_scatter_belongs(world):
    verdict = sq.sp_collectives(GATHER, _fn(_sum_then_my_rows, _gather), worlds=(world,))
    assert not verdict and f"on {world} ranks, float32" in verdict.detail
    assert "MyScatterSeq's forward gave the right values with all-reduce" in verdict.detail
    assert "2(t-1)/t" in verdict.hint and "reduce-scatter" in verdict.hint
    # the same in the gather's backward
    verdict = sq.sp_collectives(_fn(_gather, _sum_then_my_rows), SCATTER, worlds=(world,))
    assert not verdict and "MyGatherSeq's backward gave the right values with all-reduce" in \
        verdict.detail and "2(t-1)/t" in verdict.hint


@pytest.mark.parametrize("world", [2, 4])
def test_sp_collectives_wrong_all_gather_in_backward_where_reduce_scatter_belongs(world):
    verdict = sq.sp_collectives(_fn(_gather, _gathered_then_summed), SCATTER, worlds=(world,))
    assert not verdict and f"on {world} ranks" in verdict.detail
    assert "MyGatherSeq's backward gave the right values with all-gather" in verdict.detail
    assert "an all-gather where a reduce-scatter belongs" in verdict.hint
    # bytes: t - 1 times the whole tensor, against (t - 1) / t of it
    whole = world * 2 * 3 * 4 * 4
    assert f"({(world - 1) * whole:,} bytes sent)" in verdict.detail
    assert f"sends {(world - 1) * whole // world:,}" in verdict.detail


@pytest.mark.parametrize("world", [2, 4])
def test_sp_collectives_wrong_padded_all_reduce_where_all_gather_belongs(world):
    verdict = sq.sp_collectives(GATHER, _fn(_reduce_scatter, _padded_all_reduce), worlds=(world,))
    assert not verdict and "MyScatterSeq's backward gave the right values with all-reduce" in \
        verdict.detail
    assert "zero-padded" in verdict.hint and "all-gather" in verdict.hint


@pytest.mark.parametrize("world", [2, 4])
def test_sp_collectives_wrong_float64_converted_for_the_collective(world):
    verdict = sq.sp_collectives(GATHER, _fn(_reduce_scatter_in_float32, _gather),
                                worlds=(world,))
    whole = world * 2 * 3 * 4 * 8
    assert not verdict and f"on {world} ranks, float64" in verdict.detail
    assert f"carried a {whole // 2:,}-byte tensor; the whole tensor is {whole:,} bytes" in \
        verdict.detail and "in its own dtype" in verdict.hint


def _gather_into_float32(ctx, x):
    """A buffer made with torch.empty: float32 whatever x is."""
    out = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def test_sp_collectives_wrong_buffer_in_float32_fails_in_float64():
    verdict = sq.sp_collectives(_fn(_gather_into_float32, _reduce_scatter), SCATTER)
    assert not verdict and "on 2 ranks, float64" in verdict.detail
    assert "it passed in float32" in verdict.hint


def _gather_tensor(ctx, x):
    out = x.new_empty((dist.get_world_size() * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous())
    return out


def _reduce_scatter_tensor(ctx, x):
    out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous())
    return out


def test_sp_collectives_written_another_way_passes():
    """The tensor forms (all_gather_into_tensor, reduce_scatter_tensor), where the solution uses
    the list forms: the same route, every dtype and world."""
    verdict = sq.sp_collectives(_fn(_gather_tensor, _reduce_scatter_tensor),
                                _fn(_reduce_scatter_tensor, _gather_tensor))
    assert verdict, verdict
    assert "on 2 and 4 gloo ranks, in float32 and float64" in verdict.detail


def test_sp_collectives_wrong_not_classes_or_not_written():
    verdict = sq.sp_collectives(_gather, SCATTER)
    assert not verdict and "not a torch.autograd.Function subclass" in verdict.detail

    class Untouched(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            raise NotImplementedError("your code here")

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("your code here")

    verdict = sq.sp_collectives(Untouched, Untouched)
    assert not verdict and "not written yet" in verdict.detail

"""Notebook 09's sp_collectives grader: the solution passes, known wrong answers get their hint.

Every grading runs on 2 (and, once those pass, 4) warm gloo ranks; one pool per rank count
serves the whole file.
"""

from __future__ import annotations

import sys

import cloudpickle
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


def test_sp_collectives_wrong_all_reduce_then_slice_sends_twice_the_bytes():
    verdict = sq.sp_collectives(GATHER, _fn(lambda ctx, x: _my_rows(ctx, _all_reduce(ctx, x)),
                                            _gather))
    assert not verdict and "right numbers" in verdict.detail and "'all_reduce': 1" in \
        verdict.detail
    assert "2(t-1)/t" in verdict.hint


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

"""Notebook 09's challenge (the all-to-all autograd Function of expert parallelism): the
solution passes on 2 and 4 ranks, known wrong answers (right values by a wrong route among
them) get their hints, and a valid answer written another way passes."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import sequence_context_expert as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    return solution_namespace("09_sequence_context_expert", "all_to_all_function")["MyAllToAll"]


def _recv_counts(send_counts):
    recv = torch.empty(dist.get_world_size(), dtype=torch.int64)
    dist.all_to_all_single(recv, torch.tensor(send_counts, dtype=torch.int64))
    return recv.tolist()


def _rows(x, send_counts, recv_counts, dtype=None):
    out = torch.empty((sum(recv_counts), *x.shape[1:]), dtype=dtype or x.dtype)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts))
    return out


def test_all_to_all_function_solution_passes_on_2_and_4_ranks():
    verdict = exercise.all_to_all_function(_solution())
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def test_all_to_all_function_untouched_is_not_written_yet():
    class MyAllToAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, send_counts):
            raise NotImplementedError(check.PLACEHOLDER)

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.all_to_all_function(MyAllToAll).detail


def test_all_to_all_function_wrong_not_a_function_class():
    verdict = exercise.all_to_all_function(lambda x, counts: x, worlds=(2,))
    assert not verdict and "not a torch.autograd.Function class" in verdict.detail


class PointToPoint(torch.autograd.Function):
    """Right rows, wrong route: a message to each rank instead of one all-to-all."""

    @staticmethod
    def forward(ctx, x, send_counts):
        rank, world = dist.get_rank(), dist.get_world_size()
        recv_counts = _recv_counts(send_counts)
        out = x.new_empty((sum(recv_counts), x.shape[1]))
        ins, outs = x.split(send_counts), out.split(recv_counts)
        works = []
        for peer in range(world):
            if peer == rank:
                outs[peer].copy_(ins[peer])
            else:
                works += [dist.isend(ins[peer].contiguous(), peer), dist.irecv(outs[peer], peer)]
        for work in works:
            work.wait()
        ctx.counts = (list(send_counts), recv_counts)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return _rows(grad, recv_counts, send_counts), None


def test_all_to_all_function_wrong_route_point_to_point_messages():
    verdict = exercise.all_to_all_function(PointToPoint, worlds=(2,))
    assert not verdict and "the forward called recv, send" in verdict.detail
    assert verdict.hint.startswith("an all-to-all sends each rank only the rows meant for it")


class CountsAgain(torch.autograd.Function):
    """Right gradients, wrong route: the backward exchanges the counts once more."""

    @staticmethod
    def forward(ctx, x, send_counts):
        ctx.send_counts = list(send_counts)
        return _rows(x, send_counts, _recv_counts(send_counts))

    @staticmethod
    def backward(ctx, grad):
        return _rows(grad, _recv_counts(ctx.send_counts), ctx.send_counts), None


def test_all_to_all_function_wrong_route_backward_exchanges_counts_again():
    verdict = exercise.all_to_all_function(CountsAgain, worlds=(4,))
    assert not verdict and "the backward made 2 all-to-alls" in verdict.detail
    assert verdict.hint.startswith("backward already knows both split sizes")


class Float32Rows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts):
        recv = _recv_counts(send_counts)
        ctx.counts = (list(send_counts), recv)
        return _rows(x.float(), send_counts, recv, dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        return _rows(grad, recv_counts, send_counts), None


def test_all_to_all_function_wrong_float32_rows_for_float64_input():
    verdict = exercise.all_to_all_function(Float32Rows, worlds=(2,))
    assert not verdict and "forward returned torch.float32 rows for torch.float64" in \
        verdict.detail
    assert verdict.hint.startswith("allocate the output with x.new_empty")


class NoGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts):
        return _rows(x, send_counts, _recv_counts(send_counts))

    @staticmethod
    def backward(ctx, grad):
        return None, None


def test_all_to_all_function_wrong_backward_returns_no_gradient():
    verdict = exercise.all_to_all_function(NoGradient, worlds=(2,))
    assert not verdict and "x.grad is None after backward" in verdict.detail


class GradientsKept(torch.autograd.Function):
    """Backward does the exchange but keeps the received gradients in sent order: on the
    `rank 0 sends nothing` case the shapes agree and the rows are someone else's."""

    @staticmethod
    def forward(ctx, x, send_counts):
        recv = _recv_counts(send_counts)
        ctx.counts = (list(send_counts), recv)
        return _rows(x, send_counts, recv)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        back = _rows(grad, recv_counts, send_counts)
        return back.flip(0), None


def test_all_to_all_function_wrong_gradient_rows_in_the_wrong_place():
    verdict = exercise.all_to_all_function(GradientsKept, worlds=(2,))
    assert not verdict and "x.grad is not the gradient of the rows x sent" in verdict.detail
    assert verdict.hint.startswith("backward sends each gradient row home")


class ListForm(torch.autograd.Function):
    """Valid, written differently: the counts by the list form of all-to-all (one tensor per
    rank), the split sizes saved as tensors, the outputs zero-filled (gloo's list form needs
    equal sizes, so the rows stay one all_to_all_single)."""

    @staticmethod
    def forward(ctx, x, send_counts):
        world = dist.get_world_size()
        theirs = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_to_all(theirs, [torch.tensor([c]) for c in send_counts])
        recv_counts = torch.cat(theirs)
        ctx.save_for_backward(torch.tensor(send_counts), recv_counts)
        out = x.new_zeros((int(recv_counts.sum()), x.shape[1]))
        dist.all_to_all_single(out, x, recv_counts.tolist(), list(send_counts))
        return out

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.saved_tensors
        back = grad.new_zeros((int(send_counts.sum()), grad.shape[1]))
        dist.all_to_all_single(back, grad.contiguous(), send_counts.tolist(),
                               recv_counts.tolist())
        return back, None


def test_all_to_all_function_valid_list_form_passes():
    assert exercise.all_to_all_function(ListForm)

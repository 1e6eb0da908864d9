"""Notebook 03's challenge (a GPipe step on real stages): the solution passes on 2 and 4 ranks,
known wrong answers (right values by a wrong route among them) get their hints, and a valid
answer written another way passes."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import model_parallel as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    return solution_namespace("03_model_parallelism", "gpipe_runner")["my_gpipe_step"]


def _step(stage, x, y, rows, width, m, loss_fn, *, scale="rows", interleave=False,
          dtype=None):
    """A pipeline step with one mistake switched on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    dtype = dtype or next(stage.parameters()).dtype
    sizes = [len(p) for p in torch.arange(rows).tensor_split(m)]
    inputs, outputs, sends, loss = [], [], [], 0.0

    def forward(i, n):
        if first:
            inp = x.tensor_split(m)[i]
        else:
            inp = torch.empty(n, width, dtype=dtype)
            dist.recv(inp, src=rank - 1)
            inp.requires_grad_()
        out = stage(inp)
        if last:
            factor = {"rows": n / rows, "m": 1 / m, "none": 1.0}[scale]
            out = loss_fn(out, y.tensor_split(m)[i]) * factor
        else:
            sends.append(dist.isend(out.detach(), dst=rank + 1))
        inputs.append(inp)
        outputs.append(out)

    def backward(i):
        nonlocal loss
        if last:
            outputs[i].backward()
            loss += outputs[i].item()
        else:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=rank + 1)
            outputs[i].backward(grad)
        if not first:
            sends.append(dist.isend(inputs[i].grad, dst=rank - 1))

    if interleave:
        for i, n in enumerate(sizes):
            forward(i, n)
            backward(i)
    else:
        for i, n in enumerate(sizes):
            forward(i, n)
        for i in range(m):
            backward(i)
    for work in sends:
        work.wait()
    return loss if last else None


def test_gpipe_runner_solution_passes_on_2_and_4_ranks():
    verdict = exercise.gpipe_runner(_solution())
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def test_gpipe_runner_untouched_is_not_written_yet():
    def my_gpipe_step(stage, x, y, rows, width, m, loss_fn):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.gpipe_runner(my_gpipe_step).detail


def _one_at_a_time(stage, x, y, rows, width, m, loss_fn):
    return _step(stage, x, y, rows, width, m, loss_fn, interleave=True)


def test_gpipe_runner_wrong_route_each_micro_batch_forward_then_backward():
    verdict = exercise.gpipe_runner(_one_at_a_time, worlds=(2,))
    assert not verdict and "exchanged a backward message before its last forward one" in \
        verdict.detail
    assert verdict.hint.startswith("that is not GPipe's order")


def _whole_batch(stage, x, y, rows, width, m, loss_fn):
    return _step(stage, x, y, rows, width, 1, loss_fn)


def test_gpipe_runner_wrong_route_no_micro_batches():
    verdict = exercise.gpipe_runner(_whole_batch, worlds=(2,))
    assert not verdict and "rank 0 sent 1 and received 1 messages (one message of the whole " \
                           "batch: no micro-batches); with m = 3" in verdict.detail


def _divided_by_m(stage, x, y, rows, width, m, loss_fn):
    return _step(stage, x, y, rows, width, m, loss_fn, scale="m")


def test_gpipe_runner_wrong_loss_divided_by_m_with_uneven_micro_batches():
    verdict = exercise.gpipe_runner(_divided_by_m, worlds=(2,))
    assert not verdict and "(micro-batches of [3, 2, 2] rows)" in verdict.detail
    assert verdict.hint.startswith("with micro-batches of unequal rows, dividing each loss by m")


def _unscaled(stage, x, y, rows, width, m, loss_fn):
    return _step(stage, x, y, rows, width, m, loss_fn, scale="none")


def test_gpipe_runner_wrong_losses_not_scaled_even_micro_batches():
    verdict = exercise.gpipe_runner(_unscaled, worlds=(4,))
    assert not verdict and "differ from the whole batch's" in verdict.detail  # uneven case first
    assert "scale micro-batch i's loss by rows_i / rows" in verdict.hint


def _float32_buffers(stage, x, y, rows, width, m, loss_fn):
    return _step(stage, x, y, rows, width, m, loss_fn, dtype=torch.float32)


def test_gpipe_runner_wrong_float32_buffers_for_a_float64_stage():
    verdict = exercise.gpipe_runner(_float32_buffers, worlds=(2,))
    assert not verdict and "on 2 ranks" in verdict.detail
    assert "of the stage's dtype" in verdict.hint


def _backwards_reversed_batched(stage, x, y, rows, width, m, loss_fn):
    """Valid, written differently: irecv and batched sends, the backwards in reverse order,
    each micro-batch's loss as a sum over its elements divided by the batch's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    prev, nxt = rank - 1 if rank else None, rank + 1 if rank < world - 1 else None
    dtype = next(stage.parameters()).dtype
    parts = torch.arange(rows).tensor_split(m)
    saved, pending = {}, []
    for i, idx in enumerate(parts):
        if prev is None:
            inp = x[idx]
        else:
            inp = torch.empty(len(idx), width, dtype=dtype)
            dist.irecv(inp, prev).wait()
            inp.requires_grad_()
        out = stage(inp)
        if nxt is None:
            out = loss_fn(out, y[idx], reduction="sum") / (rows * width)
        else:
            pending += dist.batch_isend_irecv([dist.P2POp(dist.isend, out.detach(), nxt)])
        saved[i] = (inp, out)
    total = 0.0
    for i in reversed(range(m)):
        inp, out = saved.pop(i)
        if nxt is None:
            out.backward()
            total += out.item()
        else:
            grad = torch.empty_like(out)
            dist.irecv(grad, nxt).wait()
            out.backward(grad)
        if prev is not None:
            pending += dist.batch_isend_irecv([dist.P2POp(dist.isend, inp.grad, prev)])
    for work in pending:
        work.wait()
    return total if nxt is None else None


def test_gpipe_runner_valid_reverse_backwards_batched_sends_pass():
    assert exercise.gpipe_runner(_backwards_reversed_batched)

"""Notebook 10's ZeRO-1 grader: the solution passes, known wrong answers get their hint.

The grader runs on 2 and then 4 warm gloo ranks; a wrong answer is usually caught on 2.
"""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit.exercises.composition import zero as grader

from .fakes import solution_namespace

# The wrong answers below run on the ranks: ship them by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEM = "10_composing_parallelism"


def _solution(name: str):
    """The object the solution block of ``name`` defines, exec'd as the notebook would."""
    return solution_namespace(STEM, name)


def _scatter(flat_grad, average=True):
    """This rank's slice of the sum (or the average) of ``flat_grad`` over the ranks."""
    world = dist.get_world_size()
    out = torch.empty(flat_grad.numel() // world)
    dist.reduce_scatter_tensor(out, flat_grad)
    return out / world if average else out


def _mine(flat_params):
    n = flat_params.numel() // dist.get_world_size()
    return slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)


def test_zero1_step_solution_passes_on_2_and_4_ranks():
    verdict = grader.zero1_step(_solution("zero1_step")["my_zero1_step"])
    assert verdict, verdict
    assert "on 2 and 4 gloo ranks" in verdict.detail
    assert "1,184 and 1,776 bytes" in verdict.detail  # 296 floats: (n-1)/n * 1184 * 2


def test_zero1_step_wrong_all_reduce_instead_of_reduce_scatter():
    def all_reduce(flat_params, flat_grad, update_shard):
        dist.all_reduce(flat_grad)
        flat_grad /= dist.get_world_size()
        mine = _mine(flat_params)
        dist.all_gather_into_tensor(flat_params, update_shard(flat_params[mine], flat_grad[mine]))

    verdict = grader.zero1_step(all_reduce)
    assert not verdict and "right parameters, but the gradient went through an all-reduce" \
        in verdict.detail
    assert "every rank held the full averaged gradient" in verdict.hint


def test_zero1_step_wrong_forgot_to_average():
    def summed(flat_params, flat_grad, update_shard):
        new = update_shard(flat_params[_mine(flat_params)], _scatter(flat_grad, average=False))
        dist.all_gather_into_tensor(flat_params, new)

    verdict = grader.zero1_step(summed)
    assert not verdict and "2 times the average" in verdict.detail
    assert verdict.hint.startswith("forgot to average")


def test_zero1_step_wrong_shard_offset():
    def offset_by_rank(flat_params, flat_grad, update_shard):
        n, r = flat_params.numel() // dist.get_world_size(), dist.get_rank()
        new = update_shard(flat_params[r:r + n], _scatter(flat_grad))  # rank, not rank * n
        dist.all_gather_into_tensor(flat_params, new)

    verdict = grader.zero1_step(offset_by_rank)
    assert not verdict and "rank 1" in verdict.detail
    assert verdict.hint.startswith("updated the wrong shard") and "rank * shard" in verdict.hint


def test_zero1_step_wrong_shard_of_another_rank():
    def always_shard_0(flat_params, flat_grad, update_shard):
        n = flat_params.numel() // dist.get_world_size()
        new = update_shard(flat_params[:n], _scatter(flat_grad))
        dist.all_gather_into_tensor(flat_params, new)

    verdict = grader.zero1_step(always_shard_0)
    assert not verdict and "updated shard 0, not its own shard 1" in verdict.detail
    assert verdict.hint.startswith("updated the wrong shard")


def test_zero1_step_wrong_forgot_the_all_gather():
    def no_gather(flat_params, flat_grad, update_shard):
        mine = _mine(flat_params)
        flat_params[mine] = update_shard(flat_params[mine], _scatter(flat_grad))

    verdict = grader.zero1_step(no_gather)
    assert not verdict and "the ranks' parameters diverge" in verdict.detail
    assert verdict.hint.startswith("forgot the all-gather")


def _ring_all_gather(flat, mine_index):
    """Notebook 06's ring all-gather with isend/irecv: every rank's shard, in rank order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(flat.chunk(world))
    for s in range(world - 1):
        send, into = chunks[(mine_index - s) % world], chunks[(mine_index - s - 1) % world]
        for work in (dist.isend(send, (rank + 1) % world), dist.irecv(into, (rank - 1) % world)):
            work.wait()


def test_zero1_step_gathered_by_an_isend_irecv_ring_passes():
    def ring(flat_params, flat_grad, update_shard):
        mine = _mine(flat_params)
        flat_params[mine] = update_shard(flat_params[mine], _scatter(flat_grad))
        _ring_all_gather(flat_params, dist.get_rank())

    verdict = grader.zero1_step(ring)
    assert verdict, verdict
    assert "1,184 and 1,776 bytes" in verdict.detail


def test_zero1_step_wrong_parameters_gathered_with_an_all_reduce():
    def all_reduce_gather(flat_params, flat_grad, update_shard):
        mine = _mine(flat_params)
        new = update_shard(flat_params[mine], _scatter(flat_grad))
        flat_params.zero_()
        flat_params[mine] = new
        dist.all_reduce(flat_params)  # the other shards are zero here: a sum gathers them

    verdict = grader.zero1_step(all_reduce_gather)
    assert not verdict and "right parameters, but gathered with an all-reduce" in verdict.detail
    assert "1,184 bytes sent after update_shard, where an all-gather sends 592" in verdict.detail
    assert "forgot the all-gather" not in verdict.hint and "twice" in verdict.hint


def test_zero1_step_wrong_gathered_before_updating():
    def gather_first(flat_params, flat_grad, update_shard):
        mine = _mine(flat_params)
        grad = _scatter(flat_grad)
        dist.all_gather_into_tensor(flat_params, flat_params[mine].clone())
        flat_params[mine] = update_shard(flat_params[mine], grad)

    verdict = grader.zero1_step(gather_first)
    assert not verdict and "before update_shard ran" in verdict.detail
    assert verdict.hint.startswith("all-gathered before updating")


def test_zero1_step_wrong_broadcast_from_rank_0():
    def broadcast(flat_params, flat_grad, update_shard):
        mine = _mine(flat_params)
        flat_params[mine] = update_shard(flat_params[mine], _scatter(flat_grad))
        dist.broadcast(flat_params, src=0)

    verdict = grader.zero1_step(broadcast)
    assert not verdict and "every rank ends with rank 0's copy" in verdict.detail
    assert "a broadcast from rank 0" in verdict.hint


def test_zero1_step_wrong_not_in_place():
    def returns_a_copy(flat_params, flat_grad, update_shard):
        out = torch.empty_like(flat_params)
        dist.all_gather_into_tensor(out, update_shard(flat_params[_mine(flat_params)],
                                                      _scatter(flat_grad)))
        return out

    verdict = grader.zero1_step(returns_a_copy)
    assert not verdict and "flat_params was left as it was" in verdict.detail
    assert "in place" in verdict.hint


def test_zero1_step_wrong_update_called_on_the_whole_model():
    def whole_model(flat_params, flat_grad, update_shard):
        flat_params.copy_(update_shard(flat_params, flat_grad))

    verdict = grader.zero1_step(whole_model)
    assert not verdict and "update_shard got shards of shapes (296,) and (296,)" in verdict.detail
    assert "numel // world elements" in verdict.hint


def test_zero1_step_wrong_not_written_yet_is_seen_without_running():
    def untouched(flat_params, flat_grad, update_shard):
        raise NotImplementedError("your code here")

    verdict = grader.zero1_step(untouched)
    assert not verdict and "not written yet" in verdict.detail

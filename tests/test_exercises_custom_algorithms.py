"""Notebook 06's graders: the reference solutions pass, known wrong answers get their hints."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit import check, exercises
from labkit.exercises import custom_algorithms as exercise
from labkit.parallel import compression, parameter_server

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


@pytest.fixture(scope="module")
def solved():
    """The reference solutions, run as the solution notebook runs them."""
    namespace = {"__name__": "solutions_06", "torch": torch, "dist": dist}
    for block in exercises.solution_blocks("06_custom_algorithms").values():
        exec(block, namespace)
    return namespace


def _swap(send, dst, recv, src):
    """Send and receive at once (what the right answers do), for the wrong answers below."""
    for work in (dist.isend(send, dst), dist.irecv(recv, src)):
        work.wait()


# ---- ring_reduce_scatter ------------------------------------------------------------------------

def test_ring_reduce_scatter_reference_passes(solved):
    verdict = exercise.ring_reduce_scatter(solved["my_reduce_scatter"])
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def test_ring_reduce_scatter_untouched_is_not_written_yet():
    def my_reduce_scatter(chunks, rank, world):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.ring_reduce_scatter(my_reduce_scatter).detail


def _rs_blocking_send(chunks, rank, world):
    for s in range(world - 1):
        buf = torch.empty_like(chunks[(rank - s - 1) % world])
        dist.send(chunks[(rank - s) % world], (rank + 1) % world)
        dist.recv(buf, (rank - 1) % world)
        chunks[(rank - s - 1) % world] += buf


def test_ring_reduce_scatter_wrong_blocking_send_is_a_deadlock(monkeypatch):
    monkeypatch.setattr(exercise, "TIMEOUT", 5.0)
    verdict = exercise.ring_reduce_scatter(_rs_blocking_send, worlds=(2,))
    assert not verdict and "still running after 5 s" in verdict.detail
    assert verdict.hint.startswith("deadlock: both ranks used blocking send first")


def _rs_one_step_late(chunks, rank, world):
    for s in range(world - 1):
        into = chunks[(rank - s - 2) % world]
        buf = torch.empty_like(into)
        _swap(chunks[(rank - s - 1) % world], (rank + 1) % world, buf, (rank - 1) % world)
        into += buf


def test_ring_reduce_scatter_wrong_indices_off_by_one_step():
    verdict = exercise.ring_reduce_scatter(_rs_one_step_late)
    assert not verdict and verdict.hint.startswith("chunk indices off by one step: at step s "
                                                   "rank r sends chunk (r - s) mod n")
    assert "your ring completed chunk 0 instead" in verdict.detail  # rank 0 finished its own


def _rs_wrong_direction(chunks, rank, world):
    for s in range(world - 1):
        into = chunks[(rank + s + 1) % world]
        buf = torch.empty_like(into)
        _swap(chunks[(rank + s) % world], (rank + 1) % world, buf, (rank - 1) % world)
        into += buf


def test_ring_reduce_scatter_wrong_direction_shows_on_4_ranks_only():
    assert exercise.ring_reduce_scatter(_rs_wrong_direction, worlds=(2,))  # r + s = r - s mod 2
    verdict = exercise.ring_reduce_scatter(_rs_wrong_direction)
    assert not verdict and "on 4 ranks" in verdict.detail  # chunks of 3 into buffers of 2
    assert verdict.hint.startswith("a chunk arrived into a buffer of another size")
    assert "chunk indices off by one step" in verdict.hint


def _rs_received_into_the_chunk(chunks, rank, world):
    for s in range(world - 1):
        _swap(chunks[(rank - s) % world], (rank + 1) % world, chunks[(rank - s - 1) % world],
              (rank - 1) % world)


def test_ring_reduce_scatter_wrong_own_chunk_not_added():
    verdict = exercise.ring_reduce_scatter(_rs_received_into_the_chunk)
    assert not verdict and verdict.hint.startswith("rank r's own chunk not added")
    assert "holds each rank's entry [0, 1] times" in verdict.detail


def _rs_out_of_place(chunks, rank, world):
    for s in range(world - 1):
        j = (rank - s - 1) % world
        buf = torch.empty_like(chunks[j])
        _swap(chunks[(rank - s) % world], (rank + 1) % world, buf, (rank - 1) % world)
        chunks[j] = chunks[j] + buf


def test_ring_reduce_scatter_wrong_new_tensor_not_in_place():
    verdict = exercise.ring_reduce_scatter(_rs_out_of_place)
    assert not verdict and "no longer view the tensor" in verdict.detail
    assert verdict.hint.startswith("work in place")


def _rs_adds_own_twice(chunks, rank, world):
    for s in range(world - 1):
        into = chunks[(rank - s - 1) % world]
        buf = torch.empty_like(into)
        _swap(chunks[(rank - s) % world], (rank + 1) % world, buf, (rank - 1) % world)
        into += buf + into


def test_ring_reduce_scatter_wrong_contribution_added_twice():
    verdict = exercise.ring_reduce_scatter(_rs_adds_own_twice, worlds=(2,))
    assert not verdict and "[2, 1] times" in verdict.detail
    assert verdict.hint.startswith("a contribution was added twice")


def _rs_batched(chunks, rank, world):
    """Valid, written another way: batch_isend_irecv, the received chunk added with add_."""
    for s in range(world - 1):
        into = chunks[(rank - s - 1) % world]
        buf = torch.zeros_like(into)
        ops = [dist.P2POp(dist.irecv, buf, (rank - 1) % world),  # the receive listed first
               dist.P2POp(dist.isend, chunks[(rank - s) % world], (rank + 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        into.add_(buf)


def test_ring_reduce_scatter_written_another_way_passes():
    assert exercise.ring_reduce_scatter(_rs_batched)


def _rs_by_all_reduce(chunks, rank, world):
    for chunk in chunks:  # every chunk summed everywhere: right values, not the ring
        dist.all_reduce(chunk)


def test_ring_reduce_scatter_wrong_route_a_collective():
    verdict = exercise.ring_reduce_scatter(_rs_by_all_reduce, worlds=(2,))
    assert not verdict and "right values, but through all_reduce" in verdict.detail
    assert "point-to-point messages" in verdict.hint


def _rs_one_step_too_many(chunks, rank, world):
    """The ring's n - 1 steps, then one more that sends and discards: right values."""
    _rs_batched(chunks, rank, world)
    _swap(chunks[rank], (rank + 1) % world, torch.empty_like(chunks[(rank - 1) % world]),
          (rank - 1) % world)


def test_ring_reduce_scatter_wrong_one_step_too_many():
    verdict = exercise.ring_reduce_scatter(_rs_one_step_too_many)
    assert not verdict and "2 messages sent and 2 received; the ring on 2 ranks takes 1 " \
        "steps" in verdict.detail
    assert verdict.hint.startswith("one step too many: the ring takes n - 1 steps")


def _rs_float32_buffer(chunks, rank, world):
    for s in range(world - 1):
        into = chunks[(rank - s - 1) % world]
        buf = torch.empty(into.shape)  # float32 whatever the chunk's dtype
        _swap(chunks[(rank - s) % world], (rank + 1) % world, buf, (rank - 1) % world)
        into += buf


def test_ring_reduce_scatter_wrong_buffer_dtype_is_named():
    verdict = exercise.ring_reduce_scatter(_rs_float32_buffer, worlds=(2,))
    assert not verdict and "buffer of another size or dtype" in verdict.hint
    assert "torch.empty_like(chunk)" in verdict.hint


# ---- ring_all_gather ----------------------------------------------------------------------------

def test_ring_all_gather_reference_passes(solved):
    verdict = exercise.ring_all_gather(solved["my_all_gather"])
    assert verdict and "every rank ends with every finished chunk" in verdict.detail


def _ag_adds(chunks, rank, world):
    for s in range(world - 1):
        into = chunks[(rank - s) % world]
        buf = torch.empty_like(into)
        _swap(chunks[(rank + 1 - s) % world], (rank + 1) % world, buf, (rank - 1) % world)
        into += buf


def test_ring_all_gather_wrong_added_instead_of_copied():
    verdict = exercise.ring_all_gather(_ag_adds)
    assert not verdict and "plus a stale partial sum" in verdict.detail
    assert verdict.hint.startswith("added instead of copied")


def _ag_sends_the_unfinished(chunks, rank, world):
    for s in range(world - 1):
        _swap(chunks[(rank - s) % world], (rank + 1) % world, chunks[(rank - 1 - s) % world],
              (rank - 1) % world)


def test_ring_all_gather_wrong_chunk_sent():
    verdict = exercise.ring_all_gather(_ag_sends_the_unfinished)
    assert not verdict and "never arrived finished" in verdict.detail
    assert verdict.hint.startswith("at step s rank r sends chunk (r + 1 - s) mod n")


def _ag_out_of_place(chunks, rank, world):
    for s in range(world - 1):
        j = (rank - s) % world
        buf = torch.empty_like(chunks[j])
        _swap(chunks[(rank + 1 - s) % world], (rank + 1) % world, buf, (rank - 1) % world)
        chunks[j] = buf


def test_ring_all_gather_wrong_new_tensor_not_in_place():
    verdict = exercise.ring_all_gather(_ag_out_of_place, worlds=(2,))
    assert not verdict and verdict.hint.startswith("work in place")


def _ag_one_step_too_many(chunks, rank, world):
    """n steps instead of n - 1: the last one copies a finished chunk again, values right."""
    for s in range(world):
        _swap(chunks[(rank + 1 - s) % world], (rank + 1) % world, chunks[(rank - s) % world],
              (rank - 1) % world)


def test_ring_all_gather_wrong_one_step_too_many_has_right_values():
    verdict = exercise.ring_all_gather(_ag_one_step_too_many)
    assert not verdict and "on 2 ranks" in verdict.detail
    assert "2 messages sent and 2 received; the ring on 2 ranks takes 1 steps" in verdict.detail
    assert verdict.hint.startswith("one step too many")


def _ag_direct(chunks, rank, world):
    """Each rank sends its finished chunk straight to every other rank: right values, no ring."""
    mine = (rank + 1) % world
    works = []
    for k in range(1, world):
        works.append(dist.isend(chunks[mine], (rank + k) % world))
        works.append(dist.irecv(chunks[(rank - k + 1) % world], (rank - k) % world))
    for work in works:
        work.wait()


def test_ring_all_gather_wrong_route_messages_to_every_rank():
    assert exercise.ring_all_gather(_ag_direct, worlds=(2,))  # on 2 ranks it is the ring
    verdict = exercise.ring_all_gather(_ag_direct)
    assert not verdict and "on 4 ranks" in verdict.detail
    assert "sent to ranks [1, 2, 3]" in verdict.detail and "a ring sends only to rank 1" \
        in verdict.detail
    assert verdict.hint.startswith("right values, but not the ring")


def _ag_by_broadcast(chunks, rank, world):
    for j, chunk in enumerate(chunks):  # chunk j is finished on rank j - 1
        dist.broadcast(chunk, (j - 1) % world)


def test_ring_all_gather_wrong_route_a_collective():
    verdict = exercise.ring_all_gather(_ag_by_broadcast, worlds=(4,))
    assert not verdict and "right values, but through broadcast" in verdict.detail


def _ag_via_buffer(chunks, rank, world):
    """Valid, written another way: receive into a buffer, copy_ it into place."""
    for s in range(world - 1):
        into = chunks[(rank - s) % world]
        buf = torch.empty_like(into)
        _swap(chunks[(rank + 1 - s) % world], (rank + 1) % world, buf, (rank - 1) % world)
        into.copy_(buf)


def test_ring_all_gather_written_another_way_passes():
    assert exercise.ring_all_gather(_ag_via_buffer)


# ---- topk_error_feedback ------------------------------------------------------------------------

def test_topk_error_feedback_reference_passes(solved):
    verdict = exercise.topk_error_feedback(solved["my_compress"])
    assert verdict and "nothing lost, only delayed" in verdict.detail


def test_topk_error_feedback_by_sorting_passes():
    """Written another way: the k largest by a sort, the residual as a mask of what stays."""
    def compress(grad, residual, k):
        full = grad + residual
        indices = torch.argsort(full.abs(), descending=True)[:k]
        keep = torch.ones_like(full, dtype=torch.bool)
        keep[indices] = False
        return full[indices], indices, torch.where(keep, full, torch.zeros_like(full))

    verdict = exercise.topk_error_feedback(compress)
    assert verdict, verdict


def test_topk_error_feedback_labkit_agrees_with_the_reference(solved):
    grad, residual = torch.randn(30), torch.randn(30)
    idx, values, left = compression.topk_compress(grad, 4, residual)
    mine_values, mine_idx, mine_left = solved["my_compress"](grad, residual, 4)
    assert set(idx.tolist()) == set(mine_idx.tolist()) and torch.equal(left, mine_left)


def _no_residual(grad, residual, k):
    indices = grad.abs().topk(k).indices
    left = grad.clone()
    left[indices] = 0
    return grad[indices], indices, left


def _by_value(grad, residual, k):
    full = grad + residual
    indices = full.topk(k).indices
    left = full.clone()
    left[indices] = 0
    return full[indices], indices, left


def _keeps_the_sent(grad, residual, k):
    full = grad + residual
    indices = full.abs().topk(k).indices
    return full[indices], indices, full


def _drops_the_rest(grad, residual, k):
    full = grad + residual
    indices = full.abs().topk(k).indices
    return full[indices], indices, torch.zeros_like(full)


def _forgets_old_residual(grad, residual, k):
    full = grad + residual
    indices = full.abs().topk(k).indices
    left = grad.clone()
    left[indices] = 0
    return full[indices], indices, left


def _labkit_order(grad, residual, k):
    return compression.topk_compress(grad, k, residual)


@pytest.mark.parametrize("wrong, said, hint", [
    (_no_residual, "top k of grad, not of grad + residual", "residual not carried"),
    (_drops_the_rest, "new residual is empty", "residual not carried: the dropped mass is lost"),
    (_forgets_old_residual, "sent + new residual is not grad + residual", "residual not carried"),
    (_by_value, "k largest values, not magnitudes", "rank by magnitude"),
    (_keeps_the_sent, "sent entries are still in the new residual", "applied twice"),
    (_labkit_order, "first item holds integers", "(values, indices, new_residual), in that order"),
])
def test_topk_error_feedback_wrong_answers_get_their_hint(wrong, said, hint):
    verdict = exercise.topk_error_feedback(wrong)
    assert not verdict and said in verdict.detail and hint in verdict.hint


def test_topk_error_feedback_wrong_residual_not_carried():
    verdict = exercise.topk_error_feedback(_no_residual)
    assert not verdict and verdict.hint.startswith("residual not carried: the dropped mass is lost")


# ---- bad input, refused with what to do (these used to be a notebook cell) ----------------------

def _data():
    x = torch.randn(64, 12, generator=torch.Generator().manual_seed(0))
    return x, (x[:, 0] > 0).long()


def _make():
    return torch.nn.Linear(12, 2)


def test_bad_input_is_refused_with_what_to_do_instead(group):
    train = _data()
    with pytest.raises(ValueError, match=r"k must be between 1 .* use e\.g\. k = max"):
        compression.topk_compress(torch.zeros(10), 0)
    with pytest.raises(ValueError, match="64 samples over 8 workers leaves 8 each, fewer than "
                                         "one batch of 32: use a smaller batch"):
        parameter_server.worker_batches(64, 0, 8, batch=32, steps=1)
    with pytest.raises(ValueError, match="unknown method 'signsgd': use one of"):
        compression.compressed_training(_make, train, train, method="signsgd")
    with pytest.raises(ValueError, match="unknown mode 'hogwild'"):
        parameter_server.parameter_server(_make, train, train, mode="hogwild")

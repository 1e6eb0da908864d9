"""Notebook 06's challenge (all-reduce by recursive halving and doubling): the solution passes on
2 and 4 ranks, known wrong answers (right values by a wrong route among them) get their hints,
and a valid answer written another way passes."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import custom_algorithms as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    return solution_namespace("06_custom_algorithms", "halving_doubling")["my_halving_doubling"]


def _swap(send, recv, partner):
    for work in (dist.isend(send, partner), dist.irecv(recv, partner)):
        work.wait()


def _halving(x, *, overwrite=False, add_back=False, buffer=torch.empty_like):
    """Halving and doubling with one mistake switched on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    segment, steps, distance = x.view(-1), [], world // 2
    while distance:
        partner = rank ^ distance
        low, high = segment.tensor_split(2)
        keep, give = (low, high) if rank < partner else (high, low)
        if overwrite:
            _swap(give, keep, partner)
        else:
            incoming = buffer(keep)
            _swap(give, incoming, partner)
            keep += incoming
        steps.append((partner, keep, give))
        segment, distance = keep, distance // 2
    for partner, keep, give in reversed(steps):
        if add_back:
            incoming = torch.empty_like(give)
            _swap(keep, incoming, partner)
            give += incoming
        else:
            _swap(keep, give, partner)
    return x


def test_halving_doubling_solution_passes_on_2_and_4_ranks():
    verdict = exercise.halving_doubling(_solution())
    assert verdict and "4 messages on 4 ranks" in verdict.detail


def test_halving_doubling_untouched_is_not_written_yet():
    def my_halving_doubling(x):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.halving_doubling(my_halving_doubling).detail


def _recursive_doubling(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    incoming, mask = torch.empty_like(x), 1
    while mask < world:
        _swap(x, incoming, rank ^ mask)
        x += incoming
        mask <<= 1
    return x


def test_halving_doubling_wrong_route_recursive_doubling_sends_whole_tensors():
    verdict = exercise.halving_doubling(_recursive_doubling, worlds=(4,))
    assert not verdict and "2 messages of the whole tensor" in verdict.detail
    assert verdict.hint.startswith("that is recursive doubling")


def _ring(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(x.view(-1).tensor_split(world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        into = chunks[(rank - s - 1) % world]
        incoming = torch.empty_like(into)
        for work in (dist.isend(chunks[(rank - s) % world], right), dist.irecv(incoming, left)):
            work.wait()
        into += incoming
    for s in range(world - 1):
        for work in (dist.isend(chunks[(rank + 1 - s) % world], right),
                     dist.irecv(chunks[(rank - s) % world], left)):
            work.wait()
    return x


def test_halving_doubling_wrong_route_the_ring_passes_on_2_ranks_only():
    assert exercise.halving_doubling(_ring, worlds=(2,))  # on 2 ranks the two are one exchange
    verdict = exercise.halving_doubling(_ring, worlds=(4,))
    assert not verdict and "6 messages, the ring's 2(n - 1)" in verdict.detail
    assert verdict.hint.startswith("pair with partners at distance n/2")


def _builtin(x):
    dist.all_reduce(x)
    return x


def test_halving_doubling_wrong_route_the_built_in_collective():
    verdict = exercise.halving_doubling(_builtin, worlds=(2,))
    assert not verdict and "it called all_reduce" in verdict.detail


def _added_back(x):
    return _halving(x, add_back=True)


def test_halving_doubling_wrong_second_phase_adds():
    verdict = exercise.halving_doubling(_added_back, worlds=(2,))
    assert not verdict and "times (want [1, 1])" in verdict.detail
    assert verdict.hint.startswith("a contribution was added twice")


def _overwrites(x):
    return _halving(x, overwrite=True)


def test_halving_doubling_wrong_received_over_its_own_half():
    verdict = exercise.halving_doubling(_overwrites, worlds=(4,))
    assert not verdict and "holds each rank's entry" in verdict.detail
    assert verdict.hint.startswith("rank r's own part was overwritten")


def _float32_buffer(x):
    return _halving(x, buffer=lambda t: torch.empty(t.numel()))


def test_halving_doubling_wrong_buffer_dtype_in_an_int64_tensor():
    verdict = exercise.halving_doubling(_float32_buffer, worlds=(2,))
    assert not verdict and "on 2 ranks" in verdict.detail
    assert verdict.hint.startswith("a message arrived into a buffer of another size or dtype")
    assert "torch.empty_like(half)" in verdict.hint


def _returns_nothing(x):
    _halving(x)


def test_halving_doubling_wrong_returns_nothing():
    verdict = exercise.halving_doubling(_returns_nothing, worlds=(2,))
    assert not verdict and "the function returned None" in verdict.detail


def _ascending_batched(x):
    """Valid, written differently: partners 1, 2, 4 ... away, batched p2p, index arithmetic."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flat, lo, hi, trail, mask = x.view(-1), 0, x.numel(), [], 1
    while mask < world:
        partner = rank ^ mask
        mid = lo + (hi - lo + 1) // 2  # tensor_split(2)'s cut
        mine, theirs = ((lo, mid), (mid, hi)) if rank & mask == 0 else ((mid, hi), (lo, mid))
        incoming = flat[mine[0]:mine[1]].clone()
        ops = [dist.P2POp(dist.isend, flat[theirs[0]:theirs[1]], partner),
               dist.P2POp(dist.irecv, incoming, partner)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        flat[mine[0]:mine[1]] += incoming
        trail.append((partner, mine, theirs))
        lo, hi = mine
        mask <<= 1
    while trail:
        partner, mine, theirs = trail.pop()
        ops = [dist.P2POp(dist.isend, flat[mine[0]:mine[1]], partner),
               dist.P2POp(dist.irecv, flat[theirs[0]:theirs[1]], partner)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return x


def test_halving_doubling_valid_ascending_partners_batched_pass():
    assert exercise.halving_doubling(_ascending_batched)


def _blocking_send(x):
    partner = dist.get_rank() ^ 1
    incoming = torch.empty_like(x)
    dist.send(x, partner)  # both ranks send first: each waits for a receiver that is sending
    dist.recv(incoming, partner)
    x += incoming
    return x


def test_halving_doubling_wrong_blocking_sends_are_a_deadlock(monkeypatch):
    monkeypatch.setattr(exercise, "TIMEOUT", 5.0)
    verdict = exercise.halving_doubling(_blocking_send, worlds=(2,))
    assert not verdict and "still running after 5 s" in verdict.detail
    assert verdict.hint.startswith("deadlock: start the send and the receive of each step")

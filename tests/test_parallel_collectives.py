"""labkit.parallel.collectives: the ring and recursive doubling against dist.all_reduce."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from labkit import launch
from labkit.parallel.collectives import recursive_doubling_allreduce, ring_allreduce

from .conftest import cuda_gpus

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUMELS = (1, 3, 10, 1000, 12345)  # fewer elements than ranks, uneven chunks, several KB



def test_one_rank_is_the_identity_in_place(group):
    for fn in (ring_allreduce, recursive_doubling_allreduce):
        x = torch.arange(5.0)
        assert fn(x) is x and torch.equal(x, torch.arange(5.0))


def test_bad_tensors_are_refused_with_what_to_pass(group):
    for fn in (ring_allreduce, recursive_doubling_allreduce):
        with pytest.raises(ValueError, match="not contiguous.*pass x.contiguous()"):
            fn(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="works on a tensor, got list"):
        ring_allreduce([1.0, 2.0])


def _against_builtin():
    """Every size with each algorithm, 4 ranks and a 3-rank subgroup (not a power of two)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    three = dist.new_group([0, 1, 2])  # every rank must call new_group, members or not
    out = {}
    for numel in NUMELS:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        builtin = x.clone()
        dist.all_reduce(builtin)
        out[numel] = {"builtin": builtin, "ring": ring_allreduce(x.clone()),
                      "doubling": recursive_doubling_allreduce(x.clone())}
        if rank < 3:
            sub = x.clone()
            dist.all_reduce(sub, group=three)
            out[numel]["ring3"], out[numel]["builtin3"] = ring_allreduce(x.clone(), three), sub
    if rank < 3:
        try:
            recursive_doubling_allreduce(torch.zeros(4), three)
        except ValueError as err:
            out["doubling3"] = str(err)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return launch(_against_builtin, nproc=4, show_ranks=[], timeout=240, warm=True).values


@pytest.mark.parametrize("name", ["ring", "doubling", "ring3"])
def test_hand_written_all_reduce_equals_the_builtin(four_ranks, name):
    members = range(3) if name == "ring3" else range(4)
    builtin = "builtin3" if name == "ring3" else "builtin"
    for numel in NUMELS:
        for rank in members:
            got, want = four_ranks[rank][numel][name], four_ranks[rank][numel][builtin]
            # Float sums in another order: equal to rounding, not bitwise.
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (name, numel, rank)
            # ...but bitwise the same on every rank: replicas that must not drift apart.
            assert torch.equal(got, four_ranks[0][numel][name]), (name, numel, rank)


def test_recursive_doubling_refuses_3_ranks(four_ranks):
    for rank in range(3):
        assert four_ranks[rank]["doubling3"] == (
            "recursive doubling pairs ranks by XOR, so it needs a power-of-two number of ranks; "
            "got 3: use ring_allreduce, or 2 or 4 ranks")
    assert "doubling3" not in four_ranks[3]


def test_a_sweep_times_every_algorithm_alternately(four_ranks):
    from labkit.bench import allreduce_sweep

    # Timings of the real thing: a short sweep on 4 ranks, every row the same on every rank.
    values = launch(allreduce_sweep, [1024, 1 << 20], iters=2, warmup=1,
                    algorithms=("builtin", "ring", "doubling"), nproc=4, show_ranks=[],
                    timeout=240, warm=True).values
    rows = values[0]
    assert all(v == rows for v in values)
    assert [(r["algorithm"], r["bytes"]) for r in rows] == [
        (a, b) for b in (1024, 1 << 20) for a in ("builtin", "ring", "doubling")]
    assert all(r["seconds"] > 0 and r["ranks"] == 4 for r in rows)


def _ring_on_gpus():
    """Ring and doubling on CUDA tensors against NCCL's own all-reduce."""
    import torch.distributed as dist

    x = torch.randn(12345, device="cuda", generator=torch.Generator("cuda").manual_seed(
        dist.get_rank()))
    builtin = x.clone()
    dist.all_reduce(builtin)
    return {name: (fn(x.clone()) - builtin).abs().max().item()
            for name, fn in (("ring", ring_allreduce), ("doubling", recursive_doubling_allreduce))}


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 2, reason="needs 2 CUDA GPUs for 2 NCCL ranks")
def test_ring_on_two_gpus_with_nccl():
    # NCCL needs the send and the receive of one step in one batch_isend_irecv, or it hangs.
    for diffs in launch(_ring_on_gpus, nproc=2, show_ranks=[], timeout=240).values:
        assert diffs["ring"] < 1e-4 and diffs["doubling"] < 1e-4, diffs

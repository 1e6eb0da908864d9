"""labkit.parallel.traffic: each kind of call counted with the bytes its rank sends."""

from __future__ import annotations

import sys

import cloudpickle
import pytest

from labkit import launch
from labkit.parallel.traffic import Traffic, ring_bytes, step_traffic

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def every_kind_of_call() -> dict:
    """On every rank: one call of each kind inside count_traffic, then FSDP2 and DTensor's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from labkit._dist import all_gather_into, reduce_scatter_into
    from labkit.parallel.traffic import count_traffic

    n, r = dist.get_world_size(), dist.get_rank()
    with count_traffic() as t:
        dist.all_reduce(torch.ones(16))  # 64 B
        all_gather_into(torch.empty(8 * n), torch.ones(8))  # output 32n B
        reduce_scatter_into(torch.empty(4), torch.ones(4 * n))  # input 16n B
        splits = [r + 1 + k for k in range(n)]  # rank r sends r+1+k rows to rank k
        recv = [k + 1 + r for k in range(n)]
        dist.all_to_all_single(torch.empty(sum(recv), 2), torch.ones(sum(splits), 2), recv, splits)
        ops = [dist.P2POp(dist.isend, torch.ones(3), (r + 1) % n),
               dist.P2POp(dist.irecv, torch.empty(3), (r - 1) % n)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        dist.broadcast(torch.ones(5), 0)
    plain = {"counts": t.counts(), "by_op": t.by_op(), "ranks": t.calls[0].ranks,
             "peers": [(c.op, c.peer) for c in t.calls if c.op in ("send", "recv")]}
    with count_traffic() as rooted:  # the rooted collectives, rooted on the last rank
        last = n - 1
        dist.reduce(torch.ones(6), last)  # 24 B
        dist.gather(torch.ones(2, dtype=torch.float64),  # 16 B each, a dtype of 8 bytes
                    [torch.empty(2, dtype=torch.float64) for _ in range(n)] if r == last else None,
                    last)
        dist.scatter(torch.empty(3), [torch.ones(3) for _ in range(n)] if r == last else None,
                     last)  # 12 B a part
        dist.all_gather([torch.empty(2) for _ in range(n)], torch.ones(2))  # the list form
        dist.reduce_scatter(torch.empty(2), [torch.ones(2) for _ in range(n)])
        dist.barrier()  # moves no data: not counted
        if r == 0:  # point to point, a rank that sends nothing (the others) included
            for k in range(1, n):
                dist.send(torch.ones(k, dtype=torch.int64), k)
        else:
            dist.recv(torch.empty(r, dtype=torch.int64), 0)
    rooted = {"by_op": rooted.by_op(), "counts": rooted.counts(),
              "roots": {c.op: c.root for c in rooted.calls if c.root is not None},
              "peers": [(c.op, c.peer) for c in rooted.calls if c.peer is not None]}
    with count_traffic() as lists:  # the list form: one tensor per destination, its own kept
        dist.all_to_all([torch.empty(3) for _ in range(n)], [torch.ones(3) for _ in range(n)])

    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(2)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)  # a root of its own (holding no parameter): the layers reshard after forward
    with count_traffic() as fsdp:
        model(torch.ones(2, 8)).sum().backward()  # the backward's collectives are seen too

    mesh = init_device_mesh("cpu", (n,))
    d = distribute_tensor(torch.ones(4 * n, 4), mesh, [Shard(0)])
    with count_traffic() as functional:
        d.redistribute(mesh, [Replicate()]).to_local()
    return {"plain": plain, "rooted": rooted, "lists": lists.by_op(), "fsdp": fsdp.by_op(),
            "fsdp_counts": fsdp.counts(), "functional": functional.by_op()}


@pytest.mark.parametrize("n", [2, 4])
def test_each_call_is_counted_with_the_bytes_its_rank_sends(n):
    values = launch(every_kind_of_call, nproc=n, backend="gloo", warm=True, show_ranks=[],
                    timeout=120).values
    for r, got in enumerate(values):
        plain = got["plain"]
        assert plain["counts"] == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1,
                                   "all_to_all": 1, "send": 1, "recv": 1, "broadcast": 1}
        own = r + 1 + r  # the rows rank r addresses to itself are not sent
        assert plain["by_op"] == {
            "all_reduce": 2 * (n - 1) * 64 // n, "all_gather": (n - 1) * 32,
            "reduce_scatter": (n - 1) * 16, "send": 12, "recv": 0,
            "all_to_all": (sum(r + 1 + k for k in range(n)) - own) * 2 * 4,
            "broadcast": 20 if r == 0 else 0}
        assert plain["ranks"] == tuple(range(n))
        assert plain["peers"] == [("send", (r + 1) % n), ("recv", (r - 1) % n)]
        rooted, last = got["rooted"], n - 1
        sends = {"send": sum(range(1, n)) * 8} if r == 0 else {"recv": 0}
        assert rooted["by_op"] == {
            "reduce": 0 if r == last else 24, "gather": 0 if r == last else 16,
            "scatter": (n - 1) * 12 if r == last else 0, "all_gather": (n - 1) * 8,
            "reduce_scatter": (n - 1) * 8, **sends}
        assert rooted["counts"] == {"reduce": 1, "gather": 1, "scatter": 1, "all_gather": 1,
                                    "reduce_scatter": 1, **({"send": n - 1} if r == 0
                                                            else {"recv": 1})}
        assert rooted["roots"] == {"reduce": last, "gather": last, "scatter": last}
        assert rooted["peers"] == ([("send", k) for k in range(1, n)] if r == 0
                                   else [("recv", 0)])
        assert got["lists"] == {"all_to_all": (n - 1) * 3 * 4}
        layer_bytes = 8 * 8 * 4
        # FSDP2: both layers all-gathered in forward and again in backward, gradients scattered
        assert got["fsdp_counts"] == {"all_gather": 4, "reduce_scatter": 2}
        assert got["fsdp"] == {"all_gather": 4 * (n - 1) * layer_bytes // n,
                               "reduce_scatter": 2 * (n - 1) * layer_bytes // n}
        assert got["functional"] == {"all_gather": (n - 1) * 4 * n * 4 * 4 // n}


def test_ring_bytes_formulas_and_refusals():
    assert ring_bytes("all_reduce", 4096, 4) == 6144
    assert ring_bytes("all_gather", 4096, 4) == ring_bytes("reduce_scatter", 4096, 4) == 3072
    assert ring_bytes("all_reduce", 4096, 1) == 0  # one rank sends nothing
    assert (ring_bytes("send", 10, 2), ring_bytes("recv", 10, 2)) == (10, 0)
    with pytest.raises(ValueError, match="no ring formula for 'all_to_all'"):
        ring_bytes("all_to_all", 10, 2)
    with pytest.raises(ValueError, match="at least 1 rank"):
        ring_bytes("all_reduce", 10, 0)


def test_an_empty_traffic_reports_nothing():
    t = Traffic()
    assert (t.counts(), t.by_op(), t.sent_bytes()) == ({}, {}, 0)
    assert "sent 0 bytes" in repr(t)


def test_step_traffic_refuses_an_unknown_wrap(group):
    from functools import partial

    from labkit.parallel.memory import mlp_blocks

    with pytest.raises(ValueError, match="wrap='zero'.*use 'ddp'.*or 'fsdp'"):
        step_traffic(partial(mlp_blocks, 1, 8), wrap="zero")

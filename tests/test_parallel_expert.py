"""labkit.parallel.expert: the expert-parallel MoE against the single-process one, bytes counted.

Tolerance: float32 on the CPU, 1e-5 absolute. Both layers do the same products; only the
grouping of rows into matrix products (BLAS blocking) and the order of the router gradient's
sum over ranks differ.
"""

from __future__ import annotations

import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit import launch
from labkit.parallel.expert import (
    MoE,
    apply_experts,
    dispatch_order,
    expert_capacity,
    expert_owner,
    expert_parallel,
    load_balancing_loss,
    moe_check,
    routing_bytes,
    uniform_routing_bytes,
)

from .conftest import cuda_gpus

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOL = 1e-5
TOKENS, HIDDEN, FFN = 32, 16, 32


def ep_checks() -> dict:
    """Run on every rank of one launch: moe_check in every setting, and the layer's edge cases."""
    import torch
    import torch.distributed as dist

    from labkit.parallel.expert import MoE, expert_parallel, moe_check

    n = dist.get_world_size()
    experts = 2 * n
    no_expert_1 = [0.0] * experts
    no_expert_1[1] = -1e4
    no_rank_0 = [-1e4 if e < experts // n else 0.0 for e in range(experts)]
    settings = {"plain": {}, "capacity": {"capacity_factor": 1.0},
                "top1": {"top_k": 1}, "top1_capacity": {"top_k": 1, "capacity_factor": 1.0},
                "empty_expert": {"router_bias": no_expert_1},
                "empty_rank": {"router_bias": no_rank_0, "capacity_factor": 1.25}}
    out = {name: moe_check(TOKENS, HIDDEN, FFN, experts, **{"top_k": 2, **kw}, seed=3)
           for name, kw in settings.items()}

    # The input needs no gradient (the first layer of a model): rank 0's experts get nothing,
    # yet it must still take part in the backward exchange, or the others would wait forever.
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, experts)
    with torch.no_grad():
        moe.router.bias += torch.tensor(no_rank_0)
    ep = expert_parallel(moe)
    ep(torch.randn(TOKENS, HIDDEN)).sum().backward()
    out["no_input_grad"] = {"received": ep.stats["tokens_per_expert"],
                            "router_grad": ep.router.weight.grad is not None}

    def all_to_rank_0(e, n_experts, world):  # counts that do not match the routing
        return torch.argsort(e), [len(e)] + [0] * (world - 1)

    errors = {"uneven_split": lambda: expert_parallel(MoE(8, 8, 2 * n + 1)),
              "bad_counts": lambda: expert_parallel(MoE(8, 8, experts),
                                                    dispatch=all_to_rank_0)(torch.randn(4, 8))}
    for name, make in errors.items():
        try:
            make()
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request):
    return launch(ep_checks, nproc=request.param, show_ranks=[], timeout=240, warm=True).values


# ---- single process --------------------------------------------------------------------------


def test_dispatch_order_groups_rows_by_rank_then_expert_stably_and_inverts():
    flat = torch.tensor([3, 0, 1, 3, 2, 0])
    order, counts = dispatch_order(flat, 4, 2)
    assert order.tolist() == [1, 5, 2, 4, 0, 3] and counts == [3, 3]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    rows = torch.arange(6.0)[:, None] * torch.ones(1, 3)
    assert torch.equal(rows[order][inverse], rows)
    assert expert_owner(flat, 4, 2).tolist() == [1, 0, 0, 1, 1, 0]
    # an empty expert, an empty rank, every row to one rank
    assert dispatch_order(torch.tensor([0, 0, 3]), 4, 2)[1] == [2, 1]
    assert dispatch_order(torch.tensor([7, 1, 6]), 8, 4)[1] == [1, 0, 0, 2]
    order, counts = dispatch_order(torch.tensor([2, 3, 2]), 4, 2)
    assert order.tolist() == [0, 2, 1] and counts == [0, 3]
    assert dispatch_order(torch.tensor([], dtype=torch.long), 4, 2)[1] == [0, 0]


def test_load_balancing_loss_is_1_when_balanced_and_n_experts_when_collapsed():
    probs = torch.full((8, 4), 0.25)
    assert load_balancing_loss(probs, torch.arange(16).view(8, 2) % 4, 4).item() == 1.0
    onehot = torch.zeros(8, 4)
    onehot[:, 2] = 1.0
    assert load_balancing_loss(onehot, torch.full((8,), 2), 4).item() == 4.0


def test_capacity_drops_the_latest_rows_of_a_full_expert():
    assert expert_capacity(64, 2, 4, 1.25) == 40 and expert_capacity(64, 2, 4, None) is None
    assert expert_capacity(10, 1, 4, 1.0) == 3  # ceil(2.5)
    experts = [lambda r: r + 1, lambda r: r + 10]
    rows = torch.zeros(5, 2)
    out, counts, dropped = apply_experts(experts, rows, torch.tensor([0, 0, 1, 0, 0]), 2)
    assert counts == [4, 1] and dropped == 2
    assert out[:, 0].tolist() == [1, 1, 10, 0, 0]


def test_moe_gates_counts_and_dropped_tokens():
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, 4, top_k=2, capacity_factor=1.0)
    y = moe(torch.randn(2, 32, HIDDEN))  # (batch, seq, hidden) works too
    assert y.shape == (2, 32, HIDDEN)
    s = moe.stats
    assert sum(s["tokens_per_expert"]) == 64 * 2 and s["capacity"] == 32
    assert s["dropped"] == sum(max(0, c - 32) for c in s["tokens_per_expert"]) > 0
    assert s["aux_loss"] == pytest.approx(moe.aux_loss.item()) and s["aux_loss"] >= 1.0 - 1e-6
    from labkit.parallel.expert import route

    x = torch.randn(8, HIDDEN)
    probs, gate, idx = route(moe.router, x, 2)
    assert torch.allclose(gate.sum(-1), torch.ones(8))  # renormalised over the top 2 (Mixtral)
    probs, gate, idx = route(moe.router, x, 1)
    assert torch.equal(gate, probs.gather(1, idx))  # top-1: the raw probability (Switch)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_k": 5}, r"top_k=5 but there are only 4 experts: .* use top_k <= 4"),
    ({"top_k": 0}, r"top_k must be a whole number >= 1, got 0"),
    ({"capacity_factor": 0}, r"capacity_factor must be a number > 0 .*got 0"),
    ({"capacity_factor": -1.0}, r"capacity_factor must be a number > 0"),
    ({"capacity_factor": "1.25"}, r"capacity_factor must be a number > 0"),
])
def test_bad_sizes_are_refused_with_what_to_do(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoE(HIDDEN, FFN, 4, **kwargs)


def test_wrong_input_shape_and_uneven_expert_split_are_refused():
    moe = MoE(HIDDEN, FFN, 4)
    for bad in (torch.randn(8, HIDDEN + 1), torch.randn(HIDDEN)):
        with pytest.raises(ValueError, match=rf"expected tokens of shape \(tokens, {HIDDEN}\) "
                                             r"or \(batch, seq, 16\), got"):
            moe(bad)
    with pytest.raises(ValueError, match=r"^6 experts do not split over 4 ranks: use a multiple "
                                         r"of 4 experts \(e\.g\. 4 or 8\), or a number of ranks "
                                         r"that divides 6 \(e\.g\. 1, 2, 3, 6\)$"):
        dispatch_order(torch.tensor([0, 5]), 6, 4)
    with pytest.raises(ValueError, match="expert_parallel needs a labkit MoE"):
        expert_parallel(torch.nn.Linear(3, 3))


def _equal_to_reference(ep, moe, x):
    """Largest output and gradient differences of ``ep`` and ``moe`` on the same tokens."""
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ep(xa), moe(xb)
    (ya.square().sum() + ep.aux_loss).backward()
    (yb.square().sum() + moe.aux_loss).backward()
    grads = {n: (p.grad - dict(moe.named_parameters())[n].grad).abs().max().item()
             for n, p in ep.named_parameters()}
    return (ya - yb).abs().max().item(), (xa.grad - xb.grad).abs().max().item(), grads


def test_one_rank_holds_every_expert_and_equals_the_reference(tmp_path):
    torch.manual_seed(0)
    moe = MoE(HIDDEN, FFN, 4, capacity_factor=1.0)
    x = torch.randn(TOKENS, HIDDEN)
    out, in_grad, grads = _equal_to_reference(expert_parallel(moe), moe, x)  # no process group
    assert out == 0.0 and in_grad == 0.0 and max(grads.values()) == 0.0
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        moe.zero_grad()
        ep = expert_parallel(moe)
        assert ep.first_expert == 0 and len(ep.experts) == 4
        out, in_grad, grads = _equal_to_reference(ep, moe, x)
        assert out == 0.0 and max(grads.values()) == 0.0
        assert "experts 0..3 on rank 0 of 1" in repr(ep)
    finally:
        dist.destroy_process_group()


def test_bytes_from_routing_and_the_uniform_formula_agree_for_uniform_routing():
    tokens, k, hidden, world, experts = 48, 2, 16, 4, 8
    flat = torch.arange(tokens * k) % experts  # every expert the same number of rows
    order, counts = dispatch_order(flat, experts, world)
    rank = 1
    got = routing_bytes(counts, counts, rank, hidden, 4, experts // world)
    formula = uniform_routing_bytes(tokens, k, hidden, 4, world)
    assert got["dispatch"] == got["return"] == formula == tokens * k * hidden * 4 * 3 / 4
    assert got["counts"] == 3 * (2 + 1) * 8  # (per_rank + 1) int64 to each other rank
    assert got["forward"] == 2 * formula + got["counts"] and got["backward"] == 2 * formula


def test_balance_sweep_the_loss_evens_the_load_and_drops_fewer_tokens():
    from labkit.parallel.expert import balance_sweep

    rows = balance_sweep(steps=40)
    last = {r["aux"]: r for r in rows if r["step"] == 39}
    first = {r["aux"]: r for r in rows if r["step"] == 0}
    assert first[True]["tokens_per_expert"] == first[False]["tokens_per_expert"]  # same start
    fair = 256 * 2 / 8
    assert max(last[False]["tokens_per_expert"]) > 1.5 * fair  # still skewed without the loss
    assert max(last[True]["tokens_per_expert"]) < 1.35 * fair
    assert last[True]["dropped"] < last[False]["dropped"] / 5
    assert last[True]["aux_loss"] < last[False]["aux_loss"]
    assert {r["aux"] for r in rows} == {False, True} and len(rows) == 80


def test_moe_check_needs_a_worker():
    with pytest.raises(RuntimeError, match="not initialised: run this inside a worker"):
        moe_check(8, 4, 8, 2)


# ---- 2 and 4 ranks ---------------------------------------------------------------------------

SETTINGS = ["plain", "capacity", "top1", "top1_capacity", "empty_expert", "empty_rank"]


@pytest.mark.parametrize("setting", SETTINGS)
def test_expert_parallel_equals_the_reference(ranks, setting):
    for v in ranks:
        r = v[setting]
        assert r["output"] < TOL, r["output"]
        assert len(r["grads"]) == 3 + 2 * 4  # input, router weight and bias, 2 experts of 4
        assert max(r["grads"].values()) < TOL, r["grads"]


@pytest.mark.parametrize("setting", SETTINGS)
def test_tokens_per_expert_and_dropped_add_up_to_the_reference(ranks, setting):
    ref = ranks[0][setting]["reference"]
    assert [c for v in ranks for c in v[setting]["tokens_per_expert"]] == ref["tokens_per_expert"]
    assert sum(v[setting]["dropped"] for v in ranks) == ref["dropped"]
    assert [e for v in ranks for e in v[setting]["experts"]] == list(range(2 * len(ranks)))
    matrix = [v[setting]["send_counts"] for v in ranks]  # row: sender, column: receiver
    k = 1 if setting.startswith("top1") else 2
    assert all(sum(row) == TOKENS * k for row in matrix)
    assert [list(col) for col in zip(*matrix, strict=True)] == [v[setting]["recv_counts"]
                                                                for v in ranks]
    if "capacity" in setting:
        assert ref["capacity"] == math.ceil(TOKENS * len(ranks) * k / (2 * len(ranks)))
        assert ref["dropped"] > 0  # the settings do drop: the claim is tested


def test_an_empty_expert_and_an_empty_rank_work(ranks):
    assert ranks[0]["empty_expert"]["reference"]["tokens_per_expert"][1] == 0
    empty = ranks[0]["empty_rank"]
    assert empty["tokens_per_expert"] == [0, 0] and empty["recv_counts"] == [0] * len(ranks)
    assert all(v["empty_rank"]["send_counts"][0] == 0 for v in ranks)  # nobody sends to rank 0
    assert ranks[0]["no_input_grad"] == {"received": [0, 0], "router_grad": True}


@pytest.mark.parametrize("setting", SETTINGS)
def test_bytes_sent_are_exactly_those_of_the_routing(ranks, setting):
    for v in ranks:
        b = v[setting]["bytes"]
        assert b["measured"] == b["from_routing"], b
        assert b["calls"] == {"forward": {"all_to_all": 3}, "backward": {"all_to_all": 2}}
        k = 1 if setting.startswith("top1") else 2
        assert b["uniform_per_exchange"] == TOKENS * k * HIDDEN * 4 * (len(ranks) - 1) / len(
            ranks)


def test_random_routing_sends_about_the_uniform_formula(ranks):
    mean = sum(v["plain"]["bytes"]["routing"]["dispatch"] for v in ranks) / len(ranks)
    assert 0.6 < mean / ranks[0]["plain"]["bytes"]["uniform_per_exchange"] < 1.4


def test_errors_on_ranks(ranks):
    n = len(ranks)
    for v in ranks:
        assert v["uneven_split"].startswith(f"{2 * n + 1} experts do not split over {n} ranks")
        assert "dispatch's send_counts" in v["bad_counts"]


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 2, reason="needs 2 CUDA GPUs for 2 NCCL ranks")
def test_moe_check_on_two_gpus_with_nccl():
    values = launch(moe_check, 64, 32, 64, 4, 2, 1.0, nproc=2, backend="nccl", show_ranks=[],
                    timeout=300).values
    for v in values:
        assert v["output"] < 1e-4 and max(v["grads"].values()) < 1e-4, v
        assert v["bytes"]["measured"] == v["bytes"]["from_routing"]

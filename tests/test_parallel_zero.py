"""labkit.parallel.zero: ZeRO-1/2 by hand against plain data parallelism, and ZeRO-3's traffic."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from torch import nn

from labkit import launch
from labkit.parallel import zero
from labkit.parallel.memory import mlp_blocks

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

KINDS = ("params", "grads", "optimizer", "total")


def _learner_step(flat_params, flat_grad, update_shard):
    """ZeRO's step as the exercise has it written, with torch's collective names."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    shard = flat_params.numel() // world
    grad = torch.empty(shard)
    dist.reduce_scatter_tensor(grad, flat_grad)
    new = update_shard(flat_params[rank * shard:(rank + 1) * shard], grad / world)
    dist.all_gather_into_tensor(flat_params, new)


def zero_checks() -> dict:
    """Run on every rank of one launch: both stages, even and padded, ZeRO-3, the errors."""
    import torch
    from torch import nn

    from labkit.parallel import zero

    out = {f"zero{s}": zero.zero_check(s, 8, 3, 3, seed=1) for s in (1, 2)}
    # 450 parameters (225 a block): padded to a multiple of the ranks (per bucket for ZeRO-2)
    out.update({f"uneven{s}": zero.zero_check(s, 5, 2, 3) for s in (1, 2)})
    out["zero3"] = zero.zero3_traffic(8, 3)
    out["learner"] = zero.zero_check(1, 8, 3, 3, seed=1, step_fn=_learner_step)
    errors = {}
    try:
        zero.ZeroOptimizer(mlp_blocks(1, 4), stage=3)
    except ValueError as e:
        errors["stage"] = str(e)
    frozen = mlp_blocks(1, 4).requires_grad_(False)
    try:
        zero.ZeroOptimizer(frozen, stage=1)
    except ValueError as e:
        errors["frozen"] = str(e)
    try:
        zero.zero3_traffic(6, 1)  # 6 splits over 2 ranks, not over 4
    except ValueError as e:
        errors["zero3_width"] = str(e)
    # ZeRO-2 waits for every parameter's gradient: one unused in forward is an error at step
    model = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    opt = zero.ZeroOptimizer(model, stage=2)
    model[0](torch.randn(2, 4)).sum().backward()
    try:
        opt.step()
    except RuntimeError as e:
        errors["unused"] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request):
    return launch(zero_checks, nproc=request.param, show_ranks=[], timeout=300,
                  warm=True).values


# ---- on 2 and 4 ranks --------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["zero1", "zero2", "uneven1", "uneven2"])
def test_zero_equals_data_parallelism_over_three_steps(ranks, case):
    for r in ranks:
        got = r[case]
        assert got["loss_diff"] <= zero.TOL and got["weight_diff"] <= zero.TOL, got
        assert got["replica_diff"] == 0.0  # the all-gather leaves every rank the same weights
        assert len(got["zero"]["losses"]) == 3


@pytest.mark.parametrize("case", ["zero1", "zero2", "uneven1", "uneven2"])
def test_bytes_held_equal_the_formulas_exactly(ranks, case):
    for r in ranks:
        for who in ("dp", "zero"):
            got, formula = r[case][who]["held"], r[case][who]["formula"]
            for when in ("after_backward", "after_step"):
                assert {k: got[when][k] for k in KINDS} == {k: formula[k] for k in KINDS}, \
                    (case, who, when)


def test_zero2_holds_its_gradient_shard_plus_one_bucket_in_flight(ranks):
    n = len(ranks)
    for r in (x["zero2"] for x in ranks):
        assert r["buckets"] == [552, 552, 552]  # one block a bucket, 552 a multiple of 2 and 4
        assert r["zero"]["grads_in_flight"] == r["zero"]["grads_in_flight_formula"] \
            == 4 * 1656 // n + 4 * 552


def test_bytes_on_the_wire_equal_the_formulas_exactly(ranks):
    n = len(ranks)
    for r in ranks:
        for case in ("zero1", "zero2", "uneven1", "uneven2"):
            dp, z = r[case]["dp"], r[case]["zero"]
            assert dp["wire"] == dp["formula"]["wire"] == 2 * (n - 1) * 4 * r[case]["n_params"] // n
            assert z["wire"] == z["formula"]["wire"]
            assert z["wire_by_op"]["reduce_scatter"] == z["wire_by_op"]["all_gather"] \
                == (n - 1) * 4 * r[case]["padded"] // n
            assert set(dp["calls"]) == {"all_reduce"}
            assert set(z["calls"]) == {"reduce_scatter", "all_gather"}
        assert r["zero1"]["zero"]["calls"] == {"reduce_scatter": 1, "all_gather": 1}  # flat
        assert r["zero2"]["zero"]["calls"] == {"reduce_scatter": 3, "all_gather": 3}  # buckets
        assert r["zero1"]["zero"]["wire"] == r["zero1"]["dp"]["wire"]  # no padding at 1656


def test_an_uneven_model_is_padded_to_a_multiple_of_the_ranks(ranks):
    n = len(ranks)
    for r in ranks:
        assert r["uneven1"]["n_params"] == 450
        assert r["uneven1"]["padded"] == -(-450 // n) * n  # 450 on 2 ranks, 452 on 4
        assert r["uneven2"]["buckets"] == [-(-225 // n) * n] * 2  # each bucket padded: 226, 228
        assert r["uneven2"]["padded"] == 2 * -(-225 // n) * n


def test_zero3_sends_one_and_a_half_times_data_parallelism(ranks):
    n = len(ranks)
    for r in (x["zero3"] for x in ranks):
        assert r["calls"] == {"all_gather": 6, "reduce_scatter": 3}  # 3 blocks: 2 gathers each
        assert r["wire"] == r["formula"] == 3 * (n - 1) * 4 * 1656 // n
        assert r["ratio"] == 1.5
        assert r["held"]["total"] == 16 * 1656 // n  # everything sharded
        assert r["unsharded"]["total"] == 16 * 1656


def test_zero1_runs_a_step_function_written_as_the_exercise_has_it(ranks):
    for r in ranks:
        mine, labkits = r["learner"], r["zero1"]
        assert mine["zero"]["losses"] == labkits["zero"]["losses"]
        assert mine["weight_diff"] == labkits["weight_diff"] and mine["replica_diff"] == 0.0
        assert mine["zero"]["wire"] == labkits["zero"]["wire"]
        assert mine["zero"]["held"] == labkits["zero"]["held"]


def test_rows_for_the_figure_one_per_strategy(ranks):
    n = len(ranks)
    r = ranks[0]
    rows = zero.zero_rows(r["zero1"], r["zero2"], r["zero3"])
    assert [row["label"] for row in rows] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3 (FSDP2)"]
    assert [row["total"] for row in rows] == [16 * 1656, (8 + 8 / n) * 1656,
                                              (4 + 12 / n) * 1656, 16 * 1656 / n]
    assert [row["wire"] / rows[0]["wire"] for row in rows] == [1.0, 1.0, 1.0, 1.5]
    assert [row["in_flight"] for row in rows] == [0, 0, 4 * 552, 0]


def test_errors_on_ranks_say_what_to_do(ranks):
    errors = ranks[0]["errors"]
    assert "stage must be 1 (shard the optimizer state) or 2" in errors["stage"]
    assert "fully_shard" in errors["stage"]
    assert "has no trainable parameters" in errors["frozen"]
    assert "got no gradient in this backward" in errors["unused"]
    if len(ranks) == 4:
        assert errors["zero3_width"].startswith("width 6 does not split over 4 ranks: use a "
                                                "multiple of 4 (e.g. 4 or 8)")
    else:
        assert "zero3_width" not in errors


# ---- one rank, and no process group ------------------------------------------------------------

@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_is_plain_adam_and_sends_nothing(group, stage):
    r = zero.zero_check(stage, 4, 2, 2)
    assert r["world_size"] == 1 and r["padded"] == r["n_params"]
    assert r["weight_diff"] <= zero.TOL and r["loss_diff"] <= zero.TOL
    assert r["zero"]["wire"] == r["dp"]["wire"] == 0
    assert r["zero"]["held"]["after_step"]["total"] == 16 * r["n_params"]


def test_model_zero_grad_does_not_leave_stale_gradients_in_zero1(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    opt = zero.ZeroOptimizer(model, stage=1, lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    model.zero_grad()  # set_to_none: the grads are no longer views of the flat buffer
    model[1](torch.randn(2, 3)).sum().backward()  # only the second layer gets a gradient
    before = model[0].weight.detach().clone()
    opt.step()
    assert torch.equal(opt.flat.view(opt.flat_grad, model[0].weight), torch.zeros(3, 3))
    assert model[1].weight.grad.data_ptr() == opt.flat.view(opt.flat_grad,
                                                            model[1].weight).data_ptr()
    # Adam's momentum still moves the first layer, but by its old momentum only
    assert not torch.equal(model[0].weight, before)


def test_the_flat_buffer_holds_every_parameter_as_a_view():
    torch.manual_seed(0)
    model = mlp_blocks(2, 5)  # 450 parameters
    before = [p.detach().clone() for p in model.parameters()]
    flat = zero.flat_params(model, world=4)
    assert (flat.numel, flat.padded, flat.shard_numel) == (450, 452, 113)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} == \
        {flat.flat.untyped_storage().data_ptr()}
    assert torch.equal(flat.flat[450:], torch.zeros(2))  # the padding
    flat.flat.add_(1.0)  # the parameters ARE the buffer
    assert torch.equal(model[0][0].bias, before[1] + 1.0)
    b = flat.buckets[0]
    assert flat.shard(flat.flat, b, 3).data_ptr() == flat.flat[339:].data_ptr()
    assert zero.storage_bytes(model.parameters()) == 4 * 452


def test_buckets_follow_backward_order_and_pad_each():
    model = mlp_blocks(2, 5)
    flat = zero.flat_params(model, world=4, bucket_numel=225)
    assert [b.numel for b in flat.buckets] == [228, 228] and flat.padded == 456
    last_block = list(model[1].parameters())
    assert flat.buckets[0].params == last_block[::-1]  # the last layer's gradients come first
    assert flat.offset[id(last_block[-1])] == 0


def test_adam_by_hand_is_torch_adam():
    torch.manual_seed(0)
    p = torch.randn(50, requires_grad=True)
    mine, m, v = p.detach().clone(), torch.zeros(50), torch.zeros(50)
    opt = torch.optim.Adam([p], lr=1e-2, betas=(0.8, 0.99))
    for step in range(1, 4):
        g = torch.randn(50)
        p.grad = g.clone()
        opt.step()
        zero.adam_update(mine, g, m, v, step, lr=1e-2, betas=(0.8, 0.99))
    assert torch.equal(mine, p.detach())


def test_the_formulas():
    assert zero.zero_formulas(0, 1000, 4) == {"params": 4000, "grads": 4000, "optimizer": 8000,
                                              "total": 16000, "wire": 6000}
    assert zero.zero_formulas(1, 1000, 4)["optimizer"] == 2000
    assert zero.zero_formulas(2, 1000, 4) == {"params": 4000, "grads": 1000, "optimizer": 2000,
                                              "total": 7000, "wire": 6000}


def test_errors_without_ranks():
    with pytest.raises(ValueError, match=r"^stage must be 1 \(shard the optimizer state\) or 2 "
                                         r"\(the gradients too\), got 0; stage 3 .*fully_shard"):
        zero.ZeroOptimizer(mlp_blocks(1, 4), stage=0)
    with pytest.raises(ValueError, match=r"^step_fn is ZeRO-1's step on the flat gradient; "
                                         r"ZeRO-2 reduce-scatters during backward"):
        zero.ZeroOptimizer(mlp_blocks(1, 4), stage=2, step_fn=zero.zero_step)
    with pytest.raises(ValueError, match=r"^stage must be 1 or 2, got 3: zero_check compares"):
        zero.zero_check(3, 4, 2, 2)
    with pytest.raises(ValueError, match=r"^steps must be a whole number >= 2, got 1: the bytes "
                                         r"are measured in the last step"):
        zero.zero_check(1, 4, 2, 1)
    with pytest.raises(ValueError, match=r"^Sequential has no trainable parameters"):
        zero.flat_params(mlp_blocks(1, 4).requires_grad_(False), world=2)
    with pytest.raises(ValueError, match=r"one dtype and one device"):
        zero.flat_params(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()), world=2)
    with pytest.raises(ValueError, match=r"^world must be a whole number >= 1, got 0"):
        zero.flat_params(mlp_blocks(1, 4), world=0)
    with pytest.raises(ValueError, match=r"^bucket_numel must be a whole number >= 1"):
        zero.flat_params(mlp_blocks(1, 4), world=2, bucket_numel=0)

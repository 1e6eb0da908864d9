"""labkit.parallel.tensor: Megatron-style layers and the DTensor MLP against a dense MLP."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import launch
from labkit.parallel.tensor import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    _collective_name,
    check_split,
    count_collectives,
    dense_mlp,
    tp_check,
    tp_mlp,
)

from .conftest import cuda_gpus

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOL = 1e-5


def tp_checks() -> dict:
    """Run on every rank of one launch: tp_check, plus the layers' other modes and errors."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from labkit.parallel.tensor import (
        ColumnParallelLinear,
        RowParallelLinear,
        dense_mlp,
        dtensor_mlp,
        tp_check,
    )

    out = {"check": tp_check(batch=8, in_f=16, hidden=64, out_f=12, seed=3)}
    torch.manual_seed(1)
    dense, x = nn.Linear(10, 6), torch.randn(5, 10)
    # gather_output: every rank gets the whole output; input_is_parallel=False: the row layer
    # slices a full input itself. Both must equal the dense layer.
    col = ColumnParallelLinear.from_dense(dense, gather_output=True)
    row = RowParallelLinear.from_dense(dense, input_is_parallel=False)
    out["gathered"] = (col(x) - dense(x)).abs().max().item()
    out["split_input"] = (row(x) - dense(x)).abs().max().item()
    out["slice_shapes"] = (tuple(col.weight.shape), tuple(row.weight.shape))
    # Layers built from a seed equal the dense layer built from the same seed.
    torch.manual_seed(7)
    seeded = ColumnParallelLinear(10, 6)
    torch.manual_seed(7)
    full = nn.Linear(10, 6)
    out["seeded"] = (seeded.weight - full.weight.chunk(dist.get_world_size())[dist.get_rank()]
                     ).abs().max().item()
    try:
        ColumnParallelLinear(10, 6, tp=4)
    except ValueError as e:
        out["wrong_tp"] = str(e)
    try:  # DTensor's sharding propagation fails on an uneven hidden size: refused up front
        dtensor_mlp(dense_mlp(4, 5, 4))
    except ValueError as e:
        out["dtensor_uneven"] = str(e)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(tp_checks, nproc=2, show_ranks=[], timeout=180, warm=True).values


# ---- single process --------------------------------------------------------------------------


def test_a_hidden_size_that_does_not_split_names_sizes_and_degrees_that_do():
    with pytest.raises(ValueError, match=r"^hidden size 1000 does not split over 3 ranks: use a "
                                         r"multiple of 3 \(e\.g\. 999 or 1002\), or a TP degree "
                                         r"that divides 1000 \(e\.g\. 2, 4, 5, 8\)$"):
        ParallelMLP(16, 1000, 16, tp=3)
    assert check_split(1000, 8) == 125
    with pytest.raises(ValueError, match=r"out_features 6 does not split over 4 ranks: use a "
                                         r"multiple of 4 \(e\.g\. 4 or 8\), or a TP degree "
                                         r"that divides 6 \(e\.g\. 2, 3\)$"):
        ColumnParallelLinear(8, 6, tp=4)
    with pytest.raises(ValueError, match=r"out_features 2 does not split over 4 ranks: use a "
                                         r"multiple of 4 \(e\.g\. 4\)$"):
        ColumnParallelLinear(8, 2, tp=4)
    with pytest.raises(ValueError, match=r"in_features 7 does not split over 2 ranks: .*e\.g\. "
                                         r"6 or 8\)$"):  # 7 is prime: no degree to suggest
        RowParallelLinear(7, 4, tp=2)


def test_without_a_process_group_a_layer_holds_rank_0s_slice_and_refuses_to_run():
    torch.manual_seed(0)
    dense = nn.Linear(6, 4)
    col = ColumnParallelLinear.from_dense(dense, tp=2)
    row = RowParallelLinear.from_dense(dense, tp=2)
    assert torch.equal(col.weight, dense.weight[:2]) and torch.equal(col.bias, dense.bias[:2])
    assert torch.equal(row.weight, dense.weight[:, :3]) and torch.equal(row.bias, dense.bias)
    assert "out_features=4 (2 on rank 0 of 2)" in repr(col)
    with pytest.raises(RuntimeError, match=r"holds 1/2 of the weights: .*labkit\.launch\(fn, "
                                           r"nproc=2\)"):
        col(torch.randn(3, 6))


@pytest.mark.parametrize("tp", [0, -2, 1.5])
def test_a_tp_degree_must_be_a_whole_number(tp):
    from labkit.parallel.tensor import _degree_and_rank

    with pytest.raises(ValueError,
                       match=r"tp must be a whole number >= 1, got .* \(ranks that share"):
        _degree_and_rank(tp, None)
    assert _degree_and_rank(None, None) == (1, 0) and _degree_and_rank(4, None) == (4, 0)


def test_one_rank_is_the_dense_mlp_exactly():
    torch.manual_seed(0)
    dense = dense_mlp(8, 16, 4)
    x = torch.randn(5, 8)
    assert torch.equal(tp_mlp(dense)(x), dense(x))
    torch.manual_seed(0)
    assert torch.equal(ParallelMLP(8, 16, 4)(x), dense(x))  # same seed, same draws


@pytest.mark.parametrize("bad", [nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 4), nn.ReLU(),
                                                                 nn.Linear(5, 3))])
def test_tp_mlp_wants_linear_activation_linear(bad):
    with pytest.raises(ValueError, match=r"expected nn\.Sequential\(nn\.Linear\(in, hidden\), "
                                         r".*e\.g\. dense_mlp\(16, 64, 16\)"):
        tp_mlp(bad)


def test_tp_must_match_the_process_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match=r"tp=2 but the process group has 1 rank: leave "
                                             r"tp=None"):
            ColumnParallelLinear(4, 4, tp=2)
        # CommDebugMode also sees plain c10d calls: the hand-written layers' counter.
        assert count_collectives(dist.all_reduce, torch.ones(2)) == {"all_reduce": 1}
        assert count_collectives(dist.all_gather, [torch.ones(2)], torch.ones(2)) == {
            "all_gather": 1}
    finally:
        dist.destroy_process_group()


def test_collective_names_are_the_same_for_c10d_and_functional_ops():
    assert _collective_name("c10d.allreduce_") == "all_reduce"
    assert _collective_name("c10d_functional.all_reduce") == "all_reduce"
    assert _collective_name("c10d._allgather_base_") == "all_gather"
    assert _collective_name("c10d_functional.reduce_scatter_tensor") == "reduce_scatter"


def test_tp_check_needs_a_worker():
    with pytest.raises(RuntimeError, match="not initialised: run this inside a worker"):
        tp_check()


# ---- two ranks -------------------------------------------------------------------------------


ONE_EACH_WAY = {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}


@pytest.mark.parametrize("impl", ["megatron", "dtensor"])
def test_tensor_parallel_mlp_equals_the_dense_mlp(two_ranks, impl):
    for v in two_ranks:
        r = v["check"][impl]
        assert v["check"]["tp"] == 2
        assert r["output"] < TOL and r["input_grad"] < TOL, r
        assert set(r["grads"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        assert max(r["grads"].values()) < TOL, r["grads"]


@pytest.mark.parametrize("impl", ["megatron", "dtensor"])
def test_one_all_reduce_forward_and_one_backward(two_ranks, impl):
    assert [v["check"][impl]["collectives"] for v in two_ranks] == [ONE_EACH_WAY] * 2


def test_gather_output_split_input_and_seeded_layers_match_dense(two_ranks):
    for v in two_ranks:
        assert v["gathered"] < TOL and v["split_input"] < TOL
        assert v["slice_shapes"] == ((3, 10), (6, 5))
        assert v["seeded"] == 0.0
        assert "tp=4 but the process group has 2 ranks" in v["wrong_tp"]
        assert v["dtensor_uneven"].startswith("hidden size 5 does not split over 2 ranks")


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 2, reason="needs 2 CUDA GPUs for 2 NCCL ranks")
def test_tp_check_on_two_gpus_with_nccl():
    values = launch(tp_check, nproc=2, backend="nccl", show_ranks=[], timeout=300).values
    for v in values:
        for impl in ("megatron", "dtensor"):
            r = v[impl]
            assert r["output"] < 1e-4 and max(r["grads"].values()) < 1e-4, r
            assert r["collectives"] == ONE_EACH_WAY

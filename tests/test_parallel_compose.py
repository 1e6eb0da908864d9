"""labkit.parallel.compose: FSDP2 x TP and DP x PP on a 2-D DeviceMesh, against one process."""

from __future__ import annotations

import sys

import cloudpickle
import pytest

from labkit import launch
from labkit.parallel.compose import (
    _check_dp_pp,
    _check_fsdp_tp,
    check_mesh,
    dp_pp_step,
    dp_pp_traffic,
    fsdp_tp_bytes,
    fsdp_tp_step,
    fsdp_tp_traffic,
    mesh_2d,
    mesh_groups,
)

from .conftest import cuda_gpus

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# float32 on CPU. The loss: the same sums in another order (the batch split over ranks), so
# ~1e-7 relative. The weights: SGD's step is linear in the gradient, so its rounding stays
# ~1e-8; Adam's first step, lr * g / (|g| + eps), magnifies the rounding of a gradient near
# eps, which these tiny models (a fixed seed, deterministic on gloo) happen not to have. Either
# way each step moves some weight by far more than the tolerance (checked: "update").
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5
HELD = ("params", "grads", "optimizer", "total", "padding")


def four_rank_checks() -> dict:
    """Run on every rank of one 4-rank launch: 2 x 2 meshes, a 1 x 4 TP and a 4-stage pipeline."""
    from labkit.parallel.compose import dp_pp_step, fsdp_tp_step, mesh_2d

    out = {"fsdp_tp": fsdp_tp_step(2, 2, width=8, depth=2, batch=8, lr=1e-2, optimizer="adam"),
           # width 5: FSDP2's 5 rows of the second layer split 3 + 2, so it pads
           "uneven": fsdp_tp_step(2, 2, width=5, depth=1, batch=4),
           "tp4": fsdp_tp_step(1, 4, width=4, depth=1, batch=4),
           "dp_pp": dp_pp_step(2, 2, width=8, depth=4, batch=16, microbatches=2, lr=1e-2,
                               optimizer="adam"),
           # 3 blocks on 2 stages: 1 + 2, with GPipe
           "gpipe": dp_pp_step(2, 2, width=8, depth=3, batch=8, microbatches=2,
                               schedule="gpipe"),
           "pp4": dp_pp_step(1, 4, width=8, depth=4, batch=8, microbatches=4)}
    try:
        mesh_2d(3, 2)
    except ValueError as e:
        out["wrong_mesh"] = str(e)
    return out


def two_rank_checks() -> dict:
    """Run on every rank of one 2-rank launch: each composition degenerate in one dimension."""
    from labkit.parallel.compose import dp_pp_step, fsdp_tp_step

    return {"fsdp_tp_1x2": fsdp_tp_step(1, 2, width=8, depth=2, batch=4),
            "fsdp_tp_2x1": fsdp_tp_step(2, 1, width=8, depth=2, batch=4),
            "dp_pp_1x2": dp_pp_step(1, 2, width=8, depth=2, batch=4, microbatches=2),
            "dp_pp_2x1": dp_pp_step(2, 1, width=8, depth=2, batch=4, microbatches=2)}


@pytest.fixture(scope="module")
def four_ranks():
    return launch(four_rank_checks, nproc=4, show_ranks=[], timeout=300, warm=True).values


@pytest.fixture(scope="module")
def two_ranks():
    return launch(two_rank_checks, nproc=2, show_ranks=[], timeout=240, warm=True).values


def _assert_same_step(v):
    """One step on the mesh equals the step in one process: the loss and every weight."""
    assert abs(v["loss"] - v["reference_loss"]) <= LOSS_TOL * max(1.0, v["reference_loss"]), v
    assert max(v["weight_diff"].values()) < WEIGHT_TOL, v["weight_diff"]
    assert v["update"] > 100 * WEIGHT_TOL  # the step moved the weights: the check has teeth
    assert v["wire"] == v["wire_formula"], (v["wire"], v["wire_formula"])


def _assert_fsdp_tp(v, n_weights):
    _assert_same_step(v)
    assert len(v["weight_diff"]) == n_weights  # every weight of the model was compared
    assert {k: v["held"][k] for k in HELD} == {k: v["formula"][k] for k in HELD}


# ---- the mesh, with no ranks -----------------------------------------------------------------


def test_a_mesh_must_have_as_many_ranks_as_the_job():
    assert check_mesh(2, 2, 4) == (2, 2) and check_mesh(1, 4, 4) == (1, 4)
    with pytest.raises(ValueError, match=r"^a 2 x 3 \(dp x tp\) mesh needs 6 ranks but the job "
                                         r"has 4: pick dp \* tp = 4, e\.g\. \(1, 4\), \(2, 2\), "
                                         r"\(4, 1\)$"):
        check_mesh(2, 3, 4)
    with pytest.raises(ValueError, match=r"a 4 x 2 \(dp x pp\) mesh needs 8 ranks .* pick "
                                         r"dp \* pp = 2, e\.g\. \(1, 2\), \(2, 1\)$"):
        check_mesh(4, 2, 2, names=("dp", "pp"))
    with pytest.raises(ValueError, match=r"tp must be a whole number >= 1, got 0 \(the mesh's "
                                         r"inner dimension\)"):
        check_mesh(4, 0, 4)


def test_the_inner_dimension_holds_adjacent_ranks():
    assert mesh_groups(2, 2) == {"grid": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]],
                                 "tp": [[0, 1], [2, 3]]}
    assert mesh_groups(1, 4, names=("dp", "pp")) == {"grid": [[0, 1, 2, 3]],
                                                     "dp": [[0], [1], [2], [3]],
                                                     "pp": [[0, 1, 2, 3]]}
    assert mesh_groups(2, 4)["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_mesh_2d_needs_a_worker():
    with pytest.raises(RuntimeError, match="not initialised: run this inside a worker"):
        mesh_2d(2, 2)


def test_mesh_2d_refuses_a_mesh_larger_than_the_job(group):
    with pytest.raises(ValueError, match=r"^a 2 x 2 \(dp x tp\) mesh needs 4 ranks but the job "
                                         r"has 1: pick dp \* tp = 1, e\.g\. \(1, 1\)$"):
        mesh_2d(2, 2)


# ---- the formulas ----------------------------------------------------------------------------


@pytest.mark.parametrize("width, depth, dp, tp", [(8, 2, 2, 2), (16, 3, 2, 2), (8, 1, 1, 4),
                                                  (8, 2, 4, 1), (12, 2, 2, 3), (8, 2, 2, 4)])
def test_even_shards_hold_the_closed_form(width, depth, dp, tp):
    b = fsdp_tp_bytes(width, depth, dp, tp, optimizer="adam")
    # TP splits 8w^2 + 4w over tp, FSDP2 all of it over dp; the second bias is whole over tp.
    per_block = (8 * width**2 + 4 * width) // (dp * tp) + width // dp
    assert b["params"] == b["grads"] == 4 * depth * per_block
    assert b["optimizer"] == 2 * b["params"]  # Adam: exp_avg and exp_avg_sq
    assert b["total"] == 4 * b["params"] and b["padding"] == 0
    assert b["replicated_over_tp"] == 4 * depth * (width // dp)
    assert fsdp_tp_bytes(width, depth, dp, tp)["optimizer"] == b["params"]  # SGD's momentum


def test_uneven_shards_add_up_to_the_model_and_the_padding_is_counted():
    width, depth, dp, tp = 5, 2, 2, 2  # the second layer's 5 rows split 3 + 2
    ranks = [fsdp_tp_bytes(width, depth, dp, tp, dp_rank=r) for r in range(dp)]
    # Summed over the mesh: the model once, plus the second bias once more per extra tp rank.
    held = tp * sum(r["params"] for r in ranks)
    assert held == 4 * depth * (8 * width**2 + 5 * width + (tp - 1) * width)
    assert ranks[0]["unsharded_params"] == 4 * depth * (8 * width**2 + 5 * width)
    # Rank 1 holds 2 of 3 padded rows of the second weight (10 columns) and of its bias, for
    # its parameters and its gradients.
    assert [r["padding"] for r in ranks] == [0, 2 * 4 * depth * (10 + 1)]


def test_the_traffic_formulas():
    wire = fsdp_tp_traffic(8, 2, 2, 2, batch=8)
    shard = 2 * (8 * 8 + 8 + 4 * 16 + 4) * 4  # one block's tp shard, 2 dp pieces of it
    assert wire["bytes"] == {"dp": {"all_gather": 4 * shard // 2, "reduce_scatter": 2 * shard // 2},
                             "tp": {"all_reduce": 3 * 4 * 8 * 4}}
    assert wire["calls"] == {"dp": {"all_gather": 4, "reduce_scatter": 2},
                             "tp": {"all_reduce": 3}}
    assert fsdp_tp_traffic(8, 2, 1, 2, batch=8)["bytes"].keys() == {"tp"}  # dp of 1: no calls
    middle = dp_pp_traffic(8, 4, 1, 4, batch=8, microbatches=4, stage=1)
    assert middle == {"bytes": {"pp": {"send": 2 * 4 * 2 * 8 * 4, "recv": 0}},
                      "calls": {"pp": {"send": 8, "recv": 8}}}
    last = dp_pp_traffic(8, 4, 2, 2, batch=16, microbatches=2, stage=1)
    assert last["bytes"] == {"pp": {"send": 2 * 4 * 8 * 4, "recv": 0},
                             "dp": {"all_reduce": 2 * 552 * 4}}  # 2 blocks, 2 * (1/2) * S
    assert last["calls"]["dp"] == {"all_reduce": 8}


# ---- bad sizes -------------------------------------------------------------------------------


def test_a_hidden_size_that_does_not_split_over_tp_names_widths_and_degrees_that_do():
    with pytest.raises(ValueError, match=r"^the hidden size 4 \* width = 20 does not split over "
                                         r"tp=3 ranks: use a width that is a multiple of 3 "
                                         r"\(e\.g\. 3 or 6\), or a tp that divides 20 \(e\.g\. "
                                         r"2, 4, 5, 10\)$"):
        _check_fsdp_tp(1, 3, 5, 2, 4, "adam")
    with pytest.raises(ValueError, match=r"tp=8 ranks: use a width that is a multiple of 2 "
                                         r"\(e\.g\. 4 or 6\)"):
        fsdp_tp_bytes(5, 1, 1, 8)
    fsdp_tp_bytes(3, 1, 1, 4)  # width 3 is fine for tp=4: the hidden size 12 splits


def test_a_batch_must_split_over_the_replicas_and_their_micro_batches():
    with pytest.raises(ValueError, match=r"^a batch of 10 does not split over 4 data-parallel "
                                         r"ranks: use a multiple of 4 \(e\.g\. 8 or 12\)$"):
        _check_fsdp_tp(4, 1, 8, 2, 10, "adam")
    with pytest.raises(ValueError, match=r"^a batch of 12 does not split over 2 data-parallel "
                                         r"replicas x 4 micro-batches: use a multiple of 8 "
                                         r"\(e\.g\. 8 or 16\)$"):
        _check_dp_pp(2, 2, 8, 4, 12, 4, "adam", "1f1b")
    with pytest.raises(ValueError, match=r"a batch of 2 .* use a multiple of 4 \(e\.g\. 4\)$"):
        _check_dp_pp(2, 1, 8, 4, 2, 2, "adam", "1f1b")


def test_a_pipeline_needs_a_block_per_stage():
    with pytest.raises(ValueError, match=r"^depth 2 does not split into 4 pipeline stages: every "
                                         r"stage needs at least one block; use depth >= 4 \(a "
                                         r"multiple of 4 gives equal stages\) or fewer stages$"):
        _check_dp_pp(1, 4, 8, 2, 8, 2, "adam", "1f1b")


def test_unknown_optimizers_and_schedules_are_refused():
    with pytest.raises(ValueError, match=r"unknown optimizer 'lamb': use one of adam, sgd"):
        _check_fsdp_tp(1, 1, 8, 2, 4, "lamb")
    with pytest.raises(ValueError, match=r"unknown schedule 'zb': use gpipe or 1f1b"):
        _check_dp_pp(1, 1, 8, 2, 4, 2, "adam", "zb")
    with pytest.raises(ValueError, match=r"unknown optimizer"):
        fsdp_tp_bytes(8, 1, 1, 1, optimizer="adamw")


# ---- one rank: the whole path in this process ------------------------------------------------


def test_one_rank_runs_both_steps_in_this_process(group):
    _assert_fsdp_tp(fsdp_tp_step(1, 1, width=4, depth=1, batch=2), n_weights=4)
    v = dp_pp_step(1, 1, width=4, depth=1, batch=2, microbatches=1)
    _assert_same_step(v)
    assert v["wire"] == {"bytes": {}, "calls": {}}  # one rank: nothing on the wire


# ---- four ranks ------------------------------------------------------------------------------


def test_fsdp_x_tp_on_2x2_equals_one_process_and_its_formulas(four_ranks):
    for v in four_ranks:
        r = v["fsdp_tp"]
        _assert_fsdp_tp(r, n_weights=8)
        assert r["held"]["params"] == 2 * (8 * 64 // 4 + 4 * 8 // 4 + 8 // 2) * 4  # 1120 bytes
        assert r["held"]["optimizer"] == 2 * 1120  # Adam: two moments, sharded the same way
        dp_rank, tp_rank = divmod(v["fsdp_tp"]["rank"], 2)
        assert r["coords"] == {"dp": dp_rank, "tp": tp_rank}
        assert r["groups"] == {"dp": [tp_rank, tp_rank + 2], "tp": [2 * dp_rank, 2 * dp_rank + 1]}
        assert r["shards"]["0.0.weight"]["local"] == [8, 8]  # 32 x 8 / (2 * 2) rows
        assert r["shards"]["0.2.bias"]["placements"] == ["S(0)", "R"]  # whole over tp


def test_fsdp_x_tp_with_uneven_shards_pads_and_still_matches(four_ranks):
    for v in four_ranks:
        r = v["uneven"]
        _assert_fsdp_tp(r, n_weights=4)
        assert r["held"]["padding"] == (0 if r["coords"]["dp"] == 0 else 2 * 4 * (10 + 1))


def test_four_way_tensor_parallelism_all_reduces_over_every_rank(four_ranks):
    for v in four_ranks:
        r = v["tp4"]
        _assert_fsdp_tp(r, n_weights=4)
        assert r["groups"]["tp"] == [0, 1, 2, 3] and "dp" not in r["wire"]["bytes"]


def test_dp_x_pp_on_2x2_equals_one_process_and_its_formulas(four_ranks):
    for v in four_ranks:
        r = v["dp_pp"]
        _assert_same_step(r)
        assert r["stage"] == v["dp_pp"]["rank"] % 2
        assert r["blocks"] == ([0, 1] if r["stage"] == 0 else [2, 3])
        assert sorted(r["weight_diff"]) == sorted(f"{b}.{layer}.{kind}" for b in r["blocks"]
                                                  for layer in (0, 2) for kind in ("weight",
                                                                                   "bias"))
        assert r["held"]["params"] == 2 * 552 * 4  # two blocks: the stage, replicated over dp
        assert r["shape_messages"]["bytes"] < 1000  # the shapes, once: small beside the data


def test_dp_x_pp_with_gpipe_and_unequal_stages(four_ranks):
    for v in four_ranks:
        r = v["gpipe"]
        _assert_same_step(r)
        assert r["blocks"] == ([0] if r["stage"] == 0 else [1, 2])  # split_stages: 1 + 2


def test_a_four_stage_pipeline_sends_both_ways_from_the_middle(four_ranks):
    sends = [v["pp4"]["wire"]["calls"]["pp"]["send"] for v in four_ranks]
    assert sends == [4, 8, 8, 4]  # 4 micro-batches: forward only, both ways, ..., backward only
    for v in four_ranks:
        _assert_same_step(v["pp4"])


def test_a_mesh_that_does_not_fit_the_job_is_refused_on_the_ranks(four_ranks):
    for v in four_ranks:
        assert v["wrong_mesh"].startswith("a 3 x 2 (dp x tp) mesh needs 6 ranks but the job "
                                          "has 4: pick dp * tp = 4")


def test_warm_ranks_build_a_new_mesh_on_every_run(four_ranks):
    # The fixture's run built seven meshes; this run's are built and torn down again.
    values = launch(fsdp_tp_step, 2, 2, width=4, depth=1, batch=4, nproc=4, show_ranks=[],
                    timeout=120, warm=True).values
    for v in values:
        _assert_fsdp_tp(v, n_weights=4)


# ---- two ranks: 1 x 2 and 2 x 1 --------------------------------------------------------------


@pytest.mark.parametrize("case", ["fsdp_tp_1x2", "fsdp_tp_2x1"])
def test_fsdp_x_tp_degenerates_to_tp_or_fsdp_alone(two_ranks, case):
    for v in two_ranks:
        _assert_fsdp_tp(v[case], n_weights=8)
        only = "tp" if case.endswith("1x2") else "dp"
        assert list(v[case]["wire"]["bytes"]) == [only]


@pytest.mark.parametrize("case", ["dp_pp_1x2", "dp_pp_2x1"])
def test_dp_x_pp_degenerates_to_pp_or_dp_alone(two_ranks, case):
    for v in two_ranks:
        _assert_same_step(v[case])
        only = "pp" if case.endswith("1x2") else "dp"
        assert list(v[case]["wire"]["bytes"]) == [only]


# ---- GPUs ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 1, reason="needs a CUDA GPU")
def test_one_nccl_rank_runs_both_steps_on_its_gpu(nccl_group):
    # Every tensor on the rank's GPU: nothing in either step assumes the CPU.
    _assert_fsdp_tp(fsdp_tp_step(1, 1, width=8, depth=2, batch=4), n_weights=8)
    _assert_same_step(dp_pp_step(1, 1, width=8, depth=2, batch=4, microbatches=2))


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 4, reason="needs 4 CUDA GPUs for a 2 x 2 NCCL mesh")
def test_both_compositions_on_four_gpus_with_nccl():
    values = launch(four_rank_checks, nproc=4, backend="nccl", show_ranks=[], timeout=300).values
    for v in values:
        for case in ("fsdp_tp", "uneven", "dp_pp", "gpipe", "pp4"):
            assert abs(v[case]["loss"] - v[case]["reference_loss"]) < 1e-4
            assert max(v[case]["weight_diff"].values()) < 1e-4  # TF32 and NCCL's own order
            assert v[case]["wire"] == v[case]["wire_formula"]

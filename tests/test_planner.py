"""labkit.planner: each formula on hand-computed cases, every refusal, suggest(), the published
runs, and two predictions checked against real runs on gloo ranks (measured by
labkit.parallel.traffic.step_traffic).

Everything but the real runs is arithmetic (milliseconds). The real runs (DDP's all-reduce bytes,
FSDP2's bytes held and sent) take one warm launch per rank count, 2 and 4.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from functools import partial

import cloudpickle
import pytest

from labkit import launch, planner
from labkit.planner import (
    FP32_ADAM,
    PUBLISHED,
    Cluster,
    Degrees,
    Model,
    PlanError,
    allreduce_bytes,
    as_degrees,
    comm_bytes,
    gather_bytes,
    group_links,
    layer_activation_bytes,
    model_state_bytes,
    plan,
    predicted_vs_measured,
    stage_activation_bytes,
    step_seconds,
    suggest,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GiB = 2**30
# A model with round numbers: 1e9 parameters, 8 layers of hidden 1024, 8 heads, 128 tokens.
# Fields are keyword-only: partial() gives the round model, a test overrides what it needs.
one_b = partial(Model, name="1B", params=1e9, layers=8, hidden=1024, heads=8, seq_len=128,
                micro_batch=1)
ONE_B = one_b()
EIGHT = Cluster(devices=8, memory_gib=80)
GPT3 = Model("gpt3", params=175e9, layers=96, hidden=12288, heads=96, seq_len=2048,
             micro_batch=1)
SEVEN_B = Model("7B", params=6.7e9, layers=32, hidden=4096, heads=32, seq_len=2048,
                micro_batch=1, flash_attention=True)
# FSDP2 shards dim 0 of every parameter; mlp_blocks(4, 64)'s (256 and 64 rows) split evenly
# over 2 and 4 ranks, so its bytes are exact. Uneven shards would be padded by FSDP2: the band
# of the memory check, 1 %, allows for that padding.
FSDP_BAND = 0.01


# ---- ring conventions ------------------------------------------------------------------------


def test_ring_formulas_are_labkit_traffics():
    from labkit.parallel.traffic import ring_bytes

    for n in (1, 2, 4, 8):
        assert allreduce_bytes(4096, n) == ring_bytes("all_reduce", 4096, n)
        assert gather_bytes(4096, n) == ring_bytes("all_gather", 4096, n)
        assert gather_bytes(4096, n) == ring_bytes("reduce_scatter", 4096, n)


# ---- model state -----------------------------------------------------------------------------


@pytest.mark.parametrize("zero, params, grads, optimizer", [
    (0, 2.0, 2.0, 12.0), (1, 2.0, 2.0, 1.5), (2, 2.0, 0.25, 1.5), (3, 0.25, 0.25, 1.5)])
def test_zero_stages_shard_over_the_data_parallel_ranks(zero, params, grads, optimizer):
    m = model_state_bytes(ONE_B, Degrees(dp=8, zero=zero))
    assert (m["params"] / 1e9, m["grads"] / 1e9, m["optimizer"] / 1e9) == (params, grads,
                                                                            optimizer)


def test_tp_pp_divide_the_state_and_zero_shards_over_dp_times_cp():
    m = model_state_bytes(ONE_B, Degrees(dp=2, tp=2, pp=2, cp=2, zero=1))
    # 1e9 / (tp*pp) = 2.5e8 local parameters; the optimizer state over dp*cp = 4 ranks
    assert (m["params"], m["grads"], m["optimizer"]) == (5e8, 5e8, 12 * 2.5e8 / 4)


def test_zero3_buffers_hold_two_gathered_layers_and_one_layers_gradients():
    m = model_state_bytes(ONE_B, Degrees(dp=4, pp=2, zero=3))
    per_layer = 1e9 / 2 / 4  # 5e8 local parameters over the stage's 4 layers
    assert m["buffers"] == (2 * 2 + 2) * per_layer
    assert model_state_bytes(ONE_B, Degrees(dp=4, zero=2))["buffers"] == 0
    assert model_state_bytes(ONE_B, Degrees(tp=4, zero=3))["buffers"] == 0  # nothing to gather


def test_experts_split_over_ep_and_shard_over_the_ranks_holding_them():
    moe = Model("moe", params=9e9, layers=8, hidden=1024, heads=8, seq_len=128, micro_batch=1,
                experts=8, top_k=2, expert_params=8e9)
    m = model_state_bytes(moe, Degrees(dp=8, ep=4, zero=1))
    # dense 1e9 whole, experts 8e9 / ep=4 = 2e9; optimizer over 8 and over 8/ep = 2 ranks
    assert m["params"] == 2 * 3e9
    assert m["optimizer"] == 12 * (1e9 / 8 + 2e9 / 2)
    assert moe.active_params == 1e9 + 8e9 * 2 / 8


# ---- activations -------------------------------------------------------------------------------


def test_megatron_layer_activations_34_plus_5as_over_h():
    sbh = 2048 * 12288
    assert layer_activation_bytes(GPT3, Degrees()) / sbh == 34 + 5 * 96 * 2048 / 12288
    # tensor parallel without sequence parallelism: 10 + 24/t + 5as/(ht)
    d = Degrees(dp=1, tp=8, sp=False)
    assert math.isclose(layer_activation_bytes(GPT3, d) / sbh, 10 + 24 / 8 + 5 * 96 * 2048
                        / (12288 * 8))
    # with sequence parallelism: everything / t
    assert math.isclose(layer_activation_bytes(GPT3, Degrees(tp=8)) / sbh, 114 / 8)


def test_activation_options_flash_dropout_gqa_gated_cp_bytes():
    sbh = 2048 * 12288
    flash = dataclasses.replace(GPT3, flash_attention=True)
    assert layer_activation_bytes(flash, Degrees()) / sbh == 34
    no_dropout = dataclasses.replace(GPT3, dropout=False)
    assert layer_activation_bytes(no_dropout, Degrees()) / sbh == 32 + 2 * 96 * 2048 / 12288
    gqa = dataclasses.replace(flash, kv_heads=12)  # K and V 1/8 of Q's size
    assert layer_activation_bytes(gqa, Degrees()) / sbh == 34 - 2 * 2 * (1 - 1 / 8)
    gated = dataclasses.replace(flash, gated_mlp=True)  # four ffn-wide tensors, not two
    assert layer_activation_bytes(gated, Degrees()) / sbh == 34 + 2 * 2 * 4
    assert layer_activation_bytes(flash, Degrees(cp=4)) / sbh == 34 / 4
    fp32 = dataclasses.replace(no_dropout, flash_attention=True, act_bytes=4)
    assert layer_activation_bytes(fp32, Degrees()) == 2 * layer_activation_bytes(
        dataclasses.replace(fp32, act_bytes=2), Degrees())


def test_experts_compute_each_token_top_k_times():
    dense = dataclasses.replace(ONE_B, flash_attention=True)
    moe = dataclasses.replace(dense, experts=4, top_k=2, expert_params=5e8)
    sbh = 128 * 1024
    assert (layer_activation_bytes(moe, Degrees()) - layer_activation_bytes(dense, Degrees())
            ) / sbh == 2 * 8 * (2 - 1)  # the two ffn-wide tensors once more


def test_stage_zero_of_1f1b_holds_min_pp_m_micro_batches():
    per_layer = layer_activation_bytes(ONE_B, Degrees(pp=4))
    assert stage_activation_bytes(ONE_B, Degrees(pp=4)) == 4 * 2 * per_layer
    assert stage_activation_bytes(ONE_B, Degrees(pp=4, microbatches=2)) == 2 * 2 * per_layer
    assert stage_activation_bytes(ONE_B, Degrees(pp=4, microbatches=16)) == 4 * 2 * per_layer
    # no pipeline: gradient accumulation keeps one micro-batch at a time
    assert stage_activation_bytes(ONE_B, Degrees(microbatches=8)) == 8 * layer_activation_bytes(
        ONE_B, Degrees())


def test_checkpointing_keeps_layer_inputs_and_recomputes_one_layer():
    ckpt = dataclasses.replace(ONE_B, activation_checkpointing=True)
    d = Degrees(tp=2, pp=2)
    kept = 128 * 1024 * 2 / 2  # the input, split by sequence parallelism
    assert stage_activation_bytes(ckpt, d) == 2 * 4 * kept + layer_activation_bytes(ckpt, d)
    no_sp = Degrees(tp=2, pp=2, sp=False)
    assert stage_activation_bytes(ckpt, no_sp) == 2 * 4 * 2 * kept + layer_activation_bytes(
        ckpt, no_sp)


# ---- communication -----------------------------------------------------------------------------


def test_dp_bytes_ddp_zero1_zero2_zero3():
    P = 1e9 * 2  # local params bytes = grads bytes (2 each)
    assert comm_bytes(ONE_B, Degrees(dp=8))["dp"] == 2 * 7 / 8 * P
    assert comm_bytes(ONE_B, Degrees(dp=8, zero=1))["dp"] == 7 / 8 * (P + P)
    assert comm_bytes(ONE_B, Degrees(dp=8, zero=2, microbatches=4))["dp"] == 7 / 8 * (4 * P + P)
    assert comm_bytes(ONE_B, Degrees(dp=8, zero=3, microbatches=4))["dp"] == 4 * 7 / 8 * 3 * P
    # ZeRO-3 sends 1.5 times DDP's bytes for one micro-batch
    assert comm_bytes(ONE_B, Degrees(dp=8, zero=3))["dp"] == 1.5 * comm_bytes(
        ONE_B, Degrees(dp=8))["dp"]
    assert comm_bytes(ONE_B, Degrees(tp=8))["dp"] == 0


def test_dp_bytes_with_experts_use_their_own_group():
    moe = Model("moe", params=9e9, layers=8, hidden=1024, heads=8, seq_len=128, micro_batch=1,
                experts=8, expert_params=8e9)
    got = comm_bytes(moe, Degrees(dp=8, ep=4))["dp"]
    assert got == allreduce_bytes(1e9 * 2, 8) + allreduce_bytes(2e9 * 2, 2)


def test_tp_four_allreduces_per_layer_six_with_checkpointing():
    A = 128 * 1024 * 2
    d = Degrees(tp=4, pp=2, microbatches=3, sp=False)
    assert comm_bytes(ONE_B, d)["tp"] == 4 * 3 * 4 * allreduce_bytes(A, 4)
    ckpt = dataclasses.replace(ONE_B, activation_checkpointing=True)
    assert comm_bytes(ckpt, d)["tp"] == 6 * 3 * 4 * allreduce_bytes(A, 4)
    # sequence parallelism: the same bytes, plus QKV's and fc1's inputs gathered again in
    # backward (notebook 09's regather): 2 all-gathers per layer and micro-batch
    sp = dataclasses.replace(d, sp=True)
    assert comm_bytes(ONE_B, sp)["tp"] == (4 * 3 * 4 * allreduce_bytes(A, 4)
                                           + 2 * 3 * 4 * gather_bytes(A, 4))


def test_pp_sends_one_activation_per_micro_batch_each_way():
    A = 128 * 1024 * 2
    assert comm_bytes(ONE_B, Degrees(pp=1, microbatches=5))["pp"] == 0
    assert comm_bytes(ONE_B, Degrees(pp=2, microbatches=5))["pp"] == 5 * A
    assert comm_bytes(ONE_B, Degrees(pp=4, microbatches=5))["pp"] == 2 * 5 * A
    assert comm_bytes(ONE_B, Degrees(pp=4, tp=2, microbatches=5))["pp"] == 2 * 5 * A / 2


def test_cp_passes_k_and_v_around_the_ring_as_notebook_09_measures():
    gqa = dataclasses.replace(ONE_B, kv_heads=2)  # K, V each 1/4 of the hidden size
    C = 128 / 4 * 1024 * 2 / 4  # one K chunk: s/cp tokens, a quarter of the hidden size
    # forward 2(n-1)C, backward 2(2n-1)C (dK, dV make one hop more): 8 layers, 1 micro-batch
    assert comm_bytes(gqa, Degrees(cp=4))["cp"] == (2 * 3 + 2 * 7) * 8 * C
    ckpt = dataclasses.replace(gqa, activation_checkpointing=True)
    assert comm_bytes(ckpt, Degrees(cp=4))["cp"] == (2 * 3 + 2 * 7 + 2 * 3) * 8 * C


def test_ep_all_to_alls_send_the_tokens_routed_elsewhere():
    moe = Model("moe", params=9e9, layers=8, hidden=1024, heads=8, seq_len=128, micro_batch=1,
                experts=8, top_k=2, expert_params=8e9)
    A = 128 * 1024 * 2
    assert comm_bytes(moe, Degrees(dp=4, ep=4))["ep"] == 4 * 8 * 3 / 4 * 2 * A
    assert comm_bytes(ONE_B, Degrees(dp=4))["ep"] == 0


def test_links_follow_megatrons_rank_order():
    links = group_links(Cluster(devices=64, memory_gib=80), Degrees(dp=2, tp=4, cp=2, pp=4))
    assert links == {"dp": "inter-node", "tp": "intra-node", "pp": "inter-node",
                     "cp": "intra-node", "ep": None}
    assert group_links(EIGHT, Degrees(dp=8))["dp"] == "intra-node"
    assert group_links(Cluster(devices=16, memory_gib=80), Degrees(tp=16))["tp"] == "inter-node"


def test_step_seconds_compute_bubble_and_links():
    cluster = Cluster(devices=8, memory_gib=80, intra_GBps=100, inter_GBps=10, tflops=100)
    d = Degrees(dp=2, pp=4, microbatches=8, overlap=False)
    comm = comm_bytes(ONE_B, d)
    s = step_seconds(ONE_B, cluster, d, comm)
    tokens = 2 * 8 * 1 * 128
    latency = 10e-6  # the default, per ring step
    assert math.isclose(s["compute"], 6 * 1e9 * tokens / (8 * 100e12))
    assert math.isclose(s["bubble"], s["compute"] * 3 / 8)
    # DDP's one all-reduce over 2 ranks: 2 ring steps; a middle stage's 2 sends per micro-batch
    assert math.isclose(s["dp"], comm["dp"] / 100e9 + 2 * latency)
    assert math.isclose(s["pp"], comm["pp"] / 100e9 + 2 * 8 * latency)
    assert math.isclose(s["step"], s["compute"] + s["bubble"] + s["comm"])
    assert s["comm"] == s["transfer"]  # nothing overlapped
    # overlapped: the gradients' all-reduce hides behind backward, the pipeline's sends do not
    hidden = step_seconds(ONE_B, cluster, dataclasses.replace(d, overlap=True), comm)
    assert hidden["dp"] == 0 and hidden["pp"] == s["pp"] and hidden["transfer"] == s["transfer"]


# ---- plan: the verdict ---------------------------------------------------------------------------


def test_plan_adds_up_and_fits_against_memory_less_headroom():
    p = plan(SEVEN_B, EIGHT, Degrees(dp=8, zero=1))
    parts = ("params", "grads", "optimizer", "activations", "buffers")
    assert p.memory["total"] == sum(p.memory[k] for k in parts)
    assert p.budget == 80 * GiB * 0.9 and p.fits and p.why == ""
    assert p.comm["total"] == sum(p.comm[k] for k in ("dp", "tp", "pp", "cp", "ep"))
    assert p.bubble == 0 and "fits" in str(p)
    row = p.row("mine")
    assert row["label"] == "mine" and row["device_memory"] == 80 * GiB


def test_why_names_the_biggest_part_and_what_helps():
    state = plan(SEVEN_B, EIGHT, Degrees(dp=8))
    assert not state.fits
    assert "biggest part is optimizer" in state.why and "ZeRO-1" in state.why
    assert "ZeRO-3" in state.why and "more tp or pp" in state.why
    alone = plan(SEVEN_B, Cluster(devices=1, memory_gib=80), Degrees())
    assert "ZeRO has nothing to shard over" in alone.why
    long = dataclasses.replace(SEVEN_B, seq_len=131072)
    acts = plan(long, EIGHT, Degrees(dp=1, tp=8, zero=1))
    assert "biggest part is activations" in acts.why
    assert "activation checkpointing" in acts.why and "cp to split the sequence" in acts.why
    no_sp = plan(dataclasses.replace(long, flash_attention=False, micro_batch=2),
                 EIGHT, Degrees(tp=8, sp=False))
    assert "sequence parallelism" in no_sp.why and "flash attention" in no_sp.why
    assert "smaller micro_batch" in no_sp.why


def test_tp_across_nodes_and_too_few_micro_batches_are_warned_not_refused():
    p = plan(SEVEN_B, Cluster(devices=16, memory_gib=80), Degrees(tp=16))
    assert p.links["tp"] == "inter-node"
    assert any("spans 2 nodes" in w for w in p.warnings)
    q = plan(SEVEN_B, EIGHT, Degrees(dp=2, pp=4, microbatches=2))
    assert any("bubble is 60%" in w for w in q.warnings)
    assert "note:" in str(q)


@pytest.mark.parametrize("model, cluster, degrees, message", [
    (SEVEN_B, EIGHT, Degrees(dp=2, tp=2), "= 4, but the cluster has 8 devices.*"
                                                   "Keep tp=2 pp=1 cp=1 and use dp=4"),
    (SEVEN_B, EIGHT, Degrees(dp=1, tp=3), "For example dp=8 tp=1 pp=1"),
    (SEVEN_B, EIGHT, Degrees(dp=1, pp=8), None),  # 32 layers: fine
    (dataclasses.replace(SEVEN_B, layers=30), EIGHT, Degrees(dp=2, pp=4),
     "30 layers do not split into pp=4 equal stages.*1, 2, 3, 5, 6, 10"),
    (dataclasses.replace(SEVEN_B, heads=64, hidden=4096, kv_heads=2), EIGHT,
     Degrees(dp=2, tp=4), "kv_heads=2 does not split over tp=4"),
    (one_b(name="odd", hidden=1020, heads=12), EIGHT, Degrees(tp=8),
     "heads=12 does not split over tp=8"),
    (dataclasses.replace(SEVEN_B, seq_len=2052), EIGHT, Degrees(dp=2, cp=4),
     "seq_len=2052 does not split into 2\\*cp=8 chunks.*zig-zag"),
    (dataclasses.replace(SEVEN_B, seq_len=1028), EIGHT, Degrees(dp=1, tp=8),
     "multiple of 8, or Degrees\\(sp=False\\)"),
    (SEVEN_B, EIGHT, Degrees(dp=8, ep=2), "the model has no experts"),
    (one_b(name="moe", params=9e9, experts=6, expert_params=8e9), EIGHT,
     Degrees(dp=8, ep=4), "experts=6 do not split over ep=4"),
    (one_b(name="moe", params=9e9, experts=8, expert_params=8e9), EIGHT,
     Degrees(dp=2, tp=4, ep=4), "ep=4 must divide dp=2"),
])
def test_plan_refusals_say_what_to_change(model, cluster, degrees, message):
    if message is None:
        assert plan(model, cluster, degrees).degrees.pp == 8
        return
    with pytest.raises(PlanError, match=message):
        plan(model, cluster, degrees)


def test_descriptions_take_their_numbers_by_name():
    # Seven positional numbers are easy to misplace (heads for hidden): every field but a
    # Model's name is keyword-only, and each has a line of documentation in the source.
    with pytest.raises(TypeError, match="positional"):
        Model("m", 1e9, 8, 1024, 8, 128, 1)
    with pytest.raises(TypeError, match="positional"):
        Cluster(8, 80)
    with pytest.raises(TypeError, match="positional"):
        Degrees(2)
    import inspect

    for cls in (Model, Cluster, Degrees):
        source = inspect.getsource(cls)
        for f in dataclasses.fields(cls):
            after = source.split(f"\n    {f.name}: ", 1)[1].split("\n", 2)[1].strip()
            assert after.startswith('"""') and len(after) > 10, (cls.__name__, f.name)


@pytest.mark.parametrize("build, message", [
    (lambda: one_b(params=0), "params must be a number > 0"),
    (lambda: one_b(layers=8.5), "layers must be a whole number"),
    (lambda: one_b(hidden=1000, heads=16), "hidden=1000 does not split into heads=16"),
    (lambda: one_b(name="m", kv_heads=3), "kv_heads=3 must divide heads=8"),
    (lambda: one_b(name="m", experts=2, top_k=3), "top_k=3 is more than"),
    (lambda: one_b(name="m", expert_params=5e8), "experts=1"),
    (lambda: one_b(name="m", experts=4), "needs expert_params"),
    (lambda: one_b(name="m", act_bytes=0), "act_bytes must be a number"),
    (lambda: Cluster(devices=0, memory_gib=80), "devices must be a whole number"),
    (lambda: Cluster(devices=8, memory_gib=-1), "memory_gib must be a number > 0"),
    (lambda: Cluster(devices=8, memory_gib=80, headroom=1), "headroom is the fraction"),
    (lambda: Cluster(devices=12, memory_gib=80), "12 devices do not fill nodes of 8"),
    (lambda: Degrees(tp=0), "tp must be a whole number"),
    (lambda: Degrees(zero=4), "zero is the ZeRO stage"),
    (lambda: Degrees(zero=True), "zero is the ZeRO stage"),
    (lambda: Degrees(microbatches=0), "microbatches must be a whole number"),
    (lambda: as_degrees({"dp": 2, "zer0": 1}), "unknown keys \\['zer0'\\]"),
    (lambda: as_degrees((2, 1, 1)), "not tuple"),
])
def test_descriptions_check_themselves(build, message):
    with pytest.raises(PlanError, match=message):
        build()


def test_plan_error_is_a_value_error_and_degrees_come_from_dicts():
    assert issubclass(PlanError, ValueError)
    assert as_degrees({"dp": 4, "tp": 2, "zero": 1}) == Degrees(dp=4, tp=2, zero=1)
    assert plan(SEVEN_B, EIGHT, {"dp": 8, "zero": 1}).fits
    assert str(Degrees(dp=2, tp=4, sp=False)).endswith("zero=0 (no sp)")
    assert Cluster(devices=16, memory_gib=40).nodes == 2
    assert str(Cluster(devices=16, memory_gib=40, name="x")) == "x"


def test_from_module_counts_a_real_modules_parameters():
    from labkit.parallel.memory import mlp_blocks

    m = Model.from_module(mlp_blocks(4, 64), layers=4, hidden=64, heads=1, seq_len=1,
                          micro_batch=8, **FP32_ADAM)
    assert m.params == 132352 and m.name == "Sequential" and m.param_bytes == 4


def test_predicted_vs_measured_rows_and_unknown_keys():
    p = plan(SEVEN_B, EIGHT, Degrees(dp=8, zero=1))
    rows = predicted_vs_measured(p, {"dp": p.comm["dp"], "params": p.memory["params"] / 2})
    assert [r["what"] for r in rows] == ["dp bytes sent", "params bytes held"]
    assert [r["ratio"] for r in rows] == [1.0, 0.5]
    with pytest.raises(PlanError, match="unknown measurement 'total'"):
        predicted_vs_measured(p, {"total": 1})


# ---- suggest ----------------------------------------------------------------------------------


def test_suggest_ranks_the_layouts_that_fit_by_overhead():
    plans = suggest(SEVEN_B, EIGHT, top=5)
    assert len(plans) == 5 and all(p.fits for p in plans)
    overheads = [p.seconds["overhead"] for p in plans]
    assert overheads == sorted(overheads)
    assert all(p.degrees.tp <= 8 and p.degrees.world == 8 for p in plans)
    # every layout fixes the same global batch: devices * micro_batch sequences
    assert all(p.degrees.dp * p.degrees.m == 8 for p in plans)
    assert len({str(p.degrees) for p in plans}) == 5
    only_zero3 = suggest(SEVEN_B, EIGHT, zero=(3,), top=3, global_batch=64)
    assert all(p.degrees.zero == 3 for p in only_zero3)
    assert all(p.degrees.dp * p.degrees.m == 64 for p in only_zero3)


def test_suggest_says_fits_nowhere_with_the_smallest_layout():
    big = dataclasses.replace(SEVEN_B, params=70e9)
    # the model state alone is too big: no activation advice, only devices
    with pytest.raises(PlanError, match="fits nowhere on 2 x 16 GiB.*needs .* GiB per device, "
                                        "14.4 GiB usable.*model state alone .* no activation "
                                        "setting helps: use more devices") as err:
        suggest(big, Cluster(devices=2, memory_gib=16))
    assert "checkpointing" not in str(err.value)
    # activations too big, the state small: checkpointing is advice that can help
    long = dataclasses.replace(SEVEN_B, params=1e9, seq_len=2**21, flash_attention=False)
    with pytest.raises(PlanError, match="fits nowhere.*more devices.*checkpointing"):
        suggest(long, Cluster(devices=2, memory_gib=16))
    with pytest.raises(PlanError, match="no layout of 8 devices splits odd"):
        suggest(one_b(name="odd", layers=7, hidden=1022, heads=7, seq_len=3), EIGHT,
                global_batch=3)


# ---- published runs ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_runs_plan_as_their_papers_describe_them(name):
    # No verdict is asserted: the inputs are the papers', not tuned until the plan fits.
    run = PUBLISHED[name]
    p = run.plan()
    assert p.degrees.world == run.cluster.devices and run.source and run.notes
    assert p.memory["total"] > 0 and ("does not fit" in str(p)) == (not p.fits)


def test_what_the_published_runs_relied_on():
    gpt3 = PUBLISHED["gpt3-175b"]
    plain = dataclasses.replace(gpt3.model, activation_checkpointing=False)
    assert not plan(plain, gpt3.cluster, gpt3.degrees).fits  # recomputation was needed


def test_llama3_405b_is_described_as_its_paper_has_it():
    llama = PUBLISHED["llama3-405b"]
    m, d = llama.model, llama.degrees
    assert m.layers == 126 and m.gated_mlp and m.kv_heads == 8 and m.ffn == 53248
    assert d.stage_layers == (7,) + (8,) * 14 + (7,) and sum(d.stage_layers) == 126
    assert (d.tp, d.cp, d.pp, d.dp) == (8, 1, 16, 128) and d.zero == 3 and d.keep_gathered
    assert d.dp * d.m * m.seq_len == 16 * 2**20  # 16M tokens per batch
    p = llama.plan()
    assert p.stage == 1  # a middle stage (8 layers, 15 micro-batches in flight) holds the most
    # its weights stay gathered through the step: a whole stage's bf16 weights as buffers
    per_device = 405e9 * 8 / 126 / 8
    assert math.isclose(p.memory["buffers"], 2 * per_device + 2 * per_device / 8)
    for stale in ("128 slots", "gated_mlp=True counts", "zero=3 here"):
        assert stale not in llama.notes + llama.source


def test_plots_draw_plans_and_checks():
    from matplotlib import pyplot as plt

    from labkit import plots

    draw, check = plots.planner_plot, plots.planner_check_plot
    rows = [p.row() for p in suggest(SEVEN_B, EIGHT, top=3)]
    fig = draw(rows)
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 3 * 5
    plt.close(fig)
    fig, ax = plt.subplots()
    assert draw(rows, ax=ax) is fig and len(fig.axes) == 1
    plt.close(fig)
    p = plan(SEVEN_B, EIGHT, Degrees(dp=8, zero=1))
    fig = check(predicted_vs_measured(p, {"dp": p.comm["dp"]}))
    assert len(fig.axes[0].patches) == 2
    plt.close(fig)
    with pytest.raises(ValueError, match="no plans to plot"):
        draw([])
    with pytest.raises(ValueError, match="no rows to plot"):
        check([])


# ---- against real runs: DDP's and FSDP2's bytes --------------------------------------------------


def real_runs(width: int) -> dict:
    """On every rank: DDP's and FSDP2's bytes sent in one step, and FSDP2's bytes held."""
    from functools import partial

    from labkit.parallel.memory import fsdp_memory, mlp_blocks
    from labkit.parallel.traffic import step_traffic

    model_fn = partial(mlp_blocks, 4, width)
    return {"ddp": step_traffic(model_fn, wrap="ddp"), "fsdp": step_traffic(model_fn, wrap="fsdp"),
            "held": fsdp_memory(model_fn, steps=1)}


@pytest.mark.parametrize("n", [2, 4])
def test_planner_predicts_ddp_and_fsdp2_on_real_ranks(n):
    from labkit.parallel.memory import mlp_blocks

    values = launch(real_runs, 64, nproc=n, backend="gloo", warm=True, show_ranks=[],
                    timeout=240).values
    model = Model.from_module(mlp_blocks(4, 64), name="mlp_blocks(4, 64)", layers=4,
                              hidden=64, heads=1, seq_len=1, micro_batch=8, **FP32_ADAM)
    ddp = plan(model, Cluster(devices=n, memory_gib=80), Degrees(dp=n))
    fsdp = plan(model, Cluster(devices=n, memory_gib=80), Degrees(dp=n, zero=3))
    for r in values:
        assert r["ddp"]["n_params"] == model.params == 132352
        # (a) DDP: exactly the planner's dp bytes, one all-reduce bucket of fp32 gradients
        assert r["ddp"]["counts"] == {"all_reduce": 1}
        assert r["ddp"]["sent_bytes"] == ddp.comm["dp"] == 2 * (n - 1) / n * 132352 * 4
        # and FSDP2 sends ZeRO-3's bytes: two all-gathers and a reduce-scatter per layer
        assert r["fsdp"]["counts"] == {"all_gather": 8, "reduce_scatter": 4}
        assert r["fsdp"]["sent_bytes"] == fsdp.comm["dp"] == 1.5 * ddp.comm["dp"]
        # (b) FSDP2's bytes held after a step, within the band (exact here: even shards)
        for key in ("params", "grads", "optimizer"):
            measured, predicted = r["held"]["sharded"][key], fsdp.memory[key]
            assert abs(measured - predicted) <= FSDP_BAND * predicted, (key, measured, predicted)
            assert measured == predicted


def test_layouts_keep_one_zero_stage_where_nothing_is_sharded_and_respect_max_tp():
    found = list(planner.layouts(SEVEN_B, EIGHT))
    assert all(d.zero == 0 for d in found if d.dp * d.cp == 1)
    assert {d.zero for d in found if d.dp * d.cp > 1} == {0, 1, 2, 3}
    assert max(d.tp for d in found) == 8
    assert max(d.tp for d in planner.layouts(SEVEN_B, EIGHT, max_tp=2)) == 2
    assert len(found) == len({str(d) for d in found})


def test_comm_bytes_as_shown_defines_its_symbols_in_comments(capsys):
    # labkit.show prints code without its docstring: the comments must say what A, L, m, r,
    # P and G are, where the notebook shows the formula.
    from labkit import show

    text = show(planner.comm_bytes)
    comments = " ".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    for symbol in ("A:", "L:", "m:", "r:", "P:", "G:"):
        assert symbol in comments, symbol

"""labkit.precision: FLOP formulas against torch's counter, MFU refusals, bytes per parameter
measured on a real optimizer, number-format facts, and FP8 quantisation and delayed scaling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from labkit import precision as P

# ---- FLOPs ----------------------------------------------------------------------------------


def test_six_nd_and_attention_flops_are_their_formulas():
    assert P.six_nd(124_000_000, 1024) == 6 * 124_000_000 * 1024
    # A hand-computed size: 2 layers, seq 4, d_model 8, 4 tokens: 12 * 2 * 4 * 8 * 4 = 3072.
    assert P.attention_flops(2, 4, 8, 4) == 3072
    assert P.attention_flops(12, 1024, 768, 2048) == 12 * 12 * 1024 * 768 * 2048
    # causal: each query sees (seq + 1) / 2 keys on average: 3072 * (4 + 1) / (2 * 4) = 1920.
    assert P.attention_flops(2, 4, 8, 4, causal=True) == 1920
    assert P.attention_flops(1, 1, 8, 4, causal=True) == P.attention_flops(1, 1, 8, 4)


@pytest.mark.parametrize("call", [
    lambda: P.six_nd(1.3e9, 10), lambda: P.six_nd(0, 10), lambda: P.six_nd(10, True),
    lambda: P.attention_flops(0, 4, 8, 4), lambda: P.attention_flops(1, 4, 8, -1),
])
def test_flop_formulas_refuse_what_is_not_a_positive_count(call):
    with pytest.raises(ValueError, match="whole number"):
        call()


def test_attention_flops_refuses_a_causal_that_is_not_a_flag():
    with pytest.raises(TypeError, match="causal"):
        P.attention_flops(1, 4, 8, 4, causal="yes")


def test_count_flops_of_a_linear_is_2_batch_in_out_without_the_bias():
    lin = nn.Linear(5, 3)
    counted = P.count_flops(lin, torch.randn(4, 5))
    assert counted == {"total": 2 * 4 * 5 * 3, "by_op": {"aten.addmm": 2 * 4 * 5 * 3}}
    with pytest.raises(TypeError, match="callable"):
        P.count_flops("not a function")


def test_a_linears_training_step_is_3x_its_forward_when_the_input_needs_a_gradient():
    lin = nn.Linear(5, 3)
    forward = 2 * 4 * 5 * 3
    x = torch.randn(4, 5, requires_grad=True)
    step = P.train_step_flops(lin, (x, torch.randn(4, 3)), nn.functional.mse_loss)
    assert step["forward"] == forward and step["backward"] == 2 * forward
    assert step["total"] == 3 * forward and step["params"] == 5 * 3 + 3
    # Without an input gradient the backward computes the weight's gradient only.
    step = P.train_step_flops(lin, (x.detach(), torch.randn(4, 3)), nn.functional.mse_loss)
    assert step["total"] == 2 * forward


def _encoder(d=16, heads=2, ff=32, dropout=0.0):
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(d, heads, ff, dropout=dropout, batch_first=True)


def test_a_transformer_layers_step_is_6nd_plus_attention_with_the_fused_kernels_extra():
    d, ff, batch, seq = 16, 32, 2, 8
    layer, tokens = _encoder(d, 2, ff), batch * seq
    n_matmul = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    assert n_matmul == 4 * d * d + 2 * d * ff  # in_proj 3d^2, out_proj d^2, two MLP matrices
    x = torch.randn(batch, seq, d, requires_grad=True)
    step = P.train_step_flops(layer, (x, torch.randn(batch, seq, d)), nn.functional.mse_loss)
    attention = P.attention_flops(1, seq, d, tokens)
    ops = step["by_op"]
    fwd_attn = ops["aten._scaled_dot_product_flash_attention_for_cpu"]
    bwd_attn = ops["aten._scaled_dot_product_flash_attention_for_cpu_backward"]
    assert fwd_attn == attention // 3                # QK^T and scores x V: 4 of PaLM's 12
    assert bwd_attn == attention * 5 // 6            # 5 matmuls: QK^T recomputed, then 4
    assert ops["aten.mm"] + ops["aten.addmm"] == P.six_nd(n_matmul, tokens)
    assert step["total"] == P.six_nd(n_matmul, tokens) + attention * 7 // 6
    # The first layer's input gradient is the only thing a frozen input saves.
    frozen = P.train_step_flops(layer, (x.detach(), x.detach()), nn.functional.mse_loss)
    assert step["total"] - frozen["total"] == 2 * (3 * d * d) * tokens


def test_the_unfused_attention_path_counts_exactly_palms_12():
    # With attention dropout on a CPU torch takes the math path: plain bmm, nothing recomputed.
    d, seq = 16, 8
    layer = _encoder(d, dropout=0.1)
    x = torch.randn(2, seq, d, requires_grad=True)
    step = P.train_step_flops(layer, (x, x.detach()), nn.functional.mse_loss)
    assert step["by_op"]["aten.bmm"] == P.attention_flops(1, seq, d, 2 * seq)


def test_recompute_adds_one_forward_which_hfu_flops_predicts():
    layer = _encoder()
    x = torch.randn(2, 8, 16)
    plain = P.train_step_flops(layer, (x, x), nn.functional.mse_loss)
    again = P.train_step_flops(layer, (x, x), nn.functional.mse_loss, recompute=True)
    assert again["forward"] == plain["forward"]
    assert again["total"] == P.hfu_flops(plain["total"], plain["forward"])
    assert again["total"] == plain["total"] + plain["forward"]
    assert P.hfu_flops(300, 100, recomputed=0.5) == 350


def test_train_step_flops_leaves_the_models_mode_and_gradients_alone():
    layer = _encoder().eval()
    grads = [torch.full_like(p, 7.0) for p in layer.parameters()]
    for p, g in zip(layer.parameters(), grads, strict=True):
        p.grad = g
    x = torch.randn(2, 8, 16)
    P.train_step_flops(layer, (x, x), nn.functional.mse_loss)
    assert not layer.training
    assert all(p.grad is g for p, g in zip(layer.parameters(), grads, strict=True))


@pytest.mark.parametrize("model, batch, loss_fn, error, match", [
    ("not a model", (torch.ones(1), torch.ones(1)), nn.functional.mse_loss, TypeError,
     "nn.Module"),
    (nn.Linear(2, 2), torch.ones(2, 2), nn.functional.mse_loss, ValueError, "pair of tensors"),
    (nn.Linear(2, 2), (torch.ones(3, 2), torch.ones(3, 2)), lambda out, y: out - y, TypeError,
     "one-element tensor"),
])
def test_train_step_flops_refuses_a_bad_model_batch_or_loss(model, batch, loss_fn, error, match):
    with pytest.raises(error, match=match):
        P.train_step_flops(model, batch, loss_fn)


def test_train_step_flops_and_hfu_flops_refuse_bad_flags_and_shares():
    with pytest.raises(TypeError, match="recompute"):
        P.train_step_flops(nn.Linear(2, 2), (torch.ones(1, 2), torch.ones(1, 2)),
                           nn.functional.mse_loss, recompute=1)
    for bad in (1.5, -0.1, True):
        with pytest.raises(ValueError, match="recomputed"):
            P.hfu_flops(300, 100, recomputed=bad)
    with pytest.raises(ValueError, match="forward_flops"):
        P.hfu_flops(300, 0)


def test_mfu_and_hfu_are_flops_per_second_over_the_peak():
    assert P.mfu(4.0e15, 10.0, 989e12) == pytest.approx(4.0e15 / 10.0 / 989e12, rel=1e-15)
    assert P.hfu(5.3e15, 10.0, 989e12) == pytest.approx(5.3e15 / 10.0 / 989e12, rel=1e-15)
    assert P.mfu(1.0, 1.0, 1.0) == 1.0  # exactly the peak is allowed


@pytest.mark.parametrize("fn", [P.mfu, P.hfu])
def test_mfu_and_hfu_refuse_a_share_over_one_naming_the_likely_causes(fn):
    with pytest.raises(ValueError, match="over 1") as info:
        fn(2e15, 1.0, 989e12)
    message = info.value.args[0]
    assert "peak" in message and "TF32" in message and "sparse" in message
    assert "twice" in message
    assert all(len(line) <= 100 for line in message.splitlines())


@pytest.mark.parametrize("args, name", [
    ((0, 1.0, 1e12), "flops"), ((1e12, 0.0, 1e12), "step_seconds"),
    ((1e12, 1.0, -5.0), "peak_flops_per_s"), ((1e12, math.inf, 1e12), "step_seconds"),
    ((True, 1.0, 1e12), "flops"), (("1e12", 1.0, 1e12), "flops"),
])
def test_mfu_refuses_inputs_that_are_not_positive_numbers(args, name):
    with pytest.raises(ValueError, match=f"{name} must be a positive number"):
        P.mfu(*args)


# ---- bytes per parameter --------------------------------------------------------------------


def test_mixed_precision_bytes_of_each_variant():
    zero = P.mixed_precision_bytes()
    assert zero == {"weights": 2, "grads": 2, "master_weights": 4, "fp32_grads": 0,
                    "optimizer_states": 8, "total": 16}  # ZeRO sec. 3.1: 2 + 2 + 12 = 16
    assert P.mixed_precision_bytes(fp32_grads=True)["total"] == 2 + 2 + 4 + 4 + 8 == 20
    assert P.mixed_precision_bytes(fp32_grads=True, low_precision_grads=False)["total"] == 18
    fp32 = P.mixed_precision_bytes(weight_bytes=4, master_weights=False)
    assert fp32["total"] == 4 + 4 + 8 == 16
    assert P.mixed_precision_bytes(optimizer_states=0, master_weights=False)["total"] == 4


def test_mixed_precision_bytes_refuses_bad_flags_and_sizes():
    with pytest.raises(TypeError, match="master_weights"):
        P.mixed_precision_bytes(master_weights="yes")
    with pytest.raises(ValueError, match="weight_bytes"):
        P.mixed_precision_bytes(weight_bytes=0)
    with pytest.raises(ValueError, match="optimizer_states"):
        P.mixed_precision_bytes(optimizer_states=-1)


def _bf16_with_fp32_masters():
    """A bf16 model trained through fp32 master copies by AdamW, after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    model(torch.randn(5, 8, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    for master, p in zip(masters, model.parameters(), strict=True):
        master.grad = p.grad.float()
    opt.step()
    with torch.no_grad():
        for master, p in zip(masters, model.parameters(), strict=True):
            p.copy_(master)
    return model, masters, opt


def _categories(measured):
    return {k: measured[k] for k in (*P.BYTE_CATEGORIES, "total")}


def test_measured_bytes_per_param_equal_the_formula_for_each_variant():
    model, masters, opt = _bf16_with_fp32_masters()
    n = sum(p.numel() for p in model.parameters())
    # bf16 grads and the fp32 grads copied onto the masters, both kept: 20 B.
    measured = P.training_bytes_per_param(model, opt)
    assert _categories(measured) == P.mixed_precision_bytes(fp32_grads=True)
    assert measured["params"] == n
    assert measured["other_bytes"] == 4 * len(masters)  # AdamW's float32 step, one per tensor
    # The fp32 grads freed after the step (zero_grad(set_to_none=True)): ZeRO's 16 B.
    for master in masters:
        master.grad = None
    assert _categories(P.training_bytes_per_param(model, opt)) == P.mixed_precision_bytes()
    # Gradients kept in fp32 only: 18 B.
    for master, p in zip(masters, model.parameters(), strict=True):
        master.grad, p.grad = p.grad.float(), None
    assert (_categories(P.training_bytes_per_param(model, opt))
            == P.mixed_precision_bytes(fp32_grads=True, low_precision_grads=False))


def test_plain_fp32_adam_is_16_bytes_as_well():
    model = nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    assert (_categories(P.training_bytes_per_param(model, opt))
            == P.mixed_precision_bytes(weight_bytes=4, master_weights=False))


def test_training_bytes_per_param_refuses_a_foreign_optimizer_and_wrong_types():
    model, _, _ = _bf16_with_fp32_masters()
    other = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="pass the optimizer that trains"):
        P.training_bytes_per_param(model, other)
    with pytest.raises(TypeError, match="nn.Module"):
        P.training_bytes_per_param("model", other)
    with pytest.raises(TypeError, match="Optimizer"):
        P.training_bytes_per_param(model, "adam")
    with pytest.raises(ValueError, match="no parameters"):
        P.training_bytes_per_param(nn.ReLU(), other)


# ---- number formats -------------------------------------------------------------------------

# Bit layouts: FP32 1+8+23, BF16 1+8+7, FP16 1+5+10 (Transformer Engine's introduction,
# https://nvidia.github.io/TransformerEngine/features/low_precision_training/introduction/
# introduction.html); E4M3 1+4+3 and E5M2 1+5+2 (Micikevicius et al. 2022,
# https://arxiv.org/abs/2209.05433). FP8 maxima 448 and 57344: TE's FP8 primer ("values up to
# +/-448", "up to +/-57344"). fp16's 65504 is IEEE binary16's (2 - 2^-10) * 2^15.
PUBLISHED = {"fp32": (8, 23, None), "bf16": (8, 7, None), "fp16": (5, 10, 65504.0),
             "e4m3": (4, 3, 448.0), "e5m2": (5, 2, 57344.0)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_format_facts_match_the_published_layouts_and_the_ieee_formulas(name):
    facts = P.format_facts(name)
    exponent, mantissa, published_max = PUBLISHED[name]
    assert (facts["exponent_bits"], facts["mantissa_bits"]) == (exponent, mantissa)
    assert facts["bits"] == 1 + exponent + mantissa
    bias = 2 ** (exponent - 1) - 1
    assert facts["eps"] == 2.0 ** -mantissa
    assert facts["smallest_normal"] == 2.0 ** (1 - bias)
    assert facts["smallest_subnormal"] == 2.0 ** (1 - bias - mantissa)
    if name == "e4m3":
        # No infinities: the top exponent holds normal numbers, all but the NaN pattern
        # S.1111.111, so the max is 1.110b x 2^8.
        assert facts["max"] == (2 - 2.0 ** (1 - mantissa)) * 2.0 ** (bias + 1)
    else:
        assert facts["max"] == (2 - 2.0 ** -mantissa) * 2.0 ** bias  # IEEE: top exponent is inf
    if published_max is not None:
        assert facts["max"] == published_max
    assert P.format_facts(P.FORMATS[name]) == facts  # the dtype names the same format


def test_format_facts_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="unknown number format"):
        P.format_facts("fp4")
    with pytest.raises(ValueError, match="unknown number format"):
        P.format_facts(torch.int8)


def test_underflow_fraction_counts_what_fp16_loses_and_a_loss_scale_recovers():
    # fp16's smallest subnormal is 2^-24; below half of it a value rounds to zero.
    tiny = 2.0 ** -24
    g = torch.tensor([tiny / 8, tiny / 4, 1e-3, 0.5, 0.0])
    plain = P.underflow_fraction(g)
    assert plain == {"scale": 1.0, "fp16_underflow": 2 / 4, "bf16_underflow": 0.0,
                     "fp16_overflow": 0.0}
    scaled = P.underflow_fraction(g, scale=1024.0)
    assert scaled["fp16_underflow"] == 0.0 and scaled["fp16_overflow"] == 0.0
    # Too big a scale: 0.5 * 2^18 = 131072 is over fp16's 65504.
    assert P.underflow_fraction(g, scale=2.0 ** 18)["fp16_overflow"] == 1 / 4


def test_underflow_fraction_refuses_an_all_zero_or_non_tensor_grad_and_a_bad_scale():
    with pytest.raises(ValueError, match="no nonzero"):
        P.underflow_fraction(torch.zeros(3))
    with pytest.raises(TypeError, match="tensor"):
        P.underflow_fraction([1e-9])
    with pytest.raises(ValueError, match="scale"):
        P.underflow_fraction(torch.ones(3), scale=0)


# ---- FP8 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_representable_values_survive_a_round_trip_and_beyond_max_saturates(fmt):
    facts = P.format_facts(fmt)
    top, step = facts["max"], facts["eps"]
    exact = torch.tensor([0.0, 1.0, -1.0, 1 + step, 0.5, -top, top, facts["smallest_subnormal"]])
    q = P.quantize_fp8(exact, fmt, scale=1.0)
    assert q.data.dtype == P.FORMATS[fmt] and q.saturated == 0
    assert torch.equal(P.dequantize_fp8(q), exact)
    q = P.quantize_fp8(torch.tensor([2 * top, -3 * top, math.inf, 1.0]), fmt, scale=1.0)
    assert q.saturated == 3
    assert P.dequantize_fp8(q).tolist() == [top, -top, top, 1.0]


def test_per_tensor_scale_puts_the_amax_on_the_formats_max():
    x = torch.tensor([0.25, -2.0, 1.0])
    assert P.per_tensor_scale(x, "e4m3") == 448.0 / 2.0
    assert P.per_tensor_scale(x, "e5m2", margin=1) == 57344.0 / 2.0 / 2
    assert P.per_tensor_scale(torch.zeros(3)) == 1.0
    q = P.quantize_fp8(x, "e4m3")  # scale omitted: the per-tensor scale
    assert q.scale == 224.0 and q.saturated == 0
    assert float(P.dequantize_fp8(q).abs().max()) == 2.0  # the amax lands exactly on 448


def test_fp8_functions_refuse_bad_formats_values_and_scales():
    with pytest.raises(ValueError, match="not an FP8 format"):
        P.quantize_fp8(torch.ones(2), "bf16")
    with pytest.raises(ValueError, match="non-empty tensor"):
        P.quantize_fp8(torch.ones(0), "e4m3")
    with pytest.raises(ValueError, match="scale must be a positive number"):
        P.quantize_fp8(torch.ones(2), "e4m3", scale=-1.0)
    with pytest.raises(ValueError, match="finite"):
        P.per_tensor_scale(torch.tensor([1.0, math.nan]))
    with pytest.raises(ValueError, match="margin"):
        P.per_tensor_scale(torch.ones(2), margin=-1)
    with pytest.raises(TypeError, match="quantize_fp8 returns"):
        P.dequantize_fp8(torch.ones(2))


def test_delayed_scaler_scale_follows_the_max_of_its_history_window():
    scaler = P.DelayedScaler("e4m3", history_len=3)
    assert scaler.scale == 1.0
    amaxes = [1.0, 4.0, 2.0, 0.5, 0.5, 0.5]
    scales = [scaler.update(a) for a in amaxes]
    expected = [448.0 / max(amaxes[max(0, i - 2):i + 1]) for i in range(len(amaxes))]
    assert scales == expected == [448.0, 112.0, 112.0, 112.0, 224.0, 896.0]
    assert scaler.history == [0.5, 0.5, 0.5]
    assert scaler.update(0.0) == 896.0  # an amax of 0 moves nothing
    margin = P.DelayedScaler("e5m2", history_len=2, margin=2)
    assert margin.update(7.0) == 57344.0 / 7.0 / 4


def test_delayed_scaler_casts_with_the_old_scale_so_a_jump_in_amax_saturates():
    scaler = P.DelayedScaler("e4m3", history_len=4)
    first = scaler.quantize(torch.tensor([0.5, -1.0]))  # no history yet: scale 1.0
    assert first.scale == 1.0 and first.saturated == 0 and scaler.scale == 448.0
    jump = torch.tensor([0.5, 1.0, 1.5, -3.0])
    q = scaler.quantize(jump)  # still 448 / 1: anything beyond |1| overflows
    assert q.scale == 448.0
    assert q.saturated == int((jump.abs() * 448.0 > 448.0).sum()) == 2
    assert P.dequantize_fp8(q).tolist() == [0.5, 1.0, 1.0, -1.0]
    assert scaler.scale == 448.0 / 3.0  # the next step makes room for it
    assert scaler.quantize(jump).saturated == 0


def test_delayed_scaler_refuses_bad_settings_and_amaxes():
    with pytest.raises(ValueError, match="history_len"):
        P.DelayedScaler(history_len=0)
    with pytest.raises(ValueError, match="not an FP8 format"):
        P.DelayedScaler("fp16")
    for bad in (-1.0, math.nan, "1"):
        with pytest.raises(ValueError, match="amax"):
            P.DelayedScaler().update(bad)


def test_fp8_matmul_error_is_above_bf16s_and_e5m2s_above_e4m3s():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 96, generator=gen), torch.randn(96, 48, generator=gen)
    e4m3, e5m2 = P.fp8_matmul_error(a, b, "e4m3"), P.fp8_matmul_error(a, b, "e5m2")
    assert e4m3["bf16"] == e5m2["bf16"] > 0
    assert e4m3["fp8"] > 2 * e4m3["bf16"]
    assert e5m2["fp8"] > e4m3["fp8"]
    assert e5m2["fp8"] < 0.5  # still an approximation of the product, not noise


def test_fp8_matmul_error_refuses_mismatched_or_zero_inputs():
    with pytest.raises(ValueError, match="2-D"):
        P.fp8_matmul_error(torch.ones(4, 3), torch.ones(4, 3))
    with pytest.raises(ValueError, match="all zeros"):
        P.fp8_matmul_error(torch.zeros(4, 3), torch.ones(3, 2))


def test_time_scaled_mm_without_fp8_tensor_cores_returns_none_and_says_why(capsys):
    reason = P.fp8_matmul_support()
    if reason is None:
        pytest.skip("this machine has FP8 tensor cores: time_scaled_mm times them")
    assert P.time_scaled_mm(64, repeats=1) is None
    printed = capsys.readouterr().out
    assert reason in " ".join(printed.split()) and "not timed" in printed


def test_time_scaled_mm_refuses_a_size_fp8_matmuls_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        P.time_scaled_mm(100)
    with pytest.raises(ValueError, match="repeats"):
        P.time_scaled_mm(64, repeats=0)


@pytest.mark.gpu
def test_time_scaled_mm_on_a_gpu_returns_sane_positive_times():
    if P.fp8_matmul_support() is not None:
        pytest.skip(P.fp8_matmul_support())
    out = P.time_scaled_mm(1024, repeats=3)
    assert out["fp8_s"] > 0 and out["bf16_s"] > 0
    assert out["fp8_tflops"] == pytest.approx(2 * 1024 ** 3 / out["fp8_s"] / 1e12)
    assert out["speedup"] == pytest.approx(out["bf16_s"] / out["fp8_s"])

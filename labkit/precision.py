"""FLOPs, MFU, the bytes of mixed-precision training, and FP8 numerics: notebook 11's numbers.

Four ideas, one small function each, every result plain data (ints, floats, dicts):

- **FLOPs of a step.** :func:`count_flops` asks torch's own counter
  (``torch.utils.flop_counter.FlopCounterMode``); :func:`train_step_flops` counts one real
  forward + backward; :func:`six_nd` and :func:`attention_flops` are the paper formulas it is
  compared with; :func:`mfu`, :func:`hfu` and :func:`hfu_flops` turn FLOPs and a step time into
  utilisation (HFU also counts the forward that activation checkpointing runs twice).
- **Bytes per parameter.** :func:`mixed_precision_bytes` is the textbook count (16 B for
  bf16 + fp32 master weights + Adam); :func:`training_bytes_per_param` measures the same
  categories on a real model and optimizer.
- **bf16 against fp16.** :func:`format_facts` reads ``torch.finfo``; :func:`underflow_fraction`
  shows the gradients fp16 loses without a loss scale.
- **FP8 on any CPU.** :func:`quantize_fp8` / :func:`dequantize_fp8` with a per-tensor scale
  (:func:`per_tensor_scale`), :class:`DelayedScaler` (the scale from an amax history), and
  :func:`fp8_matmul_error`. :func:`time_scaled_mm` times a real FP8 matmul on a GPU that has
  FP8 tensor cores, and returns None (printing why) anywhere else.

Sources for the facts used here (checked when this room was written):

- MFU, and training FLOPs per token = 6N + 12·L·H·Q·T (attention counted over the full T x T
  square, causal or not): Chowdhery et al. 2022, "PaLM", Appendix B,
  https://arxiv.org/abs/2204.02311 (the formula as quoted by karpathy/nanoGPT ``estimate_mfu``
  and pytorch/torchtitan ``get_num_flop_per_token``, which both cite that appendix).
- 16 bytes per parameter: Rajbhandari et al. 2020, "ZeRO", sec. 3.1,
  https://arxiv.org/abs/1910.02054: "an fp16 copy of the parameters and the gradients ... 2Ψ and
  2Ψ bytes ... an fp32 copy of the parameters, momentum and variance ... 4Ψ, 4Ψ, and 4Ψ bytes
  ... In total, this results in 2Ψ + 2Ψ + KΨ = 16Ψ bytes" (K = 12 for mixed-precision Adam).
- FP8 layouts and ranges: Micikevicius et al. 2022, "FP8 Formats for Deep Learning",
  https://arxiv.org/abs/2209.05433 (E4M3: 4 exponent, 3 mantissa bits, no infinities; E5M2:
  5 and 2, IEEE-style), and NVIDIA Transformer Engine's FP8 primer,
  https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/examples/fp8_primer.html:
  "E4M3 ... can store values up to +/-448 and nan. E5M2 ... up to +/-57344, +/- inf and nan".
- Delayed scaling: Transformer Engine ``recipe.DelayedScaling(margin=0, fp8_format=HYBRID,
  amax_history_len=1024, amax_compute_algo="max")``,
  https://docs.nvidia.com/deeplearning/transformer-engine/api/common.html ("Use scale factor
  from previous iteration and record amax history of amax_history_len steps"; "max chooses the
  largest amax in the history window"); the scale makes the FP8 tensor's largest value
  2^-margin x fp8_max (TE C API ``nvte_delayed_scaling_recipe_amax_and_scale_update``,
  https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/api/c/recipe.html), and TE's
  PyTorch ``_default_sf_compute`` keeps the previous scale when amax is 0 or not finite.
- ``torch._scaled_mm``: torch 2.14's ``torch/testing/_internal/common_cuda.py``
  (``evaluate_platform_supports_fp8``: CUDA FP8 needs SM 9.0 or later, or exactly 8.9) and
  ``torch/_meta_registrations.py`` (``_check_scaled_mm_sizes``: the first matrix row-major, the
  second column-major, every dimension divisible by 16).
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from ._display import wrap
from ._dist import sync
from ._sizes import positive, whole

__all__ = ["count_flops", "six_nd", "attention_flops", "train_step_flops", "hfu_flops", "mfu",
           "hfu", "BYTE_CATEGORIES", "mixed_precision_bytes", "training_bytes_per_param",
           "FORMATS", "format_facts", "underflow_fraction", "FP8Tensor", "per_tensor_scale",
           "quantize_fp8", "dequantize_fp8", "DelayedScaler", "fp8_matmul_error",
           "fp8_matmul_support", "time_scaled_mm"]


# ---- FLOPs of a training step ---------------------------------------------------------------

# torch's counter has formulas for the CUDA attention kernels but none for the CPU's fused one,
# so on a laptop attention would count as zero. We lend the CPU kernel the same formulas torch
# uses on the GPU: 2 matmuls forward (QK^T, then scores x V), 5 backward (it recomputes QK^T, as
# flash kernels do, then the four gradient matmuls).
_ATEN = torch.ops.aten
_CPU_ATTENTION = {
    _ATEN._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
    _ATEN._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(g, q, k, v),
}


def count_flops(fn, *args, **kwargs) -> dict:
    """The FLOPs torch's counter sees while ``fn(*args, **kwargs)`` runs: total and per op.

    ``FlopCounterMode`` intercepts every aten op and applies a shape formula: an (m, k) by
    (k, n) matmul is 2·m·k·n (one multiply and one add per term). Ops without a formula (a
    bias add, softmax, norms, activations) count zero, so the total is the matmul work, the
    part a GPU's tensor cores do and the part MFU counts.

    Example::

        >>> lin = torch.nn.Linear(64, 32)
        >>> count_flops(lin, torch.randn(8, 64))      # 2 * 8 * 64 * 32; the bias is not counted
        {'total': 32768, 'by_op': {'aten.addmm': 32768}}
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable (a model, or a function), got {type(fn).__name__}")
    with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as counter:
        fn(*args, **kwargs)
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items() if n}
    return {"total": int(counter.get_total_flops()), "by_op": by_op}


def six_nd(n_params, tokens) -> int:
    """Training FLOPs by the rule of thumb 6·N·D: ``n_params`` parameters, ``tokens`` tokens.

    Each parameter takes part in one multiply-add (2 FLOPs) per token in the forward pass and
    two in the backward (the gradient of the input and of the weight): 2 + 4 = 6. It leaves out
    attention's score and context matmuls (:func:`attention_flops`), which hold no parameters.

    Example::

        >>> six_nd(124_000_000, 1024)       # GPT-2 small, one 1024-token sequence
        761856000000
    """
    hint = " (a count of parameters, e.g. int(1.3e9))"
    return 6 * whole(n_params, "n_params", hint=hint) * whole(tokens, "tokens", hint=hint)


def attention_flops(layers, seq, d_model, tokens, causal: bool = False) -> int:
    """Training FLOPs of attention's QK^T and scores x V matmuls, which 6·N·D leaves out.

    Per layer and token the forward does two matmuls against ``seq`` keys of width
    ``d_model`` (all heads together): 2 x 2·seq·d_model FLOPs; the backward twice that, so
    12·layers·seq·d_model per token, PaLM's 12·L·H·Q·T (Appendix B, with H·Q = d_model). PaLM
    counts the full seq x seq square even for a causal model, so MFUs compare across papers;
    ``causal=True`` counts only the scores a causal mask keeps: (seq + 1) / 2 per query on
    average instead of seq.

    Example::

        >>> attention_flops(layers=12, seq=1024, d_model=768, tokens=1024)
        115964116992
    """
    L, s = whole(layers, "layers"), whole(seq, "seq")
    d, t = whole(d_model, "d_model"), whole(tokens, "tokens")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    # 12 * (s + 1) / 2 = 6 * (s + 1): the causal count stays a whole number.
    return 6 * L * d * t * (s + 1) if causal else 12 * L * d * t * s


def _check_step(model, batch):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if (not isinstance(batch, (tuple, list)) or len(batch) != 2
            or not all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError("batch must be a pair of tensors (inputs, targets), e.g. "
                         "(torch.randn(4, 16, 32), torch.randn(4, 16, 32))")
    return batch


def train_step_flops(model, batch, loss_fn, *, recompute: bool = False) -> dict:
    """The counted FLOPs of one training step, ``loss_fn(model(inputs), targets).backward()``.

    Returns ``forward``, ``backward``, ``total``, ``params`` (for :func:`six_nd`) and ``by_op``.
    With ``recompute=True`` the model runs under activation checkpointing, so the backward
    also re-runs the forward: the hardware's FLOPs (HFU's numerator), not the model's (MFU's).
    Where it differs from :func:`six_nd` + :func:`attention_flops`: the backward is 2x the
    forward less the input gradient nobody needs (the first layer's, when ``inputs`` does not
    require grad); torch's fused attention kernels count 14 attention FLOPs where PaLM counts
    12 (their backward recomputes QK^T), while the unfused path (a CPU with attention dropout)
    counts exactly 12. The model's mode and its gradients are left as they were.

    Example::

        >>> layer = torch.nn.TransformerEncoderLayer(64, 4, 256, batch_first=True)
        >>> x = torch.randn(2, 32, 64)
        >>> step = train_step_flops(layer, (x, x), torch.nn.functional.mse_loss)
        >>> step["backward"] / step["forward"]    # 1.77: x needs no gradient, so under 2
    """
    from torch.utils.checkpoint import checkpoint

    inputs, targets = _check_step(model, batch)
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be True or False, got {recompute!r}")
    params = list(model.parameters())
    saved_grads, was_training = [p.grad for p in params], model.training
    losses = []

    def forward():
        out = checkpoint(model, inputs, use_reentrant=False) if recompute else model(inputs)
        losses.append(loss_fn(out, targets))

    # Train mode: eval-mode fast paths (nn.TransformerEncoderLayer's fused kernel) are
    # invisible to the counter, and a training step is what we count.
    model.train()
    try:
        fwd = count_flops(forward)
        loss = losses[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("loss_fn must return a one-element tensor, e.g. "
                            "torch.nn.functional.cross_entropy(outputs, targets)")
        bwd = count_flops(loss.backward)
    finally:
        model.train(was_training)
        for p, grad in zip(params, saved_grads, strict=True):
            p.grad = grad
    by_op = dict(fwd["by_op"])
    for op, n in bwd["by_op"].items():
        by_op[op] = by_op.get(op, 0) + n
    return {"forward": fwd["total"], "backward": bwd["total"],
            "total": fwd["total"] + bwd["total"],
            "params": sum(p.numel() for p in {id(p): p for p in params}.values()),
            "by_op": by_op}


def hfu_flops(model_flops, forward_flops, recomputed: float = 1.0) -> float:
    """The hardware's FLOPs of a step: the model's plus the forward that checkpointing re-runs.

    ``recomputed`` is the share of the forward run again in the backward: 1.0 for full
    activation checkpointing, 0 for none. HFU divides this by the peak; MFU divides
    ``model_flops``, since the repeated forward moves the model no further.

    Example::

        >>> hfu_flops(model_flops=3e12, forward_flops=1e12)     # full checkpointing
        4000000000000.0
    """
    _positive(model_flops, "model_flops")
    _positive(forward_flops, "forward_flops")
    if (isinstance(recomputed, bool) or not isinstance(recomputed, numbers.Real)
            or not 0 <= recomputed <= 1):
        raise ValueError(f"recomputed must be a share between 0 and 1 (1.0: every layer "
                         f"checkpointed), got {recomputed!r}")
    return model_flops + recomputed * forward_flops


def _positive(value, name: str) -> float:
    return positive(value, name)


def _utilization(kind: str, flops, step_seconds, peak_flops_per_s) -> float:
    rate = _positive(flops, "flops") / _positive(step_seconds, "step_seconds")
    share = rate / _positive(peak_flops_per_s, "peak_flops_per_s")
    if share > 1:
        # No chip beats its own peak: the numbers disagree, not the hardware.
        raise ValueError(wrap(
            f"{kind} = {share:.2f} is over 1, which no chip can reach. Likely causes: the wrong "
            "peak (TF32's or FP32's for a BF16 run, or a sparse peak, twice the dense one), "
            "FLOPs counted twice (forward + backward counted, then multiplied by 3 again, or "
            "every rank's FLOPs over one GPU's peak), or a step time read before the GPU "
            "finished (synchronize before stopping the clock)."))
    return share


def mfu(model_flops, step_seconds, peak_flops_per_s) -> float:
    """Model FLOPs utilisation: the model's FLOPs per second over the chip's dense peak.

    ``model_flops`` counts what the model needs per step (6·N·D plus attention, or
    :func:`train_step_flops` without recomputation), not what the hardware repeats; PaLM
    defines MFU this way (Appendix B) so that runs with and without checkpointing compare.

    Example::

        >>> mfu(model_flops=4.0e15, step_seconds=10.0, peak_flops_per_s=989e12)
        0.4044489383215369
    """
    return _utilization("MFU", model_flops, step_seconds, peak_flops_per_s)


def hfu(hardware_flops, step_seconds, peak_flops_per_s) -> float:
    """Hardware FLOPs utilisation: every FLOP the chip ran (recomputation too) over its peak.

    ``hardware_flops`` is :func:`hfu_flops` or :func:`train_step_flops` with
    ``recompute=True``. HFU >= MFU; the gap is the work checkpointing repeats.

    Example::

        >>> hfu(hardware_flops=5.3e15, step_seconds=10.0, peak_flops_per_s=989e12)
        0.5358948432760364
    """
    return _utilization("HFU", hardware_flops, step_seconds, peak_flops_per_s)


# ---- bytes per parameter of mixed-precision training ----------------------------------------

BYTE_CATEGORIES = ("weights", "grads", "master_weights", "fp32_grads", "optimizer_states")


def mixed_precision_bytes(*, master_weights: bool = True, fp32_grads: bool = False,
                          low_precision_grads: bool = True, weight_bytes: int = 2,
                          optimizer_states: int = 2) -> dict:
    """Bytes per parameter of training state, by category, as the textbook counts them.

    The default is ZeRO's count for mixed-precision Adam (sec. 3.1): bf16/fp16 weights 2 +
    their gradients 2 + an fp32 master copy 4 + Adam's m and v, 4 + 4 = 16 B. The variants:

    - ``fp32_grads=True``: an fp32 gradient buffer as well (gradients accumulated over
      micro-batches in fp32 for accuracy): 2 + 2 + 4 + 4 + 8 = 20 B.
    - ``fp32_grads=True, low_precision_grads=False``: gradients written straight into the
      fp32 buffer, no bf16 copy kept: 2 + 4 + 4 + 8 = 18 B.
    - ``weight_bytes=4, master_weights=False``: plain fp32 Adam, 4 + 4 + 8 = 16 B as well:
      mixed precision saves compute and activation memory, not these bytes.

    Example::

        >>> mixed_precision_bytes()["total"], mixed_precision_bytes(fp32_grads=True)["total"]
        (16, 20)
    """
    for name, flag in (("master_weights", master_weights), ("fp32_grads", fp32_grads),
                       ("low_precision_grads", low_precision_grads)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    weight_bytes = whole(weight_bytes, "weight_bytes", hint=" (2 for bf16/fp16, 4 for fp32)")
    states = whole(optimizer_states, "optimizer_states", low=0,
                   hint=" (Adam keeps 2: m and v; SGD with momentum 1)")
    out = {"weights": weight_bytes,
           "grads": weight_bytes if low_precision_grads else 0,  # grads come in the weights' dtype
           "master_weights": 4 if master_weights else 0,
           "fp32_grads": 4 if fp32_grads else 0,
           "optimizer_states": 4 * states}                       # fp32, one number per state
    out["total"] = sum(out.values())
    return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def training_bytes_per_param(model, optimizer) -> dict:
    """Bytes per parameter of a real model and optimizer, by :data:`BYTE_CATEGORIES`.

    Reads the tensors themselves: the model's parameters (``weights``) and their ``.grad``
    (``grads``); the tensors the optimizer updates that are not the model's (``master_weights``,
    e.g. fp32 copies of bf16 parameters) and their ``.grad`` (``fp32_grads``); and every
    ``optimizer.state`` tensor shaped like its parameter (``optimizer_states``: Adam's m and
    v). Adam's per-tensor ``step`` counters are a few bytes per tensor, not per parameter:
    ``other_bytes`` holds them. Compare with :func:`mixed_precision_bytes`.

    Example::

        >>> model = torch.nn.Linear(256, 256)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model(torch.randn(4, 256)).sum().backward(); opt.step()
        >>> training_bytes_per_param(model, opt)["total"]    # fp32 Adam: 4 + 4 + 8
        16.0
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    # By identity, so a tied weight (shared embedding) counts once.
    params = list({id(p): p for p in model.parameters()}.values())
    trained = list({id(p): p for g in optimizer.param_groups for p in g["params"]}.values())
    n = sum(p.numel() for p in params)
    if n == 0:
        raise ValueError("model has no parameters to count")
    if sum(p.numel() for p in trained) != n:
        raise ValueError(wrap(
            f"the optimizer updates {sum(p.numel() for p in trained)} values but the model has "
            f"{n} parameters: pass the optimizer that trains this model (over its parameters, "
            "or over one master copy of each)"))
    own = {id(p) for p in params}
    masters = [p for p in trained if id(p) not in own]
    states, other = 0, 0
    for p in trained:
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                if value.shape == p.shape:
                    states += _nbytes([value])
                else:
                    other += _nbytes([value])
    out = {"weights": _nbytes(params) / n, "grads": _nbytes(p.grad for p in params) / n,
           "master_weights": _nbytes(masters) / n,
           "fp32_grads": _nbytes(p.grad for p in masters) / n,
           "optimizer_states": states / n}
    out["total"] = sum(out.values())
    out.update(params=n, other_bytes=other)
    return out


# ---- number formats: bf16 against fp16 ------------------------------------------------------

FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _format(fmt) -> tuple[str, torch.dtype]:
    for name, dtype in FORMATS.items():
        if fmt == name or fmt is dtype:
            return name, dtype
    raise ValueError(f"unknown number format {fmt!r}: use one of {', '.join(FORMATS)} "
                     "(or the torch dtype, e.g. torch.float8_e4m3fn)")


def format_facts(fmt) -> dict:
    """Range and precision of a format, from ``torch.finfo``: ``fmt`` is a name or a dtype.

    ``eps`` is the gap after 1.0, 2^-mantissa_bits: the relative rounding step. ``max`` and
    ``smallest_normal`` bound the range; below ``smallest_normal`` the subnormals give up
    precision down to ``smallest_subnormal``, and smaller values round to zero. bf16 keeps
    fp32's 8 exponent bits (its range) and pays in mantissa; fp16 keeps 10 mantissa bits and
    pays in range: hence fp16 needs loss scaling and bf16 does not.

    Example::

        >>> format_facts("fp16")["max"], format_facts("bf16")["mantissa_bits"]
        (65504.0, 7)
    """
    name, dtype = _format(fmt)
    info = torch.finfo(dtype)
    mantissa = round(-math.log2(info.eps))
    return {"name": name, "dtype": str(dtype), "bits": info.bits,
            "exponent_bits": info.bits - 1 - mantissa,  # the rest after sign and mantissa
            "mantissa_bits": mantissa, "max": info.max, "smallest_normal": info.smallest_normal,
            # subnormals are multiples of smallest_normal * 2^-mantissa
            "smallest_subnormal": info.smallest_normal * info.eps, "eps": info.eps}


def underflow_fraction(grad, scale: float = 1.0) -> dict:
    """The share of ``grad``'s nonzero values lost to zero in fp16 and in bf16, after x ``scale``.

    Small gradients fall below fp16's smallest subnormal (2^-24) and flush to zero, so their
    updates are lost; bf16 reaches fp32's range and keeps them. A loss scale multiplies every
    gradient before the cast (GradScaler divides it out later) and lifts them back into range,
    until the largest overflow to inf: ``fp16_overflow`` counts those, which is why GradScaler
    lowers the scale when it sees an inf.

    Example::

        >>> g = torch.randn(100_000) * 1e-7
        >>> underflow_fraction(g)["fp16_underflow"], underflow_fraction(g, 1024)["fp16_underflow"]
    """
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"grad must be a tensor, got {type(grad).__name__}")
    scale = _positive(scale, "scale")
    g = grad.detach().flatten().float() * scale
    nonzero = g != 0
    n = int(nonzero.sum())
    if n == 0:
        raise ValueError("grad has no nonzero values: pass a real gradient, e.g. p.grad after "
                         "loss.backward()")
    fp16, bf16 = g.to(torch.float16), g.to(torch.bfloat16)
    return {"scale": scale,
            "fp16_underflow": int(((fp16 == 0) & nonzero).sum()) / n,
            "bf16_underflow": int(((bf16 == 0) & nonzero).sum()) / n,
            "fp16_overflow": int((fp16.isinf() & g.isfinite()).sum()) / n}


# ---- FP8: scaling, saturation and error -----------------------------------------------------


@dataclass
class FP8Tensor:
    """An FP8-quantised tensor: ``data`` holds round(x * scale) in the format; divide by
    ``scale`` to get x back (:func:`dequantize_fp8`). ``saturated`` counts the values whose
    |x * scale| lay beyond the format's max and were clamped to it."""

    data: torch.Tensor
    scale: float
    fmt: str
    saturated: int


def _fp8(fmt) -> tuple[str, torch.dtype]:
    name, dtype = _format(fmt)
    if name not in ("e4m3", "e5m2"):
        raise ValueError(f"{name} is not an FP8 format: use e4m3 (weights, activations) or "
                         "e5m2 (gradients)")
    return name, dtype


def per_tensor_scale(x, fmt="e4m3", margin: int = 0) -> float:
    """The scale that maps ``x``'s largest magnitude (amax) onto the format's max.

    scale = fmt_max / amax / 2^margin (Transformer Engine's formula; a margin leaves 2^margin
    of headroom). ``x`` is a tensor or its amax. An all-zero tensor gets scale 1.0: any scale
    stores zeros exactly.

    Example::

        >>> per_tensor_scale(torch.tensor([0.5, -2.0]), "e4m3")     # 448 / 2
        224.0
    """
    _, dtype = _fp8(fmt)
    margin = whole(margin, "margin", low=0)
    amax = float(x.detach().abs().max()) if isinstance(x, torch.Tensor) and x.numel() else x
    if isinstance(amax, torch.Tensor) or isinstance(amax, bool) or not isinstance(
            amax, numbers.Real) or not math.isfinite(amax) or amax < 0:
        shown = f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)
        raise ValueError(f"x must be a non-empty tensor of finite values or its amax (a number "
                         f">= 0), got {shown}: look for an inf or nan upstream")
    return 1.0 if amax == 0 else torch.finfo(dtype).max / amax / 2 ** margin


def quantize_fp8(x, fmt="e4m3", scale=None) -> FP8Tensor:
    """``x`` x ``scale``, rounded to FP8, saturating at the format's max (e4m3 448, e5m2 57344).

    Without ``scale``, :func:`per_tensor_scale` (current scaling: x's own amax lands on the
    max). Values beyond the max are clamped and counted: we saturate both formats, where a
    plain cast would send e5m2's overflow to inf.

    Example::

        >>> q = quantize_fp8(torch.tensor([1.0, 600.0]), "e4m3", scale=1.0)
        >>> dequantize_fp8(q), q.saturated
        (tensor([  1., 448.]), 1)
    """
    name, dtype = _fp8(fmt)
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        raise ValueError(f"x must be a non-empty tensor, got {type(x).__name__} "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else x!r}")
    scale = per_tensor_scale(x, name) if scale is None else _positive(scale, "scale")
    top = torch.finfo(dtype).max
    scaled = x.detach().float() * scale
    saturated = int((scaled.abs() > top).sum())  # nan compares False: not counted
    data = scaled.clamp(-top, top).to(dtype)
    return FP8Tensor(data=data, scale=float(scale), fmt=name, saturated=saturated)


def dequantize_fp8(q: FP8Tensor) -> torch.Tensor:
    """The fp32 values an :class:`FP8Tensor` stands for: ``data / scale``."""
    if not isinstance(q, FP8Tensor):
        raise TypeError(f"dequantize_fp8 takes what quantize_fp8 returns, got {type(q).__name__}")
    return q.data.float() / q.scale


class DelayedScaler:
    """Delayed scaling: each cast uses a scale computed from the amaxes of earlier steps.

    Current scaling (:func:`per_tensor_scale`) must read the whole tensor before it can cast it;
    delayed scaling, Transformer Engine's ``DelayedScaling`` recipe, casts at once with the
    scale it holds, then records this step's amax. The next scale is fmt_max / max(last
    ``history_len`` amaxes) / 2^margin (TE's defaults: history 1024, margin 0). If a step's amax
    exceeds what the held scale allows, its largest values saturate (:attr:`FP8Tensor.saturated`)
    and the scale shrinks for the next step. An amax of 0 leaves the scale as it was (as TE does).

    Example::

        >>> s = DelayedScaler("e4m3", history_len=2)
        >>> s.scale, s.update(2.0), s.update(1.0), s.update(1.0)      # 448/2, 448/2, 448/1
        (1.0, 224.0, 224.0, 448.0)
    """

    def __init__(self, fmt="e4m3", history_len: int = 1024, margin: int = 0):
        self.fmt = _fp8(fmt)[0]
        self.history_len = whole(history_len, "history_len", hint=" (TE's default is 1024)")
        self.margin = whole(margin, "margin", low=0)
        self.history: list[float] = []
        self.scale = 1.0  # before any amax is known, as TE starts

    def update(self, amax) -> float:
        """Record one step's amax; return the scale the next cast will use."""
        if (isinstance(amax, bool) or not isinstance(amax, numbers.Real)
                or math.isnan(amax) or amax < 0):
            raise ValueError(f"amax must be a number >= 0 (a tensor's largest |value|), "
                             f"got {amax!r}")
        self.history = (self.history + [float(amax)])[-self.history_len:]
        largest = max(self.history)
        if 0 < largest < math.inf:  # else keep the scale: nothing sensible to scale to
            self.scale = per_tensor_scale(largest, self.fmt, self.margin)
        return self.scale

    def quantize(self, x) -> FP8Tensor:
        """Cast ``x`` with the held scale (from past amaxes only), then record ``x``'s amax."""
        q = quantize_fp8(x, self.fmt, scale=self.scale)
        self.update(float(x.detach().abs().max()))
        return q


def fp8_matmul_error(a, b, fmt="e4m3") -> dict:
    """Relative error of ``a @ b`` with FP8 inputs, beside bf16 inputs, against fp32.

    Each input is quantised with its own per-tensor scale (as FP8 GEMMs take one scale per
    operand), dequantised, and multiplied in fp32; bf16 inputs are rounded and multiplied the
    same way, so the difference is the input format alone. Error = ||C - C_fp32|| / ||C_fp32||
    (Frobenius). Expect bf16 < e4m3 < e5m2: 7, 3 and 2 mantissa bits.

    Example::

        >>> a, b = torch.randn(256, 512), torch.randn(512, 128)
        >>> fp8_matmul_error(a, b, "e4m3")      # {'fmt': 'e4m3', 'fp8': ~0.03, 'bf16': ~0.002}
    """
    name, _ = _fp8(fmt)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0]):
        raise ValueError("a and b must be 2-D tensors with a.shape[1] == b.shape[0], e.g. "
                         "torch.randn(64, 128) and torch.randn(128, 32)")
    a32, b32 = a.detach().float(), b.detach().float()
    exact = a32 @ b32
    norm = exact.norm()
    if not norm > 0:
        raise ValueError("a @ b is all zeros (or not finite): a relative error needs a "
                         "nonzero result")
    fp8 = dequantize_fp8(quantize_fp8(a32, name)) @ dequantize_fp8(quantize_fp8(b32, name))
    bf16 = a32.to(torch.bfloat16).float() @ b32.to(torch.bfloat16).float()
    return {"fmt": name, "fp8": float((fp8 - exact).norm() / norm),
            "bf16": float((bf16 - exact).norm() / norm)}


def fp8_matmul_support() -> str | None:
    """Why this machine cannot run an FP8 matmul on tensor cores, or None when it can.

    ``torch._scaled_mm`` needs an NVIDIA GPU of compute capability 8.9 (Ada) or 9.0 and newer
    (Hopper, Blackwell); the FP8 dtypes themselves work anywhere, which is how the rest of this
    module runs on a CPU.
    """
    if not torch.cuda.is_available():
        return ("no CUDA GPU here: FP8 matmuls need NVIDIA tensor cores of compute capability "
                "8.9 or newer (Ada, Hopper); the FP8 numerics above still run on the CPU")
    if torch.version.hip:
        return "this is a ROCm GPU: time_scaled_mm covers NVIDIA's FP8 matmul only"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}: FP8 "
                "tensor cores start at 8.9 (Ada) and 9.0 (Hopper)")
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def time_scaled_mm(n: int = 8192, repeats: int = 20) -> dict | None:
    """Seconds and TFLOP/s of an n x n x n FP8 (e4m3) matmul beside bf16, on this GPU.

    Returns None, after printing the reason, where FP8 tensor cores are missing (any CPU):
    never an error. Both matmuls take the same values (the FP8 ones cast to bf16), so the
    difference is the tensor-core path. ``n`` must be a multiple of 16 (cuBLAS's FP8 rule).

    Example::

        >>> time_scaled_mm(4096)      # on a CPU: prints why, returns None
    """
    n = whole(n, "n", low=16)
    repeats = whole(repeats, "repeats")
    if n % 16:
        raise ValueError(f"n must be a multiple of 16 for an FP8 matmul, got {n}: try "
                         f"{n - n % 16 or 16} or {n - n % 16 + 16}")
    reason = fp8_matmul_support()
    if reason is not None:
        print(wrap(f"time_scaled_mm: not timed: {reason}."))
        return None
    device = torch.device("cuda")
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    # _scaled_mm wants its second operand column-major: the transpose of a row-major tensor.
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)  # float32 per-tensor scales (1.0: values fit as is)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    runs = {"fp8": lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                            out_dtype=torch.bfloat16),
            "bf16": lambda: a16 @ b16}
    out = {"n": n, "flops": 2 * n ** 3}
    for name, run in runs.items():
        for _ in range(3):  # warm-up: cuBLAS picks its kernel on the first calls
            run()
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        sync(device)
        seconds = (time.perf_counter() - start) / repeats
        out[f"{name}_s"] = seconds
        out[f"{name}_tflops"] = out["flops"] / seconds / 1e12
    out["speedup"] = out["bf16_s"] / out["fp8_s"]
    out["device"] = torch.cuda.get_device_name()
    return out

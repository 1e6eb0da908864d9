"""The model of memory: the bytes one device holds for parameters, gradients, optimizer state
and activations under a layout."""

from __future__ import annotations

from .describe import Degrees, Model

__all__ = ["stage_layers", "local_params", "model_state_bytes", "layer_activation_bytes",
           "in_flight", "stage_activation_bytes"]


def stage_layers(model: Model, d: Degrees) -> tuple:
    """The layers on each pipeline stage: ``d.stage_layers``, or ``layers / pp`` each."""
    return d.stage_layers or (model.layers / d.pp,) * d.pp


def local_params(model: Model, d: Degrees, stage: int = 0) -> tuple[float, float]:
    """(dense, expert) parameters on one device of ``stage`` before ZeRO: split by tp*pp (by
    tp and the stage's share of the layers when stages differ), experts by ep too."""
    dense, expert = model.params - model.expert_params, model.expert_params
    if d.stage_layers is None:
        return dense / (d.tp * d.pp), expert / (d.ep * d.tp * d.pp)
    share = d.stage_layers[stage] / model.layers
    return dense * share / d.tp, expert * share / (d.ep * d.tp)


def model_state_bytes(model: Model, degrees: Degrees, stage: int = 0) -> dict:
    """Bytes per device of parameters, gradients, optimizer state, and ZeRO-3's gathered buffers.

    With ``P = params - expert_params`` dense and ``E = expert_params`` expert parameters, one
    device holds ``P / (tp*pp)`` dense and ``E / (ep*tp*pp)`` expert parameters. ZeRO divides
    the dense ones by ``n = dp*cp`` and the expert ones by ``n / ep`` (the ranks that hold the
    same experts): the optimizer state from stage 1, the gradients from 2, the parameters at 3.
    Each kind costs its bytes per parameter (``optimizer_bytes`` etc.).

    ZeRO-3 gathers a layer's parameters whole before using it; ``buffers`` counts two gathered
    layers (the one computing and the one prefetched) and one layer's unsharded gradients
    before their reduce-scatter: ``(2*param_bytes + grad_bytes) * local_params / (layers/pp)``.
    With ``keep_gathered`` the whole stage stays gathered through the step: ``buffers`` is
    ``param_bytes * local_params`` plus one layer's unsharded gradients. (ZeRO-3's ``16Ψ/n``
    alone leaves these buffers out.)

    Example (1e9 parameters, mixed Adam, ZeRO-1 over 8 ranks: 2 + 2 + 12/8 bytes each)::

        >>> m = model_state_bytes(Model("1B", params=1e9, layers=8, hidden=1024, heads=8,
        ...                              seq_len=128, micro_batch=1), Degrees(dp=8, zero=1))
        >>> m["params"] / 1e9, m["grads"] / 1e9, m["optimizer"] / 1e9
        (2.0, 2.0, 1.5)
    """
    dense, expert = local_params(model, degrees, stage)
    n = degrees.dp * degrees.cp
    n_expert = n / degrees.ep

    def held(per_param: float, sharded: bool) -> float:
        return per_param * (dense / n + expert / n_expert if sharded else dense + expert)

    out = {"params": held(model.param_bytes, degrees.zero >= 3),
           "grads": held(model.grad_bytes, degrees.zero >= 2),
           "optimizer": held(model.optimizer_bytes, degrees.zero >= 1),
           "buffers": 0.0}
    if degrees.zero >= 3 and n > 1:
        per_layer = (dense + expert) / stage_layers(model, degrees)[stage]
        if degrees.keep_gathered:
            out["buffers"] = model.param_bytes * (dense + expert) + model.grad_bytes * per_layer
        else:
            out["buffers"] = (2 * model.param_bytes + model.grad_bytes) * per_layer
    return out


def layer_activation_bytes(model: Model, degrees: Degrees) -> float:
    """Bytes one transformer layer saves for backward, for one micro-batch, on one device.

    Megatron's count (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models"): in fp16 with dropout, ``s*b*h*(34 + 5*a*s/h)`` per layer, where s is
    the sequence, b the micro-batch, h the hidden size, a the heads. Term by term, with ``B =
    act_bytes``, ``d = 1`` for dropout's 1-byte masks (0 without), ``g = kv_heads/heads`` and
    ``f = ffn/h`` (the ``s*b*h`` factor left out):

    - kept whole on every TP rank unless sequence parallelism splits them: the two layer norms'
      inputs, the inputs of the QKV and first MLP matmuls (``4B``), two dropout masks (``2d``);
    - split by TP: Q, K, V (``B*(1 + 2g)``), the attention output (``B``), the MLP's ffn-wide
      tensors (``2fB``: GELU's input and output; ``4fB`` for a gated MLP; times ``top_k`` for
      experts, each token being computed by ``top_k`` of them);
    - the attention scores, ``a*s*s*b*(B + d*(1 + B))`` (softmax output, dropout mask and
      output; ``a*s*s*b*B`` without ``attention_dropout``), split by TP; none with
      ``flash_attention`` or ``selective_recompute`` (recomputed in backward: Megatron's
      selective recomputation gives ``34/t`` with SP, ``10 + 24/t`` without);
    - with ``small_terms``: each LayerNorm's mean and 1/std, ``2*2*s*b`` fp32 numbers (``/t``
      with SP), and without flash attention the causal mask, ``s*s`` bytes on every rank.

    At B=2, d=1, g=1, f=4: ``4B + 2d = 10`` and ``B*(2 + 2g + 2f) = 24``: Megatron's ``10 +
    24/t`` without sequence parallelism, ``34/t`` with it (``sp``: everything divided by
    ``t = tp``). Context parallelism gives each rank ``s/cp`` of the sequence (its queries
    still see all ``s`` keys in the score term).

    Example (GPT-3 175B's layer, micro-batch 1, no TP: 34 + 5*96*2048/12288 = 114)::

        >>> m = Model("gpt3", params=175e9, layers=96, hidden=12288, heads=96, seq_len=2048,
        ...           micro_batch=1)
        >>> layer_activation_bytes(m, Degrees()) / (2048 * 12288)
        114.0
    """
    t = degrees.tp
    s = model.seq_len / degrees.cp
    sbh = s * model.micro_batch * model.hidden
    B, d = model.act_bytes, (1 if model.dropout else 0)
    g, f = model.kv_heads / model.heads, model.ffn / model.hidden
    wide = (4 if model.gated_mlp else 2) * f * (model.top_k if model.experts > 1 else 1)
    whole_per_rank = (4 * B + 2 * d) * sbh
    split = B * (2 + 2 * g + wide) * sbh
    scores = not (model.flash_attention or model.selective_recompute)
    if scores:
        drops = model.dropout if model.attention_dropout is None else model.attention_dropout
        score_dropout = 1 if drops else 0
        split += (model.heads * s * model.seq_len * model.micro_batch
                  * (B + score_dropout * (1 + B)))
    small = 0.0
    if model.small_terms:
        whole_per_rank += 2 * 2 * s * model.micro_batch * max(B, 4)  # LayerNorm statistics
        small = model.seq_len * model.seq_len if not model.flash_attention else 0.0
    if degrees.sp and t > 1:
        return (whole_per_rank + split) / t + small
    return whole_per_rank + split / t + small


def in_flight(degrees: Degrees, stage: int = 0) -> float:
    """Micro-batches' worth of a stage's activations that ``stage`` holds at its peak.

    1F1B: stage ``r`` runs ``pp - r`` forwards before its first backward, so it holds ``min(pp
    - r, m)``. Interleaved 1F1B with ``v`` chunks (Megatron's warm-up): ``min(2(pp-r-1) +
    (v-1)pp + 1, m v)`` chunk forwards, each ``1/v`` of the stage: stage 0 holds ``pp +
    (pp-1)/v`` stages' worth when m is large (Korthikanti et al. 2022, section 4.2.3:
    ``L(1 + (p-1)/(pv))`` layers in all), more than 1F1B's ``pp``.
    Without a pipeline gradient accumulation runs one micro-batch at a time.
    """
    p, v, m = degrees.pp, degrees.chunks, degrees.m
    if p == 1:
        return 1
    if v == 1:
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v) / v


def stage_activation_bytes(model: Model, degrees: Degrees, stage: int = 0) -> float:
    """Activation bytes on one device of pipeline ``stage`` (stage 0 by default: the busiest
    when stages are equal).

    ``in_flight(degrees, stage) * stage_layers * layer_activation_bytes``: stage 0 of a 1F1B
    pipeline holds ``min(pp, m)`` micro-batches (it runs ``pp - 1`` forwards before its first
    backward), each through ``layers / pp`` layers, about the whole model's layers' worth for
    one micro-batch. With ``activation_checkpointing`` each layer keeps only its input
    (``s*b*h*B``, ``/tp`` with sequence parallelism) and backward recomputes one layer at a
    time, whose full activations are added once.

    Example (stage 0 of 4 holds 4 micro-batches of 2 layers: 8 layers' worth)::

        >>> m = Model("m", params=1e9, layers=8, hidden=1024, heads=8, seq_len=128, micro_batch=1)
        >>> stage_activation_bytes(m, Degrees(pp=4)) / layer_activation_bytes(m, Degrees(pp=4))
        8.0
    """
    per_layer = layer_activation_bytes(model, degrees)
    held = in_flight(degrees, stage)
    layers = stage_layers(model, degrees)[stage]
    if not model.activation_checkpointing:
        return held * layers * per_layer
    s = model.seq_len / degrees.cp
    kept = s * model.micro_batch * model.hidden * model.act_bytes
    if degrees.sp and degrees.tp > 1:
        kept /= degrees.tp
    return held * layers * kept + per_layer

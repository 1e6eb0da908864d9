"""The model of memory: the bytes one device holds for parameters, gradients, optimizer state
and activations under a layout."""

from __future__ import annotations

from .describe import Degrees, Model

__all__ = ["local_params", "model_state_bytes", "layer_activation_bytes",
           "stage_activation_bytes"]


def local_params(model: Model, d: Degrees) -> tuple[float, float]:
    """(dense, expert) parameters on one device before ZeRO: split by tp*pp, experts by ep too."""
    return ((model.params - model.expert_params) / (d.tp * d.pp),
            model.expert_params / (d.ep * d.tp * d.pp))


def model_state_bytes(model: Model, degrees: Degrees) -> dict:
    """Bytes per device of parameters, gradients, optimizer state, and ZeRO-3's gathered buffers.

    With ``P = params - expert_params`` dense and ``E = expert_params`` expert parameters, one
    device holds ``P / (tp*pp)`` dense and ``E / (ep*tp*pp)`` expert parameters. ZeRO divides
    the dense ones by ``n = dp*cp`` and the expert ones by ``n / ep`` (the ranks that hold the
    same experts): the optimizer state from stage 1, the gradients from 2, the parameters at 3.
    Each kind costs its bytes per parameter (``optimizer_bytes`` etc.).

    ZeRO-3 gathers a layer's parameters whole before using it; ``buffers`` counts two gathered
    layers (the one computing and the one prefetched) and one layer's unsharded gradients
    before their reduce-scatter: ``(2*param_bytes + grad_bytes) * local_params / (layers/pp)``.

    Example (1e9 parameters, mixed Adam, ZeRO-1 over 8 ranks: 2 + 2 + 12/8 bytes each)::

        >>> m = model_state_bytes(Model("1B", params=1e9, layers=8, hidden=1024, heads=8,
        ...                              seq_len=128, micro_batch=1), Degrees(dp=8, zero=1))
        >>> m["params"] / 1e9, m["grads"] / 1e9, m["optimizer"] / 1e9
        (2.0, 2.0, 1.5)
    """
    dense, expert = local_params(model, degrees)
    n = degrees.dp * degrees.cp
    n_expert = n / degrees.ep

    def held(per_param: float, sharded: bool) -> float:
        return per_param * (dense / n + expert / n_expert if sharded else dense + expert)

    out = {"params": held(model.param_bytes, degrees.zero >= 3),
           "grads": held(model.grad_bytes, degrees.zero >= 2),
           "optimizer": held(model.optimizer_bytes, degrees.zero >= 1),
           "buffers": 0.0}
    if degrees.zero >= 3 and n > 1:
        per_layer = (dense + expert) / (model.layers / degrees.pp)
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
      output), split by TP; none with ``flash_attention``.

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
    if not model.flash_attention:
        split += model.heads * s * model.seq_len * model.micro_batch * (B + d * (1 + B))
    if degrees.sp and t > 1:
        return (whole_per_rank + split) / t
    return whole_per_rank + split / t


def stage_activation_bytes(model: Model, degrees: Degrees) -> float:
    """Activation bytes on the busiest device: pipeline stage 0 under 1F1B.

    Stage 0 of a 1F1B pipeline holds ``min(pp, m)`` micro-batches in flight (it runs ``pp - 1``
    forwards before its first backward), each through ``layers / pp`` layers: ``min(pp, m) *
    layers/pp * layer_activation_bytes``, about the whole model's layers' worth for one
    micro-batch. Without a pipeline (``pp = 1``) gradient accumulation runs one micro-batch at
    a time. With ``activation_checkpointing`` each layer keeps only its input (``s*b*h*B``,
    ``/tp`` with sequence parallelism) and backward recomputes one layer at a time, whose full
    activations are added once.

    Example (stage 0 of 4 holds 4 micro-batches of 2 layers: 8 layers' worth)::

        >>> m = Model("m", params=1e9, layers=8, hidden=1024, heads=8, seq_len=128, micro_batch=1)
        >>> stage_activation_bytes(m, Degrees(pp=4)) / layer_activation_bytes(m, Degrees(pp=4))
        8.0
    """
    per_layer = layer_activation_bytes(model, degrees)
    in_flight = min(degrees.pp, degrees.m) if degrees.pp > 1 else 1
    layers = model.layers / degrees.pp
    if not model.activation_checkpointing:
        return in_flight * layers * per_layer
    s = model.seq_len / degrees.cp
    kept = s * model.micro_batch * model.hidden * model.act_bytes
    if degrees.sp and degrees.tp > 1:
        kept /= degrees.tp
    return in_flight * layers * kept + per_layer

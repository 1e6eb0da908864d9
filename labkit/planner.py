"""Plan a training run before launching it: bytes per device, bytes on the wire, does it fit.

A run is three descriptions and one verdict::

    model = Model("7B", params=6.7e9, layers=32, hidden=4096, heads=32, seq_len=2048,
                  micro_batch=1, flash_attention=True)
    cluster = Cluster(devices=8, memory_gib=80)
    p = plan(model, cluster, Degrees(dp=8, zero=1))
    p.fits, p.memory["total"] / 2**30, p.why          # (True, 42.8, '')

The planner is arithmetic: it imports no framework and runs no rank, so it can describe a
16 384-GPU run as easily as the 2-rank runs of this course, whose measured bytes it predicts
(``tests/test_planner.py`` checks DDP's and FSDP2's on real ranks).

**Conventions** (Megatron-LM's, which torchtitan follows):

- ``world = dp * tp * pp * cp`` devices. Rank order, innermost first: ``tp``, ``cp``, ``ep``,
  ``dp``, ``pp`` (Megatron's ``tp-cp-ep-dp-pp``): tensor-parallel ranks are adjacent, so they
  share a node; a group is *intra-node* when the ranks it spans fit in one node (``tp`` spans
  ``tp`` ranks, ``cp`` spans ``tp*cp``, ``ep`` spans ``tp*cp*ep``, ``dp`` spans ``tp*cp*dp``,
  ``pp`` spans the whole world), else its bytes go at the inter-node bandwidth.
- **ZeRO** shards over the ``dp * cp`` ranks that hold the same weights (Megatron's distributed
  optimizer, FSDP over a flattened ``dp x cp`` mesh): stage 1 the optimizer state, 2 the
  gradients too, 3 the parameters too.
- **Expert parallelism** reuses the data-parallel ranks (Megatron / DeepSpeed-MoE): ``ep``
  divides ``dp`` and adds no devices. ``Model.expert_params`` (all experts together) are split
  over ``ep * tp * pp``; each expert's weights are replicated (and ZeRO-sharded) over the
  ``dp * cp / ep`` ranks that hold the same experts.
- Every formula counts bytes **per device**: the memory it holds, the bytes it *sends* per
  optimizer step, with the ring conventions of :mod:`labkit.parallel.traffic` (all-reduce of
  S bytes: ``2(n-1)/n * S``; all-gather / reduce-scatter: ``(n-1)/n * S``; point-to-point:
  ``S``). Each formula function's docstring gives its formula.

Left out, on purpose: the embedding and output layers (their parameters are in ``params``,
their activations and the first stage's imbalance are not), interleaved pipeline stages,
communication buffers other than ZeRO-3's gathered layers, and overlap of communication with
compute (``Plan.seconds`` adds them up: an upper bound, used only to rank layouts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ._sizes import whole

__all__ = ["PlanError", "Model", "Cluster", "Degrees", "Plan", "Published", "PUBLISHED",
           "MIXED_ADAM", "FP32_ADAM", "DIMENSIONS", "allreduce_bytes", "gather_bytes",
           "as_degrees", "model_state_bytes", "layer_activation_bytes", "stage_activation_bytes",
           "comm_bytes", "group_links", "step_seconds", "plan", "suggest", "layouts",
           "predicted_vs_measured", "step_traffic", "planner_explorer"]

GiB = 2**30
DIMENSIONS = ("dp", "tp", "pp", "cp", "ep")
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
# Bytes per parameter (ZeRO paper, section 3.1): mixed-precision Adam keeps bf16/fp16 weights
# and gradients (2 + 2) and an fp32 master copy, momentum and variance (12); plain fp32 Adam
# keeps fp32 weights and gradients (4 + 4) and momentum and variance (8).
MIXED_ADAM = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12, "act_bytes": 2}
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8, "act_bytes": 4}


class PlanError(ValueError):
    """A description or a layout the planner cannot use; the message says what to change."""


def _whole(value, name: str) -> int:
    return whole(value, name, error=PlanError)


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{name} must be a number > 0, got {value!r}")
    return value


def _factors(n: int) -> list[int]:
    """Every divisor of ``n``, smallest first."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.1f} GiB"


# ---- the three descriptions --------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A transformer to train: its size, its shapes, and the bytes each number takes.

    ``params`` is the exact parameter count (experts and embeddings included): pass a real
    module's count (:meth:`from_module`) to describe a small model exactly. ``expert_params`` is
    the part of it in the experts (all of them), 0 for a dense model. ``ffn`` is the MLP's
    width (4 * hidden unless given), ``kv_heads`` the key/value heads (grouped-query attention;
    ``heads`` unless given). ``vocab`` is for the record only (``params`` already counts it).

    Bytes per parameter default to mixed-precision Adam (``MIXED_ADAM``: 2 + 2 + 12); fp32
    Adam is ``Model(..., **FP32_ADAM)`` (4 + 4 + 8, activations in fp32). ``act_bytes`` is the
    bytes of one activation element. ``activation_checkpointing`` keeps only each layer's input
    for backward; ``flash_attention`` never stores the ``s x s`` attention scores; ``dropout``
    stores its 1-byte masks; ``gated_mlp`` (SwiGLU) stores four ffn-wide tensors, not two.

    Example::

        >>> Model("tiny", params=1.3e9, layers=24, hidden=2048, heads=16, seq_len=2048,
        ...       micro_batch=4).ffn
        8192
    """

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int
    vocab: int | None = None
    ffn: int | None = None
    kv_heads: int | None = None
    experts: int = 1
    top_k: int = 1
    expert_params: float = 0
    param_bytes: float = 2
    grad_bytes: float = 2
    optimizer_bytes: float = 12
    act_bytes: float = 2
    activation_checkpointing: bool = False
    flash_attention: bool = False
    dropout: bool = True
    gated_mlp: bool = False

    def __post_init__(self):
        _positive(self.params, "params")
        for name in ("layers", "hidden", "heads", "seq_len", "micro_batch", "experts", "top_k"):
            _whole(getattr(self, name), name)
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        _whole(self.ffn, "ffn")
        _whole(self.kv_heads, "kv_heads")
        if self.hidden % self.heads:
            raise PlanError(f"hidden={self.hidden} does not split into heads={self.heads}: each "
                            f"head needs hidden/heads dimensions; use heads that divide "
                            f"{self.hidden}")
        if self.heads % self.kv_heads:
            raise PlanError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (each "
                            f"key/value head serves a group of query heads)")
        if self.top_k > self.experts:
            raise PlanError(f"top_k={self.top_k} is more than experts={self.experts}: each "
                            f"token picks top_k of the experts")
        if self.experts == 1 and self.expert_params:
            raise PlanError("expert_params is set but experts=1: give experts > 1 for a "
                            "mixture of experts, or leave expert_params at 0")
        if self.experts > 1 and not 0 < self.expert_params < self.params:
            raise PlanError(f"experts={self.experts} needs expert_params: the part of params in "
                            f"the experts (0 < expert_params < params={self.params:g})")
        for name in ("param_bytes", "grad_bytes", "optimizer_bytes", "act_bytes"):
            _positive(getattr(self, name), name)

    @classmethod
    def from_module(cls, module, name: str | None = None, **fields) -> Model:
        """A Model whose ``params`` is ``module``'s exact parameter count; the rest from ``fields``.

        Example::

            >>> Model.from_module(block_stack(4, 64), layers=4, hidden=64, heads=1, seq_len=1,
            ...                   micro_batch=8, **FP32_ADAM).params
            132352
        """
        n = sum(p.numel() for p in module.parameters())  # works on any torch module
        return cls(name or type(module).__name__, params=n, **fields)

    @property
    def active_params(self) -> float:
        """Parameters one token goes through: the dense ones and top_k of the experts."""
        return self.params - self.expert_params + self.expert_params * self.top_k / self.experts


@dataclass(frozen=True)
class Cluster:
    """The devices: how many, their memory, how they are linked, how fast they compute.

    ``intra_GBps`` and ``inter_GBps`` are the bytes per second one device can send inside a
    node (NVLink) and to another node (its share of the network), in GB/s (1e9 bytes).
    ``tflops`` is the dense matmul rate one device *achieves* (about half its peak), used only
    for the compute and bubble estimates. ``headroom`` (10 %) is kept free for what the
    planner does not count: communication buckets, the allocator's fragmentation, the CUDA
    context, temporary tensors. ``budget`` is what is left for the counted bytes.

    Example::

        >>> Cluster(16, memory_gib=40).budget / 2**30
        36.0
    """

    devices: int
    memory_gib: float
    devices_per_node: int = 8
    intra_GBps: float = 150.0
    inter_GBps: float = 25.0
    tflops: float = 150.0
    headroom: float = 0.10
    name: str = ""

    def __post_init__(self):
        _whole(self.devices, "devices")
        _whole(self.devices_per_node, "devices_per_node")
        for name in ("memory_gib", "intra_GBps", "inter_GBps", "tflops"):
            _positive(getattr(self, name), name)
        if not 0 <= self.headroom < 1:
            raise PlanError(f"headroom is the fraction of memory kept free, from 0 to below 1 "
                            f"(0.1 keeps 10 %), got {self.headroom!r}")
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise PlanError(f"{self.devices} devices do not fill nodes of "
                            f"{self.devices_per_node}: use a multiple of {self.devices_per_node} "
                            f"or set devices_per_node")

    @property
    def budget(self) -> float:
        """Bytes per device the plan may use: the memory less the headroom."""
        return self.memory_gib * GiB * (1 - self.headroom)

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.devices_per_node)

    def __str__(self) -> str:
        return (self.name or f"{self.devices} x {self.memory_gib:g} GiB "
                f"({self.devices_per_node} per node)")


@dataclass(frozen=True)
class Degrees:
    """A layout: how many ways each parallelism splits the run, the ZeRO stage, the micro-batches.

    ``dp * tp * pp * cp`` must be the number of devices; ``ep`` reuses the data-parallel ranks
    (it divides ``dp``). ``zero`` (0-3) shards over ``dp * cp``. ``microbatches`` is the
    number of micro-batches each data-parallel replica runs per step (gradient accumulation, or
    the pipeline's micro-batches); ``None`` means ``pp``, the fewest that keep every stage
    busy. ``sp`` is Megatron's sequence parallelism, on by default whenever ``tp > 1``: the
    layer norms and dropouts work on ``1/tp`` of the sequence each.

    Example::

        >>> Degrees(dp=4, tp=2).world
        8
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    microbatches: int | None = None
    sp: bool = True

    def __post_init__(self):
        for name in DIMENSIONS:
            _whole(getattr(self, name), name)
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise PlanError(f"zero is the ZeRO stage, 0 (none), 1, 2 or 3, got {self.zero!r}")
        if self.microbatches is not None:
            _whole(self.microbatches, "microbatches")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def m(self) -> int:
        """Micro-batches per step per data-parallel replica."""
        return self.microbatches or self.pp

    def __str__(self) -> str:
        text = " ".join(f"{k}={getattr(self, k)}" for k in DIMENSIONS) + f" zero={self.zero}"
        return text + ("" if self.tp == 1 or self.sp else " (no sp)")


def as_degrees(value) -> Degrees:
    """A :class:`Degrees` from a Degrees or a dict such as ``{"dp": 4, "tp": 2, "zero": 1}``."""
    if isinstance(value, Degrees):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {f.name for f in dataclasses.fields(Degrees)}
        if unknown:
            raise PlanError(f"unknown keys {sorted(unknown)}: a layout has dp, tp, pp, cp, ep, "
                            f"zero, microbatches and sp")
        return Degrees(**value)
    raise PlanError(f"a layout is a Degrees(dp=..., tp=..., ...) or a dict with those keys, "
                    f"not {type(value).__name__}")


# ---- ring conventions (labkit.parallel.traffic's) ----------------------------------------------


def allreduce_bytes(payload: float, n: int) -> float:
    """Bytes one of ``n`` ranks sends in a ring all-reduce of ``payload`` bytes: ``2(n-1)/n*S``."""
    return 2 * (n - 1) / n * payload


def gather_bytes(payload: float, n: int) -> float:
    """Bytes one of ``n`` ranks sends in a ring all-gather (output ``S``) or reduce-scatter
    (input ``S``): ``(n-1)/n * S``."""
    return (n - 1) / n * payload


# ---- the formulas --------------------------------------------------------------------------------


def _local_params(model: Model, d: Degrees) -> tuple[float, float]:
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

        >>> m = model_state_bytes(Model("1B", 1e9, 8, 1024, 8, 128, 1), Degrees(dp=8, zero=1))
        >>> m["params"] / 1e9, m["grads"] / 1e9, m["optimizer"] / 1e9
        (2.0, 2.0, 1.5)
    """
    dense, expert = _local_params(model, degrees)
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

        >>> m = Model("gpt3", 175e9, 96, 12288, 96, 2048, 1)
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

        >>> m = Model("m", 1e9, 8, 1024, 8, 128, 1)
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


def comm_bytes(model: Model, degrees: Degrees) -> dict:
    """Bytes one device sends per optimizer step, by parallelism (ring conventions).

    With ``A = (s/cp) * b * h * act_bytes`` the bytes of one micro-batch's activation on a
    device, ``L = layers/pp`` its layers, ``m`` micro-batches, ``t = tp``, and ``r = 6`` with
    activation checkpointing (the forward runs twice), else 4:

    - ``dp``: the gradients ``G`` (``local params * grad_bytes``) over ``n = dp*cp`` ranks
      (expert gradients over ``n/ep``). ZeRO-0: one all-reduce per step, ``2(n-1)/n * G``
      (DDP accumulates micro-batches locally). ZeRO-1: reduce-scatter the gradients and
      all-gather the updated parameters ``P`` once, ``(n-1)/n * (G + P)``. ZeRO-2: the
      reduce-scatter for every micro-batch (its gradients stay sharded), ``(n-1)/n * (m*G +
      P)``. ZeRO-3: every micro-batch all-gathers the parameters for forward and again for
      backward and reduce-scatters the gradients, ``m * (n-1)/n * (2P + G)``: 1.5 times
      ZeRO-0's bytes when ``P = G`` and ``m = 1``.
    - ``tp``: per layer and micro-batch, 2 all-reduces of ``A`` forward (after attention and
      after the MLP) and 2 backward: ``r/2 * m * L * 2(t-1)/t * A * 2``, i.e. ``r * m * L *
      2(t-1)/t * A``. Sequence parallelism replaces each all-reduce with an all-gather and a
      reduce-scatter: the same bytes.
    - ``pp``: each micro-batch's activation to the next stage and its gradient to the previous
      one, ``A`` each (``A/t`` with sequence parallelism: each TP rank sends its shard). A
      middle stage sends ``2*m*A``, the busiest; with 2 stages each sends ``m*A``.
    - ``cp``: ring attention passes each rank's K and V (``2*A*g/t``, ``g = kv_heads/heads``)
      around the ring, ``cp-1`` hops forward and, backward, K and V again and their
      gradients: ``3(cp-1)`` hops per layer and micro-batch (4 with checkpointing).
    - ``ep``: each MoE layer's all-to-alls send the tokens routed to other ranks' experts,
      ``(ep-1)/ep * top_k * A`` (``/t`` with sequence parallelism), twice forward (dispatch,
      combine) and twice backward (``r`` in all). Every layer is an MoE layer when experts > 1.

    Example (DDP of 1e6 fp32 parameters on 2 ranks: one all-reduce of 4 MB sends 4 MB)::

        >>> m = Model("m", 1e6, 2, 64, 1, 1, 1, **FP32_ADAM)
        >>> comm_bytes(m, Degrees(dp=2))["dp"]
        4000000.0
    """
    d = degrees
    dense, expert = _local_params(model, d)
    n = d.dp * d.cp
    A = model.seq_len / d.cp * model.micro_batch * model.hidden * model.act_bytes
    shard = A / d.tp if d.sp and d.tp > 1 else A
    L, m = model.layers / d.pp, d.m
    r = 6 if model.activation_checkpointing else 4

    def dp_bytes(params: float, ranks: float) -> float:
        if ranks <= 1:
            return 0.0
        P, G = params * model.param_bytes, params * model.grad_bytes
        if d.zero == 0:
            return allreduce_bytes(G, ranks)
        if d.zero in (1, 2):
            return gather_bytes((m if d.zero == 2 else 1) * G + P, ranks)
        return m * gather_bytes(2 * P + G, ranks)

    out = {"dp": dp_bytes(dense, n) + dp_bytes(expert, n / d.ep),
           "tp": r * m * L * allreduce_bytes(A, d.tp),
           "pp": (0.0 if d.pp == 1 else (1 if d.pp == 2 else 2) * m * shard),
           "cp": (4 if model.activation_checkpointing else 3) * (d.cp - 1) * m * L
           * 2 * A * model.kv_heads / model.heads / d.tp,
           "ep": r * m * L * (d.ep - 1) / d.ep * model.top_k * shard
           if model.experts > 1 else 0.0}
    return out


def group_links(cluster: Cluster, degrees: Degrees) -> dict:
    """``{dimension: "intra-node" | "inter-node" | None}``: the link each group's bytes take.

    Ranks are numbered tp innermost, then cp, ep, dp, pp (Megatron's order); a group spans
    ``tp``, ``tp*cp``, ``tp*cp*ep``, ``tp*cp*dp`` and the whole world of ranks respectively, and
    stays on NVLink when that span fits in one node. ``None``: a group of one, which sends
    nothing.

    Example::

        >>> group_links(Cluster(16, 80), Degrees(dp=2, tp=8))
        {'dp': 'inter-node', 'tp': 'intra-node', 'pp': None, 'cp': None, 'ep': None}
    """
    d = degrees
    spans = {"dp": d.tp * d.cp * d.dp, "tp": d.tp, "pp": d.world, "cp": d.tp * d.cp,
             "ep": d.tp * d.cp * d.ep}
    size = {"dp": d.dp * d.cp, "tp": d.tp, "pp": d.pp, "cp": d.cp, "ep": d.ep}
    return {k: None if size[k] == 1 else
            ("intra-node" if spans[k] <= cluster.devices_per_node else "inter-node")
            for k in DIMENSIONS}


def step_seconds(model: Model, cluster: Cluster, degrees: Degrees, comm: dict) -> dict:
    """Rough seconds per step: compute, the pipeline's bubble, and each dimension's communication.

    ``compute = 6 * active_params * tokens / (devices * tflops)`` (8 with checkpointing: the
    forward again), ``tokens = dp * m * micro_batch * seq_len``; the 1F1B bubble adds ``(pp-1)/m``
    of it; each dimension's bytes take ``bytes / bandwidth`` of its link (:func:`group_links`),
    nothing overlapped. ``overhead = bubble + comm``: what a layout adds to the compute every
    layout shares, the figure :func:`suggest` ranks by.
    """
    d = degrees
    tokens = d.dp * d.m * model.micro_batch * model.seq_len
    per_token = (8 if model.activation_checkpointing else 6) * model.active_params
    compute = per_token * tokens / (cluster.devices * cluster.tflops * 1e12)
    links = group_links(cluster, d)
    bandwidth = {"intra-node": cluster.intra_GBps * 1e9, "inter-node": cluster.inter_GBps * 1e9}
    out = {k: comm[k] / bandwidth[links[k]] if links[k] else 0.0 for k in DIMENSIONS}
    out["comm"] = sum(out[k] for k in DIMENSIONS)
    out["compute"] = compute
    out["bubble"] = compute * (d.pp - 1) / d.m
    out["overhead"] = out["bubble"] + out["comm"]
    out["step"] = out["compute"] + out["overhead"]
    return out


# ---- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` found for one layout: bytes held, bytes sent, seconds, the verdict.

    ``memory``: bytes per device (``params``, ``grads``, ``optimizer``, ``activations``,
    ``buffers``, ``total``); ``budget``: the usable bytes (the cluster's memory less its
    headroom); ``fits``: ``total <= budget``; ``why``: '' when it fits, else what is too big
    and what would help. ``comm``: bytes each device sends per step by dimension (and
    ``total``); ``links``: intra- or inter-node per dimension; ``seconds``: the estimates of
    :func:`step_seconds`; ``bubble``: the 1F1B idle fraction ``(pp-1)/(m+pp-1)``;
    ``warnings``: what is allowed but costly.
    """

    model: Model
    cluster: Cluster
    degrees: Degrees
    memory: dict
    budget: float
    fits: bool
    why: str
    comm: dict
    links: dict
    seconds: dict
    bubble: float
    warnings: tuple = field(default=())

    def row(self, label: str | None = None) -> dict:
        """The plan as plain data, for a table or ``plots.planner_plot``."""
        return {"label": label or str(self.degrees), "memory": dict(self.memory),
                "budget": self.budget, "device_memory": self.cluster.memory_gib * GiB,
                "comm": dict(self.comm), "seconds": dict(self.seconds), "fits": self.fits}

    def __str__(self) -> str:
        mem = ", ".join(f"{k} {self.memory[k] / GiB:.2f}" for k in MEMORY_PARTS)
        sent = ", ".join(f"{k} {self.comm[k] / GiB:.3g} GiB ({self.links[k]})"
                         for k in DIMENSIONS if self.comm[k]) or "nothing"
        verdict = "fits" if self.fits else "does not fit"
        lines = [f"{self.model.name} on {self.cluster}: {self.degrees}, {self.degrees.m} "
                 f"micro-batch(es) of {self.model.micro_batch}",
                 f"  memory per device (GiB): {mem}; total {self.memory['total'] / GiB:.2f} of "
                 f"{self.budget / GiB:.1f} usable: {verdict}",
                 f"  sent per device per step: {sent}",
                 f"  seconds per step (rough): compute {self.seconds['compute']:.3g}, bubble "
                 f"{self.seconds['bubble']:.3g}, communication {self.seconds['comm']:.3g}"]
        lines += [f"  why: {self.why}"] if self.why else []
        lines += [f"  note: {w}" for w in self.warnings]
        return "\n".join(lines)


def _check_layout(model: Model, cluster: Cluster, d: Degrees) -> None:
    """PlanError unless ``d`` places every device and splits the model evenly."""
    if d.world != cluster.devices:
        raise PlanError(f"dp*tp*pp*cp = {d.dp}*{d.tp}*{d.pp}*{d.cp} = {d.world}, but the "
                        f"cluster has {cluster.devices} devices: every device needs one place "
                        f"in the layout. {_factorizations(cluster.devices, d)}")
    if model.layers % d.pp:
        raise PlanError(f"{model.layers} layers do not split into pp={d.pp} equal stages: use "
                        f"a pp that divides {model.layers}, e.g. "
                        f"{', '.join(map(str, _factors(model.layers)[:6]))}")
    for what, count in (("heads", model.heads), ("kv_heads", model.kv_heads),
                        ("ffn", model.ffn)):
        if count % d.tp:
            raise PlanError(f"{what}={count} does not split over tp={d.tp}: each TP rank takes "
                            f"whole heads and an equal slice of the MLP; use a tp that divides "
                            f"{count}, e.g. {', '.join(map(str, _factors(count)[:6]))}")
    if d.cp > 1 and model.seq_len % (2 * d.cp):
        raise PlanError(f"seq_len={model.seq_len} does not split into 2*cp={2 * d.cp} chunks: "
                        f"causal context parallelism gives each rank two chunks (zig-zag, one "
                        f"early and one late, so every rank does the same work); use a "
                        f"seq_len that is a multiple of {2 * d.cp}")
    if d.sp and d.tp > 1 and (model.seq_len // d.cp) % d.tp:
        raise PlanError(f"sequence parallelism splits each rank's {model.seq_len // d.cp} "
                        f"tokens over tp={d.tp}: use a seq_len/cp that is a multiple of {d.tp}, "
                        f"or Degrees(sp=False)")
    if d.ep > 1 and model.experts == 1:
        raise PlanError(f"ep={d.ep} but the model has no experts: expert parallelism splits a "
                        f"mixture of experts (Model(experts=..., expert_params=...)); use ep=1")
    if model.experts % d.ep:
        raise PlanError(f"experts={model.experts} do not split over ep={d.ep}: use an ep that "
                        f"divides {model.experts}")
    if d.dp % d.ep:
        raise PlanError(f"ep={d.ep} must divide dp={d.dp}: expert parallelism reuses the "
                        f"data-parallel ranks (each holds experts/ep of the experts)")


def _factorizations(devices: int, d: Degrees) -> str:
    """A suggestion for a layout with the right product, keeping what can be kept."""
    inner = d.tp * d.pp * d.cp
    if devices % inner == 0:
        return f"Keep tp={d.tp} pp={d.pp} cp={d.cp} and use dp={devices // inner}."
    options = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4):
            if devices % (tp * pp) == 0 and len(options) < 4:
                options.append(f"dp={devices // (tp * pp)} tp={tp} pp={pp}")
    return "For example " + "; ".join(options) + "."


def _why(model: Model, cluster: Cluster, d: Degrees, memory: dict) -> str:
    """What is too big and what would help, with the figures each remedy would give."""
    biggest = max(MEMORY_PARTS, key=lambda k: memory[k])
    head = (f"needs {_gib(memory['total'])} per device, {_gib(cluster.budget)} usable "
            f"({cluster.memory_gib:g} GiB less {cluster.headroom:.0%} headroom); the biggest "
            f"part is {biggest} ({_gib(memory[biggest])})")
    n = d.dp * d.cp
    state = sum(memory[k] for k in ("params", "grads", "optimizer", "buffers"))
    helps = []
    if biggest in ("params", "grads", "optimizer", "buffers"):
        if d.zero < 3 and n > 1:
            stages = [dataclasses.replace(d, zero=z) for z in range(d.zero + 1, 4)]
            figures = ", ".join(f"ZeRO-{z.zero} {_gib(sum(model_state_bytes(model, z).values()))}"
                                for z in stages)
            helps.append(f"shard over the dp*cp={n} ranks (model state now {_gib(state)}; "
                         f"{figures})")
        elif n == 1:
            helps.append("ZeRO has nothing to shard over with dp*cp=1: it needs data-parallel "
                         "ranks")
        helps.append(f"more tp or pp (the model state divides by tp*pp={d.tp * d.pp})")
    else:
        if not model.activation_checkpointing:
            ckpt = dataclasses.replace(model, activation_checkpointing=True)
            helps.append(f"activation checkpointing ({_gib(stage_activation_bytes(ckpt, d))})")
        if d.tp > 1 and not d.sp:
            helps.append("sequence parallelism (Degrees(sp=True) divides every activation by tp)")
        helps.append("more tp (with sequence parallelism it divides the activations)")
        helps.append("cp to split the sequence")
        if model.micro_batch > 1:
            helps.append(f"a smaller micro_batch (activations grow with it; now "
                         f"{model.micro_batch})")
        if not model.flash_attention:
            helps.append("flash attention (never stores the s x s scores)")
    return f"{head}. What would help: " + "; ".join(helps) + "."


def _warnings(model: Model, cluster: Cluster, d: Degrees) -> tuple:
    out = []
    if d.tp > cluster.devices_per_node:
        out.append(f"tp={d.tp} spans {d.tp // cluster.devices_per_node} nodes: its all-reduces "
                   f"in every layer go over the inter-node links (counted at "
                   f"{cluster.inter_GBps:g} GB/s); keep tp <= {cluster.devices_per_node}")
    if 1 < d.pp and d.m < d.pp:
        out.append(f"{d.m} micro-batch(es) for {d.pp} stages: the bubble is "
                   f"{(d.pp - 1) / (d.m + d.pp - 1):.0%} of the step; use at least pp, "
                   f"better 4*pp")
    return tuple(out)


def plan(model: Model, cluster: Cluster, degrees) -> Plan:
    """Memory, communication and a verdict for ``model`` on ``cluster`` laid out as ``degrees``.

    Raises :class:`PlanError` (saying what to change) for a layout that cannot run: the
    degrees' product is not the device count, pp does not divide the layers, tp does not divide
    the heads, cp does not divide the sequence, ep does not divide the experts or dp. A layout
    that runs but does not fit gets ``fits=False`` and a ``why``.

    Example (the 7B model of the module docstring: plain data parallelism, then ZeRO-1)::

        >>> plan(model, Cluster(8, 80), Degrees(dp=8)).fits
        False
        >>> p = plan(model, Cluster(8, 80), Degrees(dp=8, zero=1))
        >>> p.fits, round(p.memory["optimizer"] / 2**30, 2), round(p.comm["dp"] / 2**30, 1)
        (True, 9.36, 21.8)
    """
    degrees = as_degrees(degrees)
    _check_layout(model, cluster, degrees)
    memory = model_state_bytes(model, degrees)
    memory["activations"] = stage_activation_bytes(model, degrees)
    memory = {k: memory[k] for k in MEMORY_PARTS}
    memory["total"] = sum(memory.values())
    fits = memory["total"] <= cluster.budget
    comm = comm_bytes(model, degrees)
    comm["total"] = sum(comm.values())
    pp, m = degrees.pp, degrees.m
    return Plan(model, cluster, degrees, memory, cluster.budget, fits,
                "" if fits else _why(model, cluster, degrees, memory), comm,
                group_links(cluster, degrees), step_seconds(model, cluster, degrees, comm),
                (pp - 1) / (m + pp - 1), _warnings(model, cluster, degrees))


def layouts(model: Model, cluster: Cluster, *, zero=(0, 1, 2, 3), global_batch: int | None = None,
            max_tp: int | None = None):
    """Every valid :class:`Degrees` for ``model`` on ``cluster``: the candidates of :func:`suggest`.

    tp up to ``max_tp`` (the node size unless given) dividing the heads; pp dividing the layers;
    cp with ``seq_len`` a multiple of ``2*cp``; ep dividing the experts and dp; each ZeRO stage
    in ``zero`` (only the first where ``dp*cp = 1``: ZeRO has nothing to shard there).
    ``global_batch`` sequences per step (default ``devices * micro_batch``) fix the
    micro-batches, ``global_batch / (dp * micro_batch)``; layouts that do not divide it are
    skipped.
    """
    max_tp = max_tp or cluster.devices_per_node
    batch = global_batch or cluster.devices * model.micro_batch
    for tp in _factors(cluster.devices):
        for pp in _factors(cluster.devices // tp):
            for cp in _factors(cluster.devices // (tp * pp)):
                dp = cluster.devices // (tp * pp * cp)
                if tp > max_tp or batch % (dp * model.micro_batch):
                    continue
                # With dp*cp = 1 there is nothing to shard: one ZeRO stage stands for all.
                stages = zero if dp * cp > 1 else tuple(zero)[:1]
                for ep in _factors(math.gcd(dp, model.experts)):
                    for z in stages:
                        d = Degrees(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=z,
                                    microbatches=batch // (dp * model.micro_batch))
                        try:
                            _check_layout(model, cluster, d)
                        except PlanError:
                            continue
                        yield d


def suggest(model: Model, cluster: Cluster, top: int = 5, zero=(0, 1, 2, 3), *,
            global_batch: int | None = None, max_tp: int | None = None) -> list[Plan]:
    """The ``top`` layouts that fit, best first; :class:`PlanError` "fits nowhere" if none does.

    Candidates come from :func:`layouts`. They are ranked by ``seconds["overhead"]``, the
    communication (not overlapped) plus the pipeline bubble: the compute is the same for every
    layout of one model and batch, so what tells them apart is what each adds to it. Ties go to
    the smaller memory. An estimate for choosing, not a promise: measure the best few.

    Example (the 7B model of the module docstring)::

        >>> [str(p.degrees) for p in suggest(model, Cluster(8, 80), top=2)]
        ['dp=4 tp=2 pp=1 cp=1 ep=1 zero=1', 'dp=4 tp=2 pp=1 cp=1 ep=1 zero=0']
    """
    plans = [plan(model, cluster, d) for d in layouts(model, cluster, zero=zero,
                                                       global_batch=global_batch, max_tp=max_tp)]
    if not plans:
        raise PlanError(f"no layout of {cluster.devices} devices splits {model.name} evenly "
                        f"(heads={model.heads}, layers={model.layers}, seq_len="
                        f"{model.seq_len}): use a device count or model shape with more "
                        f"divisors (powers of two), or pass global_batch")
    fitting = [p for p in plans if p.fits]
    if not fitting:
        least = min(plans, key=lambda p: p.memory["total"])
        more = ("" if model.activation_checkpointing else
                ", turn on activation checkpointing (Model(activation_checkpointing=True))")
        raise PlanError(f"{model.name} fits nowhere on {cluster}: the smallest layout found "
                        f"({least.degrees}) needs {_gib(least.memory['total'])} per device, "
                        f"{_gib(cluster.budget)} usable. Use more devices, bigger ones{more}, "
                        f"or a smaller micro_batch / seq_len.")
    fitting.sort(key=lambda p: (p.seconds["overhead"], p.memory["total"]))
    return fitting[:top]


def predicted_vs_measured(p: Plan, measured: Mapping) -> list[dict]:
    """Rows ``{what, predicted, measured, ratio}`` for a plan beside what a run measured.

    ``measured`` maps names to bytes: memory parts (``params``, ``grads``, ``optimizer``,
    ``activations``, ``buffers``) per device, or dimensions (``dp``, ``tp``, ``pp``, ``cp``,
    ``ep``) for the bytes one device sent in one step.

    Example (DDP of ``block_stack(4, 64)`` in fp32 on 2 ranks: ``step_traffic`` measured 529408)::

        >>> predicted_vs_measured(plan(small, Cluster(2, 80), Degrees(dp=2)), {"dp": 529408})
        [{'what': 'dp bytes sent', 'predicted': 529408.0, 'measured': 529408, 'ratio': 1.0}]
    """
    rows = []
    for key, value in measured.items():
        if key in MEMORY_PARTS:
            what, predicted = f"{key} bytes held", p.memory[key]
        elif key in DIMENSIONS:
            what, predicted = f"{key} bytes sent", p.comm[key]
        else:
            raise PlanError(f"unknown measurement {key!r}: use {', '.join(MEMORY_PARTS)} "
                            f"(bytes held) or {', '.join(DIMENSIONS)} (bytes sent per step)")
        rows.append({"what": what, "predicted": predicted, "measured": value,
                     "ratio": value / predicted if predicted else math.nan})
    return rows


# ---- measured: the bytes a real step sends (a worker function) --------------------------------


def step_traffic(model_fn, *, wrap: str = "ddp", batch: int = 8, seed: int = 0) -> dict:
    """Worker function: the bytes this rank sends in one training step under DDP or FSDP2.

    ``model_fn()`` builds the model (e.g. ``functools.partial(block_stack, 4, 64)``); ``wrap``
    is ``"ddp"`` (``DistributedDataParallel``) or ``"fsdp"`` (``fully_shard`` on every child
    with parameters, then the root). One forward, backward and Adam step on a random batch
    runs inside :func:`labkit.parallel.traffic.count_traffic`. Returns ``n_params``,
    ``world_size``, ``sent_bytes`` and the ``counts`` and ``by_op`` of the calls: what
    ``plan(...).comm["dp"]`` predicts for ``zero=0`` and ``zero=3``.

    Example::

        >>> r = labkit.launch(step_traffic, partial(block_stack, 4, 64), nproc=2).values[0]
        >>> r["counts"], r["sent_bytes"]
        ({'all_reduce': 1}, 529408)
    """
    import torch
    import torch.distributed as dist

    from ._dist import collective_device
    from .parallel.traffic import count_traffic

    if wrap not in ("ddp", "fsdp"):
        raise PlanError(f"wrap={wrap!r}: use 'ddp' (DistributedDataParallel) or 'fsdp' "
                        f"(FSDP2's fully_shard)")
    device = collective_device()
    torch.manual_seed(seed)
    model = model_fn().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    x = torch.randn(batch, first.in_features, device=device)
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.children():
            if any(True for _ in layer.parameters()):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # DDP broadcast the weights when it wrapped the model: outside the block, not a step's bytes.
    with count_traffic() as t:
        model(x).square().mean().backward()
        opt.step()
    return {"wrap": wrap, "n_params": n_params, "world_size": dist.get_world_size(),
            "sent_bytes": t.sent_bytes(), "counts": t.counts(), "by_op": t.by_op()}


# ---- published runs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Published:
    """A published training run: its model, its cluster, its layout, where the figures come from."""

    model: Model
    cluster: Cluster
    degrees: Degrees
    source: str
    notes: str = ""

    def plan(self) -> Plan:
        return plan(self.model, self.cluster, self.degrees)


_A100 = {"memory_gib": 80, "devices_per_node": 8, "intra_GBps": 300.0, "inter_GBps": 25.0,
         "tflops": 150.0}  # DGX A100: NVLink 3 (600 GB/s both ways), 8 x 200 Gb/s HDR per node
_H100 = {"memory_gib": 80, "devices_per_node": 8, "intra_GBps": 450.0, "inter_GBps": 50.0,
         "tflops": 400.0}  # NVLink 4 (900 GB/s both ways), 400 Gb/s per GPU

PUBLISHED = {
    "gpt3-175b": Published(
        Model("GPT-3 175B", params=175e9, layers=96, hidden=12288, heads=96, seq_len=2048,
              micro_batch=1, vocab=51200, activation_checkpointing=True),
        Cluster(1536, name="1536 A100 80GB", **_A100),
        Degrees(dp=24, tp=8, pp=8, zero=0, microbatches=64, sp=False),
        "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters "
        "Using Megatron-LM' (SC21), Table 1: 96 layers, hidden 12288, 96 heads, t=8, p=8, 1536 "
        "A100 80GB GPUs, batch 1536 sequences of 2048 tokens, vocabulary 51200.",
        "Assumed, not from the table: micro-batch 1 (so 64 micro-batches per replica) and full "
        "activation recomputation, which the paper uses to fit its largest models: without it "
        "this plan needs about 92 GiB. 2021 Megatron had neither sequence parallelism nor a "
        "distributed optimizer (sp=False, zero=0). The paper's interleaved schedule is not "
        "modelled (it holds a little more in flight)."),
    "megatron-1t": Published(
        Model("Megatron 1T", params=1008e9, layers=128, hidden=25600, heads=160, seq_len=2048,
              micro_batch=1, vocab=51200, activation_checkpointing=True),
        Cluster(3072, name="3072 A100 80GB", **_A100),
        Degrees(dp=6, tp=8, pp=64, zero=0, microbatches=512, sp=False),
        "Narayanan et al. 2021 (SC21), Table 1, the largest row: 1008B parameters, 128 layers, "
        "hidden 25600, 160 heads, t=8, p=64, 3072 A100 80GB GPUs (502 PFLOP/s, the abstract), "
        "batch 3072 sequences of 2048 tokens.",
        "Assumed as for GPT-3: micro-batch 1 (512 micro-batches per replica) and full activation "
        "recomputation."),
    "llama3-405b": Published(
        Model("Llama 3 405B", params=405e9, layers=128, hidden=16384, heads=128, kv_heads=8,
              ffn=53248, seq_len=8192, micro_batch=1, vocab=128256, flash_attention=True,
              dropout=False),
        Cluster(16384, name="16384 H100 80GB", **_H100),
        Degrees(dp=128, tp=8, pp=16, cp=1, zero=3, microbatches=16),
        "Dubey et al. 2024, 'The Llama 3 Herd of Models', the 405B pre-training layout: 126 "
        "layers, hidden 16384, FFN 53248, 128 heads with 8 key/value heads, sequence 8192, "
        "TP 8, CP 1, PP 16, DP 128 on 16384 H100 80GB GPUs, 16M tokens per batch (16 sequences "
        "per data-parallel rank); its data parallelism is FSDP, sharding parameters, gradients "
        "and optimizer state (zero=3 here).",
        "layers=128: the real run has 126 layers and gives the first and last stages one layer "
        "fewer (they also hold the embedding and the output layer); the planner splits 128 "
        "slots evenly, 8 per stage. Assumed: micro-batch 1. The activation formula is GPT's: it "
        "counts SwiGLU's ffn-wide tensors as a GELU MLP's two (gated_mlp=True counts four, and "
        "then stage 0 needs about 79 GiB: the real run's fused kernels, its lighter first "
        "stage and whatever recomputation it used are not modelled). The paper orders its "
        "groups [TP, CP, PP, DP], not Megatron's, and uses an interleaved schedule."),
}


# ---- the explorer ------------------------------------------------------------------------------


def planner_explorer(model: Model | None = None, cluster: Cluster | None = None):
    """Sliders for a layout of ``model`` on ``cluster`` (or a published run), and its plan, live.

    A preset menu (your model and cluster, if given, then :data:`PUBLISHED`), sliders for tp,
    pp, cp and ep (dp takes the devices left), the ZeRO stage, the micro-batch and the number of
    micro-batches, and switches for activation checkpointing and sequence parallelism. Every
    change redraws ``plots.planner_plot``: the memory per device as a stacked bar against the
    usable memory, and the bytes sent per dimension; below it the verdict and ``why``. The
    returned VBox has ``update()`` (redraw now) and ``plan()`` (the current Plan, or None when
    the layout is refused).

    Example::

        >>> planner_explorer()                              # the published runs
        >>> box = planner_explorer(my_model, Cluster(8, 80)); box.plan()
    """
    import io

    import ipywidgets as widgets
    from matplotlib import pyplot as plt

    from . import plots

    presets = {}
    if model is not None:
        start = cluster or Cluster(8, 80)
        presets["yours"] = (model, start, Degrees(dp=start.devices))
    presets.update({k: (v.model, v.cluster, v.degrees) for k, v in PUBLISHED.items()})
    style = {"description_width": "initial"}
    menu = widgets.Dropdown(options=list(presets), description="preset", style=style)
    sliders = {k: widgets.SelectionSlider(options=[1], description=k, style=style,
                                          continuous_update=False)
               for k in ("tp", "pp", "cp", "ep")}
    zero = widgets.ToggleButtons(options=[0, 1, 2, 3], description="ZeRO", style=style)
    micro = widgets.IntSlider(1, min=1, max=16, description="micro_batch", style=style,
                              continuous_update=False)
    chunks = widgets.IntSlider(1, min=1, max=512, description="micro-batches", style=style,
                               continuous_update=False)
    ckpt = widgets.Checkbox(description="activation checkpointing")
    sp = widgets.Checkbox(value=True, description="sequence parallelism")
    picture, text = widgets.Image(format="png"), widgets.HTML()
    state = {"plan": None, "busy": False}

    def current():
        base, cl, _ = presets[menu.value]
        m = dataclasses.replace(base, micro_batch=micro.value,
                                activation_checkpointing=ckpt.value)
        inner = sliders["tp"].value * sliders["pp"].value * sliders["cp"].value
        d = Degrees(dp=max(1, cl.devices // inner), zero=zero.value, microbatches=chunks.value,
                    sp=sp.value, **{k: s.value for k, s in sliders.items()})
        return m, cl, d

    def update(_change=None):
        if state["busy"]:
            return
        try:
            p = plan(*current())
        except PlanError as refused:
            state["plan"] = None
            text.value = f"<b>refused:</b> {refused}"
            return
        state["plan"] = p
        fig = plots.planner_plot([p.row(f"{p.degrees}")])
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)  # shown through the picture widget, not by pyplot as well
        picture.value = buffer.getvalue()
        lines = str(p).replace("&", "&amp;").replace("<", "&lt;").splitlines()
        text.value = "<pre>" + "\n".join(lines) + "</pre>"

    def load(_change=None):
        m, cl, d = presets[menu.value]
        state["busy"] = True  # one redraw for the whole preset, not one per control
        for k, s in sliders.items():
            s.options = _factors(cl.devices)
            s.value = getattr(d, k)
        zero.value, micro.value, chunks.value = d.zero, m.micro_batch, d.m
        ckpt.value, sp.value = m.activation_checkpointing, d.sp
        state["busy"] = False
        update()

    menu.observe(load, names="value")
    for control in (*sliders.values(), zero, micro, chunks, ckpt, sp):
        control.observe(update, names="value")
    load()
    box = widgets.VBox([menu, widgets.HBox([widgets.VBox(list(sliders.values())),
                                            widgets.VBox([zero, micro, chunks, ckpt, sp])]),
                        picture, text])
    box.update = update
    box.plan = lambda: state["plan"]
    box.controls = {"preset": menu, **sliders, "zero": zero, "micro_batch": micro,
                    "microbatches": chunks, "checkpointing": ckpt, "sp": sp}
    return box

"""The three descriptions a plan starts from: the :class:`Model`, the :class:`Cluster`, the
:class:`Degrees` of a layout; each checks itself and says what to change."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass

from .._sizes import whole

__all__ = ["PlanError", "Model", "Cluster", "Degrees", "as_degrees", "MIXED_ADAM", "FP32_ADAM",
           "ADAM_BYTES", "adam_bytes", "DIMENSIONS", "MEMORY_PARTS", "GiB", "factors", "gib"]

GiB = 2**30
DIMENSIONS = ("dp", "tp", "pp", "cp", "ep")
MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "buffers")
# Bytes per parameter (ZeRO paper, section 3.1): mixed-precision Adam keeps bf16/fp16 weights
# and gradients (2 + 2) and an fp32 master copy, momentum and variance (12); plain fp32 Adam
# keeps fp32 weights and gradients (4 + 4) and momentum and variance (8).
MIXED_ADAM = {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12, "act_bytes": 2}
FP32_ADAM = {"param_bytes": 4, "grad_bytes": 4, "optimizer_bytes": 8, "act_bytes": 4}
# The conventions in use for mixed-precision Adam, by their bytes per parameter. Megatron-LM's
# distributed-optimizer table (docs/source/api-guide/dist_optimizer.md) has 20 for fp16
# parameters and gradients (2 + 2, plus fp32 main gradients 4, main parameters 4 and Adam's 8:
# its optimizer part, 16, is what the distributed optimizer shards, "4 + 16/d"), 18 for bf16
# parameters with fp32 gradients (2 + 4 + 12, "6 + 12/d"), and 16 for fp32 parameters and
# gradients (4 + 4 + 8, "8 + 8/d"); the ZeRO paper's 16 is 2 + 2 + 12 (fp16 gradients, no fp32
# copy of them).
ADAM_BYTES = {16: MIXED_ADAM,
              18: {"param_bytes": 2, "grad_bytes": 4, "optimizer_bytes": 12, "act_bytes": 2},
              20: {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 16, "act_bytes": 2}}


def adam_bytes(per_param: int) -> dict:
    """The Model fields of a bytes-per-parameter convention: 16, 18 or 20 (see ``ADAM_BYTES``).

    Example (bf16 weights, fp32 gradients, Megatron's default with a distributed optimizer)::

        >>> Model("7B", params=7e9, layers=32, hidden=4096, heads=32, seq_len=4096,
        ...       micro_batch=1, **adam_bytes(18)).grad_bytes
        4
    """
    if per_param not in ADAM_BYTES:
        raise PlanError(f"bytes per parameter is one of {sorted(ADAM_BYTES)} (16: ZeRO's 2 + 2 "
                        f"+ 12; 18: bf16 weights with fp32 gradients; 20: fp16 weights and "
                        f"gradients with fp32 main gradients), got {per_param!r}")
    return dict(ADAM_BYTES[per_param])


class PlanError(ValueError):
    """A description or a layout the planner cannot use; the message says what to change."""


def _whole(value, name: str) -> int:
    return whole(value, name, error=PlanError)


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(f"{name} must be a number > 0, got {value!r}")
    return value


def factors(n: int) -> list[int]:
    """Every divisor of ``n``, smallest first."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def gib(nbytes: float) -> str:
    """Bytes as the GiB a message prints: ``'42.8 GiB'``."""
    return f"{nbytes / GiB:.1f} GiB"


# ---- the three descriptions ----------------------------------------------------------------------
# Fields are keyword-only, each with a line of documentation under it (torchtitan's job_config
# dataclasses do the same): Model(params=..., layers=...) reads where seven positional numbers
# would not, and a misplaced one cannot go unnoticed.


@dataclass(frozen=True)
class Model:
    """A transformer to train: its size, its shapes, and the bytes each number takes.

    Bytes per parameter default to mixed-precision Adam (``MIXED_ADAM``: 2 + 2 + 12); fp32
    Adam is ``Model(..., **FP32_ADAM)`` (4 + 4 + 8, activations in fp32). Pass a real module's
    parameter count with :meth:`from_module` to describe a small model exactly.

    Example::

        >>> Model("tiny", params=1.3e9, layers=24, hidden=2048, heads=16, seq_len=2048,
        ...       micro_batch=4).ffn
        8192
    """

    name: str
    """A label for tables and messages."""
    _: KW_ONLY
    params: float
    """Every parameter, experts and embeddings included (exact: ``from_module`` counts them)."""
    layers: int
    """Transformer layers; the pipeline splits them into ``pp`` equal stages."""
    hidden: int
    """The hidden size ``h``: the width of every activation between layers."""
    heads: int
    """Attention heads; tensor parallelism gives each rank whole heads."""
    seq_len: int
    """Tokens per sequence ``s``."""
    micro_batch: int
    """Sequences per micro-batch ``b`` on one device."""
    vocab: int | None = None
    """The vocabulary, for the record only (``params`` already counts the embedding)."""
    ffn: int | None = None
    """The MLP's width; ``4 * hidden`` unless given."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``heads`` unless given."""
    experts: int = 1
    """Experts per MoE layer; 1 for a dense model (every layer is an MoE layer when > 1)."""
    top_k: int = 1
    """Experts each token is routed to."""
    expert_params: float = 0
    """The part of ``params`` in the experts, all of them together; 0 for a dense model."""
    param_bytes: float = 2
    """Bytes per parameter as computed with (bf16: 2)."""
    grad_bytes: float = 2
    """Bytes per gradient element."""
    optimizer_bytes: float = 12
    """Optimizer bytes per parameter (Adam with fp32 master weights: 4 + 4 + 4)."""
    act_bytes: float = 2
    """Bytes of one activation element."""
    activation_checkpointing: bool = False
    """Keep only each layer's input for backward, and run the forward again."""
    flash_attention: bool = False
    """Never store the ``s x s`` attention scores."""
    dropout: bool = True
    """Dropout stores its 1-byte masks."""
    gated_mlp: bool = False
    """A SwiGLU MLP: four ffn-wide tensors saved, not two."""
    selective_recompute: bool = False
    """Megatron's selective recomputation: the attention scores (softmax, its dropout) are not
    kept but recomputed in backward; ignored under full ``activation_checkpointing``."""
    attention_dropout: bool | None = None
    """Dropout on the attention probabilities (its mask and the dropped-out copy are kept);
    ``dropout`` unless given."""
    small_terms: bool = False
    """Count the small tensors too: each LayerNorm's mean and 1/std (fp32) and, without flash
    attention, the causal mask (``s x s`` booleans), as notebook 09's block keeps them."""

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

            >>> Model.from_module(mlp_blocks(4, 64), layers=4, hidden=64, heads=1, seq_len=1,
            ...                   micro_batch=8, **FP32_ADAM).params
            132352
        """
        n = sum(p.numel() for p in module.parameters())  # works on any torch module
        return cls(name or type(module).__name__, params=n, **fields)

    @property
    def active_params(self) -> float:
        """Parameters one token goes through: the dense ones and top_k of the experts."""
        return self.params - self.expert_params + self.expert_params * self.top_k / self.experts


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The devices: how many, their memory, how they are linked, how fast they compute.

    ``budget`` is the memory less the ``headroom`` kept for what the planner does not count:
    communication buckets, the allocator's fragmentation, the CUDA context, temporary tensors.

    Example::

        >>> Cluster(devices=16, memory_gib=40).budget / 2**30
        36.0
    """

    devices: int
    """Devices in all; a multiple of ``devices_per_node`` when it spans nodes."""
    memory_gib: float
    """Memory per device, in GiB."""
    devices_per_node: int = 8
    """Devices that share a node's fast links (NVLink)."""
    intra_GBps: float = 150.0
    """Bytes per second (GB/s, 1e9) one device sends inside its node."""
    inter_GBps: float = 25.0
    """Bytes per second (GB/s) one device sends to another node: its share of the network."""
    tflops: float = 150.0
    """The dense matmul rate one device achieves (about half its peak), for the time estimates."""
    latency_us: float = 10.0
    """Microseconds each message or ring step costs before its bytes flow (NCCL's few
    microseconds inside a node to tens across nodes)."""
    headroom: float = 0.10
    """The fraction of memory kept free for what the planner does not count."""
    name: str = ""
    """A label for tables; ``'8 x 80 GiB (8 per node)'`` unless given."""

    def __post_init__(self):
        _whole(self.devices, "devices")
        _whole(self.devices_per_node, "devices_per_node")
        for name in ("memory_gib", "intra_GBps", "inter_GBps", "tflops"):
            _positive(getattr(self, name), name)
        if isinstance(self.latency_us, bool) or not isinstance(self.latency_us, (int, float)) \
                or self.latency_us < 0:
            raise PlanError(f"latency_us is the microseconds per message, >= 0, got "
                            f"{self.latency_us!r}")
        if not 0 <= self.headroom < 1:
            raise PlanError(f"headroom is the fraction of memory kept free, from 0 to below 1 "
                            f"(0.1 keeps 10 %), got {self.headroom!r}")
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise PlanError(f"{self.devices} devices do not fill nodes of "
                            f"{self.devices_per_node}: use a multiple of {self.devices_per_node} "
                            f"or set devices_per_node")

    @classmethod
    def from_card(cls, card, devices: int, dtype: str = "fp32") -> Cluster:
        """This machine as the planner sees it, from notebook 00's machine card.

        ``card`` is a ``labkit.machine.MachineCard`` (only its fields are read: the planner
        stays free of torch). ``devices`` workers on one node: on a CPU they share the RAM,
        so each gets ``memory_GiB / devices``; a GPU's memory is its own. ``tflops`` is the
        matmul rate measured for ``dtype``, a rate this machine reached, not a data sheet's.
        One worker measured it alone with ``cores`` threads; CPU workers that together run
        more threads than the machine's ``cpus`` share them, so each gets that fraction of it.
        The all-reduce's fit over ``p = allreduce_ranks`` workers gives the link: a ring
        all-reduce of ``n`` bytes sends ``2(p-1)/p * n`` from each worker, so each sends at
        ``2(p-1)/p`` times the fitted algbw, and its latency ``alpha`` is paid over
        ``2(p-1)`` ring steps.

        Example::

            >>> here = Cluster.from_card(labkit.machine.load_card(), devices=4)
        """
        if getattr(card, "allreduce_ranks", None) is None or card.alpha_s is None:
            raise PlanError("the machine card has no all-reduce fit: run notebook 00's "
                            "all-reduce sweep with 2 or more workers, then its machine-card "
                            "cell, and load the card again")
        if dtype not in card.peak_flops:
            raise PlanError(f"the machine card has no {dtype} matmul peak (it has "
                            f"{', '.join(card.peak_flops)}): pass dtype= one of those")
        _whole(devices, "devices")
        p = card.allreduce_ranks
        per_rank_GBps = card.beta_GBps * 2 * (p - 1) / p
        cpu = card.device == "cpu"
        memory = card.memory_GiB / devices if cpu else card.memory_GiB
        share = min(1.0, card.cpus / (devices * card.cores)) if cpu else 1.0
        return cls(devices=devices, memory_gib=memory, devices_per_node=devices,
                   intra_GBps=per_rank_GBps, inter_GBps=per_rank_GBps,
                   tflops=card.peak_flops[dtype] * share / 1e12,
                   latency_us=card.alpha_s / (2 * (p - 1)) * 1e6,
                   name=f"this machine: {devices} x {card.model[:40]} ({card.device})")

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


@dataclass(frozen=True, kw_only=True)
class Degrees:
    """A layout: how many ways each parallelism splits the run, the ZeRO stage, the micro-batches.

    ``dp * tp * pp * cp`` must be the number of devices; ``ep`` reuses the data-parallel ranks.

    Example::

        >>> Degrees(dp=4, tp=2).world
        8
    """

    dp: int = 1
    """Data-parallel replicas (each a full copy of the model's layout)."""
    tp: int = 1
    """Tensor-parallel ranks: each holds 1/tp of every layer's matrices."""
    pp: int = 1
    """Pipeline stages: each holds layers/pp of the layers."""
    cp: int = 1
    """Context-parallel ranks: each holds seq_len/cp of every sequence (ring attention)."""
    ep: int = 1
    """Expert-parallel ranks, taken from the data-parallel ones (ep divides dp)."""
    zero: int = 0
    """The ZeRO stage, 0-3, sharding over the dp * cp ranks that hold the same weights."""
    microbatches: int | None = None
    """Micro-batches per replica per step; ``None``: pp, the fewest that keep every stage busy."""
    sp: bool = True
    """Megatron's sequence parallelism when tp > 1: norms and dropouts on 1/tp of the sequence,
    every activation divided by tp (the column-parallel inputs all-gathered again in backward)."""
    chunks: int = 1
    """Model chunks per pipeline rank: ``v > 1`` is the interleaved 1F1B schedule."""
    stage_layers: tuple | None = None
    """Layers on each pipeline stage, first to last, when they differ (Llama 3 gives its first
    and last stages one layer fewer); ``None``: ``layers / pp`` each."""
    keep_gathered: bool = False
    """With zero=3: a stage's parameters, once gathered, stay gathered through the step (FSDP's
    ``reshard_after_forward=False``, kept over the micro-batches); gradients and optimizer
    state stay sharded."""
    pp_scatter_gather: bool = False
    """Megatron's scatter/gather of pipeline sends without sequence parallelism: each TP rank
    sends 1/tp of the activation, the receiver all-gathers it inside its node."""
    overlap: bool = True
    """Communication overlapped where the frameworks overlap it: data-parallel gradients with
    backward, ZeRO-3's gathers with compute (prefetch), tensor-parallel collectives with the
    GEMMs when sequence-parallel (Megatron's ``--tp-comm-overlap``), ring attention's K/V
    passes with each block's attention. ``False``: every byte on the critical path."""

    def __post_init__(self):
        for name in DIMENSIONS + ("chunks",):
            _whole(getattr(self, name), name)
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise PlanError(f"zero is the ZeRO stage, 0 (none), 1, 2 or 3, got {self.zero!r}")
        if self.microbatches is not None:
            _whole(self.microbatches, "microbatches")
        if self.keep_gathered and self.zero != 3:
            raise PlanError(f"keep_gathered keeps ZeRO-3's gathered parameters through the step: "
                            f"it needs zero=3, got zero={self.zero}")
        if self.stage_layers is not None:
            layers = tuple(self.stage_layers)
            for n in layers:
                _whole(n, "stage_layers[i]")
            if len(layers) != self.pp:
                raise PlanError(f"stage_layers gives {len(layers)} stages but pp={self.pp}: one "
                                f"count per pipeline stage")
            object.__setattr__(self, "stage_layers", layers)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def m(self) -> int:
        """Micro-batches per step per data-parallel replica."""
        return self.microbatches or self.pp

    def __str__(self) -> str:
        text = " ".join(f"{k}={getattr(self, k)}" for k in DIMENSIONS) + f" zero={self.zero}"
        text += " (kept gathered)" if self.keep_gathered else ""
        text += f" v={self.chunks}" if self.chunks > 1 else ""
        return text + ("" if self.tp == 1 or self.sp else " (no sp)")


def as_degrees(value) -> Degrees:
    """A :class:`Degrees` from a Degrees or a dict such as ``{"dp": 4, "tp": 2, "zero": 1}``."""
    if isinstance(value, Degrees):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {f.name for f in dataclasses.fields(Degrees)}
        if unknown:
            raise PlanError(f"unknown keys {sorted(unknown)}: a layout has dp, tp, pp, cp, ep, "
                            f"zero, microbatches, sp, chunks, stage_layers, keep_gathered, "
                            f"pp_scatter_gather and overlap")
        return Degrees(**value)
    raise PlanError(f"a layout is a Degrees(dp=..., tp=..., ...) or a dict with those keys, "
                    f"not {type(value).__name__}")

"""Plan a training run before launching it: bytes per device, bytes on the wire, does it fit.

A run is three descriptions and one verdict::

    model = Model("7B", params=6.7e9, layers=32, hidden=4096, heads=32, seq_len=2048,
                  micro_batch=1, flash_attention=True)
    cluster = Cluster(devices=8, memory_gib=80)
    p = plan(model, cluster, Degrees(dp=8, zero=1))
    p.fits, p.memory["total"] / 2**30, p.why          # (True, 42.8, '')

The planner is arithmetic: it imports no framework and runs no rank, so it can describe a
16 384-GPU run as easily as the 2-rank runs of this course, whose measured bytes it predicts
(``labkit.parallel.traffic.step_traffic`` measures DDP's and FSDP2's on real ranks;
``tests/test_planner.py`` compares the two).

Its rooms, one concern each: ``describe`` (the :class:`Model`, :class:`Cluster` and
:class:`Degrees` a plan starts from), ``memory`` (the bytes a device holds), ``communication``
(the bytes it sends, over which link, and the rough seconds), ``search`` (one layout's
:class:`Plan`, every valid layout, the best few) and ``published`` (real runs described). The
interactive explorer is :func:`labkit.explorers.planner_explorer`.

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

- **Bytes per parameter**: mixed-precision Adam is 16 (ZeRO's 2 + 2 + 12, the default), 18
  (bf16 weights, fp32 gradients) or 20 (fp16 weights and gradients, fp32 main gradients):
  ``Model(..., **adam_bytes(18))``.
- **Overlap**: ``Plan.seconds["transfer"]`` adds every byte up (with ``latency_us`` per ring
  step), an upper bound; ``seconds["comm"]`` keeps what does not hide behind compute (see
  :func:`step_seconds`), and that is what :func:`suggest` ranks by.

Left out, on purpose: the embedding and output layers (their parameters are in ``params``,
their activations are not), communication buffers other than ZeRO-3's gathered layers, and
how fast kernels run on the pieces a layout leaves.
"""

from __future__ import annotations

from .communication import (
    allreduce_bytes,
    comm_bytes,
    cp_hop_seconds,
    gather_bytes,
    group_links,
    step_seconds,
)
from .describe import (
    ADAM_BYTES,
    DIMENSIONS,
    FP32_ADAM,
    MEMORY_PARTS,
    MIXED_ADAM,
    Cluster,
    Degrees,
    Model,
    PlanError,
    adam_bytes,
    as_degrees,
)
from .memory import in_flight, layer_activation_bytes, model_state_bytes, stage_activation_bytes
from .published import PUBLISHED, Published
from .search import Plan, layouts, plan, predicted_vs_measured, suggest

__all__ = ["PlanError", "Model", "Cluster", "Degrees", "Plan", "Published", "PUBLISHED",
           "MIXED_ADAM", "FP32_ADAM", "ADAM_BYTES", "adam_bytes", "in_flight", "cp_hop_seconds",
           "DIMENSIONS", "MEMORY_PARTS", "allreduce_bytes",
           "gather_bytes", "as_degrees", "model_state_bytes", "layer_activation_bytes",
           "stage_activation_bytes", "comm_bytes", "group_links", "step_seconds", "plan",
           "suggest", "layouts", "predicted_vs_measured"]

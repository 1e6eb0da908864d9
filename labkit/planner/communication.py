"""The model of communication: the bytes one device sends per optimizer step under a layout,
the link each group's bytes take, and the rough seconds they cost."""

from __future__ import annotations

from .describe import DIMENSIONS, Cluster, Degrees, Model
from .memory import local_params

__all__ = ["allreduce_bytes", "gather_bytes", "comm_bytes", "group_links", "step_seconds"]


# ---- ring conventions (labkit.parallel.traffic's) ----------------------------------------------


def allreduce_bytes(payload: float, n: int) -> float:
    """Bytes one of ``n`` ranks sends in a ring all-reduce of ``payload`` bytes: ``2(n-1)/n*S``."""
    return 2 * (n - 1) / n * payload


def gather_bytes(payload: float, n: int) -> float:
    """Bytes one of ``n`` ranks sends in a ring all-gather (output ``S``) or reduce-scatter
    (input ``S``): ``(n-1)/n * S``."""
    return (n - 1) / n * payload


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

        >>> m = Model("m", params=1e6, layers=2, hidden=64, heads=1, seq_len=1, micro_batch=1,
        ...           **FP32_ADAM)
        >>> comm_bytes(m, Degrees(dp=2))["dp"]
        4000000.0
    """
    d = degrees
    # Each device holds the dense parameters split by tp*pp, the experts by ep*tp*pp as well.
    dense, expert = local_params(model, d)
    # n: the ranks that hold the same weights, and so exchange their gradients.
    n = d.dp * d.cp
    # A: bytes of one micro-batch's activation on this device, (s/cp) * b * h elements: the
    # tensor that tensor parallelism all-reduces and a pipeline stage passes on.
    A = model.seq_len / d.cp * model.micro_batch * model.hidden * model.act_bytes
    # With sequence parallelism each TP rank holds (and sends) 1/tp of that activation.
    shard = A / d.tp if d.sp and d.tp > 1 else A
    # L: this stage's layers; m: micro-batches per step per replica.
    L, m = model.layers / d.pp, d.m
    # r: the activation collectives of one layer: 2 forward, 2 backward, 2 more when
    # activation checkpointing runs the forward again.
    r = 6 if model.activation_checkpointing else 4

    def dp_bytes(params: float, ranks: float) -> float:
        if ranks <= 1:
            return 0.0  # a replica of one has nobody to exchange gradients with
        # P: the bytes of this device's parameters, G: of its gradients (once per micro-batch).
        P, G = params * model.param_bytes, params * model.grad_bytes
        if d.zero == 0:  # DDP: gradients accumulate locally, one all-reduce per step
            return allreduce_bytes(G, ranks)
        if d.zero in (1, 2):  # reduce-scatter G (ZeRO-2: every micro-batch), all-gather P once
            return gather_bytes((m if d.zero == 2 else 1) * G + P, ranks)
        # ZeRO-3: per micro-batch, gather P for forward, again for backward, scatter G
        return m * gather_bytes(2 * P + G, ranks)

    # Experts are exchanged only among the n/ep ranks that hold the same experts.
    out = {"dp": dp_bytes(dense, n) + dp_bytes(expert, n / d.ep),
           # two all-reduces of A per layer forward, two backward (SP: gather + scatter, same)
           "tp": r * m * L * allreduce_bytes(A, d.tp),
           # a middle stage sends activations forward and gradients back; an end stage one way
           "pp": (0.0 if d.pp == 1 else (1 if d.pp == 2 else 2) * m * shard),
           # ring attention: K and V (2 * A * kv_heads/heads / tp) take cp-1 hops, 3 passes
           "cp": (4 if model.activation_checkpointing else 3) * (d.cp - 1) * m * L
           * 2 * A * model.kv_heads / model.heads / d.tp,
           # all-to-all: the (ep-1)/ep of each token's top_k copies that go to other ranks
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

        >>> group_links(Cluster(devices=16, memory_gib=80), Degrees(dp=2, tp=8))
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

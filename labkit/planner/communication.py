"""The model of communication: the bytes one device sends per optimizer step under a layout,
the link each group's bytes take, and the rough seconds they cost."""

from __future__ import annotations

from .describe import DIMENSIONS, Cluster, Degrees, Model
from .memory import local_params, stage_layers

__all__ = ["allreduce_bytes", "gather_bytes", "comm_bytes", "group_links", "step_seconds",
           "cp_hop_seconds"]


# ---- ring conventions (labkit.parallel.traffic's) ----------------------------------------------


def allreduce_bytes(payload: float, n: int) -> float:
    """Bytes one of ``n`` ranks sends in a ring all-reduce of ``payload`` bytes: ``2(n-1)/n*S``."""
    return 2 * (n - 1) / n * payload


def gather_bytes(payload: float, n: int) -> float:
    """Bytes one of ``n`` ranks sends in a ring all-gather (output ``S``) or reduce-scatter
    (input ``S``): ``(n-1)/n * S``."""
    return (n - 1) / n * payload


def comm_bytes(model: Model, degrees: Degrees, stage: int = 0) -> dict:
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
      ZeRO-0's bytes when ``P = G`` and ``m = 1``. ZeRO-3 with ``keep_gathered``: the
      parameters gathered once per step, the gradients reduce-scattered every micro-batch,
      ``(n-1)/n * (P + m*G)``.
    - ``tp``: per layer and micro-batch, 2 all-reduces of ``A`` forward (after attention and
      after the MLP) and 2 backward: ``r/2 * m * L * 2(t-1)/t * A * 2``, i.e. ``r * m * L *
      2(t-1)/t * A``. Sequence parallelism replaces each all-reduce with an all-gather and a
      reduce-scatter (the same bytes) and, to divide every activation by t, all-gathers QKV's
      and fc1's inputs again in backward: ``+ 2 * m * L * (t-1)/t * A`` (notebook 09's
      ``regather``). Megatron's pipeline scatter/gather adds the receiver's all-gathers here.
    - ``pp``: each micro-batch's activation to the next stage and its gradient to the previous
      one, ``A`` each (``A/t`` with sequence parallelism, or with ``pp_scatter_gather``: each
      TP rank sends its shard, and without SP the receiver all-gathers ``(t-1)/t * A`` over
      tp). A middle stage sends ``2*m*A``, the busiest; with 2 stages each sends ``m*A``.
      With ``v`` chunks (interleaved) every micro-batch crosses each rank ``v`` times:
      ``2*v*m*A`` (``(2v-1)*m*A`` with 2 stages).
    - ``cp``: ring attention as notebook 09 measures it, with ``C = A*g/t`` the bytes of one
      K (or V) chunk (``g = kv_heads/heads``): forward ``cp-1`` hops of K and V, ``2(cp-1)C``;
      backward K and V again and their gradient accumulators, which make one hop more,
      ``2(2cp-1)C``: ``(6cp-4)C`` per layer and micro-batch (with checkpointing the forward's
      ``2(cp-1)C`` again).
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
    dense, expert = local_params(model, d, stage)
    # n: the ranks that hold the same weights, and so exchange their gradients.
    n = d.dp * d.cp
    # A: bytes of one micro-batch's activation on this device, (s/cp) * b * h elements: the
    # tensor that tensor parallelism all-reduces and a pipeline stage passes on.
    A = model.seq_len / d.cp * model.micro_batch * model.hidden * model.act_bytes
    # With sequence parallelism each TP rank holds (and sends) 1/tp of that activation.
    sp = d.sp and d.tp > 1
    shard = A / d.tp if sp else A
    # Megatron's pipeline scatter/gather: each TP rank sends 1/tp, the receiver all-gathers.
    scatter = d.pp_scatter_gather and d.tp > 1 and not sp
    # L: this stage's layers; m: micro-batches per step per replica.
    L, m = stage_layers(model, d)[stage], d.m
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
        if d.keep_gathered:  # gather P once, kept through the step; scatter G per micro-batch
            return gather_bytes(P + m * G, ranks)
        # ZeRO-3: per micro-batch, gather P for forward, again for backward, scatter G
        return m * gather_bytes(2 * P + G, ranks)

    # pp_sends: activations (forward) and gradients (backward) a stage sends per micro-batch:
    # v each way in a middle stage (each chunk's), one fewer at each end of the pipeline.
    v = d.chunks
    pp_sends = 0 if d.pp == 1 else (2 * v - 1 if d.pp == 2 else 2 * v)
    # pp_received: what a middle stage receives, each all-gathered over tp when scattered.
    pp_received = 0 if d.pp == 1 else pp_sends
    # C: one K (or V) chunk of this rank, its kv heads split by tp.
    C = A * model.kv_heads / model.heads / d.tp
    cp_hops = 2 * (d.cp - 1) + 2 * (2 * d.cp - 1) if d.cp > 1 else 0  # K, V; then + dK, dV
    if model.activation_checkpointing and d.cp > 1:
        cp_hops += 2 * (d.cp - 1)  # the forward's ring again
    # Experts are exchanged only among the n/ep ranks that hold the same experts.
    out = {"dp": dp_bytes(dense, n) + dp_bytes(expert, n / d.ep),
           # two all-reduces of A per layer forward, two backward (SP: gather + scatter, same),
           # SP's two backward re-gathers, the pipeline receiver's gathers when scattered
           "tp": r * m * L * allreduce_bytes(A, d.tp)
           + (2 * m * L * gather_bytes(A, d.tp) if sp else 0.0)
           + (pp_received * m * gather_bytes(A, d.tp) if scatter else 0.0),
           # a middle stage sends activations forward and gradients back; an end stage one way
           "pp": pp_sends * m * (A / d.tp if scatter else shard),
           # ring attention: chunks of C bytes, cp_hops of them per layer and micro-batch
           "cp": cp_hops * m * L * C,
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


def cp_hop_seconds(model: Model, cluster: Cluster, degrees: Degrees) -> tuple[float, float]:
    """(transfer, compute) seconds of one forward ring-attention step: K and V to the next
    rank (with the link's latency), against the attention block this rank computes meanwhile.

    Notebook 09's hiding rule: a step's ``2*b*kv*(s/cp)*d*e`` bytes (``/tp``) hide behind its
    ``4*b*a*(s/cp)^2*d`` flops (``/tp``, half of them under a causal mask) once ``s/cp`` is past
    about ``e*F*kv/(a*B)`` tokens for causal attention (``e*F/B`` with as many K/V heads as
    query heads): a few thousand tokens per rank over NVLink, tens of thousands across nodes.
    """
    d = degrees
    chunk = model.seq_len / d.cp
    head_dim = model.hidden / model.heads
    sent = 2 * model.micro_batch * model.kv_heads * chunk * head_dim * model.act_bytes / d.tp
    link = group_links(cluster, d)["cp"]
    bandwidth = (cluster.intra_GBps if link == "intra-node" else cluster.inter_GBps) * 1e9
    flops = 4 * model.micro_batch * model.heads * chunk**2 * head_dim / d.tp / 2  # causal
    return (sent / bandwidth + cluster.latency_us * 1e-6,
            flops / (cluster.tflops * 1e12))


def _ring_steps(degrees: Degrees, model: Model, stage: int = 0) -> dict:
    """Ring steps (messages one after the other) per step, by dimension: what latency costs."""
    d, m = degrees, degrees.m
    L = stage_layers(model, d)[stage]
    r = 6 if model.activation_checkpointing else 4
    n = d.dp * d.cp
    dp = {0: 2 * (n - 1), 1: 2 * (n - 1), 2: (m + 1) * (n - 1)}.get(
        d.zero, (1 + m if d.keep_gathered else 3 * m) * (n - 1)) if n > 1 else 0
    sp = d.sp and d.tp > 1
    tp = (r * m * L * 2 + (2 * m * L if sp else 0)) * (d.tp - 1)
    pp = 0 if d.pp == 1 else (2 * d.chunks if d.pp > 2 else 2 * d.chunks - 1) * m
    cp = (3 * d.cp - 2 + (d.cp - 1 if model.activation_checkpointing else 0)) * m * L \
        if d.cp > 1 else 0
    ep = r * m * L * (d.ep - 1) if model.experts > 1 else 0
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}


def step_seconds(model: Model, cluster: Cluster, degrees: Degrees, comm: dict) -> dict:
    """Rough seconds per step: compute, the pipeline's bubble, and each dimension's exposed
    communication.

    ``compute = 6 * active_params * tokens / (devices * tflops)`` (8 with checkpointing: the
    forward again), ``tokens = dp * m * micro_batch * seq_len``; the 1F1B bubble adds ``(pp-1)/m``
    of it, ``(pp-1)/(v m)`` with ``v`` interleaved chunks. Each dimension's bytes take
    ``bytes / bandwidth`` of its link (:func:`group_links`) plus ``latency_us`` per ring step;
    ``transfer`` sums them, nothing overlapped (an upper bound). With ``degrees.overlap``
    (the default) part of it hides behind the compute, as the frameworks arrange:

    - ``dp``: the gradients' reduce(-scatter) behind backward (2/3 of the compute), ZeRO-3's
      gathers behind the compute (prefetch); ZeRO-1/2's parameter all-gather after the
      optimizer step stays exposed;
    - ``tp``: behind the GEMMs when sequence-parallel (Megatron's ``--tp-comm-overlap``);
      exposed without SP;
    - ``cp``: each ring step behind the attention block computed meanwhile
      (:func:`cp_hop_seconds`, notebook 09's rule); the backward's last hop stays exposed;
    - ``pp`` and ``ep``: exposed (they are on the critical path: the next stage, the experts,
      wait for them).

    ``comm`` sums the exposed seconds; ``overhead = bubble + comm``: what a layout adds to the
    compute every layout shares, the figure :func:`suggest` ranks by.
    """
    d = degrees
    tokens = d.dp * d.m * model.micro_batch * model.seq_len
    per_token = (8 if model.activation_checkpointing else 6) * model.active_params
    compute = per_token * tokens / (cluster.devices * cluster.tflops * 1e12)
    links = group_links(cluster, d)
    bandwidth = {"intra-node": cluster.intra_GBps * 1e9, "inter-node": cluster.inter_GBps * 1e9}
    steps = _ring_steps(d, model)
    latency = cluster.latency_us * 1e-6
    transfer = {k: comm[k] / bandwidth[links[k]] + steps[k] * latency if links[k] else 0.0
                for k in DIMENSIONS}
    out = dict(transfer)
    if d.overlap:
        # backward: all but the one forward of the 6 (8 with checkpointing) flops per token
        backward = compute * (1 - 2 / (8 if model.activation_checkpointing else 6))
        if d.zero == 3:
            out["dp"] = max(0.0, transfer["dp"] - compute)
        elif links["dp"]:
            # the parameters' all-gather (ZeRO-1/2) comes after the step: not hidden
            dense, expert = local_params(model, d)
            gather = (gather_bytes((dense + expert) * model.param_bytes, d.dp * d.cp)
                      if d.zero in (1, 2) else 0.0) / bandwidth[links["dp"]]
            out["dp"] = gather + max(0.0, transfer["dp"] - gather - backward)
        if d.sp and d.tp > 1:
            out["tp"] = max(0.0, transfer["tp"] - compute)
        if d.cp > 1:
            hop, block = cp_hop_seconds(model, cluster, d)
            out["cp"] = d.m * stage_layers(model, d)[0] * (
                (d.cp - 1) * max(0.0, hop - block)              # forward: K, V
                + (d.cp - 1) * max(0.0, 2 * hop - 2 * block)    # backward: K, V with dK, dV
                + 2 * hop)                                      # dK, dV's last hop home
    out["comm"] = sum(out[k] for k in DIMENSIONS)
    out["transfer"] = sum(transfer[k] for k in DIMENSIONS)
    out["compute"] = compute
    out["bubble"] = compute * (d.pp - 1) / (d.m * d.chunks)
    out["overhead"] = out["bubble"] + out["comm"]
    out["step"] = out["compute"] + out["overhead"]
    return out

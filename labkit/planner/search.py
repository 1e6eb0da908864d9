"""The search: one layout's :class:`Plan` (does it fit, what it sends, why not), every valid
layout of a model on a cluster, the best few, and a plan beside what a run measured."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .._display import hang, wrap
from .communication import comm_bytes, cp_hop_seconds, group_links, step_seconds
from .describe import (
    DIMENSIONS,
    MEMORY_PARTS,
    Cluster,
    Degrees,
    GiB,
    Model,
    PlanError,
    as_degrees,
    factors,
    gib,
)
from .memory import model_state_bytes, stage_activation_bytes, stage_layers

__all__ = ["Plan", "plan", "check_layout", "layouts", "suggest", "predicted_vs_measured"]


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` found for one layout: bytes held, bytes sent, seconds, the verdict.

    ``memory``: bytes per device (``params``, ``grads``, ``optimizer``, ``activations``,
    ``buffers``, ``total``); ``budget``: the usable bytes (the cluster's memory less its
    headroom); ``fits``: ``total <= budget``; ``why``: '' when it fits, else what is too big
    and what would help. ``comm``: bytes each device sends per step by dimension (and
    ``total``); ``links``: intra- or inter-node per dimension; ``seconds``: the estimates of
    :func:`step_seconds`; ``bubble``: the 1F1B idle fraction ``(pp-1)/(m+pp-1)``
    (``(pp-1)/(v m+pp-1)`` interleaved); ``warnings``: what is allowed but costly; ``stage``:
    the pipeline stage whose device holds the most, the one ``memory`` describes.
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
    stage: int = 0

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
        where = f" (stage {self.stage}, the fullest)" if self.degrees.stage_layers else ""
        lines = [wrap(f"{self.model.name} on {self.cluster}: {self.degrees}, {self.degrees.m} "
                      f"micro-batch(es) of {self.model.micro_batch}"),
                 hang(f"  memory per device{where} (GiB): ", f"{mem}; total "
                      f"{self.memory['total'] / GiB:.2f} of {self.budget / GiB:.1f} usable: "
                      f"{verdict}"),
                 hang("  sent per device per step: ", sent),
                 hang("  seconds per step (rough): ", f"compute {self.seconds['compute']:.3g}, "
                      f"bubble {self.seconds['bubble']:.3g}, communication "
                      f"{self.seconds['comm']:.3g} exposed of {self.seconds['transfer']:.3g}")]
        lines += [hang("  why: ", self.why)] if self.why else []
        lines += [hang("  note: ", w) for w in self.warnings]
        return "\n".join(lines)


def check_layout(model: Model, cluster: Cluster, d: Degrees) -> None:
    """PlanError unless ``d`` places every device and splits the model evenly."""
    if d.world != cluster.devices:
        raise PlanError(f"dp*tp*pp*cp = {d.dp}*{d.tp}*{d.pp}*{d.cp} = {d.world}, but the "
                        f"cluster has {cluster.devices} devices: every device needs one place "
                        f"in the layout. {_factorizations(cluster.devices, d)}")
    if d.stage_layers is not None and sum(d.stage_layers) != model.layers:
        raise PlanError(f"stage_layers={d.stage_layers} hold {sum(d.stage_layers)} layers, the "
                        f"model has {model.layers}: the stages' counts must add up to them")
    if d.stage_layers is None and model.layers % (d.pp * d.chunks):
        what = f"pp={d.pp} equal stages" if d.chunks == 1 else \
            f"pp*v={d.pp}*{d.chunks} equal chunks"
        raise PlanError(f"{model.layers} layers do not split into {what}: use a pp (and v) "
                        f"whose product divides {model.layers}, e.g. "
                        f"{', '.join(map(str, factors(model.layers)[:6]))}, or give "
                        f"stage_layers")
    for what, count in (("heads", model.heads), ("kv_heads", model.kv_heads),
                        ("ffn", model.ffn)):
        if count % d.tp:
            raise PlanError(f"{what}={count} does not split over tp={d.tp}: each TP rank takes "
                            f"whole heads and an equal slice of the MLP; use a tp that divides "
                            f"{count}, e.g. {', '.join(map(str, factors(count)[:6]))}")
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
    head = (f"needs {gib(memory['total'])} per device, {gib(cluster.budget)} usable "
            f"({cluster.memory_gib:g} GiB less {cluster.headroom:.0%} headroom); the biggest "
            f"part is {biggest} ({gib(memory[biggest])})")
    n = d.dp * d.cp
    state = sum(memory[k] for k in ("params", "grads", "optimizer", "buffers"))
    helps = []
    if state > cluster.budget:
        head += (f"; the model state alone ({gib(state)}) is more than the usable memory, so no "
                 f"activation setting (checkpointing, sequence or context parallelism) can make "
                 f"it fit")
    if state > cluster.budget or biggest in ("params", "grads", "optimizer", "buffers"):
        if d.zero < 3 and n > 1:
            stages = [dataclasses.replace(d, zero=z) for z in range(d.zero + 1, 4)]
            figures = ", ".join(f"ZeRO-{z.zero} {gib(sum(model_state_bytes(model, z).values()))}"
                                for z in stages)
            helps.append(f"shard over the dp*cp={n} ranks (model state now {gib(state)}; "
                         f"{figures})")
        elif n == 1:
            helps.append("ZeRO has nothing to shard over with dp*cp=1: it needs data-parallel "
                         "ranks")
        helps.append(f"more tp or pp (the model state divides by tp*pp={d.tp * d.pp})")
        if state > cluster.budget:
            helps.append("or more devices, or bigger ones")
    else:
        if not (model.activation_checkpointing or model.selective_recompute
                or model.flash_attention):
            sel = dataclasses.replace(model, selective_recompute=True)
            helps.append(f"selective recomputation of the attention scores "
                         f"({gib(stage_activation_bytes(sel, d))})")
        if not model.activation_checkpointing:
            ckpt = dataclasses.replace(model, activation_checkpointing=True)
            helps.append(f"activation checkpointing ({gib(stage_activation_bytes(ckpt, d))})")
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
                   f"{(d.pp - 1) / (d.m * d.chunks + d.pp - 1):.0%} of the step; use at least "
                   f"pp, better 4*pp")
    if d.cp > 1:
        hop, block = cp_hop_seconds(model, cluster, d)
        if hop > block:
            out.append(f"cp={d.cp} leaves {model.seq_len // d.cp} tokens per rank: a ring step's "
                       f"K/V transfer ({hop * 1e6:.3g} us with latency) is longer than the "
                       f"attention it could hide behind ({block * 1e6:.3g} us), so the ring "
                       f"only adds messages; use cp for longer sequences")
    return tuple(out)


def plan(model: Model, cluster: Cluster, degrees) -> Plan:
    """Memory, communication and a verdict for ``model`` on ``cluster`` laid out as ``degrees``.

    Raises :class:`PlanError` (saying what to change) for a layout that cannot run: the
    degrees' product is not the device count, pp does not divide the layers, tp does not divide
    the heads, cp does not divide the sequence, ep does not divide the experts or dp. A layout
    that runs but does not fit gets ``fits=False`` and a ``why``.

    Example (the 7B model of the module docstring: plain data parallelism, then ZeRO-1)::

        >>> plan(model, Cluster(devices=8, memory_gib=80), Degrees(dp=8)).fits
        False
        >>> p = plan(model, Cluster(devices=8, memory_gib=80), Degrees(dp=8, zero=1))
        >>> p.fits, round(p.memory["optimizer"] / 2**30, 2), round(p.comm["dp"] / 2**30, 1)
        (True, 9.36, 21.8)
    """
    degrees = as_degrees(degrees)
    check_layout(model, cluster, degrees)

    def held(stage: int) -> dict:
        memory = model_state_bytes(model, degrees, stage)
        memory["activations"] = stage_activation_bytes(model, degrees, stage)
        memory = {k: memory[k] for k in MEMORY_PARTS}
        memory["total"] = sum(memory.values())
        return memory

    # Equal stages: stage 0 holds the most (the most micro-batches in flight). Unequal ones:
    # look at each.
    stages = range(degrees.pp) if degrees.stage_layers else range(1)
    stage = max(stages, key=lambda k: held(k)["total"])
    memory = held(stage)
    fits = memory["total"] <= cluster.budget
    busiest = max(range(degrees.pp), key=lambda k: stage_layers(model, degrees)[k])
    comm = comm_bytes(model, degrees, busiest)
    comm["total"] = sum(comm.values())
    pp, m, v = degrees.pp, degrees.m, degrees.chunks
    return Plan(model, cluster, degrees, memory, cluster.budget, fits,
                "" if fits else _why(model, cluster, degrees, memory), comm,
                group_links(cluster, degrees), step_seconds(model, cluster, degrees, comm),
                (pp - 1) / (v * m + pp - 1), _warnings(model, cluster, degrees), stage)


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
    for tp in factors(cluster.devices):
        for pp in factors(cluster.devices // tp):
            for cp in factors(cluster.devices // (tp * pp)):
                dp = cluster.devices // (tp * pp * cp)
                if tp > max_tp or batch % (dp * model.micro_batch):
                    continue
                # With dp*cp = 1 there is nothing to shard: one ZeRO stage stands for all.
                stages = zero if dp * cp > 1 else tuple(zero)[:1]
                for ep in factors(math.gcd(dp, model.experts)):
                    for z in stages:
                        d = Degrees(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=z,
                                    microbatches=batch // (dp * model.micro_batch))
                        try:
                            check_layout(model, cluster, d)
                        except PlanError:
                            continue
                        yield d


def suggest(model: Model, cluster: Cluster, top: int = 5, zero=(0, 1, 2, 3), *,
            global_batch: int | None = None, max_tp: int | None = None) -> list[Plan]:
    """The ``top`` layouts that fit, best first; :class:`PlanError` "fits nowhere" if none does.

    Candidates come from :func:`layouts`. They are ranked by ``seconds["overhead"]``, the
    communication that does not hide behind compute (its latency included) plus the pipeline
    bubble: the compute is the same for every layout of one model and batch, so what tells them
    apart is what each adds to it. Ties go to the smaller memory. An estimate for choosing, not
    a promise: measure the best few.

    Example (the 7B model of the module docstring)::

        >>> [str(p.degrees) for p in suggest(model, Cluster(devices=8, memory_gib=80), top=2)]
        ['dp=1 tp=8 pp=1 cp=1 ep=1 zero=0', 'dp=2 tp=4 pp=1 cp=1 ep=1 zero=3']
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
        state = least.memory["total"] - least.memory["activations"]
        if state > cluster.budget:
            advice = (f"Its model state alone ({gib(state)}) is more than the usable memory, so "
                      f"no activation setting helps: use more devices or bigger ones.")
        else:
            more = ("" if model.activation_checkpointing else
                    ", turn on activation checkpointing (Model(activation_checkpointing=True))")
            advice = f"Use more devices, bigger ones{more}, or a smaller micro_batch / seq_len."
        raise PlanError(f"{model.name} fits nowhere on {cluster}: the smallest layout found "
                        f"({least.degrees}) needs {gib(least.memory['total'])} per device, "
                        f"{gib(cluster.budget)} usable. {advice}")
    fitting.sort(key=lambda p: (p.seconds["overhead"], p.memory["total"]))
    return fitting[:top]


def predicted_vs_measured(p: Plan, measured: Mapping) -> list[dict]:
    """Rows ``{what, predicted, measured, ratio}`` for a plan beside what a run measured.

    ``measured`` maps names to bytes: memory parts (``params``, ``grads``, ``optimizer``,
    ``activations``, ``buffers``) per device, or dimensions (``dp``, ``tp``, ``pp``, ``cp``,
    ``ep``) for the bytes one device sent in one step.

    Example (DDP of ``mlp_blocks(4, 64)`` in fp32 on 2 ranks: ``step_traffic`` measured 529408)::

        >>> two = Cluster(devices=2, memory_gib=80)
        >>> predicted_vs_measured(plan(small, two, Degrees(dp=2)), {"dp": 529408})
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

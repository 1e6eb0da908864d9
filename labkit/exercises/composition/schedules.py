"""Notebook 10's schedule exercise: Megatron's interleaved 1F1B order, written as data.

The learner writes ``my_interleaved(stages, chunks, m)``: one list per rank of ``("F", chunk, i)``
/ ``("B", chunk, i)`` actions. The grader judges the order by what it does, not by its likeness
to Megatron's: for several ``(p, v, m)`` it must run without deadlock
(:func:`labkit.parallel.schedules.check_chunked_schedule`), with each pair of neighbours
sending and receiving in the same order (:func:`~labkit.parallel.schedules.
check_message_order`), its simulated bubble must be
``(p - 1) / (v m)`` and no rank may hold more activations than Megatron's order
(:func:`labkit.parallel.schedules.interleaved_1f1b`, :func:`~labkit.parallel.schedules.
peak_in_flight`); a valid order that differs from Megatron's passes. Where an answer fails, its
usual mistakes are named by comparing it with Megatron's. It also asks for a clear error when
``m`` is not a multiple of ``p``, and plays the order on 2 and 4 real gloo ranks
(:func:`labkit.check.on_ranks`, :func:`labkit.parallel.schedules.run_schedule`), where its
gradients must equal the unpipelined step's.
"""

from __future__ import annotations

from ...check import NotYet, exercise, on_ranks
from ..model_parallel import parse_schedule

NOTEBOOK = "10"
__all__ = ["interleaved_schedule"]

# (stages, chunks, m): m = p and m > p, 2 to 4 ranks, 2 and 3 chunks.
_CASES = [(2, 2, 4), (2, 2, 2), (2, 3, 6), (3, 2, 6), (4, 2, 8), (4, 2, 4), (4, 3, 8)]
_TOL = 1e-5  # float32: the micro-batch gradients are summed in another order than one batch's


def _fmt(pairs, limit: int = 12) -> str:
    """(kind, chunk, i) or (chunk, i) as 'F0.1' or '0.1': chunk.micro-batch."""
    text = [f"{a[0]}{a[1]}.{a[2]}" if len(a) == 3 else f"{a[0]}.{a[1]}" for a in pairs[:limit]]
    return " ".join(text) + (" ..." if len(pairs) > limit else "")


def _as_schedule(fn, stages: int, chunks: int, m: int) -> list[list[tuple[str, int, int]]]:
    """The learner's schedule as lists of (kind, chunk, i) tuples, or NotYet."""
    return parse_schedule(fn(stages, chunks, m), f"my_interleaved({stages}, {chunks}, {m})",
                          stages, "rank", "('F', chunk, i) and ('B', chunk, i)", fields=3)


def _depth_first(pairs) -> bool:
    """Whether a micro-batch goes straight from chunk c to chunk c+1 on the same rank."""
    return any(c2 == c1 + 1 and i2 == i1
               for (c1, i1), (c2, i2) in zip(pairs, pairs[1:], strict=False))


def _mistake(rank: int, p: int, v: int, m: int, got, want) -> NotYet | None:
    """Why rank ``rank``'s actions are not interleaved 1F1B: the usual mistakes, named."""
    if got == want:
        return None
    where = (f"(p={p}, v={v}, m={m}) rank {rank} runs {_fmt(got)}; interleaved 1F1B runs "
             f"{_fmt(want)} (chunk.micro-batch)")
    forwards = {a: [(c, i) for k, c, i in actions if k == "F"] for a, actions in
                (("got", got), ("want", want))}
    backwards = {a: [(c, i) for k, c, i in actions if k == "B"] for a, actions in
                 (("got", got), ("want", want))}
    if forwards["got"] != forwards["want"]:
        if forwards["got"] == sorted(forwards["want"]):
            return NotYet(where, "chunks in the wrong order within a group: all micro-batches go "
                                 "through chunk 0 before any reaches chunk 1 (that is looped BFS, "
                                 "GPipe-like). Take them in groups of p: micro-batches 0..p-1 "
                                 "through chunk 0, the same p through chunk 1, ..., then the next "
                                 "group")
        if p > 1 and _depth_first(forwards["got"]):
            return NotYet(where, f"chunk/virtual-stage mapping: after chunk c on rank r a "
                                 f"micro-batch goes on to rank r+1, not to chunk c+1 of the same "
                                 f"rank. Rank r holds virtual stages r, r+p, r+2p, ... (chunk c "
                                 f"is stage c*p + r), not r*v .. r*v+v-1: here rank {rank} holds "
                                 f"{[c * p + rank for c in range(v)]}")
        return NotYet(where, "the forwards go in groups of p micro-batches: micro-batches 0..p-1 "
                             "through chunk 0, then the same through chunk 1, ..., then "
                             "micro-batches p..2p-1 through chunk 0, ...")
    if backwards["got"] != backwards["want"]:
        if backwards["got"] == forwards["want"]:
            return NotYet(where, "backward of chunks not in reverse order: the gradients come "
                                 "back from the last virtual stage, so each group of p "
                                 "micro-batches goes back through chunk v-1 first, then v-2, "
                                 "..., chunk 0 last")
        return NotYet(where, "the backwards go in the same groups of p micro-batches as the "
                             "forwards, with the chunks from last to first")
    lead = next((k for k, (kind, _, _) in enumerate(got) if kind == "B"), len(got))
    want_lead = next((k for k, (kind, _, _) in enumerate(want) if kind == "B"), len(want))
    if lead < want_lead:
        return NotYet(where, f"warm-up too short: rank {rank} starts backward after {lead} "
                             f"forwards, before the gradient it needs can be back. A micro-batch's "
                             f"gradient returns to rank r only after it has gone through every "
                             f"virtual stage after r's chunk and come back: count the forwards "
                             f"rank r can run meanwhile (more for lower ranks, and p more for "
                             f"each extra chunk)")
    if lead > want_lead:
        return NotYet(where, f"warm-up too long: rank {rank} runs {lead} forwards before its "
                             f"first backward, more than it needs to stay busy; each one holds a "
                             f"chunk's activations until its backward, so start the backwards as "
                             f"soon as the first gradient can be back")
    return NotYet(where, "after the warm-up, alternate one forward and one backward; end with "
                         "the backwards still owed")


def _judge(got, p: int, v: int, m: int):
    """NotYet unless ``got`` runs, has interleaving's bubble and holds no more than Megatron's."""
    from fractions import Fraction

    from ...parallel import schedules

    want = schedules.interleaved_1f1b(p, v, m)

    def named(fallback_detail: str, fallback_hint: str) -> NotYet:
        mistake = next((e for r in range(p) if (e := _mistake(r, p, v, m, got[r], want[r]))),
                       None)
        if mistake is None:
            return NotYet(fallback_detail, fallback_hint)
        return NotYet(f"{fallback_detail}; {mistake.detail.split(') ', 1)[1]}", mistake.hint)

    try:
        schedules.check_chunked_schedule(got, p, m, v)
    except ValueError as err:
        raise named(f"(p={p}, v={v}, m={m}): {err}",
                    "every rank runs ('F', c, i) and ('B', c, i) once for each chunk c < v and "
                    "micro-batch i < m, each after what it waits for") from None
    try:
        schedules.check_message_order(got, p, v)
    except ValueError as err:
        raise NotYet(f"(p={p}, v={v}, m={m}): {err}",
                     "point-to-point messages between two ranks are matched in the order they "
                     "are posted (as torch.distributed.pipelining and Megatron post them): a "
                     "rank must receive in the order its neighbour sends, or both wait "
                     "forever") from None
    ideal = Fraction(p - 1, v * m)
    bubble = schedules.simulate_chunked(got, p, m, v, f=Fraction(1), b=Fraction(1),
                                        w=Fraction(0))["idle_per_compute"]
    if bubble > ideal:
        raise named(f"(p={p}, v={v}, m={m}): it runs, but its simulated bubble is {bubble} of "
                    f"the compute, interleaved 1F1B's is (p-1)/(v m) = {ideal}",
                    "a rank waits for work it could have had: keep every rank busy from its "
                    "first forward to its last backward")
    held, limit = (schedules.peak_in_flight(x, p, m, v) for x in (got, want))
    worst = max(range(p), key=lambda r: held[r] - limit[r])
    if held[worst] > limit[worst]:
        raise named(f"(p={p}, v={v}, m={m}): bubble {bubble} as it should be, but rank {worst} "
                    f"holds {held[worst]:g} stages' worth of activations at once, interleaved "
                    f"1F1B {limit[worst]:g}",
                    "a forward held longer than needed costs memory: run each backward as soon "
                    "as its gradient can be there")
    return got == want


def _run_interleaved(schedule, m: int, chunks: int, seed: int = 0) -> dict:
    """Grading worker: ``schedule`` played by ``schedules.run_schedule`` on a tiny model.

    Returns the largest gradient and loss differences from the unpipelined step (plain data).
    """
    import functools

    import torch.distributed as dist

    from ...parallel import pipeline, schedules

    p = dist.get_world_size()
    # One square layer per virtual stage, so that every chunk holds work on 2 and on 4 ranks.
    build = pipeline.stage_builder(functools.partial(pipeline.mlp_stack, 16, p * chunks, 8, 4),
                                   seed=seed)
    batch = pipeline.example_batch(4 * m, inputs=8, classes=4, seed=seed)
    out = schedules.run_schedule(build, schedule, m, batch, chunks)
    ref = pipeline.reference_step(build, p * chunks, batch)
    diffs = [(g - ref["grads"][k]).abs().max().item()
             for g, k in zip(out["grads"], out["stages"], strict=True)]
    return {"grad_diff": max(diffs), "loss_diff": abs(out["loss"] - ref["loss"])}


@exercise("interleaved_schedule", notebook=NOTEBOOK, title="the interleaved 1F1B order")
def interleaved_schedule(fn) -> str:
    """Exercise: ``fn(stages, chunks, m)``, one list of ("F"/"B", chunk, i) per rank, runs as
    interleaved 1F1B does: its bubble, no more memory.

    Checked for several (p, v, m) by what the order does: it runs without deadlock
    (``schedules.check_chunked_schedule``), its simulated bubble is (p - 1) / (v m), no rank
    holds more activations than ``schedules.interleaved_1f1b``'s order (another valid order
    passes); ``m`` not a multiple of ``p`` refused with a ValueError; then played on 2 and 4
    gloo ranks by ``schedules.run_schedule``.

    Example::

        >>> exercise.interleaved_schedule(my_interleaved)
        [pass] the interleaved 1F1B order: ... bubble exactly ... 2 and 4 gloo ranks ...
    """
    same = 0
    for p, v, m in _CASES:
        same += _judge(_as_schedule(fn, p, v, m), p, v, m)
    try:
        odd = fn(2, 2, 3)
    except ValueError:
        pass
    except Exception as exc:  # noqa: BLE001 - any other error is the wrong kind of refusal
        raise NotYet(f"my_interleaved(2, 2, 3) raised {type(exc).__name__}: {exc}",
                     "m not a multiple of p: raise a ValueError that says so (m=3 does not "
                     "split into groups of p=2 micro-batches)") from None
    else:
        raise NotYet(f"my_interleaved(2, 2, 3) returned {str(odd)[:80]}...",
                     "m not a multiple of p: interleaved 1F1B takes micro-batches in groups of p, "
                     "and m=3 does not split into groups of 2; raise ValueError, as Megatron does")
    m, worst = 4, 0.0
    for nproc in (2, 4):   # m = 4: more micro-batches than 2 ranks, as many as 4
        ranks = on_ranks(_run_interleaved, _as_schedule(fn, nproc, 2, m), m, 2, nproc=nproc)
        diff = max(r["grad_diff"] for r in ranks)
        if diff > _TOL or ranks[0]["loss_diff"] > _TOL:
            raise NotYet(f"on {nproc} ranks: gradients off by {diff:.1e}, loss by "
                         f"{ranks[0]['loss_diff']:.1e}",
                         "the order passed the simulator, so this is the runner: restart the "
                         "kernel and run the notebook from the top")
        worst = max(worst, diff)
    order = ("Megatron's order" if same == len(_CASES) else
             f"a valid order ({len(_CASES) - same} of them other than Megatron's)")
    return (f"{order} for {len(_CASES)} (p, v, m) triples: no deadlock, the simulated "
            f"bubble exactly interleaved 1F1B's, no rank holding more activations; m % p != 0 "
            f"refused; played on 2 and 4 gloo ranks (v=2, m={m}) it gave the unpipelined "
            f"gradients (within {worst:.0e})")

"""Notebook 10's schedule exercise: Megatron's interleaved 1F1B order, written as data.

The learner writes ``my_interleaved(stages, chunks, m)``: one list per rank of ``("F", chunk, i)``
/ ``("B", chunk, i)`` actions. The grader checks it can run
(:func:`labkit.parallel.schedules.check_chunked_schedule`), compares it with
:func:`labkit.parallel.schedules.interleaved_1f1b` for several
``(p, v, m)``, simulates its bubble against ``(p - 1) / (v m)``, asks for a clear error when
``m`` is not a multiple of ``p``, and plays it on 2 real gloo ranks
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
    rule = min((p - rank - 1) * 2 + (v - 1) * p, m * v)
    expected = rule + (rule < m * v)  # the warm-up, then the first steady forward
    if lead != expected:
        said = "too short" if lead < expected else "too long"
        return NotYet(where, f"warm-up {said}: rank r runs (p-r-1)*2 + (v-1)*p forwards first "
                             f"(at most m*v), here ({p}-{rank}-1)*2 + ({v}-1)*{p} = {rule}, "
                             f"then one more forward before its first backward")
    return NotYet(where, "after the warm-up, alternate one forward and one backward; end with "
                         "the backwards still owed")


def _run_interleaved(schedule, m: int, chunks: int, seed: int = 0) -> dict:
    """Grading worker: ``schedule`` played by ``schedules.run_schedule`` on a tiny model.

    Returns the largest gradient and loss differences from the unpipelined step (plain data).
    """
    import functools

    import torch.distributed as dist

    from ...parallel import pipeline, schedules

    p = dist.get_world_size()
    build = pipeline.stage_builder(functools.partial(pipeline.mlp_stack, 16, 4, 8, 4), seed=seed)
    batch = pipeline.example_batch(4 * m, inputs=8, classes=4, seed=seed)
    out = schedules.run_schedule(build, schedule, m, batch, chunks)
    ref = pipeline.reference_step(build, p * chunks, batch)
    diffs = [(g - ref["grads"][k]).abs().max().item()
             for g, k in zip(out["grads"], out["stages"], strict=True)]
    return {"grad_diff": max(diffs), "loss_diff": abs(out["loss"] - ref["loss"])}


@exercise("interleaved_schedule", notebook=NOTEBOOK, title="the interleaved 1F1B order")
def interleaved_schedule(fn) -> str:
    """Exercise: ``fn(stages, chunks, m)``, one list of ("F"/"B", chunk, i) per rank, is
    Megatron's interleaved 1F1B.

    Checked with ``schedules.check_chunked_schedule`` and against ``schedules.interleaved_1f1b`` for
    several (p, v, m), its simulated bubble against (p - 1) / (v m), ``m`` not a multiple of
    ``p`` refused with a ValueError, then played on 2 gloo ranks by ``schedules.run_schedule``.

    Example::

        >>> exercise.interleaved_schedule(my_interleaved)
        [pass] the interleaved 1F1B order: ... bubble (p-1)/(v m) ... 2 gloo ranks ...
    """
    from fractions import Fraction

    from ...parallel import schedules

    for p, v, m in _CASES:
        got = _as_schedule(fn, p, v, m)
        want = schedules.interleaved_1f1b(p, v, m)
        try:
            schedules.check_chunked_schedule(got, p, m, v)
        except ValueError as err:
            named = next((e for r in range(p) if (e := _mistake(r, p, v, m, got[r], want[r]))),
                         None)
            hint = named.hint if named else ("every rank runs ('F', c, i) and ('B', c, i) once "
                                             "for each chunk c < v and micro-batch i < m")
            where = f"; {named.detail.split(') ', 1)[1]}" if named else ""
            raise NotYet(f"(p={p}, v={v}, m={m}): {err}{where}", hint) from None
        for rank in range(p):
            mistake = _mistake(rank, p, v, m, got[rank], want[rank])
            if mistake is not None:
                raise mistake
        ideal = schedules.simulate_chunked(got, p, m, v, f=Fraction(1), b=Fraction(1),
                                           w=Fraction(0))
        if ideal["idle_per_compute"] != Fraction(p - 1, v * m):  # same order: cannot differ
            raise NotYet(f"(p={p}, v={v}, m={m}): simulated bubble {ideal['idle_per_compute']}",
                         "restart the kernel and run the notebook from the top")
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
    m = 4
    ranks = on_ranks(_run_interleaved, _as_schedule(fn, 2, 2, m), m, 2)
    worst = max(r["grad_diff"] for r in ranks)
    if worst > _TOL or ranks[0]["loss_diff"] > _TOL:
        raise NotYet(f"on 2 ranks: gradients off by {worst:.1e}, loss by "
                     f"{ranks[0]['loss_diff']:.1e}",
                     "the schedule matched the reference, so this is the runner: restart the "
                     "kernel and run the notebook from the top")
    return (f"Megatron's order for {len(_CASES)} (p, v, m) triples, simulated bubble "
            f"(p-1)/(v m) exactly, m % p != 0 refused; played on 2 gloo ranks (v=2, m={m}) it "
            f"gave the unpipelined gradients (within {worst:.0e})")

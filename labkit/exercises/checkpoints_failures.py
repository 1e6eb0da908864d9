"""Notebook 12's exercises: what resharding reads, how often to save, and a peer's recovery.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint that names the mistake where one of
the usual ones fits. ``reshard_reads`` is arithmetic graded in the kernel against
:func:`labkit.checkpoints.reshard_plan` (out of reach while the learner's function runs), and
against what DCP itself read when 2 ranks loaded a 4-rank save, when the notebook passes those
reads.
"""

from __future__ import annotations

import contextlib

from ..check import NotYet, exercise, out_of_reach

NOTEBOOK = "12"

__all__ = ["RESHARD_CASES", "reshard_reads"]


# ---- reshard_reads: what each new rank reads of a tensor saved on another world size -----------

# (rows, old_world, new_world): uneven shards, ranks with nothing on either side, the same world,
# one rank to many and many to one, more ranks than rows.
RESHARD_CASES = [
    (10, 4, 2), (10, 2, 4), (8, 4, 4), (3, 4, 2), (3, 2, 4), (5, 1, 3), (9, 4, 1),
    (12, 4, 3), (12, 3, 4), (7, 3, 5), (2, 4, 4), (100, 8, 6),
]


@contextlib.contextmanager
def _answers_out_of_reach(fn):
    """``checkpoints.reshard_plan`` and ``shard_rows`` refuse while ``fn`` runs: the exercise
    is to compute the reads, not to call them."""
    from .. import checkpoints

    with out_of_reach(fn, [checkpoints], ("reshard_plan", "shard_rows"),
                      "my_reshard_reads computes the reads by hand"):
        yield


def _reference(rows: int, old: int, new: int) -> list[list[tuple[int, int, int]]]:
    from ..checkpoints import reshard_plan

    return [[(r["old_rank"], *r["rows"]) for r in p["reads"]]
            for p in reshard_plan((rows, 1), old, new)]


def _answer(fn, rows: int, old: int, new: int) -> list[list[tuple[int, int, int]]]:
    """The learner's reads as lists of int triples, or a NotYet saying what shape is wanted."""
    call = f"my_reshard_reads({rows}, {old}, {new})"
    with _answers_out_of_reach(fn):
        got = fn(rows, old, new)
    shape = ("a list with one list per new rank, each holding (old_rank, start, stop) for every "
             "saved shard that rank reads, in row order")
    try:
        out = [[tuple(int(x) for x in read) for read in reads] for reads in got]
    except (TypeError, ValueError):
        raise NotYet(f"{call} returned {got!r}", shape) from None
    if len(out) != new or any(len(read) != 3 for reads in out for read in reads):
        raise NotYet(f"{call} returned {got!r}", shape)
    return out


def _split(rows: int, world: int, how: str) -> list[tuple[int, int]]:
    """Ways of splitting rows over ranks: torch.chunk's (FSDP2's) and the usual wrong ones."""
    if how == "chunk":
        each = -(-rows // world)
        return [(min(r * each, rows), min((r + 1) * each, rows)) for r in range(world)]
    if how == "floor":  # rows // world each, the remainder on the last rank
        each = rows // world
        return [(r * each, rows if r == world - 1 else (r + 1) * each) for r in range(world)]
    extra, base = rows % world, rows // world  # numpy.array_split: the first ranks one more
    starts = [r * base + min(r, extra) for r in range(world + 1)]
    return list(zip(starts, starts[1:], strict=False))


def _reshard_mistake(got, rows: int, old: int, new: int) -> str:
    """The hint for a wrong answer on one case."""
    right = _reference(rows, old, new)
    flat = [read for reads in got for read in reads]
    if any(start >= stop for _, start, stop in flat):
        return ("an empty read (start == stop) is listed: a rank reads only the saved shards "
                "its rows overlap, and a rank with no rows reads nothing ([])")
    if sorted(got_rank := [sorted(r) for r in got]) == sorted(right) and got_rank != got:
        return "the reads are right but not in row order: sort each rank's reads by start"
    held = [(min(s for _, s, _ in reads), max(e for _, _, e in reads)) if reads else None
            for reads in got]
    for how, what in (("floor", "rows // world each with the remainder on the last rank"),
                      ("array_split", "the first ranks one row more (numpy.array_split)")):
        for world, side in ((new, "new"), (old, "saved")):
            wrong = _split(rows, world, how)
            if wrong != _split(rows, world, "chunk") and (
                    (side == "new" and held == [w if w[0] < w[1] else None for w in wrong])
                    or (side == "saved" and any(
                        (o, *w) in flat for o, w in enumerate(wrong)
                        if w not in _split(rows, world, "chunk") and w[0] < w[1]))):
                return (f"the {side} ranks' rows are split as {what}: FSDP2 splits like "
                        f"torch.chunk, ceil(rows / world) rows each, so the last ranks get "
                        f"fewer or none (10 rows over 4: 3, 3, 3, 1)")
    old_rows = _split(rows, old, "chunk")
    if any((o, *old_rows[o]) in flat and (o, *old_rows[o]) not in
           [r for reads in right for r in reads] for o in range(old)):
        return ("a whole saved shard is read where only part of it is needed: read the overlap "
                "of the saved shard's rows with the new rank's rows, max(starts) to min(stops)")
    if any(start < old_rows[o][0] or stop > old_rows[o][1] for o, start, stop in flat
           if 0 <= o < old):
        return ("a read lies outside the saved rank's rows: give start and stop as global row "
                "numbers (row 0 is the tensor's first), within that saved shard's rows")
    return ("each new rank r holds rows chunk(r) of the new world, and reads, from every saved "
            "rank o whose rows chunk(o) of the old world overlap them, the overlap (o, "
            "max(starts), min(stops)), in row order")


def _dcp_pieces(recorded) -> dict:
    """``{(rank, key): [(file, start, stop), ...]}`` from the notebook's recorded reads."""
    pieces = {}
    for rank, reads in enumerate(recorded["reads"]):
        for r in reads:
            if not r["lengths"]:  # a scalar (Adam's step) is not sharded: nothing to plan
                continue
            start = r["storage_offsets"][0]
            pieces.setdefault((rank, r["key"]), []).append(
                (r["file"], start, start + r["lengths"][0]))
    return {k: sorted(v, key=lambda p: (p[0], p[1])) for k, v in pieces.items()}


@exercise("reshard_reads", notebook=NOTEBOOK,
          title="what each rank reads when a checkpoint is resharded")
def reshard_reads(fn, *, recorded=None) -> str:
    """Exercise: ``fn(rows, old_world, new_world)`` lists, for each new rank, the
    ``(old_rank, start, stop)`` global rows it reads of a tensor saved dim-0 sharded over
    ``old_world`` ranks, in row order.

    Graded on :data:`RESHARD_CASES` against :func:`labkit.checkpoints.reshard_plan`, which
    (with ``shard_rows``) refuses while ``fn`` runs. ``recorded``, when given, is
    ``{"shapes": {key: shape}, "old_world": n, "reads": [rank 0's reads, rank 1's, ...]}``
    from a real resume (:class:`labkit.checkpoints.RecordingReader`): the answer must name
    exactly the pieces DCP read, file by file, for each tensor.

    Example::

        >>> exercise.reshard_reads(my_reshard_reads, recorded=recorded)
        [pass] what each rank reads when a checkpoint is resharded: ...
    """
    for rows, old, new in RESHARD_CASES:
        got, right = _answer(fn, rows, old, new), _reference(rows, old, new)
        if got != right:
            raise NotYet(f"my_reshard_reads({rows}, {old}, {new}) = {got}, expected {right}",
                         _reshard_mistake(got, rows, old, new))
    if recorded is None:
        return (f"{len(RESHARD_CASES)} cases: uneven shards, ranks with nothing on either side, "
                "one rank to many and back, more ranks than rows")
    pieces, old = _dcp_pieces(recorded), recorded["old_world"]
    new = len(recorded["reads"])
    for key, shape in recorded["shapes"].items():
        starts = [s for s, _ in _split(shape[0], old, "chunk")]
        for rank, reads in enumerate(_answer(fn, shape[0], old, new)):
            mine = sorted((f"__{o}_0.distcp", a - starts[o], b - starts[o]) for o, a, b in reads)
            if mine != pieces.get((rank, key), []):
                raise NotYet(f"{key} {tuple(shape)}, new rank {rank}: your reads are {mine} "
                             f"(file, rows within the saved shard), DCP read "
                             f"{pieces.get((rank, key), [])}",
                             "DCP numbers a saved shard's rows from 0 in its own file: your "
                             "global rows minus the saved rank's first row")
    return (f"{len(RESHARD_CASES)} cases, and the same pieces DCP read when {new} ranks loaded "
            f"{len(recorded['shapes'])} tensors saved on {old}")


# ---- checkpoint_interval: the first-order goodput and the interval that maximises it ------------

__all__ += ["INTERVAL_CASES", "checkpoint_interval"]  # noqa: PLE0605

# (save seconds, MTBF seconds, restart seconds): a laptop's minutes to a large run's hours.
INTERVAL_CASES = [(60.0, 3 * 3600.0, 300.0), (5.0, 24 * 60.0, 0.0), (1.0, 100.0, 10.0),
                  (30.0, 11135.0, 600.0), (0.02, 1.0, 0.05), (120.0, 86400.0, 900.0)]


def _number(value, call: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise NotYet(f"{call} returned {value!r}", "return a number (a float)")
    return float(value)


def _goodput_mistake(goodput, delta: float, mtbf: float, restart: float) -> str:
    """Which term of ``1 - δ/τ - (τ/2 + R)/M`` the learner's goodput gets wrong."""
    tau = 0.1 * mtbf
    got = goodput(tau, delta, mtbf, restart)
    for wrong, hint in (
            (1 - delta / tau - (tau + restart) / mtbf,
             "a failure loses, on average, half an interval of work (failures fall anywhere in "
             "it), not a whole one: (τ/2 + R)/M"),
            (1 - delta / tau - tau / (2 * mtbf),
             "each failure also costs the restart R: (τ/2 + R)/M of the time is lost"),
            (1 - delta / (tau + delta) - (tau / 2 + restart) / mtbf,
             "the save's share is δ/τ in this first-order model (one save per τ of work)"),
            (1 - (tau / 2 + restart) / mtbf,
             "every τ of work also costs δ to save: a share δ/τ of the time")):
        if abs(got - wrong) < 1e-9:
            return hint
    return ("per τ of work the run spends δ saving (a share δ/τ); failures come 1/M per second, "
            "each losing half an interval on average plus R (a share (τ/2 + R)/M): the goodput "
            "is 1 - δ/τ - (τ/2 + R)/M")


def _interval_mistake(best, delta: float, mtbf: float) -> str:
    got = best(delta, mtbf)
    root = (2 * delta * mtbf) ** 0.5
    for wrong, hint in (
            ((delta * mtbf) ** 0.5, "sqrt(δM) is the optimum of a model that loses a whole "
                                    "interval per failure: with half an interval, 2δM"),
            (2 * delta * mtbf, "the optimum is where δ/τ² = 1/(2M): τ = sqrt(2δM), a square root"),
            ((2 * delta / mtbf) ** 0.5, "δ/τ² = 1/(2M) gives τ² = 2δM: multiply, do not divide"),
            (root - delta, "sqrt(2δM) - δ is a first step towards Daly's higher-order estimate; "
                           "the first-order goodput's maximum is sqrt(2δM) exactly")):
        if abs(got - wrong) <= 1e-9 * max(1.0, abs(wrong)):
            return hint
    return ("set the derivative of your goodput in τ to zero: δ/τ² - 1/(2M) = 0, so τ = "
            "sqrt(2δM); R adds a constant and does not move the maximum")


@exercise("checkpoint_interval", notebook=NOTEBOOK,
          title="the first-order goodput and the best interval between saves")
def checkpoint_interval(goodput, best_interval) -> str:
    """Exercise: ``goodput(interval, save_s, mtbf_s, restart_s)`` is the first-order fraction of
    time spent on work that is kept, ``best_interval(save_s, mtbf_s)`` the interval that
    maximises it.

    Graded on :data:`INTERVAL_CASES` against :func:`labkit.resilience.expected_goodput` (at
    intervals from a hundredth of the optimum to near the MTBF; where the model gives no
    progress, anything at or below 0 passes) and :func:`labkit.resilience.young_daly_interval`;
    and the route: the learner's interval must be where the learner's own goodput peaks.

    Example::

        >>> exercise.checkpoint_interval(my_goodput, my_best_interval)
        [pass] the first-order goodput and the best interval between saves: ...
    """
    from ..resilience import expected_goodput, young_daly_interval

    for delta, mtbf, restart in INTERVAL_CASES:
        best = young_daly_interval(delta, mtbf)
        for tau in (best / 100, best / 3, best, 3 * best, 0.9 * mtbf):
            call = f"my_goodput({tau:.4g}, {delta:g}, {mtbf:g}, {restart:g})"
            got = _number(goodput(tau, delta, mtbf, restart), call)
            right = expected_goodput(tau, delta, mtbf, restart)
            if not (abs(got - right) <= 1e-9 or (right == 0 and got <= 0)):
                raise NotYet(f"{call} = {got:.6g}, expected {right:.6g}",
                             _goodput_mistake(goodput, delta, mtbf, restart))
    for delta, mtbf, restart in INTERVAL_CASES:
        call = f"my_best_interval({delta:g}, {mtbf:g})"
        got, right = _number(best_interval(delta, mtbf), call), young_daly_interval(delta, mtbf)
        if abs(got - right) > 1e-9 * right:
            raise NotYet(f"{call} = {got:.6g} s, expected {right:.6g} s",
                         _interval_mistake(best_interval, delta, mtbf))
        # the route: the interval is the top of the learner's own curve, not a remembered formula
        peak = goodput(got, delta, mtbf, restart)
        for side in (got * (1 - 1e-3), got * (1 + 1e-3)):
            if goodput(side, delta, mtbf, restart) > peak + 1e-12:
                raise NotYet(f"your goodput is higher at {side:.6g} s than at your interval "
                             f"{got:.6g} s", "the best interval is where your goodput peaks")
    return (f"the goodput at 5 intervals of {len(INTERVAL_CASES)} runs (saves of 20 ms to 2 min, "
            f"failures every second to every day) and the interval sqrt(2δM) at its peak")


# ---- peer_heal: a replaced replica gets the state from a healthy peer, on real ranks ----------

__all__ += ["HEAL_CASES", "peer_heal"]  # noqa: PLE0605

# (ranks, steps, kills): who loses its state when. On 4 ranks: two of four at once (one copy each
# from two peers), three at once (one peer sends three), and rank 0 alone (two peers send nothing).
HEAL_CASES = [
    (2, 3, [(1, 2)]),
    (4, 5, [(1, 2), (3, 2), (0, 3), (1, 3), (2, 3), (0, 4)]),
]


_STATE_HINT = ("send both the model's and the optimizer's state (SGD keeps a momentum buffer per "
               "parameter: without it the healed replica steps differently), and load them "
               "into the model and optimizer you were given")


def _heal_worker(fn, steps: int, kills) -> dict:
    """On every rank: an uninterrupted run, then the same run with ``kills`` healed by ``fn``;
    each call of ``fn`` with what this rank sent and received meanwhile."""
    from ..parallel.traffic import count_traffic
    from ..resilience import resilient_training

    heals = []

    def counted(model, optimizer, healthy, recovering, group):
        with count_traffic() as traffic:
            fn(model, optimizer, healthy, recovering, group)
        heals.append({"healthy": healthy, "recovering": recovering,
                      "calls": [(c.op, c.peer, c.sent_bytes, c.payload_bytes)
                                for c in traffic.calls]})

    plain = resilient_training(steps=steps, collective_timeout=20.0)
    faults = [{"kind": "kill", "rank": r, "step": s} for r, s in kills]
    try:
        healed = resilient_training(steps=steps, faults=faults, heal=counted,
                                    collective_timeout=20.0)
    except RuntimeError as split:
        if "no majority" not in str(split):
            raise
        # Two replicas that differ after a heal: the run cannot tell which one to trust.
        return {"split": str(split), "heals": heals}
    return {"plain": plain["fingerprint"], "fingerprint": healed["fingerprint"],
            "heals": heals, "diverged": healed["diverged"]}


def _edges(ranks: list[dict], at: int) -> tuple[dict, set]:
    """``({(src, dst): bytes}, other ops)`` of heal number ``at``, from every rank's calls."""
    edges, other = {}, set()
    for rank, got in enumerate(ranks):
        for op, peer, sent, _payload in got["heals"][at]["calls"]:
            if op == "send":
                edges[(rank, peer)] = edges.get((rank, peer), 0) + sent
            elif op != "recv":
                other.add(op)
    return edges, other


def _heal_route(where: str, healthy: list, recovering: list, edges: dict, other: set) -> None:
    if other:
        raise NotYet(f"{where}: healing called {sorted(other)}",
                     "a broadcast or an all-reduce involves every rank, healthy ones included: "
                     "send the state point to point (dist.send / dist.send_object_list) from "
                     "one healthy rank to each recovering rank, and receive it there")
    wrong = sorted(e for e in edges if e[0] not in healthy or e[1] not in recovering)
    if wrong:
        raise NotYet(f"{where}: healthy {healthy}, recovering {recovering}; sends {wrong}",
                     "only healthy ranks send (a recovering rank's state is the lost one), and "
                     "only to recovering ranks (the healthy ones have the state already)")
    for dst in recovering:
        sources = sorted(src for src, to in edges if to == dst)
        if len(sources) != 1:
            raise NotYet(f"{where}: rank {dst} received from {sources or 'nobody'}",
                         "each recovering rank receives the state once, from one healthy rank")
    most = -(-len(recovering) // len(healthy))
    for src in healthy:
        sent_to = sorted(to for s, to in edges if s == src)
        if len(sent_to) > most:
            raise NotYet(f"{where}: rank {src} sent to {sent_to} while healthy ranks "
                         f"{healthy} could share the {len(recovering)} copies",
                         f"spread the copies: no healthy rank needs to send more than "
                         f"ceil({len(recovering)} / {len(healthy)}) = {most}; e.g. the i-th "
                         f"recovering rank from the (i mod {len(healthy)})-th healthy one")


@exercise("peer_heal", notebook=NOTEBOOK,
          title="healing a replaced replica from a healthy peer, in memory")
def peer_heal(fn) -> str:
    """Exercise: ``fn(model, optimizer, healthy, recovering, group)``, run on every rank of a
    data-parallel run when ranks ``recovering`` have lost their state, leaves their model and
    optimizer equal to the healthy replicas' by sending the state point to point.

    Graded in :func:`labkit.resilience.resilient_training` on 2 and 4 gloo ranks
    (:data:`HEAL_CASES`: two ranks healed at once, three from one peer, rank 0 with two idle
    peers) against the same run uninterrupted: every replica's final weights bit for bit, no
    replica left different after its heal (a missing optimizer state shows there), and the
    route, counted by ``labkit.parallel.traffic``: sends only from healthy to recovering
    ranks, one copy per recovering rank, no peer sending more than its share.

    Example::

        >>> exercise.peer_heal(my_heal)
        [pass] healing a replaced replica from a healthy peer, in memory: ...
    """
    from ..check import on_ranks

    copies = 0
    for world, steps, kills in HEAL_CASES:
        ranks = on_ranks(_heal_worker, fn, steps, kills, nproc=world, timeout=180)
        lost = {}
        for rank, step in kills:
            lost.setdefault(step, []).append(rank)
        heals = ranks[0]["heals"]
        for at, (step, recovering) in enumerate(sorted(lost.items())):
            # the heals of the kills come first, in step order: a heal after a divergence
            # (a replica still different after its own heal) only comes later
            healthy = [r for r in range(world) if r not in recovering]
            where = f"on {world} ranks, step {step}"
            if at >= len(heals) or heals[at]["recovering"] != sorted(recovering):
                break
            edges, other = _edges(ranks, at)
            _heal_route(where, healthy, sorted(recovering), edges, other)
            copies += len(recovering)
        if any("split" in r for r in ranks):
            raise NotYet(f"on {world} ranks: after healing, the replicas still differed ("
                         f"{next(r['split'] for r in ranks if 'split' in r)})", _STATE_HINT)
        if any(r["diverged"] for r in ranks) or len(heals) != len(lost):
            first = ranks[0]["diverged"] or {"step": "?", "ranks": "?"}
            raise NotYet(f"on {world} ranks: after healing, replica(s) {first['ranks']} still "
                         f"differed from the others at step {first['step']}", _STATE_HINT)
        plain = {r["plain"] for r in ranks}
        if len(plain) != 1 or any(r["fingerprint"] not in plain for r in ranks):
            raise NotYet(f"on {world} ranks: the final weights differ from the run that never "
                         f"lost a replica", "the recovering ranks must end with exactly the "
                         "healthy ranks' state: load what you received in place")
    return (f"{copies} replicas healed on 2 and 4 gloo ranks, each from one healthy peer, the "
            f"copies spread over the peers; every replica ended bit for bit on the run that "
            f"never lost one")

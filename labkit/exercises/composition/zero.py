"""Notebook 10's ZeRO exercise: the communication of one ZeRO-2 step, on flat tensors.

The learner writes ``my_zero2_step(flat_params, flat_grad, update_shard)``; the grader runs it on
2 and 4 real gloo ranks (:func:`labkit.check.on_ranks`) for 3 steps of a small model, beside
plain data parallelism, and watches what it sent (:func:`labkit.parallel.traffic.count_traffic`)
as well as what it computed: an all-reduce gives the right numbers but is not ZeRO-2.
"""

from __future__ import annotations

from ...check import NotYet, exercise, on_ranks

NOTEBOOK = "10"
__all__ = ["zero2_step"]

_STEPS, _LR, _TOL = 3, 1e-2, 1e-5
_WIDTH, _DEPTH = 4, 2  # mlp_blocks(2, 4): 296 parameters, a multiple of 2 and of 4


def _which(t, shards, world=None):
    """Which of ``shards`` ``t`` equals (each times ``world`` if given); None if none."""
    import torch

    for k, s in enumerate(shards):
        want = s * world if world else s
        if t.shape == want.shape and torch.allclose(t, want, rtol=1e-5, atol=1e-7):
            return k
    return None


def _zero2_probe(fn, steps: int = _STEPS, seed: int = 0) -> dict:
    """Grading worker: ``fn`` for ``steps`` steps beside data parallelism; what it did, per step.

    Every rank trains ``mlp_blocks(2, 4)`` on its own batches. Before each call the full
    average gradient is computed apart (an all-reduce outside the count), so that the shards
    ``update_shard`` receives can be recognised: whose shard, averaged or summed.
    """
    import torch
    import torch.distributed as dist

    from ...parallel import traffic, zero
    from ...parallel.memory import mlp_blocks

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)
    model = mlp_blocks(_DEPTH, _WIDTH)
    torch.manual_seed(seed)
    ref = mlp_blocks(_DEPTH, _WIDTH)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=_LR)
    flat = zero.flat_params(model, world)
    n = flat.shard_numel
    state = {"m": torch.zeros(n), "v": torch.zeros(n), "t": 0}
    log: list[dict] = []
    counter: dict = {}

    def update_shard(param_shard, grad_shard):
        """Adam on this rank's shard; returns the new shard (a new tensor)."""
        entry = {"at": len(counter["t"].calls),
                 "shapes": (tuple(getattr(param_shard, "shape", ())),
                            tuple(getattr(grad_shard, "shape", ())))}
        log.append(entry)
        if entry["shapes"] != ((n,), (n,)):
            return param_shard.detach().clone() if torch.is_tensor(param_shard) else param_shard
        entry["param"], entry["grad"] = param_shard.detach().clone(), grad_shard.detach().clone()
        new = param_shard.detach().clone()
        state["t"] += 1
        zero.adam_update(new, grad_shard.detach(), state["m"], state["v"], state["t"], lr=_LR)
        return new

    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 7919 + step * 101 + rank)
        x, y = torch.randn(2, 8, _WIDTH, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        flat_grad = torch.zeros_like(flat.flat)
        for p in flat.params:
            flat.view(flat_grad, p).copy_(p.grad)
            p.grad = None
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():  # plain data parallelism, the reference
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        ref_opt.step()
        ref_opt.zero_grad()
        average = flat_grad.clone()
        dist.all_reduce(average)
        average.div_(world)
        before = flat.flat.clone()
        log.clear()
        with torch.no_grad(), traffic.count_traffic() as counter["t"]:
            fn(flat.flat, flat_grad.clone(), update_shard)
        after = flat.flat.detach().clone()
        rank0 = after.clone()
        dist.broadcast(rank0, src=0)
        want = torch.zeros_like(after)
        for p, q in zip(flat.params, ref.parameters(), strict=True):
            flat.view(want, p).copy_(q.detach())
        shards_of = lambda t: list(t.split(n))  # noqa: E731
        updates = []
        for u in log:
            seen = {"at": u["at"], "shapes": u["shapes"]}
            if "grad" in u:
                seen.update(avg=_which(u["grad"], shards_of(average)),
                            sum=_which(u["grad"], shards_of(average), world),
                            param=_which(u["param"], shards_of(before)))
            updates.append(seen)
        with torch.no_grad():  # the next step starts from what this one left, as in training
            flat.flat.copy_(after)
        out.append({"calls": [(c.op, c.sent_bytes) for c in counter["t"].calls],
                    "sent": counter["t"].sent_bytes(), "updates": updates,
                    "param_diff": (after - want).abs().max().item(),
                    "spread": (after - rank0).abs().max().item(),
                    "unchanged": bool(torch.equal(after, before))})
    return {"rank": rank, "world": world, "numel": flat.padded, "shard": n, "steps": out}


def _update_mistake(where: str, u: dict, rank: int, world: int, shard: int) -> NotYet | None:
    """What is wrong with the shards this rank handed ``update_shard``, if anything."""
    mine = f"flat_params[rank * shard:(rank + 1) * shard] with shard = numel // world = {shard}"
    if u["shapes"] != ((shard,), (shard,)):
        return NotYet(f"{where}: update_shard got shards of shapes {u['shapes'][0]} and "
                      f"{u['shapes'][1]}; this rank's shard has {shard} elements",
                      f"pass this rank's shard, numel // world elements: the gradient shard "
                      f"that reduce_scatter_tensor writes, and the parameters {mine}")
    if u["sum"] is not None and u["avg"] is None:
        return NotYet(f"{where}: the gradient shard is {world} times the average (the sum over "
                      f"the ranks)",
                      f"forgot to average: reduce_scatter_tensor sums over the ranks; divide "
                      f"the shard by the world size ({world}), as data parallelism divides its "
                      f"all-reduce")
    got = u["avg"] if u["avg"] is not None else u["sum"]
    if (got is not None and got != rank) or (u["param"] is not None and u["param"] != rank):
        other = got if got is not None and got != rank else u["param"]
        return NotYet(f"{where}: updated shard {other}, not its own shard {rank}",
                      f"updated the wrong shard: rank r owns elements [r * shard, (r + 1) * "
                      f"shard), the slice reduce_scatter_tensor hands it; use {mine}")
    if u["param"] is None:
        return NotYet(f"{where}: the parameter shard is no whole shard of flat_params",
                      f"updated the wrong shard: the parameters to update are {mine} (the "
                      f"offset is rank * shard, not rank)")
    if got is None:
        return NotYet(f"{where}: the gradient shard is not this rank's slice of the average "
                      f"gradient",
                      "reduce-scatter the full local gradient (reduce_scatter_tensor(out, "
                      "flat_grad): this rank's slice of the sum over ranks), then divide by the "
                      "world size")
    return None


def _step_mistake(where: str, s: dict, world: int, numel: int) -> NotYet | None:
    """What is wrong with one step's communication and result on one rank, if anything."""
    ops = [op for op, _ in s["calls"]]
    right = s["param_diff"] <= _TOL
    at = s["updates"][0]["at"]
    if "broadcast" in ops:
        if right:
            return NotYet(f"{where}: right parameters, sent with broadcasts ({ops})",
                          "each rank contributes its updated shard: one all_gather_into_tensor"
                          "(flat_params, new_shard) does it in one collective")
        return NotYet(f"{where}: every rank ends with rank 0's copy (parameters off by "
                      f"{s['param_diff']:.2g}; only shard 0 is updated)",
                      "a broadcast from rank 0 sends rank 0's flat_params, in which only its "
                      "own shard was updated; every rank must contribute its updated shard: "
                      "all_gather_into_tensor(flat_params, new_shard)")
    if "all_gather" not in ops:
        return NotYet(f"{where}: the ranks' parameters diverge (by up to {s['spread']:.2g} "
                      f"from rank 0's): each updated only its own shard",
                      "forgot the all-gather: after the update, all_gather_into_tensor("
                      "flat_params, new_shard) gives every rank every updated shard")
    if ops.index("all_gather") < at:
        return NotYet(f"{where}: all-gathered (call {ops.index('all_gather') + 1}) before "
                      f"update_shard ran (after call {at})",
                      "all-gathered before updating: the gather spreads the OLD shards; "
                      "update this rank's shard first, then all-gather the new one")
    if s["unchanged"]:
        return NotYet(f"{where}: flat_params was left as it was",
                      "update flat_params in place: all_gather_into_tensor(flat_params, "
                      "new_shard) writes into it (returning a new tensor does not count)")
    if not right:
        return NotYet(f"{where}: parameters off by {s['param_diff']:.2g} from data parallelism",
                      "the shards were right; check where the new shard goes: "
                      "all_gather_into_tensor(flat_params, new_shard) puts rank r's at "
                      "[r * shard, (r + 1) * shard)")
    if "all_reduce" in ops:
        return NotYet(f"{where}: right parameters, but with an all-reduce ({ops})",
                      "right answer, but every rank held the full averaged gradient: that is "
                      "data parallelism, not ZeRO-2. reduce_scatter_tensor gives each rank only "
                      "its shard of the sum (half an all-reduce's traffic)")
    want = 2 * (world - 1) * 4 * numel // world
    if s["sent"] != want:
        return NotYet(f"{where}: sent {s['sent']:,} bytes ({ops}); a reduce-scatter and an "
                      f"all-gather of {numel} floats send {want:,}",
                      "one reduce_scatter_tensor of flat_grad and one all_gather_into_tensor "
                      "of the new shard: nothing more")
    return None


@exercise("zero2_step", notebook=NOTEBOOK,
          title="ZeRO-2's step: reduce-scatter the gradients, update your shard, all-gather the "
                "parameters")
def zero2_step(fn) -> str:
    """Exercise: ``fn(flat_params, flat_grad, update_shard)``, one ZeRO-2 step's communication.

    ``flat_params``: the model's parameters as one flat fp32 tensor, the same on every rank
    (its numel divides by the world size); ``flat_grad``: this rank's full local gradient, same
    shape; ``update_shard(param_shard, grad_shard)``: Adam on this rank's shard (given; it
    keeps the state of that shard), returns the new parameter shard as a new tensor. ``fn``
    must leave ``flat_params`` updated in place, the same on every rank, as plain data
    parallelism (all-reduce, divide, Adam on everything) would have it. Run on 2 and 4 gloo
    ranks for 3 steps; the collectives are counted too.

    Example::

        >>> exercise.zero2_step(my_zero2_step)
        [pass] ZeRO-2's step: ...: equal to data parallelism for 3 steps on 2 and 4 ranks ...
    """
    sent = {}
    for world in (2, 4):
        ranks = on_ranks(_zero2_probe, fn, nproc=world, timeout=120)
        numel, shard = ranks[0]["numel"], ranks[0]["shard"]
        for step in range(_STEPS):
            # What every rank handed update_shard first: one rank's wrong shard spoils the
            # result on all of them, so it is named before any result is compared.
            where = [f"on {world} ranks, step {step + 1}, rank {r}" for r in range(world)]
            for r, got in enumerate(ranks):
                updates = got["steps"][step]["updates"]
                if len(updates) != 1:
                    raise NotYet(f"{where[r]}: update_shard was called {len(updates)} times",
                                 "call update_shard(param_shard, grad_shard) once per step, "
                                 "with this rank's shards: it is Adam on the shard this rank "
                                 "owns, and keeps that shard's state")
                mistake = _update_mistake(where[r], updates[0], r, world, shard)
                if mistake is not None:
                    raise mistake
            for r, got in enumerate(ranks):
                mistake = _step_mistake(where[r], got["steps"][step], world, numel)
                if mistake is not None:
                    raise mistake
        sent[world] = ranks[0]["steps"][0]["sent"]
    return (f"equal to data parallelism for {_STEPS} steps on 2 and 4 gloo ranks, each rank "
            f"updating only its shard; one reduce-scatter and one all-gather a step, "
            f"{sent[2]:,} and {sent[4]:,} bytes sent per rank (the same as one all-reduce of "
            f"the {numel} parameters)")

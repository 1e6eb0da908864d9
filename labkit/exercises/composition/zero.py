"""Notebook 10's ZeRO exercise: the communication of one ZeRO-1 step, on flat tensors.

(ZeRO-2 does the same two collectives, its reduce-scatter moved into backward.)

The learner writes ``my_zero1_step(flat_params, flat_grad, update_shard)``; the grader runs it on
2 and 4 real gloo ranks (:func:`labkit.check.on_ranks`) for 3 steps of a small model, beside
plain data parallelism, and watches what it sent (:func:`labkit.parallel.traffic.count_traffic`)
as well as what it computed: an all-reduce gives the right numbers but is not ZeRO.
"""

from __future__ import annotations

from ...check import NotYet, exercise, on_ranks

NOTEBOOK = "10"
__all__ = ["zero1_step"]

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


def _zero1_probe(fn, steps: int = _STEPS, seed: int = 0) -> dict:
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


def _phase_ops(calls, at: int) -> tuple[list[str], list[str]]:
    """The ops before ``update_shard`` ran (the gradient's) and after (the parameters')."""
    return [op for op, _ in calls[:at]], [op for op, _ in calls[at:]]


def _step_mistake(where: str, s: dict, world: int, numel: int) -> NotYet | None:
    """What is wrong with one step's communication and result on one rank, if anything.

    The result first, then the route: the gradient's half (before ``update_shard``) and the
    parameters' half (after) each send (n-1)/n of the flat tensor, by collectives or by the
    point-to-point ring of notebook 06 alike; an all-reduce in either half is named.
    """
    ops = [op for op, _ in s["calls"]]
    right = s["param_diff"] <= _TOL
    at = s["updates"][0]["at"]
    grad_ops, param_ops = _phase_ops(s["calls"], at)
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
    if not right:
        if not param_ops and "all_gather" in grad_ops:
            return NotYet(f"{where}: all-gathered (call {grad_ops.index('all_gather') + 1}) "
                          f"before update_shard ran (after call {at})",
                          "all-gathered before updating: the gather spreads the OLD shards; "
                          "update this rank's shard first, then all-gather the new one")
        if s["unchanged"]:
            return NotYet(f"{where}: flat_params was left as it was",
                          "update flat_params in place: all_gather_into_tensor(flat_params, "
                          "new_shard) writes into it (returning a new tensor does not count)")
        if not param_ops:
            return NotYet(f"{where}: the ranks' parameters diverge (by up to "
                          f"{s['spread']:.2g} from rank 0's): each updated only its own shard, "
                          f"and nothing was sent after update_shard",
                          "forgot the all-gather: after the update, all_gather_into_tensor("
                          "flat_params, new_shard) gives every rank every updated shard")
        return NotYet(f"{where}: parameters off by {s['param_diff']:.2g} from data parallelism",
                      "the shards were right; check where the new shard goes: "
                      "all_gather_into_tensor(flat_params, new_shard) puts rank r's at "
                      "[r * shard, (r + 1) * shard)")
    if "all_reduce" in grad_ops:
        return NotYet(f"{where}: right parameters, but the gradient went through an all-reduce "
                      f"({ops})",
                      "right answer, but every rank held the full averaged gradient: that is "
                      "data parallelism, not ZeRO. reduce_scatter_tensor gives each rank only "
                      "its shard of the sum (half an all-reduce's traffic)")
    half = (world - 1) * 4 * numel // world  # a reduce-scatter's, or an all-gather's, bytes
    if "all_reduce" in param_ops:
        sent = sum(b for _, b in s["calls"][at:])
        return NotYet(f"{where}: right parameters, but gathered with an all-reduce ({ops}): "
                      f"{sent:,} bytes sent after update_shard, where an all-gather sends "
                      f"{half:,}",
                      "summing zero-padded shards with an all-reduce gives every rank every "
                      "shard, at twice an all-gather's traffic: all_gather_into_tensor("
                      "flat_params, new_shard) sends each shard once (a ring of isend/irecv as "
                      "in notebook 06 does too)")
    for phase, calls, what in (("before", s["calls"][:at], "a reduce-scatter of the gradient"),
                               ("after", s["calls"][at:], "an all-gather of the parameters")):
        sent = sum(b for _, b in calls)
        if sent != half:
            return NotYet(f"{where}: sent {sent:,} bytes {phase} update_shard "
                          f"({[op for op, _ in calls]}); {what} of {numel} floats sends "
                          f"{half:,}",
                          "one reduce_scatter_tensor of flat_grad and one all_gather_into_tensor "
                          "of the new shard (or the same by a ring of isend/irecv): nothing more")
    return None


@exercise("zero1_step", notebook=NOTEBOOK,
          title="ZeRO-1's step: reduce-scatter the gradients, update your shard, all-gather the "
                "parameters")
def zero1_step(fn) -> str:
    """Exercise: ``fn(flat_params, flat_grad, update_shard)``, one ZeRO-1 step's communication.

    ``flat_params``: the model's parameters as one flat fp32 tensor, the same on every rank
    (its numel divides by the world size); ``flat_grad``: this rank's full local gradient, same
    shape; ``update_shard(param_shard, grad_shard)``: Adam on this rank's shard (given; it
    keeps the state of that shard), returns the new parameter shard as a new tensor. ``fn``
    must leave ``flat_params`` updated in place, the same on every rank, as plain data
    parallelism (all-reduce, divide, Adam on everything) would have it. Run on 2 and 4 gloo
    ranks for 3 steps; the collectives are counted too.

    Example::

        >>> exercise.zero1_step(my_zero1_step)
        [pass] ZeRO-1's step: ...: equal to data parallelism for 3 steps on 2 and 4 ranks ...
    """
    sent = {}
    for world in (2, 4):
        ranks = on_ranks(_zero1_probe, fn, nproc=world, timeout=120)
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
            f"updating only its shard; a reduce-scatter's bytes before the update and an "
            f"all-gather's after, {sent[2]:,} and {sent[4]:,} bytes sent per rank (the same as "
            f"one all-reduce of the {numel} parameters)")


# ==== challenge: ZeRO-3's gather-and-free, one layer as an autograd Function ==================
# Graded on 2 and 4 ranks: the shards' gradients and the weights after two SGD steps against
# one process on the global batch; the route per layer (an all-gather before its forward, another
# before its backward, a reduce-scatter after it); and what the graph keeps between the two
# passes (the shard and the input, never the full parameters).

__all__ += ["zero3_linear"]  # noqa: PLE0605

_Z3_LAYERS = ((5, 4), (4, 3), (3, 2), (2, 1))  # (in, out): 24, 15, 8, 3 parameters
_Z3_BATCH, _Z3_STEPS, _Z3_LR = 5, 2, 0.1  # batch per rank: no layer has 5 outputs (shapes apart)
_Z3_TOL = {"float32": 1e-5, "float64": 1e-12}
_Z3_ROUTE = ("per layer: forward, one all-gather of the shards into the full flat parameters "
             "(dist.all_gather_into_tensor), the layer computed, the full parameters dropped; "
             "backward, one all-gather again, the gradients of x, W and b, then one "
             "reduce-scatter (dist.reduce_scatter_tensor) of the full flat gradient into the "
             "shard's, divided by the world size")


def _z3_padded(n: int, world: int) -> int:
    return -(-n // world) * world


def _z3_saved_full(node, in_f: int, out_f: int, world: int) -> str | None:
    """What of the full parameters the graph node ``node`` keeps for backward, if anything."""
    import torch

    kept = list(getattr(node, "saved_tensors", ()) or ())
    kept += [v for v in vars(node).values() if isinstance(v, torch.Tensor)] if hasattr(
        node, "__dict__") else []
    for t in kept:
        if tuple(t.shape) in ((out_f, in_f), (in_f, out_f)):
            return f"a tensor of shape {tuple(t.shape)} (the weight)"
        if t.dim() == 1 and t.numel() >= _z3_padded(out_f * in_f + out_f, world):
            return f"a flat tensor of {t.numel()} elements (the full parameters)"
    return None


def _zero3_worker(fn, dtypes) -> list[dict]:
    """Each rank, each dtype: ``_Z3_STEPS`` SGD steps of 4 sharded layers through ``fn``."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from ...parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        torch.manual_seed(0)
        ref = [nn.Linear(i, o).to(dt) for i, o in _Z3_LAYERS]

        def flat_of(layer, world=world):
            flat = torch.cat([layer.weight.detach().reshape(-1), layer.bias.detach()])
            return torch.cat([flat, flat.new_zeros(_z3_padded(flat.numel(), world) - len(flat))])

        shards = []
        for layer in ref:
            flat = flat_of(layer)
            s = flat.numel() // world
            shards.append(flat[rank * s:(rank + 1) * s].clone().requires_grad_())
        steps = []
        for step in range(_Z3_STEPS):
            g = torch.Generator().manual_seed(100 + step)
            x_all = torch.randn(world * _Z3_BATCH, _Z3_LAYERS[0][0], generator=g).to(dt)
            t_all = torch.randn(world * _Z3_BATCH, 1, generator=g).to(dt)
            mine = slice(rank * _Z3_BATCH, (rank + 1) * _Z3_BATCH)
            h, nodes = x_all[mine], []
            with traffic.count_traffic() as fwd:
                for k, ((i, o), shard) in enumerate(zip(_Z3_LAYERS, shards, strict=True)):
                    h = fn.apply(h, shard, i, o)
                    if not isinstance(h, torch.Tensor):
                        break
                    nodes.append(h.grad_fn)
                    if k < len(_Z3_LAYERS) - 1:
                        h = torch.tanh(h)
            record = {"forward": [(c.op, c.payload_bytes) for c in fwd.calls],
                      "returned": type(h).__name__}
            if not isinstance(h, torch.Tensor) or h.grad_fn is None:
                steps.append(record)
                break
            record["kept"] = [_z3_saved_full(n, i, o, world) if n is not None else None
                              for n, (i, o) in zip(nodes, _Z3_LAYERS, strict=True)]
            loss = nn.functional.mse_loss(h, t_all[mine])
            with traffic.count_traffic() as bwd:
                loss.backward()
            record["backward"] = [(c.op, c.payload_bytes) for c in bwd.calls]
            # the reference: one process, the global batch, the same step
            hr = x_all
            for k, layer in enumerate(ref):
                hr = layer(hr)
                if k < len(ref) - 1:
                    hr = torch.tanh(hr)
            nn.functional.mse_loss(hr, t_all).backward()
            want = []
            for layer in ref:
                flat = torch.cat([layer.weight.grad.reshape(-1), layer.bias.grad])
                flat = torch.cat([flat, flat.new_zeros(_z3_padded(len(flat), world) - len(flat))])
                s = flat.numel() // world
                want.append(flat[rank * s:(rank + 1) * s].clone())
            record["grads"] = [None if s.grad is None else s.grad.detach().clone()
                               for s in shards]
            record["want"] = want
            steps.append(record)
            with torch.no_grad():
                for shard, layer in zip(shards, ref, strict=True):
                    if shard.grad is not None:
                        shard -= _Z3_LR * shard.grad
                    shard.grad = None
                    for p in layer.parameters():
                        p -= _Z3_LR * p.grad
                        p.grad = None
        finals = []
        for layer in ref:
            flat = flat_of(layer)
            s = flat.numel() // world
            finals.append(flat[rank * s:(rank + 1) * s])
        out.append({"dtype": dtype, "steps": steps,
                    "shards": [s.detach().clone() for s in shards], "finals": finals})
    return out


def _z3_route(where: str, rec: dict, esize: int, world: int) -> None:
    padded = [_z3_padded(i * o + o, world) * esize for i, o in _Z3_LAYERS]
    fwd, bwd = rec["forward"], rec["backward"]
    want_fwd = [("all_gather", b) for b in padded]
    want_bwd = [c for b in reversed(padded) for c in (("all_gather", b), ("reduce_scatter", b))]
    for phase, got, want in (("forward", fwd, want_fwd), ("backward", bwd, want_bwd)):
        if got == want:
            continue
        ops = [op for op, _ in got]
        if phase == "backward" and "all_reduce" in ops:
            raise NotYet(f"{where}: the backward all-reduced the gradients "
                         f"({ops.count('all_reduce')} calls)",
                         "an all-reduce hands every rank the whole averaged gradient and sends "
                         "twice a reduce-scatter's bytes; a rank needs only its shard: "
                         "reduce-scatter the full flat gradient (dist.reduce_scatter_tensor), "
                         "then divide by the world size")
        if phase == "backward" and ops.count("all_gather") == 0 and ops:
            raise NotYet(f"{where}: the backward gathered no parameters",
                         "if the full parameters are dropped after forward (they must be), "
                         "backward needs them again: one all-gather per layer in backward")
        if phase == "forward" and len(got) > len(want):
            raise NotYet(f"{where}: the forward made {len(got)} calls "
                         f"({', '.join(sorted(set(ops)))}); one all-gather per layer is all it "
                         f"needs", _Z3_ROUTE)
        raise NotYet(f"{where}: the {phase} called {ops} with payloads "
                     f"{[b for _, b in got]} bytes; want {[op for op, _ in want]} with "
                     f"{[b for _, b in want]} (each layer's padded flat parameters)", _Z3_ROUTE)


@exercise("zero3_linear", notebook=NOTEBOOK,
          title="challenge: ZeRO-3's gather and free, one layer as an autograd Function")
def zero3_linear(fn, worlds=(2, 4), dtypes=("float32", "float64")) -> str:
    """Challenge: ``fn.apply(x, shard, in_features, out_features)`` is a Linear layer of which
    this rank holds only ``shard``: ZeRO-3's gather-and-free for one layer.

    The layer's parameters, ``torch.cat([weight.reshape(-1), bias])`` zero-padded to a multiple
    of the world size, are cut into equal shards; rank r holds shard r. Run on real gloo ranks
    (``worlds``) through 4 such layers (24, 15, 8 and 3 parameters: padding, and on 4 ranks a
    rank whose shard is all padding), two SGD steps on the shards: the shards' gradients and
    final values equal one process's on the global batch; per layer the forward makes one
    all-gather, the backward one all-gather and one reduce-scatter; the graph keeps no full
    parameters between the two passes.

    Example::

        >>> exercise.zero3_linear(MyZero3Linear)
        [pass] challenge: ZeRO-3's gather and free, one layer as an autograd Function: ...
    """
    import torch

    if not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        raise NotYet(f"got {type(fn).__name__}, not a torch.autograd.Function class",
                     "define `class MyZero3Linear(torch.autograd.Function)` with static methods "
                     "forward(ctx, x, shard, in_features, out_features) and backward(ctx, "
                     "grad_out), and pass the class")
    for world in worlds:
        ranks = on_ranks(_zero3_worker, fn, dtypes, nproc=world, timeout=60.0)
        for rank, per_dtype in enumerate(ranks):
            for got in per_dtype:
                dtype, tol = got["dtype"], _Z3_TOL[got["dtype"]]
                esize = got["shards"][0].element_size()
                for step, rec in enumerate(got["steps"], start=1):
                    where = f"on {world} ranks (rank {rank}), {dtype}, step {step}"
                    if "kept" not in rec:
                        raise NotYet(f"{where}: forward returned {rec['returned']} with no "
                                     f"graph", "forward returns x @ W.T + b, a tensor; call it "
                                     "as MyZero3Linear.apply(x, shard, in_features, "
                                     "out_features) so that autograd records it")
                    kept = [(k, what) for k, what in enumerate(rec["kept"], start=1) if what]
                    if kept:
                        k, what = kept[0]
                        raise NotYet(f"{where}: layer {k} keeps {what} from forward to backward",
                                     "free the full parameters after forward: save only the "
                                     "input and the shard (ctx.save_for_backward(x, shard)) and "
                                     "gather them again in backward; keeping them is ZeRO-2's "
                                     "memory, not ZeRO-3's")
                    _z3_values(where, rec, world, tol)
                    _z3_route(where, rec, esize, world)
                gap = max(float((s.double() - f.double()).abs().max()) if s.numel() else 0.0
                          for s, f in zip(got["shards"], got["finals"], strict=True))
                if gap > tol:
                    raise NotYet(f"on {world} ranks (rank {rank}), {dtype}: after {_Z3_STEPS} "
                                 f"steps the shards differ from one process's weights by "
                                 f"{gap:.2g}", "the gradients were right: leave the update to "
                                 "the loop, and do not change the shard in forward or backward")
    return (f"on {' and '.join(map(str, worlds))} ranks, {' and '.join(dtypes)}, 4 layers "
            f"(padded shards, one all padding): shard gradients and weights after {_Z3_STEPS} "
            f"steps equal one process's; per layer one all-gather forward, one all-gather and "
            f"one reduce-scatter backward, no full parameters kept between the passes")


def _z3_values(where: str, rec: dict, world: int, tol: float) -> None:
    for k, (got, want) in enumerate(zip(rec["grads"], rec["want"], strict=True), start=1):
        if got is None:
            raise NotYet(f"{where}: layer {k}'s shard has no gradient after backward",
                         "backward returns (gradient of x, gradient of the shard, None, None): "
                         "the shard's is this rank's slice of the reduce-scattered flat "
                         "gradient, divided by the world size")
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            raise NotYet(f"{where}: layer {k}'s shard gradient is {got.dtype} of shape "
                         f"{tuple(got.shape)}; the shard is {want.dtype} of shape "
                         f"{tuple(want.shape)}", "the shard's gradient has the shard's shape "
                         "and dtype: the reduce-scatter's output, shard.new_empty(shard.shape)")
        gap = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        if gap <= tol:
            continue
        if float((got.double() - world * want.double()).abs().max()) <= tol * world:
            raise NotYet(f"{where}: layer {k}'s shard gradient is {world}x the global batch's",
                         "reduce-scatter sums over the ranks: divide by the world size")
        raise NotYet(f"{where}: layer {k}'s shard gradient differs from the global batch's by "
                     f"{gap:.2g}", "the flat gradient is torch.cat([grad_W.reshape(-1), grad_b])"
                     " zero-padded like the parameters, grad_W = grad_out.T @ x, grad_b = "
                     "grad_out.sum(0); rank r keeps slice r of its reduce-scatter")

"""Notebook 09's sequence-parallelism exercise: SP's all-gather / reduce-scatter conjugate pair.

The learner writes two ``torch.autograd.Function`` classes over the default process group:
``MyGatherSeq`` (all-gather along dim 0, the sequence, forward; reduce-scatter backward) and
``MyScatterSeq`` (reduce-scatter forward; all-gather backward). The grader runs them on 2 and
on 4 real gloo ranks (:func:`labkit.check.on_ranks`), in float32 and float64: first each on known
tensors, so that a wrong half is named, values then route (each half is one collective of the
right kind and size, counted with :func:`labkit.parallel.traffic.count_traffic`: an all-reduce
then a slice gives the right numbers for twice the bytes), then together in a sequence-parallel
MLP whose output shard and every gradient must equal the dense MLP's, with one all-gather and
one reduce-scatter each way, each of the whole activation's bytes.
"""

from __future__ import annotations

from ...check import NotYet, exercise, on_ranks

NOTEBOOK = "09"

__all__ = ["sp_collectives"]

_SHARD = (2, 3, 4)  # rows (tokens) per rank, batch, hidden: a probe shard


def _attempt(step):
    """``step()``'s tensor (detached, on the CPU), or the error it raised, as plain data."""
    try:
        out = step()
    except Exception as exc:  # the learner's code: any failure is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    return {"value": out.detach().cpu().clone()} if hasattr(out, "detach") else {
        "error": f"returned {type(out).__name__}, not a tensor"}


def _raw_backward(cls, grad):
    """The learner's ``backward`` called directly (no shape check), to see what it computes."""
    import types

    ctx = types.SimpleNamespace(saved_tensors=(), needs_input_grad=(True,))
    out = cls.backward(ctx, grad)
    return out[0] if isinstance(out, tuple) else out


def _base(t: int, dtype: str):
    """The probe's whole tensor: (t * seq/t, batch, hidden), every element a different integer."""
    import torch

    s, b, h = _SHARD
    return (torch.arange(float(t * s * b * h)).view(t * s, b, h) + 1.0).to(getattr(torch, dtype))


def _probe(gather_cls, scatter_cls, dtype: str = "float32") -> dict:
    """Grading worker: each class forward and backward on known tensors of ``dtype`` (see the
    grader), and the calls each of the four steps made (``traffic``: (op, payload bytes))."""
    import torch
    import torch.distributed as dist

    from ...parallel import traffic

    rank, t = dist.get_rank(), dist.get_world_size()
    s = _SHARD[0]
    base = _base(t, dtype)
    mine = slice(rank * s, (rank + 1) * s)
    found: dict = {"traffic": {}}
    x = base[mine].clone().requires_grad_()
    holder = {}

    def counted(step, name):
        with traffic.count_traffic() as seen:
            out = _attempt(step)
        found["traffic"][name] = [(c.op, c.payload_bytes) for c in seen.calls]
        return out

    def gather_forward():
        holder["y"] = gather_cls.apply(x * 1.0)
        return holder["y"]

    found["gather_forward"] = counted(gather_forward, "gather_forward")
    upstream = base * (rank + 1.0)  # each rank's own gradient of the gathered tensor
    if "value" in found["gather_forward"] and found["gather_forward"]["value"].shape == base.shape:
        found["gather_backward"] = counted(
            lambda: torch.autograd.grad(holder["y"], x, upstream)[0], "gather_backward")
        if "error" in found["gather_backward"]:
            found["gather_raw"] = _attempt(lambda: _raw_backward(gather_cls, upstream.clone()))
    z = (base * (rank + 1.0)).requires_grad_()  # partial sums: rank r holds (r + 1) * base

    def scatter_forward():
        holder["w"] = scatter_cls.apply(z * 1.0)
        return holder["w"]

    found["scatter_forward"] = counted(scatter_forward, "scatter_forward")
    shard_grad = base[mine] * (rank + 1.0)
    if "value" in found["scatter_forward"] and found["scatter_forward"]["value"].shape == \
            shard_grad.shape:
        found["scatter_backward"] = counted(
            lambda: torch.autograd.grad(holder["w"], z, shard_grad)[0], "scatter_backward")
        if "error" in found["scatter_backward"]:
            found["scatter_raw"] = _attempt(lambda: _raw_backward(scatter_cls, shard_grad.clone()))
    return found


def _sp_mlp(gather_cls, scatter_cls, dtype: str = "float32", seq: int = 8, batch: int = 2,
            hidden: int = 16, seed: int = 0) -> dict:
    """Grading worker: LayerNorm -> gather -> column fc1 -> GELU -> row fc2 -> scatter, vs dense.

    Returns the worst difference from the dense MLP of the output shard and of each gradient
    (the LayerNorm's and fc2's bias all-reduced first, as SP requires), and the calls of the
    forward and of the backward as (op, payload bytes).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from ...parallel import traffic

    rank, t = dist.get_rank(), dist.get_world_size()
    dt = getattr(torch, dtype)
    torch.manual_seed(seed)
    ln, fc1, fc2 = nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden,
                                                                                 hidden)
    with torch.no_grad():  # LayerNorm starts at 1 and 0: move it, so its gradients show
        ln.weight.add_(torch.randn(hidden) * 0.1)
        ln.bias.add_(torch.randn(hidden) * 0.1)
    ln, fc1, fc2 = (module.to(dt) for module in (ln, fc1, fc2))
    x, dy = torch.randn(seq, batch, hidden, dtype=dt), torch.randn(seq, batch, hidden, dtype=dt)
    xd = x.clone().requires_grad_()
    dense_out = fc2(F.gelu(fc1(ln(xd))))
    dense_out.backward(dy)

    tokens = slice(rank * seq // t, (rank + 1) * seq // t)
    cols = slice(rank * 4 * hidden // t, (rank + 1) * 4 * hidden // t)
    leaf = lambda v: v.detach()[...].clone().requires_grad_()  # noqa: E731
    w_ln, b_ln = leaf(ln.weight), leaf(ln.bias)
    w1, b1 = leaf(fc1.weight[cols]), leaf(fc1.bias[cols])
    w2, b2 = leaf(fc2.weight[:, cols]), leaf(fc2.bias)
    xs = leaf(x[tokens])
    outs = []
    with traffic.count_traffic() as forward:
        h = gather_cls.apply(F.layer_norm(xs, (hidden,), w_ln, b_ln))  # every token
        m = F.linear(F.gelu(F.linear(h, w1, b1)), w2)                   # a partial sum
        outs.append(scatter_cls.apply(m) + b2)                           # my tokens, summed
    with traffic.count_traffic() as backward:
        outs[0].backward(dy[tokens])
    for p in (w_ln, b_ln, b2):  # they saw only this rank's tokens: the grader's job, not yours
        dist.all_reduce(p.grad)
    pairs = {"output": (outs[0], dense_out[tokens]), "input gradient": (xs.grad, xd.grad[tokens]),
             "LayerNorm weight gradient": (w_ln.grad, ln.weight.grad),
             "LayerNorm bias gradient": (b_ln.grad, ln.bias.grad),
             "fc1 weight gradient": (w1.grad, fc1.weight.grad[cols]),
             "fc1 bias gradient": (b1.grad, fc1.bias.grad[cols]),
             "fc2 weight gradient": (w2.grad, fc2.weight.grad[:, cols]),
             "fc2 bias gradient": (b2.grad, fc2.bias.grad)}
    return {"diffs": {k: (a.double() - b.double()).abs().max().item() if a.dtype == b.dtype
                      else float("inf") for k, (a, b) in pairs.items()},
            "calls": {"forward": [(c.op, c.payload_bytes) for c in forward.calls],
                      "backward": [(c.op, c.payload_bytes) for c in backward.calls]},
            "whole": seq * batch * hidden * torch.finfo(dt).bits // 8}


def _same(got, want) -> bool:
    import torch

    return (got is not None and got.shape == want.shape and got.dtype == want.dtype
            and torch.allclose(got, want, rtol=1e-5, atol=1e-4))


def _dtype_mistake(r: int, found: dict, dtype: str) -> NotYet | None:
    """A step that returned another dtype than its input's, named (before any value check)."""
    import torch

    want = getattr(torch, dtype)
    for step, (cls, part) in {"gather_forward": ("MyGatherSeq", "forward"),
                              "gather_backward": ("MyGatherSeq", "backward"),
                              "scatter_forward": ("MyScatterSeq", "forward"),
                              "scatter_backward": ("MyScatterSeq", "backward")}.items():
        value = found.get(step, {}).get("value")
        if value is not None and value.dtype != want:
            return NotYet(f"rank {r}: {cls}'s {part} returned {str(value.dtype)[6:]} for a "
                          f"{dtype} input",
                          "keep the input's dtype: allocate the output like it (x.new_empty, "
                          "torch.empty_like) and collect in that dtype, so that the collective "
                          "also carries the tensor's own bytes")
    return None


def _gather_mistake(r: int, t: int, found: dict, dtype: str = "float32") -> NotYet | None:
    """What the learner's gather got wrong on rank ``r`` of ``t``, if anything."""
    s, b, h = _SHARD
    base = _base(t, dtype)
    mine = base[r * s:(r + 1) * s]
    fwd = found["gather_forward"]
    if "error" in fwd:
        return NotYet(f"rank {r}: MyGatherSeq's forward failed: {fwd['error']}",
                      "forward(ctx, x): allocate the output with t times x's rows "
                      "(x.new_empty((t * x.shape[0], *x.shape[1:]))) and fill it with "
                      "dist.all_gather_into_tensor(out, x.contiguous())")
    got, shard = fwd["value"], tuple(_SHARD)
    if tuple(got.shape) == shard:
        return NotYet(f"rank {r}: MyGatherSeq's forward returned its own shard {shard}, "
                      f"not every rank's tokens {tuple(base.shape)}",
                      "the forward is the all-gather: the column-parallel layer after it needs "
                      "every token of the sequence")
    if tuple(got.shape) == (s, b, h * t):
        return NotYet(f"rank {r}: MyGatherSeq's forward gave shape {tuple(got.shape)}: the "
                      f"shards were joined along the hidden dimension",
                      "gather along dim 0: activations are (seq, batch, hidden) and each rank "
                      "holds seq / t rows of the sequence")
    if tuple(got.shape) == (t, *shard):
        return NotYet(f"rank {r}: MyGatherSeq's forward gave shape {tuple(got.shape)}: the "
                      f"shards were stacked in a new dimension",
                      "concatenate along dim 0 (torch.cat, or all_gather_into_tensor into a "
                      "tensor of t * seq/t rows), do not stack")
    if not _same(got, base):
        return NotYet(f"rank {r}: MyGatherSeq's forward has the right shape but not every "
                      f"rank's rows in rank order",
                      "rank q's shard goes to rows q * seq/t ... (q+1) * seq/t of the output")
    bwd = found["gather_backward"]
    total = t * (t + 1) / 2  # each rank sent (rank + 1) * base as its gradient
    if "error" in bwd:
        raw = found.get("gather_raw", {}).get("value")
        if raw is not None and _same(raw, base * (r + 1.0)):
            return NotYet(f"rank {r}: MyGatherSeq's backward returned the incoming gradient "
                          f"unchanged, shape {tuple(raw.shape)}; x has shape {shard}",
                          "the backward of an all-gather is a reduce-scatter: every rank used "
                          "this rank's tokens, so their gradient is the sum over the ranks of "
                          "the gradient's rows for those tokens (dist.reduce_scatter_tensor)")
        if raw is not None and tuple(raw.shape) == tuple(base.shape):
            return NotYet(f"rank {r}: MyGatherSeq's backward returned a gradient for every token, "
                          f"shape {tuple(raw.shape)}; x, this rank's shard, has shape {shard}",
                          "all-reduce gives every rank all the summed rows; backward must return "
                          "only this rank's rows of the sum: a reduce-scatter, which also sends "
                          "half the bytes of an all-reduce")
        return NotYet(f"rank {r}: MyGatherSeq's backward failed: {bwd['error']}",
                      "backward(ctx, grad) gets the gradient of all the tokens and returns this "
                      "rank's rows of its sum over the ranks: dist.reduce_scatter_tensor(out, "
                      "grad.contiguous()) with out shaped like the shard")
    return _sum_mistake(
        r, bwd["value"], mine * total, mine * (r + 1.0), t,
        kept=("MyGatherSeq's backward kept this rank's rows of its own gradient, without the "
              "other ranks' contributions",
              "every rank used these tokens (with its own slice of the weights), so their "
              "gradient is the SUM over the ranks: reduce-scatter, not a slice"),
        averaged=("MyGatherSeq's backward averaged the gradients over the ranks",
                  "reduce-scatter with the default op, SUM, and no division: the ranks' "
                  "contributions add up to the dense gradient"),
        wrong=("MyGatherSeq's backward returned the wrong values",
               "this rank's rows of the gradient summed over the ranks "
               "(dist.reduce_scatter_tensor)"))


def _sum_mistake(r: int, got, right, own, t: int, *, kept, averaged, wrong) -> NotYet | None:
    """The usual wrong answers where ``right`` is a sum over the ``t`` ranks of which ``own`` is
    this rank's part: ``kept`` (only its own part), ``averaged`` (the sum divided by ``t``),
    ``wrong`` (any other values); each a ``(what, hint)`` pair. None when ``got`` is right."""
    for expected, (what, hint) in ((own, kept), (right / t, averaged)):
        if _same(got, expected):
            return NotYet(f"rank {r}: {what}", hint)
    if not _same(got, right):
        return NotYet(f"rank {r}: {wrong[0]}", wrong[1])
    return None


def _scatter_mistake(r: int, t: int, found: dict, dtype: str = "float32") -> NotYet | None:
    """What the learner's reduce-scatter got wrong on rank ``r`` of ``t``, if anything."""
    import torch

    s, b, h = _SHARD
    base = _base(t, dtype)
    mine, total = base[r * s:(r + 1) * s], t * (t + 1) / 2
    fwd = found["scatter_forward"]
    if "error" in fwd:
        return NotYet(f"rank {r}: MyScatterSeq's forward failed: {fwd['error']}",
                      "forward(ctx, x): out = x.new_empty((x.shape[0] // t, *x.shape[1:])), "
                      "then dist.reduce_scatter_tensor(out, x.contiguous())")
    got = fwd["value"]
    if tuple(got.shape) == tuple(base.shape):
        if _same(got, base * total):
            return NotYet(f"rank {r}: MyScatterSeq's forward returned every token's sum, shape "
                          f"{tuple(got.shape)}",
                          "that is an all-reduce; sequence parallelism keeps only this rank's "
                          "rows of the sum (shape seq/t): a reduce-scatter")
        return NotYet(f"rank {r}: MyScatterSeq's forward returned shape {tuple(got.shape)}, the "
                      f"input's", "the forward is a reduce-scatter: this rank's seq/t rows of "
                                  "the sum over the ranks")
    if tuple(got.shape) == (t * s, b, h // t):
        return NotYet(f"rank {r}: MyScatterSeq's forward gave shape {tuple(got.shape)}: it split "
                      f"the hidden dimension",
                      "reduce-scatter along dim 0: each rank keeps seq / t rows (tokens), every "
                      "hidden feature")
    if tuple(got.shape) != tuple(mine.shape):
        return NotYet(f"rank {r}: MyScatterSeq's forward gave shape {tuple(got.shape)}, "
                      f"expected {tuple(mine.shape)}",
                      "this rank's seq / t rows of the sum: out has x.shape[0] // t rows")
    mistake = _sum_mistake(
        r, got, mine * total, mine * (r + 1.0), t,
        kept=("MyScatterSeq's forward kept its own rows of its own partial sums",
              "the row-parallel layer's outputs are partial sums: they must be summed over the "
              "ranks (reduce-scatter), not just sliced"),
        averaged=("MyScatterSeq's forward averaged the partial sums",
                  "reduce-scatter sums (the default op, SUM), no division: the partial sums add "
                  "up to the dense layer's output"),
        wrong=("MyScatterSeq's forward returned the wrong values",
               "this rank's rows of the sum over the ranks, in rank order"))
    if mistake is not None:
        return mistake
    bwd = found["scatter_backward"]
    want = torch.cat([base[q * s:(q + 1) * s] * (q + 1.0) for q in range(t)])
    if "error" in bwd:
        raw = found.get("scatter_raw", {}).get("value")
        if raw is not None and tuple(raw.shape) == tuple(mine.shape):
            return NotYet(f"rank {r}: MyScatterSeq's backward returned shape {tuple(raw.shape)}, "
                          f"the shard's; the input had every token, {tuple(base.shape)}",
                          "the backward of a reduce-scatter is an all-gather: each rank's "
                          "partial sums fed every rank's tokens, so it needs every rank's "
                          "gradient rows")
        return NotYet(f"rank {r}: MyScatterSeq's backward failed: {bwd['error']}",
                      "backward(ctx, grad): all-gather the gradient along dim 0 "
                      "(dist.all_gather_into_tensor)")
    if not _same(bwd["value"], want):
        return NotYet(f"rank {r}: MyScatterSeq's backward returned the wrong values",
                      "every rank's gradient rows, concatenated along dim 0 in rank order, "
                      "unchanged (no sum: each output row came from one sum)")
    return None


# Each step's one collective: the op, and the tensor whose bytes it carries (the traffic table's
# payload: an all-gather's gathered output, a reduce-scatter's whole input).
_ROUTE = {"gather_forward": ("MyGatherSeq", "forward", "all_gather"),
          "gather_backward": ("MyGatherSeq", "backward", "reduce_scatter"),
          "scatter_forward": ("MyScatterSeq", "forward", "reduce_scatter"),
          "scatter_backward": ("MyScatterSeq", "backward", "all_gather")}
_NAMES = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
          "all_reduce": "all-reduce"}
_TOL = {"float32": 1e-4, "float64": 1e-10}
_MLP_CASES = (("float32", 8), ("float64", 12))  # (dtype, seq): seq splits evenly on 2 and 4


def _sent(calls, t: int) -> int:
    from ...parallel.traffic import ring_bytes

    return sum(ring_bytes(op, size, t) if op in ("all_reduce", "all_gather", "reduce_scatter",
                                                 "send", "recv") else size for op, size in calls)


def _route_mistake(where: str, calls: list, want_op: str, whole: int, t: int) -> NotYet | None:
    """None when ``calls`` are one ``want_op`` carrying ``whole`` bytes; else the route, named.

    ``where`` says whose step it is ("rank 0: MyGatherSeq's backward"); the values were right.
    """
    if calls == [(want_op, whole)]:
        return None
    ops = [op for op, _ in calls]
    want, sent, need = _NAMES[want_op], _sent(calls, t), whole * (t - 1) // t
    used = ", ".join(_NAMES.get(op, op) for op in ops) or "no call"
    said = (f"{where} gave the right values with {used} ({sent:,} bytes sent); one {want} of "
            f"the {whole:,}-byte tensor sends {need:,}")
    if want_op == "reduce_scatter" and "all_reduce" in ops:
        return NotYet(said, "an all-reduce followed by keeping your rows gives the same numbers "
                            "but sends 2(t-1)/t of the tensor instead of (t-1)/t: reduce-scatter "
                            "(dist.reduce_scatter_tensor, or dist.reduce_scatter into a list)")
    if want_op == "all_gather" and "all_reduce" in ops:
        return NotYet(said, "an all-reduce of a zero-padded tensor gathers the rows too, but "
                            "sends 2(t-1)/t of the gathered tensor instead of (t-1)/t: all-gather "
                            "(dist.all_gather_into_tensor, or dist.all_gather into a list)")
    if want_op == "reduce_scatter" and "all_gather" in ops and "reduce_scatter" not in ops:
        return NotYet(said, "an all-gather where a reduce-scatter belongs: gathering every "
                            "rank's whole tensor to sum it here sends (t-1) times the tensor, "
                            "a reduce-scatter (t-1)/t of it, and each rank receives only the "
                            "sums of its own rows")
    if ops == [want_op]:
        return NotYet(f"{where}: its {want} carried a {calls[0][1]:,}-byte tensor; the "
                      f"{'gathered' if want_op == 'all_gather' else 'whole'} tensor is "
                      f"{whole:,} bytes",
                      f"{want} the tensor itself, in its own dtype and rows: not a padded, "
                      f"converted or repeated copy")
    if ops and set(ops) == {want_op}:
        return NotYet(f"{where} gave the right values with {len(ops)} {want}s",
                      f"one {want} of the whole tensor: a collective call per rank or per "
                      f"part pays its start-up cost {len(ops)} times for the same bytes")
    return NotYet(said, f"sequence parallelism communicates with exactly one collective each "
                        f"way in each class: here one {want}")


def _probe_route(r: int, t: int, found: dict, dtype: str) -> NotYet | None:
    import torch

    s, b, h = _SHARD
    whole = t * s * b * h * torch.finfo(getattr(torch, dtype)).bits // 8
    for step, (cls, part, op) in _ROUTE.items():
        mistake = _route_mistake(f"rank {r}: {cls}'s {part}", found["traffic"].get(step, []),
                                 op, whole, t)
        if mistake is not None:
            return mistake
    return None


def _judge_probes(probes: list, t: int, dtype: str) -> None:
    for r, found in enumerate(probes):
        mistake = (_dtype_mistake(r, found, dtype) or _gather_mistake(r, t, found, dtype)
                   or _scatter_mistake(r, t, found, dtype) or _probe_route(r, t, found, dtype))
        if mistake is not None:
            mistake.detail = f"on {t} ranks, {dtype}: {mistake.detail}"
            failed = any("error" in v for v in found.values() if isinstance(v, dict))
            if dtype != "float32" and failed:
                mistake.hint += (f" (it passed in float32: a buffer made with torch.empty or "
                                 f"torch.zeros is float32 whatever x's dtype, {dtype} here)")
            raise mistake


def _judge_mlp(ranks: list, t: int, dtype: str, seq: int) -> None:
    where = f"on {t} ranks, {dtype}, seq={seq}"
    for r, got in enumerate(ranks):
        bad = {k: d for k, d in got["diffs"].items() if not d <= _TOL[dtype]}
        if bad:
            what, diff = next(iter(bad.items()))
            raise NotYet(f"{where}, rank {r}: the SP MLP's {what} is off by {diff:.2g}",
                         "both classes passed on known tensors: check that forward returns "
                         "a new tensor (not a view the collective overwrites later) and "
                         "backward one gradient per input of forward")
        whole = got["whole"]
        for way in ("forward", "backward"):
            calls = sorted(got["calls"][way])
            if calls != [("all_gather", whole), ("reduce_scatter", whole)]:
                raise NotYet(f"{where}, rank {r}: right numbers, but the SP MLP's {way} made "
                             f"{calls} (op, bytes); one all-gather and one reduce-scatter of "
                             f"the {whole:,}-byte activation",
                             "one all-gather and one reduce-scatter each way, each of the "
                             "whole (seq, batch, hidden) tensor, nothing else")


@exercise("sp_collectives", notebook=NOTEBOOK,
          title="sequence parallelism's all-gather and reduce-scatter")
def sp_collectives(gather_cls, scatter_cls, worlds=(2, 4)) -> str:
    """Exercise: ``MyGatherSeq`` (all-gather dim 0 / reduce-scatter) and ``MyScatterSeq``
    (reduce-scatter / all-gather), two ``torch.autograd.Function`` subclasses.

    Run on 2 and on 4 gloo ranks (``worlds``), in float32 and float64: each on known tensors
    (values, then the route: one collective of the right kind per step, of the whole tensor's
    bytes), then in a sequence-parallel MLP (LayerNorm on the shard, your gather, column fc1,
    GELU, row fc2, your scatter) whose output shard and every gradient must equal the dense
    MLP's, with one all-gather and one reduce-scatter each way.

    Example::

        >>> exercise.sp_collectives(MyGatherSeq, MyScatterSeq)
        [pass] sequence parallelism's all-gather and reduce-scatter: ... on 2 and 4 ranks ...
    """
    import torch

    for name, cls in (("MyGatherSeq", gather_cls), ("MyScatterSeq", scatter_cls)):
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            raise NotYet(f"{name} is {cls!r}, not a torch.autograd.Function subclass",
                         "pass the classes themselves: exercise.sp_collectives(MyGatherSeq, "
                         "MyScatterSeq)")
    for t in worlds:
        for dtype in ("float32", "float64"):
            _judge_probes(on_ranks(_probe, gather_cls, scatter_cls, dtype, nproc=t), t, dtype)
        for dtype, seq in _MLP_CASES:
            _judge_mlp(on_ranks(_sp_mlp, gather_cls, scatter_cls, dtype, seq, nproc=t), t,
                       dtype, seq)
    return (f"each class right on known tensors on {' and '.join(map(str, worlds))} gloo ranks, "
            f"in float32 and float64, "
            "each step one collective of the whole tensor's bytes; the sequence-parallel MLP's "
            "output shard, input gradient and every weight gradient equal the dense MLP's "
            "(seq 8 and 12); 1 all-gather and 1 reduce-scatter forward, 1 reduce-scatter and 1 "
            "all-gather backward")

"""Notebook 04's exercises: an fp16 step with a GradScaler, a compression hook, no_sync.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint. The two DDP exercises run on two
real gloo ranks (:func:`labkit.check.on_ranks`); the GradScaler step runs in this process, on
the CPU (fp16 autocast and ``torch.amp.GradScaler("cpu")`` exist there too).
"""

from __future__ import annotations

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "04"
FEATURES, CLASSES = 8, 4


def _net(seed: int = 0):
    """The small network every grader trains: the same weights on every rank."""
    import torch
    from torch import nn

    with torch.random.fork_rng(devices=[]):  # the kernel's own random stream is left alone
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def _data(n: int, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)


def _flat(tensors):
    import torch

    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _rel(a, b) -> float:
    """How far ``a`` is from ``b``, relative to ``b``'s size."""
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- 1. one fp16 training step: autocast, GradScaler -------------------------------------------


def _reference_amp_step(model, opt, scaler, x, y):
    """The answer the grader compares with (the solution's code)."""
    import torch

    opt.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


# What the GradScaler raises when its calls come in the wrong order, and what that means.
_SCALER_MISUSE = (
    ("_scale is None", "scaler.step(opt) ran, but the scaler never scaled a loss",
     "backward outside the scaler: call scaler.scale(loss).backward(), not loss.backward()"),
    ("No inf checks were recorded", "scaler.update() ran, but scaler.step(opt) never did",
     "optimizer.step() instead of scaler.step(opt): scaler.step unscales the gradients, checks "
     "them for inf/NaN and steps only if they are finite"),
    ("since the last update", "scaler.step(opt) ran twice without scaler.update() between",
     "call scaler.update() after scaler.step(opt), once per step: it adapts the scale"),
)


def _amp_run(step, x, y, steps: int = 1):
    """A fresh net, SGD and GradScaler; ``steps`` calls of ``step``. What was seen, and after."""
    import torch

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    seen = {"dtype": None, "grad": []}
    model[0].register_forward_hook(lambda m, i, out: seen.__setitem__("dtype", out.dtype))
    model[2].weight.register_hook(lambda g: seen["grad"].append(g.float().norm().item()))
    before = _flat(model.parameters())
    for _ in range(steps):
        try:
            step(model, opt, scaler, x, y)
        except (AssertionError, RuntimeError) as exc:  # the GradScaler's own complaints
            for words, detail, hint in _SCALER_MISUSE:
                if words in str(exc):
                    raise NotYet(detail, hint) from None
            raise
    return seen, before, _flat(model.parameters()), scaler.get_scale()


@exercise("amp_grad_scaler_step", notebook=NOTEBOOK, title="fp16 step with a GradScaler")
def amp_grad_scaler_step(step) -> str:
    """Exercise: ``step(model, opt, scaler, x, y)``, one fp16 autocast step through a GradScaler.

    Run on a small network on the CPU: the forward must run in float16, backward on the scaled
    loss, the optimizer step unscaled (the same as the reference step), and a batch whose
    gradients overflow must leave the weights alone and halve the scale.

    Example::

        >>> exercise.amp_grad_scaler_step(amp_step)
        [pass] fp16 step with a GradScaler: forward in float16, backward on the loss x 65536, ...
    """
    import torch

    x, y = _data(16, seed=1)
    seen, before, after, _ = _amp_run(step, x, y)
    ref_seen, _, ref_after, scale = _amp_run(_reference_amp_step, x, y)
    if seen["dtype"] is None:
        raise NotYet("the model was never called", "compute the loss of model(x) against y")
    if seen["dtype"] == torch.bfloat16:
        raise NotYet("the forward ran in bfloat16", "use dtype=torch.float16: bf16 has float32's "
                     "range and needs no scaler; the GradScaler exists for fp16")
    if seen["dtype"] != torch.float16:
        raise NotYet(f"the forward ran in {seen['dtype']}: no autocast",
                     "wrap the forward and the loss in `with torch.autocast(x.device.type, "
                     "dtype=torch.float16):`")
    if not seen["grad"]:
        raise NotYet("no gradient reached the model: no backward ran",
                     "call scaler.scale(loss).backward()")
    ratio = seen["grad"][0] / ref_seen["grad"][0]  # the reference's backward sees loss x scale
    if abs(ratio * scale - 1) < 0.05:
        raise NotYet("backward ran on the unscaled loss: gradients as small as float16 makes "
                     "them", "backward outside the scaler: call scaler.scale(loss).backward(), "
                     "not loss.backward()")
    moved = (after - before).norm() / (ref_after - before).norm()
    if moved < 1e-6:
        raise NotYet("the weights did not change: no optimizer step was taken",
                     "call scaler.step(opt) after backward, then scaler.update()")
    if abs(moved / scale - 1) < 0.05:
        raise NotYet(f"the step was {scale:g} times too large: it used the scaled gradients",
                     "optimizer.step() instead of scaler.step(opt): scaler.step unscales the "
                     "gradients first (and skips a step whose gradients overflowed)")
    off = _rel(after - before, ref_after - before)
    if off > 1e-2:
        raise NotYet(f"the step is {off:.0%} off the reference step",
                     "loss = cross_entropy(model(x), y), the mean over the batch; one "
                     "scaler.step(opt) per call")
    x_inf = x.clone()
    x_inf[0, 0] = float("inf")  # float16 overflows: the loss, and every gradient, is inf/NaN
    _, before, after, scale_after = _amp_run(step, x_inf, y)
    if not torch.equal(before, after):
        raise NotYet("a batch whose gradients overflowed changed the weights (to NaN)",
                     "optimizer.step instead of scaler.step: a step with inf gradients was "
                     "taken; scaler.step(opt) skips it")
    if scale_after == scale:
        raise NotYet(f"after an overflow the scale is still {scale_after:g}",
                     "call scaler.update() after scaler.step(opt): it halves the scale after an "
                     "overflow (and grows it again after 2000 clean steps)")
    return (f"forward in float16, backward on the loss x {scale:g}, the step unscaled; an "
            f"overflowing batch skipped, scale {scale:g} -> {scale_after:g}")


# ---- 2. a DDP communication hook that sends float16 ---------------------------------------------


def _hook_worker(hook):
    """Rank worker: one backward of DDP with ``hook``; the gradients, the bytes, the references."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..ddp import counting_allreduces

    rank, world = dist.get_rank(), dist.get_world_size()
    net = _net()
    batches = [_data(8, seed=100 + r) for r in range(world)]  # rank r trains on batches[r]

    def grad_of(x, y):
        m = copy.deepcopy(net)
        torch.nn.functional.cross_entropy(m(x), y).backward()
        return _flat(p.grad for p in m.parameters())

    local = [grad_of(*b) for b in batches]
    model = DDP(copy.deepcopy(net))
    model.register_comm_hook(None, hook)
    counter = {"calls": 0, "bytes": 0}
    with counting_allreduces(counter):
        torch.nn.functional.cross_entropy(model(batches[rank][0]), batches[rank][1]).backward()
    return {"grad": _flat(p.grad for p in model.parameters()), "mean": sum(local) / world,
            "world": world, **counter,
            "fp32_bytes": sum(p.numel() * 4 for p in net.parameters())}


@exercise("fp16_compress_hook", notebook=NOTEBOOK, title="fp16 compression hook")
def fp16_compress_hook(hook) -> str:
    """Exercise: ``hook(state, bucket)``, a DDP comm hook that averages in float16.

    Registered on a DDP model on 2, then 4 gloo ranks, each with its own batch: after backward
    every rank must hold the average of the ranks' gradients (to fp16 rounding), and the
    all-reduces must have sent half the bytes of float32.

    Example::

        >>> exercise.fp16_compress_hook(compress_hook)
        [pass] fp16 compression hook: 2 ranks hold the average gradient (...); 840 bytes sent, ...
    """
    for world in (2, 4):
        r0 = _judge_hook(on_ranks(_hook_worker, hook, nproc=world))
    return (f"on 2 and 4 ranks every rank holds the average gradient (to fp16 rounding); "
            f"{r0['bytes']:,} bytes sent, not {r0['fp32_bytes']:,}")


def _judge_hook(ranks: list[dict]) -> dict:
    """Raise NotYet unless every rank holds the fp16-averaged gradient, half the bytes sent."""
    r0, world = ranks[0], len(ranks)
    full = r0["fp32_bytes"]
    if r0["calls"] == 0:
        raise NotYet("no dist.all_reduce ran: the gradients were never communicated",
                     "all-reduce the 16-bit copy with dist.all_reduce(t, async_op=True) and "
                     "return its .get_future() (then-ed back to float32)")
    if any(_rel(r0["grad"], r["grad"]) > 1e-6 for r in ranks[1:]):
        raise NotYet(f"on {world} ranks the ranks hold different gradients after backward",
                     "return a future of the all-reduced tensor, not of the local bucket: "
                     "fut = dist.all_reduce(...).get_future(); return fut.then(...)")
    if r0["bytes"] == full:
        raise NotYet(f"{full:,} bytes were all-reduced: the float32 gradients, uncompressed",
                     "cast the bucket to 16 bits first: bucket.buffer().to(torch.float16)")
    if r0["bytes"] != full // 2:
        raise NotYet(f"{r0['bytes']:,} bytes were all-reduced, expected {full // 2:,} (half of "
                     f"{full:,})", "one dist.all_reduce per bucket, of bucket.buffer() in "
                     "torch.float16")
    if any(r["bytes"] != r0["bytes"] for r in ranks):
        raise NotYet(f"on {world} ranks the ranks all-reduced {[r['bytes'] for r in ranks]} "
                     f"bytes", "every rank runs the same hook on the same buckets")
    if _rel(r0["grad"], world * r0["mean"]) < 1e-2:
        raise NotYet(f"on {world} ranks the gradients are {world} times the average: the sum "
                     f"over the ranks",
                     "the hook returned a future of the un-averaged sum: divide by world size "
                     "(dist.get_world_size()) before or after the all-reduce")
    if world != 2 and _rel(r0["grad"], world / 2 * r0["mean"]) < 1e-2:
        raise NotYet(f"on {world} ranks the gradients are {world / 2:g} times the average: the "
                     f"sum divided by 2", "divide by the world size, dist.get_world_size() "
                     "(or the process group's size()), not by 2: it is right on 2 ranks only")
    if _rel(r0["grad"], r0["mean"]) > 1e-2:
        raise NotYet(f"the gradients are {_rel(r0['grad'], r0['mean']):.0%} off the ranks' "
                     f"average", "the future's value must be the averaged bucket, back in "
                     "float32, in the bucket's order (bucket.buffer())")
    return r0


# ---- 3. gradient accumulation under DDP: no_sync ------------------------------------------------


def _accumulation_worker(step, k: int, micro: int):
    """Rank worker: ``step(model, opt, micro_batches)`` on DDP; all-reduces and the update."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..ddp import count_allreduces

    rank, world = dist.get_rank(), dist.get_world_size()
    net = _net()
    data = [_data(k * micro, seed=200 + r) for r in range(world)]  # each rank's share

    def grad_of(x, y, scale=1.0):
        m = copy.deepcopy(net)
        (torch.nn.functional.cross_entropy(m(x), y) * scale).backward()
        return _flat(p.grad for p in m.parameters())

    # The big batch: every rank's samples at once, one mean loss.
    big = grad_of(torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data]))
    last_only = sum(grad_of(d[0][-micro:], d[1][-micro:], 1 / k) for d in data) / world
    model = DDP(copy.deepcopy(net))
    counter = count_allreduces(model)  # DDP's own all-reduce, counted: one call per bucket
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # lr 1: the update is the gradient
    before = _flat(model.parameters())
    x, y = data[rank]
    step(model, opt, list(zip(x.split(micro), y.split(micro), strict=True)))
    return {"update": before - _flat(model.parameters()), "big": big, "last_only": last_only,
            "calls": counter["calls"]}


@exercise("no_sync_accumulation", notebook=NOTEBOOK, title="accumulation with no_sync")
def no_sync_accumulation(step, k: int = 4, micro: int = 4) -> str:
    """Exercise: ``step(model, opt, micro_batches)``: one DDP step from k micro-batches.

    On 2, then 4 gloo ranks, each with ``k`` micro-batches of ``micro`` samples: exactly one
    all-reduce on every rank (the model fits one bucket), and an update equal to the big
    batch's gradient (all ranks' samples at once) times the learning rate.

    Example::

        >>> exercise.no_sync_accumulation(accumulation_step)
        [pass] accumulation with no_sync: 1 all-reduce for 4 micro-batches; the big batch's ...
    """
    for world in (2, 4):
        _judge_accumulation(on_ranks(_accumulation_worker, step, k, micro, nproc=world), k)
    return (f"1 all-reduce for {k} micro-batches on every rank; the big batch's gradient "
            f"(2 and 4 ranks x {k} x {micro} samples), to float rounding")


def _judge_accumulation(ranks: list[dict], k: int) -> None:
    """Raise NotYet unless every rank all-reduced once and stepped by the big batch's gradient."""
    r0 = ranks[0]
    if any(r["calls"] != r0["calls"] for r in ranks):
        raise NotYet(f"on {len(ranks)} ranks the ranks made {[r['calls'] for r in ranks]} "
                     f"all-reduces", "every rank runs the same loop: no_sync on the same "
                     "micro-batches everywhere")
    if r0["calls"] == k:
        raise NotYet(f"{k} all-reduces for {k} micro-batches",
                     "an all-reduce per micro-batch: wrap all but the last in model.no_sync() "
                     "(forward and backward both inside it)")
    if r0["calls"] == 0:
        raise NotYet("no all-reduce at all: the ranks never averaged their gradients",
                     "run the last micro-batch's forward and backward outside model.no_sync(): "
                     "that backward all-reduces everything accumulated")
    if r0["calls"] != 1:
        raise NotYet(f"{r0['calls']} all-reduces for one step, expected 1",
                     "one backward outside no_sync per step, after the k-1 inside it")
    update, big = r0["update"], r0["big"]
    if update.norm() == 0:
        raise NotYet("the weights did not move", "call opt.step() once, after the last backward")
    if _rel(update, k * big) < 1e-4:
        raise NotYet(f"the gradients are {k} times the big batch's",
                     f"loss not divided by accumulation steps: gradients k times too large; "
                     f"use loss / {k} (len(micro_batches)) for each micro-batch")
    if _rel(update, r0["last_only"]) < 1e-4:
        raise NotYet("only the last micro-batch's gradient was used",
                     "call opt.zero_grad() once before the loop, not per micro-batch: "
                     "backward adds into .grad, which is the accumulation")
    if _rel(update, big) > 1e-4:
        raise NotYet(f"the update is {_rel(update, big):.0%} off the big batch's gradient",
                     "zero_grad once, then for each micro-batch backward on loss / k, then one "
                     "opt.step()")
    if any(_rel(r["update"], update) > 1e-6 for r in ranks[1:]):
        raise NotYet("the ranks took different steps", "every rank runs the same loop")


# ==== challenge: one PowerSGD step with error feedback, on real ranks ========================
# Graded on 2 and 4 ranks, step by step (each step's reference is computed from the inputs the
# learner's previous step left: its q, every rank's error): the approximation, this rank's new
# error and the route (two all-reduces, of n*r then m*r numbers, instead of n*m).

_PS_CASES = (  # (n, m, r, dtype, steps): tall and wide, rank 1 and 2, float32 and float64
    (6, 4, 1, "float32", 3), (3, 7, 2, "float64", 3))
_PS_TOL = {"float32": 1e-4, "float64": 1e-10}
_PS_ALGO = ("M = grad + error; P = M @ q, all-reduced and divided by the world size; P's columns "
            "made orthonormal (torch.linalg.qr(P).Q); new_q = M.T @ P, all-reduced and divided; "
            "approx = P @ new_q.T; new_error = M - approx")


def _ps_reference(ms, q):
    """PowerSGD's approximation of the mean of ``ms`` from ``q``: orth(M̄ q), M̄ᵀ P, P new_qᵀ."""
    import torch

    mean = sum(ms) / len(ms)
    p = torch.linalg.qr(mean @ q).Q
    raw = mean @ q
    return {"approx": p @ (mean.T @ p).T, "not_orth": raw @ (mean.T @ raw).T, "p": p,
            "q": mean.T @ p}


def _powersgd_worker(fn) -> list[dict]:
    """Each rank, each case: ``steps`` calls of ``fn(grad, q, error)``, its outputs fed forward."""
    import torch
    import torch.distributed as dist

    from ..parallel import traffic

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for case, (n, m, r, dtype, steps) in enumerate(_PS_CASES):
        dt = getattr(torch, dtype)
        q = torch.randn(m, r, generator=torch.Generator().manual_seed(case)).to(dt)
        error = torch.zeros(n, m, dtype=dt)
        records = []
        for step in range(steps):
            grads = [torch.randn(n, m, generator=torch.Generator().manual_seed(
                1000 * case + 10 * step + s)).to(dt) for s in range(world)]
            if step == 0:
                grads[0].zero_()  # rank 0 has nothing to add at first: it still takes part
            errors = [torch.empty_like(error) for _ in range(world)]
            dist.all_gather(errors, error.contiguous())  # outside the count: for the reference
            ms = [g + e for g, e in zip(grads, errors, strict=True)]
            ref = _ps_reference(ms, q)
            with traffic.count_traffic() as t:
                got = fn(grads[rank].clone(), q.clone(), error.clone())
            rec = {"calls": [(c.op, c.payload_bytes) for c in t.calls],
                   "returned": type(got).__name__, "n": n, "m": m, "r": r, "dtype": dtype,
                   "ref": ref["approx"], "not_orth": ref["not_orth"], "ref_q": ref["q"],
                   "local": ref["p"] @ (ms[rank].T @ ref["p"]).T, "mine": ms[rank],
                   "grad": grads[rank], "q_in": q.clone()}
            if not (isinstance(got, tuple | list) and len(got) == 3
                    and all(isinstance(v, torch.Tensor) for v in got)):
                records.append(rec)
                break
            approx, new_q, new_error = (v.detach().clone() for v in got)
            rec.update(approx=approx, new_q=new_q, new_error=new_error)
            records.append(rec)
            if tuple(new_q.shape) != (m, r) or tuple(new_error.shape) != (n, m):
                break
            q, error = new_q.to(dt), new_error.to(dt)
        out.append(records)
    return out


def _ps_judge(world: int, rank: int, rec: dict, step: int) -> None:
    n, m, r, dtype = rec["n"], rec["m"], rec["r"], rec["dtype"]
    where = f"on {world} ranks (rank {rank}), a {n} x {m} {dtype} gradient, rank {r}, step {step}"
    tol = _PS_TOL[dtype]
    if "approx" not in rec:
        raise NotYet(f"{where}: it returned {rec['returned']}, not three tensors",
                     "return (approx, new_q, new_error): the n x m approximation, the m x r "
                     "q for the next step, this rank's n x m error")
    approx, new_q, new_error = rec["approx"], rec["new_q"], rec["new_error"]
    shapes = (tuple(approx.shape), tuple(new_q.shape), tuple(new_error.shape))
    if shapes != ((n, m), (m, r), (n, m)):
        raise NotYet(f"{where}: it returned shapes {shapes}; want {((n, m), (m, r), (n, m))}",
                     "return (approx, new_q, new_error) in that order: " + _PS_ALGO)
    if any(str(t.dtype) != f"torch.{dtype}" for t in (approx, new_q, new_error)):
        raise NotYet(f"{where}: it returned {[str(t.dtype) for t in (approx, new_q, new_error)]}"
                     f" for a {dtype} gradient", "keep the gradient's dtype throughout (buffers "
                     "from torch.empty_like or the products themselves)")
    calls = rec["calls"]
    ops = [op for op, _ in calls]
    esize = approx.element_size()
    if "all_reduce" in ops and any(b == n * m * esize for _, b in calls):
        raise NotYet(f"{where}: it all-reduced {n * m} numbers, the whole matrix",
                     f"PowerSGD's point is to send (n + m) r = {(n + m) * r} numbers instead of "
                     f"n m = {n * m}: all-reduce P (n x r) and new_q (m x r) only, and build the "
                     f"approximation from them on every rank")
    gap = _ps_gap(approx, rec["ref"])
    if gap > tol:
        if _ps_gap(approx, world * rec["ref"]) <= tol * world:
            raise NotYet(f"{where}: the approximation is {world}x the mean gradient's",
                         "all_reduce sums: divide new_q (or P and new_q) by the world size")
        if _ps_gap(approx, rec["local"]) <= tol:
            raise NotYet(f"{where}: the approximation is of this rank's M, not the mean",
                         "all-reduce new_q = M.T @ P too (and divide): without it every rank "
                         "builds its approximation from its own gradient, and they differ")
        if _ps_gap(approx, rec["not_orth"]) <= tol * 10:
            raise NotYet(f"{where}: the approximation is off by a scale: P was not made "
                         f"orthonormal", "orthonormalise P's columns after its all-reduce "
                         "(torch.linalg.qr(P).Q) before computing new_q = M.T @ P")
        raise NotYet(f"{where}: the approximation differs from PowerSGD's by {gap:.2g}",
                     ("the error from the last step is part of M: M = grad + error, "
                      if step > 1 else "") + _PS_ALGO)
    # new_q is M̄ᵀ P for the learner's own orthonormal P = P_ref D (D orthogonal): new_q new_qᵀ
    # does not depend on D
    if _ps_gap(new_q @ new_q.T, rec["ref_q"] @ rec["ref_q"].T) > tol * 10:
        if _ps_gap(new_q, rec["q_in"]) == 0:
            raise NotYet(f"{where}: new_q is the q it was given",
                         "return the new q, M.T @ P all-reduced and divided: the next step "
                         "starts from it (the warm start that makes one power step enough)")
        raise NotYet(f"{where}: new_q is not M.T @ P averaged over the ranks", _PS_ALGO)
    want_error = rec["mine"] - approx
    if _ps_gap(new_error, want_error) > tol:
        hint = ("the new error is what this rank's M = grad + error lost: M - approx, so "
                "nothing is dropped for good")
        if _ps_gap(new_error, rec["grad"] - approx) <= tol:
            hint = "the previous error is part of M: new_error = (grad + error) - approx"
        raise NotYet(f"{where}: new_error is not (grad + error) - approx", hint)
    if ops != ["all_reduce", "all_reduce"] or sorted(b for _, b in calls) != sorted(
            [n * r * esize, m * r * esize]):
        raise NotYet(f"{where}: it made {ops} of {[b for _, b in calls]} bytes; PowerSGD makes "
                     f"two all-reduces, of P ({n * r} numbers) and new_q ({m * r})", _PS_ALGO)


def _ps_gap(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@exercise("powersgd_step", notebook=NOTEBOOK, title="challenge: one PowerSGD step, on real ranks")
def powersgd_step(fn, worlds=(2, 4)) -> str:
    """Challenge: ``fn(grad, q, error) -> (approx, new_q, new_error)``, PowerSGD on one matrix.

    Run on real gloo ranks (``worlds``) for 3 steps of a 6 x 4 float32 gradient at rank 1 and
    a 3 x 7 float64 one at rank 2, the learner's q and error fed forward (rank 0's first
    gradient is zero). Each step is compared with PowerSGD computed from the same inputs: the
    approximation (independent of how P is made orthonormal), this rank's error, and the route:
    two all-reduces of n r and m r numbers, never the n m of the matrix.

    Example::

        >>> exercise.powersgd_step(my_powersgd)
        [pass] challenge: one PowerSGD step, on real ranks: on 2 and 4 ranks ...
    """
    for world in worlds:
        ranks = on_ranks(_powersgd_worker, fn, nproc=world, timeout=60.0)
        for rank, per_case in enumerate(ranks):
            for records in per_case:
                for step, rec in enumerate(records, start=1):
                    _ps_judge(world, rank, rec, step)
    return (f"on {' and '.join(map(str, worlds))} ranks, 3 steps each of a tall float32 "
            f"matrix at rank 1 and a wide float64 one at rank 2: the approximation of the mean "
            f"gradient and each rank's error, from two all-reduces of (n + m) r numbers")

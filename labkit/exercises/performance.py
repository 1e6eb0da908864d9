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

    Registered on a DDP model on two gloo ranks, each with its own batch: after backward every
    rank must hold the average of the ranks' gradients (to fp16 rounding), and the all-reduces
    must have sent half the bytes of float32.

    Example::

        >>> exercise.fp16_compress_hook(compress_hook)
        [pass] fp16 compression hook: 2 ranks hold the average gradient (...); 840 bytes sent, ...
    """
    ranks = on_ranks(_hook_worker, hook)
    r0, r1 = ranks[0], ranks[1]
    full = r0["fp32_bytes"]
    if r0["calls"] == 0:
        raise NotYet("no dist.all_reduce ran: the gradients were never communicated",
                     "all-reduce the 16-bit copy with dist.all_reduce(t, async_op=True) and "
                     "return its .get_future() (then-ed back to float32)")
    if _rel(r0["grad"], r1["grad"]) > 1e-6:
        raise NotYet("the ranks hold different gradients after backward",
                     "return a future of the all-reduced tensor, not of the local bucket: "
                     "fut = dist.all_reduce(...).get_future(); return fut.then(...)")
    if r0["bytes"] == full:
        raise NotYet(f"{full:,} bytes were all-reduced: the float32 gradients, uncompressed",
                     "cast the bucket to 16 bits first: bucket.buffer().to(torch.float16)")
    if r0["bytes"] != full // 2:
        raise NotYet(f"{r0['bytes']:,} bytes were all-reduced, expected {full // 2:,} (half of "
                     f"{full:,})", "one dist.all_reduce per bucket, of bucket.buffer() in "
                     "torch.float16")
    world = r0["world"]
    if _rel(r0["grad"], world * r0["mean"]) < 1e-2:
        raise NotYet(f"the gradients are {world} times the average: the sum over the ranks",
                     "the hook returned a future of the un-averaged sum: divide by world size "
                     "(dist.get_world_size()) before or after the all-reduce")
    if _rel(r0["grad"], r0["mean"]) > 1e-2:
        raise NotYet(f"the gradients are {_rel(r0['grad'], r0['mean']):.0%} off the ranks' "
                     f"average", "the future's value must be the averaged bucket, back in "
                     "float32, in the bucket's order (bucket.buffer())")
    return (f"{world} ranks hold the average gradient (to fp16 rounding); {r0['bytes']:,} bytes "
            f"sent, not {full:,}")


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

    On two gloo ranks, each with ``k`` micro-batches of ``micro`` samples: exactly one
    all-reduce (the model fits one bucket), and an update equal to the big batch's gradient
    (all ranks' samples at once) times the learning rate.

    Example::

        >>> exercise.no_sync_accumulation(accumulation_step)
        [pass] accumulation with no_sync: 1 all-reduce for 4 micro-batches; the big batch's ...
    """
    ranks = on_ranks(_accumulation_worker, step, k, micro)
    r0 = ranks[0]
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
    return (f"1 all-reduce for {k} micro-batches; the big batch's gradient "
            f"({len(ranks)} ranks x {k} x {micro} samples), to float rounding")

"""ZeRO by hand: data parallelism without the redundant copies, stage by stage.

Plain data parallelism keeps everything on every one of the ``n`` ranks: the parameters (4 bytes
each in fp32), their gradients (4) and Adam's two moments (8): ``16 Psi`` bytes per rank for
``Psi`` parameters, ``n`` identical copies of most of it. ZeRO (Rajbhandari et al., 2020) cuts
the copies, each stage one more kind:

- **ZeRO-1** shards the optimizer state: rank ``r`` keeps Adam's moments for its ``1/n`` of the
  parameters only, and updates only that shard. The gradients are still computed in full; the
  step *reduce-scatters* them (each rank gets the average of its shard), updates the shard, and
  *all-gathers* the parameters: ``4 Psi + 4 Psi + 8 Psi / n``.
- **ZeRO-2** shards the gradients too: each bucket of gradients is reduce-scattered as soon as
  backward has produced it and the full gradients are freed: ``4 Psi + 4 Psi / n + 8 Psi / n``.
- **ZeRO-3** shards the parameters too, gathering each layer just before it is used: that is
  FSDP (``torch.distributed.fsdp.fully_shard``), measured by :func:`zero3_traffic` and
  :func:`labkit.parallel.memory.fsdp_memory`.

A reduce-scatter plus an all-gather move exactly what one all-reduce moves (an all-reduce *is*
a reduce-scatter followed by an all-gather), so ZeRO-1 and ZeRO-2 cost no more bandwidth than
data parallelism. ZeRO-3 gathers the parameters twice (forward, then again for backward):
1.5 times the traffic.

:class:`ZeroOptimizer` is stages 1 and 2 written out (Adam by hand on the shard);
:func:`zero_check` (a worker function) runs it beside plain data parallelism and returns the
differences, the bytes each rank holds and the bytes it sent, with their formulas.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from labkit._dist import all_gather_into, collective_device, reduce_scatter_into
from labkit._sizes import multiples_near, whole

from . import traffic
from .memory import estimate_memory, fsdp_memory, mlp_blocks

__all__ = ["FlatParams", "flat_params", "adam_update", "storage_bytes", "zero_step",
           "ZeroOptimizer", "dp_held", "zero_formulas", "zero_check", "zero3_traffic",
           "zero_rows"]

TOL = 1e-5  # float32: sums over ranks taken in another order differ in the last bits


# ---- the flat buffer ---------------------------------------------------------------------------


class _Bucket:
    """A contiguous run of the flat buffer, padded to a multiple of the world size."""

    def __init__(self, start: int, numel: int, params: list, world: int):
        self.start, self.numel, self.params = start, numel, params
        self.shard_numel = numel // world
        self.staging = None  # ZeRO-2: the bucket's full gradient while backward fills it
        self.pending = len(params)


class FlatParams:
    """A model's trainable parameters as views of one flat buffer, in buckets, padded to ``world``.

    Why ZeRO flattens: a model is many tensors of odd sizes. Laid end to end in one buffer
    (each ``p.data`` becomes a view of it), the whole model is ONE tensor: one reduce-scatter
    and one all-gather per step instead of one per tensor, and it cuts into ``world`` equal
    shards whatever the tensors' shapes. The buffer is padded with zeros to a multiple of
    ``world``, so rank ``r``'s shard is ``[r * N / n, (r + 1) * N / n)`` of the ``N`` (padded)
    elements; the padding gets zero gradients and stays zero.

    ``bucket_numel`` (ZeRO-2) cuts the buffer into buckets of whole parameters, about that many
    elements each, in the order backward produces them (the last layer first); each bucket is
    padded and split the same way, and a rank's shard is its slice of every bucket (Megatron's
    distributed optimizer does the same). ``None``: one bucket, the whole model.

    Example::

        >>> flat = flat_params(mlp_blocks(2, 8), world=4)
        >>> flat.numel, flat.padded, flat.shard_numel        # 1104 parameters, 276 per rank
        (1104, 1104, 276)
    """

    def __init__(self, model, world: int, bucket_numel: int | None = None):
        world = whole(world, "world")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(model).__name__} has no trainable parameters (none with "
                             f"requires_grad=True): ZeRO shards a model that is trained")
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("the parameters must share one dtype and one device to live in one "
                             "flat buffer: call model.to(device, dtype) first")
        if bucket_numel is not None:
            bucket_numel = whole(bucket_numel, "bucket_numel")
        self.world, self.params = world, params
        self.numel = sum(p.numel() for p in params)
        # Buckets in reverse model order, each padded to a multiple of world so that it splits
        # into world equal shards: rank r owns elements [r * numel/world, (r+1) * numel/world)
        # of every bucket, and updates only those.
        self.buckets: list[_Bucket] = []
        group: list = []
        for p in reversed(params):  # backward produces the last layer's gradients first
            group.append(p)
            size = sum(q.numel() for q in group)
            if p is params[0] or (bucket_numel is not None and size >= bucket_numel):
                start = self.buckets[-1].start + self.buckets[-1].numel if self.buckets else 0
                self.buckets.append(_Bucket(start, -(-size // world) * world, group, world))
                group = []
        self.padded = sum(b.numel for b in self.buckets)
        self.shard_numel = self.padded // world
        # One flat buffer holds every parameter (every rank keeps all of them: ZeRO-1/2 shard
        # the optimizer state and the gradients, not the weights); the padding stays zero.
        self.flat = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        self.offset = {}  # id(param) -> where it starts in the flat buffer
        for b in self.buckets:
            at = b.start
            for p in b.params:
                self.flat[at:at + p.numel()].copy_(p.detach().reshape(-1))
                # The model's parameter becomes a view of the buffer: an all-gather into the
                # buffer updates the model's weights with no copy.
                p.data = self.flat[at:at + p.numel()].view_as(p)
                self.offset[id(p)] = at
                at += p.numel()

    def view(self, buffer, p):
        """``p``'s elements of a flat ``buffer`` (of parameters or of gradients), shaped as p."""
        at = self.offset[id(p)]
        return buffer[at:at + p.numel()].view_as(p)

    def shard(self, buffer, bucket: _Bucket, rank: int):
        """Rank ``rank``'s slice of ``bucket`` in a flat ``buffer``: a view, no copy."""
        at = bucket.start + rank * bucket.shard_numel
        return buffer[at:at + bucket.shard_numel]

    def in_shard(self, shard_buffer, bucket: _Bucket):
        """``bucket``'s part of a buffer in shard coordinates (``padded / world`` elements)."""
        at = bucket.start // self.world
        return shard_buffer[at:at + bucket.shard_numel]


def flat_params(model, world: int, bucket_numel: int | None = None) -> FlatParams:
    """``model``'s trainable parameters as views of one flat buffer padded to ``world``.

    See :class:`FlatParams`. Example::

        >>> flat = flat_params(mlp_blocks(1, 5), world=4)   # 225 parameters
        >>> flat.padded, flat.shard_numel
        (228, 57)
    """
    return FlatParams(model, world, bucket_numel)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    storages = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


# ---- Adam on a shard ----------------------------------------------------------------------------


def adam_update(param, grad, exp_avg, exp_avg_sq, step: int, *, lr: float = 1e-3,
                betas=(0.9, 0.999), eps: float = 1e-8) -> None:
    """``torch.optim.Adam``'s update (no weight decay), in place, on any slice of a model.

    Adam is elementwise: each element's update needs only that element's gradient and its two
    moments. That is what lets ZeRO shard it: a rank updating its slice needs nothing from the
    other slices. ``step`` counts from 1. Example::

        >>> adam_update(p, g, m, v, step=1)      # p, g, m, v: tensors of one shape
    """
    beta1, beta2 = betas
    # Every line is elementwise: on a shard it computes exactly that shard of the full update.
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def zero_step(flat_params, flat_grad, update_shard, group=None) -> None:
    """One ZeRO step on flat tensors: reduce-scatter, update this rank's shard, all-gather.

    ``flat_params``: the parameters, one flat tensor, the same on every rank (its numel a
    multiple of the ranks); ``flat_grad``: this rank's full local gradient; ``update_shard(
    param_shard, grad_shard)``: the optimizer on this rank's shard, returning the new shard.
    ``flat_params`` is updated in place, the same on every rank. ZeRO-1's step is exactly this
    (``ZeroOptimizer(stage=1)`` calls it); ZeRO-2 does the reduce-scatter earlier, bucket by
    bucket during backward. Example (inside a worker)::

        >>> zero_step(flat.flat, flat_grad, lambda p, g: p - 0.1 * g)   # SGD on the shard
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = flat_params.numel() // world
    grad_shard = torch.empty(shard, dtype=flat_grad.dtype, device=flat_grad.device)
    # Each rank receives the SUM over the ranks of ITS slice only: half an all-reduce's traffic,
    # and 1/n of the gradient's memory once the full local gradient is dropped.
    reduce_scatter_into(grad_shard, flat_grad, group=group)
    grad_shard.div_(world)  # the average, as data parallelism's all-reduce and divide
    new_shard = update_shard(flat_params[rank * shard:(rank + 1) * shard], grad_shard)
    # The other half of an all-reduce: every rank's updated shard, in rank order, everywhere.
    all_gather_into(flat_params, new_shard, group=group)


# ---- ZeRO-1 and ZeRO-2 ---------------------------------------------------------------------------


class ZeroOptimizer:
    """Adam with ZeRO stage 1 (optimizer state sharded) or 2 (gradients sharded too).

    Every rank builds the same model (same seed) and wraps it; ``model.parameters()`` become
    views of one flat buffer (:class:`FlatParams`). Each rank keeps Adam's two moments for its
    shard only (``2 * 4 * padded / n`` bytes).

    - ``stage=1``: backward fills a full flat gradient buffer (``p.grad`` are views of it, as
      DDP's ``gradient_as_bucket_view``); :meth:`step` is :func:`zero_step` (or ``step_fn``,
      the same signature, default group only): reduce-scatter, divide by ``n``, update the
      shard, all-gather the parameters.
    - ``stage=2``: a hook on every parameter (``register_post_accumulate_grad_hook``) copies
      its new gradient into its bucket and frees it (``p.grad = None``); when a bucket is
      complete it is reduce-scattered into this rank's gradient shard and dropped. A rank holds
      its gradient shard plus at most one bucket in flight; ``bucket_numel`` (elements, default
      ``2**20``) sets the bucket size.

    Use it as a torch optimizer: ``opt.zero_grad()``, ``loss.backward()``, ``opt.step()``.
    Example (inside a worker)::

        >>> model = mlp_blocks(4, 64).to(collective_device())
        >>> opt = ZeroOptimizer(model, stage=2, lr=1e-3, bucket_numel=33_000)
        >>> model(x).square().mean().backward(); opt.step()
        >>> opt.held()                                       # bytes this rank holds, by kind
    """

    def __init__(self, model, stage: int = 1, *, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, group=None, bucket_numel: int | None = None,
                 step_fn=None):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (shard the optimizer state) or 2 (the gradients "
                             f"too), got {stage!r}; stage 3 shards the parameters as well: "
                             f"use torch.distributed.fsdp.fully_shard (see zero3_traffic)")
        if step_fn is not None and stage != 1:
            raise ValueError("step_fn is ZeRO-1's step on the flat gradient; ZeRO-2 "
                             "reduce-scatters during backward: pass step_fn with stage=1")
        self.step_fn = step_fn or functools.partial(zero_step, group=group)
        self.stage, self.group = stage, group
        self.lr, self.betas, self.eps = lr, betas, eps
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if stage == 2 and bucket_numel is None:
            bucket_numel = 2 ** 20
        self.flat = FlatParams(model, self.world, bucket_numel if stage == 2 else None)
        f = self.flat.flat
        self.exp_avg = torch.zeros(self.flat.shard_numel, dtype=f.dtype, device=f.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = 0
        self.grads_in_flight = 0  # ZeRO-2: the most gradient bytes held during a backward
        if stage == 1:
            self.flat_grad = torch.zeros_like(f)
            for p in self.flat.params:
                p.grad = self.flat.view(self.flat_grad, p)  # backward accumulates in place
        else:
            self.grad_shard = torch.zeros_like(self.exp_avg)
            self._bucket_of = {id(p): b for b in self.flat.buckets for p in b.params}
            for p in self.flat.params:
                p.register_post_accumulate_grad_hook(self.reduce_when_ready)

    def reduce_when_ready(self, p) -> None:
        """ZeRO-2's hook: bank ``p``'s gradient in its bucket; reduce-scatter a full bucket."""
        # Called by autograd once p's gradient is accumulated, in backward order: the last
        # layers' buckets fill (and leave) first, while earlier layers still compute.
        b = self._bucket_of[id(p)]
        if b.staging is None:  # the bucket's first gradient: allocate it (padding stays zero)
            b.staging = torch.zeros(b.numel, dtype=p.dtype, device=p.device)
        at = self.flat.offset[id(p)] - b.start
        b.staging[at:at + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None  # the full gradient is gone: only its bucket holds it, for now
        b.pending -= 1
        if b.pending == 0:
            # Measured here, the most a backward holds: the shard plus this bucket (autograd's
            # fresh p.grad also lives for the moment between its accumulation and this hook).
            self.grads_in_flight = max(self.grads_in_flight, self._grad_bytes())
            mine = torch.empty(b.shard_numel, dtype=p.dtype, device=p.device)
            # Every rank reaches this bucket in the same order (the same graph), so the
            # collectives match up; each gets the SUM of its slice over the ranks.
            reduce_scatter_into(mine, b.staging, group=self.group)
            # SUM / world: the mean gradient, as DDP's. add_, not copy_: gradients accumulate
            # over micro-batches until zero_grad.
            self.flat.in_shard(self.grad_shard, b).add_(mine.div_(self.world))
            b.staging, b.pending = None, len(b.params)

    def zero_grad(self) -> None:
        """Zero the gradients this rank holds (stage 1: the full buffer; stage 2: the shard)."""
        (self.flat_grad if self.stage == 1 else self.grad_shard).zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Average the gradients' shard, update it with Adam, all-gather the parameters."""
        flat = self.flat
        self.steps += 1
        if self.stage == 1:
            # ZeRO-1: every rank holds the full local gradient until now; zero_step
            # reduce-scatters it, updates this rank's shard, all-gathers the parameters.
            for p in flat.params:  # model.zero_grad() sets p.grad to None: back into the view
                view = flat.view(self.flat_grad, p)
                if p.grad is None:
                    view.zero_()  # no gradient since: zero, not the last step's
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view
            self.step_fn(flat.flat, self.flat_grad, self._update_shard)  # one bucket: flat
            return
        if any(b.pending != len(b.params) for b in flat.buckets):
            raise RuntimeError("some parameters got no gradient in this backward, so their "
                               "bucket was never reduce-scattered: ZeRO-2 needs every "
                               "trainable parameter to be used in the forward")
        for b in flat.buckets:  # the gradient shard is here already: update, then gather
            mine = flat.shard(flat.flat, b, self.rank)  # a view: the update lands in the buffer
            adam_update(mine, flat.in_shard(self.grad_shard, b), flat.in_shard(self.exp_avg, b),
                        flat.in_shard(self.exp_avg_sq, b), self.steps, lr=self.lr,
                        betas=self.betas, eps=self.eps)
            # In place: this rank's input IS its slot of the output, so nothing is copied
            # (NCCL documents the in-place form; the tests check it on gloo, 2 and 4 ranks).
            all_gather_into(flat.flat[b.start:b.start + b.numel], mine, group=self.group)

    def _update_shard(self, param_shard, grad_shard):
        """Adam on this rank's shard with its state; the new shard (``param_shard`` untouched)."""
        new = param_shard.clone()
        adam_update(new, grad_shard, self.exp_avg, self.exp_avg_sq, self.steps, lr=self.lr,
                    betas=self.betas, eps=self.eps)
        return new

    def _grad_bytes(self) -> int:
        flat = self.flat
        held = [p.grad for p in flat.params]
        held += [self.flat_grad] if self.stage == 1 else [self.grad_shard]
        return storage_bytes(held + [b.staging for b in flat.buckets])

    def held(self) -> dict:
        """Bytes this rank holds now, by kind, counted over the storages alive (views once)."""
        out = {"params": storage_bytes(self.flat.params), "grads": self._grad_bytes(),
               "optimizer": storage_bytes([self.exp_avg, self.exp_avg_sq])}
        out["total"] = out["params"] + out["grads"] + out["optimizer"]
        return out


# ---- measuring it against plain data parallelism -----------------------------------------------


def dp_held(model, opt) -> dict:
    """Bytes a plain data-parallel rank holds: params, grads, Adam's moments (step counters out)."""
    params = list(model.parameters())
    states = [v for p in params for k, v in opt.state[p].items() if k != "step"]
    out = {"params": storage_bytes(params), "grads": storage_bytes(p.grad for p in params),
           "optimizer": storage_bytes(states)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def zero_formulas(stage: int, n_params: int, world: int) -> dict:
    """Bytes one rank holds and sends per step under DP (``stage=0``) or ZeRO-1/2, fp32 Adam.

    ``n_params`` is Psi, padded to ``world`` for ZeRO. Held: ``memory.estimate_memory``.
    Sent: DP's all-reduce ``2 (n-1)/n * 4 Psi``; ZeRO's reduce-scatter ``(n-1)/n * 4 Psi`` plus
    all-gather ``(n-1)/n * 4 Psi``: the same. Example::

        >>> zero_formulas(2, 1000, 4)["grads"], zero_formulas(2, 1000, 4)["wire"]
        (1000, 6000)
    """
    held = estimate_memory(n_params, strategy=("dp", "zero1", "zero2")[stage], world_size=world,
                           precision="fp32")
    # Whole numbers: Psi is padded to a multiple of the ranks wherever ZeRO divides it.
    out = {k: int(held[k]) if float(held[k]).is_integer() else held[k]
           for k in ("params", "grads", "optimizer", "total")}
    s = 4 * n_params
    out["wire"] = (2 * (world - 1) * s // world if stage == 0
                   else (world - 1) * s // world + (world - 1) * s // world)
    return out


def _batch(seed: int, rank: int, step: int, batch: int, width: int, device):
    """This rank's (x, y) for ``step``: different on every rank, the same for DP and ZeRO."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x, y = torch.randn(2, batch, width, generator=g)
    return x.to(device), y.to(device)


def zero_check(stage: int, width: int, depth: int, steps: int, seed: int = 0, *,
               batch: int = 8, lr: float = 1e-3, bucket_numel: int | None = None,
               step_fn=None) -> dict:
    """Worker function: ZeRO-``stage`` (1 or 2) against plain data parallelism, step for step.

    Both train ``mlp_blocks(depth, width)`` from the same seed, each rank on its own batches
    (MSE loss, Adam, ``steps`` >= 2). Plain DP: every rank all-reduces each gradient, divides
    by ``n`` and runs ``torch.optim.Adam`` on everything; ZeRO: :class:`ZeroOptimizer` (Adam by
    hand on the shard). ZeRO-2's buckets are one block each unless ``bucket_numel`` says;
    ``step_fn`` replaces ZeRO-1's :func:`zero_step` (yours, from the exercise).

    Returns, for this rank: ``loss_diff`` and ``weight_diff`` (largest differences from DP,
    expected below ``TOL`` = 1e-5: sums over ranks taken in a different order),
    ``replica_diff`` (ZeRO's weights against rank 0's: exactly 0), and for ``"dp"`` and
    ``"zero"``: ``held`` bytes after the last step's backward and after its step, beside
    ``formula`` (Psi padded for ZeRO), ``wire`` (bytes sent in the last step, counted with
    ``traffic.count_traffic``) and ``calls``; ZeRO-2 adds ``grads_in_flight``, the most gradient
    bytes held during backward, measured when a bucket is full (formula: its shard plus the
    largest bucket, ``4 Psi / n + 4 B``).

    Example::

        >>> r = labkit.launch(zero_check, 2, 64, 4, 3, nproc=4).values[0]
        >>> r["weight_diff"] < 1e-5, r["zero"]["held"]["after_step"] == r["zero"]["formula"]
    """
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}: zero_check compares ZeRO-1 or "
                         f"ZeRO-2 with plain data parallelism (ZeRO-3: zero3_traffic)")
    width, depth, batch = whole(width, "width"), whole(depth, "depth"), whole(batch, "batch")
    steps = whole(steps, "steps", low=2, hint=": the bytes are measured in the last step, "
                                              "once Adam's state exists")
    device = collective_device()
    world, rank = dist.get_world_size(), dist.get_rank()

    def build():
        torch.manual_seed(seed)
        return mlp_blocks(depth, width).to(device)

    dp_model, zero_model = build(), build()
    dp_opt = torch.optim.Adam(dp_model.parameters(), lr=lr)
    if stage == 2 and bucket_numel is None:
        bucket_numel = sum(p.numel() for p in zero_model[0].parameters())  # one block a bucket
    zero_opt = ZeroOptimizer(zero_model, stage, lr=lr, bucket_numel=bucket_numel,
                             step_fn=step_fn)
    out = {"dp": {"losses": [], "held": {}}, "zero": {"losses": [], "held": {}}}

    def train_step(name, model, reduce_and_step, held, step, last):
        x, y = _batch(seed, rank, step, batch, width, device)
        with traffic.count_traffic() as t:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if last:
                out[name]["held"]["after_backward"] = held()
            reduce_and_step()
        out[name]["losses"].append(loss.item())
        if last:
            out[name]["held"]["after_step"] = held()
            out[name].update(wire=t.sent_bytes(), wire_by_op=t.by_op(), calls=t.counts())

    def dp_reduce_and_step():
        for p in dp_model.parameters():  # plain DP: every rank gets the whole averaged gradient
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        dp_opt.step()

    for step in range(steps):
        last = step == steps - 1
        dp_opt.zero_grad()
        train_step("dp", dp_model, dp_reduce_and_step, lambda: dp_held(dp_model, dp_opt), step,
                   last)
        zero_opt.zero_grad()
        train_step("zero", zero_model, zero_opt.step, zero_opt.held, step, last)

    flat = zero_opt.flat
    rank0 = flat.flat.clone()
    dist.broadcast(rank0, src=0)
    out["dp"]["formula"] = zero_formulas(0, flat.numel, world)
    out["zero"]["formula"] = zero_formulas(stage, flat.padded, world)
    if stage == 2:
        out["zero"]["grads_in_flight"] = zero_opt.grads_in_flight
        out["zero"]["grads_in_flight_formula"] = (
            4 * flat.shard_numel + 4 * max(b.numel for b in flat.buckets))
    out.update(
        rank=rank, world_size=world, stage=stage, n_params=flat.numel, padded=flat.padded,
        buckets=[b.numel for b in flat.buckets],
        loss_diff=max(abs(a - b) for a, b in zip(out["dp"]["losses"], out["zero"]["losses"],
                                                  strict=True)),
        weight_diff=max((a - b).abs().max().item()
                        for a, b in zip(dp_model.parameters(), zero_model.parameters(),
                                        strict=True)),
        replica_diff=(flat.flat - rank0).abs().max().item())
    return out


# ---- ZeRO-3 is FSDP ----------------------------------------------------------------------------


def zero3_traffic(width: int, depth: int, seed: int = 0, *, batch: int = 8) -> dict:
    """Worker function: FSDP2's (ZeRO-3's) bytes on the wire per step, and the bytes it holds.

    ``mlp_blocks(depth, width)`` with ``fully_shard`` on each block, then on the root; one
    Adam step to warm up, then one counted with ``traffic.count_traffic``: the all-gathers of
    forward, the all-gathers again in backward (each block was resharded after its forward)
    and the reduce-scatter of the gradients, ``3 (n-1)/n * 4 Psi`` in all, 1.5 times data
    parallelism's all-reduce ``2 (n-1)/n * 4 Psi``. ``width`` must be a multiple of the ranks
    (no padding, so the formula is exact). ``held`` is ``memory.fsdp_memory``'s count of the
    same model's sharded bytes per rank.

    Example::

        >>> r = labkit.launch(zero3_traffic, 64, 4, nproc=4).values[0]
        >>> r["wire"] / r["dp_wire_formula"]
        1.5
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width, depth, batch = whole(width, "width"), whole(depth, "depth"), whole(batch, "batch")
    world, rank = dist.get_world_size(), dist.get_rank()
    if width % world:
        raise ValueError(f"width {width} does not split over {world} ranks: use a multiple of "
                         f"{world} (e.g. {multiples_near(width, world)}), so that FSDP2 needs no "
                         f"padding and the traffic formula is exact")
    device = collective_device()
    torch.manual_seed(seed)
    model = mlp_blocks(depth, width).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh(device.type, (world,))
    # The blocks hold every parameter; the root (the nn.Sequential) holds none. That matters:
    # FSDP2 does not reshard the ROOT's parameters after forward (backward would gather them
    # again at once), so root parameters would be gathered once, not twice, and the total
    # would fall short of 3x. Each block is resharded after its forward and gathered again
    # for its backward.
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):  # the first step sets FSDP2 up lazily: count the second
        x, y = _batch(seed, rank, step, batch, width, device)
        opt.zero_grad()
        with traffic.count_traffic() as t:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    s = 4 * n_params
    dp_wire = 2 * (world - 1) * s // world
    held = fsdp_memory(functools.partial(mlp_blocks, depth, width), steps=1, seed=seed)
    return {"rank": rank, "world_size": world, "n_params": n_params, "wire": t.sent_bytes(),
            "wire_by_op": t.by_op(), "calls": t.counts(),
            "formula": 3 * (world - 1) * s // world, "dp_wire_formula": dp_wire,
            "ratio": t.sent_bytes() / dp_wire if dp_wire else None,
            "held": held["sharded"], "unsharded": held["unsharded"]}


def zero_rows(zero1: dict, zero2: dict, zero3: dict) -> list[dict]:
    """One row per strategy (DP, ZeRO-1, ZeRO-2, ZeRO-3) from one rank's results, for a table.

    ``zero1`` and ``zero2``: :func:`zero_check` results for stages 1 and 2, ``zero3``:
    :func:`zero3_traffic`'s, of one model on one rank. Each row: ``label``, the bytes held
    after the step (``params``, ``grads``, ``optimizer``, ``total``), ``in_flight`` (ZeRO-2's
    bucket during backward, else 0) and ``wire`` (bytes sent per step). Example::

        >>> plots.zero_plot(zero_rows(z1, z2, z3))
    """
    def row(label, held, wire, in_flight=0):
        return {"label": label, **{k: held[k] for k in ("params", "grads", "optimizer")},
                "total": held["params"] + held["grads"] + held["optimizer"],
                "in_flight": in_flight, "wire": wire}

    z2 = zero2["zero"]
    return [row("DP", zero1["dp"]["held"]["after_step"], zero1["dp"]["wire"]),
            row("ZeRO-1", zero1["zero"]["held"]["after_step"], zero1["zero"]["wire"]),
            row("ZeRO-2", z2["held"]["after_step"], z2["wire"],
                z2["grads_in_flight"] - z2["held"]["after_step"]["grads"]),
            row("ZeRO-3 (FSDP2)", zero3["held"], zero3["wire"])]

"""Performance tuning: each technique measured before and after, as plain dicts.

One small function per technique of notebook 04. Single-process techniques (mixed precision,
channels_last, ``torch.compile``) time a training step with :func:`labkit.bench`'s step timer
(warm-up, device synchronised before the clock stops), repeated with the variants' order
alternated, and keep the median, so every variant is measured beside its baseline under the
same load. The data-parallel ones (:func:`comm_hook_sweep`, :func:`overlap_sweep`) are worker
functions for ``labkit.launch``::

    rows = labkit.launch(comm_hook_sweep, nproc=2).values[0]

:func:`result_row` and :func:`results_table` gather every technique into one table, which
``labkit.plots.tuning_plot`` draws. Nothing here plots.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from . import bench
from ._sizes import divisors
from .parallel.memory import counting_saved_bytes

__all__ = ["AMP_MODES", "HOOKS", "compare_steps", "time_step", "grad_scaler_check",
           "loader_throughput", "loader_sweep", "accumulation_check", "powersgd_bytes", "comm_hook_sweep",
           "overlap_sweep", "profile_top_ops", "result_row", "results_table"]

AMP_MODES = (None, "bf16", "fp16")
HOOKS = ("none", "fp16", "bf16", "powersgd")
_VARIANT_KEYS = ("amp", "channels_last", "compile")
_ROW_KEYS = ("technique", "before", "after", "unit", "speedup", "note")


def _check_batch(batch):
    """``(inputs, labels)`` tensors of one length, or a ValueError that shows one."""
    example = "e.g. (torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))"
    if (not isinstance(batch, (tuple, list)) or len(batch) != 2
            or not all(isinstance(t, torch.Tensor) for t in batch)):
        raise ValueError(f"batch must be a pair of tensors (inputs, labels), {example}")
    x, y = batch
    if x.dim() < 2 or len(x) == 0 or len(x) != len(y):
        raise ValueError(f"batch needs inputs (N, ...) and N labels with N >= 1, got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}: {example}")
    return x, y


def _check_counts(**counts):
    """Each named count is an int >= its minimum (given as ``name=(value, minimum)``)."""
    for name, (value, minimum) in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class _Autocast(nn.Module):
    """The wrapped model run under autocast; logits leave in float32 for the loss."""

    def __init__(self, module: nn.Module, dtype):
        super().__init__()
        self.module, self.dtype = module, dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.module(x).float()


def _tuned(model: nn.Module, device, amp=None, channels_last=False, compile=False) -> nn.Module:
    """A copy of ``model`` on ``device`` with the variant's changes applied."""
    tuned = copy.deepcopy(model).to(device)
    if channels_last:
        tuned = tuned.to(memory_format=torch.channels_last)
    if amp is not None:
        tuned = _Autocast(tuned, torch.bfloat16 if amp == "bf16" else torch.float16)
    return torch.compile(tuned) if compile else tuned


def _check_variant(name, options: dict, x) -> dict:
    """A variant's options with defaults filled in, or a ValueError naming the problem."""
    if not isinstance(options, dict):
        raise ValueError(f"variant {name!r} must be a dict of options, e.g. {{'amp': 'bf16'}}")
    unknown = sorted(set(options) - set(_VARIANT_KEYS))
    if unknown:
        raise ValueError(f"variant {name!r} has unknown options {unknown}: use "
                         f"{', '.join(_VARIANT_KEYS)}")
    options = {"amp": None, "channels_last": False, "compile": False, **options}
    if options["amp"] not in AMP_MODES:
        raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {options['amp']!r}")
    if options["channels_last"] and x.dim() != 4:
        raise ValueError(f"channels_last is a layout of image batches (N, C, H, W); the inputs "
                         f"have shape {tuple(x.shape)}: leave channels_last=False for them")
    return options


def compare_steps(model: nn.Module, batch, variants: dict, *, steps: int = 10, warmup: int = 2,
                  repeats: int = 3) -> list[dict]:
    """Median seconds of a training step (forward, backward, SGD) for each variant, side by side.

    ``variants`` maps a name to options: ``amp`` (None, ``"bf16"``, ``"fp16"``: autocast),
    ``channels_last`` (NHWC memory layout for model and inputs) and ``compile``
    (``torch.compile``). Each variant is a copy of ``model`` built once, so a compiled one
    compiles once: ``first_step_s`` is its first step, compilation included. Then ``repeats``
    rounds of ``warmup`` + ``steps`` steps, the variants' order reversed every other round so a
    machine that gets busier slows all of them alike. Timed fp16 steps leave out the
    GradScaler (see :func:`grad_scaler_check`); a variant whose compilation fails gets a
    ``skipped`` reason instead of times.

    Example::

        >>> batch = (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
        >>> rows = compare_steps(convnet(), batch, {"fp32": {}, "bf16": {"amp": "bf16"}})
        >>> [r["variant"] for r in rows], rows[0]["step_s"] > 0
        (['fp32', 'bf16'], True)
    """
    x, y = _check_batch(batch)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module (it is copied per variant), got "
                         f"{type(model).__name__}")
    if not isinstance(variants, dict) or not variants:
        raise ValueError("variants must be a non-empty dict, e.g. {'fp32': {}, 'bf16': "
                         "{'amp': 'bf16'}}")
    _check_counts(steps=(steps, 1), warmup=(warmup, 0), repeats=(repeats, 1))
    device = x.device
    built, rows = {}, {}
    for name, options in variants.items():
        options = _check_variant(name, options, x)
        xi = x.contiguous(memory_format=torch.channels_last) if options["channels_last"] else x
        rows[name] = {"variant": name, **options, "device": str(device), "batch": len(x),
                      "first_step_s": None, "step_s": None, "samples_per_s": None,
                      "step_s_all": [], "skipped": None}
        model_i = _tuned(model, device, **options)
        try:  # the first step pays for compilation (and on GPUs, cuDNN's autotuning)
            rows[name]["first_step_s"] = bench._time_steps(lambda m=model_i: m, None, xi, y, 1,
                                                           0, device)
        except Exception as exc:
            if not options["compile"]:
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            rows[name]["skipped"] = f"torch.compile failed: {type(exc).__name__}: {first}"
            continue
        built[name] = (model_i, xi)
    names = list(built)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            model_i, xi = built[name]
            seconds = bench._time_steps(lambda m=model_i: m, None, xi, y, steps, warmup, device)
            rows[name]["step_s_all"].append(seconds / steps)
    for name in names:
        row = rows[name]
        row["step_s"] = statistics.median(row["step_s_all"])
        row["samples_per_s"] = len(x) / row["step_s"]
    return list(rows.values())


def time_step(model: nn.Module, batch, *, amp=None, channels_last: bool = False,
              compile: bool = False, steps: int = 10, warmup: int = 2, repeats: int = 3) -> dict:
    """One variant of :func:`compare_steps`: the median training-step time of ``model``.

    Example::

        >>> row = time_step(convnet(), batch, amp="bf16", channels_last=True)
        >>> row["step_s"], row["samples_per_s"]
        (0.0123, 1300.8)
    """
    options = {"amp": amp, "channels_last": channels_last, "compile": compile}
    return compare_steps(model, batch, {"step": options}, steps=steps, warmup=warmup,
                         repeats=repeats)[0]


def _grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened into one float32 vector."""
    return torch.cat([p.grad.detach().float().reshape(-1) for p in model.parameters()])


def grad_scaler_check(model: nn.Module, batch, *, loss_factor: float = 1e-5) -> dict:
    """Why fp16 needs a GradScaler: gradients that underflow in fp16, and survive when scaled.

    float16 has 5 exponent bits: values below about 6e-8 become 0 and those below 6e-5 lose
    precision. Small gradients (``loss_factor`` scales the loss down to make them, as late in
    training or with a loss averaged over many tokens) vanish in an fp16 backward pass. The
    GradScaler multiplies the loss by a large factor before backward and divides the
    gradients by it before the optimizer step. bfloat16 keeps float32's exponent range and
    needs no scaler. Compares each gradient with float32's: ``zero_*`` is the fraction of
    gradient entries that came out exactly 0, ``error_*`` the relative L2 error.

    Example::

        >>> r = grad_scaler_check(small_cnn(), batch)
        >>> r["zero_fp16"] > r["zero_fp16_scaled"], r["error_fp16_scaled"] < 0.05
        (True, True)
    """
    x, y = _check_batch(batch)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not 0 < loss_factor <= 1:
        raise ValueError(f"loss_factor must be in (0, 1] (it scales the loss down to make small "
                         f"gradients), got {loss_factor!r}")
    device = x.device

    def backward(amp, scaler=None):
        m = _tuned(model, device, amp=amp)
        loss = nn.functional.cross_entropy(m(x), y) * loss_factor
        if scaler is None:
            loss.backward()
            return _grads(m)
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # divides the gradients by the scale, and checks for inf/NaN
        return _grads(m)

    reference = backward(None)
    plain = backward("fp16")
    scaler = torch.amp.GradScaler(device.type)
    scaled = backward("fp16", scaler)

    def error(g):
        return ((g - reference).norm() / reference.norm()).item()

    def zeros(g):
        return (g == 0).float().mean().item()

    return {"loss_factor": loss_factor, "scale": scaler.get_scale(),
            "zero_fp32": zeros(reference), "zero_fp16": zeros(plain),
            "zero_fp16_scaled": zeros(scaled), "error_fp16": error(plain),
            "error_fp16_scaled": error(scaled)}


def loader_throughput(dataset, *, workers: int = 0, pin_memory: bool = False,
                      batch_size: int = 32, batches: int | None = None, repeats: int = 1,
                      device=None) -> dict:
    """Samples per second a ``DataLoader`` delivers with ``workers`` processes (one epoch).

    With ``workers=0`` the training process runs every per-sample transform itself; with N
    workers, N processes prepare batches while the training process trains (start-up
    included: workers start anew every epoch unless ``persistent_workers``). ``main_cpu_s`` is
    the CPU time the training process itself spent, which workers take off it whatever else
    the machine is doing (wall-clock gains need idle cores). ``pin_memory``
    puts batches in page-locked memory, which a GPU copies from asynchronously: it pays only
    with a CUDA ``device`` (without a GPU it does nothing, and ``pinned`` says so). With
    ``device`` each batch is also copied there (``non_blocking`` when pinned).

    Example::

        >>> ds = labkit.data.to_torch(shapes(512, 64), transform=augmentation(64))
        >>> loader_throughput(ds, workers=2)["samples_per_s"]
        1480.2
    """
    from torch.utils.data import DataLoader

    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise ValueError(f"dataset must be a map-style Dataset (len and [i]), got "
                         f"{type(dataset).__name__}: e.g. labkit.data.to_torch(imageset)")
    _check_counts(workers=(workers, 0), batch_size=(batch_size, 1), repeats=(repeats, 1))
    if batches is not None:
        _check_counts(batches=(batches, 1))
    if len(dataset) < batch_size:
        raise ValueError(f"the dataset has {len(dataset)} samples, fewer than one batch of "
                         f"{batch_size}: use a smaller batch_size or more data")
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    # Without a GPU, DataLoader ignores pin_memory with a warning; the row's "pinned" says so.
    pin = pin_memory and torch.cuda.is_available()
    total = len(dataset) // batch_size if batches is None else min(batches,
                                                                   len(dataset) // batch_size)
    seconds, startup, cpu, pinned = [], [], [], False
    for _ in range(repeats):
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=workers, pin_memory=pin,
                            drop_last=True)
        start, cpu_start = time.perf_counter(), time.process_time()
        for i, (x, _y) in enumerate(loader):
            if i == 0:
                startup.append(time.perf_counter() - start)
                pinned = pin and x.is_pinned()
            if device is not None:
                x.to(device, non_blocking=pin)
            if i + 1 == total:
                break
        if cuda:
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    epoch = statistics.median(seconds)
    return {"workers": workers, "pin_memory": pin_memory, "pinned": bool(pinned),
            "batch_size": batch_size, "batches": total, "seconds": epoch,
            "startup_s": statistics.median(startup), "samples_per_s": total * batch_size / epoch,
            "main_cpu_s": statistics.median(cpu),
            "device": str(device) if device is not None else None}


def loader_sweep(dataset, settings=((0, False), (2, False), (2, True)), *, repeats: int = 2,
                 **kwargs) -> list[dict]:
    """:func:`loader_throughput` for each ``(workers, pin_memory)`` in ``settings``, side by side.

    ``repeats`` rounds, the settings' order reversed every other round, so a machine that gets
    busier slows all of them alike; each row holds the median epoch (``seconds_all``: every
    round's). Other keyword arguments go to :func:`loader_throughput`.

    Example::

        >>> rows = loader_sweep(dataset, [(0, False), (2, False)], batch_size=32)
        >>> rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
        1.62
    """
    settings = list(settings) if isinstance(settings, (list, tuple)) else []
    if not settings or any(not isinstance(s, (list, tuple)) or len(s) != 2 for s in settings):
        raise ValueError(f"settings must be (workers, pin_memory) pairs, e.g. [(0, False), "
                         f"(2, True)], got {settings!r}")
    _check_counts(repeats=(repeats, 1))
    runs: dict = {tuple(s): [] for s in settings}
    keys = list(runs)
    for r in range(repeats):
        for workers, pin in keys if r % 2 == 0 else keys[::-1]:
            runs[workers, pin].append(loader_throughput(dataset, workers=workers,
                                                        pin_memory=pin, **kwargs))
    rows = []
    for key in keys:
        row, seconds = dict(runs[key][0]), [r["seconds"] for r in runs[key]]
        row.update(seconds=statistics.median(seconds), seconds_all=seconds,
                   startup_s=statistics.median(r["startup_s"] for r in runs[key]),
                   main_cpu_s=statistics.median(r["main_cpu_s"] for r in runs[key]))
        row["samples_per_s"] = row["batches"] * row["batch_size"] / row["seconds"]
        rows.append(row)
    return rows


def accumulation_check(model: nn.Module, batch, micro_batches: int) -> dict:
    """Gradient accumulation: k micro-batches give one big batch's gradients, in 1/k the memory.

    Runs backward on the whole batch, then on ``micro_batches`` equal slices with each loss
    divided by k (the big batch's loss is a mean), summing the gradients. Reports the largest
    gradient difference (float rounding only) and the bytes autograd saved for backward
    (activations, the memory that grows with the batch; weights count once in both).

    Example::

        >>> r = accumulation_check(convnet(), batch, 4)
        >>> r["max_abs_diff"] < 1e-5, r["saved_bytes_batch"] / r["saved_bytes_micro"]
        (True, 3.6)
    """
    x, y = _check_batch(batch)
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_counts(micro_batches=(micro_batches, 1))
    if len(x) % micro_batches:
        raise ValueError(f"a batch of {len(x)} does not split into {micro_batches} equal "
                         f"micro-batches (unequal ones would weigh samples unequally): use a "
                         f"divisor of {len(x)}, e.g. {divisors(len(x), 5)[1:]}")
    whole, accumulated = copy.deepcopy(model).to(x.device), copy.deepcopy(model).to(x.device)
    with counting_saved_bytes() as big:
        loss = nn.functional.cross_entropy(whole(x), y)
    loss.backward()
    micro = 0
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        with counting_saved_bytes() as counter:
            loss = nn.functional.cross_entropy(accumulated(xs), ys) / micro_batches
        loss.backward()  # adds into .grad: that is the accumulation
        micro = max(micro, counter["bytes"])
    g_big, g_acc = _grads(whole), _grads(accumulated)
    diff = (g_big - g_acc).abs().max().item()
    return {"micro_batches": micro_batches, "batch": len(x), "micro_batch": len(x) // micro_batches,
            "max_abs_diff": diff, "max_rel_diff": diff / max(g_big.abs().max().item(), 1e-30),
            "saved_bytes_batch": big["bytes"], "saved_bytes_micro": micro}


# ---- data-parallel communication: hooks, buckets, overlap ------------------------------------


def powersgd_bytes(model: nn.Module, rank: int = 1, min_compression_rate: float = 2.0) -> dict:
    """The bytes PowerSGD all-reduces per step for ``model``'s gradients, against plain DDP.

    PowerSGD views each gradient as a matrix ``n x m`` (first dimension by the rest) and sends
    two rank-``r`` factors, ``(n + m) r`` numbers instead of ``n m``, when that is at least
    ``min_compression_rate`` times smaller; other tensors (biases, small layers) go uncompressed.
    This is the rule of ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.

    Example::

        >>> powersgd_bytes(small_cnn(10, 16))
        {'uncompressed_bytes': 40872, 'compressed_bytes': 3196, 'ratio': 12.79}
    """
    _check_counts(rank=(rank, 1))
    if not min_compression_rate > 0:
        raise ValueError(f"min_compression_rate must be > 0, got {min_compression_rate!r}")
    before = after = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n = p.shape[0] if p.dim() else 1
        m = p.numel() // n
        r = min(n, m, rank)
        size = p.element_size()
        before += n * m * size
        compress = (n + m) * r * min_compression_rate < n * m
        after += ((n + m) * r if compress else n * m) * size
    return {"uncompressed_bytes": before, "compressed_bytes": after, "ratio": before / after}


@contextlib.contextmanager
def _counting_allreduce(counter: dict):
    """Count calls and bytes of every ``dist.all_reduce`` while inside (hooks call it)."""
    real = dist.all_reduce
    lock = threading.Lock()  # PowerSGD's later all-reduces run in future callbacks

    def counted(tensor, *args, **kwargs):
        with lock:
            counter["calls"] += 1
            counter["bytes"] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield counter
    finally:
        dist.all_reduce = real


def _comm_hook(name: str, powersgd_rank: int, powersgd_start: int):
    """``(state, hook)`` for DDP's ``register_comm_hook``; 'none' is DDP's own all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=powersgd_start)
        return state, powerSGD_hook.powerSGD_hook
    # allreduce_hook is what DDP does without a hook, but in Python, where it can be counted.
    return None, {"none": default_hooks.allreduce_hook,
                  "fp16": default_hooks.fp16_compress_hook,
                  "bf16": default_hooks.bf16_compress_hook}[name]


def comm_hook_sweep(hooks=HOOKS, *, steps: int = 60, batch: int = 32, lr: float = 0.04,
                    image_size: int = 16, powersgd_rank: int = 1, powersgd_start: int = 10,
                    seed: int = 0) -> list[dict]:
    """Worker function: train with each DDP communication hook; bytes sent and accuracy.

    Every hook trains ``labkit.models.small_cnn`` on the digits from the same weights with
    the same batches (``batch`` per worker) for ``steps`` SGD steps. ``none`` all-reduces
    float32 gradients; ``fp16`` / ``bf16`` cast each bucket to 16 bits first (half the bytes;
    bf16 keeps float32's range, fp16 its precision); ``powersgd`` sends rank-``powersgd_rank``
    factors after ``powersgd_start`` plain steps, with error feedback (what compression drops
    is added to the next step's gradient). Bytes are counted by wrapping ``dist.all_reduce``,
    which every hook calls. Rows: ``hook, bytes_per_step`` (the last step's payload),
    ``wire_bytes_per_step`` (what each rank sends in a ring: ``2 (n-1)/n`` x payload),
    ``allreduces_per_step, val_loss, val_acc, train_s``; every rank returns the same rows.

    Example::

        >>> rows = labkit.launch(comm_hook_sweep, nproc=2).values[0]
        >>> {r["hook"]: r["bytes_per_step"] for r in rows}
        {'none': 40872, 'fp16': 20436, 'bf16': 20436, 'powersgd': 3196}
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .data import digits, split, to_float_tensors
    from .models import small_cnn

    if not isinstance(hooks, (list, tuple)) or not hooks or any(h not in HOOKS for h in hooks):
        raise ValueError(f"hooks must be a list of some of {', '.join(HOOKS)}, got {hooks!r}")
    _check_counts(steps=(steps, 1), batch=(batch, 1), powersgd_rank=(powersgd_rank, 1),
                  powersgd_start=(powersgd_start, 2))
    if "powersgd" in hooks and steps <= powersgd_start:
        raise ValueError(f"PowerSGD compresses only after powersgd_start={powersgd_start} plain "
                         f"steps: use steps > {powersgd_start}, or a smaller powersgd_start")
    device = bench._device()
    rank, world = dist.get_rank(), dist.get_world_size()
    train_set, val_set = split(digits(image_size), 0.2, seed=seed)
    x_train, y_train = to_float_tensors(train_set)
    x_val, y_val = (t.to(device) for t in to_float_tensors(val_set))
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))
    per_step = batch * world

    def shard(step):
        """This rank's slice of the step's global batch: the same batches for every hook."""
        start = step * per_step % (len(order) - per_step + 1)
        idx = order[start:start + per_step][rank::world]
        return x_train[idx].to(device), y_train[idx].to(device)

    rows = []
    for name in hooks:
        torch.manual_seed(seed)
        ids = [device.index] if device.type == "cuda" else None
        model = DDP(small_cnn(10, image_size).to(device), device_ids=ids)
        model.register_comm_hook(*_comm_hook(name, powersgd_rank, powersgd_start))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        counter = {"calls": 0, "bytes": 0}
        start = time.perf_counter()
        with _counting_allreduce(counter):
            for step in range(steps):
                before = dict(counter)
                xs, ys = shard(step)
                opt.zero_grad(set_to_none=True)
                # DDP waits for every bucket's future before backward returns: the count is whole.
                nn.functional.cross_entropy(model(xs), ys).backward()
                opt.step()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        with torch.no_grad():
            logits = model.module(x_val)
        payload = counter["bytes"] - before["bytes"]
        rows.append({"hook": name, "bytes_per_step": payload,
                     "wire_bytes_per_step": bench.bus_bandwidth(payload, world),
                     "allreduces_per_step": counter["calls"] - before["calls"],
                     "val_loss": nn.functional.cross_entropy(logits, y_val).item(),
                     "val_acc": (logits.argmax(1) == y_val).float().mean().item(),
                     "train_s": elapsed.item(), "steps": steps, "ranks": world,
                     "params_bytes": sum(p.numel() * p.element_size()
                                         for p in model.module.parameters())})
    return rows


def _blocking_allreduce_hook(state: dict, bucket):
    """Reduce the bucket before returning: backward waits on each bucket, nothing overlaps."""
    buffer = bucket.buffer()
    state["calls"] += 1
    dist.all_reduce(buffer.div_(dist.get_world_size()))
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


def overlap_sweep(caps_mb=(1, 25), *, model=None, batch: int = 32, steps: int = 5,
                  warmup: int = 2, repeats: int = 3) -> list[dict]:
    """Worker function: how much of the all-reduce DDP hides behind backward, per bucket size.

    Three step times for each ``bucket_cap_mb`` in ``caps_mb`` (``model`` a factory, default
    ``bench.wide_mlp``): ``compute_s`` without any communication, ``overlapped_s`` with DDP as
    it is (a bucket's all-reduce starts as soon as backward fills it), ``serial_s`` with a hook
    that waits for each all-reduce before backward goes on. ``hidden_fraction`` is the share of
    the communication time that overlap hid: ``(serial - overlapped) / (serial - compute)``
    (None when the communication time is lost in the noise). Times are medians over
    ``repeats`` alternated rounds, the slowest rank's.

    Example::

        >>> rows = labkit.launch(overlap_sweep, [1, 25], nproc=2).values[0]
        >>> [(r["bucket_cap_mb"], r["buckets"]) for r in rows]
        [(1, 13), (25, 2)]
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    caps = list(caps_mb) if isinstance(caps_mb, (list, tuple)) else []
    if not caps or any(not isinstance(c, (int, float)) or c <= 0 for c in caps):
        raise ValueError(f"caps_mb must be positive sizes in MB, e.g. [1, 25], got {caps_mb!r}")
    _check_counts(batch=(batch, 1), steps=(steps, 1), warmup=(warmup, 0), repeats=(repeats, 1))
    device = bench._device()
    make = model or bench.wide_mlp
    inputs = next(m for m in make().modules() if isinstance(m, nn.Linear)).in_features
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, inputs, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    ids = [device.index] if device.type == "cuda" else None
    variants, buckets = {("compute", None): make().to(device)}, {}
    for cap in caps:
        torch.manual_seed(0)
        variants["overlapped", cap] = DDP(make().to(device), device_ids=ids, bucket_cap_mb=cap)
        serial = DDP(make().to(device), device_ids=ids, bucket_cap_mb=cap)
        buckets[cap] = {"calls": 0}
        serial.register_comm_hook(buckets[cap], _blocking_allreduce_hook)
        variants["serial", cap] = serial
    times = {key: [] for key in variants}
    names = list(variants)
    for r in range(repeats):
        for key in names if r % 2 == 0 else names[::-1]:
            counter = buckets.get(key[1]) if key[0] == "serial" else None
            calls = counter["calls"] if counter else 0
            dist.barrier()  # start together: an all-reduce waits for its slowest rank
            seconds = bench._time_steps(lambda m=variants[key]: m, None, x, y, steps, warmup,
                                        device)
            times[key].append(seconds / steps)
            if counter:  # the latest round's count: DDP rebuilds its buckets after step one
                counter["per_step"] = (counter["calls"] - calls) / (steps + warmup)
    medians = torch.tensor([statistics.median(times[k]) for k in names], dtype=torch.float64,
                           device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    step = dict(zip(names, medians.tolist(), strict=True))
    rows = []
    for cap in caps:
        compute, overlapped, serial = step["compute", None], step["overlapped", cap], \
            step["serial", cap]
        comm = serial - compute
        rows.append({"bucket_cap_mb": cap, "buckets": buckets[cap]["per_step"],
                     "compute_s": compute, "overlapped_s": overlapped, "serial_s": serial,
                     "comm_s": comm,
                     "hidden_fraction": (serial - overlapped) / comm if comm > 0.02 * serial
                     else None, "ranks": dist.get_world_size()})
    return rows


# ---- profiler and the results table ----------------------------------------------------------


def profile_top_ops(fn, n: int = 10, *, steps: int = 3, warmup: int = 1, trace=None) -> list[dict]:
    """Run ``fn()`` under ``torch.profiler`` and return its ``n`` costliest operators as rows.

    ``warmup`` untimed calls first (allocator, lazy initialisation), then ``steps`` profiled
    ones. Rows, costliest self time first (GPU time when CUDA ran, else CPU time): ``op,
    calls`` (per step), ``self_ms`` and ``total_ms`` (per step; total includes the ops it
    called), ``share`` (of all self time). ``trace`` names a file for the Chrome/Perfetto
    trace (open it at https://ui.perfetto.dev).

    Example::

        >>> rows = profile_top_ops(lambda: model(x).sum().backward(), n=5)
        >>> rows[0]["op"]
        'aten::convolution_backward'
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise ValueError(f"fn must be a callable that runs one step, e.g. lambda: "
                         f"train_step(), got {type(fn).__name__}")
    _check_counts(n=(n, 1), steps=(steps, 1), warmup=(warmup, 0))
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    # Operators only: GPU kernels appear as rows of their own too, and would count twice (an
    # operator's device time is that of the kernels it launched).
    events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU
              and not e.key.startswith("ProfilerStep")]
    on_device = cuda and any(e.self_device_time_total > 0 for e in events)

    def self_us(e):
        return e.self_device_time_total if on_device else e.self_cpu_time_total

    total = sum(self_us(e) for e in events) or 1
    top = sorted(events, key=self_us, reverse=True)[:n]
    return [{"op": e.key, "calls": e.count / steps, "self_ms": self_us(e) / 1e3 / steps,
             "total_ms": (e.device_time_total if on_device else e.cpu_time_total) / 1e3 / steps,
             "share": self_us(e) / total, "clock": "device" if on_device else "cpu"}
            for e in top]


def result_row(technique: str, before: float, after: float, unit: str, *,
               higher_is_better: bool = False, note: str = "") -> dict:
    """One line of the results table: a technique's baseline and tuned figures, and the gain.

    ``speedup`` is how many times better ``after`` is: ``before / after`` for costs (seconds,
    bytes: ``higher_is_better=False``), ``after / before`` for rates (samples/s). Above 1 the
    technique helped.

    Example::

        >>> result_row("bf16 autocast", 0.020, 0.010, "s/step")["speedup"]
        2.0
    """
    if not isinstance(technique, str) or not technique:
        raise ValueError("technique must be a non-empty name, e.g. 'bf16 autocast'")
    for name, value in (("before", before), ("after", after)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(f"{name} must be a positive number (a time, a size or a rate), got "
                             f"{value!r}: a skipped measurement has no row")
    speedup = after / before if higher_is_better else before / after
    return {"technique": technique, "before": before, "after": after, "unit": unit,
            "speedup": speedup, "note": note}


def _fmt(value: float) -> str:
    """Four significant figures, thousands apart: 40872 -> '40,872', 0.01234 -> '0.01234'."""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def results_table(rows: list[dict]) -> str:
    """The rows of :func:`result_row` as one aligned text table (print it).

    Example::

        >>> print(results_table([result_row("bf16 autocast", 0.02, 0.01, "s/step")]))
        technique      before  after  unit    speedup  note
        bf16 autocast    0.02   0.01  s/step    2.00x
    """
    if not rows:
        raise ValueError("no rows: build them with result_row(technique, before, after, unit)")
    missing = sorted({k for r in rows for k in _ROW_KEYS if k not in r})
    if missing:
        raise ValueError(f"rows lack {missing}: build them with result_row(technique, before, "
                         f"after, unit)")
    cells = [[r["technique"], _fmt(r["before"]), _fmt(r["after"]), r["unit"],
              f"{r['speedup']:.2f}x", r["note"]] for r in rows]
    header = ["technique", "before", "after", "unit", "speedup", "note"]
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]
    right = (False, True, True, False, True, False)

    def line(cols):
        return "  ".join(str(c).rjust(w) if r else str(c).ljust(w)
                         for c, w, r in zip(cols, widths, right, strict=True)).rstrip()

    return "\n".join([line(header), *(line(c) for c in cells)])

"""Performance tuning, the code of notebook 04: each technique measured before and after.

One room past 800 lines on purpose: notebook 04's techniques share one rule (each timed beside
its own baseline, under the same load) and one results table; split by technique, each part
would repeat them.

One small function per technique. Single-process techniques (mixed precision, channels_last,
``torch.compile``) time a training step with the shared step timer (warm-up, device
synchronised before the clock stops), repeated with the variants' order alternated, and keep
the median, so every variant is measured beside its baseline under the same load.
:func:`comm_hook_sweep` is a worker function for ``labkit.launch``::

    rows = labkit.launch(comm_hook_sweep, nproc=2).values[0]

The bucket-size and overlap measurement is ``labkit.ddp.bucket_sweep(..., overlap=True)``, the
same sweep notebook 02 uses. :func:`vgg16_throughput` gives images/s and MFU of VGG16 (its
FLOPs: ``labkit.models.vgg16_flops``). :func:`result_row` and :func:`results_table` gather
every technique into one table, which ``labkit.plots.tuning_plot`` draws. Nothing here plots.
"""

from __future__ import annotations

import copy
import os
import re
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ._display import hang, table_text, wrap
from ._dist import collective_device, time_steps
from ._sizes import divisors, whole
from .bench import bus_bandwidth
from .ddp import counting_allreduces
from .parallel.memory import counting_saved_bytes

__all__ = ["AMP_MODES", "HOOKS", "compare_steps", "time_step", "grad_scaler_check",
           "loader_throughput", "compare_loaders", "accumulation_check", "powersgd_bytes",
           "comm_hook_sweep", "overlap_check", "VGG16_VARIANTS", "PEAK_TFLOPS", "peak_tflops",
           "cpu_bf16_unit",
           "vgg16_throughput", "print_vgg16_throughput", "profile_top_ops", "timing_verdict",
           "result_row", "results_table"]

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
    whole(steps, "steps")
    whole(warmup, "warmup", low=0)
    whole(repeats, "repeats")
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
            rows[name]["first_step_s"] = time_steps(model_i, xi, y, 1, 0, device)
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
            seconds = time_steps(model_i, xi, y, steps, warmup, device)
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
    whole(workers, "workers", low=0)
    whole(batch_size, "batch_size")
    whole(repeats, "repeats")
    if batches is not None:
        whole(batches, "batches")
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


def compare_loaders(dataset, settings=((0, False), (2, False), (2, True)), *, repeats: int = 2,
                 **kwargs) -> list[dict]:
    """:func:`loader_throughput` for each ``(workers, pin_memory)`` in ``settings``, side by side.

    ``repeats`` rounds, the settings' order reversed every other round, so a machine that gets
    busier slows all of them alike; each row holds the median epoch (``seconds_all``: every
    round's). Other keyword arguments go to :func:`loader_throughput`.

    Example::

        >>> rows = compare_loaders(dataset, [(0, False), (2, False)], batch_size=32)
        >>> rows[1]["samples_per_s"] / rows[0]["samples_per_s"]
        1.62
    """
    settings = list(settings) if isinstance(settings, (list, tuple)) else []
    if not settings or any(not isinstance(s, (list, tuple)) or len(s) != 2 for s in settings):
        raise ValueError(f"settings must be (workers, pin_memory) pairs, e.g. [(0, False), "
                         f"(2, True)], got {settings!r}")
    whole(repeats, "repeats")
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
    whole(micro_batches, "micro_batches")
    if len(x) % micro_batches:
        raise ValueError(f"a batch of {len(x)} does not split into {micro_batches} equal "
                         f"micro-batches (unequal ones would weigh samples unequally): use a "
                         f"divisor of {len(x)}, e.g. {divisors(len(x), 5)[1:]}")
    one_batch = copy.deepcopy(model).to(x.device)
    accumulated = copy.deepcopy(model).to(x.device)
    with counting_saved_bytes() as big:
        loss = nn.functional.cross_entropy(one_batch(x), y)
    loss.backward()
    micro = 0
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        with counting_saved_bytes() as counter:
            loss = nn.functional.cross_entropy(accumulated(xs), ys) / micro_batches
        loss.backward()  # adds into .grad: that is the accumulation
        micro = max(micro, counter["bytes"])
    g_big, g_acc = _grads(one_batch), _grads(accumulated)
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
    whole(rank, "rank")
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
    whole(steps, "steps")
    whole(batch, "batch")
    whole(powersgd_rank, "powersgd_rank")
    whole(powersgd_start, "powersgd_start", low=2)
    if "powersgd" in hooks and steps <= powersgd_start:
        raise ValueError(f"PowerSGD compresses only after powersgd_start={powersgd_start} plain "
                         f"steps: use steps > {powersgd_start}, or a smaller powersgd_start")
    device = collective_device()
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
        with counting_allreduces(counter):
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
                     "wire_bytes_per_step": bus_bandwidth(payload, world),
                     "allreduces_per_step": counter["calls"] - before["calls"],
                     "val_loss": nn.functional.cross_entropy(logits, y_val).item(),
                     "val_acc": (logits.argmax(1) == y_val).float().mean().item(),
                     "train_s": elapsed.item(), "steps": steps, "ranks": world,
                     "params_bytes": sum(p.numel() * p.element_size()
                                         for p in model.module.parameters())})
    return rows


_OVERLAP_KEYS = ("bucket_cap_mb", "allreduces", "step_s", "compute_s", "serial_s",
                 "hidden_fraction", "ranks")
# (expected band of the hidden share, what it rests on, likely cause below, likely cause above)
_OVERLAP_BANDS = {
    "nccl": ((0.5, 1.0), "NCCL runs on its own CUDA stream and the links move data beside the "
             "compute units: most of it hides",
             "each bucket's all-reduce outlasts the backward left to hide it: a slow link (PCIe "
             "without peer-to-peer, Ethernet between nodes), or another job on the GPUs; a "
             "profiler trace shows whether the all-reduce kernels sit beside backward's",
             "timing noise: above 100 % the overlapped step beat compute alone"),
    "spare": ((0.2, 1.0), "gloo's threads have cores of their own: some of it hides",
              "other programs took the spare cores gloo's threads needed, or the steps are too "
              "few to time (raise OVERLAP_STEPS)",
              "timing noise: above 100 % the overlapped step beat compute alone"),
    "shared": ((-0.25, 0.5), "the same cores compute and run gloo: little hides",
               "timing noise: below 0 the overlapped step was slower than the serial one, "
               "which only a busy machine explains",
               "a quieter machine than usual: the cores had idle moments (a rank waiting for "
               "a message) that gloo's threads used"),
}


def overlap_check(rows: list[dict], *, backend: str, cores: int | None = None) -> dict:
    """Verdict on the share of communication that DDP's overlap hid, for this hardware.

    ``rows`` are ``labkit.ddp.bucket_sweep(..., overlap=True)``'s. Measured: the mean
    ``hidden_fraction`` over the caps that make more than one bucket. The one-bucket rows are
    the control: that bucket starts when backward has ended, so nothing can hide and what they
    read is this run's noise. Expected: with ``backend="nccl"`` (GPUs) 50 to 100 %; with
    ``"gloo"`` 20 to 100 % when each rank has a spare core (``cores >= 2 * ranks``, default
    ``os.cpu_count()``), and little, -25 to 50 %, without (2 ranks on 2 cores). A timing
    claim: the verdict is printed, not asserted. Returns :func:`timing_verdict`'s dict plus
    ``control`` (None without a one-bucket row).

    Example::

        >>> rows = labkit.launch(ddp.bucket_sweep, [0.25, 4, 25], overlap=True,
        ...                      nproc=2).values[0]
        >>> print(overlap_check(rows, backend="gloo")["text"])
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' (GPUs) or 'gloo' (CPUs), got {backend!r}")
    advice = "pass the rows of labkit.ddp.bucket_sweep(caps_mb, ..., overlap=True)"
    if not rows:
        raise ValueError(f"no rows: {advice}")
    missing = sorted({k for r in rows for k in _OVERLAP_KEYS if k not in r})
    if missing:
        raise ValueError(f"rows lack {missing}: {advice}")
    cores = cores or os.cpu_count() or 1
    kind = backend if backend == "nccl" else ("spare" if cores >= 2 * rows[0]["ranks"]
                                               else "shared")
    band, why, below, above = _OVERLAP_BANDS[kind]
    where = f"{backend}, {rows[0]['ranks']} ranks" + (f", {cores} cores" if kind != "nccl" else "")
    claim = f"communication hidden by DDP's overlap ({where})"
    shares = [r["hidden_fraction"] for r in rows
              if r["allreduces"] > 1 and r["hidden_fraction"] is not None]
    controls = [r["hidden_fraction"] for r in rows
                if r["allreduces"] == 1 and r["hidden_fraction"] is not None]
    control = statistics.fmean(controls) if controls else None
    if not shares:
        text = (f"{claim}: not measurable: no cap made more than one bucket with communication "
                f"above the noise; use smaller caps or a larger model")
        return {"claim": claim, "expected": band, "measured": None, "verdict": "not measurable",
                "ok": False, "cause": "nothing to overlap", "text": text, "control": control}
    noisy = control is not None and abs(control) > 0.25
    noise = (f"the one-bucket control, which can hide nothing, reads {control:.0%}: this run's "
             f"noise is about that large") if noisy else None
    verdict = timing_verdict(claim, statistics.fmean(shares), band, below=noise or below,
                             above=noise or above, fmt="{:.0%}")
    first, said, cause = verdict["text"].partition("\n  likely cause: ")
    lines = [first, hang("  the band: ", why), *([said.lstrip("\n") + cause] if said else [])]
    if control is not None and not (noisy and verdict["cause"] == noise):  # else said above
        lines.append(hang("  control: ", f"one bucket hides {control:.0%} (nothing can hide "
                                         f"there: this run's noise"
                                         f"{' is as large as the effect' if noisy else ''})"))
    return {**verdict, "text": "\n".join(lines), "control": control}


# ---- VGG16 training throughput and model FLOP utilisation (MFU) ----------------------------

VGG16_VARIANTS = ("fp32", "bf16", "bf16+channels_last", "bf16+channels_last+compile")

# Dense peak TFLOP/s per math precision, from NVIDIA's data sheets (the sparsity figures halved).
# Matched in order against torch.cuda.get_device_name(): the first pattern found wins, so the
# NVL and PCIe parts come before the SXM parts whose names they contain.
PEAK_TFLOPS = (
    (r"H[12]00 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H[12]00", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),     # SXM
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
)


def cpu_bf16_unit(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU's bf16 hardware as Linux reports it: "AMX" (amx_bf16), "AVX-512 BF16"
    (avx512_bf16), or None when the flags name neither or cannot be read (another OS).

    It decides whether a bf16 step can beat fp32 on this CPU: without such a unit oneDNN
    converts every operand in software.

    Example::

        >>> cpu_bf16_unit()          # on a Sapphire Rapids Xeon
        'AMX'
    """
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return None
    if "amx_bf16" in flags:
        return "AMX"
    return "AVX-512 BF16" if "avx512_bf16" in flags else None


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The GPU's dense peak TFLOP/s at ``precision`` (bf16, tf32, fp32); None when unknown.

    Example::

        >>> peak_tflops("NVIDIA H200", "bf16"), peak_tflops("cpu", "fp32")
        (989.4, None)
    """
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks.get(precision)
    return None


def _vgg16_defaults(device_type: str) -> dict:
    """Full size on a GPU; on a CPU a VGG16 1/8 as wide at 64 px, so a run takes ~20 s."""
    if device_type == "cuda":
        return {"image_size": 224, "batch_size": 128, "width": 1.0, "steps": 20, "warmup": 5,
                "repeats": 3}
    return {"image_size": 64, "batch_size": 8, "width": 1 / 8, "steps": 3, "warmup": 1,
            "repeats": 1}


def _time_vgg16_variant(variant: str, device, cfg: dict) -> float:
    """Median seconds of one training step (forward, backward, SGD) in ``variant``."""
    import torch
    import torch.nn.functional as F

    from .models import vgg16

    torch.manual_seed(0)
    model = vgg16(cfg["num_classes"], width=cfg["width"], image_size=cfg["image_size"]).to(device)
    x = torch.randn(cfg["batch_size"], 3, cfg["image_size"], cfg["image_size"], device=device)
    y = torch.randint(0, cfg["num_classes"], (cfg["batch_size"],), device=device)
    if "channels_last" in variant:  # NHWC: the layout tensor-core convolutions read directly
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    forward = torch.compile(model) if "compile" in variant else model
    bf16 = "bf16" in variant

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()

    def sync():
        if device.type == "cuda":  # kernels run asynchronously: wait before reading the clock
            torch.cuda.synchronize(device)

    for _ in range(cfg["warmup"]):  # cuDNN autotuning, allocator, compilation
        step()
    sync()
    times = []
    for _ in range(cfg["repeats"]):
        start = time.perf_counter()
        for _ in range(cfg["steps"]):
            step()
        sync()
        times.append((time.perf_counter() - start) / cfg["steps"])
    return statistics.median(times)


def _skip_reason(variant: str, device) -> str | None:
    import torch

    if "compile" in variant and device.type != "cuda":
        return "torch.compile is measured on GPUs only (on a CPU it compiles for minutes)"
    if "bf16" in variant and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    return None


def vgg16_throughput(variants=VGG16_VARIANTS, *, device=None, image_size: int | None = None,
                     batch_size: int | None = None, width: float | None = None,
                     num_classes: int = 1000, steps: int | None = None,
                     warmup: int | None = None, repeats: int | None = None) -> list[dict]:
    """Images/s, TFLOP/s and MFU of a VGG16 training step in each of ``variants``.

    Variants: ``fp32`` (on GPUs PyTorch's default runs convolutions in TF32), ``bf16``
    (autocast), ``bf16+channels_last`` and ``bf16+channels_last+compile``. Defaults: the first
    GPU at 224 px, batch 128, full width; else the CPU at 64 px, batch 8, width 1/8. A row that
    cannot run says why in ``skipped``. Each variant runs ``warmup`` untimed steps, then
    ``repeats`` timings of ``steps`` steps (the median counts). MFU is achieved FLOP/s
    (3 x forward FLOPs per image) over the GPU's dense peak at that precision; None when the
    peak is unknown (any CPU).

    Example::

        >>> rows = vgg16_throughput(["fp32", "bf16"])
        >>> rows[0]["variant"], rows[0]["images_per_s"] > 0
        ('fp32', True)
    """
    from .models import vgg16_flops

    unknown = [v for v in variants if v not in VGG16_VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown VGG16 variant {unknown[0] if unknown else None!r}: choose "
                         f"from {', '.join(VGG16_VARIANTS)}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = _vgg16_defaults(device.type)
    given = {"image_size": image_size, "batch_size": batch_size, "width": width, "steps": steps,
             "warmup": warmup, "repeats": repeats}
    cfg.update({k: v for k, v in given.items() if v is not None}, num_classes=num_classes)
    for key in ("batch_size", "steps", "repeats"):
        cfg[key] = whole(cfg[key], key)
    cfg["warmup"] = whole(cfg["warmup"], "warmup", low=0)
    flops_per_image = 3 * vgg16_flops(cfg["image_size"], cfg["width"], num_classes)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for variant in variants:
        precision = "bf16" if "bf16" in variant else "fp32"
        if precision == "fp32" and device.type == "cuda" and torch.backends.cudnn.allow_tf32:
            precision = "tf32"  # the convolutions, nearly all the FLOPs, run on tensor cores
        row = {"variant": variant, "device": str(device), "device_name": name,
               "image_size": cfg["image_size"], "width": cfg["width"],
               "batch_size": cfg["batch_size"], "precision": precision,
               "train_flops_per_image": flops_per_image,
               "peak_tflops": peak_tflops(name, precision),
               "step_s": None, "images_per_s": None, "tflops": None, "mfu": None,
               "skipped": _skip_reason(variant, device)}
        rows.append(row)
        if row["skipped"]:
            continue
        try:
            seconds = _time_vgg16_variant(variant, device, cfg)
        except Exception as exc:
            if "compile" not in variant:
                raise
            first = (str(exc).strip().splitlines() or [""])[0][:160]
            row["skipped"] = f"torch.compile failed: {type(exc).__name__}: {first}"
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["step_s"] = seconds
        row["images_per_s"] = cfg["batch_size"] / seconds
        row["tflops"] = row["images_per_s"] * flops_per_image / 1e12
        if row["peak_tflops"]:
            row["mfu"] = row["tflops"] / row["peak_tflops"]
    return rows


# ---- profiler and the results table ----------------------------------------------------------


def print_vgg16_throughput(rows: list[dict]) -> None:
    """What ``python -m labkit bench vgg16`` prints for :func:`vgg16_throughput`'s rows."""
    r = rows[0]
    print(wrap(f"VGG16 training step (forward + backward + SGD) on {r['device']} "
               f"({r['device_name']}): {r['image_size']} px, width {r['width']:g}, batch "
               f"{r['batch_size']}"))
    print(f"  {r['train_flops_per_image'] / 3e9:.3g} GFLOP forward per image, 3x that per "
          f"training step")
    print(f"  {'variant':<28}  {'images/s':>9}  {'TFLOP/s':>8}  {'MFU':>6}  peak used")
    for r in rows:
        if r["skipped"]:
            print(hang(f"  {r['variant']:<28}  skipped: ", r["skipped"]))
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        peak = (f"{r['precision']} {r['peak_tflops']:g} TFLOP/s" if r["peak_tflops"]
                else f"{r['precision']}: no peak known for {r['device_name']}")
        print(f"  {r['variant']:<28}  {r['images_per_s']:>9.1f}  {r['tflops']:>8.3g}  "
              f"{mfu:>6}  {peak}")


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
    whole(n, "n")
    whole(steps, "steps")
    whole(warmup, "warmup", low=0)
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


def timing_verdict(claim: str, measured: float, expected: tuple[float, float], *,
                   below: str, above: str, fmt: str = "{:.2f}") -> dict:
    """A timing claim judged without stopping the lesson: band, measured value, likely cause.

    A time taken on a shared machine moves with whatever else runs there, so the notebooks
    print this verdict where an exact claim would assert. ``expected`` is the ``(low, high)``
    band the claim predicts; ``below`` and ``above`` name the likely cause of a value outside
    it. In the smoke profile the verdict is "not judged at this size" (``ok`` False), with the
    figure measured. Returns ``{"claim", "expected", "measured", "verdict", "ok", "cause",
    "text"}``.

    Example::

        >>> print(timing_verdict("recomputation cost (x the plain step)", 1.4, (1.1, 2.0),
        ...                      below="noise", above="Python overhead")["text"])
        recomputation cost (x the plain step): expected 1.10 to 2.00, measured 1.40: as expected
    """
    if not isinstance(measured, (int, float)) or isinstance(measured, bool) or measured != measured:
        raise ValueError(f"measured must be a number, got {measured!r}: time the claim first")
    low, high = expected
    if not low <= high:
        raise ValueError(f"expected must be a (low, high) band with low <= high, got {expected!r}")
    from .check import judged

    if not judged():  # the smoke profile: sizes far too small for a time to mean anything
        text = wrap(f"{claim}: measured {fmt.format(measured)}; not judged at this size (the "
                    f"cpu and gpu profiles expect {fmt.format(low)} to {fmt.format(high)})")
        return {"claim": claim, "expected": (low, high), "measured": measured,
                "verdict": "not judged at this size", "ok": False, "cause": None, "text": text}
    if measured < low:
        verdict, cause = "below the expected band", below
    elif measured > high:
        verdict, cause = "above the expected band", above
    else:
        verdict, cause = "as expected", None
    text = wrap(f"{claim}: expected {fmt.format(low)} to {fmt.format(high)}, measured "
                f"{fmt.format(measured)}: {verdict}")
    if cause:
        text += "\n" + hang("  likely cause: ", cause)
    return {"claim": claim, "expected": (low, high), "measured": measured, "verdict": verdict,
            "ok": verdict == "as expected", "cause": cause, "text": text}


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
    # The same table labkit.show_table shows (numbers right-aligned, 4 significant figures).
    return table_text(rows, list(_ROW_KEYS), formats={"speedup": "{:.2f}x"})

"""Timing: how fast do the workers talk? All-reduce sweeps and the numbers derived from them.

The worker functions (:func:`check_allreduce`, :func:`allreduce_sweep`) run inside each rank
with ``torch.distributed`` already initialised, which is what ``labkit.launch`` does::

    rows = labkit.launch(allreduce_sweep, message_sizes(1 << 10, 64 << 20), nproc=2).values[0]

The helpers (:func:`message_sizes`, :func:`bus_bandwidth`, :func:`fit_alpha_beta`) are plain
Python. Results are plain dicts so they can be printed, saved and handed to
``labkit.plots.bandwidth_plot``; nothing here plots.
"""

from __future__ import annotations

import re
import statistics
import sys
import time

__all__ = ["message_sizes", "bus_bandwidth", "fit_alpha_beta", "check_allreduce",
           "allreduce_sweep", "launch_overhead", "SCALING_MODES", "machine_workers",
           "worker_counts", "scaling_sweep", "link_model", "ring_seconds", "predict_scaling",
           "count_allreduces", "wide_mlp", "bucket_sweep", "ddp_efficiency", "VGG16_VARIANTS", "PEAK_TFLOPS", "peak_tflops",
           "vgg16_flops", "vgg16_throughput", "main"]

_FLOAT32 = 4  # bytes per element of the tensors the sweep reduces


def message_sizes(lo: int = 1 << 10, hi: int = 64 << 20) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` bytes, both included (``lo`` rounded up to one).

    Example::

        >>> message_sizes(1024, 8192)
        [1024, 2048, 4096, 8192]
    """
    if lo < 1 or hi < lo:
        raise ValueError(f"need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    size = 1 << (int(lo) - 1).bit_length()
    sizes = []
    while size <= hi:
        sizes.append(size)
        size *= 2
    return sizes


def bus_bandwidth(algbw: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: ``algbw * 2 (n - 1) / n``.

    A ring all-reduce moves ``2 (n - 1) / n`` times the message over every link, so busbw is
    comparable with a link's peak speed whatever the number of ranks. With one rank nothing
    crosses a link and busbw is 0, exactly as nccl-tests prints it.

    Example::

        >>> bus_bandwidth(10.0, 4)    # 4 ranks: each link carries 1.5x the message
        15.0
    """
    if n < 1:
        raise ValueError(f"need at least one rank, got n={n}")
    return algbw * 2 * (n - 1) / n


def _weighted_line(xs, ys, ws):
    """Weighted least squares for y = a + b x (closed form)."""
    sw = sum(ws)
    mx = sum(w * x for x, w in zip(xs, ws, strict=True)) / sw
    my = sum(w * y for y, w in zip(ys, ws, strict=True)) / sw
    sxx = sum(w * (x - mx) ** 2 for x, w in zip(xs, ws, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for x, y, w in zip(xs, ys, ws, strict=True))
    b = sxy / sxx
    return my - b * mx, b


def fit_alpha_beta(rows: list[dict]) -> dict:
    """Fit the latency-bandwidth model ``seconds = alpha + bytes * beta`` to a sweep's rows.

    ``alpha`` (s) is the fixed cost of one all-reduce, ``1 / beta`` the bandwidth (GB/s, the
    algbw that large messages approach). The fit weighs relative errors, so the microsecond
    small messages count as much as the large ones, and keeps alpha and beta non-negative (a
    negative latency is noise, not physics; a zero beta gives an infinite bandwidth).

    Example::

        >>> rows = [{"bytes": b, "seconds": 1e-5 + b / 1e9} for b in message_sizes(1024, 1 << 20)]
        >>> fit = fit_alpha_beta(rows)
        >>> round(fit["alpha_s"] * 1e6, 3), round(fit["bandwidth_GBps"], 3)
        (10.0, 1.0)
    """
    xs = [float(r["bytes"]) for r in rows]
    ys = [float(r["seconds"]) for r in rows]
    if len(set(xs)) < 2:
        raise ValueError("fitting alpha and beta needs rows of at least two different sizes")
    if min(ys) <= 0:
        raise ValueError("every row needs a positive 'seconds'")
    ws = [1 / y**2 for y in ys]
    alpha, beta = _weighted_line(xs, ys, ws)
    if alpha < 0:  # best fit through the origin
        alpha, beta = 0.0, sum(w * x * y for x, y, w in zip(xs, ys, ws, strict=True)) / sum(
            w * x * x for x, w in zip(xs, ws, strict=True))
    elif beta < 0:  # time does not grow with size: pure latency
        alpha, beta = sum(w * y for y, w in zip(ys, ws, strict=True)) / sum(ws), 0.0
    bandwidth = 1 / beta / 1e9 if beta > 0 else float("inf")
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_GBps": bandwidth}


def _device(group=None):
    """The tensor device collectives in ``group`` need: the rank's GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run this inside a worker, "
                           "e.g. labkit.launch(check_allreduce, nproc=2)")
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_allreduce() -> float:
    """Worker function: every rank adds ``rank + 1``; all must get ``n (n + 1) / 2``.

    Raises ``AssertionError`` on the rank that got a wrong sum (the launcher names it).

    Example::

        >>> labkit.launch(check_allreduce, nproc=2).values
        [3.0, 3.0]
    """
    import torch
    import torch.distributed as dist

    device = _device()
    rank, n = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    value, expected = total.item(), n * (n + 1) / 2
    if value != expected:
        raise AssertionError(f"rank {rank}: all-reduce gave {value}, expected {expected} "
                             f"(1 + 2 + ... + {n})")
    return value


def allreduce_sweep(sizes: list[int], iters: int = 20, warmup: int = 5,
                    algorithms=("builtin",)) -> list[dict]:
    """Worker function: time ``all_reduce`` of float32 messages of each size in ``sizes`` bytes.

    Each size gets ``warmup`` untimed calls (connection set-up, allocator, NCCL kernels), then
    ``iters`` timed ones, each started together behind a barrier and ended by a device
    synchronise (CUDA calls return before the GPU is done). A size's time is the median over
    the calls, then the maximum over ranks: a collective is as slow as its slowest rank.
    ``algorithms`` names implementations from ``labkit.parallel.collectives.ALGORITHMS``
    ("builtin" is ``dist.all_reduce``, "ring", "doubling"); their timed calls alternate, so a
    disturbance hits them alike. Every rank returns the same rows: ``algorithm, bytes,
    seconds, algbw_GBps, busbw_GBps, ranks, backend``.

    Example::

        >>> sizes = message_sizes(1 << 10, 1 << 20)
        >>> rows = labkit.launch(allreduce_sweep, sizes, nproc=2).values[0]
        >>> rows[0]["bytes"], rows[0]["busbw_GBps"] > 0
        (1024, True)
        >>> rows = labkit.launch(allreduce_sweep, [16 << 20], algorithms=("builtin", "ring"),
        ...                      nproc=4).values[0]          # the ring against gloo's own
    """
    import torch
    import torch.distributed as dist

    from .parallel.collectives import ALGORITHMS

    bad = [s for s in sizes if not isinstance(s, int) or s < _FLOAT32 or s % _FLOAT32]
    if bad or not sizes:
        raise ValueError(f"sizes must be a non-empty list of byte counts that are positive "
                         f"multiples of {_FLOAT32} (float32), got {bad or sizes}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise ValueError(f"unknown all-reduce algorithm(s) {unknown or list(algorithms)}: use "
                         f"some of {', '.join(ALGORITHMS)}")
    device = _device()
    on_gpu = device.type == "cuda"
    n, backend = dist.get_world_size(), dist.get_backend()

    def sync():
        if on_gpu:
            torch.cuda.synchronize(device)

    def barrier():
        if on_gpu:  # naming the GPU spares NCCL its "devices ... are unknown" guess
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()

    rows = []
    for size in sizes:
        # Zeros stay zeros under a sum, so repeated reductions never overflow to inf.
        x = torch.zeros(size // _FLOAT32, dtype=torch.float32, device=device)
        for name in algorithms:
            for _ in range(warmup):
                ALGORITHMS[name](x)
        sync()
        times = {name: [] for name in algorithms}
        for _ in range(iters):
            for name in algorithms:
                barrier()
                sync()
                start = time.perf_counter()
                ALGORITHMS[name](x)
                sync()
                times[name].append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times[name]) for name in algorithms],
                               dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        for name, seconds in zip(algorithms, slowest.tolist(), strict=True):
            algbw = size / seconds / 1e9
            rows.append({"algorithm": name, "bytes": size, "seconds": seconds,
                         "algbw_GBps": algbw, "busbw_GBps": bus_bandwidth(algbw, n), "ranks": n,
                         "backend": backend})
    return rows


# ---- data-parallel scaling: throughput against worker count ------------------------------------

SCALING_MODES = ("weak", "strong", "independent")
_ROW_KEYS = ("mode", "workers", "per_worker_batch", "global_batch", "step_s", "samples_per_s",
             "speedup", "efficiency")


def machine_workers(backend: str = "auto") -> tuple[int, str]:
    """How many data-parallel workers this machine runs side by side: its GPUs, else its cores.

    ``backend="gloo"`` counts CPU cores even where there are GPUs (gloo workers compute on
    the CPU).
    """
    import os

    from .profile import visible_gpu_count

    gpus = visible_gpu_count() if backend != "gloo" else 0
    if gpus:
        return gpus, "GPU" if gpus == 1 else "GPUs"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1, "CPU core" if cores == 1 else "CPU cores"


def worker_counts(limit: int | None = None) -> list[int]:
    """1, 2, 4, ... up to ``limit`` (default: what the machine has), and ``limit`` itself.

    Example::

        >>> worker_counts(6)
        [1, 2, 4, 6]
    """
    limit = machine_workers()[0] if limit is None else int(limit)
    if limit < 1:
        raise ValueError(f"need a limit of at least one worker, got {limit}")
    counts = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    return counts if counts[-1] == limit else [*counts, limit]


def _capped_workers(workers, oversubscribe: bool, backend: str) -> list[int]:
    """Validated, sorted worker counts; counts beyond the machine are dropped with a message."""
    if workers is None:
        return worker_counts(machine_workers(backend)[0])
    counts = sorted(set(workers))
    if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"workers must be positive integers, e.g. [1, 2, 4], got {workers!r}")
    limit, what = machine_workers(backend)
    over = [n for n in counts if n > limit]
    if over and not oversubscribe:
        counts = [n for n in counts if n <= limit]
        print(f"[labkit] skipping {', '.join(map(str, over))} workers: this machine has {limit} "
              f"{what}, and workers sharing one would measure the sharing, not the scaling. "
              f"Pass oversubscribe=True to run them anyway.")
        if not counts:
            raise ValueError(f"no worker count left to measure: use at most {limit}")
    return counts


def scaling_sweep(workers=None, *, modes=("weak", "strong"), per_worker_batch: int = 64,
                  global_batch: int | None = None, model=None, input_shape=(3, 32, 32),
                  num_classes: int = 10, steps: int = 20, warmup: int = 3, repeats: int = 3,
                  threads: int | None = None, oversubscribe: bool = False,
                  timeout: float | None = None, backend: str = "auto") -> list[dict]:
    """Measure DDP training throughput for each worker count in ``workers``, in one launch.

    ``"weak"`` scaling keeps ``per_worker_batch`` (the global batch grows with N); ``"strong"``
    keeps ``global_batch`` (default ``per_worker_batch * max(workers)``) and splits it;
    ``"independent"`` runs N workers with no gradient exchange at all, which measures what
    the hardware allows (shared memory bandwidth, other tenants) apart from communication.
    All counts run inside one launch of ``max(workers)`` ranks: a count of n uses ranks
    0..n-1 (a process subgroup) while the others wait, and the repeats alternate the order of
    the counts, so every figure is measured side by side under the same load. Inputs are
    random tensors already in memory: this times compute and communication, not data loading.

    Returns plain rows (``mode, workers, per_worker_batch, global_batch, step_s,
    samples_per_s, speedup, efficiency, grad_bytes, step_s_all``), ``step_s`` the median over
    the repeats; ``speedup`` is against the same mode's one-worker row.

    Example::

        >>> rows = scaling_sweep([1, 2], modes=("weak",), steps=10)
        >>> round(rows[1]["efficiency"], 2)
        0.93
    """
    from .launcher import launch

    counts = _capped_workers(workers, oversubscribe, backend)
    unknown = [m for m in modes if m not in SCALING_MODES]
    if unknown or not modes:
        raise ValueError(f"modes must name some of {', '.join(SCALING_MODES)}, got {modes!r}")
    if steps < 1 or warmup < 0 or repeats < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0, repeats >= 1; got {steps}, {warmup}, "
                         f"{repeats}")
    from .ddp import per_worker_batch as split

    if global_batch is None:
        global_batch = per_worker_batch * counts[-1]
    batches = {}
    for mode in modes:
        for n in counts:
            batches[mode, n] = (split(global_batch, world_size=n) if mode == "strong"
                                else per_worker_batch)
    if threads is None and machine_workers(backend)[1].startswith("CPU"):
        threads = max(1, machine_workers("gloo")[0] // counts[-1])
    spec = {"counts": counts, "modes": list(modes), "batches": batches, "model": model,
            "input_shape": tuple(input_shape), "num_classes": num_classes, "steps": steps,
            "warmup": warmup, "repeats": repeats, "threads": threads}
    times, grad_bytes = launch(_scaling_worker, spec, nproc=counts[-1], backend=backend,
                               timeout=timeout, show_ranks=[0]).values[0]
    return _scaling_rows(times, batches, grad_bytes)


def _scaling_rows(times: dict, batches: dict, grad_bytes: int) -> list[dict]:
    """Rows from the raw step times; speedup and efficiency against each mode's 1-worker row."""
    rows = []
    for (mode, n), step_times in times.items():
        b = batches[mode, n]
        step = statistics.median(step_times)
        rows.append({"mode": mode, "workers": n, "per_worker_batch": b, "global_batch": b * n,
                     "step_s": step, "samples_per_s": b * n / step, "grad_bytes": grad_bytes,
                     "step_s_all": list(step_times)})
    for row in rows:
        one = next((r for r in rows if r["mode"] == row["mode"] and r["workers"] == 1), None)
        row["speedup"] = row["samples_per_s"] / one["samples_per_s"] if one else float("nan")
        row["efficiency"] = row["speedup"] / row["workers"]
    return sorted(rows, key=lambda r: (SCALING_MODES.index(r["mode"]), r["workers"]))


def _scaling_worker(spec: dict):
    """Worker side of :func:`scaling_sweep`: every rank runs this; rank 0's return is the result."""
    import torch
    import torch.distributed as dist

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = _device()
    rank = dist.get_rank()
    # Waiting ranks park on a gloo group: a NCCL barrier would keep their GPUs and CPUs busy.
    coord = dist.new_group(backend="gloo")
    # new_group is collective: every rank creates every subgroup, in the same order.
    groups = {n: dist.new_group(list(range(n))) for n in spec["counts"] if n > 1}
    from .models import convnet

    make = spec["model"] or convnet
    biggest = max(spec["batches"].values())
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(biggest, *spec["input_shape"], generator=gen).to(device)
    y = torch.randint(0, spec["num_classes"], (biggest,), generator=gen).to(device)
    grad_bytes = sum(p.numel() * p.element_size() for p in make().parameters())
    # The 1-worker run is the same for weak and independent scaling: measure it once.
    phases = [(m, n) for m in spec["modes"] for n in spec["counts"]
              if not (m == "independent" and n == 1 and "weak" in spec["modes"])]
    times: dict = {(m, n): [] for m in spec["modes"] for n in spec["counts"]}
    for repeat in range(spec["repeats"]):
        order = phases if repeat % 2 == 0 else phases[::-1]
        for mode, n in order:
            elapsed = 0.0
            if rank < n:
                group = groups.get(n) if mode != "independent" else None
                b = spec["batches"][mode, n]
                elapsed = _time_steps(make, group, x[:b], y[:b], spec["steps"], spec["warmup"],
                                      device)
            slowest = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=coord)
            times[mode, n].append(slowest.item() / spec["steps"])
    if "independent" in spec["modes"] and "weak" in spec["modes"]:
        times["independent", 1] = times["weak", 1]
    return times, grad_bytes


def _time_steps(make, group, x, y, steps: int, warmup: int, device) -> float:
    """Seconds for ``steps`` SGD steps of a fresh model, DDP over ``group`` when there is one."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    model = make().to(device)
    if group is not None:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if group is not None:  # start and stop together: a collective is as slow as its slowest
            dist.barrier(group=group, **({"device_ids": [device.index]}
                                         if device.type == "cuda" else {}))

    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - start


def link_model(allreduce_rows: list[dict]) -> dict:
    """One link's latency and bandwidth, from an :func:`allreduce_sweep` on n >= 2 ranks.

    A ring all-reduce of S bytes takes ``2 (n - 1)`` steps of one ``S / n`` chunk each, so the
    fitted ``seconds = alpha + S * beta`` of the whole all-reduce is ``2 (n - 1)`` link
    latencies plus ``2 (n - 1) / n`` of the message over one link. Returns ``alpha_s`` (one
    message's latency) and ``bandwidth_GBps`` (one link's), what :func:`ring_seconds` takes.

    Example::

        >>> rows = [{"bytes": b, "seconds": 6e-5 + 1.5 * b / 1e9, "ranks": 4}
        ...         for b in message_sizes(1024, 1 << 20)]
        >>> {k: round(v, 9) for k, v in link_model(rows).items()}
        {'alpha_s': 1e-05, 'bandwidth_GBps': 1.0}
    """
    fit = fit_alpha_beta(allreduce_rows)
    ranks = allreduce_rows[0]["ranks"]
    if ranks < 2:
        raise ValueError("the all-reduce rows come from one rank, where nothing crosses a link: "
                         "measure them with nproc >= 2")
    beta = fit["beta_s_per_byte"] * ranks / (2 * (ranks - 1))
    return {"alpha_s": fit["alpha_s"] / (2 * (ranks - 1)),
            "bandwidth_GBps": 1 / beta / 1e9 if beta > 0 else float("inf")}


def ring_seconds(nbytes: float, n: int, *, alpha_s: float, bandwidth_GBps: float) -> float:
    """The alpha-beta model of a ring all-reduce: ``2 (n - 1) (alpha + S / n / B)``.

    ``2 (n - 1)`` steps, each paying one message's latency ``alpha`` and carrying one chunk of
    ``S / n`` bytes over a link of ``B`` GB/s: ``2 (n - 1) / n * S / B`` of transfer in all.

    Example::

        >>> round(ring_seconds(16 << 20, 4, alpha_s=0.0, bandwidth_GBps=1.0), 4)   # 1.5 S / B
        0.0252
    """
    if n < 1 or nbytes < 0 or alpha_s < 0 or not bandwidth_GBps > 0:
        raise ValueError(f"need n >= 1, nbytes >= 0, alpha_s >= 0 and bandwidth_GBps > 0; got "
                         f"n={n}, nbytes={nbytes}, alpha_s={alpha_s}, "
                         f"bandwidth_GBps={bandwidth_GBps}")
    if n == 1:
        return 0.0
    return 2 * (n - 1) * (alpha_s + nbytes / n / (bandwidth_GBps * 1e9))


def predict_scaling(rows: list[dict], allreduce_rows: list[dict], workers) -> list[dict]:
    """A simple model of the same runs: compute time plus a ring all-reduce of the gradients.

    ``step(N) = compute(N) + 2 (N-1) a + 2 (N-1)/N * S * b`` with ``S`` the gradient bytes and
    ``a``, ``b`` one link's latency and seconds per byte, taken from ``allreduce_rows`` (an
    :func:`allreduce_sweep` on some number of ranks, as notebook 00 measures). ``compute(N)`` is
    the measured 1-worker step time for weak scaling and that time times ``1/N`` for strong
    scaling (the per-worker batch shrinks). DDP overlaps the all-reduce with the backward pass,
    so this is a pessimistic bound; where measurements fall below it, something else (memory
    bandwidth, stragglers, a shared machine) costs more than the wire.

    Example::

        >>> predicted = predict_scaling(rows, allreduce_rows, workers=[1, 2, 4, 8, 16, 32, 64])
    """
    link = link_model(allreduce_rows)
    predicted = []
    for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"] != "independent"):
        one = next((r for r in rows if r["mode"] == mode and r["workers"] == 1), None)
        if one is None:
            raise ValueError(f"predicting '{mode}' scaling needs its 1-worker row")
        for n in workers:
            b = one["per_worker_batch"] if mode == "weak" else one["global_batch"] / n
            compute = one["step_s"] * b / one["per_worker_batch"]
            comm = ring_seconds(one["grad_bytes"], n, **link)
            step = compute + comm
            sps = b * n / step
            predicted.append({"mode": mode, "workers": n, "per_worker_batch": b,
                              "global_batch": b * n, "step_s": step, "samples_per_s": sps,
                              "speedup": sps / one["samples_per_s"],
                              "efficiency": sps / one["samples_per_s"] / n, "predicted": True,
                              "compute_s": compute, "allreduce_s": comm})
    return predicted


# ---- DDP internals: gradient buckets -----------------------------------------------------------


def count_allreduces(ddp_model) -> dict:
    """Count the all-reduces a DDP model launches: returns a dict that updates as it trains.

    Registers a communication hook that does exactly what DDP does by default (all-reduce the
    bucket, divide by the world size) and counts calls and bytes on the way. DDP reduces one
    *bucket* per call, so the count per step is the number of buckets.

    Example::

        >>> counter = count_allreduces(model)          # model = DistributedDataParallel(...)
        >>> loss.backward(); counter
        {'calls': 1, 'bytes': 264872}
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    counter = {"calls": 0, "bytes": 0}

    def hook(state, bucket):
        state["calls"] += 1
        state["bytes"] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(None, bucket)

    ddp_model.register_comm_hook(counter, hook)
    return counter


def wide_mlp(width: int = 512, depth: int = 12, inputs: int = 512, num_classes: int = 10):
    """An MLP with ``depth`` square layers: many parameters per FLOP, so buckets matter.

    Example::

        >>> sum(p.numel() for p in wide_mlp().parameters()) / 1e6     # million parameters
        3.16
    """
    from torch import nn

    layers = [nn.Linear(inputs, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def bucket_sweep(caps_mb, *, model=None, batch: int = 32, steps: int = 10,
                 warmup: int = 2) -> list[dict]:
    """Worker function: DDP step time and all-reduce calls per step for each ``bucket_cap_mb``.

    DDP groups gradients into buckets of about ``bucket_cap_mb`` and all-reduces a bucket as
    soon as backward has filled it, overlapping communication with the rest of backward. Small
    buckets pay the per-call latency many times; one huge bucket waits for the whole backward
    and overlaps nothing. Every rank returns the same rows: ``bucket_cap_mb, allreduces,
    MB_per_step, step_s``.

    Example::

        >>> labkit.launch(bucket_sweep, [1, 25, 1000], nproc=2).values[0]
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    if not caps_mb or any(c <= 0 for c in caps_mb):
        raise ValueError(f"caps_mb must be positive sizes in MB, e.g. [1, 25, 100], got {caps_mb}")
    device = _device()
    make = model or wide_mlp
    probe = make()
    inputs = next(m for m in probe.modules() if isinstance(m, nn.Linear)).in_features
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, inputs, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    return [_bucket_row(make, cap, x, y, steps, warmup, device) for cap in caps_mb]


def _bucket_row(make, cap, x, y, steps: int, warmup: int, device) -> dict:
    """One :func:`bucket_sweep` row: a fresh DDP model with ``bucket_cap_mb=cap``, timed."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    ids = [device.index] if device.type == "cuda" else None
    model = nn.parallel.DistributedDataParallel(make().to(device), device_ids=ids,
                                                bucket_cap_mb=cap)
    counter = count_allreduces(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    # The warm-up also lets DDP rebuild its buckets, which it does after the first step.
    for _ in range(max(warmup, 1)):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    calls, nbytes = counter["calls"], counter["bytes"]
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return {"bucket_cap_mb": cap, "allreduces": (counter["calls"] - calls) / steps,
            "MB_per_step": (counter["bytes"] - nbytes) / steps / 1e6,
            "step_s": elapsed.item() / steps}


# ---- benchmarks run from a shell: python -m labkit bench [launch|allreduce] --------------------

_BARE_SCRIPT = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def _trivial_allreduce() -> float:
    """The launch benchmark's job: the same work as ``_BARE_SCRIPT``, as a function."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def launch_overhead(repeats: int = 5, nproc: int = 2) -> dict:
    """Median wall time of ``labkit.launch`` against bare ``torchrun`` doing the same job.

    Runs alternate (launch, torchrun, launch, ...) after one untimed warm-up of each, so a
    machine that gets busier or quieter affects both sides alike.

    Example::

        >>> r = launch_overhead(repeats=3)
        >>> r["ratio"] < 1.5
        True
    """
    import os
    import subprocess
    import tempfile

    from .launcher import launch

    with tempfile.TemporaryDirectory(prefix="labkit-bench-") as tmp:
        script = os.path.join(tmp, "bare.py")
        with open(script, "w") as f:
            f.write(_BARE_SCRIPT)
        bare = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", f"--log-dir={tmp}/logs", script]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))

        def time_launch():
            start = time.perf_counter()
            assert launch(_trivial_allreduce, nproc=nproc, show_ranks=[]).values == [nproc] * nproc
            return time.perf_counter() - start

        def time_bare():
            start = time.perf_counter()
            subprocess.run(bare, check=True, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            return time.perf_counter() - start

        time_launch(), time_bare()  # warm the page cache for both
        launched, bared = [], []
        for _ in range(repeats):
            launched.append(time_launch())
            bared.append(time_bare())
    median_launch, median_bare = statistics.median(launched), statistics.median(bared)
    return {"nproc": nproc, "repeats": repeats, "launch_s": median_launch,
            "torchrun_s": median_bare, "ratio": median_launch / median_bare,
            "launch_all_s": launched, "torchrun_all_s": bared}


def ddp_efficiency(nproc: int = 2, *, repeats: int = 3, steps: int = 20,
                   per_worker_batch: int = 64) -> list[dict]:
    """``bench ddp``: 1 against ``nproc`` workers, one thread each, same batch per worker.

    Weak scaling of the compute-bound :func:`labkit.models.convnet` with DDP, plus the same
    workers with no gradient exchange ("independent"): the ceiling the hardware allows, so
    the gap between the two is what communication and synchronisation cost.

    Example::

        >>> rows = ddp_efficiency(2)
        >>> [round(r["efficiency"], 2) for r in rows]
        [1.0, 0.95, 1.0, 0.98]
    """
    return scaling_sweep([1, nproc], modes=("weak", "independent"), threads=1,
                         per_worker_batch=per_worker_batch, steps=steps, warmup=3,
                         repeats=repeats, backend="gloo")


def _print_ddp(rows: list[dict]) -> None:
    weak = {r["workers"]: r for r in rows if r["mode"] == "weak"}
    free = {r["workers"]: r for r in rows if r["mode"] == "independent"}
    n = max(weak)
    print(f"DDP weak scaling (convnet, {weak[1]['per_worker_batch']} images per worker, one "
          f"thread each, {weak[1]['grad_bytes'] / 1e3:.0f} kB of gradients per step)")
    print(f"  {'workers':>7}  {'mode':<12}  {'samples/s':>10}  {'step ms':>8}  {'efficiency':>10}")
    for r in rows:
        if r["mode"] == "independent" and r["workers"] == 1:
            continue
        print(f"  {r['workers']:>7}  {r['mode']:<12}  {r['samples_per_s']:>10.1f}  "
              f"{r['step_s'] * 1e3:>8.1f}  {r['efficiency']:>10.3f}")
    print(f"  efficiency {n} workers = {weak[n]['efficiency']:.3f}   (target >= 0.90)")
    print(f"  hardware ceiling (no communication) = {free[n]['efficiency']:.3f};  "
          f"DDP / ceiling = {weak[n]['samples_per_s'] / free[n]['samples_per_s']:.3f}")


def _print_launch(r: dict) -> None:
    print(f"launch overhead ({r['nproc']} workers, trivial all_reduce, {r['repeats']} alternated runs)")
    print(f"  labkit.launch  median {r['launch_s']:.2f} s   runs {_fmt_list(r['launch_all_s'])}")
    print(f"  bare torchrun  median {r['torchrun_s']:.2f} s   runs {_fmt_list(r['torchrun_all_s'])}")
    print(f"  ratio launch / torchrun = {r['ratio']:.3f}   (target <= 1.10)")


def _print_allreduce(rows: list[dict]) -> None:
    n = rows[0]["ranks"]
    names = list(dict.fromkeys(r.get("algorithm", "builtin") for r in rows))
    by = {(r.get("algorithm", "builtin"), r["bytes"]): r for r in rows}
    print(f"all_reduce sweep ({n} ranks, {rows[0]['backend']}): time ms and busbw GB/s")
    print(f"  {'bytes':>10}" + "".join(f"  {name + ' ms':>12} {'busbw':>7}" for name in names)
          + "".join(f"  {name + '/builtin':>16}" for name in names if name != "builtin"))
    for size in dict.fromkeys(r["bytes"] for r in rows):
        cells = "".join(f"  {by[name, size]['seconds'] * 1e3:>12.3f} "
                        f"{by[name, size]['busbw_GBps']:>7.3f}" for name in names)
        if "builtin" in names:  # bandwidth ratio: >= 1 means as fast as gloo's or NCCL's own
            cells += "".join(f"  {by['builtin', size]['seconds'] / by[name, size]['seconds']:>16.2f}"
                             for name in names if name != "builtin")
        print(f"  {size:>10}{cells}")
    for name in names:
        mine = [r for r in rows if r.get("algorithm", "builtin") == name]
        fit = fit_alpha_beta(mine)
        print(f"  fit {name}: alpha = {fit['alpha_s'] * 1e6:.1f} us, "
              f"bandwidth = {fit['bandwidth_GBps']:.2f} GB/s")
    builtin = [r for r in rows if r.get("algorithm", "builtin") == "builtin"]
    if "ring" in names and builtin and n > 1:
        link = link_model(builtin)
        size = max(r["bytes"] for r in rows)
        model = ring_seconds(size, n, **link)
        print(f"  ring model 2(n-1)(alpha + S/n/B) with the builtin's link (alpha "
              f"{link['alpha_s'] * 1e6:.1f} us, B {link['bandwidth_GBps']:.2f} GB/s): "
              f"{model * 1e3:.2f} ms at {size} bytes; the ring measured "
              f"{by['ring', size]['seconds'] * 1e3:.2f} ms")


def _fmt_list(xs) -> str:
    return " ".join(f"{x:.2f}" for x in xs)


# ---- VGG16 training throughput and model FLOP utilisation (MFU) --------------------------------

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


def vgg16_flops(image_size: int = 224, width: float = 1.0, num_classes: int = 1000) -> int:
    """Forward FLOPs of one image through ``labkit.models.vgg16``: 2 x the multiply-adds.

    Counts the 13 convolutions and 3 linear layers (pooling, ReLU and biases are noise). A
    training step costs about 3x this: the backward pass computes two products per layer.

    Example::

        >>> round(vgg16_flops() / 1e9, 1)       # 15.5 GMACs
        31.0
    """
    from .models import _CFG, MIN_IMAGE_SIZE, _scaled

    if not isinstance(image_size, int) or image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be an int >= {MIN_IMAGE_SIZE} (VGG16's five 2x2 "
                         f"poolings), got {image_size!r}")
    if not width > 0:
        raise ValueError(f"width must be > 0, got {width}")
    size, channels, macs = image_size, 3, 0
    for item in _CFG:
        if item == "M":
            size //= 2
            continue
        out = _scaled(item, width)
        macs += size * size * out * channels * 9  # 3x3 kernel, padding 1: same size out
        channels = out
    hidden = _scaled(4096, width)
    macs += channels * 7 * 7 * hidden + hidden * hidden + hidden * num_classes
    return 2 * macs


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
    import torch

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
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive int, got {cfg[key]!r}")
    if not isinstance(cfg["warmup"], int) or cfg["warmup"] < 0:
        raise ValueError(f"warmup must be an int >= 0, got {cfg['warmup']!r}")
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
               "train_flops_per_image": flops_per_image, "peak_tflops": peak_tflops(name, precision),
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


def _print_vgg16(rows: list[dict]) -> None:
    r = rows[0]
    print(f"VGG16 training step (forward + backward + SGD) on {r['device']} ({r['device_name']}): "
          f"{r['image_size']} px, width {r['width']:g}, batch {r['batch_size']}")
    print(f"  {r['train_flops_per_image'] / 3e9:.3g} GFLOP forward per image, 3x that per "
          f"training step")
    print(f"  {'variant':<28}  {'images/s':>9}  {'TFLOP/s':>8}  {'MFU':>6}  peak used")
    for r in rows:
        if r["skipped"]:
            print(f"  {r['variant']:<28}  skipped: {r['skipped']}")
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        peak = (f"{r['precision']} {r['peak_tflops']:g} TFLOP/s" if r["peak_tflops"]
                else f"{r['precision']}: no peak known for {r['device_name']}")
        print(f"  {r['variant']:<28}  {r['images_per_s']:>9.1f}  {r['tflops']:>8.3g}  "
              f"{mfu:>6}  {peak}")


BENCHMARKS = ("launch", "allreduce", "ddp", "vgg16")


def main(which: str = "all", repeats: int = 5, nproc: int | None = None) -> int:
    """``python -m labkit bench [all|launch|allreduce|ddp|vgg16]``: run benchmarks, print their figures.

    ``--repeats`` sets the launch benchmark's runs; ``--nproc`` the ranks of allreduce (4:
    the hand-written ring and recursive doubling beside the built-in) and ddp (2); vgg16
    picks its sizes from the device.
    """
    chosen = BENCHMARKS if which == "all" else (which,)
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        print(f"labkit bench: unknown benchmark {unknown[0]!r}; choose from all, "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    if repeats < 1:
        print(f"labkit bench: --repeats must be >= 1, got {repeats}", file=sys.stderr)
        return 2
    if nproc is not None and nproc < 2:
        print(f"labkit bench: --nproc must be >= 2 (one rank has nothing to measure), got {nproc}",
              file=sys.stderr)
        return 2
    if "launch" in chosen:
        _print_launch(launch_overhead(repeats=repeats))
    if "allreduce" in chosen:
        from .launcher import launch

        ranks = nproc or 4
        algorithms = ("builtin", "ring") + (("doubling",) if ranks & (ranks - 1) == 0 else ())
        sizes = message_sizes(1 << 10, 16 << 20)
        _print_allreduce(launch(allreduce_sweep, sizes, iters=10, algorithms=algorithms,
                                nproc=ranks, show_ranks=[]).values[0])
    if "ddp" in chosen:
        _print_ddp(ddp_efficiency(nproc or 2, repeats=repeats))
    if "vgg16" in chosen:  # in this process: one device, no workers needed
        _print_vgg16(vgg16_throughput())
    return 0

"""Timing: how fast do the workers talk? All-reduce sweeps and the numbers derived from them.

The worker functions (:func:`check_allreduce`, :func:`allreduce_sweep`) run inside each rank
with ``torch.distributed`` already initialised, which is what ``labkit.launch`` does::

    rows = labkit.launch(allreduce_sweep, message_sizes(1 << 10, 64 << 20), nproc=2).values[0]

The helpers (:func:`message_sizes`, :func:`bus_bandwidth`, :func:`fit_alpha_beta`, the
alpha-beta model :func:`link_model` and :func:`ring_seconds`) are plain Python. Results are plain
dicts so they can be printed, saved and handed to ``labkit.plots.bandwidth_plot``; nothing here
plots. The ``print_*`` functions are what ``python -m labkit bench`` (:mod:`labkit.cli`) prints
for the launch overhead and the all-reduce sweep.
"""

from __future__ import annotations

import statistics
import sys
import time

from ._dist import barrier, collective_device, slowest, sync

__all__ = ["message_sizes", "bus_bandwidth", "fit_alpha_beta", "check_allreduce",
           "allreduce_sweep", "link_model", "ring_seconds", "launch_overhead",
           "print_launch_overhead", "print_allreduce_sweep"]

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


def check_allreduce() -> float:
    """Worker function: every rank adds ``rank + 1``; all must get ``n (n + 1) / 2``.

    Raises ``AssertionError`` on the rank that got a wrong sum (the launcher names it).

    Example::

        >>> labkit.launch(check_allreduce, nproc=2).values
        [3.0, 3.0]
    """
    import torch
    import torch.distributed as dist

    device = collective_device()
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
    device = collective_device()
    n, backend = dist.get_world_size(), dist.get_backend()
    rows = []
    for size in sizes:
        # Zeros stay zeros under a sum, so repeated reductions never overflow to inf.
        x = torch.zeros(size // _FLOAT32, dtype=torch.float32, device=device)
        for name in algorithms:
            for _ in range(warmup):
                ALGORITHMS[name](x)
        sync(device)
        times = {name: [] for name in algorithms}
        for _ in range(iters):
            for name in algorithms:
                barrier(device)
                sync(device)
                start = time.perf_counter()
                ALGORITHMS[name](x)
                sync(device)
                times[name].append(time.perf_counter() - start)
        medians = slowest([statistics.median(times[name]) for name in algorithms], device)
        for name, seconds in zip(algorithms, medians, strict=True):
            algbw = size / seconds / 1e9
            rows.append({"algorithm": name, "bytes": size, "seconds": seconds,
                         "algbw_GBps": algbw, "busbw_GBps": bus_bandwidth(algbw, n), "ranks": n,
                         "backend": backend})
    return rows


# ---- the alpha-beta model of one link, and of a ring all-reduce over it ---------------------


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


# ---- benchmarks run from a shell: python -m labkit bench [launch|allreduce|ddp|vgg16] --------

# It leaves with os._exit: torch 2.14's gloo threads may still be releasing the all-reduced
# tensor when the interpreter shuts down, and the rank then aborts after its work is done
# (about one run in ten on a busy machine), which check=True would report as a failure.
_BARE_SCRIPT = """\
import os
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
os._exit(0)
"""


def _trivial_allreduce() -> float:
    """The launch benchmark's job: the same work as ``_BARE_SCRIPT``, as a function."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def launch_overhead(repeats: int = 5, nproc: int = 2, warm_runs: int = 20) -> dict:
    """Median wall time of ``labkit.launch`` against bare ``torchrun`` doing the same job, and
    of the same job on warm workers (``labkit.workers``), with the pool's start-up.

    Cold runs alternate (launch, torchrun, launch, ...) after one untimed warm-up of each, so
    a machine that gets busier or quieter affects both sides alike; the ``warm_runs`` warm
    runs follow one untimed run on a fresh pool.

    Example::

        >>> r = launch_overhead(repeats=3)
        >>> r["ratio"] < 1.5, r["warm_ratio"] < 0.05
        (True, True)
    """
    import os
    import subprocess
    import tempfile

    from .launcher import launch, workers

    with tempfile.TemporaryDirectory(prefix="labkit-bench-") as tmp:
        script = os.path.join(tmp, "bare.py")
        with open(script, "w") as f:
            f.write(_BARE_SCRIPT)
        bare = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nproc}", f"--log-dir={tmp}/logs", script]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))

        def time_launch():
            start = time.perf_counter()
            values = launch(_trivial_allreduce, nproc=nproc, show_ranks=[], warm=False).values
            assert values == [nproc] * nproc
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
    start = time.perf_counter()
    with workers(nproc) as pool:
        pool_start = time.perf_counter() - start
        pool.run(_trivial_allreduce, show_ranks=[])  # the first run imports what the job needs
        warm = []
        for _ in range(warm_runs):
            start = time.perf_counter()
            assert pool.run(_trivial_allreduce, show_ranks=[]).values == [nproc] * nproc
            warm.append(time.perf_counter() - start)
    median_launch, median_bare = statistics.median(launched), statistics.median(bared)
    median_warm = statistics.median(warm)
    return {"nproc": nproc, "repeats": repeats, "launch_s": median_launch,
            "torchrun_s": median_bare, "ratio": median_launch / median_bare,
            "launch_all_s": launched, "torchrun_all_s": bared, "warm_runs": warm_runs,
            "warm_s": median_warm, "warm_all_s": warm, "pool_start_s": pool_start,
            "warm_ratio": median_warm / median_launch}


def print_launch_overhead(r: dict) -> None:
    """What ``python -m labkit bench launch`` prints for :func:`launch_overhead`'s dict."""
    print(f"launch overhead ({r['nproc']} workers, trivial all_reduce, "
          f"{r['repeats']} alternated cold runs, {r['warm_runs']} warm runs)")
    print(f"  cold  labkit.launch  median {r['launch_s']:.2f} s   "
          f"runs {_fmt_list(r['launch_all_s'])}")
    print(f"  cold  bare torchrun  median {r['torchrun_s']:.2f} s   "
          f"runs {_fmt_list(r['torchrun_all_s'])}")
    print(f"  ratio launch / torchrun = {r['ratio']:.3f}   (target <= 1.10)")
    warm = r["warm_all_s"]
    print(f"  warm  pool.run       median {r['warm_s']:.3f} s  {len(warm)} runs, "
          f"min {min(warm):.3f} s, max {max(warm):.3f} s; "
          f"pool start-up {r['pool_start_s']:.2f} s")
    print(f"  warm / cold = {r['warm_ratio']:.3f}   (target <= 0.05, and warm <= 0.10 s)")


def print_allreduce_sweep(rows: list[dict]) -> None:
    """What ``python -m labkit bench allreduce`` prints for :func:`allreduce_sweep`'s rows:
    time and bus bandwidth per size, each algorithm's alpha-beta fit, the ring model."""
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
            cells += "".join(
                f"  {by['builtin', size]['seconds'] / by[name, size]['seconds']:>16.2f}"
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

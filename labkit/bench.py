"""Timing: how fast do the workers talk? All-reduce sweeps and the numbers derived from them.

The worker functions (:func:`check_allreduce`, :func:`allreduce_sweep`) run inside each rank
with ``torch.distributed`` already initialised, which is what ``labkit.launch`` does::

    rows = labkit.launch(allreduce_sweep, message_sizes(1 << 10, 64 << 20), nproc=2).values[0]

The helpers (:func:`message_sizes`, :func:`bus_bandwidth`, :func:`fit_alpha_beta`) are plain
Python. Results are plain dicts so they can be printed, saved and handed to
``labkit.plots.bandwidth_plot``; nothing here plots.
"""

from __future__ import annotations

import statistics
import sys
import time

__all__ = ["message_sizes", "bus_bandwidth", "fit_alpha_beta", "check_allreduce",
           "allreduce_sweep", "launch_overhead", "main"]

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


def _device():
    """The tensor device collectives need: the rank's GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run this inside a worker, "
                           "e.g. labkit.launch(check_allreduce, nproc=2)")
    if dist.get_backend() == "nccl":
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


def allreduce_sweep(sizes: list[int], iters: int = 20, warmup: int = 5) -> list[dict]:
    """Worker function: time ``all_reduce`` of float32 messages of each size in ``sizes`` bytes.

    Each size gets ``warmup`` untimed calls (connection set-up, allocator, NCCL kernels), then
    ``iters`` timed ones, each started together behind a barrier and ended by a device
    synchronise (CUDA calls return before the GPU is done). A size's time is the median over
    the calls, then the maximum over ranks: a collective is as slow as its slowest rank. Every
    rank returns the same rows: ``bytes, seconds, algbw_GBps, busbw_GBps, ranks, backend``.

    Example::

        >>> sizes = message_sizes(1 << 10, 1 << 20)
        >>> rows = labkit.launch(allreduce_sweep, sizes, nproc=2).values[0]
        >>> rows[0]["bytes"], rows[0]["busbw_GBps"] > 0
        (1024, True)
    """
    import torch
    import torch.distributed as dist

    bad = [s for s in sizes if not isinstance(s, int) or s < _FLOAT32 or s % _FLOAT32]
    if bad or not sizes:
        raise ValueError(f"sizes must be a non-empty list of byte counts that are positive "
                         f"multiples of {_FLOAT32} (float32), got {bad or sizes}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
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
        for _ in range(warmup):
            dist.all_reduce(x)
        sync()
        times = []
        for _ in range(iters):
            barrier()
            sync()
            start = time.perf_counter()
            dist.all_reduce(x)
            sync()
            times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = slowest.item()
        algbw = size / seconds / 1e9
        rows.append({"bytes": size, "seconds": seconds, "algbw_GBps": algbw,
                     "busbw_GBps": bus_bandwidth(algbw, n), "ranks": n, "backend": backend})
    return rows


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
                f"--nproc-per-node={nproc}", script]
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


def _print_launch(r: dict) -> None:
    print(f"launch overhead ({r['nproc']} workers, trivial all_reduce, {r['repeats']} alternated runs)")
    print(f"  labkit.launch  median {r['launch_s']:.2f} s   runs {_fmt_list(r['launch_all_s'])}")
    print(f"  bare torchrun  median {r['torchrun_s']:.2f} s   runs {_fmt_list(r['torchrun_all_s'])}")
    print(f"  ratio launch / torchrun = {r['ratio']:.3f}   (target <= 1.10)")


def _print_allreduce(rows: list[dict]) -> None:
    print(f"all_reduce sweep ({rows[0]['ranks']} ranks, {rows[0]['backend']})")
    print(f"  {'bytes':>10}  {'time ms':>9}  {'algbw GB/s':>10}  {'busbw GB/s':>10}")
    for r in rows:
        print(f"  {r['bytes']:>10}  {r['seconds'] * 1e3:>9.3f}  {r['algbw_GBps']:>10.3f}  "
              f"{r['busbw_GBps']:>10.3f}")
    fit = fit_alpha_beta(rows)
    print(f"  fit: alpha = {fit['alpha_s'] * 1e6:.1f} us, bandwidth = {fit['bandwidth_GBps']:.2f} GB/s")


def _fmt_list(xs) -> str:
    return " ".join(f"{x:.2f}" for x in xs)


BENCHMARKS = ("launch", "allreduce")


def main(which: str = "all", repeats: int = 5) -> int:
    """``python -m labkit bench [all|launch|allreduce]``: run benchmarks and print their figures."""
    chosen = BENCHMARKS if which == "all" else (which,)
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        print(f"labkit bench: unknown benchmark {unknown[0]!r}; choose from all, "
              f"{', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    if repeats < 1:
        print(f"labkit bench: --repeats must be >= 1, got {repeats}", file=sys.stderr)
        return 2
    if "launch" in chosen:
        _print_launch(launch_overhead(repeats=repeats))
    if "allreduce" in chosen:
        from .launcher import launch

        sizes = message_sizes(1 << 10, 16 << 20)
        _print_allreduce(launch(allreduce_sweep, sizes, iters=10, nproc=2, show_ranks=[]).values[0])
    return 0

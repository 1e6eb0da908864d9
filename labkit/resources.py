"""Resources: what a training run needs of a device, and how runs share one machine.

Notebook 07's questions, one function each:

- :func:`training_memory`: a model's training memory per device, estimated (parameters,
  gradients, optimizer state, activations), and :func:`largest_batch`, the largest batch for
  which a test passes: run it on the estimate, then on :func:`peak_memory`, the measurement.
- :func:`matmul_throughput`: matrix-multiply throughput with this process's share of the
  machine (its threads, its GPUs), timed in a window that concurrent jobs enter together;
  :func:`thread_env`, the environment that sets that thread share.
- :func:`gpu_partitions` and :func:`launch_together`: split the GPUs between jobs with
  ``CUDA_VISIBLE_DEVICES`` and run several launches at once (jobs sharing a machine, or the
  agents of a multi-node run on one host).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ._sizes import whole

__all__ = ["MEASURE_ENV", "training_memory", "largest_batch", "peak_memory", "matmul_throughput",
           "thread_env", "gpu_partitions", "launch_together"]

# glibc serves large allocations with mmap, but raises that threshold after each free, after
# which freed tensors stay in its heap and the process's resident size stops following them.
# A fixed threshold keeps every tensor above 64 KiB in its own mapping, returned to the system
# when freed: then the peak resident size measures what training held (pass as launch's env).
MEASURE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
_WARM: list = []  # non-empty once this process has run one training step


def training_memory(model, sample, batch: int, *, precision: str = "fp32",
                    optimizer: str = "adam") -> dict:
    """Estimated bytes of one training step on one device: the four terms, and their total.

    Parameters, gradients and optimizer state come from the parameter count
    (:data:`labkit.parallel.memory.BYTES_PER_PARAM`); activations are what autograd saves in
    the forward pass, counted on batches of 1 and 2 (``sample`` is one input, without the
    batch dimension) and grown linearly to ``batch``: ``fixed + batch * per_sample``, both
    returned too.

    Example::

        >>> est = training_memory(models.vgg16(10, width=0.25, image_size=32),
        ...                       torch.zeros(3, 32, 32), batch=256)
        >>> {k: round(v / 1e6, 1) for k, v in est.items()}
        {'params': 33.6, 'grads': 33.6, 'optimizer': 67.2, 'activations': 110.6,
         'per_sample': 0.4, 'fixed': 0.0, 'total': 245.1}
    """
    from .parallel.memory import BYTES_PER_PARAM, saved_bytes

    if (precision, optimizer) not in BYTES_PER_PARAM:
        raise ValueError(f"no bytes-per-parameter rule for precision={precision!r}, "
                         f"optimizer={optimizer!r}: use one of {sorted(BYTES_PER_PARAM)}")
    batch = whole(batch, "batch")
    n = sum(p.numel() for p in model.parameters())
    per_param = BYTES_PER_PARAM[precision, optimizer]
    one, two = (saved_bytes(model, sample.expand(b, *sample.shape).clone(),
                            exclude=model.parameters()) for b in (1, 2))
    per_sample, fixed = two - one, 2 * one - two  # fixed: what does not grow with the batch
    est = {kind: n * per_param[kind] for kind in ("params", "grads", "optimizer")}
    est["activations"] = fixed + batch * per_sample
    est["per_sample"], est["fixed"] = per_sample, fixed
    est["total"] = est["params"] + est["grads"] + est["optimizer"] + est["activations"]
    return est


def largest_batch(fits, *, start: int = 1, limit: int = 1 << 20, tolerance: float = 0.0) -> int:
    """The largest batch ``b <= limit`` with ``fits(b)``, or 0 when not even ``start`` fits.

    Doubles from ``start`` until a batch does not fit, then bisects between the last two, as
    the batch-size finders of Lightning and Accelerate do: about ``2 log2(answer / start)``
    calls. ``fits`` must be monotone: a batch fits when every smaller one does. With
    ``tolerance`` (e.g. 0.02) the bisection stops once the answer is known within that
    fraction; what it returns always fits.

    Example::

        >>> largest_batch(lambda b: 16 * 2**20 + b * 400_000 <= 256 * 2**20)
        629
    """
    if isinstance(start, bool) or not isinstance(start, int) or not 1 <= start <= limit:
        raise ValueError(f"need a whole start with 1 <= start <= limit, got {start=}, {limit=}")
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None:
        if good == limit:
            return limit
        trial = min(2 * good, limit)
        good, bad = (trial, None) if fits(trial) else (good, trial)
    while bad - good > max(1, tolerance * good):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}: peak_memory needs Linux on the CPU")


def _reset_peak_rss() -> None:
    """Set this process's peak resident size (VmHWM) back to its current size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _train_step(model, opt, sample, batch: int, num_classes: int) -> None:
    import torch
    from torch.nn import functional as F

    x = sample.expand(batch, *sample.shape).clone()
    y = torch.arange(batch, device=sample.device) % num_classes
    opt.zero_grad(set_to_none=True)  # what a training loop holds between two steps
    F.cross_entropy(model(x), y).backward()
    opt.step()


def peak_memory(make_model, sample, batch: int, *, num_classes: int = 10) -> dict:
    """Measured bytes of one Adam training step at ``batch``: the peak, above what came before.

    On a GPU (``sample`` on CUDA) the peak is ``torch.cuda.max_memory_allocated``; on the CPU
    it is the process's peak resident size, which is only meaningful in a process started
    with :data:`MEASURE_ENV` (``labkit.launch(..., env=resources.MEASURE_ENV)``). The model is
    built and stepped once at batch 2 first, so the optimizer state exists and the libraries'
    own first-use memory is not counted; ``held`` is what stays between steps.

    Example::

        >>> labkit.launch(peak_memory, make, torch.zeros(3, 32, 32), 256, nproc=1,
        ...               env=resources.MEASURE_ENV).values[0]["peak"] / 1e6
        242.6
    """
    import torch

    cuda = sample.device.type == "cuda"
    threshold = MEASURE_ENV["MALLOC_MMAP_THRESHOLD_"]
    if not cuda and os.environ.get("MALLOC_MMAP_THRESHOLD_") != threshold:
        raise RuntimeError("peak_memory on the CPU reads the resident size, which glibc's heap "
                           "blurs: run it in a process started with env=resources.MEASURE_ENV, "
                           "e.g. labkit.launch(peak_memory, ..., nproc=1, env=MEASURE_ENV)")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        current = torch.cuda.memory_allocated
    else:
        current = lambda: _status_bytes("VmRSS")  # noqa: E731
        if not _WARM:  # libraries map their code and buffers on first use: not the model's
            warm = make_model()
            _train_step(warm, torch.optim.Adam(warm.parameters()), sample, 2, num_classes)
            _WARM.append(True)
            del warm
    before = current()
    model = make_model().to(sample.device)
    opt = torch.optim.Adam(model.parameters())
    _train_step(model, opt, sample, 2, num_classes)
    opt.zero_grad(set_to_none=True)
    held = current() - before
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak_rss()
    _train_step(model, opt, sample, batch, num_classes)
    if cuda:
        torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")) - before
    return {"batch": batch, "peak": peak, "held": held, "device": str(sample.device)}


def matmul_throughput(seconds: float, *, device: str = "cpu", size: int = 256,
                      ready_dir: str | None = None, jobs: int = 1, wait: float = 120.0) -> dict:
    """GFLOP/s of ``size``-square float32 matrix products for ``seconds``, on this process's share.

    On the CPU the share is its threads (``OMP_NUM_THREADS``), on a GPU the device it sees
    (``CUDA_VISIBLE_DEVICES``). ``ready_dir`` and ``jobs``: when several launches run at once,
    each waits until ``jobs`` of them have written a file there, so that the timed windows
    overlap (launches start seconds apart); after ``wait`` seconds without them it gives up.
    Returns ``gflops``, ``threads`` (torch's intra-op threads) and the process's
    ``cpu_seconds`` in the window.

    Example::

        >>> labkit.launch(matmul_throughput, 2.0, nproc=1, env={"OMP_NUM_THREADS": "2"})
    """
    import torch

    if ready_dir is not None:
        Path(ready_dir, f"{os.getpid()}.ready").touch()
        deadline = time.monotonic() + wait
        while (ready := len(list(Path(ready_dir).glob("*.ready")))) < jobs:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {ready} of {jobs} jobs reached {ready_dir} in "
                                   f"{wait:g} s: did every job get the same ready_dir and jobs?")
            time.sleep(0.01)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    torch.mm(a, b)  # warm-up: thread pool started, kernels chosen
    sync()
    products, cpu0, start = 0, time.process_time(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            torch.mm(a, b)
        sync()  # GPU kernels are queued, not done: count only finished ones
        products += 8
    wall = time.perf_counter() - start
    return {"gflops": products * 2 * size**3 / wall / 1e9, "threads": torch.get_num_threads(),
            "cpu_seconds": time.process_time() - cpu0, "seconds": wall}


def thread_env(threads: int) -> dict:
    """Environment that gives a process ``threads`` math threads, whichever library does the math.

    ``OMP_NUM_THREADS`` alone is not enough where ``MKL_NUM_THREADS`` is also set (as ``make
    test`` does): MKL, which runs PyTorch's CPU matrix products, reads its own variable first.

    Example::

        >>> labkit.launch(train, nproc=2, env=thread_env(4))
    """
    threads = whole(threads, "threads")
    return {name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                             "OPENBLAS_NUM_THREADS")}


def gpu_partitions(n_gpus: int, jobs: int) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` values that give each of ``jobs`` jobs its own equal share.

    Inside a job its GPUs are renumbered from 0, so its code need not know where it runs.

    Example::

        >>> gpu_partitions(8, 2)
        ['0,1,2,3', '4,5,6,7']
    """
    if jobs < 1 or n_gpus < jobs:
        raise ValueError(f"cannot give {jobs} job(s) a GPU each from {n_gpus} GPU(s): run fewer "
                         "jobs, or let them share with the same CUDA_VISIBLE_DEVICES")
    share = n_gpus // jobs
    return [",".join(str(g) for g in range(j * share, (j + 1) * share)) for j in range(jobs)]


def launch_together(fn, *args, runs: list[dict], **common) -> list:
    """Run ``labkit.launch(fn, *args, **common, **run)`` for every run at once; results in order.

    Each is its own torchrun run (its own rendezvous, workers and environment): two users'
    runs on one machine, or the agents of a multi-node run started on one host. The first
    failure is raised after all runs have ended.

    Example::

        >>> a, b = launch_together(matmul_throughput, 2.0, nproc=1,
        ...                        runs=[{"env": {"OMP_NUM_THREADS": "1"}}] * 2)
    """
    from .launcher import launch

    if not runs or not all(isinstance(run, dict) for run in runs):
        raise ValueError("runs must be a non-empty list of dicts of launch keywords, e.g. "
                         "runs=[{'env': {'CUDA_VISIBLE_DEVICES': '0'}}, "
                         "{'env': {'CUDA_VISIBLE_DEVICES': '1'}}]")
    with ThreadPoolExecutor(len(runs), thread_name_prefix="labkit-run") as pool:
        futures = [pool.submit(launch, fn, *args, **{**common, **run}) for run in runs]
        errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]

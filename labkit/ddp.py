"""Data parallelism, the code of notebook 02: batch arithmetic, rank-0 saving, replica checks,
scaling measured and predicted, and DDP's gradient buckets.

The lesson code of notebook 02 (DistributedSampler, ``set_epoch``, DDP, ``all_reduce`` of the
metrics) stays in the notebook where the learner reads it; what lives here is what every DDP
script needs and gets subtly wrong (a global batch that does not split over the workers, a
dataset too small for them, a checkpoint half-written when a rank dies, replicas that drifted)
and the measurements of the notebook's later sections:

* :func:`measure_scaling` launches workers itself and times DDP steps for several worker
  counts in one run; :func:`predict_scaling` models the same runs as compute plus a ring
  all-reduce (``labkit.bench``'s alpha-beta model), and :func:`predict_efficiency` applies that
  model to a published network known only by its gradient bytes and compute time (notebook 08).
* :func:`bucket_sweep` is a worker function (``labkit.launch(bucket_sweep, ...)``), like every
  ``*_sweep`` in labkit: it runs on every rank and returns the same rows on each. It counts the
  all-reduces per step for each bucket size and, with ``overlap=True``, how much of the
  communication DDP hides behind backward (notebook 04).
* :func:`counting_allreduces` and :func:`count_allreduces` are labkit's one all-reduce counter.

Every function takes an explicit ``world_size`` / ``rank`` or reads them from the initialised
process group, which is what ``labkit.launch`` sets up.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
from pathlib import Path

from ._dist import barrier, collective_device, slowest, time_steps
from ._sizes import divisors, whole
from .bench import link_model, ring_seconds

__all__ = ["per_worker_batch", "save_on_rank0", "replica_divergence", "SCALING_MODES",
           "machine_workers", "worker_counts", "measure_scaling", "predict_scaling",
           "predict_efficiency", "ddp_efficiency", "print_efficiency", "wide_mlp",
           "counting_allreduces", "count_allreduces", "bucket_sweep"]


def _world_size(world_size: int | None) -> int:
    if world_size is not None:
        return int(world_size)
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def per_worker_batch(global_batch: int, *, world_size: int | None = None,
                     dataset_size: int | None = None) -> int:
    """The batch each worker loads so that together they make ``global_batch``.

    Data parallelism keeps the *global* batch (what the learning rate is tuned for) and splits
    it; a global batch that does not split evenly, or a dataset that gives the workers no full
    batch, is an error here rather than a silently different experiment (DistributedSampler
    pads a short dataset by repeating samples).

    Example::

        >>> per_worker_batch(256, world_size=4)
        64
        >>> per_worker_batch(256, world_size=4, dataset_size=1000)   # 3 steps per epoch
        64
    """
    world = _world_size(world_size)
    if global_batch < 1 or world < 1:
        raise ValueError(f"need global_batch >= 1 and world_size >= 1, got {global_batch} and "
                         f"{world}")
    if global_batch % world:
        lower, upper = global_batch // world * world, (global_batch // world + 1) * world
        near = f"{lower} or {upper}" if lower else f"{upper} or {2 * upper}"
        options = ", ".join(str(n) for n in divisors(global_batch) if n != world)
        raise ValueError(
            f"a global batch of {global_batch} does not split evenly over {world} workers: use a "
            f"multiple of {world} (e.g. {near}), or a worker count that divides {global_batch} "
            f"({options})")
    if dataset_size is not None:
        per_worker_samples = dataset_size // world  # DistributedSampler(drop_last=True)
        if per_worker_samples < global_batch // world:
            raise ValueError(
                f"{dataset_size} samples over {world} workers is {per_worker_samples} each: not "
                f"one full batch of {global_batch // world} per worker (global batch "
                f"{global_batch}); use fewer workers, a smaller global batch (at most "
                f"{max(dataset_size // world * world, world)}), or more data")
    return global_batch // world


def save_on_rank0(obj, path) -> Path:
    """Rank 0 writes ``obj`` with ``torch.save``; every rank returns once the file is complete.

    The write goes to a temporary name and is renamed into place, so a run that dies mid-write
    leaves the previous checkpoint intact; the barrier keeps the other ranks from loading a
    file rank 0 has not finished. Without a process group it simply saves.

    Example::

        >>> path = save_on_rank0({"model": model.module.state_dict(), "epoch": 3}, "ckpt.pt")
        >>> state = torch.load(path, map_location="cpu")    # on every rank
    """
    import torch
    import torch.distributed as dist

    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(obj, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    if distributed:
        dist.barrier()
    return path


def replica_divergence(model) -> float:
    """The largest difference between any rank's parameters and rank 0's (0.0: in sync).

    DDP keeps replicas identical by construction; this checks it, e.g. after loading a
    checkpoint or after a step that went around DDP. Every rank must call it (it is a
    collective); every rank gets the same number.

    Example::

        >>> replica_divergence(ddp_model)
        0.0
    """
    import torch
    import torch.distributed as dist

    module = getattr(model, "module", model)
    flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0.0
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff.item())


# ---- data-parallel scaling: throughput against worker count, and a model of it ------------

SCALING_MODES = ("weak", "strong", "independent")


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
    if not counts:
        raise ValueError(f"workers must list at least one worker count, e.g. [1, 2, 4], got "
                         f"{workers!r}")
    counts = [whole(n, f"workers={workers!r}: each count", hint=" (e.g. [1, 2, 4])")
              for n in counts]
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


def measure_scaling(workers=None, *, modes=("weak", "strong"), per_worker_batch: int = 64,
                    global_batch: int | None = None, model=None, input_shape=(3, 32, 32),
                    num_classes: int = 10, steps: int = 20, warmup: int = 3, repeats: int = 3,
                    threads: int | None = None, oversubscribe: bool = False,
                    timeout: float | None = None, backend: str = "auto") -> list[dict]:
    """Launch and measure DDP training throughput for each worker count in ``workers``.

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

        >>> rows = measure_scaling([1, 2], modes=("weak",), steps=10)
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
    batches = _scaling_batches(modes, counts, per_worker_batch, global_batch)
    if threads is None and machine_workers(backend)[1].startswith("CPU"):
        threads = max(1, machine_workers("gloo")[0] // counts[-1])
    spec = {"counts": counts, "modes": list(modes), "batches": batches, "model": model,
            "input_shape": tuple(input_shape), "num_classes": num_classes, "steps": steps,
            "warmup": warmup, "repeats": repeats, "threads": threads}
    times, grad_bytes = launch(_scaling_worker, spec, nproc=counts[-1], backend=backend,
                               timeout=timeout, show_ranks=[0]).values[0]
    return _scaling_rows(times, batches, grad_bytes)


def _scaling_batches(modes, counts, per_worker: int, global_batch: int | None) -> dict:
    """Each (mode, workers)'s per-worker batch: strong scaling splits one global batch."""
    if global_batch is None:
        global_batch = per_worker * counts[-1]
    return {(mode, n): per_worker_batch(global_batch, world_size=n) if mode == "strong"
            else per_worker for mode in modes for n in counts}


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
    """Worker side of :func:`measure_scaling`: every rank runs this.

    Rank 0's return is the result.
    """
    import torch
    import torch.distributed as dist

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    device = collective_device()
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
                model = _fresh_model(make, device, ddp=group is not None,
                                     process_group=group)
                elapsed = time_steps(model, x[:b], y[:b], spec["steps"], spec["warmup"], device,
                                     group)
            elapsed = slowest(elapsed, torch.device("cpu"), coord)[0]
            times[mode, n].append(elapsed / spec["steps"])
    if "independent" in spec["modes"] and "weak" in spec["modes"]:
        times["independent", 1] = times["weak", 1]
    return times, grad_bytes


def _fresh_model(make, device, *, ddp: bool = False, **options):
    """A model from ``make`` with seed 0 on ``device``; wrapped in DDP (``options``) if ``ddp``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = make().to(device)
    if not ddp:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, **options)


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


def predict_efficiency(grad_bytes: float, compute_s: float, workers, *, alpha_s: float,
                       bandwidth_GBps: float) -> list[dict]:
    """:func:`predict_scaling`'s weak-scaling model for a model known only by its size.

    A published model is rarely one you can time here, but the model needs only its gradient
    bytes, the seconds one worker computes a step (``compute_s``, e.g. the training FLOPs of
    a batch over the FLOP/s a GPU sustains) and a link (``alpha_s``, ``bandwidth_GBps``: what
    :func:`labkit.bench.link_model` returns from a sweep, or a network's data sheet):
    ``efficiency(N) = compute / (compute + ring all-reduce of grad_bytes over N)``. The same
    pessimistic bound as :func:`predict_scaling`: no overlap with backward.

    Example::

        >>> rows = predict_efficiency(100e6, 0.3, [1, 512], alpha_s=5e-6, bandwidth_GBps=3.125)
        >>> [round(r["efficiency"], 2) for r in rows]
        [1.0, 0.81]
    """
    if not grad_bytes >= 0 or not compute_s > 0:
        raise ValueError(f"need grad_bytes >= 0 and compute_s > 0 (seconds per step of one "
                         f"worker), got grad_bytes={grad_bytes}, compute_s={compute_s}")
    counts = [whole(n, "a worker count") for n in workers]
    if not counts:
        raise ValueError("workers is empty: pass the worker counts to predict, e.g. [1, 8, 64]")
    rows = []
    for n in counts:
        comm = ring_seconds(grad_bytes, n, alpha_s=alpha_s, bandwidth_GBps=bandwidth_GBps)
        rows.append({"workers": n, "compute_s": compute_s, "allreduce_s": comm,
                     "step_s": compute_s + comm, "efficiency": compute_s / (compute_s + comm)})
    return rows


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
    return measure_scaling([1, nproc], modes=("weak", "independent"), threads=1,
                           per_worker_batch=per_worker_batch, steps=steps, warmup=3,
                           repeats=repeats, backend="gloo")


def print_efficiency(rows: list[dict]) -> None:
    """What ``python -m labkit bench ddp`` prints for :func:`ddp_efficiency`'s rows."""
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


# ---- DDP internals: gradient buckets, all-reduces counted, overlap with backward ----------


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


@contextlib.contextmanager
def counting_allreduces(counter: dict | None = None):
    """Count the calls and bytes of every ``dist.all_reduce`` made while inside.

    DDP's Python communication hooks (its default all-reduce, the fp16 / bf16 / PowerSGD
    compression hooks) all call ``dist.all_reduce``, so wrapping it counts what any hook
    sends; the counter is a dict ``{"calls", "bytes"}`` that updates as the ranks train.

    Example::

        >>> with counting_allreduces() as counter:
        ...     loss.backward()                 # model = DDP(...) with a comm hook
        >>> counter
        {'calls': 1, 'bytes': 264872}
    """
    import torch.distributed as dist

    counter = {"calls": 0, "bytes": 0} if counter is None else counter
    counter.setdefault("calls", 0)
    counter.setdefault("bytes", 0)
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


def count_allreduces(ddp_model, *, blocking: bool = False) -> dict:
    """Count the all-reduces a DDP model launches: returns a dict that updates as it trains.

    Registers a communication hook that does exactly what DDP does by default (all-reduce the
    bucket, divide by the world size), counted by :func:`counting_allreduces`. DDP reduces one
    *bucket* per call, so the count per step is the number of buckets. ``blocking=True`` waits
    for each bucket's all-reduce before backward goes on: nothing overlaps, which is the
    baseline that shows what overlap hides.

    Example::

        >>> counter = count_allreduces(model)          # model = DistributedDataParallel(...)
        >>> loss.backward(); counter
        {'calls': 1, 'bytes': 264872}
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        with counting_allreduces(state):
            if not blocking:
                return default_hooks.allreduce_hook(None, bucket)
            buffer = bucket.buffer()
            dist.all_reduce(buffer.div_(dist.get_world_size()))
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    counter = {"calls": 0, "bytes": 0}
    ddp_model.register_comm_hook(counter, hook)
    return counter


def bucket_sweep(caps_mb, *, model=None, batch: int = 32, steps: int = 10, warmup: int = 2,
                 repeats: int = 1, overlap: bool = False) -> list[dict]:
    """Worker function: DDP's step time and all-reduces per step for each ``bucket_cap_mb``.

    DDP groups gradients into buckets of about ``bucket_cap_mb`` and all-reduces a bucket as
    soon as backward has filled it, overlapping communication with the rest of backward. Small
    buckets pay the per-call latency many times; one huge bucket waits for the whole backward
    and overlaps nothing. ``model`` is a factory (default :func:`wide_mlp`). A gradient
    bigger than the cap gets a bucket of its own, so every cap below a layer's size gives one
    call per layer; a cap you give applies to DDP's first bucket too (left at its default, the
    first bucket is 1 MiB).

    Every rank returns the same rows: ``bucket_cap_mb, allreduces`` (calls per step, the
    bucket count), ``MB_per_step, step_s`` (DDP as it is), ``ranks``. With ``overlap=True``
    also ``compute_s`` (no communication at all), ``serial_s`` (each bucket's all-reduce
    waited for, :func:`count_allreduces` with ``blocking=True``), ``comm_s = serial - compute``
    and ``hidden_fraction = (serial - step) / comm``, the share of the communication that
    overlap hid (None when it is lost in the noise). Times are medians over ``repeats``
    rounds whose order alternates, the slowest rank's.

    Example::

        >>> rows = labkit.launch(bucket_sweep, [0.25, 1, 2, 4, 25, 100], nproc=2).values[0]
        >>> [r["allreduces"] for r in rows]      # wide_mlp: twelve layers of about 1 MB each
        [12.0, 12.0, 6.0, 3.0, 1.0, 1.0]
        >>> labkit.launch(bucket_sweep, [1, 25], overlap=True, repeats=3, nproc=2).values[0]
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    caps = list(caps_mb) if isinstance(caps_mb, list | tuple) else []
    if not caps or any(not isinstance(c, int | float) or c <= 0 for c in caps):
        raise ValueError(f"caps_mb must be positive sizes in MB, e.g. [1, 25, 100], got "
                         f"{caps_mb!r}")
    whole(batch, "batch")
    whole(steps, "steps")
    whole(warmup, "warmup", low=0)
    whole(repeats, "repeats")
    device = collective_device()
    make = model or wide_mlp
    inputs = next(m for m in make().modules() if isinstance(m, nn.Linear)).in_features
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(batch, inputs, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    variants, counters = _bucket_variants(make, caps, overlap, device)
    for m in variants.values():  # DDP rebuilds its buckets after the first step
        time_steps(m, x, y, 1, 0, device)
    times: dict = {key: [] for key in variants}
    counted: dict = {}
    names = list(variants)
    for r in range(repeats):
        for key in names if r % 2 == 0 else names[::-1]:
            counter = counters.get(key)
            before = dict(counter) if counter else {}
            barrier(device)  # start together: an all-reduce waits for its slowest rank
            times[key].append(time_steps(variants[key], x, y, steps, warmup, device) / steps)
            if counter:
                counted[key] = {k: (counter[k] - before[k]) / (steps + warmup) for k in before}
    step = dict(zip(names, slowest([statistics.median(times[k]) for k in names], device),
                    strict=True))
    return [_bucket_row(cap, step, counted, overlap) for cap in caps]


def _bucket_variants(make, caps, overlap: bool, device):
    """The DDP models :func:`bucket_sweep` times, by (kind, cap), and their all-reduce counters."""
    variants, counters = {}, {}
    if overlap:
        variants["compute", None] = _fresh_model(make, device)
    for cap in caps:
        kinds = ("overlapped", "serial") if overlap else ("overlapped",)
        for kind in kinds:
            model = _fresh_model(make, device, ddp=True, bucket_cap_mb=cap)
            counters[kind, cap] = count_allreduces(model, blocking=kind == "serial")
            variants[kind, cap] = model
    return variants, counters


def _bucket_row(cap, step: dict, counted: dict, overlap: bool) -> dict:
    """One :func:`bucket_sweep` row from the slowest rank's step times and the counts."""
    import torch.distributed as dist

    row = {"bucket_cap_mb": cap, "allreduces": counted["overlapped", cap]["calls"],
           "MB_per_step": counted["overlapped", cap]["bytes"] / 1e6,
           "step_s": step["overlapped", cap], "ranks": dist.get_world_size()}
    if overlap:
        compute, serial = step["compute", None], step["serial", cap]
        comm = serial - compute
        row.update(compute_s=compute, serial_s=serial, comm_s=comm,
                   hidden_fraction=(serial - row["step_s"]) / comm if comm > 0.02 * serial
                   else None)
    return row

"""Reading a profiler trace, the code of notebook 11: exposed communication, data-loading stalls
and host-device synchronisations, found in the events of one rank's ``torch.profiler`` trace.

``torch.profiler.profile(...).export_chrome_trace(path)`` writes a Chrome/Perfetto trace: JSON
whose ``traceEvents`` list holds, among others, *complete events* (``"ph": "X"``), each a span
of ``dur`` microseconds starting at ``ts`` microseconds on thread ``tid`` of process ``pid``
(the Trace Event Format; ``displayTimeUnit`` only changes how a viewer shows them). Kineto,
torch's profiler library, puts each event in a category (``cat``, its ``ActivityType.cpp``):
``cpu_op`` (an aten or autograd op), ``user_annotation`` (a ``record_function`` range),
``kernel``, ``gpu_memcpy``, ``gpu_memset`` and ``gpu_user_annotation`` (the GPU timeline) and
``cuda_runtime`` (a CUDA API call on the CPU).

Everything here is interval arithmetic over those spans:

* :func:`record_ddp_trace` records a real one: a small DDP training step on ``nproc`` ranks
  with a deliberate data-loading stall and a ``loss.item()`` each step.
* :func:`load_trace` reads a trace into plain event dicts; :func:`intervals`,
  :func:`merge_intervals`, :func:`intervals_total` and :func:`subtract_intervals` are the
  arithmetic.
* :func:`exposed_communication` (collective time that no compute overlaps), :func:`data_stalls`
  (the ``"data"`` spans that took too long), :func:`host_syncs` (ops that make the CPU wait for
  the device) and :func:`step_times`; :func:`analyse_trace` runs them all.
* :func:`synthetic_trace` builds small traces whose answers are known by construction: for
  tests, and for grading an analysis on traces its author has not seen.

All analysis functions read one rank's trace (one file): ranks have clocks of their own.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import random
import statistics
import time
from pathlib import Path

from ._sizes import whole
from .profile import knob

__all__ = [
    "SYNC_OPS", "record_ddp_trace", "load_trace", "intervals", "merge_intervals",
    "intervals_total", "subtract_intervals", "is_communication", "is_cpu_compute",
    "is_gpu_compute", "is_gpu_trace", "exposed_communication", "data_stalls", "host_syncs",
    "step_times", "analyse_trace", "SyntheticTrace", "synthetic_trace",
]

US = 1e6  # trace times are microseconds; results are seconds

# Ops that make the host wait for the device. ``Tensor.item()`` is ``aten::item``, which calls
# ``aten::_local_scalar_dense`` (the copy of one number to the CPU); on a GPU that op calls
# ``cudaStreamSynchronize``. ``torch.cuda.synchronize()`` is ``cudaDeviceSynchronize``,
# ``Event.synchronize()`` is ``cudaEventSynchronize`` (CUDA runtime API names, which kineto
# records as they are, category ``cuda_runtime``). On a CPU trace the first two still show
# where the code would wait on a GPU, although a CPU has nothing to wait for.
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaEventSynchronize")


# --------------------------------------------------------------------------- recording

def record_ddp_trace(out_dir, *, nproc: int = 2, steps: int | None = None,
                     stall_s: float | None = None, stall_step: int = 1,
                     stall_rank: int | None = None, sync: bool = True,
                     timeout: float | None = 300) -> list[Path]:
    """Profile ``steps`` DDP training steps on ``nproc`` ranks; return each rank's trace file.

    Every rank trains a small MLP under ``torch.profiler.profile`` (CPU activities, CUDA too
    on a GPU) and writes ``trace-rank{r}.json`` into ``out_dir`` (created if missing; nothing
    is written elsewhere). Each step is two ``record_function`` ranges, so that an analysis
    reads them instead of guessing: ``"data"`` (the next batch from the loader) and ``"step"``
    (forward, backward with DDP's all-reduce, the optimizer, and ``loss.item()`` if ``sync``:
    a host-device synchronisation). On step ``stall_step`` the loader sleeps ``stall_s``
    seconds, on every rank or only on ``stall_rank`` (a straggler: the others then wait for it
    inside the all-reduce). Two unprofiled warm-up steps come first: DDP broadcasts and
    rebuilds its gradient buckets in its first two iterations.

    What a collective looks like in the trace (recorded with torch 2.14): under gloo, the
    main thread's ``c10d::allreduce_`` op (``cpu_op``) only hands the work to gloo, and the
    all-reduce itself is a ``gloo:all_reduce`` range (``user_annotation``) on one of gloo's
    own threads (named ``pt_gloo_runloop``); its name is the ``profilingTitle`` of the work
    in ProcessGroupGloo.cpp. Under NCCL the CPU side is ``c10d::allreduce_`` with a
    ``nccl:all_reduce`` range inside (ProcessGroupNCCL.hpp's ``profilingTitle``), and the
    all-reduce runs as a GPU kernel named ``ncclDevKernel_AllReduce_...`` (``ncclKernel_...``
    in older NCCL releases) on NCCL's own stream.

    Example::

        >>> paths = record_ddp_trace("traces", steps=4, stall_s=0.1)
        >>> [p.name for p in paths]
        ['trace-rank0.json', 'trace-rank1.json']
        >>> analyse_trace(paths[0])["stalls"][0]["step"]
        1
    """
    from .launcher import launch

    nproc = whole(nproc, "nproc", hint=": the number of ranks to record")
    steps = whole(knob(10, cpu=5, smoke=4) if steps is None else steps, "steps",
                  hint=": the profiled training steps")
    stall_s = knob(0.2, cpu=0.1, smoke=0.05) if stall_s is None else stall_s
    if isinstance(stall_s, bool) or not isinstance(stall_s, int | float) or not stall_s >= 0:
        raise ValueError(f"stall_s must be seconds >= 0 (0: no stall), got {stall_s!r}")
    stall_step = whole(stall_step, "stall_step", low=0, hint=": the step whose batch is late")
    if stall_step >= steps:
        raise ValueError(f"stall_step={stall_step} is past the last step: use 0 to "
                         f"{steps - 1}, or more steps")
    if stall_rank is not None:
        stall_rank = whole(stall_rank, "stall_rank", low=0)
        if stall_rank >= nproc:
            raise ValueError(f"stall_rank={stall_rank} but ranks are 0 to {nproc - 1}: use "
                             "one of them, or None to stall every rank")
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    # show_ranks=[]: the profiler's native start/stop lines (and, on a CPU, its failed GPU
    # probe) would fill the cell; a rank that fails still raises with its traceback.
    result = launch(_record_rank, str(folder.resolve()), nproc=nproc, timeout=timeout,
                    show_ranks=[],
                    steps=steps, stall_s=float(stall_s), stall_step=stall_step,
                    stall_rank=stall_rank, sync=bool(sync))
    return [Path(p) for p in result.values]


def _loader(steps, stall_s, stall_step, device, seed):
    """A data loader whose batch ``stall_step`` arrives ``stall_s`` seconds late."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        if i == stall_step and stall_s:
            time.sleep(stall_s)  # the deliberate stall: a slow disk, a busy decoder...
        x = torch.randn(16, 64, generator=gen).to(device)
        yield x, torch.randint(0, 10, (16,), generator=gen).to(device)


def _record_rank(out_dir, *, steps, stall_s, stall_step, stall_rank, sync) -> str:
    """Worker: profile ``steps`` DDP steps on this rank and write its Chrome trace."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    from ._dist import collective_device

    rank = dist.get_rank()
    device = collective_device()
    torch.manual_seed(0)  # the same start on every rank, as DDP expects
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 10)).to(device)
    model = nn.parallel.DistributedDataParallel(
        net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # DDP all-reduces the gradients during backward
        opt.step()
        return loss

    for x, y in _loader(2, 0, -1, device, seed=100 + rank):  # warm-up, not profiled
        train_step(x, y)
    stalls = stall_rank is None or stall_rank == rank
    batches = _loader(steps, stall_s if stalls else 0, stall_step, device, seed=rank)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("data"):
                x, y = next(batches)
            with record_function("step"):
                loss = train_step(x, y)
                if sync:
                    loss.item()  # the number for the log: the host waits for the device
    path = Path(out_dir) / f"trace-rank{rank}.json"
    prof.export_chrome_trace(str(path))  # a .json path: written directly, no temporary file
    return str(path)


# --------------------------------------------------------------------------- reading

def load_trace(trace) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace, sorted by start time.

    ``trace``: the path of a ``.json`` (or ``.json.gz``) file written by
    ``export_chrome_trace``, its parsed dict (``{"traceEvents": [...]}``) or the bare list
    of events. Each event comes back as a plain dict ``name, cat, ph, ts, dur, pid, tid,
    args`` with ``ts`` and ``dur`` in microseconds, as in the file. Instant, flow and metadata
    events carry no duration and are left out.

    Example::

        >>> events = load_trace("traces/trace-rank0.json")
        >>> [e["name"] for e in events if e["name"].startswith("gloo:")][:1]   # on a CPU
        ['gloo:all_reduce']
    """
    if isinstance(trace, str | os.PathLike):
        trace = _read_json(Path(trace))
    if isinstance(trace, dict):
        if not isinstance(trace.get("traceEvents"), list):
            raise ValueError("not a Chrome trace: no 'traceEvents' list (found keys "
                             f"{sorted(trace)[:6]}); pass the file export_chrome_trace wrote")
        trace = trace["traceEvents"]
    if not isinstance(trace, list):
        raise TypeError(f"load_trace takes a path, a trace dict or a list of events, got "
                        f"{type(trace).__name__}")
    events = []
    for i, e in enumerate(trace):
        if not isinstance(e, dict):
            raise ValueError(f"event {i} is a {type(e).__name__}, not a dict: not a Chrome "
                             "trace")
        if e.get("ph") != "X":
            continue
        try:
            ts, dur = float(e["ts"]), float(e["dur"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"complete event {i} ({e.get('name')!r}) needs numbers 'ts' and "
                             "'dur' (microseconds): is this file a Chrome trace?") from None
        if dur < 0:
            raise ValueError(f"event {i} ({e.get('name')!r}) has a negative duration {dur}")
        events.append({"name": str(e.get("name", "")), "cat": str(e.get("cat", "")), "ph": "X",
                       "ts": ts, "dur": dur, "pid": e.get("pid"), "tid": e.get("tid"),
                       "args": dict(e.get("args") or {})})
    events.sort(key=lambda e: (e["ts"], -e["dur"]))  # a parent before the ops it contains
    return events


def _read_json(path: Path):
    """The parsed JSON of ``path`` (gzip-compressed if it ends with ``.gz``)."""
    if not path.is_file():
        raise FileNotFoundError(f"no trace at {str(path)!r}: write one with "
                                "prof.export_chrome_trace(path) or record_ddp_trace(folder)")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        raise ValueError(f"{str(path)!r} is not a Chrome trace (not JSON: {err}); pass the "
                         "file prof.export_chrome_trace(path) wrote") from None


# --------------------------------------------------------------------------- intervals

def intervals(events, keep=None) -> list[tuple[float, float]]:
    """``(start, end)`` in microseconds of each event for which ``keep(event)`` is true (all
    events if ``keep`` is None)."""
    return [(e["ts"], e["ts"] + e["dur"]) for e in events if keep is None or keep(e)]


def merge_intervals(spans) -> list[tuple[float, float]]:
    """The union of ``spans`` as sorted, disjoint ``(start, end)`` pairs.

    Overlapping, nested and touching spans become one (``(0, 2)`` and ``(2, 3)`` cover
    ``(0, 3)`` without a gap); empty spans (``start == end``) cover nothing and vanish.

    Example::

        >>> merge_intervals([(5, 6), (0, 2), (1, 3), (3, 4)])
        [(0, 4), (5, 6)]
    """
    merged: list[list] = []
    for start, end in sorted(_checked(spans)):
        if end == start:
            continue
        if merged and start <= merged[-1][1]:  # overlaps or touches the last one: extend it
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _checked(spans) -> list[tuple]:
    spans = [tuple(s) for s in spans]
    for s in spans:
        if len(s) != 2 or s[1] < s[0]:
            raise ValueError(f"an interval is (start, end) with end >= start, got {s}")
    return spans


def intervals_total(spans) -> float:
    """The length of the union of ``spans``: time covered counts once, however many cover it.

    Example::

        >>> intervals_total([(0, 10), (5, 15), (20, 25)])    # 15 + 5, the overlap once
        20
    """
    return sum(end - start for start, end in merge_intervals(spans))


def subtract_intervals(a, b) -> list[tuple[float, float]]:
    """The parts of ``a`` that no interval of ``b`` covers, as sorted, disjoint pairs.

    Example::

        >>> subtract_intervals([(0, 10)], [(2, 3), (5, 12)])
        [(0, 2), (3, 5)]
    """
    cuts = merge_intervals(b)
    out = []
    for start, end in merge_intervals(a):
        for cut_start, cut_end in cuts:  # both sorted: walk the cuts inside (start, end)
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


# --------------------------------------------------------------------------- classifying

def is_communication(event) -> bool:
    """Whether ``event`` is a collective doing its work (the default ``comm`` classes).

    * ``gloo:*`` ranges (``gloo:all_reduce``, ``gloo:broadcast``, ...): gloo runs each
      collective on a thread of its own, and this range spans the transfer and the reduction.
    * GPU kernels (``cat == "kernel"``) whose name starts with ``nccl``: NCCL's all-reduce,
      all-gather... run as kernels on a stream of their own.

    Not communication: ``c10d::allreduce_`` and NCCL's CPU range ``nccl:all_reduce`` only
    enqueue the work (microseconds on the main thread), and counting them would call the CPU's
    launch time "exposed" while the GPU is busy.
    """
    name = event["name"]
    if name.startswith("gloo:"):
        return True
    return event["cat"] == "kernel" and name.lower().startswith("nccl")


def is_cpu_compute(event) -> bool:
    """Compute on a CPU trace: every aten or autograd op (``cat == "cpu_op"``) that is not a
    ``c10d::`` op (those hand a collective to its backend) nor communication."""
    return (event["cat"] == "cpu_op" and not event["name"].startswith("c10d::")
            and not is_communication(event))


def is_gpu_compute(event) -> bool:
    """Compute on a GPU trace: every GPU kernel that is not communication. Copies and memsets
    (``gpu_memcpy``, ``gpu_memset``) move data and do not count."""
    return event["cat"] == "kernel" and not is_communication(event)


def is_gpu_trace(events) -> bool:
    """Whether the trace holds GPU kernels (recorded with ``ProfilerActivity.CUDA``)."""
    return any(e["cat"] == "kernel" for e in events)


# --------------------------------------------------------------------------- analyses

def exposed_communication(events, *, comm=None, compute=None) -> float:
    """Seconds during which a collective runs and no compute does: the communication that
    overlap did not hide, ``total(union(comm) - union(compute))``.

    ``comm`` and ``compute`` classify an event (a function of the event dict returning a
    bool). By default ``comm`` is :func:`is_communication`, and ``compute`` is
    :func:`is_gpu_compute` on a trace with GPU kernels (the device is what must stay busy;
    the CPU only launches) and :func:`is_cpu_compute` otherwise.

    What "overlapped" means on a CPU with gloo: the all-reduce runs on gloo's own thread, so
    the main thread may go on with backward meanwhile: time covered by both is hidden. Time
    when the main thread runs no op counts as exposed: waiting in DDP for the all-reduce to
    finish, or Python running between ops. Overlap is on the wall clock, not on the cores:
    with more threads than free cores, gloo and backward take turns, and hidden time still
    costs.

    Example::

        >>> events = load_trace(synthetic_trace(steps=3, comm_us=400, exposed=0.5).trace)
        >>> round(exposed_communication(events), 9)     # 3 steps x 200 us left uncovered
        0.0006
    """
    comm = comm or is_communication
    if compute is None:
        compute = is_gpu_compute if is_gpu_trace(events) else is_cpu_compute
    exposed = subtract_intervals(intervals(events, comm), intervals(events, compute))
    return intervals_total(exposed) / US


def _labelled(events, label: str) -> list[dict]:
    """The ``record_function(label)`` ranges of the CPU timeline, in time order. Kineto copies
    a range that launches kernels onto the GPU timeline (``gpu_user_annotation``): the copy
    would count each step twice, so it is left out."""
    found = [e for e in events if e["name"] == label and e["cat"] != "gpu_user_annotation"]
    if not found:
        raise ValueError(f"no {label!r} ranges in this trace: wrap that code in "
                         f"torch.profiler.record_function({label!r}), or name the label "
                         "your trace uses")
    return sorted(found, key=lambda e: e["ts"])


def data_stalls(events, label: str = "data", threshold_s: float = 0.01) -> list[dict]:
    """The data-loading ranges (``record_function(label)``) that took over ``threshold_s``.

    A prefetched batch arrives in well under a millisecond; a range longer than the threshold
    is the training loop waiting for its input. Each stall is ``{"step", "start_s",
    "seconds"}``: ``step`` counts the label's ranges from 0 (the loop's step when it loads one
    batch per step), ``start_s`` is seconds since the trace's first event.

    Example::

        >>> events = load_trace(synthetic_trace(stall_step=1, stall_us=50_000).trace)
        >>> [(s["step"], s["seconds"]) for s in data_stalls(events)]
        [(1, 0.05)]
    """
    if isinstance(threshold_s, bool) or not isinstance(threshold_s, int | float) \
            or not threshold_s >= 0:
        raise ValueError(f"threshold_s must be seconds >= 0, got {threshold_s!r}")
    spans = _labelled(events, label)
    t0 = min(e["ts"] for e in events)
    return [{"step": i, "start_s": (e["ts"] - t0) / US, "seconds": e["dur"] / US}
            for i, e in enumerate(spans) if e["dur"] / US > threshold_s]


def host_syncs(events, names=SYNC_OPS) -> dict:
    """The ops where the host waits for the device: ``count``, ``seconds`` and ``by_name``.

    One ``loss.item()`` on a GPU is three nested events (``aten::item`` calls
    ``aten::_local_scalar_dense``, which calls ``cudaStreamSynchronize``): ``count`` counts
    each outermost one once, and ``seconds`` is the time covered by any of them (the union).
    ``by_name`` maps each name found to its own ``{"count", "seconds"}``, nested ones included.

    Example::

        >>> syncs = host_syncs(load_trace(synthetic_trace(steps=3, gpu=True).trace))
        >>> syncs["count"], syncs["by_name"]["cudaStreamSynchronize"]["count"]
        (3, 3)
    """
    found = [e for e in events if e["name"] in set(names)]
    by_name: dict = {}
    for e in found:
        entry = by_name.setdefault(e["name"], {"count": 0, "seconds": 0.0})
        entry["count"] += 1
        entry["seconds"] += e["dur"] / US
    outer, reach = 0, {}  # per thread, where the last outermost sync op ends
    for e in sorted(found, key=lambda e: (e["ts"], -e["dur"])):  # a parent before its children
        thread = (e["pid"], e["tid"])
        if e["ts"] >= reach.get(thread, float("-inf")):  # not inside the last one: a new sync
            outer += 1
            reach[thread] = e["ts"] + e["dur"]
    return {"count": outer, "seconds": intervals_total(intervals(found)) / US,
            "by_name": by_name}


def step_times(events, label: str = "step") -> list[float]:
    """Seconds of each ``record_function(label)`` range, in order: the training steps."""
    return [e["dur"] / US for e in _labelled(events, label)]


def analyse_trace(events, *, data_label: str = "data", step_label: str = "step",
                  threshold_s: float = 0.01) -> dict:
    """The three findings of a trace and its step time, as one dict.

    ``events``: :func:`load_trace`'s list, or anything it reads (a path, a trace dict).
    Returns ``steps`` and ``step_s`` (their count and median seconds), ``comm_s`` (the time
    a collective runs), ``exposed_comm_s`` (:func:`exposed_communication`),
    ``exposed_fraction`` (their ratio; None without communication), ``stalls``
    (:func:`data_stalls`) and ``syncs`` (:func:`host_syncs`).

    Example::

        >>> record_ddp_trace("traces", steps=4)    # a stall on step 1, an item() each step
        >>> report = analyse_trace("traces/trace-rank0.json")
        >>> [s["step"] for s in report["stalls"]], report["syncs"]["count"]
        ([1], 4)
    """
    events = load_trace(events)  # its own output reads back unchanged
    steps = step_times(events, step_label)
    comm_s = intervals_total(intervals(events, is_communication)) / US
    exposed = exposed_communication(events)
    return {"steps": len(steps), "step_s": statistics.median(steps), "comm_s": comm_s,
            "exposed_comm_s": exposed, "exposed_fraction": exposed / comm_s if comm_s else None,
            "stalls": data_stalls(events, data_label, threshold_s),
            "syncs": host_syncs(events)}


# --------------------------------------------------------------------------- synthetic traces

@dataclasses.dataclass(frozen=True)
class SyntheticTrace:
    """A trace built by :func:`synthetic_trace` and the answers it was built to have.

    ``trace`` is a Chrome trace dict (what :func:`load_trace` reads); ``expected`` holds the
    keys of :func:`analyse_trace` (``stalls`` as the list of stalled steps, ``syncs`` as
    their count), computed from the durations used to build it, not by analysing it.
    """

    trace: dict
    expected: dict


def synthetic_trace(*, steps: int = 3, exposed: float = 0.5, comm_us: float = 400.0,
                    stall_step: int | None = None, stall_us: float = 50_000.0,
                    sync: bool = True, gpu: bool = False,
                    seed: int | None = None) -> SyntheticTrace:
    """A small one-rank trace of ``steps`` DDP steps with known answers.

    Each step is a ``"data"`` range (50 us, or ``stall_us`` on ``stall_step``) then a
    ``"step"`` range: forward, a first part of backward, the enqueue of the all-reduce
    (``c10d::allreduce_``), then the all-reduce (``comm_us``) beside the rest of backward,
    whose length leaves ``exposed`` (0: fully hidden, 1: fully exposed) of the all-reduce
    uncovered; the optimizer starts when both are done; then ``loss.item()`` if ``sync``.
    On a CPU trace (``gpu=False``) the all-reduce is a ``gloo:all_reduce`` range on gloo's
    thread and compute is ``cpu_op`` events; with ``gpu=True`` the same work runs as kernels
    (the all-reduce an ``ncclDevKernel_AllReduce_...`` kernel on its own stream), the CPU ops
    only launch them, NCCL's CPU range ``nccl:all_reduce`` marks the enqueue and the sync ends
    in ``cudaStreamSynchronize``. With a ``seed`` every duration varies (x0.5 to x1.5) from
    step to step, so that no answer can be guessed from another trace.

    Example::

        >>> s = synthetic_trace(exposed=1.0, comm_us=400, steps=3)
        >>> s.expected["exposed_comm_s"]                    # 3 x 400 us, all of it
        0.0012
        >>> abs(analyse_trace(s.trace)["exposed_comm_s"] - 0.0012) < 1e-12
        True
    """
    steps = whole(steps, "steps")
    if isinstance(exposed, bool) or not isinstance(exposed, int | float) \
            or not 0 <= exposed <= 1:
        raise ValueError(f"exposed is the share of the all-reduce left uncovered, from 0 "
                         f"(hidden) to 1 (fully exposed), got {exposed!r}")
    for name, value in (("comm_us", comm_us), ("stall_us", stall_us)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"{name} must be microseconds > 0, got {value!r}")
    if stall_step is not None:
        stall_step = whole(stall_step, "stall_step", low=0)
        if stall_step >= steps:
            raise ValueError(f"stall_step={stall_step} is past the last step: use 0 to "
                             f"{steps - 1}, or None for no stall")
    rng = random.Random(seed)
    vary = (lambda us: us * rng.uniform(0.5, 1.5)) if seed is not None else (lambda us: us)
    build = _Builder(gpu)
    t = 1_000_000.0  # real traces start far from 0: answers must not depend on it
    step_us, comm_total, exposed_total = [], 0.0, 0.0
    for i in range(steps):
        data = stall_us if i == stall_step else 50.0
        build.cpu("data", "user_annotation", t, data)
        build.cpu("aten::randn", "cpu_op", t + data * 0.25, data * 0.5)
        s = t + data
        fwd, bwd1, comm = vary(300.0), vary(200.0), vary(float(comm_us))
        bwd2, opt, item = comm * (1 - exposed), vary(100.0), vary(20.0)
        enqueue = s + fwd + bwd1  # backward's first bucket is ready: its all-reduce starts
        build.work("aten::linear", s, fwd)
        build.work("autograd::engine::evaluate_function: AddmmBackward0", s + fwd, bwd1)
        build.cpu("c10d::allreduce_", "cpu_op", enqueue, 10.0)
        if gpu:
            build.cpu("nccl:all_reduce", "user_annotation", enqueue + 1, 8.0)
        begin = enqueue + 10.0
        build.comm(begin, comm)
        if bwd2 > 0:
            build.work("autograd::engine::evaluate_function: ReluBackward0", begin, bwd2)
        after = begin + max(comm, bwd2)  # DDP waits for the all-reduce before the optimizer
        build.work("aten::add_", after, opt)
        end = after + opt
        if sync:
            build.item(end, item)
            end += item
        build.cpu("step", "user_annotation", s, end - s)
        if gpu:
            build.gpu("step", "gpu_user_annotation", s, end - s, stream=7)
        step_us.append(end - s)
        comm_total += comm
        exposed_total += comm - min(comm, bwd2)
        t = end + 5.0
    expected = {"steps": steps, "step_s": statistics.median(step_us) / US,
                "comm_s": comm_total / US, "exposed_comm_s": exposed_total / US,
                "exposed_fraction": exposed_total / comm_total,
                "stalls": [] if stall_step is None else [stall_step],
                "syncs": steps if sync else 0}
    return SyntheticTrace({"traceEvents": build.events, "displayTimeUnit": "ms"}, expected)


class _Builder:
    """The events of :func:`synthetic_trace`, laid out as torch's profiler lays them out."""

    PID, MAIN, GLOO = 4242, 4242, 4250  # one process: its main thread and gloo's thread

    def __init__(self, gpu: bool):
        self.gpu_trace = gpu
        self.events = [{"ph": "M", "name": "thread_name", "pid": self.PID, "tid": self.GLOO,
                        "args": {"name": "pt_gloo_runloop"}}]

    def cpu(self, name, cat, ts, dur, tid=None):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": self.PID,
                            "tid": self.MAIN if tid is None else tid, "ts": ts, "dur": dur,
                            "args": {}})

    def gpu(self, name, cat, ts, dur, stream):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream,
                            "ts": ts, "dur": dur, "args": {"stream": stream}})

    def work(self, name, ts, dur):
        """An op; with a GPU, it launches a kernel that runs as long (launches are instant)."""
        self.cpu(name, "cpu_op", ts, dur)
        self.cpu("aten::mm", "cpu_op", ts + dur * 0.1, dur * 0.8)  # ops nest in ops
        if self.gpu_trace:
            self.cpu("cudaLaunchKernel", "cuda_runtime", ts + dur * 0.2, dur * 0.1)
            self.gpu("void at::native::elementwise_kernel<128, 4>", "kernel", ts, dur, 7)

    def comm(self, ts, dur):
        if self.gpu_trace:
            self.gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                     "kernel", ts, dur, stream=20)
        else:
            self.cpu("gloo:all_reduce", "user_annotation", ts, dur, tid=self.GLOO)

    def item(self, ts, dur):
        """``loss.item()``: three nested events on a GPU, two on a CPU."""
        self.cpu("aten::item", "cpu_op", ts, dur)
        self.cpu("aten::_local_scalar_dense", "cpu_op", ts + dur * 0.1, dur * 0.8)
        if self.gpu_trace:
            self.cpu("cudaStreamSynchronize", "cuda_runtime", ts + dur * 0.2, dur * 0.6)
            self.gpu("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", ts + dur * 0.2,
                     dur * 0.1, stream=7)

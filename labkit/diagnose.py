"""Faults of distributed training, reproduced on purpose, and the tools that diagnose them.

One room past 800 lines on purpose: each fault of notebook 05 is reproduced, detected and fixed
by functions that must agree with one another, and the notebook reads them side by side.

Notebook 05 runs each fault the way it happens in real code, shows how it fails, and fixes
it. Two kinds of functions live here:

* **fault scenarios** (``skipped_allreduce``, ``crash_on_rank``, ``mismatched_shapes``,
  ``nan_on_rank``, ``training_fingerprints``, ``early_stopping``), small worker functions for
  :func:`labkit.launch`, each with a switch that turns the diagnosis tool or the fix on;
* **diagnosis tools** a learner reuses in real training code: :func:`nonfinite_ranks`,
  :func:`check_finite` and :func:`all_finite` (a NaN on one rank, named on every rank),
  :func:`check_same_shape`, :func:`common_steps` (every rank runs as many collectives),
  :func:`fingerprint` and :func:`make_deterministic` (runs that repeat bit for bit),
  :func:`collectives_in_log` and :func:`first_mismatch` (reading
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` logs), :func:`flight_recorder` and
  :func:`dump_flight_recorder` (the collectives each rank has issued, from torch's flight
  recorder, printable while a rank hangs), :func:`small_shm_support` and
  :func:`shm_dataloader` (DataLoader workers under a small ``/dev/shm``, as in Docker).

The collective tools work on any process group (gloo or NCCL) and, without one, on the one
process that calls them; every rank of the group must call them, as any collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

from ._display import hang
from ._dist import collective_device
from ._sizes import whole

__all__ = [
    "DEBUG_ENV",
    "RECORDER_ENV",
    "NotFiniteError",
    "ShapeMismatchError",
    "nonfinite_ranks",
    "check_finite",
    "all_finite",
    "check_same_shape",
    "common_steps",
    "fingerprint",
    "make_deterministic",
    "collectives_in_log",
    "first_mismatch",
    "flight_recorder",
    "dump_flight_recorder",
    "ShmRun",
    "small_shm_support",
    "shm_dataloader",
    "skipped_allreduce",
    "crash_on_rank",
    "mismatched_shapes",
    "nan_on_rank",
    "training_fingerprints",
    "early_stopping",
    "loss_over_ranks",
]

# What a learner sets (through ``labkit.launch(..., env=DEBUG_ENV)``) to make the process group
# check every collective and log it: DETAIL wraps the backend in a checker that compares op,
# shapes and dtypes across ranks before each collective; INFO lets its C++ log lines through.
DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "TORCH_CPP_LOG_LEVEL": "INFO"}
# The flight recorder: each rank keeps its last N collectives (gloo and NCCL), at no real cost.
# (Older torch releases know only TORCH_NCCL_TRACE_BUFFER_SIZE, still accepted as a deprecated
# alias.)
RECORDER_ENV = {"TORCH_FR_BUFFER_SIZE": "2000"}


class NotFiniteError(FloatingPointError):
    """A value went NaN or inf on some rank; raised on every rank. ``ranks`` names where."""

    # Defaults let the exception be unpickled (it travels from a worker to the notebook).
    def __init__(self, message: str, *, ranks: list[int] | None = None, name: str = "", step=None):
        super().__init__(message)
        self.ranks = ranks or []
        self.name = name
        self.step = step


class ShapeMismatchError(RuntimeError):
    """Ranks passed tensors of different shapes or dtypes; raised on every rank."""

    def __init__(self, message: str, *, ranks: list[int] | None = None,
                 shapes: dict[int, tuple] | None = None):
        super().__init__(message)
        self.ranks = ranks or []
        self.shapes = shapes or {}


# ------------------------------------------------------------------------- process-group helpers


def _group_info(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``, or (0, 1) without an initialised process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _as_tensor(value, what: str):
    """A tensor view of a tensor or a Python/NumPy number; a clear error for anything else."""
    import numbers

    import torch

    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return torch.tensor(value)
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        return torch.as_tensor(value)
    raise ValueError(f"{what} takes a tensor or a number (e.g. the loss tensor), got "
                     f"{type(value).__name__} {value!r:.60}: pass the tensor itself")


def _check_name(name) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string that says what is checked (e.g. "
                         f"'loss'), got {name!r}")
    return name


def nonfinite_ranks(value, *, group=None) -> list[int]:
    """The ranks on which ``value`` holds a NaN or an inf: the same list on every rank.

    ``[]`` when the value is finite everywhere. Each rank looks at its own value and sets its
    own slot of a tensor of ``world_size`` flags; one SUM all-reduce gives every rank every
    slot. Every rank must call it, finite or not (it is a collective): that call is how the
    ranks whose value is fine learn that another's is not. :func:`check_finite` raises on
    its answer, :func:`all_finite` skips on it.

    Example::

        >>> diagnose.nonfinite_ranks(loss)      # on every rank, when rank 1's loss is NaN
        [1]
    """
    import torch
    import torch.distributed as dist

    local_bad = not bool(torch.isfinite(_as_tensor(value, "nonfinite_ranks")).all())
    rank, world = _group_info(group)
    flags = torch.zeros(world, dtype=torch.int32, device=collective_device(group, required=False))
    flags[rank] = int(local_bad)  # a flag tensor of its own: the value itself stays untouched
    if world > 1:
        dist.all_reduce(flags, group=group)
    return [r for r, bad in enumerate(flags.tolist()) if bad]


def check_finite(value, name: str = "loss", *, step=None, group=None) -> None:
    """Raise :class:`NotFiniteError` on *every* rank if ``value`` is NaN or inf on *any* rank.

    A NaN on one rank does not stay there: DDP averages the gradients, so one rank's NaN
    turns every rank's weights into NaN one step later, and each rank's own
    ``torch.isfinite`` check then blames itself. Checking before ``backward()`` with one tiny
    all-reduce names the rank (and step) where it began, and since every rank raises
    together, no rank is left waiting in the next collective. A collective: every rank of
    ``group`` must call it.

    Example::

        >>> loss = criterion(model(x), y)
        >>> diagnose.check_finite(loss, "loss", step=step)   # before loss.backward()
        NotFiniteError: loss is not finite (NaN or inf) on rank(s) 1 at step 2 (of 2 rank(s)); ...
    """
    name = _check_name(name)
    bad = nonfinite_ranks(_as_tensor(value, "check_finite"), group=group)
    if bad:
        _, world = _group_info(group)
        at = f" at step {step}" if step is not None else ""
        raise NotFiniteError(
            f"{name} is not finite (NaN or inf) on rank(s) {', '.join(map(str, bad))}{at} "
            f"(of {world} rank(s)); this is raised on every rank. Look at what rank "
            f"{bad[0]} loaded at that step (a corrupt sample, a log of 0, a division by a zero "
            "count), or skip the step on every rank together with all_finite()",
            ranks=bad, name=name, step=step)


def all_finite(value, *, group=None) -> bool:
    """True on every rank when ``value`` is finite on all ranks, False on every rank otherwise.

    The same answer everywhere is the point: a rank that skipped its optimizer step alone
    would make one all-reduce fewer than the others and hang them (this is how
    ``torch.amp.GradScaler`` skips steps with inf gradients). A collective.

    Example::

        >>> if not diagnose.all_finite(loss):   # every rank skips this batch together
        ...     continue
    """
    return not nonfinite_ranks(_as_tensor(value, "all_finite"), group=group)


def check_same_shape(tensor, name: str = "tensor", *, group=None) -> None:
    """Raise :class:`ShapeMismatchError` on every rank unless all ranks hold one shape and dtype.

    Collectives assume identical shapes and trust the caller: gloo fails with a message
    about byte counts, NCCL can hang or reduce garbage. Call this right before a suspicious
    collective; it exchanges only the shapes (``all_gather_object``) and names each rank
    that differs from rank 0. A collective.

    Example::

        >>> counts = torch.bincount(labels, minlength=10)   # without minlength: rank-dependent
        >>> diagnose.check_same_shape(counts, "counts")
        >>> dist.all_reduce(counts)
    """
    import torch
    import torch.distributed as dist

    name = _check_name(name)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"check_same_shape takes the tensor you are about to pass to a "
                         f"collective, got {type(tensor).__name__}")
    mine = (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
    rank, world = _group_info(group)
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    differ = [r for r, seen in enumerate(everyone) if seen != everyone[0]]
    if differ:
        listing = "; ".join(f"rank {r}: shape {tuple(s)} {d}" for r, (s, d) in enumerate(everyone))
        raise ShapeMismatchError(
            f"{name} differs across ranks ({listing}): rank(s) {', '.join(map(str, differ))} "
            "differ from rank 0, and a collective needs the same shape and dtype on every rank. "
            "Make the shape independent of the rank's data (bincount(..., minlength=n), pad the "
            "last batch, or drop_last=True in the sampler)",
            ranks=differ, shapes={r: tuple(s) for r, (s, _) in enumerate(everyone)})


def common_steps(n: int, *, group=None) -> int:
    """The number of steps every rank can take: the smallest ``n`` over the ranks.

    Each training step issues collectives (DDP's gradient all-reduce); a rank with one batch
    more than the others issues one collective more, and waits in it forever. Use it when
    ranks hold different amounts of data and you do not use ``DistributedSampler(...,
    drop_last=True)``. A collective.

    Example::

        >>> steps = diagnose.common_steps(len(my_loader))
        >>> for _, (x, y) in zip(range(steps), my_loader):
        ...     train_step(x, y)
    """
    import torch
    import torch.distributed as dist

    n = whole(n, "n", low=0, hint=": common_steps takes this rank's number of steps "
                                  "(e.g. len(loader))")
    _, world = _group_info(group)
    if world == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=collective_device(group, required=False))
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


# --------------------------------------------------------------------------------- determinism


def fingerprint(obj) -> str:
    """A short hash of a model's weights, a tensor, a state dict or a sequence (e.g. a batch order).

    Two runs that should be identical are identical when their fingerprints match: compare
    the fingerprint of the trained model (or of the order a sampler produced) across runs
    or ranks instead of eyeballing numbers. Equal values give equal fingerprints in any
    process; a single flipped bit changes it.

    Example::

        >>> diagnose.fingerprint(model)              # after training, in two runs
        'a41f09c2be77'
        >>> diagnose.fingerprint(list(sampler))      # the order of one epoch
        '03d5c4e1f9aa'
    """
    digest = hashlib.sha256()
    _feed(digest, obj, "fingerprint")
    return digest.hexdigest()[:12]


def _feed(digest, obj, where: str) -> None:
    """Hash ``obj`` into ``digest`` by value (bytes, dtype, shape), recursively."""
    import numbers

    import torch

    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            digest.update(f"K{key}".encode())
            _feed(digest, obj[key], f"{where}[{key!r}]")
    elif isinstance(obj, list | tuple | range):
        digest.update(f"L{len(obj)}".encode())
        for i, item in enumerate(obj):
            _feed(digest, item, f"{where}[{i}]")
    elif isinstance(obj, bool | numbers.Number):
        digest.update(f"N{obj!r}".encode())
    elif type(obj).__module__ == "numpy" and hasattr(obj, "dtype"):
        _feed(digest, torch.as_tensor(obj), where)
    else:
        raise ValueError(
            f"{where}: cannot fingerprint {type(obj).__name__}; pass a model, a tensor, a state "
            "dict, or a list of numbers/tensors (for a sampler or DataLoader, pass "
            "list(sampler), or the list of batches)")


def make_deterministic(seed: int, *, warn_only: bool = False) -> int:
    """Seed every random generator and ask torch for deterministic algorithms; returns ``seed``.

    Runs differ for three reasons: unseeded generators (Python's ``random``, NumPy and torch
    each seed themselves from the operating system at start-up), algorithms that add in a
    different order every time (CUDA atomics in scatter/index_add backward, cuDNN's
    benchmark autotuner picking a different kernel), and data order (a sampler whose epoch
    is not set). This fixes the first two, for this process; pass ``seed + rank`` to give the
    ranks different but repeatable augmentation streams (DDP copies rank 0's weights anyway).
    With ``warn_only=False`` an op with no deterministic version raises instead of warning.

    Example::

        >>> diagnose.make_deterministic(1234 + dist.get_rank())
        1235
    """
    import random

    import numpy as np
    import torch

    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be a whole number in [0, 2**32), got {seed!r} "
                         "(e.g. 1234 + dist.get_rank())")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    # cuBLAS picks reduction splits by workspace; a fixed workspace makes them repeatable
    # (read when cuBLAS starts, so before the first CUDA matmul of the process).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    return seed


# ------------------------------------------------------------------------------ reading the logs

# ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) logs each collective before it runs:
#   [Rank 0] Running collective: CollectiveFingerPrint(SequenceNumber=3, OpType=ALLREDUCE,
#   TensorShape=[4], TensorDtypes=Float, TensorDeviceTypes=...)
# (a collective without tensors prints "SequenceNumber=3OpType=BARRIER", with no separator).
_FINGERPRINT = re.compile(
    r"Running collective: CollectiveFingerPrint\(SequenceNumber=(?P<seq>\d+),? ?"
    r"OpType=(?P<op>\w+)(?:, TensorShape=(?P<shape>\[[^\]]*\]))?(?:, TensorDtypes=(?P<dtype>\w+))?")
# dump_flight_recorder() prints one line per entry:
#   [flight recorder] #4 gloo:all_reduce [[4]] not completed at .../train.py:51 in step
_RECORD = re.compile(r"\[flight recorder\] #(?P<seq>\d+) (?P<op>\S+) (?P<shape>\[.*?\]) "
                     r"(?P<state>completed|not completed)")
LOG_SOURCES = ("detail", "flight recorder")


def collectives_in_log(logs: dict, source: str = "detail") -> dict[int, list[dict]]:
    """The collectives each rank logged, in the order it issued them, read from a run's logs.

    ``logs`` is ``result.logs`` or a ``LaunchError``'s ``.logs`` (rank -> lines).
    ``source="detail"`` reads the lines of a run with ``env=diagnose.DEBUG_ENV``
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``): entries ``{"seq", "op", "shape", "dtype"}``.
    ``source="flight recorder"`` reads what :func:`dump_flight_recorder` printed: entries
    ``{"seq", "op", "shape", "completed"}``. The last entry of a stuck rank is where it waits.

    Example::

        >>> diagnose.collectives_in_log(err.logs)[1][-1]
        {'seq': 3, 'op': 'ALLREDUCE', 'shape': '[4]', 'dtype': 'Float'}
    """
    if not isinstance(logs, dict):
        raise ValueError(f"collectives_in_log takes a rank -> lines dict (result.logs or "
                         f"error.logs), got {type(logs).__name__}")
    if source not in LOG_SOURCES:
        raise ValueError(f"unknown source {source!r}: use 'detail' (TORCH_DISTRIBUTED_DEBUG=DETAIL "
                         "lines) or 'flight recorder' (dump_flight_recorder lines)")
    out: dict[int, list[dict]] = {}
    for rank, lines in sorted(logs.items()):
        if isinstance(lines, str):
            raise ValueError(f"logs[{rank!r}] is one string: pass a list of lines "
                             "(result.logs is already in that form)")
        found = []
        for line in lines:
            if source == "detail" and (m := _FINGERPRINT.search(line)):
                found.append({"seq": int(m["seq"]), "op": m["op"], "shape": m["shape"],
                              "dtype": m["dtype"]})
            elif source == "flight recorder" and (m := _RECORD.search(line)):
                found.append({"seq": int(m["seq"]), "op": m["op"],
                              "shape": None if m["shape"] == "[]" else m["shape"],
                              "completed": m["state"] == "completed"})
        out[rank] = found
    return out


def first_mismatch(collectives: dict[int, list[dict]]) -> dict | None:
    """The first sequence number at which the ranks' collectives differ, or None if they agree.

    Takes :func:`collectives_in_log`'s result (or :func:`flight_recorder` entries in the same
    form); a rank that issued nothing at that number shows as ``None``. Returns
    ``{"seq": n, "ops": {rank: "ALLREDUCE [4]" or None}}``.

    Example::

        >>> diagnose.first_mismatch(diagnose.collectives_in_log(err.logs))
        {'seq': 4, 'ops': {0: 'BARRIER', 1: 'ALLREDUCE [4]'}}
    """
    if not isinstance(collectives, dict):
        raise ValueError("first_mismatch takes collectives_in_log(logs)'s result, a rank -> list "
                         f"of collectives dict, got {type(collectives).__name__}")
    by_rank = {r: {c["seq"]: _describe(c) for c in calls} for r, calls in collectives.items()}
    seqs = sorted(set().union(*by_rank.values())) if by_rank else []
    for seq in seqs:
        ops = {r: calls.get(seq) for r, calls in sorted(by_rank.items())}
        if len(set(ops.values())) > 1:
            return {"seq": seq, "ops": ops}
    return None


def _describe(call: dict) -> str:
    return f"{call['op']} {call['shape']}" if call.get("shape") else call["op"]


def flight_recorder(*, stacks: bool = False) -> list[dict]:
    """The collectives this rank issued, as torch's flight recorder kept them (oldest first).

    It records gloo and NCCL collectives alike, by default in recent torch (2.14 here);
    ``TORCH_FR_BUFFER_SIZE`` in the run's environment (e.g. ``diagnose.RECORDER_ENV``) sets
    how many entries are kept and turns it on where the default is off. Entries:
    ``{"seq", "op", "shape", "completed", "where"}``; ``where``, the line of code that issued
    the collective, is filled with ``stacks=True`` (the first such dump imports
    ``torch._dynamo``, seconds on a small machine). On a hang the ranks' lists part at the
    collective one rank issued and the other did not, and the stuck rank's last entry never
    completed. On NCCL the watchdog also writes this dump on a
    timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1``), to be compared with
    ``python -m torch.distributed.flight_recorder.fr_trace``.

    Example::

        >>> labkit.launch(step, env=diagnose.RECORDER_ENV)
        >>> diagnose.flight_recorder()[-1]          # inside the worker
        {'seq': 4, 'op': 'gloo:all_reduce', 'shape': '[[4]]', 'completed': False, 'where': ''}
    """
    import pickle

    import torch

    c10d = torch._C._distributed_c10d
    cuda = collective_device(required=False).type == "cuda"
    dump = getattr(c10d, "_dump_nccl_trace", None) if cuda else None
    dump = dump or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        raise RuntimeError("this torch build has no flight recorder (torch >= 2.5 has one)")
    raw = pickle.loads(dump(True, bool(stacks), False))
    # gloo leaves each entry's state at "scheduled"; the group's counter says what completed.
    done = {str(pg): status.get("last_completed_collective", -1)
            for pg, status in raw.get("pg_status", {}).items()}
    out = []
    for e in raw.get("entries", []):
        seq = e.get("collective_seq_id")
        completed = e.get("state") == "completed" or seq <= done.get(str(e.get("pg_id")), -1)
        out.append({"seq": seq, "op": e.get("profiling_name"), "shape": str(e.get("input_sizes")),
                    "completed": completed,
                    "where": _user_frame(e.get("frames", [])) if stacks else ""})
    return out


def _user_frame(frames: list) -> str:
    """The first frame outside torch and labkit's shim: the line that issued the collective."""
    for f in frames:
        name = f.get("filename", "")
        if ("/torch/" not in name and not name.endswith("labkit/_worker.py")
                and "<frozen" not in name):
            return f"{name}:{f.get('line')} in {f.get('name')}"
    return "(no frame outside torch)"


def dump_flight_recorder(after: float | None = None, *, stacks: bool = False):
    """Print this rank's flight recorder, one line per collective; after ``after`` s in a thread.

    A hung rank cannot print anything itself: it is blocked in the collective. With
    ``after``, a daemon thread prints the record that many seconds later, whatever the main
    thread is doing (collectives wait without holding the GIL), the way NCCL's watchdog dumps
    it on a timeout. ``stacks=True`` adds the line of code that issued each collective.
    Read the lines back with ``collectives_in_log(logs, "flight recorder")``.
    Returns the thread (or None when printing at once).

    Example::

        >>> diagnose.dump_flight_recorder(after=5.0, stacks=True)   # at the start of the worker
        [flight recorder] #1 gloo:all_reduce [[4]] completed at train.py:31 in step
    """
    import threading

    if after is not None and not (isinstance(after, int | float) and after >= 0):
        raise ValueError(f"after must be a number of seconds >= 0 (or None for now), got {after!r}")

    def dump():
        lines = [f"[flight recorder] #{e['seq']} {e['op']} {e['shape'].replace(' ', '')} "
                 f"{'completed' if e['completed'] else 'not completed'}"
                 + (f" at {e['where']}" if e["where"] else "")
                 for e in flight_recorder(stacks=stacks)]
        print("\n".join(lines) or "[flight recorder] empty: set TORCH_FR_BUFFER_SIZE", flush=True)

    if after is None:
        dump()
        return None

    def later():
        start = time.monotonic()
        if stacks:
            # The first dump with stacks imports torch._dynamo (seconds on a small machine):
            # do it while the main thread works or hangs, not after the delay.
            import torch._dynamo  # noqa: F401
        time.sleep(max(0.0, after - (time.monotonic() - start)))
        dump()

    thread = threading.Thread(target=later, name="labkit-flight-recorder", daemon=True)
    thread.start()
    return thread


# ----------------------------------------------------------------------- shared memory (/dev/shm)


@dataclasses.dataclass
class ShmRun:
    """One DataLoader run in a child process: did it finish, and if not, the error it showed."""

    ok: bool
    error: str
    output: str
    shm_mb: int | None
    num_workers: int
    sharing_strategy: str | None
    batch_mb: float
    seconds: float

    def __str__(self) -> str:
        where = f"/dev/shm of {self.shm_mb} MB" if self.shm_mb else "this machine's /dev/shm"
        how = f"num_workers={self.num_workers}" + (
            f", sharing strategy {self.sharing_strategy}" if self.sharing_strategy else "")
        said = f"DataLoader ({how}, {self.batch_mb:g} MB batches) on {where}: "
        return said + "finished" if self.ok else said + "FAILED:\n" + hang("  ", str(self.error))


# Each way of getting a private /dev/shm, tried in order: a mount namespace (root with
# CAP_SYS_ADMIN), then a user namespace in which we are root (an unprivileged user on a
# laptop). The tmpfs exists only in the child's namespace and vanishes with it, so nothing
# on the machine changes and nothing is left behind.
_UNSHARE_WAYS = (("--mount",), ("--user", "--map-root-user", "--mount"))
_MOUNT = 'mount -t tmpfs -o size="$LABKIT_SHM_MB"m tmpfs /dev/shm && exec "$@"'
_support_cache: dict = {}


def small_shm_support() -> tuple[bool, str]:
    """Whether :func:`shm_dataloader` can give a child process a small ``/dev/shm`` here, and why.

    It needs ``unshare`` (util-linux) and the right to mount a tmpfs in a new mount
    namespace: root with CAP_SYS_ADMIN, or unprivileged user namespaces. A default Docker
    container has neither (its seccomp profile blocks both), which is fine: there /dev/shm
    is *already* small (64 MB), and the failure shows with real batch sizes.

    Example::

        >>> diagnose.small_shm_support()
        (True, 'a private tmpfs on /dev/shm via unshare --mount')
    """
    if "answer" not in _support_cache:
        _support_cache["answer"] = _probe_shm_support()
    ok, why, _ = _support_cache["answer"]
    return ok, why


def _probe_shm_support() -> tuple[bool, str, list[str] | None]:
    """Try each namespace recipe with a 1 MB tmpfs; the working command prefix, or what failed."""
    if not sys.platform.startswith("linux"):
        return False, f"/dev/shm limits are a Linux feature; this is {sys.platform}", None
    unshare = shutil.which("unshare")
    if unshare is None:
        return False, "the `unshare` command (util-linux) is not installed", None
    errors = []
    for way in _UNSHARE_WAYS:
        cmd = [unshare, *way, "sh", "-c", _MOUNT, "sh", "true"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                                 env=dict(os.environ, LABKIT_SHM_MB="1"))
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(f"unshare {' '.join(way)}: {exc}")
            continue
        if out.returncode == 0:
            return True, f"a private tmpfs on /dev/shm via unshare {' '.join(way)}", [unshare, *way]
        reason = (out.stderr.strip() or "failed").splitlines()[-1]
        errors.append(f"unshare {' '.join(way)}: {reason}")
    return False, ("cannot mount a private /dev/shm here (no CAP_SYS_ADMIN and no user "
                   "namespaces, as in a default Docker container): " + "; ".join(errors)), None


# The child: a DataLoader whose workers collate batches of `batch_mb` into shared memory, as
# every DataLoader with num_workers > 0 does (the batch travels to the main process that way).
_CHILD = r"""
import json, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
cfg = json.loads(sys.argv[1])
if cfg["strategy"]:
    torch.multiprocessing.set_sharing_strategy(cfg["strategy"])
per_sample = max(1, int(cfg["batch_mb"] * 2**20 / 4 / cfg["batch_size"]))

class Images(Dataset):
    def __len__(self):
        return cfg["batches"] * cfg["batch_size"]
    def __getitem__(self, i):
        return torch.full((per_sample,), float(i))

loader = DataLoader(Images(), batch_size=cfg["batch_size"], num_workers=cfg["num_workers"])
seen = 0
for batch in loader:
    seen += 1
print("LABKIT-SHM-OK", seen, flush=True)
"""


def shm_dataloader(*, shm_mb: int | None = None, num_workers: int = 2, batch_mb: float = 16,
                   batches: int = 8, sharing_strategy: str | None = None,
                   timeout: float = 120) -> ShmRun:
    """Run a DataLoader in a child process, optionally with only ``shm_mb`` MB of ``/dev/shm``.

    DataLoader workers hand each batch to the main process through shared memory
    (``/dev/shm``); with ``num_workers`` workers and a prefetch factor of 2, about
    ``2 * num_workers`` batches are there at once. Docker gives a container 64 MB of it, so
    real image batches do not fit: torch 2.14 fails with "unable to allocate shared
    memory(shm) ... No space left on device"; where the space is not reserved up front, the
    worker dies of a bus error instead. ``shm_mb`` reproduces that limit with a private tmpfs
    (see :func:`small_shm_support`); ``None`` uses the machine's own. Returns a
    :class:`ShmRun`; the fixes are ``docker run --shm-size=8g`` (or ``--ipc=host``), i.e. a
    larger ``shm_mb``, and ``num_workers=0``.

    Example::

        >>> diagnose.shm_dataloader(shm_mb=8, batch_mb=16).ok
        False
        >>> diagnose.shm_dataloader(shm_mb=8, batch_mb=16, num_workers=0).ok
        True
    """
    import torch.multiprocessing as mp

    if shm_mb is not None:
        shm_mb = whole(shm_mb, "shm_mb", hint=": a size in MB (Docker's default is 64), or None "
                                              "for this machine's /dev/shm")
    num_workers = whole(num_workers, "num_workers", low=0,
                        hint=" (0 loads in the main process)")
    if not batch_mb > 0:
        raise ValueError(f"batch_mb must be > 0, got {batch_mb!r}")
    batches = whole(batches, "batches")
    if not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if sharing_strategy is not None and sharing_strategy not in mp.get_all_sharing_strategies():
        raise ValueError(f"unknown sharing strategy {sharing_strategy!r}: use one of "
                         f"{', '.join(sorted(mp.get_all_sharing_strategies()))}, or None")
    cfg = {"strategy": sharing_strategy, "batch_mb": batch_mb, "batch_size": 16,
           "batches": batches, "num_workers": num_workers}
    cmd = [sys.executable, "-c", _CHILD, json.dumps(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if shm_mb is not None:
        ok, why = small_shm_support()
        if not ok:
            raise RuntimeError(f"cannot limit /dev/shm here: {why}. Run the DataLoader in a "
                               "container started with --shm-size=64m to see the failure")
        cmd = [*_support_cache["answer"][2], "sh", "-c", _MOUNT, "sh", *cmd]
        env["LABKIT_SHM_MB"] = str(shm_mb)
    start = time.monotonic()
    # A session of its own: on a timeout the whole group goes, DataLoader workers included.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        text, _ = proc.communicate()
        text, code = text + f"\n(timed out after {timeout:g} s)", -1
    ok = code == 0 and "LABKIT-SHM-OK" in text
    return ShmRun(ok, "" if ok else _key_error(text), text, shm_mb, num_workers,
                  sharing_strategy, batch_mb, time.monotonic() - start)


def _key_error(text: str) -> str:
    """The line of a failed run that says what happened (the exception, else the last line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", ln):
            return ln
    return lines[-1] if lines else "no output"


# ------------------------------------------------------------------------------ fault scenarios


def skipped_allreduce(batches: int = 3, *, extra_rank: int = 1, sync: str = "barrier",
                      fixed: bool = False, monitor_timeout: float = 2.0,
                      dump_after: float | None = None) -> int:
    """A hang: rank ``extra_rank`` holds one batch more, so it makes one all_reduce more.

    The data was split by hand (not with ``DistributedSampler(drop_last=True)``), one rank
    got a batch more, and its extra step's gradient all-reduce has no partner: it waits
    there while the others wait at the end-of-epoch ``sync``: ``"barrier"``, a
    ``"monitored"`` barrier (which names the rank that never came) or ``"none"`` (the others
    simply return). ``fixed=True`` agrees on :func:`common_steps` first. ``dump_after``
    prints the flight recorder that many seconds in (:func:`dump_flight_recorder`). Returns
    the number of steps this rank took.

    Example::

        >>> labkit.launch(diagnose.skipped_allreduce, timeout=20)          # LaunchTimeout
        >>> labkit.launch(diagnose.skipped_allreduce, env=diagnose.DEBUG_ENV)  # names it
        >>> labkit.launch(diagnose.skipped_allreduce, fixed=True).values
        [3, 3]
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if sync not in ("barrier", "monitored", "none"):
        raise ValueError(f"unknown sync {sync!r}: use 'barrier', 'monitored' or 'none'")
    if dump_after is not None:
        dump_flight_recorder(after=dump_after)
    rank = dist.get_rank()
    steps = batches + (rank == extra_rank)  # the uneven split
    if fixed:
        steps = common_steps(steps)
    for step in range(steps):
        grad = torch.full((4,), float(rank + step), device=collective_device(required=False))
        dist.all_reduce(grad)  # one rank's last all_reduce has no partner
    if sync == "monitored":
        dist.monitored_barrier(timeout=timedelta(seconds=monitor_timeout), wait_all_ranks=True)
    elif sync == "barrier":
        dist.barrier()  # the end of the epoch
    return steps


def crash_on_rank(steps: int = 3, *, bad_rank: int = 1, bad_step: int = 1,
                  fixed: bool = False) -> float:
    """A crash: one rank's batch holds a label out of range, and only that rank raises.

    The others are already waiting in the next all-reduce when it dies; what they report
    (a closed connection) is a consequence, not the cause. ``fixed=True`` drops the bad
    label (the fix a learner makes after reading rank ``bad_rank``'s traceback). Returns the
    last averaged loss.

    Example::

        >>> labkit.launch(diagnose.crash_on_rank)   # LaunchError: rank 1 failed with IndexError
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    loss = torch.zeros(1)
    for step in range(steps):
        logits = torch.randn(8, 10, generator=gen)
        labels = torch.randint(0, 10, (8,), generator=gen)
        if rank == bad_rank and step == bad_step and not fixed:
            labels[3] = 10  # a mislabelled sample: class 10 of 10 classes
        loss = F.cross_entropy(logits, labels).reshape(1)
        dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def mismatched_shapes(*, check: bool = False, fixed: bool = False, classes: int = 10) -> list:
    """Shapes that differ: each rank counts its labels with ``bincount`` and all-reduces the counts.

    ``torch.bincount`` returns ``max(label) + 1`` bins, so a rank whose shard lacks the
    highest class returns a shorter tensor than its peers, and the all-reduce is handed
    different sizes: gloo then fails, hangs on one rank or returns a wrong sum, depending on
    the sizes (NCCL does not even check). ``check=True`` calls :func:`check_same_shape` first;
    ``fixed=True`` uses ``minlength=classes``. Prints and returns the summed counts.

    Example::

        >>> labkit.launch(diagnose.mismatched_shapes, fixed=True).values[0]
        [...]                      # the class counts over all ranks
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    top = classes - 1 - (rank % 2)  # odd ranks never see the last class
    labels = torch.arange(0, top + 1).repeat(3)
    counts = torch.bincount(labels, minlength=classes if fixed else 0)
    if check:
        check_same_shape(counts, "counts")
    dist.all_reduce(counts)
    print(f"class counts over all ranks: {counts.tolist()}", flush=True)
    return counts.tolist()


def nan_on_rank(steps: int = 4, *, bad_rank: int = 1, bad_step: int = 2,
                mode: str = "plain") -> dict:
    """A loss that goes NaN on one rank, under DDP: the NaN spreads to every rank's weights.

    Rank ``bad_rank`` meets a corrupt sample (an inf in the input) at ``bad_step``.
    ``mode="plain"`` trains on: after the gradient all-reduce every rank's weights are NaN,
    and a local check on any rank would blame that rank. ``mode="check"`` calls
    :func:`check_finite` before ``backward``, which raises on every rank naming the culprit;
    ``mode="skip"`` uses :func:`all_finite` so every rank skips that step together (what
    ``GradScaler`` does). Returns ``{"finite": weights still finite, "skipped": steps}``.

    Example::

        >>> labkit.launch(diagnose.nan_on_rank).values[0]["finite"]
        False
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if mode not in ("plain", "check", "skip"):
        raise ValueError(f"unknown mode {mode!r}: use 'plain', 'check' or 'skip'")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    skipped = []
    for step in range(steps):
        x = torch.randn(8, 4, generator=gen)
        if rank == bad_rank and step == bad_step:
            x[0, 0] = float("inf")  # a corrupt sample
        loss = model(x).pow(2).mean()
        if mode == "check":
            check_finite(loss, "loss", step=step)
        elif mode == "skip" and not all_finite(loss):
            skipped.append(step)
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"finite": finite, "skipped": skipped}


def training_fingerprints(*, seed: int | None = None, epochs: int = 2, set_epoch: bool = True,
                          samples: int = 64) -> dict:
    """Train a small DDP model with random augmentation; fingerprint the weights and the data order.

    The initial weights come from torch's generator and the augmentation noise from NumPy's,
    as in most training code; both seed themselves from the operating system when the
    process starts, so without ``seed`` two runs differ (the sampler's order does not: it is
    seeded). ``seed`` calls :func:`make_deterministic` (``seed + rank``). ``set_epoch=False``
    leaves the sampler at epoch 0, so every epoch repeats the first one's order. Returns
    ``{"weights": fingerprint, "orders": [fingerprint per epoch]}``.

    Example::

        >>> a = labkit.launch(diagnose.training_fingerprints, seed=0).values
        >>> b = labkit.launch(diagnose.training_fingerprints, seed=0).values
        >>> a == b
        True
    """
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    if seed is not None:
        make_deterministic(seed + dist.get_rank())
    data_gen = torch.Generator().manual_seed(0)  # the data set itself is fixed
    x = torch.randn(samples, 8, generator=data_gen)
    y = x.sum(1, keepdim=True)
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    orders = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        orders.append(fingerprint(list(sampler)))
        for xb, yb in loader:
            noise = torch.from_numpy(np.random.normal(0, 0.1, xb.shape).astype("float32"))
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb + noise), yb).backward()
            opt.step()
    return {"weights": fingerprint(model.module), "orders": orders}


def early_stopping(epochs: int = 10, *, patience: int = 1, fixed: bool = False) -> dict:
    """A hang that the data decides: each rank stops early on its own validation loss.

    Early stopping ends training once the validation loss has not improved for more than
    ``patience`` epochs. Here each rank measures it on its own validation shard, and rank 1's
    shard comes from a slightly different distribution (another camera, another site): its
    loss turns up epochs before rank 0's. Rank 1 leaves the loop; rank 0 goes on into the
    next epoch, whose gradient all-reduce waits for rank 1 forever (with DDP, the same wait
    happens inside ``backward()``). On one process the code is right, and with other data it
    would not hang. ``fixed=True`` decides on the validation loss over all ranks (one
    all-reduce of the loss sum and the sample count: odd ranks hold 48 validation samples,
    even ranks 32, so the mean of the ranks' means would be another number), the same on every
    rank. Prints each epoch's loss; returns ``{"epochs": epochs trained, "val": each epoch's
    loss (over all ranks when fixed), "shard": each epoch's loss on this rank's shard}``.

    Example::

        >>> labkit.launch(diagnose.early_stopping, timeout=10)     # LaunchTimeout: rank 0
        >>> labkit.launch(diagnose.early_stopping, fixed=True).values[0]["epochs"]
        8
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 4, generator=gen)
    y = x.sum(1, keepdim=True)                              # the same task on every rank
    val_x = torch.randn(32 + 16 * (rank % 2), 4, generator=gen)   # shards of 32 and 48
    val_y = val_x.sum(1, keepdim=True) * (1 - 0.5 * rank)   # rank 1's shard differs
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)                           # the same start on every rank
    best, worse, history, shard = float("inf"), 0, [], []
    for epoch in range(epochs):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():                    # a data-parallel SGD step:
                dist.all_reduce(p.grad)                     # the gradients summed over ranks,
                p -= 0.1 * p.grad / dist.get_world_size()   # averaged, and one step down
            val = F.mse_loss(model(val_x), val_y)           # this rank's shard only
        shard.append(round(val.item(), 5))
        if fixed:  # the fix, shown after notebook 05's exercise on it
            val = loss_over_ranks(val, len(val_x))
        history.append(round(val.item(), 5))
        worse = 0 if val.item() < best else worse + 1
        best = min(best, val.item())
        print(f"epoch {epoch + 1}: validation loss {val.item():.4f}", flush=True)
        if worse > patience:
            print(f"stopping early: no improvement for {worse} epochs", flush=True)
            break
    return {"epochs": len(history), "val": history, "shard": shard}


def loss_over_ranks(loss, samples: int):
    """The mean loss over every rank's samples, the same number on every rank.

    ``loss`` is this rank's mean over its ``samples``; one all-reduce sums every rank's loss sum
    and sample count (the mean of the ranks' means would weigh unequal shards alike). The fix
    of :func:`early_stopping`: a decision taken on this value is the same on every rank.

    Example::

        >>> val = loss_over_ranks(F.mse_loss(model(val_x), val_y), len(val_x))
    """
    import torch
    import torch.distributed as dist

    total = torch.stack([loss * samples, torch.tensor(float(samples))])
    dist.all_reduce(total)
    return total[0] / total[1]

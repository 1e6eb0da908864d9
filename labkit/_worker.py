"""The worker shim: what torchrun starts on every rank for :func:`labkit.launch`.

``python -m labkit._worker RUN_DIR`` reads the job from ``RUN_DIR/job.pkl``, prepares the rank
(output prefix, stack dumps on demand, controller watchdog, GPU binding, process group), runs
it, and leaves the outcome in ``RUN_DIR``: ``result-<rank>.pkl`` or ``error-<rank>.pkl``. A
warm pool's job ("serve") forms the process group once and then runs task after task (see
:func:`_serve`). The file names and the job's fields are :mod:`labkit._protocol`'s.
Nothing here imports torch at module level: TensorFlow workers must stay torch-free.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

from ._protocol import (
    CONTINUES,
    CONTROLLER_PID,
    CONTROLLER_START,
    JOB_FILE,
    RUN_TASK,
    STACK_SIGNAL,
    TEMP_DIR,
    Job,
    Task,
    end_of_task,
    error_file,
    fifo_file,
    pid_file,
    process_start_time,
    ready_file,
    result_file,
    retire_file,
    stack_file,
    task_file,
)


def _env_int(name: str, default: int = 0) -> int:
    return int(os.environ.get(name, default))


def _prefix_output(rank: int) -> threading.Thread:
    """Route fds 1 and 2 through a pipe so every line, C++ logs included, starts with the rank.

    The pipe's write end stays open here too (``thread.writer``): labkit's own lines (a warm
    run's end-of-task mark) and a warm rank's fds 1 and 2 after a run go through it, whatever
    the run did to fds 1 and 2 themselves.
    """
    read_fd, write_fd = os.pipe()
    upstream = os.dup(1)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    prefix = f"[rank{rank}] ".encode()

    def pump():
        pending = b""
        while True:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            whole = len(pending) // _PIECE * _PIECE  # a long unfinished line: its full pieces
            while 0 < whole < len(pending) and pending[whole] & 0xC0 == 0x80:
                whole -= 1  # not inside a UTF-8 character: the controller decodes each piece
            _send(upstream, prefix, lines, pending[:whole])
            pending = pending[whole:]
        _send(upstream, prefix, [pending] if pending else [])
        os.close(read_fd)

    thread = threading.Thread(target=pump, name="labkit-output", daemon=True)
    thread.start()
    thread.upstream = upstream  # type: ignore[attr-defined]
    thread.writer = write_fd  # type: ignore[attr-defined]
    return thread


# Every rank writes into the one pipe the controller reads, and a pipe keeps a write whole only
# up to PIPE_BUF bytes (4096 on Linux, pipe(7)): a larger one can be split by another rank's.
# So each write carries whole prefixed lines and at most PIPE_BUF bytes; a line too long for one
# is sent in pieces, each but the last ending with CONTINUES, which the controller joins again.
_CONTINUES = CONTINUES.encode()
_PIECE = select.PIPE_BUF - 64 - len(_CONTINUES)  # room for the prefix, the mark and the newline


def _send(fd: int, prefix: bytes, lines: list[bytes], unfinished: bytes = b"") -> None:
    """Write ``lines`` (and the full pieces of an ``unfinished`` one) as prefixed lines."""
    batch = b""
    for line in lines:
        for frame in _frames(prefix, line, last=True):
            if len(batch) + len(frame) > select.PIPE_BUF:
                _write_all(fd, batch)
                batch = b""
            batch += frame
    for frame in _frames(prefix, unfinished, last=False):
        if len(batch) + len(frame) > select.PIPE_BUF:
            _write_all(fd, batch)
            batch = b""
        batch += frame
    if batch:
        _write_all(fd, batch)


def _frames(prefix: bytes, line: bytes, last: bool) -> list[bytes]:
    """One line as prefixed lines of at most PIPE_BUF bytes; with ``last=False`` every piece
    is marked as continued (the line's end comes later)."""
    pieces = []
    while len(line) > _PIECE or (line and not last):
        cut = min(_PIECE, len(line))
        while 0 < cut < len(line) and line[cut] & 0xC0 == 0x80:
            cut -= 1  # not inside a UTF-8 character: the controller decodes each piece
        cut = cut or min(_PIECE, len(line))
        pieces.append(prefix + line[:cut] + _CONTINUES + b"\n")
        line = line[cut:]
    if last:
        pieces.append(prefix + line + b"\n")
    return pieces


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _close_output(thread: threading.Thread) -> None:
    """Flush Python's streams and let the pump drain before the process exits."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.dup2(thread.upstream, 1)  # type: ignore[attr-defined]
    os.dup2(thread.upstream, 2)  # type: ignore[attr-defined]
    os.close(thread.writer)  # type: ignore[attr-defined]
    thread.join(timeout=2.0)


def _watch_controller(pid: int, start: str, agent_pid: int, run_dir: str) -> None:
    """Die with the notebook kernel: if the controller is gone, stop the agent and this rank.

    The dead controller cannot remove the run folder any more, so the first rank to notice does.
    """
    while True:
        time.sleep(0.5)
        if not _controller_alive(pid, start):
            shutil.rmtree(run_dir, ignore_errors=True)
            try:
                os.kill(agent_pid, signal.SIGTERM)
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGKILL)


def _controller_alive(pid: int | None = None, start: str | None = None) -> bool:
    """Whether the controller named in this rank's environment still runs (not a reused pid)."""
    pid = _env_int(CONTROLLER_PID) if pid is None else pid
    start = os.environ.get(CONTROLLER_START, "") if start is None else start
    return process_start_time(pid) == start if start else _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _write(run_dir: str, name: str, payload: bytes) -> None:
    tmp = os.path.join(run_dir, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, os.path.join(run_dir, name))


def _error_payload(exc: BaseException, rank: int, what: str = "") -> bytes:
    """A rank's error record, whole: the controller shortens what it shows of a huge message."""
    import cloudpickle

    return cloudpickle.dumps(
        {
            "rank": rank,
            "type": type(exc).__name__,
            "message": what or str(exc),
            "traceback": _user_traceback(exc),
            # The traceback's last lines repeat the message ("ValueError: ..."); knowing them
            # lets the controller show the frames without a second copy of a huge text.
            "exception_only": "".join(traceback.format_exception_only(type(exc), exc)),
            "time": time.time(),
        }
    )


def _user_traceback(exc: BaseException) -> str:
    """The traceback without this shim's own frames: they are the same in every run."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _to_cpu(value):
    """Move tensors (also inside lists, tuples and dicts) to the CPU so the kernel can load them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor | torch.nn.Module):
        return value.detach().cpu() if isinstance(value, torch.Tensor) else value.cpu()
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _bind_device(job: Job, local_rank: int):
    """Give each local rank its own GPU; TensorFlow ranks see only theirs (TF grabs all by
    default)."""
    gpus = job.gpus
    if not gpus:
        return None
    gpu = local_rank % gpus
    if job.framework == "tensorflow":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(gpus)]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[gpu]
        return None
    import torch

    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def _init_torch(job: Job, device, namespace: str = "", init=None):
    import torch.distributed as dist

    kwargs = {}
    if job.backend == "nccl" and device is not None:
        kwargs["device_id"] = device  # eager NCCL init: a bad setup fails here, not mid-step
    # torchrun keeps one store for all attempts of a run (launch(max_restarts=...)), and a
    # dead attempt's keys stay in it: the new ranks could read the old ranks' addresses and
    # fail to connect. A prefix per attempt gives each attempt a clean namespace.
    # (A warm rank that forms its group again after a run adds a namespace of that run's own.)
    global _STORE
    store, rank, world_size = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"labkit/attempt-{attempt}{namespace}"
    # Kept apart from the group: the ranks still meet through it after a run destroyed the group.
    _STORE = dist.PrefixStore(prefix, store)
    (init or dist.init_process_group)(job.backend, store=dist.PrefixStore(prefix, store),
                                      rank=rank, world_size=world_size, **kwargs)
    return dist


_STORE = None  # the rendezvous store under this attempt's prefix, once the group is formed


def _tf_config(job: Job, rank: int, run_dir: str) -> None:
    workers = [f"127.0.0.1:{port}" for port in job.tf_ports]
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}}
    )
    # AutoGraph writes each converted function to a file in the temporary folder and removes it
    # at exit: a rank that is killed (a fault injected, torchrun stopping the others) leaves
    # those files in /tmp for good. In the run folder they go with it.
    temp = os.path.join(run_dir, TEMP_DIR)
    os.makedirs(temp, exist_ok=True)
    os.environ["TMPDIR"] = temp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def _wait_for_peers(world_size: int) -> None:
    """Finished ranks wait (off the collectives' path) until every rank is done.

    A rank that returns early must not tear down the group under ranks still in a
    collective: they would fail with a connection error instead of showing the real hang.
    They meet in the rendezvous store, not the group's: a run may have destroyed its group.
    """
    _STORE.add("labkit/done", 1)
    while int(_STORE.add("labkit/done", 0)) < world_size:
        time.sleep(0.05)


def _run(job: Job | Task, rank: int):
    if isinstance(job, Job) and job.mode == "script":
        import runpy

        sys.argv = [job.script, *job.script_args]
        try:
            runpy.run_path(job.script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        return None
    fn, args, kwargs = job.payload
    return fn(*args, **kwargs)


def main(run_dir: str) -> int:
    import cloudpickle

    rank = _env_int("RANK")
    local_rank = _env_int("LOCAL_RANK")
    world_size = _env_int("WORLD_SIZE", 1)
    pump = _prefix_output(rank)
    with open(os.path.join(run_dir, stack_file(rank)), "w") as stacks:
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
        faulthandler.enable(file=stacks)  # a native crash leaves its stack too
        _write(run_dir, pid_file(rank),
               json.dumps({"pid": os.getpid(), "local_rank": local_rank}).encode())
        threading.Thread(
            target=_watch_controller,
            args=(_env_int(CONTROLLER_PID), os.environ.get(CONTROLLER_START, ""), os.getppid(),
                  run_dir),
            name="labkit-watchdog",
            daemon=True,
        ).start()
        code = _main_body(run_dir, rank, local_rank, world_size, cloudpickle, pump.writer)
        _close_output(pump)
    if "tensorflow" in sys.modules:
        # At exit the garbage collector walks every object, seconds with TensorFlow's hundreds
        # of thousands; the outcome is written, so exclude them (refcounts still free the rest).
        import gc

        gc.freeze()
    return code


def _load_job(path: str, cloudpickle) -> Job | Task:
    """Install the controller's sys.path and source lines (for tracebacks), then unpickle the
    job."""
    import linecache

    with open(path, "rb") as f:
        outer = cloudpickle.load(f)
    # Functions from the notebook's own modules are pickled by reference: make them importable.
    sys.path.extend(p for p in outer["sys_path"] if p not in sys.path)
    for filename, lines in outer["sources"].items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return cloudpickle.loads(outer["job"])


def _main_body(run_dir, rank, local_rank, world_size, cloudpickle, output: int) -> int:
    dist = None
    try:
        job = _load_job(os.path.join(run_dir, JOB_FILE), cloudpickle)
        device = _bind_device(job, local_rank)
        if job.framework == "tensorflow":
            _tf_config(job, rank, run_dir)
        elif job.mode != "script":
            dist = _init_torch(job, device)
        if job.mode == "serve":
            return _serve(run_dir, rank, job, device, cloudpickle, output)
        if job.mode != "script":  # a script forms its group itself: its timeout counts from start
            _write(run_dir, ready_file(rank), b"")
        value = _to_cpu(_run(job, rank))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the controller
        _write(run_dir, error_file(rank), _error_payload(exc, rank))
        return 1
    if not _report(run_dir, rank, value, cloudpickle):
        return 1
    if dist is not None:
        _wait_for_peers(world_size)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _report(run_dir: str, rank: int, value, cloudpickle) -> bool:
    """Write the rank's result; an error record instead if the value cannot travel."""
    try:
        payload = cloudpickle.dumps(value)
    except Exception as exc:
        what = (
            f"the return value of rank {rank} ({type(value).__name__}) cannot be pickled: {exc}. "
            "Return plain data (numbers, lists, dicts, tensors) instead"
        )
        _write(run_dir, error_file(rank), _error_payload(exc, rank, what))
        return False
    _write(run_dir, result_file(rank), payload)
    return True


# ---- warm ranks: the "serve" job --------------------------------------------------------------


def _serve(run_dir: str, rank: int, job: Job, device, cloudpickle, output: int) -> int:
    """A warm rank: with the group formed once, run task after task until told to stop.

    The rank blocks in read() on its FIFO, which costs no CPU while idle; the controller's one
    byte wakes it at once. The read sees EOF when the controller is gone: that ends it too.
    """
    import torch.distributed as dist

    slate = _Slate(job, device, output)
    fifo = os.open(os.path.join(run_dir, fifo_file(rank)), os.O_RDONLY)
    try:
        _mark_end(0, output)  # the process group is formed: ready for task 1
        number = 0
        while os.read(fifo, 1) == RUN_TASK:
            number += 1
            failed = not _serve_one(run_dir, rank, number, cloudpickle, slate)
            try:
                # After _serve_one returned: the run's locals are gone, so what still holds
                # CUDA memory now is really kept alive by the run.
                retire = slate.restore(rank, number, failed=failed)
            except BaseException as exc:  # noqa: BLE001 - the controller must stop this pool
                what = (f"the warm rank {rank} could not restore its state after the run: "
                        f"{type(exc).__name__}: {exc}. The warm workers are stopped; the next "
                        "warm run starts fresh ones")
                _write(run_dir, error_file(rank), _error_payload(exc, rank, what))
                _mark_end(number, output)
                return 1
            if retire:
                _write(run_dir, retire_file(rank), retire.encode())
            _mark_end(number, output)
    finally:
        os.close(fifo)
    if not _controller_alive():
        # EOF: the kernel died. This rank may be gone before its watchdog looks (0.5 s), so it
        # removes the run folder now, as the watchdog would.
        shutil.rmtree(run_dir, ignore_errors=True)
    # QUIT or EOF: every rank is idle, so the group can go down without a peer inside it.
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _serve_one(run_dir: str, rank: int, number: int, cloudpickle, slate: _Slate) -> bool:
    """Run task ``number`` and leave its result or error in the run folder, as a cold rank would.
    Returns whether it succeeded."""
    try:
        task = _load_job(os.path.join(run_dir, task_file(number)), cloudpickle)
        slate.begin(task)
        value = _to_cpu(_run(task, rank))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the controller
        _write(run_dir, error_file(rank), _error_payload(exc, rank))
        return False
    return _report(run_dir, rank, value, cloudpickle)


_LIBC = None


def _mark_end(number: int, output: int) -> None:
    """Flush every layer of output, then write the end-of-task line behind it into ``output``,
    the pipe fds 1 and 2 were given at the start (the run may have pointed them elsewhere)."""
    global _LIBC
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        if _LIBC is None:
            import ctypes

            _LIBC = ctypes.CDLL(None)
        # C and C++ code (std::cout shares C's stdio) buffers a pipe's output in the process;
        # a cold rank flushes it when it exits, a warm one must do it after every run.
        _LIBC.fflush(None)
    except (OSError, AttributeError):
        pass
    _write_all(output, end_of_task(number))


def _backend_flags(torch) -> list[tuple[object, str]]:
    """The global switches of torch's backends that a run may flip (cuDNN, oneDNN, TF32,
    reduced-precision reductions, opt_einsum)."""
    cudnn, matmul, mkldnn = torch.backends.cudnn, torch.backends.cuda.matmul, torch.backends.mkldnn
    flags = [(cudnn, "enabled"), (cudnn, "benchmark"), (cudnn, "deterministic"),
             (cudnn, "allow_tf32"), (matmul, "allow_tf32"),
             (matmul, "allow_fp16_reduced_precision_reduction"),
             (matmul, "allow_bf16_reduced_precision_reduction"),
             (mkldnn, "enabled"), (mkldnn, "deterministic"), (mkldnn, "allow_tf32"),
             (torch.backends.opt_einsum, "enabled"), (torch.backends.opt_einsum, "strategy")]
    return [(obj, name) for obj, name in flags if hasattr(obj, name)]


_SDP = ("flash", "mem_efficient", "math", "cudnn")  # torch.backends.cuda.<name>_sdp_enabled()
_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")


def _flushes_denormals(torch) -> bool:
    """Whether torch.set_flush_denormal(True) is in force (there is no getter): a denormal
    number then reads as zero."""
    return (torch.tensor(1e-310, dtype=torch.float64) * 0.5).item() == 0.0


class _Slate:
    """What a fresh rank starts with, captured once before the first run, put back after each.

    Only what is cheap to reset is reset; what cannot be put back (the inter-op thread count,
    a process group the run formed through the shared store) retires the rank: the controller
    replaces the pool before the next run. What persists between runs is listed in the
    docstring of ``labkit.workers``.
    """

    def __init__(self, job: Job, device, output: int):
        import warnings

        import torch
        import torch.distributed as dist

        self.job, self.device, self.torch, self.dist = job, device, torch, dist
        self.output = output
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.umask = os.umask(0o077)
        os.umask(self.umask)
        self.sys_path, self.argv = list(sys.path), list(sys.argv)
        self.streams = (sys.stdout, sys.stderr)
        self.warning_filters = list(warnings.filters)
        self.threads = torch.get_num_threads()
        self.interop = torch.get_num_interop_threads()
        self.dtype = torch.get_default_dtype()
        self.default_device = torch.get_default_device()
        self.grad = torch.is_grad_enabled()
        self.anomaly = torch.is_anomaly_enabled()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.precision = torch.get_float32_matmul_precision()
        self.print_options = torch._tensor_str.get_printoptions()
        self.denormal = _flushes_denormals(torch)
        self.flags = [(obj, name, getattr(obj, name)) for obj, name in _backend_flags(torch)]
        self.sdp = {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in _SDP
                    if hasattr(torch.backends.cuda, f"{name}_sdp_enabled")}
        self.world, self.world_size = dist.group.WORLD, dist.get_world_size()
        self.groups = self._groups()
        self.cuda_bytes = torch.cuda.memory_allocated(device) if device is not None else 0
        self.called: set[str] = set()  # the one-way calls below that this run made
        self._init_group = dist.init_process_group  # labkit's own forming, unwatched
        c10d = dist.distributed_c10d
        self._watch((torch,), "set_num_interop_threads")
        for name in ("init_process_group", *_POINT_TO_POINT):
            # Both names: the user's dist.send, and c10d's own calls (send_object_list's).
            self._watch((dist, c10d), name)

    def _groups(self) -> set:
        return set(self.dist.distributed_c10d._world.pg_map)

    def _watch(self, modules: tuple, name: str) -> None:
        """Note a run's successful call of ``name`` (in each of ``modules``): its effect
        outlives the run.

        ``torch.set_num_interop_threads`` works once per process; a group the run formed
        through the ranks' shared store (env://) leaves keys there that the next run's group
        would read again, naming ranks that are gone. Either way only fresh ranks give the next
        run what a cold one gets. A point-to-point message the run left unmatched (an isend
        nobody received) would be received by the next run's recv: after a run that sent or
        received any, the ranks form the default group again.
        """
        real = getattr(modules[0], name)

        def watched(*args, **kwargs):
            out = real(*args, **kwargs)
            self.called.add(name)
            return out

        watched.__doc__, watched.__name__, watched.__wrapped__ = real.__doc__, name, real
        for module in modules:
            setattr(module, name, watched)

    def _any_rank_lost_it(self, rank: int, number: int, lost: bool) -> bool:
        """Tell the other ranks whether this one lost the default group; whether any did."""
        keys = [f"labkit/task-{number}/lost-{r}" for r in range(self.world_size)]
        _STORE.set(keys[rank], "1" if lost else "0")
        _STORE.wait(keys)
        return any(_STORE.get(key) == b"1" for key in keys)

    def begin(self, task: Task) -> None:
        """Start a run as a fresh process would: new random seeds, the controller's cwd and env."""
        import random

        self.torch.seed()  # the CPU generator and every CUDA device's, from fresh entropy
        random.seed()
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        for key, value in task.environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        try:
            os.chdir(task.cwd)
        except OSError:  # the kernel's folder is gone or not ours: stay in the pool's
            pass
        if self.device is not None:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def restore(self, rank: int, number: int, failed: bool = False) -> str:
        """Put back what a run changed; say so if it left CUDA tensors alive. Returns why the
        rank must be replaced before the next run ('' if it need not). ``failed``: the run
        raised on this rank."""
        import warnings

        torch = self.torch
        self._restore_output()
        if warnings.filters != self.warning_filters:  # first: "error" would break what follows
            warnings.filters[:] = self.warning_filters
        # A new filters version makes "shown once" warnings show again, as in a fresh process.
        warnings._filters_mutated()
        sys.path[:], sys.argv[:] = self.sys_path, self.argv
        for key in set(os.environ) - set(self.environ):
            del os.environ[key]
        for key, value in self.environ.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        os.chdir(self.cwd)
        os.umask(self.umask)
        retire = self._restore_groups(rank, number, failed)
        # Each switch is set only if the run changed it: the first call of some of them costs
        # seconds (use_deterministic_algorithms imports half of torch's compiler stack).
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.default_device:
            torch.set_default_device(None)
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
        if torch.is_anomaly_enabled() != self.anomaly:
            torch.set_anomaly_enabled(self.anomaly)
        mode, warn_only = self.deterministic
        if (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled()) != self.deterministic:
            torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        if torch.get_float32_matmul_precision() != self.precision:
            torch.set_float32_matmul_precision(self.precision)  # before allow_tf32: it sets both
        for obj, name, value in self.flags:
            if getattr(obj, name) != value:
                setattr(obj, name, value)
        for name, on in self.sdp.items():
            if getattr(torch.backends.cuda, f"{name}_sdp_enabled")() != on:
                getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)
        if torch._tensor_str.get_printoptions() != self.print_options:
            torch.set_printoptions(**self.print_options)
        torch.set_flush_denormal(self.denormal)  # no getter; one register write, cheap
        if self.device is not None:
            self._cuda_memory(rank)
        if "set_num_interop_threads" in self.called or (
                torch.get_num_interop_threads() != self.interop):
            retire = retire or ("the last run set the number of inter-op threads, which a "
                                "process can do once only")
        self.called.clear()
        return retire

    def _restore_output(self) -> None:
        """Point fds 1 and 2 at the output pipe again and give Python working streams."""
        try:
            pipe = os.fstat(self.output)
        except OSError:  # closed under us: the output is lost, nothing to put back
            return
        for fd in (1, 2):
            try:
                now = os.fstat(fd)
                same = (now.st_dev, now.st_ino) == (pipe.st_dev, pipe.st_ino)
            except OSError:  # the run closed it
                same = False
            if not same:
                os.dup2(self.output, fd)
        streams = []
        for fd, stream in zip((1, 2), self.streams, strict=True):
            if stream.closed:  # the run closed sys.stdout itself: a new one on the same fd
                stream = open(fd, "w", buffering=1, closefd=False)  # noqa: SIM115
            streams.append(stream)
        sys.stdout, sys.stderr = self.streams = tuple(streams)

    def _restore_groups(self, rank: int, number: int, failed: bool = False) -> str:
        """Destroy the groups the run made, and form the default group again if the run
        destroyed or replaced it on any rank, or failed on any rank of a CPU pool; returns why
        the rank must be replaced ('' if it need not)."""
        dist = self.dist
        world = dist.group.WORLD if dist.is_initialized() else None
        for group in self._groups() - self.groups - {world}:
            dist.destroy_process_group(group)  # subgroups hold sockets or NCCL communicators
        # A rank that lost the default group cannot form it again alone: it would wait for
        # peers that still have theirs. So the ranks agree, through the store, whether all do.
        # A run that raised may have left its ranks after different numbers of collectives (a
        # gloo collective is matched by a per-group counter) or a message unreceived: on a
        # CPU pool a new default group costs well under a second, fresh processes several, so
        # the ranks form it again and serve on. (A GPU pool is replaced after a failure: a
        # CUDA error can leave the device unusable.)
        lost = (world is not self.world or not self.called.isdisjoint(_POINT_TO_POINT)
                or (failed and self.device is None))
        if not self._any_rank_lost_it(rank, number, lost=lost):
            return ""
        if dist.is_initialized():
            dist.destroy_process_group()
        # The next run needs a default group (a script's habit is to destroy it). Every rank
        # forms it again, and they meet under a namespace of this run's.
        _init_torch(self.job, self.device, f"/after-task-{number}", self._init_group)
        self.world, self.groups = self.dist.group.WORLD, self._groups()
        if "init_process_group" in self.called:
            return "the last run formed a process group of its own"
        return ""

    def _cuda_memory(self, rank: int) -> None:
        """Give the cached CUDA memory back; report tensors that the run left alive."""
        import gc

        torch = self.torch
        gc.collect()  # tensors in a reference cycle the run left are freed only by the collector
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(self.device) - self.cuda_bytes
        if left > 0:
            print(f"[labkit] rank {rank}: this run left {left / 2**20:.1f} MiB of CUDA tensors "
                  "alive (in a module global, a cache or a class attribute?); the warm rank keeps "
                  "them for later runs: `del` them before the function returns, or run cold "
                  "(warm=False)", flush=True)


def leave(code: int) -> None:
    """End the rank as Python's exit would, without the interpreter's shutdown.

    torch 2.14's gloo threads can still be releasing the last collective's tensors while the
    interpreter shuts down; releasing one takes the GIL, which then ends the thread, and the
    rank aborts (SIGABRT, "terminate called without an active exception") after its result
    was written: the run fails for nothing. So the rank does what exit does that matters (it
    waits for the threads the run left running, runs the atexit functions while everything is
    alive: DataLoader workers are stopped there, temporary files removed; flushes Python's and
    C's buffered output) and leaves with os._exit.
    """
    import atexit
    import ctypes

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed with the output pump
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # what native code printed with C's stdio
    except (OSError, AttributeError):
        pass
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1]))

"""Run a function, a script or a cell on N torchrun workers from a notebook kernel.

The kernel is only a controller: it never forks and never touches CUDA. Each run is
``python -m torch.distributed.run`` (torchrun's elastic agent, c10d rendezvous) in a session of
its own, with :mod:`labkit._worker` as the entry point of every rank. The job travels by value
with cloudpickle, so functions, classes and closures defined in notebook cells work.

The module is long (past 800 lines) because the cold path and the warm pool (:class:`Workers`)
share one supervision engine and its private state: the output reader (``_Output``), the checks
and clock (``_Watch``), the uninterruptible teardown (``_Shield``, ``_stop``) and the reading of
how each rank ended.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import importlib
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ._progress import MARKER, ProgressBars
from ._protocol import (
    CONTINUES,
    CONTROLLER_PID,
    CONTROLLER_START,
    END_OF_TASK,
    ERRORS,
    JOB_FILE,
    PIDS,
    QUIT,
    READY,
    RESULTS,
    RETIRES,
    RUN_PREFIX,
    RUN_TASK,
    STACK_SIGNAL,
    Job,
    Task,
    error_file,
    exit_file,
    fifo_file,
    process_start_time,
    rank_of,
    result_file,
    stack_file,
    task_file,
)
from .profile import visible_gpu_count

BACKENDS = ("auto", "gloo", "nccl")
FRAMEWORKS = ("torch", "tensorflow")
_STACK_WAIT = 2.0  # seconds the ranks get to dump their stacks before a timeout kills them
# A cold run's timeout counts from the moment every rank calls the function; the start-up
# before it (torch imported, the process group formed: seconds, minutes on a busy laptop)
# gets max(timeout, STARTUP_S) of its own, so that a short timeout means the same everywhere.
STARTUP_S = 120.0
_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when the controller stops a run
_HEARTBEAT = 30.0  # a quiet run reports its progress this often

# torchrun's own chatter that says nothing a learner needs (labkit sets these variables itself).
_AGENT_NOISE = ("Setting OMP_NUM_THREADS environment variable", "*****")


class LaunchError(RuntimeError):
    """A launched run failed: a rank raised, crashed, or the run could not start.

    ``rank`` is the rank that failed first (a killed rank before the peers that lost it),
    ``logs`` every rank's output lines. The message shows at most the first lines of a long
    exception text and the traceback's last lines; ``full_message`` has the failing rank's
    whole exception text and traceback (None when no rank raised).
    """

    def __init__(self, message: str, *, rank: int | None = None, logs: dict | None = None,
                 full_message: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.logs = logs or {}
        self.full_message = full_message


class LaunchTimeout(LaunchError):
    """A launched run outlived its ``timeout``; the message names the stuck ranks and their
    stacks."""

    def __init__(self, message: str, *, stuck: list[int], stacks: dict[int, str], logs=None):
        super().__init__(message, rank=stuck[0] if stuck else None, logs=logs)
        self.stuck = stuck
        self.stacks = stacks


@dataclasses.dataclass
class LaunchResult:
    """What a run gave back: ``values`` in rank order, the wall time and every rank's log lines."""

    values: list
    seconds: float
    logs: dict[int, list[str]]
    nproc: int
    backend: str
    command: list[str]
    agent_log: list[str] = dataclasses.field(default_factory=list)

    def __repr__(self) -> str:
        return (
            f"LaunchResult(nproc={self.nproc}, backend={self.backend!r}, "
            f"seconds={self.seconds:.2f}, values={self.values!r})"
        )


@dataclasses.dataclass
class _Run:
    """One run's private state: its folder, its torchrun process, the workers it has started."""

    run_dir: Path
    proc: subprocess.Popen
    lines: queue.Queue
    known: dict  # pid -> psutil.Process, every descendant ever seen
    reader: threading.Thread


def launch(
    fn,
    *args,
    nproc: int = 2,
    backend: str = "auto",
    timeout: float | None = None,
    framework: str = "torch",
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    show_ranks=None,
    keep_run_dir: bool = False,
    env: dict | None = None,
    max_restarts: int = 0,
    warm: bool | None = None,
    **kwargs,
) -> LaunchResult:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` workers with the process group ready.

    ``fn`` may be a function (defined anywhere, notebook cells included) or the path of a
    script, whose ``*args`` become its command line. Worker output streams into the cell,
    each line prefixed with its rank; ``show_ranks=0`` (or a list) shows only those ranks.

    Example::

        >>> import torch.distributed as dist
        >>> def total(x):
        ...     t = torch.tensor([x + dist.get_rank()])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> labkit.launch(total, 10, nproc=2).values
        [21, 21]
        >>> labkit.launch("train.py", "--epochs", "1", nproc=2)    # the %%writefile style

    ``env`` adds environment variables for this run (torchrun and its workers; the kernel's
    own environment is left as it is). They are in place before torch starts in the workers,
    which is when it reads ``TORCH_DISTRIBUTED_DEBUG``, ``NCCL_DEBUG`` and the like::

        >>> labkit.launch(total, 10, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})

    ``max_restarts=N`` lets torchrun restart all workers up to N times when one dies (its
    elastic agent); ``fn`` must then resume by itself, from a checkpoint (see
    ``labkit.elastic``). The run succeeds if an attempt finishes; the failures it survived
    are printed.

    ``warm=True`` runs ``fn`` on the kernel's warm workers of this shape (``nproc``,
    ``backend``, ``framework``, ``env``), started on first use and kept for the next runs:
    a run then costs milliseconds instead of seconds (see :func:`workers` for what stays
    alive between runs). ``warm=None``, the default, follows :func:`use_warm` or the
    ``LABKIT_WARM=1`` environment variable, and runs cold otherwise or where warm workers
    cannot (a script, several nodes, ``max_restarts``, ``keep_run_dir``, TensorFlow);
    ``warm=False`` always starts fresh processes::

        >>> labkit.launch(total, 10, warm=True).values    # ~3 s the first time, then ~0.02 s
        [21, 21]

    The launcher's own keywords (``nproc``, ``timeout``, ``env``, ``warm``, ...) are not passed
    on to ``fn``; every other keyword argument is.

    Raises :class:`LaunchError` naming the first failing rank with its traceback, and
    :class:`LaunchTimeout` (with every stuck rank's stack) when ``timeout`` seconds pass.
    ``timeout`` counts from the moment every rank calls ``fn``: the start-up before it
    (importing torch, forming the process group) has ``max(timeout, STARTUP_S)`` seconds of
    its own, so that a short timeout for a hang means the same on a busy laptop. A script's
    timeout counts from the start (it forms its group itself).
    """
    __tracebackhide__ = True  # IPython shows the LaunchError, not the controller's frames
    job, gpus = _validate(fn, args, kwargs, nproc, backend, timeout, framework, nnodes, node_rank,
                          rdzv_endpoint)
    extra_env = _check_env(env)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number >= 0 (0: a failure ends the run), "
                         f"got {max_restarts!r}")
    if _goes_warm(warm, fn, framework, nnodes, rdzv_endpoint, max_restarts, keep_run_dir):
        result = _kernel_pool(nproc, job.backend, framework, extra_env).run_if_free(
            fn, args, kwargs, timeout, show_ranks, wait=warm is True)
        if result is not None:
            return result  # (None: the pool is busy with a run of another thread: go cold)
    run_dir = _new_run_dir()
    started: list[_Run] = []

    def cleanup():  # whatever ended the run: no process, and no folder unless asked to keep it
        for run in started:
            _stop(run)
        if keep_run_dir:
            (run_dir / _KEPT).touch()  # asked for: no later sweep takes it
            print(f"[labkit] run folder kept: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)

    with _Shield(cleanup):
        _write_job(run_dir, job)
        command = _torchrun_command(run_dir, nproc, nnodes, node_rank, rdzv_endpoint,
                                    max_restarts)
        if nnodes > 1:
            _print_other_nodes(fn, nproc, nnodes, node_rank, rdzv_endpoint)
        started.append(_start(run_dir, command, _worker_env(nproc, gpus, extra_env)))
        return _supervise(started[0], job, nproc, timeout, show_ranks, command, max_restarts)


def _validate(fn, args, kwargs, nproc, backend, timeout, framework, nnodes, node_rank,
              rdzv_endpoint):
    """Check every argument before anything starts; return the job description and GPU count."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(
            f"nproc must be a whole number >= 1 (workers per node), got {nproc!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if framework not in FRAMEWORKS:
        raise ValueError(
            f"unknown framework {framework!r}: use one of {', '.join(FRAMEWORKS)}")
    if timeout is not None and not timeout > 0:
        raise ValueError(
            f"timeout must be a number of seconds > 0 (or None for none), got {timeout!r}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"need nnodes >= 1 and 0 <= node_rank < nnodes, got {nnodes=} {node_rank=}")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(
            "a multi-node run needs rdzv_endpoint='host:port' of node 0, the same on every node")
    if framework == "tensorflow" and nnodes > 1:
        raise ValueError(
            "framework='tensorflow' runs on one node; for several, write TF_CONFIG per node")
    gpus = visible_gpu_count()
    if backend == "nccl":
        if gpus == 0:
            raise ValueError("backend='nccl' needs CUDA GPUs and none is visible here: use "
                             "backend='gloo' (or 'auto'), or check `nvidia-smi` and "
                             "CUDA_VISIBLE_DEVICES")
        if gpus < nproc:
            raise ValueError(f"backend='nccl' needs one GPU per local rank: nproc={nproc} but "
                             f"{gpus} GPU(s) visible. Use nproc<={gpus}, or backend='gloo' to "
                             "share GPUs")
    if backend == "auto":
        backend = "nccl" if 0 < nproc <= gpus else "gloo"
    script = None
    if isinstance(fn, str | os.PathLike):
        script = Path(fn)
        if not script.is_file():
            raise FileNotFoundError(f"no script at {str(script)!r} (looked in {os.getcwd()}): "
                                    "write it first, e.g. with %%writefile, or pass a function")
        if kwargs:
            raise ValueError(
                "a script takes command-line arguments only: pass them as strings in *args")
    elif not callable(fn):
        raise TypeError(f"launch() needs a function or a script path, got {type(fn).__name__}")
    job = Job(
        mode="script" if script else "function",
        backend=backend,
        framework=framework,
        gpus=gpus,
        sys_path=_sys_path(),
        script=str(script.resolve()) if script else None,
        script_args=[str(a) for a in args] if script else [],
        tf_ports=_free_ports(nproc) if framework == "tensorflow" else [],
        payload=None if script else (fn, args, kwargs),
    )
    return job, gpus


def _sys_path() -> list[str]:
    """The controller's sys.path for the workers, '' (the current folder) spelt out."""
    return [p or os.getcwd() for p in sys.path]


def _check_env(env) -> dict:
    """The workers' extra environment, checked: a dict of str to str (what os.environ holds)."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ValueError("env must be a dict of variable names to values, got "
                         f"{type(env).__name__}: e.g. env={{'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ValueError(f"env: {key!r} is not a valid variable name: use a non-empty string "
                             "without '=', e.g. 'NCCL_DEBUG'")
        if not isinstance(value, str):
            raise ValueError(f"env[{key!r}] is {type(value).__name__} {value!r}, but environment "
                             f"values are strings: write {key!r}: {str(value)!r}")
        if "\0" in value:
            raise ValueError(
                f"env[{key!r}] contains a NUL character, which no environment can hold")
    return dict(env)


def _write_job(run_dir: Path, job: Job | Task, name: str = JOB_FILE) -> None:
    """Pickle the job by value into the run folder (whole or not at all); name the object that
    cannot travel if pickling fails."""
    try:
        data = _dumps_with_sources(job)
    except Exception as exc:
        culprit = _unpicklable(*job.payload) if job.payload else "the job"
        raise TypeError(
            f"cannot send {culprit} to the workers: {type(exc).__name__}: {exc}. Workers are "
            "separate processes; create such objects (open files, locks, CUDA tensors, generators) "
            "inside the function instead of passing them in"
        ) from exc
    tmp = run_dir / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, run_dir / name)


def _dumps_with_sources(job: Job | Task) -> bytes:
    """cloudpickle the job, keeping code's file names and shipping their source lines.

    cloudpickle renames shipped code "<dynamic-code>"; keeping the notebook cell's name and its
    lines lets worker tracebacks show the learner's source (and lets AutoGraph read it).
    """
    import copyreg
    import io
    import linecache
    import types
    from collections import ChainMap

    import cloudpickle

    files: set[str] = set()
    base_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]

    def reduce_code(code):
        constructor, fields = base_reduce(code)
        files.add(code.co_filename)
        return constructor, tuple(code.co_filename if f == "<dynamic-code>" else f for f in fields)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap({types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table,
                                  copyreg.dispatch_table)

        def reducer_override(self, obj):
            # torch.classes and torch.ops are instances of ModuleType subclasses, which
            # cloudpickle does not take for modules: a function using `torch` and any attribute
            # named `classes` (ds.classes) would fail to pickle. Send them by name, as modules.
            if (isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType
                    and sys.modules.get(getattr(obj, "__name__", None)) is obj):
                return importlib.import_module, (obj.__name__,)
            return super().reducer_override(obj)

    buffer = io.BytesIO()
    Pickler(buffer).dump(job)
    sources = {f: lines for f in files if (lines := linecache.getlines(f))}
    return cloudpickle.dumps({"sources": sources, "sys_path": job.sys_path,
                              "job": buffer.getvalue()})


def _unpicklable(fn, args, kwargs) -> str:
    """A name for the first of fn, args and kwargs that cloudpickle refuses."""
    import cloudpickle

    named = [(f"the function {getattr(fn, '__qualname__', fn)!r}", fn)]
    named += [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
    named += [(f"keyword argument {k!r} ({type(v).__name__})", v) for k, v in kwargs.items()]
    for name, obj in named:
        try:
            cloudpickle.dumps(obj)
        except Exception:
            return name
    return "the job"


def _free_ports(n: int) -> list[int]:
    """Free loopback ports for TF_CONFIG; all held open together so they differ."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _torchrun_command(run_dir: Path, nproc: int, nnodes: int, node_rank: int,
                      rdzv_endpoint: str | None, max_restarts: int = 0) -> list[str]:
    """The torchrun command line; --standalone picks a free rendezvous port on one node."""
    if nnodes == 1 and not rdzv_endpoint:
        where = ["--standalone"]
    else:
        where = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", "labkit"]
    return [
        sys.executable, "-c", _AGENT_BOOT, str(os.getpid()),
        *where, "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
        "--monitor-interval", "0.1",
        # torchrun's own log folder goes inside the run folder: by default it leaves a
        # torchelastic_* folder in /tmp behind on every run.
        "--log-dir", str(run_dir / "torchelastic"),
        "-m", "labkit._worker", str(run_dir),
    ]


# torchrun, but asked (PR_SET_PDEATHSIG) to get SIGTERM when the controller dies for any reason,
# SIGKILL included: the agent then stops its workers itself, and removes the run folder that the
# dead controller no longer can. Runs torchrun in this same process (no extra interpreter).
# SIGTERM ends it at once as Python's default would, but removes the run folder first when the
# controller is gone (from the first line on: a kernel killed while its pool starts leaves none).
# torchrun is told not to take SIGTERM over (TORCHELASTIC_SIGNALS_TO_HANDLE, read by its
# PContext.start): its graceful shutdown could be cut short by a rank watchdog's second SIGTERM
# before the folder is removed. The ranks end by themselves (watchdog, FIFO end) or by _stop.
# Each rank's exit status is written to the run folder as the agent reaps it (exit_file): torchrun
# reports non-zero codes only, and the controller is no parent of the ranks to see them itself.
_AGENT_BOOT = (
    "import os,sys,signal,shutil,subprocess\n"
    "parent, run_dir = int(sys.argv[1]), sys.argv[-1]\n"
    "def stop(*_):\n"
    "    if os.getppid() != parent: shutil.rmtree(run_dir, ignore_errors=True)\n"
    "    os._exit(128 + signal.SIGTERM)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "os.environ['TORCHELASTIC_SIGNALS_TO_HANDLE'] = 'SIGINT,SIGHUP,SIGQUIT'\n"
    "def noting(method):\n"
    "    def noted(self, *args, **kwargs):\n"
    "        out = method(self, *args, **kwargs)\n"
    "        if self.returncode is not None and not getattr(self, 'labkit_noted', False):\n"
    "            self.labkit_noted = True\n"
    "            path = os.path.join(run_dir, 'exit-%d' % self.pid)\n"
    "            try:\n"
    "                with open(path + '.tmp', 'w') as f: f.write(str(self.returncode))\n"
    "                os.replace(path + '.tmp', path)\n"
    "            except OSError: pass\n"
    "        return out\n"
    "    return noted\n"
    "subprocess.Popen.poll = noting(subprocess.Popen.poll)\n"
    "subprocess.Popen.wait = noting(subprocess.Popen.wait)\n"
    "try:\n"
    "    if sys.platform.startswith('linux'):\n"
    "        import ctypes; ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))\n"
    "    if os.getppid() != parent: sys.exit('labkit: controller exited before start')\n"
    "    sys.argv = ['torchrun'] + sys.argv[2:]\n"
    "    import runpy\n"
    "    runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    if os.getppid() != parent:\n"
    "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "        shutil.rmtree(run_dir, ignore_errors=True)\n"
)


def _worker_env(nproc: int, gpus: int, extra: dict | None = None) -> dict:
    """The controller's environment, the caller's ``env`` over it, and what the workers need."""
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the cell as they are printed
    env[CONTROLLER_PID] = str(os.getpid())
    env[CONTROLLER_START] = process_start_time(os.getpid()) or ""
    # A thread budget per worker: N workers each using every core would fight over them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The kernel's matplotlib backend (inline) does not exist in a plain worker process.
    env.pop("MPLBACKEND", None)
    return env


def _start(run_dir: Path, command: list[str], env: dict) -> _Run:
    """Start torchrun in a session of its own and a thread that reads its output lines."""
    proc = subprocess.Popen(
        command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()

    def read():
        with proc.stdout:
            for raw in proc.stdout:
                lines.put(raw.decode(errors="replace").rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=read, name="labkit-reader", daemon=True)
    reader.start()
    return _Run(run_dir, proc, lines, {}, reader)


class _Shield:
    """Runs ``cleanup`` when the block ends, however it ends, and lets no interrupt cut it short.

    In the main thread (where SIGINT lands), the first SIGINT inside the block interrupts as
    usual (KeyboardInterrupt); later ones, and every one once the cleanup has begun, wait until
    it is over: a learner pressing stop again and again must not leave ranks alive (SIGTERM
    sent, SIGKILL never) or a run folder behind. If one arrived during a cleanup after a block
    that ended normally, KeyboardInterrupt is raised after it.
    """

    def __init__(self, cleanup):
        self.cleanup, self.armed, self.deferred, self.handler = cleanup, True, 0, None

    def __enter__(self) -> _Shield:
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):  # SIG_IGN / SIG_DFL: nothing Python sees, nothing to defer
                self.handler = handler
                signal.signal(signal.SIGINT, self._interrupt)
        return self

    def _interrupt(self, signum, frame):
        if not self.armed:
            self.deferred += 1
            return
        self.armed = False  # before the handler raises: one interrupt per block, no more
        self.handler(signum, frame)
        self.armed = True  # a handler that did not raise: the next interrupt goes to it too

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.armed = False
        finally:
            try:
                self.cleanup()
            finally:
                if self.handler is not None:
                    signal.signal(signal.SIGINT, self.handler)
        if self.deferred and exc_type is None:
            raise KeyboardInterrupt


def _supervise(run: _Run, job: Job, nproc: int, timeout, show_ranks, command,
               max_restarts: int = 0, task: _Task | None = None) -> LaunchResult:
    """Stream output, watch for failure and timeout, and always leave no process behind.

    With ``task`` (a run on warm workers) the run ends when every rank has marked the task's
    end, and its processes are stopped only if it failed. The clock is the controller's own:
    whatever the ranks do to their group, their output or their descriptors, a timeout fires.
    """
    __tracebackhide__ = True
    out = _Output(show_ranks)
    watch = _Watch(run, job, nproc, timeout, task, max_restarts)
    keep = []  # a warm run that went well leaves its ranks running for the next
    with _Shield(lambda: (keep and keep[0]) or _stop(run)):
        try:
            done = False
            while not done:
                lines, done = _drain(run.lines)
                for line in lines:
                    if task is not None:
                        line = task.take(line)
                        done = done or task.ended_by_all(nproc)
                    if line:
                        out.route(line)
                out.flush()
                if lines:
                    watch.last_output = time.monotonic()
                if not done:
                    done = watch.check(out)
            ended = task is not None and task.ended_by_all(nproc)  # the warm ranks live on
            if not ended:
                try:
                    run.proc.wait(timeout=2 * _GRACE)
                except subprocess.TimeoutExpired:  # its output ended, it did not: stop it
                    _stop(run)
            out.flush(partial=True)
            seconds = time.monotonic() - watch.start
            errors = _errors(run.run_dir)
            error = errors[0] if errors else None
            # Ranks that ended without returning, in a run nobody stopped (os._exit(0)).
            missing = ([] if job.mode != "function" or error is not None or watch.dead
                       or watch.stopped else _without_outcome(run.run_dir, nproc))
            if max_restarts and run.proc.returncode == 0:
                _report_restarts(run.run_dir, errors)
            elif (error is not None or watch.dead or missing
                  or not ended and (task is not None or run.proc.returncode != 0)):
                raise _failure(error, run.proc.returncode, out.agent_log, out.logs,
                               watch.dead or missing, run.run_dir)
            values = _collect(run.run_dir)
            keep.append(ended)
            return LaunchResult(values, seconds, out.logs, nproc, job.backend, command,
                                out.agent_log)
        except KeyboardInterrupt:
            stopped = _stop(run)
            print(f"[labkit] interrupted: stopped torchrun and {stopped} worker process(es)")
            raise


# Seconds a run's ranks get, once all have returned, to end (or mark the end): at least the run's
# own timeout. Tens of seconds: on a busy laptop an exit that destroys the group and unloads
# torch can take that long.
_TEARDOWN_S = 30.0
_CHECK_EVERY = 0.1  # seconds between two looks at the run's processes and folder


def _drain(lines: queue.Queue, wait: float = _CHECK_EVERY, most: int = 10000):
    """The output lines that have arrived (waiting up to ``wait`` for the first), and whether
    the output has ended. Taken in batches: a flood costs one look at the run per batch."""
    got = []
    try:
        got.append(lines.get(timeout=wait))
        while len(got) < most:
            got.append(lines.get_nowait())
    except queue.Empty:
        pass
    if got and got[-1] is None:
        return got[:-1], True
    return got, False


class _Watch:
    """The supervisor's checks between batches of output: dead ranks, failures, the clock."""

    def __init__(self, run: _Run, job: Job, nproc: int, timeout, task, max_restarts: int):
        self.run, self.job, self.nproc, self.timeout = run, job, nproc, timeout
        self.task, self.max_restarts = task, max_restarts
        self.start = self.last_output = time.monotonic()
        # When the timeout's clock starts: at once for a warm run or a script, else when every
        # rank has started the function.
        self.clock = self.start if task is not None or job.mode == "script" else None
        self.returned_at: float | None = None  # when the last rank returned from the function
        self.exited_at: float | None = None  # when torchrun exited while its output went on
        self.next = self.start
        self.dead: list[int] = []  # ranks gone without a word, seen before the run was stopped
        self.stopped = False  # the supervisor stopped the run after a failure

    def check(self, out: _Output) -> bool:
        """Look at the run (at most every _CHECK_EVERY s); raise LaunchTimeout when it is
        overdue; True when the run is over although its output has not ended."""
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + _CHECK_EVERY
        run, task = self.run, self.task
        _track(run)
        if run.proc.poll() is not None:
            # Its output ends with it, unless a process it left behind holds the pipe open.
            self.exited_at = self.exited_at or now
            return now - self.exited_at > _GRACE
        if not self.max_restarts:  # with restarts, torchrun replaces failed ranks itself
            failed = any(run.run_dir.glob(ERRORS))
            gone = [] if failed else _silently_dead(run.run_dir, self.job.mode == "script")
            if gone or (failed and (task is None or task.settled(run.run_dir))):
                # Stop the peers now rather than after torchrun's own (up to 30 s) shutdown,
                # or never (torchrun takes a rank's exit code 0 for success, and waits).
                script = self.job.mode == "script"
                self.dead = gone or _silently_dead(run.run_dir, script)
                if self.dead and not _await_exits(run.run_dir, self.dead):
                    _await_agent(run, out, task)  # let torchrun say how the rank died
                if script and not failed:  # its exit status may have said "ended with code 0"
                    self.dead = _silently_dead(run.run_dir, script)
                    if not self.dead:
                        return False
                _stop(run)
                self.stopped = True
                return False
        if self.clock is None and len(list(run.run_dir.glob(READY))) >= self.nproc:
            self.clock = now
        returned = len(list(run.run_dir.glob(RESULTS)))
        if returned >= self.nproc:
            self.returned_at = self.returned_at or now
        if self.timeout is not None and self._overdue(now):
            raise _timed_out(run, self.nproc, self.timeout, out.logs,
                             started=self.clock is not None, task=task,
                             returned=self.returned_at is not None)
        if now - self.last_output > _HEARTBEAT:
            print(_progress_line(now - self.start, self.nproc - returned, self.nproc))
            self.last_output = now
        return False

    def _overdue(self, now: float) -> bool:
        if self.clock is None:
            return now - self.start > max(self.timeout, STARTUP_S)
        if now - self.clock <= self.timeout:
            return False
        # Once every rank has returned, what is left is the launcher's teardown (the group
        # destroyed, torchrun noticing the exits): not the function's time, but not forever.
        return (self.returned_at is None
                or now - self.returned_at > max(_TEARDOWN_S, self.timeout))


def _progress_line(elapsed: float, running: int, nproc: int) -> str:
    """The heartbeat of a quiet run; once every rank has returned, say what is left to wait for."""
    if running <= 0:
        return (f"[labkit] {elapsed:.0f} s elapsed: all {nproc} rank(s) have returned; waiting "
                f"for torchrun to shut the workers down")
    return f"[labkit] {elapsed:.0f} s elapsed, {running} of {nproc} rank(s) still running"


class _Output:
    """A run's output as it arrives: each rank's lines kept, shown (a batch at a time) unless
    filtered, progress lines drawn as bars, pieces of long lines joined again."""

    def __init__(self, show_ranks):
        self.show = None if show_ranks is None else (
            {show_ranks} if isinstance(show_ranks, int) else set(show_ranks))
        if self.show:  # an empty filter asks for silence: nothing to announce
            print(f"[labkit] showing rank(s) {sorted(self.show)} only; the others are hidden "
                  "(all lines are in result.logs)")
        self.logs: dict[int, list[str]] = {}
        self.agent_log: list[str] = []
        self.bars = ProgressBars()  # the ranks' labkit.progress bars, drawn as lines arrive
        self.pieces: dict[str, list[str]] = {}  # "[rankN]" -> the pieces of its unfinished line
        self.shown: list[str] = []

    def route(self, line: str) -> None:
        if MARKER in line:
            self.flush()  # a bar drawn as text comes after the lines printed before it
        head, sep, text = line.partition("] ")
        if line.startswith("[rank") and sep:
            if text.endswith(CONTINUES):
                self.pieces.setdefault(head, []).append(text[:-len(CONTINUES)])
                return
            if head in self.pieces:
                line = f"{head}] {''.join(self.pieces.pop(head))}{text}"
        shown = _sort_line(line, self.logs, self.agent_log, self.show, self.bars)
        if shown is not None:
            self.shown.append(shown)

    def flush(self, partial: bool = False) -> None:
        """Print what was routed; ``partial``: the end, where an unfinished line is whole."""
        if partial:
            for head, pieces in list(self.pieces.items()):
                del self.pieces[head]
                self.route(f"{head}] {''.join(pieces)}")
        if self.shown:
            print("\n".join(self.shown), flush=True)  # one write per batch, not per line
            self.shown = []


def _route(line: str, logs: dict, agent_log: list, show, bars: ProgressBars | None = None) -> None:
    """Keep a line in its rank's log and print it unless filtered; agent lines stay quiet."""
    shown = _sort_line(line, logs, agent_log, show, bars)
    if shown is not None:
        print(shown, flush=True)


def _sort_line(line: str, logs: dict, agent_log: list, show,
               bars: ProgressBars | None = None) -> str | None:
    """Keep a line in its rank's log; return it if it is to be shown. Agent lines stay quiet.

    A labkit.progress line updates the rank's bar in ``bars`` and is neither kept nor shown.
    """
    if line.startswith("[rank") and "] " in line:
        head, _, text = line.partition("] ")
        try:
            rank = int(head[5:])
        except ValueError:
            rank = None
        if rank is not None:
            # A progress line can land after a partial line the rank printed without "\n".
            text, marked, update = text.partition(MARKER)
            if marked:
                if bars is not None and (show is None or rank in show):
                    bars.feed(rank, update)
                if not text:
                    return None
                line = f"{head}] {text}"
            logs.setdefault(rank, []).append(text)
            return line if show is None or rank in show else None
    agent_log.append(line)
    return None


def _track(run: _Run) -> None:
    """Remember every descendant of torchrun: workers run in sessions of their own."""
    import psutil

    try:
        for child in psutil.Process(run.proc.pid).children(recursive=True):
            run.known.setdefault(child.pid, child)
    except psutil.Error:
        pass


def _stop(run: _Run) -> int:
    """SIGTERM torchrun and every worker, SIGKILL what is left after a grace period."""
    import psutil

    if run.proc.poll() is None:
        _track(run)
    procs = [p for p in run.known.values() if p.is_running()]
    if run.proc.poll() is None:
        try:
            os.killpg(run.proc.pid, signal.SIGTERM)
        except OSError:
            pass
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=_GRACE)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        run.proc.wait(timeout=_GRACE)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
    run.reader.join(timeout=_GRACE)
    return len(procs)


def _rank_of(path: Path) -> int:
    """The rank in a run-folder file name: ``pid-3``, ``result-3.pkl`` -> 3."""
    return rank_of(path.name)


def _rank_pids(run_dir: Path) -> dict[int, int]:
    import json

    out = {}
    for f in run_dir.glob(PIDS):
        out[_rank_of(f)] = json.loads(f.read_text())["pid"]
    return out


def _timed_out(run: _Run, nproc: int, timeout: float, logs: dict, started: bool = True,
               task: _Task | None = None, returned: bool = False) -> LaunchTimeout:
    """Ask every unfinished rank for its Python stack, then build the LaunchTimeout.

    ``returned``: every rank had returned, but some did not end (a cold rank's process, a warm
    rank's end-of-task mark) within _TEARDOWN_S: those are the stuck ones.
    """
    finished = {_rank_of(f) for f in run.run_dir.glob(RESULTS)}
    pids = _rank_pids(run.run_dir)
    if returned:
        stuck = sorted(r for r, pid in pids.items()
                       if (r not in task.ended if task is not None else _alive(pid)))
    else:
        stuck = sorted(r for r in pids if r not in finished)
    stacks = _ask_stacks(run.run_dir, {r: pids[r] for r in stuck})
    never_started = sorted(set(range(nproc)) - set(pids)) if len(pids) < nproc else []
    if returned:
        parts = [f"the run did not finish within timeout={timeout:g} s: every rank returned "
                 f"from the function, but rank(s) {', '.join(map(str, stuck)) or '?'} did not "
                 f"end within {max(_TEARDOWN_S, timeout):g} s after (a thread still running, or "
                 "a process group in use?)."]
    elif started:
        parts = [f"the run did not finish within timeout={timeout:g} s."]
    else:
        parts = [f"the workers did not start the function within {max(timeout, STARTUP_S):g} s "
                 f"(importing torch, forming the process group): a machine too busy, or a "
                 f"rendezvous that never completes."]
    if stuck and not returned:
        done = ', '.join(map(str, sorted(finished)))
        parts.append(f"Stuck rank(s): {', '.join(map(str, stuck))}"
                     + (f" (rank(s) {done} had finished)" if finished else ""))
    if never_started:
        parts.append(
            "Some ranks never started (still in rendezvous): check nnodes and rdzv_endpoint.")
    for rank in stuck:
        stack = stacks[rank].strip() or (
            "(it did not answer: it blocks or handles SIGUSR1 itself, or closed the file its "
            "stack is written to)")
        parts.append(f"\n--- rank {rank} stack (most recent call first) ---\n{stack}")
    if not returned:
        parts.append("\nA rank waiting in a collective that another rank skipped is the usual "
                     "cause; run with TORCH_DISTRIBUTED_DEBUG=DETAIL to name the mismatch.")
    return LaunchTimeout("\n".join(parts), stuck=stuck, stacks=stacks, logs=logs)


def _ask_stacks(run_dir: Path, pids: dict[int, int]) -> dict[int, str]:
    """Each rank's Python stack, dumped by faulthandler on STACK_SIGNAL; '' where none came
    within _STACK_WAIT seconds."""
    def size(rank):
        try:
            return (run_dir / stack_file(rank)).stat().st_size
        except OSError:
            return -1

    before = {r: size(r) for r in pids}
    for pid in pids.values():
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            pass
    deadline = time.monotonic() + _STACK_WAIT
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        waiting = {r for r in waiting if size(r) <= before[r]}
    time.sleep(0.1)  # a dump under way: let it finish
    stacks = {}
    for rank in pids:
        try:
            dump = (run_dir / stack_file(rank)).read_bytes()[max(before[rank], 0):]
        except OSError:
            dump = b""
        stacks[rank] = _clean_stack(dump.decode(errors="replace"))
    return stacks


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _clean_stack(dump: str) -> str:
    """Drop labkit's own threads and shim frames from a faulthandler dump: the user's code
    remains."""
    own_threads = (" in _watch_controller", " in pump")
    keep = []
    for block in dump.strip().split("\n\n"):
        lines = block.split("\n")
        if any(ln.endswith(own_threads) for ln in lines):
            continue
        keep.append("\n".join(ln for ln in lines
                               if "labkit/_worker.py" not in ln and "<frozen runpy>" not in ln))
    return "\n\n".join(keep)


def _report_restarts(run_dir: Path, errors: list[dict]) -> None:
    """After a run that finished under max_restarts: say which failures it came through."""
    # torchrun logs each attempt of the worker group into its own attempt_N folder.
    restarts = len(list(run_dir.glob("torchelastic/*/attempt_*"))) - 1
    if restarts > 0 or errors:
        said = "; ".join(f"rank {e['rank']} raised {e['type']}: {e['message'][:200]}"
                         for e in errors) or "no rank raised a Python exception"
        print(f"[labkit] torchrun restarted the workers {restarts} time(s), then the run "
              f"finished. Before that: {said}. (A rank that was killed leaves no exception; "
              f"its peers then report a lost connection.)")


def _errors(run_dir: Path) -> list[dict]:
    """Every rank's error record in the run folder, the earliest first."""
    import cloudpickle

    return sorted((cloudpickle.loads(f.read_bytes()) for f in run_dir.glob(ERRORS)),
                  key=lambda e: e["time"])


_AGENT_REPORT = 5.0  # seconds torchrun gets to report how a dead rank ended


def _await_agent(run: _Run, out: _Output, task: _Task | None = None) -> None:
    """Route output until torchrun exits by itself, or a few seconds pass.

    torchrun notices a dead rank within its monitor interval (0.1 s), stops the others and then
    prints each rank's exit status. Stopping torchrun first would lose that report.
    """
    deadline = time.monotonic() + _AGENT_REPORT
    while time.monotonic() < deadline:
        lines, ended = _drain(run.lines)
        for line in lines:
            if task is not None:
                line = task.take(line)  # a warm rank's end-of-task mark is no output
            if line:
                out.route(line)
        out.flush()
        if ended:
            run.lines.put(None)  # the end of the output, for the supervisor's loop
            return


def _silently_dead(run_dir: Path, script: bool = False) -> list[int]:
    """Ranks whose process is gone without a result or an error: killed, a native crash, or
    an exit the function did not return from (os._exit). A script's rank that exited with
    code 0 just ended (it reports no value)."""
    import psutil

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    # Gone first, files second: a rank that writes its result and exits in between is no death.
    ended = [r for r, pid in _rank_pids(run_dir).items() if gone(pid)]
    dead = [r for r in ended if not _has_outcome(run_dir, r)]
    if script:
        codes = _recorded_exits(run_dir)
        dead = [r for r in dead if codes.get(r, (None,))[0] != 0]
    return sorted(dead)


def _has_outcome(run_dir: Path, rank: int) -> bool:
    return any((run_dir / name(rank)).exists() for name in (result_file, error_file))


def _without_outcome(run_dir: Path, nproc: int) -> list[int]:
    """Ranks that neither returned nor raised (after the run: every rank has ended).

    The files are named by global rank: on node k of a multi-node run this node's ranks are
    k * nproc onwards, so the ranks asked about are those that registered here.
    """
    ranks = sorted(_rank_pids(run_dir)) or range(nproc)
    return [r for r in ranks if not _has_outcome(run_dir, r)]


def _recorded_exits(run_dir: Path) -> dict[int, tuple[int, float]]:
    """rank -> (exit status, when) of each rank process torchrun's agent saw end (-N: signal N)."""
    found = {}
    for rank, pid in _rank_pids(run_dir).items():
        path = run_dir / exit_file(pid)
        try:
            found[rank] = (int(path.read_text()), path.stat().st_mtime)
        except (OSError, ValueError):
            pass
    return found


def _await_exits(run_dir: Path, ranks: list[int], within: float = 2.0) -> bool:
    """Wait until torchrun's agent has recorded how each of ``ranks`` ended; False if it did
    not within ``within`` seconds (then its closing report is the only record)."""
    deadline = time.monotonic() + within
    while not set(ranks) <= set(_recorded_exits(run_dir)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _failure(error: dict | None, returncode: int, agent_log: list, logs: dict,
             dead: list[int] = (), run_dir: Path | None = None) -> LaunchError:
    """The LaunchError of a failed run: the root cause first, what followed from it after."""
    full = _full_text(error) if error is not None else None
    pids = _rank_pids(run_dir) if run_dir is not None else {}
    # A rank that wrote an error record exited by itself after raising: not a death.
    exits = [(r, code) for r, code in _exit_codes(agent_log, pids).items()
             if run_dir is None or not (run_dir / error_file(r)).exists()]
    # The ranks that ended unasked, in the order they ended, with what the agent recorded.
    recorded = _recorded_exits(run_dir) if run_dir is not None else {}
    ordered = sorted(dead, key=lambda r: recorded.get(r, (0, float("inf")))[1])
    exits += [(r, recorded.get(r, (None,))[0]) for r in ordered if r not in dict(exits)]
    if exits:
        rank, code = exits[0]
        text = _death(rank, code, logs, run_dir)
        if error is not None:
            # The peers of a killed rank fail with "connection reset": a consequence, not the cause.
            text += (f"\n\nThen rank {error['rank']} failed with {error['type']}: "
                     f"{_shorten(error['message'])}")
        return LaunchError(text, rank=rank, logs=logs, full_message=full)
    if error is not None:
        return LaunchError(_raised(error), rank=error["rank"], logs=logs, full_message=full)
    said = "\n".join(line for line in agent_log[-30:] if not line.startswith(_AGENT_NOISE))
    return LaunchError(
        f"torchrun exited with code {returncode} and no rank reported a Python exception: a worker "
        f"was killed (out of memory?) or crashed in native code. torchrun said:\n{said}", logs=logs)


_MESSAGE_LINES, _MESSAGE_CHARS = 10, 1000  # of an exception's text, in a LaunchError's message
_TRACEBACK_LINES, _LINE_CHARS = 40, 300  # the traceback's tail: the frames nearest the error


def _shorten(text: str) -> str:
    """The first lines of a long exception text (a tensor in the message can fill a screen)."""
    cut = "\n".join(text.split("\n")[:_MESSAGE_LINES])[:_MESSAGE_CHARS]
    if cut == text:
        return text
    return (f"{cut.rstrip()}\n... ({len(text) - len(cut)} more characters: the LaunchError's "
            f".full_message has the whole text)")


def _raised(error: dict) -> str:
    """"rank N failed with T: text" and the traceback's tail, a huge text shortened."""
    message = _shorten(error["message"])
    tb = error["traceback"].rstrip("\n")
    only = error.get("exception_only", "").rstrip("\n")
    body, end = (tb[:-len(only)], only) if only and tb.endswith(only) else (tb, "")
    if message != error["message"] and end:
        # The traceback ends with the exception's text again: the lines above show it already.
        end = f"{end.partition(': ')[0]}: (its text is shown above, shortened)"
    lines = body.rstrip("\n").split("\n") if body.strip() else []
    lines = [ln if len(ln) <= _LINE_CHARS else ln[:_LINE_CHARS] + " ..." for ln in lines]
    if len(lines) > _TRACEBACK_LINES:
        lines = [f"... ({len(lines) - _TRACEBACK_LINES} earlier lines: the LaunchError's "
                 f".full_message has the whole traceback)", *lines[-_TRACEBACK_LINES:]]
    shown = "\n".join([*lines, end] if end else lines)
    return (f"rank {error['rank']} failed with {error['type']}: {message}\n\n"
            f"--- rank {error['rank']} traceback ---\n{shown}")


def _full_text(error: dict) -> str:
    """A rank's whole exception text and traceback, as LaunchError.full_message."""
    return (f"rank {error['rank']} failed with {error['type']}: {error['message']}\n\n"
            f"--- rank {error['rank']} traceback ---\n{error['traceback'].rstrip()}")


# torchrun's agent names the first failure in a line "failed (exitcode: -9) local_rank: 1 (pid:
# 42) of binary: ..." and every failure in its closing summary ("rank : 1 (local_rank: 1)", then
# "exitcode : -9 (pid: 42)  (SIGKILL)"). It logs the signals it sends the survivors itself
# ("Sending process 41 closing signal SIGTERM"): those ranks did not fail, they were stopped.
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: \d+ \(pid: (\d+)\)")
_SUMMARY_RANK = re.compile(r"^\s*rank\s*: (\d+) \(local_rank: \d+\)")
_SUMMARY_EXIT = re.compile(r"^\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)")
_AGENT_CLOSED = re.compile(r"Sending process (\d+) closing signal")


def _exit_codes(agent_log: list, pids: dict[int, int]) -> dict[int, int]:
    """rank -> non-zero exit code of every worker torchrun saw fail (-N: killed by signal N)."""
    rank_of = {pid: rank for rank, pid in pids.items()}
    stopped = {int(m[1]) for line in agent_log if (m := _AGENT_CLOSED.search(line))}
    found: list[tuple[bool, int, int]] = []  # (root cause, rank, exit code) in the order said
    rank, root = None, False
    for line in agent_log:
        root = root or "Root Cause" in line
        if m := _AGENT_FAILED.search(line):
            pid, code = int(m[2]), int(m[1])
            if pid in rank_of and pid not in stopped:
                found.append((True, rank_of[pid], code))
        elif m := _SUMMARY_RANK.match(line):
            rank = int(m[1])
        elif (m := _SUMMARY_EXIT.match(line)) and rank is not None:
            if int(m[2]) not in stopped:
                found.append((root, rank, int(m[1])))
            rank = None
    codes: dict[int, int] = {}
    for _, r, code in sorted(found, key=lambda f: not f[0]):  # the root cause first
        if code != 0:
            codes.setdefault(r, code)
    return codes


# What usually sends a training process each signal: where to look next.
_SIGNAL_CAUSES = {
    "SIGKILL": "the out-of-memory killer, a `kill`, or a crash in native code; see `dmesg`",
    "SIGSEGV": "a crash in native code (a C++/CUDA extension or library read memory it must "
               "not); the Python stack below shows the call that crashed",
    "SIGBUS": "a crash in native code; in a container this is often a full /dev/shm (run it "
              "with --ipc=host or --shm-size=16g)",
    "SIGABRT": "native code aborted, usually a failed C++ check whose message is in the rank's "
               "last output lines",
    "SIGFPE": "a crash in native code (an integer division by zero)",
    "SIGILL": "native code built for another CPU",
    "SIGTERM": "it was stopped from outside: a `kill`, or a job scheduler's time limit",
    "SIGINT": "it was interrupted (Ctrl-C, or a `kill -INT`)",
}
_CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL")  # faulthandler's stack


def _death(rank: int, code: int | None, logs: dict, run_dir: Path | None) -> str:
    """Why a rank ended without a Python exception: its signal (and stack) or its exit code."""
    if code is None:
        text = (f"rank {rank} died without a Python exception (killed by a signal: the "
                "out-of-memory killer, a `kill`, or a crash in native code; see `dmesg`)")
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        cause = _SIGNAL_CAUSES.get(name, "a signal from outside, or a crash in native code")
        text = f"rank {rank} was killed by {name} (signal {-code}): {cause}"
        stack = _crash_stack(run_dir, rank) if name in _CRASH_SIGNALS else ""
        if stack:
            text += f"\n\n--- rank {rank} Python stack at the crash (most recent call first) ---\n"
            text += stack
    else:
        text = (f"rank {rank} exited with code {code} without a Python exception and without "
                f"returning from the function: something called os._exit({code}), or native "
                "code ended the process")
    last = [ln if len(ln) <= _LINE_CHARS else ln[:_LINE_CHARS] + " ..."
            for ln in logs.get(rank, [])[-5:]]
    if last:
        text += f"\n\n--- rank {rank} last output lines ---\n" + "\n".join(last)
    return text


def _crash_stack(run_dir: Path | None, rank: int) -> str:
    """The Python stack faulthandler wrote when the rank crashed, without labkit's threads."""
    try:
        dump = (run_dir / stack_file(rank)).read_text(errors="replace")
    except (OSError, TypeError):
        return ""
    blocks = _clean_stack(dump).split("\n\n")
    return "\n\n".join(b for b in blocks if b.strip() and not b.startswith(("Extension modules",
                                                                          "Fatal Python")))


def _collect(run_dir: Path) -> list:
    import cloudpickle

    values = []
    for f in sorted(run_dir.glob(RESULTS), key=_rank_of):
        values.append(cloudpickle.loads(f.read_bytes()))
    return values


def _print_other_nodes(fn, nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str) -> None:
    """Tell the learner what every other node must run to join this rendezvous."""
    others = [r for r in range(nnodes) if r != node_rank]
    lines = [f"[labkit] node {node_rank} of {nnodes} joins the rendezvous at {rdzv_endpoint}. "
             f"On node(s) {', '.join(map(str, others))} run the same call with "
             "node_rank=<that node>, or:"]
    target = str(fn) if isinstance(fn, str | os.PathLike) else "your_script.py"
    for r in others:
        lines.append("  " + shlex.join(["torchrun", "--nnodes", str(nnodes), "--node-rank", str(r),
                                        "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                                        "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", "labkit",
                                        target]))
    # One write: agents of several nodes started from one process (launch_together) would
    # otherwise interleave their lines.
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


_KEPT = "kept"  # in a run folder that keep_run_dir=True asked to keep


def _new_run_dir() -> Path:
    """A private (0700) run folder named after this controller: ``labkit-run-<pid>.<start>-``.

    torchrun's agent removes the folder of a controller that died, but a kernel killed in the
    moment between making the folder and starting the agent leaves it with nobody to remove
    it; the name lets the next launch (or :func:`stop_workers`) see that its owner is gone.
    """
    sweep_run_folders()
    return Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{os.getpid()}.{_started(os.getpid())}-"))


def _started(pid: int) -> int | None:
    import psutil

    try:
        return round(psutil.Process(pid).create_time())
    except (psutil.Error, OSError):
        return None


def sweep_run_folders() -> list[Path]:
    """Remove the run folders of controllers that are gone, and return them.

    A folder belongs to the process whose pid and start time its name holds; it is left where
    that process still runs (a pid reused by a later process does not count), where it was kept
    on purpose (``keep_run_dir=True``), or where it is another user's.
    """
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{RUN_PREFIX}*.*-*"):
        owner = re.fullmatch(rf"{re.escape(RUN_PREFIX)}(\d+)\.(\d+)-\w+", folder.name)
        try:
            if (owner is None or not folder.is_dir() or (folder / _KEPT).exists()
                    or folder.stat().st_uid != os.getuid()):
                continue
        except OSError:
            continue
        pid, start = int(owner[1]), int(owner[2])
        now = _started(pid)
        if now is None or abs(now - start) > 1:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def stray_workers() -> list[str]:
    """Worker processes that this process's ``labkit.launch`` runs left alive: should be none.

    A notebook's last cell asserts it (``assert not labkit.stray_workers()``): every launch
    stops its whole process group, even after a failure, a timeout or an interrupt. Finds
    torchrun agents and worker shims by their command line, and keeps those whose environment
    names this process as their controller, so runs of another notebook do not count.
    The processes of warm workers that are running (:func:`workers`) are not strays: they
    are owned; once stopped, any of theirs still alive is listed. :func:`stop_workers` ends
    every process listed here. Returns ``"pid: command line"`` strings.

    Example::

        >>> labkit.stray_workers()
        []
    """
    found = []
    for proc, cmdline in _strays():
        line = " ".join(cmdline)  # the agent's boot script spans several lines
        line = " ".join(line.split())
        if len(line) > 160:  # keep the start and the run folder at the end
            line = f"{line[:60]} ... {line[-95:]}"
        found.append(f"{proc.pid}: {line}")
    return found


def _strays() -> list:
    """(psutil.Process, command line) of each torchrun agent or worker shim of this process's
    launches that no running pool owns."""
    import psutil

    me = str(os.getpid())
    owned = set().union(*(pool.owned_pids() for pool in list(_LIVE)))
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        joined = " ".join(cmdline)
        if "labkit._worker" not in joined and RUN_PREFIX not in joined:
            continue
        try:
            controller = proc.environ().get(CONTROLLER_PID)
            if proc.status() == psutil.STATUS_ZOMBIE:  # ended; its parent has not reaped it
                continue
        except (psutil.Error, OSError):  # gone meanwhile, or another user's process
            continue
        if controller == me and proc.pid not in owned:
            found.append((proc, cmdline))
    return found


def _end_strays() -> int:
    """SIGTERM every stray, SIGKILL what is left after a grace period, and remove the run
    folders named on their command lines; count them."""
    import psutil

    strays = _strays()
    for proc, _ in strays:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs([p for p, _ in strays], timeout=_GRACE)
    for proc in alive:  # it ignores SIGTERM
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=_GRACE)
    for _, cmdline in strays:
        folder = Path(cmdline[-1]) if cmdline else None
        if folder is not None and folder.name.startswith(RUN_PREFIX) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
    return len(strays)


# ---- warm workers: one torchrun run in "serve" mode, many runs ---------------------------------

MAX_IDLE_POOLS = 2  # sets of warm workers launch(warm=True) keeps; each idle rank holds torch
_SETTLE = 1.0  # seconds a failed warm rank gets to mark its end (its last output) before the stop
_WARM: bool | None = None  # use_warm()'s choice; None: the LABKIT_WARM variable decides
_LIVE: list[Workers] = []  # every pool started in this process and not stopped
_KERNEL_POOLS: collections.OrderedDict = collections.OrderedDict()  # shape -> pool, LRU first
_REGISTRY = threading.Lock()  # guards _LIVE and _KERNEL_POOLS
_STARTING = threading.Lock()  # held while launch(warm=True) looks up or starts a kernel pool
_STOP_WAIT = 30.0  # seconds stop() waits for a run in another thread before stopping under it

_TF_COLD = ("TensorFlow cannot run on warm workers: MultiWorkerMirroredStrategy configures its "
            "collectives and starts its gRPC server once per process, and neither can be reset "
            "between runs (a failed or changed setup would break every later run). Use "
            "warm=False: TensorFlow runs always start fresh workers")
_SCRIPT_COLD = ("a script calls init_process_group itself and expects a fresh process, while a "
                "warm rank has its process group formed already. Launch scripts with warm=False, "
                "or move the script's body into a function and launch that")


@dataclasses.dataclass
class _Task:
    """A run on warm workers as the supervisor follows it: which ranks have marked its end."""

    number: int
    ended: set = dataclasses.field(default_factory=set)
    failed_at: float | None = None

    def take(self, line: str) -> str:
        """Note and strip a rank's end-of-task mark; return what remains of the line."""
        head, marked, tail = line.partition(END_OF_TASK)
        if not marked or not head.startswith("[rank"):
            return line
        prefix, _, text = head.partition("] ")
        try:
            rank, number = int(prefix[5:]), int(tail)
        except ValueError:
            return line
        if number == self.number:
            self.ended.add(rank)
        return head if text else ""  # the mark can follow a line printed without "\n"

    def ended_by_all(self, nproc: int) -> bool:
        return len(self.ended) >= nproc

    def settled(self, run_dir: Path) -> bool:
        """Whether the failed ranks' output is all in (they marked the end), or _SETTLE passed."""
        if {_rank_of(f) for f in run_dir.glob(ERRORS)} <= self.ended:
            return True
        now = time.monotonic()
        self.failed_at = self.failed_at or now
        return now - self.failed_at > _SETTLE


class Workers:
    """Warm ranks that run function after function: see :func:`workers`."""

    def __init__(self, nproc: int = 2, backend: str = "auto", framework: str = "torch",
                 env: dict | None = None):
        if framework == "tensorflow":
            raise ValueError(_TF_COLD)
        # The shape is checked as a function run's would be; the functions come with .run().
        job, self._gpus = _validate(Workers.run, (), {}, nproc, backend, None, framework, 1, 0,
                                    None)
        self._job = dataclasses.replace(job, mode="serve", payload=None)
        self.nproc, self.backend, self.framework = nproc, job.backend, framework
        self.env = _check_env(env)
        self.start_seconds = 0.0  # how long the last start took (torchrun, torch, the group)
        self.runs = 0  # runs served, over every restart
        self._lock = threading.Lock()  # one run at a time
        self._run: _Run | None = None
        self._run_dir: Path | None = None
        self._fifos: list[int] = []
        self._command: list[str] = []
        self._tasks = 0  # the number of the last task sent to this torchrun run
        self._base_env: dict = {}
        self._lost: str | None = None  # why the last ranks were stopped, said at the next start
        self._stopped = False
        with _REGISTRY:
            _LIVE.append(self)
        try:
            self._boot()
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = ("stopped" if self._stopped else "running" if self._running()
                 else "to restart on the next run")
        return (f"Workers(nproc={self.nproc}, backend={self.backend!r}, {state}, "
                f"{self.runs} run(s))")

    def run(self, fn, *args, timeout: float | None = None, show_ranks=None,
            **kwargs) -> LaunchResult:
        """Run ``fn(*args, **kwargs)`` on the warm ranks; a :class:`LaunchResult` as from launch.

        Example::

            >>> pool = labkit.workers(nproc=2)
            >>> pool.run(total, 10, show_ranks=0, timeout=60).values
            [21, 21]
        """
        __tracebackhide__ = True
        return self.run_if_free(fn, args, kwargs, timeout, show_ranks, wait=True)

    def run_if_free(self, fn, args, kwargs, timeout, show_ranks, *,
                    wait: bool) -> LaunchResult | None:
        """``run``; or, with ``wait=False``, None at once if another thread's run holds the pool."""
        __tracebackhide__ = True
        if isinstance(fn, str | os.PathLike):
            raise ValueError(f"warm workers run functions, not scripts: {_SCRIPT_COLD}")
        if not callable(fn):
            raise TypeError(f"run() needs a function, got {type(fn).__name__}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0 (or None for none), "
                             f"got {timeout!r}")
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            if self._stopped:
                raise RuntimeError("these warm workers were stopped (by `with`, .stop() or "
                                   "labkit.stop_workers()): start new ones with "
                                   "labkit.workers(...), or use labkit.launch(fn, warm=True)")
            if not self._running():
                why = self._lost or "their torchrun exited while they were idle"
                print(f"[labkit] the warm workers were stopped after {why}; starting "
                      f"{self.nproc} fresh ones", flush=True)
                self._teardown()
                self._boot()
            return self._dispatch(fn, args, kwargs, timeout, show_ranks)
        finally:
            self._lock.release()

    def pids(self) -> list[int]:
        """The pool's processes: the torchrun agent, then rank 0, 1, ...; [] while none runs."""
        run = self._run
        if run is None or run.proc.poll() is not None:
            return []
        try:
            ranks = _rank_pids(run.run_dir)
        except OSError:  # stopped meanwhile
            return []
        return [run.proc.pid, *(ranks[r] for r in sorted(ranks))]

    def owned_pids(self) -> set[int]:
        """Every live process of the pool: torchrun and all its descendants."""
        import psutil

        run = self._run
        if run is None or run.proc.poll() is not None:
            return set()
        try:
            children = psutil.Process(run.proc.pid).children(recursive=True)
        except psutil.Error:
            return set()
        return {run.proc.pid, *(c.pid for c in children)}

    def stop(self) -> None:
        """Stop the ranks and remove their run folder; the pool cannot run again."""
        # A run in another thread ends first; at exit, a stuck daemon thread must not block.
        locked = self._lock.acquire(timeout=_STOP_WAIT)
        try:
            self._stopped = True
            self._teardown(quit=True)
        finally:
            if locked:
                self._lock.release()
        with _REGISTRY:
            if self in _LIVE:
                _LIVE.remove(self)
            for key in [k for k, pool in _KERNEL_POOLS.items() if pool is self]:
                del _KERNEL_POOLS[key]

    def _running(self) -> bool:
        return self._run is not None and self._run.proc.poll() is None

    def _boot(self) -> None:
        """Start torchrun in serve mode and wait until every rank has formed the group."""
        __tracebackhide__ = True
        began = time.monotonic()
        self._run_dir = _new_run_dir()
        try:
            for rank in range(self.nproc):
                path = self._run_dir / fifo_file(rank)
                os.mkfifo(path, 0o600)
                # Read-write: the open does not wait for a reader, and this process holds the
                # FIFO's only writer, so a rank's read sees EOF the moment this process dies.
                self._fifos.append(os.open(path, os.O_RDWR))
            _write_job(self._run_dir, self._job)
            self._command = _torchrun_command(self._run_dir, self.nproc, 1, 0, None)
            self._base_env = _worker_env(self.nproc, self._gpus, self.env)
            self._tasks = 0
            self._run = _start(self._run_dir, self._command, self._base_env)
            _supervise(self._run, self._job, self.nproc, None, None, self._command,
                       task=_Task(0))  # "task 0" ends when a rank has formed the group
        except BaseException:
            self._teardown()
            raise
        self._lost = None
        self.start_seconds = time.monotonic() - began

    def _dispatch(self, fn, args, kwargs, timeout, show_ranks) -> LaunchResult:
        """Send one task to every rank and supervise it; stop the ranks if it fails."""
        __tracebackhide__ = True
        number = self._tasks + 1
        task = Task(number, (fn, args, kwargs), _sys_path(), os.getcwd(), self._env_changes())
        _write_job(self._run_dir, task, task_file(number))  # unpicklable: nothing was sent
        self._tasks = number
        served: list[LaunchResult] = []

        def cleanup():
            if not served:  # failed, timed out, interrupted: the ranks are stopped
                self._teardown()
            elif retired := sorted(self._run_dir.glob(RETIRES)):
                # The run changed what a rank cannot put back: fresh ranks for the next run.
                self._lost = retired[0].read_text()
                self._teardown(quit=True)
            if self._run_dir is not None:  # the next task finds a clean folder
                names = [task_file(number), *(f(r) for r in range(self.nproc)
                                               for f in (result_file, error_file))]
                for name in names:
                    (self._run_dir / name).unlink(missing_ok=True)

        with _Shield(cleanup):
            try:
                for fd in self._fifos:
                    os.write(fd, RUN_TASK)
                served.append(_supervise(self._run, self._job, self.nproc, timeout, show_ranks,
                                         self._command, task=_Task(number)))
            except BaseException as exc:
                self._lost = _lost_by(exc)
                raise
        self.runs += 1
        return served[0]

    def _env_changes(self) -> dict[str, str | None]:
        """What a cold run started now would see differently in its environment."""
        now = _worker_env(self.nproc, self._gpus, self.env)
        changes: dict[str, str | None] = {k: v for k, v in now.items()
                                          if self._base_env.get(k) != v}
        changes.update((k, None) for k in self._base_env if k not in now)
        for key in (CONTROLLER_PID, CONTROLLER_START):
            changes.pop(key, None)
        return changes

    def _teardown(self, quit: bool = False) -> None:
        """Stop every process of the pool and remove its run folder; ``quit`` asks them first.
        No interrupt cuts it short (see _Shield)."""
        with _Shield(lambda: self._stop_all(quit)):
            pass

    def _stop_all(self, quit: bool) -> None:
        run, self._run = self._run, None
        fifos, self._fifos = self._fifos, []
        if run is not None:
            if quit and run.proc.poll() is None:
                # The ranks leave their loop and destroy the group themselves: NCCL's
                # communicators are closed rather than killed under way.
                for fd in fifos:
                    try:
                        os.write(fd, QUIT)
                    except OSError:
                        pass
                try:
                    run.proc.wait(timeout=_GRACE)
                except subprocess.TimeoutExpired:
                    pass
            _stop(run)
        for fd in fifos:
            try:
                os.close(fd)
            except OSError:
                pass
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None


def _lost_by(exc: BaseException) -> str:
    """Why a warm run's ranks were stopped, for the line the next start prints."""
    if isinstance(exc, LaunchTimeout):
        return "the last run timed out"
    if isinstance(exc, LaunchError):
        return "the last run failed"
    if isinstance(exc, KeyboardInterrupt):
        return "the last run was interrupted"
    return f"the last run ended with {type(exc).__name__}"


def workers(nproc: int = 2, backend: str = "auto", framework: str = "torch",
            env: dict | None = None) -> Workers:
    """Start ``nproc`` warm ranks that run function after function, in milliseconds each.

    ``labkit.launch`` starts torchrun, imports torch in every rank and forms the process
    group for every run: seconds each time. Warm workers do that once; ``.run(fn, *args,
    timeout=None, show_ranks=None, **kwargs)`` then sends ``fn`` to ranks already waiting
    and returns the same :class:`LaunchResult`, with the same live output, errors and
    timeouts. ``labkit.launch(fn, warm=True)`` does this with the kernel's own pool.

    Example::

        >>> with labkit.workers(nproc=2) as pool:   # ~3 s: torchrun, torch, the group
        ...     print(pool.run(total, 10).values)   # ~0.02 s
        ...     print(pool.run(total, 20, timeout=30).values)
        [21, 21]
        [41, 41]

    Every run starts as a fresh process would: torch's (CPU and CUDA), Python's and NumPy's
    random generators are reseeded from fresh entropy, so ``torch.manual_seed`` inside a run
    gives the numbers of a cold run. Afterwards the ranks put back the thread count, default
    dtype and device, grad mode, anomaly detection, deterministic algorithms, float32 matmul
    precision, print options (``torch.set_printoptions``), denormal flushing, the switches of
    ``torch.backends`` (cuDNN, oneDNN/mkldnn, TF32, reduced-precision reductions, opt_einsum,
    the CUDA attention kernels), ``os.environ``, the working directory, the umask,
    ``sys.path``, ``sys.argv``, ``sys.stdout``/``sys.stderr`` and file descriptors 1 and 2
    (output reaches the cell again after a run redirected or closed them), and the warning
    filters. Process groups the run created are destroyed; if the run destroyed or replaced
    the default group on any rank, or sent or received point-to-point messages (one left
    unmatched would reach the next run), every rank forms the default group again. What no
    reset can undo makes the next run start fresh ranks, with a line that says so: a call of
    ``torch.set_num_interop_threads`` (allowed once per process), a process group the run
    formed itself with ``init_process_group``. On GPUs the cached memory is given back, and a
    line says if the run left CUDA tensors alive.

    What persists between runs: imported modules (``sys.modules``: after editing a module's
    file, ``labkit.stop_workers()`` for fresh ranks), module-level state (the globals of
    imported modules, functions pickled by reference included; class attributes; caches
    such as ``functools.lru_cache`` or ``torch.compile``'s), threads a run started, signal
    handlers, logging setup, files written and file descriptors other than 1 and 2 left open,
    torch's inter-op thread pool once a run used it (a later ``set_num_interop_threads``
    then fails, as in a process that used it), other process-wide settings not named above
    (``sys.setrecursionlimit``, CPU affinity, resource limits), and on GPUs the CUDA context,
    the NCCL communicators and compiled kernels. Functions from notebook cells travel by value
    with fresh globals each run. Variables the kernel sets in ``os.environ`` after the pool
    started reach each run, as they would a cold one, but torch and NCCL read theirs
    (``TORCH_DISTRIBUTED_DEBUG``, ``NCCL_DEBUG``, ...) when the pool starts: pass those in
    ``env=``, which makes a pool of its own.

    After a run that fails, times out or is interrupted, the ranks are stopped (every process
    and the run folder): the next run starts fresh ones and says so in one line. Each idle
    rank holds torch in memory (about 300 MB; on GPUs also a CUDA context): ``with`` or
    ``.stop()`` ends a pool, ``labkit.stop_workers()`` every pool, and all end with the
    kernel, even one that is killed. ``launch(warm=True)`` keeps at most
    ``MAX_IDLE_POOLS`` (2) shapes, stopping the least recently used. ``.pids()`` lists the
    pool's processes; :func:`stray_workers` does not count them while the pool runs.
    TensorFlow cannot run warm (its collectives are set up once per process).
    """
    return Workers(nproc, backend, framework, env)


def stop_workers() -> int:
    """Stop every set of warm workers this kernel holds (launch's and :func:`workers`'); count them.

    Any other process :func:`stray_workers` lists (one that outlived its run) is ended too,
    SIGKILLed if it ignores SIGTERM, and its run folder removed.

    Example::

        >>> labkit.launch(total, 10, warm=True)
        >>> labkit.stop_workers()     # the ranks exit; the next warm run starts fresh ones
        1
    """
    with _REGISTRY:
        pools = list(_LIVE)
    for pool in pools:
        pool.stop()
    with _Shield(_end_strays):
        pass
    sweep_run_folders()
    return len(pools)


atexit.register(stop_workers)


def use_warm(on: bool | None = True) -> None:
    """Make warm workers the default of ``labkit.launch`` and ``%%distributed`` in this kernel.

    ``use_warm(True)``: every ``launch`` that does not say ``warm=False`` reuses the
    kernel's warm workers (:func:`workers`) where it can, and runs cold where it cannot (a
    script, several nodes, ``max_restarts``, ``keep_run_dir``, TensorFlow). ``use_warm(False)``:
    cold unless ``warm=True``. ``use_warm(None)``: back to the ``LABKIT_WARM`` environment
    variable (``LABKIT_WARM=1``: warm by default; unset or 0: cold). ``LABKIT_WARM=never``
    overrides them all: every run starts fresh workers, ``warm=True`` included (to time the
    cold path, or to rule warm workers out when something misbehaves).

    Example::

        >>> labkit.use_warm(True)
        >>> labkit.launch(total, 10).values     # warm: the first run starts the workers
        [21, 21]
    """
    global _WARM
    if on is not None and not isinstance(on, bool):
        raise ValueError(f"use_warm takes True, False or None (the LABKIT_WARM variable "
                         f"decides), got {on!r}")
    _WARM = on


def _never_warm() -> bool:
    """``LABKIT_WARM=never``: every run cold, ``warm=True`` included (to time the cold path,
    or to rule warm workers out when a run misbehaves)."""
    return os.environ.get("LABKIT_WARM", "").strip().lower() == "never"


def _warm_default() -> bool:
    """What ``warm=None`` means now: use_warm's choice, else LABKIT_WARM's."""
    if _WARM is not None:
        return _WARM
    value = os.environ.get("LABKIT_WARM", "").strip().lower()
    if value in ("", "0", "false", "no", "off", "never"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"LABKIT_WARM={value!r} is not understood: set it to 1 (warm workers by "
                     "default), 0 (cold by default) or never (cold even with warm=True), or "
                     "call labkit.use_warm(True)")


def _cold_only(fn, framework, nnodes, rdzv_endpoint, max_restarts, keep_run_dir) -> str | None:
    """Why a run needs fresh workers, saying what to do instead; None if it can run warm."""
    if isinstance(fn, str | os.PathLike):
        return _SCRIPT_COLD
    if framework == "tensorflow":
        return _TF_COLD
    if nnodes > 1 or rdzv_endpoint:
        return ("a multi-node run rendezvouses with the other nodes' agents once per run, and "
                "warm workers are one node's. Use warm=False")
    if max_restarts:
        return ("max_restarts lets torchrun replace the whole worker group after a failure, "
                "while warm workers keep one group for many runs (and are replaced after any "
                "failure anyway). Use warm=False, or max_restarts=0")
    if keep_run_dir:
        return ("warm workers share one run folder between their runs and remove it when they "
                "stop. Use warm=False to keep a run's folder")
    return None


def _goes_warm(warm, fn, framework, nnodes, rdzv_endpoint, max_restarts, keep_run_dir) -> bool:
    """Whether a launch runs on warm workers; an explicit warm=True that cannot is an error."""
    if warm is not None and not isinstance(warm, bool):
        raise ValueError(f"warm must be True, False or None (the kernel's default, see "
                         f"labkit.use_warm), got {warm!r}")
    if warm is False or (warm is None and not _warm_default()) or _never_warm():
        return False
    reason = _cold_only(fn, framework, nnodes, rdzv_endpoint, max_restarts, keep_run_dir)
    if reason is not None and warm:
        raise ValueError(f"warm=True cannot run this: {reason}")
    return reason is None


def _kernel_pool(nproc: int, backend: str, framework: str, env: dict) -> Workers:
    """The kernel's warm workers of this shape, started on first use; the least recently used
    beyond MAX_IDLE_POOLS are stopped (the idle ones: a busy one on a later call)."""
    key = (nproc, backend, framework, tuple(sorted(env.items())))
    with _STARTING:  # one start at a time: two threads asking for one shape get one pool
        with _REGISTRY:
            pool = _KERNEL_POOLS.get(key)
            if pool is not None:
                _KERNEL_POOLS.move_to_end(key)
                return pool
        pool = Workers(nproc, backend, framework, env)  # _REGISTRY is free: this takes seconds
        with _REGISTRY:
            _KERNEL_POOLS[key] = pool
            old = [p for p in list(_KERNEL_POOLS.values())[:-MAX_IDLE_POOLS]
                   if not p._lock.locked()]
    for old_pool in old:
        print(f"[labkit] stopping the least recently used warm workers ({old_pool.nproc} x "
              f"{old_pool.backend}): a kernel keeps at most {MAX_IDLE_POOLS} sets "
              "(each idle rank holds torch in memory)", flush=True)
        old_pool.stop()
    return pool

"""Run a function, a script or a cell on N torchrun workers from a notebook kernel.

The kernel is only a controller: it never forks and never touches CUDA. Each run is
``python -m torch.distributed.run`` (torchrun's elastic agent, c10d rendezvous) in a session of
its own, with :mod:`labkit._worker` as the entry point of every rank. The job travels by value
with cloudpickle, so functions, classes and closures defined in notebook cells work.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import queue
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

from ._worker import STACK_SIGNAL, process_start_time
from .profile import visible_gpu_count

BACKENDS = ("auto", "gloo", "nccl")
FRAMEWORKS = ("torch", "tensorflow")
_STACK_WAIT = 2.0  # seconds the ranks get to dump their stacks before a timeout kills them
_GRACE = 3.0  # seconds between SIGTERM and SIGKILL when the controller stops a run
_HEARTBEAT = 30.0  # a quiet run reports its progress this often

# torchrun's own chatter that says nothing a learner needs (labkit sets these variables itself).
_AGENT_NOISE = ("Setting OMP_NUM_THREADS environment variable", "*****")


class LaunchError(RuntimeError):
    """A launched run failed: a rank raised, crashed, or the run could not start."""

    def __init__(self, message: str, *, rank: int | None = None, logs: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.logs = logs or {}


class LaunchTimeout(LaunchError):
    """A launched run outlived its ``timeout``; the message names the stuck ranks and their stacks."""

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

    The launcher's own keywords (``nproc``, ``timeout``, ``env``, ...) are not passed on to
    ``fn``; every other keyword argument is.

    Raises :class:`LaunchError` naming the first failing rank with its traceback, and
    :class:`LaunchTimeout` (with every stuck rank's stack) when ``timeout`` seconds pass.
    """
    __tracebackhide__ = True  # IPython shows the LaunchError, not the controller's frames
    job, gpus = _validate(fn, args, kwargs, nproc, backend, timeout, framework, nnodes, node_rank,
                          rdzv_endpoint)
    extra_env = _check_env(env)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number >= 0 (0: a failure ends the run), "
                         f"got {max_restarts!r}")
    run_dir = Path(tempfile.mkdtemp(prefix="labkit-run-"))  # mkdtemp makes it 0700
    try:
        _write_job(run_dir, job, fn, args, kwargs)
        command = _torchrun_command(run_dir, nproc, nnodes, node_rank, rdzv_endpoint,
                                    max_restarts)
        if nnodes > 1:
            _print_other_nodes(fn, nproc, nnodes, node_rank, rdzv_endpoint)
        run = _start(run_dir, command, _worker_env(nproc, gpus, extra_env))
        return _supervise(run, job, nproc, timeout, show_ranks, command, max_restarts)
    finally:
        if keep_run_dir:
            print(f"[labkit] run folder kept: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)


def _validate(fn, args, kwargs, nproc, backend, timeout, framework, nnodes, node_rank,
              rdzv_endpoint):
    """Check every argument before anything starts; return the job description and GPU count."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a whole number >= 1 (workers per node), got {nproc!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}: use one of {', '.join(FRAMEWORKS)}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0 (or None for none), got {timeout!r}")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"need nnodes >= 1 and 0 <= node_rank < nnodes, got {nnodes=} {node_rank=}")
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError("a multi-node run needs rdzv_endpoint='host:port' of node 0, the same on every node")
    if framework == "tensorflow" and nnodes > 1:
        raise ValueError("framework='tensorflow' runs on one node; for several, write TF_CONFIG per node")
    gpus = visible_gpu_count()
    if backend == "nccl":
        if gpus == 0:
            raise ValueError("backend='nccl' needs CUDA GPUs and none is visible here: use backend='gloo' "
                             "(or 'auto'), or check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
        if gpus < nproc:
            raise ValueError(f"backend='nccl' needs one GPU per local rank: nproc={nproc} but {gpus} GPU(s) "
                             f"visible. Use nproc<={gpus}, or backend='gloo' to share GPUs")
    if backend == "auto":
        backend = "nccl" if 0 < nproc <= gpus else "gloo"
    script = None
    if isinstance(fn, str | os.PathLike):
        script = Path(fn)
        if not script.is_file():
            raise FileNotFoundError(f"no script at {str(script)!r} (looked in {os.getcwd()}): write it "
                                    "first, e.g. with %%writefile, or pass a function")
        if kwargs:
            raise ValueError("a script takes command-line arguments only: pass them as strings in *args")
    elif not callable(fn):
        raise TypeError(f"launch() needs a function or a script path, got {type(fn).__name__}")
    job = {
        "mode": "script" if script else "function",
        "script": str(script.resolve()) if script else None,
        "script_args": [str(a) for a in args] if script else [],
        "backend": backend,
        "framework": framework,
        "gpus": gpus,
        "tf_ports": _free_ports(nproc) if framework == "tensorflow" else [],
        "sys_path": [p or os.getcwd() for p in sys.path],
    }
    return job, gpus


def _check_env(env) -> dict:
    """The workers' extra environment, checked: a dict of str to str (what os.environ holds)."""
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise ValueError(f"env must be a dict of variable names to values, got {type(env).__name__}: "
                         "e.g. env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ValueError(f"env: {key!r} is not a valid variable name: use a non-empty string "
                             "without '=', e.g. 'NCCL_DEBUG'")
        if not isinstance(value, str):
            raise ValueError(f"env[{key!r}] is {type(value).__name__} {value!r}, but environment "
                             f"values are strings: write {key!r}: {str(value)!r}")
        if "\0" in value:
            raise ValueError(f"env[{key!r}] contains a NUL character, which no environment can hold")
    return dict(env)


def _write_job(run_dir: Path, job: dict, fn, args, kwargs) -> None:
    """Pickle the job by value; name the object that cannot travel if pickling fails."""
    if job["mode"] == "function":
        job = dict(job, payload=(fn, args, kwargs))
    try:
        data = _dumps_with_sources(job)
    except Exception as exc:
        culprit = _unpicklable(fn, args, kwargs)
        raise TypeError(
            f"cannot send {culprit} to the workers: {type(exc).__name__}: {exc}. Workers are separate "
            "processes; create such objects (open files, locks, CUDA tensors, generators) inside the "
            "function instead of passing them in"
        ) from exc
    (run_dir / "job.pkl").write_bytes(data)


def _dumps_with_sources(job: dict) -> bytes:
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
    return cloudpickle.dumps({"sources": sources, "sys_path": job["sys_path"], "job": buffer.getvalue()})


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
_AGENT_BOOT = (
    "import os,sys,signal,shutil\n"
    "parent, run_dir = int(sys.argv[1]), sys.argv[-1]\n"
    "if sys.platform.startswith('linux'):\n"
    "    import ctypes; ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))\n"
    "    if os.getppid() != parent: sys.exit('labkit: controller exited before start')\n"
    "sys.argv = ['torchrun'] + sys.argv[2:]\n"
    "try:\n"
    "    import runpy; runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    if os.getppid() != parent: shutil.rmtree(run_dir, ignore_errors=True)\n"
)


def _worker_env(nproc: int, gpus: int, extra: dict | None = None) -> dict:
    """The controller's environment, the caller's ``env`` over it, and what the workers need."""
    env = dict(os.environ)
    env.update(extra or {})
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the cell as they are printed
    env["LABKIT_CONTROLLER_PID"] = str(os.getpid())
    env["LABKIT_CONTROLLER_START"] = process_start_time(os.getpid()) or ""
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


def _supervise(run: _Run, job: dict, nproc: int, timeout, show_ranks, command,
               max_restarts: int = 0) -> LaunchResult:
    """Stream output, watch for failure and timeout, and always leave no process behind."""
    __tracebackhide__ = True
    show = None if show_ranks is None else (
        {show_ranks} if isinstance(show_ranks, int) else set(show_ranks))
    if show:  # an empty filter asks for silence: nothing to announce
        print(f"[labkit] showing rank(s) {sorted(show)} only; the others are hidden "
              "(all lines are in result.logs)")
    logs: dict[int, list[str]] = {}
    agent_log: list[str] = []
    dead: list[int] = []  # ranks gone without a word, seen when the first error appeared
    start = time.monotonic()
    last_output = start
    try:
        done = False
        while not done:
            try:
                line = run.lines.get(timeout=0.2)
            except queue.Empty:
                line = ""
            if line is None:
                done = True
            elif line:
                last_output = time.monotonic()
                _route(line, logs, agent_log, show)
            _track(run)
            if not max_restarts and run.proc.poll() is None and any(run.run_dir.glob("error-*.pkl")):
                # Stop the peers now rather than after torchrun's own (up to 30 s) shutdown.
                # Not when restarts are allowed: then torchrun restarts the group itself.
                dead = _silently_dead(run.run_dir)
                _stop(run)
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed > timeout and run.proc.poll() is None:
                raise _timed_out(run, nproc, timeout, logs)
            if time.monotonic() - last_output > _HEARTBEAT:
                running = nproc - len(list(run.run_dir.glob("result-*.pkl")))
                print(_progress_line(elapsed, running, nproc))
                last_output = time.monotonic()
        run.proc.wait()
        seconds = time.monotonic() - start
        errors = _errors(run.run_dir)
        error = errors[0] if errors else None
        if max_restarts and run.proc.returncode == 0:
            _report_restarts(run.run_dir, errors)
        elif error is not None or run.proc.returncode != 0:
            raise _failure(error, run.proc.returncode, agent_log, logs, dead)
        values = _collect(run.run_dir)
        return LaunchResult(values, seconds, logs, nproc, job["backend"], command, agent_log)
    except KeyboardInterrupt:
        stopped = _stop(run)
        print(f"[labkit] interrupted: stopped torchrun and {stopped} worker process(es)")
        raise
    finally:
        _stop(run)


def _progress_line(elapsed: float, running: int, nproc: int) -> str:
    """The heartbeat of a quiet run; once every rank has returned, say what is left to wait for."""
    if running <= 0:
        return (f"[labkit] {elapsed:.0f} s elapsed: all {nproc} rank(s) have returned; waiting "
                f"for torchrun to shut the workers down")
    return f"[labkit] {elapsed:.0f} s elapsed, {running} of {nproc} rank(s) still running"


def _route(line: str, logs: dict, agent_log: list, show) -> None:
    """Keep a line in its rank's log and print it unless filtered; agent lines stay quiet."""
    if line.startswith("[rank") and "] " in line:
        head, _, text = line.partition("] ")
        try:
            rank = int(head[5:])
        except ValueError:
            rank = None
        if rank is not None:
            logs.setdefault(rank, []).append(text)
            if show is None or rank in show:
                print(line, flush=True)
            return
    agent_log.append(line)


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
    return int(path.name.split("-", 1)[1].split(".", 1)[0])


def _rank_pids(run_dir: Path) -> dict[int, int]:
    import json

    out = {}
    for f in run_dir.glob("pid-*"):
        out[_rank_of(f)] = json.loads(f.read_text())["pid"]
    return out


def _timed_out(run: _Run, nproc: int, timeout: float, logs: dict) -> LaunchTimeout:
    """Ask every unfinished rank for its Python stack, then build the LaunchTimeout."""
    finished = {_rank_of(f) for f in run.run_dir.glob("result-*.pkl")}
    pids = _rank_pids(run.run_dir)
    stuck = sorted(r for r in pids if r not in finished)
    for rank in stuck:
        try:
            os.kill(pids[rank], STACK_SIGNAL)
        except OSError:
            pass
    time.sleep(_STACK_WAIT)
    stacks = {r: _clean_stack((run.run_dir / f"stack-{r}.txt").read_text(errors="replace"))
              for r in stuck}
    never_started = sorted(set(range(nproc)) - set(pids)) if len(pids) < nproc else []
    parts = [f"the run did not finish within timeout={timeout:g} s."]
    if stuck:
        parts.append(f"Stuck rank(s): {', '.join(map(str, stuck))}"
                     + (f" (rank(s) {', '.join(map(str, sorted(finished)))} had finished)" if finished else ""))
    if never_started:
        parts.append("Some ranks never started (still in rendezvous): check nnodes and rdzv_endpoint.")
    for rank in stuck:
        parts.append(f"\n--- rank {rank} stack (most recent call first) ---\n{stacks[rank].strip()}")
    parts.append("\nA rank waiting in a collective that another rank skipped is the usual cause; "
                 "run with TORCH_DISTRIBUTED_DEBUG=DETAIL to name the mismatch.")
    return LaunchTimeout("\n".join(parts), stuck=stuck, stacks=stacks, logs=logs)


def _clean_stack(dump: str) -> str:
    """Drop labkit's own threads and shim frames from a faulthandler dump: the user's code remains."""
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

    return sorted((cloudpickle.loads(f.read_bytes()) for f in run_dir.glob("error-*.pkl")),
                  key=lambda e: e["time"])


def _silently_dead(run_dir: Path) -> list[int]:
    """Ranks whose process is gone without a result or an error: killed, or a native crash."""
    import psutil

    def gone(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    return sorted(r for r, pid in _rank_pids(run_dir).items()
                  if not any((run_dir / f"{kind}-{r}.pkl").exists() for kind in ("result", "error"))
                  and gone(pid))


def _failure(error: dict | None, returncode: int, agent_log: list, logs: dict,
             dead: list[int] = ()) -> LaunchError:
    if error is not None and dead:
        # The peers of a killed rank fail with "connection reset": a consequence, not the cause.
        return LaunchError(
            f"rank {dead[0]} died without a Python exception (killed by a signal: out of memory, "
            f"a `kill`, or a crash in native code; see dmesg). Then rank {error['rank']} failed "
            f"with {error['type']}: {error['message']}", rank=dead[0], logs=logs)
    if error is not None:
        return LaunchError(
            f"rank {error['rank']} failed with {error['type']}: {error['message']}\n\n"
            f"--- rank {error['rank']} traceback ---\n{error['traceback'].rstrip()}",
            rank=error["rank"], logs=logs)
    said = "\n".join(line for line in agent_log[-30:] if not line.startswith(_AGENT_NOISE))
    return LaunchError(
        f"torchrun exited with code {returncode} and no rank reported a Python exception: a worker "
        f"was killed (out of memory?) or crashed in native code. torchrun said:\n{said}", logs=logs)


def _collect(run_dir: Path) -> list:
    import cloudpickle

    values = []
    for f in sorted(run_dir.glob("result-*.pkl"), key=_rank_of):
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


def stray_workers() -> list[str]:
    """Worker processes that this process's ``labkit.launch`` runs left alive: should be none.

    A notebook's last cell asserts it (``assert not labkit.stray_workers()``): every launch
    stops its whole process group, even after a failure, a timeout or an interrupt. Finds
    torchrun agents and worker shims by their command line, and keeps those whose environment
    names this process as their controller, so runs of another notebook do not count.
    Returns ``"pid: command line"`` strings.

    Example::

        >>> labkit.stray_workers()
        []
    """
    import psutil

    me = str(os.getpid())
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "labkit._worker" not in cmdline and "labkit-run-" not in cmdline:
            continue
        try:
            controller = proc.environ().get("LABKIT_CONTROLLER_PID")
        except (psutil.Error, OSError):  # gone meanwhile, or another user's process
            continue
        if controller == me:
            line = " ".join(cmdline.split())  # the agent's boot script spans several lines
            if len(line) > 160:  # keep the start and the run folder at the end
                line = f"{line[:60]} ... {line[-95:]}"
            found.append(f"{proc.info['pid']}: {line}")
    return found

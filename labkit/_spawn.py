"""Starting a run, cold or warm: the job checked and pickled into a private run folder,
torchrun's command line and boot script, the workers' environment, and the sweep of run
folders whose controller died.

The kernel never forks: every run is ``python -m torch.distributed.run`` (torchrun's elastic
agent, c10d rendezvous) in a session of its own, with :mod:`labkit._worker` as the entry point
of every rank. The job travels by value with cloudpickle, so functions, classes and closures
defined in notebook cells work. The supervisor that follows a started run is
:mod:`labkit._engine`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ._protocol import (
    CONTROLLER_PID,
    CONTROLLER_START,
    FORK_RANKS,
    JOB_FILE,
    RUN_PREFIX,
    Job,
    Task,
    process_start_time,
)
from ._sizes import whole
from .profile import visible_gpu_count

BACKENDS = ("auto", "gloo", "nccl")
FRAMEWORKS = ("torch", "tensorflow")


@dataclasses.dataclass
class Run:
    """One run's private state: its folder, its torchrun process, the workers it has started."""

    run_dir: Path
    proc: subprocess.Popen
    lines: queue.Queue
    known: dict  # pid -> psutil.Process, every descendant ever seen
    reader: threading.Thread


def validate(fn, args, kwargs, nproc, backend, timeout, framework, nnodes, node_rank,
             rdzv_endpoint):
    """Check every argument before anything starts; return the job description and GPU count.

    The counts may be NumPy integers (``whole`` accepts them): callers take ``int()`` of them.
    """
    whole(nproc, "nproc", hint=": the number of workers per node")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if framework not in FRAMEWORKS:
        raise ValueError(
            f"unknown framework {framework!r}: use one of {', '.join(FRAMEWORKS)}")
    if timeout is not None and not timeout > 0:
        raise ValueError(
            f"timeout must be a number of seconds > 0 (or None for none), got {timeout!r}")
    whole(nnodes, "nnodes", hint=": the number of machines in the run")
    whole(node_rank, "node_rank", low=0, hint=": this machine's place among the nnodes")
    if node_rank >= nnodes:
        raise ValueError(
            f"need 0 <= node_rank < nnodes, got {nnodes=} {node_rank=}: node ranks count from 0")
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
        sys_path=sys_path(),
        script=str(script.resolve()) if script else None,
        script_args=[str(a) for a in args] if script else [],
        tf_ports=_free_ports(nproc) if framework == "tensorflow" else [],
        payload=None if script else (fn, args, kwargs),
    )
    return job, gpus


def sys_path() -> list[str]:
    """The controller's sys.path for the workers, '' (the current folder) spelt out."""
    return [p or os.getcwd() for p in sys.path]


def check_env(env) -> dict:
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


def write_job(run_dir: Path, job: Job | Task, name: str = JOB_FILE) -> None:
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


def torchrun_command(run_dir: Path, nproc: int, nnodes: int, node_rank: int,
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
# Gone: the agent was re-parented, or its parent is already a zombie. The death signal can be
# handled before getppid() shows the new parent; the folder was then left behind (seen under
# load), and the ranks, killed with the agent, could not remove it either.
# torchrun is told not to take SIGTERM over (TORCHELASTIC_SIGNALS_TO_HANDLE, read by its
# PContext.start): its graceful shutdown could be cut short by a rank watchdog's second SIGTERM
# before the folder is removed. The ranks end by themselves (watchdog, FIFO end) or by the
# supervisor's stop_run.
# Each rank's exit status is written to the run folder as the agent reaps it (exit_file): torchrun
# reports non-zero codes only, and the controller is no parent of the ranks to see them itself.
_AGENT_BOOT = (
    "import os,sys,signal,shutil,subprocess\n"
    "parent, run_dir = int(sys.argv[1]), sys.argv[-1]\n"
    "def orphaned():\n"
    "    if os.getppid() != parent: return True\n"
    "    try:\n"
    "        with open('/proc/%d/stat' % parent) as f: state = f.read().rsplit(')', 1)[1]\n"
    "        return state.split()[0] in 'ZX'\n"
    "    except OSError: return not os.path.isdir('/proc/self')\n"
    "def stop(*_):\n"
    "    if orphaned(): shutil.rmtree(run_dir, ignore_errors=True)\n"
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
    "    if os.environ.get('LABKIT_FORK_RANKS') == '1':\n"
    "        from labkit import _forkrank; _forkrank.prefork(sys.argv); _forkrank.install()\n"
    "    import runpy\n"
    "    runpy.run_module('torch.distributed.run', run_name='__main__', alter_sys=True)\n"
    "finally:\n"
    "    if orphaned():\n"
    "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "        shutil.rmtree(run_dir, ignore_errors=True)\n"
)


def worker_env(nproc: int, gpus: int, extra: dict | None = None,
               framework: str = "torch") -> dict:
    """The controller's environment, the caller's ``env`` over it, and what the workers need."""
    env = dict(os.environ)
    env.update(extra or {})
    # A torch run on CPUs forks its ranks from torchrun's agent, which has imported torch
    # already: a rank then starts in a fraction of the time (labkit._forkrank). Never for
    # CUDA (initialised in no fork's parent is the rule it keeps simple) or TensorFlow (its
    # ranks stay torch-free), and only on Linux (macOS's system libraries refuse work in a
    # child forked from a process that has loaded them, which is why Python spawns there).
    # LABKIT_FORK_RANKS=0 in the environment starts every rank afresh.
    if gpus or framework != "torch" or not sys.platform.startswith("linux"):
        env[FORK_RANKS] = "0"
    else:
        env.setdefault(FORK_RANKS, "1")
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the cell as they are printed
    env[CONTROLLER_PID] = str(os.getpid())
    env[CONTROLLER_START] = process_start_time(os.getpid()) or ""
    # A thread budget per worker: N workers each using every core would fight over them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # The kernel's matplotlib backend (inline) does not exist in a plain worker process.
    env.pop("MPLBACKEND", None)
    return env


def start(run_dir: Path, command: list[str], env: dict) -> Run:
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
    return Run(run_dir, proc, lines, {}, reader)


KEPT = "kept"  # in a run folder that keep_run_dir=True asked to keep


def new_run_dir() -> Path:
    """A private (0700) run folder named after this controller: ``labkit-run-<pid>.<start>-``.

    torchrun's agent removes the folder of a controller that died, but a kernel killed in the
    moment between making the folder and starting the agent leaves it with nobody to remove
    it; the name lets the next launch (or ``labkit.stop_workers()``) see that its owner is gone.
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
            if (owner is None or not folder.is_dir() or (folder / KEPT).exists()
                    or folder.stat().st_uid != os.getuid()):
                continue
        except OSError:
            continue
        pid, began = int(owner[1]), int(owner[2])
        now = _started(pid)
        if now is None or abs(now - began) > 1:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


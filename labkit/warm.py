"""Warm workers: ranks that keep torch imported and their process group formed, and run
function after function in milliseconds each (:func:`workers`, ``launch(warm=True)``).

A pool is one torchrun run in "serve" mode: its ranks loop over tasks written into the run
folder, woken through one FIFO each. It is started and supervised by the same engine as a cold
run (:mod:`labkit._spawn`, :mod:`labkit._engine`), with the same output, errors and timeouts.
After a run that raised, CPU ranks form their default group again and serve on; after any other
failure (a timeout, an interrupt, a rank that died, any failure on GPUs) the pool is torn down
and the next run starts fresh ranks. This module also
keeps the kernel's own pools for ``launch(warm=True)`` and the choice of warm or cold
(:func:`use_warm`, ``LABKIT_WARM``).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from ._engine import GRACE, LaunchResult, Shield, WarmTask, stop_run, supervise
from ._failures import LaunchError, LaunchTimeout, rank_pids
from ._protocol import (
    CONTROLLER_PID,
    CONTROLLER_START,
    QUIT,
    RETIRES,
    RUN_TASK,
    Task,
    error_file,
    fifo_file,
    result_file,
    task_file,
)
from ._spawn import (
    Run,
    check_env,
    new_run_dir,
    start,
    sys_path,
    torchrun_command,
    validate,
    worker_env,
    write_job,
)

MAX_IDLE_POOLS = 2  # sets of warm workers launch(warm=True) keeps; each idle rank holds torch
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



class Workers:
    """Warm ranks that run function after function: see :func:`workers`."""

    def __init__(self, nproc: int = 2, backend: str = "auto", framework: str = "torch",
                 env: dict | None = None):
        if framework == "tensorflow":
            raise ValueError(_TF_COLD)
        # The shape is checked as a function run's would be; the functions come with .run().
        job, self._gpus = validate(Workers.run, (), {}, nproc, backend, None, framework, 1, 0,
                                   None)
        self._job = dataclasses.replace(job, mode="serve", payload=None)
        self.nproc, self.backend, self.framework = int(nproc), job.backend, framework
        self.env = check_env(env)
        self.start_seconds = 0.0  # how long the last start took (torchrun, torch, the group)
        self.runs = 0  # runs served, over every restart
        self._lock = threading.Lock()  # one run at a time
        self._run: Run | None = None
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
            ranks = rank_pids(run.run_dir)
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
        # Past _STOP_WAIT the teardown goes on under that run: its supervisor then sees its
        # ranks gone and raises in its own thread.
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
        self._run_dir = new_run_dir()
        try:
            for rank in range(self.nproc):
                path = self._run_dir / fifo_file(rank)
                os.mkfifo(path, 0o600)
                # Read-write: the open does not wait for a reader, and this process holds the
                # FIFO's only writer, so a rank's read sees EOF the moment this process dies.
                self._fifos.append(os.open(path, os.O_RDWR))
            write_job(self._run_dir, self._job)
            self._command = torchrun_command(self._run_dir, self.nproc, 1, 0, None)
            self._base_env = worker_env(self.nproc, self._gpus, self.env, self.framework)
            self._tasks = 0
            self._run = start(self._run_dir, self._command, self._base_env)
            supervise(self._run, self._job, self.nproc, None, None, self._command,
                      task=WarmTask(0))  # "task 0" ends when a rank has formed the group
        except BaseException:
            self._teardown()
            raise
        self._lost = None
        self.start_seconds = time.monotonic() - began

    def _dispatch(self, fn, args, kwargs, timeout, show_ranks) -> LaunchResult:
        """Send one task to every rank and supervise it; stop the ranks if it fails (unless every
        rank of a CPU pool came back from a Python error: they serve on)."""
        __tracebackhide__ = True
        number = self._tasks + 1
        task = Task(number, (fn, args, kwargs), sys_path(), os.getcwd(), self._env_changes())
        write_job(self._run_dir, task, task_file(number))  # unpicklable: nothing was sent
        self._tasks = number
        served: list[LaunchResult] = []
        failed: list[BaseException] = []

        def cleanup():
            retired = sorted(self._run_dir.glob(RETIRES)) if self._run_dir is not None else []
            if not served and not (self._back_after(failed) and not retired):
                self._teardown()  # timed out, interrupted, a rank died: the ranks are stopped
            elif not served:
                self._lost = None  # a Python error on the ranks: they serve the next run
            elif retired:
                # The run changed what a rank cannot put back: fresh ranks for the next run.
                self._lost = retired[0].read_text()
                self._teardown(quit=True)
            if self._run_dir is not None:  # the next task finds a clean folder
                names = [task_file(number), *(f(r) for r in range(self.nproc)
                                               for f in (result_file, error_file))]
                for name in names:
                    (self._run_dir / name).unlink(missing_ok=True)

        with Shield(cleanup):
            try:
                for fd in self._fifos:
                    os.write(fd, RUN_TASK)
                served.append(supervise(self._run, self._job, self.nproc, timeout, show_ranks,
                                        self._command, task=WarmTask(number)))
            except BaseException as exc:
                failed.append(exc)
                self._lost = _lost_by(exc)
                raise
        self.runs += 1
        return served[0]

    def _back_after(self, failed: list[BaseException]) -> bool:
        """Whether a failed run left every rank back in its loop with a fresh default group, so
        that this pool serves the next run: on CPU ranks (gloo) only. Fresh processes would cost
        seconds after every wrong answer a learner tries."""
        return (len(failed) == 1 and isinstance(failed[0], LaunchError)
                and failed[0].ranks_back and not self._gpus and self._running())

    def _env_changes(self) -> dict[str, str | None]:
        """What a cold run started now would see differently in its environment."""
        now = worker_env(self.nproc, self._gpus, self.env, self.framework)
        changes: dict[str, str | None] = {k: v for k, v in now.items()
                                          if self._base_env.get(k) != v}
        changes.update((k, None) for k in self._base_env if k not in now)
        for key in (CONTROLLER_PID, CONTROLLER_START):
            changes.pop(key, None)
        return changes

    def _teardown(self, quit: bool = False) -> None:
        """Stop every process of the pool and remove its run folder; ``quit`` asks them first.
        No interrupt cuts it short (see the engine's Shield)."""
        with Shield(lambda: self._stop_all(quit)):
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
                    run.proc.wait(timeout=GRACE)
                except subprocess.TimeoutExpired:
                    pass
            stop_run(run)
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

    After a run that raised a Python exception on CPU ranks (gloo), every rank puts its state
    back as above and the ranks form the default group again (a run that stopped part-way may
    have left them after different numbers of collectives): they serve the next run at once.
    After a run that times out, is interrupted, loses a rank, or fails on GPUs (a CUDA error
    can leave the device unusable), the ranks are stopped (every process and the run folder):
    the next run starts fresh ones and says so in one line. Each idle
    rank holds torch in memory (about 300 MB; on GPUs also a CUDA context): ``with`` or
    ``.stop()`` ends a pool, ``labkit.stop_workers()`` every pool, and all end with the
    kernel, even one that is killed. ``launch(warm=True)`` keeps at most
    ``MAX_IDLE_POOLS`` (2) shapes, stopping the least recently used. ``.pids()`` lists the
    pool's processes; ``labkit.stray_workers()`` does not count them while the pool runs.
    TensorFlow cannot run warm (its collectives are set up once per process).
    """
    return Workers(nproc, backend, framework, env)


def owned_pids() -> set[int]:
    """Every live process of every running pool: owned, so no stray while its pool runs."""
    with _REGISTRY:
        pools = list(_LIVE)
    return set().union(*(pool.owned_pids() for pool in pools))


def stop_pools() -> int:
    """Stop every pool this process holds (launch's and :func:`workers`'); count them."""
    with _REGISTRY:
        pools = list(_LIVE)
    for pool in pools:
        pool.stop()
    return len(pools)


# At exit the ranks are asked to quit (stop() writes QUIT to their FIFOs), so that they destroy
# their group themselves; a process that dies without this still ends them, through the FIFOs'
# end and the agent's parent-death signal, but NCCL's communicators are then killed under way.
atexit.register(stop_pools)


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
                "while warm workers keep one group for many runs (and are replaced after a "
                "failure that is not a Python error). Use warm=False, or max_restarts=0")
    if keep_run_dir:
        return ("warm workers share one run folder between their runs and remove it when they "
                "stop. Use warm=False to keep a run's folder")
    return None


def goes_warm(warm, fn, framework, nnodes, rdzv_endpoint, max_restarts, keep_run_dir) -> bool:
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


def kernel_pool(nproc: int, backend: str, framework: str, env: dict) -> Workers:
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
              f"{old_pool.backend}):\n  a kernel keeps at most {MAX_IDLE_POOLS} sets "
              "(each idle rank holds torch in memory)", flush=True)
        old_pool.stop()
    return pool

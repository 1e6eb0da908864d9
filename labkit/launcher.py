"""Run a function, a script or a cell on N torchrun workers from a notebook kernel.

The kernel is only a controller: it never forks and never touches CUDA. This module is the
public API (:func:`launch`, :func:`stray_workers`, :func:`stop_workers`, and the warm pool's
:func:`workers` and :func:`use_warm`, re-exported from :mod:`labkit.warm`) and the cold path:
one fresh torchrun run per call, in a run folder of its own that is removed however the run
ends. Both paths share one engine: :mod:`labkit._spawn` starts a run, :mod:`labkit._engine`
supervises it (output, failures, the clock, the stop) and :mod:`labkit._failures` reads how
its ranks ended.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import sys
from pathlib import Path

from ._display import wrap
from ._engine import (
    GRACE,
    STARTUP_S,
    LaunchResult,
    Shield,
    stop_run,
    supervise,
)
from ._failures import LaunchError, LaunchTimeout
from ._protocol import CONTROLLER_PID, RUN_PREFIX
from ._sizes import whole
from ._spawn import (
    BACKENDS,
    FRAMEWORKS,
    KEPT,
    Run,
    check_env,
    new_run_dir,
    start,
    sweep_run_folders,
    torchrun_command,
    validate,
    worker_env,
    write_job,
)
from .warm import (
    MAX_IDLE_POOLS,
    Workers,
    goes_warm,
    kernel_pool,
    owned_pids,
    stop_pools,
    use_warm,
    workers,
)

__all__ = [
    "BACKENDS", "FRAMEWORKS", "MAX_IDLE_POOLS", "STARTUP_S", "LaunchError", "LaunchResult",
    "LaunchTimeout", "Workers", "launch", "stop_workers", "stray_workers", "sweep_run_folders",
    "use_warm", "workers",
]


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
    job, gpus = validate(fn, args, kwargs, nproc, backend, timeout, framework, nnodes, node_rank,
                         rdzv_endpoint)
    # NumPy integers pass validate; the command line, the pool's key and the result take ints.
    nproc, nnodes, node_rank = int(nproc), int(nnodes), int(node_rank)
    extra_env = check_env(env)
    max_restarts = whole(max_restarts, "max_restarts", low=0,
                         hint=" (0: a failure ends the run; N: torchrun restarts the workers "
                              "up to N times)")
    if goes_warm(warm, fn, framework, nnodes, rdzv_endpoint, max_restarts, keep_run_dir):
        result = kernel_pool(nproc, job.backend, framework, extra_env).run_if_free(
            fn, args, kwargs, timeout, show_ranks, wait=warm is True)
        if result is not None:
            return result  # (None: the pool is busy with a run of another thread: go cold)
    run_dir = new_run_dir()
    started: list[Run] = []

    def cleanup():  # whatever ended the run: no process, and no folder unless asked to keep it
        for run in started:
            stop_run(run)
        if keep_run_dir:
            (run_dir / KEPT).touch()  # asked for: no later sweep takes it
            print(f"[labkit] run folder kept: {run_dir}")
        else:
            shutil.rmtree(run_dir, ignore_errors=True)

    # The cleanup runs inside the Shield: a learner pressing stop again while the ranks are
    # being stopped must not leave one alive (SIGTERM sent, SIGKILL never) or the folder behind.
    with Shield(cleanup):
        write_job(run_dir, job)
        command = torchrun_command(run_dir, nproc, nnodes, node_rank, rdzv_endpoint,
                                   max_restarts)
        if nnodes > 1:
            _print_other_nodes(fn, nproc, nnodes, node_rank, rdzv_endpoint)
        started.append(start(run_dir, command, worker_env(nproc, gpus, extra_env, job.framework)))
        return supervise(started[0], job, nproc, timeout, show_ranks, command, max_restarts)


def _print_other_nodes(fn, nproc: int, nnodes: int, node_rank: int, rdzv_endpoint: str) -> None:
    """Tell the learner what every other node must run to join this rendezvous."""
    others = [r for r in range(nnodes) if r != node_rank]
    lines = [wrap(f"[labkit] node {node_rank} of {nnodes} joins the rendezvous at "
                  f"{rdzv_endpoint}. On node(s) {', '.join(map(str, others))} run the same call "
                  "with node_rank=<that node>, or:")]
    target = str(fn) if isinstance(fn, str | os.PathLike) else "your_script.py"
    for r in others:
        # Two lines joined by the shell's backslash: a command that fits the output area.
        lines.append("  " + shlex.join(["torchrun", "--nnodes", str(nnodes), "--node-rank", str(r),
                                        "--nproc-per-node", str(nproc)]) + " \\\n      "
                     + shlex.join(["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                                   "--rdzv-id", "labkit", target]))
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
    owned = owned_pids()
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
    _, alive = psutil.wait_procs([p for p, _ in strays], timeout=GRACE)
    for proc in alive:  # it ignores SIGTERM
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=GRACE)
    for _, cmdline in strays:
        folder = Path(cmdline[-1]) if cmdline else None
        if folder is not None and folder.name.startswith(RUN_PREFIX) and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
    return len(strays)


def stop_workers() -> int:
    """Stop every set of warm workers this kernel holds (launch's and :func:`workers`'); count them.

    Any other process :func:`stray_workers` lists (one that outlived its run) is ended too,
    SIGKILLed if it ignores SIGTERM, and its run folder removed.

    Example::

        >>> labkit.launch(total, 10, warm=True)
        >>> labkit.stop_workers()     # the ranks exit; the next warm run starts fresh ones
        1
    """
    stopped = stop_pools()
    with Shield(_end_strays):  # no interrupt leaves a stray half-stopped
        pass
    sweep_run_folders()
    return stopped


# At exit, before labkit.warm's own stop_pools (atexit runs the last registered first): the
# pools, then any stray, then the folders of controllers that died.
atexit.register(stop_workers)

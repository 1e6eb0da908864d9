"""The contract between the controller (:mod:`labkit.launcher`) and the worker shim.

Both sides import what they share from here: the job descriptions, the names of the files in
a run folder, the controller's environment variables, the bytes and lines they exchange.
Nothing here imports torch: TensorFlow workers import this module too.

A run folder holds ``job.pkl`` (a :class:`Job`), and per rank ``pid-<rank>`` (JSON: pid,
local rank), ``stack-<rank>.txt`` (faulthandler's dumps) and the outcome, ``result-<rank>.pkl``
or ``error-<rank>.pkl``; torchrun's agent adds ``exit-<pid>`` as each rank process ends. A
warm pool's folder also holds ``fifo-<rank>``, the named pipe its rank blocks on,
``task-<n>.pkl`` (a :class:`Task`) while run ``n`` is in progress, and ``retire-<rank>.txt``
after a run that changed what the rank cannot put back; the controller removes each run's
task and outcome files before it sends the next run.
"""

from __future__ import annotations

import dataclasses
import signal

# The controller's pid and start time (field 22 of /proc/<pid>/stat), in every worker's
# environment: the watchdog's test of the controller being alive, and stray_workers' owner.
CONTROLLER_PID = "LABKIT_CONTROLLER_PID"
CONTROLLER_START = "LABKIT_CONTROLLER_START"

# "1" in torchrun's environment: its agent forks the ranks instead of starting new interpreters
# (labkit._forkrank); "0": new interpreters, as torchrun does by itself.
FORK_RANKS = "LABKIT_FORK_RANKS"

STACK_SIGNAL = signal.SIGUSR1  # a rank dumps every thread's Python stack on this signal
RUN_PREFIX = "labkit-run-"  # run folders are tempfile.mkdtemp(prefix=RUN_PREFIX)
JOB_FILE = "job.pkl"
TEMP_DIR = "tmp"  # a TensorFlow rank's temporary files, removed with the run folder

# What the controller writes into a warm rank's FIFO: one byte per order.
RUN_TASK = b"r"  # task-<n>.pkl is ready, n one more than the last
QUIT = b"q"  # leave the serve loop and exit cleanly

# The line a warm rank prints after a run's result or error is written and its output flushed:
# once every rank's has arrived, the controller has all of that run's output.
END_OF_TASK = "\x1elabkit-end-of-task "
# The end of a piece of a line too long for one atomic write to the shared pipe: the line goes
# on in the rank's next piece.
CONTINUES = "\x1elabkit-continues"


def pid_file(rank: int | str) -> str:
    return f"pid-{rank}"


def ready_file(rank: int | str) -> str:
    """Written by a cold rank just before it calls the function: its start-up is over."""
    return f"ready-{rank}"


def result_file(rank: int | str) -> str:
    return f"result-{rank}.pkl"


def error_file(rank: int | str) -> str:
    return f"error-{rank}.pkl"


def stack_file(rank: int | str) -> str:
    return f"stack-{rank}.txt"


def fifo_file(rank: int | str) -> str:
    return f"fifo-{rank}"


def task_file(number: int | str) -> str:
    return f"task-{number}.pkl"


def retire_file(rank: int | str) -> str:
    """Written by a warm rank whose run changed what it cannot put back: why (text). The
    controller replaces the pool before the next run."""
    return f"retire-{rank}.txt"


def exit_file(pid: int | str) -> str:
    """Written by torchrun's agent when a rank process ends: its exit status as Popen gives it
    (-N: killed by signal N). The only record of a rank that ended with code 0 unasked."""
    return f"exit-{pid}"


PIDS, RESULTS, ERRORS = pid_file("*"), result_file("*"), error_file("*")  # glob patterns
READY, RETIRES = ready_file("*"), retire_file("*")


def rank_of(name: str) -> int:
    """The rank in a run-folder file name: ``pid-3``, ``result-3.pkl`` -> 3."""
    return int(name.split("-", 1)[1].split(".", 1)[0])


def end_of_task(number: int) -> bytes:
    return f"{END_OF_TASK}{number}\n".encode()


@dataclasses.dataclass
class Job:
    """What torchrun's ranks are to do, in ``job.pkl``: one function or script, or serve runs."""

    mode: str  # "function", "script", or "serve" (a warm pool: run Task after Task)
    backend: str  # "gloo" or "nccl", resolved from "auto"
    framework: str  # "torch" or "tensorflow"
    gpus: int  # GPUs visible to the controller; local rank r gets GPU r % gpus
    sys_path: list[str]  # the controller's, so functions pickled by reference import
    script: str | None = None
    script_args: list[str] = dataclasses.field(default_factory=list)
    tf_ports: list[int] = dataclasses.field(default_factory=list)
    payload: tuple | None = None  # (fn, args, kwargs) in function mode


@dataclasses.dataclass
class Task:
    """One run on a warm pool, in ``task-<number>.pkl``."""

    number: int
    payload: tuple  # (fn, args, kwargs)
    sys_path: list[str]
    cwd: str  # the controller's working directory, where a cold run's ranks would start
    # Variables the controller's environment set (str) or unset (None) since the pool started:
    # a cold run started now would see them.
    environ: dict[str, str | None] = dataclasses.field(default_factory=dict)


def process_start_time(pid: int) -> str | None:
    """A process's start time in clock ticks: with the pid, it tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None

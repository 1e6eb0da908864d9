"""How a failed run's ranks ended, read back by the controller: :class:`LaunchError` and
:class:`LaunchTimeout`, and the texts that name the root cause.

A rank leaves three kinds of record: the error file its shim writes when the function raises,
the exit status torchrun's agent writes as it reaps the rank (``exit-<pid>``, see
:mod:`labkit._spawn`), and the lines of the agent's own log. Read together they tell the cause
(the rank that was killed, or raised first) from its consequences (the peers that then lost
their connection). Used by the supervisor (:mod:`labkit._engine`) for cold and warm runs alike.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from ._display import wrap
from ._protocol import ERRORS, PIDS, error_file, exit_file, rank_of, result_file, stack_file

# torchrun's own chatter that says nothing a learner needs (labkit sets these variables itself).
_AGENT_NOISE = ("Setting OMP_NUM_THREADS environment variable", "*****")


class LaunchError(RuntimeError):
    """A launched run failed: a rank raised, crashed, or the run could not start.

    ``rank`` is the rank that failed first (a killed rank before the peers that lost it),
    ``logs`` every rank's output lines. The message shows at most the first lines of a long
    exception text and the traceback's last lines; ``full_message`` has the failing rank's
    whole exception text and traceback (None when no rank raised). ``ranks_back``: a run on
    warm workers whose every rank returned to its loop after the failure, so that the pool
    can serve the next run.
    """

    def __init__(self, message: str, *, rank: int | None = None, logs: dict | None = None,
                 full_message: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.logs = logs or {}
        self.full_message = full_message
        self.ranks_back = False


class LaunchTimeout(LaunchError):
    """A launched run outlived its ``timeout``; the message names the stuck ranks and their
    stacks."""

    def __init__(self, message: str, *, stuck: list[int], stacks: dict[int, str], logs=None):
        super().__init__(message, rank=stuck[0] if stuck else None, logs=logs)
        self.stuck = stuck
        self.stacks = stacks


# Both are raised from labkit.launcher, the public place: tracebacks and pickles name them there.
LaunchError.__module__ = LaunchTimeout.__module__ = "labkit.launcher"


def rank_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of every rank that has started in this run folder."""
    import json

    out = {}
    for f in run_dir.glob(PIDS):
        try:
            out[rank_of(f.name)] = json.loads(f.read_text())["pid"]
        except FileNotFoundError:  # the run was stopped and its folder removed meanwhile
            continue
    return out


def clean_stack(dump: str) -> str:
    """Drop labkit's own threads and shim frames from a faulthandler dump: the user's code
    remains."""
    own_threads = (" in _watch_controller", " in pump")
    keep = []
    for block in dump.strip().split("\n\n"):
        lines = block.split("\n")
        if any(ln.endswith(own_threads) for ln in lines):
            continue
        # A rank forked from torchrun's agent (labkit._forkrank) has the agent's frames below
        # the fork: they end where the rank's own begin.
        forked = next((i for i, ln in enumerate(lines) if "labkit/_forkrank.py" in ln), None)
        keep.append("\n".join(ln for ln in lines[:forked]
                               if "labkit/_worker.py" not in ln and "<frozen runpy>" not in ln))
    return "\n\n".join(keep)


def report_restarts(run_dir: Path, errors: list[dict]) -> None:
    """After a run that finished under max_restarts: say which failures it came through."""
    # torchrun logs each attempt of the worker group into its own attempt_N folder.
    restarts = len(list(run_dir.glob("torchelastic/*/attempt_*"))) - 1
    if restarts > 0 or errors:
        said = "; ".join(f"rank {e['rank']} raised {e['type']}: {e['message'][:200]}"
                         for e in errors) or "no rank raised a Python exception"
        print(wrap(f"[labkit] torchrun restarted the workers {restarts} time(s), then the run "
                   f"finished. Before that: {said}. (A rank that was killed leaves no "
                   f"exception; its peers then report a lost connection.)"))


def read_errors(run_dir: Path) -> list[dict]:
    """Every rank's error record in the run folder, the earliest first."""
    import cloudpickle

    return sorted((cloudpickle.loads(f.read_bytes()) for f in run_dir.glob(ERRORS)),
                  key=lambda e: e["time"])


def silently_dead(run_dir: Path, script: bool = False) -> list[int]:
    """Ranks whose process is gone without a result or an error: killed, a native crash, or
    an exit the function did not return from (os._exit). A script's rank that exited with
    code 0 just ended (it reports no value)."""
    # Gone first, files second: a rank that writes its result and exits in between is no death.
    ended = [r for r, pid in rank_pids(run_dir).items() if _gone(pid)]
    dead = [r for r in ended if not _has_outcome(run_dir, r)]
    if script:
        codes = _recorded_exits(run_dir)
        dead = [r for r in dead if codes.get(r, (None,))[0] != 0]
    return sorted(dead)


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def await_peers(run_dir: Path, dead: list[int], within: float = 1.0) -> bool:
    """Wait until every rank but ``dead`` has returned, raised or ended; False if one had not
    within ``within`` seconds.

    A rank killed inside a collective makes its peers raise (a lost connection) within
    milliseconds, on a quiet machine. Stopped before they have written it, they would leave
    no trace of the consequence, and the report would tell the cause alone.
    """
    deadline = time.monotonic() + within
    while True:
        waiting = [r for r, pid in rank_pids(run_dir).items()
                   if r not in dead and not _has_outcome(run_dir, r) and not _gone(pid)]
        if not waiting:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _has_outcome(run_dir: Path, rank: int) -> bool:
    return any((run_dir / name(rank)).exists() for name in (result_file, error_file))


def without_outcome(run_dir: Path, nproc: int) -> list[int]:
    """Ranks that neither returned nor raised (after the run: every rank has ended).

    The files are named by global rank: on node k of a multi-node run this node's ranks are
    k * nproc onwards, so the ranks asked about are those that registered here.
    """
    ranks = sorted(rank_pids(run_dir)) or range(nproc)
    return [r for r in ranks if not _has_outcome(run_dir, r)]


def _recorded_exits(run_dir: Path) -> dict[int, tuple[int, float]]:
    """rank -> (exit status, when) of each rank process torchrun's agent saw end (-N: signal N)."""
    found = {}
    for rank, pid in rank_pids(run_dir).items():
        path = run_dir / exit_file(pid)
        try:
            found[rank] = (int(path.read_text()), path.stat().st_mtime)
        except (OSError, ValueError):
            pass
    return found


def await_exits(run_dir: Path, ranks: list[int], within: float = 2.0) -> bool:
    """Wait until torchrun's agent has recorded how each of ``ranks`` ended; False if it did
    not within ``within`` seconds (then its closing report is the only record)."""
    deadline = time.monotonic() + within
    while not set(ranks) <= set(_recorded_exits(run_dir)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def failure(error: dict | None, returncode: int, agent_log: list, logs: dict,
            dead: list[int] = (), run_dir: Path | None = None) -> LaunchError:
    """The LaunchError of a failed run: the root cause first, what followed from it after."""
    full = _full_text(error) if error is not None else None
    pids = rank_pids(run_dir) if run_dir is not None else {}
    # A rank that wrote an error record exited by itself after raising: not a death.
    exits = [(r, code) for r, code in _exit_codes(agent_log, pids).items()
             if run_dir is None or not (run_dir / error_file(r)).exists()]
    # The ranks that ended unasked, in the order they ended, with what the agent recorded. A
    # rank torchrun stopped itself (its SIGTERM to the survivors of a failure) is no cause,
    # however soon the supervisor found it gone.
    recorded = _recorded_exits(run_dir) if run_dir is not None else {}
    stopped = _stopped_by_agent(agent_log)
    ordered = sorted((r for r in dead if pids.get(r) not in stopped),
                     key=lambda r: recorded.get(r, (0, float("inf")))[1])
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


def _stopped_by_agent(agent_log: list) -> set[int]:
    """The pids torchrun's agent sent its closing signal: survivors it stopped, not failures."""
    return {int(m[1]) for line in agent_log if (m := _AGENT_CLOSED.search(line))}


def _exit_codes(agent_log: list, pids: dict[int, int]) -> dict[int, int]:
    """rank -> non-zero exit code of every worker torchrun saw fail (-N: killed by signal N)."""
    rank_of = {pid: rank for rank, pid in pids.items()}
    stopped = _stopped_by_agent(agent_log)
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
    blocks = clean_stack(dump).split("\n\n")
    return "\n\n".join(b for b in blocks if b.strip() and not b.startswith(("Extension modules",
                                                                          "Fatal Python")))


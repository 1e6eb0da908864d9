"""The supervisor every run goes through, cold or warm: it streams the ranks' output into the
cell, watches for failures and the clock, collects the values, and stops every process however
the run ends.

The clock and the checks are the controller's own: whatever the ranks do to their group, their
output or their descriptors, a timeout fires and a dead rank is named. A cold run
(:mod:`labkit.launcher`) is supervised until torchrun exits; a run on warm workers
(:mod:`labkit.warm`) until every rank has marked the end of its task (:class:`WarmTask`), its
ranks living on if it went well. :mod:`labkit._spawn` starts the runs, :mod:`labkit._failures`
reads how their ranks ended.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

from ._display import is_native_info
from ._failures import (
    LaunchTimeout,
    await_exits,
    await_peers,
    clean_stack,
    failure,
    rank_pids,
    read_errors,
    report_restarts,
    silently_dead,
    without_outcome,
)
from ._progress import MARKER, ProgressBars
from ._protocol import (
    CONTINUES,
    END_OF_TASK,
    ERRORS,
    PIDS,
    READY,
    RESULTS,
    STACK_SIGNAL,
    Job,
    rank_of,
    stack_file,
)
from ._spawn import Run

_STACK_WAIT = 2.0  # seconds the ranks get to dump their stacks before a timeout kills them
# A cold run's timeout counts from the moment every rank calls the function; the start-up
# before it (torch imported, the process group formed: seconds, minutes on a busy laptop)
# gets max(timeout, STARTUP_S) of its own, so that a short timeout means the same everywhere.
STARTUP_S = 120.0
GRACE = 3.0  # seconds between SIGTERM and SIGKILL when the controller stops a run
_HEARTBEAT = 30.0  # a quiet run reports its progress this often
_SETTLE = 1.0  # seconds a failed warm rank gets to mark its end (its last output) before the stop


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


# Returned from labkit.launcher, the public place: its repr and pickles name it there.
LaunchResult.__module__ = "labkit.launcher"


class Shield:
    """Runs ``cleanup`` when the block ends, however it ends, and lets no interrupt cut it short.

    In the main thread (where SIGINT lands), the first SIGINT inside the block interrupts as
    usual (KeyboardInterrupt); later ones, and every one once the cleanup has begun, wait until
    it is over: a learner pressing stop again and again must not leave ranks alive (SIGTERM
    sent, SIGKILL never) or a run folder behind. If one arrived during a cleanup after a block
    that ended normally, KeyboardInterrupt is raised after it.
    """

    def __init__(self, cleanup):
        self.cleanup, self.armed, self.deferred, self.handler = cleanup, True, 0, None

    def __enter__(self) -> Shield:
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


def supervise(run: Run, job: Job, nproc: int, timeout, show_ranks, command,
              max_restarts: int = 0, task: WarmTask | None = None) -> LaunchResult:
    """Stream output, watch for failure and timeout, and always leave no process behind.

    With ``task`` (a run on warm workers) the run ends when every rank has marked the task's
    end, and its processes are stopped only if it failed. The clock is the controller's own:
    whatever the ranks do to their group, their output or their descriptors, a timeout fires.
    """
    __tracebackhide__ = True
    out = _Output(show_ranks, quiet_native_info=job.framework == "tensorflow")
    watch = _Watch(run, job, nproc, timeout, task, max_restarts)
    keep = []  # a warm run that went well leaves its ranks running for the next
    # A cold run, or warm workers' first start, takes seconds before the function runs
    # (torch imported, the group formed): say so at once, and how long it took. An empty
    # show_ranks asks for silence (a check's run): none of that either.
    starting = (task is None or task.number == 0) and out.show != set()
    if starting:
        out.bars.starting(nproc)
    with Shield(lambda: (keep and keep[0]) or stop_run(run)):
        try:
            done = False
            while not done:
                lines, done = _drain(run.lines)
                if starting and watch.up():  # before the lines: the first ones are the run's
                    out.bars.ready()
                    starting = False
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
            if starting and watch.up():
                out.bars.ready()
            if not ended:
                try:
                    run.proc.wait(timeout=2 * GRACE)
                except subprocess.TimeoutExpired:  # its output ended, it did not: stop it
                    stop_run(run)
            out.flush(partial=True)
            seconds = time.monotonic() - watch.start
            errors = read_errors(run.run_dir)
            error = errors[0] if errors else None
            # Ranks that ended without returning, in a run nobody stopped (os._exit(0)).
            missing = ([] if job.mode != "function" or error is not None or watch.dead
                       or watch.stopped else without_outcome(run.run_dir, nproc))
            if max_restarts and run.proc.returncode == 0:
                report_restarts(run.run_dir, errors)
            elif (error is not None or watch.dead or missing
                  or not ended and (task is not None or run.proc.returncode != 0)):
                failed = failure(error, run.proc.returncode, out.agent_log, out.logs,
                                 watch.dead or missing, run.run_dir)
                if ended and not (watch.stopped or watch.dead or missing):
                    # Every warm rank raised or returned, then put its state back and marked
                    # the end: nothing is left running that a next run could trip over.
                    failed.ranks_back = True
                    keep.append(True)
                raise failed
            values = _collect(run.run_dir)
            keep.append(ended)
            return LaunchResult(values, seconds, out.logs, nproc, job.backend, command,
                                out.agent_log)
        except KeyboardInterrupt:
            stopped = stop_run(run)
            out.bars.end_line()
            print(f"[labkit] interrupted: stopped torchrun and {stopped} worker process(es)")
            raise
        finally:  # the bars become a static summary, whatever ended the run
            out.bars.finish()


@dataclasses.dataclass
class WarmTask:
    """A run on warm workers as the supervisor follows it: which ranks have marked its end.

    A warm rank does not exit after its function: it prints the end-of-task mark (after its
    last output line, so nothing of the run arrives after the run is over) and waits for the
    next task. Its number tells a late mark of an earlier task from this one's.
    """

    number: int
    ended: set = dataclasses.field(default_factory=set)
    failed_at: float | None = None
    settled_at: float | None = None

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

    def others_finishing(self, now: float) -> bool:
        """Once the failed ranks have marked the end: whether the others may still be about to.

        A warm rank marks the end only after every rank has reached the same point (they agree
        through the store whether to form the group again), so the rest follow within moments
        unless one is stuck elsewhere; _REST_GRACE bounds the wait for those.
        """
        self.settled_at = self.settled_at or now
        return now - self.settled_at < _REST_GRACE

    def settled(self, run_dir: Path) -> bool:
        """Whether the failed ranks' output is all in (they marked the end), or _SETTLE passed."""
        if {rank_of(f.name) for f in run_dir.glob(ERRORS)} <= self.ended:
            return True
        now = time.monotonic()
        self.failed_at = self.failed_at or now
        return now - self.failed_at > _SETTLE


# Seconds a run's ranks get, once all have returned, to end (or mark the end): at least the run's
# own timeout. Tens of seconds: on a busy laptop an exit that destroys the group and unloads
# torch can take that long.
_TEARDOWN_S = 30.0
# Seconds the other warm ranks get to mark a failed run's end after the failed ranks did: they
# passed the same barrier, so this is their new group forming, not a wait for a stuck rank.
_REST_GRACE = 5.0
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

    def __init__(self, run: Run, job: Job, nproc: int, timeout, task, max_restarts: int):
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
            return now - self.exited_at > GRACE
        if not self.max_restarts:  # with restarts, torchrun replaces failed ranks itself
            failed = any(run.run_dir.glob(ERRORS))
            gone = [] if failed else silently_dead(run.run_dir, self.job.mode == "script")
            if failed and not gone and task is not None and task.ended_by_all(self.nproc):
                return True  # every rank is back in its loop: the pool decides what follows
            if (failed and not gone and task is not None and task.settled(run.run_dir)
                    and task.others_finishing(now)):
                return False
            if gone or (failed and (task is None or task.settled(run.run_dir))):
                # Stop the peers now rather than after torchrun's own (up to 30 s) shutdown,
                # or never (torchrun takes a rank's exit code 0 for success, and waits).
                script = self.job.mode == "script"
                self.dead = gone or silently_dead(run.run_dir, script)
                if gone:  # the peers' errors are the consequence: let them be written
                    await_peers(run.run_dir, gone)
                if self.dead and not await_exits(run.run_dir, self.dead):
                    _await_agent(run, out, task)  # let torchrun say how the rank died
                if script and not failed:  # its exit status may have said "ended with code 0"
                    self.dead = silently_dead(run.run_dir, script)
                    if not self.dead:
                        return False
                stop_run(run)
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
            out.bars.end_line()
            print(_progress_line(now - self.start, self.nproc - returned, self.nproc))
            self.last_output = now
        return False

    def up(self) -> bool:
        """Whether every rank is up: it has started the function (a warm rank: formed the
        group; a script's rank, which forms its group itself: started)."""
        if self.task is not None:
            return self.task.ended_by_all(self.nproc)
        pattern = PIDS if self.job.mode == "script" else READY
        return len(list(self.run.run_dir.glob(pattern))) >= self.nproc

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

    def __init__(self, show_ranks, quiet_native_info: bool = False):
        # TensorFlow's ranks log native INFO lines (oneDNN, CUDA drivers) before its logging is
        # set up, past TF_CPP_MIN_LOG_LEVEL: kept in result.logs, not shown.
        self.quiet_native_info = quiet_native_info
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
        if shown is not None and not (self.quiet_native_info
                                      and is_native_info(shown.partition("] ")[2])):
            self.shown.append(shown)

    def flush(self, partial: bool = False) -> None:
        """Print what was routed; ``partial``: the end, where an unfinished line is whole."""
        if partial:
            for head, pieces in list(self.pieces.items()):
                del self.pieces[head]
                self.route(f"{head}] {''.join(pieces)}")
        if self.shown:
            self.bars.end_line()
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


def _track(run: Run) -> None:
    """Remember every descendant of torchrun: workers run in sessions of their own."""
    import psutil

    try:
        for child in psutil.Process(run.proc.pid).children(recursive=True):
            run.known.setdefault(child.pid, child)
    except psutil.Error:
        pass


def stop_run(run: Run) -> int:
    """SIGTERM torchrun and every worker, SIGKILL what is left after a grace period."""
    import psutil

    # killpg reaches torchrun and what shares its session; the ranks run in sessions of their
    # own, so each is reached by pid, from every descendant ever seen: a rank whose agent died
    # is no descendant any more, yet still holds its GPU and its peers.
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
    _, alive = psutil.wait_procs(procs, timeout=GRACE)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        run.proc.wait(timeout=GRACE)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.wait()
    run.reader.join(timeout=GRACE)
    return len(procs)


def _timed_out(run: Run, nproc: int, timeout: float, logs: dict, started: bool = True,
               task: WarmTask | None = None, returned: bool = False) -> LaunchTimeout:
    """Ask every unfinished rank for its Python stack, then build the LaunchTimeout.

    ``returned``: every rank had returned, but some did not end (a cold rank's process, a warm
    rank's end-of-task mark) within _TEARDOWN_S: those are the stuck ones.
    """
    finished = {rank_of(f.name) for f in run.run_dir.glob(RESULTS)}
    pids = rank_pids(run.run_dir)
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
                     "cause;\nrun with TORCH_DISTRIBUTED_DEBUG=DETAIL to name the mismatch.")
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
        stacks[rank] = clean_stack(dump.decode(errors="replace"))
    return stacks


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_AGENT_REPORT = 5.0  # seconds torchrun gets to report how a dead rank ended


def _await_agent(run: Run, out: _Output, task: WarmTask | None = None) -> None:
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


def _collect(run_dir: Path) -> list:
    """Every rank's return value, in rank order."""
    import cloudpickle

    values = []
    for f in sorted(run_dir.glob(RESULTS), key=lambda f: rank_of(f.name)):
        values.append(cloudpickle.loads(f.read_bytes()))
    return values


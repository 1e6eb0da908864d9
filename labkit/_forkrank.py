"""Ranks forked from torchrun's agent instead of started as new interpreters (CPU torch runs).

torchrun starts each rank as ``python -u -m labkit._worker <run folder>``: a new interpreter
that imports torch again, about 1.2 s of CPU per rank on a laptop, more than most short runs
take. Loaded into the agent by ``_spawn``'s boot script when the controller asked for it
(``LABKIT_FORK_RANKS=1``: a torch run on CPUs; never CUDA, nor TensorFlow, whose ranks must
stay torch-free), :func:`prefork` imports torch once and forks one waiting child per local
rank while the agent still has a single thread; :func:`install` then puts :func:`popen` where
torchrun's subprocess handler looks up ``Popen``, so that each rank torchrun asks for is a
:class:`ForkedRank`: the waiting child, told to become that rank. It is the agent's own
child, which torchrun polls, signals and reaps as before (its exit status, a signal
included, is the same). Any other command, and a group torchrun restarts, start as torchrun
would.

What a new interpreter gives a rank and a fork does not, the child sets up before it becomes
the rank: a session of its own (torchrun's ``start_new_session``), Python's default signal
handlers (the agent's SIGTERM handler would remove the run folder), no open file but the
three standard streams, the environment torchrun built for it, none of the agent's atexit
functions, NumPy's and torch's generators seeded afresh, and an exit that never returns into
the agent's frames (``os._exit``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_WORKER = ("-m", "labkit._worker")
_MAX_FD = os.sysconf("SC_OPEN_MAX")
# local rank -> (pid, the pipe's write end) of each child forked at the agent's start
_WAITING: dict[int, tuple[int, int]] = {}


def prefork(argv: list[str]) -> None:
    """In the agent, before torchrun starts: import torch, then fork one waiting child per
    local rank (``--nproc-per-node`` in torchrun's ``argv``).

    The fork happens here, while the agent has a single thread. Forked later, from an agent
    whose rendezvous threads run, a child can inherit a lock one of them held (glibc's
    resolver lock, seen here: the rank hung in getaddrinfo forming its group). Each child
    waits on a pipe for its order, or its end (the agent gone, or done without it).
    """
    import cloudpickle  # noqa: F401 - loaded once here, for every rank
    import torch.distributed.run  # noqa: F401

    import labkit._worker  # noqa: F401

    nproc = int(argv[argv.index("--nproc-per-node") + 1])
    for local_rank in range(nproc):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            _wait_for_order(read)  # never returns
        os.close(read)
        _WAITING[local_rank] = (pid, write)


def install() -> None:
    """Make torchrun's subprocess handler hand labkit's ranks to the waiting children."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    subprocess_handler.Popen = popen


def popen(args, env=None, stdout=None, stderr=None, **kwargs) -> subprocess.Popen:
    """torchrun's ``Popen(...)``: a :class:`ForkedRank` for labkit's worker command with its
    output inherited (the only way labkit starts torchrun) while a child waits for that local
    rank; a real Popen for anything else, and for a restarted group (the children are used)."""
    args = [str(a) for a in args]
    ours = (len(args) >= 4 and tuple(args[-3:-1]) == _WORKER and stdout is None
            and stderr is None and set(kwargs) <= {"start_new_session"} and env is not None)
    child = _WAITING.pop(int(env.get("LOCAL_RANK", -1)), None) if ours else None
    if child is None:
        return subprocess.Popen(args, env=env, stdout=stdout, stderr=stderr, **kwargs)
    return ForkedRank(args, env=env, start_new_session=kwargs.get("start_new_session", False),
                      child=child)


class ForkedRank(subprocess.Popen):
    """A Popen whose child is one of the agent's waiting forks, told to become this rank.

    Popen's bookkeeping (poll, wait, send_signal, the exit status) is kept: the child is the
    agent's own. Valid only for a command with no pipes (stdio inherited).
    """

    def __init__(self, args, *, env, start_new_session, child):
        self._child, self._new_session = child, start_new_session
        super().__init__(args, env=env, start_new_session=start_new_session)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                       *rest):
        import pickle

        pid, pipe = self._child
        order = pickle.dumps({"run_dir": args[-1], "env": env, "session": self._new_session})
        try:
            with os.fdopen(pipe, "wb") as f:
                f.write(order)
        except OSError:  # the child is gone (killed meanwhile): start the command itself
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds,
                                          cwd, env, *rest)
        self.pid = pid
        self._child_created = True


def _wait_for_order(read: int) -> None:
    """In a waiting child: block until the agent's order, then become the rank; exit if the
    pipe ends without one."""
    code = 0
    try:
        # The boot script's SIGTERM handler removes the run folder: never in a child.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # Only its own pipe's read end stays open: with a sibling's write end (or its own)
        # open, a pipe would never end when the agent goes.
        os.closerange(3, read)
        os.closerange(read + 1, _MAX_FD)
        with os.fdopen(read, "rb") as f:
            order = f.read()
        if order:
            import pickle

            got = pickle.loads(order)
            _become_rank(got["run_dir"], got["env"], got["session"])  # never returns
    except BaseException:  # noqa: BLE001 - it must not unwind into the agent's frames
        code = 1
    finally:
        os._exit(code)


def _become_rank(run_dir: str, env: dict | None, new_session: bool) -> None:
    """In the forked child: clear what the agent set up, run the worker shim, exit."""
    code = 1
    try:
        if new_session:
            os.setsid()
        # The agent's handlers are not the rank's: SIGTERM would remove the run folder, and
        # torchrun's SIGINT/SIGHUP/SIGQUIT handlers raise its own exception.
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # As Popen's close_fds does before an exec: the agent's sockets (its rendezvous store
        # among them) must not stay open, or listening, in the ranks.
        os.closerange(3, _MAX_FD)
        import atexit

        atexit._clear()  # the agent's exit functions are its own
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        import tempfile

        tempfile.tempdir = None  # gettempdir() reads TMPDIR again, from the rank's environment
        # A new interpreter seeds NumPy's and torch's global generators from the system;
        # forks of one agent would otherwise all draw the same numbers (random reseeds itself).
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules:
            sys.modules["torch"].seed()
        import labkit._worker as _worker

        # As `python -m labkit._worker <folder>` has them: multiprocessing's spawn re-imports
        # __main__ in its children, which must be the shim, not torchrun's module.
        sys.argv = [_worker.__file__, run_dir]
        sys.modules["__main__"] = _worker

        _worker.leave(_worker.main(run_dir))  # leave() ends the process with os._exit
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - it must not unwind into the agent's frames
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

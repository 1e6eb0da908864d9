"""Exercise checks: each runs what the learner wrote and answers pass, or not yet with a hint.

This module owns the course's verdicts (:class:`Verdict`, which the capstone grader in
:mod:`labkit.capstone` reports with too) and the machinery every graded exercise shares:

- :func:`exercise`, the decorator that turns a grader into a check: it prints the verdict,
  records a pass in the learner's progress file, and turns the learner's exceptions and the
  untouched placeholder into a "not yet" instead of an error;
- :class:`NotYet`, what a grader raises for a wrong answer (what is wrong, and a hint);
- :func:`on_ranks`, which runs a grading worker on real ranks (warm workers, gloo) and turns
  the learner's failure on a rank (its traceback, or a hang) into a :class:`NotYet`;
- :func:`solution`, a reference solution (kept in ``solutions/``), only when asked for;
- :func:`progress`, the exercises passed across the course;
- :func:`in_band`, the printed verdict for a noisy figure (a time, an accuracy after a short
  run), and :func:`prediction`, the learner's prediction compared with the measurement.

The graders themselves live in :mod:`labkit.exercises`, one module per notebook topic.

A check never raises on a wrong answer (the notebook goes on, and runs in CI with its exercise
cells as the learner finds them); it prints its verdict and returns a truthy or falsy
:class:`Verdict`. Importing this module imports no framework.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import json
import math
import os
import re
import sys
import traceback
from pathlib import Path

from . import profile
from ._display import WIDTH, hang, show_verdict

__all__ = ["Verdict", "NotYet", "exercise", "on_ranks", "written", "comparable", "solution",
           "progress", "assert_passed", "learner_traceback", "judged", "NotAllowedHere",
           "out_of_reach",
           "in_band", "prediction", "EXERCISES", "PLACEHOLDER"]

# The exercise cells as the learner finds them: functions that raise
# NotImplementedError(PLACEHOLDER), or names assigned ``...``. A check sees either and says
# "not written yet" without running anything.
PLACEHOLDER = "your code here"
_PACKAGE = Path(__file__).resolve().parent


@dataclasses.dataclass
class Verdict:
    """The outcome of one check: ``passed``, what was found, and a hint when it did not pass."""

    exercise: str
    passed: bool
    detail: str
    hint: str = ""
    # The whole traceback of an exception behind a "not yet"; the detail shows the learner's
    # frames of it, with the library's in between elided.
    traceback: str = ""
    judged: bool = True  # False: a claim the smoke profile's sizes are too small to judge

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            return f"[pass] {self.exercise}: {self.detail}"
        return f"[not yet] {self.exercise}: {self.detail}\n  hint: {self.hint}"

    def show(self) -> Verdict:
        """Show this verdict: a badge and its hint on its own line in Jupyter, else the text of
        ``str(self)`` with its long lines wrapped."""
        if self.passed:
            show_verdict("pass", self.exercise, self.detail)
        else:
            show_verdict("not yet", self.exercise, self.detail, [("hint", self.hint)])
        return self

    def _ipython_display_(self) -> None:
        # A check prints its verdict when it is made; a cell ending in one shows it once.
        pass


class NotYet(Exception):
    """Raised by a grader for a wrong answer: ``detail`` says what is wrong, ``hint`` what to try.

    Example::

        >>> raise NotYet("rank 1 saw the same batches as rank 0",
        ...              "was a DistributedSampler used?")
    """

    def __init__(self, detail: str, hint: str, *, stuck: list[int] | None = None,
                 traceback: str = ""):
        super().__init__(detail)
        self.detail = detail
        self.hint = hint
        self.stuck = stuck or []  # from on_ranks: the ranks a hang left waiting
        self.traceback = traceback  # from on_ranks: a rank's whole traceback


class NotAllowedHere(RuntimeError):
    """Raised by one of labkit's functions that answers an exercise, while it is graded."""


@contextlib.contextmanager
def out_of_reach(fn, modules, names, why: str):
    """While the block runs, the functions ``names`` of ``modules[0]`` raise
    :class:`NotAllowedHere` wherever the learner's ``fn`` could reach them: in ``modules``
    (the owner and the modules that import them) and in ``fn``'s globals, whatever name
    they are bound to there. Everything is put back when the block ends, however it ends.

    Example::

        >>> with out_of_reach(my_plan, [planner], ["plan"], "my_plan computes it by hand"):
        ...     got = my_plan(model)          # planner.plan(...) inside raises NotAllowedHere
    """
    owner = modules[0].__name__.rsplit(".", 1)[-1]
    real = {id(getattr(modules[0], name)): name for name in names}

    def refusal(name):
        def refused(*args, **kwargs):
            raise NotAllowedHere(f"{owner}.{name} is not allowed here: {why}")
        refused.__name__ = name
        return refused

    saved = []
    for space in [vars(m) for m in modules] + [getattr(fn, "__globals__", {})]:
        for key, value in list(space.items()):
            if callable(value) and id(value) in real:
                saved.append((space, key, value))
                space[key] = refusal(real[id(value)])
    try:
        yield
    finally:
        for space, key, value in reversed(saved):
            space[key] = value


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One graded exercise: its id (the name ``solution`` takes), its notebook and its title."""

    id: str
    notebook: str
    title: str
    grader: str = ""  # the check's function name, which the notebook calls
    module: str = ""  # the grader's module: tells 02 from its Keras twin, both notebook "02"


EXERCISES: dict[str, Exercise] = {}  # id -> Exercise, filled as labkit.exercises modules import
_LAST: dict[str, bool] = {}  # id -> whether this process's last check of it passed


def exercise(id: str, *, notebook: str, title: str):
    """Make ``grader`` a check: printed verdict, recorded pass, never an exception for the learner.

    The grader gets the learner's answer (a function, a value) and returns a short description
    of what it verified, or raises :class:`NotYet`. The decorator adds the rest: an answer that
    is still the placeholder is "not written yet" without running anything; an exception from
    the learner's code is shown with its traceback (the learner's frames) as a "not yet"; a
    pass is recorded for :func:`progress`.

    Example::

        >>> @exercise("busbw", notebook="00", title="bus bandwidth from algorithm bandwidth")
        ... def bus_bandwidth(fn):
        ...     if abs(fn(10.0, 4) - 15.0) > 1e-9:
        ...         raise NotYet(f"busbw(10, 4) gave {fn(10.0, 4)}", "a ring moves 2(n-1)/n ...")
        ...     return "busbw = algbw * 2(n-1)/n for every n tried"
    """
    if id in EXERCISES:
        raise ValueError(f"exercise id {id!r} is taken (by notebook {EXERCISES[id].notebook}): "
                         f"every exercise needs its own id")

    def wrap(grader):
        EXERCISES[id] = Exercise(id, notebook, title, grader.__name__, grader.__module__)

        @functools.wraps(grader)
        def graded(*args, **kwargs) -> Verdict:
            verdict = _grade(id, title, grader, args, kwargs)
            _LAST[id] = verdict.passed
            if verdict.passed:
                _record_pass(id)
            return verdict.show()

        graded.exercise_id = id
        return graded

    return wrap


def _grade(id: str, title: str, grader, args, kwargs) -> Verdict:
    """Run one grader on the learner's answer; every outcome becomes a Verdict."""
    if any(_is_placeholder(a) for a in (*args, *kwargs.values())):
        return Verdict(title, False, "not written yet (the cell still holds its placeholder)",
                       f"write your answer in the marked cell, run it, then run this check "
                       f"again; check.solution({id!r}) shows one answer")
    try:
        detail = grader(*args, **kwargs)
    except NotYet as wrong:
        return Verdict(title, False, wrong.detail, wrong.hint, traceback=wrong.traceback)
    except Exception as exc:  # the learner's code, run in this process, may fail in any way
        if _raised_placeholder(exc):
            return Verdict(title, False, "not written yet (it still raises NotImplementedError)",
                           f"replace the `raise NotImplementedError(...)` line with your code; "
                           f"check.solution({id!r}) shows one answer")
        whole = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        ours = _code_of(grader)
        if not _has_learner_frame(whole, ours):
            # Nothing of the learner's ran when it failed: the check itself could not go on,
            # most often on a value of a kind it did not expect (a list for a tensor, float64).
            return Verdict(title, False, f"the check could not use what your code gave it: "
                                         f"{type(exc).__name__}: {_first_line(exc)}",
                           "this is the check failing, not your code raising: give back what the "
                           "task asks for (its type, and for a tensor its dtype and shape)",
                           traceback=whole)
        return Verdict(title, False, f"your code raised {type(exc).__name__}: "
                                     f"{_first_line(exc)}\n{learner_traceback(whole, ours)}",
                       "the traceback above is your code's: fix the line it ends on",
                       traceback=whole)
    return Verdict(title, True, str(detail))


def _is_placeholder(value) -> bool:
    if value is Ellipsis:
        return True
    if isinstance(value, type):  # a class to write (an autograd Function): any of its methods
        codes = (getattr(getattr(member, "__func__", member), "__code__", None)
                 for member in vars(value).values())
        return any(code is not None and _code_has_placeholder(code) for code in codes)
    code = getattr(value, "__code__", None)
    return code is not None and _code_has_placeholder(code)


def _code_has_placeholder(code) -> bool:
    for const in code.co_consts:
        if const == PLACEHOLDER:
            return True
        if hasattr(const, "co_consts") and _code_has_placeholder(const):
            return True
    return False


def _raised_placeholder(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) and PLACEHOLDER in str(exc)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')


def _frame_owner(filename: str, func: str = "", checker=frozenset()) -> str:
    """Whose code a traceback frame runs: "labkit", a library's name, or "" for the learner's.

    ``checker``: ``(file, function)`` pairs that count as labkit's too (a grader, or a grading
    worker, defined outside the package, as a test defines them).
    """
    if (filename, func) in checker:
        return "labkit"
    if filename.startswith("<frozen "):
        return "python"
    if filename.startswith("<"):  # <string>, <ipython-input-...>: code typed, not installed
        return ""
    path = Path(filename).resolve()
    if path.is_relative_to(_PACKAGE):
        return "labkit"
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1:]
            return rest[0].split(".")[0] if rest else "python"
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        if path.is_relative_to(Path(prefix).resolve()):
            return "python"
    return ""


def _has_learner_frame(text: str, checker=frozenset()) -> bool:
    return any((m := _FRAME.match(line)) and not _frame_owner(m["file"], m["func"], checker)
               for line in text.splitlines())


def _code_of(*fns) -> frozenset:
    """The ``(file, function)`` of each of ``fns``: frames of the check's own code."""
    codes = (getattr(inspect.unwrap(fn), "__code__", None) for fn in fns)
    return frozenset((c.co_filename, c.co_name) for c in codes if c is not None)


def learner_traceback(text: str, checker=frozenset()) -> str:
    """A traceback as a learner needs it: their own frames, one line for where labkit called
    them, and each run of a library's frames (torch's internals) elided to one line.

    ``text`` is a formatted traceback (``traceback.format_exception``'s, or a rank's as the
    launcher reports it); the frames of a traceback that never reached the learner's code are
    kept as they are. The whole text stays on the verdict (``Verdict.traceback``).

    Example::

        >>> print(learner_traceback(text))
          (labkit called your code from labkit/exercises/data_parallel.py, line 88, in _worker)
          File "/tmp/ipykernel_7/12.py", line 4, in my_ddp_training
            loss = nn.functional.cross_entropy(model(x), y)
          ... 6 frames inside torch
        RuntimeError: mat1 and mat2 shapes cannot be multiplied (8x64 and 256x10)
    """
    if not _has_learner_frame(text, checker):
        return text.rstrip()
    # Split into items: a frame (its "File" line and the indented lines under it) or a line.
    items: list[tuple[str, list[str]]] = []  # (owner, lines); owner None for a plain line
    for line in text.rstrip().splitlines():
        m = _FRAME.match(line)
        if m:
            items.append((_frame_owner(m["file"], m["func"], checker), [line]))
        elif line.startswith("    ") and items and items[-1][0] is not None:
            items[-1][1].append(line)
        else:
            items.append((None, [line]))
    out: list[str] = []
    i = 0
    while i < len(items):
        owner, lines = items[i]
        if owner is None or owner == "":
            if not (owner is None and lines[0].startswith("Traceback (most recent call last)")):
                out.extend(lines)
            i += 1
            continue
        j = i
        while j < len(items) and items[j][0] not in (None, ""):
            j += 1
        run = [owner for owner, _ in items[i:j]]
        if j < len(items) and items[j][0] == "" and run[-1] == "labkit":
            # The frames above the learner's: the grader calling them, the same every time.
            m = _FRAME.match(items[j - 1][1][0])
            out.append(f"  (labkit called your code from {_short_path(m['file'])}, line "
                       f"{m['line']}, in {m['func']})")
        else:
            names = ", ".join(dict.fromkeys(run))
            out.append(f"  ... {len(run)} frame{'s' if len(run) > 1 else ''} inside {names} "
                       f"(the verdict's .traceback has them all)")
        i = j
    return "\n".join(out)


def _short_path(filename: str) -> str:
    path = Path(filename).resolve()
    return str(path.relative_to(_PACKAGE.parent)) if path.is_relative_to(_PACKAGE) else filename


def written(value, what: str = "the answer"):
    """``value`` unless it is still the placeholder ``...``; then a :class:`NotYet`.

    For graders that take several values, some of which may not be filled in yet.
    """
    if _is_placeholder(value):
        raise NotYet(f"{what} is not written yet (still `...`)",
                     f"replace the `...` of {what} in the marked cell, and run it")
    return value


def comparable(got, want, what: str = "your result"):
    """``got`` unless it cannot be compared with the reference ``want``; then a :class:`NotYet`.

    Graders call it before comparing, so that an answer of the wrong kind (a list where a
    tensor is expected, float64 for float32, another shape) is named as such, instead of the
    comparison failing inside the check. ``want`` with a ``shape`` and a ``dtype`` (a tensor, an
    array) asks for the same kind, dtype and shape; a number asks for a number.

    Example::

        >>> check.comparable([1.0, 2.0], torch.zeros(2), "my_ring(x)")
        NotYet: my_ring(x) gave a list, where the check compares a tensor of shape (2,) ...
    """
    if hasattr(want, "shape") and hasattr(want, "dtype"):
        kind = f"a {type(want).__name__} of shape {tuple(want.shape)} and dtype {want.dtype}"
        if not (hasattr(got, "shape") and hasattr(got, "dtype")):
            raise NotYet(f"{what} gave a {type(got).__name__}, where the check compares {kind}",
                         f"return {kind}, as the task says")
        if got.dtype != want.dtype:
            raise NotYet(f"{what} has dtype {got.dtype}, where the check compares {want.dtype}",
                         "keep the dtype of the input: a cast (a float literal, torch.tensor of "
                         "a Python number, .float()) changes it")
        if tuple(got.shape) != tuple(want.shape):
            raise NotYet(f"{what} has shape {tuple(got.shape)}, where the check compares "
                         f"{tuple(want.shape)}", "return the whole result, in the shape the task "
                                                 "gives (not a slice, a flattened copy or a "
                                                 "stacked list)")
        return got
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        if isinstance(got, bool) or not isinstance(got, (int, float)) and not (
                hasattr(got, "item") and getattr(got, "shape", None) in ((), None)):
            raise NotYet(f"{what} gave a {type(got).__name__}, where the check compares a number",
                         "return a Python number (a one-element tensor's .item())")
    return got


def on_ranks(worker, *args, nproc: int = 2, timeout: float = 60.0, warm: bool = True,
             framework: str = "torch", **kwargs) -> list:
    """Run ``worker(*args, **kwargs)`` on ``nproc`` real ranks; every rank's return value.

    The learner's failure on a rank becomes a :class:`NotYet`: an exception with its rank and
    traceback, a hang (a collective that not every rank calls) with where each rank waited.
    Grading runs on gloo (CPU) ranks, on warm workers where the framework allows it.

    Example::

        >>> on_ranks(_sum_of_ranks, learner_fn)      # [1, 1] from two ranks
    """
    from .launcher import LaunchError, LaunchTimeout, launch

    if framework != "torch":
        warm = False  # TensorFlow sets its collectives up once per process: always fresh
    try:
        return launch(worker, *args, nproc=nproc, backend="gloo", framework=framework,
                      timeout=timeout, warm=warm, show_ranks=[], **kwargs).values
    except LaunchTimeout as hang:
        where = "; ".join(f"rank {r}: {_last_frame(s)}" for r, s in sorted(hang.stacks.items()))
        raise NotYet(f"the ranks were still running after {timeout:g} s ({where or 'no stacks'})",
                     "every rank must call the same collectives in the same order: one that a "
                     "rank skips (or calls once more) leaves the others waiting",
                     stuck=list(hang.stuck)) from None
    except LaunchError as failed:
        rank, text = _most_informative(_failures(failed))
        if "NotImplementedError" in text and PLACEHOLDER in text:
            raise NotYet("not written yet (it still raises NotImplementedError)",
                         "replace the `raise NotImplementedError(...)` line with your "
                         "code") from None
        raise _rank_failure(rank, text, _code_of(worker)) from None


# What a rank's error says when a peer it was exchanging with ended first: the connection to
# it closed. True, but a consequence: the peer's own failure is what the learner must see.
_SECONDARY = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "[Errno 32]", "[Errno 104]")
# libstdc++'s last words when a C++ exception escapes (gloo's checks on a background thread):
# the process aborts without a Python error, its output keeps the reason.
_ABORTED = "terminate called after throwing"


def _secondary(text: str) -> bool:
    """Whether a failure's text is a lost connection: its first line, not what it quotes after
    (a death's text ends with the connection errors of the peers that followed it)."""
    first = (text.strip().splitlines() or [""])[0]
    return any(sign in first for sign in _SECONDARY)


def _failures(failed) -> list[tuple[int | None, str]]:
    """``(rank, text)`` of each failure a LaunchError holds, in the launcher's order.

    The launcher names the root cause first (a rank that died before the peers that lost it),
    with the whole text of the first rank that raised in ``full_message``: that is a second
    failure when the first was a death, whose own text is the message. A rank that aborted
    unnoticed (its death not yet recorded when the run stopped) still left its last words in
    its output.
    """
    full, said = failed.full_message, str(failed)
    raised = _rank_in(full) if full else None
    if full and raised == failed.rank:
        found = [(failed.rank, full)]  # the whole text: the message shortens it
    else:
        found = [(failed.rank, said)] + ([(raised, full)] if full else [])
    for rank, lines in sorted((failed.logs or {}).items(), key=lambda kv: str(kv[0])):
        tail = [str(line) for line in lines[-5:]]
        if rank not in (r for r, _ in found) and any(_ABORTED in line for line in tail):
            found.append((rank, f"rank {rank} aborted in native code; its last output lines:\n"
                                + "\n".join(tail)))
    return found


def _rank_in(text: str) -> int | None:
    m = re.match(r"rank (\d+) failed with ", text)
    return int(m[1]) if m else None


def _most_informative(failures: list[tuple[int | None, str]]) -> tuple[int | None, str]:
    """The failure to show: the first that is not a peer's lost connection (which only says
    that another rank failed first), else the first."""
    return next((f for f in failures if not _secondary(f[1])), failures[0])


def _rank_failure(rank, text: str, checker=frozenset()) -> NotYet:
    """The NotYet of a rank that raised: the learner's code, or the grading worker itself."""
    who = f"rank {rank}" if rank is not None else "a rank"
    head, _, tb = text.partition(f"--- {who} traceback ---\n")
    said = (head.strip().splitlines() or [""])[0][:300].removeprefix(f"{who} failed with ")
    if _secondary(text):
        # Nothing better was found: say that the cause is elsewhere, not on the line shown.
        return NotYet(f"{who} lost its connection to a peer: {said}\n"
                      f"{learner_traceback(tb, checker) if tb else ''}".rstrip(),
                      "that error is a consequence: a rank this one was exchanging with ended "
                      "first (it crashed, was killed, or left the exchange early). Every rank "
                      "must make the same calls with messages of the sizes its peers expect",
                      traceback=text)
    if not tb or not _has_learner_frame(tb, checker):
        # A traceback without the learner's frames is the grading worker failing (or a rank
        # that died): the text says what happened, there is no line of theirs to fix.
        if tb:
            return NotYet(f"the check's worker failed on {who}, not in your code: {said}",
                          "this is the check failing on what your code gave it: give back "
                          "what the task asks for (its type, and for a tensor its dtype and "
                          "shape)", traceback=text)
        text = text.strip()
        return NotYet(text if text.startswith(f"{who} ") else f"{who} failed: {text}",
                      "a rank that ends without a Python error was killed (out of memory?) or "
                      "crashed in native code: the text above says which", traceback=text)
    return NotYet(f"{who} raised {said}\n"
                  f"{learner_traceback(tb, checker)}",
                  "the traceback above is your code's, on that rank: fix the line it ends on",
                  traceback=text)


def _last_frame(stack: str) -> str:
    """Where a stuck rank waits: the call it is in, and the line of the code that made it."""
    # A stack dump lists the most recent call first, down to the rank's function.
    frames = [ln.strip() for ln in stack.strip().splitlines() if ln.strip().startswith("File ")]
    if not frames:
        return "?"
    waiting = frames[0].rsplit(" in ", 1)[-1]
    origin = frames[-1].removeprefix("File ")
    return f"waits in {waiting}, from {origin}"[:200]


# ---- solutions and progress ------------------------------------------------------------------


def solution(exercise: str) -> str:
    """Print (and return) the reference solution of an exercise: only when you ask for it.

    Example::

        >>> check.solution("frozen_base")
        for p in model.features.parameters():
            p.requires_grad = False
    """
    from . import exercises

    blocks = exercises.solution_blocks()
    if exercise not in blocks:
        raise KeyError(f"no exercise {exercise!r}: choose from {', '.join(sorted(blocks))}")
    text = blocks[exercise]
    print(text)
    return text


def assert_passed(ids) -> None:
    """Fail unless every exercise in ``ids`` was checked in this process, last with a pass.

    The solution notebooks end with it: a solution that no longer passes fails CI.
    """
    missing = [i for i in ids if i not in _LAST]
    failed = [i for i in ids if i in _LAST and not _LAST[i]]
    assert not missing and not failed, (f"exercises never checked: {missing}; checked but not "
                                        f"passed: {failed}")
    print(hang(f"all {len(ids)} exercises passed: ", ", ".join(ids)))


def progress_file() -> Path:
    """Where passes are recorded: ``$LABKIT_HOME/progress.json`` (``~/.labkit`` by default)."""
    return Path(os.environ.get("LABKIT_HOME") or Path.home() / ".labkit") / "progress.json"


def _passes() -> dict:
    try:
        return json.loads(progress_file().read_text())
    except (OSError, ValueError):  # no file yet, or one damaged by hand: start afresh
        return {}


def _record_pass(id: str) -> None:
    passes = _passes()
    if id in passes:
        return
    passes[id] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    path = progress_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(passes, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home must not fail the exercise itself
        print(f"[labkit] could not record this pass in {path}: {exc}", file=sys.stderr)


class Progress(dict):
    """``{notebook: [passed exercise ids]}``; :func:`progress` has printed it already, so a
    notebook cell that ends with it shows it once."""

    def _ipython_display_(self) -> None:
        pass


def progress(show: bool = True) -> Progress:
    """The exercises you have passed, notebook by notebook (kept in :func:`progress_file`).

    Returns ``{notebook: [passed exercise ids]}`` for every notebook with exercises, a twin
    counted on its own (``"02"`` and ``"02 keras"``).

    Example::

        >>> check.progress()
        3 of 51 exercises passed (recorded in /home/you/.labkit/progress.json)
          00        2 of 3  [pass] first all-reduce, [pass] bus bandwidth, [    ] ring time
        ...
    """
    from . import exercises

    exercises.load_all()
    passes = _passes()
    by_notebook: dict[str, list[Exercise]] = {}
    for ex in EXERCISES.values():
        by_notebook.setdefault(exercises.notebook_label(ex.module, ex.notebook), []).append(ex)
    by_notebook = dict(sorted(by_notebook.items()))
    done = Progress({nb: [e.id for e in exs if e.id in passes]
                     for nb, exs in by_notebook.items()})
    if show:
        total = sum(len(v) for v in by_notebook.values())
        print(f"{sum(len(v) for v in done.values())} of {total} exercises passed "
              f"(recorded in {progress_file()})")
        width = max(len(nb) for nb in by_notebook)
        for nb, exs in by_notebook.items():
            marks = [f"[{'pass' if e.id in passes else '    '}] {e.title}" for e in exs]
            print(_packed(f"  {nb:<{width}}  {len(done[nb])} of {len(exs)}  ", marks))
    return done


def _packed(label: str, items: list[str]) -> str:
    """``items`` after ``label``, comma-separated, as many to a line as fit: an item (an
    exercise's mark and title) is never broken across lines, the lines after the first start
    under the first item."""
    lines, line = [], label
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if line.strip() and line != label and len(line) + 1 + len(piece) > WIDTH:
            lines.append(line)
            line = " " * len(label) + piece
        else:
            line += ("" if line == label else " ") + piece
    lead = len(label) + len("[pass] ")  # a title too long for a line wraps under its start
    return "\n".join(one if len(one) <= WIDTH else hang(one[:lead], one[lead:])
                     for one in [*lines, line])


# ---- claims: noisy figures and predictions -----------------------------------------------------

SMOKE_NOTE = "the smoke profile's runs are too small and short for this claim to mean anything"


def judged() -> bool:
    """Whether claims about noisy figures are judged here: everywhere but the smoke profile."""
    return profile.current() != "smoke"


def _band(low: float, high: float) -> str:
    if high == math.inf:
        return f"at least {_figure(low)}"
    if low == -math.inf:
        return f"at most {_figure(high)}"
    return f"between {_figure(low)} and {_figure(high)}"


def in_band(claim: str, measured: float, low: float = -math.inf, high: float = math.inf, *,
            cause: str, retry=None) -> Verdict:
    """A printed verdict for a noisy figure: inside the band ``[low, high]`` expected, or not.

    For what a short run or a busy machine moves (an accuracy after a few epochs, a gap between
    two runs, a time): it prints the band the lesson expects, the measured value and, outside
    the band, the likely ``cause``, and never raises, so the lesson goes on. The band points
    the way the lesson does: a claim that something speeds up expects at least 1 (or more),
    so a slow-down is "not as expected". ``retry``, a function that measures again, is called
    once when the first figure misses (a busy moment passes). Exact claims are ``assert``s.

    In the smoke profile the runs are too small for such figures to mean anything: the verdict
    says the claim is not judged at this size, with the figure measured (``judged`` False, and
    falsy: it passed nothing).

    Example::

        >>> check.in_band("gap without augmentation", 0.48, 0.3, 1.0,
        ...               cause="too few epochs to memorise the training images")
        [as expected] gap without augmentation: measured 0.48, expected between 0.3 and 1
    """
    if not low <= high:
        raise ValueError(f"in_band needs low <= high, got low={low!r}, high={high!r}: swap them, "
                         f"or leave one out for a one-sided band")
    band = _band(low, high)
    measured = float(measured)
    if not judged():
        verdict = Verdict(claim, False, f"measured {_figure(measured)}; not judged at this size "
                                        f"(the cpu and gpu profiles expect {band})",
                          SMOKE_NOTE, judged=False)
        show_verdict("not judged at this size", claim, verdict.detail)
        return verdict
    inside = low <= measured <= high  # False for NaN too
    if not inside and retry is not None:
        show_verdict("measuring again", claim, f"measured {_figure(measured)}, not {band}; once "
                                               f"more, in case the machine was busy")
        measured = float(retry())
        inside = low <= measured <= high
    verdict = Verdict(claim, inside, f"measured {_figure(measured)}, expected {band}",
                      "" if inside else f"likely cause: {cause}")
    show_verdict("as expected" if inside else "not as expected", claim, verdict.detail,
                 [] if inside else [("likely cause", cause)])
    return verdict


def prediction(what: str, predicted, measured: float, *, rel: float = 0.25, unit: str = "",
               why: str = "", noisy: bool = False) -> Verdict | None:
    """Your prediction beside the measurement: within ``rel`` (25 %) of it, or how far off.

    ``predicted`` still ``...`` prints a reminder and returns None. ``why`` explains the usual
    reason a prediction misses (shown when it does). ``noisy``: the measurement is a time or
    an accuracy after a short run, which the smoke profile's sizes leave meaningless; there
    the figures are shown, and the prediction not judged. Never raises.

    Example::

        >>> check.prediction("speedup on 2 ranks", 1.9, 1.62, unit="x")
        [prediction] speedup on 2 ranks: you said 1.9x, measured 1.62x (17% off: close)
    """
    measured = float(measured)
    if predicted is Ellipsis or predicted is None:
        show_verdict("prediction", what, f"measured {_figure(measured)}{unit}. Write your "
                                         f"prediction first next time (the `...` in the cell "
                                         f"above), then run the measurement")
        return None
    predicted = float(predicted)
    if noisy and not judged():
        detail = (f"you said {_figure(predicted)}{unit}, measured {_figure(measured)}{unit}; "
                  f"not judged at this size")
        show_verdict("prediction", what, f"{detail} ({SMOKE_NOTE}; run the cpu profile to "
                                         f"compare)")
        return Verdict(what, False, detail, SMOKE_NOTE, judged=False)
    off = abs(predicted - measured) / max(abs(measured), 1e-12)
    close = off <= rel
    detail = (f"you said {_figure(predicted)}{unit}, measured {_figure(measured)}{unit} "
              f"({off:.0%} off: {'close' if close else 'not close'})")
    verdict = Verdict(what, close, detail, "" if close else why)
    show_verdict("prediction", what, detail, [] if close else [("why", why)])
    return verdict


def _figure(x: float) -> str:
    """A figure as a learner writes it: 20,436 rather than 2.04e+04; 0.112 and 1.62 as they are."""
    return f"{x:,.0f}" if 1e3 <= abs(x) < 1e12 else f"{x:.3g}"

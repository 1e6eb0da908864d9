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

import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import traceback
from pathlib import Path

__all__ = ["Verdict", "NotYet", "exercise", "on_ranks", "written", "solution", "progress",
           "assert_passed",
           "in_band", "prediction", "EXERCISES", "PLACEHOLDER"]

# The exercise cells as the learner finds them: functions that raise
# NotImplementedError(PLACEHOLDER), or names assigned ``...``. A check sees either and says
# "not written yet" without running anything.
PLACEHOLDER = "your code here"


@dataclasses.dataclass
class Verdict:
    """The outcome of one check: ``passed``, what was found, and a hint when it did not pass."""

    exercise: str
    passed: bool
    detail: str
    hint: str = ""

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            return f"[pass] {self.exercise}: {self.detail}"
        return f"[not yet] {self.exercise}: {self.detail}\n  hint: {self.hint}"

    def show(self) -> Verdict:
        print(self)
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

    def __init__(self, detail: str, hint: str, *, stuck: list[int] | None = None):
        super().__init__(detail)
        self.detail = detail
        self.hint = hint
        self.stuck = stuck or []  # from on_ranks: the ranks a hang left waiting


@dataclasses.dataclass(frozen=True)
class Exercise:
    """One graded exercise: its id (the name ``solution`` takes), its notebook and its title."""

    id: str
    notebook: str
    title: str
    grader: str = ""  # the check's function name, which the notebook calls


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
        EXERCISES[id] = Exercise(id, notebook, title, grader.__name__)

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
        return Verdict(title, False, wrong.detail, wrong.hint)
    except Exception as exc:  # the learner's code, run in this process, may fail in any way
        if _raised_placeholder(exc):
            return Verdict(title, False, "not written yet (it still raises NotImplementedError)",
                           f"replace the `raise NotImplementedError(...)` line with your code; "
                           f"check.solution({id!r}) shows one answer")
        return Verdict(title, False, f"your code raised {type(exc).__name__}: "
                                     f"{_first_line(exc)}\n{_learner_traceback(exc)}",
                       "the traceback above is your code's: fix the line it ends on")
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


def _learner_traceback(exc: BaseException, limit: int = 8) -> str:
    """The traceback's frames outside labkit: where the learner's code failed."""
    here = str(Path(__file__).resolve().parent)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(here)]
    return "".join(traceback.format_list(frames[-limit:])).rstrip()


def written(value, what: str = "the answer"):
    """``value`` unless it is still the placeholder ``...``; then a :class:`NotYet`.

    For graders that take several values, some of which may not be filled in yet.
    """
    if _is_placeholder(value):
        raise NotYet(f"{what} is not written yet (still `...`)",
                     f"replace the `...` of {what} in the marked cell, and run it")
    return value


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
        text = failed.full_message or str(failed)
        if "NotImplementedError" in text and PLACEHOLDER in text:
            raise NotYet("not written yet (it still raises NotImplementedError)",
                         "replace the `raise NotImplementedError(...)` line with your "
                         "code") from None
        raise NotYet(f"rank {failed.rank} raised: {str(failed).strip()}",
                     "the traceback above is your code's, on that rank: fix the line it ends "
                     "on") from None


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
    print(f"all {len(ids)} exercises passed: {', '.join(ids)}")


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


def progress(show: bool = True) -> dict[str, list[str]]:
    """The exercises you have passed, notebook by notebook (kept in :func:`progress_file`).

    Returns ``{notebook: [passed exercise ids]}`` for every notebook with exercises.

    Example::

        >>> check.progress()
        00  2 of 3  [pass] first all-reduce, [pass] bus bandwidth, [    ] ring time
        ...
    """
    from . import exercises

    exercises.load_all()
    passes = _passes()
    by_notebook: dict[str, list[Exercise]] = {}
    for ex in EXERCISES.values():
        by_notebook.setdefault(ex.notebook, []).append(ex)
    done = {nb: [e.id for e in exs if e.id in passes] for nb, exs in sorted(by_notebook.items())}
    if show:
        total = sum(len(v) for v in by_notebook.values())
        print(f"{sum(len(v) for v in done.values())} of {total} exercises passed "
              f"(recorded in {progress_file()})")
        for nb, exs in sorted(by_notebook.items()):
            marks = ", ".join(f"[{'pass' if e.id in passes else '    '}] {e.title}" for e in exs)
            print(f"  {nb}  {len(done[nb])} of {len(exs)}  {marks}")
    return done


# ---- claims: noisy figures and predictions -----------------------------------------------------


def in_band(claim: str, measured: float, low: float = -math.inf, high: float = math.inf, *,
            cause: str, retry=None) -> Verdict:
    """A printed verdict for a noisy figure: inside the band ``[low, high]`` expected, or not.

    For what a short run or a busy machine moves (an accuracy after a few epochs, a gap between
    two runs, a time): it prints the expected band, the measured value and, outside the band, the
    likely ``cause``, and never raises, so the lesson goes on. ``retry``, a function that
    measures again, is called once when the first figure misses (a busy moment passes). Exact
    claims are ``assert``s.

    Example::

        >>> check.in_band("gap without augmentation", 0.48, 0.3, 1.0,
        ...               cause="too few epochs to memorise the training images")
        [as expected] gap without augmentation: measured 0.48, expected 0.3 to 1
    """
    if not low <= high:
        raise ValueError(f"in_band needs low <= high, got low={low!r}, high={high!r}: swap them, "
                         f"or leave one out for a one-sided band")
    if high == math.inf:
        band = f"at least {low:g}"
    elif low == -math.inf:
        band = f"at most {high:g}"
    else:
        band = f"{low:g} to {high:g}"
    measured = float(measured)
    inside = low <= measured <= high  # False for NaN too
    if not inside and retry is not None:
        print(f"[measuring again] {claim}: {measured:.3g} is outside {band}; once more, in case "
              f"the machine was busy")
        measured = float(retry())
        inside = low <= measured <= high
    verdict = Verdict(claim, inside, f"measured {measured:.3g}, expected {band}",
                      "" if inside else f"likely cause: {cause}")
    label = "as expected" if inside else "outside the expected band"
    print(f"[{label}] {claim}: {verdict.detail}" + ("" if inside else f"\n  {verdict.hint}"))
    return verdict


def prediction(what: str, predicted, measured: float, *, rel: float = 0.25, unit: str = "",
               why: str = "") -> Verdict | None:
    """Your prediction beside the measurement: within ``rel`` (25 %) of it, or how far off.

    ``predicted`` still ``...`` prints a reminder and returns None. ``why`` explains the usual
    reason a prediction misses (shown when it does). Never raises.

    Example::

        >>> check.prediction("speedup on 2 ranks", 1.9, 1.62, unit="x")
        [prediction] speedup on 2 ranks: you said 1.9x, measured 1.62x (17 % off: close)
    """
    measured = float(measured)
    if predicted is Ellipsis or predicted is None:
        print(f"[prediction] {what}: measured {_figure(measured)}{unit}. Write your prediction "
              f"first next time (the `...` in the cell above), then run the measurement")
        return None
    predicted = float(predicted)
    off = abs(predicted - measured) / max(abs(measured), 1e-12)
    close = off <= rel
    detail = (f"you said {_figure(predicted)}{unit}, measured {_figure(measured)}{unit} "
              f"({off:.0%} off: {'close' if close else 'not close'})")
    verdict = Verdict(what, close, detail, "" if close else why)
    print(f"[prediction] {what}: {detail}" + ("" if close or not why else f"\n  why: {why}"))
    return verdict


def _figure(x: float) -> str:
    """A figure as a learner writes it: 20,436 rather than 2.04e+04; 0.112 and 1.62 as they are."""
    return f"{x:,.0f}" if 1e3 <= abs(x) < 1e12 else f"{x:.3g}"

"""Notebook 10's planner grader: the reference solution passes, known wrong layouts get their hint.

The grader is arithmetic (labkit.planner.plan on each case): no ranks, milliseconds per check.
"""

from __future__ import annotations

from labkit.exercises.composition import planner as ex
from labkit.planner import Degrees

from .fakes import solution_namespace

STEM = "10_composing_parallelism"


def _solution(name: str):
    """The object the solution block of ``name`` defines, exec'd as the notebook would."""
    return solution_namespace(STEM, name)


def _answers(**by_devices):
    """A learner's function that answers each case (keyed by its device count) as given."""
    layouts = {int(k.removeprefix("n")): v for k, v in by_devices.items()}
    return lambda model, cluster: layouts[cluster.devices]


# Layouts that fit: one per case (8, 64 and 16 devices).
GOOD = {"n8": Degrees(dp=8, zero=1), "n64": Degrees(dp=8, tp=8, zero=1),
        "n16": Degrees(dp=1, tp=8, cp=2, zero=1)}


def test_fit_degrees_solution_passes():
    verdict = ex.fit_degrees(_solution("fit_degrees")["my_degrees"])
    assert verdict, verdict
    assert verdict.detail.startswith("all 3 cases fit")


def test_fit_degrees_accepts_dicts_and_the_registered_exercise():
    from labkit.check import EXERCISES

    as_dicts = {k: {"dp": d.dp, "tp": d.tp, "cp": d.cp, "zero": d.zero} for k, d in GOOD.items()}
    assert ex.fit_degrees(_answers(**as_dicts))
    assert EXERCISES["fit_degrees"].notebook == "10"
    assert EXERCISES["fit_degrees"].title == "degrees that fit a model on a cluster"
    assert [what for what, _, _ in ex.fit_cases()][0] == "a 7B model on 8 x 80 GiB"


def test_fit_degrees_wrong_product_of_degrees():
    verdict = ex.fit_degrees(_answers(**{**GOOD, "n8": Degrees(dp=4, zero=1)}))
    assert not verdict and "places dp*tp*pp*cp = 4 devices, not 8" in verdict.detail
    assert "product of the degrees must be the device count" in verdict.hint


def test_fit_degrees_wrong_tp_across_nodes():
    verdict = ex.fit_degrees(_answers(**{**GOOD, "n64": Degrees(dp=4, tp=16, zero=1)}))
    assert not verdict and "tp=16 spans 2 nodes" in verdict.detail
    assert "keep it inside a node" in verdict.hint


def test_fit_degrees_wrong_forgot_zero():
    verdict = ex.fit_degrees(_answers(**{**GOOD, "n8": Degrees(dp=8)}))
    assert not verdict and "GiB per device, 72.0 GiB usable" in verdict.detail
    assert "forgot ZeRO?" in verdict.hint and "biggest part is optimizer" in verdict.hint


def test_fit_degrees_wrong_pp_not_dividing_layers():
    verdict = ex.fit_degrees(_answers(**{**GOOD, "n16": Degrees(pp=16)}))
    assert not verdict and "refused by the planner" in verdict.detail
    assert "pp must divide the 40 layers" in verdict.hint


def test_fit_degrees_wrong_long_sequences_without_cp():
    verdict = ex.fit_degrees(_answers(**{**GOOD, "n16": Degrees(dp=2, tp=8, zero=3)}))
    assert not verdict and "long sequences" in verdict.hint
    assert "context parallelism (cp)" in verdict.hint and "activation checkpointing" in \
        verdict.hint


def test_fit_degrees_wrong_code_that_raises():
    def my_degrees(model, cluster):
        return Degrees(dp=cluster.devices // model.tensor_parallel)  # no such field

    verdict = ex.fit_degrees(my_degrees)
    assert not verdict and "your code raised AttributeError" in verdict.detail
    assert "fix the line it ends on" in verdict.hint


def test_fit_degrees_wrong_return_type():
    verdict = ex.fit_degrees(lambda model, cluster: (8, 1, 1))
    assert not verdict and "returned (8, 1, 1)" in verdict.detail
    assert "return Degrees(dp=..., tp=..., pp=..., zero=...)" in verdict.hint
    unknown = ex.fit_degrees(lambda model, cluster: {"dp": 8, "zer0": 1})
    assert not unknown and "unknown keys ['zer0']" in unknown.detail


def test_fit_degrees_placeholder_is_not_written_yet():
    def my_degrees(model, cluster):
        raise NotImplementedError("your code here")

    verdict = ex.fit_degrees(my_degrees)
    assert not verdict and "not written yet" in verdict.detail

"""Notebook 10's planner exercise: the memory of one layout by hand. The solution passes, a
valid answer written differently passes, known wrong answers get their hint, and an answer that
asks the planner (plan, suggest, its memory functions) is refused while it is graded.

The grader is arithmetic: no ranks, milliseconds per check.
"""

from __future__ import annotations

import dataclasses

from labkit import planner
from labkit.exercises.composition import planner as ex

from .fakes import solution_namespace

STEM = "10_composing_parallelism"


def _solution():
    return solution_namespace(STEM, "layout_memory")["my_memory"]


def _with(change):
    """The solution with one part's answer changed: ``change(part, value, model, degrees)``."""
    right = _solution()

    def answer(model, degrees):
        return {k: change(k, v, model, degrees) for k, v in right(model, degrees).items()}
    return answer


def test_layout_memory_solution_passes():
    verdict = ex.layout_memory(_solution())
    assert verdict, verdict
    assert verdict.detail.startswith("4 layouts, every part equal to the planner's")


def test_layout_memory_is_registered_for_notebook_10():
    from labkit.check import EXERCISES

    assert "layout_memory" in EXERCISES and "fit_degrees" not in EXERCISES
    assert ex.__all__ == ["memory_cases", "layout_memory"]


def test_layout_memory_valid_answer_written_differently_passes():
    def per_element(model, degrees):
        """Counted tensor by tensor, in bytes, with ZeRO as a table of dividers."""
        d = degrees
        share = model.params / d.tp / d.pp
        shard = {k: (d.dp * d.cp if d.zero >= z else 1)
                 for k, z in (("optimizer", 1), ("grads", 2), ("params", 3))}
        s, b, h = model.seq_len // d.cp, model.micro_batch, model.hidden
        kv = h * model.kv_heads // model.heads
        split_by = d.tp
        tensors_whole = [s * b * h] * 4               # ln1 in, qkv in, ln2 in, fc1 in
        tensors_split = [s * b * h, s * b * kv, s * b * kv, s * b * h,   # q, k, v, attention out
                         s * b * model.ffn, s * b * model.ffn]          # gelu in, fc2 in
        if d.sp and d.tp > 1:
            elements = (sum(tensors_whole) + sum(tensors_split)) / split_by
        else:
            elements = sum(tensors_whole) + sum(tensors_split) / split_by
        held = min(d.pp, d.m) if d.pp > 1 else 1
        return {"params": share * model.param_bytes / shard["params"],
                "grads": share * model.grad_bytes / shard["grads"],
                "optimizer": share * model.optimizer_bytes / shard["optimizer"],
                "activations": elements * model.act_bytes * held * model.layers / d.pp}

    verdict = ex.layout_memory(per_element)
    assert verdict, verdict


def test_layout_memory_answer_calling_plan_is_not_allowed():
    def asks_plan(model, degrees):
        p = planner.plan(model, planner.Cluster(devices=degrees.world, memory_gib=80), degrees)
        return {k: p.memory[k] for k in ex.PARTS}

    verdict = ex.layout_memory(asks_plan)
    assert not verdict and "planner.plan is not allowed here" in verdict.detail
    assert "switched off while your function is graded" in verdict.hint
    # and restored afterwards
    assert planner.plan.__name__ == "plan" and planner.plan.__module__.endswith("search")


def test_layout_memory_answer_importing_the_memory_functions_is_not_allowed():
    def imports(model, degrees):
        from labkit.planner.memory import model_state_bytes, stage_activation_bytes

        state = model_state_bytes(model, degrees)
        return {**state, "activations": stage_activation_bytes(model, degrees)}

    verdict = ex.layout_memory(imports)
    assert not verdict and "model_state_bytes is not allowed here" in verdict.detail
    from labkit.planner.memory import model_state_bytes
    assert model_state_bytes.__name__ == "model_state_bytes"


def test_layout_memory_answer_suggest_through_its_globals_is_not_allowed():
    namespace = {"suggest": planner.suggest, "planner": planner}
    exec("def my_memory(model, degrees):\n"
         "    return suggest(model, None)\n", namespace)
    verdict = ex.layout_memory(namespace["my_memory"])
    assert not verdict and "planner.suggest is not allowed here" in verdict.detail
    assert namespace["suggest"] is planner.suggest  # the learner's namespace is restored


def test_layout_memory_wrong_forgot_zero():
    def unsharded(part, value, model, d):
        return value * d.dp * d.cp if part == "optimizer" else value

    verdict = ex.layout_memory(_with(unsharded))
    assert not verdict and "optimizer" in verdict.detail
    assert "shards the optimizer (from stage 1) over the dp*cp = 8 ranks" in verdict.hint


def test_layout_memory_wrong_zero1_sharding_the_gradients_too():
    def sharded(part, value, model, d):
        return value / (d.dp * d.cp) if part == "grads" and d.zero < 2 else value

    verdict = ex.layout_memory(_with(sharded))
    assert not verdict and "does not shard the grads" in verdict.hint


def test_layout_memory_wrong_one_micro_batch_in_flight():
    def one(part, value, model, d):
        return value / min(d.pp, d.m) if part == "activations" and d.pp > 1 else value

    verdict = ex.layout_memory(_with(one))
    assert not verdict and "1B, dp=2 x pp=2" in verdict.detail
    assert "min(pp, m) = 2 micro-batches in flight" in verdict.hint


def test_layout_memory_wrong_sequence_parallelism_left_out():
    def no_sp(part, value, model, d):
        return value * d.tp if part == "activations" and d.tp > 1 else value

    verdict = ex.layout_memory(_with(no_sp))
    assert not verdict and "70B" in verdict.detail
    assert "sequence parallelism" in verdict.hint


def test_layout_memory_wrong_cp_not_dividing_the_tokens():
    def whole_sequence(part, value, model, d):
        return value * d.cp if part == "activations" and d.cp > 1 else value

    verdict = ex.layout_memory(_with(whole_sequence))
    assert not verdict and "13B" in verdict.detail and "seq_len/cp" in verdict.hint


def test_layout_memory_wrong_zero_over_dp_only():
    def over_dp(part, value, model, d):
        return value * d.cp if part == "params" and d.zero >= 3 else value

    verdict = ex.layout_memory(_with(over_dp))
    assert not verdict and "over the dp*cp = 2 ranks" in verdict.hint  # dp=1: cp is all there is


def test_layout_memory_wrong_shape_and_placeholder():
    verdict = ex.layout_memory(lambda model, degrees: 42)
    assert not verdict and "return a dict" in verdict.hint
    missing = ex.layout_memory(lambda model, degrees: {"params": 1})
    assert not missing and "activations" in missing.hint

    def my_memory(model, degrees):
        raise NotImplementedError("your code here")

    verdict = ex.layout_memory(my_memory)
    assert not verdict and "not written yet" in verdict.detail


def test_memory_cases_are_valid_layouts():
    for what, model, d in ex.memory_cases():
        cluster = planner.Cluster(devices=d.world, memory_gib=80)
        assert planner.plan(model, cluster, d).memory["total"] > 0, what
        assert dataclasses.replace(d).world == d.world

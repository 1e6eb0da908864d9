"""Notebook 03's graders: the reference solutions pass, known wrong answers get the right hint.

The schedule and the tensor-parallel graders run on 2 and 4 warm gloo ranks (one pool per rank
count for the whole file: each grading run after the first takes milliseconds).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labkit.exercises import model_parallel as mp
from labkit.parallel import pipeline, tensor

from .fakes import solution_namespace

STEM = "03_model_parallelism"


def _solution(name: str):
    """The object the solution block of ``name`` defines, exec'd as the notebook would."""
    return solution_namespace(STEM, name)


# ---- pipeline_1f1b_schedule -------------------------------------------------------------------
# Judged by what the order does in the simulator; each wrong answer below is tried alone on 2 and
# on 4 stages (``cases``), without the run on ranks (``runs=()``) that only a valid order reaches.

TWO_AND_FOUR = [(2, 4), (4, 8)]  # m > p on 2 and on 4 stages


def _judged(fn, stages, m):
    return mp.pipeline_1f1b_schedule(fn, cases=((stages, m),), runs=())


def _warmup(extra, cap=True):
    """1F1B whose warm-up is p - s - 1 + ``extra`` forwards (capped by m unless ``cap`` is off)."""
    def schedule(stages, m):
        out = []
        for s in range(stages):
            warmup = max(stages - s - 1 + extra, 0)
            warmup = min(warmup, m) if cap else warmup
            actions = [("F", i) for i in range(warmup)]
            for i in range(m - warmup):
                actions += [("F", warmup + i), ("B", i)]
            out.append(actions + [("B", i) for i in range(max(m - warmup, 0), m)])
        return out
    return schedule


def _reversed_micro_batches(stages, m):
    """Valid, written differently: 1F1B taking the micro-batches last first, on every stage."""
    return [[(kind, m - 1 - i) for kind, i in actions]
            for actions in pipeline.one_f_one_b_schedule(stages, m)]


def test_pipeline_1f1b_schedule_solution_passes_and_runs_on_ranks():
    verdict = mp.pipeline_1f1b_schedule(_solution("pipeline_1f1b_schedule")["my_1f1b"])
    assert verdict, verdict
    assert "the order of torch's Schedule1F1B for 9 (stages, m) pairs" in verdict.detail
    assert "on 2 ranks (m=4) its stages held [2, 1] micro-batches" in verdict.detail
    assert "on 4 ranks (m=6) its stages held [4, 3, 2, 1] micro-batches" in verdict.detail


def test_pipeline_1f1b_schedule_another_valid_order_passes_and_runs_on_ranks():
    verdict = mp.pipeline_1f1b_schedule(_reversed_micro_batches)
    assert verdict, verdict
    assert "a valid order (8 of them other than torch's Schedule1F1B)" in verdict.detail
    assert "held [4, 3, 2, 1] micro-batches" in verdict.detail


@pytest.mark.parametrize("stages, m", TWO_AND_FOUR + [(4, 2)])
def test_pipeline_1f1b_schedule_wrong_gpipe_has_the_bubble_but_holds_m(stages, m):
    verdict = _judged(pipeline.gpipe_schedule, stages, m)
    assert not verdict and f"bubble {stages - 1}/{m}" in verdict.detail
    assert f"stage {stages - 1} holds {m} micro-batches' activations at once, 1F1B 1" in \
        verdict.detail
    assert "that is GPipe" in verdict.hint


@pytest.mark.parametrize("stages, m", TWO_AND_FOUR)
def test_pipeline_1f1b_schedule_wrong_warmup_one_too_many(stages, m):
    verdict = _judged(_warmup(+1), stages, m)
    assert not verdict and "holds" in verdict.detail and "as it should be" in verdict.detail
    assert "warm-up too long" in verdict.hint


@pytest.mark.parametrize("stages, m", TWO_AND_FOUR)
def test_pipeline_1f1b_schedule_wrong_warmup_one_too_few(stages, m):
    verdict = _judged(_warmup(-1), stages, m)
    assert not verdict and "simulated bubble is" in verdict.detail
    assert f"(p-1)/m = {stages - 1}/{m}" in verdict.detail
    assert "warm-up too short" in verdict.hint


def test_pipeline_1f1b_schedule_wrong_warmup_not_capped_by_m():
    verdict = _judged(_warmup(0, cap=False), 4, 2)
    assert not verdict and "min(p-s-1, m)" in verdict.hint and "m=2" in verdict.hint


def test_pipeline_1f1b_schedule_wrong_backwards_newest_first():
    def newest_first(stages, m):
        out = []
        for actions in pipeline.one_f_one_b_schedule(stages, m):
            backs = iter(sorted((i for k, i in actions if k == "B"), reverse=True))
            out.append([(k, next(backs)) if k == "B" else (k, i) for k, i in actions])
        return out

    verdict = mp.pipeline_1f1b_schedule(newest_first)
    assert not verdict and "oldest first" in verdict.hint


@pytest.mark.parametrize("stages, m", TWO_AND_FOUR)
def test_pipeline_1f1b_schedule_wrong_deadlock(stages, m):
    def later_stages_warm_up_more(stages, m):  # stage s warms up with s forwards: a deadlock
        return pipeline.one_f_one_b_schedule(stages, m)[::-1]

    verdict = _judged(later_stages_warm_up_more, stages, m)
    assert not verdict and "deadlocks" in verdict.detail and "p-s-1" in verdict.hint


@pytest.mark.parametrize("stages, m", TWO_AND_FOUR)
def test_pipeline_1f1b_schedule_wrong_neighbours_in_another_order(stages, m):
    def last_stage_swaps(stages, m):  # the last stage takes micro-batches 1 and 0 the other way
        out = pipeline.one_f_one_b_schedule(stages, m)
        out[-1] = [(k, {0: 1, 1: 0}.get(i, i)) for k, i in out[-1]]
        return out

    verdict = _judged(last_stage_swaps, stages, m)
    assert not verdict and "messages are matched in order" in verdict.detail
    assert "one micro-batch order on every stage" in verdict.hint


def test_pipeline_1f1b_schedule_wrong_shape():
    verdict = mp.pipeline_1f1b_schedule(lambda stages, m: pipeline.one_f_one_b_schedule(2, m))
    assert not verdict and "one per stage" in verdict.hint


# ---- tp_f_and_g -----------------------------------------------------------------------------

def _functions(f_forward, f_backward, g_forward, g_backward):
    """An (f, g) pair of autograd Functions from four plain functions."""
    f = type("F", (torch.autograd.Function,), {"forward": staticmethod(f_forward),
                                               "backward": staticmethod(f_backward)})
    g = type("G", (torch.autograd.Function,), {"forward": staticmethod(g_forward),
                                               "backward": staticmethod(g_backward)})
    return f, g


def _summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _identity(ctx, t):
    return t.view_as(t)


def _all_reduce(ctx, t):
    return _summed(t)


def _averaged(ctx, t):
    return _summed(t) / dist.get_world_size()


def test_tp_f_and_g_solution_passes():
    ns = _solution("tp_f_and_g")
    verdict = mp.tp_f_and_g(ns["MyCopyToTP"], ns["MyReduceFromTP"])
    assert verdict, verdict
    assert "1 all-reduce forward (of the output), 1 backward" in verdict.detail


def test_tp_f_and_g_wrong_copy_backward_not_all_reduced():
    verdict = mp.tp_f_and_g(*_functions(_identity, _identity, _all_reduce, _identity))
    assert not verdict and "the backward of the copy (f) must all-reduce" in verdict.hint
    assert "its own gradient unchanged" in verdict.detail


def test_tp_f_and_g_wrong_reduce_forward_is_the_identity():
    verdict = mp.tp_f_and_g(*_functions(_identity, _all_reduce, _identity, _identity))
    assert not verdict and "g's forward must all-reduce" in verdict.hint
    assert "partial output unchanged" in verdict.detail


def test_tp_f_and_g_wrong_reduce_forward_averages():
    verdict = mp.tp_f_and_g(*_functions(_identity, _all_reduce, _averaged, _identity))
    assert not verdict and "the average" in verdict.detail and "no division" in verdict.hint


def test_tp_f_and_g_wrong_reduce_backward_all_reduces_too():
    verdict = mp.tp_f_and_g(*_functions(_identity, _all_reduce, _all_reduce, _all_reduce))
    assert not verdict and "pass the gradient through unchanged" in verdict.hint


def test_tp_f_and_g_wrong_copy_forward_all_reduces():
    verdict = mp.tp_f_and_g(*_functions(_all_reduce, _all_reduce, _all_reduce, _identity))
    assert not verdict and "f's forward must return x unchanged" in verdict.hint


def _gathered_sum(ctx, t):
    """The sum over the ranks by gathering every rank's tensor: right values, another route."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.stack(parts).sum(0)


def test_tp_f_and_g_wrong_route_gathered_with_right_values():
    verdict = mp.tp_f_and_g(*_functions(_identity, _all_reduce, _gathered_sum, _identity))
    assert not verdict and "right numbers, but the MLP's collectives were" in verdict.detail
    assert "'all_gather': 1" in verdict.detail and "once each way" in verdict.hint


def _async_sum(ctx, t):
    """Valid, written another way: an asynchronous all-reduce of a detached copy, waited on."""
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, async_op=True).wait()
    return out


def _sum_in_float64(ctx, t):
    """The right sum, but all-reduced as a float64 copy: twice the tensor's bytes on the wire."""
    out = t.double()
    dist.all_reduce(out)
    return out.to(t.dtype)


def test_tp_f_and_g_wrong_route_converted_copy_carries_twice_the_bytes():
    verdict = mp.tp_f_and_g(*_functions(_identity, _all_reduce, _sum_in_float64, _identity))
    assert not verdict and "the forward all-reduce carried [256] bytes; the output is [128]" in \
        verdict.detail and "in its own dtype" in verdict.hint


def test_tp_f_and_g_written_another_way_passes_on_2_and_4_ranks():
    verdict = mp.tp_f_and_g(*_functions(lambda ctx, t: t.clone(), _async_sum, _async_sum,
                                        lambda ctx, g: g.clone()))
    assert verdict and "on 2 and 4 gloo ranks" in verdict.detail


def test_tp_f_and_g_wrong_not_written_yet_is_seen_without_running():
    class Untouched(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            raise NotImplementedError("your code here")

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("your code here")

    verdict = mp.tp_f_and_g(Untouched, Untouched)
    assert not verdict and "not written yet" in verdict.detail
    verdict = mp.tp_f_and_g(tensor.copy_to_tp, tensor.reduce_from_tp)  # functions, not classes
    assert not verdict and "not a torch.autograd.Function subclass" in verdict.detail


# ---- zero_bytes_per_rank --------------------------------------------------------------------

def _zero(shards, nbytes=None):
    """A bytes-per-rank function sharding each key from the stage in ``shards``."""
    def fn(n, world, stage, pb, gb, ob):
        sizes = nbytes or {"params": pb, "grads": gb, "optimizer": ob}
        return {k: n * sizes[k] / (world if stage >= shards[k] else 1) for k in sizes}
    return fn


def test_zero_bytes_per_rank_solution_passes():
    verdict = mp.zero_bytes_per_rank(_solution("zero_bytes_per_rank")["my_zero_bytes"])
    assert verdict, verdict


def test_zero_bytes_per_rank_written_as_a_table_passes():
    """The stages as a table of which parts are sharded, integer division where it divides."""
    def zero_bytes(n_params, world_size, stage, param_bytes=2, grad_bytes=2, optimizer_bytes=12):
        sharded = {0: (), 1: ("optimizer",), 2: ("optimizer", "grads"),
                   3: ("optimizer", "grads", "params")}[stage]
        sizes = {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}
        return {part: n_params * size / (world_size if part in sharded else 1)
                for part, size in sizes.items()}

    assert mp.zero_bytes_per_rank(zero_bytes)


def test_zero_bytes_per_rank_wrong_optimizer_not_sharded():
    verdict = mp.zero_bytes_per_rank(_zero({"optimizer": 9, "grads": 2, "params": 3}))
    assert not verdict and "optimizer state not sharded" in verdict.hint


def test_zero_bytes_per_rank_wrong_grads_sharded_at_zero1():
    verdict = mp.zero_bytes_per_rank(_zero({"optimizer": 1, "grads": 1, "params": 3}))
    assert not verdict and "ZeRO-1 keeps the grads whole" in verdict.hint


def test_zero_bytes_per_rank_wrong_params_not_sharded_at_zero3():
    verdict = mp.zero_bytes_per_rank(_zero({"optimizer": 1, "grads": 2, "params": 9}))
    assert not verdict and "parameters not sharded: ZeRO-3" in verdict.hint


def test_zero_bytes_per_rank_wrong_fixed_byte_sizes():
    fixed = _zero({"optimizer": 1, "grads": 2, "params": 3},
                  nbytes={"params": 2, "grads": 2, "optimizer": 12})
    verdict = mp.zero_bytes_per_rank(fixed)
    assert not verdict and "use the byte sizes passed in" in verdict.hint


def test_zero_bytes_per_rank_wrong_return_type():
    verdict = mp.zero_bytes_per_rank(lambda n, world, stage, pb, gb, ob: n * (pb + gb + ob))
    assert not verdict and "'params', 'grads' and 'optimizer'" in verdict.hint


# ---- bad input, refused with what to do instead (the notebook's section 5 used to show these) -

@pytest.mark.parametrize("call, match", [
    (lambda: pipeline.micro_batches(torch.zeros(64, 2), 3),
     r"a batch of 64 does not split into 3 micro-batches: use m in \(1, 2, 4, 8, \.\.\.\)"),
    (lambda: pipeline.split_stages(torch.nn.Sequential(*[torch.nn.Linear(2, 2)] * 4), 5),
     r"more pipeline stages \(5\) than layers \(4\)"),
    (lambda: tensor.check_split(1000, 3, "hidden size"),
     r"hidden size 1000 does not split over 3 ranks: use a multiple of 3 \(e.g. 999 or 1002\)"),
])
def test_model_parallel_bad_input_is_refused_with_what_to_do(call, match):
    with pytest.raises(ValueError, match=match):
        call()

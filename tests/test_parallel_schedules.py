"""labkit.parallel.schedules: interleaved 1F1B and zero bubble as data, simulated, run on gloo."""

from __future__ import annotations

import sys
from fractions import Fraction

import cloudpickle
import pytest

from labkit import launch
from labkit.parallel import pipeline
from labkit.parallel.schedules import (
    SCHEDULE_NAMES,
    bubble_of,
    check_chunked_schedule,
    check_message_order,
    interleaved_1f1b,
    interleaved_bubble,
    interleaved_bubble_fraction,
    make_schedule,
    messages,
    peak_in_flight,
    pipelined_step,
    schedule_timeline,
    simulate_chunked,
    zero_bubble,
    zero_bubble_formula,
)

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ONE = Fraction(1)
TOL = 1e-5  # float32: micro-batch gradients are summed in another order than one batch's


def _text(actions) -> str:
    return " ".join(f"{k}{c}.{i}" for k, c, i in actions)


# ---- the schedules ------------------------------------------------------------------------------


def test_interleaved_p2_v2_m4_exact():
    got = [_text(actions) for actions in interleaved_1f1b(2, 2, 4)]
    # rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards, rank 1 with 2.
    assert got == ["F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 "
                   "B1.2 B1.3 B0.2 B0.3",
                   "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 "
                   "F1.3 B1.3 B0.2 B0.3"]


def test_interleaved_warmup_follows_megatrons_rule():
    for p, v, m in [(4, 2, 8), (4, 3, 8), (3, 2, 9), (8, 2, 16)]:
        for rank, actions in enumerate(interleaved_1f1b(p, v, m)):
            lead = next(k for k, a in enumerate(actions) if a[0] == "B")
            assert lead == min((p - rank - 1) * 2 + (v - 1) * p, m * v) + 1


def test_interleaved_with_m_equal_to_p_caps_the_warmup_at_every_forward():
    schedule = interleaved_1f1b(2, 2, 2)
    assert _text(schedule[0]) == "F0.0 F0.1 F1.0 F1.1 B1.0 B1.1 B0.0 B0.1"


def test_zero_bubble_p2_m3_exact():
    assert [_text(a) for a in zero_bubble(2, 3)] == [
        "F0.0 F0.1 B0.0 W0.0 F0.2 B0.1 W0.1 B0.2 W0.2",
        "F0.0 B0.0 F0.1 B0.1 W0.0 F0.2 B0.2 W0.1 W0.2"]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("v", [1, 2, 3, 4])
def test_schedules_are_valid_for_many_sizes(p, v):
    for m in (p, 2 * p, 3 * p):
        for schedule in (interleaved_1f1b(p, v, m), zero_bubble(p, m, v)):
            actions = check_chunked_schedule(schedule, p, m, v)  # every action once, no deadlock
            kinds = {k for row in actions for k, _, _ in row}
            assert all(len(row) == len(kinds) * v * m for row in actions)
        check_message_order(interleaved_1f1b(p, v, m), p, v)
    for m in (1, 2, 7):  # zero bubble with one chunk: any m, like 1F1B
        check_chunked_schedule(zero_bubble(p, m), p, m)


def test_make_schedule_names_the_four():
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "interleaved 1f1b", "zero bubble")
    assert make_schedule("1f1b", 3, 4) == pipeline.one_f_one_b_schedule(3, 4)
    assert make_schedule("gpipe", 2, 2) == pipeline.gpipe_schedule(2, 2)
    assert make_schedule("interleaved 1f1b", 2, 4, 2) == interleaved_1f1b(2, 2, 4)
    assert make_schedule("zero bubble", 4, 8, 2) == zero_bubble(4, 8, 2)


# ---- the bubble: simulated and the formulas -----------------------------------------------------


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (4, 2, 4), (4, 3, 8),
                                     (3, 2, 6), (8, 2, 16), (4, 4, 16), (2, 1, 4), (4, 1, 8)])
def test_interleaved_simulated_bubble_equals_the_formula_exactly(p, v, m):
    for f, b, w in [(ONE, ONE, 0 * ONE), (ONE, ONE, ONE), (2 * ONE, ONE, ONE)]:
        out = simulate_chunked(interleaved_1f1b(p, v, m), p, m, v, f, b, w)
        assert out["idle_per_compute"] == Fraction(p - 1, v * m) == Fraction(
            interleaved_bubble(p, v, m)).limit_denominator(1000)
        assert out["bubble"] == Fraction(p - 1, v * m + p - 1)
    assert abs(interleaved_bubble_fraction(p, v, m) - (p - 1) / (v * m + p - 1)) < 1e-15


def test_interleaved_fraction_for_one_chunk_is_notebook_03s_formula():
    for p, m in [(2, 4), (4, 8), (3, 9)]:
        assert interleaved_bubble_fraction(p, 1, m) == pipeline.bubble_formula(p, m)
        assert interleaved_bubble(p, 1, m) == (p - 1) / m
        for name in ("gpipe", "1f1b"):
            out = simulate_chunked(make_schedule(name, p, m), p, m, f=ONE, b=ONE, w=ONE)
            assert out["bubble"] == Fraction(p - 1, m + p - 1)


@pytest.mark.parametrize("p, m, v", [(2, 4, 1), (4, 8, 1), (4, 4, 1), (3, 7, 1), (8, 16, 1),
                                     (2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_zero_bubble_simulated_bubble_is_a_third_of_1f1bs_when_f_b_w_are_equal(p, m, v):
    out = simulate_chunked(zero_bubble(p, m, v), p, m, v, ONE, ONE, ONE)
    assert out["idle_per_compute"] == Fraction(p - 1, 3 * v * m)
    assert zero_bubble_formula(p, m, v) == pytest.approx((p - 1) / (3 * v * m), abs=1e-15)
    one_f_one_b = simulate_chunked(interleaved_1f1b(p, v, m) if v > 1 else
                           pipeline.one_f_one_b_schedule(p, m), p, m, v, ONE, ONE, ONE)
    assert out["idle_per_compute"] * 3 == one_f_one_b["idle_per_compute"]


def test_zero_bubble_formula_with_w_cheaper_than_f_and_b():
    for p, m, v in [(2, 4, 1), (4, 8, 1), (4, 6, 1), (5, 10, 1), (2, 4, 2), (4, 8, 2)]:
        for f, b, w in [(2, 1, 1), (1, 2, 1), (2, 2, 1), (Fraction(3, 2), 2, Fraction(1, 2))]:
            got = simulate_chunked(zero_bubble(p, m, v), p, m, v, f * ONE, b * ONE, w * ONE)
            assert got["idle_per_compute"] == (Fraction(p - 1) * (f + b - w)
                                               / (v * m * (f + b + w)))
            assert zero_bubble_formula(p, m, v, f, b, w) == pytest.approx(
                float(got["idle_per_compute"]))


def test_zero_bubble_formula_refuses_where_it_does_not_hold():
    with pytest.raises(ValueError, match=r"holds for m >= stages and w <= min\(f, b\).*simulate"):
        zero_bubble_formula(4, 2)
    with pytest.raises(ValueError, match=r"w <= min\(f, b\)"):
        zero_bubble_formula(4, 8, f=1, b=1, w=2)


def test_bubble_of_both_forms():
    events = [{"rank": 0, "start": 0, "end": 1}, {"rank": 1, "start": 1, "end": 2}]
    assert bubble_of(events) == {"bubble": 0.5, "idle_per_compute": 1.0, "span": 2}
    two_steps = [{**e, "step": s} for s in (0, 1) for e in events]
    assert bubble_of(two_steps)["bubble"] == 0.5
    with pytest.raises(ValueError, match="no events"):
        bubble_of([])


def test_memory_held_and_messages():
    p, m = 4, 8
    assert peak_in_flight(pipeline.one_f_one_b_schedule(p, m), p, m) == [4.0, 3.0, 2.0, 1.0]
    assert peak_in_flight(pipeline.gpipe_schedule(p, m), p, m) == [8.0] * 4
    # Interleaving: rank r holds its warm-up + 1 chunks, each 1/v of a stage.
    assert peak_in_flight(interleaved_1f1b(p, 2, m), p, m, 2) == [
        ((p - r - 1) * 2 + p + 1) / 2 for r in range(p)]
    # ZB-H1: W's deferred hold activations longer, but never more than 1F1B's rank 0.
    assert peak_in_flight(zero_bubble(p, m), p, m) == [4.0] * 4
    assert messages(p, m) == 2 * m * (p - 1) and messages(p, m, 2) == 2 * m * (2 * p - 1)
    for v in (1, 2, 3):  # the count is what the schedule sends: one per F or B at a boundary
        sends = sum(1 for r, row in enumerate(interleaved_1f1b(p, v, m)) for k, c, _ in row
                    if (k == "F" and c * p + r < p * v - 1) or (k == "B" and c * p + r > 0))
        assert sends == messages(p, m, v)


def test_schedule_timeline_gives_events_bubble_and_formula():
    for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved 1f1b", 2), ("zero bubble", 1),
                    ("zero bubble", 2)]:
        t = schedule_timeline(name, 4, 8, chunks=v)
        assert t["bubble"] == pytest.approx(t["formula"], abs=1e-12), name
        assert t["idle_per_compute"] == pytest.approx(t["formula_per_compute"], abs=1e-12)
        assert {"rank", "kind", "chunk", "stage", "micro", "start", "end"} <= set(t["events"][0])
        assert len(t["events"]) == sum(len(row) for row in t["schedule"])
    assert schedule_timeline("zero bubble", 4, 2)["formula"] is None  # m < p: no closed form


# ---- errors -------------------------------------------------------------------------------------


def test_interleaved_needs_m_a_multiple_of_p():
    with pytest.raises(ValueError, match=r"^interleaved 1F1B runs the micro-batches in groups of "
                                         r"stages=4: m=6 is not a multiple of 4; use m = 4 or 8$"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match=r"m=3 is not a multiple of 4; use m = 4$"):
        interleaved_1f1b(4, 2, 3)
    with pytest.raises(ValueError, match="interleaved zero bubble .* not a multiple of 2"):
        zero_bubble(2, 3, chunks=2)


@pytest.mark.parametrize("args, match", [((0, 2, 4), r"^stages must be a whole number >= 1"),
                                         ((2, 0, 4), r"^chunks must be a whole number >= 1"),
                                         ((2, 2, 0), r"^m must be a whole number >= 1"),
                                         ((2, 1.5, 4), r"chunks must be a whole number")])
def test_sizes_must_be_whole_numbers(args, match):
    with pytest.raises(ValueError, match=match):
        interleaved_1f1b(*args)


def test_unknown_schedule_and_chunks_where_there_are_none():
    with pytest.raises(ValueError, match=r"^unknown schedule 'dualpipe': use one of gpipe, 1f1b, "
                                         r"interleaved 1f1b, zero bubble$"):
        make_schedule("dualpipe", 2, 4)
    with pytest.raises(ValueError, match=r"^gpipe runs one model chunk per rank: use chunks=1"):
        schedule_timeline("gpipe", 2, 4, chunks=2)
    with pytest.raises(ValueError, match="unknown schedule 'gpipe' for torch.distributed"):
        pipelined_step("gpipe", 1, 4, (None, None), None)
    with pytest.raises(ValueError, match="Schedule1F1B holds one stage per rank"):
        pipelined_step("1f1b", 2, 4, (None, None), None)
    with pytest.raises(ValueError, match="exactly two stages per rank"):
        pipelined_step("zbv", 3, 4, (None, None), None)


@pytest.mark.parametrize("schedule, match", [
    ([[("F", 0, 0), ("B", 0, 0)]], r"one list of actions per rank: 2 lists, got 1 lists"),
    ([[("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]], r"rank 0 must run each of F/B once .* "
                                                  r"missing \[\('B', 0, 0\)\]"),
    ([[("F", 0, 0), ("F", 0, 0), ("B", 0, 0)], [("F", 0, 0), ("B", 0, 0)]],
     r"extra or repeated \[\('F', 0, 0\)\]"),
    ([[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]], r"rank 0 runs \('B', 0, 0\) before"),
    ([[("F", 0, 0), ("B", 0, 0), ("W", 0, 0)], [("F", 0, 0), ("W", 0, 0), ("B", 0, 0)]],
     r"rank 1 runs \('W', 0, 0\) before \('B', 0, 0\)"),
    ([[("X", 0, 0), ("B", 0, 0)], [("F", 0, 0), ("B", 0, 0)]], r"rank 0 has the action"),
])
def test_check_schedule_refuses(schedule, match):
    with pytest.raises(ValueError, match=match):
        check_chunked_schedule(schedule, 2, 1)


def test_check_schedule_finds_a_deadlock_and_says_who_waits():
    deadlock = [[("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
                [("F", 0, 1), ("F", 0, 0), ("B", 0, 0), ("B", 0, 1)]]  # F1 first: both wait
    with pytest.raises(ValueError, match=r"deadlocks.*0: 'B0.0 needs B of virtual stage 1 for "
                                         r"micro-batch 0', 1: 'F0.1 needs F of virtual stage 0 "
                                         r"for micro-batch 1'"):
        check_chunked_schedule(deadlock, 2, 2)


def test_message_order_mismatch_is_named():
    swapped = pipeline.gpipe_schedule(2, 2)
    swapped[1] = [("F", 1), ("F", 0), ("B", 0), ("B", 1)]
    check_chunked_schedule(swapped, 2, 2)  # it runs when simulated (messages found by micro-batch)
    with pytest.raises(ValueError, match=r"rank 0 sends to rank 1 in the order \[activation 0.0, "
                                         r"activation 0.1\] but rank 1 receives"):
        check_message_order(swapped, 2)


def test_simulate_refuses_negative_costs():
    with pytest.raises(ValueError, match=r"w is a time: use a number >= 0"):
        simulate_chunked(zero_bubble(2, 2), 2, 2, w=-1)


# ---- real ranks: torch.distributed.pipelining and run_schedule ----------------------------------


def schedules_on_ranks(m: int, chunks: int, runs, width: int = 16) -> dict:
    """On every rank: the torch schedules ``runs`` and run_schedule beside the unpipelined step."""
    import functools
    import time

    import torch.distributed as dist

    from labkit.parallel import pipeline, schedules

    p, rank = dist.get_world_size(), dist.get_rank()
    # depth p * chunks: every one of the p * chunks stages gets a layer with parameters
    build = pipeline.stage_builder(functools.partial(pipeline.mlp_stack, width, p * chunks, 8, 4))
    batch = pipeline.example_batch(4 * m, inputs=8, classes=4)
    refs = {v: pipeline.reference_step(build, p * v, batch) for v in {1, chunks, 2}}
    out = {"seconds": {}}
    for name, v in runs:
        start = time.perf_counter()
        step = schedules.pipelined_step(name, v, m, batch, build, steps=1, warmup=0)
        ours = (schedules.check_chunked_schedule(schedules.make_schedule(name, p, m, v), p, m,
                                                 v)[rank] if name != "zbv" else None)
        out[name, v] = {
            "grad_diff": max((g - refs[v]["grads"][k]).abs().max().item()
                             for g, k in zip(step["grads"], step["stages"], strict=True)),
            "loss_diff": abs(step["loss"] - refs[v]["loss"]), "same_order": step["order"] == ours,
            "kinds": sorted({e["kind"] for e in step["events"]}), "stages": step["stages"],
            "measured": step["measured"], "simulated": step["simulated"],
            "step_s": step["step_s"]}
        out["seconds"][name, v] = time.perf_counter() - start
    played = schedules.run_schedule(build, schedules.interleaved_1f1b(p, chunks, m), m, batch,
                                    chunks)
    out["run_schedule"] = {
        "grad_diff": max((g - refs[chunks]["grads"][k]).abs().max().item()
                         for g, k in zip(played["grads"], played["stages"], strict=True)),
        "loss_diff": abs(played["loss"] - refs[chunks]["loss"])}
    errors = {}
    for key, call in [
            ("odd_m", lambda: schedules.pipelined_step("interleaved 1f1b", 2, p + 1, batch,
                                                       build)),
            ("w", lambda: schedules.run_schedule(build, schedules.zero_bubble(p, m), m, batch))]:
        try:
            call()
        except ValueError as err:
            errors[key] = str(err)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def two_ranks():
    runs = [("1f1b", 1), ("interleaved 1f1b", 2), ("zero bubble", 1), ("zero bubble", 2),
            ("zbv", 2)]
    return launch(schedules_on_ranks, 4, 2, runs, nproc=2, show_ranks=[], timeout=240,
                  warm=True).values


def test_torch_schedules_equal_the_unpipelined_step_on_2_ranks(two_ranks):
    for rank, out in enumerate(two_ranks):
        for key in [("1f1b", 1), ("interleaved 1f1b", 2), ("zero bubble", 1),
                    ("zero bubble", 2), ("zbv", 2), "run_schedule"]:
            assert out[key]["grad_diff"] < TOL, (rank, key, out[key])
            assert out[key]["loss_diff"] < TOL, (rank, key, out[key])
    assert two_ranks[0]["interleaved 1f1b", 2]["stages"] == [0, 2]  # rank r: r, r + p
    assert two_ranks[0]["zbv", 2]["stages"] == [0, 3]  # the V: r and 2p - 1 - r


def test_torch_runs_the_orders_written_here(two_ranks):
    for out in two_ranks:
        for key in [("1f1b", 1), ("interleaved 1f1b", 2), ("zero bubble", 1), ("zero bubble", 2)]:
            assert out[key]["same_order"], key
        assert out["zero bubble", 1]["kinds"] == ["B", "F", "W"]  # the backward is split
        assert out["1f1b", 1]["kinds"] == ["B", "F"]


def test_measured_bubble_is_at_least_the_simulated_one(two_ranks):
    # Timing is noisy; the one exact claim: measured events include waiting for messages, so
    # idle can only add to what the schedule itself leaves (up to clock jitter).
    for key in [("1f1b", 1), ("interleaved 1f1b", 2), ("zero bubble", 1)]:
        out = two_ranks[0][key]
        assert 0 < out["measured"]["bubble"] < 1 and 0 <= out["simulated"]["bubble"] < 1
        assert out["measured"]["span"] > 0 and out["step_s"] > 0


def test_errors_on_ranks(two_ranks):
    errors = two_ranks[0]["errors"]
    assert "m=3 is not a multiple of 2" in errors["odd_m"]
    assert "run zero-bubble schedules with pipelined_step" in errors["w"]


def test_four_ranks():
    runs = [("interleaved 1f1b", 2), ("zero bubble", 2)]
    values = launch(schedules_on_ranks, 8, 2, runs, nproc=4, show_ranks=[], timeout=300,
                    warm=True).values
    for rank, out in enumerate(values):
        for key, result in out.items():
            if key not in ("errors", "seconds"):
                assert result["grad_diff"] < TOL and result["loss_diff"] < TOL, (rank, key)
        for key in runs:
            assert out[key]["same_order"], (rank, key)

"""labkit.parallel.pipeline: schedules as data, the bubble, and a real 2-stage pipeline (gloo)."""

from __future__ import annotations

import sys
from functools import partial

import cloudpickle
import pytest
import torch
from torch import nn

from labkit import launch
from labkit.parallel.pipeline import (
    SCHEDULES,
    bubble_breakdown,
    bubble_formula,
    check_schedule,
    example_batch,
    gpipe_schedule,
    measured_bubble,
    micro_batches,
    mlp_stack,
    naive_schedule,
    one_f_one_b_schedule,
    pipelining_step,
    reference_step,
    run_pipeline,
    simulate,
    split_stages,
    stage_builder,
)

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

F, B = "F", "B"


def _actions(text: str) -> list[tuple[str, int]]:
    """'F0 F1 B0' -> [('F', 0), ('F', 1), ('B', 0)]: schedules as people write them."""
    return [(a[0], int(a[1:])) for a in text.split()]


# ---- schedules -----------------------------------------------------------------------------------


def test_gpipe_p2_m3_exact():
    assert gpipe_schedule(2, 3) == [_actions("F0 F1 F2 B0 B1 B2")] * 2


def test_gpipe_p3_m4_exact():
    assert gpipe_schedule(3, 4) == [_actions("F0 F1 F2 F3 B0 B1 B2 B3")] * 3


def test_one_f_one_b_p2_m3_exact():
    assert one_f_one_b_schedule(2, 3) == [
        _actions("F0 F1 B0 F2 B1 B2"),
        _actions("F0 B0 F1 B1 F2 B2"),
    ]


def test_one_f_one_b_p3_m4_exact():
    assert one_f_one_b_schedule(3, 4) == [
        _actions("F0 F1 F2 B0 F3 B1 B2 B3"),
        _actions("F0 F1 B0 F2 B1 F3 B2 B3"),
        _actions("F0 B0 F1 B1 F2 B2 F3 B3"),
    ]


def test_one_f_one_b_with_fewer_micro_batches_than_stages():
    assert one_f_one_b_schedule(4, 2)[0] == _actions("F0 F1 B0 B1")
    assert one_f_one_b_schedule(4, 2)[3] == _actions("F0 B0 F1 B1")


def test_naive_is_gpipe_with_one_micro_batch():
    assert naive_schedule(3) == gpipe_schedule(3, 1) == [_actions("F0 B0")] * 3
    assert SCHEDULES["naive"](2, 1) == naive_schedule(2)


def _in_flight(actions) -> int:
    """The most micro-batches a stage holds activations for at once (forwarded, not backwarded)."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == F else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 3), (3, 4), (4, 8), (4, 2), (5, 16)])
def test_every_stage_runs_each_forward_and_backward_once(p, m):
    for name in ("gpipe", "1f1b"):
        schedule = SCHEDULES[name](p, m)
        assert len(schedule) == p
        for actions in schedule:
            assert sorted(actions) == sorted([(F, i) for i in range(m)]
                                             + [(B, i) for i in range(m)])
            assert all(actions.index((B, i)) > actions.index((F, i)) for i in range(m))
        check_schedule(schedule, m)  # the same, as the library checks it


@pytest.mark.parametrize("p, m", [(2, 3), (3, 4), (4, 8), (4, 2), (5, 16)])
def test_one_f_one_b_holds_at_most_p_minus_stage_micro_batches(p, m):
    for stage, actions in enumerate(one_f_one_b_schedule(p, m)):
        assert _in_flight(actions) == min(p - stage, m)
    assert all(_in_flight(actions) == m for actions in gpipe_schedule(p, m))  # GPipe holds all


@pytest.mark.parametrize("p, m", [(0, 4), (2, 0), (2, 1.5)])
def test_schedules_refuse_bad_sizes(p, m):
    for make in (gpipe_schedule, one_f_one_b_schedule):
        with pytest.raises(ValueError, match=r"(stages|m) must be a whole number >= 1"):
            make(p, m)


@pytest.mark.parametrize("schedule, match", [
    ([_actions("F0 B0 F1")], r"stage 0 must run .* missing \[\('B', 1\)\]"),
    ([_actions("F0 F0 B0 B1")], r"missing \[\('F', 1\)\], extra or repeated \[\('F', 0\)\]"),
    ([_actions("F0 F1 B0 B1"), _actions("F0 B1 F1 B0 ")], r"stage 1 runs \('B', 1\) before"),
])
def test_check_schedule_says_what_is_wrong(schedule, match):
    with pytest.raises(ValueError, match=match):
        check_schedule(schedule, 2)


# ---- the bubble ---------------------------------------------------------------------------------


def test_bubble_formula_values():
    assert bubble_formula(1, 4) == 0.0  # one stage: nothing to fill
    assert bubble_formula(2, 1) == 0.5  # naive: each of 2 ranks idles half the time
    assert bubble_formula(2, 4) == pytest.approx(1 / 5)
    assert bubble_formula(2, 8) == pytest.approx(1 / 9)
    assert bubble_formula(4, 4) == pytest.approx(3 / 7)
    assert bubble_formula(8, 32) == pytest.approx(7 / 39)
    with pytest.raises(ValueError, match="stages must be a whole number >= 1"):
        bubble_formula(0, 4)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_bubble_is_the_formula(name, p, m):
    events = simulate(SCHEDULES[name](p, m), forward=1.0, backward=2.0)
    assert measured_bubble(events) == pytest.approx(bubble_formula(p, m), abs=1e-12)
    assert len(events) == 2 * p * m


def test_simulated_step_takes_m_plus_p_minus_1_slots():
    events = simulate(one_f_one_b_schedule(3, 4), forward=1.0, backward=2.0)
    assert max(e["end"] for e in events) == (4 + 3 - 1) * 3.0


@pytest.mark.parametrize("schedule, match", [
    # Stage 0 takes the gradients in the order 1, 0 while stage 1 sends them 0, 1.
    ([_actions("F0 F1 B1 B0"), _actions("F0 F1 B0 B1")],
     r"stage 0 runs the B's in the order \[1, 0\] but stage 1 sends them in the order \[0, 1\]"),
    # Stage 1 takes the activations in the order 1, 0 while stage 0 sends them 0, 1.
    ([_actions("F0 F1 B0 B1"), _actions("F1 F0 B0 B1")],
     r"stage 1 runs the F's in the order \[1, 0\] but stage 0 sends them in the order \[0, 1\]"),
])
def test_neighbours_must_pass_micro_batches_in_the_same_order(schedule, match):
    # Messages carry no micro-batch number: another order would silently mix micro-batches.
    with pytest.raises(ValueError, match=match):
        check_schedule(schedule, 2)


def test_simulate_finds_a_deadlock():
    # Stage 0 wants B0 before it has sent F1; stage 1 wants F1 before B0: each waits on the other.
    schedule = [_actions("F0 B0 F1 B1"), _actions("F0 F1 B0 B1")]
    with pytest.raises(ValueError, match=r"deadlocks.*0: \('B', 0\), 1: \('F', 1\)"):
        simulate(schedule)


def test_measured_bubble_averages_ranks_and_steps():
    one = [{"rank": 0, "kind": F, "micro": 0, "start": 0.0, "end": 1.0},
           {"rank": 1, "kind": F, "micro": 0, "start": 1.0, "end": 2.0}]
    assert measured_bubble(one) == 0.5
    full = [{"rank": r, "kind": F, "micro": 0, "start": 0.0, "end": 2.0, "step": 1} for r in (0, 1)]
    assert measured_bubble([{**e, "step": 0} for e in one] + full) == 0.25  # mean of 0.5 and 0
    with pytest.raises(ValueError, match="no events"):
        measured_bubble([])


def test_simulate_with_a_hand_over_cost_and_uneven_stages():
    # GPipe, 2 stages, m = 2, forward 1, backward 2, each receive costs 0.5:
    # stage 1: F0 1.5-2.5, F1 2.5+0.5=3-4, B0 4-6, B1 6-8; stage 0: B0 6.5-8.5, B1 8.5+0.5=9-11.
    events = simulate(gpipe_schedule(2, 2), message=0.5)
    got = {(e["rank"], e["kind"], e["micro"]): (e["start"], e["end"]) for e in events}
    assert got[1, F, 0] == (1.5, 2.5) and got[1, F, 1] == (3.0, 4.0)
    assert got[0, B, 0] == (6.5, 8.5) and got[0, B, 1] == (9.0, 11.0)
    # A slower stage sets the pace: stage 1's forwards take 3, so stage 0 waits for them.
    slow = simulate(gpipe_schedule(2, 4), forward=[1.0, 3.0], backward=[2.0, 2.0])
    assert measured_bubble(slow) > bubble_formula(2, 4)
    assert max(e["end"] for e in slow if e["rank"] == 1 and e["kind"] == F) == 1.0 + 4 * 3.0


@pytest.mark.parametrize("kwargs, match", [
    ({"forward": [1.0, 2.0, 3.0]}, "forward has 3 times for 2 stages"),
    ({"backward": [2.0]}, "backward has 1 times for 2 stages"),
    ({"message": -1.0}, "message is a time"),
])
def test_simulate_refuses_bad_times(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(gpipe_schedule(2, 2), **kwargs)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_breakdown_recovers_the_costs_it_is_given(name):
    # Replaying a timeline made with known stage times and hand-over cost gives them back,
    # and each model adds its cost: formula <= uneven stages <= with messages = measured.
    events = simulate(SCHEDULES[name](3, 6), forward=[1.0, 1.5, 1.0], backward=2.0, message=0.2)
    b = bubble_breakdown(events)
    assert b["forward_s"] == [1.0, 1.5, 1.0] and b["backward_s"] == [2.0, 2.0, 2.0]
    assert b["message_s"] == pytest.approx(0.2)
    assert b["formula"] == bubble_formula(3, 6) < b["stages"] < b["messages"]
    assert b["messages"] == pytest.approx(b["measured"])
    ideal = bubble_breakdown(simulate(SCHEDULES[name](3, 6)))
    assert ideal["stages"] == pytest.approx(ideal["formula"]) and ideal["message_s"] == 0.0


def test_bubble_breakdown_takes_the_median_step_and_needs_events():
    calm = simulate(gpipe_schedule(2, 2))
    late = [{**e, "start": e["start"] + 0.5 * (e["rank"] == 1),
             "end": e["end"] + 0.5 * (e["rank"] == 1)}
            for e in calm]
    steps = [{**e, "step": k} for k, step in enumerate([calm, calm, late]) for e in step]
    assert bubble_breakdown(steps)["measured"] == pytest.approx(measured_bubble(calm))
    with pytest.raises(ValueError, match="no events"):
        bubble_breakdown([])


# ---- stages and micro-batches -------------------------------------------------------------------


def _params(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_split_stages_keeps_the_layers_in_order_and_balances_parameters(stages):
    model = mlp_stack(width=64, depth=8, inputs=8)
    parts = split_stages(model, stages)
    assert len(parts) == stages
    assert [layer for part in parts for layer in part] == list(model)  # the same objects, in order
    square = 64 * 64 + 64  # one Linear(64, 64): the unit of work
    sizes = [_params(p) for p in parts]
    assert max(sizes) - min(sizes) <= square  # no better contiguous split exists
    assert all(isinstance(part[0], nn.Linear) for part in parts)
    assert all(isinstance(part[-1], nn.ReLU) for part in parts[:-1])  # ReLU stays with its Linear


def test_split_stages_two_stages_of_the_example_model():
    parts = split_stages(mlp_stack(depth=4), 2)
    assert [len(p) for p in parts] == [6, 5]  # input layer + 2 square | 2 square + head
    assert abs(_params(parts[0]) - _params(parts[1])) < 0.03 * _params(parts[0])  # in vs head


def test_split_stages_without_parameters_balances_layer_counts():
    model = nn.Sequential(*[nn.ReLU() for _ in range(7)])
    assert [len(p) for p in split_stages(model, 3)] == [2, 2, 3]
    assert [len(p) for p in split_stages(model, 7)] == [1] * 7


def test_split_stages_refuses_what_cannot_split():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match=r"more pipeline stages \(5\) than layers \(4\): .*"
                                         r"use stages <= 4"):
        split_stages(model, 5)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="stages must be a whole number >= 1"):
            split_stages(model, bad)
    with pytest.raises(ValueError, match=r"needs an nn.Sequential.*got Linear"):
        split_stages(nn.Linear(2, 2), 1)


def test_stage_builder_builds_the_same_stages_every_time():
    build = stage_builder(partial(mlp_stack, width=16, depth=2, inputs=4))
    a, b = build(1, 2), build(1, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    torch.manual_seed(0)
    full = split_stages(mlp_stack(width=16, depth=2, inputs=4), 2)
    assert all(torch.equal(p, q) for p, q in zip(full[1].parameters(), a.parameters(), strict=True))


def test_micro_batches_are_equal_views():
    x = torch.arange(24.0).reshape(12, 2)
    chunks = micro_batches(x, 4)
    assert [c.shape for c in chunks] == [torch.Size([3, 2])] * 4
    assert torch.equal(torch.cat(chunks), x)
    assert chunks[1].data_ptr() == x[3:].data_ptr()  # a view: no copy
    assert len(micro_batches(x, 1)) == 1 and len(micro_batches(x, 12)) == 12


def test_micro_batches_that_do_not_divide_say_what_would():
    with pytest.raises(ValueError, match=r"^a batch of 30 does not split into 4 micro-batches: "
                                         r"use m in \(1, 2, 3, 5, \.\.\.\) or a batch that is a "
                                         r"multiple of 4$"):
        micro_batches(torch.zeros(30, 2), 4)
    with pytest.raises(ValueError, match=r"use m in \(1, 7\) or"):
        micro_batches(torch.zeros(7), 2)
    with pytest.raises(ValueError, match="m must be a whole number >= 1"):
        micro_batches(torch.zeros(4), 0)


def test_reference_step_is_the_full_model_on_the_full_batch():
    make = partial(mlp_stack, width=16, depth=3, inputs=4)
    batch = example_batch(8, inputs=4)
    ref = reference_step(stage_builder(make), 3, batch)
    torch.manual_seed(0)
    model = make()
    loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    assert ref["loss"] == pytest.approx(loss.item(), rel=1e-6)
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(torch.cat(ref["grads"]), flat, atol=1e-7)


# ---- worker functions in a one-rank group (this process) -----------------------------------

SMALL = partial(mlp_stack, width=32, depth=4, inputs=8)


def test_one_stage_pipeline_is_gradient_accumulation(group):
    batch = example_batch(12, inputs=8)
    ref = reference_step(stage_builder(SMALL), 1, batch)
    for name, m, live in (("naive", 1, 1), ("gpipe", 3, 3), ("1f1b", 4, 1)):
        out = run_pipeline(stage_builder(SMALL), name, m, batch, steps=2, warmup=1)
        assert out["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert torch.allclose(out["grads"], ref["grads"][0], rtol=1e-4, atol=1e-6)
        assert len(out["events"]) == 2 * 2 * m and {e["step"] for e in out["events"]} == {0, 1}
        # One stage: GPipe holds every micro-batch, 1F1B runs each backward at once.
        assert out["peak_live"] == [live], name
        assert out["peak_saved_bytes"] == [live * out["micro_saved_bytes"][0]] != [0], name


def test_run_stage_is_the_schedule_and_the_meter_measures_around_it(group):
    from labkit.parallel.pipeline import StageMeter, run_stage

    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    xs, ys = list(torch.randn(4, 4).chunk(2)), list(torch.tensor([0, 1, 2, 0]).chunk(2))
    actions = [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # GPipe on one stage
    meta = ((2, 4), torch.float32)
    # Alone, run_stage only runs the schedule: the losses, the gradients, nothing measured.
    losses = run_stage(module, actions, xs, ys, meta, nn.functional.cross_entropy, "cpu")
    assert len(losses) == 2 and module.weight.grad is not None
    module.zero_grad()
    meter = StageMeter(torch.device("cpu"), held=list(module.parameters()))
    meter.start_step()
    run_stage(module, actions, xs, ys, meta, nn.functional.cross_entropy, torch.device("cpu"),
              meter.measure)
    assert [(e["kind"], e["micro"]) for e in meter.events] == actions
    assert all(0 <= e["start"] <= e["end"] for e in meter.events)
    # Both forwards ran before either backward: two micro-batches' activations held at once.
    assert meter.peak["live"] == 2 and meter.peak["bytes"] >= 2 * meter.peak["micro"] > 0
    assert meter.alive == {}  # every backward freed its micro-batch


@pytest.mark.parametrize("schedule, m, kwargs, match", [
    ("zigzag", 2, {}, r"unknown schedule 'zigzag': use one of naive, gpipe, 1f1b"),
    ("naive", 2, {}, r"naive .* m must be 1, got m=2; use 'gpipe' or '1f1b'"),
    ("gpipe", 5, {}, r"a batch of 12 does not split into 5 micro-batches"),
    ([[("F", 0), ("B", 0)]] * 2, 1, {}, r"2 stage\(s\) but there are 1 ranks"),
    ("gpipe", 2, {"steps": 0}, r"need steps >= 1"),
    ("gpipe", 2, {"warmup": -1}, r"need steps >= 1 and warmup >= 0, got steps=1, warmup=-1"),
])
def test_run_pipeline_refuses_bad_arguments(group, schedule, m, kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_pipeline(stage_builder(SMALL), schedule, m, example_batch(12, inputs=8), **kwargs)
    with pytest.raises(ValueError, match="pass batch="):
        run_pipeline(stage_builder(SMALL), "gpipe", 2)
    with pytest.raises(ValueError, match="pass batch="):
        pipelining_step(stage_builder(SMALL), "gpipe", 2)


def test_a_stage_whose_output_cannot_be_sent_is_refused(group):
    from labkit.parallel.pipeline import _input_meta

    class Labels(nn.Module):
        def forward(self, x):
            return x.argmax(dim=1)  # int64: not an activation the next stage can take a grad of

    # Rank 0 of 2 stages checks its output before it tells stage 1 the shape (nothing is sent).
    with pytest.raises(ValueError, match=r"stage 0 outputs a torch\.int64 tensor with 1 dims: "
                                         r"the activations sent must be floats"):
        _input_meta(Labels(), torch.zeros(4, 3), 0, 2, torch.device("cpu"))


def test_bubble_sweep_rows_on_one_rank(group):
    from labkit.parallel.pipeline import bubble_sweep

    rows = bubble_sweep(stage_builder(SMALL), [1, 2, 4], example_batch(12, inputs=8), steps=2)
    assert [(r["schedule"], r["m"]) for r in rows] == [(s, m) for s in ("gpipe", "1f1b")
                                                       for m in (1, 2, 4)]
    by = {(r["schedule"], r["m"]): r for r in rows}
    assert by["gpipe", 1]["measured_steps"] == by["1f1b", 1]["measured_steps"]  # naive, run once
    for r in rows:
        assert r["formula"] == 0.0 and r["stages"] == 1 and r["micro_batch"] == 12 // r["m"]
        assert len(r["measured_steps"]) == 2 and 0 <= r["measured"] < 1 and r["step_s"] > 0
        # One stage: nothing to wait for, so every model says no bubble and no hand-over.
        assert r["uneven_stages"] == r["with_messages"] == 0.0 and r["message_s"] == 0.0


def test_pipelining_refuses_unknown_schedules(group):
    with pytest.raises(ValueError, match="use gpipe or 1f1b"):
        pipelining_step(stage_builder(SMALL), "naive", 1, example_batch(12, inputs=8))


# ---- two stages, one launch ----------------------------------------------------------------

BATCH, M = 12, 3
SKEW = 0.05  # seconds: how far apart two ranks may leave the same barrier on a busy CI box


def pipeline_checks(build, batch, m) -> dict:
    """Run on both ranks of one launch: every schedule by hand, and torch's pipelining."""
    out = {name: run_pipeline(build, name, m, batch) for name in ("gpipe", "1f1b")}
    out["naive"] = run_pipeline(build, "naive", 1, batch)
    out["torch_gpipe"] = pipelining_step(build, "gpipe", m, batch)
    out["torch_1f1b"] = pipelining_step(build, "1f1b", m, batch)
    return out


@pytest.fixture(scope="module")
def two_stages():
    """One launch of 2 ranks (about 10 s here), its per-rank results and the reference step."""
    build, batch = stage_builder(SMALL), example_batch(BATCH, inputs=8)
    values = launch(pipeline_checks, build, batch, M, nproc=2, show_ranks=[], timeout=180,
                    warm=True).values
    return values, reference_step(build, 2, batch)


def _check_pipeline(values, ref, names=("gpipe", "1f1b", "naive", "torch_gpipe", "torch_1f1b")):
    for name in names:
        for rank, v in enumerate(values):
            got = v[name]
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), (name, rank)
            assert torch.allclose(got["grads"].cpu(), ref["grads"][rank], rtol=1e-4, atol=1e-6), \
                (name, rank, (got["grads"].cpu() - ref["grads"][rank]).abs().max())


def test_two_stage_pipelines_equal_one_unpipelined_step(two_stages):
    values, ref = two_stages
    _check_pipeline(values, ref)


@pytest.mark.parametrize("name, m", [("gpipe", M), ("1f1b", M), ("naive", 1)])
def test_two_stage_events_are_well_formed(two_stages, name, m):
    values, _ = two_stages
    events = values[0][name]["events"]
    assert events == values[1][name]["events"]  # every rank returns every rank's events
    schedule = SCHEDULES[name](2, m)
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        assert [(e["kind"], e["micro"]) for e in mine] == schedule[rank]  # in schedule order
        assert all(0 <= e["start"] <= e["end"] for e in mine)
        assert all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:], strict=False))
    # The data dependencies, as the clocks saw them; the ranks' t = 0 agree to the barrier's skew.
    at = {(e["rank"], e["kind"], e["micro"]): e for e in events}
    for i in range(m):
        assert at[0, F, i]["end"] <= at[1, F, i]["start"] + SKEW
        assert at[1, B, i]["end"] <= at[0, B, i]["start"] + SKEW
    assert 0 < measured_bubble(events) < 1


def test_two_stage_activations_alive_follow_the_schedule(two_stages):
    values, _ = two_stages
    runs = {name: values[0][name] for name in ("gpipe", "1f1b", "naive")}
    keys = ("peak_live", "peak_saved_bytes", "micro_saved_bytes")
    for name, run in runs.items():  # every rank returns every stage's figures
        assert all(values[1][name][k] == run[k] for k in keys), name
    assert runs["gpipe"]["peak_live"] == [M, M]
    assert runs["1f1b"]["peak_live"] == [min(M, 2 - s) for s in range(2)] == [2, 1]
    assert runs["naive"]["peak_live"] == [1, 1]
    for name, run in runs.items():  # equal micro-batches: bytes are live micro-batches x one's
        assert run["peak_saved_bytes"] == [n * b for n, b in zip(run["peak_live"],
                                                                  run["micro_saved_bytes"],
                                                                  strict=True)], name
    assert runs["gpipe"]["micro_saved_bytes"] == runs["1f1b"]["micro_saved_bytes"]
    # Stage 0 of SMALL is Linear-ReLU three times: it keeps the three ReLU outputs (each the
    # next Linear's input); its own input is the batch and its weights are held anyway.
    micro = BATCH // M
    width = 32 * 4  # float32 bytes per row of SMALL's square layers
    assert runs["gpipe"]["micro_saved_bytes"][0] == 3 * micro * width
    # Stage 1 also keeps the input it received and the loss's log-softmax, at least.
    assert runs["gpipe"]["micro_saved_bytes"][1] >= 3 * micro * width + micro * 10 * 4


# ---- on GPUs -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_two_stage_pipeline_on_two_gpus_with_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("a 2-stage pipeline with NCCL needs 2 GPUs")
    build, batch = stage_builder(SMALL), example_batch(BATCH, inputs=8)
    values = launch(pipeline_checks, build, batch, M, nproc=2, backend="nccl", show_ranks=[],
                    timeout=300).values
    # fp32 matmuls on both sides (TF32 is off by default for them): the CPU reference holds.
    _check_pipeline(values, reference_step(build, 2, batch))

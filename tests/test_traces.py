"""labkit.traces: interval arithmetic, the analyses on synthetic traces whose answers are computed
here by hand, load_trace's errors, and one real 2-rank DDP recording (slow)."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from labkit import traces
from labkit.traces import (
    analyse_trace,
    data_stalls,
    exposed_communication,
    host_syncs,
    intervals_total,
    load_trace,
    merge_intervals,
    step_times,
    subtract_intervals,
    synthetic_trace,
)

# synthetic_trace's fixed durations (us) without a seed: forward, backward before the enqueue,
# the enqueue, the optimizer, loss.item(), a data range, the gap between steps; the first
# event starts at 1e6 us.
FWD, BWD1, ENQ, OPT, ITEM, DATA, GAP, T0 = 300, 200, 10, 100, 20, 50, 5, 1_000_000


def ev(name, ts, dur, cat="cpu_op", tid=1, pid=1):
    """One complete event as load_trace returns it."""
    return {"name": name, "cat": cat, "ph": "X", "ts": float(ts), "dur": float(dur),
            "pid": pid, "tid": tid, "args": {}}


# --------------------------------------------------------------------------- intervals

@pytest.mark.parametrize("spans, merged", [
    ([], []),
    ([(0, 1), (1, 2)], [(0, 2)]),                  # touching: one span, no gap
    ([(0, 10), (2, 3)], [(0, 10)]),                # nested
    ([(1, 2), (1, 2)], [(1, 2)]),                  # identical
    ([(3, 3)], []),                                # empty: covers nothing
    ([(5, 6), (0, 2), (1, 3)], [(0, 3), (5, 6)]),  # unsorted, overlapping, disjoint
])
def test_merge_intervals_edge_cases(spans, merged):
    assert merge_intervals(spans) == merged
    assert intervals_total(spans) == sum(e - s for s, e in merged)


@pytest.mark.parametrize("a, b, left", [
    ([], [(0, 5)], []),
    ([(0, 5)], [], [(0, 5)]),
    ([(0, 5)], [(0, 5)], []),                      # identical: nothing left
    ([(0, 5)], [(-1, 9)], []),                     # covered
    ([(0, 2)], [(2, 3)], [(0, 2)]),                # touching does not cut
    ([(0, 10)], [(2, 3), (5, 12)], [(0, 2), (3, 5)]),
    ([(0, 4), (6, 10)], [(3, 7)], [(0, 3), (7, 10)]),  # one cut across two spans
    ([(0, 4), (2, 6)], [(1, 2)], [(0, 1), (2, 6)]),    # a is merged first
])
def test_subtract_intervals_edge_cases(a, b, left):
    assert subtract_intervals(a, b) == left


def test_interval_functions_agree_with_counting_unit_cells():
    """On random integer spans, each function against the cells of [0, 40) it covers."""
    rng = random.Random(7)

    def spans():
        out = []
        for _ in range(rng.randint(0, 6)):
            s = rng.randint(0, 39)
            out.append((s, rng.randint(s, 40)))
        return out

    def cells(sp):
        return {c for s, e in sp for c in range(s, e)}

    for _ in range(200):
        a, b = spans(), spans()
        assert intervals_total(a) == len(cells(a))
        assert cells(merge_intervals(a)) == cells(a)
        merged = merge_intervals(a)
        assert all(e1 < s2 for (_, e1), (s2, _) in zip(merged, merged[1:], strict=False))
        assert cells(subtract_intervals(a, b)) == cells(a) - cells(b)


@pytest.mark.parametrize("bad", [[(2, 1)], [(1, 2, 3)]])
def test_intervals_refuse_a_span_that_ends_before_it_starts(bad):
    with pytest.raises(ValueError, match=r"\(start, end\) with end >= start"):
        merge_intervals(bad)


# --------------------------------------------------------------------------- synthetic traces

@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("exposed", [0.0, 0.25, 1.0])
def test_synthetic_trace_answers_by_hand(exposed, gpu):
    steps, comm = 3, 400
    s = synthetic_trace(steps=steps, exposed=exposed, comm_us=comm, gpu=gpu)
    step_us = FWD + BWD1 + ENQ + comm + OPT + ITEM  # the rest of backward hides under comm
    hand = {"steps": 3, "step_s": step_us / 1e6, "comm_s": steps * comm / 1e6,
            "exposed_comm_s": steps * exposed * comm / 1e6, "exposed_fraction": exposed,
            "stalls": [], "syncs": 3}
    assert s.expected.keys() == hand.keys()
    assert s.expected["stalls"] == [] and s.expected["syncs"] == 3
    for key in ("steps", "step_s", "comm_s", "exposed_comm_s", "exposed_fraction"):
        assert s.expected[key] == pytest.approx(hand[key], abs=1e-12), key
    got = analyse_trace(s.trace)
    for key in ("steps", "step_s", "comm_s", "exposed_comm_s", "exposed_fraction"):
        assert got[key] == pytest.approx(hand[key], abs=1e-12), key
    assert got["stalls"] == [] and got["syncs"]["count"] == 3


def test_exposed_is_exactly_zero_when_hidden_and_all_when_exposed():
    assert exposed_communication(load_trace(synthetic_trace(exposed=0.0).trace)) == 0.0
    events = load_trace(synthetic_trace(exposed=1.0, steps=2, comm_us=300).trace)
    assert exposed_communication(events) == pytest.approx(2 * 300 / 1e6, abs=1e-12)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_synthetic_traces_vary_and_still_match_their_answers(seed):
    s = synthetic_trace(steps=4, exposed=0.4, stall_step=2, seed=seed)
    got = analyse_trace(s.trace)
    for key in ("steps", "step_s", "comm_s", "exposed_comm_s", "exposed_fraction"):
        assert got[key] == pytest.approx(s.expected[key], abs=1e-12), key
    assert got["exposed_fraction"] == pytest.approx(0.4)  # the share is exact in every step
    assert [x["step"] for x in got["stalls"]] == s.expected["stalls"] == [2]
    assert got["comm_s"] != pytest.approx(4 * 400 / 1e6)  # durations did vary
    assert synthetic_trace(steps=4, seed=seed).trace == synthetic_trace(steps=4, seed=seed).trace


def test_enqueue_ranges_are_not_communication_unless_asked():
    """A GPU trace's c10d::allreduce_ and nccl:all_reduce CPU ranges only enqueue: counted as
    communication, the 8 us nccl range of each step (no kernel under it) would be exposed."""
    events = load_trace(synthetic_trace(steps=3, exposed=0.0, gpu=True).trace)
    assert exposed_communication(events) == 0.0

    def with_cpu_ranges(e):
        return traces.is_communication(e) or e["name"] == "nccl:all_reduce"

    assert exposed_communication(events, comm=with_cpu_ranges) == pytest.approx(3 * 8 / 1e6)
    # no compute at all: every microsecond of the all-reduce is exposed
    assert exposed_communication(events, compute=lambda e: False) == pytest.approx(3 * 400 / 1e6)


def test_cpu_rule_gloo_on_its_thread_against_ops_on_the_main_thread():
    comm = [ev("gloo:all_reduce", 0, 100, "user_annotation", tid=9),
            ev("gloo:all_reduce", 50, 100, "user_annotation", tid=9)]  # union: 0..150
    # the enqueue op is no compute: all 150 us exposed
    assert exposed_communication(comm + [ev("c10d::allreduce_", 0, 150)]) == pytest.approx(
        150e-6)
    # backward 100..120 with an op nested in it: 150 - 20 us exposed
    ops = [ev("autograd::engine::evaluate_function: MmBackward0", 100, 20),
           ev("aten::mm", 105, 10)]
    assert exposed_communication(comm + ops) == pytest.approx(130e-6)
    # a record_function range is no compute either
    assert exposed_communication(comm + [ev("step", 0, 200, "user_annotation")]) == (
        pytest.approx(150e-6))
    assert exposed_communication(ops) == 0.0  # no communication: nothing exposed


def test_data_stalls_finds_the_stalled_step_and_when_it_began():
    s = synthetic_trace(steps=4, stall_step=2, stall_us=50_000)
    stalls = data_stalls(load_trace(s.trace))
    step_us = FWD + BWD1 + ENQ + 400 + OPT + ITEM
    start_us = 2 * (DATA + step_us + GAP)  # two normal steps before it, from the first event
    assert stalls == [{"step": 2, "start_s": pytest.approx(start_us / 1e6),
                       "seconds": pytest.approx(0.05)}]


def test_data_stalls_threshold_is_strict():
    events = load_trace(synthetic_trace(steps=3, stall_step=0, stall_us=50_000).trace)
    assert data_stalls(events, threshold_s=0.05) == []     # exactly the threshold: no stall
    assert [s["step"] for s in data_stalls(events, threshold_s=0.0)] == [0, 1, 2]


@pytest.mark.parametrize("bad", [-1, True, "0.1", None])
def test_data_stalls_refuses_a_bad_threshold(bad):
    events = load_trace(synthetic_trace().trace)
    with pytest.raises(ValueError, match="threshold_s must be seconds >= 0"):
        data_stalls(events, threshold_s=bad)


def test_a_missing_label_says_how_to_add_it():
    events = load_trace(synthetic_trace().trace)
    with pytest.raises(ValueError, match=r"no 'batch' ranges.*record_function\('batch'\)"):
        data_stalls(events, label="batch")
    with pytest.raises(ValueError, match="no 'train' ranges"):
        step_times(events, label="train")


def test_step_times_ignore_the_gpu_copy_of_a_range():
    events = load_trace(synthetic_trace(steps=3, gpu=True).trace)
    assert sum(e["name"] == "step" for e in events) == 6  # CPU range + its GPU copy
    assert step_times(events) == pytest.approx([(FWD + BWD1 + ENQ + 400 + OPT + ITEM) / 1e6] * 3)


@pytest.mark.parametrize("gpu", [False, True])
def test_host_syncs_count_each_item_once(gpu):
    syncs = host_syncs(load_trace(synthetic_trace(steps=3, gpu=gpu).trace))
    assert syncs["count"] == 3
    assert syncs["seconds"] == pytest.approx(3 * ITEM / 1e6)  # the outer aten::item spans
    names = {"aten::item", "aten::_local_scalar_dense"} | ({"cudaStreamSynchronize"} if gpu
                                                           else set())
    assert set(syncs["by_name"]) == names
    assert all(v["count"] == 3 for v in syncs["by_name"].values())
    assert syncs["by_name"]["aten::item"]["seconds"] == pytest.approx(3 * ITEM / 1e6)


def test_host_syncs_without_any():
    assert host_syncs(load_trace(synthetic_trace(sync=False).trace)) == {
        "count": 0, "seconds": 0, "by_name": {}}


def test_host_syncs_outermost_per_thread():
    events = [ev("aten::item", 0, 10), ev("aten::item", 10, 5),        # touching: two
              ev("cudaDeviceSynchronize", 30, 4, "cuda_runtime"),
              ev("cudaDeviceSynchronize", 30, 4, "cuda_runtime"),      # identical: one
              ev("aten::item", 2, 3, tid=2)]                           # another thread
    syncs = host_syncs(events)
    assert syncs["count"] == 4
    assert syncs["seconds"] == pytest.approx(19e-6)  # 0..15 and 30..34; tid 2 inside 0..15
    assert syncs["by_name"]["aten::item"]["count"] == 3
    assert host_syncs(events, names=("cudaDeviceSynchronize",))["count"] == 1


# --------------------------------------------------------------------------- load_trace

def test_load_trace_reads_a_file_a_dict_and_a_list(tmp_path):
    trace = synthetic_trace(steps=2, stall_step=1).trace
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    gz = tmp_path / "t.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump(trace, f)
    events = load_trace(trace)
    assert load_trace(path) == load_trace(str(gz)) == load_trace(trace["traceEvents"]) == events
    assert load_trace(events) == events  # its own output reads back unchanged
    raw = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(raw) and len(trace["traceEvents"]) > len(raw)  # metadata dropped
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in raw)
    assert set(events[0]) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
    assert analyse_trace(path) == analyse_trace(trace)


def test_load_trace_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="export_chrome_trace"):
        load_trace(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("ranks: 2\n")
    with pytest.raises(ValueError, match="not a Chrome trace .not JSON"):
        load_trace(bad)
    with pytest.raises(ValueError, match="no 'traceEvents' list"):
        load_trace({"events": []})
    with pytest.raises(TypeError, match="got int"):
        load_trace(3)
    with pytest.raises(ValueError, match="event 0 is a str"):
        load_trace(["gloo:all_reduce"])
    with pytest.raises(ValueError, match="needs numbers 'ts' and 'dur'"):
        load_trace([{"ph": "X", "name": "step", "ts": 0}])
    with pytest.raises(ValueError, match="negative duration"):
        load_trace([{"ph": "X", "name": "step", "ts": 0, "dur": -1}])


# --------------------------------------------------------------------------- argument errors

@pytest.mark.parametrize("kwargs, message", [
    ({"steps": 0}, "steps must be a whole number >= 1"),
    ({"exposed": 1.5}, "from 0 .hidden. to 1"),
    ({"exposed": True}, "from 0 .hidden. to 1"),
    ({"comm_us": 0}, "comm_us must be microseconds > 0"),
    ({"stall_us": -5}, "stall_us must be microseconds > 0"),
    ({"stall_step": 3, "steps": 3}, "stall_step=3 is past the last step"),
])
def test_synthetic_trace_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        synthetic_trace(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"nproc": 0}, "nproc must be a whole number >= 1"),
    ({"steps": 0}, "steps must be a whole number >= 1"),
    ({"stall_s": -0.1}, "stall_s must be seconds >= 0"),
    ({"stall_step": 4, "steps": 4}, "stall_step=4 is past the last step"),
    ({"stall_rank": 2, "nproc": 2}, "stall_rank=2 but ranks are 0 to 1"),
])
def test_record_ddp_trace_refuses_bad_arguments_before_starting(tmp_path, kwargs, message):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        traces.record_ddp_trace(out, **kwargs)
    assert not out.exists()  # refused before anything was written or launched


# --------------------------------------------------------------------------- a real recording

@pytest.mark.slow
def test_record_ddp_trace_on_two_ranks(tmp_path):
    """A straggler: rank 0's batch of step 1 comes 0.2 s late; rank 1 waits for it inside the
    all-reduce, where its trace shows the stall as exposed communication."""
    steps, stall_s = 3, 0.2
    out = tmp_path / "traces"
    paths = traces.record_ddp_trace(out, steps=steps, stall_s=stall_s, stall_rank=0)
    assert paths == [out / "trace-rank0.json", out / "trace-rank1.json"]
    assert sorted(p.name for p in out.iterdir()) == ["trace-rank0.json", "trace-rank1.json"]
    reports = [analyse_trace(p) for p in paths]
    for report in reports:
        assert report["steps"] == steps and report["step_s"] > 0
        assert report["syncs"]["count"] == steps  # one loss.item() a step
        assert report["syncs"]["by_name"]["aten::_local_scalar_dense"]["count"] == steps
        assert 0 < report["exposed_comm_s"] <= report["comm_s"]
    stalls = data_stalls(load_trace(paths[0]), threshold_s=stall_s / 2)
    assert [s["step"] for s in stalls] == [1] and stalls[0]["seconds"] >= stall_s
    assert data_stalls(load_trace(paths[1]), threshold_s=stall_s / 2) == []
    assert reports[1]["exposed_comm_s"] >= stall_s / 2  # waiting for rank 0 inside gloo
    events = load_trace(paths[1])
    gloo = [e for e in events if e["name"] == "gloo:all_reduce"]
    enqueue = [e for e in events if e["name"] == "c10d::allreduce_"]
    main = {e["tid"] for e in events if e["name"] == "step"}
    assert len(gloo) >= steps and len(enqueue) >= steps  # at least one bucket a step
    assert {e["tid"] for e in gloo}.isdisjoint(main)  # gloo works on threads of its own

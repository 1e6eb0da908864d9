"""labkit.resilience: the save interval against its formulas and a simulation, failure rates with
their source, and faults injected into real gloo ranks with two recoveries measured."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest
import torch

from labkit.resilience import (
    LIES,
    LLAMA3_405B,
    Fault,
    daly_interval,
    divergent_ranks,
    exact_goodput,
    exact_interval,
    expected_goodput,
    fault_plan,
    fingerprint,
    fingerprints,
    interval_at_scale,
    lying_resumes,
    mtbf_at_scale,
    peer_recovery_plan,
    resilient_training,
    simulate_goodput,
    young_daly_interval,
)


def _argmax(f, low, high, tol=1e-12):
    """Golden-section search for the maximum of a unimodal ``f`` on ``[low, high]``."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    while b - a > tol * high:
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if f(c) > f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


# ---- how often to save ---------------------------------------------------------------------


def test_young_is_the_exact_maximum_of_the_first_order_goodput():
    delta, mtbf, restart = 30.0, 4 * 3600.0, 120.0
    young = young_daly_interval(delta, mtbf)
    assert young == math.sqrt(2 * delta * mtbf)

    def goodput(tau):
        return expected_goodput(tau, delta, mtbf, restart)

    h = young * 1e-5
    assert abs(goodput(young + h) - goodput(young - h)) / (2 * h) < 1e-9  # the slope vanishes
    assert _argmax(goodput, young / 4, young * 4) == pytest.approx(young, rel=1e-6)


def test_the_exact_interval_maximises_the_exact_goodput_and_daly_is_its_series():
    mtbf = 3600.0
    for delta in (1.0, 60.0, 600.0):
        best = exact_interval(delta, mtbf)
        found = _argmax(lambda tau, d=delta: exact_goodput(tau, d, mtbf, 300.0), 1e-3, mtbf)
        assert found == pytest.approx(best, rel=1e-6)
    # Daly's formula is the exact optimum's expansion in eps = sqrt(delta/2M) up to eps^3: what
    # is left over is the next term of the series, (8/135)·eps^4·M (derived with sympy).
    for eps in (0.01, 0.03):
        delta = 2 * eps ** 2 * mtbf
        left = (exact_interval(delta, mtbf) - daly_interval(delta, mtbf)) / mtbf
        assert left / eps ** 4 == pytest.approx(8 / 135, rel=0.01)


def test_daly_reproduces_the_papers_worked_examples():
    # Daly 2006, Figs. 3-5: delta = 5 min, M = 24 h, 6 h, 15 min -> 117, 57 and 9.1 minutes.
    assert round(daly_interval(5, 24 * 60)) == 117
    assert round(daly_interval(5, 6 * 60)) == 57
    assert round(daly_interval(5, 15), 1) == 9.1
    assert daly_interval(50, 20) == 20  # delta >= 2M: save every M


def test_the_simulated_optimum_lands_on_the_exact_interval():
    mtbf, delta, restart = 1.0, 0.02, 0.05
    best = exact_interval(delta, mtbf)
    grid = [best * (0.6 + 0.04 * i) for i in range(21)]  # 4% apart, the optimum in the middle
    runs = [simulate_goodput(tau, delta, mtbf, restart, horizon=2e4, seed=0) for tau in grid]
    found = grid[max(range(len(grid)), key=lambda i: runs[i]["goodput"])]
    # One seed for every interval (common random numbers): the optimum within one grid step of
    # the exact one, while Young's interval is 7% off at this delta/M.
    assert abs(found / best - 1) <= 0.041
    assert young_daly_interval(delta, mtbf) / best - 1 > 0.06
    for tau, run in zip(grid, runs, strict=True):  # and the simulation is the model it solves
        assert run["goodput"] == pytest.approx(exact_goodput(tau, delta, mtbf, restart), abs=0.01)
    assert runs[10]["failures"] == pytest.approx(runs[10]["wall_seconds"] / mtbf, rel=0.05)
    again = simulate_goodput(grid[10], delta, mtbf, restart, horizon=2e4, seed=0)
    assert again == runs[10]  # seeded: the same run again


@pytest.mark.parametrize("call, message", [
    (lambda: young_daly_interval(0, 3600), "save_seconds must be a number of seconds > 0, got 0"),
    (lambda: young_daly_interval(60, -1), "mtbf_seconds must be a number of seconds > 0"),
    (lambda: daly_interval(60, float("nan")), "mtbf_seconds must be a number of seconds > 0"),
    (lambda: exact_interval("60", 3600), "save_seconds must be a number of seconds > 0"),
    (lambda: expected_goodput(0, 60, 3600), "interval must be a number of seconds > 0, got 0"),
    (lambda: exact_goodput(-5, 60, 3600), "interval must be a number of seconds > 0"),
    (lambda: exact_goodput(600, 60, 3600, -1), "restart_seconds must be a number of seconds >= 0"),
    (lambda: simulate_goodput(600, 60, 3600, horizon=0), "horizon must be a number of seconds"),
    (lambda: mtbf_at_scale(0), "gpus must be a whole number >= 1"),
])
def test_bad_times_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_interval_math_runs_without_torch():
    probe = ("import sys, labkit.resilience as r; r.interval_at_scale(1024, 60, 600); "
             "r.simulate_goodput(10, 1, 100, horizon=1e3); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


# ---- failure rates at scale ----------------------------------------------------------------


def test_llama3_interruptions_are_the_papers_and_scale_with_the_gpu_count():
    assert (LLAMA3_405B.total, LLAMA3_405B.planned, LLAMA3_405B.unexpected) == (466, 47, 419)
    assert (LLAMA3_405B.days, LLAMA3_405B.gpus) == (54, 16_384)
    assert "466 job interruptions" in LLAMA3_405B.quote and "2407.21783" in LLAMA3_405B.source
    full = mtbf_at_scale(16_384)
    assert full["job_mtbf_seconds"] == pytest.approx(54 * 86400 / 419)  # one every ~3.1 hours
    assert full["per_gpu_mtbf_seconds"] == pytest.approx(54 * 86400 / 419 * 16_384)
    assert mtbf_at_scale(1024)["job_mtbf_seconds"] == pytest.approx(16 * full["job_mtbf_seconds"])
    assert mtbf_at_scale(16_384, planned=True)["job_mtbf_seconds"] == pytest.approx(
        54 * 86400 / 466)
    run = interval_at_scale(16_384, save_seconds=60, restart_seconds=600)
    assert run["interval_seconds"] == exact_interval(60, full["job_mtbf_seconds"])
    assert run["daly_seconds"] < run["young_seconds"]
    assert 0.8 < run["goodput"] < 0.9  # below Meta's ">90%": they cut save and restart times
    small = interval_at_scale(1024, save_seconds=60, restart_seconds=600)
    assert small["interval_seconds"] > 3.5 * run["interval_seconds"] and small["goodput"] > 0.95


# ---- fault plans, fingerprints, who heals whom ----------------------------------------------


def test_a_fault_plan_is_checked_and_sorted():
    plan = fault_plan([{"kind": "corrupt", "rank": 0, "step": 7},
                       {"kind": "kill", "rank": 1, "step": 3}], world=2, steps=10)
    assert plan == [Fault("kill", 1, 3), Fault("corrupt", 0, 7)]
    assert fault_plan([], world=2, steps=10) == []


@pytest.mark.parametrize("faults, message", [
    ([{"kind": "melt", "rank": 0, "step": 1}], "unknown fault kind 'melt': use one of kill, hang"),
    ([{"kind": "kill", "rank": 2, "step": 1}], "names rank 2, but this run has ranks 0..1"),
    ([{"kind": "kill", "rank": 0, "step": 11}], "at step 11, but the run has steps 1..10"),
    ([{"kind": "hang", "rank": 0, "step": 0}], "at step 0, but the run has steps 1..10"),
    ([{"kind": "kill", "rank": 0}], "a fault is a dict with kind, rank and step"),
    ([{"kind": "kill", "rank": 1, "step": 2}, {"kind": "corrupt", "rank": 1, "step": 2}],
     "two faults hit rank 1 at step 2"),
])
def test_bad_fault_plans_are_refused(faults, message):
    with pytest.raises(ValueError, match=message):
        fault_plan(faults, world=2, steps=10)


def test_fingerprints_see_one_bit_and_the_majority_names_the_odd_replica(group):
    model = torch.nn.Linear(3, 2)
    before = fingerprint(model)
    assert fingerprints(model) == [before]  # a one-rank group: this replica alone
    with torch.no_grad():
        bits = model.weight.view(-1)[:1].view(torch.int32)
        bits ^= 1  # the lowest bit of one float
    after = fingerprint(model)
    assert after[1] != before[1] and abs(after[0] - before[0]) < 1e-6
    assert divergent_ranks([before, before, after, before]) == [2]
    assert divergent_ranks([before] * 3) == []
    assert divergent_ranks([before, after]) == [0, 1]  # two replicas: no majority to trust
    assert divergent_ranks([]) == []


def test_peer_recovery_spreads_the_copies_round_robin():
    assert peer_recovery_plan([0, 2], [1, 3]) == [(0, 1), (2, 3)]
    assert peer_recovery_plan([5, 0], [4, 1, 7, 2, 6]) == [(0, 1), (5, 2), (0, 4), (5, 6),
                                                           (0, 7)]
    assert peer_recovery_plan([0, 1, 2], []) == []
    plan = peer_recovery_plan(range(3), range(3, 11))
    sends = [src for src, _ in plan]
    assert max(sends.count(r) for r in range(3)) == math.ceil(8 / 3)  # nobody sends more
    assert [dst for _, dst in plan] == list(range(3, 11))


@pytest.mark.parametrize("healthy, recovering, message", [
    ([], [1], "no healthy rank is left to recover from"),
    ([0, 1], [1], r"rank\(s\) \[1\] are both healthy and recovering"),
    ([0, 0], [1], "healthy_ranks lists a rank twice"),
    ([0], [-1], "recovering_ranks must be ranks"),
])
def test_bad_recovery_plans_are_refused(healthy, recovering, message):
    with pytest.raises(ValueError, match=message):
        peer_recovery_plan(healthy, recovering)


def test_bad_recoveries_are_refused_before_any_collective():
    with pytest.raises(ValueError, match="unknown recovery 'pray': use 'restart'"):
        resilient_training(recovery="pray")
    with pytest.raises(ValueError, match="recovery='restart' needs folder="):
        resilient_training(recovery="restart")


# ---- faults on real ranks ------------------------------------------------------------------


def test_the_worker_runs_in_one_process_and_resumes_from_its_checkpoint(group, tmp_path):
    first = resilient_training(steps=6, recovery="restart", folder=tmp_path, ckpt_every=3)
    assert first["steps_run"] == list(range(1, 7)) and first["resumed_from"] is None
    assert first["diverged"] is None and first["healed"] == [] and first["lost_steps"] == 0
    more = resilient_training(steps=8, recovery="restart", folder=tmp_path, ckpt_every=3)
    assert more["resumed_from"] == 6 and more["steps_run"] == [7, 8]
    straight = resilient_training(steps=8)  # peer mode, no fault: the same numbers
    assert torch.equal(more["weights"], straight["weights"])
    assert list(straight["losses"]) == list(range(1, 9))


def test_peer_recovery_heals_in_memory_and_ends_bitwise_on_the_uninterrupted_run():
    from labkit import LaunchError, launch

    kw = {"steps": 10, "nproc": 4, "warm": True, "show_ranks": [], "timeout": 60}
    straight = launch(resilient_training, **kw).values
    assert all(r["diverged"] is None and r["healed"] == [] for r in straight)
    # Ranks 1 and 3 lose their state at step 4 (healed by 0 and 2); rank 2's weights are
    # nudged after step 7: the fingerprints catch it at once and rank 0 heals it.
    faults = [{"kind": "kill", "rank": 1, "step": 4}, {"kind": "kill", "rank": 3, "step": 4},
              {"kind": "corrupt", "rank": 2, "step": 7}]
    healed = launch(resilient_training, faults=faults, **kw).values
    for rank, out in enumerate(healed):
        assert out["healed"] == [{"step": 4, "src": 0, "dst": 1}, {"step": 4, "src": 2, "dst": 3},
                                 {"step": 7, "src": 0, "dst": 2}]
        assert out["diverged"] == {"step": 7, "ranks": [2]}
        assert out["lost_steps"] == 0 and out["steps_run"] == list(range(1, 11))
        assert out["fingerprint"] == healed[0]["fingerprint"]
        assert torch.equal(out["weights"], straight[rank]["weights"])  # bitwise
        assert out["losses"] == straight[rank]["losses"]
    # Checked every 3 steps, a nudge after step 4 is caught at step 6: healed, the replicas
    # agree again, but two steps averaged a corrupt gradient into everyone's weights.
    late = launch(resilient_training, check_every=3,
                  faults=[{"kind": "corrupt", "rank": 1, "step": 4}], **kw).values
    assert late[0]["diverged"] == {"step": 6, "ranks": [1]}
    assert len({r["fingerprint"] for r in late}) == 1
    assert not torch.equal(late[0]["weights"], straight[0]["weights"])
    # Two of four corrupted at once: no majority to heal from, and the run says so.
    with pytest.raises(LaunchError, match="step 5: the replicas disagree and no majority"):
        launch(resilient_training, faults=[{"kind": "corrupt", "rank": r, "step": 5}
                                           for r in (0, 1)], **kw)


def test_a_killed_rank_restarts_every_rank_from_the_checkpoint(tmp_path, capsys):
    from labkit import launch

    kw = {"steps": 12, "nproc": 2, "show_ranks": [], "timeout": 60}
    straight = launch(resilient_training, warm=True, **kw).values
    # Rank 1 dies before step 9: both ranks restart from the step-5 checkpoint and redo 6-8.
    out = launch(resilient_training, recovery="restart", folder=str(tmp_path), ckpt_every=5,
                 max_restarts=1, faults=[{"kind": "kill", "rank": 1, "step": 9}], **kw).values
    for rank in range(2):
        assert out[rank]["restarts"] == 1 and out[rank]["resumed_from"] == 5
        assert out[rank]["lost_steps"] == 3 and out[rank]["steps_run"] == list(range(6, 13))
        assert torch.equal(out[rank]["weights"], straight[rank]["weights"])  # bitwise
        assert 0 < out[rank]["useful_seconds"] < out[rank]["wall_seconds"]
    assert "torchrun restarted the workers 1 time(s)" in capsys.readouterr().out


def test_a_hung_rank_ends_the_run_with_an_error_that_names_it():
    from labkit import LaunchError, launch

    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"step 3: the gradient all-reduce gave up after 2 s "
                                          r"waiting for rank\(s\) \[1\], which never reached it"):
        launch(resilient_training, steps=5, nproc=2, warm=False, show_ranks=[], timeout=60,
               collective_timeout=2, faults=[{"kind": "hang", "rank": 1, "step": 3}])
    assert time.monotonic() - start < 45  # not the hang's 50 s, nor forever


# ---- a checkpoint that lies ------------------------------------------------------------------


def test_each_lying_resume_diverges_and_the_honest_one_does_not():
    runs = lying_resumes(steps=10, resume_at=5)
    straight = runs["uninterrupted"]
    assert set(runs) == {"uninterrupted", "honest", *LIES}
    assert runs["honest"]["losses"] == straight["losses"]
    assert runs["honest"]["fingerprint"] == straight["fingerprint"]
    assert torch.equal(runs["honest"]["weights"], straight["weights"])
    for lie in LIES:
        assert runs[lie]["losses"][:5] == straight["losses"][:5]  # the same run until the save
        assert runs[lie]["fingerprint"] != straight["fingerprint"], lie
        assert runs[lie]["losses"][6:] != straight["losses"][6:], lie
    with pytest.raises(ValueError, match="resume_at=10 must come before the last step"):
        lying_resumes(steps=10, resume_at=10)

"""Notebook 05's graders: the reference solutions pass, known wrong answers get their hints.

Every grader runs on warm gloo ranks (2, then 4), so a check costs milliseconds once the pools
are up; the answers that hang (a collective on one rank only) cost their timeout and a fresh
pool, so they come last and use a short timeout.
"""

from __future__ import annotations

import functools
import random
import re
import sys

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist

from labkit import check, diagnose
from labkit.exercises import diagnosis

from .fakes import solution_namespace

# Ship this module's wrong answers by value, as a notebook's functions are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

HANG_S = 3.0  # a warm run's timeout counts from its start: the jobs take well under a second


def solved(exercise_id: str) -> dict:
    """The reference solution block, run as the solution notebook runs it."""
    return solution_namespace("05_problem_diagnosis", exercise_id, np=np, random=random)


def test_the_exercises_are_registered_for_notebook_05():
    for ex_id in ("nonfinite_ranks", "seed_everything", "early_stop_together"):
        assert check.EXERCISES[ex_id].notebook == "05"


# ------------------------------------------------------------------------------ nonfinite_ranks


def test_nonfinite_ranks_solution_passes():
    verdict = diagnosis.nonfinite_ranks(solved("nonfinite_ranks")["my_nonfinite_ranks"])
    assert verdict, verdict
    assert "the same, right list on every rank" in verdict.detail


def test_labkits_nonfinite_ranks_passes_its_own_check():
    assert diagnosis.nonfinite_ranks(diagnose.nonfinite_ranks)


def only_my_own(value):
    return [dist.get_rank()] if not torch.isfinite(value).all() else []


def test_nonfinite_ranks_wrong_each_rank_looks_only_at_its_own():
    verdict = diagnosis.nonfinite_ranks(only_my_own)
    assert not verdict and "the ranks disagree: rank 0 said [], rank 1 said [1]" in verdict.detail
    assert "tensor of world_size flags" in verdict.hint


def isnan_only(value):
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = float(torch.isnan(value).any())
    dist.all_reduce(flags)
    return [r for r in range(len(flags)) if flags[r] > 0]


def test_nonfinite_ranks_wrong_isnan_misses_inf():
    verdict = diagnosis.nonfinite_ranks(isnan_only)
    assert not verdict and "inf on rank 0: every rank said [], expected [0]" in verdict.detail
    assert "torch.isnan misses inf" in verdict.hint


def reduces_the_loss_itself(value):
    dist.all_reduce(value)  # NaN spreads: every rank knows, none can say where
    return [] if torch.isfinite(value).all() else list(range(dist.get_world_size()))


def test_nonfinite_ranks_wrong_all_reduce_of_the_loss_in_place():
    verdict = diagnosis.nonfinite_ranks(reduces_the_loss_itself)
    assert not verdict and "changed the value it was given" in verdict.detail
    assert "all_reduce works in place" in verdict.hint


def one_flag_for_all(value):
    flag = torch.tensor([float(not torch.isfinite(value).all())])
    dist.all_reduce(flag)
    return list(range(dist.get_world_size())) if flag.item() else []


def test_nonfinite_ranks_wrong_one_flag_cannot_name_the_rank():
    verdict = diagnosis.nonfinite_ranks(one_flag_for_all)
    assert not verdict and "NaN on rank 1: every rank said [0, 1], expected [1]" in verdict.detail
    assert "one flag per rank" in verdict.hint


def test_nonfinite_ranks_wrong_a_count_instead_of_a_list():
    verdict = diagnosis.nonfinite_ranks(lambda value: 0)
    assert not verdict and "not a list of ranks" in verdict.detail


def a_mask(value):
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = float(not torch.isfinite(value).all())
    dist.all_reduce(flags)
    return [bool(f) for f in flags]


def test_nonfinite_ranks_wrong_a_mask_instead_of_rank_numbers():
    verdict = diagnosis.nonfinite_ranks(a_mask)
    assert not verdict and "a mask, not rank numbers" in verdict.detail


def two_ranks_assumed(value):
    """Right on 2 ranks: the other rank is 1 - rank, one flag each way."""
    mine = torch.tensor([float(not torch.isfinite(value).all())])
    theirs = torch.empty(1)
    other = 1 - dist.get_rank()
    for work in (dist.isend(mine, other), dist.irecv(theirs, other)):
        work.wait()
    flags = {dist.get_rank(): mine.item(), other: theirs.item()}
    return [r for r in sorted(flags) if flags[r] > 0]


def test_nonfinite_ranks_wrong_two_ranks_assumed_shows_on_4():
    verdict = diagnosis.nonfinite_ranks(two_ranks_assumed, timeout=5.0)  # passes on 2 ranks
    assert not verdict and "still running after 5 s (rank 2: waits in isend" in verdict.detail
    assert verdict.hint.startswith("ranks 2, 3 waited in a collective")


def isnan_or_isinf_per_dtype(value):
    """Valid, written another way: all_gather of one flag per rank, NaN and inf tested apart."""
    bad = torch.tensor([float(bool(torch.isnan(value).any() or torch.isinf(value).any()))])
    flags = [torch.empty(1) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, bad)
    return [r for r, f in enumerate(flags) if f.item()]


def test_nonfinite_ranks_written_another_way_passes_on_2_and_4_ranks():
    verdict = diagnosis.nonfinite_ranks(isnan_or_isinf_per_dtype)
    assert verdict and "on 2 and 4 ranks" in verdict.detail and "bfloat16" in verdict.detail


def test_nonfinite_ranks_wrong_the_last_rank_left_out():
    def all_but_last(value):
        flags = torch.zeros(dist.get_world_size())
        flags[dist.get_rank()] = float(not torch.isfinite(value).all())
        dist.all_reduce(flags)
        return [r for r in range(len(flags) - 1) if flags[r] > 0]  # one short

    verdict = diagnosis.nonfinite_ranks(all_but_last)
    assert not verdict and "NaN on rank 1: every rank said [], expected [1]" in verdict.detail


def test_nonfinite_ranks_takes_rank_numbers_as_a_tensor():
    def as_tensor(value):
        flags = torch.zeros(dist.get_world_size())
        flags[dist.get_rank()] = float(not torch.isfinite(value).all())
        dist.all_reduce(flags)
        return torch.nonzero(flags).flatten()

    assert diagnosis.nonfinite_ranks(as_tensor)


def test_the_placeholder_is_not_run():
    def untouched(value):
        raise NotImplementedError("your code here")  # the exercise cell as the learner finds it

    for grader in (diagnosis.nonfinite_ranks, diagnosis.seed_everything,
                   diagnosis.early_stop_together):
        verdict = grader(untouched)
        assert not verdict and "not written yet" in verdict.detail


# ------------------------------------------------------------------------------ seed_everything


def test_seed_everything_solution_passes_on_2_and_4_ranks():
    verdict = diagnosis.seed_everything(solved("seed_everything")["my_seed_everything"])
    assert verdict, verdict
    assert "on 2 and 4 ranks, two runs gave bit-identical weights on every rank" in verdict.detail


def test_labkits_make_deterministic_passes_with_seed_plus_rank():
    assert diagnosis.seed_everything(lambda seed, rank: diagnose.make_deterministic(seed + rank))


def no_numpy(seed, rank):
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    torch.use_deterministic_algorithms(True)


def test_seed_everything_wrong_numpy_not_seeded():
    verdict = diagnosis.seed_everything(no_numpy)
    assert not verdict and "numpy's generator gave other numbers" in verdict.detail
    assert "np.random.seed" in verdict.hint


def same_seed_everywhere(seed, rank):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)


def test_seed_everything_wrong_the_same_seed_on_every_rank():
    verdict = diagnosis.seed_everything(same_seed_everywhere)
    assert not verdict and "on 2 ranks, every rank drew the same numbers from random" \
        in verdict.detail
    assert "seed + rank" in verdict.hint


def test_seed_everything_wrong_the_same_seed_on_all_4_ranks():
    verdict = diagnosis.seed_everything(same_seed_everywhere, worlds=(4,))
    assert not verdict and "on 4 ranks, every rank drew the same numbers from random: every " \
        "rank got the same seed" in verdict.detail
    assert "seed + rank" in verdict.hint


def seed_plus_rank_mod_2(seed, rank):
    """Right on 2 ranks; on 4, ranks 0 and 2 (and 1 and 3) share a seed, as local ranks do."""
    random.seed(seed + rank % 2)
    np.random.seed(seed + rank % 2)
    torch.manual_seed(seed + rank % 2)
    torch.use_deterministic_algorithms(True)


def test_seed_everything_wrong_a_seed_that_repeats_across_4_ranks():
    verdict = diagnosis.seed_everything(seed_plus_rank_mod_2)  # passes on 2 ranks
    assert not verdict and ("on 4 ranks, ranks 0 and 2 drew the same numbers from random (and "
                            "1 and 3 too): they got the same seed") in verdict.detail
    assert "from its global rank, 0 to 3" in verdict.hint and "rank % 2" in verdict.hint


def seed_times_rank(seed, rank):
    """Each rank its own stream, but rank 0's is seed * 0 = 0 whatever the seed."""
    random.seed(seed * rank)
    np.random.seed(seed * rank)
    torch.manual_seed(seed * rank)
    torch.use_deterministic_algorithms(True)


def test_seed_everything_wrong_rank_0_ignores_the_seed():
    verdict = diagnosis.seed_everything(seed_times_rank, worlds=(4,))
    assert not verdict and ("on 4 ranks, seed 1234 and seed 1235 gave rank 0 the same weights"
                            in verdict.detail)
    assert "rank 0's seed does not depend on the seed argument" in verdict.hint


def seeded_by_seed_sequence(seed, rank):
    """Valid, written another way: one SeedSequence per (seed, rank), not seed + rank."""
    state = np.random.SeedSequence([seed, rank]).generate_state(3)
    random.seed(int(state[0]))
    np.random.seed(int(state[1]))
    torch.manual_seed(int(state[2]))
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def test_seed_everything_written_another_way_passes_on_2_and_4_ranks():
    verdict = diagnosis.seed_everything(seeded_by_seed_sequence)
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def seeds_only(seed, rank):
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def test_seed_everything_wrong_no_deterministic_algorithms():
    verdict = diagnosis.seed_everything(seeds_only)
    assert not verdict and "are_deterministic_algorithms_enabled() is False" in verdict.detail
    assert "torch.use_deterministic_algorithms(True)" in verdict.hint


def a_seed_of_its_own(seed, rank):  # seed unused: 7 always
    random.seed(7 + rank)
    np.random.seed(7 + rank)
    torch.manual_seed(7 + rank)
    torch.use_deterministic_algorithms(True)


def test_seed_everything_wrong_the_seed_argument_ignored():
    verdict = diagnosis.seed_everything(a_seed_of_its_own)
    assert not verdict and "seed 1234 and seed 1235 gave the same weights" in verdict.detail
    assert "use the seed argument" in verdict.hint


# -------------------------------------------------------------------------- early_stop_together


def test_early_stop_together_solution_passes_on_2_and_4_ranks():
    verdict = diagnosis.early_stop_together(solved("early_stop_together")["my_early_stopping"])
    assert verdict, verdict
    assert "on 2 ranks every rank stopped after 8 epochs" in verdict.detail
    assert "on 4 ranks every rank stopped after 4 epochs" in verdict.detail


def test_labkits_fixed_job_passes():
    assert diagnosis.early_stop_together(functools.partial(diagnose.early_stopping, fixed=True))


def stop_when_any_rank_wants(epochs=10, patience=1):
    """The job with a stop flag all-reduced with MAX: no hang, but it stops too early."""
    return job(epochs, patience, stop=dist.ReduceOp.MAX)


def test_early_stop_together_wrong_any_rank_stops_every_rank():
    verdict = diagnosis.early_stop_together(stop_when_any_rank_wants)
    assert not verdict and "on 2 ranks: every rank stopped after 5 epochs" in verdict.detail
    assert "best at epoch 6, so with patience=1 the job stops after 8" in verdict.detail
    assert "a stop flag all-reduced with MAX" in verdict.hint


def test_early_stop_together_wrong_any_rank_stops_every_rank_on_4_ranks():
    verdict = diagnosis.early_stop_together(stop_when_any_rank_wants, worlds=(4,))
    assert not verdict and "on 4 ranks: every rank stopped after 3 epochs" in verdict.detail
    assert "best at epoch 2, so with patience=1 the job stops after 4" in verdict.detail
    assert "a stop flag all-reduced with MAX" in verdict.hint


def summed_not_averaged(epochs=10, patience=1):
    """The fixed job, but the per-rank mean losses summed over the ranks: world times the loss."""
    out = diagnose.early_stopping(epochs, patience=patience, fixed=True)
    return {"epochs": out["epochs"], "val": [dist.get_world_size() * v for v in out["val"]]}


def test_early_stop_together_wrong_summed_not_averaged():
    verdict = diagnosis.early_stop_together(summed_not_averaged)
    assert not verdict and "on 2 ranks: right epoch, but the validation losses are 2x labkit's" \
        in verdict.detail
    assert "all_reduce sums" in verdict.hint


def test_early_stop_together_wrong_summed_not_averaged_on_4_ranks():
    verdict = diagnosis.early_stop_together(summed_not_averaged, worlds=(4,))
    assert not verdict and "validation losses are 4x labkit's" in verdict.detail
    assert "all_reduce sums" in verdict.hint


def stops_too_early(epochs=10, patience=1):
    out = diagnose.early_stopping(epochs, patience=0, fixed=True)
    return out


def test_early_stop_together_wrong_stops_before_the_loss_over_all_ranks_does():
    verdict = diagnosis.early_stop_together(stops_too_early)
    assert not verdict and "every rank stopped after 7 epochs" in verdict.detail
    assert "best at epoch 6" in verdict.detail and "is patience still used" in verdict.hint


def job(epochs=10, patience=1, *, loss=None, stop=None, join=False):
    """The job, its validation loss shared by ``loss(val, n)`` (None: this shard's own), the stop
    flag all-reduced with ``stop`` (a ReduceOp), or, ``join``, ranks that have stopped answering
    the others' gradient all-reduces with zeros until every rank has (each its own epochs)."""
    import torch.nn.functional as F

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 4, generator=gen)
    y = x.sum(1, keepdim=True)
    val_x = torch.randn(32 + 16 * (rank % 2), 4, generator=gen)
    val_y = val_x.sum(1, keepdim=True) * (1 - 0.5 * rank)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    best, worse, history, done = float("inf"), 0, [], False
    for _ in range(epochs):
        if join:
            training = torch.tensor([float(not done)])
            dist.all_reduce(training)
            if not training.item():
                break
        model.zero_grad()
        if not done:
            F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(grad)
                p -= 0.1 * grad / dist.get_world_size()
            val = F.mse_loss(model(val_x), val_y)
        if done:
            continue
        if loss is not None:
            val = loss(val, len(val_x))
        history.append(round(float(val), 5))
        worse = 0 if float(val) < best else worse + 1
        best = min(best, float(val))
        want = worse > patience
        if stop is not None:
            flag = torch.tensor([float(want)])
            dist.all_reduce(flag, op=stop)
            want = bool(flag.item())
        if want and join:
            done = True
        elif want:
            break
    return {"epochs": len(history), "val": history}


def sum_and_count(val, n):
    """The reference's route: one all-reduce of a 2-element tensor."""
    total = torch.stack([val * n, torch.tensor(float(n))])
    dist.all_reduce(total)
    return total[0] / total[1]


def two_scalars(val, n):
    """Valid, written another way: the sum and the count in two scalar all-reduces."""
    total, count = val * n, torch.tensor(float(n))
    dist.all_reduce(total)
    dist.all_reduce(count)
    return total / count


def gathers_every_loss(val, n):
    """Right values, but every rank's loss sum and count gathered on every rank."""
    pairs = [torch.empty(2) for _ in range(dist.get_world_size())]
    dist.all_gather(pairs, torch.stack([val * n, torch.tensor(float(n))]))
    total = torch.stack(pairs).sum(0)
    return total[0] / total[1]


def mean_of_means(val, n):
    """One all-reduce, the route is right, but the ranks' own means averaged: the shards differ
    in size (32 and 48 samples), so the loss is not the one over every sample."""
    val = val.clone()
    dist.all_reduce(val)
    return val / dist.get_world_size()


def twice(val, n):
    """The right all-reduce, made twice: once for the history, once more for the decision."""
    sum_and_count(val, n)
    return sum_and_count(val, n)


def test_early_stop_together_wrong_mean_of_the_ranks_means():
    verdict = diagnosis.early_stop_together(functools.partial(job, loss=mean_of_means))
    assert not verdict and ("on 2 ranks: the validation losses are the mean of the ranks' own "
                            "means") in verdict.detail
    assert "stopped after 9 epochs (labkit's job: 8)" in verdict.detail
    assert "the shards hold 32, 48 samples" in verdict.hint


def test_early_stop_together_wrong_mean_of_the_ranks_means_on_4_ranks():
    """On 4 ranks the epoch comes out right; only the losses tell."""
    verdict = diagnosis.early_stop_together(functools.partial(job, loss=mean_of_means),
                                            worlds=(4,))
    assert not verdict and "stopped after 4 epochs (labkit's job: 4)" in verdict.detail
    assert "the shards hold 32, 48, 32, 48 samples" in verdict.hint


def test_early_stop_together_written_with_two_scalar_all_reduces_passes():
    verdict = diagnosis.early_stop_together(functools.partial(job, loss=two_scalars))
    assert verdict and "on 4 ranks every rank stopped after 4 epochs" in verdict.detail


def _calls_of_both(fn):
    from labkit.parallel import traffic

    with traffic.count_traffic() as ours:
        diagnose.early_stopping(epochs=10, patience=1, fixed=True)
    with traffic.count_traffic() as theirs:
        fn(epochs=10, patience=1)
    return [[(c.op, c.payload_bytes) for c in t.calls] for t in (ours, theirs)]


def test_early_stop_together_the_bound_rests_on_labkits_route():
    """Per epoch, labkit's job all-reduces the gradients (16 + 4 bytes) and 8 for the validation,
    as the solution's job does: the grader's bound is measured against that."""
    ours, theirs = check.on_ranks(_calls_of_both, solved("early_stop_together")
                                  ["my_early_stopping"], nproc=4)[0]
    assert ours == theirs == [("all_reduce", 16), ("all_reduce", 4), ("all_reduce", 8)] * 4


def test_early_stop_together_wrong_per_shard_decisions_on_4_ranks():
    verdict = diagnosis.early_stop_together(functools.partial(job, join=True), worlds=(4,))
    assert not verdict and ("on 4 ranks: rank 0 trained 10 epochs, rank 1 trained 6, rank 2 "
                            "trained 3, rank 3 trained 3") in verdict.detail
    assert "the stop decision must come out the same on every rank" in verdict.hint


def test_early_stop_together_wrong_route_all_gather_of_every_loss():
    verdict = diagnosis.early_stop_together(functools.partial(job, loss=gathers_every_loss),
                                            worlds=(4,))
    assert not verdict and ("on 4 ranks: right epochs and losses, but rank 0 gathered every "
                            "rank's values (4 gathers, 128 bytes)") in verdict.detail
    assert "a gather of every rank's losses" in verdict.hint and "one all_reduce" in verdict.hint


def test_early_stop_together_wrong_route_the_all_reduce_made_twice():
    verdict = diagnosis.early_stop_together(functools.partial(job, loss=twice), worlds=(4,))
    assert not verdict and ("on 4 ranks: right epochs and losses, but rank 0 all-reduced 16 "
                            "bytes per epoch for the validation, beyond the gradients' 20, where "
                            "8 carry") in verdict.detail
    assert "is the same all-reduce made twice" in verdict.hint


def test_early_stop_together_wrong_stop_only_when_every_rank_wants():
    verdict = diagnosis.early_stop_together(functools.partial(job, stop=dist.ReduceOp.MIN))
    assert not verdict and "on 2 ranks: every rank stopped after 10 epochs" in verdict.detail
    assert "a stop flag all-reduced with MIN" in verdict.hint


def test_early_stop_together_wrong_answer_shape():
    verdict = diagnosis.early_stop_together(lambda epochs, patience: 9)
    assert not verdict and "return the dict the job returns" in verdict.hint


# ---- the answers that hang: each costs its timeout, and the next check a fresh pool -----------


def test_early_stop_together_wrong_the_job_as_it_was_hangs():
    verdict = diagnosis.early_stop_together(diagnose.early_stopping, timeout=HANG_S)
    assert not verdict and "on 2 ranks: the ranks were still running after 3 s" in verdict.detail
    assert "rank 0 still waits in a collective, and rank 1 had left" in verdict.hint
    assert "the stop decision must come out the same on every rank" in verdict.hint.lower()


def test_early_stop_together_wrong_the_job_as_it_was_hangs_on_4_ranks():
    verdict = diagnosis.early_stop_together(diagnose.early_stopping, timeout=HANG_S, worlds=(4,))
    assert not verdict and "on 4 ranks: the ranks were still running after 3 s" in verdict.detail
    assert "ranks 0, 1 still wait in a collective, and ranks 2, 3 had left" in verdict.hint


def reduce_only_when_bad(value):
    if torch.isfinite(value).all():
        return []
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = 1
    dist.all_reduce(flags)  # only the ranks with a NaN get here
    return [r for r in range(len(flags)) if flags[r] > 0]


def test_nonfinite_ranks_wrong_a_collective_only_on_the_bad_rank_hangs():
    verdict = diagnosis.nonfinite_ranks(reduce_only_when_bad, timeout=HANG_S)
    assert not verdict and "still running after 3 s" in verdict.detail
    assert re.search(r"rank [01] waited in a collective that another rank never called",
                     verdict.hint)
    assert "call it on every rank, every time, finite or not" in verdict.hint

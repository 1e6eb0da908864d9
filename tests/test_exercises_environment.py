"""Notebook 00's graders: the reference solutions pass, typical wrong answers get their hints."""

import pytest

from labkit import exercises
from labkit.exercises import environment


@pytest.fixture(autouse=True)
def _own_progress_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))


@pytest.fixture(scope="module")
def solved():
    """The names that solutions/00_environment_check.py's blocks define (they import nothing)."""
    names = {}
    for block in exercises.solution_blocks("00_environment_check").values():
        exec(block, names)
    return names


# ---- first_allreduce (on two real ranks) --------------------------------------------------------

def test_first_allreduce_solution_passes(solved):
    verdict = environment.first_allreduce(solved["my_allreduce"])
    assert verdict, verdict
    assert "[3.0, 3.0]" in verdict.detail


def own_value(x):
    return x


def reduce_to_rank_0(x):
    import torch.distributed as dist

    dist.reduce(x, dst=0)
    return x


def maximum(x):
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def mean(x):
    import torch.distributed as dist

    dist.all_reduce(x)
    return x / dist.get_world_size()


def returns_what_all_reduce_returns(x):
    import torch.distributed as dist

    return dist.all_reduce(x)


def twice(x):
    import torch.distributed as dist

    dist.all_reduce(x)
    dist.all_reduce(x)
    return x


def only_rank_0_calls(x):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(x)
    return x


@pytest.mark.parametrize("answer, said", [
    (own_value, "each rank kept its own value"),
    (reduce_to_rank_0, "only rank 0 holds the sum"),
    (maximum, "that is the maximum"),
    (mean, "that is the mean"),
    (returns_what_all_reduce_returns, "end with `return x`"),
    (twice, "all-reduced twice"),
])
def test_first_allreduce_wrong_answers_get_their_hint(answer, said):
    verdict = environment.first_allreduce(answer)
    assert not verdict
    assert said in verdict.hint, verdict


def gathered_and_added(x):
    """Right values, another route: every rank's x gathered, then added up."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return torch.stack(parts).sum(0)


def summed_twice_then_halved(x):
    """Right values, another route: errors that cancel (a sum of sums, divided)."""
    import torch.distributed as dist

    dist.all_reduce(x)
    dist.all_reduce(x)
    return x / dist.get_world_size()


def test_first_allreduce_wrong_route_with_right_values():
    verdict = environment.first_allreduce(gathered_and_added)
    assert not verdict and "the right sum, but through ['all_gather']" in verdict.detail
    assert "dist.all_reduce(x), one call" in verdict.hint
    verdict = environment.first_allreduce(summed_twice_then_halved)
    assert not verdict and "with 2 all_reduce calls" in verdict.detail


def test_first_allreduce_written_another_way_passes():
    def out_of_place(x):
        import torch.distributed as dist

        y = x.clone()  # all-reduce a copy, return the copy
        work = dist.all_reduce(y, op=dist.ReduceOp.SUM, async_op=True)
        work.wait()
        return y

    verdict = environment.first_allreduce(out_of_place)
    assert verdict and "on 4 ranks" in verdict.detail


def test_first_allreduce_wrong_collective_on_one_rank_is_a_hang_with_a_hint(monkeypatch):
    monkeypatch.setattr(environment, "on_ranks", _quick(environment.on_ranks))
    verdict = environment.first_allreduce(only_rank_0_calls)
    assert not verdict and "same collectives in the same order" in verdict.hint


def _quick(on_ranks):
    """on_ranks with a short timeout: a hang is detected in seconds."""
    def run(*args, timeout=30, **kwargs):
        return on_ranks(*args, timeout=5, **kwargs)
    return run


def test_first_allreduce_placeholder_is_not_written_yet():
    def my_allreduce(x):
        raise NotImplementedError("your code here")

    verdict = environment.first_allreduce(my_allreduce)
    assert not verdict and "not written yet" in verdict.detail


# ---- busbw_from_algbw ---------------------------------------------------------------------------

def test_busbw_from_algbw_solution_passes(solved):
    assert environment.busbw_from_algbw(solved["my_busbw"])


def test_busbw_from_algbw_written_another_way_passes():
    """The factor as 2 - 2/n, a lookup by nothing but arithmetic: n = 1 still gives 0."""
    assert environment.busbw_from_algbw(lambda algbw, n: algbw * (2 - 2 / n))


@pytest.mark.parametrize("answer, said", [
    (lambda algbw, n: algbw, "the 2(n-1)/n factor is missing"),
    (lambda algbw, n: algbw * (n - 1) / n, "counts the reduce-scatter only"),
    (lambda algbw, n: algbw * n, "n is not the factor"),
    (lambda algbw, n: algbw * 2 * (n - 1), "divide by n"),
    (lambda algbw, n: algbw * n / (2 * (n - 1)) if n > 1 else 0.0, "upside down"),
    (lambda algbw, n: algbw * 2 * (n - 1) / n if n > 1 else algbw, "busbw of 0"),
])
def test_busbw_from_algbw_wrong_factor_gets_its_hint(answer, said):
    verdict = environment.busbw_from_algbw(answer)
    assert not verdict and said in verdict.hint, verdict


# ---- ring_allreduce_seconds ---------------------------------------------------------------------

def test_ring_allreduce_seconds_solution_passes(solved):
    assert environment.ring_allreduce_seconds(solved["my_ring_seconds"])


def test_ring_allreduce_seconds_step_by_step_passes():
    """Each of the 2(n-1) steps added up, in bytes per second: the same time, counted."""
    def seconds(nbytes, n, alpha_s, bandwidth_GBps):
        chunk, per_s = nbytes / n, bandwidth_GBps * 1e9
        return sum(alpha_s + chunk / per_s for _ in range(2 * (n - 1)))

    assert environment.ring_allreduce_seconds(seconds)


def right(s, n, a, b):
    return 2 * (n - 1) * (a + s / n / (b * 1e9))


@pytest.mark.parametrize("answer, said", [
    (lambda s, n, a, b: 2 * (n - 1) * (s / n / (b * 1e9)), "latency term is missing"),
    (lambda s, n, a, b: (n - 1) * (a + s / n / (b * 1e9)), "reduce-scatter's n-1 steps"),
    (lambda s, n, a, b: 2 * (n - 1) * (a + s / (b * 1e9)), "not the whole message"),
    (lambda s, n, a, b: 2 * (n - 1) * a + s / (b * 1e9), "one copy of the message"),
    (lambda s, n, a, b: 2 * (n - 1) * (a + s / n / b), "bandwidth_GBps is in GB/s"),
    (lambda s, n, a, b: 2 * (n - 1) * a + 2 * (n - 1) * s / n / (b * 1e9) + (a if n == 1 else 0),
     "with one rank nothing is sent"),
])
def test_ring_allreduce_seconds_wrong_formula_gets_its_hint(answer, said):
    verdict = environment.ring_allreduce_seconds(answer)
    assert not verdict and said in verdict.hint, verdict
    assert environment.ring_allreduce_seconds(right)

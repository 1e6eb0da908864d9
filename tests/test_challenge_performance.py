"""Notebook 04's challenge (one PowerSGD step with error feedback): the solution passes on 2 and
4 ranks, known wrong answers (right values by a wrong route among them) get their hints, and a
valid answer written another way passes."""

from __future__ import annotations

import sys

import cloudpickle
import torch
import torch.distributed as dist

from labkit import check
from labkit.exercises import performance as exercise

from .fakes import solution_namespace

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # wrong answers travel to the ranks


def _solution():
    return solution_namespace("04_performance_tuning", "powersgd_step")["my_powersgd"]


def _powersgd(grad, q, error, *, feedback=True, divide=True, orth=True, reduce_q=True,
              keep_q=False):
    """PowerSGD with one mistake switched on."""
    world = dist.get_world_size()
    m = grad + error if feedback else grad
    p = m @ q
    dist.all_reduce(p)
    if divide:
        p /= world
    if orth:
        p = torch.linalg.qr(p).Q
    new_q = m.T @ p
    if reduce_q:
        dist.all_reduce(new_q)
        if divide:
            new_q /= world
    approx = p @ new_q.T
    return approx, q.clone() if keep_q else new_q, m - approx


def test_powersgd_step_solution_passes_on_2_and_4_ranks():
    verdict = exercise.powersgd_step(_solution())
    assert verdict and "on 2 and 4 ranks" in verdict.detail


def test_powersgd_step_untouched_is_not_written_yet():
    def my_powersgd(grad, q, error):
        raise NotImplementedError(check.PLACEHOLDER)

    assert "not written yet" in exercise.powersgd_step(my_powersgd).detail


def _whole_matrix(grad, q, error):
    world = dist.get_world_size()
    m = grad + error
    mean = m.clone()
    dist.all_reduce(mean)
    mean /= world
    p = torch.linalg.qr(mean @ q).Q
    new_q = mean.T @ p
    approx = p @ new_q.T
    return approx, new_q, m - approx


def test_powersgd_step_wrong_route_all_reduce_of_the_whole_matrix():
    verdict = exercise.powersgd_step(_whole_matrix, worlds=(2,))
    assert not verdict and "it all-reduced 24 numbers, the whole matrix" in verdict.detail
    assert verdict.hint.startswith("PowerSGD's point is to send (n + m) r = 10 numbers")


def _q_not_reduced(grad, q, error):
    return _powersgd(grad, q, error, reduce_q=False)


def test_powersgd_step_wrong_new_q_not_all_reduced():
    verdict = exercise.powersgd_step(_q_not_reduced, worlds=(4,))
    assert not verdict and "the approximation is of this rank's M, not the mean" in verdict.detail
    assert verdict.hint.startswith("all-reduce new_q = M.T @ P too")


def _not_orthonormal(grad, q, error):
    return _powersgd(grad, q, error, orth=False)


def test_powersgd_step_wrong_p_not_orthonormal():
    verdict = exercise.powersgd_step(_not_orthonormal, worlds=(2,))
    assert not verdict and "P was not made orthonormal" in verdict.detail


def _summed(grad, q, error):
    return _powersgd(grad, q, error, divide=False)


def test_powersgd_step_wrong_sum_not_mean():
    verdict = exercise.powersgd_step(_summed, worlds=(2,))
    assert not verdict and "the approximation is 2x the mean gradient's" in verdict.detail


def _no_feedback(grad, q, error):
    return _powersgd(grad, q, error, feedback=False)


def test_powersgd_step_wrong_no_error_feedback():
    verdict = exercise.powersgd_step(_no_feedback, worlds=(2,))
    assert not verdict and "step 2" in verdict.detail
    assert verdict.hint.startswith("the error from the last step is part of M")


def _old_q(grad, q, error):
    return _powersgd(grad, q, error, keep_q=True)


def test_powersgd_step_wrong_returns_the_old_q():
    verdict = exercise.powersgd_step(_old_q, worlds=(2,))
    assert not verdict and "new_q is the q it was given" in verdict.detail


def _gram_schmidt(grad, q, error):
    """Valid, written differently: Gram-Schmidt by hand, each factor divided before its sum."""
    world = dist.get_world_size()
    m = grad + error
    p = (m @ q) / world
    dist.all_reduce(p)
    cols = []
    for j in range(p.shape[1]):
        v = p[:, j].clone()
        for u in cols:
            v -= (u @ v) * u
        cols.append(v / v.norm())
    p = torch.stack(cols, dim=1)
    new_q = (m.T @ p) / world
    dist.all_reduce(new_q)
    approx = p @ new_q.T
    return approx, new_q, m - approx


def test_powersgd_step_valid_gram_schmidt_passes():
    assert exercise.powersgd_step(_gram_schmidt)

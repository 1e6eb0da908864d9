"""Notebook 09's expert_dispatch grader: the solution passes, known wrong answers get their hint.

Wrong answers are caught on the local cases, before any rank starts; the solution runs on 2
and 4 warm gloo ranks.
"""

from __future__ import annotations

import sys

import cloudpickle
import torch

from labkit.exercises import sequence_context_expert as exercise
from labkit.exercises.sequence_context_expert import expert as expert_module

from .fakes import solution_namespace

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEM = "09_sequence_context_expert"


def _solution(block: str, name: str):
    """``name`` as solution ``block`` defines it, exec'd as the notebook would."""
    return solution_namespace(STEM, block)[name]


def test_expert_dispatch_solution_passes_on_2_and_4_ranks():
    verdict = exercise.expert_dispatch(_solution("expert_dispatch", "my_dispatch"))
    assert verdict, verdict
    assert "on 2 and 4 gloo ranks" in verdict.detail and "dropped" in verdict.detail


def test_expert_dispatch_is_registered_for_notebook_09():
    from labkit.check import EXERCISES

    ex = EXERCISES["expert_dispatch"]
    assert ex.notebook == "09" and ex.grader == "expert_dispatch"
    assert ex.title == "the permutation that sends each token to its expert's rank"
    assert "expert_dispatch" in expert_module.__all__ and expert_module.NOTEBOOK == "09"


def test_expert_dispatch_wrong_counts_per_expert():
    def per_expert(expert_index, n_experts, world_size):
        order = torch.argsort(expert_index, stable=True)
        return order, torch.bincount(expert_index, minlength=n_experts).tolist()

    verdict = exercise.expert_dispatch(per_expert)
    assert not verdict and "counts per expert instead of per rank" in verdict.hint


def test_expert_dispatch_wrong_not_sorted():
    def by_token(expert_index, n_experts, world_size):
        per_rank = n_experts // world_size
        counts = torch.bincount(expert_index // per_rank, minlength=world_size).tolist()
        return torch.arange(len(expert_index)), counts

    verdict = exercise.expert_dispatch(by_token)
    assert not verdict and "you forgot to sort" in verdict.hint
    assert "is the token order" in verdict.detail


def test_expert_dispatch_wrong_unstable_sort():
    def newest_first(expert_index, n_experts, world_size):
        per_rank = n_experts // world_size
        n = len(expert_index)
        # by expert, but the latest token first within an expert: a valid grouping, another
        # choice of which tokens a full expert keeps
        order = torch.argsort(expert_index * n + (n - 1 - torch.arange(n)))
        return order, torch.bincount(expert_index // per_rank, minlength=world_size).tolist()

    verdict = exercise.expert_dispatch(newest_first)
    assert not verdict and "unstable sort" in verdict.hint and "stable=True" in verdict.hint


def test_expert_dispatch_wrong_counts_do_not_sum_to_the_tokens():
    def tokens_not_rows(expert_index, n_experts, world_size):
        per_rank = n_experts // world_size
        order = torch.argsort(expert_index, stable=True)
        counts = torch.bincount(expert_index // per_rank, minlength=world_size)
        return order, (counts // 2).tolist()  # halved: counted tokens, not (token, slot) rows

    verdict = exercise.expert_dispatch(tokens_not_rows)
    assert not verdict and "must sum to the number of rows" in verdict.hint


def test_expert_dispatch_wrong_modulo_rank_mapping():
    def modulo(expert_index, n_experts, world_size):
        dest = expert_index % world_size  # round-robin placement: not how the ranks hold them
        order = torch.argsort(dest * n_experts + expert_index, stable=True)
        return order, torch.bincount(dest, minlength=world_size).tolist()

    verdict = exercise.expert_dispatch(modulo)
    assert not verdict and "off-by-one rank mapping" in verdict.hint
    assert "expert // (n_experts // world_size), not expert % world_size" in verdict.hint


def test_expert_dispatch_wrong_grouped_by_rank_only():
    def by_rank(expert_index, n_experts, world_size):
        dest = expert_index // (n_experts // world_size)
        return torch.argsort(dest, stable=True), torch.bincount(dest,
                                                                minlength=world_size).tolist()

    verdict = exercise.expert_dispatch(by_rank)
    assert not verdict and "not by expert within a rank" in verdict.hint


def test_expert_dispatch_wrong_types_and_shapes():
    verdict = exercise.expert_dispatch(lambda e, n, w: torch.argsort(e, stable=True))
    assert not verdict and "return a pair: (order, send_counts)" in verdict.hint
    verdict = exercise.expert_dispatch(lambda e, n, w: (e.float(), [len(e)] + [0] * (w - 1)))
    assert not verdict and "1-D integer tensor (a LongTensor)" in verdict.hint
    verdict = exercise.expert_dispatch(lambda e, n, w: (torch.zeros_like(e), [0] * w))
    assert not verdict and "every row index exactly once" in verdict.hint


def test_expert_dispatch_placeholder_is_not_written_yet():
    def stub(expert_index, n_experts, world_size):
        raise NotImplementedError("your code here")

    verdict = exercise.expert_dispatch(stub)
    assert not verdict and "not written yet" in verdict.detail


def test_expert_dispatch_wrong_counts_stop_before_an_empty_last_rank():
    def no_minlength(expert_index, n_experts, world_size):
        order = torch.argsort(expert_index, stable=True)
        return order, torch.bincount(expert_index // (n_experts // world_size)).tolist()

    verdict = exercise.expert_dispatch(no_minlength)
    assert not verdict and "the last rank gets no token (4 experts on 2 ranks)" in verdict.detail
    assert "has 1 entries for 2 ranks" in verdict.detail
    assert "the last rank receives no rows" in verdict.hint and "minlength" in verdict.hint


def test_expert_dispatch_written_another_way_passes():
    def by_rank_then_expert(expert_index, n_experts, world_size):
        per_rank = n_experts // world_size
        dest = expert_index // per_rank
        n = len(expert_index)
        # a composite key sorted without stable=True: unique keys need no stability
        key = (dest * n_experts + expert_index) * n + torch.arange(n)
        counts = [int((dest == r).sum()) for r in range(world_size)]  # a list comprehension
        return torch.sort(key).indices, counts

    assert exercise.expert_dispatch(by_rank_then_expert)

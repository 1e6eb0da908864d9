"""Notebook 09's online-softmax merge grader: the solution passes, known mistakes get their hint.

The last stage runs ring attention with the learner's merge on 2 warm gloo ranks; the wrong
answers below are all caught by the local stage, before any rank starts.
"""

from __future__ import annotations

import sys

import cloudpickle
import torch

from labkit.exercises.sequence_context_expert import context as ex
from labkit.parallel.context import merge

from .fakes import solution_namespace

# The wrong answers below are shipped to ranks by value, as a notebook's functions are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEM = "09_sequence_context_expert"


def _solution(name: str):
    """The object the solution block of ``name`` defines, exec'd as the notebook would."""
    return solution_namespace(STEM, name)


def test_online_softmax_merge_solution_passes_locally_and_on_ranks():
    verdict = ex.online_softmax_merge(_solution("online_softmax_merge")["my_merge"])
    assert verdict, verdict
    assert "inside ring_attention on 2 and 4 gloo ranks" in verdict.detail


def test_online_softmax_merge_labkits_merge_passes():
    assert ex.online_softmax_merge(merge)


def test_online_softmax_merge_wrong_not_written_yet():
    def my_merge(out_a, lse_a, out_b, lse_b):
        raise NotImplementedError("your code here")

    verdict = ex.online_softmax_merge(my_merge)
    assert not verdict and "not written yet" in verdict.detail


def test_online_softmax_merge_wrong_average():
    def average(out_a, lse_a, out_b, lse_b):
        return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)

    verdict = ex.online_softmax_merge(average)
    assert not verdict and "that is the average of the two outputs" in verdict.hint
    assert "keys split 5 + 7" in verdict.detail


def test_online_softmax_merge_wrong_overflow_without_the_max():
    def naive(out_a, lse_a, out_b, lse_b):
        w_a, w_b = torch.exp(lse_a), torch.exp(lse_b)  # inf beyond lse = 88
        total = w_a + w_b
        return ((w_a / total).unsqueeze(-1) * out_a + (w_b / total).unsqueeze(-1) * out_b,
                torch.log(total))

    verdict = ex.online_softmax_merge(naive)
    assert not verdict and "large logits" in verdict.detail
    assert "exp(lse) overflows float32" in verdict.hint and "subtract the larger" in verdict.hint


def test_online_softmax_merge_wrong_not_renormalised():
    def unnormalised(out_a, lse_a, out_b, lse_b):
        m = torch.maximum(lse_a, lse_b)
        w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
        return (w_a.unsqueeze(-1) * out_a + w_b.unsqueeze(-1) * out_b,
                m + torch.log(w_a + w_b))

    verdict = ex.online_softmax_merge(unnormalised)
    assert not verdict and "weights do not sum to 1: renormalise" in verdict.hint


def test_online_softmax_merge_wrong_lse_with_max():
    def lse_max(out_a, lse_a, out_b, lse_b):
        out, _ = merge(out_a, lse_a, out_b, lse_b)
        return out, torch.maximum(lse_a, lse_b)

    verdict = ex.online_softmax_merge(lse_max)
    assert not verdict and "out right, but lse differs" in verdict.detail
    assert "lse combined with max instead of log-sum-exp" in verdict.hint


def test_online_softmax_merge_wrong_nan_when_a_side_is_minus_inf():
    def softplus_form(out_a, lse_a, out_b, lse_b):  # stable for large logits, but
        lse = lse_a + torch.nn.functional.softplus(lse_b - lse_a)  # -inf + inf = NaN
        w_a = torch.sigmoid(lse_a - lse_b)
        return w_a.unsqueeze(-1) * out_a + (1 - w_a).unsqueeze(-1) * out_b, lse

    verdict = ex.online_softmax_merge(softplus_form)
    assert not verdict and "NaN" in verdict.detail and "no keys" in verdict.detail
    assert "-inf - (-inf) is NaN" in verdict.hint


def test_online_softmax_merge_wrong_nan_when_both_sides_are_minus_inf():
    def logaddexp_form(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)  # right, but exp(-inf - -inf) is NaN below
        return (torch.exp(lse_a - lse).unsqueeze(-1) * out_a
                + torch.exp(lse_b - lse).unsqueeze(-1) * out_b, lse)

    verdict = ex.online_softmax_merge(logaddexp_form)
    assert not verdict and "sees no key on either side" in verdict.detail
    assert "shift by 0 instead of the max" in verdict.hint


def test_online_softmax_merge_wrong_weights_do_not_broadcast():
    def no_trailing_dim(out_a, lse_a, out_b, lse_b):
        _, lse = merge(out_a, lse_a, out_b, lse_b)
        return torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b, lse

    verdict = ex.online_softmax_merge(no_trailing_dim)
    assert not verdict and "shapes that do not broadcast" in verdict.hint
    assert "unsqueeze(-1)" in verdict.hint


def test_online_softmax_merge_wrong_lse_shape():
    def lse_keepdim(out_a, lse_a, out_b, lse_b):
        out, lse = merge(out_a, lse_a, out_b, lse_b)
        return out, lse.unsqueeze(-1)

    verdict = ex.online_softmax_merge(lse_keepdim)
    assert not verdict and "expected out (2, 3, 5, 8), lse (2, 3, 5)" in verdict.detail
    assert "one number per query row" in verdict.hint


def test_online_softmax_merge_wrong_returns_one_tensor():
    verdict = ex.online_softmax_merge(lambda out_a, lse_a, out_b, lse_b: out_a)
    assert not verdict and "return a pair of tensors: (out, lse)" in verdict.hint


def test_online_softmax_merge_written_with_logaddexp_passes_on_2_and_4_ranks():
    def logaddexp_merge(out_a, lse_a, out_b, lse_b):
        lse = torch.logaddexp(lse_a, lse_b)  # stable by itself; -inf where both sides are empty
        w_a = torch.nan_to_num(torch.exp(lse_a - lse), nan=0.0)  # -inf - -inf: no weight
        w_b = torch.nan_to_num(torch.exp(lse_b - lse), nan=0.0)
        return w_a[..., None] * out_a + w_b[..., None] * out_b, lse

    verdict = ex.online_softmax_merge(logaddexp_merge)
    assert verdict and "on 2 and 4 gloo ranks" in verdict.detail

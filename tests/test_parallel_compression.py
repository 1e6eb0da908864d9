"""labkit.parallel.compression: top-k with error feedback, local SGD, and their bytes."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from labkit import launch
from labkit.parallel.compression import METHODS, compressed_training, topk_compress

from .test_parallel_parameter_server import _data, _make

cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUMEL = 12 * 3 + 3  # _make's parameters


def test_topk_sends_the_largest_and_keeps_the_rest_for_later():
    grad, residual = torch.tensor([0.1, -3.0, 0.5, 2.0]), torch.tensor([0.0, 0.0, 2.0, 0.0])
    idx, values, left = topk_compress(grad, 2, residual)
    assert idx.tolist() == [1, 2] and values.tolist() == [-3.0, 2.5]  # 0.5 + 2.0 beats 2.0
    sent = torch.zeros(4).index_put_((idx,), values)
    assert torch.equal(sent + left, grad + residual)  # error feedback loses nothing
    idx, values, left = topk_compress(grad, 1)
    assert idx.tolist() == [1] and left is None  # without feedback the rest is dropped


@pytest.mark.parametrize("k", [0, 5])
def test_topk_k_must_fit_the_gradient(k):
    with pytest.raises(ValueError, match=r"k must be between 1 and the gradient's 4 entries"):
        topk_compress(torch.zeros(4), k)


@pytest.mark.parametrize("kwargs, match", [
    ({"method": "signsgd"}, "unknown method 'signsgd': use one of dense, topk, local_sgd"),
    ({"method": "topk", "ratio": 0}, "between 0 and 1"),
    ({"method": "topk", "ratio": 1.5}, "between 0 and 1"),
    ({"method": "local_sgd", "sync_every": 0}, "sync_every must be >= 1 step"),
])
def test_compressed_training_refuses_bad_settings(group, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compressed_training(_make, _data(), _data(), **kwargs)


def test_on_one_rank_every_method_is_plain_sgd(group):
    # Nothing to exchange: top-k of every entry, and local SGD, must equal dense exactly.
    data = _data()
    runs = [compressed_training(_make, data, data, steps=5, batch=8, **kwargs)
            for kwargs in ({"method": "dense"}, {"method": "topk", "ratio": 1.0},
                           {"method": "local_sgd", "sync_every": 2})]
    assert len({r["accuracy"] for r in runs}) == 1
    assert [r["bytes_per_rank"] for r in runs] == [5 * NUMEL * 4, 5 * NUMEL * 8, 3 * NUMEL * 4]


def _all_methods(data):
    return [compressed_training(_make, data, data, method=m, steps=20, batch=8, ratio=0.1,
                                sync_every=8) for m in METHODS]


def test_two_ranks_end_with_the_same_model_and_the_promised_bytes():
    values = launch(_all_methods, _data(), nproc=2, show_ranks=[], timeout=180, warm=True).values
    for method, a, b in zip(METHODS, *values, strict=True):
        assert a["method"] == b["method"] == method
        assert a["accuracy"] == b["accuracy"], method  # one model, whatever was exchanged
    fractions = [r["bytes_per_rank"] / r["dense_bytes"] for r in values[0]]
    k = int(0.1 * NUMEL)
    # dense: every step; top-k: k values + k indices of 4 bytes; local SGD: steps 8, 16, 20.
    assert fractions == pytest.approx([1.0, k * 8 / (NUMEL * 4), 3 / 20])

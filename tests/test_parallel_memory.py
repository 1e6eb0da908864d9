"""labkit.parallel.memory: the ZeRO arithmetic, FSDP2 bytes counted, activation checkpointing."""

from __future__ import annotations

import sys
from functools import partial

import cloudpickle
import pytest
import torch

from labkit import launch
from labkit.parallel.memory import (
    STRATEGIES,
    activation_memory,
    estimate_memory,
    forward_blocks,
    fsdp_memory,
    mlp_blocks,
)

from .conftest import cuda_gpus

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

GB = 1e9


def fsdp_checks() -> dict:
    """Run on every rank of one launch: even shards, uneven shards, mixed precision."""
    from functools import partial

    from labkit.parallel.memory import fsdp_memory, mlp_blocks

    return {"even": fsdp_memory(partial(mlp_blocks, 2, 16), steps=2),
            "uneven": fsdp_memory(partial(mlp_blocks, 1, 5)),  # 5 rows: 3 + 2 over 2 ranks
            "mixed": fsdp_memory(partial(mlp_blocks, 2, 16), mixed_precision=True)}


@pytest.fixture(scope="module")
def two_ranks():
    return launch(fsdp_checks, nproc=2, show_ranks=[], timeout=180, warm=True).values


# ---- estimate_memory -------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, params, grads, optimizer, total", [
    ("dp", 2, 2, 12, 16),
    ("zero1", 2, 2, 1.5, 5.5),      # 12 / 8
    ("zero2", 2, 0.25, 1.5, 3.75),  # 2 / 8 + 12 / 8
    ("zero3", 0.25, 0.25, 1.5, 2),  # 16 / 8
    ("tp", 0.25, 0.25, 1.5, 2),     # 8-way TP: everything / 8
    ("pp", 0.25, 0.25, 1.5, 2),
])
def test_a_billion_params_on_8_ranks_with_mixed_precision_adam(strategy, params, grads,
                                                                optimizer, total):
    m = estimate_memory(1e9, strategy=strategy, world_size=8)
    assert (m["params"], m["grads"], m["optimizer"], m["total"]) == (
        params * GB, grads * GB, optimizer * GB, total * GB)


def test_the_zero_papers_figure_1_7_5b_params_on_64_gpus():
    # Rajbhandari et al. 2020, Figure 1: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device.
    totals = [estimate_memory(7.5e9, strategy=s, world_size=64)["total"] / GB
              for s in ("dp", "zero1", "zero2", "zero3")]
    assert totals == [120.0, 31.40625, 16.640625, 1.875]


def test_fp32_adam_sgd_and_explicit_bytes():
    fp32 = [estimate_memory(1e9, strategy=s, world_size=8, precision="fp32")["total"] / GB
            for s in ("dp", "zero1", "zero2", "zero3")]
    assert fp32 == [16.0, 9.0, 5.5, 2.0]  # 4 + 4 + 8, the optimizer's 8 sharded first
    assert estimate_memory(1e9, strategy="dp", world_size=1, precision="fp32",
                           optimizer="sgd")["total"] == 12 * GB
    m = estimate_memory(100, strategy="zero2", world_size=4,
                        bytes_per_param={"params": 2, "grads": 4, "optimizer": 12})
    assert (m["params"], m["grads"], m["optimizer"]) == (200, 100, 300)


def test_tp_and_pp_divide_what_zero_shards_over_the_replicas():
    m = estimate_memory(1e9, strategy="zero3", world_size=16, tp=2, pp=2)
    assert (m["dp"], m["tp"], m["pp"], m["total"]) == (4, 2, 2, 1 * GB)  # 16 / (2 * 2 * 4)
    m = estimate_memory(1e9, strategy="zero1", world_size=8, tp=2)
    assert (m["dp"], m["params"], m["optimizer"], m["total"]) == (4, 1 * GB, 1.5 * GB, 3.5 * GB)
    m = estimate_memory(1e9, strategy="tp", world_size=8, tp=2)  # 2-way TP, 4 plain replicas
    assert (m["dp"], m["total"]) == (4, 8 * GB)
    assert estimate_memory(1e9, strategy="pp", world_size=4)["pp"] == 4
    assert set(STRATEGIES) == {"dp", "zero1", "zero2", "zero3", "tp", "pp"}


@pytest.mark.parametrize("kwargs, message", [
    ({"strategy": "zero4", "world_size": 8}, r"unknown strategy 'zero4': use one of dp, zero1, "
                                             r"zero2, zero3, tp, pp"),
    ({"strategy": "dp", "world_size": 0}, r"world_size must be a whole number >= 1, got 0"),
    ({"strategy": "dp", "world_size": 6, "tp": 4}, r"world_size=6 is not a multiple of "
                                                   r"tp\*pp=4: choose tp and pp"),
    ({"strategy": "dp", "world_size": 2, "precision": "fp8"}, r"unknown precision='fp8'.*"
                                                              r"bytes_per_param="),
    ({"strategy": "dp", "world_size": 2, "bytes_per_param": {"params": 2}},
     r"needs exactly the keys 'params', 'grads', 'optimizer', got \['params'\]"),
])
def test_estimate_memory_errors_say_what_to_use(kwargs, message):
    with pytest.raises(ValueError, match=message):
        estimate_memory(1e9, **kwargs)
    with pytest.raises(ValueError, match="n_params must be > 0"):
        estimate_memory(0, strategy="dp", world_size=1)


# ---- activation_memory -----------------------------------------------------------------------


def test_checkpointing_keeps_only_the_block_inputs():
    x = torch.randn(16, 32)
    model = partial(mlp_blocks, 8, 32)
    plain = activation_memory(model, x, repeats=1)
    ckpt = activation_memory(model, x, checkpoint=True, repeats=1)
    # Per block: its input (16 x 32), the first Linear's output and GELU's (16 x 128 each).
    assert plain["saved_bytes"] == 8 * (16 * 32 + 2 * 16 * 128) * 4
    assert ckpt["saved_bytes"] == 8 * 16 * 32 * 4  # the inputs only: 89 % saved
    assert 1 - ckpt["saved_bytes"] / plain["saved_bytes"] > 0.4
    assert plain["seconds"] > 0 and ckpt["seconds"] > 0


def test_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model, x = mlp_blocks(8, 32), torch.randn(16, 32, requires_grad=True)
    grads = []
    for checkpoint in (False, True):
        model.zero_grad()
        x.grad = None
        forward_blocks(model, x, checkpoint=checkpoint).square().mean().backward()
        grads.append([x.grad.clone(), *(p.grad.clone() for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_activation_memory_wants_a_sequential_of_blocks():
    with pytest.raises(ValueError, match=r"nn\.Sequential of blocks .*got Linear"):
        activation_memory(lambda: torch.nn.Linear(3, 3), torch.randn(2, 3))


def test_activation_memory_refuses_bad_repeats():
    with pytest.raises(ValueError, match="repeats must be a whole number >= 1, got 0"):
        activation_memory(lambda: mlp_blocks(1, 4), torch.randn(2, 4), repeats=0)


def test_fsdp_memory_refuses_bad_steps_and_models_it_cannot_feed():
    from labkit.parallel.memory import _first_linear_input

    with pytest.raises(ValueError, match="steps must be a whole number >= 1, got 0"):
        fsdp_memory(partial(mlp_blocks, 1, 4), steps=0)
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    with pytest.raises(ValueError, match=r"found none: pass input_fn=lambda: torch\.randn"):
        _first_linear_input(conv, 2, torch.device("cpu"))
    assert _first_linear_input(mlp_blocks(1, 4), 2, torch.device("cpu")).shape == (2, 4)


def test_tp_and_pp_left_out_default_to_the_whole_world_only_for_their_own_strategy():
    assert estimate_memory(1e9, strategy="tp", world_size=8)["tp"] == 8
    assert estimate_memory(1e9, strategy="tp", world_size=8, tp=1)["dp"] == 8  # an explicit 1 holds
    assert estimate_memory(1e9, strategy="pp", world_size=8, tp=2)["pp"] == 4
    assert estimate_memory(1e9, strategy="zero3", world_size=8)["tp"] == 1


def test_fsdp_memory_needs_a_worker():
    with pytest.raises(RuntimeError, match="not initialised: run this inside a worker"):
        fsdp_memory(partial(mlp_blocks, 1, 4))


# ---- fsdp_memory on two ranks ----------------------------------------------------------------


def _params(width, n_blocks, expansion=4):
    return n_blocks * (2 * width * expansion * width + expansion * width + width)


def test_fsdp2_holds_exactly_the_zero3_share_of_fp32_adam(two_ranks):
    n = _params(16, 2)
    zero3 = estimate_memory(n, strategy="zero3", world_size=2, precision="fp32")
    dp = estimate_memory(n, strategy="dp", world_size=2, precision="fp32")
    for v in two_ranks:
        r = v["even"]
        assert r["n_params"] == n and r["world_size"] == 2
        for key in ("params", "grads", "optimizer", "total"):
            assert r["sharded"][key] == zero3[key], key
            assert r["unsharded"][key] == dp[key], key
        assert r["sharded"]["params"] * 2 == r["unsharded"]["params"]
        assert r["sharded"]["padding"] == 0 and r["unsharded"]["padding"] == 0
        assert r["sharded"]["optimizer_steps"] == 8 * 4  # a float32 step per tensor, 4 per block
        assert r["sharded"]["cuda_peak"] is None  # CPU: no allocator statistics


def test_uneven_shards_differ_per_rank_pad_and_still_add_up(two_ranks):
    n = _params(5, 1)
    r0, r1 = (v["uneven"]["sharded"] for v in two_ranks)
    assert r0["total"] != r1["total"]
    assert r0["total"] + r1["total"] == estimate_memory(n, strategy="dp", world_size=1,
                                                        precision="fp32")["total"]
    # The second Linear's weight (5 x 20) and bias (5) split 3 + 2 rows: the rank with 2 rows
    # allocates a third as padding, for the parameter and for its gradient (Adam's state is not
    # padded).
    assert r0["padding"] == 0 and r1["padding"] == 2 * (20 + 1) * 4


def test_fsdp2_mixed_precision_keeps_fp32_shards_16_bytes_per_param_in_all(two_ranks):
    n = _params(16, 2)
    mixed = estimate_memory(n, strategy="zero3", world_size=2, precision="mixed")
    for v in two_ranks:
        r = v["mixed"]["sharded"]
        assert r["total"] == mixed["total"]  # 16 bytes per parameter / 2 ranks
        assert r["params"] == 4 * n / 2 and r["grads"] == 4 * n / 2  # fp32, not the paper's 2 + 2
        assert r["optimizer"] == 8 * n / 2


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 2, reason="needs 2 CUDA GPUs for 2 NCCL ranks")
def test_fsdp_memory_on_two_gpus_with_nccl():
    n = _params(256, 4)
    zero3 = estimate_memory(n, strategy="zero3", world_size=2, precision="fp32")
    values = launch(fsdp_memory, partial(mlp_blocks, 4, 256), nproc=2, backend="nccl",
                    show_ranks=[], timeout=300).values
    for v in values:
        assert v["sharded"]["total"] == zero3["total"]
        assert 0 < v["sharded"]["cuda_peak"] < v["unsharded"]["cuda_peak"]


def test_counting_saved_bytes_counts_each_storage_once_and_leaves_out_what_is_excluded():
    from labkit.parallel.memory import counting_saved_bytes

    x = torch.randn(10, 10, requires_grad=True)
    with counting_saved_bytes() as counter:
        (x * x).sum()  # saves x twice: one storage
    assert counter["bytes"] == x.numel() * 4
    with counting_saved_bytes(exclude=[x]) as counter:
        (x * x).sum()
    assert counter["bytes"] == 0

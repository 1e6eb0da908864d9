"""labkit.parallel.transformer and .sequence: the block, its TP and SP copies, the formulas."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import launch
from labkit.parallel.memory import saved_bytes
from labkit.parallel.sequence import (
    activation_bytes,
    allreduce_sequence_parallel_grads,
    check_sequence_split,
    gather_sequence,
    reduce_scatter_sequence,
    sp_block,
    sp_check,
    split_sequence,
    tp_block,
    traffic_formula,
)
from labkit.parallel.transformer import (
    Block,
    SlicedDropout,
    attention,
    block_input,
    block_stack,
    check_heads,
    merge_heads,
    split_heads,
)

from .conftest import cuda_gpus

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

# float32: the parallel blocks add the same products in another order (partial sums over
# ranks, then over tokens); the gradients are sums of up to s*b*4h terms of size ~10, so
# differences of a few 1e-6 are rounding, and a real mistake is off by O(1).
TOL = 1e-4
SIZES = dict(seq=16, batch=2, hidden=32, heads=4)


def sequence_checks(seq, batch, hidden, heads) -> dict:
    """Run on every rank of one launch: sp_check, the collectives on known tensors, errors."""
    import torch
    import torch.distributed as dist

    from labkit.parallel.sequence import (
        gather_sequence,
        reduce_scatter_sequence,
        sp_block,
        sp_check,
        split_sequence,
        tp_block,
    )
    from labkit.parallel.transformer import Block

    rank, t = dist.get_rank(), dist.get_world_size()
    out = {"check": sp_check(seq, batch, hidden, heads, dropout=0.1, seed=3),
           "no_dropout": sp_check(seq, batch, hidden, heads, dropout=0.0, seed=1)}
    x = torch.full((2, 3), float(rank)).requires_grad_()
    gathered = gather_sequence(x * 1.0)
    gathered.backward(torch.full_like(gathered, rank + 1.0))
    out["gather"] = (gathered.detach()[:, 0].tolist(), x.grad[:, 0].tolist())
    y = torch.arange(2.0 * t).repeat(3, 1).t().contiguous().requires_grad_()  # rows 0..2t-1
    scattered = reduce_scatter_sequence(y * 1.0)
    scattered.backward(torch.full_like(scattered, rank + 1.0))
    out["scatter"] = (scattered.detach()[:, 0].tolist(), y.grad[:, 0].tolist())
    z = torch.arange(2.0 * t).view(2 * t, 1).requires_grad_()
    split = split_sequence(z)
    split.backward(torch.ones_like(split))
    out["split"] = (split.detach()[:, 0].tolist(), z.grad[:, 0].tolist())
    errors = {}
    for what, fn in (("heads", lambda: tp_block(Block(8 * (t + 1), t + 1))),
                     ("sp_heads", lambda: sp_block(Block(8 * (t + 1), t + 1))),
                     ("seq", lambda: sp_check(4 * t + 1, batch, hidden, heads)),
                     ("split", lambda: split_sequence(torch.ones(4 * t + 1, 1)))):
        try:
            fn()
        except ValueError as e:
            errors[what] = str(e)
    out["errors"] = errors
    return out


def _launch(n):
    return launch(sequence_checks, *SIZES.values(), nproc=n, show_ranks=[], timeout=300,
                  warm=True).values


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks(request):
    return request.param, _launch(request.param)


# ---- the block, one process -----------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_attention_is_scaled_dot_product_attention(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.allclose(attention(q, k, v, causal), want, atol=1e-6)


def test_heads_split_and_merge_back():
    qkv = torch.randn(5, 2, 3 * 12)
    q, k, v = split_heads(qkv, heads=3)
    assert q.shape == (2, 3, 5, 4) and q.is_contiguous()
    # head by head: head 1's q is features 12..15, its k 16..19, its v 20..23
    assert torch.equal(q[:, 1], qkv[..., 12:16].permute(1, 0, 2))
    assert torch.equal(v[:, 1], qkv[..., 20:24].permute(1, 0, 2))
    assert torch.equal(merge_heads(q), torch.cat([qkv[..., 12 * h:12 * h + 4] for h in range(3)],
                                                 dim=-1))


def test_block_is_pre_layernorm_attention_then_mlp():
    torch.manual_seed(0)
    block = Block(16, 2, causal=False)
    x = block_input(6, 3, 16, seed=1)
    h = block.ln1(x)
    mha = nn.MultiheadAttention(16, 2, bias=True)  # torch's attention, fed the same weights
    # torch's in_proj is [all q | all k | all v]; the block's is head by head
    w = block.qkv.weight.view(2, 3, 8, 16).transpose(0, 1).reshape(48, 16)
    b = block.qkv.bias.view(2, 3, 8).transpose(0, 1).reshape(48)
    with torch.no_grad():
        mha.in_proj_weight.copy_(w)
        mha.in_proj_bias.copy_(b)
        mha.out_proj.weight.copy_(block.proj.weight)
        mha.out_proj.bias.copy_(block.proj.bias)
    x1 = x + mha(h, h, h, need_weights=False)[0]
    want = x1 + block.fc2(F.gelu(block.fc1(block.ln2(x1))))
    assert torch.allclose(block(x), want, atol=1e-5)


def test_sliced_dropout_gives_every_shard_its_rows_of_one_mask():
    drop = SlicedDropout(0.5, seed=4)
    x = torch.ones(8, 2, 3)
    full = drop(x)
    assert set(full.unique().tolist()) == {0.0, 2.0}
    for start in (0, 4):
        drop.calls = 0  # the same call again
        assert torch.equal(drop(x[start:start + 4], start=start, full_seq=8), full[start:start + 4])
    assert not torch.equal(drop(x), full)  # call 1: a new mask
    drop.eval()
    assert torch.equal(drop(x), x)
    assert torch.equal(SlicedDropout(0.0)(x), x)


def test_sliced_dropout_without_a_seed_is_nn_dropout():
    x = torch.randn(6, 2, 5, requires_grad=True)
    torch.manual_seed(7)
    want = nn.Dropout(0.3)(x)
    torch.manual_seed(7)
    got = SlicedDropout(0.3, seed=None)(x)
    assert torch.equal(got, want)


def test_sliced_dropout_keeps_one_byte_per_element_and_the_gradient_is_masked():
    drop = SlicedDropout(0.25, seed=0)
    x = torch.randn(4, 2, 8, requires_grad=True)
    assert saved_bytes(drop, x) == 4 * 2 * 8  # a boolean mask, like nn.Dropout's
    drop.calls = 0
    y = drop(x)
    y.sum().backward()
    assert torch.equal(x.grad, (y != 0).float() / 0.75)


@pytest.mark.parametrize("p", [-0.1, 1.0])
def test_dropout_probability_must_be_below_one(p):
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\)"):
        SlicedDropout(p)


def test_hidden_must_split_into_heads():
    assert check_heads(64, 4) == 16
    with pytest.raises(ValueError, match=r"^hidden 30 does not split into 4 heads: use a hidden "
                                         r"size that is a multiple of 4 \(e\.g\. 28 or 32\)$"):
        Block(30, 4)


def test_block_stack_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    a = block_stack(2, 16, 2, dropout=0.1, seed=5)
    assert torch.equal(torch.rand(1), before)
    b = block_stack(2, 16, 2, dropout=0.1, seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert [blk.drop1.seed for blk in a] == [20, 22]  # each block its own masks
    x = block_input(8, 2, 16)
    assert torch.equal(a(x), b(x)) and a(x).shape == (8, 2, 16)


# ---- the formulas, one process --------------------------------------------------------------


@pytest.mark.parametrize("seq, batch, hidden, heads, dropout, causal", [
    (16, 2, 32, 4, 0.1, True), (12, 3, 24, 2, 0.0, True), (8, 1, 48, 6, 0.2, False)])
def test_activation_bytes_is_what_the_dense_block_saves(seq, batch, hidden, heads, dropout,
                                                        causal):
    torch.manual_seed(0)
    block = Block(hidden, heads, dropout=dropout, causal=causal)
    x = block_input(seq, batch, hidden).requires_grad_()
    got = saved_bytes(block, x, exclude=block.parameters())
    want = activation_bytes(seq, batch, hidden, heads, dropout=dropout > 0, causal=causal)
    assert got == want["total"]
    assert want["total"] == sum(v for k, v in want.items() if k != "total")


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_activation_bytes_in_fp16_are_megatrons_without_attention_dropout(t):
    s, b, h, a = 64, 2, 256, 8
    sbh = s * b * h

    def main_terms(**kw):  # without the LayerNorm statistics and the causal mask
        r = activation_bytes(s, b, h, a, t, dtype_bytes=2, causal=False, **kw)
        return r["total"] - 2 * 2 * s * b * 4 // (t if kw.get("sequence_parallel") else 1)

    # Megatron: 10 + 24/t + 5as/(ht) for TP, (34 + 5as/h)/t with SP; 5 -> 2 without the
    # attention dropout's mask (1 byte) and output (2 bytes) per score
    assert main_terms() * t == sbh * (10 * t + 24) + 2 * a * s * s * b
    assert main_terms(sequence_parallel=True, regather=True) * t == sbh * 34 + 2 * a * s * s * b
    assert main_terms(sequence_parallel=True) * t == sbh * (4 * t + 30) + 2 * a * s * s * b


def test_traffic_formula_tp_and_sp_send_the_same_activation_bytes():
    S = 16 * 2 * 32 * 4
    for t in (2, 4):
        tp = traffic_formula(16, 2, 32, t, sequence_parallel=False)
        sp = traffic_formula(16, 2, 32, t, sequence_parallel=True)
        assert tp["forward"] == sp["forward"] == 2 * 2 * (t - 1) * S // t
        assert tp["backward"] == sp["backward"] and tp["grad_sync"] == 0
        assert sp["grad_sync"] == 2 * (t - 1) * 6 * 32 * 4 // t
        again = traffic_formula(16, 2, 32, t, sequence_parallel=True, regather=True)
        assert again["backward"] == sp["backward"] + 2 * (t - 1) * S // t


def test_sizes_that_do_not_split_say_what_would():
    with pytest.raises(ValueError, match=r"^sequence length 10 does not split over 4 ranks: use "
                                         r"a multiple of 4 \(e\.g\. 8 or 12\), or a TP degree "
                                         r"that divides 10 \(e\.g\. 2, 5\)$"):
        activation_bytes(10, 2, 32, 4, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"^number of heads 6 does not split over 4 ranks: use a "
                                         r"multiple of 4 \(e\.g\. 4 or 8\)"):
        activation_bytes(16, 2, 48, 6, 4)
    with pytest.raises(ValueError, match=r"^hidden 30 does not split into 4 heads"):
        activation_bytes(16, 2, 30, 4)
    assert check_sequence_split(16, 4) == 4
    activation_bytes(10, 2, 32, 4, 2)  # plain TP keeps every token: any length


def test_tp_block_wants_a_block():
    with pytest.raises(ValueError, match=r"expected a labkit\.parallel\.transformer\.Block"):
        tp_block(nn.Linear(4, 4))


# ---- one rank ---------------------------------------------------------------------------------


def test_one_rank_is_the_dense_block_with_no_collectives(group):
    r = sp_check(8, 2, 16, 2, dropout=0.1)
    assert r["degree"] == 1 and r["dense"]["saved_bytes"] == r["dense"]["formula_bytes"]["total"]
    for name in ("tp", "sp", "sp_regather"):
        v = r[name]
        assert v["output"] == 0.0 and v["input_grad"] == 0.0 and max(v["grads"].values()) == 0.0
        assert v["collectives"] == {"forward": {}, "backward": {}} and v["grad_sync"] == {}
        assert v["saved_bytes"] == v["formula_bytes"]["total"]
    torch.manual_seed(0)
    dense = Block(16, 2)
    x = block_input(8, 2, 16)
    assert torch.equal(gather_sequence(x), x) and torch.equal(reduce_scatter_sequence(x), x)
    assert torch.equal(split_sequence(x), x)
    assert torch.equal(sp_block(dense)(x), dense(x)) and torch.equal(tp_block(dense)(x), dense(x))
    assert allreduce_sequence_parallel_grads(sp_block(dense)) == 0  # no gradients yet


def test_sp_check_needs_a_worker():
    with pytest.raises(RuntimeError, match="not initialised: run this inside a worker"):
        sp_check()


# ---- 2 and 4 ranks ------------------------------------------------------------------------------


VERSIONS = ("tp", "sp", "sp_regather")


def test_tp_and_sp_blocks_equal_the_dense_block_with_dropout_on(ranks):
    n, values = ranks
    names = {n for n, _ in Block(32, 4).named_parameters()}
    for v in values:
        for case in ("check", "no_dropout"):
            for name in VERSIONS:
                r = v[case][name]
                assert v[case]["degree"] == n
                assert r["output"] < TOL and r["input_grad"] < TOL, (name, r)
                assert set(r["grads"]) == names
                assert max(r["grads"].values()) < TOL, (name, r["grads"])


def test_sp_layernorm_grads_are_partial_until_all_reduced(ranks):
    for v in ranks[1]:
        for name in ("sp", "sp_regather"):
            assert v["check"][name]["unsynced"] > 100 * TOL  # each rank saw its tokens only


def test_collectives_forward_backward_and_the_gradient_sync(ranks):
    for v in ranks[1]:
        r = v["check"]
        assert r["tp"]["collectives"] == {"forward": {"all_reduce": 2},
                                          "backward": {"all_reduce": 2}}
        assert r["tp"]["grad_sync"] == {}
        pair = {"all_gather": 2, "reduce_scatter": 2}
        assert r["sp"]["collectives"] == {"forward": pair, "backward": pair}
        assert r["sp_regather"]["collectives"] == {
            "forward": pair, "backward": {"all_gather": 4, "reduce_scatter": 2}}
        for name in ("sp", "sp_regather"):
            assert r[name]["grad_sync"] == {"all_reduce": 1}


def test_bytes_sent_equal_the_formula_and_tp_equals_sp(ranks):
    n, values = ranks
    S = 16 * 2 * 32 * 4
    for v in values:
        r = v["check"]
        for name in VERSIONS:
            f = r[name]["formula_traffic"]
            assert r[name]["sent_bytes"] == {"forward": f["forward"], "backward": f["backward"]}
            assert r[name]["grad_sync_bytes"] == f["grad_sync"]
        assert r["tp"]["sent_bytes"] == r["sp"]["sent_bytes"] == {
            "forward": 4 * (n - 1) * S // n, "backward": 4 * (n - 1) * S // n}


def test_activation_bytes_saved_per_rank_equal_the_formula(ranks):
    n, values = ranks
    for v in values:
        for case in ("check", "no_dropout"):
            r = v[case]
            assert r["dense"]["saved_bytes"] == r["dense"]["formula_bytes"]["total"]
            for name in VERSIONS:
                assert r[name]["saved_bytes"] == r[name]["formula_bytes"]["total"], (name, r)
        r = v["check"]
        assert (r["dense"]["saved_bytes"] > r["tp"]["saved_bytes"] > r["sp"]["saved_bytes"]
                > r["sp_regather"]["saved_bytes"])


def test_the_collectives_on_known_tensors(ranks):
    n, values = ranks
    for rank, v in enumerate(values):
        out, grad = v["gather"]
        assert out == [float(r) for r in range(n) for _ in range(2)]
        assert grad == [n * (n + 1) / 2] * 2  # this rank's rows of the summed gradient
        out, grad = v["scatter"]
        assert out == [n * (2.0 * rank + i) for i in range(2)]  # its rows, summed over n ranks
        assert grad == [float(r + 1) for r in range(n) for _ in range(2)]
        out, grad = v["split"]
        assert out == [2.0 * rank, 2.0 * rank + 1] and grad == [1.0] * (2 * n)


def test_sizes_that_do_not_split_on_ranks(ranks):
    n, values = ranks
    errors = values[0]["errors"]
    assert errors["heads"].startswith(f"number of heads {n + 1} does not split over {n} ranks")
    assert errors["sp_heads"] == errors["heads"]
    lower = 4 * n
    assert errors["seq"].startswith(f"sequence length {4 * n + 1} does not split over {n} ranks:"
                                    f" use a multiple of {n} (e.g. {lower} or {lower + n})")
    assert errors["split"] == errors["seq"]


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 2, reason="needs 2 CUDA GPUs for 2 NCCL ranks")
def test_sp_check_on_two_gpus_with_nccl():
    values = launch(sp_check, 16, 2, 32, 4, nproc=2, backend="nccl", show_ranks=[],
                    timeout=300).values
    for v in values:
        for name in VERSIONS:
            r = v[name]
            assert r["output"] < 1e-3 and max(r["grads"].values()) < 1e-3, r  # TF32 GEMMs
            assert r["saved_bytes"] == r["formula_bytes"]["total"]
            assert r["sent_bytes"]["forward"] == r["formula_traffic"]["forward"]

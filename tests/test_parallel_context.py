"""labkit.parallel.context: ring attention against full attention, its work, bytes and memory.

Tolerance: float32, values of order 1. The ring computes the same softmax in blocks, merged in
another order of summation, so it differs from full attention in the last bits: 1e-5 absolute
on outputs and gradients (measured: below 1e-6).
"""

from __future__ import annotations

import sys

import cloudpickle
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from labkit import launch
from labkit.parallel import transformer
from labkit.parallel.context import (
    ORDERS,
    block_attention,
    full_saved_bytes,
    merge,
    ring_attention,
    ring_bytes_formula,
    ring_check,
    ring_saved_bytes,
    ring_schedule,
    sequence_chunks,
    shard_sequence,
    unshard_sequence,
)
from labkit.parallel.memory import counting_saved_bytes

cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOL = 1e-5
NEG_INF = float("-inf")


def context_checks(seq: int) -> dict:
    """On every rank of one launch: ring_check in each (causal, order), memory, errors."""
    import torch
    import torch.distributed as dist

    from labkit.parallel import context, transformer

    out = {"checks": {(causal, order): context.ring_check(seq, 2, 2, 8, causal, order, seed=1)
                      for causal in (True, False) for order in context.ORDERS}}
    out["memory"] = context.memory_sweep([seq, 2 * seq], batch=1, heads=2, head_dim=8)
    out["memory_contiguous"] = context.memory_sweep([seq], order="contiguous", causal=False)
    n = dist.get_world_size()
    try:
        context.ring_check(seq + n, causal=True, order="zigzag")  # not a multiple of 2n
    except ValueError as e:
        out["zigzag_error"] = str(e)
    # Two CP groups of n/2 ranks (of 1 on 2 ranks: no ring): the ring's peers are global ranks.
    half = n // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, n)))]
    group, me = groups[dist.get_rank() // half], dist.get_rank() % half
    gen = torch.Generator().manual_seed(dist.get_rank() // half)  # a sequence per group
    q, k, v = (torch.randn(1, 2, seq, 8, generator=gen) for _ in range(3))
    ref = transformer.attention(q, k, v, causal=True)
    local = [context.shard_sequence(t, me, half, "zigzag") for t in (q, k, v)]
    got = context.ring_attention(*local, causal=True, order="zigzag", group=group)
    out["subgroup"] = (got - context.shard_sequence(ref, me, half, "zigzag")).abs().max().item()
    return out


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    n = request.param
    values = launch(context_checks, 8 * n, nproc=n, backend="gloo",
                    show_ranks=[], timeout=180, warm=True).values
    return n, values


# ---- the block and the merge, single process -------------------------------------------------


def _qkv(sq=6, sk=10, d=8, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, sq, d, generator=gen) * scale
    return q, torch.randn(2, 3, sk, d, generator=gen), torch.randn(2, 3, sk, d, generator=gen)


def test_block_attention_is_scaled_dot_product_attention_and_returns_the_log_sum_exp():
    q, k, v = _qkv()
    out, lse = block_attention(q, k, v)
    assert out.shape == (2, 3, 6, 8) and lse.shape == (2, 3, 6)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=TOL)
    assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-2, -1) / 8 ** 0.5, -1), atol=TOL)
    mask = torch.ones(6, 10, dtype=torch.bool).tril()
    out, _ = block_attention(q, k, v, mask)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=TOL)


def test_a_row_whose_keys_are_all_masked_gets_lse_minus_inf_and_out_zero():
    q, k, v = _qkv()
    mask = torch.ones(6, 10, dtype=torch.bool)
    mask[2] = False
    out, lse = block_attention(q, k, v, mask)
    assert torch.all(lse[..., 2] == NEG_INF) and torch.all(out[..., 2, :] == 0)
    assert torch.isfinite(lse[..., [0, 1, 3, 4, 5]]).all() and not out.isnan().any()


@pytest.mark.parametrize("cuts", [[4], [1, 5, 9], [2, 3, 4, 7]])
@pytest.mark.parametrize("scale", [1.0, 60.0])  # 60: lse near 400, exp(lse) overflows float32
def test_merging_the_parts_of_a_key_split_gives_the_whole_softmax(cuts, scale):
    q, k, v = _qkv(scale=scale)
    want_out, want_lse = block_attention(q, k, v)
    bounds = [0, *cuts, k.shape[-2]]
    out, lse = torch.zeros_like(want_out), torch.full(want_lse.shape, NEG_INF)  # no keys yet
    for a, b in zip(bounds, bounds[1:], strict=False):
        out, lse = merge(out, lse, *block_attention(q, k[..., a:b, :], v[..., a:b, :]))
    assert torch.isfinite(lse).all() and lse.max() > (200 if scale > 1 else -1)
    assert torch.allclose(out, want_out, atol=TOL) and torch.allclose(lse, want_lse, rtol=1e-6)


def test_merge_with_an_empty_side_is_the_other_side_and_two_empty_sides_stay_empty():
    q, k, v = _qkv()
    out, lse = block_attention(q, k, v)
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, NEG_INF)
    for args in ((out, lse, empty_out, empty_lse), (empty_out, empty_lse, out, lse)):
        got_out, got_lse = merge(*args)
        assert torch.equal(got_out, out) and torch.equal(got_lse, lse)
    got_out, got_lse = merge(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.all(got_lse == NEG_INF) and torch.all(got_out == 0)


# ---- sharding --------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_shard_then_unshard_is_the_identity_and_shards_are_copies(order, world):
    x = torch.arange(2 * 3 * 16 * 2.0).view(2, 3, 16, 2)
    shards = [shard_sequence(x, r, world, order) for r in range(world)]
    assert all(s.shape == (2, 3, 16 // world, 2) for s in shards)
    assert torch.equal(unshard_sequence(shards, order), x)
    assert shards[0].untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    y = x.transpose(1, 2)  # the sequence as another dim
    assert torch.equal(unshard_sequence([shard_sequence(y, r, world, order, dim=1)
                                         for r in range(world)], order, dim=1), y)


def test_zigzag_gives_rank_r_chunks_r_and_2n_minus_1_minus_r():
    assert [sequence_chunks(r, 4, "zigzag") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [sequence_chunks(r, 3) for r in range(3)] == [[0], [1], [2]]
    x = torch.arange(8).view(1, 1, 8, 1)
    assert shard_sequence(x, 1, 2, "zigzag").flatten().tolist() == [2, 3, 4, 5]


def test_a_sequence_that_does_not_split_says_what_to_use():
    x = torch.zeros(1, 1, 10, 4)
    with pytest.raises(ValueError, match=r"^sequence length 10 does not split over 4 ranks: use a "
                                         r"multiple of 4 \(e\.g\. 8 or 12\)$"):
        shard_sequence(x, 0, 4)
    with pytest.raises(ValueError, match=r"^sequence length 10 does not split into 2 x 2 = 4 "
                                         r"zigzag chunks: use a multiple of 4 \(e\.g\. 8 or 12\), "
                                         r"or order='contiguous'$"):
        shard_sequence(x, 0, 2, "zigzag")
    with pytest.raises(ValueError, match=r"multiple of 16 \(e\.g\. 16\)"):
        shard_sequence(x, 0, 8, "zigzag")


def test_orders_ranks_and_shard_lists_are_checked():
    x = torch.zeros(1, 1, 8, 4)
    with pytest.raises(ValueError, match=r"order must be one of 'contiguous', 'zigzag', got "
                                         r"'striped'"):
        shard_sequence(x, 0, 2, "striped")
    with pytest.raises(ValueError, match=r"rank must be 0 \.\.\. 1 for world=2, got 2"):
        shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match=r"world must be a whole number >= 1, got 0"):
        ring_schedule(0)
    # A flag is not a count, although Python calls True 1; NumPy's integers are counts.
    with pytest.raises(ValueError, match=r"world must be a whole number >= 1, got True"):
        sequence_chunks(0, True)
    with pytest.raises(ValueError, match=r"rank must be 0 \.\.\. 1 for world=2, got True"):
        sequence_chunks(True, 2)
    with pytest.raises(ValueError, match=r"rank must be a whole number >= 0, got 1.0"):
        shard_sequence(x, 1.0, 2)
    assert sequence_chunks(np.int64(1), np.int64(2), "zigzag") == [1, 2]
    assert torch.equal(shard_sequence(x, np.int32(1), np.int64(2)), x[:, :, 4:])
    assert len(ring_schedule(np.int64(2))) == 2 * 2
    with pytest.raises(ValueError, match=r"needs every rank's shard, in rank order: got none"):
        unshard_sequence([])


# ---- the schedule: who computes what ---------------------------------------------------------


def _work(world, order, causal=True):
    rows = ring_schedule(world, order, causal)
    return [sum(b["kind"] != "skipped" for row in rows if row["rank"] == r for b in row["blocks"])
            for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_contiguous_causal_rank_r_computes_r_plus_1_blocks_zigzag_evens_them(world):
    assert _work(world, "contiguous") == [r + 1 for r in range(world)]
    assert _work(world, "zigzag") == [2 * world + 1] * world  # half-chunk blocks, equal
    assert _work(world, "contiguous", causal=False) == [world] * world
    assert _work(world, "zigzag", causal=False) == [world] * world


def test_the_ring_passes_each_chunk_to_the_right():
    rows = ring_schedule(4, "zigzag")
    assert [(r["step"], r["rank"], r["kv_from"]) for r in rows[4:8]] == [
        (1, 0, 3), (1, 1, 0), (1, 2, 1), (1, 3, 2)]
    assert rows[5]["kv_chunks"] == [0, 7] and rows[5]["q_chunks"] == [1, 6]
    kinds = [(b["q"], b["kv"], b["kind"]) for b in rows[5]["blocks"]]
    assert kinds == [((1,), (0,), "full"), ((1,), (7,), "skipped"), ((6,), (0,), "full"),
                     ((6,), (7,), "skipped")]
    assert [b["kind"] for b in rows[0]["blocks"]] == ["diagonal", "skipped", "full", "diagonal"]


# ---- one rank, no ring -----------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("causal", [False, True])
def test_without_a_process_group_ring_attention_is_full_attention_with_its_gradients(causal,
                                                                                       order):
    q, k, v = _qkv(12, 12)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    stats = {}
    out = ring_attention(*mine, causal=causal, order=order, stats=stats)
    want = transformer.attention(*ref, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout)
    assert (out - want).abs().max() < TOL
    for a, b in zip(mine, ref, strict=True):
        assert (a.grad - b.grad).abs().max() < TOL
    assert stats["blocks"] == stats["backward_blocks"] == (3 if causal and order == "zigzag"
                                                           else 1)


def test_ring_check_on_one_rank(group):
    r = ring_check(16, 1, 2, 8, True, "zigzag")
    assert r["world"] == 1 and r["max_diff"] < TOL and r["blocks"] == 3
    assert r["bytes"] == r["bytes_formula"] == {"forward": 0, "backward": 0}


def test_q_k_v_shapes_are_checked():
    q, k, v = _qkv(6, 6)
    with pytest.raises(ValueError, match=r"^q, k and v must have the same shape .*got q "
                                         r"\(2, 3, 6, 8\), k \(2, 3, 4, 8\), v \(2, 3, 6, 8\)$"):
        ring_attention(q, k[..., :4, :], v)
    with pytest.raises(ValueError, match=r"^k must be a tensor \(batch, heads, seq, head_dim\): "
                                         r"this rank's chunk of the sequence; got \(6, 8\)$"):
        ring_attention(q, k[0, 0], v)
    with pytest.raises(ValueError, match=r"^zigzag: each rank holds two chunks, so its sequence "
                                         r"length must be even, got 5"):
        ring_attention(*(t[..., :5, :] for t in (q, k, v)), order="zigzag")
    with pytest.raises(ValueError, match=r"order must be one of"):
        ring_attention(q, k, v, order="ring")


def test_the_memory_formulas_are_what_autograd_saves_in_one_process():
    for causal in (False, True):
        leaves = [t.requires_grad_() for t in _qkv(16, 16)]
        with counting_saved_bytes() as saved:
            transformer.attention(*leaves, causal=causal)
        assert saved["bytes"] == full_saved_bytes(16, 2, 3, 8, causal)
    leaves = [t.requires_grad_() for t in _qkv(16, 16)]
    with counting_saved_bytes() as saved:
        ring_attention(*leaves, causal=True)
    assert saved["bytes"] == ring_saved_bytes(16, 2, 3, 8, 1) == 4 * 2 * 3 * 16 * (4 * 8 + 1)


def test_ring_bytes_formula():
    assert ring_bytes_formula(64, 1, 2, 8, 4) == {"forward": 6 * 1024, "backward": 14 * 1024}
    assert ring_bytes_formula(64, 1, 2, 8, 1) == {"forward": 0, "backward": 0}


# ---- 2 and 4 ranks ---------------------------------------------------------------------------


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_full_attention_forward_and_backward(ranks, causal, order):
    n, values = ranks
    for r, v in enumerate(values):
        check = v["checks"][causal, order]
        assert check["rank"] == r and check["world"] == n
        assert set(check["diffs"]) == {"out", "dq", "dk", "dv"}
        assert check["max_diff"] < TOL, check["diffs"]


def test_causal_work_is_uneven_contiguous_and_even_zigzag(ranks):
    n, values = ranks
    contiguous = [v["checks"][True, "contiguous"] for v in values]
    zigzag = [v["checks"][True, "zigzag"] for v in values]
    assert [c["blocks"] for c in contiguous] == [r + 1 for r in range(n)]
    assert [c["backward_blocks"] for c in contiguous] == [r + 1 for r in range(n)]
    assert [c["blocks"] for c in zigzag] == [2 * n + 1] * n
    assert len({c["scores"] for c in zigzag}) == 1  # the same number of scores on every rank
    chunk = 8  # seq 8n over n ranks
    assert [c["scores"] for c in contiguous] == [(r + 1) * chunk * chunk for r in range(n)]
    assert all(c["compute_s"] > 0 for c in contiguous + zigzag)
    assert [v["checks"][False, "zigzag"]["blocks"] for v in values] == [n] * n


@pytest.mark.parametrize("causal", [True, False])
def test_bytes_sent_are_exactly_the_formula(ranks, causal):
    n, values = ranks
    chunk = 2 * 2 * 8 * 8 * 4  # batch * heads * (seq / n) * head_dim * 4 bytes
    for v in values:
        for order in ORDERS:
            check = v["checks"][causal, order]
            assert check["bytes"] == check["bytes_formula"] == {
                "forward": 2 * (n - 1) * chunk, "backward": 2 * (2 * n - 1) * chunk}
            assert check["sends"] == {"forward": 2 * (n - 1), "backward": 2 * (2 * n - 1)}


def test_memory_per_rank_is_the_formula(ranks):
    n, values = ranks
    for v in values:
        for row in v["memory"] + v["memory_contiguous"]:
            assert row["world"] == n
            assert row["full"] == row["full_formula"] and row["ring"] == row["ring_formula"]
        small, big = v["memory"]
        assert big["ring"] == 2 * small["ring"]  # O(s / n)
        assert big["full"] > 2 * small["full"]  # more than linear: the s x s probabilities


def test_a_zigzag_run_with_a_bad_length_says_what_to_use(ranks):
    n, values = ranks
    assert values[0]["zigzag_error"].startswith(
        f"sequence length {9 * n} does not split into 2 x {n} = {2 * n} zigzag chunks")


def test_a_ring_over_a_subgroup_addresses_its_global_ranks(ranks):
    _, values = ranks
    assert max(v["subgroup"] for v in values) < TOL

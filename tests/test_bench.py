"""labkit.bench: the pure helpers, and the worker functions in a single-rank gloo group."""

from __future__ import annotations

import math

import pytest

from labkit.bench import (
    allreduce_sweep,
    bus_bandwidth,
    check_allreduce,
    fit_alpha_beta,
    message_sizes,
)


@pytest.fixture
def group(tmp_path):
    """A one-rank process group in this process: the worker functions without a launcher."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ pure helpers


def test_message_sizes_are_powers_of_two_inclusive():
    assert message_sizes(1024, 8192) == [1024, 2048, 4096, 8192]
    assert message_sizes(1000, 4096) == [1024, 2048, 4096]  # lo rounds up to a power of two
    assert message_sizes(4, 4) == [4]
    assert len(message_sizes()) == 17  # 1 KiB ... 64 MiB


@pytest.mark.parametrize("lo, hi", [(0, 8), (16, 8), (-4, 8)])
def test_message_sizes_rejects_bad_ranges(lo, hi):
    with pytest.raises(ValueError, match="lo <= hi"):
        message_sizes(lo, hi)


def test_bus_bandwidth_is_the_nccl_tests_factor():
    assert bus_bandwidth(10.0, 2) == 10.0      # 2 (n-1)/n = 1 for two ranks
    assert bus_bandwidth(10.0, 4) == 15.0
    assert bus_bandwidth(10.0, 8) == 17.5
    assert bus_bandwidth(10.0, 1) == 0.0       # one rank: nothing crosses a link
    with pytest.raises(ValueError, match="at least one rank"):
        bus_bandwidth(10.0, 0)


def _rows(alpha, bandwidth_bps, sizes=None):
    sizes = sizes or message_sizes(1024, 1 << 24)
    return [{"bytes": b, "seconds": alpha + b / bandwidth_bps} for b in sizes]


def test_fit_recovers_alpha_and_bandwidth():
    fit = fit_alpha_beta(_rows(25e-6, 2e9))
    assert fit["alpha_s"] == pytest.approx(25e-6, rel=1e-9)
    assert fit["bandwidth_GBps"] == pytest.approx(2.0, rel=1e-9)
    assert fit["beta_s_per_byte"] == pytest.approx(0.5e-9, rel=1e-9)


def test_fit_weighs_small_messages_too():
    rows = _rows(10e-6, 1e9)
    rows[0]["seconds"] *= 1.02  # 2 % noise on the smallest message barely moves alpha
    assert fit_alpha_beta(rows)["alpha_s"] == pytest.approx(10e-6, rel=0.05)


def test_fit_never_returns_a_negative_latency():
    # Time that grows faster than linearly (caches spilling) pulls a free line below zero.
    rows = [{"bytes": b, "seconds": (b / 1e9) ** 1.2} for b in message_sizes(1024, 1 << 24)]
    fit = fit_alpha_beta(rows)
    assert fit["alpha_s"] == 0.0 and fit["bandwidth_GBps"] > 0


def test_fit_of_flat_times_is_pure_latency():
    rows = [{"bytes": b, "seconds": 1e-3 - b * 1e-12} for b in message_sizes(1024, 1 << 20)]
    fit = fit_alpha_beta(rows)
    assert fit["beta_s_per_byte"] == 0.0 and math.isinf(fit["bandwidth_GBps"])
    assert fit["alpha_s"] == pytest.approx(1e-3, rel=0.01)


@pytest.mark.parametrize("rows, match", [
    ([{"bytes": 1024, "seconds": 1e-5}], "two different sizes"),
    ([{"bytes": 1024, "seconds": 1e-5}, {"bytes": 1024, "seconds": 2e-5}], "two different sizes"),
    ([{"bytes": 1024, "seconds": 0.0}, {"bytes": 2048, "seconds": 1e-5}], "positive"),
])
def test_fit_rejects_rows_it_cannot_fit(rows, match):
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(rows)


# ------------------------------------------------------------- worker functions, one rank


def test_check_allreduce_single_rank(group):
    assert check_allreduce() == 1.0


def test_check_allreduce_names_the_rank_with_a_wrong_sum(group, monkeypatch):
    monkeypatch.setattr(group, "all_reduce", lambda t, *a, **k: t.mul_(2))  # a broken collective
    with pytest.raises(AssertionError, match=r"rank 0: all-reduce gave 2.0, expected 1.0"):
        check_allreduce()


def test_worker_functions_need_a_process_group():
    with pytest.raises(RuntimeError, match="not initialised"):
        check_allreduce()
    with pytest.raises(RuntimeError, match="labkit.launch"):
        allreduce_sweep([1024])


def test_sweep_rows_single_rank(group):
    sizes = message_sizes(1024, 16384)
    rows = allreduce_sweep(sizes, iters=3, warmup=1)
    assert [r["bytes"] for r in rows] == sizes
    for r in rows:
        assert set(r) == {"bytes", "seconds", "algbw_GBps", "busbw_GBps", "ranks", "backend"}
        assert r["seconds"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw_GBps"] == 0.0 and r["ranks"] == 1 and r["backend"] == "gloo"


@pytest.mark.parametrize("kwargs, match", [
    ({"sizes": []}, "non-empty"),
    ({"sizes": [1024, 6]}, r"multiples of 4.*\[6\]"),
    ({"sizes": [0]}, "positive"),
    ({"sizes": [1024.0]}, "byte counts"),
    ({"sizes": [1024], "iters": 0}, "iters >= 1"),
    ({"sizes": [1024], "warmup": -1}, "warmup >= 0"),
])
def test_sweep_rejects_bad_arguments(group, kwargs, match):
    with pytest.raises(ValueError, match=match):
        allreduce_sweep(**kwargs)


# ------------------------------------------------------------- two ranks, without the launcher


def _two_rank_worker(rank, store_path, out_path):
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        rows = allreduce_sweep([1024, 65536], iters=3, warmup=1)
        result = {"sum": check_allreduce(), "rows": rows}
    finally:
        dist.destroy_process_group()
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)


@pytest.mark.slow
def test_two_ranks_agree_on_sum_and_times(tmp_path):
    import json

    import torch.multiprocessing as mp

    out = tmp_path / "out"
    mp.start_processes(_two_rank_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2,
                       start_method="spawn")
    results = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2)]
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert results[0]["rows"] == results[1]["rows"]  # the max over ranks: one answer for all
    for row in results[0]["rows"]:
        assert row["ranks"] == 2 and row["algbw_GBps"] > 0
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])  # 2 (n-1)/n = 1 for n = 2


# ---------------------------------------------------------------------------------- on GPUs


@pytest.mark.gpu
def test_sweep_on_a_gpu_with_nccl(tmp_path):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        assert check_allreduce() == 1.0
        rows = allreduce_sweep(message_sizes(1024, 1 << 20), iters=5, warmup=2)
    finally:
        dist.destroy_process_group()
    assert all(r["backend"] == "nccl" and r["seconds"] > 0 and r["algbw_GBps"] > 0 for r in rows)

"""labkit.bench: the pure helpers, and the worker functions in a single-rank gloo group."""

from __future__ import annotations

import math

import pytest

from labkit import bench, cli, ddp, perf
from labkit.bench import (
    allreduce_sweep,
    bus_bandwidth,
    check_allreduce,
    fit_alpha_beta,
    message_sizes,
)
from tests.fakes import VGG_TINY, allreduce_rows

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
        assert set(r) == {"algorithm", "bytes", "seconds", "algbw_GBps", "busbw_GBps", "ranks",
                          "backend"} and r["algorithm"] == "builtin"
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
    ({"sizes": [1024], "algorithms": ("builtin", "tree")},
     r"unknown all-reduce algorithm\(s\) \['tree'\]: use some of builtin, ring"),
    ({"sizes": [1024], "algorithms": ()}, r"algorithm\(s\) \[\]"),
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
def test_sweep_on_a_gpu_with_nccl(nccl_group):
    assert check_allreduce() == 1.0
    rows = allreduce_sweep(message_sizes(1024, 1 << 20), iters=5, warmup=2)
    assert all(r["backend"] == "nccl" and r["seconds"] > 0 and r["algbw_GBps"] > 0 for r in rows)


# ------------------------------------------------------------------------ VGG16 throughput, MFU


def test_bench_vgg16_prints_the_table(monkeypatch, capsys):
    real = perf.vgg16_throughput
    monkeypatch.setattr(perf, "vgg16_throughput", lambda: real(device="cpu", **VGG_TINY))
    assert "vgg16" in cli.BENCHMARKS
    assert cli.bench("vgg16") == 0
    out = capsys.readouterr().out
    assert "VGG16 training step (forward + backward + SGD) on cpu" in out
    assert "32 px, width 0.0625, batch 2" in out
    for variant in ("fp32", "bf16", "bf16+channels_last"):
        assert any(line.split()[:1] == [variant] and "n/a" in line for line in out.splitlines())
    assert "bf16+channels_last+compile    skipped: torch.compile is measured on GPUs" in out


# ------------------------------------------------------------ data-parallel scaling (notebook 02)


def test_link_model_undoes_the_rings_2_n_minus_1_steps():
    # 4 ranks, link latency 10 us and 1 GB/s: the whole all-reduce takes 6 alpha + 1.5 S / B.
    rows = allreduce_rows(4, 6 * 10e-6, 1.5e-9)
    link = bench.link_model(rows)
    assert link == {"alpha_s": pytest.approx(10e-6), "bandwidth_GBps": pytest.approx(1.0)}
    expected = 6 * 10e-6 + 1.5 * (1 << 20) / 1e9
    assert bench.ring_seconds(1 << 20, 4, **link) == pytest.approx(expected)
    with pytest.raises(ValueError, match="come from one rank.*nproc >= 2"):
        bench.link_model(allreduce_rows(1, 1e-5, 1e-9))


def test_ring_seconds_model_and_its_refusals():
    assert bench.ring_seconds(16 << 20, 1, alpha_s=1.0, bandwidth_GBps=1.0) == 0.0  # no link
    # Bandwidth term 2 (n - 1) / n * S / B tends to 2 S / B as n grows; latency grows with n.
    assert bench.ring_seconds(1e9, 2, alpha_s=0, bandwidth_GBps=1) == pytest.approx(1.0)
    assert bench.ring_seconds(1e9, 64, alpha_s=0, bandwidth_GBps=1) == pytest.approx(2 * 63 / 64)
    for bad in ({"n": 0}, {"nbytes": -1}, {"alpha_s": -1e-6}, {"bandwidth_GBps": 0}):
        args = {"nbytes": 1024, "n": 4, "alpha_s": 1e-6, "bandwidth_GBps": 1.0, **bad}
        with pytest.raises(ValueError, match="need n >= 1, nbytes >= 0, alpha_s >= 0"):
            bench.ring_seconds(args.pop("nbytes"), args.pop("n"), **args)


def test_bench_allreduce_prints_each_algorithm_its_ratio_and_the_model(monkeypatch, capsys):
    calls = {}

    def fake_launch(fn, sizes, **kwargs):
        calls.update(kwargs)
        n = kwargs["nproc"]
        rows = [{"algorithm": a, "bytes": b, "seconds": (6e-5 + 1.5 * b / 1e9) * f,
                 "algbw_GBps": 1.0, "busbw_GBps": 1.5, "ranks": n, "backend": "gloo"}
                for b in sizes for a, f in (("builtin", 1.0), ("ring", 1.25), ("doubling", 2.0))
                if a in kwargs["algorithms"]]
        return type("Result", (), {"values": [rows] * n})()

    monkeypatch.setattr("labkit.launcher.launch", fake_launch)
    assert cli.bench("allreduce") == 0
    out = capsys.readouterr().out
    assert calls["nproc"] == 4 and calls["algorithms"] == ("builtin", "ring", "doubling")
    assert "ring/builtin" in out and "doubling/builtin" in out
    last = [line for line in out.splitlines() if line.strip().startswith("16777216")][0]
    assert last.split()[-2:] == ["0.80", "0.50"]  # builtin time / ring time, / doubling time
    assert "fit ring: alpha = 75.0 us, bandwidth = 0.53 GB/s" in out
    assert ("ring model 2(n-1)(alpha + S/n/B) with the builtin's link "
            "(alpha 10.0 us, B 1.00 GB/s)") in out
    assert cli.bench("allreduce", nproc=3) == 0  # 3 ranks: no recursive doubling (needs 2^k)
    assert calls["algorithms"] == ("builtin", "ring")
    assert cli.bench("allreduce", nproc=1) == 2
    assert "--nproc must be >= 2" in capsys.readouterr().err


def test_bench_ddp_prints_efficiency_and_the_ceiling(monkeypatch, capsys):
    times = {("weak", 1): [0.1], ("weak", 2): [0.125], ("independent", 1): [0.1],
             ("independent", 2): [0.11]}
    batches = dict.fromkeys(times, 64)
    monkeypatch.setattr(ddp, "ddp_efficiency",
                        lambda nproc, repeats: ddp._scaling_rows(times, batches, 264872))
    assert "ddp" in cli.BENCHMARKS
    assert cli.bench("ddp") == 0
    out = capsys.readouterr().out
    assert "64 images per worker, one thread each, 265 kB of gradients" in out
    assert "efficiency 2 workers = 0.800   (target >= 0.90)" in out
    assert "hardware ceiling (no communication) = 0.909;  DDP / ceiling = 0.880" in out



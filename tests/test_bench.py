"""labkit.bench: the pure helpers, and the worker functions in a single-rank gloo group."""

from __future__ import annotations

import math

import pytest

from labkit import bench
from labkit.bench import (
    BENCHMARKS,
    VGG16_VARIANTS,
    allreduce_sweep,
    bus_bandwidth,
    check_allreduce,
    fit_alpha_beta,
    message_sizes,
    peak_tflops,
    vgg16_flops,
    vgg16_throughput,
)

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
    ({"sizes": [1024], "algorithms": ("builtin", "tree")}, r"unknown all-reduce algorithm\(s\) "
                                                            r"\['tree'\]: use some of builtin, ring"),
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


@pytest.fixture
def nccl_group(tmp_path):
    """A one-rank NCCL group on GPU 0 in this process: the worker functions on a GPU."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    yield dist
    dist.destroy_process_group()


@pytest.mark.gpu
def test_sweep_on_a_gpu_with_nccl(nccl_group):
    assert check_allreduce() == 1.0
    rows = allreduce_sweep(message_sizes(1024, 1 << 20), iters=5, warmup=2)
    assert all(r["backend"] == "nccl" and r["seconds"] > 0 and r["algbw_GBps"] > 0 for r in rows)


# ------------------------------------------------------------------------ VGG16 throughput, MFU

TINY = {"image_size": 32, "width": 1 / 16, "batch_size": 2, "num_classes": 10, "steps": 1,
        "warmup": 0, "repeats": 1}


def _counted_forward_flops(image_size, width, num_classes, device="cpu"):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.models import vgg16

    with torch.device(device):
        model = vgg16(num_classes, width=width, image_size=max(image_size, 32))
        x = torch.zeros(1, 3, image_size, image_size)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops()


@pytest.mark.parametrize("image_size, width, num_classes", [
    (32, 1 / 16, 10), (64, 1 / 8, 1000), (50, 0.3, 7),
])
def test_vgg16_flops_match_torchs_flop_counter(image_size, width, num_classes):
    assert vgg16_flops(image_size, width, num_classes) == _counted_forward_flops(
        image_size, width, num_classes)


def test_full_vgg16_is_31_gflop_forward():
    flops = vgg16_flops()
    assert flops == _counted_forward_flops(224, 1.0, 1000, device="meta")  # no 528 MB allocated
    assert flops / 2 == pytest.approx(15.47e9, rel=0.01)  # the often quoted 15.5 GMACs


@pytest.mark.parametrize("kwargs, match", [
    ({"image_size": 16}, r"image_size must be an int >= 32"),
    ({"image_size": 64.0}, r"image_size must be an int >= 32"),
    ({"width": 0}, r"width must be > 0"),
])
def test_vgg16_flops_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vgg16_flops(**kwargs)


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H200 NVL", "bf16", 835.0),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("NVIDIA L40S", "bf16", 362.1),
    ("NVIDIA L4", "bf16", 121.0), ("NVIDIA L40", "bf16", None), ("cpu", "fp32", None),
    ("NVIDIA H200", "fp8", None),
])
def test_peak_table(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_vgg16_throughput_tiny_cpu_run():
    rows = vgg16_throughput(VGG16_VARIANTS, device="cpu", **TINY)
    assert [r["variant"] for r in rows] == list(VGG16_VARIANTS)
    flops = 3 * vgg16_flops(32, 1 / 16, 10)
    for r in rows[:3]:  # fp32, bf16, bf16 + channels_last all measured
        assert r["skipped"] is None and r["images_per_s"] > 0 and r["step_s"] > 0
        assert r["images_per_s"] == pytest.approx(2 / r["step_s"])
        assert r["tflops"] == pytest.approx(r["images_per_s"] * flops / 1e12)
        assert r["mfu"] is None and r["peak_tflops"] is None  # no peak for a CPU: "n/a"
    assert [r["precision"] for r in rows] == ["fp32", "bf16", "bf16", "bf16"]
    assert rows[3]["images_per_s"] is None and "GPUs only" in rows[3]["skipped"]


def test_a_failing_compile_is_skipped_with_the_reason(monkeypatch):
    import torch

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler\nmore detail")

    monkeypatch.setattr(bench, "_skip_reason", lambda variant, device: None)
    monkeypatch.setattr(torch, "compile", broken)
    (row,) = vgg16_throughput(["bf16+channels_last+compile"], device="cpu", **TINY)
    assert row["skipped"] == "torch.compile failed: RuntimeError: no C++ compiler"


def test_other_failures_are_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(bench, "_time_vgg16_variant", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        vgg16_throughput(["fp32"], device="cpu", **TINY)


@pytest.mark.parametrize("kwargs, match", [
    ({"variants": ["fp16"]}, r"unknown VGG16 variant 'fp16'.*fp32, bf16"),
    ({"variants": []}, r"unknown VGG16 variant None"),
    ({"batch_size": 0}, r"batch_size must be a positive int"),
    ({"steps": 0}, r"steps must be a positive int"),
    ({"repeats": 0}, r"repeats must be a positive int"),
    ({"warmup": -1}, r"warmup must be an int >= 0"),
])
def test_vgg16_throughput_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vgg16_throughput(**{**TINY, "device": "cpu", **kwargs})


def test_bench_vgg16_prints_the_table(monkeypatch, capsys):
    real = bench.vgg16_throughput
    monkeypatch.setattr(bench, "vgg16_throughput", lambda: real(device="cpu", **TINY))
    assert "vgg16" in BENCHMARKS
    assert bench.main("vgg16") == 0
    out = capsys.readouterr().out
    assert "VGG16 training step (forward + backward + SGD) on cpu" in out
    assert "32 px, width 0.0625, batch 2" in out
    for variant in ("fp32", "bf16", "bf16+channels_last"):
        assert any(line.split()[:1] == [variant] and "n/a" in line for line in out.splitlines())
    assert "bf16+channels_last+compile    skipped: torch.compile is measured on GPUs" in out


@pytest.mark.gpu
def test_vgg16_throughput_on_a_gpu():
    import torch

    rows = vgg16_throughput(device="cuda", image_size=64, width=0.25, batch_size=16, steps=3,
                            warmup=2, repeats=1)
    name = torch.cuda.get_device_name(0)
    for r in rows[:3]:
        assert r["skipped"] is None and r["images_per_s"] > 0
        assert r["device"] == "cuda:0" and r["device_name"] == name
        if peak_tflops(name, r["precision"]) is not None:
            assert 0 < r["mfu"] < 1
    assert rows[0]["precision"] in ("tf32", "fp32")
    compiled = rows[3]
    assert compiled["images_per_s"] or compiled["skipped"].startswith("torch.compile failed")


# ------------------------------------------------------------ data-parallel scaling (notebook 02)


@pytest.fixture
def two_cores(monkeypatch):
    """A machine with two CPU cores and no GPU, whatever this one has."""
    monkeypatch.setattr(bench, "machine_workers", lambda backend="auto": (2, "CPU cores"))


def test_worker_counts_are_powers_of_two_and_the_limit():
    assert bench.worker_counts(1) == [1]
    assert bench.worker_counts(8) == [1, 2, 4, 8]
    assert bench.worker_counts(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="at least one worker"):
        bench.worker_counts(0)


def test_machine_workers_counts_cores_for_gloo(monkeypatch):
    import os

    monkeypatch.setattr("labkit.profile.visible_gpu_count", lambda: 4)
    assert bench.machine_workers() == (4, "GPUs")
    assert bench.machine_workers("gloo") == (len(os.sched_getaffinity(0)), bench.machine_workers(
        "gloo")[1])
    assert "CPU core" in bench.machine_workers("gloo")[1]


def test_worker_counts_beyond_the_machine_are_skipped_with_a_message(two_cores, capsys):
    assert bench._capped_workers([8, 1, 2, 4, 2], False, "auto") == [1, 2]
    out = capsys.readouterr().out
    assert "skipping 4, 8 workers: this machine has 2 CPU cores" in out
    assert "oversubscribe=True" in out
    assert bench._capped_workers([1, 4], True, "auto") == [1, 4]  # asked for: no message
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("workers, match", [
    ([], "positive integers"), ([0, 1], "positive integers"), ([1.5], "positive integers"),
    ([4, 8], "no worker count left"),
])
def test_bad_worker_counts_are_refused(two_cores, workers, match):
    with pytest.raises(ValueError, match=match):
        bench._capped_workers(workers, False, "auto")


@pytest.mark.parametrize("kwargs, match", [
    ({"modes": ("weak", "fast")}, "modes must name some of weak, strong, independent"),
    ({"modes": ()}, "modes must name"),
    ({"steps": 0}, "need steps >= 1"),
    ({"repeats": 0}, "repeats >= 1"),
    ({"modes": ("strong",), "global_batch": 63}, "63 does not split evenly over 2 workers"),
])
def test_scaling_sweep_refuses_bad_arguments_before_launching(two_cores, monkeypatch, kwargs,
                                                                match):
    monkeypatch.setattr("labkit.launcher.launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=match):
        bench.scaling_sweep([1, 2], **kwargs)


def test_scaling_rows_speedup_and_efficiency():
    times = {("weak", 1): [0.2, 0.1, 0.3], ("weak", 2): [0.25], ("strong", 1): [0.4],
             ("strong", 2): [0.25]}
    batches = {("weak", 1): 8, ("weak", 2): 8, ("strong", 1): 16, ("strong", 2): 8}
    rows = bench._scaling_rows(times, batches, grad_bytes=1000)
    assert [(r["mode"], r["workers"]) for r in rows] == [("weak", 1), ("weak", 2), ("strong", 1),
                                                         ("strong", 2)]
    weak1, weak2, strong1, strong2 = rows
    assert weak1["step_s"] == 0.2 and weak1["samples_per_s"] == pytest.approx(40)  # the median
    assert weak2["global_batch"] == 16 and weak2["samples_per_s"] == pytest.approx(64)
    assert weak2["speedup"] == pytest.approx(1.6) and weak2["efficiency"] == pytest.approx(0.8)
    assert strong2["global_batch"] == strong1["global_batch"] == 16
    assert strong2["speedup"] == pytest.approx(1.6)
    assert weak1["step_s_all"] == [0.2, 0.1, 0.3] and weak1["grad_bytes"] == 1000


def _allreduce_rows(ranks, alpha, beta):
    return [{"bytes": b, "seconds": alpha + b * beta, "ranks": ranks}
            for b in message_sizes(1 << 10, 1 << 20)]


def test_predict_scaling_is_compute_plus_a_ring_allreduce():
    rows = [{"mode": "weak", "workers": 1, "per_worker_batch": 10, "global_batch": 10,
             "step_s": 0.1, "samples_per_s": 100.0, "grad_bytes": 1_000_000},
            {"mode": "strong", "workers": 1, "per_worker_batch": 40, "global_batch": 40,
             "step_s": 0.4, "samples_per_s": 100.0, "grad_bytes": 1_000_000}]
    # measured on 2 ranks: one link's alpha is half the call's, its beta the call's
    predicted = bench.predict_scaling(rows, _allreduce_rows(2, 20e-6, 1e-9), [1, 2, 4])
    by = {(p["mode"], p["workers"]): p for p in predicted}
    assert by["weak", 1]["allreduce_s"] == 0 and by["weak", 1]["speedup"] == pytest.approx(1)
    ring4 = 2 * 3 * 10e-6 + 2 * 3 / 4 * 1_000_000 * 1e-9
    assert by["weak", 4]["allreduce_s"] == pytest.approx(ring4, rel=1e-6)
    assert by["weak", 4]["step_s"] == pytest.approx(0.1 + ring4, rel=1e-6)
    assert by["weak", 4]["samples_per_s"] == pytest.approx(40 / (0.1 + ring4), rel=1e-6)
    assert by["strong", 4]["compute_s"] == pytest.approx(0.1)  # a quarter of the batch each
    assert by["strong", 4]["global_batch"] == pytest.approx(40)
    assert all(p["predicted"] for p in predicted)
    # compute taken as proportional to the batch: at 4 workers each has the weak batch again
    assert by["strong", 4]["efficiency"] == pytest.approx(by["weak", 4]["efficiency"])
    assert by["weak", 2]["efficiency"] < by["strong", 2]["efficiency"] < 1


def test_link_model_undoes_the_rings_2_n_minus_1_steps():
    # 4 ranks, link latency 10 us and 1 GB/s: the whole all-reduce takes 6 alpha + 1.5 S / B.
    rows = _allreduce_rows(4, 6 * 10e-6, 1.5e-9)
    link = bench.link_model(rows)
    assert link == {"alpha_s": pytest.approx(10e-6), "bandwidth_GBps": pytest.approx(1.0)}
    assert bench.ring_seconds(1 << 20, 4, **link) == pytest.approx(6 * 10e-6 + 1.5 * (1 << 20) / 1e9)
    with pytest.raises(ValueError, match="come from one rank.*nproc >= 2"):
        bench.link_model(_allreduce_rows(1, 1e-5, 1e-9))


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
    assert bench.main("allreduce") == 0
    out = capsys.readouterr().out
    assert calls["nproc"] == 4 and calls["algorithms"] == ("builtin", "ring", "doubling")
    assert "ring/builtin" in out and "doubling/builtin" in out
    last = [line for line in out.splitlines() if line.strip().startswith("16777216")][0]
    assert last.split()[-2:] == ["0.80", "0.50"]  # builtin time / ring time, / doubling time
    assert "fit ring: alpha = 75.0 us, bandwidth = 0.53 GB/s" in out
    assert "ring model 2(n-1)(alpha + S/n/B) with the builtin's link (alpha 10.0 us, B 1.00 GB/s)" in out
    assert bench.main("allreduce", nproc=3) == 0  # 3 ranks: no recursive doubling (needs 2^k)
    assert calls["algorithms"] == ("builtin", "ring")
    assert bench.main("allreduce", nproc=1) == 2
    assert "--nproc must be >= 2" in capsys.readouterr().err


def test_predict_scaling_needs_two_ranks_and_a_one_worker_row():
    one = {"mode": "weak", "workers": 1, "per_worker_batch": 10, "global_batch": 10,
           "step_s": 0.1, "samples_per_s": 100.0, "grad_bytes": 1000}
    with pytest.raises(ValueError, match="nproc >= 2"):
        bench.predict_scaling([one], _allreduce_rows(1, 1e-5, 1e-9), [1, 2])
    with pytest.raises(ValueError, match="needs its 1-worker row"):
        bench.predict_scaling([{**one, "workers": 2}], _allreduce_rows(2, 1e-5, 1e-9), [1, 2])


def test_bucket_sweep_counts_buckets_on_one_rank(group):
    rows = bench.bucket_sweep([0.25, 100], batch=4, steps=1, warmup=1)
    assert [r["bucket_cap_mb"] for r in rows] == [0.25, 100]
    params_mb = sum(p.numel() * 4 for p in bench.wide_mlp().parameters()) / 1e6
    assert all(r["MB_per_step"] == pytest.approx(params_mb) for r in rows)
    assert rows[0]["allreduces"] > 10 and rows[1]["allreduces"] <= 2 and rows[1]["step_s"] > 0


@pytest.mark.parametrize("caps", [[], [0], [1, -2]])
def test_bucket_sweep_rejects_bad_caps(caps):
    with pytest.raises(ValueError, match="caps_mb must be positive sizes"):
        bench.bucket_sweep(caps)


@pytest.mark.slow
def test_scaling_sweep_two_workers_in_one_launch(two_cores):
    from functools import partial

    from labkit.models import convnet

    rows = bench.scaling_sweep([1, 2], modes=("weak", "strong", "independent"),
                               per_worker_batch=4, model=partial(convnet, width=4), steps=2,
                               warmup=1, repeats=2)
    got = {(r["mode"], r["workers"]): r for r in rows}
    assert sorted(got) == sorted((m, n) for m in ("weak", "strong", "independent") for n in (1, 2))
    assert [got["weak", n]["global_batch"] for n in (1, 2)] == [4, 8]
    assert [got["strong", n]["per_worker_batch"] for n in (1, 2)] == [8, 4]
    assert got["independent", 1]["step_s_all"] == got["weak", 1]["step_s_all"]  # measured once
    assert all(len(r["step_s_all"]) == 2 and r["step_s"] > 0 for r in rows)
    assert all(got[m, 1]["speedup"] == 1 for m in ("weak", "strong", "independent"))
    params = sum(p.numel() * 4 for p in convnet(width=4).parameters())
    assert {r["grad_bytes"] for r in rows} == {params}


def test_bench_ddp_prints_efficiency_and_the_ceiling(monkeypatch, capsys):
    times = {("weak", 1): [0.1], ("weak", 2): [0.125], ("independent", 1): [0.1],
             ("independent", 2): [0.11]}
    batches = dict.fromkeys(times, 64)
    monkeypatch.setattr(bench, "ddp_efficiency",
                        lambda nproc, repeats: bench._scaling_rows(times, batches, 264872))
    assert "ddp" in BENCHMARKS
    assert bench.main("ddp") == 0
    out = capsys.readouterr().out
    assert "64 images per worker, one thread each, 265 kB of gradients" in out
    assert "efficiency 2 workers = 0.800   (target >= 0.90)" in out
    assert "hardware ceiling (no communication) = 0.909;  DDP / ceiling = 0.880" in out


@pytest.mark.gpu
def test_scaling_sweep_on_gpus():
    from functools import partial

    from labkit.models import convnet

    counts = bench.worker_counts()  # every GPU here
    rows = bench.scaling_sweep(counts, modes=("weak",), per_worker_batch=64,
                               model=partial(convnet, width=64), steps=5, repeats=1)
    assert [r["workers"] for r in rows] == counts
    assert all(r["samples_per_s"] > 0 for r in rows)
    if len(counts) > 1:
        assert rows[-1]["efficiency"] > 0.5


@pytest.mark.gpu
def test_bucket_sweep_on_a_gpu_with_nccl(nccl_group):
    rows = bench.bucket_sweep([0.25, 100], batch=64, steps=3)
    assert rows[0]["allreduces"] > rows[1]["allreduces"] >= 1

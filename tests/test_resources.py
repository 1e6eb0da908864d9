"""labkit.resources: the memory estimate and search, the peak measured, threads, GPU shares."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

from labkit import launch, resources
from labkit.launcher import LaunchError

from .conftest import cuda_gpus

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


# ---- largest_batch -----------------------------------------------------------------------------


def test_largest_batch_finds_the_boundary_with_few_calls():
    calls = []

    def fits(b):
        calls.append(b)
        return b <= 300

    assert resources.largest_batch(fits) == 300
    assert len(calls) <= 2 * 9 + 2  # doubling to 512, then bisecting down to one batch
    assert resources.largest_batch(lambda b: b <= 300, start=16) == 300
    assert resources.largest_batch(lambda b: b <= 7, start=7) == 7


def test_largest_batch_with_a_tolerance_returns_a_batch_that_fits_close_to_the_answer():
    calls = []

    def fits(b):
        calls.append(b)
        return b <= 1000

    found = resources.largest_batch(fits, start=16, tolerance=0.05)
    assert fits(found) and found >= 1000 / 1.05
    exact_calls = len(calls) - 1
    calls.clear()
    resources.largest_batch(fits, start=16)
    assert exact_calls < len(calls) - 1


def test_largest_batch_edges_nothing_fits_and_everything_fits():
    assert resources.largest_batch(lambda b: False) == 0
    assert resources.largest_batch(lambda b: b <= 3, start=4) == 0
    assert resources.largest_batch(lambda b: True, limit=100) == 100


@pytest.mark.parametrize("start,limit", [(0, 10), (-1, 10), (11, 10), (1.5, 10), (True, 10)])
def test_largest_batch_refuses_a_bad_start(start, limit):
    with pytest.raises(ValueError, match="need a whole start with 1 <= start <= limit"):
        resources.largest_batch(lambda b: True, start=start, limit=limit)


# ---- training_memory ---------------------------------------------------------------------------


def test_training_memory_terms_follow_the_parameter_count_and_the_batch():
    model = _mlp()
    n = sum(p.numel() for p in model.parameters())  # 6*16 + 16 + 16*2 + 2 = 146
    est = resources.training_memory(model, torch.zeros(6), 10)
    assert (est["params"], est["grads"], est["optimizer"]) == (4 * n, 4 * n, 8 * n)
    # Saved for backward, per sample: the input (6 floats, for the first Linear's weight
    # gradient) and the ReLU's output (16 floats, kept by the ReLU and the second Linear).
    assert est["per_sample"] == (6 + 16) * 4
    assert est["activations"] == 10 * est["per_sample"]
    assert est["total"] == 16 * n + est["activations"]
    mixed = resources.training_memory(model, torch.zeros(6), 10, precision="mixed")
    assert (mixed["params"], mixed["optimizer"]) == (2 * n, 12 * n)


@pytest.mark.parametrize("kwargs,match", [
    ({"optimizer": "lamb"}, "no bytes-per-parameter rule for precision='fp32', optimizer='lamb'"),
    ({"precision": "fp8"}, "no bytes-per-parameter rule for precision='fp8'"),
    ({"batch": 0}, "batch must be a whole number >= 1, got 0"),
    ({"batch": 2.5}, "batch must be a whole number >= 1, got 2.5"),
])
def test_training_memory_refuses_bad_input(kwargs, match):
    args = {"batch": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        resources.training_memory(_mlp(), torch.zeros(6), args.pop("batch"), **args)


# ---- peak_memory -------------------------------------------------------------------------------


def _vgg():
    from labkit import models

    return models.vgg16(num_classes=10, width=0.125, image_size=32)


def _peaks(batches):
    return [resources.peak_memory(_vgg, torch.zeros(3, 32, 32), b) for b in batches]


@pytest.mark.slow
def test_peak_memory_measured_on_the_cpu_matches_the_estimate_where_activations_dominate():
    # A deep network: the backward pass's temporaries (one layer's activation gradients at a
    # time) are small beside the activations of all 16 layers, which the estimate counts.
    batches = [128, 256]
    peaks = launch(_peaks, batches, nproc=1, env=resources.MEASURE_ENV, show_ranks=[]).values[0]
    est = {b: resources.training_memory(_vgg(), torch.zeros(3, 32, 32), b) for b in batches}
    for p in peaks:
        e = est[p["batch"]]
        assert p["held"] == pytest.approx(e["params"] + e["optimizer"], rel=0.1)
        assert p["peak"] == pytest.approx(e["total"], rel=0.15), (p, e)
    grown = peaks[1]["peak"] - peaks[0]["peak"]
    assert grown == pytest.approx(128 * est[128]["per_sample"], rel=0.15)


def test_peak_memory_on_the_cpu_refuses_a_process_without_measure_env(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(RuntimeError,
                       match="run it in a process started with env=resources.MEASURE_ENV"):
        resources.peak_memory(_mlp, torch.zeros(6), 4)


# ---- threads and GPUs --------------------------------------------------------------------------


def test_matmul_throughput_gives_up_when_the_other_jobs_never_come(tmp_path):
    with pytest.raises(TimeoutError, match="only 1 of 2 jobs reached .* in 0.2 s: did every job"):
        resources.matmul_throughput(0.1, ready_dir=str(tmp_path), jobs=2, wait=0.2)


def test_thread_env_sets_every_math_librarys_thread_count():
    assert resources.thread_env(3) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3",
                                       "OPENBLAS_NUM_THREADS": "3"}
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads must be a whole number >= 1"):
            resources.thread_env(bad)


def test_gpu_partitions_give_each_job_its_own_equal_share():
    assert resources.gpu_partitions(8, 2) == ["0,1,2,3", "4,5,6,7"]
    assert resources.gpu_partitions(4, 4) == ["0", "1", "2", "3"]
    assert resources.gpu_partitions(8, 3) == ["0,1", "2,3", "4,5"]  # equal shares: 6 and 7 idle
    for n, jobs in [(1, 2), (0, 1), (4, 0)]:
        with pytest.raises(ValueError, match="cannot give .* a GPU each"):
            resources.gpu_partitions(n, jobs)


def _fail_if(value):
    if value == "boom":
        raise RuntimeError("this run fails on purpose")
    return value


def test_launch_together_runs_each_with_its_own_keywords_and_keeps_their_order(tmp_path):
    # Two matmul jobs with different thread budgets, timed in one window they enter together.
    runs = resources.launch_together(resources.matmul_throughput, 0.2, size=64, nproc=1,
                                      show_ranks=[], ready_dir=str(tmp_path), jobs=2,
                                      runs=[{"env": resources.thread_env(2)},
                                            {"env": resources.thread_env(1)}])
    assert [r.values[0]["threads"] for r in runs] == [2, 1]
    assert all(r.values[0]["gflops"] > 0 and r.values[0]["seconds"] >= 0.2 for r in runs)
    assert len(list(tmp_path.glob("*.ready"))) == 2


def test_launch_together_raises_the_failure_after_every_run_ended():
    with pytest.raises(LaunchError, match="this run fails on purpose"):
        resources.launch_together(_fail_if, nproc=1, show_ranks=[],
                                  runs=[{"value": "fine"}, {"value": "boom"}])
    from labkit import stray_workers

    assert not stray_workers()


@pytest.mark.parametrize("runs", [[], [1], "env"])
def test_launch_together_refuses_runs_that_are_not_dicts(runs):
    with pytest.raises(ValueError, match="runs must be a non-empty list of dicts"):
        resources.launch_together(_fail_if, "X", runs=runs)


@pytest.mark.gpu
def test_cuda_visible_devices_partitions_do_not_overlap():
    if cuda_gpus() < 2:
        pytest.skip("needs 2 GPUs")

    def seen():
        return [str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())]

    parts = resources.gpu_partitions(cuda_gpus(), 2)
    a, b = (r.values[0] for r in resources.launch_together(
        seen, nproc=1, show_ranks=[], runs=[{"env": {"CUDA_VISIBLE_DEVICES": p}} for p in parts]))
    assert len(a) == len(parts[0].split(",")) and not set(a) & set(b)


@pytest.mark.gpu
def test_peak_memory_on_a_gpu_counts_the_cuda_allocator():
    if cuda_gpus() < 1:
        pytest.skip("needs a GPU")
    p = resources.peak_memory(_vgg, torch.zeros(3, 32, 32, device="cuda"), 1024)
    e = resources.training_memory(_vgg(), torch.zeros(3, 32, 32), 1024)
    assert p["held"] == pytest.approx(e["params"] + e["optimizer"], rel=0.1)
    assert p["peak"] == pytest.approx(e["total"], rel=0.2)

"""labkit.ddp: global-batch arithmetic, atomic rank-0 checkpoints, replica checks (gloo ranks)."""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import bench, ddp, launch
from labkit.ddp import per_worker_batch, replica_divergence, save_on_rank0
from tests.fakes import allreduce_rows

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def ddp_checks(folder: str) -> dict:
    """Run on every rank of one launch: what each helper does inside a real process group."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.ddp import per_worker_batch, replica_divergence, save_on_rank0

    rank = dist.get_rank()
    out = {"rank": rank, "batch": per_worker_batch(64),
           "explicit_world": per_worker_batch(64, world_size=4)}
    try:
        per_worker_batch(64, dataset_size=40)  # 20 samples per worker: no batch of 32
    except ValueError as e:
        out["short_dataset"] = str(e)

    # Count torch.save calls per rank; rank 0 writes late, so a rank that loads before the
    # barrier would find no file.
    calls = []
    real_save = torch.save

    def slow_counting_save(obj, f, *args, **kwargs):
        calls.append(rank)
        time.sleep(1.0)
        return real_save(obj, f, *args, **kwargs)

    torch.save = slow_counting_save
    try:
        path = save_on_rank0({"saved_by": rank, "w": torch.arange(3)}, Path(folder) / "ckpt.pt")
        try:
            out["loaded"] = torch.load(path, map_location="cpu")  # right after it returns
        except Exception as e:  # reported by the test below, not as a failed launch
            out["loaded"] = repr(e)
    finally:
        torch.save = real_save
    out["save_calls"] = len(calls)
    out["path"] = str(path)
    out["files"] = sorted(os.listdir(folder))

    torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
    model = DDP(torch.nn.Linear(4, 2))
    out["in_sync"] = replica_divergence(model)
    if rank == 1:
        with torch.no_grad():
            model.module.weight[0, 0] += 0.5
    out["perturbed"] = replica_divergence(model)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of ddp_checks on two workers; its per-rank results and the checkpoint folder."""
    folder = tmp_path_factory.mktemp("ddp")
    values = launch(ddp_checks, str(folder), nproc=2, show_ranks=[], timeout=120, warm=True).values
    return values, folder


# ---- per_worker_batch ------------------------------------------------------------------------


def test_per_worker_batch_splits_the_global_batch():
    assert per_worker_batch(256, world_size=4) == 64
    assert per_worker_batch(256, world_size=4, dataset_size=1000) == 64
    assert per_worker_batch(7, world_size=1) == 7


def test_per_worker_batch_without_a_process_group_is_one_worker():
    assert not dist.is_initialized()
    assert per_worker_batch(100) == 100
    assert per_worker_batch(100, dataset_size=100) == 100


def test_per_worker_batch_that_does_not_split_names_both_numbers_and_multiples():
    with pytest.raises(ValueError, match=r"global batch of 100 does not split evenly over 3 "
                                         r"workers: use a multiple of 3 \(e\.g\. 99 or 102\)"):
        per_worker_batch(100, world_size=3)


def test_per_worker_batch_needs_a_full_batch_on_every_worker():
    with pytest.raises(ValueError, match=r"50 samples over 8 workers is 6 each: not one full "
                                         r"batch of 8 per worker.*at most 48"):
        per_worker_batch(64, world_size=8, dataset_size=50)


def test_per_worker_batch_dataset_boundary_is_exactly_one_batch_per_worker():
    assert per_worker_batch(64, world_size=8, dataset_size=64) == 8
    with pytest.raises(ValueError, match="63 samples over 8 workers is 7 each"):
        per_worker_batch(64, world_size=8, dataset_size=63)


@pytest.mark.parametrize("global_batch", [0, -8])
def test_per_worker_batch_below_one(global_batch):
    with pytest.raises(ValueError, match=f"need global_batch >= 1.*got {global_batch} and 2"):
        per_worker_batch(global_batch, world_size=2)


# ---- save_on_rank0 and replica_divergence without a process group -----------------------------


def test_save_on_rank0_without_a_process_group_saves_and_leaves_no_temp_file(tmp_path):
    path = save_on_rank0({"epoch": 3, "w": torch.ones(2)}, tmp_path / "runs" / "ckpt.pt")
    assert path == tmp_path / "runs" / "ckpt.pt"
    state = torch.load(path)
    assert state["epoch"] == 3 and torch.equal(state["w"], torch.ones(2))
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_save_on_rank0_keeps_the_previous_checkpoint_when_saving_fails(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_on_rank0({"epoch": 1}, path)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        save_on_rank0({"epoch": 2, "hook": lambda: None}, path)
    assert torch.load(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"], "a temporary file was left"


def test_replica_divergence_without_a_process_group_is_zero():
    assert replica_divergence(torch.nn.Linear(3, 1)) == 0.0


# ---- inside a launch with two workers ---------------------------------------------------------


def test_per_worker_batch_reads_the_world_size_of_the_process_group(two_ranks):
    values, _ = two_ranks
    assert [v["batch"] for v in values] == [32, 32]
    assert [v["explicit_world"] for v in values] == [16, 16]
    for v in values:
        assert "40 samples over 2 workers is 20 each" in v["short_dataset"]


def test_save_on_rank0_writes_once_and_every_rank_loads_it_when_it_returns(two_ranks):
    values, folder = two_ranks
    assert [v["save_calls"] for v in values] == [1, 0], "only rank 0 writes"
    for v in values:
        assert v["path"] == str(folder / "ckpt.pt")
        assert isinstance(v["loaded"], dict), f"rank {v['rank']} could not load: {v['loaded']}"
        assert v["loaded"]["saved_by"] == 0
        assert torch.equal(v["loaded"]["w"], torch.arange(3))
        assert v["files"] == ["ckpt.pt"]


def test_replica_divergence_is_zero_for_ddp_and_the_same_on_every_rank_after_drift(two_ranks):
    values, _ = two_ranks
    assert [v["in_sync"] for v in values] == [0.0, 0.0]
    drift = [v["perturbed"] for v in values]
    assert drift[0] == drift[1]
    assert drift[0] == pytest.approx(0.5, abs=1e-6)


# ------------------------------------------------ data-parallel scaling, measured and predicted


@pytest.fixture
def two_cores(monkeypatch):
    """A machine with two CPU cores and no GPU, whatever this one has."""
    monkeypatch.setattr(ddp, "machine_workers", lambda backend="auto": (2, "CPU cores"))


def test_worker_counts_are_powers_of_two_and_the_limit():
    assert ddp.worker_counts(1) == [1]
    assert ddp.worker_counts(8) == [1, 2, 4, 8]
    assert ddp.worker_counts(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="at least one worker"):
        ddp.worker_counts(0)


def test_machine_workers_counts_cores_for_gloo(monkeypatch):
    import os

    monkeypatch.setattr("labkit.profile.visible_gpu_count", lambda: 4)
    assert ddp.machine_workers() == (4, "GPUs")
    assert ddp.machine_workers("gloo") == (len(os.sched_getaffinity(0)), ddp.machine_workers(
        "gloo")[1])
    assert "CPU core" in ddp.machine_workers("gloo")[1]


def test_worker_counts_beyond_the_machine_are_skipped_with_a_message(two_cores, capsys):
    assert ddp._capped_workers([8, 1, 2, 4, 2], False, "auto") == [1, 2]
    out = capsys.readouterr().out
    assert "skipping 4, 8 workers: this machine has 2 CPU cores" in out
    assert "oversubscribe=True" in out
    assert ddp._capped_workers([1, 4], True, "auto") == [1, 4]  # asked for: no message
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("workers, match", [
    ([], "at least one worker count"), ([0, 1], "each count must be a whole number >= 1"),
    ([1.5], "each count must be a whole number >= 1"),
    ([4, 8], "no worker count left"),
])
def test_bad_worker_counts_are_refused(two_cores, workers, match):
    with pytest.raises(ValueError, match=match):
        ddp._capped_workers(workers, False, "auto")


@pytest.mark.parametrize("kwargs, match", [
    ({"modes": ("weak", "fast")}, "modes must name some of weak, strong, independent"),
    ({"modes": ()}, "modes must name"),
    ({"steps": 0}, "need steps >= 1"),
    ({"repeats": 0}, "repeats >= 1"),
    ({"modes": ("strong",), "global_batch": 63}, "63 does not split evenly over 2 workers"),
])
def test_measure_scaling_refuses_bad_arguments_before_launching(two_cores, monkeypatch, kwargs,
                                                                match):
    monkeypatch.setattr("labkit.launcher.launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match=match):
        ddp.measure_scaling([1, 2], **kwargs)


def test_measure_scaling_beyond_the_machine_is_refused_before_launching(two_cores, monkeypatch,
                                                                        capsys):
    # Workers side by side, one per core or GPU: a sweep with no count that fits is an error.
    monkeypatch.setattr("labkit.launcher.launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(ValueError, match="no worker count left to measure: use at most 2"):
        ddp.measure_scaling([4, 8])
    assert "skipping 4, 8 workers: this machine has 2 CPU cores" in capsys.readouterr().out


def test_scaling_rows_speedup_and_efficiency():
    times = {("weak", 1): [0.2, 0.1, 0.3], ("weak", 2): [0.25], ("strong", 1): [0.4],
             ("strong", 2): [0.25]}
    batches = {("weak", 1): 8, ("weak", 2): 8, ("strong", 1): 16, ("strong", 2): 8}
    rows = ddp._scaling_rows(times, batches, grad_bytes=1000)
    assert [(r["mode"], r["workers"]) for r in rows] == [("weak", 1), ("weak", 2), ("strong", 1),
                                                         ("strong", 2)]
    weak1, weak2, strong1, strong2 = rows
    assert weak1["step_s"] == 0.2 and weak1["samples_per_s"] == pytest.approx(40)  # the median
    assert weak2["global_batch"] == 16 and weak2["samples_per_s"] == pytest.approx(64)
    assert weak2["speedup"] == pytest.approx(1.6) and weak2["efficiency"] == pytest.approx(0.8)
    assert strong2["global_batch"] == strong1["global_batch"] == 16
    assert strong2["speedup"] == pytest.approx(1.6)
    assert weak1["step_s_all"] == [0.2, 0.1, 0.3] and weak1["grad_bytes"] == 1000


def test_predict_scaling_is_compute_plus_a_ring_allreduce():
    rows = [{"mode": "weak", "workers": 1, "per_worker_batch": 10, "global_batch": 10,
             "step_s": 0.1, "samples_per_s": 100.0, "grad_bytes": 1_000_000},
            {"mode": "strong", "workers": 1, "per_worker_batch": 40, "global_batch": 40,
             "step_s": 0.4, "samples_per_s": 100.0, "grad_bytes": 1_000_000}]
    # measured on 2 ranks: one link's alpha is half the call's, its beta the call's
    predicted = ddp.predict_scaling(rows, allreduce_rows(2, 20e-6, 1e-9), [1, 2, 4])
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


def test_predict_scaling_needs_two_ranks_and_a_one_worker_row():
    one = {"mode": "weak", "workers": 1, "per_worker_batch": 10, "global_batch": 10,
           "step_s": 0.1, "samples_per_s": 100.0, "grad_bytes": 1000}
    with pytest.raises(ValueError, match="nproc >= 2"):
        ddp.predict_scaling([one], allreduce_rows(1, 1e-5, 1e-9), [1, 2])
    with pytest.raises(ValueError, match="needs its 1-worker row"):
        ddp.predict_scaling([{**one, "workers": 2}], allreduce_rows(2, 1e-5, 1e-9), [1, 2])


def test_predict_efficiency_is_predict_scalings_weak_model():
    one = {"mode": "weak", "workers": 1, "per_worker_batch": 64, "global_batch": 64,
           "step_s": 0.25, "samples_per_s": 256.0, "grad_bytes": 553_000_000}
    sweep = allreduce_rows(4, 60e-6, 1e-9)
    link = bench.link_model(sweep)
    by_rows = ddp.predict_scaling([one], sweep, [1, 8, 512])
    by_size = ddp.predict_efficiency(553_000_000, 0.25, [1, 8, 512], **link)
    assert [r["workers"] for r in by_size] == [1, 8, 512]
    for a, b in zip(by_rows, by_size, strict=True):
        assert b["efficiency"] == pytest.approx(a["efficiency"], rel=1e-12)
        assert b["allreduce_s"] == pytest.approx(a["allreduce_s"], rel=1e-12)
    assert by_size[0]["efficiency"] == 1 and by_size[0]["allreduce_s"] == 0
    ring = 2 * 511 * link["alpha_s"] + 2 * 511 / 512 * 553e6 / (link["bandwidth_GBps"] * 1e9)
    assert by_size[2]["step_s"] == pytest.approx(0.25 + ring, rel=1e-12)
    # more gradient bytes for the same compute: lower efficiency, the ordering notebook 08 uses
    small = ddp.predict_efficiency(102e6, 0.25, [512], **link)[0]
    assert small["efficiency"] > by_size[2]["efficiency"]


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((-1, 0.1, [2]), {}, "need grad_bytes >= 0 and compute_s > 0"),
    ((1e6, 0, [2]), {}, "need grad_bytes >= 0 and compute_s > 0"),
    ((1e6, 0.1, []), {}, "workers is empty"),
    ((1e6, 0.1, [0]), {}, "a worker count must be a whole number >= 1"),
    ((1e6, 0.1, [2]), {"bandwidth_GBps": 0}, "bandwidth_GBps > 0"),
])
def test_predict_efficiency_rejects_bad_inputs(args, kwargs, message):
    link = {"alpha_s": 1e-5, "bandwidth_GBps": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        ddp.predict_efficiency(*args, **link)


def test_bucket_sweep_counts_buckets_on_one_rank(group):
    rows = ddp.bucket_sweep([0.25, 100], batch=4, steps=1, warmup=1)
    assert [r["bucket_cap_mb"] for r in rows] == [0.25, 100]
    params_mb = sum(p.numel() * 4 for p in ddp.wide_mlp().parameters()) / 1e6
    assert all(r["MB_per_step"] == pytest.approx(params_mb) for r in rows)
    assert rows[0]["allreduces"] > 10 and rows[1]["allreduces"] <= 2 and rows[1]["step_s"] > 0


@pytest.mark.parametrize("caps", [[], [0], [1, -2]])
def test_bucket_sweep_rejects_bad_caps(caps):
    with pytest.raises(ValueError, match="caps_mb must be positive sizes"):
        ddp.bucket_sweep(caps)


@pytest.mark.slow
def test_measure_scaling_two_workers_in_one_launch(two_cores):
    from functools import partial

    from labkit.models import convnet

    rows = ddp.measure_scaling([1, 2], modes=("weak", "strong", "independent"),
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


@pytest.mark.gpu
def test_measure_scaling_on_gpus():
    from functools import partial

    from labkit.models import convnet

    counts = ddp.worker_counts()  # every GPU here
    rows = ddp.measure_scaling(counts, modes=("weak",), per_worker_batch=64,
                               model=partial(convnet, width=64), steps=5, repeats=1)
    assert [r["workers"] for r in rows] == counts
    assert all(r["samples_per_s"] > 0 for r in rows)
    if len(counts) > 1:
        assert rows[-1]["efficiency"] > 0.5


@pytest.mark.gpu
def test_bucket_sweep_on_a_gpu_with_nccl(nccl_group):
    rows = ddp.bucket_sweep([0.25, 100], batch=64, steps=3)
    assert rows[0]["allreduces"] > rows[1]["allreduces"] >= 1


def test_counting_allreduces_counts_and_restores(group):
    real = dist.all_reduce
    counter = {"calls": 0, "bytes": 0}
    with ddp.counting_allreduces(counter):
        dist.all_reduce(torch.ones(10))
        dist.all_reduce(torch.ones(4, dtype=torch.float16))
    assert counter == {"calls": 2, "bytes": 48} and dist.all_reduce is real


def test_bucket_sweep_measures_overlap_on_one_rank(group):
    rows = ddp.bucket_sweep([0.1, 100], model=_small_mlp, batch=8, steps=1, warmup=1,
                             repeats=2, overlap=True)
    assert [r["bucket_cap_mb"] for r in rows] == [0.1, 100]
    assert rows[0]["allreduces"] > rows[1]["allreduces"] == 1
    for r in rows:
        assert min(r["compute_s"], r["step_s"], r["serial_s"]) > 0 and r["ranks"] == 1
        assert r["comm_s"] == pytest.approx(r["serial_s"] - r["compute_s"])
        assert r["hidden_fraction"] is None or isinstance(r["hidden_fraction"], float)


@pytest.mark.parametrize("caps, kwargs, match", [
    ([], {}, "caps_mb must be positive sizes"), ([0], {}, "caps_mb must be positive sizes"),
    (25, {}, "caps_mb must be positive sizes"), ([25], {"repeats": 0}, "repeats must be"),
])
def test_bucket_sweep_with_overlap_refuses_bad_input(caps, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ddp.bucket_sweep(caps, overlap=True, **kwargs)


def _small_mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))

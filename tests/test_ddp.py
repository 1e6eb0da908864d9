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

from labkit import launch
from labkit.ddp import per_worker_batch, replica_divergence, save_on_rank0

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
    values = launch(ddp_checks, str(folder), nproc=2, show_ranks=[], timeout=120).values
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

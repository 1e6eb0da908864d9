"""labkit.capstone: the grader passes the reference solution and fails each known mistake.

The solution and its mistakes live in solutions/capstone_solution.py. The runs here are tiny
(200 training images, two epochs, a narrow network, two ranks): they prove the grader's
verdicts, not the network's accuracy, so the accuracy target is set low.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import capstone

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "solutions"))
import capstone_solution as solution  # noqa: E402

TINY = {"epochs": 2, "train_per_class": 20, "base_batch": 16}
TARGET = 0.3  # chance is 0.1; two epochs on 200 images reach about 0.6
BUDGET = 240.0


@pytest.fixture
def task(tmp_path):
    return capstone.capstone_task(**TINY, checkpoint=tmp_path / "ckpt.pt")


def grade(fn, task, nproc=2):
    return capstone.capstone(functools.partial(fn, width=4), task, nproc=nproc, target=TARGET,
                          time_budget=BUDGET)


def test_the_default_checkpoint_folder_is_removed_when_the_process_exits(tmp_path):
    code = ("from labkit import capstone\n"
            "task = capstone.capstone_task(epochs=2, train_per_class=1)\n"
            "open(task.checkpoint, 'wb').write(b'x')\n"
            "print(task.checkpoint)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    checkpoint = Path(out.stdout.strip())
    assert checkpoint.parent.parent == tmp_path and checkpoint.parent.name.startswith(
        "labkit-capstone-")
    assert not checkpoint.parent.exists(), "the folder outlived the process"


# ---- bad input is an error that says what to do (no worker starts) ----------------------------


def test_bad_input_is_an_error_that_says_what_to_do(task):
    with pytest.raises(TypeError, match="pass your per-worker training function"):
        capstone.capstone("train_ddp", task)
    with pytest.raises(TypeError, match="capstone_task"):
        capstone.capstone(solution.train_ddp, {"epochs": 2})
    for nproc in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="nproc must be a whole number"):
            capstone.capstone(solution.train_ddp, task, nproc=nproc)
    with pytest.raises(ValueError, match="target is an accuracy"):
        capstone.capstone(solution.train_ddp, task, target=90)
    with pytest.raises(ValueError, match="time_budget"):
        capstone.capstone(solution.train_ddp, task, time_budget=0)
    with pytest.raises(ValueError, match="epochs must be a whole number >= 2"):
        capstone.capstone_task(epochs=1)


def test_the_task_keeps_the_held_out_split_apart(task):
    from labkit import data

    train, val, held_out = capstone._capstone_splits(task.image_size, None)
    seen = {data.content_hash(s[i:i + 1]) for s in (train, val) for i in range(len(s))}
    assert not any(data.content_hash(held_out[i:i + 1]) in seen for i in range(len(held_out)))
    assert len(train) + len(val) + len(held_out) == 1797
    assert len(task.train) == 200 and len(task.val) == len(val)
    images = [v for v in vars(task).values() if isinstance(v, data.ImageSet)]
    assert images == [task.train, task.val], "the task must carry no other images"



# ---- the criteria, on recorded runs (no worker starts) -----------------------------------------


def records(rank=0, **changes):
    rec = {"rank": rank, "world_size": 2, "returned": "dict", "param_hash": "a",
           "param_sums": [1.0], "val_acc": 0.9, "ddp_wrapped": 1, "train_samples": 400,
           "eval_samples": 100, "seconds": 1.0, "gpu_augment": 0, "batch_hashes": [f"r{rank}"],
           "eval_hashes": set(),
           "transforms": [{"size": 200, "steps": ["RandomAffine", "ToDtype"]}],
           "sampler_passes": [{"id": 1, "epoch": e, "size": 200, "shuffle": True}
                              for e in range(3)],
           "steps": [{"lr": lr, "batch": 16} for lr in (0.025, 0.05, 0.1, 0.1)]}
    rec.update(changes)
    return rec


def test_set_epoch_is_read_from_the_sampler_passes(task):
    assert capstone._crit_set_epoch(records(), task)
    stuck = records(sampler_passes=[{"id": 1, "epoch": 0, "size": 200, "shuffle": True}] * 3)
    verdict = capstone._crit_set_epoch(stuck, task)
    assert not verdict and "[0, 0, 0]" in verdict.detail and "set_epoch(epoch)" in verdict.hint
    verdict = capstone._crit_set_epoch(records(sampler_passes=[]), task)
    assert not verdict and "no DistributedSampler" in verdict.detail


def test_lr_must_be_scaled_with_the_global_batch_and_warmed_up(task):
    base = task.base_lr  # 0.05 for base_batch 16; two workers x 16 -> 0.1
    assert capstone._crit_lr(records()["steps"], task, 2)
    unscaled = [{"lr": lr, "batch": 16} for lr in (0.01, 0.03, base, base)]
    verdict = capstone._crit_lr(unscaled, task, 2)
    assert not verdict and "unscaled" in verdict.detail and "linear_scaled_lr" in verdict.hint
    cold = [{"lr": 0.1, "batch": 16}] * 4
    verdict = capstone._crit_lr(cold, task, 2)
    assert not verdict and "no warm-up" in verdict.detail
    # Keeping the global batch (8 per worker) needs no scaling: the rule is the batch ratio.
    assert capstone._crit_lr([{"lr": lr, "batch": 8} for lr in (0.01, base)], task, 2)
    # A task that asks for no warm-up does not get one demanded.
    assert capstone._crit_lr(cold, dataclasses.replace(task, warmup_epochs=0), 2)


def test_replicas_that_differ_fail_the_workers_criterion():
    assert capstone._crit_workers([records(), records(rank=1)])
    verdict = capstone._crit_workers([records(ddp_wrapped=0),
                                      records(rank=1, param_hash="b", param_sums=[2.0],
                                              ddp_wrapped=0)])
    assert not verdict and "not averaged" in verdict.detail
    assert "DistributedDataParallel" in verdict.hint
    assert not capstone._crit_workers([records(world_size=1)])
    same = capstone._crit_workers([records(batch_hashes=["x"]),
                                   records(rank=1, batch_hashes=["x"])])
    assert not same and "the same batches" in same.detail


def test_no_random_transform_fails_augmentation(task):
    assert capstone._crit_augmentation([records()], task)
    plain = records(transforms=[{"size": 200, "steps": ["Resize", "ToDtype", "Normalize"]}])
    assert not capstone._crit_augmentation([plain], task)
    assert capstone._crit_augmentation([records(transforms=[], gpu_augment=3)], task)


def test_a_function_that_returns_nothing_is_told_what_to_return(task, capsys):
    verdict = capstone._grade([records(returned="NoneType", val_acc=None)], task, "ada", {})
    assert not verdict and verdict.failed == ["runs"] and "return {" in verdict.criteria[0].hint


# ---- the recorder, in this process (no worker starts) ------------------------------------------


def test_the_recorder_sees_what_training_does_and_leaves_nothing_behind():
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from labkit import augment, data

    original_iter = DistributedSampler.__iter__
    images = data.take(data.digits(8), 2)  # 20 images
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = capstone.Recorder(rank=0, world_size=2)
    with recorder.watching():
        train_ds = data.to_torch(images, augment.augmentation(8, config=augment.AugmentConfig()))
        sampler = DistributedSampler(train_ds, num_replicas=2, rank=0, shuffle=True)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for x, y in DataLoader(train_ds, batch_size=5, sampler=sampler):
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        augment.gpu_augment(torch.rand(2, 3, 8, 8))
        model.eval()
        with torch.no_grad():
            model(next(iter(DataLoader(data.to_torch(images), batch_size=6)))[0])
    recorder.on_result({"model": model, "val_acc": 0.5})
    rec = recorder.record
    assert [(p["epoch"], p["size"], p["shuffle"]) for p in rec["sampler_passes"]] == \
        [(0, 20, True), (1, 20, True)]
    assert rec["steps"] == [{"lr": 0.1, "batch": 5}] * 4 and rec["train_samples"] == 20
    assert len(rec["batch_hashes"]) == 3 and rec["gpu_augment"] == 1
    assert [t["size"] for t in rec["transforms"]] == [20, 20]
    assert "RandomResizedCrop" in rec["transforms"][0]["steps"]
    assert not rec["transforms"][1]["steps"]
    assert rec["eval_samples"] == 6 and len(rec["eval_hashes"]) == 6
    assert rec["returned"] == "dict" and rec["val_acc"] == 0.5 and rec["model"] is model
    assert len(rec["param_hash"]) == 64 and len(rec["param_sums"]) == 2

    # Everything is removed on the way out, also when the function raises.
    with pytest.raises(RuntimeError, match="kaput"), recorder.watching():
        raise RuntimeError("kaput")
    assert DistributedSampler.__iter__ is original_iter
    data.to_torch(images)
    augment.gpu_augment(torch.rand(2, 3, 8, 8))
    opt.step()
    assert len(rec["transforms"]) == 2 and rec["gpu_augment"] == 1 and len(rec["steps"]) == 4


def test_the_recorder_counts_the_collectives_that_follow_an_evaluation(group):
    import torch

    original = group.all_reduce
    model = torch.nn.Linear(4, 2)
    recorder = capstone.Recorder(rank=0, world_size=1)
    with recorder.watching():
        group.all_reduce(torch.ones(1))  # before any evaluation: not a metric being combined
        model.eval()
        model(torch.ones(3, 4))
        group.all_reduce(torch.ones(2))
        group.all_gather_object([None], 1)
    assert recorder.record["eval_samples"] == 3
    assert recorder.record["collectives_after_eval"] == 2
    assert group.all_reduce is original


def test_the_certificate_lists_the_exercises_passed(tmp_path, monkeypatch):
    import json

    from labkit import check

    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))
    (tmp_path / "progress.json").write_text(json.dumps({"frozen_base": "2026-01-01T00:00:00"}))
    lines = "\n".join(capstone._exercises_passed())
    total = sum(1 for e in check.EXERCISES.values() if not e.id.startswith("_test"))
    assert "course exercises passed: 1 of" in lines and "01: freeze the base" in lines
    assert total >= 2


def test_a_validation_share_never_combined_is_not_honest():
    import torch

    from labkit import data

    task = capstone.capstone_task(**TINY)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(10))
    model(torch.zeros(1, 3, task.image_size, task.image_size))
    val = data.to_torch(task.val, task.eval_transform)
    half = torch.stack([val[i][0] for i in range(0, len(val), 2)])
    zero = {"val_acc": 0.5, "eval_hashes": capstone._row_hashes(half),
            "collectives_after_eval": 0, "param_hash": "a"}
    one = {**zero, "eval_hashes": capstone._row_hashes(
        torch.stack([val[i][0] for i in range(1, len(val), 2)]))}
    verdict = capstone._crit_validation(model, zero, [zero, one], task, {})
    assert not verdict and "is rank 0's share alone" in verdict.detail
    assert "all_reduce the counts" in verdict.hint
    combined = {**zero, "collectives_after_eval": 1}
    verdict = capstone._crit_validation(model, combined, [combined, one], task, {})
    assert "share alone" not in verdict.detail


# ---- real runs: the solution passes, each known mistake fails for its reason -------------------


@pytest.mark.slow
def test_the_solution_passes_with_a_certificate(task, capsys):
    verdict = grade(solution.train_ddp, task)
    out = capsys.readouterr().out
    assert verdict, out
    assert [c.exercise for c in verdict.criteria] == list(capstone.CAPSTONE_CRITERIA)
    assert "certificate of completion" in out and "all 9 criteria met" in out
    assert "course exercises passed:" in out
    f = verdict.figures
    assert f["world_size"] == 2 and f["global_batch"] == 32 and f["peak_lr"] == pytest.approx(0.1)
    assert abs(f["reported_val_acc"] - f["val_acc"]) < 0.01 and f["held_out_acc"] >= TARGET


@pytest.mark.slow
@pytest.mark.parametrize("mistake, criterion, said, also", [
    ("no set_epoch", "set_epoch", "replayed the same shuffled order", set()),
    ("no lr scaling", "lr scaling", "unscaled", set()),
    ("evaluated on the training split", "honest validation", "measured on the training split",
     set()),
    ("validation not all-reduced", "honest validation", "is rank 0's share alone", set()),
    # Ranks that trained apart hold different models: no one model has the reported accuracy.
    ("not distributed", "N workers", "gradients were not averaged", {"honest validation"}),
])
def test_each_known_mistake_fails_its_criterion(task, capsys, mistake, criterion, said, also):
    verdict = grade(solution.MISTAKES[mistake], task)
    out = capsys.readouterr().out
    assert not verdict and criterion in verdict.failed, out
    # Nothing else fails, but the mistake's consequences (a tiny run's accuracy may, too).
    assert set(verdict.failed) <= {criterion, "accuracy", *also}, out
    failed = next(c for c in verdict.criteria if c.exercise == criterion)
    assert said in failed.detail and failed.hint, out
    assert "[not yet] capstone" in out and "certificate" not in out


@pytest.mark.slow
def test_a_single_process_fails_the_workers_criterion(task):
    verdict = grade(solution.train_ddp, task, nproc=1)
    assert not verdict and "N workers" in verdict.failed
    assert "nproc=2" in next(c for c in verdict.criteria if c.exercise == "N workers").hint


def test_a_function_that_raises_or_hangs_is_a_verdict_not_an_exception(task, monkeypatch):
    from labkit import launcher

    def raising(*args, **kwargs):
        raise launcher.LaunchError("rank 1 failed with RuntimeError: forgot something", rank=1)

    monkeypatch.setattr(launcher, "launch", raising)
    verdict = capstone.capstone(solution.train_ddp, task, time_budget=BUDGET)
    assert not verdict and verdict.failed == ["runs"]
    assert "rank 1 raised" in verdict.criteria[0].detail
    assert "forgot something" in verdict.criteria[0].detail

    def hanging(*args, **kwargs):
        raise launcher.LaunchTimeout("stuck", stuck=[0], stacks={0: "..."})

    monkeypatch.setattr(launcher, "launch", hanging)
    verdict = capstone.capstone(solution.train_ddp, task, time_budget=BUDGET)
    assert not verdict and "stuck rank(s): [0]" in verdict.criteria[0].detail


def test_solution_notebooks_are_stripped():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert not any(c.get("outputs") or c.get("execution_count") for c in nb.cells
                       if c.cell_type == "code"), f"{path.name} has outputs: run nbstripout"


def test_the_recorder_sees_the_new_names_of_the_gathering_collectives(group):
    import torch

    recorder = capstone.Recorder(rank=0, world_size=1)
    recorder.record["eval_samples"] = 8  # as if the learner had just evaluated
    original = group.all_gather_single
    with recorder.watching():
        group.all_gather_single(torch.empty(2), torch.ones(2))
        group.reduce_scatter_single(torch.empty(2), torch.ones(2))
    assert recorder.record["collectives_after_eval"] >= 2
    assert group.all_gather_single is original  # restored when the block ends

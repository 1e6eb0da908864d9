"""labkit.checkpoints: DCP saves, resumes on another world size, reshard plans, failures refused."""

from __future__ import annotations

import hashlib
import shutil
import sys

import cloudpickle
import pytest
import torch

from labkit import launch
from labkit.checkpoints import (
    WIDTHS,
    async_save_checkpoint,
    checkpoint_files,
    fingerprint,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    reshard_plan,
    resume_and_train,
    run_and_save,
    save_checkpoint,
    save_stall,
    shard_rows,
    sharded_model,
    step_batch,
    train_steps,
)

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def error_of(fn, *args, **kwargs) -> str:
    """``"ValueError: ..."`` for what ``fn`` raises inside a worker (the launch goes on)."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (the test asserts the type and the message)
        return f"{type(e).__name__}: {e}"
    return "no error"


def on_four_ranks(root) -> dict:
    """One 4-rank launch: an FSDP2 run saved at step 4, resumed on 4; a dp x tp run saved."""
    from labkit.checkpoints import resume_and_train, run_and_save, sharded_model

    fsdp = run_and_save(f"{root}/fsdp", steps=8, save_at=4)
    return {"fsdp": fsdp, "resumed": resume_and_train(f"{root}/fsdp", steps=8),
            "tp": run_and_save(f"{root}/tp", steps=8, save_at=4, tp=2),
            "tp3": error_of(sharded_model, widths=(8, 12, 12, 3), tp=3)}


def on_two_ranks(root) -> dict:
    """One 2-rank launch: the 4-rank saves resumed on 2, a 2-rank run, sync and async saves."""
    from labkit.checkpoints import resume_and_train, run_and_save, save_stall

    small = (8, 32, 32, 8)
    return {"from4": resume_and_train(f"{root}/fsdp", steps=8),
            "from_tp": resume_and_train(f"{root}/tp", steps=8),
            "two": run_and_save(f"{root}/two", steps=8, save_at=4),
            "two_resumed": resume_and_train(f"{root}/two", steps=8),
            "sync": save_stall(f"{root}/sync", mode="sync", steps=6, every=2, widths=small),
            "async": save_stall(f"{root}/async", mode="async", steps=6, every=2, widths=small),
            "odd_batch": error_of(odd_batch)}


def odd_batch():
    from labkit.checkpoints import sharded_model, train_steps

    train_steps(*sharded_model(), 0, 1, batch=7)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    four = launch(on_four_ranks, str(root), nproc=4, show_ranks=[], timeout=300, warm=True)
    two = launch(on_two_ranks, str(root), nproc=2, show_ranks=[], timeout=300, warm=True)
    return {"root": root, "four": four.values, "two": two.values}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- resuming -----------------------------------------------------------------------------------


def test_a_resume_on_the_same_world_size_is_the_uninterrupted_run_bit_for_bit(runs):
    for values, run, resumed in ((runs["four"], "fsdp", "resumed"),
                                 (runs["two"], "two", "two_resumed")):
        for v in values:
            assert v[resumed]["resumed_from"] == 4
            assert v[resumed]["final"]["sha256"] == v[run]["final"]["sha256"]
            assert _equal(v[resumed]["final"]["tensors"], v[run]["final"]["tensors"])
            assert v[resumed]["losses"] == v[run]["losses"][4:]


def test_loading_4_ranks_saves_on_2_ranks_gives_back_the_saved_state_bit_for_bit(runs):
    four, two = runs["four"][0], runs["two"]
    for v in two:
        assert v["from4"]["world"] == 2 and v["from4"]["resumed_from"] == 4
        # Resharding moves bytes and computes nothing: model and AdamW state, gathered whole.
        assert v["from4"]["loaded"]["sha256"] == four["fsdp"]["saved"]["sha256"]
        assert _equal(v["from4"]["loaded"]["tensors"], four["fsdp"]["saved"]["tensors"])
        # A dp=2 x tp=2 save loads into plain FSDP2 on 2 ranks: another layout, the same bits.
        assert v["from_tp"]["loaded"]["sha256"] == four["tp"]["saved"]["sha256"]


def test_a_4_to_2_resume_continues_the_run_up_to_float32_rounding(runs):
    # Not bit for bit (measured): each rank sums its rows' gradients in one matmul, then the
    # ranks' sums are added by the reduce-scatter. 4 ranks x 2 rows and 2 ranks x 4 rows add
    # the same 8 numbers in another order, and float32 addition is not associative. The same
    # world size adds in the same order, hence the bitwise test above.
    uninterrupted, resumed = runs["four"][0]["fsdp"], runs["two"][0]["from4"]
    for key, full in uninterrupted["final"]["tensors"].items():
        torch.testing.assert_close(resumed["final"]["tensors"][key], full, rtol=1e-5, atol=1e-6)
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][4:], rel=1e-5)


def test_a_dp_x_tp_run_trains_like_the_fsdp2_one(runs):
    fsdp, tp = runs["four"][0]["fsdp"], runs["four"][0]["tp"]
    assert tp["tp"] == 2 and tp["world"] == 4
    assert tp["losses"] == pytest.approx(fsdp["losses"], rel=1e-5)


def test_save_and_load_seconds_are_measured_on_every_rank(runs):
    assert [v["fsdp"]["save_seconds"] > 0 for v in runs["four"]] == [True] * 4
    assert [v["from4"]["load_seconds"] > 0 for v in runs["two"]] == [True] * 2


# ---- what a save wrote, and resharding by hand -----------------------------------------------


def test_checkpoint_files_lists_the_metadata_and_one_file_per_rank(runs):
    path = runs["four"][0]["fsdp"]["path"]
    files = checkpoint_files(path)
    assert [f["name"] for f in files["files"]] == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    sizes = {p.name: p.stat().st_size for p in runs["root"].glob("fsdp/step-000004/*")}
    assert {f["name"]: f["bytes"] for f in files["files"]} == sizes
    assert files["total_bytes"] == sum(sizes.values())
    n = sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:], strict=False))  # 233 parameters
    assert files["model_bytes"] == 4 * n
    assert files["optim_bytes"] == 8 * n + 6 * 4  # exp_avg, exp_avg_sq; a step per tensor
    assert files["tensor_bytes"] == files["model_bytes"] + files["optim_bytes"]
    assert files["total_bytes"] > files["tensor_bytes"]  # torch.save's framing per chunk
    assert {"step", "scheduler.last_epoch", "optim.param_groups.0.lr"} <= set(files["objects"])
    assert files["tensors"]["model.2.weight"]["shape"] == (10, 10)
    assert read_checkpoint(path)["step"] == 4


def test_the_saved_chunks_are_the_shards_reshard_plan_computes(runs):
    files = checkpoint_files(runs["four"][0]["fsdp"]["path"])
    sharded = [k for k in files["tensors"] if k.startswith("model.") or "exp_avg" in k]
    assert len(sharded) == 18
    for key in sharded:
        t = files["tensors"][key]
        got = [(c["file"], c["offsets"][0], c["sizes"][0]) for c in t["chunks"]]
        # Saving is the plan from 4 ranks to the same 4: each rank's chunk, in its own file.
        want = [(r["reads"][0]["file"] if r["reads"] else f"__{r['rank']}_0.distcp",
                 r["rows"][0], r["shape"][0]) for r in reshard_plan(t["shape"], 4, 4)]
        assert got == want, key
    # 3 rows over 4 ranks: rank 3 holds none and still writes an empty chunk at offset 3.
    assert [c["sizes"] for c in files["tensors"]["model.4.weight"]["chunks"]] == [
        (1, 10), (1, 10), (1, 10), (0, 10)]


def test_reshard_plan_is_what_dcp_read_when_2_ranks_loaded_the_4_ranks_save(runs):
    files = checkpoint_files(runs["four"][0]["fsdp"]["path"])
    for v in runs["two"]:
        rank, reads = v["from4"]["rank"], v["from4"]["reads"]
        for key in ("model.0.weight", "model.4.weight", "model.4.bias",
                    "optim.state.2.weight.exp_avg_sq"):
            shape = files["tensors"][key]["shape"]
            read = sorted((r["file"], r["storage_offsets"][0],
                           r["storage_offsets"][0] + r["lengths"][0], r["dest_offsets"][0])
                          for r in reads if r["key"] == key)
            plan = reshard_plan(shape, old_world=4, new_world=2)[rank]
            assert read == [(r["file"], *r["shard_rows"], r["dest_rows"][0])
                            for r in plan["reads"]], (key, rank)


def test_shard_rows_splits_like_torch_chunk_with_empty_ranks_at_the_end():
    for rows in range(0, 12):
        for world in range(1, 6):
            chunks = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
            chunks += [0] * (world - len(chunks))
            assert [b - a for a, b in shard_rows(rows, world)] == chunks, (rows, world)
    assert shard_rows(3, 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]


def test_reshard_plan_reads_every_row_once_uneven_and_with_empty_ranks():
    assert reshard_plan((10, 8), 4, 2)[1]["reads"] == [
        {"old_rank": 1, "file": "__1_0.distcp", "rows": (5, 6), "shard_rows": (2, 3),
         "bytes": (64, 96), "dest_rows": (0, 1)},
        {"old_rank": 2, "file": "__2_0.distcp", "rows": (6, 9), "shard_rows": (0, 3),
         "bytes": (0, 96), "dest_rows": (1, 4)},
        {"old_rank": 3, "file": "__3_0.distcp", "rows": (9, 10), "shard_rows": (0, 1),
         "bytes": (0, 32), "dest_rows": (4, 5)}]
    up = reshard_plan((3,), 2, 4, itemsize=2)  # 2 + 1 rows onto 1 + 1 + 1 + 0
    assert [p["rows"] for p in up] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert up[3]["reads"] == [] and up[3]["bytes"] == 0 and up[3]["shape"] == (0,)
    assert [(r["file"], r["bytes"]) for r in up[1]["reads"]] == [("__0_0.distcp", (2, 4))]
    for rows, old, new in ((10, 4, 3), (7, 3, 5), (3, 4, 2), (1, 1, 8), (0, 2, 3)):
        for p in reshard_plan((rows, 2), old, new):
            covered = [i for r in p["reads"] for i in range(*r["rows"])]
            assert covered == list(range(*p["rows"]))
            assert sum(r["bytes"][1] - r["bytes"][0] for r in p["reads"]) == p["bytes"]


@pytest.mark.parametrize("args, message", [
    (((), 2, 2), r"global_shape=\(\): a scalar is not sharded"),
    (((4, -1), 2, 2), "each dimension of global_shape must be a whole number >= 0, got -1"),
    (((4,), 0, 2), "world must be a whole number >= 1, got 0"),
    (((4,), 2, 2.5), "world must be a whole number >= 1, got 2.5"),
])
def test_reshard_plan_refuses_what_is_not_a_layout(args, message):
    with pytest.raises(ValueError, match=message):
        reshard_plan(*args)
    with pytest.raises(ValueError, match="itemsize must be a whole number >= 1, got 0"):
        reshard_plan((4,), 2, 2, itemsize=0)


# ---- sync and async saves --------------------------------------------------------------------


def test_async_saves_write_what_sync_saves_write_and_wait_for_each_other(runs):
    root = runs["root"]
    for v in runs["two"]:
        for mode in ("sync", "async"):
            r = v[mode]
            assert r["mode"] == mode and len(r["step_seconds"]) == 6
            assert len(r["save_seconds"]) == 3 and r["stall"] == pytest.approx(
                sum(r["save_seconds"]))
            assert [p.rsplit("/", 1)[1] for p in r["paths"]] == [
                "step-000002", "step-000004", "step-000006"]
        assert v["sync"]["final_wait"] < 0.01 and v["async"]["final_wait"] >= 0
    # Training went on while the async saves were written: the staged copies kept the state
    # of their own step, equal to what the blocking saves wrote.
    for step in ("step-000002", "step-000004", "step-000006"):
        a, b = read_checkpoint(root / "sync" / step), read_checkpoint(root / "async" / step)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                   for k in a), step
    assert sorted(p.name for p in (root / "async").iterdir()) == [
        "step-000002", "step-000004", "step-000006"]  # no temporary folder left


def test_save_stall_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="mode='fast': use 'sync'"):
        save_stall("unused", mode="fast")


# ---- layouts that cannot be -------------------------------------------------------------------


def test_a_tp_degree_that_does_not_divide_the_ranks_is_refused(runs, group):
    assert runs["four"][0]["tp3"] == (
        "ValueError: tp=3 does not divide the 4 ranks: the mesh is dp x tp, so use tp in "
        "[1, 2, 4]")
    with pytest.raises(ValueError, match="the hidden width 9 does not split over tp=2 ranks: "
                                         r"use a tp that divides it \(1, 3, 9\)"):
        sharded_model(widths=(8, 9, 9, 3), tp=2)
    with pytest.raises(ValueError, match=r"widths=\(8, 3\): give at least in, hidden and out"):
        sharded_model(widths=(8, 3))


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(runs):
    assert runs["two"][0]["odd_batch"] == ("ValueError: batch=7 rows do not split over 2 "
                                           "data-parallel ranks: use a multiple of 2")


def test_sharded_model_needs_a_worker():
    with pytest.raises(RuntimeError, match="not initialised: run this inside a worker"):
        sharded_model()


# ---- failures on one rank, in this process ------------------------------------------------------


def _digests(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture
def saved(group, tmp_path):
    """A one-rank FSDP2 run trained 2 steps and saved at step 2 in tmp_path/run."""
    model, opt, sched = sharded_model()
    train_steps(model, opt, sched, 0, 2)
    path = save_checkpoint(tmp_path / "run", 2, model, opt, sched)
    return {"path": path, "model": model, "opt": opt, "sched": sched}


def test_a_one_rank_round_trip_restores_model_optimizer_scheduler_and_step(saved):
    model, opt, sched = sharded_model(seed=5)
    assert load_checkpoint(latest_checkpoint(saved["path"].parent), model, opt, sched) == 2
    assert fingerprint(model, opt) == fingerprint(saved["model"], saved["opt"])
    assert sched.state_dict() == saved["sched"].state_dict()


def test_loading_another_models_checkpoint_names_the_first_mismatch_and_changes_nothing(saved):
    model, opt, sched = sharded_model(widths=(8, 12, 10, 3))
    before = fingerprint(model, opt)
    with pytest.raises(ValueError, match=r"step-000002 was saved from another model: "
                                         r"'model\.0\.weight' is \[10, 8\] torch\.float32 "
                                         r"there, \[12, 8\] torch\.float32 here"):
        load_checkpoint(saved["path"], model, opt, sched)
    assert fingerprint(model, opt) == before  # refused before anything was read
    deeper = sharded_model(widths=(8, 10, 10, 10, 3))
    with pytest.raises(ValueError, match=r"'model\.4\.weight' is \[3, 10\] .*\[10, 10\]"):
        load_checkpoint(saved["path"], *deeper)
    with pytest.raises(ValueError, match=r"it has no 'model\.6\.weight'"):
        load_checkpoint(saved["path"], *sharded_model(widths=(8, 10, 10, 3, 3)))
    with pytest.raises(ValueError, match=r"it has 'model\.4\.bias', which this one has not"):
        load_checkpoint(saved["path"], *_without_last_bias())


def _without_last_bias():
    model, opt, sched = sharded_model()
    del model[4].bias  # the same shapes, one tensor fewer
    model[4].register_parameter("bias", None)
    return model, torch.optim.AdamW(model.parameters()), sched


def test_a_missing_shard_file_is_named_and_the_state_is_untouched(saved, tmp_path):
    broken = tmp_path / "copy" / "step-000002"
    shutil.copytree(saved["path"], broken)
    (broken / "__0_0.distcp").unlink()
    model, opt, sched = sharded_model()
    before = fingerprint(model, opt)
    with pytest.raises(FileNotFoundError, match=r"step-000002 is incomplete: __0_0\.distcp is "
                                                r"missing \(1 of 1 shard files\)"):
        load_checkpoint(broken, model, opt, sched)
    assert fingerprint(model, opt) == before


def test_what_is_not_a_checkpoint_is_refused(saved, tmp_path):
    model, opt, sched = sharded_model()
    with pytest.raises(FileNotFoundError, match=r"is not a checkpoint \(no \.metadata file\)"):
        load_checkpoint(tmp_path, model, opt, sched)
    with pytest.raises(FileNotFoundError, match="latest_checkpoint found none"):
        load_checkpoint(latest_checkpoint(tmp_path / "empty"), model, opt, sched)
    for read in (checkpoint_files, read_checkpoint):
        with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
            read(tmp_path)


def test_an_existing_step_is_never_overwritten_unless_asked(saved):
    path, run = saved["path"], saved["path"].parent
    before = _digests(path)
    model, opt, sched = sharded_model(seed=7)  # another run, saving into the same folder
    with pytest.raises(FileExistsError, match=r"step-000002 already holds a checkpoint: nothing "
                                              r"was written.*overwrite=True"):
        save_checkpoint(run, 2, model, opt, sched)
    assert _digests(path) == before
    assert sorted(p.name for p in run.iterdir()) == ["step-000002"]
    save_checkpoint(run, 2, model, opt, sched, overwrite=True)
    assert _digests(path) != before
    assert sorted(p.name for p in run.iterdir()) == ["step-000002"]  # nothing left behind
    loaded = sharded_model()
    load_checkpoint(path, *loaded)
    assert fingerprint(*loaded[:2]) == fingerprint(model, opt)


def test_a_crashed_saves_leftovers_are_cleared_and_a_folder_that_is_no_checkpoint_kept(saved):
    run = saved["path"].parent
    (run / ".step-000004.partial").mkdir()
    (run / ".step-000004.partial" / "__0_0.distcp").write_bytes(b"half")  # a crash mid-save
    assert latest_checkpoint(run) == saved["path"]  # a partial one is never the latest
    path = save_checkpoint(run, 4, saved["model"], saved["opt"], saved["sched"])
    assert latest_checkpoint(run) == path
    assert sorted(p.name for p in run.iterdir()) == ["step-000002", "step-000004"]
    (run / "step-000006").mkdir()
    with pytest.raises(FileExistsError, match="step-000006 already holds something that is not "
                                              "one"):
        save_checkpoint(run, 6, saved["model"], saved["opt"], saved["sched"])
    with pytest.raises(ValueError, match=r"step-000002 is itself a checkpoint: pass the run's "
                                         r"folder"):
        save_checkpoint(saved["path"], 6, saved["model"], saved["opt"], saved["sched"])


def test_async_saves_need_a_group_of_their_own(saved, group):
    args = (saved["path"].parent, 6, saved["model"], saved["opt"], saved["sched"])
    for pg in (None, group.group.WORLD):
        with pytest.raises(ValueError, match="async saves need a process group of their own"):
            async_save_checkpoint(*args, process_group=pg)
    pg = group.new_group(backend="gloo")
    pending = async_save_checkpoint(*args, process_group=pg)
    assert pending.wait() == saved["path"].parent / "step-000006"
    assert pending.done() and read_checkpoint(pending.target)["step"] == 6
    assert pending.wait() == pending.target  # a second wait renames nothing again
    group.destroy_process_group(pg)


def test_bad_runs_are_refused_before_training(group, tmp_path):
    with pytest.raises(ValueError, match="save_at=9 is after the last step"):
        run_and_save(tmp_path, steps=8, save_at=9)
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*: run run_and_save there"):
        resume_and_train(tmp_path)


def test_step_batch_depends_on_the_step_alone():
    x, y = step_batch(3)
    assert x.shape == (8, 8) and y.shape == (8, 3)
    assert torch.equal(step_batch(3)[0], x) and not torch.equal(step_batch(4)[0], x)


def test_a_process_group_without_gloo_is_refused_with_what_to_launch(group, monkeypatch):
    # A GPU server's default launch is NCCL, which carries no CPU tensors: say so before
    # building anything.
    monkeypatch.setattr(group, "get_backend", lambda *a, **k: "nccl")
    with pytest.raises(ValueError, match="launch with backend='gloo'"):
        sharded_model()

"""labkit.diagnose: every fault really happens, every tool really detects it, bad input is refused.

Launches cost seconds each, so the two-rank behaviour is covered by a few launches that each
run several scenarios; everything that works on one rank uses a one-rank gloo group here.
"""

from __future__ import annotations

import random
import shutil
import sys
import time

import cloudpickle
import numpy as np
import pytest
import torch

import labkit
from labkit import LaunchError, LaunchTimeout, diagnose, launch
from labkit.diagnose import NotFiniteError, ShapeMismatchError

from .conftest import cuda_gpus

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------ check_finite, all_finite


@pytest.mark.parametrize("with_group", [True, False], ids=["one-rank group", "no group"])
def test_check_finite_passes_finite_values_and_names_the_rank_of_a_nan(request, with_group):
    if with_group:
        request.getfixturevalue("group")
    diagnose.check_finite(torch.tensor([1.0, 2.0]))
    diagnose.check_finite(3.5, "lr")
    diagnose.check_finite(np.float32(1.0))
    diagnose.check_finite(torch.tensor([1, 2]))  # integers are always finite
    with pytest.raises(NotFiniteError, match=r"loss is not finite \(NaN or inf\) on rank\(s\) 0 "
                                             r"at step 7 \(of 1 rank\(s\)\)") as info:
        diagnose.check_finite(torch.tensor(float("nan")), step=7)
    assert info.value.ranks == [0] and info.value.step == 7 and info.value.name == "loss"
    with pytest.raises(NotFiniteError, match="grad norm is not finite"):
        diagnose.check_finite(torch.tensor([0.0, float("-inf")]), "grad norm")
    assert isinstance(info.value, FloatingPointError)


def test_the_errors_survive_pickling_from_a_worker_to_the_notebook():
    for err in (NotFiniteError("m", ranks=[1], name="loss", step=2),
                ShapeMismatchError("m", ranks=[1], shapes={0: (2,), 1: (3,)})):
        back = cloudpickle.loads(cloudpickle.dumps(err))
        assert type(back) is type(err) and str(back) == "m" and back.__dict__ == err.__dict__


def test_all_finite_agrees_on_one_rank(group):
    assert diagnose.all_finite(torch.ones(3)) is True
    assert diagnose.all_finite(torch.tensor([1.0, float("inf")])) is False


def test_nonfinite_ranks_names_this_rank_and_leaves_the_value_alone(group):
    value = torch.tensor([1.0, float("nan")])
    assert diagnose.nonfinite_ranks(value) == [0]
    assert value[0] == 1.0 and value[1].isnan(), "the value is not reduced in place"
    assert diagnose.nonfinite_ranks(torch.tensor(2.0)) == []
    assert diagnose.nonfinite_ranks(float("-inf")) == [0]
    with pytest.raises(ValueError, match="nonfinite_ranks takes a tensor or a number"):
        diagnose.nonfinite_ranks("nan")


@pytest.mark.parametrize("value", ["1.0", None, [1.0, 2.0]], ids=["str", "None", "list"])
def test_check_finite_refuses_what_is_not_a_tensor_or_number(value):
    with pytest.raises(ValueError, match=r"check_finite takes a tensor or a number .* pass the "
                                         r"tensor itself"):
        diagnose.check_finite(value)
    with pytest.raises(ValueError, match="all_finite takes a tensor or a number"):
        diagnose.all_finite(value)


@pytest.mark.parametrize("name", ["", 3])
def test_check_finite_needs_a_name_that_says_what(name):
    with pytest.raises(ValueError, match="name must be a non-empty string .* 'loss'"):
        diagnose.check_finite(1.0, name)


# ----------------------------------------------------------------- check_same_shape, common_steps


def test_check_same_shape_and_common_steps_on_one_rank(group):
    diagnose.check_same_shape(torch.zeros(3, 2), "x")
    assert diagnose.common_steps(5) == 5
    assert diagnose.common_steps(0) == 0


def test_check_same_shape_refuses_a_non_tensor():
    with pytest.raises(ValueError, match="check_same_shape takes the tensor .* got list"):
        diagnose.check_same_shape([1, 2])
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        diagnose.check_same_shape(torch.zeros(1), "")


@pytest.mark.parametrize("n", [-1, 2.5, True, "3"])
def test_common_steps_refuses_what_is_not_a_step_count(n):
    with pytest.raises(ValueError, match=r"common_steps takes this rank's number of steps .* "
                                         r"len\(loader\)"):
        diagnose.common_steps(n)


# --------------------------------------------------------------------------------- determinism


def test_fingerprint_is_equal_for_equal_values_and_changes_with_one_bit():
    torch.manual_seed(0)
    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert (diagnose.fingerprint(a) == diagnose.fingerprint(b)
            == diagnose.fingerprint(a.state_dict()))
    assert len(diagnose.fingerprint(a)) == 12
    with torch.no_grad():
        flat = b.weight.view(-1).view(torch.int32)
        flat[0] ^= 1  # the lowest bit of one weight
    assert diagnose.fingerprint(a) != diagnose.fingerprint(b)
    assert diagnose.fingerprint([3, 1, 2]) == diagnose.fingerprint((3, 1, 2))
    assert diagnose.fingerprint([3, 1, 2]) != diagnose.fingerprint([1, 2, 3])
    assert (diagnose.fingerprint(torch.ones(2))
            != diagnose.fingerprint(torch.ones(2, dtype=torch.float64)))
    assert diagnose.fingerprint(np.arange(3)) == diagnose.fingerprint(torch.arange(3))
    assert diagnose.fingerprint(range(4)) == diagnose.fingerprint([0, 1, 2, 3])


@pytest.mark.parametrize("obj", ["abc", object(), [1, None]], ids=["str", "object", "None inside"])
def test_fingerprint_refuses_what_it_cannot_hash_by_value(obj):
    with pytest.raises(ValueError, match=r"cannot fingerprint .* pass a model, a tensor, a state "
                                         r"dict, or a list of numbers/tensors .*list\(sampler\)"):
        diagnose.fingerprint(obj)


@pytest.fixture
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def test_make_deterministic_repeats_every_generator(restore_determinism):
    draws = []
    for _ in range(2):
        assert diagnose.make_deterministic(7) == 7
        draws.append((random.random(), np.random.rand(), torch.rand(1).item()))
    assert draws[0] == draws[1]
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    diagnose.make_deterministic(8)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) != draws[0]


@pytest.mark.parametrize("seed", [-1, 2**32, 1.5, "0", True])
def test_make_deterministic_refuses_a_bad_seed(seed):
    with pytest.raises(ValueError, match=r"seed must be a whole number in \[0, 2\*\*32\)"):
        diagnose.make_deterministic(seed)


# ------------------------------------------------------------------------------ reading the logs

# Lines as a TORCH_DISTRIBUTED_DEBUG=DETAIL, TORCH_CPP_LOG_LEVEL=INFO run of skipped_allreduce
# printed them (see test_debug_env_names_the_mismatch_in_the_error_and_the_logs for the real run).
LOGS = {
    0: ["[I1130 05:20:01.1 ProcessGroupWrapper.cpp:566] [Rank 0] Running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[4], "
        "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu))",
        "some other line",
        "[I1130 05:20:01.2 ProcessGroupWrapper.cpp:566] [Rank 0] Running collective: "
        "CollectiveFingerPrint(SequenceNumber=3, OpType=BARRIER)"],
    1: ["[I1130 05:20:01.1 ProcessGroupWrapper.cpp:566] [Rank 1] Running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[4], "
        "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu))",
        "[I1130 05:20:01.2 ProcessGroupWrapper.cpp:566] [Rank 1] Running collective: "
        "CollectiveFingerPrint(SequenceNumber=3, OpType=ALLREDUCE, TensorShape=[4], "
        "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu))"],
}


def test_collectives_in_log_and_first_mismatch_read_detail_lines():
    calls = diagnose.collectives_in_log(LOGS)
    assert calls[0][-1] == {"seq": 3, "op": "BARRIER", "shape": None, "dtype": None}
    assert calls[1][-1] == {"seq": 3, "op": "ALLREDUCE", "shape": "[4]", "dtype": "Float"}
    assert diagnose.first_mismatch(calls) == {"seq": 3, "ops": {0: "BARRIER", 1: "ALLREDUCE [4]"}}
    agreeing = {0: calls[0][:1], 1: calls[1][:1]}
    assert diagnose.first_mismatch(agreeing) is None
    missing = {0: calls[0][:1], 1: calls[1]}  # rank 0 never got to its next collective
    assert diagnose.first_mismatch(missing) == {"seq": 3, "ops": {0: None, 1: "ALLREDUCE [4]"}}
    assert diagnose.collectives_in_log({0: ["nothing here"]}) == {0: []}
    assert diagnose.first_mismatch({}) is None


def test_log_readers_refuse_the_wrong_shape_of_input():
    with pytest.raises(ValueError,
                       match=r"rank -> lines dict \(result.logs or error.logs\), got list"):
        diagnose.collectives_in_log(["line"])
    with pytest.raises(ValueError, match=r"logs\[0\] is one string: pass a list of lines"):
        diagnose.collectives_in_log({0: "one long string"})
    with pytest.raises(ValueError,
                       match=r"first_mismatch takes collectives_in_log\(logs\)'s result"):
        diagnose.first_mismatch(LOGS[0])


def test_flight_recorder_lists_this_ranks_collectives_and_dumps_them(group, capsys):
    group.all_reduce(torch.ones(3))
    group.barrier()
    # The recorder counts a gloo collective completed a moment after the call returned: on a
    # busy machine (a CI run) the barrier read "not completed" when asked at once.
    deadline = time.monotonic() + 10
    while True:
        entries = diagnose.flight_recorder()  # the recorder keeps earlier tests' entries too
        if entries[-1]["completed"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    reduce, barrier = entries[-2:]
    assert ((reduce["op"], reduce["shape"], barrier["op"])
            == ("gloo:all_reduce", "[[3]]", "gloo:barrier"))
    assert barrier["seq"] == reduce["seq"] + 1 and reduce["completed"] and barrier["completed"]
    assert reduce["where"] == ""
    where = diagnose.flight_recorder(stacks=True)[-2]["where"]
    assert "test_diagnose.py:" in where and where.endswith("in test_flight_recorder_lists_this_"
                                                          "ranks_collectives_and_dumps_them")
    assert diagnose.dump_flight_recorder() is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"[flight recorder] #{barrier['seq']} gloo:barrier [] completed"
    read_back = diagnose.collectives_in_log({0: lines}, "flight recorder")[0][-2:]
    assert read_back == [
        {"seq": reduce["seq"], "op": "gloo:all_reduce", "shape": "[[3]]", "completed": True},
        {"seq": barrier["seq"], "op": "gloo:barrier", "shape": None, "completed": True}]
    thread = diagnose.dump_flight_recorder(after=0.2, stacks=True)
    thread.join(60)
    later = capsys.readouterr().out.splitlines()[-1]
    assert later.startswith(lines[-1] + " at ") and "test_diagnose.py" in later


@pytest.mark.parametrize("after", [-1, "soon"])
def test_dump_flight_recorder_refuses_a_bad_delay(after):
    with pytest.raises(ValueError,
                       match=r"after must be a number of seconds >= 0 \(or None for now\)"):
        diagnose.dump_flight_recorder(after=after)


def test_collectives_in_log_refuses_an_unknown_source():
    with pytest.raises(ValueError,
                       match="unknown source 'nccl': use 'detail' .* or 'flight recorder'"):
        diagnose.collectives_in_log(LOGS, "nccl")


# ------------------------------------------------------------------------- shared memory (/dev/shm)


def test_shm_dataloader_fails_with_a_small_shm_and_each_fix_works():
    ok, why = diagnose.small_shm_support()
    assert isinstance(why, str) and why
    if not ok:
        pytest.skip(f"no private /dev/shm here: {why}")
    failed = diagnose.shm_dataloader(shm_mb=4, batch_mb=4, batches=4)
    assert not failed.ok
    assert "shared memory" in failed.output, failed.output
    assert "FAILED" in str(failed) and "/dev/shm of 4 MB" in str(failed)
    for fix in (dict(shm_mb=64), dict(shm_mb=4, num_workers=0)):
        run = diagnose.shm_dataloader(**(dict(batch_mb=4, batches=4) | fix))
        assert run.ok, run.output
        assert run.error == "" and "finished" in str(run)


def test_shm_dataloader_stops_a_run_that_outlives_its_timeout():
    run = diagnose.shm_dataloader(batch_mb=1, batches=2, num_workers=1, timeout=0.5)
    assert not run.ok and run.error == "(timed out after 0.5 s)"


def test_shm_dataloader_without_a_limit_runs_on_this_machine():
    run = diagnose.shm_dataloader(batch_mb=1, batches=2, num_workers=1)
    assert run.ok, run.output
    assert run.shm_mb is None and "this machine's /dev/shm" in str(run)


def test_small_shm_support_explains_a_missing_unshare(monkeypatch):
    monkeypatch.setattr(diagnose, "_support_cache", {})
    monkeypatch.setattr(diagnose.shutil, "which", lambda name: None)
    assert diagnose.small_shm_support() == (
        False, "the `unshare` command (util-linux) is not installed")
    with pytest.raises(RuntimeError, match="cannot limit /dev/shm here: .*--shm-size=64m"):
        diagnose.shm_dataloader(shm_mb=8)


def test_small_shm_support_falls_back_to_the_next_recipe_and_says_why_all_failed(monkeypatch):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare command here "
                    "(see test_small_shm_support_explains_a_missing_unshare)")
    monkeypatch.setattr(diagnose, "_support_cache", {})
    monkeypatch.setattr(diagnose, "_UNSHARE_WAYS", (("--no-such-option",),))
    ok, why = diagnose.small_shm_support()
    assert not ok and why.startswith("cannot mount a private /dev/shm here (no CAP_SYS_ADMIN")
    assert "unshare --no-such-option: " in why
    monkeypatch.setattr(diagnose, "_support_cache", {})
    monkeypatch.setattr(diagnose, "_UNSHARE_WAYS", (("--no-such-option",), ("--mount",)))
    ok, why = diagnose.small_shm_support()
    if not ok:
        pytest.skip(f"unshare --mount is not allowed here: {why}")
    assert why == "a private tmpfs on /dev/shm via unshare --mount"
    assert diagnose._support_cache["answer"][2][1:] == ["--mount"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(shm_mb=0), r"shm_mb must be a whole number >= 1, got 0: a size in MB \(Docker's"),
    (dict(shm_mb=1.5), r"shm_mb must be a whole number"),
    (dict(num_workers=-1), r"num_workers must be a whole number >= 0"),
    (dict(batch_mb=0), r"batch_mb must be > 0"),
    (dict(batches=0), r"batches must be a whole number >= 1"),
    (dict(sharing_strategy="shm"), r"unknown sharing strategy 'shm': use one of .*file_system"),
    (dict(timeout=0), r"timeout must be a number of seconds > 0"),
])
def test_shm_dataloader_refuses_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        diagnose.shm_dataloader(**kwargs)


# ------------------------------------------------------------------- scenarios on two real ranks


def checked_and_fixed():
    """Every scenario with its tool or its fix on; the tools' errors are caught per rank."""
    import torch.distributed as dist

    out = {"rank": dist.get_rank()}
    out["hang fixed"] = diagnose.skipped_allreduce(fixed=True)
    out["crash fixed"] = diagnose.crash_on_rank(fixed=True)
    try:
        diagnose.mismatched_shapes(check=True)
    except ShapeMismatchError as err:
        out["shape error"] = (str(err), err.ranks, err.shapes)
    out["shapes fixed"] = diagnose.mismatched_shapes(fixed=True)
    out["nan plain"] = diagnose.nan_on_rank(mode="plain")
    try:
        diagnose.nan_on_rank(mode="check")
    except NotFiniteError as err:
        out["nan error"] = (str(err), err.ranks, err.step)
    out["nan skip"] = diagnose.nan_on_rank(mode="skip")
    out["fingerprints"] = [diagnose.training_fingerprints(seed=0),
                           diagnose.training_fingerprints(seed=0),
                           diagnose.training_fingerprints(seed=0, set_epoch=False),
                           diagnose.training_fingerprints()]
    return out


def test_tools_detect_each_fault_on_every_rank_and_the_fixes_work():
    values = launch(checked_and_fixed, nproc=2, backend="gloo", timeout=180, show_ranks=[]).values
    for v in values:
        assert v["hang fixed"] == 3
        assert v["crash fixed"] > 0
        message, ranks, shapes = v["shape error"]
        assert ranks == [1] and shapes == {0: (10,), 1: (9,)}
        assert "rank 0: shape (10,) int64; rank 1: shape (9,) int64" in message
        assert v["shapes fixed"] == [6] * 9 + [3]
        assert v["nan plain"] == {"finite": False, "skipped": []}, "the NaN spread to every rank"
        message, ranks, step = v["nan error"]
        assert ranks == [1] and step == 2 and "on rank(s) 1 at step 2 (of 2 rank(s))" in message
        assert v["nan skip"] == {"finite": True, "skipped": [2]}
        seeded, again, no_epoch, unseeded = v["fingerprints"]
        assert seeded == again, "a seeded run repeats bit for bit"
        assert unseeded["weights"] != seeded["weights"]
        assert seeded["orders"][0] != seeded["orders"][1], "set_epoch gives each epoch its order"
        assert no_epoch["orders"][0] == no_epoch["orders"][1], "without set_epoch it repeats"
    assert values[0]["fingerprints"][0]["weights"] == values[1]["fingerprints"][0]["weights"], \
        "DDP keeps the replicas equal"
    assert values[0]["fingerprints"][0]["orders"] != values[1]["fingerprints"][0]["orders"], \
        "each rank draws its own slice"


def test_a_skipped_allreduce_hangs_and_the_stacks_and_flight_recorder_show_where():
    with pytest.raises(LaunchTimeout) as info:
        launch(diagnose.skipped_allreduce, dump_after=3.0, nproc=2, backend="gloo", timeout=6,
               show_ranks=[], env=diagnose.RECORDER_ENV)
    err = info.value
    assert err.stuck == [0, 1]
    assert "in all_reduce" in err.stacks[1] and "skipped_allreduce" in err.stacks[1]
    assert "in barrier" in err.stacks[0]
    records = diagnose.collectives_in_log(err.logs, "flight recorder")
    assert [r["seq"] for r in records[1]] == [1, 2, 3, 4]
    # The stuck all-reduce never completes. gloo marks the earlier ones complete through the
    # group's counter, which a loaded machine may not have advanced yet when the dump is taken:
    # only the order is certain (nothing completed after something that did not).
    completed = [r["completed"] for r in records[1]]
    assert completed[-1] is False and completed == sorted(completed, reverse=True)
    assert diagnose.first_mismatch(records) == {
        "seq": 4, "ops": {0: "gloo:barrier", 1: "gloo:all_reduce [[4]]"}}
    assert not labkit.stray_workers()


def test_debug_env_names_the_mismatch_in_the_error_and_the_logs():
    with pytest.raises(LaunchError) as info:
        launch(diagnose.skipped_allreduce, nproc=2, backend="gloo", timeout=60, show_ranks=[],
               env=diagnose.DEBUG_ENV)
    text = str(info.value)
    # Which rank raises first is a race, and the peer's side of the message can be garbled
    # (the check's own exchange is out of step too); the raising rank's own op is right.
    assert "Detected mismatch between collectives on ranks" in text and "Op type: " in text
    assert "OpType=BARRIER" in text or "OpType=ALLREDUCE, TensorShape=[4]" in text
    # The raising rank's log is complete (the other was stopped, maybe before its last line).
    calls = diagnose.collectives_in_log(info.value.logs)
    assert calls[info.value.rank][-1]["seq"] == 3
    assert calls[info.value.rank][-1]["op"] == ("BARRIER", "ALLREDUCE")[info.value.rank]
    assert not labkit.stray_workers()


def test_monitored_barrier_names_the_rank_that_never_came():
    with pytest.raises(LaunchError) as info:
        launch(diagnose.skipped_allreduce, sync="monitored", monitor_timeout=1.0, nproc=2,
               backend="gloo", timeout=60, show_ranks=[])
    # Rank 0 names rank 1; rank 1 may report its closed connection first (a race).
    named = [line for line in info.value.logs[0] if "failed to pass monitoredBarrier" in line]
    assert named and "Rank 1 failed to pass monitoredBarrier in 1000 ms" in named[0]


def test_a_crash_is_reported_from_the_rank_that_crashed():
    with pytest.raises(LaunchError) as info:
        launch(diagnose.crash_on_rank, nproc=2, backend="gloo", timeout=60, show_ranks=[])
    assert info.value.rank == 1
    assert "rank 1 failed with IndexError" in str(info.value)
    assert "cross_entropy" in str(info.value), "the traceback shows the failing line"


@pytest.mark.parametrize("fn, kwargs, match", [
    (diagnose.skipped_allreduce, dict(sync="wait"), "unknown sync 'wait'"),
    (diagnose.nan_on_rank, dict(mode="ignore"), "unknown mode 'ignore'"),
])
def test_scenarios_refuse_unknown_switches(group, fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(**kwargs)


def test_scenarios_run_on_one_rank(group):
    # One rank holds rank 0's data only: its validation loss keeps falling, so it never stops.
    assert diagnose.early_stopping(epochs=4)["epochs"] == 4
    fixed = diagnose.early_stopping(epochs=4, fixed=True)
    assert fixed == diagnose.early_stopping(epochs=4) and fixed["val"] == sorted(fixed["val"])[::-1]
    assert diagnose.skipped_allreduce(extra_rank=5) == 3
    assert diagnose.nan_on_rank(bad_rank=5) == {"finite": True, "skipped": []}
    assert diagnose.mismatched_shapes(check=True) == [3] * 10
    with pytest.raises(IndexError, match="out of bounds"):
        diagnose.crash_on_rank(bad_rank=0)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_gpus() < 2, reason="needs 2 CUDA GPUs for 2 NCCL ranks")
def test_flight_recorder_on_nccl_lists_the_collectives_of_each_rank():
    values = launch(nccl_flight_record, nproc=2, backend="nccl", timeout=120, show_ranks=[],
                    env=diagnose.RECORDER_ENV).values
    for entries in values:
        first, second = entries[-2:]
        assert second["seq"] == first["seq"] + 1
        assert all(e["op"] == "nccl:all_reduce" and e["completed"] for e in (first, second))


def nccl_flight_record():
    import time

    import torch.distributed as dist

    for _ in range(2):
        dist.all_reduce(torch.ones(4, device="cuda"))
    torch.cuda.synchronize()
    time.sleep(2)  # NCCL's watchdog thread, not the caller, marks entries completed
    return diagnose.flight_recorder()

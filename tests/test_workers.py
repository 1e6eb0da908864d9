"""Warm workers (labkit.workers, launch(warm=True)) on CPU ranks: the same answers as cold runs,
a clean slate for every run, cold's failure semantics, and nothing left behind."""

from __future__ import annotations

import _thread
import dataclasses
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import psutil
import pytest

import labkit
from labkit import LaunchError, LaunchTimeout, launch

pytestmark = pytest.mark.usefixtures("no_warm_pools")

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

FRESH = "[labkit] the warm workers were stopped after {why}; starting 2 fresh ones"


@pytest.fixture(scope="module")
def _pools():
    held: list = []
    yield held
    for p in held:
        p.stop()


@pytest.fixture
def pool(_pools):
    """One pool for the module: tests that break it leave it to restart itself; a test that
    stops every pool (labkit.stop_workers) makes the next test start another."""
    if not _pools or _pools[-1]._stopped:
        _pools.append(labkit.workers(nproc=2))
    return _pools[-1]


@pytest.fixture(scope="module")
def cold():
    """What fresh processes give: one cold run of every job the warm results are checked against."""
    return launch(reference, 10, 7, nproc=2, warm=False)


def stop_kernel_pools():
    """Stop launch(warm=True)'s pools only: labkit.stop_workers() would stop the module's too."""
    from labkit import warm

    for p in list(warm._KERNEL_POOLS.values()):
        p.stop()


@pytest.fixture(autouse=True)
def cold_by_default(monkeypatch):
    """Each test starts with the kernel default cold, whatever the environment says."""
    monkeypatch.delenv("LABKIT_WARM", raising=False)
    labkit.use_warm(None)
    yield
    labkit.use_warm(None)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_dead(pids, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def workers_of(controller_pid: int) -> set[int]:
    """Every process that names a given controller as theirs (labkit's environment variable)."""
    found = set()
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("LABKIT_CONTROLLER_PID") == str(controller_pid) and alive(p.pid):
                found.add(p.pid)
        except psutil.Error:
            pass
    return found


def controller_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "controller.py"
    script.write_text("import os, sys, time\nimport labkit\n" + textwrap.dedent(body))
    return script


# ---- worker functions ----------------------------------------------------------------------


def total(x):
    import torch
    import torch.distributed as dist

    t = torch.tensor([x + dist.get_rank()])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t}


def rank_pid():
    return os.getpid()


def getenv(name):
    return os.environ.get(name)


def chatty():
    import torch.distributed as dist

    print("hello from", dist.get_rank())
    print("no newline", end="")
    return dist.get_rank()


def report_state():
    import warnings

    import torch
    import torch.distributed as dist

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    return {"threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()),
            "device": torch.empty(1).device.type, "grad": torch.is_grad_enabled(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "anomaly": torch.is_anomaly_enabled(),
            "cudnn": (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32),
            "matmul_tf32": matmul.allow_tf32, "precision": torch.get_float32_matmul_precision(),
            "leftover": os.environ.get("LABKIT_TEST_LEFTOVER"),
            "unbuffered": os.environ.get("PYTHONUNBUFFERED"), "cwd": os.getcwd(),
            "nowhere": "/nowhere" in sys.path,
            "warnings_raise": any(f[0] == "error" for f in warnings.filters),
            "groups": len(dist.distributed_c10d._world.pg_map), "world": dist.get_world_size()}


def mess_up_state(folder):
    import warnings

    import torch
    import torch.distributed as dist

    torch.set_num_threads(torch.get_num_threads() + 1)
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("meta")
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_anomaly_enabled(True)
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("medium")
    os.environ["LABKIT_TEST_LEFTOVER"] = "1"
    del os.environ["PYTHONUNBUFFERED"]
    os.chdir(folder)
    sys.path.insert(0, "/nowhere")
    dist.new_group([0, 1])
    torch.set_default_device("meta")
    warnings.simplefilter("error")
    return report_state()


def draw():
    import random

    import numpy as np
    import torch

    return [torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def seeded_draw(seed):
    import random

    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return draw()


def boom_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        print("about to fail", flush=True)
        raise ValueError("boom")
    time.sleep(60)


def skip_collective_on_rank_1():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return dist.get_rank()


def sleep_after_marking(marker):
    Path(f"{marker}-{os.getpid()}").touch()
    time.sleep(60)


def exit_quietly_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(0)  # a success to torchrun, which would wait for rank 0 forever
    time.sleep(60)


def destroy_the_group():
    import torch.distributed as dist

    dist.destroy_process_group()  # a script's last line, pasted into a function


def noop():
    return 1


def raise_after_an_unmatched_isend():
    """Rank 0 sends a message rank 1 never receives; then every rank raises. Without a new
    group a later recv on rank 1 would be given that stale message."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.isend(torch.full((1,), 100.0), dst=1)
    raise ValueError(f"wrong on rank {dist.get_rank()}")


def recv_on_rank_1():
    import torch
    import torch.distributed as dist

    t = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.send(torch.full((1,), 7.0), dst=1)
    else:
        dist.recv(t, src=0)
    return t.item()


def raise_before_the_collective_on_rank_1():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom before the all-reduce")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, which never comes


def raise_on_rank_1_after_a_collective():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        raise ValueError("boom after the all-reduce")
    return t.item()


def return_a_lock_on_rank_1():
    import torch.distributed as dist

    return threading.Lock() if dist.get_rank() == 1 else 0


def remove_the_folder(folder):
    import shutil

    shutil.rmtree(folder)


def return_an_object_only_the_ranks_can_import(folder):
    sys.path.insert(0, folder)
    import labkit_rank_only

    return labkit_rank_only.Thing()


def reference(x, seed):
    state = report_state()
    return {"total": total(x), "state": state, "seeded": seeded_draw(seed)}


# ---- the same answers as cold ----------------------------------------------------------------


def test_a_warm_run_gives_what_a_cold_run_gives(pool, cold):
    warm = pool.run(total, 10)
    for values in (warm.values, [v["total"] for v in cold.values]):
        assert [(v["rank"], v["world"], v["sum"].item()) for v in values] == [
            (0, 2, 21), (1, 2, 21)]
    assert (warm.nproc, warm.backend) == (cold.nproc, cold.backend) == (2, "gloo")
    assert warm.command == pool._command and "labkit._worker" in warm.command
    assert warm.seconds < cold.seconds


def test_output_streams_with_rank_prefixes_and_no_end_of_task_marks(pool, capsys):
    result = pool.run(chatty, show_ranks=1)
    out = capsys.readouterr().out
    assert "[rank1] hello from 1" in out and "[rank1] no newline" in out
    assert "[rank0]" not in out and "showing rank(s) [1] only" in out
    assert result.logs == {0: ["hello from 0", "no newline"], 1: ["hello from 1", "no newline"]}
    assert "\x1e" not in out and "end-of-task" not in out
    assert result.values == [0, 1]


def test_warm_runs_take_milliseconds(pool):
    times = []
    for _ in range(20):
        start = time.perf_counter()
        pool.run(noop)
        times.append(time.perf_counter() - start)
    # A dispatch that polled files or waited on the supervisor's 0.2 s tick would fail this.
    assert statistics.median(times) < 0.15, times


def test_a_run_that_changes_global_state_leaves_the_next_unaffected(pool, cold, tmp_path):
    before = pool.run(report_state).values
    messed = pool.run(mess_up_state, str(tmp_path)).values[0]
    changed = {k for k in messed if messed[k] != before[0][k]}
    assert changed == set(before[0]) - {"world"}, "the mess-up must change every setting"
    after = pool.run(report_state).values
    assert after == before
    assert after == [v["state"] for v in cold.values], "a fresh process's state"


def test_random_numbers_differ_between_runs_as_in_fresh_processes(pool, cold):
    first, second = pool.run(draw).values, pool.run(draw).values
    for rank in (0, 1):
        for generator in range(3):  # torch, random, numpy
            assert first[rank][generator] != second[rank][generator]
    assert first[0] != first[1], "ranks draw different numbers, as separate processes do"
    seeded = pool.run(seeded_draw, 7).values
    assert seeded == [v["seeded"] for v in cold.values]
    assert pool.run(draw).values != seeded, "a run's seed does not carry over"


def test_the_kernels_environment_reaches_warm_runs_as_it_reaches_cold_ones(pool, monkeypatch):
    monkeypatch.setenv("LABKIT_TEST_LATER", "set after the pool started")
    values = pool.run(getenv, "LABKIT_TEST_LATER").values
    assert values == ["set after the pool started"] * 2
    monkeypatch.delenv("LABKIT_TEST_LATER")
    assert pool.run(getenv, "LABKIT_TEST_LATER").values == [None, None]


def test_a_run_that_destroys_the_default_group_leaves_one_for_the_next(pool):
    pool.run(destroy_the_group)
    assert [v["sum"].item() for v in pool.run(total, 1).values] == [3, 3]


def test_an_unpicklable_argument_is_refused_and_the_pool_stays(pool, capsys):
    pids = pool.pids()
    with pytest.raises(TypeError, match=r"argument 0 \(lock\)"):
        pool.run(noop, threading.Lock())
    assert pool.run(noop).values == [1, 1]
    assert pool.pids() == pids and "fresh ones" not in capsys.readouterr().out


def test_200_warm_runs_leak_no_process_descriptor_or_memory(pool):
    for _ in range(20):  # caches filled before counting
        pool.run(noop)
    pids = pool.pids()
    ranks = [psutil.Process(p) for p in pids[1:]]
    me = psutil.Process()
    fds = [p.num_fds() for p in (*ranks, me)]
    rss = [p.memory_info().rss for p in ranks]
    processes = workers_of(os.getpid())
    for _ in range(200):
        pool.run(noop)
    assert pool.pids() == pids
    assert workers_of(os.getpid()) == processes
    assert [p.num_fds() for p in (*ranks, me)] == fds
    growth = [(p.memory_info().rss - before) / 2**20 for p, before in zip(ranks, rss, strict=True)]
    assert max(growth) < 10, f"RSS grew by {growth} MiB per rank over 200 runs (bound: 10 MiB)"


# ---- failures, hangs, interrupts: cold's semantics; a fresh pool unless the ranks came back ----


def test_a_failing_rank_gives_launch_error_and_the_next_run_a_fresh_pool(pool, capsys):
    pool.run(noop)
    old, run_dir = pool.pids(), pool._run_dir
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        pool.run(boom_on_rank_1)
    assert time.monotonic() - start < 15, "rank 0 was stopped, not waited for"
    err = info.value
    assert err.rank == 1 and "rank 1 failed with ValueError: boom" in str(err)
    assert 'raise ValueError("boom")' in str(err), "the traceback shows the user's source"
    assert "about to fail" in err.logs[1], "the failing rank's last output arrived"
    assert not wait_dead(old, within=5) and not run_dir.exists()
    capsys.readouterr()
    assert [v["sum"].item() for v in pool.run(total, 1).values] == [3, 3]
    out = capsys.readouterr().out
    assert out.count(FRESH.format(why="the last run failed")) == 1
    assert set(pool.pids()).isdisjoint(old)


@pytest.mark.parametrize("fn, rank", [(raise_after_an_unmatched_isend, None),
                                      (raise_on_rank_1_after_a_collective, 1)])
def test_a_python_error_leaves_the_ranks_serving_with_a_fresh_group(pool, capsys, fn, rank):
    """Every rank came back from the error (raised, or returned): no new processes, and the
    default group formed again, so the next run's messages are matched as in a fresh pool."""
    pool.run(noop)
    pids = pool.pids()
    capsys.readouterr()
    with pytest.raises(LaunchError) as info:
        pool.run(fn)
    assert rank is None or info.value.rank == rank  # both raised: either may come first
    assert info.value.ranks_back and "ValueError" in str(info.value)
    assert pool.run(recv_on_rank_1).values == [0.0, 7.0]  # not the stale 100
    assert [v["sum"].item() for v in pool.run(total, 1).values] == [3, 3]
    assert pool.pids() == pids and "fresh ones" not in capsys.readouterr().out


def test_a_rank_stuck_after_another_raised_still_stops_the_pool(pool, capsys):
    """The others get a moment to come back, not more: a rank left waiting in a collective for
    the one that raised is stopped, and the next run starts fresh ranks."""
    pool.run(noop)
    pids = pool.pids()
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        pool.run(raise_before_the_collective_on_rank_1)
    assert not info.value.ranks_back and time.monotonic() - start < 20
    assert not wait_dead(pids, within=5)
    capsys.readouterr()
    assert pool.run(noop).values == [1, 1]
    assert FRESH.format(why="the last run failed") in capsys.readouterr().out


def test_a_hang_gives_launch_timeout_with_stacks_then_a_fresh_pool(pool, capsys):
    pool.run(noop)
    old = pool.pids()
    with pytest.raises(LaunchTimeout) as info:
        pool.run(skip_collective_on_rank_1, timeout=3)
    err = info.value
    assert err.stuck == [0] and "Stuck rank(s): 0 (rank(s) 1 had finished)" in str(err)
    assert "in all_reduce" in err.stacks[0] and "skip_collective_on_rank_1" in err.stacks[0]
    assert "_worker.py" not in err.stacks[0], "the shim's frames are left out"
    assert not wait_dead(old, within=5)
    capsys.readouterr()
    assert pool.run(noop).values == [1, 1]
    assert FRESH.format(why="the last run timed out") in capsys.readouterr().out


def test_an_interrupt_stops_the_run_and_the_pool(pool, tmp_path, capsys):
    pool.run(noop)
    old = pool.pids()
    marker = tmp_path / "started"

    def interrupt_once_running():
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()  # what a kernel interrupt (SIGINT) raises in the kernel

    # A kernel always handles SIGINT; a process started in the background by a shell (as CI
    # may be) inherits SIGINT ignored, and interrupt_main then does nothing.
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_running, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            pool.run(sleep_after_marking, str(marker))
    finally:
        signal.signal(signal.SIGINT, handler)
    assert "[labkit] interrupted: stopped torchrun and" in capsys.readouterr().out
    assert not wait_dead(old, within=5)
    assert pool.run(noop).values == [1, 1]
    assert FRESH.format(why="the last run was interrupted") in capsys.readouterr().out


def test_a_rank_that_exits_quietly_mid_run_is_a_launch_error(pool, capsys):
    pool.run(noop)
    old = pool.pids()
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        pool.run(exit_quietly_on_rank_1)
    assert time.monotonic() - start < 20
    assert info.value.rank == 1 and "rank 1" in str(info.value)
    assert not wait_dead(old, within=5)
    assert pool.run(noop).values == [1, 1]
    assert FRESH.format(why="the last run failed") in capsys.readouterr().out


def test_a_result_the_kernel_cannot_load_stops_the_pool_too(pool, tmp_path, capsys):
    (tmp_path / "labkit_rank_only.py").write_text("class Thing:\n    pass\n")
    pool.run(noop)
    old = pool.pids()
    with pytest.raises(ModuleNotFoundError, match="labkit_rank_only"):
        pool.run(return_an_object_only_the_ranks_can_import, str(tmp_path))
    assert not wait_dead(old, within=5)
    capsys.readouterr()
    assert pool.run(noop).values == [1, 1]
    out = capsys.readouterr().out
    assert FRESH.format(why="the last run ended with ModuleNotFoundError") in out


def test_an_unpicklable_return_value_names_the_rank_and_the_ranks_serve_on(pool, capsys):
    pool.run(noop)
    pids = pool.pids()
    with pytest.raises(LaunchError, match="return value of rank 1 .*cannot be pickled") as info:
        pool.run(return_a_lock_on_rank_1)
    assert info.value.rank == 1 and info.value.ranks_back
    capsys.readouterr()
    assert pool.run(noop).values == [1, 1]
    assert pool.pids() == pids and "fresh ones" not in capsys.readouterr().out


def test_a_rank_that_cannot_restore_its_state_stops_the_pool(tmp_path, monkeypatch):
    home = tmp_path / "pool-home"
    home.mkdir()
    monkeypatch.chdir(home)  # the ranks start here...
    with labkit.workers(nproc=1) as p:
        monkeypatch.chdir(tmp_path)
        pids = p.pids()
        with pytest.raises(LaunchError, match="could not restore its state after the run: "
                                              "FileNotFoundError.*starts fresh ones"):
            p.run(remove_the_folder, str(home))  # ...and cannot go back there
        assert not wait_dead(pids, within=5)


def test_end_of_task_marks_are_read_and_other_lines_left_alone():
    from labkit._engine import WarmTask
    from labkit._protocol import END_OF_TASK

    task = WarmTask(3)
    assert task.take(f"[rank1] {END_OF_TASK}3") == "" and task.ended == {1}
    assert task.take(f"[rank0] half a line{END_OF_TASK}3") == "[rank0] half a line"
    assert task.ended_by_all(2)
    for other in (f"[rank2] {END_OF_TASK}2", f"[rankx] {END_OF_TASK}3",
                  f"[rank2] {END_OF_TASK}three", "[rank2] just output", f"agent {END_OF_TASK}3"):
        task.take(other)
    assert task.ended == {0, 1}, "a mark of another task, or a malformed one, ends nothing"
    assert WarmTask(1).take("[rank0] hello") == "[rank0] hello"


def test_workers_whose_torchrun_died_while_idle_are_replaced(pool, capsys):
    pool.run(noop)
    old = pool.pids()
    os.kill(old[0], signal.SIGKILL)  # the agent: its ranks are orphaned, still alive
    # A killed process is reaped only once all its threads are gone, which can take a while.
    deadline = time.monotonic() + 10
    while pool.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pool.pids() == [], "the pool sees that its torchrun is gone"
    capsys.readouterr()
    assert pool.run(noop).values == [1, 1]
    out = capsys.readouterr().out
    assert FRESH.format(why="their torchrun exited while they were idle") in out
    assert not wait_dead(old, within=5), "the orphaned ranks were stopped with it"


def test_workers_that_cannot_form_their_group_raise_and_leave_nothing(monkeypatch, tmp_path):
    from labkit import warm

    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    validate = warm.validate

    def with_a_bogus_backend(*args):
        job, gpus = validate(*args)
        return dataclasses.replace(job, backend="bogus"), gpus

    monkeypatch.setattr(warm, "validate", with_a_bogus_backend)
    before, live = workers_of(os.getpid()), list(warm._LIVE)
    with pytest.raises(LaunchError, match="rank 0 failed with .*bogus"):
        labkit.workers(nproc=1)
    assert warm._LIVE == live, "the pool that never started is not kept"
    assert not list(private.iterdir()), "its run folder is removed"
    deadline = time.monotonic() + 5
    while not workers_of(os.getpid()) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert workers_of(os.getpid()) <= before


def test_stop_during_a_run_of_another_thread_stops_under_it(monkeypatch):
    from labkit import warm

    monkeypatch.setattr(warm, "_STOP_WAIT", 0.5)
    p = labkit.workers(nproc=1)
    failed = []

    def run():
        try:
            p.run(time.sleep, 60)
        except LaunchError as exc:
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(1)
    pids = p.pids()
    start = time.monotonic()
    p.stop()
    thread.join(30)
    assert time.monotonic() - start < 20 and failed, "the run under the stop was stopped"
    assert not wait_dead(pids, within=5) and p.pids() == []


def test_the_ranks_die_with_a_sigkilled_kernel_and_the_run_folder_goes(tmp_path):
    private = tmp_path / "tmp"
    private.mkdir()
    script = controller_script(tmp_path, """
        import torch.distributed as dist

        def world():
            return dist.get_world_size()

        assert labkit.launch(world, nproc=2, warm=True).values == [2, 2]
        (pool,) = labkit.warm._KERNEL_POOLS.values()
        print("PIDS", *pool.pids(), flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path, env=dict(os.environ, TMPDIR=str(private)))
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("PIDS"):  # the launch's own lines come first
            line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 3 and all(alive(p) for p in pids), "torchrun and 2 warm ranks"
        assert len(list(private.glob("labkit-run-*"))) == 1
    finally:
        proc.kill()
        proc.wait()
    assert not wait_dead(pids, within=5), "warm ranks outlived the SIGKILLed kernel"
    deadline = time.monotonic() + 5
    while list(private.glob("labkit-run-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(str(f.relative_to(private)) for f in private.rglob("*"))
    assert not left, f"the run folder outlived the kernel: {left}"
    assert not workers_of(proc.pid)


def test_stopping_a_pool_ends_every_process_and_its_folder():
    with labkit.workers(nproc=1) as p:
        pids, run_dir = p.pids(), p._run_dir
        assert len(pids) == 2 and run_dir.is_dir()
        assert p.run(noop).values == [1]
    assert not wait_dead(pids, within=5) and not run_dir.exists()
    assert p.pids() == [] and "stopped" in repr(p)
    with pytest.raises(RuntimeError, match="were stopped .* labkit.workers"):
        p.run(noop)


# ---- stray_workers -----------------------------------------------------------------------


def escape(marker):
    """Start a sleeper that is no descendant of the pool (double fork), as a leak would be."""
    import subprocess

    import torch.distributed as dist

    if dist.get_rank() == 0:
        code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(60)', 'labkit._worker', sys.argv[1]], "
                "start_new_session=True, stdout=subprocess.DEVNULL, "
                "stderr=subprocess.DEVNULL); print(p.pid)")
        return int(subprocess.check_output([sys.executable, "-c", code, marker]))
    return None


def test_stray_workers_leaves_out_a_live_pools_processes_only(pool):
    pool.run(noop)
    escaped = pool.run(escape, "labkit-test-escapee").values[0]
    try:
        listed = {int(s.split(":")[0]) for s in labkit.stray_workers()}
        assert escaped in listed, "a process outside the pool is a stray"
        assert listed.isdisjoint(pool.pids()), "a running pool's processes are owned"
        assert pool.owned_pids() >= set(pool.pids())
    finally:
        os.kill(escaped, signal.SIGKILL)
    assert wait_dead([escaped], within=5) == []
    assert labkit.stray_workers() == []


def test_a_stopped_pools_survivors_are_strays(monkeypatch):
    from labkit import warm

    # Survival made to happen: the stop neither asks the ranks to quit nor kills them.
    monkeypatch.setattr(warm, "stop_run", lambda run: 0)
    monkeypatch.setattr(warm, "QUIT", b"")
    p = labkit.workers(nproc=1)
    pids = p.pids()
    p._fifos, fifos = [], p._fifos  # nor sees its FIFO close
    try:
        p.stop()
        listed = {int(s.split(":")[0]) for s in labkit.stray_workers()}
        assert set(pids) <= listed, "the processes of a stopped pool that live on are strays"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for fd in fifos:
            os.close(fd)
    assert wait_dead(pids, within=5) == []


def test_bad_warm_settings_are_refused(monkeypatch, pool):
    with pytest.raises(ValueError, match="warm must be True, False or None"):
        launch(noop, warm="yes")
    with pytest.raises(ValueError, match="use_warm takes True, False or None"):
        labkit.use_warm("yes")
    monkeypatch.setenv("LABKIT_WARM", "maybe")
    with pytest.raises(ValueError, match="LABKIT_WARM='maybe' is not understood: set it to 1"):
        launch(noop)
    with pytest.raises(ValueError, match="TensorFlow cannot run on warm workers"):
        labkit.workers(framework="tensorflow")
    with pytest.raises(ValueError, match="nproc must be a whole number"):
        labkit.workers(nproc=0)
    with pytest.raises(ValueError, match="warm workers run functions, not scripts"):
        pool.run("train.py")
    with pytest.raises(TypeError, match="run\\(\\) needs a function"):
        pool.run(42)
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        pool.run(noop, timeout=0)


# ---- launch(warm=...), use_warm, LABKIT_WARM, the kernel's pools -----------------------------


def test_launch_warm_reuses_the_kernels_pool_and_cold_does_not():
    from labkit import warm

    assert warm._warm_default() is False, "without use_warm or LABKIT_WARM: cold"
    try:
        first = launch(rank_pid, nproc=2, warm=True).values
        assert launch(rank_pid, nproc=2, warm=True).values == first
        labkit.use_warm(True)
        assert launch(rank_pid, nproc=2).values == first
        assert launch(rank_pid, nproc=2, warm=False).values != first
    finally:
        stop_kernel_pools()
    assert not wait_dead(first, within=5)


def test_labkit_warm_1_makes_warm_the_default(monkeypatch):
    monkeypatch.setenv("LABKIT_WARM", "1")
    try:
        first = launch(rank_pid, nproc=1).values
        assert launch(rank_pid, nproc=1).values == first
        labkit.use_warm(False)  # the call wins over the variable
        assert launch(rank_pid, nproc=1).values != first
    finally:
        stop_kernel_pools()


def test_labkit_warm_never_runs_everything_cold_even_warm_true(monkeypatch):
    monkeypatch.setenv("LABKIT_WARM", "never")
    labkit.use_warm(True)
    try:
        first = launch(rank_pid, nproc=1, warm=True).values
        assert launch(rank_pid, nproc=1, warm=True).values != first, "fresh processes each time"
        assert launch(rank_pid, nproc=1).values != first
    finally:
        stop_kernel_pools()


def test_the_kernel_keeps_at_most_max_idle_pools_least_recently_used_stopped(monkeypatch,
                                                                            capsys):
    from labkit import warm

    monkeypatch.setattr(warm, "MAX_IDLE_POOLS", 1)
    try:
        a = launch(rank_pid, nproc=1, warm=True, env={"LABKIT_TEST_SHAPE": "a"}).values
        b = launch(rank_pid, nproc=1, warm=True, env={"LABKIT_TEST_SHAPE": "b"}).values
        assert "stopping the least recently used warm workers (1 x gloo)" in capsys.readouterr().out
        assert not wait_dead(a, within=5), "the older pool was stopped"
        assert launch(rank_pid, nproc=1, warm=True, env={"LABKIT_TEST_SHAPE": "b"}).values == b
    finally:
        stop_kernel_pools()


def test_a_busy_kernel_pool_sends_a_default_warm_run_cold(tmp_path):
    labkit.use_warm(True)
    try:
        pids = launch(rank_pid, nproc=1).values
        holder = threading.Thread(target=launch, args=(time.sleep, 6), kwargs={"nproc": 1})
        holder.start()
        time.sleep(0.5)
        assert launch(rank_pid, nproc=1).values != pids, "ran cold beside the busy pool"
        holder.join(30)
        assert launch(rank_pid, nproc=1).values == pids
    finally:
        stop_kernel_pools()


@pytest.mark.parametrize("kwargs, why", [
    ({"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "127.0.0.1:1"}, "multi-node run"),
    ({"rdzv_endpoint": "127.0.0.1:1"}, "multi-node run"),
    ({"max_restarts": 1}, "max_restarts lets torchrun replace the whole worker group"),
    ({"keep_run_dir": True}, "Use warm=False to keep a run's folder"),
    ({"framework": "tensorflow"}, "TensorFlow cannot run on warm workers.*Use warm=False"),
])
def test_warm_true_refuses_what_only_a_cold_run_can_do(kwargs, why):
    with pytest.raises(ValueError, match=f"warm=True cannot run this: .*{why}"):
        launch(noop, warm=True, **kwargs)


def test_warm_true_refuses_a_script_and_the_default_runs_it_cold(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "print('world', dist.get_world_size())\n")
    with pytest.raises(ValueError, match="a script calls init_process_group itself.*warm=False"):
        launch(str(script), warm=True)
    labkit.use_warm(True)
    pools = list(labkit.warm._LIVE)
    result = launch(str(script), nproc=2)
    assert result.values == [None, None] and result.logs[0] == ["world 2"]
    assert labkit.warm._LIVE == pools, "no pool was started for it"


def test_the_default_runs_max_restarts_cold():
    labkit.use_warm(True)
    pools = list(labkit.warm._LIVE)
    assert launch(noop, nproc=1, max_restarts=1).values == [1]
    assert labkit.warm._LIVE == pools


# ---- %%distributed --warm and the benchmark's printer ----------------------------------------


def test_distributed_cell_magic_runs_warm_with_the_flag():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_cell("%load_ext labkit", store_history=False).raise_error()
        cell = ("import os\nt = torch.tensor([rank]); dist.all_reduce(t)\n"
                "s = t.item(); me = os.getpid()\n")
        shell.run_cell("%%distributed -n 2 --warm --out s,me\n" + cell).raise_error()
        first = shell.user_ns["me"]
        assert shell.user_ns["s"] == [1, 1]
        shell.run_cell("%%distributed -n 2 --warm --out me\n" + cell).raise_error()
        assert shell.user_ns["me"] == first, "the same warm ranks ran both cells"
        shell.run_cell("%%distributed -n 2 --out me\n" + cell).raise_error()
        assert shell.user_ns["me"] != first, "without --warm: cold"
    finally:
        InteractiveShell.clear_instance()
        stop_kernel_pools()


def test_stop_workers_stops_every_pool_of_the_kernel(pool):
    launch(noop, nproc=1, warm=True)
    pids = pool.pids() + launch(rank_pid, nproc=1, warm=True).values
    assert labkit.stop_workers() == 2 and labkit.stop_workers() == 0
    assert not wait_dead(pids, within=5)
    assert labkit.stray_workers() == []


def test_the_launch_benchmark_prints_cold_and_warm_side_by_side(capsys):
    from labkit import bench

    bench.print_launch_overhead({"nproc": 2, "repeats": 3, "launch_s": 3.0, "torchrun_s": 2.9,
                         "ratio": 3.0 / 2.9, "launch_all_s": [3.0, 3.1, 2.9],
                         "torchrun_all_s": [2.9, 2.9, 3.0], "warm_runs": 20, "warm_s": 0.012,
                         "warm_all_s": [0.012] * 20, "pool_start_s": 3.4,
                         "warm_ratio": 0.004})
    out = capsys.readouterr().out
    assert "cold  labkit.launch  median 3.00 s" in out
    assert "warm  pool.run       median 0.012 s" in out and "20 runs" in out
    assert "pool start-up 3.40 s" in out
    assert "warm / cold = 0.004" in out and "(target <= 0.05, and warm <= 0.10 s)" in out


# ---- GPUs ----------------------------------------------------------------------------------


def keep_a_cuda_tensor():
    import torch

    # An attribute of an imported module survives the run (a by-value function's globals not).
    torch._labkit_test_kept = torch.ones(1 << 20, device="cuda")


def cuda_memory():
    import torch

    torch.ones(64 << 20, device="cuda").sum().item()  # 256 MiB, freed when the run ends
    return torch.cuda.max_memory_allocated()


def cuda_state():
    import torch

    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "peak": torch.cuda.max_memory_allocated(),
            "rand": torch.rand(2, device="cuda").tolist()}


@pytest.mark.gpu
def test_cuda_memory_returns_to_its_baseline_between_warm_nccl_runs(capsys):
    with labkit.workers(nproc=1, backend="nccl") as p:
        base = p.run(cuda_state).values[0]
        assert p.run(cuda_memory).values[0] >= 256 << 20
        after = p.run(cuda_state).values[0]
        assert after["allocated"] == base["allocated"] and after["reserved"] <= base["reserved"]
        assert after["peak"] < 256 << 20, "the peak counter starts afresh each run"
        assert after["rand"] != base["rand"], "CUDA's generator is reseeded"
        capsys.readouterr()
        p.run(keep_a_cuda_tensor)
        out = capsys.readouterr().out
        assert "[rank0] [labkit] rank 0: this run left 4.0 MiB of CUDA tensors alive" in out


@pytest.mark.gpu
def test_seeded_cuda_numbers_are_the_same_warm_and_cold():
    def seeded():
        import torch

        torch.manual_seed(3)
        return torch.rand(4, device="cuda").tolist()

    with labkit.workers(nproc=1, backend="nccl") as p:
        assert p.run(seeded).values == launch(seeded, nproc=1, backend="nccl").values

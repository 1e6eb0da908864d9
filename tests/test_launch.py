"""labkit.launch on CPU ranks (gloo): results, live output, failures, timeouts, no orphans."""

from __future__ import annotations

import os
import signal
import socket
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


def workers_of(controller_pid: int) -> list[psutil.Process]:
    """Every process that a given controller started, found by the variable labkit gives them."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("LABKIT_CONTROLLER_PID") == str(controller_pid):
                found.append(p)
        except psutil.Error:
            pass
    return found


def wait_no_workers(controller_pid: int, within: float) -> list[psutil.Process]:
    deadline = time.monotonic() + within
    while (left := workers_of(controller_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def controller_script(tmp_path: Path, body: str) -> Path:
    """A script whose functions live in __main__, as a notebook's do."""
    script = tmp_path / "controller.py"
    script.write_text("import os, sys, time\nimport labkit\n" + textwrap.dedent(body))
    return script


def run_controller(script: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=kw.pop("timeout", 120), cwd=script.parent, **kw)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temp folder of this test's own, for launches here and in controller subprocesses."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# ---- results -----------------------------------------------------------------------------


def test_main_function_and_closure_run_on_two_workers(tmp_path):
    script = controller_script(tmp_path, """
        import torch, torch.distributed as dist

        def total(x):
            t = torch.tensor([x + dist.get_rank()])
            dist.all_reduce(t)
            return {"rank": dist.get_rank(), "sum": t, "world": dist.get_world_size()}

        offset = 100
        closure = lambda: offset + dist.get_rank()

        res = labkit.launch(total, 10, nproc=2)
        print("VALUES", [(v["rank"], v["sum"].item(), v["world"]) for v in res.values])
        print("CLOSURE", labkit.launch(closure, nproc=2).values)
        print("LOGS", sorted(res.logs), res.backend)
    """)
    out = run_controller(script)
    assert out.returncode == 0, out.stderr
    assert "VALUES [(0, 21, 2), (1, 21, 2)]" in out.stdout
    assert "CLOSURE [100, 101]" in out.stdout
    assert "LOGS [] gloo" in out.stdout  # the workers printed nothing


def ends_with_an_atexit_function_and_native_output(folder):
    import atexit
    import ctypes

    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)  # gloo's threads then hold this collective, as in any training run
    rank = dist.get_rank()
    atexit.register(lambda: open(os.path.join(folder, f"atexit-{rank}"), "w").close())
    ctypes.CDLL(None).printf(b"native line of rank %d\n", rank)  # C's stdio: buffered in a pipe
    return t.item()


def test_a_rank_leaves_as_exit_would_atexit_functions_run_and_native_output_kept(tmp_path):
    """Ranks end with os._exit after what exit does that matters: the atexit functions ran,
    C's buffered output reached the cell, and the run succeeded."""
    res = launch(ends_with_an_atexit_function_and_native_output, str(tmp_path), nproc=2,
                 warm=False, show_ranks=[])
    assert res.values == [2.0, 2.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["atexit-0", "atexit-1"]
    assert any("native line of rank 1" in line for line in res.logs[1])


def test_rank_pids_skips_a_rank_file_removed_while_it_reads(tmp_path):
    from labkit._failures import rank_pids
    from labkit._protocol import pid_file

    (tmp_path / pid_file(0)).write_text('{"pid": 123, "local_rank": 0}')
    (tmp_path / pid_file(1)).symlink_to(tmp_path / "gone")  # listed, then not there to read
    assert rank_pids(tmp_path) == {0: 123}


def test_worker_output_streams_while_the_run_goes_on(tmp_path):
    script = controller_script(tmp_path, """
        def chatty():
            print("first", flush=True)
            time.sleep(3)
            print("second")
            return 1

        res = labkit.launch(chatty, nproc=1)
        print("DONE", res.logs)
    """)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    arrived = {}
    for line in proc.stdout:
        arrived.setdefault(line.split(" ")[0] + " " + line.split(" ")[1].strip(), time.monotonic())
    assert proc.wait(60) == 0
    first, second = arrived["[rank0] first"], arrived["[rank0] second"]
    assert second - first >= 2.5, "the first line waited for the end of the run"
    assert "DONE {0:" in next(k for k in arrived if k.startswith("DONE"))


def test_show_ranks_filters_and_a_quiet_run_shows_progress(capsys, monkeypatch):
    monkeypatch.setattr("labkit._engine._HEARTBEAT", 0.5)
    res = launch(print_rank_then_wait, nproc=2, show_ranks=1)
    out = capsys.readouterr().out
    assert "[rank1] I am 1" in out and "[rank0]" not in out
    assert "showing rank(s) [1] only" in out
    assert res.logs[0] == ["I am 0"], "hidden lines are still kept"
    assert "s elapsed, 2 of 2 rank(s) still running" in out


def test_progress_line_says_when_only_the_shutdown_is_left():
    from labkit._engine import _progress_line

    assert _progress_line(31.2, 2, 2) == "[labkit] 31 s elapsed, 2 of 2 rank(s) still running"
    assert _progress_line(60, 0, 2) == ("[labkit] 60 s elapsed: all 2 rank(s) have returned; "
                                        "waiting for torchrun to shut the workers down")


def print_rank_then_wait():
    import torch.distributed as dist

    print("I am", dist.get_rank(), flush=True)
    time.sleep(2)


def test_script_mode_runs_a_file_with_its_arguments(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys, torch.distributed as dist
        dist.init_process_group("gloo")
        print("args", sys.argv[1:], "world", dist.get_world_size())
    """))
    res = launch(str(script), "--epochs", "1", nproc=2)
    assert res.values == [None, None]
    assert res.logs[1] == ["args ['--epochs', '1'] world 2"]


def test_script_that_exits_nonzero_is_a_failure(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(LaunchError, match="SystemExit"):
        launch(script, nproc=1)


# ---- failures, hangs, interrupts -----------------------------------------------------------


def test_exception_on_rank_1_names_the_rank_and_leaves_no_process(tmp_path):
    script = controller_script(tmp_path, """
        import torch.distributed as dist

        def boom():
            if dist.get_rank() == 1:
                raise ValueError("boom")
            time.sleep(60)

        print("PID", os.getpid(), flush=True)
        try:
            labkit.launch(boom, nproc=2)
        except labkit.LaunchError as e:
            print("RANK", e.rank)
            print("MESSAGE", str(e).replace(chr(10), " | "))
            print("ENDED", time.time(), flush=True)
            time.sleep(8)  # stay alive: the check below looks for this controller's workers
    """)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    lines = {}
    for line in proc.stdout:
        key, _, rest = line.partition(" ")
        lines[key] = rest.strip()
        if key == "ENDED":
            break
    pid = int(lines["PID"])
    assert lines["RANK"] == "1"
    assert "rank 1 failed with ValueError: boom" in lines["MESSAGE"]
    assert 'raise ValueError("boom")' in lines["MESSAGE"], "the traceback shows the user's source"
    assert not wait_no_workers(pid, within=5.0), "workers outlived the failed run"
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSEGV", "SIGKILL in a collective"])
def test_a_rank_killed_by_a_signal_is_named_with_its_signal(how):
    name = how.split()[0]
    with pytest.raises(LaunchError) as info:
        launch(die_on_rank_1, name, "collective" in how, nproc=2, show_ranks=[])
    err, number = info.value, int(getattr(signal, name))
    assert err.rank == 1
    assert f"rank 1 was killed by {name} (signal {number})" in str(err)
    if name == "SIGKILL":
        assert "out-of-memory killer" in str(err) and "`dmesg`" in str(err)
    else:  # faulthandler's stack of the crash: the user's frame, not the shim's
        assert "Python stack at the crash" in str(err) and "in die_on_rank_1" in str(err)
        assert "_worker.py" not in str(err)
    if "collective" in how:  # rank 0 lost its peer: told as a consequence, after the cause
        assert str(err).index("Then rank 0 failed with") > str(err).index("SIGKILL")
    assert not wait_no_workers(os.getpid(), within=5.0)


def die_on_rank_1(signal_name, in_collective):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.5)  # rank 0 is waiting (in the all-reduce, or asleep) by now
        os.kill(os.getpid(), getattr(signal, signal_name))
    if in_collective:
        dist.all_reduce(torch.ones(1))
    time.sleep(30)


def test_exit_codes_read_from_torchruns_report_leave_out_the_ranks_it_stopped():
    from labkit._failures import _exit_codes

    agent_log = [  # torch 2.14's own lines, for a rank 1 killed by the OOM killer
        "W1201 09:22:19.12 3779 multiprocessing/api.py:1028] Sending process 3785 closing signal "
        "SIGTERM",
        "E1201 09:22:19.13 3779 multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 "
        "(pid: 3786) of binary: /venv/bin/python",
        "Failures:", "[1]:", "  rank      : 0 (local_rank: 0)",
        "  exitcode  : -15 (pid: 3785)  (SIGTERM)",
        "Root Cause (first observed failure):", "[0]:", "  rank      : 1 (local_rank: 1)",
        "  exitcode  : -9 (pid: 3786)  (SIGKILL)",
    ]
    assert _exit_codes(agent_log, {0: 3785, 1: 3786}) == {1: -9}
    assert _exit_codes(agent_log[1:2], {1: 3786}) == {1: -9}, "the first line alone is enough"
    assert _exit_codes(agent_log[1:2], {}) == {}, "a pid of no rank of this run names no rank"


def test_a_rank_torchrun_stopped_after_a_peer_raised_is_not_named_as_the_cause(tmp_path):
    # The race a CI run met: rank 1 raised, torchrun's agent stopped rank 0 with SIGTERM, and the
    # supervisor found rank 0 gone without an outcome before it looked at the agent's report.
    import json

    import cloudpickle

    from labkit._failures import failure, read_errors
    from labkit._protocol import error_file, exit_file, pid_file

    for rank, pid in ((0, 3785), (1, 3786)):
        (tmp_path / pid_file(rank)).write_text(json.dumps({"pid": pid, "local_rank": rank}))
    (tmp_path / error_file(1)).write_bytes(cloudpickle.dumps({
        "rank": 1, "type": "ValueError", "message": "boom", "traceback": "ValueError: boom\n",
        "exception_only": "ValueError: boom\n", "time": time.time()}))
    (tmp_path / exit_file(3785)).write_text("-15")
    (tmp_path / exit_file(3786)).write_text("1")
    stopped = ["W1201 09:22:19.12 3779 multiprocessing/api.py:1028] Sending process 3785 closing "
               "signal SIGTERM"]
    err = failure(None, 1, stopped, {}, dead=[0], run_dir=tmp_path)
    assert err.rank is None, "a rank torchrun stopped is no cause: no rank is named"
    err = failure(read_errors(tmp_path)[0], 1, stopped, {}, dead=[0], run_dir=tmp_path)
    assert err.rank == 1 and str(err).startswith("rank 1 failed with ValueError: boom")
    # Without the agent's word, a rank gone without an outcome is still the cause (a SIGKILL).
    killed = failure(None, 1, [], {}, dead=[0], run_dir=tmp_path)
    assert killed.rank == 0 and "rank 0 was killed by SIGTERM" in str(killed)


def test_after_a_silent_death_the_supervisor_waits_briefly_for_the_peers_consequence(tmp_path):
    # Rank 1 was killed in a collective; rank 0 (a live process here) has not yet written the
    # lost connection it will raise. Stopped at once, the report would tell the cause alone.
    import json
    import subprocess
    import sys

    from labkit._failures import await_peers
    from labkit._protocol import error_file, pid_file

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for rank, pid in ((0, peer.pid), (1, 2 ** 22 + 12345)):  # rank 1's pid: long gone
            (tmp_path / pid_file(rank)).write_text(json.dumps({"pid": pid, "local_rank": rank}))
        began = time.monotonic()
        assert not await_peers(tmp_path, [1], within=0.3), "rank 0 is alive and silent"
        assert 0.3 <= time.monotonic() - began < 5
        threading.Timer(0.2, lambda: (tmp_path / error_file(0)).write_bytes(b"x")).start()
        assert await_peers(tmp_path, [1], within=10), "rank 0's error record came"
        (tmp_path / error_file(0)).unlink()
        peer.kill()
        peer.wait()
        assert await_peers(tmp_path, [1], within=0), "rank 0 ended: nothing to wait for"
    finally:
        peer.kill()
        peer.wait()


def test_a_huge_exception_message_is_shortened_and_kept_whole():
    with pytest.raises(LaunchError) as info:
        launch(raise_a_huge_message, nproc=2, show_ranks=[])
    err, text = info.value, str(info.value)
    assert err.rank == 1 and text.startswith("rank 1 failed with ValueError: tensor([[0.1234,")
    assert len(text) < 3000, len(text)
    assert "more characters: the LaunchError's .full_message has the whole text" in text
    assert "raise ValueError(" in text, "the traceback's frames are still shown"
    assert huge_message() in err.full_message


def huge_message():
    return "tensor([[" + ",\n".join("0.1234, 0.5678, 0.9012" for _ in range(800)) + "]])"


def raise_a_huge_message():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(huge_message())


def test_a_short_error_keeps_its_message_and_a_long_traceback_its_last_lines():
    from labkit._failures import _raised

    tb = 'Traceback (most recent call last):\n  File "<cell>", line 3, in f\nValueError: boom\n'
    short = {"rank": 1, "type": "ValueError", "message": "boom", "traceback": tb,
             "exception_only": "ValueError: boom\n"}
    assert _raised(short) == ("rank 1 failed with ValueError: boom\n\n--- rank 1 traceback ---\n"
                              + tb.rstrip())
    frames = "".join(f'  File "m.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(30))
    deep = dict(short, traceback=f"Traceback (most recent call last):\n{frames}ValueError: boom\n")
    shown = _raised(deep).split("--- rank 1 traceback ---\n")[1].split("\n")
    assert shown[0] == ("... (21 earlier lines: the LaunchError's .full_message has the whole "
                        "traceback)")
    assert shown[1:] == deep["traceback"].rstrip().split("\n")[-41:-1] + ["ValueError: boom"]


def test_timeout_names_the_stuck_rank_with_its_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(skip_collective_on_rank_1, nproc=2, timeout=10)
    assert time.monotonic() - start < 25
    err = info.value
    assert err.stuck == [0]
    assert "Stuck rank(s): 0" in str(err)
    assert "in all_reduce" in err.stacks[0] and "skip_collective_on_rank_1" in err.stacks[0]
    assert "_watch_controller" not in err.stacks[0], "labkit's own threads are left out"
    # A rank forked from torchrun's agent: the agent's frames below the fork are left out too.
    assert "torch/distributed/run.py" not in err.stacks[0] and "_forkrank" not in err.stacks[0]
    assert not wait_no_workers(os.getpid(), within=5.0)


def skip_collective_on_rank_1():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return dist.get_rank()


@pytest.mark.parametrize("how", ["interrupt", "sigkill"])
def test_no_worker_survives_the_controller(tmp_path, private_tmp, how):
    script = controller_script(tmp_path, """
        def slow():
            print("started", flush=True)
            time.sleep(120)

        # A kernel always handles SIGINT; a process started in the background by a shell
        # (as CI may be) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
        import signal
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print("PID", os.getpid(), flush=True)
        try:
            labkit.launch(slow, nproc=2)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)
    pid = None
    for line in proc.stdout:
        if line.startswith("PID"):
            pid = int(line.split()[1])
        if "started" in line:
            break
    assert len(workers_of(pid)) >= 3, "torchrun and two workers should be running"
    if how == "interrupt":
        proc.send_signal(signal.SIGINT)  # what a Jupyter kernel interrupt does
        assert "INTERRUPTED" in proc.stdout.read()
    else:
        proc.kill()
    proc.wait(30)
    time.sleep(10)
    assert not workers_of(pid), f"workers survived the controller ({how})"
    assert not list(private_tmp.glob("labkit-run-*")), "the run folder outlived the controller"


# ---- many runs -----------------------------------------------------------------------------


def test_two_launches_at_once_do_not_clash():
    results = {}

    def go(i):
        results[i] = launch(rank_times, i, nproc=2, show_ranks=[]).values

    threads = [threading.Thread(target=go, args=(i,)) for i in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {1: [0, 1], 2: [0, 2]}


def rank_times(k):
    import torch.distributed as dist

    return dist.get_rank() * k


@pytest.mark.slow
def test_launches_in_a_row_leave_nothing_behind(private_tmp):
    # A leak of even one descriptor, folder or process per launch shows after the second
    # launch; three in a row (each a cold start, seconds of CPU) show it three times over.
    me = psutil.Process()
    launch(rank_times, 1, nproc=1)  # warm caches before counting descriptors
    fds_before = me.num_fds()
    for _ in range(3):
        assert launch(rank_times, 1, nproc=1).values == [0]
    assert me.num_fds() <= fds_before
    assert not list(private_tmp.iterdir())
    assert not workers_of(os.getpid())


def test_keep_run_dir_keeps_it_private(capsys):
    launch(rank_times, 1, nproc=1, keep_run_dir=True)
    kept = Path(capsys.readouterr().out.split("run folder kept: ")[1].split()[0])
    try:
        assert (kept.stat().st_mode & 0o777) == 0o700
        assert (kept / "result-0.pkl").exists()
    finally:
        import shutil

        shutil.rmtree(kept)


# ---- frameworks and nodes ------------------------------------------------------------------


def test_tensorflow_multiworker_mirrored_strategy_trains_the_same_weights():
    values = launch(train_keras_mwms, nproc=2, framework="tensorflow", timeout=180,
                    show_ranks=[]).values
    import numpy as np

    (w0, loss0, torch0), (w1, loss1, torch1) = values
    assert not torch0 and not torch1, "a TensorFlow worker imported torch"
    assert loss0 == pytest.approx(loss1)
    assert all(np.allclose(a, b) for a, b in zip(w0, w1, strict=True))


def train_keras_mwms():
    import json

    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
        opt = tf.keras.optimizers.SGD(0.1)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    x = tf.random.stateless_normal((64, 4), seed=(task, 1))  # each worker its own data
    y = tf.reduce_sum(x, 1, keepdims=True)
    data = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(16).repeat()))

    @tf.function
    def step(batches):
        def replica(batch):
            xb, yb = batch
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss
        return strategy.reduce("MEAN", strategy.run(replica, args=(next(batches),)), axis=None)

    for _ in range(5):
        loss = step(data)
    return [w.numpy() for w in model.trainable_variables], float(loss), "torch" in sys.modules


def test_two_nodes_on_loopback_all_reduce(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = controller_script(tmp_path, f"""
        import torch, torch.distributed as dist
        node = int(sys.argv[1])

        def total():
            t = torch.tensor([dist.get_rank() + 1])
            dist.all_reduce(t)
            return dist.get_rank(), dist.get_world_size(), t.item()

        res = labkit.launch(total, nproc=1, nnodes=2, node_rank=node,
                            rdzv_endpoint="127.0.0.1:{port}", timeout=90)
        print("RESULT", res.values)
    """)
    nodes = [subprocess.Popen([sys.executable, str(script), str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=tmp_path) for n in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), outs
    results = sorted(line for out in outs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == ["RESULT [(0, 2, 3)]", "RESULT [(1, 2, 3)]"]
    assert "--node-rank 1" in outs[0], "node 0 prints the command for the other node"


# ---- the %%distributed magic and the CLI -------------------------------------------------------


def test_distributed_cell_magic_sends_and_brings_back_variables():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.run_cell("%load_ext labkit", store_history=False).raise_error()
        shell.user_ns["x"] = 10
        shell.run_cell("%%distributed -n 2 --in x --out total,me\n"
                       "t = torch.tensor([x + rank]); dist.all_reduce(t)\n"
                       "total = t.item(); me = rank\n").raise_error()
        assert shell.user_ns["total"] == [21, 21]
        assert shell.user_ns["me"] == [0, 1]
        with pytest.raises(NameError, match="not defined in the notebook"):
            shell.run_cell("%%distributed -n 1 --in nowhere\npass\n").raise_error()
    finally:
        InteractiveShell.clear_instance()


def test_cli_launch_runs_a_script_and_reports_failure(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("import os\nprint('hi from', os.environ['RANK'])\n")
    out = subprocess.run([sys.executable, "-m", "labkit", "launch", "-n", "2", str(good)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[rank0] hi from 0" in out.stdout and "[rank1] hi from 1" in out.stdout
    out = subprocess.run([sys.executable, "-m", "labkit", "launch", str(tmp_path / "missing.py")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no script at" in out.stderr


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nproc", [0, -1, 1.5, True])
def test_nproc_below_one_or_not_whole(nproc):
    with pytest.raises(ValueError, match="nproc must be a whole number >= 1"):
        launch(rank_times, 1, nproc=nproc)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'mpi'.*auto, gloo, nccl"):
        launch(rank_times, 1, backend="mpi")


def test_unknown_framework():
    with pytest.raises(ValueError, match="unknown framework 'jax'"):
        launch(rank_times, 1, framework="jax")


@pytest.mark.parametrize("timeout", [0, -5])
def test_timeout_not_positive(timeout):
    with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
        launch(rank_times, 1, timeout=timeout)


def test_nccl_without_gpus(monkeypatch):
    monkeypatch.setattr("labkit._spawn.visible_gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="needs CUDA GPUs.*backend='gloo'"):
        launch(rank_times, 1, backend="nccl")


def test_nccl_with_fewer_gpus_than_ranks(monkeypatch):
    monkeypatch.setattr("labkit._spawn.visible_gpu_count", lambda: 1)
    with pytest.raises(ValueError, match="one GPU per local rank: nproc=2 but 1 GPU"):
        launch(rank_times, 1, nproc=2, backend="nccl")


def test_auto_backend_picks_nccl_only_with_a_gpu_per_rank(monkeypatch):
    from labkit._spawn import validate

    for gpus, nproc, expected in [(0, 2, "gloo"), (1, 2, "gloo"), (2, 2, "nccl"), (8, 4, "nccl")]:
        monkeypatch.setattr("labkit._spawn.visible_gpu_count", lambda g=gpus: g)
        job, _ = validate(rank_times, (), {}, nproc, "auto", None, "torch", 1, 0, None)
        assert job.backend == expected, (gpus, nproc)


def test_unpicklable_argument_is_named():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"argument 1 \(lock\)"):
        launch(rank_times, 1, lock, nproc=1)
    with pytest.raises(TypeError, match="keyword argument 'guard'"):
        launch(rank_times, 1, nproc=1, guard=lock)


def test_unpicklable_function_is_named():
    lock = threading.Lock()

    def uses_lock():
        return lock

    with pytest.raises(TypeError, match="the function .*uses_lock"):
        launch(uses_lock, nproc=1)


def test_a_function_reading_an_attribute_named_classes_is_shipped():
    # cloudpickle takes `ds.classes` in a function that uses torch for torch.classes, a
    # ModuleType subclass it cannot pickle; the launcher sends such modules by name.
    import pickle

    import torch

    from labkit._spawn import _dumps_with_sources

    def count(ds):
        return torch.zeros(len(ds.classes)).numel()

    from labkit._protocol import Task

    outer = pickle.loads(_dumps_with_sources(Task(1, (count, (), {}), [], "/")))
    fn = pickle.loads(outer["job"]).payload[0]
    assert fn(type("Dataset", (), {"classes": ["cat", "dog", "bird"]})) == 3


def test_missing_script():
    with pytest.raises(FileNotFoundError, match="no script at 'nope.py'.*%%writefile"):
        launch("nope.py", nproc=1)


def test_not_a_function():
    with pytest.raises(TypeError, match="needs a function or a script path"):
        launch(42)


def test_multi_node_needs_an_endpoint():
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        launch(rank_times, 1, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="0 <= node_rank < nnodes"):
        launch(rank_times, 1, nnodes=2, node_rank=2, rdzv_endpoint="127.0.0.1:1")


def test_unpicklable_return_value_names_the_rank():
    with pytest.raises(LaunchError, match="return value of rank 0 .*cannot be pickled") as info:
        launch(return_a_lock, nproc=1)
    assert info.value.rank == 0


def return_a_lock():
    return threading.Lock()


def test_timeout_is_a_launch_error():
    assert issubclass(labkit.LaunchTimeout, labkit.LaunchError)


@pytest.mark.gpu
def test_nccl_ranks_get_their_own_gpu_and_results_come_back_on_cpu():
    import torch

    n = min(2, torch.cuda.device_count())
    values = launch(cuda_all_reduce, nproc=n, backend="nccl").values
    assert [v["device"] for v in values] == [f"cuda:{r}" for r in range(n)]
    assert all(v["sum"].device.type == "cpu" and v["sum"].item() == n for v in values)
    assert all(v["backend"] == "nccl" for v in values)


def cuda_all_reduce():
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return {"device": str(t.device), "sum": t, "backend": dist.get_backend()}


# ---- stray_workers ---------------------------------------------------------------------------


def test_stray_workers_lists_a_running_launch_and_nothing_after_it():
    from labkit.launcher import stray_workers

    seen, started, done = [], set(), threading.Event()

    def go():
        try:
            launch(sleep_then_return, 4.0, nproc=2, show_ranks=[])
        finally:
            done.set()

    thread = threading.Thread(target=go)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            seen = stray_workers()
            # torchrun's agent and both workers: a worker forked from the agent has its
            # command line, and the agent's names the worker module too.
            if sum("-m labkit._worker" in s for s in seen) >= 3:
                started = {p.pid for p in workers_of(os.getpid())}
                break
            time.sleep(0.2)
    finally:
        thread.join(120)
    live = {int(s.split(":")[0]) for s in seen}
    assert len(live) >= 3, f"torchrun and two workers should be listed while running: {seen}"
    assert live <= started, "only processes this controller started are listed"
    assert stray_workers() == []


def sleep_then_return(seconds):
    time.sleep(seconds)
    return seconds


def test_stray_workers_finds_a_worker_of_this_controller_only():
    from labkit.launcher import stray_workers

    def fake_worker(controller_pid):
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                                 "labkit._worker"],
                                env=dict(os.environ, LABKIT_CONTROLLER_PID=str(controller_pid)))

    mine, other = fake_worker(os.getpid()), fake_worker(os.getpid() + 1_000_000)
    try:
        listed = {int(s.split(":")[0]): s for s in stray_workers()}
        assert mine.pid in listed
        assert "labkit._worker" in listed[mine.pid]
        assert other.pid not in listed
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()
    assert stray_workers() == []


# ---- env: variables for the workers ------------------------------------------------------------


def test_env_reaches_the_workers_before_the_process_group_and_kwargs_still_reach_fn(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = launch(report_env, 7, nproc=2, show_ranks=[], label="x",
                 env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "LABKIT_TEST_VALUE": "42",
                      "OMP_NUM_THREADS": "3"})
    for rank, value in enumerate(res.values):
        assert value == {"rank": rank, "debug": "DETAIL", "value": "42", "omp": "3",
                         "args": (7,), "kwargs": {"label": "x"}}
    assert "LABKIT_TEST_VALUE" not in os.environ, "the controller's own environment is untouched"


def report_env(*args, **kwargs):
    import torch.distributed as dist

    return {"rank": dist.get_rank(),
            # torch reads it once, when torch.distributed is imported: env must be set by then
            "debug": dist.get_debug_level().name,
            "value": os.environ.get("LABKIT_TEST_VALUE"), "omp": os.environ["OMP_NUM_THREADS"],
            "args": args, "kwargs": kwargs}


def test_worker_env_puts_env_over_the_controllers_but_keeps_labkits_own(monkeypatch):
    from labkit._spawn import worker_env

    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    env = worker_env(2, 0, {"NCCL_DEBUG": "INFO", "LABKIT_CONTROLLER_PID": "1"})
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["LABKIT_CONTROLLER_PID"] == str(os.getpid()), "the watchdog must find this process"
    assert worker_env(2, 0)["NCCL_DEBUG"] == "WARN"


@pytest.mark.parametrize("env, match", [
    ([("NCCL_DEBUG", "INFO")], r"env must be a dict of variable names to values, got list: "
                               r"e\.g\. env=\{'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'\}"),
    ({1: "x"}, r"env: 1 is not a valid variable name: use a non-empty string without '='"),
    ({"": "x"}, r"env: '' is not a valid variable name"),
    ({"A=B": "x"}, r"env: 'A=B' is not a valid variable name"),
    ({"TORCH_NCCL_TRACE_BUFFER_SIZE": 2000},
     r"env\['TORCH_NCCL_TRACE_BUFFER_SIZE'\] is int 2000, but environment values are strings: "
     r"write 'TORCH_NCCL_TRACE_BUFFER_SIZE': '2000'"),
    ({"X": None}, r"env\['X'\] is NoneType None"),
    ({"X": "a\0b"}, r"env\['X'\] contains a NUL character"),
])
def test_bad_env_is_refused_before_anything_starts(env, match):
    with pytest.raises(ValueError, match=match):
        launch(rank_times, 1, nproc=1, env=env)


def _slow_start_env(tmp_path, seconds: float) -> dict:
    """Every Python process of the run (torchrun's agent, each rank) sleeps at start-up."""
    (tmp_path / "sitecustomize.py").write_text(f"import time\ntime.sleep({seconds})\n")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_the_timeout_counts_from_the_function_not_from_the_start_up(tmp_path):
    # Start-up takes over 4 s here, the function 0.5 s: a timeout of 2 s is the function's.
    start = time.monotonic()
    values = launch(time.sleep, 0.5, nproc=1, timeout=2, env=_slow_start_env(tmp_path, 2.0),
                    warm=False).values
    assert values == [None] and time.monotonic() - start > 4


def test_a_start_up_slower_than_its_limit_is_a_timeout_that_says_so(tmp_path, monkeypatch):
    from labkit import _engine

    monkeypatch.setattr(_engine, "STARTUP_S", 1.0)
    with pytest.raises(LaunchTimeout, match="did not start the function within 1 s"):
        launch(time.sleep, 0.1, nproc=1, timeout=0.5, env=_slow_start_env(tmp_path, 5.0),
               warm=False)
    assert not wait_no_workers(os.getpid(), within=5.0)

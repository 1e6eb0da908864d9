"""Ranks forked from torchrun's agent (labkit._forkrank): when, and that a fork is a rank as a
new interpreter is one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from labkit import launch
from labkit._forkrank import ForkedRank, popen
from labkit._spawn import worker_env
from labkit.launcher import LaunchError


def test_only_a_torch_run_on_cpus_forks_and_the_environment_can_say_no(monkeypatch):
    monkeypatch.delenv("LABKIT_FORK_RANKS", raising=False)
    assert worker_env(2, 0)["LABKIT_FORK_RANKS"] == "1"
    assert worker_env(2, 2)["LABKIT_FORK_RANKS"] == "0", "CUDA ranks start afresh"
    assert worker_env(2, 0, framework="tensorflow")["LABKIT_FORK_RANKS"] == "0"
    assert worker_env(2, 0, {"LABKIT_FORK_RANKS": "0"})["LABKIT_FORK_RANKS"] == "0"
    monkeypatch.setenv("LABKIT_FORK_RANKS", "0")
    assert worker_env(2, 0)["LABKIT_FORK_RANKS"] == "0"
    assert worker_env(2, 1, {"LABKIT_FORK_RANKS": "1"})["LABKIT_FORK_RANKS"] == "0"
    monkeypatch.delenv("LABKIT_FORK_RANKS")
    monkeypatch.setattr("labkit._spawn.sys.platform", "darwin")
    assert worker_env(2, 0)["LABKIT_FORK_RANKS"] == "0", "only Linux forks its ranks"


def test_any_other_command_torchrun_asks_for_is_started_as_it_would_be():
    proc = popen([sys.executable, "-c", "raise SystemExit(3)"], env=dict(os.environ),
                 stdout=None, stderr=None, start_new_session=True)
    assert type(proc) is subprocess.Popen and proc.wait(30) == 3
    # labkit's worker command with its output sent elsewhere: not a fork either
    with open(os.devnull, "w") as sink:
        proc = popen([sys.executable, "-c", "pass", "-m", "labkit._worker", "/nowhere"],
                     env=dict(os.environ), stdout=sink, stderr=None)
        assert type(proc) is subprocess.Popen and proc.wait(30) == 0


def test_a_waiting_child_that_is_gone_leaves_the_command_to_start_itself():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    read, write = os.pipe()
    os.close(read)  # the child's end: its order cannot arrive
    proc = ForkedRank([sys.executable, "-c", "raise SystemExit(4)"], env=dict(os.environ),
                      start_new_session=True, child=(gone.pid, write))
    assert proc.pid != gone.pid and proc.wait(30) == 4


def where_am_i(stop_on_rank_1=False):
    import random
    import sys

    import numpy
    import torch
    import torch.distributed as dist

    if stop_on_rank_1 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    with open("/proc/self/cmdline") as f:  # a fork keeps the agent's: python -c <boot> ...
        forked = f.read().split("\0")[1] == "-c"
    return {"forked": forked, "session": os.getsid(0),
            "pid": os.getpid(), "main": sys.modules["__main__"].__name__,
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "numpy": float(numpy.random.random()), "torch": torch.initial_seed(),
            "random": random.random(), "handler": signal.getsignal(signal.SIGTERM)}


def test_a_forked_rank_has_what_a_new_interpreter_gives_it():
    runs = {fork: launch(where_am_i, nproc=2, show_ranks=[], warm=False,
                         env={"LABKIT_FORK_RANKS": fork}).values for fork in ("1", "0")}
    for fork, got in runs.items():
        assert [g["forked"] for g in got] == [fork == "1"] * 2
        for g in got:
            assert g["session"] == g["pid"], "a session of its own, as torchrun asks"
            assert g["handler"] == signal.SIG_DFL, "not the agent's SIGTERM handler"
            assert g["main"] in ("__main__", "labkit._worker")
        for generator in ("numpy", "torch", "random"):  # each rank seeds them afresh
            assert got[0][generator] != got[1][generator], (fork, generator)
    # No descriptor of the agent's (its rendezvous store's socket) stays open in a forked rank.
    assert len(runs["1"][0]["fds"]) <= len(runs["0"][0]["fds"]), runs


def test_a_forked_rank_killed_by_sigterm_is_named_with_its_signal():
    with pytest.raises(LaunchError) as info:
        launch(where_am_i, True, nproc=2, show_ranks=[], warm=False, timeout=60)
    assert info.value.rank == 1 and "rank 1 was killed by SIGTERM" in str(info.value)

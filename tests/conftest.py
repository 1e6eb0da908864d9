"""Shared test setup: headless matplotlib, and `gpu`-marked tests skipped where CUDA is absent."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile

import pytest

# Figures in tests are rendered off-screen; no display is needed (or wanted) in CI.
os.environ.setdefault("MPLBACKEND", "Agg")
# Exercise passes are recorded in $LABKIT_HOME: never in the home of whoever runs the tests.
_HOME = tempfile.TemporaryDirectory(prefix="labkit-home-")
os.environ["LABKIT_HOME"] = _HOME.name


@functools.lru_cache(maxsize=1)
def cuda_gpus() -> int:
    """How many CUDA GPUs torch can use, asked in a subprocess so this process stays CUDA-free."""
    from labkit.profile import visible_gpu_count

    if visible_gpu_count() == 0:  # no driver device files: skip the torch start-up entirely
        return 0
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True, text=True, timeout=120,
        )
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return 0


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and cuda_gpus() == 0:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group in this process: worker functions without a launcher."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    yield dist
    dist.destroy_process_group()


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


@pytest.fixture(scope="session", autouse=True)
def _warm_pool_stopped_at_the_end():
    """Tests that run warm (``warm=True``, ``check.on_ranks``) share the session's warm workers;
    they are stopped when the session ends, and the temporary LABKIT_HOME is removed."""
    yield
    from labkit import launcher

    launcher.stop_workers()
    _HOME.cleanup()


@pytest.fixture(scope="module")
def no_warm_pools():
    """For a test file that counts this process's workers: it starts with no warm pool.

    Warm pools (``check.on_ranks``'s) live for the session, and under pytest-xdist a worker
    process runs the test files in any order, so another file's pool would be counted as a
    leftover of this file's launches.
    """
    from labkit import launcher

    launcher.stop_workers()
    yield


class DisplayHandle:
    """What IPython.display.display returns with display_id=True: it records the updates."""

    def __init__(self, data):
        self.data, self.updates = data, []

    def update(self, data, raw=False):
        assert raw
        self.data = data
        self.updates.append(data)


@pytest.fixture
def displayed(monkeypatch):
    """Every display() call, as (data, handle); the handles follow their updates."""
    import IPython.display

    shown = []

    def display(data, raw=False, display_id=None):
        assert raw and isinstance(data, dict)
        handle = DisplayHandle(data) if display_id else None
        shown.append((data, handle))
        return handle

    monkeypatch.setattr(IPython.display, "display", display)
    return shown

"""labkit.profile: the smoke / cpu / gpu choice and knob()."""

import subprocess
import sys

import pytest

from labkit import knob, profile


@pytest.mark.parametrize("name", ["smoke", "cpu", "gpu", " GPU "])
def test_env_var_picks_the_profile(monkeypatch, name):
    monkeypatch.setenv("LABKIT_PROFILE", name)
    assert profile.current() == name.strip().lower()


def test_unknown_profile_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE", "bogus")
    with pytest.raises(profile.ProfileError, match="'bogus'.*smoke, cpu, gpu.*LABKIT_PROFILE"):
        profile.current()
    with pytest.raises(ValueError):  # ProfileError is a ValueError for callers that catch those
        knob(1, profile="huge")


@pytest.mark.parametrize("gpus, expected", [(0, "cpu"), (2, "gpu")])
def test_hardware_decides_without_the_env_var(monkeypatch, gpus, expected):
    monkeypatch.delenv("LABKIT_PROFILE", raising=False)
    monkeypatch.setattr(profile, "visible_gpu_count", lambda: gpus)
    assert profile.current() == expected


def test_visible_gpu_count_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(profile.glob, "glob", lambda pattern: ["/dev/nvidia0", "/dev/nvidia1"]
                        if pattern.startswith("/dev") else [])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert profile.visible_gpu_count() == 2
    for visible, count in [("0", 1), ("", 0), ("-1", 0), ("1,0", 2), ("0,-1,1", 1), ("0,1,2,3", 2)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert profile.visible_gpu_count() == count, visible


def test_no_driver_means_no_gpu(monkeypatch):
    monkeypatch.setattr(profile.glob, "glob", lambda pattern: [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert profile.visible_gpu_count() == 0


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("gpu", dict(cpu=5, smoke=1), 30),
        ("cpu", dict(cpu=5, smoke=1), 5),
        ("smoke", dict(cpu=5, smoke=1), 1),
        ("smoke", dict(cpu=5), 5),  # smoke falls back to cpu
        ("cpu", dict(smoke=1), 30),  # cpu falls back to full
        ("smoke", dict(), 30),
    ],
)
def test_knob_picks_by_profile(monkeypatch, name, kwargs, expected):
    monkeypatch.setenv("LABKIT_PROFILE", name)
    assert knob(30, **kwargs) == expected
    assert knob(30, **kwargs, profile=name) == expected


def test_bogus_profile_from_a_shell_is_a_clear_error():
    out = subprocess.run(
        [sys.executable, "-c", "import labkit; labkit.profile.current()"],
        env={"LABKIT_PROFILE": "bogus", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "ProfileError: unknown labkit profile 'bogus': use one of smoke, cpu, gpu" in out.stderr

"""Which size the notebooks run at: ``smoke`` (CI), ``cpu`` (a laptop) or ``gpu`` (full DLI scale).

The notebook code is the same in all three; only the sizes picked with :func:`knob` change.
Nothing here imports torch: the hardware is read from the device files the NVIDIA driver
creates, so that asking for the profile never initialises CUDA in the kernel.
"""

from __future__ import annotations

import glob
import os

PROFILES = ("smoke", "cpu", "gpu")
ENV_VAR = "LABKIT_PROFILE"

__all__ = ["PROFILES", "ENV_VAR", "ProfileError", "current", "knob", "visible_gpu_count"]


class ProfileError(ValueError):
    """An unknown profile name."""


def visible_gpu_count() -> int:
    """How many NVIDIA GPUs this process may use, read without touching CUDA."""
    found = (sorted(glob.glob("/dev/nvidia[0-9]*"))
             or sorted(glob.glob("/proc/driver/nvidia/gpus/*")))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(found)
    # CUDA stops at the first invalid entry ("-1" is the usual way to hide every GPU).
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(count, len(found)) if found else 0


def _check(name: str) -> str:
    key = name.strip().lower()
    if key not in PROFILES:
        raise ProfileError(
            f"unknown labkit profile {name!r}: use one of {', '.join(PROFILES)} "
            f"(e.g. `export {ENV_VAR}=cpu`), or unset {ENV_VAR} to pick from the hardware"
        )
    return key


def current() -> str:
    """The active profile: ``$LABKIT_PROFILE`` if set, else ``gpu`` with a GPU, else ``cpu``.

    Example::

        >>> import labkit
        >>> labkit.profile.current() in labkit.profile.PROFILES
        True
    """
    name = os.environ.get(ENV_VAR, "")
    if name.strip():
        return _check(name)
    return "gpu" if visible_gpu_count() > 0 else "cpu"


def knob(full, *, cpu=None, smoke=None, profile: str | None = None):
    """Pick a size by profile: ``full`` on ``gpu``, ``cpu`` on a laptop, ``smoke`` in CI.

    A missing ``smoke`` falls back to ``cpu``, a missing ``cpu`` to ``full``, so a notebook
    only names the sizes that must shrink.

    Example::

        epochs = knob(30, cpu=5, smoke=1)        # 30 on GPUs, 5 on a laptop, 1 in CI
        width = knob(1.0, cpu=0.25)              # smoke reuses the cpu value
    """
    name = _check(profile) if profile is not None else current()
    if name == "gpu":
        return full
    if name == "cpu":
        return full if cpu is None else cpu
    if smoke is not None:
        return smoke
    return full if cpu is None else cpu

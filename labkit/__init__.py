"""labkit: the helper package the course notebooks import.

``import labkit`` is cheap and framework-free: it imports neither torch nor TensorFlow
(TensorFlow notebooks import labkit too, and torchvision imported after TensorFlow in one
process crashes). Everything that needs a framework is loaded on first use.
"""

from __future__ import annotations

import importlib

from . import profile
from .profile import knob

__version__ = "0.1.0"

# name -> module that defines it, imported on first attribute access (PEP 562).
_LAZY = {
    "launch": ".launcher",
    "LaunchError": ".launcher",
    "LaunchTimeout": ".launcher",
    "LaunchResult": ".launcher",
    "stray_workers": ".launcher",
}

_LAZY_MODULES = ("doctor", "bench", "plots", "data", "models", "augment", "train", "check", "ddp",
                 "perf", "diagnose", "elastic", "resources", "slurm")

__all__ = ["profile", "knob", "__version__", *_LAZY, *_LAZY_MODULES]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'labkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython):
    """``%load_ext labkit`` registers the ``%%distributed`` cell magic."""
    from .magics import register

    register(ipython)

"""labkit: the helper package the course notebooks import.

``import labkit`` is cheap and framework-free: it imports neither torch nor TensorFlow
(TensorFlow notebooks import labkit too, and torchvision imported after TensorFlow in one
process crashes). Everything that needs a framework is loaded on first use.

Every notebook starts workers with :func:`labkit.launch` (``launcher``: the public API and
the cold path; ``warm``: the warm workers that run function after function; ``_worker``: the
shim every rank runs) and sizes itself with :func:`labkit.knob` (``profile``); beyond those,
each notebook's code lives in the rooms named for its topic:

- 00 environment check: ``doctor`` (facts and checks), ``bench`` (the first all-reduce, its
  sweep and the alpha-beta fit), ``machine`` (this machine's card), ``plots``.
- 01 VGG16 and augmentation (and its Keras twin): ``data``, ``augment``, ``models``, ``train``,
  ``check`` (the graded exercises), ``plots``, ``explorers`` (the augmentation explorer).
- 02 data parallelism (and its Keras twin): ``ddp`` (batch arithmetic, rank-0 checkpoints,
  the scaling sweep and its prediction, gradient buckets, the all-reduce counter), ``bench``
  (the link's alpha and beta), ``train``, ``data``, ``models``, ``plots``.
- 03 model parallelism: ``parallel.pipeline``, ``parallel.tensor``, ``parallel.memory``,
  ``plots``.
- 04 performance tuning: ``perf`` (each technique against its baseline, VGG16's throughput and
  MFU), ``ddp.bucket_sweep`` (overlap), ``data``, ``augment``, ``models``, ``plots``.
- 05 problem diagnosis: ``diagnose``.
- 06 custom algorithms: ``parallel.collectives``, ``parallel.parameter_server``,
  ``parallel.compression``, ``bench``, ``data``, ``plots``.
- 07 resources and multi-node: ``resources``, ``elastic``, ``slurm``, ``data``, ``models``,
  ``plots``.
- 08 capstone: ``capstone`` (the grader), ``ddp`` (the scaling report; ``predict_efficiency``
  for the case studies), ``train``, ``data``, ``augment``, ``models``, ``perf`` (peak FLOP/s),
  ``plots``.
- 09 sequence, context and expert parallelism: ``parallel.transformer`` (the running example),
  ``parallel.sequence``, ``parallel.context``, ``parallel.expert``, ``parallel.traffic`` (the
  bytes each rank sends, counted), ``plots``.
- 10 composing parallelisms: ``parallel.compose`` (2-D meshes), ``parallel.schedules``
  (interleaved and zero-bubble pipelines), ``parallel.zero`` (ZeRO-1/2 by hand), ``planner``
  (memory and communication predicted for any DP/TP/PP/CP/EP layout; a package: ``describe``,
  ``memory``, ``communication``, ``search``, ``published``), ``parallel.traffic.step_traffic``
  (the bytes a real DDP or FSDP2 step sends, beside the planner's), ``explorers`` (the schedule
  and planner explorers), ``plots``.

- 11 performance from first principles: ``machine`` (the machine card that notebook 00
  measures and saves, data-sheet peaks, the roofline), ``precision`` (FLOPs and MFU, bytes
  per parameter, bf16/fp16/FP8 numerics), ``traces`` (a DDP step's profiler trace and its
  analysis), ``plots``.
- 12 checkpoints and failures at scale: ``checkpoints`` (DCP saves of an FSDP2 run, resharded
  resumes, what a save wrote and what a resharded rank reads, async saves), ``resilience``
  (the checkpoint interval and goodput, failure rates at scale, faults injected into a
  data-parallel run, restart against in-memory healing by a peer, resumes that lie).

``plots`` is a package with one module per notebook or concern (``plots.training``,
``plots.sequence``, ...); every figure is also ``labkit.plots.<name>``. ``cli`` is the command
line (``python -m labkit bench`` calls ``bench``, ``ddp`` and ``perf``, which never call each
other back).

Private modules with public names hold what several rooms share: ``_dist`` (the device a
collective needs, barriers, the slowest rank's time, timed training steps), ``_sizes`` (the
one whole-number check, divisor suggestions), ``_protocol`` (the launcher's contract with its
workers: the ``Job``, the run folder's file names, the controller's variables), the engine
that cold runs and warm workers share (``_spawn`` starts a run: the job pickled into its run
folder, torchrun and its boot script, the sweep of orphaned folders; ``_forkrank``, in
torchrun's agent, forks a CPU run's ranks from it; ``_engine`` supervises it:
output, failures, the clock, the stop; ``_failures`` reads how its ranks ended:
``LaunchError``, ``LaunchTimeout``) and ``_progress`` (``labkit.progress``, per-rank bars fed
through the workers' output).
``docs/ARCHITECTURE.md`` describes the rooms, the data flow and the launcher's protocol.
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
    "workers": ".launcher",  # warm ranks that run function after function
    "stop_workers": ".launcher",
    "use_warm": ".launcher",
    "progress": "._progress",
    "show": ".source",  # the source of what a notebook teaches
    "show_table": "._display",  # a table: HTML in Jupyter, aligned text within 100 elsewhere
    "quiet_startup": "._display",  # a framework imported without its C++ INFO start-up lines
}

_LAZY_MODULES = ("doctor", "bench", "plots", "data", "models", "augment", "train", "check",
                 "capstone", "ddp", "perf", "diagnose", "elastic", "resources", "slurm",
                 "planner", "explorers", "machine", "precision", "traces", "checkpoints",
                 "resilience")

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

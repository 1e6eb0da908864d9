"""The capstone grader: a learner's per-worker training function, graded by running it.

This module owns the capstone of notebook 08: the task handed to the learner
(:func:`capstone_task`, :class:`CapstoneTask`), the grader (:func:`capstone`), the
:class:`Recorder` that watches the learner's function from inside the workers, the criteria
(one :class:`labkit.check.Verdict` each) and the overall :class:`Assessment`.

The grader never reads the learner's printed numbers. It launches the learner's per-worker
function itself, watches it from inside the workers (which sampler epochs were drawn, which
learning rates the optimizer stepped with, how large the batches were, whether the replicas
ended equal), then evaluates the returned model in this process on a held-out split that the
learner's function is never given. (Its seed is no secret: anyone can rebuild it from
labkit.data. The grader is there to catch mistakes, not to stop cheating.)

Like :mod:`labkit.check`, importing this module imports no framework; torch is imported by
the functions that need it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from ._sizes import whole
from .check import Verdict

__all__ = ["HELD_OUT_SEED", "CAPSTONE_CRITERIA", "CapstoneTask", "capstone_task", "capstone",
           "Assessment", "Recorder"]

HELD_OUT_SEED = 8  # the held-out split's seed; the learner's train/val split uses another
CAPSTONE_CRITERIA = ("runs", "N workers", "set_epoch", "lr scaling", "augmentation", "checkpoint",
                     "honest validation", "accuracy", "time budget")


# ---- the task: what the learner's function is given ---------------------------------------------


@dataclasses.dataclass
class CapstoneTask:
    """What the grader hands the learner's training function: data, hyper-parameters, paths.

    ``train`` and ``val`` are :class:`labkit.data.ImageSet` splits of the digits; a third,
    held-out split stays with the grader. ``base_lr`` is tuned for ``base_batch`` images per
    step on one process (the given single-process script); ``eval_transform`` is how images
    are prepared for evaluation (the grader evaluates the same way). ``checkpoint`` is where
    the function must save the trained weights. Build one with :func:`capstone_task`.

    Example::

        >>> task = capstone_task(epochs=4)
        >>> task.base_lr, task.base_batch, len(task.train)
        (0.05, 32, 1151)
    """

    train: object
    val: object
    image_size: int
    epochs: int
    base_lr: float
    base_batch: int
    warmup_epochs: int
    checkpoint: str
    seed: int = 0

    @property
    def eval_transform(self):
        """The evaluation pipeline (resize, centre crop, normalise): no randomness."""
        from . import augment

        return augment.augmentation(self.image_size, kind="none")

    def __repr__(self) -> str:  # one field group per line: it fits a notebook's output area
        return (f"CapstoneTask(train={len(self.train)} images, val={len(self.val)} images, "
                f"{self.image_size}px,\n             epochs={self.epochs}, base_lr={self.base_lr}, "
                f"base_batch={self.base_batch}, warmup_epochs={self.warmup_epochs},\n"
                f"             checkpoint={self.checkpoint!r})")


def _capstone_splits(image_size: int, train_per_class: int | None):
    """``(train, val, held_out)`` of the digits; held_out never reaches the learner's function."""
    from . import data

    rest, held_out = data.split(data.digits(image_size), 0.2, seed=HELD_OUT_SEED)
    train, val = data.split(rest, 0.2, seed=0)
    if train_per_class is not None:
        train = data.take(train, train_per_class, seed=0)
    return train, val, held_out


_TEMPORARY_FOLDERS: list = []  # capstone_task's default folders: each removes itself at exit


def capstone_task(*, image_size: int = 16, epochs: int = 6, base_lr: float = 0.05,
                  base_batch: int = 32, warmup_epochs: int = 1, train_per_class: int | None = None,
                  checkpoint=None, seed: int = 0) -> CapstoneTask:
    """The capstone's task: the learner's share of the digits and the single-process settings.

    ``train_per_class`` keeps that many training images per class (smaller, faster runs).
    ``checkpoint`` defaults to a file in a fresh temporary folder, removed when the process
    exits.

    Example::

        >>> task = capstone_task(epochs=4)
        >>> task
        CapstoneTask(train=1151 images, val=287 images, 16px, epochs=4, base_lr=0.05, ...)
    """
    import tempfile
    from pathlib import Path

    epochs = whole(epochs, "epochs", low=2, hint=" (with one epoch, whether the sampler's "
                                                  "epoch was set cannot be seen)")
    if not base_lr > 0:
        raise ValueError(f"need base_lr > 0, got {base_lr!r}")
    base_batch = whole(base_batch, "base_batch")
    if not 0 <= warmup_epochs < epochs:
        raise ValueError(f"warmup_epochs must lie in 0..{epochs - 1}, got {warmup_epochs!r}")
    train, val, _ = _capstone_splits(image_size, train_per_class)
    if checkpoint is None:
        # Removed when this process exits (notebook 08 removes it at its end): a learner who
        # stops half-way does not leave a folder in /tmp per run.
        folder = tempfile.TemporaryDirectory(prefix="labkit-capstone-")
        _TEMPORARY_FOLDERS.append(folder)
        checkpoint = Path(folder.name) / "checkpoint.pt"
    return CapstoneTask(train, val, image_size, epochs, float(base_lr), base_batch,
                        warmup_epochs, str(checkpoint), seed)


# ---- the recorder: what the learner's function really does, seen from inside a worker -----------

_MAX_EVAL_HASHES = 200_000
_FIRST_BATCHES = 3  # training batches hashed per rank: ranks that split the data see different ones


class Recorder:
    """Records, on one worker, what a training function really does while :meth:`watching`.

    One method per thing watched, each called by a hook: every DistributedSampler pass (its
    epoch, dataset size, shuffle); the learning rate of every optimizer step and the batch of
    the forward pass before it; hashes of the first training batches; the images evaluated in
    eval mode; whether DDP wrapped a model; the transforms handed to labkit's datasets and
    whether ``labkit.augment.gpu_augment`` ran; then what the function returned and a hash of
    the replica's parameters (replicas that averaged their gradients end bit-identical).
    ``record`` is the picklable dict the grader reads back from each rank.

    Example::

        >>> recorder = Recorder(rank=0, world_size=1)
        >>> with recorder.watching():
        ...     result = train_fn(task)
        >>> recorder.on_result(result)
        >>> recorder.record["steps"][:2]
        [{'lr': 0.01, 'batch': 32}, {'lr': 0.02, 'batch': 32}]
    """

    def __init__(self, rank: int, world_size: int):
        self.record = {"rank": rank, "world_size": world_size, "sampler_passes": [], "steps": [],
                       "eval_samples": 0, "train_samples": 0, "ddp_wrapped": 0, "transforms": [],
                       "gpu_augment": 0, "batch_hashes": [], "eval_hashes": set(),
                       "collectives_after_eval": 0}
        self._depth = 0     # nesting of module forward calls: only the outermost is the model's
        self._batch = None  # size of the last training forward pass, for the next optimizer step

    @contextlib.contextmanager
    def watching(self):
        """Install every hook; remove them all (patches restored) when the block ends or raises.

        Public torch API is patched or hooked (``DistributedSampler.__iter__``,
        ``DistributedDataParallel.__init__``, the global module-forward and optimizer-step
        hooks); labkit is watched through its public hooks
        (:func:`labkit.data.register_dataset_hook`,
        :func:`labkit.augment.register_gpu_augment_hook`).
        """
        import torch.distributed as dist
        from torch.nn.modules import module as nn_module
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        from torch.utils.data.distributed import DistributedSampler

        from . import augment, data

        with contextlib.ExitStack() as stack:
            _call_first(stack, DistributedSampler, "__iter__", self.on_sampler_pass)
            _call_first(stack, DistributedDataParallel, "__init__", self.on_ddp_init)
            for name in _AGGREGATING_COLLECTIVES:
                _call_before(stack, dist, name, self.on_collective)
            for handle in (data.register_dataset_hook(self.on_dataset),
                           augment.register_gpu_augment_hook(self.on_gpu_augment),
                           register_optimizer_step_pre_hook(self.on_optimizer_step),
                           nn_module.register_module_forward_pre_hook(self.on_forward),
                           nn_module.register_module_forward_hook(self.on_forward_end,
                                                                  always_call=True)):
                stack.callback(handle.remove)
            yield self

    def on_sampler_pass(self, sampler) -> None:
        """A DistributedSampler pass starts: the epoch it starts with is what shuffles it."""
        # Whether or not set_epoch was called, this is the truth (subclasses that call
        # super().__iter__ included).
        self.record["sampler_passes"].append({"id": id(sampler), "epoch": int(sampler.epoch),
                                              "size": len(sampler.dataset),
                                              "shuffle": sampler.shuffle})

    def on_collective(self) -> None:
        """A collective that can aggregate a metric, called by the learner's code."""
        # DDP's gradient all-reduce runs in C++ and is not seen here: what is seen after an
        # evaluation is the learner combining the ranks' counts (or not).
        if self.record["eval_samples"]:
            self.record["collectives_after_eval"] += 1

    def on_ddp_init(self, ddp_model) -> None:
        """DistributedDataParallel wraps a model."""
        self.record["ddp_wrapped"] += 1

    def on_dataset(self, dataset) -> None:
        """labkit.data.to_torch built a dataset: the names of its transform's steps."""
        transform = dataset.transform
        steps = [type(t).__name__ for t in getattr(transform, "transforms", [transform])
                 if t is not None]
        self.record["transforms"].append({"size": len(dataset.imageset), "steps": steps})

    def on_gpu_augment(self, batch, config) -> None:
        """labkit.augment.gpu_augment was called, whatever name it was imported as."""
        self.record["gpu_augment"] += 1

    def on_forward(self, module, inputs) -> None:
        """A module's forward starts; the outermost one with parameters is the model's."""
        # DDP's inner module, the layers, and a parameter-free loss module are not "the model".
        self._depth += 1
        if self._depth != 1 or not inputs:
            return
        import torch

        x = inputs[0]
        if isinstance(x, torch.Tensor) and next(module.parameters(), None) is not None:
            n = int(x.shape[0]) if x.dim() else 1
            (self.on_train_batch if module.training else self.on_eval_batch)(x, n)

    def on_forward_end(self, module, inputs, output) -> None:
        """A module's forward ended (or raised)."""
        self._depth -= 1

    def on_train_batch(self, x, n: int) -> None:
        """The model trains on a batch of ``n``: count it; hash the first few (which data?)."""
        import hashlib

        self._batch = n
        self.record["train_samples"] += n
        if len(self.record["batch_hashes"]) < _FIRST_BATCHES:  # did the ranks see different data?
            self.record["batch_hashes"].append(hashlib.sha1(
                x.detach().cpu().contiguous().numpy().tobytes()).hexdigest())

    def on_eval_batch(self, x, n: int) -> None:
        """The model evaluates a batch of ``n`` in eval mode: hash each image (which split?)."""
        self.record["eval_samples"] += n
        if len(self.record["eval_hashes"]) < _MAX_EVAL_HASHES:  # which images were evaluated?
            self.record["eval_hashes"].update(_row_hashes(x))

    def on_optimizer_step(self, optimizer, args, kwargs) -> None:
        """An optimizer steps: its learning rate, and the batch the step follows."""
        self.record["steps"].append({"lr": float(optimizer.param_groups[0]["lr"]),
                                     "batch": self._batch})

    def on_result(self, result) -> None:
        """The function returned: its type, ``val_acc``, the replica (rank 0 sends its model)."""
        import torch

        rec = self.record
        rec["returned"] = type(result).__name__
        model = result.get("model") if isinstance(result, dict) else None
        model = getattr(model, "module", model)  # a DDP wrapper does not travel: its module does
        if isinstance(model, torch.nn.Module):
            self.on_replica(model)
        if isinstance(result, dict):
            rec["val_acc"] = result.get("val_acc")
            if rec["rank"] == 0:
                rec["model"] = model.cpu() if isinstance(model, torch.nn.Module) else model

    def on_replica(self, model) -> None:
        """A hash of the replica's parameters, and each parameter's sum (how far apart?)."""
        import hashlib

        blob = hashlib.sha256()
        for p in model.parameters():
            blob.update(p.detach().cpu().contiguous().numpy().tobytes())
        self.record["param_hash"] = blob.hexdigest()
        self.record["param_sums"] = [float(p.detach().double().sum()) for p in model.parameters()]


# torch 2.14 adds the *_single names (the *_tensor ones still work, with a warning)
_AGGREGATING_COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
                            "all_gather_single", "all_gather_object", "gather", "gather_object",
                            "gather_single", "reduce_scatter", "reduce_scatter_tensor",
                            "reduce_scatter_single")


def _call_before(stack: contextlib.ExitStack, module, name: str, before) -> None:
    """Make ``module.name(...)`` call ``before()`` first, until ``stack`` closes."""
    original = getattr(module, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        before()
        return original(*args, **kwargs)

    setattr(module, name, wrapper)
    stack.callback(setattr, module, name, original)


def _call_first(stack: contextlib.ExitStack, owner, name: str, before) -> None:
    """Make ``owner.name(obj, ...)`` call ``before(obj)`` first, until ``stack`` closes."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(obj, *args, **kwargs):
        before(obj)
        return original(obj, *args, **kwargs)

    setattr(owner, name, wrapper)
    stack.callback(setattr, owner, name, original)


def _observe(train_fn, task: CapstoneTask) -> dict:
    """Worker side: run ``train_fn(task)`` under a :class:`Recorder`; return its record."""
    import time

    import torch.distributed as dist

    recorder = Recorder(dist.get_rank(), dist.get_world_size())
    with recorder.watching():
        start = time.perf_counter()
        result = train_fn(task)
        recorder.record["seconds"] = time.perf_counter() - start
    recorder.on_result(result)
    return recorder.record


def _row_hashes(batch) -> set:
    """A short hash of every image in ``batch``: the same prepared image, the same hash."""
    import hashlib

    rows = batch.detach().cpu().contiguous()
    return {hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in rows}


def _accuracy(model, imageset, transform, hashes: set | None = None) -> float:
    """The model's accuracy on ``imageset``, evaluated here, in eval mode, without gradients.

    ``hashes``, when given, collects each prepared image's :func:`_row_hashes` entry.
    """
    import torch
    from torch.utils.data import DataLoader

    from . import data

    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(data.to_torch(imageset, transform), batch_size=256):
            correct += (model(x).argmax(1) == y).sum().item()
            if hashes is not None:
                hashes.update(_row_hashes(x))
    return correct / len(imageset)


# ---- the verdict ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Assessment(Verdict):
    """The capstone's overall verdict, with one :class:`Verdict` per criterion and the figures.

    Truthy when every criterion passed; ``failed`` names the ones that did not; ``figures``
    holds what the grader measured (world size, held-out accuracy, seconds, ...).

    Example::

        >>> result = capstone(train_ddp, task, nproc=2)
        >>> result.failed, round(result.figures["held_out_acc"], 2)
        ([], 0.95)
    """

    criteria: list = dataclasses.field(default_factory=list)
    figures: dict = dataclasses.field(default_factory=dict)
    name: str = ""

    @property
    def failed(self) -> list[str]:
        return [c.exercise for c in self.criteria if not c.passed]

    def __repr__(self) -> str:  # the printed report says it all; a short echo in notebooks
        return f"Assessment(passed={self.passed}, failed={self.failed})"

    def __str__(self) -> str:
        from ._display import wrap

        lines = [str(c) for c in self.criteria]
        if not self.passed:  # wrapped at spaces: the report is read in a notebook's output area
            return wrap(f"[not yet] capstone: {len(self.failed)} of {len(self.criteria)} "
                        f"criteria not met ({', '.join(self.failed)})\n" + "\n".join(lines))
        return wrap(_certificate(self))


def _certificate(a: Assessment) -> str:
    import datetime

    f = a.figures
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rule = "=" * 78
    body = [rule, "  labkit · certificate of completion".center(78),
            "Capstone: a single-process script converted to data-parallel training".center(78),
            "", f"  awarded to  {a.name}", f"  on          {now}", "",
            f"  all {len(a.criteria)} criteria met:"]
    body += [f"    [pass] {c.exercise}: {c.detail}" for c in a.criteria]
    body += ["", f"  {f['world_size']} workers, global batch {f['global_batch']}, peak lr "
                 f"{f['peak_lr']:.4g}; held-out accuracy {f['held_out_acc']:.3f} (target "
                 f"{f['target']:.2f}); {f['seconds']:.1f} s of a {f['time_budget']:g} s budget; "
                 f"{f['samples_per_s']:.0f} training samples/s"]
    body += _exercises_passed()
    body.append(rule)
    return "\n".join(body)


def _exercises_passed() -> list[str]:
    """The certificate's lines on the course's exercises, from the learner's progress file."""
    import textwrap

    from . import check

    done = check.progress(show=False)
    total = sum(1 for e in check.EXERCISES.values() if e.notebook in done)
    passed = sum(len(ids) for ids in done.values())
    lines = ["", f"  course exercises passed: {passed} of {total} "
                 f"(recorded in {check.progress_file()})"]
    for notebook, ids in done.items():
        titles = ", ".join(check.EXERCISES[i].title for i in ids) or "none yet"
        lines.append(textwrap.fill(titles, 78, initial_indent=f"    {notebook}: ",
                                   subsequent_indent=" " * 8))
    return lines


# ---- the grader ----------------------------------------------------------------------------------


def capstone(train_fn, task: CapstoneTask, *, nproc: int = 2, target: float = 0.9,
             time_budget: float = 300.0, name: str | None = None,
             show_ranks=(0,)) -> Assessment:
    """Grade the capstone: launch ``train_fn(task)`` on ``nproc`` workers and check what it did.

    ``train_fn`` is the learner's per-worker function; every rank returns
    ``{"model": model, "val_acc": accuracy on task.val}``. The grader runs it under
    ``labkit.launch``, records from inside the workers what really happened (a
    :class:`Recorder` on each), then evaluates the returned model itself on a held-out split
    the function never saw. Criteria, each a :class:`Verdict` with a hint:

    - **runs**: every rank finished and returned that dict;
    - **N workers**: more than one worker, whose replicas ended bit-identical (gradients
      averaged: DDP);
    - **set_epoch**: the training data came through a DistributedSampler whose epoch changed
      every epoch;
    - **lr scaling**: the peak learning rate is ``base_lr x global batch / base_batch``
      (within 10 %), reached after a warm-up from lower values;
    - **augmentation**: the training images went through a random transform (or
      ``labkit.augment.gpu_augment``);
    - **checkpoint**: ``task.checkpoint`` exists and loads into the returned model;
    - **honest validation**: the reported ``val_acc`` is the model's accuracy on ``task.val``
      (the grader re-evaluates it, to within two images or 1 %); one that equals the training
      split's accuracy instead is named as such (when the two splits score alike, the grader
      cannot tell them apart, and the held-out accuracy is what counts);
    - **accuracy**: held-out accuracy >= ``target``;
    - **time budget**: the whole run, as the grader timed it, took at most ``time_budget`` s.

    A wrong answer never raises: the verdicts say what is missing. Bad input (a function that
    is not callable, a task not from :func:`capstone_task`, an invalid ``nproc``) is an error.
    Returns an :class:`Assessment` (truthy when all criteria pass) and prints it; a pass prints
    a certificate.

    Example::

        >>> task = capstone_task(epochs=6)
        >>> result = capstone(train_ddp, task, nproc=2, target=0.9, time_budget=300)
        [pass] N workers: 2 workers, replicas bit-identical after training (DDP)
        ...
    """
    _check_arguments(train_fn, task, nproc, target, time_budget)
    import getpass
    import os
    import time

    from . import launcher

    name = name or os.environ.get("JUPYTERHUB_USER") or getpass.getuser()
    figures = {"world_size": nproc, "target": target, "time_budget": time_budget}
    if os.path.exists(task.checkpoint):
        os.remove(task.checkpoint)  # a file from an earlier run proves nothing about this one
    start = time.perf_counter()
    try:
        # Twice the budget (and a minute) before the run is stopped: over budget is a verdict,
        # a hang must still end.
        records = launcher.launch(_observe, train_fn, task, nproc=nproc,
                                  show_ranks=list(show_ranks),
                                  timeout=max(2 * time_budget, time_budget + 60)).values
    except launcher.LaunchTimeout as exc:
        seconds = time.perf_counter() - start
        return _assessment(name, figures, [Verdict(
            "runs", False, f"stopped after {seconds:.0f} s, far past the {time_budget:g} s "
                           f"budget; stuck rank(s): {exc.stuck}",
            "a rank waits in a collective the others skipped (an all_reduce or barrier on one "
            "rank only?), or the run is far too slow for the budget")])
    except launcher.LaunchError as exc:
        print(exc)  # the learner's traceback, as launch would have shown it
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        return _assessment(name, figures, [Verdict(
            "runs", False, f"rank {exc.rank} raised: {lines[-1]}",
            "run your function on one small case first; the traceback above names the line")])
    figures["seconds"] = time.perf_counter() - start
    return _grade(records, task, name, figures)


def _check_arguments(train_fn, task, nproc, target, time_budget) -> None:
    """Bad input to :func:`capstone` is an error that says what to pass instead."""
    if not callable(train_fn):
        raise TypeError(f"capstone() grades a function: pass your per-worker training function "
                        f"itself, e.g. capstone(train_ddp, task), not a "
                        f"{type(train_fn).__name__}")
    if not isinstance(task, CapstoneTask):
        raise TypeError(f"task must come from labkit.capstone.capstone_task(...), got "
                        f"{type(task).__name__}")
    whole(nproc, "nproc", hint=" (workers; 2 or more for data parallelism): "
                               "e.g. capstone(train_ddp, task, nproc=2)")
    if not 0 < target <= 1:
        raise ValueError(f"target is an accuracy in (0, 1], got {target!r}")
    if not time_budget > 0:
        raise ValueError(f"time_budget is a number of seconds > 0, got {time_budget!r}")

def _assessment(name: str, figures: dict, criteria: list[Verdict]) -> Assessment:
    failed = [c for c in criteria if not c.passed]
    detail = (f"all {len(criteria)} criteria met" if not failed
              else f"{len(failed)} of {len(criteria)} criteria not met")
    hint = failed[0].hint if failed else ""
    a = Assessment("capstone", not failed, detail, hint, criteria=criteria, figures=figures,
                   name=name)
    print(a)
    return a


def _grade(records: list[dict], task: CapstoneTask, name: str, figures: dict) -> Assessment:
    zero = records[0]
    bad = [r["rank"] for r in records
           if r["returned"] != "dict" or "param_hash" not in r or r.get("val_acc") is None]
    if bad or not hasattr(zero.get("model"), "parameters"):
        return _assessment(name, figures, [Verdict(
            "runs", False, f"rank(s) {bad or [0]} returned {records[(bad or [0])[0]]['returned']} "
                           f"without a model and a val_acc",
            'end your function with: return {"model": model.module, "val_acc": val_acc} '
            "(on every rank)")])
    model = zero["model"]
    world = zero["world_size"]
    steps = zero["steps"]
    batch = max((s["batch"] or 0 for s in steps), default=0)
    figures.update(world_size=world, global_batch=batch * world,
                   peak_lr=max((s["lr"] for s in steps), default=0.0),
                   samples_per_s=sum(r["train_samples"] for r in records)
                   / max(r["seconds"] for r in records))
    criteria = [Verdict("runs", True, f"{world} rank(s) finished in {figures['seconds']:.1f} s "
                                      f"and returned a model")]
    criteria.append(_crit_workers(records))
    criteria.append(_crit_set_epoch(zero, task))
    criteria.append(_crit_lr(steps, task, world))
    criteria.append(_crit_augmentation(records, task))
    criteria.append(_crit_checkpoint(model, task))
    held_out = _capstone_splits(task.image_size, None)[2]
    figures["held_out_acc"] = held = _accuracy(model, held_out, task.eval_transform)
    criteria.append(_crit_validation(model, zero, records, task, figures))
    criteria.append(Verdict(
        "accuracy", held >= figures["target"],
        f"{held:.3f} on {len(held_out)} held-out images the function never saw (target "
        f"{figures['target']:.2f})",
        "train longer (more epochs), check the learning rate and its warm-up, and that the "
        "replicas train together; compare with the single-process script's accuracy"))
    within = figures["seconds"] <= figures["time_budget"]
    criteria.append(Verdict(
        "time budget", within, f"{figures['seconds']:.1f} s of {figures['time_budget']:g} s",
        "evaluate once at the end rather than every step, keep DataLoader work light, and "
        "check that each rank trains on 1/N of the data per epoch"))
    return _assessment(name, figures, criteria)


def _crit_workers(records) -> Verdict:
    world = records[0]["world_size"]
    if world < 2:
        return Verdict("N workers", False, "the run had a single worker (world_size 1)",
                       "grade it on two or more workers: capstone(train_ddp, task, nproc=2)")
    batches = {tuple(r["batch_hashes"]) for r in records}
    if len(batches) == 1 and records[0]["batch_hashes"]:
        return Verdict("N workers", False,
                       f"the {world} workers trained on the same batches: each did the whole "
                       f"job, as {world} copies of one process",
                       "give each rank its share of every epoch with a DistributedSampler, and "
                       "wrap the model in DistributedDataParallel so the shares add up")
    hashes = {r["param_hash"] for r in records}
    if len(hashes) > 1:
        drift = max(abs(a - b) for r in records[1:]
                    for a, b in zip(records[0]["param_sums"], r["param_sums"], strict=False))
        wrapped = any(r["ddp_wrapped"] for r in records)
        return Verdict("N workers", False,
                       f"{world} workers trained {len(hashes)} different models (parameter sums "
                       f"differ by up to {drift:.3g}): the gradients were not averaged",
                       "wrap the model in DistributedDataParallel(model) and train that"
                       if not wrapped else "train the DDP-wrapped model (call ddp_model(x), not "
                       "model(x)), and give every rank the same seed before building the model")
    return Verdict("N workers", True, f"{world} workers, replicas bit-identical after training"
                                      f"{' (DDP)' if records[0]['ddp_wrapped'] else ''}")


def _crit_set_epoch(rec, task) -> Verdict:
    passes = rec["sampler_passes"]
    if not passes:
        return Verdict("set_epoch", False, "no DistributedSampler drew the training data: every "
                       "rank may have trained on all of it",
                       "load the training set with DataLoader(..., sampler=DistributedSampler("
                       "train_ds, shuffle=True)) so each rank gets its 1/N share")
    by_sampler: dict = {}
    for p in passes:
        by_sampler.setdefault(p["id"], []).append(p)
    # The training sampler: the one over the training set's size, else the most used.
    train = [v for v in by_sampler.values() if v[0]["size"] == len(task.train)] \
        or sorted(by_sampler.values(), key=len)[-1:]
    runs = max(train, key=len)
    epochs = [p["epoch"] for p in runs]
    if not runs[0]["shuffle"]:
        return Verdict("set_epoch", False, "the training DistributedSampler has shuffle=False: "
                       "every epoch draws the same order",
                       "use DistributedSampler(train_ds, shuffle=True) and call "
                       "sampler.set_epoch(epoch) each epoch")
    if len(epochs) >= 2 and len(set(epochs)) < len(epochs):
        return Verdict("set_epoch", False, f"the training sampler's epoch over {len(epochs)} "
                       f"passes was {epochs}: every epoch replayed the same shuffled order",
                       "call sampler.set_epoch(epoch) at the start of every epoch, before "
                       "iterating the DataLoader")
    return Verdict("set_epoch", True, f"DistributedSampler over {runs[0]['size']} images, "
                                      f"epochs {epochs}")


def _crit_lr(steps, task, world) -> Verdict:
    if not steps:
        return Verdict("lr scaling", False, "no optimizer step was seen",
                       "train with a torch.optim optimizer and call optimizer.step()")
    lrs = [s["lr"] for s in steps]
    batch = max(s["batch"] or 0 for s in steps) or task.base_batch
    global_batch = batch * world
    expected = task.base_lr * global_batch / task.base_batch
    peak = max(lrs)
    rule = (f"base_lr {task.base_lr:g} x global batch {global_batch} ({world} x {batch}) / "
            f"base_batch {task.base_batch} = {expected:.4g}")
    if abs(peak / expected - 1) > 0.1:
        said = (" (the single-process learning rate, unscaled)"
                if abs(peak / task.base_lr - 1) <= 0.1 and world > 1 else "")
        return Verdict("lr scaling", False, f"peak learning rate {peak:.4g}{said}; expected "
                       f"{rule}",
                       "scale the learning rate linearly with the global batch "
                       "(labkit.train.linear_scaled_lr) and ramp up to it "
                       "(labkit.train.warmup_lr)")
    if task.warmup_epochs and lrs[0] >= peak * 0.99:
        return Verdict("lr scaling", False, f"the first step already used the peak rate "
                       f"{peak:.4g}: no warm-up",
                       f"warm up: start lower and ramp to {expected:.4g} over the first "
                       f"{max(task.warmup_epochs, 1)} epoch(s) (labkit.train.warmup_lr per step)")
    reached = next(i for i, lr in enumerate(lrs) if lr >= peak * 0.99)
    ramp = f"warm-up from {lrs[0]:.4g} to {peak:.4g} over {reached + 1} steps" if reached \
        else f"peak {peak:.4g} from the first step (no warm-up asked)"
    return Verdict("lr scaling", True, f"{ramp}; {rule}")


_RANDOM_STEPS = ("Random", "ColorJitter", "RandAugment", "AutoAugment", "TrivialAugmentWide",
                 "AugMix", "ElasticTransform", "GaussianBlur")


def _crit_augmentation(records, task) -> Verdict:
    if any(r["gpu_augment"] for r in records):
        return Verdict("augmentation", True, "labkit.augment.gpu_augment on the training batches")
    random_steps = sorted({s for r in records for t in r["transforms"] for s in t["steps"]
                           if s.startswith(_RANDOM_STEPS)})
    if random_steps:
        return Verdict("augmentation", True, f"training images through {', '.join(random_steps)}")
    return Verdict("augmentation", False, "no random transform on the training images",
                   "build the training set with data.to_torch(task.train, "
                   "augment.augmentation(task.image_size, config=...)) (no flips for digits)")


def _crit_checkpoint(model, task) -> Verdict:
    import copy
    import os

    import torch

    path = task.checkpoint
    if not os.path.isfile(path):
        return Verdict("checkpoint", False, f"no file at task.checkpoint ({path})",
                       "save on rank 0: labkit.ddp.save_on_rank0({'model': model.module."
                       "state_dict()}, task.checkpoint)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            state = state["model"]
        state = {k.removeprefix("module."): v for k, v in state.items()}
        copy.deepcopy(model).load_state_dict(state)
    except Exception as exc:  # any way the file fails to load is the learner's to fix
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return Verdict("checkpoint", False, f"{path} does not load into the model: {first}",
                       "save the unwrapped model's state dict: model.module.state_dict()")
    return Verdict("checkpoint", True, f"{os.path.basename(path)} loads into the model "
                                       f"({os.path.getsize(path) / 1e6:.1f} MB)")


def _crit_validation(model, zero, records, task, figures) -> Verdict:
    reported = float(zero["val_acc"])
    val_hashes, train_hashes = set(), set()
    on_val = _accuracy(model, task.val, task.eval_transform, val_hashes)
    on_train = _accuracy(model, task.train, task.eval_transform, train_hashes)
    figures.update(reported_val_acc=reported, val_acc=on_val, train_acc=on_train)
    # Which images did the learner's evaluation see? Prepared with task.eval_transform, each is
    # bit-identical to the grader's, so their hashes say which split they came from (a few
    # digits occur in both splits: only images of one split alone count).
    seen = set().union(*(r["eval_hashes"] for r in records))
    val_seen = len(seen & (val_hashes - train_hashes))
    train_seen = len(seen & (train_hashes - val_hashes))
    # Within two images (or 1 %): ranks may evaluate with slightly different BatchNorm
    # statistics and batch sizes, which can flip an image or two.
    tol = max(2 / len(task.val), 0.01)
    if len({r["param_hash"] for r in records}) > 1:
        return Verdict("honest validation", False,
                       f"reported val_acc {reported:.3f} ({on_val:.3f} for rank 0's model): the "
                       f"ranks hold different models, so no one model has the reported accuracy",
                       "fix 'N workers' first: with averaged gradients every rank holds the same "
                       "model")
    on_training_split = Verdict(
        "honest validation", False,
        f"the reported val_acc {reported:.3f} was measured on the training split "
        f"({train_seen} training images evaluated, {val_seen} validation images; accuracy "
        f"{on_train:.3f} there, {on_val:.3f} on task.val)",
        "evaluate on task.val (with task.eval_transform), never on the images the model "
        "trained on")
    if train_seen and not val_seen:  # the evaluation saw training images only
        return on_training_split
    val_only = val_hashes - train_hashes
    share = len(zero["eval_hashes"] & val_only)
    if (val_only and share < 0.9 * len(val_only) and val_seen >= 0.9 * len(val_only)
            and not zero["collectives_after_eval"]):
        # The ranks evaluated the split between them, and nothing combined their counts.
        return Verdict("honest validation", False,
                       f"each rank evaluated its own share of task.val (rank 0: {share} of "
                       f"{len(val_only)} validation images) and no collective followed: the "
                       f"reported val_acc {reported:.3f} is rank 0's share alone (the whole "
                       f"split: {on_val:.3f})",
                       "count (correct, seen) on each rank, then dist.all_reduce the counts: "
                       "every rank then reports the accuracy of the whole split")
    if abs(reported - on_val) <= tol:
        return Verdict("honest validation", True, f"reported {reported:.3f}, the grader measured "
                       f"{on_val:.3f} on task.val ({val_seen} of {len(task.val)} validation "
                       f"images seen in eval mode)")
    if abs(reported - on_train) <= max(2 / len(task.train), 0.01):
        return on_training_split
    return Verdict("honest validation", False,
                   f"reported val_acc {reported:.3f}, but the model scores {on_val:.3f} on "
                   f"task.val",
                   "report the accuracy over the whole validation split: each rank counts "
                   "its share, then all_reduce the counts (correct, seen)")

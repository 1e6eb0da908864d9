"""Checkpoints at scale: torch.distributed.checkpoint (DCP) saves, reshards and resumes FSDP2 runs.

Every rank writes its own shards, in parallel, to one folder; a ``.metadata`` file (rank 0's)
records each tensor's global shape and which chunk of it lies where. Loading reads that
metadata and lets every rank of the *new* run fetch exactly the rows its new shards need, so a
run saved on 4 ranks resumes on 2 (resharding) without anyone gathering the whole model.

- :func:`sharded_model`: a small seeded MLP, FSDP2-sharded (optionally FSDP2 x TP), with AdamW
  and a learning-rate schedule: the state a resumed run must get back exactly.
- :func:`train_steps`, :func:`save_checkpoint` / :func:`async_save_checkpoint`,
  :func:`load_checkpoint`, :func:`fingerprint`: the pieces, inside a worker.
- :func:`run_and_save`, :func:`resume_and_train`, :func:`save_stall`: worker functions for
  ``labkit.launch`` (train, save, resume on another world size; sync against async saves).
- :func:`checkpoint_files`, :func:`read_checkpoint`: what a save wrote, read in the kernel.
- :func:`shard_rows`, :func:`reshard_plan`: FSDP2's dim-0 sharding and what resharding reads,
  computed by hand (no torch.distributed), to check against the metadata.

What is bit for bit, measured (torch 2.14, CPU, gloo, float32):

- the state loaded on 2 ranks from a 4-rank save (and from a dp=2 x tp=2 save) is the saved
  state exactly: resharding copies bytes and computes nothing;
- a resume on the *same* layout continues exactly as the uninterrupted run (the same sums in
  the same order);
- a resume on 2 ranks of a 4-rank run does not: each rank sums its rows' gradients in one
  matmul and the reduce-scatter adds the ranks' sums, so 4 x 2 rows and 2 x 4 rows add the
  same numbers in another order, and float32 addition is not associative. After 4 more steps
  the weights differ by at most 3e-8 (relative 2e-6), as an uninterrupted 2-rank run differs
  from a 4-rank one: the world size changes the rounding, the checkpoint does not.

A checkpoint is the folder ``<run folder>/step-NNNNNN/``. It is written under a temporary name
and renamed into place when complete, so a crash mid-save never leaves a half checkpoint that
looks whole, and an existing step folder is never overwritten unless asked.

Example::

    >>> r4 = labkit.launch(run_and_save, "/tmp/run", steps=8, save_at=4, nproc=4).values
    >>> r2 = labkit.launch(resume_and_train, "/tmp/run", steps=8, nproc=2).values
    >>> r2[0]["loaded"]["sha256"] == r4[0]["saved"]["sha256"]     # resharded bit for bit
    True
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from ._sizes import divisors, whole

__all__ = [
    "WIDTHS", "PREFIX", "sharded_model", "step_batch", "train_steps", "training_state",
    "save_checkpoint", "async_save_checkpoint", "PendingCheckpoint", "latest_checkpoint",
    "load_checkpoint", "check_checkpoint", "RecordingReader", "fingerprint", "run_and_save",
    "resume_and_train", "save_stall", "checkpoint_files", "read_checkpoint", "shard_rows",
    "reshard_plan",
]

# in -> hidden -> hidden -> out. Over 4 ranks the hidden layers' 10 rows split 3 + 3 + 3 + 1 and
# the last layer's 3 rows 1 + 1 + 1 + 0: uneven shards and a rank with nothing, on purpose.
WIDTHS = (8, 10, 10, 3)
PREFIX = "step-"
METADATA = ".metadata"


# ---- the model, the data, the training -------------------------------------------------------


def sharded_model(*, widths=WIDTHS, tp: int = 1, seed: int = 0, lr: float = 0.05):
    """``(model, optimizer, scheduler)``: a seeded MLP sharded with FSDP2 over all ranks.

    ``Linear -> ReLU -> ... -> Linear`` with ``widths`` features; every rank builds the same
    full model from ``seed`` and FSDP2's ``fully_shard`` keeps dim-0 chunks of each parameter
    (:func:`shard_rows`). AdamW and a StepLR schedule make the optimizer state a resume needs.

    ``tp > 1`` lays the ranks out as a ``(dp, tp)`` mesh: the first Linear is column-parallel
    and the second row-parallel over ``tp`` (Megatron's pair), then FSDP2 shards over ``dp``.
    ``tp`` must divide the world size and the hidden width. FSDP2 x TP works on CPU with gloo
    in this torch (2.14): DCP saves the 2-D DTensors and a run on another layout loads them.
    (FSDP2 warns that the row-parallel layer "returned a view tensor"; nothing here writes
    into it in place, so the warning does not apply.)

    Example::

        >>> model, opt, sched = sharded_model()                 # inside a worker
        >>> model[0].weight.placements
        (Shard(dim=0),)
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    widths = tuple(whole(w, "each width") for w in widths)
    if len(widths) < 3:
        raise ValueError(f"widths={widths}: give at least in, hidden and out features, "
                         f"e.g. {WIDTHS}")
    tp = whole(tp, "tp", hint=" (tensor-parallel ranks)")
    if tp > 1 and widths[1] % tp:
        raise ValueError(f"the hidden width {widths[1]} does not split over tp={tp} ranks: use a "
                         f"tp that divides it ({', '.join(map(str, divisors(widths[1])))})")
    world = dist.get_world_size() if dist.is_initialized() else 0
    if not world:
        raise RuntimeError("torch.distributed is not initialised: run this inside a worker, "
                           "e.g. labkit.launch(run_and_save, folder, nproc=4)")
    if world % tp:
        raise ValueError(f"tp={tp} does not divide the {world} ranks: the mesh is dp x tp, so "
                         f"use tp in {divisors(world)}")
    if "gloo" not in str(dist.get_backend()):
        # The model and its mesh live on the CPU; NCCL moves only CUDA tensors.
        raise ValueError(f"these checkpoint runs keep their tensors on the CPU, which the "
                         f"{dist.get_backend()!r} process group cannot carry: launch with "
                         f"backend='gloo'")
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    model = nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        _tensor_parallel(model, mesh["tp"])
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def _tensor_parallel(model, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # Column- then row-parallel: the hidden activations stay split between the two Linears and
    # one all-reduce after the second puts the sum back together. TP first, FSDP2 on top.
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _dp(model) -> tuple[int, int]:
    """This rank's place among the data-parallel ranks: ``(dp rank, dp size)``."""
    mesh = next(model.parameters()).device_mesh
    names = mesh.mesh_dim_names or ()
    if "dp" in names and mesh.ndim > 1:
        return mesh.get_local_rank("dp"), mesh["dp"].size()
    return mesh.get_local_rank(0), mesh.size(0)


def step_batch(step: int, *, widths=WIDTHS, batch: int = 8, seed: int = 0):
    """The whole batch ``(x, y)`` of ``step``: a function of the step number alone.

    A resumed run draws the batches an uninterrupted one would, whatever the world size: each
    data-parallel rank then takes its contiguous slice of the rows.

    Example::

        >>> x, y = step_batch(3)
        >>> x.shape, y.shape
        (torch.Size([8, 8]), torch.Size([8, 3]))
    """
    teacher = torch.randn(widths[0], widths[-1], generator=torch.Generator().manual_seed(seed))
    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(
        seed * 1_000_003 + step + 1))
    return x, torch.sin(x @ teacher)


def train_steps(model, optimizer, scheduler, start: int, stop: int, *, widths=WIDTHS,
                batch: int = 8, seed: int = 0) -> list[float]:
    """Train steps ``start ... stop - 1``; the loss of each (the mean over all ranks' rows).

    Example::

        >>> losses = train_steps(model, opt, sched, 0, 4)      # inside a worker
    """
    rank, size = _dp(model)
    if batch % size:
        raise ValueError(f"batch={batch} rows do not split over {size} data-parallel ranks: "
                         f"use a multiple of {size}")
    rows = slice(rank * batch // size, (rank + 1) * batch // size)
    losses = []
    for step in range(start, stop):
        x, y = step_batch(step, widths=widths, batch=batch, seed=seed)
        optimizer.zero_grad(set_to_none=True)
        # The mean over this rank's rows; FSDP2 averages the gradients over the dp ranks, so
        # with equal slices the update is the full batch's mean gradient on any world size.
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        scheduler.step()
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


# ---- saving ----------------------------------------------------------------------------------


def training_state(model, optimizer, scheduler, step: int) -> dict:
    """The dict DCP saves and loads: model, optimizer, scheduler and the step.

    ``get_state_dict`` gives the model's and the optimizer's state as DTensors keyed by the
    parameters' names (not the optimizer's ids), which is what lets another world size, or
    another parallelism, find each tensor again.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "scheduler": scheduler.state_dict(),
            "step": step}


def _step_folder(folder, step: int, overwrite: bool) -> Path:
    """Where ``step`` goes in ``folder``, refused when a checkpoint is there and not replaced."""
    folder = Path(folder)
    if (folder / METADATA).exists():
        raise ValueError(f"{folder} is itself a checkpoint: pass the run's folder (its parent, "
                         f"{folder.parent}), where checkpoints go as {PREFIX}NNNNNN/")
    target = folder / f"{PREFIX}{whole(step, 'step', low=0):06d}"
    if target.exists() and not overwrite:
        kind = "a checkpoint" if (target / METADATA).exists() else "something that is not one"
        raise FileExistsError(f"{target} already holds {kind}: nothing was written. Save into "
                              f"a new run folder, or pass overwrite=True to replace it")
    return target


def _prepare(target: Path, group) -> Path:
    """The empty temporary folder the ranks write into; rank 0 clears a crashed save's."""
    partial = target.with_name(f".{target.name}.partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier(group=group)  # no rank writes into the folder before it is empty
    return partial


def _publish(partial: Path, target: Path, group) -> Path:
    """Rename the complete checkpoint into place (rank 0); every rank returns once it is there."""
    if dist.get_rank() == 0:
        old = target.with_name(f".{target.name}.replaced")
        # overwrite=True: the old one goes only once the new one is whole; a crash between
        # the two renames leaves both, complete, under their temporary names.
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(partial, target)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)
    return target


def save_checkpoint(folder, step: int, model, optimizer, scheduler, *, overwrite: bool = False,
                    process_group=None) -> Path:
    """Save with ``dcp.save`` into ``folder/step-NNNNNN/``, atomically; the step folder.

    Every rank writes its own shards (``__<rank>_0.distcp``) and rank 0 the ``.metadata``. The
    ranks write into a temporary folder that is renamed into place only once ``dcp.save``
    has returned, which is after rank 0 wrote the metadata and hence after every rank's files
    are complete. An existing step folder raises ``FileExistsError`` unless ``overwrite``.

    Example::

        >>> save_checkpoint("/tmp/run", 4, model, opt, sched)      # inside a worker
        PosixPath('/tmp/run/step-000004')
    """
    import torch.distributed.checkpoint as dcp

    target = _step_folder(folder, step, overwrite)
    partial = _prepare(target, process_group)
    dcp.save(training_state(model, optimizer, scheduler, step), checkpoint_id=partial,
             process_group=process_group)
    return _publish(partial, target, process_group)


class PendingCheckpoint:
    """An ``async_save`` under way: :meth:`wait` blocks until it is written and in place."""

    def __init__(self, future, partial: Path, target: Path, group):
        self.future, self.partial, self.target, self.group = future, partial, target, group
        self.path: Path | None = None  # set once published: wait() may be called again

    def done(self) -> bool:
        return self.future.done()

    def wait(self) -> Path:
        """The step folder, once its files are written and it is renamed into place."""
        if self.path is None:
            self.future.result()  # re-raises a failed background save here, on this thread
            self.path = _publish(self.partial, self.target, self.group)
        return self.path


def async_save_checkpoint(folder, step: int, model, optimizer, scheduler, *, process_group,
                          overwrite: bool = False) -> PendingCheckpoint:
    """Start ``dcp.async_save`` into ``folder/step-NNNNNN/``; returns once the state is copied.

    The training loop is blocked only while the state is *staged* (copied to CPU memory that
    the optimizer will not touch); a background thread then writes the files. ``process_group``
    must be a group of its own, e.g. ``dist.new_group(backend="gloo")``: the background
    thread runs DCP's collectives (gather the plans, gather the results) while the training
    thread runs FSDP2's, and two threads issuing collectives on one group can issue them in a
    different order on different ranks, which pairs the wrong messages or hangs.

    Call ``.wait()`` before the next save and before the worker returns (see
    :func:`save_stall`).

    Example::

        >>> pg = dist.new_group(backend="gloo")                  # inside a worker
        >>> pending = async_save_checkpoint("/tmp/run", 4, model, opt, sched, process_group=pg)
        >>> ...                                                  # train on
        >>> pending.wait()
        PosixPath('/tmp/run/step-000004')
    """
    import torch.distributed.checkpoint as dcp

    if process_group is None or process_group == dist.GroupMember.WORLD:
        raise ValueError("async saves need a process group of their own: pass "
                         "process_group=dist.new_group(backend='gloo'), not the training one")
    target = _step_folder(folder, step, overwrite)
    partial = _prepare(target, process_group)
    future = dcp.async_save(training_state(model, optimizer, scheduler, step),
                            checkpoint_id=partial, process_group=process_group)
    return PendingCheckpoint(future, partial, target, process_group)


# ---- loading ---------------------------------------------------------------------------------


def latest_checkpoint(folder) -> Path | None:
    """The newest complete ``step-NNNNNN/`` in ``folder`` (with its ``.metadata``), or None.

    Example::

        >>> latest_checkpoint("/tmp/run")            # after steps 4 and 8 were saved
        PosixPath('/tmp/run/step-000008')
    """
    folder = Path(folder)
    found = sorted(p for p in folder.glob(f"{PREFIX}*") if (p / METADATA).is_file())
    return found[-1] if found else None


def _flat_tensors(state: dict, prefix: str = "") -> dict:
    """``{"model.0.weight": tensor, "optim.state.0.weight.exp_avg": tensor, ...}``: DCP's keys."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat_tensors(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value
    return flat


def check_checkpoint(path, state: dict):
    """The checkpoint's metadata, once ``state`` is known to fit it; else a clear error.

    Every rank reads the same metadata and raises the same error before any collective, so a
    mismatch stops the whole run with one message instead of a hang or a rank-local traceback.
    Raises ``FileNotFoundError`` for no checkpoint or a missing shard file (naming it) and
    ``ValueError`` naming the first tensor whose name, shape or dtype does not match.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if path is None:
        raise FileNotFoundError("no checkpoint to load (latest_checkpoint found none): save "
                                "one first, or start the run from step 0")
    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {METADATA} file): pass a "
                                f"{PREFIX}NNNNNN folder, e.g. latest_checkpoint(run_folder)")
    metadata = FileSystemReader(path).read_metadata()
    saved = {k: v for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    wanted = _flat_tensors(state)
    for key, tensor in wanted.items():
        if key not in saved:
            raise ValueError(f"{path.name} was saved from another model: it has no {key!r} "
                             f"(it has e.g. {', '.join(list(saved)[:3])}); load it into the "
                             f"model it was saved from")
        meta = saved[key]
        if tuple(meta.size) != tuple(tensor.shape) or meta.properties.dtype != tensor.dtype:
            raise ValueError(f"{path.name} was saved from another model: {key!r} is "
                             f"{list(meta.size)} {meta.properties.dtype} there, "
                             f"{list(tensor.shape)} {tensor.dtype} here")
    extra = [key for key in saved if key not in wanted]
    if extra:
        raise ValueError(f"{path.name} was saved from another model: it has {extra[0]!r}, "
                         f"which this one has not ({len(extra)} such tensors)")
    files = sorted({info.relative_path for info in metadata.storage_data.values()})
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{path} is incomplete: {missing[0]} is missing "
                                f"({len(missing)} of {len(files)} shard files); restore it, "
                                f"or load an earlier checkpoint")
    return metadata


class RecordingReader(FileSystemReader):
    """A ``FileSystemReader`` that notes what this rank reads: which chunk of which file.

    ``reads`` lists ``{"key", "file", "chunk_offsets", "storage_offsets", "lengths",
    "dest_offsets"}`` per tensor piece, as DCP's load plan asks for them.
    """

    def __init__(self, path):
        super().__init__(path)
        self.reads: list[dict] = []

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType

        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                self.reads.append({
                    "key": item.storage_index.fqn,
                    "file": self.storage_data[item.storage_index].relative_path,
                    "chunk_offsets": tuple(item.storage_index.offset),
                    "storage_offsets": tuple(item.storage_offsets),
                    "lengths": tuple(item.lengths), "dest_offsets": tuple(item.dest_offsets)})
        return super().read_data(plan, planner)


def load_checkpoint(path, model, optimizer, scheduler, *, reader=None) -> int:
    """Load the checkpoint at ``path`` (a step folder) into the sharded training; its step.

    The model may be sharded over another number of ranks than the one saved (or laid out
    with another TP degree): each rank asks DCP for its own DTensor shards, and DCP reads the
    overlapping pieces of the saved chunks. :func:`check_checkpoint` refuses, before any
    reading, a checkpoint of another model or one with a shard file missing.

    Example::

        >>> step = load_checkpoint(latest_checkpoint("/tmp/run"), model, opt, sched)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = training_state(model, optimizer, scheduler, 0)
    check_checkpoint(path, state)
    dcp.load(state, checkpoint_id=path, storage_reader=reader)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"]


def _full(t) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def fingerprint(model, optimizer, *, keep: bool = False) -> dict:
    """A sha256 and a float64 sum over the full model and optimizer state, the same on all ranks.

    Each DTensor is gathered whole (``full_tensor()``, a collective: every rank calls this),
    so two runs sharded differently compare equal exactly when their state is bit for bit the
    same. ``keep=True`` also returns the full tensors (``"tensors"``).

    Example::

        >>> fingerprint(model, opt) == fingerprint(resumed, resumed_opt)   # inside a worker
        True
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    flat = _flat_tensors({"model": model_state, "optim": optim_state})
    digest, total, tensors = hashlib.sha256(), 0.0, {}
    for key in sorted(flat):
        full = _full(flat[key]).detach().cpu().contiguous()
        digest.update(key.encode())
        digest.update(full.numpy().tobytes())
        total += full.double().sum().item()
        if keep:
            tensors[key] = full.clone()
    out = {"sha256": digest.hexdigest(), "sum": total}
    if keep:
        out["tensors"] = tensors
    return out


# ---- worker functions ------------------------------------------------------------------------


def run_and_save(folder, *, steps: int = 8, save_at: int = 4, widths=WIDTHS, tp: int = 1,
                 seed: int = 0) -> dict:
    """Worker function: train ``steps`` steps without stopping, saving at ``save_at`` on the way.

    The one run gives both the checkpoint and the uninterrupted reference a resume is
    compared with (saving reads the state, it does not change it). Returns ``losses``,
    ``saved`` and ``final`` (:func:`fingerprint` at ``save_at`` and at the end, with the full
    tensors), ``save_seconds`` (this rank's ``dcp.save``), ``path``, ``world``.

    Example::

        >>> r = labkit.launch(run_and_save, "/tmp/run", nproc=4).values[0]
        >>> r["path"], len(r["losses"])
        ('/tmp/run/step-000004', 8)
    """
    whole(save_at, "save_at")
    if whole(steps, "steps") < save_at:
        raise ValueError(f"save_at={save_at} is after the last step ({steps}): save within the run")
    model, opt, sched = sharded_model(widths=widths, tp=tp, seed=seed)
    losses = train_steps(model, opt, sched, 0, save_at, widths=widths, seed=seed)
    start = time.perf_counter()
    path = save_checkpoint(folder, save_at, model, opt, sched)
    save_seconds = time.perf_counter() - start
    saved = fingerprint(model, opt, keep=True)
    losses += train_steps(model, opt, sched, save_at, steps, widths=widths, seed=seed)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "tp": tp, "path": str(path),
            "losses": losses, "saved": saved, "final": fingerprint(model, opt, keep=True),
            "save_seconds": save_seconds}


def resume_and_train(folder, *, steps: int = 8, widths=WIDTHS, tp: int = 1, seed: int = 0) -> dict:
    """Worker function: resume from the newest checkpoint in ``folder`` and train to ``steps``.

    Run it on another world size than the save to reshard. Returns ``resumed_from`` (the
    step), ``loaded`` and ``final`` (:func:`fingerprint` right after loading and at the end,
    with the full tensors), ``losses`` (of the steps run here), ``load_seconds`` and
    ``reads``: what this rank read, from which file (:class:`RecordingReader`), to set beside
    :func:`reshard_plan`.

    Example::

        >>> r = labkit.launch(resume_and_train, "/tmp/run", nproc=2).values[0]
        >>> r["resumed_from"], len(r["losses"])
        (4, 4)
    """
    path = latest_checkpoint(folder)
    if path is None:
        raise FileNotFoundError(f"no checkpoint in {folder}: run run_and_save there first")
    model, opt, sched = sharded_model(widths=widths, tp=tp, seed=seed + 1)  # not the saved init
    reader = RecordingReader(path)
    start = time.perf_counter()
    step = load_checkpoint(path, model, opt, sched, reader=reader)
    load_seconds = time.perf_counter() - start
    loaded = fingerprint(model, opt, keep=True)
    losses = train_steps(model, opt, sched, step, steps, widths=widths, seed=seed)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "tp": tp,
            "resumed_from": step, "loaded": loaded, "final": fingerprint(model, opt, keep=True),
            "losses": losses, "load_seconds": load_seconds, "reads": reader.reads}


def save_stall(folder, *, mode: str = "sync", steps: int = 12, every: int = 4,
               widths=(64, 256, 256, 64), seed: int = 0) -> dict:
    """Worker function: how long saving blocks training, with ``dcp.save`` or ``async_save``.

    Trains ``steps`` steps and saves every ``every`` steps into ``folder``. Returns
    ``step_seconds`` (each step, the save included), ``save_seconds`` (the time each save call
    kept the training loop waiting), ``stall`` (their sum), ``final_wait`` (async: waiting
    for the last save before returning) and ``paths``.

    On this course's CPU machine (2 ranks, ``widths=(256, 1024, 1024, 256)``: 19 MB per save,
    3 saves) the sync saves stalled training ~0.19 s and the async ones ~0.09 s, plus ~0.05 s
    waiting for the last; but the background writes share the CPU cores with training, so
    the other steps ran slower meanwhile. On GPUs the training does not need those cores.

    Example::

        >>> big = (256, 1024, 1024, 256)
        >>> sync = labkit.launch(save_stall, "/tmp/a", mode="sync", widths=big, nproc=2)
        >>> asyn = labkit.launch(save_stall, "/tmp/b", mode="async", widths=big, nproc=2)
        >>> asyn.values[0]["stall"] < sync.values[0]["stall"]
        True
    """
    if mode not in ("sync", "async"):
        raise ValueError(f"mode={mode!r}: use 'sync' (dcp.save) or 'async' (dcp.async_save)")
    whole(steps, "steps")
    whole(every, "every")
    model, opt, sched = sharded_model(widths=widths, seed=seed)
    group = dist.new_group(backend="gloo")  # the saves' own group: see async_save_checkpoint
    step_seconds, save_seconds, paths, pending = [], [], [], None
    try:
        for step in range(1, steps + 1):
            start = time.perf_counter()
            train_steps(model, opt, sched, step - 1, step, widths=widths, seed=seed)
            if step % every == 0:
                saving = time.perf_counter()
                if mode == "sync":
                    paths.append(save_checkpoint(folder, step, model, opt, sched,
                                                 process_group=group))
                else:
                    # One save at a time: a second would stage a second copy of the state and
                    # run its collectives on the same group from another thread, interleaved
                    # with the first's. Waiting here is the stall when saves come too often.
                    if pending is not None:
                        paths.append(pending.wait())
                    pending = async_save_checkpoint(folder, step, model, opt, sched,
                                                    process_group=group)
                save_seconds.append(time.perf_counter() - saving)
            step_seconds.append(time.perf_counter() - start)
        final_wait = time.perf_counter()
        if pending is not None:
            # Before returning: the files are written by a background thread of this process,
            # and a worker that returns (or exits) before it finishes leaves a half-written
            # checkpoint under the temporary name, never renamed into place.
            paths.append(pending.wait())
            pending = None
        final_wait = time.perf_counter() - final_wait
    finally:
        if pending is not None:
            pending.future.exception()  # an error on the way: let the thread finish first
        dist.destroy_process_group(group)
    return {"rank": dist.get_rank(), "mode": mode, "step_seconds": step_seconds,
            "save_seconds": save_seconds, "stall": sum(save_seconds), "final_wait": final_wait,
            "paths": [str(p) for p in paths]}


# ---- what a save wrote -----------------------------------------------------------------------


def checkpoint_files(path) -> dict:
    """What DCP wrote in the step folder ``path``: the files, and the chunks each one holds.

    Read from the folder and its ``.metadata`` (``FileSystemReader(path).read_metadata()``),
    no process group needed. Returns

    - ``files``: per file (``.metadata`` first, then ``__<rank>_0.distcp``), its ``bytes``
      and the ``chunks`` it holds: ``key``, ``offsets`` and ``sizes`` in the global tensor
      (``None`` for a pickled object such as the step), ``bytes`` the chunk takes in the file;
    - ``tensors``: per key, the global ``shape``, ``dtype`` and its ``chunks`` with the file;
    - ``objects``: the keys saved as pickled bytes (step, scheduler, param groups);
    - ``total_bytes`` (all files), ``tensor_bytes`` (model + optimizer state, each tensor
      counted once at its global size), ``model_bytes``, ``optim_bytes``.

    Example::

        >>> files = checkpoint_files("/tmp/run/step-000004")
        >>> [f["name"] for f in files["files"]]
        ['.metadata', '__0_0.distcp', '__1_0.distcp', '__2_0.distcp', '__3_0.distcp']
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {METADATA} file): pass a "
                                f"{PREFIX}NNNNNN folder, e.g. latest_checkpoint(run_folder)")
    metadata = FileSystemReader(path).read_metadata()
    names = [METADATA] + sorted(p.name for p in path.iterdir() if p.name != METADATA)
    files = {name: {"name": name, "bytes": (path / name).stat().st_size, "chunks": []}
             for name in names}
    tensors, objects = {}, []
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            tensors[key] = {"shape": tuple(meta.size), "dtype": meta.properties.dtype,
                            "chunks": []}
        else:
            objects.append(key)
    for index, info in metadata.storage_data.items():
        offsets = tuple(index.offset) if index.offset is not None else None
        sizes = None
        if index.fqn in tensors:
            meta = metadata.state_dict_metadata[index.fqn]
            sizes = next(tuple(c.sizes) for c in meta.chunks if tuple(c.offsets) == offsets)
            tensors[index.fqn]["chunks"].append(
                {"offsets": offsets, "sizes": sizes, "file": info.relative_path})
        files.setdefault(info.relative_path, {"name": info.relative_path, "bytes": None,
                                              "chunks": []})["chunks"].append(
            {"key": index.fqn, "offsets": offsets, "sizes": sizes, "bytes": info.length})
    for entry in tensors.values():
        entry["chunks"].sort(key=lambda c: c["offsets"])

    def size(key):
        return math.prod(tensors[key]["shape"]) * tensors[key]["dtype"].itemsize

    model_bytes = sum(size(k) for k in tensors if k.startswith("model."))
    optim_bytes = sum(size(k) for k in tensors if k.startswith("optim."))
    return {"path": str(path), "files": list(files.values()), "tensors": tensors,
            "objects": objects, "total_bytes": sum(f["bytes"] or 0 for f in files.values()),
            "tensor_bytes": sum(size(k) for k in tensors), "model_bytes": model_bytes,
            "optim_bytes": optim_bytes}


def read_checkpoint(path) -> dict:
    """Every tensor of the checkpoint at ``path``, whole, and its pickled objects, in this process.

    ``dcp.load`` with ``no_dist=True`` into full-size tensors allocated from the metadata: the
    same reading a 1-rank run does, without a process group (a notebook's kernel, a test).

    Example::

        >>> read_checkpoint("/tmp/run/step-000004")["model.0.weight"].shape
        torch.Size([10, 8])
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no {METADATA} file): pass a "
                                f"{PREFIX}NNNNNN folder, e.g. latest_checkpoint(run_folder)")
    metadata = FileSystemReader(path).read_metadata()
    state = {key: (torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
                   if isinstance(meta, TensorStorageMetadata) else None)
             for key, meta in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


# ---- resharding by hand ----------------------------------------------------------------------


def shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """The rows ``[start, stop)`` each of ``world`` ranks holds under FSDP2's dim-0 sharding.

    FSDP2 (and a DTensor's ``Shard(0)``) splits like ``torch.chunk``: every rank gets
    ``ceil(rows / world)`` rows except at the end, where the last ranks get fewer, or none
    (``start == stop``) when there are more ranks than the rows fill.

    Example::

        >>> shard_rows(10, 4), shard_rows(3, 4)
        ([(0, 3), (3, 6), (6, 9), (9, 10)], [(0, 1), (1, 2), (2, 3), (3, 3)])
    """
    rows = whole(rows, "rows", low=0)
    world = whole(world, "world")
    each = -(-rows // world)  # ceil: torch.chunk's chunk size
    return [(min(r * each, rows), min((r + 1) * each, rows)) for r in range(world)]


def reshard_plan(global_shape, old_world: int, new_world: int, *, itemsize: int = 4) -> list:
    """What each rank of a new world reads of a tensor saved dim-0 sharded over ``old_world``.

    A pure function (no torch.distributed): the arithmetic DCP's load planner does for an
    FSDP2 parameter (or Adam state) saved on ``old_world`` ranks and loaded on ``new_world``.
    Saved rank ``o``'s chunk is rows :func:`shard_rows` ``(rows, old_world)[o]``, in file
    ``__<o>_0.distcp``; new rank ``r`` needs rows ``shard_rows(rows, new_world)[r]`` and reads
    the overlap with each saved chunk. One dict per new rank:

    - ``rank``, ``rows`` (``(start, stop)`` global), ``shape`` of its new shard, ``bytes``;
    - ``reads``: per saved chunk it overlaps, in row order: ``old_rank``, ``file``, ``rows``
      (global), ``shard_rows`` (within the saved chunk), ``bytes`` (``(start, stop)`` byte
      offsets within the saved chunk's data: a row is ``prod(shape[1:]) * itemsize`` bytes),
      and ``dest_rows`` (where they go within the new shard).

    A new rank with no rows reads nothing (``reads == []``). A saved rank that held no rows
    still wrote a chunk, of size 0 at offset ``rows`` (DCP records it in ``.metadata``, see
    :func:`checkpoint_files`), and nobody reads it. More ranks than rows is no error: FSDP2
    allows it, the rank simply holds an empty shard, so this plan allows it too.

    Example::

        >>> plan = reshard_plan((10, 8), old_world=4, new_world=2)
        >>> [[(r["file"], r["shard_rows"]) for r in p["reads"]] for p in plan]
        [[('__0_0.distcp', (0, 3)), ('__1_0.distcp', (0, 2))],
         [('__1_0.distcp', (2, 3)), ('__2_0.distcp', (0, 3)), ('__3_0.distcp', (0, 1))]]
    """
    shape = tuple(global_shape)
    if not shape:
        raise ValueError("global_shape=(): a scalar is not sharded; give the tensor's shape, "
                         "e.g. (10, 8)")
    shape = tuple(whole(d, "each dimension of global_shape", low=0) for d in shape)
    row_bytes = math.prod(shape[1:]) * whole(itemsize, "itemsize")
    old = shard_rows(shape[0], old_world)
    plan = []
    for rank, (start, stop) in enumerate(shard_rows(shape[0], new_world)):
        reads = []
        for old_rank, (o_start, o_stop) in enumerate(old):
            lo, hi = max(start, o_start), min(stop, o_stop)
            if lo < hi:
                reads.append({"old_rank": old_rank, "file": f"__{old_rank}_0.distcp",
                              "rows": (lo, hi), "shard_rows": (lo - o_start, hi - o_start),
                              "bytes": ((lo - o_start) * row_bytes, (hi - o_start) * row_bytes),
                              "dest_rows": (lo - start, hi - start)})
        plan.append({"rank": rank, "rows": (start, stop), "shape": (stop - start, *shape[1:]),
                     "bytes": (stop - start) * row_bytes, "reads": reads})
    return plan

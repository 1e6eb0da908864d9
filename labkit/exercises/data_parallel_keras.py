"""Notebook 02 Keras's exercises: the loss over the global batch, TF_CONFIG, a shard per worker.

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint. The loss and ``TF_CONFIG`` are
pure functions, graded in the kernel; the shard is graded on two real TensorFlow workers
(fresh processes: TensorFlow cannot reuse warm ones), each under its own ``TF_CONFIG``.
Graders import TensorFlow and NumPy when they run, never PyTorch.
"""

from __future__ import annotations

import json
import os
import re

from ..check import NotYet, exercise, on_ranks

NOTEBOOK = "02"


# ---- the loss divided by the global batch -------------------------------------------------------

def _diagnose_ratio(ratio: float, replicas: int, per_replica: int) -> tuple[str, str] | None:
    """What a wrong factor between the summed gradient and the right one says; None if right."""
    global_batch = replicas * per_replica
    close = lambda target: abs(ratio - target) <= 1e-3 * target  # noqa: E731 - one line
    if close(1.0):
        return None
    if close(replicas):
        return (f"with {replicas} replicas the summed gradient is {ratio:.3g} x the right one: "
                f"gradients are {replicas} times too large",
                "each replica divided by its own batch (a mean over its samples); the all-reduce "
                "then adds N such means. Divide the sum by global_batch_size instead")
    if close(global_batch):
        return (f"the summed gradient is {ratio:.3g} x the right one (the global batch is "
                f"{global_batch})", "the per-example losses were added up but not divided: "
                                    "divide their sum by global_batch_size")
    if close(1 / per_replica):
        return (f"the summed gradient is 1/{per_replica} of the right one ({per_replica} samples "
                f"per replica)", "the loss was divided twice, by the replica's own batch (a "
                                 "mean) and by the global batch: divide the sum of the "
                                 "per-example losses by global_batch_size, once")
    if close(1 / replicas):
        return (f"the summed gradient is 1/{replicas} of the right one",
                "the loss was divided by the global batch and by the number of replicas too; "
                "the all-reduce sums the replicas' gradients, so divide by global_batch_size "
                "only")
    return (f"with {replicas} replicas of {per_replica} samples the summed gradient is "
            f"{ratio:.3g} x the right one",
            "divide the sum of this replica's per-example losses by the global_batch_size "
            "argument (not by a number from the notebook)")


def _replica_gradients(replica_loss, x, y, replicas: int):
    """Each replica's gradient of ``replica_loss`` on its slice, like ``strategy.run`` would."""
    import tensorflow as tf

    w = tf.Variable([0.5, -1.0, 2.0])
    per_replica, global_batch = len(x) // replicas, len(x)
    grads = []
    for r in range(replicas):
        xs, ys = x[r * per_replica:(r + 1) * per_replica], y[r * per_replica:(r + 1) * per_replica]
        with tf.GradientTape() as tape:
            per_example = tf.square(tf.linalg.matvec(xs, w) - ys)  # one loss per sample
            loss = replica_loss(per_example, global_batch)
        if not tf.is_tensor(loss):
            raise NotYet(f"it returned a {type(loss).__name__}, not a TensorFlow tensor: the "
                         f"gradient tape cannot follow it",
                         "compute it from per_example_loss with TensorFlow operations "
                         "(tf.reduce_sum), not NumPy or float()")
        if tuple(loss.shape) != ():
            raise NotYet(f"it returned a tensor of shape {tuple(loss.shape)}, not one number",
                         "return a scalar: the sum of the per-example losses divided by "
                         "global_batch_size")
        grad = tape.gradient(loss, w)
        if grad is None:
            raise NotYet("its result has no gradient: the tape did not see it computed",
                         "compute it from per_example_loss with TensorFlow operations "
                         "(tf.reduce_sum), not NumPy or float()")
        grads.append(grad.numpy())
    with tf.GradientTape() as tape:  # the reference: one device, the whole batch, its mean
        mean = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - y))
    return grads, tape.gradient(mean, w).numpy()


@exercise("keras_global_batch_loss", notebook=NOTEBOOK, title="the loss over the global batch")
def global_batch_loss(replica_loss) -> str:
    """Exercise: ``replica_loss(per_example_loss, global_batch_size)``, one replica's share.

    Run as replicas would run it: the global batch cut into N slices, each replica's gradient
    through the learner's loss, the gradients summed (what the all-reduce does), compared with
    one device's gradient of the mean loss over the whole batch; for 2 and 4 replicas, and once
    inside a ``tf.function`` (the training step is traced).

    Example::

        >>> exercise.global_batch_loss(replica_loss)
        [pass] the loss over the global batch: summed replica gradients equal one device's ...
    """
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for replicas, per_replica in ((2, 4), (4, 3)):
        x = rng.normal(size=(replicas * per_replica, 3)).astype("float32")
        y = rng.normal(size=replicas * per_replica).astype("float32")
        grads, reference = _replica_gradients(replica_loss, x, y, replicas)
        summed = np.sum(grads, axis=0)  # the all-reduce
        ratio = float(np.linalg.norm(summed) / np.linalg.norm(reference))
        if (wrong := _diagnose_ratio(ratio, replicas, per_replica)) is not None:
            raise NotYet(*wrong)
        if not np.allclose(summed, reference, rtol=1e-4, atol=1e-6):
            raise NotYet("the summed gradient has the right size but points elsewhere",
                         "weigh every per-example loss alike: their sum over global_batch_size")
    try:
        traced = float(tf.function(replica_loss)(tf.constant([1.0, 2.0, 3.0]), 6))
    except Exception as exc:  # eager worked, the graph did not: NumPy or Python on tensors
        raise NotYet(f"it fails inside a tf.function: {type(exc).__name__}: "
                     f"{str(exc).strip()[:160]}",
                     "the training step is traced into a graph: use TensorFlow operations "
                     "(tf.reduce_sum), not NumPy or float()") from None
    if abs(traced - 1.0) > 1e-6:
        raise NotYet(f"inside a tf.function, losses [1, 2, 3] of a global batch of 6 gave "
                     f"{traced:g}, not 1", "the same division in a graph as eagerly")
    return ("summed replica gradients equal one device's gradient of the global mean, for 2 "
            "and 4 replicas, eagerly and in a tf.function")


# ---- TF_CONFIG ----------------------------------------------------------------------------------

def _expected_tf_config(worker: int, addresses: list[str]) -> dict:
    return {"cluster": {"worker": list(addresses)}, "task": {"type": "worker", "index": worker}}


def _diagnose_tf_config(config, worker: int, addresses: list[str]) -> None:
    """Raise NotYet naming the first difference from worker ``worker``'s TF_CONFIG."""
    if isinstance(config, str):
        raise NotYet(f"worker {worker}'s answer is a string", "return the dict itself; the "
                     "environment variable holds json.dumps of it")
    if not isinstance(config, dict) or set(config) != {"cluster", "task"}:
        keys = sorted(config) if isinstance(config, dict) else type(config).__name__
        raise NotYet(f"worker {worker}'s TF_CONFIG has {keys}, not the keys cluster and task",
                     'a dict {"cluster": {"worker": [...]}, "task": {"type": ..., "index": ...}}')
    cluster, task = config["cluster"], config["task"]
    mine = cluster.get("worker") if isinstance(cluster, dict) else None
    if mine != list(addresses):
        if mine == [addresses[worker]]:
            hint = ("every worker gets the whole cluster, every address, in the same order: the "
                    "workers find each other through it")
        elif isinstance(mine, list) and sorted(mine) == sorted(addresses):
            hint = "the same order on every worker: an index is a position in this list"
        else:
            hint = 'the cluster is {"worker": addresses}: all of them, as given'
        raise NotYet(f"worker {worker}'s cluster is {cluster}", hint)
    if not isinstance(task, dict) or task.get("type") != "worker":
        raise NotYet(f"worker {worker}'s task is {task}",
                     'every process here is a worker: "type": "worker" (worker 0 acts as chief)')
    index = task.get("index")
    if index != worker or not isinstance(index, int):
        hint = (f"an int, not {type(index).__name__}" if str(index) == str(worker) else
                "its own position in the cluster list, counted from 0: worker i has index i")
        raise NotYet(f"worker {worker}'s task index is {index!r}", hint)
    if config != _expected_tf_config(worker, addresses):
        raise NotYet(f"worker {worker}'s TF_CONFIG has more than the layout: {config}",
                     'only {"cluster": {"worker": addresses}, "task": {"type": "worker", '
                     '"index": i}}')


def _addresses(workers: int) -> list[str]:
    """The cluster's addresses, as given: not sorted, so that sorting them changes the order."""
    return [f"host-{'cadbfehgjilk'[i]}.lab:{2222 + i}" for i in range(workers)]


@exercise("keras_tf_config", notebook=NOTEBOOK, title="TF_CONFIG for worker i")
def tf_config(make_tf_config, workers: int = 3) -> str:
    """Exercise: ``make_tf_config(worker, addresses)``, the ``TF_CONFIG`` dict of one worker.

    Asked for every worker of a 3-worker cluster; each answer is compared with the layout, then
    read back by TensorFlow's own ``TFConfigClusterResolver`` (what the strategy reads).

    Example::

        >>> exercise.tf_config(make_tf_config)
        [pass] TF_CONFIG for worker i: 3 workers, one cluster list, each its own index ...
    """
    import tensorflow as tf

    addresses = _addresses(workers)
    configs = [make_tf_config(i, list(addresses)) for i in range(workers)]
    for i, config in enumerate(configs):
        _diagnose_tf_config(config, i, addresses)
    saved = os.environ.get("TF_CONFIG")
    try:
        for i, config in enumerate(configs):
            os.environ["TF_CONFIG"] = json.dumps(config)
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            read = resolver.task_type, resolver.task_id, resolver.cluster_spec().as_dict()
            if read != ("worker", i, {"worker": addresses}):
                raise NotYet(f"TensorFlow read worker {i}'s TF_CONFIG as {read}",
                             "the layout of TensorFlow's multi-worker guide, exactly")
    finally:  # the kernel's own environment as it was
        if saved is None:
            os.environ.pop("TF_CONFIG", None)
        else:
            os.environ["TF_CONFIG"] = saved
    return (f"{workers} workers, one cluster list, each its own index; "
            f"TFConfigClusterResolver reads task_id 0..{workers - 1}")


# ---- a shard per worker, on real workers ---------------------------------------------------------

def _shard_worker(shard_and_batch_fns, samples: int, global_batch: int, limit: int = 64):
    """On each TensorFlow worker: the example ids of every batch each function gave this worker.

    Runs the learner's ``shard_and_batch(dataset, ctx, global_batch)`` the way a training
    program does: as ``dataset_fn`` of ``MultiWorkerMirroredStrategy``'s
    ``distribute_datasets_from_function``, which passes this worker's ``InputContext``.
    """
    import signal

    import numpy as np
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")  # numbered examples need no GPU: CPU collectives
    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG, waits for all
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stop at once when the launcher says so
    ids = np.arange(samples)
    found = []
    for fn in shard_and_batch_fns:
        def dataset_fn(ctx, fn=fn):
            examples = tf.data.Dataset.from_tensor_slices((ids[:, None].astype("float32"), ids))
            return fn(examples, ctx, global_batch)

        seen = []
        batches = strategy.distribute_datasets_from_function(dataset_fn)
        for _, (_, y) in zip(range(limit), batches, strict=False):  # limit: a repeat() is fine
            local = strategy.experimental_local_results(y)
            seen.append([int(v) for t in local for v in np.atleast_1d(np.asarray(t))])
        found.append(seen)
    return {"worker": strategy.cluster_resolver.task_id, "batches": found}


def _judge_shards(per_worker: list[list[list[int]]], samples: int, global_batch: int) -> str:
    """Pass or NotYet for the batches each worker saw (``per_worker[w]``: lists of example ids)."""
    workers = len(per_worker)
    share = global_batch // workers
    seen = [{i for batch in batches for i in batch} for batches in per_worker]
    for w in range(1, workers):
        if common := seen[0] & seen[w]:
            raise NotYet(f"worker {w} saw {len(common)} of worker 0's examples "
                         f"(of {len(seen[w])} it saw)",
                         "give each worker its own shard: dataset.shard(ctx.num_input_pipelines, "
                         "ctx.input_pipeline_id), before batching")
    sizes = sorted({len(b) for batches in per_worker for b in batches})
    if 0 in sizes:  # the strategy pads a worker that ran out with empty batches
        empty = [w for w, batches in enumerate(per_worker) if any(not b for b in batches)]
        raise NotYet(f"worker {empty[0]} got an empty batch: it ran out of batches while another "
                     f"worker still had one", "synchronous steps need the same number of full "
                     "batches on every worker: shard first, then batch with drop_remainder=True")
    if sizes and sizes[-1] == global_batch:
        raise NotYet(f"each worker's batches hold {global_batch} examples: the whole global "
                     f"batch, on each of the {workers} workers",
                     "the global batch is split between the workers: batch by "
                     "ctx.get_per_replica_batch_size(global_batch), here "
                     f"{global_batch} // {workers} = {share}")
    if sizes != [share]:
        raise NotYet(f"batches of {sizes} examples, expected {share} in every one",
                     f"{share} = ctx.get_per_replica_batch_size(global_batch); batch with "
                     f"drop_remainder=True so no step gets a partial batch")
    counts = [len(batches) for batches in per_worker]
    if len(set(counts)) > 1:
        raise NotYet(f"the workers got {counts} batches",
                     "synchronous steps need the same number of batches on every worker (the "
                     "one with more would wait in an all-reduce): shard first, then batch with "
                     "drop_remainder=True")
    missed = samples - len(set().union(*seen))
    if missed >= global_batch:
        raise NotYet(f"{missed} of the {samples} examples reached no worker",
                     "shard the whole dataset: every example goes to exactly one worker")
    return (f"{workers} workers saw disjoint shards, {counts[0]} batches of {share} each "
            f"({samples - missed} of {samples} examples; the rest would make a partial batch)")


def _context_shards(shard_and_batch, workers: int, samples: int, global_batch: int,
                    limit: int = 64) -> list[list[list[int]]]:
    """The batches each of ``workers`` input pipelines would give, here in the kernel.

    Each pipeline gets the ``tf.distribute.InputContext`` the strategy would pass it: what the
    learner's code reads (its pipeline's id, how many there are, the per-replica batch) is the
    same as on real workers, without starting them.
    """
    import numpy as np
    import tensorflow as tf

    ids = np.arange(samples)
    found = []
    for w in range(workers):
        ctx = tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=w,
                                         num_replicas_in_sync=workers)
        examples = tf.data.Dataset.from_tensor_slices((ids[:, None].astype("float32"), ids))
        try:
            batches = shard_and_batch(examples, ctx, global_batch)
            found.append([[int(v) for v in np.atleast_1d(y.numpy())]
                          for _, (_, y) in zip(range(limit), batches, strict=False)])
        except Exception as exc:  # the learner's code, e.g. shard(2, i) on pipeline 2 of 4
            said = re.sub(r"\{\{.*?\}\}\s*", "", str(exc)).strip().split("\n")[0][:160]
            raise NotYet(f"on pipeline {w} of {workers} it raised {type(exc).__name__}: {said}",
                         "it runs once per worker, each time with that worker's ctx") from None
    return found


@exercise("keras_worker_shard", notebook=NOTEBOOK, title="a shard and a batch per worker")
def worker_shard(shard_and_batch, samples: int = 42, global_batch: int = 8,
                 timeout: float = 120) -> str:
    """Exercise: ``shard_and_batch(dataset, ctx, global_batch)``, one worker's batches.

    First on 4 input pipelines here, each with the ``InputContext`` the strategy would give it
    (global batch ``2 * global_batch``), then on 2 real TensorFlow workers
    (``MultiWorkerMirroredStrategy``, each with its own ``TF_CONFIG``), on a dataset of
    ``samples`` numbered examples: the workers must see disjoint examples, in batches of their
    share of the global batch, as many on each.

    Example::

        >>> exercise.worker_shard(shard_and_batch)
        [pass] a shard and a batch per worker: 2 workers saw disjoint shards, 5 batches of 4 ...
    """
    # First 4 pipelines with the InputContext each would get: a number of workers written in
    # (global_batch // 2, shard(2, ...)) passes on 2 workers and fails here.
    try:
        _judge_shards(_context_shards(shard_and_batch, 4, samples, 2 * global_batch), samples,
                      2 * global_batch)
    except NotYet as wrong:
        raise NotYet(f"with 4 workers and a global batch of {2 * global_batch}: {wrong.detail}",
                     "read the number of workers, this worker's id and the per-worker batch from "
                     "ctx (num_input_pipelines, input_pipeline_id, get_per_replica_batch_size), "
                     "not from numbers in the notebook; " + wrong.hint) from None
    values = on_ranks(_shard_worker, [shard_and_batch], samples, global_batch, nproc=2,
                      timeout=timeout, framework="tensorflow")
    return (_judge_shards([v["batches"][0] for v in values], samples, global_batch)
            + f"; and on 4 input pipelines, a global batch of {2 * global_batch}")

"""Notebook 02 Keras's graders: the reference solutions pass, known wrong answers get their hints.

The loss and TF_CONFIG graders run in the kernel's TensorFlow, which must not share a process
with torchvision (other tests import it): those cases run in one subprocess,
``python -m tests.test_exercises_data_parallel_keras``, which prints each verdict as JSON. The
shard grader runs on two TensorFlow workers started from here: one launch gives the batches of
the reference solution and of every wrong answer at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from labkit import check, exercises
from labkit.exercises import data_parallel_keras

ROOT = Path(__file__).resolve().parents[1]
STEM = "02_data_parallelism_keras"
CASES = {}  # name -> a function that runs one in-kernel grader on one answer, in the subprocess

# The workers unpickle this module's answers by value, as they do a notebook's.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _solution(ex_id: str, name: str):
    namespace = {"__name__": "solution_block"}
    if ex_id == "keras_global_batch_loss":
        import tensorflow as tf

        namespace["tf"] = tf
    exec(exercises.solution_blocks(STEM)[ex_id], namespace)
    return namespace[name]


# ---- keras_global_batch_loss (in the subprocess) -------------------------------------------------

@case
def loss_solution():
    return data_parallel_keras.global_batch_loss(_solution("keras_global_batch_loss",
                                                           "replica_loss"))


@case
def loss_compute_average_loss():
    import tensorflow as tf

    return data_parallel_keras.global_batch_loss(
        lambda per_example, global_batch: tf.nn.compute_average_loss(
            per_example, global_batch_size=global_batch))


@case
def loss_replica_mean():
    import tensorflow as tf

    return data_parallel_keras.global_batch_loss(lambda per_example, _: tf.reduce_mean(per_example))


@case
def loss_sum():
    import tensorflow as tf

    return data_parallel_keras.global_batch_loss(lambda per_example, _: tf.reduce_sum(per_example))


@case
def loss_divided_twice():
    import tensorflow as tf

    def replica_loss(per_example, global_batch):
        return tf.reduce_mean(per_example) / global_batch

    return data_parallel_keras.global_batch_loss(replica_loss)


@case
def loss_over_replicas():
    import tensorflow as tf

    def replica_loss(per_example, global_batch):  # REPLICAS (2) from the notebook, once more
        return tf.reduce_sum(per_example) / global_batch / 2

    return data_parallel_keras.global_batch_loss(replica_loss)


@case
def loss_numpy():
    import numpy as np

    return data_parallel_keras.global_batch_loss(
        lambda per_example, global_batch: np.sum(per_example.numpy()) / global_batch)


@case
def loss_per_example():
    return data_parallel_keras.global_batch_loss(lambda per_example, global_batch:
                                                 per_example / global_batch)


# ---- keras_tf_config (in the subprocess) ---------------------------------------------------------

@case
def tf_config_solution():
    return data_parallel_keras.tf_config(_solution("keras_tf_config", "make_tf_config"))


@case
def tf_config_own_address_only():
    return data_parallel_keras.tf_config(lambda i, addresses: {
        "cluster": {"worker": [addresses[i]]}, "task": {"type": "worker", "index": i}})


@case
def tf_config_index_zero():
    return data_parallel_keras.tf_config(lambda i, addresses: {
        "cluster": {"worker": addresses}, "task": {"type": "worker", "index": 0}})


@case
def tf_config_json_string():
    return data_parallel_keras.tf_config(lambda i, addresses: json.dumps({
        "cluster": {"worker": addresses}, "task": {"type": "worker", "index": i}}))


@case
def tf_config_index_string():
    return data_parallel_keras.tf_config(lambda i, addresses: {
        "cluster": {"worker": addresses}, "task": {"type": "worker", "index": str(i)}})


@case
def tf_config_chief():
    return data_parallel_keras.tf_config(lambda i, addresses: {
        "cluster": {"worker": addresses}, "task": {"type": "chief" if i == 0 else "worker",
                                                    "index": i}})


@case
def tf_config_sorted():
    return data_parallel_keras.tf_config(lambda i, addresses: {
        "cluster": {"worker": sorted(addresses)}, "task": {"type": "worker", "index": i}})


@case
def tf_config_copied_by_json():  # a valid answer written otherwise: a template, filled in
    template = '{"cluster": {"worker": []}, "task": {"type": "worker", "index": 0}}'

    def make_tf_config(worker, addresses):
        config = json.loads(template)
        config["cluster"]["worker"].extend(addresses)
        config["task"]["index"] = worker
        return config

    return data_parallel_keras.tf_config(make_tf_config)


# ---- keras_worker_shard in the kernel: 4 input pipelines, before any worker starts ---------------

def two_workers_written_in(dataset, ctx, global_batch):  # GLOBAL // 2 and shard(2, i)
    return dataset.shard(2, ctx.input_pipeline_id).batch(global_batch // 2, drop_remainder=True)


def half_the_global_batch(dataset, ctx, global_batch):
    shard = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return shard.batch(global_batch // 2, drop_remainder=True)


def notebook_global_batch(dataset, ctx, global_batch):  # the notebook's 8, not the argument
    shard = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return shard.batch(ctx.get_per_replica_batch_size(8), drop_remainder=True)


def every_nth_by_index(dataset, ctx, global_batch):  # valid, written otherwise
    n, mine = ctx.num_input_pipelines, ctx.input_pipeline_id

    def keep(index, example):
        return index % n == mine

    def drop_index(index, example):
        return example

    own = dataset.enumerate().filter(keep).map(drop_index)
    return own.batch(global_batch // n, drop_remainder=True)


def _on_four_pipelines(fn):
    """What worker_shard checks in the kernel, as a verdict: 4 pipelines, a global batch of 16."""
    try:
        said = data_parallel_keras._judge_shards(
            data_parallel_keras._context_shards(fn, 4, 42, 16), 42, 16)
    except check.NotYet as wrong:
        return check.Verdict("shards", False, wrong.detail, wrong.hint)
    return check.Verdict("shards", True, said)


@case
def shard_two_workers_written_in():  # fails in the kernel: no worker starts
    return data_parallel_keras.worker_shard(two_workers_written_in)


@case
def shard_half_the_global_batch():
    return data_parallel_keras.worker_shard(half_the_global_batch)


@case
def shard_notebook_global_batch():
    return data_parallel_keras.worker_shard(notebook_global_batch)


@case
def shard_solution_on_four_pipelines():
    return _on_four_pipelines(_solution("keras_worker_shard", "shard_and_batch"))


@case
def shard_every_nth_on_four_pipelines():
    return _on_four_pipelines(every_nth_by_index)


@pytest.fixture(scope="module")
def verdicts():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tests.test_exercises_data_parallel_keras"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("VERDICTS ")]
    assert out.returncode == 0 and lines, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(lines[-1][len("VERDICTS "):])


def passed(verdicts, name):
    v = verdicts[name]
    assert v["passed"], v
    return v


def not_yet(verdicts, name, said):
    v = verdicts[name]
    assert not v["passed"], v
    assert said in v["detail"] + " | " + v["hint"], v
    return v


def test_keras_global_batch_loss_solution_passes(verdicts):
    assert "for 2 and 4 replicas" in passed(verdicts, "loss_solution")["detail"]
    passed(verdicts, "loss_compute_average_loss")  # TensorFlow's own function, the other answer


def test_keras_global_batch_loss_wrong_replica_mean(verdicts):
    v = not_yet(verdicts, "loss_replica_mean", "gradients are 2 times too large")
    assert "divided by its own batch" in v["hint"]


def test_keras_global_batch_loss_wrong_sum_not_divided(verdicts):
    not_yet(verdicts, "loss_sum", "added up but not divided")


def test_keras_global_batch_loss_wrong_divided_twice(verdicts):
    not_yet(verdicts, "loss_divided_twice", "the loss was divided twice")


def test_keras_global_batch_loss_wrong_numpy_loses_the_gradient(verdicts):
    v = not_yet(verdicts, "loss_numpy", "not a TensorFlow tensor")
    assert "tf.reduce_sum" in v["hint"]


def test_keras_global_batch_loss_wrong_divided_by_the_replicas_again(verdicts):
    not_yet(verdicts, "loss_over_replicas", "by the number of replicas too")


def test_keras_global_batch_loss_wrong_not_a_scalar(verdicts):
    not_yet(verdicts, "loss_per_example", "not one number")


def test_keras_tf_config_solution_passes(verdicts):
    assert "TFConfigClusterResolver" in passed(verdicts, "tf_config_solution")["detail"]


def test_keras_tf_config_wrong_own_address_only(verdicts):
    not_yet(verdicts, "tf_config_own_address_only", "every worker gets the whole cluster")


def test_keras_tf_config_wrong_every_index_zero(verdicts):
    v = not_yet(verdicts, "tf_config_index_zero", "worker 1's task index is 0")
    assert "worker i has index i" in v["hint"]


def test_keras_tf_config_wrong_json_string(verdicts):
    not_yet(verdicts, "tf_config_json_string", "return the dict itself")


def test_keras_tf_config_wrong_index_as_string(verdicts):
    not_yet(verdicts, "tf_config_index_string", "an int, not str")


def test_keras_tf_config_wrong_chief_type(verdicts):
    not_yet(verdicts, "tf_config_chief", '"type": "worker"')


def test_keras_tf_config_wrong_addresses_sorted(verdicts):
    not_yet(verdicts, "tf_config_sorted", "the same order on every worker")


def test_keras_tf_config_a_filled_in_template_passes_too(verdicts):
    passed(verdicts, "tf_config_copied_by_json")


def test_keras_worker_shard_wrong_two_workers_written_in(verdicts):
    v = not_yet(verdicts, "shard_two_workers_written_in", "on pipeline 2 of 4 it raised")
    assert "with 4 workers" in v["detail"] and "ctx (num_input_pipelines" in v["hint"]


def test_keras_worker_shard_wrong_half_the_global_batch_on_each(verdicts):
    v = not_yet(verdicts, "shard_half_the_global_batch", "batches of [8] examples, expected 4")
    assert "get_per_replica_batch_size" in v["hint"]


def test_keras_worker_shard_wrong_global_batch_from_the_notebook(verdicts):
    not_yet(verdicts, "shard_notebook_global_batch", "batches of [2] examples, expected 4")


def test_keras_worker_shard_solution_and_another_answer_pass_on_four_pipelines(verdicts):
    said = passed(verdicts, "shard_solution_on_four_pipelines")["detail"]
    assert "4 workers saw disjoint shards, 2 batches of 4 each" in said
    passed(verdicts, "shard_every_nth_on_four_pipelines")


# ---- keras_worker_shard (on two TensorFlow workers) ----------------------------------------------

def no_shard(dataset, ctx, global_batch):
    return dataset.batch(ctx.get_per_replica_batch_size(global_batch), drop_remainder=True)


def global_batch_each(dataset, ctx, global_batch):
    shard = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return shard.batch(global_batch, drop_remainder=True)


def partial_batches(dataset, ctx, global_batch):
    shard = dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return shard.batch(ctx.get_per_replica_batch_size(global_batch))


def shard_after_batch(dataset, ctx, global_batch):  # 11 batches of 4: 6 for worker 0, 5 for 1
    batches = dataset.batch(ctx.get_per_replica_batch_size(global_batch))
    return batches.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)


def same_shard_everywhere(dataset, ctx, global_batch):
    shard = dataset.shard(ctx.num_input_pipelines, 0)
    return shard.batch(ctx.get_per_replica_batch_size(global_batch), drop_remainder=True)


WRONG = [no_shard, global_batch_each, partial_batches, shard_after_batch, same_shard_everywhere,
         every_nth_by_index]  # the last is right: written otherwise, it passes on real workers


@pytest.fixture(scope="module")
def wrong_batches():
    """{answer name: the batches each worker saw}, from one launch of two workers."""
    answers = [_solution("keras_worker_shard", "shard_and_batch"), *WRONG]
    values = check.on_ranks(data_parallel_keras._shard_worker, answers, 42, 8,
                            framework="tensorflow", timeout=180)
    assert [v["worker"] for v in values] == [0, 1]
    return {fn.__name__: [v["batches"][i] for v in values] for i, fn in enumerate(answers)}


def judged(wrong_batches, name):
    with pytest.raises(check.NotYet) as wrong:
        data_parallel_keras._judge_shards(wrong_batches[name], 42, 8)
    return wrong.value.detail + " | " + wrong.value.hint


def test_keras_worker_shard_solution_passes_on_two_workers(wrong_batches):
    # what worker_shard does after its launch (the solution notebook runs it end to end)
    said = data_parallel_keras._judge_shards(wrong_batches["shard_and_batch"], 42, 8)
    assert "2 workers saw disjoint shards, 5 batches of 4 each (40 of 42 examples" in said
    assert wrong_batches["shard_and_batch"][1][0] == [1, 3, 5, 7]  # worker 1: every 2nd, from 1


def test_keras_worker_shard_another_valid_answer_passes_on_two_workers(wrong_batches):
    said = data_parallel_keras._judge_shards(wrong_batches["every_nth_by_index"], 42, 8)
    assert "2 workers saw disjoint shards, 5 batches of 4 each" in said


def test_keras_worker_shard_wrong_no_shard(wrong_batches):
    assert "worker 1 saw 40 of worker 0's examples" in judged(wrong_batches, "no_shard")


def test_keras_worker_shard_wrong_same_shard_on_every_worker(wrong_batches):
    said = judged(wrong_batches, "same_shard_everywhere")
    assert "of worker 0's examples" in said and "ctx.input_pipeline_id" in said


def test_keras_worker_shard_wrong_global_batch_on_each_worker(wrong_batches):
    said = judged(wrong_batches, "global_batch_each")
    assert "the whole global batch" in said and "8 // 2 = 4" in said


def test_keras_worker_shard_wrong_partial_batches(wrong_batches):
    said = judged(wrong_batches, "partial_batches")
    assert "batches of [1, 4] examples" in said and "drop_remainder=True" in said


def test_keras_worker_shard_wrong_uneven_batch_counts(wrong_batches):
    assert "worker 1 got an empty batch" in judged(wrong_batches, "shard_after_batch")


def test_keras_worker_shard_wrong_examples_missed():
    halves = [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]  # two workers, one batch each, 34 examples unseen
    with pytest.raises(check.NotYet, match="34 of the 42 examples reached no worker"):
        data_parallel_keras._judge_shards(halves, 42, 8)


def test_keras_worker_shard_placeholder_launches_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))

    def shard_and_batch(dataset, ctx, global_batch):
        raise NotImplementedError("your code here")  # the exercise cell as the learner finds it

    start = time.perf_counter()
    verdict = data_parallel_keras.worker_shard(shard_and_batch)
    assert not verdict and "not written yet" in verdict.detail
    assert time.perf_counter() - start < 5, "a placeholder must not start TensorFlow workers"


if __name__ == "__main__":  # the subprocess: TensorFlow here, never in the pytest process
    results = {}
    for name, run in CASES.items():
        results[name] = dataclasses.asdict(run())
    print("VERDICTS " + json.dumps(results), flush=True)

"""Keras ``fit`` under MultiWorkerMirroredStrategy on labkit workers (notebook 02 Keras, section 5).

One launch (TensorFlow starts slowly) gives every test here its facts: on two workers with
``TF_USE_LEGACY_KERAS=1``, Keras 3's ``fit`` is tried and fails; then tf_keras' ``fit`` with
``BackupAndRestore`` runs while worker 1 kills itself in the middle of an epoch on the first
attempt; torchrun (``max_restarts=1``) restarts both workers, the fit resumes from the backup,
and an uninterrupted fit follows in the same processes for comparison. TensorFlow is imported
only in the workers: this test process must stay torch-and-TensorFlow-safe.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile

import cloudpickle
import numpy as np
import pytest

from labkit import launch

# Ship this module's functions by value, as a notebook's are.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

EPOCHS = 3
KILL_EPOCH, KILL_STEP = 1, 2  # worker 1 dies after step 2 of the second epoch, first attempt only


def fit(strategy, epochs, backup_dir=None, kill_marker=None):
    """tf.keras fit on a tiny MLP; BackupAndRestore into ``backup_dir``; maybe kill worker 1."""
    import tensorflow as tf

    task = strategy.cluster_resolver.task_id  # this worker's index in TF_CONFIG
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).with_options(options)
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((8,)),
                                     tf.keras.layers.Dense(16, activation="relu"),
                                     tf.keras.layers.Dense(2)])
        model.compile(tf.keras.optimizers.Adam(1e-2),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    epochs_run: list[int] = []
    callbacks = [tf.keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))]
    if backup_dir:
        callbacks.insert(0, tf.keras.callbacks.BackupAndRestore(backup_dir))
    if kill_marker and task == 1 and not os.path.exists(kill_marker):
        def kill(step, logs):
            if (epochs_run[-1], step) == (KILL_EPOCH, KILL_STEP):
                open(kill_marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
        callbacks.append(tf.keras.callbacks.LambdaCallback(on_train_batch_end=kill))
    history = model.fit(data, epochs=epochs, verbose=0, callbacks=callbacks)
    return {"weights": [w.numpy() for w in model.weights], "epochs_run": epochs_run,
            "loss": history.history["loss"]}


def keras3_fit_error(strategy) -> str:
    """Keras 3's fit under MultiWorkerMirroredStrategy: the error text, or '' if it worked."""
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = tf.data.Dataset.from_tensor_slices(
        (np.zeros((64, 8), "float32"), np.zeros(64, "int64"))).batch(16)
    try:
        model.fit(data, epochs=1, verbose=0)
    except ValueError as err:
        return str(err)
    return ""


def worker(folder):
    import tensorflow as tf

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    with open(os.path.join(folder, f"tf_config-{attempt}-{rank}.json"), "w") as f:
        f.write(os.environ["TF_CONFIG"])
    # One strategy per process: a second one resets the collectives under a peer still using them.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the strategy catches it: torchrun's stop
    resumed = fit(strategy, EPOCHS, os.path.join(folder, "backup"), os.path.join(folder, "killed"))
    reference = fit(strategy, EPOCHS)  # the same training, uninterrupted, in the same processes
    # Last: a failed Keras 3 fit may leave the workers' collectives out of step with each other.
    keras3 = keras3_fit_error(strategy)
    temp = tempfile.gettempdir()
    return {"attempt": attempt, "tf_keras": tf.keras.__name__, "keras3_error": keras3,
            "resumed": resumed, "reference": reference, "torch_imported": "torch" in sys.modules,
            "temp": temp, "autograph_files": sorted(
                n for n in os.listdir(temp) if n.startswith("__autograph_generated_file"))}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keras-fit")
    tf_before = "tensorflow" in sys.modules
    result = launch(worker, str(folder), nproc=2, framework="tensorflow", max_restarts=1,
                    env={"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"},
                    show_ranks=[], timeout=300)
    assert ("tensorflow" in sys.modules) == tf_before, "the test process imported TensorFlow"
    return result.values, folder


@pytest.mark.slow
def test_keras3_fit_fails_under_multiworker_strategy(run):
    values, _ = run
    for v in values:
        assert v["keras3_error"], ("Keras 3's fit now works under MultiWorkerMirroredStrategy: "
                                   "notebook 02 Keras (section 5) says it fails; update it")
        assert "PerReplica" in v["keras3_error"] and "unsupported type" in v["keras3_error"]
        assert v["tf_keras"].startswith("tf_keras"), "TF_USE_LEGACY_KERAS=1: tf.keras is tf_keras"
        assert not v["torch_imported"], "a TensorFlow worker imported torch"


@pytest.mark.slow
def test_fit_gives_both_workers_the_same_weights_bit_for_bit(run):
    values, _ = run
    for key in ("reference", "resumed"):
        (w0, w1) = (v[key]["weights"] for v in values)
        assert all(np.array_equal(a, b) for a, b in zip(w0, w1, strict=True)), key
    assert values[0]["reference"]["epochs_run"] == list(range(EPOCHS))
    loss = values[0]["reference"]["loss"]
    assert np.all(np.isfinite(loss)) and loss[-1] < loss[0]


@pytest.mark.slow
def test_killed_worker_restarts_and_fit_resumes_from_the_backup(run):
    values, folder = run
    assert [v["attempt"] for v in values] == [1, 1], "torchrun restarts every worker once"
    assert (folder / "killed").exists()
    # BackupAndRestore saves at the end of each epoch: the killed epoch runs again, whole.
    assert all(v["resumed"]["epochs_run"] == list(range(KILL_EPOCH, EPOCHS)) for v in values)
    resumed, reference = values[0]["resumed"], values[0]["reference"]
    for a, b in zip(resumed["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(resumed["loss"], reference["loss"][KILL_EPOCH:], rtol=1e-5)


@pytest.mark.slow
def test_restart_reuses_the_tf_config_ports(run):
    _, folder = run
    for rank in (0, 1):
        first, second = (json.loads((folder / f"tf_config-{a}-{rank}.json").read_text())
                         for a in (0, 1))
        assert first == second and first["task"]["index"] == rank
    assert len(set(first["cluster"]["worker"])) == 2


@pytest.mark.slow
def test_autograph_files_stay_in_the_run_folder_and_go_with_it(run):
    # AutoGraph removes its files at exit; the killed worker never got there. Its files and the
    # others' were written in the run folder, which the launch removed.
    values, folder = run
    temps = {v["temp"] for v in values}
    assert len(temps) == 1 and "labkit-run-" in temps.pop().replace(os.sep, "/")
    assert all(v["autograph_files"] for v in values), "fit converts functions with AutoGraph"
    assert not os.path.exists(values[0]["temp"])

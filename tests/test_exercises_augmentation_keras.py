"""Notebook 01 Keras's graders: the reference solutions pass, known wrong answers get their hints.

The graders import TensorFlow, which must not share a process with torchvision (other tests
import it): every case runs in one subprocess,
``python -m tests.test_exercises_augmentation_keras``, which prints each case's verdict as JSON;
the tests below read them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEM = "01_vgg16_data_augmentation_keras"
CASES = {}  # name -> a function that runs one grader on one answer, in the subprocess
HEAD_LR, FINETUNE_LR = 1e-2, 1e-4


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _namespace():
    """What the solution blocks use from the notebook: keras, layers, config, compile_model."""
    import keras

    from labkit.augment import AugmentConfig

    def compile_model(model, learning_rate):  # the notebook's, without its metrics
        model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    return {"__name__": "solution_block", "keras": keras, "layers": keras.layers,
            "config": AugmentConfig.strong(), "compile_model": compile_model,
            "HEAD_LR": HEAD_LR, "FINETUNE_LR": FINETUNE_LR}


def _solution(ex_id: str, name: str):
    from labkit import exercises

    namespace = _namespace()
    exec(exercises.solution_blocks(STEM)[ex_id], namespace)
    return namespace[name]


def _pipeline(*steps):
    import keras

    return keras.Sequential([keras.Input((None, None, 3)), *steps])


# ---- keras_flip_rotate ---------------------------------------------------------------------------

@case
def flip_rotate_solution():
    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_solution("keras_flip_rotate", "my_flip_rotate"), degrees=30)


@case
def flip_rotate_radians():
    import math

    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(layers.RandomFlip("horizontal"),
                                          layers.RandomRotation(math.radians(30))), degrees=30)


@case
def flip_rotate_half_turns():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(layers.RandomFlip("horizontal"),
                                          layers.RandomRotation(30 / 180)), degrees=30)


@case
def flip_rotate_one_way():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(layers.RandomFlip("horizontal"),
                                          layers.RandomRotation((0, 30 / 360))), degrees=30)


@case
def flip_rotate_vertical():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(layers.RandomFlip(),
                                          layers.RandomRotation(30 / 360)), degrees=30)


@case
def flip_rotate_no_flip():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(layers.RandomRotation(30 / 360)), degrees=30)


@case
def flip_rotate_rescales():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(layers.Rescaling(1 / 255),
                                          layers.RandomFlip("horizontal"),
                                          layers.RandomRotation(30 / 360)), degrees=30)


@case
def flip_rotate_starting_point():
    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(), degrees=30)


# ---- keras_transfer_stages -----------------------------------------------------------------------

@case
def transfer_stages_solution():
    from labkit.exercises import augmentation_keras as exercise

    return exercise.transfer_stages(_solution("keras_transfer_stages", "prepare_stage"),
                                    HEAD_LR, FINETUNE_LR)


@case
def transfer_stages_no_recompile():
    from labkit.exercises import augmentation_keras as exercise

    compile_model = _namespace()["compile_model"]

    def prepare_stage(model, base, stage):
        base.trainable = stage == "finetune"
        if stage == "head":  # compiled once only: the fine-tuning stage keeps the head's setup
            compile_model(model, HEAD_LR)

    return exercise.transfer_stages(prepare_stage, HEAD_LR, FINETUNE_LR)


@case
def transfer_stages_same_rate():
    from labkit.exercises import augmentation_keras as exercise

    compile_model = _namespace()["compile_model"]

    def prepare_stage(model, base, stage):
        base.trainable = stage == "finetune"
        compile_model(model, HEAD_LR)

    return exercise.transfer_stages(prepare_stage, HEAD_LR, FINETUNE_LR)


@case
def transfer_stages_nothing_frozen():
    from labkit.exercises import augmentation_keras as exercise

    compile_model = _namespace()["compile_model"]

    def prepare_stage(model, base, stage):
        compile_model(model, HEAD_LR if stage == "head" else FINETUNE_LR)

    return exercise.transfer_stages(prepare_stage, HEAD_LR, FINETUNE_LR)


@case
def transfer_stages_model_frozen():
    from labkit.exercises import augmentation_keras as exercise

    compile_model = _namespace()["compile_model"]

    def prepare_stage(model, base, stage):
        model.trainable = stage == "finetune"  # the whole model, head included
        compile_model(model, HEAD_LR if stage == "head" else FINETUNE_LR)

    return exercise.transfer_stages(prepare_stage, HEAD_LR, FINETUNE_LR)


@case
def transfer_stages_not_compiled():
    from labkit.exercises import augmentation_keras as exercise

    def prepare_stage(model, base, stage):
        base.trainable = stage == "finetune"

    return exercise.transfer_stages(prepare_stage, HEAD_LR, FINETUNE_LR)


# ---- keras_brightness ----------------------------------------------------------------------------

@case
def brightness_solution():
    from labkit.exercises import augmentation_keras as exercise

    return exercise.brightness(_solution("keras_brightness", "my_augment"))


@case
def brightness_no_value_range():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.brightness(_pipeline(layers.RandomFlip("horizontal"),
                                         layers.RandomBrightness(0.1)))


@case
def brightness_missing():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.brightness(_pipeline(layers.RandomFlip("horizontal")))


@case
def brightness_too_strong():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.brightness(_pipeline(layers.RandomBrightness(0.3, value_range=(0, 1))))


@case
def brightness_zero():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.brightness(_pipeline(layers.RandomBrightness(0.0, value_range=(0, 1))))


@case
def brightness_one_way():
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.brightness(_pipeline(layers.RandomBrightness((0.0, 0.1),
                                                                 value_range=(0, 1))))


@case
def brightness_pair_factor():  # a valid answer written otherwise: the range as a pair
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.brightness(_pipeline(layers.RandomFlip("horizontal"),
                                         layers.RandomBrightness((-0.1, 0.1),
                                                                 value_range=(0.0, 1.0))))


@case
def flip_rotate_pair_factor():  # a valid answer written otherwise: the turns as a pair
    from keras import layers

    from labkit.exercises import augmentation_keras as exercise

    return exercise.flip_rotate(_pipeline(layers.RandomRotation((-30 / 360, 30 / 360)),
                                          layers.RandomFlip(mode="horizontal")), degrees=30)


@case
def transfer_stages_layer_by_layer():  # a valid answer written otherwise: each layer of the base
    from labkit.exercises import augmentation_keras as exercise

    compile_model = _namespace()["compile_model"]

    def prepare_stage(model, base, stage):
        for layer in base.layers:
            layer.trainable = stage != "head"
        base.trainable = stage != "head"
        compile_model(model, {"head": HEAD_LR, "finetune": FINETUNE_LR}[stage])

    return exercise.transfer_stages(prepare_stage, HEAD_LR, FINETUNE_LR)


# ---- the subprocess and the tests ----------------------------------------------------------------

@pytest.fixture(scope="module")
def verdicts():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tests.test_exercises_augmentation_keras"],
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


def test_keras_flip_rotate_solution_passes(verdicts):
    assert "flips left-right" in passed(verdicts, "flip_rotate_solution")["detail"]


def test_keras_flip_rotate_wrong_radians_instead_of_turns(verdicts):
    v = not_yet(verdicts, "flip_rotate_radians", "fractions of a full turn, not in radians")
    assert "it turns by up to 1" in v["detail"]  # ±188°: all the way round


def test_keras_flip_rotate_wrong_half_turns(verdicts):
    not_yet(verdicts, "flip_rotate_half_turns", "it turns by up to 6")  # ±60°


def test_keras_flip_rotate_wrong_one_way(verdicts):
    not_yet(verdicts, "flip_rotate_one_way", "a single factor f turns both ways")


def test_keras_flip_rotate_wrong_vertical_flip(verdicts):
    not_yet(verdicts, "flip_rotate_vertical", "flips upside down too")


def test_keras_flip_rotate_wrong_no_flip(verdicts):
    not_yet(verdicts, "flip_rotate_no_flip", "no RandomFlip layer")


def test_keras_flip_rotate_wrong_rescaling(verdicts):
    not_yet(verdicts, "flip_rotate_rescales", "changes the images at inference")


def test_keras_flip_rotate_wrong_starting_point_says_what_is_missing(verdicts):
    not_yet(verdicts, "flip_rotate_starting_point", "no RandomFlip layer among []")


def test_keras_flip_rotate_a_pair_of_factors_passes_too(verdicts):
    passed(verdicts, "flip_rotate_pair_factor")


def test_keras_transfer_stages_solution_passes(verdicts):
    assert "compiled again" in passed(verdicts, "transfer_stages_solution")["detail"]


def test_keras_transfer_stages_freezing_each_layer_passes_too(verdicts):
    passed(verdicts, "transfer_stages_layer_by_layer")


def test_keras_transfer_stages_wrong_no_recompile(verdicts):
    not_yet(verdicts, "transfer_stages_no_recompile", "trainable takes effect when the model is "
                                                      "compiled")


def test_keras_transfer_stages_wrong_same_learning_rate(verdicts):
    not_yet(verdicts, "transfer_stages_same_rate", "not FINETUNE_LR")


def test_keras_transfer_stages_wrong_nothing_frozen(verdicts):
    not_yet(verdicts, "transfer_stages_nothing_frozen", "base.trainable = False")


def test_keras_transfer_stages_wrong_head_frozen_too(verdicts):
    not_yet(verdicts, "transfer_stages_model_frozen", "the head is frozen too")


def test_keras_transfer_stages_wrong_not_compiled(verdicts):
    not_yet(verdicts, "transfer_stages_not_compiled", "not compiled")


def test_keras_brightness_solution_passes(verdicts):
    assert "pixels stay on 0..1" in passed(verdicts, "brightness_solution")["detail"]


def test_keras_brightness_wrong_value_range(verdicts):
    not_yet(verdicts, "brightness_no_value_range", "value_range=(0, 1)")


def test_keras_brightness_wrong_missing_layer(verdicts):
    not_yet(verdicts, "brightness_missing", "no RandomBrightness layer")


def test_keras_brightness_wrong_too_strong(verdicts):
    not_yet(verdicts, "brightness_too_strong", "more than 0.1 of the range")


def test_keras_brightness_wrong_factor_zero(verdicts):
    not_yet(verdicts, "brightness_zero", "never changes")


def test_keras_brightness_wrong_one_way_only(verdicts):
    v = not_yet(verdicts, "brightness_one_way", "one way only")
    assert "(0, 0.1) only lightens" in v["hint"]


def test_keras_brightness_a_pair_of_factors_passes_too(verdicts):
    passed(verdicts, "brightness_pair_factor")


if __name__ == "__main__":  # the subprocess: TensorFlow here, never in the pytest process
    results = {}
    for name, run in CASES.items():
        results[name] = dataclasses.asdict(run())
    print("VERDICTS " + json.dumps(results), flush=True)

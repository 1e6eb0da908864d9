"""Notebook 01 Keras's exercises: flip and turn in Keras' units, transfer's two stages, brightness.

Each grader runs the learner's answer in the kernel (TensorFlow is imported there already) and
returns what it verified, or raises :class:`labkit.check.NotYet` with what is wrong and a hint.
Graders import Keras and NumPy when they run, never PyTorch.
"""

from __future__ import annotations

from ..check import NotYet, exercise

NOTEBOOK = "01"


def _flat_layers(pipeline) -> list:
    """The layers of a pipeline, nested Sequentials opened up (a lone layer is its own list)."""
    found = []
    for layer in getattr(pipeline, "layers", [pipeline]):
        found += _flat_layers(layer) if hasattr(layer, "layers") else [layer]
    return found


def _call(pipeline, batch, training: bool):
    import numpy as np

    try:
        return np.asarray(pipeline(batch, training=training))
    except Exception as exc:  # the learner's pipeline may fail in any way: say how
        raise NotYet(f"calling it on a float32 batch of shape {batch.shape} failed: "
                     f"{type(exc).__name__}: {str(exc).strip()[:200]}",
                     "try it on a few images first: my_pipeline(x_train[:4], training=True); "
                     "every layer must take (batch, height, width, 3)") from None


def _turns(rotations, draws: int = 256):
    """Angles in degrees by which ``rotations`` turned a dot straight above the centre."""
    import numpy as np

    size, radius = 65, 24
    dots = np.zeros((draws, size, size, 3), "float32")
    dots[:, size // 2 - radius, size // 2, :] = 1.0  # at 90 degrees; a left-right flip keeps it
    out = dots
    for layer in rotations:
        out = np.asarray(layer(out, training=True))
    row, col = np.divmod(out[..., 0].reshape(draws, -1).argmax(axis=1), size)
    angle = np.degrees(np.arctan2(size // 2 - row, col - size // 2))
    return (angle - 90 + 180) % 360 - 180  # the turn, from -180 to 180


@exercise("keras_flip_rotate", notebook=NOTEBOOK, title="flip and turn, in Keras' units")
def flip_rotate(pipeline, degrees: float = 30) -> str:
    """Exercise: a Keras pipeline that flips left-right and turns by up to ±``degrees``.

    It is called on a batch in training mode (same shape and dtype, random), at inference
    (unchanged), and its turns are measured on a dot: Keras counts rotations in turns.

    Example::

        >>> exercise.flip_rotate(my_flip_rotate, degrees=30)
        [pass] flip and turn, in Keras' units: flips left-right, turns -30° .. +30° ...
    """
    import keras
    import numpy as np

    steps = _flat_layers(pipeline)
    names = [type(s).__name__ for s in steps]
    flips = [s for s in steps if isinstance(s, keras.layers.RandomFlip)]
    if not flips:
        raise NotYet(f"no RandomFlip layer among {names}",
                     'add layers.RandomFlip("horizontal"): left-right, with probability 1/2')
    if any("vertical" in f.mode for f in flips):
        raise NotYet(f"it flips upside down too (mode {flips[0].mode!r})",
                     'use RandomFlip("horizontal"): left-right only, as AugmentConfig\'s flip; '
                     "upside down, a 6 would become a 9")
    rotations = [s for s in steps if isinstance(s, keras.layers.RandomRotation)]
    if not rotations:
        raise NotYet(f"no RandomRotation layer among {names}",
                     f"add layers.RandomRotation(...) for turns of up to ±{degrees:g}°")
    batch = np.random.default_rng(0).random((8, 32, 32, 3), dtype=np.float32)
    first, second = _call(pipeline, batch, True), _call(pipeline, batch, True)
    if first.shape != batch.shape or first.dtype != batch.dtype:
        raise NotYet(f"a {batch.dtype} batch of shape {batch.shape} came out {first.dtype} "
                     f"{first.shape}", "flips and turns keep the size and the pixel type: "
                                       "leave out layers that resize or rescale")
    if not np.array_equal(_call(pipeline, batch, False), batch):
        raise NotYet("it changes the images at inference (training=False)",
                     "only random augmentation layers belong in it: they pass images through "
                     "unchanged in evaluate and predict")
    turns = _turns(rotations)
    low, high = turns.min(), turns.max()
    if max(-low, high) > 1.15 * degrees + 2:
        raise NotYet(f"it turns by up to {max(-low, high):.0f}°, not {degrees:g}°",
                     f"RandomRotation counts in fractions of a full turn, not in radians: "
                     f"±{degrees:g}° is {degrees:g} / 360")
    if high < 0.8 * degrees or -low < 0.8 * degrees:
        one_way = high < 0.3 * degrees or -low < 0.3 * degrees
        raise NotYet(f"it turns by {low:.0f}° to {high:.0f}°, expected -{degrees:g}° to "
                     f"+{degrees:g}°",
                     "a single factor f turns both ways, -f to +f; a pair (lower, upper) is "
                     "the range itself" if one_way else
                     f"the factor is a fraction of a full turn: {degrees:g} / 360")
    if np.array_equal(first, second):
        raise NotYet("two calls in training mode gave the same images: nothing random happens",
                     "call it with training=True, and keep the layers' default probabilities")
    return (f"flips left-right, turns {low:.0f}° .. +{high:.0f}° (expected ±{degrees:g}°), "
            f"keeps shape and dtype, unchanged at inference")


def _tiny_transfer_model():
    """A two-layer 'base' and a Dense 'head' on top of it, as ``classifier`` builds them."""
    import keras

    init = keras.initializers.GlorotUniform(seed=0)  # its own seed: the kernel's stays as it is
    base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, kernel_initializer=init,
                                                                   name="conv")], name="base")
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3, kernel_initializer=init, name="head")(
        base(inputs, training=False))
    return keras.Model(inputs, outputs), base


def _learning_rate(model) -> float | None:
    import keras

    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def _one_step(model, base) -> tuple[bool, bool]:
    """Train one batch; whether the base's weights and the head's changed."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 6)).astype("float32"), rng.integers(0, 3, 8)
    head = model.get_layer("head")
    before = [w.copy() for w in base.get_weights()], [w.copy() for w in head.get_weights()]
    model.train_on_batch(x, y)
    after = base.get_weights(), head.get_weights()
    return tuple(any(not np.array_equal(a, b) for a, b in zip(old, new, strict=True))
                 for old, new in zip(before, after, strict=True))


@exercise("keras_transfer_stages", notebook=NOTEBOOK, title="freeze, train the head, fine-tune")
def transfer_stages(prepare_stage, head_lr: float, finetune_lr: float) -> str:
    """Exercise: ``prepare_stage(model, base, stage)`` sets up "head" and "finetune" training.

    Run on a tiny base-and-head model: after "head" only the head may train, compiled at
    ``head_lr``; after "finetune" everything trains, compiled again at ``finetune_lr``. Each
    stage trains one batch to show which weights move.

    Example::

        >>> exercise.transfer_stages(prepare_stage, HEAD_LR, FINETUNE_LR)
        [pass] freeze, train the head, fine-tune: "head": only the head trained (lr 0.01) ...
    """
    import math

    model, base = _tiny_transfer_model()
    prepare_stage(model, base, "head")
    if base.trainable_weights:
        raise NotYet(f'after "head", {len(base.trainable_weights)} arrays of the base still train',
                     "freeze the base with base.trainable = False")
    if not model.trainable_weights:
        raise NotYet('after "head", nothing trains: the head is frozen too',
                     "freeze only the base; the new head must learn")
    head_optimizer = getattr(model, "optimizer", None)
    if head_optimizer is None or _learning_rate(model) is None:
        raise NotYet('after "head", the model is not compiled',
                     "compile after changing trainable: compile_model(model, HEAD_LR)")
    if not math.isclose(_learning_rate(model), head_lr, rel_tol=1e-5):
        raise NotYet(f'"head" compiled at learning rate {_learning_rate(model):g}, not HEAD_LR '
                     f"= {head_lr:g}", "compile the head's stage with HEAD_LR")
    base_moved, head_moved = _one_step(model, base)
    if base_moved or not head_moved:
        raise NotYet(f'training one batch after "head" moved the base: {base_moved}, the head: '
                     f"{head_moved}", "only the head should move: freeze the base, then compile")
    prepare_stage(model, base, "finetune")
    if not base.trainable or len(model.trainable_weights) != len(model.weights):
        raise NotYet('after "finetune", parts of the network are still frozen',
                     "unfreeze the base with base.trainable = True")
    if getattr(model, "optimizer", None) is head_optimizer:
        raise NotYet('"finetune" did not compile the model again',
                     "trainable takes effect when the model is compiled: compile again after "
                     "unfreezing, with the fine-tuning learning rate")
    rate = _learning_rate(model)
    if not math.isclose(rate, finetune_lr, rel_tol=1e-5):
        raise NotYet(f'"finetune" compiled at learning rate {rate:g}, not FINETUNE_LR = '
                     f"{finetune_lr:g}",
                     "fine-tune about ten times slower than the head trained, so the pretrained "
                     "features adapt instead of being overwritten: FINETUNE_LR")
    base_moved, _ = _one_step(model, base)
    if not base_moved:
        raise NotYet('training one batch after "finetune" left the base unchanged',
                     "unfreeze the base (base.trainable = True), then compile")
    return (f'"head": only the head trained (lr {head_lr:g}); "finetune": compiled again, '
            f"everything trained (lr {finetune_lr:g})")


@exercise("keras_brightness", notebook=NOTEBOOK, title="brightness for pixels on 0..1")
def brightness(pipeline, factor: float = 0.1) -> str:
    """Exercise: a ``RandomBrightness`` layer for pixels on 0..1, up to ``factor`` of the range.

    Tried on grey images (0.5 everywhere) in training mode: the change must stay inside 0..1,
    be about ``factor`` at most, and go both ways (some images lighter, some darker).

    Example::

        >>> exercise.brightness(my_augment)
        [pass] brightness for pixels on 0..1: brightness changes by up to 0.1 ...
    """
    import keras
    import numpy as np

    found = [s for s in _flat_layers(pipeline) if isinstance(s, keras.layers.RandomBrightness)]
    if not found:
        raise NotYet("there is no RandomBrightness layer in the pipeline",
                     "add layers.RandomBrightness(...) to the list of layers")
    grey = np.full((64, 8, 8, 3), 0.5, "float32")
    shown = _call(pipeline, grey, True)
    change = np.abs(shown.mean(axis=(1, 2, 3)) - 0.5)
    if shown.max() > 1 or change.max() > 0.3:  # 0.1 x 255 on pixels on 0..1: white or black
        raise NotYet(f"the brightness jumps far outside 0..1 (by up to {change.max():.2f})",
                     "Keras assumes pixels on 0..255 unless you pass value_range=(0, 1)")
    if change.max() < 1e-3:
        raise NotYet("the brightness never changes",
                     f"the factor is the largest change as a fraction of the value range, "
                     f"e.g. {factor:g}")
    if change.max() > 1.5 * factor:
        raise NotYet(f"the change reaches {change.max():.2f}, more than {factor:g} of the range",
                     f"factor={factor:g}")
    if change.max() < 0.6 * factor:
        raise NotYet(f"the change stays below {change.max():.3f}, far under {factor:g} of the "
                     f"range", f"factor={factor:g}: the largest change, as a fraction of 0..1")
    signed = shown.mean(axis=(1, 2, 3)) - 0.5
    lighter, darker = int((signed > 1e-3).sum()), int((signed < -1e-3).sum())
    if not lighter or not darker:
        raise NotYet(f"of {len(grey)} grey images, {lighter} came out lighter and {darker} "
                     f"darker: it changes the brightness one way only",
                     f"a single factor f changes it by -f to +f ({factor:g}); a pair (lower, "
                     f"upper) is the range itself, so (0, {factor:g}) only lightens")
    return (f"brightness changes by up to {change.max():.3f} (asked: {factor:g}), "
            f"pixels stay on 0..1")

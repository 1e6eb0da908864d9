"""The claim notebook 01 makes, at a size CI can afford: augmentation narrows the overfitting gap.

Same VGG16 (width 1/8, BatchNorm), same start, same batches; 30 images per class of three
generated shapes. Without augmentation it memorises the training set (train accuracy 1.0) and
validation lags far behind; with flips, rotations, crops and shifts the gap nearly closes.
Seeded, so the run is the same every time on a given machine (about 50 s on 2 cores).
"""

import pytest

from labkit import augment, data
from labkit.train import augmentation_experiment

CLASSES = ["circle", "square", "cross"]
PER_CLASS, VAL_PER_CLASS = 30, 60
STRONG = augment.AugmentConfig.strong()  # the notebook's setting


@pytest.mark.slow
def test_augmentation_narrows_the_train_validation_gap():
    full = data.shapes(len(CLASSES) * (PER_CLASS + VAL_PER_CLASS), image_size=32, seed=0,
                       classes=CLASSES)
    train, val = data.split(full, val_fraction=VAL_PER_CLASS / (PER_CLASS + VAL_PER_CLASS), seed=0)
    runs = augmentation_experiment(train, val, image_size=32, epochs=30, augment_config=STRONG,
                                   seed=0)
    last = {kind: history[-1] for kind, history in runs.items()}
    gap = {kind: h["train_acc"] - h["val_acc"] for kind, h in last.items()}
    summary = {k: (round(h["train_acc"], 3), round(h["val_acc"], 3), round(gap[k], 3))
               for k, h in last.items()}
    print("train acc, val acc, gap:", summary)
    assert last["none"]["train_acc"] >= 0.95, f"without augmentation it should memorise: {summary}"
    assert gap["standard"] < gap["none"] - 0.15, f"the gap did not narrow enough: {summary}"
    assert last["standard"]["val_acc"] >= last["none"]["val_acc"] - 0.1, summary

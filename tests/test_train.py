"""labkit.train: the shared loop learns, records a history, and refuses bad settings."""

import functools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from labkit.train import (
    LR_RULES,
    TrainConfig,
    evaluate,
    fit,
    large_batch_experiment,
    linear_scaled_lr,
    warmup_lr,
)


def blobs(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + 2.5 * y[:, None].float()
    return TensorDataset(x, y)


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def test_fit_learns_and_records_every_epoch():
    train, val = DataLoader(blobs(), batch_size=32, shuffle=True), DataLoader(blobs(seed=1), 64)
    seen = []
    history = fit(tiny_model(), train, val, TrainConfig(epochs=4, lr=0.05, warmup_epochs=2),
                  on_epoch=lambda h: seen.append(len(h)))
    assert seen == [1, 2, 3, 4]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert history[0]["lr"] == pytest.approx(0.005) and history[-1]["lr"] == pytest.approx(0.05)
    assert history[-1]["val_acc"] > 0.9
    assert set(history[0]) == {"epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr",
                               "seconds"}


def test_train_eval_loader_measures_train_accuracy_like_validation():
    model = tiny_model()
    train = DataLoader(blobs(), batch_size=32)
    history = fit(model, train, train, TrainConfig(epochs=1), train_eval_loader=train)
    assert history[0]["train_acc"] == history[0]["val_acc"]
    assert evaluate(model, train, torch.device("cpu"))[1] == history[0]["val_acc"]


def test_bf16_autocast_runs_on_cpu():
    history = fit(tiny_model(), DataLoader(blobs(), 64), DataLoader(blobs(), 64),
                  TrainConfig(epochs=1, amp="bf16"))
    assert history[0]["val_loss"] > 0


def test_fit_leaves_a_frozen_batch_norm_base_exactly_as_it_was():
    from labkit.models import freeze, vgg16

    torch.manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 3, (16,))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    model = vgg16(3, width=1 / 16, image_size=32, batch_norm=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit(model, loader, loader, TrainConfig(epochs=1, lr=1e-3, optimizer="adam"))
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert any(k.endswith("running_mean") for k in changed)  # unfrozen: statistics move
    before = {k: v.clone() for k, v in model.state_dict().items()}
    freeze(model.features)
    fit(model, loader, loader, TrainConfig(epochs=1, lr=1e-3, optimizer="adam"))
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(k.startswith("classifier.") for k in changed)


def test_everything_frozen_is_a_clear_error():
    model = tiny_model()
    for p in model.parameters():
        p.requires_grad = False
    with pytest.raises(ValueError, match="every parameter is frozen"):
        fit(model, DataLoader(blobs(), 64), DataLoader(blobs(), 64), TrainConfig(epochs=1))


@pytest.mark.parametrize("kwargs, message", [
    (dict(epochs=0), "epochs must be >= 1"),
    (dict(lr=0), "lr must be > 0"),
    (dict(optimizer="lamb"), "optimizer must be 'sgd' or 'adam'"),
    (dict(amp="fp8"), "amp must be None, 'bf16' or 'fp16'"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


# ---- large-batch training: linear scaling and warm-up --------------------------------------


@functools.lru_cache(maxsize=1)
def digit_split():
    """300 16x16 digits split 240/60: big enough to train on, small enough for seconds."""
    from labkit import data

    return data.split(data.take(data.digits(image_size=16), 30), 0.2)


def batch_rows():
    train, val = digit_split()
    return large_batch_experiment(train, val, [16, 64], base_batch=16, base_lr=0.05, epochs=1,
                                  rules=("same lr", "linear scaling + warmup"))


@functools.lru_cache(maxsize=1)
def first_batch_rows():
    return batch_rows()


def test_lr_rules_are_the_three_of_the_lesson():
    assert LR_RULES == ("same lr", "linear scaling", "linear scaling + warmup")


@pytest.mark.parametrize("base_lr, base_batch, batch, expected", [
    (0.1, 256, 8192, 3.2),
    (0.05, 16, 64, 0.2),
    (0.1, 256, 128, 0.05),
    (0.01, 32, 32, 0.01),
])
def test_linear_scaled_lr_multiplies_the_lr_by_the_batch_ratio(base_lr, base_batch, batch,
                                                               expected):
    assert linear_scaled_lr(base_lr, base_batch, batch) == pytest.approx(expected)


@pytest.mark.parametrize("args", [(0, 16, 64), (-0.1, 16, 64), (0.1, 0, 64), (0.1, 16, 0)])
def test_linear_scaled_lr_rejects_non_positive_values(args):
    with pytest.raises(ValueError, match="need base_lr > 0 and batches >= 1"):
        linear_scaled_lr(*args)


def test_warmup_lr_ramps_linearly_then_holds():
    assert [warmup_lr(1.0, s, 4) for s in range(6)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    assert warmup_lr(0.2, 0, 10) == pytest.approx(0.02)
    assert warmup_lr(0.3, 0, 0) == 0.3, "no warm-up steps: the target from the first step"


@pytest.mark.parametrize("kwargs, message", [
    (dict(rules=("cosine",)), r"rules must be some of \('same lr'"),
    (dict(rules=()), "rules must be some of"),
    (dict(epochs=0), "need epochs >= 1"),
    (dict(batches=[16, 241]), r"global batches \[241\] do not fit the 240 training samples"),
    (dict(batches=[0]), r"global batches \[0\] do not fit"),
    (dict(base_lr=0.0), "need base_lr > 0"),
    (dict(base_lr=-0.05), "need base_lr > 0"),
])
def test_large_batch_experiment_bad_settings(kwargs, message):
    train, val = digit_split()
    settings = dict(batches=[16], base_batch=16, base_lr=0.05, epochs=1,
                    rules=("linear scaling",)) | kwargs
    with pytest.raises(ValueError, match=message):
        large_batch_experiment(train, val, settings.pop("batches"), **settings)


def test_large_batch_experiment_rows_scale_the_lr_and_count_the_steps():
    rows = first_batch_rows()
    assert [(r["global_batch"], r["rule"]) for r in rows] == [
        (16, "same lr"), (16, "linear scaling + warmup"),
        (64, "same lr"), (64, "linear scaling + warmup")]
    assert all(set(r) == {"global_batch", "rule", "lr", "steps", "val_acc"} for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx([0.05, 0.05, 0.05, 0.2])
    assert [r["steps"] for r in rows] == [240 // 16, 240 // 16, 240 // 64, 240 // 64]
    assert all(0.0 <= r["val_acc"] <= 1.0 for r in rows)
    assert rows[0]["val_acc"] > 0.2, "15 steps at batch 16 learn more than chance (0.1)"


def test_large_batch_experiment_is_deterministic():
    assert batch_rows() == first_batch_rows()


def test_large_batch_experiment_trains_each_distinct_run_once():
    from labkit.models import small_cnn

    built = []

    def make():
        built.append(1)
        return small_cnn(10, image_size=16, width=4)

    train_set, val_set = digit_split()
    rows = large_batch_experiment(train_set, val_set, [16, 64], base_batch=16, base_lr=0.05,
                                  epochs=1, rules=("same lr", "linear scaling"), model_fn=make)
    # at the base batch both rules use lr 0.05 with no warm-up: one run serves both rows
    assert len(built) == 1 + 3 and len(rows) == 4  # the initial weights, then three runs
    assert rows[0]["val_acc"] == rows[1]["val_acc"] and rows[1]["rule"] == "linear scaling"
    assert rows[2]["lr"] == 0.05 and rows[3]["lr"] == pytest.approx(0.2)


def test_train_val_gap_measures_both_sets_alike_in_eval_mode():
    from labkit import data
    from labkit.models import small_cnn
    from labkit.train import train_val_gap

    images = data.shapes(24, image_size=16, seed=0, classes=["circle", "square"])
    train, val = data.split(images, val_fraction=0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(small_cnn(2, image_size=16, width=4, batch_norm=True),
                                torch.nn.Dropout(0.9))
    model.train()
    gaps = {train_val_gap(model, train, val, 16, batch_size=b) for b in (5, 256)}
    assert len(gaps) == 1, "eval mode, no augmentation: the same gap whatever the batches"
    assert not model.training
    assert train_val_gap(model, train, train, 16) == 0.0


def test_augmentation_experiment_can_return_its_trained_models():
    from labkit import data
    from labkit.train import augmentation_experiment, train_val_gap

    images = data.shapes(18, image_size=32, seed=0, classes=["circle", "square", "cross"])
    train, val = data.split(images, val_fraction=0.5)
    runs, models = augmentation_experiment(train, val, image_size=32, epochs=1, batch_size=8,
                                           width=1 / 16, return_models=True)
    assert set(runs) == set(models) == {"none", "standard"}
    for kind, model in models.items():
        last = runs[kind][-1]
        assert train_val_gap(model, train, val, 32) == last["train_acc"] - last["val_acc"]

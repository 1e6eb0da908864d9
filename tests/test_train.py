"""labkit.train: the shared loop learns, records a history, and refuses bad settings."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from labkit.train import TrainConfig, evaluate, fit


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

"""Training loops the notebooks share: one epoch, evaluation, and ``fit`` with a history.

Kept apart from :mod:`labkit.models` (models hold no loops) so the same loop trains on one
process and, in later notebooks, inside DDP workers. Results are plain data: ``fit`` returns a
list of per-epoch dicts that :func:`labkit.plots.training_curves` draws.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

__all__ = ["TrainConfig", "fit", "train_epoch", "evaluate", "pick_device", "train_val_gap",
           "augmentation_experiment", "LR_RULES", "linear_scaled_lr", "warmup_lr",
           "large_batch_experiment"]


@dataclasses.dataclass
class TrainConfig:
    """What ``fit`` needs besides the model and the data.

    ``amp`` is ``None``, ``"bf16"`` or ``"fp16"`` (fp16 uses a GradScaler; both only pay on
    GPUs). ``warmup_epochs`` ramps the learning rate linearly from ``lr / 10``.
    """

    epochs: int = 10
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 5e-4
    optimizer: str = "sgd"
    warmup_epochs: int = 0
    amp: str | None = None
    channels_last: bool = False
    device: str = "auto"

    def __post_init__(self):
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")
        if self.amp not in (None, "bf16", "fp16"):
            raise ValueError(f"amp must be None, 'bf16' or 'fp16', got {self.amp!r}")


def pick_device(name: str = "auto"):
    """``"auto"``: this process's CUDA device when there is one, else the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    return torch.device(name)


def _autocast(device, amp: str | None):
    import contextlib

    import torch

    if amp is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if amp == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_epoch(model, loader, optimizer, device, *, amp=None, scaler=None,
                channels_last=False) -> tuple[float, float]:
    """One pass over ``loader``; returns the mean loss and the accuracy seen while training.

    The model is in train mode, except frozen BatchNorm layers (:func:`labkit.models.train_mode`):
    a frozen base keeps its running statistics as well as its weights.
    """
    import torch
    import torch.nn.functional as F

    from .models import train_mode

    train_mode(model)
    total_loss, correct, seen = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with _autocast(device, amp):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        total_loss += loss.item() * len(y)
        correct += (logits.argmax(1) == y).sum().item()
        seen += len(y)
    return total_loss / seen, correct / seen


def evaluate(model, loader, device, *, amp=None, channels_last=False) -> tuple[float, float]:
    """Mean loss and accuracy of ``model`` on ``loader``, without gradients."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total_loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            with _autocast(device, amp):
                logits = model(x)
            total_loss += F.cross_entropy(logits.float(), y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
            seen += len(y)
    return total_loss / seen, correct / seen


def _optimizer(model, cfg: TrainConfig):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("every parameter is frozen: unfreeze at least the head before training")
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def _warmup_lr(cfg: TrainConfig, epoch: int) -> float:
    """Linear warm-up from lr/10 over ``warmup_epochs`` (Goyal et al.), then constant."""
    if epoch >= cfg.warmup_epochs:
        return cfg.lr
    return cfg.lr * (0.1 + 0.9 * epoch / cfg.warmup_epochs)


def fit(model, train_loader, val_loader, config: TrainConfig | None = None, *,
        train_eval_loader=None,
        on_epoch: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Train ``model`` for ``config.epochs`` and return one dict per epoch.

    Each dict holds ``epoch, train_loss, train_acc, val_loss, val_acc, lr, seconds``;
    ``on_epoch(history)`` is called after every epoch (e.g. to redraw a live plot).
    ``train_acc`` is measured while training, on augmented batches with dropout on; pass
    ``train_eval_loader`` (the training images, not augmented) to measure it like ``val_acc``
    instead, which is the fair way to compare the train-validation gap of two pipelines.

    Example::

        >>> history = fit(model, train_loader, val_loader, TrainConfig(epochs=5, lr=0.05))
        >>> history[-1]["val_acc"]
        0.93
    """
    import torch

    cfg = config or TrainConfig()
    device = pick_device(cfg.device)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = _optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    history: list[dict] = []
    for epoch in range(cfg.epochs):
        lr = _warmup_lr(cfg, epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        train_loss, train_acc = train_epoch(model, train_loader, optimizer, device, amp=cfg.amp,
                                            scaler=scaler, channels_last=cfg.channels_last)
        val_loss, val_acc = evaluate(model, val_loader, device, amp=cfg.amp,
                                     channels_last=cfg.channels_last)
        if train_eval_loader is not None:
            train_loss, train_acc = evaluate(model, train_eval_loader, device, amp=cfg.amp,
                                             channels_last=cfg.channels_last)
        history.append({"epoch": epoch + 1, "train_loss": train_loss, "train_acc": train_acc,
                        "val_loss": val_loss, "val_acc": val_acc, "lr": lr,
                        "seconds": time.perf_counter() - start})
        if on_epoch is not None:
            on_epoch(history)
    return history


def train_val_gap(model, train_set, val_set, image_size: int, batch_size: int = 256) -> float:
    """Train accuracy minus validation accuracy, both measured alike: the fair overfitting gap.

    Both ImageSets go through the same un-augmented pipeline (resize, normalise) and are
    evaluated with the model in eval mode (BatchNorm's running statistics, no dropout), on the
    model's device. The accuracy ``fit`` records while training is neither: augmented batches,
    train mode.

    Example::

        >>> train_val_gap(model, train, val, image_size=32)    # train 1.00, val 0.62
        0.38
    """
    from torch.utils.data import DataLoader

    from . import augment, data

    plain = augment.augmentation(image_size, kind="none")
    device = next(model.parameters()).device
    accuracy = [evaluate(model, DataLoader(data.to_torch(s, plain), batch_size=batch_size),
                         device)[1] for s in (train_set, val_set)]
    return accuracy[0] - accuracy[1]


def augmentation_experiment(train_set, val_set, *, image_size: int, width: float = 0.125,
                            epochs: int = 30, lr: float = 1e-3, batch_size: int = 16,
                            augment_config=None, kinds=("none", "standard"), seed: int = 0,
                            on_epoch: Callable[[str, list[dict]], None] | None = None,
                            return_models: bool = False):
    """Train the same VGG16 (BatchNorm, no dropout) once per augmentation ``kind``.

    Returns ``{kind: history}``, and with ``return_models=True`` the pair ``(runs, models)``,
    ``models`` being ``{kind: the trained model}``. Every run starts from the same weights and
    sees the same batches order; train accuracy is measured on the un-augmented training
    images, like validation, so the train-validation gaps of the runs compare fairly.

    Example::

        >>> runs = augmentation_experiment(train, val, image_size=32, epochs=30)
        >>> gap = {k: h[-1]["train_acc"] - h[-1]["val_acc"] for k, h in runs.items()}
        >>> runs, models = augmentation_experiment(train, val, image_size=32, return_models=True)
    """
    import torch
    from torch.utils.data import DataLoader

    from . import augment, data, models

    plain = augment.augmentation(image_size, kind="none")
    train_eval = DataLoader(data.to_torch(train_set, plain), batch_size=256)
    val = DataLoader(data.to_torch(val_set, plain), batch_size=256)
    runs, trained = {}, {}
    for kind in kinds:
        torch.manual_seed(seed)
        # Dropout off: the comparison is augmentation against nothing, not against dropout.
        model = models.vgg16(len(train_set.classes), width=width, image_size=image_size,
                             batch_norm=True, dropout=0.0)
        pipeline = augment.augmentation(image_size, kind=kind, config=augment_config)
        loader = DataLoader(data.to_torch(train_set, pipeline), batch_size=batch_size,
                            shuffle=True, generator=torch.Generator().manual_seed(seed))
        config = TrainConfig(epochs=epochs, lr=lr, optimizer="adam", weight_decay=0.0)
        callback = (lambda h, k=kind: on_epoch(k, h)) if on_epoch else None
        runs[kind] = fit(model, loader, val, config, train_eval_loader=train_eval,
                         on_epoch=callback)
        trained[kind] = model
    return (runs, trained) if return_models else runs


# ---- large-batch training: linear learning-rate scaling and warm-up (Goyal et al., 2017) -------

LR_RULES = ("same lr", "linear scaling", "linear scaling + warmup")


def linear_scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """Goyal et al.'s rule: multiply the batch by k, multiply the learning rate by k.

    With k times fewer steps per epoch, each step must move k times further to cover the same
    distance; SGD's update with a k times larger batch and learning rate approximates k small
    steps as long as the gradient changes little over them.

    Example::

        >>> linear_scaled_lr(0.1, 256, 8192)     # ImageNet in one hour: 256 -> 8k images
        3.2
    """
    if base_lr <= 0 or base_batch < 1 or global_batch < 1:
        raise ValueError(f"need base_lr > 0 and batches >= 1, got {base_lr}, {base_batch}, "
                         f"{global_batch}")
    return base_lr * global_batch / base_batch


def warmup_lr(target_lr: float, step: int, warmup_steps: int) -> float:
    """The learning rate at ``step`` (0-based): a linear ramp to ``target_lr`` in ``warmup_steps``.

    Early gradients are large and change fast, exactly when the linear-scaling approximation
    fails; ramping the scaled rate up over the first epochs avoids the early divergence.

    Example::

        >>> [warmup_lr(1.0, s, 4) for s in range(6)]
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    """
    if warmup_steps <= 0:
        return target_lr
    return target_lr * min(1.0, (step + 1) / warmup_steps)


def large_batch_experiment(train_set, val_set, batches, *, base_batch: int, base_lr: float,
                           epochs: int, warmup_epochs: float = 2, rules=LR_RULES,
                           model_fn=None, momentum: float = 0.9, seed: int = 0) -> list[dict]:
    """Validation accuracy after ``epochs`` for each global batch and learning-rate rule.

    Every run starts from the same weights and trains for the same number of epochs (so larger
    batches take fewer steps) with SGD and momentum: ``"same lr"`` keeps ``base_lr``,
    ``"linear scaling"`` multiplies it by ``batch / base_batch``, and ``"linear scaling +
    warmup"`` also ramps it up over ``warmup_epochs``. It runs in one process: N data-parallel
    workers with batch b compute exactly the update of one process with batch N*b (notebook
    02 shows it), so a global batch is simulated here without the workers.

    Returns rows ``{global_batch, rule, lr, steps, val_acc}``.

    Example::

        >>> rows = large_batch_experiment(train, val, [16, 128], base_batch=16, base_lr=0.01,
        ...                               epochs=8)
    """
    import torch
    from torch import nn

    from .data import to_float_tensors
    from .models import small_cnn

    bad = [r for r in rules if r not in LR_RULES]
    if bad or not rules:
        raise ValueError(f"rules must be some of {LR_RULES}, got {rules!r}")
    if epochs < 1 or warmup_epochs < 0:
        raise ValueError(f"need epochs >= 1 and warmup_epochs >= 0, got {epochs}, {warmup_epochs}")
    if base_lr <= 0 or base_batch < 1:
        raise ValueError(f"need base_lr > 0 and base_batch >= 1, got {base_lr}, {base_batch}")
    x, y = to_float_tensors(train_set)
    x_val, y_val = to_float_tensors(val_set)
    too_big = [b for b in batches if not 1 <= b <= len(x)]
    if too_big:
        raise ValueError(f"global batches {too_big} do not fit the {len(x)} training samples: "
                         f"use batches between 1 and {len(x)}")
    image_size = train_set.images.shape[1]
    make = model_fn or (lambda: small_cnn(len(train_set.classes), image_size=image_size))
    torch.manual_seed(seed)
    initial = make().state_dict()
    rows, done = [], {}
    for batch in batches:
        steps_per_epoch = len(x) // batch
        for rule in rules:
            lr = base_lr if rule == "same lr" else linear_scaled_lr(base_lr, base_batch, batch)
            warmup = round(warmup_epochs * steps_per_epoch) if rule.endswith("warmup") else 0
            if (batch, lr, warmup) in done:  # at the base batch two rules are the same run
                rows.append({**done[batch, lr, warmup], "rule": rule})
                continue
            model = make()
            model.load_state_dict(initial)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            order = torch.Generator().manual_seed(seed)  # the same sample order for every rule
            step = 0
            for _ in range(epochs):
                perm = torch.randperm(len(x), generator=order)
                for i in range(steps_per_epoch):
                    idx = perm[i * batch:(i + 1) * batch]
                    for group in opt.param_groups:
                        group["lr"] = warmup_lr(lr, step, warmup)
                    opt.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
                    step += 1
            model.eval()  # BatchNorm and dropout, if model_fn has them, in inference mode
            with torch.no_grad():
                logits = model(x_val)
            acc = (logits.argmax(1) == y_val).float().mean().item()
            rows.append({"global_batch": batch, "rule": rule, "lr": lr, "steps": step,
                         "val_acc": 0.0 if torch.isnan(logits).any() else acc})
            done[batch, lr, warmup] = rows[-1]
    return rows

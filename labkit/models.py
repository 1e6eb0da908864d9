"""Models: VGG16 with width and resolution knobs, pretrained loading, and transfer-learning helpers.

:func:`vgg16` builds the network of Simonyan & Zisserman with torchvision's exact module layout,
so torchvision's ImageNet checkpoint loads unchanged at ``width=1.0``; a smaller ``width`` makes
a CPU-sized copy with the same depth. Weights come from the torch hub cache or a file, never
from the network: this module downloads nothing.

    >>> model = vgg16(num_classes=10, width=1 / 8, image_size=64)
    >>> freeze(model.features)
    >>> count_parameters(model)          # (trainable, total): only the classifier learns
    (1873930, 2104498)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ._display import wrap
from ._sizes import whole

__all__ = ["convnet", "small_cnn", "VGG16", "IMAGENET", "MIN_IMAGE_SIZE", "PRETRAINED_CHOICES",
           "vgg16", "vgg16_flops", "imagenet_checkpoint_path", "load_checkpoint", "freeze",
           "unfreeze", "train_mode", "count_parameters", "replace_head"]

# Conv channel counts of VGG16 ("configuration D"); "M" is a 2x2 max-pool.
_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
MIN_IMAGE_SIZE = 32  # five 2x2 poolings: 32 px is the smallest input that leaves 1x1 at the end
PRETRAINED_CHOICES = (None, "auto", "imagenet", "a path to a .pth file")


@dataclass(frozen=True)
class ImageNetWeights:
    """Where torchvision keeps VGG16's ImageNet checkpoint, and the model it fits."""

    file: str = "vgg16-397923af.pth"  # basename of VGG16_Weights.IMAGENET1K_V1.url
    file_bn: str = "vgg16_bn-6c64b313.pth"  # VGG16_BN_Weights.IMAGENET1K_V1, for batch_norm=True
    width: float = 1.0
    num_classes: int = 1000


IMAGENET = ImageNetWeights()


class VGG16(nn.Module):
    """VGG16 with torchvision's layout: ``features`` (13 convs), ``avgpool``, ``classifier``.

    The adaptive pool always yields 7x7 cells, as in torchvision, so the classifier's input size
    depends on ``width`` only and ImageNet weights load at any image size. Below 224 px the last
    feature map is smaller than 7x7 (2x2 at 64 px) and the pool repeats each cell.

    Example::

        >>> VGG16(num_classes=10, width=0.25)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, num_classes: int = 1000, width: float = 1.0, dropout: float = 0.5,
                 image_size: int = 224, batch_norm: bool = False):
        super().__init__()
        layers, channels = [], 3
        for item in _CFG:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out = _scaled(item, width)
                layers.append(nn.Conv2d(channels, out, kernel_size=3, padding=1))
                if batch_norm:  # torchvision's vgg16_bn layout: conv, bn, relu
                    layers.append(nn.BatchNorm2d(out))
                layers.append(nn.ReLU(inplace=True))
                channels = out
        hidden = _scaled(4096, width)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )
        self.width, self.image_size, self.batch_norm = width, image_size, batch_norm
        for m in self.modules():
            _init(m)

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def _scaled(channels: int, width: float) -> int:
    return max(1, round(channels * width))


def _init(m: nn.Module) -> None:
    """torchvision's VGG initialisation: a random start matches ``torchvision.models.vgg16()``."""
    if isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0, 0.01)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def imagenet_checkpoint_path(batch_norm: bool = False) -> Path:
    """Where torchvision caches VGG16's ImageNet weights: ``<torch hub dir>/checkpoints/<file>``.

    The hub dir is ``$TORCH_HOME/hub`` (default ``~/.cache/torch/hub``), so setting TORCH_HOME
    or copying the file there is all it takes.

    Example::

        >>> imagenet_checkpoint_path().name
        'vgg16-397923af.pth'
    """
    file = IMAGENET.file_bn if batch_norm else IMAGENET.file
    return Path(torch.hub.get_dir()) / "checkpoints" / file


def vgg16(num_classes: int = 1000, *, width: float = 1.0, image_size: int = 224,
          pretrained: str | os.PathLike | None = None, dropout: float = 0.5,
          batch_norm: bool = False) -> VGG16:
    """VGG16 for ``image_size`` px RGB inputs, ``width`` times as wide, optionally pretrained.

    ``pretrained``: ``None`` (random), ``"auto"`` (ImageNet weights if the file is in the torch
    hub cache, else random with a one-line message), ``"imagenet"`` (the same, but an error if
    the file is missing) or a path to a ``.pth`` file saved from a model like this one. When
    ``num_classes`` differs from the checkpoint's, its head is left out and a new random one
    is trained: the usual transfer-learning start. ``batch_norm=True`` is torchvision's
    ``vgg16_bn``: a BatchNorm after every conv, which lets a narrow VGG16 train from scratch on
    a few hundred images (plain VGG16 was trained in stages for that reason).

    Example::

        >>> model = vgg16(10, width=1 / 8, image_size=64)           # a CPU-sized VGG16
        >>> model(torch.zeros(4, 3, 64, 64)).shape
        torch.Size([4, 10])
        >>> base = vgg16(5, pretrained="auto")   # ImageNet features when cached, else random
    """
    image_size = whole(image_size, "image_size", low=MIN_IMAGE_SIZE,
                       hint=f": too small for VGG16's five 2x2 poolings (resize the images up, "
                            f"e.g. with labkit.augment.augmentation({MIN_IMAGE_SIZE}))")
    if not width > 0:
        raise ValueError(f"width must be > 0 (1.0 is VGG16, 0.125 a CPU-sized copy), got {width}")
    num_classes = whole(num_classes, "num_classes")
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    path = _resolve_pretrained(pretrained, width, batch_norm)
    model = VGG16(num_classes, width=width, dropout=dropout, image_size=image_size,
                  batch_norm=batch_norm)
    if path is not None:
        load_checkpoint(model, path)
    return model


def vgg16_flops(image_size: int = 224, width: float = 1.0, num_classes: int = 1000) -> int:
    """Forward FLOPs of one image through :func:`vgg16`: 2 x the multiply-adds.

    Counts the 13 convolutions and 3 linear layers (pooling, ReLU and biases are noise). A
    training step costs about 3x this: the backward pass computes two products per layer.

    Example::

        >>> round(vgg16_flops() / 1e9, 1)       # 15.5 GMACs
        31.0
    """
    image_size = whole(image_size, "image_size", low=MIN_IMAGE_SIZE,
                       hint=" (VGG16's five 2x2 poolings)")
    if not width > 0:
        raise ValueError(f"width must be > 0, got {width}")
    size, channels, macs = image_size, 3, 0
    for item in _CFG:
        if item == "M":
            size //= 2
            continue
        out = _scaled(item, width)
        macs += size * size * out * channels * 9  # 3x3 kernel, padding 1: same size out
        channels = out
    hidden = _scaled(4096, width)
    macs += channels * 7 * 7 * hidden + hidden * hidden + hidden * num_classes
    return 2 * macs


def _resolve_pretrained(pretrained, width: float, batch_norm: bool = False) -> Path | None:
    """The checkpoint file ``pretrained`` names, or None for a random start."""
    if pretrained is None:
        return None
    if pretrained in ("auto", "imagenet"):
        if width != IMAGENET.width:
            raise ValueError(f"ImageNet weights exist for width={IMAGENET.width} only, got "
                             f"width={width}: use width={IMAGENET.width}, or pretrained=None to "
                             f"start a narrower VGG16 from random weights")
        path = imagenet_checkpoint_path(batch_norm)
        if path.is_file():
            return path
        if pretrained == "auto":
            print(f"labkit: no ImageNet weights at {path}; starting VGG16 from random weights "
                  f"(put {path.name} there to use them)")
            return None
        builder = "vgg16_bn" if batch_norm else "vgg16"
        raise FileNotFoundError(
            f"no ImageNet weights for VGG16 at {path}. Where the network is reachable, run "
            f"`torchvision.models.{builder}(weights=\"IMAGENET1K_V1\")` once (it saves the file "
            f"there), or copy {path.name} to {path}; pretrained=\"auto\" falls back to "
            f"random weights instead")
    if isinstance(pretrained, os.PathLike) or (
            isinstance(pretrained, str) and (pretrained.endswith((".pth", ".pt"))
                                             or os.sep in pretrained
                                             or os.path.isfile(pretrained))):
        path = Path(pretrained)
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint file at {path}: save one with "
                                    f"torch.save(model.state_dict(), {str(path)!r})")
        return path
    raise ValueError(f"unknown pretrained={pretrained!r}: use None (random), 'auto', 'imagenet', "
                     f"or a path to a .pth file")


def load_checkpoint(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Load a VGG16 checkpoint into ``model``: features must match; another head size stays new.

    The file holds a state dict, or a dict with it under ``"model"`` or ``"state_dict"``
    (``module.`` and ``_orig_mod.`` prefixes from DDP and torch.compile are removed). It is read
    with ``weights_only=True``: tensors only, no code. Classifier layers whose shapes differ
    (a new number of classes) keep their random initialisation, and a line says which.

    Example::

        >>> torch.save(vgg16(10, width=1 / 8).state_dict(), "base.pth")
        >>> model = load_checkpoint(vgg16(3, width=1 / 8), "base.pth")  # new 3-class head
    """
    state = _read_state_dict(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        what = (f"lacks {missing[0]!r} ({len(missing)} keys missing)" if missing
                else f"has {unexpected[0]!r}, which VGG16 lacks ({len(unexpected)} unexpected)")
        raise ValueError(f"{path} is not a VGG16 state dict: it {what}. Save one with "
                         f"torch.save(model.state_dict(), path) from labkit.models.vgg16 or "
                         f"torchvision.models.vgg16")
    kept_new = []
    for key, tensor in own.items():
        if state[key].shape == tensor.shape:
            continue
        if not key.startswith("classifier."):
            raise ValueError(
                f"checkpoint {path} does not fit this model: {key} has shape "
                f"{tuple(state[key].shape)} in the file but {tuple(tensor.shape)} here. Was it "
                f"saved with another width? Build the model with the width it was saved with")
        kept_new.append(key)
        state[key] = tensor  # keep this layer's random initialisation
    model.load_state_dict(state)
    if kept_new:
        layers = sorted({k.rsplit(".", 1)[0] for k in kept_new})
        print(wrap(f"labkit: loaded {path}; kept {', '.join(layers)} newly initialised "
                   f"(shapes differ from the checkpoint: e.g. a new number of classes)"))
    return model


def _read_state_dict(path) -> dict:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle and zip errors differ by torch version; one message for all
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"cannot read {path} as a PyTorch checkpoint of tensors ({type(exc).__name__}: "
            f"{first}). Write it with torch.save(model.state_dict(), path); a trusted file that "
            f"holds more can be opened with torch.load(path, weights_only=False) and its state "
            f"dict saved again") from exc
    if isinstance(obj, dict):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path} holds no state dict (a dict of tensors): save one with "
                         f"torch.save(model.state_dict(), path)")
    return {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in obj.items()}


def freeze(module: nn.Module) -> nn.Module:
    """Stop training ``module``: its parameters get no gradients (the optimiser skips them).

    Example::

        >>> model = vgg16(5, width=1 / 8, image_size=32)
        >>> freeze(model.features) is model.features
        True
    """
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def unfreeze(module: nn.Module) -> nn.Module:
    """Train ``module`` again (fine-tuning: pair it with a low learning rate).

    Example::

        >>> unfreeze(model.features)
    """
    for p in module.parameters():
        p.requires_grad_(True)
    return module


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def train_mode(model: nn.Module) -> nn.Module:
    """``model.train()``, except that frozen BatchNorm layers stay in eval mode.

    ``requires_grad = False`` stops the optimiser, but a BatchNorm layer also keeps running
    statistics (``running_mean``, ``running_var``: buffers, not parameters) that every forward
    pass in train mode updates, and it normalises with the batch's own statistics instead of
    them. A frozen base would still drift. So a BatchNorm layer whose parameters are all frozen
    is put back in eval mode: it normalises with its stored statistics and leaves them as they
    are, which is what Keras does for a layer with ``trainable = False``. BatchNorm layers
    without parameters (``affine=False``) cannot be told frozen and train as usual.

    Example::

        >>> model = vgg16(10, width=1 / 8, image_size=32, batch_norm=True)
        >>> _ = train_mode(freeze(model.features))
        >>> model.features[1].training, model.classifier.training   # BatchNorm, head
        (False, True)
    """
    model.train()
    for m in model.modules():
        params = list(m.parameters(recurse=False))
        if isinstance(m, _BATCH_NORMS) and params and not any(p.requires_grad for p in params):
            m.eval()
    return model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts, as the DLI lab prints them after freezing.

    Example::

        >>> count_parameters(vgg16())
        (138357544, 138357544)
    """
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Give a VGG-style model a new, randomly initialised last layer with ``num_classes`` outputs.

    The new layer sits on the old one's device and dtype and is trainable even in a frozen model.

    Example::

        >>> model = replace_head(vgg16(width=1 / 8), 5)
        >>> model.classifier[-1].out_features
        5
    """
    num_classes = whole(num_classes, "num_classes")
    classifier = getattr(model, "classifier", None)
    if not isinstance(classifier, nn.Sequential) or not isinstance(classifier[-1], nn.Linear):
        raise TypeError(f"replace_head expects a VGG-style model whose .classifier is an "
                        f"nn.Sequential ending in nn.Linear, got {type(model).__name__}; "
                        f"replace the last layer by hand for other models")
    old = classifier[-1]
    new = nn.Linear(old.in_features, num_classes, device=old.weight.device, dtype=old.weight.dtype)
    _init(new)
    classifier[-1] = new
    return model


def convnet(num_classes: int = 10, width: int = 32, in_channels: int = 3) -> nn.Module:
    """A small, compute-bound conv net: ~66k parameters, ~30 MFLOPs per 32x32 image at width 32.

    Many FLOPs per parameter means the gradient all-reduce is cheap next to the arithmetic,
    the regime where data parallelism scales (and one a CPU can show). Global average pooling
    makes it take any image size; it has no BatchNorm, so N data-parallel workers compute
    exactly what one process computes on their combined batch.

    Example::

        >>> sum(p.numel() for p in convnet().parameters())
        66218
    """
    w = width
    return nn.Sequential(
        nn.Conv2d(in_channels, w, 3, padding=1), nn.ReLU(), nn.Conv2d(w, w, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.Conv2d(2 * w, 2 * w, 3, padding=1),
        nn.ReLU(), nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, num_classes))


def small_cnn(num_classes: int = 10, image_size: int = 16, width: int = 16, *,
              batch_norm: bool = False) -> nn.Module:
    """Two conv layers and a linear head: trains on 16x16 digits to ~95 % in seconds on a CPU.

    The network of notebook 02's lessons, where many short runs must fit in minutes. Without
    BatchNorm (the default), data-parallel workers compute exactly what one process computes on
    their combined batch; ``batch_norm=True`` adds BatchNorm after each conv, whose statistics
    are per worker's batch, which is the lesson on SyncBatchNorm.

    Example::

        >>> small_cnn(10, image_size=16)(torch.zeros(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """
    if image_size < 4 or image_size % 4:
        raise ValueError(f"image_size must be a multiple of 4 (two 2x poolings), got {image_size}")
    w = width

    def norm(c):
        return [nn.BatchNorm2d(c)] if batch_norm else []

    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), *norm(w), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), *norm(2 * w), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * w * (image_size // 4) ** 2, num_classes))

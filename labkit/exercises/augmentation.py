"""Notebook 01's exercises (PyTorch): an augmentation pipeline, a frozen base, ...

Each grader runs the learner's answer and returns what it verified, or raises
:class:`labkit.check.NotYet` with what is wrong and a hint.
"""

from __future__ import annotations

from ..check import NotYet, exercise

NOTEBOOK = "01"

_KINDS = {"flip": ("RandomHorizontalFlip", "RandomVerticalFlip"),
          "rotation": ("RandomRotation", "RandomAffine"),
          "crop": ("RandomResizedCrop", "RandomCrop"),
          "color": ("ColorJitter", "RandomAutocontrast"),
          "policy": ("RandAugment", "AutoAugment", "TrivialAugmentWide", "AugMix")}


@exercise("augmentation_pipeline", notebook=NOTEBOOK, title="augmentation pipeline")
def augmentation_pipeline(transform, image_size: int, *, needs=("flip", "rotation")) -> str:
    """Exercise: a v2 pipeline that augments (``needs``) and returns normalised float images.

    Example::

        >>> exercise.augmentation_pipeline(my_transform, image_size=64)
        [pass] augmentation pipeline: flip, rotation; float32 3x64x64 output, random
    """
    import torch

    image = torch.randint(0, 256, (3, image_size + 8, image_size + 8), dtype=torch.uint8)
    try:
        torch.manual_seed(0)
        outs = [transform(image) for _ in range(4)]
    except Exception as exc:  # the learner's pipeline may fail in any way: say how
        raise NotYet(f"calling it on a uint8 3xHxW image failed: {exc}",
                     "test it on one image first: transform(torch.zeros(3, 64, 64, "
                     "dtype=torch.uint8))") from None
    steps = [type(t).__name__ for t in getattr(transform, "transforms", [transform])]
    for need in needs:
        if not any(s in _KINDS[need] for s in steps):
            raise NotYet(f"no {need} step among {steps}",
                         f"add one of {', '.join(_KINDS[need])} from torchvision.transforms.v2")
    out = outs[0]
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        raise NotYet(f"it returns {type(out).__name__} {getattr(out, 'dtype', '')}, not a "
                     f"float32 tensor",
                     "end with v2.ToDtype(torch.float32, scale=True) and v2.Normalize(...)")
    if tuple(out.shape) != (3, image_size, image_size):
        raise NotYet(f"output shape {tuple(out.shape)}, expected (3, {image_size}, {image_size})",
                     f"resize or crop to {image_size}, e.g. v2.RandomResizedCrop({image_size})")
    if all(torch.equal(outs[0], o) for o in outs[1:]):
        raise NotYet("four calls gave the same image: nothing random happens",
                     "augmentation steps are random: check their probabilities and ranges")
    return f"{', '.join(needs)}; float32 3x{image_size}x{image_size} output, random"


@exercise("frozen_base", notebook=NOTEBOOK, title="freeze the base")
def frozen_base(model, base: str = "features", head: str = "classifier") -> str:
    """Exercise: the convolutional base frozen, the head still trainable.

    Example::

        >>> exercise.frozen_base(model)
        [pass] freeze the base: 14,714,688 base parameters frozen, 2,565 head parameters train
    """
    base_params = list(getattr(model, base).parameters())
    head_params = list(getattr(model, head).parameters())
    trainable_base = sum(p.numel() for p in base_params if p.requires_grad)
    if trainable_base:
        raise NotYet(f"{trainable_base:,} parameters of model.{base} still train",
                     f"set requires_grad = False on every parameter of model.{base} "
                     f"(labkit.models.freeze(model.{base}) does it)")
    if all(not p.requires_grad for p in head_params):
        raise NotYet(f"the head (model.{head}) is frozen too: nothing would learn",
                     f"freeze only model.{base}; keep model.{head} trainable")
    total_base = sum(p.numel() for p in base_params)
    trainable_head = sum(p.numel() for p in head_params if p.requires_grad)
    return f"{total_base:,} base parameters frozen, {trainable_head:,} head parameters train"

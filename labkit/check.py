"""Exercise checks: each looks at what the learner built and answers pass, or not yet with a hint.

This module owns the course's verdicts (:class:`Verdict`, which the capstone grader in
:mod:`labkit.capstone` reports with too), the exercise checks (:func:`augmentation_pipeline`,
:func:`frozen_base`) and their reference solutions (:data:`SOLUTIONS`, :func:`solution`), and
:func:`in_band`, the printed verdict for a noisy figure (an accuracy after a short run, a time).

A check never raises on a wrong answer (the notebook goes on, and runs in CI with its exercise
cells as the learner finds them); it prints its verdict and returns a truthy or falsy
:class:`Verdict`. Solutions stay hidden unless asked for with :func:`solution`.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

__all__ = ["Verdict", "augmentation_pipeline", "frozen_base", "in_band", "solution", "SOLUTIONS"]


@dataclasses.dataclass
class Verdict:
    """The outcome of one check: ``passed``, what was found, and a hint when it did not pass."""

    exercise: str
    passed: bool
    detail: str
    hint: str = ""

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        if self.passed:
            return f"[pass] {self.exercise}: {self.detail}"
        return f"[not yet] {self.exercise}: {self.detail}\n  hint: {self.hint}"

    def show(self) -> Verdict:
        print(self)
        return self


def _verdict(exercise: str, problems: list[tuple[str, str]], ok_detail: str) -> Verdict:
    if problems:
        detail, hint = problems[0]
        return Verdict(exercise, False, detail, hint).show()
    return Verdict(exercise, True, ok_detail).show()


def augmentation_pipeline(transform, image_size: int, *, needs=("flip", "rotation")) -> Verdict:
    """Exercise: a v2 pipeline that augments (``needs``) and returns normalised float images.

    Example::

        >>> check.augmentation_pipeline(my_transform, image_size=64)
        [pass] augmentation pipeline: flip, rotation; float32 3x64x64 output, random
    """
    import torch

    name = "augmentation pipeline"
    kinds = {"flip": ("RandomHorizontalFlip", "RandomVerticalFlip"),
             "rotation": ("RandomRotation", "RandomAffine"),
             "crop": ("RandomResizedCrop", "RandomCrop"),
             "color": ("ColorJitter", "RandomAutocontrast"),
             "policy": ("RandAugment", "AutoAugment", "TrivialAugmentWide", "AugMix")}
    steps = [type(t).__name__ for t in getattr(transform, "transforms", [transform])]
    problems = []
    for need in needs:
        if not any(s in kinds[need] for s in steps):
            problems.append((f"no {need} step among {steps}",
                             f"add one of {', '.join(kinds[need])} from torchvision.transforms.v2"))
    image = torch.randint(0, 256, (3, image_size + 8, image_size + 8), dtype=torch.uint8)
    try:
        torch.manual_seed(0)
        outs = [transform(image) for _ in range(4)]
    except Exception as exc:  # the learner's pipeline may fail in any way: say how
        return Verdict(name, False, f"calling it on a uint8 3xHxW image failed: {exc}",
                       "test it on one image first: transform(torch.zeros(3, 64, 64, "
                       "dtype=torch.uint8))").show()
    out = outs[0]
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        problems.append((f"it returns {type(out).__name__} "
                         f"{getattr(out, 'dtype', '')}, not a float32 tensor",
                         "end with v2.ToDtype(torch.float32, scale=True) and v2.Normalize(...)"))
    elif tuple(out.shape) != (3, image_size, image_size):
        problems.append((f"output shape {tuple(out.shape)}, expected "
                         f"(3, {image_size}, {image_size})",
                         f"resize or crop to {image_size}, "
                         f"e.g. v2.RandomResizedCrop({image_size})"))
    elif all(torch.equal(outs[0], o) for o in outs[1:]):
        problems.append(("four calls gave the same image: nothing random happens",
                         "augmentation steps are random: check their probabilities and ranges"))
    return _verdict(name, problems,
                    f"{', '.join(needs)}; float32 3x{image_size}x{image_size} output, random")


def frozen_base(model, base: str = "features", head: str = "classifier") -> Verdict:
    """Exercise: the convolutional base frozen, the head still trainable.

    Example::

        >>> check.frozen_base(model)
        [pass] freeze the base: 14,714,688 base parameters frozen, 2,565 head parameters train
    """
    name = "freeze the base"
    base_params = list(getattr(model, base).parameters())
    head_params = list(getattr(model, head).parameters())
    trainable_base = sum(p.numel() for p in base_params if p.requires_grad)
    frozen_head = sum(p.numel() for p in head_params if not p.requires_grad)
    problems = []
    if trainable_base:
        problems.append((f"{trainable_base:,} parameters of model.{base} still train",
                         f"set requires_grad = False on every parameter of model.{base} "
                         f"(labkit.models.freeze(model.{base}) does it)"))
    if frozen_head == sum(p.numel() for p in head_params):
        problems.append((f"the head (model.{head}) is frozen too: nothing would learn",
                         f"freeze only model.{base}; keep model.{head} trainable"))
    total_base = sum(p.numel() for p in base_params)
    trainable_head = sum(p.numel() for p in head_params if p.requires_grad)
    return _verdict(name, problems, f"{total_base:,} base parameters frozen, "
                                    f"{trainable_head:,} head parameters train")


def in_band(claim: str, measured: float, low: float = -math.inf, high: float = math.inf, *,
            cause: str) -> Verdict:
    """A printed verdict for a noisy figure: inside the band ``[low, high]`` expected, or not.

    For what a short run or a busy machine moves (an accuracy after a few epochs, a gap between
    two runs, a time): it prints the expected band, the measured value and, outside the band, the
    likely ``cause``, and never raises, so the lesson goes on. Exact claims are ``assert``s.

    Example::

        >>> check.in_band("gap without augmentation", 0.48, 0.3, 1.0,
        ...               cause="too few epochs to memorise the training images")
        [as expected] gap without augmentation: measured 0.48, expected 0.3 to 1
    """
    if not low <= high:
        raise ValueError(f"in_band needs low <= high, got low={low!r}, high={high!r}: swap them, "
                         f"or leave one out for a one-sided band")
    measured = float(measured)
    if high == math.inf:
        band = f"at least {low:g}"
    elif low == -math.inf:
        band = f"at most {high:g}"
    else:
        band = f"{low:g} to {high:g}"
    inside = low <= measured <= high  # False for NaN too
    verdict = Verdict(claim, inside, f"measured {measured:.3g}, expected {band}",
                      "" if inside else f"likely cause: {cause}")
    label = "as expected" if inside else "outside the expected band"
    print(f"[{label}] {claim}: {verdict.detail}" + ("" if inside else f"\n  {verdict.hint}"))
    return verdict


SOLUTIONS = {
    "augmentation_pipeline": """
        from torchvision.transforms import v2
        transform = v2.Compose([
            v2.RandomResizedCrop(image_size, scale=(0.7, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomRotation(15),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean, std),
        ])
    """,
    "frozen_base": """
        for p in model.features.parameters():
            p.requires_grad = False
    """,
}


def solution(exercise: str) -> str:
    """Print (and return) the reference solution of an exercise: only when you ask for it.

    Example::

        >>> check.solution("frozen_base")
        for p in model.features.parameters():
            p.requires_grad = False
    """
    if exercise not in SOLUTIONS:
        raise KeyError(f"no exercise {exercise!r}: choose from {', '.join(SOLUTIONS)}")
    text = textwrap.dedent(SOLUTIONS[exercise]).strip()
    print(text)
    return text

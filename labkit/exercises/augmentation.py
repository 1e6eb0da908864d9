"""Notebook 01's exercises (PyTorch): a pipeline, a batched flip, a fair gap, a frozen base.

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


def _steps(transform) -> list:
    """The steps of a pipeline, nested Compose, RandomApply and RandomChoice opened up."""
    inner = getattr(transform, "transforms", None)
    if isinstance(inner, list | tuple):
        return [step for t in inner for step in _steps(t)]
    return [transform]


@exercise("augmentation_pipeline", notebook=NOTEBOOK, title="augmentation pipeline")
def augmentation_pipeline(transform, image_size: int, *, needs=("flip", "rotation")) -> str:
    """Exercise: a v2 pipeline that augments (``needs``) and returns normalised float images.

    Called eight times on a random uint8 image: float32 ``3 x image_size x image_size`` out,
    different each time; each needed step present (nested pipelines opened up) and acting (a
    flip with p > 0, a rotation by more than 0 degrees); a Normalize step, on pixels scaled to
    0..1 first.

    Example::

        >>> exercise.augmentation_pipeline(my_transform, image_size=64)
        [pass] augmentation pipeline: flip, rotation; normalised float32 3x64x64 output, random
    """
    import torch

    image = torch.randint(0, 256, (3, image_size + 8, image_size + 8), dtype=torch.uint8)
    try:
        torch.manual_seed(0)
        outs = [transform(image) for _ in range(8)]
    except Exception as exc:  # the learner's pipeline may fail in any way: say how
        raise NotYet(f"calling it on a uint8 3xHxW image failed: {exc}",
                     "test it on one image first: transform(torch.zeros(3, 64, 64, "
                     "dtype=torch.uint8))") from None
    found = _steps(transform)
    steps = [type(t).__name__ for t in found]
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
    # A step that cannot act is named, unless nothing needed can act (nothing random at all).
    dead = []
    flips = [t for t in found if type(t).__name__ in _KINDS["flip"]]
    if "flip" in needs and all(getattr(t, "p", 1) <= 0 for t in flips):
        dead.append((f"its flip step never flips (p={getattr(flips[0], 'p', None)})",
                     "p is the probability that an image is flipped: leave the default, 0.5"))
    turns = [t for t in found if type(t).__name__ in _KINDS["rotation"]]
    if "rotation" in needs and all(list(getattr(t, "degrees", [1])) == [0, 0] for t in turns):
        dead.append(("its rotation step turns by 0 degrees",
                     "RandomRotation(d) turns each image by a random angle from -d to +d "
                     "degrees: e.g. 15"))
    if all(torch.equal(outs[0], o) for o in outs[1:]) and len(dead) != 1:
        raise NotYet("eight calls gave the same image: nothing random happens",
                     "augmentation steps are random: check their probabilities and ranges")
    if dead:
        raise NotYet(*dead[0])
    if "Normalize" not in steps:
        raise NotYet(f"the float images come out on 0..1, not normalised: no Normalize step "
                     f"among {steps}", "end with v2.Normalize(augment.IMAGENET_MEAN, "
                     "augment.IMAGENET_STD): the pretrained network saw its images so")
    if (top := out.abs().max().item()) > 50:
        raise NotYet(f"values up to {top:.0f} after Normalize: the pixels were not scaled to "
                     f"0..1 first", "v2.ToDtype(torch.float32, scale=True): without scale=True "
                     "255 stays 255, and Normalize expects 0..1")
    return (f"{', '.join(needs)}; normalised float32 3x{image_size}x{image_size} output, "
            f"random")


@exercise("frozen_base", notebook=NOTEBOOK, title="freeze the base")
def frozen_base(model, base: str = "features", head: str = "classifier") -> str:
    """Exercise: the convolutional base frozen, every parameter of the head still trainable.

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
    frozen_head = sum(p.numel() for p in head_params if not p.requires_grad)
    if frozen_head:
        raise NotYet(f"{frozen_head:,} of the head's {sum(p.numel() for p in head_params):,} "
                     f"parameters are frozen too", f"the whole head learns the new task: "
                     f"freeze model.{base} only, every parameter of model.{head} trains")
    total_base = sum(p.numel() for p in base_params)
    trainable_head = sum(p.numel() for p in head_params if p.requires_grad)
    return f"{total_base:,} base parameters frozen, {trainable_head:,} head parameters train"


@exercise("per_image_flip", notebook=NOTEBOOK, title="a random flip per image, batched")
def per_image_flip(fn) -> str:
    """Exercise: ``fn(batch, p, generator=None)`` mirrors each image left-right with probability p.

    Graded on a batch of 400 random CPU images: every output image must be the input image or
    its mirror; p=0 flips none, p=1 all, p=0.25 and p=0.5 about that share, each image its own
    coin; the input stays as it was, a seeded generator repeats the flips and another seed
    changes them (the coins come from the generator given), and a float16 batch stays float16.

    Example::

        >>> exercise.per_image_flip(my_flip)
        [pass] a random flip per image, batched: each image its own coin: ...
    """
    import torch

    batch = torch.rand(400, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    kept = batch.clone()

    def flipped(p, seed=0):
        """Which images fn mirrored; NotYet if an output is neither the image nor its mirror."""
        out = fn(batch, p, generator=torch.Generator().manual_seed(seed))
        if not torch.equal(batch, kept):
            raise NotYet("the input batch changed: it was flipped in place",
                         "return a new tensor (batch.flip(-1) makes one, torch.where picks "
                         "from two): the caller still needs the original images")
        if not isinstance(out, torch.Tensor) or out.shape != batch.shape:
            raise NotYet(f"it returned {type(out).__name__} "
                         f"{tuple(getattr(out, 'shape', ()))}, expected a tensor of the "
                         f"batch's shape {tuple(batch.shape)}",
                         "return the whole batch, each image flipped or not")
        same = (out == batch).flatten(1).all(1)
        mirror = (out == batch.flip(-1)).flatten(1).all(1)
        if not (same | mirror).all():
            upside = (out == batch.flip(-2)).flatten(1).all(1)
            raise NotYet(f"{int((~(same | mirror)).sum())} of {len(batch)} images are neither "
                         f"themselves nor their left-right mirror",
                         "an up-down flip: flip the width, the last dimension (flip(-1)), not "
                         "the height" if upside.any() else
                         "mirror whole images along the width, the last dimension of N x C x H "
                         "x W: batch.flip(-1), nothing else changed")
        return mirror

    for p, lo, hi in ((0.5, 0.4, 0.6), (0.0, 0, 0), (1.0, 1, 1), (0.25, 0.17, 0.33)):
        share = flipped(p).float().mean().item()
        if p == 0.5 and share in (0.0, 1.0):
            raise NotYet("with p=0.5 it flipped all images or none: one coin for the whole "
                         "batch", "draw one random number per image: torch.rand(len(batch)) "
                         "< p, then pick per image")
        if not lo <= share <= hi:
            raise NotYet(f"with p={p} it flipped {share:.0%} of the images",
                         "flip where torch.rand(len(batch)) < p: then p=0 flips none, p=1 "
                         "every image, p=0.25 about a quarter")
    if not torch.equal(flipped(0.5, seed=1), flipped(0.5, seed=1)):
        raise NotYet("the same seeded generator gave different flips",
                     "draw with the generator you are given: torch.rand(n, generator="
                     "generator), so that a run can be repeated")
    if torch.equal(flipped(0.5, seed=1), flipped(0.5, seed=2)):
        raise NotYet("generators seeded 1 and 2 gave the same flips: the coins do not come "
                     "from the generator you are given",
                     "draw with it: torch.rand(n, generator=generator). A seed fixed inside "
                     "the function flips the same images in every epoch")
    half = batch.to(torch.float16)
    out = fn(half, 0.5, generator=torch.Generator().manual_seed(0))
    if getattr(out, "dtype", None) != torch.float16:
        raise NotYet(f"a float16 batch came back {getattr(out, 'dtype', type(out).__name__)}",
                     "keep the batch's dtype: pick between the images and their mirrors "
                     "(torch.where) rather than mixing them with float32 coins, which "
                     "promotes half-precision images to float32")
    return ("each image its own coin: p=0 flips none, p=1 all, p=0.25 and 0.5 about that "
            "share; the input is left as it was, a seeded generator repeats the flips and "
            "another seed changes them; a float16 batch stays float16")


def _memoriser(train_set, image_size: int):
    """A model that has memorised ``train_set``: 1-nearest neighbour over its plain images.

    Its BatchNorm (running statistics 0 and 1: no change in eval mode) and dropout make train
    mode visible: both change what it predicts, and BatchNorm's buffers move.
    """
    import torch

    from .. import augment, data

    plain = augment.augmentation(image_size, kind="none")
    images = torch.stack([x for x, _ in data.to_torch(train_set, plain)])
    labels = torch.as_tensor(train_set.labels, dtype=torch.long)
    classes = len(train_set.classes)

    class Memoriser(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.BatchNorm2d(3)
            self.drop = torch.nn.Dropout(0.5)
            self.register_buffer("memory", images.flatten(1) / (1 + self.norm.eps) ** 0.5)

        def forward(self, x):
            if tuple(x.shape[-2:]) != (image_size, image_size):
                raise NotYet(f"the model was given {x.shape[-2]}x{x.shape[-1]} images; the "
                             f"check's are {image_size}x{image_size}",
                             "resize to the image_size argument, augment.augmentation("
                             "image_size, kind='none'), not to a size from the notebook")
            x = self.drop(self.norm(x)).flatten(1)
            d = torch.cdist(x, self.memory, compute_mode="donot_use_mm_for_euclid_dist")
            # a class's logit: minus the distance to its nearest memorised image
            return torch.stack([-d[:, labels == c].min(1).values for c in range(classes)], 1)

    return Memoriser().eval()


@exercise("fair_gap", notebook=NOTEBOOK, title="the train-validation gap, measured fairly")
def fair_gap(fn, image_size: int = 16) -> str:
    """Exercise: ``fn(model, train_set, val_set, image_size)``, train minus validation accuracy.

    Graded on a model that memorised its training images (train accuracy exactly 1.0 when
    measured fairly), against :func:`labkit.train.train_val_gap`: both accuracies in eval mode
    (BatchNorm's running statistics unchanged, no dropout), on un-augmented images.

    Example::

        >>> exercise.fair_gap(my_gap)
        [pass] the train-validation gap, measured fairly: gap 0.52 (train 1.00, val 0.48) ...
    """
    from .. import data
    from ..train import train_val_gap

    full = data.shapes(90, image_size=image_size, seed=3, classes=["circle", "square", "cross"])
    train_set, val_set = data.split(full, val_fraction=2 / 3, seed=0)
    model = _memoriser(train_set, image_size)
    stats = {k: v.clone() for k, v in model.norm.state_dict().items()}
    gaps = []
    for _ in range(2):
        model.train()  # as training leaves a model: the measurement must switch it to eval
        gaps.append(float(fn(model, train_set, val_set, image_size)))
    if any(not v.equal(stats[k]) for k, v in model.norm.state_dict().items()):
        raise NotYet("BatchNorm's running statistics changed: the model ran in train mode",
                     "call model.eval() before measuring: train mode normalises with each "
                     "batch's statistics, updates the running ones and drops activations")
    if gaps[0] != gaps[1]:
        raise NotYet(f"two calls on the same model gave different gaps ({gaps[0]:.3f}, "
                     f"{gaps[1]:.3f}): something random ran",
                     "measure on un-augmented images (augment.augmentation(image_size, "
                     "kind='none')), with the model in eval mode")
    want, got = train_val_gap(model, train_set, val_set, image_size), gaps[0]
    val_acc = 1.0 - want
    tol = 1e-6
    if abs(got - want) <= tol:
        return (f"gap {got:.2f} (train 1.00, val {val_acc:.2f}) on a model that memorised its "
                f"training images: eval mode, un-augmented images")
    said = f"it gave {got:.4g}; train accuracy 1.0 minus validation {val_acc:.3f} is {want:.4g}"
    for value, hint in [(-want, "the sign: the gap is train accuracy minus validation accuracy"),
                        (100 * want, "accuracies are fractions from 0 to 1, not percentages"),
                        (1.0, "that is the train accuracy alone: subtract the validation "
                              "accuracy"),
                        (val_acc, "that is the validation accuracy alone: train minus "
                                  "validation"),
                        (0.0, "train and validation gave the same accuracy: measure each on "
                              "its own set")]:
        if abs(got - value) <= tol:
            raise NotYet(said, hint)
    raise NotYet(said, "count the correct predictions over each whole set (a mean of batch "
                       "accuracies weighs a short last batch wrongly), in eval mode, on "
                       "un-augmented images")

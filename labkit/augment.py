"""Data augmentation: torchvision.transforms.v2 pipelines for DataLoader workers, and the same
random changes batched on the GPU.

One :class:`AugmentConfig` drives both paths and the slider explorer in ``labkit.plots``, so
what a learner tunes by eye is what the training run uses::

    config = AugmentConfig(rotation=20, scale=(0.5, 1.0))
    train_tf = augmentation(64, kind="standard", config=config)   # per image, in workers
    batch = gpu_augment(images.cuda().float() / 255, config)      # per batch, on the device

This module imports torch inside its functions only: ``AugmentConfig`` and the constants are
usable where torch is absent (the Keras notebook can read the same config).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from ._sizes import whole

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "KINDS", "AugmentConfig", "augmentation",
           "gpu_augment", "normalize", "register_gpu_augment_hook"]

# The statistics torchvision's ImageNet models were trained with (RGB, on 0..1 pixels).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
KINDS = ("none", "standard", "randaugment")
_GRAY = (0.2989, 0.587, 0.114)  # ITU-R 601 luma, the weights torchvision's colour ops use
# handle id -> hook(batch, config), see register_gpu_augment_hook (torch's handles need an
# OrderedDict: they keep a weak reference to it)
_GPU_AUGMENT_HOOKS: collections.OrderedDict = collections.OrderedDict()


@dataclass
class AugmentConfig:
    """How strongly each random change may act; 0 (or ``scale=(1, 1)``) turns a change off.

    Example::

        >>> AugmentConfig(rotation=30, flip=0.0)          # turn up to 30 degrees, never flip
        >>> AugmentConfig.off()                            # no change at all
    """

    rotation: float = 15.0                    # degrees: turn by up to +- this
    scale: tuple[float, float] = (0.6, 1.0)   # zoom: a crop keeps this fraction of the area
    translate: float = 0.1                    # shift by up to this fraction of width / height
    flip: float = 0.5                         # probability of a left-right flip
    brightness: float = 0.2                   # multiply by a factor in [1 - b, 1 + b]
    contrast: float = 0.2                     # stretch around the mean grey by [1 - c, 1 + c]
    saturation: float = 0.2                   # blend with the grey image by [1 - s, 1 + s]
    hue: float = 0.05                         # rotate the colour wheel by up to +- this turn

    def __post_init__(self):
        self.scale = tuple(float(s) for s in self.scale)
        checks = [
            ("rotation", 0 <= self.rotation <= 180, "in [0, 180] degrees"),
            ("scale", len(self.scale) == 2 and 0 < self.scale[0] <= self.scale[1] <= 1,
             "a pair (lo, hi) with 0 < lo <= hi <= 1, e.g. (0.6, 1.0)"),
            ("translate", 0 <= self.translate <= 1, "in [0, 1] (a fraction of the image)"),
            ("flip", 0 <= self.flip <= 1, "a probability in [0, 1]"),
            ("brightness", self.brightness >= 0, ">= 0"),
            ("contrast", self.contrast >= 0, ">= 0"),
            ("saturation", self.saturation >= 0, ">= 0"),
            ("hue", 0 <= self.hue <= 0.5, "in [0, 0.5] (half a turn of the colour wheel)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"AugmentConfig.{name}={getattr(self, name)!r}: must be {rule}")

    @classmethod
    def off(cls) -> AugmentConfig:
        """The config that changes nothing (every image passes through as it is)."""
        return cls(rotation=0, scale=(1.0, 1.0), translate=0, flip=0, brightness=0, contrast=0,
                   saturation=0, hue=0)

    @classmethod
    def strong(cls) -> AugmentConfig:
        """The setting of notebook 01's overfitting experiment: more geometry, less colour.

        Turns of up to 30 degrees and shifts of up to 15 %, against the default 15 and 10 %,
        because position and rotation are what varies between generated shapes of one class;
        colour changes are halved and hue is left alone.
        """
        return cls(rotation=30, scale=(0.6, 1.0), translate=0.15, flip=0.5, brightness=0.1,
                   contrast=0.1, saturation=0.1, hue=0.0)

    @property
    def geometric(self) -> bool:
        """Whether any change moves pixels (crop, flip, rotation, shift)."""
        return bool(self.rotation or self.scale != (1.0, 1.0) or self.translate or self.flip)

    @property
    def colour(self) -> bool:
        """Whether any change alters colours."""
        return bool(self.brightness or self.contrast or self.saturation or self.hue)


def augmentation(image_size: int, *, kind: str = "standard", config: AugmentConfig | None = None,
                 normalize: bool = True):
    """A ``v2.Compose`` from a uint8 CHW image (any size) to a float ``image_size`` square.

    ``kind``: ``"none"`` (resize, centre crop: for validation), ``"standard"`` (random resized
    crop, flip, rotation and shift, colour jitter, as set by ``config``) or ``"randaugment"``
    (the random crop and flip, then ``v2.RandAugment``: no policy searched for, two operations
    drawn uniformly per image from a fixed list, all at one magnitude). All end in floats on 0..1,
    normalised with the ImageNet mean and std unless ``normalize=False`` (for showing them).

    Example::

        >>> tf = augmentation(64, kind="standard", config=AugmentConfig(rotation=30))
        >>> tf(torch.zeros(3, 100, 80, dtype=torch.uint8)).shape
        torch.Size([3, 64, 64])
    """
    import torch
    from torchvision.transforms import v2

    image_size = whole(image_size, "image_size", hint=" (pixels)")
    if kind not in KINDS:
        raise ValueError(f"unknown augmentation kind {kind!r}: use one of {', '.join(KINDS)}")
    config = AugmentConfig() if config is None else config
    if not isinstance(config, AugmentConfig):
        raise TypeError(f"config must be an AugmentConfig, got {type(config).__name__}")
    resize = [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
    steps = []
    if kind == "none":
        steps += resize
    else:
        if config.scale == (1.0, 1.0):
            steps += resize
        else:
            steps.append(v2.RandomResizedCrop(image_size, scale=config.scale, antialias=True))
        if config.flip:
            steps.append(v2.RandomHorizontalFlip(p=config.flip))
        if kind == "randaugment":
            # RandAugment brings its own rotations, shears and colours: the config's are unused.
            # Unlike AutoAugment it needs no policy search: num_ops=2 operations drawn uniformly
            # from 14, each at the same magnitude (9 on a scale of 31).
            steps.append(v2.RandAugment(interpolation=v2.InterpolationMode.BILINEAR))
        else:
            if config.rotation or config.translate:
                steps.append(v2.RandomAffine(degrees=config.rotation,
                                             translate=(config.translate, config.translate),
                                             interpolation=v2.InterpolationMode.BILINEAR))
            if config.colour:
                steps.append(v2.ColorJitter(brightness=config.brightness,
                                            contrast=config.contrast,
                                            saturation=config.saturation, hue=config.hue))
    steps.append(v2.ToDtype(torch.float32, scale=True))
    if normalize:
        steps.append(v2.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD))
    return v2.Compose(steps)


def normalize(batch, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """``(batch - mean) / std`` per channel, on the batch's device (after :func:`gpu_augment`).

    Example::

        >>> normalize(torch.full((2, 3, 8, 8), 0.5)).shape
        torch.Size([2, 3, 8, 8])
    """
    import torch

    mean = torch.as_tensor(mean, dtype=batch.dtype, device=batch.device).view(1, -1, 1, 1)
    std = torch.as_tensor(std, dtype=batch.dtype, device=batch.device).view(1, -1, 1, 1)
    return (batch - mean) / std


def gpu_augment(batch, config: AugmentConfig | None = None, generator=None):
    """Augment a float NCHW batch of 0..1 pixels where it lives (GPU or CPU), all at once.

    Every image gets its own random crop (zoom), flip, rotation and shift, folded into one
    affine matrix per image and applied by a single ``grid_sample``; then its own brightness,
    contrast, saturation and hue (a rotation in YIQ colour space, close to HSV's hue). No Python
    loop runs over the images, so the cost is a few kernels per batch. Corners that come from
    outside the image are black, as with torchvision's RandomAffine. Normalise afterwards.
    ``generator`` (a ``torch.Generator`` on any device) makes the draws repeatable.

    Example::

        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.rand(8, 3, 32, 32)
        >>> gpu_augment(x, AugmentConfig(rotation=30), generator=g).shape
        torch.Size([8, 3, 32, 32])
    """
    import torch

    config = AugmentConfig() if config is None else config
    for hook in tuple(_GPU_AUGMENT_HOOKS.values()):
        hook(batch, config)
    _check_batch(batch, config)
    n = batch.shape[0]
    draw_on = generator.device if generator is not None else batch.device

    def uniform(lo, hi):
        u = torch.rand(n, generator=generator, device=draw_on, dtype=torch.float32)
        return (lo + (hi - lo) * u).to(batch.device)

    out = batch
    if config.geometric:
        out = _warp(out, config, uniform)
    if config.colour:
        out = _jitter(out, config, uniform)
    return out


def register_gpu_augment_hook(hook):
    """Call ``hook(batch, config)`` at the start of every :func:`gpu_augment` call, however it
    was imported (before the batch is checked); returns a handle whose ``remove()`` ends it.

    The capstone grader (``labkit.capstone``) uses it to see whether training augmented.

    Example::

        >>> handle = register_gpu_augment_hook(lambda batch, config: print(tuple(batch.shape)))
        >>> _ = gpu_augment(torch.rand(2, 3, 8, 8))
        (2, 3, 8, 8)
        >>> handle.remove()
    """
    from torch.utils.hooks import RemovableHandle

    handle = RemovableHandle(_GPU_AUGMENT_HOOKS)
    _GPU_AUGMENT_HOOKS[handle.id] = hook
    return handle


def _check_batch(batch, config: AugmentConfig) -> None:
    import torch

    if not isinstance(config, AugmentConfig):
        raise TypeError(f"config must be an AugmentConfig, got {type(config).__name__}")
    if not isinstance(batch, torch.Tensor) or batch.dim() != 4 or not batch.is_floating_point():
        what = (f"a {batch.dim()}-d {batch.dtype} tensor" if isinstance(batch, torch.Tensor)
                else type(batch).__name__)
        raise ValueError(f"gpu_augment needs a float NCHW batch of 0..1 pixels, got {what}: "
                         f"convert uint8 images with batch.float() / 255 (add a batch dimension "
                         f"with unsqueeze(0) for one image)")
    channels = batch.shape[1]
    if channels not in (1, 3) or (channels == 1 and (config.saturation or config.hue)):
        raise ValueError(f"gpu_augment needs 3 (RGB) channels, or 1 with saturation=0 and hue=0; "
                         f"got {channels} channels in a batch of shape {tuple(batch.shape)}")


def _warp(batch, config: AugmentConfig, uniform):
    """One affine warp per image: output pixel -> where to read it in the input."""
    import torch
    import torch.nn.functional as F

    n, _, h, w = batch.shape
    side = uniform(*config.scale).sqrt()                     # crop side, as a fraction
    angle = uniform(-config.rotation, config.rotation) * (math.pi / 180)
    flip = torch.where(uniform(0, 1) < config.flip, -1.0, 1.0)
    # Coordinates run from -1 to 1: a crop of side f may sit anywhere within +-(1 - f).
    cx = uniform(-1, 1) * (1 - side) + uniform(-2, 2) * config.translate
    cy = uniform(-1, 1) * (1 - side) + uniform(-2, 2) * config.translate
    cos, sin = angle.cos(), angle.sin()
    # Rotating in pixels, not in the -1..1 square, keeps non-square images undistorted.
    theta = torch.stack([
        torch.stack([side * cos * flip, -side * sin * (h / w), cx], dim=1),
        torch.stack([side * sin * (w / h) * flip, side * cos, cy], dim=1),
    ], dim=1).to(batch.dtype)
    grid = F.affine_grid(theta, [n, batch.shape[1], h, w], align_corners=False)
    return F.grid_sample(batch, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _jitter(batch, config: AugmentConfig, uniform):
    """Brightness, contrast, saturation and hue, each with one random factor per image."""
    import torch

    def factor(amount):
        return uniform(max(0.0, 1 - amount), 1 + amount).view(-1, 1, 1, 1).to(batch.dtype)

    def grey(x):
        if x.shape[1] == 1:
            return x
        weights = torch.tensor(_GRAY, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        return (x * weights).sum(dim=1, keepdim=True)

    out = batch
    if config.brightness:
        out = (out * factor(config.brightness)).clamp(0, 1)
    if config.contrast:
        mean = grey(out).mean(dim=(1, 2, 3), keepdim=True)
        out = ((out - mean) * factor(config.contrast) + mean).clamp(0, 1)
    if config.saturation:
        g = grey(out)
        out = ((out - g) * factor(config.saturation) + g).clamp(0, 1)
    if config.hue:
        out = _rotate_hue(out, uniform(-config.hue, config.hue) * (2 * math.pi)).clamp(0, 1)
    return out


def _rotate_hue(batch, angle):
    """Turn each image's colours by ``angle`` radians around the grey axis (YIQ space)."""
    import torch

    to_yiq = torch.tensor([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322],
                           [0.211, -0.523, 0.312]], dtype=torch.float32, device=batch.device)
    cos, sin = angle.cos(), angle.sin()
    one, zero = torch.ones_like(cos), torch.zeros_like(cos)
    rot = torch.stack([torch.stack([one, zero, zero], 1), torch.stack([zero, cos, -sin], 1),
                       torch.stack([zero, sin, cos], 1)], 1)             # (n, 3, 3)
    matrix = (torch.linalg.inv(to_yiq) @ rot @ to_yiq).to(batch.dtype)
    return torch.einsum("nij,njhw->nihw", matrix, batch)

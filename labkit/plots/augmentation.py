"""Figures of notebook 01: one image under many random augmentations."""

from __future__ import annotations

from .._sizes import whole
from ._common import MAX_WIDTH_IN, course_figure

__all__ = ["check_image", "augmentation_grid"]


def check_image(image):
    """An H x W x 3 uint8 array (what skimage.data and PIL give), or a clear error."""
    import numpy as np

    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"image must be an H x W x 3 uint8 array (RGB), got shape "
                         f"{arr.shape} and dtype {arr.dtype}: e.g. skimage.data.astronaut(), or "
                         f"np.asarray(PIL.Image.open(path).convert('RGB'))")
    return arr


def _normalize_step(transform):
    """The Normalize inside a (nested) Compose, so its output can be shown in true colours."""
    from torchvision import transforms as v1
    from torchvision.transforms import v2

    if isinstance(transform, (v2.Normalize, v1.Normalize)):
        return transform
    for step in getattr(transform, "transforms", ()):
        found = _normalize_step(step)
        if found is not None:
            return found
    return None


def _displayable(out, normalize_step):
    """A transform's CHW output as an H x W x C float array on 0..1, for imshow."""
    import torch

    if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[0] not in (1, 3):
        what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"the transform must return a C x H x W tensor with 1 or 3 channels, "
                         f"got {what}: build it with labkit.augment.augmentation(...)")
    x = out.detach().cpu()
    if x.dtype == torch.uint8:
        x = x.float() / 255
    elif normalize_step is not None:  # undo (x - mean) / std to see real colours
        mean = torch.tensor(normalize_step.mean).view(-1, 1, 1)
        std = torch.tensor(normalize_step.std).view(-1, 1, 1)
        x = x.float() * std + mean
    return x.float().clamp(0, 1).permute(1, 2, 0).squeeze(-1).numpy()


@course_figure
def augmentation_grid(image, transform, n: int = 16, seed: int = 0):
    """The original image and ``n`` random augmentations of it, in a grid; returns the Figure.

    ``image`` is an H x W x 3 uint8 array; ``transform`` takes a uint8 C x H x W tensor (as
    ``labkit.augment.augmentation`` does). Normalised outputs are shown un-normalised. The same
    ``seed`` draws the same augmentations, without touching the global random state.

    Example::

        >>> from skimage.data import astronaut
        >>> from labkit.augment import augmentation
        >>> fig = augmentation_grid(astronaut(), augmentation(128), n=8)
    """
    import math

    import numpy as np
    import torch
    from matplotlib import pyplot as plt

    arr = check_image(image)
    n = whole(n, "n", hint=" (how many augmented copies)")
    # a copy: the image may be read-only (a PIL view), which torch.from_numpy warns about
    tensor = torch.from_numpy(np.array(arr, copy=True)).permute(2, 0, 1)
    step = _normalize_step(transform)
    with torch.random.fork_rng(devices=[]):  # the learner's own random stream stays untouched
        torch.manual_seed(seed)
        pictures = [_displayable(transform(tensor.clone()), step) for _ in range(n)]
    cols = math.ceil(math.sqrt(n + 1))
    rows = math.ceil((n + 1) / cols)
    cell = min(1.8, MAX_WIDTH_IN / cols)  # many copies: smaller cells, never a wider figure
    fig, axes = plt.subplots(rows, cols, figsize=(cell * cols, cell * rows), squeeze=False)
    cells = list(axes.flat)
    for ax, picture in zip(cells, [arr, *pictures], strict=False):
        ax.imshow(picture, cmap="gray" if picture.ndim == 2 else None)
        ax.set_axis_off()
    for ax in cells[n + 1:]:
        fig.delaxes(ax)
    cells[0].set_title("original")
    fig.tight_layout()
    return fig

"""labkit.augment: the config, the v2 pipelines, and the batched on-device augmentation."""

from __future__ import annotations

import pytest
import torch

from labkit.augment import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    KINDS,
    AugmentConfig,
    augmentation,
    gpu_augment,
    normalize,
)


def _image(h=40, w=56, seed=0):
    return torch.randint(0, 256, (3, h, w), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def _batch(n=8, h=24, w=32, seed=0, device="cpu"):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed)).to(device)


# ------------------------------------------------------------------------------------- config


def test_constants_are_torchvisions_imagenet_statistics():
    from torchvision.models import VGG16_Weights

    preset = VGG16_Weights.IMAGENET1K_V1.transforms()
    assert list(IMAGENET_MEAN) == list(preset.mean) and list(IMAGENET_STD) == list(preset.std)


def test_off_changes_nothing_and_the_default_changes_everything():
    off = AugmentConfig.off()
    assert not off.geometric and not off.colour
    assert AugmentConfig().geometric and AugmentConfig().colour
    assert AugmentConfig(scale=[0.5, 1]).scale == (0.5, 1.0)  # lists become tuples


def test_strong_moves_shapes_further_and_recolours_less_than_the_default():
    strong, default = AugmentConfig.strong(), AugmentConfig()
    assert strong.rotation > default.rotation and strong.translate > default.translate
    assert strong.brightness < default.brightness and strong.hue == 0
    assert strong is not AugmentConfig.strong()  # a fresh one each call: safe to change


@pytest.mark.parametrize("field, value", [
    ("rotation", -1), ("rotation", 200), ("scale", (0.0, 1.0)), ("scale", (0.9, 0.5)),
    ("scale", (0.5, 1.2)), ("scale", (0.5,)), ("translate", 1.5), ("flip", 1.1), ("flip", -0.1),
    ("brightness", -0.1), ("contrast", -1), ("saturation", -1), ("hue", 0.6),
])
def test_config_rejects_out_of_range_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"AugmentConfig\.{field}=.*must be"):
        AugmentConfig(**{field: value})


# -------------------------------------------------------------------------- v2 pipelines


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_gives_a_normalised_square(kind):
    out = augmentation(32, kind=kind)(_image())
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    raw = augmentation(32, kind=kind, normalize=False)(_image())
    assert 0 <= raw.min() and raw.max() <= 1


def test_none_is_deterministic_and_standard_is_random():
    image = _image()
    plain = augmentation(32, kind="none")
    assert torch.equal(plain(image), plain(image))
    standard = augmentation(32, kind="standard")
    torch.manual_seed(0)
    assert not torch.equal(standard(image), standard(image))


def test_standard_with_everything_off_is_none():
    image = _image()
    off = augmentation(32, kind="standard", config=AugmentConfig.off())
    assert torch.equal(off(image), augmentation(32, kind="none")(image))


def test_normalisation_maps_the_mean_colour_to_zero():
    mean_colour = torch.tensor([round(m * 255) for m in IMAGENET_MEAN], dtype=torch.uint8)
    image = mean_colour.view(3, 1, 1).expand(3, 20, 20).contiguous()
    assert augmentation(16, kind="none")(image).abs().max() < 0.01


def test_the_config_sets_the_pipeline_steps():
    from torchvision.transforms import v2

    config = AugmentConfig(rotation=0, translate=0, brightness=0, contrast=0, saturation=0, hue=0)
    names = [type(t).__name__ for t in augmentation(32, config=config).transforms]
    assert names == ["RandomResizedCrop", "RandomHorizontalFlip", "ToDtype", "Normalize"]
    steps = augmentation(32, config=AugmentConfig(rotation=25, hue=0.1)).transforms
    affine = next(t for t in steps if isinstance(t, v2.RandomAffine))
    jitter = next(t for t in steps if isinstance(t, v2.ColorJitter))
    assert affine.degrees == [-25.0, 25.0] and jitter.hue == (-0.1, 0.1)
    assert any(isinstance(t, v2.RandAugment)
               for t in augmentation(32, kind="randaugment").transforms)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"kind": "heavy"}, ValueError, r"unknown augmentation kind 'heavy'.*none, standard, rand"),
    ({"image_size": 0}, ValueError, r"image_size must be a whole number >= 1"),
    ({"image_size": 32.5}, ValueError, r"image_size must be a whole number >= 1"),
    ({"config": {"rotation": 5}}, TypeError, r"config must be an AugmentConfig"),
])
def test_augmentation_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        augmentation(**{"image_size": 32, **kwargs})


# ----------------------------------------------------------------- batched, on the device


def test_gpu_augment_keeps_shape_dtype_and_range():
    x = _batch()
    out = gpu_augment(x, AugmentConfig(rotation=40, hue=0.3, brightness=0.8),
                      generator=torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert 0 <= out.min() and out.max() <= 1
    assert not torch.equal(out, x)


def test_gpu_augment_is_repeatable_with_a_seeded_generator():
    x = _batch()

    def run(seed):
        return gpu_augment(x, AugmentConfig(), generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(3), run(3))
    assert not torch.equal(run(3), run(4))


def test_gpu_augment_with_everything_off_is_the_identity():
    x = _batch()
    assert torch.equal(gpu_augment(x, AugmentConfig.off()), x)


def test_certain_flip_mirrors_every_image():
    x = _batch()
    flip_only = AugmentConfig(**{**vars(AugmentConfig.off()), "flip": 1.0})
    assert torch.allclose(gpu_augment(x, flip_only), x.flip(-1), atol=1e-5)


def test_each_image_draws_its_own_changes():
    x = torch.full((16, 3, 8, 8), 0.5)
    bright = AugmentConfig(**{**vars(AugmentConfig.off()), "brightness": 0.5})
    per_image = gpu_augment(x, bright, generator=torch.Generator().manual_seed(0)).mean((1, 2, 3))
    assert len(set(per_image.tolist())) == 16  # 16 different factors, one per image
    assert per_image.min() >= 0.25 - 1e-6 and per_image.max() <= 0.75 + 1e-6


def test_zoom_alone_stays_inside_the_image():
    x = torch.full((8, 3, 16, 20), 0.7)
    zoom = AugmentConfig(**{**vars(AugmentConfig.off()), "scale": (0.3, 0.9)})
    assert torch.allclose(gpu_augment(x, zoom), x, atol=1e-5)  # no black border came in


def test_rotation_brings_black_corners_in():
    x = torch.ones(32, 3, 16, 16)
    turn = AugmentConfig(**{**vars(AugmentConfig.off()), "rotation": 45})
    out = gpu_augment(x, turn, generator=torch.Generator().manual_seed(0))
    assert out[:, :, 0, 0].min() < 0.5 and out[:, :, 8, 8].min() > 0.99


def test_grey_batches_take_brightness_and_contrast():
    grey = torch.rand(4, 1, 8, 8)
    config = AugmentConfig(saturation=0, hue=0)
    assert gpu_augment(grey, config).shape == grey.shape


@pytest.mark.parametrize("batch, config, match", [
    (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), AugmentConfig(), r"float NCHW.*uint8.*/ 255"),
    (torch.zeros(3, 8, 8), AugmentConfig(), r"float NCHW.*3-d.*unsqueeze"),
    ([[0.0]], AugmentConfig(), r"float NCHW.*list"),
    (torch.zeros(2, 4, 8, 8), AugmentConfig(), r"3 \(RGB\) channels.*got 4"),
    (torch.zeros(2, 1, 8, 8), AugmentConfig(), r"saturation=0 and hue=0"),
])
def test_gpu_augment_rejects_what_it_cannot_augment(batch, config, match):
    with pytest.raises(ValueError, match=match):
        gpu_augment(batch, config)


def test_gpu_augment_wants_a_config():
    with pytest.raises(TypeError, match="AugmentConfig"):
        gpu_augment(_batch(), {"rotation": 3})


def test_normalize_on_a_batch():
    x = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1).expand(2, 3, 4, 4)
    assert normalize(x).abs().max() < 1e-6
    assert normalize(torch.ones(1, 3, 1, 1), mean=(0, 0, 0), std=(2, 2, 2)).eq(0.5).all()


@pytest.mark.gpu
def test_gpu_augment_on_cuda_matches_the_cpu_draws():
    x = _batch(n=64, h=64, w=64)
    config = AugmentConfig(rotation=30, hue=0.2)
    on_cpu = gpu_augment(x, config, generator=torch.Generator().manual_seed(0))
    # A CPU generator drives a CUDA batch: the same draws, so the same images up to rounding.
    on_gpu = gpu_augment(x.cuda(), config, generator=torch.Generator().manual_seed(0))
    assert on_gpu.device.type == "cuda"
    assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-3)
    g = torch.Generator(device="cuda")
    first = gpu_augment(x.cuda(), config, generator=g.manual_seed(1))
    assert torch.equal(first, gpu_augment(x.cuda(), config, generator=g.manual_seed(1)))
    half = gpu_augment(x.cuda().bfloat16(), config)
    assert half.dtype == torch.bfloat16 and half.shape == x.shape

"""labkit.models: VGG16's layout, width and size knobs, checkpoint loading, transfer helpers.

Checkpoints are tiny ones the tests write (width 1/16); the ImageNet file itself (528 MB) is
never needed: its expected name is checked against torchvision, and the hub-cache lookup is
exercised with a small stand-in under a temporary TORCH_HOME.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from labkit import models
from labkit.models import (
    IMAGENET,
    convnet,
    count_parameters,
    freeze,
    imagenet_checkpoint_path,
    load_checkpoint,
    replace_head,
    small_cnn,
    train_mode,
    unfreeze,
    vgg16,
)

W = 1 / 16  # 4..32 channels, hidden 256: a VGG16 that builds and runs in milliseconds


def _same(a: nn.Module, b: nn.Module, prefix: str = "") -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa if k.startswith(prefix))


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty torch hub cache in tmp_path (TORCH_HOME), as a fresh machine has."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # forget any torch.hub.set_dir()
    return tmp_path / "hub" / "checkpoints"


@pytest.fixture
def tiny_imagenet(hub, monkeypatch):
    """A stand-in "ImageNet" checkpoint (width 1/16, 1000 classes) where "auto" looks for it."""
    monkeypatch.setattr(models, "IMAGENET", models.ImageNetWeights(file="tiny-vgg16.pth", width=W))
    hub.mkdir(parents=True)
    torch.manual_seed(1)
    source = vgg16(1000, width=W, image_size=32)
    torch.save(source.state_dict(), hub / "tiny-vgg16.pth")
    return source


# ------------------------------------------------------------------------------ architecture


def test_layout_and_keys_match_torchvision():
    import torchvision

    with torch.device("meta"):  # full size without allocating 528 MB
        ours, theirs = vgg16(), torchvision.models.vgg16()
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b)
    assert all(a[k].shape == b[k].shape for k in a)
    assert str(ours).replace("VGG16(", "VGG(", 1) == str(theirs)
    assert count_parameters(ours) == (138_357_544, 138_357_544)


def test_batch_norm_variant_matches_torchvisions_vgg16_bn():
    import torchvision

    with torch.device("meta"):
        ours, theirs = vgg16(batch_norm=True), torchvision.models.vgg16_bn()
    a, b = ours.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and all(a[k].shape == b[k].shape for k in a)


def test_imagenet_file_is_torchvisions():
    from torchvision.models import VGG16_BN_Weights, VGG16_Weights

    assert VGG16_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[1] == IMAGENET.file
    assert VGG16_BN_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[1] == IMAGENET.file_bn
    assert imagenet_checkpoint_path().parts[-2:] == ("checkpoints", IMAGENET.file)
    assert imagenet_checkpoint_path(batch_norm=True).name == IMAGENET.file_bn


def test_width_scales_every_conv_and_the_hidden_layers():
    model = vgg16(10, width=1 / 8, image_size=64)
    convs = [m for m in model.features if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 8, 16, 16, 32, 32, 32] + [64] * 6
    assert model.classifier[0].in_features == 64 * 7 * 7
    assert model.classifier[0].out_features == model.classifier[3].out_features == 512
    assert model.classifier[6].out_features == 10
    assert model.width == 1 / 8 and model.image_size == 64


@pytest.mark.parametrize("size", [32, 64, 50])
def test_forward_shapes(size):
    model = vgg16(7, width=W, image_size=size)
    assert model(torch.zeros(2, 3, size, size)).shape == (2, 7)


@pytest.mark.parametrize("kwargs, match", [
    ({"image_size": 16}, r"image_size must be a whole number >= 32, got 16: too small"),
    ({"image_size": 31}, r"image_size must be a whole number >= 32"),
    ({"image_size": 64.0}, r"image_size must be a whole number >= 32"),
    ({"width": 0}, r"width must be > 0"),
    ({"width": -1}, r"width must be > 0"),
    ({"num_classes": 0}, r"num_classes must be a whole number >= 1"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
])
def test_bad_arguments_say_what_to_use(kwargs, match):
    with pytest.raises(ValueError, match=match):
        vgg16(**{"width": W, **kwargs})


# -------------------------------------------------------------------------- loading from files


def test_saved_model_loads_back_with_equal_outputs(tmp_path):
    torch.manual_seed(0)
    source = vgg16(10, width=W, image_size=32).eval()
    torch.save(source.state_dict(), tmp_path / "m.pth")
    torch.manual_seed(1)
    loaded = vgg16(10, width=W, image_size=32, pretrained=tmp_path / "m.pth").eval()
    x = torch.randn(3, 3, 32, 32)
    assert torch.equal(source(x), loaded(x))
    assert _same(source, vgg16(10, width=W, image_size=32, pretrained=str(tmp_path / "m.pth")))


def test_other_num_classes_loads_features_and_keeps_a_new_head(tmp_path, capsys):
    torch.manual_seed(0)
    source = vgg16(10, width=W, image_size=32)
    torch.save(source.state_dict(), tmp_path / "base.pth")
    model = vgg16(3, width=W, image_size=32, pretrained=tmp_path / "base.pth")
    assert _same(source, model, "features.")
    assert torch.equal(source.classifier[0].weight, model.classifier[0].weight)  # hidden layers
    assert torch.equal(source.classifier[3].weight, model.classifier[3].weight)
    assert model.classifier[6].weight.shape == (3, 256)
    assert "kept classifier.6 newly initialised" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("wrap", [
    lambda sd: {"model": sd, "epoch": 3},
    lambda sd: {"state_dict": sd},
    lambda sd: {f"module.{k}": v for k, v in sd.items()},         # saved from DDP
    lambda sd: {f"_orig_mod.{k}": v for k, v in sd.items()},      # saved from torch.compile
])
def test_wrapped_checkpoints_load(tmp_path, wrap):
    source = vgg16(10, width=W)
    torch.save(wrap(source.state_dict()), tmp_path / "ckpt.pth")
    assert _same(source, load_checkpoint(vgg16(10, width=W), tmp_path / "ckpt.pth"))


def test_checkpoint_of_another_width_names_the_key_and_shapes(tmp_path):
    torch.save(vgg16(10, width=1 / 8).state_dict(), tmp_path / "wide.pth")
    with pytest.raises(ValueError, match=r"features\.0\.weight has shape \(8, 3, 3, 3\) in the "
                                         r"file but \(4, 3, 3, 3\) here.*width"):
        vgg16(10, width=W, pretrained=tmp_path / "wide.pth")


@pytest.mark.parametrize("content, match", [
    (lambda: nn.Linear(2, 2).state_dict(), r"not a VGG16 state dict: it lacks 'features\.0"),
    (lambda: {**vgg16(10, width=W).state_dict(), "extra.weight": torch.zeros(1)},
     r"has 'extra\.weight', which VGG16 lacks"),
    (lambda: [torch.zeros(1)], r"holds no state dict"),
    (lambda: {"step": 3}, r"holds no state dict"),
])
def test_checkpoints_that_are_not_vgg16_state_dicts(tmp_path, content, match):
    torch.save(content(), tmp_path / "other.pth")
    with pytest.raises(ValueError, match=match):
        vgg16(10, width=W, pretrained=tmp_path / "other.pth")


def test_unreadable_and_unsafe_files_are_refused(tmp_path):
    (tmp_path / "junk.pth").write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"cannot read .*junk\.pth.*torch\.save"):
        vgg16(10, width=W, pretrained=tmp_path / "junk.pth")
    torch.save({"features.0.weight": torch.zeros(1), "hook": print}, tmp_path / "code.pth")
    with pytest.raises(ValueError, match="cannot read"):  # weights_only=True: no code runs
        vgg16(10, width=W, pretrained=tmp_path / "code.pth")


def test_missing_checkpoint_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint file at .*nope\.pth.*torch\.save"):
        vgg16(10, width=W, pretrained=tmp_path / "nope.pth")


@pytest.mark.parametrize("value", ["imagenet1k", "IMAGENET", True, 3])
def test_unknown_pretrained_value_lists_the_valid_ones(value):
    with pytest.raises(ValueError, match=r"unknown pretrained=.*None.*'auto', 'imagenet'.*\.pth"):
        vgg16(10, width=W, pretrained=value)


# --------------------------------------------------------------- ImageNet from the hub cache


def test_auto_finds_the_hub_cache_checkpoint(tiny_imagenet, capsys):
    model = vgg16(1000, width=W, image_size=32, pretrained="auto")
    assert _same(tiny_imagenet, model)
    assert _same(tiny_imagenet, vgg16(1000, width=W, image_size=32, pretrained="imagenet"))
    assert capsys.readouterr().out == ""
    five = vgg16(5, width=W, image_size=32, pretrained="auto")  # transfer learning's start
    assert _same(tiny_imagenet, five, "features.")
    assert five.classifier[6].out_features == 5


def test_auto_without_the_file_starts_random_and_says_where_to_put_it(hub, monkeypatch, capsys):
    monkeypatch.setattr(models, "IMAGENET", models.ImageNetWeights(file="tiny-vgg16.pth", width=W))
    model = vgg16(10, width=W, pretrained="auto")
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    assert f"no ImageNet weights at {hub / 'tiny-vgg16.pth'}" in out and "random" in out
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_imagenet_without_the_file_says_how_to_get_it(hub):
    with pytest.raises(FileNotFoundError) as info:
        vgg16(10, pretrained="imagenet")
    message = str(info.value)
    assert str(hub / IMAGENET.file) in message
    assert 'torchvision.models.vgg16(weights="IMAGENET1K_V1")' in message
    assert "pretrained=\"auto\"" in message


@pytest.mark.parametrize("value", ["auto", "imagenet"])
def test_imagenet_weights_need_full_width(value):
    with pytest.raises(ValueError, match=r"width=1\.0 only.*pretrained=None"):
        vgg16(10, width=0.5, pretrained=value)


def test_hub_dir_follows_torch_home(hub):
    assert imagenet_checkpoint_path() == hub / IMAGENET.file
    assert str(imagenet_checkpoint_path()).startswith(os.environ["TORCH_HOME"])


# ------------------------------------------------------------------- transfer-learning helpers


def test_freeze_unfreeze_and_count():
    model = vgg16(10, width=W)
    trainable, total = count_parameters(model)
    assert trainable == total == sum(p.numel() for p in model.parameters())
    assert freeze(model.features) is model.features
    base = sum(p.numel() for p in model.features.parameters())
    assert count_parameters(model) == (total - base, total)
    unfreeze(model.features)
    assert count_parameters(model) == (total, total)


def test_train_mode_keeps_frozen_batch_norm_in_eval_mode():
    model = vgg16(10, width=W, image_size=32, batch_norm=True)
    norms = [m for m in model.features if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 13
    assert train_mode(model) is model and all(m.training for m in model.modules())
    train_mode(freeze(model.features))
    assert not any(m.training for m in norms)
    assert model.training and model.classifier.training and model.features[0].training
    unfreeze(model.features)
    assert all(m.training for m in train_mode(model).modules())


def test_train_mode_leaves_running_statistics_of_a_frozen_base_alone():
    model = vgg16(10, width=W, image_size=32, batch_norm=True)
    freeze(model.features)
    before = {k: v.clone() for k, v in model.features.state_dict().items()}
    x = torch.randn(4, 3, 32, 32)
    model.train()  # a plain train(): every BatchNorm updates its statistics
    model(x)
    moved = [k for k, v in model.features.state_dict().items() if not torch.equal(v, before[k])]
    assert moved and all(k.rsplit(".", 1)[1] in ("running_mean", "running_var",
                                                  "num_batches_tracked") for k in moved)
    model.features.load_state_dict(before)
    train_mode(model)
    model(x)
    assert all(torch.equal(v, before[k]) for k, v in model.features.state_dict().items())


def test_train_mode_trains_batch_norm_without_parameters():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, affine=False))
    freeze(model)
    assert train_mode(model)[1].training  # no parameters: it cannot be told frozen


def test_replace_head_gives_a_new_trainable_layer():
    model = vgg16(1000, width=W)
    freeze(model)
    old = model.classifier[6]
    assert replace_head(model, 5) is model
    new = model.classifier[6]
    assert new is not old and (new.in_features, new.out_features) == (256, 5)
    assert count_parameters(model) == (256 * 5 + 5, count_parameters(model)[1])
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 5)


def test_replace_head_errors():
    with pytest.raises(ValueError, match="num_classes must be a whole number >= 1"):
        replace_head(vgg16(10, width=W), 0)
    with pytest.raises(TypeError, match=r"VGG-style model.*Linear"):
        replace_head(nn.Sequential(nn.Linear(2, 2)), 3)


# ------------------------------------------------------------ small nets of the DDP lessons


def test_convnet_has_66218_parameters_at_the_default_width():
    assert sum(p.numel() for p in convnet().parameters()) == 66218


@pytest.mark.parametrize("size", [16, 32, 64])
def test_convnet_takes_any_image_size(size):
    assert convnet()(torch.zeros(2, 3, size, size)).shape == (2, 10)


def test_convnet_classes_width_and_channels():
    model = convnet(num_classes=5, width=8, in_channels=1)
    assert model(torch.zeros(3, 1, 32, 32)).shape == (3, 5)
    assert model[0].out_channels == 8 and model[-1].in_features == 16
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("image_size", [16, 32])
def test_small_cnn_output_shape(image_size):
    model = small_cnn(7, image_size=image_size)
    assert model(torch.zeros(4, 3, image_size, image_size)).shape == (4, 7)


def test_small_cnn_has_batch_norm_only_when_asked():
    def norms(model):
        return [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)]

    assert norms(small_cnn(width=8)) == []
    with_bn = small_cnn(width=8, batch_norm=True)
    assert norms(with_bn) == [8, 16]
    assert with_bn(torch.zeros(2, 3, 16, 16)).shape == (2, 10)


@pytest.mark.parametrize("image_size", [0, 2, 6, 18])
def test_small_cnn_image_size_must_be_a_multiple_of_4(image_size):
    with pytest.raises(ValueError, match=f"image_size must be a multiple of 4.*got {image_size}"):
        small_cnn(image_size=image_size)


# ------------------------------------------------------------------------- VGG16's FLOPs


def _counted_forward_flops(image_size, width, num_classes, device="cpu"):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from labkit.models import vgg16

    with torch.device(device):
        model = vgg16(num_classes, width=width, image_size=max(image_size, 32))
        x = torch.zeros(1, 3, image_size, image_size)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(x)
    return counter.get_total_flops()


@pytest.mark.parametrize("image_size, width, num_classes", [
    (32, 1 / 16, 10), (64, 1 / 8, 1000), (50, 0.3, 7),
])
def test_vgg16_flops_match_torchs_flop_counter(image_size, width, num_classes):
    assert models.vgg16_flops(image_size, width, num_classes) == _counted_forward_flops(
        image_size, width, num_classes)


def test_full_vgg16_is_31_gflop_forward():
    flops = models.vgg16_flops()
    assert flops == _counted_forward_flops(224, 1.0, 1000, device="meta")  # no 528 MB allocated
    assert flops / 2 == pytest.approx(15.47e9, rel=0.01)  # the often quoted 15.5 GMACs


@pytest.mark.parametrize("kwargs, match", [
    ({"image_size": 16}, r"image_size must be a whole number >= 32"),
    ({"image_size": 64.0}, r"image_size must be a whole number >= 32"),
    ({"width": 0}, r"width must be > 0"),
])
def test_vgg16_flops_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.vgg16_flops(**kwargs)

"""Notebook 01's graders (PyTorch): wrong answers that look right get their hint, and valid
answers written otherwise than the reference pass.

tests/test_check.py holds the first tests of these graders; these add the cases where a step
that cannot act, a pipeline left unnormalised, a head frozen in part, coins that ignore the
generator, a change of dtype, or a size from the notebook used to pass or to fail obscurely.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from labkit import augment, data
from labkit.exercises import augmentation

MEAN, STD = augment.IMAGENET_MEAN, augment.IMAGENET_STD


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_HOME", str(tmp_path))  # progress is recorded away from the user's


def said(verdict, text):
    return not verdict and text in verdict.hint + verdict.detail


# ---- augmentation_pipeline ----------------------------------------------------------------------

def _pipeline(*steps, scale=True, normalize=True):
    tail = [v2.ToDtype(torch.float32, scale=scale)]
    if normalize:
        tail.append(v2.Normalize(MEAN, STD))
    return v2.Compose([v2.Resize((32, 32), antialias=True), *steps, *tail])


def test_augmentation_pipeline_nested_pipelines_pass_too():
    nested = _pipeline(v2.Compose([v2.RandomHorizontalFlip(),
                                   v2.RandomApply([v2.RandomRotation(20)], p=0.9)]))
    verdict = augmentation.augmentation_pipeline(nested, 32)
    assert verdict and "normalised float32 3x32x32" in verdict.detail


def test_augmentation_pipeline_wrong_flip_that_never_flips():
    # the rotation makes every call differ, which hid the flip that does nothing
    verdict = augmentation.augmentation_pipeline(
        _pipeline(v2.RandomHorizontalFlip(p=0.0), v2.RandomRotation(15)), 32)
    assert said(verdict, "its flip step never flips") and "the default, 0.5" in verdict.hint


def test_augmentation_pipeline_wrong_rotation_by_zero_degrees():
    verdict = augmentation.augmentation_pipeline(
        _pipeline(v2.RandomHorizontalFlip(), v2.RandomRotation(0)), 32)
    assert said(verdict, "turns by 0 degrees") and "RandomRotation(d)" in verdict.hint


def test_augmentation_pipeline_wrong_not_normalised():
    verdict = augmentation.augmentation_pipeline(
        _pipeline(v2.RandomHorizontalFlip(), v2.RandomRotation(15), normalize=False), 32)
    assert said(verdict, "not normalised: no Normalize step")
    assert "v2.Normalize(augment.IMAGENET_MEAN" in verdict.hint


def test_augmentation_pipeline_wrong_pixels_not_scaled_before_normalize():
    verdict = augmentation.augmentation_pipeline(
        _pipeline(v2.RandomHorizontalFlip(), v2.RandomRotation(15), scale=False), 32)
    assert said(verdict, "not scaled to 0..1 first") and "scale=True" in verdict.hint


# ---- frozen_base --------------------------------------------------------------------------------

class Net(torch.nn.Module):
    """A base and a head of two layers, as VGG's classifier has several."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
        self.classifier = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                              torch.nn.Linear(8, 2))


def test_frozen_base_wrong_head_frozen_but_its_last_layer():
    model = Net()
    for p in model.parameters():  # everything frozen, then only the last layer unfrozen
        p.requires_grad = False
    for p in model.classifier[-1].parameters():
        p.requires_grad = True
    verdict = augmentation.frozen_base(model)
    assert said(verdict, "40 of the head's 58 parameters are frozen too")
    assert "every parameter of model.classifier trains" in verdict.hint


def test_frozen_base_requires_grad_on_the_module_passes_too():
    model = Net()
    model.features.requires_grad_(False)  # the module's method: every parameter at once
    verdict = augmentation.frozen_base(model)
    assert verdict and "58 head parameters train" in verdict.detail


# ---- per_image_flip -----------------------------------------------------------------------------

def _coins(batch, p, generator):
    return (torch.rand(len(batch), generator=generator) < p).view(-1, 1, 1, 1)


def _own_seed(batch, p, generator=None):
    coins = _coins(batch, p, torch.Generator().manual_seed(0))  # not the generator given
    return torch.where(coins, batch.flip(-1), batch)


def _blended(batch, p, generator=None):
    coins = _coins(batch, p, generator).float()  # float32, whatever the batch
    return coins * batch.flip(-1) + (1 - coins) * batch


def _bernoulli(batch, p, generator=None):  # valid, written otherwise: a mask and a copy
    mask = torch.bernoulli(torch.full((len(batch),), float(p)), generator=generator).bool()
    out = batch.clone()
    out[mask] = batch[mask].flip(3)
    return out


def test_per_image_flip_wrong_seed_fixed_inside():
    verdict = augmentation.per_image_flip(_own_seed)
    assert said(verdict, "generators seeded 1 and 2 gave the same flips")
    assert "torch.rand(n, generator=generator)" in verdict.hint


def test_per_image_flip_wrong_float32_coins_promote_a_half_batch():
    verdict = augmentation.per_image_flip(_blended)
    assert said(verdict, "a float16 batch came back torch.float32")
    assert "keep the batch's dtype" in verdict.hint


def test_per_image_flip_a_mask_and_a_copy_passes_too():
    verdict = augmentation.per_image_flip(_bernoulli)
    assert verdict and "a float16 batch stays float16" in verdict.detail


# ---- fair_gap -----------------------------------------------------------------------------------

def _gap(size=None, batch_size=256):
    """Train minus validation accuracy, fairly, at ``size`` (the argument when None)."""
    def gap(model, train_set, val_set, image_size):
        plain = augment.augmentation(size or image_size, kind="none")
        model.eval()

        def accuracy(images):
            loader = DataLoader(data.to_torch(images, plain), batch_size=batch_size)
            with torch.no_grad():
                hits = [(model(x).argmax(1) == y) for x, y in loader]
            return torch.cat(hits).float().mean().item()

        return accuracy(train_set) - accuracy(val_set)
    return gap


def test_fair_gap_wrong_image_size_from_the_notebook():
    verdict = augmentation.fair_gap(_gap(size=32))  # the notebook's exp_size, not image_size
    assert said(verdict, "the model was given 32x32 images; the check's are 16x16")
    assert "the image_size argument" in verdict.hint


def test_fair_gap_small_batches_counted_over_the_whole_set_pass_too():
    assert augmentation.fair_gap(_gap(batch_size=7))

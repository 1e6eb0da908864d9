"""labkit.check: exercise checks pass right answers, and say what is missing otherwise."""

import pytest
import torch
from torchvision.transforms import v2

from labkit import check

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


def tail():
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]


def test_a_good_pipeline_passes(capsys):
    good = v2.Compose([v2.RandomResizedCrop(32, scale=(0.7, 1.0)), v2.RandomHorizontalFlip(),
                       v2.RandomRotation(15), *tail()])
    assert check.augmentation_pipeline(good, 32)
    assert "[pass] augmentation pipeline" in capsys.readouterr().out


@pytest.mark.parametrize("steps, needs, said", [
    ([v2.Resize((32, 32)), v2.RandomRotation(15)], ("flip", "rotation"), "no flip step"),
    ([v2.Resize((32, 32)), v2.RandomHorizontalFlip()], ("flip", "rotation"), "no rotation step"),
    ([v2.Resize((32, 32)), v2.RandomHorizontalFlip(p=0.0), v2.RandomRotation(0)],
     ("flip", "rotation"), "nothing random happens"),
    ([v2.Resize((40, 40)), v2.RandomHorizontalFlip(), v2.RandomRotation(15)],
     ("flip", "rotation"), "output shape (3, 40, 40)"),
    ([v2.Resize((32, 32)), v2.RandomHorizontalFlip()], ("flip", "policy"), "no policy step"),
])
def test_a_pipeline_that_misses_something_gets_a_hint(capsys, steps, needs, said):
    verdict = check.augmentation_pipeline(v2.Compose([*steps, *tail()]), 32, needs=needs)
    assert not verdict
    out = capsys.readouterr().out
    assert "[not yet]" in out and said in out and "hint:" in out


def test_a_pipeline_without_float_output_is_told_how_to_end():
    verdict = check.augmentation_pipeline(
        v2.Compose([v2.RandomResizedCrop(32), v2.RandomHorizontalFlip(),
                    v2.RandomRotation(10)]), 32)
    assert not verdict and "ToDtype" in verdict.hint


def test_a_pipeline_that_crashes_is_reported_not_raised():
    def broken(image):
        raise RuntimeError("kaput")

    verdict = check.augmentation_pipeline(broken, 32)
    assert not verdict and "kaput" in verdict.detail


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Conv2d(3, 4, 3)
        self.classifier = torch.nn.Linear(4, 2)


def test_frozen_base():
    model = Net()
    assert not check.frozen_base(model)  # nothing frozen yet
    for p in model.features.parameters():
        p.requires_grad = False
    assert check.frozen_base(model)
    for p in model.classifier.parameters():
        p.requires_grad = False
    verdict = check.frozen_base(model)
    assert not verdict and "nothing would learn" in verdict.detail


def test_in_band_prints_a_verdict_and_never_raises_on_a_noisy_figure(capsys):
    assert check.in_band("gap", 0.48, 0.3, 1.0, cause="few epochs")
    assert capsys.readouterr().out == "[as expected] gap: measured 0.48, expected 0.3 to 1\n"
    verdict = check.in_band("gap", 0.1, 0.3, cause="few epochs")
    out = capsys.readouterr().out
    assert not verdict and "[outside the expected band]" in out and "at least 0.3" in out
    assert "likely cause: few epochs" in out and verdict.hint == "likely cause: few epochs"
    assert not check.in_band("accuracy", float("nan"), high=1.0, cause="a loss became NaN")
    assert "at most 1" in capsys.readouterr().out


def test_in_band_wants_low_below_high():
    with pytest.raises(ValueError, match="low <= high.*swap them"):
        check.in_band("gap", 0.5, 1.0, 0.3, cause="-")


def test_solutions_only_when_asked(capsys):
    assert "requires_grad = False" in check.solution("frozen_base")
    assert "requires_grad" in capsys.readouterr().out
    with pytest.raises(KeyError, match="choose from augmentation_pipeline, frozen_base"):
        check.solution("nope")

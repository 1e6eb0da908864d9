"""labkit.explorers: each explorer is built, a control is moved, and what it shows follows.

The rendering is ipywidgets' and happens in the browser; here a control's value is set as a
slider would set it and the explorer's picture, text and result are read back.
"""

from __future__ import annotations

import pytest

from labkit.explorers import augmentation_explorer, planner_explorer, schedule_explorer
from labkit.planner import Cluster, Degrees, Model

SEVEN_B = Model("7B", params=6.7e9, layers=32, hidden=4096, heads=32, seq_len=2048,
                micro_batch=1, flash_attention=True)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    from matplotlib import pyplot as plt

    plt.close("all")


def _photo(h=40, w=48):
    import numpy as np

    return np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ---- augmentation (notebook 01) ----------------------------------------------------------------


def test_augmentation_explorer_redraws_when_a_slider_moves(monkeypatch):
    import ipywidgets as widgets

    from labkit import explorers, plots

    draws = []
    real = plots.augmentation_grid

    def counting(*args, **kwargs):
        draws.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(plots, "augmentation_grid", counting)
    explorer = explorers.augmentation_explorer(_photo(), image_size=24, n=3)
    assert isinstance(explorer, widgets.VBox)
    sliders = {s.description: s for s in explorer.children[0].children[0].children
               + explorer.children[0].children[1].children}
    assert set(sliders) == {"rotation (deg)", "zoom", "shift", "flip p", "brightness",
                            "contrast", "saturation", "hue"}
    picture = explorer.children[1]
    assert isinstance(picture, widgets.Image) and picture.value[:4] == b"\x89PNG"
    assert len(draws) == 1
    before = picture.value
    sliders["rotation (deg)"].value = 60
    sliders["zoom"].value = 0.5
    assert len(draws) == 3 and picture.value != before
    config = explorer.config()
    assert config.rotation == 60 and config.scale == (0.5, 1.0)


def test_augmentation_explorer_rejects_a_bad_image():
    with pytest.raises(ValueError, match="uint8"):
        augmentation_explorer(_photo().astype(float))


# ---- pipeline schedules (notebook 10) --------------------------------------------------------


def test_schedule_explorer_updates_and_reports():
    box = schedule_explorer(stages=2, m=4, chunks=2)
    assert box.result["name"] == "interleaved 1f1b" and box.result["chunks"] == 2
    assert bytes(box.children[-1].value).startswith(b"\x89PNG")
    assert "bubble 0.111 of the step, formula 0.111" in box.children[-2].value
    sliders = box.children[0].children + box.children[1].children
    sliders[1].value = 3  # m=3 does not split into groups of 2: the message, not a figure
    assert box.result is None and "not a multiple of 2" in box.children[-2].value
    sliders[3].value = "gpipe"  # the chunks slider is ignored for one-chunk schedules
    assert box.result["name"] == "gpipe" and box.result["chunks"] == 1
    assert box.update()["m"] == 3


# ---- the planner (notebook 10) ---------------------------------------------------------------


def test_planner_explorer_builds_redraws_and_reports_refusals():
    import ipywidgets as widgets

    box = planner_explorer(SEVEN_B, Cluster(devices=8, memory_gib=80))
    assert isinstance(box, widgets.VBox)
    controls = box.controls
    assert controls["preset"].options[0] == "yours" and "llama3-405b" in controls["preset"].options
    picture = box.children[2]
    assert picture.value[:4] == b"\x89PNG"
    assert box.plan().degrees == Degrees(dp=8, microbatches=1) and not box.plan().fits
    controls["zero"].value = 1
    assert box.plan().fits and "fits" in box.children[3].value
    before = picture.value
    controls["tp"].value = 2
    assert box.plan().degrees.dp == 4 and picture.value != before
    controls["tp"].value = 8
    controls["pp"].value = 2  # 16 ranks on 8 devices: refused, and said so
    assert box.plan() is None and "refused" in box.children[3].value
    controls["preset"].value = "gpt3-175b"
    assert box.plan().fits and box.plan().degrees.pp == 8
    box.update()

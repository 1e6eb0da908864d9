"""labkit.explorers: each explorer is built, a control is moved, and what it shows follows.

The controls are ipywidgets and render in the browser; here a control's value is set as a
slider would set it and the explorer's figure, text and result are read back. The figure and
text are ordinary outputs of the cell, updated in place through display handles: what they
last held is what a saved notebook shows without a kernel.
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
    picture = explorer.figure
    assert picture.png[:4] == b"\x89PNG" and "rotation (deg)" in picture.text
    assert len(draws) == 1
    before = picture.png
    sliders["rotation (deg)"].value = 60
    sliders["zoom"].value = 0.5
    assert len(draws) == 3 and picture.png != before
    config = explorer.config()
    assert config.rotation == 60 and config.scale == (0.5, 1.0)


def test_augmentation_explorer_rejects_a_bad_image():
    with pytest.raises(ValueError, match="uint8"):
        augmentation_explorer(_photo().astype(float))


# ---- pipeline schedules (notebook 10) --------------------------------------------------------


def test_schedule_explorer_updates_and_reports():
    box = schedule_explorer(stages=2, m=4, chunks=2)
    assert box.result["name"] == "interleaved 1f1b" and box.result["chunks"] == 2
    assert box.figure.png.startswith(b"\x89PNG") and "v=2" in box.figure.text
    assert "bubble 0.111 of the step, formula 0.111" in box.message.text
    controls = box.controls
    controls["m"].value = 3  # m=3 does not split into groups of 2: the message, not a figure
    assert box.result is None and "not a multiple of 2" in " ".join(box.message.text.split())
    assert box.figure.png is None, "the figure of m=4 is gone: it is not this one"
    controls["name"].value = "gpipe"
    assert box.result["name"] == "gpipe" and box.result["chunks"] == 1
    assert box.update()["m"] == 3


def test_schedule_explorer_disables_chunks_for_one_chunk_schedules():
    box = schedule_explorer(stages=4, m=8, chunks=2)
    chunks = box.controls["chunks"]
    assert not chunks.disabled and chunks.value == 2
    box.controls["name"].value = "1f1b"
    assert chunks.disabled and chunks.value == 1, "the slider says what the timeline runs"
    assert box.result["chunks"] == 1 and "v=1" in box.figure.text
    box.controls["name"].value = "zero bubble"  # chunked too: the learner's 2 comes back
    assert not chunks.disabled and chunks.value == 2 and box.result["chunks"] == 2
    box.controls["name"].value = "interleaved 1f1b"
    assert not chunks.disabled and box.result["chunks"] == 2
    started = schedule_explorer(chunks=3, schedule="gpipe")
    assert started.controls["chunks"].disabled and started.result["chunks"] == 1
    started.controls["name"].value = "interleaved 1f1b"
    assert started.controls["chunks"].value == 3


def test_the_schedule_explorers_text_fits_the_output_area():
    # The widest case the sliders allow: 8 ranks' activations, four-digit message counts.
    box = schedule_explorer(stages=8, m=32, chunks=4)
    for name in ("gpipe", "1f1b", "interleaved 1f1b", "zero bubble"):
        box.controls["name"].value = name
        lines = box.message.text.splitlines()
        assert len(lines) == 2 and max(map(len, lines)) <= 100, lines
        assert box.message.data["text/html"].count("\n") == 1, "the HTML breaks where the text does"
    box.controls["m"].value = 31  # the refusal names the schedule, m and the m that work
    lines = box.message.text.splitlines()
    assert "cannot draw this one" in lines[0] and max(map(len, lines)) <= 100, lines
    assert " ".join(lines).endswith("use m = 24 or 32"), "broken at spaces, nothing lost"


def test_a_displayed_explorer_leaves_its_figure_and_text_as_ordinary_outputs(displayed):
    import base64

    box = schedule_explorer(stages=2, m=4, chunks=2)
    box._ipython_display_()  # what IPython does with a cell's last value
    (controls, none), (text, text_handle), (figure, figure_handle) = displayed
    assert none is None and "application/vnd.jupyter.widget-view+json" in controls
    assert controls["text/plain"].startswith("Pipeline schedule explorer"), "not a bare VBox()"
    assert "bubble 0.111" in text["text/plain"] and "<" in text["text/html"]
    assert base64.b64decode(figure["image/png"])[:4] == b"\x89PNG"
    box.controls["m"].value = 6  # a move updates the outputs in place, in the saved notebook too
    assert "bubble 0.077" in text_handle.data["text/plain"]
    assert figure_handle.data["image/png"] != figure["image/png"]
    assert "m=6" in figure_handle.data["text/plain"]
    box.controls["m"].value = 5
    assert figure_handle.data == {"text/plain": ""}, "no stale figure under the message"
    assert "cannot draw this one" in text_handle.data["text/plain"]


def test_the_other_explorers_show_their_figures_as_ordinary_outputs(displayed):
    planner = planner_explorer(SEVEN_B, Cluster(devices=8, memory_gib=80))
    planner._ipython_display_()
    augment = augmentation_explorer(_photo(), image_size=24, n=2)
    augment._ipython_display_()
    kinds = [sorted(data) for data, _ in displayed]
    assert kinds == [["application/vnd.jupyter.widget-view+json", "text/plain"],
                     ["image/png", "text/plain"], ["text/html", "text/plain"],
                     ["application/vnd.jupyter.widget-view+json", "text/plain"],
                     ["image/png", "text/plain"]]
    assert "planner" in displayed[0][0]["text/plain"] and "grid" in displayed[4][0]["text/plain"]
    figure_handle = displayed[1][1]
    planner.controls["zero"].value = 1
    assert figure_handle.updates and figure_handle.data["image/png"]
    assert "fits" in displayed[2][1].data["text/plain"]


def test_explorers_display_through_ipython_as_updatable_outputs():
    """The real IPython display machinery: the outputs carry display ids that updates name."""
    from IPython.core.displaypub import CapturingDisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell

    had = InteractiveShell.initialized()
    shell = InteractiveShell.instance()
    publisher, shell.display_pub = shell.display_pub, CapturingDisplayPublisher()
    try:
        box = schedule_explorer(stages=2, m=4, chunks=2)
        shell.display_formatter.format(box)  # _ipython_display_ displays, returns nothing
        outputs = shell.display_pub.outputs
        assert len(outputs) == 3
        figure_id = outputs[2]["transient"]["display_id"]
        box.controls["m"].value = 6
        updates = [o for o in outputs[3:] if o["update"]]
        assert figure_id in {o["transient"]["display_id"] for o in updates}
        assert any("image/png" in o["data"] for o in updates)
    finally:
        shell.display_pub = publisher
        if not had:
            InteractiveShell.clear_instance()


# ---- the planner (notebook 10) ---------------------------------------------------------------


def test_planner_explorer_builds_redraws_and_reports_refusals():
    import ipywidgets as widgets

    box = planner_explorer(SEVEN_B, Cluster(devices=8, memory_gib=80))
    assert isinstance(box, widgets.VBox)
    controls = box.controls
    assert controls["preset"].options[0] == "yours" and "llama3-405b" in controls["preset"].options
    picture = box.figure
    assert picture.png[:4] == b"\x89PNG"
    assert box.plan().degrees == Degrees(dp=8, microbatches=1) and not box.plan().fits
    controls["zero"].value = 1
    assert box.plan().fits and "fits" in box.message.text
    before = picture.png
    controls["tp"].value = 2
    assert box.plan().degrees.dp == 4 and picture.png != before
    controls["tp"].value = 8
    controls["pp"].value = 2  # 16 ranks on 8 devices: refused, and said so
    assert box.plan() is None and "refused" in box.message.text
    assert picture.png is None, "no figure of the last layout under the refusal"
    controls["preset"].value = "gpt3-175b"
    assert box.plan().fits and box.plan().degrees.pp == 8
    box.update()


def test_what_a_reader_without_the_widgets_reads_fits_the_output_area():
    for box in (schedule_explorer(), planner_explorer(),
                augmentation_explorer(_photo(), image_size=24, n=2)):
        text = box._repr_mimebundle_()["text/plain"]
        assert "VBox" not in text and "need a running kernel" in text
        assert max(len(line) for line in text.splitlines()) <= 100


# ---- the course's JupyterLab keeps the widgets' state in a saved notebook ----------------------


def _widget_settings(app_dir, tmp_path):
    """The widget manager's settings as JupyterLab's own server code composes them."""
    from jupyter_core.paths import jupyter_path
    from jupyterlab_server.settings_utils import get_settings

    result, _ = get_settings(str(app_dir / "settings"), str(app_dir / "schemas"),
                             str(tmp_path / "user-settings"),
                             schema_name="@jupyter-widgets/jupyterlab-manager:plugin",
                             labextensions_path=jupyter_path("labextensions"))
    return result


def test_the_course_jupyterlab_saves_the_widgets_state(tmp_path):
    pytest.importorskip("jupyterlab_server")
    from labkit.jupyter import install_lab_settings

    app_dir = tmp_path / "lab"
    before = _widget_settings(app_dir, tmp_path)
    assert before["schema"]["properties"]["saveState"]["default"] is False, "JupyterLab's own"
    path = install_lab_settings(app_dir)
    assert path == app_dir / "settings" / "overrides.d" / "labkit.json"
    after = _widget_settings(app_dir, tmp_path)
    assert after["schema"]["properties"]["saveState"]["default"] is True
    assert install_lab_settings(app_dir) == path and path.stat().st_size > 0, "idempotent"


def test_make_lab_installs_the_settings_before_starting_jupyterlab(tmp_path, monkeypatch):
    import labkit.jupyter as jupyter

    monkeypatch.setenv("JUPYTERLAB_DIR", str(tmp_path / "lab"))
    monkeypatch.setattr(jupyter, "port_free", lambda host, port: True)
    started = []
    monkeypatch.setattr(jupyter.os, "execv", lambda exe, cmd: started.append(
        jupyter.lab_settings_file().is_file()))
    assert jupyter.run_lab(root=str(tmp_path)) == 0
    assert started == [True]
    assert jupyter.lab_settings_file() == tmp_path.resolve() / "lab" / "settings" / \
        "overrides.d" / "labkit.json"


def test_a_jupyterlab_folder_that_cannot_be_written_is_said_and_not_fatal(tmp_path, capsys):
    from labkit.jupyter import install_lab_settings

    (tmp_path / "lab").write_text("a file where the folder should be")
    assert install_lab_settings(tmp_path / "lab") is None
    assert "could not write" in capsys.readouterr().err

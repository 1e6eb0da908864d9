"""The notebooks in a real browser: JupyterLab driven by Playwright in Debian's Chromium.

What no other test shows: that the course works where learners use it. JupyterLab starts on
127.0.0.1 with a token, on a temporary copy of notebooks/ in the smoke profile; Chromium opens a
notebook, runs its cells from the Run menu (all of notebook 00; notebook 01 through its widget
and its first exercise, which it then works as a learner does: a wrong answer typed in gets
its hint, the right one a pass),
waits for the kernel to go idle, and the DOM must show the plots and the widgets, and no error
anywhere. A screenshot of each notebook is kept in tests/artifacts/ (gitignored) for a human
to look at.

Chromium is Debian's (/usr/bin/chromium, `apt-get install chromium`; .ci/run installs it), never
the one `playwright install` downloads: that download fails offline.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from labkit.jupyter import lab_command, port_free

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
# Headless, as root in CI, and quiet on a closed network: without the background-networking
# flags Chromium keeps trying Google's hosts, and QUIC / sync / component updates do the same.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_MS = 240_000  # one notebook, all cells, smoke profile, 2 CPU cores

if not CHROMIUM.exists():
    pytest.skip(f"Debian's Chromium is not at {CHROMIUM}: `apt-get install chromium` "
                "(.ci/run installs it)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is missing: `make install` (dev extra)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}{path}", method=method,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a copy of notebooks/, stopped by PID; nothing it started may survive it."""
    tmp = tmp_path_factory.mktemp("browser")
    root = tmp / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    env = dict(os.environ, LABKIT_PROFILE="smoke", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", IPYTHONDIR=str(tmp / "ipython"))
    # conftest.py sets MPLBACKEND=Agg for the tests; a kernel inheriting it would draw its
    # figures off-screen instead of inline, and the notebooks would show no plots.
    env.pop("MPLBACKEND", None)
    # Jupyter's config, state and settings in the temporary folder, not in the user's home.
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR",
                "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR"):
        env[var] = str(tmp / var.lower())
    # No "Jupyter news" popup over the notebook (it would also try the network).
    labconfig = tmp / "jupyter_config_dir" / "labconfig"
    labconfig.mkdir(parents=True)
    (labconfig / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    # Every cell in the DOM: JupyterLab otherwise renders only the cells near the viewport,
    # and the checks below read all outputs.
    tracker = tmp / "jupyterlab_settings_dir" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))

    port, token = free_port(), "labkit-browser-test"
    log = open(tmp / "jupyterlab.log", "wb")  # closed in the teardown
    proc = subprocess.Popen(lab_command("127.0.0.1", port, root, token), env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # a fresh venv's first start builds caches
        while True:
            try:
                api(base, token, "/api/status")
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, (tmp / "jupyterlab.log").read_text()
                assert time.monotonic() < deadline, f"JupyterLab did not answer on {base} in 180 s"
                time.sleep(0.5)
        yield {"base": base, "token": token, "root": root, "proc": proc}
    finally:
        started = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        proc.terminate()  # JupyterLab shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        _, alive = psutil.wait_procs(started, timeout=30)
        for p in alive:  # report, then clean up by PID, so one failure does not leak into others
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        assert not alive, f"still running after JupyterLab stopped: {[p.pid for p in alive]}"
        assert port_free("127.0.0.1", port), f"JupyterLab still holds port {port}"


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                      args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def run_notebook(browser, lab, name: str, through: str | None = None):
    """Open a notebook and run it from the Run menu: all cells, or (``through``) the cells up
    to and including the first code cell containing that text. Wait until they all ran and the
    kernel is idle; return the page (for the DOM checks) and the notebook as saved after the run.
    """
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    # A workspace of its own: JupyterLab would otherwise reopen the notebooks of earlier tests
    # beside this one, and the selectors below would see their cells too.
    workspace = Path(name).stem.replace("_", "-")
    page.goto(f"{lab['base']}/lab/workspaces/{workspace}/tree/{name}?token={lab['token']}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    # The toolbar says "idle" before the kernel has even connected, and Run All then silently
    # does nothing; the status bar's "| Idle" comes only from a connected kernel.
    page.wait_for_function("() => /\\|\\s*Idle/.test(document.querySelector('#jp-main-statusbar')"
                           "?.innerText ?? '')", timeout=120_000)
    source = json.loads((lab["root"] / name).read_text())["cells"]
    if through is None:
        command, n_code = "runmenu:run-all", sum(c["cell_type"] == "code" for c in source)
    else:
        # "Run All Above Selected Cell" with the cell after the last one wanted selected.
        last = next(i for i, c in enumerate(source)
                    if c["cell_type"] == "code" and through in "".join(c["source"]))
        page.locator(".jp-Notebook .jp-Cell").nth(last + 1).locator(".jp-InputPrompt").click()
        command = "notebook:run-all-above"
        n_code = sum(c["cell_type"] == "code" for c in source[:last + 1])
    started = time.monotonic()
    # By command id: "Run All Cells" also names a toolbar button and a palette entry.
    page.locator(".lm-MenuBar-item", has_text="Run").click()
    page.locator(f'.lm-Menu-item[data-command="{command}"]').click()
    # Done: the kernel is idle again, and the first n_code code cells have an execution number
    # (none waits as [*] or [ ]), or a cell failed (running stops there; the checks say which).
    page.wait_for_function(
        """n => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
            const done = prompts.length >= n
                && prompts.slice(0, n).every(p => /\\[\\d+\\]/.test(p.innerText));
            const failed = [...document.querySelectorAll('.jp-OutputArea-output')]
                .some(o => o.innerText.includes('Traceback'));
            const idle = /\\|\\s*Idle/.test(
                document.querySelector('#jp-main-statusbar')?.innerText ?? '');
            return (done || failed) && idle;
        }""", arg=n_code, timeout=RUN_TIMEOUT_MS, polling=500)
    print(f"{name}: {command} took {time.monotonic() - started:.1f} s")
    # The saved file carries the outputs for the checks below. Autosave may have written a
    # half-run copy already, so wait for the one where every wanted cell ran.
    page.keyboard.press("Control+s")
    path = lab["root"] / name
    deadline = time.monotonic() + 30
    while True:
        nb = json.loads(path.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"][:n_code]
        if all(c["execution_count"] for c in code) or any(
                o["output_type"] == "error" for c in code for o in c.get("outputs", [])):
            return page, nb
        assert time.monotonic() < deadline, f"{name} was not saved after the run"
        time.sleep(0.5)


def assert_no_errors(page, nb, name: str):
    errors = [o for c in nb["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{name}: {errors[0]['ename']}: {errors[0]['evalue']}"
    text = page.locator(".jp-Notebook").inner_text()
    assert "Error displaying widget" not in text, f"{name}: a widget failed to render"
    # Tracebacks render as stderr too; warnings there (gloo, torchrun) are fine.
    stderr = page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    tracebacks = [t for t in stderr.all_inner_texts() if "Traceback" in t]
    assert not tracebacks, f"{name}: {tracebacks[0][-2000:]}"


def loaded_images(page, selector: str) -> int:
    """How many images under ``selector`` were decoded (a broken image has no natural width)."""
    return page.eval_on_selector_all(selector, "els => els.filter(e => e.naturalWidth > 0).length")


def screenshot(page, locator, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    locator.scroll_into_view_if_needed()
    path = ARTIFACTS / f"browser-{Path(name).stem}.png"
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


def test_notebook_00_runs_in_the_browser(browser, lab):
    name = "00_environment_check.ipynb"
    page, nb = run_notebook(browser, lab, name)
    try:
        assert_no_errors(page, nb, name)
        assert loaded_images(page, ".jp-OutputArea-output img") >= 1, "no plot in the outputs"
        plot = page.locator(".jp-OutputArea-output img").last
        assert "algbw" in page.locator(".jp-Notebook").inner_text()  # the bandwidth table
        assert screenshot(page, plot, name).stat().st_size > 10_000
    finally:
        page.close()
        stop_kernels(lab)


def test_notebook_01_widget_and_an_exercise_in_the_browser(browser, lab):
    # Through the first exercise's check only: the training after it adds a minute and nothing
    # a browser shows that nbval's run of the whole notebook in `make test` does not.
    name = "01_vgg16_data_augmentation.ipynb"
    page, nb = run_notebook(browser, lab, name, through="exercise.augmentation_pipeline(")
    try:
        assert_no_errors(page, nb, name)
        assert page.locator(".jp-OutputArea .jupyter-widgets").count() >= 1
        sliders = page.locator(".jp-OutputArea .widget-slider")
        assert sliders.count() >= 2, "the augmentation explorer's sliders did not render"
        # The explorer's picture is an ordinary output beside its sliders (so a saved notebook
        # keeps it): with the plots, every PNG must have arrived and decoded.
        assert loaded_images(page, ".jp-OutputArea-output img") >= 3, "plots are missing"
        assert screenshot(page, sliders.first, name).stat().st_size > 10_000
        work_the_exercise(page, nb, name)
    finally:
        page.close()
        stop_kernels(lab)


WRONG_PIPELINE = """my_pipeline = v2.Compose([
v2.Resize((image_size, image_size), antialias=True),
v2.RandomHorizontalFlip(),
v2.ToDtype(torch.float32, scale=True),
v2.Normalize(augment.IMAGENET_MEAN, augment.IMAGENET_STD),
])"""
RIGHT_PIPELINE = WRONG_PIPELINE.replace("v2.RandomHorizontalFlip(),",
                                        "v2.RandomHorizontalFlip(),\nv2.RandomRotation(15),")


def work_the_exercise(page, nb, name: str):
    """As a learner does: the untouched cell says "not yet"; a wrong answer typed into the
    exercise cell gets its hint; the right one a pass. Nothing raises on the way."""
    index = next(i for i, c in enumerate(nb["cells"])
                 if "".join(c["source"]).startswith("# EXERCISE augmentation_pipeline"))
    cells = page.locator(".jp-Notebook .jp-Cell")
    check_output = cells.nth(index + 1).locator(".jp-OutputArea")
    # The verdict is a badge in JupyterLab ("not yet", coloured), then the check's title.
    assert re.search(r"\[?not yet\]? augmentation pipeline", check_output.inner_text())
    for answer, expected in [(WRONG_PIPELINE, "no rotation step"),
                             (RIGHT_PIPELINE, "augmentation pipeline: flip, rotation")]:
        editor = cells.nth(index).locator(".cm-content")
        editor.click()
        page.keyboard.press("Control+a")
        # insert_text, not type: the editor would auto-indent and close brackets as it types.
        page.keyboard.insert_text(f"# EXERCISE augmentation_pipeline\n{answer}")
        page.keyboard.press("Shift+Enter")  # runs the exercise cell, selects the check's
        page.keyboard.press("Shift+Enter")  # runs the check
        page.wait_for_function(
            "([i, text]) => document.querySelectorAll('.jp-Notebook .jp-Cell')[i]"
            "?.querySelector('.jp-OutputArea')?.innerText.includes(text)",
            arg=[index + 1, expected], timeout=60_000, polling=250)
        shown = check_output.inner_text()
        assert expected in shown and "Traceback" not in shown, shown
    assert "hint:" not in check_output.inner_text()
    screenshot(page, check_output, "01_exercise")


def stop_kernels(lab):
    """Shut the kernel of a finished notebook down (so the next one has both cores), and check
    that the kernel and everything it started (torchrun, workers, watchdogs) went with it."""
    started = psutil.Process(lab["proc"].pid).children(recursive=True)
    for session in api(lab["base"], lab["token"], "/api/sessions"):
        api(lab["base"], lab["token"], f"/api/sessions/{session['id']}", method="DELETE")
    _, alive = psutil.wait_procs(started, timeout=30)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    assert not alive, f"still running after the kernel shut down: {[p.pid for p in alive]}"


def test_a_failing_cell_is_caught(browser, lab):
    """The checks above are not vacuous: a notebook whose cell raises fails them, fast."""
    import nbformat

    name = "zz_fails.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('before')"),
                                         nbformat.v4.new_code_cell("1 / 0"),
                                         nbformat.v4.new_code_cell("print('never')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, lab["root"] / name)
    page, saved = run_notebook(browser, lab, name)
    try:
        with pytest.raises(AssertionError, match="ZeroDivisionError: division by zero"):
            assert_no_errors(page, saved, name)
    finally:
        page.close()
        stop_kernels(lab)

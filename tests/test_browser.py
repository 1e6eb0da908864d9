"""The notebooks in a real browser: JupyterLab driven by Playwright in Debian's Chromium.

What no other test shows: that the course works where learners use it. JupyterLab starts on
127.0.0.1 with a token, on a temporary copy of notebooks/ in the smoke profile, with the
course's JupyterLab settings (`make lab`'s: the widgets' state is saved with a notebook).
Chromium opens a notebook, runs its cells from the Run menu, waits for the kernel to go idle,
and the DOM must show the plots and the widgets, no error anywhere, and no line of text wider
than its output area (nor, in the saved notebook, over 100 characters). Covered:

- notebook 00, all of it;
- notebook 01 through its augmentation explorer and its first exercise, which it then works as
  a learner does: a wrong answer typed in gets its hint, the right one a pass;
- notebook 10's two explorers (the schedule explorer and the planner), in a copy of the notebook
  cut down to its setup cell and the explorers' cells: a control moved in the page changes the
  figure and the text, a one-chunk schedule disables the chunks slider, an impossible schedule
  shows its message and no stale figure; saved, closed, its kernel stopped and reopened without
  running anything, the notebook shows the explorers' last figures and controls, no widget error;
- labkit.progress's per-rank bars in a launch on two ranks: their summary (every rank at 100 %)
  stays in the notebook, saved and reopened likewise;
- that the checks can fail: a cell that raises, a printed line of 300 characters.

A screenshot of each is kept in tests/artifacts/ (gitignored) for a human to look at.

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

from labkit.jupyter import install_lab_settings, lab_command, port_free
from tests.notebook_lines import too_long

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
    # The course's defaults, as `make lab` installs them (saveState: a notebook saved and
    # reopened draws its widgets from the state saved with it).
    install_lab_settings()

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


def open_notebook(browser, lab, name: str, workspace: str | None = None):
    """A new page with the notebook open and its kernel connected and idle; nothing is run."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    # A workspace of its own: JupyterLab would otherwise reopen the notebooks of earlier tests
    # beside this one, and the selectors below would see their cells too.
    workspace = workspace or Path(name).stem.replace("_", "-")
    page.goto(f"{lab['base']}/lab/workspaces/{workspace}/tree/{name}?token={lab['token']}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    # The toolbar says "idle" before the kernel has even connected, and Run All then silently
    # does nothing; the status bar's "| Idle" comes only from a connected kernel.
    page.wait_for_function("() => /\\|\\s*Idle/.test(document.querySelector('#jp-main-statusbar')"
                           "?.innerText ?? '')", timeout=120_000)
    return page


def run_notebook(browser, lab, name: str, through: str | None = None):
    """Open a notebook and run it from the Run menu: all cells, or (``through``) the cells up
    to and including the first code cell containing that text. Wait until they all ran and the
    kernel is idle; return the page (for the DOM checks) and the notebook as saved after the run.
    """
    page = open_notebook(browser, lab, name)
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


def wide_outputs(page) -> list[list]:
    """``[width, room, text]`` of each text output (a ``pre``: stdout, stderr, text/plain, or an
    HTML one) with a line wider than its output area. JupyterLab wraps such a line mid-word
    rather than letting it scroll, so each is measured unwrapped for a moment."""
    return page.eval_on_selector_all(".jp-OutputArea-output pre", """els => els.map(e => {
        const wrap = e.style.whiteSpace;
        e.style.whiteSpace = 'pre';
        const measured = [e.scrollWidth, e.clientWidth, e.innerText.slice(0, 200)];
        e.style.whiteSpace = wrap;
        return measured;
    }).filter(([width, room]) => width > room + 1)""")


def long_lines(nb, limit: int = 100) -> list[tuple[int, int, str]]:
    """``(cell index, length, line)`` of each line of text the saved outputs show over ``limit``
    characters (what `make notebooks` checks with LINE_CHECK=1, here for the browser's runs)."""
    return [(i, n, line) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            for n, line in too_long(c.get("outputs"), limit)]


def assert_lines_fit(page, nb, name: str):
    wide = wide_outputs(page)
    assert not wide, (f"{name}: a line {wide[0][0]} px wide in an output area of {wide[0][1]} px: "
                      f"{wide[0][2]!r}")
    long = long_lines(nb)
    assert not long, (f"{name}: cell {long[0][0]} shows a line of {long[0][1]} characters "
                      f"(over 100): {long[0][2][:120]!r}")


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
        assert_lines_fit(page, nb, name)
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


# ---- what a saved notebook keeps: the explorers' figures, the progress bars' summary ------------


def cut_notebook(lab, source: str, name: str, finds: list[str]) -> list[int]:
    """Write ``name``: the notebook ``source`` cut down to its first code cell (imports, setup)
    and the code cells containing each of ``finds``, each with the markdown just above it, as
    the notebook has them. Return the index of each found cell in the new notebook."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / source, as_version=4)
    cells = nb.cells
    keep = [next(c for c in cells if c.cell_type == "code")]
    found = []
    for text in finds:
        i = next(i for i, c in enumerate(cells) if c.cell_type == "code" and text in c.source)
        if cells[i - 1].cell_type == "markdown":
            keep.append(cells[i - 1])
        found.append(len(keep))
        keep.append(cells[i])
    nb.cells = keep
    nbformat.write(nb, lab["root"] / name)
    return found


def shown(page, index: int) -> dict:
    """What cell ``index`` shows beside its widgets: its figure (the image's src) and its HTML
    text (the explorers' and the progress bars' messages)."""
    return page.evaluate("""i => {
        const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
        const img = cell.querySelector('.jp-OutputArea-output img');
        const html = cell.querySelectorAll('.jp-OutputArea-output[data-mime-type="text/html"]');
        return {src: img ? img.src : null, text: [...html].map(e => e.innerText).join('\\n')};
    }""", index)


def wait_shown(page, index: int, condition, what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        now = shown(page, index)
        if condition(now):
            return now
        assert time.monotonic() < deadline, f"{what}: cell {index} shows {now['text'][:300]!r}"
        page.wait_for_timeout(250)


def control(cell, kind: str, label: str):
    """The ipywidgets control of class ``kind`` (".widget-slider") described as ``label``."""
    return cell.locator(kind).filter(has=cell.page.locator(
        ".widget-label", has_text=re.compile(f"^{re.escape(label)}$")))


def set_slider(cell, label: str, value: int):
    """As a learner types a value into a slider's readout."""
    readout = control(cell, ".widget-slider", label).locator(".widget-readout")
    readout.fill(str(value))
    readout.press("Enter")


def saved_figures(nb, index: int) -> list[str]:
    """The PNGs (base64) among the saved outputs of cell ``index``."""
    return ["".join(o["data"]["image/png"]).replace("\n", "")
            for o in nb["cells"][index].get("outputs", []) if "image/png" in o.get("data", {})]


def png_of(src: str | None) -> list[str]:
    return [] if src is None else [src.split("base64,", 1)[1]]


def save(page, lab, name: str, ready) -> dict:
    """Save from the page (Control+s) and return the notebook file once ``ready(nb)``."""
    page.locator(".jp-Notebook .jp-Cell").first.locator(".jp-InputPrompt").click()
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while True:
        nb = json.loads((lab["root"] / name).read_text())
        if ready(nb):
            return nb
        assert time.monotonic() < deadline, f"{name}: the saved file lacks the last outputs"
        time.sleep(0.5)


def reopen(browser, lab, name: str):
    """The notebook reopened in a new page after its kernel was stopped, nothing run: all it
    shows comes from the saved file. Return the page once its widgets are drawn or failed."""
    stop_kernels(lab)  # else the new page finds the old kernel, and its widgets, still there
    page = open_notebook(browser, lab, name, workspace=Path(name).stem.replace("_", "-") + "-2")
    try:
        page.wait_for_function("() => !document.querySelector('.jp-Notebook').innerText"
                               ".includes('Loading widget')", timeout=30_000, polling=250)
    except sync_api.TimeoutError:
        pytest.fail(f"{name}: reopened, a widget still says 'Loading widget...' after 30 s")
    return page


def assert_no_widget_errors(page, name: str):
    text = page.locator(".jp-Notebook").inner_text()
    for error in ("Error displaying widget", "model not found"):
        assert error not in text, f"{name}: {error!r} in the reopened notebook"


def test_notebook_10_explorers_move_and_a_saved_notebook_keeps_their_figures(browser, lab):
    # Notebook 10's own setup and explorer cells only: the rest of it takes minutes and shows
    # nothing of the explorers.
    name = "10_explorers.ipynb"
    at_schedule, at_planner = cut_notebook(lab, "10_composing_parallelism.ipynb", name, [
        "explorers.schedule_explorer(", "explorers.planner_explorer("])
    page, nb = run_notebook(browser, lab, name)
    reopened = None
    try:
        assert_no_errors(page, nb, name)
        assert_lines_fit(page, nb, name)
        cells = page.locator(".jp-Notebook .jp-Cell")
        schedule, planner = cells.nth(at_schedule), cells.nth(at_planner)
        first = wait_shown(page, at_schedule, lambda s: s["src"] and "bubble" in s["text"],
                           "the schedule explorer's first timeline")
        # A one-chunk schedule: another timeline, and the chunks slider shows 1, disabled.
        menu = control(schedule, ".widget-dropdown", "schedule").locator("select")
        menu.select_option(label="1f1b")
        wait_shown(page, at_schedule, lambda s: s["src"] not in (None, first["src"])
                   and "bubble" in s["text"] and s["text"] != first["text"], "1F1B's timeline")
        chunks = control(schedule, ".widget-slider", "chunks v").locator(".widget-readout")
        sync_api.expect(chunks).to_have_text("1")
        sync_api.expect(chunks).to_have_attribute("contenteditable", "false")
        # Back to interleaved: the 2 chunks come back, and with them the first timeline.
        menu.select_option(label="interleaved 1f1b")
        sync_api.expect(chunks).to_have_text("2")
        sync_api.expect(chunks).to_have_attribute("contenteditable", "true")
        wait_shown(page, at_schedule, lambda s: s == first, "interleaved 1F1B's timeline again")
        # m=6 on 4 ranks cannot be interleaved: the message, and no figure of m=8 under it.
        set_slider(schedule, "micro-batches m", 6)
        refused = wait_shown(page, at_schedule, lambda s: "cannot draw this one" in s["text"],
                             "the message for m=6")
        assert refused["src"] is None, f"{name}: a stale figure under {refused['text']!r}"
        set_slider(schedule, "micro-batches m", 12)
        last = wait_shown(page, at_schedule, lambda s: s["src"] not in (None, first["src"])
                          and "bubble" in s["text"], "the timeline for m=12")

        before = wait_shown(page, at_planner, lambda s: s["text"], "the planner's first plan")
        presets = control(planner, ".widget-dropdown", "preset").locator("select")
        other = presets.locator("option").all_inner_texts()[1]
        presets.select_option(label=other)
        planned = wait_shown(page, at_planner, lambda s: s["src"] != before["src"]
                             and s["text"] not in ("", before["text"]), f"the plan of {other}")
        assert planned["src"], f"{name}: {other} is refused: {planned['text'][:300]!r}"
        assert_no_errors(page, nb, name)
        assert_lines_fit(page, nb, name)
        screenshot(page, schedule, name)

        saved = save(page, lab, name, lambda nb: saved_figures(nb, at_schedule) ==
                     png_of(last["src"]) and saved_figures(nb, at_planner) ==
                     png_of(planned["src"]))
        assert "application/vnd.jupyter.widget-state+json" in saved["metadata"].get(
            "widgets", {}), f"{name}: saved without its widgets' state (saveState is off)"
        page.close()
        reopened = reopen(browser, lab, name)
        assert_no_widget_errors(reopened, name)
        assert shown(reopened, at_schedule) == last, "not the last timeline and its bubble"
        assert shown(reopened, at_planner) == planned, "not the last plan"
        assert loaded_images(reopened, ".jp-OutputArea-output img") == 2
        # The saved widgets' state draws the controls again (they need a kernel to move).
        assert reopened.locator(".jp-OutputArea .widget-slider").count() >= 4
        assert_lines_fit(reopened, saved, name)
        screenshot(reopened, reopened.locator(".jp-Notebook .jp-Cell").nth(at_schedule),
                   "10_explorers_reopened")
    finally:
        page.close()
        if reopened is not None:
            reopened.close()
        stop_kernels(lab)


PROGRESS_CELL = '''import time

import labkit


def train(steps):
    for _ in labkit.progress(range(steps), desc="train"):
        time.sleep(0.02)
    return steps


labkit.launch(train, 40, nproc=2).values'''


def test_progress_bars_leave_their_summary_in_a_saved_notebook(browser, lab):
    name = "zz_progress.ipynb"
    write_notebook(lab, name, [PROGRESS_CELL])
    page, nb = run_notebook(browser, lab, name)
    reopened = None
    ended = re.compile(r"rank 0 train\s+40/40 \(100%\) in .*\n.*rank 1 train\s+40/40 \(100%\) in ")
    try:
        assert_no_errors(page, nb, name)
        # The run is over: the live bars gave way to their summary, no widget left.
        summary = wait_shown(page, 0, lambda s: ended.search(s["text"]), "both ranks at 100%")
        assert "starting 2 workers ... ready in" in summary["text"]
        assert page.locator(".jp-OutputArea .jupyter-widgets").count() == 0
        assert "[40, 40]" in page.locator(".jp-OutputArea").inner_text()
        assert_lines_fit(page, nb, name)
        saved = save(page, lab, name, lambda nb: any(
            "40/40" in "".join(o.get("data", {}).get("text/html", ""))
            for o in nb["cells"][0].get("outputs", [])))
        page.close()
        reopened = reopen(browser, lab, name)
        assert_no_widget_errors(reopened, name)
        assert shown(reopened, 0) == summary
        assert reopened.locator(".jp-OutputArea-output progress").count() == 2
        # Green, as the live bars ended (JupyterLab's success colour), not the browser's blue.
        colours = reopened.locator(".jp-OutputArea-output progress").evaluate_all(
            "bars => bars.map(b => getComputedStyle(b).accentColor)")
        rgb = [tuple(map(int, re.findall(r"\d+", c)[:3])) for c in colours]
        assert len(rgb) == 2 and all(len(c) == 3 and c[1] > c[0] and c[1] > c[2]
                                     for c in rgb), colours
        assert_lines_fit(reopened, saved, name)
        screenshot(reopened, reopened.locator(".jp-OutputArea").first, "progress_reopened")
    finally:
        page.close()
        if reopened is not None:
            reopened.close()
        stop_kernels(lab)


def write_notebook(lab, name: str, sources: list[str]) -> None:
    """A notebook of these code cells in JupyterLab's folder, for the kernel the course uses."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, lab["root"] / name)


def test_a_failing_cell_is_caught(browser, lab):
    """The checks above are not vacuous: a notebook whose cell raises fails them, fast."""
    name = "zz_fails.ipynb"
    write_notebook(lab, name, ["print('before')", "1 / 0", "print('never')"])
    page, saved = run_notebook(browser, lab, name)
    try:
        with pytest.raises(AssertionError, match="ZeroDivisionError: division by zero"):
            assert_no_errors(page, saved, name)
    finally:
        page.close()
        stop_kernels(lab)


def test_a_line_wider_than_its_output_area_is_caught(browser, lab):
    """Nor is the line check: a printed line of 300 characters fails it, in the page (wider
    than the output area, unwrapped) and in the saved notebook (over 100 characters)."""
    name = "zz_wide.ipynb"
    write_notebook(lab, name, ["print('short')", "print(' '.join(['word'] * 60) + '.')"])
    page, saved = run_notebook(browser, lab, name)
    try:
        assert_no_errors(page, saved, name)
        wide = wide_outputs(page)
        assert len(wide) == 1 and wide[0][2].startswith("word word"), wide
        assert [(i, n) for i, n, _ in long_lines(saved)] == [(1, 300)]
        with pytest.raises(AssertionError, match="px wide in an output area of"):
            assert_lines_fit(page, saved, name)
    finally:
        page.close()
        stop_kernels(lab)

"""JupyterLab as `make lab` starts it: loopback only, token required, stopped by PID."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from labkit.jupyter import lab_command, port_free


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str, token: str | None) -> int:
    headers = {"Authorization": f"token {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture
def jupyter_env(tmp_path, monkeypatch):
    # Keep Jupyter's runtime and config files out of the user's home.
    for var in ("JUPYTER_RUNTIME_DIR", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_lab_answers_with_the_token_and_refuses_without(jupyter_env):
    port, token = free_port(), "labkit-test-token"
    (jupyter_env / "nb").mkdir()
    proc = subprocess.Popen(lab_command("127.0.0.1", port, jupyter_env / "nb", token),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}/api/status"
        code = None
        deadline = time.monotonic() + 180  # a fresh venv's first start compiles and caches a lot
        while code is None and time.monotonic() < deadline:
            try:
                code = status(url, token)
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None, proc.stderr.read().decode()
                time.sleep(0.5)
        assert code == 200, f"JupyterLab did not answer on {url} within 180 s"
        assert status(url, None) == 403
        assert status(url, "wrong-token") == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert port_free("127.0.0.1", port), "JupyterLab still holds its port"


def test_lab_refuses_a_busy_port(jupyter_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "labkit", "lab", "--port", str(port),
                              "--root", str(jupyter_env)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"127.0.0.1:{port} is in use" in out.stderr and f"PORT={port + 1}" in out.stderr


def test_lab_needs_the_notebooks_folder(jupyter_env):
    out = subprocess.run([sys.executable, "-m", "labkit", "lab", "--root",
                          str(jupyter_env / "nope")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no folder" in out.stderr


def test_lab_binds_loopback_and_asks_for_a_token():
    cmd = " ".join(lab_command("127.0.0.1", 8888, "notebooks", "t0k"))
    assert "--ServerApp.ip=127.0.0.1" in cmd and "--IdentityProvider.token=t0k" in cmd
    assert "--ServerApp.port_retries=0" in cmd

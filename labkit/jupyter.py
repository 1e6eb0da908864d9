"""Start JupyterLab the way ``make lab`` does: on loopback, behind a token, on the notebooks,
with the course's JupyterLab settings in place."""

from __future__ import annotations

import json
import os
import secrets
import socket
import sys
from pathlib import Path

TOKEN_ENV = "LABKIT_TOKEN"

# Defaults JupyterLab takes for the course. saveState: JupyterLab keeps the widgets' state in a
# notebook it saves, so that a notebook reopened (or read in nbviewer) draws the explorers'
# controls again instead of "Error displaying widget: model not found".
LAB_SETTINGS = {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True}}


def lab_settings_file(app_dir: str | os.PathLike | None = None) -> Path:
    """Where JupyterLab reads labkit's defaults: a file of labkit's own among its overrides
    (``<app dir>/settings/overrides.d``), beside any ``overrides.json`` of the learner's."""
    if app_dir is None:
        from jupyterlab.commands import get_app_dir

        app_dir = get_app_dir()  # the venv's share/jupyter/lab, or $JUPYTERLAB_DIR
    return Path(app_dir) / "settings" / "overrides.d" / "labkit.json"


def install_lab_settings(app_dir: str | os.PathLike | None = None) -> Path | None:
    """Write :data:`LAB_SETTINGS` where JupyterLab reads them; the file, or None (and a note on
    stderr) where that folder cannot be written: JupyterLab then runs with its own defaults.

    Example::

        >>> install_lab_settings()
        PosixPath('.../.venv/share/jupyter/lab/settings/overrides.d/labkit.json')
    """
    path = lab_settings_file(app_dir)
    text = json.dumps(LAB_SETTINGS, indent=2) + "\n"
    try:
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    except OSError as err:
        print(f"labkit lab: could not write {path} ({err}); notebooks will be saved without "
              "their widgets' state", file=sys.stderr)
        return None
    return path


def lab_command(host: str, port: int, root: str | os.PathLike, token: str) -> list[str]:
    """The JupyterLab command line; tests start exactly this one.

    Example::

        >>> lab_command("127.0.0.1", 8888, "notebooks", "s3cret")[:3]
        ['.../python', '-m', 'jupyterlab']
    """
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser",
        f"--ServerApp.ip={host}", f"--ServerApp.port={port}",
        # A busy port is an error, not a silent move to another port the printed URL does not name.
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={Path(root).resolve()}",
        f"--IdentityProvider.token={token}",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers run as root; Jupyter refuses without this
    return cmd


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` right now (as Jupyter binds: SO_REUSEADDR).

    Without SO_REUSEADDR a port whose last server just stopped looks busy for a minute
    (its closed connections sit in TIME_WAIT), although JupyterLab could bind it.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def run_lab(host: str = "127.0.0.1", port: int = 8888, root: str = "notebooks") -> int:
    """Print the URL with its token, then replace this process with JupyterLab."""
    if not Path(root).is_dir():
        print(f"labkit lab: no folder {root!r}; run `make lab` from the repository root",
              file=sys.stderr)
        return 2
    if not port_free(host, port):
        print(f"labkit lab: {host}:{port} is in use (another JupyterLab?). Stop it, or pick "
              f"another port: make lab PORT={port + 1}", file=sys.stderr)
        return 2
    install_lab_settings()
    token = os.environ.get(TOKEN_ENV) or secrets.token_hex(24)
    print(f"\n  JupyterLab: http://{host}:{port}/lab?token={token}\n"
          f"  (set {TOKEN_ENV} to choose the token; Ctrl-C twice to stop)\n", flush=True)
    cmd = lab_command(host, port, root, token)
    os.execv(cmd[0], cmd)
    return 0  # not reached

"""Start JupyterLab the way ``make lab`` does: on loopback, behind a token, on the notebooks."""

from __future__ import annotations

import os
import secrets
import socket
import sys
from pathlib import Path

TOKEN_ENV = "LABKIT_TOKEN"


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
    token = os.environ.get(TOKEN_ENV) or secrets.token_hex(24)
    print(f"\n  JupyterLab: http://{host}:{port}/lab?token={token}\n"
          f"  (set {TOKEN_ENV} to choose the token; Ctrl-C twice to stop)\n", flush=True)
    cmd = lab_command(host, port, root, token)
    os.execv(cmd[0], cmd)
    return 0  # not reached

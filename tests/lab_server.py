"""A throwaway JupyterLab server on loopback, for tests that drive a real browser.

`lab_server(tmp, kernel_env=...)` starts ``python -m jupyterlab`` from this interpreter
in its own directories and yields a `LabServer`; leaving the block stops the kernels and
the server, whatever happened. Terms:

- *root*: the server's root directory (``tmp/root``); notebooks written there open at
  ``LabServer.notebook_url(name)``.
- *home*: ``tmp/home``, the server's own Jupyter config, data and runtime directories and
  its IPython directory, so nothing of the user's Jupyter setup is read or written. The
  data directory holds one kernelspec, `KERNEL_NAME`: this interpreter's ipykernel with
  the repository on ``PYTHONPATH``, and the repository's own build of the lab extension
  (``labextension/prebuilt``), which comes first on the data path, so the tests drive the
  committed build whatever is installed. The interpreter's own ``share/jupyter`` stays on
  Jupyter's data path, which is where the lab extensions of ipywidgets and anywidget are.
- *user settings*: JupyterLab settings written before the server starts: no news or
  update checks (their pop-ups would cover the notebook), no auto-closed brackets in the
  editor, and the theme given to `lab_server`.

Every wait is bounded; a server that is not ready in `START_TIMEOUT` seconds fails with
the tail of its log.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAB_EXTENSION = REPO / "labextension"
LAB_EXTENSION_NAME = "mlx-nbengine"
KERNEL_NAME = "mlx-nbengine-test"
START_TIMEOUT = 90.0
STOP_TIMEOUT = 15.0


@dataclass
class LabServer:
    """A running JupyterLab: where it listens, its token, root, and its process."""

    port: int
    token: str
    root: Path
    log: Path
    process: subprocess.Popen

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, name: str) -> str:
        return f"{self.base_url}/lab/tree/{name}?token={self.token}"

    def api(self, path: str, *, method: str = "GET", timeout: float = 10.0) -> object:
        """The JSON answer of the server's REST API at `path` (``/api/...``)."""
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kernel_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The kernelspec's environment: the repository importable, plus `extra`."""
    path = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    return {"PYTHONPATH": path} | (extra or {})


def write_kernelspec(data_dir: Path, env: dict[str, str]) -> None:
    spec_dir = data_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mlx_nbengine test",
        "language": "python",
        "env": env,
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))


def install_lab_extension(data_dir: Path) -> None:
    """The repository's prebuilt lab extension, where JupyterLab looks for it first."""
    target = data_dir / "labextensions" / LAB_EXTENSION_NAME
    shutil.copytree(LAB_EXTENSION / "prebuilt", target, dirs_exist_ok=True)
    shutil.copy2(LAB_EXTENSION / "install.json", target / "install.json")


def write_user_settings(settings_dir: Path, *, theme: str) -> None:
    def put(plugin: str, values: dict) -> None:
        package, name = plugin.split(":")
        path = settings_dir / package / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))

    put("@jupyterlab/apputils-extension:themes", {"theme": theme})
    put(
        "@jupyterlab/apputils-extension:notification",
        {"fetchNews": "false", "checkForUpdates": False},
    )
    # Typed text must arrive as typed: no closing bracket or quote added by the editor.
    put(
        "@jupyterlab/notebook-extension:tracker",
        {"codeCellConfig": {"autoClosingBrackets": False}},
    )
    put("@jupyterlab/completer-extension:manager", {"autoCompletion": False})


def write_config(config_dir: Path) -> None:
    # Server extensions the tests do not use cost seconds of start-up on a small machine.
    server = {"ServerApp": {"jpserver_extensions": {"jupyter_lsp": False}}}
    (config_dir / "jupyter_server_config.json").write_text(json.dumps(server))
    # No "build recommended" check: it rescans every extension when the page loads.
    (config_dir / "labconfig").mkdir(exist_ok=True)
    # Nor the language-server client, whose server extension is off.
    page = {
        "buildCheck": False,
        "buildAvailable": False,
        "disabledExtensions": {"@jupyterlab/lsp-extension": True},
    }
    (config_dir / "labconfig" / "page_config.json").write_text(json.dumps(page))


def notebook_json(cells: list[str]) -> dict:
    """An nbformat 4 notebook of code cells `cells`, for the test kernelspec."""
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": KERNEL_NAME, "display_name": "mlx_nbengine test"},
            "language_info": {"name": "python"},
        },
        "cells": [
            {
                "id": f"cell-{i}",
                "cell_type": "code",
                "metadata": {},
                "execution_count": None,
                "outputs": [],
                "source": source,
            }
            for i, source in enumerate(cells)
        ],
    }


@contextmanager
def lab_server(
    tmp: Path,
    *,
    kernel_extra_env: dict[str, str] | None = None,
    theme: str = "JupyterLab Light",
    app: str = "lab",
) -> Iterator[LabServer]:
    """JupyterLab (`app` "lab") or Notebook 7 (`app` "notebook") on 127.0.0.1 with a random
    token, stopped (kernels too) on exit."""
    root, home = tmp / "root", tmp / "home"
    config, data, runtime = home / "config", home / "data", home / "runtime"
    settings, workspaces = home / "user-settings", home / "workspaces"
    for d in (root, config, data, runtime, settings, workspaces):
        d.mkdir(parents=True, exist_ok=True)
    write_kernelspec(data, kernel_env(kernel_extra_env))
    install_lab_extension(data)
    write_user_settings(settings, theme=theme)
    write_config(config)
    env = os.environ | {
        "JUPYTER_CONFIG_DIR": str(config),
        "JUPYTER_DATA_DIR": str(data),
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "IPYTHONDIR": str(home / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "0",
    }
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTERLAB_SETTINGS_DIR", None)
    env.pop("JUPYTERLAB_WORKSPACES_DIR", None)
    port, token = free_port(), secrets.token_hex(16)
    module, cls = {"lab": ("jupyterlab", "LabApp"), "notebook": ("notebook", "JupyterNotebookApp")}[
        app
    ]
    argv = [
        sys.executable,
        "-m",
        module,
        "--no-browser",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--{cls}.user_settings_dir={settings}",
        f"--{cls}.workspaces_dir={workspaces}",
        # window.jupyterapp: the tests read cell sources and run commands through it.
        f"--{cls}.expose_app_in_browser=True",
    ]
    if app == "lab":
        argv += [
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ]
    log = home / "server.log"
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            argv,
            cwd=root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            # Its own process group: stopping it never signals the test runner.
            start_new_session=True,
        )
    server = LabServer(port=port, token=token, root=root, log=log, process=process)
    try:
        wait_ready(server)
        yield server
    finally:
        stop(server)


def wait_ready(server: LabServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"JupyterLab exited with {server.process.returncode}:\n{server.log_tail()}"
            )
        try:
            server.api("/api/status", timeout=2.0)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.25)
    raise TimeoutError(f"JupyterLab not ready in {START_TIMEOUT} s:\n{server.log_tail()}")


def stop(server: LabServer) -> None:
    """Shut the kernels down through the API, then the server; kill what is left."""
    import psutil

    try:
        children = psutil.Process(server.process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    try:
        for kernel in server.api("/api/kernels", timeout=5.0) or []:
            server.api(f"/api/kernels/{kernel['id']}", method="DELETE", timeout=10.0)
    except (OSError, ValueError):
        pass  # the server is gone already; the kill below covers its kernels
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(STOP_TIMEOUT)
    # Kernels run in sessions of their own; anything the server left behind goes now.
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=STOP_TIMEOUT)

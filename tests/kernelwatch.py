"""The kernels tests start: made here, watched while a test waits on them, cleaned up after.

- `kernel_manager(tmp, env=..., asynchronous=...)`: a manager for this interpreter's
  ipykernel, whatever kernelspecs are installed; its kernelspec and its connection file
  live in `tmp` (never in the user's Jupyter runtime folder). `asynchronous=True` gives an
  `AsyncKernelManager`, the one to hand to nbclient: with it nbclient checks every second
  that the kernel lives (a blocking client waits out the cell timeout for a dead one).
- `death(km)`: ``"the kernel died (signal 4: SIGILL)"`` once the kernel's process has
  ended, else None; `check_alive(km)` raises `KernelDied` with that line.
- `execute_notebook(client)`: `NotebookClient.execute` that shuts the kernel down and
  removes its connection file whatever happens, and turns nbclient's bare "Kernel died"
  into `KernelDied` naming the signal and the cell.
- `shut_down(km)`: the kernel stopped (if it still runs) and its connection file removed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from mlx_nbengine.demo import exit_description

REPO = Path(__file__).resolve().parent.parent


class KernelDied(AssertionError):
    """A test's kernel died; the message names the signal (or exit code)."""


def kernel_manager(
    tmp: Path, *, env: dict[str, str] | None = None, asynchronous: bool = False
) -> Any:
    """A (blocking or async) KernelManager for this interpreter's ipykernel (see above)."""
    from jupyter_client import AsyncKernelManager, KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = tmp / "kernels" / "mlx-nbengine-test"
    spec_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mlx_nbengine test",
        "language": "python",
        "env": {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        | (env or {}),
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    manager = AsyncKernelManager if asynchronous else KernelManager
    return manager(
        kernel_name="mlx-nbengine-test",
        kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(tmp / "kernels")]),
        connection_file=str(tmp / "kernel-connection.json"),
    )


def returncode(km: Any) -> int | None:
    """The kernel process's return code (negative: the signal), None while it runs."""
    process = getattr(getattr(km, "provisioner", None), "process", None)
    return None if process is None else process.poll()


def death(km: Any) -> str | None:
    """How the kernel died ("the kernel died (signal 4: SIGILL)"), None while it runs."""
    code = returncode(km)
    return None if code is None else f"the kernel died ({exit_description(code)})"


def check_alive(km: Any) -> None:
    """Raise `KernelDied` naming the signal if the kernel's process has ended."""
    line = death(km)
    if line is not None:
        raise KernelDied(line)


def shut_down(km: Any) -> None:
    """Stop the (blocking manager's) kernel if it runs; always remove its connection file."""
    try:
        if km.has_kernel and km.is_alive():
            km.shutdown_kernel(now=True)
    finally:
        km.cleanup_resources()


def execute_notebook(client: Any) -> Any:
    """`client.execute()` with the kernel shut down after it, and a death named."""
    km = client.km
    running: list[int] = []
    client.on_cell_execute = lambda cell, cell_index: running.append(cell_index)
    try:
        return client.execute(cleanup_kc=True)
    except Exception as e:
        line = death(km)
        if line is None:
            raise
        where = f" while running notebook cell {running[-1] + 1}" if running else ""
        raise KernelDied(f"{line}{where}") from e

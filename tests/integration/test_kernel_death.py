"""A kernel that dies is reported in seconds, naming the signal; Ctrl-C ends the demo cleanly.

Real kernels kill themselves for real (``os.kill(os.getpid(), signal.SIGILL)``, as a native
library's illegal instruction would), in notebooks that load no model:

- the demo (``python -m mlx_nbengine demo --notebook NB``) ends within seconds with one
  line naming the signal and the cell, then the kernel log's fatal stack, exit code 1;
- Ctrl-C (SIGINT to the demo process while a cell sleeps) ends it with one line, exit code
  130 and no traceback, the kernel shut down; a cell's error is one line, exit code 1;
- the test helpers (`test_kernel.Kernel`'s waits, `kernelwatch.execute_notebook` for
  nbclient) fail within seconds with "the kernel died (signal 4: SIGILL)".

Each run leaves nothing behind: no connection file in the Jupyter runtime folder or the
temporary folder, no kernel process.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("jupyter_client")
nbformat = pytest.importorskip("nbformat")

from kernelwatch import (  # noqa: E402  (tests/ is on sys.path)
    REPO,
    KernelDied,
    execute_notebook,
    kernel_manager,
)
from test_kernel import Kernel  # noqa: E402

# No core file where the kernel runs, whatever the machine's core settings.
KILL = (
    "import os, resource, signal; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
    "os.kill(os.getpid(), signal.SIGILL)"
)
DIED_LINE = "the kernel died (signal 4: SIGILL)"

# The child restores Python's Ctrl-C handler: a test started as a background job (SIGINT
# ignored, which a child inherits) must still see the demo handle Ctrl-C.
DEMO = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'mlx_nbengine'; runpy.run_module('mlx_nbengine', run_name='__main__')"
)


def write_notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("A notebook that loads no model.")]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nb, path)
    return path


class Machine:
    """A demo's surroundings: its own HOME, temporary folder and Jupyter runtime folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name in ("home", "tmp", "runtime", "cache-home"):
            (root / name).mkdir()
        self.tmp, self.runtime = root / "tmp", root / "runtime"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "HOME": str(root / "home"),
            "TMPDIR": str(self.tmp),
            "JUPYTER_RUNTIME_DIR": str(self.runtime),
            "MLX_NBENGINE_HOME": str(root / "cache-home"),
        }

    def demo(self, notebook: Path, model: Path, out: Path) -> list[str]:
        args = ["demo", "--model", str(model), "--notebook", str(notebook), "--out", str(out)]
        return [sys.executable, "-c", DEMO, *args]

    def leftovers(self) -> list[str]:
        """What the run left in the temporary and runtime folders."""
        return sorted(p.name for folder in (self.tmp, self.runtime) for p in folder.iterdir())


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether process `pid` has ended (and been reaped) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        except OSError:  # no /proc: ask the process table
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            state = "?"
        if state == "Z":
            return False  # ended but nobody waited for it: the demo did not shut it down
        time.sleep(0.1)
    return False


def test_a_kernel_that_dies_ends_the_demo_in_seconds_naming_the_signal_and_the_cell(
    tiny_model_dir, tmp_path
):
    machine = Machine(tmp_path)
    died_at = tmp_path / "died-at"
    kill = f"open({str(died_at)!r}, 'w').write(repr(__import__('time').time())); {KILL}"
    nb = write_notebook(tmp_path / "dies.ipynb", "print('before')", kill, "print('after')")
    out = tmp_path / "out"
    started = time.monotonic()
    run = subprocess.run(
        machine.demo(nb, tiny_model_dir("llama"), out),
        cwd=tmp_path,
        env=machine.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed, noticed = time.monotonic() - started, time.time() - float(died_at.read_text())
    lines = run.stderr.splitlines()
    assert run.returncode == 1, run.stderr
    assert lines[0] == f"{DIED_LINE} while running cell 2: {kill[:71]}…", run.stderr
    # Then the kernel log's lines that tell why: the fatal signal and the cell's frame.
    assert lines[1] == f"from its log ({out / 'kernel.log'}):"
    assert lines[2].strip() == "Fatal Python error: Illegal instruction"
    assert "Traceback" not in run.stderr and "after" not in run.stdout
    assert noticed < 10, f"the demo ended {noticed:.0f} s after its kernel died"
    assert elapsed < 30, f"the demo took {elapsed:.0f} s in all"
    assert machine.leftovers() == []
    assert sorted(p.name for p in out.iterdir()) == ["kernel.log"]


def test_ctrl_c_ends_the_demo_with_one_line_and_exit_code_130(tiny_model_dir, tmp_path):
    machine = Machine(tmp_path)
    pid_file = tmp_path / "kernel.pid"
    nb = write_notebook(
        tmp_path / "sleeps.ipynb",
        f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid()))",
        "import time; time.sleep(120)",
        "print('after')",
    )
    proc = subprocess.Popen(
        machine.demo(nb, tiny_model_dir("llama"), tmp_path / "out"),
        cwd=tmp_path,
        env=machine.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the signal goes to the demo alone, as a terminal's would
    )
    try:
        shown = b""
        deadline = time.monotonic() + 120
        while b"[ 2/3]" not in shown and proc.poll() is None and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.5)[0]:
                shown += os.read(proc.stdout.fileno(), 4096)
        assert b"[ 2/3] import time" in shown, (shown, proc.poll())
        time.sleep(1.0)  # the cell is sleeping in the kernel now
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        rest, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = (shown + rest).decode(), stderr.decode()
    assert proc.returncode == 130, stderr
    assert stderr.splitlines() == [
        "interrupted: the demo stopped at cell 2: import time; time.sleep(120)"
    ]
    assert "Traceback" not in stdout + stderr and "after" not in stdout
    assert time.monotonic() - signalled < 20
    assert gone(int(pid_file.read_text())), "the kernel still runs"
    assert machine.leftovers() == []


def test_a_demo_that_ends_or_fails_leaves_nothing_behind(tiny_model_dir, tmp_path):
    machine = Machine(tmp_path)
    model = tiny_model_dir("llama")
    fine = write_notebook(tmp_path / "fine.ipynb", "print('fine')")
    run = subprocess.run(
        machine.demo(fine, model, tmp_path / "out"),
        env=machine.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert f"wrote {tmp_path / 'out' / 'fine.ipynb'} and" in run.stdout
    assert machine.leftovers() == []
    fails = write_notebook(tmp_path / "fails.ipynb", "x = 1", "raise ValueError('no such page')")
    run = subprocess.run(
        machine.demo(fails, model, tmp_path / "out"),
        env=machine.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert run.stderr.splitlines() == ["error: cell 2 raised ValueError: no such page"]
    assert machine.leftovers() == []


def test_a_test_kernel_that_dies_fails_the_wait_in_seconds_naming_the_signal(tmp_path):
    km = kernel_manager(tmp_path, env={"HOME": str(tmp_path)})
    km.start_kernel(cwd=str(tmp_path))
    kernel = Kernel(km)
    try:
        assert kernel.value("1 + 1") == "2"
        msg_id = kernel.send(KILL)
        started = time.monotonic()
        with pytest.raises(KernelDied, match=r"^the kernel died \(signal 4: SIGILL\)$"):
            kernel.wait_reply(msg_id)
        assert time.monotonic() - started < 10
    finally:
        kernel.close()
    assert not (tmp_path / "kernel-connection.json").exists()


def test_a_notebook_whose_kernel_dies_fails_in_seconds_naming_the_signal_and_cell(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(write_notebook(tmp_path / "dies.ipynb", "x = 1", KILL), as_version=4)
    km = kernel_manager(tmp_path, env={"HOME": str(tmp_path)}, asynchronous=True)
    client = NotebookClient(nb, km=km, timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    started = time.monotonic()
    with pytest.raises(KernelDied, match=r"signal 4: SIGILL\) while running notebook cell 3$"):
        execute_notebook(client)
    assert time.monotonic() - started < 30
    assert not (tmp_path / "kernel-connection.json").exists()

"""An engine leaves nothing behind: no scratch file, no thread, whether closed or not.

Each test runs a real engine in a subprocess so that interpreter exit (the `atexit`
hook, MLX's per-thread streams) is part of what is checked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mlx_nbengine.testing import make_tiny_model

SCRIPT = textwrap.dedent(
    """
    import os, sys, threading
    from mlx_nbengine import Engine

    model_dir, cache_dir, mode = sys.argv[1:]

    def files_open_in(directory):
        fds = "/proc/self/fd"
        links = []
        for fd in os.listdir(fds):
            try:
                links.append(os.readlink(os.path.join(fds, fd)))
            except OSError:
                pass
        return [link for link in links if link.startswith(directory)]

    engine = Engine.load(model_dir, cache_dir=cache_dir, block_size=32)
    engine.submit(list(range(2, 200)), max_tokens=20).result(timeout=60)
    engine.wait_for_saves(timeout=60)
    assert engine.stats()["file_size"] > 0
    assert len(files_open_in(cache_dir)) == 1, files_open_in(cache_dir)
    if mode == "close":
        engine.close()
        assert threading.active_count() == 1, threading.enumerate()
        assert files_open_in(cache_dir) == []
        print("closed cleanly", flush=True)
    else:
        # Exit with a request still decoding and the engine open.
        engine.submit(list(range(2, 300)), max_tokens=100_000)
        print("exiting without close", flush=True)
    """
)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model("gemma3_text", tmp_path_factory.mktemp("m") / "gemma3_text")


def run(model_dir: Path, cache_dir: Path, mode: str) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(model_dir), str(cache_dir), mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_close_leaves_no_scratch_file_and_no_thread(model_dir, tmp_path):
    done = run(model_dir, tmp_path, "close")
    assert done.returncode == 0, done.stderr
    assert "closed cleanly" in done.stdout
    assert os.listdir(tmp_path) == []


def test_a_process_exiting_without_close_exits_promptly_and_leaves_nothing(model_dir, tmp_path):
    start = time.monotonic()
    done = run(model_dir, tmp_path, "exit")
    assert done.returncode == 0, done.stderr  # no abort from a stream left behind
    assert "exiting without close" in done.stdout
    assert time.monotonic() - start < 60
    assert os.listdir(tmp_path) == []


def test_load_reports_gguf_conversion_progress_from_the_generation_thread(tmp_path, monkeypatch):
    from mlx_nbengine import Engine
    from mlx_nbengine.testing import make_tiny_gguf

    monkeypatch.setenv("MLX_NBENGINE_HOME", str(tmp_path / "home"))
    gguf_file = make_tiny_gguf("llama", tmp_path / "tiny.gguf")
    calls = []

    def progress(done, total):
        calls.append((done, total, threading.current_thread().name))

    with Engine.load(gguf_file, progress=progress, cache_dir=tmp_path) as engine:
        assert engine.submit([2, 7, 9], max_tokens=2).result(timeout=60).tokens
    assert calls, "a conversion reports its progress"
    dones = [done for done, _, _ in calls]
    assert dones == sorted(dones) and dones[-1] == calls[-1][1] > 0
    assert {name for _, _, name in calls} == {"mlx-nbengine-generation"}
    calls.clear()
    Engine.load(gguf_file, progress=progress, cache_dir=tmp_path).close()
    assert calls == []  # already converted: nothing to report

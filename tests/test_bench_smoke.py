"""Smoke test of the benchmarks: every `bench/` script's ``--quick`` mode completes and writes
its JSON.

Each runs as ``python -m bench.NAME --quick [--model DIR] --json PATH`` in a subprocess of
this interpreter, from the repository root, on tiny random models (the `tiny_model_dir`
fixture; never the default model), with a timeout. Figures are not checked: a quick run
measures milliseconds on a machine shared with other work. A peer that needs an optional
package (llama.cpp's) is skipped by the benchmark itself, which says so and still finishes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300

# name: (module, extra arguments, the tiny model passed with --model or None)
CASES = {
    "engine": ("bench_engine", [], ("gemma3_text", {"sliding_window": 64})),
    "restore": ("bench_restore", [], ("llama", {})),
    "peers": ("bench_peers", [], ("gemma3_text", {"sliding_window": 64})),
    "peers-parity": ("bench_peers", ["--parity"], None),  # its tiny families, made inside
    "sampling": ("bench_sampling", [], ("gemma3_text", {"sliding_window": 64})),
    "cpu_math": ("bench_cpu_math", [], ("gemma3_text", {"sliding_window": 64})),
    "vision": ("bench_vision", [], None),  # its two tiny vision families, made inside
    "blobfile": ("bench_blobfile", [], None),
    "persist": ("bench_persist", [], None),
    "blas": ("bench_blas", [], ("gemma3_text", {"sliding_window": 64})),
    "cpu_decode": ("bench_cpu_decode", [], ("llama", {})),
    "cpu_prefill": ("bench_cpu_prefill", [], ("gemma3_text", {"sliding_window": 64})),
    "api": ("bench_api", [], ("llama", {})),  # its tiny vision model made inside
    "ranks": ("bench_ranks", [], ("llama", {"kv_heads": 2})),  # two local ranks, loopback
}


def test_every_bench_script_is_covered():
    scripts = {p.stem for p in (ROOT / "bench").glob("bench_*.py")}
    assert scripts == {module for module, _, _ in CASES.values()}


@pytest.mark.parametrize("case", list(CASES))
def test_quick_run_writes_its_json(case, tiny_model_dir, tmp_path):
    module, extra, tiny = CASES[case]
    out = tmp_path / f"{case}.json"
    cmd = [sys.executable, "-m", f"bench.{module}", "--quick", *extra, "--json", str(out)]
    if tiny is not None:
        family, kwargs = tiny
        cmd += ["--model", str(tiny_model_dir(family, **kwargs))]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    tail = (done.stdout[-3000:] + "\n" + done.stderr[-3000:]).strip()
    assert done.returncode == 0, f"{' '.join(cmd[1:])} failed:\n{tail}"
    assert out.is_file(), f"no JSON written:\n{tail}"
    data = json.loads(out.read_text())
    assert isinstance(data, dict) and data, tail
    assert out.with_suffix(".txt").is_file(), "no table written beside the JSON"
    if module == "bench_peers" and not extra:
        # llama.cpp is optional: where it is missing the run says so and skips it alone.
        skipped = data.get("skipped", {})
        if "llama.cpp" in skipped:
            assert "llama.cpp skipped" in done.stdout

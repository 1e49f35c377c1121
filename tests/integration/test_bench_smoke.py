"""Smoke test of the benchmarks: every `bench/` script's ``--quick`` mode completes and writes
its JSON.

Each runs as ``python -m bench.NAME --quick [--model DIR] --json PATH`` in a subprocess of
this interpreter, from the repository root, on tiny random models (the `tiny_model_dir`
fixture; never the default model), with a timeout. Figures are not checked: a quick run
measures milliseconds on a machine shared with other work.

llama.cpp: every path of a benchmark that runs it (llama-cpp-python's `Llama` with its prompt
cache on, its server, the ``[server]`` extra, and llama.cpp's own ``llama-bench``,
`bench.llama_tools`) runs on a GGUF of the tiny model. Where a side is here (llama-cpp-python
installed, its server's extra, ``llama-bench`` built), its paths must have run (not
skipped). Where one is missing the benchmark skips that peer alone and says so, and the test
checks that it did; under ``CI=true`` a missing one fails the test instead (`.ci/run`
installs llama-cpp-python with its server and builds llama-bench).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600  # a busy 2-core machine: the api case with its llama.cpp server takes minutes
IN_CI = os.environ.get("CI") == "true"

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
    "families": ("bench_families", [], None),  # tiny hybrid, its twin, tiny gemma4: inside
}


# Benchmarks whose smoke run has a file of its own.
SMOKED_ELSEWHERE = {"bench_agent": "tests/integration/test_bench_agent_smoke.py"}


def test_every_bench_script_is_covered():
    scripts = {p.stem for p in (ROOT / "bench").glob("bench_*.py")}
    assert all((ROOT / path).is_file() for path in SMOKED_ELSEWHERE.values())
    assert scripts == {module for module, _, _ in CASES.values()} | set(SMOKED_ELSEWHERE)


@pytest.mark.parametrize("case", list(CASES))
def test_quick_run_writes_its_json(case, tiny_model_dir, tmp_path):
    module, extra, tiny = CASES[case]
    out = tmp_path / f"{case}.json"
    cmd = [sys.executable, "-m", f"bench.{module}", "--quick", *extra, "--json", str(out)]
    if tiny is not None:
        family, kwargs = tiny
        cmd += ["--model", str(tiny_model_dir(family, **kwargs))]
    scratch = tmp_path / "tmp"  # the run's temporary files, which it must remove
    scratch.mkdir()
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(scratch)},
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
    # MLX keeps a folder of its own there (`mlx`, shared by every process, as in /tmp).
    left = sorted(p.name for p in scratch.iterdir() if p.name != "mlx")
    assert not left, f"{module} left temporary files behind: {left}"
    if module in LLAMA_PATHS and not extra:
        check_llama_paths(module, data, done.stdout + done.stderr)
    if module == "bench_cpu_decode" and data["kernels"]["active"]:
        check_decode_variants(data["variants"])


def check_decode_variants(variants: dict) -> None:
    """Our variants ran their quantized layers on our kernels and MLX's on MLX's (a model
    quantized after its load is routed by the benchmark itself: once it was not, and "ours"
    measured MLX's kernels)."""
    for bits in (8, 4):
        assert variants[f"ours q{bits}"]["layers_on_our_kernels"] > 0, variants
        if f"mlx q{bits}" in variants:
            assert variants[f"mlx q{bits}"]["layers_on_our_kernels"] == 0, variants


# The benchmarks with llama.cpp paths: where each records (in its JSON) the outcome of each
# path, a dict holding "skipped" (the reason) where the path did not run.
LLAMA_PATHS = {
    "bench_peers": {
        "binding": lambda d: (
            {"skipped": d["skipped"]["llama.cpp"]}
            if "llama.cpp" in d["skipped"]
            else d["four"]["llama.cpp"]
        ),
    },
    "bench_cpu_prefill": {
        "binding": lambda d: d["llama_cpp"],
        "llama-bench": lambda d: d["llama_bench"],
    },
    "bench_cpu_decode": {
        "binding": lambda d: d["llama_cpp"]["binding"],
        "answers": lambda d: d["whole_answers"].get("llama.cpp", d["whole_answers"]),
        "llama-bench": lambda d: d["llama_cpp"]["llama_bench"],
    },
    "bench_families": {
        "binding": lambda d: (
            (d["results"]["tiny"].get("llama.cpp") and d["results"]["tiny-gemma4"].get("llama.cpp"))
            or {"skipped": d["skipped"]["llama.cpp"]}
        ),
    },
    "bench_api": {
        "server": lambda d: (
            d["servers"].get("llama.cpp")
            or {"skipped": d["skipped"].get("llama.cpp") or d["skipped"].get("llama_cpp")}
        ),
    },
}
SIDES = {"llama-bench": "llama-bench", "server": "server"}  # every other path: the binding


def llama_missing() -> dict[str, str | None]:
    """Why each llama.cpp side cannot run here (None where it can): llama-cpp-python (the
    binding), its server extra and llama-bench (`python -m bench.llama_tools path
    llama-bench`)."""
    binding = server = None
    if importlib.util.find_spec("llama_cpp") is None:
        binding = server = "llama-cpp-python is not installed (pip install -e '.[peers]')"
    else:  # in a child: this process loads no llama.cpp
        done = subprocess.run(
            [sys.executable, "-c", "import llama_cpp.server.app"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            server = f"llama-cpp-python[server] is not installed ({last})"
    done = subprocess.run(
        [sys.executable, "-m", "bench.llama_tools", "path", "llama-bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    tool = None if done.returncode == 0 else (done.stdout.strip() or done.stderr[-300:])
    return {"binding": binding, "llama-bench": tool, "server": server}


def check_llama_paths(module: str, data: dict, output: str) -> None:
    """Every llama.cpp path of `module` ran where its side is here; else it was skipped and
    said so; under CI=true a missing side fails."""
    missing = llama_missing()
    for path, outcome in LLAMA_PATHS[module].items():
        why = missing[SIDES.get(path, "binding")]
        result = outcome(data)
        if why is None:
            assert "skipped" not in result, f"{module}: llama.cpp's {path} did not run: {result}"
            continue
        if IN_CI:
            pytest.fail(f"CI=true and {why}", pytrace=False)
        assert "skipped" in result, f"{module}: {path} ran though {why}?"
        assert "skipped" in output, f"{module}: {path} skipped but not said so"


def test_llama_cpp_is_here_under_ci():
    """Under CI=true llama-cpp-python and llama-bench are there (.ci/run puts them there), so
    no llama.cpp path of the benchmarks is skipped."""
    missing = {k: v for k, v in llama_missing().items() if v}
    if not IN_CI:
        pytest.skip(f"not CI; missing here: {missing or 'nothing'}")
    assert not missing, f"CI=true and {missing}"

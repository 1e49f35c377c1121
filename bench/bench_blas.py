"""Gemma 3 270M float32 prefill and decode speed on CPU, per BLAS set-up, in one run.

Each set-up runs in its own subprocess (a process's BLAS is fixed once MLX is imported):

- ``default``: what a user gets; `mlx_nbengine` binds OpenBLAS in-process
  (``_blas.py``) and runs each step in `blas_step(tokens)`: the faster
  (measured) of all threads and one thread, separately for prefill and decode
  (decode starts on one thread and probes all threads after three steps).
- ``all-threads``: OpenBLAS in-process, its default thread count for every step.
- ``one-thread``: OpenBLAS in-process, one thread for every step.
- ``preload``: the classic way, ``LD_PRELOAD`` of the same OpenBLAS (with the
  libgfortran shim on ``LD_LIBRARY_PATH``), default threads; a cross-check.
- ``reference``: the reference BLAS bundled in the mlx-cpu wheel
  (``MLX_NBENGINE_BLAS=reference``).

*Prefill* feeds a prompt of ``--prompt-tokens`` tokens in 256-token steps (as the
engine does), evaluating only the cache and the last position's logits, best of
``--prefill-runs`` prefills (one for the slow reference BLAS); *decode*
generates ``--decode-tokens`` tokens greedily one at a time. Rounds alternate the
set-ups, and the best round of each counts, so a noisy shared machine hurts least.
Writes ``bench/results/blas-<time>.json`` and ``.md`` and prints the table.

    python bench/bench_blas.py [--rounds 2] [--prompt-tokens 256] [--decode-tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODES = ("default", "all-threads", "one-thread", "preload", "reference")
PROMPT_TEXT = (
    "The Eiffel Tower is located in the city of Paris. It was built for the 1889 World's Fair "
    "and was at first criticised by artists and intellectuals, yet it became a global icon. "
)


def child(args: argparse.Namespace) -> None:
    """Measure in this process; print one JSON line."""
    from contextlib import nullcontext

    from mlx_nbengine import _blas
    from mlx_nbengine._blas import blas_status, blas_step, ensure_fast_blas

    ensure_fast_blas()

    def step(n: int):
        return blas_step(n) if args.mode == "default" else nullcontext()

    import mlx.core as mx

    from mlx_nbengine.models import load

    a = mx.random.normal((1024, 1024))
    mx.eval(a @ a)
    t = time.perf_counter()
    for _ in range(3):
        mx.eval(a @ a)
    gflops = 3 * 2 * 1024**3 / (time.perf_counter() - t) / 1e9

    t = time.perf_counter()
    lm = load("default", dtype="float32")
    load_s = time.perf_counter() - t
    ids = lm.encode(PROMPT_TEXT * 64)[: args.prompt_tokens]

    def prefill() -> tuple[float, list]:
        cache = lm.make_cache()
        start = time.perf_counter()
        for s in range(0, len(ids), 256):
            chunk = mx.array(ids[s : s + 256])[None]
            with step(chunk.shape[1]):
                if s + 256 < len(ids):
                    lm.model(chunk, cache=cache)
                    mx.eval([c.state for c in cache])
                else:
                    logits = lm.model(chunk, cache=cache)[:, -1]
                    mx.eval(logits)
        return time.perf_counter() - start, (cache, logits)

    # Several prefills, as over a session: the default's tuner tries both thread counts
    # in its first two. The reference BLAS is too slow to repeat and has nothing to tune.
    runs = 1 if args.mode == "reference" else args.prefill_runs
    timings = [prefill() for _ in range(runs)]
    prefill_s = min(t for t, _ in timings)
    cache, logits = timings[-1][1]
    token = mx.argmax(logits, axis=-1)
    start = time.perf_counter()
    for _ in range(args.decode_tokens):
        with step(1):
            logits = lm.model(token[None], cache=cache)[:, -1]
            token = mx.argmax(logits, axis=-1)
            mx.eval(token)
    decode_s = time.perf_counter() - start
    status = blas_status()
    print(
        json.dumps(
            {
                "blas_active": bool(status and status.active),
                "blas_reason": status.reason if status else None,
                "matmul_gflops": gflops,
                "load_s": load_s,
                "prompt_tokens": len(ids),
                "prefill_tok_s": len(ids) / prefill_s,
                "decode_tokens": args.decode_tokens,
                "decode_tok_s": args.decode_tokens / decode_s,
                # The decode thread count `blas_step` ended on (default set-up only).
                "decode_threads": _blas._decode.preferred if _blas._decode else None,
            }
        )
    )


def _env(mode: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if mode == "reference":
        env["MLX_NBENGINE_BLAS"] = "reference"
    elif mode == "one-thread":
        env["OPENBLAS_NUM_THREADS"] = "1"
    elif mode == "preload":
        from mlx_nbengine import _blas

        openblas = _blas._find_in_site("cmeel.prefix/lib/libopenblas.so.0")
        gfortran = _blas._find_mlx_gfortran()
        if openblas is None:
            raise RuntimeError("cmeel-openblas is not installed")
        env["MLX_NBENGINE_BLAS"] = "reference"  # the preload alone does the work
        env["LD_PRELOAD"] = str(openblas)
        if gfortran is not None:
            shim = _blas._gfortran_shim(gfortran).parent
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                filter(None, [str(shim), env.get("LD_LIBRARY_PATH")])
            )
    return env


def run_child(mode: str, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        mode,
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--decode-tokens",
        str(args.decode_tokens),
        "--prefill-runs",
        str(args.prefill_runs),
    ]
    out = subprocess.run(cmd, env=_env(mode), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict], summary: dict) -> str:
    lines = [
        "| BLAS set-up | OpenBLAS | matmul GFLOP/s | prefill tok/s | decode tok/s "
        "| decode threads chosen |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {mode != 'reference'} | {r['matmul_gflops']:.1f} "
            f"| {r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.2f} "
            f"| {r.get('decode_threads') or '-'} |"
        )
    if not summary:
        return "\n".join(lines)
    lines += [
        "",
        f"default prefill = {summary['default_vs_best']:.0%} of best, "
        f"{summary['default_vs_reference']:.1f}x reference "
        f"(targets: >= 90%, >= 10x) -> {'PASS' if summary['meets_targets'] else 'MISS'}",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", dest="mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--prefill-runs", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    args = parser.parse_args()
    if args.mode:
        child(args)
        return

    sys.path.insert(0, str(ROOT))
    modes = [m for m in args.modes.split(",") if m]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for round_ in range(args.rounds):
        for mode in modes:
            print(f"round {round_ + 1}/{args.rounds}: {mode} ...", file=sys.stderr, flush=True)
            runs[mode].append(run_child(mode, args))
    best = {
        m: {
            **max(rs, key=lambda r: r["prefill_tok_s"]),
            "decode_tok_s": max(r["decode_tok_s"] for r in rs),
        }
        for m, rs in runs.items()
    }
    summary: dict = {}
    if "default" in best and "reference" in best:
        fastest = max(r["prefill_tok_s"] for m, r in best.items() if m != "reference")
        summary = {
            "default_vs_best": best["default"]["prefill_tok_s"] / fastest,
            "default_vs_reference": best["default"]["prefill_tok_s"]
            / best["reference"]["prefill_tok_s"],
        }
        summary["meets_targets"] = (
            summary["default_vs_best"] >= 0.9 and summary["default_vs_reference"] >= 10
        )
    text = table(best, summary)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "model": "Gemma 3 270M (Q4_K_M GGUF, dequantized, float32)",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
        },
        "args": {k: v for k, v in vars(args).items() if k != "mode"},
        "best": best,
        "runs": runs,
        "summary": summary,
    }
    (RESULTS / f"blas-{stamp}.json").write_text(json.dumps(record, indent=2))
    (RESULTS / f"blas-{stamp}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

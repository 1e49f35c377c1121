"""Engine benchmarks: batching, RAM kept by stale caches, time to first token after an edit.

Three ratios per model, each measured within one run:

- **(a) batching**: four short chats submitted together to an engine with ``parallel=4``
  vs the same four one after another on the same engine. *speedup* = sequential
  wall time / parallel wall time (target on Gemma 3 270M: >= 3.5x). *mlx-lm batch* is
  the same ratio for mlx-lm's `generate_step` one by one vs its `batch_generate`, each
  run under one BLAS thread and under every usable CPU (`bench.common.blas_thread_counts`;
  our engine picks its count per step, see `mlx_nbengine._blas`), ``--mlx-lm-repeats``
  runs each (alternated), and taken at its best count (named in the table and the JSON).
- **(b) RAM**: four long prompts submitted together (``parallel=4``), in a fresh
  subprocess per mode. *extra RAM* = RSS once the engine is idle again minus RSS after
  load and a warm-up with one prompt of the same length. Modes: the disk store (records
  in the scratch file) vs the memory-only store (``disk_budget=0``: the same records
  kept in RAM, like an in-memory prompt cache).
  *saving* = 1 - extra(disk) / extra(memory) (target >= 85%); a negative extra (the
  allocator gave memory back) counts as 0.
- **(c) TTFT after an edit**: a prompt of ``--ttft-tokens`` tokens is run once, then
  again with its last 100 tokens changed. Each of ``--repeats`` rounds starts from an
  emptied store (`Engine.clear_cache`): the original prompt is run (untimed), then a
  never-seen prompt of the same length (*cold*), then the edited prompt (*warm*), so every
  warm run meets a store that holds the original (and the unrelated cold prompt), never
  the edit itself, and the hot cache holds the cold prompt. Figures are the median
  (min-max) of the rounds. *mlx-lm LRU* = TTFT of the edited prompt with mlx-lm's own
  `LRUPromptCache` holding the original prompt's cache (prefill with `generate_step`, as
  mlx-lm's server does; the cache is copied out of the LRU for every run, so every run
  is a first edit), ``--mlx-lm-repeats`` runs under each BLAS thread count (alternated),
  the median of the best count. *floor* = the prefill time of the tokens that cannot be
  restored (the computed blocks of each warm report) + restored bytes / the read
  bandwidth measured on the cache directory (median of the rounds). Targets: cold/warm >= 7x and
  warm/floor <= 1.25x.

Models: the default model (Gemma 3 270M via ``load("default")``, float32; skipped with
``--skip-default``) and tiny random models from `mlx_nbengine.testing` (block size 32
for those, so their prompts span several blocks). Results: ``bench/results/engine.json``
and ``bench/results/engine.txt``; the table is printed too.

Run from the repository root: ``.venv/bin/python -m bench.bench_engine [--skip-default]``;
``--only a`` runs only part (a), ``--models gemma,llama`` only the models whose names
contain one of these words (a partial run prints its table and writes no results);
``--model M`` measures M in place of the default model. ``--quick`` (a smoke test, seconds)
runs all three parts with small sizes on one tiny model (``--model DIR``, else a tiny
gemma3_text), writing only ``--json PATH``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import psutil  # noqa: E402

from bench.common import blas_thread_counts, set_blas_threads, write_results  # noqa: E402
from mlx_nbengine import Engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "tiny llama": ("llama", {}),
    "tiny gemma3_text w64": ("gemma3_text", {"sliding_window": 64}),
    "tiny qwen3_5": ("qwen3_5", {}),
}
CHATS = [
    "Write a haiku about the sea.",
    "Name three uses of a paper clip.",
    "Explain what a prime number is to a child.",
    "Give me a short packing list for a day hike.",
]
WORDS = "alpha beta river stone cloud paper seven green ocean table lamp window garden".split()


def text_prompt(lm, n_tokens: int, seed: int) -> list[int]:
    """`n_tokens` ids of plain random English words (BOS first), cut to length."""
    rng = random.Random(seed)
    words = " ".join(rng.choice(WORDS) for _ in range(n_tokens * 2))
    return lm.encode(words)[:n_tokens]


def edited(lm, tokens: list[int], n_last: int, seed: int) -> list[int]:
    return tokens[:-n_last] + text_prompt(lm, n_last + 1, seed)[1 : n_last + 1]


# --- (a) batching ----------------------------------------------------------------------------


def bench_batching(engine: Engine, *, max_tokens: int, repeats: int) -> dict:
    if getattr(engine.model, "has_chat_template", True):
        chats = [[{"role": "user", "content": c}] for c in CHATS]
    else:  # a base model (e.g. the default GGUF): the same requests as plain text
        chats = list(CHATS)
    engine.submit(chats[0], max_tokens=4).result()  # warm-up: first-call allocations
    t_seq, t_par = [], []
    for _ in range(repeats):  # alternated, so a change in machine load hits both
        t = time.perf_counter()
        seq = [engine.submit(c, max_tokens=max_tokens).result() for c in chats]
        t_seq.append(time.perf_counter() - t)
        t = time.perf_counter()
        reqs = [engine.submit(c, max_tokens=max_tokens) for c in chats]
        par = [r.result() for r in reqs]
        t_par.append(time.perf_counter() - t)
    return {
        "sequential_s": min(t_seq),
        "parallel_s": min(t_par),
        "speedup": min(t_seq) / min(t_par),
        "tokens_sequential": sum(len(c.tokens) for c in seq),
        "tokens_parallel": sum(len(c.tokens) for c in par),
        "same_tokens": [c.tokens for c in seq] == [c.tokens for c in par],
        "prompts": [c.prompt_tokens for c in seq],
    }


def mlx_lm_batching(lm, prompts: list[list[int]], *, max_tokens: int, repeats: int) -> dict:
    """The same chats through mlx-lm: `generate_step` one by one vs `batch_generate`, under
    each BLAS thread count (alternated, best of `repeats` each); the ratio at the best
    count of each."""
    from mlx_lm.generate import batch_generate, generate_step

    def sequential() -> float:
        t = time.perf_counter()
        for p in prompts:
            for _ in generate_step(mx.array(p), lm.model, max_tokens=max_tokens):
                pass
        return time.perf_counter() - t

    def batched() -> float:
        t = time.perf_counter()
        batch_generate(lm.model, lm.tokenizer, prompts, max_tokens=max_tokens)
        return time.perf_counter() - t

    counts = blas_thread_counts() or [None]
    for _ in generate_step(mx.array(prompts[0]), lm.model, max_tokens=4):
        pass  # warm-up: first-call allocations
    seq: dict = {n: [] for n in counts}
    bat: dict = {n: [] for n in counts}
    for _ in range(repeats):
        for n in counts:
            if n is not None:
                set_blas_threads(n)
            seq[n].append(sequential())
            bat[n].append(batched())
    best_seq = min(counts, key=lambda n: min(seq[n]))
    best_bat = min(counts, key=lambda n: min(bat[n]))
    return {
        "sequential_s": min(seq[best_seq]),
        "batch_s": min(bat[best_bat]),
        "speedup": min(seq[best_seq]) / min(bat[best_bat]),
        "sequential_threads": best_seq,
        "batch_threads": best_bat,
        "by_threads": {str(n): {"sequential_s": seq[n], "batch_s": bat[n]} for n in counts},
    }


# --- (b) RAM ---------------------------------------------------------------------------------


def rss_child(model: str, mode: str, n_tokens: int, block_size: int) -> dict:
    """Run in a subprocess: extra RSS after four long prompts (see the module docstring)."""
    proc = psutil.Process()
    with tempfile.TemporaryDirectory() as scratch:
        engine = Engine.load(
            model,
            parallel=4,
            block_size=block_size,
            disk_budget=0 if mode == "memory" else None,
            cache_dir=scratch,
            dtype="float32",
        )
        lm = engine.model
        # Warm-up of the same size: first-use buffers (BLAS workspaces, MLX's kernels'
        # scratch) are paid before the baseline, so "extra" is what the prompts leave.
        engine.submit(text_prompt(lm, n_tokens, seed=99), max_tokens=8).result()
        engine.wait_for_saves()
        gc.collect()
        time.sleep(0.5)
        before = proc.memory_info().rss
        t = time.perf_counter()
        reqs = [engine.submit(text_prompt(lm, n_tokens, seed=i), max_tokens=8) for i in range(4)]
        for r in reqs:
            r.result()
        seconds = time.perf_counter() - t
        engine.wait_for_saves()
        gc.collect()
        time.sleep(0.5)
        after = proc.memory_info().rss
        mlx_active = mx.get_active_memory()
        stats = engine.stats()
        engine.close()
    return {
        "mode": mode,
        "rss_before": before,
        "rss_after": after,
        "extra_bytes": after - before,
        "seconds": seconds,
        "store_bytes": stats.get("bytes_held", 0),
        "mlx_active_bytes": mlx_active,
    }


def bench_ram(model: str, *, n_tokens: int, block_size: int) -> dict:
    out = {}
    for mode in ("disk", "memory"):
        cmd = [sys.executable, "-m", "bench.bench_engine", "--rss-child", mode, model]
        cmd += ["--rss-tokens", str(n_tokens), "--block-size", str(block_size)]
        done = subprocess.run(
            cmd, capture_output=True, text=True, cwd=ROOT, check=False, timeout=1800
        )
        if done.returncode != 0:
            raise RuntimeError(f"RAM child ({mode}) failed:\n{done.stderr[-2000:]}")
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    disk, mem = out["disk"]["extra_bytes"], out["memory"]["extra_bytes"]
    out["saving"] = 1 - max(disk, 0) / mem if mem > 0 else None
    return out


# --- (c) TTFT --------------------------------------------------------------------------------


def read_bandwidth(directory: str, nbytes: int) -> float:
    """Bytes per second of sequential `pread` of a freshly written file in `directory`."""
    nbytes = max(nbytes, 64 << 20)
    chunk = 4 << 20
    data = os.urandom(chunk)
    with tempfile.TemporaryFile(dir=directory) as f:
        for _ in range(nbytes // chunk):
            f.write(data)
        f.flush()
        fd = f.fileno()
        t = time.perf_counter()
        for off in range(0, nbytes // chunk * chunk, chunk):
            os.pread(fd, chunk, off)
        return nbytes // chunk * chunk / (time.perf_counter() - t)


def mlx_lm_lru_ttft(lm, original: list[int], edit: list[int], *, repeats: int) -> dict:
    """TTFT of `edit` with mlx-lm's LRUPromptCache holding `original`'s cache, `repeats`
    runs under each BLAS thread count (alternated); the median of the best count.

    `fetch_nearest_cache` hands out a copy, so the LRU holds `original` alone at every run."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    lru = LRUPromptCache()
    cache = make_prompt_cache(lm.model)
    for _ in generate_step(mx.array(original), lm.model, prompt_cache=cache, max_tokens=1):
        break
    lru.insert_cache("m", original, cache)
    del cache

    def once() -> tuple[float, int]:
        t = time.perf_counter()
        cache, rest = lru.fetch_nearest_cache("m", edit)
        if cache is None:
            cache, rest = make_prompt_cache(lm.model), edit
        for token, _ in generate_step(mx.array(rest), lm.model, prompt_cache=cache, max_tokens=1):
            int(token)
            break
        return time.perf_counter() - t, len(edit) - len(rest)

    counts = blas_thread_counts() or [None]
    runs: dict = {n: [] for n in counts}
    reused = 0
    for _ in range(repeats):
        for n in counts:
            if n is not None:
                set_blas_threads(n)
            seconds, reused = once()
            runs[n].append(seconds)
    best = min(counts, key=lambda n: statistics.median(runs[n]))
    gc.collect()
    mx.clear_cache()
    return {
        "ttft_s": statistics.median(runs[best]),
        "threads": best,
        "reused_tokens": reused,
        "by_threads": {str(n): runs[n] for n in counts},
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_ttft(engine: Engine, *, n_tokens: int, repeats: int, scratch: str) -> dict:
    """Warm and cold TTFT of an edited prompt (module docstring): `repeats` rounds, each
    from an emptied store holding the original only; medians (min-max)."""
    lm = engine.model
    original = text_prompt(lm, n_tokens, seed=1)
    edit = edited(lm, original, 100, seed=2)
    # Warm-up of the same shape (untimed): first-call allocations, the BLAS tuner's tries.
    engine.submit(text_prompt(lm, n_tokens, seed=9), max_tokens=1).result()
    engine.wait_for_saves()
    engine.drop_hot_cache()  # the warm-up's edit comes from the store
    warm_edit = edited(lm, text_prompt(lm, n_tokens, seed=9), 100, seed=3)
    engine.submit(warm_edit, max_tokens=1).result()
    engine.wait_for_saves()
    warm_runs, cold_runs = [], []
    for i in range(repeats):
        engine.clear_cache()  # the store and the hot cache emptied: no earlier edit is held
        engine.submit(original, max_tokens=1).result()
        engine.wait_for_saves()
        cold_runs.append(engine.submit(text_prompt(lm, n_tokens, seed=10 + i), max_tokens=1))
        cold_runs[-1] = cold_runs[-1].result().report
        engine.wait_for_saves()
        warm_runs.append(engine.submit(edit, max_tokens=1).result().report)
        engine.wait_for_saves()
    tails = [sum(b.seconds for b in r.blocks if b.source == "computed") for r in warm_runs]
    bandwidth = read_bandwidth(scratch, max(r.restored_bytes for r in warm_runs))
    floors = [t + r.restored_bytes / bandwidth for t, r in zip(tails, warm_runs, strict=True)]
    warm = spread([r.ttft_s for r in warm_runs])
    cold = spread([r.ttft_s for r in cold_runs])
    floor = spread(floors)
    return {
        "prompt_tokens": len(edit),
        "rounds": repeats,
        "warm_ttft_s": warm["median"],
        "warm_ttft": warm,
        "warm_sources": [r.restore_source for r in warm_runs],
        "restored_tokens": [r.restored_tokens for r in warm_runs],
        "restored_bytes": [r.restored_bytes for r in warm_runs],
        "cold_ttft_s": cold["median"],
        "cold_ttft": cold,
        "tail_prefill_s": tails,
        "read_bandwidth_Bps": bandwidth,
        "floor_s": floor["median"],
        "floor": floor,
        "cold_over_warm": cold["median"] / warm["median"],
        "warm_over_floor": warm["median"] / floor["median"],
        "original": original,
        "edit": edit,
    }


# --- table -----------------------------------------------------------------------------------


def _threads(n) -> str:
    return "-" if n is None else f"{n}t"


def table(rows: list[dict]) -> str:
    lines = []
    head = ["model", "(a) seq s", "par s", "speedup", "mlx-lm batch (threads seq/batch)"]
    head += ["(b) extra MB disk", "memory", "saving"]
    head += ["(c) cold s", "warm s (min-max)", "cold/warm", "floor s", "warm/floor"]
    head += ["mlx-lm LRU s (threads)", "LRU reused", "LRU/warm"]
    lines.append(" | ".join(head))
    lines.append(" | ".join("---" for _ in head))
    for r in rows:
        a, b, c = r.get("batching"), r.get("ram"), r.get("ttft")
        cells = [r["model"]]
        ref = r.get("mlx_lm_batching")
        if a:
            cells += [f"{a['sequential_s']:.2f}", f"{a['parallel_s']:.2f}", f"{a['speedup']:.2f}x"]
            cells.append(
                f"{ref['speedup']:.2f}x ({_threads(ref['sequential_threads'])}/"
                f"{_threads(ref['batch_threads'])})"
                if ref
                else "-"
            )
        else:
            cells += ["-"] * 4
        if b:
            cells += [
                f"{b['disk']['extra_bytes'] / 1e6:.0f}",
                f"{b['memory']['extra_bytes'] / 1e6:.0f}",
                f"{b['saving']:.0%}" if b["saving"] is not None else "-",
            ]
        else:
            cells += ["-"] * 3
        if c:
            w = c["warm_ttft"]
            cells += [
                f"{c['cold_ttft_s']:.2f}",
                f"{w['median']:.2f} ({w['min']:.2f}-{w['max']:.2f})",
                f"{c['cold_over_warm']:.1f}x",
                f"{c['floor_s']:.2f}",
                f"{c['warm_over_floor']:.2f}x",
                f"{c['lru_ttft_s']:.2f} ({_threads(c['lru_threads'])})",
                f"{c['lru_reused_tokens']}",
                f"{c['lru_over_warm']:.1f}x",
            ]
        else:
            cells += ["-"] * 8
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def bench_model(name: str, model: str, args, *, block_size: int, scale: int) -> dict:
    from mlx_nbengine.models import load

    row: dict = {"model": name, "block_size": block_size}
    with tempfile.TemporaryDirectory() as scratch:
        engine = Engine.load(
            model, parallel=4, block_size=block_size, dtype="float32", cache_dir=scratch
        )
        with engine:
            if "a" in args.only:
                print(f"[{name}] (a) batching", flush=True)
                row["batching"] = bench_batching(
                    engine, max_tokens=args.chat_tokens, repeats=args.repeats
                )
            if "c" in args.only:
                print(f"[{name}] (c) TTFT", flush=True)
                row["ttft"] = bench_ttft(
                    engine,
                    n_tokens=args.ttft_tokens // scale,
                    repeats=args.repeats,
                    scratch=scratch,
                )
    print(f"[{name}] mlx-lm references", flush=True)
    lm = load(model, dtype="float32")  # on this thread, for mlx-lm's own loops
    if "a" in args.only:
        row["mlx_lm_batching"] = mlx_lm_batching(
            lm,
            row["batching"].pop("prompts"),
            max_tokens=args.chat_tokens,
            repeats=args.mlx_lm_repeats,
        )
    if "c" in args.only:
        ttft = row["ttft"]
        lru = mlx_lm_lru_ttft(
            lm, ttft.pop("original"), ttft.pop("edit"), repeats=args.mlx_lm_repeats
        )
        ttft.update(
            lru_ttft_s=lru["ttft_s"],
            lru_threads=lru["threads"],
            lru_by_threads=lru["by_threads"],
            lru_reused_tokens=lru["reused_tokens"],
            lru_over_warm=lru["ttft_s"] / ttft["warm_ttft_s"],
        )
    del lm
    gc.collect()
    mx.clear_cache()
    if "b" not in args.only:
        return row
    print(f"[{name}] (b) RAM", flush=True)
    # Tiny models keep ~1 KB per token: their RAM test needs long prompts to rise above noise.
    rss_tokens = args.rss_tokens if scale == 1 or args.quick else 4096
    row["ram"] = bench_ram(model, n_tokens=rss_tokens, block_size=block_size)
    return row


def main(argv: list[str] | None = None) -> int:
    from bench.common import add_run_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--skip-default", action="store_true", help="only the tiny models")
    ap.add_argument("--skip-tiny", action="store_true", help="only the default model")
    ap.add_argument("--chat-tokens", type=int, default=None, help="(a) max tokens per chat (64)")
    ap.add_argument(
        "--rss-tokens", type=int, default=None, help="(b) tokens per long prompt (1024)"
    )
    ap.add_argument("--ttft-tokens", type=int, default=None, help="(c) prompt tokens (2048)")
    ap.add_argument("--repeats", type=int, default=None, help="(a) best of, (c) rounds (3)")
    ap.add_argument(
        "--mlx-lm-repeats",
        type=int,
        default=None,
        help="mlx-lm's runs per BLAS thread count in (a) and (c) (1)",
    )
    ap.add_argument(
        "--only", default="abc", help="the parts to run, e.g. `a` or `ac` (default: abc)"
    )
    ap.add_argument(
        "--models",
        default=None,
        help="comma-separated parts of model names to run, e.g. `gemma,llama` (default: all)",
    )
    ap.add_argument("--block-size", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--rss-child", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    quick = {"chat_tokens": 8, "rss_tokens": 512, "ttft_tokens": 256, "repeats": 2}
    full = {"chat_tokens": 64, "rss_tokens": 1024, "ttft_tokens": 2048, "repeats": 3}
    quick["mlx_lm_repeats"] = full["mlx_lm_repeats"] = 1
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.rss_child:
        mode, model = args.rss_child
        print(json.dumps(rss_child(model, mode, args.rss_tokens, args.block_size)))
        return 0

    wanted = [w.strip().lower() for w in args.models.split(",")] if args.models else None

    def chosen(name: str) -> bool:
        return wanted is None or any(w in name.lower() for w in wanted)

    rows = []
    settings = {
        "chat_tokens": args.chat_tokens,
        "rss_tokens": args.rss_tokens,
        "ttft_tokens": args.ttft_tokens,
        "repeats": args.repeats,
        "mlx_lm_repeats": args.mlx_lm_repeats,
        "only": args.only,
        "blas_thread_counts": blas_thread_counts(),
        "quick": args.quick,
    }
    if args.quick:
        # One tiny model, every part, small sizes: a smoke test of the whole benchmark.
        with tempfile.TemporaryDirectory() as models:
            if args.model:
                path, name = args.model, f"quick: {Path(args.model).name}"
            else:
                from mlx_nbengine.testing import make_tiny_model

                path = str(make_tiny_model("gemma3_text", Path(models) / "g", sliding_window=64))
                name = "quick: tiny gemma3_text w64"
            rows.append(bench_model(name, path, args, block_size=32, scale=1))
        write_results(
            "engine", {**settings, "rows": rows}, table(rows), json_path=args.json, quick=True
        )
        return 0
    if not args.skip_default:
        name = Path(args.model).name if args.model else "Gemma 3 270M"
        if chosen(name):
            rows.append(bench_model(name, args.model or "default", args, block_size=256, scale=1))
    if not args.skip_tiny:
        from mlx_nbengine.testing import make_tiny_model

        with tempfile.TemporaryDirectory() as models:
            for name, (family, kw) in TINY.items():
                if not chosen(name):
                    continue
                path = str(make_tiny_model(family, Path(models) / family, **kw))
                # Block 32 and prompts / 8: the tiny models' prompts span blocks as Gemma's do.
                rows.append(bench_model(name, path, args, block_size=32, scale=8))
    if args.only != "abc" or wanted is not None:
        # A partial run must not overwrite the full table the README quotes.
        print(table(rows))
        print(json.dumps(rows, indent=1))
        return 0
    write_results("engine", {**settings, "rows": rows}, table(rows), json_path=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())

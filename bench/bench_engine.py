"""Engine benchmarks: batching, RAM kept by stale caches, time to first token after an edit.

Three ratios per model, each measured within one run:

- **(a) batching**: four short chats submitted together to an engine with ``parallel=4``
  vs the same four one after another on the same engine. *speedup* = sequential
  wall time / parallel wall time (target on Gemma 3 270M: >= 3.5x). *mlx-lm batch* is
  the same ratio for mlx-lm's `generate_step` one by one vs its `batch_generate`, with
  the BLAS thread count the engine's decode settled on (see `mlx_nbengine._blas`).
- **(b) RAM**: four long prompts submitted together (``parallel=4``), in a fresh
  subprocess per mode. *extra RAM* = RSS once the engine is idle again minus RSS after
  load and a warm-up with one prompt of the same length. Modes: the disk store (records
  in the scratch file) vs the memory-only store (``disk_budget=0``: the same records
  kept in RAM, like an in-memory prompt cache).
  *saving* = 1 - extra(disk) / extra(memory) (target >= 85%); a negative extra (the
  allocator gave memory back) counts as 0.
- **(c) TTFT after an edit**: a prompt of ``--ttft-tokens`` tokens is run once, then
  again with its last 100 tokens changed. *warm* = TTFT of the edited prompt on that
  engine; *cold* = TTFT of a never-seen prompt of the same length on the same engine
  (warm and cold alternate, best of ``--repeats`` each); *mlx-lm LRU* = TTFT of
  the edited prompt with mlx-lm's own `LRUPromptCache` holding the original prompt's
  cache (prefill with `generate_step`, as mlx-lm's server does). *floor* = the prefill
  time of the tokens that cannot be restored (the computed blocks of the warm report)
  + restored bytes / the read bandwidth measured on the cache directory. Targets:
  cold/warm >= 7x and warm/floor <= 1.25x.

Models: the default model (Gemma 3 270M via ``load("default")``, float32; skipped with
``--skip-default``) and tiny random models from `mlx_nbengine.testing` (block size 32
for those, so their prompts span several blocks). Results: ``bench/results/engine.json``
and ``bench/results/engine.txt``; the table is printed too.

Run from the repository root: ``.venv/bin/python -m bench.bench_engine [--skip-default]``;
``--only a`` runs only part (a), ``--models gemma,llama`` only the models whose names
contain one of these words (a partial run prints its table and writes no results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import psutil  # noqa: E402

from bench.common import write_results  # noqa: E402
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


def mlx_lm_batching(lm, prompts: list[list[int]], *, max_tokens: int) -> dict:
    """The same chats through mlx-lm: `generate_step` one by one vs `batch_generate`."""
    from mlx_lm.generate import batch_generate, generate_step

    from mlx_nbengine._blas import blas_threads_for

    blas_threads_for(1)  # the engine's decode preference, so the comparison is like for like
    t = time.perf_counter()
    for p in prompts:
        for _ in generate_step(mx.array(p), lm.model, max_tokens=max_tokens):
            pass
    t_seq = time.perf_counter() - t
    t = time.perf_counter()
    batch_generate(lm.model, lm.tokenizer, prompts, max_tokens=max_tokens)
    t_batch = time.perf_counter() - t
    return {"sequential_s": t_seq, "batch_s": t_batch, "speedup": t_seq / t_batch}


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
        engine._io.drain()
        gc.collect()
        time.sleep(0.5)
        before = proc.memory_info().rss
        t = time.perf_counter()
        reqs = [engine.submit(text_prompt(lm, n_tokens, seed=i), max_tokens=8) for i in range(4)]
        for r in reqs:
            r.result()
        seconds = time.perf_counter() - t
        engine._io.drain()
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
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
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


def mlx_lm_lru_ttft(lm, original: list[int], edit: list[int]) -> dict:
    """TTFT of `edit` with mlx-lm's LRUPromptCache holding `original`'s cache."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    lru = LRUPromptCache()
    cache = make_prompt_cache(lm.model)
    for _ in generate_step(mx.array(original), lm.model, prompt_cache=cache, max_tokens=1):
        break
    lru.insert_cache("m", original, cache)
    t = time.perf_counter()
    cache, rest = lru.fetch_nearest_cache("m", edit)
    if cache is None:
        cache, rest = make_prompt_cache(lm.model), edit
    for token, _ in generate_step(mx.array(rest), lm.model, prompt_cache=cache, max_tokens=1):
        int(token)
        break
    ttft = time.perf_counter() - t
    del cache, lru
    gc.collect()
    mx.clear_cache()
    return {"ttft_s": ttft, "reused_tokens": len(edit) - len(rest)}


def bench_ttft(engine: Engine, *, n_tokens: int, repeats: int, scratch: str) -> dict:
    """Warm and cold TTFT of an edited prompt (module docstring), alternated, best of each.

    Cold runs use fresh prompts of the same length on the same engine: nothing of them
    is cached, and machine load changes hit warm and cold alike.
    """
    lm = engine.model
    original = text_prompt(lm, n_tokens, seed=1)
    edit = edited(lm, original, 100, seed=2)
    engine.submit(original, max_tokens=1).result()
    engine._io.drain()
    warm_runs, cold_runs = [], []
    for i in range(repeats):
        cold_runs.append(engine.submit(text_prompt(lm, n_tokens, seed=10 + i), max_tokens=1))
        cold_runs[-1] = cold_runs[-1].result().report
        engine._io.drain()
        warm_runs.append(engine.submit(edit, max_tokens=1).result().report)
    warm = min(warm_runs, key=lambda r: r.ttft_s)
    cold = min(cold_runs, key=lambda r: r.ttft_s)
    tail_s = sum(b.seconds for b in warm.blocks if b.source == "computed")
    bandwidth = read_bandwidth(scratch, warm.restored_bytes)
    floor = tail_s + warm.restored_bytes / bandwidth
    return {
        "prompt_tokens": len(edit),
        "warm_ttft_s": warm.ttft_s,
        "warm_source": warm.restore_source,
        "restored_tokens": warm.restored_tokens,
        "restored_bytes": warm.restored_bytes,
        "cold_ttft_s": cold.ttft_s,
        "tail_prefill_s": tail_s,
        "read_bandwidth_Bps": bandwidth,
        "floor_s": floor,
        "cold_over_warm": cold.ttft_s / warm.ttft_s,
        "warm_over_floor": warm.ttft_s / floor,
        "original": original,
        "edit": edit,
    }


# --- table -----------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    lines = []
    head = ["model", "(a) seq s", "par s", "speedup", "mlx-lm batch"]
    head += ["(b) extra MB disk", "memory", "saving"]
    head += ["(c) cold s", "warm s", "cold/warm", "floor s", "warm/floor", "mlx-lm LRU s"]
    head += ["LRU reused"]
    lines.append(" | ".join(head))
    lines.append(" | ".join("---" for _ in head))
    for r in rows:
        a, b, c = r.get("batching"), r.get("ram"), r.get("ttft")
        cells = [r["model"]]
        ref = r.get("mlx_lm_batching")
        if a:
            cells += [f"{a['sequential_s']:.2f}", f"{a['parallel_s']:.2f}", f"{a['speedup']:.2f}x"]
            cells.append(f"{ref['speedup']:.2f}x" if ref else "-")
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
            cells += [
                f"{c['cold_ttft_s']:.2f}",
                f"{c['warm_ttft_s']:.2f}",
                f"{c['cold_over_warm']:.1f}x",
                f"{c['floor_s']:.2f}",
                f"{c['warm_over_floor']:.2f}x",
                f"{c['lru_ttft_s']:.2f}",
                f"{c['lru_reused_tokens']}",
            ]
        else:
            cells += ["-"] * 7
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
            lm, row["batching"].pop("prompts"), max_tokens=args.chat_tokens
        )
    if "c" in args.only:
        ttft = row["ttft"]
        lru = mlx_lm_lru_ttft(lm, ttft.pop("original"), ttft.pop("edit"))
        ttft.update(
            lru_ttft_s=lru["ttft_s"],
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
    rss_tokens = args.rss_tokens if scale == 1 else 4096
    row["ram"] = bench_ram(model, n_tokens=rss_tokens, block_size=block_size)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-default", action="store_true", help="only the tiny models")
    ap.add_argument("--skip-tiny", action="store_true", help="only the default model")
    ap.add_argument("--chat-tokens", type=int, default=64, help="(a) max tokens per chat")
    ap.add_argument("--rss-tokens", type=int, default=1024, help="(b) tokens per long prompt")
    ap.add_argument("--ttft-tokens", type=int, default=2048, help="(c) prompt tokens")
    ap.add_argument("--repeats", type=int, default=3, help="(a), (c): best of this many")
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
    if args.rss_child:
        mode, model = args.rss_child
        print(json.dumps(rss_child(model, mode, args.rss_tokens, args.block_size)))
        return 0

    wanted = [w.strip().lower() for w in args.models.split(",")] if args.models else None

    def chosen(name: str) -> bool:
        return wanted is None or any(w in name.lower() for w in wanted)

    rows = []
    if not args.skip_default and chosen("Gemma 3 270M"):
        rows.append(bench_model("Gemma 3 270M", "default", args, block_size=256, scale=1))
    if not args.skip_tiny:
        from mlx_nbengine.testing import make_tiny_model

        with tempfile.TemporaryDirectory() as models:
            for name, (family, kw) in TINY.items():
                if not chosen(name):
                    continue
                path = str(make_tiny_model(family, Path(models) / family, **kw))
                # Block 32 and prompts / 8: the tiny models' prompts span blocks as Gemma's do.
                rows.append(bench_model(name, path, args, block_size=32, scale=8))
    settings = {
        "chat_tokens": args.chat_tokens,
        "rss_tokens": args.rss_tokens,
        "ttft_tokens": args.ttft_tokens,
        "repeats": args.repeats,
        "only": args.only,
    }
    if args.only != "abc" or wanted is not None:
        # A partial run must not overwrite the full table the README quotes.
        print(table(rows))
        print(json.dumps(rows, indent=1))
        return 0
    write_results("engine", {**settings, "rows": rows}, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

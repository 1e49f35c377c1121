"""Restore vs prefill, per 256-token block: is restoring a block much cheaper than computing it?

For each model, a prompt of ``--blocks`` whole blocks plus a short tail is
prefilled block by block (one model call per block), and every completed
block's records are extracted and stored in a `BlockStore` backed by a scratch
file. Then the prompt is restored from the store and the time splits into its
shares:

- *get*: reading the blobs out of the scratch file (`BlockStore.get`),
- *decode*: safetensors bytes -> evaluated MLX arrays (`record_from_bytes`),
- *assemble*: building the live cache (`PrefixCache.assemble`, evaluated).

*restore/block* is their sum over the restored blocks divided by the number of
blocks (best of ``--repeats``). *prefill/block* is what the engine itself takes to
compute a block: `Engine.load(model).submit(prompt, max_tokens=1)` on never-seen
prompts of the same shape, each whole block's `BlockReport.seconds` (the engine's
own steps, up to 1,024 tokens a call, one block on models with recurrent layers; its
BLAS thread choice per step, `mlx_nbengine._blas`), after ``--warmup`` untimed
prompts (first-call allocations, the thread tuner's first tries), median of
``--repeats`` prompts. *ratio* is restore/prefill (target on Gemma 3 270M: at most
5 %). *engine restore/block* is the engine's own disk restore of such a prompt (its
report's restored blocks, the hot cache dropped first: plan, read, assembly on the
cache-I/O thread), median of ``--repeats``. *bytes/block* is what the store holds per
block, all record kinds together. *get MB/s* is blob bytes read per second of get
time. The check column says whether the restored cache's next logits equal a fresh
prefill's bit for bit.

Models: the default model (Gemma 3 270M, ``load("default")``, float32; skipped with a
message when it cannot be loaded; ``--model M`` measures M in its place) and the tiny
random families of `mlx_nbengine.testing`. Results: ``bench/results/restore.json`` and
``bench/results/restore.txt``; the table is printed too.

Run from the repository root:
``.venv/bin/python -m bench.bench_restore [--blocks 4] [--repeats 3] [--skip-default]``;
``--quick`` (a smoke test, seconds): one tiny model (``--model DIR``, else a tiny llama),
two blocks, writing only ``--json PATH``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported, as the engine does

import mlx.core as mx  # noqa: E402

from bench.common import add_run_args, write_results  # noqa: E402
from mlx_nbengine import Engine  # noqa: E402
from mlx_nbengine.cache import (  # noqa: E402
    PrefixCache,
    extract_block_records,
    prefill_steps,
    record_from_bytes,
)
from mlx_nbengine.cache.store import BlockStore  # noqa: E402

B = 256
TINY = {
    "tiny llama": ("llama", {}),
    "tiny gemma3_text w64": ("gemma3_text", {"sliding_window": 64}),
    "tiny gemma3_text w512": ("gemma3_text", {"sliding_window": 512}),
    "tiny qwen3_5": ("qwen3_5", {}),
}


def prefill(model, cache, tokens, start, *, on_step=None):
    """Block-aligned prefill, one block a call (so every block's records can be taken
    right after its step); returns the last logits. `on_step(start, end)`. It fills the
    store and gives the check its reference, untimed: the timed prefill is the engine's."""
    logits = None
    for s, e in prefill_steps(start, len(tokens), block_size=B, max_step=B):
        logits = model(mx.array(tokens[s:e])[None], cache=cache)
        mx.eval([c.state for c in cache])
        if on_step is not None:
            on_step(s, e)
    mx.eval(logits)
    return logits


def random_prompt(vocab: int, n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, min(vocab, 32000)) for _ in range(n_tokens)]


def engine_prefill(
    model: str,
    *,
    dtype: str | None,
    vocab: int,
    blocks: int,
    warmup: int,
    repeats: int,
    scratch: Path,
) -> dict:
    """Per-block prefill and disk-restore seconds of the engine itself (module docstring)."""
    n_tokens = blocks * B + 17
    engine = Engine.load(model, block_size=B, dtype=dtype, cache_dir=scratch)
    with engine:
        for i in range(warmup):
            engine.submit(random_prompt(vocab, n_tokens, 100 + i), max_tokens=1).result()
            engine.wait_for_saves()
        prefill, reports = [], []
        for i in range(repeats):
            report = engine.submit(random_prompt(vocab, n_tokens, 200 + i), max_tokens=1)
            report = report.result().report
            engine.wait_for_saves()
            whole = [b for b in report.blocks if b.end - b.start == B]
            assert all(b.source == "computed" for b in whole), "a never-seen prompt restored"
            prefill.append(sum(b.seconds for b in whole) / len(whole))
            reports.append(report)
        restore = []
        for i in range(repeats):
            engine.drop_hot_cache()  # from the store, not memory
            report = engine.submit(random_prompt(vocab, n_tokens, 200 + i), max_tokens=1)
            report = report.result().report
            engine.wait_for_saves()
            disk = [b for b in report.blocks if b.source == "disk" and b.end - b.start == B]
            restore.append(sum(b.seconds for b in disk) / len(disk) if disk else float("nan"))
    return {
        "prefill_s_per_block": statistics.median(prefill),
        "prefill_s_per_block_each": prefill,
        "restore_s_per_block": statistics.median(restore),
        "restore_s_per_block_each": restore,
        "ttft_s_each": [r.ttft_s for r in reports],
    }


def bench_model(
    name: str,
    model: str,
    *,
    dtype: str | None,
    blocks: int,
    warmup: int,
    repeats: int,
    scratch: Path,
) -> dict:
    from mlx_nbengine.models import load

    lm = load(model, dtype=dtype)  # on this thread, for the cache layer's own timings
    vocab = int(lm.config.get("vocab_size") or lm.config.get("text_config", {})["vocab_size"])
    tokens = random_prompt(vocab, blocks * B + 17, 0)
    with BlockStore(budget_bytes=1 << 34, directory=scratch) as store:
        cache = lm.make_cache()
        pc = PrefixCache.for_cache(cache, fingerprint=lm.fingerprint, store=store, block_size=B)
        keys = pc.keys(tokens)
        save_times = []

        def on_step(s, e):
            if e % B:
                return
            t = time.perf_counter()
            block = e // B - 1
            pc.save(keys[block], extract_block_records(cache, block=block, block_size=B))
            save_times.append(time.perf_counter() - t)

        prefill(lm.model, cache, tokens, 0, on_step=on_step)
        pc.touch(keys)
        bytes_held = store.stats().bytes_held
        kinds_bytes: dict[str, int] = {}
        for key in keys:
            for kind in pc.kinds:
                data = store.get(key, kind)
                if data is not None:
                    kinds_bytes[kind] = kinds_bytes.get(kind, 0) + len(data)

        best = None
        for _ in range(repeats):
            plan = pc.plan(tokens)
            get_s = decode_s = 0.0
            nbytes = 0
            by_block: dict[int, dict] = {}
            for key, kind in plan.needed:
                t = time.perf_counter()
                data = store.get(key, kind)
                get_s += time.perf_counter() - t
                nbytes += len(data)
                t = time.perf_counter()
                rec = record_from_bytes(data)
                decode_s += time.perf_counter() - t
                by_block.setdefault(rec.block, {})[kind] = rec
            t = time.perf_counter()
            restored = pc.assemble(by_block, n_blocks=plan.n_blocks, template_cache=lm.make_cache())
            mx.eval([c.state for c in restored])
            assemble_s = time.perf_counter() - t
            total = get_s + decode_s + assemble_s
            if best is None or total < best["total_s"]:
                best = {
                    "total_s": total,
                    "get_s": get_s,
                    "decode_s": decode_s,
                    "assemble_s": assemble_s,
                    "bytes_read": nbytes,
                    "n_blocks": plan.n_blocks,
                    "cache": restored,
                }

        # Correctness: the restored cache continues exactly like a fresh one.
        tail_restored = prefill(lm.model, best.pop("cache"), tokens, best["n_blocks"] * B)
        tail_fresh = prefill(lm.model, lm.make_cache(), tokens, 0)
        identical = bool(mx.array_equal(tail_restored, tail_fresh).item())

    n = best["n_blocks"]
    layer_kinds = {k: pc.layer_kinds.count(k) for k in pc.kinds}
    model_type = lm.model_type
    lm = cache = pc = None  # the engine loads its own copy
    engine = engine_prefill(
        model,
        dtype=dtype,
        vocab=vocab,
        blocks=blocks,
        warmup=warmup,
        repeats=repeats,
        scratch=scratch,
    )
    prefill_per_block = engine["prefill_s_per_block"]
    restore_per_block = best["total_s"] / n
    return {
        "model": name,
        "model_type": model_type,
        "layer_kinds": layer_kinds,
        "blocks": n,
        "prefill_s_per_block": prefill_per_block,
        "prefill_s_per_block_each": engine["prefill_s_per_block_each"],
        "prefill_ttft_s_each": engine["ttft_s_each"],
        "save_s_per_block": sum(save_times) / len(save_times),
        "restore_s_per_block": restore_per_block,
        "get_s_per_block": best["get_s"] / n,
        "decode_s_per_block": best["decode_s"] / n,
        "assemble_s_per_block": best["assemble_s"] / n,
        "ratio": restore_per_block / prefill_per_block,
        "engine_restore_s_per_block": engine["restore_s_per_block"],
        "engine_restore_s_per_block_each": engine["restore_s_per_block_each"],
        "engine_ratio": engine["restore_s_per_block"] / prefill_per_block,
        "bytes_per_block": bytes_held / len(keys),
        "bytes_per_block_by_kind": {k: v / len(keys) for k, v in kinds_bytes.items()},
        "bytes_read_per_restore": best["bytes_read"],
        "get_mb_per_s": best["bytes_read"] / best["get_s"] / 1e6 if best["get_s"] else None,
        "identical": identical,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}ms"


def table(rows: list[dict]) -> str:
    head = (
        f"{'model':<24} {'prefill/blk':>11} {'restore/blk':>11} {'get':>8} {'decode':>8} "
        f"{'assemble':>8} {'ratio':>7} {'engine restore/blk':>18} {'ratio':>7} "
        f"{'bytes/blk':>10} {'get MB/s':>9} {'check':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<24} {_ms(r['prefill_s_per_block']):>11} "
            f"{_ms(r['restore_s_per_block']):>11} {_ms(r['get_s_per_block']):>8} "
            f"{_ms(r['decode_s_per_block']):>8} {_ms(r['assemble_s_per_block']):>8} "
            f"{r['ratio'] * 100:>6.2f}% {_ms(r['engine_restore_s_per_block']):>18} "
            f"{r['engine_ratio'] * 100:>6.2f}% {r['bytes_per_block'] / 1024:>8.0f}KiB "
            f"{(r['get_mb_per_s'] or 0):>9.0f} {'identical' if r['identical'] else 'DIFFERS':>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(parser)
    parser.add_argument("--blocks", type=int, default=None, help="whole blocks in the prompt (4)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="restores timed (the best counts), engine "
        "prefills and restores timed (the median counts) (3)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed engine prompts (3)")
    parser.add_argument("--skip-default", action="store_true", help="only the tiny models")
    parser.add_argument("--scratch", default=None, help="folder for the scratch file")
    args = parser.parse_args(argv)
    sizes = {"blocks": 2, "repeats": 1, "warmup": 1} if args.quick else {}
    for key, value in ({"blocks": 4, "repeats": 3, "warmup": 3} | sizes).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    from mlx_nbengine.testing import make_tiny_model

    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(args.scratch) if args.scratch else Path(tmp)
        run = dict(blocks=args.blocks, warmup=args.warmup, repeats=args.repeats, scratch=scratch)
        if args.quick:
            if args.model:
                model, name = args.model, f"quick: {Path(args.model).name}"
            else:
                model, name = (
                    str(make_tiny_model("llama", Path(tmp) / "llama")),
                    "quick: tiny llama",
                )
            rows.append(bench_model(name, model, dtype=None, **run))
        elif not args.skip_default:
            name = Path(args.model).name if args.model else "Gemma 3 270M (default)"
            try:
                rows.append(bench_model(name, args.model or "default", dtype="float32", **run))
            except Exception as e:  # any failure: the bench still runs the tiny models
                notes.append(f"{name} skipped: could not load it ({e})")
        if not args.quick:
            for name, (family, kwargs) in TINY.items():
                model = str(make_tiny_model(family, Path(tmp) / name.replace(" ", "-"), **kwargs))
                rows.append(bench_model(name, model, dtype=None, **run))

    text = "\n".join(
        [
            *notes,
            table(rows),
            f"block {B} tokens, {mx.default_device()}; prefill: the engine's "
            f"own steps, median of {args.repeats} after {args.warmup} warm-up prompts",
        ]
    )
    meta = {
        "block_size": B,
        "default_dtype": "float32",
        "blocks": args.blocks,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "device": str(mx.default_device()),
        "notes": notes,
        "quick": args.quick,
    }
    write_results("restore", {**meta, "rows": rows}, text, json_path=args.json, quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())

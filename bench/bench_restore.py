"""Restore vs prefill, per 256-token block: is restoring a block much cheaper than computing it?

For each model, a prompt of ``--blocks`` whole blocks plus a short tail is
prefilled block by block (one model call per block, float32), and every
completed block's records are extracted and stored in a `BlockStore` backed by
a scratch file. Then the prompt is restored from the store and the time splits
into its shares:

- *get*: reading the blobs out of the scratch file (`BlockStore.get`),
- *decode*: safetensors bytes -> evaluated MLX arrays (`record_from_bytes`),
- *assemble*: building the live cache (`PrefixCache.assemble`, evaluated).

*restore/block* is their sum over the restored blocks divided by the number of
blocks; *prefill/block* is the mean model-call time of the prefill steps;
*ratio* is restore/prefill (target on Gemma 3 270M: at most 5 %). *bytes/block*
is what the store holds per block, all record kinds together. *get MB/s* is
blob bytes read per second of get time. The check column says whether the
restored cache's next logits equal a fresh prefill's bit for bit.

Models: the default model (Gemma 3 270M, ``load("default")``; skipped with a
message when it cannot be loaded) and the tiny random families of
`mlx_nbengine.testing`. Results: ``bench/results/restore.json`` and
``bench/results/restore.txt``; the table is printed too.

Run from the repository root:
``.venv/bin/python -m bench.bench_restore [--blocks 4] [--repeats 3] [--skip-default]``
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported: the prefill baseline should use a fast BLAS

import mlx.core as mx  # noqa: E402

from mlx_nbengine.cache import (  # noqa: E402
    PrefixCache,
    extract_block_records,
    prefill_steps,
    record_from_bytes,
)
from mlx_nbengine.cache.store import BlockStore  # noqa: E402

B = 256
RESULTS = Path(__file__).resolve().parent / "results"
TINY = {
    "tiny llama": ("llama", {}),
    "tiny gemma3_text w64": ("gemma3_text", {"sliding_window": 64}),
    "tiny gemma3_text w512": ("gemma3_text", {"sliding_window": 512}),
    "tiny qwen3_5": ("qwen3_5", {}),
}


def prefill(model, cache, tokens, start, *, on_step=None):
    """Block-aligned prefill; returns the last logits. `on_step(start, end, seconds)`.

    Like mlx-lm's own prefill, a step evaluates only the cache, so the lazy graph
    skips the vocabulary projection of positions whose logits nobody reads.
    """
    logits = None
    for s, e in prefill_steps(start, len(tokens), block_size=B, max_step=B):
        t = time.perf_counter()
        logits = model(mx.array(tokens[s:e])[None], cache=cache)
        mx.eval([c.state for c in cache])
        if on_step is not None:
            on_step(s, e, time.perf_counter() - t)
    mx.eval(logits)
    return logits


def bench_model(name: str, lm, *, blocks: int, repeats: int, scratch: Path) -> dict:
    rng = random.Random(0)
    vocab = int(lm.config.get("vocab_size") or lm.config.get("text_config", {})["vocab_size"])
    tokens = [rng.randrange(10, min(vocab, 32000)) for _ in range(blocks * B + 17)]
    with BlockStore(budget_bytes=1 << 34, directory=scratch) as store:
        cache = lm.make_cache()
        pc = PrefixCache.for_cache(cache, fingerprint=lm.fingerprint, store=store, block_size=B)
        keys = pc.keys(tokens)
        prefill_times, save_times = [], []

        def on_step(s, e, seconds):
            if e % B:
                return
            prefill_times.append(seconds)
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
    prefill_per_block = sum(prefill_times) / len(prefill_times)
    restore_per_block = best["total_s"] / n
    return {
        "model": name,
        "model_type": lm.model_type,
        "layer_kinds": {k: pc.layer_kinds.count(k) for k in pc.kinds},
        "blocks": n,
        "prefill_s_per_block": prefill_per_block,
        "prefill_s_per_block_each": prefill_times,
        "save_s_per_block": sum(save_times) / len(save_times),
        "restore_s_per_block": restore_per_block,
        "get_s_per_block": best["get_s"] / n,
        "decode_s_per_block": best["decode_s"] / n,
        "assemble_s_per_block": best["assemble_s"] / n,
        "ratio": restore_per_block / prefill_per_block,
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
        f"{'assemble':>8} {'ratio':>7} {'bytes/blk':>10} {'get MB/s':>9} {'check':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['model']:<24} {_ms(r['prefill_s_per_block']):>11} "
            f"{_ms(r['restore_s_per_block']):>11} {_ms(r['get_s_per_block']):>8} "
            f"{_ms(r['decode_s_per_block']):>8} {_ms(r['assemble_s_per_block']):>8} "
            f"{r['ratio'] * 100:>6.2f}% {r['bytes_per_block'] / 1024:>8.0f}KiB "
            f"{(r['get_mb_per_s'] or 0):>9.0f} {'identical' if r['identical'] else 'DIFFERS':>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=4, help="whole blocks in the prompt")
    parser.add_argument("--repeats", type=int, default=3, help="restores timed; the best counts")
    parser.add_argument("--skip-default", action="store_true", help="only the tiny models")
    parser.add_argument("--scratch", default=None, help="folder for the scratch file")
    args = parser.parse_args(argv)

    from mlx_nbengine.models import load
    from mlx_nbengine.testing import make_tiny_model

    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(args.scratch) if args.scratch else Path(tmp)
        if not args.skip_default:
            try:
                lm = load("default", dtype="float32")
            except Exception as e:  # any failure: the bench still runs the tiny models
                notes.append(f"default model skipped: could not load it ({e})")
            else:
                rows.append(
                    bench_model(
                        "Gemma 3 270M (default)",
                        lm,
                        blocks=args.blocks,
                        repeats=args.repeats,
                        scratch=scratch,
                    )
                )
                del lm
        for name, (family, kwargs) in TINY.items():
            lm = load(make_tiny_model(family, Path(tmp) / name.replace(" ", "-"), **kwargs))
            rows.append(
                bench_model(name, lm, blocks=args.blocks, repeats=args.repeats, scratch=scratch)
            )

    text = table(rows)
    meta = {
        "block_size": B,
        "dtype": "float32",
        "blocks": args.blocks,
        "device": str(mx.default_device()),
        "machine": platform.platform(),
        "notes": notes,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "restore.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    (RESULTS / "restore.txt").write_text(
        "\n".join([*notes, text, f"block {B} tokens, float32, {meta['device']}"]) + "\n"
    )
    for note in notes:
        print(note)
    print(text)
    print(f"\nwritten: {RESULTS / 'restore.json'} and restore.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

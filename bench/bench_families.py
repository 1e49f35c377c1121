"""The hybrid family at speed: Qwen 3.5-shaped models against their dense twins, through
`Engine`, in one run.

Models (random weights in the published shapes, `testing.make_shaped_model`, MLX-quantized
at 8 bits, groups of 64; speed does not depend on the weights' values), written once into
the cache home (``bench-models/``):

- *hybrid*: ``--shapes`` (default ``qwen3_5-0.8b`` and ``qwen3_5-2b``), three gated-delta
  layers then a full-attention layer, on our kernels (`models.deltaroute`);
- *library*: the same hybrid with the route suspended, so its linear attention runs mlx-lm's
  ``gated_delta_ops`` loop, MLX's grouped convolution and silu (cold prefill at the first
  length only: it is slow);
- *dense twin*: a qwen3 model of the same width, depth, MLP and attention heads, every
  layer full attention.

Measured per model, on the CPUs this process may use (the engine's thread policy; the
threads are in the JSON):

- *cold prefill* tok/s of ``--lengths`` tokens (default 1,024 and 4,096): an empty store, the
  time to the first token (the engine's own steps: up to 1,024 tokens, the hybrid's states
  at the block boundaries inside a step taken by its layers; the library variant steps one
  block at a time, as a recurrent model off our kernels does);
- *decode* tok/s of ``--decode`` tokens after a 64-token prompt, 1 row; and 4 rows at once
  (four prompts submitted together, their tokens over the wall time);
- *edited re-run*: a prompt of the first length, then the same prompt with one token changed
  at 90%, its whole ``--answer``-token answer in seconds (restored from the block store).

Run from the repository root: ``.venv/bin/python -m bench.bench_families``. Writes
``bench/results/families.json`` and ``.txt``; ``--quick``: the tiny hybrid and a tiny qwen3
twin, small sizes, writing only ``--json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import add_run_args, cpu_name, fill_sizes, usable_cpus, write_results

SIZES = {"lengths": "1024,4096", "decode": 64, "answer": 128, "shapes": "qwen3_5-0.8b,qwen3_5-2b"}
QUICK = {"lengths": "300", "decode": 8, "answer": 8, "shapes": "tiny"}


def model_dirs(shape: str, scratch: Path) -> dict[str, Path]:
    """The hybrid and its dense twin of `shape` (made once, in the cache home; the tiny ones
    in `scratch`)."""
    from mlx_nbengine.home import home
    from mlx_nbengine.testing import make_shaped_model, make_tiny_model

    if shape == "tiny":
        return {
            "hybrid": make_tiny_model("qwen3_5", scratch / "hybrid"),
            "dense twin": make_tiny_model("qwen3", scratch / "dense", num_layers=4),
        }
    out = {}
    for name, dense in (("hybrid", False), ("dense twin", True)):
        path = home() / "bench-models" / f"{shape}-q8g64{'-dense' if dense else ''}"
        if not (path / "config.json").is_file():
            print(f"writing {path.name} (random weights, once)...", flush=True)
            make_shaped_model(shape, path.with_suffix(".part"), dense=dense)
            path.with_suffix(".part").rename(path)
        out[name] = path
    return out


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [2, *(5 + (i * 7 + seed * 13) % 400 for i in range(n - 1))]


def cold_prefill(engine, n: int) -> float:
    engine.clear_cache()
    done = engine.submit(prompt_of(n), max_tokens=1).result(timeout=7200)
    return n / done.report.ttft_s


def decode_rates(engine, n: int) -> dict:
    done_at = time.perf_counter()
    done = engine.submit(prompt_of(64, 1), max_tokens=n, temperature=0.0).result(timeout=3600)
    whole = time.perf_counter() - done_at
    one = (len(done.tokens) - 1) / (whole - done.report.ttft_s)
    started = time.perf_counter()
    handles = [engine.submit(prompt_of(64, 2 + i), max_tokens=n) for i in range(4)]
    tokens = sum(len(h.result(timeout=3600).tokens) for h in handles)
    return {"decode_1_tok_s": one, "decode_4_tok_s": tokens / (time.perf_counter() - started)}


def edited_rerun(engine, n: int, answer: int) -> float:
    prompt = prompt_of(n, 3)
    engine.submit(prompt, max_tokens=1).result(timeout=7200)
    at = int(n * 0.9)
    edited = [*prompt[:at], 9 if prompt[at] != 9 else 10, *prompt[at + 1 :]]
    started = time.perf_counter()
    engine.submit(edited, max_tokens=answer, temperature=0.0).result(timeout=3600)
    return time.perf_counter() - started


def measure(path: Path, lengths: list[int], args, *, library: bool) -> dict:
    from mlx_nbengine.engine import Engine
    from mlx_nbengine.models import deltaroute, qroute

    out: dict = {}
    with tempfile.TemporaryDirectory() as cache, Engine.load(str(path), cache_dir=cache) as engine:
        out["routes"] = list(engine.model.routing.names())
        if library:
            with engine.model.routing.suspended(deltaroute.DELTA, *qroute.SWIGLU_MLPS):
                return {**out, "prefill_tok_s": {str(lengths[0]): cold_prefill(engine, lengths[0])}}
        out["prefill_tok_s"] = {str(n): cold_prefill(engine, n) for n in lengths}
        out.update(decode_rates(engine, args.decode))
        out["edited_rerun_s"] = edited_rerun(engine, lengths[0], args.answer)
    return out


def table(results: dict, lengths: list[int]) -> str:
    head = [f"prefill {n}" for n in lengths] + ["decode 1", "decode 4", "edited re-run"]
    lines = [
        f"Qwen 3.5-shaped hybrids against their dense twins, through Engine ({cpu_name()}, "
        f"{usable_cpus()} CPUs; tok/s, the re-run in s)",
        "",
        "| model | variant | " + " | ".join(head) + " |",
        "|---|---|" + "---:|" * len(head),
    ]
    for shape, variants in results.items():
        for name, got in variants.items():
            cells = [got["prefill_tok_s"].get(str(n)) for n in lengths]
            cells += [
                got.get("decode_1_tok_s"),
                got.get("decode_4_tok_s"),
                got.get("edited_rerun_s"),
            ]
            text = ["" if c is None else f"{c:.1f}" if c >= 10 else f"{c:.2f}" for c in cells]
            lines.append(f"| {shape} | {name} | " + " | ".join(text) + " |")
        hybrid, twin = variants["hybrid"], variants["dense twin"]
        ratios = [hybrid["prefill_tok_s"][str(n)] / twin["prefill_tok_s"][str(n)] for n in lengths]
        ratios += [hybrid[k] / twin[k] for k in ("decode_1_tok_s", "decode_4_tok_s")]
        ratios.append(twin["edited_rerun_s"] / hybrid["edited_rerun_s"])
        lines.append(
            f"| {shape} | hybrid / twin | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import mlx_nbengine  # noqa: F401 - binds the fast BLAS before MLX loads

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, model=None)
    ap.add_argument("--shapes", default=None, help="comma-separated (qwen3_5-0.8b,qwen3_5-2b)")
    ap.add_argument("--lengths", default=None, help="cold prefill lengths (1024,4096)")
    ap.add_argument("--decode", type=int, default=None, help="decode tokens (64)")
    ap.add_argument("--answer", type=int, default=None, help="the edited re-run's answer (128)")
    ap.add_argument("--no-library", action="store_true", help="skip the library variant")
    args = ap.parse_args(argv)
    fill_sizes(args, SIZES, QUICK)
    lengths = [int(n) for n in args.lengths.split(",")]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-families-") as scratch:
        for shape in args.shapes.split(","):
            paths = model_dirs(shape, Path(scratch))
            variants = {"hybrid": measure(paths["hybrid"], lengths, args, library=False)}
            if not args.no_library:
                variants["library"] = measure(paths["hybrid"], lengths, args, library=True)
            variants["dense twin"] = measure(paths["dense twin"], lengths, args, library=False)
            results[shape] = variants
            print(f"{shape}: {variants}", flush=True)
    data = {
        "sizes": {k: getattr(args, k) for k in SIZES},
        "threads": usable_cpus(),
        "results": results,
    }
    write_results("families", data, table(results, lengths), json_path=args.json, quick=args.quick)


if __name__ == "__main__":
    main()

"""The two families the reference engine leads with, at speed: Qwen 3.5-shaped hybrids
against their dense twins, and a Gemma 4 E2B-shaped model, through `Engine`, against
llama.cpp on the same weights, in one run.

Models (random weights in the published shapes, `testing.make_shaped_model`, MLX-quantized
at 8 bits, groups of 64; speed does not depend on the weights' values), written once into
the cache home (``bench-models/``):

- *ours*: ``--shapes`` (default ``qwen3_5-0.8b``, ``qwen3_5-2b`` and ``gemma4-e2b``) on our
  routes: a hybrid's three gated-delta layers then a full-attention layer on our kernels
  (`models.deltaroute`); Gemma 4's 35 layers, four sliding to one full, the last 20 reading
  earlier layers' keys and values, with per-layer inputs;
- *library*: the same model with our routes suspended (a hybrid's linear attention then runs
  mlx-lm's ``gated_delta_ops`` loop, MLX's grouped convolution and silu; Gemma 4 runs
  mlx-lm's code throughout), cold prefill at the first length only: it is slow;
- *vision checkpoint* (hybrids only): the hybrid as Qwen publishes the family, with a vision
  tower (a tiny one here), so it loads through mlx-vlm, whose own gated-delta layer our route
  takes too (`deltaroute.DELTA_VLM`); *vision checkpoint, mlx-vlm's* is it with the routes
  suspended (mlx-vlm's chunked scan for prefill, its per-token loop for decode), at the first
  length only;
- *dense twin* (hybrids only): a qwen3 model of the same width, depth, MLP and attention
  heads, every layer full attention;
- *llama.cpp*: llama-cpp-python's ``Llama`` on the model's GGUF (the same weights, written as
  llama.cpp's converter writes them, 2-D matrices as Q8_0: `testing.make_shaped_gguf`), its
  prompt cache on (``LlamaRAMCache``), on the same thread count; skipped, and said so, where
  ``llama_cpp`` is not installed (the ``peers`` extra). It decodes one sequence at a time,
  so it has no 4-row figure.

Measured per model, on the CPUs this process may use (the engine's thread policy; the
threads are in the JSON):

- *cold prefill* tok/s of ``--lengths`` tokens (default 1,024 and 4,096): an empty store, the
  time to the first token, the better of two prompts after one warm-up prompt (the
  engine's own steps: up to 1,024 tokens, a hybrid's states
  at the block boundaries inside a step taken by its layers; a hybrid's library variant
  steps one block at a time, as a recurrent model off our kernels does);
- *decode* tok/s of ``--decode`` tokens after a 64-token prompt, 1 row (after a 16-token
  answer that lets the engine choose its decode thread count); and 4 rows at once (four
  prompts submitted together, their tokens over the wall time);
- *edited re-run*: a prompt of the first length, then the same prompt with one token changed
  at 90%, its whole ``--answer``-token answer in seconds (restored from the block store).

Beside a hybrid's ratios to its twin, the row *twin's work / ours* gives the ratios that
equal speed per weight would give, from the files alone (`work_of`): the twin's multiply-adds
a token over the hybrid's for prefill (the twin's wider attention scores left out), its
bytes a decode step reads over the hybrid's for decode. The twin of the same width and depth
does less: a gated-delta layer's products are twice its attention's.

Run from the repository root: ``.venv/bin/python -m bench.bench_families``. Writes
``bench/results/families.json`` (after each shape, so a later shape's failure keeps the
earlier ones) and ``.txt``; ``--quick``: the tiny hybrid with a tiny
qwen3 twin, and a tiny gemma4_text, small sizes, writing only ``--json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import (
    add_run_args,
    cpu_name,
    fill_sizes,
    results_path,
    usable_cpus,
    write_json,
    write_results,
)

SIZES = {
    "lengths": "1024,4096",
    "decode": 64,
    "answer": 128,
    "shapes": "qwen3_5-0.8b,qwen3_5-2b,gemma4-e2b",
}
QUICK = {"lengths": "300", "decode": 8, "answer": 8, "shapes": "tiny,tiny-gemma4"}


def is_gemma4(shape: str) -> bool:
    return "gemma4" in shape


def model_dirs(shape: str, scratch: Path) -> dict[str, Path]:
    """The model of `shape` and a hybrid's dense twin (made once, in the cache home; the tiny
    ones in `scratch`)."""
    from mlx_nbengine.home import home
    from mlx_nbengine.testing import make_shaped_model, make_tiny_model

    if shape == "tiny":
        return {
            "ours": make_tiny_model("qwen3_5", scratch / "hybrid"),
            "vision checkpoint": make_tiny_model("qwen3_5_vl", scratch / "hybrid-vl"),
            "dense twin": make_tiny_model("qwen3", scratch / "dense", num_layers=4),
        }
    if shape == "tiny-gemma4":
        return {"ours": make_tiny_model("gemma4_text", scratch / "gemma4", sliding_window=128)}
    out = {}
    kinds = (
        (("ours", "", {}),)
        if is_gemma4(shape)
        else (
            ("ours", "", {}),
            ("vision checkpoint", "-vl", {"vision": True}),
            ("dense twin", "-dense", {"dense": True}),
        )
    )
    for name, suffix, options in kinds:
        path = home() / "bench-models" / f"{shape}-q8g64{suffix}"
        if not (path / "config.json").is_file():
            print(f"writing {path.name} (random weights, once)...", flush=True)
            part = path.parent / f"{path.name}.part"  # not with_suffix: "0.8b" has a dot
            make_shaped_model(shape, part, **options)
            part.rename(path)
        out[name] = path
    return out


def gguf_beside(path: Path) -> Path:
    """A shaped model's GGUF, beside its directory."""
    return path.parent / f"{path.name}.gguf"  # not with_suffix: "qwen3_5-0.8b-..." has a dot


def gguf_of(shape: str, path: Path, scratch: Path) -> Path:
    """The model's GGUF (made once beside it; the tiny ones in `scratch`)."""
    from mlx_nbengine.testing import make_shaped_gguf, make_tiny_gguf

    if shape == "tiny":
        return make_tiny_gguf("qwen3_5", scratch / "hybrid.gguf", source=path)
    if shape == "tiny-gemma4":
        return make_tiny_gguf("gemma4_text", scratch / "gemma4.gguf", source=path)
    out = gguf_beside(path)
    if not out.is_file():
        print(f"writing {out.name} (once)...", flush=True)
        part = path.parent / f"{path.name}.gguf.part"
        make_shaped_gguf(path, part)
        part.rename(out)
    return out


def gguf_apart(shape: str, path: Path, scratch: Path) -> Path:
    """`gguf_of`, first written in a child process: the write holds the source model and the
    GGUF in memory together (E4B: about 16 GB), which beside an engine's model would not fit
    a 24 GB machine, and a child gives all of it back when it ends."""
    import multiprocessing

    if shape.startswith("tiny") or gguf_beside(path).is_file():
        return gguf_of(shape, path, scratch)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(gguf_of, (shape, path, scratch))


def llama_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[peers]')"
    return None


def measure_llama(gguf: Path, lengths: list[int], args) -> dict:
    """The same figures from llama.cpp on `gguf` (no 4-row decode: one sequence a call)."""
    from bench.common import open_llama

    llm = open_llama(gguf, threads=usable_cpus(), n_ctx=max(lengths) + args.answer + 64, cache=True)

    def timed(tokens: list[int], n: int) -> tuple[float, float]:
        started = time.perf_counter()
        first = None
        for _ in llm.create_completion(list(tokens), max_tokens=n, temperature=0.0, stream=True):
            if first is None:
                first = time.perf_counter() - started
        return first, time.perf_counter() - started

    out: dict = {"prefill_tok_s": {}}
    timed(prompt_of(lengths[0], 99), 4)  # the same warm-up as ours
    for n in lengths:
        # Other prompts per length: llama.cpp's prompt cache would restore a shared prefix.
        firsts = [timed(prompt_of(n, 2 * n + seed), 1)[0] for seed in (0, 1)]
        out["prefill_tok_s"][str(n)] = n / min(firsts)
    first, whole = timed(prompt_of(64, 1), args.decode)
    out["decode_1_tok_s"] = (args.decode - 1) / (whole - first)
    prompt = prompt_of(lengths[0], 3)
    timed(prompt, 1)
    at = int(lengths[0] * 0.9)
    edited = [*prompt[:at], 9 if prompt[at] != 9 else 10, *prompt[at + 1 :]]
    out["edited_rerun_s"] = timed(edited, args.answer)[1]
    close = getattr(llm, "close", None)
    if close is not None:
        close()
    return out


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return [2, *(5 + (i * 7 + seed * 13) % 400 for i in range(n - 1))]


def cold_prefill(engine, n: int) -> float:
    """The better of two cold prefills of `n` tokens (other prompts, an emptied store)."""
    rates = []
    for seed in (0, 1):
        engine.clear_cache()
        prompt = prompt_of(n, 2 * n + seed)  # no two lengths share a prefix
        done = engine.submit(prompt, max_tokens=1).result(timeout=7200)
        rates.append(n / done.report.ttft_s)
    return max(rates)


def warm_up(engine, n: int) -> None:
    """One prompt first: the engine's first steps tune its thread counts (and the first
    calls fill MLX's caches), which would land on the first measured prompt."""
    engine.submit(prompt_of(n, 99), max_tokens=4).result(timeout=7200)
    engine.clear_cache()


def decode_rates(engine, n: int) -> dict:
    # A short answer first: the engine's first decode steps choose their thread count, which
    # would land on the measured one (a long answer is decoded at the chosen count).
    engine.submit(prompt_of(64, 7), max_tokens=16, temperature=0.0).result(timeout=3600)
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

    out: dict = {} if library else {"work": work_of(path)}
    with tempfile.TemporaryDirectory() as cache, Engine.load(str(path), cache_dir=cache) as engine:
        out["routes"] = list(engine.model.routing.names())
        warm_up(engine, lengths[0])
        if library:
            routes = (
                ()
                if is_gemma4(str(path))
                else (deltaroute.DELTA, deltaroute.DELTA_VLM, *qroute.SWIGLU_MLPS)
            )
            with engine.model.routing.suspended(*routes):  # none named: every route
                return {**out, "prefill_tok_s": {str(lengths[0]): cold_prefill(engine, lengths[0])}}
        out["prefill_tok_s"] = {str(n): cold_prefill(engine, n) for n in lengths}
        out.update(decode_rates(engine, args.decode))
        out["edited_rerun_s"] = edited_rerun(engine, lengths[0], args.answer)
    return out


def work_of(path: Path) -> dict:
    """What a token costs the model at `path` by its files alone: the multiply-adds of its
    matrices but the embedding (a prefill step's; the head runs on one row) and the bytes a
    decode step reads (every matrix, the tied head included, with scales and biases)."""
    import json
    import struct

    bits = json.loads((path / "config.json").read_text()).get("quantization", {}).get("bits")
    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    products = read = 0
    for name, info in header.items():
        if name == "__metadata__" or len(info["shape"]) != 2:
            continue
        start, end = info["data_offsets"]
        read += end - start
        if name.endswith(".weight") and "embed_tokens" not in name:
            packed = 32 // bits if info["dtype"] == "U32" else 1
            products += info["shape"][0] * info["shape"][1] * packed
    return {"products_per_token": products, "bytes_per_token": read}


def work_row(shape: str, ours: dict, twin: dict, lengths: list[int]) -> str:
    """The hybrid / twin ratios that equal work per weight would give: the twin's products
    over ours for prefill (attention's scores left out: they favour the hybrid as prompts
    grow), its bytes over ours for decode."""
    prefill = twin["work"]["products_per_token"] / ours["work"]["products_per_token"]
    decode = twin["work"]["bytes_per_token"] / ours["work"]["bytes_per_token"]
    cells = [f"{prefill:.2f}x"] * len(lengths) + [f"{decode:.2f}x"] * 2 + [""]
    return f"| {shape} | twin's work / ours | " + " | ".join(cells) + " |"


def ratio_row(
    shape: str, ours: dict, peer: dict, name: str, lengths: list[int], mine: str = "ours"
) -> str:
    """Our figures (variant `mine`) over `peer`'s (speeds: ours / theirs; the re-run:
    theirs / ours, so above 1 is ours faster everywhere)."""
    theirs = peer["prefill_tok_s"]
    cells = [
        ours["prefill_tok_s"][str(n)] / theirs[str(n)] if str(n) in theirs else None
        for n in lengths
    ]
    for key in ("decode_1_tok_s", "decode_4_tok_s"):
        cells.append(ours[key] / peer[key] if peer.get(key) else None)
    rerun = peer.get("edited_rerun_s")
    cells.append(rerun / ours["edited_rerun_s"] if rerun else None)
    text = ["" if c is None else f"{c:.2f}x" for c in cells]
    return f"| {shape} | {mine} / {name} | " + " | ".join(text) + " |"


def table(results: dict, lengths: list[int]) -> str:
    head = [f"prefill {n}" for n in lengths] + ["decode 1", "decode 4", "edited re-run"]
    lines = [
        f"Qwen 3.5-shaped hybrids and Gemma 4 E2B, through Engine ({cpu_name()}, "
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
        for peer in ("dense twin", "llama.cpp"):
            if peer in variants:
                lines.append(ratio_row(shape, variants["ours"], variants[peer], peer, lengths))
            if peer == "dense twin" and "work" in variants.get(peer, {}):
                lines.append(work_row(shape, variants["ours"], variants[peer], lengths))
        vision = variants.get("vision checkpoint")
        if vision is not None:
            for peer, name in (("vision checkpoint, mlx-vlm's", "mlx-vlm's"), ("llama.cpp",) * 2):
                if peer in variants:
                    lines.append(ratio_row(shape, vision, variants[peer], name, lengths, "vision"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import mlx_nbengine  # noqa: F401 - binds the fast BLAS before MLX loads

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, model=None)
    ap.add_argument(
        "--shapes",
        default=None,
        help="comma-separated (qwen3_5-0.8b,qwen3_5-2b,gemma4-e2b; also gemma4-e4b)",
    )
    ap.add_argument("--lengths", default=None, help="cold prefill lengths (1024,4096)")
    ap.add_argument("--decode", type=int, default=None, help="decode tokens (64)")
    ap.add_argument("--answer", type=int, default=None, help="the edited re-run's answer (128)")
    ap.add_argument("--no-library", action="store_true", help="skip the library variant")
    args = ap.parse_args(argv)
    fill_sizes(args, SIZES, QUICK)
    lengths = [int(n) for n in args.lengths.split(",")]
    results: dict = {}
    skipped: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-families-") as scratch:
        shapes = args.shapes.split(",")
        partial = results_path("families", args.json, args.quick)
        for shape in shapes:
            paths = model_dirs(shape, Path(scratch))
            missing = llama_missing()
            gguf = gguf_apart(shape, paths["ours"], Path(scratch)) if missing is None else None
            variants = {"ours": measure(paths["ours"], lengths, args, library=False)}
            if not args.no_library:
                variants["library"] = measure(paths["ours"], lengths, args, library=True)
            if "vision checkpoint" in paths:
                vl = paths["vision checkpoint"]
                variants["vision checkpoint"] = measure(vl, lengths, args, library=False)
                if not args.no_library:
                    variants["vision checkpoint, mlx-vlm's"] = measure(
                        vl, lengths, args, library=True
                    )
            if "dense twin" in paths:
                variants["dense twin"] = measure(paths["dense twin"], lengths, args, library=False)
            if gguf is not None:
                variants["llama.cpp"] = measure_llama(gguf, lengths, args)
            else:
                print(f"llama.cpp skipped: {missing}", flush=True)
                skipped["llama.cpp"] = missing
            results[shape] = variants
            print(f"{shape}: {variants}", flush=True)
            if partial is not None and shape != shapes[-1]:  # a later shape's crash keeps it
                write_json(partial, data_of(args, results, skipped))
    write_results(
        "families",
        data_of(args, results, skipped),
        table(results, lengths),
        json_path=args.json,
        quick=args.quick,
    )


def data_of(args, results: dict, skipped: dict) -> dict:
    return {
        "sizes": {k: getattr(args, k) for k in SIZES},
        "threads": usable_cpus(),
        "results": results,
        "skipped": skipped,
    }


if __name__ == "__main__":
    main()

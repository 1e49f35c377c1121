"""Sampling cost per decode step on Gemma 3 270M (262k vocabulary), CPU, in one run.

- *per step*: the time to draw the next token of 1 and of 4 rows (temperature 0.8, with
  and without ``top_p`` 0.95), from real logits (the last position of four chat prompts),
  median of ``--repeats``:
  - *mlx-lm*: what mlx-lm's generators do each step, log-softmax then its
    `make_sampler` (sort for the nucleus, Gumbel-max), in MLX;
  - *graph*: `RequestSampler.graph` (the engine's GPU path), in MLX, no log-softmax;
  - *host*: `RequestSampler.host` (the engine's CPU path), numpy, including the copy of
    the logits out of MLX.
- *engine*: four chats submitted together to an engine with ``parallel=4``, up to
  ``--chat-tokens`` tokens each: greedy, sampled (temperature 0.8, ``top_p`` 0.95) on the
  host path, and sampled on the graph path; best of ``--engine-repeats`` alternated runs.
  Reported as time per generated token relative to greedy (sampled chats may stop early):
  near 1 means sampling adds little to a batched step (about 160 ms here).

Run from the repository root: ``.venv/bin/python -m bench.bench_sampling``. Writes
``bench/results/sampling.json`` and ``sampling.txt`` (``--json PATH``: there) and prints
the table. ``--model M`` measures M instead of the default model; ``--quick`` (a smoke
test, seconds): a tiny model (``--model DIR``, else a tiny gemma3_text), few repeats,
writing only ``--json``. The samplers involve no matrix products, so no BLAS thread count
is set for them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

from bench.common import add_run_args, fill_sizes, write_results  # noqa: E402
from mlx_nbengine import Engine  # noqa: E402
from mlx_nbengine.engine.sampling import RequestSampler  # noqa: E402
from mlx_nbengine.models import load  # noqa: E402

CHATS = [
    "Write a haiku about the sea.",
    "Name three uses of a paper clip.",
    "Explain what a prime number is to a child.",
    "Give me a short packing list for a day hike.",
]
TEMPERATURE = 0.8


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def time_samplers(batch: mx.array, top_p: float, repeats: int) -> dict:
    rows = batch.shape[0]
    mlx_lm = make_sampler(TEMPERATURE, top_p=top_p)
    ours = [RequestSampler(temperature=TEMPERATURE, top_p=top_p, seed=i) for i in range(rows)]

    def mlx_lm_way():
        logprobs = batch - mx.logsumexp(batch, axis=-1, keepdims=True)
        mx.eval(mlx_lm(logprobs))

    def graph():
        mx.eval([s.graph(r - r.max()) for s, r in zip(ours, batch.split(rows), strict=True)])

    def host():
        [s.host(v) for s, v in zip(ours, np.array(batch), strict=True)]

    return {
        "top_p": top_p,
        "rows": rows,
        "mlx_lm_ms": median_ms(mlx_lm_way, repeats),
        "graph_ms": median_ms(graph, repeats),
        "host_ms": median_ms(host, repeats),
    }


def per_step(logits: mx.array, repeats: int) -> list[dict]:
    out = []
    for top_p in (1.0, 0.95):
        for rows in (1, 4):
            out.append(time_samplers(logits[:rows], top_p, repeats))
            print(out[-1], flush=True)
    return out


def engine_runs(engine: Engine, *, max_tokens: int, repeats: int) -> dict:
    """Best of `repeats` alternated runs: greedy, sampled on the host path (the engine's
    choice on CPU), sampled on the graph path (the engine switched to it for the run)."""

    def run(graph: bool = False, **sampling) -> tuple[float, int]:
        engine.internals.host_sampling = not graph
        start = time.perf_counter()
        requests = [engine.submit(c, max_tokens=max_tokens, **sampling) for c in CHATS]
        tokens = sum(len(r.result().tokens) for r in requests)
        return time.perf_counter() - start, tokens

    engine.submit(CHATS[0], max_tokens=4).result()
    sampled = dict(temperature=TEMPERATURE, top_p=0.95)
    best: dict[str, tuple[float, int]] = {}
    for i in range(repeats):
        for name, kwargs in (
            ("greedy", {}),
            ("sampled_host", {**sampled, "seed": i}),
            ("sampled_graph", {**sampled, "seed": i, "graph": True}),
        ):
            got = run(**kwargs)
            best[name] = min(got, best.get(name, got))
            print(f"engine run {i + 1} {name}: {got[0]:.2f} s, {got[1]} tokens", flush=True)
    engine.internals.host_sampling = True
    out = {f"{k}_s": v[0] for k, v in best.items()} | {f"{k}_tokens": v[1] for k, v in best.items()}
    per_token = {k: seconds / tokens for k, (seconds, tokens) in best.items()}
    for k in ("sampled_host", "sampled_graph"):
        out[f"{k}_over_greedy"] = per_token[k] / per_token["greedy"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--repeats", type=int, default=None, help="per-step timings: median (15)")
    ap.add_argument("--engine-repeats", type=int, default=None, help="engine runs, best of (2)")
    ap.add_argument("--chat-tokens", type=int, default=None, help="tokens per chat (32)")
    args = ap.parse_args(argv)
    fill_sizes(
        args,
        {"repeats": 15, "engine_repeats": 2, "chat_tokens": 32},
        {"repeats": 3, "engine_repeats": 1, "chat_tokens": 4},
    )
    with tempfile.TemporaryDirectory() as models:
        model = args.model or "default"
        if args.quick and not args.model:
            from mlx_nbengine.testing import make_tiny_model

            model = str(make_tiny_model("gemma3_text", Path(models) / "g", sliding_window=64))
        return run(args, model)


def run(args, model: str) -> int:
    lm = load(model, dtype="float32")  # on this thread, for the per-step timings
    logits = mx.concatenate([lm.model(mx.array(lm.encode(c))[None])[:, -1, :] for c in CHATS])
    mx.eval(logits)
    del lm
    steps = per_step(logits, args.repeats)
    with tempfile.TemporaryDirectory() as scratch:
        with Engine.load(model, parallel=4, dtype="float32", cache_dir=scratch) as engine:
            runs = engine_runs(engine, max_tokens=args.chat_tokens, repeats=args.engine_repeats)

    lines = [
        "top_p | rows | mlx-lm (log-softmax + sampler) | graph | host",
        "---: | ---: | ---: | ---: | ---:",
    ]
    for s in steps:
        lines.append(
            f"{s['top_p']} | {s['rows']} | {s['mlx_lm_ms']:.1f} ms | {s['graph_ms']:.1f} ms"
            f" | {s['host_ms']:.1f} ms"
        )
    lines.append("")
    lines.append(
        f"engine, four chats (up to {args.chat_tokens} tokens each) with parallel=4, time per"
        f" token relative to greedy ({runs['greedy_s']:.2f} s, {runs['greedy_tokens']} tokens):"
        f" sampled on the host {runs['sampled_host_over_greedy']:.2f}x"
        f" ({runs['sampled_host_s']:.2f} s, {runs['sampled_host_tokens']} tokens), in the graph"
        f" {runs['sampled_graph_over_greedy']:.2f}x ({runs['sampled_graph_s']:.2f} s,"
        f" {runs['sampled_graph_tokens']} tokens)"
    )
    text = "\n".join(lines)
    settings = {"temperature": TEMPERATURE, "repeats": args.repeats, "model": model}
    settings["quick"] = args.quick
    write_results(
        "sampling",
        {**settings, "per_step": steps, "engine": runs},
        text,
        json_path=args.json,
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

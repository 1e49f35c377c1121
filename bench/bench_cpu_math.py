"""MLX's own GELU vs the fused rational-tanh GELU (`models.cpu_math`), side by side in one run.

On Gemma 3 270M (float32, CPU, the default model), both variants of the same loaded model
(the MLP modules' class is switched between rounds):

- *GELU alone*: the activations of one 256-token prefill step (18 layers x 256 x 2,048).
- *prefill*: a ``--prompt-tokens`` prompt in 256-token steps, as the engine runs it.
- *decode 1 / 4 rows*: median step time (model call + greedy argmax) over
  ``--decode-steps`` steps of a batch of one and of four sequences, and *4-row cost* =
  4-row step / 1-row step (what caps the batched speed-up, bench_engine's (a)). The
  four (variant, rows) decodes run interleaved, one step each in turn.

For the GELU and prefill, rounds alternate the variants and the best round of each
counts. Also reported: the largest logit difference between the variants over the prompt
(relative to the largest logit) and whether their greedy continuations agree.

Run from the repository root: ``.venv/bin/python -m bench.bench_cpu_math``. Writes
``bench/results/cpu_math.json`` and ``cpu_math.txt`` (``--json PATH``: there) and prints the
table. ``--model M`` measures another float32 Gemma model; ``--quick`` (a smoke test,
seconds): a tiny float32 gemma3_text (``--model DIR``, else one made), a 128-token prompt,
one round, writing only ``--json``. The GELU alone is timed on the model's own shapes (its
layers x 256 positions x its MLP width).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mlx_nbengine._blas import ThreadPolicy, ensure_fast_blas

ensure_fast_blas()  # before MLX is imported

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from bench.common import add_run_args, fill_sizes, write_results  # noqa: E402
from mlx_nbengine.models import cpu_math, load  # noqa: E402

TEXT = "The river stone sat under seven green lamps by the ocean window. "
VARIANTS = ("mlx gelu_approx", "fused rational")
POLICY = ThreadPolicy()  # each step's threads, as an engine's


def set_variant(mlps: list, fast_class: type, library_class: type, variant: str) -> None:
    for mlp in mlps:
        mlp.__class__ = fast_class if variant == VARIANTS[1] else library_class


def gelu_ms(variant: str, *, layers: int, width: int) -> float:
    gelu = cpu_math.gelu_tanh if variant == VARIANTS[1] else nn.gelu_approx
    xs = [mx.random.normal((1, 256, width)) for _ in range(layers)]
    mx.eval(xs)
    start = time.perf_counter()
    mx.eval([gelu(x) for x in xs])
    return (time.perf_counter() - start) * 1000


def prefill_s(lm, ids: list[int]) -> float:
    cache = lm.make_cache()
    start = time.perf_counter()
    for s in range(0, len(ids), 256):
        chunk = mx.array(ids[s : s + 256])[None]
        with POLICY.step(chunk.shape[1]):
            mx.eval(lm.model(chunk, cache=cache)[:, -1, :], [c.state for c in cache])
    return time.perf_counter() - start


def decode_ms(lm, set_to, steps: int) -> dict[tuple[str, int], float]:
    """Median step time per (variant, rows): the four interleaved step by step, so that
    the machine's load changes hit them alike."""
    combos = [(v, rows) for v in VARIANTS for rows in (1, 4)]
    caches, tokens, times = {}, {}, {c: [] for c in combos}
    ids = lm.encode(TEXT)  # a few prompt tokens, then one fed token, from the model's tokenizer
    for variant, rows in combos:
        set_to(variant)
        caches[variant, rows] = lm.make_cache()
        mx.eval(lm.model(mx.array([ids[:4]] * rows), cache=caches[variant, rows]))
        tokens[variant, rows] = mx.array([[ids[4]]] * rows)
    for i in range(steps + 1):
        for combo in combos[i % 4 :] + combos[: i % 4]:
            set_to(combo[0])
            start = time.perf_counter()
            with POLICY.step(combo[1]):
                token = mx.argmax(lm.model(tokens[combo], cache=caches[combo])[:, -1:, :], axis=-1)
                mx.eval(token)
            if i:  # the first step of each pays one-off costs
                times[combo].append(time.perf_counter() - start)
            tokens[combo] = token
    return {c: statistics.median(t) * 1000 for c, t in times.items()}


def greedy(lm, ids: list[int], n: int) -> tuple[mx.array, list[int]]:
    cache = lm.make_cache()
    logits = lm.model(mx.array(ids)[None], cache=cache)
    out, token = [], mx.argmax(logits[:, -1:, :], axis=-1)
    for _ in range(n):
        out.append(token.item())
        token = mx.argmax(lm.model(token, cache=cache)[:, -1:, :], axis=-1)
    return logits, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=None, help="prefill prompt (1024)")
    ap.add_argument("--decode-steps", type=int, default=None, help="decode steps timed (48)")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds (3)")
    args = ap.parse_args(argv)
    fill_sizes(
        args,
        {"prompt_tokens": 1024, "decode_steps": 48, "rounds": 3},
        {"prompt_tokens": 128, "decode_steps": 4, "rounds": 1},
    )
    with tempfile.TemporaryDirectory() as models:
        model = args.model or "default"
        if args.quick and not args.model:
            from mlx_nbengine.testing import make_tiny_model

            model = str(make_tiny_model("gemma3_text", Path(models) / "g", dtype="float32"))
        return run(args, model)


def run(args, model: str) -> int:
    lm = load(model, dtype="float32")
    mlps = [layer.mlp for layer in lm.model.layers]
    fast_class = type(mlps[0])
    library_class = fast_class.__mro__[1]
    if fast_class is library_class or not issubclass(fast_class, library_class):
        print("the fused GELU is not in use here (not a CPU, or the MLP changed)")
        return 1
    ids = lm.encode(TEXT * (args.prompt_tokens // 8))[: args.prompt_tokens]
    config = lm.config.get("text_config", lm.config)
    width = int(config.get("intermediate_size") or 4 * config["hidden_size"])

    best: dict[str, dict[str, float]] = {v: {} for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            set_variant(mlps, fast_class, library_class, variant)
            got = {
                "gelu_ms": gelu_ms(variant, layers=len(mlps), width=width),
                "prefill_tok_s": -len(ids) / prefill_s(lm, ids),  # negated: best = min
            }
            for k, v in got.items():
                best[variant][k] = min(v, best[variant].get(k, v))
            print(f"round {r + 1} {variant}: {got}", flush=True)

    def set_to(variant: str) -> None:
        set_variant(mlps, fast_class, library_class, variant)

    decode = decode_ms(lm, set_to, args.decode_steps)
    for (variant, rows), ms in decode.items():
        best[variant][f"decode{rows}_ms"] = ms

    rows = []
    for variant in VARIANTS:
        b = best[variant]
        rows.append(
            {
                "variant": variant,
                "gelu_ms": b["gelu_ms"],
                "prefill_tok_s": -b["prefill_tok_s"],
                "decode1_ms": b["decode1_ms"],
                "decode4_ms": b["decode4_ms"],
                "four_row_cost": b["decode4_ms"] / b["decode1_ms"],
            }
        )
    set_variant(mlps, fast_class, library_class, VARIANTS[0])
    slow_logits, slow_tokens = greedy(lm, ids[:256], 24)
    set_variant(mlps, fast_class, library_class, VARIANTS[1])
    fast_logits, fast_tokens = greedy(lm, ids[:256], 24)
    scale = mx.abs(slow_logits).max().item()
    agreement = {
        "max_logit_diff_rel": mx.abs(fast_logits - slow_logits).max().item() / scale,
        "same_greedy_tokens": fast_tokens == slow_tokens,
    }

    lines = [
        "variant | GELU of a 256-token step | prefill tok/s | decode 1 row | decode 4 rows"
        " | 4-row cost",
        "--- | ---: | ---: | ---: | ---: | ---:",
    ]
    for row in rows:
        lines.append(
            f"{row['variant']} | {row['gelu_ms']:.0f} ms | {row['prefill_tok_s']:.1f}"
            f" | {row['decode1_ms']:.1f} ms | {row['decode4_ms']:.1f} ms"
            f" | {row['four_row_cost']:.3f}x"
        )
    slow, fast = rows
    lines.append("")
    lines.append(
        f"fused vs library: GELU {slow['gelu_ms'] / fast['gelu_ms']:.2f}x faster, prefill"
        f" {fast['prefill_tok_s'] / slow['prefill_tok_s']:.2f}x; largest logit difference"
        f" {agreement['max_logit_diff_rel']:.1e} of the largest logit; same greedy tokens:"
        f" {agreement['same_greedy_tokens']}"
    )
    text = "\n".join(lines)
    settings = {"prompt_tokens": len(ids), "decode_steps": args.decode_steps, "rounds": args.rounds}
    settings |= {"model": model, "gelu_shape": [len(mlps), 256, width], "quick": args.quick}
    write_results(
        "cpu_math",
        {**settings, "rows": rows, "agreement": agreement},
        text,
        json_path=args.json,
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

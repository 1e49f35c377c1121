"""Command line: ``python -m mlx_nbengine {demo,convert,blas}``.

- ``demo``: load the default model (Gemma 3 270M; converted from its GGUF on
  first use, with a progress bar) and stream a greedy completion of a fixed
  prompt, then print prefill and decode speed.
- ``convert FILE.gguf``: convert a GGUF file into the conversion cache and print
  the MLX model directory.
- ``blas``: say whether MLX got the optimized BLAS in this process.
"""

from __future__ import annotations

import argparse
import sys
import time

from mlx_nbengine._blas import ensure_fast_blas

DEMO_PROMPT = "The Eiffel Tower is located in the city of"


def _demo(args: argparse.Namespace) -> int:
    import mlx.core as mx

    from mlx_nbengine._blas import blas_step
    from mlx_nbengine.models import load

    started = time.perf_counter()
    print(f"Loading {args.model} ...", file=sys.stderr, flush=True)
    lm = load(args.model)
    print(f"Loaded {lm.model_type} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    prompt = lm.encode(args.prompt)
    print(args.prompt, end="", flush=True)

    # Prefill in 256-token steps, as the engine does, then greedy decode one token at a time.
    started = time.perf_counter()
    cache = lm.make_cache()
    for start in range(0, len(prompt), 256):
        step = prompt[start : start + 256]
        with blas_step(len(step)):
            logits = lm.model(mx.array(step)[None], cache=cache)
            mx.eval(logits[0, -1], [c.state for c in cache])
    token = mx.argmax(logits[0, -1])
    prefill_s = time.perf_counter() - started

    detokenizer = lm.tokenizer.detokenizer
    detokenizer.reset()
    started = time.perf_counter()
    generated = 0
    for _ in range(args.max_tokens):
        if int(token.item()) in lm.eos_token_ids:
            break
        detokenizer.add_token(int(token.item()))
        print(detokenizer.last_segment, end="", flush=True)
        generated += 1
        with blas_step(1):
            token = mx.argmax(lm.model(token.reshape(1, 1), cache=cache)[0, -1])
            mx.eval(token)
    detokenizer.finalize()
    print(detokenizer.last_segment)
    decode_s = time.perf_counter() - started
    print(
        f"prefill {len(prompt)} tokens at {len(prompt) / prefill_s:.1f} tok/s, "
        f"decode {generated} tokens at {generated / max(decode_s, 1e-9):.1f} tok/s",
        file=sys.stderr,
    )
    return 0


def _convert(args: argparse.Namespace) -> int:
    from mlx_nbengine.models.gguf import convert

    started = time.perf_counter()
    out = convert(args.file, cache_dir=args.cache_dir)
    print(f"converted in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(out)
    return 0


def _blas(args: argparse.Namespace) -> int:
    status = ensure_fast_blas()
    print(f"optimized BLAS active: {status.active} ({status.reason})")
    if status.library:
        print(status.library)
    return 0


def main(argv: list[str] | None = None) -> int:
    # Before anything imports MLX: only then can OpenBLAS take over its matmuls.
    ensure_fast_blas()
    from mlx_nbengine.errors import EngineError

    parser = argparse.ArgumentParser(
        prog="python -m mlx_nbengine", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="stream a greedy completion from the default model")
    demo.add_argument("--model", default="default", help="'default', a model directory or a .gguf")
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=40)
    demo.set_defaults(run=_demo)
    conv = sub.add_parser("convert", help="convert a GGUF file into an MLX model directory")
    conv.add_argument("file", help="path of the .gguf file")
    conv.add_argument("--cache-dir", default=None, help="where conversions are kept")
    conv.set_defaults(run=_convert)
    blas = sub.add_parser("blas", help="report whether the optimized BLAS is in use")
    blas.set_defaults(run=_blas)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

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
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlx_nbengine.models import load

    started = time.perf_counter()
    print(f"Loading {args.model} ...", file=sys.stderr, flush=True)
    lm = load(args.model)
    print(f"Loaded {lm.model_type} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    prompt = lm.encode(args.prompt)
    print(args.prompt, end="", flush=True)
    response = None
    for response in stream_generate(
        lm.model, lm.tokenizer, prompt, max_tokens=args.max_tokens, sampler=make_sampler(0.0)
    ):
        print(response.text, end="", flush=True)
    print()
    if response is not None:
        print(
            f"prefill {response.prompt_tokens} tokens at {response.prompt_tps:.1f} tok/s, "
            f"decode {response.generation_tokens} tokens at {response.generation_tps:.1f} tok/s",
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

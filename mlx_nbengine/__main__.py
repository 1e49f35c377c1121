"""Command line: ``python -m mlx_nbengine {demo,convert,html,blas}``.

- ``demo``: the main job (`mlx_nbengine.demo`): execute the quickstart notebook
  headless on the default model (Gemma 3 270M; converted from its GGUF on first use,
  with a progress bar), a line per cell, then a table of each answer's restored and
  computed tokens, time to first token and each edited re-run's speed-up;
  ``--quick`` sends the same story straight to the engine.
- ``convert FILE.gguf``: convert a GGUF file into the conversion cache and print
  the MLX model directory.
- ``html NOTEBOOK``: export an executed notebook to HTML whose block pictures need no
  kernel and no network (`mlx_nbengine.notebook.export`).
- ``blas``: say whether MLX got the optimized BLAS in this process.
"""

from __future__ import annotations

import argparse
import sys
import time

from mlx_nbengine._blas import ensure_fast_blas
from mlx_nbengine.demo import DEFAULT_OUT


def _demo(args: argparse.Namespace) -> int:
    from mlx_nbengine.demo import main as demo_main

    return demo_main(args)


def _convert(args: argparse.Namespace) -> int:
    from mlx_nbengine.models.gguf import convert

    started = time.perf_counter()
    out = convert(args.file, cache_dir=args.cache_dir)
    print(f"converted in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(out)
    return 0


def _html(args: argparse.Namespace) -> int:
    from mlx_nbengine.notebook.export import write_html

    print(write_html(args.notebook, args.out))
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
    demo = sub.add_parser(
        "demo", help="run the quickstart notebook headless: a long prompt, an edit, the re-run"
    )
    demo.add_argument("--model", default="default", help="'default', a model directory or a .gguf")
    demo.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"where the executed notebook and its HTML go (default ./{DEFAULT_OUT}/)",
    )
    demo.add_argument(
        "--quick", action="store_true", help="skip the notebook: the same story through the engine"
    )
    demo.set_defaults(run=_demo)
    conv = sub.add_parser("convert", help="convert a GGUF file into an MLX model directory")
    conv.add_argument("file", help="path of the .gguf file")
    conv.add_argument("--cache-dir", default=None, help="where conversions are kept")
    conv.set_defaults(run=_convert)
    html = sub.add_parser(
        "html", help="export an executed notebook to HTML with its block pictures (no kernel)"
    )
    html.add_argument("notebook", help="path of the .ipynb file")
    html.add_argument("-o", "--out", default=None, help="the HTML file (default: beside it)")
    html.set_defaults(run=_html)
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

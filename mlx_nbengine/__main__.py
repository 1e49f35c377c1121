"""Command line: ``python -m mlx_nbengine {demo,convert,html,blas}``.

- ``demo``: the main job (`mlx_nbengine.demo`): execute the quickstart notebook
  headless on the default model (Gemma 3 270M; converted from its GGUF on first use,
  with a progress bar), a line per cell, then a table of each answer's restored and
  computed tokens, time to first token and each edited re-run's speed-up;
  ``--quick`` sends the same story straight to the engine; ``--notebook NB`` executes
  another notebook the same way.
- ``convert FILE.gguf``: convert a GGUF file into the conversion cache and print
  the MLX model directory.
- ``html NOTEBOOK``: export an executed notebook to HTML whose block pictures need no
  kernel and no network (`mlx_nbengine.notebook.export`).
- ``blas``: say whether MLX got the optimized BLAS in this process.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable

from mlx_nbengine._blas import ensure_fast_blas
from mlx_nbengine.demo import DEFAULT_OUT
from mlx_nbengine.demo import main as demo_main
from mlx_nbengine.errors import EngineError
from mlx_nbengine.models.gguf import convert
from mlx_nbengine.notebook.export import write_html


def _demo(args: argparse.Namespace) -> int:
    return demo_main(args)


def _convert(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    out = convert(args.file, cache_dir=args.cache_dir)
    print(f"converted in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(out)
    return 0


def _html(args: argparse.Namespace) -> int:
    print(write_html(args.notebook, args.out))
    return 0


def _blas(args: argparse.Namespace) -> int:
    print("\n".join(ensure_fast_blas().lines()))
    return 0


def _plain(text: str) -> str:
    """reST markup out of `text` (``code`` and `role` become their words), for --help."""
    return " ".join(re.sub(r"`{1,2}([^`]*)`{1,2}", r"\1", text).split())


def _descriptions(doc: str) -> dict[str, str]:
    """Each subcommand's bullet in the module docstring, as plain text: {"demo": "..."}."""
    found: dict[str, str] = {}
    for bullet in re.split(r"\n- ", doc)[1:]:
        name, _, text = bullet.partition(":")
        words = _plain(name).split()
        if words:
            found[words[0]] = _plain(text.split("\n\n")[0])
    return found


def main(argv: list[str] | None = None) -> int:
    # Before anything imports MLX: only then can OpenBLAS take over its matmuls.
    ensure_fast_blas()

    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except EngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: python -m mlx_nbengine {args.command} stopped", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per bullet of the module docstring."""
    doc = __doc__ or ""
    about = _descriptions(doc)
    parser = argparse.ArgumentParser(
        prog="python -m mlx_nbengine", description=_plain(doc.split("\n")[0])
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run: Callable[..., int], summary: str) -> argparse.ArgumentParser:
        child = sub.add_parser(name, help=summary, description=about.get(name))
        child.set_defaults(run=run)
        return child

    demo = command(
        "demo", _demo, "run the quickstart notebook headless: a long prompt, an edit, the re-run"
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
    demo.add_argument(
        "--notebook",
        default=None,
        metavar="NB",
        help="execute this notebook instead of the quickstart (its %%load_model default "
        "gets --model)",
    )
    conv = command("convert", _convert, "convert a GGUF file into an MLX model directory")
    conv.add_argument("file", help="path of the .gguf file")
    conv.add_argument("--cache-dir", default=None, help="where conversions are kept")
    html = command(
        "html", _html, "export an executed notebook to HTML with its block pictures (no kernel)"
    )
    html.add_argument("notebook", help="path of the .ipynb file")
    html.add_argument("-o", "--out", default=None, help="the HTML file (default: beside it)")
    command("blas", _blas, "report whether the optimized BLAS is in use")
    return parser


if __name__ == "__main__":
    sys.exit(main())

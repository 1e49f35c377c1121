"""The notebook face: `%load_model`, `%%llm`, `%llm_cache`, `%llm_status`, `%llm_models`,
`%unload_model`.

`%load_ext mlx_nbengine` registers these magics; the `Engine` then lives in the kernel
process until `%unload_model` (or the kernel's exit). The magics are thin: they declare
their options with IPython's `magic_arguments` (the docstrings are the help text), read
their line and cell with `mlx_nbengine.notebook.prompting`, and make one call into
`mlx_nbengine.notebook.session`, the session's state and operations without IPython (it
submits to the engine and follows the request with `mlx_nbengine.notebook.streaming`).

Terms:

- *model name*: what `%load_model` takes: ``default``, a local model directory or
  ``.gguf`` file, or a model id ``ORG/NAME`` looked up in the Hugging Face hub cache, then
  LM Studio's models folder, then downloaded from the hub (the order of
  `mlx_nbengine.models.sources`). `%llm_models` lists the names found without a download.
- *load progress*: the one line `%load_model` keeps updating while the engine loads: the
  download's bytes ("downloading ORG/NAME: ..."), then a GGUF conversion's ("converting
  ..."), else the elapsed time.
- *session* (`LLMSession`): what the extension keeps between cells: the engine, the name
  and options of the loaded model, the named conversations and the background requests.
  The kernel's main thread owns it; the magics run there.
- *foreground request*: a plain `%%llm` cell. The cell stays busy while the main thread
  renders the answer into it; the kernel's interrupt cancels the request. The partial
  answer stays, marked interrupted, and ``-o`` still receives it; the cell then ends with
  `GenerationInterrupted` (a `KeyboardInterrupt` shown as one line), so "Run all" stops
  there.
- *background request*: `%%llm --bg`. The cell returns at once with a `BackgroundAnswer`
  handle whose own thread renders into that cell (see `mlx_nbengine.notebook.streaming`). Several
  run at once (up to the engine's `parallel` slots, then they queue). nbclient and
  nbconvert only record output that arrives while a cell runs, so in a headless run a
  background answer is complete only if a later cell waits for it (``handle.result()``).

In a kernel (a notebook front end) every answer gets a block strip under it, `--blocks`
adds the block map after the answer and `%llm_cache` shows the store view: the widgets of
`mlx_nbengine.notebook.widgets`, whose bundles also carry static ``text/html`` for exported
notebooks. Terminal IPython gets their text instead. A cell with ``--image`` (a vision
model's pictures) first shows a thumbnail of each image, above the answer; its strip and
map mark the blocks that hold an image's tokens.

Errors the user can fix (no model loaded, an unknown option, an empty cell, a model that
fails to load, is not cached while offline or is ambiguous, a prompt the engine rejects)
raise `UsageError`: IPython prints one line, no traceback. The session raises
`mlx_nbengine.errors.SessionError`; `one_line` turns it into `UsageError` here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mlx_nbengine.errors import SessionError
from mlx_nbengine.notebook.prompting import (
    engine_options,
    interpolate,
    parse_options,
    parse_size,
    read_images,
)
from mlx_nbengine.notebook.serving import ServeMagics
from mlx_nbengine.notebook.session import (
    LLMSession,
    Output,
    cell_text,
    default_engine_factory,
    model_label,
    rank_rows,
    show_models,
)
from mlx_nbengine.notebook.streaming import BackgroundAnswer, GenerationInterrupted

__all__ = [
    "BackgroundAnswer",
    "GenerationInterrupted",
    "LLMMagics",
    "LLMSession",
    "interpolate",
    "load_ipython_extension",
    "model_label",
    "parse_size",
    "rank_rows",
    "unload_ipython_extension",
]


@contextmanager
def one_line() -> Iterator[None]:
    """The magic boundary: a `SessionError` the user can fix becomes a one-line `UsageError`."""
    try:
        yield
    except SessionError as exc:
        raise UsageError(str(exc)) from None


def _no_arguments(line: str, magic: str) -> None:
    if line.strip():
        raise UsageError(f"{magic} takes no arguments")


@magics_class
class LLMMagics(Magics):
    """Magics of mlx_nbengine; one instance per shell, holding the `LLMSession`.

    Each magic is its argument table and help text (``%magic?`` reads them) and one call
    into `mlx_nbengine.notebook.session`; serving.py holds %llm_serve, its own class."""

    def __init__(self, shell=None, *, engine_factory=None) -> None:
        super().__init__(shell)
        self.session = LLMSession()
        # Builds the engine for %load_model; tests inject a fake to isolate parsing.
        self.engine_factory = engine_factory or default_engine_factory

    def pre_run_cell(self, info: Any) -> None:
        """IPython `pre_run_cell` hook: remember which cell runs (for chat turn keys)."""
        source = getattr(info, "raw_cell", "") or ""
        self.session.cell_started(cell_id=getattr(info, "cell_id", None), source=source)

    def _require_engine(self) -> Any:
        with one_line():
            return self.session.require_engine()

    def _updates_in_place(self) -> bool:
        # A kernel's front end redraws a display in place; a terminal prints every update.
        return hasattr(self.shell, "kernel")

    def _display(self, obj: Any, **kwargs: Any) -> Any:
        """Show `obj`: a mimebundle dict (sent raw), or an object IPython formats (a widget)."""
        # Looked up at each call: a shell (or a test) may replace IPython.display.display.
        from IPython.display import display

        return display(obj, raw=isinstance(obj, dict), **kwargs)

    def _out(self) -> Output:
        return Output(show=self._display, live=self._updates_in_place())

    def close_engine(self) -> str | None:
        """Close the engine (and its scratch file); return the model name it served."""
        return self.session.close_engine()

    @magic_arguments()
    @argument(
        "model",
        metavar="MODEL",
        help=(
            "`default`, a local MLX model directory, a .gguf file, or ORG/NAME: a Hugging Face "
            "id (from its local cache, else downloaded) or an LM Studio model"
        ),
    )
    @argument(
        "--revision",
        metavar="REV",
        default=None,
        help="branch, tag or commit of a Hugging Face id ORG/NAME (default: main)",
    )
    @argument(
        "--parallel", type=int, metavar="N", default=4, help="requests decoded together (default 4)"
    )
    @argument(
        "--block-size",
        type=int,
        metavar="N",
        default=256,
        help="tokens per cached block (default 256)",
    )
    @argument(
        "--disk-budget",
        metavar="SIZE",
        default=None,
        help="bytes the block store may use on disk, e.g. 4GB or 512MiB (default: engine's)",
    )
    @argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="directory of the scratch file (default: tmp)",
    )
    @argument("--dtype", metavar="T", default=None, help="compute dtype, e.g. bfloat16 or float32")
    @argument(
        "--persist",
        metavar="DIR",
        default=None,
        help="keep the block store in DIR, so a restarted kernel restores its blocks from disk",
    )
    @argument(
        "--no-store",
        action="store_true",
        help="run without a block store (every prompt block is computed)",
    )
    @argument(
        "--restore",
        choices=["token", "block"],
        default=None,
        help="token (default): an edit restores up to its first changed token; block: whole "
        "blocks only, bit-identical to a cold run",
    )
    @argument(
        "--ranks",
        type=int,
        metavar="N",
        default=None,
        help="shard the model over N local processes (this kernel is rank 0)",
    )
    @argument(
        "--hosts",
        metavar="H1,H2",
        default=None,
        help="shard the model over one rank per host, this machine first (ssh to the others)",
    )
    @argument(
        "--shard",
        choices=["tensor", "pipeline"],
        default=None,
        help="how --ranks/--hosts shard the model (default: what mlx-lm supports, tensor first)",
    )
    @line_magic
    def load_model(self, line: str) -> None:
        """Load a model into this kernel and start its engine.

        MODEL is, looked up in this order:
          `default`        the embedded Gemma 3 270M;
          a local path     an MLX model directory or a .gguf file (converted on first load);
          ORG/NAME         a Hugging Face id in the local hub cache (HF_HUB_CACHE / HF_HOME),
                           at --revision REV if given (a branch, tag or commit);
          PUBLISHER/NAME   an LM Studio model in its models folder;
          ORG/NAME         else downloaded from the Hugging Face hub (not with
                           HF_HUB_OFFLINE=1); ORG/NAME/FILE.gguf picks one GGUF file.
        `%llm_models` lists the models found here. The cell shows a download's and a GGUF
        conversion's progress and the time spent loading.
        Loading another model replaces the current one and frees its block store.
        --persist DIR keeps the block store in DIR (created private), so after a kernel
        restart `%load_model` of the same model restores the notebook's blocks from disk;
        a store of another model, dtype or block size there is set aside, and a DIR in use
        by another kernel leaves this one with a temporary store (one line says so).
        --ranks N / --hosts H1,H2 shard the model with mlx-lm over MLX's ring backend: this
        kernel is rank 0, the workers are started here (--ranks) or over ssh (--hosts); see
        the README's "Across two machines".
        """
        args = parse_options(self.load_model, line, "%load_model")
        options = engine_options(args)
        model = args.model if args.model == "default" else os.path.expanduser(args.model)
        with one_line():
            self.session.load(
                self.engine_factory,
                args.model,
                model,
                options,
                revision=args.revision,
                out=self._out(),
            )

    @line_magic
    def unload_model(self, line: str = "") -> None:
        """Stop the engine and free the model, its block store and the scratch file.

        Running requests are cancelled and the named conversations are forgotten.
        """
        _no_arguments(line, "%unload_model")
        with one_line():
            self.session.unload(self._out())

    @magic_arguments()
    @argument("-o", "--output", metavar="VAR", default=None, help="store the answer in VAR")
    @argument("--max-tokens", type=int, metavar="N", default=None, help="most tokens to generate")
    @argument(
        "--temperature",
        type=float,
        metavar="T",
        default=None,
        help="sampling temperature (0: greedy)",
    )
    @argument("--seed", type=int, metavar="S", default=None, help="random seed for sampling")
    @argument("--stop", action="append", metavar="S", default=None, help="stop string (repeatable)")
    @argument("--system", metavar="TEXT", default=None, help="system message (quote it)")
    @argument("--chat", metavar="NAME", default=None, help="continue the conversation NAME")
    @argument("--raw", action="store_true", help="send the text as is, no chat template")
    @argument(
        "--interpolate", action="store_true", help="substitute {name} from the user namespace"
    )
    @argument("--bg", action="store_true", help="run in the background; return a handle")
    @argument(
        "--markdown", action="store_true", help="render the answer as Markdown (HTML shown as text)"
    )
    @argument("--blocks", action="store_true", help="show the block map after the answer")
    @argument(
        "--image",
        action="append",
        metavar="IMG",
        default=None,
        help=(
            "an image for a vision model: a variable (PIL image, numpy array, bytes, path) "
            "or a file path (repeatable, in order)"
        ),
    )
    @cell_magic
    def llm(self, line: str, cell: str) -> None:
        """Ask the loaded model; the cell body is the prompt.

        The prompt goes through the model's chat template unless --raw (a base model,
        one without a chat template, always gets the text as is). The answer streams
        into this cell as the model wrote it (line breaks kept, any HTML shown as text;
        --markdown renders it as Markdown), followed by one line on where the prompt's
        tokens came from, the speed and why generation stopped. In a notebook a strip
        under the answer shows each prompt block: from memory, from disk, computed, or
        the tail; --blocks adds a map of every block, its words and why it was computed.
        Interrupting the kernel, or the Stop button under the answer (a --bg answer:
        the Stop button or the handle's `.cancel()`), cancels the request and keeps the
        partial answer; Copy copies the answer as written. `-o VAR`
        stores the `Completion` (with --bg: the `BackgroundAnswer` handle, whose
        `.result()` waits for it).

        --chat NAME continues a conversation kept in the kernel. Re-running a cell
        replaces its turn and every later one; the cell is recognised by the cell id
        JupyterLab sends, or, where there is none (nbclient, terminal), by identical
        source text.

        --image IMG (repeatable) shows a vision model pictures with the prompt, in the
        order given: IMG is a variable of this namespace when it names one (a PIL image,
        a numpy array HxWx3 of uint8, the bytes of an image file, or a path), else the
        path of an image file (PNG, JPEG, GIF, WebP, ...). A thumbnail of each is shown
        above the answer, and the block strip marks the blocks holding an image's tokens.
        With --chat the images go with that turn's question.
        """
        args = parse_options(self.llm, line, "%%llm")
        with one_line():
            text = cell_text(args, self.session.require_engine(), cell)
        if args.interpolate:
            text = interpolate(text, self.shell.user_ns)
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o needs a variable name, not {args.output!r}")
        # Read before anything is submitted: a bad image is one line, and no turn begins.
        images = read_images(args.image, self.shell.user_ns) if args.image else []
        with one_line():
            self.session.ask(
                args,
                text,
                images,
                source=f"%%llm {line}\n{cell}",
                out=self._out(),
                namespace=self.shell.user_ns,
                shell=self.shell,
            )

    @magic_arguments()
    @argument("action", nargs="?", choices=["clear"], help="`clear` empties the block store")
    @line_magic
    def llm_cache(self, line: str) -> None:
        """Show the block store: blocks held, restored, computed and evicted; bytes; records.

        In a notebook this is the store view widget (with a chart of restored, computed
        and evicted blocks over the session); in a terminal, a table. `%llm_cache clear`
        empties the store first.
        """
        args = parse_options(self.llm_cache, line, "%llm_cache")
        with one_line():
            self.session.show_cache(clear=args.action == "clear", out=self._out())

    @line_magic
    def llm_models(self, line: str = "") -> None:
        """List the models that load here without a download.

        One row per model: the name to give `%load_model`, where it was found (the
        default model, the Hugging Face hub cache, LM Studio's models folder), its kind
        (text, vision, or gguf: converted to MLX on first load), its size on disk, and
        whether a GGUF model was converted already. A table in a notebook, text in a
        terminal; below it, where the listing looked.
        """
        _no_arguments(line, "%llm_models")
        with one_line():
            show_models(self._out())

    @line_magic
    def llm_status(self, line: str = "") -> None:
        """Show the loaded model, its parallel slots, and active and queued requests (with a
        vision model: pictures encoded by its vision tower and feature-memo hits)."""
        _no_arguments(line, "%llm_status")
        self.session.show_status(self._out())


_MAGICS_KEY = "_mlx_nbengine_magics"


def load_ipython_extension(ipython: Any, *, engine_factory=None) -> LLMMagics:
    """Register the magics and the pre_run_cell hook on `ipython` (idempotent)."""
    existing = getattr(ipython, _MAGICS_KEY, None)
    if existing is not None:
        return existing
    magics = LLMMagics(ipython, engine_factory=engine_factory)
    ipython.register_magics(magics)
    ipython.register_magics(ServeMagics(ipython, magics))  # %llm_serve
    ipython.events.register("pre_run_cell", magics.pre_run_cell)
    setattr(ipython, _MAGICS_KEY, magics)
    return magics


def unload_ipython_extension(ipython: Any) -> None:
    """Close the engine and remove the hook (the magics stay registered but report no model)."""
    magics = getattr(ipython, _MAGICS_KEY, None)
    if magics is None:
        return
    magics.close_engine()
    ipython.events.unregister("pre_run_cell", magics.pre_run_cell)
    delattr(ipython, _MAGICS_KEY)

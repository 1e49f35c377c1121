"""The notebook face: `%load_model`, `%%llm`, `%llm_cache`, `%llm_status`, `%llm_models`,
`%unload_model`.

`%load_ext mlx_nbengine` registers these magics; the `Engine` then lives in the kernel
process until `%unload_model` (or the kernel's exit). The magics are thin: they declare
their options with IPython's `magic_arguments` (the docstrings are the help text), read
their line and cell with `mlx_nbengine.notebook.prompting`, submit to the engine, and follow
the request with `mlx_nbengine.notebook.streaming`, which renders through
`mlx_nbengine.notebook.render`.

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
raise `UsageError`: IPython prints one line, no traceback.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mlx_nbengine import _blas
from mlx_nbengine.errors import EngineError
from mlx_nbengine.models import list_local_models, sources
from mlx_nbengine.models.default import INSTALL_COMMAND
from mlx_nbengine.notebook.blockinfo import block_dicts, edit_dict, image_dicts, image_spans
from mlx_nbengine.notebook.chat import ChatBook, turn_key
from mlx_nbengine.notebook.livestore import LiveStores
from mlx_nbengine.notebook.loading import load_with_progress
from mlx_nbengine.notebook.prompting import (
    build_prompt,
    engine_options,
    interpolate,
    parse_options,
    parse_size,
    read_images,
    sampling_options,
)
from mlx_nbengine.notebook.render import (
    AnswerView,
    StripFeed,
    TerminalView,
    cache_rows,
    format_bytes,
    images_bundle,
    key_value_bundle,
    models_bundle,
    models_text,
)
from mlx_nbengine.notebook.serving import ServeMagics
from mlx_nbengine.notebook.streaming import (
    CANCEL_GRACE_S,
    BackgroundAnswer,
    GenerationInterrupted,
    follow,
    short_error,
)

__all__ = [
    "BackgroundAnswer",
    "GenerationInterrupted",
    "LLMMagics",
    "LLMSession",
    "interpolate",
    "load_ipython_extension",
    "parse_size",
    "unload_ipython_extension",
]

# -- session state -------------------------------------------------------------------------


@dataclass
class LLMSession:
    """What the extension keeps in the kernel between cells (main thread owns it)."""

    engine: Any = None
    model: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    chats: ChatBook = field(default_factory=ChatBook)
    background: list[BackgroundAnswer] = field(default_factory=list)  # running ones
    background_count: int = 0
    # From IPython's pre_run_cell event: the executing cell's id (None outside JupyterLab)
    # and source, and how many chat calls that cell run made so far.
    cell_id: str | None = None
    cell_source: str = ""
    chat_calls: int = 0
    # The loaded model's record kind per layer, for the block map (asked once per load).
    layer_kinds: list[str] | None = None
    # The `%llm_cache` views of the loaded engine, redrawn as requests finish.
    stores: LiveStores = field(default_factory=LiveStores)
    # The `%llm_serve` endpoint on the loaded engine (`notebook.serving`), or None.
    server: Any = None

    def next_turn_key(self, source: str) -> str:
        """Key of the next chat call in the running cell (`source` where IPython gave none)."""
        key = turn_key(
            cell_id=self.cell_id, source=self.cell_source or source, index=self.chat_calls
        )
        self.chat_calls += 1
        return key


# Readable names of models `%load_model` knows by a short name.
_MODEL_TITLES = {"default": "Gemma 3 270M"}


def model_label(name: str, loaded: Any) -> str:
    """`name` as given to `%load_model`, with what it is: "default (Gemma 3 270M, gemma3_text)"."""
    details = [_MODEL_TITLES[name]] if name in _MODEL_TITLES else []
    model_type = getattr(loaded, "model_type", None)
    if isinstance(model_type, str) and model_type:
        details.append(model_type)
    if getattr(loaded, "kind", None) == "vision":
        details.append("vision")
    return f"{name} ({', '.join(details)})" if details else name


def _widgets() -> Any:
    """The widgets module, or None where it cannot load (then the magics show text only)."""
    try:
        from mlx_nbengine.notebook import widgets
    except (ImportError, OSError):  # anywidget missing, or the widgets' files
        return None
    return widgets


def _decoder(engine: Any) -> Any:
    """The loaded model's ``decode`` (token ids -> text), for block words; None without one."""
    tokenizer = getattr(getattr(engine, "model", None), "tokenizer", None)
    decode = getattr(tokenizer, "decode", None)
    return decode if callable(decode) else None


def _special_ids(engine: Any) -> frozenset[int]:
    """The tokenizer's special token ids (``<bos>``...), left out of block words."""
    tokenizer = getattr(getattr(engine, "model", None), "tokenizer", None)
    ids = getattr(tokenizer, "all_special_ids", None)
    return frozenset(int(t) for t in ids) if ids else frozenset()


def _image_dicts(images: list[Any]) -> list[dict]:
    """The widgets' image dicts (64-px thumbnails); [] where they cannot be drawn."""
    if _widgets() is None:
        return []
    return image_dicts(images)


def _blas_hint() -> str | None:
    """One line for a Linux CPU kernel whose MLX was imported before us (see `_blas`)."""
    status = _blas.blas_status()
    if status is None or status.active or "imported first" not in status.reason:
        return None
    mx = sys.modules.get("mlx.core")
    if mx is not None and mx.default_device() == mx.gpu:
        return None  # the engine runs on the GPU: the CPU BLAS does not matter
    return (
        "hint: mlx was imported before mlx_nbengine, so CPU prefill runs on a slow BLAS; "
        "restart the kernel and run `%load_ext mlx_nbengine` before importing mlx "
        "(~30x faster prefill)"
    )


# -- the magics ------------------------------------------------------------------------------


def _default_engine_factory(model: str, *, progress: Any = None, **options: Any) -> Any:
    # Lazy, and the BLAS bound first, for a kernel whose MLX arrived before this module
    # (see _blas); a no-op afterwards.
    _blas.ensure_fast_blas()
    _blas.say_reference_blas(claimed=True)  # %load_model shows its own hint (_blas_hint)
    from mlx_nbengine.engine import Engine

    return Engine.load(model, progress=progress, **options)


def _looked_in(found: list[Any]) -> str:
    """Where `%llm_models` looked, in words (and how to get the default model if absent)."""
    folders = [str(f) for f in sources.lmstudio_model_dirs()]
    if not folders:
        lmstudio = "LM Studio's models folder (none here: no ~/.lmstudio/models)"
    elif len(folders) == 1:
        lmstudio = f"LM Studio's models folder ({folders[0]})"
    else:
        lmstudio = f"LM Studio's models folders ({', '.join(folders)})"
    text = f"looked in the Hugging Face cache ({sources.hub_cache()}) and {lmstudio}"
    if not any(getattr(m, "source", None) == "default" for m in found):
        text += f"; the default model needs `{INSTALL_COMMAND}`"
    return text


@magics_class
class LLMMagics(Magics):
    """Magics of mlx_nbengine; one instance per shell, holding the `LLMSession`.

    Longer than the package's other classes (about 550 lines) on purpose: IPython registers
    magics as the methods of one `Magics` class, and each magic's argument table and help
    text (about 180 of those lines) sit on its method, where ``%magic?`` reads them. The
    work is elsewhere: loading.py (the load's wait), prompting.py, streaming.py (following
    an answer), render.py, livestore.py, serving.py (%llm_serve, its own class)."""

    def __init__(self, shell=None, *, engine_factory=None) -> None:
        super().__init__(shell)
        self.session = LLMSession()
        # Builds the engine for %load_model; tests inject a fake to isolate parsing.
        self.engine_factory = engine_factory or _default_engine_factory

    # -- events --------------------------------------------------------------------------

    def pre_run_cell(self, info: Any) -> None:
        """IPython `pre_run_cell` hook: remember which cell runs (for chat turn keys)."""
        self.session.cell_id = getattr(info, "cell_id", None)
        self.session.cell_source = getattr(info, "raw_cell", "") or ""
        self.session.chat_calls = 0

    # -- helpers -------------------------------------------------------------------------

    def _require_engine(self) -> Any:
        if self.session.engine is None:
            raise UsageError(
                "no model is loaded; run `%load_model default` (or a model directory, "
                ".gguf file or ORG/NAME; `%llm_models` lists those here) first"
            )
        return self.session.engine

    def _updates_in_place(self) -> bool:
        # A kernel's front end redraws a display in place; a terminal prints every update.
        return hasattr(self.shell, "kernel")

    def _display(self, obj: Any, **kwargs: Any) -> Any:
        """Show `obj`: a mimebundle dict (sent raw), or an object IPython formats (a widget)."""
        # Looked up at each call: a shell (or a test) may replace IPython.display.display.
        from IPython.display import display

        return display(obj, raw=isinstance(obj, dict), **kwargs)

    def close_engine(self) -> str | None:
        """Close the engine (and its scratch file); return the model name it served."""
        session = self.session
        engine, model = session.engine, session.model
        session.engine, session.model, session.options = None, None, {}
        session.layer_kinds = None
        session.stores.clear()
        if session.server is not None:  # %llm_serve stops before its engine closes
            session.server.stop()
            session.server = None
        if engine is None:
            return None
        for handle in session.background:
            if not handle.done():
                handle.cancel()
        engine.close()
        for handle in session.background:
            handle.join(timeout=CANCEL_GRACE_S)
        session.background.clear()
        session.chats.clear()
        return model

    # -- %load_model ---------------------------------------------------------------------

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
        previous = self.close_engine()
        if previous is not None:
            self._display({"text/plain": f"unloaded {previous}"})
        model = args.model if args.model == "default" else os.path.expanduser(args.model)
        engine = self._load_with_progress(model, options, revision=args.revision)
        self.session.engine = engine
        self.session.model = args.model
        self.session.options = options
        note = getattr(engine, "store_note", None)
        if isinstance(note, str) and note:
            self._display({"text/plain": note})
        hint = _blas_hint()
        if hint is not None:
            self._display({"text/plain": hint})

    def _load_with_progress(
        self, model: str, options: dict[str, Any], *, revision: str | None = None
    ) -> Any:
        return load_with_progress(
            self.engine_factory,
            model,
            options,
            revision=revision,
            display=self._display,
            live=self._updates_in_place(),
        )

    # -- %unload_model -------------------------------------------------------------------

    @line_magic
    def unload_model(self, line: str = "") -> None:
        """Stop the engine and free the model, its block store and the scratch file.

        Running requests are cancelled and the named conversations are forgotten.
        """
        if line.strip():
            raise UsageError("%unload_model takes no arguments")
        model = self.close_engine()
        if model is None:
            raise UsageError("no model is loaded; nothing to unload")
        self._display({"text/plain": f"unloaded {model}; its scratch file is removed"})

    # -- %%llm -----------------------------------------------------------------------------

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
        engine = self._require_engine()
        text = self._cell_text(args, engine, cell)
        # Read before anything is submitted: a bad image is one line, and no turn begins.
        images = read_images(args.image, self.shell.user_ns) if args.image else []
        request, chat, sent = self._submit(args, engine, text, images, f"%%llm {line}\n{cell}")
        thumbs = _image_dicts(sent) if sent else []
        if images:
            # The pictures above the answer, as the model got them (in order).
            self._display(images_bundle(images))
        view = self._answer_view(args, engine, request, thumbs)
        after = (
            (lambda completion: self._show_block_map(engine, completion, images=thumbs))
            if args.blocks
            else None
        )
        if args.bg:
            self._start_background(request, view, args, chat, after=after)
            return None
        try:
            completion, interrupted = follow(request, view, turn=chat)
        except EngineError as exc:
            raise UsageError(short_error(exc)) from None
        self.session.stores.refresh(engine)
        if args.output is not None:
            self.shell.user_ns[args.output] = completion
        if after is not None and completion is not None:
            after(completion)
        self._warn_saving(engine)
        if interrupted:
            raise GenerationInterrupted.of(completion)
        return None

    def _cell_text(self, args: Any, engine: Any, cell: str) -> str:
        """The prompt text of a `%%llm` cell, its options checked (`args.raw` set for a
        model without a chat template)."""
        text = cell.strip()
        if not text:
            raise UsageError("the cell is empty; write the prompt below the %%llm line")
        if args.raw and (args.chat or args.system):
            raise UsageError("--raw sends text without the chat template; drop --chat/--system")
        if not args.raw and not getattr(engine.model, "has_chat_template", True):
            if args.chat or args.system:
                raise UsageError(
                    "this model has no chat template (a base model), so --chat and --system "
                    "cannot work; drop them to send the cell as plain text"
                )
            args.raw = True  # a base model continues the text it is given
        if args.interpolate:
            text = interpolate(text, self.shell.user_ns)
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o needs a variable name, not {args.output!r}")
        return text

    def _submit(
        self, args: Any, engine: Any, text: str, images: list[Any], source: str
    ) -> tuple[Any, Any, list[Any]]:
        """Submit the cell's prompt: (the request, its chat turn or None, the images sent)."""
        conversation = self.session.chats.get(args.chat) if args.chat else None
        key = None if conversation is None else self.session.next_turn_key(source)
        prompt, chat = build_prompt(
            text,
            raw=args.raw,
            system=args.system,
            conversation=conversation,
            key=key,
            images=images,
        )
        # A conversation sends the images of all its turns (their parts are in the messages).
        sent = conversation.images() if conversation is not None else images
        # Only a request with images names them: engines (and fakes) before images differ.
        extra: dict[str, Any] = {"images": [item.image for item in sent]} if sent else {}
        if self._watched():
            # Someone sees the strip: prefill in steps of one block, so it fills block by
            # block (slower than long steps; a headless run keeps those).
            extra["live_blocks"] = True
        try:
            request = engine.submit(prompt, **sampling_options(args), **extra)
        except (EngineError, ValueError) as exc:
            if chat is not None:
                chat.abandon()
            raise UsageError(short_error(exc)) from None
        return request, chat, sent

    def _answer_view(self, args: Any, engine: Any, request: Any, thumbs: list[dict]) -> Any:
        """The answer's view (widgets in a front end, text in a terminal), shown."""
        if self._updates_in_place():
            view = AnswerView(
                title=args.chat or "",
                markdown=args.markdown,
                strip=self._strip_feed(engine, request, show_edit=not args.blocks, images=thumbs),
            )
        else:
            view = TerminalView(title=args.chat or "")
        if view.strip is not None and not args.bg:
            # The main thread follows this answer: the front end's Stop interrupts the kernel.
            view.strip.stoppable("interrupt", request.cancel)
        view.show()
        return view

    def _watched(self) -> bool:
        """Whether a person watches this cell's strip: a front end that draws widgets and
        names its cells (JupyterLab, Notebook 7); nbclient and nbconvert send no cell id."""
        return (
            self._updates_in_place() and _widgets() is not None and self.session.cell_id is not None
        )

    def _warn_saving(self, engine: Any) -> None:
        # Once, in the first cell to finish after saving to the store turned off.
        warning = getattr(engine, "store_warning", None)
        line = warning() if callable(warning) else None
        if isinstance(line, str) and line:
            self._display({"text/plain": f"warning: {line}"})

    def _strip_feed(
        self, engine: Any, request: Any, *, show_edit: bool, images: list[dict] | None = None
    ) -> StripFeed | None:
        """The block strip for `request`, all its blocks pending; None without widgets.
        With `show_edit` false (a block map follows, with its own) it marks no edit banner;
        `images` are the request's image dicts (`blockinfo.image_dicts`)."""
        block_size = getattr(engine, "block_size", None)
        tokens = getattr(request, "prompt_tokens", None)
        widgets = _widgets()
        if widgets is None or not isinstance(block_size, int) or tokens is None:
            return None
        strip = widgets.BlockStrip(
            n_blocks=math.ceil(len(tokens) / block_size),
            block_size=block_size,
            prompt_tokens=len(tokens),
            show_edit=show_edit,
            images=list(images or []),
        )
        return StripFeed(
            strip,
            tokens=tokens,
            decode=_decoder(engine),
            special=_special_ids(engine),
            block_size=block_size,
        )

    def _show_block_map(
        self, engine: Any, completion: Any, *, images: list[dict] | None = None
    ) -> None:
        """`--blocks`: every prompt block of `completion`, its words, source and reason
        (and, with `images`, which blocks hold which image)."""
        widgets = _widgets()
        if widgets is None:
            return
        report, tokens = completion.report, completion.prompt_tokens
        block_size = int(getattr(engine, "block_size", 0) or 0)
        decode, special = _decoder(engine), _special_ids(engine)
        edit_at = getattr(report, "edit_at", None)
        block_map = widgets.BlockMap(
            blocks=block_dicts(
                report.blocks,
                decode=decode,
                tokens=tokens,
                special=special,
                spans=image_spans(report),
            ),
            edit=(
                None
                if edit_at is None
                else edit_dict(
                    edit_at, tokens, decode=decode, block_size=block_size, special=special
                )
            ),
            block_size=block_size,
            prompt_tokens=len(tokens),
            layer_kinds=self._layer_kinds(engine),
            images=list(images or []),
        )
        if self._updates_in_place():
            self._display(block_map)
        else:
            self._display({"text/plain": block_map.text()})

    def _layer_kinds(self, engine: Any) -> list[str]:
        """The model's record kind per layer ("kv", "window", "state"); [] if unknown."""
        session = self.session
        if session.layer_kinds is None:
            session.layer_kinds = [str(k) for k in getattr(engine, "layer_kinds", ())]
        return session.layer_kinds

    def _start_background(self, request, view, args, chat, *, after=None) -> BackgroundAnswer:
        session = self.session
        session.background_count += 1
        label = args.output or args.chat or f"bg{session.background_count}"
        engine, stores = session.engine, session.stores

        def finished(completion: Any) -> None:
            if after is not None:
                after(completion)
            stores.refresh(engine)

        handle = BackgroundAnswer(request, view, label=label, turn=chat, after=finished)
        if view.strip is not None:
            # The main thread is free: the Stop button's message reaches the kernel.
            view.strip.stoppable("message", handle.cancel)
        # Finished handles live on in the user's variables, not here.
        session.background = [h for h in session.background if not h.done()]
        session.background.append(handle)
        if args.output is not None:
            self.shell.user_ns[args.output] = handle
        handle.start(self.shell)
        return handle

    # -- %llm_cache and %llm_status ---------------------------------------------------------

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
        engine = self._require_engine()
        if args.action == "clear":
            clear = getattr(engine, "clear_cache", None)
            if clear is None:
                raise UsageError(
                    "this engine cannot empty its store while loaded; `%unload_model` then "
                    "`%load_model` starts with an empty one"
                )
            clear()
        title = "block store (cleared)" if args.action == "clear" else "block store"
        view = engine.cache_view()
        widgets = _widgets()
        if self._updates_in_place() and widgets is not None:
            if args.action == "clear":
                self._display({"text/plain": "block store cleared"})
            store_view = widgets.StoreView(view=view)
            self.session.stores.add(store_view)
            self._display(store_view)
            return
        model = view.get("model")
        self._display(key_value_bundle(f"{title}: {model}" if model else title, cache_rows(view)))

    @line_magic
    def llm_models(self, line: str = "") -> None:
        """List the models that load here without a download.

        One row per model: the name to give `%load_model`, where it was found (the
        default model, the Hugging Face hub cache, LM Studio's models folder), its kind
        (text, vision, or gguf: converted to MLX on first load), its size on disk, and
        whether a GGUF model was converted already. A table in a notebook, text in a
        terminal; below it, where the listing looked.
        """
        if line.strip():
            raise UsageError("%llm_models takes no arguments")
        try:
            found = list_local_models()
            looked_in = _looked_in(found)
        except (EngineError, OSError) as exc:
            raise UsageError(f"could not list the models: {short_error(exc)}") from None
        if self._updates_in_place():
            self._display(models_bundle(found, looked_in=looked_in))
        else:
            self._display({"text/plain": models_text(found, looked_in=looked_in)})

    @line_magic
    def llm_status(self, line: str = "") -> None:
        """Show the loaded model, its parallel slots, and active and queued requests (with a
        vision model: pictures encoded by its vision tower and feature-memo hits)."""
        if line.strip():
            raise UsageError("%llm_status takes no arguments")
        session = self.session
        if session.engine is None:
            self._display({"text/plain": "no model loaded; run `%load_model default`"})
            return
        stats = session.engine.stats()
        running = sum(1 for handle in session.background if not handle.done())
        loaded = getattr(session.engine, "model", None)
        rows: list[tuple[str, Any]] = [("model", model_label(session.model or "-", loaded))]
        for name, value in session.options.items():
            if name == "store":
                rows.append(("block store", "on" if value else "off"))
                continue
            if name in ("ranks", "hosts", "shard"):
                continue  # rank_rows, from the engine
            shown = format_bytes(value) if name == "disk_budget" else value
            rows.append((name.replace("_", " "), shown))
        rows += [
            ("active requests", stats.get("active", "-")),
            ("queued requests", stats.get("queued", "-")),
            ("background cells running", running),
            ("failed requests", stats.get("failures", "-")),
            ("shared prefill steps", stats.get("group_prefills", "-")),
            ("conversations", ", ".join(session.chats.names()) or "-"),
        ]
        if stats.get("persistent") or stats.get("store_note"):
            rows.append(("persistent store", "yes" if stats.get("persistent") else "no"))
        if stats.get("store_note"):
            rows.append(("store note", stats["store_note"]))
        if stats.get("saving") is False:
            rows.append(("saving", stats.get("saving_error") or "off"))
        if "sharded" in stats:
            rows += rank_rows(stats["sharded"])
        if "vision_encodes" in stats:  # a vision model
            rows += [
                ("pictures encoded", stats["vision_encodes"]),
                ("feature memo hits", stats.get("feature_memo_hits", 0)),
                ("feature memo", format_bytes(stats.get("feature_memo_bytes", 0))),
            ]
        self._display(key_value_bundle("mlx_nbengine", rows))


def rank_rows(sharded: dict[str, Any]) -> list[tuple[str, Any]]:
    """`%llm_status`'s rows of a sharded model: ranks, hosts, shard, each rank's store."""
    rows: list[tuple[str, Any]] = [
        ("ranks", sharded.get("ranks")),
        ("hosts", ", ".join(sharded.get("hosts") or [])),
        ("shard", sharded.get("shard") or "-"),
    ]
    own = sharded.get("rank0_store") or {}
    rows.append(
        (
            "rank 0",
            f"this kernel; {own.get('blocks_held', 0)} blocks, "
            f"{format_bytes(own.get('bytes_held', 0))}",
        )
    )
    for worker in sharded.get("workers") or []:
        store = worker.get("store") or {}
        state = "running" if worker.get("running") else "stopped"
        figures = (
            f"{store.get('blocks_held', 0)} blocks, {format_bytes(store.get('bytes_held', 0))}"
            if store
            else "no answer"
        )
        rows.append(
            (f"rank {worker['rank']}", f"{worker['host']} pid {worker['pid']} {state}; {figures}")
        )
    if sharded.get("error"):
        rows.append(("rank error", sharded["error"]))
    return rows


# -- extension entry points ---------------------------------------------------------------------

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

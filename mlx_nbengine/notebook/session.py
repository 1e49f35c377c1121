"""The notebook session without IPython: what the magics keep between cells, and what they do.

`mlx_nbengine.notebook.magics` parses a magic's line and calls one operation here; a plain
Python program (or a test) can call them the same way, with no shell.

Terms:

- *session* (`LLMSession`): the engine, the name and options of the loaded model, the named
  conversations, the background requests, the shown store views and the `%llm_serve`
  server. The kernel's main thread owns it.
- *output* (`Output`): where an operation shows things: `show(obj, **kwargs)` (IPython's
  ``display``: a dict is a raw mimebundle, anything else an object it formats) and `live`,
  whether the front end redraws a display in place (a kernel's front end; a terminal prints
  every update and gets text instead of widgets).
- *watched*: a person sees the cell's strip: a live output that draws widgets, in a front
  end that names its cells (JupyterLab, Notebook 7); nbclient and nbconvert send no cell id.

Errors the user can fix raise `mlx_nbengine.errors.SessionError` (one line); the magics
turn it into IPython's `UsageError`. An interrupted answer raises `GenerationInterrupted`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_nbengine import _blas
from mlx_nbengine.errors import EngineError, SessionError
from mlx_nbengine.models import list_local_models, sources
from mlx_nbengine.models.default import INSTALL_COMMAND
from mlx_nbengine.notebook import cellview
from mlx_nbengine.notebook.chat import ChatBook, turn_key
from mlx_nbengine.notebook.imagesview import images_bundle
from mlx_nbengine.notebook.livestore import LiveStores
from mlx_nbengine.notebook.loading import load_with_progress
from mlx_nbengine.notebook.prompting import build_prompt, sampling_options
from mlx_nbengine.notebook.streaming import (
    CANCEL_GRACE_S,
    BackgroundAnswer,
    GenerationInterrupted,
    follow,
    short_error,
)
from mlx_nbengine.notebook.tables import cache_rows, key_value_bundle, models_bundle, models_text
from mlx_nbengine.notebook.words import format_bytes

__all__ = [
    "LLMSession",
    "Output",
    "default_engine_factory",
    "model_label",
    "rank_rows",
    "show_models",
]

NO_MODEL = (
    "no model is loaded; run `%load_model default` (or a model directory, "
    ".gguf file or ORG/NAME; `%llm_models` lists those here) first"
)

# Readable names of models `%load_model` knows by a short name.
_MODEL_TITLES = {"default": "Gemma 3 270M"}


@dataclass(frozen=True)
class Output:
    """Where an operation shows things (see the module's terms)."""

    show: Callable[..., Any]
    live: bool

    def line(self, text: str) -> Any:
        return self.show({"text/plain": text})


def model_label(name: str, loaded: Any) -> str:
    """`name` as given to `%load_model`, with what it is: "default (Gemma 3 270M, gemma3_text)"."""
    details = [_MODEL_TITLES[name]] if name in _MODEL_TITLES else []
    model_type = getattr(loaded, "model_type", None)
    if isinstance(model_type, str) and model_type:
        details.append(model_type)
    if getattr(loaded, "modality", None) == "vision":
        details.append("vision")
    return f"{name} ({', '.join(details)})" if details else name


def blas_hint() -> str | None:
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
        f"({_blas.REFERENCE_COST})"
    )


def default_engine_factory(model: str, *, progress: Any = None, **options: Any) -> Any:
    # Lazy, and the BLAS bound first, for a kernel whose MLX arrived before this module
    # (see _blas); a no-op afterwards.
    _blas.ensure_fast_blas()
    _blas.say_reference_blas(claimed=True)  # %load_model shows its own hint (blas_hint)
    from mlx_nbengine.engine import Engine

    return Engine.load(model, progress=progress, **options)


def looked_in(found: list[Any]) -> str:
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


def show_models(out: Output) -> None:
    """`%llm_models`: the models that load here without a download, and where it looked."""
    try:
        found = list_local_models()
        where = looked_in(found)
    except (EngineError, OSError) as exc:
        raise SessionError(f"could not list the models: {short_error(exc)}") from None
    if out.live:
        out.show(models_bundle(found, looked_in=where))
    else:
        out.line(models_text(found, looked_in=where))


def cell_text(args: Any, engine: Any, cell: str) -> str:
    """The prompt text of a `%%llm` cell, its options checked (`args.raw` set for a model
    without a chat template)."""
    text = cell.strip()
    if not text:
        raise SessionError("the cell is empty; write the prompt below the %%llm line")
    if args.raw and (args.chat or args.system):
        raise SessionError("--raw sends text without the chat template; drop --chat/--system")
    if not args.raw and not getattr(engine.model, "has_chat_template", True):
        if args.chat or args.system:
            raise SessionError(
                "this model has no chat template (a base model), so --chat and --system "
                "cannot work; drop them to send the cell as plain text"
            )
        args.raw = True  # a base model continues the text it is given
    return text


@dataclass
class LLMSession:
    """What the extension keeps in the kernel between cells (main thread owns it), and the
    operations of the magics on it."""

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

    def cell_started(self, *, cell_id: str | None, source: str) -> None:
        """A cell starts to run (for chat turn keys)."""
        self.cell_id, self.cell_source, self.chat_calls = cell_id, source, 0

    def next_turn_key(self, source: str) -> str:
        """Key of the next chat call in the running cell (`source` where IPython gave none)."""
        key = turn_key(
            cell_id=self.cell_id, source=self.cell_source or source, index=self.chat_calls
        )
        self.chat_calls += 1
        return key

    def require_engine(self) -> Any:
        if self.engine is None:
            raise SessionError(NO_MODEL)
        return self.engine

    # -- loading -------------------------------------------------------------------------

    def load(
        self,
        factory: Any,
        name: str,
        model: str,
        options: dict[str, Any],
        *,
        revision: str | None,
        out: Output,
    ) -> None:
        """`%load_model`: replace the loaded model by `model` (`name` as the user wrote it)."""
        previous = self.close_engine()
        if previous is not None:
            out.line(f"unloaded {previous}")
        engine = load_with_progress(
            factory, model, options, revision=revision, display=out.show, live=out.live
        )
        self.engine, self.model, self.options = engine, name, options
        note = getattr(engine, "store_note", None)
        if isinstance(note, str) and note:
            out.line(note)
        hint = blas_hint()
        if hint is not None:
            out.line(hint)

    def unload(self, out: Output) -> None:
        """`%unload_model`."""
        model = self.close_engine()
        if model is None:
            raise SessionError("no model is loaded; nothing to unload")
        out.line(f"unloaded {model}; its scratch file is removed")

    def close_engine(self) -> str | None:
        """Close the engine (and its scratch file); return the model name it served."""
        engine, model = self.engine, self.model
        self.engine, self.model, self.options = None, None, {}
        self.layer_kinds = None
        self.stores.clear()
        if self.server is not None:  # %llm_serve stops before its engine closes
            self.server.stop()
            self.server = None
        if engine is None:
            return None
        for handle in self.background:
            if not handle.done():
                handle.cancel()
        engine.close()
        for handle in self.background:
            handle.join(timeout=CANCEL_GRACE_S)
        self.background.clear()
        self.chats.clear()
        return model

    # -- %%llm ---------------------------------------------------------------------------

    def ask(
        self,
        args: Any,
        text: str,
        images: list[Any],
        *,
        source: str,
        out: Output,
        namespace: dict[str, Any],
        shell: Any,
    ) -> None:
        """`%%llm`: submit `text` (checked by `cell_text`) with `images`, show the answer and
        follow it (`args.bg`: on its own thread, the handle in ``namespace[args.output]``)."""
        engine = self.require_engine()
        request, chat, sent = self._submit(args, engine, text, images, source, out)
        thumbs = cellview.image_thumbs(sent) if sent else []
        if images:
            out.show(images_bundle(images))  # the pictures above the answer, in order
        view = cellview.answer_view(args, engine, request, thumbs, out)
        after = None
        if args.blocks:

            def after(completion: Any) -> None:
                kinds = self.kinds_of(engine)
                cellview.show_block_map(engine, completion, kinds, images=thumbs, out=out)

        if args.bg:
            self._start_background(request, view, args, chat, after, namespace, shell)
            return
        try:
            completion, interrupted = follow(request, view, turn=chat)
        except EngineError as exc:
            raise SessionError(short_error(exc)) from None
        self.stores.refresh(engine)
        if args.output is not None:
            namespace[args.output] = completion
        if after is not None and completion is not None:
            after(completion)
        cellview.warn_saving(engine, out)
        if interrupted:
            raise GenerationInterrupted.of(completion)

    def watched(self, out: Output) -> bool:
        """Whether a person watches the running cell's strip (see the module's terms)."""
        return out.live and cellview.widgets() is not None and self.cell_id is not None

    def _submit(self, args, engine, text, images, source, out) -> tuple[Any, Any, list[Any]]:
        """Submit the cell's prompt: (the request, its chat turn or None, the images sent)."""
        conversation = self.chats.get(args.chat) if args.chat else None
        key = None if conversation is None else self.next_turn_key(source)
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
        if self.watched(out):
            # Someone sees the strip: prefill in steps of one block, so it fills block by
            # block (slower than long steps; a headless run keeps those).
            extra["live_blocks"] = True
        try:
            request = engine.submit(prompt, **sampling_options(args), **extra)
        except (EngineError, ValueError) as exc:
            if chat is not None:
                chat.abandon()
            raise SessionError(short_error(exc)) from None
        return request, chat, sent

    def kinds_of(self, engine: Any) -> list[str]:
        """The model's record kind per layer ("kv", "window", "state"); [] if unknown."""
        if self.layer_kinds is None:
            self.layer_kinds = [str(k) for k in getattr(engine, "layer_kinds", ())]
        return self.layer_kinds

    def _start_background(self, request, view, args, chat, after, namespace, shell) -> None:
        self.background_count += 1
        label = args.output or args.chat or f"bg{self.background_count}"
        engine, stores = self.engine, self.stores

        def finished(completion: Any) -> None:
            if after is not None:
                after(completion)
            stores.refresh(engine)

        handle = BackgroundAnswer(request, view, label=label, turn=chat, after=finished)
        if view.strip is not None:
            # The main thread is free: the Stop button's message reaches the kernel.
            view.strip.stoppable("message", handle.cancel)
        # Finished handles live on in the user's variables, not here.
        self.background = [h for h in self.background if not h.done()]
        self.background.append(handle)
        if args.output is not None:
            namespace[args.output] = handle
        handle.start(shell)

    # -- %llm_cache and %llm_status --------------------------------------------------------

    def show_cache(self, *, clear: bool, out: Output) -> None:
        """`%llm_cache [clear]`: the store view (a widget when live), emptied first if `clear`."""
        engine = self.require_engine()
        if clear:
            empty = getattr(engine, "clear_cache", None)
            if empty is None:
                raise SessionError(
                    "this engine cannot empty its store while loaded; `%unload_model` then "
                    "`%load_model` starts with an empty one"
                )
            empty()
        title = "block store (cleared)" if clear else "block store"
        view = engine.cache_view()
        widgets = cellview.widgets()
        if out.live and widgets is not None:
            if clear:
                out.line("block store cleared")
            store_view = widgets.StoreView(view=view)
            self.stores.add(store_view)
            out.show(store_view)
            return
        model = view.get("model")
        out.show(key_value_bundle(f"{title}: {model}" if model else title, cache_rows(view)))

    def show_status(self, out: Output) -> None:
        """`%llm_status`: the loaded model, its options and the engine's figures."""
        if self.engine is None:
            out.line("no model loaded; run `%load_model default`")
            return
        out.show(key_value_bundle("mlx_nbengine", self.status_rows()))

    def status_rows(self) -> list[tuple[str, Any]]:
        """`%llm_status`'s rows of the loaded engine."""
        stats = self.engine.stats()
        running = sum(1 for handle in self.background if not handle.done())
        loaded = getattr(self.engine, "model", None)
        rows: list[tuple[str, Any]] = [("model", model_label(self.model or "-", loaded))]
        rows += option_rows(self.options)
        rows += [
            ("active requests", stats.get("active", "-")),
            ("queued requests", stats.get("queued", "-")),
            ("background cells running", running),
            ("failed requests", stats.get("failures", "-")),
            ("shared prefill steps", stats.get("group_prefills", "-")),
            ("conversations", ", ".join(self.chats.names()) or "-"),
        ]
        return rows + stats_rows(stats)


def option_rows(options: dict[str, Any]) -> list[tuple[str, Any]]:
    """`%llm_status`'s rows of the options the model was loaded with."""
    rows: list[tuple[str, Any]] = []
    for name, value in options.items():
        if name == "store":
            rows.append(("block store", "on" if value else "off"))
            continue
        if name in ("ranks", "hosts", "shard"):
            continue  # rank_rows, from the engine
        shown = format_bytes(value) if name == "disk_budget" else value
        rows.append((name.replace("_", " "), shown))
    return rows


def stats_rows(stats: dict[str, Any]) -> list[tuple[str, Any]]:
    """`%llm_status`'s rows of the store, the ranks and the vision tower, where present."""
    rows: list[tuple[str, Any]] = []
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
    return rows


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

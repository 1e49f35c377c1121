"""The notebook face: `%load_model`, `%%llm`, `%llm_cache`, `%llm_status`, `%unload_model`.

`%load_ext mlx_nbengine` registers these magics; the `Engine` then lives in the kernel
process until `%unload_model` (or the kernel's exit). The magics are thin: they parse
their line with IPython's `magic_arguments` (the docstrings are the help text), submit
to the engine, and render through `mlx_nbengine.render`.

Terms:

- *session* (`LLMSession`): what the extension keeps between cells: the engine, the name
  and options of the loaded model, the named conversations and the background requests.
- *foreground request*: a plain `%%llm` cell. The cell stays busy; the kernel's main
  thread reads the request's events and updates one display handle about every 100 ms,
  so the output lands in the executing cell, nbclient records it, and the kernel's
  interrupt (a `KeyboardInterrupt` on the main thread) cancels the request. The partial
  answer stays, marked interrupted, and ``-o`` still receives it; the cell then ends with
  `KeyboardInterrupt` like any interrupted cell, so "Run all" stops there.
- *background request*: `%%llm --bg`. The cell returns at once with a `BackgroundAnswer`
  handle; a thread per request renders into the display created in the original cell,
  with ipykernel's `set_thread_parent` so that every update carries that cell's parent
  header. Several run at once (up to the engine's `parallel` slots, then they queue).
  nbclient and nbconvert only record output that arrives while a cell runs, so in a
  headless run a background answer is complete only if a later cell waits for it
  (``handle.result()``).

Errors the user can fix (no model loaded, an unknown option, an empty cell, a model that
fails to load, a prompt the engine rejects) raise `UsageError`: IPython prints one line,
no traceback.
"""

from __future__ import annotations

import os
import queue
import re
import string
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from mlx_nbengine.chat import ChatBook, Conversation, PendingTurnError, Turn, turn_key
from mlx_nbengine.errors import EngineError
from mlx_nbengine.render import (
    AnswerView,
    TerminalView,
    format_bytes,
    key_value_bundle,
    progress_bundle,
    stats_rows,
)

__all__ = [
    "BackgroundAnswer",
    "LLMMagics",
    "LLMSession",
    "interpolate",
    "load_ipython_extension",
    "parse_size",
    "unload_ipython_extension",
]

# How long a cancelled request may take to deliver its final event before we stop waiting.
_CANCEL_GRACE_S = 10.0


# -- small parsers -------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """Parse a byte size: '4GB' (decimal), '4GiB' or '4G' (binary), '512M', '1000000'."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise UsageError(
            f"cannot read the size {text!r}; write a number with an optional unit, "
            "like 4GB, 512MiB or 2G"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def interpolate(text: str, namespace: dict[str, Any]) -> str:
    """Substitute ``{name}`` (and ``{name.attr}``, ``{name[0]}``, format specs) from `namespace`.

    ``{{`` and ``}}`` stay literal braces. A missing name is a `UsageError`.
    """
    try:
        return string.Formatter().vformat(text, (), namespace)
    except KeyError as exc:
        raise UsageError(
            f"--interpolate: {exc.args[0]!r} is not defined; define it first, "
            "or write {{ and }} for literal braces"
        ) from None
    except (ValueError, IndexError, AttributeError) as exc:
        raise UsageError(f"--interpolate: {exc}; write {{{{ and }}}} for literal braces") from None


def _parse(func, line: str, magic: str):
    # posix splitting, so `--system "Be brief."` arrives without its quotes.
    try:
        return func.parser.parse_args(arg_split(line, posix=True))
    except UsageError as exc:
        raise UsageError(f"{exc}. See `{magic}?` for the options.") from None
    except ValueError as exc:  # shlex: an unclosed quote
        raise UsageError(f"cannot read the options ({exc}); close the quotes") from None


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


class BackgroundAnswer:
    """Handle of a `%%llm --bg` request, returned at once (and stored by ``-o VAR``).

    `result()` waits for the `Completion`; `cancel()` stops the request (the partial text
    stays); `text` is what has streamed so far; `done()` says whether it has finished.
    The rendering thread owns `view`; the handle only reads it.
    """

    def __init__(self, request: Any, view: AnswerView, *, label: str = "") -> None:
        self.request = request
        self.view = view
        self.label = label
        self.completion: Any = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def text(self) -> str:
        return self.completion.text if self.completion is not None else self.view.text

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def cancel(self) -> None:
        self.request.cancel()

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the answer and return its `Completion` (re-raises the request's error)."""
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the background answer {self.label!r} is still running")
        if self.error is not None:
            raise self.error
        return self.completion

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<BackgroundAnswer {self.label!r} {state}, {len(self.text):,} chars>"

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        # Showing the handle (e.g. after `handle.result()`) shows the answer as it stands:
        # what a headless run records, since it misses updates sent after the --bg cell.
        return self.view.bundle()


@dataclass
class _ChatTurn:
    """The turn a `%%llm --chat` request answers, in its conversation."""

    conversation: Conversation
    turn: Turn

    def finish(self, answer: str) -> None:
        self.conversation.finish(self.turn, answer)

    def abandon(self) -> None:
        self.conversation.abandon(self.turn)


def _sampling(args: Any) -> dict[str, Any]:
    # Only the options given: the engine's defaults stay the single source of truth.
    given = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "seed": args.seed,
        "stop": args.stop,
    }
    return {name: value for name, value in given.items() if value is not None}


# -- driving a request -----------------------------------------------------------------------

_END = object()


@dataclass
class _Failure:
    error: BaseException


def _pump(request: Any, events: queue.Queue) -> None:
    # Runs on its own thread so the reader can wake every `interval` (and see Ctrl-C)
    # whatever the engine's stream does while it waits.
    try:
        for event in request.stream():
            events.put(event)
    except BaseException as exc:  # noqa: BLE001 - handed to the reader, which decides
        events.put(_Failure(exc))
    finally:
        events.put(_END)


def _consume(events: queue.Queue, view: AnswerView, *, deadline: float | None = None) -> Any:
    """Feed events to `view` until the stream ends; return the `Completion` if one came."""
    completion = None
    while True:
        timeout = view.interval
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        try:
            item = events.get(timeout=timeout)
        except queue.Empty:
            view.refresh()
            if deadline is not None and time.monotonic() >= deadline:
                return completion
            continue
        if item is _END:
            return completion
        if isinstance(item, _Failure):
            raise item.error
        if type(item).__name__ == "Finished":
            completion = item.completion
        view.apply(item)
        view.refresh()


def _drive(request: Any, view: AnswerView) -> tuple[Any, bool]:
    """Render `request` into `view` until it ends; return (completion, interrupted).

    On the main thread a `KeyboardInterrupt` (the kernel's interrupt) cancels the request;
    the events still in flight are drained so the partial answer and its report show.
    """
    events: queue.Queue = queue.Queue()
    threading.Thread(
        target=_pump, args=(request, events), name="mlx-nbengine-stream", daemon=True
    ).start()
    interrupted = False
    try:
        completion = _consume(events, view)
    except KeyboardInterrupt:
        interrupted = True
        request.cancel()
        view.mark_interrupted()
        view.refresh(force=True)
        try:
            completion = _consume(events, view, deadline=time.monotonic() + _CANCEL_GRACE_S)
        except KeyboardInterrupt:
            completion = None  # a second interrupt: stop waiting for the engine
    if completion is None and not interrupted:
        completion = request.result()
    if completion is not None:
        view.finish(completion, interrupted=interrupted)
    elif interrupted:
        view.mark_interrupted()
    view.close()
    return completion, interrupted


def _short_error(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


# Keys of Engine.stats() that describe the engine, not its block store (%llm_status shows them).
_ENGINE_STAT_KEYS = frozenset(
    {"model", "parallel", "block_size", "active", "queued", "failures", "save_errors", "closed"}
)

# -- the magics ------------------------------------------------------------------------------


def _default_engine_factory(model: str, **options: Any) -> Any:
    from mlx_nbengine._blas import ensure_fast_blas

    # Before MLX is first imported in this kernel (see _blas); a no-op afterwards.
    ensure_fast_blas()
    from mlx_nbengine.engine import Engine

    return Engine.load(model, **options)


@magics_class
class LLMMagics(Magics):
    """Magics of mlx_nbengine; one instance per shell, holding the `LLMSession`."""

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
                "no model is loaded; run `%load_model default` (or a model directory or "
                ".gguf file) first"
            )
        return self.session.engine

    def _updates_in_place(self) -> bool:
        # A kernel's front end redraws a display in place; a terminal prints every update.
        return hasattr(self.shell, "kernel")

    def _display(self, bundle: dict[str, str], **kwargs: Any) -> Any:
        from IPython.display import display

        return display(bundle, raw=True, **kwargs)

    def close_engine(self) -> str | None:
        """Close the engine (and its scratch file); return the model name it served."""
        session = self.session
        engine, model = session.engine, session.model
        session.engine, session.model, session.options = None, None, {}
        if engine is None:
            return None
        for handle in session.background:
            if not handle.done():
                handle.cancel()
        engine.close()
        for handle in session.background:
            if handle._thread is not None:
                handle._thread.join(timeout=_CANCEL_GRACE_S)
        session.background.clear()
        session.chats.clear()
        return model

    # -- %load_model ---------------------------------------------------------------------

    @magic_arguments()
    @argument(
        "model", metavar="MODEL", help="a local MLX model directory, a .gguf file, or `default`"
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
    @line_magic
    def load_model(self, line: str) -> None:
        """Load a model into this kernel and start its engine.

        MODEL is a local MLX model directory, a GGUF file (converted on first load) or
        `default` (the embedded Gemma 3 270M); the cell shows the time spent loading.
        Loading another model replaces the current one and frees its block store.
        """
        args = _parse(self.load_model, line, "%load_model")
        if args.parallel < 1 or args.block_size < 1:
            raise UsageError("--parallel and --block-size must be at least 1")
        options: dict[str, Any] = {"parallel": args.parallel, "block_size": args.block_size}
        if args.disk_budget is not None:
            options["disk_budget"] = parse_size(args.disk_budget)
        if args.cache_dir is not None:
            options["cache_dir"] = os.path.expanduser(args.cache_dir)
        if args.dtype is not None:
            options["dtype"] = args.dtype

        previous = self.close_engine()
        if previous is not None:
            self._display({"text/plain": f"unloaded {previous}"})
        model = args.model if args.model == "default" else os.path.expanduser(args.model)
        engine = self._load_with_progress(model, options)
        self.session.engine = engine
        self.session.model = args.model
        self.session.options = options

    def _load_with_progress(self, model: str, options: dict[str, Any]) -> Any:
        # Engine.load blocks and reports no progress; it runs on a helper thread while the
        # main thread redraws an elapsed-time line and stays interruptible (an interrupted
        # load is closed when it completes).
        result: dict[str, Any] = {}
        lock = threading.Lock()

        def work() -> None:
            try:
                engine = self.engine_factory(model, **options)
            except BaseException as exc:  # noqa: BLE001 - reported on the main thread
                result["error"] = exc
                return
            with lock:
                if result.get("discard"):
                    engine.close()
                else:
                    result["engine"] = engine

        started = time.monotonic()
        what = f"loading {model}"
        live = self._updates_in_place()
        handle = self._display(progress_bundle(what, elapsed=0.0), display_id=True)
        worker = threading.Thread(target=work, name="mlx-nbengine-load", daemon=True)
        worker.start()
        try:
            while worker.is_alive():
                worker.join(0.1)
                if live:
                    elapsed = time.monotonic() - started
                    handle.update(progress_bundle(what, elapsed=elapsed), raw=True)
        except KeyboardInterrupt:
            with lock:
                result["discard"] = True
                engine = result.pop("engine", None)
            if engine is not None:
                engine.close()
            handle.update({"text/plain": f"loading {model} interrupted"}, raw=True)
            raise UsageError(f"loading {model} was interrupted; no model is loaded") from None
        elapsed = time.monotonic() - started
        error = result.get("error")
        if error is not None:
            handle.update({"text/plain": f"loading {model} failed"}, raw=True)
            if isinstance(error, EngineError | OSError | ValueError):
                raise UsageError(f"could not load {model}: {_short_error(error)}") from None
            raise error
        engine = result["engine"]
        loaded = getattr(engine, "model", None)
        what_kind = f" ({loaded.model_type}, {loaded.kind})" if hasattr(loaded, "kind") else ""
        done = f"loaded {model}{what_kind} in {elapsed:.1f} s"
        handle.update({"text/plain": done, "text/markdown": done}, raw=True)
        return engine

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
    @cell_magic
    def llm(self, line: str, cell: str) -> None:
        """Ask the loaded model; the cell body is the prompt.

        The prompt goes through the model's chat template unless --raw. The answer streams
        into this cell, followed by one line on where the prompt's blocks came from
        (memory, disk or computed) and the speed. Interrupting the kernel cancels the
        request and keeps the partial answer. `-o VAR` stores the `Completion` (with
        --bg: the `BackgroundAnswer` handle, whose `.result()` waits for it).

        --chat NAME continues a conversation kept in the kernel. Re-running a cell
        replaces its turn and every later one; the cell is recognised by the cell id
        JupyterLab sends, or, where there is none (nbclient, terminal), by identical
        source text.
        """
        args = _parse(self.llm, line, "%%llm")
        engine = self._require_engine()
        text = cell.strip()
        if not text:
            raise UsageError("the cell is empty; write the prompt below the %%llm line")
        if args.raw and (args.chat or args.system):
            raise UsageError("--raw sends text without the chat template; drop --chat/--system")
        if args.interpolate:
            text = interpolate(text, self.shell.user_ns)
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o needs a variable name, not {args.output!r}")

        prompt, chat = self._prompt(args, text, source=f"%%llm {line}\n{cell}")
        try:
            request = engine.submit(prompt, **_sampling(args))
        except (EngineError, ValueError) as exc:
            if chat is not None:
                chat.abandon()
            raise UsageError(_short_error(exc)) from None

        view_class = AnswerView if self._updates_in_place() else TerminalView
        view = view_class(title=args.chat or "")
        view.show()
        if args.bg:
            self._start_background(request, view, args, chat)
            return None
        try:
            completion, interrupted = _drive(request, view)
        except EngineError as exc:
            view.fail(_short_error(exc))
            view.close()
            if chat is not None:
                chat.abandon()
            raise UsageError(_short_error(exc)) from None
        if chat is not None:
            chat.finish(completion.text if completion is not None else view.text)
        if args.output is not None:
            self.shell.user_ns[args.output] = completion
        if interrupted:
            raise KeyboardInterrupt("generation cancelled; the partial answer is kept above")
        return None

    def _prompt(self, args: Any, text: str, *, source: str) -> tuple[Any, _ChatTurn | None]:
        """The prompt to submit (text with --raw, else chat messages) and the chat turn."""
        if args.raw:
            return text, None
        if not args.chat:
            messages = [{"role": "user", "content": text}]
            if args.system:
                messages.insert(0, {"role": "system", "content": args.system})
            return messages, None
        conversation = self.session.chats.get(args.chat)
        key = turn_key(
            cell_id=self.session.cell_id,
            source=self.session.cell_source or source,
            index=self.session.chat_calls,
        )
        self.session.chat_calls += 1
        try:
            turn, messages = conversation.begin(key, text, system=args.system)
        except PendingTurnError as exc:
            raise UsageError(str(exc)) from None
        return messages, _ChatTurn(conversation, turn)

    def _start_background(self, request, view, args, chat) -> BackgroundAnswer:
        session = self.session
        session.background_count += 1
        label = args.output or args.chat or f"bg{session.background_count}"
        handle = BackgroundAnswer(request, view, label=label)
        # Finished handles live on in the user's variables, not here.
        session.background = [h for h in session.background if not h.done()]
        shell = self.shell
        # The parent header of the executing cell, so the thread's output goes there.
        parent = shell.get_parent() if hasattr(shell, "get_parent") else None

        def run() -> None:
            tokens = None
            if parent is not None and hasattr(shell, "set_thread_parent"):
                tokens = shell.set_thread_parent(parent)
            try:
                handle.completion, _ = _drive(request, view)
                if chat is not None:
                    chat.finish(handle.text)
            except BaseException as exc:  # noqa: BLE001 - kept for handle.result()
                handle.error = exc
                view.fail(_short_error(exc))
                view.close()
                if chat is not None:
                    chat.abandon()
            finally:
                if tokens is not None:
                    shell.reset_thread_parent(tokens)

        handle._thread = threading.Thread(target=run, name=f"mlx-nbengine-{label}", daemon=True)
        self.session.background.append(handle)
        if args.output is not None:
            self.shell.user_ns[args.output] = handle
        handle._thread.start()
        return handle

    # -- %llm_cache and %llm_status ---------------------------------------------------------

    @magic_arguments()
    @argument("action", nargs="?", choices=["clear"], help="`clear` empties the block store")
    @line_magic
    def llm_cache(self, line: str) -> None:
        """Show the block store's statistics; `%llm_cache clear` empties it."""
        args = _parse(self.llm_cache, line, "%llm_cache")
        engine = self._require_engine()
        if args.action == "clear":
            clear = getattr(engine, "clear_cache", None)
            if clear is None:
                raise UsageError(
                    "this engine cannot empty its store while loaded; `%unload_model` then "
                    "`%load_model` starts with an empty one"
                )
            clear()
        stats = {k: v for k, v in engine.stats().items() if k not in _ENGINE_STAT_KEYS}
        hits, misses = stats.get("hits"), stats.get("misses")
        if isinstance(hits, int) and isinstance(misses, int) and hits + misses:
            stats["hit rate"] = f"{hits / (hits + misses):.0%}"
        title = "block store (cleared)" if args.action == "clear" else "block store"
        self._display(key_value_bundle(title, stats_rows(stats)))

    @line_magic
    def llm_status(self, line: str = "") -> None:
        """Show the loaded model, its parallel slots, and active and queued requests."""
        if line.strip():
            raise UsageError("%llm_status takes no arguments")
        session = self.session
        if session.engine is None:
            self._display({"text/plain": "no model loaded; run `%load_model default`"})
            return
        stats = session.engine.stats()
        running = sum(1 for handle in session.background if not handle.done())
        rows: list[tuple[str, Any]] = [("model", session.model)]
        for name, value in session.options.items():
            shown = format_bytes(value) if name == "disk_budget" else value
            rows.append((name.replace("_", " "), shown))
        rows += [
            ("active requests", stats.get("active", "-")),
            ("queued requests", stats.get("queued", "-")),
            ("background cells running", running),
            ("failed requests", stats.get("failures", "-")),
            ("conversations", ", ".join(session.chats.names()) or "-"),
        ]
        self._display(key_value_bundle("mlx_nbengine", rows))


# -- extension entry points ---------------------------------------------------------------------

_MAGICS_KEY = "_mlx_nbengine_magics"


def load_ipython_extension(ipython: Any, *, engine_factory=None) -> LLMMagics:
    """Register the magics and the pre_run_cell hook on `ipython` (idempotent)."""
    existing = getattr(ipython, _MAGICS_KEY, None)
    if existing is not None:
        return existing
    magics = LLMMagics(ipython, engine_factory=engine_factory)
    ipython.register_magics(magics)
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

"""`%llm_serve`: the loaded engine as an OpenAI-compatible endpoint, and the agent view.

``%llm_serve [--port N] [--host H] [--api-key K]`` starts `mlx_nbengine.server.ApiServer`
on the session's engine, in a thread of the kernel, and returns at once; ``%llm_serve
stop`` stops it; ``%llm_serve`` alone while it runs shows the view again. `%unload_model`,
`%load_model` of another model (both close the engine: `LLMMagics.close_engine` stops the
server first), an engine closed any other way (the server's watcher) and the kernel's exit
(an atexit hook) stop it too.

Terms:

- *agent view* (`AgentView`): the cell's output, live: the URL, a snippet for the `openai`
  client, and one row per API request (time, client, API, conversation, prompt tokens,
  restored from memory and from disk, computed, first-token time, tok/s, finish) with that
  request's block strip; a click on a row opens its block map. A request that restored less
  than the previous turn of its conversation held gets a line under its row: why
  (`mlx_nbengine.server.conversations`), with the text either side of the first changed
  token (`miss_html`, in the edit marker's classes). It reuses the notebook's one renderer
  (`pictures.strip_html`, `pictures.map_html`) and the widgets' ES module and CSS.
- *row*: one journal entry of the server (`server.journal`) as a dict of figures plus its
  strip and map HTML, made once per change of the entry (`row_of`).

Redraws are throttled (`REDRAW_S`): the server's thread only marks the view stale.
"""

from __future__ import annotations

import html
import math
import threading
import time
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from mlx_nbengine.notebook.blockinfo import block_dicts
from mlx_nbengine.notebook.pictures import escape, map_html, strip_html, style
from mlx_nbengine.notebook.prompting import parse_options
from mlx_nbengine.notebook.words import seconds
from mlx_nbengine.server import DEFAULT_PORT, ApiServer, ServeError

__all__ = ["REDRAW_S", "AgentRows", "ServeMagics", "client_snippet", "row_of"]

REDRAW_S = 0.25  # at most this often the view is redrawn while requests run
SHOWN_ROWS = 50  # the newest rows the view shows


def client_snippet(server: ApiServer) -> str:
    """Copy-paste Python for the `openai` client against `server`."""
    key = '"<the --api-key>"' if server.api_key else '"none"  # any string: no key is asked'
    return (
        "from openai import OpenAI\n\n"
        f'client = OpenAI(base_url="{server.url}", api_key={key})\n'
        "reply = client.chat.completions.create(\n"
        f'    model="{server.model_name}",\n'
        '    messages=[{"role": "user", "content": "Hello!"}],\n'
        ")\n"
        "print(reply.choices[0].message.content)"
    )


def _decoder(engine: Any) -> tuple[Any, frozenset[int]]:
    tokenizer = getattr(getattr(engine, "model", None), "tokenizer", None)
    decode = getattr(tokenizer, "decode", None)
    special = getattr(tokenizer, "all_special_ids", None) or ()
    return (decode if callable(decode) else None), frozenset(int(t) for t in special)


def row_of(entry: Any, engine: Any, *, block_size: int) -> dict[str, Any]:
    """The view's row of a journal entry: its figures, and its strip and map HTML."""
    decode, special = _decoder(engine) if entry.finish is not None else (None, frozenset())
    blocks = block_dicts(
        list(entry.blocks), decode=decode, tokens=entry.tokens or None, special=special
    )
    n_blocks = math.ceil(entry.prompt_tokens / block_size) if block_size else len(blocks)
    figures = {
        "number": entry.number,
        "time": time.strftime("%H:%M:%S", time.localtime(entry.started)),
        "endpoint": entry.endpoint.removeprefix("/v1/"),
        "client": getattr(entry, "client", "") or "",
        "api": getattr(entry, "api", "") or entry.endpoint.removeprefix("/v1/"),
        "conversation": getattr(entry, "conversation", "") or "",
        "prompt": entry.prompt_tokens,
        "memory": entry.restored_memory,
        "disk": entry.restored_disk,
        "computed": entry.computed,
        "ttft": entry.ttft_s,
        "tps": entry.tokens_per_s,
        "finish": entry.finish or "running",
        "status": entry.status,
        "error": entry.error or "",
    }
    strip = map_ = ""
    if blocks or n_blocks:
        strip = strip_html(
            blocks,
            n_blocks=n_blocks,
            block_size=block_size,
            prompt_tokens=entry.prompt_tokens,
            live=True,
        )
    if blocks and entry.finish is not None:
        map_ = map_html(blocks, block_size=block_size, prompt_tokens=entry.prompt_tokens, live=True)
    miss = getattr(entry, "miss", None)
    return {
        **figures,
        "strip": strip,
        "map": map_,
        "miss": miss.as_dict(text=True) if miss else None,
    }


COLUMNS = (
    ("time", "time"),
    ("client", "client"),
    ("api", "API"),
    ("conversation", "conversation"),
    ("prompt", "prompt tokens"),
    ("memory", "memory"),
    ("disk", "disk"),
    ("computed", "computed"),
    ("ttft", "first token"),
    ("tps", "tok/s"),
    ("finish", "finish"),
)


def _cell(row: dict, name: str) -> str:
    value = row.get(name)
    if name == "ttft":
        return seconds(value) if value is not None else "-"
    if name == "tps":
        return f"{value:,.1f}" if value else "-"
    if name == "finish" and row.get("status", 200) not in (200, 499):
        return f"{row['status']} error"
    if name in ("client", "conversation") and not value:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def miss_html(miss: dict) -> str:
    """The line under a row that restored less than the previous turn of its conversation
    held: why, and the text either side of the first changed token (the edit marker's
    classes: what this prompt has from there, and what the previous turn had)."""
    position = int(miss.get("position", 0))
    words = (
        f'<span class="mnb-edit-words">…<span class="mnb-before">{escape(miss.get("before", ""))}'
        '</span><span class="mnb-caret" aria-label="changed here">▍</span>'
        f'<span class="mnb-after">{escape(miss.get("now", ""))}</span>…</span>'
    )
    notes = []
    if miss.get("was"):
        notes.append(
            f"request {int(miss.get('previous', 0)):,} had "
            f'<span class="mnb-edit-words">{escape(miss["was"])}…</span>'
        )
    if miss.get("detail"):
        notes.append(escape(miss["detail"]))
    notes.append(
        f"restored {int(miss.get('restored', 0)):,} of the "
        f"{int(miss.get('expected', 0)):,} tokens it held"
    )
    return (
        f'<div class="mnb-edit mnb-agent-why" data-cause="{escape(miss.get("cause", ""))}" '
        f'data-position="{position}">'
        f'<span class="mnb-edit-label">{escape(miss.get("why", ""))}</span> {words} '
        f'<span class="mnb-edit-note">{"; ".join(notes)}</span></div>'
    )


def rows_html(rows: list[dict], *, url: str, snippet: str, stopped: bool = False) -> str:
    """The agent view's HTML (live: no style block)."""
    state = "stopped" if stopped else "serving"
    head = (
        f'<div class="mnb-agent-head"><b>{state}</b> <code>{escape(url)}</code> '
        f"({len(rows):,} requests)</div>"
    )
    code = (
        '<details class="mnb-agent-snippet"><summary>openai client</summary>'
        f"<pre>{html.escape(snippet)}</pre></details>"
    )
    ths = "".join(f"<th>{label}</th>" for _, label in COLUMNS)
    body = []
    for row in rows[-SHOWN_ROWS:][::-1]:  # newest first
        tds = "".join(f'<td data-name="{n}">{escape(_cell(row, n))}</td>' for n, _ in COLUMNS)
        title = f' title="{escape(row["error"])}"' if row.get("error") else ""
        body.append(f'<tr class="mnb-agent-row" data-number="{row["number"]}"{title}>{tds}</tr>')
        if row.get("strip"):
            inner = row["strip"]
            if row.get("map"):
                inner = (
                    '<details class="mnb-agent-blocks"><summary title="click for its block map">'
                    f"{row['strip']}</summary>"
                    f"{row['map']}</details>"
                )
            body.append(
                f'<tr class="mnb-agent-strip"><td colspan="{len(COLUMNS)}">{inner}</td></tr>'
            )
        if row.get("miss"):  # under the row's strip: why it restored less than it could
            body.append(
                f'<tr class="mnb-agent-miss" data-number="{row["number"]}">'
                f'<td colspan="{len(COLUMNS)}">{miss_html(row["miss"])}</td></tr>'
            )
    table = (
        f'<table class="mnb-table mnb-agent-table"><thead><tr>{ths}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )
    return f'<div class="mnb-root mnb-agent">{head}{code}{table}</div>'


def rows_text(rows: list[dict], *, url: str) -> str:
    lines = [f"serving {url}: {len(rows):,} requests"]
    for row in rows[-SHOWN_ROWS:]:
        lines.append(" ".join(f"{label}={_cell(row, name)}" for name, label in COLUMNS))
        if row.get("miss"):
            lines.append(f"  missed: {row['miss'].get('why', '')}")
    return "\n".join(lines)


class AgentRows:
    """The rows of one server's journal, kept as the entries change; `on_change(rows)` is
    called at most every `REDRAW_S` seconds (from its own thread, which also draws the
    changed rows: the server's thread only notes which entries changed)."""

    def __init__(self, server: ApiServer, on_change: Any) -> None:
        self.server = server
        self._rows: dict[int, dict] = {}
        self._changed_entries: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._stale = threading.Event()
        self._on_change = on_change
        self._block_size = int(getattr(server.engine, "block_size", 0) or 0)
        for entry in server.journal.entries():
            self._rows[entry.number] = row_of(entry, server.engine, block_size=self._block_size)
        self._unwatch = server.journal.watch(self._changed)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="mnb-agent-view")
        self._thread.start()

    def rows(self) -> list[dict]:
        with self._lock:
            return [self._rows[n] for n in sorted(self._rows)][-SHOWN_ROWS:]

    def current(self) -> list[dict]:
        """The rows with every change so far drawn (on the caller's thread)."""
        self._draw_changed()
        return self.rows()

    def _changed(self, entry: Any) -> None:
        with self._lock:
            self._changed_entries[entry.number] = entry
        self._stale.set()

    def _draw_changed(self) -> None:
        with self._lock:
            entries, self._changed_entries = self._changed_entries, {}
        rows = {
            n: row_of(e, self.server.engine, block_size=self._block_size)
            for n, e in entries.items()
        }
        with self._lock:
            self._rows.update(rows)
            for old in sorted(self._rows)[:-SHOWN_ROWS]:
                del self._rows[old]

    def _loop(self) -> None:
        while True:
            self._stale.wait()
            time.sleep(REDRAW_S)
            self._stale.clear()
            try:
                self._draw_changed()
                self._on_change(self.rows())
            except Exception:  # a view's failure never reaches the server
                pass
            if not self.server.running and not self._stale.is_set():
                self._unwatch()
                return


def _agent_view_class() -> Any:
    """The `AgentView` widget class, or None where the widgets cannot load."""
    try:
        import traitlets

        from mlx_nbengine.notebook.widgets import _Widget
    except (ImportError, OSError):  # anywidget missing, or the widgets' files
        return None

    class AgentView(_Widget):
        """The agent view: one row per API request with its block strip."""

        _behaviour = traitlets.Unicode("agent").tag(sync=True)
        rows = traitlets.List(traitlets.Dict()).tag(sync=True)
        url = traitlets.Unicode("").tag(sync=True)
        snippet = traitlets.Unicode("").tag(sync=True)
        stopped = traitlets.Bool(False).tag(sync=True)

        _drawn_from = ("rows", "url", "snippet", "stopped")

        def _redraw(self, change: Any = None) -> None:
            self.markup = rows_html(
                self.rows, url=self.url, snippet=self.snippet, stopped=self.stopped
            )

        def html(self) -> str:
            return style() + self.markup

        def text(self) -> str:
            return rows_text(self.rows, url=self.url)

    return AgentView


_VIEW_CLASS: list[Any] = []


def agent_view(server: ApiServer, rows: list[dict]) -> Any:
    """A new `AgentView` of `server` (None without widgets)."""
    if not _VIEW_CLASS:
        _VIEW_CLASS.append(_agent_view_class())
    cls = _VIEW_CLASS[0]
    if cls is None:
        return None
    return cls(rows=rows, url=server.url, snippet=client_snippet(server))


@magics_class
class ServeMagics(Magics):
    """`%llm_serve`, on the engine of the `LLMMagics` `llm` (its session holds the server)."""

    def __init__(self, shell: Any, llm: Any) -> None:
        super().__init__(shell)
        self.llm = llm
        self._views: list[Any] = []
        self._rows: AgentRows | None = None

    @property
    def server(self) -> ApiServer | None:
        server = self.llm.session.server
        return server if server is not None and server.running else None

    @magic_arguments()
    @argument("action", nargs="?", default=None, choices=["stop"], help="stop: stop serving")
    @argument("--port", type=int, default=None, metavar="N", help=f"port (default {DEFAULT_PORT})")
    @argument(
        "--host",
        default=None,
        metavar="H",
        help="address to serve on (default 127.0.0.1; any other needs --api-key)",
    )
    @argument(
        "--api-key",
        default=None,
        metavar="K",
        help="clients must send 'Authorization: Bearer K' (required off loopback)",
    )
    @argument(
        "--log-prompts",
        action="store_true",
        help="log prompts and answers to the mlx_nbengine.server logger (off by default)",
    )
    @line_magic
    def llm_serve(self, line: str = "") -> None:
        """Serve the loaded model as an OpenAI-compatible endpoint at http://HOST:PORT/v1.

        Starts in a thread of the kernel and returns at once; cells and API requests share
        the engine, its batch and its block store. The output is the agent view: one row per
        request with its block strip (click a row for its block map). `%llm_serve` alone
        while serving shows the view again; `%llm_serve stop` stops; so do `%unload_model`,
        `%load_model` and the kernel's exit. Endpoints: /v1/chat/completions,
        /v1/completions (streaming or not), /v1/models.
        """
        args = parse_options(self.llm_serve, line, "%llm_serve")
        if args.action == "stop":
            self._stop()
            return
        options = (args.port, args.host, args.api_key)
        if self.server is not None and options == (None, None, None) and not args.log_prompts:
            self._show(self.server)
            return
        engine = self.llm._require_engine()
        if self.server is not None:
            self._stop(quiet=True)
        server = self._start(engine, args)
        self._show(server)

    def _start(self, engine: Any, args: Any) -> ApiServer:
        try:
            server = ApiServer(
                engine,
                host=args.host or "127.0.0.1",
                port=DEFAULT_PORT if args.port is None else args.port,
                api_key=args.api_key,
                log_prompts=args.log_prompts,
            ).start()
        except ServeError as exc:
            raise UsageError(str(exc)) from None
        self.llm.session.server = server
        self._views = []
        self._rows = AgentRows(server, self._redraw)
        return server

    def _redraw(self, rows: list[dict]) -> None:
        stopped = self.llm.session.server is None or not self.llm.session.server.running
        for view in list(self._views):
            with view.hold_sync():
                view.rows = rows
                view.stopped = stopped

    def _show(self, server: ApiServer) -> None:
        rows = self._rows.current() if self._rows is not None else []
        view = agent_view(server, rows) if self.llm._updates_in_place() else None
        if view is not None:
            self._views.append(view)
            self.llm._display(view)
            return
        text = f"serving {server.model_name} at {server.url}\n\n{client_snippet(server)}"
        if rows:
            text += "\n\n" + rows_text(rows, url=server.url)
        self.llm._display({"text/plain": text})

    def _stop(self, *, quiet: bool = False) -> None:
        server = self.llm.session.server
        if server is None or not server.running:
            self.llm.session.server = None
            if quiet:
                return
            raise UsageError("%llm_serve is not running; start it with `%llm_serve`")
        server.stop()
        self.llm.session.server = None
        for view in self._views:
            view.stopped = True
        if not quiet:
            self.llm._display({"text/plain": f"stopped serving at {server.url}"})

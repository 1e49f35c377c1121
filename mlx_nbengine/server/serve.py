"""`ApiServer`: the app served by uvicorn on a daemon thread of the calling process (the
kernel), started and stopped from Python.

Terms:

- *loopback*: 127.0.0.0/8, ::1 or ``localhost``. The default host. Any other host serves
  the network, and `start` refuses it without an API key.
- *watcher*: a daemon thread that stops the server once its engine is closed, whoever
  closed it (`%unload_model`, `Engine.close()`, the engine's atexit hook). An `atexit` hook
  also stops every server still running when the process exits.

`start` binds the socket itself before uvicorn runs, so a port in use (or a host that is
not this machine's) is a one-line `ServeError` in the caller, and port 0 picks a free port
(`port` then says which). Uvicorn's own logging is left alone (``log_config=None``: the
kernel's logging is not reconfigured) and its access log is off.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlx_nbengine.server.app import build_app
from mlx_nbengine.server.journal import Journal
from mlx_nbengine.server.openai_shapes import Limits

__all__ = ["ApiServer", "ServeError", "is_loopback"]

DEFAULT_PORT = 8000
WATCH_S = 0.25  # how often the watcher looks at the engine

_running: set[ApiServer] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.stop(timeout=2)


class _IdleTimeoutH11(H11Protocol):
    """Uvicorn's h11 protocol whose idle timer (its keep-alive timeout) also runs before the
    first request, while a request's head is coming and while its body is: a connection
    that sends nothing for that long is closed, not only one kept alive after a response.
    A body that stops coming is a client gone (the app journals it as 499)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if (
            self.cycle is None
            or self.cycle.response_complete  # no request being answered
            or self.conn.their_state is h11.SEND_BODY  # its body still coming
        ):
            self._arm_idle_timer()

    def timeout_keep_alive_handler(self) -> None:
        answering = self.cycle is not None and not self.cycle.response_complete
        if answering and self.conn.their_state is h11.SEND_BODY:
            self.transport.close()  # the app's read of the body sees a disconnect
            return
        super().timeout_keep_alive_handler()

    def _arm_idle_timer(self) -> None:
        self._unset_keepalive_if_required()
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )


class ServeError(RuntimeError):
    """The server cannot start as asked; the one-line message says what to change."""


def is_loopback(host: str) -> bool:
    """True when `host` (an address or a name) means this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ApiServer:
    """The OpenAI-compatible endpoint of one `Engine`; `start()`, then `stop()`.

    `idle_timeout_s` closes a connection that sends nothing that long (between requests, or
    before its first request's head is complete); `limits` bounds a
    request (body size, messages, images; `max_tokens` is bounded by the model's context);
    `max_pending` requests in flight at most (then 429); `log_prompts` logs prompts and
    answers to the ``mlx_nbengine.server`` logger (off: nothing holding them is logged).
    """

    def __init__(
        self,
        engine: Any,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        api_key: str | None = None,
        limits: Limits | None = None,
        idle_timeout_s: int = 30,
        max_pending: int = 64,
        log_prompts: bool = False,
    ) -> None:
        if not is_loopback(host) and not api_key:
            raise ServeError(
                f"--host {host} serves the network: give --api-key KEY too (or serve on "
                "127.0.0.1, the default)"
            )
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ServeError(f"--port must be 0..65535, got {port!r}")
        if limits is None:
            limits = Limits(context=getattr(getattr(engine, "model", None), "context_length", None))
        self.engine = engine
        self.host = host
        self.port = port
        self.api_key = api_key or None
        self.limits = limits
        self.journal = Journal()
        self.app = build_app(
            engine,
            api_key=self.api_key,
            limits=limits,
            journal=self.journal,
            log_prompts=log_prompts,
            max_pending=max_pending,
            loopback_only=is_loopback(host),
        )
        self.model_name = engine.model_name
        self._config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            http=_IdleTimeoutH11,
            timeout_keep_alive=idle_timeout_s,
            timeout_graceful_shutdown=2,
            # No limit_concurrency: past it uvicorn answers a plain-text 503 (and counts idle
            # keep-alive connections too); the app's own 429 past max_pending is the refusal.
        )
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    # -- state --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True from `start` until the serving thread has ended (after `stop`)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def url(self) -> str:
        """The base URL clients use (``http://HOST:PORT/v1``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<ApiServer {self.url} {'running' if self.running else 'stopped'}>"

    # -- start / stop -----------------------------------------------------------------------------

    def _bind(self) -> socket.socket:
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            raise ServeError(f"--host {self.host} is not an address of this machine") from None
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(2048)  # uvicorn's own backlog: a burst of clients is queued, not dropped
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise ServeError(
                    f"port {self.port} is in use on {self.host}; pick another with --port N"
                ) from None
            raise ServeError(f"cannot serve on {self.host}:{self.port}: {exc.strerror}") from None
        sock.setblocking(False)
        return sock

    def start(self, timeout: float = 30.0) -> ApiServer:
        """Bind, start serving on a daemon thread, and return once requests are taken."""
        if self.running:
            return self
        if getattr(self.engine, "closed", False):
            raise ServeError("the engine is closed; load a model first")
        self._socket = self._bind()
        self.port = self._socket.getsockname()[1]
        self._uvicorn = uvicorn.Server(self._config)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="mnb-api-server")
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"the server did not start: {self.error or 'timed out'}")
            time.sleep(0.01)
        _running.add(self)
        threading.Thread(target=self._watch, daemon=True, name="mnb-api-watch").start()
        return self

    def _serve(self) -> None:
        try:
            self._uvicorn.run(sockets=[self._socket])
        except BaseException as exc:  # SystemExit from uvicorn included: never kill the kernel
            self.error = exc

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_S):
            if getattr(self.engine, "closed", False):
                self.stop()
                return

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (streams still open are cut after a 2 s grace); idempotent."""
        self._stopping.set()
        _running.discard(self)
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive() and self._uvicorn is not None:
                self._uvicorn.force_exit = True
                thread.join(2)
        if self._socket is not None:
            self._socket.close()
            self._socket = None

"""The control channel between the engine (rank 0) and one worker: framed pickles on TCP.

It carries *coordination* only, never a tensor: the step plans rank 0 sends (which model
call, which tokens, which cache restore or checkpoint), the workers' answers to store
questions, their heartbeats and errors. The tensors of a sharded step go over
`mx.distributed` (the ring backend).

A *frame* is an 8-byte big-endian length and that many bytes. The worker's first frame is
the group's secret (given to it when it was started); rank 0 unpickles nothing from a
socket before that frame matched (`hmac.compare_digest`). Every later frame is a pickled
``(kind, fields)`` pair. `Link` is one end: `send` from any thread (a lock keeps frames
whole), `receive` on one thread with a timeout.
"""

from __future__ import annotations

import hmac
import pickle
import socket
import struct
import threading
from typing import Any

_LENGTH = struct.Struct(">Q")
MAX_FRAME = 1 << 30  # a step plan is small; anything this large is not ours


class ChannelClosed(ConnectionError):
    """The other end closed the channel (or it broke)."""


def _read_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ChannelClosed("the control channel was closed by the other end")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket) -> bytes:
    (n,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
    if n > MAX_FRAME:
        raise ChannelClosed(f"a control frame of {n} bytes: not this engine's channel")
    return _read_exact(sock, n)


def write_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


class Link:
    """One end of a control channel over a connected socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, message: Any) -> None:
        """Send one message (a `plans` dataclass)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            if self.closed:
                raise ChannelClosed("the control channel is closed")
            try:
                write_frame(self.sock, data)
            except OSError as exc:
                raise ChannelClosed(f"the control channel broke: {exc}") from exc

    def receive(self, timeout: float | None = None) -> Any:
        """The next message; `TimeoutError` after `timeout` s, `ChannelClosed` at the end."""
        self.sock.settimeout(timeout)
        try:
            data = read_frame(self.sock)
        except TimeoutError:
            raise
        except OSError as exc:
            raise ChannelClosed(f"the control channel broke: {exc}") from exc
        return pickle.loads(data)

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(address: tuple[str, int], secret: bytes, *, timeout: float) -> Link:
    """The worker's end: connect to rank 0 and prove the secret."""
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    write_frame(sock, secret)
    return Link(sock)


def accept(server: socket.socket, secret: bytes, *, timeout: float) -> Link | None:
    """Rank 0's end: the next connection that proves `secret` (None: it did not)."""
    server.settimeout(timeout)
    sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    try:
        given = read_frame(sock)
    except (OSError, ChannelClosed):
        sock.close()
        return None
    if not hmac.compare_digest(given, secret):
        sock.close()
        return None
    return Link(sock)

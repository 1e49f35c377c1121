"""`RankGroup`: rank 0's side of a sharded model, the workers' lifecycle and their links.

Start (`RankGroup.start`): listen for the workers' control channels, start them
(`launch`), accept each one's channel (it proves the group's secret), then form the MLX
group: every worker is told to call ``mx.distributed.init(backend="ring")`` and this
process does too (`init_ring`). Measured: MLX's ring init waits for every peer without a
timeout, holding the GIL, and a process gets one global group for its whole life; so the
ring is formed only once every worker is connected and running, and one process can
host one group (`RingUsedError` for a second one: restart the kernel).

While it runs, one reader thread per worker takes its heartbeats, answers and errors, and
a watchdog thread fails the group (`fault`) when a worker exits, reports an error, or
sends nothing for `hang_timeout_s`. A fault kills every worker's process group, which
breaks the ring, so a step blocked in a collective on this rank raises at once; the
error (`RankLostError`) names the host and rank, and `on_fault` (the engine) closes.

`send` broadcasts a step plan (no answer); `ask` asks every worker a store question and
waits for all answers (bounded). `close` asks the workers to stop (each closes its store,
which deletes its scratch file) and kills whatever is left after `STOP_WAIT_S`.
"""

from __future__ import annotations

import itertools
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

from mlx_nbengine.engine import memory
from mlx_nbengine.engine.ranks import launch, plans
from mlx_nbengine.engine.ranks.channel import ChannelClosed, Link, accept
from mlx_nbengine.errors import EngineError

CONNECT_TIMEOUT_S = 120.0  # a worker's start: interpreter, imports, over ssh
HANG_TIMEOUT_S = 20.0  # no heartbeat (sent every HEARTBEAT_S) for this long: hung
ASK_TIMEOUT_S = 60.0
STOP_WAIT_S = 10.0

_ring_used = threading.Lock()  # held for good once a process formed its MLX group


class RankLostError(EngineError, RuntimeError):
    """A worker rank died, hung or could not be reached; the sharded engine is closed."""


class RingUsedError(EngineError):
    """This process already formed its one MLX distributed group."""


class RankGroup:
    """The workers of one sharded model (see the module docstring)."""

    def __init__(self, places: list[launch.Place], *, hang_timeout_s: float = HANG_TIMEOUT_S):
        self.places = places
        self.size = len(places)
        self.hang_timeout_s = hang_timeout_s
        self.secret = secrets.token_bytes(32)
        self.processes: list[launch.Process] = []
        self.links: dict[int, Link] = {}
        self.hello: dict[int, plans.Hello] = {}
        self.error: RankLostError | None = None
        self.on_fault: Callable[[RankLostError], None] | None = None
        self._seen: dict[int, float] = {}
        self._asks = itertools.count(1)
        self._waiting: dict[int, tuple[Future, dict[int, Any]]] = {}
        self._lock = threading.Lock()
        self._closing = False
        self.hostfile: str | None = None  # the ring's addresses, once it is formed
        # Until every rank loaded, a worker may hold its GIL (MLX's ring init, reading
        # weights) longer than `hang_timeout_s` between heartbeats.
        self._grace_until = float("inf")

    def name(self, rank: int) -> str:
        return f"rank {rank} on {self.places[rank].host}"

    # --- start ------------------------------------------------------------------------------

    def start(self, env: dict[str, str], *, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Start every worker and accept its channel; raise `RankLostError` naming the
        first one that did not connect in `timeout` s (every worker is then stopped)."""
        if _ring_used.locked():
            raise RingUsedError(
                "this process already formed its MLX distributed group (MLX allows one per "
                "process); restart the kernel to load a sharded model again"
            )
        ip = self.places[0].ip
        with socket.create_server((ip if ip != launch.LOCAL else launch.LOCAL, 0)) as server:
            address = f"{ip}:{server.getsockname()[1]}"
            env = {**env, "MLX_NBENGINE_RANK0": address, "MLX_NBENGINE_RANKS": str(self.size)}
            try:
                for place in self.places[1:]:
                    try:
                        self.processes.append(launch.start(place, env, self.secret))
                    except OSError as exc:
                        raise RankLostError(
                            f"{self.name(place.rank)} cannot be started: {exc}"
                        ) from exc
                self._accept_all(server, timeout)
            except BaseException:
                self.kill()
                raise
        for rank, link in self.links.items():
            self._seen[rank] = time.monotonic()
            threading.Thread(
                target=self._read, args=(rank, link), name=f"mlx-nbengine-rank{rank}", daemon=True
            ).start()
        threading.Thread(target=self._watch, name="mlx-nbengine-ranks-watch", daemon=True).start()

    def _accept_all(self, server: socket.socket, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.links) < self.size - 1:
            left = deadline - time.monotonic()
            dead = next((p for p in self.processes if p.exit_code() is not None), None)
            if dead is not None and dead.place.rank not in self.links:
                raise self._lost(
                    dead.place.rank, f"exited (code {dead.exit_code()}) before it connected"
                )
            if left <= 0:
                missing = next(p for p in self.processes if p.place.rank not in self.links)
                raise self._lost(missing.place.rank, f"did not connect within {timeout:.0f} s")
            try:
                link = accept(server, self.secret, timeout=min(left, 0.5))
            except TimeoutError:
                continue
            if link is None:
                continue
            hello = link.receive(timeout=10)
            rank = hello.rank if isinstance(hello, plans.Hello) else -1
            if rank not in range(1, self.size) or rank in self.links:
                link.close()
                continue
            self.links[rank] = link
            self.hello[rank] = hello
            self.processes[rank - 1].remote_pid = hello.pid

    def _lost(self, rank: int, what: str) -> RankLostError:
        tail = self.processes[rank - 1].output() if 0 < rank <= len(self.processes) else ""
        last = tail.strip().splitlines()[-1] if tail.strip() else ""
        return RankLostError(
            f"{self.name(rank)} {what}" + (f"; its last output: {last}" if last else "")
        )

    def init_ring(self, hostfile: str) -> Any:
        """Tell every worker to form the ring, then form it here; the group (rank 0)."""
        self.send(plans.Init())
        time.sleep(0.2)  # MLX's init waits without a timeout: start it only beside live peers
        self.check()
        if not _ring_used.acquire(blocking=False):
            raise RingUsedError("this process already formed its MLX distributed group")
        self.hostfile = hostfile
        import mlx.core as mx  # lazy: MLX's distributed module is used by sharded engines only

        memory.collectives_formed()  # from now on MLX's pool is emptied between steps only

        return _init_with_hostfile(mx, hostfile)

    # --- while it runs ----------------------------------------------------------------------

    def check(self) -> None:
        """Raise the group's `RankLostError` if it failed."""
        if self.error is not None:
            raise self.error
        for process in self.processes:
            if process.exit_code() is not None:
                self.fault(process.place.rank, f"exited (code {process.exit_code()})")
                raise self.error

    def send(self, plan: Any) -> None:
        """Send one step plan (a `plans` message) to every worker (in rank order); raise if
        the group failed."""
        if self.error is not None:
            raise self.error
        for rank, link in self.links.items():
            try:
                link.send(plan)
            except ChannelClosed:
                self.fault(rank, "cannot be reached (its control channel closed)")
                raise self.error from None

    def ask(self, question: plans.Question, *, timeout: float = ASK_TIMEOUT_S) -> list[Any]:
        """Every worker's answer to `question` (rank order); `RankLostError` when one fails
        or does not answer in `timeout` s."""
        number = next(self._asks)
        fut: Future = Future()
        with self._lock:
            self._waiting[number] = (fut, {})
        try:
            self.send(replace(question, ask=number))
            fut.result(timeout)
        except FutureTimeout:
            rank = next(r for r in self.links if r not in self._waiting.get(number, (None, {}))[1])
            self.fault(rank, f"did not answer {type(question).__name__} within {timeout:.0f} s")
            raise self.error from None
        finally:
            with self._lock:
                _, answers = self._waiting.pop(number, (None, {}))
        if self.error is not None:
            raise self.error
        return [answers[r] for r in sorted(answers)]

    def _read(self, rank: int, link: Link) -> None:
        while True:
            try:
                message = link.receive(timeout=None)
            except (ChannelClosed, OSError, EOFError, ValueError):
                if not self._closing:
                    time.sleep(0.2)  # its exit code, if it is exiting, names the cause better
                    code = self.processes[rank - 1].exit_code()
                    what = f"exited (code {code})" if code is not None else "closed its channel"
                    self.fault(rank, what)
                return
            self._seen[rank] = time.monotonic()
            match message:
                case plans.Answer(ask=number, value=value):
                    self._answer(rank, number, value)
                case plans.Failed(message=said):
                    self.fault(rank, f"failed: {said}")

    def _answer(self, rank: int, number: int, value: Any) -> None:
        with self._lock:
            waiting = self._waiting.get(number)
            if waiting is None:
                return
            fut, answers = waiting
            answers[rank] = value
            if len(answers) == len(self.links) and not fut.done():
                fut.set_result(None)

    def loaded(self) -> None:
        """Every rank loaded: from now on `hang_timeout_s` applies."""
        self._grace_until = time.monotonic()

    def _watch(self) -> None:
        while not self._closing and self.error is None:
            time.sleep(0.25)
            now = time.monotonic()
            limit = self.hang_timeout_s if now > self._grace_until else CONNECT_TIMEOUT_S
            for rank, seen in list(self._seen.items()):
                # A heartbeat waiting in the socket is not a hang: this process held its
                # GIL (a long step), so the reader thread has not taken it yet.
                if now - seen > limit and not _readable(self.links[rank]):
                    self.fault(rank, f"sent nothing for {limit:.0f} s (hung)")
                    return
            for process in self.processes:
                if process.exit_code() is not None and not self._closing:
                    self.fault(process.place.rank, f"exited (code {process.exit_code()})")
                    return

    def fault(self, rank: int, what: str) -> None:
        """Fail the group: `rank` `what`. Kills every worker (breaking the ring, so a
        collective in flight here raises), wakes every question, tells `on_fault`."""
        with self._lock:
            if self.error is not None or self._closing:
                return
            self.error = self._lost(
                rank, what + "; the sharded engine is closed, run %load_model (Engine.load) again"
            )
            waiting = list(self._waiting.values())
        self.kill()
        for fut, _ in waiting:
            if not fut.done():
                fut.set_result(None)
        if self.on_fault is not None:
            threading.Thread(
                target=self.on_fault,
                args=(self.error,),
                name="mlx-nbengine-ranks-fault",
                daemon=True,
            ).start()

    # --- stop -------------------------------------------------------------------------------

    def kill(self) -> None:
        for process in self.processes:
            process.kill()

    def close(self) -> None:
        """Stop every worker (each deletes its scratch file); kill what is left. Idempotent."""
        if self._closing:
            return
        self._closing = True
        for link in self.links.values():
            try:
                link.send(plans.Stop())
            except ChannelClosed:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes:
            process.reap(max(0.1, deadline - time.monotonic()))
        self.kill()
        for link in self.links.values():
            link.close()

    def status(self) -> list[dict[str, Any]]:
        """One row per worker: rank, host, pid, running, and its store's figures."""
        stores: list[Any] = []
        if self.error is None and not self._closing:
            try:
                stores = self.ask(plans.Store(), timeout=5)
            except RankLostError:
                stores = []
        rows = []
        for i, process in enumerate(self.processes):
            row = launch.describe(process)
            if i < len(stores):
                row["store"] = stores[i]
            rows.append(row)
        return rows


def _readable(link: Link) -> bool:
    try:
        return bool(select.select([link.sock], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def _init_with_hostfile(mx: Any, hostfile: str) -> Any:
    """``mx.distributed.init(backend="ring")`` as rank 0 of `hostfile` (text), through a
    temporary hostfile removed right after."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="mlx-nbengine-ring-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(hostfile)
        os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = path, "0"
        return mx.distributed.init(backend="ring", strict=True)
    finally:
        os.unlink(path)
        os.environ.pop("MLX_HOSTFILE", None)
        os.environ.pop("MLX_RANK", None)

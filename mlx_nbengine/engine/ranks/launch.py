"""Starting the worker ranks and stopping them: local subprocesses, or over ssh.

A *place* is where one rank runs: rank 0 is this process (the engine), ranks 1..N-1 are
worker processes (`python -m mlx_nbengine.engine.ranks.worker`). Local ranks (`ranks=N`)
are subprocesses, each the leader of its own session (so a kernel interrupt never
reaches them and one `killpg` stops all a rank started); a remote rank is ``ssh HOST``
running the same interpreter path there, as `mlx.launch` does it. A worker gets what it
needs in its environment (its rank, the ring's addresses, where to reach rank 0) and the
group's secret on its standard input, so the secret never shows in a process list.
Its stdout and stderr are kept, the last lines only, for the error that names it.

The *ring addresses* are MLX's ring-backend hostfile: one ``["IP:PORT"]`` per rank, in
rank order (what `mlx.launch --backend ring` writes); each rank writes it to a temporary
file of its own just before `mx.distributed.init` and deletes it right after.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

LOCAL = "127.0.0.1"
WORKER_MODULE = "mlx_nbengine.engine.ranks.worker"
# The first ring port of a remote group (mlx.launch's default); rank r listens on BASE + r.
RING_PORT_BASE = int(os.environ.get("MLX_NBENGINE_RING_PORT", "32323"))
TAIL_LINES = 30


@dataclass
class Place:
    """Where rank `rank` runs: `host` as given (ssh target; "127.0.0.1" locally) and the
    `ip` its ring address uses."""

    rank: int
    host: str
    ip: str

    @property
    def local(self) -> bool:
        return self.host == LOCAL


def places_for(*, ranks: int | None, hosts: list[str] | None) -> list[Place]:
    """Rank 0 first: `ranks` local places, or one per host (the first host is this
    machine, where the engine runs)."""
    if hosts:
        out = []
        for rank, host in enumerate(hosts):
            name = host.split("@")[-1]
            try:
                ip = socket.gethostbyname(name)
            except OSError as exc:
                raise OSError(f"rank {rank} on {host} cannot be reached: {exc}") from exc
            out.append(Place(rank, LOCAL if rank == 0 else host, ip))
        return out
    return [Place(rank, LOCAL, LOCAL) for rank in range(ranks or 1)]


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def ring_hosts(places: list[Place]) -> str:
    """The ring backend's hostfile text for `places`."""
    if all(p.local for p in places):
        ports = [_free_port(LOCAL) for _ in places]
    else:
        ports = [RING_PORT_BASE + p.rank for p in places]
    return json.dumps([[f"{p.ip}:{port}"] for p, port in zip(places, ports, strict=True)])


@dataclass
class Process:
    """One started worker: its place, its process (or ssh client), the tail of its output."""

    place: Place
    popen: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    remote_pid: int | None = None

    def output(self) -> str:
        return "\n".join(self.tail)

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL its whole session here (and, over ssh, the remote worker); no wait."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not self.place.local and self.remote_pid is not None:
            subprocess.Popen(  # best effort: the worker also exits when its channel closes
                ["ssh", "-o", "BatchMode=yes", self.place.host, f"kill -9 {self.remote_pid}"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )

    def reap(self, timeout: float) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _environment(place: Place, env: dict[str, str]) -> dict[str, str]:
    return {**env, "MLX_RANK": str(place.rank), "PYTHONUNBUFFERED": "1"}


def _command(place: Place, env: dict[str, str]) -> list[str]:
    python = os.environ.get("MLX_NBENGINE_RANK_PYTHON", sys.executable)
    if place.local:
        return [python, "-m", WORKER_MODULE]
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in _environment(place, env).items())
    remote = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec env {exports} "
    remote += f"{shlex.quote(python)} -m {WORKER_MODULE}"
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", place.host, remote]


def start(place: Place, env: dict[str, str], secret: bytes) -> Process:
    """Start the worker of `place` with `env` (the group's variables) and `secret`."""
    full = {**os.environ, **_environment(place, env)} if place.local else dict(os.environ)
    popen = subprocess.Popen(
        _command(place, env),
        env=full,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    process = Process(place, popen)
    try:
        popen.stdin.write(secret.hex().encode() + b"\n")
        popen.stdin.flush()
    except OSError:
        pass  # it died at once: its exit code and output say why
    threading.Thread(
        target=_keep_tail, args=(process,), name=f"mlx-nbengine-rank{place.rank}-out", daemon=True
    ).start()
    return process


def _keep_tail(process: Process) -> None:
    for line in iter(process.popen.stdout.readline, b""):
        process.tail.append(line.decode(errors="replace").rstrip())
    process.popen.stdout.close()


def describe(process: Process, *, extra: str = "") -> dict[str, Any]:
    """What the status shows of one worker process."""
    return {
        "rank": process.place.rank,
        "host": process.place.host,
        "pid": process.remote_pid or process.popen.pid,
        "running": process.exit_code() is None,
        **({"note": extra} if extra else {}),
    }

"""A worker rank: ``python -m mlx_nbengine.engine.ranks.worker``, started by `RankGroup`.

It connects to rank 0 (``MLX_NBENGINE_RANK0``, the secret on stdin), sends a heartbeat
every `HEARTBEAT_S` from a thread of its own, joins the ring when told (``init``), loads
only its shard (``load``), opens its own block store (a scratch file of its own, through
its own cache-I/O thread) and then replays rank 0's step plans in order (`Replay`). It
decides nothing: which call, which tokens, which block to save or restore, all come from
rank 0. Its store answers rank 0's questions (``holds``, ``restore``, ``store``) from its
cache-I/O thread, so the replay goes on meanwhile.

It exits when told (``stop``: its store closes, which deletes its scratch file), when its
channel closes (rank 0 is gone), and on any error (reported first, naming the step).
SIGINT is ignored: a terminal's Ctrl-C must not kill one rank of a group mid-step.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback

HEARTBEAT_S = 1.0


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    secret = bytes.fromhex(sys.stdin.readline().strip())
    rank = int(os.environ["MLX_RANK"])
    host, port = os.environ["MLX_NBENGINE_RANK0"].rsplit(":", 1)
    from mlx_nbengine.engine.ranks import plans
    from mlx_nbengine.engine.ranks.channel import ChannelClosed, connect

    link = connect((host, int(port)), secret, timeout=30)
    link.sock.settimeout(None)
    link.send(plans.Hello(rank=rank, pid=os.getpid(), host=socket.gethostname()))

    def beat() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                link.send(plans.Alive())
            except ChannelClosed:
                os._exit(0)

    threading.Thread(target=beat, name="mlx-nbengine-heartbeat", daemon=True).start()
    from mlx_nbengine.engine.ranks.replay import Replay  # imports MLX: after the hello

    replay = Replay(link, rank)
    try:
        replay.run()
    except ChannelClosed:
        os._exit(0)  # rank 0 is gone; the scratch file is unlinked, nothing is left
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then exit
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        try:
            link.send(plans.Failed(message=message, trace=traceback.format_exc()[-4000:]))
        except ChannelClosed:
            pass
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        os._exit(1)
    replay.close()
    os._exit(0)


if __name__ == "__main__":
    main()

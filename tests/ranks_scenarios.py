"""Scenarios of a model sharded over two local ranks, each run in a process of its own.

`tests/integration/test_ranks.py` runs ``python tests/ranks_scenarios.py SCENARIO MODEL CACHE_DIR
[SHARD]`` with a timeout and reads the one JSON line it prints last. A process of its own
per scenario: MLX makes one distributed group per process, for its whole life, so every
sharded engine needs a fresh process (a kernel restart, in a notebook).

- ``behaviour``: greedy tokens against the single-process engine; an edited prompt
  restored from disk on both ranks; four requests batched; a cancel; the status; whether
  our CPU kernels served each rank.
- ``kill``: the worker killed mid-request (SIGKILL) or stopped (SIGSTOP, `hang`): the
  error, how long it took, the engine closed; then a single-process engine loads in the
  same process and a second sharded one is refused in one line. For `hang`, the store
  thread's `give_back_memory` runs while the step's collective waits (MLX's
  `clear_cache` held the GIL there, which froze the watchdog).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time

from mlx_nbengine.engine import Engine
from mlx_nbengine.engine.memory import give_back_memory
from mlx_nbengine.engine.ranks import plans

PROMPT = list(range(5, 45))
EDITED = PROMPT[:30] + [99] + PROMPT[31:]
BATCH = [list(range(7 + i, 27 + 6 * i)) for i in range(4)]


def single_process(model: str, cache_dir: str) -> dict:
    with Engine.load(model, block_size=16, cache_dir=cache_dir) as engine:
        plain = engine.submit(PROMPT, max_tokens=12).result().tokens
        engine.wait_for_saves(10)
        engine.drop_hot_cache()
        edited = engine.submit(EDITED, max_tokens=12).result()
        batch = [engine.submit(p, max_tokens=10).result().tokens for p in BATCH]
    return {
        "plain": plain,
        "edited": edited.tokens,
        "restored": edited.report.restored_tokens,
        "batch": batch,
    }


def behaviour(model: str, cache_dir: str, shard: str | None) -> dict:
    cold = single_process(model, cache_dir)
    engine = Engine.load(model, ranks=2, shard=shard, block_size=16, cache_dir=cache_dir)
    out: dict = {"pids": [w["pid"] for w in engine.stats()["sharded"]["workers"]]}
    out["plain"] = engine.submit(PROMPT, max_tokens=12).result().tokens == cold["plain"]
    engine.wait_for_saves(10)
    engine.drop_hot_cache()  # the edited prompt restores from every rank's disk store
    edited = engine.submit(EDITED, max_tokens=12).result()
    out["edited"] = edited.tokens == cold["edited"]
    out["edited_sources"] = [b.source for b in edited.report.blocks]
    out["restored"] = [edited.report.restored_tokens, cold["restored"]]
    handles = [engine.submit(p, max_tokens=10) for p in BATCH]  # submitted together
    out["batch"] = [h.result(timeout=60).tokens for h in handles] == cold["batch"]
    handle = engine.submit(PROMPT, max_tokens=500)
    for _ in handle.stream(timeout=60):
        handle.cancel()
        break
    cancelled = handle.result(timeout=60)
    out["cancel"] = [cancelled.finish_reason, len(cancelled.tokens)]
    out["after_cancel"] = engine.submit(PROMPT, max_tokens=12).result().tokens == cold["plain"]
    status = engine.stats()["sharded"]
    out["status"] = {
        "ranks": status["ranks"],
        "hosts": status["hosts"],
        "shard": status["shard"],
        "rank0_blocks": status["rank0_store"]["blocks_held"],
        "worker_blocks": status["workers"][0]["store"]["blocks_held"],
        "worker_restores": status["workers"][0]["store"]["restores"],
    }
    # A block only rank 0 holds is not restored: the worker's store emptied alone, the
    # edited prompt is computed on every rank, with a cold run's tokens.
    engine.sharded.group.ask(plans.ClearStore())
    engine.drop_hot_cache()
    alone = engine.submit(EDITED, max_tokens=12).result()
    blocks = alone.report.blocks
    out["rank0_only"] = [alone.tokens == cold["edited"], [(b.source, b.reason) for b in blocks]]
    engine.clear_cache()
    out["cleared"] = [w["store"]["blocks_held"] for w in engine.stats()["sharded"]["workers"]]
    out["kernels"] = kernels_in_use(out["pids"], engine.model.routing.names())
    engine.close()
    return out


def kernels_in_use(pids: list[int], routes: tuple[str, ...]) -> dict:
    """Rank 0's kernel set and routes (quantized products, attention: of `routes`, its
    model's), and whether each worker process has our kernels' module loaded. Rank 0's
    quantized products are routed where any quantized layer is (a tensor-sharded model's
    projections are mlx's sharded layers; its head is ours)."""
    from mlx_nbengine import kernels
    from mlx_nbengine.kernels.build import MODULE_NAME

    def loaded(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as maps:
            return MODULE_NAME in maps.read()

    return {
        "rank0": [
            kernels.status().isa,
            any(name.startswith("quantized-") for name in routes),
            "attention" in routes,
        ],
        "workers": [loaded(pid) for pid in pids],
    }


def kill(model: str, cache_dir: str, how: str, hosts: list[str] | None = None) -> dict:
    where = {"hosts": hosts} if hosts else {"ranks": 2}
    engine = Engine.load(model, block_size=16, cache_dir=cache_dir, **where)
    pid = engine.stats()["sharded"]["workers"][0]["pid"]
    handle = engine.submit(PROMPT, max_tokens=4000)
    out: dict = {"pids": [pid]}
    started = None
    try:
        for n, _ in enumerate(handle.stream(timeout=60)):
            if n == 10:
                os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                started = time.monotonic()
                if how == "hang":  # as the store's thread does when it goes idle
                    threading.Timer(0.5, give_back_memory).start()
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - the error is what the scenario reports
        out["error"] = [type(exc).__name__, str(exc)]
    out["seconds"] = None if started is None else time.monotonic() - started
    out["closed"] = engine.closed
    try:
        engine.submit(PROMPT, max_tokens=2)
        out["submit_after"] = None
    except Exception as exc:  # noqa: BLE001
        out["submit_after"] = [type(exc).__name__, str(exc)]
    engine.close()
    try:
        Engine.load(model, ranks=2, block_size=16, cache_dir=cache_dir)
        out["second"] = None
    except Exception as exc:  # noqa: BLE001
        out["second"] = [type(exc).__name__, str(exc)]
    try:
        with Engine.load(model, block_size=16, cache_dir=cache_dir) as single:
            out["single_after"] = len(single.submit(PROMPT, max_tokens=4).result().tokens)
    except Exception as exc:  # noqa: BLE001 - MLX stuck in the lost group's step
        out["single_after"] = [type(exc).__name__, str(exc)]
    return out


def orphan(model: str, cache_dir: str) -> None:
    """Print the worker's pid mid-request, then wait to be killed (rank 0 dies)."""
    engine = Engine.load(model, ranks=2, block_size=16, cache_dir=cache_dir)
    pid = engine.stats()["sharded"]["workers"][0]["pid"]
    handle = engine.submit(PROMPT, max_tokens=100000)
    next(iter(handle.stream(timeout=60)))
    print(json.dumps({"pids": [pid]}), flush=True)
    time.sleep(120)


def magics(model: str, cache_dir: str) -> dict:
    """`%load_model --ranks 2`, a `%%llm` cell, `%llm_status`, `%unload_model` in IPython."""
    import contextlib
    import io

    from IPython.core.interactiveshell import InteractiveShell

    from mlx_nbengine.notebook import magics as face

    shell = InteractiveShell.instance()
    loaded = face.load_ipython_extension(shell)  # the real engine factory: Engine.load
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        options = f"--ranks 2 --block-size 16 --cache-dir {cache_dir}"
        shell.run_line_magic("load_model", f"{model} {options}")
        shell.run_cell_magic("llm", "--raw --max-tokens 6 -o answer", "one two three four")
        shell.run_line_magic("llm_status", "")
        engine = loaded.session.engine
        pids = [w["pid"] for w in engine.stats()["sharded"]["workers"]]
        shell.run_line_magic("unload_model", "")
    out = {"pids": pids, "closed": engine.closed}
    answer = shell.user_ns.get("answer")
    return {**out, "shown": shown.getvalue(), "tokens": len(getattr(answer, "tokens", []))}


def main() -> None:
    scenario, model, cache_dir, *rest = sys.argv[1:]
    if "SCENARIO_STACKS_AFTER_S" in os.environ:  # a hang names where every thread waits
        faulthandler.dump_traceback_later(float(os.environ["SCENARIO_STACKS_AFTER_S"]))
    if scenario == "magics":
        print(json.dumps(magics(model, cache_dir)), flush=True)
        return
    if scenario == "orphan":
        orphan(model, cache_dir)
        return
    if scenario == "behaviour":
        result = behaviour(model, cache_dir, rest[0] if rest else None)
    elif scenario == "ssh":  # rank 1 over ssh (integration/test_ranks.py: where sshd lets us in)
        cold = single_process(model, cache_dir)
        engine = Engine.load(model, hosts=["127.0.0.1", rest[0]], block_size=16)
        worker = engine.stats()["sharded"]["workers"][0]
        same = engine.submit(PROMPT, max_tokens=12).result().tokens == cold["plain"]
        engine.close()
        result = {"pids": [worker["pid"]], "host": worker["host"], "same": same}
    else:  # kill / hang, [HOST]: its rank 1 over ssh
        result = kill(model, cache_dir, scenario, hosts=["127.0.0.1", *rest] if rest else None)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""A model sharded over two local MLX ranks (ring backend on loopback), driven by one engine.

The sharded scenarios run in a process each (`ranks_scenarios.py`: MLX forms one
distributed group per process) under a timeout, and after each the worker processes and
the scratch folder are checked: nothing may be left. Tensor parallelism on tiny llama
(two key/value heads, so each rank holds one), pipeline and tensor on tiny qwen3_5
(recurrent and full-attention layers), and the faults.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import needs  # tests/ is on sys.path
import pytest
from kernelsets import needs_kernels

from mlx_nbengine import kernels
from mlx_nbengine.engine import Engine
from mlx_nbengine.engine.ranks import NotShardableError, RankLostError
from mlx_nbengine.engine.ranks.shard import choose_mode, modes_of
from mlx_nbengine.testing import make_tiny_quantized_model

SCENARIOS = Path(__file__).parents[1] / "ranks_scenarios.py"


def scenario(*args: str, timeout: float, env: dict | None = None) -> dict:
    """Run one scenario in a process of its own; its JSON result."""
    proc = subprocess.Popen(
        [sys.executable, str(SCENARIOS), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # Our CPU kernels off unless `env` turns them on (they are then the module this
        # session built): a scenario must not wait for their first build; the
        # single-process runs it compares with run the same way.
        # Where it runs long, it prints every thread's stack first (`faulthandler`).
        env={
            **os.environ,
            "MLX_NBENGINE_KERNELS": "off",
            "SCENARIO_STACKS_AFTER_S": str(timeout - 10),
            **(env or {}),
        },
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"scenario {args[0]} ran past {timeout} s: {err[-8000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"scenario failed ({proc.returncode}): {err[-3000:]}"
    return json.loads(lines[-1])


def assert_nothing_left(result: dict, cache_dir: Path) -> None:
    deadline = time.monotonic() + 10
    for pid in result["pids"]:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            state = (
                Path(f"/proc/{pid}/stat").read_text().split()[2]
                if os.path.exists(f"/proc/{pid}/stat")
                else "?"
            )
            if state == "Z" or time.monotonic() > deadline:
                assert state == "Z", f"worker {pid} still running ({state})"
                break
            time.sleep(0.1)
    assert list(cache_dir.iterdir()) == [], "a scratch file was left behind"


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    d = tmp_path / "scratch"
    d.mkdir()
    return d


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("family", "shard"), [("llama", "tensor"), ("qwen3_5", "pipeline"), ("qwen3_5", "tensor")]
)
def test_two_ranks_serve_as_one_process(tiny_model_dir, cache_dir, family, shard):
    model = tiny_model_dir(family, kv_heads=2)
    result = scenario("behaviour", str(model), str(cache_dir), shard, timeout=180)
    assert_served_as_one_process(result, cache_dir, shard)
    assert result["kernels"] == {"rank0": [None, False, False], "workers": [False]}


@pytest.fixture(scope="module")
def tiny_llama_q8(tmp_path_factory) -> Path:
    return make_tiny_quantized_model(
        "llama", tmp_path_factory.mktemp("q8") / "tiny-llama-q8", bits=8, group_size=32, kv_heads=2
    )


@needs_kernels
@pytest.mark.timeout(200)
def test_two_ranks_serve_a_quantized_model_on_the_cpu_kernels(tiny_llama_q8, cache_dir):
    """As users run a sharded model: 8-bit weights, our CPU kernels on (the module this
    session built, found in the same cache home), llama's own shard mode (tensor). The
    sharded projections run on MLX's kernels; the head, attention and norms on ours, on every
    rank, and the tokens are the single-process engine's (its kernels on too)."""
    env = {"MLX_NBENGINE_KERNELS": "auto"}
    result = scenario(
        "behaviour", str(tiny_llama_q8), str(cache_dir), "tensor", timeout=180, env=env
    )
    assert_served_as_one_process(result, cache_dir, "tensor")
    assert result["kernels"] == {"rank0": [kernels.status().isa, True, True], "workers": [True]}


def assert_served_as_one_process(result: dict, cache_dir: Path, shard: str) -> None:
    assert result["plain"], "greedy tokens differ from the single-process engine"
    assert result["edited"], "the edited prompt's tokens differ from a cold run's"
    assert result["edited_sources"][0] == "disk"
    assert result["restored"][0] == result["restored"][1] > 0
    assert result["status"]["worker_restores"] >= 1, "the worker rebuilt no restore"
    assert result["status"]["worker_blocks"] == result["status"]["rank0_blocks"] > 0
    assert result["rank0_only"][0], "tokens differ when only rank 0 held the blocks"
    sources = result["rank0_only"][1]
    assert all(source != "disk" for source, _ in sources), "restored what a rank lacked"
    assert sources[0] == ["computed", "evicted"], "the block a rank lost is not called evicted"
    assert result["cleared"] == [0], "clear_cache left blocks in the worker's store"
    assert result["batch"], "four batched requests differ from one by one"
    assert result["cancel"][0] == "cancelled"
    assert result["after_cancel"]
    assert result["status"]["ranks"] == 2 and result["status"]["shard"] == shard
    assert result["status"]["hosts"] == ["127.0.0.1", "127.0.0.1"]
    assert_nothing_left(result, cache_dir)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_lost_worker_fails_its_requests_in_one_line(tiny_model_dir, cache_dir, how):
    model = tiny_model_dir("llama", kv_heads=2)
    env = {"MLX_NBENGINE_RANK_TIMEOUT_S": "3"}
    result = scenario(how, str(model), str(cache_dir), timeout=120, env=env)
    kind, message = result["error"]
    assert kind == "RankLostError"
    assert "rank 1 on 127.0.0.1" in message
    assert ("exited" in message) if how == "kill" else ("hung" in message)
    assert result["seconds"] < 30
    assert result["closed"]
    # A later request is refused with the same line.
    assert result["submit_after"][0] == "EngineClosedError"
    assert "rank 1 on 127.0.0.1" in result["submit_after"][1]
    # A second sharded engine in the same process is refused in one line (MLX: one group
    # per process). A single-process engine loads there as usual, unless MLX itself is
    # stuck in the lost group's collective (its ring backend does not always give up):
    # then every load says so in one line, and the process still exits.
    second, single = result["second"], result["single_after"]
    assert second[0] in ("RingUsedError", "EngineClosedError")
    assert "restart the kernel" in second[1] and "\n" not in second[1]
    if second[0] == "RingUsedError":
        assert single == 4
    else:
        assert single[0] == "EngineClosedError" and "restart the kernel" in single[1]
    assert_nothing_left(result, cache_dir)


@pytest.mark.timeout(120)
def test_workers_exit_when_rank_0_dies(tiny_model_dir, cache_dir):
    """A kernel killed outright (no atexit) leaves no worker behind: each notices its
    control channel close."""
    model = tiny_model_dir("llama", kv_heads=2)
    proc = subprocess.Popen(
        [sys.executable, str(SCENARIOS), "orphan", str(model), str(cache_dir)],
        env={**os.environ, "MLX_NBENGINE_KERNELS": "off"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        result = json.loads(line)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert_nothing_left(result, cache_dir)


def test_a_host_that_cannot_be_reached_fails_the_load_in_one_line(tiny_model_dir):
    model = tiny_model_dir("llama", kv_heads=2)
    with pytest.raises(RankLostError) as caught:
        Engine.load(model, hosts=["127.0.0.1", "no-such-host.invalid"])
    assert "rank 1 on no-such-host.invalid cannot be reached" in str(caught.value)
    # An address ssh cannot log in to (no sshd there, or no key): the worker's ssh exits.
    started = time.monotonic()
    with pytest.raises(RankLostError) as caught:
        Engine.load(model, hosts=["127.0.0.1", "127.0.0.3"])
    assert "rank 1 on 127.0.0.3" in str(caught.value) and "\n" not in str(caught.value)
    assert time.monotonic() - started < 60


@pytest.mark.timeout(150)
def test_the_notebook_drives_two_ranks(tiny_model_dir, cache_dir):
    """`%load_model --ranks 2` (the real engine factory), a `%%llm` cell, `%llm_status`
    showing both ranks, `%unload_model` stopping the worker."""
    model = tiny_model_dir("llama", kv_heads=2)
    result = scenario("magics", str(model), str(cache_dir), timeout=120)
    assert result["tokens"] == 6
    shown = result["shown"]
    assert "ranks" in shown and "tensor" in shown and "rank 1" in shown
    assert f"pid {result['pids'][0]} running" in shown
    assert "unloaded" in shown and result["closed"]
    assert_nothing_left(result, cache_dir)


SSH_HOST = "127.0.0.2"  # a loopback address: an sshd there is this machine


def _ssh_works() -> bool:
    try:
        done = subprocess.run(
            ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", SSH_HOST, "true"],
            capture_output=True,
            timeout=10,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.timeout(200)
def test_a_rank_over_ssh(tiny_model_dir, cache_dir):
    """`hosts=[...]`: rank 1 started over ssh, as on a second machine (here an sshd on a
    loopback address, which .ci/run starts; outside CI skipped where ssh cannot log in
    there without a password)."""
    if not _ssh_works():
        needs.missing(f"no password-less ssh to {SSH_HOST} here (.ci/run starts an sshd)")
    model = tiny_model_dir("llama", kv_heads=2)
    result = scenario("ssh", str(model), str(cache_dir), SSH_HOST, timeout=180)
    assert result["host"] == SSH_HOST and result["same"]
    assert_nothing_left(result, cache_dir)
    killed = scenario("kill", str(model), str(cache_dir), SSH_HOST, timeout=120)
    kind, message = killed["error"]
    assert kind == "RankLostError" and f"rank 1 on {SSH_HOST}" in message
    assert killed["seconds"] < 30
    assert_nothing_left(killed, cache_dir)


def test_a_family_mlx_lm_cannot_shard_gets_one_line(tiny_model_dir):
    model = tiny_model_dir("gemma3_text")
    with pytest.raises(NotShardableError) as caught:
        Engine.load(model, ranks=2)
    message = str(caught.value)
    assert "\n" not in message
    assert "gemma3_text" in message and "llama" in message and "qwen3_5" in message


def test_shard_modes_follow_mlx_lm():
    assert modes_of("llama") == ("tensor",)
    assert modes_of("qwen3_5") == ("tensor", "pipeline")
    assert modes_of("gemma3_text") == ()
    assert choose_mode("qwen3_5", None) == "tensor"
    with pytest.raises(NotShardableError, match="not pipeline"):
        choose_mode("llama", "pipeline")


def test_bad_rank_options_are_refused(tiny_model_dir):
    model = tiny_model_dir("llama", kv_heads=2)
    with pytest.raises(ValueError, match="ranks must be"):
        Engine.load(model, ranks=1)
    with pytest.raises(ValueError, match="persist_dir"):
        Engine.load(model, ranks=2, persist_dir="/nonexistent-dir-for-test")


# --- %load_model --ranks / --hosts / --shard and %llm_status ---------------------------------


class _StatusEngine:
    """What `%llm_status` reads of a sharded engine (its `stats()`)."""

    def __init__(self, model: str, **options) -> None:
        self.options = options
        self.model = None
        _StatusEngine.last = self

    def stats(self) -> dict:
        worker_store = {"blocks_held": 3, "bytes_held": 4096, "restores": 1}
        return {
            "active": 0,
            "queued": 0,
            "sharded": {
                "ranks": 2,
                "hosts": ["127.0.0.1", "127.0.0.1"],
                "shard": "tensor",
                "rank0_store": {"blocks_held": 3, "bytes_held": 4096},
                "workers": [
                    {
                        "rank": 1,
                        "host": "127.0.0.1",
                        "pid": 4242,
                        "running": True,
                        "store": worker_store,
                    }
                ],
                "error": None,
            },
        }

    def close(self) -> None:
        pass


@pytest.fixture
def ip():
    from IPython.core.interactiveshell import InteractiveShell

    from mlx_nbengine.notebook import magics

    shell = InteractiveShell.instance()
    magics.unload_ipython_extension(shell)
    magics.load_ipython_extension(shell, engine_factory=_StatusEngine)
    yield shell
    magics.unload_ipython_extension(shell)


def test_load_model_takes_ranks_hosts_and_shard(ip):
    ip.run_line_magic("load_model", "tiny --ranks 2 --shard pipeline")
    assert _StatusEngine.last.options["ranks"] == 2
    assert _StatusEngine.last.options["shard"] == "pipeline"
    ip.run_line_magic("load_model", "tiny --hosts this-mac,other-mac")
    assert _StatusEngine.last.options["hosts"] == ["this-mac", "other-mac"]
    from IPython.core.error import UsageError

    for bad in (
        "tiny --ranks 1",
        "tiny --shard tensor",
        "tiny --ranks 2 --hosts a,b",
        "tiny --hosts a",
    ):
        with pytest.raises(UsageError):
            ip.run_line_magic("load_model", bad)


def test_llm_status_shows_ranks_hosts_shard_and_each_store(ip, capsys):
    from mlx_nbengine.notebook.magics import rank_rows

    rows = dict(rank_rows(_StatusEngine("x").stats()["sharded"]))
    assert rows["ranks"] == 2
    assert rows["hosts"] == "127.0.0.1, 127.0.0.1"
    assert rows["shard"] == "tensor"
    assert "3 blocks" in rows["rank 0"] and "this kernel" in rows["rank 0"]
    assert "pid 4242 running" in rows["rank 1"] and "3 blocks" in rows["rank 1"]
    ip.run_line_magic("load_model", "tiny --ranks 2")
    ip.run_line_magic("llm_status", "")
    shown = capsys.readouterr().out
    assert "rank 1" in shown and "pid 4242" in shown

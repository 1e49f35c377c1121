"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) driven by the
real ``anthropic`` client, as Claude Code speaks it.

A tiny random-weight llama (16-token blocks) is served on 127.0.0.1 at a free port; answers
are compared with `Engine.submit` on the same engine (greedy, so the same tokens). A second
tiny llama has a chat template in Qwen 3's way (tools in a system block, calls written
``<tool_call>{json}</tool_call>``, the generation prompt opening ``<think>``), for thinking
blocks and the tool loop.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")

from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.server import ApiServer, Limits  # noqa: E402
from mlx_nbengine.server.agentio import template_messages  # noqa: E402

BLOCK = 16
KEY = "sk-test-messages"
LONG = (
    "The Eiffel Tower is located in the city of Paris, the capital of France. "
    "A block of two hundred and fifty six tokens is cached on disk and restored later. "
)
# Greedy: the SDK has no temperature argument (the API takes the field).
GREEDY = {"extra_body": {"temperature": 0}}
# A 128,000-token request is answered (clamped to the context, never refused); a stop
# sequence the tiny model soon writes ends it well before the context does.
STOP_EARLY = [" ", "e", "a", "o", "t", "i", "n", "s"]
MARKS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# Qwen 3's way: tools in a system block, calls as <tool_call>{json}</tool_call> (mlx-lm reads
# "tool_call.name" and picks its json_tools parser), tool results in <tool_response>, and
# the generation prompt opens <think> unless enable_thinking is false.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\nTools:{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set tool_call = call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)

# Bounded arguments: a random model's forced call ends (a free number or string may not).
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 8},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}
CONVERT = {
    "name": "convert",
    "description": "Convert a temperature",
    "input_schema": {
        "type": "object",
        "properties": {"to": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["to"],
    },
}


def function_tool(tool: dict) -> dict:
    return {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool["description"],
            "parameters": tool["input_schema"],
        },
    }


@pytest.fixture(scope="module", autouse=True)
def _no_anthropic_environment():
    """The SDK reads ANTHROPIC_AUTH_TOKEN, ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL from the
    environment; a machine that sets them must not change what these tests send."""
    import os

    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("ANTHROPIC_")]:
            mp.delenv(name)
        yield


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with Engine.load(tiny_model_dir("llama"), block_size=BLOCK, parallel=4) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    srv = ApiServer(engine, port=0, limits=Limits(context=8192)).start()
    yield srv
    srv.stop()


def base_url(server) -> str:
    return server.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(
        base_url=base_url(server), api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def tool_engine(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("tool-llama"))
    make_tiny_tokenizer(directory, extra_special_tokens=MARKS, chat_template=TOOL_TEMPLATE)
    with Engine.load(directory, block_size=BLOCK, parallel=2) as e:
        yield e


@pytest.fixture(scope="module")
def tools(tool_engine):
    """A server on the tool engine with an API key, and its client."""
    srv = ApiServer(tool_engine, port=0, api_key=KEY).start()
    client = anthropic.Anthropic(base_url=base_url(srv), api_key=KEY, max_retries=0, timeout=60)
    yield srv, client
    srv.stop()


def reference(engine, prompt, **kwargs):
    """The engine's own answer, cold (both caches emptied first)."""
    engine.clear_cache()
    done = engine.submit(prompt, **kwargs).result(timeout=60)
    engine.clear_cache()
    return done


def chat(question: str) -> list[dict]:
    return [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": question},
    ]


def user(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{base_url(server)}{path}", timeout=60, **kwargs)


def anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == kind
    message = body["error"]["message"]
    assert message and "\n" not in message
    return message


def still_served(client) -> None:
    ok = client.messages.create(
        model="claude-opus-5-5", max_tokens=2, messages=user("hi"), **GREEDY
    )
    assert ok.usage.output_tokens == 2


def last_entry(server):
    return server.journal.entries()[-1]


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[6:])))
            name = None
    return events


# -- answers -------------------------------------------------------------------------------------


def test_create_gives_the_engines_tokens_under_any_model_name(client, engine):
    want = reference(engine, chat("What is the capital of Italy?"), max_tokens=20)
    got = client.messages.create(
        model="claude-opus-5-5",
        system="You answer briefly.",
        messages=user("What is the capital of Italy?"),
        max_tokens=20,
        **GREEDY,
    )
    assert got.type == "message" and got.role == "assistant" and got.id.startswith("msg_")
    assert got.model == engine.model_name
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.text
    assert got.stop_reason == "max_tokens" and got.stop_sequence is None
    assert got.usage.input_tokens == len(want.prompt_tokens)
    assert got.usage.output_tokens == 20
    assert got.usage.cache_read_input_tokens == 0  # cold
    assert got.usage.cache_creation_input_tokens == 0


def test_system_blocks_and_content_blocks_render_like_strings(client, engine):
    """Claude Code sends ``system`` and user turns as text blocks with cache_control."""
    want = reference(engine, chat("Explain the weather today."), max_tokens=12)
    got = client.messages.create(
        model="claude-sonnet-9",
        system=[
            {"type": "text", "text": "You answer briefly.", "cache_control": {"type": "ephemeral"}}
        ],
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "Explain the weather today.",
                        "cache_control": {"type": "ephemeral", "ttl": "1h"},
                    }
                ],
            }
        ],
        max_tokens=12,
        metadata={"user_id": "someone"},
        extra_body={"temperature": 0, "top_k": 40},
    )
    assert got.content[0].text == want.text
    assert got.usage.input_tokens == len(want.prompt_tokens)


def test_streamed_events_in_anthropics_order(server, engine):
    want = reference(engine, chat("Count to ten."), max_tokens=16)
    body = {
        "model": "claude-opus-5-5",
        "system": "You answer briefly.",
        "messages": user("Count to ten."),
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{base_url(server)}/v1/messages", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    names = [name for name, _ in events]
    assert all(data["type"] == name for name, data in events)
    assert names[:2] == ["message_start", "ping"]  # at once, before the prompt is read
    assert names[-2:] == ["message_delta", "message_stop"]
    kinds = [n for n in names if n != "ping"]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["model"] == engine.model_name and start["id"].startswith("msg_")
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == want.text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 16
    assert delta["usage"]["input_tokens"] == len(want.prompt_tokens)


def test_pings_keep_the_stream_alive_while_the_prompt_waits(server, engine, monkeypatch):
    """No token comes while the prompt is read (here: the generation thread is held): a
    ping every keep-alive interval, then the answer."""
    from mlx_nbengine.server import transport

    monkeypatch.setattr(transport, "KEEPALIVE_S", 0.05)
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(60)

    holder = threading.Thread(target=engine.on_model_thread, args=(hold,))
    holder.start()
    body = {"model": "m", "messages": user("hi"), "max_tokens": 3, "stream": True, "temperature": 0}
    names = []
    try:
        assert entered.wait(30)
        with httpx.stream("POST", f"{base_url(server)}/v1/messages", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("event: "):
                    names.append(line[7:])
                if names.count("ping") == 4:
                    release.set()  # the model thread goes on: the answer comes
            assert names[-1] == "message_stop"
    finally:
        release.set()
        holder.join()
    assert names[:4] == ["message_start", "ping", "ping", "ping"]
    assert names.index("content_block_start") > names.index("ping") + 2


def test_the_sdks_stream_and_final_message(client, engine):
    want = reference(engine, chat("Tell me about Paris."), max_tokens=24)
    kwargs = dict(
        model="claude-opus-5-5",
        system="You answer briefly.",
        messages=user("Tell me about Paris."),
        max_tokens=24,
        **GREEDY,
    )
    raw = list(client.messages.create(stream=True, **kwargs))
    assert raw[0].type == "message_start" and raw[-1].type == "message_stop"
    text = "".join(e.delta.text for e in raw if e.type == "content_block_delta")
    assert text == want.text
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == want.text
    assert final.content[0].text == want.text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24
    prompt = len(want.prompt_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt


def test_stop_sequences_cut_the_answer_and_name_the_sequence(client, engine):
    greedy = reference(engine, user("Count to ten."), max_tokens=20)
    stop = greedy.text[6:9]
    assert stop and stop not in greedy.text[:6]
    kwargs = dict(
        model="m", messages=user("Count to ten."), max_tokens=20, **GREEDY,
        stop_sequences=["never appears here", stop],
    )  # fmt: skip
    cut = client.messages.create(**kwargs)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == greedy.text[: greedy.text.index(stop)]
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == cut.content[0].text


def test_max_tokens_is_clamped_and_sampling_reaches_the_engine(client, engine):
    sampled = {"temperature": 0.9, "top_p": 0.8}  # no seed in Anthropic's API
    got = client.messages.create(
        model="m", messages=user("Count to ten."), max_tokens=12, extra_body=sampled
    )
    assert got.usage.output_tokens == 12 and got.stop_reason == "max_tokens"
    big = client.messages.create(
        model="claude-opus-5-5",
        messages=user("hi"),
        max_tokens=128_000,
        stop_sequences=STOP_EARLY,
        **GREEDY,
    )
    assert big.usage.output_tokens >= 1  # clamped to the context, not refused


def test_count_tokens_is_the_rendered_prompts_length(client, engine):
    msgs = chat("What is two plus two?")
    want = len(engine.model.apply_chat_template(msgs))
    counted = client.messages.count_tokens(
        model="claude-opus-5-5", system="You answer briefly.", messages=user(msgs[1]["content"])
    )
    assert counted.input_tokens == want
    engine.clear_cache()
    answer = client.messages.create(
        model="claude-opus-5-5",
        system="You answer briefly.",
        messages=user(msgs[1]["content"]),
        max_tokens=2,
        **GREEDY,
    )
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == want
    assert engine.stats()["active"] == 0


def test_a_second_turn_reads_the_shared_prefix_from_the_cache(client, engine, server):
    engine.clear_cache()
    system = LONG * 4 + "You answer briefly."
    first_turn = user("Summarize the text above.")
    first = client.messages.create(
        model="m", system=system, messages=first_turn, max_tokens=6, **GREEDY
    )
    assert first.usage.cache_read_input_tokens == 0
    second_turn = [
        *first_turn,
        {"role": "assistant", "content": first.content[0].text},
        {"role": "user", "content": "Now in one word."},
    ]
    second = client.messages.create(
        model="m", system=system, messages=second_turn, max_tokens=4, **GREEDY
    )
    cached = second.usage.cache_read_input_tokens
    prompt = client.messages.count_tokens(model="m", system=system, messages=second_turn)
    assert cached >= first.usage.input_tokens - 2 * BLOCK and cached > 0
    assert second.usage.input_tokens + cached == prompt.input_tokens
    entry = last_entry(server)
    assert entry.endpoint == "/v1/messages"
    assert entry.restored_memory + entry.restored_disk == cached


def test_beta_query_headers_and_claude_codes_fields_are_taken(tools, tool_engine):
    """What Claude Code sends: ``?beta=true``, a long anthropic-beta header, adaptive
    thinking, context_management, output_config, metadata, 128,000 max_tokens, server
    tools beside its own."""
    srv, client = tools
    betas = [
        "claude-code-20250219",
        "oauth-2025-04-20",
        "interleaved-thinking-2025-05-14",
        "context-management-2025-06-27",
        "fine-grained-tool-streaming-2025-05-14",
    ]
    got = client.beta.messages.create(
        model="claude-opus-5-5",
        max_tokens=128_000,
        system=[
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}
        ],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        tools=[WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        thinking={"type": "adaptive"},
        betas=betas,
        metadata={"user_id": "user_abc_account_def_session_ghi"},
        stop_sequences=STOP_EARLY,
        extra_body={
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "some_future_field": {"x": 1},
            "temperature": 0,
        },
        extra_headers={"anthropic-version": "2023-06-01", "x-app": "cli"},
        stream=False,
    )
    assert got.usage.output_tokens >= 1
    assert got.model == tool_engine.model_name
    assert last_entry(srv).endpoint == "/v1/messages"
    # The key as a bearer token (an OAuth-style client) is taken as well.
    bearer = anthropic.Anthropic(base_url=base_url(srv), auth_token=KEY, max_retries=0, timeout=60)
    counted = bearer.messages.count_tokens(model="x", messages=user("hi"))
    assert counted.input_tokens > 0


def test_thinking_blocks_when_the_template_opens_reasoning(tools, tool_engine):
    srv, client = tools
    want = reference(tool_engine, chat("What is two plus two?"), max_tokens=24)
    kwargs = dict(
        model="claude-opus-5-5",
        system="You answer briefly.",
        messages=user("What is two plus two?"),
        max_tokens=24,
        **GREEDY,
        thinking={"type": "enabled", "budget_tokens": 2048},
    )
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    # The answer begins inside the <think> the prompt opened: thinking first.
    thinking, _, text = want.text.partition("</think>")
    for message in (whole, final):
        assert message.content[0].type == "thinking"
        assert message.content[0].thinking == thinking
        assert message.content[0].signature
        assert "".join(b.text for b in message.content if b.type == "text") == text
    assert final.content[0].signature == whole.content[0].signature
    assert any(
        e.type == "content_block_delta" and e.delta.type == "signature_delta" for e in events
    )
    # Passed back with its signature (and a redacted block), the next turn is served.
    again = client.messages.create(
        **{
            **kwargs,
            "messages": [
                *user("What is two plus two?"),
                {
                    "role": "assistant",
                    "content": [
                        whole.content[0].model_dump(),
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "Four."},
                    ],
                },
                *user("And three plus three?"),
            ],
        }
    )
    assert again.usage.output_tokens >= 1


# -- the tool loop -------------------------------------------------------------------------------


def tool_conversation() -> tuple[list[dict], list[dict]]:
    """A tool loop's turns as Claude Code sends them, and the chat form they render as."""
    sent = [
        {"role": "user", "content": "What is the weather in Paris, in fahrenheit?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "abc"},
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_02",
                    "name": "convert",
                    "input": {"to": "fahrenheit"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "Sunny, 21 C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_02",
                    "content": [{"type": "text", "text": "70 F"}],
                    "is_error": False,
                },
                {"type": "text", "text": "Answer now."},
            ],
        },
    ]
    rendered = [
        {"role": "system", "content": "You use tools."},
        {"role": "user", "content": "What is the weather in Paris, in fahrenheit?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {
                    "id": "toolu_01",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "toolu_02",
                    "type": "function",
                    "function": {"name": "convert", "arguments": '{"to": "fahrenheit"}'},
                },
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "toolu_01",
            "name": "get_weather",
            "content": "Sunny, 21 C",
        },
        {"role": "tool", "tool_call_id": "toolu_02", "name": "convert", "content": "70 F"},
        {"role": "user", "content": "Answer now."},
    ]
    return sent, rendered


def test_tool_use_and_tool_result_turns_render_as_the_chat_form(tools, tool_engine):
    srv, client = tools
    sent, rendered = tool_conversation()
    lm = tool_engine.model
    chat_tools = [function_tool(WEATHER), function_tool(CONVERT)]
    want = lm.apply_chat_template(template_messages(rendered), tools=chat_tools)
    counted = client.messages.count_tokens(
        model="claude-opus-5-5", system="You use tools.", messages=sent, tools=[WEATHER, CONVERT]
    )
    assert counted.input_tokens == len(want)
    # The calls and results are in the prompt the model reads.
    text = lm.text_tokenizer.decode(want)
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
    answer = client.messages.create(
        model="claude-opus-5-5",
        system="You use tools.",
        messages=sent,
        tools=[WEATHER, CONVERT],
        max_tokens=4,
        **GREEDY,
    )
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == len(want)


def test_forced_tool_calls_and_the_loop_that_answers_them(tools, tool_engine):
    """``tool_choice`` any / tool: the engine's constrained decoding makes a random model
    call a tool; the result goes back, and the next answer comes."""
    srv, client = tools
    question = user("What is the weather in Paris?")
    ask = dict(model="claude-opus-5-5", tools=[WEATHER, CONVERT], max_tokens=200, **GREEDY)
    forced = client.messages.create(
        messages=question, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **ask
    )
    assert forced.stop_reason == "tool_use"
    (call,) = [b for b in forced.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name in ("get_weather", "convert")
    schema = {"get_weather": WEATHER, "convert": CONVERT}[call.name]["input_schema"]
    assert set(schema["required"]) <= set(call.input) <= set(schema["properties"])
    # Streamed, a named tool's call arrives as an input_json_delta.
    with client.messages.stream(
        messages=question, tool_choice={"type": "tool", "name": "convert"}, **ask
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    named = [b for b in final.content if b.type == "tool_use"]
    assert named and all(b.name == "convert" for b in named)
    assert all(b.input["to"] in ("celsius", "fahrenheit") for b in named)
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert any(e.delta.type == "input_json_delta" for e in deltas)
    # The loop: the result goes back, the model answers (no tool forced now).
    follow = client.messages.create(
        messages=[
            *question,
            {"role": "assistant", "content": [b.model_dump() for b in forced.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}],
            },
        ],
        **{**ask, "max_tokens": 8},
    )
    assert follow.usage.output_tokens >= 1
    assert follow.usage.cache_read_input_tokens > 0  # the first turn's prefix restored
    # tool_choice none: the tools stay out of the prompt, no call is read.
    calm = client.messages.create(messages=question, tool_choice={"type": "none"}, **ask)
    assert calm.stop_reason in ("end_turn", "max_tokens")
    assert not [b for b in calm.content if b.type == "tool_use"]


def test_blocks_events_build_the_same_message_in_the_sdk():
    """Pieces of every kind, in turn: the stream events `Blocks` makes, read by the SDK's
    own accumulator, give the content `Blocks` lists (the non-streamed answer)."""
    from anthropic.lib.streaming._messages import accumulate_event

    from mlx_nbengine.server.agentio import Reasoning, Text, ToolCall
    from mlx_nbengine.server.anthropic_shapes import Blocks, message_response, usage

    blocks = Blocks()
    events = [*blocks.feed([Reasoning("Let me "), Reasoning("think.")])]
    events += blocks.feed([Text("I will call "), Text("two tools.")])
    events += blocks.feed([ToolCall("call_1a", "get_weather", '{"city": "Paris"}')])
    events += blocks.feed([ToolCall("call_2b", "convert", "{}"), Text(""), Reasoning("")])
    events += blocks.feed([Text("Done.")])
    events += blocks.close()
    assert blocks.tool_calls == 2
    assert [e[0] for e in events].count("content_block_start") == 5
    assert [e[0] for e in events].count("content_block_stop") == 5
    start = message_response("msg_x", "m", [], None, None, usage(10, 0, 0))
    snapshot = accumulate_event(
        event={"type": "message_start", "message": start}, current_snapshot=None, json_bufs={}
    )
    buffers: dict = {}
    for name, payload in events:
        assert payload["type"] == name
        snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=buffers)
    streamed = [b.model_dump(exclude_none=True) for b in snapshot.content]
    assert streamed == blocks.content
    assert [b["type"] for b in blocks.content] == [
        "thinking",
        "text",
        "tool_use",
        "tool_use",
        "text",
    ]
    assert blocks.content[0]["thinking"] == "Let me think." and blocks.content[0]["signature"]
    assert blocks.content[2] == {
        "type": "tool_use",
        "id": "toolu_1a",
        "name": "get_weather",
        "input": {"city": "Paris"},
    }
    assert blocks.content[3]["input"] == {}


# -- a Claude Code-sized request -----------------------------------------------------------------

CLAUDE_CODE_TOOLS = (
    "Task Bash Glob Grep LS ExitPlanMode Read Edit MultiEdit Write NotebookEdit WebFetch "
    "TodoWrite WebSearch BashOutput KillShell SlashCommand Skill AskUserQuestion EnterPlanMode "
    "ListMcpResources ReadMcpResource"
).split()
BETAS = (
    "claude-code-20250219,oauth-2025-04-20,interleaved-thinking-2025-05-14,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,effort-2025-11-24,"
    "fine-grained-tool-streaming-2025-05-14,tool-search-2025-10-19"
)


def claude_code_body(turns: list[dict]) -> dict:
    """A request the size and shape of Claude Code's: about 90,000 characters, 22 tools
    with JSON schemas, system blocks, adaptive thinking and its other fields."""
    tools = []
    for n, name in enumerate(CLAUDE_CODE_TOOLS):
        tools.append(
            {
                "name": name,
                "description": f"The {name} tool. " + LONG * 12,
                "input_schema": {
                    "$schema": "http://json-schema.org/draft-07/schema#",
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "path": {"type": "string", "description": "An absolute path."},
                        "limit": {"type": "number", "description": f"At most {n} lines."},
                    },
                    "required": ["path"],
                },
            }
        )
    return {
        "model": "claude-opus-5-5",
        "max_tokens": 128_000,
        "stream": True,
        "system": [
            {"type": "text", "text": "You are Claude Code, a command line coding agent."},
            {"type": "text", "text": LONG * 264, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": turns,
        "tools": tools,
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_0123_account_4567_session_89ab"},
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def long_engine(tmp_path_factory):
    """The tool engine's template on a tiny llama whose context holds 65,536 tokens."""
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("long-llama"))
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 65_536
    (directory / "config.json").write_text(json.dumps(config))
    make_tiny_tokenizer(directory, extra_special_tokens=MARKS, chat_template=TOOL_TEMPLATE)
    with Engine.load(directory, block_size=256, parallel=1) as e:
        srv = ApiServer(e, port=0, api_key=KEY).start()
        yield e, srv
        srv.stop()


def test_a_claude_code_sized_request_is_streamed_and_its_next_turn_is_cached(long_engine):
    engine, srv = long_engine
    first = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>Be concise.</system-reminder>"},
                {"type": "text", "text": "Read the README and tell me what it says."},
            ],
        }
    ]
    body = claude_code_body(first)
    assert len(json.dumps(body)) >= 90_000 and len(body["tools"]) == 22
    headers = {
        "x-api-key": KEY,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": BETAS,
        "anthropic-dangerous-direct-browser-access": "true",
        "user-agent": "claude-cli/2.1.328 (external, cli)",
        "x-app": "cli",
    }
    url = f"{base_url(srv)}/v1/messages?beta=true"
    count_url = f"{base_url(srv)}/v1/messages/count_tokens?beta=true"
    counting = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
    counted = httpx.post(count_url, json=counting, headers=headers, timeout=120)
    assert counted.status_code == 200, counted.text
    prompt = counted.json()["input_tokens"]
    assert prompt > 20_000
    events = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if sum(e["type"] == "content_block_delta" for e in events) >= 3:
                break  # Claude Code's user pressed Esc: the stream is dropped
    start = events[0]
    assert start["type"] == "message_start"
    assert start["message"]["usage"]["input_tokens"] == prompt
    assert start["message"]["model"] == engine.model_name
    # The next turn: the long prefix is read back from the cache.
    second = [
        *first,
        {"role": "assistant", "content": [{"type": "text", "text": "It describes the project."}]},
        {"role": "user", "content": "Thanks. Now list the files."},
    ]
    body = {**claude_code_body(second), "stream": False, "max_tokens": 2}
    answer = httpx.post(url, json=body, headers=headers, timeout=300)
    assert answer.status_code == 200, answer.text
    use = answer.json()["usage"]
    assert use["cache_read_input_tokens"] > prompt * 0.9
    assert use["output_tokens"] == 2


CAPTURED = Path(__file__).parents[1] / "agents" / "claude_first_request.json"


def test_claude_codes_captured_first_request_renders_as_anthropic_reads_it():
    """Claude Code 2.1.328's first request, as recorded: its billing line is not prompt
    text, its mid-conversation system turn joins the user's turn (templates take a system
    message first only), its deferred placeholder tool is not shown."""
    from mlx_nbengine.server.anthropic_shapes import check_messages

    first = json.loads(CAPTURED.read_text())["first"]
    call = check_messages(first["body"], Limits(context=8192), vision=False)
    assert [m["role"] for m in call.prompt] == ["system", "user"]
    system, turn = call.prompt[0]["content"], call.prompt[1]["content"]
    assert "x-anthropic-billing-header" not in system
    assert system.startswith("You are a Claude agent")
    assert "Reply with the single word OK." in turn and "# Environment" in turn
    assert turn.index("Reply with the single word OK.") < turn.index("# Environment")
    names = [t["function"]["name"] for t in call.tools]
    assert "DeferredToolPlaceholder" not in names
    assert {"Bash", "Read", "Edit", "Write", "ToolSearch"} <= set(names)
    assert call.max_tokens == 8192 and call.stream and call.tool_choice == "auto"


def test_claude_codes_captured_first_request_is_answered(long_engine):
    """The recorded request, sent as Claude Code sent it (its query, headers and body)."""
    engine, srv = long_engine
    first = json.loads(CAPTURED.read_text())["first"]
    headers = {
        k: v
        for k, v in first["headers"].items()
        if k not in ("host", "content-length", "connection", "accept-encoding")
    }
    headers["x-api-key"] = KEY
    url = f"{base_url(srv)}{first['path']}?{first['query']}"
    body = {**first["body"], "temperature": 0}
    events = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            if any(e["type"] == "content_block_delta" for e in events):
                break  # the answer has begun: enough (the client drops the stream)
    assert events[0]["type"] == "message_start"
    assert events[0]["message"]["model"] == engine.model_name
    counting = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
    count_url = f"{base_url(srv)}/v1/messages/count_tokens?beta=true"
    counted = httpx.post(count_url, json=counting, headers=headers, timeout=120).json()
    assert events[0]["message"]["usage"]["input_tokens"] == counted["input_tokens"]


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, words",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": "12"}, "max_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
        ({"system": 5}, "system"),
        ({"tools": [{"name": "x"}]}, "input_schema"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ],
)
def test_a_bad_field_is_a_400_in_anthropics_shape(server, client, change, words):
    body = {"model": "claude-opus-5-5", "messages": user("hi"), "max_tokens": 2, **change}
    message = anthropic_error(post(server, "/v1/messages", json=body), 400, "invalid_request_error")
    assert words in message
    still_served(client)


def test_the_sdk_raises_its_own_errors(client, engine):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="m", messages=user("hi"), max_tokens=-5)
    assert bad.value.status_code == 400
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="answers no tool_use"):
        client.messages.create(
            model="m",
            max_tokens=2,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "5"}],
                }
            ],
        )
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    with pytest.raises(anthropic.BadRequestError, match="reads text only"):
        client.messages.create(
            model="m",
            max_tokens=2,
            messages=[{"role": "user", "content": [image, {"type": "text", "text": "what?"}]}],
        )
    with pytest.raises(anthropic.BadRequestError, match="reads text only"):
        client.messages.count_tokens(model="m", messages=[{"role": "user", "content": [image]}])
    still_served(client)


def test_a_prompt_over_the_context_is_a_400_as_anthropic_words_it(client, engine):
    context = engine.model.context_length
    text = "0 1 2 3 4 5 6 7 8 9 " * (context // 2)
    counted = client.messages.count_tokens(model="m", messages=user(text)).input_tokens
    assert counted >= context
    with pytest.raises(anthropic.BadRequestError) as too_long:
        client.messages.create(model="m", messages=user(text), max_tokens=2)
    error = too_long.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == f"prompt is too long: {counted} tokens > {context - 1} maximum"
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        list(client.messages.create(model="m", messages=user(text), max_tokens=2, stream=True))
    still_served(client)


def test_keys_json_and_methods(tools, server):
    srv, client = tools
    good = client.messages.create(model="m", messages=user("hi"), max_tokens=1, **GREEDY)
    assert good.usage.output_tokens == 1
    wrong = anthropic.Anthropic(base_url=base_url(srv), api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model="m", messages=user("hi"), max_tokens=1)
    assert denied.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model="m", messages=user("hi"))
    body = json.dumps({"model": "m", "messages": user("hi"), "max_tokens": 1})
    as_text = post(server, "/v1/messages", content=body, headers={"content-type": "text/plain"})
    anthropic_error(as_text, 415, "invalid_request_error")
    broken = post(
        server, "/v1/messages", content=b"{", headers={"content-type": "application/json"}
    )
    anthropic_error(broken, 400, "invalid_request_error")
    assert httpx.get(f"{base_url(server)}/v1/messages", timeout=10).status_code == 405
    assert post(server, "/v1/messages?beta=true", json=json.loads(body)).status_code == 200


def test_a_streaming_client_that_leaves_cancels_its_request(client, engine, server):
    stream = client.messages.create(
        model="m",
        messages=user("Tell me a very long story."),
        max_tokens=8000,
        **GREEDY,
        stream=True,
    )
    deltas = 0
    for event in stream:
        deltas += event.type == "content_block_delta"
        if deltas >= 3:
            break
    stream.close()
    entry = last_entry(server)
    deadline = time.monotonic() + 30
    while entry.finish is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry.finish == "cancelled"
    still_served(client)


# -- images ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_vlm

    directory = make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))
    with Engine.load(directory, block_size=BLOCK) as e:
        srv = ApiServer(e, port=0).start()
        yield e, anthropic.Anthropic(base_url=base_url(srv), api_key="x", max_retries=0)
        srv.stop()


def png(seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_base64_images_reach_a_vision_model(vision):
    engine, client = vision
    data = png(1)
    parts = [{"type": "text", "text": "What is in this picture?"}, {"type": "image"}]
    want = reference(engine, [{"role": "user", "content": parts}], images=[data], max_tokens=8)
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image", "source": source},
    ]
    got = client.messages.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=8, **GREEDY
    )
    assert got.content[0].text == want.text
    assert got.usage.input_tokens == len(want.prompt_tokens)
    counted = client.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": content}]
    )
    assert counted.input_tokens == len(want.prompt_tokens)
    url = {"type": "image", "source": {"type": "url", "url": "https://example.invalid/cat.png"}}
    with pytest.raises(anthropic.BadRequestError, match="fetches nothing"):
        client.messages.create(
            model="m", messages=[{"role": "user", "content": [url]}], max_tokens=2
        )

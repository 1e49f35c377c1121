"""OpenAI's Responses API (``POST /v1/responses``) driven by the real `openai` client.

A tiny random-weight llama whose chat template is our own in the way of Qwen 2.5's (tools
in a system block, calls as ``<tool_call>{json}</tool_call>``, results as ``tool`` turns,
reasoning between ``<think>`` markers) is served on 127.0.0.1 at a free port for the
module; answers are compared with `Engine.submit` on the same engine (greedy, so the same
tokens). A random model writes no calls of its own: the tool loop forces them with
``tool_choice`` (decoded under the tool-call grammar).
"""

from __future__ import annotations

import json
import re
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.server import ApiServer, Limits, agentio  # noqa: E402
from mlx_nbengine.server.responses_shapes import check_responses  # noqa: E402

BLOCK = 16
CONTEXT = 2048
LONG = (
    "The Eiffel Tower is located in the city of Paris, the capital of France. "
    "A block of two hundred and fifty six tokens is cached on disk and restored later. "
)

TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\nTools:"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{%- if message.get('reasoning_content') %}<think>\n{{ message['reasoning_content'] }}"
    "\n</think>\n{% endif %}{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] %}{%- set tool_call = call['function'] %}"
    '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message['role'] == 'tool' %}<|im_start|>tool\n{{ message['content'] }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        # an enum: a random model's free string would never end
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
        "required": ["city"],
    },
}
SHELL = {  # a freeform tool whose input a regex bounds
    "type": "custom",
    "name": "shell",
    "description": "Run a command",
    "format": {"type": "grammar", "syntax": "regex", "definition": "(ls|pwd) [a-z]{1,8}"},
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch to the files",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch"'},
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("responses-llama"))
    make_tiny_tokenizer(directory, chat_template=TOOL_TEMPLATE)
    with Engine.load(directory, block_size=BLOCK, parallel=4) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    srv = ApiServer(engine, port=0, limits=Limits(context=CONTEXT)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def chat(*turns: str) -> list[dict]:
    return [{"role": "user", "content": t} for t in turns]


def reference(engine, messages, **kwargs):
    """The engine's own answer, cold (both caches emptied first)."""
    engine.clear_cache()
    done = engine.submit(agentio.template_messages(messages), **kwargs).result(timeout=60)
    engine.clear_cache()
    return done


def post(server, json_body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}/responses", json=json_body, timeout=60, **kwargs)


def sse_events(response: httpx.Response) -> list[tuple[str | None, dict]]:
    """(event name, payload) of each server-sent event; comments skipped."""
    out = []
    for block in response.text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
        if data is not None:
            out.append((name, data))
    return out


# -- answers ---------------------------------------------------------------------------------


def test_a_plain_answer_gives_the_engines_tokens(client, engine, server):
    want = reference(engine, chat("What is the capital of Italy?"), max_tokens=12)
    got = client.responses.create(
        model="gpt-5-codex",
        input="What is the capital of Italy?",
        max_output_tokens=12,
        temperature=0,
    )
    assert got.object == "response" and got.id.startswith("resp_")
    assert got.model == engine.model_name
    assert got.status == "incomplete"  # max_output_tokens ended it
    assert got.incomplete_details.reason == "max_output_tokens"
    (message,) = got.output
    assert message.type == "message" and message.role == "assistant"
    assert got.output_text == want.text.lstrip()
    assert got.usage.input_tokens == len(want.prompt_tokens)
    assert got.usage.output_tokens == 12
    assert got.usage.total_tokens == got.usage.input_tokens + 12
    assert got.usage.input_tokens_details.cached_tokens == 0  # cold
    assert got.usage.output_tokens_details.reasoning_tokens == 0
    entry = server.journal.entries()[-1]
    assert entry.endpoint == "/v1/responses" and entry.completion_tokens == 12


def test_instructions_and_developer_messages_are_one_system_message():
    req = check_responses(
        {
            "instructions": "You are Codex.",
            "input": [
                {"type": "message", "role": "developer", "content": "Sandbox: read-only."},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"role": "developer", "content": "later"},
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "<a>x</a>"},
                        {"type": "input_text", "text": "<b>y</b>"},
                        {"type": "input_text", "text": " z"},
                    ],
                },
            ],
        },
        Limits(context=CONTEXT),
        vision=False,
    )
    assert req.messages == [
        {"role": "system", "content": "You are Codex.\n\nSandbox: read-only."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "later"},
        {"role": "user", "content": "<a>x</a>\n<b>y</b> z"},  # touching parts: a newline
    ]


def test_a_conversations_items_become_chat_messages():
    req = check_responses(
        {
            "input": [
                {"role": "user", "content": "Patch it and check the weather."},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Two tools."}],
                    "encrypted_content": "opaque",
                },
                {
                    "type": "function_call",
                    "call_id": "call_a",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                },
                {
                    "type": "custom_tool_call",
                    "call_id": "call_b",
                    "name": "apply_patch",
                    "input": "*** Begin Patch",
                },
                {"type": "function_call_output", "call_id": "call_a", "output": "sunny"},
                {
                    "type": "custom_tool_call_output",
                    "call_id": "call_b",
                    "output": [{"type": "input_text", "text": "done"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [
                        {"type": "output_text", "text": "Sunny; patched.", "annotations": []}
                    ],
                },
                {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            ],
            "tools": [WEATHER, APPLY_PATCH, {"type": "web_search"}],
            "tool_choice": {"type": "custom", "name": "apply_patch"},
            "store": False,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "abc",
            "service_tier": "auto",
            "truncation": "auto",
        },
        Limits(context=CONTEXT),
        vision=False,
    )
    assert req.messages == [
        {"role": "user", "content": "Patch it and check the weather."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two tools.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {
                        "name": "apply_patch",
                        "arguments": json.dumps({"input": "*** Begin Patch"}),
                    },
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_b", "name": "apply_patch", "content": "done"},
        {"role": "assistant", "content": "Sunny; patched."},
    ]
    names = [t["function"]["name"] for t in req.tools]
    assert names == ["get_weather", "apply_patch"]  # web_search skipped
    patch = req.tools[1]["function"]
    assert patch["parameters"]["properties"]["input"]["type"] == "string"
    assert 'start: "*** Begin Patch"' in patch["description"]
    assert req.custom_tools == {"apply_patch"}
    assert req.tool_choice == {"type": "function", "function": {"name": "apply_patch"}}


def test_codex_bookkeeping_items_and_empty_reasoning_are_left_out():
    req = check_responses(
        {
            "input": [
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}],
                },
                {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "x"},
                {"type": "ghost_snapshot", "ghost_commit": {"id": "abc"}},
                {"type": "tool_search_call", "call_id": "t1", "arguments": {}},
                {"type": "message", "role": "user", "content": "b", "phase": None},
            ]
        },
        Limits(context=CONTEXT),
        vision=False,
    )
    assert req.messages == [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]


def test_the_stream_is_what_the_sdk_parses_and_gives_the_same_text(client, engine, server):
    prompt = "Name three rivers."
    want = reference(engine, chat(prompt), max_tokens=10)
    with client.responses.stream(
        model=engine.model_name, input=prompt, max_output_tokens=10, temperature=0
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == want.text.lstrip()
    done = events[-2].item
    assert done.type == "message" and done.content[0].text == deltas
    final = events[-1].response
    assert final.status == "incomplete" and final.output[0].content[0].text == deltas
    assert final.usage.output_tokens == 10
    assert final.usage.input_tokens == len(want.prompt_tokens)
    # every event names its type on the SSE's event: line
    raw = post(server, {"input": prompt, "max_output_tokens": 3, "temperature": 0, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(name == data["type"] for name, data in sse_events(raw))


def test_previous_response_id_continues_the_conversation(client, engine, server):
    first = client.responses.create(
        model=engine.model_name,
        input="Remember the word swordfish.",
        max_output_tokens=6,
        temperature=0,
        instructions="You answer briefly.",
    )
    second = client.responses.create(
        model=engine.model_name,
        input="Which word?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
        store=False,
        prompt_cache_key="session-1",
    )
    history = [
        {"role": "user", "content": "Remember the word swordfish."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Which word?"},
    ]
    want = reference(engine, history, max_tokens=6)
    assert second.output_text == want.text.lstrip()
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == len(want.prompt_tokens)
    assert server.journal.entries()[-1].conversation_key == "session-1"
    assert server.journal.entries()[-1].as_dict()["conversation_key"] == "session-1"


def test_an_unknown_previous_response_id_is_a_clear_400(client, engine):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=engine.model_name, input="hi", previous_response_id="resp_nothere"
        )
    error = caught.value.body
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id"
    assert "resp_nothere" in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": 5}, "input", "string or a list"),
        ({"input": ["hi"]}, "input[0]", "object"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "one of"),
        ({"input": [{"type": "nonsense"}]}, "input[0].type", "unknown item type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
            "input[0].content[0].text",
            "string",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
            "input[0].call_id",
            "call_x",
        ),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}
                        ],
                    }
                ]
            },
            "input[0].content[0]",
            "text only",
        ),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name", "name"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tools"),
        ({"input": "hi", "temperature": 3}, "temperature", "between"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least"),
    ],
)
def test_bad_items_and_fields_are_400_in_openais_shape(server, client, engine, body, param, words):
    response = post(server, {"model": "x", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    # the server keeps serving
    ok = client.responses.create(model="x", input="hi", max_output_tokens=1, temperature=0)
    assert ok.usage.output_tokens == 1


def test_unknown_and_unused_fields_are_accepted(client, engine):
    got = client.responses.create(
        model=engine.model_name,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        max_output_tokens=2,
        temperature=0,
        store=False,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        metadata={"a": "b"},
        service_tier="auto",
        truncation="auto",
        reasoning={"effort": "high", "summary": "auto"},
        text={"format": {"type": "text"}, "verbosity": "low"},
        parallel_tool_calls=False,
        tools=[{"type": "web_search"}],
        extra_body={"client_metadata": {"x": 1}, "stream_options": None},
    )
    assert got.usage.output_tokens == 2
    assert got.reasoning.effort == "high"


def test_a_second_turn_sharing_a_long_prefix_reports_cached_tokens(client, engine, server):
    engine.clear_cache()
    system = LONG * 3
    turn = [{"role": "user", "content": "First question?"}]
    one = client.responses.create(
        model=engine.model_name,
        instructions=system,
        input=turn,
        max_output_tokens=4,
        temperature=0,
    )
    assert one.usage.input_tokens_details.cached_tokens == 0
    two = client.responses.create(
        model=engine.model_name,
        instructions=system,
        input=[
            *turn,
            {"role": "assistant", "content": [{"type": "output_text", "text": one.output_text}]},
            {"role": "user", "content": "Second question?"},
        ],
        max_output_tokens=4,
        temperature=0,
    )
    cached = two.usage.input_tokens_details.cached_tokens
    assert cached >= BLOCK * 4  # at least the instructions' blocks came back
    assert cached == server.journal.entries()[-1].cached_tokens


def test_a_prompt_over_the_context_streamed_fails_with_its_code(server, client, engine):
    long = "word " * (CONTEXT * 2)
    plain = post(server, {"input": long, "max_output_tokens": 2})
    assert plain.status_code == 400
    assert plain.json()["error"]["code"] == "context_length_exceeded"
    assert plain.json()["error"]["param"] == "input"
    stream = client.responses.create(
        model=engine.model_name, input=long, max_output_tokens=2, stream=True
    )
    events = list(stream)
    assert [e.type for e in events] == ["response.created", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed"
    assert failed.error.code == "context_length_exceeded"
    ok = client.responses.create(model="x", input="hi", max_output_tokens=1, temperature=0)
    assert ok.usage.output_tokens == 1


def test_long_prompts_stream_keep_alive_comments_the_sdk_skips(client, engine, server):
    handler = server.app.state.handlers.responses_api
    handler.keepalive_s = 0.001  # any silence at all: the prompt's reading is one
    try:
        raw = post(
            server,
            {"input": LONG * 8, "max_output_tokens": 2, "temperature": 0, "stream": True},
        )
        stream = client.responses.create(
            model="x", input=LONG * 8 + "again", max_output_tokens=2, temperature=0, stream=True
        )
        types = [e.type for e in stream]
    finally:
        handler.keepalive_s = 5.0
    assert ": keep-alive\n\n" in raw.text
    assert raw.text.index("response.created") < raw.text.index(": keep-alive")
    assert types[0] == "response.created" and types[-1] == "response.incomplete"


# -- tools -----------------------------------------------------------------------------------


def test_a_tool_loop_call_its_output_and_the_next_answer(client, engine, server):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    one = client.responses.create(
        model=engine.model_name,
        input=[question],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
    )
    assert one.status == "completed"
    (call,) = [item for item in one.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert call.status == "completed" and call.id.startswith("fc_")
    # the client runs the tool and sends the whole conversation back
    history = [question, *[item.model_dump(exclude_none=True) for item in one.output]]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    two = client.responses.create(
        model=engine.model_name,
        input=[*history, result],
        tools=[WEATHER],
        max_output_tokens=5,
        temperature=0,
    )
    assert two.output[-1].type == "message" and two.output_text
    messages = [
        {"role": "user", "content": question["content"]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments},
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": call.call_id,
            "name": "get_weather",
            "content": "Sunny, 21 C",
        },
    ]
    tools = [
        {
            "type": "function",
            "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
        }
    ]
    want = reference(engine, messages, max_tokens=5, template_kwargs={"tools": tools})
    assert two.usage.input_tokens == len(want.prompt_tokens)
    assert two.output_text == want.text.lstrip()
    # the same loop with previous_response_id: only the output goes back
    three = client.responses.create(
        model=engine.model_name,
        previous_response_id=one.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=5,
        temperature=0,
    )
    assert three.output_text == two.output_text
    assert three.usage.input_tokens == two.usage.input_tokens


def test_a_custom_tool_call_streams_as_its_raw_input(client, engine):
    tools = [WEATHER, APPLY_PATCH, SHELL]
    with client.responses.stream(
        model=engine.model_name,
        input="Fix the bug.",
        tools=tools,
        tool_choice={"type": "custom", "name": "shell"},
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in types
    assert types[-2:] == ["response.output_item.done", "response.completed"]
    (call,) = [item for item in final.output if item.type == "custom_tool_call"]
    assert call.name == "shell" and re.fullmatch("(ls|pwd) [a-z]{1,8}", call.input)
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert done[0].input == call.input
    # sent back, it is a call of the function the model was shown, with its output
    back = client.responses.create(
        model=engine.model_name,
        input=[
            {"role": "user", "content": "Fix the bug."},
            call.model_dump(exclude_none=True),
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"},
        ],
        tools=tools,
        max_output_tokens=3,
        temperature=0,
    )
    assert back.usage.output_tokens == 3


def test_tool_choice_none_shows_no_tools(client, engine):
    shown = client.responses.create(
        model="x", input="hi", tools=[WEATHER], max_output_tokens=1, temperature=0
    )
    hidden = client.responses.create(
        model="x",
        input="hi",
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=1,
        temperature=0,
    )
    assert hidden.usage.input_tokens < shown.usage.input_tokens
    assert hidden.tool_choice == "none"


# -- reasoning -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A tiny llama whose template opens a reasoning block (<think>, a token of its own)."""
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("responses-thinking"))
    template = TOOL_TEMPLATE.replace(
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
    )
    make_tiny_tokenizer(
        directory, chat_template=template, extra_special_tokens=("<think>", "</think>")
    )
    with Engine.load(directory, block_size=BLOCK) as e:
        srv = ApiServer(e, port=0, limits=Limits(context=CONTEXT)).start()
        yield e, openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        srv.stop()


def test_reasoning_comes_as_a_reasoning_item_and_goes_back_as_reasoning(thinking):
    engine, client = thinking
    with client.responses.stream(
        model="x", input="Think first.", max_output_tokens=8, temperature=0
    ) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types
    assert "response.output_text.delta" not in types  # a random model never closes it
    final = events[-1].response
    (item,) = final.output
    assert item.type == "reasoning" and item.id.startswith("rs_")
    text = item.content[0].text
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == deltas and text.strip()
    assert 0 < final.usage.output_tokens_details.reasoning_tokens <= 8
    # the item sent back is the assistant's reasoning, rendered by the template
    back = client.responses.create(
        model="x",
        input=[
            {"role": "user", "content": "Think first."},
            item.model_dump(exclude_none=True),
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Next."},
        ],
        max_output_tokens=1,
        temperature=0,
    )
    messages = [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": text},
        {"role": "user", "content": "Next."},
    ]
    assert back.usage.input_tokens == len(engine.model.apply_chat_template(messages))


def test_a_namespaces_tools_are_shown_by_name_and_called_with_the_namespace(client, engine):
    agents = {
        "type": "namespace",
        "name": "agents",
        "description": "Sub-agents",
        "tools": [WEATHER],
    }
    req = check_responses(
        {"input": "hi", "tools": [agents, {"type": "web_search"}]},
        Limits(context=CONTEXT),
        vision=False,
    )
    assert [t["function"]["name"] for t in req.tools] == ["get_weather"]
    assert req.namespaces == {"get_weather": "agents"}
    got = client.responses.create(
        model="x",
        input="Weather?",
        tools=[agents],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
    )
    (call,) = got.output
    assert call.type == "function_call" and call.namespace == "agents"
    assert call.name == "get_weather"


def test_input_images_reach_a_vision_model(tmp_path):
    import base64
    import io

    import numpy as np
    from PIL import Image

    from mlx_nbengine.testing import make_tiny_vlm

    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with Engine.load(make_tiny_vlm(tmp_path / "vlm"), block_size=BLOCK) as e:
        srv = ApiServer(e, port=0).start()
        try:
            vlm = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
            text = {"type": "input_text", "text": "What is this?"}
            image = {"type": "input_image", "image_url": url, "detail": "auto"}
            kw = {"model": "x", "max_output_tokens": 2, "temperature": 0}
            seen = vlm.responses.create(input=[{"role": "user", "content": [text, image]}], **kw)
            plain = vlm.responses.create(input=[{"role": "user", "content": [text]}], **kw)
            assert seen.usage.input_tokens > plain.usage.input_tokens  # the image's tokens
            with pytest.raises(openai.BadRequestError) as caught:
                vlm.responses.create(
                    input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
                    **kw,
                )
            assert "data URLs" in caught.value.body["message"]
        finally:
            srv.stop()


def wait_idle(engine, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["active"] == 0 and stats["queued"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine still runs requests: {engine.stats()}")


def test_a_streaming_client_that_goes_away_cancels_its_response(client, engine, server):
    wait_idle(engine)
    stream = client.responses.create(
        model="x", input="Tell me a very long story.", temperature=0, stream=True
    )
    deltas = 0
    for event in stream:
        deltas += event.type == "response.output_text.delta"
        if deltas >= 3:
            break
    stream.close()  # the client goes away mid-answer
    wait_idle(engine)
    entry = server.journal.entries()[-1]
    deadline = time.monotonic() + 30
    while entry.finish is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry.finish == "cancelled" and entry.status == 499
    ok = client.responses.create(model="x", input="hi", max_output_tokens=2, temperature=0)
    assert ok.usage.output_tokens == 2

"""Tool calls and reasoning on ``/v1/chat/completions``, driven by the real `openai` client.

A tiny random-weight llama whose tokenizer has ``<think>``, ``</think>``, ``<tool_call>``
and ``</tool_call>`` as special tokens and whose chat template is written the way Qwen 3's is
(tools in a system block, calls as ``<tool_call>{json}</tool_call>``, which makes mlx-lm pick
its ``json_tools`` parser; ``tool`` messages; the generation prompt opens ``<think>`` unless
``enable_thinking`` is false) is served on 127.0.0.1 at a free port. A forced call
(``tool_choice`` "required" or a named function) is decoded under the tool-call grammar, so
even this random model makes a call that parses; unforced answers are compared with the
engine's own (greedy) answer split the same way.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from mlx_nbengine.engine import Engine  # noqa: E402
from mlx_nbengine.server import ApiServer  # noqa: E402
from mlx_nbengine.server.agentio import (  # noqa: E402
    OutputSplitter,
    Reasoning,
    Text,
    ToolCall,
    split_all,
    template_messages,
)

BLOCK = 16
MARKS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\nTools:{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set tool_call = call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant"
    "{%- if enable_thinking is defined and not enable_thinking %}\n<think>\n\n</think>\n\n"
    "{%- else %}\n<think>\n{%- endif %}{%- endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": -9, "maximum": 9},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
QUESTION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_model, make_tiny_tokenizer

    directory = make_tiny_model("llama", tmp_path_factory.mktemp("tools-llama"))
    make_tiny_tokenizer(directory, extra_special_tokens=MARKS, chat_template=TOOLS_TEMPLATE)
    with Engine.load(directory, block_size=BLOCK, parallel=2) as e:
        yield e


@pytest.fixture(scope="module")
def server(engine):
    srv = ApiServer(engine, port=0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def reference(engine, messages, **kwargs):
    """The engine's own answer, cold (both caches emptied first)."""
    engine.clear_cache()
    done = engine.submit(template_messages(messages), **kwargs).result(timeout=120)
    engine.clear_cache()
    return done


def pieces_of(engine, text, tools, prompt):
    pieces = split_all(engine.model, tools, text, prompt=prompt)
    answer = "".join(p.text for p in pieces if isinstance(p, Text))
    reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
    calls = [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ToolCall)]
    return answer, reasoning, calls


def check_call(call, tools=TOOLS):
    """One well-formed call of one of `tools`, its arguments matching the schema."""
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.type == "function"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
        assert len(arguments["city"]) <= 12
    else:
        assert call.function.name == "add" and set(arguments) == {"a", "b"}
        assert 0 <= arguments["a"] <= 99 and -9 <= arguments["b"] <= 9
    assert call.function.name in {t["function"]["name"] for t in tools}
    return call.function.name, arguments


# -- tool_choice "required": the call is decoded under the grammar --------------------------------


def test_a_required_call_is_made_and_read(client, engine, server):
    got = client.chat.completions.create(
        model=engine.model_name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    (choice,) = got.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call)
    # The same tokens as the engine's own answer under the same grammar, read the same way.
    from mlx_nbengine.server.toolgrammar import tool_call_grammar

    grammar = tool_call_grammar(engine.model.tokenizer, TOOLS, "required", parallel=False)
    kwargs = {"tools": TOOLS, "enable_thinking": False}
    want = reference(engine, QUESTION, max_tokens=80, template_kwargs=kwargs, grammar=grammar)
    assert want.stop_reason == "grammar"
    _, _, calls = pieces_of(engine, want.text, TOOLS, want.prompt_tokens)
    assert calls == [(call.function.name, json.loads(call.function.arguments))]
    assert got.usage.completion_tokens == len(want.tokens)
    assert server.journal.entries()[-1].finish == "stop"


def test_a_required_call_streams_as_one_tool_call_delta(client, engine):
    common = {
        "model": engine.model_name,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**common)
    stream = client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    (call,) = calls
    assert call.index == 0 and call.type == "function"
    check_call(call)
    (want,) = whole.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (
        want.function.name,
        want.function.arguments,
    )
    assert call.id != want.id  # every call its own id
    assert "".join(d.content or "" for d in deltas) == ""
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_named_function_is_the_one_called(client, engine):
    got = client.chat.completions.create(
        model=engine.model_name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=120,
        temperature=0,
    )
    # Parallel calls are allowed (the default): one or more, each of that function (a
    # random model may go on calling up to max_tokens, leaving the last call cut short).
    assert got.choices[0].finish_reason in ("tool_calls", "length")
    calls = got.choices[0].message.tool_calls
    assert calls and all(check_call(c)[0] == "add" for c in calls)
    assert len({c.id for c in calls}) == len(calls)


def test_a_tool_loop_call_result_and_the_next_answer(client, engine, server):
    # 1. the model calls the tool.
    first = client.chat.completions.create(
        model=engine.model_name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    # 2. the agent runs it and sends the result back, with the assistant's call.
    history = [
        *QUESTION,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"},
    ]
    assert history[2]["tool_calls"][0]["id"] == call.id
    second = client.chat.completions.create(
        model=engine.model_name, messages=history, tools=TOOLS, max_tokens=12, temperature=0
    )
    # 3. the next answer reads the call and its result: the template rendered both.
    lm = engine.model
    rendered = lm.render_chat(template_messages(history), tools=TOOLS)
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert f'{{"name": "get_weather", "arguments": {arguments}}}' in rendered
    assert "<|im_start|>tool\nSunny, 21 degrees<|im_end|>" in rendered
    assert second.usage.prompt_tokens == len(
        lm.apply_chat_template(template_messages(history), tools=TOOLS)
    )
    want = reference(engine, history, max_tokens=12, template_kwargs={"tools": TOOLS})
    answer, reasoning, calls = pieces_of(engine, want.text, TOOLS, want.prompt_tokens)
    got = second.choices[0].message
    assert (got.reasoning_content or "", got.content or "") == (reasoning, answer)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls or ()] == (
        calls
    )
    assert server.journal.entries()[-1].prompt_tokens == second.usage.prompt_tokens


# -- reasoning ------------------------------------------------------------------------------


def test_reasoning_is_split_from_the_content(client, engine):
    # The generation prompt opened <think>: the answer begins inside the reasoning.
    want = reference(engine, QUESTION, max_tokens=24, template_kwargs={"tools": TOOLS})
    answer, reasoning, calls = pieces_of(engine, want.text, TOOLS, want.prompt_tokens)
    assert OutputSplitter(engine.model, TOOLS, prompt=want.prompt_tokens).state == "reasoning"
    got = client.chat.completions.create(
        model=engine.model_name, messages=QUESTION, tools=TOOLS, max_tokens=24, temperature=0
    )
    message = got.choices[0].message
    assert message.reasoning_content == reasoning
    assert (message.content or "") == answer
    assert got.choices[0].finish_reason == ("tool_calls" if calls else want.finish_reason)
    # Streamed: the same split, as delta.reasoning_content and delta.content.
    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.content or "" for d in deltas) == answer


def test_thinking_turned_off_answers_as_content(client, engine):
    for extra in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        got = client.chat.completions.create(
            model=engine.model_name,
            messages=QUESTION,
            max_tokens=16,
            temperature=0,
            extra_body=extra,
        )
        message = got.choices[0].message
        want = reference(
            engine, QUESTION, max_tokens=16, template_kwargs={"enable_thinking": False}
        )
        answer, reasoning, _ = pieces_of(engine, want.text, None, want.prompt_tokens)
        assert message.content == answer and (message.reasoning_content or "") == reasoning
        # The prompt closed its reasoning block: the answer begins as content (where the
        # random model writes <think> itself, what follows is reasoning).
        assert OutputSplitter(engine.model, None, prompt=want.prompt_tokens).state == "normal"
        assert got.usage.prompt_tokens == len(want.prompt_tokens)


def test_tool_choice_none_hides_the_tools_from_the_template(client, engine):
    got = client.chat.completions.create(
        model=engine.model_name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=2,
        temperature=0,
    )
    assert got.usage.prompt_tokens == len(engine.model.apply_chat_template(QUESTION))
    assert not got.choices[0].message.tool_calls


# -- bad shapes -----------------------------------------------------------------------------


def _post(server, body):
    return httpx.post(f"{server.url}/chat/completions", json=body, timeout=60)


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}


@pytest.mark.parametrize(
    "change, param",
    [
        (
            {"messages": [*QUESTION, ASKED, {"role": "tool", "tool_call_id": "call_1"}]},
            "messages[3].content",
        ),
        (
            {"messages": [*QUESTION, ASKED, {"role": "tool", "content": "3"}]},
            "messages[3].tool_call_id",
        ),
        (
            {"messages": [*QUESTION, ASKED, {"role": "tool", "tool_call_id": "x", "content": "3"}]},
            "messages[3].tool_call_id",
        ),
        (
            {
                "messages": [
                    *QUESTION,
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "add", "arguments": 5}}],
                    },
                ]
            },
            "messages[2].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [*QUESTION, {"role": "assistant", "tool_calls": "add"}]},
            "messages[2].tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
            "messages[0].tool_calls",
        ),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": {"name": "f"}}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
        ),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_shapes_are_400_naming_the_param(server, client, engine, change, param):
    body = {"model": engine.model_name, "messages": QUESTION, "max_tokens": 2, **change}
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"]
    ok = client.chat.completions.create(
        model=engine.model_name, messages=QUESTION, max_tokens=2, temperature=0
    )
    assert ok.usage.completion_tokens == 2


def test_arguments_sent_as_an_object_and_text_parts_are_taken(client, engine):
    call = {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    as_text = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "3"},
    ]
    call["function"]["arguments"] = '{"a": 1, "b": 2}'
    as_sent = json.loads(json.dumps(as_text))
    as_sent[2]["tool_calls"][0]["function"]["arguments"] = {"a": 1, "b": 2}
    as_sent[3]["content"] = [{"type": "text", "text": "3"}]
    got = client.chat.completions.create(
        model=engine.model_name, messages=as_sent, tools=TOOLS, max_tokens=2, temperature=0
    )
    want = engine.model.apply_chat_template(template_messages(as_text), tools=TOOLS)
    assert got.usage.prompt_tokens == len(want)

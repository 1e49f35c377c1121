"""`mlx_nbengine.server.agentio`: the output split (text, reasoning, tool calls) on the real
mlx-lm tokenizer wrappers of tiny tokenizers whose chat templates name a tool format (mlx-lm
picks its parser from the template, as it does for real models), and the conversation form
chat templates read.

Each answer is fed whole, cut in two at every position, and one character at a time: the
pieces (adjacent text joined) are the same every way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mlx_nbengine.server.agentio import (
    OutputSplitter,
    Reasoning,
    Text,
    ToolCall,
    new_call_id,
    split_all,
    template_messages,
)

MARKS = ("<think>", "</think>", "<tool_call>", "</tool_call>")

# Qwen 3's way: tools in a system block, calls as <tool_call>{json}</tool_call> (mlx-lm reads
# "tool_call.name" and picks its json_tools parser), the generation prompt opens <think>.
JSON_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{%- if message.tool_calls %}{%- for call in message.tool_calls %}"
    "{%- set tool_call = call.function %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

# Qwen3-Coder's XML calls (mlx-lm's qwen3_coder parser); no thinking opened.
XML_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{#- calls are written <tool_call>\n<function=NAME> ... #}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Gemma 4's markers (mlx-lm's gemma4 parser), ChatML otherwise.
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{#- calls: <|tool_call>call:NAME{...}<tool_call|> #}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# GLM 4.7's <arg_key> calls (mlx-lm's glm47 parser, which reads any text as some call).
GLM_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{#- calls: <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call> #}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mistral's [TOOL_CALLS] (no end marker: the call runs to the end of the answer).
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{#- calls: [TOOL_CALLS]NAME[ARGS]{...} #}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    },
]


def _load(directory: Path):
    from mlx_lm.tokenizer_utils import load

    return load(directory)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from mlx_nbengine.testing import make_tiny_tokenizer

    made = {}
    for name, template, marks in (
        ("json", JSON_TEMPLATE, MARKS),
        ("xml", XML_TEMPLATE, ("<tool_call>", "</tool_call>")),
        ("gemma4", GEMMA4_TEMPLATE, ("<|tool_call>", "<tool_call|>")),
        ("mistral", MISTRAL_TEMPLATE, ("[TOOL_CALLS]", "[ARGS]")),
        ("glm", GLM_TEMPLATE, ("<tool_call>", "</tool_call>")),
        ("plain", None, ()),
    ):
        directory = tmp_path_factory.mktemp(f"tok-{name}")
        kwargs = {"chat_template": template} if template else {}
        make_tiny_tokenizer(directory, extra_special_tokens=marks, **kwargs)
        made[name] = _load(directory)
    return made


def shape(pieces) -> list[tuple]:
    """Pieces as comparable tuples (adjacent text joined, calls by name and arguments)."""
    out: list[tuple] = []
    for p in pieces:
        if isinstance(p, ToolCall):
            assert re.fullmatch(r"call_[0-9a-f]{24}", p.id)
            assert isinstance(json.loads(p.arguments), dict)
            out.append(("call", p.name, json.loads(p.arguments)))
            continue
        kind = "text" if isinstance(p, Text) else "reasoning"
        assert isinstance(p, Text | Reasoning)
        if not p.text:
            continue
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + p.text)
        else:
            out.append((kind, p.text))
    return out


def every_way(tokenizer, tools, text, *, prompt=None) -> list[tuple]:
    """The pieces of `text` fed whole, cut in two at every position, and one character at a
    time; all must agree. Returns them."""
    whole = shape(split_all(tokenizer, tools, text, prompt=prompt))
    for cut in range(len(text) + 1):
        s = OutputSplitter(tokenizer, tools, prompt=prompt)
        got = [*s.feed(text[:cut]), *s.feed(text[cut:]), *s.close()]
        assert shape(got) == whole, (cut, text[:cut])
    s = OutputSplitter(tokenizer, tools, prompt=prompt)
    got = [piece for ch in text for piece in s.feed(ch)] + s.close()
    assert shape(got) == whole
    assert [(c.name, json.loads(c.arguments)) for c in s.calls] == [
        (x[1], x[2]) for x in whole if x[0] == "call"
    ]
    return whole


def test_the_tiny_templates_pick_mlx_lms_parsers(tokenizers):
    names = {
        k: t.tool_parser.__module__.rpartition(".")[2]
        for k, t in tokenizers.items()
        if k != "plain"
    }
    assert names == {
        "json": "json_tools",
        "xml": "qwen3_coder",
        "gemma4": "gemma4",
        "mistral": "mistral",
        "glm": "glm47",
    }
    assert tokenizers["json"].has_thinking and not tokenizers["xml"].has_thinking
    assert not tokenizers["plain"].has_tool_calling


def test_call_ids_are_call_and_24_hex():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_reasoning_text_and_several_calls(tokenizers):
    tok = tokenizers["json"]
    text = (
        "<think>\nThe user wants weather.\n</think>\n\nLet me look.<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2.5}}</tool_call>'
    )
    assert every_way(tok, TOOLS, text) == [
        ("reasoning", "\nThe user wants weather.\n"),
        ("text", "\n\nLet me look."),
        ("call", "get_weather", {"city": "Paris", "days": 2}),
        ("call", "add", {"a": 1, "b": 2.5}),
    ]


def test_an_answer_that_begins_inside_the_prompts_reasoning(tokenizers):
    tok = tokenizers["json"]
    messages = [{"role": "user", "content": "hello"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert tok.decode(prompt).endswith("<think>\n")
    text = "Thinking < about it </thi.\n</think>\n\nHello <b>there</b>."
    assert every_way(tok, None, text, prompt=prompt) == [
        ("reasoning", "Thinking < about it </thi.\n"),
        ("text", "\n\nHello <b>there</b>."),
    ]
    # Without the prompt the answer is taken to begin as text (a lone end marker is text).
    assert shape(split_all(tok, None, text)) == [("text", text)]
    # A prompt whose reasoning block was closed: the answer begins as text.
    closed = tok.encode("<think>x</think>", add_special_tokens=False)
    assert every_way(tok, None, "plain", prompt=closed) == [("text", "plain")]


def test_a_call_made_while_reasoning_ends_the_reasoning(tokenizers):
    tok = tokenizers["json"]
    text = 'hmm<tool_call>{"name": "add", "arguments": {}}</tool_call>done'
    prompt = tok.encode("<think>", add_special_tokens=False)
    assert every_way(tok, TOOLS, text, prompt=prompt) == [
        ("reasoning", "hmm"),
        ("call", "add", {}),
        ("text", "done"),
    ]


def test_bad_call_text_stays_text(tokenizers):
    tok = tokenizers["json"]
    bad = '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>'
    assert every_way(tok, TOOLS, "x" + bad + "y") == [("text", "x" + bad + "y")]
    not_object = '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'
    assert every_way(tok, TOOLS, not_object) == [("text", not_object)]
    # Cut short: the open call at the end of the answer is text too.
    cut = 'ok <tool_call>{"name": "add", "argu'
    assert every_way(tok, TOOLS, cut) == [("text", cut)]
    # A good call beside a bad one: only the bad one is text.
    good = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert every_way(tok, TOOLS, good + bad) == [("call", "add", {"a": 1}), ("text", bad)]


def test_arguments_given_as_json_text_are_read(tokenizers):
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3}"}</tool_call>'
    assert every_way(tokenizers["json"], TOOLS, text) == [("call", "add", {"a": 3})]


def test_without_tools_the_markup_is_text(tokenizers):
    tok = tokenizers["json"]
    text = '<think>r</think>a<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert every_way(tok, None, text) == [
        ("reasoning", "r"),
        ("text", 'a<tool_call>{"name": "add", "arguments": {}}</tool_call>'),
    ]
    assert every_way(tok, [], text)[1][0] == "text"


def test_a_model_without_a_tool_format_gets_the_json_form(tokenizers):
    tok = tokenizers["plain"]
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert every_way(tok, TOOLS, text) == [
        ("text", "Sure."),
        ("call", "get_weather", {"city": "Rome"}),
    ]
    # No tokenizer at all: the same form, and <think> is text.
    assert every_way(None, TOOLS, "<think>" + text) == [
        ("text", "<think>Sure."),
        ("call", "get_weather", {"city": "Rome"}),
    ]


def test_qwen3_coder_xml_calls_and_the_json_form_beside_them(tokenizers):
    tok = tokenizers["xml"]
    xml = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    forced = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    assert every_way(tok, TOOLS, "A" + xml + forced) == [
        ("text", "A"),
        ("call", "get_weather", {"city": "New York", "days": 3}),
        ("call", "add", {"a": 1, "b": 2}),
    ]


def test_gemma4_calls_and_the_json_form(tokenizers):
    tok = tokenizers["gemma4"]
    native = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,days:1}<tool_call|>'
    forced = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    assert every_way(tok, TOOLS, native + " and " + forced) == [
        ("call", "get_weather", {"city": "Oslo", "days": 1}),
        ("text", " and "),
        ("call", "add", {"a": 2}),
    ]


def test_glm_calls_and_the_json_form_read_first(tokenizers):
    tok = tokenizers["glm"]
    native = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Kyiv</arg_value></tool_call>"
    forced = '<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_call>'
    assert every_way(tok, TOOLS, native + forced) == [
        ("call", "get_weather", {"city": "Kyiv"}),
        ("call", "add", {"a": 1}),
    ]


def test_mistral_calls_run_to_the_end_of_the_answer(tokenizers):
    tok = tokenizers["mistral"]
    text = 'Calling.[TOOL_CALLS]add[ARGS]{"a": 1}get_weather[ARGS]{"city": "Lima"}'
    assert every_way(tok, TOOLS, text) == [
        ("text", "Calling."),
        ("call", "add", {"a": 1}),
        ("call", "get_weather", {"city": "Lima"}),
    ]


def test_feed_after_close_is_refused_and_close_twice_is_empty(tokenizers):
    s = OutputSplitter(tokenizers["json"], TOOLS)
    assert s.feed("<thi") == []  # held back: may be a marker
    assert s.close() == [Text("<thi")]
    assert s.close() == []
    with pytest.raises(RuntimeError):
        s.feed("x")


def test_the_loaded_model_and_a_hugging_face_tokenizer_are_taken(tokenizers, tiny_model_dir):
    from mlx_nbengine.models import load

    lm = load(tiny_model_dir("llama"))
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    for given in (lm, lm.tokenizer, lm.text_tokenizer):
        assert shape(split_all(given, TOOLS, text)) == [("call", "add", {})]
    hf = tokenizers["json"]._tokenizer
    assert shape(split_all(hf, None, "<think>a</think>b")) == [("reasoning", "a"), ("text", "b")]


def test_template_messages_give_arguments_as_dicts(tokenizers):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
    }
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "r"},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "3"},
    ]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    assert out[1]["content"] == "" and out[1]["reasoning_content"] == "r"
    assert out[2] == messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    # Text that is not a JSON object is kept as it is.
    odd = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "x"}}]}
    assert template_messages([odd])[0]["tool_calls"][0]["function"]["arguments"] == "x"
    # The template renders the call as the model writes one.
    rendered = tokenizers["json"].apply_chat_template(out, tokenize=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in rendered

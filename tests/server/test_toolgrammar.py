"""Forced tool calls (`server.toolgrammar`) on tiny random models: every call parses with
the mlx-lm parser of the model's own format (or ``json_tools`` where it has none), names an
allowed function, and its arguments validate against that function's schema."""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest

from mlx_nbengine import Engine
from mlx_nbengine.engine import InvalidRequestError
from mlx_nbengine.server.toolgrammar import (
    FALLBACK_PARSER,
    fallback_parser,
    tool_call_format,
    tool_call_grammar,
)
from mlx_nbengine.testing import make_tiny_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -50, "maximum": 999},
                "b": {"type": "number", "minimum": 0, "maximum": 1},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
            },
            "required": ["a", "b", "exact", "tags"],
        },
    },
}
NO_PARAMETERS = {"type": "function", "function": {"name": "ping"}}
PLAN = {
    "type": "function",
    "function": {
        "name": "plan",
        "parameters": {
            "type": "object",
            "properties": {
                "stops": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "at": {"type": "string", "maxLength": 5},
                            "wait": {"type": "number", "minimum": 0, "maximum": 2},
                        },
                        "required": ["at"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                },
                "fast": {"type": "boolean"},
                "note": {"type": "null"},
            },
            "required": ["stops"],
        },
    },
}
TOOLS = [WEATHER, ADD, NO_PARAMETERS]
SCHEMAS = {
    t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS
}
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]

# A template naming json_tools' markers, which the tokenizer holds as special tokens.
SPECIAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% for tool_call in tool_calls or [] %}<tool_call>{{ tool_call.name }}</tool_call>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def variants(tiny_model_dir, tmp_path_factory):
    """The tiny llama with each tool format: none, mlx-lm's named parsers, and json_tools
    with special-token markers (inferred from the template)."""
    root = tmp_path_factory.mktemp("tool_formats")
    source = tiny_model_dir("llama")
    made = {}
    for name in (
        "none",
        "json_tools",
        "qwen3_coder",
        "mistral",
        "gemma4",
        "function_gemma",
        "special",
    ):
        directory = root / name
        shutil.copytree(source, directory)
        if name == "special":
            make_tiny_tokenizer(
                directory,
                extra_special_tokens=("<tool_call>", "</tool_call>"),
                chat_template=SPECIAL_TEMPLATE,
            )
        elif name != "none":
            config_file = directory / "tokenizer_config.json"
            config = json.loads(config_file.read_text())
            config["tool_parser_type"] = name
            config_file.write_text(json.dumps(config))
        made[name] = directory
    return made


@pytest.fixture
def engines(variants, tmp_path):
    opened = {}

    def get(name):
        if name not in opened:
            opened[name] = Engine.load(variants[name], block_size=32, cache_dir=tmp_path)
        return opened[name]

    yield get
    for engine in opened.values():
        engine.close()


def parse_calls(text, fmt, tools):
    """Every call in `text`, as the server splits and parses them (mlx-lm's parser)."""
    parse = fmt.parser_module().parse_tool_call
    assert text.startswith(fmt.start)
    if not fmt.end:  # mistral: one marker, then the calls to the end
        parsed = parse(text[len(fmt.start) :], tools)
        return parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for chunk in text.split(fmt.start)[1:]:
        inner, end, rest = chunk.partition(fmt.end)
        assert end and not rest.strip(), text
        calls.append(parse(inner, tools))
    return calls


def check(call, names=None):
    assert call["name"] in (names or SCHEMAS), call
    jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])


@pytest.mark.parametrize(
    "variant", ["none", "json_tools", "qwen3_coder", "mistral", "gemma4", "special"]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_required_call_parses_and_matches_its_schema(engines, variant, temperature):
    engine = engines(variant)
    tokenizer = engine.model.tokenizer
    fmt = tool_call_format(tokenizer, TOOLS)
    assert fmt.parser == {"none": FALLBACK_PARSER, "special": "json_tools"}.get(variant, variant)
    assert fmt.native == (variant != "none")
    grammar = tool_call_grammar(tokenizer, TOOLS, "required")
    for seed in (1, 2, 3):
        done = engine.submit(
            PROMPT, max_tokens=300, grammar=grammar, temperature=temperature, seed=seed
        ).result(timeout=120)
        assert done.finish_reason == "stop" and done.stop_reason == "grammar", done.text
        [call] = parse_calls(done.text, fmt, TOOLS)
        check(call)


@pytest.mark.parametrize("variant", ["none", "qwen3_coder", "mistral", "gemma4"])
@pytest.mark.parametrize("name", ["add", "get_weather", "ping"])
def test_a_named_function_is_the_one_called(engines, variant, name):
    engine = engines(variant)
    tokenizer = engine.model.tokenizer
    choice = {"type": "function", "function": {"name": name}}
    grammar = tool_call_grammar(tokenizer, TOOLS, choice)
    for seed in (5, 6):
        done = engine.submit(
            PROMPT, max_tokens=300, grammar=grammar, temperature=0.9, seed=seed
        ).result(timeout=120)
        [call] = parse_calls(done.text, tool_call_format(tokenizer, TOOLS), TOOLS)
        check(call, names=[name])


@pytest.mark.parametrize("variant", ["none", "qwen3_coder", "mistral", "gemma4"])
def test_nested_arguments_parse_in_every_form(engines, variant):
    engine = engines(variant)
    tokenizer = engine.model.tokenizer
    fmt = tool_call_format(tokenizer, [PLAN])
    assert fmt.native == (variant != "none")
    grammar = tool_call_grammar(tokenizer, [PLAN], "required")
    for seed in (1, 2, 3, 4):
        done = engine.submit(PROMPT, max_tokens=400, grammar=grammar, temperature=1.0, seed=seed)
        [call] = parse_calls(done.result(timeout=120).text, fmt, [PLAN])
        assert call["name"] == "plan"
        jsonschema.validate(call["arguments"], PLAN["function"]["parameters"])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_function_gemma_writes_flat_calls_and_falls_back_for_nested_ones(engines, temperature):
    engine = engines("function_gemma")
    tokenizer = engine.model.tokenizer
    flat = [WEATHER, NO_PARAMETERS]
    fmt = tool_call_format(tokenizer, flat)
    assert (fmt.parser, fmt.native) == ("function_gemma", True)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        grammar = tool_call_grammar(tokenizer, flat, choice)
        for seed in (1, 2, 3):
            done = engine.submit(
                PROMPT, max_tokens=300, grammar=grammar, temperature=temperature, seed=seed
            ).result(timeout=120)
            [call] = parse_calls(done.text, fmt, flat)
            check(call)
    nested = tool_call_format(tokenizer, [PLAN])
    assert (nested.parser, nested.native) == (FALLBACK_PARSER, False)
    grammar = tool_call_grammar(tokenizer, [PLAN], "required")
    done = engine.submit(PROMPT, max_tokens=400, grammar=grammar, temperature=1.0, seed=1)
    [call] = parse_calls(done.result(timeout=120).text, nested, [PLAN])
    jsonschema.validate(call["arguments"], PLAN["function"]["parameters"])


def test_greedy_forced_calls_repeat(engines):
    engine = engines("qwen3_coder")
    grammar = tool_call_grammar(engine.model.tokenizer, TOOLS, "required")
    runs = [
        engine.submit(PROMPT, max_tokens=300, grammar=grammar).result(timeout=120) for _ in range(2)
    ]
    assert runs[0].tokens == runs[1].tokens


@pytest.mark.parametrize("variant", ["none", "mistral", "gemma4"])
def test_parallel_calls_each_parse(engines, variant):
    engine = engines(variant)
    tokenizer = engine.model.tokenizer
    tools = [ADD]
    grammar = tool_call_grammar(tokenizer, tools, "required", parallel=True)
    done = engine.submit(PROMPT, max_tokens=400, grammar=grammar, temperature=1.0, seed=3)
    done = done.result(timeout=120)
    calls = parse_calls(done.text, tool_call_format(tokenizer, tools), tools)
    assert calls and all(check(c, names=["add"]) is None for c in calls)


def test_a_schema_the_xml_form_cannot_hold_falls_back_to_json_tools(engines):
    engine = engines("qwen3_coder")
    tokenizer = engine.model.tokenizer
    patterned = {
        "type": "function",
        "function": {
            "name": "code",
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                "required": ["id"],
            },
        },
    }
    fmt = tool_call_format(tokenizer, [patterned])
    assert (fmt.parser, fmt.native) == (FALLBACK_PARSER, False)
    assert tool_call_format(tokenizer, TOOLS).parser == "qwen3_coder"
    grammar = tool_call_grammar(tokenizer, [patterned], "required")
    done = engine.submit(PROMPT, max_tokens=100, grammar=grammar).result(timeout=120)
    [call] = parse_calls(done.text, fmt, [patterned])
    jsonschema.validate(call["arguments"], patterned["function"]["parameters"])


def test_a_name_mistrals_parser_cannot_read_falls_back_to_json_tools(engines):
    engine = engines("mistral")
    tokenizer = engine.model.tokenizer
    dotted = {"type": "function", "function": {"name": "weather.now"}}
    fmt = tool_call_format(tokenizer, [dotted])
    assert (fmt.parser, fmt.native) == (FALLBACK_PARSER, False)
    grammar = tool_call_grammar(tokenizer, [dotted], "required")
    done = engine.submit(PROMPT, max_tokens=100, grammar=grammar).result(timeout=120)
    assert parse_calls(done.text, fmt, [dotted]) == [{"name": "weather.now", "arguments": {}}]


def test_special_token_markers_are_written_as_the_tokens(engines):
    engine = engines("special")
    tokenizer = engine.model.tokenizer
    start_id = tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(start_id) == 1
    grammar = tool_call_grammar(tokenizer, TOOLS, "required")
    assert f"<[{start_id[0]}]>" in grammar
    done = engine.submit(PROMPT, max_tokens=300, grammar=grammar).result(timeout=120)
    assert done.tokens[0] == start_id[0]


def test_the_fallback_parser_is_mlx_lms_json_tools():
    module = fallback_parser()
    assert module.__name__ == f"mlx_lm.tool_parsers.{FALLBACK_PARSER}"
    assert (module.tool_call_start, module.tool_call_end) == ("<tool_call>", "</tool_call>")


@pytest.mark.parametrize(
    ("tools", "choice", "words"),
    [
        ([], "required", "at least one function"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "not in tools"),
        (TOOLS, "auto", "tool_choice must be"),
        ([{"type": "function", "function": {"name": "a b<"}}], "required", "plain name"),
        ([{"type": "retrieval"}], "required", "tools[0]"),
        ("get_weather", "required", "must be a list"),
    ],
)
def test_tools_or_choices_it_cannot_hold_are_one_line_errors(engines, tools, choice, words):
    tokenizer = engines("none").model.tokenizer
    with pytest.raises(InvalidRequestError, match=re.escape(words)) as caught:
        tool_call_grammar(tokenizer, tools, choice)
    assert "\n" not in str(caught.value)

"""Tool calls that always parse: the grammar a forced tool call is decoded under.

With ``tool_choice`` ``"required"`` or a named function, the server submits the request with
``grammar=tool_call_grammar(tokenizer, tools, tool_choice)`` (`Engine.submit`): every
token is then chosen among those that keep the output a tool call of one of the allowed
functions, whose arguments match that function's JSON schema, and the request stops when
the call is complete. A tiny or random model still makes a call the parser reads.

The call is written in the model's own tool-call format where mlx-lm's tokenizer wrapper
names one we can write (``tokenizer.tool_parser``'s module, its ``tool_call_start`` and
``tool_call_end``), so the same mlx-lm parser reads it as it reads the model's unforced
calls:

- ``json_tools`` (Qwen 2.5 / 3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen 3.5): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>
  \\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``, a string written as it is (no
  ``<`` in it), other values as JSON; only where every parameter has a plain ``type`` (or is
  an enum of strings) and the parameters are an object's properties;
- ``mistral``: ``[TOOL_CALLS]NAME[ARGS]{...}``, where every name is word characters and
  dashes (what its parser reads);
- ``gemma4`` (Gemma 4): ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3,...}<tool_call|>``,
  where every value's schema is a plain type (objects with word-character keys, arrays,
  strings without a pattern or format, numbers, booleans, null) or an enum of strings;
- ``function_gemma`` (FunctionGemma): ``<start_function_call>call:NAME{key:<escape>text
  <escape>,n:3}<end_function_call>``, where every parameter is a string, a number, a
  boolean, null or an enum of strings, and names are word characters (no ``}`` or ``<`` in
  a string: its parser ends the call at the first ``}``).

A marker that is one special token of the tokenizer is written as that token (llguidance's
``<[id]>``), else as its text.

Any other model (no tool format, or one of mlx-lm's other formats, or parameters the XML
form cannot hold) gets the JSON form, which mlx-lm's ``json_tools`` parser reads
(`FALLBACK_PARSER`, `fallback_parser`). `tool_call_format` says, for a tokenizer and its
tools, which form a grammar writes and which parser reads it; `tool_call_grammar` follows
it, so a caller splitting the output asks `tool_call_format` with the same arguments.

JSON is written compact (no free whitespace: a small model cannot ramble in it), and an
object whose schema names its properties and does not say otherwise gets no others
(``additionalProperties: false``, at every depth, as OpenAI's strict mode asks). With
``parallel=True`` one or more calls are allowed, else exactly one. The grammar starts at
the first generated token: a template that opens a reasoning block in the prompt should be
rendered without it (e.g. ``enable_thinking=False``) for forced calls.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mlx_nbengine.errors import InvalidRequestError

__all__ = [
    "FALLBACK_PARSER",
    "NATIVE_PARSERS",
    "ToolFormat",
    "fallback_parser",
    "tool_call_format",
    "tool_call_grammar",
]

FALLBACK_PARSER = "json_tools"
"""mlx-lm's parser module (``mlx_lm.tool_parsers.json_tools``) that reads the JSON form."""

NATIVE_PARSERS = ("json_tools", "qwen3_coder", "mistral", "gemma4", "function_gemma")
"""mlx-lm tool parsers whose format `tool_call_grammar` writes."""

# Compact JSON: llguidance's JSON options, given inside each schema.
_COMPACT = {"whitespace_flexible": False}

# A function name every form writes and reads back (OpenAI's names, dots and colons too).
_NAME = re.compile(r"[\w.:-]{1,128}")
_MISTRAL_NAME = re.compile(r"[\w-]+")
# An object key Gemma 4's parser quotes back (it reads bare keys of word characters).
_GEMMA4_KEY = re.compile(r"\w+")

# A parameter name the XML form's parser reads back whole.
_XML_KEY = re.compile(r"[^\s<>=]+")

# The XML form's parameter types (mlx-lm's qwen3_coder parser converts a value by its type).
_XML_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")


@dataclass(frozen=True)
class ToolFormat:
    """How a forced tool call is written: `parser` (an mlx-lm ``tool_parsers`` module
    name) reads the text between `start` and `end` (`end` "" : to the end of the output);
    `native` is False where the JSON form stands in for the model's own."""

    parser: str
    start: str
    end: str
    native: bool

    def parser_module(self) -> ModuleType:
        """The mlx-lm parser module (its ``parse_tool_call(text, tools)``)."""
        return importlib.import_module(f"mlx_lm.tool_parsers.{self.parser}")


def fallback_parser() -> ModuleType:
    """mlx-lm's ``json_tools`` parser module: it reads the JSON form written for a model
    without a tool format we can write."""
    return importlib.import_module(f"mlx_lm.tool_parsers.{FALLBACK_PARSER}")


_FALLBACK = ToolFormat(FALLBACK_PARSER, "<tool_call>", "</tool_call>", native=False)


def tool_call_format(tokenizer: Any, tools: list[dict] | None = None) -> ToolFormat:
    """The form `tool_call_grammar` writes for `tokenizer` (mlx-lm's ``TokenizerWrapper``)
    and `tools` (the XML form needs parameters it can hold; see the module docstring)."""
    parser = getattr(tokenizer, "tool_parser", None)
    if not getattr(tokenizer, "has_tool_calling", False) or parser is None:
        return _FALLBACK
    name = getattr(parser, "__module__", "").rpartition(".")[2]
    if name not in NATIVE_PARSERS:
        return _FALLBACK
    try:
        functions = _functions(tools or [])
    except InvalidRequestError:  # tool_call_grammar says what is wrong with them
        functions = []
    if name == "qwen3_coder" and not all(_xml_holds(f) for f in functions):
        return _FALLBACK
    if name == "mistral" and not all(_MISTRAL_NAME.fullmatch(f["name"]) for f in functions):
        return _FALLBACK  # its parser reads names of word characters and dashes only
    if name in _CALL_SYNTAX:
        syntax, names = _CALL_SYNTAX[name](None), _CALL_NAMES[name]
        if not all(names.fullmatch(f["name"]) and syntax.holds(f["parameters"]) for f in functions):
            return _FALLBACK
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
    return ToolFormat(name, start, end, native=True)


def tool_call_grammar(
    tokenizer: Any,
    tools: list[dict],
    tool_choice: str | dict,
    *,
    parallel: bool = False,
) -> str:
    """An llguidance Lark grammar for `Engine.submit(grammar=...)`: a call (one, or with
    `parallel` one or more) of a function of `tools` (OpenAI chat-format function tools)
    allowed by `tool_choice` (``"required"``: any of them; ``{"type": "function",
    "function": {"name": NAME}}``: that one), in `tool_call_format(tokenizer, tools)`'s form.

    Raises `InvalidRequestError` (one line) for tools or a choice it cannot hold.
    """
    functions = _functions(tools)
    if not functions:
        raise InvalidRequestError("tool_choice needs at least one function in tools")
    chosen = _chosen(functions, tool_choice)
    form = tool_call_format(tokenizer, tools)
    marker = _Markers(tokenizer)
    start, end = marker(form.start), marker(form.end) if form.end else None
    rules: list[str] = []
    if form.parser == "mistral":
        calls = [_mistral_call(f, i, rules, marker("[ARGS]")) for i, f in enumerate(chosen)]
        rules.append("call: " + " | ".join(calls))
        repeat = " call*" if parallel else ""
        return "\n".join([f"start: {start} call{repeat}", *rules])
    if form.parser in _CALL_SYNTAX:
        syntax = _CALL_SYNTAX[form.parser](marker)
        calls = [syntax.call(f, f"g{i}", rules) for i, f in enumerate(chosen)]
        rules.append("body: " + " | ".join(calls))
        rules.append(f"call: {start} body {end}")
        return "\n".join([f"start: call{' call*' if parallel else ''}", *rules])
    if form.parser == "qwen3_coder":
        bodies = [_xml_call(f, i, rules) for i, f in enumerate(chosen)]
    else:
        bodies = [_json_call(f) for f in chosen]
    rules.append("body: " + " | ".join(bodies))
    rules.append(f'call: {start} "\\n" body "\\n" {end}')
    repeat = ' ("\\n" call)*' if parallel else ""
    return "\n".join([f"start: call{repeat}", *rules])


# --- the tools ------------------------------------------------------------------------------


def _functions(tools: Any) -> list[dict]:
    """The function definitions of `tools`, checked (name, parameters' schema)."""
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise InvalidRequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"tools[{i}].function.name must be a plain name, got {name!r}"
            )
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"tools[{i}].function.parameters must be a JSON schema object"
            )
        out.append({"name": name, "parameters": parameters})
    return out


def _chosen(functions: list[dict], tool_choice: Any) -> list[dict]:
    if tool_choice == "required":
        return functions
    name = None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise InvalidRequestError(
            "tool_choice must be 'required' or {'type': 'function', 'function': {'name': ...}}"
            f" for a forced call, got {tool_choice!r}"
        )
    picked = [f for f in functions if f["name"] == name]
    if not picked:
        known = ", ".join(f["name"] for f in functions)
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools ({known})")
    return picked[:1]


def _arguments_schema(parameters: dict) -> dict:
    """The function's parameters' schema (a copy), every object that names its properties
    closed unless it says otherwise; the top level closed even with no properties."""
    schema = _closed(parameters)
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples"):
            out[key] = value  # values, not schemas
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            out[key] = _closed(value)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


# --- the forms ------------------------------------------------------------------------------


def _json_call(function: dict) -> str:
    """``{"name": NAME, "arguments": {...}}`` as an inline JSON schema."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": _arguments_schema(function["parameters"]),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": _COMPACT,
    }
    return "%json " + json.dumps(schema)


def _mistral_call(function: dict, index: int, rules: list[str], args_marker: str) -> str:
    """``NAME[ARGS]{...}`` (``[TOOL_CALLS]`` is written once, before the calls)."""
    schema = {**_arguments_schema(function["parameters"]), "x-guidance": _COMPACT}
    rules.append(f"args{index}: %json " + json.dumps(schema))
    return f"{_lark_string(function['name'])} {args_marker} args{index}"


def _xml_holds(function: dict) -> bool:
    """The XML form can hold `function`'s parameters (see the module docstring)."""
    parameters = function["parameters"]
    if parameters.get("type", "object") != "object":
        return False
    properties = parameters.get("properties") or {}
    return isinstance(properties, dict) and all(
        _XML_KEY.fullmatch(key) and isinstance(p, dict) and _xml_value_holds(p)
        for key, p in properties.items()
    )


def _xml_value_holds(schema: dict) -> bool:
    if _string_enum(schema) is not None:
        return True
    if schema.get("type") == "string":  # written as it is: no pattern or format to keep
        return not any(k in schema for k in ("pattern", "format", "enum", "const"))
    return schema.get("type") in _XML_TYPES


def _xml_call(function: dict, index: int, rules: list[str]) -> str:
    """``<function=NAME>\\n`` then each parameter's ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``
    (required ones always, the others optionally, in the properties' order), then
    ``</function>``."""
    parameters = function["parameters"]
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    parts = [_lark_string(f"<function={function['name']}>\n")]
    for j, (key, schema) in enumerate(properties.items()):
        rule = f"p{index}_{j}"
        head = _lark_string(f"<parameter={key}>\n")
        tail = _lark_string("\n</parameter>\n")
        rules.append(f"{rule}: {head} {_xml_value(schema, f'{rule}v', rules)} {tail}")
        parts.append(rule if key in required else f"{rule}?")
    parts.append(_lark_string("</function>"))
    return " ".join(parts)


def _xml_value(schema: dict, rule: str, rules: list[str]) -> str:
    """A parameter's value as the qwen3_coder parser reads it back."""
    strings = _string_enum(schema)
    if strings is not None:
        return "(" + " | ".join(_lark_string(s) for s in strings) + ")"
    if schema.get("type") == "string":
        low = int(schema.get("minLength", 0))
        high = schema.get("maxLength")
        if high is not None:
            text = f"/[^<]{{{low},{int(high)}}}/"
        else:
            text = f"/[^<]{{{low},}}/" if low else "/[^<]*/"
        # Not "null" in any case: the parser reads that as None.
        rules.append(f"{rule.upper()}: {text} & ~/[nN][uU][lL][lL]/")
        return rule.upper()
    rules.append(f"{rule}: %json " + json.dumps({**_closed(schema), "x-guidance": _COMPACT}))
    return rule


def _string_enum(schema: dict) -> list[str] | None:
    values = schema.get("enum")
    if "const" in schema:
        values = [schema["const"]]
    if not isinstance(values, list) or not values:
        return None
    if all(isinstance(v, str) and "<" not in v and v.lower() != "null" for v in values):
        return values
    return None


class _Gemma4:
    """Gemma 4's call syntax: ``call:NAME{key:VALUE,...}``, keys bare, strings between
    `quote` markers (``<|"|>``), other scalars as JSON; mlx-lm's gemma4 parser turns it
    back into JSON. `marker` (None: only `holds` is asked) writes a marker as Lark."""

    QUOTE = '<|"|>'
    EXCLUDED = "<\\x00"  # characters never in a string (as a regex class's body)
    FLAT = False  # only scalars inside the arguments object

    def __init__(self, marker: Callable[[str], str] | None) -> None:
        self.quote = marker(self.QUOTE) if marker is not None else None

    def holds(self, schema: Any, depth: int = 0) -> bool:
        """`schema` can be written in this syntax (see the module docstring)."""
        if not isinstance(schema, dict):
            return False
        if self._strings(schema) is not None:
            return True
        kind = schema.get("type", "object" if "properties" in schema else None)
        if kind in ("object", "array") and self.FLAT and depth:
            return False
        if kind == "object":
            properties = schema.get("properties") or {}
            return isinstance(properties, dict) and all(
                _GEMMA4_KEY.fullmatch(k) and self.holds(p, depth + 1) for k, p in properties.items()
            )
        if kind == "array":
            return "items" not in schema or self.holds(schema["items"], depth + 1)
        if kind == "string":
            return not any(k in schema for k in ("pattern", "format", "enum", "const"))
        return kind in ("integer", "number", "boolean", "null") and not (
            "enum" in schema or "const" in schema
        )

    def call(self, function: dict, rule: str, rules: list[str]) -> str:
        parameters = dict(function["parameters"])
        parameters.setdefault("type", "object")
        value = self.value(parameters, rule, rules)
        return f"{_lark_string('call:' + function['name'])} {value}"

    def value(self, schema: dict, rule: str, rules: list[str]) -> str:
        """A Lark expression for a value of `schema` (`rule`: a prefix for its rules)."""
        strings = self._strings(schema)
        if strings is not None:
            return "(" + " | ".join(self._quoted(_lark_string(v)) for v in strings) + ")"
        kind = schema.get("type", "object" if "properties" in schema else None)
        if kind == "object":
            return self._object(schema, rule, rules)
        if kind == "array":
            return self._array(schema, rule, rules)
        if kind == "string":
            low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
            count = f"{{{low},{int(high)}}}" if high is not None else f"{{{low},}}"
            rules.append(f"{rule.upper()}: /[^{self.EXCLUDED}]{count}/")
            return self._quoted(rule.upper())
        rules.append(f"{rule}: %json " + json.dumps({**schema, "x-guidance": _COMPACT}))
        return rule

    def _quoted(self, item: str) -> str:
        return f"{self.quote} {item} {self.quote}"

    def _object(self, schema: dict, rule: str, rules: list[str]) -> str:
        """``{`` the properties in order, the required ones always, commas between ``}``:
        rule ``{rule}_{i}{a}`` is the rest from property i, a: one was written already."""
        properties = list((schema.get("properties") or {}).items())
        required = set(schema.get("required") or ())
        n = len(properties)
        values = [self.value(sub, f"{rule}_{i}v", rules) for i, (_, sub) in enumerate(properties)]
        rules += [f'{rule}_{n}n: ""', f'{rule}_{n}a: ""']
        for i in reversed(range(n)):
            key = properties[i][0]
            for written in ("n", "a"):
                head = ('"," ' if written == "a" else "") + _lark_string(key + ":")
                present = f"{head} {values[i]} {rule}_{i + 1}a"
                absent = f"{rule}_{i + 1}{written}"
                body = present if key in required else f"{present} | {absent}"
                rules.append(f"{rule}_{i}{written}: {body}")
        return f'"{{" {rule}_0n "}}"'

    def _array(self, schema: dict, rule: str, rules: list[str]) -> str:
        item = self.value(schema.get("items") or {"type": "string"}, f"{rule}_i", rules)
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) == 0:
            return '"[" "]"'
        # The first item, then the others: `low` required, then optional up to `high`.
        more = [f'"," {item}'] * max(0, low - 1)
        tail = f'("," {item})*'
        if high is not None:
            tail = ""
            for _ in range(int(high) - max(low, 1)):
                tail = f'("," {item} {tail})?'
        items = " ".join([item, *more, tail]).strip()
        return f'"[" {items} "]"' if low else f'"[" ({items})? "]"'

    def _strings(self, schema: dict) -> list[str] | None:
        """The values of an enum (or const) of strings this syntax can write, else None."""
        values = schema.get("enum")
        if "const" in schema:
            values = [schema["const"]]
        if not isinstance(values, list) or not values:
            return None
        excluded = re.compile(f"[{self.EXCLUDED}]")
        if all(isinstance(v, str) and not excluded.search(v) for v in values):
            return values
        return None


class _FunctionGemma(_Gemma4):
    """FunctionGemma's call syntax: Gemma 4's, flat, strings between ``<escape>`` markers
    and without ``}`` (mlx-lm's function_gemma parser ends the call at the first one)."""

    QUOTE = "<escape>"
    EXCLUDED = "<}\\x00"
    FLAT = True


_CALL_SYNTAX: dict[str, type[_Gemma4]] = {"gemma4": _Gemma4, "function_gemma": _FunctionGemma}
_CALL_NAMES = {"gemma4": re.compile(r"[\w-]+"), "function_gemma": re.compile(r"\w+")}


# --- markers --------------------------------------------------------------------------------


class _Markers:
    """A tool-call marker as a Lark item: the special token itself where the marker is one
    special token of the tokenizer (llguidance's ``<[id]>``), else its text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> str:
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            added = self.tokenizer.added_tokens_decoder
        except Exception:  # a tokenizer without these: the marker is its text
            return _lark_string(text)
        if len(ids) == 1 and ids[0] in added and added[ids[0]].special:
            return f"<[{ids[0]}]>"
        return _lark_string(text)


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal (JSON escapes)."""
    return json.dumps(text)

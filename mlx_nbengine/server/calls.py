"""What the agents' endpoint hands the engine for an API call, and how it reads the
answer: the prompt (chat messages as templates read them, or plain lines for a base
model), the template's extra arguments, the grammar of a forced tool call, the split of the
answer (`agentio.OutputSplitter`), and `Engine.submit` with the engine's errors as
`APIError`s."""

from __future__ import annotations

import json
from typing import Any

from mlx_nbengine.engine import EngineClosedError, InvalidRequestError, PromptTooLongError
from mlx_nbengine.errors import EngineError
from mlx_nbengine.server.agentio import OutputSplitter, template_messages
from mlx_nbengine.server.openai_shapes import APIError, Call

__all__ = ["EngineCalls", "plain_chat"]


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def plain_chat(messages: list[dict], tools: list[dict] | None = None) -> str:
    """Chat messages as plain text for a model without a chat template (a base model):
    a ``tools:`` line with the offered tools' JSON first (never dropped unseen), one
    ``role: content`` line each, an assistant's calls in the JSON ``<tool_call>`` form the
    answer's splitter reads, then ``assistant:`` for the answer to follow."""
    lines = []
    if tools:
        lines.append("tools: " + json.dumps(tools, separators=(",", ":"), ensure_ascii=False))
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # parts (images are refused for text models)
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        for called in m.get("tool_calls") or ():
            function = called.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):  # JSON text, as the chat form holds it
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            call = {"name": function.get("name"), "arguments": arguments}
            content += "<tool_call>" + json.dumps(call, ensure_ascii=False) + "</tool_call>"
        lines.append(f"{m.get('role', 'user')}: {content}")
    return "\n".join([*lines, "assistant:"])


class EngineCalls:
    """A server's calls into its `engine` (see the module)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def template_kwargs(self, call: Call) -> dict[str, Any] | None:
        """What the chat template is given beside the messages: the call's own values
        (``reasoning_effort``, ``chat_template_kwargs``), ``tools`` for a template that reads
        them (others never see them; none with ``tool_choice: "none"``), and
        ``enable_thinking: False`` for a forced call (its grammar starts at the first
        token, so a template that can should not open a reasoning block)."""
        out = dict(call.template_kwargs)
        tools = call.offered_tools
        if tools:
            lm = self.engine.model
            template = getattr(getattr(lm, "text_tokenizer", None), "chat_template", None)
            if isinstance(template, dict):  # named templates: the default one renders chats
                template = template.get("default") or template.get("tool_use") or ""
            if isinstance(template, str) and "tools" in template:
                out["tools"] = tools
        if call.forced:
            out.setdefault("enable_thinking", False)
        return out or None

    def tool_grammar(self, call: Call) -> str | None:
        """The grammar a forced call is decoded under (`toolgrammar.tool_call_grammar` for
        the model's tokenizer); None where the call is not forced."""
        if not call.forced:
            return None
        from mlx_nbengine.server import toolgrammar  # noqa: PLC0415 - only forced calls need it

        return toolgrammar.tool_call_grammar(
            self.engine.model.tokenizer,
            call.tools,
            call.tool_choice,
            parallel=call.parallel_tool_calls,
        )

    def splitter(self, call: Call, handle: Any) -> OutputSplitter:
        """The split of a chat call's answer (`handle`: its `Request`): reasoning, text and
        calls of the tools the model was offered, with the model's own markers and parser."""
        return OutputSplitter(
            getattr(self.engine, "model", None),
            call.offered_tools,
            prompt=getattr(handle, "prompt_tokens", None),
        )

    def prompt_of(self, call: Call) -> Any:
        """The prompt `Engine.submit` takes for `call`: chat messages as templates read them
        (`agentio.template_messages`), or plain lines for a model without a template."""
        prompt = call.prompt
        if _is_chat(prompt):
            prompt = template_messages(prompt)
            if not getattr(self.engine.model, "has_chat_template", True):
                # A base model: no template to render them (the tools as a line of JSON).
                prompt = plain_chat(prompt, call.offered_tools)
        return prompt

    def submit(self, call: Call) -> Any:
        """`Engine.submit` (on a worker thread: it tokenizes); OpenAI errors for its own."""
        prompt = self.prompt_of(call)
        try:
            grammar = self.tool_grammar(call)
            extra = {"grammar": grammar} if grammar is not None else {}
            return self.engine.submit(
                prompt,
                max_tokens=call.max_tokens,
                temperature=call.temperature,
                top_p=call.top_p,
                seed=call.seed,
                stop=call.stop or None,
                images=call.images or None,
                template_kwargs=self.template_kwargs(call),
                **extra,
            )
        except PromptTooLongError as exc:
            raise APIError(str(exc), param="messages", code="context_length_exceeded") from None
        except InvalidRequestError as exc:
            raise APIError(str(exc)) from None
        except EngineClosedError:
            raise APIError(
                "the model was unloaded; load it again and restart the server",
                status=503,
                type="server_error",
            ) from None
        except EngineError as exc:  # e.g. a model without a chat template
            raise APIError(str(exc)) from None

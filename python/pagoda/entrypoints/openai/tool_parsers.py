"""Tool calls in generated text, per model family's format (vLLM's
--tool-call-parser names), and the JSON schemas that force a call when
tool_choice is "required" or names a function.

hermes (Qwen2.5, Qwen3): each call is `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`; text before the first call is the message's content.
llama3_json (Llama 3.1+): the whole output is one or more JSON objects
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`,
separated by `;`). Text that does not parse as calls stays content.

While streaming, content_end says how much of the text so far is surely
content: the rest may open a call and is held back until the end.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from pagoda.engine.detokenizer import partial_stop_len


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = dict(id=f"call_{secrets.token_hex(12)}", type="function",
                    function=dict(name=self.name, arguments=self.arguments))
        return call if index is None else dict(index=index, **call)


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); no calls (and all the text as content) unless every call parses."""
        start = text.find(self.START)
        if start == -1:
            return text, []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start != -1 else len(text) - partial_stop_len(text, [self.START])


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while at < len(body) and (body[at].isspace() or body[at] == ";"):
                at += 1
        return None, calls

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith(("{", self.TAG)) or self.TAG.startswith(body):
            return 0  # may be a call: held back until the end
        return len(text)


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def forced_call_schema(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> dict[str, Any]:
    """The JSON schema the output follows when tool_choice forces a call: a
    named function's arguments, or ("required") an array of {name,
    parameters} objects over the tools (one item unless parallel)."""
    if isinstance(tool_choice, dict):
        return _parameters(next(t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]))
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, tool_choice: Any) -> list[ToolCall]:
    """The calls in a forced output (it follows forced_call_schema)."""
    if isinstance(tool_choice, dict):
        return [ToolCall(tool_choice["function"]["name"], text)]
    return [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in json.loads(text)]

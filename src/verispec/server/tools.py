"""Function calling in the chat endpoint: `tools` and `tool_choice` in, `tool_calls` out.

Owns the three things tools change in a chat request:
- the prompt: the messages as the chat template takes them (an assistant turn's `tool_calls`
  with their arguments as objects, a `tool` turn's `tool_call_id`) and the tools given to the
  template (`apply_chat_template(tools=...)`); without a template, a plain description of the
  tools and of the call syntax;
- the output's format: `tool_choice` "required" or a named function constrains the output to a
  call, `{"name": ..., "arguments": {...}}` whose arguments follow the function's `parameters`
  schema (a JSON schema, compiled as any `response_format`); "auto" leaves the model free, and
  calls are read from `<tool_call>{...}</tool_call>` blocks (the Hermes/Qwen syntax, which the
  templates of tool-trained models such as Qwen2.5 ask for); "none" ignores the tools;
- the answer: the calls parsed into OpenAI's `tool_calls` (each with an id and its arguments as
  a JSON string), `finish_reason` "tool_calls", the text outside the calls as `content`.
"""

from __future__ import annotations

import json
import re
import uuid

CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def active(tools, tool_choice) -> bool:
    """Whether the request's output may hold tool calls."""
    return bool(tools) and tool_choice != "none"


def call_schema(tools, tool_choice) -> dict | None:
    """The JSON schema of the output for "required" or a named function (None for auto/none)."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    functions = [tool.function for tool in tools]
    if tool_choice != "required":
        functions = [f for f in functions if f.name == tool_choice.function.name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f.name},
                             "arguments": f.parameters if f.parameters else {"type": "object"}}}
             for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def template_messages(messages) -> list[dict]:
    """The request's messages as chat templates read them."""
    rendered = []
    for message in messages:
        item = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            item["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": _arguments(call.function.arguments)}}
                                  for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


def plain_messages(messages: list[dict], tools) -> list[dict]:
    """For a model without a chat template: the tools described in a first system turn, calls
    written as `<tool_call>` blocks in the assistant's text."""
    described = json.dumps([tool.model_dump(exclude_none=True) for tool in tools])
    system = {"role": "system", "content": f"Tools: {described}\nTo call one, write "
                                           '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'}
    out = [system]
    for message in messages:
        text = message["content"]
        for call in message.get("tool_calls", ()):
            text += "<tool_call>" + json.dumps({"name": call["function"]["name"],
                                                 "arguments": call["function"]["arguments"]}) + "</tool_call>"
        out.append({"role": message["role"], "content": text})
    return out


def _arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_calls(text: str, constrained: bool) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an output: a constrained output is one call; a free one holds
    calls in `<tool_call>` blocks (a block that is not a call stays text)."""
    if constrained:
        call = _call(text)
        return (None, [call]) if call is not None else (text, [])
    calls, kept, last = [], [], 0
    for match in CALL_BLOCK.finditer(text):
        call = _call(match.group(1))
        if call is None:
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}

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
  templates of tool-trained models such as Qwen2.5 ask for) and from fenced JSON blocks
  (```` ```json {"name": ..., "arguments": ...} ``` ````) that name one of the request's tools,
  the form Qwen2.5-Coder writes its calls in under that same template; "none" ignores the tools;
- the answer: the calls parsed into OpenAI's `tool_calls` (each with an id and its arguments as
  a JSON string), `finish_reason` "tool_calls", the text outside the calls as `content`.

`CallReader` reads an output as it is written and says what to send (OpenAI's deltas): text
outside the calls as content at once, except what may be the start of a call block; a call as
soon as its name is known (id, name, empty arguments), then its arguments' text as the model
writes it, in fragments. A streamed answer and a whole one are read by the same reader, so the
arguments a client joins from the fragments are the whole answer's, character for character
(the model's own text of the arguments value). A block whose text does not begin
`{"name": ..., "arguments": ...` is held until it closes: then it is a call if it parses as one
(the arguments written as `json.dumps` writes them), else text. A fenced block whose first
character is not `{` is code, streamed as content at once.
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


def parse_calls(text: str, constrained: bool, names: frozenset[str] = frozenset()) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output, as `CallReader` streams it: a constrained output
    is one call; a free one holds calls in `<tool_call>` blocks, and in fenced JSON blocks that
    call one of `names` (a block that is not a call stays text). Content is None where calls
    were made and no other text was written."""
    reader = CallReader(constrained, names)
    content, calls = [], []
    for delta in reader.feed(text) + reader.finish():
        content.append(delta.get("content", ""))
        for part in delta.get("tool_calls", ()):
            if "id" in part:
                calls.append({"id": part["id"], "type": "function",
                              "function": {"name": part["function"]["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += part["function"]["arguments"]
    joined = "".join(content)
    return (joined or None) if calls else joined, calls


OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"  # a fenced block opens and closes with it; its first line may name a language
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
FENCE_TAG = re.compile(r'[A-Za-z]*[ \t]*\n?')  # the language tag and the end of the fence's line


class CallReader:
    """One choice's output, read as it is written (`feed`, then `finish` at its end), as the
    deltas of OpenAI's chat stream: `{"content": text}` and `{"tool_calls": [part]}`, a part
    being a call's start (index, id, type, name, empty arguments) or a fragment of its
    arguments (index, arguments). Whitespace next to a call is not content."""

    def __init__(self, constrained: bool, names: frozenset[str] = frozenset()):
        self.constrained = constrained
        self.names = names  # the tools a fenced block may call (none: fenced blocks are text)
        self.pending = ""  # text read but not yet said: a possible `<tool_call>`, a block, spaces
        self.in_block = constrained  # a constrained output is one call, with no tags around it
        self.close = CLOSE  # what ends the open block: `</tool_call>`, or a fence
        self.in_code = False  # inside a fenced block that is not a call: content up to its fence
        self.calls = 0
        self.value: _ValueScanner | None = None  # the arguments being streamed
        self.after_value = False  # the call's arguments are whole; the rest of its block is skipped
        self.after_call = False  # spaces after a call are not content
        self.spaces = ""  # spaces before an open block: content if the block is not a call

    def feed(self, text: str) -> list[dict]:
        self.pending += text
        deltas: list[dict] = []
        while True:
            progressed = self._step(deltas)
            if not progressed:
                return deltas

    def finish(self) -> list[dict]:
        """What is still held when the output ends: an unclosed block that is not yet a call (as
        text, or as a call if a constrained output parses as one), trailing spaces where no call
        was made."""
        text, self.pending = self.pending, ""
        if self.value is not None or self.after_value:
            return []  # a call cut short stays as streamed
        if self.in_code:
            return [{"content": text}] if text else []
        if self.in_block:
            if self.constrained:
                call = _call(text)
                if call is not None:
                    return self._whole_call(call)
                return [{"content": text}] if text else []
            text = self.spaces + self._opener() + text
        if text and not (self.calls and not text.strip()):
            return [{"content": text}]
        return []

    # -- the states ----------------------------------------------------------------------------
    def _step(self, deltas: list[dict]) -> bool:
        if self.value is not None:
            return self._stream_value(deltas)
        if self.after_value:
            return self._skip_to_close()
        if self.in_code:
            return self._read_code(deltas)
        if self.in_block:
            return self._read_fence(deltas) if self.close == FENCE else self._read_block(deltas)
        return self._read_text(deltas)

    def _opener(self) -> str:
        return OPEN if self.close == CLOSE else FENCE

    def _openers(self) -> tuple[str, ...]:
        return (OPEN, FENCE) if self.names else (OPEN,)

    def _read_text(self, deltas: list[dict]) -> bool:
        if self.after_call:
            self.pending = self.pending.lstrip()
            self.after_call = not self.pending
        found = [(at, opener) for opener in self._openers() if (at := self.pending.find(opener)) >= 0]
        if found:
            at, opener = min(found)
            before, self.pending = self.pending[:at], self.pending[at + len(opener):]
            said = before.rstrip()
            if said:
                deltas.append({"content": said})
            self.spaces, self.in_block = before[len(said):], True
            self.close = CLOSE if opener == OPEN else FENCE
            return True
        keep = max(_open_prefix(self.pending, opener) for opener in self._openers())
        say = self.pending[:len(self.pending) - keep]
        stripped = say.rstrip()
        if stripped:  # spaces are held: they are content only if text follows them
            deltas.append({"content": stripped})
            self.pending = self.pending[len(stripped):]
        return False

    def _read_block(self, deltas: list[dict]) -> bool:
        if self._start_call(deltas, self.pending, 0, None):
            return True
        if not self.constrained:
            close = self.pending.find(CLOSE)
            if close >= 0:
                self._end_held_block(deltas, close, _call(self.pending[:close].strip()))
                return True
        return False

    def _read_fence(self, deltas: list[dict]) -> bool:
        """A fenced block: a call if its JSON calls one of the request's tools, else code."""
        body = self.pending
        start = FENCE_TAG.match(body).end()  # past the language tag and the fence's line
        first = body[start:].lstrip()[:1]
        if not first:
            return False  # nothing of the block's text yet
        if first != "{":
            return self._as_code(deltas)
        if CALL_HEAD.match(body, start) is not None:
            return self._start_call(deltas, body, start, self.names) or self._as_code(deltas)
        close = body.find(FENCE, start)
        if close >= 0:
            self._end_held_block(deltas, close, _call(body[start:close].strip(), self.names))
            return True
        return False

    def _as_code(self, deltas: list[dict]) -> bool:
        """The open fenced block is code: said as it comes, up to its closing fence."""
        deltas.append({"content": self.spaces + FENCE + self.pending})
        self.pending, self.spaces, self.in_block, self.in_code = "", "", False, True
        return True

    def _start_call(self, deltas: list[dict], text: str, start: int, names: frozenset[str] | None) -> bool:
        """Begin streaming a call if `text` from `start` begins `{"name": N, "arguments":` (N among
        `names` unless None)."""
        head = CALL_HEAD.match(text, start)
        if head is None:
            return False
        try:
            name = json.loads('"' + head.group(1) + '"')
        except json.JSONDecodeError:
            return False
        if not isinstance(name, str) or (names is not None and name not in names):
            return False
        deltas.append({"tool_calls": [{"index": self.calls, "id": _call_id(), "type": "function",
                                           "function": {"name": name, "arguments": ""}}]})
        self.pending = text[head.end():]
        self.value = _ValueScanner()
        return True

    def _end_held_block(self, deltas: list[dict], close: int, call: dict | None) -> None:
        """A held block closed at `close`: a whole call, or text."""
        block, self.pending = self.pending[:close], self.pending[close + len(self.close):]
        self.in_block = False
        if call is not None:
            deltas.extend(self._whole_call(call))
            self.after_call = True
        else:
            opener = self._opener()
            deltas.append({"content": self.spaces + opener + block + self.close})
        self.spaces = ""

    def _read_code(self, deltas: list[dict]) -> bool:
        close = self.pending.find(FENCE)
        if close >= 0:
            deltas.append({"content": self.pending[:close + len(FENCE)]})
            self.pending, self.in_code = self.pending[close + len(FENCE):], False
            return True
        say = self.pending[:len(self.pending) - _open_prefix(self.pending, FENCE)]
        if say:
            deltas.append({"content": say})
            self.pending = self.pending[len(say):]
        return False

    def _stream_value(self, deltas: list[dict]) -> bool:
        if not self.value.kind:
            self.pending = self.pending.lstrip()  # spaces before the value, however they arrive
        taken = self.value.take(self.pending)
        if taken:
            deltas.append({"tool_calls": [{"index": self.calls, "function": {"arguments": self.pending[:taken]}}]})
            self.pending = self.pending[taken:]
        if not self.value.done:
            return False
        self.value, self.after_value = None, True
        self.calls += 1
        return True

    def _skip_to_close(self) -> bool:
        if self.constrained:
            self.pending = ""  # the closing brace
            return False
        close = self.pending.find(self.close)
        if close < 0:
            return False
        self.pending = self.pending[close + len(self.close):]
        self.after_value = self.in_block = False
        self.after_call, self.spaces = True, ""
        return True

    def _whole_call(self, call: dict) -> list[dict]:
        index, self.calls = self.calls, self.calls + 1
        function = call["function"]
        return [{"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                 "function": {"name": function["name"], "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]}]


class _ValueScanner:
    """Where one JSON value ends in text read piece by piece (its nesting, its strings)."""

    def __init__(self):
        self.depth = 0
        self.kind = ""  # "" (not begun), "nest" ({ or [), "string", "literal"
        self.in_string = self.escaped = self.done = False

    def take(self, text: str) -> int:
        """How many leading characters of `text` belong to the value (all of them, unless the
        value ends inside it; `done` then)."""
        for i, char in enumerate(text):
            if self.done:
                return i
            if not self.kind:
                if char.isspace():
                    continue
                self.kind = {"{": "nest", "[": "nest", '"': "string"}.get(char, "literal")
            if self.kind == "literal":
                if char in ",}] \t\r\n":
                    self.done = True
                    return i
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    self.done = self.kind == "string"
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        return len(text)


def _open_prefix(text: str, opener: str) -> int:
    """The length of the longest end of `text` that begins `opener`."""
    for size in range(min(len(opener) - 1, len(text)), 0, -1):
        if opener.startswith(text[-size:]):
            return size
    return 0


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(text: str, names: frozenset[str] | None = None) -> dict | None:
    """A call `{"name": ..., "arguments": ...}` (or "parameters"), its name among `names` unless
    None; None where `text` is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": _call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}

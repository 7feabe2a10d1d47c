"""`server.tools.CallReader`: an output read as it is written gives OpenAI's stream deltas, and the
same content and calls however its text is cut into pieces (one piece, a character at a time, at
random), so a streamed answer joins into the whole answer's message. Calls come in `<tool_call>`
blocks, or in fenced JSON blocks naming one of the request's tools (as Qwen2.5-Coder writes them;
the first case below is its answer on the project's 1.5B)."""

from __future__ import annotations

import json
import random

import pytest

from verispec.server.tools import CallReader, parse_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo \\"N\\"", "days": [1, {"x": "}"}]}}'
CODER = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo",\n    "unit": "c"\n  }\n}\n```'
NAMES = frozenset({"get_weather", "now"})
FENCED = [
    (CODER, NAMES),
    ("Sure.\n```\n" + WEATHER + "\n```\nDone.", NAMES),
    ("Code:\n```python\nprint({'a': 1})\n```\nand JSON:\n```json\n{\"a\": 1}\n```", NAMES),
    ('```json\n{"name": "unknown", "arguments": {}}\n```', NAMES),
    (CODER, frozenset()),
    ("```json\n{\"arguments\": {\"x\": 1}, \"name\": \"now\"}\n``` and ``", NAMES),
]
OUTPUTS = [
    ("Let me look.<tool_call>" + WEATHER + "</tool_call>", False),
    ("<tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
     False),
    ("First. <tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"late\"}</tool_call> Then text.", False),
    ("no call here <tool_call>not json</tool_call> and <tool", False),
    ("plain text with a < sign and <tool_cal", False),
    ("  spaced  ", False),
    ("<tool_call>\n{\"name\": \"cut\", \"arguments\": {\"city\": \"Os", False),
    (WEATHER, True),
    ('{"name": "é", "arguments": {"q": "ünï"}}', True),
    ('{"name": "get_time", "arguments": {"zone": "utc"}', True),
]


def joined(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """The content and the (name, arguments) of the calls a client joins from the deltas."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", ()):
            if "id" in part:
                assert part["index"] == len(calls) and part["function"]["arguments"] == ""
                calls.append([part["function"]["name"], ""])
            calls[part["index"]][1] += part["function"]["arguments"]
    return content, [tuple(call) for call in calls]


def read(pieces: list[str], constrained: bool, names: frozenset[str] = frozenset()) -> list[dict]:
    reader = CallReader(constrained, names)
    deltas = []
    for piece in pieces:
        deltas += reader.feed(piece)
    return deltas + reader.finish()


def cuts(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


@pytest.mark.parametrize("text,constrained,names", [(t, c, frozenset()) for t, c in OUTPUTS] +
                         [(t, False, n) for t, n in FENCED])
def test_any_cut_of_the_text_gives_the_whole_texts_answer(text, constrained, names):
    whole = joined(read([text], constrained, names))
    assert joined(read(list(text), constrained, names)) == whole
    for seed in range(20):
        assert joined(read(cuts(text, seed), constrained, names)) == whole
    content, calls = parse_calls(text, constrained, names)
    assert (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == whole


@pytest.mark.parametrize("text,names,content,calls", [
    (CODER, NAMES, None, [("get_weather", '{\n    "city": "Oslo",\n    "unit": "c"\n  }')]),
    (CODER, frozenset(), CODER, []),  # no tools of that name: a code block
    ("Sure.\n```\n" + WEATHER + "\n```\nDone.", NAMES, "Sure.Done.",
     [("get_weather", json.dumps(json.loads(WEATHER)["arguments"]))]),
    ('```json\n{"name": "unknown", "arguments": {}}\n```', NAMES, '```json\n{"name": "unknown", "arguments": {}}\n```',
     []),
    ("```json\n{\"arguments\": {\"x\": 1}, \"name\": \"now\"}\n```", NAMES, None, [("now", '{"x": 1}')]),
])
def test_fenced_json_that_calls_a_given_tool_is_a_call(text, names, content, calls):
    got_content, got_calls = parse_calls(text, False, names)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls


def test_a_code_block_streams_as_it_is_written():
    reader = CallReader(False, NAMES)
    assert reader.feed("Here:\n```py") == [{"content": "Here:"}]
    assert reader.feed("thon\nprint(1)\n") == [{"content": "\n```python\nprint(1)\n"}]
    assert reader.feed("x = 2\n``") == [{"content": "x = 2\n"}]
    assert reader.feed("`\nbye") == [{"content": "```"}, {"content": "\nbye"}]


def test_a_call_is_said_as_soon_as_its_name_is_known_and_its_arguments_as_written():
    reader = CallReader(constrained=False)
    assert reader.feed("Let me look.<tool_call>\n{\"name\": \"get_wea") == [{"content": "Let me look."}]
    start = reader.feed("ther\", \"arguments\": {\"ci")
    assert start[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert start[0]["tool_calls"][0]["id"].startswith("call_")
    assert start[1:] == [{"tool_calls": [{"index": 0, "function": {"arguments": "{\"ci"}}]}]
    assert reader.feed("ty\": \"Oslo\"}}\n</tool_call>") == \
        [{"tool_calls": [{"index": 0, "function": {"arguments": "ty\": \"Oslo\"}"}}]}]
    assert reader.feed("\n") == [] and reader.finish() == []


@pytest.mark.parametrize("text,constrained,content,calls", [
    ("Let me look.<tool_call>" + WEATHER + "</tool_call>", False, "Let me look.",
     [("get_weather", json.dumps(json.loads(WEATHER)["arguments"], ensure_ascii=False))]),
    ("First. <tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"late\"}</tool_call> Then text.", False,
     "First.Then text.", [("late", '{"a": 1}')]),
    ("no call here <tool_call>not json</tool_call>", False, "no call here <tool_call>not json</tool_call>", []),
    ("  spaced  ", False, "  spaced  ", []),
    ('{"name": "é", "arguments": {"q": "ünï"}}', True, None, [("é", '{"q": "ünï"}')]),
    ("not a call", True, "not a call", []),
])
def test_what_a_whole_output_holds(text, constrained, content, calls):
    got_content, got_calls = parse_calls(text, constrained)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls

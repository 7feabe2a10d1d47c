"""`server.tools.CallReader`: an output read as it is written gives OpenAI's stream deltas, and the
same content and calls however its text is cut into pieces (one piece, a character at a time, at
random), so a streamed answer joins into the whole answer's message."""

from __future__ import annotations

import json
import random

import pytest

from verispec.server.tools import CallReader, parse_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Oslo \\"N\\"", "days": [1, {"x": "}"}]}}'
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


def read(pieces: list[str], constrained: bool) -> list[dict]:
    reader = CallReader(constrained)
    deltas = []
    for piece in pieces:
        deltas += reader.feed(piece)
    return deltas + reader.finish()


def cuts(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


@pytest.mark.parametrize("text,constrained", OUTPUTS)
def test_any_cut_of_the_text_gives_the_whole_texts_answer(text, constrained):
    whole = joined(read([text], constrained))
    assert joined(read(list(text), constrained)) == whole
    for seed in range(20):
        assert joined(read(cuts(text, seed), constrained)) == whole
    content, calls = parse_calls(text, constrained)
    assert (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls]) == whole


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

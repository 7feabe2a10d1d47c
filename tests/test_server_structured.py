"""Structured output through the server: `response_format` json_schema (the openai client's
`chat.completions.parse` with a Pydantic model) and json_object, streamed and not, 8 clients at
once giving each request's output alone, and a schema that does not compile being a 400 naming
`response_format` (never a 500).

The model is a tiny random-weight Llama over a tokenizer of printable characters with an EOS, in
int8 numerics so that concurrent requests decode together in one batch."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

import helpers
import server_helpers as sh
from test_constraint import json_tokenizer
from verispec.server import ServerSettings

pytestmark = pytest.mark.long
MODEL_ID = "tiny-json"


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    ok: bool


@pytest.fixture(scope="module")
def server():
    tokenizer = json_tokenizer()
    config = helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1, max_positions=2048)
    model = helpers.make_model(config, seed=3)
    target = sh.HookedTarget(model, tokenizer, name=MODEL_ID, fast=True, blocks=helpers.blockify(model),
                             numerics="int8")
    running = sh.RunningServer(target, ServerSettings(model_id=MODEL_ID, max_tokens_limit=200))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=sh.HANG_GUARD_S)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": f'Reply as {{"name":"bob","age":31,"ok":true}}: {question}'}]


def test_parse_with_a_pydantic_model_gives_a_valid_instance(client):
    for method in ("ar", "anpd", "pld"):
        for question in ("who is al?", "who is eve?"):
            completion = client.chat.completions.parse(model=MODEL_ID, messages=ask(question), response_format=Person,
                                                       temperature=0, max_tokens=80, extra_body={"method": method})
            choice = completion.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            person = choice.message.parsed
            assert isinstance(person, Person) and len(person.name) <= 6 and 0 <= person.age <= 120
            assert Person.model_validate_json(choice.message.content) == person


def test_json_object_and_a_streamed_schema(client):
    free = client.chat.completions.create(model=MODEL_ID, messages=ask("x"), temperature=0, max_tokens=30,
                                          response_format={"type": "json_object"})
    assert free.choices[0].message.content.startswith("{")
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    pieces = client.chat.completions.create(model=MODEL_ID, messages=ask("who?"), temperature=0.8, seed=4,
                                            max_tokens=80, response_format=schema, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
    Person.model_validate_json(text)


def test_eight_clients_at_once_get_each_output_alone(client):
    strict = {**Person.model_json_schema(), "additionalProperties": False}  # as OpenAI's strict mode asks
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": strict, "strict": True}}
    requests = [dict(messages=ask(f"person {i}"), extra_body={"method": ("anpd", "pld", "ar")[i % 3]},
                     response_format=schema if i % 4 else {"type": "json_object"}, max_tokens=60)
                for i in range(8)]

    def send(kwargs):
        return client.chat.completions.create(model=MODEL_ID, temperature=0, **kwargs).choices[0].message.content

    alone = [send(kwargs) for kwargs in requests]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(send, requests))
    assert together == alone
    for kwargs, text in zip(requests, together):
        if kwargs["response_format"]["type"] == "json_schema":
            Person.model_validate_json(text)


@pytest.mark.parametrize("response_format,reason", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "regex", "regex": "a+"}, "not supported"),
])
def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(client, response_format, reason):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=ask("x"), max_tokens=5,
                                       response_format=response_format)
    error = caught.value.body
    assert error["param"] == "response_format" and reason in error["message"], error
    json.dumps(error)  # OpenAI's shape: a JSON object


# -- tools -----------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 8}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "cet"]}}}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_or_named_tool_call_round_trip(client, stream):
    """tool_choice a named function, then "required": the answer is a call with arguments that
    follow the function's schema; the call and the tool's result go back in a follow-up turn."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        kwargs = dict(model=MODEL_ID, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
                      temperature=0, max_tokens=60)
        if stream:  # the openai client joins the call's pieces, as it does OpenAI's streams
            with client.chat.completions.stream(**kwargs) as events:
                pieces = [event for event in events if event.type == "tool_calls.function.arguments.delta"]
                response = events.get_final_completion()
            calls, finish = response.choices[0].message.tool_calls, response.choices[0].finish_reason
            assert len(pieces) > 1, "the arguments arrive as they are written, not whole at the end"
            assert "".join(piece.arguments_delta for piece in pieces) == calls[0].function.arguments
        else:
            response = client.chat.completions.create(**kwargs)
            calls, finish = response.choices[0].message.tool_calls, response.choices[0].finish_reason
            assert response.choices[0].message.content is None
        assert finish == "tool_calls" and len(calls) == 1
        call = calls[0]
        arguments = json.loads(call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            assert set(arguments) == {"city"} and len(arguments["city"]) <= 8
        else:
            assert arguments["zone"] in ("utc", "cet")
    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                              "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL_ID, messages=follow_up, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=8)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    free = client.chat.completions.create(model=MODEL_ID, messages=messages, tools=[WEATHER], temperature=0,
                                          max_tokens=8)  # auto: the model is free; this one writes text
    assert free.choices[0].finish_reason in ("stop", "length") and free.choices[0].message.content


def test_auto_reads_calls_from_tool_call_blocks():
    from verispec.server.tools import parse_calls

    content, calls = parse_calls('Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                 '</tool_call>', constrained=False)
    assert content == "Let me look." and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert parse_calls("no call here <tool_call>not json</tool_call>", constrained=False) == \
        ("no call here <tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "response_format"),
])
def test_bad_tool_requests_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_ID, messages=ask("x"), max_tokens=5, **extra)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_streamed_call_keeps_every_tokens_log_probability(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
        tool_choice="required", temperature=0, max_tokens=60, logprobs=True, stream=True,
        stream_options={"include_usage": True}))
    entries = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
               for entry in chunk.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens > 0


def test_n_streamed_choices_each_join_into_their_own_call(client):
    """With n = 2, each choice's call arrives in its own pieces (by choice and call index) and
    joins into that choice's arguments, sampled apart (seed + i)."""
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
                  tool_choice="required", temperature=1.0, seed=5, max_tokens=60, n=2)
    joined: dict[int, dict] = {}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                entry = joined.setdefault(choice.index, {"name": "", "arguments": "", "pieces": 0})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
                entry["pieces"] += 1
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    whole = client.chat.completions.create(**kwargs)
    assert sorted(joined) == [0, 1] and finish == {0: "tool_calls", 1: "tool_calls"}
    for index, choice in enumerate(whole.choices):
        call = choice.message.tool_calls[0]
        assert joined[index]["name"] == call.function.name == "get_weather"
        assert joined[index]["arguments"] == call.function.arguments and joined[index]["pieces"] > 2

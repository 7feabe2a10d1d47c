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
    config = helpers.make_config("llama", vocab_size=len(tokenizer), init=0.1, max_positions=512)
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
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(),
                                                     "strict": True}}
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

"""Every field of both endpoints, at and past its range, as a property over the request schemas:
whatever value a client sends in whichever field (the fields read from the pydantic models, so a
field added later is walked too), the server answers a 4xx in OpenAI's error shape or a 200,
never a 5xx, and serves a normal request afterwards.

Values are drawn around every range the schemas and the settings have (0, 1, 2, 5, 16, 20, 100,
2**64 - 1 and their neighbours; floats that are 0 in float32, subnormals, NaN, infinities, huge
integers), as every JSON type (strings with lone surrogates, lists, objects, nesting) and as
valid-looking values of the field's own kind; up to three fields are changed at once, nested
fields (a message's role, content, name; stream_options) included.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import helpers
import server_helpers as sh
from verispec.server import ServerSettings
from verispec.server.schemas import ChatCompletionRequest, CompletionRequest, Message, StreamOptions

pytestmark = pytest.mark.long

MODEL_ID = "tiny"
BASE = {  # a valid, cheap request of each endpoint; each example changes fields of a copy
    "/v1/completions": {"model": MODEL_ID, "prompt": "hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": MODEL_ID, "messages": [{"role": "user", "content": "hello"}],
                             "max_tokens": 2, "temperature": 0},
}
FIELDS = {path: sorted(model.model_fields) for path, model in
          (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest))}
MESSAGE_FIELDS = sorted(Message.model_fields)
STREAM_OPTION_FIELDS = sorted(StreamOptions.model_fields)

EDGES = [0, 1, 2, 3, 4, 5, 6, 16, 17, 20, 21, 50, 64, 100, 101, 200, 201, 1024, 2**31, 2**63 - 1, 2**63,
         2**64 - 1, 2**64, 10**30]
EDGE_FLOATS = [0.0, -0.0, 1e-46, 1e-300, 5e-324, 1e-7, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, -2.0, 100.0, 100.5,
               1e308, float("nan"), float("inf"), float("-inf")]
EDGE_TEXTS = ["", " ", "\ud800", "a\udfffb", "\x00", "user", "tool", "text", "json_object", MODEL_ID, "anpd",
              "pld/constant:3", "anpd/tree=8/tree=9", "mtad", "nope", "x" * 3000]
# Every value the exhaustive walk puts in every field: each range's edges and each JSON type.
EDGE_VALUES = ([None, True, False, [], {}, [1], ["a"], [[]], {"type": "text"}, {"role": "user", "content": "hi"}]
               + EDGES + [-edge for edge in EDGES] + EDGE_FLOATS + EDGE_TEXTS)
INTEGERS = st.one_of(st.sampled_from(EDGES + [-edge for edge in EDGES]), st.integers(-(2**70), 2**70))
FLOATS = st.one_of(st.sampled_from(EDGE_FLOATS), st.floats(allow_nan=True, allow_infinity=True))
TEXTS = st.one_of(st.sampled_from(EDGE_TEXTS), st.text(max_size=20))
SCALARS = st.one_of(st.none(), st.booleans(), INTEGERS, FLOATS, TEXTS)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(TEXTS, st.sampled_from(MESSAGE_FIELDS + ["type"])),
                                                 inner, max_size=3)), max_leaves=8)


@st.composite
def bodies(draw):
    """(endpoint, body): a valid base body with one to three fields (top-level or nested) changed."""
    path = draw(st.sampled_from(sorted(BASE)))
    body = json.loads(json.dumps(BASE[path]))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top"] * 4 + (["message"] if "messages" in body else []) + ["stream_options"]))
        value = draw(VALUES)
        if where == "top":
            field = draw(st.sampled_from(FIELDS[path]))
            if draw(st.booleans()) and field in body:
                del body[field]  # a required field missing
            else:
                body[field] = value
        elif where == "message" and isinstance(body.get("messages"), list) and body["messages"] \
                and isinstance(body["messages"][0], dict):
            body["messages"][0][draw(st.sampled_from(MESSAGE_FIELDS))] = value
        else:
            body["stream_options"] = {draw(st.sampled_from(STREAM_OPTION_FIELDS)): value}
    return path, body


@pytest.fixture(scope="module")
def server():
    tokenizer = helpers.char_tokenizer()
    running = sh.RunningServer(sh.text_target(tokenizer), ServerSettings(
        model_id=MODEL_ID, max_queue=4, request_timeout=30, max_tokens_limit=8))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=sh.HANG_GUARD_S) as client:
        yield client


def _send(http: httpx.Client, path: str, body: dict) -> tuple[int, str]:
    """The status and the whole answer (a stream read to its end)."""
    raw = json.dumps(body, allow_nan=True)  # NaN and Infinity as Python's json writes them
    with http.stream("POST", path, content=raw, headers={"Content-Type": "application/json"}) as response:
        return response.status_code, response.read().decode("utf-8", "replace")


def _check(status: int, text: str, body: dict) -> None:
    """A 200 with no error event, or a 4xx in OpenAI's error shape; never a 5xx, and never a 429
    (the requests go one at a time, so the server is idle: a retry would meet the same answer)."""
    assert status < 500 and status != 429, (status, body, text[:500])
    if status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)
    else:
        assert status == 200, (status, body)
        assert '"server_error"' not in text, (body, text[:500])  # no error event inside a stream


def _placements(path: str):
    """(where, body) for every field of the endpoint's schema (and each nested one) holding every
    edge value in turn, and each field left out."""
    for field in FIELDS[path]:
        for value in EDGE_VALUES:
            yield f"{field}={value!r:.40}", {**BASE[path], field: value}
        yield f"no {field}", {key: value for key, value in BASE[path].items() if key != field}
    nested = [("stream_options", lambda value, field: {"stream_options": {field: value}}, STREAM_OPTION_FIELDS)]
    if "messages" in BASE[path]:
        nested.append(("messages[0]", lambda value, field: {"messages": [{**BASE[path]["messages"][0], field: value}]},
                       MESSAGE_FIELDS))
    for name, place, fields in nested:
        for field in fields:
            for value in EDGE_VALUES:
                yield f"{name}.{field}={value!r:.40}", {**BASE[path], **place(value, field)}


@pytest.mark.parametrize("path", sorted(BASE))
def test_every_field_at_every_edge_gets_a_4xx_or_a_200(http, path):
    """The exhaustive walk: each field of the schema, one at a time, through every edge value."""
    failures = []
    for where, body in _placements(path):
        status, text = _send(http, path, body)
        try:
            _check(status, text, body)
        except (AssertionError, ValueError, KeyError) as error:
            failures.append(f"{where}: {status} {str(error)[:200]}")
    assert not failures, "\n".join(failures[:20])
    _assert_still_serving(http)


def _assert_still_serving(http: httpx.Client) -> None:
    """After the walk (in the same test, so on the same server whatever the test order): a normal
    request of each endpoint is served, and nothing is left waiting or running."""
    for path, body in BASE.items():
        status, text = _send(http, path, body)
        assert status == 200, text
    health = http.get("/health").json()
    assert health["queue_length"] == 0 and health["running"] == 0, health


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies())
def test_any_values_in_up_to_three_fields_get_a_4xx_or_a_200(http, case):
    """Random combinations of up to three changed fields, with values of every JSON type."""
    path, body = case
    status, text = _send(http, path, body)
    _check(status, text, body)

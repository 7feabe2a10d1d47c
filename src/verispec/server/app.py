"""The OpenAI-compatible HTTP app: routes, validation and response shapes.

Owns the FastAPI app (`create_app(target, settings)`: thin routes over a `Serving`, which holds
the target, the settings, the worker and the metrics and takes each request through its checks,
prompt encoding, the library request, its jobs and the answer), the endpoints

  GET  /v1/models, /v1/models/{id}   the one served model
  POST /v1/completions               text completion (`text_completion`)
  POST /v1/chat/completions          chat, with the tokenizer's chat template or the plain
                                     "Role: content" fallback for base models (text.encode_messages)
  GET  /health                       liveness and queue state (never needs the API key)
  GET  /metrics                      Prometheus text format

the OpenAI error shape `{"error": {"message", "type", "param", "code"}}` for every failure
(400 invalid request, 401 API key, 404 unknown model or route, 408 a body not sent in time, 413 a
body too large, 429 queue full with a Retry-After estimated from the queue, 503 shutting down or
timed out while waiting, 500 internal), optional Bearer-key authentication, and server-sent
events for `stream: true`. Every completion carries
the request's speculation metrics in the extension field `verispec` (in a stream: the final
chunk before `data: [DONE]`).

What one request may cost before it is validated: its body is read by `_BodyLimit` before
anything else sees it, up to `max_body_bytes` (a 413 as soon as the Content-Length or the bytes
received pass it) and within `body_timeout` seconds (408); a prompt of more than
`max_prompt_chars` characters is refused before it is tokenized. The bounds on connections and
on the time to send headers are the protocol's (`connections`).

No exception leaves the app (`_ErrorGuard`): an unexpected one is logged and answered with a
complete 500 in the error shape, so the connection stays usable (the server would otherwise close
it without a word after the answer); in a stream that has begun, it becomes a final error event
followed by `data: [DONE]`. Error bodies are always valid UTF-8 JSON, whatever text they quote.

Does not own generation: a validated request is handed to `worker.Worker`, whose single thread
owns the Target and decodes every admitted request together in a continuous batch (a request's
output is the one it gives alone). The event loop never runs the model; prompt encoding runs in
the thread pool. A handler waits for its jobs' events and polls `request.is_disconnected()`
between them: a client that goes away cancels its jobs (a waiting job leaves the queue, a
running one leaves the batch at the next step). A request with `n` > 1 is n jobs (choice i
samples with seed + i when a seed is given), whose prompt blocks are shared; `logprobs` are the
target's own log-probabilities of the committed tokens, from the rows that chose them.
A request that could never fit the KV memory (its prompt and max_tokens, in the batch engine's
own reckoning) is refused (400, "kv_memory_exceeded"); any other waits for room. A request that
names no max_tokens gets what the context and the KV memory leave, up to the server's limit.

Timeout (`request_timeout`, counted from arrival, queue wait included): a request that times
out while still waiting gets 503 (code "timeout"); one that is generating stops at its next step
and ends normally with the text so far and finish_reason "length" (`verispec.stop_reason` is
"timeout"), in a stream as the final chunk followed by [DONE].
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..core.batch import DEFAULT_MAX_ROWS
from ..errors import ConfigError, UnknownMethodError, VerispecError
from ..request.grammar import compile_format
from ..request.lifecycle import Request as GenerationRequest
from ..core.methods import TREE_MAX_NODES, MethodOptions, check_settings, method_request
from ..target.model import Target
from ..core.sampling import MAX_SEED, SamplingConfig
from ..request.text import encode_messages, encode_prompt
from . import tools
from .connections import DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS
from .metrics import ServerMetrics
from .schemas import ChatCompletionRequest, CompletionRequest
from .worker import (DEFAULT_MAX_SEQUENCES, DONE, QUEUED, Delta, Event, Failed, Finished, Ticket, QueueFull, QueueTimeout,
                     Started, Worker, WorkerStopped)


log = logging.getLogger("verispec.server")

DEFAULT_MODEL_ID = "verispec-default"
# What one request's method settings may ask for: a verify of the draft and the committed token
# within one call of the C layers, draft forwards of at most this many beams, and a suffix cache
# no larger than the default one.
MAX_DRAFT_LENGTH = TREE_MAX_NODES
MAX_BEAMS = 16
MAX_CACHED_REQUESTS = MethodOptions.max_cached_requests  # suffix's earlier outputs kept (its default), per store
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
_POLL_S = 0.1  # how often a waiting handler checks for a disconnect and its deadline
_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "length", "cancelled": "length"}
DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # a context of ids as JSON, or about a million characters of text
DEFAULT_MAX_PROMPT_CHARS = 1_000_000  # about 0.7 s of tokenizing for the default model's tokenizer
DEFAULT_BODY_TIMEOUT = 60.0  # seconds: a 4 MiB body at 70 kB/s


def default_model_id(model: str | None) -> str:
    """The id a server advertises for `model`: "verispec-default" for the embedded model,
    otherwise the basename of the path or hub id."""
    if model is None:
        return DEFAULT_MODEL_ID
    return Path(model.rstrip("/")).name or DEFAULT_MODEL_ID


@dataclass(frozen=True)
class ServerSettings:
    """What `verispec serve` configures, validated on construction (before any model loads).

    request_timeout: seconds from a request's arrival (queue wait included) after which it ends;
    None or 0 for no limit. max_tokens_limit: the largest max_tokens a request may ask for, and
    the budget of a request that does not say (capped by the room left in the context).
    max_sequences: requests decoding together in the running batch (each choice of a request
    with n > 1 is one); max_rows: rows of one step's forward (verify rows, then prompt chunks).
    draft_model: the draft model of sps and mtad requests (a path; the server's own, not a
    request's: None means their default, the EESD exit head); exit_head: the exit head of eesd
    (and of sps and mtad without a draft model) (None: the target's own, shipped or trained once).
    What one request or connection may cost: max_body_bytes (a larger body is a 413),
    max_prompt_chars (characters of a prompt, or of the messages' roles, names and contents,
    checked before tokenizing), body_timeout (seconds to send the body once the headers are in;
    408), max_connections (open at once) and header_timeout (seconds to send a request's headers);
    a timeout of None or 0 is none.
    """

    model_id: str = DEFAULT_MODEL_ID
    default_method: str = "anpd"
    api_key: str | None = None
    max_queue: int = 64
    request_timeout: float | None = 300.0
    max_tokens_limit: int = 1024
    max_sequences: int = DEFAULT_MAX_SEQUENCES  # requests decoding together
    max_rows: int = DEFAULT_MAX_ROWS  # rows of one step's forward
    draft_model: str | None = None
    exit_head: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise ConfigError("the model id must be a non-empty string")
        served_method(self.default_method)
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key must not be empty (omit it to serve without one)")
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ConfigError(f"max_queue must be an integer >= 1, got {self.max_queue!r}")
        if self.request_timeout is not None and (
            not isinstance(self.request_timeout, (int, float)) or not self.request_timeout >= 0
        ):
            raise ConfigError(f"request_timeout must be >= 0 seconds (0 = no limit), got {self.request_timeout!r}")
        if not isinstance(self.max_tokens_limit, int) or self.max_tokens_limit < 1:
            raise ConfigError(f"max_tokens_limit must be an integer >= 1, got {self.max_tokens_limit!r}")
        if not isinstance(self.max_sequences, int) or not 1 <= self.max_sequences <= 256:
            raise ConfigError(f"max_sequences must be an integer from 1 to 256, got {self.max_sequences!r}")
        if not isinstance(self.max_rows, int) or not 16 <= self.max_rows <= 4096:
            raise ConfigError(f"max_rows must be an integer from 16 to 4096, got {self.max_rows!r}")
        for name in ("max_body_bytes", "max_prompt_chars", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("body_timeout", "header_timeout"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < math.inf):
                raise ConfigError(f"{name} must be a number of seconds >= 0 (0 = no limit), got {value!r}")

    @property
    def timeout(self) -> float | None:
        return self.request_timeout or None


# -- errors ------------------------------------------------------------------------------------

def _printable(text: str) -> str:
    """`text` with lone surrogates (which UTF-8 cannot encode) written as \\udXXX escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _json_text(payload) -> str:
    """JSON for a response body or event: UTF-8 characters as they are, but any lone surrogate in
    quoted input as a JSON escape (json.dumps would otherwise yield text that UTF-8 cannot encode)."""
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(payload, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text


class _JSON(JSONResponse):
    def render(self, content) -> bytes:
        return _json_text(content).encode("utf-8")


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return _JSON(self.body(), status_code=self.status, headers=self.headers)


def _internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal server error: {type(exc).__name__}", "server_error", code="internal_error")


def served_method(spec: str) -> tuple[str, MethodOptions]:
    """A request's (or the server's default) method with its settings, `methods.method_request`'s
    syntax within the server's bounds (MAX_DRAFT_LENGTH, MAX_BEAMS, MAX_CACHED_REQUESTS): (name, options)."""
    return method_request(spec, MAX_DRAFT_LENGTH, MAX_BEAMS, MAX_CACHED_REQUESTS)


def _invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _field_path(loc) -> list[str]:
    """A pydantic error location without "body" and without the union-member tags pydantic adds
    ("str", "list[int]", "TextPart"...): ("body", "prompt", "list[int]", 2) -> ["prompt", "2"]."""
    path = []
    for part in loc:
        if part == "body":
            continue
        text = str(part)
        if isinstance(part, str) and ("[" in text or text in {"str", "int", "float", "bool", "dict", "none"}
                                      or text[:1].isupper()):
            continue
        path.append(text)
    return path


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI/pydantic's list of errors -> one 400 naming the first offending parameter (the
    first range or text error if there is one: a value that fails one member of a union such as
    `prompt` by its content also fails the others by its type, and the content is the news)."""
    errors = exc.errors()
    if not errors:
        return _invalid("invalid request body")
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    kind = first.get("type", "")
    loc = _field_path(first.get("loc", ()))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return _invalid(f"malformed JSON in the request body: {detail}".rstrip(": "), code="invalid_json")
    if not loc:
        if kind == "missing":
            return _invalid("the request body is missing: send a JSON object", code="invalid_json")
        return _invalid("the request body must be a JSON object (Content-Type: application/json)",
                        code="invalid_json")
    param = loc[0]
    where = ".".join(loc)
    if kind == "missing":
        return _invalid(f"missing required parameter: '{where}'", param=param, code="missing_required_parameter")
    others = {path[0] for e in errors if (path := _field_path(e.get("loc", ())))} - {param}
    more = f" (and {len(others)} more invalid field{'s' if len(others) > 1 else ''})" if others else ""
    if kind == "value_error":  # a range or text check of schemas.py: its message names the range
        detail = str((first.get("ctx") or {}).get("error", first.get("msg", "is invalid")))
        return _invalid(f"'{where}' {detail}{more}", param=param)
    return _invalid(f"invalid value for '{where}': {first.get('msg', 'invalid')}{more}", param=param,
                    code="invalid_type")


def _body_parse_error(cause: BaseException | None) -> APIError:
    """FastAPI's 400 "There was an error parsing the body", with the reason."""
    if isinstance(cause, UnicodeDecodeError):
        return _invalid(f"the request body is not valid UTF-8: byte 0x{cause.object[cause.start]:02x} at "
                        f"offset {cause.start}", code="invalid_json")
    if isinstance(cause, RecursionError):
        return _invalid("the request body's JSON is nested too deeply", code="invalid_json")
    reason = f": {str(cause).split(';')[0]}" if isinstance(cause, ValueError) else ""  # no "use sys.set_..." hint
    return _invalid(f"the request body could not be read as JSON{reason}", code="invalid_json")


# -- ASGI middlewares (pure ASGI: they must not buffer or break streaming responses) -----------

def _endpoint_label(path: str) -> str:
    known = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics"}
    if path in known:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"  # unknown routes share one label: no unbounded label values


class _MetricsMiddleware:
    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.request(_endpoint_label(scope["path"]), status, time.perf_counter() - started)


class _ErrorGuard:
    """The outermost layer: an exception that escaped every handler is logged and answered with
    a complete 500 (or, when a complete answer already went out, only logged), so that it never
    reaches the server, which would drop the connection without a `Connection: close`. Only a
    response cut off halfway is left to the server to end by closing the connection."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = complete = False

        async def tracking_send(message):
            nonlocal started, complete
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            return  # the client left while its body was being read: nobody to answer
        except Exception as exc:
            where = f"{scope.get('method', '')} {_printable(scope.get('path', ''))}"
            log.error("unexpected error answering %s", where, exc_info=exc)
            if started and not complete:
                raise
            if not started:
                await _internal_error(exc).response()(scope, receive, send)


class _BodyLimit:
    """Reads a request's body before anything else sees it: at most `max_bytes` (413 at once for a
    larger Content-Length, else as soon as the bytes received pass it, chunked bodies included)
    within `timeout` seconds of the headers (408; None: no limit). Either answer closes the
    connection, whose unread rest is never read. The app then reads the body from memory (it
    never streams one) and still hears of a disconnect."""

    def __init__(self, app, max_bytes: int, timeout: float | None):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; this server takes at most {self.max_bytes} "
                        f"(--max-body)", code="request_too_large", headers={"Connection": "close"})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lengths = [value for name, value in scope["headers"] if name == b"content-length"]
        chunked = any(name == b"transfer-encoding" for name, _ in scope["headers"])
        if not chunked and (not lengths or lengths[0].strip() in (b"0", b"")):
            return await self.app(scope, receive, send)  # no body (the server checked Content-Length's form)
        if lengths and lengths[0].strip().isdigit() and int(lengths[0]) > self.max_bytes:
            return await self._too_large(f"{int(lengths[0])}").response()(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = None if not self.timeout else loop.time() + self.timeout
        chunks, size, more = [], 0, True
        while more:
            try:
                if deadline is None:
                    message = await receive()
                else:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                error = APIError(408, f"the request body did not arrive within {self.timeout:g} s (--body-timeout)",
                                 code="body_timeout", headers={"Connection": "close"})
                return await error.response()(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client went away: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(f"more than {self.max_bytes}").response()(scope, receive, send)
            chunks.append(chunk)
            more = message.get("more_body", False)
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # a disconnect, while the request runs

        await self.app(scope, replay, send)


class _AuthMiddleware:
    """Requires `Authorization: Bearer KEY`, exactly once, on every path except OPEN_PATHS."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = [value for name, value in scope["headers"] if name == b"authorization"]
        header = headers[0] if len(headers) == 1 else b""
        scheme, _, token = header.partition(b" ")
        if len(headers) > 1:  # which one would count is no choice to make for the client
            error = APIError(401, f"{len(headers)} Authorization headers: send exactly one", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
        elif not header:
            error = APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        elif scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            error = APIError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        else:
            return await self.app(scope, receive, send)
        await error.response()(scope, receive, send)


class _JobStreamingResponse(StreamingResponse):
    """A stream that cancels its job however it ends (finished, client gone, server stopping)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# -- the app -------------------------------------------------------------------------------------

def create_app(target: Target, settings: ServerSettings | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `target`: thin routes over one `Serving`. Its worker
    thread (the only user of `target`) starts and stops with the app's lifespan."""
    serving = Serving(target, settings or ServerSettings())
    worker, metrics = serving.worker, serving.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await run_in_threadpool(worker.stop)

    app = FastAPI(title="verispec", version="0.1.0", lifespan=lifespan,
                  summary="OpenAI-compatible server for verispec (speculative decoding on CPU)")
    app.state.serving = serving
    app.state.worker, app.state.metrics, app.state.settings, app.state.target = worker, metrics, serving.settings, target
    if serving.settings.api_key:
        app.add_middleware(_AuthMiddleware, api_key=serving.settings.api_key)
    app.add_middleware(_BodyLimit, max_bytes=serving.settings.max_body_bytes,
                       timeout=serving.settings.body_timeout or None)  # before the key is read
    app.add_middleware(_MetricsMiddleware, metrics=metrics)  # counts 401s, 408s and 413s too
    app.add_middleware(_ErrorGuard)  # added last = outermost: nothing escapes it
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [serving.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        serving.check_model(model_id)
        return serving.model_card()

    @app.get("/health")
    async def health():
        return serving.health()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat_completions(body, request)

    return app


# -- error handlers --------------------------------------------------------------------------------

async def _api_error(request: Request, exc: APIError):
    return exc.response()


async def _request_invalid(request: Request, exc: RequestValidationError):
    return _validation_error(exc).response()


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        message = f"unknown route: {request.method} {request.url.path}"
    else:
        message = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
        return _body_parse_error(exc.__cause__).response()
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return APIError(exc.status_code, message, kind, code=code, headers=getattr(exc, "headers", None)).response()


async def _internal(request: Request, exc: Exception):
    # Reached only by an error in _ErrorGuard's own answer; Starlette then re-raises it.
    return _internal_error(exc).response()


# -- serving requests ------------------------------------------------------------------------------

class Serving:
    """What the routes answer with: the target, the settings, the worker that owns the target and
    the metrics, and each request's way through them (checks, prompt encoding, the library
    request, its jobs in the worker, the answer: whole, or streamed). One per app."""

    def __init__(self, target: Target, settings: ServerSettings):
        self.target, self.settings = target, settings
        self.pool = pool = target.pool if target.pages_kv else None  # the batch's KV memory (sized before serving)
        self.metrics = ServerMetrics(
            queue_length=lambda: self.worker.queue_length, busy=lambda: float(self.worker.busy),
            running=lambda: self.worker.running,
            kv_blocks=lambda: (pool.used_blocks, pool.blocks) if pool is not None else (0, 0),
            prefix_counts=lambda: (pool.prefix.queried_tokens, pool.prefix.hit_tokens) if pool is not None else (0, 0))
        self.worker = Worker(target, settings.max_queue, observer=self.metrics, max_sequences=settings.max_sequences,
                             max_rows=settings.max_rows)
        self.created = int(time.time())

    # -- info ------------------------------------------------------------------------------------
    def model_card(self) -> dict:
        settings, target = self.settings, self.target
        return {"id": settings.model_id, "object": "model", "created": self.created, "owned_by": "verispec",
                "verispec": {"name": target.name, "max_length": target.max_length, "vocab_size": target.vocab_size,
                             "default_method": settings.default_method}}

    def health(self) -> Response:
        worker, settings = self.worker, self.settings
        alive = worker.alive
        body = {"status": "ok" if alive else "unavailable", "model": settings.model_id,
                "busy": worker.busy, "running": worker.running, "max_sequences": settings.max_sequences,
                "queue_length": worker.queue_length, "max_queue": settings.max_queue}
        return _JSON(body, status_code=200 if alive else 503)

    # -- the generation routes -------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        method = self.check_common(body)
        prompt = body.prompt
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            self.check_prompt_chars(sum(map(len, [prompt] if isinstance(prompt, str) else prompt)), "prompt")
        ids = await self.encode(lambda: self.completion_ids(body), "prompt")
        generation = self.generation_request(body, method, ids, body.max_tokens, "max_tokens", "prompt")
        return await self.respond(request, body, generation, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        method = self.check_common(body)
        if not body.messages:
            raise _invalid("messages must not be empty", param="messages", code="empty_array")
        messages = tools.template_messages(body.messages)
        self.check_prompt_chars(sum(len(m["role"]) + len(m["content"]) + len(n.name or "")
                                    for m, n in zip(messages, body.messages)), "messages")
        response_format = self.check_tools(body)
        ids = await self.encode(lambda: self.encode_chat(body, messages), "messages")
        # off the event loop: the first format on a model builds llguidance's tokenizer (seconds)
        constraint = await run_in_threadpool(self.compile_format, response_format)
        generation = self.generation_request(body, method, ids, body.token_budget(), body.token_budget_param(),
                                             "messages", constraint)
        return await self.respond(request, body, generation, chat=True)

    def check_tools(self, body: ChatCompletionRequest) -> dict | None:
        """The request's output format: its `response_format`, or with `tool_choice` "required"
        or a named function, a call's schema (`tools.call_schema`); a choice that names no tool
        given, or asks for a call and a response_format at once, is a 400."""
        choice = body.tool_choice
        if choice is not None and choice != "none" and not body.tools:
            raise _invalid("tool_choice needs tools", param="tool_choice")
        if not isinstance(choice, str) and choice is not None and \
                choice.function.name not in {tool.function.name for tool in body.tools}:
            raise _invalid(f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        schema = tools.call_schema(body.tools, choice)
        if schema is None:
            return body.response_format
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise _invalid("a tool_choice that requires a call and a response_format cannot go together",
                           param="response_format")
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}

    def encode_chat(self, body: ChatCompletionRequest, messages: list[dict]) -> list[int]:
        """The chat prompt's ids, the tools given to the template (or described, without one)."""
        tokenizer = self.target.tokenizer
        if not tools.active(body.tools, body.tool_choice):
            return encode_messages(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
        if getattr(tokenizer, "chat_template", None):
            return encode_messages(tokenizer, messages, [tool.model_dump(exclude_none=True) for tool in body.tools])
        return encode_messages(tokenizer, tools.plain_messages(messages, body.tools))

    # -- checks and encoding -----------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_id:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.settings.model_id}'",
                           param="model", code="model_not_found")

    def check_common(self, body) -> tuple[str, MethodOptions]:
        """Checks every request makes before its prompt is encoded; returns its method and settings."""
        self.check_model(body.model)
        if getattr(body, "top_logprobs", None) and not body.logprobs:
            raise _invalid("top_logprobs needs logprobs: true", param="top_logprobs")
        problems = body.unsupported()
        if problems:
            param, message = problems[0]
            raise _invalid(message, param=param, code="unsupported_parameter")
        settings = self.settings
        try:  # "" is no method
            name, options = served_method(settings.default_method if body.method is None else body.method)
        except UnknownMethodError as error:
            raise _invalid(str(error), param="method", code="unknown_method") from None
        except ConfigError as error:
            raise _invalid(str(error), param="method") from None
        method = name, dataclasses.replace(options, draft_model=settings.draft_model, exit_head=settings.exit_head)
        for stop in body.stop_strings():
            if not stop:
                raise _invalid("stop strings must be non-empty", param="stop")
        return method

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """A prompt of more characters than the server takes is refused before it is tokenized."""
        limit = self.settings.max_prompt_chars
        if chars > limit:
            raise _invalid(f"the {param} has {chars} characters; this server takes at most {limit} "
                           f"(--max-prompt-chars)", param=param, code="prompt_too_long")

    def completion_ids(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            context = self.target.max_length
            if len(prompt) >= context:  # before looking at each id
                raise _invalid(f"the prompt has {len(prompt)} tokens; the model's context is {context} tokens, "
                               f"which leaves no room to generate", param="prompt", code="context_length_exceeded")
            vocab = self.target.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise _invalid(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt")
            return list(prompt)
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise _invalid("send exactly one prompt per request (batched prompts are not supported)"
                               if prompt else "the prompt is empty", param="prompt")
            prompt = prompt[0]
        return encode_prompt(self.target.tokenizer, prompt, "raw")

    async def encode(self, encode: Callable[[], list[int]], param: str) -> list[int]:
        """Tokenize off the event loop; template and prompt errors become 400."""
        try:
            ids = await run_in_threadpool(encode)
        except APIError:
            raise
        except VerispecError as error:
            raise _invalid(str(error), param=param) from None
        except Exception as error:  # a chat template that refuses the messages (jinja2 raise_exception)
            if type(error).__module__.startswith("jinja2"):
                raise _invalid(f"the chat template refused the messages: {error}", param=param) from None
            raise
        if not ids:
            raise _invalid("the prompt encodes to no tokens", param=param)
        context = self.target.max_length
        if len(ids) >= context:
            raise _invalid(f"the prompt has {len(ids)} tokens; the model's context is {context} tokens, "
                           f"which leaves no room to generate", param=param, code="context_length_exceeded")
        return ids

    def generation_request(self, body, method: tuple[str, MethodOptions], ids: list[int], max_tokens: int | None,
                           budget_param: str, prompt_param: str, constraint=None) -> GenerationRequest:
        """The library request; max_tokens (>= 1 by the schema) is checked against the server's
        limit and the room the prompt leaves in the context. `constraint`: its compiled
        `response_format` (`compile_format`), if any."""
        target, settings, pool = self.target, self.settings, self.pool
        room = target.max_length - len(ids)
        if pool is not None:  # nor more than the KV memory holds
            room = min(room, pool.blocks * pool.block - len(ids))
        if max_tokens is None:
            max_tokens = min(settings.max_tokens_limit, room)
            if max_tokens < 1:
                raise _invalid(f"the {prompt_param} ({len(ids)} tokens) leaves no room to generate in this server's KV "
                               f"memory ({pool.blocks} blocks of {pool.block} positions)", param=prompt_param,
                               code="kv_memory_exceeded")
        elif max_tokens > settings.max_tokens_limit:
            raise _invalid(f"{budget_param} ({max_tokens}) exceeds this server's limit of "
                           f"{settings.max_tokens_limit}", param=budget_param)
        elif max_tokens > target.max_length - len(ids):
            raise _invalid(
                f"this model's context is {target.max_length} tokens, but {len(ids) + max_tokens} were requested "
                f"({len(ids)} in the {prompt_param}, {max_tokens} for the completion); lower {budget_param}",
                param=budget_param, code="context_length_exceeded")
        engine = self.worker.engine
        refusal = engine.refusal(len(ids), max_tokens)  # the batch engine's own check: it could never run
        if refusal is not None:
            alone = engine.refusal(len(ids), 1)  # the prompt with one token to generate
            if alone is not None:  # no max_tokens would do
                raise _invalid(f"the {prompt_param} ({len(ids)} tokens) can never fit this server's KV memory: "
                               f"{alone}; shorten it", param=prompt_param, code="kv_memory_exceeded")
            raise _invalid(f"this request can never fit this server's KV memory: {refusal}; lower {budget_param}",
                           param=budget_param, code="kv_memory_exceeded")
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        top_k = 0 if body.top_k is None else body.top_k
        try:
            sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=body.seed)
        except ConfigError as error:
            param = next((p for p in ("temperature", "top_k", "top_p", "seed") if str(error).startswith(p)), None)
            raise _invalid(str(error), param=param) from None
        name, options = method
        try:
            check_settings(name, options, sampling)
        except ConfigError as error:  # settings that do not go with this request's sampling
            param = "temperature" if str(error).startswith("temperature") else "method"  # greedy for mtad
            raise _invalid(str(error), param=param) from None
        try:
            return GenerationRequest(tuple(ids), name, max_tokens, sampling, body.stop_strings(), options, constraint)
        except ConfigError as error:
            raise _invalid(str(error)) from None

    def compile_format(self, response_format: dict | None):
        """The request's grammar (`request.grammar.Constraint`), None for text; a format that
        does not compile is a 400 naming `response_format` and llguidance's reason."""
        try:
            return compile_format(self.target, response_format)
        except ConfigError as error:
            raise _invalid(str(error), param="response_format", code="invalid_response_format") from None

    # -- running a request's jobs and answering ------------------------------------------------
    def submit(self, body, generation: GenerationRequest) -> tuple[list[Ticket], asyncio.Queue]:
        """The request's n jobs, queued in the worker, and the queue their (choice, event) pairs
        arrive in; a full queue is a 429 (with Retry-After), a stopping worker a 503."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()  # (choice, event)
        timeout = self.settings.timeout
        arrival = time.monotonic()
        jobs = [Ticket(choice, _notifier(loop, events, i), deadline=None if timeout is None else arrival + timeout,
                    created=arrival, logprobs=body.logprobs_wanted())
                for i, choice in enumerate(_choice_requests(generation, body.n or 1))]
        worker = self.worker
        worker.start()  # idempotent; normally started by the lifespan
        try:
            worker.submit_all(jobs)
        except QueueFull as error:
            wait = max(1, math.ceil(worker.estimated_wait()))
            raise APIError(429, f"the server is busy: {error}; retry in about {wait} s", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(wait)}) from None
        except WorkerStopped as error:
            raise APIError(503, str(error), "server_error", code="unavailable") from None
        return jobs, events

    def cancel_all(self, jobs: list[Ticket]) -> None:
        for job in jobs:
            if job.state != DONE:
                self.worker.cancel(job, "cancelled")

    async def respond(self, request: Request, body, generation: GenerationRequest, chat: bool) -> Response:
        """Run the request's jobs and answer: one body once every choice has finished, or (with
        `stream`) server-sent events whose headers go out with the first text, so that a failure
        before any text (a bad request, a fault in the prefill, a timeout in the queue) is still a
        plain error."""
        jobs, events = self.submit(body, generation)
        shape = _Shape(chat, self.settings.model_id, generation, self.target.tokenizer)
        if chat and tools.active(body.tools, body.tool_choice):
            shape.calls = "constrained" if tools.call_schema(body.tools, body.tool_choice) else "free"
            shape.tool_names = frozenset(tool.function.name for tool in body.tools)
        try:
            if not body.stream:
                return await self.complete(request, jobs, events, shape)
            while True:
                first = await self.next_event(request, jobs, events)
                if first is None:
                    return Response(status_code=499)  # the client went away; nobody reads this
                if isinstance(first[1], Failed):
                    raise _failure(first[1])
                if not isinstance(first[1], Started):
                    break
        except BaseException:  # an error answer, or this handler cancelled (server shutdown)
            self.cancel_all(jobs)  # no effect on jobs that have ended
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _JobStreamingResponse(
            self.stream(request, jobs, events, shape, first, include_usage), on_close=lambda: self.cancel_all(jobs),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def complete(self, request: Request, jobs: list[Ticket], events: asyncio.Queue, shape: _Shape) -> Response:
        """The whole answer, once every choice has finished."""
        finished: dict[int, Finished] = {}
        while len(finished) < len(jobs):
            got = await self.next_event(request, jobs, events)
            if got is None:
                return Response(status_code=499)  # the client went away; nobody reads this
            index, event = got
            if isinstance(event, Finished):
                finished[index] = event
            elif isinstance(event, Failed):
                raise _failure(event)
        return _JSON(shape.completion([finished[i] for i in range(len(jobs))]))

    async def stream(self, request: Request, jobs: list[Ticket], events: asyncio.Queue, shape: _Shape,
                     first: tuple[int, Event], include_usage: bool) -> AsyncIterator[str]:
        """The server-sent events of a stream, from its first event with text (or its end)."""
        n = len(jobs)
        finished: dict[int, Finished] = {}
        got: tuple[int, Event] | None = first
        readers = {index: shape.call_reader() for index in range(n)} if shape.calls else {}
        try:
            if shape.chat:
                for index in range(n):
                    yield shape.sse(shape.chunk({"role": "assistant", "content": ""}, index))
            while got is not None:
                index, event = got
                if isinstance(event, Delta):
                    if shape.calls:  # text and calls as the reader finds them
                        for chunk in shape.call_chunks(readers[index].feed(event.text), index, shape.logprobs(event)):
                            yield shape.sse(chunk)
                    else:
                        yield shape.sse(shape.chunk(event.text, index, logprobs=shape.logprobs(event)))
                elif isinstance(event, Finished):
                    finished[index] = event
                    if shape.calls:
                        for chunk in shape.call_chunks(readers[index].finish(), index, None, last=True):
                            yield shape.sse(chunk)
                    yield shape.sse(shape.final_chunk(event, index, bool(shape.calls and readers[index].calls)))
                    if len(finished) == n:
                        if include_usage:
                            yield shape.sse(shape.usage_chunk([finished[i] for i in range(n)]))
                        yield "data: [DONE]\n\n"
                        return
                elif isinstance(event, Failed):
                    yield shape.sse(_failure(event).body())
                    yield "data: [DONE]\n\n"
                    return
                got = await self.next_event(request, jobs, events)
        except Exception as exc:  # the stream has begun: the error can only be its last event
            if not isinstance(exc, APIError):
                log.error("unexpected error in a stream", exc_info=exc)
            yield shape.sse((exc if isinstance(exc, APIError) else _internal_error(exc)).body())
            yield "data: [DONE]\n\n"

    async def next_event(self, request: Request, jobs: list[Ticket], events: asyncio.Queue) -> tuple[int, Event] | None:
        """The next (choice, event) of the request's jobs, consecutive text of one choice merged
        when the client reads slower than it is generated; None once the client has disconnected
        (the jobs are then cancelled). Jobs still waiting when their deadline passes leave the
        queue with a 503."""
        worker = self.worker
        while True:
            try:
                got = await asyncio.wait_for(events.get(), _POLL_S)
                return _merged(got, events)
            except asyncio.TimeoutError:
                pass
            if await request.is_disconnected():
                for job in jobs:
                    worker.cancel(job, "cancelled")
                return None
            queued = [job for job in jobs if job.state == QUEUED]
            if queued and queued[0].deadline is not None and time.monotonic() >= queued[0].deadline:
                if all(worker.cancel(job, "timeout") for job in queued):
                    for job in jobs:
                        worker.cancel(job, "cancelled")
                    raise APIError(503, f"the request timed out after {self.settings.timeout:g} s waiting in the "
                                   f"queue", "server_error", code="timeout")


def _notifier(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int) -> Callable[[Event], None]:
    """A job's `notify` (called on the worker thread): its events into `events` as (index, event)."""
    return lambda event: loop.call_soon_threadsafe(events.put_nowait, (index, event))


def _choice_requests(generation: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The requests of n choices: the same prompt and settings; with a seed, choice i samples
    with seed + i (so each choice equals a request sent alone with that seed)."""
    if n == 1 or generation.sampling.seed is None:
        return [generation] * n
    return [dataclasses.replace(generation, sampling=dataclasses.replace(
        generation.sampling, seed=(generation.sampling.seed + i) % (MAX_SEED + 1))) for i in range(n)]


def _merged(got: tuple[int, Event], events: asyncio.Queue) -> tuple[int, Event]:
    """`got`, with the Deltas of the same choice queued right after it folded in (a reader that
    falls behind gets fewer, longer chunks; nothing queues without bound)."""
    index, event = got
    while isinstance(event, Delta) and not events.empty():
        following = events._queue[0]  # noqa: SLF001 - peek: asyncio.Queue has no public peek
        if following[0] != index or not isinstance(following[1], Delta):
            break
        nxt = events.get_nowait()[1]
        event = Delta(event.text + nxt.text, event.token_ids + nxt.token_ids, event.logprobs + nxt.logprobs)
    return index, event


def _failure(event: Failed) -> APIError:
    if event.user_error:
        return _invalid(str(event.error))
    if isinstance(event.error, WorkerStopped):
        return APIError(503, str(event.error), "server_error", code="unavailable")
    if isinstance(event.error, QueueTimeout):
        return APIError(503, str(event.error), "server_error", code="timeout")
    return APIError(500, f"generation failed: {type(event.error).__name__}: {event.error}", "server_error",
                    code="internal_error")


class _Shape:
    """OpenAI's response and chunk shapes for one request (its n choices)."""

    def __init__(self, chat: bool, model_id: str, generation: GenerationRequest, tokenizer=None):
        self.chat, self.model, self.generation, self.tokenizer = chat, model_id, generation, tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.calls = ""  # "free" or "constrained" where the output may hold tool calls (`tools`)
        self.tool_names: frozenset[str] = frozenset()  # the request's tools (a fenced block may call them)
        self.created = int(time.time())
        self._offsets: dict[int, int] = {}  # completions' text_offset so far, per choice (streams)
        self._held_logprobs: dict[int, dict] = {}  # a stream's log-probabilities not yet sent, per choice

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def _usage(self, events: list[Finished]) -> dict:
        prompt = len(self.generation.prompt_ids)
        completion = sum(len(event.result.token_ids) for event in events)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def extension(event: Finished) -> dict:
        stats = event.result.stats.to_dict()
        stats.update(stop_reason=event.reason, queue_s=round(event.queue_s, 4))
        return stats

    def _extensions(self, events: list[Finished]) -> dict:
        """The speculation metrics: the first choice's, and with n > 1 every choice's too."""
        extension = self.extension(events[0])
        if len(events) > 1:
            extension["choices"] = [self.extension(event) for event in events]
        return extension

    # -- log-probabilities -------------------------------------------------------------------
    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def logprobs(self, event: Delta | Finished, index: int = 0) -> dict | None:
        """OpenAI's logprobs object for the tokens of `event` (None when none were asked for)."""
        if isinstance(event, Finished):
            tokens, entries = event.result.token_ids, event.logprobs
        else:
            tokens, entries = event.token_ids, event.logprobs
        if not entries:
            return None
        tokens = tokens[: len(entries)]
        if self.chat:
            def item(token: int, logprob: float) -> dict:
                piece = self._piece(token)
                return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}
            return {"content": [{**item(token, logprob), "top_logprobs": [item(i, lp) for i, lp in tops]}
                                for token, (logprob, tops) in zip(tokens, entries)]}
        pieces = [self._piece(token) for token in tokens]
        offset = self._offsets.get(index, 0)
        offsets = []
        for piece in pieces:
            offsets.append(offset)
            offset += len(piece)
        if isinstance(event, Delta):
            self._offsets[index] = offset
        return {"tokens": pieces, "token_logprobs": [logprob for logprob, _ in entries],
                "top_logprobs": [{self._piece(i): lp for i, lp in tops} for _, tops in entries]
                if any(tops for _, tops in entries) else None,
                "text_offset": offsets}

    # -- bodies and chunks ---------------------------------------------------------------------
    def completion(self, events: list[Finished]) -> dict:
        choices = []
        for index, event in enumerate(events):
            if self.chat:
                message = self.message(event)
                choices.append({"index": index, "message": message, "logprobs": self.logprobs(event),
                                "finish_reason": self.finish_reason(event, bool(message.get("tool_calls")))})
            else:
                choices.append({"index": index, "text": event.text, "logprobs": self.logprobs(event),
                                "finish_reason": self.finish_reason(event)})
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": choices, "usage": self._usage(events), "verispec": self._extensions(events)}

    def chunk(self, delta: str | dict, index: int = 0, finish: str | None = None, logprobs: dict | None = None) -> dict:
        if self.chat:
            content = delta if isinstance(delta, dict) else {"content": delta}
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta if isinstance(delta, str) else "", "logprobs": logprobs,
                  "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def message(self, event: Finished) -> dict:
        """A chat choice's message: its text, or with tools its calls (`tools.parse_calls`) and
        the text outside them."""
        if not self.calls:
            return {"role": "assistant", "content": event.text}
        content, calls = tools.parse_calls(event.text, self.calls == "constrained", self.tool_names)
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}

    def call_reader(self) -> tools.CallReader:
        """A reader of one choice's calls as it is streamed."""
        return tools.CallReader(self.calls == "constrained", self.tool_names)

    def call_chunks(self, deltas: list[dict], index: int, logprobs: dict | None, last: bool = False) -> list[dict]:
        """A stream's chunks for what a `tools.CallReader` said of a choice's new text; its
        log-probabilities go with the next chunk that says something (with `last`, now)."""
        held = self._held_logprobs.pop(index, None)
        if held is not None and logprobs is not None:
            logprobs = {"content": held["content"] + logprobs["content"]}
        else:
            logprobs = held if logprobs is None else logprobs
        if not deltas and logprobs is not None and not last:
            self._held_logprobs[index] = logprobs
            return []
        if not deltas and logprobs is not None:
            deltas = [{}]
        return [self.chunk(delta, index, logprobs=logprobs if i == 0 else None) for i, delta in enumerate(deltas)]

    def finish_reason(self, event: Finished, made_calls: bool = False) -> str:
        """OpenAI's finish_reason of a choice; "tool_calls" where it stopped after making calls
        (`made_calls`: what its message or its stream's `tools.CallReader` found)."""
        finish = _FINISH_REASONS.get(event.reason, "length")
        return "tool_calls" if finish == "stop" and made_calls else finish

    def final_chunk(self, event: Finished, index: int, made_calls: bool = False) -> dict:
        """A choice's chunk with its finish_reason, its usage and metrics."""
        last = self.chunk({} if self.chat else "", index, self.finish_reason(event, made_calls))
        last.update(usage=self._usage([event]), verispec=self.extension(event))
        return last

    def usage_chunk(self, events: list[Finished]) -> dict:
        """OpenAI's usage-only chunk (empty choices) at the end of a stream with include_usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self._usage(events), "verispec": self._extensions(events)}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {_json_text(payload)}\n\n"

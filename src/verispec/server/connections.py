"""What a connection may cost `verispec serve` before it is a request: how many are open at once,
and how long a client may take to send a request's headers.

Owns the uvicorn configuration of the server (`uvicorn_config`, used by `verispec serve` and the
tests alike) and its HTTP protocol: uvicorn's h11 protocol with two bounds added (uvicorn's own
`limit_concurrency` answers a plain-text 503 to every request while that many connections are
open, idle ones included, and nothing bounds the time before a request's headers are complete):

- `max_connections`: a connection accepted while that many are open is answered at once with a
  503 in OpenAI's error shape (`code: "too_many_connections"`, `Retry-After`) and closed; the
  open ones are untouched.
- `header_timeout`: a connection that has not sent a complete request line and headers within
  that many seconds of opening (or, kept alive, of its last answer) is closed: with a 408 in
  OpenAI's shape if it sent part of them, silently if it sent nothing. An idle kept-alive
  connection is closed earlier by uvicorn's `timeout_keep_alive` (5 s).

The size of the headers is h11's bound (16 KiB: a larger request line and headers get uvicorn's
400). The body's size and read time are bounded once the headers are in, by the app
(`app._BodyLimit`). Nothing here reads the API key or the body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import ConfigError

log = logging.getLogger("verispec.server")

DEFAULT_MAX_CONNECTIONS = 1000
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds
FILE_DESCRIPTOR_MARGIN = 64  # for the process's own files besides its connections


def raw_error(status: int, reason: str, message: str, code: str, extra_headers: str = "") -> bytes:
    """A complete HTTP/1.1 error answer in OpenAI's shape that closes the connection, written
    straight to a transport (where no request was parsed, so h11 cannot send one)."""
    body = json.dumps({"error": {"message": message, "type": "server_error" if status >= 500 else
                                 "invalid_request_error", "param": None, "code": code}}, separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra_headers}\r\n")
    return head.encode("ascii") + body


def protocol_class(max_connections: int, header_timeout: float | None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the module's two bounds (header_timeout None or 0: none)."""
    refusal = raw_error(503, "Service Unavailable", f"the server has {max_connections} connections open, its limit "
                        f"(--max-connections); retry shortly", "too_many_connections", "retry-after: 1\r\n")
    late = raw_error(408, "Request Timeout", f"the request's headers did not arrive within {header_timeout or 0:g} s "
                     f"(--header-timeout)", "header_timeout")

    class BoundedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _armed_for: object = None  # the request cycle the timer was armed after (None: the first)
        _partial = False  # bytes of the awaited request's headers have arrived

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refused a connection: %d open (--max-connections)", max_connections)
                transport.write(refusal)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._timer is not None:
                if self.cycle is not self._armed_for:  # a request's headers are complete
                    self._disarm()
                else:
                    self._partial = True

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()  # arms uvicorn's keep-alive timer; may start a pipelined request
            if not self.transport.is_closing() and self.cycle is cycle:
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if header_timeout:
                self._armed_for, self._partial = self.cycle, False
                self._timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                if self._partial:
                    self.transport.write(late)
                self.transport.close()

    return BoundedH11Protocol


def ensure_file_limit(max_connections: int) -> None:
    """Raise this process's soft limit on open files to hold `max_connections` connections (one
    file descriptor each) and FILE_DESCRIPTOR_MARGIN more, up to the hard limit; a ConfigError if
    the hard limit is lower."""
    needed = max_connections + FILE_DESCRIPTOR_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(f"--max-connections {max_connections} needs {needed} open files, but this process may open "
                          f"at most {hard} (ulimit -Hn): lower --max-connections or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def uvicorn_config(app, settings, **kwargs) -> uvicorn.Config:
    """The uvicorn configuration that serves `app` within `settings` (a `ServerSettings`: its
    `max_connections` and `header_timeout`), on the bounded h11 protocol; `kwargs` go to uvicorn
    (log_level, timeout_graceful_shutdown...)."""
    return uvicorn.Config(app, http=protocol_class(settings.max_connections, settings.header_timeout or None),
                          lifespan="on", **kwargs)

"""Slow and excess clients, at the connection level (uvicorn's h11 protocol, subclassed).

uvicorn has no read timeouts: a client that sends its headers one byte at a time, or never
finishes its body, holds its connection for ever (its keep-alive timer restarts on every
byte). Here each request must arrive in full within a deadline: its headers within
`header_timeout` seconds of the connection opening (or of the previous response), then its
body within `body_timeout` more. A client that misses one is disconnected (a 408 if it is
still sending headers; a handler waiting for its body sees the disconnect). Past
`max_connections` open connections, a new one gets a 503 in OpenAI's format and is closed,
before the server reads anything from it.
"""
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.server.errors import error_body


def _raw_response(status: str, body: dict, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode() + data


TOO_MANY = _raw_response("503 Service Unavailable", error_body(
    "too many open connections (--max-connections); retry later", type="server_error", code="too_many_connections"),
    "retry-after: 1\r\n")
HEADER_TIMEOUT = _raw_response("408 Request Timeout", error_body(
    "the request headers did not arrive within --header-timeout", code="request_timeout"))


def guarded_protocol(header_timeout: float, body_timeout: float, max_connections: int) -> type:
    """An H11Protocol class for uvicorn.Config(http=...) with these limits."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._phase = None
            if len(self.connections) > max_connections:
                transport.write(TOO_MANY)
                transport.close()
                return
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc) -> None:
            self._cancel()
            super().connection_lost(exc)

        def _watch(self) -> None:
            """(Re)arm the deadline for what the client is sending now: headers, then the body."""
            state = self.conn.their_state
            phase = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
            if phase == self._phase:
                return
            self._cancel()
            self._phase = phase
            if phase is not None and not self.transport.is_closing():
                timeout = header_timeout if phase == "headers" else body_timeout
                self._deadline = self.loop.call_later(timeout, self._expired, phase)

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, phase: str) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if phase == "headers" and (self.cycle is None or self.cycle.response_complete):
                # an idle keep-alive connection is uvicorn's to close (--timeout-keep-alive); one
                # that started a request and did not finish its headers gets a 408
                if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                    self.transport.write(HEADER_TIMEOUT)
            self.transport.close()

    return GuardedH11Protocol

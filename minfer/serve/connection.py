"""Deadlines on what a client sends over its connection: uvicorn's HTTP/1.1 protocol with read timeouts.

uvicorn bounds only the idle time between two requests (`timeout_keep_alive`). A client that opens a
connection and sends half a header section, or a body shorter than its `Content-Length`, holds the connection
(a socket, a buffer, an asyncio task) for as long as it likes: 300 such connections stayed open for minutes.
`TimedH11Protocol` adds two deadlines, each counted from when the wait starts and never pushed back by a byte
that trickles in (a client sending one byte every few seconds is as stuck as one sending none):

- headers: complete within `header_read_timeout` seconds of the connection's start, or of the first byte of
  the next request on a kept-alive connection;
- body: complete within `body_read_timeout` + 1 seconds of the end of the headers. The app's own deadline
  (`limits.read_body`, `body_read_timeout`) fires first with a 408 in OpenAI's shape; this one is the
  backstop for a body the app never reads (sent with a GET, or after a 401 or 413).

At a deadline the connection is closed. `uvicorn_options` gives `uvicorn.run` this protocol and the other
connection limits of `ServerLimits`.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minfer.serve.limits import ServerLimits

logger = logging.getLogger("minfer.serve")

_BACKSTOP_GRACE_S = 1.0  # the app's 408 goes out before the protocol closes the connection under it


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection whose client is too slow sending headers or body.

    Attributes:
        header_read_timeout: seconds to send a request's header section.
        body_read_timeout: seconds the app waits for a body (the backstop here waits 1 s more).
    """

    header_read_timeout = ServerLimits.header_read_timeout
    body_read_timeout = ServerLimits.body_read_timeout

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_state = None  # the h11 state of the client the deadline was set for

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch(after_response=False)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(after_response=False)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch(after_response=True)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _watch(self, after_response: bool) -> None:
        """Set the deadline for what the client owes now, keep the one already set, or drop it."""
        state = self.conn.their_state
        if state is h11.IDLE and not after_response:
            timeout = self.header_read_timeout
        elif state is h11.SEND_BODY:
            timeout = self.body_read_timeout + _BACKSTOP_GRACE_S
        else:  # a whole request is in, or (idle after a response) uvicorn's keep-alive timer is in charge
            self._disarm()
            return
        if self._deadline_state is not state:
            self._disarm()
            self._deadline = self.loop.call_later(timeout, self._expire, state)
            self._deadline_state = state

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._deadline_state = None, None

    def _expire(self, state) -> None:
        self._deadline, self._deadline_state = None, None
        if self.conn.their_state is state and not self.transport.is_closing():
            what = "headers" if state is h11.IDLE else "body"
            logger.info("closing a connection from %s: its request %s did not arrive in time",
                        "%s:%d" % self.client if self.client else "?", what)
            self.transport.close()


def uvicorn_options(limits: ServerLimits) -> dict:
    """Keyword arguments for `uvicorn.run` / `uvicorn.Config` that enforce the connection limits of `limits`."""
    protocol = type("TimedH11Protocol", (TimedH11Protocol,), {
        "header_read_timeout": limits.header_read_timeout, "body_read_timeout": limits.body_read_timeout})
    return {"http": protocol, "timeout_keep_alive": limits.timeout_keep_alive,
            "h11_max_incomplete_event_size": limits.h11_max_incomplete_event_size}

"""Bounds on connections that send no request: a deadline for the request head, and a cap on those waiting.
uvicorn's h11 closes an idle keep-alive connection only once a response is complete: one that never finishes
its first head (or trickles a byte at a time) is held for ever. `guarded_h11` gives a connection
`HEADER_TIMEOUT_S` from its opening or last response to send a whole head, and lets at most
`MAX_WAITING_CONNECTIONS` wait (a new one closes the oldest). h11 itself refuses a head over 16 KiB."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
"""From a connection's opening (or the end of its last response) to the end of its request head: a browser or a
client on a slow link sends a head in well under a second (nginx allows 60 s, Go servers commonly 10 s)."""
MAX_WAITING_CONNECTIONS = 128
"""Connections waiting for a request head (new, or idle between requests): a browser holds 6 per server, a few
preconnected; far fewer than the 300 half-open sockets an attacker opened, each a file descriptor."""


def guarded_h11(header_timeout_s: float = HEADER_TIMEOUT_S, max_waiting: int = MAX_WAITING_CONNECTIONS) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline and a cap on waiting connections, a class per server."""
    waiting: dict[H11Protocol, None] = {}  # insertion-ordered: the first has waited longest

    class GuardedH11Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._wait_for_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole request head arrived (or the connection ended)
                self._stop_waiting()

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._wait_for_head()  # before the base class reads a pipelined request, which ends the wait at once
            super().on_response_complete()

        def _wait_for_head(self) -> None:
            self._stop_waiting()
            while len(waiting) >= max_waiting:
                oldest = next(iter(waiting))
                logger.debug("closing a connection that sent no request: %d are waiting for one", len(waiting))
                oldest._close_waiting()
            waiting[self] = None
            self._head_deadline = self.loop.call_later(header_timeout_s, self._close_waiting)

        def _stop_waiting(self) -> None:
            waiting.pop(self, None)
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _close_waiting(self) -> None:
            self._stop_waiting()
            if not self.transport.is_closing():
                self.transport.close()  # nothing was asked, nothing is answered: as uvicorn's keep-alive timeout does

    return GuardedH11Protocol

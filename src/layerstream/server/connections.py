"""Bounds on connections that send no request, or send it too slowly: a deadline for the request head, a cap on
connections waiting for one, and a pace for the body. uvicorn's h11 closes an idle keep-alive connection only once
a response is complete: one that never finishes its first head (or trickles a byte at a time) is held for ever,
and so is one whose body trickles (each byte cancels uvicorn's keep-alive timer). `guarded_h11` gives a connection
`HEADER_TIMEOUT_S` from its opening or last response to send a whole head, lets at most
`MAX_WAITING_CONNECTIONS` wait (a new one closes the oldest), and closes one whose body falls behind its
`BodyPace` (`bodies.read_body` answers a 408 first, at the pace itself). h11 itself refuses a head over 16 KiB."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
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


@dataclass(frozen=True)
class BodyPace:
    """How fast a request body must arrive: `timeout_s` from the end of its head, one second more for every
    `min_rate` bytes received (Apache's mod_reqtimeout defaults, ``body=20,MinRate=500``): a 20 MB image needs
    about 500 B/s on average, a stalled or trickling body is cut within 20 s of falling behind."""

    timeout_s: float = 20.0
    min_rate: float = 500.0
    close_grace_s: float = 2.0
    """The connection closes this long after the deadline: where the app reads the body, its 408 goes first."""

    def deadline(self, start: float, received: int) -> float:
        return start + self.timeout_s + received / self.min_rate

    def refusal(self) -> str:
        return f"a body has {self.timeout_s:g} s, and 1 s more for every {self.min_rate:g} bytes received"


BODY_PACE = BodyPace()


def guarded_h11(
    header_timeout_s: float = HEADER_TIMEOUT_S, max_waiting: int = MAX_WAITING_CONNECTIONS, body: BodyPace = BODY_PACE
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a head deadline, a cap on waiting connections and a body pace, a class a server."""
    waiting: dict[H11Protocol, None] = {}  # insertion-ordered: the first has waited longest

    class GuardedH11Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None
        _body_check: asyncio.TimerHandle | None = None
        _body_started = 0.0
        _body_received = 0

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._wait_for_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            self._stop_watching_body()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._body_check is not None:
                self._body_received += len(data)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole request head arrived (or the connection ended)
                self._stop_waiting()
            if self.conn.their_state is not h11.SEND_BODY:
                self._stop_watching_body()
            elif self._body_check is None:  # a head with a body to come: from now on the body's pace holds
                self._body_started, self._body_received = self.loop.time(), 0
                self._body_check = self.loop.call_later(body.timeout_s + body.close_grace_s, self._check_body)

        def _check_body(self) -> None:
            self._body_check = None
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                return
            due = body.deadline(self._body_started, self._body_received) + body.close_grace_s
            if self.loop.time() < due:  # bytes came meanwhile: check again at the deadline they moved
                self._body_check = self.loop.call_later(due - self.loop.time(), self._check_body)
                return
            logger.info(
                "closing a connection whose request body came too slowly: %d bytes in %.1f s (%s)",
                self._body_received, self.loop.time() - self._body_started, body.refusal(),
            )  # fmt: skip
            self.transport.close()

        def _stop_watching_body(self) -> None:
            if self._body_check is not None:
                self._body_check.cancel()
                self._body_check = None

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

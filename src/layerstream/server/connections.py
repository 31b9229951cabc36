"""Bounds on connections that send no request, or send it too slowly. uvicorn's h11 holds for ever a connection
whose first head never ends (or trickles a byte at a time), and one whose body trickles (each byte cancels its
keep-alive timer). `guarded_h11` gives a connection `HEADER_TIMEOUT_S` from its opening or last response to send
a whole head, lets at most `MAX_WAITING_CONNECTIONS` wait (a new one closes the oldest), and closes one whose body
falls behind its `BodyPace` (`bodies.read_body` answers 408 first). h11 itself refuses a head over 16 KiB."""

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
    """How fast a request body must arrive: `timeout_s` from the end of its head, 1 s more for every `min_rate`
    bytes received (Apache's mod_reqtimeout defaults, ``body=20,MinRate=500``)."""

    timeout_s: float = 20.0
    min_rate: float = 500.0
    close_grace_s: float = 2.0
    """The connection closes this long after the deadline: where the app reads the body, its 408 goes first."""

    def deadline(self, start: float, received: int) -> float:
        return start + self.timeout_s + received / self.min_rate


BODY_PACE = BodyPace()


class _BodyWatch:
    """One request body's pace on a connection: closes it once the body is `close_grace_s` behind its deadline."""

    def __init__(self, protocol: H11Protocol, pace: BodyPace):
        self.protocol, self.pace, self.started = protocol, pace, protocol.loop.time()
        self.received = len(getattr(protocol.cycle, "body", b""))  # what came in the head's read: the app counts it
        self.timer = protocol.loop.call_later(pace.timeout_s + pace.close_grace_s, self.check)

    def check(self) -> None:
        protocol, now = self.protocol, self.protocol.loop.time()
        if protocol.conn.their_state is not h11.SEND_BODY or protocol.transport.is_closing():
            return
        due = self.pace.deadline(self.started, self.received) + self.pace.close_grace_s
        if now < due:  # bytes came meanwhile: check again at the deadline they moved
            self.timer = protocol.loop.call_later(due - now, self.check)
            return
        logger.debug("a request body too slow: closing after %d bytes in %.1f s", self.received, now - self.started)
        protocol.transport.close()


def guarded_h11(
    header_timeout_s: float = HEADER_TIMEOUT_S, max_waiting: int = MAX_WAITING_CONNECTIONS, body: BodyPace = BODY_PACE
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a head deadline, a cap on waiting connections and a body pace; a class per server."""
    waiting: dict[H11Protocol, None] = {}  # insertion-ordered: the first has waited longest

    class GuardedH11Protocol(H11Protocol):
        _head_deadline: asyncio.TimerHandle | None = None
        _body: _BodyWatch | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._wait_for_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            self._watch_body(sending=False)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._body is not None:
                self._body.received += len(data)
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # a whole request head arrived (or the connection ended)
                self._stop_waiting()
            self._watch_body(sending=self.conn.their_state is h11.SEND_BODY)
            if self.conn.states == {h11.CLIENT: h11.IDLE, h11.SERVER: h11.IDLE} and self not in waiting:
                if not self.transport.is_closing():  # a body the route left unread ended after its answer
                    self._wait_for_head()

        def _watch_body(self, *, sending: bool) -> None:
            if sending and self._body is None:  # a head with a body to come: from now on the body's pace holds
                self._body = _BodyWatch(self, body)
            elif not sending and self._body is not None:
                self._body.timer.cancel()
                self._body = None

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

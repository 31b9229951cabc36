"""Connections that never send a whole request head are closed (`layerstream.server.connections`): the oldest at
once past the cap on waiting ones, every one by the head deadline, while complete requests are answered; a body
that falls behind its pace gets a 408 where the app reads it, and its connection is closed either way. Here on
uvicorn in this process with small figures (tiny apps, no model); `test_access_server` holds the defaults on
`layerstream serve`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from starlette.requests import Request

from layerstream.server.bodies import read_body
from layerstream.server.connections import BodyPace, guarded_h11
from layerstream.server.errors import ApiError
from serve_harness import closed_by_server, wait_until

HEAD_TIMEOUT_S = 0.5
MAX_WAITING = 20
PACE = BodyPace(timeout_s=0.5, min_rate=2000, close_grace_s=0.3)


async def _hello(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def _body_length(scope, receive, send):
    """The length of the body `read_body` reads at `PACE`, or its refusal."""
    try:
        status, text = 200, str(len(await read_body(Request(scope, receive), 10**6, pace=PACE)))
    except ApiError as e:
        status, text = e.status, e.message
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": text.encode()})


def _serve(head_timeout_s: float, app=_hello):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=guarded_h11(head_timeout_s, MAX_WAITING, PACE), lifespan="off", log_config=None)
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: instance.started, what="uvicorn started")
    try:
        yield "http://127.0.0.1:%d" % sock.getsockname()[1]
    finally:
        instance.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server():
    yield from _serve(HEAD_TIMEOUT_S)


@pytest.fixture(scope="module")
def reading_server():
    yield from _serve(HEAD_TIMEOUT_S, _body_length)


@pytest.fixture(scope="module")
def patient_server():
    """A deadline no test waits for: what closes a connection here is the cap."""
    yield from _serve(600.0)


def _half_open(url: str, count: int, sent: bytes) -> list[socket.socket]:
    port = int(url.rsplit(":", 1)[1])
    sockets = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        if sent:
            s.sendall(sent)
        sockets.append(s)
    return sockets


def test_past_the_cap_the_oldest_waiting_connections_close_at_once(patient_server):
    partial = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a head that never ends
    sockets = _half_open(patient_server, MAX_WAITING, b"") + _half_open(patient_server, MAX_WAITING, partial)
    try:
        oldest, newest = sockets[:MAX_WAITING], sockets[MAX_WAITING:]
        wait_until(lambda: all(closed_by_server(s) for s in oldest), what="the oldest past the cap closed")
        assert not any(closed_by_server(s) for s in newest)
        assert httpx.get(patient_server + "/").text == "hello"  # a whole request is answered meanwhile
        assert closed_by_server(newest[0]) and not any(closed_by_server(s) for s in newest[1:])  # it took a place
    finally:
        for s in sockets:
            s.close()


def test_every_half_open_connection_closes_by_the_head_deadline(server):
    sockets = _half_open(server, MAX_WAITING // 2, b"") + _half_open(server, MAX_WAITING // 2, b"POST / HTTP/1.1\r\n")
    try:
        wait_until(lambda: all(closed_by_server(s) for s in sockets), what="every half-open connection closed")
        assert httpx.get(server + "/").text == "hello"
    finally:
        for s in sockets:
            s.close()


def test_a_keep_alive_connection_that_trickles_its_next_head_is_closed(server):
    """After a response, bytes of a next head that never ends keep no connection open (each byte cancels
    uvicorn's keep-alive timer; the head deadline runs from the end of the response)."""
    (s,) = _half_open(server, 1, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    try:
        s.settimeout(30)
        answer = b""
        while b"hello" not in answer:
            answer += s.recv(4096)
        started = time.monotonic()
        s.setblocking(False)
        closed = False
        for _ in range(2000):  # the test's own bound, far past the deadline
            try:
                s.send(b"X")  # one byte of the next head at a time
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed or closed_by_server(s):
                break
            time.sleep(0.05)
        assert closed or closed_by_server(s)
        assert time.monotonic() - started >= HEAD_TIMEOUT_S * 0.9  # by the deadline, not by the first byte
    finally:
        s.close()


def test_requests_keep_working_on_a_kept_alive_connection(server):
    with httpx.Client(base_url=server) as client:
        for _ in range(3):
            assert client.get("/").text == "hello"
            asyncio.run(asyncio.sleep(HEAD_TIMEOUT_S / 5))


def _send_body_at(url: str, total: int, chunk: int, every_s: float) -> tuple[socket.socket, bytes, float]:
    """A POST declaring `total` bytes, its body sent `chunk` bytes every `every_s` until the server answers or
    closes: (the socket, the whole answer, seconds from the head to the answer)."""
    (s,) = _half_open(url, 1, f"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {total}\r\n\r\n".encode())
    s.setblocking(False)
    started, sent, answer = time.monotonic(), 0, b""
    while time.monotonic() - started < 30:  # the test's own bound
        try:
            answer += s.recv(4096)
        except BlockingIOError:
            pass
        if answer.endswith(b"\r\n0\r\n\r\n"):
            break  # the last chunk: these apps answer chunked
        if sent < total:
            try:
                sent += s.send(b"x" * min(chunk, total - sent))
            except (BrokenPipeError, ConnectionResetError):
                break
        time.sleep(every_s)
    return s, answer, time.monotonic() - started


def test_a_body_that_keeps_its_pace_is_read_whole(reading_server):
    """4,000 bytes at 4 kB/s: past the pace's first 0.5 s, kept going by the second each 2,000 bytes add."""
    s, answer, _ = _send_body_at(reading_server, 4000, 200, 0.05)
    s.close()
    assert answer.startswith(b"HTTP/1.1 200") and b"\r\n4000\r\n" in answer, answer


def test_a_body_that_falls_behind_is_answered_408_then_closed(reading_server):
    s, answer, seconds = _send_body_at(reading_server, 100_000, 10, 0.05)  # 200 B/s, a tenth of the pace
    try:
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b"the request body came too slowly: " in answer
        assert b"a body has 0.5 s, and 1 s more for every 2000" in answer
        assert seconds >= PACE.timeout_s * 0.9
        wait_until(lambda: closed_by_server(s), what="the connection closed after its 408")
    finally:
        s.close()


def test_a_trickled_body_the_app_never_reads_is_closed(server):
    """The app answers without reading the body; the bytes that keep coming after the answer hold no connection
    open (each cancels uvicorn's keep-alive timer, and no head deadline runs while a body is being sent)."""
    s, answer, _ = _send_body_at(server, 100_000, 10, 0.05)
    started = time.monotonic()
    try:
        assert answer.startswith(b"HTTP/1.1 200") and b"\r\nhello\r\n" in answer, answer
        closed = False
        while not closed and time.monotonic() - started < 30:
            try:
                s.send(b"x")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            closed = closed or closed_by_server(s)
            time.sleep(0.05)
        assert closed
    finally:
        s.close()


def test_body_bytes_that_come_with_the_head_count_toward_the_pace(reading_server):
    """The head and 4,000 bytes of body in one send, then a stall: the app's 408 comes first (at 0.5 s + 2 s), not
    a close at the head's 0.5 s as if the first bytes had not come."""
    head = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
    (s,) = _half_open(reading_server, 1, head + b"x" * 4000)
    try:
        s.settimeout(30)
        answer = b""
        while not answer.endswith(b"\r\n0\r\n\r\n"):
            more = s.recv(4096)
            if not more:
                break
            answer += more
        assert answer.startswith(b"HTTP/1.1 408") and b"4000 bytes" in answer, answer
    finally:
        s.close()


def test_a_body_left_unread_that_ends_after_the_answer_leaves_no_idle_connection(server):
    """The app answers without reading the body, whose bytes then come in two sends: once the body is whole the
    connection waits for a next head under the head deadline, as after any response."""
    (s,) = _half_open(server, 1, b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n")
    try:
        s.settimeout(30)
        answer = b""
        while not answer.endswith(b"\r\n0\r\n\r\n"):
            answer += s.recv(4096)
        s.sendall(b"x" * 50)
        time.sleep(0.1)
        s.sendall(b"x" * 50)
        wait_until(lambda: closed_by_server(s), timeout=10 * HEAD_TIMEOUT_S, what="the idle connection closed")
    finally:
        s.close()

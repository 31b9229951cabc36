"""Connections that never send a whole request head are closed (`layerstream.server.connections`): the oldest at
once past the cap on waiting ones, every one by the head deadline, while complete requests are answered. Here on
uvicorn in this process with small figures (a tiny app, no model); `test_access_server` holds the defaults on
`layerstream serve`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from layerstream.server.connections import guarded_h11
from serve_harness import closed_by_server, wait_until

HEAD_TIMEOUT_S = 0.5
MAX_WAITING = 20


async def _hello(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


def _serve(head_timeout_s: float):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_hello, http=guarded_h11(head_timeout_s, MAX_WAITING), lifespan="off", log_config=None)
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

"""A real server with slow generations: 429 when full, 504 and 499 whether waiting or running, bounded stop.

``--link-gbps 0.001`` throttles the CPU copy engine so that each denoising step of tiny-flux takes about
0.6 s (most of it waiting on the simulated link, so it holds even on a busy machine), long enough to hold
the queue in a known state while the test acts.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest

from serve_harness import IMAGES, decode_png, metric, wait_until

SLOW = ("--link-gbps", "0.001", "--max-queue", "1")
LONG_STEPS = 100  # about 60 s: a test that sees it end early has seen it stopped
CLIENT_GONE = 'endpoint="/v1/images/generations",status="499"'
STOPPED = 'outcome="stopped"'


def _request(seed: int, steps: int, **extra) -> dict:
    return {"prompt": "a slow fox", "size": "32x32", "seed": seed, "num_inference_steps": steps, **extra}


def _post_in_thread(server, body: dict, results: dict, key: str) -> threading.Thread:
    def send():
        with server.client() as own:
            results[key] = own.post(IMAGES, json=body)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def slow_server(server_factory):
    return server_factory("tiny-flux", *SLOW)


def test_full_queue_is_429_and_the_loop_never_blocks(slow_server):
    results: dict[str, httpx.Response] = {}
    with slow_server.client() as client:
        running = _post_in_thread(slow_server, _request(1, steps=3), results, "running")
        wait_until(lambda: client.get("/health").json()["running"], what="the first generation to start")
        waiting = _post_in_thread(slow_server, _request(2, steps=1), results, "waiting")
        wait_until(lambda: client.get("/health").json()["queue_depth"] == 1, what="the second request to queue")

        refused = client.post(IMAGES, json=_request(3, steps=1))
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_full" and refused.headers["retry-after"] == "1"

        health = client.get("/health")  # answered while a generation runs: the event loop is free
        assert health.status_code == 200 and health.json()["running"] and running.is_alive()
    for thread in (running, waiting):
        thread.join(60)
    assert results["running"].status_code == 200 and results["waiting"].status_code == 200


def test_a_request_that_waits_past_its_timeout_is_504_and_never_started(slow_server):
    results: dict[str, httpx.Response] = {}
    with slow_server.client() as client:
        jobs_started = metric(client, "layerstream_jobs_started_total")
        running = _post_in_thread(slow_server, _request(4, steps=6), results, "running")
        wait_until(lambda: client.get("/health").json()["running"], what="the first generation to start")
        late = client.post(IMAGES, json=_request(5, steps=1, timeout=0.3))
        assert late.status_code == 504, late.text
        assert late.json()["error"]["param"] == "timeout"
        assert "running" not in results  # answered at its deadline, not when the worker got to it (after 6 steps)
        running.join(60)
        assert results["running"].status_code == 200
        assert metric(client, "layerstream_jobs_started_total") == jobs_started + 1  # the late one never ran


def test_a_client_that_leaves_while_queued_is_dropped(slow_server):
    results: dict[str, httpx.Response] = {}
    with slow_server.client() as client:
        jobs_started = metric(client, "layerstream_jobs_started_total")
        running = _post_in_thread(slow_server, _request(8, steps=3), results, "running")
        wait_until(lambda: client.get("/health").json()["running"], what="the first generation to start")
        with pytest.raises(httpx.ReadTimeout), slow_server.client(timeout=0.3) as impatient:
            impatient.post(IMAGES, json=_request(9, steps=1))
        wait_until(lambda: client.get("/health").json()["queue_depth"] == 0, what="the abandoned request to leave")
        running.join(60)
        assert results["running"].status_code == 200
        assert metric(client, "layerstream_jobs_started_total") == jobs_started + 1
        assert metric(client, "layerstream_requests_total", CLIENT_GONE) >= 1
        assert metric(client, "layerstream_generations_total", STOPPED) == 0  # dropped, never started


def test_a_generation_past_its_timeout_is_504_and_stops_leaving_the_runtime_clean(slow_server):
    with slow_server.client() as client:
        before = client.post(IMAGES, json=_request(10, steps=1))
        assert before.status_code == 200
        stopped = metric(client, "layerstream_generations_total", STOPPED)
        late = client.post(IMAGES, json=_request(11, steps=LONG_STEPS, timeout=1.0))
        assert late.status_code == 504, late.text  # answered at its deadline: a finished generation would be 200
        error = late.json()["error"]
        assert error["code"] == "generation_timeout" and error["param"] == "timeout"
        wait_until(lambda: not client.get("/health").json()["running"], timeout=5, what="the generation to stop")
        assert metric(client, "layerstream_generations_total", STOPPED) == stopped + 1
        after = client.post(IMAGES, json=_request(10, steps=1))  # the same request as before the stop
        assert after.status_code == 200, after.text
    assert (decode_png(after.json()["data"][0]["b64_json"]) == decode_png(before.json()["data"][0]["b64_json"])).all()


def test_a_client_that_leaves_during_its_generation_stops_it(slow_server):
    with slow_server.client() as client:
        gone = metric(client, "layerstream_requests_total", CLIENT_GONE)
        stopped = metric(client, "layerstream_generations_total", STOPPED)
        with pytest.raises(httpx.ReadTimeout), slow_server.client(timeout=1.0) as impatient:
            impatient.post(IMAGES, json=_request(12, steps=LONG_STEPS))
        wait_until(lambda: not client.get("/health").json()["running"], timeout=5, what="the generation to stop")
        assert metric(client, "layerstream_generations_total", STOPPED) == stopped + 1
        assert metric(client, "layerstream_requests_total", CLIENT_GONE) == gone + 1
        assert client.post(IMAGES, json=_request(13, steps=1)).status_code == 200


def test_a_client_that_disconnects_mid_upload_is_499_and_one_log_line(slow_server):
    with slow_server.client() as client:
        gone = metric(client, "layerstream_requests_total", CLIENT_GONE)
        failed = metric(client, "layerstream_requests_total", 'endpoint="/v1/images/generations",status="500"')
        log_start = len(slow_server.log())
        url = urlsplit(slow_server.url)
        with socket.create_connection((url.hostname, url.port), timeout=5) as sock:
            head = f"POST {IMAGES} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            # the server reads what was sent before the connection's end (TCP delivers it first), then the end
            sock.sendall(f"{head}Content-Length: 100000\r\n\r\n".encode() + b'{"prompt": "' + b"x" * 1000)
        wait_until(lambda: metric(client, "layerstream_requests_total", CLIENT_GONE) == gone + 1, what="the 499")
        assert metric(client, "layerstream_requests_total", 'endpoint="/v1/images/generations",status="500"') == failed
    new_lines = [line for line in slow_server.log()[log_start:].splitlines() if "GET /metrics" not in line]
    assert "Traceback" not in "\n".join(new_lines)
    assert len(new_lines) == 1 and "disconnected after sending 1012 bytes" in new_lines[0], new_lines


def test_sigterm_stops_a_generation_that_outlives_the_shutdown_timeout(server_factory):
    server = server_factory("tiny-flux", *SLOW, "--shutdown-timeout", "0.5")
    results: dict[str, httpx.Response] = {}
    with server.client() as client:
        running = _post_in_thread(server, _request(14, steps=LONG_STEPS), results, "running")
        wait_until(lambda: client.get("/health").json()["running"], what="the generation to start")
    assert server.terminate(timeout=30) == 0, server.log()  # the grace period, one step and the exit (30 s: a hang)
    running.join(10)
    assert results["running"].status_code == 503, results["running"].text
    assert results["running"].json()["error"]["code"] == "shutting_down"
    assert "generation stopped (shutdown)" in server.log() and "layerstream serve: stopped" in server.log()


def test_sigterm_finishes_the_running_generation_answers_waiting_503_and_exits_0(server_factory):
    server = server_factory("tiny-flux", *SLOW, "--shutdown-timeout", "10")
    results: dict[str, httpx.Response] = {}
    with server.client() as client:
        running = _post_in_thread(server, _request(6, steps=2), results, "running")
        wait_until(lambda: client.get("/health").json()["running"], what="the generation to start")
        waiting = _post_in_thread(server, _request(7, steps=1), results, "waiting")
        wait_until(lambda: client.get("/health").json()["queue_depth"] == 1, what="the second request to queue")
    assert server.terminate(timeout=30) == 0, server.log()
    for thread in (running, waiting):
        thread.join(30)
    assert results["running"].status_code == 200, results["running"].text
    assert results["running"].json()["layerstream"]["seeds"] == [6]
    assert results["waiting"].status_code == 503
    assert results["waiting"].json()["error"]["code"] == "shutting_down"
    assert "layerstream serve: stopped" in server.log()

"""A real server batching requests: compatible ones share one pipeline call, each answered with its own
outputs; incompatible ones keep their order; a stopped or failing request in a batch is handled per request.

``--link-gbps 0.001`` makes each denoising step of tiny-flux take about 0.6 s (the simulated link), so that
requests reach the queue well within a batch's time. ``--batch-wait-ms 2000`` keeps the head of the queue
waiting for its batch long enough for the test to queue the others one by one, in a known order (the order
within a batch is part of what makes its outputs repeat exactly).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from serve_harness import IMAGES, decode_png, metric, wait_until

BATCHING = ("--max-batch-size", "4", "--batch-wait-ms", "2000", "--max-queue", "8")
SLOW = ("--link-gbps", "0.001")
STOPPED = 'outcome="stopped"'


def _request(prompt: str, seed: int, size: str = "32x32", steps: int = 1, **extra) -> dict:
    return {"prompt": prompt, "size": size, "seed": seed, "num_inference_steps": steps, **extra}


class Sender:
    """Posts requests from threads, one at a time into the queue (each waits in it before the next is sent),
    and records each answer and when it came."""

    def __init__(self, server, client: httpx.Client):
        self.server, self.client = server, client
        self.answers: dict[str, httpx.Response] = {}
        self.answered_at: dict[str, float] = {}
        self.threads: list[threading.Thread] = []

    def send(self, key: str, body: dict, *, client_timeout: float = 60.0, queued: int | None = None) -> None:
        def post():
            try:
                with self.server.client(timeout=client_timeout) as own:
                    self.answers[key] = own.post(IMAGES, json=body)
            except httpx.ReadTimeout:
                pass  # the client gave up on purpose
            self.answered_at[key] = time.monotonic()

        thread = threading.Thread(target=post)
        thread.start()
        self.threads.append(thread)
        if queued is not None:
            wait_until(lambda: self.client.get("/health").json()["queue_depth"] == queued, what=f"{key} to queue")

    def join(self) -> None:
        for thread in self.threads:
            thread.join(60)


def _pngs(response: httpx.Response) -> list:
    assert response.status_code == 200, response.text
    return [decode_png(item["b64_json"]) for item in response.json()["data"]]


@pytest.fixture(scope="module")
def batching_server(server_factory):
    return server_factory("tiny-flux", *BATCHING, *SLOW)


def _send_four(server, client) -> dict[str, httpx.Response]:
    sender = Sender(server, client)
    bodies = [_request("a red fox", 1), _request("a grey cat", 2, n=2), _request("a red fox", 3), _request("an owl", 4)]
    for index, body in enumerate(bodies):
        # the fourth fills the batch, which starts at once: it is never seen waiting
        sender.send(f"r{index}", body, queued=index + 1 if index < 3 else None)
    sender.join()
    return sender.answers


def test_four_compatible_requests_run_as_one_batch_each_with_its_own_outputs_and_repeat_exactly(batching_server):
    with batching_server.client() as client:
        health = client.get("/health").json()
        assert health["max_batch_size"] == 4 and health["batch_wait_ms"] == 2000
        batches, requests = metric(client, "layerstream_batch_size_count"), metric(client, "layerstream_batch_size_sum")
        streamed = metric(client, "layerstream_streamed_bytes_total")
        per_request = metric(client, "layerstream_request_streamed_bytes_sum")
        first = _send_four(batching_server, client)
        assert metric(client, "layerstream_batch_size_count") == batches + 1  # one pipeline call ...
        assert metric(client, "layerstream_batch_size_sum") == requests + 4  # ... for the four requests
        call_bytes = int(metric(client, "layerstream_streamed_bytes_total") - streamed)
        shares = [call_bytes * k // 5 for k in (1, 2, 1, 1)]  # by outputs: 1 + 2 + 1 + 1
        assert metric(client, "layerstream_request_streamed_bytes_sum") - per_request == sum(shares)
        second = _send_four(batching_server, client)
    outputs = {key: _pngs(first[key]) for key in sorted(first)}
    usages = [first[key].json()["layerstream"] for key in sorted(first)]
    assert [u["batch_size"] for u in usages] == [4, 4, 4, 4]
    assert [u["seeds"] for u in usages] == [[1], [2, 3], [3], [4]]
    assert [u["bytes_streamed"] for u in usages] == shares  # each request pays its share of the one call
    images = [image for key in sorted(outputs) for image in outputs[key]]
    assert len(images) == 5 and all((a != b).any() for i, a in enumerate(images) for b in images[i + 1 :])
    for key in sorted(first):  # the same batch, the same seeds: the same outputs, bit for bit
        assert all((a == b).all() for a, b in zip(outputs[key], _pngs(second[key])))


def test_incompatible_requests_are_never_batched_together_and_keep_their_order(batching_server):
    with batching_server.client() as client:
        batches = metric(client, "layerstream_batch_size_count")
        sender = Sender(batching_server, client)
        for index, size in enumerate(["32x32", "48x48", "32x32", "48x48"]):
            sender.send(f"r{index}", _request("a red fox", 10 + index, size=size), queued=index + 1)
        sender.join()
        assert metric(client, "layerstream_batch_size_count") == batches + 2
    answers, at = sender.answers, sender.answered_at
    assert [answers[f"r{i}"].json()["layerstream"]["batch_size"] for i in range(4)] == [2, 2, 2, 2]
    assert [_pngs(answers[f"r{i}"])[0].shape[0] for i in range(4)] == [32, 48, 32, 48]
    assert max(at["r0"], at["r2"]) < min(at["r1"], at["r3"])  # the oldest request's batch ran first


def test_a_request_of_a_batch_that_times_out_or_leaves_does_not_fail_the_others(batching_server):
    with batching_server.client() as client:
        stopped = metric(client, "layerstream_generations_total", STOPPED)
        sender = Sender(batching_server, client)
        sender.send("ok1", _request("a red fox", 20, steps=3), queued=1)
        sender.send("ok2", _request("a red fox", 21, steps=3), queued=2)
        # the last two start counting just before the batch starts (the fourth fills it): about 2 s of steps
        sender.send("gone", _request("an owl", 22, steps=3), client_timeout=1.5, queued=3)
        sender.send("late", _request("a grey cat", 23, steps=3, timeout=1.5))
        sender.join()
        assert "gone" not in sender.answers  # its client gave up
        late = sender.answers["late"]
        assert late.status_code == 504 and late.json()["error"]["code"] == "generation_timeout", late.text
        for key in ("ok1", "ok2"):
            assert sender.answers[key].json()["layerstream"]["batch_size"] == 4
            assert len(_pngs(sender.answers[key])) == 1
        wait_until(lambda: not client.get("/health").json()["running"], what="the batch to end")
        assert metric(client, "layerstream_generations_total", STOPPED) == stopped + 2


def test_a_batch_that_raises_answers_500_to_each_request_and_the_next_batch_runs(server_factory):
    server = server_factory("tiny-flux", *BATCHING, fault_prompt="explode")
    with server.client() as client:
        sender = Sender(server, client)
        sender.send("fault", _request("explode", 1), queued=1)
        sender.send("other", _request("a red fox", 2), queued=2)
        sender.send("third", _request("a grey cat", 3), queued=3)
        sender.send("fourth", _request("an owl", 4))
        sender.join()
        for key in ("fault", "other", "third", "fourth"):
            error = sender.answers[key].json()["error"]
            assert sender.answers[key].status_code == 500 and error["code"] == "generation_failed"
            assert "InjectedFault" in error["message"]
        sender = Sender(server, client)
        for index in range(4):
            sender.send(f"after{index}", _request("a red fox", 5 + index), queued=index + 1 if index < 3 else None)
        sender.join()
    assert [sender.answers[f"after{i}"].json()["layerstream"]["batch_size"] for i in range(4)] == [4] * 4
    assert server.log().count("Traceback") == 1  # the batch's failure logged once, not once per request

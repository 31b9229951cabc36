"""`layerstream serve tiny-flux` as a client meets it: images, health, metrics, FIFO, faults, bad input."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_contract import IMAGE_DATA_KEYS, IMAGE_RESPONSE_KEYS, USAGE_KEYS
from serve_harness import IMAGES, VIDEOS, decode_png, metric, wait_until

FAULT_PROMPT = "explode"
MAX_BODY_BYTES = 65536
SMALL = {"size": "32x32", "num_inference_steps": 1}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("tiny-flux", "--max-body-bytes", str(MAX_BODY_BYTES), fault_prompt=FAULT_PROMPT)


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def test_image_generation(client):
    response = client.post(IMAGES, json={"prompt": "a red fox", "n": 2, "seed": 5, **SMALL})
    assert response.status_code == 200, response.text
    body = response.json()
    assert list(body) == IMAGE_RESPONSE_KEYS and body["output_format"] == "png" and body["size"] == "32x32"
    assert [list(item) for item in body["data"]] == [IMAGE_DATA_KEYS] * 2
    assert all(item["revised_prompt"] is None for item in body["data"])
    usage = body["layerstream"]
    assert list(usage) == USAGE_KEYS
    assert usage["seeds"] == [5, 6] and (usage["width"], usage["height"]) == (32, 32) and usage["num_frames"] is None
    assert usage["bytes_streamed"] > 0 and usage["host_bytes"] > 0 and usage["num_inference_steps"] == 1
    first, second = (decode_png(item["b64_json"]) for item in body["data"])
    assert first.shape == second.shape == (32, 32, 3)
    assert not np.array_equal(first, second)  # different seeds


def test_seeds_reach_the_command_line_range(client):
    """Any seed `layerstream generate` takes (up to 2**53 - 1) the server takes; seed + n - 1 must fit too."""
    top = 2**53 - 1
    response = client.post(IMAGES, json={"prompt": "a red fox", "n": 2, "seed": top - 1, **SMALL})
    assert response.status_code == 200, response.text
    assert response.json()["layerstream"]["seeds"] == [top - 1, top]
    response = client.post(IMAGES, json={"prompt": "a red fox", "n": 2, "seed": top, **SMALL})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "seed" and str(top) in error["message"] and str(top - 1) in error["message"]


def test_health(client):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny-flux" and health["kind"] == "image"
    assert health["device"] == "cpu" and health["queue_depth"] == 0 and health["max_queue"] == 16
    assert health["offload_config"] == {
        "mode": "layer", "components": ["dit"], "pin_memory": True, "vae_use_tiling": "auto", "vae_use_slicing": "auto"
    }
    assert health["size_multiple"] == 16 and health["frame_multiple"] is None


def test_metrics_count_requests_and_runtime(client):
    ok = 'endpoint="/v1/images/generations",status="200"'
    before = metric(client, "layerstream_requests_total", ok)
    streamed = metric(client, "layerstream_streamed_bytes_total")
    assert client.post(IMAGES, json={"prompt": "fox", "seed": 1, **SMALL}).status_code == 200
    assert client.post(IMAGES, json={"prompt": "fox", "n": 0}).status_code == 422
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert metric(client, "layerstream_requests_total", ok) == before + 1
    assert metric(client, "layerstream_requests_total", 'endpoint="/v1/images/generations",status="422"') >= 1
    assert metric(client, "layerstream_streamed_bytes_total") > streamed
    assert metric(client, "layerstream_request_duration_seconds_count", 'endpoint="/v1/images/generations"') >= 2
    for name in ("layerstream_stall_seconds_total", "layerstream_device_bytes", "layerstream_host_bytes"):
        assert f"\n{name} " in response.text


def test_eight_concurrent_requests_are_answered_in_submission_order(server, client):
    submitted = metric(client, "layerstream_jobs_submitted_total")
    responses: dict[int, httpx.Response] = {}
    finished: list[int] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        # the first request is long, so that the other seven are all queued behind it while it runs
        steps = 24 if i == 0 else 2
        body = {"prompt": "a red fox", "seed": 100 + i, "size": "64x64", "num_inference_steps": steps}
        with server.client() as own:
            response = own.post(IMAGES, json=body)
        with lock:
            responses[i] = response
            finished.append(i)

    threads = []
    for i in range(8):
        thread = threading.Thread(target=send, args=(i,))
        thread.start()
        threads.append(thread)
        # submission order is the order the server accepted them: wait for each before sending the next
        wait_until(lambda: metric(client, "layerstream_jobs_submitted_total") >= submitted + i + 1, what=f"request {i}")
    for thread in threads:
        thread.join(60)
    assert [responses[i].status_code for i in range(8)] == [200] * 8
    assert [responses[i].json()["layerstream"]["seeds"] for i in range(8)] == [[100 + i] for i in range(8)]
    assert finished == list(range(8))
    waits = [responses[i].json()["layerstream"]["queue_seconds"] for i in range(8)]
    assert all(wait > 0.01 for wait in waits[1:])  # all seven really queued (behind the first, long one)


def test_a_failed_generation_is_500_and_the_next_one_matches_a_fresh_run(client):
    request = {"prompt": "a lighthouse at dusk", "seed": 11, **SMALL}
    before = client.post(IMAGES, json=request)
    assert before.status_code == 200
    failed = client.post(IMAGES, json={**request, "prompt": FAULT_PROMPT})
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == "generation_failed" and "InjectedFault" in error["message"]
    after = client.post(IMAGES, json=request)
    assert after.status_code == 200, after.text
    served = decode_png(after.json()["data"][0]["b64_json"])
    assert np.array_equal(served, decode_png(before.json()["data"][0]["b64_json"]))
    assert np.array_equal(served, _fresh_run(request))
    assert client.get("/health").json()["status"] == "ok"


def _fresh_run(request: dict) -> np.ndarray:
    """The same request run by a fresh `Omni` in this process, on one thread like the server."""
    from layerstream.omni import Omni

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        omni = Omni("tiny-flux", device="cpu")
        result = omni.generate(request["prompt"], height=32, width=32, num_inference_steps=1, seed=request["seed"])
        omni.close()
    finally:
        torch.set_num_threads(threads)
    return result.frames[0]


def test_wrong_endpoint_and_unknown_path(client):
    response = client.post(VIDEOS, json={"prompt": "fox", "num_frames": 5})
    assert response.status_code == 400
    assert "tiny-flux makes images" in response.json()["error"]["message"]
    response = client.get("/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_size_not_a_multiple_is_400(client):
    response = client.post(IMAGES, json={"prompt": "fox", "size": "40x32"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "size" and "multiple of 16" in error["details"][0]["allowed"]


def test_oversized_body_is_413(client):
    response = client.post(IMAGES, content=json.dumps({"prompt": "x" * (2 * MAX_BODY_BYTES)}).encode())
    assert response.status_code == 413
    assert str(MAX_BODY_BYTES) in response.json()["error"]["message"]


# fuzzing: every request below has at least one thing wrong with it --------------------------------------------

VALID = {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 1, "seed": 0}
_ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)
_NOT_INT = st.text(max_size=4) | st.floats() | st.booleans() | st.lists(st.integers(), max_size=2)
_BAD_SIZE = (
    st.builds(lambda w, h: f"{w}x{h}", st.integers(1, 4000), st.integers(1, 4000)).filter(
        lambda s: any(int(side) % 16 or int(side) > 2048 for side in s.split("x"))
    )
    | st.text(max_size=10).filter(lambda s: "x" not in s)
    | st.sampled_from(["0x16", "16x", "x16", "16X16", "-16x16", "16x16x16", " 16x16", "16.0x16"])
    | st.integers()
)
BAD_VALUES = {
    "prompt": st.just("") | st.integers() | st.booleans() | st.lists(st.text(max_size=3), max_size=2) | st.none(),
    "n": st.integers(max_value=0) | st.integers(min_value=5) | _NOT_INT,
    "size": _BAD_SIZE,
    "seed": st.integers(max_value=-1) | st.integers(min_value=2**53) | _NOT_INT,
    "num_inference_steps": st.integers(max_value=0) | st.integers(min_value=1001) | _NOT_INT,
    "guidance_scale": st.floats(max_value=-0.001) | st.floats(min_value=100.001) | st.text(max_size=3) | st.booleans(),
    "response_format": st.text(max_size=10).filter(lambda s: s not in ("b64_json", "url")) | st.integers(),  # both are valid
    "timeout": st.floats(max_value=0.0) | st.floats(min_value=86400.5) | st.text(max_size=3) | st.booleans(),
    "negative_prompt": st.integers() | st.booleans() | st.lists(st.integers(), max_size=2),  # tiny-flux takes none: any string is bad too
    "model": st.integers() | st.sampled_from(["tiny-wan", "dall-e-3", ""]),
    "num_frames": st.integers(),  # a video field on the image endpoint
}


@st.composite
def bad_bodies(draw) -> bytes:
    shape = draw(st.sampled_from(["fields", "fields", "fields", "not_an_object", "not_json"]))
    if shape == "not_an_object":
        return json.dumps(draw(st.lists(_ANY_JSON, max_size=3) | st.integers() | st.text(max_size=5) | st.none())).encode()
    if shape == "not_json":
        return draw(st.sampled_from([b"", b"{", b"{'prompt': 'fox'}", b"prompt=fox", b"\xff\xfe", b'{"prompt": "fox",}']))
    body = dict(VALID)
    bad_fields = draw(st.lists(st.sampled_from(sorted(BAD_VALUES)), max_size=3, unique=True))
    for field in bad_fields:
        body[field] = draw(BAD_VALUES[field])
    extra = draw(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in BAD_VALUES and k not in VALID), _ANY_JSON, max_size=2))
    body.update(extra)
    drop_prompt = draw(st.booleans())
    if drop_prompt or not (bad_fields or extra):
        body.pop("prompt")
    return json.dumps(body).encode()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bad_bodies())
def test_bad_input_is_4xx_never_500(client, body):
    response = client.post(IMAGES, content=body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
    error = response.json()["error"]
    assert error["message"] and error["code"]


def test_a_json_body_may_open_with_a_utf8_byte_order_mark_and_utf16_is_named(client):
    """RFC 8259 lets a parser ignore a UTF-8 byte order mark (Windows tools write one); UTF-16 is refused by name."""
    body, as_json = {"prompt": "a red fox", "seed": 4, **SMALL}, {"content-type": "application/json"}
    plain = client.post(IMAGES, content=json.dumps(body).encode(), headers=as_json)
    marked = client.post(IMAGES, content=b"\xef\xbb\xbf" + json.dumps(body).encode(), headers=as_json)
    assert plain.status_code == marked.status_code == 200, marked.text
    assert plain.json()["data"][0]["b64_json"] == marked.json()["data"][0]["b64_json"]
    for encoding in ("utf-16", "utf-16-le", "utf-16-be"):
        answer = client.post(IMAGES, content=json.dumps(body).encode(encoding), headers=as_json)
        assert answer.status_code == 400, (encoding, answer.text)
        assert answer.json()["error"]["message"].startswith("the JSON body is not UTF-8 (it looks like UTF-16")


def test_server_is_up_after_the_fuzzing(server, client):
    # the process lives and answers (a hang meets the client's timeout)
    assert server.process.poll() is None, server.log()
    assert client.get("/health").status_code == 200
    assert client.post(IMAGES, json={"prompt": "still here", "seed": 2, **SMALL}).status_code == 200


def test_the_edit_endpoint_on_a_model_without_an_image_input_is_400(client):
    files = {"image": ("in.png", b"\x89PNG", "image/png")}
    response = client.post("/v1/images/edits", data={"prompt": "fox"}, files=files)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "wrong_endpoint_for_model" and "takes no input image" in error["message"]

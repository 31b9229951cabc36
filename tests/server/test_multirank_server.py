"""`layerstream serve --nproc 2`: two gloo ranks on the CPU, the DiT's blocks shared by allgather.

Every output is compared, byte for byte (a job's, frame for frame), with the single-process server's for the
same request and seed. The job API runs each job on one rank, as the synchronous endpoints do.
tiny-flux runs under torchrun through `serve_ranks_with_fault.py` (rank 1 raises on the fault prompt);
tiny-wan runs through the real launcher, `layerstream serve --nproc 2`.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from jobs_harness import mp4_frames, png_pixels, read_events, wait_for_job
from rank_harness import RankServer, start_rank_server
from serve_harness import IMAGES, VIDEOS, metric, stop_all, wait_until

# ranks on loopback ports chosen by free_port, timeouts sized for a 2-core machine: on one xdist worker, one group at a time
pytestmark = pytest.mark.xdist_group("serving_ranks")  # torchrun groups: beside tests/distributed's "ranks", not with them

FAULT_PROMPT = "explode"
COLLECTIVE_TIMEOUT_S = 4
"""A fault or a hung rank is answered within it (the hung rank: twice). What it proves needs only that it ends
the wait; it still leaves a loaded 2-core machine room: a live rank beats every 0.5 s, and the tiny models'
transfers take milliseconds."""
FLUX = {"size": "32x32", "num_inference_steps": 2}
WAN = {"size": "32x32", "num_frames": 5, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def rank_servers(tmp_path_factory, layerstream_cache):
    started: list[RankServer] = []

    def start(model: str, *args: str, **kwargs) -> RankServer:
        server = start_rank_server(model, *args, folder=tmp_path_factory.mktemp("ranks"), **kwargs)
        started.append(server)
        return server

    try:
        yield start
    finally:
        stop_all(started)  # SIGTERM to rank 0, every rank exits 0 (unless a test ended it and checked)


@pytest.fixture(scope="module")
def flux_ranks(rank_servers, tmp_path_factory):
    gate = tmp_path_factory.mktemp("rebuild-gate") / "open"  # a rebuild after a fault waits until it exists
    env = {"LAYERSTREAM_TEST_FAULT_RANK": "1", "LAYERSTREAM_TEST_FAULT_PROMPT": FAULT_PROMPT,
           "LAYERSTREAM_TEST_REBUILD_GATE": str(gate)}  # fmt: skip
    # no config given: with several ranks the default is the allgather one
    server = rank_servers("tiny-flux", "--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S), script="serve_ranks_with_fault.py", env=env)
    server.rebuild_gate = gate
    return server


@pytest.fixture(scope="module")
def flux_single(shared_server):
    return shared_server("tiny-flux")  # one rank, the default config: the same DiT blocks, copied whole


@pytest.fixture(scope="module")
def wan_ranks(rank_servers):
    # requests sent together wait for each other: a wave of 2, not a wave of 1 and one waiting behind it
    return rank_servers("tiny-wan", "--collective-timeout-s", "30", "--shutdown-timeout", "60", "--batch-wait-ms", "1000")


@pytest.fixture(scope="module")
def wan_single(shared_server):
    return shared_server("tiny-wan")


def _post_all(server, path: str, bodies: list[dict]) -> list[httpx.Response]:
    with ThreadPoolExecutor(len(bodies)) as pool, server.client(timeout=120) as client:
        return list(pool.map(lambda body: client.post(path, json=body), bodies))


def _files(response: httpx.Response) -> list[tuple[tuple[int, ...], bytes]]:
    """Each output's pixels (a video's frames), with their shape: the files themselves differ between the servers
    in the settings they carry (the offload config: allgather on the ranks, rank-local on one process)."""
    assert response.status_code == 200, response.text
    return [_pixels(base64.b64decode(item["b64_json"])) for item in response.json()["data"]]


def _pixels(data: bytes) -> tuple[tuple[int, ...], bytes]:
    decoded = png_pixels(data) if data.startswith(b"\x89PNG") else mp4_frames(data)
    return tuple(decoded.shape), decoded.numpy().tobytes()


def _single_files(server, path: str, bodies: list[dict]) -> list[list[str]]:
    with server.client(timeout=120) as client:
        return [_files(client.post(path, json=body)) for body in bodies]


def test_four_concurrent_flux_requests_match_the_single_process_server(flux_ranks, flux_single):
    bodies = [{"prompt": f"a fox number {i}", "seed": 10 + i, **FLUX} for i in range(4)]
    bodies[3]["n"] = 2  # a wave holds requests of one output count: this one runs beside a placeholder
    with flux_ranks.client() as client:
        waves_before = metric(client, "layerstream_waves_total")
    num_keys = flux_ranks.num_store_keys()  # between waves: torchrun's, the process groups' and the heartbeats
    responses = _post_all(flux_ranks, IMAGES, bodies)
    assert [_files(r) for r in responses] == _single_files(flux_single, IMAGES, bodies)
    with flux_ranks.client() as client:
        assert metric(client, "layerstream_waves_total") >= waves_before + 2  # 4 requests over 2 ranks
        assert metric(client, "layerstream_world_size") == 2
    # every key the waves wrote (messages, outcomes) left the store once every rank had read it
    assert flux_ranks.num_store_keys() == num_keys


def test_health_shows_each_rank_holding_half_the_host_bytes(flux_ranks, flux_single):
    with flux_ranks.client() as client:
        health = client.get("/health").json()
    with flux_single.client() as client:
        single = client.get("/health").json()
    assert (health["world_size"], health["backend"], health["status"]) == (2, "gloo", "ok")
    assert health["offload_config"]["layer_options"]["dit"]["weight_transfer"] == "allgather"
    assert (single["world_size"], single["backend"]) == (1, None)
    full = single["ranks"][0]["host_bytes"]
    shares = [r["host_bytes"] for r in health["ranks"]]
    assert [r["rank"] for r in health["ranks"]] == [0, 1]
    # each rank keeps ceil(B / 2) of every block, rounded up to 64 bytes
    assert all(full / 2 <= share <= full / 2 + 64 * 64 for share in shares), (full, shares)


def test_a_fault_on_rank_1_answers_500_and_the_next_request_runs_on_a_clean_runtime(flux_ranks, flux_single):
    """The failed wave is answered 500; the rebuild after it is no outage: /health says "rebuilding" (never a
    500), /metrics answers, and a job created while the rebuild runs waits in the queue and runs after it. The
    ranks hold the rebuild at a gate until the test has queued that job, so the order is the test's, not the
    machine's pace."""
    events: list[tuple] = []  # what each thread saw, in the order it saw it
    done = threading.Event()

    def watch():
        with flux_ranks.client() as watcher:
            while not done.is_set():
                health = watcher.get("/health")
                status = health.json().get("status") if health.status_code == 200 else None
                events.append(("health", health.status_code, status, watcher.get("/metrics").status_code))
                time.sleep(0.01)

    def seen(status: str) -> list[int]:
        return [i for i, e in enumerate(events) if e[0] == "health" and e[2] == status]

    watching = threading.Thread(target=watch)
    with flux_ranks.client() as client:
        watching.start()
        try:
            # rank 0 waits for rank 1's transfers up to the collective timeout: an answer, not a hang
            failed = client.post(IMAGES, json={"prompt": FAULT_PROMPT, "seed": 1, **FLUX})
            assert failed.status_code == 500, failed.text
            assert "rank 1: InjectedFault" in failed.json()["error"]["message"]
            wait_until(lambda: seen("rebuilding"), timeout=60, what="/health to say rebuilding")
            job = client.post("/v1/images/jobs", json={"prompt": "a job made during the rebuild", "seed": 5, **FLUX})
            assert job.status_code == 200, job.text  # queued, not refused
            job_url = f"/v1/images/jobs/{job.json()['id']}"
            assert client.get(job_url).json()["status"] == "queued"
            assert client.get("/health").json()["status"] == "rebuilding"  # the gate still holds every rank
            events.append(("job queued",))
            flux_ranks.rebuild_gate.touch()
            wait_until(lambda: seen("ok") and seen("ok")[-1] > events.index(("job queued",)), timeout=60,
                       what="the rebuild to end")  # fmt: skip
            body = {"prompt": "after the fault", "seed": 4, **FLUX}
            assert _files(client.post(IMAGES, json=body)) == _single_files(flux_single, IMAGES, [body])[0]
            wait_until(lambda: client.get(job_url).json()["status"] == "completed",
                       what="the job made during the rebuild to complete")  # fmt: skip
        finally:
            done.set()
            watching.join(30)
    queued = events.index(("job queued",))
    assert seen("rebuilding")[0] < queued < seen("ok")[-1], events  # rebuilding, the job queued, then ok again
    assert all(e[1] == 200 and e[3] == 200 for e in events if e[0] == "health"), events
    assert {e[2] for e in events if e[0] == "health"} <= {"ok", "rebuilding"}
    log = flux_ranks.log()  # the server's own order: the rebuild began, the job was queued, the rebuild ended
    began = log.index("a wave failed: rebuilding the runtime on every rank")
    assert began < log.index("queued (prompt 'a job made during the rebuild')") < log.index("rank 0: runtime rebuilt", began)


def test_a_hung_rank_answers_503_and_the_server_exits_nonzero(flux_ranks):
    rank0, rank1 = flux_ranks.rank_pids()[0], flux_ranks.rank_pids()[1]
    logged_before = len(flux_ranks.log())
    os.kill(rank1, signal.SIGSTOP)  # alive but silent: torchrun does not notice, the heartbeats do
    try:
        with flux_ranks.client(timeout=120) as client:
            response = client.post(IMAGES, json={"prompt": "a fox", "seed": 1, **FLUX})
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "rank_failed" and "rank 1" in response.json()["error"]["message"]
        wait_until(lambda: "layerstream serve: stopped: rank 1 has not answered" in flux_ranks.log(), timeout=60,
                   what="rank 0 to stop")  # fmt: skip
        # rank 0's transfer timed out first, then rank 1's silent heartbeat was noticed
        log = flux_ranks.log()[logged_before:]
        assert log.index("TransferError") < log.index("rank 1 has not answered"), log
    finally:
        os.kill(rank1, signal.SIGKILL)  # and a killed rank ends the rest
    assert flux_ranks.wait_exit(60) != 0, flux_ranks.log()
    with pytest.raises(ProcessLookupError):
        os.kill(rank0, 0)


@pytest.fixture(scope="module")
def flux_batching(rank_servers):
    return rank_servers("tiny-flux", "--max-batch-size", "2", "--batch-wait-ms", "1000")


def test_with_batching_each_rank_runs_a_batch(flux_batching, flux_single):
    server = flux_batching
    with server.client() as client:
        waves_before = metric(client, "layerstream_waves_total")
    bodies = [{"prompt": f"a batch of foxes {i}", "seed": 40 + i, **FLUX} for i in range(4)]
    responses = _post_all(server, IMAGES, bodies)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert [r.json()["layerstream"]["batch_size"] for r in responses] == [2, 2, 2, 2]
    with server.client() as client:
        assert metric(client, "layerstream_waves_total") == waves_before + 1  # 2 ranks x a batch of 2
    # two requests spread over the ranks, a batch of one each: as the single-process server makes them
    bodies = [{"prompt": f"two foxes {i}", "seed": 50 + i, **FLUX} for i in range(2)]
    responses = _post_all(server, IMAGES, bodies)
    assert [r.json()["layerstream"]["batch_size"] for r in responses] == [1, 1]
    assert [_files(r) for r in responses] == _single_files(flux_single, IMAGES, bodies)


def test_a_killed_rank_ends_the_server_with_a_nonzero_exit(flux_batching):
    rank0 = flux_batching.rank_pids()[0]
    os.kill(flux_batching.rank_pids()[1], signal.SIGKILL)
    assert flux_batching.wait_exit(COLLECTIVE_TIMEOUT_S + 60) != 0, flux_batching.log()
    with pytest.raises(ProcessLookupError):
        os.kill(rank0, 0)  # rank 0 is gone too: its port is closed


def test_four_concurrent_wan_requests_match_the_single_process_server(wan_ranks, wan_single):
    bodies = [{"prompt": f"a river {i}", "seed": 20 + i, **WAN} for i in range(4)]
    responses = _post_all(wan_ranks, VIDEOS, bodies)
    assert [_files(r) for r in responses] == _single_files(wan_single, VIDEOS, bodies)
    assert all(r.json()["layerstream"]["num_frames"] == 5 for r in responses)


def test_an_odd_number_of_requests_runs_a_placeholder_on_the_idle_rank(wan_ranks, wan_single):
    with wan_ranks.client() as client:
        idle_before = metric(client, "layerstream_wave_idle_ranks_total")
        steps_before = metric(client, "layerstream_placeholder_steps_total")
        body = {"prompt": "a lone heron", "seed": 7, **WAN}
        assert _files(client.post(VIDEOS, json=body)) == _single_files(wan_single, VIDEOS, [body])[0]
        assert metric(client, "layerstream_wave_idle_ranks_total") == idle_before + 1
        # the idle rank ran the same forwards: both denoising steps of the request
        assert metric(client, "layerstream_placeholder_steps_total") == steps_before + 2
    bodies = [{"prompt": f"three herons {i}", "seed": 30 + i, **WAN} for i in range(3)]
    responses = _post_all(wan_ranks, VIDEOS, bodies)
    assert [_files(r) for r in responses] == _single_files(wan_single, VIDEOS, bodies)


def test_a_request_past_its_timeout_stops_every_rank_at_the_same_step(wan_ranks, wan_single):
    with wan_ranks.client(timeout=120) as client:
        response = client.post(VIDEOS, json={"prompt": "too slow", "seed": 3, **WAN, "num_inference_steps": 40, "timeout": 1.5})
        assert response.status_code == 504 and response.json()["error"]["code"] == "generation_timeout", response.text
        wait_until(lambda: metric(client, "layerstream_generation_running") == 0, timeout=60, what="the wave to stop")
        # both ranks stopped after the same forwards: no transfer failed, so nothing was rebuilt
        assert "a wave failed" not in wan_ranks.log() and "TransferError" not in wan_ranks.log()
        body = {"prompt": "after the stop", "seed": 5, **WAN}
        assert _files(client.post(VIDEOS, json=body)) == _single_files(wan_single, VIDEOS, [body])[0]


JOBS = "/v1/videos"


def _job_body(prompt: str, seed: int, **fields) -> dict:
    return {"prompt": prompt, "seed": seed, **WAN, **fields}


def _sync_frames(server, body: dict):
    """The frames of the single-process server's synchronous answer to `body`."""
    with server.client(timeout=120) as client:
        response = client.post(VIDEOS, json=body)
    assert response.status_code == 200, response.text
    return mp4_frames(base64.b64decode(response.json()["data"][0]["b64_json"]))


def test_a_job_runs_on_the_ranks_streams_its_events_and_its_content_matches_the_single_process_server(
    wan_ranks, wan_single
):
    body = _job_body("a job on two ranks", 61)
    with wan_ranks.client(timeout=120) as http:
        assert http.get("/health").json()["jobs_path"] == JOBS  # what the web page reads to turn its form on
        page = http.get("/")
        assert page.status_code == 200 and ">Generate</button>" in page.text
        job = http.post(JOBS, json=body).json()
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress"), job
        with http.stream("GET", f"{JOBS}/{job['id']}/events") as response:
            events = read_events(response)
        statuses = [data["status"] for name, data in events if name == "status"]
        assert statuses[-2:] == ["in_progress", "completed"], events
        assert [data["step"] for name, data in events if name == "progress"][:2] == [1, 2]
        content = http.get(f"{JOBS}/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        listed = [j["id"] for j in http.get(JOBS, params={"limit": 100}).json()["data"]]
        assert job["id"] in listed  # the history lives with rank 0, which serves HTTP
    assert torch.equal(mp4_frames(content.content), _sync_frames(wan_single, body))


def test_two_jobs_run_side_by_side_one_per_rank(wan_ranks, wan_single):
    bodies = [_job_body(f"two jobs {i}", 70 + i) for i in range(2)]
    with wan_ranks.client(timeout=120) as http:
        waves_before = metric(http, "layerstream_waves_total")
        made = [http.post(JOBS, json=body).json()["id"] for body in bodies]  # a wave of 2 (--batch-wait-ms 1000)
        done = [wait_for_job(http, JOBS, job_id) for job_id in made]
        assert [job["status"] for job in done] == ["completed", "completed"], done
        assert metric(http, "layerstream_waves_total") == waves_before + 1
        frames = [mp4_frames(http.get(f"{JOBS}/{job_id}/content").content) for job_id in made]
    for got, body in zip(frames, bodies):
        assert torch.equal(got, _sync_frames(wan_single, body))


def test_deleting_running_jobs_cancels_them_on_whichever_rank_runs_them(wan_ranks, wan_single):
    bodies = [_job_body(f"cancelled {i}", 80 + i, num_inference_steps=40) for i in range(2)]
    with wan_ranks.client(timeout=120) as http:
        stopped_before = metric(http, "layerstream_generations_total", 'outcome="stopped"')
        made = [http.post(JOBS, json=body).json()["id"] for body in bodies]  # one wave: rank 0 and rank 1
        for job_id in made:
            wait_for_job(http, JOBS, job_id, statuses=("in_progress",), timeout=60)
        for job_id in reversed(made):  # rank 1's job first, then rank 0's: the wave stops once both are gone
            assert http.delete(f"{JOBS}/{job_id}").json() == {"id": job_id, "object": "video.deleted", "deleted": True}
            assert http.get(f"{JOBS}/{job_id}").status_code == 404
        wait_until(lambda: metric(http, "layerstream_generation_running") == 0, timeout=60, what="the wave to stop")
        assert metric(http, "layerstream_generations_total", 'outcome="stopped"') == stopped_before + 2
        # every rank stopped at the same stop point, well before its 40 steps: nothing to rebuild
        assert "rank 1: generation stopped (cancelled)" in wan_ranks.log()
        assert "a wave failed" not in wan_ranks.log()
        after = _job_body("after the cancel", 90)
        job_id = http.post(JOBS, json=after).json()["id"]
        assert wait_for_job(http, JOBS, job_id)["status"] == "completed"
        frames = mp4_frames(http.get(f"{JOBS}/{job_id}/content").content)
    assert torch.equal(frames, _sync_frames(wan_single, after))


def test_sigterm_during_a_wave_answers_its_requests_and_every_rank_exits_0(wan_ranks):
    bodies = [{"prompt": f"slow {i}", "seed": i, **WAN, "num_inference_steps": 12} for i in range(2)]
    with ThreadPoolExecutor(2) as pool, wan_ranks.client(timeout=120) as client:
        started = metric(client, "layerstream_jobs_started_total")
        futures = [pool.submit(client.post, VIDEOS, json=body) for body in bodies]
        wait_until(lambda: metric(client, "layerstream_jobs_started_total") == started + 2, timeout=60, what="the wave")
        assert client.get("/health").json()["running"]
        wan_ranks.process.send_signal(signal.SIGTERM)  # the launcher passes it to rank 0, which drains
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    assert wan_ranks.wait_exit(60) == 0, wan_ranks.log()
    log = wan_ranks.log()
    assert "layerstream serve: rank 1 stopped" in log and "layerstream serve: stopped" in log

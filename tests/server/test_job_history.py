"""The job history lasts: a restart keeps finished jobs listed and downloadable and fails the unfinished
ones with a reason; a kill -9 loses no finished job and leaves the database readable; outputs carry their
settings; the retention limit removes the oldest finished jobs first; one server per data folder."""

from __future__ import annotations

import signal
import sqlite3

import pytest
import torch

from jobs_harness import IMAGE_JOBS, VIDEOS, mp4_frames, png_pixels, wait_for_job
from serve_harness import metric, wait_until

from layerstream.outputs import read_output_metadata


FAST = {"size": "32x32", "num_inference_steps": 2}
SLOW_LINK = ("--link-gbps", "0.01")
"""A simulated link that makes a step take some 0.05 s: the 200-step job is still running seconds after the test
sees it start, when it stops the server; the 2-step jobs before it are quick."""


def test_a_restart_keeps_finished_jobs_and_fails_the_running_one(server_factory, tmp_path):
    data = tmp_path / "data"
    server = server_factory("tiny-wan", "--data-dir", str(data), *SLOW_LINK, "--shutdown-timeout", "0")
    with server.client() as http:
        done = http.post(VIDEOS, json={"prompt": "kept", "num_frames": 5, "seed": 4, **FAST}).json()
        wait_for_job(http, VIDEOS, done["id"])
        mp4 = http.get(f"{VIDEOS}/{done['id']}/content").content
        running = http.post(VIDEOS, json={"prompt": "cut short", "num_frames": 1, "size": "32x32", "num_inference_steps": 200}).json()
        wait_until(lambda: http.get(f"{VIDEOS}/{running['id']}").json()["status"] == "in_progress", what="the long job")
    assert server.terminate() == 0
    settings = read_output_metadata(data / "outputs" / f"{done['id']}.mp4")
    assert (settings["prompt"], settings["seed"], settings["num_frames"], settings["model"]) == ("kept", 4, 5, "tiny-wan")
    assert settings["offload_config"]["mode"] == "layer" and settings["size"] == "32x32"

    again = server_factory("tiny-wan", "--data-dir", str(data))
    with again.client() as http:
        listed = {job["id"]: job for job in http.get(VIDEOS).json()["data"]}
        assert listed[done["id"]]["status"] == "completed" and listed[done["id"]]["layerstream"]["step"] == 2
        assert torch.equal(mp4_frames(http.get(f"{VIDEOS}/{done['id']}/content").content), mp4_frames(mp4))
        failed = listed[running["id"]]
        assert failed["status"] == "failed" and failed["error"]["code"] in ("stopped", "server_shutdown")


def test_a_kill_9_loses_no_finished_job_and_leaves_the_database_readable(server_factory, tmp_path):
    data = tmp_path / "data"
    server = server_factory("tiny-flux", "--data-dir", str(data), *SLOW_LINK)
    with server.client() as http:
        finished = [http.post(IMAGE_JOBS, json={"prompt": f"fox {i}", "seed": i, **FAST}).json()["id"] for i in range(2)]
        for job_id in finished:
            wait_for_job(http, IMAGE_JOBS, job_id)
        pngs = {job_id: http.get(f"{IMAGE_JOBS}/{job_id}/content").content for job_id in finished}
        running = http.post(IMAGE_JOBS, json={"prompt": "killed", **FAST, "num_inference_steps": 200}).json()["id"]
        queued = http.post(IMAGE_JOBS, json={"prompt": "never run", **FAST}).json()["id"]
        wait_until(lambda: http.get(f"{IMAGE_JOBS}/{running}").json()["status"] == "in_progress", what="the long job")
    server.kill()  # SIGKILL: no shutdown code runs
    assert server.process.returncode == -signal.SIGKILL

    with sqlite3.connect(data / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT count(*) FROM jobs").fetchone() == (4,)
    again = server_factory("tiny-flux", "--data-dir", str(data))
    with again.client() as http:
        for job_id, png in pngs.items():
            assert http.get(f"{IMAGE_JOBS}/{job_id}").json()["status"] == "completed"
            stored = http.get(f"{IMAGE_JOBS}/{job_id}/content")
            assert stored.headers["content-type"] == "image/png" and torch.equal(png_pixels(stored.content), png_pixels(png))
        for job_id in (running, queued):
            job = http.get(f"{IMAGE_JOBS}/{job_id}").json()
            assert job["status"] == "failed" and job["error"]["code"] == "server_restarted", job
            assert http.get(f"{IMAGE_JOBS}/{job_id}/content").status_code == 409
        # the history goes on: a new job completes beside the old ones
        new = http.post(IMAGE_JOBS, json={"prompt": "after", **FAST}).json()["id"]
        assert wait_for_job(http, IMAGE_JOBS, new)["status"] == "completed"
        assert len(http.get(IMAGE_JOBS).json()["data"]) == 5


@pytest.fixture(scope="module")
def retaining(server_factory, tmp_path_factory):
    """A server keeping at most 2 jobs, on a data folder the tests know."""
    data = tmp_path_factory.mktemp("retaining") / "data"
    return server_factory("tiny-flux", "--max-jobs", "2", "--data-dir", str(data)), data


def test_retention_removes_the_oldest_finished_jobs_first(retaining, tmp_path):
    server, _ = retaining
    with server.client() as http:
        made = []
        for i in range(3):
            made.append(http.post(IMAGE_JOBS, json={"prompt": f"fox {i}", "seed": i, **FAST}).json()["id"])
            wait_for_job(http, IMAGE_JOBS, made[-1])
        # the completed status is stored first and retention runs just after it (a limit never applied times out)
        wait_until(
            lambda: http.get(f"{IMAGE_JOBS}/{made[0]}").status_code == 404
            and metric(http, "layerstream_jobs", 'status="completed"') == 2,
            what="the oldest job's removal from the history and from /metrics",
        )
        assert [job["id"] for job in http.get(IMAGE_JOBS).json()["data"]] == made[:0:-1]
        assert http.get(f"{IMAGE_JOBS}/{made[0]}").status_code == 404
        # the job states on /metrics follow the history (the removed job has left them)
        assert metric(http, "layerstream_jobs", 'status="completed"') == 2
        assert metric(http, "layerstream_queue_wait_seconds_count") >= 3
        from PIL import Image

        settings_png = http.get(f"{IMAGE_JOBS}/{made[2]}/content").content
        (tmp_path / "out.png").write_bytes(settings_png)
        assert read_output_metadata(tmp_path / "out.png")["prompt"] == "fox 2"
        assert Image.open(tmp_path / "out.png").text["prompt"] == "fox 2"


def test_one_server_per_data_folder_and_bad_retention_flags(retaining, layerstream_cli, monkeypatch):
    """The second server is this process's command line (which opens the history before loading anything)."""
    import layerstream.omni

    _, data = retaining
    monkeypatch.setattr(layerstream.omni, "Omni", _must_not_load)
    second = layerstream_cli("serve", "tiny-flux", "--port", "0", "--data-dir", str(data))
    assert second.returncode != 0 and "--data-dir" in second.stderr and "in use by another running server" in second.stderr
    for flag in ("--max-jobs", "--max-output-bytes"):
        bad = layerstream_cli("serve", "tiny-flux", flag, "0")
        assert bad.returncode != 0 and f"{flag} = 0 is not valid" in bad.stderr, bad.stderr


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model loaded before the error")

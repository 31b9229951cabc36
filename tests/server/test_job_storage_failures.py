"""A job always ends, whatever fails after its generation, and a job that cannot be stored is refused saying why.

Real failures, not mocks: an output folder on a filesystem that has run out of space (ENOSPC: a small tmpfs,
filled) or is read-only (EROFS: a read-only tmpfs; EACCES: the folder's mode, where the test is not root), a job
database whose trigger refuses the write, and a data folder on a full tmpfs at creation. Mounting needs root
(CAP_SYS_ADMIN): elsewhere the full-disk tests skip, saying so (no other way makes a real ENOSPC: a file-size
limit gives EFBIG, /dev/full cannot stand in for a folder). The app runs in this process (FastAPI's test client)
on tiny-flux.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

JOBS = "/v1/images/jobs"
BODY = {"prompt": "a fox", "size": "64x64", "num_inference_steps": 1, "seed": 1}  # a PNG of ~12 KB


@pytest.fixture(scope="module")
def omni():
    from layerstream.omni import Omni

    omni = Omni("tiny-flux", device="cpu")
    yield omni
    omni.close()


@contextlib.contextmanager
def _served(omni, data_dir: Path):
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.jobs.store import JobStore
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=data_dir)))
    with TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1") as client:
        yield client


def _ended(client, job_id: str) -> dict:
    deadline = time.monotonic() + 120  # catches a job that never ends
    while (job := client.get(f"{JOBS}/{job_id}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"the job never ended: {job}"
        time.sleep(0.05)
    return job


def _mount_tmpfs(path: Path, size_bytes: int, *options: str) -> str | None:
    """Mount a tmpfs of `size_bytes` at `path`: None once mounted, else why it cannot be."""
    if os.geteuid() != 0:
        return "not root: mounting a tmpfs needs root (CAP_SYS_ADMIN)"
    mount = ["mount", "-t", "tmpfs", "-o", ",".join([f"size={size_bytes}", *options]), "tmpfs", str(path)]
    done = subprocess.run(mount, capture_output=True, text=True)
    return None if done.returncode == 0 else f"mount exited {done.returncode}: {done.stderr.strip()}"


def _unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=True)


@contextlib.contextmanager
def _unwritable(folder: Path, how: str) -> Iterator[int]:
    """`folder` made unwritable for real, "full" (a tmpfs filled: ENOSPC) or "read-only" (a read-only tmpfs as
    root: EROFS; else the folder's mode: EACCES); yields the errno a write there gets. Skips where it cannot."""
    if how == "read-only" and os.geteuid() != 0:
        folder.chmod(0o555)  # root would write through the mode bits
        try:
            yield errno.EACCES
        finally:
            folder.chmod(0o755)
        return
    why_not = _mount_tmpfs(folder, 4096, *(["ro"] if how == "read-only" else []))
    if why_not:
        real = "ENOSPC" if how == "full" else "EROFS"
        pytest.skip(f"no {how} filesystem to write to here, so no real {real}: {why_not}")
    try:
        if how == "full":
            _fill(folder)
        yield errno.ENOSPC if how == "full" else errno.EROFS
    finally:
        _unmount(folder)


def _fill(folder: Path) -> Path:
    """Write one file into `folder` until its filesystem has no space left; the file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


@pytest.mark.parametrize("how", ["full", "read-only"])
def test_a_job_whose_output_cannot_be_written_fails_saying_so_and_the_server_goes_on(omni, tmp_path, how):
    data = tmp_path / "data"
    outputs = data / "outputs"
    outputs.mkdir(parents=True)
    with _unwritable(outputs, how) as error_number, _served(omni, data) as client:
        job = client.post(JOBS, json=BODY).json()
        ended = _ended(client, job["id"])
        assert ended["status"] == "failed" and ended["error"]["code"] == "output_write_failed", ended
        assert "its output could not be written" in ended["error"]["message"]
        assert os.strerror(error_number) in ended["error"]["message"]  # the filesystem's own refusal
        assert client.get(f"{JOBS}/{job['id']}").json()["status"] == "failed"  # stored: it stays failed
        assert [p.name for p in outputs.iterdir() if p.name.startswith(job["id"])] == []  # no partial file
        assert "could not be written" in client.get("/health").json()["jobs_storage"]
        assert str(tmp_path) not in client.get("/health").text + ended["error"]["message"]
        assert client.get("/health").status_code == 200
    with _served(omni, data) as client:  # writable again: the same server code completes the next job
        job = client.post(JOBS, json=BODY).json()
        assert _ended(client, job["id"])["status"] == "completed"
        assert client.get("/health").json()["jobs_storage"] == "ok"


def test_a_job_whose_row_the_database_refuses_fails_and_leaves_no_file(omni, tmp_path):
    data = tmp_path / "data"
    with _served(omni, data) as client:
        refusing = sqlite3.connect(data / "jobs.sqlite3")
        with refusing:  # the database itself refuses to record any job as ended
            refusing.execute(
                "CREATE TRIGGER refuse BEFORE UPDATE ON jobs WHEN NEW.status IN ('completed', 'failed') "
                "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
            )
        job = client.post(JOBS, json=BODY).json()
        ended = _ended(client, job["id"])
        assert ended["status"] == "failed" and ended["error"]["code"] == "database_error", ended
        assert "refused by the test" in ended["error"]["message"]
        assert list((data / "outputs").iterdir()) == []  # the file no row names was removed
        listed = {item["id"]: item for item in client.get(JOBS).json()["data"]}
        assert listed[job["id"]]["status"] == "failed"  # the list says so too
        with refusing:
            refusing.execute("DROP TRIGGER refuse")
        refusing.close()
        again = client.post(JOBS, json=BODY).json()
        assert _ended(client, again["id"])["status"] == "completed"  # the server kept serving
        assert client.get(f"{JOBS}/{again['id']}/content").status_code == 200


def test_a_job_a_full_data_folder_cannot_store_is_refused_and_health_says_so(omni, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    why_not = _mount_tmpfs(data, 1 << 20)
    if why_not:
        pytest.skip(f"no small filesystem to fill here, so no real ENOSPC: {why_not}")
    try:
        with _served(omni, data) as client:
            filler = _fill(data)
            refused = client.post(JOBS, json=BODY)
            assert refused.status_code == 507, refused.text
            error = refused.json()["error"]
            assert error["code"] == "data_folder_full" and "is full" in error["message"] and "--data-dir" in error["message"]
            assert str(tmp_path) not in refused.text  # the setting is named, the path is in the log only
            assert "is full" in client.get("/health").json()["jobs_storage"] and str(tmp_path) not in client.get("/health").text
            assert client.get(JOBS).json()["data"] == []  # nothing stored
            filler.unlink()
            job = client.post(JOBS, json=BODY)
            assert job.status_code == 200, job.text
            assert _ended(client, job.json()["id"])["status"] == "completed"
            assert client.get("/health").json()["jobs_storage"] == "ok"
    finally:
        _unmount(data)

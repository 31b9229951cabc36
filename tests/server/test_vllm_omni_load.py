"""`benchmarks/vllm_omni_load.py` against served tiny models, in this process: every request of every vllm-omni
shape succeeds (the job API as JSON, multipart and url-encoded forms, each polled and downloaded; the
synchronous video endpoint; the image endpoint), two at a time. Times are not asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_omni_load.py"


@pytest.fixture(scope="module")
def load_module():
    spec = importlib.util.spec_from_file_location("vllm_omni_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _served(model: str, data_dir: Path):
    from layerstream.omni import Omni
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.jobs.store import JobStore
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    omni = Omni(model, device="cpu")
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=data_dir)))
    return omni, TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1")


@pytest.mark.parametrize("model, num_requests", [("tiny-wan", 8), ("tiny-flux", 4)])
def test_every_vllm_omni_shaped_request_succeeds(load_module, model, num_requests, tmp_path):
    omni, app = _served(model, tmp_path)
    try:
        with app as client:
            report = load_module.run_load(client, num_requests=num_requests, concurrency=2, timeout=120)
    finally:
        omni.close()
    assert report.num_failed == 0, report.failures
    shapes = load_module.VIDEO_SHAPES if model == "tiny-wan" else load_module.IMAGE_SHAPES
    assert set(report.shapes) == set(shapes) and sum(report.shapes.values()) == num_requests

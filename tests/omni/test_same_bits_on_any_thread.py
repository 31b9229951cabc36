"""One request, the same pixels through every entry point and on every thread, with 1 and with 2 intra-op threads.

A thread other than the one that called `torch.set_num_threads` computes its first matrix products with one
thread per core until it adopts the process's count (`layerstream.compute_threads`); on some CPUs MKL's sgemm
rounds differently then (on the AMD EPYC, a product of 5 to 11 rows). The model is a Flux of 256 channels at
32x48 pixels (6 image tokens: its embedding is such a product, and the raw output of 1 and 2 threads differ
there); the request runs through `Omni` on the main thread and on a new one, the `generate` command, and the server's
synchronous endpoint and its job API (in this process: its worker is a thread of this process too).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import time

import numpy as np
import pytest
import torch

from tests.same_threading import on_new_thread

PROMPT, SEED, HEIGHT, WIDTH, STEPS = "a red fox in the snow", 7, 32, 48, 2


@contextlib.contextmanager
def _intra_op_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@pytest.fixture(scope="module")
def wide_flux(tmp_path_factory):
    """tiny-flux with a 256-channel transformer (4 heads of 64), saved as a diffusers folder."""
    from diffusers import FluxTransformer2DModel

    from layerstream.models.tiny import build_tiny_pipeline

    pipeline = build_tiny_pipeline("tiny-flux")
    torch.manual_seed(0)
    pipeline.transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=64, num_attention_heads=4,
        joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 24, 24),
    )
    folder = tmp_path_factory.mktemp("wide-flux")
    pipeline.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def served(wide_flux, tmp_path_factory):
    from fastapi.testclient import TestClient

    from layerstream.omni import Omni
    from layerstream.server.app import create_app
    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.jobs.store import JobStore
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings

    omni = Omni(str(wide_flux), device="cpu")
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path_factory.mktemp("data"))))
    try:
        with TestClient(create_app(service, jobs, ui=False), base_url="http://127.0.0.1") as client:
            yield omni, client
    finally:
        omni.close()


def _job_pixels(client, body: dict) -> np.ndarray:
    job = client.post("/v1/images/jobs", json=body).json()
    deadline = time.monotonic() + 120  # catches a hang only
    while (job := client.get(f"/v1/images/jobs/{job['id']}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["status"] == "completed", job
    return _pixels(client.get(f"/v1/images/jobs/{job['id']}/content").content)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_request_gives_the_same_pixels_through_every_edge_and_thread(served, wide_flux, threads, layerstream_cli, tmp_path):
    omni, client = served
    request = dict(prompt=PROMPT, seed=SEED, height=HEIGHT, width=WIDTH, num_inference_steps=STEPS)
    body = {"prompt": PROMPT, "seed": SEED, "size": f"{WIDTH}x{HEIGHT}", "num_inference_steps": STEPS}
    with _intra_op_threads(threads):
        on_main = omni.generate(**request, keep_raw=True)
        main = on_main.frames[0]
        assert main.std() > 0  # a picture, not a constant
        on_thread = on_new_thread(lambda: omni.generate(**request, keep_raw=True))
        assert np.array_equal(on_thread.raw, on_main.raw)  # the float output too, before rounding to pixels
        results = {"Omni on another thread": on_thread.frames[0]}
        output = tmp_path / "fox.png"
        cli = layerstream_cli(
            "generate", "--model", str(wide_flux), "--device", "cpu", "--prompt", PROMPT, "--seed", str(SEED),
            "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", str(STEPS), "--output", str(output),
        )
        assert cli.returncode == 0, cli.stderr
        results["generate"] = _pixels(output.read_bytes())
        sync = client.post("/v1/images/generations", json=body)
        assert sync.status_code == 200, sync.text
        results["the synchronous endpoint"] = _pixels(base64.b64decode(sync.json()["data"][0]["b64_json"]))
        results["a job"] = _job_pixels(client, body)
    differ = [edge for edge, pixels in results.items() if not np.array_equal(pixels, main)]
    assert not differ, f"with {threads} intra-op thread(s), {differ} computed other pixels than Omni on the main thread"


PRODUCT_SHAPES = [(6, 256, 1024), (16, 1024, 256), (32, 1024, 256), (64, 1024, 64)]
"""(rows, inner, outputs) of `linear` products tried for the control: the first differs between 1 and 2 threads on
the AMD EPYC (MKL's sgemm of 5 to 11 rows), the others on the Intel Xeon (16 rows and more, an inner 1,024 split
between the threads)."""


def _product_a_new_thread_computes_differently() -> tuple[torch.Tensor, torch.Tensor] | None:
    """The control: (rows, weight) of a product whose bits differ between the main thread at 1 intra-op thread
    and a new thread that has not adopted that count (one thread per core), or None where every one tried gives
    the same bits on this CPU."""
    g = torch.Generator().manual_seed(0)
    with _intra_op_threads(1):
        for rows, inner, outputs in PRODUCT_SHAPES:
            x, weight = torch.randn(rows, inner, generator=g), torch.randn(outputs, inner, generator=g)
            on_main = torch.nn.functional.linear(x, weight)
            if not torch.equal(on_new_thread(lambda: torch.nn.functional.linear(x, weight)), on_main):
                return x, weight
    return None


def _cpu_name() -> str:
    import platform

    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


@pytest.mark.fast
def test_a_new_thread_that_adopts_the_process_threads_computes_the_main_threads_bits():
    from layerstream.pipeline_runner import adopt_process_threads

    control = _product_a_new_thread_computes_differently()
    if control is None:
        pytest.skip(f"on this CPU ({_cpu_name()}, {os.cpu_count()} cores) a new thread computes every product of "
                    f"{PRODUCT_SHAPES} with the main thread's bits: the test could not fail here")  # fmt: skip
    rows, weight = control
    for threads in (1, 2):
        with _intra_op_threads(threads):
            expected = torch.nn.functional.linear(rows, weight)

            def adopted():
                adopt_process_threads()
                return torch.nn.functional.linear(rows, weight)

            assert torch.equal(on_new_thread(adopted), expected)

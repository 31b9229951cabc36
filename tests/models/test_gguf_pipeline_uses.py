"""A transformer from a GGUF file keeps working where a folder's does: a batch of outputs in one pipeline call
(the tiny Wan 2.2 with a GGUF expert), and a server's job (an in-process job manager on the tiny Flux from a
GGUF file), each matched against the same file's pipeline and against the folder's weights it replaces."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("gguf")

from layerstream import Omni  # noqa: E402
from layerstream.models import ensure_tiny_model  # noqa: E402
from tests.models.single_files import wan_original_keys, write_gguf  # noqa: E402

DIT = {"mode": "layer", "components": ["dit"]}
PROMPTS, SEEDS = ["a red fox", "a grey cat", "a grey cat"], [1, 7, 8]
VIDEO = dict(height=32, width=32, num_frames=5, num_inference_steps=2)


def _wan_gguf_expert(tmp_path) -> dict[str, str]:
    from diffusers import WanTransformer3DModel

    state = WanTransformer3DModel.from_pretrained(ensure_tiny_model("tiny-wan"), subfolder="transformer_2").state_dict()
    path = tmp_path / "low.gguf"
    assert set(write_gguf(path, wan_original_keys(state), {".ffn.": "Q8_0", "": "Q4_0"}).values()) == {"Q8_0", "Q4_0"}
    return {"transformer_2": str(path)}


def _batch(omni: Omni) -> list[np.ndarray]:
    return [r.raw for r in omni.generate_batch(PROMPTS, seeds=SEEDS, **VIDEO, keep_raw=True)]


def test_a_batch_on_a_streamed_gguf_expert_matches_the_resident_batch_and_each_request_alone(tmp_path):
    components = _wan_gguf_expert(tmp_path)
    streamed = Omni(model="tiny-wan", diffusion_offload_config=DIT, device="cpu", components=components)
    resident = Omni(model="tiny-wan", diffusion_offload_config=DIT, device="cpu", components=components, offload=False)
    folder = Omni(model="tiny-wan", diffusion_offload_config=DIT, device="cpu")
    try:
        batch = _batch(streamed)
        assert type(streamed.pipeline.transformer_2.blocks[0].ffn.net[2].weight).__name__ == "GGUFParameter"
        alone = [streamed.generate(p, seed=s, **VIDEO, keep_raw=True).raw for p, s in zip(PROMPTS, SEEDS)]
        resident_batch, folder_batch = _batch(resident), _batch(folder)
    finally:
        for omni in (streamed, resident, folder):
            omni.close()
    for b, r, single, f in zip(batch, resident_batch, alone, folder_batch):
        assert np.array_equal(b, r)  # streamed as the file's bytes: the resident pipeline's bits
        # one by one on the same pipeline: a batched matmul may round the last bits differently, never more
        assert np.abs(b - single).max() < 1e-4
        assert np.abs(b - f).max() > 1e-3  # the file's quantized weights, not the folder's
    assert not np.array_equal(batch[1], batch[2])  # one prompt, two seeds: two outputs


def test_a_server_job_on_a_gguf_transformer_completes_with_omnis_output(tmp_path):
    from diffusers import FluxTransformer2DModel

    from layerstream.server.jobs.manager import JobManager
    from layerstream.server.jobs.requests import ImageJobRequest
    from layerstream.server.jobs.settings import HistorySettings
    from layerstream.server.jobs.store import JobStore
    from layerstream.server.service import GenerationService
    from layerstream.server.settings import ServeSettings
    from tests.server.jobs_harness import png_pixels

    state = FluxTransformer2DModel.from_pretrained(ensure_tiny_model("tiny-flux"), subfolder="transformer").state_dict()
    path = tmp_path / "flux.gguf"
    write_gguf(path, state, {"ff": "Q4_0", "": "Q8_0"}, arch="flux")
    components = {"transformer": str(path)}
    shape = dict(height=32, width=32, num_inference_steps=2, seed=5)
    expected = Omni("tiny-flux", DIT, device="cpu", components=components, offload=False).generate("a red fox", **shape)
    folder = Omni("tiny-flux", DIT, device="cpu").generate("a red fox", **shape)
    assert not np.array_equal(expected.frames, folder.frames)  # the file's weights make another image

    omni = Omni("tiny-flux", DIT, device="cpu", components=components)
    service = GenerationService(omni, ServeSettings(port=0, shutdown_timeout=0))
    jobs = JobManager(service, JobStore(HistorySettings(data_dir=tmp_path / "data")))
    service.start()
    try:
        body = ImageJobRequest(prompt="a red fox", size="32x32", num_inference_steps=2, seed=5)
        job_id = jobs.create(body, None)["id"]
        while jobs.get(job_id)["status"] not in ("completed", "failed"):
            time.sleep(0.05)
        assert jobs.get(job_id)["status"] == "completed", jobs.get(job_id)["error"]
        served, media_type, _ = jobs.content(job_id)
        assert media_type == "image/png"
        pixels = png_pixels(served.read_bytes()).numpy()
        jobs.release_content(served)
    finally:
        assert service.stop()
        jobs.close()
        omni.close()
    assert np.array_equal(pixels, expected.frames[0])

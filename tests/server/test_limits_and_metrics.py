"""Model rules read from pipelines, request checks against them, and the metrics text format."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from layerstream.models.geometry import pipeline_max_frames, pipeline_max_side, pipeline_size_multiple
from layerstream.models.model_rules import ModelRules
from layerstream.models.output_limits import OutputGeometry
from layerstream.server.errors import ApiError
from layerstream.server.limits import ModelLimits, check_endpoint, check_request
from layerstream.server.metrics import JobOutcome, QueueState, ServerMetrics
from layerstream.server.schemas import ImageGenerationRequest, VideoGenerationRequest

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast


def _pipeline(spatial_attr, spatial, patch_size, processor_factor):
    transformer = SimpleNamespace(config=SimpleNamespace(patch_size=patch_size))
    processor = SimpleNamespace(config=SimpleNamespace(vae_scale_factor=processor_factor))
    return SimpleNamespace(**{spatial_attr: spatial}, transformer=transformer, image_processor=processor)


@pytest.mark.parametrize(
    "pipeline, expected",
    [
        (_pipeline("vae_scale_factor_spatial", 8, (1, 2, 2), 8), 16),  # Wan 2.1/2.2 A14B
        (_pipeline("vae_scale_factor_spatial", 16, (1, 2, 2), 16), 32),  # Wan 2.2 TI2V-5B
        (_pipeline("vae_scale_factor", 8, 1, 16), 16),  # Flux: 2x2 packing declared by the image processor
        (_pipeline("vae_scale_factor", 8, 2, 16), 16),  # Qwen-Image
    ],
)
def test_size_multiple_from_the_pipeline(pipeline, expected):
    assert pipeline_size_multiple(pipeline) == expected


def _rules(model, kind, *, frame_multiple, default_num_frames, takes, image_input="none", size=(64, 64)):
    geometry = OutputGeometry(size_multiple=16, frame_multiple=frame_multiple, max_side_pixels=None, max_frames=None)
    return ModelRules(
        model=model, pipeline_class="Stand-in", kind=kind, geometry=geometry, image_input=image_input,
        default_width=size[0], default_height=size[1], default_num_frames=default_num_frames,
        default_num_inference_steps=4, default_guidance_scale=None, fps=16, takes=frozenset(takes),
    )  # fmt: skip


WAN = ModelLimits(
    rules=_rules("tiny-wan", "video", frame_multiple=4, default_num_frames=9, takes={"negative_prompt"}),
    max_frames=13, max_side_pixels=256, max_latent_positions=None, max_work=10**9,
)  # fmt: skip


def _problems(request) -> dict[str, str]:
    with pytest.raises(ApiError) as info:
        check_request(request, WAN)
    assert info.value.status == 400
    return {d.param: d.allowed for d in info.value.details}


def _wan_like(*rope_max_seq_lens):
    experts = {
        name: SimpleNamespace(config=SimpleNamespace(patch_size=(1, 2, 2), rope_max_seq_len=n))
        for name, n in zip(("transformer", "transformer_2"), rope_max_seq_lens)
    }
    return SimpleNamespace(vae_scale_factor_spatial=8, vae_scale_factor_temporal=4, **experts)


def test_largest_size_and_frames_the_transformer_can_position():
    # tiny-wan: 64 rotary positions per axis, 8x VAE x 2x2 patches -> 1024 px; 4x temporal -> 63 * 4 + 1 frames
    assert (pipeline_max_side(_wan_like(64)), pipeline_max_frames(_wan_like(64))) == (1024, 253)
    assert pipeline_max_side(_wan_like(1024, 32)) == 512  # two experts: the smaller table binds
    flux_like = _pipeline("vae_scale_factor", 8, 1, 16)  # positions computed from ids: no table, no limit
    assert pipeline_max_side(flux_like) is None and pipeline_max_frames(flux_like) is None


def test_a_size_beyond_the_model_grid_names_the_limit():
    limits = dataclasses.replace(WAN, max_side_pixels=1024, max_latent_positions=64)
    with pytest.raises(ApiError) as info:
        check_request(VideoGenerationRequest(prompt="fox", size="2048x2048"), limits)
    detail = info.value.details[0]
    assert info.value.status == 400 and detail.param == "size"
    assert "to 1024" in detail.allowed and "64 latent tokens per axis" in detail.allowed
    check_request(VideoGenerationRequest(prompt="fox", size="1024x64"), limits)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"num_inference_steps": 1000}, "num_inference_steps"),
        ({"n": 4, "num_inference_steps": 8}, "n"),  # n=4 asks 4x the default, steps 2x
        ({"n": 2}, "n"),  # n alone: two outputs are twice the work of one
        ({"size": "256x256", "num_inference_steps": 8}, "size"),
        ({"num_frames": 13, "num_inference_steps": 5}, "num_frames"),  # 13/9 of the default frames, 5/4 of the steps
    ],
)
def test_more_work_than_the_cap_names_the_field_that_asks_most(fields, named):
    from layerstream.server.limits import request_price

    default = request_price(VideoGenerationRequest(prompt="fox"), WAN)
    assert (default.pixels, default.num_frames, default.forwards) == (64 * 64, 9, 4 * 2)  # guidance 4: two passes a step
    limits = dataclasses.replace(WAN, max_work=default.work)  # exactly the default request
    check_request(VideoGenerationRequest(prompt="fox"), limits)
    with pytest.raises(ApiError) as info:
        check_request(VideoGenerationRequest(prompt="fox", **fields), limits)
    detail = info.value.details[0]
    assert info.value.status == 400 and detail.param == named
    assert "--max-work" in detail.allowed and f"{default.work:,}" in detail.allowed


def test_wrong_endpoint_names_what_the_model_makes():
    with pytest.raises(ApiError) as info:
        check_endpoint(WAN, "image")
    assert info.value.status == 400 and "makes videos" in info.value.message and "/v1/videos/generations" in info.value.message
    check_endpoint(WAN, "video")


@pytest.mark.parametrize("num_frames", [1, 5, 9, 13])
def test_frames_following_the_rule_pass(num_frames):
    check_request(VideoGenerationRequest(prompt="fox", num_frames=num_frames, size="32x48"), WAN)


def test_every_bad_field_is_named_with_what_is_allowed():
    problems = _problems(VideoGenerationRequest(prompt="fox", size="30x32", num_frames=6, model="other"))
    assert set(problems) == {"size", "num_frames", "model"}
    assert "multiple of 16" in problems["size"]
    assert "num_frames - 1 a multiple of 4" in problems["num_frames"] and "to 13" in problems["num_frames"]
    assert _problems(VideoGenerationRequest(prompt="fox", num_frames=17)).keys() == {"num_frames"}  # over --max-frames
    assert _problems(VideoGenerationRequest(prompt="fox", size="512x64")).keys() == {"size"}  # over the side cap


def test_image_request_on_image_model():
    flux = ModelLimits(
        rules=_rules("tiny-flux", "image", frame_multiple=None, default_num_frames=None, takes={"true_cfg_scale"}),
        max_frames=129, max_side_pixels=2048, max_latent_positions=None, max_work=10**9,
    )  # fmt: skip
    check_request(ImageGenerationRequest(prompt="fox", size="64x32"), flux)
    with pytest.raises(ApiError) as info:
        check_request(ImageGenerationRequest(prompt="fox", negative_prompt="blur"), flux)
    assert info.value.param == "negative_prompt"


def test_metrics_text_is_well_formed():
    metrics = ServerMetrics()
    metrics.observe_request("/health", 200, 0.01)
    metrics.observe_job(queue_seconds=0.5, seconds=1.5, num_outputs=2, outcome=JobOutcome.OK)
    offload = SimpleNamespace(
        bytes_transferred=10, num_transfers=2, num_sync_loads=0, stall_seconds=0.25, device_bytes=5, host_bytes=7,
        pinned_host_bytes=7, slot_bytes=4, max_materialized_blocks=2, disk_bytes_read=9, disk_stall_seconds=0.125,
        host_pool_bytes=3, disk_staging_bytes=6,
    )  # fmt: skip
    state = QueueState(depth=1, max_waiting=4, running=True, num_submitted=3, num_started=2)
    text = metrics.render(queue=state, offload=offload, labels={"model": 'odd"name', "kind": "image", "device": "cpu"})
    sample = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)+\})? \S+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    assert 'layerstream_requests_total{endpoint="/health",status="200"} 1.0' in text
    assert 'layerstream_server_info{device="cpu",kind="image",model="odd\\"name"} 1.0' in text
    assert "layerstream_streamed_bytes_total 10.0" in text and "layerstream_stall_seconds_total 0.25" in text
    assert "layerstream_disk_read_bytes_total 9.0" in text and "layerstream_disk_stall_seconds_total 0.125" in text
    assert "layerstream_host_pool_bytes 3.0" in text and "layerstream_disk_staging_bytes 6.0" in text
    assert 'layerstream_generations_total{outcome="ok"} 2.0' in text and "layerstream_queue_depth 1.0" in text


def _served_wan(device: str):
    """Wan 2.2 T2V A14B's rules (832x480, 81 frames, 50 steps) as `read_model_limits` reads them, on `device`."""
    from layerstream.server.limits import read_model_limits
    from layerstream.server.settings import ServeSettings

    rules = dataclasses.replace(
        _rules("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "video", frame_multiple=4, default_num_frames=81, takes={"negative_prompt"}, size=(832, 480)),
        default_num_inference_steps=50,
    )
    from layerstream.models.hub import ModelSource

    source = ModelSource(rules.model, Path("unused"), "hub")
    omni = SimpleNamespace(rules=rules, pipeline=None, device=device, source=source)  # only read: no CUDA call is made
    return read_model_limits(omni, ServeSettings())


VLLM_OMNI_WAN_CLIENT = {"prompt": "a fox", "size": "832x480", "num_frames": 33, "fps": 16, "num_inference_steps": 40, "seed": 42}
"""vllm-omni's Wan 2.2 curl client's generation (2 s at 16 fps: 33 frames), as the synchronous body states it."""


def test_the_work_cap_fits_the_device_a_gpu_server_takes_the_models_own_generation():
    gpu, cpu = _served_wan("cuda:0"), _served_wan("cpu")
    own = VideoGenerationRequest.model_validate({"prompt": "a fox", "size": "832x480", "num_frames": 81, "num_inference_steps": 50})
    client = VideoGenerationRequest.model_validate(VLLM_OMNI_WAN_CLIENT)
    for request in (own, client):
        check_request(request, gpu)  # taken on an accelerator by default
        with pytest.raises(ApiError) as refused:
            check_request(request, cpu)  # minutes of a 2-core CPU: refused there, naming --max-work
        assert "--max-work" in str(refused.value.details or refused.value.message)
    # the size and frame caps at 50 steps, two passes a step (guidance), two texts (the prompt, the negative one)
    assert cpu.max_work == 100_000_000 and gpu.max_work == 2048 * 2048 * 129 * 50 * 2 + 2 * 512 * 1024

"""One set of model rules: `Omni`, `generate`, the synchronous endpoint and a job resolve the same defaults.

For every embedded tiny model, and for the same model saved as an ordinary diffusers folder (which has its
pipeline's real-size defaults: Wan's 50 steps), the four entry points build their requests their own way;
what reaches the pipeline's call must be the same, and so must the frame rate the output is encoded at.
"""

from __future__ import annotations

import argparse
import functools
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
from PIL import Image

from layerstream.cli.generate_cmd import add_arguments, request_from_args
from layerstream.models.model_rules import FRAME_RATES, read_model_rules
from layerstream.models.tiny import TINY_MODELS, ensure_tiny_model
from layerstream.omni import Omni
from layerstream.request import GenerationError, GenerationRequest
from layerstream.server.jobs.requests import ImageJobRequest, VideoJobRequest
from layerstream.server.schemas import ImageGenerationRequest, VideoGenerationRequest
from layerstream.server.service import GenerationService
from layerstream.server.settings import ServeSettings

# a unit or contract test: in `make test-fast` (no process, no socket; tests/conftest.py checks)
pytestmark = pytest.mark.fast

PROMPT = "a red fox"
_NOT_COMPARED = ("generator", "callback_on_step_end", "image")  # a fresh generator each; the image is the same one


class _Called(Exception):
    """Raised by the recorded call instead of running the pipeline: only its arguments are wanted."""


def _call_arguments(monkeypatch, omni: Omni, request: GenerationRequest) -> dict:
    """The keyword arguments `omni.run(request)` calls its pipeline with (the pipeline does not run)."""
    seen: list[dict] = []
    original = type(omni.pipeline).__call__

    @functools.wraps(original)  # keeps the signature Omni reads
    def record(self, *args, **kwargs):
        seen.append(kwargs)
        raise _Called

    with monkeypatch.context() as patch:
        patch.setattr(type(omni.pipeline), "__call__", record)
        with pytest.raises(_Called):
            omni.run(request)
    return {name: value for name, value in seen[0].items() if name not in _NOT_COMPARED}


def _cli_request(model: str, image_path) -> GenerationRequest:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", model, "--prompt", PROMPT] + (["--image", str(image_path)] if image_path else [])
    args = parser.parse_args(argv)
    image = Image.open(image_path).convert("RGB") if image_path else None
    return request_from_args(args, image=image)


@pytest.mark.parametrize("saved", [False, True], ids=["tiny", "saved-folder"])
@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_every_entry_point_resolves_the_same_defaults(monkeypatch, tmp_path, name, saved):
    model = str(ensure_tiny_model(name)) if saved else name
    omni = Omni(model, offload=False)
    rules = omni.rules
    image = Image.new("RGB", (48, 32), (200, 40, 40)) if rules.image_input == "required" else None
    image_path = None
    if image is not None:
        image_path = tmp_path / "input.png"
        image.save(image_path)
    service = GenerationService(omni, ServeSettings(port=0, max_work=10**12))  # a real-size default is much work
    video = rules.kind == "video"
    sync_body = VideoGenerationRequest(prompt=PROMPT) if video else ImageGenerationRequest(prompt=PROMPT)
    job_body = (VideoJobRequest if video else ImageJobRequest)(prompt=PROMPT)

    requests = {
        "Omni": GenerationRequest(prompt=PROMPT, image=image),
        "generate": _cli_request(model, image_path),
        "synchronous": service.prepare(sync_body, image).request,
        "job": service.prepare(job_body.generation_body(service.limits), image).request,
    }
    calls = {where: _call_arguments(monkeypatch, omni, request.outputs()[0]) for where, request in requests.items()}
    assert all(call == calls["Omni"] for call in calls.values()), calls
    if video:
        assert {where: request.fps or rules.fps for where, request in requests.items()} == dict.fromkeys(requests, rules.fps)

    steps = calls["Omni"]["num_inference_steps"]
    if saved:  # a real model's own default: the pipeline's __call__ says it (WanPipeline: 50)
        assert steps == inspect.signature(type(omni.pipeline).__call__).parameters["num_inference_steps"].default
    else:
        assert steps == TINY_MODELS[name].default_kwargs["num_inference_steps"]


def test_frame_rates_and_optional_fields_follow_the_pipeline():
    def call(self, prompt, num_frames=121, num_inference_steps=40, guidance_scale=3.0):
        pass

    ltx = type("LTXPipeline", (), {"__call__": call})()
    rules = read_model_rules(ltx, "a/ltx")
    assert (rules.fps, rules.kind, rules.default_num_inference_steps, rules.default_guidance_scale) == (24, "video", 40, 3.0)
    assert rules.takes == frozenset() and FRAME_RATES["LTXPipeline"] == 24
    assert rules.refused_fields({"negative_prompt": "blur", "flow_shift": 3.0, "boundary_ratio": None}) == [
        "negative_prompt",
        "flow_shift",
    ]


def test_wan22_takes_vllm_omnis_fields_and_flux_refuses_them_naming_the_pipeline():
    wan = Omni("tiny-wan", offload=False)
    assert wan.rules.takes == {"negative_prompt", "guidance_scale_2", "boundary_ratio", "flow_shift"}
    flux = Omni("tiny-flux", offload=False)
    assert "true_cfg_scale" in flux.rules.takes and "boundary_ratio" not in flux.rules.takes
    with pytest.raises(GenerationError, match="boundary_ratio is not valid for tiny-flux: FluxPipeline has no second expert"):
        flux.generate(PROMPT, boundary_ratio=0.5)
    with pytest.raises(GenerationError, match="flow_shift is not valid for tiny-flux: FluxPipeline's scheduler"):
        flux.generate(PROMPT, flow_shift=3.0)


@pytest.mark.parametrize("model", ["tiny-wan", "tiny-flux", "tiny-wan-i2v"])
def test_the_skeleton_reads_the_optional_fields_as_the_loaded_pipeline_does(model):
    """The skeleton carries the pipeline's own settings from model_index.json (Wan 2.2's boundary_ratio), so
    `generate` refuses a field the model cannot take before any weight is read."""
    from layerstream.models.loading import load_skeleton

    skeleton, _ = load_skeleton(model)
    assert read_model_rules(skeleton, model).takes == Omni(model, offload=False).rules.takes


def test_generate_refuses_a_second_experts_field_before_loading(layerstream_cli, tmp_path, monkeypatch):
    from layerstream.models import loading

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded for a field its configs refuse")

    monkeypatch.setattr(loading, "load_model", load_model)
    Image.new("RGB", (48, 32), (200, 40, 40)).save(tmp_path / "input.png")
    image = str(tmp_path / "input.png")
    result = layerstream_cli("generate", "tiny-wan-i2v", "--image", image, "--guidance-scale-2", "2")
    assert result.returncode == 2, result.stderr
    assert result.error_lines == [
        "layerstream: error: --guidance-scale-2 is not valid for tiny-wan-i2v: WanImageToVideoPipeline has no second "
        "expert (a boundary_ratio in its config and a transformer_2)"
    ]


def test_per_request_settings_reach_the_call_and_are_restored_after_it(monkeypatch):
    omni = Omni("tiny-wan", offload=False)
    seen = []
    original = type(omni.pipeline).__call__

    @functools.wraps(original)
    def record(self, *args, **kwargs):
        seen.append(SimpleNamespace(ratio=self.config.boundary_ratio, shift=self.scheduler.config.flow_shift, kwargs=kwargs))
        if len(seen) == 2:
            raise RuntimeError("a failing call restores them too")
        return original(self, *args, **kwargs)

    ratio, shift, scheduler = omni.pipeline.config.boundary_ratio, omni.pipeline.scheduler.config.flow_shift, omni.pipeline.scheduler
    monkeypatch.setattr(type(omni.pipeline), "__call__", record)
    omni.generate(PROMPT, boundary_ratio=0.5, flow_shift=5.0, guidance_scale_2=2.0, num_inference_steps=2)
    with pytest.raises(RuntimeError, match="restores them too"):
        omni.generate(PROMPT, boundary_ratio=0.25, flow_shift=7.0, num_inference_steps=2)
    assert [(s.ratio, s.shift) for s in seen] == [(0.5, 5.0), (0.25, 7.0)]
    assert seen[0].kwargs["guidance_scale_2"] == 2.0
    assert omni.pipeline.config.boundary_ratio == ratio and omni.pipeline.scheduler is scheduler
    assert scheduler.config.flow_shift == shift


def test_defaults_geometry_and_image_presence_are_decided_by_the_rules_alone():
    """The one place each is decided: `filled` (a request's figures, the model's for the rest), `check_geometry`
    with a caller's caps (the server's), `image_problem` (each entry point only words it)."""
    from layerstream.models.loading import load_pipeline

    rules = read_model_rules(load_pipeline("tiny-wan"), "tiny-wan")
    shape = rules.filled(height=64)
    assert (shape.height, shape.width, shape.num_frames, shape.num_inference_steps) == (
        64, rules.default_width, rules.default_num_frames, rules.default_num_inference_steps
    )  # fmt: skip
    assert rules.check_geometry(height=64, width=64, num_frames=5) == []
    assert [v.name for v in rules.check_geometry(height=65, width=64, num_frames=6)] == ["height", "num_frames"]
    capped = rules.check_geometry(height=256, width=64, num_frames=9, max_side_pixels=128, max_frames=5)
    assert [(v.name, v.allowed) for v in capped] == [("height", "an integer from 1 to 128"), ("num_frames", "an integer from 1 to 5")]
    assert rules.image_problem(has_image=True) == "takes_none" and rules.image_problem(has_image=False) is None
    i2v = read_model_rules(load_pipeline("tiny-wan-i2v"), "tiny-wan-i2v")
    assert i2v.image_problem(has_image=False) == "required" and i2v.image_problem(has_image=True) is None


# --- extra_params: what each family declares, and vllm-omni's sample_solver -------------------------------------


def _pipeline(class_name: str, scheduler: Any = None):
    """A stand-in pipeline of `class_name` whose ``__call__`` takes what Flux's does (annotations play no part)."""

    def call(self, prompt, prompt_2=None, sigmas=None, max_sequence_length=256, joint_attention_kwargs=None, ip_adapter_image_embeds=None):
        pass

    return type(class_name, (), {"__call__": call, "scheduler": scheduler})()


def test_extra_params_are_what_the_family_declares_and_the_call_and_scheduler_take():
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    from layerstream.models.call_arguments import declared_arguments

    flux = declared_arguments(_pipeline("FluxPipeline", FlowMatchEulerDiscreteScheduler()))
    # declared and in the call; never ip_adapter_image_embeds (in the call, declared nowhere)
    assert set(flux) == {"prompt_2", "sigmas", "max_sequence_length", "joint_attention_kwargs"}
    assert flux["max_sequence_length"].high == 256  # the call's own default caps it
    assert "sigmas" not in declared_arguments(_pipeline("FluxPipeline", DDIMScheduler()))  # its set_timesteps takes none
    assert declared_arguments(_pipeline("SomePipeline")) == {}  # no family: nothing
    from layerstream.models.loading import load_pipeline

    wan = read_model_rules(load_pipeline("tiny-wan"), "tiny-wan")
    assert set(wan.call_arguments) == {"max_sequence_length", "attention_kwargs"}


def test_extra_params_problems_name_the_key_and_what_is_taken():
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    from layerstream.models.tiny_components import _wan_scheduler

    rules = read_model_rules(_pipeline("WanPipeline", _wan_scheduler()), "a/some")
    assert dict(rules.sample_solvers) == {
        "unipc": "UniPCMultistepScheduler", "euler": "FlowMatchEulerDiscreteScheduler", "dpm++": "DPMSolverMultistepScheduler"
    }  # fmt: skip
    assert rules.extra_params_problems({"sample_solver": " Euler ", "max_sequence_length": 8}, num_inference_steps=2) == []
    problems = rules.extra_params_problems({"sample_solver": "heun", "max_sequence_length": 4096, "shift": 3}, num_inference_steps=2)
    assert [(p.name, p.allowed) for p in problems] == [
        ("extra_params.sample_solver", "one of 'unipc', 'euler', 'dpm++' (any case)"),
        ("extra_params.max_sequence_length", "an integer from 1 to 256"),
        ("extra_params.shift", "one of the keys WanPipeline takes: max_sequence_length, sample_solver"),
    ]  # fmt: skip
    flux = read_model_rules(_pipeline("FluxPipeline", FlowMatchEulerDiscreteScheduler()), "a/some")
    assert dict(flux.sample_solvers) == {"euler": "FlowMatchEulerDiscreteScheduler"}  # only its own name
    taken = {"prompt_2": "a fox", "sigmas": [1.0, 0.5], "joint_attention_kwargs": {"scale": 0.5}}
    assert flux.extra_params_problems(taken, num_inference_steps=2) == []
    hostile = {
        "prompt_2": ["a", "b"], "sigmas": [1e308, 0.5], "joint_attention_kwargs": {"hidden_states": 1},
        "ip_adapter_image_embeds": [1], "attention_mask": [[1, 0]],
    }  # fmt: skip
    named = {p.name: p.allowed for p in flux.extra_params_problems(hostile, num_inference_steps=2)}
    assert named["extra_params.prompt_2"] == "a text of at most 10,000 characters"
    assert named["extra_params.sigmas"].startswith("an array of 2 numbers (one per step, num_inference_steps), strictly decreasing")
    assert named["extra_params.joint_attention_kwargs"] == "an object with only the keys scale (a number from 0 to 10)"
    assert named["extra_params.ip_adapter_image_embeds"].startswith("one of the keys FluxPipeline takes: joint_attention_kwargs,")
    assert set(named) == {f"extra_params.{key}" for key in hostile}
    for wrong in ([0.5, 1.0], [1.0, 0.0], [1.0]):  # rising, at zero, one short
        assert flux.extra_params_problems({"sigmas": wrong}, num_inference_steps=2), wrong
    assert flux.extra_params_problems({"prompt_2": "x" * 10_001}, num_inference_steps=2)
    assert flux.extra_params_problems({"joint_attention_kwargs": {"scale": float("inf")}}, num_inference_steps=2)
    (problem,) = read_model_rules(_pipeline("WanPipeline", DDIMScheduler()), "a/some").extra_params_problems(
        {"sample_solver": "euler"}, num_inference_steps=2
    )
    assert problem.allowed.startswith("no sample_solver: WanPipeline's scheduler has no counterpart")


def test_extra_params_reach_the_call_and_a_solver_lasts_one_call():
    """On the tiny Wan: ``{}`` makes the same bits as none; a passed argument and a mapped solver change the
    output; the served scheduler is back after the call (the next request makes the first one's bits)."""
    omni = Omni("tiny-wan", offload=False)
    served = omni.pipeline.scheduler
    first = omni.generate(PROMPT, keep_raw=True).raw
    assert (omni.generate(PROMPT, keep_raw=True, extra_params={}).raw == first).all()
    assert (omni.generate(PROMPT, keep_raw=True, extra_params={"sample_solver": "UniPC"}).raw == first).all()  # the served one
    for extra_params in ({"sample_solver": "euler"}, {"sample_solver": "dpm++"}, {"max_sequence_length": 8}):
        assert (omni.generate(PROMPT, keep_raw=True, extra_params=extra_params).raw != first).any(), extra_params
        assert omni.pipeline.scheduler is served
    assert (omni.generate(PROMPT, keep_raw=True).raw == first).all()
    with pytest.raises(GenerationError, match=r"^extra_params.sample_solver = 'heun' is not valid; expected one of 'unipc'"):
        omni.generate(PROMPT, extra_params={"sample_solver": "heun"})
    batch = omni.generate_batch([PROMPT, "a cat"], seeds=[0, 1], extra_params={"sample_solver": "euler"}, keep_raw=True)
    assert len(batch) == 2 and omni.pipeline.scheduler is served


class _Injected(Exception):
    """The failure injected into a call."""


def test_per_request_settings_never_touch_the_served_pipeline_even_when_the_call_fails(monkeypatch):
    """A request's scheduler (sample_solver, flow_shift) and VAE view are its call's alone: during the call the
    served pipeline keeps its own (and its VAE its decode setting), and a failure at any point (a transformer
    forward, a scheduler step, the decode) leaves the next request's output bit for bit as before."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from layerstream.models.decode.decode_memory import VaeDecodeSettings

    omni = Omni("tiny-wan", offload=False)
    served, config = omni.pipeline.scheduler, dict(omni.pipeline.config)
    first = omni.generate(PROMPT, keep_raw=True).raw
    seen = []

    def forward_hook(module, args):
        seen.append(omni.pipeline.scheduler is served and dict(omni.pipeline.config) == config)

    omni.pipeline.transformer.register_forward_pre_hook(forward_hook)

    def fail(*args, **kwargs):
        raise _Injected

    points = {
        "forward": lambda patch: omni.pipeline.transformer.register_forward_pre_hook(lambda *_: fail()),
        "scheduler step": lambda patch: patch.setattr(FlowMatchEulerDiscreteScheduler, "step", fail),
        "decode": lambda patch: patch.setattr(type(omni.pipeline.vae), "decode", fail),
    }
    for point, inject in points.items():
        with monkeypatch.context() as patch:  # the class patches of this point only
            patch.setattr(omni.runner, "vae_settings", VaeDecodeSettings(vae_use_tiling=True))  # a VAE view too
            handle = inject(patch)
            with pytest.raises(_Injected):
                omni.generate(PROMPT, flow_shift=3.0, extra_params={"sample_solver": "euler"})
            if handle is not None:
                handle.remove()
        assert omni.pipeline.scheduler is served and dict(omni.pipeline.config) == config, point
        assert not omni.pipeline.vae.use_tiling, point
        assert (omni.generate(PROMPT, keep_raw=True).raw == first).all(), point
    assert seen and all(seen)  # during every call, the served pipeline had its own scheduler and config

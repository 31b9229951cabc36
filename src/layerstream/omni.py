"""`Omni`: load a pipeline on the host, enable offload, and generate.

    omni = Omni(model="tiny-wan", diffusion_offload_config={"mode": "layer", "components": ["dit"]})
    result = omni.generate("a red fox in the snow", num_inference_steps=4, seed=0)
    result.save("fox.gif")

Components load on the host; `enable_offload` then moves the resident parts to the device and packs the
streamed blocks into the host store, so the whole model is never on the device at once. `Omni` is a facade:
loading is `models.loading`, a request's call of the pipeline `pipeline_runner.PipelineRunner`, what a model
accepts `models.model_rules`, and the files an output makes `outputs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from layerstream.config.offload_config import OffloadConfig, parse_offload_config
from layerstream.models.generation_size import RequestSizes
from layerstream.models.hub import ModelSource
from layerstream.models.input_image import ImageInputKind, ImageSource
from layerstream.models.model_rules import ModelRules, read_model_rules
from layerstream.models.output_limits import DEFAULT_MAX_SIDE_PIXELS
from layerstream.offload import default_device, enable_offload
from layerstream.outputs import IMAGE_SUFFIXES, VIDEO_SUFFIXES, GenerationResult, save_output
from layerstream.pipeline_runner import PipelineRunner, RunStats, batch_requests, request_options
from layerstream.request import GenerationError, GenerationRequest
from layerstream.runtime.modes.handle import OffloadHandle
from layerstream.runtime.reporting.stats import OffloadStats

__all__ = ["DEFAULT_CONFIG", "GenerationError", "GenerationResult", "IMAGE_SUFFIXES", "Omni", "RunStats", "VIDEO_SUFFIXES", "save_output"]

DEFAULT_CONFIG = {"mode": "layer", "components": ["dit"]}


class Omni:
    """A pipeline loaded from a Hugging Face Hub id, a local diffusers folder or an embedded tiny model, with
    offload enabled. A Hub id is downloaded into huggingface_hub's cache first (`revision` pins a branch, tag
    or commit; `variant` picks weights such as ``"fp16"``, as diffusers names them)."""

    def __init__(
        self,
        model: str | ModelSource = "tiny-wan",
        diffusion_offload_config: OffloadConfig | dict | str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        *,
        simulated_link_gbps: float | None = None,
        trace: bool = False,
        offload: bool = True,
        process_group=None,
        revision: str | None = None,
        variant: str | None = None,
        requests: RequestSizes | None = None,  # what will be asked for: the host reserve of "auto" is sized to it
    ):
        from layerstream.models.generation_size import generation_size_for
        from layerstream.models.launched_group import join_launched_group
        from layerstream.models.loading import component_dtypes, load_pipeline, pipeline_kind, resolve_model

        # parse before loading: a bad config is reported before any weight is read
        self.config = parse_offload_config(diffusion_offload_config if diffusion_offload_config is not None else DEFAULT_CONFIG)
        self.model = model.model if isinstance(model, ModelSource) else model
        self.device = join_launched_group(self.config, device, process_group) or (torch.device(device) if device is not None else default_device())
        self.dtype = _parse_dtype(dtype)
        self.source = model if isinstance(model, ModelSource) else resolve_model(model, revision=revision, variant=variant)
        """Where the model's files came from (a Hub id's revision and commit, or the folder)."""
        self.pipeline = load_pipeline(self.source, dtype=self.dtype)
        self.kind = pipeline_kind(self.pipeline)
        self._component_dtypes = component_dtypes(self.pipeline)  # before enabling: blocks still hold weights
        self.rules: ModelRules = read_model_rules(self.pipeline, self.model)
        """What the model accepts and its defaults (size, frames, steps, guidance, frame rate)."""
        self.image_input: ImageInputKind = self.rules.image_input
        """Whether the pipeline takes an input image: ``"none"``, ``"optional"`` or ``"required"``."""
        self.handle: OffloadHandle | None = None
        self.runner = PipelineRunner(self.pipeline, self.rules, self.device, self.stats)
        if offload:
            self.handle = enable_offload(
                self.pipeline,
                self.config,
                self.device,
                simulated_link_gbps=simulated_link_gbps,
                trace=trace,
                process_group=process_group,  # allgather's group (None: the default group)
                generation=generation_size_for(self.rules, requests),  # the largest generation (default: the model's)
            )
        else:
            self.pipeline.to(self.device)
        _quiet_progress(self.pipeline)

    def generate(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        *,
        image: ImageSource | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int = 0,
        fps: int | None = None,
        on_step: Callable[[int, int, float], None] | None = None,
        max_side_pixels: int | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Run the pipeline once; `on_step(step, total, seconds)` after every denoising step. The arguments are
        `GenerationRequest`'s (`options`: ``guidance_scale_2``, ``true_cfg_scale``, ``boundary_ratio``,
        ``flow_shift``); None takes the model's default (`rules`). `image` (a PIL image, a path or an array)
        conditions models that take one; without a size the output takes the image's, scaled to fit the
        model's largest side and `max_side_pixels` (default 2048), rounded down to its size multiple (the
        result's `size_note` says how). Everything is checked before the pipeline runs."""
        max_side_pixels = max_side_pixels if max_side_pixels is not None else DEFAULT_MAX_SIDE_PIXELS
        request = GenerationRequest(
            prompt=prompt, negative_prompt=negative_prompt, image=image, height=height, width=width,
            num_frames=num_frames, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
            seed=seed, fps=fps, max_side_pixels=max_side_pixels, **request_options(options),
        )  # fmt: skip
        return self.run(request, on_step=on_step)

    def run(
        self,
        request: GenerationRequest,
        *,
        on_step: Callable[[int, int, float], None] | None = None,
        on_latents: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> GenerationResult:
        """Make the one output of `request` (``n = 1``); see `PipelineRunner.run`."""
        return self.runner.run(request, on_step=on_step, on_latents=on_latents)

    def generate_batch(
        self,
        prompts: Sequence[str],
        negative_prompt: str | None = None,
        *,
        seeds: Sequence[int],
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        fps: int | None = None,
        on_step: Callable[[int, int, float], None] | None = None,
        **options: Any,
    ) -> list[GenerationResult]:
        """One pipeline call for several outputs: output ``i`` from ``prompts[i]`` and its own generator seeded
        with ``seeds[i]``, all of one shape; each streamed block crosses the link once per step for the whole
        batch. See `PipelineRunner.run_batch` for what is equal to `generate` and what may differ."""
        shape = GenerationRequest(
            prompt="", negative_prompt=negative_prompt, height=height, width=width, num_frames=num_frames,
            num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, fps=fps, **request_options(options),
        )  # fmt: skip
        return self.run_batch(batch_requests(shape, prompts, seeds), on_step=on_step)

    def run_batch(
        self, requests: Sequence[GenerationRequest], *, on_step: Callable[[int, int, float], None] | None = None
    ) -> list[GenerationResult]:
        """One pipeline call for every output of `requests`; see `generate_batch` and `PipelineRunner.run_batch`."""
        return self.runner.run_batch(requests, on_step=on_step)

    def component_dtypes(self) -> dict[str, str]:
        """The dtype each model component computes in (``"bfloat16"``): the dtype holding most of its weight
        bytes as loaded (diffusers keeps a few norms of some models in float32 on purpose)."""
        return dict(self._component_dtypes)

    def stats(self) -> OffloadStats | None:
        """Offload counters since enable. Not safe to call from another thread while a generation runs."""
        return self.handle.stats() if self.handle is not None else None

    def close(self) -> None:
        with self.runner.lock:  # after a generation in another thread, never under it
            if self.handle is not None:
                self.handle.disable()
                self.handle = None


def _quiet_progress(pipeline) -> None:
    if hasattr(pipeline, "set_progress_bar_config"):
        pipeline.set_progress_bar_config(disable=True)  # layerstream reports progress itself, per step


def _parse_dtype(dtype) -> torch.dtype | None:
    """`dtype` as a torch dtype: None, a torch dtype, or its name (``"bfloat16"``, ``"bf16"``...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise GenerationError(f"dtype = {dtype!r} is not valid; allowed: {', '.join(names)}")
    return names[dtype]

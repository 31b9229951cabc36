"""`Omni`, a facade (docs/python.md shows it in use): load a pipeline on the host (`models.loading`), enable
offload, and generate (`pipeline_runner.PipelineRunner`); torchrun's group is joined where the config asks for
allgather (`distributed.launched_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from layerstream.config.offload_config import OffloadConfig, parse_offload_config, with_vae_settings
from layerstream.models.decode.decode_memory import VaeDecodeSettings
from layerstream.models.size import GenerationSize, SizeCaps
from layerstream.models.hub import ModelSource
from layerstream.models.input_image import ImageInputKind
from layerstream.models.model_rules import ModelRules
from layerstream.models.work import WorkPrice, price_request
from layerstream.offload import default_device, enable_offload
from layerstream.outputs import IMAGE_SUFFIXES, VIDEO_SUFFIXES, GenerationResult, request_settings, save_output
from layerstream.pipeline_runner import PipelineRunner, RunStats, batch_requests, parse_dtype
from layerstream.errors import extra_needed
from layerstream.models.request_fields import OMNI_KEYWORDS
from layerstream.request import GenerationError, GenerationRequest, request_from
from layerstream.runtime.modes.handle import OffloadHandle
from layerstream.runtime.reporting.stats import OffloadStats

__all__ = ["DEFAULT_CONFIG", "GenerationError", "GenerationResult", "IMAGE_SUFFIXES", "Omni", "RunStats", "VIDEO_SUFFIXES", "save_output"]

DEFAULT_CONFIG = {"mode": "layer", "components": ["dit"]}


class Omni:
    """A pipeline loaded from a Hugging Face Hub id (into its cache first, at `revision`, in weights `variant`),
    a local diffusers folder or an embedded tiny model, with `components` from their own files (a GGUF or
    fp8_scaled transformer), with offload enabled (docs/python.md)."""

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
        # what will be asked for: the host reserve of "auto" is sized to it
        requests: GenerationSize | SizeCaps | None = None,
        vae_use_tiling: bool | str | None = None,  # None: the config's (default "auto"); see docs/configuration.md
        vae_use_slicing: bool | str | None = None,
        components: dict[str, str] | None = None,  # component name -> a file loaded in its place (GGUF, fp8_scaled)
    ):
        from layerstream.distributed.launched_group import join_launched_group
        from layerstream.models.generation_size import generation_size_for
        from layerstream.models.loading import load_model  # here: importing layerstream loads no diffusers

        # parse before loading: a bad config is reported before any weight is read
        config = parse_offload_config(diffusion_offload_config if diffusion_offload_config is not None else DEFAULT_CONFIG)
        self.config = with_vae_settings(config, vae_use_tiling=vae_use_tiling, vae_use_slicing=vae_use_slicing)
        self.device = join_launched_group(self.config, device, process_group) or (torch.device(device) if device is not None else default_device())
        self.dtype = parse_dtype(dtype)
        with extra_needed("Omni"):  # the core install has no diffusers: one line naming the extra
            loaded = load_model(model, dtype=self.dtype, revision=revision, variant=variant, components=components)
        self.model, self.pipeline, self.kind = loaded.name, loaded.pipeline, loaded.kind
        self._component_dtypes = loaded.component_dtypes
        self.source: ModelSource = loaded.source  # a Hub id's revision and commit, or the folder
        self.rules: ModelRules = loaded.rules  # what the model accepts and its defaults
        self.image_input: ImageInputKind = self.rules.image_input
        self.runner = PipelineRunner(self.pipeline, self.rules, self.device, self.stats, VaeDecodeSettings.of(self.config))
        self.handle: OffloadHandle | None = None
        if not offload:
            self.pipeline.to(self.device)
            return
        self.handle = enable_offload(
            self.pipeline, self.config, self.device, simulated_link_gbps=simulated_link_gbps, trace=trace,
            process_group=process_group,  # allgather's group (None: the default group)
            generation=generation_size_for(self.rules, requests),  # the largest generation (default: the model's)
        )  # fmt: skip

    def generate(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        *,
        on_step: Callable[[int, int, float], None] | None = None,
        keep_raw: bool = False,
        **fields: Any,
    ) -> GenerationResult:
        """Run the pipeline once with `GenerationRequest`'s fields as keywords (`OMNI_KEYWORDS`), checked before
        the run; `on_step(step, total, seconds)` after every step; `keep_raw`: keep the float output as `raw`
        (docs/python.md)."""
        if fields.get("max_side_pixels", 0) is None:  # None: the request's default, as the keyword always meant
            del fields["max_side_pixels"]
        request = request_from(fields, OMNI_KEYWORDS, prompt=prompt, negative_prompt=negative_prompt)
        return self.run(request, on_step=on_step, keep_raw=keep_raw)

    def run(
        self,
        request: GenerationRequest,
        *,
        on_step: Callable[[int, int, float], None] | None = None,
        on_latents: Callable[[int, int, torch.Tensor], None] | None = None,
        keep_raw: bool = False,
    ) -> GenerationResult:
        """Make the one output of `request` (``n = 1``), with its `settings`; see `PipelineRunner.run`."""
        result = self.runner.run(request, on_step=on_step, on_latents=on_latents, keep_raw=keep_raw)
        result.settings = self._settings(request, result)
        return result

    def generate_batch(
        self,
        prompts: Sequence[str],
        negative_prompt: str | None = None,
        *,
        seeds: Sequence[int],
        on_step: Callable[[int, int, float], None] | None = None,
        keep_raw: bool = False,
        **fields: Any,
    ) -> list[GenerationResult]:
        """One pipeline call for outputs of one shape (output ``i``: ``prompts[i]``, seeded ``seeds[i]``)."""
        per_output = {"prompt", "seed", "image", "max_side_pixels"}  # a batch takes no input image (`run` does)
        shape = request_from(fields, OMNI_KEYWORDS - per_output, prompt="", negative_prompt=negative_prompt)
        return self.run_batch(batch_requests(shape, prompts, seeds), on_step=on_step, keep_raw=keep_raw)

    def run_batch(
        self,
        requests: Sequence[GenerationRequest],
        *,
        on_step: Callable[[int, int, float], None] | None = None,
        keep_raw: bool = False,
    ) -> list[GenerationResult]:
        """One pipeline call for every output of `requests`; see `generate_batch` and `PipelineRunner.run_batch`."""
        results = self.runner.run_batch(requests, on_step=on_step, keep_raw=keep_raw)
        for result, output in zip(results, [output for request in requests for output in request.outputs()]):
            result.settings = self._settings(output, result)
        return results

    def _settings(self, request: GenerationRequest, result: GenerationResult) -> dict[str, Any]:
        """What makes `result` again, as a job's output carries it: the request with the model's defaults filled
        in (the size as made: an input image may have set it), the model and the offload config."""
        shape = self.rules.filled(num_frames=request.num_frames, num_inference_steps=request.num_inference_steps)
        height, width = result.frames.shape[1:3]
        video = result.kind == "video"
        made = replace(
            request, height=height, width=width, num_frames=shape.num_frames if video else None,
            num_inference_steps=shape.num_inference_steps, fps=result.fps if video else None,
        )  # fmt: skip
        revision = self.source.to_dict().get("revision")
        has_image = request.image is not None
        settings = request_settings(made, has_input_image=has_image, model_revision=revision, model_commit=self.source.commit)
        return {**settings, "model": self.model, "offload_config": self.config.to_dict()}

    def price(self, request: GenerationRequest) -> WorkPrice:
        """What `request` costs this model: the price a server's work cap compares (`models.work`)."""
        return price_request(self.rules, request, max_side_pixels=request.max_side_pixels)

    def component_dtypes(self) -> dict[str, str]:
        """The dtype each component computes in (``"bfloat16"``)."""
        return dict(self._component_dtypes)

    def stats(self) -> OffloadStats | None:
        """Offload counters since enable. Not safe to call from another thread while a generation runs."""
        return self.handle.stats() if self.handle is not None else None

    def close(self) -> None:
        with self.runner.lock:  # after a generation in another thread, never under it
            if self.handle is not None:
                self.handle.disable()
                self.handle = None

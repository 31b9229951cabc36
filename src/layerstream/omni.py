"""`Omni`: load a pipeline on the host, enable offload, and generate.

    omni = Omni(model="tiny-wan", diffusion_offload_config={"mode": "layer", "components": ["dit"]})
    result = omni.generate("a red fox in the snow", num_inference_steps=4, seed=0)
    result.save("fox.gif")

Components load on the host; `enable_offload` then moves the resident parts to the device and packs the
streamed blocks into the host store, so the whole model is never on the device at once.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from layerstream.config.offload_config import OffloadConfig, parse_offload_config
from layerstream.models.hub import ModelSource
from layerstream.models.input_image import ImageInputKind, ImageSource
from layerstream.models.model_rules import ModelRules, read_model_rules
from layerstream.models.output_limits import DEFAULT_MAX_SIDE_PIXELS
from layerstream.offload import default_device, enable_offload
from layerstream.request import GenerationError, GenerationRequest, invalid_field
from layerstream.runtime.modes.handle import OffloadHandle
from layerstream.runtime.reporting.stats import OffloadStats

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = {"mode": "layer", "components": ["dit"]}
IMAGE_SUFFIXES = (".png",)
VIDEO_SUFFIXES = (".mp4", ".gif")


@dataclass
class RunStats:
    """What one `generate` call cost."""

    seconds: float
    step_seconds: list[float]
    bytes_transferred: int
    num_transfers: int
    num_sync_loads: int
    stall_seconds: float
    device_bytes: int
    host_bytes: int
    peak_device_bytes: int | None = None
    disk_bytes_read: int = 0
    """Bytes the disk tier (`host_budget_gb`) read during the call."""
    disk_stall_seconds: float = 0.0
    """Of the stall, the time compute waited on disk reads."""

    @property
    def seconds_per_step(self) -> float:
        """Median step time: the first step also carries prompt encoding and warm-up, so a mean would mislead."""
        return float(np.median(self.step_seconds)) if self.step_seconds else self.seconds


@dataclass
class GenerationResult:
    """Frames (video: [F, H, W, 3]) or images ([N, H, W, 3]) as uint8, with the run's statistics."""

    kind: str
    frames: np.ndarray
    stats: RunStats
    fps: int = 16
    """Video: the frame rate it is saved at (the request's, else the model's)."""
    raw: Any = field(default=None, repr=False)
    """The pipeline's float output before conversion to uint8 (for exact comparisons)."""
    size_note: str | None = None
    """With an input image: how the output size was reached (``"48x32: the input image's 50x35, rounded down
    to multiples of 16"``); None without one."""

    def save(self, path: str | Path) -> Path:
        return save_output(self, path)


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
    ):
        from layerstream.models.loading import load_pipeline, pipeline_kind, resolve_model

        # parse before loading: a bad config is reported before any weight is read
        self.config = parse_offload_config(diffusion_offload_config if diffusion_offload_config is not None else DEFAULT_CONFIG)
        self.model = model.model if isinstance(model, ModelSource) else model
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = _parse_dtype(dtype)
        self.source = model if isinstance(model, ModelSource) else resolve_model(model, revision=revision, variant=variant)
        """Where the model's files came from (a Hub id's revision and commit, or the folder)."""
        self.pipeline = load_pipeline(self.source, dtype=self.dtype)
        self.kind = pipeline_kind(self.pipeline)
        self._component_dtypes = _component_dtypes(self.pipeline)  # before enabling: blocks still hold weights
        self.rules: ModelRules = read_model_rules(self.pipeline, self.model)
        """What the model accepts and its defaults (size, frames, steps, guidance, frame rate)."""
        self.image_input: ImageInputKind = self.rules.image_input
        """Whether the pipeline takes an input image: ``"none"``, ``"optional"`` or ``"required"``."""
        self.handle: OffloadHandle | None = None
        self._run_lock = threading.Lock()
        if offload:
            self.handle = enable_offload(
                self.pipeline,
                self.config,
                self.device,
                simulated_link_gbps=simulated_link_gbps,
                trace=trace,
                process_group=process_group,  # allgather's group (None: the default group)
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
        """Run the pipeline once. `on_step(step, total, seconds)` is called after every denoising step.

        `image` (a PIL image, a path or an array) conditions pipelines that take one (image to video, image
        editing). Without `height` and `width` the output takes the image's size, scaled down to fit the
        model's largest side (and `max_side_pixels`, default 2048) and rounded down to its size multiple; the
        result's `size_note` says how. Everything is checked before the pipeline runs. The arguments are those
        of `GenerationRequest` (`options`: its others, such as ``guidance_scale_2``, ``true_cfg_scale``,
        ``boundary_ratio`` and ``flow_shift``); None takes the model's default (`rules`). This builds one
        request and `run`s it.
        """
        request = GenerationRequest(
            prompt=prompt,
            negative_prompt=negative_prompt,
            image=image,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            seed=seed,
            fps=fps,
            max_side_pixels=max_side_pixels if max_side_pixels is not None else DEFAULT_MAX_SIDE_PIXELS,
            **_request_options(options),
        )
        return self.run(request, on_step=on_step)

    def run(
        self,
        request: GenerationRequest,
        *,
        on_step: Callable[[int, int, float], None] | None = None,
        on_latents: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> GenerationResult:
        """Make the one output of `request` (``n = 1``; run each of `request.outputs()` for more, or `run_batch`).

        `on_latents(step, total, latents)`, after `on_step`, sees the pipeline's latents after each step (to
        read, never to change: previews). What depends on the model (image input, size multiples, frame rule,
        reach) is checked here, before the pipeline runs; the request checked the rest when it was built."""
        if request.n != 1:
            raise invalid_field("n", request.n, "1: run makes one output; run each of request.outputs(), or run_batch([request])")
        picture, conditioned = self._input_image(request)
        if conditioned is not None:
            request = replace(request, height=conditioned.height, width=conditioned.width)
            if (picture.width, picture.height) != (request.width, request.height):
                # condition on the image at the output size, as image-to-video pipelines do themselves: an
                # editing pipeline would otherwise encode a large input at its full size
                picture = picture.resize((request.width, request.height), _lanczos())
        kwargs, num_inference_steps = self._pipeline_kwargs(request, request.prompt, picture=picture)
        kwargs["generator"] = torch.Generator("cpu").manual_seed(request.seed)
        output, stats = self._run_pipeline(request, kwargs, num_inference_steps, on_step, on_latents)
        raw = _output_array(output, self.kind)
        note = conditioned.note if conditioned is not None else None
        fps = request.fps or self.rules.fps
        return GenerationResult(kind=self.kind, frames=_to_uint8(raw), stats=stats, fps=fps, raw=raw, size_note=note)

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
        """Run the pipeline once for several outputs: output ``i`` from ``prompts[i]`` and its own generator
        seeded with ``seeds[i]``; all share the size, frames, steps, guidance and negative prompt.

        Every streamed block is copied to the device once per step for the whole batch instead of once per
        output, which is where a transfer-bound model gains throughput. The initial noise of each output is
        the same as `generate` with its seed (diffusers draws one latent per generator), but the pipeline's
        matrices have a batch dimension, so an output may differ from `generate`'s in the last bits; the same
        prompts and seeds, in the same order, give the same outputs. Each result's `stats` is the whole call's
        (the same object for all). Image-conditioned generation takes one image per call: use `generate`.
        One `GenerationRequest` per output, run by `run_batch`.
        """
        prompts, seeds = list(prompts), list(seeds)
        if not prompts or len(prompts) != len(seeds):
            raise GenerationError(
                f"prompts and seeds must be non-empty and of one length (one seed per output); got {len(prompts)} "
                f"prompt(s) and {len(seeds)} seed(s)"
            )
        shape = GenerationRequest(
            prompt="",
            negative_prompt=negative_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            fps=fps,
            **_request_options(options),
        )
        requests = [_batch_output(shape, index, prompt, seed) for index, (prompt, seed) in enumerate(zip(prompts, seeds))]
        return self.run_batch(requests, on_step=on_step)

    def run_batch(
        self, requests: Sequence[GenerationRequest], *, on_step: Callable[[int, int, float], None] | None = None
    ) -> list[GenerationResult]:
        """One pipeline call for every output of `requests`, in order (each request's `n` seeds in turn); they
        must share their `batch_shape()` (everything but prompt, seed, n, fps and timeout), and carry no image
        (pipelines take one image per call: `run` those). See `generate_batch`."""
        requests = list(requests)
        _check_batch(requests)
        if self.image_input == "required":
            raise GenerationError(f"{self.model} generates from an input image, one per call: use generate(image=...)")
        prompts = [request.prompt for request in requests for _ in request.seeds]
        kwargs, num_inference_steps = self._pipeline_kwargs(requests[0], prompts, picture=None)
        if "negative_prompt" in kwargs:  # one per prompt: pipelines differ in how they broadcast a single one
            kwargs["negative_prompt"] = [kwargs["negative_prompt"]] * len(prompts)
        # one generator per output, as diffusers takes them: output i's noise is drawn from generator i alone
        kwargs["generator"] = [torch.Generator("cpu").manual_seed(seed) for request in requests for seed in request.seeds]
        output, stats = self._run_pipeline(requests[0], kwargs, num_inference_steps, on_step)
        raws = iter(_output_arrays(output, self.kind, len(prompts)))
        return [
            GenerationResult(kind=self.kind, frames=_to_uint8(raw), stats=stats, fps=request.fps or self.rules.fps, raw=raw)
            for request in requests
            for raw in (next(raws) for _ in request.seeds)
        ]

    def _pipeline_kwargs(self, request: GenerationRequest, prompt: str | list[str], *, picture) -> tuple[dict[str, Any], int]:
        """(the pipeline's keyword arguments, the step count) for `request`'s shape and `prompt` (its own, or a
        batch's): the model's defaults (`self.rules`) filled in and what depends on the model checked;
        everything but the generator and the step callback."""
        rules = self.rules
        refused = rules.refused_fields(request.to_dict())
        if refused:
            name = refused[0]
            raise GenerationError(f"{name} is not valid for {self.model}: {rules.why_not(name)}", field=name, value=getattr(request, name))
        height = request.height if request.height is not None else rules.default_height
        width = request.width if request.width is not None else rules.default_width
        num_inference_steps = request.num_inference_steps or rules.default_num_inference_steps
        negative_prompt = request.negative_prompt if request.negative_prompt is not None else rules.default_negative_prompt
        num_frames = request.num_frames
        if self.kind == "video" and num_frames is None:
            num_frames = rules.default_num_frames
        if self.kind != "video" and num_frames is not None:
            raise GenerationError(f"num_frames = {num_frames!r} is not valid: {self.model} makes images, not video")
        self._check_geometry(height, width, num_frames)

        call = inspect.signature(self.pipeline.__call__).parameters
        kwargs: dict[str, Any] = {"prompt": prompt, "num_inference_steps": num_inference_steps, "output_type": "np"}
        for name, value in (("height", height), ("width", width), ("num_frames", num_frames)):
            if value is not None and name in call:
                kwargs[name] = value
        if picture is not None:
            kwargs["image"] = picture
        # Flux Kontext rescales any size to `max_area` (default 1024 x 1024) and, with `_auto_resize`, its input
        # image to its preferred resolutions: the size asked for is what it should make, and the image we sized
        if height is not None and width is not None and "max_area" in call:
            kwargs["max_area"] = height * width
        if picture is not None and "_auto_resize" in call:
            kwargs["_auto_resize"] = False
        if negative_prompt is not None:
            kwargs["negative_prompt"] = negative_prompt
        kwargs.update(_guidance_arguments(request, rules, call))
        return kwargs, num_inference_steps

    def _run_pipeline(
        self,
        request: GenerationRequest,
        kwargs: dict[str, Any],
        num_inference_steps: int,
        on_step: Callable[[int, int, float], None] | None,
        on_latents: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> tuple[Any, RunStats]:
        """Call the pipeline with `kwargs` and `request`'s per-request settings (restored after), timing each step
        and calling `on_step` after it; (its output, the cost)."""
        call = inspect.signature(self.pipeline.__call__).parameters
        step_times: list[float] = []
        last = [time.perf_counter()]

        def step_end(pipe, step, timestep, callback_kwargs):
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now
            if on_step is not None:
                on_step(step + 1, num_inference_steps, step_times[-1])
            if on_latents is not None and "latents" in callback_kwargs:  # diffusers hands over "latents" by default
                on_latents(step + 1, num_inference_steps, callback_kwargs["latents"])
            return callback_kwargs

        if "callback_on_step_end" in call:
            kwargs["callback_on_step_end"] = step_end

        # one call at a time: a second thread waits here, before it reads the counters or the pipeline's state
        # (what ran before this point only read the arguments); the raw pipeline refuses instead of waiting
        with self._run_lock:
            before = self.handle.stats() if self.handle is not None else None
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            start = time.perf_counter()
            with torch.inference_mode(), _settings_for(self.pipeline, request):
                output = self.pipeline(**kwargs)
            seconds = time.perf_counter() - start
            after = self.handle.stats() if self.handle is not None else None
        return output, _run_stats(seconds, step_times, before, after, self.device)

    def _input_image(self, request: GenerationRequest):
        """(the RGB image, the size it leads to), or (None, None) without one; refuses an image the pipeline
        does not take, and a missing one it needs, before any work."""
        from layerstream.models.geometry import pipeline_max_side, pipeline_size_multiple
        from layerstream.models.input_image import read_input_image, size_from_image

        pipeline_name = type(self.pipeline).__name__
        image = request.image
        if image is None:
            if self.image_input == "required":
                raise GenerationError(
                    f"image is required: {self.model} ({pipeline_name}) generates from an input image; pass image= "
                    "(a PIL image, a path or an array)"
                )
            return None, None
        if self.image_input == "none":
            raise GenerationError(
                f"image is not valid for {self.model}: {pipeline_name} takes no input image (its __call__ has no "
                "image argument); drop image, or load an image-to-video or image-editing model"
            )
        picture = read_input_image(image)
        model_side = pipeline_max_side(self.pipeline)
        caps = [side for side in (model_side, request.max_side_pixels) if side is not None]
        conditioned = size_from_image(
            picture.size,
            size_multiple=pipeline_size_multiple(self.pipeline),
            max_side=min(caps),
            width=request.width,
            height=request.height,
        )
        return picture, conditioned

    def _check_geometry(self, height, width, num_frames) -> None:
        """Refuse sizes the pipeline would silently round (diffusers rounds down to its latent grid) or that lie
        past the reach of its position table (the model would fail deep inside: "view size is not compatible")."""
        violations = self.rules.check_geometry(height=height, width=width, num_frames=num_frames)
        if violations:
            problem = violations[0]
            raise invalid_field(problem.name, problem.value, f"{problem.allowed} for {self.model}")

    def component_dtypes(self) -> dict[str, str]:
        """The dtype each model component computes in (``"bfloat16"``): the dtype holding most of its weight
        bytes as loaded (diffusers keeps a few norms of some models in float32 on purpose)."""
        return dict(self._component_dtypes)

    def stats(self) -> OffloadStats | None:
        """Offload counters since enable. Not safe to call from another thread while a generation runs."""
        return self.handle.stats() if self.handle is not None else None

    def close(self) -> None:
        with self._run_lock:  # after a generation in another thread, never under it
            if self.handle is not None:
                self.handle.disable()
                self.handle = None


def _component_dtypes(pipeline) -> dict[str, str]:
    from layerstream.models.saved_dtypes import module_dtype

    out = {}
    for name, component in getattr(pipeline, "components", {}).items():
        dtype = module_dtype(component) if isinstance(component, torch.nn.Module) else None
        if dtype is not None:
            out[name] = str(dtype).removeprefix("torch.")
    return out


def _parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise GenerationError(f"dtype = {dtype!r} is not valid; allowed: {', '.join(names)}")
    return names[dtype]


def _batch_output(shape: GenerationRequest, index: int, prompt: str, seed: int) -> GenerationRequest:
    """Output `index` of `generate_batch`: `shape` with its prompt and seed; an error names ``prompts[i]`` or ``seeds[i]``."""
    try:
        return replace(shape, prompt=prompt, seed=seed)
    except GenerationError as e:
        if e.field not in ("prompt", "seed"):
            raise
        raise invalid_field(f"{e.field}s[{index}]", e.value, e.allowed or "") from e


def _check_batch(requests: list[GenerationRequest]) -> None:
    """Refuse requests that cannot run as one pipeline call: none, an image, or two shapes."""
    if not requests:
        raise GenerationError("run_batch needs at least one request")
    for index, request in enumerate(requests):
        if request.image is not None:
            raise GenerationError(f"requests[{index}] has an image: image-conditioned generation takes one image per call; use run")
    shape = requests[0].batch_shape()
    for index, request in enumerate(requests[1:], start=1):
        other = request.batch_shape()
        if other != shape:
            differ = next(name for name, value in shape.to_dict().items() if other.to_dict()[name] != value)
            raise GenerationError(
                f"requests[{index}].{differ} = {getattr(request, differ)!r} differs from requests[0]'s "
                f"{getattr(requests[0], differ)!r}; expected one shape per batch (everything but prompt, seed, n, fps, timeout)"
            )


def _request_options(options: dict[str, Any]) -> dict[str, Any]:
    """`generate`'s extra keywords, which must be `GenerationRequest` fields it has no parameter of its own for."""
    allowed = {"guidance_scale_2", "true_cfg_scale", "boundary_ratio", "flow_shift"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise GenerationError(f"{unknown[0]} is not a generation argument; expected one of {', '.join(sorted(allowed))}", field=unknown[0])
    return options


def _guidance_arguments(request: GenerationRequest, rules: ModelRules, call) -> dict[str, Any]:
    """The guidance scales as the pipeline's call takes them.

    `guidance_scale` is the classifier-free guidance scale: a pipeline that takes CFG through ``true_cfg_scale``
    (its ``guidance_scale`` is a distilled model's embedding input) gets it there, unless the request gives
    ``true_cfg_scale`` itself (vllm-omni's field), in which case each goes to the argument of its name."""
    out: dict[str, Any] = {}
    guidance = request.guidance_scale
    if guidance is None and request.true_cfg_scale is None:
        guidance = rules.default_guidance_scale
    if request.true_cfg_scale is not None:
        out["true_cfg_scale"] = request.true_cfg_scale
        if guidance is not None and "guidance_scale" in call:
            out["guidance_scale"] = guidance
    elif guidance is not None:
        if "true_cfg_scale" in call:
            out["true_cfg_scale"] = guidance
        elif "guidance_scale" in call:
            out["guidance_scale"] = guidance
    if request.guidance_scale_2 is not None:
        out["guidance_scale_2"] = request.guidance_scale_2
    return out


@contextlib.contextmanager
def _settings_for(pipeline, request: GenerationRequest):
    """The request's per-request settings applied to `pipeline` for the call, and restored after it, whatever
    happens: ``boundary_ratio`` (the pipeline's config) and ``flow_shift`` (a scheduler built from the served
    one's config with it; the served scheduler object is put back)."""
    ratio_before = pipeline.config["boundary_ratio"] if request.boundary_ratio is not None else None
    scheduler_before = pipeline.scheduler if request.flow_shift is not None else None
    try:
        if request.boundary_ratio is not None:
            pipeline.register_to_config(boundary_ratio=request.boundary_ratio)
        if scheduler_before is not None:
            pipeline.scheduler = type(scheduler_before).from_config(scheduler_before.config, flow_shift=request.flow_shift)
        yield
    finally:
        if scheduler_before is not None:
            pipeline.scheduler = scheduler_before
        if request.boundary_ratio is not None:
            pipeline.register_to_config(boundary_ratio=ratio_before)


def _lanczos():
    from PIL import Image

    return Image.Resampling.LANCZOS  # what diffusers' image processors resize with


def _quiet_progress(pipeline) -> None:
    if hasattr(pipeline, "set_progress_bar_config"):
        pipeline.set_progress_bar_config(disable=True)  # layerstream reports progress itself, per step


def _output_frames(output) -> np.ndarray:
    """The pipeline's frames (video pipelines) or images, as one array with the batch first."""
    frames = getattr(output, "frames", None)
    if frames is None:
        frames = getattr(output, "images", None)
    if frames is None and isinstance(output, (tuple, list)):
        frames = output[0]
    return np.asarray(frames)


def _output_array(output, kind: str) -> np.ndarray:
    array = _output_frames(output)
    if kind == "video" and array.ndim == 5:
        array = array[0]  # [batch, frames, H, W, C] -> one video
    return array


def _output_arrays(output, kind: str, num_outputs: int) -> list[np.ndarray]:
    """A batched output split into one array per output: [1, H, W, C] images, [F, H, W, C] videos."""
    array = _output_frames(output)
    if len(array) != num_outputs:
        raise GenerationError(f"the pipeline returned {len(array)} outputs for {num_outputs} prompts")
    if kind == "video":
        return [array[i] for i in range(num_outputs)]
    return [array[i : i + 1] for i in range(num_outputs)]


def _to_uint8(array: np.ndarray) -> np.ndarray:
    return (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def _run_stats(seconds, step_times, before: OffloadStats | None, after: OffloadStats | None, device) -> RunStats:
    def delta(name):
        if before is None or after is None:
            return 0
        return getattr(after, name) - getattr(before, name)

    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return RunStats(
        seconds=seconds,
        step_seconds=step_times,
        bytes_transferred=delta("bytes_transferred"),
        num_transfers=delta("num_transfers"),
        num_sync_loads=delta("num_sync_loads"),
        stall_seconds=delta("stall_seconds"),
        device_bytes=after.device_bytes if after else 0,
        host_bytes=after.host_bytes if after else 0,
        peak_device_bytes=peak,
        disk_bytes_read=delta("disk_bytes_read"),
        disk_stall_seconds=delta("disk_stall_seconds"),
    )


def save_output(result: GenerationResult, path: str | Path) -> Path:
    """Write images as PNG and video as MP4 or GIF, chosen by the file suffix.

    The file is written beside `path` under a temporary name and renamed into place once complete (see
    `write_atomically`): an error or Ctrl-C while writing leaves a file already at `path` as it was.
    """
    from layerstream.atomic_write import write_atomically

    path = Path(path)
    suffix = path.suffix.lower()
    allowed = IMAGE_SUFFIXES if result.kind == "image" else VIDEO_SUFFIXES
    if suffix not in allowed:
        raise GenerationError(f"output = {str(path)!r}: a {result.kind} is saved as {' or '.join(allowed)}")
    with write_atomically(path) as partial:
        _encode(result, partial, suffix)
    return path


def _encode(result: GenerationResult, path: Path, suffix: str) -> None:
    # the format is passed explicitly, never read from `path`: a temporary name is not the output's name
    if suffix == ".png":
        from PIL import Image

        Image.fromarray(result.frames[0]).save(path, format="PNG")
    else:
        import imageio.v3 as iio

        if suffix == ".gif":
            iio.imwrite(path, result.frames, extension=".gif", duration=1000 / result.fps, loop=0)
        else:
            iio.imwrite(path, _even_frames(result.frames), extension=".mp4", fps=result.fps, codec="libx264")


def _even_frames(frames: np.ndarray) -> np.ndarray:
    """libx264 with yuv420p needs even width and height: pad by one edge pixel where needed."""
    _, h, w, _ = frames.shape
    return np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")

"""`PipelineRunner`: a `GenerationRequest` made into one call of a diffusers pipeline, and its cost: the call's
arguments from the request and the model's rules, its per-request settings built for that call alone
(`pipeline_for`: its own config, scheduler and VAE view, nothing set on the shared pipeline), each step timed, and
its streaming measured as a difference of the runtime's counters (`StreamCounters`). One call runs at a time.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch

from layerstream.models.decode.decode_memory import VaeDecodeSettings, choose_decode
from layerstream.models.size import GenerationSize
from layerstream.models.model_rules import ModelRules
from layerstream.models.sample_solvers import SAMPLE_SOLVER, scheduler_for
from layerstream.models.decode.vae_tiling import VaeDecodeChoice, vae_for
from layerstream.outputs import GenerationResult
from layerstream.request import GenerationError, GenerationRequest, invalid_field
from layerstream.runtime.reporting.stats import OffloadStats, StreamCounters


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
    vae_decode: VaeDecodeChoice | None = None
    """How the VAE decoded (tiled or not, and why); None for a pipeline without a VAE that tiles."""

    @property
    def seconds_per_step(self) -> float:
        """Median time of the steps after the first: the first carries warm-up (0.63 s against 8 ms for tiny-wan's
        later steps), and a 2-step run's median would be half of it. A 1-step run: that step; none: the call."""
        steady = self.step_seconds[1:] or self.step_seconds
        return float(np.median(steady)) if steady else self.seconds


class PipelineRunner:
    """Runs requests on one loaded pipeline: `model` names it in errors, `read_stats` reads the offload
    counters (None: nothing is offloaded)."""

    def __init__(
        self,
        pipeline,
        rules: ModelRules,
        device: torch.device,
        read_stats: Callable[[], OffloadStats | None],
        vae_settings: VaeDecodeSettings = VaeDecodeSettings(),
    ):
        self.pipeline = pipeline
        self.vae_settings = vae_settings
        """``vae_use_tiling``, ``vae_use_slicing`` and the device memory they weigh the decode against."""
        self.rules = rules
        self.model = rules.model
        self.kind = rules.kind
        self.device = device
        self._read_stats = read_stats
        self.lock = threading.Lock()
        """Held for the whole of a call; a second thread waits on it (and `Omni.close` does)."""

    def run(
        self,
        request: GenerationRequest,
        *,
        on_step: Callable[[int, int, float], None] | None = None,
        on_latents: Callable[[int, int, torch.Tensor], None] | None = None,
        keep_raw: bool = False,
    ) -> GenerationResult:
        """Make the one output of `request` (``n = 1``; run each of `request.outputs()` for more, or `run_batch`).
        The pipeline's float output is kept as the result's `raw` only with `keep_raw` (exact comparisons): else
        the result holds its uint8 frames alone, a quarter of the float bytes.

        `on_latents(step, total, latents)`, after `on_step`, sees the pipeline's latents after each step (to
        read, never to change: previews). What depends on the model (image input, size multiples, frame rule,
        reach) is checked here, before the pipeline runs; the request checked the rest when it was built."""
        if request.n != 1:
            raise invalid_field("n", request.n, "1: run makes one output; run each of request.outputs(), or run_batch([request])")
        picture, conditioned = self._input_image(request)
        if conditioned is not None:
            request = replace(request, height=conditioned.height, width=conditioned.width)
            if (picture.width, picture.height) != (request.width, request.height):
                from PIL import Image

                # condition on the image at the output size, as image-to-video pipelines do themselves: an
                # editing pipeline would otherwise encode a large input at its full size; with Lanczos, as
                # diffusers' image processors resize
                picture = picture.resize((request.width, request.height), Image.Resampling.LANCZOS)
        kwargs, num_inference_steps = self.call_arguments(request, request.prompt, picture=picture)
        kwargs["generator"] = torch.Generator("cpu").manual_seed(request.seed)
        note = conditioned.source if conditioned is not None else None
        return self._results([request], kwargs, num_inference_steps, on_step, on_latents, keep_raw, note)[0]

    def run_batch(
        self,
        requests: Sequence[GenerationRequest],
        *,
        on_step: Callable[[int, int, float], None] | None = None,
        keep_raw: bool = False,
    ) -> list[GenerationResult]:
        """One pipeline call for every output of `requests`, in order (each request's `n` seeds in turn); they
        must share their `batch_shape()` (everything but prompt, seed, n, fps and timeout), and carry no image
        (pipelines take one image per call: `run` those).

        The initial noise of each output is the same as `run` with its seed (diffusers draws one latent per
        generator), but the pipeline's matrices have a batch dimension, so an output may differ from `run`'s
        in the last bits; the same requests in the same order give the same outputs. Each result's `stats` is
        the whole call's (the same object for all)."""
        requests = list(requests)
        _check_batch(requests)
        if self.rules.image_problem(has_image=False) == "required":
            raise GenerationError(f"{self.model} generates from an input image, one per call: use generate(image=...)")
        prompts = [request.prompt for request in requests for _ in request.seeds]
        kwargs, num_inference_steps = self.call_arguments(requests[0], prompts, picture=None)
        for name in PER_PROMPT_ARGUMENTS:  # one per prompt: pipelines differ in how they broadcast a single one
            if isinstance(kwargs.get(name), str):
                kwargs[name] = [kwargs[name]] * len(prompts)
        # one generator per output, as diffusers takes them: output i's noise is drawn from generator i alone
        kwargs["generator"] = [torch.Generator("cpu").manual_seed(seed) for request in requests for seed in request.seeds]
        return self._results(requests, kwargs, num_inference_steps, on_step, None, keep_raw)

    def _results(
        self, requests, kwargs, num_inference_steps, on_step, on_latents, keep_raw, note=None
    ) -> list[GenerationResult]:
        """One result per output of `requests`, from one call of the pipeline with `kwargs`."""
        output, stats = self._call(requests[0], kwargs, num_inference_steps, on_step, on_latents)
        raws = _output_arrays(output, self.kind, sum(request.n for request in requests))
        del output  # the pipeline's own copy of the float frames
        results = []
        for request in requests:
            for _ in request.seeds:
                raw = raws.pop(0)  # each float output goes once its uint8 frames are made (unless kept)
                frames = (np.clip(raw, 0.0, 1.0) * 255.0).round().astype(np.uint8)
                results.append(GenerationResult(
                    kind=self.kind, frames=frames, stats=stats, fps=request.fps or self.rules.fps,
                    raw=raw if keep_raw else None, size_note=note,
                ))  # fmt: skip
        return results

    def call_arguments(self, request: GenerationRequest, prompt: str | list[str], *, picture) -> tuple[dict[str, Any], int]:
        """(the pipeline's keyword arguments, the step count) for `request`'s shape and `prompt` (its own, or a
        batch's): the model's defaults (`self.rules`) filled in and what depends on the model checked;
        everything but the generator and the step callback."""
        rules = self.rules
        refused = rules.refused_fields(request.to_dict())
        if refused:
            name = refused[0]
            raise GenerationError(f"{name} is not valid for {self.model}: {rules.why_not(name)}", field=name, value=getattr(request, name))
        shape = rules.filled_for(request)
        height, width, num_frames, num_inference_steps = shape.height, shape.width, shape.num_frames, shape.num_inference_steps
        negative_prompt = request.negative_prompt if request.negative_prompt is not None else rules.default_negative_prompt
        if self.kind != "video" and num_frames is not None:
            raise GenerationError(f"num_frames = {num_frames!r} is not valid: {self.model} makes images, not video")
        # sizes the pipeline would silently round (diffusers rounds down to its latent grid) or that lie past the
        # reach of its position table (the model would fail deep inside: "view size is not compatible")
        self._refuse_first(self.rules.check_geometry(height=height, width=width, num_frames=num_frames))

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
        kwargs.update(self._extra_arguments(request, num_inference_steps))
        return kwargs, num_inference_steps

    def _extra_arguments(self, request: GenerationRequest, num_inference_steps: int) -> dict[str, Any]:
        """The call arguments `request.extra_params` passes through (fresh values: the call may change them),
        refused first if the model cannot take one; mapped keys (``sample_solver``) are settings (`pipeline_for`)."""
        params = request.extra_params
        self._refuse_first(self.rules.extra_params_problems(params, num_inference_steps=num_inference_steps))
        passed = params.to_dict()
        return {name: value for name, value in passed.items() if name in self.rules.call_arguments}

    def _call(self, request: GenerationRequest, kwargs: dict[str, Any], num_inference_steps: int, on_step, on_latents):
        """Call the pipeline with `kwargs` and `request`'s per-request settings (`pipeline_for`), timing each step
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
        with self.lock:
            adopt_process_threads()  # the server's worker computes the same bits as the caller's thread would
            before_stats = self._read_stats()
            decode = choose_decode(self.pipeline, self.vae_settings, _decoded_size(kwargs), self.device, before_stats)
            if decode is not None and not decode.fits:  # refused before the first step
                raise GenerationError(f"{self.model} cannot decode this output on {self.device}: {decode.reason}")
            before = StreamCounters.of(before_stats)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            start = time.perf_counter()
            with torch.inference_mode():
                output = pipeline_for(self.pipeline, request, decode)(**kwargs)
            seconds = time.perf_counter() - start
            stats = self._read_stats()
            after = StreamCounters.of(stats)
        return output, _run_stats(seconds, step_times, after - before, stats, self.device, decode)

    def _input_image(self, request: GenerationRequest):
        """(the RGB image, the size it leads to), or (None, None) without one; refuses an image the pipeline
        does not take, and a missing one it needs, before any work."""
        from layerstream.models.input_image import read_input_image, size_from_image

        pipeline_name = type(self.pipeline).__name__
        image = request.image
        problem = self.rules.image_problem(has_image=image is not None)
        if problem == "required":
            raise GenerationError(
                f"image is required: {self.model} ({pipeline_name}) generates from an input image; pass image= "
                "(a PIL image, a path or an array)"
            )
        if problem == "takes_none":
            raise GenerationError(
                f"image is not valid for {self.model}: {pipeline_name} takes no input image (its __call__ has no "
                "image argument); drop image, or load an image-to-video or image-editing model"
            )
        if image is None:
            return None, None
        picture = read_input_image(image)
        caps = [side for side in (self.rules.geometry.max_side_pixels, request.max_side_pixels) if side is not None]
        return picture, size_from_image(
            picture.size, size_multiple=self.rules.size_multiple, max_side=min(caps),
            width=request.width, height=request.height,
        )  # fmt: skip

    def _refuse_first(self, problems: list) -> None:
        """Raise the first of `problems` (the model's `LimitViolation`s), naming the model."""
        if problems:
            raise invalid_field(problems[0].name, problems[0].value, f"{problems[0].allowed} for {self.model}")


def batch_requests(shape: GenerationRequest, prompts: Sequence[str], seeds: Sequence[int]) -> list[GenerationRequest]:
    """`Omni.generate_batch`'s outputs: `shape` with each prompt and its seed."""
    prompts, seeds = list(prompts), list(seeds)
    if not prompts or len(prompts) != len(seeds):
        raise GenerationError(
            f"prompts and seeds must be non-empty and of one length (one seed per output); got {len(prompts)} "
            f"prompt(s) and {len(seeds)} seed(s)"
        )
    return [_batch_output(shape, index, prompt, seed) for index, (prompt, seed) in enumerate(zip(prompts, seeds))]


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


def _guidance_arguments(request: GenerationRequest, rules: ModelRules, call) -> dict[str, Any]:
    """The guidance scales as the pipeline's call takes them.

    `guidance_scale` is the classifier-free guidance scale: a pipeline that takes CFG through ``true_cfg_scale``
    (its ``guidance_scale`` is a distilled model's embedding input) gets it there, unless the request gives
    ``true_cfg_scale`` itself (vllm-omni's field), in which case each goes to the argument of its name."""
    out: dict[str, Any] = {} if request.true_cfg_scale is None else {"true_cfg_scale": request.true_cfg_scale}
    guidance, name = request.guidance_scale, "guidance_scale"
    if request.true_cfg_scale is None:
        guidance = guidance if guidance is not None else rules.default_guidance_scale
        name = "true_cfg_scale" if "true_cfg_scale" in call else "guidance_scale"
    if guidance is not None and name in call:
        out[name] = guidance
    if request.guidance_scale_2 is not None:
        out["guidance_scale_2"] = request.guidance_scale_2
    return out


def pipeline_for(pipeline, request: GenerationRequest, decode: VaeDecodeChoice | None = None):
    """The pipeline one call of `request` runs: `pipeline` itself, or, where the request sets ``boundary_ratio``,
    ``flow_shift`` or ``extra_params``' ``sample_solver``, or `decode` differs from the VAE's own setting, a
    shallow copy (the modules shared) with its own config, a scheduler built for the call (`scheduler_for`) and a
    VAE view that decodes as `decode` says (`vae_for`). Nothing is set on the served pipeline, so nothing has to
    be put back, whatever the call does."""
    served, vae = getattr(pipeline, "scheduler", None), getattr(pipeline, "vae", None)
    scheduler = scheduler_for(served, solver=request.extra_params.get(SAMPLE_SOLVER), flow_shift=request.flow_shift)
    own_vae = vae_for(vae, tiled=decode.tiled, sliced=decode.sliced) if decode is not None else vae
    if scheduler is served and request.boundary_ratio is None and own_vae is vae:
        return pipeline
    # a view sharing every module (offload's guard refuses copy.copy, which is for copies of the weights);
    # diffusers' __setattr__ and register_to_config then replace the view's config, not the served one's
    own = object.__new__(type(pipeline))
    own.__dict__.update(pipeline.__dict__)
    if scheduler is not served:
        own.scheduler = scheduler
    if own_vae is not vae:
        own.__dict__["vae"] = own_vae  # not through setattr: an nn.Module pipeline's would write the shared _modules
    if request.boundary_ratio is not None:
        own.register_to_config(boundary_ratio=request.boundary_ratio)
    return own


def _decoded_size(kwargs: dict[str, Any]) -> GenerationSize:
    """What a call with `kwargs` decodes: its size, and a batch of its prompts."""
    prompt = kwargs["prompt"]
    batch = len(prompt) if isinstance(prompt, list) else 1
    return GenerationSize(
        height=kwargs.get("height"), width=kwargs.get("width"), num_frames=kwargs.get("num_frames"), batch=batch
    )


PER_PROMPT_ARGUMENTS = ("negative_prompt", "prompt_2", "prompt_3", "negative_prompt_2", "negative_prompt_3")
"""Call arguments a batch call takes one of per prompt (`run_batch` repeats a single text)."""


def _output_arrays(output, kind: str, num_outputs: int) -> list[np.ndarray]:
    """The pipeline's frames (video pipelines) or images, one array per output: [1, H, W, C] images, [F, H, W, C]
    videos."""
    array = getattr(output, "frames", None)
    if array is None:
        array = getattr(output, "images", None)
    if array is None and isinstance(output, (tuple, list)):
        array = output[0]
    array = np.asarray(array)
    if array.ndim == (4 if kind == "video" else 3):
        array = array[None]  # one output without its batch dimension
    if len(array) != num_outputs:
        raise GenerationError(f"the pipeline returned {len(array)} outputs for {num_outputs} prompts")
    return [array[i] if kind == "video" else array[i : i + 1] for i in range(num_outputs)]


def _run_stats(seconds, step_times, streamed: StreamCounters, now: OffloadStats | None, device, decode) -> RunStats:
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return RunStats(
        seconds=seconds, step_seconds=step_times, **asdict(streamed), device_bytes=now.device_bytes if now else 0,
        host_bytes=now.host_bytes if now else 0, peak_device_bytes=peak, vae_decode=decode,
    )  # fmt: skip


def adopt_process_threads() -> None:
    """Give the calling thread the process's intra-op thread count before it computes.

    PyTorch's OpenMP build keeps that count per OS thread: `torch.set_num_threads(n)` sets it on the calling
    thread and records it for the others, but another thread takes it up only at its first parallel ATen op (or
    `torch.get_num_threads()`); until then MKL's matrix products, which read the thread's own OpenMP setting,
    run with one thread per core. On AMD EPYC MKL's sgemm rounds differently with two threads than with one (a
    6x32 @ 32x64 product differs in its last bit; the Intel Xeon gives the same bits), so the server's worker
    would compute other bits than the caller's thread for the same seed."""
    torch.set_num_threads(torch.get_num_threads())


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`dtype` as a torch dtype: None, a torch dtype, or its name (``"bfloat16"``, ``"bf16"``...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise GenerationError(f"dtype = {dtype!r} is not valid; allowed: {', '.join(names)}")
    return names[dtype]

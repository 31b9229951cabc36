"""`layerstream generate`: the main job. Check, load a model, enable offload, generate, save, summarize."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from layerstream.cli.common import (
    MODEL_SOURCES,
    CliError,
    add_config_argument,
    add_hub_arguments,
    add_work_cap_argument,
    add_model_first_argument,
    add_vae_arguments,
    check_device_arg,
    check_output_path,
    check_work,
    component_files,
    fetch_before_ranks,
    json_object_text,
    parse_config_args,
    positive_float,
    positive_int,
    prompt_text,
    request_value,
    seed_int,
)
from layerstream.cli.generate_summary import as_expected, print_table, summary
from layerstream.cli.resident_compare import compare_with_resident
from layerstream.cli.interrupt import Phase, PhaseLog, report_interrupt
from layerstream.models.output_limits import (
    DEFAULT_MAX_FRAMES,
    DEFAULT_MAX_SIDE_PIXELS,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    LimitViolation,
    check_output_caps,
)
from layerstream.request import FIELD_BOUNDS, GenerationError, GenerationRequest

DATA_PARALLEL_CONFIG = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}
"""The default config with --nproc > 1: every rank keeps 1/N of the DiT's blocks and they are all-gathered."""

# the flag a user types for each generation argument (every `GenerationRequest` field but image, n and timeout,
# which tests/test_request.py holds it to), to build the request and to name a flag in errors
_FLAGS = {"height": "--height", "width": "--width", "num_frames": "--num-frames"}
_REQUEST_FLAGS = {
    **_FLAGS, "prompt": "--prompt", "negative_prompt": "--negative-prompt", "num_inference_steps": "--steps",
    "guidance_scale": "--guidance-scale", "seed": "--seed", "fps": "--fps", "max_side_pixels": "--max-size",
    "guidance_scale_2": "--guidance-scale-2", "true_cfg_scale": "--true-cfg-scale",
    "boundary_ratio": "--boundary-ratio", "flow_shift": "--flow-shift", "extra_params": "--extra-params",
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_first_argument(parser, MODEL_SOURCES, "tiny-wan", "--model")
    add_hub_arguments(parser)
    add_vae_arguments(parser)
    parser.add_argument(
        "--prompt", type=prompt_text, default="a red fox running through fresh snow, cinematic",
        help=f"text prompt, at most {MAX_PROMPT_CHARS:,} characters (as the server takes)",
    )
    parser.add_argument(
        "--negative-prompt", type=prompt_text, default=None,
        help="negative prompt (classifier-free guidance), at most as long as --prompt",
    )
    parser.add_argument(
        "--image", default=None, metavar="PATH",
        help="input image (PNG, JPEG, WebP) for image-to-video and image-editing models; without --height and "
        "--width the output takes its size, rounded down to the model's size multiple",
    )
    parser.add_argument(
        "--height", type=request_value("height"), default=None,
        help="pixels, a multiple of the model's size step (16 for the tiny models), at most --max-size (default: the model's)",
    )
    parser.add_argument("--width", type=request_value("width"), default=None, help="pixels, as --height")
    parser.add_argument(
        "--num-frames", type=request_value("num_frames"), default=None, help="video models only; at most --max-frames (default: the model's)"
    )
    parser.add_argument(
        "--steps", type=request_value("num_inference_steps"), default=None, dest="num_inference_steps",
        help=f"denoising steps, {FIELD_BOUNDS['num_inference_steps'].allowed()} (default: the model's)",
    )
    parser.add_argument(
        "--guidance-scale",
        type=request_value("guidance_scale"),
        default=None,
        help=f"classifier-free guidance scale, {FIELD_BOUNDS['guidance_scale'].allowed()}; 1 or less turns guidance off (default: the model's)",
    )
    parser.add_argument(
        "--seed", type=seed_int, default=0,
        help=f"random seed, 0 to {MAX_SEED} (2**53 - 1); rank r of --nproc uses seed + r (default: 0)",
    )
    parser.add_argument(
        "--guidance-scale-2", type=request_value("guidance_scale_2"), default=None,
        help="two-expert models (Wan 2.2 A14B): the low-noise expert's guidance scale (default: --guidance-scale)",
    )
    parser.add_argument(
        "--true-cfg-scale", type=request_value("true_cfg_scale"), default=None,
        help="models with a true_cfg_scale argument (Flux, Qwen-Image): that argument; --guidance-scale then goes to "
        "the model's own guidance_scale",
    )
    parser.add_argument(
        "--boundary-ratio", type=request_value("boundary_ratio"), default=None,
        help="two-expert models: where the second expert takes over, a fraction of the timesteps from 0 to 1 "
        "(default: the model's config)",
    )
    parser.add_argument(
        "--flow-shift", type=request_value("flow_shift"), default=None,
        help="models whose scheduler has a flow_shift (Wan): its value for this run (default: the model's)",
    )
    parser.add_argument(
        "--extra-params", type=json_object_text, default=None, metavar="JSON",
        help="vllm-omni's extra call arguments, a JSON object: keys the model's call takes from JSON, and "
        '"sample_solver" ("unipc", "euler", "dpm++") where its scheduler has the counterpart (docs/serving.md)',
    )  # fmt: skip
    parser.add_argument(
        "--fps", type=request_value("fps"), default=None,
        help=f"frames per second of saved video, {FIELD_BOUNDS['fps'].allowed()} (default: the model's: Wan 16, LTX 24)",
    )
    parser.add_argument(
        "--max-size", type=request_value("max_side_pixels"), default=DEFAULT_MAX_SIDE_PIXELS, dest="max_side_pixels",
        help=f"largest --height or --width accepted, as the server's --max-size (default: {DEFAULT_MAX_SIDE_PIXELS})",
    )
    parser.add_argument(
        "--max-frames", type=positive_int, default=DEFAULT_MAX_FRAMES,
        help=f"largest --num-frames accepted, as the server's --max-frames (default: {DEFAULT_MAX_FRAMES})",
    )
    add_work_cap_argument(parser)
    parser.add_argument("--output", default=None, help="output file: .png for images, .mp4 or .gif for video")
    add_config_argument(parser)
    parser.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: as saved)")
    parser.add_argument("--link-gbps", type=positive_float, default=None, help="CPU only: simulated host link bandwidth in GB/s")
    parser.add_argument(
        "--compare-resident", action="store_true",
        help="also run resident (the whole model on the device) and report whether outputs are bit-identical; with "
        "float8 storage against the model in its weights' own dtype, loaded again (it differs by design: the largest difference is shown)",
    )  # fmt: skip
    parser.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace JSON (and a .png timeline beside it)")
    parser.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="run N data-parallel ranks on this machine (torchrun), seed + rank on each; without a config the "
        "DiT's weights are shared with allgather",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")




def run(args: argparse.Namespace) -> int:
    """Generate as the arguments say; Ctrl-C at any point ends it with one line naming the phase it stopped
    in and what it had written (outputs are written whole or not at all) and exit code 130."""
    log = PhaseLog()
    try:
        return _run(args, log)
    except KeyboardInterrupt:
        return report_interrupt(log)


def _run(args: argparse.Namespace, log: PhaseLog) -> int:
    rank, world_size = _rank_info()
    default = DATA_PARALLEL_CONFIG if (args.nproc or world_size) > 1 else None
    config = parse_config_args(args, default)  # before anything loads
    _check_arguments(args, world_size)  # every check that needs no model, so a mistake costs no load
    # rank r of several uses seed + r
    request = request_from_args(args, image=_read_image_arg(args.image), seed=args.seed + rank)
    if args.nproc is not None and args.nproc > 1 and world_size == 1:
        return _launch_ranks(args)

    log.enter(Phase.LOADING)
    omni = _load(args, config, world_size)
    output = _output_path(args, omni, request.seed, rank, world_size)
    _check_model_geometry(args, omni)
    _check_image_input(args, omni)
    check_work(
        omni.price(request), omni.rules, max_work=args.max_work, max_side=args.max_side_pixels,
        max_frames=args.max_frames, device=omni.device,
    )  # fmt: skip
    log.enter(Phase.GENERATING)
    result = _generate(args, omni, request, rank)
    with log.writing(Phase.WRITING_OUTPUT, output):
        result.save(output)
    trace_files = _save_trace(args, omni, log)
    compared = None
    if args.compare_resident:
        log.enter(Phase.COMPARING)
        compared = compare_with_resident(args, omni, request, result)
    log.enter(Phase.REPORTING)
    made = summary(args.model, omni, result, output, compared, trace_files, rank, prompt=request.prompt, seed=request.seed)
    made["image"] = args.image
    made["size_note"] = result.size_note
    return _report(args, omni, made, rank, world_size)


def request_from_args(args: argparse.Namespace, *, image=None, seed: int | None = None) -> GenerationRequest:
    """The `GenerationRequest` the flags describe (`seed`: this rank's, default --seed; `image`: --image as
    read); a value it refuses is one line naming the flag."""
    # None (or absent from a namespace built without it): the request's default
    given = {name: value for name in _REQUEST_FLAGS if (value := getattr(args, name, None)) is not None}
    try:
        return GenerationRequest(**{**given, "seed": args.seed if seed is None else seed}, image=image)
    except GenerationError as e:
        field, _, key = (e.field or "").partition(".")  # extra_params.KEY: --extra-params KEY
        flag = " ".join(filter(None, (_REQUEST_FLAGS.get(field, e.field), key)))
        allowed = f"give {_REQUEST_FLAGS[key]} instead" if key in _REQUEST_FLAGS else e.allowed
        raise CliError(f"{flag}: {e.value!r} is not allowed ({allowed})") from e


def _load(args: argparse.Namespace, config, world_size: int):
    """The model loaded with offload enabled (joining the other ranks first under torchrun), as an `Omni`."""
    from layerstream.errors import OffloadError
    from layerstream.models.generation_size import GenerationSize
    from layerstream.models.loading import ModelLoadError
    from layerstream.omni import Omni

    device = args.device
    offload_group = None
    if world_size > 1:
        device, offload_group = _join_ranks(args)
    try:
        return Omni(
            model=args.model,
            diffusion_offload_config=config,
            device=device,
            dtype=args.dtype,
            simulated_link_gbps=args.link_gbps,
            trace=args.trace is not None,
            process_group=offload_group,
            revision=args.revision,
            variant=args.variant,
            components=component_files(args),
            requests=GenerationSize(height=args.height, width=args.width, num_frames=args.num_frames, source="the request's size"),
        )
    except (ModelLoadError, GenerationError, OffloadError) as e:
        raise CliError(str(e)) from e
    except RuntimeError as e:
        if "device" in str(e).lower():
            raise CliError(f"--device {args.device}: {e}") from e
        raise


def _output_path(args: argparse.Namespace, omni, seed: int, rank: int, world_size: int) -> Path:
    """--output (or a default name for what the model makes), checked against the loaded model's kind, with
    the rank in the name under torchrun."""
    output = Path(args.output) if args.output else _default_output(args.model, omni.kind, seed)
    _check_kind(args, omni.kind, output)  # again: a folder's kind may be known only now
    if world_size > 1:
        output = output.with_name(f"{output.stem}.rank{rank}{output.suffix}")
    return output


def _generate(args: argparse.Namespace, omni, request: GenerationRequest, rank: int):
    from layerstream.models.input_image import InputImageError

    progress = _Progress(enabled=rank == 0)
    try:
        if omni.handle is not None and args.trace:
            omni.handle.reset_trace()
        return omni.run(request, on_step=progress.step, keep_raw=args.compare_resident)
    except (GenerationError, InputImageError) as e:
        raise CliError(str(e)) from e
    finally:
        progress.close()


def _save_trace(args: argparse.Namespace, omni, log: PhaseLog) -> list[str]:
    if not args.trace or omni.handle is None:
        return []
    path = Path(args.trace)
    files = dict.fromkeys((path, path if path.suffix.lower() == ".png" else path.with_suffix(".png")))
    with log.writing(Phase.WRITING_TRACE, *files):
        return _write_trace(omni.handle, path, title=_trace_title(args, omni))


def _report(args: argparse.Namespace, omni, made: dict, rank: int, world_size: int) -> int:
    """Print the summary (rank 0 prints every rank's); exit code 1 if an output differs from resident (other
    than by a lossy storage asked for)."""
    if world_size > 1:
        from layerstream.distributed.launch import gather_objects
        from layerstream.distributed.process_group import destroy_distributed

        summaries = gather_objects(made)  # every rank's summary, on rank 0 only
        if omni.handle is not None:
            omni.close()  # a collective: every rank gives its shards back together
        destroy_distributed()
        if rank != 0:
            return 0 if as_expected(made) else 1
    else:
        summaries = [made]
    if args.json:
        print(json.dumps(summaries if world_size > 1 else made, indent=2))
    else:
        print_table(summaries)
    return 0 if all(as_expected(s) for s in summaries) else 1


def _check_arguments(args: argparse.Namespace, world_size: int) -> None:
    """Checks of the arguments alone, before the model loads: the caps, the seed range across ranks, the
    device, the output path and its suffix against what the model makes. What needs the loaded model (size
    multiples, frame rule, image input) follows the load."""
    from layerstream.models.loading import model_kind
    from layerstream.omni import IMAGE_SUFFIXES, VIDEO_SUFFIXES

    violations = check_output_caps(
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        max_side_pixels=args.max_side_pixels,
        max_frames=args.max_frames,
    )
    if violations:
        cap = "--max-frames" if violations[0].name == "num_frames" else "--max-size"
        raise CliError(f"{_violation_text(violations[0])} (the cap is set by {cap})")
    num_ranks = max(args.nproc or 1, world_size)
    if args.seed + num_ranks - 1 > MAX_SEED:
        most = MAX_SEED - num_ranks + 1
        raise CliError(f"--seed {args.seed} is too large for {num_ranks} ranks (rank r uses seed + r); expected at most {most}")
    check_device_arg("--device", args.device)
    if args.output is not None:
        suffixes = IMAGE_SUFFIXES + VIDEO_SUFFIXES
        if Path(args.output).suffix.lower() not in suffixes:
            raise CliError(f"--output {args.output}: expected a {', '.join(suffixes)} file (.png for images)")
    check_output_path("--output", Path(args.output) if args.output else Path.cwd() / "output.png")
    # the tiny model's spec or the folder's model_index.json tells the kind without loading a weight
    _check_kind(args, model_kind(args.model), Path(args.output) if args.output else None)


def _check_kind(args: argparse.Namespace, kind: str | None, output: Path | None) -> None:
    """--output's suffix and --num-frames against what the model makes (`kind` None: not known yet)."""
    from layerstream.omni import IMAGE_SUFFIXES, VIDEO_SUFFIXES

    if kind is None:
        return
    allowed = IMAGE_SUFFIXES if kind == "image" else VIDEO_SUFFIXES
    if output is not None and output.suffix.lower() not in allowed:
        article = "an" if kind == "image" else "a"
        raise CliError(f"--output {output}: {args.model} makes {article} {kind}; use a {' or '.join(allowed)} file")
    if kind != "video" and args.num_frames is not None:
        raise CliError(f"--num-frames {args.num_frames}: {args.model} makes images, not video; drop --num-frames")


def _read_image_arg(path: str | None):
    """--image, read and checked before the model loads: a missing file, a file that is not an image, or one
    past the caps (bytes, or pixels read from its header) is one line and exit code 2."""
    if path is None:
        return None
    from layerstream.models.input_image import InputImageError, read_input_image

    try:
        return read_input_image(path, name="--image")
    except InputImageError as e:
        raise CliError(str(e)) from e


def _check_image_input(args: argparse.Namespace, omni) -> None:
    """--image against what the loaded model takes, before the first step."""
    pipeline_name = type(omni.pipeline).__name__
    problem = omni.rules.image_problem(has_image=args.image is not None)
    if problem == "takes_none":
        raise CliError(f"--image {args.image}: {args.model} ({pipeline_name}) takes no input image; drop --image")
    if problem == "required":
        raise CliError(f"{args.model} ({pipeline_name}) generates from an input image; pass --image PATH")


def _check_model_geometry(args: argparse.Namespace, omni) -> None:
    """Sizes and options the loaded model cannot take, named by flag, before the first step."""
    rules = omni.rules
    violations = rules.check_geometry(height=args.height, width=args.width, num_frames=args.num_frames)
    if violations:
        raise CliError(f"{_violation_text(violations[0])} for {args.model}")
    refused = rules.refused_fields(vars(args))
    if refused:
        raise CliError(f"{_REQUEST_FLAGS[refused[0]]} is not valid for {args.model}: {rules.why_not(refused[0])}")
    steps = rules.filled(num_inference_steps=args.num_inference_steps).num_inference_steps
    problems = rules.extra_params_problems(getattr(args, "extra_params", None) or {}, num_inference_steps=steps)
    if problems:
        key, value = problems[0].name.removeprefix("extra_params."), problems[0].value
        raise CliError(f"--extra-params {key}: {value!r} is not valid for {args.model}; expected {problems[0].allowed}")


def _violation_text(violation: LimitViolation) -> str:
    return f"{_FLAGS[violation.name]} = {violation.value} is not valid; expected {violation.allowed}"


def _join_ranks(args) -> tuple:
    """Join the ranks; return this rank's device and the process group its allgather transfers run on.

    The transfers get a group of their own: the copy thread runs them while the main thread gathers the
    summaries on the default group (the last block prefetches the first after every forward), and collectives
    of two threads on one group would interleave differently on each rank. A tiny model is built once, by rank
    0, before any rank reads it (two ranks building one cache folder at once would collide)."""
    import torch.distributed as dist

    from layerstream.distributed.process_group import backend_for, collective_timeout, init_distributed
    from layerstream.models.hub import looks_like_hub_id
    from layerstream.models.loading import ModelLoadError, resolve_model
    from layerstream.models.tiny import is_tiny_model_name

    device = init_distributed(args.device)  # cuda:LOCAL_RANK (NCCL) or cpu (gloo)
    from_files = frozenset(component_files(args))  # a malformed --component: every rank says so, none waits
    failed = None
    if dist.get_rank() == 0 and (is_tiny_model_name(args.model) or looks_like_hub_id(args.model)):
        try:  # rank 0 builds the tiny model or downloads the Hub snapshot; the others then read it
            resolve_model(args.model, revision=args.revision, variant=args.variant, from_files=from_files)
        except ModelLoadError as e:
            failed = e
    dist.barrier()  # every rank waits for the build (a failure is reported by each rank's own load below)
    if failed is not None:
        raise CliError(str(failed)) from failed
    return device, dist.new_group(backend=backend_for(device), timeout=collective_timeout())


def _launch_ranks(args) -> int:
    from layerstream.distributed.launch import launch_torchrun, without_nproc

    extra_env = fetch_before_ranks(args)
    return launch_torchrun(args.nproc, without_nproc(sys.argv[1:]), extra_env=extra_env)  # the ranks run the same command


def _rank_info() -> tuple[int, int]:
    """(rank, world size) under torchrun; (0, 1) otherwise, without importing torch.distributed."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from layerstream.distributed.launch import rank_info

        return rank_info()
    return 0, 1


def _default_output(model: str, kind: str, seed: int) -> Path:
    name = Path(model).name  # a folder's name, a Hub id's name, or a tiny model's
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path.cwd() / f"layerstream-{name}-seed{seed}-{stamp}{'.png' if kind == 'image' else '.mp4'}"


class _Progress:
    """A progress bar on a terminal, plain lines otherwise (logs, CI)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.tty = sys.stderr.isatty()

    def step(self, step: int, total: int, seconds: float) -> None:
        if not self.enabled:
            return
        if self.tty:
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="denoising", unit="step", file=sys.stderr)
            self.bar.update(1)
        else:
            print(f"step {step}/{total}: {seconds:.3f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _trace_title(args: argparse.Namespace, omni) -> str:
    """What the timeline shows: the model, the device and the link the copies crossed."""
    device = omni.device
    if device.type == "cpu":
        link = f"simulated link {args.link_gbps:g} GB/s" if args.link_gbps else "CPU copy thread, no simulated link"
    else:
        import torch

        link = f"{torch.cuda.get_device_name(device)} host link" if device.type == "cuda" else f"{device} host link"
    return f"{args.model}: layerwise offload on {device}, {link}"


def _write_trace(handle, path: Path, *, title: str | None = None) -> list[str]:
    """The Chrome trace JSON at `path` and its timeline beside it as a .png (only the .png if `path` is one),
    each written whole or not at all."""
    from layerstream.atomic_write import write_atomically
    from layerstream.runtime.reporting.trace_export import write_chrome_trace, write_timeline_png

    trace = handle.trace()
    png = path if path.suffix.lower() == ".png" else path.with_suffix(".png")
    if png != path:
        with write_atomically(path) as partial:
            write_chrome_trace(trace, partial)
    with write_atomically(png) as partial:
        write_timeline_png(trace, partial, title=title)
    return [str(p) for p in dict.fromkeys((path, png))]

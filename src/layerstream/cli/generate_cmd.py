"""`layerstream generate`: the main job. Check (by the model's rules read from its configs, before any weight),
load a model, enable offload, generate, save, summarize."""

from __future__ import annotations

import argparse
import dataclasses
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
)
from layerstream.cli.generate_summary import as_expected, print_table, summary
from layerstream.cli.resident_compare import compare_with_resident
from layerstream.cli.interrupt import Phase, PhaseLog, report_interrupt
from layerstream.models.output_limits import (
    DEFAULT_MAX_FRAMES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    LimitViolation,
    check_output_caps,
)
from layerstream.models.request_fields import REQUEST_FIELDS, FieldBound
from layerstream.request import GenerationError, GenerationRequest

DATA_PARALLEL_CONFIG = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "allgather"}}}
"""The default config with --nproc > 1: every rank keeps 1/N of the DiT's blocks and they are all-gathered."""
DEFAULT_PROMPT = "a red fox running through fresh snow, cinematic"
_FLAGS = {name: field.flag for name, field in REQUEST_FIELDS.items() if field.flag is not None}
"""The flag of each request field the command line takes (--image reads a file), as the request's table spells it."""
_HELP = {
    "prompt": f"text prompt, at most {MAX_PROMPT_CHARS:,} characters (as the server takes)",
    "num_frames": "video models only; at most --max-frames (default: the model's)",
    "seed": "random seed of the first output; rank r of --nproc uses seed + r (default: 0)",
    "negative_prompt": "negative prompt (classifier-free guidance), at most as long as --prompt",
    "image": "input image (PNG, JPEG, WebP) of image-to-video and image-editing models; without --height and"
    " --width the output takes its size, rounded down to the model's size multiple",
    "height": "pixels, a multiple of the model's size multiple, at most --max-size (default: the model's)",
    "width": "pixels, as --height",
    "guidance_scale_2": "two-expert models (Wan 2.2 A14B): the low-noise expert's scale (default: --guidance-scale)",
    "true_cfg_scale": "models with a true_cfg_scale argument (Flux, Qwen-Image): that argument; --guidance-scale"
    " then goes to the model's own guidance_scale",
    "fps": "frames per second of saved video (default: the model's: Wan 16, LTX 24)",
    "max_side_pixels": "largest --height or --width accepted, and the largest side of an output sized from --image,"
    " as the server's --max-size (default: %(default)s)",
    "extra_params": "vllm-omni's extra call arguments, a JSON object: the keys the model's family declares"
    " (docs/serving.md) and sample_solver ('unipc', 'euler', 'dpm++'); another key is refused naming it",
}
"""Where the command line's help says more than the table's description (which the HTTP schema shows)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_first_argument(parser, MODEL_SOURCES, "tiny-wan", "--model")
    add_hub_arguments(parser)
    add_vae_arguments(parser)
    defaults = {field.name: field.default for field in dataclasses.fields(GenerationRequest)}
    for name, flag in _FLAGS.items():
        default = DEFAULT_PROMPT if name == "prompt" else defaults[name]
        parser.add_argument(flag, dest=name, default=default, **_flag_options(name))
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


def _flag_options(name: str) -> dict:
    """How the flag of request field `name` reads its text, and its help: the table's bounds and description."""
    values, help_text = REQUEST_FIELDS[name].values, _HELP.get(name, REQUEST_FIELDS[name].description)
    if isinstance(values, FieldBound):
        return {"type": request_value(name), "help": f"{help_text} ({values.allowed()})"}
    if values is str:
        return {"type": prompt_text, "help": help_text}
    if values is dict:
        return {"type": json_object_text, "metavar": "JSON", "help": help_text}
    return {"metavar": "PATH", "help": help_text}  # --image: read once the other flags are checked


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
    log.enter(Phase.LOADING)  # its configs first (a tiny model is built), then its weights
    rules = _rules_before_loading(args) if world_size == 1 else None  # ranks: their launcher checked
    if rules is not None:
        _check_for_model(args, request, rules, args.device)
    if args.nproc is not None and args.nproc > 1 and world_size == 1:
        return _launch_ranks(args)
    omni = _load(args, config, world_size)
    output = _output_path(args, omni, request.seed, rank, world_size)
    if rules is None:
        _check_for_model(args, request, omni.rules, omni.device)
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
    given = {name: value for name in _FLAGS if (value := getattr(args, name, None)) is not None}
    try:
        return GenerationRequest(**{**given, "seed": args.seed if seed is None else seed, "image": image})
    except GenerationError as e:
        field, _, key = (e.field or "").partition(".")  # extra_params.KEY: --extra-params KEY
        flag = " ".join(filter(None, (_FLAGS.get(field, e.field), key)))
        allowed = f"give {_FLAGS[key]} instead" if key in _FLAGS else e.allowed
        raise CliError(f"{flag}: {e.value!r} is not allowed ({allowed})") from e


def _load(args: argparse.Namespace, config, world_size: int):
    """The model loaded with offload enabled (joining the other ranks first under torchrun), as an `Omni`."""
    from layerstream.errors import OffloadError
    from layerstream.models.size import GenerationSize
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
            requests=GenerationSize(
                height=args.height, width=args.width, num_frames=args.num_frames, source="the request's size"
            ),
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
    """The Chrome trace JSON at --trace and its timeline beside it as a .png (only the .png if --trace is one),
    each written whole or not at all."""
    if not args.trace or omni.handle is None:
        return []
    from layerstream.atomic_write import write_atomically
    from layerstream.runtime.reporting.trace_export import write_chrome_trace, write_timeline_png

    path = Path(args.trace)
    png = path if path.suffix.lower() == ".png" else path.with_suffix(".png")
    with log.writing(Phase.WRITING_TRACE, *dict.fromkeys((path, png))):
        trace = omni.handle.trace()
        if png != path:
            with write_atomically(path) as partial:
                write_chrome_trace(trace, partial)
        with write_atomically(png) as partial:
            write_timeline_png(trace, partial, title=_trace_title(args, omni))
    return [str(p) for p in dict.fromkeys((path, png))]


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
    """Checks of the arguments alone: the caps, the seed range across ranks, the device, the output path and its
    suffix against what the model makes (`_check_for_model` follows, by the model's rules)."""
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


def _rules_before_loading(args: argparse.Namespace):
    """The model's rules read from its skeleton (`models.loading.load_skeleton`: configs, no weight read), so that
    what the model refuses costs no load; None where that needs the load (the Hub cannot describe a Hub id now)."""
    from layerstream.models.hub import names_hub_repo
    from layerstream.models.loading import ModelLoadError, load_skeleton, resolve_model
    from layerstream.models.model_rules import read_model_rules
    from layerstream.models.optional_imports import quiet_library_noise

    model = args.model
    if names_hub_repo(model):  # a snapshot the cache holds is read there: the Hub is asked only before a download
        try:
            model = resolve_model(model, revision=args.revision, variant=args.variant, offline=True).folder
        except ModelLoadError:
            pass
    try:
        with quiet_library_noise():  # as the load: a tiny model is built with diffusers here
            files = component_files(args)
            skeleton, _ = load_skeleton(model, revision=args.revision, variant=args.variant, components=files)
    except ModelLoadError:  # the load says what is wrong, or loads what the cache holds
        return None
    return read_model_rules(skeleton, args.model)


def _check_for_model(args: argparse.Namespace, request: GenerationRequest, rules, device) -> None:
    """What the model's `rules` refuse (the output's kind, sizes, ``extra_params``, the input image) and the work
    cap, each named by flag."""
    from layerstream.models.work import price_request
    from layerstream.offload import default_device

    _check_kind(args, rules.kind, Path(args.output) if args.output else None)
    refused = rules.refused_fields(vars(args))  # a skeleton reads its settings too; the runner refuses again
    if refused:
        raise CliError(f"{_FLAGS[refused[0]]} is not valid for {args.model}: {rules.why_not(refused[0])}")
    violations = rules.check_geometry(height=args.height, width=args.width, num_frames=args.num_frames)
    if violations:
        raise CliError(f"{_violation_text(violations[0])} for {args.model}")
    steps = rules.filled(num_inference_steps=args.num_inference_steps).num_inference_steps
    problems = rules.extra_params_problems(request.extra_params, num_inference_steps=steps)
    if problems:
        key, value = problems[0].name.removeprefix("extra_params."), problems[0].value
        raise CliError(f"--extra-params {key}: {value!r} is not valid for {args.model}; expected {problems[0].allowed}")
    problem, model = rules.image_problem(has_image=args.image is not None), f"{args.model} ({rules.pipeline_class})"
    if problem == "takes_none":
        raise CliError(f"--image {args.image}: {model} takes no input image; drop --image")
    if problem == "required":
        raise CliError(f"{model} generates from an input image; pass --image PATH")
    check_work(
        price_request(rules, request, max_side_pixels=request.max_side_pixels), rules, max_work=args.max_work,
        max_side=args.max_side_pixels, max_frames=args.max_frames, device=device or default_device(),
    )  # fmt: skip


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

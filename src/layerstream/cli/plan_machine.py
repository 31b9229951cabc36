"""`layerstream plan MODEL --device-memory GB --host-memory GB ...`: the plan for a machine given by its figures.

The flags, their checks (one line naming the flag, before the model is loaded) and the report; the planning
itself is `layerstream.machine.planner`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
from typing import Any

from layerstream.cli.common import (
    CliError,
    check_work,
    non_negative_float,
    positive_float,
    request_value,
    vae_setting,
    work_cap,
)
from layerstream.models.request_fields import REQUEST_FIELDS

_MACHINE_FIELDS = ("link_gbps", "disk_gbps", "device_tflops", "baseline_gb", "host_reserve_gb", "activation_reserve_gb")
"""The planner's `Machine` fields each set by the flag of its name (--link-gbps), beside the two memories."""
_FLAG_OF = {
    "device_memory_gb": "--device-memory", "host_memory_gb": "--host-memory",
    **{name: "--" + name.replace("_", "-") for name in _MACHINE_FIELDS},
}  # fmt: skip
_FIELD_NAMES = re.compile(r"\b(" + "|".join(_FLAG_OF) + r")\b")
_GENERATION_FLAGS = {
    name: REQUEST_FIELDS[name].flag for name in ("height", "width", "num_frames", "num_inference_steps")
}
"""The generation planned for, by the flags that set it (as `generate` spells them)."""
_MACHINE_FLAGS = (*_MACHINE_FIELDS, "vae_use_tiling", "allow_lossy", "measure")


def add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    """The machine's flags (GB are 1e9 bytes; defaults documented in `layerstream.machine.planner`)."""
    from_planner = "see docs/planning.md"
    group = parser.add_argument_group("a plan for a machine (give both memories)")
    group.add_argument("--device-memory", type=positive_float, metavar="GB", help="the device's memory")
    group.add_argument("--host-memory", type=positive_float, metavar="GB", help="the whole process's host memory, Python and libraries included")
    group.add_argument("--link-gbps", type=positive_float, metavar="X", help=f"host-to-device GB/s (default 25, PCIe 4.0 x16; {from_planner})")
    group.add_argument("--disk-gbps", type=positive_float, metavar="Y", help="disk read GB/s (default 3, a PCIe 3.0 NVMe)")
    group.add_argument("--device-tflops", type=positive_float, metavar="T", help="bfloat16 TFLOPS for the compute estimate (default 150)")
    group.add_argument("--baseline-gb", type=non_negative_float, metavar="GB", help="host memory before any model (default 1.41: imports 0.41 + a CUDA context 1.0)")
    group.add_argument("--host-reserve-gb", type=non_negative_float, metavar="GB", help="host memory kept free for a generation (default: estimated for the size planned)")
    group.add_argument("--activation-reserve-gb", type=non_negative_float, metavar="GB", help="device memory left beside the weights and the slot ring (default: the largest phase's estimate for the size planned)")
    group.add_argument("--vae-use-tiling", type=vae_setting, metavar="{true,false,auto}", help='plan the VAE decode tiled: "auto" (default) only where the untiled decode does not fit (tiles blend at their edges)')
    group.add_argument("--allow-lossy", action="store_true", help="float8 storage may be recommended (weights rounded once)")
    group.add_argument("--measure", action="store_true", help="time one step on this machine's device instead of the FLOPs estimate")
    tokens = "for the tokens per block (default: the model's)"
    group.add_argument("--height", type=request_value("height"), help=f"pixels, {tokens}")
    group.add_argument("--width", type=request_value("width"), help="pixels (default: the model's)")
    group.add_argument("--num-frames", type=request_value("num_frames"), help="video models (default: the model's)")
    group.add_argument("--steps", type=request_value("num_inference_steps"), dest="num_inference_steps", help="denoising steps, over which a host pool's reads spread (default: the model's)")


def wants_machine_plan(args: argparse.Namespace) -> bool:
    """Whether the machine flags were given; refuses a half-given machine or mixed modes, before loading."""
    memories = {"--device-memory": args.device_memory, "--host-memory": args.host_memory}
    others = [f"--{name.replace('_', '-')}" for name in _MACHINE_FLAGS if getattr(args, name) not in (None, False)]
    others += [flag for name, flag in _GENERATION_FLAGS.items() if getattr(args, name) is not None]
    given = [flag for flag, value in memories.items() if value is not None]
    if not given:
        if others:
            raise CliError(f"{others[0]}: only used with --device-memory and --host-memory (a plan for a machine); give both")
        return False
    if len(given) == 1:
        missing = next(flag for flag in memories if flag not in given)
        raise CliError(f"{given[0]} = {memories[given[0]]:g}: a plan for a machine needs {missing} too")
    if args.diffusion_offload_config is not None:
        raise CliError("--diffusion-offload-config: a plan for a machine recommends the config itself; give either it or --device-memory and --host-memory")
    return True


def lossless_fraction(pipeline: Any, origin: dict[str, Any], variant: str | None):
    """What the lossless form is priced at for this model (`CodedFraction`): its DiT's weights sampled where the
    model's folder (a local one, a downloaded snapshot) holds them, else by ranged reads of a Hub id's files, else
    the fixed estimate (saying why)."""
    from pathlib import Path

    from layerstream.config.offload_config import parse_offload_config
    from layerstream.models.coded_fraction import sample_coded_fraction
    from layerstream.models.hub_sample import hub_coded_fraction
    from layerstream.plan.resolver import resolve_offload_plan
    from layerstream.runtime.packing.lossless_code import ESTIMATED

    folder = origin.get("folder")
    if not folder or origin.get("origin") == "tiny":
        return ESTIMATED
    plan = resolve_offload_plan(pipeline, parse_offload_config({"mode": "layer", "components": ["dit"]}))
    components = {c.path.split(".", 1)[0] for c in plan.streamed if c.path}
    sampled = sample_coded_fraction(Path(folder), components, variant)
    if sampled is None and origin.get("origin") == "hub":  # planned from the Hub's metadata: its files are not here
        return hub_coded_fraction(origin["model"], origin["commit"], components, variant)
    return sampled or ESTIMATED


def run_machine_plan(args: argparse.Namespace, pipeline: Any, origin: dict[str, Any] | None = None) -> int:
    """The plan for the machine of `args`; the lossless form priced at the model's own sampled fraction where
    `origin` (where the model came from) names a folder holding its weights."""
    from layerstream.errors import LayerstreamError
    from layerstream.machine.planner import Machine, MachinePlanError, check_machine, measured_block_seconds, plan_for_machine
    from layerstream.runtime.packing.lossless_code import pricing_at

    given = {name: getattr(args, name) for name in _MACHINE_FIELDS}
    if args.vae_use_tiling is not None:
        given["vae_use_tiling"] = args.vae_use_tiling
    machine = Machine(
        device_memory_gb=args.device_memory, host_memory_gb=args.host_memory, allow_lossy=args.allow_lossy,
        **{k: v for k, v in given.items() if v is not None},
    )  # fmt: skip
    generation, work = planned_generation_of(args, pipeline)
    try:
        check_machine(machine)
        # lossless is priced (a sample read, a Hub's ranged reads) only where the plan may choose it: not beside float8
        fraction = None if machine.allow_lossy else lossless_fraction(pipeline, origin or {}, args.variant)
        with pricing_at(fraction) if fraction is not None else contextlib.nullcontext():
            result = plan_for_machine(pipeline, machine, generation=generation)
            if args.measure:
                from layerstream.offload import default_device

                seconds = measured_block_seconds(pipeline, result.config, generation.as_size(), default_device())
                result = plan_for_machine(pipeline, machine, generation=generation, block_seconds=seconds)
    except MachinePlanError as e:  # "host_memory_gb = 3: ... (set by baseline_gb)" -> "--host-memory = 3: ... (set by --baseline-gb)"
        raise CliError(re.sub(_FIELD_NAMES, lambda name: _FLAG_OF[name.group()], str(e))) from e
    except LayerstreamError as e:  # the recommended config refused (float8 with a disk tier before its support)
        raise CliError(" ".join(f"the recommended configuration: {e}".split())) from e
    lossless = any(o.get("storage_dtype") == "lossless" for o in result.config.get("layer_options", {}).values())
    if args.json:
        print(json.dumps({**result.to_dict(), **({"lossless_fraction": dataclasses.asdict(fraction)} if lossless else {})}, indent=2))
    else:
        print("\n".join(machine_plan_lines(result)))
        print(work)
        if lossless:
            print(f"lossless priced at {fraction.describe()}")
    return 0


def planned_generation_of(args: argparse.Namespace, pipeline: Any):
    """The generation to plan for: --height/--width/--num-frames/--steps, each left out taken from the model's
    rules (`ModelRules`, read from the skeleton under the model's name: an embedded tiny model's own small size
    and steps, a real model's its pipeline's), as `Omni` would run it; each figure says where it came from. A size
    the model cannot make is refused as `generate` refuses it (`ModelRules.check_geometry`), before any tracing, and
    so is one over the work cap (`_work_line`). Returns (the generation, its price as a line)."""
    from layerstream.models.generation_size import planned_generation
    from layerstream.models.model_rules import read_model_rules

    given = {name: getattr(args, name, None) for name in _GENERATION_FLAGS}
    rules = read_model_rules(pipeline, args.model)
    violations = rules.check_geometry(height=given["height"], width=given["width"], num_frames=given["num_frames"])
    if violations:
        wrong = violations[0]
        raise CliError(f"{_GENERATION_FLAGS[wrong.name]} = {wrong.value} is not valid; expected {wrong.allowed} for {args.model}")
    return planned_generation(rules, **given, sources=_GENERATION_FLAGS), _work_line(args, rules, given)


def _work_line(args: argparse.Namespace, rules: Any, given: dict) -> str:
    """The planned generation's price (`models.work.price_request`, as `serve` and `generate` price it) against
    --max-work, which is held (exit 2 over it, before any tracing), or else an accelerator's default cap (a plan is
    for one, whatever this machine has), which is only compared, in words."""
    from layerstream.models.output_limits import DEFAULT_MAX_FRAMES, DEFAULT_MAX_SIDE_PIXELS
    from layerstream.models.work import price_request
    from layerstream.request import GenerationRequest

    request = GenerationRequest(prompt="", **given)  # each flag parsed within the request's bounds
    price = price_request(rules, request, max_side_pixels=DEFAULT_MAX_SIDE_PIXELS)
    caps = dict(max_work=args.max_work, max_side=DEFAULT_MAX_SIDE_PIXELS, max_frames=DEFAULT_MAX_FRAMES, device="cuda")
    if args.max_work is not None:
        cap = check_work(price, rules, **caps)  # a cap the user set is held, as generate and serve hold it
        return f"work: priced at {price.work:,}, of at most {cap:,} (--max-work): {price.describe()}"
    cap = work_cap(rules, **caps)  # a plan of what a server would refuse still says what it needs
    within = "within" if price.work <= cap else "over (serve and generate would refuse it without --max-work)"
    return f"work: priced at {price.work:,}, {within} an accelerator's default cap of {cap:,}: {price.describe()}"


def machine_plan_lines(result) -> list[str]:
    from layerstream.wording import format_bytes, format_seconds

    m, stages = result.machine, result.stage_seconds_per_step
    device, host = result.device_phases, result.host_phases
    lines = [
        f"on a machine of {m.device_memory_gb:g} GB device, {m.host_memory_gb:g} GB host, link {m.link_gbps:g} GB/s, "
        f"disk {m.disk_gbps:g} GB/s: it runs",
        f"  device: {format_bytes(result.device_nbytes)} of {m.device_memory_gb:g} GB at its peak, in {device.peak.phase} "
        f"({_slots(result.placement)}; "
        f"{result.activation_reserve_gb:.3g} GB left beside the weights and the ring for the largest phase)",
        *(f"    {phase.describe()}" for phase in device.phases),
        *([f"  VAE decode: {result.decode.summary()}{_decode_time(result)}"] if result.decode is not None else []),
        f"  host:   {format_bytes(result.host_nbytes)} of {m.host_memory_gb:g} GB while it generates, "
        f"{format_bytes(host.phase('loading and enabling').nbytes)} while it loads and enables",
        *(f"    {phase.describe()}" for phase in host.phases),
        f"  host reserve: {result.host_reserve.describe()}",
        f"  disk:   {format_bytes(result.disk_nbytes)} of blocks read from disk",
        f"  per step ({m.forwards_per_step} forwards): {format_bytes(result.link_nbytes_per_step)} over the link, "
        f"{format_bytes(result.disk_nbytes_per_step)} from disk",
        f"  generation: {result.generation.describe()}, {result.generation.num_inference_steps} steps",
        f"  predicted: {format_seconds(result.seconds_per_step)} per step, bound by {result.bound} (compute "
        f"{format_seconds(stages['compute'])}, link {format_seconds(stages['link'])}, disk {format_seconds(stages['disk'])} alone)",
        f"  compute per block: {result.compute_source}",
        f"  {result.host_budget.describe()}",
        *(f"  note: {n}" for n in result.notes),
        "config to paste:",
        f"  --diffusion-offload-config '{json.dumps(dict(result.config))}'",
    ]
    return lines


def _decode_time(result) -> str:
    from layerstream.wording import format_seconds

    if result.decode_seconds is None:
        return ""
    return f", about {format_seconds(result.decode_seconds)} (its convolutions' FLOPs at the step's compute rate)"


def _slots(placement) -> str:
    """The slot ring, or "no slots" where nothing streams (everything fits on the device)."""
    from layerstream.wording import format_bytes

    if not placement.num_slots:
        return "no slots: nothing streams"
    return f"{placement.num_slots} slots of {format_bytes(placement.slot_nbytes)}"

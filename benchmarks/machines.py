"""The machines people own: what `layerstream plan` recommends for Wan 2.2 T2V-A14B and TI2V-5B, Flux.1-dev,
Qwen-Image and HunyuanVideo (`published_models`: meta skeletons of their real sizes, nothing downloaded) at their
usual sizes on 8, 12, 16 and 24 GB of device memory with 16, 32 and 64 GB of RAM: the config, each phase's device
peak, the predicted seconds per step for the stated link, disk and compute, or "does not fit" with what would.

    python benchmarks/machines.py                 # the markdown tables of docs/planning.md
    python benchmarks/machines.py --json          # every row as JSON (benchmarks/results/machines.json)
    python benchmarks/machines.py --models "Wan 2.2 T2V-A14B" --devices 8,16 --hosts 32
    python benchmarks/machines.py --models "Wan 2.2 T2V-A14B" --dit-format Q4_K_M   # the DiTs from GGUF files

Every row is `plan_for_machine`, the code of `layerstream plan --device-memory D --host-memory H --height ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from published_models import MODELS, skeleton  # noqa: E402

from layerstream.machine.figures import DEFAULT_DEVICE_TFLOPS, DEFAULT_DISK_GBPS, DEFAULT_LINK_GBPS  # noqa: E402
from layerstream.machine.planner import DeviceTooSmallError, Machine, MachinePlanError, plan_for_machine  # noqa: E402

DEVICES_GB = (8, 12, 16, 24)
HOSTS_GB = (16, 32, 64)
PHASE_COLUMNS = ("prompt encoding", "denoising", "VAE decode")


def plan_row(pipe: Any, rules: Any, size: tuple[int, int, int], device_gb: float, host_gb: float, args: argparse.Namespace) -> dict[str, Any]:
    """One machine's plan for one generation, as plain data (what the tables print)."""
    from layerstream.models.generation_size import planned_generation

    height, width, frames = size
    generation = planned_generation(rules, height=height, width=width, num_frames=frames if frames > 1 else None)
    machine = Machine(
        device_memory_gb=device_gb, host_memory_gb=host_gb, link_gbps=args.link_gbps, disk_gbps=args.disk_gbps,
        device_tflops=args.device_tflops,
    )  # fmt: skip
    row: dict[str, Any] = {"size": list(size), "device_gb": device_gb, "host_gb": host_gb, "steps": generation.num_inference_steps}
    try:
        plan = plan_for_machine(pipe, machine, generation=generation)
    except DeviceTooSmallError as e:
        return row | {"fits": False, "refused": "device", "phase": e.peak.phase, "peak_bytes": e.peak.nbytes, "would_fit": list(e.would_fit), "message": str(e)}
    except MachinePlanError as e:
        return row | {"fits": False, "refused": "host", "message": str(e)}
    dit = plan.config["layer_options"]["dit"]
    dits = [c.path for c in plan_components(pipe, plan.config) if c.category == "dit"]
    resident = sum(len(plan.placement.residency[p].resident_block_paths) for p in dits)
    blocks = sum(plan.placement.residency[p].num_blocks for p in dits)
    return row | {
        "fits": True,
        "config": dict(plan.config),
        "text_encoder_streams": "text_encoder" in plan.config["components"],
        "resident_blocks": resident, "dit_blocks": blocks,
        "storage_dtype": dit.get("storage_dtype"),
        "host_budget_gb": plan.config.get("host_budget_gb"),
        "decode_tiled": any("tiled" in n and n.startswith("the VAE decode") for n in plan.notes),
        "phases": {p.phase: p.nbytes for p in plan.device_phases.phases},
        "device_peak_bytes": plan.device_nbytes, "bounded_by": plan.device_phases.peak.phase,
        "host_bytes": plan.host_nbytes, "disk_bytes": plan.disk_nbytes, "disk_bytes_per_step": plan.disk_nbytes_per_step,
        "seconds_per_step": plan.seconds_per_step, "bound": plan.bound, "stage_seconds_per_step": dict(plan.stage_seconds_per_step),
        "notes": list(plan.notes),
    }  # fmt: skip


def plan_components(pipe: Any, config: Any) -> Any:
    """The resolved components of a recommended config (the placement keeps their paths, not their categories)."""
    from layerstream.config.offload_config import parse_offload_config
    from layerstream.plan.resolver import resolve_offload_plan

    return resolve_offload_plan(pipe, parse_offload_config(dict(config))).components


DIT_FORMATS = {
    # the GGUF block type of each weight; Q4_K_M: Q6_K for the value and feed-forward-out projections (as
    # llama.cpp's _M mixes give the most sensitive tensors), Q4_K for the rest: an estimate of published files
    "Q8_0": {"": "Q8_0"},
    "Q4_K_M": {".to_v.": "Q6_K", ".ffn.net.2.": "Q6_K", "": "Q4_K"},
    "fp8_scaled": {"": "fp8_scaled"},
}


def with_dit_format_(pipe: Any, fmt: str) -> Any:
    """`pipe` (a skeleton) with every DiT block's Linear weights at the bytes a `fmt` single file keeps on the host
    (`models.component_skeleton` reads them from a real file's header): uint8 GGUF blocks, or float8 with a
    float32 scale; everything else as the skeleton has it."""
    import torch

    from layerstream.plan.resolver import resolve_offload_plan
    from layerstream.config.offload_config import parse_offload_config

    plan = resolve_offload_plan(pipe, parse_offload_config({"mode": "layer", "components": ["dit"]}))
    for component in (c for c in plan.components if c.category == "dit"):
        root = pipe.components[component.path]
        for name, linear in root.named_modules():
            if not isinstance(linear, torch.nn.Linear) or "blocks." not in name:
                continue
            rows, cols = linear.weight.shape
            kind = next(k for pattern, k in DIT_FORMATS[fmt].items() if pattern in f".{name}.")
            if fmt == "fp8_scaled":
                stored = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device="meta")
                linear.weight = torch.nn.Parameter(stored, requires_grad=False)
                linear.register_buffer("weight_scale", torch.empty((), device="meta"))
                continue
            import gguf
            from diffusers.quantizers.gguf.utils import GGUFParameter

            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
            stored = torch.empty(rows, cols // block * block_bytes, dtype=torch.uint8, device="meta")
            # a GGUF weight of its type, as loading a file makes it: the planner prices its dequantisation by type
            linear.weight = GGUFParameter(stored, quant_type=gguf.GGMLQuantizationType[kind])
    return pipe


def model_rows(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    from layerstream.models.model_rules import read_model_rules

    model = MODELS[name]
    pipe = skeleton(name)
    if args.dit_format:
        pipe = with_dit_format_(pipe, args.dit_format)
        name = f"{name}, DiTs {args.dit_format}"
    rules = read_model_rules(pipe, model.hub_id)
    rows = []
    for size in model.sizes:
        for device_gb in args.devices:
            for host_gb in args.hosts:
                started = time.perf_counter()
                rows.append({"model": name, "hub_id": model.hub_id, **plan_row(pipe, rules, size, device_gb, host_gb, args)})
                print(f"{name} {size} {device_gb:g}/{host_gb:g} GB: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return rows


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f}"


def _device_side(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["resident_blocks"], row["text_encoder_streams"], row["decode_tiled"]


def _config_cell(row: dict[str, Any], *, form: bool = True) -> str:
    """The device side of a row's config (its RAM moves it only where the text encoder or the lossless form
    changes with the host's room: `_time_cell` says so) and, with `form`, the DiT's stored form."""
    parts = [f"{row['resident_blocks']}/{row['dit_blocks']} blocks resident"]
    parts.append("text encoder streamed" if row["text_encoder_streams"] else "text encoder resident")
    if row["decode_tiled"]:
        parts.append("**tiled decode**")
    if form and row["storage_dtype"]:
        parts.append(row["storage_dtype"])
    return ", ".join(parts)


def _time_cell(row: dict[str, Any], shown: dict[str, Any] | None) -> str:
    """Seconds per step, what bounds it, and where the config differs from the row's (`shown`)."""
    if row["fits"]:
        disk = f", {_gb(row['disk_bytes_per_step'])} GB/step from disk" if row["disk_bytes_per_step"] else ""
        lossless = " lossless" if row["storage_dtype"] == "lossless" else ""
        other = f"; {_config_cell(row, form=False)}" if shown is not None and _device_side(row) != _device_side(shown) else ""
        return f"{row['seconds_per_step']:.3g} s ({row['bound']}{lossless}{disk}{other})"
    if row["refused"] == "host":
        return "no: " + row["message"].split(": ", 1)[-1].split(" (")[0].replace("host_budget_gb = \"auto\": ", "")[:60] + "..."
    return "-"


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """One table per model and size: a row per device (its config and phase peaks, which the RAM does not move),
    and the seconds per step with each RAM."""
    lines = [
        f"Link {args.link_gbps:g} GB/s, disk {args.disk_gbps:g} GB/s, compute {args.device_tflops:g} TFLOPS (a card with T "
        f"TFLOPS takes {args.device_tflops:g}/T times the compute); phases in GB at their device peak; s per step of 2 forwards.",
        "",
    ]
    for (model, size), group in _groups(rows).items():
        height, width, frames = size
        frames_text = f" x {frames} frames" if frames > 1 else ""
        lines += [f"**{model}** at {width}x{height}{frames_text}, {group[0]['steps']} steps", ""]
        header = ["device", "config (device)", *PHASE_COLUMNS, *(f"{h:g} GB RAM" for h in args.hosts)]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for device_gb in args.devices:
            cells = [r for r in group if r["device_gb"] == device_gb]
            fitting = next((r for r in cells if r["fits"]), None)
            refused = next((r for r in cells if not r["fits"] and r["refused"] == "device"), None)
            if fitting is not None:
                phases = [(_gb(fitting["phases"][p]) + ("*" if p == fitting["bounded_by"] else "")) if p in fitting["phases"] else "-" for p in PHASE_COLUMNS]
                row = [f"{device_gb:g} GB", _config_cell(fitting), *phases, *(_time_cell(r, fitting) for r in cells)]
            elif refused is not None:
                why = f"does not fit: {refused['phase']} needs {_gb(refused['peak_bytes'])} GB; fits with {'; or '.join(refused['would_fit'])}"
                row = [f"{device_gb:g} GB", why, *("-" for _ in PHASE_COLUMNS), *("-" for _ in cells)]
            else:
                row = [f"{device_gb:g} GB", "host refused at every RAM size", *("-" for _ in PHASE_COLUMNS), *(_time_cell(r, None) for r in cells)]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    lines.append("\\* the phase that bounds the device. A tiled decode blends its tiles' edges: not bit-identical to an untiled one.")
    return "\n".join(lines)


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]]:
    groups: dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], tuple(row["size"])), []).append(row)
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names (default: all)")
    parser.add_argument("--devices", default=",".join(map(str, DEVICES_GB)), help="device memories, GB")
    parser.add_argument("--hosts", default=",".join(map(str, HOSTS_GB)), help="host memories, GB")
    parser.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS)
    parser.add_argument("--disk-gbps", type=float, default=DEFAULT_DISK_GBPS)
    parser.add_argument("--device-tflops", type=float, default=DEFAULT_DEVICE_TFLOPS)
    parser.add_argument("--json", action="store_true", help="every row as JSON instead of the markdown tables")
    parser.add_argument("--dit-format", choices=sorted(DIT_FORMATS), default=None, help="the DiTs as from single files of this format")
    args = parser.parse_args(argv)
    args.devices = [float(x) for x in args.devices.split(",")]
    args.hosts = [float(x) for x in args.hosts.split(",")]
    names = [n.strip() for n in args.models.split(",")]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: {unknown[0]!r} is not one of {', '.join(MODELS)}")
    rows = [row for name in names for row in model_rows(name, args)]
    if args.json:
        machine = {"link_gbps": args.link_gbps, "disk_gbps": args.disk_gbps, "device_tflops": args.device_tflops}
        print(json.dumps({"schema": 1, "machine": machine, "rows": rows}, indent=1))
    else:
        print(markdown(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

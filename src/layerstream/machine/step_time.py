"""The seconds a denoising step takes on a machine: per block the longest of compute, link and disk, each stage
running ahead of the next (`timing.ideal.ideal_forward_seconds_with_disk`, the benchmarks' ideal), from the bytes
each block moves and its compute: measured on the device (`measured_block_seconds`) or estimated from its FLOPs at
the device's throughput (`block_flops`)."""

from __future__ import annotations

import inspect
import statistics
from collections.abc import Mapping
from typing import Any

import torch

from layerstream.models.generation_estimates import block_flops
from layerstream.plan.placement import Placement
from layerstream.runtime.packing.lossless_code import priced_fraction
from layerstream.timing import ideal
from layerstream.timing.block_timer import BlockTimer
from layerstream.wording import GB, format_seconds

from layerstream.machine.figures import DEQUANT_GBPS_CPU, DEQUANT_GBPS_DEVICE, DEVICE_DECODE_GBPS, Machine


def block_compute(pipeline, placement: Placement, block_seconds, tokens: int, machine: Machine) -> tuple[dict[str, float], str]:
    """Each block's compute seconds, and where they come from: measured (the dequantisation of GGUF and fp8_scaled
    weights included, as it runs in each forward), or its FLOPs at the device's throughput plus that
    dequantisation at the measured rates (`dequant_seconds`)."""
    from layerstream.plan.resolved import lookup

    paths = [p for c in placement.chains for p in c.block_paths] + [p for r in placement.residency.values() for p in r.resident_block_paths]
    if block_seconds:
        typical = statistics.median(block_seconds.values())  # resident blocks are not in the trace: a DiT's blocks are alike
        return {p: block_seconds.get(p, typical) for p in paths}, "measured on the device: one step, median per block"
    rate = machine.device_tflops * 1e12
    dequant = {p: dequant_seconds(lookup(pipeline, p), machine) for p in paths}
    compute = {p: block_flops(lookup(pipeline, p), tokens) / rate + dequant[p] for p in paths}
    source = f"estimated: the blocks' FLOPs at {tokens} tokens and device_tflops {machine.device_tflops:g}"
    if any(dequant.values()):
        on_device = f"an assumed {DEQUANT_GBPS_DEVICE:g} GB/s"
        rate = "the CPU's measured rates" if machine.device_type == "cpu" else on_device
        most = format_seconds(max(dequant.values()))
        source += f", plus dequantising GGUF and fp8_scaled weights at every call ({most} a block at most, {rate})"
    return compute, source


def dequant_seconds(block, machine: Machine) -> float:
    """Seconds one call of `block` spends dequantising its GGUF-quantized and fp8_scaled weights (into bfloat16
    bytes, the rates' unit): each weight once per call of its Linear."""
    seconds = 0.0
    for module in block.modules():
        weight = getattr(module, "weight", None)
        quant_type = getattr(weight, "quant_type", None)
        if quant_type is not None:  # diffusers' GGUFParameter: rows of `type_size`-byte blocks of `block_size` weights
            import gguf

            block_size, type_size = gguf.GGML_QUANT_SIZES[quant_type]
            kind, num_weights = quant_type.name, weight.numel() // type_size * block_size
        elif isinstance(weight, torch.Tensor) and hasattr(module, "weight_scale"):
            kind, num_weights = "fp8_scaled", weight.numel()
        else:
            continue
        rate = DEQUANT_GBPS_CPU.get(kind, min(DEQUANT_GBPS_CPU.values()))  # a type not measured: the slowest
        if machine.device_type != "cpu":
            rate = DEQUANT_GBPS_DEVICE
        seconds += 2 * num_weights / (rate * GB)
    return seconds


def step_seconds(
    plan, placement: Placement, streamed: Mapping[str, int], compute: Mapping[str, float], machine: Machine, steps: int,
) -> dict[str, float]:  # fmt: skip
    """Bytes and seconds of one denoising step: `forwards_per_step` forwards of the DiT that runs (of DiTs
    that alternate, the slower one; others run one after the other), and, spread over a generation of `steps`,
    the first forward of each alternating DiT, which reads its pooled blocks from disk (`forward_seconds`)."""
    tier = placement.host_tier
    per_dit: dict[str, dict[str, float]] = {}
    entering: dict[str, dict[str, float]] = {}
    for comp in plan.streamed:
        if comp.category != "dit":
            continue
        blocks = [p for s in comp.stacks for p in s.block_paths]
        cast, decode = comp.storage_dtype not in (None, "lossless"), comp.storage_dtype == "lossless"
        per_dit[comp.path] = forward_seconds(blocks, streamed, compute, machine, tier, cast=cast, decode=decode)
        if comp.alternates and tier is not None and any(tier.pooled(p) for p in blocks):
            entering[comp.path] = forward_seconds(blocks, streamed, compute, machine, tier, cast=cast, decode=decode, pooled=True)
    alternating = [c.path for c in plan.streamed if c.alternates and c.path in per_dit]
    running = [p for p in per_dit if p not in alternating]
    if alternating:
        running.append(max(alternating, key=lambda p: per_dit[p]["seconds"]))
    keys = ("seconds", "link_bytes", "disk_bytes", "compute_s", "link_s", "disk_s")
    total = {k: machine.forwards_per_step * sum(per_dit[p][k] for p in running) for k in keys}
    for path, first in entering.items():  # once a generation each: the pool's reads, over `steps` steps
        for k in keys:
            total[k] += (first[k] - per_dit[path][k]) / steps
    return {k: (round(v) if k.endswith("bytes") else v) for k, v in total.items()}


def forward_seconds(
    blocks, streamed, compute, machine: Machine, tier, *, cast: bool, decode: bool = False, pooled: bool = False,
) -> dict[str, float]:  # fmt: skip
    """One forward of a DiT's `blocks`: each block's compute (plus the compute time its copy, cast and read take
    from the cores where they share them, `Machine.host_copy_s_per_gb`), link and disk; `pooled`: the first
    forward after a change of expert, whose pooled blocks are read from disk too; `decode`: lossless blocks,
    decoded after each copy on the copy stream (the link stage)."""
    moved = [p in streamed for p in blocks]
    on_disk = [tier is not None and (tier.on_disk(p) or (pooled and tier.pooled(p))) for p in blocks]
    sizes = [streamed.get(p, 0) for p in blocks]
    per_gb = machine.host_copy_s_per_gb + (machine.host_cast_s_per_gb if cast else 0.0)
    fraction = priced_fraction().value  # the checkpoint's sampled figure where `layerstream plan` read it
    if decode:  # per decoded GB: a coded GB decodes to 1 / fraction
        per_gb += machine.host_decode_s_per_gb / fraction
    compute_s = [
        compute[p] + (n * per_gb * m + n * machine.host_copy_s_per_gb * d) / GB for p, n, m, d in zip(blocks, sizes, moved, on_disk)
    ]  # fmt: skip
    link_s = ideal.block_transfer_seconds(sizes, moved, machine.link_gbps)
    if decode:
        link_s = [t + (n / fraction / (machine.decode_gbps * GB) if m else 0.0) for t, n, m in zip(link_s, sizes, moved)]
    disk_s = ideal.block_transfer_seconds(sizes, on_disk, machine.disk_gbps)
    disk_stage_s = disk_s
    if machine.copy_and_read_share_a_core:  # one core reads, then copies: the link stage is its busy time
        link_s, disk_stage_s = [t + d for t, d in zip(link_s, disk_s)], [0.0] * len(disk_s)
    return {
        "seconds": ideal.ideal_forward_seconds_with_disk(compute_s, link_s, disk_stage_s),
        "link_bytes": sum(n for n, m in zip(sizes, moved) if m),
        "disk_bytes": sum(n for n, d in zip(sizes, on_disk) if d),
        "compute_s": sum(compute_s), "link_s": sum(link_s), "disk_s": sum(disk_s),
    }  # fmt: skip


def decode_rate(machine: Machine) -> str:
    if machine.decode_gbps == DEVICE_DECODE_GBPS:
        return f"an assumed {DEVICE_DECODE_GBPS:g} GB/s"
    return f"{machine.decode_gbps:.3g} GB/s"


def measured_block_seconds(pipeline: Any, config: Mapping[str, Any], size: Mapping[str, int], device: torch.device) -> dict[str, float]:
    """Each DiT block's compute time in one denoising step on `device` with `config` enabled, median per block:
    for a streamed block the compute interval of the runtime's own trace (from when its weights were ready),
    for a resident one the time between its forward hooks. The pipeline is left as it was."""
    from layerstream.offload import enable_offload
    from layerstream.plan.resolved import lookup

    handle = enable_offload(pipeline, dict(config), device=device, trace=True)
    try:
        paths = [p for c in handle.plan.streamed if c.category == "dit" for s in c.stacks for p in s.block_paths]
        kwargs = {"prompt": "a", "num_inference_steps": 1, "output_type": "latent", **size}
        accepted = inspect.signature(pipeline.__call__).parameters

        def one_step() -> None:
            with torch.inference_mode():
                pipeline(**{k: v for k, v in kwargs.items() if k in accepted})

        timer = BlockTimer([lookup(pipeline, p) for p in paths], device)
        try:
            one_step()
            hooks = {p: statistics.median(t) for p, t in zip(paths, timer.seconds()) if t}
        finally:
            timer.remove()
        runs: dict[str, list[float]] = {}
        for interval in handle.trace().lane("compute"):
            runs.setdefault(interval.label, []).append(interval.end - interval.start)
    finally:
        handle.disable()
    return {p: statistics.median(runs[p]) if p in runs else hooks[p] for p in paths if p in runs or p in hooks}

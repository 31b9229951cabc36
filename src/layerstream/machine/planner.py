"""A plan for a machine given by its figures: will the model run there, how, and how fast.

`plan_for_machine` picks the configuration `"auto"` settings would reach on that machine: the DiT streamed
with residency "auto" filling the device (its memory minus the activation reserve), the text encoder streamed
too where keeping it resident would not leave room for the slot ring, float8 storage only when lossy storage is
allowed, and the host budget `host_budget_gb: "auto"` would choose (`plan.host_budget`, from the host memory
minus the process's baseline). It places the blocks with the same placement as enabling, and predicts the
seconds per step with the benchmarks' ideal (`timing.ideal.ideal_forward_seconds_with_disk`: per block the
longest of compute, link and disk, each stage running ahead of the next) from the bytes each block moves and
its compute: measured on the device (`measured_block_seconds`) or estimated from its FLOPs at the device's
throughput (`block_flops`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from layerstream.config.offload_config import DEFAULT_ACTIVATION_RESERVE_GB, parse_offload_config
from layerstream.errors import LayerstreamError
from layerstream.host.reserve import HostReserve, host_reserve_for
from layerstream.models.generation_estimates import block_activation_nbytes, latent_tokens
from layerstream.plan.host_budget import HostBudgetChoice, choose_host_budget, host_needs
from layerstream.runtime.packing.lossless_code import priced_fraction
from layerstream.plan.placement import Placement
from layerstream.timing import ideal
from layerstream.timing.block_timer import BlockTimer
from layerstream.wording import GB, format_gb

if TYPE_CHECKING:
    from layerstream.models.generation_size import GenerationSize

PROCESS_BASELINE_GB = 0.41
"""Host memory of a Python process that has imported torch, diffusers, transformers and layerstream, before any
model: 0.40 GB resident, measured with torch 2.13 (CPU build) on Linux."""
CUDA_CONTEXT_GB = 1.0
"""Host memory a CUDA context and its libraries add to the process (an allowance, not measured here)."""
DEFAULT_LINK_GBPS = 25.0
"""Host-to-device copies from pinned memory on PCIe 4.0 x16 (about 25 of its 32 GB/s)."""
DEFAULT_DISK_GBPS = 3.0
"""A PCIe 3.0 NVMe disk reading large blocks."""
DEFAULT_DEVICE_TFLOPS = 150.0
"""Dense bfloat16 throughput a 24 GB GPU of the RTX 4090 class sustains in large matmuls (about 165 peak)."""
TEXT_TOKENS = 512
"""Text tokens a cross-attention attends to (UMT5's and T5's maximum in Wan and Flux)."""
FORWARDS_PER_STEP = 2
"""Transformer forwards per denoising step: classifier-free guidance runs the model on the prompt and without."""
Bound = Literal["compute", "link", "disk"]


class MachinePlanError(LayerstreamError, ValueError):
    """A machine the model cannot run on, or figures that make no sense; the message says which and why."""


DEVICE_DECODE_GBPS = 100.0
"""Decoded bytes per second the lossless form's decode is assumed to reach on an accelerator (elementwise torch
ops over a block on the copy stream: about 60 small kernels per step of 2^22 elements with three tiers, so launches
may bound it below this); an assumption until `benchmarks/gpu.sh` measures it where a GPU is present."""


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The machine to plan for (GB are 1e9 bytes, GB/s 1e9 bytes per second)."""

    device_memory_gb: float
    host_memory_gb: float
    """The whole process's host memory, Python and libraries included (`baseline_gb`)."""
    link_gbps: float = DEFAULT_LINK_GBPS
    disk_gbps: float = DEFAULT_DISK_GBPS
    device_tflops: float = DEFAULT_DEVICE_TFLOPS
    baseline_gb: float = PROCESS_BASELINE_GB + CUDA_CONTEXT_GB
    """What the process holds before the model: the imports and the device's context."""
    host_reserve_gb: float | None = None
    """Host memory kept free for what a generation allocates (as `host_reserve_gb` in the config); None: the
    estimate for the generation planned (`host.reserve`)."""
    allow_lossy: bool = False
    """Whether float8 storage (lossy, rounded once) may be recommended."""
    forwards_per_step: int = FORWARDS_PER_STEP
    host_copy_s_per_gb: float = 0.0
    """Compute time lost per GB the copy and read threads move, where they share the compute's cores: on a CPU
    device, whose copies into slots and reads from disk are the host's own work (0 on an accelerator, whose
    copies are its DMA engines'). A measured figure of the machine (`benchmarks/headline.py` measures it)."""
    host_cast_s_per_gb: float = 0.0
    """The same per GB of float8 bytes cast back to the compute dtype on the copy thread (a CPU device's table
    lookups, `runtime/packing/upcast.py`; 0 on an accelerator, which casts in a kernel beside compute)."""
    decode_gbps: float = DEVICE_DECODE_GBPS
    """Decoded GB per second of the lossless form's decode, which runs after each copy, before the block is
    ready (the link stage): on an accelerator elementwise kernels (assumed, `DEVICE_DECODE_GBPS`); on a
    CPU device the copy thread's own rate beside compute, a measured figure of the machine."""
    host_decode_s_per_gb: float = 0.0
    """Compute time lost per decoded GB where the decode shares the compute's cores (a CPU device's copy
    thread; 0 on an accelerator)."""
    copy_and_read_share_a_core: bool = False
    """Whether the copy thread (copy, cast, decode) and the disk reads share one core (a CPU device with one
    core left beside compute): a block's read and its transfer then run one after the other, the transfer
    stage their sum, instead of overlapping as a DMA engine and a disk do (False)."""


@dataclass(frozen=True)
class MachinePlan:
    """The recommended configuration on a machine, what it puts where, and the predicted seconds per step."""

    machine: Machine
    config: Mapping[str, Any]
    """The `diffusion_offload_config` to paste (explicit figures: the same placement on any machine)."""
    placement: Placement
    host_budget: HostBudgetChoice
    device_nbytes: int
    host_nbytes: int
    """Host memory of the whole process: baseline, host store (with the pool), staging ring and reserve."""
    disk_nbytes: int
    """Bytes of the blocks that live on disk (read from the checkpoint or spill files)."""
    link_nbytes_per_step: int
    disk_nbytes_per_step: int
    seconds_per_step: float
    stage_seconds_per_step: Mapping[str, float]
    """Busy time per step of each stage alone: compute, link, disk."""
    compute_source: str
    tokens: int
    notes: tuple[str, ...] = field(default=())
    activation_reserve_gb: float = DEFAULT_ACTIVATION_RESERVE_GB
    """Device memory left beside the resident parts for a forward's activations (`activation_reserve`)."""
    host_reserve: HostReserve | None = None
    """Host memory kept for what a generation allocates beside the store, and how it was reached."""
    generation: GenerationSize | None = None
    """The generation planned for (size, frames, steps, tokens), each figure with where it came from."""

    @property
    def bound(self) -> Bound:
        return max(("compute", "link", "disk"), key=lambda s: self.stage_seconds_per_step[s])

    def to_dict(self) -> dict[str, Any]:
        return {
            "machine": vars(self.machine),
            "generation": self.generation.to_dict() if self.generation is not None else None,
            "recommended": {
                "diffusion_offload_config": dict(self.config),
                "bytes": {"device": self.device_nbytes, "host": self.host_nbytes, "disk": self.disk_nbytes},
                "per_step": {"link_bytes": self.link_nbytes_per_step, "disk_bytes": self.disk_nbytes_per_step},
                "predicted_seconds_per_step": self.seconds_per_step,
                "bound": self.bound,
                "stage_seconds_per_step": dict(self.stage_seconds_per_step),
                "compute": self.compute_source,
                "tokens": self.tokens,
                "activation_reserve_gb": self.activation_reserve_gb,
                "host_reserve": self.host_reserve.to_dict() if self.host_reserve is not None else None,
                "host_budget": self.host_budget.to_dict(),
                "placement": self.placement.to_dict(),
                "notes": list(self.notes),
            },
        }


def check_machine(machine: Machine) -> None:
    """One clear error for figures that cannot describe a machine (the CLI checks its flags the same way)."""
    for name in ("device_memory_gb", "host_memory_gb", "link_gbps", "disk_gbps", "device_tflops", "decode_gbps"):
        value = getattr(machine, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise MachinePlanError(f"{name} = {value!r} is not valid; expected a finite number > 0")
    reserve = machine.host_reserve_gb
    if reserve is not None and (isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < float("inf")):
        raise MachinePlanError(f"host_reserve_gb = {machine.host_reserve_gb!r} is not valid; expected a finite number >= 0")
    for name in ("host_copy_s_per_gb", "host_cast_s_per_gb", "host_decode_s_per_gb"):
        value = getattr(machine, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise MachinePlanError(f"{name} = {value!r} is not valid; expected a finite number >= 0 (0: an accelerator's copies)")
    if isinstance(machine.baseline_gb, bool) or not 0 <= machine.baseline_gb < float("inf"):
        raise MachinePlanError(f"baseline_gb = {machine.baseline_gb!r} is not valid; expected a finite number >= 0")
    if machine.host_memory_gb <= machine.baseline_gb:
        raise MachinePlanError(
            f"host_memory_gb = {machine.host_memory_gb:g} is not valid; expected more than the process's baseline of "
            f"{machine.baseline_gb:g} GB before any model (imports and the device's context; set by baseline_gb)"
        )


def recommended_config(
    pipeline: Any, machine: Machine, *, text_encoder: bool, host_budget_gb: float | None,
    activation_reserve_gb: float = DEFAULT_ACTIVATION_RESERVE_GB, lossless: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The config `"auto"` settings would reach on `machine`, with its figures written out; the device budget
    leaves `activation_reserve_gb` beside the resident parts (`activation_reserve`)."""
    device_budget = machine.device_memory_gb - activation_reserve_gb
    if device_budget <= 0:
        raise MachinePlanError(
            f"device_memory_gb = {machine.device_memory_gb:g} leaves nothing beside the activation reserve of "
            f"{activation_reserve_gb:.3g} GB; expected more than that"
        )
    dit: dict[str, Any] = {"resident_layers": "auto", "device_budget_gb": round(device_budget, 4)}
    if machine.allow_lossy:
        dit["storage_dtype"] = "float8_e4m3fn"
    elif lossless:
        dit["storage_dtype"] = "lossless"  # the same bits: no --allow-lossy needed
    config: dict[str, Any] = {"mode": "layer", "components": ["dit", "text_encoder"] if text_encoder else ["dit"]}
    config["layer_options"] = {"dit": dit}
    if host_budget_gb is not None:
        config["host_budget_gb"] = host_budget_gb
    return config


def plan_for_machine(
    pipeline: Any,
    machine: Machine,
    *,
    generation: GenerationSize | None = None,
    block_seconds: Mapping[str, float] | None = None,
    lossless: bool | None = None,
) -> MachinePlan:
    """The plan (see `_plan_for_machine`); without `allow_lossy`, where it is bound by the link or the disk, the
    lossless form (`storage_dtype: "lossless"`: fewer bytes, the same bits, a decode on the device) where it
    predicts a faster step. `lossless` True or False asks for the DiT in that form or not, whatever is faster
    (a benchmark's rows side by side). `generation` (default: the model's rules read from the pipeline,
    `pipeline_generation`) is the generation planned for: its size or `tokens` give the tokens a block sees, its
    steps spread the host pool's reads at each change of expert over a generation."""
    from layerstream.models.generation_size import pipeline_generation

    generation = generation if generation is not None else pipeline_generation(pipeline)
    if lossless is not None:
        return _plan_for_machine(pipeline, machine, generation=generation, block_seconds=block_seconds, lossless=lossless)
    plan = _plan_for_machine(pipeline, machine, generation=generation, block_seconds=block_seconds)
    if machine.allow_lossy or plan.bound == "compute":
        return plan
    coded = _plan_for_machine(pipeline, machine, generation=generation, block_seconds=block_seconds, lossless=True)
    if coded.seconds_per_step >= plan.seconds_per_step:
        return plan
    note = (
        f"the DiT is stored lossless (about {priced_fraction().value:.2f}x the bytes, the same bits, decoded on the "
        f"device at {_decode_rate(machine)}): {plan.bound}-bound, {plan.seconds_per_step:.3g} s per "
        f"step as it is, {coded.seconds_per_step:.3g} s coded"
    )
    return dataclasses.replace(coded, notes=coded.notes + (note,))


def _plan_for_machine(
    pipeline: Any,
    machine: Machine,
    *,
    generation: GenerationSize,
    block_seconds: Mapping[str, float] | None = None,
    lossless: bool = False,
) -> MachinePlan:
    """The plan (see the module docstring) for `generation` (`plan_for_machine`); `block_seconds` (block path ->
    seconds, from `measured_block_seconds`) replaces the FLOPs estimate. Raises `MachinePlanError` where it
    cannot run."""
    from layerstream.offload import plan_placement, priced_placement  # the composition root prices the stores
    from layerstream.plan.resolver import resolve_offload_plan
    from layerstream.runtime.stores.disk.staging import NUM_STAGING_BUFFERS

    check_machine(machine)
    cpu = torch.device("cpu")  # layouts are priced here; their bytes do not depend on the device
    notes: list[str] = []
    if generation.num_inference_steps is None:
        raise MachinePlanError("num_inference_steps = None is not valid; expected the steps planned for (`planned_generation`)")
    tokens = latent_tokens(pipeline, generation.as_size()) if generation.tokens is None else generation.tokens
    reserve_gb, estimated = activation_reserve(pipeline, tokens)
    if estimated:
        notes.append(
            f"the activation reserve is {reserve_gb:.3g} GB, not the default {DEFAULT_ACTIVATION_RESERVE_GB:g}: a DiT block's "
            f"forward at {tokens} tokens holds about that much at its peak (an estimate, `block_activation_nbytes`)"
        )
    for text_encoder in (False, True):
        unbudgeted = resolve_offload_plan(
            pipeline, parse_offload_config(recommended_config(
                pipeline, machine, text_encoder=text_encoder, host_budget_gb=None, activation_reserve_gb=reserve_gb,
                lossless=lossless,
            )),
        )  # fmt: skip
        placement, host_nbytes = priced_placement(pipeline, unbudgeted, cpu)
        if _device_nbytes(unbudgeted, placement) <= machine.device_memory_gb * GB or not _has_text_encoder(unbudgeted):
            break
        notes.append("the text encoder streams: kept resident it leaves no room on the device for the slot ring")
    device_nbytes = _device_nbytes(unbudgeted, placement)
    if device_nbytes > machine.device_memory_gb * GB:
        raise MachinePlanError(
            f"device_memory_gb = {machine.device_memory_gb:g}: the resident parts and the slot ring need "
            f"{format_gb(device_nbytes)}; this model does not run on that device"
        )
    streamed = {p: host_nbytes[p] for p in placement.streamed_block_paths}
    host_reserve = host_reserve_for(
        pipeline, unbudgeted, machine.host_reserve_gb, device_is_host=False, generation=dataclasses.replace(generation, tokens=tokens)
    )
    needs = host_needs(
        unbudgeted, placement, device_is_host=False, reserve_nbytes=host_reserve.nbytes,
        num_staging_buffers=NUM_STAGING_BUFFERS, block_host_nbytes=host_nbytes, reserve_name=host_reserve.need_name,
    )  # fmt: skip
    free = round((machine.host_memory_gb - machine.baseline_gb) * GB)
    try:
        choice = choose_host_budget(
            free_nbytes=free, free_source=f"host_memory_gb {machine.host_memory_gb:g} - baseline {machine.baseline_gb:g} GB",
            streamed_nbytes=sum(streamed.values()), needs=needs, reserve_reason=host_reserve.describe() if host_reserve.parts else "",
        )  # fmt: skip
    except LayerstreamError as e:
        raise MachinePlanError(f"host_memory_gb = {machine.host_memory_gb:g}: {e}") from e
    budget_gb = None if choice.budget_gb is None else _round_down(choice.budget_gb)
    config = recommended_config(
        pipeline, machine, text_encoder=text_encoder, host_budget_gb=budget_gb, activation_reserve_gb=reserve_gb, lossless=lossless
    )
    plan = resolve_offload_plan(pipeline, parse_offload_config(config))
    placement = plan_placement(pipeline, plan, cpu)
    compute, source = _block_compute(pipeline, placement, block_seconds, tokens, machine)
    per_step = _per_step(plan, placement, streamed, compute, machine, generation.num_inference_steps)
    host_total = round(machine.baseline_gb * GB) + sum(needs.values()) - (0 if budget_gb is not None else needs["disk staging ring"])
    host_total += placement.host_tier.host_nbytes if placement.host_tier is not None else sum(streamed.values())
    tier = placement.host_tier
    return MachinePlan(
        machine, config, placement, choice, device_nbytes, host_total,
        sum(streamed[p] for p in tier.from_disk_paths) if tier is not None else 0,
        per_step["link_bytes"], per_step["disk_bytes"], per_step["seconds"],
        {k: per_step[k + "_s"] for k in ("compute", "link", "disk")}, source, tokens, tuple(notes), reserve_gb, host_reserve,
        generation,
    )  # fmt: skip


def _round_down(gb: float, digits: int = 4) -> float:
    """`gb` to `digits` significant digits, rounded down (a budget pasted back must still fit)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(gb)))
    return math.floor(gb * scale) / scale


def _has_text_encoder(plan) -> bool:
    return any(c.category == "text_encoder" and c.stacks for c in plan.components)


def _device_nbytes(plan, placement: Placement) -> int:
    """Device bytes: every module that does not stream, the resident blocks, and the slot ring."""
    streamed = set(placement.streamed_block_paths)
    resident = 0
    for comp in plan.components:
        if comp.action in ("stream", "resident"):
            block_bytes = sum(n for s in comp.stacks for p, n in zip(s.block_paths, s.block_bytes) if p in streamed)
            resident += comp.total_bytes - (block_bytes if comp.action == "stream" else 0)
    return resident + placement.ring_nbytes


def activation_reserve(pipeline: Any, tokens: int) -> tuple[float, bool]:
    """(the device memory in GB to keep free for activations, whether the estimate exceeded the default): the
    default reserve, or the largest `block_activation_nbytes` of a DiT's first block where that is more (a large
    video: Wan 2.2 at 720p x 81 frames, 75,600 tokens, holds about 5.7 GB in one block's forward)."""
    from layerstream.plan.resolved import lookup
    from layerstream.plan.resolver import resolve_offload_plan

    plan = resolve_offload_plan(pipeline, parse_offload_config({"mode": "layer", "components": ["dit"]}))
    firsts = [s.block_paths[0] for c in plan.streamed if c.category == "dit" for s in c.stacks if s.block_paths]
    estimate = max((block_activation_nbytes(lookup(pipeline, p), tokens) for p in firsts), default=0) / GB
    return (estimate, True) if estimate > DEFAULT_ACTIVATION_RESERVE_GB else (DEFAULT_ACTIVATION_RESERVE_GB, False)


def block_flops(block: nn.Module, tokens: int) -> int:
    """An estimate of one forward's FLOPs: two per weight of every linear layer per token, and per attention
    four per query-key pair and head dimension (self-attention over the tokens, cross-attention over
    `TEXT_TOKENS`). Norms, activations and rotary embeddings are left out (a few percent)."""
    flops = 2 * tokens * sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
    for name, m in block.named_modules():
        to_q = getattr(m, "to_q", None)
        if isinstance(to_q, nn.Linear):
            cross = bool(getattr(m, "is_cross_attention", False)) or name.endswith("attn2")
            flops += 4 * tokens * (TEXT_TOKENS if cross else tokens) * to_q.out_features
    return flops


def _block_compute(pipeline, placement: Placement, block_seconds, tokens: int, machine: Machine) -> tuple[dict[str, float], str]:
    from layerstream.plan.resolved import lookup

    paths = [p for c in placement.chains for p in c.block_paths] + [p for r in placement.residency.values() for p in r.resident_block_paths]
    if block_seconds is not None:
        if not block_seconds:
            raise MachinePlanError("the measurement timed no streamed block")
        typical = statistics.median(block_seconds.values())  # resident blocks are not in the trace: a DiT's blocks are alike
        return {p: block_seconds.get(p, typical) for p in paths}, "measured on the device: one step, median per block"
    rate = machine.device_tflops * 1e12
    compute = {p: block_flops(lookup(pipeline, p), tokens) / rate for p in paths}
    return compute, f"estimated: the blocks' FLOPs at {tokens} tokens and device_tflops {machine.device_tflops:g}"


def _per_step(
    plan, placement: Placement, streamed: Mapping[str, int], compute: Mapping[str, float], machine: Machine, steps: int,
) -> dict[str, float]:  # fmt: skip
    """Bytes and seconds of one denoising step: `forwards_per_step` forwards of the DiT that runs (of DiTs
    that alternate, the slower one; others run one after the other), and, spread over a generation of `steps`,
    the first forward of each alternating DiT, which reads its pooled blocks from disk (`_forward`)."""
    tier = placement.host_tier
    per_dit: dict[str, dict[str, float]] = {}
    entering: dict[str, dict[str, float]] = {}
    for comp in plan.streamed:
        if comp.category != "dit":
            continue
        blocks = [p for s in comp.stacks for p in s.block_paths]
        cast, decode = comp.storage_dtype not in (None, "lossless"), comp.storage_dtype == "lossless"
        per_dit[comp.path] = _forward(blocks, streamed, compute, machine, tier, cast=cast, decode=decode)
        if comp.alternates and tier is not None and any(tier.pooled(p) for p in blocks):
            entering[comp.path] = _forward(blocks, streamed, compute, machine, tier, cast=cast, decode=decode, pooled=True)
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


def _forward(
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
    disk_s = ideal.block_disk_seconds(sizes, on_disk, machine.disk_gbps)
    disk_stage_s = disk_s
    if machine.copy_and_read_share_a_core:  # one core reads, then copies: the link stage is its busy time
        link_s, disk_stage_s = [t + d for t, d in zip(link_s, disk_s)], [0.0] * len(disk_s)
    return {
        "seconds": ideal.ideal_forward_seconds_with_disk(compute_s, link_s, disk_stage_s),
        "link_bytes": sum(n for n, m in zip(sizes, moved) if m),
        "disk_bytes": sum(n for n, d in zip(sizes, on_disk) if d),
        "compute_s": sum(compute_s), "link_s": sum(link_s), "disk_s": sum(disk_s),
    }  # fmt: skip


def _decode_rate(machine: Machine) -> str:
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

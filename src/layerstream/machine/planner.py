"""A plan for a machine given by its figures: will the model run there, how, and how fast.

`plan_for_machine` picks the configuration `"auto"` settings would reach on that machine: the DiT streamed
with residency "auto" filling the device (its memory less the largest phase's transient: `machine.device_fit`),
the text encoder streamed too where keeping it resident would leave a phase no room, float8 storage only when
lossy storage is allowed, and the host budget `host_budget_gb: "auto"` would choose (`plan.host_budget`, from the
host memory minus the process's baseline). It places the blocks with the same placement as enabling, states
every phase's peak on the device and the host (`machine.phases`), and predicts the seconds per step with the
benchmarks' ideal (`machine.step_time`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from layerstream.config.offload_config import parse_offload_config
from layerstream.errors import LayerstreamError
from layerstream.host.reserve import HostReserve, host_reserve_for
from layerstream.machine.device_fit import DeviceFit, fit_device, recommended_config
from layerstream.machine.figures import (
    CUDA_CONTEXT_GB,
    DEVICE_DECODE_GBPS,
    PROCESS_BASELINE_GB,
    DeviceTooSmallError,
    Machine,
    MachinePlanError,
    check_machine,
)
from layerstream.machine.phases import PhasePeaks, host_phase_peaks
from layerstream.machine.step_time import block_compute, decode_rate, measured_block_seconds, step_seconds
from layerstream.models.generation_estimates import decode_steps, latent_tokens
from layerstream.plan.host_budget import STAGING_RING, HostBudgetChoice, choose_host_budget, host_needs
from layerstream.plan.placement import Placement
from layerstream.plan.resolved import OffloadPlanResolutionError
from layerstream.runtime.packing.lossless_code import priced_fraction
from layerstream.wording import GB, format_seconds

if TYPE_CHECKING:
    from layerstream.models.size import GenerationSize
    from layerstream.models.decode.vae_tiling import VaeDecodeChoice

__all__ = [
    "CUDA_CONTEXT_GB", "DEVICE_DECODE_GBPS", "PROCESS_BASELINE_GB", "DeviceTooSmallError", "Machine", "MachinePlan", "MachinePlanError",
    "check_machine",
    "measured_block_seconds", "plan_for_machine", "recommended_config",
]  # fmt: skip

Bound = Literal["compute", "link", "disk"]


@dataclass(frozen=True)
class MachinePlan:
    """The recommended configuration on a machine, what it puts where, and the predicted seconds per step."""

    machine: Machine
    config: Mapping[str, Any]
    """The `diffusion_offload_config` to paste (explicit figures: the same placement on any machine)."""
    placement: Placement
    host_budget: HostBudgetChoice
    device_nbytes: int
    """Device memory at the peak of the largest phase (`device_phases`)."""
    host_nbytes: int
    """Host memory of the whole process while it generates: baseline, host store (with the pool), staging ring and
    reserve (`host_phases` has the peak of enabling beside it)."""
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
    activation_reserve_gb: float = 0.0
    """Device memory residency "auto" left beside the weights kept there and the ring: the largest phase's
    transient and the allowance (`Machine.activation_reserve_gb` where given)."""
    host_reserve: HostReserve | None = None
    """Host memory kept for what a generation allocates beside the store, and how it was reached."""
    generation: GenerationSize | None = None
    """The generation planned for (size, frames, steps, tokens), each figure with where it came from."""
    device_phases: PhasePeaks | None = None
    """Each phase's peak on the device (prompt encoding, image encoding, denoising, VAE decode) from its parts."""
    host_phases: PhasePeaks | None = None
    """The host's peaks: loading and enabling, and generating (`host_nbytes`)."""
    text_encoder_link_nbytes: int = 0
    """Bytes a streamed text encoder moves over the link a generation (its blocks, once per prompt)."""
    decode: VaeDecodeChoice | None = None
    """The VAE decode's choice, tiled or not, and why (as a run with `vae_use_tiling` makes it); None: no VAE."""
    decode_seconds: float | None = None
    """The decode's work in steps (`decode_steps`: its traced FLOPs) at the step's compute seconds; None: no VAE."""

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
                "decode": self.decode.to_dict() if self.decode is not None else None,
                "predicted_decode_seconds": self.decode_seconds,
                "phases": {
                    "device": self.device_phases.to_dict() if self.device_phases is not None else None,
                    "host": self.host_phases.to_dict() if self.host_phases is not None else None,
                },
                "host_reserve": self.host_reserve.to_dict() if self.host_reserve is not None else None,
                "host_budget": self.host_budget.to_dict(),
                "placement": self.placement.to_dict(),
                "notes": list(self.notes),
            },
        }


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
    kwargs = {"generation": generation, "block_seconds": block_seconds}
    if lossless is not None:
        return _faster_text_encoder(pipeline, machine, lossless=lossless, **kwargs)
    plan = _faster_text_encoder(pipeline, machine, lossless=False, **kwargs)
    if machine.allow_lossy or plan.bound == "compute":
        return plan

    def coded_note(plan: MachinePlan, coded: MachinePlan) -> str:
        return (
            f"the DiT is stored lossless (about {priced_fraction().value:.2f}x the bytes, the same bits, decoded on the "
            f"device at {decode_rate(machine)}): {plan.bound}-bound, {format_seconds(plan.seconds_per_step)} per "
            f"step as it is, {format_seconds(coded.seconds_per_step)} coded"
        )

    # its slots (the decoded block beside the coded one) may leave some phase no room: then it is not planned
    return _if_faster(plan, lambda: _faster_text_encoder(pipeline, machine, lossless=True, **kwargs), coded_note)


def _faster_text_encoder(pipeline: Any, machine: Machine, **kwargs: Any) -> MachinePlan:
    """The plan with the text encoder resident where it fits, or streamed where the device memory that frees for
    resident DiT blocks saves more per step than streaming it costs (its blocks over the link for each prompt,
    once a generation, spread over its steps)."""
    plan = _plan_for_machine(pipeline, machine, **kwargs)
    if "text_encoder" in plan.config["components"]:
        return plan

    def streamed() -> MachinePlan | None:  # its blocks may not fit in the host's memory beside the DiT's
        try:
            return _plan_for_machine(pipeline, machine, text_encoder_streams=True, **kwargs)
        except OffloadPlanResolutionError:  # no text encoder to stream (a caller that passes prompt embeddings)
            return None

    def prompts_s(streaming: MachinePlan) -> float:
        return streaming.text_encoder_link_nbytes / (machine.link_gbps * GB)

    def note(plan: MachinePlan, streaming: MachinePlan) -> str:
        return (
            f"the text encoder streams: the device memory it frees keeps more DiT blocks resident, "
            f"{format_seconds(plan.seconds_per_step)} per step with it resident, {format_seconds(streaming.seconds_per_step)} "
            f"streamed, and its blocks cost {format_seconds(prompts_s(streaming))} over the link once a generation"
        )

    steps = plan.generation.num_inference_steps
    return _if_faster(plan, streamed, note, extra_s=lambda streaming: prompts_s(streaming) / steps)


def _if_faster(
    plan: MachinePlan, alternative: Callable[[], MachinePlan | None], note: Callable[[MachinePlan, MachinePlan], str],
    *, extra_s: Callable[[MachinePlan], float] = lambda _: 0.0,
) -> MachinePlan:  # fmt: skip
    """`plan`, or the `alternative` where it can be planned (not None, no `MachinePlanError`) and predicts a faster
    step, `extra_s` of its own per step added, with the note that says why."""
    try:
        other = alternative()
    except MachinePlanError:
        return plan
    if other is None or other.seconds_per_step + extra_s(other) >= plan.seconds_per_step:
        return plan
    return dataclasses.replace(other, notes=other.notes + (note(plan, other),))


def _plan_for_machine(
    pipeline: Any,
    machine: Machine,
    *,
    generation: GenerationSize,
    block_seconds: Mapping[str, float] | None = None,
    lossless: bool = False,
    text_encoder_streams: bool = False,
) -> MachinePlan:
    """The plan (see the module docstring) for `generation` (`plan_for_machine`); `block_seconds` (block path ->
    seconds, from `measured_block_seconds`) replaces the FLOPs estimate; `text_encoder_streams` streams the text
    encoder whether or not it would fit resident. Raises `MachinePlanError` where it cannot run: naming the phase
    that bounds the device (`DeviceTooSmallError`), or the host figure."""
    from layerstream.offload import plan_placement  # the composition root prices the stores
    from layerstream.plan.resolver import resolve_offload_plan

    check_machine(machine)
    if generation.num_inference_steps is None:
        raise MachinePlanError("num_inference_steps = None is not valid; expected the steps planned for (`planned_generation`)")
    if block_seconds is not None and not block_seconds:
        raise MachinePlanError("the measurement timed no streamed block")
    tokens = latent_tokens(pipeline, generation.as_size()) if generation.tokens is None else generation.tokens
    fit, notes = fit_device(pipeline, machine, generation, lossless=lossless, text_encoder_streams=text_encoder_streams)
    host = _host_plan(pipeline, machine, fit, dataclasses.replace(generation, tokens=tokens))
    config = recommended_config(
        machine, text_encoder=fit.text_encoder_streams, host_budget_gb=host.budget_gb,
        activation_reserve_gb=fit.reserve_nbytes / GB, lossless=lossless,
    )  # fmt: skip
    plan = resolve_offload_plan(pipeline, parse_offload_config(config))
    placement = plan_placement(pipeline, plan, torch.device("cpu"))  # layouts are priced here; their bytes do not depend on the device
    streamed = {p: fit.block_host_nbytes[p] for p in placement.streamed_block_paths}
    compute, source = block_compute(pipeline, placement, block_seconds, tokens, machine)
    per_step = step_seconds(plan, placement, streamed, compute, machine, generation.num_inference_steps)
    tier = placement.host_tier
    host_phases = _host_phases(machine, fit, placement, host)
    return MachinePlan(
        machine, config, placement, host.choice, fit.phases.peak.nbytes, host_phases.phase("generating").nbytes,
        sum(streamed[p] for p in tier.from_disk_paths) if tier is not None else 0,
        per_step["link_bytes"], per_step["disk_bytes"], per_step["seconds"],
        {k: per_step[k + "_s"] for k in ("compute", "link", "disk")}, source, tokens, notes,
        activation_reserve_gb=fit.reserve_nbytes / GB, host_reserve=host.reserve, generation=generation,
        device_phases=fit.phases, host_phases=host_phases, text_encoder_link_nbytes=_text_encoder_link_nbytes(plan, placement, machine),
        decode=fit.decode_choice, decode_seconds=_decode_seconds(pipeline, generation, machine, per_step["compute_s"]),
    )  # fmt: skip


def _decode_seconds(pipeline: Any, generation: GenerationSize, machine: Machine, compute_s: float) -> float | None:
    steps = decode_steps(pipeline, generation.as_size(), machine.forwards_per_step)
    return None if steps is None else steps * compute_s


def _text_encoder_link_nbytes(plan, placement: Placement, machine: Machine) -> int:
    """A streamed text encoder's blocks, once for each of the step's forwards' prompts (with classifier-free
    guidance the prompt and the negative one)."""
    encoders = {c.path for c in plan.streamed if c.category == "text_encoder"}
    streamed = sum(placement.block_slot_nbytes[p] for c in placement.chains if c.component in encoders for p in c.block_paths)
    return machine.forwards_per_step * streamed


@dataclass(frozen=True)
class _HostPlan:
    choice: HostBudgetChoice
    budget_gb: float | None
    """The host budget to paste (rounded down), None: every streamed block fits (no disk tier)."""
    reserve: HostReserve
    needs: Mapping[str, int]
    """What runs beside the host store (`plan.host_budget.host_needs`), the reserve among them."""


def _host_plan(pipeline: Any, machine: Machine, fit: DeviceFit, generation: GenerationSize) -> _HostPlan:
    """The host budget `"auto"` chooses beside what runs with the host store (`plan.host_budget`)."""
    from layerstream.runtime.stores.disk.staging import NUM_STAGING_BUFFERS

    placement = fit.placement
    streamed = {p: fit.block_host_nbytes[p] for p in placement.streamed_block_paths}
    reserve = host_reserve_for(pipeline, fit.plan, machine.host_reserve_gb, device_is_host=False, generation=generation)
    needs = host_needs(
        fit.plan, placement, device_is_host=False, reserve_nbytes=reserve.nbytes,
        num_staging_buffers=NUM_STAGING_BUFFERS, block_host_nbytes=fit.block_host_nbytes, reserve_name=reserve.need_name,
    )  # fmt: skip
    free = round((machine.host_memory_gb - machine.baseline_gb) * GB)
    try:
        choice = choose_host_budget(
            free_nbytes=free, free_source=f"host_memory_gb {machine.host_memory_gb:g} - baseline {machine.baseline_gb:g} GB",
            streamed_nbytes=sum(streamed.values()), needs=needs, reserve_reason=reserve.describe() if reserve.parts else "",
        )  # fmt: skip
    except LayerstreamError as e:
        raise MachinePlanError(f"host_memory_gb = {machine.host_memory_gb:g}: {e}") from e
    budget_gb = None if choice.budget_gb is None else _round_down(choice.budget_gb)
    return _HostPlan(choice, budget_gb, reserve, needs)


def _host_phases(machine: Machine, fit: DeviceFit, placement: Placement, host: _HostPlan) -> PhasePeaks:
    """The host's peaks with the blocks placed as the config to paste places them: enabling (the store filled,
    with what enabling holds until it commits) and generating (with the reserve)."""
    tier = placement.host_tier
    stored = tier.host_nbytes if tier is not None else sum(fit.block_host_nbytes[p] for p in placement.streamed_block_paths)
    beside = {k: n for k, n in host.needs.items() if k != host.reserve.need_name and (k != STAGING_RING or tier is not None)}
    return host_phase_peaks(
        memory_nbytes=round(machine.host_memory_gb * GB), baseline_nbytes=round(machine.baseline_gb * GB),
        kept={"host store": stored, **beside}, enabling=_enabling_transient(fit),
        generating={host.reserve.need_name: host.reserve.nbytes},
    )  # fmt: skip


def _enabling_transient(fit: DeviceFit) -> dict[str, int]:
    """What enabling holds beside the filled store: the block being packed (its bytes read from the checkpoint,
    and coded or cast where the DiT is stored in another form). The blocks' own tensors a stored form keeps until
    enabling commits (an exact rollback) are views of the checkpoint's files, as loading leaves every weight kept
    in the dtype its checkpoint stores: page cache, which the kernel reclaims (`benchmarks/plan_in_cgroup.py`
    measured the lossless form's enabling within the store, the rings and one block)."""
    streamed = set(fit.placement.streamed_block_paths)
    largest = max((n for c in fit.plan.streamed for s in c.stacks for p, n in zip(s.block_paths, s.block_bytes) if p in streamed), default=0)
    return {"the block being packed": largest}


def _round_down(gb: float, digits: int = 4) -> float:
    """`gb` to `digits` significant digits, rounded down (a budget pasted back must still fit)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(gb)))
    return math.floor(gb * scale) / scale

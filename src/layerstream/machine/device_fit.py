"""Fitting a generation's phases on a machine's device: the config `"auto"` settings reach there, and, where no
config fits, the refusal that names the phase that bounds, its parts and what would make it fit.

Residency "auto" leaves the largest phase's transient free beside the weights kept on the device and the slot
ring (`models.generation_estimates.activation_reserve_nbytes`), so every phase fits once the weights and the ring do. The candidates
are tried from the one that changes least: the text encoder resident, then streamed (it runs once a generation:
its blocks cost a prompt encoding's transfers, not a step's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from layerstream.config.offload_config import parse_offload_config
from layerstream.machine.figures import Machine, MachinePlanError
from layerstream.machine.phases import PhasePeaks, device_phase_peaks
from layerstream.models.generation_estimates import Transient, activation_reserve_nbytes, phase_transients
from layerstream.plan.phase_blocks import phase_blocks
from layerstream.plan.placement import Placement
from layerstream.plan.resolved import ResolvedOffloadPlan
from layerstream.wording import GB, format_gb

if TYPE_CHECKING:
    from layerstream.models.generation_size import GenerationSize


@dataclass(frozen=True)
class DeviceFit:
    """One candidate config on the device: its plan (no host budget yet), placement and each phase's peak."""

    text_encoder_streams: bool
    reserve_nbytes: int
    """What residency "auto" leaves free: the largest transient and the allowance, or the machine's given reserve."""
    plan: ResolvedOffloadPlan
    placement: Placement
    block_host_nbytes: Mapping[str, int]
    phases: PhasePeaks


def recommended_config(
    machine: Machine, *, text_encoder: bool, host_budget_gb: float | None, activation_reserve_gb: float, lossless: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """The config `"auto"` settings would reach on `machine`, with its figures written out: the device budget of
    residency "auto" is the device memory less `activation_reserve_gb` (none left: 0, no block resident)."""
    device_budget = max(machine.device_memory_gb - activation_reserve_gb, 0.0)
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


def generation_transients(pipeline: Any, generation: GenerationSize) -> tuple[Transient, ...]:
    """Each phase's transient for `pipeline` at `generation` (`models.generation_estimates.phase_transients` on
    the blocks `plan.phase_blocks` finds)."""
    return phase_transients(pipeline, generation, phase_blocks(pipeline))


def fit_device(
    pipeline: Any, machine: Machine, generation: GenerationSize, *, lossless: bool,
) -> tuple[DeviceFit, tuple[str, ...]]:  # fmt: skip
    """The first candidate whose phases all fit the device at `generation`, and the notes that say what was chosen
    and why. Raises `MachinePlanError` naming the phase that bounds where none fits (`refusal`)."""
    transients = generation_transients(pipeline, generation)
    resident = _candidate(pipeline, machine, transients, text_encoder=False, lossless=lossless)
    if resident.phases.fits:
        return resident, ()
    if not any(c.category == "text_encoder" and c.stacks for c in resident.plan.components):
        raise MachinePlanError(refusal(pipeline, machine, resident, generation))  # no text encoder to stream
    streamed = _candidate(pipeline, machine, transients, text_encoder=True, lossless=lossless)
    if streamed.phases.fits:
        return streamed, (_why_streamed(resident),)
    raise MachinePlanError(refusal(pipeline, machine, streamed, generation))


def _candidate(pipeline, machine: Machine, transients, *, text_encoder: bool, lossless: bool) -> DeviceFit:
    from layerstream.offload import priced_placement  # the composition root prices the stores
    from layerstream.plan.resolver import resolve_offload_plan
    import torch

    allowance = round(machine.device_allowance_gb * GB)
    if machine.activation_reserve_gb is not None:
        reserve = round(machine.activation_reserve_gb * GB)
    else:
        reserve = activation_reserve_nbytes(transients, allowance)
    config = recommended_config(machine, text_encoder=text_encoder, host_budget_gb=None, activation_reserve_gb=reserve / GB, lossless=lossless)
    plan = resolve_offload_plan(pipeline, parse_offload_config(config))
    placement, host_nbytes = priced_placement(pipeline, plan, torch.device("cpu"))  # bytes do not depend on the device
    memory = round(machine.device_memory_gb * GB)
    phases = device_phase_peaks(plan, placement, transients, memory_nbytes=memory, allowance_nbytes=allowance)
    return DeviceFit(text_encoder, reserve, plan, placement, host_nbytes, phases)


def _why_streamed(resident: DeviceFit) -> str:
    peak = resident.phases.peak
    return (
        f"the text encoder streams: kept resident, {peak.phase} would need {format_gb(peak.nbytes)}, more than the "
        f"device's {format_gb(resident.phases.memory_nbytes)}"
    )


def refusal(pipeline: Any, machine: Machine, fit: DeviceFit, generation: GenerationSize) -> str:
    """Why `fit` (the last candidate) does not fit the device: the phase that bounds, its parts, and what would
    make it fit (a smaller generation that fits, or the device it needs)."""
    peak = fit.phases.peak
    streamed = ", with the text encoder streamed" if fit.text_encoder_streams else ""
    resident = sum(len(r.resident_block_paths) for r in fit.placement.residency.values())
    blocks = "" if resident else " and no block resident"
    message = (
        f"device_memory_gb = {machine.device_memory_gb:g}: {peak.describe()} is more than the device's "
        f"{format_gb(fit.phases.memory_nbytes)}{streamed}{blocks}"
    )
    return message + "; " + _what_would_fit(pipeline, fit, generation)


def _what_would_fit(pipeline: Any, fit: DeviceFit, generation: GenerationSize) -> str:
    """A smaller generation whose phases fit beside the same weights and ring, or the device memory it needs."""
    peak = fit.phases.peak
    kept = sum(n for name, n in peak.parts.items() if name != _transient_name(peak))
    needs = f"a device of {format_gb(peak.nbytes)} runs it"
    if kept >= fit.phases.memory_nbytes:
        return f"the weights kept on the device, the slot ring and the allowance alone need {format_gb(kept)}: {needs}"
    for smaller in _smaller_generations(pipeline, generation):
        largest = max(t.nbytes for t in generation_transients(pipeline, smaller))
        if kept + largest <= fit.phases.memory_nbytes:
            return f"it fits at {size_phrase(smaller)} ({format_gb(kept + largest)} at its peak), or {needs}"
    return needs


def _transient_name(peak) -> str:
    return list(peak.parts)[-1]  # the phase's own transient is its last part (`device_phase_peaks`)


def size_phrase(generation: GenerationSize) -> str:
    frames = f" x {generation.num_frames} frames" if generation.num_frames > 1 else ""
    return f"{generation.height}x{generation.width}{frames}"


def _smaller_generations(pipeline: Any, generation: GenerationSize) -> list[GenerationSize]:
    """Smaller generations of the same shape, largest first: each side at 3/4 and 1/2 (whole size multiples),
    and a video's frames halved (whole frame rule); none where the planned one gives its tokens, not a size."""
    from layerstream.models.geometry import pipeline_frame_multiple, pipeline_size_multiple

    if generation.tokens is not None:
        return []
    multiple, temporal = pipeline_size_multiple(pipeline), pipeline_frame_multiple(pipeline) or 1
    frames = [generation.num_frames]
    if generation.num_frames > 1:
        frames.append(max(1, (generation.num_frames - 1) // 2 // temporal * temporal + 1))
    out = []
    for scale in (1.0, 0.75, 0.5):
        height = max(multiple, int(generation.height * scale) // multiple * multiple)
        width = max(multiple, int(generation.width * scale) // multiple * multiple)
        for f in frames:
            if (height, width, f) != (generation.height, generation.width, generation.num_frames):
                out.append(replace(generation, height=height, width=width, num_frames=f, tokens=None))
    return sorted(out, key=lambda g: -g.height * g.width * g.num_frames)
